"""LLMEngine: add_request / step / abort_request, as in vLLM."""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import EngineConfig
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.scheduler import Scheduler
from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxllm.runner.sampler import MAX_LOGPROBS
from jaxllm.loader import load_model
from jaxllm.parallel import make_mesh
from jaxllm.parallel import multiprocess as mp
from jaxllm.runner.model_runner import ModelRunner, kv_bytes_per_block
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jaxllm")

DEFAULT_CPU_KV_BYTES = 1 << 30


def setup_compilation_cache(cache_dir: str | None) -> None:
    if not cache_dir:
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


def resolve_dtype(name: str, platform: str):
    if name == "auto":
        # bf16 on accelerators; on CPU XLA's f32 matmuls are the fast ones
        return jnp.bfloat16 if platform in ("gpu", "tpu") else jnp.float32
    return jnp.dtype(name).type


@dataclass
class _Child:
    """Engine-side view of one sequence: its detokenizer and the parent it reports to."""
    request: Request
    parent_id: str
    index: int
    detok: IncrementalDetokenizer | None
    logprobs: list | None = None
    cumulative_logprob: float = 0.0


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[str]
    metrics: RequestMetrics
    params: SamplingParams
    prompt_logprobs: list | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig):
        start = time.perf_counter()
        self.config = config
        claim_device_memory(config.gpu_memory_utilization)
        if config.num_processes > 1:  # before anything touches a device
            mp.initialize(config.distributed_coordinator, config.num_processes, config.process_id)
        setup_compilation_cache(config.compilation_cache_dir)
        platform = jax.default_backend()
        self.dtype = resolve_dtype(config.dtype, platform)
        if config.attention_backend == "auto":
            config.attention_backend = "pallas" if platform == "gpu" else "xla"
        self.mesh = make_mesh(config.tensor_parallel_size)
        loaded = load_model(config.model, self.dtype, config.load_format, config.seed,
                            config.tokenizer, attention_backend=config.attention_backend,
                            mesh=self.mesh)
        self.arch = loaded.arch
        self.tokenizer = loaded.tokenizer
        self.eos_token_id = loaded.eos_token_id
        model_max = loaded.arch.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(f"max_model_len ({config.max_model_len}) is larger than the model's "
                             f"maximum context ({model_max})")
        config.resolve(platform, model_max)
        bs = config.block_size
        per_block = kv_bytes_per_block(self.arch, bs, self.dtype)
        self.is_follower = jax.process_index() != 0
        num_blocks = 0 if self.is_follower else self._num_blocks(platform, per_block, loaded)
        if jax.process_count() > 1:  # every process sizes its cache as process 0 did
            num_blocks = mp.Channel().announce(mp.INIT, num_blocks)[1]
        num_host_blocks = 0
        if config.preemption_mode == "swap":
            num_host_blocks = int(config.swap_space * 2**30) // per_block
            logger.info("swap space: %d host blocks (%.2f GiB)", num_host_blocks, config.swap_space)
        self.kv_manager = KVCacheManager(num_blocks, bs, config.enable_prefix_caching,
                                         num_host_blocks)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.max_model_len,
                                   config.scheduling_policy, config.preemption_mode)
        self.runner = ModelRunner(loaded, self.dtype, num_blocks, bs, config.max_model_len,
                                  config.max_num_seqs, config.max_num_batched_tokens,
                                  num_host_blocks, config.attention_backend)
        if config.warmup:
            secs = self.runner.compile_all()
            logger.info("compiled %d step shapes in %.1f s", len(self.runner.shapes.all), secs)
        self._rng = np.random.default_rng(config.seed)
        self._children: dict[str, _Child] = {}
        self._token_text: dict[int, str] = {}
        self.num_prompt_tokens = 0       # prompt tokens computed (prefix-cache hits excluded)
        self.num_generation_tokens = 0
        self.kv_slot_steps = 0            # memory accounting, summed over steps
        self.kv_waste_slot_steps = 0
        self.peak_running = 0
        self._parents: dict[str, _Parent] = {}
        self.startup_seconds = time.perf_counter() - start
        logger.info("engine ready in %.1f s (model %s, dtype %s, %s)", self.startup_seconds,
                    loaded.path, jnp.dtype(self.dtype).name, platform)

    def _num_blocks(self, platform: str, per_block: int, loaded) -> int:
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            num = cfg.num_gpu_blocks_override
        elif cfg.kv_cache_memory_bytes is not None:
            num = cfg.kv_cache_memory_bytes // per_block
        elif platform == "cpu":
            num = DEFAULT_CPU_KV_BYTES // per_block
        else:
            num = self._profile_blocks(per_block, loaded)
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
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB); maximum concurrency "
                    "for %d-token requests: %.2fx", num, cfg.block_size, tokens,
                    num * per_block / 2**30, cfg.max_model_len, tokens / cfg.max_model_len)
        return num

    def _profile_blocks(self, per_block: int, loaded) -> int:
        """gpu_memory_utilization of device memory, less weights and a maximal step's scratch."""
        cfg = self.config
        dev = jax.devices()[0]
        stats = dev.memory_stats() or {}
        limit = stats.get("bytes_limit")
        if not limit:
            raise ValueError("device memory size is unknown; set kv_cache_memory_bytes or "
                             "num_gpu_blocks_override")
        # a runner with a 2-block cache, only to measure the largest step's scratch memory
        probe = ModelRunner(loaded, self.dtype, 2, cfg.block_size, cfg.max_model_len,
                            cfg.max_num_seqs, cfg.max_num_batched_tokens,
                            attention_backend=cfg.attention_backend)
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
        """Process 0: release the followers (they return from follow())."""
        self.runner.stop_followers()

    # requests
    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate_request(self, prompt, params: SamplingParams) -> tuple[str | None, list[int], SamplingParams]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        vocab = self.arch.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt contains token ids outside the vocabulary [0, {vocab})")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt is {len(ids)} tokens, but max_model_len is {limit}: "
                             "no room to generate")
        params.check_vocab(vocab)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > MAX_LOGPROBS:
                raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {k}")
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise ValueError(f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len ({limit})")
        return text, ids, params

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue a request. `prompt` is a string, a list of token ids, or a dict with
        "prompt" or "prompt_token_ids" (and optionally "cache_salt")."""
        params = params or SamplingParams()
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(priority, int) or (priority != 0 and self.config.scheduling_policy != "priority"):
            raise ValueError(f"priority={priority!r} needs scheduling_policy='priority'")
        text, ids, params = self.validate_request(prompt, params)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt must be a string")
        bad_word_ids = self._tokenize_bad_words(params.bad_words) if params.bad_words else None
        arrival = time.time() if arrival_time is None else arrival_time
        num = params.num_sequences
        child_ids = [request_id] if num == 1 else [f"{i}_{request_id}" for i in range(num)]
        taken = [c for c in child_ids if c in self._children or c in self.scheduler.requests]
        if taken:
            raise ValueError(f"request_id {request_id!r} collides with running sequence {taken[0]!r}")
        reqs, children = [], {}
        for i, child_id in enumerate(child_ids):
            if params.seed is not None:
                seed = (params.seed + i) & 0xFFFFFFFF
            else:
                seed = int(self._rng.integers(0, 2**32))
            req = Request(child_id, ids, params, self.eos_token_id, seed, arrival,
                          priority=priority, cache_salt=cache_salt)
            req.bad_word_ids = bad_word_ids
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                               params.stop_strings, params.include_stop_str_in_output,
                                               params.spaces_between_special_tokens)
            children[child_id] = _Child(req, request_id, i, detok,
                                        [] if params.logprobs is not None else None)
            reqs.append(req)
        # siblings of a parallel-sampling request start from the first one's prompt blocks
        self.scheduler.add_request(reqs[0], reqs[1:])
        # only once the scheduler has taken it: a refused request leaves nothing behind
        self._children.update(children)
        plp = [None] if params.prompt_logprobs is not None else None
        self._parents[request_id] = _Parent(request_id, text, ids, child_ids,
                                            RequestMetrics(arrival), params, plp)

    def _tokenize_bad_words(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, alone and after a space (as it appears mid-text)."""
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer")
        out = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _position_logprobs(self, token: int, lp) -> dict:
        entry = {token: Logprob(lp.logprob, lp.rank, self.token_text(token))}
        for rank, (tid, val) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            if tid not in entry:
                entry[tid] = Logprob(val, rank, self.token_text(tid))
        return entry

    def abort_request(self, request_id) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            self.scheduler.finish_requests(parent.children, RequestStatus.FINISHED_ABORTED)
            for cid in parent.children:
                self._children.pop(cid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # one iteration
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        scheduled_at = time.time()
        res = self.runner.execute_model(out)
        now = time.time()
        for rid, n in out.num_scheduled_tokens.items():
            child = self._children.get(rid)
            if child is not None:
                req = child.request
                self.num_prompt_tokens += max(0, min(req.num_computed_tokens + n, req.num_prompt_tokens)
                                              - req.num_computed_tokens)
                m = self._parents[child.parent_id].metrics
                if m.first_scheduled_time is None:
                    m.first_scheduled_time = scheduled_at
        for rid, (start, entries) in res.prompt_logprobs.items():
            self._add_prompt_logprobs(rid, start, entries)
        updates = self.scheduler.update_from_output(out, res.sampled)
        self.num_generation_tokens += len(updates)
        self._account_memory()
        touched = {}
        for upd in updates:
            child = self._children[upd.request.request_id]
            req = child.request
            lp = res.logprobs.get(req.request_id)
            if lp is not None:
                child.cumulative_logprob += lp.logprob
                if child.logprobs is not None:
                    child.logprobs.append(self._position_logprobs(upd.new_token_ids[0], lp))
            if child.detok is not None:
                hit = child.detok.update(upd.new_token_ids)
                if hit is not None:
                    req.stop_reason = hit
                    if req.status.finished:  # the same token hit a length limit: the stop wins
                        req.status = RequestStatus.FINISHED_STOPPED
                    else:
                        self.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_STOPPED)
            m = self._parents[child.parent_id].metrics
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            touched[child.parent_id] = None
        return [self._make_output(pid) for pid in touched if self._wants_output(pid)]

    def _wants_output(self, parent_id: str) -> bool:
        """FINAL_ONLY requests get their one output when every child has finished (building
        every request's output each step costs the host more than the step at large batch)."""
        parent = self._parents[parent_id]
        return (parent.params.output_kind is not RequestOutputKind.FINAL_ONLY
                or all(self._children[c].request.status.finished for c in parent.children))

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

    def _add_prompt_logprobs(self, rid: str, start: int, entries) -> None:
        child = self._children.get(rid)
        if child is None:
            return
        plp = self._parents[child.parent_id].prompt_logprobs
        ids = self._parents[child.parent_id].prompt_token_ids
        for j, lp in enumerate(entries):
            pos = start + j + 1  # the entry of position p scores prompt token p + 1
            if pos == len(plp):  # a recomputed prompt (after preemption) adds nothing twice
                plp.append(self._position_logprobs(ids[pos], lp))

    def _make_output(self, parent_id: str) -> RequestOutput:
        parent = self._parents[parent_id]
        params = parent.params
        cached = max(self._children[parent.children[0]].request.num_cached_tokens, 0)
        outputs = []
        finished = True
        for cid in parent.children:
            child = self._children[cid]
            req = child.request
            done = req.status.finished
            text = child.detok.get_text(done) if child.detok is not None else ""
            finished &= done
            parent.metrics.num_preemptions = max(parent.metrics.num_preemptions, req.num_preemptions)
            outputs.append(CompletionOutput(
                child.index, text, list(req.output_token_ids),
                child.cumulative_logprob if params.logprobs is not None or params.best_of else None,
                list(child.logprobs) if child.logprobs is not None else None,
                req.finish_reason if done else None, req.stop_reason))
        if finished:
            parent.metrics.finished_time = time.time()
            del self._parents[parent_id]
            for cid in parent.children:
                del self._children[cid]
            if params.best_of and params.best_of > params.n:
                # the n most likely of best_of sequences
                outputs = sorted(outputs, key=lambda o: -o.cumulative_logprob)[:params.n]
                for i, o in enumerate(outputs):
                    o.index = i
                    if params.logprobs is None:
                        o.cumulative_logprob = None
        elif params.best_of and params.best_of > params.n:
            outputs = outputs[:params.n]  # streamed: the choice is made at the end
        return RequestOutput(parent_id, parent.prompt, parent.prompt_token_ids, outputs, finished,
                             dataclasses.replace(parent.metrics), cached,
                             list(parent.prompt_logprobs) if parent.prompt_logprobs is not None else None)

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
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
            "kv_slot_steps": self.kv_slot_steps,
            "kv_waste_slot_steps": self.kv_waste_slot_steps,
            "peak_running": self.peak_running,
            "kv_total_slots": self.kv_manager.pool.num_usable_blocks * self.config.block_size,
        }

