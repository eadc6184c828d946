"""Padded step shapes: token counts T and sequence counts S from short fixed lists.

Token buckets are powers of two up to `linear_from`, then multiples of it (and, on a CPU,
square decode shapes below the smallest). For each T only sequence buckets between
T/`seq_ratio` and T are compiled: padding a step with many tokens
to more sequence rows costs only the rows' logits and sampling, a few percent of the step,
while every extra pair costs a compilation at every start.
"""
from __future__ import annotations

import bisect

from jaxllm.layers.attention import max_tiles


def make_buckets(minimum: int, maximum: int, linear_from: int | None = None) -> list[int]:
    out, b = [], max(1, minimum)
    while b < maximum and (linear_from is None or b < linear_from):
        out.append(b)
        b *= 2
    if linear_from is not None:
        b = max(b, linear_from)
        while b < maximum:
            out.append(b)
            b += linear_from
    out.append(maximum)
    return out


def pick(buckets: list[int], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


class StepShapes:
    def __init__(self, token_buckets: list[int], seq_buckets: list[int], seq_ratio: int = 8,
                 decode_buckets: list[int] = (), spec_width: int = 1,
                 square_decodes: bool = False):
        """decode_buckets: token counts below the smallest token bucket compiled only as
        (t tokens, t sequences), the shape of a small decode batch (on a CPU a step costs in
        proportion to its padded tokens; a GPU pads for free). With speculative decoding
        (spec_width = k + 1 tokens a verifying sequence runs) also (t * (k + 1), t).

        square_decodes: a square shape (T = S) holds only steps of one token per sequence,
        so it is compiled without the prefill tiles' attention (tiles() is 0), and a decode
        step takes the smallest square shape that holds it. On a GPU that attention would
        otherwise sit behind a run-time branch in every layer, and XLA's GPU runtime reads a
        branch's predicate back to the host: a wait on the device per layer."""
        self.square_decodes = square_decodes
        token_buckets = [t for t in token_buckets if t >= seq_buckets[0]]  # none hold fewer
        seqs_for: dict[int, set[int]] = {}
        for t in decode_buckets:
            if t not in seq_buckets:
                continue
            for width in {1, spec_width}:
                if t * width < token_buckets[0]:
                    seqs_for.setdefault(t * width, set()).add(t)
        small = sorted(seqs_for)
        self.token_buckets = small + token_buckets
        self.seq_buckets = seq_buckets
        self.seqs_for: dict[int, list[int]] = {t: sorted(seqs_for[t]) for t in small}
        for t in token_buckets:
            fits = [s for s in seq_buckets if s <= t]
            lo = min(t // seq_ratio, fits[-1])
            self.seqs_for[t] = [s for s in fits if s >= lo]
        if square_decodes:  # a square shape for every sequence bucket the tokens reach
            for s in seq_buckets:
                if token_buckets[0] < s <= token_buckets[-1] and s not in self.seqs_for:
                    self.seqs_for[s] = [s]
            self.token_buckets = sorted(self.seqs_for)
        self.squares = [t for t in self.token_buckets if t in self.seqs_for[t]]

    @property
    def all(self) -> list[tuple[int, int]]:
        return [(t, s) for t in self.token_buckets for s in self.seqs_for[t]]

    @property
    def essential(self) -> list[tuple[int, int]]:
        """The shapes compiled before serving when the rest compile in the background: the
        largest (any step fits it) and the decode shapes of every other sequence bucket from
        the largest down, so a decode batch pads to at most four times its sequences meanwhile."""
        decode = {self.pick(s, s) for s in self.seq_buckets[::-1][::2]}
        return sorted(decode | {self.all[-1]})

    def tiles(self, T: int, S: int, q_tile: int) -> int:
        """Prefill tiles a (T, S) step has room for (attention.max_tiles); 0: none, a
        decode-only shape (square_decodes)."""
        return 0 if self.square_decodes and T == S else max_tiles(T, S, q_tile)

    def allowed(self, T: int, S: int, num_tokens: int, num_seqs: int) -> bool:
        """Whether a (T, S) shape may take a step of num_tokens in num_seqs sequences as far
        as prefill tiles go: a decode-only shape takes only one token per sequence."""
        return not (self.square_decodes and T == S and num_tokens > num_seqs)

    def pick(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The smallest compiled (T, S) holding num_tokens tokens in num_seqs sequences
        (with square_decodes: a decode step's smallest square shape, if one holds it, and
        any other step's smallest shape that is not square)."""
        if self.square_decodes and num_tokens <= num_seqs:
            i = bisect.bisect_left(self.squares, num_seqs)
            if i < len(self.squares):
                return self.squares[i], self.squares[i]
        t = pick(self.token_buckets, max(num_tokens, num_seqs))
        i = bisect.bisect_left(self.token_buckets, t)
        for t in self.token_buckets[i:]:
            seqs = self.seqs_for[t]  # (ascending: a square shape is the last)
            if not self.allowed(t, seqs[-1], num_tokens, num_seqs):
                seqs = seqs[:-1]
            if seqs and seqs[-1] >= num_seqs:
                return t, pick(seqs, num_seqs)
        raise ValueError(f"no step shape holds {num_tokens} tokens in {num_seqs} sequences")


def step_shapes(platform: str, max_num_batched_tokens: int, max_num_seqs: int,
                num_spec_tokens: int = 0, token_buckets: list[int] | None = None,
                seq_buckets: list[int] | None = None) -> StepShapes:
    """The engine's step shapes: the given buckets, or those derived from its limits. On a
    CPU a step's cost follows its padded tokens: small decode batches get shapes of their own
    instead of padding to 16 tokens (unless the token buckets are given)."""
    decode = [1, 2, 4, 8] if platform == "cpu" and token_buckets is None else []
    return StepShapes(
        token_buckets or make_buckets(min(16, max_num_batched_tokens), max_num_batched_tokens,
                                      linear_from=1024),
        seq_buckets or make_buckets(1, max_num_seqs), decode_buckets=decode,
        spec_width=num_spec_tokens + 1, square_decodes=platform == "gpu")
