"""How many KV-cache blocks an engine's memory budget holds.

The budget is `num_gpu_blocks_override` blocks, or `kv_cache_memory_bytes`, or on a CPU a
fixed share of host memory; on a GPU it is `gpu_memory_utilization` of the whole device, as
in vLLM, less what is in use (the weights, the serving runner's sampler state) and the
largest step's scratch. That scratch is measured from the very runner that will serve (its
multi-step and speculative programs included): the engine builds it with a small cache
(PROBE_BLOCKS), sizes the cache here, then gives the runner the sized one
(ModelRunner.allocate_kv_cache).
"""
from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
from jax._src import xla_bridge

from jaxllm.quantization import kv as kvq
from jaxllm.runner.kv_cache import kv_bytes_per_block

logger = logging.getLogger("jaxllm")

DEFAULT_CPU_KV_BYTES = 1 << 30
PROBE_BLOCKS = 2  # the cache a runner is built with before its step's scratch is measured

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


def bytes_per_block(arch, block_size: int, kv_dtype, kv_cache_dtype: str, draft_arch=None) -> int:
    """A block's bytes; a draft model's cache has the same blocks as the target's, so a block
    costs both."""
    per_block = kv_bytes_per_block(arch, block_size, kv_dtype, kv_cache_dtype)
    if draft_arch is not None:
        per_block += kv_bytes_per_block(draft_arch, block_size, kv_dtype, kv_cache_dtype)
    return per_block


def needs_profile(config, platform: str) -> bool:
    """Whether the budget depends on the serving runner's measured scratch."""
    return (config.num_gpu_blocks_override is None and config.kv_cache_memory_bytes is None
            and platform != "cpu")


def num_blocks(config, platform: str, per_block: int, runner=None, mesh_size: int = 1) -> int:
    """The blocks of the budget (see the module's docstring); `runner` is measured when
    needs_profile()."""
    if needs_profile(config, platform):
        num = profile_blocks(runner, per_block, config.gpu_memory_utilization, mesh_size)
    elif config.num_gpu_blocks_override is not None:
        num = config.num_gpu_blocks_override
    elif config.kv_cache_memory_bytes is not None:
        num = config.kv_cache_memory_bytes // per_block
    else:
        num = DEFAULT_CPU_KV_BYTES // per_block
    if num < 2:
        raise ValueError(f"the KV-cache budget fits {num} blocks of {per_block} bytes; "
                         "at least 2 are needed (raise the memory budget)")
    if platform == "cpu":
        # past the host's available memory the kernel's OOM killer ends the process silently
        free = host_available_bytes()
        if num * per_block > free:
            raise ValueError(f"the KV cache needs {num * per_block / 2**30:.1f} GiB of memory "
                             f"but the host has {free / 2**30:.1f} GiB available; lower "
                             "kv_cache_memory_bytes or num_gpu_blocks_override")
    return num


def host_available_bytes() -> int:
    """Memory the host can give without swapping: the kernel's MemAvailable, which counts the
    page cache it would drop (free pages alone are near zero on a machine that has read a few
    gigabytes of files)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def profile_blocks(runner, per_block: int, utilization: float, mesh_size: int = 1) -> int:
    """`utilization` of device memory, less what is in use and the largest step's scratch of
    `runner` (anything with activation_bytes()), in blocks."""
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        raise ValueError("device memory size is unknown; set kv_cache_memory_bytes or "
                         "num_gpu_blocks_override")
    scratch = runner.activation_bytes()
    in_use = dev.memory_stats().get("bytes_in_use", 0)
    budget = kv_budget_bytes(limit, in_use, scratch, utilization, allocator_fraction())
    logger.info("memory: limit %.2f GiB, in use %.2f GiB, step scratch %.2f GiB",
                limit / 2**30, in_use / 2**30, scratch / 2**30)
    # the stats are one device's; each device holds its KV heads' share of every block
    return max(0, budget // (per_block // mesh_size))


def headroom_bytes(limit: int, in_use: int, scratch: int, utilization: float,
                   fraction: float) -> int:
    """What is left of `utilization` of the device (limit / fraction) once what is held (the
    weights and the KV cache) and the largest step's scratch are taken: negative, and that
    step would run out of memory."""
    return int(min(utilization * limit / fraction, limit)) - in_use - scratch


def check_headroom(runner, utilization: float) -> None:
    """After warm-up, on a device that reports its memory: the largest step fits beside the
    weights and the cache, or the start fails now, not on the first long batch."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return
    in_use, scratch = stats.get("bytes_in_use", 0), runner.activation_bytes()
    room = headroom_bytes(limit, in_use, scratch, utilization, allocator_fraction())
    logger.info("device memory: %.2f GiB held (weights, KV cache), largest step's scratch %.2f "
                "GiB, headroom %.2f GiB under gpu_memory_utilization %.2f", in_use / 2**30,
                scratch / 2**30, room / 2**30, utilization)
    if room < 0:
        raise ValueError(f"the largest step needs {scratch / 2**30:.2f} GiB of scratch beside "
                         f"{in_use / 2**30:.2f} GiB held, {-room / 2**30:.2f} GiB more than "
                         f"gpu_memory_utilization={utilization} allows: lower "
                         "max_num_batched_tokens, kv_cache_memory_bytes or num_gpu_blocks_override")


def log_cache(config, num: int, per_block: int, kv_dtype, arch, activation_dtype) -> None:
    """The blocks, the tokens they hold and the maximum concurrency they imply."""
    tokens = (num - 1) * config.block_size
    stored = kvq.dtype_name(kv_dtype)
    logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s %s); maximum "
                "concurrency for %d-token requests: %.2fx", num, config.block_size, tokens,
                num * per_block / 2**30, config.kv_cache_dtype, stored if config.kv_cache_dtype
                in ("auto", "bfloat16") else "with scales", config.max_model_len,
                tokens / config.max_model_len)
    if config.kv_cache_dtype != "auto":
        plain = kv_bytes_per_block(arch, config.block_size, activation_dtype)
        logger.info("KV cache dtype %s: %.2fx the tokens of %s in the same memory",
                    config.kv_cache_dtype, plain / per_block, jnp.dtype(activation_dtype).name)
