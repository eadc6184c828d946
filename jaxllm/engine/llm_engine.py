"""LLMEngine: add_request / step / abort_request, as in vLLM."""
from __future__ import annotations

import concurrent.futures
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import EngineConfig
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.scheduler import Scheduler
from jaxllm.engine.input_processor import EngineRequest, InputProcessor
from jaxllm.engine.output_processor import OutputProcessor
from jaxllm.engine.outputs import RequestOutput
from jaxllm.kernels import matmul_backend
from jaxllm.kernels.cpu import build as cpu_build
from jaxllm.layers.dtype_policy import resolve_policy
from jaxllm.loader import load_model
from jaxllm.parallel import make_mesh
from jaxllm.parallel import multiprocess as mp
from jaxllm.quantization import kv as kvq
from jaxllm import executable_cache
from jaxllm.runner.kv_cache import kv_bytes_per_block
from jaxllm.runner.model_runner import ModelRunner
from jaxllm.runner.outputs import InFlight
from jaxllm.core.scheduler import SchedulerOutput
from jaxllm.sampling_params import SamplingParams
from jaxllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("jaxllm")

DEFAULT_CPU_KV_BYTES = 1 << 30


def setup_compilation_cache(cache_dir: str | None, executables: bool = True) -> None:
    """jaxllm's executable cache, or (executables=False) JAX's persistent cache. Not both: an
    executable JAX's cache loads cannot be serialized whole again (executable_cache), so with
    JAX's cache on, a step it holds would never reach ours."""
    executable_cache.configure(cache_dir if executables else None)
    if not cache_dir or executable_cache.enabled():
        return
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


MEM_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
JAX_MEM_FRACTION = 0.75  # JAX's GPU allocator takes this share of the device when not told
ALLOCATOR_SLACK = 0.03   # of the usable memory, left free for fragmentation and autotuning
# XLA's GPU compiler plans for this share of the device; a step whose arguments (weights and
# KV cache) exceed it is compiled to recompute everything it can to save memory
XLA_GPU_PLAN_SHARE = 0.8


def claim_device_memory(utilization: float) -> bool:
    """gpu_memory_utilization is a share of the whole device, as in vLLM, but JAX's GPU
    allocator preallocates 75% of it unless told otherwise. Before JAX starts a backend, give
    the allocator that share; a fraction the user set, or a backend already up, is left be."""
    from jax._src import xla_bridge
    if any(os.environ.get(v) for v in MEM_FRACTION_VARS) or xla_bridge.backends_are_initialized():
        return False
    os.environ[MEM_FRACTION_VARS[0]] = f"{utilization:.4f}"
    return True


def allocator_fraction() -> float:
    for var in MEM_FRACTION_VARS:
        if os.environ.get(var):
            return float(os.environ[var])
    return JAX_MEM_FRACTION


def kv_budget_bytes(limit: int, in_use: int, scratch: int, utilization: float,
                    fraction: float) -> int:
    """Bytes left for the KV cache: `utilization` of the whole device (limit / fraction), as
    far as the allocator's pool (`limit`) and XLA's plan reach, less a little slack, what is
    already in use (the weights) and the largest step's scratch."""
    total = limit / fraction
    usable = min(utilization * total, limit, XLA_GPU_PLAN_SHARE * total)
    return int(usable * (1 - ALLOCATOR_SLACK)) - in_use - scratch


def near_memory_map_limit(share: float = 0.75, limit: int | None = None) -> bool:
    """Warn when this process holds more than `share` of the kernel's limit on memory
    mappings (Linux's vm.max_map_count, 65,530 by default), and say so. XLA:CPU maps each
    compiled executable's code into ~60 regions (an engine's few thousand); past the limit a
    compile cannot map its code and the process crashes. Several engines in one process get
    there."""
    try:
        if limit is None:
            with open("/proc/sys/vm/max_map_count") as f:
                limit = int(f.read())
        with open("/proc/self/maps") as f:
            used = sum(1 for _ in f)
    except (OSError, ValueError):  # not Linux
        return False
    if used <= share * limit:
        return False
    logger.warning("this process holds %d memory mappings of the %d the kernel allows "
                   "(vm.max_map_count): compiling more executables (another engine) may crash "
                   "it; free engines no longer used, or raise vm.max_map_count", used, limit)
    return True


