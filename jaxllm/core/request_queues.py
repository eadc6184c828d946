"""Where each request is: the registry of live requests, the waiting queue (in arrival or
priority order), the running list, and n > 1 siblings held until their leader has computed
the prompt. Requests end here (finished, aborted, failed), their blocks go back, and the ids
the runner must drop are collected for the next step. The Scheduler builds its steps on
these queues."""
from __future__ import annotations

import bisect
from collections import deque

from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request, RequestStatus

POLICIES = ("fcfs", "priority")


class RequestQueues:
    def __init__(self, kv_cache_manager: KVCacheManager, policy: str = "fcfs", max_loras: int = 0):
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {policy!r}")
        self.kv = kv_cache_manager
        self.policy = policy
        # distinct LoRA adapters among running requests (so in any step); 0: LoRA is off
        self.max_loras = max_loras
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._held: dict[str, Request] = {}  # n > 1 siblings waiting for their leader's prompt
        self._finished_ids: set[str] = set()  # for the next step's output: the runner drops them
        self._num_needing_host_tokens = 0  # live requests with Request.needs_host_tokens
        # forks' copy-on-write block copies for the next step: request id -> (src, dst)
        self._pending_copies: dict[str, tuple[int, int]] = {}
        self.num_preemptions = 0

    def _order(self, req: Request):
        return (req.priority, req.arrival_time) if self.policy == "priority" else (req.arrival_time,)

    # queue management
    def add_request(self, request: Request, siblings: list[Request] = ()) -> None:
        """Queue a request. `siblings` (parallel sampling) share its prompt: they start once
        it has computed the prompt, from its blocks."""
        for req in (request, *siblings):
            if req.request_id in self.requests:
                raise ValueError(f"request_id {req.request_id!r} is already in use")
            if req.lora_id and not self.max_loras:
                raise ValueError("a request with a LoRA adapter needs max_loras >= 1")
        self.requests[request.request_id] = request
        for sib in siblings:
            self.requests[sib.request_id] = sib
            self._held[sib.request_id] = sib
        self._num_needing_host_tokens += sum(r.needs_host_tokens for r in (request, *siblings))
        request.forks = list(siblings)
        self._enqueue(request)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if self.policy == "priority":
            keys = [self._order(r) for r in self.waiting]
            self.waiting.insert(bisect.bisect_right(keys, self._order(request)), request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def finish_request(self, request: Request, status: RequestStatus,
                       stop_reason: int | str | None = None, num_dropped_tokens: int = 0) -> None:
        """End a request from outside the step's own stop checks (a stop string, a grammar,
        an abort): the one way its status and stop reason change there. `num_dropped_tokens`:
        its last output tokens are taken back (a stop string ended the text before them).
        A request already finished takes the new status (a stop string or a grammar found
        complete on the token that hit a length limit: the stop wins); one the scheduler
        never held (its grammar failed to compile) is only marked."""
        request.drop_last_output_tokens(num_dropped_tokens)
        if stop_reason is not None:
            request.stop_reason = stop_reason
        if not request.status.finished and self.requests.get(request.request_id) is request:
            self._finish(request, status)
        else:
            request.status = status

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        """End the live requests among `request_ids` (unknown or finished ones are skipped)."""
        finished = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            self._finish(req, status)
            finished.append(req)
        return finished

    def fail_requests(self, request_ids, error: str) -> list[Request]:
        """End the live requests among `request_ids` because their step failed: their blocks
        leave the prefix cache (the step was to write them) and return to the pool."""
        failed = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            self.kv.pool.forget(self.kv.get_blocks(rid))
            req.error = error
            self._finish(req, RequestStatus.FINISHED_ERROR)
            failed.append(req)
        self.kv.end_step()  # the failed step's block copies are moot
        return failed

    def recompute_running(self) -> None:
        """The device lost the KV cache: every running request computes its tokens again,
        and nothing cached before is found any more."""
        for req in reversed(list(self.running)):  # to the queue's front, in their order
            self.running.remove(req)
            self.kv.free(req)
            req.spec_token_ids = []
            req.num_preemptions += 1
            self.num_preemptions += 1
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            req.num_output_placeholders = 0
            self._finished_ids.add(req.request_id)  # the runner drops its row
            self._enqueue(req, front=True)
        self.kv.pool.forget_all()

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Take the request out of whichever queue holds it, and free it."""
        if req.request_id in self._held:
            del self._held[req.request_id]
        elif req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._free(req, status)

    def _drop_copy(self, req: Request) -> None:
        """A sibling gives its blocks back before its pending copy ran: the copy must not
        write into a block that may belong to someone else by then."""
        copy = self._pending_copies.pop(req.request_id, None)
        if copy is not None:
            self.kv.release_copy_source(copy[0])

    def _release_forks(self, req: Request) -> None:
        """Siblings still waiting for this request's prompt blocks compute the prompt
        themselves."""
        for sib in req.forks:
            if self._held.pop(sib.request_id, None) is not None:
                self._enqueue(sib, front=True)
        req.forks = []

    def _free(self, req: Request, status: RequestStatus) -> None:
        self._drop_copy(req)
        self._release_forks(req)
        req.status = status
        self.kv.free(req)
        del self.requests[req.request_id]
        self._finished_ids.add(req.request_id)
        self._num_needing_host_tokens -= req.needs_host_tokens

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._held)

    @property
    def needs_host_tokens(self) -> bool:
        """A live request samples from tokens the host must know first (multi-token bad
        words): no step may be scheduled before the previous one is read."""
        return self._num_needing_host_tokens > 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._held)

    @property
    def num_running(self) -> int:
        return len(self.running)
