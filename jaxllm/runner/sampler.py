"""On-device sampling inside the jitted step: greedy, temperature, top-k, top-p, min-p.

Every row draws from its own key, fold_in(key(seed), index of the token being generated),
so a seeded request yields the same tokens whatever else shares its batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

_GREEDY_EPS = 1e-5


@jax.tree_util.register_dataclass
@dataclass
class SamplingMetadata:
    temperature: jax.Array  # [S] f32, 0 = greedy
    top_k: jax.Array        # [S] i32, 0 = off
    top_p: jax.Array        # [S] f32
    min_p: jax.Array        # [S] f32
    seeds: jax.Array        # [S] u32
    gen_index: jax.Array    # [S] i32


def _filter(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    V = logits.shape[-1]
    desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(md.top_k <= 0, V, jnp.minimum(md.top_k, V))
    ranks = jnp.arange(V)[None, :]
    desc = jnp.where(ranks < k[:, None], desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < md.top_p[:, None]
    keep &= probs >= md.min_p[:, None] * probs[:, :1]
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def sample(logits: jax.Array, md: SamplingMetadata) -> jax.Array:
    """logits: [S, V] f32 -> token ids [S] i32."""
    greedy_mask = md.temperature < _GREEDY_EPS
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def random_tokens():
        temp = jnp.where(greedy_mask, 1.0, md.temperature)
        scaled = _filter(logits / temp[:, None], md)
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(md.seeds, md.gen_index)
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], jnp.float32))(keys)
        return jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)

    # an all-greedy batch skips the sort entirely
    sampled = jax.lax.cond(jnp.all(greedy_mask), lambda: greedy, random_tokens)
    return jnp.where(greedy_mask, greedy, sampled)