def process_seconds() -> float:
    """Seconds since this process started (imports included)."""
    import psutil
    return time.time() - psutil.Process().create_time()


class LLMEngine:
    def __init__(self, config: EngineConfig, lora_modules=(), model_names=()):
        """lora_modules: LoRARequests registered before anything compiles (a refused one stops
        the start); model_names: what else the base model is called, for their base check."""
        start = time.perf_counter()
        self.config = config
        claim_device_memory(config.gpu_memory_utilization)
        if config.num_processes > 1:  # before anything touches a device
            mp.initialize(config.distributed_coordinator, config.num_processes, config.process_id)
        setup_compilation_cache(config.compilation_cache_dir, config.executable_cache)
        platform = jax.default_backend()
        # where matmuls run, then the weights' storage and the dots' dtypes for it
        self.matmul_backend = matmul_backend(
            platform, config.tensor_parallel_size * config.num_processes, config.matmul_backend,
            config.cpu_kernels)
        if platform == "cpu" and config.cpu_kernels and cpu_build.available():
            cpu_build.set_amx(config.cpu_amx)
        self.policy = resolve_policy(config.dtype, platform, self.matmul_backend)
        if config.attention_backend == "auto":
            config.attention_backend = ("pallas" if platform == "gpu" else
                                        "cpu" if config.cpu_kernels else "xla")
        self.mesh = make_mesh(config.tensor_parallel_size)
        load_start = time.perf_counter()
        loaded = load_model(config.model, self.policy, config.load_format, config.seed,
                            config.tokenizer, attention_backend=config.attention_backend,
                            mesh=self.mesh, quantization=config.quantization,
                            smoothquant_alpha=config.smoothquant_alpha,
                            matmul_backend=self.matmul_backend,
                            int4_activations=config.int4_activations)
        self.load_seconds = time.perf_counter() - load_start
        # the KV cache's storage: bf16 when asked, and for "auto" the dtype the model's float
        # weights are stored in, as vLLM's auto (a CPU's bf16 policy: attention reads half the
        # bytes); otherwise, and for quantized weights (whose products are exact to the
        # dequantized float model's), the activations' dtype. On a CPU's XLA attention a bf16
        # cache is kept as its bit patterns (kv.py)
        kv_bf16 = config.kv_cache_dtype == "bfloat16" or (
            config.kv_cache_dtype == "auto" and self.policy.weight == jnp.bfloat16
            and loaded.quant is None)
        self.dtype = jnp.bfloat16 if kv_bf16 else self.policy.activation
        if platform == "cpu" and self.dtype == jnp.bfloat16 and config.attention_backend != "pallas":
            self.dtype = kvq.BF16_BITS
        self.arch = loaded.arch
        self.tokenizer = loaded.tokenizer
        self.eos_token_id = loaded.eos_token_id
        self.smoothquant = loaded.smoothquant  # how w8a8's smoothing was made, when it was
        model_max = loaded.arch.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(f"max_model_len ({config.max_model_len}) is larger than the model's "
                             f"maximum context ({model_max})")
        config.resolve(platform, model_max)
        spec = config.speculative_config
        draft = None
        if spec is not None and spec.method == "draft_model":
            from jaxllm.spec_decode.draft_model import check_draft
            draft = load_model(spec.model, self.policy, "auto", config.seed,
                               attention_backend=config.attention_backend, mesh=self.mesh,
                               matmul_backend=self.matmul_backend)
            check_draft(draft, loaded, config.max_model_len)
        bs = config.block_size
        # a draft model's cache has the same blocks as the target's: a block costs both
        per_block = kv_bytes_per_block(self.arch, bs, self.dtype, config.kv_cache_dtype) + (
            kv_bytes_per_block(draft.arch, bs, self.dtype, config.kv_cache_dtype)
            if draft is not None else 0)
        self.is_follower = jax.process_index() != 0
        # LoRA: the adapters known (a host registry and cache) and the device slots
        self.lora, lora_slots = (self._setup_lora(loaded) if config.enable_lora else (None, None))
        if lora_modules and self.lora is None:
            raise ValueError("LoRA modules need enable_lora=True")
        if self.lora is not None:
            self.lora.base_names += list(model_names)
            for lora in lora_modules:
                self.lora.add(lora)
        num_blocks = 0 if self.is_follower else self._num_blocks(platform, per_block, loaded, lora_slots)
        if jax.process_count() > 1:  # every process sizes its cache as process 0 did
            num_blocks = mp.Channel().announce(mp.INIT, num_blocks)[1]
        num_host_blocks = 0
        if config.preemption_mode == "swap":
            num_host_blocks = int(config.swap_space * 2**30) // per_block
            logger.info("swap space: %d host blocks (%.2f GiB)", num_host_blocks, config.swap_space)
        self.kv_manager = KVCacheManager(num_blocks, bs, config.enable_prefix_caching,
                                         num_host_blocks)
        k = spec.k if spec is not None else 0
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.max_model_len,
                                   config.scheduling_policy, config.preemption_mode,
                                   config.max_loras if config.enable_lora else 0,
                                   num_lookahead_tokens=k if draft is not None else 0,
                                   num_spec_tokens=k,
                                   num_scheduler_steps=config.num_scheduler_steps)
        self.runner = ModelRunner(loaded, self.dtype, num_blocks, bs, config.max_model_len,
                                  config.max_num_seqs, config.max_num_batched_tokens,
                                  num_host_blocks, config.attention_backend, config.kv_cache_dtype,
                                  lora_slots, num_spec_tokens=k,
                                  spec_probabilistic=spec is not None
                                  and spec.draft_sample_method == "probabilistic",
                                  num_scheduler_steps=config.num_scheduler_steps)
        self.speculator = None
        if spec is not None:
            from jaxllm.spec_decode.proposer import Speculator
            if draft is not None:
                from jaxllm.spec_decode.draft_model import DraftModel
                self.runner.drafter = DraftModel(draft, self.runner, num_host_blocks, k,
                                                 spec.draft_sample_method == "probabilistic")
            self.speculator = Speculator(spec, self.runner.batch, self.runner.drafter)
            logger.info("speculative decoding: %s", spec.describe())
        # huge pages under the weights and the KV cache (a CPU's TLB), asked for on a thread
        # (bytes collapsed to huge pages, bytes asked for only), once that thread has finished
        self.huge_page_bytes: tuple[int, int] | None = None
        self._huge_pages = None
        if platform == "cpu" and config.huge_pages:
            from jaxllm.runner.huge_pages import advise_in_background
            drafter = self.runner.drafter
            arrays = (self.runner.state, self.runner.kv_cache) + (
                (drafter.state, drafter.kv_cache) if drafter is not None else ())
            self._huge_pages = advise_in_background(
                arrays, lambda *n: setattr(self, "huge_page_bytes", n))
        self.compile_seconds = 0.0
        if config.warmup:
            self.compile_seconds = self.runner.compile_all(
                background=config.compile_in_background)
            c = self.runner.compiler
            total = len(c.shapes.all) + len(c.sample_buckets) + len(c.passes_shapes)
            logger.info("compiled %d of %d step executables (forward %d, sampling %d, "
                        "multi-step %d) in %.1f s", min(c.num_compiled, total), total,
                        len(c.shapes.all), len(c.sample_buckets), len(c.passes_shapes),
                        self.compile_seconds)
            near_memory_map_limit()
        self._rng = np.random.default_rng(config.seed)
        self.structured = StructuredOutputManager(self.tokenizer, self.arch.vocab_size,
                                                  self.eos_token_id)
        # structured requests whose grammar is still compiling: id -> (compiled future,
        # sequences); they join the scheduler when it is ready
        self._awaiting_grammar: dict[str, tuple[concurrent.futures.Future, list[Request]]] = {}
        self.inputs = InputProcessor(self.tokenizer, self.arch.vocab_size, config.max_model_len,
                                     self.structured, speculative=spec is not None)
        self.outputs = OutputProcessor(self.tokenizer)
        # async scheduling: the step dispatched last, whose tokens the host has not read yet
        self._in_flight: tuple[SchedulerOutput, InFlight | None] | None = None
        # requests whose sampling needs every earlier token on the host (multi-token bad
        # words): while one runs, steps do not overlap
        self._needs_sync: set[str] = set()
        self.kv_slot_steps = 0            # memory accounting, summed over steps
        self.kv_waste_slot_steps = 0
        self.peak_running = 0
        self.startup_seconds = time.perf_counter() - start
        logger.info("engine ready in %.1f s (load %.1f s, compile %.1f s; %.1f s since the "
                    "process started; model %s, dtype %s, %s, %s scheduling)",
                    self.startup_seconds, self.load_seconds, self.compile_seconds,
                    process_seconds(), loaded.path, self.policy.describe(), platform,
                    "async" if config.async_scheduling else "synchronous")

    def _setup_lora(self, loaded):
        from jaxllm.lora.peft import LoRALayout, base_model_names
        from jaxllm.lora.registry import LoRARegistry
        from jaxllm.lora.slots import LoRASlots
        from jaxllm.models import get_model_class
        cfg = self.config
        layout = LoRALayout(get_model_class(loaded.arch.architecture),
                            loaded.checkpoint_arch or loaded.arch, self.mesh.size, cfg.max_lora_rank)
        registry = LoRARegistry(layout, cfg.max_cpu_loras or cfg.max_loras,
                                base_model_names(loaded.path, cfg.model))
        slots = LoRASlots(layout, cfg.max_loras, self.policy.weight, self.mesh, registry.adapter)
        logger.info("LoRA: %d device slots of rank %d over %s (%.1f MiB), %d adapters cached on "
                    "the host", cfg.max_loras, cfg.max_lora_rank, ", ".join(layout.module_names),
                    slots.nbytes / 2**20, registry.max_cpu_loras)
        return registry, slots

    def _num_blocks(self, platform: str, per_block: int, loaded, lora_slots=None) -> int:
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            num = cfg.num_gpu_blocks_override
        elif cfg.kv_cache_memory_bytes is not None:
            num = cfg.kv_cache_memory_bytes // per_block
        elif platform == "cpu":
            num = DEFAULT_CPU_KV_BYTES // per_block
        else:
            num = self._profile_blocks(per_block, loaded, lora_slots)
        if num < 2:
            raise ValueError(f"the KV-cache budget fits {num} blocks of {per_block} bytes; "
                             "at least 2 are needed (raise the memory budget)")
        if platform == "cpu":
            # past the host's free memory the kernel's OOM killer ends the process silently
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            if num * per_block > free:
                raise ValueError(f"the KV cache needs {num * per_block / 2**30:.1f} GiB of memory "
                                 f"but the host has {free / 2**30:.1f} GiB free; lower "
                                 "kv_cache_memory_bytes or num_gpu_blocks_override")
        tokens = (num - 1) * cfg.block_size
        stored = "bfloat16" if self.dtype == kvq.BF16_BITS else jnp.dtype(self.dtype).name
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s %s); maximum "
                    "concurrency for %d-token requests: %.2fx", num, cfg.block_size, tokens,
                    num * per_block / 2**30, cfg.kv_cache_dtype, stored if cfg.kv_cache_dtype
                    in ("auto", "bfloat16") else "with scales", cfg.max_model_len,
                    tokens / cfg.max_model_len)
        if cfg.kv_cache_dtype != "auto":
            plain = kv_bytes_per_block(self.arch, cfg.block_size, self.policy.activation)
            logger.info("KV cache dtype %s: %.2fx the tokens of %s in the same memory",
                        cfg.kv_cache_dtype, plain / per_block, jnp.dtype(self.policy.activation).name)
        return num

    def _profile_blocks(self, per_block: int, loaded, lora_slots=None) -> int:
        """gpu_memory_utilization of device memory, less weights and a maximal step's scratch."""
        cfg = self.config
        dev = jax.devices()[0]
        stats = dev.memory_stats() or {}
        limit = stats.get("bytes_limit")
        if not limit:
            raise ValueError("device memory size is unknown; set kv_cache_memory_bytes or "
                             "num_gpu_blocks_override")
        # a runner with a 2-block cache, only to measure the largest step's scratch memory
        spec = cfg.speculative_config
        probe = ModelRunner(loaded, self.dtype, 2, cfg.block_size, cfg.max_model_len,
                            cfg.max_num_seqs, cfg.max_num_batched_tokens,
                            attention_backend=cfg.attention_backend,
                            kv_cache_dtype=cfg.kv_cache_dtype, lora=lora_slots,
                            num_spec_tokens=spec.k if spec is not None else 0,
                            spec_probabilistic=spec is not None
                            and spec.draft_sample_method == "probabilistic")
        scratch = probe.activation_bytes()
        del probe
        in_use = dev.memory_stats().get("bytes_in_use", 0)
        budget = kv_budget_bytes(limit, in_use, scratch, cfg.gpu_memory_utilization,
                                 allocator_fraction())
        logger.info("memory: limit %.2f GiB, in use %.2f GiB, step scratch %.2f GiB",
                    limit / 2**30, in_use / 2**30, scratch / 2**30)
        # the stats are one device's; each device holds its KV heads' share of every block
        return max(0, budget // (per_block // self.mesh.size))

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

    # LoRA adapters
    def add_lora(self, lora_request, adapter=None) -> bool:
        """Register an adapter: read and checked now (ValueError naming it if refused), or
        given as read by read_lora()."""
        if self.lora is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True")
        self.lora.add(lora_request, adapter)
        return True

    def read_lora(self, lora_request):
        """Read and check an adapter for add_lora() (safe to call from another thread)."""
        if self.lora is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True")
        return self.lora.read(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter; requests already running with it finish with it."""
        if self.lora is None:
            return False
        key = self.lora.remove(lora_int_id)
        if key is None:
            return False
        if not any(r.lora_id == key for r in self.scheduler.requests.values()):
            self.runner.lora.evict(key)
        return True

    def list_loras(self) -> set[int]:
        return set() if self.lora is None else {r.lora_int_id for r in self.lora.list()}

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
        reqs = []
        for i, child_id in enumerate(child_ids):
            if params.seed is not None:
                seed = (params.seed + i) & 0xFFFFFFFF
            else:
                seed = int(self._rng.integers(0, 2**32))
            req = Request(child_id, req_in.prompt_token_ids, params, self.eos_token_id, seed,
                          arrival, priority=priority, cache_salt=req_in.cache_salt,
                          lora_id=lora_id, parent_id=request_id)
            req.bad_word_ids = req_in.bad_word_ids
            reqs.append(req)
        compiled = None
        if req_in.grammar is not None:
            compiled = self.structured.compile(req_in.grammar)
            if not compiled.done():  # it waits outside the scheduler, steps go on
                self.outputs.add(request_id, req_in.prompt, req_in.prompt_token_ids, params,
                                 reqs, arrival)
                self._awaiting_grammar[request_id] = (compiled, reqs)
                return
            self._attach_grammars(reqs, compiled.result())  # a failure raises ValueError here
        # siblings of a parallel-sampling request start from the first one's prompt blocks
        self.scheduler.add_request(reqs[0], reqs[1:])
        # only once the scheduler has taken it: a refused request leaves nothing behind
        self.outputs.add(request_id, req_in.prompt, req_in.prompt_token_ids, params, reqs, arrival)
        if any(len(w) > 1 for w in req_in.bad_word_ids or ()):
            self._needs_sync.add(request_id)

    # structured outputs
    def _attach_grammars(self, reqs: list[Request], compiled) -> None:
        for req in reqs:
            req.grammar = self.structured.grammar(compiled)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar finished compiling join the scheduler; one whose grammar
        failed ends (aborted, the error logged; the server compiles before submitting, so its
        clients get a 400 instead)."""
        if not self._awaiting_grammar:
            return []
        failed = []
        if not self.scheduler.has_unfinished_requests() and self._in_flight is None:
            # nothing else to run: wait a little for a compilation instead of spinning
            concurrent.futures.wait([f for f, _ in self._awaiting_grammar.values()],
                                    timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
        for rid, (compiled, reqs) in list(self._awaiting_grammar.items()):
            if not compiled.done():
                continue
            del self._awaiting_grammar[rid]
            error = compiled.exception()
            if error is not None:
                logger.error("request %s: %s", rid, error)
                for req in reqs:
                    req.status = RequestStatus.FINISHED_ABORTED
                failed.append(rid)
                continue
            self._attach_grammars(reqs, compiled.result())
            self.scheduler.add_request(reqs[0], reqs[1:])
        return self.outputs.make_outputs(failed)

    def _advance_grammar(self, req: Request, tokens: list[int]) -> None:
        """A constrained sequence's new tokens advance its grammar; it ends (stop) once the
        grammar is complete and allows nothing more."""
        if req.status.finished and tokens[-1] == req.eos_token_id:
            tokens = tokens[:-1]  # ended by EOS, which the grammar allowed
        grammar = req.grammar
        if tokens and not grammar.accept(tokens):
            # only when other masks (allowed_token_ids, bad words) left no token the grammar allows
            logger.error("request %s sampled a token its grammar does not allow: %s",
                         req.request_id, grammar.error)
            self.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
        elif grammar.is_terminated:
            if req.status == RequestStatus.FINISHED_LENGTH:  # complete at the limit: it stopped
                req.status = RequestStatus.FINISHED_STOPPED
            elif not req.status.finished:
                self.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_STOPPED)

    def _grammar_rows(self, out: SchedulerOutput, flight: InFlight) -> list:
        """(row of the step, grammar) of the constrained rows that sample in it."""
        st = flight.step
        rows = []
        for i in np.nonzero(st.final)[0]:
            req = out.scheduled_reqs[st.req_ids[i]]
            if req.grammar is not None and not req.status.finished:
                rows.append((int(i), req.grammar))
        return rows

    def token_text(self, token_id: int) -> str | None:
        return self.outputs.token_text(token_id)

    def abort_request(self, request_id) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            parent = self.outputs.remove(rid)
            if parent is None:
                continue
            self._needs_sync.discard(rid)
            if self._awaiting_grammar.pop(rid, None) is not None:
                continue  # never reached the scheduler
            self.scheduler.finish_requests([s.request.request_id for s in parent.seqs],
                                           RequestStatus.FINISHED_ABORTED)

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
        schedules the step after); without it, each step is read before the next one."""
        outputs = []
        overlap = self.config.async_scheduling and not self._needs_sync
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
        masked = any(out.scheduled_reqs[rid].grammar is not None for rid in out.sampling_req_ids)
        flight = self.runner.dispatch(out, masked)
        if self.runner.lora_failures:
            outputs += self._abort_failed_loras(self.runner.lora_failures)
        previous, self._in_flight = self._in_flight, (out, flight)
        if previous is not None:
            outputs += self._finish_step(*previous)
        if masked and flight is not None:
            rows = self._grammar_rows(out, flight)
            self.runner.sample(flight, self.structured.bitmask(rows, len(flight.step.req_ids)))
        if not overlap or flight is None:
            outputs += self._finish_step(*self._in_flight)
            self._in_flight = None
        self._account_memory()
        return outputs

    def _finish_step(self, out: SchedulerOutput, flight: InFlight | None) -> list[RequestOutput]:
        """Read a dispatched step's results and turn them into request updates and outputs."""
        res = self.runner.collect(flight)
        now = time.time()
        for rid, (start, entries) in res.prompt_logprobs.items():
            self.outputs.add_prompt_logprobs(rid, start, entries)
        touched = {}
        for upd in self.scheduler.update_from_output(out, res.sampled):
            req = upd.request
            if req.grammar is not None and upd.new_token_ids:
                self._advance_grammar(req, upd.new_token_ids)
            pid = self.outputs.update(req, upd.new_token_ids, res.logprobs.get(req.request_id),
                                      now, self._finish_stopped)
            touched[pid] = None
        outputs = self.outputs.make_outputs(touched)
        for o in outputs:
            if o.finished:
                self._needs_sync.discard(o.request_id)
        return outputs

    def _abort_failed_loras(self, failures: dict[int, str]) -> list[RequestOutput]:
        """Adapters that could not be read again (the host cache had let them go and their
        files changed): their requests end now, aborted (their tokens of the step just
        dispatched, computed without the adapter, are never read); everything else goes on."""
        for key, why in failures.items():
            req = self.lora.requests[key]
            logger.error("LoRA adapter %r could not be read again, its requests are aborted "
                         "and it is unregistered: %s", req.lora_name, why)
            self.lora.remove_key(key)
        reqs = [r for r in self.scheduler.requests.values() if r.lora_id in failures]
        self.scheduler.finish_requests([r.request_id for r in reqs], RequestStatus.FINISHED_ABORTED)
        parents = dict.fromkeys(r.parent_id for r in reqs)
        for pid in parents:
            self._needs_sync.discard(pid)
        return self.outputs.make_outputs(parents)

    def _finish_stopped(self, req: Request) -> None:
        """A stop string ended the sequence (the detokenizer found it)."""
        if req.status.finished:  # the same token hit a length limit: the stop wins
            req.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_STOPPED)

    def _account_memory(self) -> None:
        """KV slots held by running requests against slots holding a token, once per step.
        Shared (prefix-cached or forked) blocks are full, so a block's empty slots belong
        to the one request whose table ends in it."""
        kv, bs = self.kv_manager, self.config.block_size
        running = self.scheduler.running
        if not running:
            return
        allocated = (kv.pool.num_usable_blocks - kv.num_free_blocks) * bs
        waste = sum(len(kv.get_blocks(r.request_id)) * bs - r.num_computed_tokens for r in running)
        self.kv_slot_steps += allocated
        self.kv_waste_slot_steps += min(max(waste, 0), allocated)
        self.peak_running = max(self.peak_running, len(running))

    def memory_report(self) -> dict:
        """Waste of allocated KV slots over the run so far, peak concurrency, and what static
        max-length preallocation would have admitted with the same memory."""
        total = self.kv_manager.pool.num_usable_blocks * self.config.block_size
        waste = self.kv_waste_slot_steps / self.kv_slot_steps if self.kv_slot_steps else 0.0
        return {"kv_total_slots": total, "kv_waste_perc": 100.0 * waste,
                "peak_running_seqs": self.peak_running,
                "static_prealloc_seqs": total // self.config.max_model_len,
                "max_model_len": self.config.max_model_len}

    # introspection
    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def kv_cache_usage(self) -> float:
        return self.kv_manager.usage()

    def stats(self) -> dict:
        """A snapshot of the scheduler and cache counters (what /metrics exports)."""
        sched, kv = self.scheduler, self.kv_manager
        return {
            "num_requests_running": sched.num_running,
            "num_requests_waiting": sched.num_waiting,
            "kv_cache_usage_perc": kv.usage(),
            "num_preemptions": sched.num_preemptions,
            "num_swaps": sched.num_swaps,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "prompt_tokens": sched.num_prompt_tokens,
            "generation_tokens": sched.num_generation_tokens,
            "kv_slot_steps": self.kv_slot_steps,
            "kv_waste_slot_steps": self.kv_waste_slot_steps,
            "peak_running": self.peak_running,
            "kv_total_slots": self.kv_manager.pool.num_usable_blocks * self.config.block_size,
            **self._lora_stats(),
            # speculative decoding (vLLM's counters): verifications, proposed and accepted tokens
            "spec_decode_num_drafts": sched.spec_num_drafts,
            "spec_decode_num_draft_tokens": sched.spec_num_draft_tokens,
            "spec_decode_num_accepted_tokens": sched.spec_num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(sched.spec_accepted_per_pos),
        }

    def _lora_stats(self) -> dict:
        """Requests running and waiting per adapter name (vLLM's lora_requests_info)."""
        if self.lora is None:
            return {}
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for r in self.scheduler.requests.values():
            if r.lora_id:
                side = running if r.status == RequestStatus.RUNNING else waiting
                name = self.lora.name_of(r.lora_id)
                side[name] = side.get(name, 0) + 1
        return {"lora_running": running, "lora_waiting": waiting, "max_lora": self.config.max_loras}

