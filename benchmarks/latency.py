"""`jaxllm bench latency`: time to first token, decode step time at batch 1 and batch N, and
end-to-end latency of a batch, through the Python API. On a GPU the decode step is also
compared with its HBM floor: every step reads all weights and the live KV cache."""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks import datasets
from benchmarks.common import percentiles, write_result


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--batch-size", type=int, default=8, help="N of the batch-N measurement")
    g.add_argument("--num-iters", type=int, default=5)
    g.add_argument("--num-iters-warmup", type=int, default=1)
    g.add_argument("--workload-seed", type=int, default=0)
    o = p.add_argument_group("output")
    o.add_argument("--results-dir", default=os.environ.get("OUT") or "benchmarks/results")
    o.add_argument("--tag", default=None)


def _timed_steps(engine, requests, host=None) -> tuple[list[float], list[float], float]:
    """Runs requests to completion: (prefill step times, decode step times, e2e seconds).
    A decode step is one in which every scheduled request computes exactly one token; `host`
    collects each decode step's time outside the wait for the device's results."""
    from jaxllm import SamplingParams

    for rid, prompt, n_out in requests:
        engine.add_request(rid, {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True))
    prefill, decode = [], []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        sched = engine.scheduler
        before = {r.request_id: r.num_computed_tokens for r in sched.running}
        waited = engine.runner.device_wait_seconds
        engine.step()
        dt = time.perf_counter() - t
        waited = engine.runner.device_wait_seconds - waited
        after = {r.request_id: r.num_computed_tokens for r in sched.running}
        advanced = [after.get(k, before[k] + 1) - before[k] for k in before]
        is_decode = bool(before) and all(a == 1 for a in advanced) and len(before) == len(requests)
        (decode if is_decode else prefill).append(dt)
        if is_decode and host is not None:
            host.append(dt - waited)
    return prefill, decode, time.perf_counter() - start


def hbm_floor_ms(engine, batch: int, context: int) -> dict | None:
    """Bytes a decode step must move (weights + live KV) over the measured device bandwidth."""
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "gpu":
        return None
    from benchmarks.peaks import measure_copy_bandwidth
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(engine.runner.state))
    arch = engine.arch
    kv = (batch * context * arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim
          * jnp.dtype(engine.dtype).itemsize)
    bw = measure_copy_bandwidth()
    return {"weight_bytes": int(weights), "kv_bytes": int(kv), "bandwidth_gb_s": bw / 1e9,
            "floor_ms": (weights + kv) / bw * 1e3}


def run(args) -> int:
    from jaxllm.cli import engine_config_from_args
    from jaxllm.llm import LLM

    config = engine_config_from_args(args)
    llm = LLM(config=config)
    engine = llm.llm_engine
    tok = engine.tokenizer
    avoid = set(getattr(tok, "all_special_ids", []) or []) if tok is not None else set()
    src = datasets.TokenSource(engine.arch.vocab_size, avoid, args.workload_seed)
    results = {"workload": {"input_len": args.input_len, "output_len": args.output_len,
                            "batch_size": args.batch_size, "num_iters": args.num_iters}}
    count = 0
    for batch in sorted({1, args.batch_size}):
        ttft, steps, e2e, host = [], [], [], []
        for it in range(args.num_iters_warmup + args.num_iters):
            reqs = []
            for _ in range(batch):
                count += 1
                reqs.append((f"lat-{count}", src.tokens(args.input_len), args.output_len))
            # time to first token: the prompt alone, one output token
            t0 = time.perf_counter()
            _timed_steps(engine, [(r + "-ttft", p, 1) for r, p, _ in reqs])
            t_first = time.perf_counter() - t0
            hosted = []
            _, dec, total = _timed_steps(engine, reqs, hosted)
            if it >= args.num_iters_warmup:
                ttft.append(t_first)
                steps += dec
                host += hosted
                e2e.append(total)
        # host time of a decode step: what async scheduling could hide behind the device
        entry = {"ttft_s": percentiles(ttft), "decode_step_s": percentiles(steps),
                 "decode_host_s": percentiles(host), "e2e_s": percentiles(e2e)}
        floor = hbm_floor_ms(engine, batch, args.input_len + args.output_len // 2)
        if floor is not None:
            entry["hbm_floor"] = floor
            entry["decode_step_over_floor"] = entry["decode_step_s"]["median"] * 1e3 / floor["floor_ms"]
        results[f"batch_{batch}"] = entry
        line = (f"batch {batch:>3}: TTFT {entry['ttft_s']['mean'] * 1e3:8.1f} ms  decode step "
                f"{entry['decode_step_s']['median'] * 1e3:8.2f} ms (p99 {entry['decode_step_s']['p99'] * 1e3:.2f}, "
                f"host {entry['decode_host_s']['median'] * 1e3:.2f})"
                f"  e2e {entry['e2e_s']['mean']:.2f} s")
        if floor is not None:
            line += f"  = {entry['decode_step_over_floor']:.2f}x the HBM floor ({floor['floor_ms']:.2f} ms)"
        print(line)
    results["engine"] = {"model": config.model or "SmolLM2-135M-Instruct (default GGUF)",
                         "dtype": str(np.dtype(engine.dtype)), "max_num_seqs": config.max_num_seqs,
                         "startup_seconds": round(engine.startup_seconds, 2)}
    write_result(args, results, "latency")
    return 0
