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
                "steps": self._steps, **(self._stats or {})}

    async def generate(self, request_id: str, request, priority: int = 0):
        async for out in self.engine.submit(request_id, request, priority):
            yield out

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
