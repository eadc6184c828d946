"""`jaxllm bench kernels`: paged attention timed against the hardware limits measured in the
same run. Decode over a grid of batch x context, for our two Pallas kernel families (Mosaic
GPU, where the GPU and dtype allow it, and Triton), JAX's own
`jax.experimental.pallas.ops.gpu.paged_attention` and our XLA path, reported as KV bytes read
per second and as a fraction of a large copy's bandwidth; prefill over chunk sizes, reported as
TFLOP/s and as a fraction of a large bf16 matmul. Each timing rotates through enough copies of
the case's KV cache that together they are four times any GPU's L2 (one small cache timed back
to back would be read from L2). On a CPU the kernels run in their interpreters over a small
grid, so that CI exercises the command (those numbers say nothing about a GPU)."""
from __future__ import annotations

import argparse
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import write_result
from benchmarks.peaks import (bench_rotated, measure_copy_bandwidth, measure_matmul_flops,
                              rotations)

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
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                   help="int8 / fp8: the cache quantized (a scale per token and head), the "
                   "queries in --dtype; bytes read count the values and the scales")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sweep", action="store_true",
                   help="also time our kernels' tile variants (keys per step, warps, splits) "
                        "on the largest decode and prefill shapes of the grid")
    p.add_argument("--results-dir", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--tag", default=None)


def _case(batch: int, ctx: int, q_len: int, args, dtype, on_gpu: bool, seed: int = 0):
    """A batch of `batch` sequences, each with `ctx` cached tokens and `q_len` new ones, in
    shuffled blocks of a cache big enough for all of them (one layer)."""
    from jaxllm.layers.attention_metadata import attention_metadata
    from jaxllm.layers.attention_metadata import table_width
    from jaxllm.quantization import kv as kvq
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
    key = jax.random.key(seed)
    cache = jax.random.normal(key, (1, 2, args.kv_heads, num_blocks * bs, args.head_dim), dtype)
    q = jax.random.normal(key, (T, args.heads, args.head_dim), dtype)
    if kvq.storage_dtype(args.kv_cache_dtype) is not None:
        cache = kvq.quantize(cache, args.kv_cache_dtype)
    return q, cache, jax.tree.map(jnp.asarray, md), jax.tree.map(jnp.asarray, md_xla)


def _jax_paged_attention(q, cache, md, args, interpret: bool):
    """JAX's decode kernel on the same cache (its layout [kv_heads, pages, page, dim])."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    if hasattr(cache, "scale"):
        raise ValueError("JAX's kernel reads float caches only")
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


# the Mosaic kernels': the depth of the K/V ring, and decode splits
MOSAIC_DECODE_VARIANTS = [(2, None), (3, None), (4, None), (2, 1), (2, 4), (2, 16)]
MOSAIC_PREFILL_VARIANTS = [1, 2, 3]


def _variant(fn, sets, row, work, peak, unit, iters, on_gpu) -> dict:
    try:
        secs = _time(fn, sets, lambda s: s[:3], iters, on_gpu)
        key = "gb_s" if unit == "bytes" else "tflop_s"
        row.update({"ms": secs * 1e3, key: work / secs / (1e9 if unit == "bytes" else 1e12),
                    "frac_of_copy_bw" if unit == "bytes" else "frac_of_matmul": work / secs / peak})
    except Exception as e:  # a variant that does not build (shared memory) is a result too
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    print("  variant " + " ".join(f"{k} {v}" for k, v in row.items() if k in (
        "kernels", "keys", "num_warps", "k_splits", "stages")) + ": "
          + (f"{row['gb_s']:8.1f} GB/s" if "gb_s" in row else
             f"{row['tflop_s']:7.2f} TFLOP/s" if "tflop_s" in row else row["error"]))
    return row


def _sweep(args, dtype, on_gpu, interpret, bw, flops_peak, mosaic: bool) -> dict:
    """Our kernels with each tile variant on the grid's largest decode and prefill shapes."""
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    grid = GRIDS[args.grid or ("full" if on_gpu else "small")]
    scale, layer, item = args.head_dim ** -0.5, jnp.int32(0), _item(args, dtype)
    out = {"decode": [], "prefill": []}
    batch, ctx = grid["decode"][-1]
    sets = _rotated(batch, ctx - 1, 1, args, dtype, on_gpu)
    kv_bytes = int(batch * ctx * args.kv_heads * args.head_dim * 2 * item)
    variants = [("triton", dict(keys=k, num_warps=w), sp) for k, w, sp in DECODE_VARIANTS]
    if mosaic:
        variants += [("mosaic", dict(stages=st), sp) for st, sp in MOSAIC_DECODE_VARIANTS]
    for kernels, tune, splits in variants:
        fn = jax.jit(lambda q, c, md, k=kernels, t=tune, sp=splits: ragged_paged_attention(
            q, c, layer, md, scale, interpret=interpret, k_splits=sp, kernels=k,
            tuning={"decode": t}))
        row = {"batch": batch, "context": ctx, "kernels": kernels, **tune, "k_splits": splits}
        out["decode"].append(_variant(fn, sets, row, kv_bytes, bw, "bytes", args.iters, on_gpu))
    del sets
    chunk = grid["prefill"][-1]
    sets = _rotated(1, 0, chunk, args, dtype, on_gpu)
    flops = 4 * args.heads * args.head_dim * chunk * (chunk + 1) / 2
    variants = [("triton", dict(keys=k, num_warps=w)) for k, w in PREFILL_VARIANTS]
    if mosaic:
        variants += [("mosaic", dict(stages=st)) for st in MOSAIC_PREFILL_VARIANTS]
    for kernels, tune in variants:
        fn = jax.jit(lambda q, c, md, k=kernels, t=tune: ragged_paged_attention(
            q, c, layer, md, scale, interpret=interpret, kernels=k, tuning={"prefill": t}))
        row = {"chunk": chunk, "kernels": kernels, **tune}
        out["prefill"].append(_variant(fn, sets, row, flops, flops_peak, "flops", args.iters,
                                       on_gpu))
    return out


def _rotated(batch, ctx, q_len, args, dtype, on_gpu):
    """The case and as many differently-seeded copies of it as rotations() asks for."""
    first = _case(batch, ctx, q_len, args, dtype, on_gpu)
    n = rotations(sum(x.nbytes for x in jax.tree.leaves(first[1]))) if on_gpu else 1
    return [first] + [_case(batch, ctx, q_len, args, dtype, on_gpu, seed=i) for i in range(1, n)]


def mosaic_applies(dtype, head_dim: int, on_gpu: bool, kv_cache_dtype: str = "auto") -> str | None:
    """None when the Mosaic kernels can run here (as the engine decides), else why not."""
    from jaxllm.kernels import attention_backend, cuda_runtime_version
    from jaxllm.quantization.kv import storage_dtype
    backend, why = attention_backend(
        "pallas", "gpu" if on_gpu else "cpu", dtype, storage_dtype(kv_cache_dtype), head_dim,
        getattr(jax.devices()[0], "compute_capability", None),
        cuda_runtime=cuda_runtime_version() if on_gpu else None)
    return None if backend == "pallas-mosaic" else why


def _item(args, dtype) -> float:
    """Bytes per cached value (a quantized cache's scales spread over its head)."""
    from jaxllm.quantization.kv import bytes_per_value
    return bytes_per_value(dtype, args.kv_cache_dtype, args.head_dim)


def _time(fn, sets, pick, iters, on_gpu):
    return bench_rotated(fn, [pick(s) for s in sets], iters=iters, warm_s=0.5 if on_gpu else 0.0)


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
    ours = {f"jaxllm_{k}": jax.jit(lambda q, c, md, k=k: ragged_paged_attention(
        q, c, layer, md, scale, interpret=interpret, kernels=k)) for k in ("triton", "mosaic")}
    no_mosaic = mosaic_applies(dtype, args.head_dim, on_gpu, args.kv_cache_dtype)
    if no_mosaic:
        print(f"the Mosaic kernels are left out: {no_mosaic}")
        ours.pop("jaxllm_mosaic")
    xla = jax.jit(lambda q, c, md: paged_attention_xla(q, c, layer, md, scale))
    rows = {"decode": [], "prefill": []}
    item = _item(args, dtype)
    for batch, ctx in grid["decode"]:
        sets = _rotated(batch, ctx - 1, 1, args, dtype, on_gpu)
        kv_bytes = int(batch * ctx * args.kv_heads * args.head_dim * 2 * item)
        row = {"batch": batch, "context": ctx, "kv_bytes": kv_bytes, "rotated_caches": len(sets)}
        for name, fn, pick in ([(n, f, lambda s: s[:3]) for n, f in ours.items()]
                               + [("xla", xla, lambda s: (s[0], s[1], s[3]))]):
            secs = _time(fn, sets, pick, args.iters, on_gpu)
            row[name] = {"ms": secs * 1e3, "gb_s": kv_bytes / secs / 1e9,
                         "frac_of_copy_bw": kv_bytes / secs / bw}
        try:
            made = [_jax_paged_attention(s[0], s[1], s[2], args, interpret) for s in sets]
            secs = bench_rotated(made[0][0], [m[1] for m in made], iters=args.iters)
            row["jax_paged_attention"] = {"ms": secs * 1e3, "gb_s": kv_bytes / secs / 1e9,
                                          "frac_of_copy_bw": kv_bytes / secs / bw}
        except Exception as e:  # its constraints on shapes are narrower than ours
            row["jax_paged_attention"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        rows["decode"].append(row)
        j = row["jax_paged_attention"]
        print(f"decode batch {batch:>4} ctx {ctx:>5}: " + "  ".join(
            f"{n[7:]} {row[n]['gb_s']:8.1f} GB/s ({100 * row[n]['frac_of_copy_bw']:5.1f}%)"
            for n in ours) + f"  jax {j.get('gb_s', float('nan')):8.1f}  xla {row['xla']['gb_s']:8.1f}")
        del sets
    for chunk in grid["prefill"]:
        sets = _rotated(1, 0, chunk, args, dtype, on_gpu)
        flops = 4 * args.heads * args.head_dim * chunk * (chunk + 1) / 2
        row = {"chunk": chunk, "flops": flops, "rotated_caches": len(sets)}
        for name, fn, pick in ([(n, f, lambda s: s[:3]) for n, f in ours.items()]
                               + [("xla", xla, lambda s: (s[0], s[1], s[3]))]):
            secs = _time(fn, sets, pick, args.iters, on_gpu)
            row[name] = {"ms": secs * 1e3, "tflop_s": flops / secs / 1e12,
                         "frac_of_matmul": flops / secs / flops_peak}
        rows["prefill"].append(row)
        print(f"prefill chunk {chunk:>5}: " + "  ".join(
            f"{n[7:]} {row[n]['tflop_s']:7.2f} TFLOP/s ({100 * row[n]['frac_of_matmul']:5.1f}%)"
            for n in ours) + f"  xla {row['xla']['tflop_s']:7.2f}")
        del sets
    sweep = _sweep(args, dtype, on_gpu, interpret, bw, flops_peak, "jaxllm_mosaic" in ours) \
        if args.sweep else None
    result = {"peaks": {"copy_gb_s": bw / 1e9, "bf16_matmul_tflop_s": flops_peak / 1e12},
              "interpret": interpret, "mosaic_left_out": no_mosaic,
              "shape": {"heads": args.heads, "kv_heads": args.kv_heads,
                        "head_dim": args.head_dim, "block_size": args.block_size,
                        "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype}, **rows}
    if sweep is not None:
        result["sweep"] = sweep
    write_result(args, result, "kernels")
    return 0
