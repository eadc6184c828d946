"""AsyncEngine: the engine loop on its own thread, bridged to asyncio.

All requests share one continuous batch. The engine thread owns the LLMEngine: it takes new
requests and aborts from an inbox between steps, runs a step whenever there is work, and hands
each output to the asyncio queue of its request with call_soon_threadsafe, so the event loop
never waits on the device. Tokenization and chat templating run in a small thread pool, so one
long prompt does not stall the event loop. The server talks to the engine only through this
class.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from jaxllm.config import EngineConfig
from jaxllm.engine.input_processor import EngineRequest
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.engine.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger("jaxllm")

TOKENIZER_THREADS = 2


class EngineDeadError(RuntimeError):
    pass


class RequestLostError(RuntimeError):
    """The engine running a request went away under it (a data-parallel replica died after
    the request had streamed output); the server and the other requests go on."""


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def describe_error(e: BaseException) -> str:
    """One line: the exception's type and the first line of its message."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineFront:
    """What the server asks of an engine around its requests, shared by AsyncEngine and the
    data-parallel front end (jaxllm.distributed): tokenizing, validating, chat templates and
    token texts, in a small thread pool so that the event loop never waits on them.
    Subclasses give `tokenizer`, `inputs` (an InputProcessor), `structured` (the grammar
    manager) and `_pool`."""

    _pool: ThreadPoolExecutor

    def token_text(self, token_id: int) -> str:
        tok = self.tokenizer
        if tok is None:  # vLLM's spelling of a token it cannot show
            return f"token_id:{token_id}"
        texts = self.__dict__.setdefault("_token_texts", {})
        text = texts.get(token_id)
        if text is None:
            text = texts[token_id] = tok.decode([token_id])
        return text

    async def _in_pool(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def tokenize(self, prompt) -> tuple[str | None, list[int], str | None]:
        """(text, token ids, cache_salt) of a prompt (see InputProcessor.tokenize)."""
        return await self._in_pool(self.inputs.tokenize, prompt)

    async def process(self, prompt, params: SamplingParams, lora_request=None) -> EngineRequest:
        """Validate a prompt with its parameters (tokenizing what needs it) for submit(). A
        structured-output constraint is compiled here (on the grammar thread, or found in its
        cache), so a grammar that fails is the caller's error and the request reaches the
        engine ready to run."""
        req = await self._in_pool(self.inputs.process, prompt, params, lora_request)
        if req.grammar is not None:
            await asyncio.wrap_future(self.structured.compile(req.grammar))
        return req

    @property
    def image_token(self) -> str | None:
        """A vision-language model's image placeholder as text (what a chat's image part
        becomes before the template), None for a model that takes no images."""
        mm, tok = self.inputs.mm, self.tokenizer
        return None if mm is None or tok is None else tok.convert_ids_to_tokens(mm.image_token_id)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._in_pool(lambda: self.tokenizer.encode(
            text, add_special_tokens=add_special_tokens))

    async def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return await self._in_pool(lambda: self.tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens))

    async def count_tokens(self, texts: list[str]) -> list[int]:
        """Each text's tokens (no special tokens added)."""
        return await self._in_pool(lambda: [len(self.tokenizer.encode(t, add_special_tokens=False))
                                            for t in texts])

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool,
                          continue_final_message: bool, chat_template: str | None,
                          tools: list[dict] | None = None) -> list[int]:
        """The chat template applied and tokenized (`tools`: function definitions, for the
        templates that describe them to the model). Template errors are ValueErrors."""
        def render():
            tok = self.tokenizer
            if tools and "tools" not in (chat_template or tok.chat_template or ""):
                _warn_once("the chat template does not render tools: the model does not see "
                           "their definitions (forced tool calls still follow their schemas)")
            try:
                text = tok.apply_chat_template(
                    messages, tokenize=False, chat_template=chat_template, tools=tools,
                    add_generation_prompt=add_generation_prompt and not continue_final_message,
                    continue_final_message=continue_final_message)
            except ImportError:
                raise
            except Exception as e:  # the template's own errors are the caller's input errors
                raise ValueError(f"messages: the chat template failed: {e}") from None
            return tok.encode(text, add_special_tokens=False)
        return await self._in_pool(render)



