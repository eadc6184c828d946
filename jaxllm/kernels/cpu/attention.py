"""The CPU paged-attention kernels' entry points: the decode pass (each sequence's last token)
and the prefill tiles, reading the paged KV cache (f32, bf16 bits, int8 or fp8) in place."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels.cpu import build
from jaxllm.quantization import kv as kvq


def _cache_operands(cache) -> tuple[jax.Array, jax.Array]:
    """The attention kernels' cache operands: the values and their scales (a QuantizedKV's
    int8 / fp8 data and f32 scales; for a float cache a placeholder the kernels do not read)."""
    if isinstance(cache, kvq.QuantizedKV):
        return cache.data, cache.scale
    return cache, jnp.zeros((1,), jnp.float32)


def decode_attention(qg: jax.Array, cache, layer, block_tables: jax.Array,
                     seq_lens: jax.Array, lo: jax.Array, block_size: int,
                     soft_cap: float | None) -> jax.Array:
    """Each sequence's last token (qg [S, KVH, G, D] f32, scaled) against its cached context
    positions [lo, seq_len), read in place from the paged cache [L, 2, KVH, slots, D] (f32,
    bf16 bits, or a QuantizedKV of int8 / fp8): [S, KVH, G, D] f32, as
    attention._decode_pass."""
    if not build.available():
        raise RuntimeError("the CPU kernels are not available here (see the warning)")
    out = jax.ShapeDtypeStruct(qg.shape, jnp.float32)
    return jax.ffi.ffi_call("jaxllm_decode_attention", out)(
        qg.astype(jnp.float32), *_cache_operands(cache), jnp.asarray(layer, jnp.int32),
        block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32), lo.astype(jnp.int32),
        block_size=np.int64(block_size), soft_cap=np.float32(soft_cap or 0.0))


def prefill_attention(qg: jax.Array, cache, layer, md, window: int | None,
                      soft_cap: float | None) -> jax.Array:
    """The tokens of the step's prefill tiles (md.tile_seq / tile_start / num_tiles, q_tile
    tokens each; qg [T, KVH, G, D] f32, scaled) against their causal context, read in place
    from the paged cache: [T, KVH, G, D] f32, zeros for tokens in no tile (as
    attention._prefill_pass)."""
    if not build.available():
        raise RuntimeError("the CPU kernels are not available here (see the warning)")
    out = jax.ShapeDtypeStruct(qg.shape, jnp.float32)
    i32 = (lambda a: jnp.asarray(a, jnp.int32))
    return jax.ffi.ffi_call("jaxllm_prefill_attention", out)(
        qg.astype(jnp.float32), *_cache_operands(cache), i32(layer), i32(md.block_tables),
        i32(md.positions),
        i32(md.query_start_loc), i32(md.tile_seq), i32(md.tile_start), i32(md.num_tiles),
        block_size=np.int64(md.block_size), q_tile=np.int64(md.q_tile),
        window=np.int64(window or 0), soft_cap=np.float32(soft_cap or 0.0))
