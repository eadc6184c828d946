"""`jaxllm bench replicas`: data-parallel replicas and disaggregated prefill/decode, each
comparison in one run against real servers, through `jaxllm bench serve`'s load generator.

- routing: a multi-tenant chat workload (conversations re-sending their growing history,
  system prompts shared within tenants) against 2 replicas, prefix-aware routing against
  round robin: cached prompt-token fraction and TTFT. Each conversation waits a random
  think time before its next turn (so turns arrive in no fixed order), and their histories
  together outgrow one replica's KV cache (--routing-cache-blocks) but not two, as in a
  service whose caches hold fewer conversations than it serves: routed by prefix, each
  replica caches half of them; in turn, every replica must cache all of them and evicts.
- scaling: requests/s of 2 replicas against 1 engine at saturation, same machine (on a CPU
  the replicas split its cores: what they share bounds the gain).
- simulate: the routing workload (or a trace from `jaxllm bench serve --save-trace`) through
  the server's router on simulated replicas (benchmarks/route_sim.py: the engine's own prefix
  cache, a modelled step cost), for 1, 2, 4 and 8 replicas and each policy: hit rates and
  requests/s where that many replicas cannot be had. Its hit rates for 2 replicas sit beside
  the live routing part's when both run.
- pd: long prompts arriving while streams decode, prefill/decode split (1 prefill replica +
  1 decode replica) against 2 colocated replicas: the streams' inter-token latency, the long
  prompts' TTFT, and the KV transfer's bytes and rate.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import time

from benchmarks import serve as bench_serve
from benchmarks.common import percentiles, positive_int, start_server, write_result

KV = {"kv_connector": "RayObjectStoreConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"prefill_replicas": 1}}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--serve-args", default="--max-model-len 4096",
                   help="engine flags every server gets")
    p.add_argument("--parts", default="routing,scaling,pd")
    p.add_argument("--port", type=int, default=8431)
    g = p.add_argument_group("routing")
    g.add_argument("--num-conversations", type=int, default=64)
    g.add_argument("--num-turns", type=int, default=6)
    g.add_argument("--num-tenants", type=int, default=6)
    g.add_argument("--system-len", type=int, default=128)
    g.add_argument("--user-len", type=int, default=64)
    g.add_argument("--output-len", type=int, default=32)
    g.add_argument("--concurrency", type=int, default=8)
    g.add_argument("--think-time", type=float, default=2.0, help="mean seconds between a "
                   "conversation's turns")
    g.add_argument("--max-active-conversations", type=positive_int, default=None,
                   help="conversations open at a time, the next starting when one ends "
                   "(default: all open from the start)")
    g.add_argument("--routing-cache-blocks", type=int, default=1536,
                   help="KV blocks per replica (--num-gpu-blocks-override) in this part")
    g = p.add_argument_group("simulate")
    g.add_argument("--trace", default=None, help="a trace from bench serve --save-trace "
                   "(default: the routing part's workload)")
    g.add_argument("--sim-replicas", default="1,2,4,8")
    g.add_argument("--sim-policies", default="prefix,round_robin,least_loaded")
    g.add_argument("--sim-prefill-tok-s", type=float, default=20000.0,
                   help="a replica's prefill rate (default: an 8B model on one H100, about)")
    g.add_argument("--sim-decode-step-ms", type=float, default=12.0,
                   help="a decode step's time, whatever the batch")
    g.add_argument("--sim-concurrency", type=int, default=None,
                   help="requests in flight (default: --concurrency)")
    g.add_argument("--sim-seeds", type=int, default=1,
                   help="runs per configuration, each with its own workload (--seed + i) and "
                        "think times; reported: the mean hit rate and requests/s and the median "
                        "of the median TTFTs, each run's figures beside them")
    g = p.add_argument_group("scaling")
    g.add_argument("--scaling-prompts", type=int, default=96)
    g.add_argument("--scaling-input-len", type=int, default=256)
    g.add_argument("--scaling-output-len", type=int, default=64)
    g.add_argument("--scaling-concurrency", type=int, default=48)
    g = p.add_argument_group("pd")
    g.add_argument("--streams", type=int, default=4, help="decoding streams")
    g.add_argument("--stream-output-len", type=int, default=384)
    g.add_argument("--long-prompts", type=int, default=4)
    g.add_argument("--long-len", type=int, default=2048)
    g.add_argument("--long-every", type=float, default=4.0, help="seconds between long prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--tag", default=None)


def _workload_args(args, **over) -> argparse.Namespace:
    """bench serve's workload options."""
    base = dict(dataset_name="prefix-chat", dataset_path=None, num_prompts=args.num_conversations,
                random_input_len=args.user_len, random_output_len=args.output_len,
                random_range_ratio=0.0, num_turns=args.num_turns, system_len=args.system_len,
                num_tenants=args.num_tenants, tokenizer=None, vocab_size=_vocab(args),
                max_model_len=4096, request_rate=float("inf"), ignore_eos=True, seed=args.seed,
                think_time=getattr(args, "think_time", 0.0),
                max_active_conversations=getattr(args, "max_active_conversations", None),
                base_url=None, endpoint="/v1/completions", api_key=None)
    base.update(over)
    return argparse.Namespace(**base)


