"""A pool of fixed-size KV blocks: reference counts, an LRU free queue, the prefix-cache map.

A freed block keeps its hash and its contents: it stays findable by prefix lookups until it
is handed out again (lazy eviction). The free queue is ordered least recently used first, and
an ordered dict lets a cache hit take a free block out of the middle in O(1).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

NULL_BLOCK = 0  # padded tokens write here; nothing reads it


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[Hashable | None] = [None] * num_blocks
        self.cached: dict[Hashable, int] = {}  # block hash -> block id
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks, least recently used first (evicting their cached hashes), or None."""
        if n > len(self._free):
            return None
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]
            self.num_evictions += 1

    def lookup(self, block_hash: Hashable) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on blocks found in the cache (free ones leave the free queue)."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self._free[block]
            self.ref_cnt[block] += 1

    def free(self, blocks: list[int]) -> None:
        # in reverse, so that a request's tail blocks (the least shareable) are evicted first
        for block in reversed(blocks):
            cnt = self.ref_cnt[block] - 1
            if cnt < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self.ref_cnt[block] = cnt
            if cnt == 0:
                self._free[block] = None

    def cache(self, block: int, block_hash: Hashable) -> None:
        """Register a full, computed block under its hash. A block already cached under the
        same hash stays the one found; duplicates are not merged (block tables never move)."""
        if not self.enable_caching or self.block_hash[block] is not None:
            return
        self.block_hash[block] = block_hash
        self.cached.setdefault(block_hash, block)

    def forget(self, blocks) -> None:
        """Drop blocks from the prefix cache: their contents are not what their hashes say (a
        failed step was to write them). Holders keep them; nobody finds them again."""
        for block in blocks:
            self._evict(block)

    def forget_all(self) -> None:
        self.forget(range(self.num_blocks))

    def num_free_if_touched(self, blocks: list[int]) -> int:
        """Free blocks left after touching `blocks` (cache hits that sit in the free queue)."""
        return len(self._free) - sum(1 for b in blocks if self.ref_cnt[b] == 0)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks
