"""The paged layout the attention layer reads: the cache's shape, the block table's width, and
AttentionMetadata of one step built on the host from the step's numpy layout (the runner's
input preparation and SmoothQuant's calibration pass both build it here)."""
from __future__ import annotations

import numpy as np

from jaxllm.core.block_pool import NULL_BLOCK
from jaxllm.core.kv_cache_manager import cdiv
from jaxllm.layers.attention import AttentionMetadata, kv_chunk, max_tiles, q_tile_size


def kv_cache_shape(arch, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """[layers, 2, kv_heads, slots, head_dim], slot = block * block_size + offset."""
    return (arch.num_layers, 2, arch.num_kv_heads, num_blocks * block_size, arch.head_dim)


def table_width(max_model_len: int, block_size: int) -> int:
    """Block-table columns: enough for max_model_len, rounded up to whole attention chunks
    so that the attention loop's chunked slices of a row never run off its end."""
    per_chunk = kv_chunk(block_size) // block_size
    return cdiv(cdiv(max_model_len, block_size), per_chunk) * per_chunk


def attention_metadata(starts: np.ndarray, n: np.ndarray, tables: np.ndarray, T: int, S: int,
                       block_size: int, qt: int | None = None,
                       rows: np.ndarray | None = None, on_device=None,
                       num_tile_slots: int | None = None) -> AttentionMetadata:
    """The flat ragged layout of one step, padded to T tokens and S sequences.

    starts[i]: tokens of sequence i already in the cache; n[i]: its tokens this step;
    tables[i]: its block-table row. Padded tokens write to the null block. With `rows`,
    sequence i's row is tables[rows[i]] and the metadata's block_tables is `on_device`:
    what the runner's step gathers them from on the device (jaxllm.runner.block_table).
    num_tile_slots: the shape's room for prefill tiles (StepShapes.tiles; default
    max_tiles).
    """
    S_real, T_real = len(n), int(n.sum())
    bs = block_size
    qt = qt or q_tile_size(T)
    given = rows is not None
    if not given:
        rows = np.arange(S_real)
    if (n == 1).all():  # one token per sequence (decode steps): no repeats, no tiles
        return _one_token_each(starts, tables, rows, given, on_device, T, S, bs, qt,
                               num_tile_slots)
    qsl = np.zeros(S + 1, np.int32)
    np.cumsum(n, out=qsl[1:S_real + 1])
    qsl[S_real + 1:] = T_real
    seq_ids = np.zeros(T, np.int32)
    seq_ids[:T_real] = np.repeat(np.arange(S_real, dtype=np.int32), n)
    positions = np.zeros(T, np.int32)
    positions[:T_real] = np.arange(T_real, dtype=np.int32) + np.repeat(starts - qsl[:S_real], n)
    real_pos = positions[:T_real]
    slots = np.full(T, NULL_BLOCK * bs, np.int32)
    slots[:T_real] = tables[rows[seq_ids[:T_real]], real_pos // bs] * bs + real_pos % bs
    seq_lens = np.zeros(S, np.int32)
    seq_lens[:S_real] = starts + n

    # prefill tiles: each sequence with more than one token, cut into query tiles
    W = max_tiles(T, S, qt) if num_tile_slots is None else num_tile_slots
    multi = np.nonzero(n > 1)[0]
    per_seq = -(-n[multi] // qt)
    num_tiles = int(per_seq.sum())
    if num_tiles > W:  # (a decode-only shape has no room: the step picked the wrong shape)
        raise ValueError(f"{num_tiles} prefill tiles exceed the step shape's room for {W}")
    tile_seq = np.zeros(W, np.int32)
    tile_start = np.zeros(W, np.int32)
    tile_seq[:num_tiles] = np.repeat(multi, per_seq)
    first_tile = np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    tile_start[:num_tiles] = qsl[tile_seq[:num_tiles]] + (np.arange(num_tiles) - first_tile) * qt
    return AttentionMetadata(positions, slots, seq_ids, qsl, seq_lens,
                             _step_tables(tables, rows, S, given, on_device), tile_seq, tile_start,
                             np.int32(num_tiles), block_size=bs, q_tile=qt)


def _step_tables(tables: np.ndarray, rows: np.ndarray, S: int, given: bool, on_device):
    if given:
        return on_device
    block_tables = np.full((S, tables.shape[1]), NULL_BLOCK, np.int32)
    block_tables[:len(rows)] = tables[rows]
    return block_tables


def _one_token_each(starts: np.ndarray, tables: np.ndarray, rows: np.ndarray, given: bool,
                    on_device, T: int, S: int, bs: int, qt: int,
                    num_tile_slots: int | None) -> AttentionMetadata:
    """attention_metadata of a step whose sequences have one token each."""
    S_real = len(starts)
    idx = np.arange(S_real, dtype=np.int32)
    qsl = np.full(S + 1, S_real, np.int32)
    qsl[:S_real] = idx
    seq_ids = np.zeros(T, np.int32)
    seq_ids[:S_real] = idx
    positions = np.zeros(T, np.int32)
    positions[:S_real] = starts
    slots = np.full(T, NULL_BLOCK * bs, np.int32)
    slots[:S_real] = tables[rows, starts // bs] * bs + starts % bs
    seq_lens = np.zeros(S, np.int32)
    seq_lens[:S_real] = starts + 1
    W = max_tiles(T, S, qt) if num_tile_slots is None else num_tile_slots
    return AttentionMetadata(positions, slots, seq_ids, qsl, seq_lens,
                             _step_tables(tables, rows, S, given, on_device),
                             np.zeros(W, np.int32), np.zeros(W, np.int32), np.int32(0),
                             block_size=bs, q_tile=qt)
