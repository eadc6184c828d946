"""The block tables on the device, changed by deltas.

The persistent batch's block table ([max_num_seqs + 1, width], the spare last row all null)
lives on the device as well as on the host. A step does not send its sequences' rows: it
sends the entries appended since the last step (TableWrites: row, column, block) and each
sequence's block count, and the step's program writes the entries and gathers its rows,
masking every column past the count. So what crosses per step is O(blocks added), not
O(sequences x table width), which grows with the model length.

A row's stale columns (from the request that held it before) are never cleared: the mask
hides them. The entries of a step go in the step itself up to a capacity fixed by its shape
(write_capacity); more, as when requests arrive with long cached prefixes, are written first
by a small program of their own, WRITE_CHUNK entries a call, in the order they were made.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.core.block_pool import NULL_BLOCK

WRITE_CHUNK = 512  # entries per call of the program that writes what a step cannot hold


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TableWrites:
    """A step's changes to the device's block table and the counts that mask its rows. It
    stands where AttentionMetadata.block_tables goes until the step's program resolves it."""
    rows: jax.Array        # [U] persistent-batch row of each entry (padding: the spare row)
    cols: jax.Array        # [U] its column
    blocks: jax.Array      # [U] the block (padding: the null block)
    num_blocks: jax.Array  # [S] blocks in each sequence's row (padded sequences: 0)


def write_capacity(T: int, S: int, block_size: int) -> int:
    """Entries a (T, S) step holds: twice what its own tokens can need (each sequence's
    tokens span at most T / block_size + 1 new blocks, summed over sequences), so that the
    blocks allocated ahead (speculative and multi-step tokens) and most new requests'
    cached prefixes fit too."""
    return 2 * (S + -(-T // block_size))


def init_tables(max_num_seqs: int, width: int, sharding) -> jax.Array:
    return jax.jit(lambda: jnp.full((max_num_seqs + 1, width), NULL_BLOCK, jnp.int32),
                   out_shardings=sharding)()


def abstract_writes(T: int, S: int, block_size: int) -> TableWrites:
    U, sds = write_capacity(T, S, block_size), jax.ShapeDtypeStruct
    return TableWrites(sds((U,), jnp.int32), sds((U,), jnp.int32), sds((U,), jnp.int32),
                       sds((S,), jnp.int32))


def write(tables: jax.Array, rows, cols, blocks) -> jax.Array:
    # padding entries all write the null block into the spare row, which stays null; real
    # entries never repeat a place within one step's window (a holder only appends, and a
    # row freed in a step's output was written in an earlier window), so the scatter's
    # order among duplicates does not matter
    return tables.at[rows, cols].set(blocks)


def resolve(tables: jax.Array, writes: TableWrites, rows: jax.Array):
    """Inside a step's program: the table with the step's entries written, and the step's
    block tables [S, width] (sequence i is persistent-batch row rows[i])."""
    tables = write(tables, writes.rows, writes.cols, writes.blocks)
    cols = jnp.arange(tables.shape[1], dtype=jnp.int32)
    gathered = jnp.where(cols < writes.num_blocks[:, None], tables[rows], NULL_BLOCK)
    return tables, gathered


def build_write(sharding):
    """Writes WRITE_CHUNK entries (rows, cols, blocks) into the table (donated)."""
    return jax.jit(write, donate_argnums=(0,), in_shardings=sharding, out_shardings=sharding)


def abstract_chunk():
    sds = jax.ShapeDtypeStruct
    return tuple(sds((WRITE_CHUNK,), jnp.int32) for _ in range(3))


def split_writes(rows: np.ndarray, cols: np.ndarray, blocks: np.ndarray, capacity: int,
                 spare_row: int, num_blocks: np.ndarray):
    """The entries made since the last step, in order: the last `capacity` of them as the
    step's TableWrites (padded), the earlier ones as WRITE_CHUNK-sized chunks to write first.
    Returns (writes, chunks)."""
    n = len(rows)
    if n == 0:  # (most decode steps)
        return TableWrites(*_no_writes(capacity, spare_row), num_blocks), []
    cut = max(0, n - capacity)
    chunks = []
    for lo in range(0, cut, WRITE_CHUNK):
        hi = min(lo + WRITE_CHUNK, cut)
        chunks.append(tuple(_padded(x[lo:hi], WRITE_CHUNK, fill)
                            for x, fill in ((rows, spare_row), (cols, 0), (blocks, NULL_BLOCK))))
    step = TableWrites(_padded(rows[cut:], capacity, spare_row), _padded(cols[cut:], capacity, 0),
                       _padded(blocks[cut:], capacity, NULL_BLOCK), num_blocks)
    return step, chunks


def without_entries(writes: TableWrites, spare_row: int) -> TableWrites:
    """The same step with no entries to write (all padding), its block counts kept."""
    return TableWrites(*_no_writes(len(writes.rows), spare_row), writes.num_blocks)


@functools.lru_cache(maxsize=64)
def _no_writes(capacity: int, spare_row: int) -> tuple[np.ndarray, ...]:
    """A step's entries when it has none: all padding (read-only, shared)."""
    out = tuple(np.full(capacity, fill, np.int32) for fill in (spare_row, 0, NULL_BLOCK))
    for x in out:
        x.flags.writeable = False
    return out


def _padded(x: np.ndarray, size: int, fill: int) -> np.ndarray:
    out = np.full(size, fill, np.int32)
    out[:len(x)] = x
    return out
