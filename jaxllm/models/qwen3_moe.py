"""Qwen3-MoE: Qwen3's attention (q and k normed per head), many small experts, the top k
renormalised when the config says norm_topk_prob. Checkpoints that mix dense and MoE layers
(mlp_only_layers, decoder_sparse_step) are refused."""
from __future__ import annotations

from jaxllm.models.arch import ArchConfig
from jaxllm.models.base import WeightMap
from jaxllm.models.llama import _GGUF_WHOLE, _HF_WHOLE
from jaxllm.models.moe import MoeForCausalLM, moe_arch, moe_gguf_layer, moe_layer

QWEN_MOE_LAYER = moe_layer("mlp.gate.weight", "mlp.experts.*.gate_proj.weight",
                           "mlp.experts.*.up_proj.weight", "mlp.experts.*.down_proj.weight")


class Qwen3MoeForCausalLM(MoeForCausalLM):
    HF_WEIGHTS = WeightMap(r"model\.layers\.(\d+)\.(.+)", QWEN_MOE_LAYER, _HF_WHOLE)
    GGUF_WEIGHTS = WeightMap(r"blk\.(\d+)\.(.+)", moe_gguf_layer(unpermute=False), _GGUF_WHOLE)
    GGUF_ARCHITECTURES = ("qwen3moe",)

    @classmethod
    def arch_from_gguf(cls, arch: ArchConfig, field) -> ArchConfig:
        # llama.cpp renormalises Qwen3-MoE's top k unless the file says otherwise
        arch.qk_norm, arch.norm_topk_prob = True, bool(field("expert_weights_norm", True))
        return arch

    @classmethod
    def arch_from_hf(cls, cfg: dict) -> ArchConfig:
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ValueError("Qwen3MoeForCausalLM: dense MLP layers among the MoE ones (mlp_only_layers "
                             f"{cfg.get('mlp_only_layers')}, decoder_sparse_step "
                             f"{cfg.get('decoder_sparse_step')}) are not supported")
        return moe_arch(cfg, "num_experts", normalize=bool(cfg.get("norm_topk_prob", False)), qk_norm=True)
