"""The replicas themselves, for both front ends (data_parallel.py's server engine,
offline.py's LLMEngine): Ray started or joined, one Replica actor (replica.py) placed per
engine on its own devices and restarted by Ray when it dies; what the front ends share about
them (the front end's tokenizer and validation, as replica 0 has them; their counters summed
across restarts; the router's key and the prefill request of disaggregated prefill/decode).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from dataclasses import dataclass, field

from jaxllm.config import EngineConfig
from jaxllm.engine.async_engine import describe_error
from jaxllm.engine.input_processor import EngineRequest, InputProcessor

logger = logging.getLogger("jaxllm")

MAX_RESTARTS = 4        # Ray restarts a dead replica this many times, then it stays dead


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


def router_key(request: EngineRequest):
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


def ray_errors():
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


def front_parts(config: EngineConfig, info: dict):
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


class Totals:
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
