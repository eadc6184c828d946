"""`jaxllm bench structured`: what structured outputs cost, measured side by side in one run.

Throughput: N concurrent requests under N different JSON schemas against the same N requests
unconstrained, the same prompts and output length (the schemas ask for more than the output
length, so every request runs to it and the two runs produce the same number of tokens).
Each round times the constrained requests twice: with schemas never seen (their compilation
included) and again with the grammars cached; unconstrained runs bracket every round. Time to first token of a request alone, unconstrained, with a
schema never seen and with a cached one.

--adherence: how often outputs keep to JSON schemas that do not set additionalProperties,
read strictly (only the keys a schema names; the engine's default) and permissively
(structured_outputs_allow_additional_properties), one engine each in the same run. An output
adheres when it parses and validates against its schema with additionalProperties: false
injected into every object."""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import time

import numpy as np

from benchmarks.common import percentiles, write_result
from benchmarks.latency import _Recorder


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=32)
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--num-ttft", type=int, default=3, help="new schemas timed alone")
    g.add_argument("--rounds", type=int, default=2,
                   help="constrained runs (new, then cached), each between unconstrained ones")
    a = p.add_argument_group("adherence")
    a.add_argument("--adherence", action="store_true",
                   help="measure schema adherence, strict and permissive, instead of speed")
    a.add_argument("--num-schemas", type=int, default=20)
    a.add_argument("--max-tokens", type=int, default=96, help="per output (--adherence)")
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


_THEMES = {
    "a book": ["title", "author", "year", "pages", "genre", "rating", "tags"],
    "a city": ["name", "country", "population", "coastal", "founded", "landmarks", "mayor"],
    "a person": ["name", "age", "email", "city", "employed", "skills", "height"],
    "a product": ["name", "price", "stock", "category", "available", "colors", "sku"],
    "a movie": ["title", "director", "year", "minutes", "rated", "cast", "sequel"],
    "a recipe": ["name", "servings", "minutes", "vegetarian", "cuisine", "ingredients", "spicy"],
}


def open_schema(i: int) -> tuple[str, dict]:
    """A small object schema (and what it describes) that never sets additionalProperties:
    2-4 properties of short strings, bounded integers, booleans, enums, short arrays, or one
    nested object."""
    rng = random.Random(i)
    thing = rng.choice(list(_THEMES))
    names = rng.sample(_THEMES[thing], rng.randint(2, 4))

    def prop(depth: int) -> dict:
        kind = rng.choice(["string", "integer", "boolean", "enum", "array"]
                          + (["object"] if depth == 0 else []))
        if kind == "string":
            return {"type": "string", "maxLength": rng.randint(6, 16)}
        if kind == "integer":
            return {"type": "integer", "minimum": 0, "maximum": rng.choice([10, 100, 10000])}
        if kind == "enum":
            return {"type": "string", "enum": rng.sample(["low", "mid", "high", "new", "old"], 3)}
        if kind == "array":
            return {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}
        if kind == "object":
            inner = rng.sample(["id", "label", "score", "note"], 2)
            return {"type": "object", "properties": {n: prop(1) for n in inner}, "required": inner}
        return {"type": "boolean"}

    props = {n: prop(0) for n in names}
    return thing, {"type": "object", "properties": props,
                   "required": rng.sample(names, rng.randint(1, len(names)))}


def forbid_extra(schema):
    """The schema with additionalProperties: false on every object that lists properties (a
    copy)."""
    schema = copy.deepcopy(schema)

    def walk(s):
        if isinstance(s, dict):
            for v in s.values():
                walk(v)
            if isinstance(s.get("properties"), dict):
                s["additionalProperties"] = False
        elif isinstance(s, list):
            for v in s:
                walk(v)
    walk(schema)
    return schema


def adheres(text: str, schema: dict) -> dict:
    """Whether an output parses, validates as JSON Schema reads the schema, and validates with
    other keys forbidden."""
    import jsonschema
    try:
        value = json.loads(text)
    except ValueError:
        return {"parses": False, "valid": False, "adheres": False}
    ok = {}
    for name, s in (("valid", schema), ("adheres", forbid_extra(schema))):
        try:
            jsonschema.validate(value, s)
            ok[name] = True
        except jsonschema.ValidationError:
            ok[name] = False
    return {"parses": True, **ok}


def run_adherence(args) -> int:
    import gc

    from jaxllm.cli import engine_config_from_args
    from jaxllm.llm import LLM
    from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams

    schemas = [open_schema(i) for i in range(args.num_schemas)]
    results = {"workload": {"num_schemas": args.num_schemas, "max_tokens": args.max_tokens,
                            "temperature": 0.0, "schemas": [s for _, s in schemas]},
               "modes": {}}
    for mode, allow in (("strict", False), ("permissive", True)):
        config = engine_config_from_args(args)
        config.structured_outputs_allow_additional_properties = allow
        llm = LLM(config=config)
        tok = llm.get_tokenizer()
        prompts = [tok.apply_chat_template([{"role": "user", "content": (
            f"Describe {thing} as JSON following this schema: "
            + json.dumps(schema, separators=(",", ":")))}], tokenize=False,
            add_generation_prompt=True) for thing, schema in schemas]
        params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=schema))
                  for _, schema in schemas]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        rows = []
        for out, (_, schema) in zip(outs, schemas):
            c = out.outputs[0]
            rows.append({"text": c.text, "finish_reason": c.finish_reason,
                         "tokens": len(c.token_ids), **adheres(c.text, schema)})
        n = len(rows)
        summary = {k: sum(r[k] for r in rows) / n for k in ("parses", "valid", "adheres")}
        summary["length_finished"] = sum(r["finish_reason"] == "length" for r in rows) / n
        summary["mean_tokens"] = sum(r["tokens"] for r in rows) / n
        summary["seconds"] = seconds
        results["modes"][mode] = {"summary": summary, "outputs": rows}
        print(f"{mode:>10}: {summary['adheres']:.0%} adhere (parse and validate with other keys "
              f"forbidden), {summary['parses']:.0%} parse, {summary['length_finished']:.0%} cut "
              f"at max_tokens; {summary['mean_tokens']:.1f} tokens an output", flush=True)
        results["engine"] = {"model": config.model or "SmolLM2-135M-Instruct (default GGUF)",
                             "dtype": llm.llm_engine.policy.describe()}
        llm.llm_engine.shutdown()
        del llm, outs
        gc.collect()
    write_result(args, results, "structured_adherence")
    return 0


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


def split_step_cost(engine, recorded) -> dict:
    """What running the step as two calls (forward, then sampling) costs a batch without
    constraints, against the same computation as one jitted call: a recorded whole-batch
    decode step replayed both ways, in alternating blocks (the median block of each)."""
    import jax
    from jaxllm.runner.replay import StepReplay

    runner = engine.runner
    shape, inputs, _ = recorded  # a single step: structured outputs run no multi-step calls
    replay = StepReplay(runner, shape, inputs)
    split, joined = replay.step, replay.fused()
    kv, sampler = runner.kv_cache, runner.sampler_state

    times = {"one_call": [], "two_calls": []}
    for fn in (joined, split):  # settle
        res, kv, sampler = fn(kv, sampler)
        jax.block_until_ready(res)
    for _ in range(5):
        for name, fn in (("one_call", joined), ("two_calls", split)):
            t = time.perf_counter()
            for _ in range(5):
                res, kv, sampler = fn(kv, sampler)
            jax.block_until_ready(res)
            times[name].append((time.perf_counter() - t) / 5)
    runner.kv_cache, runner.sampler_state = kv, sampler
    out = {k: float(np.median(v)) for k, v in times.items()}
    out["step_shape"] = list(shape)
    out["two_calls_over_one"] = out["two_calls"] / out["one_call"]
    print(f"decode step {shape}: one jitted call {out['one_call'] * 1e3:.1f} ms, forward + "
          f"sampling {out['two_calls'] * 1e3:.1f} ms ({out['two_calls_over_one']:.3f}x)", flush=True)
    return out


