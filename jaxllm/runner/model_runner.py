"""The JAX side of a step: the persistent batch kept up to date, the step dispatched to the
device, its sampling launched, its tokens collected.

A step is two jitted calls launched back to back: the forward pass (the model, the logits of
the rows that sample, prompt logprobs) and sampling. Between the two the host may compute
what sampling needs that depends on the previous step's tokens: structured outputs' token
bitmask, while the device runs the forward pass. With multi-step scheduling a decode step is
one call of several passes instead. Beside this module: the KV cache (kv_cache),
input preparation (inputs), the programs (step_programs) and their executables (compiler),
the records of a step (outputs), and with several processes the leader's announcements
(jaxllm.parallel.leader).
"""
from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np

from jaxllm.core.scheduler_output import SchedulerOutput
from jaxllm.layers.attention import q_tile_size
from jaxllm.parallel import make_mesh, platform_of, sharding
from jaxllm.parallel import multiprocess as mp
from jaxllm.parallel.leader import Leader, call_args, device_put, to_host
from jaxllm.quantization import kv as kvq
from jaxllm import executable_cache
# (jaxllm.quantization.smoothquant reads attention_metadata and kv_cache_shape from here)
from jaxllm.runner.block_ops import BlockOps
from jaxllm.runner.block_table import abstract_chunk, build_write, init_tables
from jaxllm.runner.buckets import step_shapes
from jaxllm.runner.compiler import StepCompiler, StepPrograms, abstract
from jaxllm.runner.input_batch import InputBatch
from jaxllm.runner.inputs import InputPreparer
from jaxllm.runner.kv_cache import allocate_kv_cache
from jaxllm.layers.attention_metadata import table_width
from jaxllm.runner.outputs import (ForwardOutput, InFlight, Logprobs, PassesOutput,
                                   RunnerOutput, prompt_logprobs)
