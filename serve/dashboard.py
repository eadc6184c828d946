"""The live dashboard's feed: once a second the server's Prometheus registry (the counters
`/metrics` serves, so there is no second bookkeeping) is read and turned into one point of the
charts: gauges as they are, counters as rates and histograms as percentiles over a short
window; with data-parallel replicas, their totals and each replica's own gauges. The last minutes of points are kept for `GET /dashboard/data`; the page asks for the
points after the last one it has."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque

logger = logging.getLogger("jaxllm")

INTERVAL = 1.0        # seconds between points
KEEP = 600            # points kept: the last ten minutes
RATE_WINDOW = 5.0     # seconds over which counters become rates
LATENCY_WINDOW = 30.0  # seconds over which histograms become percentiles


def read(registry) -> dict:
    """The registry's samples summed over their labels (every model and adapter), except
    histogram buckets, kept as {upper bound: cumulative count}; and adapters' gauges by name."""
    values: dict = {}
    for family in registry.collect():
        for s in family.samples:
            name = s.name.removeprefix("jaxllm:")
            if name.endswith("_bucket"):
                buckets = values.setdefault(name, {})
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
            elif name.endswith("_created"):
                continue
            elif name == "lora_num_requests_running":
                values.setdefault("lora_running", {})[s.labels["lora_name"]] = s.value
            elif name == "lora_requests_info":
                values["max_lora"] = float(s.labels["max_lora"])
            elif name.startswith("replica_") and "replica" in s.labels:
                per = values.setdefault("replicas", {}).setdefault(s.labels["replica"], {})
                per[name] = per.get(name, 0.0) + s.value
            else:
                values[name] = values.get(name, 0.0) + s.value
    return values


def quantile(q: float, buckets: dict) -> float | None:
    """Prometheus' histogram_quantile: the q-quantile of cumulative `buckets`, interpolated
    linearly within its bucket; None without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank and count > below:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def _delta(now: dict, then: dict, name: str) -> float:
    return now.get(name, 0.0) - then.get(name, 0.0)


def _window(now: dict, then: dict, name: str) -> dict:
    a, b = now.get(name, {}), then.get(name, {})
    return {le: a[le] - b.get(le, 0.0) for le in a}


def point(t: float, now: dict, rate_then: tuple[float, dict], lat_then: tuple[float, dict]) -> dict:
    """One chart point at time t from the registry now and at the start of each window."""
    t_rate, r = rate_then
    t_lat, lat = lat_then
    dt = max(t - t_rate, 1e-9)
    p = {"t": round(t, 3),
         "running": now.get("num_requests_running", 0.0),
         "waiting": now.get("num_requests_waiting", 0.0),
         "kv_usage": now.get("kv_cache_usage_perc", 0.0),
         "prompt_tps": _delta(now, r, "prompt_tokens_total") / dt,
         "generation_tps": _delta(now, r, "generation_tokens_total") / dt,
         "preemptions_per_min": 60 * _delta(now, r, "num_preemptions_total") / dt,
         "failed_requests": now.get("num_failed_requests_total", 0.0)}
    held = _delta(now, r, "kv_slots_allocated_steps_total")
    p["kv_waste"] = _delta(now, r, "kv_slots_wasted_steps_total") / held if held > 0 else None
    queries = _delta(now, r, "prefix_cache_queries_total")
    p["prefix_hit_rate"] = _delta(now, r, "prefix_cache_hits_total") / queries if queries > 0 else None
    for key, hist in (("ttft", "time_to_first_token_seconds_bucket"),
                      ("itl", "inter_token_latency_seconds_bucket")):
        window = _window(now, lat, hist)
        for q in (0.5, 0.9, 0.99):
            p[f"{key}_p{round(q * 100)}"] = quantile(q, window)
    if "spec_decode_num_draft_tokens_total" in now:
        drafted = _delta(now, r, "spec_decode_num_draft_tokens_total")
        p["spec_acceptance"] = (_delta(now, r, "spec_decode_num_accepted_tokens_total") / drafted
                                if drafted > 0 else None)
    if "lora_running" in now:
        p["lora_running"] = dict(now["lora_running"])
    for i, r in now.get("replicas", {}).items():  # data-parallel replicas, each on its own
        p[f"replica{i}_running"] = r.get("replica_num_requests_running", 0.0)
        p[f"replica{i}_kv"] = r.get("replica_kv_cache_usage_perc", 0.0)
        p[f"replica{i}_up"] = r.get("replica_up", 0.0)
    return p


class DashboardFeed:
    """Points over the last minutes, sampled by `run` (a task of the server's event loop)."""

    def __init__(self, registry, info, clock=time.time, monotonic=time.monotonic):
        """info: called for what the page shows once (the model, its adapters, sizes). Points
        carry `clock`'s time; the windows are measured on `monotonic`, which never steps back."""
        self.registry, self.info, self.clock, self.monotonic = registry, info, clock, monotonic
        self.points: deque[dict] = deque(maxlen=KEEP)
        self._raw: deque[tuple[float, dict]] = deque()  # (time, registry) over the longest window

    def sample(self) -> dict:
        m, now = self.monotonic(), read(self.registry)
        self._raw.append((m, now))
        while len(self._raw) > 1 and m - self._raw[1][0] >= LATENCY_WINDOW:
            self._raw.popleft()
        rate_then = next(((ts, v) for ts, v in self._raw if m - ts <= RATE_WINDOW), self._raw[0])
        if rate_then[0] == m and len(self._raw) > 1:
            rate_then = self._raw[-2]
        p = point(m, now, rate_then, self._raw[0])
        p["t"] = round(self.clock(), 3)
        if self.points and p["t"] <= self.points[-1]["t"]:  # the wall clock stepped back
            p["t"] = self.points[-1]["t"] + 0.001
        self.points.append(p)
        return p

    def data(self, since: float | None) -> dict:
        """The points after `since` (all kept ones when None), and what the page shows once."""
        points = [p for p in self.points if since is None or p["t"] > since]
        return {"info": self.info(), "interval": INTERVAL, "window_seconds": KEEP * INTERVAL,
                "points": points}

    async def run(self):
        while True:
            try:
                self.sample()
            except Exception:  # a bad sample is skipped; the feed goes on
                logger.exception("the dashboard could not sample the metrics")
            await asyncio.sleep(INTERVAL)
