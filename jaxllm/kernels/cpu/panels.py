"""The packed weight layouts of the CPU kernels, known here only: bf16 layer stacks and the bf16
head as panels of 48 columns (`to_panels`, `to_head_panels`), w8a8 codes as VNNI panels
(`to_i8_panels`), packed once at load (`pack_state`) and unpacked for checkpoints; and
`DenseWeight`, the one type through which layers and models hand a bf16 matrix, packed or
not, to the kernels.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels.cpu import build

PANEL = 48  # columns of a packed panel (common.h kPanel)


def _built(probe: str) -> bool:
    lib = build.library()
    return lib is not None and bool(getattr(lib, probe)())


def bf16_panels_built() -> bool:
    """The kernels are here and have AVX512-BF16 (the bf16 panels and fp8 run)."""
    return _built("JaxllmBf16PanelsBuilt")


@jax.tree_util.register_dataclass
@dataclass
class DenseWeight:
    """A bf16 float matrix for the CPU kernel: a layer stack [L, K, N] with the index of the
    layer to use (read in place: XLA would copy a slice of the stack out first), or one
    matrix; out_major: [N, K] (a tied embedding table as the head); panels: packed at load
    (`to_panels`, `to_head_panels`)."""
    w: jax.Array
    layer: jax.Array | int | None = None
    out_major: bool = field(default=False, metadata=dict(static=True))
    panels: bool = field(default=False, metadata=dict(static=True))

    def at(self, layer) -> "DenseWeight":
        return DenseWeight(self.w, layer, self.out_major, self.panels)


def is_bf16_panels(w) -> bool:
    """A layer stack or a head packed by `to_panels` / `to_head_panels` (uint32, 4-d)."""
    return w.ndim == 4 and w.dtype == jnp.uint32


def is_i8_panels(q) -> bool:
    """w8a8 codes packed by `to_i8_panels` (int32, 4-d)."""
    return q.ndim == 4 and q.dtype == jnp.int32


def dense_weight(w, out_major: bool = False) -> DenseWeight:
    """The kernels' view of a bf16 matrix or stack as a model holds it, packed or not."""
    if is_bf16_panels(w):
        return DenseWeight(w, panels=True)
    return DenseWeight(w, out_major=out_major)


def panels_apply(w) -> bool:
    """Whether a bf16 layer stack [L, K, N] is kept as packed panels (`to_panels`): the
    kernels are here and have AVX512-BF16, K is a multiple of 32 and N of 48."""
    if w.ndim != 3 or jnp.dtype(w.dtype) != jnp.bfloat16 or w.shape[1] % 32 or w.shape[2] % PANEL:
        return False
    return _built("JaxllmBf16PanelsBuilt")


