"""Whole-block moves on the KV cache: swap out to host memory, swap in, copy on write.

Blocks move in fixed-size groups so that two small jitted functions (a gather and a donated
scatter) compiled at start-up serve any number of blocks. Padded entries gather the null
block and scatter out of bounds, which drops them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 16  # blocks per gather / scatter call


def _slots(blocks: jax.Array, block_size: int) -> jax.Array:
    return (blocks[:, None] * block_size + jnp.arange(block_size)).reshape(-1)


class BlockOps:
    def __init__(self, kv_shape: tuple[int, ...], dtype, block_size: int, num_host_blocks: int,
                 kv_sharding=None):
        L, two, KVH, num_slots, D = kv_shape
        self.block_size = block_size
        self.num_slots = num_slots
        # host copies of blocks, one row per host block: [L, 2, KVH, block_size, D]
        self.host = np.zeros((num_host_blocks, L, two, KVH, block_size, D),
                             dtype=np.dtype(jnp.dtype(dtype))) if num_host_blocks else None
        bs = block_size

        def gather(cache, blocks):  # -> [GROUP, L, 2, KVH, bs, D]
            g = cache[:, :, :, _slots(blocks, bs)].reshape(L, two, KVH, GROUP, bs, D)
            return g.transpose(3, 0, 1, 2, 4, 5)

        def scatter(cache, blocks, values):
            vals = values.transpose(1, 2, 3, 0, 4, 5).reshape(L, two, KVH, GROUP * bs, D)
            return cache.at[:, :, :, _slots(blocks, bs)].set(vals, mode="drop")

        def copy(cache, src, dst):
            return scatter(cache, dst, gather(cache, src))

        # the cache keeps its (tensor-parallel) sharding through every move
        self._gather = jax.jit(gather)
        self._scatter = jax.jit(scatter, donate_argnums=(0,), out_shardings=kv_sharding)
        self._copy = jax.jit(copy, donate_argnums=(0,), out_shardings=kv_sharding)
        self._shape = kv_shape
        self._dtype = dtype
        self._kv_sharding = kv_sharding

    def compile(self) -> None:
        kv = self._kv_sharding
        rep = None if kv is None else jax.sharding.NamedSharding(kv.mesh, jax.sharding.PartitionSpec())
        cache = jax.ShapeDtypeStruct(self._shape, self._dtype, sharding=kv)
        idx = jax.ShapeDtypeStruct((GROUP,), jnp.int32, sharding=rep)
        L, two, KVH, _, D = self._shape
        vals = jax.ShapeDtypeStruct((GROUP, L, two, KVH, self.block_size, D), self._dtype, sharding=rep)
        self._copy = self._copy.lower(cache, idx, idx).compile()
        if self.host is not None:
            self._gather = self._gather.lower(cache, idx).compile()
            self._scatter = self._scatter.lower(cache, idx, vals).compile()

    def _groups(self, pairs, pad_src: int, pad_dst: int):
        for i in range(0, len(pairs), GROUP):
            chunk = pairs[i:i + GROUP]
            src = np.full(GROUP, pad_src, np.int32)
            dst = np.full(GROUP, pad_dst, np.int32)
            src[:len(chunk)] = [a for a, _ in chunk]
            dst[:len(chunk)] = [b for _, b in chunk]
            yield len(chunk), src, dst

    def swap_out(self, cache, pairs: list[tuple[int, int]]):
        """(device block, host block) pairs: device contents land in host memory."""
        for n, src, dst in self._groups(pairs, 0, 0):
            self.host[dst[:n]] = np.asarray(self._gather(cache, src))[:n]
        return cache

    def swap_in(self, cache, pairs: list[tuple[int, int]]):
        """(host block, device block) pairs."""
        oob = self.num_slots // self.block_size  # scatters past the cache: dropped
        for n, src, dst in self._groups(pairs, 0, oob):
            vals = self.host[src]
            cache = self._scatter(cache, dst, vals)
        return cache

    def copy(self, cache, pairs: list[tuple[int, int]]):
        """(src, dst) device block pairs."""
        oob = self.num_slots // self.block_size
        for _, src, dst in self._groups(pairs, 0, oob):
            cache = self._copy(cache, src, dst)
        return cache
