"""The OpenAI-compatible Starlette app: routes, lifecycle, API keys, admission control and what
every endpoint shares (body parsing, sampling parameters, submitting requests). The endpoints
live beside it: completions.py, chat.py, models.py (models, tokenize, detokenize), beam.py."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

import jaxllm
from jaxllm.config import EngineConfig
from jaxllm.engine.async_engine import AsyncEngine, EngineDeadError
from jaxllm.engine.input_processor import EngineRequest
from jaxllm.sampling_params import RequestOutputKind
from serve.errors import APIError, bad_request, check_json, error_response
from serve.dashboard import DashboardFeed
from serve.metrics import Metrics
from serve.protocol import REFUSED
from serve.openapi import openapi_document
from serve.streaming import Outputs
from serve.tool_parsers import get_parser

logger = logging.getLogger("jaxllm")

WEB_DIR = Path(__file__).parent / "web"
# the pages load only their own files and talk only to this server; model output is text
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                "object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_queue_len: int | None = None
    log_interval: float = 10.0
    # tool_choice "auto": how the model writes tool calls (--tool-call-parser, with
    # --enable-auto-tool-choice); None: "auto" is refused
    tool_call_parser: str | None = None
    lora_modules: list = field(default_factory=list)  # LoRARequests served from the start
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (JAXLLM_ALLOW_RUNTIME_LORA_UPDATING)
    allow_runtime_lora_updating: bool = False
    # a chat's prompt budget (--max-prompt-tokens) and what a conversation over its budget or
    # the model's length gets (--chat-context-policy): "reject" (a 400) or "trim" (the oldest
    # turns dropped: serve/context_budget.py)
    max_prompt_tokens: int | None = None
    chat_context_policy: str = "reject"
    # where a trimmed conversation may be cut (--chat-trim-step): a fraction of the budget
    # between allowed cuts, so the cut stays put as a chat grows and its prefix stays cached
    chat_trim_step: float = 0.25
    # the chat page at / and the live dashboard at /dashboard (--disable-web-ui turns them off)
    web_ui: bool = True
    # hosts whose image URLs the server fetches (--allowed-media-domains): fetching is a
    # request from the server's network, so none unless listed; data: URLs need no fetch
    allowed_media_domains: list = field(default_factory=list)


class _WebFiles(StaticFiles):
    """The pages' files, revalidated on every load (an upgraded server's page never runs an
    old cached script) with the pages' headers."""

    def file_response(self, *args, **kwargs):
        response = super().file_response(*args, **kwargs)
        response.headers.update(PAGE_HEADERS)
        return response


