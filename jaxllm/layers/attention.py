"""Paged attention over the flat ragged token layout.

The KV cache of all layers is one array `[layers, 2, num_slots, kv_heads, head_dim]` where
slot = block_id * block_size + offset. It is passed into the jitted step and returned, donated.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

_NEG = -1e30
KV_CHUNK = 128  # context tokens per loop iteration of the XLA path


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    positions: jax.Array        # [T]
    slot_mapping: jax.Array     # [T]   padded tokens -> null block
    token_seq_ids: jax.Array    # [T]   which sequence each token belongs to
    query_start_loc: jax.Array  # [S+1]
    seq_lens: jax.Array         # [S]   context length after this step (0 for padded rows)
    block_tables: jax.Array     # [S, max_blocks]
    block_size: int = field(metadata=dict(static=True), default=16)


def write_kv(kv_cache: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> jax.Array:
    kv = jnp.stack([k, v]).astype(kv_cache.dtype)  # [2, T, KVH, D]
    return kv_cache.at[layer, :, slot_mapping].set(kv.swapaxes(0, 1), mode="drop",
                                                   unique_indices=False)


def paged_attention_xla(q: jax.Array, kv_cache: jax.Array, layer: jax.Array,
                        md: AttentionMetadata, scale: float,
                        sliding_window: int | None = None) -> jax.Array:
    """Causal attention of each token over its own sequence's cached context.

    q: [T, H, D]. Loops over the context in chunks with an online softmax; the trip count is
    the longest context in the batch, so shapes stay static while work follows the real
    lengths. Every token sees at least its own position, so no row is empty.
    """
    T, H, D = q.shape
    KVH = kv_cache.shape[3]
    G = H // KVH
    bs = md.block_size
    qg = (q.astype(jnp.float32) * scale).reshape(T, KVH, G, D)
    tables = md.block_tables[md.token_seq_ids]  # [T, max_blocks]
    pos = md.positions
    max_blocks = md.block_tables.shape[1]
    num_chunks = jnp.maximum(1, -(-jnp.max(md.seq_lens) // KV_CHUNK))

    def body(j, carry):
        m, l, acc = carry
        ctx = j * KV_CHUNK + jnp.arange(KV_CHUNK)
        blk = jnp.take(tables, jnp.minimum(ctx // bs, max_blocks - 1), axis=1)  # [T, CH]
        slots = blk * bs + ctx % bs
        k = kv_cache[layer, 0, slots].astype(jnp.float32)  # [T, CH, KVH, D]
        v = kv_cache[layer, 1, slots].astype(jnp.float32)
        s = jnp.einsum("tkgd,tckd->tkgc", qg, k)
        mask = ctx[None, :] <= pos[:, None]
        if sliding_window is not None:
            mask &= ctx[None, :] > pos[:, None] - sliding_window
        s = jnp.where(mask[:, None, None, :], s, _NEG)
        m_new = jnp.maximum(m, s.max(-1))
        # masked entries are zeroed explicitly: a chunk may be fully masked (sliding window)
        p = jnp.where(mask[:, None, None, :], jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum("tkgc,tckd->tkgd", p, v)
        return m_new, l, acc

    init = (jnp.full((T, KVH, G), _NEG, jnp.float32), jnp.zeros((T, KVH, G), jnp.float32),
            jnp.zeros((T, KVH, G, D), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    return (acc / l[..., None]).reshape(T, H, D).astype(q.dtype)


def paged_attention(q, kv_cache, layer, md, scale, sliding_window=None, backend="xla"):
    if backend == "xla":
        return paged_attention_xla(q, kv_cache, layer, md, scale, sliding_window)
    raise ValueError(f"unknown attention backend {backend!r}")
