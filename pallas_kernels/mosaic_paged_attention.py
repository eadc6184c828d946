"""Ragged paged attention on Mosaic GPU (`plgpu.kernel`), for Hopper and later: the same two
kernels as ragged_paged_attention.py (decode rows with split-K, prefill tiles), written for
Hopper's TMA and warpgroup matmuls instead of Triton's vector gathers.

* K and V come in page by page: one TMA copy per page (`block_size` x `head_dim`) straight
  from the flat page array into swizzled shared memory, its index read from the block table.
  A chunk of 64 keys (or one page when pages are larger) is one pipeline stage; the stages
  form a ring that is refilled as soon as a chunk has been consumed, so the next chunks'
  copies overlap this chunk's matmuls. The ring is as deep as shared memory allows.
* QK^T and PV are warpgroup matmuls (wgmma) with the accumulators in registers and the online
  softmax done in the WGMMA register layout; P goes to the PV matmul from registers, which
  accumulates in place into the output's registers.
* decode: one program per (sequence, KV head, split); the KV head's query heads are padded to
  the 64 rows of a warpgroup matmul (decode is bound by reading K and V, not by the matmul).
  Split-K partials are combined by their log-sum-exp outside, as for the Triton kernel.
* prefill: one program per (tile, KV head), 128 rows (tokens x the KV head's query heads, as
  the Triton tiles cut them), the output written back through the query's shared memory.

Head sizes are any multiple of 16 (64, 80, 96, 128, 256...): the swizzle is the widest of
128/64/32 bytes that divides a row. The matmuls take bf16 or fp16 (an f32 cache would run the
tensor cores in TF32; `supports()` refuses it and the engine falls back to the Triton kernels).

Quantized caches (int8 or fp8 e4m3 values, a float32 scale per token and KV head): the ring
holds the 8-bit pages as they are (half the bytes to copy) and each chunk's scales; a
dequantising stage turns the chunk into bf16 (fp16 for fp16 queries) in a shared-memory
buffer (values times their token's scale, in the warpgroup matmul's register layout) that
the matmuls then read as they read a bf16 ring. The scales are gathered per sequence before
the kernels (`sequence_scales`): one page's alone are fewer bytes than a TMA copy moves.

On a CPU the kernels run in Mosaic GPU's interpret mode (`interpret_params`), which simulates
shared memory, the TMA engine and barriers. It has no wgmma for a transposed or register
operand (nor `run_state`), so there the two matmuls are plain dots over the same shared-memory
buffers.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.split_k import combine_splits

_NEG = -1e30
DECODE_ROWS = 64   # one warpgroup matmul's M
PREFILL_ROWS = 128
SMEM_BYTES = 227 * 1024  # Hopper's shared memory per block
MAX_STAGES = 4


def interpret_params(detect_races: bool = True):
    """Mosaic GPU's interpret mode. It lives under jax._src (a private path, subject to
    change): this is the one place the project reaches into it."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(detect_races=detect_races)


def races_found() -> bool:
    """Whether the interpret mode's race detector saw a race since the last run started."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    return gpu_callbacks.get_races().races_found


QUANTIZED = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def supports(dtype, head_dim: int, values=None) -> str | None:
    """None when these kernels handle the cache, else why not. dtype: a float cache's;
    values: a quantized cache's values' dtype (None for a float cache), whose matmuls run in
    matmul_dtype(queries)."""
    if values is None and jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"the Mosaic kernels take bf16 or fp16 caches, not {jnp.dtype(dtype).name}"
    if values is not None and jnp.dtype(values) not in QUANTIZED:
        return f"quantized caches of int8 or fp8 (e4m3) values, not {jnp.dtype(values).name}"
    if head_dim % 16:
        return f"head size {head_dim} is not a multiple of 16"
    return None


def matmul_dtype(query_dtype):
    """What a quantized cache's matmuls take: fp16 for fp16 queries, else bf16 (which holds
    every int8 and e4m3 value exactly; f32 queries are rounded to it, as they are to a bf16
    cache's dtype)."""
    return jnp.float16 if jnp.dtype(query_dtype) == jnp.float16 else jnp.bfloat16


def chunk_keys(block_size: int) -> int:
    """Keys per pipeline stage: 64 (the K step of the PV matmul), or one page when pages are
    larger; pages must tile it."""
    chunk = max(64, block_size)
    if chunk % block_size:
        raise ValueError(f"block_size {block_size} must divide 64 or be a multiple of it")
    return chunk


def _swizzle(head_dim: int, dtype) -> tuple:
    row = head_dim * jnp.dtype(dtype).itemsize
    for sw in (128, 64, 32):
        if row % sw == 0:
            return (plgpu.TilingTransform((8, sw // jnp.dtype(dtype).itemsize)),
                    plgpu.SwizzleTransform(sw))
    raise ValueError(f"head size {head_dim} is not a multiple of 16")


def stages_for(fixed_bytes: int, per_stage: int, head_dim: int) -> int:
    """The deepest K/V ring (at most MAX_STAGES) that fits beside `fixed_bytes`."""
    stages = min(MAX_STAGES, (SMEM_BYTES - fixed_bytes) // per_stage)
    if stages < 1:
        raise ValueError(f"head size {head_dim} does not fit in shared memory")
    return stages


class _Ops:
    """What differs between the GPU and the interpreter: layouts and the matmuls."""

    def __init__(self, interpret):
        self.real = interpret is None

    def cast(self, x, layout):
        return plgpu.layout_cast(x, layout) if self.real else x

    def load(self, ref, layout):
        return plgpu.load(ref, (), layout=layout) if self.real else ref[...]

    def iota(self, shape, dim):
        if self.real:
            return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)
        return lax.broadcasted_iota(jnp.int32, shape, dim)

    def mma(self, a, b_ref, transpose_b: bool, shape):
        """a @ b (or a @ b.T) in f32; a is a shared-memory ref or a register array."""
        if self.real:
            def run(acc_ref):
                b = plgpu.transpose_ref(b_ref, (1, 0)) if transpose_b else b_ref
                plgpu.wgmma(acc_ref, a, b)
                return acc_ref[...]
            return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))
        a = a if isinstance(a, jax.Array) else a[...]
        return lax.dot_general(a, b_ref[...], (((1,), (1 if transpose_b else 0,)), ((), ())),
                               preferred_element_type=jnp.float32)

    def mma_acc(self, acc, a, b_ref):
        """acc + a @ b: on the GPU accumulated in place in acc's registers (a second
        accumulator for the product would double the registers a row takes)."""
        if self.real:
            def run(acc_ref):
                plgpu.wgmma(acc_ref, a, b_ref)
            return pl.run_state(run)(plgpu.ACC.init(acc))
        return acc + lax.dot_general(a, b_ref[...], (((1,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)

    def init(self, rows, D):
        acc = self.cast(jnp.zeros((rows, D), jnp.float32), plgpu.Layout.WGMMA)
        m = self.cast(jnp.full((rows,), _NEG, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l = self.cast(jnp.zeros((rows,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        return acc, m, l


def _attend(ops, q_smem, ring, slot, carry, ok, scale, soft_cap, dtype, rows, chunk):
    """One chunk of the online softmax (the chunk in ring slot `slot`): scores, the mask `ok`
    (visible keys), rescale, PV."""
    acc, m, l = carry
    s = ops.mma(q_smem, ring.keys(ops, slot), True, (rows, chunk)) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(ok, s, _NEG)
    m_new = jnp.maximum(m, s.max(axis=1))
    corr = jnp.exp(m - m_new)
    p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    l = l * corr + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(corr, acc.shape, [0])
    acc = ops.mma_acc(acc, p.astype(dtype), ring.values(ops, slot))
    return acc, m_new, l


class _Ring:
    """A kernel's K/V ring: `stages` chunks of `chunk` keys, each chunk's K and V pages copied
    in by TMA on one barrier each. For a quantized cache (values: int8 / fp8) the ring holds
    the 8-bit pages and the chunk's scales, and a dequantising stage writes each chunk into
    one buffer for K and one for V in the matmuls' dtype."""

    def __init__(self, D, dtype, values, stages_fixed, chunk, ppc, bs, stages=None):
        self.D, self.dtype, self.chunk, self.ppc, self.bs = D, dtype, chunk, ppc, bs
        self.quantized = values is not None
        self.store = jnp.dtype(values) if self.quantized else jnp.dtype(dtype)
        per_stage = 2 * chunk * D * self.store.itemsize + (2 * chunk * 4 if self.quantized else 0)
        fixed = stages_fixed + (2 * chunk * D * jnp.dtype(dtype).itemsize if self.quantized else 0)
        self.stages = stages or stages_for(fixed, per_stage, D)
        self.refs = None

    def scratch(self) -> list:
        """Its shared memory (before the kernel's own extra buffers)."""
        st, chunk, D = self.stages, self.chunk, self.D
        out = [plgpu.SMEM((st, chunk, D), self.store, transforms=_ring_transforms(D, self.store))
               for _ in range(2)]
        if self.quantized:
            out += [plgpu.SMEM((st, chunk), jnp.float32) for _ in range(2)]
            out += [plgpu.SMEM((chunk, D), self.dtype, transforms=_swizzle(D, self.dtype))
                    for _ in range(2)]
        return out

    def barriers(self) -> list:
        n = self.ppc + self.quantized  # the pages' copies, and the scales'
        return [plgpu.Barrier(num_arrivals=n, num_barriers=self.stages) for _ in range(2)]

    def take(self, refs: list, k_bar, v_bar) -> list:
        """Keep the ring's refs (the first of `refs`); returns the rest."""
        n = 6 if self.quantized else 2
        self.refs, self.k_bar, self.v_bar = refs[:n], k_bar, v_bar
        return refs[n:]

    def fetcher(self, pages_ref, page_of, k_base, v_base, scales=None):
        """fetch(c, slot): copy chunk c's K and V pages (and scales) into ring slot `slot`.
        scales: (this sequence and head's [2, keys] scales ref, c -> its first key)."""
        k_smem, v_smem = self.refs[:2]
        bs = self.bs

        def fetch(c, slot):
            for p in range(self.ppc):
                page = page_of(c * self.ppc + p)
                dst = pl.ds(p * bs, bs)
                plgpu.copy_gmem_to_smem(pages_ref.at[k_base + page], k_smem.at[slot, dst],
                                        self.k_bar.at[slot])
                plgpu.copy_gmem_to_smem(pages_ref.at[v_base + page], v_smem.at[slot, dst],
                                        self.v_bar.at[slot])
            if self.quantized:
                sc_ref, first_key = scales
                keys = pl.ds(first_key(c), self.chunk)
                plgpu.copy_gmem_to_smem(sc_ref.at[0, keys], self.refs[2].at[slot],
                                        self.k_bar.at[slot])
                plgpu.copy_gmem_to_smem(sc_ref.at[1, keys], self.refs[3].at[slot],
                                        self.v_bar.at[slot])
        return fetch

    def keys(self, ops, slot):
        """The chunk's K, ready for the matmul (its copies waited for)."""
        plgpu.barrier_wait(self.k_bar.at[slot])
        return self._ready(ops, 0, slot)

    def values(self, ops, slot):
        plgpu.barrier_wait(self.v_bar.at[slot])
        return self._ready(ops, 1, slot)

    def _ready(self, ops, which, slot):
        if not self.quantized:
            return self.refs[which].at[slot]
        # the codes times their token's scale, in the matmuls' register layout; the buffer's
        # previous chunk has been read (its matmul's result was waited for)
        sc = ops.load(self.refs[2 + which].at[slot], plgpu.Layout.WGMMA.reduce(1))
        out = self.refs[4 + which]
        for j in range(0, self.D, 128):  # past 128 columns, a piece at a time (registers)
            cols = pl.ds(j, min(128, self.D - j))
            x = ops.load(self.refs[which].at[slot, :, cols], plgpu.Layout.WGMMA)
            x = x.astype(jnp.float32)
            out[:, cols] = (x * lax.broadcast_in_dim(sc, x.shape, [0])).astype(self.dtype)
        plgpu.commit_smem()
        return out


def _ring_transforms(D, store) -> tuple:
    """The ring's layout in shared memory: swizzled as the matmuls want it, or for 8-bit
    values whose rows no swizzle divides (head size 80), plain rows (the dequantising stage
    reads them, not a matmul)."""
    try:
        return _swizzle(D, store)
    except ValueError:
        if store.itemsize == 1:
            return ()
        raise


def sequence_scales(scale, layer, tables, block_size):
    """A quantized cache's scales [L, 2, KVH, slots] for each sequence's keys in order:
    [S, KVH, 2, MB * block_size] (tables: [S, MB]). Gathered before the kernels so that a
    chunk's scales are one TMA copy: a page's alone are fewer bytes than one moves."""
    _, two, KVH, slots = scale.shape
    sc = lax.dynamic_index_in_dim(scale, layer[0], 0, keepdims=False)
    sc = sc.reshape(two, KVH, slots // block_size, block_size)[:, :, tables]  # [2,KVH,S,MB,bs]
    S, MB = tables.shape
    return sc.transpose(2, 1, 0, 3, 4).reshape(S, KVH, two, MB * block_size)


def _pipeline(fetch, c0, c1, stages, body, carry):
    """Run body(c, slot, carry) over chunks [c0, c1) with `stages` chunks in flight."""
    for i in range(stages):
        @pl.when(c0 + i < c1)
        def _():
            fetch(c0 + i, i)

    def step(c, carry):
        slot = lax.rem(c - c0, stages)
        carry = body(c, slot, carry)

        @pl.when(c + stages < c1)
        def _():
            fetch(c + stages, slot)
        return carry
    return lax.fori_loop(c0, c1, step, carry)


def _pad_keys(seq_scales, width: int, ring: _Ring, bs: int):
    """The scales padded to the (padded) tables' keys, and to a whole ring: the first
    chunks' copies are issued under a run-time condition, but their slices are checked when
    traced."""
    keys = max(width, ring.stages * ring.ppc) * bs
    return jnp.pad(seq_scales, ((0, 0), (0, 0), (0, 0), (0, keys - seq_scales.shape[-1])))


def paged_decode(q, pages, layer, tables, lens, lo, *, kv_heads, blocks, block_size, scale,
                 soft_cap=None, k_splits=1, stages=None, interpret=None, seq_scales=None):
    """One query token per sequence against its context, split-K over the context.

    q: [S, KVH, G, D]; pages: flat_pages(cache); layer: [1] i32; tables: [S, MB];
    lens: [S] context lengths (0: padded row); lo: [S] first position in the window;
    interpret: None on a GPU, interpret_params() elsewhere; seq_scales: a quantized cache's
    sequence_scales (pages then hold its int8 / fp8 values). Returns [S, KVH, G, D] f32."""
    S, KVH, G, D = q.shape
    dtype = q.dtype
    bs = block_size
    chunk = chunk_keys(bs)
    ppc = chunk // bs
    rows = DECODE_ROWS
    W = tables.shape[1]
    k_splits = max(1, min(k_splits, -(-W // ppc)))
    width = -(-W // (ppc * k_splits)) * ppc * k_splits
    tables = jnp.pad(tables, ((0, 0), (0, width - W)))
    per_split = width // k_splits
    qp = jnp.pad(q, ((0, 0), (0, 0), (0, rows - G), (0, 0)))
    quantized = seq_scales is not None
    size = jnp.dtype(dtype).itemsize
    ring = _Ring(D, dtype, pages.dtype if quantized else None,
                 rows * D * size + rows * D * 4 + 2 * rows * 4 + 4096, chunk, ppc, bs, stages)
    inputs = [layer, qp, pages, tables, lens, lo]
    if quantized:
        inputs.append(_pad_keys(seq_scales, width, ring, bs))
    ops = _Ops(interpret)

    def body(*refs):
        layer_ref, q_ref, pages_ref, tables_ref, lens_ref, lo_ref, *refs = refs
        sc_ref = refs.pop(0) if quantized else None
        o_ref, m_ref, l_ref, q_smem, *refs = refs
        o_smem, ml_smem, q_bar, k_bar, v_bar = ring.take(refs[:-3], *refs[-2:]) + refs[-3:]
        s = lax.axis_index("s")
        h = lax.axis_index("h")
        split = lax.axis_index("k")
        length = lens_ref[s]
        lo_s = lo_ref[s]
        k_base = (layer_ref[0] * 2 * kv_heads + h) * blocks
        v_base = k_base + kv_heads * blocks
        first = split * per_split
        # this split's pages that hold context in the window: [start, end)
        start = jnp.maximum(first, lo_s // bs)
        end = jnp.minimum(first + per_split, pl.cdiv(length, bs))
        c0 = (start - first) // ppc
        c1 = jnp.where(start < end, pl.cdiv(end - first, ppc), c0)
        fetch = ring.fetcher(pages_ref, lambda i: tables_ref[s, first + i], k_base, v_base,
                             (sc_ref.at[s, h], lambda c: (first + c * ppc) * bs)
                             if quantized else None)
        plgpu.copy_gmem_to_smem(q_ref.at[s, h], q_smem, q_bar)
        plgpu.barrier_wait(q_bar)

        def chunk_step(c, slot, carry):
            pos = (first + c * ppc) * bs + ops.iota((rows, chunk), 1)
            return _attend(ops, q_smem, ring, slot, carry, (pos < length) & (pos >= lo_s),
                           scale, soft_cap, dtype, rows, chunk)
        acc, m, l = _pipeline(fetch, c0, c1, ring.stages, chunk_step, ops.init(rows, D))
        o_smem[...] = acc
        ml_smem[0] = m
        ml_smem[1] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[split, s, h])
        plgpu.copy_smem_to_gmem(ml_smem.at[0], m_ref.at[split, s, h])
        plgpu.copy_smem_to_gmem(ml_smem.at[1], l_ref.at[split, s, h])
        plgpu.wait_smem_to_gmem(0)

    o, m, l = plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((k_splits, S, KVH, rows, D), jnp.float32),
                  jax.ShapeDtypeStruct((k_splits, S, KVH, rows), jnp.float32),
                  jax.ShapeDtypeStruct((k_splits, S, KVH, rows), jnp.float32)],
        scratch_types=[plgpu.SMEM((rows, D), dtype, transforms=_swizzle(D, dtype)),
                       *ring.scratch(),
                       plgpu.SMEM((rows, D), jnp.float32), plgpu.SMEM((2, rows), jnp.float32),
                       plgpu.Barrier(), *ring.barriers()],
        grid=(S, KVH, k_splits), grid_names=("s", "h", "k"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret, kernel_name="jaxllm_mosaic_decode",
    )(*inputs)
    return combine_splits(o, m, l)[:, :, :G]


def paged_prefill_tiles(q, pages, layer, tables, meta, *, kv_heads, blocks, block_size, qt,
                        scale, window=None, soft_cap=None, stages=None, interpret=None,
                        seq_scales=None):
    """q: [KVH, T, Gp, D] queries by KV head (padded with qt rows at the end);
    tables: [W, MB] the block-table row of each tile's sequence; meta: [W, 4] (first token,
    its position, valid rows, its sequence); seq_scales: a quantized cache's
    sequence_scales (pages then hold its int8 / fp8 values). Returns [W, KVH, qt, Gp, D] in
    q's dtype.

    Past a head size of 128 (at any head size with a quantized cache, whose dequantising
    stage holds a chunk in registers too) a 128-row tile's accumulator and scores no longer
    fit in one warpgroup's registers: each tile is run as two programs of half its tokens."""
    KVH, Tp, gp, D = q.shape
    if (D > 128 or seq_scales is not None) and qt * gp > 64 and qt % 2 == 0:
        W = meta.shape[0]
        half = qt // 2
        start, pos0, nrows = meta[:, 0], meta[:, 1], meta[:, 2]
        meta = jnp.stack([jnp.stack([start + h * half, pos0 + h * half,
                                     jnp.clip(nrows - h * half, 0, half), meta[:, 3]], axis=1)
                          for h in (0, 1)], axis=1).reshape(2 * W, 4)
        out = paged_prefill_tiles(q, pages, layer, jnp.repeat(tables, 2, axis=0), meta,
                                  kv_heads=kv_heads, blocks=blocks, block_size=block_size,
                                  qt=half, scale=scale, window=window, soft_cap=soft_cap,
                                  stages=stages, interpret=interpret, seq_scales=seq_scales)
        return out.reshape(W, 2, KVH, half, gp, D).transpose(0, 2, 1, 3, 4, 5).reshape(
            W, KVH, qt, gp, D)
    W = meta.shape[0]
    dtype = q.dtype
    rows = qt * gp
    if rows % 64:
        raise ValueError(f"a prefill tile of {qt} tokens x {gp} heads is not a multiple of 64 rows")
    bs = block_size
    chunk = chunk_keys(bs)
    ppc = chunk // bs
    MB = tables.shape[1]
    width = -(-MB // ppc) * ppc
    tables = jnp.pad(tables, ((0, 0), (0, width - MB)))
    # each tile's query rows gathered here: a TMA copy into the tiled (8-row) shared memory
    # must start on a multiple of 8 rows, and a tile's first row (start * gp) need not
    rows_of = meta[:, :1] * gp + jnp.arange(rows)[None, :]
    q_tiles = q.reshape(KVH, Tp * gp, D)[:, rows_of]  # [KVH, W, rows, D]
    quantized = seq_scales is not None
    ring = _Ring(D, dtype, pages.dtype if quantized else None,
                 rows * D * jnp.dtype(dtype).itemsize + 4096, chunk, ppc, bs, stages)
    inputs = [layer, q_tiles, pages, tables, meta]
    if quantized:
        inputs.append(_pad_keys(seq_scales, width, ring, bs))
    ops = _Ops(interpret)

    def body(*refs):
        layer_ref, q_ref, pages_ref, tables_ref, meta_ref, *refs = refs
        sc_ref = refs.pop(0) if quantized else None
        o_ref, q_smem, *refs = refs
        q_bar, k_bar, v_bar = ring.take(refs[:-3], *refs[-2:]) + refs[-3:]
        w = lax.axis_index("w")
        h = lax.axis_index("h")
        pos0, nrows = meta_ref[w, 1], meta_ref[w, 2]
        k_base = (layer_ref[0] * 2 * kv_heads + h) * blocks
        v_base = k_base + kv_heads * blocks
        hi = pos0 + jnp.maximum(nrows, 1)  # keys before this bound can be visible
        lo = 0 if window is None else jnp.maximum(pos0 - window + 1, 0)
        c0 = lo // chunk
        c1 = jnp.where(nrows > 0, pl.cdiv(hi, chunk), c0)
        fetch = ring.fetcher(pages_ref, lambda i: tables_ref[w, i], k_base, v_base,
                             (sc_ref.at[meta_ref[w, 3], h], lambda c: c * chunk)
                             if quantized else None)
        plgpu.copy_gmem_to_smem(q_ref.at[h, w], q_smem, q_bar)
        plgpu.barrier_wait(q_bar)

        def chunk_step(c, slot, carry):
            # row r is token r // gp of the tile, query head r % gp of this KV head
            q_pos = pos0 + ops.iota((rows, chunk), 0) // gp
            k_pos = c * chunk + ops.iota((rows, chunk), 1)
            ok = k_pos <= q_pos
            if window is not None:
                ok &= k_pos > q_pos - window
            return _attend(ops, q_smem, ring, slot, carry, ok, scale, soft_cap, dtype, rows,
                           chunk)
        acc, _, l = _pipeline(fetch, c0, c1, ring.stages, chunk_step, ops.init(rows, D))
        acc = acc / lax.broadcast_in_dim(jnp.maximum(l, 1e-30), acc.shape, [0])
        q_smem[...] = acc.astype(dtype)  # the query's buffer takes the output
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[w, h])
        plgpu.wait_smem_to_gmem(0)

    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((W, KVH, rows, D), dtype),
        scratch_types=[plgpu.SMEM((rows, D), dtype, transforms=_swizzle(D, dtype)),
                       *ring.scratch(), plgpu.Barrier(), *ring.barriers()],
        grid=(W, KVH), grid_names=("w", "h"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret, kernel_name="jaxllm_mosaic_prefill",
    )(*inputs)
    return out.reshape(W, KVH, qt, gp, D)
