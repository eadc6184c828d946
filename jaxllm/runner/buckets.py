"""Padded shape buckets: powers of two up to the limit, chosen by bisect."""
from __future__ import annotations

import bisect


def make_buckets(minimum: int, maximum: int) -> list[int]:
    out, b = [], max(1, minimum)
    while b < maximum:
        out.append(b)
        b *= 2
    out.append(maximum)
    return out


def pick(buckets: list[int], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def step_shapes(token_buckets: list[int], seq_buckets: list[int]) -> list[tuple[int, int]]:
    """Every (tokens, seqs) pair a step can take: the token bucket is picked at least as
    large as the seq bucket, so pairs with more seqs than tokens never occur."""
    return [(t, s) for t in token_buckets for s in seq_buckets if s <= t]
