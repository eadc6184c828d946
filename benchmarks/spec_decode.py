"""`jaxllm bench spec`: speculative decoding's speed-up against batch size, in one run.

For each engine (no speculation, then each --speculative-config) and each batch size B, the
workload runs in rounds of B requests submitted together (concurrency B), greedy. The ratio
of output tokens per second against the engine without speculation, in the same run, is the
speed-up; the mean acceptance length (vLLM's: tokens a verification emits) says why. Greedy
outputs must equal the unspeculated ones: the report counts the requests that do.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

from benchmarks import datasets
from benchmarks.common import write_result


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", default="copy", choices=("copy", "random", "sharegpt"))
    g.add_argument("--batch-sizes", default="1,4,16,64")
    g.add_argument("--rounds", type=int, default=1,
                   help="rounds of batch-size requests per batch size (batch 1: at least 4)")
    g.add_argument("--input-len", type=int, default=128, help="random: prompt tokens")
    g.add_argument("--output-len", type=int, default=None,
                   help="most output tokens per request (copy: 1.5x the paragraph by default)")
    g.add_argument("--workload-seed", type=int, default=0)
    s = p.add_argument_group("speculation")
    s.add_argument("--spec", action="append", default=[], metavar="JSON",
                   help="a speculative_config to measure (repeatable)")
    s.add_argument("--draft-from", default=None, metavar="HF_DIR",
                   help="also measure a draft model made of this HF checkpoint's first "
                        "--draft-layers layers (with its embedding, final norm and head)")
    s.add_argument("--draft-layers", type=int, default=4)
    s.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="k of the draft made with --draft-from")
    o = p.add_argument_group("output")
    o.add_argument("--results-dir", default=os.environ.get("OUT") or "benchmarks/results")
    o.add_argument("--tag", default=None)
    o.add_argument("--plot", action="store_true", help="a PNG of the curve and a markdown table")


def _samples(args, engine, batch: int, rounds: int):
    tok = engine.tokenizer
    avoid = set(getattr(tok, "all_special_ids", []) or []) if tok is not None else set()
    src = datasets.TokenSource(engine.arch.vocab_size, avoid, args.workload_seed)
    n = batch * rounds
    if args.dataset_name == "copy":
        return datasets.copy_dataset(src, tok, n, args.output_len)
    if args.dataset_name == "sharegpt":
        return datasets.sharegpt_like(src, n, engine.config.max_model_len)
    return datasets.random_dataset(src, n, args.input_len, args.output_len or 128)


def _measure(llm, samples, batch: int) -> dict:
    from benchmarks.throughput import spec_report
    from jaxllm import SamplingParams

    engine = llm.llm_engine
    before = engine.stats()
    steps0 = engine.runner.num_passes_dispatched
    tokens, n_out = [], 0
    start = time.perf_counter()
    for i in range(0, len(samples), batch):
        chunk = samples[i:i + batch]
        params = [SamplingParams(temperature=0.0, max_tokens=s.output_len,
                                 ignore_eos=not s.stop_at_eos) for s in chunk]
        outs = llm.generate([{"prompt_token_ids": s.prompt_token_ids} for s in chunk], params,
                            use_tqdm=False)
        for o in outs:
            tokens.append(list(o.outputs[0].token_ids))
            n_out += len(o.outputs[0].token_ids)
    secs = time.perf_counter() - start
    r = {"seconds": secs, "requests": len(samples), "output_tokens": n_out,
         "output_tokens_per_s": n_out / secs, "steps": engine.runner.num_passes_dispatched - steps0,
         "_tokens": tokens}
    if engine.speculator is not None:
        r["speculative_decoding"] = spec_report(before, engine.stats())
    return r


def run(args) -> int:
    import dataclasses

    from jaxllm.cli import engine_config_from_args
    from jaxllm.llm import LLM
    from jaxllm.spec_decode.config import SpeculativeConfig

    sizes = sorted({int(b) for b in str(args.batch_sizes).split(",")})
    base = engine_config_from_args(args)
    if base.speculative_config is not None:
        raise ValueError("give the configurations to measure with --spec (the baseline runs "
                         "without speculation)")
    if base.max_num_seqs is None:
        base.max_num_seqs = max(sizes)
    if base.max_num_seqs < max(sizes):
        raise ValueError(f"--max-num-seqs ({base.max_num_seqs}) is below the largest batch size")
    specs = [SpeculativeConfig.parse(s) for s in args.spec]
    tmp = None
    if args.draft_from:
        from benchmarks.spec_drafts import truncated_draft
        tmp = tempfile.TemporaryDirectory(prefix="jaxllm-draft-")
        draft = truncated_draft(args.draft_from, os.path.join(tmp.name, "draft"), args.draft_layers)
        specs.append(SpeculativeConfig(method="draft_model", model=draft,
                                       num_speculative_tokens=args.num_speculative_tokens))
    if not specs:
        raise ValueError("nothing to measure: give --spec JSON and/or --draft-from HF_DIR")
    names = ["none"] + [_name(s, args) for s in specs]
    result = {"workload": {"dataset": args.dataset_name, "batch_sizes": sizes,
                           "rounds": args.rounds, "seed": args.workload_seed},
              "engine": {"model": base.model or "SmolLM2-135M-Instruct (default GGUF)",
                         "max_num_seqs": base.max_num_seqs,
                         "max_num_batched_tokens": base.max_num_batched_tokens,
                         "async_scheduling": base.async_scheduling},
              "configs": {n: (None if s is None else _describe(s, args))
                          for n, s in zip(names, [None] + specs)},
              "runs": {}}
    reference = {}
    for name, spec in zip(names, [None] + specs):
        llm = LLM(config=dataclasses.replace(base, speculative_config=spec))
        engine = llm.llm_engine
        runs = result["runs"][name] = {"startup_seconds": round(engine.startup_seconds, 1)}
        _measure(llm, _samples(args, engine, 1, 1), 1)  # warm-up
        for b in sizes:
            rounds = max(args.rounds, 4 if b == 1 else 1)
            r = _measure(llm, _samples(args, engine, b, rounds), b)
            toks = r.pop("_tokens")
            if spec is None:
                reference[b] = toks
            else:
                r["same_outputs"] = sum(x == y for x, y in zip(toks, reference[b]))
                r["speedup"] = r["output_tokens_per_s"] / result["runs"]["none"][f"batch_{b}"]["output_tokens_per_s"]
            runs[f"batch_{b}"] = r
            line = f"{name:<24} batch {b:>3}: {r['output_tokens_per_s']:8.1f} output tok/s"
            if spec is not None:
                sd = r["speculative_decoding"]
                mal = sd["mean_acceptance_length"]
                line += (f"  speed-up {r['speedup']:.2f}x  mean acceptance length "
                         f"{mal if mal is None else round(mal, 2)}  same outputs "
                         f"{r['same_outputs']}/{r['requests']}")
            print(line, flush=True)
        runs["compiles_after_warmup"] = engine.runner.num_compiles_after_warmup
        del llm, engine
        gc.collect()
    if tmp is not None:
        tmp.cleanup()
    path = write_result(args, result, "spec")
    if args.plot:
        from benchmarks.plots import spec_plots
        spec_plots(result, path)
    return 0


def _name(spec, args) -> str:
    if spec.method == "ngram":
        return f"ngram k={spec.k}"
    if args.draft_from and spec.model.endswith(os.sep + "draft"):
        return f"draft {args.draft_layers} layers k={spec.k}"
    return f"draft k={spec.k}"


def _describe(spec, args) -> dict:
    d = json.loads(json.dumps(dataclasses_asdict(spec)))
    if args.draft_from and spec.method == "draft_model" and spec.model.endswith(os.sep + "draft"):
        d["model"] = f"first {args.draft_layers} layers of {args.draft_from} (+ norm, head)"
    return d


def dataclasses_asdict(x):
    import dataclasses
    return dataclasses.asdict(x)
