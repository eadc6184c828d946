"""One replica: an AsyncEngine inside a Ray actor's process.

The front end (jaxllm.distributed.data_parallel) validates and tokenizes each request, routes
it, and calls generate() here as a Ray streaming generator: each RequestOutput crosses back
as it is made. Stopping early (ray.cancel) aborts the request, as closing the stream of a
local AsyncEngine does. A replica whose engine fails exits its process, so that Ray restarts
it; its `incarnation` tells the front end that the restarted one is a new life with an empty
cache. Plain class: data_parallel.py makes it an actor with the resources it gets.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid

logger = logging.getLogger("jaxllm")

PREFILL_TIMEOUT = 300.0  # seconds a decode replica waits for a prefill before computing it


class Replica:
    def __init__(self, config, index: int, cores: list[int] | None, lora_modules=(),
                 model_names=(), log_level: int = logging.INFO):
        """cores: the CPU cores this replica's process keeps to (None: all it is given);
        set before JAX starts, so that its thread pools are sized to them."""
        if cores:
            os.sched_setaffinity(0, cores)
        logging.basicConfig(level=log_level, format=f"%(asctime)s replica {index} %(levelname)s %(message)s")
        logging.getLogger("jaxllm").setLevel(log_level)
        from jaxllm.engine.async_engine import AsyncEngine  # after the affinity: JAX starts here

        self.index = index
        self.incarnation = uuid.uuid4().hex
        self.started = time.time()
        self._stats: dict | None = None
        self._steps = 0
        # KV transfer (disaggregated prefill/decode): what this replica sent and received
        self.kv = {"kv_transfer_sent_blocks": 0, "kv_transfer_sent_bytes": 0,
                   "kv_transfer_received_blocks": 0, "kv_transfer_received_bytes": 0,
                   "kv_transfer_imported_blocks": 0, "kv_transfer_receive_seconds": 0.0,
                   "kv_transfer_import_seconds": 0.0,
                   "kv_transfer_failures": 0}
        self.engine = AsyncEngine(config, on_step=self._on_step, on_fail=self._on_fail,
                                  lora_modules=lora_modules, model_names=model_names)
        self.engine.start()
        self.engine.ready.wait()
        if self.engine.error is not None:
            raise self.engine.error
        self._stats = self.engine.engine.stats()

    def _on_step(self, engine, outputs, elapsed: float) -> None:
        self._stats = engine.stats()
        self._steps += 1

    def _on_fail(self, error: BaseException) -> None:
        """The engine died: streams have their error; the process goes so Ray restarts it."""
        logger.error("replica %d: the engine failed; exiting for a restart", self.index)
        threading.Timer(1.0, os._exit, (1,)).start()

    def info(self) -> dict:
        """What the front end needs to know of this replica (fixed for its life)."""
        import jax
        e = self.engine.engine
        spec = e.config.speculative_config
        return {"incarnation": self.incarnation, "pid": os.getpid(), "index": self.index,
                "node": os.uname().nodename, "cores": sorted(os.sched_getaffinity(0)),
                "max_model_len": e.config.max_model_len, "vocab_size": e.arch.vocab_size,
                "eos_token_id": e.eos_token_id, "has_tokenizer": e.tokenizer is not None,
                "block_size": e.config.block_size,
                "num_blocks": e.kv_manager.pool.num_usable_blocks,
                "speculative_tokens": spec.num_speculative_tokens if spec is not None else 0,
                "platform": jax.default_backend(),
                "startup_seconds": e.startup_seconds}

    def stats(self) -> dict:
        """The engine's counters after its last step, and this life's identity."""
        return {"incarnation": self.incarnation, "alive": self.engine.error is None,
                "steps": self._steps, **(self._stats or {}), **self.kv}

    async def generate(self, request_id: str, request, priority: int = 0, kv=None):
        """The request's outputs as they are made. kv: [the ObjectRef of this replica's
        receive() for the request], awaited first (in a list, so that Ray does not wait for
        it before the call starts)."""
        if kv:
            try:
                await kv[0]
            except Exception as e:  # receive() itself failed (cancelled): compute the prompt
                logger.error("replica %d: the KV transfer of request %s did not finish (%s); "
                             "its prompt is computed here instead", self.index, request_id,
                             type(e).__name__)
        async for out in self.engine.submit(request_id, request, priority):
            yield out

    async def receive(self, request_id: str, request, kv) -> bool:
        """Fetch the payload of a producer's prefill() (kv: [its ObjectRef]) and write its
        blocks into this cache; False if that failed (the prompt is then computed here).
        A call of its own: the payload is let go when it returns."""
        return await self._receive(request_id, request, kv[0])

    async def _receive(self, request_id: str, request, ref) -> bool:
        from jaxllm.distributed.kv_transfer import import_prefix
        try:
            if hasattr(ref, "hex"):  # a Ray ObjectRef: wait for the prefill, then time the fetch
                import ray
                ready, _ = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: ray.wait([ref], fetch_local=False, timeout=PREFILL_TIMEOUT))
                if not ready:
                    raise TimeoutError(f"the prefill took over {PREFILL_TIMEOUT:.0f} s")
            start = time.perf_counter()
            payload = await ref
            fetched = time.perf_counter()
            written = await self.engine.on_engine(lambda e: import_prefix(
                e, request.prompt_token_ids, payload, request.cache_salt, request.lora_request))
            self.kv["kv_transfer_receive_seconds"] += fetched - start
            self.kv["kv_transfer_import_seconds"] += time.perf_counter() - fetched
        except Exception as e:  # the prompt is computed here instead
            self.kv["kv_transfer_failures"] += 1
            logger.error("replica %d: the KV transfer of request %s failed (%s: %s); its prompt "
                         "is computed here instead", self.index, request_id, type(e).__name__, e)
            return False
        self.kv["kv_transfer_received_blocks"] += payload["num_blocks"]
        self.kv["kv_transfer_received_bytes"] += payload["nbytes"]
        self.kv["kv_transfer_imported_blocks"] += written
        return True

    async def prefill(self, request_id: str, request):
        """Producer: run the request (its max_tokens set to 1 by the front end) and return
        (a small summary, the payload of its prompt's KV blocks): two objects, so that the
        front end reads the summary while the payload goes from here to the consumer."""
        from jaxllm.distributed.kv_transfer import export_prefix
        out = None
        async for out in self.engine.submit(request_id, request):
            pass
        payload = await self.engine.on_engine(lambda e: export_prefix(
            e, request.prompt_token_ids, request.cache_salt, request.lora_request))
        self.kv["kv_transfer_sent_blocks"] += payload["num_blocks"]
        self.kv["kv_transfer_sent_bytes"] += payload["nbytes"]
        summary = {k: v for k, v in payload.items() if k != "values"}
        summary["num_cached_tokens"] = max(out.num_cached_tokens, 0) if out is not None else 0
        return summary, payload

    async def run_batch(self, items: list) -> list:
        """Offline: every (request_id, request) run to its final output, in order."""
        async def last(stream):
            out = None
            async for out in stream:
                pass
            return out
        streams = [self.engine.submit(rid, req) for rid, req in items]
        return await asyncio.gather(*(last(s) for s in streams))

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def add_lora(self, lora_request) -> None:
        await self.engine.add_lora(lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self.engine.remove_lora(lora_int_id)

    async def memory_report(self) -> dict:
        return await self.engine.on_engine(lambda e: e.memory_report())

    def shutdown(self) -> None:
        self.engine.shutdown()
