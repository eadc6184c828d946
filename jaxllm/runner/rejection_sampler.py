"""Verification of proposed tokens inside the step, by rejection sampling (Leviathan et al.,
Chen et al.).

A speculating request schedules its last known token x0 and k proposed tokens d1..dk. The
target's logits at x0..d(k-1) give its distributions p1..pk for d1..dk; those at dk give the
bonus distribution. Draft j is accepted with probability min(1, pj(dj) / qj(dj)); at the first
rejection the token is drawn from the normalised residual max(0, pj - qj); if all k are
accepted the bonus token is drawn from p(k+1). The emitted tokens then follow the target's
distribution exactly, whatever the proposals were.

Two forms, one per kind of proposal:

- A deterministic proposal (n-gram, a draft model's argmax): q is one-hot at d, so dj is
  accepted with probability pj(dj) and the residual is pj without dj, renormalised. Drawing the
  target's own token tj at that position, with the very key the sampler would use there
  (fold_in(key(seed), output index)), and accepting when tj == dj realises exactly that: P(tj =
  dj) = pj(dj), and a rejected tj is distributed as pj given tj != dj. It also makes every
  emitted token the one the unspeculated sampler would have drawn, so greedy and seeded
  outputs are identical with and without speculation, whatever shares the batch.
- A sampled proposal (a draft model's "probabilistic" draft_sample_method): qj is on the
  device; uj ~ U(0, 1) from fold_in(fold_in(key(seed), index), 1) decides; the residual is
  drawn by the Gumbel-max trick with fold_in(..., 2).

Every per-request parameter the sampler honours position by position (temperature, top-k,
top-p, min-p, logit bias, allowed tokens, single-token bad words, min_tokens through each
position's output index, logprobs) is applied to each verified position as to a sampled one.
Penalties and multi-token bad words depend on the tokens before each position; requests with
them do not speculate (the host proposes nothing for them).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.runner.sampler import (MAX_BANNED, SamplerState, SamplingMetadata, _logprob_stats,
                                   argmax, filter_logits, process_logits, sample)
from jaxllm.sampling_params import GREEDY_EPS, MAX_LOGPROBS

ACCEPT_STREAM, RESIDUAL_STREAM, DRAFT_STREAM = 1, 2, 3


@jax.tree_util.register_dataclass
@dataclass
class VerifyMetadata:
    """The step's verified positions, one row per proposed token (R rows, padded)."""
    token_idx: jax.Array      # [R] flat index of the token whose logits score the proposal
    seq: jax.Array            # [R] its sequence in the step
    pos: jax.Array            # [R] which proposal of its sequence (0-based)
    valid: jax.Array          # [R] bool: a real row
    num_draft: jax.Array      # [S] proposals per sequence (0: not speculating)
    probabilistic: jax.Array  # [S] bool: the draft's distribution q is on the device
    any_spec: jax.Array       # [] bool
    any_probabilistic: jax.Array  # [] bool


@jax.tree_util.register_dataclass
@dataclass
class SpecState:
    """Per persistent-batch row (plus the spare row): a draft model's proposals for the row's
    next step, and their distributions when sampled (`probabilistic`; else a [1, K, 1] stub)."""
    draft_tokens: jax.Array  # [R+1, K] i32
    draft_probs: jax.Array   # [R+1, K, V] f32


def init_spec_state(rows: int, k: int, vocab: int, probabilistic: bool) -> SpecState:
    probs = (jnp.zeros((rows + 1, k, vocab), jnp.float32) if probabilistic
             else jnp.zeros((1, k, 1), jnp.float32))
    return SpecState(jnp.zeros((rows + 1, k), jnp.int32), probs)


@jax.tree_util.register_dataclass
@dataclass
class VerifyOutput:
    """Per sequence, the tokens the step emitted (accepted proposals, then one drawn token)."""
    tokens: jax.Array          # [S, K+1] i32, -1 past num_tokens
    num_tokens: jax.Array      # [S] i32 (0 for sequences that sample nothing)
    logprobs: jax.Array        # [S, K+1] f32 raw logprob of each emitted token
    ranks: jax.Array           # [S, K+1] i32
    top_ids: jax.Array         # [S, K+1, MAX_LOGPROBS] i32
    top_logprobs: jax.Array    # [S, K+1, MAX_LOGPROBS] f32
    prompt_logprobs: jax.Array
    prompt_ranks: jax.Array
    prompt_top_ids: jax.Array
    prompt_top_logprobs: jax.Array
    input_ids: jax.Array       # [T] the step's input tokens, device-held ones filled in


