"""A quantized KV cache: int8 or fp8 (e4m3) values with one float32 scale per token and KV
head, written when the step's keys and values enter the cache.

The cache is then a `QuantizedKV(data [layers, 2, kv_heads, slots, head_dim], scale [layers,
2, kv_heads, slots])` instead of one float array; both share the slot axis, so block moves
and tensor parallelism (by KV head) treat them alike. A per-token scale keeps int8 accurate
whatever the magnitude of a token's keys (no calibration needed, unlike one static scale per
tensor); it costs 4 bytes per head_dim values, so int8 holds 8 + 32 / head_dim bits per value,
nearly twice the tokens of bf16 at head_dim 64.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.quantization.formats import FP8_MAX

KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "fp8", "fp8_e4m3")
# a bf16 cache kept as its 16-bit patterns: XLA:CPU scatters into a bf16 array by converting
# the whole array to f32 and back on every write, into uint16 in place. Reads bitcast the
# gathered values back to bf16.
BF16_BITS = jnp.uint16
# an fp8 cache kept as its byte patterns, for the same reason (a float8 scatter converts the
# whole array; a scatter into its bytes writes only the new tokens).
FP8_BITS = jnp.uint8


def validate_kv_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


def stored_as_bits(platform: str, attention_backend: str) -> bool:
    """A float cache is kept as its bit patterns (BF16_BITS, FP8_BITS): XLA's attention on a
    CPU, whose scatters into bf16 and fp8 arrays convert the whole array."""
    return platform == "cpu" and not attention_backend.startswith("pallas")


def cache_dtype(kv_cache_dtype: str, weight_dtype, activation_dtype, weights_quantized: bool,
                platform: str, attention_backend: str):
    """The float dtype the KV cache is kept in (a quantized cache's scales aside): bf16 when
    asked, and for "auto" the dtype the model's float weights are stored in, as vLLM's auto
    (a bf16 policy: attention reads half the bytes); otherwise, and for quantized weights
    (whose products are exact to the dequantized float model's), the activations' dtype. A
    bf16 cache kept as bits (stored_as_bits) is BF16_BITS."""
    validate_kv_dtype(kv_cache_dtype)
    bf16 = kv_cache_dtype == "bfloat16" or (
        kv_cache_dtype == "auto" and weight_dtype == jnp.bfloat16 and not weights_quantized)
    dtype = jnp.bfloat16 if bf16 else activation_dtype
    if dtype == jnp.bfloat16 and stored_as_bits(platform, attention_backend):
        return BF16_BITS
    return dtype


def dtype_name(dtype) -> str:
    """A cache dtype's name, a bf16 cache kept as bits included."""
    return "bfloat16" if dtype == BF16_BITS else jnp.dtype(dtype).name


def storage_dtype(name: str):
    """The values' dtype of a kv_cache_dtype (None: unquantized, in the dtype the engine
    chose: the activations' for "auto", bf16 for "bfloat16")."""
    validate_kv_dtype(name)
    return {"auto": None, "bfloat16": None, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn,
            "fp8_e4m3": jnp.float8_e4m3fn}[name]


@jax.tree_util.register_dataclass
@dataclass
class QuantizedKV:
    data: jax.Array   # int8 | float8_e4m3fn | FP8_BITS [L, 2, KVH, slots, D]
    scale: jax.Array  # f32 [L, 2, KVH, slots]


def make_cache(shape: tuple[int, ...], dtype, kv_dtype: str = "auto", bits: bool = False):
    """Zeros of the cache: a float array, or a QuantizedKV for int8 / fp8. bits: fp8 values
    are stored as their bytes (FP8_BITS), as XLA:CPU wants them."""
    store = storage_dtype(kv_dtype)
    if store is None:
        return jnp.zeros(shape, dtype)
    if bits and store == jnp.float8_e4m3fn:
        store = FP8_BITS
    return QuantizedKV(jnp.zeros(shape, store), jnp.zeros(shape[:-1], jnp.float32))


def bytes_per_value(dtype, kv_dtype: str, head_dim: int) -> float:
    store = storage_dtype(kv_dtype)
    if store is None:
        return jnp.dtype(dtype).itemsize
    return jnp.dtype(store).itemsize + 4 / head_dim


def cache_axes(axes: tuple[str, ...], cache) -> object:
    """The cache's logical axes, shaped like the cache (the scales have no head_dim)."""
    if isinstance(cache, QuantizedKV):
        return QuantizedKV(axes, axes[:-1])
    return axes


def _quantize(x: jax.Array, store):
    """[..., D] -> (values, scale [...]) per token and head."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    top = 127.0 if store == jnp.int8 else FP8_MAX
    s = jnp.where(amax > 0, amax / top, 1.0)
    y = x / s[..., None]
    if store == jnp.int8:
        return jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8), s
    if store == FP8_BITS:
        return jax.lax.bitcast_convert_type(y.astype(jnp.float8_e4m3fn), FP8_BITS), s
    return y.astype(store), s


def quantize(cache: jax.Array, kv_dtype: str) -> QuantizedKV:
    """A whole float cache as an int8 / fp8 one (a scale per token and head), as write()
    would have stored it token by token."""
    return QuantizedKV(*_quantize(cache, storage_dtype(kv_dtype)))


def _values(data: jax.Array) -> jax.Array:
    """A quantized cache's values in their own dtype (fp8 bytes read as fp8)."""
    return jax.lax.bitcast_convert_type(data, jnp.float8_e4m3fn) if data.dtype == FP8_BITS else data


def write(cache, layer, k: jax.Array, v: jax.Array, slot_mapping: jax.Array):
    """k, v: [T, KVH, D] -> written at cache[layer, 0/1, :, slot_mapping]."""
    kv = jnp.stack([k, v], axis=0).swapaxes(1, 2)  # [2, KVH, T, D]
    if not isinstance(cache, QuantizedKV):
        vals = (jax.lax.bitcast_convert_type(kv.astype(jnp.bfloat16), BF16_BITS)
                if cache.dtype == BF16_BITS else kv.astype(cache.dtype))
        return cache.at[layer, :, :, slot_mapping].set(vals.transpose(2, 0, 1, 3), mode="drop")
    q, s = _quantize(kv, cache.data.dtype)
    data = cache.data.at[layer, :, :, slot_mapping].set(q.transpose(2, 0, 1, 3), mode="drop")
    scale = cache.scale.at[layer, :, :, slot_mapping].set(s.transpose(2, 0, 1), mode="drop")
    return QuantizedKV(data, scale)


def _float(x: jax.Array) -> jax.Array:
    if x.dtype == BF16_BITS:
        x = jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    return x.astype(jnp.float32)


def read(cache, layer, which: int, slots: jax.Array) -> jax.Array:
    """cache[layer, which, :, slots] in f32: slots [...] -> [..., KVH, D]."""
    if not isinstance(cache, QuantizedKV):
        return _float(cache[layer, which, :, slots])
    vals = _values(cache.data[layer, which, :, slots]).astype(jnp.float32)
    return vals * cache.scale[layer, which, :, slots][..., None]


def dequantize(cache) -> jax.Array:
    """The whole cache in f32 (references in tests)."""
    if not isinstance(cache, QuantizedKV):
        return _float(cache)
    return _values(cache.data).astype(jnp.float32) * cache.scale[..., None]
