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
128/64/32 bytes that divides a row. bf16 and fp16 only: an f32 cache would run the tensor
cores in TF32, and the int8/fp8 caches need a dequantising stage this kernel does not have
yet; `supports()` says so and the engine falls back to the Triton kernels for those.

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


def supports(dtype, head_dim: int, quantized: bool = False) -> str | None:
    """None when these kernels handle the cache, else why not."""
    if quantized:
        return "quantized KV caches (int8/fp8) are not in the Mosaic kernels yet"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"the Mosaic kernels take bf16 or fp16 caches, not {jnp.dtype(dtype).name}"
    if head_dim % 16:
        return f"head size {head_dim} is not a multiple of 16"
    return None


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


def stages_for(fixed_bytes: int, chunk: int, head_dim: int, dtype) -> int:
    """The deepest K/V ring (at most MAX_STAGES) that fits beside `fixed_bytes`."""
    per_stage = 2 * chunk * head_dim * jnp.dtype(dtype).itemsize
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


def _attend(ops, q_smem, k_slot, v_slot, carry, ok, scale, soft_cap, dtype, rows, chunk, D,
            k_wait, v_wait):
    """One chunk of the online softmax: scores, the mask `ok` (visible keys), rescale, PV;
    k_wait / v_wait wait for the chunk's K and V copies."""
    acc, m, l = carry
    k_wait()
    s = ops.mma(q_smem, k_slot, True, (rows, chunk)) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(ok, s, _NEG)
    m_new = jnp.maximum(m, s.max(axis=1))
    corr = jnp.exp(m - m_new)
    p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    l = l * corr + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(corr, acc.shape, [0])
    v_wait()
    acc = ops.mma_acc(acc, p.astype(dtype), v_slot)
    return acc, m_new, l


def _ring(pages_ref, k_smem, v_smem, k_bar, v_bar, page_of, k_base, v_base, ppc, bs):
    """fetch(c, slot): copy chunk c's K and V pages into ring slot `slot`."""
    def fetch(c, slot):
        for p in range(ppc):
            page = page_of(c * ppc + p)
            dst = pl.ds(p * bs, bs)
            plgpu.copy_gmem_to_smem(pages_ref.at[k_base + page], k_smem.at[slot, dst],
                                    k_bar.at[slot])
            plgpu.copy_gmem_to_smem(pages_ref.at[v_base + page], v_smem.at[slot, dst],
                                    v_bar.at[slot])
    return fetch


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


def _scratch(q_rows, D, dtype, stages, chunk, ppc, extra=()):
    tr = _swizzle(D, dtype)
    return [plgpu.SMEM((q_rows, D), dtype, transforms=tr),
            plgpu.SMEM((stages, chunk, D), dtype, transforms=tr),
            plgpu.SMEM((stages, chunk, D), dtype, transforms=tr),
            *extra,
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=ppc, num_barriers=stages),
            plgpu.Barrier(num_arrivals=ppc, num_barriers=stages)]


def paged_decode(q, pages, layer, tables, lens, lo, *, kv_heads, blocks, block_size, scale,
                 soft_cap=None, k_splits=1, stages=None, interpret=None):
    """One query token per sequence against its context, split-K over the context.

    q: [S, KVH, G, D]; pages: flat_pages(cache); layer: [1] i32; tables: [S, MB];
    lens: [S] context lengths (0: padded row); lo: [S] first position in the window;
    interpret: None on a GPU, interpret_params() elsewhere. Returns [S, KVH, G, D] f32."""
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
    size = jnp.dtype(dtype).itemsize
    fixed = rows * D * size + rows * D * 4 + 2 * rows * 4 + 4096
    stages = stages or stages_for(fixed, chunk, D, dtype)
    ops = _Ops(interpret)

    def body(layer_ref, q_ref, pages_ref, tables_ref, lens_ref, lo_ref, o_ref, m_ref, l_ref,
             q_smem, k_smem, v_smem, o_smem, ml_smem, q_bar, k_bar, v_bar):
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
        fetch = _ring(pages_ref, k_smem, v_smem, k_bar, v_bar,
                      lambda i: tables_ref[s, first + i], k_base, v_base, ppc, bs)
        plgpu.copy_gmem_to_smem(q_ref.at[s, h], q_smem, q_bar)
        plgpu.barrier_wait(q_bar)

        def chunk_step(c, slot, carry):
            pos = (first + c * ppc) * bs + ops.iota((rows, chunk), 1)
            return _attend(ops, q_smem, k_smem.at[slot], v_smem.at[slot], carry,
                           (pos < length) & (pos >= lo_s), scale, soft_cap, dtype, rows,
                           chunk, D, lambda: plgpu.barrier_wait(k_bar.at[slot]),
                           lambda: plgpu.barrier_wait(v_bar.at[slot]))
        acc, m, l = _pipeline(fetch, c0, c1, stages, chunk_step, ops.init(rows, D))
        o_smem[...] = acc
        ml_smem[0] = m
        ml_smem[1] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[split, s, h])
        plgpu.copy_smem_to_gmem(ml_smem.at[0], m_ref.at[split, s, h])
        plgpu.copy_smem_to_gmem(ml_smem.at[1], l_ref.at[split, s, h])
        plgpu.wait_smem_to_gmem(0)

    extra = [plgpu.SMEM((rows, D), jnp.float32), plgpu.SMEM((2, rows), jnp.float32)]
    o, m, l = plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((k_splits, S, KVH, rows, D), jnp.float32),
                  jax.ShapeDtypeStruct((k_splits, S, KVH, rows), jnp.float32),
                  jax.ShapeDtypeStruct((k_splits, S, KVH, rows), jnp.float32)],
        scratch_types=_scratch(rows, D, dtype, stages, chunk, ppc, extra),
        grid=(S, KVH, k_splits), grid_names=("s", "h", "k"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret, kernel_name="jaxllm_mosaic_decode",
    )(layer, qp, pages, tables, lens, lo)
    return combine_splits(o, m, l)[:, :, :G]


