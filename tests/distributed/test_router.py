"""The replica router (jaxllm/distributed/router.py): a prompt goes where its prefix is
cached, cold prompts spread by load, a hot prefix spills over once its replica is out of
balance or its queue of prefills outweighs the prefix, a full KV cache is avoided, dead replicas get nothing and forget their cache; round
robin and least loaded as asked; the router's keys are the prefix cache's."""
import random

import pytest

from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request
from jaxllm.distributed.router import Router
from jaxllm.sampling_params import SamplingParams

BS = 4


def prompt(prefix: int, n_prefix: int = 16, tail: int = 0, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [1000 * prefix + i for i in range(n_prefix)] + [rng.randrange(50_000, 60_000) for _ in range(tail)]


def test_keys_are_the_prefix_cache_keys():
    ids = prompt(3, 18)
    req = Request("r", ids, SamplingParams(), eos_token_id=None, seed=0)
    want = KVCacheManager(num_blocks=16, block_size=BS).block_hashes(req)
    assert Router(2, BS, 100).keys(ids) == want and len(want) == 4
    # the adapter and cache salt are in the first key, as in the engine
    salted = Request("s", ids, SamplingParams(), eos_token_id=None, seed=0, cache_salt="t", lora_id=2)
    assert Router(2, BS, 100).keys(ids, salted.cache_extra) == \
        KVCacheManager(num_blocks=16, block_size=BS).block_hashes(salted)


def test_same_prefix_same_replica_and_cold_prompts_spread():
    r = Router(3, BS, 1000)
    homes = {}
    for p in range(6):  # six conversations, each first seen cold
        d = r.route(prompt(p, tail=3, seed=p))
        assert d.reason == "least_loaded" and d.cached_blocks == 0
        homes[p] = d.replica
        r.finished(d)
    assert sorted(homes.values()) == [0, 0, 1, 1, 2, 2]  # spread while nothing is cached
    for turn in range(1, 4):  # each conversation comes back with a longer history
        for p in range(6):
            d = r.route(prompt(p, tail=3 + turn, seed=p))
            assert d.replica == homes[p] and d.reason == "prefix"
            assert d.cached_blocks == (4 if turn == 1 else 5)  # what it sent there before
            r.finished(d)


def test_a_short_shared_prefix_does_not_decide():
    """A tenant's system prompt alone (under cache_threshold of the prompt) does not pull
    every new conversation of the tenant onto the replica that cached it first: those
    spread by load; once a conversation's own history is cached, it stays where it is."""
    r = Router(2, BS, 1000)
    system = prompt(5, n_prefix=8)  # 2 blocks, shared by the tenant's conversations
    convs = [system + prompt(100 + c, n_prefix=0, tail=28, seed=c) for c in range(4)]  # 9 blocks
    first = []
    for p in convs:  # all in flight at once, prefilled (no queue); 2 of 9 blocks is under 0.3
        first.append(r.route(p))
        r.first_token(first[-1])
    assert [d.replica for d in first] == [0, 1, 0, 1]
    assert all(d.reason == "least_loaded" for d in first)
    assert [d.cached_blocks for d in first] == [0, 0, 2, 2]
    for d in first:
        r.finished(d)
    for c, p in enumerate(convs):  # the next turn: history + reply + new message
        d = r.route(p + prompt(200 + c, n_prefix=0, tail=8, seed=c))
        assert d.replica == first[c].replica and d.reason == "prefix" and d.cached_blocks == 9
        r.finished(d)
    # with no threshold, the tenant's cached system prompt decides: all go to one replica
    r = Router(2, BS, 1000, cache_threshold=0.0)
    homes = []
    for p in convs:
        homes.append(r.route(p))
        r.first_token(homes[-1])
    assert [d.replica for d in homes[1:]] == [homes[0].replica] * 3
    with pytest.raises(ValueError, match="cache_threshold"):
        Router(2, BS, 1000, cache_threshold=1.5)


def test_a_hot_prefix_spills_over_when_out_of_balance():
    r = Router(2, BS, 1000, balance_abs=2, balance_rel=1.5)
    first = r.route(prompt(7, tail=2, seed=0))
    seen = [first]
    for i in range(1, 12):  # the same system prompt, nobody finishing
        seen.append(r.route(prompt(7, tail=2, seed=i)))
    on_home = sum(d.replica == first.replica for d in seen)
    assert 0 < len(seen) - on_home  # some went elsewhere ...
    spilled = [d for d in seen if d.replica != first.replica]
    assert spilled[0].reason == "balance"
    # ... and never more than the balance allows: in-flight counts stay close
    counts = [s["in_flight"] for s in r.stats()]
    assert abs(counts[0] - counts[1]) <= 3
    # once the other replica holds the prefix too, it is a prefix hit there as well
    assert any(d.reason == "prefix" and d.replica != first.replica for d in spilled)


def test_many_conversations_in_flight_keep_their_replica():
    """Requests of different prefixes in flight on a replica are not one hot prefix: a
    conversation stays where its history is cached until the replica's whole load is out of
    balance (load_abs), where moving it would compute that history again elsewhere."""
    r = Router(2, BS, 1000, balance_abs=2, load_abs=6)
    home = r.route(prompt(50, tail=3, seed=0))
    r.finished(home)
    for i in range(5):  # five other conversations there, decoding
        r.first_token(r.route(prompt(60 + i, tail=2, seed=i), exclude=(1 - home.replica,)))
    state = {i: s["in_flight"] for i, s in enumerate(r.stats())}
    assert state[home.replica] == 5 and state[1 - home.replica] == 0
    again = r.route(prompt(50, tail=6, seed=0))  # its next turn: 5 in flight there, none elsewhere
    assert again.replica == home.replica and again.reason == "prefix"
    for i in range(3):  # past load_abs the load decides
        r.first_token(r.route(prompt(90 + i, tail=2, seed=i), exclude=(1 - home.replica,)))
    moved = r.route(prompt(50, tail=9, seed=0))
    assert moved.replica != home.replica and moved.reason == "balance"
    # the hot-prefix rule counts the requests in flight holding each block: finishing one
    # lowers the counts of its blocks
    r2 = Router(2, BS, 1000, balance_abs=2)
    hot = [r2.route(prompt(7, tail=2, seed=i)) for i in range(3)]
    assert len({d.replica for d in hot}) == 1
    shared, keys = r2.replicas[hot[0].replica].shared, hot[0].keys
    assert [shared[k] for k in keys] == [3, 3, 3, 3]
    r2.finished(hot[0])
    assert [shared[k] for k in keys] == [2, 2, 2, 2]
    r2.set_alive(hot[0].replica, False)
    assert r2.replicas[hot[0].replica].shared == {}


def test_a_shared_system_prompt_is_not_what_holds_a_conversation():
    """The hot-prefix rule counts the requests sharing the deepest prefix a replica holds of
    the prompt: conversations of one tenant in flight share its system prompt, not the
    history that holds this conversation's next turn where it is."""
    r = Router(2, BS, 1000, balance_abs=2)
    turns = [r.route(prompt(5, tail=8, seed=c), exclude=(1,)) for c in range(6)]
    for d in turns[1:]:
        r.first_token(d)
    r.finished(turns[0])  # conversation 0's turn ended; the tenant's 5 others are in flight
    nxt = r.route(prompt(5, tail=8, seed=0) + [7] * 12)
    assert nxt.replica == 0 and nxt.reason == "prefix" and nxt.cached_blocks == 6
    # a new conversation of the tenant is drawn only by the system prompt: that one is hot
    new = r.route(prompt(5, tail=8, seed=99))
    assert new.replica == 1 and new.reason == "balance"


def test_finishing_twice_counts_once():
    r = Router(2, BS, 1000)
    a, b = (r.route(prompt(1, tail=t), exclude=(1,)) for t in (2, 3))
    r.finished(a)
    r.finished(a)
    assert r.stats()[0]["in_flight"] == 1
    assert list(r.replicas[0].shared.values()) == [1, 1, 1, 1]  # b's blocks
    r.finished(b)
    assert r.stats()[0]["in_flight"] == 0 and not r.replicas[0].shared


def test_a_full_kv_cache_is_avoided():
    r = Router(2, BS, 1000)
    d = r.route(prompt(1))
    r.finished(d)
    r.set_kv_usage(d.replica, 0.97)
    again = r.route(prompt(1, tail=4))
    assert again.replica != d.replica and again.reason == "balance"
    r.first_token(again)
    r.set_kv_usage(again.replica, 0.99)  # both full: the cache decides again
    last = r.route(prompt(1, tail=5))
    assert last.replica == again.replica and last.reason == "prefix"  # it holds the longer prefix


def test_a_long_queue_of_prefills_outweighs_a_short_cached_prefix():
    """Prompt tokens routed to a replica and not yet prefilled (no first token) are its queue:
    a request leaves its cached prefix for another replica only when that queue is longer
    than the other's by more than prefix_weight times what the prefix saves; a first token
    (or the end) takes a request's tokens out of the queue, once."""
    r = Router(2, BS, 1000, prefix_weight=4.0)
    home = r.route(prompt(1, n_prefix=16))  # 4 blocks: 16 tokens, saving 64 as weighed
    r.first_token(home)
    other = 1 - home.replica
    cold = [r.route(prompt(50 + i, n_prefix=20, seed=i), exclude=(other,)) for i in range(3)]
    assert r.stats()[home.replica]["pending_prefill_tokens"] == 60  # queued: 60 < 64
    d = r.route(prompt(1, n_prefix=16, tail=2))
    assert d.replica == home.replica and d.reason == "prefix"
    assert r.stats()[home.replica]["pending_prefill_tokens"] == 62  # its own 2 uncached
    cold.append(r.route(prompt(60, n_prefix=20), exclude=(other,)))  # queued: 82 > 64
    moved = r.route(prompt(1, n_prefix=16, tail=3))
    assert moved.replica == other and moved.reason == "balance" and moved.prefill_tokens == 19
    for c in cold:  # the cold prompts are prefilled
        r.first_token(c)
        r.first_token(c)  # (twice: counted once)
    r.finished(d)  # never had a first token: the end takes it out
    assert r.stats()[home.replica]["pending_prefill_tokens"] == 0
    back = r.route(prompt(1, n_prefix=16, tail=4))
    assert back.replica == home.replica and back.reason == "prefix"
    # a replica that dies forgets its queue
    r.set_alive(other, False)
    assert r.stats()[other]["pending_prefill_tokens"] == 0


def test_dead_replicas_get_nothing_and_forget():
    r = Router(3, BS, 1000)
    d = r.route(prompt(2))
    r.finished(d)
    r.set_alive(d.replica, False)
    for i in range(6):
        assert r.route(prompt(2, tail=i)).replica != d.replica
    r.set_alive(d.replica, True)
    assert r.cached_blocks(d.replica, r.keys(prompt(2))) == 0  # a restarted replica is empty
    # a request from before the death that ends now does not lower the new life's count
    late = r.route(prompt(3))
    r.set_alive(late.replica, False)
    r.set_alive(late.replica, True)
    fresh = r.route(prompt(3))
    assert fresh.replica == late.replica
    r.finished(late)
    assert r.stats()[late.replica]["in_flight"] == 1
    r.finished(fresh)
    assert r.stats()[late.replica]["in_flight"] == 0
    for i in range(3):
        r.set_alive(i, False)
    with pytest.raises(RuntimeError, match="no replica"):
        r.route(prompt(2))


def test_memory_is_bounded_by_the_replicas_cache():
    r = Router(1, BS, capacity_blocks=8)
    for p in range(10):
        r.route(prompt(p))  # 4 blocks each
    assert r.stats()[0]["remembered_blocks"] == 8
    assert r.cached_blocks(0, r.keys(prompt(9))) == 4   # the newest kept
    assert r.cached_blocks(0, r.keys(prompt(0))) == 0   # the oldest gone


def test_round_robin_and_least_loaded():
    rr = Router(3, BS, 100, policy="round_robin")
    assert [rr.route(prompt(1)).replica for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    rr.set_alive(1, False)
    assert [rr.route(prompt(1)).replica for _ in range(4)] == [0, 2, 0, 2]
    ll = Router(3, BS, 100, policy="least_loaded")
    first, second = ll.route(prompt(1)), ll.route(prompt(1))
    a = first.replica
    assert a != second.replica  # the same prompt, but the loads differ
    ll.finished(first)
    assert ll.route(prompt(5)).replica == a
    with pytest.raises(ValueError, match="routing policy"):
        Router(2, BS, 100, policy="random")


def test_hit_rates_per_replica():
    r = Router(2, BS, 100)
    d = r.route(prompt(1, tail=2))
    r.finished(d, num_cached_tokens=12)
    s = r.stats()[d.replica]
    assert s["routed"] == 1 and s["prompt_tokens"] == 18 and s["cached_tokens"] == 12


def chat_chains(seed: int) -> list:
    """12 conversations of 4 turns: 64 new tokens a turn, an 8-token reply after each."""
    rng = random.Random(seed)
    chains = []
    for c in range(12):
        history, chain = [], []
        for _ in range(4):
            history = history + [rng.randrange(1, 50_000) for _ in range(64)]
            chain.append((list(history), 8))
            history = history + [rng.randrange(1, 50_000) for _ in range(8)]
        chains.append(chain)
    return chains


def ideal_hits(chains) -> float:
    """Turn t's prompt starts with turn t - 1's, whose full blocks a cache can hold (the reply
    after it is the trace's, not what the replica generated)."""
    prompts = [[len(p) for p, _ in chain] for chain in chains]
    return sum(n // 16 * 16 for lens in prompts for n in lens[:-1]) / sum(map(sum, prompts))


def test_simulated_replicas_over_a_chat_trace():
    """benchmarks/route_sim.py: the router and the engine's prefix cache on simulated
    replicas. Conversations re-sending their history find it cached when routed by prefix
    and only sometimes in turn; one replica whose cache holds every history finds it all."""
    from benchmarks.route_sim import simulate
    chains = chat_chains(0)
    runs = {p: simulate(chains, 2, p, cache_blocks=4096, concurrency=4, think_time=1.0)
            for p in ("prefix", "round_robin")}
    assert all(r["requests"] == 48 for r in runs.values())
    assert runs["prefix"]["cached_token_fraction"] == pytest.approx(ideal_hits(chains), abs=0.02)
    assert runs["round_robin"]["cached_token_fraction"] < 0.8 * runs["prefix"]["cached_token_fraction"]
    one = simulate(chains, 1, "prefix", cache_blocks=4096, concurrency=4, think_time=1.0)
    assert one["cached_token_fraction"] == pytest.approx(runs["prefix"]["cached_token_fraction"], abs=0.02)
    with pytest.raises(ValueError, match="does not fit"):
        simulate([[([1] * 200, 4)]], 1, "prefix", cache_blocks=8)


def test_simulated_replicas_with_few_conversations_open():
    """route_sim's max_active: conversations open a few at a time, so a cache that holds a
    few histories finds nearly all of them, where all conversations open at once cycle
    through more histories than it holds and LRU evicts each before its next turn."""
    from benchmarks.route_sim import simulate
    chains = chat_chains(1)
    ideal = ideal_hits(chains)
    few = simulate(chains, 1, "prefix", cache_blocks=64, concurrency=2, think_time=0.0, max_active=2)
    every = simulate(chains, 1, "prefix", cache_blocks=64, concurrency=2, think_time=0.0)
    assert few["requests"] == every["requests"] == 48
    assert few["cached_token_fraction"] == pytest.approx(ideal, abs=0.02)
    assert every["cached_token_fraction"] < 0.5 * ideal
    with pytest.raises(ValueError, match="max_active"):
        simulate(chains, 1, "prefix", cache_blocks=64, max_active=0)
