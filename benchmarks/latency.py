"""`jaxllm bench latency`: time to first token, decode step time at batch 1 and batch N, and
end-to-end latency of a batch, through the Python API. On a GPU the decode step is also
compared with its HBM floor: every step reads all weights and the live KV cache."""
from __future__ import annotations

import argparse
import gc
import os
import time

import numpy as np

from benchmarks import datasets
from benchmarks.common import percentiles, write_result


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--batch-size", default="8",
                   help="N of the batch-N measurements; several as 8,64,256 (batch 1 always)")
    g.add_argument("--num-iters", type=int, default=5)
    g.add_argument("--num-iters-warmup", type=int, default=1)
    g.add_argument("--replay-steps", type=int, default=10,
                   help="decode steps replayed back to back to time the device alone")
    g.add_argument("--workload-seed", type=int, default=0)
    o = p.add_argument_group("output")
    o.add_argument("--results-dir", default=os.environ.get("OUT") or "benchmarks/results")
    o.add_argument("--tag", default=None)


class _Recorder:
    """Keeps the inputs of the steps the runner launches that decode the whole batch (one
    token for each of `batch` sequences), to replay the middle one: its context length is
    the decode phase's average. With multi-step scheduling these are the calls of full
    passes (each sequence num_scheduler_steps of them)."""

    def __init__(self, runner):
        import jax
        self.runner, self.steps, self.batch = runner, [], 0
        self._run, self._run_passes = runner.run_forward, runner.run_passes
        self._sample = runner.run_sample
        # device idleness, seen from the host: a step launched while the device still runs
        # the previous executable (its outputs not ready) found the device busy, so no host
        # time before it was exposed; one launched after the previous finished found it idle
        self.launched = self.found_idle = 0
        self._last = None  # the outputs of the executable launched last
        # the garbage collector's pauses on the engine's thread: full collections and the
        # seconds of all of them (the loop stalls while one runs)
        self.gc_full, self.gc_seconds, self._gc_start = 0, 0.0, 0.0
        # this recorder's own CPU seconds on the engine's thread (its checks and records): not
        # the host's work, left out of the host CPU per step
        self.own_cpu = 0.0

        def collected(phase, info):
            if phase == "start":
                self._gc_start = time.perf_counter()
                return
            self.gc_seconds += time.perf_counter() - self._gc_start
            self.gc_full += info["generation"] == 2
        self._collected = collected
        gc.callbacks.append(collected)

        def launch(fn, *a, **kw):
            t = time.thread_time()
            if self._last is not None:
                # (outputs a later executable took as donated inputs were followed by work)
                ready = [x.is_ready() for x in self._last if not x.is_deleted()]
                self.launched += 1
                self.found_idle += bool(ready) and all(ready)
            self.own_cpu += time.thread_time() - t
            out = fn(*a, **kw)
            keep(out)
            return out

        def keep(out):
            t = time.thread_time()
            self._last = [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]
            self.own_cpu += time.thread_time() - t

        def whole(md) -> bool:
            tokens = int(md.query_start_loc[-1])
            return tokens == self.batch and int((md.seq_lens > 0).sum()) == self.batch

        def run(shape, inputs, *a, **kw):
            t = time.thread_time()
            if whole(inputs[1]):
                self.steps.append((shape, inputs, None))
            self.own_cpu += time.thread_time() - t
            return launch(self._run, shape, inputs, *a, **kw)

        def run_passes(shape, inputs, num, *a, **kw):
            t = time.thread_time()
            if whole(inputs[1]) and (num[:self.batch] == runner.num_passes).all():
                self.steps.append((shape, inputs, num))
            self.own_cpu += time.thread_time() - t
            return launch(self._run_passes, shape, inputs, num, *a, **kw)

        def sample(*a, **kw):  # sampling follows its forward pass at once: not a new step
            out = self._sample(*a, **kw)
            keep(out)
            return out
        runner.run_forward, runner.run_passes, runner.run_sample = run, run_passes, sample

    def close(self) -> None:
        """Stop counting the collector's pauses (the callback holds the engine)."""
        gc.callbacks.remove(self._collected)

    def middle(self):
        calls = [s for s in self.steps if s[2] is not None] or self.steps
        return calls[len(calls) // 2]


def device_step_seconds(runner, shape, inputs, steps: int, num=None) -> float:
    """The device's own time for one step: the same compiled step run `steps` times back to
    back, inputs already on the device, no host work in between. A multi-step call (`num`:
    its passes per row) is run whole and its time divided by its passes."""
    import jax
    from jaxllm.runner.replay import StepReplay
    replay = StepReplay(runner, shape, inputs, num=num)
    step, passes = replay.step, replay.passes
    kv, sampler = runner.kv_cache, runner.sampler_state
    res, kv, sampler = step(kv, sampler)  # once more, to settle
    jax.block_until_ready(res)
    blocks = []
    for _ in range(3):  # the median of three blocks: one noisy block does not decide it
        t = time.perf_counter()
        for _ in range(steps):
            res, kv, sampler = step(kv, sampler)
        jax.block_until_ready(res)
        blocks.append((time.perf_counter() - t) / steps / passes)
    runner.kv_cache, runner.sampler_state = kv, sampler
    return float(np.median(blocks))


def _run_batch(engine, requests, recorder=None) -> tuple[float, float, int, float, tuple]:
    """Runs requests to completion: (seconds to the last first token, seconds of the steady
    decode phase, its steps (forward passes read back in it), the engine thread's CPU seconds
    in that phase). That phase runs from the moment every request has its first token to the
    moment the first one finishes (prompts are prefilled a budget at a time, so the requests
    finish at different steps): every step in it decodes the whole batch. It is timed whole: with async scheduling one
    step() call launches a step and reads the previous one, so single calls are not steps.
    The CPU seconds are the host's own work (waiting on the device takes none): on a CPU,
    whose cores also run the step, that is what the host takes from the device. Last: the
    steps launched in that phase, how many of them found the device idle, and the garbage
    collector's full collections and seconds in it, and the recorder's own CPU seconds
    (`recorder`), which the caller takes out of the host's."""
    from jaxllm import SamplingParams
    from jaxllm.sampling_params import RequestOutputKind

    for rid, prompt, n_out in requests:
        # each step's new tokens, as the server streams them (a cumulative output would
        # copy every token so far at every step)
        engine.add_request(rid, {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True,
                                          output_kind=RequestOutputKind.DELTA))
    waiting = {rid for rid, _, _ in requests}

    def launches():
        if recorder is None:
            return (0, 0, 0, 0.0, 0.0)
        return (recorder.launched, recorder.found_idle, recorder.gc_full, recorder.gc_seconds,
                recorder.own_cpu)

    start = time.perf_counter()
    first = steps_at_first = last = steps_at_last = cpu_first = cpu_last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                waiting.discard(out.request_id)
            if out.finished and last is None and first is not None:
                last, steps_at_last = time.perf_counter(), engine.runner.num_passes_collected
                cpu_last, launches_last = time.thread_time(), launches()
        if first is None and not waiting:
            first, steps_at_first = time.perf_counter(), engine.runner.num_passes_collected
            cpu_first, launches_first = time.thread_time(), launches()
    if last is None:  # one output token: no decode phase
        last, steps_at_last, cpu_last, launches_last = first, steps_at_first, cpu_first, launches_first
    return (first - start, last - first, steps_at_last - steps_at_first, cpu_last - cpu_first,
            tuple(b - a for a, b in zip(launches_first, launches_last)))


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
          * jnp.dtype(engine.kv_dtype).itemsize)
    bw = measure_copy_bandwidth()
    return {"weight_bytes": int(weights), "kv_bytes": int(kv), "bandwidth_gb_s": bw / 1e9,
            "floor_ms": (weights + kv) / bw * 1e3}


