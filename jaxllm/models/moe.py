"""What the mixture-of-experts families share: the Llama-style attention, and in place of its
MLP a router and experts (layers/moe.py runs them). Each expert projection is one stack
[layers, experts, in, out]; a family declares where its checkpoint keeps the router and the
experts, and how its config names their sizes.

Expert weights are float or quantized at load (online methods); quantized MoE checkpoints are
refused by the loader, and a GGUF file's expert tensors load dequantized. LoRA adapts the
attention's projections only (PROJECTION_SITES)."""
from __future__ import annotations

from dataclasses import replace

import jax.numpy as jnp
import numpy as np

from jaxllm.layers.linear import linear
from jaxllm.layers.moe import ExpertStack, moe_block, moe_dense
from jaxllm.models.arch import ArchConfig
from jaxllm.models.base import Target
from jaxllm.models.llama import _GGUF_LAYER, LlamaForCausalLM, _hf_layer, device_major
from jaxllm.parallel import platform_of
from jaxllm.params import ParamSpec

EXPERT_PARAMS = ("experts_gate_up", "experts_down")


def moe_layer(router: str, gate: str, up: str, down: str) -> dict[str, Target]:
    """A family's per-layer checkpoint names: the Llama attention's, and the router's and the
    experts' ("*" stands for the expert's index)."""
    table = {k: v for k, v in _hf_layer(fused_in_checkpoint=False).items() if not k.startswith("mlp.")}
    return table | {router: Target("router", True),
                    gate: Target("experts_gate_up", True, "gate"),
                    up: Target("experts_gate_up", True, "up"),
                    down: Target("experts_down", True)}


def moe_gguf_layer(unpermute: bool) -> dict[str, Target]:
    """llama.cpp's per-layer names: the Llama attention's (q/k rows permuted by its converter
    only for its "llama" architecture), q/k norms, the router, and each projection of every
    expert in one tensor."""
    table = {k: v if unpermute else replace(v, unpermute=None) for k, v in _GGUF_LAYER.items()
             if k.startswith("attn_") or k == "ffn_norm.weight"}
    return table | {"attn_q_norm.weight": Target("q_norm"), "attn_k_norm.weight": Target("k_norm"),
                    "ffn_gate_inp.weight": Target("router", True),
                    "ffn_gate_exps.weight": Target("experts_gate_up", True, "gate", all_experts=True),
                    "ffn_up_exps.weight": Target("experts_gate_up", True, "up", all_experts=True),
                    "ffn_down_exps.weight": Target("experts_down", True, all_experts=True)}


def moe_arch(cfg: dict, experts_key: str, normalize: bool, **over) -> ArchConfig:
    """ArchConfig.from_hf with the experts' sizes: intermediate_size becomes each expert's."""
    arch = ArchConfig.from_hf({**cfg, "intermediate_size": cfg.get("moe_intermediate_size")
                               or cfg["intermediate_size"]})
    num = cfg.get(experts_key) or cfg.get("num_local_experts") or cfg.get("num_experts")
    if not num:
        raise ValueError(f"{arch.architecture}: the config gives no number of experts ({experts_key})")
    arch.num_experts = int(num)
    arch.num_experts_per_tok = int(cfg["num_experts_per_tok"])
    arch.norm_topk_prob = normalize
    for k, v in over.items():
        setattr(arch, k, v)
    arch.__post_init__()
    return arch


