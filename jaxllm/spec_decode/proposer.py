"""Which running requests speculate this step, and their proposals.

The engine calls propose() before scheduling. A request speculates when it is decoding (its
known tokens are computed but for the last one, or that one is still being computed by the
step in flight), its sampling needs nothing that depends on the tokens before each position
(penalties, multi-token bad words), and no more than `disable_by_batch_size` requests run.

n-gram proposals come from the request's known tokens on the host (the persistent batch's
token rows). A request whose last token is still in flight (async scheduling) proposes from
the tokens known before it: the match's continuation after the token the match predicts
for it. When that prediction is wrong the proposals are rejected, which costs nothing but the
verified positions. A draft model's proposals are already on the device (it ran right behind
the request's last step, on the tokens that step emitted); the host asks for k of them.
"""
from __future__ import annotations

import numpy as np

from jaxllm.core.request import RequestStatus
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.ngram import propose_ngram

ON_DEVICE = -1  # a proposal held on the device


class Speculator:
    def __init__(self, config: SpeculativeConfig, batch, drafter=None):
        self.config = config
        self.batch = batch  # the runner's InputBatch: token rows of running requests
        self.drafter = drafter  # a draft model: which requests have proposals on the device

    def can_speculate(self, req) -> bool:
        p = req.sampling_params
        return not (p.has_penalties or req.needs_host_tokens)

    def enabled_for(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def eligible(self, running) -> list:
        """The running requests that may speculate this step."""
        if not self.enabled_for(len(running)):
            return []
        row_of = self.batch.row_of
        return [r for r in running
                if r.status == RequestStatus.RUNNING and r.request_id in row_of
                # decoding: it has sampled, and at most its last token is left to compute
                and r.num_tokens_with_placeholders > r.num_prompt_tokens
                and r.num_computed_tokens >= r.num_tokens - 1 and self.can_speculate(r)]

    def propose(self, running) -> None:
        """Set spec_token_ids on the running requests that speculate this step."""
        cfg = self.config
        reqs = self.eligible(running)
        if not reqs:
            return
        if cfg.method == "draft_model":
            for r in reqs:
                if r.request_id in self.drafter.fresh:
                    r.spec_token_ids = [ON_DEVICE] * cfg.k
            return
        rows = np.fromiter((self.batch.row_of[r.request_id] for r in reqs), np.int64, len(reqs))
        lengths = self.batch.num_tokens[rows]
        skip = np.fromiter((r.num_output_placeholders > 0 for r in reqs), np.int64, len(reqs))
        tokens = self.batch.token_ids[rows, :int(lengths.max())]
        drafts, count = propose_ngram(tokens, lengths, np.full(len(reqs), cfg.k), cfg.prompt_lookup_min,
                                      cfg.prompt_lookup_max, skip)
        for r, d, c in zip(reqs, drafts, count):
            if c:
                r.spec_token_ids = d[:c].tolist()
