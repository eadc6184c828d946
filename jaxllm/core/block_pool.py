"""A pool of fixed-size KV blocks with reference counts and a free list."""
from __future__ import annotations

from collections import OrderedDict

NULL_BLOCK = 0  # padded tokens write here; nothing reads it


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        # An ordered dict is a queue with O(1) removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self.ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        # Freed in reverse so that a request's tail blocks are reused first.
        for block in reversed(blocks):
            cnt = self.ref_cnt[block] - 1
            if cnt < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self.ref_cnt[block] = cnt
            if cnt == 0:
                self._free[block] = None

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks
