"""The runner's records of a step: what the host keeps while a step runs, what the device
returns, and what collect() hands to the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import numpy as np

from jaxllm.runner.packing import Packed
from jaxllm.runner.sampler import SamplerOutput


@dataclass
class Logprobs:
    """Logprob of a chosen token, its rank and the top alternatives (ids, logprobs)."""
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class RunnerOutput:
    """What one step produced: per sampling request, its new tokens (0..k of them) and, when
    asked for, one Logprobs per token."""
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    # requests computing prompt tokens that asked for them: (position of the first entry,
    # entries); the entry of position p scores prompt token p + 1
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] = field(default_factory=dict)
    # requests whose logits were not numbers (NaN or +inf): they sampled nothing
    non_finite: list[str] = field(default_factory=list)


@jax.tree_util.register_dataclass
@dataclass
class PassesOutput:
    """A multi-step dispatch's results: `num_tokens[i]` tokens of row i, one per pass."""
    tokens: jax.Array        # [S, k] i32
    num_tokens: jax.Array    # [S] i32
    logprobs: jax.Array      # [S, k] f32
    ranks: jax.Array         # [S, k] i32
    top_ids: jax.Array       # [S, k, MAX_LOGPROBS] i32
    top_logprobs: jax.Array  # [S, k, MAX_LOGPROBS] f32


@dataclass
class DispatchedStep:
    """The host's record of a dispatched step: which request each row of its outputs is."""
    req_ids: list[str]
    rows: np.ndarray
    serials: np.ndarray  # who held each row when the step was dispatched
    starts: np.ndarray
    n: np.ndarray
    final: np.ndarray  # the rows that sample
    num_logprobs: np.ndarray         # what each row asked for (the rows may be gone by collect)
    num_prompt_logprobs: np.ndarray
    num_prompt_tokens: np.ndarray
    num_draft: np.ndarray            # proposals verified per row


@dataclass
class ForwardOutput:
    """A dispatched forward pass, on the device, until sampling takes it."""
    shape: tuple[int, int]
    args: tuple          # the step's inputs on the device (a draft model reads them too)
    logits: jax.Array    # [S, V] of the rows that sample
    plp: tuple           # prompt logprobs
    smd: Packed          # the sampling metadata as sampling reads it (packed_step)
    verify: tuple | None = None  # speculative decoding: (raw logits at the verified
    #                              positions, the proposals, the resolved input ids, the
    #                              block tables the step gathered)


@dataclass
class InFlight:
    step: DispatchedStep
    result: SamplerOutput | PassesOutput | None  # None until sampling is launched
    want_logprobs: bool
    want_prompt_logprobs: bool
    pending: ForwardOutput | None = None  # the forward pass's outputs, until sampling takes them
    passes: int = 1  # a multi-step call's passes


def prompt_logprobs(st: DispatchedStep, plp, ranks, top_ids, top_lps) -> dict:
    """A step's prompt logprobs on the host ([T] and [T, k] arrays, tokens in the step's
    flat order) per request that asked for them: (position of the first entry, entries);
    the entry of position p scores prompt token p + 1."""
    out, offset = {}, 0
    for i, rid in enumerate(st.req_ids):
        n, k = int(st.n[i]), int(st.num_prompt_logprobs[i])
        if k >= 0:
            entries = []
            for t in range(offset, offset + n):
                pos = st.starts[i] + t - offset
                if pos + 1 < st.num_prompt_tokens[i]:
                    entries.append(Logprobs(float(plp[t]), int(ranks[t]), top_ids[t, :k].tolist(),
                                            top_lps[t, :k].tolist()))
            if entries:
                out[rid] = (int(st.starts[i]), entries)
        offset += n
    return out
