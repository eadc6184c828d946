"""A draft model: a smaller model sharing the target's tokenizer proposes k tokens per step.

It has its own paged KV cache with the same number of blocks as the target's, addressed by
the same block tables (so prefix hits, forks, swaps and rollbacks apply to both caches alike),
and runs right behind every target step, on the device, with no host round trip:

1. mirror: the draft model over the step's flat batch (the same tokens, positions and slots
   as the target), so its cache holds every token the target computed. Proposals rejected in
   that step were written past the request's accepted tokens; like the target's, those slots
   are written again before anything reads them.
2. decode (only after steps where a sequence sampled): k one-token passes from each sampling
   sequence's newest token, at positions found on the device from the step's accepted counts,
   each proposing the next token (the argmax, or a draw from the draft's distribution q for
   draft_sample_method "probabilistic"). The proposals (and q) stay on the device in the
   runner's SpecState; the next step reads them by row. The scheduler holds k slots past each
   running request's tokens for these passes (num_lookahead_tokens).

Both are compiled at start-up: the mirror per (tokens, seqs) step bucket, the decode per
sequence bucket.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm.auto import tqdm

from jaxllm.core.block_pool import NULL_BLOCK
from jaxllm.layers.attention import AttentionMetadata
from jaxllm import executable_cache
from jaxllm.runner.block_ops import BlockOps
from jaxllm.runner.compiler import abstract
from jaxllm.runner.kv_cache import allocate_kv_cache
from jaxllm.runner.rejection_sampler import DRAFT_STREAM, _stream_key
from jaxllm.runner.sampler import argmax, filter_logits, process_logits
from jaxllm.sampling_params import GREEDY_EPS

logger = logging.getLogger(__name__)


def check_draft(draft, target, max_model_len: int) -> None:
    """A draft must speak the target's vocabulary, token for token."""
    dv, tv = draft.arch.vocab_size, target.arch.vocab_size
    if dv != tv:
        raise ValueError(f"speculative_config.model: the draft's vocabulary ({dv} tokens) differs "
                         f"from the target's ({tv}); a draft model must share the tokenizer")
    if draft.tokenizer is not None and target.tokenizer is not None:
        if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ValueError("speculative_config.model: the draft's tokenizer differs from the "
                             "target's (same size, different tokens); a draft model must share "
                             "the tokenizer")
    if draft.arch.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config.model: the draft's context "
                         f"({draft.arch.max_position_embeddings}) is shorter than max_model_len "
                         f"({max_model_len})")


def _draft_tokens(raw, md, state, probabilistic: bool):
    """Proposals from the draft's logits [S, V], processed as the target's are (bias, allowed
    tokens, min_tokens): the argmax, or for random rows a draw from q (temperature, top-k/p,
    min-p) with the row's key for that output index."""
    logits = process_logits(raw, md, state)
    greedy = argmax(logits)
    if not probabilistic:
        return greedy, None
    V = raw.shape[-1]
    is_greedy = md.temperature < GREEDY_EPS
    scaled = logits / jnp.where(is_greedy, 1.0, md.temperature)[:, None]
    scaled = jax.lax.cond(md.any_filter, filter_logits, lambda x, *_: x, scaled,
                          md.top_k, md.top_p, md.min_p)
    q = jax.nn.softmax(scaled, axis=-1)
    gumbel = jax.vmap(lambda s, i: jax.random.gumbel(_stream_key(s, i, DRAFT_STREAM), (V,)))(
        md.seeds, md.gen_index)
    drawn = argmax(scaled + gumbel)
    return jnp.where(is_greedy, greedy, drawn), q


