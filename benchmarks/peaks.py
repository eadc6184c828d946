"""Hardware peaks measured in the same run, to express kernel and step timings as fractions:
memory bandwidth from a large device-to-device copy, matrix throughput from a large bf16
matmul."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def bench(fn, *args, iters: int = 10, warmup: int = 2) -> float:
    """Median seconds of fn(*args) (jitted by the caller), after warm-up."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def measure_copy_bandwidth(nbytes: int | None = None) -> float:
    """Bytes per second of a copy (read + write counted) of a large array."""
    on_gpu = jax.default_backend() == "gpu"
    nbytes = nbytes or (2 << 30 if on_gpu else 256 << 20)
    x = jnp.ones(nbytes // 4, jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)  # one read and one write; XLA cannot elide it
    secs = bench(f, x)
    return 2 * nbytes / secs


def measure_matmul_flops(n: int | None = None, dtype=jnp.bfloat16) -> float:
    """FLOP per second of an n x n x n matmul."""
    on_gpu = jax.default_backend() == "gpu"
    n = n or (8192 if on_gpu else 1024)
    a = jnp.ones((n, n), dtype)
    b = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    secs = bench(f, a, b)
    return 2 * n ** 3 / secs