class OpenAIServer:
    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig,
                 on_fatal=None):
        """on_fatal: called on the event loop when the engine fails (to start or later);
        `jaxllm serve` then stops the server and exits 1."""
        self.cfg = server_config
        self.tool_parser = (get_parser(server_config.tool_call_parser)
                            if server_config.tool_call_parser else None)
        self.metrics = Metrics(server_config.served_model_name)
        if engine_config.data_parallel_size > 1:  # replicas on Ray behind a router
            from jaxllm.distributed.data_parallel import DataParallelEngine
            self.engine = DataParallelEngine(engine_config, hooks=self.metrics,
                                             on_fail=self._engine_failed,
                                             lora_modules=server_config.lora_modules,
                                             model_names=[server_config.served_model_name])
        else:
            self.engine = AsyncEngine(engine_config, on_step=self.metrics.on_step,
                                      on_fail=self._engine_failed,
                                      lora_modules=server_config.lora_modules,
                                      model_names=[server_config.served_model_name])
        # the adapters served, by name (the engine thread owns the registry; this mirrors it)
        self.loras = {lr.lora_name: lr for lr in server_config.lora_modules}
        self.lora_lock = asyncio.Lock()
        self.next_lora_id = max([0, *(lr.lora_int_id for lr in server_config.lora_modules)]) + 1
        self.created = int(time.time())
        self.on_fatal = on_fatal
        self._loop = None
        self._log_task = None
        self._warned_fields: set[str] = set()
        self.dashboard = (DashboardFeed(self.metrics.registry, self._dashboard_info)
                          if server_config.web_ui else None)
        self._dashboard_task = None

    # lifecycle
    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self._loop = asyncio.get_running_loop()
        self.engine.start()
        self._log_task = asyncio.create_task(self._periodic_log())
        if self.dashboard is not None:
            self._dashboard_task = asyncio.create_task(self.dashboard.run())
        try:
            yield
        finally:
            self._log_task.cancel()
            if self._dashboard_task is not None:
                self._dashboard_task.cancel()
            self.engine.shutdown()

    def _engine_failed(self, error: BaseException) -> None:
        """From the engine thread: hand the failure to the event loop."""
        if self._loop is not None and self.on_fatal is not None:
            self._loop.call_soon_threadsafe(self.on_fatal)

    async def _periodic_log(self):
        while True:
            await asyncio.sleep(self.cfg.log_interval)
            if self.engine.is_ready:
                self.metrics.log_line()

    def app(self) -> Starlette:
        from serve import chat, completions, models
        routes = [
            Route("/v1/completions", self._wrap(partial(completions.create, self), auth=True),
                  methods=["POST"]),
            Route("/v1/chat/completions", self._wrap(partial(chat.create, self), auth=True),
                  methods=["POST"]),
            Route("/v1/models", self._wrap(partial(models.list_models, self), auth=True),
                  methods=["GET"]),
            *([Route("/v1/load_lora_adapter", self._wrap(partial(models.load_lora, self), auth=True),
                     methods=["POST"]),
               Route("/v1/unload_lora_adapter", self._wrap(partial(models.unload_lora, self), auth=True),
                     methods=["POST"])] if self.cfg.allow_runtime_lora_updating else []),
            Route("/tokenize", self._wrap(partial(models.tokenize, self)), methods=["POST"]),
            Route("/detokenize", self._wrap(partial(models.detokenize, self)), methods=["POST"]),
            Route("/health", self._wrap(self.health), methods=["GET"]),
            Route("/health/ready", self._wrap(self.health_ready), methods=["GET"]),
            Route("/metrics", self._wrap(self.prometheus), methods=["GET"]),
            Route("/version", self._wrap(self.version), methods=["GET"]),
            Route("/openapi.json", self._wrap(self.openapi), methods=["GET"]),
        ]
        if self.cfg.web_ui:
            routes += [
                Route("/", self._page("chat.html"), methods=["GET"]),
                Route("/dashboard", self._page("dashboard.html"), methods=["GET"]),
                Route("/dashboard/data", self._wrap(self.dashboard_data), methods=["GET"]),
                Mount("/web", _WebFiles(directory=WEB_DIR), name="web"),
            ]
        return Starlette(routes=routes, lifespan=self.lifespan,
                         exception_handlers={404: self._not_found, 405: self._not_allowed})

    async def _not_found(self, request, exc):
        return error_response(APIError(404, f"no route {request.url.path}", code="not_found"))

    async def _not_allowed(self, request, exc):
        return error_response(APIError(405, f"method {request.method} not allowed on {request.url.path}"))

    def _wrap(self, handler, auth: bool = False):
        """Every endpoint: the key checked, our errors as OpenAI bodies, and a dead engine as
        a server error."""
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

    # what the endpoints share
    def ready_engine(self) -> AsyncEngine:
        if self.engine.error is not None:
            raise EngineDeadError(str(self.engine.error))
        if not self.engine.is_ready:
            raise APIError(503, "the model is still loading", type="server_error",
                           code="not_ready", headers={"Retry-After": "5"})
        return self.engine

    def require_tokenizer(self, param: str = "prompt", what: str = "this request"):
        """A 400 naming `param` when the engine has no tokenizer (skip_tokenizer_init, or a
        checkpoint without one)."""
        if self.engine.tokenizer is None:
            raise APIError(400, f"{what} needs a tokenizer, and this server has none "
                           "(--skip-tokenizer-init, or a checkpoint without one): send token-id "
                           "prompts to /v1/completions", param=param)
        return self.engine.tokenizer

    async def body(self, request: Request, model_cls):
        """The request body as `model_cls`: JSON, sane, valid; fields we do not implement
        refused by name; fields we do not know named once in a warning."""
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
            raise APIError(400, REFUSED.get(refused, f"{refused} is not supported by this server yet"),
                           param=refused, code="unsupported_parameter")
        problem = body.check() if hasattr(body, "check") else None
        if problem is not None:
            raise APIError(400, problem[1], param=problem[0])
        unknown = [f for f in body.unknown_fields() if f not in self._warned_fields]
        if unknown:
            self._warned_fields.update(unknown)
            logger.warning("request fields ignored (not part of the API; warned once each): %s",
                           ", ".join(unknown))
        if getattr(body, "model", None) is not None:
            self.check_model(body.model)
        return body

    def check_model(self, name: str) -> None:
        """The served model or one of its LoRA adapters."""
        if name != self.cfg.served_model_name and name not in self.loras:
            raise APIError(404, f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")

    def model_name(self, body) -> str:
        """What responses name as their model: the adapter asked for, or the base model."""
        return body.model if body.model in self.loras else self.cfg.served_model_name

    def lora_of(self, name: str | None):
        """The LoRARequest a request's `model` selects (None: the base model)."""
        return None if name is None else self.loras.get(name)

    def admit(self, body=None) -> None:
        """A 429 while the waiting queue is full (counted against the model `body` asks for)."""
        limit = self.cfg.max_queue_len
        if limit is not None and self.engine.num_waiting() >= limit:
            self.metrics.on_rejected(self.cfg.served_model_name if body is None else self.model_name(body))
            raise APIError(429, f"the waiting queue is full ({limit} requests)",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})

    def max_tokens(self, num_prompt_tokens: int, given: int | None) -> int:
        """max_tokens as asked, or all the room the context leaves (OpenAI's message when
        the prompt and max_tokens do not fit)."""
        limit = self.engine.max_model_len
        max_tokens = limit - num_prompt_tokens if given is None else given
        if given is not None and given < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {given}", param="max_tokens")
        if num_prompt_tokens + max_tokens > limit or max_tokens < 1:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, "
                           f"you requested {num_prompt_tokens + max_tokens} tokens "
                           f"({num_prompt_tokens} in the prompt, {max_tokens} for the completion).",
                           param="max_tokens", code="context_length_exceeded")
        return max_tokens

    def chat_budget(self, body, max_tokens: int | None) -> int | None:
        """The prompt tokens a chat request's conversation is trimmed to, or None when it is
        not trimmed (a request's context_budget asks for trimming whatever the policy)."""
        if body.context_budget is None and self.cfg.chat_context_policy != "trim":
            return None
        room = self.engine.max_model_len - (1 if max_tokens is None else max_tokens)
        budget = body.context_budget if body.context_budget is not None else self.cfg.max_prompt_tokens
        return room if budget is None else min(budget, room)

    def chat_trim_step_tokens(self, body) -> int:
        """Tokens between a trimmed chat's allowed cuts: --chat-trim-step of the budget asked
        for, or of the model's length (not of the room max_tokens leaves, so that a request's
        max_tokens does not move the cuts)."""
        base = body.context_budget or self.cfg.max_prompt_tokens or self.engine.max_model_len
        return int(self.cfg.chat_trim_step * base)

    def check_prompt_budget(self, num_prompt_tokens: int) -> None:
        limit = self.cfg.max_prompt_tokens
        if limit is not None and num_prompt_tokens > limit:
            raise APIError(400, f"the conversation needs {num_prompt_tokens} prompt tokens and the "
                           f"server takes at most {limit} (--max-prompt-tokens); set "
                           "context_budget to have the oldest turns dropped",
                           param="messages", code="context_length_exceeded")

    async def processed(self, body, text: str | None, ids: list[int], max_tokens: int | None,
                        stream: bool, images: list | None = None) -> EngineRequest:
        """The prompt with the body's sampling parameters, validated by the engine: streams
        get DELTA outputs, the others one FINAL_ONLY output. `images`: decoded, in order."""
        try:
            params = body.to_sampling_params(self.max_tokens(len(ids), max_tokens))
            params.output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
            prompt = {"prompt": text, "prompt_token_ids": ids}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            if body.cache_salt:
                prompt["cache_salt"] = body.cache_salt
            return await self.engine.process(prompt, params, self.lora_of(body.model))
        except ValueError as e:
            raise bad_request(e) from None

    async def load_images(self, urls: list[str]) -> list:
        """Chat image parts' URLs as images: data URLs decoded, http(s) ones fetched when
        their host is allowed (ValueErrors say why not)."""
        from urllib.parse import urlparse

        from jaxllm.multimodal import load_image
        out = []
        for url in urls:
            if url.startswith(("http://", "https://")):
                host = urlparse(url).hostname
                if host not in self.cfg.allowed_media_domains:
                    raise ValueError(f"messages: image_url {url[:80]!r} is a remote URL; this server "
                                     "fetches only hosts listed by --allowed-media-domains (send the "
                                     "image as a data: URL)")
                data = await asyncio.to_thread(_fetch, url, tuple(self.cfg.allowed_media_domains))
                out.append(await asyncio.to_thread(load_image, data))
            elif url.startswith("data:"):
                out.append(await asyncio.to_thread(load_image, url))
            else:
                raise ValueError("messages: image_url must be a data: URL or an http(s) URL")
        return out

    def run(self, rid: str, request: EngineRequest, priority: int) -> Outputs:
        """Submit now (admission control counts it at once); iterate for the outputs."""
        lora = request.lora_request
        return Outputs(self, rid, self.engine.submit(rid, request, priority),
                       lora.lora_name if lora is not None else self.cfg.served_model_name)

    # small endpoints
    async def health(self, request: Request):
        """As vLLM: a dead engine is a server error. With replicas, "degraded" (some are
        restarting or dead) still serves; "unavailable" (none up yet) is a 503."""
        body = self.engine.health()
        code = {"error": 500, "unavailable": 503}.get(body["status"], 200)
        return JSONResponse(body, status_code=code)

    async def health_ready(self, request: Request):
        if self.engine.is_ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "loading" if self.engine.error is None else "error"},
                            status_code=503)

    async def version(self, request: Request):
        return JSONResponse({"version": jaxllm.__version__})

    async def openapi(self, request: Request):
        return JSONResponse(openapi_document())

    # the web pages (static files: serve/web) and the dashboard's data
    def _page(self, name: str):
        async def page(request: Request):
            return FileResponse(WEB_DIR / name, headers=PAGE_HEADERS)
        return page

    def _dashboard_info(self) -> dict:
        stats = self.metrics.last_stats() or {}
        return {"model": self.cfg.served_model_name, "adapters": sorted(self.loras),
                "ready": self.engine.is_ready,
                "max_model_len": self.engine.max_model_len if self.engine.is_ready else None,
                "kv_total_slots": stats.get("kv_total_slots"),
                "max_lora": stats.get("max_lora"),
                "speculative": self.metrics.speculative,
                # data-parallel replicas: index and role of each (None: one engine)
                "replicas": ([{"replica": r["replica"], "role": r["role"]}
                              for r in self.engine.replica_states()]
                             if hasattr(self.engine, "replica_states") and self.engine.is_ready
                             else None)}

    async def dashboard_data(self, request: Request):
        since = request.query_params.get("since")
        try:
            since = None if since is None else float(since)
        except ValueError:
            raise APIError(400, f"since must be a number (seconds since the epoch), got {since!r}",
                           param="since") from None
        return JSONResponse(self.dashboard.data(since), headers={"Cache-Control": "no-store"})

    async def prometheus(self, request: Request):
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


MAX_IMAGE_BYTES = 20 * 2**20


def _fetch(url: str, allowed: tuple[str, ...]) -> bytes:
    """An allowed image URL's bytes (bounded in time and size). A redirect must stay on an
    allowed host over http(s): otherwise an allowed host could point the server anywhere."""
    import http.client
    import urllib.request
    from urllib.parse import urlparse

    class Guarded(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):
            where = urlparse(newurl)
            if where.scheme not in ("http", "https") or where.hostname not in allowed:
                raise ValueError(f"messages: image_url redirects to {newurl[:80]!r}, which "
                                 "--allowed-media-domains does not list")
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    try:
        with urllib.request.build_opener(Guarded).open(url, timeout=10) as r:
            data = r.read(MAX_IMAGE_BYTES + 1)
    except (OSError, http.client.HTTPException) as e:
        raise ValueError(f"messages: image_url could not be fetched: {e}") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"messages: image_url is larger than {MAX_IMAGE_BYTES >> 20} MiB")
    return data
