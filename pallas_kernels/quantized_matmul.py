"""Group-quantized matmul as a Pallas kernel: y = x . W^T where W is stored as 4- or 8-bit
codes with a scale and offset per group along its input, dequantized tile by tile in the
kernel so that no float copy of W ever reaches HBM.

XLA fuses a per-channel scale into a GPU GEMM (applied after the dot), but not the
broadcast of group scales along the contraction: it writes the whole dequantized weight
first (`jaxllm bench aot --quantization int4` shows it). This kernel walks K one group at a
time: each step loads a [block_n, group] tile of codes with one scale and offset per row,
dequantizes it in registers and feeds the tensor cores.

Layouts (jaxllm.quantization.formats): W [N, K] out-major; int4 codes packed two per byte in
blocks of 32 along K (byte j of a block: code j in the low nibble, code j + 16 in the high
one), so the activations are split the same way outside the kernel (their "low" and "high"
halves of every 32-block) and each packed tile meets two dots; int8 codes one per byte.
Weights may be a stack [L, N, K'] with the layer chosen at run time (no slice of the stack is
copied). Portable Pallas only: it runs in interpret mode on a CPU and lowers through Triton.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

NIBBLE_BLOCK = 32


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernel(layer_ref, *refs, kind: str, steps: int, width: int, has_offset: bool, dtype, prec):
    if kind == "int4":
        xl_ref, xh_ref, q_ref, s_ref, *rest = refs
    else:
        xl_ref, q_ref, s_ref, *rest = refs
    o_ref, y_ref = (rest[0], rest[1]) if has_offset else (None, rest[0])
    layer = layer_ref[0]
    bm, bn = y_ref.shape

    def dot(a, w):  # a [bm, width] . w [bn, width]^T
        return jax.lax.dot_general(a, w.astype(dtype), (((1,), (1,)), ((), ())), precision=prec,
                                   preferred_element_type=jnp.float32)

    def body(g, acc):
        cols = pl.ds(g * width, width)
        c = q_ref[layer, :, cols]                        # [bn, width] codes
        s = s_ref[layer, :, pl.ds(g, 1)].astype(jnp.float32)   # [bn, 1]
        o = o_ref[layer, :, pl.ds(g, 1)].astype(jnp.float32) if has_offset else 0.0
        if kind == "int4":
            lo = (c & 15).astype(jnp.float32) * s + o
            hi = (c >> 4).astype(jnp.float32) * s + o
            return acc + dot(xl_ref[:, cols], lo) + dot(xh_ref[:, cols], hi)
        return acc + dot(xl_ref[:, cols], c.astype(jnp.float32) * s + o)

    y_ref[...] = jax.lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))


def quantized_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, offset: jax.Array | None,
                     layer=0, *, block_m: int | None = None, block_n: int = 128,
                     num_warps: int = 4, interpret: bool = False) -> jax.Array:
    """x [M, K] . W^T -> [M, N] f32. q: [L, N, K/2] uint8 (int4) or [L, N, K] int8;
    scale, offset: [L, N, K/G] (offset may be None); layer: which of the L matrices."""
    M, K = x.shape
    L, N, width_all = q.shape
    kind = "int4" if q.dtype == jnp.uint8 else "int8"
    groups = scale.shape[-1]
    group = K // groups
    if kind == "int4" and (group % NIBBLE_BLOCK or width_all * 2 != K):
        raise ValueError(f"int4 codes [.., {N}, {width_all}] do not fit K={K} in groups of {group}")
    width = group // 2 if kind == "int4" else group  # code columns per group
    bn = block_n
    while N % bn:
        bn //= 2
    if bn < 16:
        raise ValueError(f"N={N} has no power-of-two tile of at least 16 rows")
    bm = block_m or min(64, max(16, _next_pow2(M)))
    Mp = -(-M // bm) * bm
    dtype = x.dtype
    xp = jnp.pad(x, ((0, Mp - M), (0, 0)))
    if kind == "int4":  # the halves of each 32-block that meet the low and high nibbles
        xb = xp.reshape(Mp, K // NIBBLE_BLOCK, 2, NIBBLE_BLOCK // 2)
        xs = [xb[:, :, 0].reshape(Mp, K // 2), xb[:, :, 1].reshape(Mp, K // 2)]
    else:
        xs = [xp]
    prec = jax.lax.Precision.HIGHEST if dtype == jnp.float32 and interpret else (
        jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3 if dtype == jnp.float32 else None)
    has_offset = offset is not None
    kernel = functools.partial(_kernel, kind=kind, steps=groups, width=width,
                               has_offset=has_offset, dtype=dtype, prec=prec)
    x_spec = pl.BlockSpec((bm, xs[0].shape[1]), lambda i, j: (i, 0))
    w_spec = lambda a: pl.BlockSpec((L, bn, a.shape[-1]), lambda i, j: (0, j, 0))  # noqa: E731
    args = [jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), *xs, q, scale] + ([offset] if has_offset else [])
    in_specs = ([pl.BlockSpec((1,), lambda i, j: (0,))] + [x_spec] * len(xs)
                + [w_spec(q), w_spec(scale)] + ([w_spec(offset)] if has_offset else []))
    y = pl.pallas_call(
        kernel,
        grid=(Mp // bm, N // bn),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((Mp, N), jnp.float32),
        interpret=interpret,
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=3),
        name=f"jaxllm_{kind}_matmul",
    )(*args)
    return y[:M]
