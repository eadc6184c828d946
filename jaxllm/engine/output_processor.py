"""Output processing: the tokens a step produced become RequestOutputs.

Per request (a parent of n or best_of sequences) and per sequence: an incremental detokenizer,
stop strings, logprobs and what has been sent so far. Outputs come in vLLM's three kinds:
CUMULATIVE (everything so far, every step), DELTA (only what is new: constant work per token,
for streams) and FINAL_ONLY (once, at the end: offline generate). Token ids are not copied
here: the scheduler's Request owns them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from jaxllm.core.request import Request, RequestStatus
from jaxllm.engine.detokenizer import IncrementalDetokenizer, piece_table
from jaxllm.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _Sequence:
    request: Request
    index: int
    detok: IncrementalDetokenizer | None
    logprobs: list | None             # per output token: token id -> Logprob
    cumulative_logprob: float = 0.0
    sent_tokens: int = 0              # DELTA: what earlier outputs carried
    sent_chars: int = 0
    done_sent: bool = False           # its final output was sent
    metrics: RequestMetrics | None = None  # its parent's


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[_Sequence]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    sent_prompt_logprobs: int = 0
    outputs_made: int = 0

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # (most requests: no generator per step)
            return seqs[0].request.status.finished
        return all(s.request.status.finished for s in seqs)


class OutputProcessor:
    def __init__(self, tokenizer, scheduler):
        self.tokenizer = tokenizer
        # ends sequences whose text hit a stop string (jaxllm.core.scheduler.Scheduler)
        self.scheduler = scheduler
        self.parents: dict[str, _Parent] = {}
        self.seqs: dict[str, _Sequence] = {}     # by the sequence's (child) request id
        self._token_text: dict[int, str] = {}
        # tokens' own texts, by skip_special_tokens, shared by all sequences' detokenizers
        # (built at the first request that needs one)
        self._pieces: dict[bool, dict | None] = {}

    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int],
            params: SamplingParams, requests: list[Request], arrival: float) -> None:
        seqs = []
        for i, req in enumerate(requests):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                skip = params.skip_special_tokens
                if skip not in self._pieces:
                    self._pieces[skip] = piece_table(self.tokenizer, skip)
                detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, skip,
                                               params.stop_strings, params.include_stop_str_in_output,
                                               params.spaces_between_special_tokens,
                                               self._pieces[skip])
            seqs.append(_Sequence(req, i, detok, [] if params.logprobs is not None else None))
        plp = [None] if params.prompt_logprobs is not None else None
        parent = _Parent(request_id, prompt, prompt_ids, params, seqs, RequestMetrics(arrival),
                         plp)
        for s in seqs:
            s.metrics = parent.metrics
        self.parents[request_id] = parent
        for s in seqs:
            self.seqs[s.request.request_id] = s

    def remove(self, request_id: str) -> _Parent | None:
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            for s in parent.seqs:
                self.seqs.pop(s.request.request_id, None)
        return parent

    def parent_of(self, seq_request_id: str) -> _Parent | None:
        seq = self.seqs.get(seq_request_id)
        return None if seq is None else self.parents[seq.request.parent_id]

    def token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _position_logprobs(self, token: int, lp) -> dict:
        entry = {token: Logprob(lp.logprob, lp.rank, self.token_text(token))}
        for rank, (tid, val) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            if tid not in entry:
                entry[tid] = Logprob(val, rank, self.token_text(tid))
        return entry

    # one step
    def add_prompt_logprobs(self, rid: str, start: int, entries) -> None:
        parent = self.parent_of(rid)
        if parent is None or parent.prompt_logprobs is None:
            return
        plp, ids = parent.prompt_logprobs, parent.prompt_token_ids
        for j, lp in enumerate(entries):
            pos = start + j + 1  # the entry of position p scores prompt token p + 1
            if pos == len(plp):  # a recomputed prompt (after preemption) adds nothing twice
                plp.append(self._position_logprobs(ids[pos], lp))

    def update(self, request: Request, new_tokens: list[int], logprobs, now: float) -> str:
        """A sequence's new tokens; returns its parent's id. A sequence whose text hit a stop
        string ends through the scheduler."""
        seq = self.seqs[request.request_id]
        hit = seq.detok.update(new_tokens) if seq.detok is not None and new_tokens else None
        if hit is not None:
            # the tokens a multi-token step emitted after the one completing the stop string
            # are not output: the sequence ends where one token at a time would have ended it
            stop_reason, used = hit
            num_dropped = len(new_tokens) - used
            new_tokens = new_tokens[:used]
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED, stop_reason,
                                          num_dropped)
        if logprobs:
            for token, lp in zip(new_tokens, logprobs):
                seq.cumulative_logprob += lp.logprob
                if seq.logprobs is not None:
                    seq.logprobs.append(self._position_logprobs(token, lp))
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        return request.parent_id

    def make_outputs(self, parent_ids) -> list[RequestOutput]:
        out = []
        parents, final_only, delta = self.parents, RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA
        for pid in parent_ids:
            parent = parents.get(pid)
            if parent is None:
                continue
            kind = parent.params.output_kind
            seqs = parent.seqs  # (parent.finished, inline: this runs per request per step)
            finished = (seqs[0].request.status.finished if len(seqs) == 1
                        else all(s.request.status.finished for s in seqs))
            if kind is final_only and not finished:
                continue
            made = self._output(parent, kind is delta, finished)
            if made is not None:
                out.append(made)
            if finished:
                self.remove(pid)
        return out

    def _output(self, parent: _Parent, delta: bool, finished: bool) -> RequestOutput | None:
        params = parent.params
        wants_cum = parent.seqs[0].request.wants_cumulative_logprob
        outputs = []
        metrics = parent.metrics
        for seq in parent.seqs:
            req = seq.request
            done = req.status.finished
            n_tok = len(req.output_token_ids)
            if delta:
                if seq.done_sent or (n_tok == seq.sent_tokens and not done):
                    continue  # nothing new for this sequence
                text = seq.detok.text_since(seq.sent_chars, done) if seq.detok else ""
                token_ids = req.output_token_ids[seq.sent_tokens:]
                lps = seq.logprobs[seq.sent_tokens:] if seq.logprobs is not None else None
                seq.sent_chars += len(text)
                seq.sent_tokens = n_tok
                seq.done_sent = done
            else:
                text = seq.detok.get_text(done) if seq.detok else ""
                token_ids = list(req.output_token_ids)
                lps = list(seq.logprobs) if seq.logprobs is not None else None
            if req.num_preemptions > metrics.num_preemptions:
                metrics.num_preemptions = req.num_preemptions
            outputs.append(CompletionOutput(
                seq.index, text, token_ids, seq.cumulative_logprob if wants_cum else None, lps,
                req.finish_reason if done else None, req.stop_reason,
                req.error if done else None))
        plp = parent.prompt_logprobs
        if delta and plp is not None:
            plp, parent.sent_prompt_logprobs = plp[parent.sent_prompt_logprobs:], len(plp)
        elif plp is not None:
            plp = list(plp)
        if delta and not outputs and not finished:
            return None
        best_of = params.best_of and params.best_of > params.n
        if finished:
            metrics.finished_time = time.time()
            if best_of:
                # the n most likely of best_of sequences
                outputs = sorted(outputs, key=lambda o: -o.cumulative_logprob)[:params.n]
                for i, o in enumerate(outputs):
                    o.index = i
                    if params.logprobs is None:
                        o.cumulative_logprob = None
        elif best_of:
            outputs = outputs[:params.n]  # streamed: the choice is made at the end
        cached = max(parent.seqs[0].request.num_cached_tokens, 0)
        parent.outputs_made += 1
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs,
                             finished, metrics.snapshot(), cached, plp)

