"""`jaxllm bench serve`: an online load generator for any OpenAI-compatible server (ours,
vLLM's, llama.cpp's). Requests stream from /v1/completions with token-id prompts, arrive as a
Poisson process (or all at once), optionally capped in concurrency; the report follows
`vllm bench serve`: successes, failures, duration, request and token throughput, and
mean / median / p99 of TTFT, TPOT, ITL and end-to-end latency."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass, field

import numpy as np

from benchmarks import datasets
from benchmarks.common import memory_line, percentiles, positive_int, write_result


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000")
    g.add_argument("--endpoint", default="/v1/completions")
    g.add_argument("--model", default=None, help="default: the first of /v1/models")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    w = p.add_argument_group("workload")
    w.add_argument("--dataset-name", default="random", choices=datasets.DATASETS)
    w.add_argument("--dataset-path", default=None)
    w.add_argument("--num-prompts", type=int, default=100)
    w.add_argument("--random-input-len", type=int, default=128)
    w.add_argument("--random-output-len", type=int, default=128)
    w.add_argument("--random-range-ratio", type=float, default=0.0)
    w.add_argument("--num-turns", type=int, default=3, help="prefix-chat: turns per conversation")
    w.add_argument("--system-len", type=int, default=256, help="prefix-chat: shared system prompt")
    w.add_argument("--think-time", type=float, default=0.0, help="prefix-chat: mean seconds "
                   "(exponential) a conversation waits before each of its later turns")
    w.add_argument("--num-tenants", type=int, default=1, help="prefix-chat: tenants, each with "
                   "its own system prompt shared by its conversations")
    w.add_argument("--max-active-conversations", type=positive_int, default=None,
                   help="conversations open at a time (a request each, outside prefix-chat); "
                   "the next one starts when one ends (default: all open from the start)")
    w.add_argument("--image-size", type=int, default=448, help="image: the images' side")
    w.add_argument("--num-unique-images", type=int, default=None,
                   help="image: distinct images among the prompts (default: one per prompt)")
    w.add_argument("--tokenizer", default=None, help="HF directory or GGUF file: vocabulary "
                   "for random prompts and the encoder for --dataset-path")
    w.add_argument("--vocab-size", type=int, default=32000, help="without --tokenizer")
    w.add_argument("--max-model-len", type=int, default=2048, help="bound for the sharegpt mix")
    w.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (inf: all at once)")
    w.add_argument("--max-concurrency", default=None,
                   help="cap on requests in flight; a comma list runs a sweep (e.g. 1,4,16)")
    w.add_argument("--ignore-eos", action="store_true")
    w.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("output")
    o.add_argument("--save-result", action="store_true", help="write the JSON report")
    o.add_argument("--plot", action="store_true", help="PNG plots and a markdown summary")
    o.add_argument("--save-trace", default=None, metavar="PATH",
                   help="write the requests as sent (JSON lines: chain, prompt_token_ids, "
                   "output_len), a trace for `jaxllm bench replicas --parts simulate --trace`")
    o.add_argument("--results-dir", default=os.environ.get("OUT") or "benchmarks/results")
    o.add_argument("--tag", default=None)


@dataclass
class Outcome:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    cached_tokens: int = 0


def build_workload(args) -> list[list[datasets.Sample]]:
    """Chains of requests: one sample per chain, or a conversation's turns in order. Chat
    turns carry the reply as random tokens of the reply's length: over HTTP the client sees
    text, not token ids, so each turn extends the previous prompt, not the model's reply."""
    tok, vocab = None, args.vocab_size
    if args.tokenizer:
        from jaxllm.loader.loader import get_tokenizer
        tok = get_tokenizer(args.tokenizer)
        vocab = len(tok)
    avoid = set(getattr(tok, "all_special_ids", []) or []) if tok is not None else set()
    src = datasets.TokenSource(vocab, avoid, args.seed)
    if args.dataset_name == "image":  # chat requests, each with one image
        samples = datasets.image_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                                         args.image_size, args.num_unique_images or args.num_prompts,
                                         args.seed)
        return [[s] for s in samples]
    if args.dataset_name == "random":
        samples = datasets.random_dataset(src, args.num_prompts, args.random_input_len,
                                          args.random_output_len, args.random_range_ratio)
        return [[s] for s in samples]
    if args.dataset_name == "sharegpt":
        if args.dataset_path:
            if tok is None:
                raise SystemExit("--dataset-path needs --tokenizer")
            samples = datasets.sharegpt_file(args.dataset_path, tok, args.num_prompts,
                                             args.max_model_len, args.seed)
        else:
            samples = datasets.sharegpt_like(src, args.num_prompts, args.max_model_len)
        return [[s] for s in samples]
    chat = datasets.prefix_chat(src, args.num_prompts, args.num_turns, args.system_len,
                                args.random_input_len, args.random_output_len,
                                getattr(args, "num_tenants", 1))
    chains = []
    for c, users in enumerate(chat.user_turns):
        history, chain = list(chat.system_of(c)), []
        for user in users:
            history += user
            chain.append(datasets.Sample(list(history), chat.output_len))
            history += src.tokens(chat.output_len)
        chains.append(chain)
    return chains


