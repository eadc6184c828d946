"""Paged attention over the flat ragged token layout.

The KV cache of all layers is one array `[layers, 2, num_slots, kv_heads, head_dim]` where
slot = block_id * block_size + offset. It is passed into the jitted step and returned, donated.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

_NEG = -1e30
KV_CHUNK = 128  # cached context tokens per loop iteration of the XLA path
Q_BLOCK = 512   # query tokens per block of the in-step attention


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    positions: jax.Array        # [T]
    slot_mapping: jax.Array     # [T]   padded tokens -> null block
    token_seq_ids: jax.Array    # [T]   which sequence each token belongs to
    query_start_loc: jax.Array  # [S+1] padded rows repeat the total number of real tokens
    seq_lens: jax.Array         # [S]   context length after this step (0 for padded rows)
    block_tables: jax.Array     # [S, max_blocks]
    block_size: int = field(metadata=dict(static=True), default=16)


def write_kv(kv_cache: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> jax.Array:
    kv = jnp.stack([k, v], axis=1).astype(kv_cache.dtype)  # [T, 2, KVH, D]
    return kv_cache.at[layer, :, slot_mapping].set(kv, mode="drop")


def _merge(state, s, v, mask):
    """One online-softmax update. s: [T, KVH, G, C] scores, v: values, mask: [T, C]."""
    m, l, acc = state
    s = jnp.where(mask[:, None, None, :], s, _NEG)
    m_new = jnp.maximum(m, s.max(-1))
    # masked entries are zeroed explicitly: a block may be fully masked
    p = jnp.where(mask[:, None, None, :], jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    return m_new, l * corr + p.sum(-1), acc * corr[..., None] + v(p)


def paged_attention_xla(q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: jax.Array,
                        layer: jax.Array, md: AttentionMetadata, scale: float,
                        sliding_window: int | None = None) -> jax.Array:
    """Causal attention of each token over its own sequence.

    q: [T, H, D]; k, v: [T, KVH, D], this step's keys and values. Two parts share one online
    softmax: the step's own tokens attend to each other densely (block-diagonal by sequence),
    then a loop over the context cached by earlier steps gathers it through the block table in
    chunks. The loop's trip count is the longest cached context in the batch, so a batch of
    fresh prompts reads no cache at all while shapes stay static.
    """
    T, H, D = q.shape
    KVH = k.shape[1]
    G = H // KVH
    bs = md.block_size
    f32 = jnp.float32
    qg = (q.astype(f32) * scale).reshape(T, KVH, G, D)
    kf, vf = k.astype(f32), v.astype(f32)
    pos, seq = md.positions, md.token_seq_ids
    idx = jnp.arange(T)
    num_real = md.query_start_loc[-1]
    ctx_start = pos - (idx - md.query_start_loc[seq])  # first position computed in this step

    def window(q_pos, k_pos):
        ok = k_pos <= q_pos
        if sliding_window is not None:
            ok &= k_pos > q_pos - sliding_window
        return ok

    init = (jnp.full((T, KVH, G), _NEG, f32), jnp.zeros((T, KVH, G), f32),
            jnp.zeros((T, KVH, G, D), f32))

    # this step's tokens, in query blocks to bound the score matrix
    qb = min(T, Q_BLOCK)
    nb = -(-T // qb)
    pad = nb * qb - T

    def in_step(args):
        qblk, rows = args  # [qb, KVH, G, D], [qb]
        rows_c = jnp.minimum(rows, T - 1)
        s = jnp.einsum("tkgd,ckd->tkgc", qblk, kf)
        mask = ((seq[rows_c][:, None] == seq[None, :]) & window(pos[rows_c][:, None], pos[None, :])
                & (idx[None, :] < num_real)) | (rows[:, None] == idx[None, :])
        st = tuple(x[:qblk.shape[0]] for x in init)
        return _merge(st, s, lambda p: jnp.einsum("tkgc,ckd->tkgd", p, vf), mask)

    q_blocks = jnp.pad(qg, ((0, pad), (0, 0), (0, 0), (0, 0))).reshape(nb, qb, KVH, G, D)
    rows = jnp.arange(nb * qb).reshape(nb, qb)
    state = jax.lax.map(in_step, (q_blocks, rows))
    state = tuple(x.reshape(nb * qb, *x.shape[2:])[:T] for x in state)

    # context cached by earlier steps
    tables = md.block_tables[seq]  # [T, max_blocks]
    max_blocks = md.block_tables.shape[1]
    num_chunks = -(-jnp.max(jnp.where(idx < num_real, ctx_start, 0)) // KV_CHUNK)

    def cached(j, state):
        ctx = j * KV_CHUNK + jnp.arange(KV_CHUNK)
        blk = jnp.take(tables, jnp.minimum(ctx // bs, max_blocks - 1), axis=1)  # [T, CH]
        slots = blk * bs + ctx % bs
        kc = kv_cache[layer, 0, slots].astype(f32)  # [T, CH, KVH, D]
        vc = kv_cache[layer, 1, slots].astype(f32)
        s = jnp.einsum("tkgd,tckd->tkgc", qg, kc)
        mask = (ctx[None, :] < ctx_start[:, None]) & window(pos[:, None], ctx[None, :])
        return _merge(state, s, lambda p: jnp.einsum("tkgc,tckd->tkgd", p, vc), mask)

    _, l, acc = jax.lax.fori_loop(0, num_chunks, cached, state)
    return (acc / l[..., None]).reshape(T, H, D).astype(q.dtype)


def paged_attention(q, k, v, kv_cache, layer, md, scale, sliding_window=None, backend="xla"):
    if backend == "xla":
        return paged_attention_xla(q, k, v, kv_cache, layer, md, scale, sliding_window)
    raise ValueError(f"unknown attention backend {backend!r}")
