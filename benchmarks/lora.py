"""`jaxllm bench lora`: multi-LoRA serving against the base model alone, in one run.

Random PEFT adapters over the model (every projection, rank --lora-rank) are written to a
temporary directory. The same greedy workload runs (1) on an engine without LoRA, (2) on a
LoRA engine with base-model requests only, (3) on the LoRA engine spread round-robin over
--num-adapters adapters. A decode step of a full batch is timed on the device alone in each
engine, and replayed in the LoRA engine with its tokens spread over 0..max_loras adapters:
the step's extra cost per adapter slot. --ops times the LoRA delta of one projection in the
forms considered (masked dense over the slots, the form used; a per-token gather of the
adapter weights; `lax.ragged_dot` over tokens grouped by adapter) against the base matmul.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from benchmarks import datasets
from benchmarks.common import write_result


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--num-adapters", type=int, default=4)
    g.add_argument("--lora-rank", type=int, default=16)
    g.add_argument("--decode-batch", type=int, default=32, help="sequences of the timed decode step")
    g.add_argument("--replay-steps", type=int, default=10)
    g.add_argument("--num-iters", type=int, default=2, help="turns of each variant; the best counts")
    g.add_argument("--ops", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the LoRA delta's forms on the model's projection shapes")
    g.add_argument("--workload-seed", type=int, default=0)
    o = p.add_argument_group("output")
    o.add_argument("--results-dir", default=os.environ.get("OUT") or "benchmarks/results")
    o.add_argument("--tag", default=None)


def write_adapters(arch, directory: str, n: int, rank: int, base_name: str, seed: int = 0) -> list:
    """n random PEFT adapters over every projection of `arch` (Llama family names)."""
    from safetensors.numpy import save_file

    from jaxllm.lora import LoRARequest
    E, F, D = arch.hidden_size, arch.intermediate_size, arch.head_dim
    dims = {"self_attn.q_proj": (E, arch.num_heads * D), "self_attn.k_proj": (E, arch.num_kv_heads * D),
            "self_attn.v_proj": (E, arch.num_kv_heads * D), "self_attn.o_proj": (arch.num_heads * D, E),
            "mlp.gate_proj": (E, F), "mlp.up_proj": (E, F), "mlp.down_proj": (F, E)}
    rng = np.random.default_rng(seed)
    out = []
    for a in range(n):
        path = os.path.join(directory, f"adapter{a}")
        os.makedirs(path)
        tensors = {}
        for layer in range(arch.num_layers):
            for module, (i, o) in dims.items():
                name = f"base_model.model.model.layers.{layer}.{module}"
                tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((rank, i)) / np.sqrt(i)).astype(np.float32)
                tensors[f"{name}.lora_B.weight"] = (0.01 * rng.standard_normal((o, rank))).astype(np.float32)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                       "target_modules": [m.rsplit(".", 1)[-1] for m in dims],
                       "base_model_name_or_path": base_name, "bias": "none"}, f)
        out.append(LoRARequest(f"adapter{a}", a + 1, path))
    return out


def throughput(llm, prompts, output_len: int, loras) -> dict:
    from jaxllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine = llm.llm_engine
    steps0 = engine.runner.num_passes_dispatched
    t, c = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)
    secs, cpu = time.perf_counter() - t, time.process_time() - c
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    return {"seconds": secs, "cpu_seconds": cpu, "output_tokens_per_s": n_out / secs,
            "output_tokens_per_cpu_s": n_out / cpu, "total_tokens_per_s": (n_in + n_out) / secs,
            "steps": engine.runner.num_passes_dispatched - steps0, "_tokens": [o.outputs[0].token_ids for o in outs]}


def replay(runner, shape, inputs, token_slots, steps: int, blocks: int = 3) -> dict:
    """One compiled step (its forward and sampling calls, as the engine launches them) run
    `steps` times back to back, inputs on the device: seconds per step in wall time and in
    this process's CPU time (all threads; what a busy shared machine disturbs least), the
    best of `blocks`."""
    import jax
    from jaxllm.runner.replay import StepReplay
    step = StepReplay(runner, shape, inputs, token_slots).step
    res, kv, sampler = step(runner.kv_cache, runner.sampler_state)
    jax.block_until_ready(res)
    wall, cpu = [], []
    for _ in range(blocks):
        t, c = time.perf_counter(), time.process_time()
        for _ in range(steps):
            res, kv, sampler = step(kv, sampler)
        jax.block_until_ready(res)
        wall.append((time.perf_counter() - t) / steps)
        cpu.append((time.process_time() - c) / steps)
    runner.kv_cache, runner.sampler_state = kv, sampler
    return {"wall_s": min(wall), "cpu_s": min(cpu)}


def decode_step(llm, prompts, loras, replay_steps: int, spreads=()) -> dict:
    """A step decoding the whole batch, replayed on the device alone; with `spreads`, replayed
    again with its sequences spread over k adapters for each k (0: none)."""
    from jaxllm import SamplingParams
    engine = llm.llm_engine
    runner = engine.runner
    recorded = []
    run = runner.run_forward

    def record(shape, inputs, token_slots=None, *a, **kw):
        md = inputs[1]
        if int(md.query_start_loc[-1]) == len(prompts) == int((md.seq_lens > 0).sum()):
            recorded.append((shape, inputs, token_slots))
        return run(shape, inputs, token_slots, *a, **kw)
    # outputs long enough that every sequence still decodes once the last prompt is in
    output_len = -(-sum(len(p) for p in prompts) // engine.config.max_num_batched_tokens) + 8
    for lr in dict.fromkeys(x for x in loras if x is not None):
        engine.add_lora(lr)
    for i, (p, lr) in enumerate(zip(prompts, loras)):
        engine.add_request(f"step-{i}-{time.monotonic_ns()}", {"prompt_token_ids": p},
                           SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True),
                           lora_request=lr)
    runner.run_forward = record
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        runner.run_forward = run
    shape, inputs, slots = recorded[len(recorded) // 2]
    out = {"shape": list(shape), "step": replay(runner, shape, inputs, slots, replay_steps)}
    md = inputs[1]
    seq, real = np.asarray(md.token_seq_ids), int(md.query_start_loc[-1])
    for k in spreads:
        spread = np.zeros(shape[0], np.int32)
        spread[:real] = 0 if k == 0 else (seq[:real] % k) + 1
        out[f"{k}_adapters"] = replay(runner, shape, inputs, spread, replay_steps)
    return out


def time_ops(arch, max_loras: int, rank: int, sizes=(1, 8, 64, 256), reps: int = 5) -> dict:
    """One projection's LoRA delta, each form, against the base matmul alone (median of reps)."""
    import jax
    import jax.numpy as jnp

    E, F, D = arch.hidden_size, arch.intermediate_size, arch.head_dim
    shapes = {"qkv": (E, (arch.num_heads + 2 * arch.num_kv_heads) * D), "o": (arch.num_heads * D, E),
              "gate_up": (E, 2 * F), "down": (F, E)}
    N, R = max_loras, rank
    rng = np.random.default_rng(0)
    out = {}
    for site, (i, o) in shapes.items():
        W = jnp.asarray(rng.standard_normal((i, o)), jnp.float32)
        A = jnp.asarray(rng.standard_normal((N, i, R)), jnp.float32)
        B = jnp.asarray(rng.standard_normal((N, R, o)), jnp.float32)
        A_cat, B_cat = A.transpose(1, 0, 2).reshape(i, N * R), B.reshape(N * R, o)
        A0, B0 = jnp.concatenate([jnp.zeros((1, i, R)), A]), jnp.concatenate([jnp.zeros((1, R, o)), B])

        def base(x, s):
            return x @ W

        def dense(x, s):  # the form jaxllm.lora.ops uses
            onehot = (s[:, None] == jnp.arange(1, N + 1)).astype(x.dtype)
            return x @ W + ((x @ A_cat).reshape(-1, N, R) * onehot[:, :, None]).reshape(-1, N * R) @ B_cat

        def gather(x, s):
            idx = jnp.maximum(s - 1, 0)
            u = jnp.einsum("ti,tir->tr", x, A[idx]) * (s > 0)[:, None]
            return x @ W + jnp.einsum("tr,tro->to", u, B[idx])

        def ragged(x, s):  # tokens sorted by slot; group 0 (no adapter) has zero weights
            sizes_ = jnp.bincount(s, length=N + 1).astype(jnp.int32)
            return x @ W + jax.lax.ragged_dot(jax.lax.ragged_dot(x, A0, sizes_), B0, sizes_)

        forms = {"base": base, "dense": dense, "gather": gather, "ragged_dot": ragged}
        rows = {}
        for T in sizes:
            x = jnp.asarray(rng.standard_normal((T, i)), jnp.float32)
            s = jnp.asarray(np.sort(rng.integers(0, N + 1, T)), jnp.int32)
            fns = {k: jax.jit(f) for k, f in forms.items()}
            ref = fns["dense"](x, s)
            for k, f in fns.items():
                y = f(x, s).block_until_ready()
                if k != "base":
                    assert np.allclose(y, ref, rtol=1e-3, atol=1e-2 * float(jnp.abs(ref).max())), (site, k)
            times = {k: [] for k in fns}
            n = max(3, 2000 // T)
            for _ in range(reps):  # interleaved, so that a noisy moment hits every form
                for k, f in fns.items():
                    t = time.perf_counter()
                    for _ in range(n):
                        y = f(x, s)
                    y.block_until_ready()
                    times[k].append((time.perf_counter() - t) / n)
            med = {k: float(np.median(v)) for k, v in times.items()}
            rows[str(T)] = {"base_us": med["base"] * 1e6,
                            **{f"{k}_over_base": med[k] / med["base"] for k in forms if k != "base"}}
        out[site] = rows
    return out


def run(args) -> int:
    from jaxllm.cli import engine_config_from_args
    from jaxllm.llm import LLM
    from jaxllm.loader.loader import DEFAULT_MODEL_NAME

    load_before = os.getloadavg()[0]
    # both engines stay up and take turns, so that a busy moment of a shared machine hits
    # every variant alike; the best of --num-iters counts
    config = engine_config_from_args(args)
    config.enable_lora = False
    max_loras = max(config.max_loras, args.num_adapters)
    lora_config = engine_config_from_args(args)
    lora_config.enable_lora, lora_config.max_loras = True, max_loras
    lora_config.max_lora_rank = max(lora_config.max_lora_rank, args.lora_rank)
    base_llm = LLM(config=config)
    lora_llm = LLM(config=lora_config)
    engine = base_llm.llm_engine
    arch = engine.arch
    tok = engine.tokenizer
    avoid = set(getattr(tok, "all_special_ids", []) or []) if tok is not None else set()
    src = datasets.TokenSource(arch.vocab_size, avoid, args.workload_seed)
    prompts = [src.tokens(args.input_len) for _ in range(args.num_prompts)]
    step_prompts = [src.tokens(args.input_len) for _ in range(args.decode_batch)]
    none = [None] * len(prompts)
    with tempfile.TemporaryDirectory(prefix="jaxllm-lora-bench-") as tmp:
        adapters = write_adapters(arch, tmp, args.num_adapters, args.lora_rank,
                                  config.model or f"HuggingFaceTB/{DEFAULT_MODEL_NAME}")
        spread = [adapters[i % len(adapters)] for i in range(len(prompts))]
        step_spread = [adapters[i % len(adapters)] for i in range(len(step_prompts))]
        throughput(base_llm, prompts[:8], 4, none[:8])  # warm-up (and the adapters read)
        throughput(lora_llm, prompts[:8], 4, spread[:8])
        runs = {"base": [], "lora_base": [], "lora": []}
        steps = {"base": [], "lora": []}
        for _ in range(args.num_iters):
            runs["base"].append(throughput(base_llm, prompts, args.output_len, none))
            runs["lora_base"].append(throughput(lora_llm, prompts, args.output_len, none))
            runs["lora"].append(throughput(lora_llm, prompts, args.output_len, spread))
            steps["base"].append(decode_step(base_llm, step_prompts, [None] * len(step_prompts),
                                             args.replay_steps))
            steps["lora"].append(decode_step(lora_llm, step_prompts, step_spread,
                                             args.replay_steps, spreads=range(max_loras + 1)))
        slots_mib = lora_llm.llm_engine.runner.lora.nbytes / 2**20
        recompiles = lora_llm.llm_engine.runner.num_compiles_after_warmup
    best = {k: max(runs[k], key=lambda r: r["output_tokens_per_s"]) for k in runs}
    best_cpu = {k: max(runs[k], key=lambda r: r["output_tokens_per_cpu_s"]) for k in runs}
    base, lora_base = best["base"], best["lora_base"]
    same_base = base["_tokens"] == lora_base["_tokens"]
    for rs in runs.values():
        for r in rs:
            r.pop("_tokens", None)

    def best_step(records):
        keys = [k for k in records[0] if k != "shape"]
        return {"shape": records[0]["shape"],
                **{k: {m: min(r[k][m] for r in records) for m in ("wall_s", "cpu_s")} for k in keys}}
    base_step, step = best_step(steps["base"]), best_step(steps["lora"])

    def ratio(key, metric):
        return best_cpu[key][metric] / best_cpu["base"][metric] if "cpu" in metric else \
            best[key][metric] / best["base"][metric]
    extra = {m: step["step"][m] - base_step["step"][m] for m in ("wall_s", "cpu_s")}
    results = {
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                     "output_len": args.output_len, "num_adapters": args.num_adapters,
                     "lora_rank": args.lora_rank, "targets": "all seven projections",
                     "num_iters": args.num_iters, "decode_batch": args.decode_batch},
        "engine": {"model": config.model or f"{DEFAULT_MODEL_NAME} (default GGUF)",
                   "dtype": engine.policy.describe(), "max_num_seqs": engine.config.max_num_seqs,
                   "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                   "max_loras": max_loras, "max_lora_rank": lora_config.max_lora_rank,
                   "lora_slots_mib": slots_mib},
        "load_average_1m": [load_before, os.getloadavg()[0]],
        "runs": runs,
        "throughput_ratio_adapters_vs_base": {m: ratio("lora", m) for m in ("output_tokens_per_s", "output_tokens_per_cpu_s")},
        "throughput_ratio_lora_engine_base_requests_vs_base":
            {m: ratio("lora_base", m) for m in ("output_tokens_per_s", "output_tokens_per_cpu_s")},
        "base_outputs_identical_with_lora_enabled": same_base,
        "decode_step": {"base_engine": base_step, "lora_engine": step, "extra": extra,
                        "extra_frac": {m: extra[m] / base_step["step"][m] for m in extra},
                        "extra_per_adapter_slot": {m: extra[m] / max_loras for m in extra}},
        "compilations_after_warmup": recompiles,
    }
    if args.ops:
        results["delta_forms_over_base_matmul"] = time_ops(arch, max_loras, args.lora_rank)
    r = results
    for m, unit in (("output_tokens_per_s", "wall"), ("output_tokens_per_cpu_s", "CPU")):
        print(f"throughput ({unit} time), {args.num_adapters} adapters / base model alone: "
              f"{r['throughput_ratio_adapters_vs_base'][m]:.3f}; LoRA engine with base requests "
              f"only / base: {r['throughput_ratio_lora_engine_base_requests_vs_base'][m]:.3f}")
    for m in ("wall_s", "cpu_s"):
        spread_ms = ", ".join(f"{k}: {step[f'{k}_adapters'][m] * 1e3:.2f}" for k in range(max_loras + 1))
        print(f"decode step {step['shape']} ({m[:-2]}): base {base_step['step'][m] * 1e3:.2f} ms, "
              f"LoRA engine {step['step'][m] * 1e3:.2f} ms: +{extra[m] * 1e3:.2f} ms "
              f"({100 * extra[m] / base_step['step'][m]:.1f}%), {extra[m] / max_loras * 1e3:.2f} ms "
              f"per adapter slot; by adapters in the step: {spread_ms} ms")
    write_result(args, results, "lora")
    return 0
