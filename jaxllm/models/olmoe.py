"""OLMoE: q and k normed over all their heads at once, q/k/v optionally clipped, 64 experts
with the top 8's softmax weights used as they are (norm_topk_prob off by default)."""
from __future__ import annotations

from jaxllm.models.arch import ArchConfig
from jaxllm.models.base import WeightMap
from jaxllm.models.llama import _GGUF_WHOLE, _HF_WHOLE
from jaxllm.models.moe import MoeForCausalLM, moe_arch, moe_gguf_layer
from jaxllm.models.qwen3_moe import QWEN_MOE_LAYER


class OlmoeForCausalLM(MoeForCausalLM):
    HF_WEIGHTS = WeightMap(r"model\.layers\.(\d+)\.(.+)", QWEN_MOE_LAYER, _HF_WHOLE)
    GGUF_WEIGHTS = WeightMap(r"blk\.(\d+)\.(.+)", moe_gguf_layer(unpermute=False), _GGUF_WHOLE)
    GGUF_ARCHITECTURES = ("olmoe",)

    @classmethod
    def arch_from_gguf(cls, arch: ArchConfig, field) -> ArchConfig:
        arch.qk_norm = arch.qk_norm_all_heads = True
        arch.norm_topk_prob = bool(field("expert_weights_norm", False))
        clip = field("attention.clamp_kqv")
        arch.clip_qkv = None if clip is None else float(clip)
        return arch

    @classmethod
    def arch_from_hf(cls, cfg: dict) -> ArchConfig:
        clip = cfg.get("clip_qkv")
        return moe_arch(cfg, "num_experts", normalize=bool(cfg.get("norm_topk_prob", False)),
                        qk_norm=True, qk_norm_all_heads=True,
                        clip_qkv=None if clip is None else float(clip))
