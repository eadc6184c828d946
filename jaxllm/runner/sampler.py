"""On-device sampling inside the jitted step, batched over requests with different parameters.

Order, as vLLM's sampler: raw logprobs are taken first; then allowed-token masks, bad words,
min_tokens and logit bias; then repetition, frequency and presence penalties; greedy rows take
the argmax; the others apply temperature, min_p, top-k and top-p, and draw by the Gumbel-max
trick. Every row draws from its own key, fold_in(key(seed), index of the token being
generated), so a seeded request yields the same tokens whatever else shares its batch.

Per-request state that outlives a step (output token counts, the prompt's token set, a dense
bias row, the min_tokens stop set) lives in `SamplerState`, one row per persistent-batch row,
passed in and returned donated. Optional work sits behind `lax.cond` on flags computed on the
host, so a new mix of parameters never recompiles and a plain greedy batch pays for nothing.
The same holds for structured outputs' token bitmask.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.sampling_params import GREEDY_EPS, MAX_LOGPROBS

MAX_BANNED = 16     # tokens banned per row and step by multi-token bad words
PROMPT_LP_CHUNK = 256
_NEG_INF = -jnp.inf
ARGMAX_CHUNK = 1024  # entries per chunk of the two-pass argmax


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis of [S, V] (the first maximum) as int32, in two passes: the
    maximum of each chunk of 1024 entries, then the argmax inside the winning chunk. XLA:CPU's
    one-pass argmax is a scalar loop, while a chunk's maximum vectorizes. The pad
    (only when V is not a multiple of the chunk) is -inf, which never wins over a real entry.
    NaN counts as +inf (jnp.argmax takes the first NaN even after a +inf; a row with either is
    broken, and both pick one of its non-finite entries)."""
    S, V = x.shape
    C = ARGMAX_CHUNK
    if V <= 2 * C:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    if V % C:
        x = jnp.pad(x, ((0, 0), (0, C - V % C)), constant_values=-jnp.inf)
    xc = x.reshape(S, -1, C)
    # XLA:CPU's max may skip NaN; a chunk's sum is NaN if it holds a NaN (or both infinities,
    # when its maximum is +inf anyway): one cheap pass instead of an isnan over every entry
    top = jnp.where(jnp.isnan(xc.sum(-1)), jnp.inf, xc.max(-1))
    chunk = jnp.argmax(top, axis=-1)
    inside = jnp.take_along_axis(xc, chunk[:, None, None], axis=1)[:, 0]
    inside = jnp.where(jnp.isnan(inside), jnp.inf, inside)
    return (chunk * C + jnp.argmax(inside, axis=-1)).astype(jnp.int32)


def gumbel_rows(seeds: jax.Array, gen_index: jax.Array, V: int) -> jax.Array:
    """Gumbel noise [S, V], row r from (seeds[r], gen_index[r]): a 32-bit word per row from
    JAX's threefry key fold_in(key(seed), index), then one per entry as SplitMix does, the
    word plus the entry's index times the golden ratio through murmur3's finaliser (a
    bijection that mixes every bit). threefry itself for every entry would take most of a
    sampling step on XLA:CPU."""
    word = jax.vmap(lambda s, i: jax.random.bits(jax.random.fold_in(jax.random.key(s), i), (),
                                                 jnp.uint32))(seeds, gen_index)
    x = word[:, None] + jnp.arange(V, dtype=jnp.uint32)[None, :] * jnp.uint32(0x9E3779B9)
    x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
    x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
    x = x ^ (x >> 16)
    u = (x >> 8).astype(jnp.float32) * (2.0 ** -24) + 2.0 ** -25  # (0, 1), 24 bits
    return -jnp.log(-jnp.log(u))


@jax.tree_util.register_dataclass
@dataclass
class SamplingMetadata:
    temperature: jax.Array         # [S] f32, < GREEDY_EPS = greedy
    top_k: jax.Array               # [S] i32, 0 = off
    top_p: jax.Array               # [S] f32
    min_p: jax.Array               # [S] f32
    seeds: jax.Array               # [S] u32
    gen_index: jax.Array           # [S] i32 output tokens so far
    rows: jax.Array                # [S] i32 persistent-batch row (padded rows: the spare row)
    is_final: jax.Array            # [S] bool: the row samples its next token this step
    repetition_penalty: jax.Array  # [S] f32
    frequency_penalty: jax.Array   # [S] f32
    presence_penalty: jax.Array    # [S] f32
    min_tokens: jax.Array          # [S] i32
    has_bias: jax.Array            # [S] bool: the row's bias row applies
    banned: jax.Array              # [S, MAX_BANNED] i32, -1 = none
    next_ids: jax.Array            # [T] i32 the prompt token after each token (prompt logprobs)
    any_random: jax.Array          # [] bool
    any_filter: jax.Array          # [] bool: some random row uses top-k, top-p or min-p
    any_penalty: jax.Array         # [] bool
    any_bias: jax.Array            # [] bool
    any_min_tokens: jax.Array      # [] bool
    any_banned: jax.Array          # [] bool
    any_logprobs: jax.Array        # [] bool
    any_prompt_logprobs: jax.Array  # [] bool


