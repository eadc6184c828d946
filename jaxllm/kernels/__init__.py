"""Kernels outside XLA's own: the CPU backend (cpu/) and the choice of where matmuls run. The
Pallas GPU kernels live in the top-level `pallas_kernels` package."""
from __future__ import annotations

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
