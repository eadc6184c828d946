"""Quantized weight formats on the host (numpy): our layouts, online quantization, and the
conversion of checkpoint formats (GGUF blocks, AWQ, GPTQ, compressed-tensors) into them
without dequantizing.

Our layouts are out-major, like the checkpoints: a matrix W of shape [N out, K in] is
  int4: `q` uint8 [N, K/2] holding 4-bit codes 0..15 in blocks of 32 along K (byte j of a
        block holds code j in its low nibble and code j + 16 in its high one, which is GGUF's
        Q4 layout), `scale` and `offset` [N, K/G]: W = code * scale + offset;
  int8: `q` int8 [N, K], `scale` [N, K/G] and an optional `offset` [N, K/G];
  fp8:  `q` float8_e4m3fn [N, K], `scale` [N, 1] (per output channel).
G is the group size along K (G = K: one scale per output channel). Stacked layers add a
leading axis. Scales and offsets are float16 where every one of them is exactly a float16
(GGUF's own d and m, our online quantizers' rounded ones), float32 otherwise: at groups of 32
they are a fifth of int4's bytes in float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

NIBBLE_BLOCK = 32  # int4 codes are packed in blocks of this many along K
FP8 = ml_dtypes.float8_e4m3fn
FP8_MAX = float(ml_dtypes.finfo(FP8).max)  # 448


@dataclass
class HostQuant:
    """One quantized matrix (or a stack of them) on the host, in our layout."""
    kind: str                  # "int4" | "int8" | "fp8"
    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None = None
    # SmoothQuant [.., K]: the codes hold W * smooth (per input channel) and activations are
    # divided by it at run time (jaxllm.quantization.smoothquant)
    smooth: np.ndarray | None = None

    def compact(self) -> "HostQuant":
        """The same weights with float16 scales and offsets where that is exact."""
        scale, offset = compact_scales(self.scale, self.offset, self.kind != "fp8")
        return HostQuant(self.kind, self.q, scale, offset, self.smooth)

    @property
    def group(self) -> int:
        return self.in_features // self.scale.shape[-1]

    @property
    def in_features(self) -> int:
        return self.q.shape[-1] * (2 if self.kind == "int4" else 1)

    @property
    def out_features(self) -> int:
        return self.q.shape[-2]

    def codes(self) -> np.ndarray:
        """The integer codes, one per weight ([.., N, K]; int4 unpacked)."""
        return unpack_int4(self.q) if self.kind == "int4" else self.q

    def dequantize(self) -> np.ndarray:
        """W [.., N, K] in float32 (the reference the tests hold every path to); a smoothed
        matrix divided back by its smoothing vector."""
        c = self.codes().astype(np.float32)
        g = self.group
        w = c.reshape(*c.shape[:-1], -1, g) * self.scale.astype(np.float32)[..., None]
        if self.offset is not None:
            w = w + self.offset.astype(np.float32)[..., None]
        w = w.reshape(c.shape)
        return w if self.smooth is None else w / self.smooth[..., None, :]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.q, self.scale, self.offset, self.smooth) if a is not None)


def compact_scales(scale, offset, allow_f16: bool = True):
    """float16 copies of scale and offset when both hold exactly, else float32."""
    arrs = [np.asarray(a, np.float32) for a in (scale, offset) if a is not None]
    if allow_f16 and all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in arrs):
        dt = np.float16
    else:
        dt = np.float32
    return np.asarray(scale).astype(dt), None if offset is None else np.asarray(offset).astype(dt)


def _f16_round(x: np.ndarray) -> np.ndarray:
    """Round to the nearest float16 (kept as float32), unless that overflows."""
    y = x.astype(np.float16).astype(np.float32)
    return np.where(np.isfinite(y), y, x).astype(np.float32)


# int4 packing
def pack_int4(codes: np.ndarray) -> np.ndarray:
    """uint8 codes 0..15 [.., K] -> packed bytes [.., K/2] (blocks of 32, GGUF's order)."""
    K = codes.shape[-1]
    if K % NIBBLE_BLOCK:
        raise ValueError(f"int4 needs the input size to be a multiple of {NIBBLE_BLOCK}, got {K}")
    c = codes.astype(np.uint8).reshape(*codes.shape[:-1], K // NIBBLE_BLOCK, 2, NIBBLE_BLOCK // 2)
    return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(*codes.shape[:-1], K // 2)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    half = packed.shape[-1]
    p = packed.reshape(*packed.shape[:-1], half * 2 // NIBBLE_BLOCK, 1, NIBBLE_BLOCK // 2)
    c = np.concatenate([p & 15, p >> 4], axis=-2)
    return c.reshape(*packed.shape[:-1], half * 2)


# online quantization of float weights [.., N, K]
def _groups(w: np.ndarray, group: int) -> np.ndarray:
    K = w.shape[-1]
    if K % group:
        raise ValueError(f"group size {group} does not divide the input size {K}")
    return w.reshape(*w.shape[:-1], K // group, group)


def quantize_int8(w: np.ndarray, group: int | None = None) -> HostQuant:
    """Symmetric int8, one scale per output channel (group=None) or per group along K."""
    w = np.asarray(w, np.float32)
    g = _groups(w, group or w.shape[-1])
    scale = _f16_round(np.abs(g).max(-1) / 127.0)
    inv = np.where(scale > 0, 1.0 / np.where(scale > 0, scale, 1.0), 0.0)
    q = np.clip(np.rint(g * inv[..., None]), -127, 127).astype(np.int8)
    return HostQuant("int8", q.reshape(w.shape), scale.astype(np.float32))


def quantize_int4(w: np.ndarray, group: int = 128) -> HostQuant:
    """Asymmetric int4 per group along K: W = code * scale + offset, codes 0..15."""
    w = np.asarray(w, np.float32)
    g = _groups(w, group)
    lo = _f16_round(g.min(-1))
    hi = g.max(-1)
    scale = _f16_round((hi - lo) / 15.0)
    inv = np.where(scale > 0, 1.0 / np.where(scale > 0, scale, 1.0), 0.0)
    codes = np.clip(np.rint((g - lo[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    return HostQuant("int4", pack_int4(codes.reshape(w.shape)), scale.astype(np.float32),
                     lo.astype(np.float32))


def quantize_fp8(w: np.ndarray) -> HostQuant:
    """e4m3 with one scale per output channel (amax maps to 448)."""
    w = np.asarray(w, np.float32)
    scale = np.abs(w).max(-1, keepdims=True) / FP8_MAX
    inv = np.where(scale > 0, 1.0 / np.where(scale > 0, scale, 1.0), 0.0)
    return HostQuant("fp8", (w * inv).astype(FP8), scale.astype(np.float32))


def int4_group(in_features: int, preferred: int = 128) -> int:
    """The largest of preferred, 64, 32 that divides the input size (int4 packs in 32s)."""
    for g in (preferred, 64, 32):
        if g <= preferred and in_features % g == 0:
            return g
    raise ValueError(f"int4 needs the input size to be a multiple of 32, got {in_features}")


# promotion: the parts of one fused parameter must share a layout
def as_int8(h: HostQuant) -> HostQuant:
    """int4 -> int8 with the same scale and offset (exact)."""
    if h.kind == "int8":
        return h
    if h.kind != "int4":
        raise ValueError(f"cannot convert {h.kind} to int8 exactly")
    return HostQuant("int8", h.codes().astype(np.int8), h.scale, h.offset)


def regroup(h: HostQuant, group: int) -> HostQuant:
    """The same weights with scales repeated down to a smaller group that divides the old one."""
    if h.group == group:
        return h
    if h.group % group:
        raise ValueError(f"group {group} does not divide group {h.group}")
    r = h.group // group
    off = None if h.offset is None else np.repeat(h.offset, r, axis=-1)
    return HostQuant(h.kind, h.q, np.repeat(h.scale, r, axis=-1), off)


def common_layout(parts: list[HostQuant]) -> list[HostQuant]:
    """Convert the segments of a fused parameter to one layout, exactly: int4 next to int8
    becomes int8, groups shrink to the smallest, a missing offset becomes zeros."""
    kinds = {p.kind for p in parts}
    if "fp8" in kinds and kinds != {"fp8"}:
        raise ValueError(f"cannot fuse fp8 weights with {sorted(kinds - {'fp8'})} ones")
    if len({p.scale.dtype for p in parts}) > 1:  # float16 next to float32: all float32
        parts = [HostQuant(p.kind, p.q, p.scale.astype(np.float32),
                           None if p.offset is None else p.offset.astype(np.float32)) for p in parts]
    if kinds == {"int4", "int8"}:
        parts = [as_int8(p) for p in parts]
    group = min(p.group for p in parts)
    parts = [regroup(p, group) for p in parts]
    if any(p.offset is not None for p in parts):
        parts = [p if p.offset is not None else
                 HostQuant(p.kind, p.q, p.scale, np.zeros_like(p.scale)) for p in parts]
    return parts


# GGUF blocks
def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[..., 0]


def _unit_scale_codes(raw: np.ndarray, qtype, header: dict[int, bytes]) -> np.ndarray:
    """The codes of a K-quant: its blocks with every scale set to one and every min to zero,
    dequantized by the gguf package (whose bit layouts are the reference); header maps a
    byte offset within the block to the bytes written there."""
    from gguf.quants import dequantize
    b = raw.copy()
    for off, val in header.items():
        b[..., off:off + len(val)] = np.frombuffer(val, np.uint8)
    return dequantize(b, qtype)


def from_gguf(raw: np.ndarray, qtype, shape: tuple[int, int]) -> HostQuant | None:
    """A GGUF tensor's raw blocks ([N, bytes per row]) -> our layout, or None for a type we
    keep in float. shape is (N, K)."""
    import gguf
    T = gguf.GGMLQuantizationType
    N, K = shape
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in (T.F32, T.F16, T.BF16):
        return None
    b = raw.reshape(N, K // block, size)
    if qtype == T.Q4_0:  # d, 16 bytes of codes: W = d * (code - 8)
        d = _f16(b[..., 0:2])
        return HostQuant("int4", b[..., 2:18].reshape(N, K // 2).copy(), d, -8.0 * d)
    if qtype == T.Q4_1:  # d, m, codes: W = d * code + m
        return HostQuant("int4", b[..., 4:20].reshape(N, K // 2).copy(), _f16(b[..., 0:2]),
                         _f16(b[..., 2:4]))
    if qtype == T.Q8_0:  # d, 32 int8
        return HostQuant("int8", b[..., 2:34].reshape(N, K).view(np.int8).copy(), _f16(b[..., 0:2]))
    one, zero = np.float16(1).tobytes(), np.float16(0).tobytes()
    if qtype in (T.Q5_0, T.Q5_1):  # 5-bit codes in blocks of 32
        codes = _unit_scale_codes(b, qtype, {0: one} if qtype == T.Q5_0 else {0: one, 2: zero})
        d = _f16(b[..., 0:2])
        if qtype == T.Q5_0:  # W = d * (code - 16), codes come back already centred
            return HostQuant("int8", codes.reshape(N, K).astype(np.int8), d)
        return HostQuant("int8", codes.reshape(N, K).astype(np.int8), d, _f16(b[..., 2:4]))
    if qtype in (T.Q4_K, T.Q5_K):
        # 256-weight super-blocks: d, dmin, 12 bytes of 6-bit scales and mins for 8 groups
        # of 32; W = d * sc * code - dmin * m
        from gguf.quants import Q4_K
        unit = bytes([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1])
        codes = _unit_scale_codes(b, qtype, {0: one, 2: zero, 4: unit}).reshape(N, K)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
        sc = sc.reshape(N, K // 256, 8).astype(np.float32)
        m = m.reshape(N, K // 256, 8).astype(np.float32)
        scale = (d[..., None] * sc).reshape(N, K // 32)
        offset = (-dmin[..., None] * m).reshape(N, K // 32)
        if qtype == T.Q4_K:
            return HostQuant("int4", pack_int4(codes.astype(np.uint8)), scale, offset)
        return HostQuant("int8", codes.astype(np.int8), scale, offset)
    if qtype == T.Q6_K:
        # ql 128, qh 64, 16 int8 scales, d: W = d * sc * (code - 32) in groups of 16
        scales = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
        codes = _unit_scale_codes(b, qtype, {192: bytes([1] * 16), 208: one}).reshape(N, K)
        d = _f16(b[..., 208:210])
        return HostQuant("int8", codes.astype(np.int8), (d[..., None] * scales).reshape(N, K // 16))
    raise ValueError(f"GGUF tensor type {T(qtype).name} is not supported; supported: F32, F16, "
                     "BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K")


# AWQ / GPTQ / compressed-tensors: int32 words holding eight 4-bit codes
def unpack_int32(words: np.ndarray, axis: int, order=tuple(range(8))) -> np.ndarray:
    """Eight 4-bit codes per int32 along `axis`; order[i] is the code position held by
    nibble i (AWQ interleaves them)."""
    w = np.moveaxis(words.astype(np.int64) & 0xFFFFFFFF, axis, -1)
    nib = np.stack([(w >> (4 * i)) & 15 for i in range(8)], axis=-1)  # [.., words, 8 nibbles]
    codes = np.empty_like(nib)
    codes[..., list(order)] = nib
    codes = codes.reshape(*w.shape[:-1], w.shape[-1] * 8).astype(np.uint8)
    return np.moveaxis(codes, -1, axis)


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # code position held by nibble i of an AWQ word


def from_awq(qweight, qzeros, scales, group: int) -> HostQuant:
    """AutoAWQ GEMM: qweight int32 [K, N/8] and qzeros [K/G, N/8] packed along N in AWQ's
    interleaved order, scales [K/G, N]: W[k, n] = (code - zero) * scale."""
    codes = unpack_int32(qweight, 1, AWQ_ORDER)       # [K, N]
    zeros = unpack_int32(qzeros, 1, AWQ_ORDER).astype(np.float32)
    return _asym_int4(codes, zeros, np.asarray(scales, np.float32), group)


def from_gptq(qweight, qzeros, scales, group: int, g_idx=None, zero_plus_one: bool = True) -> HostQuant:
    """GPTQ: qweight int32 [K/8, N] packed along K, qzeros [K/G, N/8] packed along N, scales
    [K/G, N]. The v1 checkpoint format stores zero - 1 (zero_plus_one). Act-order checkpoints
    whose g_idx is not the plain group order are refused: our groups are contiguous in K."""
    codes = unpack_int32(qweight, 0)                  # [K, N]
    K = codes.shape[0]
    if g_idx is not None and not np.array_equal(np.asarray(g_idx), np.arange(K) // group):
        raise ValueError("GPTQ checkpoints with act-order (desc_act, a permuted g_idx) are not "
                         "supported")
    zeros = unpack_int32(qzeros, 1).astype(np.float32) + (1 if zero_plus_one else 0)
    return _asym_int4(codes, zeros, np.asarray(scales, np.float32), group)


def _asym_int4(codes_kn, zeros_gn, scales_gn, group: int) -> HostQuant:
    K, N = codes_kn.shape
    if K % group:
        raise ValueError(f"group_size {group} does not divide the input size {K}")
    if scales_gn.shape != (K // group, N) or zeros_gn.shape[0] != K // group:
        raise ValueError(f"scales {scales_gn.shape} / zeros {zeros_gn.shape} do not match "
                         f"{K // group} groups of {group} for a [{K}, {N}] weight")
    zeros_gn = zeros_gn[:, :N]
    return HostQuant("int4", pack_int4(np.ascontiguousarray(codes_kn.T)),
                     np.ascontiguousarray(scales_gn.T), np.ascontiguousarray((-zeros_gn * scales_gn).T))


def from_pack_quantized(packed, scale, zero_point=None, num_bits: int = 4) -> HostQuant:
    """compressed-tensors "pack-quantized": weight_packed int32 [N, K/8] of signed 4-bit
    values stored as value + 8, weight_scale [N, K/G]; an asymmetric checkpoint's
    weight_zero_point [N/8, K/G] is packed the same way along N. W = (value - zero) * scale."""
    if num_bits != 4:
        raise ValueError(f"compressed-tensors pack-quantized with {num_bits} bits is not "
                         "supported; supported: 4")
    codes = unpack_int32(packed, 1)                   # [N, K]: value + 8
    scale = np.asarray(scale, np.float32)
    if zero_point is None:
        offset = -8.0 * scale
    else:  # (code - 8) - (zcode - 8) = code - zcode
        zcode = unpack_int32(zero_point, 0)[:codes.shape[0]].astype(np.float32)
        offset = -zcode * scale
    return HostQuant("int4", pack_int4(codes), scale, offset.astype(np.float32))