def run(args) -> int:
    from jaxllm.cli import engine_config_from_args
    from jaxllm.llm import LLM
    from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams

    config = engine_config_from_args(args)
    if config.speculative_config is not None:
        raise SystemExit("bench structured: structured outputs are not supported with --speculative-config")
    if args.adherence:
        return run_adherence(args)
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

    # warm-up: the step shapes have run, llguidance's tokenizer is built, and every prompt is
    # in the prefix cache (each run below finds it there alike)
    _run(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=1)] * n)
    _run(engine, prompts[:4], free[:4])
    _run(engine, prompts[:4], constrained("warm")[:4])

    results = {"workload": {"num_requests": n, "output_len": out_len, "rounds": args.rounds,
                            "async_scheduling": engine.config.async_scheduling}}
    s = engine.structured

    def timed(params) -> dict:
        mask_s, masks = s.mask_seconds, s.num_masks
        secs, tokens = _run(engine, prompts, params)
        return {"seconds": secs, "output_tokens": tokens, "output_tok_s": tokens / secs,
                "mask_seconds": s.mask_seconds - mask_s, "masks": s.num_masks - masks}

    # the load on a shared machine drifts: unconstrained runs bracket each constrained pair,
    # and each constrained run is compared with the mean of the two around it
    recorder = _Recorder(engine.runner)
    recorder.batch = n
    rows = {"unconstrained": [timed(free)]}
    for r in range(args.rounds):
        params = constrained(f"r{r}")
        rows.setdefault("json_schema_new", []).append(timed(params))
        rows.setdefault("json_schema_cached", []).append(timed(params))
        rows["unconstrained"].append(timed(free))
        base = (rows["unconstrained"][r]["output_tok_s"] + rows["unconstrained"][r + 1]["output_tok_s"]) / 2
        for name in ("json_schema_new", "json_schema_cached"):
            rows[name][r]["ratio_to_unconstrained"] = rows[name][r]["output_tok_s"] / base
    for name, runs in rows.items():
        for x in runs:
            print(f"{name:>20}: {x['output_tokens']} tokens in {x['seconds']:.2f} s = "
                  f"{x['output_tok_s']:.1f} tok/s" + (f", {x['ratio_to_unconstrained']:.2f}x "
                  f"(bitmask host time {x['mask_seconds']:.3f} s over {x['masks']} steps)"
                                                      if "ratio_to_unconstrained" in x else ""),
                  flush=True)
    ratios = {name: float(np.median([x["ratio_to_unconstrained"] for x in rows[name]]))
              for name in ("json_schema_new", "json_schema_cached")}
    results["throughput"] = rows
    results["ratio_to_unconstrained_median"] = ratios

    results["split_step"] = split_step_cost(engine, recorder.middle())

    # a request alone, with a prompt of its own each time (no prefix-cache hit between kinds)
    ttft = {"unconstrained": [], "new_schema": [], "cached_schema": []}
    for k in range(args.num_ttft):
        ttft["unconstrained"].append(_ttft(engine, prompt(1000 + 3 * k), SamplingParams(
            temperature=0.0, max_tokens=2)))
        for j, kind in enumerate(("new_schema", "cached_schema")):  # the same schema: new, cached
            ttft[kind].append(_ttft(engine, prompt(1001 + 3 * k + j), SamplingParams(
                temperature=0.0, max_tokens=2,
                structured_outputs=StructuredOutputsParams(json=schema(k, "ttft")))))
    results["ttft_s"] = {k: percentiles(v) for k, v in ttft.items()}
    for k, v in results["ttft_s"].items():
        print(f"TTFT {k:>14}: median {v['median'] * 1e3:.1f} ms over {v['n']}", flush=True)
    print(f"{n} concurrent JSON-schema requests: {ratios['json_schema_new']:.2f}x (new schemas), "
          f"{ratios['json_schema_cached']:.2f}x (cached) the unconstrained output tokens/s "
          f"(median of {args.rounds} rounds)", flush=True)
    results["engine"] = {"model": config.model or "SmolLM2-135M-Instruct (default GGUF)",
                         "dtype": engine.policy.describe(), "max_num_seqs": config.max_num_seqs,
                         "max_num_batched_tokens": config.max_num_batched_tokens,
                         "startup_seconds": round(engine.startup_seconds, 2)}
    write_result(args, results, "structured")
    return 0