class AsyncEngine(EngineFront):
    def __init__(self, config: EngineConfig,
                 on_step: Callable[[LLMEngine, list, float], None] | None = None,
                 on_fail: Callable[[BaseException], None] | None = None,
                 lora_modules=(), model_names=()):
        """lora_modules: LoRARequests registered at start-up (one refused: the engine fails to
        start); model_names: what else the base model is called (adapters' base model check)."""
        self.config = config
        self._lora_modules = list(lora_modules)
        self._model_names = list(model_names)
        self._on_fail = on_fail
        self._engine: LLMEngine | None = None
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._on_step = on_step
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="jaxllm-tokenize")
        self._thread = threading.Thread(target=self._run, name="jaxllm-engine", daemon=True)

    # lifecycle
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._inbox.put(("wake", None))
        self._thread.join(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and self.error is None

    def _run(self) -> None:
        try:
            self._engine = LLMEngine(self.config, self._lora_modules, self._model_names)
        except BaseException as e:  # reported by /health and on_fail
            if not isinstance(e, ValueError):  # not a refused input: the details help
                logger.warning("engine start-up raised", exc_info=True)
            logger.error("engine failed to start: %s", describe_error(e))
            self._fail(e)
            return
        self.ready.set()
        engine = self._engine
        if engine.tokenizer is not None:
            engine.structured.warm()  # the first structured request does not wait for it
        try:
            while not self._stopping:
                if self._drain_inbox(block=not engine.has_unfinished_requests()) and self._on_step:
                    self._on_step(engine, [], 0.0)  # aborts change the gauges too
                if not engine.has_unfinished_requests():
                    continue
                start = time.perf_counter()
                outputs = engine.step()
                elapsed = time.perf_counter() - start
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.put(out)
                        if out.finished:
                            self._streams.pop(out.request_id, None)
                if self._on_step is not None:
                    self._on_step(engine, outputs, elapsed)
        except BaseException as e:
            logger.exception("engine loop died")
            logger.error("engine failed: %s", describe_error(e))
            self._fail(e)
        finally:
            engine.shutdown()  # followers on other processes stop with us

    def _fail(self, error: BaseException) -> None:
        """Every waiting stream learns that the engine is gone (none can register after)."""
        with self._lock:
            self.error = error
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.put(EngineDeadError(str(error)))
        if self._on_fail is not None:
            self._on_fail(error)

    def _drain_inbox(self, block: bool) -> bool:
        """Takes queued adds and aborts; True if there were any."""
        engine = self._engine
        took = False
        while True:
            try:
                op, arg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                return took
            block, took = False, True
            if op == "add":
                request_id, prompt, priority = arg
                try:
                    lora = getattr(prompt, "lora_request", None)
                    if lora is not None and (engine.lora is None or engine.lora.key_of(lora) is None):
                        # unloaded while the request was on its way: not loaded again
                        raise ValueError(f"model: the LoRA adapter {lora.lora_name!r} is not loaded")
                    engine.add_request(request_id, prompt, priority=priority)
                except Exception as e:  # validation: the request fails, nothing else does
                    stream = self._streams.pop(request_id, None)
                    if stream is not None:
                        stream.put(e)
            elif op == "abort":
                engine.abort_request(arg)
                self._streams.pop(arg, None)
            elif op == "call":
                fn, result = arg
                try:
                    result.put(fn(engine))
                except Exception as e:  # the caller's to report
                    result.put(e)

    # what the server may read: fixed once the engine is up
    @property
    def engine(self) -> LLMEngine:
        if self.error is not None:
            raise EngineDeadError(str(self.error))
        if self._engine is None or not self.ready.is_set():
            raise RuntimeError("the engine is not ready")
        return self._engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def inputs(self):
        return self.engine.inputs

    @property
    def structured(self):
        return self.engine.structured

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.arch.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.engine.eos_token_id

    def health(self) -> dict:
        """/health's body: one engine is up or not (see the data-parallel front end)."""
        if self.error is not None:
            return {"status": "error", "error": str(self.error)}
        return {"status": "ok"}

    # LoRA adapters at run time
    async def on_engine(self, fn):
        """fn(engine) on the engine thread, between steps; its result (or its exception)."""
        self.engine  # noqa: B018 (raises if the engine is not running)
        result: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox.put(("call", (fn, result)))

        def wait():
            while True:
                try:
                    return result.get(timeout=0.5)
                except queue.Empty:
                    if self.error is not None:
                        return EngineDeadError(str(self.error))
        out = await self._in_pool(wait)
        if isinstance(out, Exception):
            raise out
        return out

    async def add_lora(self, lora_request) -> None:
        """Read and check the adapter in the pool (steps go on), then register it."""
        adapter = await self._in_pool(self.engine.read_lora, lora_request)
        await self.on_engine(lambda e: e.add_lora(lora_request, adapter))

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self.on_engine(lambda e: e.remove_lora(lora_int_id))

    # requests
    def submit(self, request_id: str, request: EngineRequest,
               priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Queue a processed request now (so admission control sees it at once) and return
        the stream of its outputs; the request is aborted (its blocks freed) if the consumer
        stops early, is cancelled, or never starts."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if self.error is not None:
                raise EngineDeadError(str(self.error))
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._inbox.put(("add", (request_id, request, priority)))
        return self._outputs(request_id, stream)

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def num_waiting(self) -> int:
        """Requests queued in the engine plus those not yet handed to it."""
        engine = self._engine
        return (engine.scheduler.num_waiting if engine is not None else 0) + self._inbox.qsize()
