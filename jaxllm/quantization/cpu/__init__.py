"""The CPU quantized matmuls (kernels.cc): built on first use with the machine's C++
compiler against the FFI headers jaxlib ships, cached by source, jaxlib version and CPU, and
registered with XLA as custom calls.

Why a kernel of our own: XLA:CPU dots need materialized operands, so a quantized weight is
first written out whole in float (measured: 10x slower than the float dot at one row on this
project's CPU), and a dot on a slice of the layer stack copies the slice first. These kernels
read the packed codes of the wanted layer in place. Without a compiler (or with
JAXLLM_CPU_KERNELS=0) the engine runs the XLA path and says so once.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from math import prod

import jax
import jax.numpy as jnp

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(__file__), "kernels.cc")
CACHE = os.environ.get("JAXLLM_KERNEL_CACHE_DIR", os.path.expanduser("~/.cache/jaxllm/kernels"))
TARGETS = {"jaxllm_qmm": "JaxllmQmm", "jaxllm_qmm_sym": "JaxllmQmmSym",
           "jaxllm_qmm_q8": "JaxllmQmmQ8", "jaxllm_qmm_q8_sym": "JaxllmQmmQ8Sym",
           "jaxllm_w8a8": "JaxllmW8A8", "jaxllm_w8a8_smooth": "JaxllmW8A8Smooth",
           "jaxllm_qmm_sym_bf16": "JaxllmQmmSymBf16",
           "jaxllm_fp8": "JaxllmFp8",
           "jaxllm_bf16_in_out": "JaxllmBf16InOut", "jaxllm_bf16_out_in": "JaxllmBf16OutIn",
           "jaxllm_bf16_panels": "JaxllmBf16Panels",
           "jaxllm_w8a8_panels": "JaxllmW8A8Panels",
           "jaxllm_w8a8_panels_smooth": "JaxllmW8A8PanelsSmooth",
           "jaxllm_decode_attention": "JaxllmDecodeAttention",
           "jaxllm_prefill_attention": "JaxllmPrefillAttention"}

_lock = threading.Lock()
_state: dict = {}


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build() -> str:
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    with open(SOURCE, "rb") as f:
        src = f.read()
    key = hashlib.sha256(src + jax.__version__.encode() + cxx.encode()
                         + _cpu_signature().encode()).hexdigest()[:16]
    lib = os.path.join(CACHE, f"kernels-{key}.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(CACHE, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=CACHE)
    os.close(fd)
    cmd = [cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w",
           "-I", jax.ffi.include_dir(), SOURCE, "-o", tmp]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, lib)  # atomic: a concurrent build of the same key is harmless
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def available() -> bool:
    """Build (once) and register the kernels; False, with one warning, if that is not
    possible here."""
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        if os.environ.get("JAXLLM_CPU_KERNELS", "1") == "0":
            _state["ok"] = False
            return False
        try:
            lib = ctypes.cdll.LoadLibrary(_build())
            for target, symbol in TARGETS.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                            platform="cpu")
            _state["lib"] = lib
            _state["ok"] = True
        except (OSError, RuntimeError, AttributeError) as e:
            logger.warning("CPU quantized kernels unavailable (%s); quantized weights run "
                           "through XLA's dots, which dequantize them first (slower)", e)
            _state["ok"] = False
        return _state["ok"]


def amx() -> bool:
    """Whether the packed kernels multiply on AMX's tiles (Intel's matrix unit) here: the CPU
    has it, Linux grants it, and JAXLLM_CPU_AMX is not 0; otherwise AVX-512 runs them."""
    return available() and bool(_state["lib"].JaxllmAmx())


PANEL = 48  # columns of a packed panel (kernels.cc kPanel)


def panels_apply(w) -> bool:
    """Whether a bf16 layer stack [L, K, N] is kept as packed panels (`to_panels`): the
    kernels are here and have AVX512-BF16, K is a multiple of 32 and N of 48."""
    if w.ndim != 3 or jnp.dtype(w.dtype) != jnp.bfloat16 or w.shape[1] % 32 or w.shape[2] % PANEL:
        return False
    return available() and bool(_state["lib"].JaxllmBf16PanelsBuilt())


@jax.jit
def to_panels(w: jax.Array) -> jax.Array:
    """bf16 [L, K, N] -> uint32 [L, N / 48, K / 2, 48]: for each 48-column panel, each pair of
    k of each column as one word (low half k even), the panel's words contiguous: the order
    the kernels multiply in (kernels.cc Bf16Panels), made once at load."""
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
    panels run. Packed per call, the head cost 4-6% of a 64-sequence decode step of the default
    model's shapes and a larger share at a 128k vocabulary."""
    if w.ndim != 2 or jnp.dtype(w.dtype) != jnp.bfloat16:
        return False
    E, V = w.shape[::-1] if out_major else w.shape
    if E % 32 or V % PANEL:
        return False
    return available() and bool(_state["lib"].JaxllmBf16PanelsBuilt())


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
    return available() and bool(_state["lib"].JaxllmI8PanelsBuilt())


