"""Quantized weights: formats against references, the CPU kernels against the XLA path,
quantized checkpoints (ours, AWQ, GPTQ, compressed-tensors, GGUF) against the float model
holding the same dequantized weights, tensor parallelism, and refusals."""
import dataclasses
import json
import os
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_tiny_checkpoint
from jaxllm.layers.dtype_policy import uniform_policy
from jaxllm.loader import load_model
from jaxllm.quantization import formats as F
from jaxllm.quantization.qweight import QWeight, matmul_xla
from model_util import all_logits, hf_logits

T = gguf.GGMLQuantizationType
RNG = np.random.default_rng(0)


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


# formats
def test_int4_packing_round_trip_and_layout():
    codes = RNG.integers(0, 16, (3, 5, 96)).astype(np.uint8)
    packed = F.pack_int4(codes)
    assert packed.shape == (3, 5, 48)
    np.testing.assert_array_equal(F.unpack_int4(packed), codes)
    # GGUF's Q4 order: byte j of a 32-block holds code j (low nibble) and code j + 16 (high)
    np.testing.assert_array_equal(packed[..., 0], codes[..., 0] | (codes[..., 16] << 4))
    np.testing.assert_array_equal(packed[..., 16], codes[..., 32] | (codes[..., 48] << 4))
    with pytest.raises(ValueError, match="multiple of 32"):
        F.pack_int4(codes[..., :40])


@pytest.mark.parametrize("kind,group", [("int8", None), ("int8", 32), ("int4", 32), ("int4", 128), ("fp8", None)])
def test_online_quantizers_round_to_nearest(kind, group):
    w = RNG.standard_normal((6, 256)).astype(np.float32)
    w[0] = 0.25  # a constant row: zero range in every group (int4 holds it exactly)
    h = {"int8": lambda: F.quantize_int8(w, group), "int4": lambda: F.quantize_int4(w, group),
         "fp8": lambda: F.quantize_fp8(w)}[kind]()
    deq = h.dequantize()
    if kind == "fp8":  # 3 mantissa bits: relative error at most 2^-4 of the scaled value
        np.testing.assert_array_less(np.abs(deq - w), np.abs(w) * 2.0 ** -4 + 1e-6)
        return
    g = h.group
    step = np.repeat(h.scale, g, axis=-1)
    np.testing.assert_array_less(np.abs(deq - w), step / 2 + 1e-6)
    codes = h.codes()
    assert (codes.min(), codes.max()) >= ((0, 0) if kind == "int4" else (-127, -127))
    assert codes.max() <= (15 if kind == "int4" else 127)
    if kind == "int4":
        np.testing.assert_array_equal(deq[0], 0.25)
    # scales (and offsets) are rounded to float16 so that they are stored exactly in it
    compact = h.compact()
    assert compact.scale.dtype == np.float16
    np.testing.assert_array_equal(compact.dequantize(), deq)


