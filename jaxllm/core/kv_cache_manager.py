"""Maps requests to their blocks. Block tables are append-only while a request runs."""
from __future__ import annotations

from jaxllm.core.block_pool import BlockPool
from jaxllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[int]] = {}

    def get_blocks(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Blocks newly added for `num_new_tokens` more tokens, or None if they do not fit."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(blocks)
        if needed <= 0:
            return []
        new = self.pool.allocate(needed)
        if new is None:
            return None
        blocks.extend(new)
        return new

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free(blocks)

    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks
