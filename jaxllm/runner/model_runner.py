"""The JAX side: host-side input preparation, the KV-cache array and ONE jitted step.

Every (tokens, seqs) bucket is compiled ahead of time at start-up; a step whose padded shape
has no compiled executable is a bug, not a reason to compile.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxllm.core.block_pool import NULL_BLOCK
from jaxllm.core.kv_cache_manager import cdiv
from jaxllm.core.scheduler import SchedulerOutput
from jaxllm.layers.attention import AttentionMetadata
from jaxllm.runner.buckets import make_buckets, pick, step_shapes
from jaxllm.runner.sampler import SamplingMetadata, sample

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int


def kv_cache_shape(arch, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (arch.num_layers, 2, num_blocks * block_size, arch.num_kv_heads, arch.head_dim)


def kv_bytes_per_block(arch, block_size: int, dtype) -> int:
    return (arch.num_layers * 2 * block_size * arch.num_kv_heads * arch.head_dim
            * jnp.dtype(dtype).itemsize)


class ModelRunner:
    def __init__(self, loaded, dtype, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int):
        self.arch = loaded.arch
        self.graphdef = loaded.graphdef
        self.state = loaded.state
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = cdiv(max_model_len, block_size)
        self.token_buckets = make_buckets(min(16, max_num_batched_tokens), max_num_batched_tokens)
        self.seq_buckets = make_buckets(1, max_num_seqs)
        self.shapes = step_shapes(self.token_buckets, self.seq_buckets)
        self.kv_cache = jnp.zeros(kv_cache_shape(self.arch, num_blocks, block_size), dtype)
        self.requests: dict[str, CachedRequestState] = {}
        self._compiled: dict[tuple[int, int], object] = {}
        self.num_steps = 0
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
        md = AttentionMetadata(sds((T,), i32), sds((T,), i32), sds((T,), i32), sds((S + 1,), i32),
                               sds((S,), i32), sds((S, self.max_blocks_per_seq), i32),
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
        todo = [s for s in self.shapes if s not in self._compiled]
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
        T, S = self.token_buckets[-1], self.seq_buckets[-1]
        exe = self._compiled.get((T, S)) or self._compile(T, S)
        analysis = exe.memory_analysis()
        return int(getattr(analysis, "temp_size_in_bytes", 0) or 0)

    # per-step state
    def _update_states(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids:
            self.requests.pop(rid, None)
        for new in out.scheduled_new_reqs:
            p = new.sampling_params
            self.requests[new.req_id] = CachedRequestState(
                list(new.token_ids), new.num_prompt_tokens, list(new.block_ids),
                new.num_computed_tokens, p.temperature, p.top_k, p.top_p, p.min_p, new.seed)
        for cached in out.scheduled_cached_reqs:
            st = self.requests[cached.req_id]
            st.block_ids.extend(cached.new_block_ids)
            st.num_computed_tokens = cached.num_computed_tokens

    def _prepare(self, out: SchedulerOutput, req_ids: list[str]):
        states = [self.requests[r] for r in req_ids]
        n = np.fromiter((out.num_scheduled_tokens[r] for r in req_ids), np.int32, len(req_ids))
        starts = np.fromiter((s.num_computed_tokens for s in states), np.int32, len(states))
        S_real, T_real = len(req_ids), int(n.sum())
        S = pick(self.seq_buckets, S_real)
        T = pick(self.token_buckets, max(T_real, S))
        bs = self.block_size

        qsl = np.zeros(S + 1, np.int32)
        np.cumsum(n, out=qsl[1:S_real + 1])
        qsl[S_real + 1:] = T_real
        seq_ids = np.zeros(T, np.int32)
        seq_ids[:T_real] = np.repeat(np.arange(S_real, dtype=np.int32), n)
        positions = np.zeros(T, np.int32)
        positions[:T_real] = np.arange(T_real, dtype=np.int32) + np.repeat(starts - qsl[:S_real], n)
        input_ids = np.zeros(T, np.int32)
        input_ids[:T_real] = np.concatenate(
            [st.token_ids[s:s + k] for st, s, k in zip(states, starts, n)])
        tables = np.full((S, self.max_blocks_per_seq), NULL_BLOCK, np.int32)
        for i, st in enumerate(states):
            tables[i, :len(st.block_ids)] = st.block_ids
        slots = np.full(T, NULL_BLOCK * bs, np.int32)
        real_pos = positions[:T_real]
        slots[:T_real] = tables[seq_ids[:T_real], real_pos // bs] * bs + real_pos % bs
        seq_lens = np.zeros(S, np.int32)
        seq_lens[:S_real] = starts + n
        logits_idx = np.zeros(S, np.int32)
        logits_idx[:S_real] = qsl[1:S_real + 1] - 1

        def col(attr, dtype, fill=0):
            a = np.full(S, fill, dtype)
            a[:S_real] = [getattr(st, attr) for st in states]
            return a

        gen_index = np.zeros(S, np.int32)
        gen_index[:S_real] = [len(st.token_ids) - st.num_prompt_tokens for st in states]
        md = AttentionMetadata(positions, slots, seq_ids, qsl, seq_lens, tables, block_size=bs)
        smd = SamplingMetadata(col("temperature", np.float32), col("top_k", np.int32),
                               col("top_p", np.float32, 1.0), col("min_p", np.float32),
                               col("seed", np.uint32), gen_index)
        return (T, S), (input_ids, md, logits_idx, smd)

    def execute_model(self, out: SchedulerOutput) -> dict[str, int]:
        self._update_states(out)
        if out.is_empty:
            return {}
        req_ids = list(out.num_scheduled_tokens)
        shape, inputs = self._prepare(out, req_ids)
        exe = self._compiled.get(shape)
        if exe is None:
            exe = self._compiled[shape] = self._compile(*shape)
            logger.warning("compiled step shape %s outside warm-up", shape)
        inputs = jax.device_put(inputs)
        tokens, self.kv_cache = exe(self.state, self.kv_cache, *inputs)
        tokens = np.asarray(tokens)
        self.num_steps += 1
        sampled = {}
        for i, rid in enumerate(req_ids):
            st = self.requests[rid]
            st.num_computed_tokens += out.num_scheduled_tokens[rid]
            if st.num_computed_tokens >= len(st.token_ids):
                tok = int(tokens[i])
                st.token_ids.append(tok)
                sampled[rid] = tok
        return sampled
