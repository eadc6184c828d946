"""The JAX side: host-side input preparation, the KV-cache array and the jitted step.

A step is two jitted calls launched back to back: the forward pass (the model, the logits of
the rows that sample, prompt logprobs) and sampling. Between the two the host may compute
what sampling needs that depends on the previous step's tokens: structured outputs' token
bitmask, while the device runs the forward pass. Every (tokens, seqs) bucket of the forward
pass and every seqs bucket of sampling is compiled ahead of time at start-up (the sampler once
per seqs bucket, not once per pair); a step whose padded shape has no compiled executable is a
bug, not a reason to compile.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxllm.core.block_pool import NULL_BLOCK
from jaxllm.core.kv_cache_manager import cdiv
from jaxllm.core.scheduler import SchedulerOutput
from jaxllm.layers.attention import AttentionMetadata, kv_chunk, max_tiles, q_tile_size
from jaxllm.lora.ops import LoRAInputs
from jaxllm.models import get_model_class
from jaxllm.parallel import make_mesh, platform_of, sharding
from jaxllm.parallel import multiprocess as mp
from jaxllm.quantization import kv as kvq
from jaxllm.runner.block_ops import BlockOps
from jaxllm.runner.buckets import StepShapes, make_buckets
from jaxllm.runner.input_batch import COLUMNS, InputBatch
from jaxllm.sampling_params import GREEDY_EPS
from jaxllm.runner.sampler import (MAX_BANNED, MAX_LOGPROBS, SamplerOutput, SamplingMetadata,
                                   init_state, prompt_logprobs, sample, set_rows)

logger = logging.getLogger(__name__)


def kv_cache_shape(arch, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (arch.num_layers, 2, arch.num_kv_heads, num_blocks * block_size, arch.head_dim)


def kv_bytes_per_block(arch, block_size: int, dtype, kv_cache_dtype: str = "auto") -> int:
    per_value = kvq.bytes_per_value(dtype, kv_cache_dtype, arch.head_dim)
    return int(arch.num_layers * 2 * block_size * arch.num_kv_heads * arch.head_dim * per_value)


def kv_cache_sharding(mesh, arch, cache):
    """The cache's shardings, shaped like the cache, from the model's KV axes."""
    axes = kvq.cache_axes(get_model_class(arch.architecture).KV_CACHE_AXES, cache)
    return jax.tree.map(lambda a: sharding(mesh, *a), axes, is_leaf=lambda x: isinstance(x, tuple))


def table_width(max_model_len: int, block_size: int) -> int:
    """Block-table columns: enough for max_model_len, rounded up to whole attention chunks
    so that the attention loop's chunked slices of a row never run off its end."""
    per_chunk = kv_chunk(block_size) // block_size
    return cdiv(cdiv(max_model_len, block_size), per_chunk) * per_chunk


def attention_metadata(starts: np.ndarray, n: np.ndarray, tables: np.ndarray, T: int, S: int,
                       block_size: int, qt: int | None = None) -> AttentionMetadata:
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
    qt = qt or q_tile_size(T)
    W = max_tiles(T, S, qt)
    multi = np.nonzero(n > 1)[0]
    per_seq = -(-n[multi] // qt)
    num_tiles = int(per_seq.sum())
    tile_seq = np.zeros(W, np.int32)
    tile_start = np.zeros(W, np.int32)
    tile_seq[:num_tiles] = np.repeat(multi, per_seq)
    first_tile = np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    tile_start[:num_tiles] = qsl[tile_seq[:num_tiles]] + (np.arange(num_tiles) - first_tile) * qt
    return AttentionMetadata(positions, slots, seq_ids, qsl, seq_lens, block_tables, tile_seq,
                             tile_start, np.int32(num_tiles), block_size=bs, q_tile=qt)


@dataclass
class Logprobs:
    """Logprob of a chosen token, its rank and the top alternatives (ids, logprobs)."""
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class RunnerOutput:
    """What one step produced: per sampling request, its new tokens (0..k of them) and, when
    asked for, one Logprobs per token."""
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    # requests computing prompt tokens that asked for them: (position of the first entry,
    # entries); the entry of position p scores prompt token p + 1
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] = field(default_factory=dict)


