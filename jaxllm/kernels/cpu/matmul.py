"""The CPU matmul kernels' entry points: quantized weights (int4 / int8 codes with float
activations, int8 activations per block, w8a8, fp8) and bf16 float weights, each read in place
from its layer stack."""
from __future__ import annotations

from math import prod

import jax
import jax.numpy as jnp

from jaxllm.kernels.cpu.panels import PANEL, bf16_panels_built


def fp8_apply(w) -> bool:
    """Whether an fp8 QWeight (e4m3 codes, per-channel scales, e4m3 activations) runs in the
    kernels: they are here and have AVX512-BF16 (the operands multiply as bf16), K is a
    multiple of 32 and N of 16; otherwise XLA emulates the fp8 dot."""
    if (w.kind != "fp8" or w.act != "fp8" or w.in_features % 32 or w.out_features % 16
            or w.smooth is not None):
        return False
    return bf16_panels_built()


def _index(layer, rows) -> jax.Array:
    """The kernels' int32 index operand: [layer, rows], rows = how many leading rows of x are
    real (None: all of them)."""
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32)
    if rows is None:
        return layer
    return jnp.stack([layer, jnp.asarray(rows, jnp.int32)])


def matmul(x: jax.Array, w, rows=None, bf16_activations: bool = False) -> jax.Array:
    """x [.., K] @ W^T -> [.., N] f32 through the kernels; w is a QWeight. rows: only the first
    `rows` rows of x (flattened) are real, the others are padding: their outputs are zeros.
    bf16_activations: x holds bf16 values (the caller rounded it) and w is per-channel int8
    (QWeight.per_channel_int8): from 16 rows (4 on AMX) they multiply as bf16 pairs."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K).astype(jnp.float32)
    stack = (lambda a: a) if w.layer is not None else (lambda a: None if a is None else a[None])
    q, scale, offset, smooth = stack(w.q), stack(w.scale), stack(w.offset), stack(w.smooth)
    layer = _index(w.layer, rows)
    N = w.out_features
    out = jax.ShapeDtypeStruct((x2.shape[0], N), jnp.float32)
    if w.panels:
        if smooth is not None:
            y = jax.ffi.ffi_call("jaxllm_w8a8_panels_smooth", out)(x2, q, scale, smooth, layer)
        else:
            y = jax.ffi.ffi_call("jaxllm_w8a8_panels", out)(x2, q, scale, layer)
    elif w.kind == "fp8":
        y = jax.ffi.ffi_call("jaxllm_fp8", out)(x2, q, scale, layer)
    elif w.act == "int8":
        if smooth is not None:
            y = jax.ffi.ffi_call("jaxllm_w8a8_smooth", out)(x2, q, scale, smooth, layer)
        else:
            y = jax.ffi.ffi_call("jaxllm_w8a8", out)(x2, q, scale, layer)
    else:
        name = "jaxllm_qmm_q8" if w.act == "int8_block" else "jaxllm_qmm"
        if offset is not None:
            y = jax.ffi.ffi_call(name, out)(x2, q, scale, offset, layer)
        elif bf16_activations:
            y = jax.ffi.ffi_call("jaxllm_qmm_sym_bf16", out)(x2, q, scale, layer)
        else:
            y = jax.ffi.ffi_call(name + "_sym", out)(x2, q, scale, layer)
    return y.reshape(*lead, N)


def dense_bf16(x: jax.Array, w: jax.Array, layer=None, out_major: bool = False,
               rows=None, panels: bool = False) -> jax.Array:
    """x [.., K] @ a bf16 matrix -> [.., N] f32, widening the weights in registers. w: a stack
    [L, K, N] read at `layer` in place (no slice copied), or one matrix [K, N]; out_major: the
    matrix is [N, K] (a tied embedding table as the head); panels: w is a stack made by
    `to_panels`; rows: as in `matmul`."""
    lead, K = x.shape[:-1], x.shape[-1]
    if panels:
        out = jax.ShapeDtypeStruct((prod(lead), w.shape[1] * PANEL), jnp.float32)
        y = jax.ffi.ffi_call("jaxllm_bf16_panels", out)(x.reshape(-1, K).astype(jnp.float32), w,
                                                       _index(layer, rows))
        return y.reshape(*lead, out.shape[1])
    w3 = w if layer is not None else w[None]
    N = w3.shape[1] if out_major else w3.shape[2]
    out = jax.ShapeDtypeStruct((prod(lead), N), jnp.float32)
    target = "jaxllm_bf16_out_in" if out_major else "jaxllm_bf16_in_out"
    y = jax.ffi.ffi_call(target, out)(x.reshape(-1, K).astype(jnp.float32), w3, _index(layer, rows))
    return y.reshape(*lead, N)


