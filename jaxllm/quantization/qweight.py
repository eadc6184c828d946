"""A quantized weight on the device and its reference matmuls (layers/linear.py picks which
matmul reads it).

`QWeight` holds one projection's arrays in our out-major layouts (formats.py) and, for the
layers' stacked weights, the index of the layer to use. The layer index travels with the
arrays instead of a slice of them: XLA copies a slice of the stack out before a dot or a
custom call reads it, which on a CPU cost as much as reading the weights again.

Two implementations:
- `xla`: dequantize and dot in the policy's dtypes (a GPU fuses the dequantization into the
  matmul's operand load); for `w8a8` int8 x int8 -> int32, for `fp8` e4m3 x e4m3 -> f32, the
  activations quantized per token at run time. It is the reference every path is tested
  against.
- `cpu`: the C++ kernels of jaxllm.kernels.cpu, which read the packed codes straight
  from the stack (XLA:CPU has no dot that dequantizes its operand on the fly: it writes the
  whole dequantized weight first, slower than the float weight it replaces).
- `pallas`: on a GPU, group-quantized weights (int4, int8 in groups) go through the Pallas
  kernel of pallas_kernels/quantized_matmul.py: XLA fuses a per-channel scale into its GEMM
  but writes a group-scaled weight out whole before it. Per-channel int8, w8a8 and fp8 stay
  on XLA's dots there (`pallas_interpret` runs the kernel in Pallas' interpreter: tests).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jaxllm.quantization.formats import FP8_MAX, NIBBLE_BLOCK


@jax.tree_util.register_dataclass
@dataclass
class QWeight:
    q: jax.Array                      # uint8 (int4 packed) | int8 | float8_e4m3fn  [.., N, K']
    #                                   or int32 w8a8 panels (`panels`)
    scale: jax.Array                  # f32 [.., N, K/G]
    offset: jax.Array | None = None   # f32 [.., N, K/G] (asymmetric formats)
    smooth: jax.Array | None = None   # f32 [.., K]: SmoothQuant divides activations by it
    layer: jax.Array | int | None = None  # index into the leading (layer) axis
    act: str = field(default="none", metadata=dict(static=True))      # none | int8 | fp8 | int8_block
    backend: str = field(default="xla", metadata=dict(static=True))   # xla | cpu | pallas

    @property
    def panels(self) -> bool:
        """w8a8 codes packed at load as the CPU kernels' panels (int32 [.., N/48, K/4 + 1, 48],
        jaxllm.kernels.cpu.panels.to_i8_panels)."""
        return self.q.dtype == jnp.int32

    @property
    def kind(self) -> str:
        if self.q.dtype == jnp.uint8:
            return "int4"
        return "int8" if self.q.dtype in (jnp.int8, jnp.int32) else "fp8"

    @property
    def in_features(self) -> int:
        if self.panels:
            return (self.q.shape[-2] - 1) * 4
        return self.q.shape[-1] * (2 if self.kind == "int4" else 1)

    @property
    def out_features(self) -> int:
        return self.q.shape[-3] * self.q.shape[-1] if self.panels else self.q.shape[-2]

    @property
    def group(self) -> int:
        return self.in_features // self.scale.shape[-1]

    @property
    def per_channel_int8(self) -> bool:
        """Weight-only int8 with one scale per output channel (W8A16): a policy that rounds
        activations to bf16 (linear.CPU_BF16_POLICY) rounds them before this dot too, and the
        CPU kernel then multiplies bf16 pairs from 16 rows."""
        return (self.kind == "int8" and self.act == "none" and self.offset is None
                and self.group == self.in_features)

    def at(self, layer) -> "QWeight":
        return QWeight(self.q, self.scale, self.offset, self.smooth, layer, self.act, self.backend)

    def matrix(self) -> "QWeight":
        """The arrays of the one matrix this weight stands for (the layer's, from a stack)."""
        if self.layer is None:
            return self
        pick = (lambda a: None if a is None else a[self.layer])
        return QWeight(pick(self.q), pick(self.scale), pick(self.offset), pick(self.smooth),
                       None, self.act, self.backend)


def unpack_codes(q: jax.Array) -> jax.Array:
    """Packed int4 bytes [.., K/2] -> codes [.., K] (uint8)."""
    *lead, half = q.shape
    b = q.reshape(*lead, half * 2 // NIBBLE_BLOCK, 1, NIBBLE_BLOCK // 2)
    return jnp.concatenate([b & 15, b >> 4], axis=-2).reshape(*lead, half * 2)


def dequantize(w: QWeight, dtype=jnp.float32) -> jax.Array:
    """W [N, K] (or [.., N, K] for a stack without a layer index) in `dtype`."""
    codes = unpack_codes(w.q) if w.kind == "int4" else w.q
    c = codes.astype(jnp.float32)
    g = w.group
    c = c.reshape(*c.shape[:-1], c.shape[-1] // g, g) * w.scale[..., None]
    if w.offset is not None:
        c = c + w.offset[..., None]
    return c.reshape(*c.shape[:-2], -1).astype(dtype)


def embed_rows(w: QWeight, ids: jax.Array, dtype) -> jax.Array:
    """Rows of a quantized embedding table [V, E] for token ids [T] -> [T, E]."""
    rows = QWeight(w.q[ids], w.scale[ids], None if w.offset is None else w.offset[ids])
    return dequantize(rows, dtype)


def _dot_t(x, w, accum):
    """x [.., K] . w [N, K] -> [.., N]."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=accum)


def quantize_activations(x: jax.Array, kind: str):
    """Per-token dynamic quantization: (values, scale [.., 1])."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    top = 127.0 if kind == "int8" else FP8_MAX
    s = jnp.where(amax > 0, amax / top, 1.0)
    if kind == "int8":
        return jnp.clip(jnp.round(x / s), -127, 127).astype(jnp.int8), s
    return (x / s).astype(jnp.float8_e4m3fn), s


def fake_quant_blocks(x: jax.Array) -> jax.Array:
    """Activations through int8 per block of 32 along K and back (the "int8_block" form of
    4-bit weights on a CPU, llama.cpp's Q8): what the CPU kernel multiplies the codes by."""
    x = x.astype(jnp.float32)
    b = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = jnp.max(jnp.abs(b), axis=-1, keepdims=True)
    d = jnp.where(amax > 0, amax / 127.0, 1.0)
    return (jnp.clip(jnp.round(b / d), -127, 127) * d).reshape(x.shape)


def matmul_xla(x: jax.Array, w: QWeight, policy) -> jax.Array:
    """x [.., K] @ W^T -> [.., N] in f32."""
    m = w.matrix()
    if m.smooth is not None:
        x = x / m.smooth
    if m.act == "int8_block":
        x = fake_quant_blocks(x)
    if m.act in ("none", "int8_block"):
        return _dot_t(x.astype(policy.dot), dequantize(m, policy.dot), policy.accum).astype(jnp.float32)
    if m.group != m.in_features or m.offset is not None:
        raise ValueError(f"{m.act} activations need symmetric per-channel weights")
    xq, xs = quantize_activations(x, m.act)
    acc = jnp.int32 if m.act == "int8" else jnp.float32
    y = _dot_t(xq, m.q, acc).astype(jnp.float32)
    return y * xs * m.scale[:, 0]


def matmul_pallas(x: jax.Array, w: QWeight, policy, interpret: bool) -> jax.Array:
    from pallas_kernels.quantized_matmul import quantized_matmul
    stack = (lambda a: a) if w.layer is not None else (lambda a: None if a is None else a[None])
    lead, K = x.shape[:-1], x.shape[-1]
    y = quantized_matmul(x.reshape(-1, K).astype(policy.dot), stack(w.q), stack(w.scale),
                         stack(w.offset), 0 if w.layer is None else w.layer, interpret=interpret)
    return y.reshape(*lead, w.out_features)