class MoeForCausalLM(LlamaForCausalLM):
    PROJECTION_SITES = ("wqkv", "wo")
    MIXTURE_OF_EXPERTS = True
    GGUF_ARCHITECTURES = ()

    @staticmethod
    def segments(cfg: ArchConfig) -> dict[str, dict[str, int]]:
        seg = LlamaForCausalLM.segments(cfg)
        F = cfg.intermediate_size
        return {"wqkv": seg["wqkv"], "bqkv": seg["bqkv"], "experts_gate_up": {"gate": F, "up": F}}

    @classmethod
    def param_specs(cls, cfg: ArchConfig) -> dict[str, ParamSpec]:
        specs = {k: v for k, v in super().param_specs(cfg).items()
                 if k not in ("layers.w_gate_up", "layers.w_down", "layers.b_gate_up", "layers.b_down")}
        L, E, F, X = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
        experts, mlp = ("experts", None) if cfg.expert_parallel else ("experts_whole", "mlp")
        # the router stays float under quantization (not a `matrix`), as vLLM keeps it
        specs["layers.router"] = ParamSpec((L, E, X), ("layers", "embed", None))
        specs["layers.experts_gate_up"] = ParamSpec((L, X, E, 2 * F), ("layers", experts, "embed", mlp),
                                                    matrix="in_out")
        specs["layers.experts_down"] = ParamSpec((L, X, F, E), ("layers", experts, mlp, "embed"),
                                                 matrix="in_out")
        return specs

    @classmethod
    def tp_transform(cls, weights: dict[str, np.ndarray], cfg: ArchConfig, plan) -> dict[str, np.ndarray]:
        out = super().tp_transform(weights, cfg, plan)
        if plan.size == 1 or cfg.expert_parallel:  # whole experts per device: as they are
            return out
        F = cfg.intermediate_size
        if "layers.experts_gate_up" in out:
            w = out["layers.experts_gate_up"]
            pad = [(0, 0)] * (w.ndim - 1) + [(0, plan.mlp_pad)]
            out["layers.experts_gate_up"] = device_major([np.pad(w[..., :F], pad), np.pad(w[..., F:], pad)],
                                                         plan.size)
        if plan.mlp_pad and "layers.experts_down" in out:
            w = out["layers.experts_down"]
            out["layers.experts_down"] = np.pad(w, [(0, 0), (0, 0), (0, plan.mlp_pad), (0, 0)])
        return out

    def __init__(self, cfg: ArchConfig, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        if (self.mesh is not None and self.mesh.size > 1 and self.quant is not None
                and any(self.quant.get("layers." + n) for n in EXPERT_PARAMS)):
            raise ValueError("quantization of a mixture of experts' experts is not supported with "
                             "tensor_parallel_size > 1 yet; run it unquantized or on one device")
        # the CPU kernel reads float experts in place (layers/moe.py)
        self.grouped_kernel = self.matmul_backend == "cpu" and jnp.dtype(self.policy.weight) in (
            jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
        # where the grouped matmuls run (layers/moe.py): the CPU kernel, the Pallas kernel on a
        # GPU (or in its interpreter, as matmul_backend="pallas_interpret" asks), ragged_dot
        if self.grouped_kernel:
            self.grouped_impl = "cpu"
        elif platform_of(self.mesh) == "gpu" or self.matmul_backend == "pallas_interpret":
            self.grouped_impl = "pallas" if platform_of(self.mesh) == "gpu" else "pallas_interpret"
        else:
            self.grouped_impl = "ragged"
        # "dense": every expert on every token (layers/moe.py's moe_dense), the reference
        # that tests and `jaxllm bench moe` hold the grouped path against; one device only
        self.moe_impl = "grouped"

    def in_place_weights(self, weights: dict) -> dict:
        if not self.grouped_kernel or self.moe_impl != "grouped":
            return weights
        return {k: ExpertStack(w) if k in EXPERT_PARAMS and hasattr(w, "ndim") else w
                for k, w in weights.items()}

    def feed_forward(self, h, w: dict, real, adapters):
        cfg = self.cfg
        logits = linear(h, w["router"], self.policy, rows=real)
        if self.moe_impl == "dense":
            return moe_dense(h, logits, w["experts_gate_up"], w["experts_down"], k=cfg.num_experts_per_tok,
                             normalize=cfg.norm_topk_prob, policy=self.policy).astype(self.policy.activation)
        return moe_block(h, logits, w["experts_gate_up"], w["experts_down"], k=cfg.num_experts_per_tok,
                         normalize=cfg.norm_topk_prob, policy=self.policy, real=real, mesh=self.mesh,
                         expert_parallel=cfg.expert_parallel, impl=self.grouped_impl)
