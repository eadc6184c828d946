"""`jaxllm bench web`: what the chat page and the dashboard cost, measured in a real headless
Chromium against a real `jaxllm serve`.

- Page weight: bytes transferred on a first load of `/` and of `/dashboard` (cache cleared),
  as the browser's Resource Timing reports them.
- What the page adds to the time to first token: the page's own TTFT (from sending to the
  first token drawn) against the API's TTFT for the same request from a Python client on a
  kept-alive connection (from sending to the first content chunk), alternated, on prompts of
  equal length that share no prefix beyond the chat template's.
- Whether the dashboard slows the API: 64 concurrent API streams, rounds with the dashboard
  open in the browser and rounds with a blank page, in the order blank, open, open, blank;
  output tokens per second."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time

from benchmarks.common import start_server, write_result


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="what `jaxllm serve` serves (default: its default)")
    p.add_argument("--serve-args", default="--max-model-len 2048", help="more `jaxllm serve` arguments")
    p.add_argument("--port", type=int, default=8235)
    p.add_argument("--ttft-trials", type=int, default=20, help="requests each from page and API")
    p.add_argument("--streams", type=int, default=64, help="concurrent API streams")
    p.add_argument("--requests", type=int, default=192, help="requests per throughput round")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="throughput rounds of each kind")
    p.add_argument("--results-dir", default="benchmarks/results")
    p.add_argument("--tag", default=None)


def page_weight(driver, base: str, path: str) -> dict:
    """Bytes transferred loading `path` with an empty cache (the page and its files; the
    API calls it makes are not page weight)."""
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.clearBrowserCache", {})
    driver.get(base + path)
    time.sleep(1.5)
    entries = driver.execute_script("""
        const nav = performance.getEntriesByType("navigation")[0];
        const files = performance.getEntriesByType("resource").filter((r) => r.initiatorType !== "fetch");
        return [{name: nav.name, transfer: nav.transferSize, body: nav.decodedBodySize},
                ...files.map((r) => ({name: r.name, transfer: r.transferSize, body: r.decodedBodySize}))];""")
    return {"files": len(entries), "kb_transferred": sum(e["transfer"] for e in entries) / 1024,
            "kb_decoded": sum(e["body"] for e in entries) / 1024,
            "by_file": {e["name"].removeprefix(base): e["transfer"] for e in entries}}


def prompt(i: int, who: str) -> str:
    """Prompts of one length (13 tokens for the default model) that differ from their first
    word on, so that neither side finds the other's prompt in the prefix cache."""
    return f"{who} {i:03d}: name three rivers and one mountain."


# Sends a message as a user would (the text typed, the form submitted) and waits for the reply
# to end without polling: a poll from the driver wakes the browser while the server computes,
# and on a machine of few cores that costs the server time it would not lose otherwise.
_SEND_AND_WAIT = """
const [text, done] = arguments;
document.getElementById("clear").click();
const box = document.getElementById("input");
box.value = text;
const watch = new MutationObserver(() => {
  const r = document.querySelector(".msg.assistant[data-done]");
  if (r) { watch.disconnect(); done(r.dataset.ttftMs || "none"); }
});
watch.observe(document.getElementById("messages"), {subtree: true, attributes: true, childList: true});
document.getElementById("composer").requestSubmit();
"""


def page_ttft(driver, text: str) -> float:
    driver.set_script_timeout(300)
    got = driver.execute_async_script(_SEND_AND_WAIT, text)
    if got == "none":
        raise RuntimeError("the page's reply had no token")
    return float(got)


