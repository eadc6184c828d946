"""Kernels outside XLA's own: the CPU backend (cpu/) and the choice of where matmuls and
attention run. The Pallas GPU kernels live in the top-level `pallas_kernels` package."""
from __future__ import annotations

import jax.numpy as jnp

from jaxllm.kernels.cpu import build

MATMUL_BACKENDS = ("auto", "cpu", "xla", "pallas", "pallas_interpret")


def matmul_backend(platform: str, devices: int, requested: str = "auto",
                   cpu_kernels: bool = True) -> str:
    """Where quantized matmuls (and on a CPU, bf16 float ones) run (EngineConfig.matmul_backend,
    resolved): the CPU kernels on one CPU device when they build and `cpu_kernels` allows, the
    Pallas kernel for group-quantized weights on one GPU; XLA's dots elsewhere (a custom call
    cannot be split by XLA's sharding). `requested` other than "auto" is taken as it is."""
    if requested not in MATMUL_BACKENDS:
        raise ValueError(f"matmul_backend must be one of {MATMUL_BACKENDS}, got {requested!r}")
    if requested != "auto":
        return requested
    if platform == "cpu" and devices == 1 and cpu_kernels:
        if build.available():
            return "cpu"
    if platform == "gpu" and devices == 1:
        return "pallas"
    return "xla"


def cuda_runtime_version() -> int | None:
    """The CUDA runtime JAX's GPU plugin runs on (12080 for 12.8), None without one."""
    try:
        from jax._src.lib import cuda_versions  # private: JAX's own kernels consult it too
        return cuda_versions.cuda_runtime_get_version() if cuda_versions else None
    except Exception:
        return None


def attention_backend(requested: str, platform: str, cache_dtype, quantized_values,
                      head_dim: int | None = None, compute_capability: str | None = None,
                      cpu_kernels: bool = True, cuda_runtime: int | None = None
                      ) -> tuple[str, str]:
    """Where paged attention runs (EngineConfig.attention_backend, resolved), and why.

    "auto" is "pallas" on a GPU, the CPU kernels (or XLA's ops) elsewhere. "pallas" is the
    Mosaic GPU kernels where they apply (a Hopper or later GPU, or a CPU, where they run in
    their interpreter; bf16/fp16 caches, or int8/fp8 values read into bf16/fp16), the Triton
    kernels otherwise. Asking for "pallas-mosaic" where it does not apply is an error. cache_dtype: the float dtype the
    attention computes in; quantized_values: an int8 / fp8 cache's values' dtype, or None."""
    if requested == "auto":
        if platform != "gpu":
            return ("cpu" if cpu_kernels else "xla"), "the default off a GPU"
        requested = "pallas"
    if not requested.startswith("pallas"):
        return requested, "asked for"
    from pallas_kernels import mosaic_paged_attention as mosaic
    why_not = mosaic.supports(cache_dtype, head_dim or 64, quantized_values)
    if platform == "gpu" and why_not is None and compute_capability is not None:
        if float(compute_capability) < 9.0:
            why_not = f"Mosaic GPU needs a Hopper or later GPU (this one is sm_{compute_capability})"
    if why_not is None and cuda_runtime is not None and 12080 <= cuda_runtime < 12091:
        # JAX's FlashAttention-3 refuses masking on these for the same reason
        why_not = "ptxas of CUDA 12.8.0-12.9.0 miscompiles the kernels' masking"
    if requested == "pallas-mosaic":
        if why_not:
            raise ValueError(f"attention_backend 'pallas-mosaic': {why_not}")
        return requested, "asked for"
    if requested == "pallas-triton":
        return requested, "asked for"
    if why_not:
        return "pallas-triton", why_not
    where = "the Mosaic GPU kernels, in their interpreter" if platform != "gpu" else \
        f"a {jnp.dtype(cache_dtype).name} cache on sm_{compute_capability}"
    return "pallas-mosaic", where
