"""Paged attention over the flat ragged token layout.

The KV cache of all layers is one array `[layers, 2, kv_heads, num_slots, head_dim]` where
slot = block_id * block_size + offset: each KV head's block is a contiguous `[block_size,
head_dim]` tile, which is what a GPU kernel wants to load and what tensor parallelism shards.
It is passed into the jitted step and returned, donated. Each layer first writes the step's
new K and V through the slot mapping and then attends over the cache alone, so cached
context, prefix hits and this step's tokens are all read the same way. On a one-device CPU
the two passes below run in C++ kernels that read the cache in place (XLA's form gathers
every context row into a new array first); elsewhere they are the XLA code here.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jaxllm.kernels.cpu import attention as cpu_attention
from jaxllm.kernels.cpu import build
from jaxllm.quantization import kv as kvq

_NEG = -1e30
KV_CHUNK = 128      # cache tokens per loop iteration of the XLA path's prefill tiles
DECODE_CHUNK = 32   # ... and of its decode pass: gathers are its cost, so little overshoot
Q_TILE = 64     # query tokens per prefill work item of the XLA path


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    positions: jax.Array        # [T]
    slot_mapping: jax.Array     # [T]   padded tokens -> the null block
    token_seq_ids: jax.Array    # [T]   which sequence each token belongs to
    query_start_loc: jax.Array  # [S+1] padded rows repeat the total number of real tokens
    seq_lens: jax.Array         # [S]   context length after this step (0 for padded rows)
    block_tables: jax.Array     # [S, max_blocks]
    # prefill work items: query tiles of the sequences with more than one token this step
    tile_seq: jax.Array         # [W]   sequence of each tile
    tile_start: jax.Array       # [W]   first token (flat index) of each tile
    num_tiles: jax.Array        # []    how many of the W tiles are real
    block_size: int = field(metadata=dict(static=True), default=16)
    q_tile: int = field(metadata=dict(static=True), default=Q_TILE)  # tokens per tile


def q_tile_size(num_tokens: int, backend: str = "cpu", kv_group: int = 1) -> int:
    """Tokens per prefill tile: the Pallas kernel fixes it by the GQA group (128 query rows);
    the XLA path slices tiles out of the step, so they fit in it."""
    if backend.startswith("pallas"):
        from pallas_kernels.ragged_paged_attention import q_tile
        return q_tile(kv_group)
    return min(num_tokens, Q_TILE)


def max_tiles(num_tokens: int, num_seqs: int, q_tile: int) -> int:
    """Upper bound on prefill tiles for a (tokens, seqs) bucket: sum of ceil(len / tile)."""
    return num_tokens // q_tile + num_seqs


def kv_chunk(block_size: int, tokens: int = KV_CHUNK) -> int:
    """A whole number of blocks near `tokens`. Block tables are padded to a multiple of the
    largest (KV_CHUNK), which every smaller chunk divides."""
    return max(block_size, tokens // block_size * block_size)


def write_kv(kv_cache, layer: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array):
    """k, v: [T, KVH, D] -> written at kv_cache[layer, 0/1, :, slot_mapping] (a quantized
    cache stores them with a scale per token and head: jaxllm.quantization.kv)."""
    return kvq.write(kv_cache, layer, k, v, slot_mapping)


def _softcap(s, soft_cap):
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def _online_update(state, s, v, mask):
    """One online-softmax step. s: [..., C] scores with mask broadcastable to it; v(p) -> values."""
    m, l, acc = state
    s = jnp.where(mask, s, _NEG)
    m_new = jnp.maximum(m, s.max(-1))
    # masked entries are zeroed explicitly: a chunk may be fully masked
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    return m_new, l * corr + p.sum(-1), acc * corr[..., None] + v(p)


def _finish(state):
    _, l, acc = state
    return acc / jnp.maximum(l, 1e-30)[..., None]


def _chunk_slots(table_rows: jax.Array, c: jax.Array, chunk: int, bs: int) -> jax.Array:
    """Slots of cache positions [c*chunk, (c+1)*chunk) for each table row: [..., chunk]."""
    nb = chunk // bs
    blocks = jax.lax.dynamic_slice_in_dim(table_rows, c * nb, nb, axis=-1)
    slots = blocks[..., :, None] * bs + jnp.arange(bs)
    return slots.reshape(*blocks.shape[:-1], chunk)


def _window_start(md, window) -> jax.Array:
    """[S] the first context position each sequence's last token sees."""
    if window is None:
        return jnp.zeros_like(md.seq_lens)
    q_pos = md.positions[jnp.maximum(md.query_start_loc[1:] - 1, 0)]
    return jnp.maximum(q_pos - window + 1, 0)


