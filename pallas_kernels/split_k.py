"""What both decode kernel families share: merging split-K partials."""
from __future__ import annotations

import jax.numpy as jnp


def combine_splits(o, m, l):
    """Split-K partials [splits, ..., rows(, D)] (unnormalised outputs, row maxima, row sums)
    merged by their log-sum-exp; an empty split (m very negative, l = 0) weighs nothing."""
    m_all = m.max(axis=0)
    w = jnp.exp(m - m_all[None])
    l_all = (l * w).sum(axis=0)
    return (o * w[..., None]).sum(axis=0) / jnp.maximum(l_all, 1e-30)[..., None]
