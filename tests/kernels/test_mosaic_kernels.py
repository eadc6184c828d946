"""The Mosaic GPU paged-attention kernels against the dense reference: in Mosaic GPU's
interpret mode on the CPU (shared memory, TMA copies and barriers simulated, races checked),
compiled for real on a GPU when JAXLLM_GPU_TESTS=1 (benchmarks/gpu_suite.sh); and lowered for
CUDA without one, where Mosaic's own lowering checks layouts, matmul shapes and shared memory."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import KERNEL_CASES, check_kernels, make_case, quantize_cache
from conftest import covering
from jaxllm.quantization import kv as kvq
from pallas_kernels import mosaic_paged_attention as mosaic
from pallas_kernels.paged_attention_ref import ragged_paged_attention_ref
from pallas_kernels.ragged_paged_attention import flat_pages, q_tile, ragged_paged_attention

ON_GPU = os.environ.get("JAXLLM_GPU_TESTS") == "1"
if ON_GPU and jax.default_backend() != "gpu":
    pytest.skip("JAXLLM_GPU_TESTS=1 needs a GPU", allow_module_level=True)
INTERPRET = not ON_GPU
TOL = dict(rtol=2e-2, atol=2e-2)  # bf16 / fp16 inputs, f32 accumulation

CASES = KERNEL_CASES


def check(seqs, heads, kv_heads, **kw):
    check_kernels(seqs, heads, kv_heads, kernels="mosaic", interpret=INTERPRET, tol=TOL,
                  dtype=kw.pop("dtype", jnp.bfloat16), **kw)
    if INTERPRET:
        assert not mosaic.races_found()


# (query, KV) heads: GQA 1, 3, 4, 8 and 16
@pytest.mark.parametrize("name,heads,head_dim", covering(
    sorted(CASES), [(4, 4), (6, 2), (8, 2), (16, 2), (16, 1)], [64, 80, 96, 128, 256]))
def test_mosaic_kernels_match_reference(name, heads, head_dim):
    check(CASES[name], *heads, head_dim=head_dim, seed=len(name) + heads[0] + head_dim)


def test_fp16_and_padded_rows_and_tokens():
    check([(10, 3), (0, 1), (40, 1)], 8, 2, dtype=jnp.float16, T=64, S=8)


@pytest.mark.parametrize("window", [1, 16, 100])
def test_sliding_window_and_soft_cap(window):
    check(CASES["prefill_and_decodes"] + [(400, 50)], 8, 2, window=window, soft_cap=3.0,
          seed=window)


@pytest.mark.parametrize("block_size", [8, 128])
def test_pages_smaller_and_larger_than_a_stage(block_size):
    """8-token pages: eight TMA copies per stage on one barrier; 128-token pages: a stage of
    one page; the last page of every sequence partly filled."""
    check([(5, 1), (130, 1), (70, 60), (0, 9)], 8, 2, block_size=block_size, max_model_len=512)


def test_random_batches():
    rng = np.random.default_rng(7)
    for trial in range(2):
        seqs = [(int(rng.integers(0, 300)), int(rng.choice([1, 1, 1, int(rng.integers(2, 90))])))
                for _ in range(int(rng.integers(1, 9)))]
        heads, kv = [(6, 2), (16, 2)][trial]
        check(seqs, heads, kv, head_dim=[80, 128][trial], seed=trial)


@pytest.mark.parametrize("kv_dtype,head_dim,block_size", covering(
    ["int8", "fp8"], [64, 80, 128, 256], [16, 8]))
def test_quantized_caches(kv_dtype, head_dim, block_size):
    """int8 / fp8 caches: the 8-bit pages and their tokens' scales come through the ring and
    are dequantised in the kernel (head size 80: 8-bit rows no swizzle divides), against the
    reference on the dequantised cache."""
    check(CASES["prefill_and_decodes"], 8, 2, head_dim=head_dim, block_size=block_size,
          kv_dtype=kv_dtype, seed=head_dim)


def test_quantized_cache_window_and_soft_cap():
    check(CASES["block_boundary"] + [(300, 40)], 16, 2, window=40, soft_cap=3.0,
          kv_dtype="fp8", head_dim=96, seed=5)


@pytest.mark.parametrize("k_splits,kv_dtype", [(1, None), (4, None), (4, "int8")])
def test_decode_split_k(k_splits, kv_dtype):
    """The decode kernel on its own (a race report of its own): long contexts split across
    programs and recombined; with an int8 cache, each split reads its own keys' scales."""
    seqs = [(1900, 1), (33, 1), (700, 1), (0, 1)]
    q, cache, layer, md = make_case(seqs, heads=8, kv_heads=2, max_model_len=2048, seed=k_splits,
                                    dtype=jnp.bfloat16)
    md = jax.tree.map(jnp.asarray, md)
    last = md.query_start_loc[1:] - 1
    bs = md.block_size
    layer_ids = jnp.array([layer], jnp.int32)
    pages, seq_scales, ref_cache = flat_pages(cache, bs), None, cache
    if kv_dtype:
        qcache = quantize_cache(cache.astype(jnp.float32), kv_dtype)
        pages, ref_cache = flat_pages(qcache.data, bs), kvq.dequantize(qcache)
        seq_scales = mosaic.sequence_scales(qcache.scale, layer_ids, md.block_tables, bs)
    got = mosaic.paged_decode(
        q.reshape(-1, 2, 4, 64)[last], pages, layer_ids,
        md.block_tables, md.seq_lens, jnp.zeros_like(md.seq_lens), kv_heads=2,
        blocks=cache.shape[3] // bs, block_size=bs, scale=0.125, k_splits=k_splits,
        interpret=mosaic.interpret_params() if INTERPRET else None, seq_scales=seq_scales)
    if INTERPRET:
        assert not mosaic.races_found()
    want = ragged_paged_attention_ref(q, ref_cache, layer, md.positions, md.token_seq_ids,
                                      md.block_tables, bs, 0.125)
    np.testing.assert_allclose(np.asarray(got).reshape(4, 8, 64),
                               np.asarray(want, np.float32)[np.asarray(last)], **TOL)


