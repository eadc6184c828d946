"""One token budget per step; no prefill phase and no decode phase.

Each request has `num_computed_tokens` and `num_tokens`; every step hands tokens out so that
requests catch up. Chunked prefill (a prompt larger than the budget), prefix-cache hits,
decode (one new token) and resumption after preemption all fall out of the same loop.

The counts are advanced here, when a step is scheduled. A step whose tokens reach the end of a
request samples its next token; until the host learns it (async scheduling: one step later)
the token is a placeholder, and the next step may already compute it (the runner takes its id
from the device). update_from_output() appends the tokens the step produced, 0..k of them.

Speculative decoding: a running request's proposed tokens (`spec_token_ids`) are scheduled
after its known tokens, from the same budget; the step verifies them and emits the accepted
ones plus one more. The counts advance over all of them when scheduled, and the rejected ones
are taken back when the step's output arrives (their KV slots are simply written again).

Multi-step scheduling (`num_scheduler_steps` = k > 1, vLLM V0's): while every running request
decodes and no waiting request could join, a step runs up to k passes on the device, each
computing one token per request and sampling the next pass's token there. A request is
scheduled min(k, what its length limits allow) tokens, of which only the first is known; the
rest are its own placeholders, and the step emits one token per pass. A stop in the middle
drops the tokens after it, as for speculative decoding.

Which request is where (waiting, running, held siblings) and how requests end is kept by
RequestQueues (request_queues.py), which the Scheduler extends.
"""
from __future__ import annotations

from jaxllm.core.kv_cache_manager import KVCacheManager, cdiv
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.request_queues import RequestQueues
from jaxllm.core.scheduler_output import (CachedRequestData, NewRequestData, RequestUpdate,
                                          SchedulerOutput)
from jaxllm.core.stops import check_stop, none_stop

PREEMPTION_MODES = ("recompute", "swap")