def num_verify_rows(T: int, S: int, k: int) -> int:
    """Verified positions a (T tokens, S sequences) step can hold: k per sequence, at most
    one per token."""
    return min(T, S * k)


def _stream_key(seed, index, stream):
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), index), stream)


def verify_metadata_rows(smd: SamplingMetadata, vmd: VerifyMetadata) -> SamplingMetadata:
    """Sampling metadata of the verified positions: their sequence's parameters at their own
    output index (the bonus row's index less the proposals after them)."""
    seq = vmd.seq
    R = seq.shape[0]

    def g(a):
        return a[seq]

    gen_index = smd.gen_index[seq] - vmd.num_draft[seq] + vmd.pos
    return SamplingMetadata(
        g(smd.temperature), g(smd.top_k), g(smd.top_p), g(smd.min_p), g(smd.seeds), gen_index,
        g(smd.rows), jnp.zeros(R, jnp.bool_), jnp.ones(R, jnp.float32), jnp.zeros(R, jnp.float32),
        jnp.zeros(R, jnp.float32), g(smd.min_tokens), g(smd.has_bias) & vmd.valid,
        jnp.full((R, MAX_BANNED), -1, jnp.int32), jnp.zeros(1, jnp.int32),
        smd.any_random, smd.any_filter, jnp.bool_(False), smd.any_bias, smd.any_min_tokens,
        jnp.bool_(False), jnp.bool_(False), jnp.bool_(False))


def target_probs(raw_logits, md: SamplingMetadata, state: SamplerState):
    """The distribution the sampler draws from (processed, temperature, filters), [R, V]."""
    logits = process_logits(raw_logits, md, state)
    temp = jnp.where(md.temperature < GREEDY_EPS, 1.0, md.temperature)
    scaled = logits / temp[:, None]
    scaled = jax.lax.cond(md.any_filter, filter_logits, lambda x, *_: x, scaled,
                          md.top_k, md.top_p, md.min_p)
    return jax.nn.softmax(scaled, axis=-1)


def _probabilistic_decisions(raw_v, md_v, state, drafts, q, prob_rows):
    """u < p(d) / q(d), and the residual draws, for rows with a sampled proposal."""
    V = raw_v.shape[-1]
    p = target_probs(raw_v, md_v, state)
    p_d = jnp.take_along_axis(p, drafts[:, None], axis=-1)[:, 0]
    q_d = jnp.take_along_axis(q, drafts[:, None], axis=-1)[:, 0]
    u = jax.vmap(lambda s, i: jax.random.uniform(_stream_key(s, i, ACCEPT_STREAM)))(
        md_v.seeds, md_v.gen_index)
    accept = (q_d > 0) & (u * q_d <= p_d)
    residual = jnp.maximum(p - q, 0.0)
    gumbel = jax.vmap(lambda s, i: jax.random.gumbel(_stream_key(s, i, RESIDUAL_STREAM), (V,)))(
        md_v.seeds, md_v.gen_index)
    recovered = argmax(jnp.where(residual > 0, jnp.log(residual) + gumbel, -jnp.inf))
    return jnp.where(prob_rows, accept, False), recovered