def run(args) -> int:
    from jaxllm.cli import engine_config_from_args
    from jaxllm.llm import LLM

    config = engine_config_from_args(args)
    if config.speculative_config is not None:
        raise SystemExit("bench latency replays unspeculated decode steps; for speculative "
                         "decoding use bench spec")
    llm = LLM(config=config)
    engine = llm.llm_engine
    recorder = _Recorder(engine.runner)
    tok = engine.tokenizer
    avoid = set(getattr(tok, "all_special_ids", []) or []) if tok is not None else set()
    src = datasets.TokenSource(engine.arch.vocab_size, avoid, args.workload_seed)
    sizes = sorted({1, *(int(b) for b in str(args.batch_size).split(","))})
    results = {"workload": {"input_len": args.input_len, "output_len": args.output_len,
                            "batch_sizes": sizes, "num_iters": args.num_iters},
               "async_scheduling": getattr(engine.config, "async_scheduling", False),
               "num_scheduler_steps": engine.config.num_scheduler_steps}
    count = 0
    for batch in sizes:
        recorder.batch = batch
        ttft, steps, e2e, host_cpu, launches = [], [], [], [], [0, 0, 0, 0.0, 0.0]
        for it in range(args.num_iters_warmup + args.num_iters):
            reqs = []
            for _ in range(batch):
                count += 1
                reqs.append((f"lat-{count}", src.tokens(args.input_len), args.output_len))
            # time to first token: the prompt alone, one output token
            t0 = time.perf_counter()
            _run_batch(engine, [(r + "-ttft", p, 1) for r, p, _ in reqs])
            t_first = time.perf_counter() - t0
            recorder.steps = []
            _, decode, n, cpu, counts = _run_batch(engine, reqs, recorder)
            if it >= args.num_iters_warmup and n > 0:
                ttft.append(t_first)
                steps.append(decode / n)
                host_cpu.append((cpu - counts[4]) / n)  # (less the recorder's own work)
                launches = [a + b for a, b in zip(launches, counts)]
                e2e.append(time.perf_counter() - t0 - t_first)
        # a step that decoded the whole batch, replayed: the device's time alone
        shape, inputs, num = recorder.middle()
        device = device_step_seconds(engine.runner, shape, inputs, args.replay_steps, num)
        step = float(np.median(steps))
        entry = {"ttft_s": percentiles(ttft), "decode_step_s": percentiles(steps),
                 "device_step_s": device, "step_shape": list(shape),
                 "replayed_passes": 1 if num is None else int(num.max()),
                 # what the host adds to a step that the device does not hide
                 "exposed_host_s": step - device, "host_cpu_s": float(np.median(host_cpu)),
                 "decode_launches": launches[0], "launches_found_device_idle": launches[1],
                 "gc_full_collections": launches[2], "gc_seconds": launches[3],
                 "e2e_s": percentiles(e2e)}
        if launches[0] and not launches[1]:
            # the device always had the next step queued: the host exposed nothing by making
            # it wait, and can only have slowed it down by taking its cores: at most the host's
            # own CPU time (a bound free of the replay's noise; on a GPU it would be zero)
            entry["exposed_host_bound_s"] = entry["host_cpu_s"]
        floor = hbm_floor_ms(engine, batch, args.input_len + args.output_len // 2)
        if floor is not None:
            entry["hbm_floor"] = floor
            entry["decode_step_over_floor"] = step * 1e3 / floor["floor_ms"]
        results[f"batch_{batch}"] = entry
        line = (f"batch {batch:>3}: TTFT {entry['ttft_s']['mean'] * 1e3:8.1f} ms  decode step "
                f"{step * 1e3:8.2f} ms (device alone {device * 1e3:.2f}, host exposed "
                f"{entry['exposed_host_s'] * 1e3:.2f}; host CPU {entry['host_cpu_s'] * 1e3:.2f}; device "
                f"found idle at {launches[1]} of {launches[0]} launches; GC {launches[3] * 1e3:.1f} ms, "
                f"{launches[2]} full)  "
                f"e2e {entry['e2e_s']['mean']:.2f} s")
        if floor is not None:
            line += f"  = {entry['decode_step_over_floor']:.2f}x the HBM floor ({floor['floor_ms']:.2f} ms)"
        print(line, flush=True)
    recorder.close()
    results["engine"] = {"model": config.model or "SmolLM2-135M-Instruct (default GGUF)",
                         "dtype": engine.policy.describe(), "max_num_seqs": config.max_num_seqs,
                         "startup_seconds": round(engine.startup_seconds, 2)}
    write_result(args, results, "latency")
    return 0