@jax.jit
def to_panels(w: jax.Array) -> jax.Array:
    """bf16 [L, K, N] -> uint32 [L, N / 48, K / 2, 48]: for each 48-column panel, each pair of
    k of each column as one word (low half k even), the panel's words contiguous: the order
    the kernels multiply in (dense.cc Bf16Panels), made once at load."""
    L, K, N = w.shape
    bits = jax.lax.bitcast_convert_type(w, jnp.uint16).astype(jnp.uint32).reshape(L, K // 2, 2, N)
    words = bits[:, :, 0] | (bits[:, :, 1] << 16)                      # [L, K/2, N]
    return words.reshape(L, K // 2, N // PANEL, PANEL).transpose(0, 2, 1, 3)


@jax.jit
def from_panels(p: jax.Array) -> jax.Array:
    """The inverse of `to_panels`: bf16 [L, K, N]."""
    L, P, KP, _ = p.shape
    words = p.transpose(0, 2, 1, 3).reshape(L, KP, P * PANEL)
    bits = jnp.stack([words & 0xFFFF, words >> 16], axis=2).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits.reshape(L, 2 * KP, P * PANEL), jnp.bfloat16)


def head_panels_apply(w, out_major: bool) -> bool:
    """Whether a bf16 head is kept as packed panels (`to_head_panels`): a tied embedding table
    [V, E] (out_major) or an LM head [E, V], E a multiple of 32 and V of 48, where the bf16
    panels run. Packed once because packing the head per call takes a visible share of a
    decode step, the larger the vocabulary the larger the share."""
    if w.ndim != 2 or jnp.dtype(w.dtype) != jnp.bfloat16:
        return False
    E, V = w.shape[::-1] if out_major else w.shape
    if E % 32 or V % PANEL:
        return False
    return _built("JaxllmBf16PanelsBuilt")


@jax.jit(static_argnums=1)
def to_head_panels(w: jax.Array, out_major: bool) -> jax.Array:
    """A head [V, E] (out_major) or [E, V] -> uint32 [1, V / 48, E / 2, 48]: `to_panels` of the
    [E, V] matrix as a stack of one, read by the bf16 panels kernel at layer 0."""
    return to_panels((w.T if out_major else w)[None])


@jax.jit(static_argnums=1)
def from_head_panels(p: jax.Array, out_major: bool) -> jax.Array:
    """The inverse of `to_head_panels`."""
    w = from_panels(p)[0]
    return w.T if out_major else w


def embed_from_panels(p: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows of a tied embedding table kept as head panels (`to_head_panels`), bf16 [T, E]:
    token t's row is column t % 48 of panel t // 48, its pairs of k in one word each."""
    words = p[0, ids // PANEL, :, ids % PANEL]                        # [T, E / 2]
    bits = jnp.stack([words & 0xFFFF, words >> 16], axis=-1).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits.reshape(*ids.shape, -1), jnp.bfloat16)


def i8_panels_apply(q) -> bool:
    """Whether a w8a8 layer stack's codes (int8 [L, N, K]) are kept as packed panels
    (`to_i8_panels`): the kernels are here and have AVX512-VNNI, K is a multiple of 4 and N of
    48 (AMX multiplies them where K is also a multiple of 64, as it does unpacked codes)."""
    if q.ndim != 3 or jnp.dtype(q.dtype) != jnp.int8 or q.shape[2] % 4 or q.shape[1] % PANEL:
        return False
    return _built("JaxllmI8PanelsBuilt")


@jax.jit
def to_i8_panels(q: jax.Array) -> jax.Array:
    """int8 codes [L, N, K] -> int32 [L, N / 48, K / 4 + 1, 48]: for each 48-column panel, each
    column's 4 consecutive k as one word (the order VNNI and AMX multiply in, quantized.cc
    W8A8Panels), then a row of the columns' sums (the kernels' correction for their unsigned
    activations); made once at load."""
    L, N, K = q.shape
    words = jax.lax.bitcast_convert_type(q.reshape(L, N, K // 4, 4), jnp.int32)  # [L, N, K/4]
    panels = words.reshape(L, N // PANEL, PANEL, K // 4).transpose(0, 1, 3, 2)
    sums = q.astype(jnp.int32).sum(-1).reshape(L, N // PANEL, 1, PANEL)
    return jnp.concatenate([panels, sums], axis=2)


@jax.jit
def from_i8_panels(p: jax.Array) -> jax.Array:
    """The inverse of `to_i8_panels`: int8 [L, N, K]."""
    L, P, KQ, _ = p.shape
    words = p[:, :, :KQ - 1].transpose(0, 1, 3, 2).reshape(L, P * PANEL, KQ - 1)
    return jax.lax.bitcast_convert_type(words, jnp.int8).reshape(L, P * PANEL, (KQ - 1) * 4)




def _param_name(path_keys) -> str:
    keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path_keys]
    if keys and keys[-1] == "value":
        keys = keys[:-1]
    return ".".join(keys)


def pack_state(state, pack: bool, dense: bool = True, quant=None):
    """A model state with its layer stacks packed as the kernels' panels where they apply
    (pack), or unpacked back: the loader packs once for the engine; a checkpoint is written
    unpacked. Packed: float stacks (`layers.<name>`, bf16 [L, K, N]) and the bf16 head (the
    LM head, or the embedding table where it is tied) when `dense`, and the codes of w8a8
    stacks in the CPU kernels (`layers.<name>.q`, int8 [L, N, K]) by `quant` (a QuantSpec)."""
    names = {_param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]}
    # the embedding table is the head too (a quantized head is lm_head.q, lm_head.scale, ...)
    tied = not any(n == "lm_head" or n.startswith("lm_head.") for n in names)

    def w8a8(prefix: str) -> bool:
        layout = None if quant is None or quant.backend != "cpu" else quant.get(prefix)
        return layout is not None and layout.act == "int8"

    def head(name: str, x):
        out_major = name == "embed_tokens"
        if out_major and not tied:  # a table read only by row stays as it is
            return x
        if pack:
            return to_head_panels(x, out_major) if dense and head_panels_apply(x, out_major) else x
        return from_head_panels(x, out_major) if x.ndim == 4 and x.dtype == np.uint32 else x

    def one(path, x):
        name = _param_name(path).split(".")
        if name in (["embed_tokens"], ["lm_head"]):
            return head(name[0], x)
        if name[0] != "layers" or len(name) not in (2, 3):
            return x
        if len(name) == 3:  # a quantized matrix's part
            if name[2] != "q":
                return x
            if pack:
                return to_i8_panels(x) if w8a8(".".join(name[:2])) and i8_panels_apply(x) else x
            return from_i8_panels(x) if x.ndim == 4 and x.dtype == np.int32 else x
        if pack:
            return to_panels(x) if dense and panels_apply(x) else x
        return from_panels(x) if x.ndim == 4 and x.dtype == np.uint32 else x
    return jax.tree_util.tree_map_with_path(one, state)
