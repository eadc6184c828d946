"""The Pallas paged-attention kernels against the dense reference: interpret mode on the CPU,
compiled for real on a GPU when JAXLLM_GPU_TESTS=1 (benchmarks/gpu_suite.sh)."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import KERNEL_CASES, check_kernels, make_case, quantize_cache
from conftest import covering
from pallas_kernels.paged_attention_ref import ragged_paged_attention_ref
from pallas_kernels.ragged_paged_attention import paged_decode, flat_pages, q_tile, ragged_paged_attention

ON_GPU = os.environ.get("JAXLLM_GPU_TESTS") == "1"
if ON_GPU and jax.default_backend() != "gpu":
    pytest.skip("JAXLLM_GPU_TESTS=1 needs a GPU", allow_module_level=True)
INTERPRET = not ON_GPU
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}

CASES = KERNEL_CASES


def check(seqs, heads, kv_heads, dtype=jnp.float32, **kw):
    check_kernels(seqs, heads, kv_heads, kernels="triton", interpret=INTERPRET, tol=TOL[dtype],
                  dtype=dtype, **kw)


@pytest.mark.parametrize("name,heads", covering(sorted(CASES), [(4, 4), (6, 2), (8, 2), (16, 2)]))
def test_kernels_match_reference(name, heads):  # heads: (query, KV) heads, GQA 1, 3, 4, 8
    heads, kv_heads = heads
    check(CASES[name], heads, kv_heads, seed=len(name) + heads)


def test_a_decode_only_shape():
    """A decode batch in a shape without room for prefill tiles (a GPU's square shapes),
    padded rows included: the decode kernel alone."""
    check([(5, 1), (16, 1), (31, 1), (200, 1)], 8, 2, T=8, S=8, tile_slots=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_dim_128_and_dtypes(dtype):
    check(CASES["prefill_and_decodes"], 8, 2, head_dim=128, dtype=dtype)


def test_padded_rows_and_tokens():
    check([(10, 3), (0, 1), (40, 1)], 8, 2, T=64, S=8)


@pytest.mark.parametrize("window", [1, 16, 100])
def test_sliding_window(window):
    check(CASES["prefill_and_decodes"] + [(400, 50)], 8, 2, window=window, seed=window)


def test_soft_cap_and_small_blocks():
    check(CASES["prefill_and_decodes"], 8, 2, soft_cap=3.0, block_size=8)


def test_random_batches():
    rng = np.random.default_rng(7)
    for trial in range(4):
        seqs = [(int(rng.integers(0, 600)), int(rng.choice([1, 1, 1, int(rng.integers(2, 90))])))
                for _ in range(int(rng.integers(1, 9)))]
        heads, kv = [(4, 4), (6, 2), (8, 2), (16, 2)][trial]
        check(seqs, heads, kv, seed=trial)


@pytest.mark.parametrize("k_splits", [1, 4, 16])
def test_decode_split_k(k_splits):
    """The decode fast path on its own: long contexts split across programs and recombined."""
    seqs = [(1900, 1), (33, 1), (700, 1), (0, 1)]
    q, cache, layer, md = make_case(seqs, heads=8, kv_heads=2, max_model_len=2048, seed=k_splits)
    md = jax.tree.map(jnp.asarray, md)
    last = md.query_start_loc[1:] - 1
    bs = md.block_size
    got = paged_decode(q.reshape(-1, 2, 4, 64)[last], flat_pages(cache, bs), jnp.array([layer], jnp.int32),
                       md.block_tables, md.seq_lens, jnp.zeros_like(md.seq_lens), kv_heads=2,
                       blocks=cache.shape[3] // bs, block_size=bs, scale=0.125, k_splits=k_splits,
                       interpret=INTERPRET)
    want = ragged_paged_attention_ref(q, cache, layer, md.positions, md.token_seq_ids,
                                      md.block_tables, bs, 0.125)
    np.testing.assert_allclose(np.asarray(got).reshape(4, 8, 64), np.asarray(want)[np.asarray(last)],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(ON_GPU, reason="the CPU engine comparison runs in interpret mode")
def test_engine_greedy_identical_with_either_backend(tiny_llama, tiny_llm):
    """f32 greedy through the whole engine: chunked prefill, decode, prefix hits."""
    from conftest import SMALL_ENGINE
    from jaxllm import LLM, SamplingParams

    rng = np.random.default_rng(3)
    shared = rng.integers(10, 40000, size=40).tolist()
    prompts = [shared + rng.integers(10, 40000, size=n).tolist() for n in (3, 30, 90)]
    prompts += [rng.integers(10, 40000, size=n).tolist() for n in (1, 17, 150)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    pallas = LLM(tiny_llama, dtype="float32", attention_backend="pallas", **SMALL_ENGINE)
    # f32: "pallas" takes the Triton kernels (the Mosaic ones are bf16/fp16)
    assert pallas.llm_engine.config.attention_backend == "pallas-triton"
    got = [o.outputs[0].token_ids for o in pallas.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


@pytest.mark.parametrize("dtype,head_dim,heads,kv_heads,window,soft_cap,kv_dtype", [
    (jnp.bfloat16, 128, 32, 8, None, None, None),   # Llama-3-8B's attention shape
    (jnp.bfloat16, 64, 9, 3, None, None, None),     # the default model's (GQA 3)
    (jnp.float32, 64, 8, 8, 16, 30.0, None),        # f32, no GQA, sliding window, soft cap
    (jnp.bfloat16, 80, 32, 32, None, None, None),   # Phi-2's head size: padded to 128 inside
    (jnp.float32, 96, 28, 4, None, None, None),     # GQA 7, head size 96
    (jnp.bfloat16, 128, 32, 8, None, None, "int8"),
    (jnp.bfloat16, 80, 32, 32, None, None, "fp8"),  # 8-bit pages padded in the gather
])
def test_kernels_lower_for_cuda_through_triton(dtype, head_dim, heads, kv_heads, window, soft_cap,
                                               kv_dtype):
    """Without a GPU, lower both kernels for CUDA: they must go through Pallas' Triton path
    (a bare pallas_call picks Mosaic GPU there, which these kernels are not written for) and
    every op in them must have a Triton lowering."""
    from jax import export
    seqs = [(100, 1), (33, 45), (0, 1), (250, 1)]
    q, cache, layer, md = make_case(seqs, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                    dtype=dtype, qt=q_tile(heads // kv_heads))
    if kv_dtype:
        cache = quantize_cache(cache.astype(jnp.float32), kv_dtype)
    md = jax.tree.map(jnp.asarray, md)
    fn = jax.jit(lambda q, c, md: ragged_paged_attention(q, c, layer, md, head_dim ** -0.5,
                                                         window, soft_cap, interpret=False))
    triton = "__gpu$xla.gpu.triton"
    exp = export.export(fn, platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])(q, cache, md)
    text = exp.mlir_module()
    for name in ("jaxllm_paged_decode", "jaxllm_paged_prefill"):
        assert f'name = "{name}"' in text
    assert text.count(f"@{triton}") == 2 and "mosaic_gpu" not in text


def test_decode_splits_fill_the_gpu_and_stop():
    """Split-K until about 1024 programs are in flight, in powers of two, never past 16."""
    from pallas_kernels.ragged_paged_attention import decode_splits
    for seqs in (1, 2, 8, 16, 64, 128, 256, 1024):
        for kv_heads in (1, 3, 8):
            k = decode_splits(seqs, kv_heads)
            assert 1 <= k <= 16 and k & (k - 1) == 0
            assert seqs * kv_heads * k >= 1024 or k == 16
            assert k == 1 or seqs * kv_heads * (k // 2) < 1024  # no more splits than needed


@pytest.mark.parametrize("head_dim,kv_dtype", [(80, None), (96, None), (80, "fp8"), (96, "int8")])
def test_head_dims_whose_key_chunk_is_not_a_power_of_two(head_dim, kv_dtype):
    """f32 at head_dim 80 used to give 3 pages a step, past the end of the (power-of-two)
    table near max_model_len: keys scored against the wrong pages. 8-bit caches pad their
    pages' rows with copies of the last column (not zeros): the result must not change."""
    check([(250, 1), (200, 40), (0, 5)], 8, 2, head_dim=head_dim, block_size=16,
          max_model_len=256, kv_dtype=kv_dtype)