@jax.tree_util.register_dataclass
@dataclass
class SamplerState:
    out_counts: jax.Array   # [R+1, V] i32 output-token counts
    prompt_mask: jax.Array  # [R+1, V] bool tokens of the prompt
    bias: jax.Array         # [R+1, V] f32 logit bias, -inf outside allowed_token_ids / on bad words
    stop_mask: jax.Array    # [R+1, V] bool EOS and stop ids, masked until min_tokens
    last_token: jax.Array   # [R+1] i32 each row's last sampled token: the next step's input
                            # while the host does not know it yet (async scheduling)


@jax.tree_util.register_dataclass
@dataclass
class SamplerOutput:
    tokens: jax.Array          # [S] i32
    logprobs: jax.Array        # [S] f32 raw logprob of the sampled token
    ranks: jax.Array           # [S] i32 its rank (1 = most likely)
    top_ids: jax.Array         # [S, MAX_LOGPROBS] i32
    top_logprobs: jax.Array    # [S, MAX_LOGPROBS] f32
    prompt_logprobs: jax.Array  # [T] f32 logprob of the next prompt token
    prompt_ranks: jax.Array    # [T] i32
    prompt_top_ids: jax.Array  # [T, MAX_LOGPROBS] i32
    prompt_top_logprobs: jax.Array  # [T, MAX_LOGPROBS] f32


def init_state(rows: int, vocab: int) -> SamplerState:
    return SamplerState(jnp.zeros((rows + 1, vocab), jnp.int32),
                        jnp.zeros((rows + 1, vocab), jnp.bool_),
                        jnp.zeros((rows + 1, vocab), jnp.float32),
                        jnp.zeros((rows + 1, vocab), jnp.bool_),
                        jnp.zeros(rows + 1, jnp.int32))


def set_rows(state: SamplerState, rows, tokens, num_prompt, num_tokens, bias, stop_mask) -> SamplerState:
    """Rebuild rows for requests entering the batch. tokens: [K, L] (prompt then outputs),
    bias: [K, V], stop_mask: [K, V]. Rows = the spare row for padding."""
    K, L = tokens.shape
    pos = jnp.arange(L)[None, :]
    r = jnp.broadcast_to(rows[:, None], (K, L))
    is_prompt = pos < num_prompt[:, None]
    is_output = (pos >= num_prompt[:, None]) & (pos < num_tokens[:, None])
    V = state.out_counts.shape[1]
    counts = state.out_counts.at[rows].set(0).at[r, tokens].add(is_output.astype(jnp.int32))
    in_prompt = jnp.where(is_prompt, tokens, V)  # out of range: dropped
    pmask = state.prompt_mask.at[rows].set(False).at[r, in_prompt].set(True, mode="drop")
    return SamplerState(counts, pmask, state.bias.at[rows].set(bias),
                        state.stop_mask.at[rows].set(stop_mask), state.last_token)


