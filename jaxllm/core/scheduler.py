"""One token budget per step; no prefill phase and no decode phase.

Each request has `num_computed_tokens` and `num_tokens`; every step hands tokens out so that
requests catch up. Chunked prefill (a prompt larger than the budget), decode (one new token)
and resumption after preemption all fall out of the same loop.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from jaxllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has no state for: sent in full once."""
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: "SamplingParams"
    seed: int


@dataclass
class CachedRequestData:
    """A request the runner already holds: only the diff."""
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # requests whose runner-side state must be dropped (finished, aborted or preempted)
    finished_req_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class RequestUpdate:
    request: Request
    new_token_ids: list[int]


class Scheduler:
    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int):
        capacity = kv_cache_manager.pool.num_usable_blocks * kv_cache_manager.block_size
        if capacity < max_model_len:
            # otherwise a lone request could outgrow the pool and wait for blocks forever
            raise ValueError(f"the KV cache holds {capacity} tokens, fewer than max_model_len "
                             f"({max_model_len}); raise the KV-cache memory or lower max_model_len")
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()
        self._known_to_runner: set[str] = set()
        self.num_preemptions = 0

    # queue management
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        finished = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._free(req, status)
            finished.append(req)
        return finished

    def _free(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req)
        del self.requests[req.request_id]
        self._finished_ids.add(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # one step
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        preempted: list[Request] = []

        # running requests first, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while True:
                blocks = self.kv.allocate_slots(req, num_new)
                if blocks is not None:
                    break
                # Out of blocks: the newest running request yields and is recomputed later.
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                num_scheduled.pop(victim.request_id, None)
                if victim is req:
                    break
            if blocks is None:
                break
            num_scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = blocks
            budget -= num_new
            i += 1

        # then waiting requests, in arrival order, unless this step already had to preempt
        while (self.waiting and not preempted and budget > 0
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            blocks = self.kv.allocate_slots(req, num_new)
            if blocks is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = blocks
            budget -= num_new

        new_reqs, cached_reqs = [], []
        for req in self.running:
            rid = req.request_id
            if rid not in num_scheduled:
                continue
            if rid in self._known_to_runner:
                cached_reqs.append(CachedRequestData(rid, new_blocks[rid], req.num_computed_tokens))
            else:
                self._known_to_runner.add(rid)
                new_reqs.append(NewRequestData(
                    rid, list(req.all_token_ids), req.num_prompt_tokens,
                    list(self.kv.get_blocks(rid)), req.num_computed_tokens,
                    req.sampling_params, req.seed))
        finished = self._finished_ids | {r.request_id for r in preempted}
        self._known_to_runner -= finished
        self._finished_ids = set()
        return SchedulerOutput(new_reqs, cached_reqs, num_scheduled,
                               sum(num_scheduled.values()), finished)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(self, out: SchedulerOutput,
                           sampled: dict[str, int]) -> list[RequestUpdate]:
        """Advance computed counts, append sampled tokens, finish on EOS / stop ids / length."""
        updates = []
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None:  # aborted while the step ran
                continue
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk: its sampled token is not the next one
            token = sampled[rid]
            req.append_output_token(token)
            updates.append(RequestUpdate(req, [token]))
            status = self._check_stop(req, token)
            if status is not None:
                self.running.remove(req)
                self._free(req, status)
        return updates

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_output_tokens < params.min_tokens:
            return None
        if not params.ignore_eos and token == req.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        return None