def cpu_kernels_apply(kv_cache, platform: str | None = None) -> bool:
    """Whether both passes can run in the CPU kernels (jaxllm.kernels.cpu), which read an
    f32, bf16-bits, int8 or fp8 cache in place; other platforms take XLA's."""
    dtype = (kv_cache.data if isinstance(kv_cache, kvq.QuantizedKV) else kv_cache).dtype
    if dtype not in (jnp.float32, kvq.BF16_BITS, jnp.int8, jnp.float8_e4m3fn, kvq.FP8_BITS):
        return False
    if (platform or jax.default_backend()) != "cpu":
        return False
    return build.available()


def _decode_pass(qg, kv_cache, layer, md, window, soft_cap):
    """The last token of every sequence against its whole context.

    qg: [S, KVH, G, D] f32, already scaled. Returns [S, KVH, G, D]. The work is the list of
    (sequence, chunk of its context) pairs, taken S at a time, so a batch with one long context
    among short ones gathers only the chunks that exist (batching by chunk index would gather
    every sequence up to the longest). Partial results merge into their sequence's online
    softmax with scatters.
    """
    S, KVH, G, D = qg.shape
    bs = md.block_size
    chunk = kv_chunk(bs, DECODE_CHUNK)
    nb = chunk // bs
    lens = md.seq_lens
    lo = _window_start(md, window)
    first = lo // chunk                              # first chunk in the window
    count = jnp.where(lens > 0, -(-lens // chunk) - first, 0)  # chunks per sequence
    ends = jnp.cumsum(count)
    total = ends[-1]

    def body(g, state):
        m, l, acc = state
        item = g * S + jnp.arange(S)                          # S work items at a time
        valid = item < total
        # S x S comparisons: a few vector ops, where the default search is a loop per layer
        seq = jnp.minimum(jnp.searchsorted(ends, item, side="right", method="compare_all"), S - 1)
        c = first[seq] + item - (ends[seq] - count[seq])      # the item's chunk of its sequence
        blocks = jnp.take_along_axis(md.block_tables[seq], (c * nb)[:, None] + jnp.arange(nb),
                                     axis=1, mode="clip")
        slots = (blocks[:, :, None] * bs + jnp.arange(bs)).reshape(S, chunk)
        # one gather straight from the stacked cache: slicing the layer out first would copy it
        k = kvq.read(kv_cache, layer, 0, slots)  # [S, C, KVH, D]
        v = kvq.read(kv_cache, layer, 1, slots)
        s = _softcap(jnp.einsum("skgd,sckd->skgc", qg[seq], k), soft_cap)
        k_pos = c[:, None] * chunk + jnp.arange(chunk)
        mask = ((k_pos < lens[seq][:, None]) & (k_pos >= lo[seq][:, None]) & valid[:, None])
        s = jnp.where(mask[:, None, None, :], s, _NEG)
        m_item = s.max(-1)                                     # [S, KVH, G]
        p = jnp.where(mask[:, None, None, :], jnp.exp(s - m_item[..., None]), 0.0)
        l_item = p.sum(-1)
        acc_item = jnp.einsum("skgc,sckd->skgd", p, v)
        dst = jnp.where(valid, seq, S)                         # invalid items merge nowhere
        m_new = m.at[dst].max(m_item, mode="drop")
        w_old = jnp.exp(m - m_new)
        w_item = jnp.exp(m_item - m_new[seq])
        l = (l * w_old).at[dst].add(l_item * w_item, mode="drop")
        acc = (acc * w_old[..., None]).at[dst].add(acc_item * w_item[..., None], mode="drop")
        return m_new, l, acc

    init = (jnp.full((S, KVH, G), _NEG, jnp.float32), jnp.zeros((S, KVH, G), jnp.float32),
            jnp.zeros((S, KVH, G, D), jnp.float32))
    return _finish(jax.lax.fori_loop(0, -(-total // S), body, init))


def _prefill_pass(qg, out, kv_cache, layer, md, window, soft_cap):
    """Every token of the sequences with more than one token this step, tile by tile.

    qg: [T, KVH, G, D] f32 scaled queries; out: [T, KVH, G, D] to update in place.
    """
    T, KVH, G, D = qg.shape
    bs = md.block_size
    chunk = kv_chunk(bs)
    qt = md.q_tile
    rows = jnp.arange(qt)

    def tile(w, out):
        s_id = md.tile_seq[w]
        start = md.tile_start[w]
        seq_end = md.query_start_loc[s_id + 1]
        base = jnp.minimum(start, T - qt)  # dynamic_slice would clamp; keep the offset explicit
        q = jax.lax.dynamic_slice_in_dim(qg, base, qt)  # [qt, KVH, G, D]
        pos = jax.lax.dynamic_slice_in_dim(md.positions, base, qt)
        valid = (base + rows >= start) & (base + rows < jnp.minimum(start + qt, seq_end))
        q_hi = jnp.max(jnp.where(valid, pos, 0))
        q_lo = jnp.min(jnp.where(valid, pos, jnp.iinfo(jnp.int32).max))
        lo = 0 if window is None else jnp.maximum(q_lo - window + 1, 0)
        table = md.block_tables[s_id]

        def body(c, state):
            slots = _chunk_slots(table, c, chunk, bs)  # [C]
            k = kvq.read(kv_cache, layer, 0, slots)  # [C, KVH, D]
            v = kvq.read(kv_cache, layer, 1, slots)
            s = _softcap(jnp.einsum("qkgd,ckd->qkgc", q, k), soft_cap)
            k_pos = c * chunk + jnp.arange(chunk)
            mask = k_pos[None, :] <= pos[:, None]
            if window is not None:
                mask &= k_pos[None, :] > pos[:, None] - window
            return _online_update(state, s, lambda p: jnp.einsum("qkgc,ckd->qkgd", p, v),
                                  mask[:, None, None, :])

        init = (jnp.full((qt, KVH, G), _NEG, jnp.float32), jnp.zeros((qt, KVH, G), jnp.float32),
                jnp.zeros((qt, KVH, G, D), jnp.float32))
        res = _finish(jax.lax.fori_loop(lo // chunk, q_hi // chunk + 1, body, init))
        old = jax.lax.dynamic_slice_in_dim(out, base, qt)
        new = jnp.where(valid[:, None, None, None], res, old)
        return jax.lax.dynamic_update_slice_in_dim(out, new, base, axis=0)

    return jax.lax.fori_loop(0, md.num_tiles, tile, out)


def paged_attention_xla(q: jax.Array, kv_cache: jax.Array, layer: jax.Array,
                        md: AttentionMetadata, scale: float, sliding_window: int | None = None,
                        soft_cap: float | None = None, use_kernel: bool | None = None) -> jax.Array:
    """Causal attention of each token over its sequence's cached context (this step included).

    q: [T, H, D]. Two passes share the work: every sequence's last token (all of a decode
    batch) is done for all sequences at once; the other tokens of prefill chunks go tile by
    tile, and that pass is skipped at run time when the step has no prefill (and left out
    of a decode-only step shape, whose metadata has no room for tiles). use_kernel: both
    passes in the CPU kernels (None: where cpu_kernels_apply).
    """
    T, H, D = q.shape
    KVH = (kv_cache.data if isinstance(kv_cache, kvq.QuantizedKV) else kv_cache).shape[2]
    G = H // KVH
    qg = (q.astype(jnp.float32) * scale).reshape(T, KVH, G, D)
    last = md.query_start_loc[1:] - 1
    if use_kernel is None:
        use_kernel = cpu_kernels_apply(kv_cache)
    if use_kernel:
        dec = cpu_attention.decode_attention(qg[jnp.maximum(last, 0)], kv_cache, layer, md.block_tables,
                                   md.seq_lens, _window_start(md, sliding_window), md.block_size,
                                   soft_cap)
    else:
        dec = _decode_pass(qg[jnp.maximum(last, 0)], kv_cache, layer, md, sliding_window, soft_cap)
    # padded sequence rows (seq_len 0) write nowhere
    dst = jnp.where(md.seq_lens > 0, last, T)
    out = jnp.zeros_like(qg).at[dst].set(dec, mode="drop")
    if use_kernel:
        def prefill(o):
            tiles = cpu_attention.prefill_attention(qg, kv_cache, layer, md, sliding_window, soft_cap)
            n = md.query_start_loc[1:] - md.query_start_loc[:-1]
            in_tile = (n[md.token_seq_ids] > 1) & (jnp.arange(T) < md.query_start_loc[-1])
            return jnp.where(in_tile[:, None, None, None], tiles, o)
    else:
        def prefill(o):
            return _prefill_pass(qg, o, kv_cache, layer, md, sliding_window, soft_cap)
    if md.tile_seq.shape[0]:  # (a decode-only step shape has no room for tiles)
        out = jax.lax.cond(md.num_tiles > 0, prefill, lambda o: o, out)
    return out.reshape(T, H, D).astype(q.dtype)


# "cpu": the CPU kernels where the step runs on a CPU and they build, XLA's ops elsewhere;
# "xla": XLA's ops; "pallas-mosaic" / "pallas-triton": the Pallas kernels (GPU); "pallas" is
# resolved to one of them at start-up (jaxllm.kernels.attention_backend), Triton here
BACKENDS = ("cpu", "xla", "pallas", "pallas-mosaic", "pallas-triton")


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "interpret",
                                             "kernels"))
def _pallas_attention(q, kv_cache, layer, md, *, scale, sliding_window, soft_cap, interpret,
                      kernels):
    """The Pallas kernels behind one jit: a model whose layers are unrolled calls it once per
    layer with the same shapes, and JAX lowers it once per step rather than once per layer
    (lowering a Mosaic GPU kernel takes a good fraction of a second)."""
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention
    return ragged_paged_attention(q, kv_cache, layer, md, scale, sliding_window, soft_cap,
                                  interpret=interpret, kernels=kernels)


def paged_attention(q, kv_cache, layer, md, scale, sliding_window=None, soft_cap=None,
                    backend="cpu", platform=None):
    """platform: where the step runs (jaxllm.parallel.platform_of); off a GPU the Pallas
    kernels run in their interpreter (tests, CPU runs)."""
    if backend in ("cpu", "xla"):
        return paged_attention_xla(q, kv_cache, layer, md, scale, sliding_window, soft_cap,
                                   backend == "cpu" and cpu_kernels_apply(kv_cache, platform))
    if backend.startswith("pallas") and backend in BACKENDS:
        return _pallas_attention(q, kv_cache, layer, md, scale=scale,
                                 sliding_window=sliding_window, soft_cap=soft_cap,
                                 interpret=(platform or jax.default_backend()) != "gpu",
                                 kernels="mosaic" if backend == "pallas-mosaic" else "triton")
    raise ValueError(f"unknown attention backend {backend!r}; choose from {BACKENDS}")


def attention_block(q, k, v, kv_cache, layer, md, scale, sliding_window=None, backend="cpu",
                    mesh=None, soft_cap=None):
    """Write the step's K/V into the cache, then attend: (out [T, H, D], new cache). Under
    tensor parallelism both run per device on its heads (shard_map), with specs from the
    same logical-axis table as the parameters."""
    from jaxllm.parallel import platform_of
    platform = platform_of(mesh)

    def local(q, k, v, kv_cache, layer, md):
        kv_cache = write_kv(kv_cache, layer, k, v, md.slot_mapping)
        return paged_attention(q, kv_cache, layer, md, scale, sliding_window, soft_cap,
                               backend, platform), kv_cache

    if mesh is None or mesh.size == 1:
        return local(q, k, v, kv_cache, layer, md)
    from jax.sharding import PartitionSpec as P

    from jaxllm.parallel import spec
    heads, kv_heads = spec(None, "heads", None), spec(None, "kv_heads", None)
    cache = jax.tree.map(lambda axes: spec(*axes),
                         kvq.cache_axes(("layers", "kv", "kv_heads", "slots", "head_dim"), kv_cache),
                         is_leaf=lambda x: isinstance(x, tuple))
    return jax.shard_map(local, mesh=mesh, in_specs=(heads, kv_heads, kv_heads, cache, P(), P()),
                         out_specs=(heads, cache), check_vma=False)(q, k, v, kv_cache, layer, md)
