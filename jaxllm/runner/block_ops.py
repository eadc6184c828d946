"""Whole-block moves on the KV cache: swap out to host memory, swap in, copy on write.

Blocks move in fixed-size groups so that two small jitted functions (a gather and a donated
scatter) compiled at start-up serve any number of blocks. Padded entries gather the null
block and scatter out of bounds, which drops them. The cache may be one array or several
(a quantized cache's values and scales: jaxllm.quantization.kv); every array has the slot
axis third, [layers, 2, kv_heads, slots, ...], and moves the same way.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import executable_cache

GROUP = 16  # blocks per gather / scatter call


def _slots(blocks: jax.Array, block_size: int) -> jax.Array:
    return (blocks[:, None] * block_size + jnp.arange(block_size)).reshape(-1)


class BlockOps:
    def __init__(self, cache_like, block_size: int, num_host_blocks: int, kv_sharding=None):
        """cache_like: the cache, or its ShapeDtypeStructs."""
        leaves, self._treedef = jax.tree.flatten(cache_like)
        self._leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        L, two, KVH, num_slots = self._leaves[0].shape[:4]
        self.block_size = block_size
        self.num_slots = num_slots
        bs = block_size
        # host copies of blocks, one row per host block: [L, 2, KVH, block_size, ...] per array
        self.host = [np.zeros((num_host_blocks, L, two, KVH, bs, *x.shape[4:]),
                              dtype=np.dtype(x.dtype)) for x in self._leaves] if num_host_blocks else None

        def gather(cache, blocks):  # -> per array [GROUP, L, 2, KVH, bs, ...]
            def one(a):
                g = a[:, :, :, _slots(blocks, bs)]
                g = g.reshape(L, two, KVH, GROUP, bs, *a.shape[4:])
                return jnp.moveaxis(g, 3, 0)
            return jax.tree.map(one, cache)

        def scatter(cache, blocks, values):
            def one(a, v):
                v = jnp.moveaxis(v, 0, 3).reshape(L, two, KVH, GROUP * bs, *a.shape[4:])
                return a.at[:, :, :, _slots(blocks, bs)].set(v, mode="drop")
            return jax.tree.map(one, cache, values)

        def copy(cache, src, dst):
            return scatter(cache, dst, gather(cache, src))

        # the cache keeps its (tensor-parallel) sharding through every move
        self._gather = jax.jit(gather)
        self._scatter = jax.jit(scatter, donate_argnums=(0,), out_shardings=kv_sharding)
        self._copy = jax.jit(copy, donate_argnums=(0,), out_shardings=kv_sharding)
        self._kv_sharding = kv_sharding

    def compile(self) -> None:
        kv = self._kv_sharding
        sh = jax.tree.leaves(kv) if kv is not None else [None] * len(self._leaves)
        mesh = sh[0].mesh if sh[0] is not None else None
        rep = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        cache = jax.tree.unflatten(self._treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                                                   for x, s in zip(self._leaves, sh)])
        idx = jax.ShapeDtypeStruct((GROUP,), jnp.int32, sharding=rep)
        vals = jax.tree.unflatten(self._treedef, [
            jax.ShapeDtypeStruct((GROUP, *x.shape[:3], self.block_size, *x.shape[4:]), x.dtype, sharding=rep)
            for x in self._leaves])
        self._copy = executable_cache.compile(self._copy, cache, idx, idx)
        if self.host is not None:
            self._gather = executable_cache.compile(self._gather, cache, idx)
            self._scatter = executable_cache.compile(self._scatter, cache, idx, vals)

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
            for host, vals in zip(self.host, jax.tree.leaves(self._gather(cache, src))):
                host[dst[:n]] = np.asarray(vals)[:n]
        return cache

    def swap_in(self, cache, pairs: list[tuple[int, int]]):
        """(host block, device block) pairs."""
        oob = self.num_slots // self.block_size  # scatters past the cache: dropped
        for n, src, dst in self._groups(pairs, 0, oob):
            vals = jax.tree.unflatten(self._treedef, [host[src] for host in self.host])
            cache = self._scatter(cache, dst, vals)
        return cache

    def read(self, cache, blocks: list[int]) -> list[np.ndarray]:
        """The contents of device blocks, per cache array [len(blocks), L, 2, KVH, bs, ...]
        (what another engine's write() takes)."""
        out = [np.empty((len(blocks), *x.shape[:3], self.block_size, *x.shape[4:]), np.dtype(x.dtype))
               for x in self._leaves]
        for i in range(0, len(blocks), GROUP):
            chunk = blocks[i:i + GROUP]
            idx = np.zeros(GROUP, np.int32)
            idx[:len(chunk)] = chunk
            for dst, vals in zip(out, jax.tree.leaves(self._gather(cache, idx))):
                dst[i:i + len(chunk)] = np.asarray(vals)[:len(chunk)]
        return out

    def check(self, values: list[np.ndarray]) -> None:
        """ValueError unless read()'s arrays (of another engine) fit this cache."""
        if len(values) != len(self._leaves) or any(
                v.shape[1:] != (*x.shape[:3], self.block_size, *x.shape[4:]) or v.dtype != np.dtype(x.dtype)
                for v, x in zip(values, self._leaves)):
            raise ValueError("the KV blocks do not match this cache's layout (model, block size "
                             "or cache dtype differ)")

    def write(self, cache, blocks: list[int], values: list[np.ndarray]):
        """Device blocks filled from read()'s arrays (one row per block)."""
        self.check(values)
        oob = self.num_slots // self.block_size
        for i in range(0, len(blocks), GROUP):
            n = min(GROUP, len(blocks) - i)
            idx = np.full(GROUP, oob, np.int32)
            idx[:n] = blocks[i:i + n]
            vals = []
            for v in values:
                pad = np.zeros((GROUP, *v.shape[1:]), v.dtype)
                pad[:n] = v[i:i + n]
                vals.append(pad)
            cache = self._scatter(cache, idx, jax.tree.unflatten(self._treedef, vals))
        return cache

    def copy(self, cache, pairs: list[tuple[int, int]]):
        """(src, dst) device block pairs."""
        oob = self.num_slots // self.block_size
        for _, src, dst in self._groups(pairs, 0, oob):
            cache = self._copy(cache, src, dst)
        return cache
