"""SamplingParams with vLLM's names, defaults and validation (a ValueError names the field)."""
from __future__ import annotations

import enum
import math
import json
from dataclasses import dataclass, field

GREEDY_EPS = 1e-5  # temperatures below this are greedy (the sampler takes the argmax)
MAX_LOGPROBS = 20  # top logprobs a request may ask for (vLLM's max_logprobs)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_truncation(k, max_model_len: int) -> int:
    """The tokens truncate_prompt_tokens keeps (-1: the model's length), as vLLM takes it."""
    if not _is_int(k) or (k < 1 and k != -1):
        raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {k!r}")
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens ({k}) is greater than max_model_len "
                         f"({max_model_len}): select a smaller truncation size")
    return max_model_len if k == -1 else k


class RequestOutputKind(enum.Enum):
    """Which outputs LLMEngine.step returns for a request (vLLM's names)."""
    CUMULATIVE = 0  # after every step, everything generated so far
    DELTA = 1       # after every step, only what is new (streaming: constant work per token)
    FINAL_ONLY = 2  # once, when the request finishes (offline generate)


CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one constraint (a JSON schema, a regex, a list of
    choices, a Lark/EBNF grammar, or any JSON object) that every output must satisfy. The
    grammar is compiled once per (constraint, tokenizer) and applied as a token mask."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    # the request field error messages name ("response_format" when the server built it)
    field_name: str = field(default="structured_outputs", repr=False, compare=False)

    def __post_init__(self):
        f = self.field_name
        given = [k for k in CONSTRAINTS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"{f} must set exactly one of json, regex, choice, grammar or "
                             f"json_object, got {given or 'none'}")
        if self.structural_tag is not None:
            raise ValueError(f"{f}.structural_tag is not supported")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"{f}.json is not valid JSON: {e}") from None
            if not isinstance(self.json, (dict, bool)):
                raise ValueError(f"{f}.json must be a JSON schema (an object), got "
                                 f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{f}.{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError(f"{f}.choice must be a non-empty list of strings")
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            raise ValueError(f"{f}.json_object must be a boolean")
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str):
                raise ValueError(f"{f}.whitespace_pattern must be a string")
            if self.json is None and not self.json_object:
                raise ValueError(f"{f}.whitespace_pattern applies to json and json_object only")
            if self.disable_any_whitespace:
                raise ValueError(f"{f}.whitespace_pattern and disable_any_whitespace "
                                 "contradict each other")

    @property
    def kind(self) -> str:
        return next(k for k in CONSTRAINTS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """What the compiled grammar depends on (the tokenizer is the engine's): the cache key.
        A schema's property order matters (properties are generated in that order)."""
        spec = getattr(self, self.kind)
        if not isinstance(spec, str):
            spec = json.dumps(spec, separators=(",", ":"))
        return (self.kind, spec, self.disable_any_whitespace, self.disable_additional_properties,
                self.whitespace_pattern)


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
    truncate_prompt_tokens: int | None = None  # only the prompt's last k tokens (-1: max_model_len)
    structured_outputs: StructuredOutputsParams | None = None
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
        if self.truncate_prompt_tokens is not None:
            check_truncation(self.truncate_prompt_tokens, math.inf)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop must be a string or a list of non-empty strings")
        self._stop = stop
        if stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True: they are matched in the text")
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
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}")
            if self.min_tokens > 0:
                raise ValueError("min_tokens cannot be combined with structured_outputs: the "
                                 "grammar decides where the output may end")
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