def apply_penalties(logits, counts, prompt_mask, rep, freq, pres):
    """vLLM's definitions: repetition divides positive / multiplies negative logits of tokens
    seen in the prompt or the output; frequency subtracts per output occurrence; presence
    subtracts once for any output occurrence."""
    out_mask = counts > 0
    r = jnp.where(out_mask | prompt_mask, rep[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / r, logits * r)
    return logits - freq[:, None] * counts - pres[:, None] * out_mask


FILTER_CANDIDATES = (64, 1024)  # the largest logits tried before a full sort, in turn


def filter_logits(logits, top_k, top_p, min_p):
    """min_p, then top-k, then top-p over what is left (renormalised); masked to -inf.

    Every filter keeps a prefix of the row in descending order, so the kept set ends at the
    row's n-th largest logit. On XLA:CPU a full sort of the rows costs far more than taking the
    64 largest: the candidates decide a row when its kept prefix ends among them (what lies
    beyond enters only through the softmax's normaliser and min_p's mass, both taken over the
    whole row); otherwise 1,024 candidates are tried, then the full sort."""
    S, V = logits.shape
    k_eff = jnp.where(top_k <= 0, V, jnp.minimum(top_k, V))
    active = (top_k > 0) | (top_p < 1.0) | (min_p > 0.0)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - lse)
    in_min_p = p >= min_p[:, None] * jnp.max(p, axis=-1, keepdims=True)
    n_min_p = jnp.sum(in_min_p, axis=-1)
    mass_min_p = jnp.sum(jnp.where(in_min_p, p, 0.0), axis=-1)

    def masked(threshold):
        return jnp.where(logits < threshold[:, None], _NEG_INF, logits)

    def from_candidates(K, fallback):
        def run(logits):
            desc, _ = jax.lax.top_k(logits, K)
            n_set = jnp.minimum(k_eff, n_min_p)  # min_p's and top-k's prefix
            kept = jnp.where(jnp.arange(K)[None, :] < n_set[:, None], jnp.exp(desc - lse), 0.0)
            # top-k cuts min_p's set: its mass is the candidates' when it ends among them
            mass = jnp.where(k_eff >= n_min_p, mass_min_p, kept.sum(-1))
            kept = kept / mass[:, None]
            n_top_p = jnp.sum((jnp.cumsum(kept, axis=-1) - kept) < top_p[:, None], axis=-1)
            n_top_p = jnp.where(n_top_p < K, n_top_p, V)  # the prefix goes on past K
            n_keep = jnp.maximum(jnp.minimum(n_set, n_top_p), 1)
            decided = ~active | ((n_keep <= K) & ((k_eff >= n_min_p) | (k_eff <= K)))
            last = jnp.minimum(n_keep, K)[:, None] - 1
            threshold = jnp.where(active, jnp.take_along_axis(desc, last, axis=-1)[:, 0], _NEG_INF)
            if K == V:
                return masked(threshold)
            return jax.lax.cond(jnp.all(decided), lambda x: masked(threshold), fallback, logits)
        return run

    path = lambda x: _filter_sorted(x, top_k, top_p, min_p)  # noqa: E731
    for K in sorted({min(c, V) for c in FILTER_CANDIDATES}, reverse=True):
        path = from_candidates(K, path)
    return path(logits)


def _filter_sorted(logits, top_k, top_p, min_p):
    """filter_logits by a full sort of each row."""
    V = logits.shape[-1]
    desc = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(desc, axis=-1)
    keep = probs >= min_p[:, None] * probs[:, :1]
    k = jnp.where(top_k <= 0, V, jnp.minimum(top_k, V))
    keep &= jnp.arange(V)[None, :] < k[:, None]
    kept = jnp.where(keep, probs, 0.0)
    kept = kept / kept.sum(-1, keepdims=True)
    # the smallest prefix whose mass reaches top_p (the first token always stays)
    keep &= (jnp.cumsum(kept, axis=-1) - kept) < top_p[:, None]
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
    # a row without filters keeps every token (the cumulative sum may pass 1 before its tail)
    active = (top_k > 0) | (top_p < 1.0) | (min_p > 0.0)
    return jnp.where(active[:, None] & (logits < threshold), _NEG_INF, logits)


