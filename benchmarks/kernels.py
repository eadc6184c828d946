"""`jaxllm bench kernels`: paged attention timed against the hardware limits measured in the
same run. Decode over a grid of batch x context, for our Pallas kernel, JAX's own
`jax.experimental.pallas.ops.gpu.paged_attention` and our XLA path, reported as KV bytes read
per second and as a fraction of a large copy's bandwidth; prefill over chunk sizes, reported as
TFLOP/s and as a fraction of a large bf16 matmul. On a CPU the kernels run in Pallas'
interpreter over a small grid, so that CI exercises the command (those numbers say nothing
about a GPU)."""
from __future__ import annotations

import argparse
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import write_result
from benchmarks.peaks import bench, measure_copy_bandwidth, measure_matmul_flops

GRIDS = {
    "full": dict(decode=[(b, c) for b in (1, 8, 32, 128) for c in (512, 1024, 4096, 8192)],
                 prefill=[512, 1024, 2048, 4096]),
    "small": dict(decode=[(1, 64), (4, 256)], prefill=[32, 128]),
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grid", default=None, choices=sorted(GRIDS),
                   help="default: full on a GPU, small elsewhere")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sweep", action="store_true",
                   help="also time our kernels' tile variants (keys per step, warps, splits) "
                        "on the largest decode and prefill shapes of the grid")
    p.add_argument("--results-dir", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--tag", default=None)


def _case(batch: int, ctx: int, q_len: int, args, dtype, on_gpu: bool):
    """A batch of `batch` sequences, each with `ctx` cached tokens and `q_len` new ones, in
    shuffled blocks of a cache big enough for all of them (one layer)."""
    from jaxllm.layers.attention_metadata import attention_metadata
    from jaxllm.layers.attention_metadata import table_width
    from pallas_kernels.ragged_paged_attention import q_tile

    bs = args.block_size
    total = ctx + q_len
    width = table_width(total, bs)
    per_seq = -(-total // bs)
    num_blocks = batch * per_seq + 1
    rng = np.random.default_rng(0)
    ids = rng.permutation(np.arange(1, num_blocks)).reshape(batch, per_seq).astype(np.int32)
    tables = np.zeros((batch, width), np.int32)
    tables[:, :per_seq] = ids
    G = args.heads // args.kv_heads
    starts, n, T = np.full(batch, ctx, np.int32), np.full(batch, q_len, np.int32), batch * q_len
    # the kernels cut prefill tiles by the GQA group, the XLA path by the step
    md = attention_metadata(starts, n, tables, T, batch, bs, q_tile(G))
    md_xla = attention_metadata(starts, n, tables, T, batch, bs)
    key = jax.random.key(0)
    cache = jax.random.normal(key, (1, 2, args.kv_heads, num_blocks * bs, args.head_dim), dtype)
    q = jax.random.normal(key, (T, args.heads, args.head_dim), dtype)
    return q, cache, jax.tree.map(jnp.asarray, md), jax.tree.map(jnp.asarray, md_xla)


def _jax_paged_attention(q, cache, md, args, interpret: bool):
    """JAX's decode kernel on the same cache (its layout [kv_heads, pages, page, dim])."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    bs = args.block_size
    _, _, KVH, slots, D = cache.shape
    k = cache[0, 0].reshape(KVH, slots // bs, bs, D)
    v = cache[0, 1].reshape(KVH, slots // bs, bs, D)
    tables = md.block_tables
    per = tables.shape[1]
    k_splits = max(s for s in (16, 8, 4, 2, 1) if per % s == 0)
    ppcb = math.gcd(per // k_splits, 8)
    fn = jax.jit(lambda q, k, v, t, lens: paged_attention(
        q, k, v, t, lens, block_h=16, pages_per_compute_block=ppcb, k_splits=k_splits,
        interpret=interpret))
    return fn, (q, k, v, tables, md.seq_lens)


# (keys per loop step, warps, decode splits): the defaults choose keys by dtype and head_dim
DECODE_VARIANTS = [(64, 4, None), (128, 4, None), (128, 8, None), (256, 8, None),
                   (128, 4, 1), (128, 4, 4), (128, 4, 16)]
PREFILL_VARIANTS = [(64, 4), (64, 8), (128, 4), (128, 8)]


def _sweep(args, dtype, on_gpu, interpret, bw, flops_peak) -> dict:
    """Our kernels with each tile variant on the grid's largest decode and prefill shapes."""
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    grid = GRIDS[args.grid or ("full" if on_gpu else "small")]
    scale, layer, item = args.head_dim ** -0.5, jnp.int32(0), dtype.itemsize
    out = {"decode": [], "prefill": []}
    batch, ctx = grid["decode"][-1]
    q, cache, md, _ = _case(batch, ctx - 1, 1, args, dtype, on_gpu)
    kv_bytes = batch * ctx * args.kv_heads * args.head_dim * 2 * item
    for keys, warps, splits in DECODE_VARIANTS:
        fn = jax.jit(lambda q, c, md, keys=keys, warps=warps, splits=splits: ragged_paged_attention(
            q, c, layer, md, scale, interpret=interpret, k_splits=splits,
            tuning={"decode": {"keys": keys, "num_warps": warps}}))
        row = {"batch": batch, "context": ctx, "keys": keys, "num_warps": warps, "k_splits": splits}
        try:
            secs = bench(fn, q, cache, md, iters=args.iters)
            row.update(ms=secs * 1e3, gb_s=kv_bytes / secs / 1e9, frac_of_copy_bw=kv_bytes / secs / bw)
        except Exception as e:  # a variant that does not build (shared memory) is a result too
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        out["decode"].append(row)
        print(f"  decode variant keys {keys:>3} warps {warps} splits {splits}: "
              + (f"{row['gb_s']:8.1f} GB/s" if "gb_s" in row else row["error"]))
    chunk = grid["prefill"][-1]
    q, cache, md, _ = _case(1, 0, chunk, args, dtype, on_gpu)
    flops = 4 * args.heads * args.head_dim * chunk * (chunk + 1) / 2
    for keys, warps in PREFILL_VARIANTS:
        fn = jax.jit(lambda q, c, md, keys=keys, warps=warps: ragged_paged_attention(
            q, c, layer, md, scale, interpret=interpret,
            tuning={"prefill": {"keys": keys, "num_warps": warps}}))
        row = {"chunk": chunk, "keys": keys, "num_warps": warps}
        try:
            secs = bench(fn, q, cache, md, iters=args.iters)
            row.update(ms=secs * 1e3, tflop_s=flops / secs / 1e12,
                       frac_of_matmul=flops / secs / flops_peak)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        out["prefill"].append(row)
        print(f"  prefill variant keys {keys:>3} warps {warps}: "
              + (f"{row['tflop_s']:7.2f} TFLOP/s" if "tflop_s" in row else row["error"]))
    return out


def run(args) -> int:
    from jaxllm.layers.attention import paged_attention_xla
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    on_gpu = jax.default_backend() == "gpu"
    interpret = not on_gpu
    grid = GRIDS[args.grid or ("full" if on_gpu else "small")]
    dtype = jnp.dtype(args.dtype)
    bw = measure_copy_bandwidth()
    flops_peak = measure_matmul_flops(dtype=jnp.bfloat16)
    print(f"measured peaks: copy {bw / 1e9:.0f} GB/s, bf16 matmul {flops_peak / 1e12:.1f} TFLOP/s"
          + ("  (interpret mode on CPU: not GPU numbers)" if interpret else ""))
    scale = args.head_dim ** -0.5
    layer = jnp.int32(0)
    ours = jax.jit(lambda q, c, md: ragged_paged_attention(q, c, layer, md, scale, interpret=interpret))
    xla = jax.jit(lambda q, c, md: paged_attention_xla(q, c, layer, md, scale))
    rows = {"decode": [], "prefill": []}
    item = dtype.itemsize
    for batch, ctx in grid["decode"]:
        q, cache, md, md_xla = _case(batch, ctx - 1, 1, args, dtype, on_gpu)
        kv_bytes = batch * ctx * args.kv_heads * args.head_dim * 2 * item
        row = {"batch": batch, "context": ctx, "kv_bytes": kv_bytes}
        for name, fn, fargs in (("jaxllm_pallas", ours, (q, cache, md)), ("xla", xla, (q, cache, md_xla))):
            secs = bench(fn, *fargs, iters=args.iters)
            row[name] = {"ms": secs * 1e3, "gb_s": kv_bytes / secs / 1e9,
                         "frac_of_copy_bw": kv_bytes / secs / bw}
        try:
            fn, fargs = _jax_paged_attention(q, cache, md, args, interpret)
            secs = bench(fn, *fargs, iters=args.iters)
            row["jax_paged_attention"] = {"ms": secs * 1e3, "gb_s": kv_bytes / secs / 1e9,
                                          "frac_of_copy_bw": kv_bytes / secs / bw}
        except Exception as e:  # its constraints on shapes are narrower than ours
            row["jax_paged_attention"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        rows["decode"].append(row)
        j = row["jax_paged_attention"]
        print(f"decode batch {batch:>4} ctx {ctx:>5}: ours {row['jaxllm_pallas']['gb_s']:8.1f} GB/s "
              f"({100 * row['jaxllm_pallas']['frac_of_copy_bw']:5.1f}% of copy)  "
              f"jax {j.get('gb_s', float('nan')):8.1f} GB/s  xla {row['xla']['gb_s']:8.1f} GB/s")
    for chunk in grid["prefill"]:
        q, cache, md, md_xla = _case(1, 0, chunk, args, dtype, on_gpu)
        flops = 4 * args.heads * args.head_dim * chunk * (chunk + 1) / 2
        row = {"chunk": chunk, "flops": flops}
        for name, fn, m in (("jaxllm_pallas", ours, md), ("xla", xla, md_xla)):
            secs = bench(fn, q, cache, m, iters=args.iters)
            row[name] = {"ms": secs * 1e3, "tflop_s": flops / secs / 1e12,
                         "frac_of_matmul": flops / secs / flops_peak}
        rows["prefill"].append(row)
        print(f"prefill chunk {chunk:>5}: ours {row['jaxllm_pallas']['tflop_s']:7.2f} TFLOP/s "
              f"({100 * row['jaxllm_pallas']['frac_of_matmul']:5.1f}% of matmul)  "
              f"xla {row['xla']['tflop_s']:7.2f} TFLOP/s")
    sweep = _sweep(args, dtype, on_gpu, interpret, bw, flops_peak) if args.sweep else None
    result = {"peaks": {"copy_gb_s": bw / 1e9, "bf16_matmul_tflop_s": flops_peak / 1e12},
              "interpret": interpret, "shape": {"heads": args.heads, "kv_heads": args.kv_heads,
                                                "head_dim": args.head_dim, "block_size": args.block_size,
                                                "dtype": args.dtype}, **rows}
    if sweep is not None:
        result["sweep"] = sweep
    write_result(args, result, "kernels")
    return 0