def paged_prefill_tiles(q, pages, layer, tables, meta, *, kv_heads, blocks, block_size, qt,
                        scale, window=None, soft_cap=None, stages=None, interpret=None):
    """q: [KVH, T, Gp, D] queries by KV head (padded with qt rows at the end);
    tables: [W, MB] the block-table row of each tile's sequence; meta: [W, 4] (first token,
    its position, valid rows, unused). Returns [W, KVH, qt, Gp, D] in q's dtype.

    Past a head size of 128 a 128-row tile's accumulator and scores no longer fit in one
    warpgroup's registers: each tile is run as two programs of half its tokens."""
    KVH, Tp, gp, D = q.shape
    if D > 128 and qt * gp > 64 and qt % 2 == 0:
        W = meta.shape[0]
        half = qt // 2
        start, pos0, nrows = meta[:, 0], meta[:, 1], meta[:, 2]
        meta = jnp.stack([jnp.stack([start + h * half, pos0 + h * half,
                                     jnp.clip(nrows - h * half, 0, half), meta[:, 3]], axis=1)
                          for h in (0, 1)], axis=1).reshape(2 * W, 4)
        out = paged_prefill_tiles(q, pages, layer, jnp.repeat(tables, 2, axis=0), meta,
                                  kv_heads=kv_heads, blocks=blocks, block_size=block_size,
                                  qt=half, scale=scale, window=window, soft_cap=soft_cap,
                                  stages=stages, interpret=interpret)
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
    stages = stages or stages_for(rows * D * jnp.dtype(dtype).itemsize + 4096, chunk, D, dtype)
    ops = _Ops(interpret)

    def body(layer_ref, q_ref, pages_ref, tables_ref, meta_ref, o_ref,
             q_smem, k_smem, v_smem, q_bar, k_bar, v_bar):
        w = lax.axis_index("w")
        h = lax.axis_index("h")
        pos0, nrows = meta_ref[w, 1], meta_ref[w, 2]
        k_base = (layer_ref[0] * 2 * kv_heads + h) * blocks
        v_base = k_base + kv_heads * blocks
        hi = pos0 + jnp.maximum(nrows, 1)  # keys before this bound can be visible
        lo = 0 if window is None else jnp.maximum(pos0 - window + 1, 0)
        c0 = lo // chunk
        c1 = jnp.where(nrows > 0, pl.cdiv(hi, chunk), c0)
        fetch = _ring(pages_ref, k_smem, v_smem, k_bar, v_bar,
                      lambda i: tables_ref[w, i], k_base, v_base, ppc, bs)
        plgpu.copy_gmem_to_smem(q_ref.at[h, w], q_smem, q_bar)
        plgpu.barrier_wait(q_bar)

        def chunk_step(c, slot, carry):
            # row r is token r // gp of the tile, query head r % gp of this KV head
            q_pos = pos0 + ops.iota((rows, chunk), 0) // gp
            k_pos = c * chunk + ops.iota((rows, chunk), 1)
            ok = k_pos <= q_pos
            if window is not None:
                ok &= k_pos > q_pos - window
            return _attend(ops, q_smem, k_smem.at[slot], v_smem.at[slot], carry, ok, scale,
                           soft_cap, dtype, rows, chunk, D,
                           lambda: plgpu.barrier_wait(k_bar.at[slot]),
                           lambda: plgpu.barrier_wait(v_bar.at[slot]))
        acc, _, l = _pipeline(fetch, c0, c1, stages, chunk_step, ops.init(rows, D))
        acc = acc / lax.broadcast_in_dim(jnp.maximum(l, 1e-30), acc.shape, [0])
        q_smem[...] = acc.astype(dtype)  # the query's buffer takes the output
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[w, h])
        plgpu.wait_smem_to_gmem(0)

    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((W, KVH, rows, D), dtype),
        scratch_types=_scratch(rows, D, dtype, stages, chunk, ppc),
        grid=(W, KVH), grid_names=("w", "h"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret, kernel_name="jaxllm_mosaic_prefill",
    )(layer, q_tiles, pages, tables, meta)
    return out.reshape(W, KVH, qt, gp, D)
