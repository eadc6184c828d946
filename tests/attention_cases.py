"""Random ragged paged-attention batches shared by the XLA-path and kernel tests."""
import jax.numpy as jnp
import numpy as np

from jaxllm.layers.attention_metadata import attention_metadata
from jaxllm.layers.attention_metadata import table_width


def make_case(seqs, *, heads=8, kv_heads=2, head_dim=64, block_size=16, layers=2, layer=1,
              T=None, S=None, max_model_len=1024, dtype=jnp.float32, seed=0, qt=None):
    """seqs: [(tokens already cached, tokens this step)]. Block tables are shuffled, the cache
    holds random K/V everywhere (the step's too, as if just written)."""
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
    md = attention_metadata(starts, n, tables, T, S, block_size, qt)
    cache = rng.standard_normal((layers, 2, kv_heads, num_blocks * block_size, head_dim))
    q = rng.standard_normal((T, heads, head_dim))
    return jnp.asarray(q, dtype), jnp.asarray(cache, dtype), layer, md