class Scheduler(RequestQueues):
    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, policy: str = "fcfs",
                 preemption_mode: str = "recompute", max_loras: int = 0,
                 num_lookahead_tokens: int = 0, num_spec_tokens: int = 0,
                 num_scheduler_steps: int = 1, max_num_batched_tokens_while_decoding: int = 0):
        capacity = kv_cache_manager.pool.num_usable_blocks * kv_cache_manager.block_size
        if capacity < max_model_len:
            # otherwise a lone request could outgrow the pool and wait for blocks forever
            raise ValueError(f"the KV cache holds {capacity} tokens, fewer than max_model_len "
                             f"({max_model_len}); raise the KV-cache memory or lower max_model_len")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        super().__init__(kv_cache_manager, policy, max_loras)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.preemption_mode = preemption_mode
        self._known_to_runner: set[str] = set()
        self.num_swaps = 0
        self.num_prompt_tokens = 0  # prompt tokens scheduled (prefix-cache hits excluded)
        self.num_generation_tokens = 0  # output tokens appended
        # speculative decoding: slots held past each running request's tokens for a draft
        # model's proposals, and vLLM's acceptance counters
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * num_spec_tokens
        self.num_scheduler_steps = num_scheduler_steps
        # the tokens of a step in which requests decode (prompts get what the decodes leave),
        # so their inter-token latency stays near a decode step's (0: max_num_batched_tokens)
        self.max_num_batched_tokens_while_decoding = max_num_batched_tokens_while_decoding

    # one step
    def _tokens_left(self, req: Request) -> int:
        """Tokens its length limits still allow beyond those known or in flight."""
        n = len(req.all_token_ids) + req.num_output_placeholders  # (no properties: hot)
        left = self.max_model_len - n
        limit = req.sampling_params.max_tokens
        if limit is not None and limit - n + len(req.prompt_token_ids) < left:
            left = limit - n + len(req.prompt_token_ids)
        return left

    def _passes(self) -> int:
        """Passes of the next step: num_scheduler_steps while every running request decodes
        one known token and samples on the device alone, and no waiting request could join
        (arrivals and prefills take single steps); otherwise 1."""
        k = self.num_scheduler_steps
        if k <= 1 or not self.running or self._could_admit():
            return 1
        for req in self.running:
            if (len(req.all_token_ids) + req.num_output_placeholders - req.num_computed_tokens != 1
                    or req.grammar is not None or req.spec_token_ids
                    or req.needs_host_tokens):
                return 1
        return k

    def _could_admit(self) -> bool:
        """The waiting queue's head may join now: a seat is free and its tokens would fit in
        the free blocks (without counting prefix hits: under memory pressure running requests
        keep their multi-step calls until blocks are freed)."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        head = self.waiting[0]
        return cdiv(head.num_tokens + 1, self.kv.block_size) <= self.kv.num_free_blocks

    def _prefill_budget(self) -> int:
        """Prompt tokens (prefill chunks, recomputation) this step may carry. While requests
        decode, the step holds max(max_num_batched_tokens_while_decoding, 4 x their tokens):
        prompts get what the decodes leave, and at least three tokens per decode, so that
        under many streams arrivals still keep up with departures."""
        cap = self.max_num_batched_tokens_while_decoding
        decode = 0
        if cap:
            for r in self.running:
                if r.num_tokens_with_placeholders - r.num_computed_tokens == 1:
                    decode += 1 + len(r.spec_token_ids)
        return max(cap, 4 * decode) - decode if decode else self.max_num_batched_tokens

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        passes = self._passes()
        prefill = self._prefill_budget() if passes == 1 else budget
        num_scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        preempted: list[Request] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        if self.policy == "priority":
            self.running.sort(key=self._order)

        # running requests first, most important first; the least important yields blocks
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            in_flight = req.num_output_placeholders
            num_known = len(req.all_token_ids) + in_flight - req.num_computed_tokens
            left = self._tokens_left(req) if in_flight or passes > 1 else 0
            if num_known <= 0 or (in_flight and left <= 0):  # (its length limits are reached)
                i += 1  # nothing to compute until its tokens in flight are known
                continue
            num_new = min(num_known, budget)
            if num_known > 1:  # a prompt's chunk (or a preempted request catching up)
                if prefill <= 0:
                    i += 1
                    continue
                num_new = min(num_new, prefill)
                prefill -= num_new
            if passes > 1:  # one token per pass, all but the first sampled on the device
                num_new = min(passes, left)
            elif req.spec_token_ids and num_new == num_known:
                # a step emits at most 1 + k tokens: no more than the length limits allow;
                # and the requests after this one keep a token of the budget each
                room = min(self._tokens_left(req) - 1,
                           budget - num_known - (len(self.running) - i - 1))
                num_new += max(0, min(len(req.spec_token_ids), room))
            lookahead = (self._lookahead(req.num_computed_tokens + num_new)
                         if self.num_lookahead_tokens else 0)
            while True:
                blocks = self.kv.allocate_slots(req, num_new, num_lookahead_tokens=lookahead)
                if blocks is not None:
                    break
                if self._release_waiting_blocks():
                    continue
                # Out of blocks: the last running request (never one scheduled earlier in this
                # step) is preempted, swapped to host memory or left to recompute later.
                victim = self.running.pop()
                swap_out += self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if blocks is None:
                break
            num_scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = blocks
            budget -= 1 if passes > 1 else num_new  # a pass holds one token per request
            i += 1

        # then waiting requests, in order, unless this step already had to preempt or is a
        # multi-step call (its passes take one token per request: a prompt cannot join; one
        # may fit after all, through prefix hits that _could_admit does not count)
        loras = self._running_loras()
        skipped: list[Request] = []  # waiting for an adapter slot: they keep their place
        while (self.waiting and not preempted and min(budget, prefill) > 0 and passes == 1
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            if req.num_output_placeholders:
                break  # its last token is still in flight: the host must know it first
            if req.lora_id and (skipped or (req.lora_id not in loras
                                            and len(loras) >= self.max_loras)):
                # Running requests use max_loras adapters already. Base requests go on; later
                # requests with an adapter wait behind this one (even those whose adapter runs)
                # so that the running adapters drain and this one gets in: no adapter starves.
                skipped.append(self.waiting.popleft())
                continue
            if req.status == RequestStatus.SWAPPED:
                num_new = min(req.num_tokens - req.num_computed_tokens, budget, prefill)
                if num_new < 1:  # its next token must exist on the host: it would sample nothing
                    raise RuntimeError(f"{req!r} was swapped out without its last token")
                got = self.kv.swap_in(req, num_new, self._lookahead(req.num_computed_tokens + num_new))
                if got is None:
                    break
                blocks, pairs = got
                swap_in += pairs
            else:
                computed, num_hit = [], 0
                looked_up = req.num_computed_tokens == 0
                if looked_up:
                    computed, num_hit = self.kv.get_computed_blocks(req)
                num_new = min(req.num_tokens - req.num_computed_tokens - num_hit, budget, prefill)
                lookahead = self._lookahead(req.num_computed_tokens + num_hit + num_new)
                blocks = self.kv.allocate_slots(req, num_new, computed, lookahead)
                if blocks is None and self._release_waiting_blocks(req):
                    continue  # look again: the release may have dropped this one's hits too
                if blocks is None:
                    break
                if looked_up:
                    self.kv.record_prefix_lookup(req, num_hit)
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit
                req.num_computed_tokens += num_hit
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.lora_id:
                loras.add(req.lora_id)
            num_scheduled[req.request_id] = num_new
            new_blocks[req.request_id] = blocks
            budget -= num_new
            prefill -= num_new
        self.waiting.extendleft(reversed(skipped))

        finished = self._finished_ids | {r.request_id for r in preempted}
        # before the lists: a finished id may come back at once as a new request
        self._known_to_runner -= finished
        new_reqs, cached_reqs, sampling, spec, scheduled = [], [], set(), {}, {}
        known = self._known_to_runner
        for req in self.running:
            rid = req.request_id
            n = num_scheduled.get(rid)
            if n is None:
                req.spec_token_ids = []
                continue
            scheduled[rid] = req
            start = req.num_computed_tokens
            end = start + n
            # (properties read as their fields: this loop runs per request per step)
            num_all = len(req.all_token_ids) + req.num_output_placeholders
            if req.spec_token_ids:
                # (a multi-step call's tokens past the first are the request's own placeholders)
                if passes == 1 and end > num_all:
                    spec[rid] = req.spec_token_ids[:end - num_all]
                req.spec_token_ids = []  # proposed again for the next step
            if rid in known:
                cached_reqs.append(CachedRequestData(rid, new_blocks[rid], start))
            else:
                known.add(rid)
                new_reqs.append(NewRequestData.from_request(req, list(self.kv.get_blocks(rid))))
            # the counts advance here, once: the runner mirrors what this output says
            num_prompt = len(req.prompt_token_ids)
            if start < num_prompt:
                self.num_prompt_tokens += min(end, num_prompt) - start
            req.num_computed_tokens = end
            if end >= num_all:
                req.num_output_placeholders += n if passes > 1 else 1
                sampling.add(rid)
        self._finished_ids = set()
        copies = list(self._pending_copies.values())
        self._pending_copies = {}
        return SchedulerOutput(new_reqs, cached_reqs, num_scheduled,
                               sum(num_scheduled.values()), finished, swap_out, swap_in, copies,
                               sampling, spec, scheduled, passes if num_scheduled else 1)

    def _lookahead(self, end: int) -> int:
        """Slots a draft model's proposal passes write past a request's scheduled tokens."""
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - end))

    def _running_loras(self) -> set[int]:
        loras = {r.lora_id for r in self.running if r.lora_id}
        if len(loras) > self.max_loras:  # admission keeps this from happening
            raise RuntimeError(f"requests with {len(loras)} LoRA adapters are running but "
                             f"max_loras is {self.max_loras}")
        return loras

    def _release_waiting_blocks(self, keep: Request | None = None) -> bool:
        """Forked siblings wait holding their blocks; under memory pressure they give them
        back and will recompute their prompt, before anything running is preempted."""
        released = False
        for req in self.waiting:
            if req is not keep and req.status == RequestStatus.WAITING and self.kv.get_blocks(req.request_id):
                self._drop_copy(req)
                self.kv.free(req)
                req.num_computed_tokens = 0
                req.num_cached_tokens = -1
                released = True
        return released

    def _preempt(self, req: Request) -> list[tuple[int, int]]:
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        pairs = self.kv.swap_out(req) if self.preemption_mode == "swap" else None
        if pairs is not None:
            req.status = RequestStatus.SWAPPED
            self.num_swaps += 1
        else:  # recompute (or the swap space is full)
            self.kv.free(req)
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            pairs = []
        self._enqueue(req, front=True)
        return pairs

    def update_from_output(self, out: SchedulerOutput,
                           sampled: dict[str, list[int]]) -> list[RequestUpdate]:
        """The tokens a step produced, per sampling request (0..k each): append them in order,
        finishing on EOS, stop ids or length (later tokens of the same step are dropped).
        Requests finished or aborted while the step ran get nothing; requests preempted while
        it ran keep their token (it was sampled from the right context)."""
        self.kv.end_step()
        updates = []
        # (the step's fields as locals: this loop runs per request per step)
        sampling, scheduled, requests = out.sampling_req_ids, out.scheduled_reqs, self.requests
        multi, spec, max_len = out.num_passes > 1, out.scheduled_spec_decode_tokens, self.max_model_len
        for rid, n in out.num_scheduled_tokens.items():
            if rid not in sampling:
                continue  # a prefill chunk: it samples nothing
            req = requests.get(rid)
            if req is None or req is not scheduled[rid] or req.status.finished:
                continue
            req.num_output_placeholders -= n if multi else 1
            drafts = spec.get(rid) if spec else None
            if drafts:
                self._account_verification(req, len(drafts), len(sampled.get(rid, ())))
            if req.forks:
                if req.status == RequestStatus.RUNNING:
                    self._fork(req)
                else:  # preempted while its prompt step ran: its blocks are gone
                    self._release_forks(req)
            toks = sampled.get(rid, ())
            if len(toks) == 1:  # (most steps)
                token = toks[0]
                req.output_token_ids.append(token)
                req.all_token_ids.append(token)
                self.num_generation_tokens += 1
                status = check_stop(req, token, max_len)
                if status is not None:
                    self._finish(req, status)
                updates.append(RequestUpdate(req, toks))
                continue
            if len(toks) > 1 and none_stop(req, toks, self.max_model_len):
                # a multi-token step that ends nothing: its tokens go in at once (the list is
                # this step's own)
                req.append_output_tokens(toks)
                self.num_generation_tokens += len(toks)
                updates.append(RequestUpdate(req, toks))
                continue
            new = []
            for token in toks:
                req.append_output_token(token)
                new.append(token)
                self.num_generation_tokens += 1
                status = check_stop(req, token, self.max_model_len)
                if status is not None:
                    self._finish(req, status)
                    break
            updates.append(RequestUpdate(req, new))
        return updates

    def _account_verification(self, req: Request, num_drafts: int, num_emitted: int) -> None:
        """A step verified `num_drafts` proposed tokens and emitted the accepted ones plus one:
        the rejected ones' slots are computed again (the counts go back to before them)."""
        accepted = max(num_emitted - 1, 0)
        if req.status == RequestStatus.RUNNING:
            req.num_computed_tokens -= num_drafts - accepted
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += accepted
        for j in range(accepted):
            self.spec_accepted_per_pos[j] += 1

    def _fork(self, leader: Request) -> None:
        """The leader has computed its prompt: its siblings start from its blocks."""
        for sib in leader.forks:
            if self._held.pop(sib.request_id, None) is None:
                continue  # aborted meanwhile
            got = self.kv.fork(leader, sib)
            if got is not None:
                sib.num_cached_tokens = sib.num_computed_tokens
                if got[1] is not None:
                    self._pending_copies[sib.request_id] = got[1]
            # with no free block the sibling recomputes its prompt like any new request
            self._enqueue(sib, front=True)
        leader.forks = []
