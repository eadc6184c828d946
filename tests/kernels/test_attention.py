"""The XLA paged-attention path against the dense reference on ragged batches."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import make_case, quantize_cache
from conftest import covering
from jaxllm.layers.attention import paged_attention_xla
from pallas_kernels.paged_attention_ref import ragged_paged_attention_ref

CASES = {
    "single_token": [(0, 1)],
    "decode_batch": [(5, 1), (16, 1), (31, 1), (200, 1)],
    "block_boundary": [(15, 1), (31, 1), (48, 16)],
    "fresh_prefills": [(0, 37), (0, 5), (0, 64)],
    "chunked_prefill": [(128, 70), (300, 3)],
    "mixed": [(0, 20), (7, 1), (100, 1), (33, 45), (0, 1), (250, 1)],
    "long_context": [(900, 1), (700, 90)],
    "one_long_sequence": [(500, 1)],
}


def _check(q, cache, layer, md, window=None, soft_cap=None, reference_cache=None):
    """Both passes in XLA and in the CPU kernels (which read the cache in place) against the
    dense reference, which reads `reference_cache` (default: the cache itself)."""
    md = jax.tree.map(jnp.asarray, md)
    scale = q.shape[-1] ** -0.5
    want = ragged_paged_attention_ref(q, cache if reference_cache is None else reference_cache,
                                      layer, md.positions, md.token_seq_ids, md.block_tables,
                                      md.block_size, scale, window, soft_cap)
    real = int(md.query_start_loc[-1])
    for use_kernel in (False, True):
        got = jax.jit(paged_attention_xla, static_argnums=(4, 5, 6, 7))(
            q, cache, layer, md, scale, window, soft_cap, use_kernel)
        np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(want)[:real], rtol=2e-5,
                                   atol=2e-5, err_msg=f"use_kernel={use_kernel}")


@pytest.mark.parametrize("name,kv_heads", covering(sorted(CASES), [1, 2, 8]))
def test_xla_matches_reference(name, kv_heads):
    q, cache, layer, md = make_case(CASES[name], kv_heads=kv_heads, seed=len(name) + kv_heads)
    _check(q, cache, layer, md)


def test_a_decode_only_shape_has_no_prefill_pass():
    """A decode step in a shape without room for prefill tiles (a GPU's square shapes) is
    the same attention, padded rows included; a prefill chunk cannot be laid out there."""
    seqs = CASES["decode_batch"]
    q, cache, layer, md = make_case(seqs, T=8, S=8, tile_slots=0)
    assert md.tile_seq.shape == (0,)
    _check(q, cache, layer, md)
    with pytest.raises(ValueError):
        make_case([(0, 2), (5, 1)], T=8, S=8, tile_slots=0)


def test_padded_rows_and_tokens():
    seqs = [(10, 3), (0, 1), (40, 1)]
    q, cache, layer, md = make_case(seqs, T=32, S=8)
    _check(q, cache, layer, md)


@pytest.mark.parametrize("window", [1, 8, 50])
def test_sliding_window(window):
    q, cache, layer, md = make_case(CASES["mixed"] + [(130, 40)], seed=window)
    _check(q, cache, layer, md, window=window)


@pytest.mark.parametrize("window", [30, 200])
def test_sliding_window_one_long_sequence(window):
    """A window that starts inside a block, over one sequence's long context."""
    q, cache, layer, md = make_case([(400, 1)], kv_heads=1, seed=window)
    _check(q, cache, layer, md, window=window)


def test_soft_cap():
    q, cache, layer, md = make_case(CASES["mixed"], seed=3)
    _check(q, cache, layer, md, soft_cap=5.0)


def test_gqa_ratio_three_head_dim_128():
    q, cache, layer, md = make_case(CASES["mixed"], heads=9, kv_heads=3, head_dim=128, block_size=8)
    _check(q, cache, layer, md)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (16, 1, 32), (4, 2, 96), (6, 3, 80)])
