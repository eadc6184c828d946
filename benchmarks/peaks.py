"""Hardware peaks measured in the same run, to express kernel and step timings as fractions:
memory bandwidth from a large device-to-device copy, matrix throughput from a large bf16
matmul."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def bench(fn, *args, iters: int = 10, warmup: int = 2, warm_s: float = 0.0,
          reps: int = 1) -> float:
    """Median seconds of fn(*args) (jitted by the caller), after warm-up: `warmup` calls, and
    more until `warm_s` seconds have passed (an idle GPU runs at a fraction of its clocks for
    a while). Each timed sample is `reps` calls launched back to back, so that the host's
    wait on the device is paid once per sample rather than once per call; only for inputs
    far larger than the GPU's L2, or repeated calls read the cache."""
    jax.block_until_ready(fn(*args))  # compiles: the warm-up time starts after it
    start = time.perf_counter()
    done = 1
    while done < warmup or time.perf_counter() - start < warm_s:
        jax.block_until_ready(fn(*args))
        done += 1
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / reps)
    times.sort()
    return times[len(times) // 2]


L2_BYTES = 64 << 20  # at least any GPU's L2 here (H100 50 MiB, H200 60 MiB)


def rotations(nbytes: int, limit: int = 16) -> int:
    """How many copies of an input of `nbytes` to rotate through so that together they are at
    least four L2s: a kernel timed back to back on one small input reads it from L2."""
    return max(1, min(limit, -(-4 * L2_BYTES // max(nbytes, 1))))


def bench_rotated(fn, arg_sets: list, iters: int = 10, warm_s: float = 0.0) -> float:
    """Median seconds of one fn call, each sample being fn over every argument set in turn,
    launched back to back (bench's reps, over distinct inputs that L2 cannot hold)."""
    for args in arg_sets:
        jax.block_until_ready(fn(*args))  # compiles (once: the sets share shapes)
    start = time.perf_counter()
    while time.perf_counter() - start < warm_s:
        jax.block_until_ready([fn(*a) for a in arg_sets])
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        outs = [fn(*a) for a in arg_sets]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t) / len(arg_sets))
    times.sort()
    return times[len(times) // 2]


def measure_copy_bandwidth(nbytes: int | None = None) -> float:
    """Bytes per second of a copy (read + write counted) of a large array of random values,
    many times the L2 of any GPU, timed over back-to-back copies after half a second of them.
    1 GiB: with two copies' outputs alive at once it fits where `bench latency` measures it,
    beside an engine that holds the rest of the device."""
    on_gpu = jax.default_backend() == "gpu"
    nbytes = nbytes or (1 << 30 if on_gpu else 256 << 20)
    x = jax.random.uniform(jax.random.key(0), (nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)  # one read and one write; XLA cannot elide it
    secs = bench(f, x, warm_s=0.5 if on_gpu else 0.0, reps=10 if on_gpu else 1)
    return 2 * nbytes / secs


def measure_matmul_flops(n: int | None = None, dtype=jnp.bfloat16) -> float:
    """FLOP per second of an n x n x n matmul on random values (a product of constants can run
    faster than real data does)."""
    on_gpu = jax.default_backend() == "gpu"
    n = n or (8192 if on_gpu else 1024)
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    secs = bench(f, a, b, warm_s=0.5 if on_gpu else 0.0, reps=10 if on_gpu else 1)
    return 2 * n ** 3 / secs
