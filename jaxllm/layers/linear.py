"""The one linear seam: every projection (q/k/v, o, gate/up, down, the LM head) is a call to
`linear`, which owns the weight's storage dtype, the dtype the dot computes in and the dtype
it accumulates in. Quantized weights and LoRA plug in here.

A `DTypePolicy` says which dtypes a model runs with. Element-wise work (norms, RoPE,
attention, residuals, the KV cache) runs in `activation`; projection weights and the
embedding are stored in `weight`; a dot casts its activations to `dot` right before it and
accumulates in `accum`, returning `activation`.

Chosen by measurement (`jaxllm bench dots`, benchmarks/results/dots_*.json). On this
project's CPU (AMD Zen 4: AVX-512 with BF16 instructions, no AMX) XLA:CPU's f32 dot is the
fastest of XLA's forms at every row count from 1 to 256: bf16 operands with f32 accumulation
reach 0.3-0.8x of it, and a bf16 weight widened to f32 before XLA's dot is written out whole
first (8x slower at one row). The CPU kernel `jaxllm_bf16_*` (quantization/cpu) widens bf16
weights in registers instead, reading each layer's matrix in place: 1.9x the f32 dot at 1-4
rows (decode reads half the bytes), 1.5x at 8, 1.2x at 16-64, equal at 256
(dots_stack_2026-11-24_cpu.json). From 16 rows the kernel multiplies bf16 activations by pairs
with vdpbf16ps from packed weight panels ([64, 576] x [576, 1536]: 157 -> 249 GFLOP/s), and on
a Xeon with AMX from 4 rows on its tiles (the four layer matmuls x 30 at 64 rows: 74 -> 20 ms).
Layer stacks whose shapes allow it are packed into those panels once at load
(jaxllm.quantization.cpu.to_panels) and read so at every row count: packing per call had cost
more than the products. The policy rounds activations to bf16 before every such dot, so a
request computes the same numbers in any batch. So on a CPU where the kernels build (one
device), `auto` and `bfloat16` are `CPU_BF16_POLICY`: bf16 weights, f32 element-wise work,
bf16-rounded activations times bf16 weights in f32 through the kernel. Elsewhere on a CPU (tensor parallelism, no
compiler) `auto` is f32 and `bfloat16` the same policy on XLA's slower dots; bf16 element-wise
work is never used on a CPU (XLA:CPU runs it far slower). On a GPU `auto` and `bfloat16` are
bf16 throughout.
"""
from __future__ import annotations

from dataclasses import dataclass, field
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


def resolve_policy(dtype: str, platform: str, devices: int = 1) -> DTypePolicy:
    """devices: how many devices the model is split over (the CPU kernels run on one)."""
    accelerator = platform in ("gpu", "tpu")
    if dtype == "auto":
        if accelerator:
            return uniform_policy(jnp.bfloat16)
        return CPU_BF16_POLICY if devices == 1 and cpu_kernels() else uniform_policy(jnp.float32)
    if dtype == "bfloat16" and not accelerator:
        return CPU_BF16_POLICY
    return uniform_policy(dtype)


def uses_dense_kernel(policy: DTypePolicy, mesh) -> bool:
    """Whether a model's bf16 float matrices go through the CPU kernel (DenseWeight)."""
    from jaxllm.quantization import matmul_backend
    return (jnp.dtype(policy.weight) == jnp.bfloat16 and jnp.dtype(policy.dot) == jnp.float32
            and matmul_backend(mesh) == "cpu")


def cpu_kernels() -> bool:
    """Whether a one-device CPU model runs its matmuls through the CPU kernels (they read bf16
    weights at twice the f32 dot's speed at decode; without them bf16 is slower than f32)."""
    from jaxllm.quantization import matmul_backend
    return matmul_backend(None) == "cpu"


@jax.tree_util.register_dataclass
@dataclass
class DenseWeight:
    """A bf16 float matrix for the CPU kernel: a layer stack [L, K, N] with the index of the
    layer to use (read in place: XLA would copy a slice of the stack out first), or one
    matrix; out_major: [N, K] (a tied embedding table as the head); panels: a layer stack
    packed at load (jaxllm.quantization.cpu.to_panels)."""
    w: jax.Array
    layer: jax.Array | int | None = None
    out_major: bool = field(default=False, metadata=dict(static=True))
    panels: bool = field(default=False, metadata=dict(static=True))

    def at(self, layer) -> "DenseWeight":
        return DenseWeight(self.w, layer, self.out_major, self.panels)


def linear(x: jax.Array, w, policy: DTypePolicy, bias: jax.Array | None = None,
           lora=None, rows=None) -> jax.Array:
    """x[..., in] @ w (+ bias) in the policy's dtypes; returns `policy.activation`. w is a
    float [in, out] array, a DenseWeight (the CPU bf16 kernel) or a quantized weight
    (jaxllm.quantization.qweight.QWeight, out-major, read by its own matmul). `lora(x, y)`
    (jaxllm.lora.ops) adds the adapters' delta to the output. rows (a traced scalar): only
    the first `rows` rows of x [T, in] are real, the rest pad the step to its bucket; the CPU
    kernels then skip the padding (its outputs are not meaningful), XLA's dots compute it."""
    from jaxllm.quantization.qweight import QWeight, matmul
    if policy.round_to_bf16 and (not isinstance(w, QWeight) or w.per_channel_int8):
        x = x.astype(jnp.bfloat16).astype(jnp.float32)
    if isinstance(w, QWeight):
        y = matmul(x, w, policy, rows)
    elif isinstance(w, DenseWeight):
        from jaxllm.quantization import cpu
        y = cpu.dense_bf16(x, w.w, w.layer, w.out_major, rows, w.panels)
    elif policy.accum == policy.dot:
        y = jnp.dot(x.astype(policy.dot), w.astype(policy.dot))
    else:
        y = jax.lax.dot_general(x.astype(policy.dot), w.astype(policy.dot),
                                (((x.ndim - 1,), (0,)), ((), ())),
                                preferred_element_type=policy.accum)
    y = y.astype(policy.activation)
    y = y if bias is None else y + bias.astype(policy.activation)
    return y if lora is None else lora(x, y)
