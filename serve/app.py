"""The OpenAI-compatible Starlette app: completions and chat (streamed or not), models,
health and readiness, Prometheus metrics, tokenize/detokenize, API keys, admission control,
cancellation on disconnect and graceful shutdown."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import jaxllm
from jaxllm.config import EngineConfig
from jaxllm.engine.async_engine import AsyncEngine, EngineDeadError
from jaxllm.beam_search import BeamSearch, BeamSearchParams
from jaxllm.runner.sampler import MAX_LOGPROBS
from jaxllm.sampling_params import SamplingParams
from serve.metrics import Metrics
from serve.openapi import openapi_document
from serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                            TokenizeRequest)

logger = logging.getLogger("jaxllm")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def error_response(e: APIError) -> JSONResponse:
    body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_queue_len: int | None = None
    log_interval: float = 10.0


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


class OpenAIServer:
    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig,
                 on_fatal=None):
        """on_fatal: called on the event loop when the engine fails (to start or later);
        `jaxllm serve` then stops the server and exits 1."""
        self.cfg = server_config
        self.metrics = Metrics(server_config.served_model_name)
        self.engine = AsyncEngine(engine_config, on_step=self.metrics.on_step,
                                  on_fail=self._engine_failed)
        self.created = int(time.time())
        self.on_fatal = on_fatal
        self._loop = None
        self._log_task = None
        self._warned_fields: set[str] = set()

    # lifecycle
    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self._loop = asyncio.get_running_loop()
        self.engine.start()
        self._log_task = asyncio.create_task(self._periodic_log())
        try:
            yield
        finally:
            self._log_task.cancel()
            self.engine.shutdown()

    def _engine_failed(self, error: BaseException) -> None:
        """From the engine thread: hand the failure to the event loop."""
        if self._loop is not None and self.on_fatal is not None:
            self._loop.call_soon_threadsafe(self.on_fatal)

    async def _periodic_log(self):
        while True:
            await asyncio.sleep(self.cfg.log_interval)
            if self.engine.is_ready:
                self.metrics.log_line(self.engine.engine)

    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self._wrap(self.completions, auth=True), methods=["POST"]),
            Route("/v1/chat/completions", self._wrap(self.chat, auth=True), methods=["POST"]),
            Route("/v1/models", self._wrap(self.models, auth=True), methods=["GET"]),
            Route("/health", self._wrap(self.health), methods=["GET"]),
            Route("/health/ready", self._wrap(self.health_ready), methods=["GET"]),
            Route("/metrics", self._wrap(self.prometheus), methods=["GET"]),
            Route("/tokenize", self._wrap(self.tokenize), methods=["POST"]),
            Route("/detokenize", self._wrap(self.detokenize), methods=["POST"]),
            Route("/version", self._wrap(self.version), methods=["GET"]),
            Route("/openapi.json", self._wrap(self.openapi), methods=["GET"]),
        ]
        return Starlette(routes=routes, lifespan=self.lifespan,
                         exception_handlers={404: self._not_found, 405: self._not_allowed})

    async def _not_found(self, request, exc):
        return error_response(APIError(404, f"no route {request.url.path}", code="not_found"))

    async def _not_allowed(self, request, exc):
        return error_response(APIError(405, f"method {request.method} not allowed on {request.url.path}"))

    def _wrap(self, handler, auth: bool = False):
        async def endpoint(request: Request):
            try:
                if auth:
                    self._check_key(request)
                return await handler(request)
            except APIError as e:
                return error_response(e)
            except EngineDeadError as e:
                return error_response(APIError(503, f"the engine is not running: {e}",
                                               type="server_error", code="engine_dead"))
        return endpoint

    def _check_key(self, request: Request) -> None:
        key = self.cfg.api_key
        if not key:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "invalid or missing API key", type="authentication_error",
                           code="invalid_api_key")

    # helpers
    @staticmethod
    def _tokenizer(engine):
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token-id prompts", param="prompt")
        return engine.tokenizer

    def _engine(self):
        if self.engine.error is not None:
            raise EngineDeadError(str(self.engine.error))
        if not self.engine.is_ready:
            raise APIError(503, "the model is still loading", type="server_error",
                           code="not_ready", headers={"Retry-After": "5"})
        return self.engine.engine

    async def _body(self, request: Request, model_cls):
        ctype = request.headers.get("content-type", "")
        if "application/json" not in ctype:
            raise APIError(400, f"Content-Type must be application/json, got {ctype!r}",
                           code="invalid_content_type")
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
        except RecursionError:
            raise APIError(400, "the JSON body is nested too deeply", code="invalid_json") from None
        check_json(data)
        try:
            body = model_cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(x) for x in err["loc"]) or None
            raise APIError(400, f"{param}: {err['msg']}", param=param) from None
        refused = body.refused_field()
        if refused is not None:
            raise APIError(400, f"{refused} is not supported by this server yet", param=refused,
                           code="unsupported_parameter")
        problem = body.check() if hasattr(body, "check") else None
        if problem is not None:
            raise APIError(400, problem[1], param=problem[0])
        unknown = [f for f in body.unknown_fields() if f not in self._warned_fields]
        if unknown:
            self._warned_fields.update(unknown)
            logger.warning("request fields ignored (not part of the API; warned once each): %s",
                           ", ".join(unknown))
        return body

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.cfg.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")

    def _admit(self) -> None:
        limit = self.cfg.max_queue_len
        if limit is not None and self.engine.num_waiting() >= limit:
            raise APIError(429, f"the waiting queue is full ({limit} requests)",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})

    def _params(self, body, num_prompt_tokens: int, default_max):
        engine = self._engine()
        limit = engine.config.max_model_len
        max_tokens = default_max
        if max_tokens is None:
            max_tokens = limit - num_prompt_tokens
        elif max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if num_prompt_tokens + max_tokens > limit or max_tokens < 1:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, "
                           f"you requested {num_prompt_tokens + max_tokens} tokens "
                           f"({num_prompt_tokens} in the prompt, {max_tokens} for the completion).",
                           param="max_tokens", code="context_length_exceeded")
        if body.stream and body.best_of is not None and body.best_of > body.n:
            # the best n are known only at the end
            raise APIError(400, "best_of > n cannot be streamed", param="best_of")
        try:
            if body.use_beam_search:
                params = BeamSearchParams(beam_width=body.n, max_tokens=max_tokens,
                                          ignore_eos=body.ignore_eos,
                                          temperature=body.temperature or 0.0,
                                          length_penalty=body.length_penalty)
                if 2 * body.n > MAX_LOGPROBS:
                    raise ValueError(f"n (the beam width) must be at most {MAX_LOGPROBS // 2} with use_beam_search")
                return params
            return body.to_sampling_params(max_tokens)
        except ValueError as e:
            raise APIError(400, str(e), param=_field_of(str(e))) from None

    async def _beam_search(self, request: Request, base: str, ids: list[int], params: BeamSearchParams,
                           body):
        """Beam search through the shared engine: each step's one-token requests run in the
        continuous batch beside everything else."""
        engine = self.engine.engine
        search = BeamSearch([ids], params, engine.eos_token_id)
        step = 0
        while pending := search.pending():
            gens = [self._run(f"{base}-beam{step}-{j}", {"prompt_token_ids": t, **_salt(body)},
                              search.step_params(), body.priority)
                    for j, t in enumerate(pending)]
            outs = await self._collect(request, gens)
            search.advance([o.outputs[0].logprobs[0] for o in outs])
            step += 1
        seqs = search.results()[0].sequences
        for s in seqs:
            s.text = engine.tokenizer.decode(s.tokens[len(ids):], skip_special_tokens=True) if engine.tokenizer else ""
        return seqs

    def _beam_choices(self, seqs, prompt_len: int, chat: bool, offset: int = 0) -> list[dict]:
        choices = []
        for i, s in enumerate(seqs):
            c = {"index": offset + i, "finish_reason": s.finish_reason, "stop_reason": None,
                 "logprobs": None}
            if chat:
                c["message"] = {"role": "assistant", "content": s.text}
            else:
                c["text"] = s.text
            choices.append(c)
        return choices

    async def _beam_response(self, request, base, prompts_ids, params, body, chat: bool):
        stream = body.stream
        choices, usage = [], _usage()
        for k, ids in enumerate(prompts_ids):
            seqs = await self._beam_search(request, f"{base}-{k}", ids, params, body)
            choices += self._beam_choices(seqs, len(ids), chat, offset=k * params.beam_width)
            usage["prompt_tokens"] += len(ids)
            usage["completion_tokens"] += sum(len(s.tokens) - len(ids) for s in seqs)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        obj = "chat.completion" if chat else "text_completion"
        body = {"id": base, "object": obj, "created": int(time.time()),
                "model": self.cfg.served_model_name, "choices": choices, "usage": usage}
        if not stream:
            return JSONResponse(body)

        async def events():  # beams are only final at the end: one chunk per choice
            for c in choices:
                if chat:
                    c = {"index": c["index"], "delta": {"role": "assistant", "content": c["message"]["content"]},
                         "logprobs": None, "finish_reason": c["finish_reason"]}
                yield _sse({**body, "object": obj + (".chunk" if chat else ""), "choices": [c],
                            "usage": None})
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    def _validate(self, prompt, params) -> list[int]:
        try:
            _, ids, _ = self._engine().validate_request(prompt, params)
        except ValueError as e:
            raise APIError(400, str(e), param=_field_of(str(e))) from None
        return ids

    def _run(self, rid: str, prompt, params, priority: int) -> "_Outputs":
        """Submit now (admission control counts it at once); iterate for the outputs."""
        return _Outputs(self, rid, self.engine.submit(rid, prompt, params, priority))

    async def _collect(self, request: Request, gens: list[AsyncIterator]) -> list:
        """The final outputs of several generators; all are aborted if the client goes away."""
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
            await asyncio.gather(*tasks, return_exceptions=True)
            raise APIError(499, "client disconnected")
        watcher.cancel()
        try:
            return gathered.result()
        except ValueError as e:
            raise APIError(400, str(e), param=_field_of(str(e))) from None

    # endpoints
    async def health(self, request: Request):
        if self.engine.error is not None:  # as vLLM: a dead engine is a server error
            return JSONResponse({"status": "error", "error": str(self.engine.error)}, status_code=500)
        return JSONResponse({"status": "ok"})

    async def health_ready(self, request: Request):
        if self.engine.is_ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "loading" if self.engine.error is None else "error"},
                            status_code=503)

    async def version(self, request: Request):
        return JSONResponse({"version": jaxllm.__version__})

    async def openapi(self, request: Request):
        return JSONResponse(openapi_document())

    async def prometheus(self, request: Request):
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request):
        engine = self._engine()
        return JSONResponse({"object": "list", "data": [{
            "id": self.cfg.served_model_name, "object": "model", "created": self.created,
            "owned_by": "jaxllm", "root": engine.config.model or self.cfg.served_model_name,
            "max_model_len": engine.config.max_model_len}]})

    async def tokenize(self, request: Request):
        body = await self._body(request, TokenizeRequest)
        self._check_model(body.model)
        engine = self._engine()
        tok = self._tokenizer(engine)
        if body.messages is not None:
            ids = self._chat_ids(engine, [m.plain() for m in body.messages], body.add_generation_prompt,
                                 False, None)
        elif body.prompt is not None:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "give prompt or messages", param="prompt")
        return JSONResponse({"tokens": ids, "count": len(ids),
                             "max_model_len": engine.config.max_model_len})

    async def detokenize(self, request: Request):
        body = await self._body(request, DetokenizeRequest)
        self._check_model(body.model)
        engine = self._engine()
        if any(t < 0 or t >= engine.arch.vocab_size for t in body.tokens):
            raise APIError(400, "tokens contain ids outside the vocabulary", param="tokens")
        return JSONResponse({"prompt": self._tokenizer(engine).decode(body.tokens)})

    # completions
    async def completions(self, request: Request):
        body = await self._body(request, CompletionRequest)
        self._check_model(body.model)
        engine = self._engine()
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompts = _prompt_list(body.prompt)
        if body.echo and body.logprobs is not None and body.prompt_logprobs is None:
            body.prompt_logprobs = body.logprobs  # echoed prompt tokens carry logprobs too
        items = []
        for p in prompts:
            ids = self._validate(p, _PROBE)  # text is tokenized; ids are range-checked
            params = self._params(body, len(ids), body.max_tokens)
            text = p if isinstance(p, str) else (engine.tokenizer.decode(ids) if engine.tokenizer else "")
            if not body.use_beam_search:
                self._validate({"prompt_token_ids": ids, **_salt(body)}, params)
            items.append((ids, text, params))
        self._admit()
        base = f"cmpl-{uuid.uuid4().hex}"
        if body.use_beam_search:
            return await self._beam_response(request, base, [ids for ids, _, _ in items], items[0][2],
                                             body, chat=False)
        gens = [self._run(f"{base}-{i}", {"prompt_token_ids": ids, **_salt(body)}, params,
                          body.priority) for i, (ids, _, params) in enumerate(items)]
        if body.stream:
            return DisconnectAwareStreamingResponse(
                self._stream_completion(base, body, items, gens), media_type="text/event-stream")
        outs = await self._collect(request, gens)
        choices, usage = [], _usage()
        for i, ((ids, text, params), out) in enumerate(zip(items, outs)):
            _add_usage(usage, out)
            for c in out.outputs:
                lp = None
                if body.logprobs is not None:
                    lp = _completion_logprobs(engine, out, c, body.echo, 0)
                choices.append({"index": i * body.n + c.index,
                                "text": (text if body.echo else "") + c.text, "logprobs": lp,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return JSONResponse({"id": base, "object": "text_completion", "created": int(time.time()),
                             "model": self.cfg.served_model_name, "choices": choices, "usage": usage})

    async def _stream_completion(self, base, body, items, gens):
        engine = self.engine.engine
        created, model = int(time.time()), self.cfg.served_model_name
        usage = _usage()
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        def chunk(choices, usage_=None):
            return _sse({"id": base, "object": "text_completion", "created": created, "model": model,
                         "choices": choices, "usage": usage_})

        sent: dict[tuple[int, int], tuple[int, int]] = {}  # (prompt, choice) -> (chars, tokens)
        done: set[tuple[int, int]] = set()
        try:
            async for i, out in _merge(gens):
                ids, text, _ = items[i]
                for c in out.outputs:
                    key = (i, c.index)
                    if key in done:
                        continue  # its last chunk is out
                    sent_text, sent_toks = sent.get(key, (0, 0))
                    prefix = text if body.echo and key not in sent else ""
                    delta = c.text[sent_text:]
                    new_toks = len(c.token_ids) - sent_toks
                    finished = c.finish_reason is not None
                    if not delta and not prefix and not finished and new_toks == 0:
                        continue
                    lp = None
                    if body.logprobs is not None:
                        lp = _completion_logprobs(engine, out, c, body.echo and key not in sent, sent_toks)
                    sent[key] = (len(c.text), len(c.token_ids))
                    if finished:
                        done.add(key)
                    yield chunk([{"index": i * body.n + c.index, "text": prefix + delta, "logprobs": lp,
                                  "finish_reason": c.finish_reason,
                                  "stop_reason": c.stop_reason if finished else None}])
                if out.finished:
                    _add_usage(usage, out)
            if include_usage:
                yield chunk([], usage)
            yield "data: [DONE]\n\n"
        except (ValueError, EngineDeadError) as e:  # the request failed after the stream began
            yield _sse_error(e)
        finally:
            for g in gens:
                await g.aclose()

    # chat
    def _chat_ids(self, engine, messages, add_generation_prompt, continue_final, template):
        tok = self._tokenizer(engine)
        try:
            text = tok.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=add_generation_prompt and not continue_final,
                                           continue_final_message=continue_final, chat_template=template)
        except Exception as e:  # template errors are the caller's input errors
            raise APIError(400, f"chat template failed: {e}", param="messages") from None
        return tok.encode(text, add_special_tokens=False)

    async def chat(self, request: Request):
        body = await self._body(request, ChatCompletionRequest)
        self._check_model(body.model)
        engine = self._engine()
        try:
            messages = [m.plain() for m in body.messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        ids = self._chat_ids(engine, messages, body.add_generation_prompt, body.continue_final_message,
                             body.chat_template)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = self._params(body, len(ids), max_tokens)
        prompt = {"prompt_token_ids": ids, **_salt(body)}
        self._admit()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.use_beam_search:
            return await self._beam_response(request, rid, [ids], params, body, chat=True)
        self._validate(prompt, params)
        gen = self._run(rid, prompt, params, body.priority)
        if body.stream:
            return DisconnectAwareStreamingResponse(self._stream_chat(rid, body, gen),
                                                    media_type="text/event-stream")
        (out,) = await self._collect(request, [gen])
        usage = _add_usage(_usage(), out)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": _chat_logprobs(engine, c, 0, body.top_logprobs or 0) if body.logprobs else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for c in out.outputs]
        return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()),
                             "model": self.cfg.served_model_name, "choices": choices, "usage": usage})

    async def _stream_chat(self, rid, body, gen):
        engine = self.engine.engine
        created, model = int(time.time()), self.cfg.served_model_name
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        sent: dict[int, tuple[int, int]] = {}
        done: set[int] = set()

        def chunk(choices, usage=None):
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                         "model": model, "choices": choices, "usage": usage})

        try:
            for i in range(body.n):  # the role comes first, once per choice
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            out = None
            async for out in gen:
                for c in out.outputs:
                    if c.index in done:
                        continue  # its last chunk is out
                    sent_text, sent_toks = sent.get(c.index, (0, 0))
                    delta = c.text[sent_text:]
                    finished = c.finish_reason is not None
                    if not delta and not finished and len(c.token_ids) == sent_toks:
                        continue
                    lp = _chat_logprobs(engine, c, sent_toks, body.top_logprobs or 0) if body.logprobs else None
                    sent[c.index] = (len(c.text), len(c.token_ids))
                    if finished:
                        done.add(c.index)
                    yield chunk([{"index": c.index, "delta": {"content": delta} if delta else {},
                                  "logprobs": lp, "finish_reason": c.finish_reason,
                                  "stop_reason": c.stop_reason if finished else None}])
            if include_usage and out is not None:
                yield chunk([], _add_usage(_usage(), out))
            yield "data: [DONE]\n\n"
        except (ValueError, EngineDeadError) as e:  # the request failed after the stream began
            yield _sse_error(e)
        finally:
            await gen.aclose()


class _Outputs:
    """A submitted request's outputs. Finished ones feed the latency metrics; closing it
    before the end aborts the request, even if it was never iterated."""

    def __init__(self, server: OpenAIServer, rid: str, outputs):
        self.server, self.rid, self._it, self.finished = server, rid, outputs, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        out = await self._it.__anext__()
        if out.finished:
            self.finished = True
            self.server.metrics.on_finished(out)
        return out

    async def aclose(self):
        if not self.finished:
            self.server.engine.abort(self.rid)
        await self._it.aclose()


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


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _sse_error(e: Exception) -> str:
    return _sse({"error": {"message": str(e), "type": "invalid_request_error",
                           "param": _field_of(str(e)), "code": None}}) + "data: [DONE]\n\n"


def _usage() -> dict:
    return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
            "prompt_tokens_details": {"cached_tokens": 0}}


def _add_usage(usage: dict, out) -> dict:
    usage["prompt_tokens"] += len(out.prompt_token_ids)
    usage["completion_tokens"] += sum(len(c.token_ids) for c in out.outputs)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    usage["prompt_tokens_details"]["cached_tokens"] += out.num_cached_tokens
    return usage


def _salt(body) -> dict:
    return {"cache_salt": body.cache_salt} if body.cache_salt else {}


_PROBE = SamplingParams(max_tokens=None)  # validates a prompt before its max_tokens is known


def _prompt_list(prompt) -> list:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    return list(prompt)


_FIELDS = {"max_tokens", "n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed",
           "stop_token_ids", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs", "logprobs",
           "min_tokens", "prompt", "cache_salt", "beam_width", "messages"}


def _field_of(message: str) -> str | None:
    """The request field a validation message names: our messages start with it."""
    m = re.match(r"[a-z_]+", message)
    return m.group(0) if m and m.group(0) in _FIELDS else None


async def _merge(gens: list[AsyncIterator]):
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


def _token_str(engine, token_id: int) -> str:
    return engine.token_text(token_id) or ""


def _completion_logprobs(engine, out, c, echo: bool, start: int) -> dict:
    """OpenAI's completions logprobs for output tokens from `start` (and the prompt if echo)."""
    tokens, token_lps, tops = [], [], []
    if echo and out.prompt_logprobs is not None:
        for tid, entry in zip(out.prompt_token_ids, out.prompt_logprobs):
            tokens.append(_token_str(engine, tid))
            token_lps.append(None if entry is None else entry[tid].logprob)
            tops.append(None if entry is None else
                        {_token_str(engine, t): lp.logprob for t, lp in entry.items()})
    for tid, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        tokens.append(_token_str(engine, tid))
        token_lps.append(entry[tid].logprob)
        tops.append({_token_str(engine, t): lp.logprob for t, lp in entry.items()})
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(engine, c, start: int, k: int) -> dict:
    """OpenAI's chat logprobs for output tokens from `start`: each token with its k most
    likely alternatives."""
    content = []
    for tid, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:]):
        text = _token_str(engine, tid)
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k),
                     key=lambda x: x[1].rank)
        content.append({
            "token": text, "logprob": entry[tid].logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": _token_str(engine, t), "logprob": lp.logprob,
                              "bytes": list(_token_str(engine, t).encode())} for t, lp in top]})
    return {"content": content}
