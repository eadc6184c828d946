"""The replicas' front end without Ray's actors: their counters summed across restarts, the
configuration refused by field, the routing exclusions a resent request needs, and the
router's counts after a resend."""
import pytest

from jaxllm.config import EngineConfig
from jaxllm.distributed.replica_set import Totals as _Totals
from jaxllm.kv_transfer_config import KVTransferConfig
from jaxllm.distributed.router import Router


def _stats(life, running, prompt, kv=0.5, slots=100):
    return {"incarnation": life, "alive": True, "steps": 3, "num_requests_running": running,
            "num_requests_waiting": 0, "kv_cache_usage_perc": kv, "kv_total_slots": slots,
            "peak_running": running, "prompt_tokens": prompt,
            "spec_decode_num_accepted_tokens_per_pos": [prompt, 1]}


def test_counters_stay_monotonic_when_a_replica_restarts():
    t = _Totals(2)
    t.update(0, _stats("a", 2, 100, kv=0.5))
    t.update(1, _stats("b", 1, 40, kv=0.1, slots=300))
    total = t.total([True, True])
    assert total["prompt_tokens"] == 140 and total["num_requests_running"] == 3
    assert total["kv_cache_usage_perc"] == pytest.approx((0.5 * 100 + 0.1 * 300) / 400)
    assert total["spec_decode_num_accepted_tokens_per_pos"] == [140, 2]
    # replica 0 restarts: its new life counts from zero, the total does not go back
    t.update(0, _stats("a2", 0, 5))
    total = t.total([True, True])
    assert total["prompt_tokens"] == 145
    assert total["spec_decode_num_accepted_tokens_per_pos"] == [145, 3]
    # a replica that is down adds no load, and its capacity is not counted
    total = t.total([False, True])
    assert total["num_requests_running"] == 1 and total["kv_total_slots"] == 300
    assert total["peak_running"] == 3  # the most seen at once


def test_kv_transfer_config_is_refused_by_field():
    with pytest.raises(ValueError, match="kv_transfer_config.kv_connector"):
        KVTransferConfig.parse({"kv_connector": "NixlConnector"})
    with pytest.raises(ValueError, match="kv_transfer_config.kv_role"):
        KVTransferConfig.parse('{"kv_role": "kv_producer"}')
    with pytest.raises(ValueError, match="prefill_replicas"):
        KVTransferConfig.parse({"kv_connector_extra_config": {"prefill_replicas": 0}})
    with pytest.raises(ValueError, match="kv_transfer_config.kv_buffer_size"):
        KVTransferConfig.parse({"kv_buffer_size": 1})
    with pytest.raises(ValueError, match="not valid JSON"):
        KVTransferConfig.parse("{")
    cfg = KVTransferConfig.parse({"kv_connector_extra_config": {"prefill_replicas": 2}})
    assert cfg.num_prefill(3) == 2 and KVTransferConfig().num_prefill(4) == 2
    with pytest.raises(ValueError, match="at least one decode replica"):
        cfg.num_prefill(2)


def test_engine_config_checks_replica_options():
    kv = {"kv_connector": "RayObjectStoreConnector"}
    with pytest.raises(ValueError, match="data_parallel_size >= 2"):
        EngineConfig(kv_transfer_config=kv)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(data_parallel_size=2, kv_transfer_config=kv, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="data_parallel_backend"):
        EngineConfig(data_parallel_size=2, data_parallel_backend="mp")
    with pytest.raises(ValueError, match="routing_policy"):
        EngineConfig(data_parallel_size=2, routing_policy="random")
    with pytest.raises(ValueError, match="routing_cache_threshold"):
        EngineConfig(data_parallel_size=2, routing_cache_threshold=1.5)
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        EngineConfig(data_parallel_size=0)
    assert EngineConfig(data_parallel_size=2, kv_transfer_config=kv).kv_transfer_config.kv_role == "kv_both"


def test_llm_refuses_kv_transfer_offline():
    from jaxllm import LLM
    with pytest.raises(ValueError, match="kv_transfer_config"):
        LLM(data_parallel_size=2, kv_transfer_config={"kv_connector": "RayObjectStoreConnector"})


def test_a_resent_request_avoids_the_replicas_it_failed_on():
    r = Router(3, block_size=4, capacity_blocks=64)
    ids = list(range(12))
    first = r.route(ids)
    again = r.route(ids, exclude=(first.replica,))
    assert again.replica != first.replica
    third = r.route(ids, exclude=(first.replica, again.replica))
    assert third.replica not in (first.replica, again.replica)
    with pytest.raises(RuntimeError, match="no replica"):
        r.route(ids, exclude=(0, 1, 2))
    rr = Router(3, block_size=4, capacity_blocks=64, policy="round_robin")
    assert [rr.route(ids, exclude=(1,)).replica for _ in range(4)] == [0, 2, 0, 2]


