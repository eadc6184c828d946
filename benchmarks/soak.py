"""`jaxllm bench soak`: minutes of mixed traffic against a real `jaxllm serve` through the
official openai client, with injected step faults, and a pass/fail summary.

The traffic: streamed and whole completions and chats, streams cancelled midway, clients
that hang up before the answer, malformed and oversized requests, long chats trimmed to a
budget, structured (JSON-schema) requests, and LoRA requests when an adapter is given.
Every request must end with an answer or an error (none lost or hung); malformed ones must
get a 4xx, requests of an injected failed step a 500 naming it. Along the way the server's
RSS, its /metrics gauges and the latency percentiles are sampled; at the end the server must
come back to idle (no running or waiting request, no KV block held).

Before the soak, a long conversation is replayed turn by turn under a token budget: every
turn must be answered, and the prefix-cache hit rate on the trimmed histories is reported."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import time

import numpy as np

from benchmarks import common
from benchmarks.common import percentiles, write_result

WORDS = ("the sea river mountain light stone cloud green quiet storm morning garden city road "
         "paper window silver music winter bright engine market forest letter").split()
KINDS = {  # kind -> weight in the mix
    "stream": 25, "whole": 15, "chat_stream": 15, "chat": 10, "cancel": 10, "disconnect": 5,
    "malformed": 5, "oversized": 3, "long_chat": 7, "structured": 5, "lora": 0}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer"}},
          "required": ["name", "count"]}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="what `jaxllm serve` serves (default: its default)")
    p.add_argument("--serve-args", default="--max-model-len 2048",
                   help="more `jaxllm serve` arguments")
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--concurrency", type=int, default=16, help="clients at once (saturation)")
    p.add_argument("--fault-every", type=int, default=500,
                   help="about one step in N fails on purpose (--inject-step-faults); 0: none")
    p.add_argument("--lora", default=None, metavar="NAME=PATH",
                   help="an adapter to serve and send a share of the requests to")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds after which a request with no answer counts as hung")
    p.add_argument("--sample-seconds", type=float, default=10.0)
    p.add_argument("--replay-turns", type=int, default=50)
    p.add_argument("--replay-budget", type=int, default=1024)
    p.add_argument("--port", type=int, default=8234)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default=None, help="the server's log file (default: a temporary one)")
    p.add_argument("--results-dir", default="benchmarks/results")
    p.add_argument("--tag", default=None)


def _code(body) -> str | None:
    """An OpenAI error body's code (the client hands over the body or its "error" object)."""
    if isinstance(body, dict):
        body = body.get("error", body)
        return body.get("code") if isinstance(body, dict) else None
    return None


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Soak:
    def __init__(self, args, base: str, model: str):
        import httpx
        import openai
        self.args, self.base, self.model = args, base, model
        self.client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                                         timeout=args.request_timeout)
        self.http = httpx.AsyncClient(base_url=base, timeout=args.request_timeout)
        self.openai = openai
        self.outcomes: list[dict] = []
        kinds = dict(KINDS)
        if args.lora:
            kinds["lora"] = 5
        self.kinds, self.weights = list(kinds), list(kinds.values())

    async def one(self, rng: random.Random) -> dict:
        kind = rng.choices(self.kinds, self.weights)[0]
        start = time.time()
        rec = {"kind": kind, "start": start}
        try:
            rec.update(await asyncio.wait_for(self._send(kind, rng), self.args.request_timeout))
        except asyncio.TimeoutError:
            rec["outcome"] = "hung"
        except self.openai.APIStatusError as e:
            rec["outcome"], rec["status"] = self._status_outcome(kind, e.status_code, e.body), e.status_code
        except self.openai.APIError as e:  # a stream's error event, or the connection
            rec["outcome"] = "step_failed" if _code(getattr(e, "body", None)) == "step_failed" else "unexpected"
            rec["error"] = str(e)[:200]
        except Exception as e:  # noqa: BLE001 - anything else is a finding, not a crash
            rec["outcome"], rec["error"] = "unexpected", f"{type(e).__name__}: {str(e)[:200]}"
        rec["seconds"] = time.time() - start
        return rec

    def _status_outcome(self, kind: str, status: int, body) -> str:
        if status == 500 and _code(body) == "step_failed":
            return "step_failed"
        if kind in ("malformed", "oversized") and 400 <= status < 500:
            return "refused"  # as it should be
        return "unexpected"

    async def _send(self, kind: str, rng: random.Random) -> dict:
        c, m, mt = self.client, self.model, self.args.max_tokens
        prompt = words(rng, rng.randint(20, 200))
        if kind in ("stream", "cancel", "lora"):
            model = self.args.lora.split("=")[0] if kind == "lora" else m
            first, n, t0 = None, 0, time.time()
            stream = await c.completions.create(model=model, prompt=prompt, max_tokens=mt,
                                                stream=True, temperature=0.8)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    first = first or time.time() - t0
                    n += 1
                    if kind == "cancel" and n >= rng.randint(1, 8):
                        await stream.close()  # the client stops reading: the server aborts it
                        return {"outcome": "cancelled", "ttft": first}
            return {"outcome": "ok", "ttft": first}
        if kind == "whole":
            await c.completions.create(model=m, prompt=prompt, max_tokens=mt, temperature=0.8)
            return {"outcome": "ok"}
        if kind in ("chat", "chat_stream"):
            msgs = [{"role": "user", "content": prompt}]
            if kind == "chat":
                await c.chat.completions.create(model=m, messages=msgs, max_tokens=mt)
                return {"outcome": "ok"}
            first, t0 = None, time.time()
            async for chunk in await c.chat.completions.create(model=m, messages=msgs,
                                                               max_tokens=mt, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.time() - t0
            return {"outcome": "ok", "ttft": first}
        if kind == "disconnect":  # hang up before the answer
            import httpx
            try:
                await self.http.post("/v1/completions", json={
                    "model": m, "prompt": prompt, "max_tokens": mt}, timeout=0.05)
            except httpx.TimeoutException:
                return {"outcome": "disconnected"}
            return {"outcome": "ok"}
        if kind == "malformed":
            body = rng.choice([b'{"model": "x", "prompt": ', b'[1, 2', json.dumps(
                {"model": m, "prompt": "x", "temperature": "hot"}).encode(), json.dumps(
                {"model": m, "messages": [{"role": "nobody", "content": "x"}]}).encode()])
            path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
            r = await self.http.post(path, content=body, headers={"Content-Type": "application/json"})
            return {"outcome": "refused" if 400 <= r.status_code < 500 else "unexpected",
                    "status": r.status_code}
        if kind == "oversized":
            await c.completions.create(model=m, prompt=words(rng, 6000), max_tokens=mt)
            return {"outcome": "unexpected"}  # it must have been refused
        if kind == "long_chat":
            msgs = []
            for i in range(rng.randint(10, 30)):
                msgs += [{"role": "user", "content": words(rng, 40)},
                         {"role": "assistant", "content": words(rng, 40)}]
            msgs.append({"role": "user", "content": "and now?"})
            raw = await c.chat.completions.with_raw_response.create(
                model=m, messages=msgs, max_tokens=mt, extra_body={"context_budget": 512})
            return {"outcome": "ok", "trimmed": int(raw.headers.get("x-jaxllm-trimmed-messages", 0))}
        if kind == "structured":
            r = await c.chat.completions.create(
                model=m, messages=[{"role": "user", "content": "a name and a count"}], max_tokens=64,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
            if r.choices[0].finish_reason == "stop":  # cut by max_tokens, the JSON is unfinished
                json.loads(r.choices[0].message.content)
            return {"outcome": "ok"}
        raise ValueError(kind)

    async def worker(self, i: int, deadline: float) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        while time.time() < deadline:
            self.outcomes.append(await self.one(rng))

    async def replay(self) -> dict:
        """One conversation, turn by turn, under a budget: every turn answered?"""
        rng, msgs, turns, retries = random.Random(self.args.seed), [], [], 0
        msgs.append({"role": "system", "content": "You are a terse assistant."})
        for t in range(self.args.replay_turns):
            msgs.append({"role": "user", "content": words(rng, 30)})
            for attempt in range(10):  # a turn that met an injected fault is sent again
                try:
                    raw = await self.client.chat.completions.with_raw_response.create(
                        model=self.model, messages=msgs, max_tokens=self.args.max_tokens,
                        temperature=0,
                        extra_body={"context_budget": self.args.replay_budget})
                    break
                except self.openai.InternalServerError as e:
                    if _code(e.body) != "step_failed" or attempt == 9:
                        raise
                    retries += 1
            r = raw.parse()
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
            turns.append({"prompt_tokens": r.usage.prompt_tokens,
                          "cached_tokens": r.usage.prompt_tokens_details.cached_tokens,
                          "trimmed_messages": int(raw.headers.get("x-jaxllm-trimmed-messages", 0))})
        prompt = sum(t["prompt_tokens"] for t in turns)
        trimmed = [t for t in turns if t["trimmed_messages"]]
        return {"turns": self.args.replay_turns, "answered": len(turns), "retried_after_a_fault": retries,
                "budget": self.args.replay_budget,
                "max_prompt_tokens": max(t["prompt_tokens"] for t in turns),
                "turns_trimmed": len(trimmed),
                "prefix_cache_hit_rate": sum(t["cached_tokens"] for t in turns) / prompt,
                "prefix_cache_hit_rate_trimmed_turns": (
                    sum(t["cached_tokens"] for t in trimmed) / max(1, sum(t["prompt_tokens"] for t in trimmed))),
                "per_turn": {k: [t[k] for t in turns] for k in turns[0]}}


def gauges(base: str) -> dict:
    import httpx
    text = httpx.get(base + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith(("jaxllm:num_requests_running", "jaxllm:num_requests_waiting",
                            "jaxllm:kv_cache_usage_perc", "jaxllm:num_failed_steps_total",
                            "jaxllm:num_failed_requests_total")):
            out[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return out


def rss_bytes(pid: int) -> int:
    import psutil
    return psutil.Process(pid).memory_info().rss


async def sampler(soak: Soak, pid: int, start: float, deadline: float, samples: list) -> None:
    while time.time() < deadline:
        await asyncio.sleep(soak.args.sample_seconds)
        now = time.time()
        recent = [o for o in soak.outcomes if o["start"] >= now - soak.args.sample_seconds * 6
                  and o.get("ttft") is not None]
        ttft = percentiles([o["ttft"] for o in recent])
        samples.append({"t": now - start, "rss": rss_bytes(pid), **await asyncio.to_thread(gauges, soak.base),
                        "ttft_p50": ttft["median"], "ttft_p99": ttft["p99"],
                        "requests": len(soak.outcomes)})


def wait_idle(base: str, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while True:
        g = gauges(base)
        if (g.get("jaxllm:num_requests_running") == 0 and g.get("jaxllm:num_requests_waiting") == 0
                and g.get("jaxllm:kv_cache_usage_perc") == 0) or time.time() > deadline:
            return g
        time.sleep(0.5)


def start_server(args, log) -> tuple[subprocess.Popen, str]:
    extra = []
    if args.fault_every:
        # the engine's stop rule out of reach: faults come per step, and a fast engine takes
        # more steps in the rule's window than a slow one
        extra += ["--inject-step-faults", str(args.fault_every), "--max-step-failures", "1000000"]
    if args.lora:
        extra += ["--enable-lora", "--lora-modules", args.lora]
    return common.start_server(args.model, args.serve_args, args.port, log, extra)


def summarize(outcomes: list[dict], samples: list[dict], idle: dict, replay: dict,
              minutes: float) -> dict:
    by = {}
    for o in outcomes:
        by.setdefault(o["outcome"], 0)
        by[o["outcome"]] += 1
    ttft = [o for o in outcomes if o.get("ttft") is not None]
    t_end = max((o["start"] for o in outcomes), default=0)
    window = 600 if minutes >= 30 else 60 * minutes / 6
    t0 = min((o["start"] for o in outcomes), default=0)
    first = percentiles([o["ttft"] for o in ttft if o["start"] < t0 + window])
    last = percentiles([o["ttft"] for o in ttft if o["start"] >= t_end - window])
    # RSS once the server has settled (a tenth into the run), against the end
    rss0 = samples[max(1, len(samples) // 10) if len(samples) > 1 else 0]["rss"] if samples else 0
    rss1 = samples[-1]["rss"] if samples else 0
    checks = {
        "no request lost or hung": by.get("hung", 0) == 0,
        "no unexpected answer": by.get("unexpected", 0) == 0,
        "back to idle: no request, no KV block held": (
            idle.get("jaxllm:num_requests_running") == 0 and idle.get("jaxllm:num_requests_waiting") == 0
            and idle.get("jaxllm:kv_cache_usage_perc") == 0),
        "RSS growth under 5%": rss0 > 0 and rss1 <= 1.05 * rss0,
        "P99 TTFT of the last window within 1.2x the first's": last["p99"] <= 1.2 * first["p99"],
        "every replayed turn answered": replay["answered"] == replay["turns"],
    }
    unexpected = [{k: o.get(k) for k in ("kind", "status", "error")}
                  for o in outcomes if o["outcome"] == "unexpected"][:50]
    return {"requests": len(outcomes), "by_outcome": by, "minutes": minutes, "unexpected": unexpected,
            "ttft_s": percentiles([o["ttft"] for o in ttft]), "ttft_first_window_s": first,
            "ttft_last_window_s": last, "window_s": window, "rss_start_bytes": rss0,
            "rss_end_bytes": rss1, "rss_growth": rss1 / rss0 - 1 if rss0 else None,
            "idle_after": idle, "replay": replay, "checks": checks, "passed": all(checks.values())}


def plot(samples: list[dict], path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t = np.array([s["t"] for s in samples]) / 60
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    a.plot(t, np.array([s["rss"] for s in samples]) / 2**20)
    a.set_ylabel("server RSS (MiB)")
    b.plot(t, [s["ttft_p50"] for s in samples], label="p50")
    b.plot(t, [s["ttft_p99"] for s in samples], label="p99")
    b.set_ylabel("TTFT (s), last minute")
    b.legend()
    c.plot(t, [s.get("jaxllm:num_requests_running", 0) for s in samples], label="running")
    c.plot(t, [s.get("jaxllm:num_requests_waiting", 0) for s in samples], label="waiting")
    c.plot(t, [s.get("jaxllm:num_failed_steps_total", 0) for s in samples], label="failed steps")
    c.set_xlabel("minutes")
    c.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def run(args) -> int:
    try:
        import openai  # noqa: F401
    except ImportError:
        raise ValueError("bench soak drives the server with the official client: pip install openai") from None
    import tempfile
    log = open(args.log or tempfile.mktemp(prefix="jaxllm-soak-", suffix=".log"), "w")
    proc, base = start_server(args, log)
    try:
        import httpx
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        soak = Soak(args, base, model)

        async def main():
            replay = await soak.replay()
            start = time.time()
            deadline = start + 60 * args.minutes
            samples: list = []
            await asyncio.gather(sampler(soak, proc.pid, start, deadline, samples),
                                 *(soak.worker(i, deadline) for i in range(args.concurrency)))
            await soak.http.aclose()
            return replay, samples

        replay, samples = asyncio.run(main())
        idle = wait_idle(base)
        alive = proc.poll() is None
        result = summarize(soak.outcomes, samples, idle, replay, args.minutes)
        result["checks"]["the server is still up"] = alive
        result["passed"] = all(result["checks"].values())
        # one list per field (a sample every few seconds for an hour, compact in the report)
        result["samples"] = {k: [s.get(k) for s in samples] for k in samples[0]} if samples else {}
        result["fault_every"] = args.fault_every
        result["concurrency"] = args.concurrency
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    path = write_result(args, result, "soak")
    plot(samples, os.path.splitext(path)[0] + ".png")
    print(json.dumps({k: result[k] for k in ("requests", "by_outcome", "checks", "passed")}, indent=1))
    return 0 if result["passed"] else 1
