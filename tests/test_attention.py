"""The XLA paged-attention path against the dense reference on ragged batches."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import make_case
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
}


def _check(q, cache, layer, md, window=None, soft_cap=None, padded_tokens=0):
    md = jax.tree.map(jnp.asarray, md)
    scale = q.shape[-1] ** -0.5
    got = jax.jit(paged_attention_xla, static_argnums=(4, 5, 6))(q, cache, layer, md, scale,
                                                                  window, soft_cap)
    want = ragged_paged_attention_ref(q, cache, layer, md.positions, md.token_seq_ids,
                                      md.block_tables, md.block_size, scale, window, soft_cap)
    real = int(md.query_start_loc[-1])
    np.testing.assert_allclose(np.asarray(got)[:real], np.asarray(want)[:real], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_xla_matches_reference(name, kv_heads):
    q, cache, layer, md = make_case(CASES[name], kv_heads=kv_heads, seed=len(name) + kv_heads)
    _check(q, cache, layer, md)


def test_padded_rows_and_tokens():
    seqs = [(10, 3), (0, 1), (40, 1)]
    q, cache, layer, md = make_case(seqs, T=32, S=8)
    _check(q, cache, layer, md)


@pytest.mark.parametrize("window", [1, 8, 50])
def test_sliding_window(window):
    q, cache, layer, md = make_case(CASES["mixed"] + [(130, 40)], seed=window)
    _check(q, cache, layer, md, window=window)


def test_soft_cap():
    q, cache, layer, md = make_case(CASES["mixed"], seed=3)
    _check(q, cache, layer, md, soft_cap=5.0)


def test_gqa_ratio_three_head_dim_128():
    q, cache, layer, md = make_case(CASES["mixed"], heads=9, kv_heads=3, head_dim=128, block_size=8)
    _check(q, cache, layer, md)