def _random_blocks(qtype, rows: int, cols: int) -> np.ndarray:
    """Random K-quant blocks (any bit pattern is a block) with sane f16 scale fields."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = RNG.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    f16 = lambda n: RNG.uniform(0.001, 0.05, (rows, cols // block, n)).astype(np.float16).view(np.uint8)
    if qtype in (T.Q4_K, T.Q5_K):
        raw[..., 0:4] = f16(2)
    else:  # Q6_K: d at the end
        raw[..., 208:210] = f16(1)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_blocks_convert_without_loss(name):
    qtype = T[name]
    if name.endswith("_K"):
        raw = _random_blocks(qtype, 8, 512)
    else:
        raw = gguf.quants.quantize(RNG.standard_normal((8, 512)).astype(np.float32), qtype)
    h = F.from_gguf(raw, qtype, (8, 512))
    want = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4"}.get(name, "int8")
    assert h.kind == want
    ref = gguf.quants.dequantize(raw, qtype).reshape(8, 512)
    np.testing.assert_allclose(h.dequantize(), ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def test_checkpoint_packers_unpack_to_their_weights():
    from quant_util import awq_tensors, gptq_tensors, pack_quantized_tensors
    w = RNG.standard_normal((48, 128)).astype(np.float32)
    t, deq = awq_tensors(w, 32)
    np.testing.assert_allclose(F.from_awq(t["qweight"], t["qzeros"], t["scales"], 32).dequantize(),
                               deq, rtol=1e-5, atol=1e-6)
    t, deq = gptq_tensors(w, 32)
    np.testing.assert_allclose(F.from_gptq(t["qweight"], t["qzeros"], t["scales"], 32, t["g_idx"]).dequantize(),
                               deq, rtol=1e-5, atol=1e-6)
    t, deq = pack_quantized_tensors(w, 32)
    np.testing.assert_allclose(F.from_pack_quantized(t["weight_packed"], t["weight_scale"]).dequantize(),
                               deq, rtol=1e-5, atol=1e-6)
    # act-order GPTQ (a permuted g_idx) cannot be held in contiguous groups
    t, _ = gptq_tensors(w, 32)
    with pytest.raises(ValueError, match="act-order"):
        F.from_gptq(t["qweight"], t["qzeros"], t["scales"], 32, RNG.permutation(t["g_idx"]))


# kernels
CASES = {
    "int4 g64 float16 scales": lambda w: F.quantize_int4(w, 64).compact(),
    "int4 g64": lambda w: F.quantize_int4(w, 64),
    "int4 g32 int8 blocks": lambda w: F.quantize_int4(w, 32),
    # the kernel's three ways to find a pair of blocks' scales: groups of 32 (here as GGUF
    # holds them, float16), multiples of 64, and the rest (96)
    "int4 g32 float16 scales int8 blocks": lambda w: F.quantize_int4(w, 32).compact(),
    "int4 g96 int8 blocks": lambda w: F.quantize_int4(w, 96),
    "int4 g64 float16 scales int8 blocks": lambda w: F.quantize_int4(w, 64).compact(),
    "int8 per channel": lambda w: F.quantize_int8(w).compact(),
    "int8 g16 with offsets": lambda w: F.HostQuant("int8", F.quantize_int8(w, 16).q, F.quantize_int8(w, 16).scale,
                                                   RNG.standard_normal((*w.shape[:-1], w.shape[-1] // 16)).astype(np.float32)),
}


@pytest.mark.parametrize("case", sorted(CASES) + ["w8a8", "w8a8 smooth"])
def test_cpu_kernels_match_the_xla_path(case):
    from jaxllm.kernels.cpu import build, matmul as cpu_mm
    if not build.available():
        pytest.fail("the CPU kernels did not build here (see the warning)")
    # 3 layers, N not a multiple of 4; for w8a8 also the packed kernel's shapes (N a multiple of
    # 16, from 8 rows), with K a multiple of 64 and not (its packing has a tail)
    shapes = [(70, 192)] + ([(96, 192), (48, 200)] if case.startswith("w8a8") else [])
    for N, K in shapes:
        w = RNG.standard_normal((3, N, K)).astype(np.float32)
        h = CASES.get(case, CASES["int8 per channel"])(w)
        assert h.scale.dtype == (np.float16 if "float16" in case or "per channel" in case or "w8a8" in case
                                 else np.float32)
        act = "int8" if case.startswith("w8a8") else "int8_block" if "int8 blocks" in case else "none"
        smooth = jnp.asarray(RNG.uniform(0.5, 2.0, (3, K)).astype(np.float32)) if "smooth" in case else None
        parts = [jnp.asarray(a) if a is not None else None for a in (h.q, h.scale, h.offset)]
        pol = uniform_policy(jnp.float32)
        # one jitted function of each path: a shape compiles once, for both layers
        xla_mm, cpu_matmul = jax.jit(lambda x, w: matmul_xla(x, w, pol)), jax.jit(cpu_mm.matmul)
        for M in (1, 3, 4, 5, 8, 9, 17) + ((64,) if N % 16 == 0 else ()):
            x = jnp.asarray(RNG.standard_normal((M, K)).astype(np.float32))
            x = x.at[0, 32:64].set(0.0)  # a block of zeros
            for layer in (0, 2):
                ref = np.asarray(xla_mm(x, QWeight(*parts, smooth, jnp.int32(layer), act, "xla")))
                got = np.asarray(cpu_matmul(x, QWeight(*parts, smooth, jnp.int32(layer), act, "cpu")))
                if act == "int8":
                    # XLA:CPU divides through a reciprocal (not IEEE), so an activation on a
                    # rounding edge can take the neighbouring code there: the kernel must equal
                    # the exact arithmetic, and XLA be within a code of it
                    exact = w8a8_reference(np.asarray(x), h, layer,
                                           None if smooth is None else np.asarray(smooth)[layer])
                    assert rel(got, exact) < 1e-5, (case, N, K, M, layer)
                    assert rel(ref, exact) < 1e-2, (case, N, K, M, layer)
                    continue
                assert rel(got, ref) < 1e-5, (case, N, K, M, layer)
                if act == "none":  # and both equal the dequantized matrix product
                    assert rel(ref, np.asarray(x) @ h.dequantize()[layer].T) < 1e-5
                if act == "int8_block":  # ... of activations rounded to int8 per block of 32
                    assert rel(ref, int8_blocks(np.asarray(x)) @ h.dequantize()[layer].T) < 1e-5
                    assert rel(ref, np.asarray(x) @ h.dequantize()[layer].T) < 2e-2


def w8a8_reference(x: np.ndarray, h, layer: int, smooth: np.ndarray | None) -> np.ndarray:
    """x quantized per row to int8 (IEEE division, round half to even) times the int8 codes,
    in float64, scaled back."""
    if smooth is not None:
        x = (x / smooth).astype(np.float32)
    amax = np.abs(x).max(-1, keepdims=True)
    s = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    xq = np.clip(np.rint(x / s), -127, 127)
    y = xq.astype(np.float64) @ h.q[layer].astype(np.float64).T
    return (y * s * h.scale[layer][:, 0].astype(np.float64)).astype(np.float32)


def int8_blocks(x: np.ndarray) -> np.ndarray:
    b = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = np.abs(b).max(-1, keepdims=True) / np.float32(127)
    d[d == 0] = 1
    return (np.clip(np.rint(b / d), -127, 127) * d).reshape(x.shape)


@pytest.mark.parametrize("out_major", [False, True])
def test_cpu_bf16_kernel_matches_numpy(out_major):
    """The CPU kernel for bf16 float weights (layers' stacks [L, K, N], a tied head [N, K])
    against numpy on the same bf16 values widened: every tiling remainder of rows (M),
    columns (N = 16 * 9 + 5: whole tiles, single vectors, scalar columns) and K."""
    from jaxllm.kernels.cpu import build, matmul as cpu_mm
    if not build.available():
        pytest.fail("the CPU kernels did not build here (see the warning)")
    K, N = 16 * 6 + 7, 16 * 9 + 5  # remainders in K too (a hidden size not a multiple of 16)
    w = jnp.asarray(RNG.standard_normal((3, N, K) if out_major else (3, K, N)), jnp.bfloat16)
    wf = np.asarray(w.astype(jnp.float32))
    f = jax.jit(lambda x, w, i: cpu_mm.dense_bf16(x, w, i, out_major))
    for M in (1, 2, 3, 4, 7, 9):
        x = RNG.standard_normal((M, K)).astype(np.float32)
        for layer in (0, 2):
            ref = x @ (wf[layer].T if out_major else wf[layer])
            assert rel(np.asarray(f(x, w, jnp.int32(layer))), ref) < 1e-5, (M, layer)
    # from 16 rows with N a multiple of 16: packed panels, activations rounded to bf16 (K / 2
    # pairs of k: 6 transposed blocks of 16 and a tail of 4)
    K, N = 200, 96
    w = jnp.asarray(RNG.standard_normal((3, N, K) if out_major else (3, K, N)), jnp.bfloat16)
    wf = np.asarray(w.astype(jnp.float32))
    for M in (15, 16, 17, 64):
        x = RNG.standard_normal((M, K)).astype(np.float32)
        xr = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)) if M >= 16 else x
        for layer in (0, 2):
            ref = xr.astype(np.float64) @ (wf[layer].T if out_major else wf[layer])
            got = np.asarray(f(x, w, jnp.int32(layer)))
            assert rel(got, ref) < 1e-5, (M, layer)
            if M >= 16:  # and not the product of the unrounded activations
                assert rel(got, x @ (wf[layer].T if out_major else wf[layer])) > 1e-4
    # one matrix (no stack) with leading batch dimensions
    x = RNG.standard_normal((2, 3, K)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, w: cpu_mm.dense_bf16(x, w, None, out_major))(x, w[1]))
    assert got.shape == (2, 3, N)
    assert rel(got, x @ (wf[1].T if out_major else wf[1])) < 1e-5


def test_cpu_w8a16_kernel_with_bf16_activations():
    """Per-channel int8 codes times activations rounded to bf16 (the CPU bf16 policy's W8A16,
    w8a8's head): from 16 rows the codes are packed as bf16 pairs, below the float kernel runs;
    both give the exact product of the rounded activations and the dequantized weights, with a
    last panel of 16 columns (N = 112 = 48 + 48 + 16), and only the real rows."""
    from jaxllm.kernels.cpu import build, matmul as cpu_mm
    if not build.available():
        pytest.fail("the CPU kernels did not build here (see the warning)")
    N, K = 112, 224
    h = F.quantize_int8(RNG.standard_normal((3, N, K)).astype(np.float32)).compact()
    w = QWeight(jnp.asarray(h.q), jnp.asarray(h.scale), None, None, jnp.int32(2), "none", "cpu")
    g32 = F.quantize_int8(RNG.standard_normal((N, K)).astype(np.float32), 32)
    assert w.per_channel_int8 and not QWeight(jnp.asarray(g32.q), jnp.asarray(g32.scale)).per_channel_int8
    f = jax.jit(lambda x, rows: cpu_mm.matmul(x, w, rows, bf16_activations=True))
    for M in (3, 15, 16, 17, 64):
        x = np.asarray(jnp.asarray(RNG.standard_normal((M, K)), jnp.bfloat16).astype(jnp.float32))
        ref = x.astype(np.float64) @ h.dequantize()[2].T.astype(np.float64)
        got = np.asarray(f(x, None))
        assert rel(got, ref) < 1e-6, M
        rows = M // 2 + 1
        part = np.asarray(f(x, jnp.int32(rows)))
        np.testing.assert_array_equal(part[:rows], np.asarray(f(x[:rows], None)))
        assert not part[rows:].any()


@pytest.mark.parametrize("case", ["int4 g64", "int4 g32 int8 blocks", "int8 g16 with offsets", "w8a8",
                                  "w8a8 smooth", "w8a8 panels", "bf16 in_out", "bf16 out_in"])
def test_cpu_kernels_multiply_only_the_real_rows(case):
    """A step padded to its bucket tells the kernels how many leading rows are real: their
    result is exactly that of the real rows alone (the same path: from 16 rows the bf16 kernel
    packs, from 8 the w8a8 one), and the padded rows come back as zeros, whatever they hold."""
    from jaxllm.kernels.cpu import build, matmul as cpu_mm, panels as cpu_panels
    if not build.available():
        pytest.fail("the CPU kernels did not build here (see the warning)")
    N, K, M = 96, 192, 64
    if case.startswith("bf16"):
        out_major = case.endswith("out_in")
        w = jnp.asarray(RNG.standard_normal((3, N, K) if out_major else (3, K, N)), jnp.bfloat16)

        def run(x, rows):
            return cpu_mm.dense_bf16(x, w, jnp.int32(2), out_major, rows)
    else:
        h = CASES.get(case, CASES["int8 per channel"])(RNG.standard_normal((3, N, K)).astype(np.float32))
        act = "int8" if case.startswith("w8a8") else "int8_block" if "int8 blocks" in case else "none"
        smooth = jnp.asarray(RNG.uniform(0.5, 2.0, (3, K)).astype(np.float32)) if "smooth" in case else None
        qw = QWeight(*[None if a is None else jnp.asarray(a) for a in (h.q, h.scale, h.offset)],
                     smooth, jnp.int32(2), act, "cpu")
        if case.endswith("panels"):
            qw = dataclasses.replace(qw, q=cpu_panels.to_i8_panels(qw.q))

        def run(x, rows):
            return cpu_mm.matmul(x, qw, rows)
    f = jax.jit(run)
    x = RNG.standard_normal((M, K)).astype(np.float32) * 3
    for rows in (0, 1, 7, 8, 15, 16, 17, 40, M):
        got = np.asarray(f(x, jnp.int32(rows)))
        assert got.shape == (M, N)
        assert not got[rows:].any(), (case, rows)
        if rows:
            alone = np.asarray(jax.jit(lambda x: run(x, None))(x[:rows]))
            np.testing.assert_array_equal(got[:rows], alone, err_msg=f"{case} rows={rows}")
    np.testing.assert_array_equal(np.asarray(f(x, jnp.int32(M + 5))), np.asarray(f(x, jnp.int32(M))))


@pytest.mark.parametrize("case", ["w8a8", "w8a8 smooth", "w8a8 panels", "w8a8 smooth panels",
                                  "w8a16 bf16 activations", "bf16 in_out", "bf16 out_in", "bf16 panels"])
def test_cpu_amx_and_avx512_kernels_agree(case, cpu_amx):
    """Where the CPU has AMX and Linux grants it, the packed kernels multiply on its tiles;
    cpu_amx=False keeps them on AVX-512. w8a8's integer sums are the same (equal results);
    bf16 products are summed in another order. Rows that are not a multiple of the tiles' 16
    leave the padding out; N = 112 ends on a panel of one tile. w8a8's panels packed at load
    give exactly what its codes packed per call do, at every row count."""
    from jaxllm.kernels.cpu import build, matmul as cpu_mm, panels as cpu_panels
    if not build.available():
        pytest.fail("the CPU kernels did not build here (see the warning)")
    N, K = (144 if case.endswith("panels") else 112), 256
    smooth = None
    if case.startswith("bf16"):
        out_major, panels = case.endswith("out_in"), case.endswith("panels")
        w = jnp.asarray(RNG.standard_normal((3, N, K) if out_major else (3, K, N)), jnp.bfloat16)
        wk = cpu_panels.to_panels(w) if panels else w
        f = jax.jit(lambda x: cpu_mm.dense_bf16(x, wk, jnp.int32(2), out_major, panels=panels))
        wf = np.asarray(w[2].astype(jnp.float32), np.float64)
        matrix = wf.T if out_major else wf
    else:
        h = F.quantize_int8(RNG.standard_normal((3, N, K)).astype(np.float32)).compact()
        if "smooth" in case:
            smooth = RNG.uniform(0.5, 2.0, (3, K)).astype(np.float32)
        qw = QWeight(jnp.asarray(h.q), jnp.asarray(h.scale), None,
                     None if smooth is None else jnp.asarray(smooth), jnp.int32(2),
                     "int8" if case.startswith("w8a8") else "none", "cpu")
        f = jax.jit(lambda x: cpu_mm.matmul(x, qw, bf16_activations=case.startswith("w8a16")))
        matrix = h.dequantize()[2].T.astype(np.float64)
        if case.endswith("panels"):
            unpacked = f
            qw = dataclasses.replace(qw, q=cpu_panels.to_i8_panels(qw.q))
            np.testing.assert_array_equal(np.asarray(cpu_panels.from_i8_panels(qw.q)), h.q)
            f = jax.jit(lambda x: cpu_mm.matmul(x, qw))
    for M in (1, 3, 4, 8, 16, 17, 40):  # bf16 on AMX from 4 rows, w8a8 from 8 (its panels from 5)
        x = RNG.standard_normal((M, K)).astype(np.float32) * 3
        if not case.startswith("w8a8"):  # the bf16 policy's activations
            x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
        cpu_amx(True)
        tiles = np.asarray(f(x))
        cpu_amx(False)
        assert not build.amx()
        avx = np.asarray(f(x))
        if case.startswith("w8a8"):
            np.testing.assert_array_equal(tiles, avx, err_msg=f"{case} M={M}")
            if case.endswith("panels"):
                np.testing.assert_array_equal(avx, np.asarray(unpacked(x)), err_msg=f"{case} M={M}")
                cpu_amx(True)
                np.testing.assert_array_equal(tiles, np.asarray(unpacked(x)), err_msg=f"{case} M={M}")
        else:
            assert rel(tiles, avx) < 1e-6, (case, M)
        exact = (x.astype(np.float64) / (1.0 if smooth is None else smooth[2])) @ matrix
        # w8a8 quantizes the activations too: near, not equal
        assert rel(avx, exact) < (2e-2 if case.startswith("w8a8") else 1e-6), (case, M)


def test_cpu_fp8_kernel_multiplies_as_fp8(cpu_amx):
    """fp8 weights on the CPU kernels (XLA:CPU emulates an fp8 dot): activations rounded per
    row to e4m3 as XLA rounds them, both operands multiplied as bf16 (exact), on AMX's tiles
    and on AVX-512, at row counts on both sides of the tiles' 4 and 16: equal to the XLA path
    and to the float64 product of the e4m3 values, up to f32 sums; padding rows come back
    zero; a shape the kernel does not take stays on XLA."""
    import ml_dtypes

    from jaxllm.kernels.cpu import build, matmul as cpu_mm
    if not build.available():
        pytest.fail("the CPU kernels did not build here (see the warning)")
    N, K = 112, 256
    w = RNG.standard_normal((3, N, K)).astype(np.float32)
    hs = [F.quantize_fp8(w[i]) for i in range(3)]
    q = jnp.asarray(np.stack([h.q for h in hs]))
    scale = jnp.asarray(np.stack([h.scale for h in hs]))
    qw = QWeight(q, scale, None, None, jnp.int32(2), "fp8", "cpu")
    assert cpu_mm.fp8_apply(qw)
    kernel = jax.jit(lambda x, rows=None: cpu_mm.matmul(x, qw, rows))
    xla = jax.jit(lambda x: matmul_xla(x, dataclasses.replace(qw, backend="xla"),
                                       uniform_policy(jnp.float32)))
    wq = hs[2].q.astype(np.float64) * hs[2].scale.astype(np.float64)
    for M in (1, 3, 4, 8, 16, 17, 40):
        x = RNG.standard_normal((M, K)).astype(np.float32) * 3
        x[0, :5] = [0.0, 1e-4, -2e-3, 7.0, -7.0]  # subnormal e4m3 values and the row's top
        s = np.abs(x).max(-1, keepdims=True) / np.float32(448.0)
        xq = (x / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * s
        exact = xq @ wq.T
        cpu_amx(True)
        tiles = np.asarray(kernel(x))
        cpu_amx(False)
        avx = np.asarray(kernel(x))
        ref = np.asarray(xla(x))
        for got in (tiles, avx):
            assert rel(got, exact) < 1e-6, M
            assert rel(got, ref) < 1e-6, M
        padded = np.asarray(kernel(np.concatenate([x, x]), jnp.int32(M)))
        np.testing.assert_array_equal(padded[M:], 0)
        np.testing.assert_array_equal(padded[:M], avx)
    odd = dataclasses.replace(qw, q=q[:, :, :40], scale=scale)  # K = 40: not a multiple of 32
    assert not cpu_mm.fp8_apply(odd)
    # each activation's rounding, seen through 448 times the identity: ties to even among
    # normals (17 -> 16, 19 -> 20) and subnormals (multiples of 2^-9), the row's top at 448
    eye = F.quantize_fp8(np.eye(32, dtype=np.float32) * 448)
    iw = QWeight(jnp.asarray(eye.q), jnp.asarray(eye.scale), None, None, None, "fp8", "cpu")
    sub = 2.0 ** -9
    x = np.zeros((2, 32), np.float32)
    x[0, :10] = [448, 17, 19, -17, 0.5 * sub, 1.5 * sub, 2.5 * sub, -1.5 * sub, 1e-3, 300.1]
    x[1] = RNG.standard_normal(32) * 5
    s = (np.abs(x).max(-1, keepdims=True) / np.float32(448)).astype(np.float32)
    xq = (x / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert list(xq[0, 1:8]) == [16, 20, -16, 0, 2 * sub, 2 * sub, -2 * sub]
    want = (xq * np.float32(448)) * s * eye.scale[:, 0]
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: cpu_mm.matmul(x, iw))(x)), want)


@pytest.mark.parametrize("kind,group,N,K,M", [("int4", 32, 96, 128, 5), ("int4", 128, 64, 256, 20),
                                               ("int8", 16, 64, 64, 3), ("int8", 32, 48, 96, 17)])
def test_pallas_group_quantized_matmul(kind, group, N, K, M):
    """The GPU kernel for group-quantized weights (interpret mode) against its reference and
    the dequantized matrix product, reading layer 1 of a stack."""
    from pallas_kernels.quantized_matmul import quantized_matmul
    from pallas_kernels.quantized_matmul_ref import quantized_matmul_ref
    w = RNG.standard_normal((2, N, K)).astype(np.float32)
    h = (F.quantize_int4(w, group) if kind == "int4" else F.quantize_int8(w, group)).compact()
    q, s, o = jnp.asarray(h.q), jnp.asarray(h.scale), None if h.offset is None else jnp.asarray(h.offset)
    x = jnp.asarray(RNG.standard_normal((M, K)).astype(np.float32))
    got = np.asarray(quantized_matmul(x, q, s, o, 1, interpret=True))
    ref = np.asarray(quantized_matmul_ref(x, q, s, o, 1))
    assert rel(got, ref) < 1e-5 and rel(ref, np.asarray(x) @ h.dequantize()[1].T) < 1e-5


# models
def _set_dequantized(hf, layout_of):
    """Replace every matrix of the torch model by its quantize-dequantize round trip."""
    import torch

    from jaxllm.quantization import quantize_host
    with torch.no_grad():
        for name, p in hf.named_parameters():
            layout = layout_of(name, p)
            if layout is not None:
                w = quantize_host(p.detach().numpy().astype(np.float32), layout).dequantize()
                p.copy_(torch.from_numpy(w))


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory, tokenizer_dir):
    d = tmp_path_factory.mktemp("qtiny")
    hf = make_tiny_checkpoint(d, "llama3", tokenizer_dir)
    return str(d), hf


IDS = RNG.integers(0, 49152, 37).tolist()


@pytest.mark.parametrize("method", ["int8", "int4", "int4 g64"])
def test_online_weight_only_equals_its_dequantized_weights(tiny_hf, method):
    """Every matrix (the embedding and LM head too, int8 under int4) quantized at load,
    rounded to nearest: the logits equal HF's on the same dequantized weights, at each int4
    group size."""
    import copy

    from jaxllm.quantization import DEFAULT_INT4_GROUP, QuantLayout
    path, hf = tiny_hf
    kind, group = method.split()[0], int(method.split(" g")[1]) if " g" in method else None
    extra = {} if kind == "int8" or group is None else dict(quantization_group_size=group)
    loaded = load_model(path, jnp.float32, load_tokenizer=False, quantization=kind, **extra)
    assert loaded.quant.method == kind and loaded.quant.backend == "cpu"
    assert {n for n, _ in loaded.quant.layouts} >= {"embed_tokens", "lm_head", "layers.wqkv",
                                                     "layers.wo", "layers.w_gate_up", "layers.w_down"}
    want = group or DEFAULT_INT4_GROUP
    layouts = dict(loaded.quant.layouts)
    heads = ("embed_tokens", "lm_head")
    assert all(layouts[n].kind == "int8" and layouts[n].group == 64 for n in heads)
    assert kind == "int8" or {lay.group for n, lay in layouts.items() if n not in heads} == {want}
    assert not any(lay.smooth for _, lay in loaded.quant.layouts)
    ref_model = copy.deepcopy(hf)

    def layout(name, p):
        if p.ndim != 2:
            return None
        K = p.shape[1]
        head = name.split(".")[-2] in heads
        return QuantLayout("int8", K) if kind == "int8" or head else QuantLayout("int4", want, True)

    _set_dequantized(ref_model, layout)
    assert rel(all_logits(loaded, IDS), hf_logits(ref_model, IDS)) < 1e-4


def test_pallas_backend_in_the_model(tiny_hf):
    """int4 weights through the GPU kernel (interpreted): the same logits as XLA's dots."""
    path, _ = tiny_hf
    kernel = load_model(path, jnp.float32, load_tokenizer=False, quantization="int4",
                        matmul_backend="pallas_interpret")
    assert kernel.quant.backend == "pallas_interpret"
    xla = load_model(path, jnp.float32, load_tokenizer=False, quantization="int4", matmul_backend="xla")
    assert rel(all_logits(kernel, IDS[:12]), all_logits(xla, IDS[:12])) < 1e-5


def test_int4_with_int8_block_activations(tiny_hf):
    """int4_activations="int8": 4-bit matrices in the CPU kernels multiply activations
    rounded to int8 per block of 32 (the default keeps them float, exact to the dequantized
    weights): the logits move, but stay near the float-activation ones."""
    from jaxllm.cli import main
    from jaxllm.config import EngineConfig
    from jaxllm.quantization import QuantLayout, QuantSpec
    path, _ = tiny_hf
    exact = all_logits(load_model(path, jnp.float32, load_tokenizer=False, quantization="int4"), IDS)
    blocks = all_logits(load_model(path, jnp.float32, load_tokenizer=False, quantization="int4",
                                   int4_activations="int8"), IDS)
    assert 0 < rel(blocks, exact) < 0.05
    # only where the kernel's blocks fit: groups of 32s, inputs of 64s, the CPU kernels
    spec = QuantSpec("int4", (("a", QuantLayout("int4", 32, True)), ("b", QuantLayout("int4", 16, True))),
                     "cpu", "int8")
    assert (spec.act_of("a", 128), spec.act_of("a", 96), spec.act_of("b", 128)) == ("int8_block", "none", "none")
    assert QuantSpec("int4", spec.layouts, "xla", "int8").act_of("a", 128) == "none"
    assert QuantSpec("int4", spec.layouts, "cpu").act_of("a", 128) == "none"
    with pytest.raises(ValueError, match="int4_activations must be one of"):
        EngineConfig(int4_activations="int4")
    with pytest.raises(SystemExit):  # the flag offers the same choices
        main(["generate", "--int4-activations", "int4"])


@pytest.mark.parametrize("method", ["w8a8", "fp8"])
def test_activation_quantized_methods(tiny_hf, method):
    """W8A8 and FP8 quantize activations per token (the head stays float): the CPU kernels equal
    the XLA path, and the logits stay near the float model's."""
    path, hf = tiny_hf
    loaded = load_model(path, jnp.float32, load_tokenizer=False, quantization=method)
    layouts = dict(loaded.quant.layouts)
    assert "layers.wqkv" in layouts
    assert not {"embed_tokens", "lm_head"} & set(layouts)  # the head stays float
    ours = all_logits(loaded, IDS)
    xla = load_model(path, jnp.float32, load_tokenizer=False, quantization=method, matmul_backend="xla")
    assert xla.quant.backend == "xla"
    assert rel(ours, all_logits(xla, IDS)) < 1e-4
    assert rel(ours, hf_logits(hf, IDS)) < 0.05


@pytest.mark.parametrize("method", ["awq", "gptq", "compressed-tensors"])
def test_prequantized_checkpoints_load_quantized(tmp_path, tokenizer_dir, method):
    from quant_util import write_quantized
    hf = make_tiny_checkpoint(tmp_path, "llama3", tokenizer_dir, seed=3)
    write_quantized(hf, str(tmp_path), method, group=32)
    loaded = load_model(str(tmp_path), jnp.float32, load_tokenizer=False)
    assert loaded.quant.method == method
    layouts = dict(loaded.quant.layouts)
    assert layouts["layers.wqkv"].kind == "int4" and layouts["layers.wqkv"].group == 32
    assert "embed_tokens" not in layouts  # float in these checkpoints
    assert rel(all_logits(loaded, IDS), hf_logits(hf, IDS)) < 1e-4


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_gguf_files_run_quantized(tmp_path, default_gguf, qtype):
    """A tiny model written as a Q4_0 / Q8_0 GGUF with the gguf package: kept quantized, its
    logits equal those of transformers reading the same file (which dequantizes it)."""
    import torch
    import transformers
    from gguf_util import write_gguf
    # no RoPE scaling: transformers' GGUF reader ignores llama.cpp's rope_freqs
    hf = make_tiny_checkpoint(tmp_path / "hf", "mistral", seed=5)
    path = tmp_path / "tiny.gguf"
    write_gguf(hf, str(path), tokenizer_from=default_gguf, qtype=T[qtype])
    loaded = load_model(str(path), jnp.float32, load_tokenizer=False)
    assert loaded.quant.method == "gguf"
    assert dict(loaded.quant.layouts)["layers.w_down"].kind == ("int4" if qtype == "Q4_0" else "int8")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="tiny.gguf", torch_dtype=torch.float32)
    assert rel(all_logits(loaded, IDS), hf_logits(ref, IDS)) < 1e-4


def test_open_gguf_reads_what_gguf_reads(default_gguf):
    """The loader's reader (plain-array slicing of the mapping) against the gguf package's
    own: every metadata value and every tensor's bytes, shape and type."""
    import gguf

    from jaxllm.loader.gguf_loader import open_gguf
    ours, theirs = open_gguf(default_gguf), gguf.GGUFReader(default_gguf)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
    assert len(ours.tensors) == len(theirs.tensors) > 0
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, list(b.shape))
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name


