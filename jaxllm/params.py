"""A parameter's declaration, made once per model family: shape, logical axes, initializer and
dtype role. Random init, checkpoint loading, quantized layouts and sharding all read it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]   # logical axes; jaxllm.parallel maps them to mesh axes
    init: str = "normal"           # "normal" (std 0.02), "ones", "zeros", or a quantized part's
    # dtype role: "weight" (a projection or the embedding: the policy's storage dtype) or
    # "activation" (norm weights, biases: the policy's element-wise dtype)
    role: str = "weight"
    # a matrix that quantization may store in its own layout: "in_out" (a projection, x @ w)
    # or "out_in" (the embedding table, whose rows are the LM head's outputs when tied)
    matrix: str | None = None
    dtype: Any = None              # a fixed dtype (quantized parts), overriding the role

    @property
    def per_expert(self) -> bool:
        """A layer stack of experts' matrices: [layers, experts, ...]."""
        return len(self.axes) > 1 and self.axes[1] in ("experts", "experts_whole")

    def __post_init__(self):
        if self.matrix not in (None, "in_out", "out_in"):
            raise ValueError(f"matrix must be None, 'in_out' or 'out_in', got {self.matrix!r}")

    def dtype_for(self, policy):
        """policy: a layers.dtype_policy.DTypePolicy."""
        if self.dtype is not None:
            return self.dtype
        return policy.weight if self.role == "weight" else policy.activation

    def initial(self, key, dtype) -> jax.Array:
        if self.init == "ones":
            return jnp.ones(self.shape, dtype)
        if self.init == "zeros":
            return jnp.zeros(self.shape, dtype)
        if self.init.startswith(("codes_", "scale_", "offset_")):
            return _quant_init(self.init, key, self.shape, dtype)
        return (0.02 * jax.random.normal(key, self.shape, jnp.float32)).astype(dtype)


def _quant_init(init: str, key, shape, dtype) -> jax.Array:
    """Random quantized parts (dummy weights) whose dequantized values have std ~0.02."""
    kind = init.split("_", 1)[1]
    top = {"int4": 7.5, "int8": 127.0, "fp8": 1.0}[kind]
    step = 0.02 * (3 ** 0.5) / top  # uniform codes over +-top: std top / sqrt(3)
    if init.startswith("codes_"):
        if kind == "int4":
            return jax.random.bits(key, shape, jnp.uint8)
        if kind == "int8":
            return jax.random.randint(key, shape, -127, 128, jnp.int32).astype(jnp.int8)
        return jax.random.uniform(key, shape, jnp.float32, -1.7, 1.7).astype(dtype)
    if init.startswith("scale_"):
        return jnp.full(shape, step if kind != "fp8" else 0.02, dtype)
    return jnp.full(shape, -top * step, dtype)
