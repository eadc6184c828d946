"""The dashboard's feed (serve/dashboard.py) read from a real Metrics registry driven by a
stand-in engine: rates over the rate window, percentiles as Prometheus' histogram_quantile
computes them, the points after `since`, ten minutes kept; and every metric the Grafana
dashboard in docs/grafana queries is one the server exposes."""
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from serve import dashboard
from serve.dashboard import DashboardFeed, quantile, read
from serve.metrics import Metrics

REPO = Path(__file__).resolve().parents[2]


class Engine:
    """What Metrics.on_step reads of an engine: its counters and two config fields."""

    def __init__(self, speculative: bool = False, lora: bool = False):
        spec = SimpleNamespace(num_speculative_tokens=2) if speculative else None
        self.config = SimpleNamespace(max_model_len=256, speculative_config=spec)
        self.s = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0,
                  "num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                  "prompt_tokens": 0, "generation_tokens": 0, "kv_slot_steps": 0,
                  "kv_waste_slot_steps": 0, "peak_running": 0, "kv_total_slots": 4096,
                  "num_failed_steps": 0, "num_failed_requests": 0,
                  "spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                  "spec_decode_num_accepted_tokens": 0,
                  "spec_decode_num_accepted_tokens_per_pos": [0, 0]}
        if lora:
            self.s.update(lora_running={"ad0": 1}, lora_waiting={}, max_lora=2)

    def stats(self):
        return dict(self.s)


def finished(ttft: float, model_tokens: int = 4):
    m = SimpleNamespace(arrival_time=0.0, first_scheduled_time=0.01, first_token_time=ttft,
                        finished_time=ttft + 0.1)
    return SimpleNamespace(metrics=m, prompt_token_ids=[1] * 8, num_cached_tokens=0,
                           outputs=[SimpleNamespace(finish_reason="length", token_ids=[0] * model_tokens)])


@pytest.mark.parametrize("q", [0.5, 0.9, 0.99])
def test_quantile_is_prometheus_histogram_quantile(q):
    r = CollectorRegistry()
    bounds = [i / 100 for i in range(1, 101)]
    h = Histogram("x", "x", buckets=bounds, registry=r)
    values = np.random.default_rng(0).gamma(2.0, 0.1, size=5000)
    for v in values:
        h.observe(v)
    buckets = read(r)["x_bucket"]
    got = quantile(q, buckets)
    want = np.quantile(values, q)
    assert abs(got - want) <= 0.01 + 1e-9  # within one bucket's width
    # past the last finite bound the answer is that bound, as Prometheus says
    assert quantile(0.5, {1.0: 0.0, float("inf"): 10.0}) == 1.0
    assert quantile(0.5, {1.0: 0.0, float("inf"): 0.0}) is None
    assert quantile(0.5, {}) is None


