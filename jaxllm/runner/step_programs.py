"""The jitted programs of a step and the abstract shapes of their inputs.

A step is two programs launched back to back: the forward pass (build_forward) and sampling
(build_sample); with multi-step scheduling a decode step is one program of several passes
(build_decode_passes). Each is jitted here and compiled per shape by the compiler
(jaxllm.runner.compiler) from the abstract inputs below.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.core.block_pool import NULL_BLOCK
from jaxllm.layers.attention import AttentionMetadata, max_tiles
from jaxllm.runner.block_table import abstract_writes, resolve
from jaxllm.lora.ops import LoRAInputs
from jaxllm.runner.outputs import PassesOutput
from jaxllm.runner.packing import Packed
from jaxllm.runner.rejection_sampler import VerifyMetadata, no_verify, num_verify_rows, verify
from jaxllm.runner.sampler import (MAX_BANNED, MAX_LOGPROBS, SamplingMetadata, flag_non_finite,
                                   prompt_logprobs, sample, set_rows)

ROW_INIT_GROUP = 8  # sampler-state rows rebuilt per call


def bitmask_words(vocab: int) -> int:
    return -(-vocab // 32)


def build_forward(graphdef, vocab: int, state_sharding, kv_sharding, replicated, lora=None,
                  num_spec: int = 0, multimodal: bool = False):
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
    The two are not combined (EngineConfig refuses it). The device's block table comes
    after the cache (donated; jaxllm.runner.block_table): the step writes its entries and
    gathers its sequences' rows, and returns it after the cache (with speculative decoding
    the gathered rows also go with what verification needs, for a draft model). A
    vision-language model's step
    (`multimodal`) takes (image features [T, E], their tokens' mask [T]) right after the
    sampling metadata (InputPreparer.image_features); it is not combined with speculation."""

    def forward(state, kv_cache, tables, sampler_state, step, sampling, *extra):
        input_ids, md, logits_indices, next_ids = step.unpack()
        smd = dataclasses.replace(sampling.unpack(), next_ids=next_ids)
        tables, block_tables = resolve(tables, md.block_tables, smd.rows)
        md = dataclasses.replace(md, block_tables=block_tables)
        mm = None
        if multimodal:
            mm, *extra = extra
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
        hidden, kv_cache = model(kv_cache, input_ids, md, lora=lora_in, mm=mm)
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
            return logits.astype(jnp.float32), plp, kv_cache, tables
        R = vmd.token_idx.shape[0]
        raw_v = jax.lax.cond(
            vmd.any_spec,
            lambda h: model.compute_logits(h[vmd.token_idx]).astype(jnp.float32),
            lambda h: jnp.zeros((R, vocab), jnp.float32), hidden)
        drafts = input_ids[vmd.token_idx + 1]  # each proposal follows the token that scores it
        return (logits.astype(jnp.float32), plp, kv_cache, tables,
                (raw_v, drafts, input_ids, block_tables))

    rep = replicated
    extra = (rep, rep) if num_spec else () if lora is None else ((lora[0], rep),)
    if multimodal:
        extra = ((rep, rep), *extra)
    outs = (rep, rep, kv_sharding, rep) + ((rep,) if num_spec else ())
    return jax.jit(forward, donate_argnums=(1, 2),
                   in_shardings=(state_sharding, kv_sharding, rep, rep, rep, rep, *extra),
                   out_shardings=outs)


def build_sample(replicated, num_spec: int = 0, spec_probabilistic: bool = False):
    """The step's sampling over the forward pass's logits, under a token bitmask when
    `use_mask` (structured outputs). The sampler state is donated; the sampled tokens also
    stay in it for the next step.

    With speculative decoding it also takes the forward pass's raw logits at the verified
    positions and their proposals (raw_v [R, V], drafts [R]), the VerifyMetadata and the
    SpecState, verifies the proposals by rejection sampling and emits up to k + 1 tokens per
    sequence: (tokens [S, k+1], num_tokens [S], logprob stats [S, k+1, ...])."""

    def sample_step(logits, sampler_state, sampling, bitmask, use_mask, raw_v=None, drafts=None,
                    vmd=None, spec_state=None):
        smd = sampling.unpack()
        base, sampler_state = sample(logits, smd, sampler_state, bitmask, use_mask)
        if not num_spec:
            return (flag_non_finite(logits, base[0]), *base[1:]), sampler_state

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


