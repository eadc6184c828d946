"""Grouped matmul as a Pallas kernel (a mixture of experts' projections on a GPU): rows of x
sorted into groups, each group times its own matrix of w [G, K, N].

XLA's GPU compiler rewrites `jax.lax.ragged_dot` into one dense dot over every group (the
rows expanded G-fold and masked: G times the FLOPs), so the GPU path is this kernel. Each
group's rows are first laid out padded to whole tiles of `block_m` rows (gathered outside the
kernel: a tile then belongs to one group), and each program multiplies one tile by one
`block_n`-column panel of its group's matrix, walking K `block_k` at a time. Tiles past the
last group's are skipped (zeros). A group's weights are read once per tile of its rows, an
unused group's not at all. Portable Pallas: it lowers through Triton and runs in interpret
mode on a CPU (tests).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def _pow2_divisor(n: int, most: int) -> int:
    """The largest power of two <= most that divides n (0 if below 16)."""
    b = most
    while b >= 16 and n % b:
        b //= 2
    return b if b >= 16 else 0


def supports(K: int, N: int) -> bool:
    """Whether the kernel tiles [K, N] matrices (power-of-two tiles of at least 16)."""
    return bool(_pow2_divisor(K, 16) and _pow2_divisor(N, 16))


def _kernel(tile_group_ref, x_ref, w_ref, y_ref, *, steps: int, bk: int, prec):
    g = tile_group_ref[pl.program_id(0)]
    bm, bn = y_ref.shape

    @pl.when(g >= 0)
    def _():
        def body(k, acc):
            cols = pl.ds(k * bk, bk)
            return acc + jax.lax.dot_general(x_ref[:, cols], w_ref[g, cols, :],
                                             (((1,), (0,)), ((), ())), precision=prec,
                                             preferred_element_type=jnp.float32)
        y_ref[...] = jax.lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))

    @pl.when(g < 0)
    def _():
        y_ref[...] = jnp.zeros((bm, bn), jnp.float32)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, block_m: int = 16,
                   block_n: int = 128, block_k: int = 64, num_warps: int = 4,
                   interpret: bool = False) -> jax.Array:
    """x [M, K] (rows sorted by group; rows past the groups' sum are padding) times each
    group's w [G, K, N] -> [M, N] f32, padding rows zeros."""
    M, K = x.shape
    G, _, N = w.shape
    bm = block_m
    bn, bk = _pow2_divisor(N, block_n), _pow2_divisor(K, block_k)
    if not (bn and bk):
        raise ValueError(f"grouped matmul: K={K} and N={N} need power-of-two tiles of at least 16")
    sizes = group_sizes.astype(jnp.int32)
    padded = (sizes + bm - 1) // bm * bm
    ends, pends = jnp.cumsum(sizes), jnp.cumsum(padded)
    starts, pstarts = ends - sizes, pends - padded
    # every group padded to whole tiles: at most bm - 1 more rows per group
    tiles = -(-(M + G * (bm - 1)) // bm)
    P = tiles * bm
    slot = jnp.arange(P, dtype=jnp.int32)
    slot_group = jnp.searchsorted(pends, slot, side="right").astype(jnp.int32)  # G past the end
    g = jnp.minimum(slot_group, G - 1)
    within = slot - pstarts[g]
    real = (slot_group < G) & (within < sizes[g])
    src = jnp.where(real, starts[g] + within, 0)
    xp = jnp.where(real[:, None], x[src], 0).astype(x.dtype)
    tile_group = slot_group[::bm]
    tile_group = jnp.where(tile_group < G, tile_group, -1)
    prec = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    yp = pl.pallas_call(
        functools.partial(_kernel, steps=K // bk, bk=bk, prec=prec),
        grid=(tiles, N // bn),
        in_specs=[pl.BlockSpec((tiles,), lambda i, j: (0,)),
                  pl.BlockSpec((bm, K), lambda i, j: (i, 0)),
                  pl.BlockSpec((G, K, bn), lambda i, j: (0, 0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((P, N), jnp.float32),
        interpret=interpret,
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=3),
        name="jaxllm_grouped_matmul",
    )(tile_group, xp, w)
    # each row back from its padded slot
    row = jnp.arange(M, dtype=jnp.int32)
    row_group = jnp.minimum(jnp.searchsorted(ends, row, side="right").astype(jnp.int32), G - 1)
    at = pstarts[row_group] + row - starts[row_group]
    return jnp.where((row < ends[-1])[:, None], yp[jnp.clip(at, 0, P - 1)], 0.0)
