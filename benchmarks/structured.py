"""`jaxllm bench structured`: what structured outputs cost, measured side by side in one run.

Throughput: N concurrent requests under N different JSON schemas against the same N requests
unconstrained, the same prompts and output length (the schemas ask for more than the output
length, so every request runs to it and the two runs produce the same number of tokens).
The constrained run is timed twice: with schemas never seen (their compilation included) and
again with the grammars cached. Time to first token of a request alone, unconstrained, with a
schema never seen and with a cached one."""
from __future__ import annotations

import argparse
import os
import time

from benchmarks.common import percentiles, write_result


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=32)
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--num-ttft", type=int, default=3, help="new schemas timed alone")
    o = p.add_argument_group("output")
    o.add_argument("--results-dir", default=os.environ.get("OUT") or "benchmarks/results")
    o.add_argument("--tag", default=None)


def schema(i: int, salt: str = "") -> dict:
    """A records schema whose shortest output is longer than any output length used here."""
    record = {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 10 ** 6},
        "name": {"type": "string", "minLength": 2, "maxLength": 12},
        "kind": {"type": "string", "enum": ["alpha", "beta", "gamma", f"kind{i}"]},
        "ok": {"type": "boolean"}},
        "required": ["id", "name", "kind", "ok"], "additionalProperties": False}
    return {"type": "object", "properties": {
        f"records{salt}{i}": {"type": "array", "items": record, "minItems": 40, "maxItems": 40},
        "total": {"type": "integer"}},
        "required": [f"records{salt}{i}", "total"], "additionalProperties": False}


def _run(engine, prompts, params) -> tuple[float, int]:
    """All requests at once, to the end: (seconds, output tokens)."""
    start = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"so-{time.monotonic_ns()}-{i}", prompt, p)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return time.perf_counter() - start, tokens


def _ttft(engine, prompt, params) -> float:
    """A request alone: seconds from submission to its first token."""
    from jaxllm.sampling_params import RequestOutputKind
    params.output_kind = RequestOutputKind.DELTA
    start, first = time.perf_counter(), None
    rid = f"ttft-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter() - start
    return first


def run(args) -> int:
    from jaxllm.cli import engine_config_from_args
    from jaxllm.llm import LLM
    from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams

    config = engine_config_from_args(args)
    llm = LLM(config=config)
    engine = llm.llm_engine
    tok = engine.tokenizer
    n, out_len = args.num_requests, args.output_len

    def prompt(i):
        text = f"List customer records as JSON (batch {i}), with ids, names, kinds and flags."
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)

    prompts = [prompt(i) for i in range(n)]
    free = [SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True) for _ in range(n)]

    def constrained(salt):
        return [SamplingParams(temperature=0.0, max_tokens=out_len, structured_outputs=
                               StructuredOutputsParams(json=schema(i, salt))) for i in range(n)]

    # warm-up: every step shape of the workload has run once, and llguidance's tokenizer is built
    _run(engine, prompts[:4], free[:4])
    _run(engine, prompts[:4], constrained("warm")[:4])

    results = {"workload": {"num_requests": n, "output_len": out_len,
                            "async_scheduling": engine.config.async_scheduling}}
    s = engine.structured
    rows = {}
    for name, params in (("unconstrained", free), ("json_schema_new", constrained("new")),
                         ("json_schema_cached", constrained("new")), ("unconstrained_again", free)):
        mask_s, masks = s.mask_seconds, s.num_masks
        secs, tokens = _run(engine, prompts, params)
        rows[name] = {"seconds": secs, "output_tokens": tokens, "output_tok_s": tokens / secs,
                      "mask_seconds": s.mask_seconds - mask_s, "masks": s.num_masks - masks}
        print(f"{name:>20}: {tokens} tokens in {secs:.2f} s = {tokens / secs:.1f} tok/s "
              f"(bitmask host time {rows[name]['mask_seconds']:.3f} s over {rows[name]['masks']} steps)",
              flush=True)
    base = (rows["unconstrained"]["output_tok_s"] + rows["unconstrained_again"]["output_tok_s"]) / 2
    for name in ("json_schema_new", "json_schema_cached"):
        rows[name]["ratio_to_unconstrained"] = rows[name]["output_tok_s"] / base
    results["throughput"] = rows

    ttft = {"unconstrained": [], "new_schema": [], "cached_schema": []}
    for k in range(args.num_ttft):
        p = prompt(1000 + k)
        ttft["unconstrained"].append(_ttft(engine, p, SamplingParams(temperature=0.0, max_tokens=2)))
        for kind in ("new_schema", "cached_schema"):  # the same schema twice: new, then cached
            ttft[kind].append(_ttft(engine, p, SamplingParams(
                temperature=0.0, max_tokens=2,
                structured_outputs=StructuredOutputsParams(json=schema(k, "ttft")))))
    results["ttft_s"] = {k: percentiles(v) for k, v in ttft.items()}
    for k, v in results["ttft_s"].items():
        print(f"TTFT {k:>14}: median {v['median'] * 1e3:.1f} ms over {v['n']}", flush=True)
    print(f"32 concurrent JSON-schema requests: {rows['json_schema_new']['ratio_to_unconstrained']:.2f}x "
          f"(new schemas), {rows['json_schema_cached']['ratio_to_unconstrained']:.2f}x (cached) the "
          "unconstrained output tokens/s", flush=True)
    results["engine"] = {"model": config.model or "SmolLM2-135M-Instruct (default GGUF)",
                         "dtype": engine.policy.describe(), "max_num_seqs": config.max_num_seqs,
                         "max_num_batched_tokens": config.max_num_batched_tokens,
                         "startup_seconds": round(engine.startup_seconds, 2)}
    write_result(args, results, "structured")
    return 0