def _vocab(args) -> int:
    from jaxllm.loader.loader import get_tokenizer
    return len(get_tokenizer(args.model))


class _Server:
    def __init__(self, args, name: str, extra: list[str]):
        self.args, self.name, self.extra = args, name, extra

    def __enter__(self):
        os.makedirs(self.args.results_dir, exist_ok=True)
        self.log = open(os.path.join("/tmp", f"bench-replicas-{self.name}.log"), "w")
        start = time.perf_counter()
        self.proc, self.base = start_server(self.args.model, self.args.serve_args, self.args.port,
                                            self.log, self.extra)
        self.ready_s = time.perf_counter() - start
        print(f"[{self.name}] ready in {self.ready_s:.1f} s: {' '.join(self.extra)}", flush=True)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()
        self.log.close()
        time.sleep(2)  # Ray's processes go with the server


def _load(server, wl, concurrency):
    wl.base_url = server.base
    chains = bench_serve.build_workload(wl)
    import httpx
    model = httpx.get(server.base + "/v1/models").json()["data"][0]["id"]
    outcomes, duration = asyncio.run(bench_serve.run_load(wl, chains, model, concurrency))
    return bench_serve.summarize(outcomes, duration), outcomes


def _per_replica(base: str) -> dict:
    """Requests routed to each replica and the prompt tokens it found cached."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    out: dict = {}
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        for smp in fam.samples:
            key = {"jaxllm:router_requests_total": "routed",
                   "jaxllm:router_prompt_tokens_total": "prompt_tokens",
                   "jaxllm:router_cached_tokens_total": "cached_tokens",
                   "jaxllm:router_expected_cached_tokens_total": "expected_cached_tokens"
                   }.get(smp.name)
            if key is not None:
                r = out.setdefault(smp.labels["replica"], {})
                r[key] = r.get(key, 0) + int(smp.value)
                if key == "routed":  # and why
                    why = r.setdefault("reasons", {})
                    why[smp.labels["reason"]] = why.get(smp.labels["reason"], 0) + int(smp.value)
    return out


def _strip(r: dict) -> dict:
    return {k: v for k, v in r.items() if not k.startswith("_")}


def routing(args) -> dict:
    out = {}
    for policy in ("prefix", "round_robin"):
        with _Server(args, f"routing-{policy}", [
                "--data-parallel-size", "2", "--routing-policy", policy,
                "--num-gpu-blocks-override", str(args.routing_cache_blocks)]) as s:
            report, _ = _load(s, _workload_args(args), args.concurrency)
            report["per_replica"] = _per_replica(s.base)
        bench_serve.print_report(report, args.concurrency)
        out[policy] = _strip(report)
    p, rr = out["prefix"], out["round_robin"]
    out["cached_fraction_ratio"] = p["cached_token_fraction"] / max(rr["cached_token_fraction"], 1e-9)
    out["median_ttft_ratio"] = p["ttft_ms"]["median"] / rr["ttft_ms"]["median"]
    out["request_throughput_ratio"] = p["request_throughput"] / rr["request_throughput"]
    print(f"prefix vs round robin: cached fraction {out['cached_fraction_ratio']:.2f}x, "
          f"median TTFT {out['median_ttft_ratio']:.2f}x", flush=True)
    return out


def scaling(args) -> dict:
    out = {}
    wl = _workload_args(args, dataset_name="random", num_prompts=args.scaling_prompts,
                        random_input_len=args.scaling_input_len,
                        random_output_len=args.scaling_output_len,
                        max_active_conversations=None)  # (a routing-part flag)
    for name, extra in (("one_engine", []), ("two_replicas", ["--data-parallel-size", "2"])):
        with _Server(args, f"scaling-{name}", extra) as s:
            report, _ = _load(s, wl, args.scaling_concurrency)
        bench_serve.print_report(report, args.scaling_concurrency)
        out[name] = _strip(report)
    out["request_throughput_ratio"] = (out["two_replicas"]["request_throughput"]
                                       / out["one_engine"]["request_throughput"])
    out["cores"] = len(os.sched_getaffinity(0))
    print(f"2 replicas vs 1 engine: {out['request_throughput_ratio']:.2f}x requests/s on "
          f"{out['cores']} cores", flush=True)
    return out


async def _mixed(base: str, model: str, args) -> dict:
    """Streams decoding while long prompts arrive: each kind's outcomes."""
    import httpx
    wl = _workload_args(args, dataset_name="random")
    from benchmarks import datasets
    src = datasets.TokenSource(wl.vocab_size, set(), args.seed)
    streams = [datasets.Sample(src.tokens(64), args.stream_output_len) for _ in range(args.streams)]
    longs = [datasets.Sample(src.tokens(args.long_len), 16) for _ in range(args.long_prompts)]
    url = base + "/v1/completions"
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        tasks = [asyncio.create_task(bench_serve.one_request(client, url, model, s, True, {}))
                 for s in streams]
        await asyncio.sleep(2.0)  # the streams are decoding
        long_tasks = []
        for s in longs:
            long_tasks.append(asyncio.create_task(bench_serve.one_request(client, url, model, s, True, {})))
            await asyncio.sleep(args.long_every)
        stream_out = await asyncio.gather(*tasks)
        long_out = await asyncio.gather(*long_tasks)
    return {"streams": stream_out, "long": long_out}


