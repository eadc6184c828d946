"""/v1/models (the base model and its LoRA adapters), /v1/load_lora_adapter and
/v1/unload_lora_adapter (with JAXLLM_ALLOW_RUNTIME_LORA_UPDATING), /tokenize, /detokenize."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse

from jaxllm.lora import LoRARequest
from serve.errors import APIError, bad_request
from serve.protocol import (DetokenizeRequest, LoadLoRAAdapterRequest, TokenizeRequest,
                            UnloadLoRAAdapterRequest)


async def list_models(server, request: Request):
    engine = server.ready_engine()
    base = server.cfg.served_model_name
    card = {"object": "model", "created": server.created, "owned_by": "jaxllm",
            "max_model_len": engine.max_model_len}
    data = [{"id": base, **card, "root": engine.config.model or base, "parent": None}]
    data += [{"id": lr.lora_name, **card, "root": lr.lora_path, "parent": lr.base_model_name or base}
             for lr in server.loras.values()]
    return JSONResponse({"object": "list", "data": data})


async def load_lora(server, request: Request):
    """Register an adapter under a new name; it is read and checked in the tokenizer pool
    while steps go on, and refused (400, the reason) if it does not fit the base model."""
    body = await server.body(request, LoadLoRAAdapterRequest)
    engine = server.ready_engine()
    if not body.lora_name or not body.lora_path:
        raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
    async with server.lora_lock:
        if body.lora_name in server.loras or body.lora_name == server.cfg.served_model_name:
            raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded.",
                           param="lora_name")
        lora = LoRARequest(body.lora_name, server.next_lora_id, body.lora_path)
        try:
            await engine.add_lora(lora)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_path") from None
        server.loras[lora.lora_name] = lora
        server.next_lora_id += 1
    return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' added successfully.")


async def unload_lora(server, request: Request):
    """New requests can no longer name it; requests already running with it finish."""
    body = await server.body(request, UnloadLoRAAdapterRequest)
    engine = server.ready_engine()
    async with server.lora_lock:
        lora = server.loras.get(body.lora_name)
        if lora is None or (body.lora_int_id is not None and body.lora_int_id != lora.lora_int_id):
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.",
                           param="lora_name", code="model_not_found")
        del server.loras[lora.lora_name]
        await engine.remove_lora(lora.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' removed successfully.")


async def tokenize(server, request: Request):
    body = await server.body(request, TokenizeRequest)
    engine = server.ready_engine()
    server.require_tokenizer("messages" if body.messages is not None else "prompt", "/tokenize")
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
    server.require_tokenizer("tokens", "/detokenize")
    return JSONResponse({"prompt": await engine.decode(body.tokens)})
