"""POST /v1/completions: one or several prompts (text or token ids), n choices each, streamed
as server-sent events (DELTA outputs: constant work per token) or answered at the end."""
from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse

from jaxllm.engine.async_engine import EngineDeadError
from serve import beam
from serve.errors import APIError, bad_request
from serve.protocol import CompletionRequest
from serve.streaming import (DONE, RequestFailed, add_usage, collect, event_stream, merge,
                             new_usage, sse, sse_error, usage_of)


def _prompt_list(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    return list(prompt)


async def create(server, request: Request):
    body = await server.body(request, CompletionRequest)
    engine = server.ready_engine()
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.echo and body.logprobs is not None and body.prompt_logprobs is None:
        body.prompt_logprobs = body.logprobs  # echoed prompt tokens carry logprobs too
    prompts = []
    for p in _prompt_list(body.prompt):
        try:
            text, ids, _ = await engine.tokenize(p)
            kept = body.truncated(ids, engine.max_model_len)
        except ValueError as e:
            raise bad_request(e) from None
        # a truncated prompt echoes the text of the tokens kept
        prompts.append((text if len(kept) == len(ids) else None, kept))
    base = f"cmpl-{uuid.uuid4().hex}"
    if body.use_beam_search:
        checked = [await beam.check_prompt(server, ids, body) for _, ids in prompts]
        server.admit(body)
        return await beam.respond(server, request, base, checked, body, chat=False)
    items = []
    for text, ids in prompts:
        req = await server.processed(body, text, ids, body.max_tokens, body.stream)
        if text is None:  # echo needs the text of token-id prompts (their ids are checked now)
            text = await engine.decode(ids) if engine.tokenizer is not None else ""
        items.append((req, text))
    server.admit(body)
    gens = [server.run(f"{base}-{i}", req, body.priority) for i, (req, _) in enumerate(items)]
    if body.stream:
        return event_stream(_stream(server, base, body, items, gens))
    outs = await collect(request, gens)
    choices, usage = [], new_usage()
    for i, ((_, text), out) in enumerate(zip(items, outs)):
        add_usage(usage, *usage_of(out))
        for c in out.outputs:
            lp = None
            if body.logprobs is not None:
                lp = _logprobs(engine, out.prompt_token_ids, out.prompt_logprobs if body.echo else None,
                               c.token_ids, c.logprobs, 0)
            choice = {"index": i * body.n + c.index,
                      "text": (text if body.echo else "") + c.text, "logprobs": lp,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if body.return_token_ids:
                choice["prompt_token_ids"] = out.prompt_token_ids
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
    return JSONResponse({"id": base, "object": "text_completion", "created": int(time.time()),
                         "model": server.model_name(body), "choices": choices, "usage": usage})


async def _stream(server, base, body, items, gens):
    engine = server.engine
    created, model = int(time.time()), server.model_name(body)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    usage = new_usage()
    offsets: dict[tuple[int, int], int] = {}   # (prompt, choice) -> characters sent
    tokens: dict[int, int] = {}                # prompt -> completion tokens sent

    def chunk(choices, usage_=None):
        return sse({"id": base, "object": "text_completion", "created": created, "model": model,
                    "choices": choices, "usage": usage_})

    try:
        async for i, out in merge(gens):
            _, text = items[i]
            for c in out.outputs:  # only the choices with something new
                key = (i, c.index)
                first = key not in offsets
                prefix = text if body.echo and first else ""
                lp = None
                if body.logprobs is not None:
                    lp = _logprobs(engine, out.prompt_token_ids,
                                   out.prompt_logprobs if body.echo and first else None,
                                   c.token_ids, c.logprobs, offsets.get(key, 0))
                offsets[key] = offsets.get(key, 0) + len(prefix) + len(c.text)
                tokens[i] = tokens.get(i, 0) + len(c.token_ids)
                finished = c.finish_reason is not None
                choice = {"index": i * body.n + c.index, "text": prefix + c.text, "logprobs": lp,
                          "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason if finished else None}
                if body.return_token_ids:
                    choice["prompt_token_ids"] = out.prompt_token_ids if first else None
                    choice["token_ids"] = list(c.token_ids)
                yield chunk([choice])
            if out.finished:
                add_usage(usage, len(out.prompt_token_ids), tokens.get(i, 0), out.num_cached_tokens)
        if include_usage:
            yield chunk([], usage)
        yield DONE
    except (ValueError, EngineDeadError, RequestFailed) as e:  # failed after the stream began
        yield sse_error(e)
    finally:
        for g in gens:
            await g.aclose()


def _logprobs(engine, prompt_ids, prompt_logprobs, token_ids, logprobs, offset: int) -> dict:
    """OpenAI's completions logprobs for these tokens (after the echoed prompt's, if given);
    text offsets continue from `offset` characters already sent."""
    text = engine.token_text
    tokens, token_lps, tops = [], [], []
    if prompt_logprobs is not None:
        for tid, entry in zip(prompt_ids, prompt_logprobs):
            tokens.append(text(tid))
            token_lps.append(None if entry is None else entry[tid].logprob)
            tops.append(None if entry is None else {text(t): lp.logprob for t, lp in entry.items()})
    for tid, entry in zip(token_ids, logprobs or ()):
        tokens.append(text(tid))
        token_lps.append(entry[tid].logprob)
        tops.append({text(t): lp.logprob for t, lp in entry.items()})
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
