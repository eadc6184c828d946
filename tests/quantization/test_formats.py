"""Quantized weight formats: int4 packing, the online quantizers, GGUF blocks and the
checkpoint packers (AWQ, GPTQ, compressed-tensors) against their references."""
import gguf
import numpy as np
import pytest

from jaxllm.quantization import formats as F

T = gguf.GGMLQuantizationType
RNG = np.random.default_rng(0)


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
