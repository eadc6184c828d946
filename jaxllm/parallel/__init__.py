"""Tensor parallelism, declared once: parameters carry logical axis names, and the one table
below maps them to mesh axes. Attention runs under shard_map with specs from the same table;
everything else is left to XLA's sharding propagation (column-parallel q/k/v and gate/up,
row-parallel o and down: one all-reduce per attention and per MLP)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

TP = "tp"

# logical axis -> mesh axis (None: replicated)
LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "vocab": TP,      # embedding rows and logits columns
    "heads": TP,      # query heads (x head_dim) of q and o
    "kv_heads": TP,   # key/value heads of k, v and the KV cache
    "mlp": TP,        # the MLP's hidden size
    # mixture of experts: the experts' axis split over the devices (expert parallelism), or
    # kept whole on each (the experts' hidden size split instead, as a dense MLP's)
    "experts": TP,
    "experts_whole": None,
    "embed": None,
    "layers": None,
    "head_dim": None,
    "kv": None,       # the K / V axis of the cache
    "slots": None,
}


def spec(*logical: str | None) -> P:
    return P(*(LOGICAL_AXIS_RULES.get(name) if name else None for name in logical))


def platform_of(mesh: Mesh | None) -> str:
    """Where a step on `mesh` runs ("gpu", "cpu", ...): its devices may be a compile target on a
    machine without them (jaxllm bench aot); no mesh means JAX's default backend."""
    import jax
    return jax.default_backend() if mesh is None else mesh.devices.flat[0].platform


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh:
    import jax
    devices = list(devices if devices is not None else jax.devices())
    if tensor_parallel_size > len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs that many devices; "
                         f"{len(devices)} are visible")
    return Mesh(np.array(devices[:tensor_parallel_size]), (TP,))


def sharding(mesh: Mesh, *logical: str | None) -> NamedSharding:
    return NamedSharding(mesh, spec(*logical))


@dataclass(frozen=True)
class TPPlan:
    """How a model's shapes change to split over `size` devices: the vocabulary and the MLP
    are padded with zeros to a multiple of it (padded logits are cut off, padded MLP units
    contribute silu(0) * 0 = 0); KV heads are repeated when there are fewer than devices (each
    device then holds one, as vLLM does). Query heads cannot be padded: they must divide."""
    size: int
    vocab_pad: int = 0
    mlp_pad: int = 0
    kv_repeat: int = 1


def plan(arch, size: int) -> TPPlan:
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    if arch.expert_parallel and not arch.num_experts:
        raise ValueError(f"enable_expert_parallel: {arch.architecture} has no experts")
    if size == 1:
        return TPPlan(1)
    if arch.expert_parallel and arch.num_experts % size:
        raise ValueError(f"enable_expert_parallel: the {arch.num_experts} experts of "
                         f"{arch.architecture} do not divide over {size} devices "
                         "(tensor_parallel_size); choose a size that divides them")
    H, KVH = arch.num_heads, arch.num_kv_heads
    if H % size:
        raise ValueError(f"num_attention_heads ({H}) is not divisible by tensor_parallel_size "
                         f"({size}); attention heads cannot be padded")
    if KVH % size == 0:
        repeat = 1
    elif size % KVH == 0:
        repeat = size // KVH
    else:
        raise ValueError(f"num_key_value_heads ({KVH}) and tensor_parallel_size ({size}) must "
                         "divide one another")
    # whole experts per device (expert parallelism) keep their hidden size as it is
    mlp_pad = 0 if arch.expert_parallel else -arch.intermediate_size % size
    return TPPlan(size, vocab_pad=-arch.vocab_size % size, mlp_pad=mlp_pad, kv_repeat=repeat)


def runtime_arch(arch, p: TPPlan):
    """The shapes the sharded model is built with (the model class's tp_transform turns
    checkpoint weights into them)."""
    return replace(arch, num_kv_heads=arch.num_kv_heads * p.kv_repeat,
                   intermediate_size=arch.intermediate_size + p.mlp_pad,
                   vocab_pad=p.vocab_pad, tp_size=p.size)