def test_feed_turns_counters_into_points():
    metrics, engine, clock = Metrics("m"), Engine(), [1000.0]
    feed = DashboardFeed(metrics.registry, lambda: {"model": "m"}, clock=lambda: clock[0],
                         monotonic=lambda: clock[0])
    metrics.on_step(engine, [], 0.0)
    first = feed.sample()
    assert first["generation_tps"] == 0 and first["ttft_p50"] is None and first["kv_waste"] is None
    for second in range(1, 11):  # 50 tokens out and 20 in a second; a request a second
        clock[0] += 1
        engine.s.update(generation_tokens=50 * second, prompt_tokens=20 * second,
                        num_requests_running=3, kv_cache_usage_perc=0.25,
                        kv_slot_steps=100 * second, kv_waste_slot_steps=5 * second,
                        prefix_cache_queries=40 * second, prefix_cache_hits=10 * second,
                        num_preemptions=second // 5)
        metrics.on_step(engine, [], 0.0)
        metrics.on_finished(finished(ttft=0.2 if second % 2 else 0.6))
        p = feed.sample()
    assert p["t"] == 1010.0 and p["running"] == 3 and p["kv_usage"] == 0.25
    assert p["generation_tps"] == pytest.approx(50) and p["prompt_tps"] == pytest.approx(20)
    assert p["kv_waste"] == pytest.approx(0.05) and p["prefix_hit_rate"] == pytest.approx(0.25)
    assert p["preemptions_per_min"] == pytest.approx(60 * 1 / 5)
    # half the TTFTs were 0.2 s and half 0.6 s: the median bucket holds 0.25, p99 holds 0.75
    assert 0.1 < p["ttft_p50"] <= 0.25 and 0.5 < p["ttft_p99"] <= 0.75
    assert p["itl_p50"] is None  # no stream output was seen
    # the page asks for what it has not seen
    assert [q["t"] for q in feed.data(1008.0)["points"]] == [1009.0, 1010.0]
    assert len(feed.data(None)["points"]) == 11 and feed.data(None)["info"] == {"model": "m"}
    # at most ten minutes of points, and the raw snapshots only as far back as the windows
    for _ in range(dashboard.KEEP + 5):
        clock[0] += 1
        feed.sample()
    assert len(feed.points) == dashboard.KEEP
    assert len(feed._raw) <= dashboard.LATENCY_WINDOW + 2


def test_spec_and_lora_points_appear_only_when_enabled():
    metrics, engine = Metrics("m"), Engine(speculative=True, lora=True)
    clock = [0.0]
    feed = DashboardFeed(metrics.registry, dict, clock=lambda: clock[0], monotonic=lambda: clock[0])
    metrics.on_step(engine, [], 0.0)
    feed.sample()
    clock[0] += 1
    engine.s.update(spec_decode_num_drafts=10, spec_decode_num_draft_tokens=20,
                    spec_decode_num_accepted_tokens=15)
    metrics.on_step(engine, [], 0.0)
    p = feed.sample()
    assert p["spec_acceptance"] == pytest.approx(0.75) and p["lora_running"] == {"ad0": 1}
    plain = DashboardFeed(Metrics("m").registry, dict).sample()
    assert "spec_acceptance" not in plain and "lora_running" not in plain


def test_grafana_queries_only_metrics_the_server_exposes():
    metrics = Metrics("m")
    metrics.on_step(Engine(speculative=True, lora=True), [], 0.0)
    metrics.on_finished(finished(0.1))
    metrics.on_stream_output("m", 0.01, 1)
    metrics.on_rejected("m")
    metrics.on_trimmed("m", 10)
    exposed = set()
    for line in generate_latest(metrics.registry).decode().splitlines():
        if not line.startswith("#"):
            exposed.add(re.match(r"[^{ ]+", line).group(0))
    board = json.loads((REPO / "docs/grafana/jaxllm.json").read_text())
    assert len(board["panels"]) >= 12
    used = set()
    for panel in board["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = re.findall(r"jaxllm:[a-z0-9_]+", target["expr"])
            assert names, target["expr"]
            used.update(names)
    assert used <= exposed, used - exposed
    for key in ("num_requests_running", "kv_cache_usage_perc", "prefix_cache_hits_total",
                "generation_tokens_total", "time_to_first_token_seconds_bucket",
                "inter_token_latency_seconds_bucket", "num_preemptions_total",
                "spec_decode_num_accepted_tokens_total", "lora_num_requests_running"):
        assert f"jaxllm:{key}" in used


def test_disable_web_ui_serves_no_pages():
    """--disable-web-ui: no pages, no feed, no sampling; the API routes are untouched. (The
    app is built without starting its engine: nothing here needs a model.)"""
    from starlette.testclient import TestClient

    from jaxllm.config import EngineConfig
    from serve.app import OpenAIServer, ServerConfig

    on = OpenAIServer(EngineConfig(model="unused"), ServerConfig("m"))
    off = OpenAIServer(EngineConfig(model="unused"), ServerConfig("m", web_ui=False))
    with_pages, without = TestClient(on.app()), TestClient(off.app())
    for path in ("/", "/dashboard", "/dashboard/data", "/web/chat.js"):
        assert with_pages.get(path).status_code == 200, path
        r = without.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
    assert off.dashboard is None
    assert with_pages.get("/").headers["content-security-policy"].startswith("default-src 'self'")
    assert without.get("/version").status_code == 200


def test_a_clock_step_or_a_failing_sample_does_not_break_the_feed(monkeypatch, caplog):
    import asyncio
    metrics, engine = Metrics("m"), Engine()
    wall, mono = [5000.0], [0.0]
    feed = DashboardFeed(metrics.registry, dict, clock=lambda: wall[0], monotonic=lambda: mono[0])
    metrics.on_step(engine, [], 0.0)
    first = feed.sample()
    mono[0] += 1
    wall[0] -= 3600  # the wall clock is stepped back an hour
    engine.s["generation_tokens"] = 40
    metrics.on_step(engine, [], 0.0)
    p = feed.sample()
    assert p["generation_tps"] == pytest.approx(40) and p["t"] > first["t"]
    # run() logs a sample that raises and goes on sampling
    monkeypatch.setattr(dashboard, "INTERVAL", 0.01)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a collector broke")
    feed.sample = flaky

    async def go():
        task = asyncio.create_task(feed.run())
        while len(calls) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
    asyncio.run(go())
    assert "could not sample" in caplog.text
