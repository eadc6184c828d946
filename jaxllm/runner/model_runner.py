"""The JAX side: host-side input preparation, the KV-cache array and ONE jitted step.

Every (tokens, seqs) bucket is compiled ahead of time at start-up; a step whose padded shape
has no compiled executable is a bug, not a reason to compile.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxllm.core.block_pool import NULL_BLOCK
from jaxllm.core.kv_cache_manager import cdiv
from jaxllm.core.scheduler import SchedulerOutput
from jaxllm.layers.attention import AttentionMetadata, kv_chunk, max_tiles, q_tile_size
from jaxllm.runner.block_ops import BlockOps
from jaxllm.runner.buckets import StepShapes, make_buckets
from jaxllm.runner.input_batch import InputBatch
from jaxllm.runner.sampler import SamplingMetadata, sample

logger = logging.getLogger(__name__)


def kv_cache_shape(arch, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (arch.num_layers, 2, arch.num_kv_heads, num_blocks * block_size, arch.head_dim)


def kv_bytes_per_block(arch, block_size: int, dtype) -> int:
    return (arch.num_layers * 2 * block_size * arch.num_kv_heads * arch.head_dim
            * jnp.dtype(dtype).itemsize)


def table_width(max_model_len: int, block_size: int) -> int:
    """Block-table columns: enough for max_model_len, rounded up to whole attention chunks
    so that the attention loop's chunked slices of a row never run off its end."""
    per_chunk = kv_chunk(block_size) // block_size
    return cdiv(cdiv(max_model_len, block_size), per_chunk) * per_chunk


