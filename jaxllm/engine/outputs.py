"""Outputs shaped like vLLM's."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per position: the chosen token and the top alternatives, token id -> Logprob
PositionLogprobs = dict[int, Logprob]


# slotted: outputs are made per request per step (no instance dict to build or collect)
@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # finish_reason "error": what failed


    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    def snapshot(self) -> "RequestMetrics":
        """A copy, as each output carries (copy.copy's generic path is slower for so small a
        record, and outputs are made at every step)."""
        return RequestMetrics(self.arrival_time, self.first_scheduled_time, self.first_token_time,
                              self.last_token_time, self.finished_time, self.num_preemptions)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default=None)
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
