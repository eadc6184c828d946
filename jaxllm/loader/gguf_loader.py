"""GGUF files, dequantized with the `gguf` package; which tensor goes where is the model
class's GGUF_WEIGHTS."""
from __future__ import annotations

import re

import numpy as np
from tqdm.auto import tqdm

from jaxllm.loader.hf import StackedWeights
from jaxllm.models.arch import ArchConfig

_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")

def open_gguf(path: str):
    """A gguf.GGUFReader over `path`, reading its header through a plain array view of the
    file's mapping. The reader slices the mapping once or twice per value, and a vocabulary
    has a value per token: slicing np.memmap itself pays its bookkeeping every time, which
    dominates reading the header. The values and tensors are the same."""
    import gguf

    class _Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            dt, count = np.dtype(dtype), int(count)
            arr = plain[offset:offset + dt.itemsize * count].view(dt)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None
                                                   else override_order))
    return _Reader(path)


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


def gguf_arch_config(reader, cls) -> ArchConfig:
    """llama.cpp's metadata keys, prefixed by its architecture name; `cls` the model class."""
    arch = _field(reader, "general.architecture")
    p = arch + "."
    heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    biases = {m.group(2) for n in names if (m := _LAYER_RE.fullmatch(n)) and n.endswith(".bias")}
    out = ArchConfig(
        architecture=cls.__name__,
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
    experts = _field(reader, p + "expert_count")
    if experts:
        out.num_experts = int(experts)
        out.num_experts_per_tok = int(_field(reader, p + "expert_used_count", 0))
        out.intermediate_size = int(_field(reader, p + "expert_feed_forward_length", out.intermediate_size))
    # the family's own reading: its norms, its routing (llama.cpp keeps some in its code)
    out = cls.arch_from_gguf(out, lambda key, default=None: _field(reader, p + key, default))
    out.__post_init__()
    return out


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp interleaves the rotary halves of q and k rows; undo it for rotate-half RoPE.
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def is_quantized(reader) -> bool:
    """Whether any matrix of the file is stored in a quantized GGML type."""
    import gguf
    floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
              gguf.GGMLQuantizationType.BF16)
    return any(t.tensor_type not in floats for t in reader.tensors)


def load_gguf_weights(reader, cfg: ArchConfig, cls, out: StackedWeights,
                      keep_quantized: bool = True) -> dict:
    """The file's tensors into `out`; quantized matrices stay quantized (our int4/int8
    layouts, jaxllm.quantization.formats.from_gguf) unless keep_quantized is False."""
    from gguf.quants import dequantize

    from jaxllm.quantization.formats import HostQuant, from_gguf

    heads = {"q": cfg.num_heads, "k": cfg.num_kv_heads}
    for t in tqdm(reader.tensors, desc="reading weights", unit="tensor"):
        if t.name == "rope_freqs.weight":
            continue  # read into the architecture's rope scaling
        found = cls.GGUF_WEIGHTS.lookup(t.name)
        if found is None:
            continue
        target, layer = found
        shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dims inner-first
        w = from_gguf(t.data, t.tensor_type, tuple(shape)) if keep_quantized and len(shape) == 2 else None
        if w is None:
            w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        if target.unpermute:
            n = heads[target.unpermute]
            if isinstance(w, HostQuant):  # the same row order for codes, scales and offsets
                perm = _unpermute(np.arange(w.out_features), n)
                w = HostQuant(w.kind, w.q[perm], w.scale[perm], None if w.offset is None else w.offset[perm])
            else:
                w = _unpermute(w, n)
        out.put(target, layer, w, t.name)
    return out.finish()