def build_decode_passes(graphdef, state_sharding, kv_sharding, replicated, num_passes: int,
                        lora=None):
    """Multi-step scheduling's device call: `num_passes` decode passes in one scan, each the
    forward pass over one token per sequence and sampling, whose tokens are the next pass's
    inputs. The inputs are a one-token-per-sequence step's (md as its first pass) and
    `num` [S], the passes each sequence takes: after its last one a sequence's pass computes
    its last position again, writing nothing (slot: the null block) and sampling nothing
    (is_final off), so the sampler state and the cache end as after num[i] single steps. The
    cache, the device's block table (as in build_forward) and the sampler state are donated.
    With LoRA, each token's slot stays the same."""

    def passes(state, kv_cache, tables, sampler_state, step, sampling, num, *adapters):
        input_ids, md, logits_indices, _ = step.unpack()
        smd = sampling.unpack()
        tables, block_tables = resolve(tables, md.block_tables, smd.rows)
        md = dataclasses.replace(md, block_tables=block_tables)
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
            flagged = (flag_non_finite(logits, out[0]), *out[1:])
            return (kv, sampler_state, jnp.where(real, out[0][seq], 0)), flagged

        (kv_cache, sampler_state, _), outs = jax.lax.scan(
            body, (kv_cache, sampler_state, tok0), jnp.arange(num_passes))
        tokens, lp, rank, top_ids, top_lp = (jnp.moveaxis(x, 0, 1) for x in outs)
        return (PassesOutput(tokens, num, lp, rank, top_ids, top_lp), kv_cache, tables,
                sampler_state)

    rep = replicated
    extra = () if lora is None else ((lora[0], rep),)
    return jax.jit(passes, donate_argnums=(1, 2, 3),
                   in_shardings=(state_sharding, kv_sharding) + (rep,) * 5 + extra,
                   out_shardings=(rep, kv_sharding, rep, rep))


def sampling_only(smd):
    """The sampling metadata sampling reads: without the [T] prompt-logprob ids, so that the
    sampler compiles once per seqs bucket."""
    return dataclasses.replace(smd, next_ids=None)


def packed_step(inputs, sharding=None) -> tuple[Packed, Packed]:
    """A step's first four inputs (input ids, attention metadata, logits indices, sampling
    metadata: host arrays, or ShapeDtypeStructs to compile) as the programs take them: the
    forward pass's own inputs (with the prompt-logprob ids) and sampling's metadata, each
    packed (jaxllm.runner.packing)."""
    input_ids, md, logits_idx, smd = inputs[:4]
    step, sampling = (input_ids, md, logits_idx, smd.next_ids), sampling_only(smd)
    if isinstance(input_ids, jax.ShapeDtypeStruct):
        return Packed.abstract(step, sharding), Packed.abstract(sampling, sharding)
    return Packed.pack(step), Packed.pack(sampling)


def _temp_bytes(exe) -> int:
    return int(getattr(exe.memory_analysis(), "temp_size_in_bytes", 0) or 0)


def step_scratch_bytes(forward_exe, sample_exe, S: int, vocab: int) -> int:
    """Scratch memory of a step from its compiled calls: the larger of the two, plus the
    logits that live from one to the other."""
    return max(_temp_bytes(forward_exe), _temp_bytes(sample_exe)) + S * vocab * 4


def passes_scratch_bytes(passes_exe) -> int:
    """Scratch memory of a multi-step call (its logits live inside it)."""
    return _temp_bytes(passes_exe)