def save_trace(path: str, chains) -> None:
    """The workload's requests, a chain's turns in order (images are not kept)."""
    with open(path, "w") as f:
        for c, chain in enumerate(chains):
            for sample in chain:
                f.write(json.dumps({"chain": c, "prompt_token_ids": list(sample.prompt_token_ids),
                                    "output_len": sample.output_len}) + "\n")


async def one_request(client, url: str, model: str, sample: datasets.Sample, ignore_eos: bool,
                      headers: dict) -> Outcome:
    body = {"model": model, "prompt": sample.prompt_token_ids, "max_tokens": sample.output_len,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if sample.image is not None:  # a chat request with an image, to the chat endpoint
        body.pop("prompt")
        body["messages"] = [{"role": "user", "content": [
            {"type": "text", "text": sample.text}, {"type": "image_url", "image_url": {"url": sample.image}}]}]
        url = url.rsplit("/v1/", 1)[0] + "/v1/chat/completions"
    if ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    out = Outcome(False, prompt_tokens=len(sample.prompt_token_ids))
    last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    out.output_tokens = data["usage"]["completion_tokens"]
                    out.prompt_tokens = data["usage"]["prompt_tokens"]
                    details = data["usage"].get("prompt_tokens_details") or {}
                    out.cached_tokens = details.get("cached_tokens") or 0
                # a chunk with a choice carries new tokens (a model without a tokenizer streams
                # them with empty text)
                if data.get("choices"):
                    now = time.perf_counter()
                    if last is None:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
        out.e2e = time.perf_counter() - start
        out.ok = last is not None
        if not out.ok:
            out.error = "no tokens streamed"
    except Exception as e:  # a failed request is counted, not fatal
        out.error = f"{type(e).__name__}: {e}"
    return out


async def run_load(args, chains, model: str, concurrency: int | None) -> tuple[list[Outcome], float]:
    import httpx

    url = args.base_url.rstrip("/") + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = np.random.default_rng(args.seed)
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    active = getattr(args, "max_active_conversations", None)
    # only the loop below acquires it, so conversations open in the workload's order
    opened = asyncio.Semaphore(active) if active else None
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=max(concurrency or 0, len(chains)) + 10)

    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        think = getattr(args, "think_time", 0.0)

        async def run_chain(chain, seed):
            try:
                await run_turns(chain, seed)
            finally:
                if opened is not None:
                    opened.release()

        async def run_turns(chain, seed):
            pause = np.random.default_rng(seed)
            for i, sample in enumerate(chain):
                if i and think > 0:  # the user reads the reply and types the next turn
                    await asyncio.sleep(float(pause.exponential(think)))
                if sem is not None:
                    async with sem:
                        outcomes.append(await one_request(client, url, model, sample, args.ignore_eos, headers))
                else:
                    outcomes.append(await one_request(client, url, model, sample, args.ignore_eos, headers))

        start = time.perf_counter()
        tasks = []
        for c, chain in enumerate(chains):
            if opened is not None:  # (a conversation arriving while N are open waits its turn)
                await opened.acquire()
            tasks.append(asyncio.create_task(run_chain(chain, args.seed * 100003 + c)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(float(rng.exponential(1.0 / args.request_rate)))
        await asyncio.gather(*tasks)
        return outcomes, time.perf_counter() - start


def summarize(outcomes: list[Outcome], duration: float) -> dict:
    ok = [o for o in outcomes if o.ok]
    out_tokens = sum(o.output_tokens for o in ok)
    in_tokens = sum(o.prompt_tokens for o in ok)
    tpot = [(o.e2e - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    ms = lambda xs: {k: (v * 1e3 if k != "n" else v) for k, v in percentiles(xs).items()}  # noqa: E731
    return {
        "successful_requests": len(ok), "failed_requests": len(outcomes) - len(ok),
        "errors": sorted({o.error for o in outcomes if not o.ok})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration, "total_token_throughput": (in_tokens + out_tokens) / duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        # prompt tokens the server found in its prefix cache (its usage's cached_tokens)
        "cached_token_fraction": sum(o.cached_tokens for o in ok) / in_tokens if in_tokens else 0.0,
        "ttft_ms": ms([o.ttft for o in ok]), "tpot_ms": ms(tpot),
        "itl_ms": ms([x for o in ok for x in o.itl]), "e2e_ms": ms([o.e2e for o in ok]),
        "_ttft_all": [o.ttft for o in ok], "_tpot_all": tpot,
    }


def print_report(r: dict, concurrency) -> None:
    print(f"{'=' * 18} serving benchmark (max concurrency {concurrency or 'unbounded'}) {'=' * 18}")
    print(f"{'Successful requests:':<40}{r['successful_requests']:>12}")
    print(f"{'Failed requests:':<40}{r['failed_requests']:>12}")
    print(f"{'Benchmark duration (s):':<40}{r['duration_s']:>12.2f}")
    print(f"{'Request throughput (req/s):':<40}{r['request_throughput']:>12.2f}")
    print(f"{'Output token throughput (tok/s):':<40}{r['output_throughput']:>12.2f}")
    print(f"{'Total token throughput (tok/s):':<40}{r['total_token_throughput']:>12.2f}")
    print(f"{'Cached prompt tokens (fraction):':<40}{r['cached_token_fraction']:>12.3f}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = r[f"{name}_ms"]
        print(f"{name.upper() + ' mean / median / p99 (ms):':<40}{s['mean']:>10.2f} {s['median']:>10.2f} {s['p99']:>10.2f}")
    for e in r["errors"]:
        print(f"  error: {e}")


def server_memory(base_url: str, before: dict, after: dict) -> dict | None:
    """jaxllm servers export KV accounting in /metrics: the report for this run's steps."""
    key = "jaxllm:kv_slots_allocated_steps_total"
    if key not in after:
        return None
    slots = after[key] - before.get(key, 0)
    waste = after["jaxllm:kv_slots_wasted_steps_total"] - before.get("jaxllm:kv_slots_wasted_steps_total", 0)
    total, max_len = after["jaxllm:kv_cache_total_slots"], after["jaxllm:max_model_len"]
    return {"kv_total_slots": int(total), "kv_waste_perc": 100.0 * waste / slots if slots else 0.0,
            "peak_running_seqs": int(after["jaxllm:peak_num_requests_running"]),
            "static_prealloc_seqs": int(total // max_len) if max_len else 0,
            "max_model_len": int(max_len)}


def scrape(base_url: str, headers: dict) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=10).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out
    except Exception:  # other servers may not export these
        return {}


def run(args) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model
    if model is None:
        r = httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
        r.raise_for_status()
        model = r.json()["data"][0]["id"]
    chains = build_workload(args)
    if args.save_trace:
        save_trace(args.save_trace, chains)
    sweep = [int(c) for c in args.max_concurrency.split(",")] if args.max_concurrency else [None]
    runs = []
    for conc in sweep:
        before = scrape(args.base_url, headers)
        outcomes, duration = asyncio.run(run_load(args, chains, model, conc))
        report = summarize(outcomes, duration)
        mem = server_memory(args.base_url, before, scrape(args.base_url, headers))
        if mem is not None:
            report["memory"] = mem
        report["max_concurrency"] = conc
        print_report(report, conc)
        if mem is not None:
            print(memory_line(mem))
        runs.append(report)
    result = {"base_url": args.base_url, "model": model,
              "workload": {"dataset": args.dataset_name, "num_prompts": args.num_prompts,
                           "num_turns": args.num_turns, "num_tenants": args.num_tenants,
                           "think_time": args.think_time,
                           "max_active_conversations": args.max_active_conversations,
                           "random_input_len": args.random_input_len,
                           "random_output_len": args.random_output_len,
                           "request_rate": args.request_rate, "seed": args.seed},
              "runs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs]}
    if args.dataset_name == "image":  # (random_input_len: the text's words)
        result["workload"].update(image_size=args.image_size,
                                  num_unique_images=args.num_unique_images or args.num_prompts)
    if args.save_result or args.plot:
        path = write_result(args, result, "serve")
        if args.plot:
            from benchmarks.plots import serve_plots
            serve_plots(runs, result, path)
    return 0
