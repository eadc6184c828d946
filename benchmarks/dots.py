"""The forms a projection's dot can take on this machine, in GFLOP/s by rows: what
jaxllm.layers.linear's dtype policy is chosen from. x[M,K] @ w[K,N] at the default model's
shapes (576 -> 1536 is its MLP), each form jitted alone, best of three blocks. One matrix
stays in the CPU's caches here; a decode step streams every layer's from memory, where the
bytes per weight count more (a bf16 weight reads half of an f32 one)."""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks.common import write_result


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="576x1536,1536x576,576x960",
                   help="KxN of the weights (the default model's gate_up half, down, fused qkv)")
    p.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    p.add_argument("--layers", type=int, default=0,
                   help="time a stack of this many weights per call, as a decode step reads them "
                        "(from memory, not the caches); 0: one matrix")
    p.add_argument("--forms", default=None, help="names separated by semicolons (default: all)")
    p.add_argument("--results-dir", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--tag", default=None)


def forms():
    import jax
    import jax.numpy as jnp
    from jaxllm.kernels.cpu import build
    from jaxllm.kernels.cpu.matmul import dense_bf16
    f32, bf16 = jnp.float32, jnp.bfloat16
    kernel = {}
    if jax.default_backend() == "cpu" and build.available():
        # what the CPU bf16 policy runs: the weights widened in registers (jaxllm.kernels.cpu)
        kernel["bf16 weights, jaxllm CPU kernel"] = (dense_bf16, bf16)
    return {**kernel,
        # name: (fn(x, w), weight dtype)
        "f32": (lambda x, w: x @ w, f32),
        "bf16 weights, bf16 dot, f32 accumulation": (
            lambda x, w: jax.lax.dot(x.astype(bf16), w, preferred_element_type=f32), bf16),
        "bf16 weights upcast, f32 dot": (lambda x, w: x @ w.astype(f32), bf16),
        "bf16 weights, f32 multiply-reduce": (
            lambda x, w: jnp.sum(x[:, :, None] * w.astype(f32)[None], axis=1), bf16),
        "bf16 dot producing bf16": (lambda x, w: (x.astype(bf16) @ w).astype(f32), bf16),
        "int8 weights upcast, f32 dot": (lambda x, w: x @ w.astype(f32), jnp.int8),
        "int8 x int8 -> int32": (lambda x, w: jax.lax.dot(
            jnp.round(x * 8).astype(jnp.int8), w, preferred_element_type=jnp.int32).astype(f32), jnp.int8),
    }


def over_layers(fn):
    """fn(x, w) over a stack w [L, K, N] in a scan, as the model's layers run: XLA's forms get
    each layer's slice, the kernel (which takes a layer index) reads it in place."""
    import jax
    import jax.numpy as jnp

    def run(x, ws):
        if fn.__name__ == "dense_bf16":
            return jax.lax.scan(lambda i, _: (i + 1, fn(x, ws, i)), jnp.int32(0), None,
                                length=ws.shape[0])[1]
        return jax.lax.scan(lambda c, w: (c, fn(x, w)), 0, ws)[1]
    return run


def time_form(fn, x, w) -> float:
    import jax
    f = jax.jit(fn)
    f(x, w).block_until_ready()
    flops = 2 * x.shape[0] * x.shape[1] * w.shape[-1] * (w.shape[0] if w.ndim == 3 else 1)
    n = max(5, int(3e8 / flops))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            y = f(x, w)
        y.block_until_ready()
        best = min(best, (time.perf_counter() - t) / n)
    return flops / best / 1e9


def run(args) -> int:
    import jax.numpy as jnp
    rng = np.random.default_rng(0)
    rows = [int(m) for m in args.rows.split(",")]
    table = {}
    for shape in args.shapes.split(","):
        K, N = (int(v) for v in shape.split("x"))
        lead = (args.layers,) if args.layers else ()
        w32 = (rng.standard_normal((*lead, K, N)) * 0.02).astype(np.float32)
        table[shape] = {}
        wanted = args.forms.split(";") if args.forms else None
        for name, (fn, wdt) in forms().items():
            if wanted and name not in wanted:
                continue
            fn = over_layers(fn) if args.layers else fn
            w = (jnp.asarray(rng.integers(-127, 128, (*lead, K, N), np.int8)) if wdt == jnp.int8
                 else jnp.asarray(w32).astype(wdt))
            row = {M: round(time_form(fn, jnp.asarray(rng.standard_normal((M, K)), jnp.float32), w), 1)
                   for M in rows}
            table[shape][name] = row
            print(f"{shape:>10} {name:44s}" + " ".join(f"{row[M]:8.1f}" for M in rows), flush=True)
    write_result(args, {"unit": "GFLOP/s (GOP/s for int8 x int8)", "rows": rows, "layers": args.layers,
                        "dots": table}, "dots")
    return 0
