"""Ragged paged attention as Pallas kernels: one call serves a flat batch that mixes prefill
chunks and decodes, reading K and V from the paged cache through block tables.

Two kernels share the work, as the XLA path in jaxllm/layers/attention.py does:

* decode: the last token of every sequence (the whole batch when it is pure decode) against
  its context; grid (sequence, KV head, split). Long contexts are split across programs and
  the partial results combined by their log-sum-exp (split-K). The query heads of one KV head
  share its K/V loads (GQA), padded to 16 rows for the tensor-core dot.
* prefill tiles: every token of the sequences with more than one token this step, in tiles
  of `q_tile` tokens x the KV head's query heads; grid (tile, KV head). Each tile walks the
  pages of its sequence up to its causal limit.

Only portable Pallas is used (BlockSpecs over the grid, dynamic slices, a vector gather of
pages, fori_loop, cond), so the kernels run in interpret mode on a CPU and lower through
Pallas' Triton path on NVIDIA GPUs. The cache is read as one flat page array
`[layers * 2 * kv_heads * blocks, block_size, head_dim]` (a free reshape of the engine's
`[layers, 2, kv_heads, slots, head_dim]`), so the layer index can be a run-time value.

`jaxllm bench aot` compiles both kernels for an H100 without one and reports ptxas' register
and spill counts: the decode kernel lowers to mma.sync tiles with cp.async loads, the prefill
tiles to Hopper's wgmma; the per-dtype key chunk and warp counts below keep them inside the
SM's shared memory and spill-free at power-of-two head sizes (the decode kernel padded from 80
or 96 spills a few dozen bytes).

These are the fallback on GPUs without Mosaic GPU support (before Hopper) and for caches the
Mosaic kernels (mosaic_paged_attention.py) do not take (f32, int8/fp8); `ragged_paged_attention`
below runs either family. Triton's blocks must be powers of two: a head size that is not one
(80, 96) is padded to one inside the kernels (q and the output outside, the pages by a masked
gather as they are loaded).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.split_k import combine_splits

_NEG = -1e30
DECODE_ROWS = 16  # query rows per decode program: the smallest tensor-core tile
DECODE_WARPS, PREFILL_WARPS = 4, 8


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def keys_per_step(head_dim: int, dtype) -> int:
    """Keys per loop iteration: at most 128, and a K (or V) chunk of at most 32 KiB in bf16 or
    16 KiB in f32, so that two pipeline stages of K and V plus the query tile fit in an SM's
    shared memory (f32 at head_dim 128 with 128 keys asks for 270 KB of the H100's 227 KB)."""
    size = jnp.dtype(dtype).itemsize
    budget = 16384 if size >= 4 else 32768
    keys = max(16, min(128, budget // (head_dim * size)))
    return 1 << (keys.bit_length() - 1)  # a power of two: Triton blocks, table splits


def pages_per_step(block_size: int, keys: int = 128) -> int:
    """Pages gathered per loop iteration: `keys` tokens of K and of V, a power of two so
    that it divides the (power-of-two) table width and every split of it."""
    pps = max(1, keys // block_size)
    return 1 << (pps.bit_length() - 1)


def q_tile(kv_group: int) -> int:
    """Tokens per prefill tile: 128 query rows (tokens x padded query heads per KV head)."""
    return max(1, 128 // next_pow2(kv_group))


def decode_splits(num_seqs: int, kv_heads: int, programs: int = 1024) -> int:
    """Split-K only pays while (sequence, KV head) programs leave the GPU's SMs idle: split
    until about `programs` are in flight (a few waves on an H100's 132 SMs), at most 16."""
    return min(16, next_pow2(max(1, -(-programs // (num_seqs * kv_heads)))))


def _triton(num_warps: int):
    # Pallas picks Mosaic GPU for a bare pallas_call on NVIDIA; these kernels are written for
    # the Triton lowering (vector page gathers, any grid), so ask for it by name
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=2)


def _prec(dtype, interpret: bool):
    """f32 inputs must not silently drop to TF32: on a GPU they take three TF32 tensor-core
    passes (near-f32 error; plain f32 FMA dots spill kilobytes of registers per thread), in
    interpret mode exact f32."""
    if dtype != jnp.float32:
        return None
    return jax.lax.Precision.HIGHEST if interpret else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _scores(q, k, scale, soft_cap, prec, k_scale=None):
    """k_scale [keys]: a quantized cache's per-key scale, applied to the scores."""
    s = jax.lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32)
    s = s * (scale if k_scale is None else scale * k_scale[None, :])
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return s


def _online(carry, s, v, prec, dtype, v_scale=None):
    """One online-softmax step over a chunk of keys (masked scores are already _NEG);
    v_scale [keys]: a quantized cache's per-value scale, folded into the probabilities."""
    o, m, l = carry
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp(s - m_new[:, None])
    corr = jnp.exp(m - m_new)
    pw = p if v_scale is None else p * v_scale[None, :]
    pv = jax.lax.dot_general(pw.astype(dtype), v.astype(dtype), (((1,), (0,)), ((), ())),
                             precision=prec, preferred_element_type=jnp.float32)
    return o * corr[:, None] + pv, m_new, l * corr + p.sum(axis=-1)


def flat_pages(kv_cache: jax.Array, block_size: int) -> jax.Array:
    L, two, KVH, slots, D = kv_cache.shape
    return kv_cache.reshape(L * two * KVH * (slots // block_size), block_size, D)


def _load_pages(pages_ref, ids, width: int):
    """Pages `ids` of the flat page array, each row padded to `width` (the next power of two
    of the head size: Triton's blocks are powers of two) when the head size is not one (80,
    96...): with zeros by a masked gather, or for 8-bit values (whose zero Triton cannot
    splat) with copies of the last column. Either is harmless: the queries' padded columns
    are zeros, and the output's are cut off."""
    _, bs, D = pages_ref.shape
    if D == width:
        return pages_ref[ids]
    shape = (ids.shape[0], bs, width)
    row = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    col = jax.lax.broadcasted_iota(jnp.int32, shape, 2)
    at = pages_ref.at[ids[:, None, None], row, jnp.minimum(col, D - 1)]
    if jnp.dtype(pages_ref.dtype).itemsize == 1:
        return pltriton.load(at)
    return pltriton.load(at, mask=col < D, other=0)


def _page_scales(scales_ref, k_pages, v_pages, chunk):
    """The per-token scales of a quantized cache's K and V pages (None, None otherwise)."""
    if scales_ref is None:
        return None, None
    return scales_ref[k_pages].reshape(chunk), scales_ref[v_pages].reshape(chunk)


# decode
def _decode_kernel(layer_ref, q_ref, pages_ref, *refs, kv_heads, blocks, block_size,
                   pages_per_split, pps, scale, soft_cap, prec, quantized):
    scales_ref, refs = (refs[0], refs[1:]) if quantized else (None, refs)
    table_ref, len_ref, lo_ref, o_ref, m_ref, l_ref = refs
    h = pl.program_id(1)
    split = pl.program_id(2)
    rows, D = q_ref.shape
    chunk = pps * block_size
    layer = layer_ref[0]
    length = len_ref[0]
    lo = lo_ref[0]
    k_base = (layer * 2 * kv_heads + h) * blocks
    v_base = k_base + kv_heads * blocks
    first = split * pages_per_split
    # this split's pages that hold context in the window: [start, end)
    start = jnp.maximum(first, lo // block_size)
    end = jnp.minimum(first + pages_per_split, pl.cdiv(length, block_size))
    q = q_ref[...]

    def body(c, carry):
        ids = table_ref[pl.ds(c * pps, pps)]
        k = _load_pages(pages_ref, k_base + ids, D).reshape(chunk, D)
        v = _load_pages(pages_ref, v_base + ids, D).reshape(chunk, D)
        ks, vs = _page_scales(scales_ref, k_base + ids, v_base + ids, chunk)
        s = _scores(q, k, scale, soft_cap, prec, ks)
        pos = (first + c * pps) * block_size + jax.lax.broadcasted_iota(jnp.int32, (rows, chunk), 1)
        s = jnp.where((pos < length) & (pos >= lo), s, _NEG)
        return _online(carry, s, v, prec, q.dtype, vs)

    init = (jnp.zeros((rows, D), jnp.float32), jnp.full((rows,), _NEG, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, m, l = jax.lax.cond(
        start < end,
        lambda: jax.lax.fori_loop((start - first) // pps, pl.cdiv(end - first, pps), body, init),
        lambda: init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def paged_decode(q, pages, layer, tables, lens, lo, *, kv_heads, blocks, block_size, scale,
                 soft_cap=None, k_splits=8, keys=None, num_warps=DECODE_WARPS,
                 interpret=False, page_scales=None):
    """One query token per sequence against its context, split-K over the context.

    q: [S, KVH, G, D]; pages: flat_pages(cache); layer: [1] i32; tables: [S, MB];
    lens: [S] context lengths (0: padded row); lo: [S] first position in the window.
    Returns [S, KVH, G, D] f32. A head size that is not a power of two is padded to one in
    the kernel (q and the output here, the pages as they are loaded)."""
    S, KVH, G, D_in = q.shape
    D = next_pow2(D_in)
    rows = max(DECODE_ROWS, next_pow2(G))
    pps = pages_per_step(block_size, keys or keys_per_step(D, pages.dtype))
    width = max(next_pow2(tables.shape[1]), pps)
    k_splits = max(1, min(k_splits, width // pps))
    per_split = width // k_splits
    tables = jnp.pad(tables, ((0, 0), (0, width - tables.shape[1])))
    qp = jnp.pad(q, ((0, 0), (0, 0), (0, rows - G), (0, D - D_in)))
    quantized = page_scales is not None
    kernel = functools.partial(
        _decode_kernel, kv_heads=KVH, blocks=blocks, block_size=block_size,
        pages_per_split=per_split, pps=pps, scale=scale, soft_cap=soft_cap,
        prec=_prec(q.dtype, interpret), quantized=quantized)
    scales = [pl.BlockSpec(page_scales.shape, lambda s, h, k: (0, 0))] if quantized else []
    o, m, l = pl.pallas_call(
        kernel,
        grid=(S, KVH, k_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda s, h, k: (0,)),                           # layer
            pl.BlockSpec((None, None, rows, D), lambda s, h, k: (s, h, 0, 0)),  # q
            pl.BlockSpec(pages.shape, lambda s, h, k: (0, 0, 0)),               # pages
            *scales,                                                            # their scales
            pl.BlockSpec((None, per_split), lambda s, h, k: (s, k)),            # table
            pl.BlockSpec((1,), lambda s, h, k: (s,)),                           # lens
            pl.BlockSpec((1,), lambda s, h, k: (s,)),                           # lo
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, D), lambda s, h, k: (k, s, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda s, h, k: (k, s, h, 0)),
            pl.BlockSpec((None, None, None, rows), lambda s, h, k: (k, s, h, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((k_splits, S, KVH, rows, D), jnp.float32),
                   jax.ShapeDtypeStruct((k_splits, S, KVH, rows), jnp.float32),
                   jax.ShapeDtypeStruct((k_splits, S, KVH, rows), jnp.float32)],
        interpret=interpret,
        compiler_params=None if interpret else _triton(num_warps),
        name="jaxllm_paged_decode",
    )(layer, qp, pages, *([page_scales] if quantized else []), tables, lens, lo)
    return combine_splits(o, m, l)[:, :, :G, :D_in]


# prefill tiles
def _tile_kernel(layer_ref, q_ref, pages_ref, *refs, kv_heads, blocks, block_size, pps, window,
                 scale, soft_cap, prec, quantized):
    scales_ref, refs = (refs[0], refs[1:]) if quantized else (None, refs)
    table_ref, meta_ref, o_ref = refs
    h = pl.program_id(1)
    qt, gp, D = o_ref.shape
    rows = qt * gp
    chunk = pps * block_size
    layer = layer_ref[0]
    start, pos0, nrows = meta_ref[0], meta_ref[1], meta_ref[2]
    k_base = (layer * 2 * kv_heads + h) * blocks
    v_base = k_base + kv_heads * blocks
    q = q_ref[pl.ds(start, qt)].reshape(rows, D)
    # row r is token r // gp of the tile, query head r % gp of this KV head
    q_pos = pos0 + jax.lax.broadcasted_iota(jnp.int32, (rows, chunk), 0) // gp
    hi = pos0 + jnp.maximum(nrows, 1)  # keys before this bound can be visible
    lo = 0 if window is None else jnp.maximum(pos0 - window + 1, 0)

    def body(c, carry):
        ids = table_ref[pl.ds(c * pps, pps)]
        k = _load_pages(pages_ref, k_base + ids, D).reshape(chunk, D)
        v = _load_pages(pages_ref, v_base + ids, D).reshape(chunk, D)
        ks, vs = _page_scales(scales_ref, k_base + ids, v_base + ids, chunk)
        s = _scores(q, k, scale, soft_cap, prec, ks)
        k_pos = c * chunk + jax.lax.broadcasted_iota(jnp.int32, (rows, chunk), 1)
        ok = k_pos <= q_pos
        if window is not None:
            ok &= k_pos > q_pos - window
        return _online(carry, jnp.where(ok, s, _NEG), v, prec, q.dtype, vs)

    init = (jnp.zeros((rows, D), jnp.float32), jnp.full((rows,), _NEG, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, _, l = jax.lax.cond(
        nrows > 0, lambda: jax.lax.fori_loop(lo // chunk, pl.cdiv(hi, chunk), body, init),
        lambda: init)
    o = o / jnp.maximum(l, 1e-30)[:, None]
    o_ref[...] = o.reshape(qt, gp, D).astype(o_ref.dtype)


def paged_prefill_tiles(q, pages, layer, tables, meta, *, kv_heads, blocks, block_size, qt,
                        scale, window=None, soft_cap=None, keys=None,
                        num_warps=PREFILL_WARPS, interpret=False, page_scales=None):
    """q: [KVH, T, Gp, D] queries by KV head (padded with qt rows at the end);
    tables: [W, MB] the block-table row of each tile's sequence; meta: [W, 4] (first token,
    its position, valid rows, its sequence). Returns [W, KVH, qt, Gp, D] f32."""
    KVH, Tp, gp, D_in = q.shape
    D = next_pow2(D_in)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, D - D_in)))
    W = meta.shape[0]
    pps = pages_per_step(block_size, keys or keys_per_step(D, pages.dtype))
    width = max(next_pow2(tables.shape[1]), pps)
    tables = jnp.pad(tables, ((0, 0), (0, width - tables.shape[1])))
    quantized = page_scales is not None
    kernel = functools.partial(
        _tile_kernel, kv_heads=KVH, blocks=blocks, block_size=block_size, pps=pps,
        window=window, scale=scale, soft_cap=soft_cap, prec=_prec(q.dtype, interpret),
        quantized=quantized)
    scales = [pl.BlockSpec(page_scales.shape, lambda w, h: (0, 0))] if quantized else []
    return pl.pallas_call(
        kernel,
        grid=(W, KVH),
        in_specs=[
            pl.BlockSpec((1,), lambda w, h: (0,)),                      # layer
            pl.BlockSpec((None, Tp, gp, D), lambda w, h: (h, 0, 0, 0)),  # q of this KV head
            pl.BlockSpec(pages.shape, lambda w, h: (0, 0, 0)),          # pages
            *scales,                                                    # their scales
            pl.BlockSpec((None, width), lambda w, h: (w, 0)),           # the tile's table row
            pl.BlockSpec((None, 4), lambda w, h: (w, 0)),               # the tile's meta
        ],
        out_specs=pl.BlockSpec((None, None, qt, gp, D), lambda w, h: (w, h, 0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((W, KVH, qt, gp, D), jnp.float32),
        interpret=interpret,
        compiler_params=None if interpret else _triton(num_warps),
        name="jaxllm_paged_prefill",
    )(layer, q, pages, *([page_scales] if quantized else []), tables, meta)[..., :D_in]


def ragged_paged_attention(q, kv_cache, layer, md, scale, sliding_window=None, soft_cap=None,
                           *, interpret=False, k_splits=None, poison=False, tuning=None,
                           kernels="triton"):
    """Drop-in for the XLA path: q [T, H, D] with the step's K/V already in kv_cache.

    md: the step's AttentionMetadata; its tiles must have been cut with q_tile(G) tokens.
    kernels: "triton" (this module's kernels) or "mosaic" (mosaic_paged_attention.py's, for
    Hopper; bf16/fp16 queries), the rest of the step being the same.
    poison (tests): tokens that no kernel writes come out NaN instead of zero.
    tuning (benchmarks): {"decode": {keys, num_warps}, "prefill": {keys, num_warps}} in place
    of the defaults ({"decode": {stages}, "prefill": {stages}} for the Mosaic kernels).
    """
    tuning = tuning or {}
    T, H, D = q.shape
    # a quantized cache (jaxllm.quantization.kv.QuantizedKV): int8 / fp8 values and a scale
    # per token and KV head, which the kernels apply to the scores and the probabilities
    quantized = hasattr(kv_cache, "scale")
    data = kv_cache.data if quantized else kv_cache
    L, _, KVH, slots, _ = data.shape
    G = H // KVH
    bs = md.block_size
    blocks = slots // bs
    pages = flat_pages(data, bs)
    page_scales = kv_cache.scale.reshape(-1, bs) if quantized else None
    layer = jnp.reshape(layer, (1,)).astype(jnp.int32)
    dtype = q.dtype if quantized else data.dtype  # what the dots compute in
    qg = q.astype(dtype).reshape(T, KVH, G, D)
    S = md.seq_lens.shape[0]
    if k_splits is None:
        k_splits = 1 if interpret else decode_splits(S, KVH)
    if kernels == "mosaic":
        from pallas_kernels import mosaic_paged_attention as mosaic
        why = mosaic.supports(dtype, D, data.dtype if quantized else None)
        if why:
            raise ValueError(f"attention_backend 'pallas-mosaic': {why}")
        if quantized:
            qg = qg.astype(mosaic.matmul_dtype(q.dtype))
        mosaic_args = dict(interpret=mosaic.interpret_params() if interpret else None,
                           seq_scales=mosaic.sequence_scales(kv_cache.scale, layer,
                                                             md.block_tables, bs)
                           if quantized else None)
        decode_fn = functools.partial(mosaic.paged_decode, **mosaic_args,
                                      **tuning.get("decode", {}))
        tiles_fn = functools.partial(mosaic.paged_prefill_tiles, **mosaic_args,
                                     **tuning.get("prefill", {}))
    elif kernels == "triton":
        quant_args = dict(interpret=interpret, page_scales=page_scales)
        decode_fn = functools.partial(paged_decode, **quant_args, **tuning.get("decode", {}))
        tiles_fn = functools.partial(paged_prefill_tiles, **quant_args,
                                     **tuning.get("prefill", {}))
    else:
        raise ValueError(f"kernels must be 'triton' or 'mosaic', got {kernels!r}")

    # decode: the last token of every sequence
    last = jnp.maximum(md.query_start_loc[1:] - 1, 0)
    q_pos = md.positions[last]
    lo = (jnp.zeros_like(md.seq_lens) if sliding_window is None
          else jnp.maximum(q_pos - sliding_window + 1, 0))
    dec = decode_fn(qg[last], pages, layer, md.block_tables, md.seq_lens, lo, kv_heads=KVH,
                    blocks=blocks, block_size=bs, scale=scale, soft_cap=soft_cap,
                    k_splits=k_splits)
    dst = jnp.where(md.seq_lens > 0, last, T)  # padded rows write nowhere
    out = jnp.full((T, KVH, G, D), jnp.nan if poison else 0.0, jnp.float32)
    out = out.at[dst].set(dec, mode="drop")

    # prefill tiles: none in a decode-only step shape (no room for them in its metadata);
    # on a GPU every tile's program runs (one without tokens reads no keys) rather than a
    # branch on whether the step has any, because XLA's GPU runtime reads a branch's
    # predicate back to the host: a wait for the device in every layer. The interpreter
    # (CPU tests) skips them at run time.
    if md.tile_seq.shape[0] == 0:
        return out.reshape(T, H, D).astype(q.dtype)
    qt = q_tile(G)
    gp = next_pow2(G)

    def prefill(out):
        W = md.tile_seq.shape[0]
        w_idx = jnp.arange(W)
        live = w_idx < md.num_tiles
        start = md.tile_start
        seq_end = md.query_start_loc[md.tile_seq + 1]
        nrows = jnp.where(live, jnp.clip(seq_end - start, 0, qt), 0)
        pos0 = md.positions[jnp.minimum(start, T - 1)]
        meta = jnp.stack([start, pos0, nrows, md.tile_seq], axis=1).astype(jnp.int32)
        qk = jnp.pad(qg.transpose(1, 0, 2, 3), ((0, 0), (0, qt), (0, gp - G), (0, 0)))
        tiles = tiles_fn(qk, pages, layer, md.block_tables[md.tile_seq], meta, kv_heads=KVH,
                         blocks=blocks, block_size=bs, qt=qt, scale=scale,
                         window=sliding_window, soft_cap=soft_cap)
        # each token of a tile goes back to its place in the flat layout
        tok = start[:, None] + jnp.arange(qt)[None, :]                    # [W, qt]
        ok = jnp.arange(qt)[None, :] < nrows[:, None]
        tok = jnp.where(ok, tok, T).reshape(-1)
        vals = tiles[:, :, :, :G].transpose(0, 2, 1, 3, 4).reshape(W * qt, KVH, G, D)
        return out.at[tok].set(vals, mode="drop")

    if interpret:
        out = jax.lax.cond(md.num_tiles > 0, prefill, lambda o: o, out)
    else:
        out = prefill(out)
    return out.reshape(T, H, D).astype(q.dtype)
