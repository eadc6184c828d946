"""What a model family declares about itself, once: its parameters (shape, logical axes,
init, dtype role), where each checkpoint tensor goes (HF and GGUF names), its KV cache's
axes and how tensor parallelism reshapes its weights. The loader, the sharding rules and the
runner ask the model class; nothing outside models/ knows a family's parameter names."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.layers.linear import DTypePolicy


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

    def __post_init__(self):
        if self.matrix not in (None, "in_out", "out_in"):
            raise ValueError(f"matrix must be None, 'in_out' or 'out_in', got {self.matrix!r}")

    def dtype_for(self, policy: DTypePolicy):
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


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: our parameter, whether the file stores it transposed
    (HF and GGUF keep [out, in]), and for a fused parameter the segment of its last axis
    (the model's `segments` give each one's offset and size)."""
    name: str
    transpose: bool = False
    segment: str | None = None
    # GGUF only: llama.cpp interleaves the rotary halves of q and k rows; the number of heads
    # ("q" or "k") to undo that with
    unpermute: str | None = None


class WeightMap:
    """A checkpoint's tensor names -> Targets: per-layer suffixes and whole-model names."""

    def __init__(self, layer_re: str, layer: dict[str, Target], whole: dict[str, Target],
                 ignored_re: str | None = None):
        import re
        self._layer_re = re.compile(layer_re)
        self.layer, self.whole = layer, whole
        self._ignored = re.compile(ignored_re) if ignored_re else None

    def lookup(self, name: str) -> tuple[Target, int | None] | None:
        """(target, layer or None); None for a tensor that is safe to skip. A tensor we do
        not know is an error: skipping it would run a different model."""
        if name in self.whole:
            return self.whole[name], None
        m = self._layer_re.fullmatch(name)
        if m and m.group(2) in self.layer:
            return self.layer[m.group(2)], int(m.group(1))
        if self._ignored is not None and self._ignored.fullmatch(name):
            return None
        raise ValueError(f"checkpoint tensor {name} is not used by this model (unsupported "
                         "architecture variant?)")


def param_dtypes(specs: dict[str, ParamSpec], policy: DTypePolicy) -> dict[str, np.dtype]:
    return {k: np.dtype(jnp.dtype(s.dtype_for(policy))) for k, s in specs.items()}
