"""Which replica serves a request (plain Python: it runs no JAX).

`prefix` (the default) sends a request where its prompt's longest prefix is likely cached:
the router keys the prompt's full blocks as the prefix cache does (core.kv_cache_manager's
block_key, chained, with the cache salt and adapter in the first key) and remembers, per
replica, the keys of the prompts it sent there, least recently used first out, at most as
many as the replica's KV cache holds. Its picture is approximate (a replica may have evicted
a block since), which is the price of not asking the replicas at every request.

A prefix only counts when it is a good part of the prompt (`cache_threshold` of its full
blocks, as SGLang's cache-aware router does): a prompt that shares little more than a short
system prompt with any replica goes where the load is least, so that a tenant's new
conversations spread over the replicas instead of all following the one that first cached
its system prompt (which the others then cache too, at the cost of one short prefill).

Load comes first when it is uneven: a replica gets no new request, however much of the
prompt it holds, when a hot prefix makes it busy: it has well more requests in flight than
the least loaded replica (`balance_abs`), and well more of them share the prefix it holds of
this prompt, so that one hot prefix cannot swamp its replica (the others then start caching
it too). Requests of many conversations on one replica are the luck of the draw, and moving
one computes its whole history again elsewhere: only a much wider gap in all requests in
flight (`load_abs`) passes over such a replica. Nor does one whose KV cache is nearly full
get new requests while another's is not.

Among replicas within the balance, a request goes where the prompt tokens still to prefill
(those queued ahead of it: routed there but without a first token yet) are fewest, less what
its cached prefix saves there, each saved token weighing `prefix_weight` queued ones. A
cached prefix thus wins unless its replica's queue of prefills is much longer than the
others'. Ties go to the longer prefix, then to the fewest requests in flight, then to the
replica remembering the fewest blocks, which spreads new conversations (and so the caches)
over the replicas.

`round_robin` and `least_loaded` ignore the caches.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from jaxllm.core.kv_cache_manager import block_key

from jaxllm.config import ROUTING_POLICIES as POLICIES


@dataclass
class Decision:
    replica: int
    reason: str               # "prefix", "balance", "least_loaded", "round_robin"
    cached_blocks: int        # blocks of the prompt the router believes the replica holds
    prompt_blocks: int
    life: int = 0             # which life of the replica it went to (see Router.finished)
    cached_tokens: int = 0    # cached_blocks in tokens
    prefill_tokens: int = 0   # its prompt tokens to prefill, as the router reckons them,
                              # counted in its replica's queue until its first token
    keys: list = field(default=None, repr=False)  # its prompt's block keys (see _Replica.shared)
    ended: bool = False       # finished() has counted it out


@dataclass
class _Replica:
    alive: bool = True
    life: int = 0             # bumped when the replica dies: its old requests count no more
    in_flight: int = 0
    shared: dict = field(default_factory=dict)  # block key -> requests in flight holding it
    pending_prefill: int = 0  # prompt tokens routed here whose first token has not come
    kv_usage: float = 0.0
    capacity: int = 0                                  # blocks remembered, at most
    keys: OrderedDict = field(default_factory=OrderedDict)  # block key -> None, LRU first
    routed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0    # as the replica reported them when its requests finished


class Router:
    def __init__(self, num_replicas: int, block_size: int, capacity_blocks: int,
                 policy: str = "prefix", balance_abs: int = 4, balance_rel: float = 1.5,
                 kv_high: float = 0.9, cache_threshold: float = 0.3, prefix_weight: float = 4.0,
                 load_abs: int = 16):
        """capacity_blocks: each replica's KV-cache blocks (what the router remembers per
        replica). A replica is out of balance when both its requests in flight and those of
        them sharing the prefix it holds of the prompt exceed the least loaded replica's by
        more than `balance_abs` and `balance_rel` times; when all its requests in flight do by
        more than `load_abs` and `balance_rel` times; or when its KV cache is above `kv_high`
        while another's is not. A replica's cached prefix counts when it covers at least
        `cache_threshold` of the prompt's full blocks; each of its tokens weighs
        `prefix_weight` queued prefill tokens (see _by_prefix)."""
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        self.policy, self.block_size = policy, block_size
        if balance_abs < 0 or load_abs < 0:
            raise ValueError(f"balance_abs and load_abs must be at least 0, got {balance_abs}, {load_abs}")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be within [0, 1], got {cache_threshold}")
        self.balance_abs, self.balance_rel, self.kv_high = balance_abs, balance_rel, kv_high
        self.load_abs = load_abs
        self.cache_threshold = cache_threshold
        self.prefix_weight = prefix_weight
        self.replicas = [_Replica(capacity=capacity_blocks) for _ in range(num_replicas)]
        self._next = 0

    # the picture of the replicas
    def keys(self, token_ids: list[int], extra=None) -> list:
        """The prompt's full blocks as the prefix cache keys them."""
        out, bs = [], self.block_size
        for i in range(len(token_ids) // bs):
            out.append(block_key(out[-1] if out else None, tuple(token_ids[i * bs:(i + 1) * bs]),
                                 extra if i == 0 else None))
        return out

    def cached_blocks(self, replica: int, keys: list) -> int:
        held = self.replicas[replica].keys
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        return n

    def set_kv_usage(self, replica: int, usage: float) -> None:
        self.replicas[replica].kv_usage = usage

    def set_alive(self, replica: int, alive: bool) -> None:
        """A replica that died forgets everything (its restart has an empty cache)."""
        r = self.replicas[replica]
        if not alive and r.alive:
            r.keys.clear()
            r.in_flight = 0
            r.shared.clear()
            r.pending_prefill = 0
            r.kv_usage = 0.0
            r.life += 1
        r.alive = alive

    # routing
    def route(self, token_ids: list[int], extra=None, exclude=()) -> Decision:
        """exclude: replicas not to pick (those a request already failed on)."""
        live = [i for i, r in enumerate(self.replicas) if r.alive and i not in exclude]
        if not live:
            raise RuntimeError("no replica is alive")
        keys = self.keys(token_ids, extra)
        if self.policy == "round_robin":
            n = len(self.replicas)
            i = next(j % n for j in range(self._next, self._next + n) if j % n in live)
            self._next = i + 1
            decision = Decision(i, "round_robin", self.cached_blocks(i, keys), len(keys))
        elif self.policy == "least_loaded":
            i = min(live, key=self._load)
            decision = Decision(i, "least_loaded", self.cached_blocks(i, keys), len(keys))
        else:
            decision = self._by_prefix(live, keys)
        decision.keys = keys
        decision.cached_tokens = decision.cached_blocks * self.block_size
        decision.prefill_tokens = len(token_ids) - decision.cached_tokens
        self._routed(decision, keys, len(token_ids))
        decision.life = self.replicas[decision.replica].life
        return decision

    def _load(self, i: int) -> tuple:
        r = self.replicas[i]
        return (r.kv_usage > self.kv_high, r.in_flight, r.kv_usage, i)

    def _over(self, n: int, least: int, by: int) -> bool:
        return n - least > by and n > self.balance_rel * max(least, 1)

    def _balanced(self, live: list[int], keys: list, cached: dict) -> list[int]:
        """The replicas not out of balance against the least loaded one."""
        least = min(self.replicas[i].in_flight for i in live)
        roomy = [i for i in live if self.replicas[i].kv_usage <= self.kv_high]
        out = []
        for i in live:
            r = self.replicas[i]
            if self._over(r.in_flight, least, self.load_abs):
                continue
            # busier than the least loaded one, and because of the prefix that draws the
            # request here (the requests sharing it are too)?
            if cached[i] and self._over(r.in_flight, least, self.balance_abs):
                k = keys[cached[i] - 1]
                if self._over(r.shared.get(k, 0), min(self.replicas[j].shared.get(k, 0) for j in live),
                              self.balance_abs):
                    continue
            if r.kv_usage > self.kv_high and roomy:
                continue
            out.append(i)
        return out or [min(live, key=self._load)]

    def _by_prefix(self, live: list[int], keys: list) -> Decision:
        cached = {i: self.cached_blocks(i, keys) for i in live}
        within = self._balanced(live, keys, cached)
        enough = lambda n: n > 0 and n >= self.cache_threshold * len(keys)  # noqa: E731
        # too little of the prompt cached counts as none: the queues alone decide
        saved = {i: cached[i] * self.block_size if enough(cached[i]) else 0 for i in within}
        # A cached token saves its replica one token of prefill, and leaving it means computing
        # it again where everyone queued behind waits for it too: so it outweighs a queued
        # token (the weight was chosen on the router's simulation: docs/replicas.md).

        def first_token_cost(i: int) -> tuple:
            r = self.replicas[i]
            return (r.pending_prefill - self.prefix_weight * saved[i], -saved[i],
                    r.kv_usage > self.kv_high, r.in_flight, len(r.keys), i)
        best = min(within, key=first_token_cost)
        # a longer prefix held by a busier replica is passed over on purpose
        most = max(cached.values())
        reason = ("least_loaded" if not enough(most) else
                  "balance" if cached[best] < most else "prefix")
        return Decision(best, reason, cached[best], len(keys))

    def _routed(self, decision: Decision, keys: list, num_tokens: int) -> None:
        r = self.replicas[decision.replica]
        r.in_flight += 1
        for k in keys:
            r.shared[k] = r.shared.get(k, 0) + 1
        r.pending_prefill += decision.prefill_tokens
        r.routed += 1
        r.prompt_tokens += num_tokens
        for k in keys:
            r.keys[k] = None
            r.keys.move_to_end(k)
        while len(r.keys) > r.capacity:
            r.keys.popitem(last=False)

    def first_token(self, decision: Decision) -> None:
        """The request routed by `decision` has its first token: its prompt is prefilled and
        leaves its replica's queue of prefills (once; finished() does it too if this was not
        called)."""
        r = self.replicas[decision.replica]
        if decision.life == r.life and decision.prefill_tokens:
            r.pending_prefill = max(r.pending_prefill - decision.prefill_tokens, 0)
        decision.prefill_tokens = 0

    def finished(self, decision: Decision, num_cached_tokens: int = 0) -> None:
        """The request routed by `decision` ended (num_cached_tokens: its prompt tokens the
        replica found in its prefix cache, for the per-replica hit rate). One that went to a
        replica's earlier life, before it died, counts no more."""
        self.first_token(decision)
        r = self.replicas[decision.replica]
        if decision.life != r.life or decision.ended:
            return
        decision.ended = True
        r.in_flight = max(r.in_flight - 1, 0)
        for k in decision.keys or ():
            n = r.shared.get(k, 0) - 1
            if n > 0:
                r.shared[k] = n
            else:
                r.shared.pop(k, None)
        r.cached_tokens += max(num_cached_tokens, 0)

    def stats(self) -> list[dict]:
        return [{"alive": r.alive, "in_flight": r.in_flight,
                 "pending_prefill_tokens": r.pending_prefill, "kv_usage": r.kv_usage,
                 "routed": r.routed, "prompt_tokens": r.prompt_tokens,
                 "cached_tokens": r.cached_tokens, "remembered_blocks": len(r.keys)}
                for r in self.replicas]
