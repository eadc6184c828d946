"""The pure-jnp reference of the group-quantized matmul: dequantize the whole weight, then dot."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def quantized_matmul_ref(x, q, scale, offset, layer=0):
    """x [M, K]; q [L, N, K/2] uint8 (int4, 32-blocks: code j low, code j + 16 high) or
    [L, N, K] int8; scale, offset [L, N, K/G]. Returns [M, N] f32, exact f32 math."""
    q, scale = q[layer], scale[layer].astype(jnp.float32)
    if q.dtype == jnp.uint8:
        b = q.reshape(q.shape[0], -1, 1, 16)
        codes = jnp.concatenate([b & 15, b >> 4], axis=-2).reshape(q.shape[0], -1)
    else:
        codes = q
    N, K = codes.shape
    G = K // scale.shape[-1]
    w = codes.astype(jnp.float32).reshape(N, K // G, G) * scale[..., None]
    if offset is not None:
        w = w + offset[layer].astype(jnp.float32)[..., None]
    return jax.lax.dot_general(x.astype(jnp.float32), w.reshape(N, K), (((1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST)