class DraftModel:
    def __init__(self, loaded, runner, num_host_blocks: int, k: int, probabilistic: bool):
        self.arch = loaded.arch
        self.graphdef, self.state = loaded.graphdef, loaded.state
        self.k, self.probabilistic = k, probabilistic
        self.max_model_len = runner.max_model_len
        self.block_size = runner.block_size
        self.q_tile = runner.q_tile
        # stored as the target's is (kv_cache_dtype)
        self.kv_cache, self.kv_sharding, shapes = allocate_kv_cache(
            runner.mesh, self.arch, runner.num_blocks, runner.block_size, runner.dtype,
            runner.kv_cache_dtype, runner.kv_bits)
        self.ops = BlockOps(shapes, runner.block_size, num_host_blocks, self.kv_sharding)
        # the engine turns the proposal passes off while no request may speculate
        # (disable_by_batch_size); the mirror pass always runs, to keep the cache whole
        self.enabled = True
        # requests whose proposals on the device were made after their latest sampled token
        self.fresh: set[str] = set()
        self.num_compiles_after_warmup = 0
        rep = runner.replicated
        state_sh = jax.tree.map(lambda x: x.sharding, self.state)
        self._mirror = jax.jit(self._mirror_fn, donate_argnums=(1,),
                               in_shardings=(state_sh, self.kv_sharding) + (rep,) * 6,
                               out_shardings=(self.kv_sharding, rep))
        self._decode = jax.jit(self._decode_fn, donate_argnums=(1, 2),
                               in_shardings=(state_sh, self.kv_sharding) + (rep,) * 6,
                               out_shardings=(self.kv_sharding, rep))
        self._compiled_mirror: dict[tuple[int, int], object] = {}
        self._compiled_decode: dict[int, object] = {}
        self._no_next_ids = jax.device_put(jnp.zeros(1, jnp.int32), rep)

    # the two device functions
    def _mirror_fn(self, state, kv, input_ids, md, smd, vmd, tokens, num):
        """The draft over the step's tokens. Returns its cache and, per sequence, where the
        proposal passes start: the newest token's position, id and output index."""
        draft = nnx.merge(self.graphdef, state)
        _, kv = draft(kv, input_ids, md)
        last = jnp.maximum(md.query_start_loc[1:] - 1, 0)
        accepted = jnp.maximum(num - 1, 0)
        rejected = vmd.num_draft - accepted
        pos = md.positions[last] + 1 - rejected
        tok = jnp.take_along_axis(tokens, accepted[:, None], axis=1)[:, 0]
        return kv, (pos, tok, smd.gen_index - rejected, num > 0)

    def _decode_fn(self, state, kv, spec_state, sampler_state, block_tables, smd, start, rows):
        draft = nnx.merge(self.graphdef, state)
        pos0, tok0, gen0, active = start
        S = block_tables.shape[0]
        bs = self.block_size
        qt = self.q_tile(S)
        zeros_w = jnp.zeros(0, jnp.int32)  # one token per sequence: no prefill tiles
        fixed = dict(token_seq_ids=jnp.arange(S, dtype=jnp.int32),
                     query_start_loc=jnp.arange(S + 1, dtype=jnp.int32), block_tables=block_tables,
                     tile_seq=zeros_w, tile_start=zeros_w, num_tiles=jnp.int32(0))
        smd = dataclasses.replace(smd, any_penalty=jnp.bool_(False), any_banned=jnp.bool_(False))

        def body(carry, j):
            kv, tok = carry
            pos = pos0 + j
            ok = active & (pos < self.max_model_len)
            col = jnp.clip(pos // bs, 0, block_tables.shape[1] - 1)
            block = jnp.take_along_axis(block_tables, col[:, None], axis=1)[:, 0]
            md = AttentionMetadata(positions=jnp.where(ok, pos, 0),
                                   slot_mapping=jnp.where(ok, block * bs + pos % bs, NULL_BLOCK * bs),
                                   seq_lens=jnp.where(ok, pos + 1, 0), block_size=bs, q_tile=qt,
                                   **fixed)
            h, kv = draft(kv, tok, md)
            # proposal j is the token at output index gen0 + 1 + j
            smd_j = dataclasses.replace(smd, gen_index=gen0 + 1 + j)
            d, q = _draft_tokens(draft.compute_logits(h), smd_j, sampler_state, self.probabilistic)
            return (kv, d), (d, q if q is not None else jnp.zeros((S, 1), jnp.float32))

        (kv, _), (drafts, qs) = jax.lax.scan(body, (kv, tok0), jnp.arange(self.k))
        spare = spec_state.draft_tokens.shape[0] - 1
        rows = jnp.where(active, rows, spare)
        new = dataclasses.replace(spec_state, draft_tokens=spec_state.draft_tokens.at[rows].set(drafts.T))
        if self.probabilistic:
            new = dataclasses.replace(new, draft_probs=new.draft_probs.at[rows].set(qs.transpose(1, 0, 2)))
        return kv, new

    # host side
    def _compile_mirror(self, runner, T: int, S: int):
        ids, md, _, smd, vmd = runner.compiler.abstract_inputs(T, S)
        md = dataclasses.replace(md, block_tables=runner.compiler.abstract_block_tables(S))
        rep = runner.replicated
        sds = jax.ShapeDtypeStruct
        tokens = sds((S, self.k + 1), jnp.int32, sharding=rep)
        num = sds((S,), jnp.int32, sharding=rep)
        return executable_cache.compile(self._mirror, abstract(self.state),
                                        abstract(self.kv_cache), ids, md, smd, vmd, tokens, num)

    def _compile_decode(self, runner, S: int):
        _, md, _, smd, _ = runner.compiler.abstract_inputs(S, S)
        rep = runner.replicated
        sds = jax.ShapeDtypeStruct
        smd = dataclasses.replace(smd, next_ids=sds((1,), jnp.int32))  # per token: not needed
        i32 = lambda: sds((S,), jnp.int32, sharding=rep)  # noqa: E731
        start = (i32(), i32(), i32(), sds((S,), jnp.bool_, sharding=rep))
        return executable_cache.compile(self._decode, abstract(self.state),
                                        abstract(self.kv_cache),
                                        abstract(runner.spec_state),
                                        abstract(runner.sampler_state),
                                        runner.compiler.abstract_block_tables(S), smd,
                                        start, i32())

    def compile_all(self, runner, progress: bool = True) -> None:
        start = time.perf_counter()
        self.ops.compile()
        shapes = runner.shapes.all
        seqs = sorted({s for _, s in shapes})
        bar = tqdm(total=len(shapes) + len(seqs), desc="compiling draft model", unit="shape",
                   disable=not progress)
        for T, S in shapes:
            self._compiled_mirror[T, S] = self._compile_mirror(runner, T, S)
            bar.update(1)
        for S in seqs:
            self._compiled_decode[S] = self._compile_decode(runner, S)
            bar.update(1)
        bar.close()
        logger.info("compiled the draft model's %d step shapes in %.1f s", len(shapes) + len(seqs),
                    time.perf_counter() - start)

    def _exe(self, table, key, compile_fn):
        exe = table.get(key)
        if exe is None:
            exe = table[key] = compile_fn()
            self.num_compiles_after_warmup += 1
            logger.warning("compiled draft model shape %s outside warm-up", key)
        return exe

    def propose(self, runner, shape, args, res, step) -> None:
        """Behind a dispatched target step: mirror its tokens, then (when a sequence sampled
        and proposals are wanted) propose k tokens for each sampling sequence."""
        T, S = shape
        input_ids, md, _, smd, vmd = args
        mirror = self._exe(self._compiled_mirror, (T, S),
                           lambda: self._compile_mirror(runner, T, S))
        self.kv_cache, start = mirror(self.state, self.kv_cache, res.input_ids, md, smd, vmd,
                                      res.tokens, res.num_tokens)
        sampled = [rid for rid, f in zip(step.req_ids, step.final) if f]
        if not (sampled and self.enabled):
            self.fresh.difference_update(sampled)
            return
        self.fresh.update(sampled)
        decode = self._exe(self._compiled_decode, S, lambda: self._compile_decode(runner, S))
        smd = dataclasses.replace(smd, next_ids=self._no_next_ids)
        self.kv_cache, runner.spec_state = decode(self.state, self.kv_cache, runner.spec_state,
                                                  runner.sampler_state, md.block_tables, smd,
                                                  start, smd.rows)

    def block_ops(self, out) -> None:
        """The scheduler's block moves, applied to the draft's cache as to the target's."""
        self.kv_cache = self.ops.swap_out(self.kv_cache, out.blocks_to_swap_out)
        self.kv_cache = self.ops.swap_in(self.kv_cache, out.blocks_to_swap_in)
        self.kv_cache = self.ops.copy(self.kv_cache, out.blocks_to_copy)
