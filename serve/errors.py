"""OpenAI error bodies, and the checks on raw JSON that come before any model validation."""
from __future__ import annotations

import re

from starlette.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status,
                        headers=e.headers)


def bad_request(e: ValueError) -> APIError:
    """A ValueError from the engine's validation, as a 400 naming the field it names."""
    return APIError(400, str(e), param=field_of(str(e)))


_FIELDS = {"max_tokens", "n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed",
           "stop_token_ids", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs", "logprobs",
           "min_tokens", "prompt", "cache_salt", "beam_width", "messages", "response_format",
           "structured_outputs", "tools", "tool_choice", "parallel_tool_calls",
           "truncate_prompt_tokens", "context_budget"}


def field_of(message: str) -> str | None:
    """The request field a validation message names: our messages start with it."""
    m = re.match(r"[a-z_]+", message)
    return m.group(0) if m and m.group(0) in _FIELDS else None


MAX_JSON_DEPTH = 32


def check_json(value, path: str = "", depth: int = 0) -> None:
    """Refuse what pydantic and the tokenizer would choke on: nesting deeper than any request
    needs, and strings that are not valid Unicode (JSON can escape a lone UTF-16 surrogate)."""
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep",
                       param=path.split(".")[0] or None, code="invalid_json")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"{path or 'body'}: invalid Unicode (a lone surrogate)",
                           param=path.split(".")[0] or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_json(k, path, depth + 1)
            check_json(v, f"{path}.{k}" if path else str(k), depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_json(v, f"{path}.{i}" if path else str(i), depth + 1)
