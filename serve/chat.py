"""POST /v1/chat/completions: the model's chat template over the messages, n choices,
streamed as server-sent events (DELTA outputs) or answered at the end."""
from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse

from jaxllm.engine.async_engine import EngineDeadError
from serve import beam, context_budget
from serve.errors import APIError, bad_request
from serve.protocol import ChatCompletionRequest, NamedToolChoice
from serve.streaming import (DONE, RequestFailed, add_usage, collect, event_stream, new_usage, sse,
                             sse_error, usage_of)
from serve.tool_parsers import REQUIRED, ToolCall, new_call_id


class _Tools:
    """How a request's tool calls come out: forced to one named function (the whole output is
    its arguments), forced to the array `required` produces, or parsed from the model's own
    syntax (`auto`, with the server's parser)."""

    def __init__(self, server, body: ChatCompletionRequest):
        choice = body.effective_tool_choice
        self.named = body.forced_tool().function.name if isinstance(choice, NamedToolChoice) else None
        self.parser = None
        if choice == "required":
            self.parser = REQUIRED
        elif choice == "auto" and body.tools:
            if server.tool_parser is None:
                raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                               "--tool-call-parser to be set", param="tool_choice")
            self.parser = server.tool_parser
        self.parallel = body.parallel_tool_calls

    @property
    def active(self) -> bool:
        return self.named is not None or self.parser is not None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A whole output as an assistant message, and its finish reason."""
        if self.named is not None:
            # as OpenAI: a named tool_choice finishes with "stop"
            return ({"role": "assistant", "content": None,
                     "tool_calls": [ToolCall(self.named, text).to_openai()]}, finish_reason)
        content, calls = self.parser.extract(text) if self.parser else (text, [])
        if not self.parallel:
            calls = calls[:1]
        msg = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [c.to_openai() for c in calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return msg, finish_reason


async def create(server, request: Request):
    body = await server.body(request, ChatCompletionRequest)
    engine = server.ready_engine()
    server.require_tokenizer("messages", "chat (its template)")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    try:
        tools = _Tools(server, body)
        images: list[str] = []
        messages = [m.plain(engine.image_token, images) for m in body.messages]
        template_tools = [t.template_dict() for t in body.tools] if body.tools else None

        def render(msgs):
            return engine.render_chat(msgs, body.add_generation_prompt, body.continue_final_message,
                                      body.chat_template, template_tools)
        trimmed = None
        budget = server.chat_budget(body, max_tokens)
        if images and (budget is not None or body.use_beam_search):
            raise ValueError("messages: images do not combine with "
                             + ("beam search" if body.use_beam_search else "chat trimming budgets") + " yet")
        if images:
            engine.inputs.check_image_count(len(images))  # before any is fetched or decoded
        decoded = await server.load_images(images) if images else None
        if budget is not None:
            trimmed = await context_budget.trim(messages, render, budget,
                                                   server.chat_trim_step_tokens(body),
                                                   engine.count_tokens)
            ids = trimmed.ids
            if trimmed.dropped_messages:
                server.metrics.on_trimmed(server.model_name(body), trimmed.dropped_tokens)
        else:
            ids = await render(messages)
            if images:  # each image as the tokens it becomes, before the length is checked
                ids = engine.inputs.widen_images(ids)
            server.check_prompt_budget(len(ids))
        ids = body.truncated(ids, engine.max_model_len)
    except ValueError as e:
        raise bad_request(e) from None
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    if body.use_beam_search:
        checked = await beam.check_prompt(server, ids, body, max_tokens)
        server.admit(body)
        return _report_trim(await beam.respond(server, request, rid, [checked], body, chat=True),
                            trimmed)
    req = await server.processed(body, None, ids, max_tokens, body.stream, decoded)
    server.admit(body)
    gen = server.run(rid, req, body.priority)
    if body.stream:
        return _report_trim(event_stream(_stream(server, rid, body, gen, tools, trimmed)), trimmed)
    (out,) = await collect(request, [gen])
    usage = _trim_usage(add_usage(new_usage(), *usage_of(out)), trimmed)
    k = body.top_logprobs or 0
    choices = []
    for c in out.outputs:
        message, finish_reason = tools.message(c.text, c.finish_reason)
        choices.append({"index": c.index, "message": message,
                        "logprobs": _logprobs(engine, c.token_ids, c.logprobs, k) if body.logprobs else None,
                        "finish_reason": finish_reason, "stop_reason": c.stop_reason})
    return _report_trim(JSONResponse({
        "id": rid, "object": "chat.completion", "created": int(time.time()),
        "model": server.model_name(body), "choices": choices, "usage": usage}), trimmed)


TRIM_HEADER = "x-jaxllm-trimmed-messages"


def _trim_usage(usage: dict, trimmed: context_budget.Trimmed | None) -> dict:
    """A budgeted request's usage says what the budget dropped (an extension of OpenAI's)."""
    if trimmed is not None:
        usage["trimmed_messages"] = trimmed.dropped_messages
        usage["trimmed_prompt_tokens"] = trimmed.dropped_tokens
    return usage


def _report_trim(response, trimmed: context_budget.Trimmed | None):
    if trimmed is not None:
        response.headers[TRIM_HEADER] = str(trimmed.dropped_messages)
    return response


async def _stream(server, rid, body, gen, tools: _Tools, trimmed):
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
        streams = {}  # per choice: its tool-call stream
        async for out in gen:
            for c in out.outputs:  # only the choices with something new
                completion_tokens += len(c.token_ids)
                finished = c.finish_reason is not None
                lp = _logprobs(engine, c.token_ids, c.logprobs, k) if body.logprobs else None
                delta, finish_reason = {"content": c.text} if c.text else {}, c.finish_reason
                if tools.active:
                    s = streams.get(c.index)
                    if s is None:
                        s = streams[c.index] = _ToolDeltas(tools)
                    delta, finish_reason = s.delta(c.text, finish_reason)
                yield chunk([{"index": c.index, "delta": delta,
                              "logprobs": lp, "finish_reason": finish_reason,
                              "stop_reason": c.stop_reason if finished else None}])
        if include_usage and out is not None:
            yield chunk([], _trim_usage(add_usage(new_usage(), len(out.prompt_token_ids),
                                                  completion_tokens, out.num_cached_tokens), trimmed))
        yield DONE
    except (ValueError, EngineDeadError, RequestFailed) as e:  # failed after the stream began
        yield sse_error(e)
    finally:
        await gen.aclose()


class _ToolDeltas:
    """One streamed choice's text as OpenAI's deltas: content, and tool calls as
    {index, id, type, function: {name, arguments: ""}} then pieces of their arguments."""

    def __init__(self, tools: _Tools):
        self.tools = tools
        self.stream = tools.parser.stream() if tools.parser is not None else None
        self.id = new_call_id()
        self.started = False
        self.num_calls = 0

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        tools, out = self.tools, {}
        if tools.named is not None:
            calls = []
            if not self.started:
                self.started = True
                calls.append({"index": 0, "id": self.id, "type": "function",
                              "function": {"name": tools.named, "arguments": ""}})
            if text:
                calls.append({"index": 0, "function": {"arguments": text}})
            return ({"tool_calls": calls} if calls else {}), finish_reason
        content, calls = self.stream.feed(text, final=finish_reason is not None)
        if not tools.parallel:
            calls = [c for c in calls if c["index"] == 0]
        self.num_calls = max([self.num_calls] + [c["index"] + 1 for c in calls])
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        if finish_reason == "stop" and self.num_calls:
            finish_reason = "tool_calls"
        return out, finish_reason


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
