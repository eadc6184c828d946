"""OpenAI request bodies (with vLLM's extra sampling fields) as pydantic models.

Every field we accept is honoured. Fields of OpenAI's or vLLM's API that we do not implement
yet are declared in NOT_IMPLEMENTED and refused (400, naming the field) when a request sets
them; fields we have never heard of are kept aside (`unknown_fields`) so the server can name
them in a warning, as vLLM does.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams, check_truncation

MAX_N = 128  # OpenAI's cap on n (and here on best_of): choices of one request
MAX_TOP_LOGPROBS = 20

# field -> the values that mean "not used" (a request may send those)
NOT_IMPLEMENTED: dict[str, tuple] = {
    "functions": (None, []),          # OpenAI's deprecated names for tools and tool_choice
    "function_call": (None, "none"),
    # vLLM's removed spellings of structured_outputs
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


class StructuredOutputs(_Model):
    """vLLM's `structured_outputs`: one constraint of json, regex, choice, grammar (Lark or
    EBNF) or json_object."""
    json_: dict | bool | str | None = Field(None, alias="json")  # `json` is a BaseModel method
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def to_params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(**{k.rstrip("_"): getattr(self, k)
                                          for k in type(self).model_fields})


class JsonSchemaFormat(_Model):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def to_params(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True, field_name="response_format")
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise ValueError("response_format.json_schema.schema is required with type json_schema")
        return StructuredOutputsParams(json=self.json_schema.schema_, field_name="response_format")


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
    # the prompt's last k tokens only (-1: the model's length), as vLLM
    truncate_prompt_tokens: int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as truncate_prompt_tokens keeps it (ValueError naming the field)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        return ids[-check_truncation(k, max_model_len):]

    def constraint(self) -> StructuredOutputsParams | None:
        """The request's structured-output constraint (ValueError naming a bad field)."""
        if self.response_format is not None and self.structured_outputs is not None:
            fmt = self.response_format.type
            if fmt != "text":
                raise ValueError("response_format and structured_outputs cannot both be set")
        if self.structured_outputs is not None:
            return self.structured_outputs.to_params()
        return self.response_format.to_params() if self.response_format is not None else None

    def sampling_kwargs(self) -> dict[str, Any]:
        kw = dict(n=self.n, best_of=self.best_of, presence_penalty=self.presence_penalty,
                  frequency_penalty=self.frequency_penalty, seed=self.seed, stop=self.stop,
                  stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                  min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
                  spaces_between_special_tokens=self.spaces_between_special_tokens,
                  include_stop_str_in_output=self.include_stop_str_in_output,
                  logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
                  bad_words=self.bad_words, prompt_logprobs=self.prompt_logprobs,
                  truncate_prompt_tokens=self.truncate_prompt_tokens,
                  structured_outputs=self.constraint())
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
    "spaces_between_special_tokens", "include_stop_str_in_output", "response_format",
    "structured_outputs", "tools", "return_token_ids")


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    # vLLM's: each choice carries prompt_token_ids and token_ids (a stream: the prompt's in
    # its first chunk, each chunk's new tokens)
    return_token_ids: bool = False

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs, **self.sampling_kwargs())


class ImageURL(_Model):
    url: str
    detail: str | None = None


class ContentPart(_Model):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class FunctionCall(_Model):
    name: str
    arguments: str


