"""POST /v1/chat/completions: the model's chat template over the messages, n choices,
streamed as server-sent events (DELTA outputs) or answered at the end."""
from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse

from jaxllm.engine.async_engine import EngineDeadError
from serve import beam
from serve.errors import bad_request
from serve.protocol import ChatCompletionRequest
from serve.streaming import (DONE, add_usage, collect, event_stream, new_usage, sse, sse_error,
                             usage_of)


async def create(server, request: Request):
    body = await server.body(request, ChatCompletionRequest)
    engine = server.ready_engine()
    server.require_tokenizer()
    try:
        messages = [m.plain() for m in body.messages]
        ids = await engine.render_chat(messages, body.add_generation_prompt,
                                       body.continue_final_message, body.chat_template)
    except ValueError as e:
        raise bad_request(e) from None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    if body.use_beam_search:
        checked = await beam.check_prompt(server, ids, body, max_tokens)
        server.admit()
        return await beam.respond(server, request, rid, [checked], body, chat=True)
    req = await server.processed(body, None, ids, max_tokens, body.stream)
    server.admit()
    gen = server.run(rid, req, body.priority)
    if body.stream:
        return event_stream(_stream(server, rid, body, gen))
    (out,) = await collect(request, [gen])
    usage = add_usage(new_usage(), *usage_of(out))
    k = body.top_logprobs or 0
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": _logprobs(engine, c.token_ids, c.logprobs, k) if body.logprobs else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
               for c in out.outputs]
    return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()),
                         "model": server.model_name(body), "choices": choices, "usage": usage})


async def _stream(server, rid, body, gen):
    engine = server.engine
    created, model = int(time.time()), server.model_name(body)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    k = body.top_logprobs or 0
    completion_tokens = 0

    def chunk(choices, usage=None):
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": choices, "usage": usage})

    try:
        for i in range(body.n):  # the role comes first, once per choice
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        out = None
        async for out in gen:
            for c in out.outputs:  # only the choices with something new
                completion_tokens += len(c.token_ids)
                finished = c.finish_reason is not None
                lp = _logprobs(engine, c.token_ids, c.logprobs, k) if body.logprobs else None
                yield chunk([{"index": c.index, "delta": {"content": c.text} if c.text else {},
                              "logprobs": lp, "finish_reason": c.finish_reason,
                              "stop_reason": c.stop_reason if finished else None}])
        if include_usage and out is not None:
            yield chunk([], add_usage(new_usage(), len(out.prompt_token_ids), completion_tokens,
                                      out.num_cached_tokens))
        yield DONE
    except (ValueError, EngineDeadError) as e:  # the request failed after the stream began
        yield sse_error(e)
    finally:
        await gen.aclose()


def _logprobs(engine, token_ids, logprobs, k: int) -> dict:
    """OpenAI's chat logprobs: each token with its k most likely alternatives."""
    text = engine.token_text
    content = []
    for tid, entry in zip(token_ids, logprobs or ()):
        t = text(tid)
        top = sorted(((a, lp) for a, lp in entry.items() if lp.rank is not None and lp.rank <= k),
                     key=lambda x: x[1].rank)
        content.append({
            "token": t, "logprob": entry[tid].logprob, "bytes": list(t.encode()),
            "top_logprobs": [{"token": text(a), "logprob": lp.logprob,
                              "bytes": list(text(a).encode())} for a, lp in top]})
    return {"content": content}
