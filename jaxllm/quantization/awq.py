"""AWQ's activation-aware scaling (Lin et al., 2023) for online int4, searched at load.

Rounding to nearest in groups spends the same 16 levels on every input channel, but a few
channels carry much larger activations than the rest, and the error of their weights reaches
the output multiplied by them. AWQ scales input channel j of a matrix W [N, K] up before
quantizing, so those weights round relatively finer, and divides the activations by the
same factor at run time (a QWeight's `smooth` vector, as SmoothQuant's):

    s_j = mean|X_j|^alpha (normalised so that max(s) * min(s) = 1)
    W_q = Q(W * s) / s,  alpha = argmin over a grid in [0, 1) of ||X W_q^T - X W^T||^2

alpha = 0 is plain round-to-nearest (s = 1), so on the calibration rows the result is never
worse than it. Each layer's matrix gets its own alpha; fused q/k/v and gate/up read one input
and share one vector, searched on their joint output, as the paper scales them together.
The embedding and LM head are not scaled: int4 keeps them int8 (and the embedding is read
by rows, where no vector along its input could be divided out).

X comes from the float model, run at load over the same calibration text as SmoothQuant
(jaxllm.loader.calibration): mean |x| per channel over every calibration token, and the
error measured on SAMPLE_ROWS of them spread evenly over the chunks.

Cost at load: the calibration pass, then per layer and matrix GRID fake quantizations and
products of SAMPLE_ROWS rows, jitted (the products dominate: GRID * SAMPLE_ROWS * 2 flops per
weight), several times the load itself on a CPU; the AWQ line of the start-up log gives the
seconds (docs/quantization.md has the measured cost), and the search is why it is not the
default. No clipping search: the grid over alpha is the whole method.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

GRID = 20            # alphas i / GRID for i in 0..GRID-1, as AutoAWQ's n_grid
SAMPLE_ROWS = 128    # calibration rows the output error is measured on
EPS = 1e-4           # a channel that never fires keeps a finite, small scale


def _f16_round(x):
    """Round to the nearest float16 (kept as float32), as formats.quantize_int4 rounds its
    minimum and scale."""
    y = x.astype(jnp.float16).astype(jnp.float32)
    return jnp.where(jnp.isfinite(y), y, x)


def fake_int4(w: jax.Array, group: int) -> jax.Array:
    """W [N, K] through formats.quantize_int4 (asymmetric, groups along K) and back."""
    N, K = w.shape
    g = w.reshape(N, K // group, group)
    lo = _f16_round(g.min(-1))
    scale = _f16_round((g.max(-1) - lo) / 15.0)
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    codes = jnp.clip(jnp.round((g - lo[..., None]) * inv[..., None]), 0, 15)
    return (codes * scale[..., None] + lo[..., None]).reshape(N, K)


def scale_of(mean_abs, alpha):
    """s = mean|x|^alpha, normalised so that max(s) * min(s) = 1 (AutoAWQ's)."""
    s = jnp.maximum(mean_abs, EPS) ** alpha
    return s / jnp.sqrt(s.max() * s.min())


@partial(jax.jit, static_argnames="group")
def output_errors(w: jax.Array, x: jax.Array, mean_abs: jax.Array, group: int) -> jax.Array:
    """Mean squared output error of W [N, K] quantized with AWQ's scale at each alpha of the
    grid, on the rows x [R, K]: [GRID]."""
    ref = x @ w.T

    def one(alpha):
        s = scale_of(mean_abs, alpha)
        wq = fake_int4(w * s, group) / s
        return jnp.mean(jnp.square(x @ wq.T - ref))
    return jax.lax.map(one, jnp.arange(GRID, dtype=jnp.float32) / GRID)


def search(w: np.ndarray, x: np.ndarray, mean_abs: np.ndarray, group: int) -> tuple[np.ndarray, float, float]:
    """AWQ's vector for one matrix W [N, K] (out-major) given calibration rows x [R, K] and
    mean |x| per channel [K]: (s [K], alpha, error at alpha / error of round-to-nearest)."""
    err = np.asarray(output_errors(jnp.asarray(w, jnp.float32), jnp.asarray(x, jnp.float32),
                                   jnp.asarray(mean_abs, jnp.float32), group))
    best = int(np.argmin(err))
    alpha = best / GRID
    s = np.asarray(scale_of(jnp.asarray(mean_abs, jnp.float32), alpha), np.float32)
    return s, alpha, float(err[best] / err[0]) if err[0] > 0 else 1.0
