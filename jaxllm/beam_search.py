"""Beam search on top of the engine, as vLLM does it: every step expands each beam by its
2 * beam_width most likely next tokens (one-token requests asking for logprobs) and keeps the
best beam_width by length-penalised score. Beams share their common prefix's KV blocks
through the prefix cache, so each step computes little more than the new tokens."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # the prompt's tokens, then the beam's
    logprobs: list[dict] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None,
               length_penalty: float) -> float:
    """vLLM's score: cumulative logprob over (sequence length ** length_penalty), the length
    counting the prompt and not a final EOS."""
    seq_len = len(tokens)
    if eos_token_id is not None and tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cum_logprob / (seq_len ** length_penalty)


class BeamSearch:
    """The search state of a batch of prompts; the caller runs each step's one-token requests
    (`pending()`), then feeds their logprobs to `advance()`."""

    def __init__(self, prompts_ids: list[list[int]], params: BeamSearchParams, eos_token_id: int | None):
        self.params = params
        self.eos = eos_token_id
        self.live = [[BeamSearchSequence(list(ids))] for ids in prompts_ids]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompts_ids]
        self._flat: list[tuple[int, BeamSearchSequence]] = []
        self.steps = 0

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam.tokens, beam.cum_logprob, self.eos, self.params.length_penalty)

    def pending(self) -> list[list[int]]:
        if self.steps >= self.params.max_tokens:
            return []
        self._flat = [(i, b) for i, beams in enumerate(self.live) for b in beams]
        return [b.tokens for _, b in self._flat]

    def advance(self, step_logprobs: list[dict]) -> None:
        """step_logprobs[j]: token id -> Logprob for the j-th pending beam."""
        grown = [[] for _ in self.live]
        for (i, beam), entry in zip(self._flat, step_logprobs):
            for token, lp in entry.items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [{token: lp}],
                                         beam.cum_logprob + lp.logprob)
                if token == self.eos and not self.params.ignore_eos:
                    new.finish_reason = "stop"
                    self.done[i].append(new)
                else:
                    grown[i].append(new)
        width = self.params.beam_width
        self.live = [sorted(g, key=self._score, reverse=True)[:width] for g in grown]
        self.steps += 1

    def step_params(self):
        from jaxllm.sampling_params import SamplingParams
        return SamplingParams(logprobs=2 * self.params.beam_width, max_tokens=1,
                              temperature=self.params.temperature)

    def results(self, tokenizer=None) -> list[BeamSearchOutput]:
        out = []
        for beams, finished in zip(self.live, self.done):
            for b in beams:
                b.finish_reason = b.finish_reason or "length"
            best = sorted(finished + beams, key=self._score, reverse=True)[:self.params.beam_width]
            for b in best:
                b.text = tokenizer.decode(b.tokens, skip_special_tokens=True) if tokenizer else None
            out.append(BeamSearchOutput(best))
        return out
