"""Moving a prompt's KV blocks from one engine to another (disaggregated prefill/decode).

The producer prefills the request (max_tokens=1) and export_prefix() reads the prompt's full
blocks out of its cache, found under their prefix-cache keys (a block evicted since the
prefill ends the run: what was found is what moves). The payload travels through Ray's
object store, from the producer's replica to the consumer's (jaxllm.distributed.replica).
There import_prefix() gives the blocks new homes in the consumer's cache, registered under
the consumer's own keys for the same tokens (block tables are per engine), so that the
request, added right after, finds them as prefix-cache hits: only the tokens after the last
full block (and the last token, whose logits are needed) run again. Both run on the
engine's thread, between steps.
"""
from __future__ import annotations

import time

import numpy as np

from jaxllm.core.kv_cache_manager import prefix_keys


def _keys(engine, token_ids, cache_salt, lora_request) -> list:
    lora_id = engine._lora_key(lora_request)  # as add_request keys the request
    extra = (cache_salt, lora_id) if (cache_salt or lora_id) else None
    return prefix_keys(token_ids, engine.kv_manager.block_size, extra)


def export_prefix(engine, token_ids: list[int], cache_salt=None, lora_request=None) -> dict:
    """The prompt's cached full blocks, as arrays per cache array (one row per block)."""
    start = time.perf_counter()
    keys = _keys(engine, token_ids, cache_salt, lora_request)
    blocks = engine.kv_manager.cached_run(keys)
    values = engine.runner.block_ops.read(engine.runner.kv_cache, blocks) if blocks else []
    return {"num_blocks": len(blocks), "prompt_blocks": len(keys), "prompt_tokens": len(token_ids),
            "block_size": engine.kv_manager.block_size, "values": values,
            "nbytes": int(sum(v.nbytes for v in values)),
            "export_seconds": time.perf_counter() - start}


def import_prefix(engine, token_ids: list[int], payload: dict, cache_salt=None,
                  lora_request=None) -> int:
    """The payload's blocks in this engine's cache, findable by the request for `token_ids`;
    the number of blocks written (those cached here already are kept). ValueError if the
    payload does not fit this cache (another model, block size or cache dtype), or if there
    is no room for it (the request then computes its prompt here)."""
    bs = engine.kv_manager.block_size
    if payload["block_size"] != bs:
        raise ValueError(f"the KV blocks are of {payload['block_size']} tokens, this cache's "
                         f"of {bs}")
    n = payload["num_blocks"]
    if n == 0:
        return 0
    runner = engine.runner
    runner.block_ops.check(payload["values"])
    keys = _keys(engine, token_ids[:n * bs], cache_salt, lora_request)
    pairs = engine.kv_manager.adopt(keys)
    if pairs is None:
        raise ValueError(f"no room for {n} KV blocks in this cache")
    if pairs:
        rows = np.array([i for i, _ in pairs])
        try:
            runner.kv_cache = runner.block_ops.write(runner.kv_cache, [b for _, b in pairs],
                                                     [v[rows] for v in payload["values"]])
        except BaseException:  # registered but not written: nobody may find them
            engine.kv_manager.pool.forget([b for _, b in pairs])
            raise
    return len(pairs)