def pd(args) -> dict:
    out = {}
    for name, extra in (("colocated", ["--data-parallel-size", "2"]),
                        ("split", ["--data-parallel-size", "2", "--kv-transfer-config",
                                   json.dumps(KV)])):
        with _Server(args, f"pd-{name}", extra) as s:
            import httpx
            model = httpx.get(s.base + "/v1/models").json()["data"][0]["id"]
            # one long prompt first: both servers' shapes and caches warm
            asyncio.run(_mixed(s.base, model, argparse.Namespace(**{
                **vars(args), "streams": 1, "stream_output_len": 8, "long_prompts": 1,
                "long_every": 0.0, "seed": args.seed + 1})))
            before = bench_serve.scrape(s.base, {})
            got = asyncio.run(_mixed(s.base, model, args))
            after = bench_serve.scrape(s.base, {})
        itl = [x for o in got["streams"] if o.ok for x in o.itl]
        r = {"stream_itl_ms": {k: (v * 1e3 if k != "n" else v) for k, v in percentiles(itl).items()},
             "long_ttft_ms": {k: (v * 1e3 if k != "n" else v)
                              for k, v in percentiles([o.ttft for o in got["long"] if o.ok]).items()},
             "failed": sum(not o.ok for o in got["streams"] + got["long"])}
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after
                 if k.startswith("jaxllm:kv_transfer")}
        if delta:
            moved, secs = delta.get("jaxllm:kv_transfer_received_bytes_total", 0.0), \
                delta.get("jaxllm:kv_transfer_receive_seconds_total", 0.0)
            r["kv_transfer"] = {"bytes": moved, "requests": args.long_prompts,
                                "bytes_per_request": moved / max(args.long_prompts, 1),
                                "receive_seconds": secs,
                                "receive_bytes_per_s": moved / secs if secs else None,
                                "import_seconds": delta.get("jaxllm:kv_transfer_import_seconds_total"),
                                "failures": delta.get("jaxllm:kv_transfer_failures_total", 0.0)}
        print(f"[pd-{name}] stream ITL p50 {r['stream_itl_ms']['median']:.1f} ms p99 "
              f"{r['stream_itl_ms']['p99']:.1f} ms; long TTFT p50 {r['long_ttft_ms']['median']:.0f} ms"
              + (f"; KV {r['kv_transfer']['bytes_per_request'] / 2**20:.1f} MiB per request at "
                 f"{(r['kv_transfer']['receive_bytes_per_s'] or 0) / 2**30:.2f} GiB/s"
                 if "kv_transfer" in r else ""), flush=True)
        out[name] = r
    out["p99_itl_ratio"] = out["split"]["stream_itl_ms"]["p99"] / out["colocated"]["stream_itl_ms"]["p99"]
    return out


