"""The router over a request trace on simulated replicas (`jaxllm bench replicas --parts
simulate`): hit rates and requests/s for 1, 2, 4... replicas under each routing policy, where
that many real replicas cannot be had (one GPU; two CPU cores).

What is real: the router (distributed.router, as the server runs it) and each replica's prefix
cache (core.kv_cache_manager: the engine's block pool, block keys and eviction order). What is
modelled: each replica's continuous batching (a step admits waiting requests while their
uncached prompt tokens fit the step's budget and their blocks fit the cache, then every
running request decodes one token) and its cost: prefill at `prefill_tok_s` tokens a second
plus `decode_step_s` for a step that decodes, whatever the batch (decode bound by reading the
weights, as on a GPU). The clients are the benchmark's: conversations (chains of turns) with
an exponential think time between turns, at most `concurrency` requests in flight and, with
`max_active`, at most that many conversations open at a time (the next opens when one ends).

Hit rates depend on the cache mechanics and the order requests arrive in, which the model
only shapes through timing; requests/s depend on the cost model as well."""
from __future__ import annotations

import heapq
import json
import random
from collections import deque
from dataclasses import dataclass, field

from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request
from jaxllm.distributed.router import Router
from jaxllm.sampling_params import SamplingParams


@dataclass
class Costs:
    prefill_tok_s: float = 20000.0
    decode_step_s: float = 0.012
    max_batched_tokens: int = 8192
    max_num_seqs: int = 256


@dataclass
class _Job:
    chain: int
    turn: int
    request: Request
    output_len: int
    submitted: float
    decision: object = None
    cached: int = 0
    first_token: float | None = None


@dataclass
class _Replica:
    kv: KVCacheManager
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    busy: bool = False


def load_trace(path: str) -> list[list[tuple[list[int], int]]]:
    """A trace written by `jaxllm bench serve --save-trace`: one JSON line per request
    ({"chain", "prompt_token_ids", "output_len"}), a chain's turns in order."""
    chains: dict[int, list] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                chains.setdefault(int(r["chain"]), []).append((r["prompt_token_ids"], int(r["output_len"])))
    return [chains[c] for c in sorted(chains)]


def simulate(chains, num_replicas: int, policy: str, cache_blocks: int, block_size: int = 16,
             concurrency: int = 8, think_time: float = 2.0, costs: Costs | None = None,
             seed: int = 0, cache_threshold: float = 0.3, max_active: int | None = None) -> dict:
    """chains: [[(prompt token ids, output tokens), ...] per conversation]."""
    if max_active is not None and max_active < 1:
        raise ValueError(f"max_active must be at least 1, got {max_active}")
    costs = costs or Costs()
    rng = random.Random(seed)
    router = Router(num_replicas, block_size, cache_blocks, policy, cache_threshold=cache_threshold)
    reps = [_Replica(KVCacheManager(cache_blocks, block_size)) for _ in range(num_replicas)]
    events: list = []  # (time, order, kind, payload)
    order = iter(range(10 ** 12))
    ready: deque = deque()   # turns whose think time is over, waiting for a client slot
    in_flight = 0
    done: list[_Job] = []

    def push(t, kind, payload):
        heapq.heappush(events, (t, next(order), kind, payload))

    opened = min(max_active or len(chains), len(chains))
    for c in range(opened):
        push(0.0, "ready", (c, 0))

    def submit(now):
        nonlocal in_flight
        while ready and in_flight < concurrency:
            c, turn = ready.popleft()
            prompt, out_len = chains[c][turn]
            req = Request(f"{c}-{turn}", list(prompt), SamplingParams(max_tokens=out_len),
                          eos_token_id=None, seed=0)
            job = _Job(c, turn, req, out_len, now)
            job.decision = router.route(req.prompt_token_ids)
            r = reps[job.decision.replica]
            r.waiting.append(job)
            in_flight += 1
            if not r.busy:
                step(job.decision.replica, now)

    def step(i, now):
        """Start replica i's next step at `now`, if it has work."""
        r = reps[i]
        budget, prefill = costs.max_batched_tokens, 0
        admitted = []
        while r.waiting and len(r.running) + len(admitted) < costs.max_num_seqs:
            job = r.waiting[0]
            hits, n_hit = r.kv.get_computed_blocks(job.request)
            new = job.request.num_tokens - n_hit
            if admitted and new > budget:
                break
            if r.kv.allocate_slots(job.request, new, hits) is None:
                break  # no room in the cache: it waits for running requests to finish
            r.waiting.popleft()
            job.request.num_computed_tokens = job.request.num_tokens
            job.cached = n_hit
            budget -= new
            prefill += new
            admitted.append(job)
        decoding = list(r.running)
        if not admitted and not decoding:
            if r.waiting:
                raise ValueError(f"a prompt of {r.waiting[0].request.num_tokens} tokens does not "
                                 f"fit a replica's cache of {cache_blocks} blocks")
            r.busy = False
            return
        r.busy = True
        dt = prefill / costs.prefill_tok_s + (costs.decode_step_s if decoding else 0.0)
        push(now + dt, "step", (i, admitted, decoding))

    def finish_step(i, admitted, decoding, now):
        nonlocal in_flight, opened
        r = reps[i]
        for job in admitted:  # a prefill ends with the first output token
            job.first_token = now
            router.first_token(job.decision)
            job.request.append_output_token(rng.randrange(1, 1 << 20))
            r.running.append(job)
        for job in decoding:
            req = job.request
            if r.kv.allocate_slots(req, 1) is None:  # out of blocks: recompute it later
                r.kv.free(req)
                r.running.remove(job)
                req.num_computed_tokens = 0
                r.waiting.appendleft(job)
                continue
            req.num_computed_tokens += 1
            req.append_output_token(rng.randrange(1, 1 << 20))
        for job in [j for j in r.running if j.request.num_output_tokens >= j.output_len]:
            r.running.remove(job)
            r.kv.free(job.request)
            router.finished(job.decision, job.cached)
            in_flight -= 1
            done.append(job)
            if job.turn + 1 == len(chains[job.chain]) and opened < len(chains):
                push(now, "ready", (opened, 0))  # a conversation ended: the next one opens
                opened += 1
            elif job.turn + 1 < len(chains[job.chain]):
                push(now + rng.expovariate(1.0 / think_time) if think_time > 0 else now,
                     "ready", (job.chain, job.turn + 1))
        router.set_kv_usage(i, r.kv.usage())
        step(i, now)

    now = 0.0
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "ready":
            ready.append(payload)
        else:
            finish_step(*payload, now)
        submit(now)
    prompt_tokens = sum(j.request.num_prompt_tokens for j in done)
    ttft = sorted(j.first_token - j.submitted for j in done)
    stats = router.stats()
    reasons: dict[str, int] = {}
    for j in done:
        reasons[j.decision.reason] = reasons.get(j.decision.reason, 0) + 1
    return {"replicas": num_replicas, "policy": policy, "requests": len(done), "reasons": reasons,
            "cached_token_fraction": sum(j.cached for j in done) / max(prompt_tokens, 1),
            "duration_s": now, "request_throughput": len(done) / now if now else 0.0,
            "median_ttft_ms": 1e3 * ttft[len(ttft) // 2] if ttft else None,
            "per_replica_hit_rate": [s["cached_tokens"] / max(s["prompt_tokens"], 1) for s in stats],
            "per_replica_routed": [s["routed"] for s in stats]}
