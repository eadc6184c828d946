"""The pure-jnp reference of ragged paged attention: obviously right, not fast.

Every token gathers its sequence's whole block table from the cache and attends with a dense
causal (and optional sliding-window) mask. Kernels and the XLA path are tested against it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def ragged_paged_attention_ref(q, kv_cache, layer, positions, token_seq_ids, block_tables,
                               block_size: int, scale: float, sliding_window=None, soft_cap=None):
    """q: [T, H, D]; kv_cache: [L, 2, KVH, slots, D]; the step's K/V already written.

    Returns [T, H, D] in q's dtype; softmax in f32.
    """
    T, H, D = q.shape
    KVH = kv_cache.shape[2]
    G = H // KVH
    width = block_tables.shape[1] * block_size
    ctx = jnp.arange(width)
    tables = block_tables[token_seq_ids]  # [T, max_blocks]
    slots = tables[:, ctx // block_size] * block_size + ctx % block_size  # [T, width]
    k = kv_cache[layer, 0][:, slots].astype(jnp.float32)  # [KVH, T, width, D]
    v = kv_cache[layer, 1][:, slots].astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(T, KVH, G, D) * scale
    # exact f32 on every backend (a GPU would otherwise use TF32 for f32 matmuls)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("tkgd,ktcd->tkgc", qg, k, precision=hi)
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    mask = ctx[None, :] <= positions[:, None]
    if sliding_window is not None:
        mask &= ctx[None, :] > positions[:, None] - sliding_window
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("tkgc,ktcd->tkgd", p, v, precision=hi)
    return out.reshape(T, H, D).astype(q.dtype)
