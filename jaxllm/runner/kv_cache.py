"""The paged KV cache: its geometry, its sharding and its arrays.

One layout serves the target model and a draft model alike: [layers, 2, kv_heads, slots,
head_dim] per array (a quantized cache adds scale arrays: jaxllm.quantization.kv), where
slot = block * block_size + offset. The cache is passed into the jitted step and returned
from it; it is never module state.
"""
from __future__ import annotations

import jax

from jaxllm.layers.attention_metadata import kv_cache_shape
from jaxllm.models import get_model_class
from jaxllm.parallel import sharding
from jaxllm.quantization import kv as kvq


def kv_bytes_per_block(arch, block_size: int, dtype, kv_cache_dtype: str = "auto") -> int:
    per_value = kvq.bytes_per_value(dtype, kv_cache_dtype, arch.head_dim)
    return int(arch.num_layers * 2 * block_size * arch.num_kv_heads * arch.head_dim * per_value)


def kv_cache_sharding(mesh, arch, cache):
    """The cache's shardings, shaped like the cache, from the model's KV axes."""
    axes = kvq.cache_axes(get_model_class(arch.architecture).KV_CACHE_AXES, cache)
    return jax.tree.map(lambda a: sharding(mesh, *a), axes, is_leaf=lambda x: isinstance(x, tuple))


def allocate_kv_cache(mesh, arch, num_blocks: int, block_size: int, dtype,
                      kv_cache_dtype: str = "auto", fp8_as_bytes: bool = False):
    """A zeroed cache of num_blocks blocks, created sharded on the devices. `fp8_as_bytes`:
    an fp8 cache stored as its bytes (kv.FP8_BITS), as XLA's attention on a CPU reads it.
    Returns (cache, its shardings, its ShapeDtypeStructs)."""
    shape = kv_cache_shape(arch, num_blocks, block_size)
    make = lambda: kvq.make_cache(shape, dtype, kv_cache_dtype, fp8_as_bytes)  # noqa: E731
    shapes = jax.eval_shape(make)
    kv_sharding = kv_cache_sharding(mesh, arch, shapes)
    return jax.jit(make, out_shardings=kv_sharding)(), kv_sharding, shapes
