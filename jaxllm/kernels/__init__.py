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


def attention_backend(requested: str, platform: str, cache_dtype, quantized_cache: bool,
                      head_dim: int | None = None, compute_capability: str | None = None,
                      cpu_kernels: bool = True) -> tuple[str, str]:
    """Where paged attention runs (EngineConfig.attention_backend, resolved), and why.

    "auto" is "pallas" on a GPU, the CPU kernels (or XLA's ops) elsewhere. "pallas" is the
    Mosaic GPU kernels where they apply (a Hopper or later GPU, or a CPU, where they run in
    their interpreter; a bf16/fp16 cache), the Triton kernels otherwise. Asking for
    "pallas-mosaic" where it does not apply is an error."""
    from pallas_kernels import mosaic_paged_attention as mosaic

    if requested == "auto":
        if platform != "gpu":
            return ("cpu" if cpu_kernels else "xla"), "the default off a GPU"
        requested = "pallas"
    if not requested.startswith("pallas"):
        return requested, "asked for"
    why_not = mosaic.supports(cache_dtype, head_dim or 64, quantized_cache)
    if platform == "gpu" and why_not is None and compute_capability is not None:
        if float(compute_capability) < 9.0:
            why_not = f"Mosaic GPU needs a Hopper or later GPU (this one is sm_{compute_capability})"
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