class ToolCallMessage(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    # validated when absent too: only an assistant's message may go without content
    content: str | list[ContentPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _content_needed(cls, content, info: ValidationInfo):
        # as OpenAI: null content is an assistant's (one that calls tools) only
        role = info.data.get("role")
        if content is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message needs content (a string or a list of parts)")
        return content

    def plain(self, image_token: str | None = None, images: list | None = None) -> dict:
        """The message as chat templates take it (tool calls' arguments as objects, as HF
        templates expect). Image parts become `image_token` (a vision-language model's
        placeholder; None: images are refused) in the text, their URLs appended to `images`."""
        if self.tool_calls and self.role != "assistant":
            raise ValueError("messages: only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("messages: a tool message needs tool_call_id")
        content = self.content
        if isinstance(content, list):
            kinds = {p.type for p in content}
            if kinds - {"text", "image_url"}:
                raise ValueError(f"messages: content parts of type {sorted(kinds - {'text', 'image_url'})} "
                                 "are not supported")
            parts = []
            for p in content:
                if p.type == "text":
                    parts.append(p.text or "")
                    continue
                if images is None:
                    raise ValueError("messages: image_url parts are not accepted here")
                if image_token is None:
                    raise ValueError("messages: this server takes no images (a text-only model, "
                                     "or data-parallel replicas, which do not carry images yet)")
                if p.image_url is None:
                    raise ValueError("messages: an image_url part needs image_url.url")
                if p.image_url.detail not in (None, "auto"):
                    raise ValueError(f"messages: image_url.detail {p.image_url.detail!r} is not "
                                     "supported (images are resized as the model's processor does: "
                                     "'auto' only)")
                images.append(p.image_url.url)
                parts.append(image_token)
            content = "".join(parts)
        msg = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in self.tool_calls]
        return msg


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(_Model):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def template_dict(self) -> dict:
        f = self.function
        d = {"name": f.name, "parameters": f.parameters or {"type": "object", "properties": {}}}
        if f.description is not None:
            d["description"] = f.description
        return {"type": "function", "function": d}


class FunctionName(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    tools: list[Tool] | None = None
    # OpenAI's default: "auto" when tools are given, "none" otherwise
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # an extension: at most this many prompt tokens, the oldest turns dropped to fit
    # (serve/context_budget.py)
    context_budget: int | None = Field(None, ge=1)

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def forced_tool(self) -> Tool | None:
        """The function a named tool_choice forces."""
        choice = self.tool_choice
        if not isinstance(choice, NamedToolChoice):
            return None
        for t in self.tools or ():
            if t.function.name == choice.function.name:
                return t
        raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is "
                         "not in tools")

    def constraint(self) -> StructuredOutputsParams | None:
        choice = self.effective_tool_choice
        forced = isinstance(choice, NamedToolChoice) or choice == "required"
        if not forced:
            return super().constraint()
        if super().constraint() is not None:
            raise ValueError("tool_choice: a forced tool call cannot be combined with "
                             "response_format or structured_outputs")
        if isinstance(choice, NamedToolChoice):
            schema = self.forced_tool().template_dict()["function"]["parameters"]
        else:
            schema = tools_schema(self.tools, self.parallel_tool_calls)
        return StructuredOutputsParams(json=schema, field_name="tool_choice")

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **self.sampling_kwargs())

    def check(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs set to true"
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            return "tool_choice", "tool_choice needs tools"
        if self.tools:
            names = [t.function.name for t in self.tools]
            if len(set(names)) != len(names):
                return "tools", "tools: function names must be unique"
        return super().check()


def tools_schema(tools: list[Tool], parallel: bool) -> dict:
    """tool_choice "required": a JSON array of one call or more, each {"name": one of the
    functions, "parameters": that function's arguments}. Shared $defs move to the top."""
    defs: dict = {}
    alternatives = []
    for t in tools:
        params = dict(t.template_dict()["function"]["parameters"])
        own = params.pop("$defs", {})
        if not isinstance(own, dict):
            raise ValueError(f"tools: $defs of {t.function.name!r} must be an object")
        for name, d in own.items():
            if defs.setdefault(name, d) != d:
                raise ValueError(f"tools: the $defs entry {name!r} differs between functions")
        alternatives.append({"type": "object", "properties": {
            "name": {"type": "string", "enum": [t.function.name]}, "parameters": params},
            "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1,
              "items": alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # rendered by the chat template, as in a chat request
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
