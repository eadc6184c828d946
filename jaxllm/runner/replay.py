"""A recorded step replayed on the device alone: its compiled calls launched back to back
with inputs already on the device and no host work between them. Benchmarks time the
device's own step this way; the engine never replays."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxllm.runner.block_table import without_entries
from jaxllm.runner.step_programs import bitmask_words, packed_step


class StepReplay:
    """One step of shape (T, S) on `inputs` (as the runner's run_forward takes them), with
    each token's LoRA slot `token_slots`, or a multi-step call of num[i] passes of row i.
    Sampling runs unconstrained (no token bitmask)."""

    def __init__(self, runner, shape: tuple[int, int], inputs, token_slots=None, num=None):
        compiler = runner.compiler
        self.runner = runner
        self.shape = shape
        # the step's inputs as its programs take them (packed_step), on the device; its
        # block-table entries left out (all padding, as many): a row may have another holder
        # by now, whose entries they must not overwrite
        ids, md, *rest = inputs
        md = dataclasses.replace(md, block_tables=without_entries(md.block_tables,
                                                                  runner.max_num_seqs))
        inputs = (ids, md, *rest)
        self.args = runner.device_put((*packed_step(inputs), *inputs[4:]))
        self.smd = self.args[1]
        self.passes = 1 if num is None else int(num.max())
        self._adapters = () if token_slots is None else (
            (runner.lora.weights, runner.device_put(token_slots)),)
        self._num = None if num is None else runner.device_put(num)
        if num is not None:
            self._passes = compiler.passes(shape)
        else:
            self._forward = compiler.forward(shape)
            self._sample = compiler.sample(compiler.sample_key(*shape))
        S = shape[1]
        self._mask = runner.device_put(np.full((S, bitmask_words(runner.vocab)), -1, np.int32))
        self._use_mask = runner.device_put(np.bool_(False))

    def step(self, kv_cache, sampler_state):
        """The step as the engine launches it, on the given cache and sampler state (both
        donated): (results, cache, sampler state). The runner's device block table goes
        through it too (the step reads its rows as they are now)."""
        runner = self.runner
        if self._num is not None:
            res, kv_cache, runner.tables, sampler_state = self._passes(
                runner.state, kv_cache, runner.tables, sampler_state, *self.args[:2],
                self._num, *self._adapters)
            return res, kv_cache, sampler_state
        logits, _, kv_cache, runner.tables = self._forward(
            runner.state, kv_cache, runner.tables, sampler_state, *self.args, *self._adapters)
        res, sampler_state = self._sample(logits, sampler_state, self.smd, self._mask,
                                          self._use_mask)
        return res, kv_cache, sampler_state

    def fused(self):
        """The same forward pass and sampling as one jitted call, compiled now: a function of
        (cache, sampler state) like step()."""
        runner, programs = self.runner, self.runner.compiler.programs
        mask, use_mask = self._mask, self._use_mask

        def one_call(state, kv_cache, tables, sampler_state, *args):
            logits, _, kv_cache, tables = programs.forward(state, kv_cache, tables,
                                                           sampler_state, *args)
            res, sampler_state = programs.sample(logits, sampler_state, args[1], mask, use_mask)
            return res, kv_cache, tables, sampler_state

        exe = jax.jit(one_call, donate_argnums=(1, 2, 3)).lower(
            runner.state, runner.kv_cache, runner.tables, runner.sampler_state, *self.args,
            *self._adapters).compile()

        def call(kv_cache, sampler_state):
            res, kv_cache, runner.tables, sampler_state = exe(
                runner.state, kv_cache, runner.tables, sampler_state, *self.args,
                *self._adapters)
            return res, kv_cache, sampler_state
        return call
