"""OpenAI request bodies (with vLLM's extra sampling fields) as pydantic models.

Every field we accept is honoured. Fields of OpenAI's or vLLM's API that we do not implement
yet are declared in NOT_IMPLEMENTED and refused (400, naming the field) when a request sets
them; fields we have never heard of are kept aside (`unknown_fields`) so the server can name
them in a warning, as vLLM does.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from jaxllm.sampling_params import SamplingParams

MAX_N = 128  # OpenAI's cap on n (and here on best_of): choices of one request
MAX_TOP_LOGPROBS = 20

# field -> the values that mean "not used" (a request may send those)
NOT_IMPLEMENTED: dict[str, tuple] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "truncate_prompt_tokens": (None,),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
}
# fields refused for another reason than "not yet": field -> why
REFUSED: dict[str, str] = {
    "lora_request": "lora_request is not taken in a request body: name a LoRA adapter in `model` "
                    "(GET /v1/models lists them)",
}


class _Model(BaseModel):
    # non-finite floats ("NaN", Infinity) are refused for every float field; fields we do not
    # know are kept in model_extra, to be named in a warning
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def unknown_fields(self, prefix: str = "") -> list[str]:
        """Dotted names of the fields we have never heard of, nested models included."""
        out = [prefix + k for k in (self.model_extra or {}) if k not in NOT_IMPLEMENTED and k not in REFUSED]
        for name in type(self).model_fields:
            value = getattr(self, name)
            items = value if isinstance(value, list) else [value]
            for item in items:
                if isinstance(item, _Model):
                    out += item.unknown_fields(f"{prefix}{name}.")
        return sorted(set(out))


class _Body(_Model):

    def refused_field(self) -> str | None:
        """The first field set that names a feature we do not implement yet."""
        extra = self.model_extra or {}
        for name, unused in NOT_IMPLEMENTED.items():
            if name in extra and extra[name] not in unused:
                return name
        return next((name for name in REFUSED if extra.get(name) is not None), None)


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Body):
    """Fields both endpoints share, with OpenAI's and vLLM's names."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None  # an end-user id for the caller's records; nothing to honour
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    priority: int = 0
    cache_salt: str | None = None

    def sampling_kwargs(self) -> dict[str, Any]:
        kw = dict(n=self.n, best_of=self.best_of, presence_penalty=self.presence_penalty,
                  frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop,
                  stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                  min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
                  spaces_between_special_tokens=self.spaces_between_special_tokens,
                  include_stop_str_in_output=self.include_stop_str_in_output,
                  logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
                  bad_words=self.bad_words, prompt_logprobs=self.prompt_logprobs)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        return kw

    def check(self) -> tuple[str, str] | None:
        """(field, message) for a combination OpenAI refuses, or None."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        if self.use_beam_search:
            for name in BEAM_SEARCH_UNSUPPORTED:
                if name in type(self).model_fields and getattr(self, name) != type(self).model_fields[name].default:
                    return name, f"{name} is not supported with use_beam_search"
        return None


# what beam search cannot honour (it takes n as the beam width, max_tokens, ignore_eos,
# temperature, length_penalty, priority and cache_salt)
BEAM_SEARCH_UNSUPPORTED = (
    "best_of", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words",
    "min_tokens", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output")


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs, **self.sampling_kwargs())


class ContentPart(_Model):
    type: str
    text: str | None = None


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # tool calling is not implemented yet: a request carrying these is refused by the server
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None

    def plain(self) -> dict:
        if self.tool_calls or self.tool_call_id is not None or self.role == "tool":
            raise ValueError("messages: tool messages and tool_calls are not supported yet")
        content = self.content
        if isinstance(content, list):
            kinds = {p.type for p in content}
            if kinds - {"text"}:
                raise ValueError(f"messages: content parts of type {sorted(kinds - {'text'})} "
                                 "are not supported")
            content = "".join(p.text or "" for p in content)
        msg = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **self.sampling_kwargs())

    def check(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs set to true"
        return super().check()


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class LoadLoRAAdapterRequest(_Body):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str
    lora_int_id: int | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
