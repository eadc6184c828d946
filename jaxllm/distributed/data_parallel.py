"""Data-parallel replicas: N engines as Ray actors behind one front end.

ReplicaSet starts Ray (or joins a running cluster), places one Replica actor
(jaxllm.distributed.replica) per engine on its own devices (a GPU each, or its share of this
machine's CPU cores, pinned) and lets Ray restart one that dies. The front end keeps what
does not need the model: the tokenizer, input validation, grammar checks and the Router,
which picks a replica per request by the prompt's cached prefix and the replicas' load.

DataParallelEngine is the server's engine (AsyncEngine's surface): each request is streamed
from its replica as Ray streaming-generator outputs. A replica that dies ends its requests
with RequestLostError, except those that had not streamed anything yet, which are sent to
another replica; a watcher per replica polls its counters (for /metrics and the router's
load picture), sees it go and come back, and re-registers runtime LoRA adapters on the new
life. DataParallelLLMEngine is the offline one (LLMEngine's surface, for LLM): requests are
routed into one batch per replica and collected as the batches finish.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator

from jaxllm.config import EngineConfig
from jaxllm.distributed.router import Decision, Router
from jaxllm.engine.async_engine import (TOKENIZER_THREADS, EngineDeadError, EngineFront,
                                        RequestLostError, describe_error)
from jaxllm.engine.input_processor import EngineRequest, InputProcessor
from jaxllm.engine.outputs import RequestOutput

logger = logging.getLogger("jaxllm")

MAX_RESTARTS = 4        # Ray restarts a dead replica this many times, then it stays dead
POLL_SECONDS = 0.25     # how often each replica's counters are read
DEAD_AFTER = 3          # consecutive "actor died" answers before a replica counts as gone


@dataclass
class ReplicaState:
    index: int
    handle: object
    info: dict | None = None
    state: str = "starting"   # starting, up, restarting, dead
    incarnation: str | None = None
    restarts: int = 0
    died_answers: int = 0
    stats: dict = field(default_factory=dict)


def _router_key(request: EngineRequest):
    """What makes equal tokens a different cache entry: the salt and the adapter."""
    lora = request.lora_request
    return (request.cache_salt, lora.lora_name if lora is not None else None)


def prefill_request(request: EngineRequest) -> EngineRequest:
    """What a prefill replica runs: the prompt, one greedy token (thrown away: the decode
    replica computes the first token from the moved blocks)."""
    from jaxllm.sampling_params import RequestOutputKind, SamplingParams
    return EngineRequest(None, request.prompt_token_ids,
                         SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                        output_kind=RequestOutputKind.FINAL_ONLY),
                         cache_salt=request.cache_salt, lora_request=request.lora_request)


def _ray_errors():
    import ray.exceptions as rx
    return rx


class ReplicaSet:
    """The actors; shared by the server's and the offline engine."""

    def __init__(self, config: EngineConfig, lora_modules=(), model_names=()):
        self.config = config
        self.size = config.data_parallel_size
        # each replica is one plain engine
        self.replica_config = dataclasses.replace(config, data_parallel_size=1,
                                                  data_parallel_address=None,
                                                  kv_transfer_config=None)
        self.lora_modules = list(lora_modules)
        self.model_names = list(model_names)
        self.replicas: list[ReplicaState] = []
        kv = config.kv_transfer_config
        # disaggregated prefill/decode: the first replicas prefill, the others decode
        num_prefill = kv.num_prefill(self.size) if kv is not None else 0
        self.prefill_ids = tuple(range(num_prefill))
        self.decode_ids = tuple(range(num_prefill, self.size)) if kv is not None else ()
        self._inited_ray = False  # this process connected to Ray (and started it, if not joined)

    def connect(self) -> None:
        """Start Ray on this machine, or join the cluster at data_parallel_address. Ray's own
        processes started here are bound to the life of the calling thread (their parent
        death signal is per thread): call it on one that lives as long as the replicas."""
        try:
            import ray
        except ImportError:
            raise ValueError("data_parallel_size > 1 runs its replicas on Ray, which is not "
                             "installed: pip install 'jaxllm[distributed]'") from None
        address = self.config.data_parallel_address
        cores = sorted(os.sched_getaffinity(0))
        if not ray.is_initialized():
            # ray.init on the main thread makes SIGTERM exit at once; the server drains on it
            # (uvicorn's handler), so whatever handled it before handles it after
            main = threading.current_thread() is threading.main_thread()
            before = signal.getsignal(signal.SIGTERM) if main else None
            if address:
                ray.init(address=address, configure_logging=False, log_to_driver=True,
                         namespace="jaxllm")
            else:
                ray.init(address="local", num_cpus=len(cores), include_dashboard=False,
                         configure_logging=False,
                         log_to_driver=True, namespace="jaxllm")
            if before is not None:
                signal.signal(signal.SIGTERM, before)
            self._inited_ray = True

    def start(self) -> list[dict]:
        """Place the replicas (connecting to Ray first if not yet) and wait until each has
        its engine up; their info(). An engine that cannot start raises its error here."""
        self.connect()
        import ray
        address = self.config.data_parallel_address
        cores = sorted(os.sched_getaffinity(0))
        local = not address
        resources = ray.cluster_resources()
        tp = self.config.tensor_parallel_size
        gpus = int(resources.get("GPU", 0))
        placements = []
        if 0 < gpus < self.size * tp:
            raise ValueError(f"data_parallel_size {self.size} x tensor_parallel_size {tp} needs "
                             f"{self.size * tp} GPUs; Ray sees {gpus}")
        if gpus >= self.size * tp:
            placements = [{"num_gpus": tp, "num_cpus": 1}] * self.size
            pins = [None] * self.size
            where = f"{tp} GPU(s) each"
        elif local:
            share = len(cores) // self.size
            if share == 0:
                logger.warning("%d replicas share %d CPU cores: they will contend for them",
                               self.size, len(cores))
                pins = [None] * self.size
                placements = [{"num_cpus": len(cores) / self.size}] * self.size
            else:
                pins = [cores[i * share:(i + 1) * share] for i in range(self.size)]
                placements = [{"num_cpus": share}] * self.size
            where = (f"CPU cores {', '.join(','.join(map(str, p)) for p in pins)}"
                     if pins[0] is not None else "shared CPU cores")
        else:  # a cluster of CPU machines: one replica per machine where they fit
            per = max(1, int(resources.get("CPU", 1)) // self.size)
            placements = [{"num_cpus": per, "scheduling_strategy": "SPREAD"}] * self.size
            pins = [None] * self.size
            where = f"{per} CPU(s) each, spread over the cluster"
        from jaxllm.distributed.replica import Replica
        cls = ray.remote(Replica)
        logger.info("starting %d replicas on Ray (%s; %s)", self.size,
                    f"cluster {address}" if address else "this machine", where)
        for i in range(self.size):
            handle = cls.options(max_restarts=MAX_RESTARTS, max_task_retries=0,
                                 **placements[i]).remote(
                self.replica_config, i, pins[i], self.lora_modules, self.model_names,
                logging.getLogger("jaxllm").getEffectiveLevel())
            self.replicas.append(ReplicaState(i, handle))
        infos = []
        for r in self.replicas:
            try:
                info = ray.get(r.handle.info.remote())
            except Exception as e:  # its engine could not start: so the set does not
                self.kill()
                cause = getattr(e, "cause", None)  # a RayTaskError carries the engine's error
                if isinstance(cause, ValueError):
                    raise ValueError(f"replica {r.index}: {cause}") from None
                raise RuntimeError(f"replica {r.index} failed to start: {describe_error(e)}") from None
            r.info, r.incarnation, r.state = info, info["incarnation"], "up"
            infos.append(info)
        logger.info("replicas up: %s", "; ".join(
            f"{i['index']} ({self.role(i['index'])}, pid {i['pid']} on {i['node']}, "
            f"{i['startup_seconds']:.1f} s)" for i in infos))
        return infos

    def handle(self, index: int):
        return self.replicas[index].handle

    def live(self) -> list[int]:
        return [r.index for r in self.replicas if r.state == "up"]

    def role(self, index: int) -> str:
        return ("prefill" if index in self.prefill_ids else "decode" if index in self.decode_ids
                else "both")

    def kill(self) -> None:
        """The replicas stop (Ray does not restart them)."""
        import ray
        for r in self.replicas:
            try:
                ray.kill(r.handle, no_restart=True)
            except Exception:  # already gone
                pass
        self.replicas = []

    def shutdown(self) -> None:
        """The replicas stop, and Ray with them if this process started it (on the thread
        that connected)."""
        import ray
        self.kill()
        if self._inited_ray and ray.is_initialized():
            ray.shutdown()  # stops the cluster this process started; leaves a joined one
            self._inited_ray = False


def _front_parts(config: EngineConfig, info: dict):
    """The front end's tokenizer, input processor and grammar manager, as replica 0 has them."""
    from jaxllm.loader.loader import get_tokenizer
    from jaxllm.structured_output.manager import StructuredOutputManager
    tokenizer = get_tokenizer(config.tokenizer or config.model) if info["has_tokenizer"] else None
    structured = StructuredOutputManager(
        tokenizer, info["vocab_size"], info["eos_token_id"],
        allow_additional_properties=config.structured_outputs_allow_additional_properties)
    inputs = InputProcessor(tokenizer, info["vocab_size"], info["max_model_len"], structured,
                            speculative=info["speculative_tokens"] > 0)
    return tokenizer, inputs, structured


class _Totals:
    """The replicas' engine counters summed, each kept monotonic across its restarts (a new
    life starts its counters at zero)."""

    SKIP = ("incarnation", "alive", "steps", "max_lora", "lora_running", "lora_waiting")
    GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
              "kv_total_slots", "peak_running")

    def __init__(self, size: int):
        self.base = [dict() for _ in range(size)]   # counters of earlier lives
        self.last = [dict() for _ in range(size)]
        self.life = [None] * size
        self.peak = 0

    def update(self, i: int, stats: dict, prefill: bool = False) -> None:
        """prefill: a prefill replica, whose one generated token per request is thrown away
        (not counted as generated)."""
        if prefill:
            stats = {**stats, "generation_tokens": 0}
        if stats.get("incarnation") != self.life[i]:
            if self.life[i] is not None:
                for k, v in self.last[i].items():
                    if k not in self.GAUGES and k not in self.SKIP:
                        self.base[i][k] = _add(self.base[i].get(k), v)
            self.life[i] = stats.get("incarnation")
        self.last[i] = stats

    def total(self, up: list[bool]) -> dict:
        out: dict = dict.fromkeys(self.GAUGES, 0)
        for i, stats in enumerate(self.last):
            for k, v in stats.items():
                if k in self.SKIP:
                    continue
                if k in self.GAUGES:
                    if up[i]:
                        out[k] = out.get(k, 0) + v
                else:
                    out[k] = _add(out.get(k), _add(self.base[i].get(k), v))
        slots = sum(s.get("kv_total_slots", 0) for s, u in zip(self.last, up) if u)
        # usage weighted by each replica's capacity
        used = sum(s.get("kv_cache_usage_perc", 0) * s.get("kv_total_slots", 0)
                   for s, u in zip(self.last, up) if u)
        out["kv_cache_usage_perc"] = used / slots if slots else 0.0
        self.peak = max(self.peak, out.get("num_requests_running", 0))
        out["peak_running"] = self.peak
        for s in self.last:  # adapters: counts summed, the slots are per replica
            if "lora_running" in s:
                out["max_lora"] = s["max_lora"]
                for key in ("lora_running", "lora_waiting"):
                    merged = out.setdefault(key, {})
                    for name, n in s[key].items():
                        merged[name] = merged.get(name, 0) + n
        return out


