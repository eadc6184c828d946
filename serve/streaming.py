"""What the endpoints share about running requests: submitting with metrics, collecting final
outputs (aborting on disconnect), merging several streams, server-sent events, usage."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse

from jaxllm.engine.async_engine import RequestLostError
from serve.errors import APIError, bad_request, error_body, field_of


class DisconnectAwareStreamingResponse(StreamingResponse):
    """Always watches for the client going away while streaming, so that a disconnect cancels
    the stream (and aborts its request) at once, not at the next write."""

    async def __call__(self, scope, receive, send):
        async with asyncio.TaskGroup() as tg:
            stream = tg.create_task(self.stream_response(send))

            async def watch():
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        stream.cancel()
                        return

            watcher = tg.create_task(watch())
            with contextlib.suppress(asyncio.CancelledError):
                await stream
            watcher.cancel()


def event_stream(events) -> DisconnectAwareStreamingResponse:
    return DisconnectAwareStreamingResponse(events, media_type="text/event-stream")


class RequestFailed(APIError):
    """The engine failed a step that ran this request (the engine itself goes on)."""

    def __init__(self, message: str, code: str = "step_failed"):
        super().__init__(500, f"the request failed: {message}", type="server_error", code=code)


class Outputs:
    """A submitted request's outputs. Finished ones feed the latency metrics; closing it
    before the end aborts the request, even if it was never iterated."""

    def __init__(self, server, rid: str, outputs, model: str):
        """model: what the request asked for (the base model or an adapter), its metrics' label."""
        self.server, self.rid, self._it, self.finished = server, rid, outputs, False
        self.model = model
        self._last = None  # when the previous output came (a stream's inter-token latency)

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            out = await self._it.__anext__()
        except RequestLostError as e:
            self.finished = True
            raise RequestFailed(str(e), code="replica_failed") from None
        metrics = self.server.metrics
        now = time.monotonic()
        if self._last is not None:
            metrics.on_stream_output(self.model, now - self._last,
                                     sum(len(c.token_ids) for c in out.outputs))
        self._last = now
        if out.finished:
            self.finished = True
            metrics.on_finished(out, self.model)
        for c in out.outputs:
            if c.finish_reason == "error":  # the whole request ends (its other choices too)
                raise RequestFailed(c.error or "its step failed")
        return out

    async def aclose(self):
        if not self.finished:
            self.server.engine.abort(self.rid)
        await self._it.aclose()


async def collect(request: Request, gens: list[AsyncIterator]) -> list:
    """The last output of each generator; all are aborted if the client goes away."""
    async def last(gen):
        out = None
        try:
            async for out in gen:
                pass
        finally:
            await gen.aclose()
        return out

    tasks = [asyncio.create_task(last(g)) for g in gens]

    async def disconnected():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.create_task(disconnected())
    gathered = asyncio.gather(*tasks)
    done, _ = await asyncio.wait([gathered, watcher], return_when=asyncio.FIRST_COMPLETED)
    if watcher in done:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # (retrieved: no "never retrieved" log)
            await gathered
        raise APIError(499, "client disconnected")
    watcher.cancel()
    try:
        return gathered.result()
    except ValueError as e:
        raise bad_request(e) from None


async def merge(gens: list[AsyncIterator]):
    """(index, output) from several generators as they arrive."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, g):
        try:
            async for out in g:
                await queue.put((i, out))
        except Exception as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(gens)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        # the pumps must be done with their generators before anyone closes those
        await asyncio.gather(*tasks, return_exceptions=True)


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


def sse_error(e: Exception) -> str:
    """A failure after the stream began: an error event, then the end."""
    if isinstance(e, APIError):
        return sse(error_body(e.message, e.type, e.param, e.code)) + DONE
    return sse(error_body(str(e), param=field_of(str(e)))) + DONE


def new_usage() -> dict:
    return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
            "prompt_tokens_details": {"cached_tokens": 0}}


def add_usage(usage: dict, prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    usage["prompt_tokens"] += prompt_tokens
    usage["completion_tokens"] += completion_tokens
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    usage["prompt_tokens_details"]["cached_tokens"] += cached
    return usage


def usage_of(out) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens of a final (not delta) RequestOutput."""
    return (len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs),
            out.num_cached_tokens)
