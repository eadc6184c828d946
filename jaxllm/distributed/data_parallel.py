"""Data-parallel replicas behind the server: DataParallelEngine, AsyncEngine's surface over
N engines on Ray (replica_set.py places them).

The front end keeps what does not need the model: the tokenizer, input validation, grammar
checks and the Router, which picks a replica per request by the prompt's cached prefix and
the replicas' load. Each request is streamed from its replica as Ray streaming-generator
outputs. A replica that dies ends its requests with RequestLostError, except those that had
not streamed anything yet, which are sent to another replica; a watcher per replica polls
its counters (for /metrics and the router's load picture), sees it go and come back, and
re-registers runtime LoRA adapters on the new life. With prefill replicas
(kv_transfer_config), a prefill runs first and the decode replica fetches its KV blocks.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator

from jaxllm.config import EngineConfig
from jaxllm.distributed.replica_set import (ReplicaSet, ReplicaState, Totals, front_parts,
                                            prefill_request, ray_errors, router_key)
from jaxllm.distributed.router import Decision, Router
from jaxllm.engine.async_engine import (TOKENIZER_THREADS, EngineDeadError, EngineFront,
                                        RequestLostError, describe_error)
from jaxllm.engine.input_processor import EngineRequest
from jaxllm.engine.outputs import RequestOutput

logger = logging.getLogger("jaxllm")

POLL_SECONDS = 0.25     # how often each replica's counters are read
DEAD_AFTER = 3          # consecutive "actor died" answers before a replica counts as gone


@dataclass
class _Running:
    decision: Decision
    stream: object          # the Ray ObjectRefGenerator
    prefill: object = None  # a prefill's summary ObjectRef (cancelling it stops the prefill)
    cancelled: bool = False


class DataParallelEngine(EngineFront):
    """The server's engine when it has replicas: AsyncEngine's surface.

    hooks: what observes the replicas (serve.metrics.Metrics): observe_stats(total,
    max_model_len, speculative_tokens), observe_replicas(states), routed(decision),
    route_finished(decision, prompt_tokens, cached_tokens), replica_failed(index, resent)."""

    def __init__(self, config: EngineConfig, hooks=None, on_fail=None, lora_modules=(),
                 model_names=()):
        self.config = config
        self.hooks = hooks
        self._on_fail = on_fail
        self.set = ReplicaSet(config, lora_modules, model_names)
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.router: Router | None = None
        self.info: dict | None = None
        self.tokenizer = self.inputs = self.structured = None  # once replica 0 is up
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="jaxllm-tokenize")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: dict[str, _Running] = {}
        self._watchers: list[asyncio.Task] = []
        self._runtime_loras: dict[int, object] = {}   # added after start: re-added on restarts
        self._attempts = 0  # prefills sent (their request ids stay unique across resends)
        self._totals = Totals(config.data_parallel_size)
        self._thread = threading.Thread(target=self._boot, name="jaxllm-replicas", daemon=True)
        self._stopping = False

    # lifecycle
    def start(self) -> None:
        """Connect to Ray here, on the server's main thread (Ray's processes live as long as
        the thread that starts them), then place and wait for the replicas on a thread."""
        self._loop = asyncio.get_running_loop()
        try:
            self.set.connect()
        except BaseException as e:
            logger.error("could not start Ray: %s", describe_error(e))
            self._fail(e)
            return
        self._thread.start()

    def _boot(self) -> None:
        try:
            infos = self.set.start()
            info = infos[0]
            self.info = info
            self.tokenizer, self.inputs, self.structured = front_parts(self.config, info)
            self.router = Router(self.set.size, info["block_size"],
                                 min(i["num_blocks"] for i in infos), self.config.routing_policy,
                                 cache_threshold=self.config.routing_cache_threshold)
        except BaseException as e:
            if not isinstance(e, ValueError):
                logger.warning("replica start-up raised", exc_info=True)
            logger.error("the replicas failed to start: %s", describe_error(e))
            self._fail(e)
            return
        if not self._stopping:
            self._loop.call_soon_threadsafe(self._watch_all)
            self.ready.set()
            if self.tokenizer is not None:
                self.structured.warm()

    def _watch_all(self) -> None:
        self._watchers = [asyncio.ensure_future(self._watch(r)) for r in self.set.replicas]

    def _fail(self, error: BaseException) -> None:
        self.error = error
        if self._on_fail is not None:
            self._on_fail(error)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        for t in self._watchers:
            t.cancel()
        self.set.shutdown()  # (a start-up still waiting on the replicas then gives up)
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and self.error is None

    @property
    def engine(self):
        raise RuntimeError("a data-parallel engine has no local LLMEngine: its replicas run "
                           "on Ray")

    @property
    def max_model_len(self) -> int:
        return self.info["max_model_len"]

    @property
    def vocab_size(self) -> int:
        return self.info["vocab_size"]

    @property
    def eos_token_id(self) -> int | None:
        return self.info["eos_token_id"]

    # the replicas' health
    async def _watch(self, r: ReplicaState) -> None:
        rx = ray_errors()
        while not self._stopping:
            try:
                stats = await r.handle.stats.remote()
                r.died_answers = 0
                if not stats["alive"]:  # its engine failed: the process is on its way out
                    self._replica_down(r, "restarting", EngineDeadError("its engine failed"))
                elif stats["incarnation"] != r.incarnation:
                    await self._replica_back(r)
                elif r.state != "up":  # a slow answer taken for a death: it was not
                    await self._readd_loras(r)
                    r.state = "up"
                    self.router.set_alive(r.index, True)
                if stats["alive"]:
                    r.stats = stats
                    self._totals.update(r.index, stats, r.index in self.set.prefill_ids)
                    self.router.set_kv_usage(r.index, stats.get("kv_cache_usage_perc", 0.0))
                    self._publish()
            except asyncio.CancelledError:
                raise
            except rx.ActorDiedError as e:
                r.died_answers += 1
                self._replica_down(r, "dead" if r.died_answers >= DEAD_AFTER else "restarting", e)
                if all(x.state == "dead" for x in self.set.replicas) and self.error is None:
                    self._fail(EngineDeadError("every replica is dead (restarts exhausted)"))
                    return
            except rx.RayActorError as e:  # unreachable or restarting
                self._replica_down(r, "restarting", e)
            except Exception:  # one bad answer or hook: the watch goes on
                logger.exception("watching replica %d", r.index)
            await asyncio.sleep(POLL_SECONDS)

    def _replica_down(self, r: ReplicaState, state: str, error) -> None:
        if self._stopping:
            return
        if r.state != state:
            logger.error("replica %d is %s: %s", r.index, state, describe_error(error))
        r.state = state
        self.router.set_alive(r.index, False)
        self._publish()

    async def _readd_loras(self, r: ReplicaState) -> None:
        for lora in list(self._runtime_loras.values()):
            await r.handle.add_lora.remote(lora)

    async def _replica_back(self, r: ReplicaState) -> None:
        info = await r.handle.info.remote()
        await self._readd_loras(r)
        r.info, r.incarnation = info, info["incarnation"]
        r.restarts += 1
        r.state = "up"
        self.router.set_alive(r.index, False)  # a new life: the router forgets the old cache
        self.router.set_alive(r.index, True)
        logger.warning("replica %d is back (restart %d, pid %d)", r.index, r.restarts, info["pid"])

    def _publish(self) -> None:
        if self.hooks is None or self._stopping:
            return
        up = [r.state == "up" for r in self.set.replicas]
        self.hooks.observe_stats(self._totals.total(up), self.max_model_len,
                                 self.info["speculative_tokens"])
        self.hooks.observe_replicas(self.replica_states())

    def replica_states(self) -> list[dict]:
        routed = self.router.stats() if self.router is not None else [{}] * self.set.size
        return [{"replica": r.index, "role": self.set.role(r.index), "state": r.state,
                 "restarts": r.restarts,
                 "pid": (r.info or {}).get("pid"), "node": (r.info or {}).get("node"),
                 "num_requests_running": r.stats.get("num_requests_running", 0),
                 "num_requests_waiting": r.stats.get("num_requests_waiting", 0),
                 "kv_cache_usage_perc": r.stats.get("kv_cache_usage_perc", 0.0),
                 "in_flight": routed[r.index].get("in_flight", 0),
                 "pending_prefill_tokens": routed[r.index].get("pending_prefill_tokens", 0)}
                for r in self.set.replicas]

    def health(self) -> dict:
        """ok (every replica up), degraded (some up), unavailable (none up yet: restarting),
        error (the replicas cannot run)."""
        if self.error is not None:
            return {"status": "error", "error": str(self.error)}
        if not self.ready.is_set():  # as one engine loading: alive, not ready (/health/ready)
            return {"status": "starting"}
        states = self.replica_states()
        up = sum(s["state"] == "up" for s in states)
        status = "ok" if up == len(states) else "degraded" if up else "unavailable"
        return {"status": status, "replicas": [
            {k: s[k] for k in ("replica", "role", "state", "restarts", "pid", "node")}
            for s in states]}

    # LoRA adapters at run time: every replica gets them
    async def add_lora(self, lora_request) -> None:
        # recorded first: a replica that comes back meanwhile gets it too
        self._runtime_loras[lora_request.lora_int_id] = lora_request
        try:
            await asyncio.gather(*(self.set.handle(i).add_lora.remote(lora_request)
                                   for i in self.set.live()))
        except BaseException:
            self._runtime_loras.pop(lora_request.lora_int_id, None)
            raise

    async def remove_lora(self, lora_int_id: int) -> bool:
        self._runtime_loras.pop(lora_int_id, None)
        done = await asyncio.gather(*(self.set.handle(i).remove_lora.remote(lora_int_id)
                                      for i in self.set.live()))
        return any(done)

    # requests
    def submit(self, request_id: str, request: EngineRequest,
               priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Route and send now; iterate for the outputs (closing early aborts the request)."""
        if self.error is not None:
            raise EngineDeadError(str(self.error))
        if request_id in self._running:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._launch(request_id, request, priority, exclude=())
        return self._outputs(request_id, request, priority)

    def _launch(self, request_id: str, request: EngineRequest, priority: int,
                exclude: tuple) -> _Running:
        """Route and send; with prefill replicas, a prefill first, whose KV blocks the
        decode replica fetches from the object store before it runs the request."""
        prefill, decode = self.set.prefill_ids, self.set.decode_ids
        if not any(i not in exclude and i not in prefill for i in self.set.live()):
            raise EngineDeadError("no replica is up to run the request (restarting)")
        kv, prefilling = None, None
        ids, key = request.prompt_token_ids, router_key(request)
        decision = self.router.route(ids, key, exclude=(*exclude, *prefill))
        target = self.set.handle(decision.replica)
        if (prefill and len(ids) > self.router.block_size and request.params.prompt_logprobs is None
                and any(i in prefill for i in self.set.live())):
            pd = self.router.route(ids, key, exclude=decode)
            self._attempts += 1
            summary, payload = self.set.handle(pd.replica).prefill.options(num_returns=2).remote(
                f"{request_id}#prefill{self._attempts}", prefill_request(request))
            # the decode replica fetches and imports the blocks in a call of its own, so that
            # the object store lets go of them once they are in its cache
            kv = [target.receive.remote(request_id, request, [payload])]
            prefilling = summary
            if self.hooks is not None:
                self.hooks.routed(pd)
            asyncio.ensure_future(self._prefilled(request_id, pd, summary))
        stream = target.generate.options(num_returns="streaming").remote(
            request_id, request, priority, kv)
        run = self._running[request_id] = _Running(decision, stream, prefilling)
        logger.debug("request %s -> replica %d (%s; %d of %d blocks cached)%s", request_id,
                     decision.replica, decision.reason, decision.cached_blocks,
                     decision.prompt_blocks, " after a prefill" if kv else "")
        if self.hooks is not None:
            self.hooks.routed(decision)
        return run

    async def _prefilled(self, request_id: str, decision: Decision, summary_ref) -> None:
        """A prefill's end: its replica's load and cache hits; a failure is the decode
        replica's to handle (it computes the prompt itself)."""
        try:
            summary = await summary_ref
        except Exception as e:
            self.router.finished(decision)
            logger.error("the prefill of request %s on replica %d failed: %s", request_id,
                         decision.replica, describe_error(e))
            return
        cached = summary["num_cached_tokens"]
        self.router.finished(decision, cached)
        if self.hooks is not None:
            self.hooks.route_finished(decision, summary["prompt_tokens"],
                                      cached)

    async def _outputs(self, request_id: str, request: EngineRequest,
                       priority: int) -> AsyncIterator[RequestOutput]:
        rx = ray_errors()
        run = self._running[request_id]
        streamed, finished, tried = False, False, (run.decision.replica,)
        try:
            while True:
                try:
                    async for ref in run.stream:
                        out = await ref
                        if not streamed:  # the prompt is prefilled: out of the replica's queue
                            self.router.first_token(run.decision)
                        streamed = True
                        finished = out.finished
                        if finished:
                            self._finished(run, out)
                        yield out
                        if finished:
                            return
                    raise RequestLostError("the replica's stream ended without a final output")
                except rx.RayTaskError as e:
                    cause = getattr(e, "cause", None)
                    if isinstance(cause, ValueError):  # the request's own problem: a 400
                        raise ValueError(str(cause)) from None
                    error = cause if isinstance(cause, BaseException) else e
                except rx.RayError as e:  # the actor died or its objects were lost
                    error = e
                if self._stopping:
                    raise RequestLostError("the server is shutting down")
                replica = run.decision.replica
                if isinstance(error, (rx.RayActorError, EngineDeadError)):  # the replica went
                    self._replica_down(self.set.replicas[replica], "restarting", error)
                resend = not streamed and any(i not in tried and i not in self.set.prefill_ids
                                              for i in self.set.live())
                if self.hooks is not None:
                    self.hooks.replica_failed(replica, resend)
                if not resend:
                    raise RequestLostError(f"replica {replica} failed while running the request: "
                                             f"{describe_error(error)}")
                logger.warning("replica %d failed before request %s streamed anything; sending "
                               "it to another replica", replica, request_id)
                self._cancel(run)  # the failed attempt leaves that replica's counts
                run = self._launch(request_id, request, priority, exclude=tried)
                tried = (*tried, run.decision.replica)
        finally:
            if not finished:
                self._cancel(run)
            self._running.pop(request_id, None)

    def _finished(self, run: _Running, out: RequestOutput) -> None:
        cached = max(out.num_cached_tokens, 0)
        self.router.finished(run.decision, cached)
        if self.hooks is not None:
            self.hooks.route_finished(run.decision, len(out.prompt_token_ids), cached)

    def _cancel(self, run: _Running) -> None:
        if run.cancelled:
            return
        run.cancelled = True
        self.router.finished(run.decision)
        import ray
        for ref in (run.stream, run.prefill):
            if ref is None:
                continue
            try:
                ray.cancel(ref)  # the replica's generator (or prefill) stops, aborting its request
            except Exception:  # the replica is gone: so is the request
                pass

    def abort(self, request_id: str) -> None:
        run = self._running.pop(request_id, None)
        if run is not None:
            self._cancel(run)

    def num_waiting(self) -> int:
        """Requests waiting in the replicas (as last polled)."""
        return sum(r.stats.get("num_requests_waiting", 0) for r in self.set.replicas
                   if r.state == "up")
