"""SpeculativeConfig: vLLM's `speculative_config` dict, validated (a ValueError names the field).

Pure Python: the engine config imports it without JAX.
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxllm import config_dicts

METHODS = ("ngram", "draft_model")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
MAX_SPECULATIVE_TOKENS = 16  # verification rows grow with it; past this, acceptance has long run out


def _field_error(name: str, msg: str) -> ValueError:
    return ValueError(f"speculative_config.{name} {msg}")


def _positive_int(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise _field_error(name, f"must be a positive integer, got {value!r}")


@dataclass
class SpeculativeConfig:
    """`method` "ngram" (prompt lookup over the request's own tokens) or "draft_model" (a smaller
    model sharing the target's tokenizer, at `model`). Without `method`, `model` decides as in
    vLLM: "ngram" or "[ngram]" means n-gram, a path means a draft model."""

    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # above this many running requests, no request speculates
    disable_by_batch_size: int | None = None
    # draft model: "greedy" proposes the draft's argmax (verification then reproduces the
    # unspeculated tokens exactly, seeded sampling included); "probabilistic" samples the
    # draft's distribution q at the request's temperature and verifies with min(1, p/q)
    draft_sample_method: str = "greedy"

    def __post_init__(self):
        if self.method is None:
            if self.model in ("ngram", "[ngram]"):
                self.method = "ngram"
            elif self.model is not None:
                self.method = "draft_model"
            else:
                raise _field_error("method", f"is required without a model (one of {METHODS})")
        if self.method == "[ngram]":
            self.method = "ngram"
        if self.method not in METHODS:
            raise _field_error("method", f"must be one of {METHODS}, got {self.method!r}")
        if self.num_speculative_tokens is None:
            raise _field_error("num_speculative_tokens", "is required")
        _positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise _field_error("num_speculative_tokens",
                               f"must be at most {MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}")
        _positive_int("disable_by_batch_size", self.disable_by_batch_size)
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise _field_error("draft_sample_method", f"must be one of {DRAFT_SAMPLE_METHODS}, "
                               f"got {self.draft_sample_method!r}")
        if self.method == "ngram":
            if self.model not in (None, "ngram", "[ngram]"):
                raise _field_error("model", f"does not apply to method 'ngram', got {self.model!r}")
            self.model = None
            _positive_int("prompt_lookup_max", self.prompt_lookup_max)
            _positive_int("prompt_lookup_min", self.prompt_lookup_min)
            # vLLM's defaults: 5 and 5, or the one given for both
            if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
                self.prompt_lookup_min = self.prompt_lookup_max = 5
            elif self.prompt_lookup_min is None:
                self.prompt_lookup_min = self.prompt_lookup_max
            elif self.prompt_lookup_max is None:
                self.prompt_lookup_max = self.prompt_lookup_min
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise _field_error("prompt_lookup_min", f"({self.prompt_lookup_min}) must be at most "
                                   f"prompt_lookup_max ({self.prompt_lookup_max})")
            if self.draft_sample_method != "greedy":
                raise _field_error("draft_sample_method", "applies to method 'draft_model' only "
                                   "(n-gram proposals are deterministic)")
        else:
            if not isinstance(self.model, str) or not self.model:
                raise _field_error("model", "is required for method 'draft_model' (a local HF "
                                   "directory or GGUF file)")
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    raise _field_error(name, "applies to method 'ngram' only")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, a dict or its JSON text (the --speculative-config flag)."""
        return config_dicts.parse(cls, value, "speculative_config")

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    def describe(self) -> str:
        if self.method == "ngram":
            return (f"ngram, {self.k} tokens, lookup {self.prompt_lookup_min}-"
                    f"{self.prompt_lookup_max}")
        return f"draft model {self.model}, {self.k} tokens, {self.draft_sample_method}"
