"""Phi-3 (and Phi-4-mini, which shares its architecture): the Llama computation with q/k/v
and gate/up fused in the checkpoint itself, RoPE over a part of head_dim, and LongRoPE.

LongRoPE has two sets of frequency factors: short ones for sequences within the original
pre-training context and long ones beyond it. HF switches the whole sequence to the long
factors once it grows past that context, which rotates the keys already in a KV cache
differently from how they were written; a paged cache cannot follow that. The model is
therefore served within its original context with the short factors (and LongRoPE's
attention factor, as HF applies it), and a longer max_model_len is refused.
"""
from __future__ import annotations

import math

from jaxllm.models.arch import ArchConfig
from jaxllm.models.base import WeightMap
from jaxllm.models.llama import _HF_WHOLE, LlamaForCausalLM, _hf_layer


class Phi3ForCausalLM(LlamaForCausalLM):
    HF_WEIGHTS = WeightMap(r"model\.layers\.(\d+)\.(.+)", _hf_layer(fused_in_checkpoint=True), _HF_WHOLE)
    GGUF_ARCHITECTURES = ()  # llama.cpp's phi3 files keep LongRoPE factors as tensors: not read yet

    @classmethod
    def arch_from_hf(cls, cfg: dict) -> ArchConfig:
        arch = ArchConfig.from_hf(cfg)
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        if partial != 1.0:
            arch.rotary_dim = int(arch.head_dim * partial)
            if arch.rotary_dim % 2:
                raise ValueError(f"partial_rotary_factor {partial} gives an odd rotary dimension")
        scaling = arch.rope_scaling
        if scaling is None:
            return arch
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("longrope", "su"):
            raise ValueError(f"{arch.architecture}: rope scaling {kind!r} is not supported; "
                             "supported: longrope")
        original = int(scaling.get("original_max_position_embeddings")
                       or cfg.get("original_max_position_embeddings") or arch.max_position_embeddings)
        factor = scaling.get("factor") or arch.max_position_embeddings / original
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        arch.rope_scaling = {"rope_type": "longrope", "short_factor": list(scaling["short_factor"]),
                             "attention_factor": float(attention_factor)}
        # within the original context only (see the module's docstring)
        arch.max_position_embeddings = min(arch.max_position_embeddings, original)
        return arch
