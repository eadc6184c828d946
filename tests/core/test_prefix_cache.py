"""core/ alone: prefix caching, forks with copy-on-write, priority and swap preemption, and the
block invariants under random workloads (hypothesis), checked against a simulated cache."""
import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxllm.core.block_pool import NULL_BLOCK
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.scheduler import Scheduler
from jaxllm.sampling_params import SamplingParams


class FakeRunner:
    """Plays the device: writes each scheduled token id into its slot, performs the block
    moves, and checks that every position a request attends to holds that request's token."""

    def __init__(self, sched: Scheduler, seed: int = 0):
        self.sched = sched
        self.kv = sched.kv
        self.bs = sched.kv.block_size
        self.cache = {}   # device block -> [token or None] * bs
        self.host = {}
        self.rng = random.Random(seed)

    def execute(self, out):
        for dev, host in out.blocks_to_swap_out:
            self.host[host] = list(self.cache.get(dev, [None] * self.bs))
        for host, dev in out.blocks_to_swap_in:
            self.cache[dev] = list(self.host[host])
        for src, dst in out.blocks_to_copy:
            self.cache[dst] = list(self.cache.get(src, [None] * self.bs))
        # where each request's tokens start: what the scheduler tells the runner
        starts = {d.req_id: d.num_computed_tokens
                  for d in out.scheduled_new_reqs + out.scheduled_cached_reqs}
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            blocks = self.kv.req_to_blocks[rid]
            assert NULL_BLOCK not in blocks
            assert starts[rid] + n == req.num_computed_tokens  # the scheduler advanced it
            for pos in range(starts[rid], starts[rid] + n):
                self.cache.setdefault(blocks[pos // self.bs], [None] * self.bs)[pos % self.bs] = \
                    req.all_token_ids[pos]
        for rid, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            blocks = self.kv.req_to_blocks[rid]
            for pos in range(starts[rid] + n):
                got = self.cache[blocks[pos // self.bs]][pos % self.bs]
                assert got == req.all_token_ids[pos], f"{rid} reads a wrong token at {pos}"
        return {rid: [self.rng.randrange(3, 12)] for rid in out.sampling_req_ids}

    def step(self):
        out = self.sched.schedule()
        return out, self.sched.update_from_output(out, self.execute(out))


def check_invariants(sched: Scheduler, runner: FakeRunner | None = None):
    kv, pool = sched.kv, sched.kv.pool
    holders = [0] * pool.num_blocks
    for rid, blocks in kv.req_to_blocks.items():
        assert len(set(blocks)) == len(blocks), f"{rid} holds a block twice"
        for b in blocks:
            holders[b] += 1
    for b in kv._hold_device:
        holders[b] += 1
    assert holders == pool.ref_cnt, "reference counts differ from the number of holders"
    free = set(pool._free)
    assert NULL_BLOCK not in free and pool.ref_cnt[NULL_BLOCK] == 0
    assert all(pool.ref_cnt[b] == 0 for b in free)
    used = sum(1 for b in range(1, pool.num_blocks) if pool.ref_cnt[b] > 0)
    assert len(free) + used == pool.num_usable_blocks
    for key, block in pool.cached.items():
        assert pool.block_hash[block] == key
        if runner is not None:
            assert tuple(runner.cache.get(block, ())) == key[1], "a cached block's contents differ from its hash"
    host_held = sum(len(v) for v in kv.req_to_host_blocks.values()) + len(kv._hold_host)
    assert host_held + kv.host_pool.num_free_blocks == kv.host_pool.num_blocks


def make(num_blocks=32, block_size=4, max_num_seqs=8, budget=32, max_model_len=64, caching=True,
         host_blocks=0, **kw):
    kv = KVCacheManager(num_blocks, block_size, caching, host_blocks)
    sched = Scheduler(kv, max_num_seqs, budget, max_model_len, **kw)
    return sched, FakeRunner(sched)


def req(rid, prompt, max_tokens=4, **kw):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=kw.pop("n", 1))
    return Request(rid, prompt, params, eos_token_id=2, seed=0, **kw)


def drain(sched, runner):
    while sched.has_unfinished_requests():
        runner.step()
        check_invariants(sched, runner)


def test_second_request_hits_full_blocks_but_not_the_last_token():
    sched, runner = make()
    a = req("a", list(range(20, 33)))  # 13 tokens: 3 full blocks of 4
    sched.add_request(a)
    runner.step()
    b = req("b", list(range(20, 33)) + [99])
    sched.add_request(b)
    runner.step()
    assert b.num_cached_tokens == 12
    assert sched.kv.req_to_blocks["b"][:3] == sched.kv.req_to_blocks["a"][:3]
    # an identical 12-token prompt keeps its last token out of the cache: 2 blocks hit
    c = req("c", list(range(20, 32)))
    sched.add_request(c)
    runner.step()
    assert c.num_cached_tokens == 8
    drain(sched, runner)
    assert sched.kv.prefix_hits == 20
    assert sched.kv.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_cache_salt_and_disabled_cache_do_not_share():
    sched, runner = make()
    prompt = list(range(30, 47))
    sched.add_request(req("a", prompt, cache_salt="alice"))
    runner.step()
    b = req("b", prompt, cache_salt="bob")
    c = req("c", prompt, cache_salt="alice")
    sched.add_request(b)
    sched.add_request(c)
    runner.step()
    assert b.num_cached_tokens == 0 and c.num_cached_tokens == 16
    sched2, runner2 = make(caching=False)
    sched2.add_request(req("a", prompt))
    runner2.step()
    d = req("d", prompt)
    sched2.add_request(d)
    runner2.step()
    assert d.num_cached_tokens == 0 and not sched2.kv.pool.cached


def test_lru_eviction_keeps_recently_freed_blocks():
    sched, runner = make(num_blocks=9, block_size=4, max_model_len=32)  # 8 usable blocks
    sched.add_request(req("old", list(range(40, 49)), max_tokens=1))
    drain(sched, runner)
    sched.add_request(req("new", list(range(60, 69)), max_tokens=1))
    drain(sched, runner)
    # a 20-token request needs 5 blocks: the 4 never-used ones, then the LRU ("old") block
    sched.add_request(req("big", list(range(100, 120)), max_tokens=1))
    drain(sched, runner)
    again_new = req("n2", list(range(60, 69)) + [5])
    again_old = req("o2", list(range(40, 49)) + [5])
    sched.add_request(again_new)
    sched.add_request(again_old)
    runner.step()
    assert again_new.num_cached_tokens == 8
    assert again_old.num_cached_tokens < 8
    assert sched.kv.pool.num_evictions >= 1


def test_fork_shares_prompt_blocks_and_copies_the_partial_block():
    sched, runner = make(block_size=4)
    prompt = list(range(50, 60))  # 10 tokens: blocks [0-3] [4-7] [8-9 partial]
    leader = req("0_r", prompt, n=3)
    sibs = [req(f"{i}_r", prompt) for i in (1, 2)]
    sched.add_request(leader, sibs)
    out, _ = runner.step()
    assert list(out.num_scheduled_tokens) == ["0_r"]  # siblings wait for the prompt
    out, _ = runner.step()
    # each sibling computes only the last prompt token, into its own copy of the last block
    assert out.num_scheduled_tokens == {"0_r": 1, "1_r": 1, "2_r": 1}
    lead_blocks = sched.kv.req_to_blocks["0_r"]
    for sib in ("1_r", "2_r"):
        blocks = sched.kv.req_to_blocks[sib]
        assert blocks[:2] == lead_blocks[:2] and blocks[2] != lead_blocks[2]
    assert sorted(out.blocks_to_copy) == sorted([(lead_blocks[2], sched.kv.req_to_blocks[s][2])
                                                 for s in ("1_r", "2_r")])
    assert [sched.kv.pool.ref_cnt[b] for b in lead_blocks[:2]] == [3, 3]
    check_invariants(sched, runner)
    drain(sched, runner)
    assert sched.kv.num_free_blocks == sched.kv.pool.num_usable_blocks


def test_priority_orders_waiting_and_picks_victims():
    sched, runner = make(num_blocks=9, block_size=4, max_num_seqs=2, budget=64, max_model_len=32,
                         policy="priority")
    sched.add_request(req("low", list(range(10, 18)), max_tokens=16, priority=5, arrival_time=1.0))
    sched.add_request(req("mid", list(range(20, 28)), max_tokens=16, priority=1, arrival_time=2.0))
    sched.add_request(req("high", list(range(30, 38)), max_tokens=16, priority=0, arrival_time=3.0))
    out, _ = runner.step()
    assert set(out.num_scheduled_tokens) == {"high", "mid"}
    while "low" not in {r.request_id for r in sched.running}:
        runner.step()
        check_invariants(sched, runner)
    sched2, runner2 = make(num_blocks=7, block_size=4, budget=64, max_model_len=24, policy="priority")
    a = req("a", list(range(10, 18)), max_tokens=12, priority=0, arrival_time=2.0)
    b = req("b", list(range(20, 28)), max_tokens=12, priority=9, arrival_time=1.0)
    c = req("c", list(range(30, 38)), max_tokens=12, priority=3, arrival_time=3.0)
    for r in (a, b, c):
        sched2.add_request(r)
    runner2.step()
    runner2.step()
    # blocks ran out: the lowest priority (b, despite arriving first) yields
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert a.num_preemptions == 0
    drain(sched2, runner2)


def test_swap_preemption_and_fallback_to_recompute():
    sched, runner = make(num_blocks=7, block_size=4, budget=64, max_model_len=24, host_blocks=16,
                         preemption_mode="swap")
    reqs = [req(x, list(range(10 * i + 10, 10 * i + 18)), max_tokens=12) for i, x in enumerate("abc")]
    for r in reqs:
        sched.add_request(r)
    swapped = False
    while sched.has_unfinished_requests():
        out, _ = runner.step()
        swapped |= bool(out.blocks_to_swap_out)
        check_invariants(sched, runner)
    assert swapped and sched.num_swaps > 0
    assert all(r.num_output_tokens == 12 for r in reqs)
    # a swap space of one block cannot hold a request: recompute instead
    sched, runner = make(num_blocks=7, block_size=4, budget=64, max_model_len=24, host_blocks=1,
                         preemption_mode="swap")
    for i, x in enumerate("abc"):
        sched.add_request(req(x, list(range(10 * i + 10, 10 * i + 18)), max_tokens=12))
    drain(sched, runner)
    assert sched.num_swaps == 0 and sched.num_preemptions > 0


def test_aborted_sibling_drops_its_pending_copy():
    """A fork queues a block copy for the next step; if the sibling is aborted first, the copy
    must not land in its (freed, possibly reused) block — e.g. one a swap-in refills."""
    sched, runner = make(num_blocks=7, block_size=4, budget=8, max_model_len=24, host_blocks=16,
                         policy="priority", preemption_mode="swap")
    r = req("r", list(range(10, 18)), max_tokens=12, priority=1)
    sched.add_request(r)
    runner.step()
    prompt = list(range(30, 45))  # 15 tokens, chunked over the 8-token budget
    lead, sib = req("0_l", prompt, max_tokens=4, n=2), req("1_l", prompt, max_tokens=4)
    sched.add_request(lead, [sib])
    for _ in range(6):
        runner.step()
        check_invariants(sched, runner)
        if sched._pending_copies:
            break
    assert sched._pending_copies, "the scenario needs a pending fork copy"
    sched.finish_requests(["0_l", "1_l"], RequestStatus.FINISHED_ABORTED)
    assert not sched._pending_copies
    drain(sched, runner)  # FakeRunner checks every position r reads holds r's own token
    assert r.num_output_tokens == 12
    assert sched.kv.num_free_blocks == sched.kv.pool.num_usable_blocks


class RandomWorkload(RuleBasedStateMachine):
    """Random arrivals (with shared prefixes), forks, aborts and memory pressure."""

    @initialize(mode=st.sampled_from(["recompute", "swap"]), policy=st.sampled_from(["fcfs", "priority"]),
                num_blocks=st.integers(9, 40), block_size=st.sampled_from([2, 4]),
                caching=st.booleans(), seed=st.integers(0, 1000))
    def setup(self, mode, policy, num_blocks, block_size, caching, seed):
        max_len = min(32, (num_blocks - 1) * block_size)
        self.sched, self.runner = make(num_blocks=num_blocks, block_size=block_size, budget=24,
                                       max_model_len=max_len, caching=caching,
                                       host_blocks=20 if mode == "swap" else 0,
                                       preemption_mode=mode, policy=policy)
        self.runner.rng.seed(seed)
        self.prefixes = [[7, 8, 9, 10, 11, 12], [7, 8, 9, 10, 3, 3], [4] * 9]
        self.count = 0
        self.max_len = max_len

    @rule(prefix=st.integers(0, 2), tail=st.lists(st.integers(3, 12), max_size=6),
          max_tokens=st.integers(1, 8), n=st.integers(1, 3), priority=st.integers(0, 3))
    def add(self, prefix, tail, max_tokens, n, priority):
        prompt = (self.prefixes[prefix] + tail)[: self.max_len - max_tokens]
        if not prompt:
            return
        self.count += 1
        rid = f"r{self.count}"
        if self.sched.policy != "priority":
            priority = 0
        reqs = [req(f"{i}_{rid}", prompt, max_tokens, priority=priority) for i in range(n)]
        self.sched.add_request(reqs[0], reqs[1:])

    @rule()
    def step(self):
        self.runner.step()

    @rule(data=st.data())
    def abort(self, data):
        ids = sorted(self.sched.requests)
        if ids:
            rid = data.draw(st.sampled_from(ids))
            self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    @rule(data=st.data())
    def abort_group(self, data):
        """As the engine aborts: a request with all its parallel-sampling siblings."""
        groups = sorted({rid.split("_", 1)[1] for rid in self.sched.requests})
        if groups:
            g = data.draw(st.sampled_from(groups))
            ids = [rid for rid in self.sched.requests if rid.split("_", 1)[1] == g]
            self.sched.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    @invariant()
    def blocks_consistent(self):
        if hasattr(self, "sched"):
            check_invariants(self.sched, self.runner)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(500):
            if not self.sched.has_unfinished_requests():
                break
            self.runner.step()
            check_invariants(self.sched, self.runner)
        assert not self.sched.has_unfinished_requests()
        self.runner.step()  # releases the holds of the last step's copies
        kv = self.sched.kv
        assert kv.num_free_blocks == kv.pool.num_usable_blocks, "blocks leaked"
        assert kv.host_pool.num_free_blocks == kv.host_pool.num_blocks


TestRandomWorkload = RandomWorkload.TestCase
TestRandomWorkload.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])

