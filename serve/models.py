"""/v1/models, /tokenize and /detokenize."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from serve.errors import APIError, bad_request
from serve.protocol import DetokenizeRequest, TokenizeRequest


async def list_models(server, request: Request):
    engine = server.ready_engine()
    return JSONResponse({"object": "list", "data": [{
        "id": server.cfg.served_model_name, "object": "model", "created": server.created,
        "owned_by": "jaxllm", "root": engine.config.model or server.cfg.served_model_name,
        "max_model_len": engine.max_model_len}]})


async def tokenize(server, request: Request):
    body = await server.body(request, TokenizeRequest)
    engine = server.ready_engine()
    server.require_tokenizer()
    try:
        if body.messages is not None:
            tools = [t.template_dict() for t in body.tools] if body.tools else None
            ids = await engine.render_chat([m.plain() for m in body.messages],
                                           body.add_generation_prompt, False, None, tools)
        elif body.prompt is not None:
            ids = await engine.encode(body.prompt, body.add_special_tokens)
        else:
            raise APIError(400, "give prompt or messages", param="prompt")
    except ValueError as e:
        raise bad_request(e) from None
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})


async def detokenize(server, request: Request):
    body = await server.body(request, DetokenizeRequest)
    engine = server.ready_engine()
    if any(t < 0 or t >= engine.vocab_size for t in body.tokens):
        raise APIError(400, "tokens contain ids outside the vocabulary", param="tokens")
    server.require_tokenizer()
    return JSONResponse({"prompt": await engine.decode(body.tokens)})