@jax.jit
def to_i8_panels(q: jax.Array) -> jax.Array:
    """int8 codes [L, N, K] -> int32 [L, N / 48, K / 4 + 1, 48]: for each 48-column panel, each
    column's 4 consecutive k as one word (the order VNNI and AMX multiply in, kernels.cc
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


def fp8_apply(w) -> bool:
    """Whether an fp8 QWeight (e4m3 codes, per-channel scales, e4m3 activations) runs in the
    kernels: they are here and have AVX512-BF16 (the operands multiply as bf16), K is a
    multiple of 32 and N of 16; otherwise XLA emulates the fp8 dot."""
    if (w.kind != "fp8" or w.act != "fp8" or w.in_features % 32 or w.out_features % 16
            or w.smooth is not None):
        return False
    return available() and bool(_state["lib"].JaxllmBf16PanelsBuilt())


def prepare_async() -> threading.Thread:
    """Start building the kernels in the background (the first build takes seconds)."""
    t = threading.Thread(target=available, daemon=True)
    t.start()
    return t


def _index(layer, rows) -> jax.Array:
    """The kernels' int32 index operand: [layer, rows], rows = how many leading rows of x are
    real (None: all of them)."""
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32)
    if rows is None:
        return layer
    return jnp.stack([layer, jnp.asarray(rows, jnp.int32)])


def matmul(x: jax.Array, w, rows=None, bf16_activations: bool = False) -> jax.Array:
    """x [.., K] @ W^T -> [.., N] f32 through the kernels; w is a QWeight. rows: only the first
    `rows` rows of x (flattened) are real, the others are padding: their outputs are zeros.
    bf16_activations: x holds bf16 values (the caller rounded it) and w is per-channel int8
    (QWeight.per_channel_int8): from 16 rows (4 on AMX) they multiply as bf16 pairs."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K).astype(jnp.float32)
    stack = (lambda a: a) if w.layer is not None else (lambda a: None if a is None else a[None])
    q, scale, offset, smooth = stack(w.q), stack(w.scale), stack(w.offset), stack(w.smooth)
    layer = _index(w.layer, rows)
    N = w.out_features
    out = jax.ShapeDtypeStruct((x2.shape[0], N), jnp.float32)
    if w.panels:
        if smooth is not None:
            y = jax.ffi.ffi_call("jaxllm_w8a8_panels_smooth", out)(x2, q, scale, smooth, layer)
        else:
            y = jax.ffi.ffi_call("jaxllm_w8a8_panels", out)(x2, q, scale, layer)
    elif w.kind == "fp8":
        y = jax.ffi.ffi_call("jaxllm_fp8", out)(x2, q, scale, layer)
    elif w.act == "int8":
        if smooth is not None:
            y = jax.ffi.ffi_call("jaxllm_w8a8_smooth", out)(x2, q, scale, smooth, layer)
        else:
            y = jax.ffi.ffi_call("jaxllm_w8a8", out)(x2, q, scale, layer)
    else:
        name = "jaxllm_qmm_q8" if w.act == "int8_block" else "jaxllm_qmm"
        if offset is not None:
            y = jax.ffi.ffi_call(name, out)(x2, q, scale, offset, layer)
        elif bf16_activations:
            y = jax.ffi.ffi_call("jaxllm_qmm_sym_bf16", out)(x2, q, scale, layer)
        else:
            y = jax.ffi.ffi_call(name + "_sym", out)(x2, q, scale, layer)
    return y.reshape(*lead, N)


