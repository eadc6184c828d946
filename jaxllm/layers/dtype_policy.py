"""Which dtypes a model runs with: a `DTypePolicy`. Element-wise work (norms, RoPE, attention,
residuals, the KV cache) runs in `activation`; projection weights and the embedding are stored
in `weight`; a dot casts its activations to `dot` right before it and accumulates in `accum`,
returning `activation`.

On a GPU `auto` and `bfloat16` are bf16 throughout. On a CPU, XLA:CPU runs bf16 element-wise
work far slower than f32, and widens a bf16 weight to f32 in memory before its dot; the CPU
kernels (jaxllm.kernels.cpu) widen bf16 weights in registers instead. So where they run, `auto`
and `bfloat16` are `CPU_BF16_POLICY`: bf16 weights, f32 element-wise work, activations rounded
to bf16 and multiplied in f32 (exact products, so a request computes the same numbers in any
batch). Elsewhere on a CPU (tensor parallelism, no compiler) `auto` is f32 and `bfloat16` the
same policy on XLA's slower dots. The measurements behind this are in benchmarks/results
(`jaxllm bench dots`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp


@dataclass(frozen=True)
class DTypePolicy:
    name: str
    weight: Any       # storage of projection weights and the embedding table
    activation: Any   # element-wise work, norms' weights, biases, the KV cache
    dot: Any          # the operands' dtype inside a dot
    accum: Any        # the dot's accumulation (preferred_element_type)
    # a float (or weight-only per-channel int8) weight's dot rounds its activations to bf16
    # first (the products are then exact in f32): the CPU kernel multiplies bf16 pairs
    # (vdpbf16ps) at 16+ rows, and rounding at every row count keeps a request's numbers
    # independent of how it was batched
    round_to_bf16: bool = False

    def describe(self) -> str:
        n = jnp.dtype
        text = (f"{self.name}: weights {n(self.weight).name}, activations {n(self.activation).name}, "
                f"dots {n(self.dot).name} accumulating in {n(self.accum).name}")
        if self.round_to_bf16:
            text += " (activations rounded to bfloat16 at float and per-channel int8 weights' dots)"
        return text


def uniform_policy(dtype) -> DTypePolicy:
    """One dtype for everything (`--dtype float32` is exact against the reference)."""
    d = jnp.dtype(dtype).type
    return DTypePolicy(jnp.dtype(d).name, d, d, d, d)


# a CPU's bf16: bf16 storage, and bf16-rounded activations, multiplied in f32; f32
# element-wise work
CPU_BF16_POLICY = DTypePolicy("cpu-bfloat16", jnp.bfloat16, jnp.float32, jnp.float32, jnp.float32,
                              round_to_bf16=True)


def resolve_policy(dtype: str, platform: str, matmul_backend: str = "xla") -> DTypePolicy:
    """matmul_backend: where the model's matmuls run (jaxllm.kernels.matmul_backend): on a CPU,
    `auto` is bf16 only where the kernels read it ("cpu")."""
    accelerator = platform in ("gpu", "tpu")
    if dtype == "auto":
        if accelerator:
            return uniform_policy(jnp.bfloat16)
        return CPU_BF16_POLICY if matmul_backend == "cpu" else uniform_policy(jnp.float32)
    if dtype == "bfloat16" and not accelerator:
        return CPU_BF16_POLICY
    return uniform_policy(dtype)


def uses_dense_kernel(policy: DTypePolicy, matmul_backend: str) -> bool:
    """Whether a model's bf16 float matrices go through the CPU kernel (DenseWeight)."""
    return (jnp.dtype(policy.weight) == jnp.bfloat16 and jnp.dtype(policy.dot) == jnp.float32
            and matmul_backend == "cpu")