def test_default_model_runs_its_q4_1_weights(default_gguf):
    """The default model keeps its Q4_1 layers (int4, groups of 32, scale and offset) and its
    Q8_0 embedding; its logits equal the dequantized model's."""
    q = load_model(default_gguf, jnp.float32, load_tokenizer=False)
    layouts = dict(q.quant.layouts)
    assert q.quant.method == "gguf"
    assert layouts["layers.wqkv"] == layouts["layers.w_down"]
    assert (layouts["layers.wqkv"].kind, layouts["layers.wqkv"].group, layouts["layers.wqkv"].offset) == ("int4", 32, True)
    assert (layouts["embed_tokens"].kind, layouts["embed_tokens"].group) == ("int8", 32)
    f = load_model(default_gguf, jnp.float32, load_tokenizer=False, quantization="none")
    assert f.quant is None
    from jaxllm.quantization import weight_bytes
    assert weight_bytes(q.state) < 0.25 * weight_bytes(f.state)
    ids = IDS[:24]
    assert rel(all_logits(q, ids), all_logits(f, ids)) < 1e-4


# refusals
def test_bad_quantization_inputs(tmp_path, tiny_hf, tokenizer_dir):
    from jaxllm.config import EngineConfig
    from quant_util import write_quantized
    path, _ = tiny_hf
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="needs a checkpoint quantized with it"):
        load_model(path, jnp.float32, load_tokenizer=False, quantization="awq")
    hf = make_tiny_checkpoint(tmp_path, "llama3", tokenizer_dir)
    write_quantized(hf, str(tmp_path), "compressed-tensors", group=32)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    with pytest.raises(ValueError, match="online quantization needs float weights"):
        load_model(str(tmp_path), jnp.float32, load_tokenizer=False, quantization="int4")
    # the config says AWQ, the tensors are compressed-tensors'
    cfg_path.write_text(json.dumps(cfg | {"quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}}))
    with pytest.raises(ValueError, match="belongs to compressed-tensors, but quantization_config says awq"):
        load_model(str(tmp_path), jnp.float32, load_tokenizer=False)
    # a group size that does not divide the input size
    write_quantized(hf, str(tmp_path), "gptq", group=32)
    gptq = json.loads(cfg_path.read_text())
    gptq["quantization_config"]["group_size"] = 48
    cfg_path.write_text(json.dumps(gptq))
    with pytest.raises(ValueError, match=r"gptq group_size 48 does not divide the input size (64|128)"):
        load_model(str(tmp_path), jnp.float32, load_tokenizer=False)
    gptq["quantization_config"] = {"quant_method": "bitsandbytes"}
    cfg_path.write_text(json.dumps(gptq))
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported"):
        load_model(str(tmp_path), jnp.float32, load_tokenizer=False)


@pytest.mark.slow
def test_tensor_parallel_quantized_weights(tiny_llama, tmp_path, default_gguf):
    """Quantized weights split over 2 devices, scales sharded with their weights: int8 per
    channel made at load, and a Q4_0 GGUF whose groups of 32 split along the row-parallel
    o projection's input. The same greedy tokens as one device."""
    from gguf_util import write_gguf
    hf = make_tiny_checkpoint(tmp_path / "hf", "llama3", seed=2)
    gguf_path = str(tmp_path / "q4_0.gguf")
    write_gguf(hf, gguf_path, tokenizer_from=default_gguf, qtype=T.Q4_0)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
    cases = ((tiny_llama, "int8"), (gguf_path, ""))
    # both workers at once: most of each one's time is starting up and compiling
    procs = [subprocess.Popen([sys.executable, os.path.join(here, "tp_worker.py"), model, "1,2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, JAXLLM_TEST_QUANT=method))
             for model, method in cases]
    outputs = [p.communicate(timeout=600) for p in procs]
    for (model, method), (stdout, stderr) in zip(cases, outputs):
        line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
        assert line, stderr[-3000:]
        res = json.loads(line[len("RESULT "):])
        assert "error" not in res["2"], res["2"]
        assert res["1"]["tokens"] == res["2"]["tokens"], model
        np.testing.assert_allclose(np.concatenate(res["1"]["logprobs"]), np.concatenate(res["2"]["logprobs"]),
                                   atol=2e-3)
        full, shard = res["2"]["wqkv_full"], res["2"]["wqkv_shard"]
        assert shard[1] * 2 == full[1] and shard[2] == full[2], (model, full, shard)
        sfull, sshard = res["2"]["wo_scale_full"], res["2"]["wo_scale_shard"]
        if method == "int8":  # one scale per output channel: whole on each device
            assert sshard == sfull
        else:  # 64 inputs of o in two groups of 32: one group per device
            assert sfull[2] == 2 and sshard[2] == 1 and sshard[1] == sfull[1]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_kv_cache_through_the_engine(tiny_llama, caplog, kv_dtype):
    """An int8 / fp8 KV cache holds 4 / (1 + 4 / head_dim) times the tokens of f32 in the same
    memory (3.2x at this model's head_dim of 16, 3.8x at 64; the log says so); on this CPU the
    attention kernels read it in place (fp8 kept as its bytes, which XLA:CPU writes in place);
    greedy tokens and logprobs stay close to an f32 cache's; swapping its blocks out and back
    and copy-on-write forks move values and scales exactly: greedy tokens equal an unpreempted
    run's."""
    import logging

    from conftest import SMALL_ENGINE
    from jaxllm import LLM, SamplingParams
    from jaxllm.layers.attention import cpu_kernels_apply
    from jaxllm.quantization import kv as kvq
    rng = np.random.default_rng(12)
    prompts = [rng.integers(10, 40000, size=40).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2, best_of=2)
    with caplog.at_level(logging.INFO, logger="jaxllm"):
        roomy = LLM(tiny_llama, kv_cache_dtype=kv_dtype, kv_cache_memory_bytes=1 << 22,
                    warmup=False, **SMALL_ENGINE)
    assert f"KV cache dtype {kv_dtype}: 3.20x the tokens of float32" in caplog.text
    f32_blocks = (1 << 22) // (2 * 2 * 16 * 2 * 16 * 4)  # layers, K/V, block, kv heads, head_dim, f32
    assert roomy.llm_engine.kv_manager.pool.num_blocks >= 3.19 * f32_blocks
    cache = roomy.llm_engine.runner.kv_cache
    assert cache.data.dtype == (jnp.int8 if kv_dtype == "int8" else kvq.FP8_BITS)
    assert cpu_kernels_apply(cache)
    one = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
    full = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 22, warmup=False,
               **SMALL_ENGINE)
    a = roomy.generate(prompts[:2], one, use_tqdm=False)
    b = full.generate(prompts[:2], one, use_tqdm=False)
    for x, y in zip(a, b):
        x, y = x.outputs[0], y.outputs[0]
        assert x.token_ids[0] == y.token_ids[0]
        assert abs(x.logprobs[0][x.token_ids[0]].logprob - y.logprobs[0][y.token_ids[0]].logprob) < 0.05
    del full
    want = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(tiny_llama, kv_cache_dtype=kv_dtype, num_gpu_blocks_override=17,
                preemption_mode="swap", swap_space=0.01, enable_prefix_caching=False,
                warmup=False, **SMALL_ENGINE)
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == want
    sched, kv = tight.llm_engine.scheduler, tight.llm_engine.kv_manager
    assert sched.num_swaps > 0
    assert kv.num_free_blocks == kv.pool.num_usable_blocks


# SmoothQuant (w8a8 with smoothing vectors)
def _w8a8_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """numpy W8A8: x per token and w per output channel to symmetric int8, the product."""
    sx = np.abs(x).max(-1, keepdims=True) / 127.0
    xq = np.clip(np.rint(x / sx), -127, 127)
    h = F.quantize_int8(w)
    return (xq @ h.codes().astype(np.float64).T) * sx * h.scale[:, 0].astype(np.float64)


def test_smoothquant_eases_an_activation_outlier_channel():
    """One input channel 50x the others (LLMs' activation outliers): per-token int8 spends its
    range on it. Smoothing (alpha 0.5) leaves x @ W^T unchanged in exact arithmetic and cuts
    the mean quantization error to about a quarter; the model's path (quantize_online + the XLA matmul)
    computes the numpy reference."""
    from jaxllm.models.base import ParamSpec
    from jaxllm.quantization import quantize_online
    from jaxllm.quantization.smoothquant import S_MAX, S_MIN, smoothing_vector, weight_maxima
    rng = np.random.default_rng(3)
    K, N = 128, 96
    x = rng.standard_normal((64, K))
    x[:, 7] *= 50.0
    w = rng.standard_normal((N, K)) * 0.05
    exact = x @ w.T
    s = smoothing_vector(np.abs(x).max(0), np.abs(w).max(0), 0.5)
    np.testing.assert_allclose((x / s) @ (w * s).T, exact, rtol=1e-9, atol=1e-9)
    err_plain = np.abs(_w8a8_reference(x, w) - exact).mean()
    err_smooth = np.abs(_w8a8_reference(x / s, w * s) - exact).mean()
    assert err_smooth < 0.4 * err_plain, (err_smooth, err_plain)  # measured: 0.24
    # bounded where a channel never fires or a weight column is zero
    s0 = smoothing_vector(np.array([0.0, 1.0, 1e9]), np.array([1.0, 0.0, 1e-9]), 0.5)
    assert np.all(np.isfinite(s0)) and s0.min() >= S_MIN and s0.max() <= S_MAX
    # through the loader's quantizer and the model's matmul (one layer of a stack, [in, out])
    spec = ParamSpec((1, K, N), ("layers", "mlp", "embed"), matrix="in_out")
    w_io = w.T[None].astype(np.float32)
    np.testing.assert_array_equal(weight_maxima(w_io, "in_out")[0], np.abs(w.astype(np.float32)).max(0))
    out, layouts = quantize_online({"layers.w_down": w_io}, {"layers.w_down": spec}, "w8a8",
                                   {"layers.w_down": s[None]})
    h = out["layers.w_down"]
    assert layouts["layers.w_down"].smooth and layouts["layers.w_down"].act == "int8"
    np.testing.assert_array_equal(h.smooth[0], s)
    np.testing.assert_allclose(h.dequantize()[0], w, atol=float(h.scale.max()) / 2 / s.min() + 1e-6)
    qw = QWeight(*(jnp.asarray(a) for a in (h.q, h.scale)), None, jnp.asarray(h.smooth), jnp.int32(0), "int8", "xla")
    got = np.asarray(matmul_xla(jnp.asarray(x, jnp.float32), qw, uniform_policy(jnp.float32)))
    ref = _w8a8_reference((x / s).astype(np.float32), (w * s).astype(np.float32))
    assert rel(got, ref) < 1e-3


@pytest.fixture(scope="module")
def outlier_hf(tiny_hf, tmp_path_factory, tokenizer_dir):
    """The tiny Llama with an outlier channel planted in front of q/k/v and gate/up, the way
    trained LLMs have them: the norm's weight on one channel x40 and the matrices' columns
    reading it /40, so the float model computes the same function."""
    import copy

    import torch
    _, hf = tiny_hf
    model = copy.deepcopy(hf)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for norm, projs, j in ((layer.input_layernorm, (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                            layer.self_attn.v_proj), 5 + i),
                                   (layer.post_attention_layernorm, (layer.mlp.gate_proj, layer.mlp.up_proj), 11 + i)):
                norm.weight[j] *= 40.0
                for p in projs:
                    p.weight[:, j] /= 40.0
    d = tmp_path_factory.mktemp("outlier")
    model.save_pretrained(d, safe_serialization=True)
    for name in os.listdir(tokenizer_dir):
        with open(os.path.join(tokenizer_dir, name), "rb") as src, open(d / name, "wb") as dst:
            dst.write(src.read())
    return str(d), model


def test_smoothquant_in_a_tiny_llama(outlier_hf):
    """w8a8 with SmoothQuant calibrated at load: the layer matrices carry smoothing vectors
    (the head stays float), the logits stay near the float model's and, with activation
    outliers, much nearer than plain w8a8's; the CPU kernels equal the XLA path."""
    path, hf = outlier_hf
    ref = hf_logits(hf, IDS)
    smooth = load_model(path, jnp.float32, load_tokenizer=False, quantization="w8a8", smoothquant_alpha=0.5)
    layouts = dict(smooth.quant.layouts)
    assert {n for n, lay in layouts.items() if lay.smooth} == {"layers.wqkv", "layers.wo",
                                                              "layers.w_gate_up", "layers.w_down"}
    assert "lm_head" not in layouts  # the head stays float
    assert smooth.smoothquant["alpha"] == 0.5 and smooth.smoothquant["calibration_tokens"] > 0
    s = np.asarray(smooth.state["layers"]["wqkv"]["smooth"][...])
    assert s.shape == (2, 64) and s[0, 5] > 4 * np.median(s[0])  # the outlier channel moved most
    plain = load_model(path, jnp.float32, load_tokenizer=False, quantization="w8a8")
    got, base = all_logits(smooth, IDS), all_logits(plain, IDS)
    assert rel(got, ref) < 0.05
    assert rel(got, ref) < 0.5 * rel(base, ref), (rel(got, ref), rel(base, ref))
    xla = load_model(path, jnp.float32, load_tokenizer=False, quantization="w8a8", smoothquant_alpha=0.5,
                     matmul_backend="xla")
    assert xla.quant.backend == "xla" and smooth.quant.backend == "cpu"
    assert rel(got, all_logits(xla, IDS)) < 1e-4


def test_smoothquant_convert_round_trip(outlier_hf, tmp_path, capsys):
    """`jaxllm convert -q w8a8 --smoothquant-alpha A` writes the smoothing vectors and the alpha
    into the Orbax checkpoint; it restores as the same model; another alpha asked of it is
    refused with the convert command that makes it."""
    from jaxllm.cli import main
    from jaxllm.loader import orbax as jo
    path, _ = outlier_hf
    out = str(tmp_path / "sq")
    assert main(["convert", path, out, "--dtype", "float32", "-q", "w8a8", "--smoothquant-alpha", "0.6"]) == 0
    meta = jo.read_metadata(out)
    assert meta["quantization"] == "w8a8" and meta["smoothquant"]["alpha"] == 0.6
    assert meta["quant_layouts"]["layers.w_down"]["smooth"] is True
    assert meta["params"]["layers.w_down.smooth"] == {"shape": [2, 128], "dtype": "float32"}
    ref = load_model(path, jnp.float32, load_tokenizer=False, quantization="w8a8", smoothquant_alpha=0.6)
    got = load_model(out, jnp.float32, load_tokenizer=False)
    assert got.quant == ref.quant and got.smoothquant == ref.smoothquant
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        np.testing.assert_array_equal(np.asarray(got.state["layers"][name]["smooth"][...]),
                                      np.asarray(ref.state["layers"][name]["smooth"][...]))
    np.testing.assert_array_equal(all_logits(got, IDS[:11]), all_logits(ref, IDS[:11]))
    load_model(out, jnp.float32, load_tokenizer=False, quantization="w8a8", smoothquant_alpha=0.6)
    with pytest.raises(ValueError, match=r"SmoothQuant vectors of alpha 0.6 but smoothquant_alpha=0.8"
                                         r".*--quantization w8a8 --smoothquant-alpha 0.8"):
        load_model(out, jnp.float32, load_tokenizer=False, quantization="w8a8", smoothquant_alpha=0.8)
    # --smoothquant alone: alpha 0.5; without w8a8: refused before anything is written
    assert main(["convert", path, str(tmp_path / "no"), "--smoothquant"]) == 1
    assert "smoothquant_alpha needs quantization='w8a8'" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def test_bad_smoothquant_inputs(tiny_hf):
    from jaxllm.cli import _smoothquant_alpha
    from jaxllm.config import EngineConfig
    path, _ = tiny_hf
    for bad in (1.5, -0.1, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match="smoothquant_alpha must be a number in"):
            EngineConfig(quantization="w8a8", smoothquant_alpha=bad)
    for method in (None, "int8", "fp8"):
        with pytest.raises(ValueError, match="smoothquant_alpha needs quantization='w8a8'"):
            EngineConfig(quantization=method, smoothquant_alpha=0.5)
    with pytest.raises(ValueError, match="folded into its norm weights"):
        EngineConfig(quantization="compressed-tensors", smoothquant_alpha=0.5)
    with pytest.raises(ValueError, match="smoothquant_alpha needs quantization='w8a8'"):
        load_model(path, jnp.float32, load_tokenizer=False, smoothquant_alpha=0.5)
    assert EngineConfig(quantization="w8a8", smoothquant_alpha=0).smoothquant_alpha == 0
    # the CLI: --smoothquant is alpha 0.5, --smoothquant-alpha A implies it
    ns = lambda flag, alpha: type("A", (), {"smoothquant": flag, "smoothquant_alpha": alpha})()  # noqa: E731
    assert (_smoothquant_alpha(ns(True, None)), _smoothquant_alpha(ns(None, 0.8)),
            _smoothquant_alpha(ns(True, 0.8)), _smoothquant_alpha(ns(None, None))) == (0.5, 0.8, 0.8, None)


# AWQ (int4 with activation-aware scaling) and int4's group sizes
def test_awq_search_scales_the_outlier_channel():
    """On rows with one large input channel, AWQ's search picks a scale that grows that
    channel's weights and lowers the output error below round-to-nearest's; on flat
    activations the search may keep alpha 0, which is round-to-nearest exactly."""
    from jaxllm.quantization import awq
    rng = np.random.default_rng(3)
    w = rng.normal(0, 1, (64, 128)).astype(np.float32)
    x = rng.normal(0, 1, (128, 128)).astype(np.float32)
    x[:, 7] *= 50.0
    s, alpha, ratio = awq.search(w, x, np.abs(x).mean(0), 32)
    assert alpha > 0 and ratio < 0.8, (alpha, ratio)
    assert s[7] == s.max() and s[7] > 4 * np.median(s)
    s0, _, ratio0 = awq.search(w, x, np.ones(128, np.float32), 32)  # no channel stands out
    np.testing.assert_allclose(s0, 1.0, rtol=1e-6)
    assert ratio0 == 1.0
    # the fake quantizer is the loader's own rounding
    np.testing.assert_allclose(np.asarray(awq.fake_int4(jnp.asarray(w), 32)),
                               F.quantize_int4(w, 32).dequantize(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("group", [32, 64])
def test_awq_in_a_tiny_llama(outlier_hf, group):
    """int4 with AWQ at each group size: the layer matrices carry AWQ's vectors (the int8
    embedding and head do not), the logits are nearer the float model's
    than round-to-nearest's (the planted outlier's weights, divided by 40, round to a few
    levels without it), and the CPU kernels equal the XLA path."""
    path, hf = outlier_hf
    ref = hf_logits(hf, IDS)
    awq = load_model(path, jnp.float32, load_tokenizer=False, quantization="int4",
                     quantization_group_size=group, int4_calibration="awq")
    layouts = dict(awq.quant.layouts)
    assert {n for n, lay in layouts.items() if lay.smooth} == {"layers.wqkv", "layers.wo",
                                                              "layers.w_gate_up", "layers.w_down"}
    assert {lay.group for n, lay in layouts.items() if lay.kind == "int4"} == {group}
    assert layouts["lm_head"].kind == "int8" and not layouts["lm_head"].smooth
    assert awq.smoothquant["method"] == "awq" and awq.smoothquant["calibration_tokens"] > 0
    s = np.asarray(awq.state["layers"]["wqkv"]["smooth"][...])
    assert s.shape == (2, 64) and not np.allclose(s, 1.0)
    rtn = load_model(path, jnp.float32, load_tokenizer=False, quantization="int4",
                     quantization_group_size=group)  # round to nearest, the default
    got, base = all_logits(awq, IDS), all_logits(rtn, IDS)
    assert rel(got, ref) < 0.5 * rel(base, ref), (rel(got, ref), rel(base, ref))
    xla = load_model(path, jnp.float32, load_tokenizer=False, quantization="int4",
                     quantization_group_size=group, int4_calibration="awq", matmul_backend="xla")
    assert xla.quant.backend == "xla" and awq.quant.backend == "cpu"
    np.testing.assert_array_equal(np.asarray(xla.state["layers"]["wqkv"]["smooth"][...]), s)
    assert rel(got, all_logits(xla, IDS)) < 1e-4


def test_awq_convert_round_trip(outlier_hf, tmp_path):
    """`jaxllm convert -q int4 --quantization-group-size 64 --int4-calibration awq` stores the
    codes and AWQ's vectors; the checkpoint restores as the model made at load, and the int4
    options asked of it again are refused (they were applied when converting)."""
    from jaxllm.cli import main
    from jaxllm.loader import orbax as jo
    path, _ = outlier_hf
    out = str(tmp_path / "awq")
    assert main(["convert", path, out, "--dtype", "float32", "-q", "int4",
                 "--quantization-group-size", "64", "--int4-calibration", "awq"]) == 0
    meta = jo.read_metadata(out)
    assert meta["quant_layouts"]["layers.w_down"]["smooth"] is True
    assert meta["quant_layouts"]["layers.w_down"]["group"] == 64 and meta["smoothquant"]["method"] == "awq"
    ref = load_model(path, jnp.float32, load_tokenizer=False, quantization="int4",
                     quantization_group_size=64, int4_calibration="awq")
    got = load_model(out, jnp.float32, load_tokenizer=False)
    assert got.quant == ref.quant
    np.testing.assert_array_equal(all_logits(got, IDS), all_logits(ref, IDS))
    with pytest.raises(ValueError, match="leave quantization_group_size and int4_calibration unset"):
        load_model(out, jnp.float32, load_tokenizer=False, quantization="int4", int4_calibration="awq")


def test_bad_int4_options(tiny_hf):
    from jaxllm.cli import main
    from jaxllm.config import EngineConfig
    path, _ = tiny_hf
    for bad in (16, 48, 256, 0, True, "64"):
        with pytest.raises(ValueError, match=r"quantization_group_size must be one of \(32, 64, 128\)"):
            EngineConfig(quantization="int4", quantization_group_size=bad)
    for method in (None, "int8", "w8a8", "awq"):
        with pytest.raises(ValueError, match="quantization_group_size needs quantization='int4'"):
            EngineConfig(quantization=method, quantization_group_size=64)
        with pytest.raises(ValueError, match="int4_calibration needs quantization='int4'"):
            EngineConfig(quantization=method, int4_calibration="awq")
    with pytest.raises(ValueError, match="int4_calibration must be one of"):
        EngineConfig(quantization="int4", int4_calibration="gptq")
    # the tiny model's hidden size is 64: groups of 128 do not divide it
    with pytest.raises(ValueError, match=r"quantization_group_size=128 does not divide the input "
                                         r"size 64 of \S+; choose 32 or 64"):
        load_model(path, jnp.float32, load_tokenizer=False, quantization="int4",
                   quantization_group_size=128, int4_calibration="none")
    with pytest.raises(SystemExit):  # the flag offers the same choices
        main(["generate", "-q", "int4", "--quantization-group-size", "48"])
