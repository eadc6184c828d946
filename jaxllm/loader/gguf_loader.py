"""GGUF files (llama architecture), dequantized with the `gguf` package."""
from __future__ import annotations

import re

import numpy as np

from jaxllm.loader.hf import StackedWeights
from jaxllm.models.arch import ArchConfig

_LAYER = {
    "attn_norm.weight": ("input_norm", False),
    "ffn_norm.weight": ("post_norm", False),
    "attn_q.weight": ("wq", True),
    "attn_k.weight": ("wk", True),
    "attn_v.weight": ("wv", True),
    "attn_output.weight": ("wo", True),
    "ffn_gate.weight": ("w_gate", True),
    "ffn_up.weight": ("w_up", True),
    "ffn_down.weight": ("w_down", True),
    "attn_q.bias": ("bq", False),
    "attn_k.bias": ("bk", False),
    "attn_v.bias": ("bv", False),
    "attn_output.bias": ("bo", False),
    "ffn_gate.bias": ("b_gate", False),
    "ffn_up.bias": ("b_up", False),
    "ffn_down.bias": ("b_down", False),
}
_GLOBAL = {
    "token_embd.weight": ("embed_tokens", False),
    "output_norm.weight": ("norm", False),
    "output.weight": ("lm_head", True),
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _rope_scaling(reader, p: str) -> dict | None:
    """llama.cpp keeps Llama-3.1-style scaling as per-frequency divisors in a `rope_freqs`
    tensor; linear scaling as metadata."""
    from gguf.quants import dequantize
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        factors = dequantize(freqs.data, freqs.tensor_type).astype(np.float32).reshape(-1)
        return {"rope_type": "freq_factors", "factors": factors.tolist()}
    kind = _field(reader, p + "rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_field(reader, p + "rope.scaling.factor"))}
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported; supported: linear, "
                     "Llama 3 frequency factors")


def gguf_arch_config(reader) -> ArchConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: llama")
    p = "llama."
    heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    biases = {m.group(2) for n in names if (m := _LAYER_RE.fullmatch(n)) and n.endswith(".bias")}
    return ArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, p + "feed_forward_length")),
        num_layers=int(_field(reader, p + "block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, p + "attention.head_count_kv", heads)),
        head_dim=int(_field(reader, p + "rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, p),
        qkv_bias="attn_q.bias" in biases,
        o_bias="attn_output.bias" in biases,
        mlp_bias="ffn_down.bias" in biases,
        max_position_embeddings=int(_field(reader, p + "context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp interleaves the rotary halves of q and k rows; undo it for rotate-half RoPE.
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_weights(reader, cfg: ArchConfig, shapes: dict, dtype) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    out = StackedWeights(shapes, dtype)
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # read into the architecture's rope scaling
        if t.name in _GLOBAL:
            name, transpose = _GLOBAL[t.name]
            layer = None
        else:
            m = _LAYER_RE.fullmatch(t.name)
            if not m or m.group(2) not in _LAYER:
                raise ValueError(f"GGUF tensor {t.name} is not used by this model (unsupported "
                                 "architecture variant?)")
            name, transpose = _LAYER[m.group(2)]
            name, layer = "layers." + name, int(m.group(1))
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims inner-first
        if name in ("layers.wq", "layers.bq"):
            w = _unpermute(w, cfg.num_heads)
        elif name in ("layers.wk", "layers.bk"):
            w = _unpermute(w, cfg.num_kv_heads)
        out.put(name, layer, w, t.name, transpose)
    return out.finish()
