"""The JAX side: host-side input preparation, the KV-cache array and the jitted step.

A step is two jitted calls launched back to back: the forward pass (the model, the logits of
the rows that sample, prompt logprobs) and sampling. Between the two the host may compute
what sampling needs that depends on the previous step's tokens: structured outputs' token
bitmask, while the device runs the forward pass. Every (tokens, seqs) bucket of the forward
pass and every seqs bucket of sampling is compiled ahead of time at start-up (the sampler once
per seqs bucket, not once per pair); a step whose padded shape has no compiled executable is a
bug, not a reason to compile. With `background=True` only a few shapes that together hold any
step compile before serving (StepShapes.essential); the rest compile on a thread while steps
run, each padded to the smallest shape compiled so far.

With multi-step scheduling a decode step is one call of several passes instead
(build_decode_passes), compiled before serving for every decode shape.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxllm.core.block_pool import NULL_BLOCK
from jaxllm.core.kv_cache_manager import cdiv
from jaxllm.core.scheduler import SchedulerOutput
from jaxllm.runner import executable_cache
from jaxllm.layers.attention import AttentionMetadata, kv_chunk, max_tiles, q_tile_size
from jaxllm.lora.ops import LoRAInputs
from jaxllm.models import get_model_class
from jaxllm.parallel import make_mesh, platform_of, sharding
from jaxllm.parallel import multiprocess as mp
from jaxllm.quantization import kv as kvq
from jaxllm.runner.block_ops import BlockOps
from jaxllm.runner.buckets import StepShapes, make_buckets
from jaxllm.runner.input_batch import COLUMNS, InputBatch
from jaxllm.runner.rejection_sampler import (VerifyMetadata, VerifyOutput, init_spec_state, no_verify,
                                             num_verify_rows, verify)
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


def build_forward(graphdef, vocab: int, state_sharding, kv_sharding, replicated, lora=None,
                  num_spec: int = 0):
    """The step's forward pass: the model over the flat batch, the logits of the rows that
    sample, and prompt logprobs when asked for. The cache is donated. A token the previous
    step sampled and the host does not know yet (async scheduling: -1) is taken from the
    sampler state on the device. After the step's inputs come:
    - with LoRA (`lora`: the slots' shardings, their number, the tensor-parallel size): the
      adapter slots' weights and each token's slot;
    - with speculative decoding (num_spec = k > 0): the verified positions (VerifyMetadata)
      and the proposals a draft model left on the device (SpecState: -2 - j in the input ids
      is proposal j); it then also returns what verification needs: the raw logits at the
      verified positions, the proposals they score, and the step's input ids as resolved.
    The two are not combined (EngineConfig refuses it)."""

    def forward(state, kv_cache, sampler_state, input_ids, md, logits_indices, smd, *extra):
        vmd, spec_state = extra if num_spec else (None, None)
        adapters = () if num_spec else extra
        model = nnx.merge(graphdef, state)
        rows = smd.rows[md.token_seq_ids]
        from_device = sampler_state.last_token[rows]
        if num_spec:
            slot = jnp.clip(-input_ids - 2, 0, num_spec - 1)
            from_device = jnp.where(input_ids <= -2, spec_state.draft_tokens[rows, slot], from_device)
        input_ids = jnp.where(input_ids < 0, from_device, input_ids)
        lora_in = None
        if adapters:
            (weights, token_slots), = adapters
            lora_in = LoRAInputs.of(weights, token_slots, lora[1], lora[2])
        hidden, kv_cache = model(kv_cache, input_ids, md, lora=lora_in)
        logits = model.compute_logits(hidden[logits_indices], jnp.sum(md.seq_lens > 0))
        T, k = hidden.shape[0], min(MAX_LOGPROBS, vocab)
        zeros = (jnp.zeros(T, jnp.float32), jnp.zeros(T, jnp.int32),
                 jnp.zeros((T, k), jnp.int32), jnp.zeros((T, k), jnp.float32))
        plp = jax.lax.cond(
            smd.any_prompt_logprobs,
            lambda h: prompt_logprobs(model.compute_logits, h, smd.next_ids,
                                      md.query_start_loc[-1], vocab),
            lambda h: zeros, hidden)
        if not num_spec:
            return logits.astype(jnp.float32), plp, kv_cache
        R = vmd.token_idx.shape[0]
        raw_v = jax.lax.cond(
            vmd.any_spec,
            lambda h: model.compute_logits(h[vmd.token_idx]).astype(jnp.float32),
            lambda h: jnp.zeros((R, vocab), jnp.float32), hidden)
        drafts = input_ids[vmd.token_idx + 1]  # each proposal follows the token that scores it
        return logits.astype(jnp.float32), plp, kv_cache, (raw_v, drafts, input_ids)

    rep = replicated
    extra = (rep, rep) if num_spec else () if lora is None else ((lora[0], rep),)
    outs = (rep, rep, kv_sharding) + ((rep,) if num_spec else ())
    return jax.jit(forward, donate_argnums=(1,),
                   in_shardings=(state_sharding, kv_sharding, rep, rep, rep, rep, rep, *extra),
                   out_shardings=outs)


def build_sample(replicated, num_spec: int = 0, spec_probabilistic: bool = False):
    """The step's sampling over the forward pass's logits, under a token bitmask when
    `use_mask` (structured outputs). The sampler state is donated; the sampled tokens also
    stay in it for the next step.

    With speculative decoding it also takes the forward pass's raw logits at the verified
    positions and their proposals (raw_v [R, V], drafts [R]), the VerifyMetadata and the
    SpecState, verifies the proposals by rejection sampling and emits up to k + 1 tokens per
    sequence: (tokens [S, k+1], num_tokens [S], logprob stats [S, k+1, ...])."""

    def sample_step(logits, sampler_state, smd, bitmask, use_mask, raw_v=None, drafts=None,
                    vmd=None, spec_state=None):
        base, sampler_state = sample(logits, smd, sampler_state, bitmask, use_mask)
        if not num_spec:
            return base, sampler_state

        def with_drafts(sampler_state):
            return verify(raw_v, drafts, base, smd, vmd, sampler_state, spec_state, num_spec,
                          spec_probabilistic)

        def without(sampler_state):
            return (*no_verify(base, smd, num_spec), sampler_state)

        tokens, num, stats, sampler_state = jax.lax.cond(vmd.any_spec, with_drafts, without,
                                                         sampler_state)
        return (tokens, num, *stats), sampler_state

    rep = replicated
    return jax.jit(sample_step, donate_argnums=(1,), in_shardings=rep, out_shardings=(rep, rep))


@jax.tree_util.register_dataclass
@dataclass
class PassesOutput:
    """A multi-step dispatch's results: `num_tokens[i]` tokens of row i, one per pass."""
    tokens: jax.Array        # [S, k] i32
    num_tokens: jax.Array    # [S] i32
    logprobs: jax.Array      # [S, k] f32
    ranks: jax.Array         # [S, k] i32
    top_ids: jax.Array       # [S, k, MAX_LOGPROBS] i32
    top_logprobs: jax.Array  # [S, k, MAX_LOGPROBS] f32


def build_decode_passes(graphdef, state_sharding, kv_sharding, replicated, num_passes: int,
                        lora=None):
    """Multi-step scheduling's device call: `num_passes` decode passes in one scan, each the
    forward pass over one token per sequence and sampling, whose tokens are the next pass's
    inputs. The inputs are a one-token-per-sequence step's (md as its first pass) and
    `num` [S], the passes each sequence takes: after its last one a sequence's pass computes
    its last position again, writing nothing (slot: the null block) and sampling nothing
    (is_final off), so the sampler state and the cache end as after num[i] single steps. The
    cache and the sampler state are donated. With LoRA, each token's slot stays the same."""

    def passes(state, kv_cache, sampler_state, input_ids, md, logits_indices, smd, num, *adapters):
        model = nnx.merge(graphdef, state)
        T = input_ids.shape[0]
        bs = md.block_size
        seq = md.token_seq_ids
        real = jnp.arange(T) < md.query_start_loc[-1]
        rows = smd.rows[seq]
        tok0 = jnp.where(input_ids < 0, sampler_state.last_token[rows], input_ids)
        num_tok = jnp.where(real, num[seq], 0)
        lora_in = None
        if adapters:
            (weights, token_slots), = adapters
            lora_in = LoRAInputs.of(weights, token_slots, lora[1], lora[2])
        n_real = jnp.sum(md.seq_lens > 0)

        def body(carry, j):
            kv, sampler_state, tok = carry
            ahead = jnp.minimum(j, jnp.maximum(num_tok - 1, 0))  # the last pass, again
            pos = md.positions + ahead
            block = md.block_tables[seq, jnp.minimum(pos // bs, md.block_tables.shape[1] - 1)]
            slots = jnp.where(j < num_tok, block * bs + pos % bs, NULL_BLOCK * bs)
            seq_ahead = jnp.minimum(j, jnp.maximum(num - 1, 0))
            md_j = dataclasses.replace(md, positions=pos, slot_mapping=slots,
                                       seq_lens=jnp.where(md.seq_lens > 0, md.seq_lens + seq_ahead, 0))
            hidden, kv = model(kv, tok, md_j, lora=lora_in)
            logits = model.compute_logits(hidden[logits_indices], n_real).astype(jnp.float32)
            smd_j = dataclasses.replace(smd, gen_index=smd.gen_index + j,
                                        is_final=smd.is_final & (j < num))
            out, sampler_state = sample(logits, smd_j, sampler_state)
            return (kv, sampler_state, jnp.where(real, out[0][seq], 0)), out

        (kv_cache, sampler_state, _), outs = jax.lax.scan(
            body, (kv_cache, sampler_state, tok0), jnp.arange(num_passes))
        tokens, lp, rank, top_ids, top_lp = (jnp.moveaxis(x, 0, 1) for x in outs)
        return PassesOutput(tokens, num, lp, rank, top_ids, top_lp), kv_cache, sampler_state

    rep = replicated
    extra = () if lora is None else ((lora[0], rep),)
    return jax.jit(passes, donate_argnums=(1, 2),
                   in_shardings=(state_sharding, kv_sharding) + (rep,) * 6 + extra,
                   out_shardings=(rep, kv_sharding, rep))


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


def abstract_step_inputs(T: int, S: int, block_size: int, max_blocks_per_seq: int, qt: int,
                         num_spec: int = 0):
    """Shapes of a (T tokens, S sequences) step's inputs after the state, cache and sampler
    state: input ids, attention metadata, logits indices, sampling metadata (and with
    speculative decoding the verified positions)."""
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
    if not num_spec:
        return sds((T,), i32), md, sds((S,), i32), smd
    vmd = abstract_verify_metadata(num_verify_rows(T, S, num_spec), S)
    return sds((T,), i32), md, sds((S,), i32), smd, vmd


def abstract_verify_metadata(R: int, S: int) -> VerifyMetadata:
    i32, b, sds = jnp.int32, jnp.bool_, jax.ShapeDtypeStruct
    return VerifyMetadata(sds((R,), i32), sds((R,), i32), sds((R,), i32), sds((R,), b),
                          sds((S,), i32), sds((S,), b), sds((), b), sds((), b))


def abstract_sample_inputs(S: int, vocab: int, smd):
    """Shapes of sampling's inputs after the sampler state: logits, sampling metadata (as
    sampling_only gives it), bitmask, use_mask."""
    sds = jax.ShapeDtypeStruct
    return (sds((S, vocab), jnp.float32), sampling_only(smd),
            sds((S, bitmask_words(vocab)), jnp.int32), sds((), jnp.bool_))


def _stop_thread(stop: threading.Event, thread: threading.Thread | None) -> None:
    stop.set()
    if thread is not None:
        thread.join()


def bitmask_words(vocab: int) -> int:
    return -(-vocab // 32)


class ModelRunner:
    def __init__(self, loaded, dtype, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, num_host_blocks: int = 0,
                 attention_backend: str = "xla", kv_cache_dtype: str = "auto", lora=None,
                 num_spec_tokens: int = 0, spec_probabilistic: bool = False,
                 num_scheduler_steps: int = 1):
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
            make_buckets(1, max_num_seqs), decode_buckets=decode, spec_width=num_spec_tokens + 1)
        self.replicated = sharding(self.mesh)
        kv_shape = kv_cache_shape(self.arch, num_blocks, block_size)
        self.kv_cache_dtype = kv_cache_dtype
        # XLA's attention on a CPU keeps an fp8 cache as bytes (kv.FP8_BITS), as a bf16 one
        self.kv_bits = platform_of(self.mesh) == "cpu" and attention_backend == "xla"
        make = lambda: kvq.make_cache(kv_shape, dtype, kv_cache_dtype, self.kv_bits)  # noqa: E731
        shapes = jax.eval_shape(make)
        self.kv_sharding = kv_cache_sharding(self.mesh, self.arch, shapes)
        self.kv_cache = jax.jit(make, out_shardings=self.kv_sharding)()
        self.sampler_state = jax.jit(lambda: init_state(max_num_seqs, self.vocab),
                                     out_shardings=self.replicated)()
        self.block_ops = BlockOps(shapes, block_size, num_host_blocks, self.kv_sharding)
        self.batch = InputBatch(max_num_seqs, max_model_len, self.max_blocks_per_seq)
        self._pending_rows: list[tuple[int, object]] = []  # rows whose sampler state to rebuild
        self._compiled: dict[tuple[int, int], object] = {}         # forward per (T, S)
        self._compiled_sample: dict[int, object] = {}               # sampling per S
        self._allow_all: dict[int, jax.Array] = {}  # per S: the bitmask of unconstrained steps
        # the shapes compiling after start-up (compile_all(background=True)), and its stop flag
        self._background: threading.Thread | None = None
        self._stop_background = threading.Event()
        self.background_compile_seconds: float | None = None  # once the thread has finished
        self.num_steps = 0            # forward passes dispatched (a multi-step call: its passes)
        self.num_steps_collected = 0  # ... and read back by collect()
        self.device_wait_seconds = 0.0  # host time spent waiting for steps' results
        self.num_compiles_after_warmup = 0
        self.channel = mp.Channel() if jax.process_count() > 1 else None
        # speculative decoding: k proposals per step at most; a draft model (spec_decode)
        # attaches itself as `drafter` and leaves its proposals in spec_state
        self.num_spec = num_spec_tokens
        self.spec_probabilistic = spec_probabilistic
        self.drafter = None
        self.spec_state = None
        if num_spec_tokens:
            self.spec_state = jax.jit(
                lambda: init_spec_state(max_num_seqs, num_spec_tokens, self.vocab, spec_probabilistic),
                out_shardings=self.replicated)()
        self._forward = build_forward(self.graphdef, self.vocab,
                                      jax.tree.map(lambda x: x.sharding, self.state),
                                      self.kv_sharding, self.replicated,
                                      lora and (lora.shardings, lora.num_slots, self.arch.tp_size),
                                      num_spec_tokens)
        self._sample = build_sample(self.replicated, num_spec_tokens, spec_probabilistic)
        # multi-step scheduling: the decode passes' call, per decode shape
        self.num_passes = num_scheduler_steps
        self._compiled_passes: dict[tuple[int, int], object] = {}
        if num_scheduler_steps > 1:
            self._passes = build_decode_passes(
                self.graphdef, jax.tree.map(lambda x: x.sharding, self.state), self.kv_sharding,
                self.replicated, num_scheduler_steps,
                lora and (lora.shardings, lora.num_slots, self.arch.tp_size))
        self._no_mask = jax.device_put(np.bool_(False), self.replicated)
        rep = self.replicated
        self._set_rows = jax.jit(set_rows, donate_argnums=(0,), in_shardings=rep, out_shardings=rep)

    def q_tile(self, T: int) -> int:
        return q_tile_size(T, self.attention_backend, self.arch.num_heads // self.arch.num_kv_heads)

    # compilation
    def _abstract_inputs(self, T: int, S: int):
        return abstract_step_inputs(T, S, self.block_size, self.max_blocks_per_seq, self.q_tile(T),
                                    self.num_spec)

    def _extra_state(self) -> tuple:
        """Device state the step reads after its inputs (a draft model's proposals)."""
        return (self.spec_state,) if self.num_spec else ()

    def _abstract(self, tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)

    def _compile(self, T: int, S: int):
        adapters = () if self.lora is None else (
            (self._abstract(self.lora.weights), jax.ShapeDtypeStruct((T,), jnp.int32)),)
        return executable_cache.compile(
            self._forward, self._abstract(self.state), self._abstract(self.kv_cache),
            self._abstract(self.sampler_state), *self._abstract_inputs(T, S),
            *self._abstract(self._extra_state()), *adapters,
            options=step_compiler_options(platform_of(self.mesh)))

    @property
    def passes_shapes(self) -> list[tuple[int, int]]:
        """The shapes of multi-step calls: those of a decode step of each batch size."""
        if self.num_passes <= 1:
            return []
        return sorted({self.shapes.pick(s, s) for s in range(1, self.max_num_seqs + 1)})

    def _compile_passes(self, T: int, S: int):
        ids, md, logits_idx, smd = self._abstract_inputs(T, S)[:4]
        adapters = () if self.lora is None else (
            (self._abstract(self.lora.weights), jax.ShapeDtypeStruct((T,), jnp.int32)),)
        return executable_cache.compile(
            self._passes, self._abstract(self.state), self._abstract(self.kv_cache),
            self._abstract(self.sampler_state), ids, md, logits_idx, sampling_only(smd),
            jax.ShapeDtypeStruct((S,), jnp.int32, sharding=self.replicated), *adapters,
            options=step_compiler_options(platform_of(self.mesh)))

    def sample_key(self, T: int, S: int):
        """Which compiled sampling a (T, S) step uses: one per seqs bucket, and with
        speculative decoding per (seqs, verified positions) pair."""
        return S if not self.num_spec else (S, num_verify_rows(T, S, self.num_spec))

    def _compile_sample(self, key):
        S, R = (key, 0) if not self.num_spec else key
        logits, smd, bitmask, use_mask = abstract_sample_inputs(
            S, self.vocab, self._abstract_inputs(S, S)[3])
        extra = ()
        if self.num_spec:
            sds = jax.ShapeDtypeStruct
            extra = (sds((R, self.vocab), jnp.float32), sds((R,), jnp.int32),
                     abstract_verify_metadata(R, S), self._abstract(self.spec_state))
        return executable_cache.compile(self._sample, logits, self._abstract(self.sampler_state),
                                        smd, bitmask, use_mask, *extra)

    @property
    def sample_buckets(self) -> list:
        return sorted({self.sample_key(T, S) for T, S in self.shapes.all})

    def _compile_jobs(self, shapes) -> list:
        """(table, key, compile) for the forward passes of `shapes` and their samplings that
        are not compiled yet."""
        jobs, keys = [], set()
        for s in shapes:  # each shape's sampling right after it: usable as soon as both are
            if s not in self._compiled:
                jobs.append((self._compiled, s, partial(self._compile, *s)))
            k = self.sample_key(*s)
            if k not in self._compiled_sample and k not in keys:
                keys.add(k)
                jobs.append((self._compiled_sample, k, partial(self._compile_sample, k)))
        return jobs

    def compile_all(self, progress: bool = True, background: bool = False) -> float:
        """Compile every step shape before returning, or with `background` only the essential
        ones, the rest on a thread (not with a draft model or several processes, whose steps
        must follow the same shapes). Returns the seconds spent before returning."""
        start = time.perf_counter()
        self.block_ops.compile()
        if self.lora is not None:
            self.lora.compile()
        K, sds = ROW_INIT_GROUP, jax.ShapeDtypeStruct
        self._set_rows = executable_cache.compile(
            self._set_rows, self._abstract(self.sampler_state), sds((K,), jnp.int32),
            sds((K, self.max_model_len), jnp.int32), sds((K,), jnp.int32), sds((K,), jnp.int32),
            sds((K, self.vocab), jnp.float32), sds((K, self.vocab), jnp.bool_))
        background = background and self.drafter is None and self.channel is None
        jobs = self._compile_jobs(self.shapes.essential if background else self.shapes.all)
        # a multi-step call's shape is fixed when the scheduler chooses it: all before serving
        jobs += [(self._compiled_passes, s, partial(self._compile_passes, *s))
                 for s in self.passes_shapes if s not in self._compiled_passes]
        # XLA compiles outside the GIL, so threads overlap the per-shape compiles
        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            futures = [(table, key, pool.submit(fn)) for table, key, fn in jobs]
            bar = tqdm(total=len(futures), desc="compiling step buckets", disable=not progress,
                       unit="shape")
            for table, key, fut in futures:
                table[key] = fut.result()
                bar.update(1)
            bar.close()
        rest = self._compile_jobs(self.shapes.all)
        if rest:
            # one thread: serving keeps the other cores
            self._background = threading.Thread(target=self._compile_rest, args=(rest,),
                                                name="jaxllm-compile", daemon=True)
            self._background.start()
            # at exit, wait for the executable in progress rather than unload XLA under it
            atexit.register(_stop_thread, self._stop_background, self._background)
            logger.info("%d step executables compile in the background; until each is ready "
                        "its steps pad to a larger compiled shape", len(rest))
        if self.drafter is not None:
            self.drafter.compile_all(self, progress)
        return time.perf_counter() - start

    def _compile_rest(self, jobs) -> None:
        start = time.perf_counter()
        for table, key, fn in jobs:
            if self._stop_background.is_set():
                return
            try:
                table[key] = fn()
            except Exception:  # steps keep padding to the compiled shapes
                logger.exception("background compilation of step shape %s failed", key)
        self.background_compile_seconds = time.perf_counter() - start
        logger.info("compiled the remaining %d step executables in the background in %.1f s",
                    len(jobs), self.background_compile_seconds)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the background compilation (if any); True when every shape is compiled."""
        if self._background is not None:
            self._background.join(timeout)
        return all(self._ready(s) for s in self.shapes.all)

    def stop_background_compile(self) -> None:
        """Stop after the executable compiling now (XLA cannot be interrupted)."""
        _stop_thread(self._stop_background, self._background)

    def pick_shape(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The step shape of num_tokens tokens in num_seqs sequences: the smallest bucket, or
        after compile_all(background=True), until that bucket is compiled (or if its compile
        failed), the smallest compiled one that holds them: a step never compiles."""
        shape = self.shapes.pick(num_tokens, num_seqs)
        if self._background is None or self._ready(shape):
            return shape
        buckets = self.shapes.token_buckets
        for t in buckets[buckets.index(shape[0]):]:
            for s in self.shapes.seqs_for[t]:
                if s >= num_seqs and self._ready((t, s)):
                    return t, s
        return shape  # not reached: the largest shape compiles before serving

    def _ready(self, shape) -> bool:
        return shape in self._compiled and self.sample_key(*shape) in self._compiled_sample

    @property
    def num_compiled(self) -> int:
        return len(self._compiled) + len(self._compiled_sample) + len(self._compiled_passes)

    def activation_bytes(self) -> int:
        """Scratch memory of the largest step, measured from its compiled executables."""
        T, S = self.shapes.all[-1]
        fwd = self._compiled.get((T, S)) or self._compile(T, S)
        key = self.sample_key(T, S)
        smp = self._compiled_sample.get(key) or self._compile_sample(key)
        # with speculative decoding the verified positions' logits also wait for sampling
        rows = S + (num_verify_rows(T, S, self.num_spec) if self.num_spec else 0)
        return step_scratch_bytes(fwd, smp, rows, self.vocab)

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
            if cached.new_block_ids:
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
    def _args(self, tree):
        """A step's host inputs as the executables take them. On one process that is the
        numpy arrays themselves: an executable's C++ call transfers them (measured: ~20 us for
        a step's ~35 inputs, against ~0.8 ms through device_put's Python path)."""
        if jax.process_count() == 1:
            return jax.tree.map(np.asarray, tree)
        return self._put(tree)

    def _put(self, tree):
        """On the device (inputs kept there: a cached mask, replayed steps)."""
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
        args = self._args(inputs)
        # with LoRA: the slots' weights and each token's slot (jaxllm.lora)
        adapters = () if token_slots is None else ((self.lora.weights, self._args(token_slots)),)
        logits, plp, self.kv_cache, *spec = exe(self.state, self.kv_cache, self.sampler_state,
                                                *args, *self._extra_state(), *adapters)
        return _Forward(shape, args, logits, plp, sampling_only(args[3]), *spec)

    def _run_passes(self, shape, inputs, num: np.ndarray, token_slots=None) -> "PassesOutput":
        """A multi-step call of shape (T, S): num[i] decode passes of row i."""
        exe = self._compiled_passes.get(shape)
        if exe is None:
            exe = self._compiled_passes[shape] = self._compile_passes(*shape)
            self.num_compiles_after_warmup += 1
            logger.warning("compiled multi-step shape %s outside warm-up", shape)
        input_ids, md, logits_idx, smd = self._args(inputs)
        adapters = () if token_slots is None else ((self.lora.weights, self._args(token_slots)),)
        res, self.kv_cache, self.sampler_state = exe(
            self.state, self.kv_cache, self.sampler_state, input_ids, md, logits_idx,
            sampling_only(smd), num, *adapters)
        return res

    def _run_sample(self, key, fwd: "_Forward", bitmask: np.ndarray | None,
                    announced: bool = False):
        """Sampling of a step whose sampling key (sample_key) is `key`, under `bitmask`
        ([S, words] int32) when given."""
        S = fwd.logits.shape[0]
        if self.channel is not None:
            if not announced:
                self.channel.announce(mp.SAMPLE, S, int(bitmask is not None))
            if bitmask is not None:
                bitmask = self.channel.share(bitmask)
        exe = self._compiled_sample.get(key)
        if exe is None:
            exe = self._compiled_sample[key] = self._compile_sample(key)
            self.num_compiles_after_warmup += 1
            logger.warning("compiled sampling of shape %s outside warm-up", key)
        if bitmask is None:
            mask, use = self._allow_all.get(S), self._no_mask
            if mask is None:
                mask = self._allow_all[S] = self._put(
                    np.full((S, bitmask_words(self.vocab)), -1, np.int32))
        else:
            mask, use = self._args((bitmask, np.bool_(True)))
        extra = ()
        if self.num_spec:
            raw_v, drafts, _ = fwd.verify
            extra = (raw_v, drafts, fwd.args[4], self.spec_state)
        res, self.sampler_state = exe(fwd.logits, self.sampler_state, fwd.smd, mask, use, *extra)
        return res

    def _set_sampler_rows(self, args, announced: bool = False) -> None:
        if self.channel is not None:
            if not announced:
                self.channel.announce(mp.SET_ROWS)
            args = self.channel.share(args)
        self.sampler_state = self._set_rows(self.sampler_state, *self._args(args))

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
                mask = np.zeros((a, bitmask_words(V)), np.int32) if b else None
                self._run_sample(a, forward, mask, announced=True)
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
        (sampled by the step still in flight) is -1, taken from the device. A multi-step
        call's inputs are those of its first pass: one token per request."""
        batch = self.batch
        rows = np.fromiter((batch.row_of[r] for r in req_ids), np.int32, len(req_ids))
        if out.num_steps > 1:
            n = np.ones(len(req_ids), np.int32)
        else:
            n = np.fromiter((out.num_scheduled_tokens[r] for r in req_ids), np.int32, len(req_ids))
        start_of = {d.req_id: d.num_computed_tokens for d in out.scheduled_new_reqs}
        start_of.update((d.req_id, d.num_computed_tokens) for d in out.scheduled_cached_reqs)
        starts = np.fromiter((start_of[r] for r in req_ids), np.int32, len(req_ids))
        if len(out.sampling_req_ids) == len(req_ids):  # (every decode step)
            final = np.ones(len(req_ids), np.bool_)
        else:
            final = np.fromiter((r in out.sampling_req_ids for r in req_ids), np.bool_, len(req_ids))
        spec = out.scheduled_spec_decode_tokens
        if spec:
            nd = np.fromiter((len(spec.get(r, ())) for r in req_ids), np.int32, len(req_ids))
        else:
            nd = np.zeros(len(req_ids), np.int32)
        S_real, T_real = len(req_ids), int(n.sum())
        # a multi-step call takes the decode shape, compiled before serving (passes_shapes)
        T, S = (self.shapes.pick if out.num_steps > 1 else self.pick_shape)(T_real, S_real)
        md = attention_metadata(starts, n, batch.block_table[rows], T, S, self.block_size,
                                self.q_tile(T))
        tok_rows = rows[md.token_seq_ids[:T_real]]
        pos = md.positions[:T_real]
        input_ids = np.zeros(T, np.int32)
        known = pos < batch.num_tokens[tok_rows]
        input_ids[:T_real] = np.where(known, batch.token_ids[tok_rows, np.where(known, pos, 0)], -1)
        logits_idx = np.zeros(S, np.int32)
        logits_idx[:S_real] = md.query_start_loc[1:S_real + 1] - 1
        smd = self._sampling_metadata(rows, n, starts, final, md, T, S, nd)
        inputs = (input_ids, md, logits_idx, smd)
        if self.num_spec:
            inputs += (self._verify_metadata(spec, req_ids, n, nd, md, smd, input_ids, T, S),)
        c = batch.cols
        step = _Step(req_ids, rows, batch.serial[rows].copy(), starts, n, final,
                     c["num_logprobs"][rows].copy(), c["num_prompt_logprobs"][rows].copy(),
                     batch.num_prompt_tokens[rows].copy(), nd)
        return step, (T, S), inputs

    def _token_slots(self, rows: np.ndarray, md: AttentionMetadata, T: int) -> np.ndarray:
        """Each token's adapter slot (0: none), the step's adapters brought in first."""
        keys = self.batch.lora_id[rows].tolist()
        slot_of, self.lora_failures = self.lora.activate(keys)
        row_slots = np.fromiter((slot_of.get(k, 0) for k in keys), np.int32, len(rows))
        T_real = int(md.query_start_loc[-1])
        token_slots = np.zeros(T, np.int32)
        token_slots[:T_real] = row_slots[md.token_seq_ids[:T_real]]
        return token_slots

    def _verify_metadata(self, spec, req_ids, n, nd, md, smd, input_ids, T: int, S: int):
        """The proposals are the last nd[i] tokens of sequence i: put them in the input ids
        (from the host, or -2 - j for a draft model's proposal j held on the device), and
        list the positions that score them."""
        R, k = num_verify_rows(T, S, self.num_spec), self.num_spec
        S_real, R_real = len(req_ids), int(nd.sum())
        if R_real > R:
            raise RuntimeError(f"{R_real} proposals exceed the step's {R} verified positions")
        seq = np.repeat(np.arange(S_real, dtype=np.int32), nd)
        pos = np.arange(R_real, dtype=np.int32) - np.repeat(np.cumsum(nd) - nd, nd).astype(np.int32)
        first = md.query_start_loc[:S_real] + n - nd  # each sequence's first proposal
        if R_real:
            drafts = np.concatenate([spec[r] for r, m in zip(req_ids, nd) if m]).astype(np.int32)
            input_ids[first[seq] + pos] = np.where(drafts >= 0, drafts, -2 - pos)
        token_idx = np.zeros(R, np.int32)
        token_idx[:R_real] = first[seq] + pos - 1
        valid = np.zeros(R, np.bool_)
        valid[:R_real] = True
        nd_pad = np.zeros(S, np.int32)
        nd_pad[:S_real] = nd
        prob = (nd_pad > 0) & (smd.temperature >= GREEDY_EPS) & self.spec_probabilistic
        pad = np.zeros(R, np.int32)
        pad[:R_real] = seq
        pos_pad = np.zeros(R, np.int32)
        pos_pad[:R_real] = pos
        return VerifyMetadata(token_idx, pad, pos_pad, valid, nd_pad, prob, np.bool_(R_real > 0),
                              np.bool_(prob.any()))

    def _sampling_metadata(self, rows, n, starts, final, md, T: int, S: int,
                           num_draft=None) -> SamplingMetadata:
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
        # verified proposals are drawn at earlier output indices than the row's last token
        first_index = gen_index.copy()
        if num_draft is not None:
            first_index[:S_real] -= num_draft
        is_final = np.zeros(S, np.bool_)
        is_final[:S_real] = final
        banned = np.full((S, MAX_BANNED), -1, np.int32)
        any_banned = False
        if batch.rows_with_bad_words:  # (few requests have them: no loop over all rows)
            for i in np.nonzero(np.isin(rows, list(batch.rows_with_bad_words)))[0].tolist():
                b = batch.banned_tokens(int(rows[i]))[:MAX_BANNED]
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
            np.bool_(cols["has_bias"].any()), np.bool_((cols["min_tokens"] > first_index).any()),
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
            if self.drafter is not None:  # the draft model's cache has the same blocks
                self.drafter.block_ops(out)
        self._update_states(out)
        if out.is_empty:
            return None
        step, shape, inputs = self._prepare(out, list(out.num_scheduled_tokens))
        smd = inputs[3]
        slots = None if self.lora is None else self._token_slots(step.rows, inputs[1], shape[0])
        if out.num_steps > 1:
            num = np.zeros(shape[1], np.int32)
            num[:len(step.req_ids)] = [out.num_scheduled_tokens[r] for r in step.req_ids]
            res = self._run_passes(shape, inputs, num, slots)
            self.num_steps += int(num.max())
            return InFlight(step, res, bool(smd.any_logprobs), False, passes=int(num.max()))
        fwd = self._run_forward(shape, inputs, slots)
        self.num_steps += 1
        flight = InFlight(step, None, bool(smd.any_logprobs), bool(smd.any_prompt_logprobs), fwd)
        if not masked:
            self.sample(flight)
        return flight

    def sample(self, flight: "InFlight", bitmask: np.ndarray | None = None) -> None:
        """Launch a dispatched step's sampling; `bitmask`: [rows of the step, words] int32,
        the tokens each row may sample (structured outputs)."""
        fwd = flight.pending
        S = fwd.logits.shape[0]
        if bitmask is not None and bitmask.shape[0] != S:  # padded rows allow everything
            full = np.full((S, bitmask.shape[1]), -1, np.int32)
            full[:bitmask.shape[0]] = bitmask
            bitmask = full
        res = self._run_sample(self.sample_key(*fwd.shape), fwd, bitmask)
        if self.num_spec:
            flight.result = VerifyOutput(*res, *fwd.plp, fwd.verify[2])
        else:
            flight.result = SamplerOutput(*res, *fwd.plp)
        flight.pending = None
        if self.drafter is not None:  # the next step's proposals, right behind this one
            self.drafter.propose(self, fwd.shape, fwd.args, flight.result, flight.step)

    def collect(self, flight: "InFlight | None") -> RunnerOutput:
        """Wait for a dispatched step and bring its tokens (and logprobs) to the host. The
        sampled tokens also go into the rows of requests still in the batch."""
        result = RunnerOutput()
        if flight is None:
            return result
        st, res = flight.step, flight.result
        self.num_steps_collected += flight.passes
        t = time.perf_counter()
        tokens = _host(res.tokens)  # waits for the device
        self.device_wait_seconds += time.perf_counter() - t
        batch = self.batch
        if flight.want_logprobs:
            lp, rank, top_ids, top_lp = (_host(x) for x in (res.logprobs, res.ranks,
                                                            res.top_ids, res.top_logprobs))
        if tokens.ndim == 1:  # one token per sequence: a step without speculation
            tokens, num = tokens[:, None], np.ones(len(tokens), np.int32)
            if flight.want_logprobs:
                lp, rank, top_ids, top_lp = lp[:, None], rank[:, None], top_ids[:, None], top_lp[:, None]
        else:
            num = _host(res.num_tokens)
        final = np.nonzero(st.final)[0]
        rows, nums, toks = st.rows[final], num[final], tokens[final]
        firsts = (st.starts + st.n - st.num_draft)[final]
        # a row given to another request meanwhile (finished, preempted) keeps its tokens;
        # the first emitted token follows the row's known tokens (and accepted proposals)
        into = (batch.serial[rows] == st.serials[final]) & (nums > 0)
        if into.any():  # all rows' tokens at once: the loops below are per request, not per token
            upto = np.arange(toks.shape[1]) < nums[:, None]
            keep = upto & into[:, None]
            cols = firsts[:, None] + np.arange(toks.shape[1])
            batch.token_ids[np.broadcast_to(rows[:, None], keep.shape)[keep], cols[keep]] = toks[keep]
            batch.num_tokens[rows[into]] = (firsts + nums)[into]
        req_ids = [st.req_ids[i] for i in final.tolist()]
        if bool((nums == toks.shape[1]).all()):
            result.sampled = dict(zip(req_ids, toks.tolist()))
        else:
            result.sampled = {rid: t[:m] for rid, t, m in zip(req_ids, toks.tolist(), nums.tolist())}
        if flight.want_logprobs:
            for i, rid, m, k in zip(final.tolist(), req_ids, nums.tolist(),
                                    st.num_logprobs[final].tolist()):
                if k >= 0:
                    result.logprobs[rid] = [Logprobs(float(lp[i, j]), int(rank[i, j]),
                                                     top_ids[i, j, :k].tolist(),
                                                     top_lp[i, j, :k].tolist()) for j in range(m)]
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
    num_draft: np.ndarray            # proposals verified per row


@dataclass
class InFlight:
    step: _Step
    result: SamplerOutput | None  # None until sampling is launched
    want_logprobs: bool
    want_prompt_logprobs: bool
    pending: "_Forward | None" = None  # the forward pass's outputs, until sampling takes them
    passes: int = 1  # a multi-step call's passes


@dataclass
class _Forward:
    """A dispatched forward pass, on the device, until sampling takes it."""
    shape: tuple[int, int]
    args: tuple          # the step's inputs on the device (a draft model reads them too)
    logits: jax.Array    # [S, V] of the rows that sample
    plp: tuple           # prompt logprobs
    smd: SamplingMetadata  # as sampling reads it
    verify: tuple | None = None  # speculative decoding: (raw logits at the verified
    #                              positions, the proposals, the resolved input ids)
