"""`jaxllm serve`: the app on uvicorn, with graceful shutdown on SIGTERM and SIGINT."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading

import uvicorn

from jaxllm import envs
from jaxllm.config import EngineConfig
from jaxllm.loader.loader import DEFAULT_MODEL_NAME
from jaxllm.engine.async_engine import describe_error
from serve.app import OpenAIServer, ServerConfig

logger = logging.getLogger("jaxllm")


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown (so the process dies of
    the signal); a drained, orderly stop is a clean exit here, status 0."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def served_name(model: str | None, given: str | None) -> str:
    if given:
        return given
    if model is None:
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(model))


def parse_lora_modules(specs: list[str] | None, enable_lora: bool) -> list:
    """`--lora-modules name=path ...` (or vLLM's JSON form {"name", "path", "base_model_name"})
    as LoRARequests with ids 1, 2, ..."""
    import json

    from jaxllm.lora import LoRARequest
    if not specs:
        return []
    if not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    out = []
    for i, spec in enumerate(specs, start=1):
        if spec.lstrip().startswith("{"):
            try:
                d = json.loads(spec)
                name, path, parent = d["name"], d["path"], d.get("base_model_name")
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules {spec!r}: a JSON module needs \"name\" and \"path\" ({e})") from None
        else:
            name, sep, path = spec.partition("=")
            parent = None
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {spec!r}: expected name=path")
        if any(lr.lora_name == name for lr in out):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        out.append(LoRARequest(name, i, path, parent))
    return out


def run_server(engine_config: EngineConfig, host: str, port: int, served_model_name: str | None,
               api_key: str | None, max_queue_len: int | None, shutdown_timeout: float,
               log_interval: float, tool_call_parser: str | None = None,
               lora_modules: list[str] | None = None,
               enable_runtime_lora_updating: bool = False, max_prompt_tokens: int | None = None,
               chat_context_policy: str = "reject", chat_trim_step: float = 0.25,
               web_ui: bool = True, allowed_media_domains: list[str] | None = None) -> int:
    """enable_runtime_lora_updating: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also
    JAXLLM_ALLOW_RUNTIME_LORA_UPDATING, as vLLM's variable)."""
    if engine_config.process_id != 0:
        # other processes serve nothing: they run process 0's steps until it shuts down
        from jaxllm.engine.llm_engine import LLMEngine
        LLMEngine(engine_config).follow()
        return 0
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"--max-prompt-tokens must be at least 1, got {max_prompt_tokens}")
    if not 0 <= chat_trim_step <= 1:
        raise ValueError(f"--chat-trim-step must be between 0 and 1, got {chat_trim_step}")
    name = served_name(engine_config.model, served_model_name)
    loras = parse_lora_modules(lora_modules, engine_config.enable_lora)
    runtime_lora = enable_runtime_lora_updating or envs.allow_runtime_lora_updating()
    if runtime_lora and not engine_config.enable_lora:
        raise ValueError("--enable-runtime-lora-updating (JAXLLM_ALLOW_RUNTIME_LORA_UPDATING) "
                         "needs --enable-lora")
    if runtime_lora:
        logger.warning("runtime LoRA updating is on: any client with the API key may load LoRA "
                       "adapters from this machine's disk (POST /v1/load_lora_adapter)")
    server = OpenAIServer(engine_config, ServerConfig(
        name, api_key or envs.api_key(), max_queue_len, log_interval,
        tool_call_parser=tool_call_parser, lora_modules=loras, allow_runtime_lora_updating=runtime_lora,
        max_prompt_tokens=max_prompt_tokens, chat_context_policy=chat_context_policy,
        chat_trim_step=chat_trim_step, web_ui=web_ui,
        allowed_media_domains=list(allowed_media_domains or ())))
    config = uvicorn.Config(server.app(), host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on")
    logger.info("serving %s on http://%s:%d", name, host, port)
    if web_ui:
        logger.info("chat page: http://%s:%d/  dashboard: http://%s:%d/dashboard", host, port, host, port)
    # uvicorn stops accepting on SIGTERM/SIGINT, lets in-flight requests finish (bounded by
    # timeout_graceful_shutdown), then runs the lifespan shutdown that stops the engine
    uv = _Server(config)
    # an engine that cannot start (or dies) stops the server: a supervisor sees exit status 1
    server.on_fatal = lambda: setattr(uv, "should_exit", True)
    uv.run()
    if server.engine.error is not None:
        logger.error("exiting: the engine failed (%s)", describe_error(server.engine.error))
        return 1
    return 0