def test_bf16_bits_cache_and_head_shapes(heads, kv_heads, head_dim):
    """A bf16 cache held as uint16 bits (the CPU's bf16 policy), read by both decode paths, and
    the kernel's head shapes: groups of 3 (SmolLM2), 16 (more than its vector path holds: the
    scalar loop), head dims 32 and 96 (other vector widths), 80 (not a multiple of 16)."""
    from jaxllm.quantization import kv as kvq
    seqs = CASES["mixed"] + [(130, 40), (17, 1), (64, 1)]
    q, cache, layer, md = make_case(seqs, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                    seed=heads + head_dim)
    bits = jax.lax.bitcast_convert_type(cache.astype(jnp.bfloat16), kvq.BF16_BITS)
    _check(q, bits, layer, md, reference_cache=kvq.dequantize(bits))


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("backend", ["xla", "cpu-kernels", "pallas"])
def test_quantized_kv_cache(kv_dtype, backend):
    """int8 / fp8 K and V with a scale per token and head, written through write_kv: each
    attention path (XLA's, the CPU kernels reading the codes in place, Pallas) equals the
    reference on the dequantized cache, and stays within the format's rounding of the
    reference on the float cache."""
    from jaxllm.quantization import kv as kvq
    from pallas_kernels.ragged_paged_attention import q_tile, ragged_paged_attention
    q, cache, layer, md = make_case(CASES["mixed"] + [(130, 40)], kv_heads=2, seed=11,
                                    qt=q_tile(4) if backend == "pallas" else None)
    D = cache.shape[-1]
    qcache = quantize_cache(cache, kv_dtype)
    deq = kvq.dequantize(qcache)
    step = 1 / 127 if kv_dtype == "int8" else 32 / 448  # int8 step / e4m3 spacing at its top
    amax = np.abs(np.asarray(cache)).max(-1, keepdims=True)
    assert np.all(np.abs(np.asarray(deq) - np.asarray(cache)) <= amax * step * 0.51 + 1e-7)
    md = jax.tree.map(jnp.asarray, md)
    scale = D ** -0.5
    if backend != "pallas":
        got = jax.jit(paged_attention_xla, static_argnums=(4, 5, 6, 7))(
            q, qcache, layer, md, scale, None, None, backend == "cpu-kernels")
    else:
        got = ragged_paged_attention(q, qcache, layer, md, scale, interpret=True)
    ref = lambda c: ragged_paged_attention_ref(q, c, layer, md.positions, md.token_seq_ids,
                                               md.block_tables, md.block_size, scale)
    real = int(md.query_start_loc[-1])
    np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(ref(deq))[:real], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(ref(cache))[:real],
                               atol=0.03 if kv_dtype == "int8" else 0.15)


@pytest.mark.parametrize("kv_dtype,shape", covering(
    ["int8", "fp8", "fp8-bytes"],
    # heads, kv_heads, head_dim, window, soft_cap
    [(9, 3, 64, None, None), (16, 1, 32, None, None), (4, 2, 96, 50, None),
     (6, 3, 80, None, 5.0), (8, 2, 128, 8, None)]))
def test_quantized_cache_head_shapes(kv_dtype, shape):
    heads, kv_heads, head_dim, window, soft_cap = shape
    """The CPU kernels read int8 / fp8 codes and their scales in place, in both passes, at the
    kernel's head shapes (the vector paths, and the scalar loop for 16 heads a group and head
    dim 80), with a sliding window and a soft cap: XLA's path and the kernels both equal the
    reference over the dequantized cache. fp8-bytes: the fp8 cache as the CPU engine holds
    it (uint8), the same bytes as the float8 array's."""
    from jaxllm.quantization import kv as kvq
    seqs = CASES["mixed"] + [(130, 40), (17, 1), (64, 1)]
    q, cache, layer, md = make_case(seqs, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                    seed=heads + head_dim + len(kv_dtype))
    kv_dtype, _, held = kv_dtype.partition("-")
    qcache = quantize_cache(cache, kv_dtype, bits=held == "bytes")
    if held:
        as_fp8 = quantize_cache(cache, kv_dtype)
        assert qcache.data.dtype == kvq.FP8_BITS
        np.testing.assert_array_equal(
            np.asarray(qcache.data),
            np.asarray(jax.lax.bitcast_convert_type(as_fp8.data, kvq.FP8_BITS)))
        np.testing.assert_array_equal(np.asarray(qcache.scale), np.asarray(as_fp8.scale))
    _check(q, qcache, layer, md, window=window, soft_cap=soft_cap,
           reference_cache=kvq.dequantize(qcache))


