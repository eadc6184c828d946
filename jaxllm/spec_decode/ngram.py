"""N-gram (prompt lookup) proposals from each request's own prompt and output, on the host.

vLLM's rule: find the longest n-gram, n in [prompt_lookup_min, prompt_lookup_max], that ends
the request's tokens and also occurs earlier in them (the earliest such occurrence); propose
the k tokens that followed it. Vectorised over the batch with numpy: one comparison of every
row's tokens with its last token finds the candidate occurrences; each longer n-gram only
filters those candidates. No Python loop runs over tokens or requests.
"""
from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, lengths: np.ndarray, num: np.ndarray, min_n: int,
                  max_n: int, skip: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """tokens [B, L]: each row's known tokens in its first lengths[b] columns. num [B]: the
    most tokens to propose per row. skip [B] (0 or 1): leave out the first token after the
    match (a row whose next token is still being computed proposes what follows it).

    Returns (drafts [B, max(num)] padded with -1, count [B])."""
    B = tokens.shape[0]
    lengths = np.asarray(lengths, np.int64)
    num = np.asarray(num, np.int64)
    skip = np.zeros(B, np.int64) if skip is None else np.asarray(skip, np.int64)
    K = int(num.max(initial=0))
    drafts = np.full((B, K), -1, np.int32)
    count = np.zeros(B, np.int32)
    if B == 0 or K == 0:
        return drafts, count
    L = tokens.shape[1]
    rows = np.arange(B)
    last = tokens[rows, np.maximum(lengths - 1, 0)]
    # occurrences of each row's last token before its end: candidate ends of a match
    cand = (tokens == last[:, None]) & (np.arange(L)[None, :] < (lengths - 1)[:, None])
    cand &= (lengths >= min_n)[:, None] & (num > 0)[:, None]
    b, e = np.nonzero(cand)
    if b.size == 0:
        return drafts, count
    n = np.ones(b.size, np.int64)  # n-gram length matched so far at each candidate
    alive = np.ones(b.size, bool)
    for j in range(1, max_n):
        i, t = e - j, lengths[b] - 1 - j
        alive &= (i >= 0) & (tokens[b, np.maximum(i, 0)] == tokens[b, np.maximum(t, 0)])
        if not alive.any():
            break
        n += alive
    # per row: the longest match, then the earliest occurrence of it
    order = np.lexsort((e, -n, b))
    first = order[np.unique(b[order], return_index=True)[1]]
    rb, rn, re = b[first], n[first], e[first]
    ok = rn >= min_n
    rb, re = rb[ok], re[ok]
    start = re + 1 + skip[rb]
    cnt = np.clip(np.minimum(num[rb], lengths[rb] - start), 0, None)
    count[rb] = cnt
    cols = np.arange(K)
    take = cols[None, :] < cnt[:, None]
    src = np.minimum(start[:, None] + cols[None, :], L - 1)
    drafts[rb] = np.where(take, tokens[rb[:, None], src], -1)
    return drafts, count
