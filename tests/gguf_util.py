"""Writing tiny HF checkpoints as GGUF files with the `gguf` package, the way llama.cpp's
converter lays them out (q/k rows permuted for its rotary layout, dims inner-first, Llama 3.1
RoPE scaling as a `rope_freqs` tensor of per-frequency divisors). Written independently of
jaxllm's loader so that the loader is checked against the format, not against itself."""
import math

import gguf
import numpy as np

_LAYER = {"input_layernorm.weight": "attn_norm.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama3_rope_factors(config) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama 3.1 scaling: a divisor per rotary frequency."""
    rs = config.rope_parameters if getattr(config, "rope_parameters", None) else config.rope_scaling
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base = rs.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def copy_tokenizer_metadata(writer: gguf.GGUFWriter, source_gguf: str) -> None:
    """The tokenizer fields of another GGUF file (the default model's: a 49152-token BPE)."""
    r = gguf.GGUFReader(source_gguf)
    f = {k: v.contents() for k, v in r.fields.items() if k.startswith("tokenizer.")}
    writer.add_tokenizer_model(f["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(f["tokenizer.ggml.pre"])
    writer.add_token_list(f["tokenizer.ggml.tokens"])
    writer.add_token_types(f["tokenizer.ggml.token_type"])
    writer.add_token_merges(f["tokenizer.ggml.merges"])
    writer.add_bos_token_id(f["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(f["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(f["tokenizer.ggml.add_bos_token"])
    writer.add_chat_template(f["tokenizer.chat_template"])


# mixture-of-experts families: llama.cpp's architecture, whether its converter permutes q/k
# (Mixtral is "llama" with experts; Qwen3-MoE and OLMoE rotate halves, as HF does), and where
# HF keeps the router and the experts' projections (gate, up, down)
_MOE = {"MixtralForCausalLM": ("llama", True, "block_sparse_moe", ("w1", "w3", "w2")),
        "Qwen3MoeForCausalLM": ("qwen3moe", False, "mlp", ("gate_proj", "up_proj", "down_proj")),
        "OlmoeForCausalLM": ("olmoe", False, "mlp", ("gate_proj", "up_proj", "down_proj"))}


def write_gguf(model, path: str, tokenizer_from: str | None = None,
               qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
               checkpoint: str | None = None) -> None:
    """An HF Llama-family (or Mixtral, Qwen3-MoE, OLMoE) torch model as a GGUF file; matrices
    stored as `qtype`, the experts' stacks [experts, out, in] merged per layer in F32 (as
    llama.cpp's converter merges them). `checkpoint`: the directory the model was saved to,
    whose per-expert tensors the converter reads (transformers fuses them in memory)."""
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    arch_name, permute, moe_prefix, moe_names = _MOE.get(cfg.architectures[0] if cfg.architectures
                                                         else type(model).__name__, ("llama", True, None, None))
    w = gguf.GGUFWriter(path, arch_name)
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w.add_rope_dimension_count(head_dim)
    rs = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    w.add_rope_freq_base(float(rs.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(int(qtype))
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if moe_prefix:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch_name == "qwen3moe":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "clip_qkv", None) is not None:
            w.add_clamp_kqv(cfg.clip_qkv)
    if tokenizer_from:
        copy_tokenizer_metadata(w, tokenizer_from)
    if rs.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))

    def put(name, arr):
        arr = np.ascontiguousarray(arr, np.float32)
        if arr.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            # the writer takes the quantized bytes' shape and works out the tensor's from it
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)

    if checkpoint is not None:
        from safetensors.numpy import load_file
        sd = {k: v.astype(np.float32) for k, v in load_file(f"{checkpoint}/model.safetensors").items()}
    else:
        sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    put("token_embd.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd and not cfg.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, ours in _LAYER.items():
            t = sd.get(f"model.layers.{i}.{hf}")
            if t is None:
                continue
            if permute and hf.startswith("self_attn.q_proj"):
                t = llama_cpp_permute(t, heads)
            elif permute and hf.startswith("self_attn.k_proj"):
                t = llama_cpp_permute(t, kv_heads)
            put(f"blk.{i}.{ours}", t)
        if moe_prefix:
            layer = f"model.layers.{i}.{moe_prefix}"
            for norm in ("q", "k"):
                if f"model.layers.{i}.self_attn.{norm}_norm.weight" in sd:
                    put(f"blk.{i}.attn_{norm}_norm.weight", sd[f"model.layers.{i}.self_attn.{norm}_norm.weight"])
            put(f"blk.{i}.ffn_gate_inp.weight", sd[f"{layer}.gate.weight"])
            for hf, ours in zip(moe_names, ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
                w.add_tensor(f"blk.{i}.{ours}.weight", np.stack(
                    [sd[f"{layer}.experts.{e}.{hf}.weight"] for e in range(experts)]).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