def dense_bf16(x: jax.Array, w: jax.Array, layer=None, out_major: bool = False,
               rows=None, panels: bool = False) -> jax.Array:
    """x [.., K] @ a bf16 matrix -> [.., N] f32, widening the weights in registers. w: a stack
    [L, K, N] read at `layer` in place (no slice copied), or one matrix [K, N]; out_major: the
    matrix is [N, K] (a tied embedding table as the head); panels: w is a stack made by
    `to_panels`; rows: as in `matmul`."""
    lead, K = x.shape[:-1], x.shape[-1]
    if panels:
        out = jax.ShapeDtypeStruct((prod(lead), w.shape[1] * PANEL), jnp.float32)
        y = jax.ffi.ffi_call("jaxllm_bf16_panels", out)(x.reshape(-1, K).astype(jnp.float32), w,
                                                       _index(layer, rows))
        return y.reshape(*lead, out.shape[1])
    w3 = w if layer is not None else w[None]
    N = w3.shape[1] if out_major else w3.shape[2]
    out = jax.ShapeDtypeStruct((prod(lead), N), jnp.float32)
    target = "jaxllm_bf16_out_in" if out_major else "jaxllm_bf16_in_out"
    y = jax.ffi.ffi_call(target, out)(x.reshape(-1, K).astype(jnp.float32), w3, _index(layer, rows))
    return y.reshape(*lead, N)


def _cache_operands(cache) -> tuple[jax.Array, jax.Array]:
    """The attention kernels' cache operands: the values and their scales (a QuantizedKV's
    int8 / fp8 data and f32 scales; for a float cache a placeholder the kernels do not read)."""
    from jaxllm.quantization import kv as kvq
    if isinstance(cache, kvq.QuantizedKV):
        return cache.data, cache.scale
    return cache, jnp.zeros((1,), jnp.float32)


def decode_attention(qg: jax.Array, cache, layer, block_tables: jax.Array,
                     seq_lens: jax.Array, lo: jax.Array, block_size: int,
                     soft_cap: float | None) -> jax.Array:
    """Each sequence's last token (qg [S, KVH, G, D] f32, scaled) against its cached context
    positions [lo, seq_len), read in place from the paged cache [L, 2, KVH, slots, D] (f32,
    bf16 bits, or a QuantizedKV of int8 / fp8): [S, KVH, G, D] f32, as
    attention._decode_pass."""
    import numpy as np
    if not available():
        raise RuntimeError("the CPU kernels are not available here (see the warning)")
    out = jax.ShapeDtypeStruct(qg.shape, jnp.float32)
    return jax.ffi.ffi_call("jaxllm_decode_attention", out)(
        qg.astype(jnp.float32), *_cache_operands(cache), jnp.asarray(layer, jnp.int32),
        block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32), lo.astype(jnp.int32),
        block_size=np.int64(block_size), soft_cap=np.float32(soft_cap or 0.0))


def prefill_attention(qg: jax.Array, cache, layer, md, window: int | None,
                      soft_cap: float | None) -> jax.Array:
    """The tokens of the step's prefill tiles (md.tile_seq / tile_start / num_tiles, q_tile
    tokens each; qg [T, KVH, G, D] f32, scaled) against their causal context, read in place
    from the paged cache: [T, KVH, G, D] f32, zeros for tokens in no tile (as
    attention._prefill_pass)."""
    import numpy as np
    if not available():
        raise RuntimeError("the CPU kernels are not available here (see the warning)")
    out = jax.ShapeDtypeStruct(qg.shape, jnp.float32)
    i32 = (lambda a: jnp.asarray(a, jnp.int32))
    return jax.ffi.ffi_call("jaxllm_prefill_attention", out)(
        qg.astype(jnp.float32), *_cache_operands(cache), i32(layer), i32(md.block_tables),
        i32(md.positions),
        i32(md.query_start_loc), i32(md.tile_seq), i32(md.tile_start), i32(md.num_tiles),
        block_size=np.int64(md.block_size), q_tile=np.int64(md.q_tile),
        window=np.int64(window or 0), soft_cap=np.float32(soft_cap or 0.0))
