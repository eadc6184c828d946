"""Random ragged paged-attention batches shared by the XLA-path and kernel tests."""
import jax.numpy as jnp
import numpy as np

from jaxllm.layers.attention_metadata import attention_metadata
from jaxllm.layers.attention_metadata import table_width


def make_case(seqs, *, heads=8, kv_heads=2, head_dim=64, block_size=16, layers=2, layer=1,
              T=None, S=None, max_model_len=1024, dtype=jnp.float32, seed=0, qt=None,
              tile_slots=None):
    """seqs: [(tokens already cached, tokens this step)]. Block tables are shuffled, the cache
    holds random K/V everywhere (the step's too, as if just written). tile_slots: the
    shape's room for prefill tiles (0: a decode-only shape)."""
    rng = np.random.default_rng(seed)
    starts = np.array([c for c, _ in seqs], np.int32)
    n = np.array([q for _, q in seqs], np.int32)
    T = T or int(n.sum())
    S = S or len(seqs)
    width = table_width(max_model_len, block_size)
    need = [-(-(c + q) // block_size) for c, q in seqs]
    num_blocks = sum(need) + 3
    ids = rng.permutation(np.arange(1, num_blocks))  # block 0 is the null block
    tables = np.zeros((len(seqs), width), np.int32)
    k = 0
    for i, m in enumerate(need):
        tables[i, :m] = ids[k:k + m]
        k += m
    md = attention_metadata(starts, n, tables, T, S, block_size, qt, num_tile_slots=tile_slots)
    cache = rng.standard_normal((layers, 2, kv_heads, num_blocks * block_size, head_dim))
    q = rng.standard_normal((T, heads, head_dim))
    return jnp.asarray(q, dtype), jnp.asarray(cache, dtype), layer, md


def quantize_cache(cache, kv_dtype, bits=False):
    """The float cache written through write_kv into an int8 / fp8 cache (with `bits`, fp8
    held as its bytes, as the CPU engine holds it), every slot of every layer, as the engine's
    steps would have."""
    from jaxllm.layers.attention import write_kv
    from jaxllm.quantization import kv as kvq
    L, _, KVH, slots, D = cache.shape
    qcache = kvq.make_cache(cache.shape, jnp.float32, kv_dtype, bits=bits)
    everything = jnp.arange(slots)
    for i in range(L):
        qcache = write_kv(qcache, i, cache[i, 0].swapaxes(0, 1), cache[i, 1].swapaxes(0, 1), everything)
    return qcache


# ragged batches for the Pallas kernels' tests: [(tokens already cached, tokens this step)]
KERNEL_CASES = {
    "single_token": [(0, 1)],
    "block_boundary": [(15, 1), (31, 1), (16, 16), (48, 17)],
    "long_context": [(1500, 1), (700, 90)],
    "prefill_and_decodes": [(0, 20), (7, 1), (100, 1), (33, 45), (0, 1), (250, 1), (0, 70)],
}


def check_kernels(seqs, heads, kv_heads, *, kernels, interpret, tol, head_dim=64,
                  dtype=jnp.float32, T=None, S=None, window=None, soft_cap=None, block_size=16,
                  seed=0, max_model_len=2048, kv_dtype=None, tile_slots=None):
    """One ragged batch through ragged_paged_attention's `kernels` family against the dense
    reference; tokens no kernel writes come out NaN and fail. kv_dtype ("int8", "fp8"): the
    cache quantized as the engine writes it, queries in `dtype`, the reference reading the
    dequantized cache."""
    import jax

    from jaxllm.quantization import kv as kvq
    from pallas_kernels.paged_attention_ref import ragged_paged_attention_ref
    from pallas_kernels.ragged_paged_attention import q_tile, ragged_paged_attention
    q, cache, layer, md = make_case(seqs, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                    block_size=block_size, T=T, S=S, max_model_len=max_model_len,
                                    dtype=dtype, seed=seed, qt=q_tile(heads // kv_heads),
                                    tile_slots=tile_slots)
    if kv_dtype is not None:
        cache = quantize_cache(cache.astype(jnp.float32), kv_dtype)
    md = jax.tree.map(jnp.asarray, md)
    scale = head_dim ** -0.5
    fn = jax.jit(lambda q, c, md: ragged_paged_attention(
        q, c, jnp.int32(layer), md, scale, window, soft_cap, interpret=interpret, poison=True,
        kernels=kernels))
    got = np.asarray(fn(q, cache, md), np.float32)
    ref_cache = cache if kv_dtype is None else kvq.dequantize(cache)
    want = np.asarray(ragged_paged_attention_ref(q, ref_cache, layer, md.positions, md.token_seq_ids,
                                                 md.block_tables, block_size, scale, window,
                                                 soft_cap), np.float32)
    real = int(md.query_start_loc[-1])
    assert np.isfinite(got[:real]).all(), "a token no kernel wrote"
    np.testing.assert_allclose(got[:real], want[:real], **tol)
