"""The OpenAPI document of the server, generated from the protocol models (served at
/openapi.json; the fuzz test draws request bodies from it)."""
from __future__ import annotations

from pydantic.json_schema import models_json_schema

import jaxllm
from serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                            TokenizeRequest)

_POSTS = {
    "/v1/completions": (CompletionRequest, "Create a completion"),
    "/v1/chat/completions": (ChatCompletionRequest, "Create a chat completion"),
    "/tokenize": (TokenizeRequest, "Tokenize a prompt or chat"),
    "/detokenize": (DetokenizeRequest, "Detokenize token ids"),
}
_GETS = {"/v1/models": "List the served models", "/health": "Liveness (500 once the engine died)",
         "/health/ready": "Readiness (503 while loading)", "/metrics": "Prometheus metrics",
         "/version": "Server version"}

_ERROR = {"description": "An OpenAI error body",
          "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def openapi_document() -> dict:
    models = [m for m, _ in _POSTS.values()]
    refs, defs = models_json_schema([(m, "validation") for m in models],
                                    ref_template="#/components/schemas/{model}")
    schemas = dict(defs.get("$defs", {}))
    schemas["Error"] = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
    paths = {}
    for path, (model, summary) in _POSTS.items():
        paths[path] = {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": refs[(model, "validation")]}}},
            "responses": {"200": {"description": "OK"}, "400": _ERROR, "401": _ERROR,
                          "404": _ERROR, "429": _ERROR, "503": _ERROR}}}
    for path, summary in _GETS.items():
        paths[path] = {"get": {"summary": summary, "responses": {"200": {"description": "OK"}}}}
    return {"openapi": "3.1.0", "info": {"title": "jaxllm", "version": jaxllm.__version__},
            "paths": paths, "components": {"schemas": schemas}}
