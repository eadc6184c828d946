"""Maps requests to their blocks: prefix-cache lookups, allocation, forks with copy-on-write,
and swapping to host memory. Block tables are append-only while a request runs."""
from __future__ import annotations

from collections.abc import Sequence

from jaxllm.core.block_pool import BlockPool
from jaxllm.core.request import Request

# what most decode steps add: one shared empty tuple, not a new list per request per step
NO_BLOCKS: tuple[int, ...] = ()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_key(parent, tokens: tuple[int, ...], extra=None) -> tuple:
    """The prefix-cache key of a full block: the parent's hash, the block's tokens and extra
    keys. Tokens are kept in the key, so equal hashes of different blocks never match."""
    return (hash(parent) if parent is not None else None, tokens, extra)


def prefix_keys(token_ids, block_size: int, extra=None) -> list:
    """The keys of the full blocks of `token_ids`, chained as block_hashes() chains a
    request's (`extra`: its cache_extra). Keys hold Python hashes: each process computes its
    own."""
    keys: list = []
    for i in range(len(token_ids) // block_size):
        keys.append(block_key(keys[-1] if keys else None,
                              tuple(token_ids[i * block_size:(i + 1) * block_size]),
                              extra if i == 0 else None))
    return keys


class HostBlockPool:
    """Host-memory blocks for swap preemption: a plain free list."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_host_blocks: int = 0):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.host_pool = HostBlockPool(num_host_blocks)
        self.req_to_blocks: dict[str, list[int]] = {}
        self.req_to_host_blocks: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # blocks of a request registered so far
        # sources of this step's copies: held until the runner has read them
        self._hold_device: list[int] = []
        self._hold_host: list[int] = []
        # prefix-cache counters, in tokens (vLLM's prefix_cache_queries / _hits)
        self.prefix_queries = 0
        self.prefix_hits = 0

    def get_blocks(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    # prefix cache
    def block_hashes(self, request: Request) -> list:
        """Keys of the request's full blocks, extended as its tokens grow."""
        hashes, bs, toks = request.block_hashes, self.block_size, request.all_token_ids
        while (len(hashes) + 1) * bs <= len(toks):
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            extra = request.cache_extra if i == 0 else None
            if request.mm:  # an image's tokens are placeholders: its hash keys their blocks
                images = tuple(h for off, n, h, _ in request.mm if off < (i + 1) * bs and off + n > i * bs)
                extra = (extra, images) if images else extra
            hashes.append(block_key(parent, tuple(toks[i * bs:(i + 1) * bs]), extra))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached full blocks at the start of the request, never covering
        its last token (whose logits are needed), and how many tokens they hold."""
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        usable = (request.num_tokens - 1) // self.block_size
        hits = []
        for key in self.block_hashes(request)[:usable]:
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def cached_run(self, keys: list) -> list[int]:
        """The blocks cached under `keys`, from the first up to the first one missing."""
        out = []
        for key in keys:
            block = self.pool.lookup(key)
            if block is None:
                break
            out.append(block)
        return out

    def adopt(self, keys: list) -> list[tuple[int, int]] | None:
        """Blocks for the keys after the cached run (moved here from another engine's cache):
        allocated, registered under their keys and released at once, so that they sit in the
        prefix cache, the last to be evicted, until a request finds them. (index in keys,
        block) for the caller to fill before any step runs; None when they do not fit."""
        held = self.cached_run(keys)
        start, need = len(held), len(keys) - len(held)
        if not self.enable_caching or need > self.pool.num_free_if_touched(held):
            return None
        # the cached run is held meanwhile, so that allocating cannot evict the prefix the new
        # blocks continue; released in one call, the chain's head is the last to be evicted
        self.pool.touch(held)
        blocks = self.pool.allocate(need) if need else []
        for key, block in zip(keys[start:], blocks):
            self.pool.cache(block, key)
        self.pool.free(held + blocks)
        return list(zip(range(start, len(keys)), blocks))

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Counted once, when the request is admitted (a waiting request is looked up again
        every step until it fits)."""
        if self.enable_caching and not request.skip_prefix_cache:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += num_hit_tokens

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        rid = request.request_id
        blocks = self.req_to_blocks[rid]
        done = self._num_cached_blocks.get(rid, 0)
        full = min(min(num_tokens, request.num_tokens) // self.block_size, len(blocks))
        if full <= done:
            return
        hashes = self.block_hashes(request)
        for i in range(done, full):
            self.pool.cache(blocks[i], hashes[i])
        self._num_cached_blocks[rid] = full

    # allocation
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None,
                       num_lookahead_tokens: int = 0) -> Sequence[int] | None:
        """Blocks newly added so that `num_new_tokens` more tokens fit (cache hits first), or
        None when they do not fit. Full blocks whose tokens are known are registered in the
        prefix cache at once: the step that computes them runs before anyone can read them
        (speculated tokens are not known, so their blocks wait until they are accepted).
        `num_lookahead_tokens` more slots are held for a draft model's proposals."""
        if not computed_blocks:  # most decode steps: the slots are held already
            blocks = self.req_to_blocks.get(request.request_id)
            total = request.num_computed_tokens + num_new_tokens
            if blocks and total + num_lookahead_tokens <= len(blocks) * self.block_size:
                if (self.enable_caching and total >= (
                        self._num_cached_blocks.get(request.request_id, 0) + 1) * self.block_size):
                    self._cache_full_blocks(request, total)  # (a block filled up)
                return NO_BLOCKS
        computed_blocks = computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        total = (request.num_computed_tokens + len(computed_blocks) * self.block_size
                 + num_new_tokens)
        need = (cdiv(total + num_lookahead_tokens, self.block_size) - len(blocks)
                - len(computed_blocks))
        if need <= 0 and not computed_blocks:
            self._cache_full_blocks(request, total)
            return []
        if max(need, 0) > self.pool.num_free_if_touched(computed_blocks):
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        new = self.pool.allocate(need) if need > 0 else []
        blocks.extend(new)
        self._cache_full_blocks(request, total)
        return computed_blocks + new

    def free(self, request: Request) -> None:
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        if blocks:
            self.pool.free(blocks)
        host = self.req_to_host_blocks.pop(rid, None)
        if host:
            self.host_pool.free(host)

    # parallel sampling
    def fork(self, parent: Request, child: Request) -> tuple[list[int], tuple[int, int] | None] | None:
        """Give `child` the parent's prompt blocks, so that it computes only the last prompt
        token (to sample its own first token). Blocks before that token's block are shared;
        that block, which the child writes, is copied: (child blocks, (src, dst) or None).
        None when no block is free."""
        bs = self.block_size
        last = child.num_prompt_tokens - 1
        pblocks = self.req_to_blocks[parent.request_id]
        shared = pblocks[:last // bs]
        fresh = self.pool.allocate(1)
        if fresh is None:
            return None
        self.pool.touch(shared)
        blocks = shared + fresh
        self.req_to_blocks[child.request_id] = blocks
        child.num_computed_tokens = last
        # the copied block holds prompt tokens before `last`; with none, nothing to copy
        copy = (pblocks[last // bs], fresh[0]) if last % bs else None
        self._num_cached_blocks[child.request_id] = len(shared)
        if copy is not None:
            self.pool.touch([copy[0]])
            self._hold_device.append(copy[0])
        return blocks, copy

    # swapping
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to host memory: (device, host) pairs, or None when the
        swap space is full (the caller then recomputes instead)."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid, [])
        host = self.host_pool.allocate(len(blocks))
        if host is None:
            return None
        self.req_to_host_blocks[rid] = host
        del self.req_to_blocks[rid]
        self._num_cached_blocks.pop(rid, None)
        self.pool.free(blocks)
        return list(zip(blocks, host))

    def swap_in(self, request: Request, num_new_tokens: int,
                num_lookahead_tokens: int = 0) -> tuple[list[int], list[tuple[int, int]]] | None:
        """Device blocks for a swapped request and `num_new_tokens` more (and lookahead
        slots): (blocks, (host, device) pairs to copy back), or None when they do not fit."""
        rid = request.request_id
        host = self.req_to_host_blocks[rid]
        need = cdiv(request.num_computed_tokens + num_new_tokens + num_lookahead_tokens,
                    self.block_size)
        blocks = self.pool.allocate(max(need, len(host)))
        if blocks is None:
            return None
        del self.req_to_host_blocks[rid]
        self._hold_host.extend(host)
        self.req_to_blocks[rid] = blocks
        self._cache_full_blocks(request, request.num_computed_tokens)
        return blocks, list(zip(host, blocks))

    def release_copy_source(self, src: int) -> None:
        self._hold_device.remove(src)
        self.pool.free([src])

    def end_step(self) -> None:
        """The runner has done this step's copies: release their held sources."""
        self.pool.free(self._hold_device)
        self.host_pool.free(self._hold_host)
        self._hold_device, self._hold_host = [], []

    # introspection
    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks
