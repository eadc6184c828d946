"""`jaxllm convert`: load a model as the engine would and write it as an Orbax checkpoint."""
from __future__ import annotations

import os

import jax
import numpy as np

from jaxllm.kernels import matmul_backend
from jaxllm.layers.dtype_policy import resolve_policy
from jaxllm.loader import orbax
from jaxllm.loader.loader import load_model, resolve_model_path
from jaxllm.parallel import make_mesh


def convert(model: str | None, out: str, dtype: str = "auto", quantization: str | None = None,
            tensor_parallel_size: int = 1, load_format: str = "auto", tokenizer: str | None = None,
            seed: int = 0, smoothquant_alpha: float | None = None,
            quantization_group_size: int | None = None, int4_calibration: str | None = None) -> str:
    """Load `model` as the engine would with these settings and write it to `out`. The
    devices JAX sees must number at least tensor_parallel_size (the CLI gives itself that many
    CPU devices)."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"output directory {out} already exists and is not empty")
    backend = matmul_backend(jax.default_backend(), tensor_parallel_size)  # as the engine's
    policy = resolve_policy(dtype, jax.default_backend(), backend)
    source = os.path.abspath(resolve_model_path(model))
    loaded = load_model(source, policy, load_format, seed, tokenizer, mesh=make_mesh(tensor_parallel_size),
                        quantization=quantization, smoothquant_alpha=smoothquant_alpha,
                        matmul_backend=backend, quantization_group_size=quantization_group_size,
                        int4_calibration=int4_calibration)
    name = dtype if dtype != "auto" else np.dtype(policy.weight).name
    return orbax.save(loaded, out, dtype=name, source=source, load_format=load_format)
