"""The quantized matmul kernels: the CPU kernels (int8, int4, w8a8, bf16, fp8; AMX and
AVX-512) and the Pallas group-quantized matmul against the XLA path and numpy."""
import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.layers.dtype_policy import uniform_policy
from jaxllm.quantization import formats as F
from jaxllm.quantization.qweight import QWeight, matmul_xla
from quant_util import rel

T = gguf.GGMLQuantizationType
RNG = np.random.default_rng(0)


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