def _logprob_stats(logprobs, chosen):
    """(logprob of chosen, its rank, top-MAX_LOGPROBS ids and logprobs) per row."""
    lp = jnp.take_along_axis(logprobs, chosen[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(logprobs > lp[:, None], axis=-1).astype(jnp.int32)
    k = min(MAX_LOGPROBS, logprobs.shape[-1])
    top_lp, top_ids = jax.lax.top_k(logprobs, k)
    return lp, rank, top_ids.astype(jnp.int32), top_lp


def flag_non_finite(logits, tokens):
    """-1 for the rows whose chosen logit is NaN or +inf (argmax picks such an entry whenever
    a row has one): the host fails those requests alone."""
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return jnp.where(jnp.isnan(chosen) | (chosen == jnp.inf), -1, tokens)


def process_logits(logits, md: SamplingMetadata, state: SamplerState):
    """Everything that changes logits before temperature: masks, bias, penalties."""
    S, V = logits.shape
    rows = md.rows

    def bias(x):
        return x + jnp.where(md.has_bias[:, None], state.bias[rows], 0.0)

    def banned(x):
        idx = jnp.where(md.banned < 0, V, md.banned)  # out of range: dropped
        return x.at[jnp.arange(S)[:, None], idx].set(_NEG_INF, mode="drop")

    def min_tokens(x):
        active = (md.gen_index < md.min_tokens)[:, None]
        return jnp.where(active & state.stop_mask[rows], _NEG_INF, x)

    def penalties(x):
        return apply_penalties(x, state.out_counts[rows], state.prompt_mask[rows],
                               md.repetition_penalty, md.frequency_penalty, md.presence_penalty)

    for flag, fn in ((md.any_bias, bias), (md.any_banned, banned),
                     (md.any_min_tokens, min_tokens), (md.any_penalty, penalties)):
        logits = jax.lax.cond(flag, fn, lambda x: x, logits)
    return logits


def apply_bitmask(logits, bitmask):
    """Structured outputs: tokens whose bit is clear in the row's packed bitmask ([S, W] int32,
    token t is bit t % 32 of word t // 32) cannot be sampled."""
    S, V = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(S, -1)[:, :V] != 0
    return jnp.where(allowed, logits, _NEG_INF)


def sample(logits: jax.Array, md: SamplingMetadata, state: SamplerState, bitmask=None,
           use_mask=None):
    """logits: [S, V] f32 raw -> (tokens and logprobs, updated state). A grammar's bitmask
    (when `use_mask`) applies first, as in vLLM: logprobs are those of the allowed tokens."""
    S, V = logits.shape
    k = min(MAX_LOGPROBS, V)
    zeros = (jnp.zeros(S, jnp.float32), jnp.zeros(S, jnp.int32), jnp.zeros((S, k), jnp.int32),
             jnp.zeros((S, k), jnp.float32))
    # A greedy batch with nothing else to apply takes only the argmax: on XLA:CPU each cond
    # below hands back a fresh copy of the [S, V] logits even from an identity branch, into
    # temporaries that are new pages every step
    plain = ~(md.any_random | md.any_penalty | md.any_bias | md.any_min_tokens | md.any_banned
              | md.any_logprobs)
    if bitmask is not None:
        plain = plain & ~use_mask

    def general(logits):
        if bitmask is not None:
            logits = jax.lax.cond(use_mask, apply_bitmask, lambda x, _: x, logits, bitmask)
        raw = logits
        logits = process_logits(logits, md, state)
        greedy_mask = md.temperature < GREEDY_EPS
        greedy = argmax(logits)

        def random_tokens(logits):
            temp = jnp.where(greedy_mask, 1.0, md.temperature)
            scaled = logits / temp[:, None]
            scaled = jax.lax.cond(md.any_filter, filter_logits, lambda x, *_: x, scaled,
                                  md.top_k, md.top_p, md.min_p)
            return argmax(scaled + gumbel_rows(md.seeds, md.gen_index, V))

        sampled = jax.lax.cond(md.any_random, random_tokens, lambda _: greedy, logits)
        tokens = jnp.where(greedy_mask, greedy, sampled)

        def stats(raw):
            return _logprob_stats(jax.nn.log_softmax(raw, axis=-1), tokens)
        return (tokens, *jax.lax.cond(md.any_logprobs, stats, lambda _: zeros, raw))

    tokens, lp, rank, top_ids, top_lp = jax.lax.cond(
        plain, lambda x: (argmax(x), *zeros), general, logits)
    counts = state.out_counts.at[md.rows, tokens].add(md.is_final.astype(jnp.int32))
    spare = state.last_token.shape[0] - 1
    last = state.last_token.at[jnp.where(md.is_final, md.rows, spare)].set(tokens)
    state = SamplerState(counts, state.prompt_mask, state.bias, state.stop_mask, last)
    return (tokens, lp, rank, top_ids, top_lp), state


def prompt_logprobs(compute_logits, hidden: jax.Array, next_ids: jax.Array, num_real: jax.Array,
                    vocab: int):
    """Raw logprob (and rank, top ids) of each token's next prompt token, in chunks of tokens
    so that the [tokens, vocab] logits never exist at once; chunks past the real tokens are
    skipped. The chunks are a scan of a fixed length with each top-k its own output: in a
    while loop that carries the results, XLA:CPU peels the first iteration and turns its top-k
    into a full sort of the vocabulary."""
    T = hidden.shape[0]
    C = min(T, PROMPT_LP_CHUNK)
    n = -(-T // C)
    k = min(MAX_LOGPROBS, vocab)
    pad = n * C - T
    hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(n, C, hidden.shape[-1])
    next_ids = jnp.pad(next_ids, (0, pad)).reshape(n, C)
    empty = (jnp.zeros(C, jnp.float32), jnp.zeros(C, jnp.int32), jnp.zeros((C, k), jnp.int32),
             jnp.zeros((C, k), jnp.float32))

    def stats(h, nxt):
        logp = jax.nn.log_softmax(compute_logits(h), axis=-1)
        return _logprob_stats(logp, jnp.maximum(nxt, 0))

    def chunk(_, x):
        i, h, nxt = x
        return None, jax.lax.cond(i * C < num_real, stats, lambda *_: empty, h, nxt)

    if n == 1:
        out = stats(hidden[0], next_ids[0])
    else:
        _, out = jax.lax.scan(chunk, None, (jnp.arange(n), hidden, next_ids))
        out = tuple(a.reshape((n * C,) + a.shape[2:])[:T] for a in out)
    return out