ROW_INIT_GROUP = 8  # sampler-state rows rebuilt per call


def _host(x) -> np.ndarray:
    """A replicated result on the host (with several processes, this process's copy)."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


def build_forward(graphdef, vocab: int, state_sharding, kv_sharding, replicated, lora=None):
    """The step's forward pass: the model over the flat batch, the logits of the rows that
    sample, and prompt logprobs when asked for. The cache is donated. A token the previous
    step sampled and the host does not know yet (async scheduling: -1) is taken from the
    sampler state on the device. With LoRA (`lora`: the slots' shardings, their number, the
    tensor-parallel size), one more argument after the step's inputs: the adapter slots'
    weights and each token's slot."""

    def forward(state, kv_cache, sampler_state, input_ids, md, logits_indices, smd, *adapters):
        model = nnx.merge(graphdef, state)
        from_device = sampler_state.last_token[smd.rows[md.token_seq_ids]]
        input_ids = jnp.where(input_ids < 0, from_device, input_ids)
        lora_in = None
        if adapters:
            (weights, token_slots), = adapters
            lora_in = LoRAInputs.of(weights, token_slots, lora[1], lora[2])
        hidden, kv_cache = model(kv_cache, input_ids, md, lora=lora_in)
        logits = model.compute_logits(hidden[logits_indices])
        T, k = hidden.shape[0], min(MAX_LOGPROBS, vocab)
        zeros = (jnp.zeros(T, jnp.float32), jnp.zeros(T, jnp.int32),
                 jnp.zeros((T, k), jnp.int32), jnp.zeros((T, k), jnp.float32))
        plp = jax.lax.cond(
            smd.any_prompt_logprobs,
            lambda h: prompt_logprobs(model.compute_logits, h, smd.next_ids,
                                      md.query_start_loc[-1], vocab),
            lambda h: zeros, hidden)
        return logits.astype(jnp.float32), plp, kv_cache

    rep = replicated
    extra = () if lora is None else ((lora[0], rep),)
    return jax.jit(forward, donate_argnums=(1,),
                   in_shardings=(state_sharding, kv_sharding, rep, rep, rep, rep, rep, *extra),
                   out_shardings=(rep, rep, kv_sharding))


def build_sample(replicated):
    """The step's sampling over the forward pass's logits, under a token bitmask when
    `use_mask` (structured outputs). The sampler state is donated; the sampled tokens also
    stay in it for the next step."""

    def sample_step(logits, sampler_state, smd, bitmask, use_mask):
        return sample(logits, smd, sampler_state, bitmask, use_mask)

    rep = replicated
    return jax.jit(sample_step, donate_argnums=(1,), in_shardings=rep, out_shardings=(rep, rep))


def sampling_only(smd):
    """The sampling metadata sampling reads: without the [T] prompt-logprob ids, so that the
    sampler compiles once per seqs bucket."""
    return dataclasses.replace(smd, next_ids=None)


def step_scratch_bytes(forward_exe, sample_exe, S: int, vocab: int) -> int:
    """Scratch memory of a step from its compiled calls: the larger of the two, plus the
    logits that live from one to the other."""
    def temp(exe):
        return int(getattr(exe.memory_analysis(), "temp_size_in_bytes", 0) or 0)
    return max(temp(forward_exe), temp(sample_exe)) + S * vocab * 4


def step_compiler_options(platform: str) -> dict | None:
    """XLA's GPU compiler plans a program's scratch within 80% of the device less the
    program's arguments, and recomputes matmuls (rematerialization) to fit. The step's
    arguments are the weights and the KV cache, most of the device by design, and the engine
    sizes the cache from the step's measured scratch itself, so that plan is given room."""
    return {"xla_gpu_memory_limit_slop_factor": 10000} if platform == "gpu" else None