def attention_metadata(starts: np.ndarray, n: np.ndarray, tables: np.ndarray, T: int, S: int,
                       block_size: int) -> AttentionMetadata:
    """The flat ragged layout of one step, padded to T tokens and S sequences.

    starts[i]: tokens of sequence i already in the cache; n[i]: its tokens this step;
    tables[i]: its block-table row. Padded tokens write to the null block.
    """
    S_real, T_real = len(n), int(n.sum())
    bs = block_size
    qsl = np.zeros(S + 1, np.int32)
    np.cumsum(n, out=qsl[1:S_real + 1])
    qsl[S_real + 1:] = T_real
    seq_ids = np.zeros(T, np.int32)
    seq_ids[:T_real] = np.repeat(np.arange(S_real, dtype=np.int32), n)
    positions = np.zeros(T, np.int32)
    positions[:T_real] = np.arange(T_real, dtype=np.int32) + np.repeat(starts - qsl[:S_real], n)
    real_pos = positions[:T_real]
    block_tables = np.full((S, tables.shape[1]), NULL_BLOCK, np.int32)
    block_tables[:S_real] = tables
    slots = np.full(T, NULL_BLOCK * bs, np.int32)
    slots[:T_real] = block_tables[seq_ids[:T_real], real_pos // bs] * bs + real_pos % bs
    seq_lens = np.zeros(S, np.int32)
    seq_lens[:S_real] = starts + n

    # prefill tiles: each sequence with more than one token, cut into query tiles
    qt = q_tile_size(T)
    W = max_tiles(T, S)
    multi = np.nonzero(n > 1)[0]
    per_seq = -(-n[multi] // qt)
    num_tiles = int(per_seq.sum())
    tile_seq = np.zeros(W, np.int32)
    tile_start = np.zeros(W, np.int32)
    tile_seq[:num_tiles] = np.repeat(multi, per_seq)
    first_tile = np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    tile_start[:num_tiles] = qsl[tile_seq[:num_tiles]] + (np.arange(num_tiles) - first_tile) * qt
    return AttentionMetadata(positions, slots, seq_ids, qsl, seq_lens, block_tables, tile_seq,
                             tile_start, np.int32(num_tiles), block_size=bs)


class ModelRunner:
    def __init__(self, loaded, dtype, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, num_host_blocks: int = 0):
        self.arch = loaded.arch
        self.graphdef = loaded.graphdef
        self.state = loaded.state
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = table_width(max_model_len, block_size)
        self.shapes = StepShapes(
            make_buckets(min(16, max_num_batched_tokens), max_num_batched_tokens, linear_from=1024),
            make_buckets(1, max_num_seqs))
        self.kv_cache = jnp.zeros(kv_cache_shape(self.arch, num_blocks, block_size), dtype)
        self.block_ops = BlockOps(self.kv_cache.shape, dtype, block_size, num_host_blocks)
        self.batch = InputBatch(max_num_seqs, max_model_len, self.max_blocks_per_seq)
        self.sampling: dict[str, tuple] = {}  # req_id -> (SamplingParams, seed)
        self._compiled: dict[tuple[int, int], object] = {}
        self.num_steps = 0
        self.num_compiles_after_warmup = 0
        graphdef = self.graphdef

        def step(state, kv_cache, input_ids, md, logits_indices, sampling_md):
            model = nnx.merge(graphdef, state)
            logits, kv_cache = model(kv_cache, input_ids, md, logits_indices)
            return sample(logits, sampling_md), kv_cache

        self._step = jax.jit(step, donate_argnums=(1,))

    # compilation
    def _abstract_inputs(self, T: int, S: int):
        i32, f32 = jnp.int32, jnp.float32
        sds = jax.ShapeDtypeStruct
        W = max_tiles(T, S)
        md = AttentionMetadata(sds((T,), i32), sds((T,), i32), sds((T,), i32), sds((S + 1,), i32),
                               sds((S,), i32), sds((S, self.max_blocks_per_seq), i32),
                               sds((W,), i32), sds((W,), i32), sds((), i32),
                               block_size=self.block_size)
        smd = SamplingMetadata(sds((S,), f32), sds((S,), i32), sds((S,), f32), sds((S,), f32),
                               sds((S,), jnp.uint32), sds((S,), i32))
        return sds((T,), i32), md, sds((S,), i32), smd

    def _compile(self, T: int, S: int):
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.state)
        kv = jax.ShapeDtypeStruct(self.kv_cache.shape, self.kv_cache.dtype)
        return self._step.lower(state, kv, *self._abstract_inputs(T, S)).compile()

    def compile_all(self, progress: bool = True) -> float:
        start = time.perf_counter()
        self.block_ops.compile()
        todo = [s for s in self.shapes.all if s not in self._compiled]
        # XLA compiles outside the GIL, so threads overlap the per-shape compiles
        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            futures = {shape: pool.submit(self._compile, *shape) for shape in todo}
            bar = tqdm(total=len(todo), desc="compiling step buckets", disable=not progress,
                       unit="shape")
            for shape, fut in futures.items():
                self._compiled[shape] = fut.result()
                bar.update(1)
            bar.close()
        return time.perf_counter() - start

    def activation_bytes(self) -> int:
        """Scratch memory of the largest step, measured from its compiled executable."""
        T, S = self.shapes.all[-1]
        exe = self._compiled.get((T, S)) or self._compile(T, S)
        analysis = exe.memory_analysis()
        return int(getattr(analysis, "temp_size_in_bytes", 0) or 0)

    # per-step state
    def _update_states(self, out: SchedulerOutput) -> None:
        batch = self.batch
        for rid in out.finished_req_ids:
            batch.remove(rid)
            self.sampling.pop(rid, None)
        for new in out.scheduled_new_reqs:
            batch.add(new.req_id, new.token_ids, new.num_prompt_tokens, new.block_ids,
                      new.num_computed_tokens)
            self.sampling[new.req_id] = new.sampling_params, new.seed
        for cached in out.scheduled_cached_reqs:
            row = batch.row_of[cached.req_id]
            batch.append_blocks(row, cached.new_block_ids)
            batch.num_computed_tokens[row] = cached.num_computed_tokens

    def _prepare(self, out: SchedulerOutput, req_ids: list[str]):
        """Padded numpy inputs of one step, vectorised over persistent-batch rows."""
        batch = self.batch
        rows = np.fromiter((batch.row_of[r] for r in req_ids), np.int32, len(req_ids))
        n = np.fromiter((out.num_scheduled_tokens[r] for r in req_ids), np.int32, len(req_ids))
        starts = batch.num_computed_tokens[rows]
        S_real, T_real = len(req_ids), int(n.sum())
        T, S = self.shapes.pick(T_real, S_real)
        md = attention_metadata(starts, n, batch.block_table[rows], T, S, self.block_size)
        tok_rows = rows[md.token_seq_ids[:T_real]]
        input_ids = np.zeros(T, np.int32)
        input_ids[:T_real] = batch.token_ids[tok_rows, md.positions[:T_real]]
        logits_idx = np.zeros(S, np.int32)
        logits_idx[:S_real] = md.query_start_loc[1:S_real + 1] - 1

        params = [self.sampling[r] for r in req_ids]

        def col(get, dtype, fill=0):
            a = np.full(S, fill, dtype)
            a[:S_real] = [get(p, seed) for p, seed in params]
            return a

        gen_index = np.zeros(S, np.int32)
        gen_index[:S_real] = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]
        smd = SamplingMetadata(col(lambda p, _: p.temperature, np.float32),
                               col(lambda p, _: p.top_k, np.int32),
                               col(lambda p, _: p.top_p, np.float32, 1.0),
                               col(lambda p, _: p.min_p, np.float32),
                               col(lambda _, seed: seed, np.uint32), gen_index)
        return rows, (T, S), (input_ids, md, logits_idx, smd)

    def execute_model(self, out: SchedulerOutput) -> dict[str, int]:
        if out.has_block_ops:
            # swap-outs first: their device blocks may be handed out again in this very step
            ops = self.block_ops
            self.kv_cache = ops.swap_out(self.kv_cache, out.blocks_to_swap_out)
            self.kv_cache = ops.swap_in(self.kv_cache, out.blocks_to_swap_in)
            self.kv_cache = ops.copy(self.kv_cache, out.blocks_to_copy)
        self._update_states(out)
        if out.is_empty:
            return {}
        req_ids = list(out.num_scheduled_tokens)
        rows, shape, inputs = self._prepare(out, req_ids)
        exe = self._compiled.get(shape)
        if exe is None:
            exe = self._compiled[shape] = self._compile(*shape)
            self.num_compiles_after_warmup += 1
            logger.warning("compiled step shape %s outside warm-up", shape)
        inputs = jax.device_put(inputs)
        tokens, self.kv_cache = exe(self.state, self.kv_cache, *inputs)
        tokens = np.asarray(tokens)
        self.num_steps += 1
        batch = self.batch
        sampled = {}
        for i, rid in enumerate(req_ids):
            row = rows[i]
            batch.num_computed_tokens[row] += out.num_scheduled_tokens[rid]
            if batch.num_computed_tokens[row] >= batch.num_tokens[row]:
                tok = int(tokens[i])
                batch.append_token(row, tok)
                sampled[rid] = tok
        return sampled