def test_adopted_blocks_are_found_and_their_chain_head_is_evicted_last():
    """Blocks moved in from another engine sit in the prefix cache under their keys, after
    the run already cached here; under pressure the chain's tail goes first."""
    from jaxllm.core.kv_cache_manager import KVCacheManager, prefix_keys
    kv = KVCacheManager(num_blocks=8, block_size=2)
    keys = prefix_keys([1, 2, 3, 4, 5, 6, 7, 8], 2)
    first = kv.adopt(keys[:2])
    assert [i for i, _ in first] == [0, 1]
    pairs = kv.adopt(keys)  # the first two are cached already: only the rest is written
    assert [i for i, _ in pairs] == [2, 3]
    chain = kv.cached_run(keys)
    assert chain == [b for _, b in first + pairs] and kv.adopt(keys) == []
    assert kv.pool.num_free_blocks == 7  # all released: evictable, not held
    kv.pool.allocate(4)  # the three never-used blocks, then the chain's tail
    assert kv.cached_run(keys) == chain[:3]
    assert kv.adopt(prefix_keys(list(range(20)), 2)) is None  # no room for ten more


def test_a_resent_request_leaves_nothing_counted_on_the_replica_it_failed_on(monkeypatch):
    """A request whose replica answered with an error before streaming anything (the replica
    itself still up) is sent elsewhere; the failed attempt is cancelled and leaves the
    router's counts there (in flight, queue of prefills), or routing would shun that replica
    for good."""
    import asyncio
    from types import SimpleNamespace

    import ray
    import ray.exceptions
    cancelled = []
    monkeypatch.setattr(ray, "cancel", cancelled.append)  # (no cluster here)

    from jaxllm.distributed.data_parallel import DataParallelEngine, _Running

    router = Router(2, block_size=4, capacity_blocks=64)
    ids = list(range(12))

    async def failing():
        raise ray.exceptions.RayError("the replica's task failed")
        yield  # (an async generator)

    async def answering():
        async def ref():
            return SimpleNamespace(finished=True, num_cached_tokens=0, prompt_token_ids=ids)
        yield ref()

    eng = object.__new__(DataParallelEngine)
    eng.router, eng.hooks, eng._stopping, eng._running = router, None, False, {}
    eng.set = SimpleNamespace(live=lambda: [0, 1], prefill_ids=(), replicas=[None, None])
    first = router.route(ids)
    eng._running["r"] = _Running(first, failing())
    relaunched = []

    def launch(request_id, request, priority, exclude):
        run = eng._running[request_id] = _Running(router.route(ids, exclude=exclude), answering())
        relaunched.append(run.decision.replica)
        return run
    eng._launch = launch

    async def consume():
        return [out async for out in eng._outputs("r", None, 0)]
    stream = eng._running["r"].stream
    outs = asyncio.run(consume())
    assert len(outs) == 1 and outs[0].finished
    assert cancelled == [stream]  # the failed attempt, on its replica
    assert relaunched == [1 - first.replica]
    for s in router.stats():
        assert s["in_flight"] == 0 and s["pending_prefill_tokens"] == 0, s


def test_offline_abort_counts_requests_out_of_the_router(monkeypatch):
    """LLM(data_parallel_size=N): aborted requests, queued or in a batch already sent (which
    is cancelled whole), leave the router's counts, so their prefixes do not stay 'hot'."""
    import ray
    from jaxllm.distributed.offline import DataParallelLLMEngine
    cancelled = []
    monkeypatch.setattr(ray, "cancel", cancelled.append)
    eng = object.__new__(DataParallelLLMEngine)
    eng.router, eng._pending, eng._batches = Router(2, 4, 100), {}, {}

    def item(rid, replica):
        return rid, None, eng.router.route(list(range(20)) + [len(rid)], exclude=(1 - replica,))
    eng._pending = {0: [item("q1", 0), item("q2", 0)]}
    eng._batches = {"ref": (1, [item("b1", 1), item("b2", 1)])}
    assert [s["in_flight"] for s in eng.router.stats()] == [2, 2]
    eng.abort_request(["q1", "b1"])
    assert cancelled == ["ref"] and eng._batches == {} and [it[0] for it in eng._pending[0]] == ["q2"]
    assert [s["in_flight"] for s in eng.router.stats()] == [1, 0]
    assert not eng.router.replicas[1].shared
    eng.abort_request("q2")
    assert [s["in_flight"] for s in eng.router.stats()] == [0, 0]
    assert not eng.router.replicas[0].shared