from jaxllm.runner.rejection_sampler import VerifyOutput, init_spec_state
from jaxllm.runner.sampler import SamplerOutput, init_state
from jaxllm.runner.step_programs import (ROW_INIT_GROUP, abstract_set_rows_inputs, bitmask_words,
                                         build_decode_passes, build_forward, build_sample,
                                         build_set_rows, packed_step, set_rows_inputs,
                                         step_compiler_options)

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, loaded, dtype, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, num_host_blocks: int = 0,
                 attention_backend: str = "cpu", kv_cache_dtype: str = "auto", lora=None,
                 num_spec_tokens: int = 0, spec_probabilistic: bool = False,
                 num_scheduler_steps: int = 1, token_buckets: list[int] | None = None,
                 seq_buckets: list[int] | None = None):
        """token_buckets, seq_buckets: the step shapes' lists (EngineConfig's); None: derived."""
        self.arch = loaded.arch
        self.lora = lora  # jaxllm.lora.slots.LoRASlots, or None
        self.lora_failures: dict[int, str] = {}  # adapters the last dispatch could not bring in
        self.attention_backend = attention_backend
        self.graphdef = loaded.graphdef
        self.state = loaded.state
        self.dtype = dtype
        self.vocab = loaded.arch.vocab_size
        # a vision-language model: its steps carry image features as wide as its embeddings
        self.mm_width = loaded.arch.hidden_size if loaded.arch.vision else 0
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = table_width(max_model_len, block_size)
        # one device is a mesh of one: the same sharded code path
        self.mesh = loaded.mesh if loaded.mesh is not None else make_mesh(1)
        platform = platform_of(self.mesh)
        self.shapes = step_shapes(platform, max_num_batched_tokens, max_num_seqs, num_spec_tokens,
                                  token_buckets, seq_buckets)
        self.replicated = sharding(self.mesh)
        self.kv_cache_dtype = kv_cache_dtype
        # XLA's attention on a CPU keeps an fp8 cache as bytes (kv.FP8_BITS), as a bf16 one
        self.kv_bits = kvq.stored_as_bits(platform, attention_backend)
        self.num_host_blocks = num_host_blocks
        self.kv_cache, self.kv_sharding, kv_shapes = allocate_kv_cache(
            self.mesh, self.arch, num_blocks, block_size, dtype, kv_cache_dtype, self.kv_bits)
        self.sampler_state = jax.jit(lambda: init_state(max_num_seqs, self.vocab),
                                     out_shardings=self.replicated)()
        self.block_ops = BlockOps(kv_shapes, block_size, num_host_blocks, self.kv_sharding)
        self.batch = InputBatch(max_num_seqs, max_model_len, self.max_blocks_per_seq)
        # the batch's block table on the device, changed by each step's entries
        self.tables = init_tables(max_num_seqs, self.max_blocks_per_seq, self.replicated)
        self._pending_rows: list[tuple[int, object]] = []  # rows whose sampler state to rebuild
        self._allow_all: dict[int, jax.Array] = {}  # per S: the bitmask of unconstrained steps
        self.num_passes_dispatched = 0  # forward passes dispatched (a multi-step call: its passes)
        self.num_passes_collected = 0   # ... and read back by collect()
        self.device_wait_seconds = 0.0  # host time spent waiting for steps' results
        self.leader = Leader()
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
        state_sharding = jax.tree.map(lambda x: x.sharding, self.state)
        lora_args = lora and (lora.shardings, lora.num_slots, self.arch.tp_size)
        # multi-step scheduling: the decode passes' call, per decode shape
        self.num_passes = num_scheduler_steps
        passes = None
        if num_scheduler_steps > 1:
            passes = build_decode_passes(self.graphdef, state_sharding, self.kv_sharding,
                                         self.replicated, num_scheduler_steps, lora_args)
        programs = StepPrograms(
            forward=build_forward(self.graphdef, self.vocab, state_sharding, self.kv_sharding,
                                  self.replicated, lora_args, num_spec_tokens, bool(self.mm_width)),
            sample=build_sample(self.replicated, num_spec_tokens, spec_probabilistic),
            passes=passes, state=abstract(self.state), kv_cache=abstract(self.kv_cache),
            tables=abstract(self.tables), sampler_state=abstract(self.sampler_state),
            spec_state=abstract(self.spec_state) if num_spec_tokens else None,
            lora_weights=abstract(lora.weights) if lora is not None else None)
        self.compiler = StepCompiler(programs, self.shapes, self.vocab, block_size,
                                     self.max_blocks_per_seq, self.q_tile, max_num_seqs,
                                     num_spec_tokens, num_scheduler_steps, self.replicated,
                                     step_compiler_options(platform), self.mm_width)
        self.inputs = InputPreparer(self.batch, self.shapes, block_size, self.q_tile,
                                    max_num_seqs, max_model_len, num_spec_tokens,
                                    spec_probabilistic, lora, self.mm_width)
        self._no_mask = jax.device_put(np.bool_(False), self.replicated)
        self._set_rows = build_set_rows(self.replicated)
        self._write_table = build_write(self.replicated)

    def q_tile(self, T: int) -> int:
        return q_tile_size(T, self.attention_backend, self.arch.num_heads // self.arch.num_kv_heads)

    # compilation (jaxllm.runner.compiler)
    def compile_all(self, progress: bool = True, background: bool = False) -> float:
        """Compile every step shape before returning, or with `background` only the essential
        ones, the rest on a thread (not with a draft model or several processes, whose steps
        must follow the same shapes). Returns the seconds spent before returning."""
        start = time.perf_counter()
        self.block_ops.compile()
        if self.lora is not None:
            self.lora.compile()
        self._set_rows = executable_cache.compile(
            self._set_rows, abstract(self.sampler_state),
            *abstract_set_rows_inputs(self.max_model_len, self.vocab))
        self._write_table = executable_cache.compile(self._write_table, abstract(self.tables),
                                                     *abstract_chunk())
        background = background and self.drafter is None and not self.leader.multiprocess
        self.compiler.compile_all(progress, background)
        if self.drafter is not None:
            self.drafter.compile_all(self, progress)
        return time.perf_counter() - start

    def pick_shape(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The compiled step shape that holds num_tokens tokens in num_seqs sequences."""
        return self.compiler.pick_shape(num_tokens, num_seqs)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the background compilation (if any); True when every shape is compiled."""
        return self.compiler.wait_compiled(timeout)

    def stop_background_compile(self) -> None:
        """Stop after the executable compiling now (XLA cannot be interrupted)."""
        self.compiler.stop_background()

    @property
    def num_compiles_after_warmup(self) -> int:
        return self.compiler.num_compiles_after_warmup

    def activation_bytes(self) -> int:
        """Scratch memory of the largest step, measured from its compiled executables."""
        return self.compiler.activation_bytes()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Replace the cache with one of num_blocks blocks: the engine builds the runner with a
        small cache, measures its largest step's scratch (activation_bytes), and sizes the
        cache from the memory left. Before warm-up: nothing compiled for the old cache is kept."""
        assert self.compiler.num_compiled == 0 and self.drafter is None
        self.kv_cache = None  # freed before the new one takes its place
        self.num_blocks = num_blocks
        self.kv_cache, self.kv_sharding, kv_shapes = allocate_kv_cache(
            self.mesh, self.arch, num_blocks, self.block_size, self.dtype, self.kv_cache_dtype,
            self.kv_bits)
        self.block_ops = BlockOps(kv_shapes, self.block_size, self.num_host_blocks,
                                  self.kv_sharding)
        self.compiler.programs.kv_cache = abstract(self.kv_cache)

    # after a failed step
    def device_state_lost(self) -> bool:
        """Whether a failed step took the device state with it: a donated buffer deleted, or
        an output of a call that failed on the device (reading it raises)."""
        leaves = jax.tree.leaves((self.kv_cache, self.tables, self.sampler_state,
                                  self.spec_state))
        if self.drafter is not None:
            leaves += jax.tree.leaves(self.drafter.kv_cache)
        try:
            if any(x.is_deleted() for x in leaves):
                return True
            jax.block_until_ready(leaves)
            return False
        except Exception:  # noqa: BLE001 - whatever the device raised, the state is gone
            return True

    def reset_device_state(self) -> None:
        """A zeroed KV cache and fresh sampler rows, of the same shapes (nothing recompiles);
        every request's row is dropped: they all enter the batch again, from their tokens."""
        self.kv_cache = None
        self.kv_cache = allocate_kv_cache(self.mesh, self.arch, self.num_blocks, self.block_size,
                                          self.dtype, self.kv_cache_dtype, self.kv_bits)[0]
        self.sampler_state = jax.jit(lambda: init_state(self.max_num_seqs, self.vocab),
                                     out_shardings=self.replicated)()
        self.tables = init_tables(self.max_num_seqs, self.max_blocks_per_seq, self.replicated)
        if self.num_spec:
            self.spec_state = jax.jit(
                lambda: init_spec_state(self.max_num_seqs, self.num_spec, self.vocab,
                                        self.spec_probabilistic), out_shardings=self.replicated)()
        if self.drafter is not None:
            self.drafter.kv_cache = None
            self.drafter.kv_cache = allocate_kv_cache(
                self.mesh, self.drafter.arch, self.num_blocks, self.block_size, self.dtype,
                self.kv_cache_dtype, self.kv_bits)[0]
            self.drafter.fresh.clear()
        for rid in list(self.batch.row_of):
            self.batch.remove(rid)
        self.batch.take_writes()  # (for the old table)
        self._pending_rows = []

    # per-step state
    def _update_states(self, out: SchedulerOutput) -> None:
        batch = self.batch
        for rid in out.finished_req_ids:
            batch.remove(rid)
        for new in out.scheduled_new_reqs:
            p = new.sampling_params
            row = batch.add_request(new)
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
        K = ROW_INIT_GROUP
        pending, self._pending_rows = self._pending_rows, []
        for i in range(0, len(pending), K):
            self._set_sampler_rows(set_rows_inputs(pending[i:i + K], self.vocab,
                                                   self.max_model_len, self.max_num_seqs))

    # device operations: with several processes, process 0 announces and shares each one so
    # that the others launch the same computation (follow())
    def device_put(self, tree):
        """A pytree of host arrays on the devices, replicated (inputs kept there: a cached
        mask, replayed steps)."""
        return device_put(tree, self.replicated)

    def _args(self, tree):
        return call_args(tree, self.replicated)

    def _packed(self, inputs):
        """A step's inputs as its programs take them (packed_step), as call arguments."""
        packed = packed_step(inputs)
        return self._args(packed) if self.leader.multiprocess else packed

    def run_forward(self, shape, inputs, token_slots=None, announced: bool = False) -> ForwardOutput:
        """Launch the forward pass of a (T, S) step on its `inputs` (as InputPreparer.prepare
        gives them): logits, prompt logprobs and the sampling metadata as sampling reads it,
        on the device. `token_slots`: each token's LoRA slot (with LoRA)."""
        inputs = self.leader.broadcast(mp.STEP, *shape, inputs=inputs, announced=announced)
        exe = self.compiler.forward(shape)
        # (on one process the host arrays themselves: the call transfers them)
        args = self._args(inputs) if self.leader.multiprocess else inputs
        step, sampling = self._packed(inputs)
        # with LoRA: the slots' weights and each token's slot (jaxllm.lora)
        adapters = () if token_slots is None else ((self.lora.weights, self._args(token_slots)),)
        extra = (self.spec_state,) if self.num_spec else ()  # a draft model's proposals
        logits, plp, self.kv_cache, self.tables, *spec = exe(
            self.state, self.kv_cache, self.tables, self.sampler_state, step, sampling,
            *args[4:], *extra, *adapters)
        return ForwardOutput(shape, args, logits, plp, sampling, *spec)

    def run_passes(self, shape, inputs, num: np.ndarray, token_slots=None) -> PassesOutput:
        """Launch a multi-step call of shape (T, S): num[i] decode passes of row i."""
        exe = self.compiler.passes(shape)
        step, sampling = self._packed(inputs)  # (decodes: no images)
        adapters = () if token_slots is None else ((self.lora.weights, self._args(token_slots)),)
        res, self.kv_cache, self.tables, self.sampler_state = exe(
            self.state, self.kv_cache, self.tables, self.sampler_state, step, sampling, num,
            *adapters)
        return res

    def run_sample(self, key, fwd: ForwardOutput, bitmask: np.ndarray | None,
                   announced: bool = False):
        """Launch sampling of a step whose sampling key (StepCompiler.sample_key) is `key`,
        under `bitmask` ([S, words] int32) when given."""
        S = fwd.logits.shape[0]
        bitmask = self.leader.broadcast(mp.SAMPLE, S, int(bitmask is not None), inputs=bitmask,
                                        announced=announced)
        exe = self.compiler.sample(key)
        if bitmask is None:
            mask, use = self._allow_all.get(S), self._no_mask
            if mask is None:
                mask = self._allow_all[S] = self.device_put(
                    np.full((S, bitmask_words(self.vocab)), -1, np.int32))
        else:
            mask, use = self._args((bitmask, np.bool_(True)))
        extra = ()
        if self.num_spec:
            raw_v, drafts, *_ = fwd.verify
            extra = (raw_v, drafts, fwd.args[4], self.spec_state)
        res, self.sampler_state = exe(fwd.logits, self.sampler_state, fwd.smd, mask, use, *extra)
        return res

    def _set_sampler_rows(self, args, announced: bool = False) -> None:
        args = self.leader.broadcast(mp.SET_ROWS, inputs=args, announced=announced)
        self.sampler_state = self._set_rows(self.sampler_state, *self._args(args))

    def _write_chunk(self, chunk, announced: bool = False) -> None:
        """Block-table entries a step could not hold (block_table.WRITE_CHUNK of them)."""
        chunk = self.leader.broadcast(mp.TABLE, inputs=chunk, announced=announced)
        self.tables = self._write_table(self.tables, *self._args(chunk))

    def _copy_blocks(self, pairs, announced: bool = False) -> None:
        if self.leader.multiprocess:
            shared = self.leader.broadcast(mp.COPY, len(pairs),
                                           inputs=np.asarray(pairs, np.int32).reshape(-1, 2),
                                           announced=announced)
            pairs = [tuple(p) for p in shared]
        self.kv_cache = self.block_ops.copy(self.kv_cache, pairs)

    def follow(self) -> None:
        """Followers: run process 0's device operations until it stops."""
        K, V, L = ROW_INIT_GROUP, self.vocab, self.max_model_len
        forward = None

        def step(T, S):
            nonlocal forward
            template = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype),
                                    self.compiler.abstract_inputs(T, S))
            forward = self.run_forward((T, S), template, announced=True)

        def sample(S, masked):
            mask = np.zeros((S, bitmask_words(V)), np.int32) if masked else None
            self.run_sample(S, forward, mask, announced=True)

        def set_rows(*_):
            self._set_sampler_rows((np.zeros(K, np.int32), np.zeros((K, L), np.int32),
                                    np.zeros(K, np.int32), np.zeros(K, np.int32),
                                    np.zeros((K, V), np.float32), np.zeros((K, V), np.bool_)),
                                   announced=True)

        def copy(n, _):
            self._copy_blocks(np.zeros((n, 2), np.int32), announced=True)

        def table(*_):
            self._write_chunk(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype),
                                           abstract_chunk()), announced=True)

        self.leader.follow({mp.STEP: step, mp.SAMPLE: sample, mp.SET_ROWS: set_rows,
                            mp.COPY: copy, mp.TABLE: table})

    def stop_followers(self) -> None:
        self.leader.stop_followers()

    # steps
    def dispatch(self, out: SchedulerOutput, masked: bool = False) -> InFlight | None:
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
        step, shape, inputs, chunks = self.inputs.prepare(out, self.pick_shape)
        for chunk in chunks:
            self._write_chunk(chunk)
        smd = inputs[3]
        slots = None
        if self.lora is not None:
            slots, self.lora_failures = self.inputs.token_slots(step.rows, inputs[1], shape[0])
        if out.num_passes > 1:
            num = np.zeros(shape[1], np.int32)
            num[:len(step.req_ids)] = [out.num_scheduled_tokens[r] for r in step.req_ids]
            res = self.run_passes(shape, inputs, num, slots)
            self.num_passes_dispatched += int(num.max())
            return InFlight(step, res, bool(smd.any_logprobs), False, passes=int(num.max()))
        fwd = self.run_forward(shape, inputs, slots)
        self.num_passes_dispatched += 1
        flight = InFlight(step, None, bool(smd.any_logprobs), bool(smd.any_prompt_logprobs), fwd)
        if not masked:
            self.sample(flight)
        return flight

    def sample(self, flight: InFlight, bitmask: np.ndarray | None = None) -> None:
        """Launch a dispatched step's sampling; `bitmask`: [rows of the step, words] int32,
        the tokens each row may sample (structured outputs)."""
        fwd = flight.pending
        S = fwd.logits.shape[0]
        if bitmask is not None and bitmask.shape[0] != S:  # padded rows allow everything
            full = np.full((S, bitmask.shape[1]), -1, np.int32)
            full[:bitmask.shape[0]] = bitmask
            bitmask = full
        res = self.run_sample(self.compiler.sample_key(*fwd.shape), fwd, bitmask)
        if self.num_spec:
            flight.result = VerifyOutput(*res, *fwd.plp, fwd.verify[2])
        else:
            flight.result = SamplerOutput(*res, *fwd.plp)
        flight.pending = None
        if self.drafter is not None:  # the next step's proposals, right behind this one
            ids, md, *rest = fwd.args  # (the block tables as the step gathered them)
            args = (ids, dataclasses.replace(md, block_tables=fwd.verify[3]), *rest)
            self.drafter.propose(self, fwd.shape, args, flight.result, flight.step)

    def collect(self, flight: InFlight | None) -> RunnerOutput:
        """Wait for a dispatched step and bring its tokens (and logprobs) to the host. The
        sampled tokens also go into the rows of requests still in the batch."""
        result = RunnerOutput()
        if flight is None:
            return result
        st, res = flight.step, flight.result
        self.num_passes_collected += flight.passes
        t = time.perf_counter()
        tokens = to_host(res.tokens)  # waits for the device
        self.device_wait_seconds += time.perf_counter() - t
        batch = self.batch
        if flight.want_logprobs:
            lp, rank, top_ids, top_lp = (to_host(x) for x in (res.logprobs, res.ranks,
                                                            res.top_ids, res.top_logprobs))
        if tokens.ndim == 1:  # one token per sequence: a step without speculation
            tokens, num = tokens[:, None], np.ones(len(tokens), np.int32)
            if flight.want_logprobs:
                lp, rank, top_ids, top_lp = lp[:, None], rank[:, None], top_ids[:, None], top_lp[:, None]
        else:
            num = to_host(res.num_tokens)
        final = np.nonzero(st.final)[0]
        rows, nums, toks = st.rows[final], num[final], tokens[final]
        broken = (toks < 0) & (np.arange(toks.shape[1]) < nums[:, None])  # non-finite logits
        if broken.any():
            bad = broken.any(axis=1)
            result.non_finite = [st.req_ids[i] for i in final[bad].tolist()]
            final, rows, nums, toks = final[~bad], rows[~bad], nums[~bad], toks[~bad]
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
            result.prompt_logprobs = prompt_logprobs(st, *(to_host(x) for x in (
                res.prompt_logprobs, res.prompt_ranks, res.prompt_top_ids,
                res.prompt_top_logprobs)))
        return result