def verify(raw_v, drafts, base, smd: SamplingMetadata, vmd: VerifyMetadata,
           state: SamplerState, spec_state: SpecState, k: int, probabilistic: bool = False):
    """raw_v [R, V]: raw target logits at the verified positions; drafts [R]: the proposals
    they score (the input token after each). base: (tokens, lp, rank,
    top_ids, top_lp) the sampler drew at each sequence's last token (the bonus), with `state`
    as it left it. `probabilistic`: some proposals may come with their q (else all are
    one-hot and that path is not built). Returns (tokens [S, K+1], num [S], stats [S, K+1,
    ...], state)."""
    S = smd.rows.shape[0]
    seq, pos, valid = vmd.seq, vmd.pos, vmd.valid
    md_v = verify_metadata_rows(smd, vmd)
    if probabilistic:  # rows with a sampled proposal need no draw of the target's own token
        prob_rows = vmd.probabilistic[seq] & valid
        temp = jnp.where(prob_rows, 0.0, md_v.temperature)
        md_t = dataclasses.replace(md_v, temperature=temp,
                                   any_random=jnp.any((temp >= GREEDY_EPS) & valid))
        (sampled, *_), _ = sample(raw_v, md_t, state)
    else:
        (sampled, *_), _ = sample(raw_v, md_v, state)
    accept = sampled == drafts
    recovered = sampled
    if probabilistic:
        def with_q(_):
            q = spec_state.draft_probs[md_v.rows, pos]
            return _probabilistic_decisions(raw_v, md_v, state, drafts, q, prob_rows)

        p_accept, p_recovered = jax.lax.cond(
            vmd.any_probabilistic, with_q,
            lambda _: (jnp.zeros_like(accept), jnp.zeros_like(recovered)), None)
        accept = jnp.where(prob_rows, p_accept, accept)
        recovered = jnp.where(prob_rows, p_recovered, recovered)
    accept &= valid

    # per sequence: the accepted prefix, then the recovered or the bonus token
    dst = jnp.where(valid, seq, S)  # padded rows land nowhere
    acc = jnp.zeros((S, k), jnp.bool_).at[dst, pos].set(accept, mode="drop")
    a = jnp.sum(jnp.cumprod(acc, axis=1), axis=1).astype(jnp.int32)
    nd = vmd.num_draft
    grid = jnp.zeros((S, k + 1), jnp.int32)
    draft_grid = grid.at[dst, pos].set(drafts, mode="drop")
    rec_grid = grid.at[dst, pos].set(recovered, mode="drop")
    bonus = base[0]
    last = jnp.where(a < nd, jnp.take_along_axis(rec_grid, a[:, None], axis=1)[:, 0], bonus)
    col = jnp.arange(k + 1)[None, :]
    tokens = jnp.where(col < a[:, None], draft_grid, jnp.where(col == a[:, None], last[:, None], -1))
    num = jnp.where(smd.is_final, a + 1, 0)

    # raw logprobs of what was emitted: verified positions from their rows, the bonus from its
    emitted_v = jnp.where(pos < a[seq], drafts, recovered)

    def stats(_):
        return _logprob_stats(jax.nn.log_softmax(raw_v, axis=-1), emitted_v)

    K = min(MAX_LOGPROBS, raw_v.shape[-1])
    R = raw_v.shape[0]
    zeros = (jnp.zeros(R, jnp.float32), jnp.zeros(R, jnp.int32), jnp.zeros((R, K), jnp.int32),
             jnp.zeros((R, K), jnp.float32))
    v_stats = jax.lax.cond(smd.any_logprobs, stats, lambda _: zeros, None)
    out_stats = []
    from_base = col == nd[:, None]
    for vs, bs in zip(v_stats, base[1:]):
        g = jnp.zeros((S, k + 1) + vs.shape[1:], vs.dtype).at[dst, pos].set(vs, mode="drop")
        b = jnp.broadcast_to(bs[:, None], g.shape)
        sel = from_base.reshape(from_base.shape + (1,) * (vs.ndim - 1))
        out_stats.append(jnp.where(sel, b, g))

    # the sampler counted the bonus and made it the row's last token: count what was emitted
    spare = state.last_token.shape[0] - 1
    spec_row = smd.is_final & (nd > 0)
    counts = state.out_counts.at[jnp.where(spec_row & (a < nd), smd.rows, spare), bonus].add(-1)
    from_rows = spec_row[:, None] & (col[:, :k] <= a[:, None]) & (col[:, :k] < nd[:, None])
    rows2 = jnp.broadcast_to(smd.rows[:, None], (S, k))
    counts = counts.at[rows2, jnp.maximum(tokens[:, :k], 0)].add(from_rows.astype(jnp.int32))
    counts = counts.at[spare].set(0)
    last_token = state.last_token.at[jnp.where(smd.is_final, smd.rows, spare)].set(
        jnp.take_along_axis(tokens, a[:, None], axis=1)[:, 0])
    state = dataclasses.replace(state, out_counts=counts, last_token=last_token)
    return tokens, num, tuple(out_stats), state


def no_verify(base, smd: SamplingMetadata, k: int):
    """A step with no proposals: the drawn token is the only one emitted."""
    S = smd.rows.shape[0]
    col = jnp.arange(k + 1)[None, :]
    tokens = jnp.where(col == 0, base[0][:, None], -1)
    stats = []
    for bs in base[1:]:
        g = jnp.zeros((S, k + 1) + bs.shape[1:], bs.dtype)
        stats.append(g.at[:, 0].set(bs))
    return tokens, smd.is_final.astype(jnp.int32), tuple(stats)
