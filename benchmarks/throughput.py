"""Offline throughput: jaxllm against HF transformers' static-batch `generate`, same prompts."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time

import numpy as np


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument("--hf-batch-size", type=int, default=None,
                   help="static batch size for the HF baseline (default: all prompts at once)")
    g.add_argument("--no-hf-baseline", action="store_true")
    g.add_argument("--results-dir", default=os.environ.get("OUT") or "benchmarks/results")
    g.add_argument("--tag", default=None, help="name of the result files")


def random_prompts(n: int, length: int, vocab: int, seed: int, avoid: set[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(100, vocab, size=length).tolist()
        out.append([t if t not in avoid else 100 for t in ids])
    return out


def run_jaxllm(llm, prompts, output_len: int) -> dict:
    from jaxllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    secs = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": secs, "requests_per_s": len(prompts) / secs, "output_tokens_per_s": n_out / secs,
            "output_tokens": n_out, "preemptions": llm.llm_engine.num_preemptions}


def run_hf(model_path: str, prompts, output_len: int, batch_size: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": torch.float32}
    if model_path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path),
                                                     gguf_file=os.path.basename(model_path), **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    model.eval()
    pad = 0
    start = time.perf_counter()
    n_out = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i:i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=output_len, min_new_tokens=output_len,
                                 pad_token_id=pad)
            n_out += (out.shape[1] - width) * len(batch)
    secs = time.perf_counter() - start
    return {"seconds": secs, "requests_per_s": len(prompts) / secs, "output_tokens_per_s": n_out / secs,
            "output_tokens": n_out, "batch_size": batch_size, "torch_threads": torch.get_num_threads()}


def machine() -> str:
    import jax
    dev = jax.devices()[0]
    return f"{platform.machine()} {os.cpu_count()} cores, jax {jax.__version__} on {dev.platform} ({dev.device_kind})"


def run(args) -> int:
    from jaxllm.cli import engine_config_from_args
    from jaxllm.llm import LLM

    config = engine_config_from_args(args)
    t0 = time.perf_counter()
    llm = LLM(config=config)
    startup = time.perf_counter() - t0
    engine = llm.llm_engine
    tok = engine.tokenizer
    avoid = set(getattr(tok, "all_special_ids", []) or []) if tok is not None else set()
    prompts = random_prompts(args.num_prompts, args.input_len, engine.arch.vocab_size,
                             args.workload_seed, avoid)
    result = {
        "command": "jaxllm " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "model": config.model or "SmolLM2-135M-Instruct (default GGUF)",
        "dtype": str(np.dtype(engine.dtype)),
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                     "output_len": args.output_len, "seed": args.workload_seed},
        "engine": {"max_num_seqs": config.max_num_seqs,
                   "max_num_batched_tokens": config.max_num_batched_tokens,
                   "max_model_len": config.max_model_len, "startup_seconds": round(startup, 2)},
    }
    result["jaxllm"] = run_jaxllm(llm, prompts, args.output_len)
    print(f"jaxllm: {result['jaxllm']['requests_per_s']:.2f} req/s, "
          f"{result['jaxllm']['output_tokens_per_s']:.1f} output tok/s")
    if not args.no_hf_baseline and config.load_format != "dummy":
        from jaxllm.loader import resolve_model_path
        path = resolve_model_path(config.model)
        hf = run_hf(path, prompts, args.output_len, args.hf_batch_size or args.num_prompts)
        result["hf_transformers"] = hf
        ratio = result["jaxllm"]["output_tokens_per_s"] / hf["output_tokens_per_s"]
        result["ratio_vs_hf"] = ratio
        print(f"HF transformers generate (batch {hf['batch_size']}): {hf['requests_per_s']:.2f} req/s, "
              f"{hf['output_tokens_per_s']:.1f} output tok/s")
        print(f"ratio jaxllm / HF: {ratio:.2f}x")
    os.makedirs(args.results_dir, exist_ok=True)
    device = "gpu" if "gpu" in result["machine"] else "cpu"
    tag = args.tag or f"throughput_{datetime.date.today().isoformat()}_{device}"
    path = os.path.join(args.results_dir, f"{tag}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
    return 0