def test_bf16_cache_kept_as_bits():
    """The CPU policy's bf16 KV cache is stored as uint16 bit patterns (XLA:CPU scatters into
    bf16 by converting the whole cache): written through write_kv it holds exactly the values'
    bf16 rounding, and attention over it equals attention over those values in f32."""
    from jaxllm.layers.attention import write_kv
    from jaxllm.quantization import kv as kvq
    q, cache, layer, md = make_case(CASES["mixed"] + [(130, 40)], kv_heads=2, seed=5)
    L, _, KVH, slots, D = cache.shape
    bits = kvq.make_cache(cache.shape, kvq.BF16_BITS)
    assert bits.dtype == jnp.uint16
    everything = jnp.arange(slots)
    for i in range(L):
        bits = write_kv(bits, i, cache[i, 0].swapaxes(0, 1), cache[i, 1].swapaxes(0, 1), everything)
    rounded = cache.astype(jnp.bfloat16).astype(jnp.float32)
    assert not np.array_equal(np.asarray(rounded), np.asarray(cache))  # the rounding is real
    np.testing.assert_array_equal(np.asarray(kvq.dequantize(bits)), np.asarray(rounded))
    md = jax.tree.map(jnp.asarray, md)
    scale = D ** -0.5
    attend = jax.jit(paged_attention_xla, static_argnums=(4,))
    real = int(md.query_start_loc[-1])
    np.testing.assert_array_equal(np.asarray(attend(q, bits, layer, md, scale))[:real],
                                  np.asarray(attend(q, rounded, layer, md, scale))[:real])


def test_cpu_engine_stores_a_bf16_cache_as_bits(tiny_llama, caplog):
    """kv_cache_dtype="bfloat16" on a CPU: a uint16 cache of bf16 bits, twice the tokens of an
    f32 cache (the log says so); the tokens stay close to the f32 cache's. "auto" is the same
    for a float checkpoint under the CPU's bf16 policy (as vLLM's auto: the weights' dtype),
    and f32 under float32 and for quantized weights (the default model)."""
    import logging

    from conftest import SMALL_ENGINE
    from jaxllm import LLM, SamplingParams
    with caplog.at_level(logging.INFO, logger="jaxllm"):
        half = LLM(tiny_llama, kv_cache_dtype="bfloat16", kv_cache_memory_bytes=1 << 22,
                   **SMALL_ENGINE)
    assert "KV cache dtype bfloat16: 2.00x the tokens of float32" in caplog.text
    assert half.llm_engine.runner.kv_cache.dtype == jnp.uint16
    auto = LLM(tiny_llama, kv_cache_memory_bytes=1 << 22, warmup=False, **SMALL_ENGINE)
    assert auto.llm_engine.runner.kv_cache.dtype == jnp.uint16
    assert auto.llm_engine.kv_manager.pool.num_blocks == half.llm_engine.kv_manager.pool.num_blocks
    default = LLM(warmup=False, **SMALL_ENGINE)  # quantized weights
    assert default.llm_engine.runner.kv_cache.dtype == jnp.float32
    full = LLM(tiny_llama, dtype="float32", kv_cache_memory_bytes=1 << 22, **SMALL_ENGINE)
    assert full.llm_engine.runner.kv_cache.dtype == jnp.float32
    assert half.llm_engine.kv_manager.pool.num_blocks >= 2 * full.llm_engine.kv_manager.pool.num_blocks - 1
    p = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
    a = half.generate([[5, 6, 7, 8, 9]], p, use_tqdm=False)[0].outputs[0]
    b = full.generate([[5, 6, 7, 8, 9]], p, use_tqdm=False)[0].outputs[0]
    assert a.token_ids[0] == b.token_ids[0]
    assert abs(a.logprobs[0][a.token_ids[0]].logprob - b.logprobs[0][b.token_ids[0]].logprob) < 0.05


@pytest.mark.parametrize("which", ["decode", "prefill"])
def test_cpu_kernels_refuse_a_block_outside_the_cache(which):
    """A block table pointing past the cache is an error from each kernel, not a stray read."""
    from jaxllm.kernels.cpu import attention as cpu_attention
    q, cache, layer, md = make_case([(40, 1) if which == "decode" else (40, 20)], seed=5)
    md.block_tables[0, 1] = cache.shape[3] // md.block_size  # one past the last block
    md = jax.tree.map(jnp.asarray, md)
    T, H, D = q.shape
    qg = q.reshape(T, cache.shape[2], H // cache.shape[2], D)

    def run():
        if which == "decode":
            return cpu_attention.decode_attention(qg, cache, layer, md.block_tables, md.seq_lens,
                                        jnp.zeros_like(md.seq_lens), md.block_size, None)
        return cpu_attention.prefill_attention(qg, cache, layer, md, None, None)
    with pytest.raises(Exception, match="block id is outside the cache"):
        jax.block_until_ready(jax.jit(run)())