def abstract_step_inputs(T: int, S: int, block_size: int, max_blocks_per_seq: int, qt: int):
    """Shapes of a (T tokens, S sequences) step's inputs after the state, cache and sampler
    state: input ids, attention metadata, logits indices, sampling metadata."""
    i32, f32, b = jnp.int32, jnp.float32, jnp.bool_
    sds = jax.ShapeDtypeStruct
    W = max_tiles(T, S, qt)
    md = AttentionMetadata(sds((T,), i32), sds((T,), i32), sds((T,), i32), sds((S + 1,), i32),
                           sds((S,), i32), sds((S, max_blocks_per_seq), i32),
                           sds((W,), i32), sds((W,), i32), sds((), i32),
                           block_size=block_size, q_tile=qt)
    smd = SamplingMetadata(
        sds((S,), f32), sds((S,), i32), sds((S,), f32), sds((S,), f32), sds((S,), jnp.uint32),
        sds((S,), i32), sds((S,), i32), sds((S,), b), sds((S,), f32), sds((S,), f32),
        sds((S,), f32), sds((S,), i32), sds((S,), b), sds((S, MAX_BANNED), i32), sds((T,), i32),
        *[sds((), b)] * 8)
    return sds((T,), i32), md, sds((S,), i32), smd


def abstract_sample_inputs(S: int, vocab: int, smd):
    """Shapes of sampling's inputs after the sampler state: logits, sampling metadata (as
    sampling_only gives it), bitmask, use_mask."""
    sds = jax.ShapeDtypeStruct
    return (sds((S, vocab), jnp.float32), sampling_only(smd),
            sds((S, bitmask_words(vocab)), jnp.int32), sds((), jnp.bool_))


