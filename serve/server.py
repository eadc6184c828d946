"""`jaxllm serve`: the app on uvicorn, with graceful shutdown on SIGTERM and SIGINT."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading

import uvicorn

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


def run_server(engine_config: EngineConfig, host: str, port: int, served_model_name: str | None,
               api_key: str | None, max_queue_len: int | None, shutdown_timeout: float,
               log_interval: float, tool_call_parser: str | None = None) -> int:
    if engine_config.process_id != 0:
        # other processes serve nothing: they run process 0's steps until it shuts down
        from jaxllm.engine.llm_engine import LLMEngine
        LLMEngine(engine_config).follow()
        return 0
    name = served_name(engine_config.model, served_model_name)
    server = OpenAIServer(engine_config, ServerConfig(
        name, api_key or os.environ.get("JAXLLM_API_KEY"), max_queue_len, log_interval,
        tool_call_parser))
    config = uvicorn.Config(server.app(), host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on")
    logger.info("serving %s on http://%s:%d", name, host, port)
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