@pytest.mark.parametrize("head_dim,heads,kv_heads,block_size,window,soft_cap,seqs,kv_dtype", [
    (64, 8, 2, 16, None, None, [(5, 1)], None),  # a one-token step: query rows TMA-tiled by 8
    (80, 32, 32, 16, 16, 30.0, None, None),   # Phi-2's head size, no GQA
    (96, 28, 4, 16, None, None, None, None),  # GQA 7
    (128, 32, 8, 16, None, None, None, None),  # Llama-3-8B
    (128, 32, 8, 128, None, None, None, None),
    (256, 16, 1, 8, 100, 50.0, None, None),   # Gemma's head size, GQA 16: a shallower ring
    # quantized caches: 8-bit pages loaded in the matmuls' layout, dequantised, stored back
    (128, 32, 8, 16, None, None, None, "int8"),
    (80, 32, 32, 16, 16, 30.0, None, "fp8"),  # unswizzled 8-bit rows
    (256, 16, 1, 8, 100, 50.0, None, "int8"),
])
def test_kernels_lower_for_cuda_through_mosaic(head_dim, heads, kv_heads, block_size, window,
                                               soft_cap, seqs, kv_dtype):
    """Without a GPU, lower both kernels for CUDA through Mosaic GPU: its lowering places
    every array in a register layout, checks each warpgroup matmul's shapes and swizzles
    and the shared memory a block asks for (227 KiB on Hopper)."""
    from jax import export
    seqs = seqs or [(100, 1), (33, 45), (0, 1), (250, 1)]
    q, cache, layer, md = make_case(seqs, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                    block_size=block_size, dtype=jnp.bfloat16, max_model_len=512,
                                    qt=q_tile(heads // kv_heads))
    if kv_dtype:
        cache = quantize_cache(cache.astype(jnp.float32), kv_dtype)
    md = jax.tree.map(jnp.asarray, md)
    fn = jax.jit(lambda q, c, md: ragged_paged_attention(
        q, c, layer, md, head_dim ** -0.5, window, soft_cap, interpret=False, kernels="mosaic"))
    text = export.export(fn, platforms=["cuda"])(q, cache, md).mlir_module()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 2
    assert "triton" not in text


def test_unsupported_caches_are_refused():
    q, cache, layer, md = make_case([(3, 1)], dtype=jnp.float32)
    with pytest.raises(ValueError, match="pallas-mosaic.*bf16 or fp16"):
        ragged_paged_attention(q, cache, layer, jax.tree.map(jnp.asarray, md), 0.125,
                               interpret=True, kernels="mosaic")
    assert "int8 or fp8" in mosaic.supports(jnp.bfloat16, 128, jnp.uint8)
    assert mosaic.supports(jnp.float32, 128, jnp.int8) is None  # f32 queries: bf16 matmuls
    assert mosaic.matmul_dtype(jnp.float32) == jnp.bfloat16
    assert mosaic.matmul_dtype(jnp.float16) == jnp.float16
    assert mosaic.supports(jnp.bfloat16, 128, jnp.int8) is None
    assert "multiple of 16" in mosaic.supports(jnp.bfloat16, 72)
    assert mosaic.supports(jnp.bfloat16, 80) is None


def test_backend_choice():
    """"pallas" (and "auto" on a GPU) takes the Mosaic kernels where they apply, the Triton
    ones elsewhere, saying why; "pallas-mosaic" where it cannot run is an error."""
    from jaxllm.kernels import attention_backend as choose
    bf16 = jnp.bfloat16
    assert choose("auto", "gpu", bf16, None, 128, "9.0")[0] == "pallas-mosaic"
    assert choose("pallas", "gpu", bf16, None, 128, "10.0")[0] == "pallas-mosaic"
    backend, why = choose("pallas", "gpu", bf16, None, 128, "8.0")
    assert backend == "pallas-triton" and "Hopper" in why
    # int8 / fp8 caches: dequantised in the Mosaic kernels
    assert choose("auto", "gpu", bf16, jnp.int8, 128, "9.0")[0] == "pallas-mosaic"
    assert choose("pallas", "gpu", bf16, jnp.float8_e4m3fn, 80, "9.0")[0] == "pallas-mosaic"
    assert choose("pallas", "gpu", jnp.float32, None, 128, "9.0")[0] == "pallas-triton"
    assert choose("pallas", "cpu", bf16, None, 64)[0] == "pallas-mosaic"  # interpret mode
    assert choose("pallas-triton", "gpu", bf16, None, 128, "9.0")[0] == "pallas-triton"
    assert choose("auto", "cpu", bf16, None, 64)[0] == "cpu"
    assert choose("auto", "cpu", bf16, None, 64, cpu_kernels=False)[0] == "xla"
    backend, why = choose("pallas", "gpu", bf16, None, 128, "9.0", cuda_runtime=12080)
    assert backend == "pallas-triton" and "12.8" in why
    assert choose("pallas", "gpu", bf16, None, 128, "9.0", cuda_runtime=13000)[0] == "pallas-mosaic"
    with pytest.raises(ValueError, match="attention_backend 'pallas-mosaic'.*Hopper"):
        choose("pallas-mosaic", "gpu", bf16, None, 128, "8.9")
    with pytest.raises(ValueError, match="attention_backend 'pallas-mosaic'.*float32"):
        choose("pallas-mosaic", "cpu", jnp.float32, None, 64)
