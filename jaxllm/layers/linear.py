"""The one linear seam: every projection (q/k/v, o, gate/up, down, the LM head) is a call to
`linear`, which owns the weight's storage dtype, the dtype the dot computes in and the dtype
it accumulates in. Quantized weights and LoRA plug in here.

A `DTypePolicy` says which dtypes a model runs with. Element-wise work (norms, RoPE,
attention, residuals, the KV cache) runs in `activation`; projection weights and the
embedding are stored in `weight`; a dot casts its activations to `dot` right before it and
accumulates in `accum`, returning `activation`.

Chosen by measurement (`jaxllm bench dots`, benchmarks/results/dots_*.json). On this
project's CPU (AMD Zen 4: AVX-512 with BF16 instructions, no AMX) XLA:CPU's f32 dot is the
fastest form at every row count from 1 to 256: bf16 operands with f32 accumulation reach
0.3-0.8x of it, and bf16 element-wise work is slower still. So `auto` is f32 on a CPU.
`bfloat16` on a CPU means bf16 weights (half the memory) with f32 element-wise work and bf16
dots accumulating in f32 (`CPU_BF16_POLICY`), never bf16 element-wise work, which XLA:CPU
runs far slower. On a GPU `auto` and `bfloat16` are bf16 throughout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class DTypePolicy:
    name: str
    weight: Any       # storage of projection weights and the embedding table
    activation: Any   # element-wise work, norms' weights, biases, the KV cache
    dot: Any          # the operands' dtype inside a dot
    accum: Any        # the dot's accumulation (preferred_element_type)

    def describe(self) -> str:
        n = jnp.dtype
        text = (f"{self.name}: weights {n(self.weight).name}, activations {n(self.activation).name}, "
                f"dots {n(self.dot).name} accumulating in {n(self.accum).name}")
        return text


def uniform_policy(dtype) -> DTypePolicy:
    """One dtype for everything (`--dtype float32` is exact against the reference)."""
    d = jnp.dtype(dtype).type
    return DTypePolicy(jnp.dtype(d).name, d, d, d, d)


# `bfloat16` on a CPU: bf16 storage, f32 element-wise work and accumulation
CPU_BF16_POLICY = DTypePolicy("cpu-bfloat16", jnp.bfloat16, jnp.float32, jnp.bfloat16, jnp.float32)


def resolve_policy(dtype: str, platform: str) -> DTypePolicy:
    accelerator = platform in ("gpu", "tpu")
    if dtype == "auto":
        return uniform_policy(jnp.bfloat16 if accelerator else jnp.float32)
    if dtype == "bfloat16" and not accelerator:
        return CPU_BF16_POLICY
    return uniform_policy(dtype)


def linear(x: jax.Array, w, policy: DTypePolicy, bias: jax.Array | None = None) -> jax.Array:
    """x[..., in] @ w (+ bias) in the policy's dtypes; returns `policy.activation`. w is a
    float [in, out] array or a quantized weight (jaxllm.quantization.qweight.QWeight,
    out-major, read by its own matmul)."""
    from jaxllm.quantization.qweight import QWeight, matmul
    if isinstance(w, QWeight):
        y = matmul(x, w, policy)
    elif policy.accum == policy.dot:
        y = jnp.dot(x.astype(policy.dot), w.astype(policy.dot))
    else:
        y = jax.lax.dot_general(x.astype(policy.dot), w.astype(policy.dot),
                                (((x.ndim - 1,), (0,)), ((), ())),
                                preferred_element_type=policy.accum)
    y = y.astype(policy.activation)
    return y if bias is None else y + bias.astype(policy.activation)