def api_ttft(client, base: str, model: str, text: str, max_tokens: int) -> float:
    """From sending to the first content chunk, on a kept-alive connection (as the browser's)."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "stream": True,
            "temperature": 0, "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if first is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
    if first is None:
        raise RuntimeError("the API's reply had no token")
    return 1000 * (first - t0)


async def _streams(base: str, model: str, streams: int, requests: int, max_tokens: int) -> dict:
    import openai
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    queue = list(range(requests))
    tokens = 0

    async def worker():
        nonlocal tokens
        while queue:
            i = queue.pop()
            stream = await client.chat.completions.create(
                model=model, stream=True, max_tokens=max_tokens, temperature=1.0, seed=i,
                stream_options={"include_usage": True},
                messages=[{"role": "user", "content": f"Story {i}: tell me about the sea."}])
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(streams)))
    wall = time.perf_counter() - t0
    await client.close()
    return {"seconds": wall, "output_tokens": tokens, "output_tok_s": tokens / wall}


def run(args) -> int:
    from benchmarks.browser import chromium
    log = open(os.path.join(tempfile.gettempdir(), f"jaxllm-web-bench-{os.getpid()}.log"), "w")
    proc, base = start_server(args.model, args.serve_args, args.port, log)
    driver = None
    try:
        import httpx
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        driver = chromium()
        weight = {"chat": page_weight(driver, base, "/"), "dashboard": page_weight(driver, base, "/dashboard")}
        print(f"page weight: chat {weight['chat']['kb_transferred']:.1f} KB, "
              f"dashboard {weight['dashboard']['kb_transferred']:.1f} KB")

        driver.get(base + "/")
        for field, value in (("temperature", "0"), ("max_tokens", "16"), ("seed", "")):
            driver.execute_script("const el = document.getElementById(arguments[0]);"
                                  "el.value = arguments[1]; el.dispatchEvent(new Event('change'));",
                                  field, value)
        api = httpx.Client()
        api_ttft(api, base, model, prompt(999, "warm-up"), 16)
        page_ttft(driver, prompt(998, "warm-up"))
        page, api_ms = [], []
        for i in range(args.ttft_trials):  # alternated, each first half the time
            order = ("page", "api") if i % 2 == 0 else ("api", "page")
            for who in order:
                if who == "page":
                    page.append(page_ttft(driver, prompt(i, who)))
                else:
                    api_ms.append(api_ttft(api, base, model, prompt(i, who), 16))
        api.close()
        ttft = {"page_ms": page, "api_ms": api_ms, "page_median_ms": statistics.median(page),
                "api_median_ms": statistics.median(api_ms),
                "page_adds_ms": statistics.median(page) - statistics.median(api_ms)}
        print(f"TTFT: page {ttft['page_median_ms']:.1f} ms, API {ttft['api_median_ms']:.1f} ms "
              f"(median; the page adds {ttft['page_adds_ms']:.1f} ms)")

        rounds = []
        asyncio.run(_streams(base, model, args.streams, args.streams, args.max_tokens))  # warm-up
        for r in range(2 * args.rounds):
            dashboard = r % 4 in (1, 2)  # blank, open, open, blank, ...: a drift favours neither
            driver.get(base + "/dashboard" if dashboard else "about:blank")
            time.sleep(2)
            updated = "return document.getElementById('status').dataset.updated || null"
            before = driver.execute_script(updated) if dashboard else None
            got = asyncio.run(_streams(base, model, args.streams, args.requests, args.max_tokens))
            got["dashboard_open"] = dashboard
            if dashboard:  # the page kept drawing through the round
                got["dashboard_updated"] = driver.execute_script(updated) != before
            rounds.append(got)
            print(f"round {r}: {'dashboard open' if dashboard else 'blank page   '} "
                  f"{got['output_tok_s']:.1f} output tok/s")
        with_ = [x["output_tok_s"] for x in rounds if x["dashboard_open"]]
        without = [x["output_tok_s"] for x in rounds if not x["dashboard_open"]]
        streams = {"rounds": rounds, "with_dashboard_tok_s": statistics.mean(with_),
                   "without_tok_s": statistics.mean(without),
                   "ratio": statistics.mean(with_) / statistics.mean(without)}
        print(f"{args.streams} streams: {streams['with_dashboard_tok_s']:.1f} output tok/s with the "
              f"dashboard open, {streams['without_tok_s']:.1f} without ({streams['ratio']:.3f}x)")
        result = {"model": model, "serve_args": args.serve_args, "page_weight": weight, "ttft": ttft,
                  "streams": args.streams, "requests_per_round": args.requests,
                  "max_tokens": args.max_tokens, "throughput": streams,
                  "chromium": driver.capabilities.get("browserVersion")}
        write_result(args, result, "web-ui")
    finally:
        if driver is not None:
            driver.quit()
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0

