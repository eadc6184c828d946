"""Data-parallel replicas offline: DataParallelLLMEngine, LLMEngine's surface as LLM uses
it. Requests are routed into one batch per replica and collected as the batches finish; a
batch whose replica dies runs again on the others (offline outputs come at the end, so
nothing was seen yet)."""
from __future__ import annotations

import logging

from jaxllm.config import EngineConfig
from jaxllm.distributed.replica_set import ReplicaSet, front_parts, ray_errors, router_key
from jaxllm.distributed.router import Router
from jaxllm.engine.async_engine import EngineDeadError, describe_error
from jaxllm.engine.input_processor import EngineRequest
from jaxllm.engine.outputs import RequestOutput

logger = logging.getLogger("jaxllm")


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
        self.tokenizer, self.inputs, self.structured = front_parts(config, self.info)
        self.eos_token_id = self.info["eos_token_id"]
        self.router = Router(self.set.size, self.info["block_size"],
                             min(i["num_blocks"] for i in infos), config.routing_policy,
                             cache_threshold=config.routing_cache_threshold)
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
        decision = self.router.route(req.prompt_token_ids, router_key(req), exclude)
        self._pending.setdefault(decision.replica, []).append((request_id, req, decision))

    def step(self) -> list[RequestOutput]:
        """Send the batches queued since the last step; the outputs of the next batch done."""
        import ray
        rx = ray_errors()
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
            if not isinstance(getattr(e, "cause", None), EngineDeadError):
                self._forget(items)  # the batch is lost: its requests leave the router's counts
                if isinstance(getattr(e, "cause", None), ValueError):
                    raise ValueError(str(e.cause)) from None
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

    def _forget(self, items: list) -> None:
        for _, _, decision in items:
            self.router.finished(decision)

    def abort_request(self, request_id) -> None:
        import ray
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        for i in list(self._pending):
            self._forget([it for it in self._pending[i] if it[0] in ids])
            self._pending[i] = [it for it in self._pending[i] if it[0] not in ids]
        for ref, (_, items) in list(self._batches.items()):
            if any(rid in ids for rid, _, _ in items):
                ray.cancel(ref)
                del self._batches[ref]
                self._forget(items)  # (the whole batch is cancelled)

    def has_unfinished_requests(self) -> bool:
        return bool(self._batches) or any(self._pending.values())

    def memory_report(self) -> list[dict]:
        import ray
        return ray.get([self.set.handle(i).memory_report.remote() for i in self.set.live()])

    def shutdown(self) -> None:
        self.set.shutdown()
