"""SamplingParams with vLLM's names, defaults and validation (a ValueError names the field)."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

GREEDY_EPS = 1e-5  # temperatures below this are greedy (the sampler takes the argmax)
MAX_LOGPROBS = 20  # top logprobs a request may ask for (vLLM's max_logprobs)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class RequestOutputKind(enum.Enum):
    """Which outputs LLMEngine.step returns for a request (vLLM's names)."""
    CUMULATIVE = 0  # after every step, everything generated so far
    DELTA = 1       # after every step, only what is new (streaming: constant work per token)
    FINAL_ONLY = 2  # once, when the request finishes (offline generate)


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    _stop: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
                     "top_p", "min_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n!r}")
        if self.best_of is not None:
            if not _is_int(self.best_of) or self.best_of < self.n:
                raise ValueError(f"best_of must be an integer at least n={self.n}, got {self.best_of!r}")
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise ValueError(f"{name} must be in [{lo}, {hi}], got {v!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be 0, -1 (disable) or at least 1, got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop must be a string or a list of non-empty strings")
        self._stop = stop
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        self.bad_words = list(self.bad_words or [])
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be a list of non-empty strings")
        if self.logit_bias is not None:
            try:
                # OpenAI sends token ids as string keys; vLLM clamps biases to [-100, 100]
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError, OverflowError):
                raise ValueError("logit_bias must map token ids to numbers") from None
            if any(math.isnan(v) for v in bias.values()):
                raise ValueError("logit_bias values must be numbers, not NaN")
            self.logit_bias = {k: min(100.0, max(-100.0, v)) for k, v in bias.items()}
            if any(k < 0 for k in self.logit_bias):
                raise ValueError("logit_bias keys must be non-negative token ids")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
        if self.temperature < GREEDY_EPS:
            # greedy: the sampling knobs do not apply
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @property
    def num_sequences(self) -> int:
        """Sequences actually generated: best_of of them, of which the n best are returned."""
        return self.best_of or self.n

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def has_bias(self) -> bool:
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids in the parameters must exist in the model's vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias", list(self.logit_bias or ())),
                          ("allowed_token_ids", self.allowed_token_ids or [])):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} contains token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