def step_compiler_options(platform: str) -> dict | None:
    """XLA's GPU compiler plans a program's scratch within 80% of the device less the
    program's arguments, and recomputes matmuls (rematerialization) to fit. The step's
    arguments are the weights and the KV cache, most of the device by design, and the engine
    sizes the cache from the step's measured scratch itself, so that plan is given room."""
    return {"xla_gpu_memory_limit_slop_factor": 10000} if platform == "gpu" else None


def abstract_step_inputs(T: int, S: int, block_size: int, qt: int, num_spec: int = 0,
                         mm_width: int = 0, num_tile_slots: int | None = None):
    """Shapes of a (T tokens, S sequences) step's inputs after the state, cache, block table
    and sampler state: input ids, attention metadata (its block_tables: the step's
    TableWrites), logits indices, sampling metadata (and with speculative decoding the
    verified positions). num_tile_slots: room for prefill tiles (StepShapes.tiles)."""
    i32, f32, b = jnp.int32, jnp.float32, jnp.bool_
    sds = jax.ShapeDtypeStruct
    W = max_tiles(T, S, qt) if num_tile_slots is None else num_tile_slots
    md = AttentionMetadata(sds((T,), i32), sds((T,), i32), sds((T,), i32), sds((S + 1,), i32),
                           sds((S,), i32), abstract_writes(T, S, block_size),
                           sds((W,), i32), sds((W,), i32), sds((), i32),
                           block_size=block_size, q_tile=qt)
    per_seq = dict(temperature=f32, top_k=i32, top_p=f32, min_p=f32, seeds=jnp.uint32,
                   gen_index=i32, rows=i32, is_final=b, repetition_penalty=f32,
                   frequency_penalty=f32, presence_penalty=f32, min_tokens=i32, has_bias=b)
    flags = [f.name for f in dataclasses.fields(SamplingMetadata) if f.name.startswith("any_")]
    smd = SamplingMetadata(**{name: sds((S,), t) for name, t in per_seq.items()},
                           banned=sds((S, MAX_BANNED), i32), next_ids=sds((T,), i32),
                           **{name: sds((), b) for name in flags})
    if mm_width:  # (not with speculation)
        return sds((T,), i32), md, sds((S,), i32), smd, (sds((T, mm_width), f32), sds((T,), b))
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
    sampling_only gives it, packed), bitmask, use_mask."""
    sds = jax.ShapeDtypeStruct
    return (sds((S, vocab), jnp.float32), Packed.abstract(sampling_only(smd)),
            sds((S, bitmask_words(vocab)), jnp.int32), sds((), jnp.bool_))


def build_set_rows(replicated):
    """Rebuilds ROW_INIT_GROUP rows of the sampler state (donated) from their tokens."""
    rep = replicated
    return jax.jit(set_rows, donate_argnums=(0,), in_shardings=rep, out_shardings=rep)


def set_rows_inputs(group, vocab: int, max_model_len: int, spare_row: int):
    """set_rows' inputs after the sampler state for up to ROW_INIT_GROUP requests entering
    the batch, [(row, NewRequestData)]: their tokens, prompt lengths, bias and stop rows
    (padding goes to the spare row)."""
    K, V, L = ROW_INIT_GROUP, vocab, max_model_len
    rows = np.full(K, spare_row, np.int32)
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
        bias[j, new.banned_token_ids] = -np.inf
        if p.min_tokens > 0:
            stop[j, list(new.stop_ids)] = True
    return rows, tokens, n_prompt, n_tok, bias, stop


def abstract_set_rows_inputs(max_model_len: int, vocab: int):
    """Shapes of set_rows' inputs after the sampler state: rows, tokens, prompt lengths,
    token counts, bias rows, stop rows."""
    K, sds = ROW_INIT_GROUP, jax.ShapeDtypeStruct
    return (sds((K,), jnp.int32), sds((K, max_model_len), jnp.int32), sds((K,), jnp.int32),
            sds((K,), jnp.int32), sds((K, vocab), jnp.float32), sds((K, vocab), jnp.bool_))
