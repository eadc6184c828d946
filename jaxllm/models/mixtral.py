"""Mixtral: Mistral's attention, 8 experts per layer, each token's top 2 weighted by a softmax
over those two."""
from __future__ import annotations

from jaxllm.models.arch import ArchConfig
from jaxllm.models.base import WeightMap
from jaxllm.models.llama import _GGUF_WHOLE, _HF_WHOLE
from jaxllm.models.moe import MoeForCausalLM, moe_arch, moe_gguf_layer, moe_layer


class MixtralForCausalLM(MoeForCausalLM):
    HF_WEIGHTS = WeightMap(r"model\.layers\.(\d+)\.(.+)",
                           moe_layer("block_sparse_moe.gate.weight", "block_sparse_moe.experts.*.w1.weight",
                                     "block_sparse_moe.experts.*.w3.weight",
                                     "block_sparse_moe.experts.*.w2.weight"), _HF_WHOLE)
    # llama.cpp writes Mixtral as "llama" with experts (and Llama's permuted q/k rows)
    GGUF_WEIGHTS = WeightMap(r"blk\.(\d+)\.(.+)", moe_gguf_layer(unpermute=True), _GGUF_WHOLE)
    GGUF_ARCHITECTURES = ("llama",)

    @classmethod
    def arch_from_hf(cls, cfg: dict) -> ArchConfig:
        return moe_arch(cfg, "num_local_experts", normalize=True)