def _add(a, b):
    if a is None:
        return list(b) if isinstance(b, list) else b
    if isinstance(b, list):
        return [x + y for x, y in zip(a, b)]
    return a + b


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
        self._totals = _Totals(config.data_parallel_size)
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
            self.tokenizer, self.inputs, self.structured = _front_parts(self.config, info)
            self.router = Router(self.set.size, info["block_size"],
                                 min(i["num_blocks"] for i in infos), self.config.routing_policy)
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
        rx = _ray_errors()
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
                 "in_flight": routed[r.index].get("in_flight", 0)}
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
        ids, key = request.prompt_token_ids, _router_key(request)
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
        rx = _ray_errors()
        run = self._running[request_id]
        streamed, finished, tried = False, False, (run.decision.replica,)
        try:
            while True:
                try:
                    async for ref in run.stream:
                        out = await ref
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


class DataParallelLLMEngine:
    """The offline engine when LLM has replicas: LLMEngine's surface as LLM uses it."""

    is_follower = False

    def __init__(self, config: EngineConfig, lora_modules=(), model_names=()):
        self.config = config
        self.set = ReplicaSet(config, lora_modules, model_names)
        try:
            infos = self.set.start()
        except BaseException:
            self.set.shutdown()
            raise
        self.info = infos[0]
        self.tokenizer, self.inputs, self.structured = _front_parts(config, self.info)
        self.eos_token_id = self.info["eos_token_id"]
        self.router = Router(self.set.size, self.info["block_size"],
                             min(i["num_blocks"] for i in infos), config.routing_policy)
        self._pending: dict[int, list] = {}
        self._batches: dict = {}    # ObjectRef -> (replica, [(request_id, request, decision)])
        self._loras: list = []

    def process_inputs(self, prompt, params=None, lora_request=None) -> EngineRequest:
        return self.inputs.process(prompt, params, lora_request)

    def add_lora(self, lora_request) -> bool:
        import ray
        if lora_request not in self._loras:
            ray.get([self.set.handle(i).add_lora.remote(lora_request) for i in self.set.live()])
            self._loras.append(lora_request)
        return True

    def add_request(self, request_id: str, prompt, params=None, arrival_time=None,
                    priority: int = 0, lora_request=None) -> None:
        if priority != 0:
            raise ValueError("priority is not supported with data_parallel_size > 1 offline")
        req = self.inputs.process(prompt, params, lora_request)
        if lora_request is not None and req.lora_request is None:
            req.lora_request = lora_request
        self._queue(request_id, req, ())

    def _queue(self, request_id: str, req: EngineRequest, exclude: tuple) -> None:
        decision = self.router.route(req.prompt_token_ids, _router_key(req), exclude)
        self._pending.setdefault(decision.replica, []).append((request_id, req, decision))

    def step(self) -> list[RequestOutput]:
        """Send the batches queued since the last step; the outputs of the next batch done."""
        import ray
        rx = _ray_errors()
        for i, items in self._pending.items():
            ref = self.set.handle(i).run_batch.remote([(rid, req) for rid, req, _ in items])
            self._batches[ref] = (i, items)
        self._pending = {}
        if not self._batches:
            return []
        [ref], _ = ray.wait(list(self._batches), num_returns=1)
        replica, items = self._batches.pop(ref)
        try:
            outs = ray.get(ref)
        except rx.RayTaskError as e:
            if isinstance(getattr(e, "cause", None), ValueError):
                raise ValueError(str(e.cause)) from None
            if not isinstance(getattr(e, "cause", None), EngineDeadError):
                raise
            return self._resend(replica, items, e)
        except rx.RayActorError as e:
            return self._resend(replica, items, e)
        for (_, _, decision), out in zip(items, outs):
            self.router.finished(decision, max(out.num_cached_tokens, 0))
        return outs

    def _resend(self, replica: int, items: list, error) -> list:
        """Offline outputs come at the end: a failed batch is run again elsewhere."""
        self.router.set_alive(replica, False)
        others = [i for i in range(self.set.size) if i != replica and self.router.replicas[i].alive]
        if not others:
            raise EngineDeadError(f"every replica failed (last: replica {replica}: "
                                  f"{describe_error(error)})")
        logger.warning("replica %d failed (%s); its %d requests run on the others", replica,
                       describe_error(error), len(items))
        for rid, req, _ in items:
            self._queue(rid, req, (replica,))
        return []

    def abort_request(self, request_id) -> None:
        import ray
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        for i in list(self._pending):
            self._pending[i] = [it for it in self._pending[i] if it[0] not in ids]
        for ref, (_, items) in list(self._batches.items()):
            if any(rid in ids for rid, _, _ in items):
                ray.cancel(ref)
                del self._batches[ref]

    def has_unfinished_requests(self) -> bool:
        return bool(self._batches) or any(self._pending.values())

    def memory_report(self) -> list[dict]:
        import ray
        return ray.get([self.set.handle(i).memory_report.remote() for i in self.set.live()])

    def shutdown(self) -> None:
        self.set.shutdown()
