"""Prometheus metrics named like vLLM's, with a `jaxllm:` prefix, and the periodic log line."""
from __future__ import annotations

import logging
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

logger = logging.getLogger("jaxllm")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name

        def gauge(name, doc):
            return Gauge(f"jaxllm:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"jaxllm:{name}", doc, labels, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.")
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Generation tokens processed.")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prefix_queries = counter("prefix_cache_queries", "Prefix-cache queries, in tokens.")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix-cache hits, in tokens.")
        self.kv_slot_steps = counter("kv_slots_allocated_steps", "KV slots held by running requests, summed over steps.")
        self.kv_waste_steps = counter("kv_slots_wasted_steps", "Held KV slots holding no token, summed over steps.")
        self.peak_running = gauge("peak_num_requests_running", "Most requests running at once so far.")
        self.kv_total_slots = gauge("kv_cache_total_slots", "KV-cache capacity in tokens.")
        self.max_model_len = gauge("max_model_len", "Longest prompt plus output.")
        self._success = Counter("jaxllm:request_success", "Successfully processed requests.",
                                ["model_name", "finished_reason"], registry=r)
        # per request, labelled with the model it asked for: the base model or a LoRA adapter
        # (a tenant), so that a latency spike can be traced to one of them
        self.failed_steps = counter("num_failed_steps", "Steps that raised (their requests failed).")
        self.failed_requests = counter("num_failed_requests", "Requests failed by a failed step "
                                       "or by non-finite logits.")

        def per_model(kind, name, doc, **kw):
            return kind(f"jaxllm:{name}", doc, labels, registry=r, **kw)

        self._request = {
            "ttft": per_model(Histogram, "time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS),
            "tpot": per_model(Histogram, "time_per_output_token_seconds",
                              "Mean time per output token of a request.", buckets=_TPOT_BUCKETS),
            "itl": per_model(Histogram, "inter_token_latency_seconds",
                             "Time between a stream's successive outputs, per token.",
                             buckets=_TPOT_BUCKETS),
            "e2e": per_model(Histogram, "e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=_LATENCY_BUCKETS),
            "queue": per_model(Histogram, "request_queue_time_seconds",
                               "Time spent waiting in the queue.", buckets=_LATENCY_BUCKETS),
            "prefill": per_model(Histogram, "request_prefill_time_seconds",
                                 "Time from first scheduled to first token.", buckets=_LATENCY_BUCKETS),
            "decode": per_model(Histogram, "request_decode_time_seconds",
                                "Time from first token to the last.", buckets=_LATENCY_BUCKETS),
            "cache_queries": per_model(Counter, "request_prefix_cache_queries",
                                       "Prompt tokens of finished requests."),
            "cache_hits": per_model(Counter, "request_prefix_cache_hits",
                                    "Prompt tokens of finished requests found in the prefix cache."),
            "rejected": per_model(Counter, "request_admission_rejections",
                                  "Requests refused with a 429 (the waiting queue was full)."),
            "trimmed": per_model(Counter, "request_prompts_trimmed",
                                 "Chats whose oldest turns were dropped to fit their budget."),
            "trimmed_tokens": per_model(Counter, "request_prompt_tokens_trimmed",
                                        "Prompt tokens those drops saved."),
        }
        self._children: dict[tuple[str, str], object] = {}
        self._lora = None  # created when the engine reports adapters (enable_lora)
        self._lora_labels = None
        self._lora_names: set[str] = set()  # adapters that had requests (their gauges go to 0)
        self._last = {}
        self._spec = None  # speculative decoding counters, made once the engine is known
        self._stats: dict | None = None  # the engine's counters after its last step
        self._kv_transfer = None  # KV transfer counters, made when replicas report them
        self._replicas = None  # per-replica series, made when replicas first report
        self._replica_states: list[dict] | None = None
        self._window_routed: dict[int, int] = {}
        self._window_hits: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()
        # for the periodic log line
        self._window_prompt = 0
        self._window_gen = 0
        self._window_start = time.monotonic()

    def on_step(self, engine, outputs, elapsed: float) -> None:
        """Called by the engine thread after every step."""
        spec = engine.config.speculative_config
        self.observe_stats(engine.stats(), engine.config.max_model_len,
                           spec.num_speculative_tokens if spec is not None else 0)

    def observe_stats(self, s: dict, max_model_len: int, speculative_tokens: int = 0) -> None:
        """The engine's counters (summed over the replicas when it has several)."""
        self._stats = s
        self.running.set(s["num_requests_running"])
        self.waiting.set(s["num_requests_waiting"])
        self.kv_usage.set(s["kv_cache_usage_perc"])
        if "lora_running" in s:
            self._lora_metrics(s)
        with self._lock:
            self.peak_running.set(s["peak_running"])
            self.kv_total_slots.set(s["kv_total_slots"])
            self.max_model_len.set(max_model_len)
            for key, metric in (("num_preemptions", self.preemptions),
                                ("kv_slot_steps", self.kv_slot_steps),
                                ("kv_waste_slot_steps", self.kv_waste_steps),
                                ("prefix_cache_queries", self.prefix_queries),
                                ("prefix_cache_hits", self.prefix_hits),
                                ("prompt_tokens", self.prompt_tokens),
                                ("generation_tokens", self.generation_tokens),
                                ("num_failed_steps", self.failed_steps),
                                ("num_failed_requests", self.failed_requests)):
                delta = s[key] - self._last.get(key, 0)
                if delta > 0:
                    metric.inc(delta)
                self._last[key] = s[key]
                if key == "prompt_tokens":
                    self._window_prompt += delta
                elif key == "generation_tokens":
                    self._window_gen += delta
            if speculative_tokens:
                self._observe_spec(s, speculative_tokens)
            if "kv_transfer_received_bytes" in s:
                self._observe_kv_transfer(s)

    # data-parallel replicas (jaxllm.distributed): made on the first report of them
    def _replica_metrics(self):
        if self._replicas is None:
            r, labels = self.registry, ["model_name", "replica"]
            self._replicas = {
                "up": Gauge("jaxllm:replica_up", "1 while the replica serves, 0 while it is "
                            "restarting or dead.", labels, registry=r),
                "restarts": Gauge("jaxllm:replica_restarts", "Times Ray restarted the replica.",
                                  labels, registry=r),
                "running": Gauge("jaxllm:replica_num_requests_running",
                                 "Requests in the replica's running batch.", labels, registry=r),
                "waiting": Gauge("jaxllm:replica_num_requests_waiting",
                                 "Requests waiting in the replica.", labels, registry=r),
                "kv": Gauge("jaxllm:replica_kv_cache_usage_perc",
                            "The replica's KV-cache usage; 1 means 100 percent.", labels, registry=r),
                "queued": Gauge("jaxllm:router_pending_prefill_tokens", "Prompt tokens the "
                                "router sent to the replica that have no first token yet: its "
                                "queue of prefills, as routing weighs it.", labels, registry=r),
                "routed": Counter("jaxllm:router_requests", "Requests the router sent to the "
                                  "replica, by why it was chosen: prefix (the longest cached "
                                  "prefix), balance (a longer prefix sat on a busier replica), "
                                  "least_loaded (cached nowhere, or too little of the "
                                  "prompt), round_robin.",
                                  [*labels, "reason"], registry=r),
                "expected": Counter("jaxllm:router_expected_cached_tokens", "Prompt tokens the "
                                    "router expected the replica to hold in its prefix cache.",
                                    labels, registry=r),
                "queries": Counter("jaxllm:router_prompt_tokens", "Prompt tokens of finished "
                                   "requests, per replica.", labels, registry=r),
                "hits": Counter("jaxllm:router_cached_tokens", "Of those, the tokens the "
                                "replica found in its prefix cache (the hit rate is their ratio).",
                                labels, registry=r),
                "failed": Counter("jaxllm:replica_failed_requests", "Requests whose replica died "
                                  "under them, by what became of them: resent (nothing streamed "
                                  "yet) or failed.", [*labels, "outcome"], registry=r),
            }
        return self._replicas

    def observe_replicas(self, states: list[dict]) -> None:
        m = self._replica_metrics()
        self._replica_states = states
        for s in states:
            i = str(s["replica"])
            m["up"].labels(self.model_name, i).set(1 if s["state"] == "up" else 0)
            m["restarts"].labels(self.model_name, i).set(s["restarts"])
            m["running"].labels(self.model_name, i).set(s["num_requests_running"])
            m["waiting"].labels(self.model_name, i).set(s["num_requests_waiting"])
            m["kv"].labels(self.model_name, i).set(s["kv_cache_usage_perc"])
            m["queued"].labels(self.model_name, i).set(s.get("pending_prefill_tokens", 0))

    def routed(self, decision) -> None:
        m, i = self._replica_metrics(), str(decision.replica)
        m["routed"].labels(self.model_name, i, decision.reason).inc()
        with self._lock:
            self._window_routed[decision.replica] = self._window_routed.get(decision.replica, 0) + 1

    def route_finished(self, decision, prompt_tokens: int, cached_tokens: int) -> None:
        m, i = self._replica_metrics(), str(decision.replica)
        m["expected"].labels(self.model_name, i).inc(min(decision.cached_tokens, prompt_tokens))
        m["queries"].labels(self.model_name, i).inc(prompt_tokens)
        m["hits"].labels(self.model_name, i).inc(cached_tokens)
        with self._lock:
            q, h = self._window_hits.get(decision.replica, (0, 0))
            self._window_hits[decision.replica] = (q + prompt_tokens, h + cached_tokens)

    def replica_failed(self, replica: int, resent: bool) -> None:
        self._replica_metrics()["failed"].labels(self.model_name, str(replica),
                                                 "resent" if resent else "failed").inc()

    def _observe_kv_transfer(self, s: dict) -> None:
        """Disaggregated prefill/decode: KV blocks moved from prefill to decode replicas."""
        if self._kv_transfer is None:
            r, name = self.registry, self.model_name
            self._kv_transfer = {key: Counter(f"jaxllm:{key}", doc, ["model_name"], registry=r).labels(name)
                                 for key, doc in (
                ("kv_transfer_received_blocks", "KV blocks decode replicas fetched from prefill replicas."),
                ("kv_transfer_received_bytes", "Bytes of those blocks."),
                ("kv_transfer_receive_seconds", "Time decode replicas spent fetching them, once "
                 "their prefill was done (bytes over this: the transport's rate)."),
                ("kv_transfer_import_seconds", "Time decode replicas spent writing them into "
                 "their caches."),
                ("kv_transfer_imported_blocks", "Of the fetched blocks, those written into a "
                 "decode replica's cache (the others were cached there already)."),
                ("kv_transfer_failures", "Transfers that failed (the decode replica computed "
                 "the prompt instead)."))}
        for key, metric in self._kv_transfer.items():
            delta = s[key] - self._last.get(key, 0)
            if delta > 0:
                metric.inc(delta)
            self._last[key] = s[key]

    def _observe_spec(self, s: dict, k: int) -> None:
        """vLLM's spec_decode counters: verifications (drafts), proposed and accepted tokens,
        accepted tokens by proposal position."""
        if self._spec is None:
            r, name = self.registry, self.model_name
            counters = {key: Counter(f"jaxllm:{key}", doc, ["model_name"], registry=r).labels(name)
                        for key, doc in (
                            ("spec_decode_num_drafts", "Number of spec decoding drafts."),
                            ("spec_decode_num_draft_tokens", "Number of draft tokens."),
                            ("spec_decode_num_accepted_tokens", "Number of accepted tokens."))}
            per_pos = Counter("jaxllm:spec_decode_num_accepted_tokens_per_pos",
                              "Accepted tokens per draft position.", ["model_name", "position"],
                              registry=r)
            self._spec = counters, [per_pos.labels(name, str(i)) for i in range(k)]
        counters, per_pos = self._spec
        for key, metric in counters.items():
            delta = s[key] - self._last.get(key, 0)
            if delta > 0:
                metric.inc(delta)
            self._last[key] = s[key]
        last = self._last.get("per_pos", [0] * k)
        for i, (metric, v) in enumerate(zip(per_pos, s["spec_decode_num_accepted_tokens_per_pos"])):
            if v > last[i]:
                metric.inc(v - last[i])
        self._last["per_pos"] = list(s["spec_decode_num_accepted_tokens_per_pos"])

    def _lora_metrics(self, s: dict) -> None:
        """vLLM's lora_requests_info (which adapters have running and waiting requests, as
        labels of one series set to the time) and requests per adapter."""
        if self._lora is None:
            r = self.registry
            self._lora = (
                Gauge("jaxllm:lora_requests_info", "Running stats on LoRA requests.",
                      ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r),
                Gauge("jaxllm:lora_num_requests_running", "Running requests per LoRA adapter.",
                      ["model_name", "lora_name"], registry=r),
                Gauge("jaxllm:lora_num_requests_waiting", "Waiting requests per LoRA adapter.",
                      ["model_name", "lora_name"], registry=r))
        info, running, waiting = self._lora
        labels = (str(s["max_lora"]), ",".join(sorted(s["lora_waiting"])),
                  ",".join(sorted(s["lora_running"])))
        if labels != self._lora_labels:
            if self._lora_labels is not None:
                info.remove(*self._lora_labels)
            self._lora_labels = labels
        info.labels(*labels).set_to_current_time()
        self._lora_names.update(s["lora_running"], s["lora_waiting"])
        for gauge, counts in ((running, s["lora_running"]), (waiting, s["lora_waiting"])):
            for name in self._lora_names:
                gauge.labels(self.model_name, name).set(counts.get(name, 0))

    @property
    def speculative(self) -> bool:
        """Speculative decoding's counters exist (the engine drafts)."""
        return self._spec is not None

    def last_stats(self) -> dict | None:
        """The engine's counters after its last step (None before the first)."""
        return self._stats

    def request(self, key: str, model: str):
        """The `key` metric's series for `model` (the base model's name or an adapter's)."""
        child = self._children.get((key, model))
        if child is None:
            child = self._children[key, model] = self._request[key].labels(model)
        return child

    def on_finished(self, out, model: str | None = None) -> None:
        """Per-request latencies and cache hits, once a request is done (`model`: what it
        asked for; the base model by default)."""
        model = model or self.model_name
        m = out.metrics
        for c in out.outputs:
            if c.finish_reason is not None and c.finish_reason != "abort":
                self._success.labels(model, c.finish_reason).inc()
        first, scheduled, done = m.first_token_time, m.first_scheduled_time, m.finished_time
        if first is not None:
            self.request("ttft", model).observe(first - m.arrival_time)
        if scheduled is not None:
            self.request("queue", model).observe(scheduled - m.arrival_time)
            if first is not None:
                self.request("prefill", model).observe(first - scheduled)
        if done is not None:
            self.request("e2e", model).observe(done - m.arrival_time)
            if first is not None:
                self.request("decode", model).observe(done - first)
            n = max((len(c.token_ids) for c in out.outputs), default=0)
            if n > 1 and first is not None:
                self.request("tpot", model).observe((done - first) / (n - 1))
        self.request("cache_queries", model).inc(len(out.prompt_token_ids))
        self.request("cache_hits", model).inc(max(out.num_cached_tokens, 0))

    def on_stream_output(self, model: str, seconds: float, num_tokens: int) -> None:
        """A stream's output arrived `seconds` after its previous one, with `num_tokens`."""
        if num_tokens > 0:
            self.request("itl", model).observe(seconds / num_tokens)

    def on_rejected(self, model: str) -> None:
        self.request("rejected", model).inc()

    def on_trimmed(self, model: str, num_tokens: int) -> None:
        self.request("trimmed", model).inc()
        self.request("trimmed_tokens", model).inc(num_tokens)

    def log_line(self) -> str | None:
        with self._lock:
            now = time.monotonic()
            secs = max(now - self._window_start, 1e-9)
            prompt_tps, gen_tps = self._window_prompt / secs, self._window_gen / secs
            self._window_prompt = self._window_gen = 0
            self._window_start = now
        s = self._stats
        if s is None:
            return None
        line = (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: "
                f"{gen_tps:.1f} tokens/s, Running: {s['num_requests_running']} reqs, Waiting: "
                f"{s['num_requests_waiting']} reqs, KV cache usage: {100 * s['kv_cache_usage_perc']:.1f}%")
        if self._spec is not None and s["spec_decode_num_drafts"]:
            drafts, accepted = s["spec_decode_num_drafts"], s["spec_decode_num_accepted_tokens"]
            line += (f"; SpecDecoding: mean acceptance length {1 + accepted / drafts:.2f}, "
                     f"draft acceptance rate {100 * accepted / max(s['spec_decode_num_draft_tokens'], 1):.1f}%")
        if self._replica_states is not None:
            with self._lock:
                routed, hits = self._window_routed, self._window_hits
                self._window_routed, self._window_hits = {}, {}
            parts = []
            for r in self._replica_states:
                i = r["replica"]
                q, h = hits.get(i, (0, 0))
                parts.append(f"{i} {r['state']} (routed {routed.get(i, 0)}, prefix hits "
                             + (f"{100 * h / q:.0f}%" if q else "-") + ")")
            line += "; Replicas: " + ", ".join(parts)
        logger.info(line)
        return line
