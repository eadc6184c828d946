"""LLMEngine: add_request / step / abort_request, as in vLLM.

The engine is built from its config by builder.py (the KV cache sized by kv_sizing.py); its
adapters are jaxllm.lora.manager's, its requests' grammars jaxllm.structured_output's, its
counters stats.py's. What stays here is the loop: requests in, steps dispatched and read,
outputs out.
"""
from __future__ import annotations

import gc
import logging
import time

import jax
import numpy as np

from jaxllm.config import EngineConfig
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.scheduler_output import SchedulerOutput
from jaxllm.engine.builder import advise_huge_pages, build_engine, process_seconds, warm_up
from jaxllm.engine.faults import FaultInjector, InjectedFault, StepFailures, describe
from jaxllm.engine.input_processor import EngineRequest, InputProcessor
from jaxllm.engine.kv_sizing import check_headroom
from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.engine.outputs import RequestOutput
from jaxllm.engine.stats import EngineStats
from jaxllm.runner.outputs import InFlight
from jaxllm.sampling_params import SamplingParams
from jaxllm.structured_output.manager import StructuredOutputManager
from jaxllm.structured_output.requests import RequestGrammars

logger = logging.getLogger("jaxllm")


class LLMEngine:
    def __init__(self, config: EngineConfig, lora_modules=(), model_names=()):
        """lora_modules: LoRARequests registered before anything compiles (a refused one stops
        the start); model_names: what else the base model is called, for their base check."""
        start = time.perf_counter()
        self.config = config
        if config.freeze_gc_heap and gc.get_freeze_count():
            # an earlier engine's frozen heap: what of it is garbage now goes before this
            # engine takes its memory (frozen, its cycles would never be collected)
            gc.unfreeze()
            gc.collect()
        parts = build_engine(config, lora_modules, model_names)
        self.matmul_backend = parts.matmul_backend
        self.policy = parts.policy
        self.mesh = parts.mesh
        self.load_seconds = parts.load_seconds
        self.kv_dtype = parts.kv_dtype  # the KV cache's storage dtype
        self.arch = parts.arch
        self.tokenizer = parts.tokenizer
        self.eos_token_id = parts.eos_token_id
        self.smoothquant = parts.smoothquant  # how w8a8's smoothing was made, when it was
        self.is_follower = parts.is_follower
        self.lora = parts.lora  # a LoRAManager with enable_lora, else None
        self.kv_manager = parts.kv_manager
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.speculator = parts.speculator
        # huge pages: (bytes collapsed to huge pages, bytes asked for) once the thread is done
        self.huge_page_bytes: tuple[int, int] | None = None
        self._huge_pages = None
        if parts.platform == "cpu" and config.huge_pages:
            self._huge_pages = advise_huge_pages(
                self.runner, lambda *n: setattr(self, "huge_page_bytes", n))
        self.compile_seconds = 0.0
        if config.warmup:
            self.compile_seconds = warm_up(self.runner, config.compile_in_background)
            if parts.platform != "cpu":  # the host's memory is checked when the cache is sized
                check_headroom(self.runner, config.gpu_memory_utilization)
        self._rng = np.random.default_rng(config.seed)
        self.structured = StructuredOutputManager(
            self.tokenizer, self.arch.vocab_size, self.eos_token_id,
            allow_additional_properties=config.structured_outputs_allow_additional_properties)
        self.grammars = RequestGrammars(self.structured, self.scheduler.finish_request)
        self.encoder, mm = None, None
        if self.arch.vision is not None:  # a vision-language model: its images' inputs
            from jaxllm.engine.input_processor import MultiModalInputs
            from jaxllm.multimodal import ImageProcessor
            from jaxllm.runner.encoder import ImageEncoder
            limit = config.limit_mm_per_prompt["image"]
            self.encoder = ImageEncoder(self.runner.graphdef, self.runner.state, max(1, limit))
            v = self.arch.vision
            mm = MultiModalInputs(v["image_token_id"], v["tokens_per_image"],
                                  ImageProcessor.for_checkpoint(parts.model_path, v), limit)
        self.inputs = InputProcessor(self.tokenizer, self.arch.vocab_size, config.max_model_len,
                                     self.structured, speculative=self.speculator is not None, mm=mm)
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler)
        self.engine_stats = EngineStats(self.scheduler, self.kv_manager, config.block_size,
                                        config.max_model_len, self.lora)
        # async scheduling: the step dispatched last, whose tokens the host has not read yet
        self._in_flight: tuple[SchedulerOutput, InFlight | None] | None = None
        # the steps scheduled and not yet read: their requests fail if a step raises
        self._open_steps: list[SchedulerOutput] = []
        self._step_outputs: list[RequestOutput] = []  # made by the step running now
        self.failures = StepFailures(1 if config.num_processes > 1 else config.max_step_failures,
                                     config.step_failure_window)
        self.faults = (FaultInjector(config.inject_step_faults, config.seed)
                       if config.inject_step_faults else None)
        if config.freeze_gc_heap:
            # what start-up left is long-lived: full collections between steps skip it
            gc.collect()
            gc.freeze()
        if config.gc_young_threshold:
            gc.set_threshold(config.gc_young_threshold, *gc.get_threshold()[1:])
        self.startup_seconds = time.perf_counter() - start
        logger.info("engine ready in %.1f s (load %.1f s, compile %.1f s; %.1f s since the "
                    "process started; model %s, dtype %s, %s, %s scheduling)",
                    self.startup_seconds, self.load_seconds, self.compile_seconds,
                    process_seconds(), parts.model_path, self.policy.describe(), parts.platform,
                    "async" if config.async_scheduling else "synchronous")

    def follow(self) -> None:
        """On processes other than 0: run process 0's steps until it shuts down."""
        logger.info("process %d follows process 0", jax.process_index())
        self.runner.follow()

    def shutdown(self) -> None:
        """Process 0: release the followers (they return from follow()); stop compiling."""
        self.runner.stop_followers()
        self.runner.stop_background_compile()

    # requests
    def process_inputs(self, prompt, params: SamplingParams | None = None,
                       lora_request=None) -> EngineRequest:
        """Validate and tokenize once; add_request takes the result as its prompt. Safe to
        call from another thread (the server does, off its event loop)."""
        return self.inputs.process(prompt, params, lora_request)

    # LoRA adapters (jaxllm.lora.manager)
    def add_lora(self, lora_request, adapter=None) -> bool:
        """Register an adapter: read and checked now (ValueError naming it if refused), or
        given as read by read_lora()."""
        self._require_lora("LoRA adapters")
        self.lora.add(lora_request, adapter)
        return True

    def read_lora(self, lora_request):
        """Read and check an adapter for add_lora() (safe to call from another thread)."""
        self._require_lora("LoRA adapters")
        return self.lora.read(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter; requests already running with it finish with it."""
        if self.lora is None:
            return False
        return self.lora.remove(lora_int_id, self.scheduler.requests.values())

    def list_loras(self) -> set[int]:
        return set() if self.lora is None else self.lora.list()

    def _require_lora(self, what: str) -> None:
        if self.lora is None:
            raise ValueError(f"{what} need an engine started with enable_lora=True")

    def _lora_key(self, lora_request) -> int | None:
        if lora_request is None:
            return None
        if self.lora is None:
            raise ValueError("lora_request needs an engine started with enable_lora=True")
        return self.lora.add(lora_request)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_request=None) -> None:
        """Queue a request. `prompt` is a string, a list of token ids, a dict with "prompt"
        or "prompt_token_ids" (and optionally "cache_salt"), or an EngineRequest.
        `lora_request` (jaxllm.lora.LoRARequest) runs it with that adapter, registering the
        adapter first if it is new."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        if request_id in self.outputs.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(priority, int) or (priority != 0 and self.config.scheduling_policy != "priority"):
            raise ValueError(f"priority={priority!r} needs scheduling_policy='priority'")
        req_in = self.process_inputs(prompt, params, lora_request)
        params = req_in.params
        lora_id = self._lora_key(lora_request or req_in.lora_request)
        arrival = time.time() if arrival_time is None else arrival_time
        num = params.num_sequences
        child_ids = [request_id] if num == 1 else [f"{i}_{request_id}" for i in range(num)]
        taken = [c for c in child_ids if c in self.outputs.seqs or c in self.scheduler.requests]
        if taken:
            raise ValueError(f"request_id {request_id!r} collides with running sequence {taken[0]!r}")
        mm = None
        if req_in.mm:  # its images' features: encoded now, or found by their hashes
            feats = self.encoder.encode([p for *_, p in req_in.mm], [h for _, _, h, _ in req_in.mm])
            mm = [(off, n, h, f) for (off, n, h, _), f in zip(req_in.mm, feats)]
        reqs = []
        for i, child_id in enumerate(child_ids):
            if params.seed is not None:
                seed = (params.seed + i) & 0xFFFFFFFF
            else:
                seed = int(self._rng.integers(0, 2**32))
            req = Request(child_id, req_in.prompt_token_ids, params, self.eos_token_id, seed,
                          arrival, priority=priority, cache_salt=req_in.cache_salt,
                          lora_id=lora_id, parent_id=request_id, bad_word_ids=req_in.bad_word_ids,
                          mm=mm)
            reqs.append(req)
        # a failed grammar raises ValueError here; one still compiling waits outside the
        # scheduler while steps go on
        if req_in.grammar is not None and not self.grammars.admit(request_id, req_in.grammar, reqs):
            self.outputs.add(request_id, req_in.prompt, req_in.prompt_token_ids, params,
                             reqs, arrival)
            return
        # siblings of a parallel-sampling request start from the first one's prompt blocks
        self.scheduler.add_request(reqs[0], reqs[1:])
        # only once the scheduler has taken it: a refused request leaves nothing behind
        self.outputs.add(request_id, req_in.prompt, req_in.prompt_token_ids, params, reqs, arrival)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar finished compiling join the scheduler; one whose grammar
        failed ends, aborted."""
        if not self.grammars.waiting:
            return []
        idle = not self.scheduler.has_unfinished_requests() and self._in_flight is None
        ready, failed = self.grammars.ready(idle)
        for reqs in ready:
            self.scheduler.add_request(reqs[0], reqs[1:])
        return self.outputs.make_outputs(failed)

    def token_text(self, token_id: int) -> str | None:
        return self.outputs.token_text(token_id)

    def abort_request(self, request_id) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            parent = self.outputs.remove(rid)
            if parent is None:
                continue
            if self.grammars.release(rid):
                continue  # never reached the scheduler
            self.scheduler.finish_requests([s.request.request_id for s in parent.seqs],
                                           RequestStatus.FINISHED_ABORTED)
        if not self.has_unfinished_requests():  # the background compilation may go on
            self.runner.compiler.set_serving(False)

    def has_unfinished_requests(self) -> bool:
        # a step still in flight is work too: its results are collected by the next step()
        return bool(self.outputs.parents) or self._in_flight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self.outputs.parents)

    def is_unfinished(self, request_id: str) -> bool:
        return request_id in self.outputs.parents

    # one iteration
    def step(self) -> list[RequestOutput]:
        """Schedule and dispatch one step; return the outputs of the step that finished.
        With async scheduling the step dispatched here runs on the device while the host
        reads the previous one's tokens and builds its outputs (and, in the next call,
        schedules the step after); without it, each step is read before the next one.

        A step that raises fails the requests of the steps not yet read (finish_reason
        "error", Request.error saying why) and the engine goes on; max_step_failures within
        step_failure_window seconds re-raise, which stops it."""
        try:
            return self._step()
        except Exception as e:  # noqa: BLE001 - any failure of a step is contained alike
            return self._contain(e)

    def _contain(self, error: Exception) -> list[RequestOutput]:
        """After a step raised: its requests end with the error, their blocks leave the prefix
        cache; if the device state went with it, a fresh one, and the other running requests
        compute their tokens again."""
        stats = self.engine_stats
        stats.num_failed_steps += 1
        if self.failures.record():
            logger.error("%d failed steps within %.0f s: the engine stops",
                         len(self.failures.times), self.failures.window)
            raise error
        ids = {rid for out in self._open_steps for rid in out.num_scheduled_tokens}
        self._open_steps, self._in_flight = [], None
        # what the failed call had made already (a step read before the failure) still goes out
        made, self._step_outputs = self._step_outputs, []
        lost = self.runner.device_state_lost()
        if lost:
            self.runner.reset_device_state()
            stats.num_device_state_resets += 1
        failed = self.scheduler.fail_requests(ids, describe(error))
        if lost:
            self.scheduler.recompute_running()
        stats.num_failed_requests += len(failed)
        logger.error("a step failed (%s): %d requests end with an error%s", describe(error),
                     len(failed), "; the device state was lost and is rebuilt, the other "
                     "requests compute their tokens again" if lost else "",
                     exc_info=not isinstance(error, InjectedFault))
        if self.runner.compiler.compiling_in_background:
            self.runner.compiler.set_serving(self.has_unfinished_requests())
        return made + self.outputs.make_outputs(dict.fromkeys(r.parent_id for r in failed))

    def _step(self) -> list[RequestOutput]:
        outputs = self._step_outputs = []
        compiling = self.runner.compiler.compiling_in_background
        if compiling:
            self.runner.compiler.set_serving(True)
        # a request whose sampling needs every earlier token on the host (multi-token bad
        # words) keeps steps from overlapping while it runs
        overlap = self.config.async_scheduling and not self.scheduler.needs_host_tokens
        # a step that verified proposals decides where each request's next tokens go (its
        # accepted count): it is read before the next step is scheduled
        verified = self._in_flight is not None and bool(self._in_flight[0].scheduled_spec_decode_tokens)
        if self._in_flight is not None and (not overlap or verified):
            outputs += self._finish_step(*self._in_flight)
            self._in_flight = None
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        outputs += self._admit_compiled()
        out = self.scheduler.schedule()
        self._open_steps.append(out)
        if self.faults is not None:
            self.faults.maybe_fail(self.runner)
        if self.runner.drafter is not None:
            self.runner.drafter.enabled = self.speculator.enabled_for(self.scheduler.num_running)
        scheduled_at = time.time()
        for new in out.scheduled_new_reqs:  # (a request's first step sends it in full)
            parent = self.outputs.parent_of(new.req_id)
            if parent is not None and parent.metrics.first_scheduled_time is None:
                parent.metrics.first_scheduled_time = scheduled_at
        # a constrained row's mask depends on the token its previous step sampled: sampling
        # waits until the host has read that step and advanced the grammars, which it does
        # while the device runs this step's forward pass
        masked = self.grammars.constrains(out)
        flight = self.runner.dispatch(out, masked)
        if self.runner.lora_failures:
            outputs += self._abort_failed_loras(self.runner.lora_failures)
        previous, self._in_flight = self._in_flight, (out, flight)
        if previous is not None:
            outputs += self._finish_step(*previous)
        if masked and flight is not None:
            self.runner.sample(flight, self.grammars.bitmask(out, flight))
        if not overlap or flight is None:
            outputs += self._finish_step(*self._in_flight)
            self._in_flight = None
        self.engine_stats.account_step()
        if compiling:
            self.runner.compiler.set_serving(self.has_unfinished_requests())
        return outputs

    def _finish_step(self, out: SchedulerOutput, flight: InFlight | None) -> list[RequestOutput]:
        """Read a dispatched step's results and turn them into request updates and outputs."""
        res = self.runner.collect(flight)
        self._open_steps = [s for s in self._open_steps if s is not out]
        now = time.time()
        for rid, (start, entries) in res.prompt_logprobs.items():
            self.outputs.add_prompt_logprobs(rid, start, entries)
        touched = {}
        if res.non_finite:  # those requests alone end; the step's others go on
            failed = self.scheduler.fail_requests(
                res.non_finite, "the model's logits were not numbers (NaN or infinity)")
            self.engine_stats.num_failed_requests += len(failed)
            touched.update(dict.fromkeys(r.parent_id for r in failed))
        logprobs, update = res.logprobs, self.outputs.update
        for upd in self.scheduler.update_from_output(out, res.sampled):
            req = upd.request
            if req.grammar is not None and upd.new_token_ids:
                self.grammars.advance(req, upd.new_token_ids)
            touched[update(req, upd.new_token_ids,
                           logprobs.get(req.request_id) if logprobs else None, now)] = None
        return self.outputs.make_outputs(touched)

    def _abort_failed_loras(self, failures: dict[int, str]) -> list[RequestOutput]:
        """Adapters that could not be read again: their requests end now, aborted (their
        tokens of the step just dispatched, computed without the adapter, are never read);
        everything else goes on."""
        self.lora.unregister_failed(failures)
        reqs = [r for r in self.scheduler.requests.values() if r.lora_id in failures]
        self.scheduler.finish_requests([r.request_id for r in reqs], RequestStatus.FINISHED_ABORTED)
        return self.outputs.make_outputs(dict.fromkeys(r.parent_id for r in reqs))

    # introspection (stats.py)
    def memory_report(self) -> dict:
        """Waste of allocated KV slots over the run so far, peak concurrency, and what static
        max-length preallocation would have admitted with the same memory."""
        return self.engine_stats.memory_report()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def kv_cache_usage(self) -> float:
        return self.kv_manager.usage()

    def stats(self) -> dict:
        """A snapshot of the scheduler and cache counters (what /metrics exports)."""
        return self.engine_stats.snapshot()
