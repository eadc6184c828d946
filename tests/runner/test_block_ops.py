"""Whole-block moves on the KV cache: copy on write, swap out to host memory and back, in
groups of GROUP blocks, for a plain cache and a quantized one (values and scales)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.quantization.kv import QuantizedKV
from jaxllm.runner.block_ops import GROUP, BlockOps

BS, BLOCKS = 4, 40  # more blocks than one group moves at once
SHAPE = (2, 2, 1, BLOCKS * BS, 3)  # [layers, 2, kv_heads, slots, head_dim]


def numbered_cache() -> np.ndarray:
    """Every value names its block: block b's slots hold b + a small per-element offset."""
    slots = np.arange(BLOCKS * BS)
    base = (slots // BS).astype(np.float32)[None, None, None, :, None]
    offset = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) % 7 / 100
    return base + offset


def block(cache, b: int) -> np.ndarray:
    return np.asarray(cache)[:, :, :, b * BS:(b + 1) * BS]


@pytest.fixture(params=[False, True], ids=["eager", "compiled"])
def compiled(request):
    return request.param


def ops_for(cache, num_host_blocks: int = 0, compiled: bool = False) -> BlockOps:
    ops = BlockOps(cache, BS, num_host_blocks)
    if compiled:
        ops.compile()
    return ops


def test_copy_moves_whole_blocks_and_leaves_the_rest(compiled):
    start = numbered_cache()
    ops = ops_for(jnp.asarray(start), compiled=compiled)
    out = ops.copy(jnp.asarray(start), [(3, 10), (7, 2)])
    np.testing.assert_array_equal(block(out, 10), block(start, 3))
    np.testing.assert_array_equal(block(out, 2), block(start, 7))
    untouched = [b for b in range(BLOCKS) if b not in (10, 2)]
    for b in untouched:
        np.testing.assert_array_equal(block(out, b), block(start, b))


def test_copy_of_more_pairs_than_a_group_moves_them_all():
    start = numbered_cache()
    ops = ops_for(jnp.asarray(start))
    pairs = [(b, b + GROUP + 2) for b in range(1, GROUP + 3)]  # GROUP + 2 pairs
    out = ops.copy(jnp.asarray(start), pairs)
    for src, dst in pairs:
        np.testing.assert_array_equal(block(out, dst), block(start, src))
    np.testing.assert_array_equal(block(out, 0), block(start, 0))


def test_no_pairs_changes_nothing():
    start = numbered_cache()
    ops = ops_for(jnp.asarray(start), num_host_blocks=2)
    cache = jnp.asarray(start)
    for move in (ops.copy, ops.swap_out, ops.swap_in):
        cache = move(cache, [])
    np.testing.assert_array_equal(np.asarray(cache), start)


def test_swap_out_then_in_restores_blocks_at_new_places(compiled):
    start = numbered_cache()
    ops = ops_for(jnp.asarray(start), num_host_blocks=3, compiled=compiled)
    cache = ops.swap_out(jnp.asarray(start), [(5, 0), (9, 2)])
    # host block h holds the device block swapped into it, [layers, 2, kv_heads, BS, dim]
    np.testing.assert_array_equal(ops.host[0][0], block(start, 5))
    np.testing.assert_array_equal(ops.host[0][2], block(start, 9))
    np.testing.assert_array_equal(np.asarray(cache), start)  # a swap-out copies
    cache = ops.swap_in(cache, [(2, 20), (0, 21)])
    np.testing.assert_array_equal(block(cache, 20), block(start, 9))
    np.testing.assert_array_equal(block(cache, 21), block(start, 5))
    for b in set(range(BLOCKS)) - {20, 21}:
        np.testing.assert_array_equal(block(cache, b), block(start, b))


def test_without_host_blocks_there_is_no_host_copy():
    assert ops_for(jnp.asarray(numbered_cache())).host is None


def test_a_quantized_cache_moves_its_values_and_scales_together():
    values = numbered_cache()
    scales = values[..., 0] * 10  # [layers, 2, kv_heads, slots]
    cache = QuantizedKV(jnp.asarray(values), jnp.asarray(scales))
    ops = ops_for(jax.eval_shape(lambda: cache), num_host_blocks=1)
    out = ops.copy(cache, [(1, 30)])
    out = ops.swap_out(out, [(30, 0)])
    out = ops.swap_in(out, [(0, 31)])
    for b in (30, 31):
        np.testing.assert_array_equal(block(out.data, b), block(values, 1))
        np.testing.assert_array_equal(np.asarray(out.scale)[:, :, :, b * BS:(b + 1) * BS],
                                      scales[:, :, :, BS:2 * BS])
    np.testing.assert_array_equal(block(out.data, 2), block(values, 2))
