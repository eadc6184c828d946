"""Building an engine from its EngineConfig: the device and compilation cache set up, the
matmul and attention backends and the dtype policy resolved, the model (and a draft model)
loaded, the KV cache sized and allocated, the scheduler, KV manager and runner built, huge
pages asked for, and every step shape compiled."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import jax

from jaxllm import executable_cache
from jaxllm.config import EngineConfig
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.scheduler import Scheduler
from jaxllm.engine import kv_sizing
from jaxllm.kernels import attention_backend as resolve_attention_backend
from jaxllm.kernels import cuda_runtime_version
from jaxllm.kernels import matmul_backend as resolve_matmul_backend
from jaxllm.kernels.cpu import build as cpu_build
from jaxllm.layers.dtype_policy import DTypePolicy, resolve_policy
from jaxllm.loader import load_model
from jaxllm.lora.manager import LoRAManager
from jaxllm.parallel import make_mesh
from jaxllm.parallel import multiprocess as mp
from jaxllm.quantization import kv as kvq
from jaxllm.runner.huge_pages import advise_in_background
from jaxllm.runner.model_runner import ModelRunner
from jaxllm.spec_decode.draft_model import DraftModel, check_draft
from jaxllm.spec_decode.proposer import Speculator

logger = logging.getLogger("jaxllm")


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


@dataclass
class EngineParts:
    """What an engine is made of, as built from its config."""
    platform: str
    matmul_backend: str
    policy: DTypePolicy
    mesh: Any
    model_path: str
    load_seconds: float
    kv_dtype: Any          # the KV cache's storage dtype
    arch: Any
    tokenizer: Any
    eos_token_id: int | None
    smoothquant: Any       # how w8a8's smoothing was made, when it was
    is_follower: bool
    lora: LoRAManager | None
    kv_manager: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    speculator: Speculator | None


def build_engine(config: EngineConfig, lora_modules=(), model_names=()) -> EngineParts:
    """Everything an engine needs before warm-up (warm_up() compiles its steps).
    lora_modules: LoRARequests registered before anything compiles (a refused one stops the
    start); model_names: what else the base model is called, for their base check."""
    kv_sizing.claim_device_memory(config.gpu_memory_utilization)
    if config.num_processes > 1:  # before anything touches a device
        mp.initialize(config.distributed_coordinator, config.num_processes, config.process_id)
    setup_compilation_cache(config.compilation_cache_dir, config.executable_cache)
    platform = jax.default_backend()
    # where matmuls run, then the weights' storage and the dots' dtypes for it
    matmul_backend = resolve_matmul_backend(
        platform, config.tensor_parallel_size * config.num_processes, config.matmul_backend,
        config.cpu_kernels)
    if platform == "cpu" and config.cpu_kernels and cpu_build.available():
        cpu_build.set_amx(config.cpu_amx)
    policy = resolve_policy(config.dtype, platform, matmul_backend)
    requested = config.attention_backend
    # the cache's float dtype (as a GPU holds it: a CPU's XLA path stores bf16 as bits);
    # the head size is not known before loading, and every supported family's is fine
    config.attention_backend, why = resolve_attention_backend(
        requested, platform,
        kvq.cache_dtype(config.kv_cache_dtype, policy.weight, policy.activation,
                        config.quantization is not None, "gpu", "pallas"),
        kvq.storage_dtype(config.kv_cache_dtype),
        compute_capability=getattr(jax.devices()[0], "compute_capability", None),
        cpu_kernels=config.cpu_kernels,
        cuda_runtime=cuda_runtime_version() if platform == "gpu" else None)
    logger.info("attention: %s (%s%s)", config.attention_backend, why,
                "" if requested == config.attention_backend else f"; asked for {requested}")
    mesh = make_mesh(config.tensor_parallel_size)
    load_start = time.perf_counter()
    loaded = load_model(config.model, policy, config.load_format, config.seed,
                        config.tokenizer, attention_backend=config.attention_backend,
                        load_tokenizer=not config.skip_tokenizer_init, mesh=mesh, quantization=config.quantization,
                        smoothquant_alpha=config.smoothquant_alpha,
                        matmul_backend=matmul_backend,
                        int4_activations=config.int4_activations,
                        quantization_group_size=config.quantization_group_size,
                        int4_calibration=config.int4_calibration,
                        expert_parallel=config.enable_expert_parallel)
    load_seconds = time.perf_counter() - load_start
    if loaded.arch.vision is not None:
        for bad, what in ((config.speculative_config is not None, "speculative_config"),
                          (config.num_processes > 1, "num_processes > 1")):
            if bad:
                raise ValueError(f"{what} is not supported with a vision-language model "
                                 f"({loaded.arch.architecture}) yet")
    kv_dtype = kvq.cache_dtype(config.kv_cache_dtype, policy.weight, policy.activation,
                               loaded.quant is not None, platform, config.attention_backend)
    model_max = loaded.arch.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > model_max:
        raise ValueError(f"max_model_len ({config.max_model_len}) is larger than the model's "
                         f"maximum context ({model_max})")
    config.resolve(platform, model_max)
    spec = config.speculative_config
    draft = None
    if spec is not None and spec.method == "draft_model":
        draft = load_model(spec.model, policy, "auto", config.seed,
                           attention_backend=config.attention_backend, mesh=mesh,
                           matmul_backend=matmul_backend)
        check_draft(draft, loaded, config.max_model_len)
    bs = config.block_size
    per_block = kv_sizing.bytes_per_block(loaded.arch, bs, kv_dtype, config.kv_cache_dtype,
                                          draft.arch if draft is not None else None)
    is_follower = jax.process_index() != 0
    # LoRA: the adapters known (a host registry and cache) and the device slots
    lora = LoRAManager(loaded, config, mesh, policy.weight, model_names) if config.enable_lora else None
    if lora_modules and lora is None:
        raise ValueError("LoRA modules need enable_lora=True")
    for lora_request in lora_modules:
        lora.add(lora_request)
    num_host_blocks = 0
    if config.preemption_mode == "swap":
        num_host_blocks = int(config.swap_space * 2**30) // per_block
        logger.info("swap space: %d host blocks (%.2f GiB)", num_host_blocks, config.swap_space)
    k = spec.k if spec is not None else 0

    def make_runner(num_blocks: int) -> ModelRunner:
        return ModelRunner(loaded, kv_dtype, num_blocks, bs, config.max_model_len,
                           config.max_num_seqs, config.max_num_batched_tokens, num_host_blocks,
                           config.attention_backend, config.kv_cache_dtype,
                           lora.slots if lora is not None else None, num_spec_tokens=k,
                           spec_probabilistic=spec is not None
                           and spec.draft_sample_method == "probabilistic",
                           num_scheduler_steps=config.num_scheduler_steps,
                           token_buckets=config.token_buckets, seq_buckets=config.seq_buckets)

    # the cache's size: measured from the runner that will serve when it depends on its scratch
    runner = None
    if is_follower:
        num_blocks = 0
    else:
        if kv_sizing.needs_profile(config, platform):
            runner = make_runner(kv_sizing.PROBE_BLOCKS)
        num_blocks = kv_sizing.num_blocks(config, platform, per_block, runner, mesh.size)
        kv_sizing.log_cache(config, num_blocks, per_block, kv_dtype, loaded.arch,
                            policy.activation)
    if jax.process_count() > 1:  # every process sizes its cache as process 0 did
        num_blocks = mp.Channel().announce(mp.INIT, num_blocks)[1]
    kv_manager = KVCacheManager(num_blocks, bs, config.enable_prefix_caching, num_host_blocks)
    scheduler = Scheduler(kv_manager, config.max_num_seqs, config.max_num_batched_tokens,
                          config.max_model_len, config.scheduling_policy, config.preemption_mode,
                          config.max_loras if config.enable_lora else 0,
                          num_lookahead_tokens=k if draft is not None else 0,
                          num_spec_tokens=k, num_scheduler_steps=config.num_scheduler_steps,
                          max_num_batched_tokens_while_decoding=config.max_num_batched_tokens_while_decoding)
    if runner is None:
        runner = make_runner(num_blocks)
    else:
        runner.allocate_kv_cache(num_blocks)
    speculator = None
    if spec is not None:
        if draft is not None:
            runner.drafter = DraftModel(draft, runner, num_host_blocks, k,
                                        spec.draft_sample_method == "probabilistic")
        speculator = Speculator(spec, runner.batch, runner.drafter)
        logger.info("speculative decoding: %s", spec.describe())
    return EngineParts(platform, matmul_backend, policy, mesh, loaded.path, load_seconds,
                       kv_dtype, loaded.arch, loaded.tokenizer, loaded.eos_token_id,
                       loaded.smoothquant, is_follower, lora, kv_manager, scheduler, runner,
                       speculator)


def advise_huge_pages(runner: ModelRunner, done):
    """Huge pages under the weights and the KV cache (a CPU's TLB), asked for on a thread;
    `done(collapsed_bytes, asked_bytes)` once it has finished. Returns the thread."""
    drafter = runner.drafter
    arrays = (runner.state, runner.kv_cache) + (
        (drafter.state, drafter.kv_cache) if drafter is not None else ())
    return advise_in_background(arrays, done)


def warm_up(runner: ModelRunner, background: bool) -> float:
    """Compile every step shape (or with `background` the essential ones, the rest on a
    thread); returns the seconds it took before returning."""
    seconds = runner.compile_all(background=background)
    c = runner.compiler
    total = len(c.shapes.all) + len(c.sample_buckets) + len(c.passes_shapes)
    logger.info("compiled %d of %d step executables (forward %d, sampling %d, "
                "multi-step %d) in %.1f s", min(c.num_compiled, total), total,
                len(c.shapes.all), len(c.sample_buckets), len(c.passes_shapes), seconds)
    near_memory_map_limit()
    return seconds