def simulate(args) -> dict:
    from benchmarks import route_sim
    seeds = [args.seed + i for i in range(max(args.sim_seeds, 1))]
    if args.trace:
        workloads, source = [route_sim.load_trace(args.trace)] * len(seeds), args.trace
    else:
        workloads = [[[(s.prompt_token_ids, s.output_len) for s in chain]
                      for chain in bench_serve.build_workload(_workload_args(args, seed=seed))]
                     for seed in seeds]
        source = "the routing part's workload"
    chains = workloads[0]
    costs = route_sim.Costs(prefill_tok_s=args.sim_prefill_tok_s,
                            decode_step_s=args.sim_decode_step_ms / 1e3)
    rows = []
    for n in [int(x) for x in args.sim_replicas.split(",")]:
        for policy in [x.strip() for x in args.sim_policies.split(",")]:
            if n == 1 and rows and rows[-1]["replicas"] == 1:
                continue  # one replica: every policy is the same
            runs = [route_sim.simulate(w, n, policy, args.routing_cache_blocks,
                                       concurrency=args.sim_concurrency or args.concurrency,
                                       think_time=args.think_time, costs=costs, seed=seed,
                                       max_active=args.max_active_conversations)
                    for w, seed in zip(workloads, seeds)]
            r = _mean_run(runs)
            rows.append(r)
            print(f"[simulate] {n} replicas, {policy:>12}: cached {r['cached_token_fraction']:.3f}, "
                  f"{r['request_throughput']:.2f} requests/s, median TTFT "
                  f"{r['median_ttft_ms']:.0f} ms", flush=True)
    out = {"source": source, "requests": sum(len(c) for c in chains), "seeds": seeds,
           "cache_blocks_per_replica": args.routing_cache_blocks,
           "max_active_conversations": args.max_active_conversations,
           "costs": {"prefill_tok_s": costs.prefill_tok_s, "decode_step_s": costs.decode_step_s},
           "runs": rows}
    one = next((r for r in rows if r["replicas"] == 1), None)
    for r in rows:
        if one is not None and r is not one:
            r["request_throughput_vs_one"] = r["request_throughput"] / one["request_throughput"]
        rr = next((x for x in rows if x["replicas"] == r["replicas"] and x["policy"] == "round_robin"), None)
        if rr is not None and r["policy"] == "prefix":
            r["cached_fraction_vs_round_robin"] = (r["cached_token_fraction"]
                                                   / max(rr["cached_token_fraction"], 1e-9))
    return out


def _mean_run(runs: list[dict]) -> dict:
    """One configuration's runs (one per seed) as one row: hit rate and requests/s averaged,
    the median of the median TTFTs; each run's own figures under "per_seed"."""
    if len(runs) == 1:
        return runs[0]
    row = dict(runs[0])
    for key in ("cached_token_fraction", "request_throughput", "duration_s"):
        row[key] = statistics.fmean(r[key] for r in runs)
    row["median_ttft_ms"] = float(statistics.median(r["median_ttft_ms"] for r in runs))
    reasons: dict[str, int] = {}
    for r in runs:
        for k, v in r["reasons"].items():
            reasons[k] = reasons.get(k, 0) + v
    row["reasons"] = reasons
    for key in ("per_replica_hit_rate", "per_replica_routed"):
        row[key] = [statistics.fmean(col) for col in zip(*(r[key] for r in runs))]
    row["per_seed"] = [{k: r[k] for k in ("cached_token_fraction", "request_throughput",
                                          "median_ttft_ms")} for r in runs]
    return row


def run(args) -> int:
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - {"routing", "scaling", "pd", "simulate"}
    if unknown:
        raise ValueError(f"--parts: unknown {sorted(unknown)} (routing, scaling, pd, simulate)")
    result = {"serve_args": shlex.split(args.serve_args), "model": args.model or "default"}
    for part in parts:
        result[part] = {"routing": routing, "scaling": scaling, "pd": pd,
                        "simulate": simulate}[part](args)
    write_result(args, result, "replicas")
    return 0