def bitmask_words(vocab: int) -> int:
    return -(-vocab // 32)


class ModelRunner:
    def __init__(self, loaded, dtype, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, num_host_blocks: int = 0,
                 attention_backend: str = "xla", kv_cache_dtype: str = "auto", lora=None):
        self.arch = loaded.arch
        self.lora = lora  # jaxllm.lora.slots.LoRASlots, or None
        self.lora_failures: dict[int, str] = {}  # adapters the last dispatch could not bring in
        self.attention_backend = attention_backend
        self.graphdef = loaded.graphdef
        self.state = loaded.state
        self.dtype = dtype
        self.vocab = loaded.arch.vocab_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = table_width(max_model_len, block_size)
        # one device is a mesh of one: the same sharded code path
        self.mesh = loaded.mesh if loaded.mesh is not None else make_mesh(1)
        # on a CPU a step's cost follows its padded tokens: small decode batches get shapes
        # of their own instead of padding to 16 tokens
        decode = [1, 2, 4, 8] if platform_of(self.mesh) == "cpu" else []
        self.shapes = StepShapes(
            make_buckets(min(16, max_num_batched_tokens), max_num_batched_tokens, linear_from=1024),
            make_buckets(1, max_num_seqs), decode_buckets=decode)
        self.replicated = sharding(self.mesh)
        kv_shape = kv_cache_shape(self.arch, num_blocks, block_size)
        self.kv_cache_dtype = kv_cache_dtype
        shapes = jax.eval_shape(lambda: kvq.make_cache(kv_shape, dtype, kv_cache_dtype))
        self.kv_sharding = kv_cache_sharding(self.mesh, self.arch, shapes)
        self.kv_cache = jax.jit(lambda: kvq.make_cache(kv_shape, dtype, kv_cache_dtype),
                                out_shardings=self.kv_sharding)()
        self.sampler_state = jax.jit(lambda: init_state(max_num_seqs, self.vocab),
                                     out_shardings=self.replicated)()
        self.block_ops = BlockOps(shapes, block_size, num_host_blocks, self.kv_sharding)
        self.batch = InputBatch(max_num_seqs, max_model_len, self.max_blocks_per_seq)
        self._pending_rows: list[tuple[int, object]] = []  # rows whose sampler state to rebuild
        self._compiled: dict[tuple[int, int], object] = {}         # forward per (T, S)
        self._compiled_sample: dict[int, object] = {}               # sampling per S
        self._allow_all: dict[int, jax.Array] = {}  # per S: the bitmask of unconstrained steps
        self.num_steps = 0
        self.device_wait_seconds = 0.0  # host time spent waiting for steps' results
        self.num_compiles_after_warmup = 0
        self.channel = mp.Channel() if jax.process_count() > 1 else None
        self._forward = build_forward(self.graphdef, self.vocab,
                                      jax.tree.map(lambda x: x.sharding, self.state),
                                      self.kv_sharding, self.replicated,
                                      lora and (lora.shardings, lora.num_slots, self.arch.tp_size))
        self._sample = build_sample(self.replicated)
        self._no_mask = jax.device_put(np.bool_(False), self.replicated)
        rep = self.replicated
        self._set_rows = jax.jit(set_rows, donate_argnums=(0,), in_shardings=rep, out_shardings=rep)

    def q_tile(self, T: int) -> int:
        return q_tile_size(T, self.attention_backend, self.arch.num_heads // self.arch.num_kv_heads)

    # compilation
    def _abstract_inputs(self, T: int, S: int):
        return abstract_step_inputs(T, S, self.block_size, self.max_blocks_per_seq, self.q_tile(T))

    def _abstract(self, tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)

    def _compile(self, T: int, S: int):
        adapters = () if self.lora is None else (
            (self._abstract(self.lora.weights), jax.ShapeDtypeStruct((T,), jnp.int32)),)
        return self._forward.lower(self._abstract(self.state), self._abstract(self.kv_cache),
                                   self._abstract(self.sampler_state),
                                   *self._abstract_inputs(T, S), *adapters).compile(
            step_compiler_options(platform_of(self.mesh)))

    def _compile_sample(self, S: int):
        logits, smd, bitmask, use_mask = abstract_sample_inputs(
            S, self.vocab, self._abstract_inputs(S, S)[-1])
        return self._sample.lower(logits, self._abstract(self.sampler_state), smd, bitmask,
                                  use_mask).compile()

    @property
    def sample_buckets(self) -> list[int]:
        return sorted({S for _, S in self.shapes.all})

    def compile_all(self, progress: bool = True) -> float:
        start = time.perf_counter()
        self.block_ops.compile()
        if self.lora is not None:
            self.lora.compile()
        K, sds = ROW_INIT_GROUP, jax.ShapeDtypeStruct
        self._set_rows = self._set_rows.lower(
            self._abstract(self.sampler_state), sds((K,), jnp.int32),
            sds((K, self.max_model_len), jnp.int32), sds((K,), jnp.int32), sds((K,), jnp.int32),
            sds((K, self.vocab), jnp.float32), sds((K, self.vocab), jnp.bool_)).compile()
        todo = [s for s in self.shapes.all if s not in self._compiled]
        todo_sample = [S for S in self.sample_buckets if S not in self._compiled_sample]
        # XLA compiles outside the GIL, so threads overlap the per-shape compiles
        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            futures = {shape: pool.submit(self._compile, *shape) for shape in todo}
            futures.update({S: pool.submit(self._compile_sample, S) for S in todo_sample})
            bar = tqdm(total=len(futures), desc="compiling step buckets", disable=not progress,
                       unit="shape")
            for key, fut in futures.items():
                if isinstance(key, tuple):
                    self._compiled[key] = fut.result()
                else:
                    self._compiled_sample[key] = fut.result()
                bar.update(1)
            bar.close()
        return time.perf_counter() - start

    @property
    def num_compiled(self) -> int:
        return len(self._compiled) + len(self._compiled_sample)

    def activation_bytes(self) -> int:
        """Scratch memory of the largest step, measured from its compiled executables."""
        T, S = self.shapes.all[-1]
        fwd = self._compiled.get((T, S)) or self._compile(T, S)
        smp = self._compiled_sample.get(S) or self._compile_sample(S)
        return step_scratch_bytes(fwd, smp, S, self.vocab)

    # per-step state
    def _update_states(self, out: SchedulerOutput) -> None:
        batch = self.batch
        for rid in out.finished_req_ids:
            batch.remove(rid)
        for new in out.scheduled_new_reqs:
            p = new.sampling_params
            row = batch.add(new.req_id, new.token_ids, new.num_prompt_tokens, new.block_ids,
                            p, new.seed, new.bad_word_ids, new.lora_id)
            if p.has_penalties or p.has_bias or p.min_tokens > 0:
                self._pending_rows.append((row, new))
        for cached in out.scheduled_cached_reqs:
            batch.append_blocks(batch.row_of[cached.req_id], cached.new_block_ids)
        if self._pending_rows:
            self._init_sampler_rows()

    def _init_sampler_rows(self) -> None:
        """Rebuild the on-device sampler rows of requests entering the batch from their token
        lists (prefix hits, forks and swaps skip recomputing tokens, so counts come from here)."""
        K, V, L = ROW_INIT_GROUP, self.vocab, self.max_model_len
        pending, self._pending_rows = self._pending_rows, []
        for i in range(0, len(pending), K):
            group = pending[i:i + K]
            rows = np.full(K, self.max_num_seqs, np.int32)  # the spare row absorbs padding
            tokens = np.zeros((K, L), np.int32)
            n_prompt = np.zeros(K, np.int32)
            n_tok = np.zeros(K, np.int32)
            bias = np.zeros((K, V), np.float32)
            stop = np.zeros((K, V), np.bool_)
            for j, (row, new) in enumerate(group):
                p = new.sampling_params
                rows[j] = row
                tokens[j, :len(new.token_ids)] = new.token_ids
                n_prompt[j], n_tok[j] = new.num_prompt_tokens, len(new.token_ids)
                if p.allowed_token_ids is not None:
                    bias[j] = -np.inf
                    bias[j, p.allowed_token_ids] = 0.0
                for t, v in (p.logit_bias or {}).items():
                    bias[j, t] += v
                for w in new.bad_word_ids or ():
                    if len(w) == 1:
                        bias[j, w[0]] = -np.inf
                if p.min_tokens > 0:
                    stop[j, p.stop_token_ids] = True
                    if not p.ignore_eos and new.eos_token_id is not None:
                        stop[j, new.eos_token_id] = True
            self._set_sampler_rows((rows, tokens, n_prompt, n_tok, bias, stop))

    # device operations: with several processes, process 0 announces and shares each one so
    # that the others launch the same computation (follow())
    def _put(self, tree):
        if jax.process_count() == 1:  # one batched transfer for all the inputs
            leaves, treedef = jax.tree.flatten(tree)
            return jax.tree.unflatten(treedef, jax.device_put([np.asarray(x) for x in leaves],
                                                              self.replicated))
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.replicated, np.asarray(x)), tree)

    def _run_forward(self, shape, inputs, token_slots=None, announced: bool = False):
        """The forward pass of a (T, S) step: (logits, prompt logprobs, sampling metadata as
        sampling reads it), on the device. `token_slots`: each token's LoRA slot (with LoRA)."""
        if self.channel is not None:
            if not announced:
                self.channel.announce(mp.STEP, *shape)
            inputs = self.channel.share(inputs)
        exe = self._compiled.get(shape)
        if exe is None:
            exe = self._compiled[shape] = self._compile(*shape)
            self.num_compiles_after_warmup += 1
            logger.warning("compiled step shape %s outside warm-up", shape)
        args = self._put(inputs)
        # with LoRA: the slots' weights and each token's slot (jaxllm.lora)
        adapters = () if token_slots is None else ((self.lora.weights, self._put(token_slots)),)
        logits, plp, self.kv_cache = exe(self.state, self.kv_cache, self.sampler_state, *args,
                                         *adapters)
        return logits, plp, sampling_only(args[-1])

    def _run_sample(self, S: int, logits, smd, bitmask: np.ndarray | None,
                    announced: bool = False):
        """Sampling of an S-row step, under `bitmask` ([S, words] int32) when given."""
        if self.channel is not None:
            if not announced:
                self.channel.announce(mp.SAMPLE, S, int(bitmask is not None))
            if bitmask is not None:
                bitmask = self.channel.share(bitmask)
        exe = self._compiled_sample.get(S)
        if exe is None:
            exe = self._compiled_sample[S] = self._compile_sample(S)
            self.num_compiles_after_warmup += 1
            logger.warning("compiled sampling of %d rows outside warm-up", S)
        if bitmask is None:
            mask, use = self._allow_all.get(S), self._no_mask
            if mask is None:
                mask = self._allow_all[S] = self._put(
                    np.full((S, bitmask_words(self.vocab)), -1, np.int32))
        else:
            mask, use = self._put((bitmask, np.bool_(True)))
        res, self.sampler_state = exe(logits, self.sampler_state, smd, mask, use)
        return res

    def _set_sampler_rows(self, args, announced: bool = False) -> None:
        if self.channel is not None:
            if not announced:
                self.channel.announce(mp.SET_ROWS)
            args = self.channel.share(args)
        self.sampler_state = self._set_rows(self.sampler_state, *self._put(args))

    def _copy_blocks(self, pairs, announced: bool = False) -> None:
        if self.channel is not None:
            if not announced:
                self.channel.announce(mp.COPY, len(pairs))
            pairs = [tuple(p) for p in self.channel.share(np.asarray(pairs, np.int32).reshape(-1, 2))]
        self.kv_cache = self.block_ops.copy(self.kv_cache, pairs)

    def follow(self) -> None:
        """Followers: run process 0's device operations until it stops."""
        K, V, L = ROW_INIT_GROUP, self.vocab, self.max_model_len
        while True:
            op, a, b = self.channel.announce(0)
            if op == mp.STOP:
                return
            if op == mp.STEP:
                template = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), self._abstract_inputs(a, b))
                forward = self._run_forward((a, b), template, announced=True)
            elif op == mp.SAMPLE:
                logits, _, smd = forward
                mask = np.zeros((a, bitmask_words(V)), np.int32) if b else None
                self._run_sample(a, logits, smd, mask, announced=True)
            elif op == mp.SET_ROWS:
                self._set_sampler_rows((np.zeros(K, np.int32), np.zeros((K, L), np.int32),
                                        np.zeros(K, np.int32), np.zeros(K, np.int32),
                                        np.zeros((K, V), np.float32), np.zeros((K, V), np.bool_)),
                                       announced=True)
            elif op == mp.COPY:
                self._copy_blocks(np.zeros((a, 2), np.int32), announced=True)
            else:
                raise RuntimeError(f"unknown operation {op} from process 0")

    def stop_followers(self) -> None:
        if self.channel is not None and self.channel.is_leader:
            self.channel.announce(mp.STOP)
            self.channel = None

    def _prepare(self, out: SchedulerOutput, req_ids: list[str]):
        """Padded numpy inputs of one step, vectorised over persistent-batch rows. Positions
        and which rows sample come from the scheduler; a token the host does not know yet
        (sampled by the step still in flight) is -1, taken from the device."""
        batch = self.batch
        rows = np.fromiter((batch.row_of[r] for r in req_ids), np.int32, len(req_ids))
        n = np.fromiter((out.num_scheduled_tokens[r] for r in req_ids), np.int32, len(req_ids))
        start_of = {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
        start_of.update((d.req_id, d.num_computed_tokens) for d in out.scheduled_cached_reqs)
        starts = np.fromiter((start_of[r] for r in req_ids), np.int32, len(req_ids))
        final = np.fromiter((r in out.sampling_req_ids for r in req_ids), np.bool_, len(req_ids))
        S_real, T_real = len(req_ids), int(n.sum())
        T, S = self.shapes.pick(T_real, S_real)
        md = attention_metadata(starts, n, batch.block_table[rows], T, S, self.block_size,
                                self.q_tile(T))
        tok_rows = rows[md.token_seq_ids[:T_real]]
        pos = md.positions[:T_real]
        input_ids = np.zeros(T, np.int32)
        known = pos < batch.num_tokens[tok_rows]
        input_ids[:T_real] = np.where(known, batch.token_ids[tok_rows, np.where(known, pos, 0)], -1)
        logits_idx = np.zeros(S, np.int32)
        logits_idx[:S_real] = md.query_start_loc[1:S_real + 1] - 1
        smd = self._sampling_metadata(rows, n, starts, final, md, T, S)
        c = batch.cols
        step = _Step(req_ids, rows, batch.serial[rows].copy(), starts, n, final,
                     c["num_logprobs"][rows].copy(), c["num_prompt_logprobs"][rows].copy(),
                     batch.num_prompt_tokens[rows].copy())
        return step, (T, S), (input_ids, md, logits_idx, smd)

    def _token_slots(self, rows: np.ndarray, md: AttentionMetadata, T: int) -> np.ndarray:
        """Each token's adapter slot (0: none), the step's adapters brought in first."""
        keys = self.batch.lora_id[rows].tolist()
        slot_of, self.lora_failures = self.lora.activate(keys)
        row_slots = np.fromiter((slot_of.get(k, 0) for k in keys), np.int32, len(rows))
        T_real = int(md.query_start_loc[-1])
        token_slots = np.zeros(T, np.int32)
        token_slots[:T_real] = row_slots[md.token_seq_ids[:T_real]]
        return token_slots

    def _sampling_metadata(self, rows, n, starts, final, md, T: int, S: int) -> SamplingMetadata:
        batch, c = self.batch, self.batch.cols
        S_real, T_real = len(rows), int(n.sum())

        def col(name):
            dtype, fill = COLUMNS[name]
            a = np.full(S, fill, dtype)
            a[:S_real] = c[name][rows]
            return a

        cols = {name: col(name) for name in COLUMNS}
        pad_rows = np.full(S, self.max_num_seqs, np.int32)
        pad_rows[:S_real] = rows
        # the output index of the token each row samples: its seed stream's position
        gen_index = np.zeros(S, np.int32)
        gen_index[:S_real] = starts + n - batch.num_prompt_tokens[rows]
        is_final = np.zeros(S, np.bool_)
        is_final[:S_real] = final
        banned = np.full((S, MAX_BANNED), -1, np.int32)
        any_banned = False
        for i, row in enumerate(rows):
            if batch.bad_words[row] is not None:
                b = batch.banned_tokens(row)[:MAX_BANNED]
                banned[i, :len(b)] = b
                any_banned |= bool(b)
        next_ids = np.zeros(T, np.int32)
        want_plp = (cols["num_prompt_logprobs"] >= 0) & (np.arange(S) < S_real)
        any_plp = bool(want_plp.any())
        if any_plp:
            pos = md.positions[:T_real]
            tok_rows = rows[md.token_seq_ids[:T_real]]
            nxt = np.minimum(pos + 1, self.max_model_len - 1)
            in_prompt = pos + 1 < batch.num_prompt_tokens[tok_rows]
            next_ids[:T_real] = np.where(in_prompt, batch.token_ids[tok_rows, nxt], -1)
        random = cols["temperature"] >= GREEDY_EPS
        return SamplingMetadata(
            cols["temperature"], cols["top_k"], cols["top_p"], cols["min_p"], cols["seed"],
            gen_index, pad_rows, is_final, cols["repetition_penalty"], cols["frequency_penalty"],
            cols["presence_penalty"], cols["min_tokens"], cols["has_bias"], banned, next_ids,
            np.bool_(random.any()),
            np.bool_((random & ((cols["top_k"] > 0) | (cols["top_p"] < 1) | (cols["min_p"] > 0))).any()),
            np.bool_(((cols["repetition_penalty"] != 1) | (cols["frequency_penalty"] != 0)
                      | (cols["presence_penalty"] != 0)).any()),
            np.bool_(cols["has_bias"].any()), np.bool_((cols["min_tokens"] > gen_index).any()),
            np.bool_(any_banned), np.bool_((cols["num_logprobs"] >= 0).any()), np.bool_(any_plp))

    def dispatch(self, out: SchedulerOutput, masked: bool = False) -> "InFlight | None":
        """Start a step on the device and return at once (JAX dispatches asynchronously); its
        results are read by collect(). Block moves and row updates happen first. `masked`:
        only the forward pass starts; sample() launches sampling under a token bitmask that
        the host computes meanwhile."""
        self.lora_failures = {}
        if out.has_block_ops:
            # swap-outs first: their device blocks may be handed out again in this very step
            ops = self.block_ops
            self.kv_cache = ops.swap_out(self.kv_cache, out.blocks_to_swap_out)
            self.kv_cache = ops.swap_in(self.kv_cache, out.blocks_to_swap_in)
            self._copy_blocks(out.blocks_to_copy)
        self._update_states(out)
        if out.is_empty:
            return None
        step, shape, inputs = self._prepare(out, list(out.num_scheduled_tokens))
        smd = inputs[-1]
        slots = None if self.lora is None else self._token_slots(step.rows, inputs[1], shape[0])
        logits, plp, smd_dev = self._run_forward(shape, inputs, slots)
        self.num_steps += 1
        flight = InFlight(step, None, bool(smd.any_logprobs), bool(smd.any_prompt_logprobs),
                          (logits, plp, smd_dev))
        if not masked:
            self.sample(flight)
        return flight

    def sample(self, flight: "InFlight", bitmask: np.ndarray | None = None) -> None:
        """Launch a dispatched step's sampling; `bitmask`: [rows of the step, words] int32,
        the tokens each row may sample (structured outputs)."""
        logits, plp, smd = flight.pending
        S = logits.shape[0]
        if bitmask is not None and bitmask.shape[0] != S:  # padded rows allow everything
            full = np.full((S, bitmask.shape[1]), -1, np.int32)
            full[:bitmask.shape[0]] = bitmask
            bitmask = full
        res = self._run_sample(S, logits, smd, bitmask)
        flight.result, flight.pending = SamplerOutput(*res, *plp), None

    def collect(self, flight: "InFlight | None") -> RunnerOutput:
        """Wait for a dispatched step and bring its tokens (and logprobs) to the host. The
        sampled tokens also go into the rows of requests still in the batch."""
        result = RunnerOutput()
        if flight is None:
            return result
        st, res = flight.step, flight.result
        t = time.perf_counter()
        tokens = _host(res.tokens)  # waits for the device
        self.device_wait_seconds += time.perf_counter() - t
        batch = self.batch
        if flight.want_logprobs:
            lp, rank, top_ids, top_lp = (_host(x) for x in (res.logprobs, res.ranks,
                                                            res.top_ids, res.top_logprobs))
        held = batch.serial[st.rows] == st.serials
        for i in np.nonzero(st.final)[0]:
            rid, tok = st.req_ids[i], int(tokens[i])
            result.sampled[rid] = [tok]
            # a row given to another request meanwhile (finished, preempted) keeps its tokens
            if held[i]:
                batch.set_token(st.rows[i], st.starts[i] + st.n[i], tok)
            k = int(st.num_logprobs[i])
            if flight.want_logprobs and k >= 0:
                result.logprobs[rid] = [Logprobs(float(lp[i]), int(rank[i]),
                                                 top_ids[i, :k].tolist(), top_lp[i, :k].tolist())]
        if flight.want_prompt_logprobs:
            self._collect_prompt_logprobs(res, st, result)
        return result

    def execute_model(self, out: SchedulerOutput) -> RunnerOutput:
        """One step, synchronously."""
        return self.collect(self.dispatch(out))

    def _collect_prompt_logprobs(self, res, st: "_Step", result: RunnerOutput) -> None:
        plp, prank, pids, ptop = (_host(x) for x in (res.prompt_logprobs, res.prompt_ranks,
                                                    res.prompt_top_ids, res.prompt_top_logprobs))
        offset = 0
        for i, rid in enumerate(st.req_ids):
            n, k = int(st.n[i]), int(st.num_prompt_logprobs[i])
            if k >= 0:
                entries = []
                for t in range(offset, offset + n):
                    pos = st.starts[i] + t - offset
                    if pos + 1 < st.num_prompt_tokens[i]:
                        entries.append(Logprobs(float(plp[t]), int(prank[t]), pids[t, :k].tolist(),
                                                ptop[t, :k].tolist()))
                if entries:
                    result.prompt_logprobs[rid] = (int(st.starts[i]), entries)
            offset += n


@dataclass
class _Step:
    """The host's record of a dispatched step: which request each row of its outputs is."""
    req_ids: list[str]
    rows: np.ndarray
    serials: np.ndarray  # who held each row when the step was dispatched
    starts: np.ndarray
    n: np.ndarray
    final: np.ndarray  # the rows that sample
    num_logprobs: np.ndarray         # what each row asked for (the rows may be gone by collect)
    num_prompt_logprobs: np.ndarray
    num_prompt_tokens: np.ndarray


@dataclass
class InFlight:
    step: _Step
    result: SamplerOutput | None  # None until sampling is launched
    want_logprobs: bool
    want_prompt_logprobs: bool
    pending: tuple | None = None  # the forward pass's outputs, until sampling takes them
