"""The step's executables: compiled per shape ahead of time, looked up per step.

Every (tokens, seqs) bucket of the forward pass and every seqs bucket of sampling is
compiled at start-up (the sampler once per seqs bucket, not once per pair); a step whose
padded shape has no compiled executable is a bug, not a reason to compile. With
`background=True` only a few shapes that together hold any step compile before serving
(StepShapes.essential); the rest compile on a thread while steps run, each padded to the
smallest shape compiled so far. A multi-step call's shapes all compile before serving.
"""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jaxllm import executable_cache
from jaxllm.runner.buckets import StepShapes
from jaxllm.runner.rejection_sampler import num_verify_rows
from jaxllm.runner.step_programs import (abstract_sample_inputs, abstract_step_inputs,
                                         abstract_verify_metadata, packed_step,
                                         passes_scratch_bytes, step_scratch_bytes)

logger = logging.getLogger(__name__)


def abstract(tree):
    """ShapeDtypeStructs of a tree of arrays, with their shardings."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


@dataclass
class StepPrograms:
    """The jitted programs of a step (jaxllm.runner.step_programs) and the abstract device
    state they take before a step's inputs."""
    forward: Any
    sample: Any
    passes: Any | None  # multi-step scheduling's decode passes
    state: Any          # the model's weights
    kv_cache: Any
    tables: Any         # the device's block table (jaxllm.runner.block_table)
    sampler_state: Any
    spec_state: Any | None   # speculative decoding: the draft model's proposals
    lora_weights: Any | None  # LoRA: the adapter slots' weights


def _lowest_priority() -> None:
    """This thread (only: Linux's nice value is per thread) yields the CPU to the others."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: it runs as before
        pass


def _stop_thread(stop: threading.Event, thread: threading.Thread | None) -> None:
    stop.set()
    if thread is not None:
        thread.join()


class StepCompiler:
    def __init__(self, programs: StepPrograms, shapes: StepShapes, vocab: int, block_size: int,
                 max_blocks_per_seq: int, q_tile: Callable[[int], int], max_num_seqs: int,
                 num_spec: int = 0, num_passes: int = 1, replicated=None,
                 options: dict | None = None, mm_width: int = 0):
        self.programs = programs
        self.mm_width = mm_width  # a vision-language model's image features per token
        self.shapes = shapes
        self.vocab = vocab
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.q_tile = q_tile
        self.max_num_seqs = max_num_seqs
        self.num_spec = num_spec
        self.num_passes = num_passes
        self.replicated = replicated
        self.options = options  # XLA compiler options of the forward programs
        self.forward_executables: dict[tuple[int, int], object] = {}  # per (T, S)
        self.sample_executables: dict = {}                             # per sample_key
        self.passes_executables: dict[tuple[int, int], object] = {}   # per decode shape
        self.num_compiles_after_warmup = 0
        # the shapes compiling after start-up (compile_all(background=True)), and its stop flag
        self._background: threading.Thread | None = None
        self._stop_background = threading.Event()
        # set while no step is being served: the background compilation runs only then
        self._idle = threading.Event()
        self._idle.set()
        self.background_compile_seconds: float | None = None  # once the thread has finished

    # shapes
    def abstract_inputs(self, T: int, S: int):
        """A (T, S) step's inputs after the device state (abstract_step_inputs)."""
        qt = self.q_tile(T)
        return abstract_step_inputs(T, S, self.block_size, qt, self.num_spec, self.mm_width,
                                    self.shapes.tiles(T, S, qt))

    def abstract_block_tables(self, S: int):
        """The block tables a step of S sequences gathers on the device ([S, width])."""
        return jax.ShapeDtypeStruct((S, self.max_blocks_per_seq), jnp.int32,
                                    sharding=self.replicated)

    def sample_key(self, T: int, S: int):
        """Which compiled sampling a (T, S) step uses: one per seqs bucket, and with
        speculative decoding per (seqs, verified positions) pair."""
        return S if not self.num_spec else (S, num_verify_rows(T, S, self.num_spec))

    @property
    def sample_buckets(self) -> list:
        return sorted({self.sample_key(T, S) for T, S in self.shapes.all})

    @property
    def passes_shapes(self) -> list[tuple[int, int]]:
        """The shapes of multi-step calls: those of a decode step of each batch size."""
        if self.num_passes <= 1:
            return []
        return sorted({self.shapes.pick(s, s) for s in range(1, self.max_num_seqs + 1)})

    def pick_shape(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The step shape of num_tokens tokens in num_seqs sequences: the smallest bucket, or
        after compile_all(background=True), until that bucket is compiled (or if its compile
        failed), the smallest compiled one that holds them: a step never compiles."""
        shape = self.shapes.pick(num_tokens, num_seqs)
        if self._background is None or self.ready(shape):
            return shape
        buckets = self.shapes.token_buckets
        for t in buckets[buckets.index(shape[0]):]:
            for s in self.shapes.seqs_for[t]:
                if (s >= num_seqs and self.ready((t, s))
                        and self.shapes.allowed(t, s, num_tokens, num_seqs)):
                    return t, s
        return shape  # not reached: the largest shape compiles before serving

    def ready(self, shape) -> bool:
        """Whether a step of this shape has both its executables."""
        return (shape in self.forward_executables
                and self.sample_key(*shape) in self.sample_executables)

    @property
    def num_compiled(self) -> int:
        return (len(self.forward_executables) + len(self.sample_executables)
                + len(self.passes_executables))

    # compiling one executable
    def _adapters(self, T: int) -> tuple:
        p = self.programs
        if p.lora_weights is None:
            return ()
        return ((p.lora_weights, jax.ShapeDtypeStruct((T,), jnp.int32)),)

    def compile_forward(self, T: int, S: int):
        p = self.programs
        extra = (p.spec_state,) if self.num_spec else ()
        inputs = self.abstract_inputs(T, S)
        return executable_cache.compile(
            p.forward, p.state, p.kv_cache, p.tables, p.sampler_state, *packed_step(inputs),
            *inputs[4:], *extra, *self._adapters(T), options=self.options)

    def compile_sample(self, key):
        p = self.programs
        S, R = (key, 0) if not self.num_spec else key
        logits, smd, bitmask, use_mask = abstract_sample_inputs(
            S, self.vocab, self.abstract_inputs(S, S)[3])
        extra = ()
        if self.num_spec:
            sds = jax.ShapeDtypeStruct
            extra = (sds((R, self.vocab), jnp.float32), sds((R,), jnp.int32),
                     abstract_verify_metadata(R, S), p.spec_state)
        return executable_cache.compile(p.sample, logits, p.sampler_state, smd, bitmask,
                                        use_mask, *extra)

    def compile_passes(self, T: int, S: int):
        p = self.programs
        return executable_cache.compile(
            p.passes, p.state, p.kv_cache, p.tables, p.sampler_state,
            *packed_step(self.abstract_inputs(T, S)),
            jax.ShapeDtypeStruct((S,), jnp.int32, sharding=self.replicated),
            *self._adapters(T), options=self.options)

    # looking up: a missing executable compiles, loudly (tests fail on it)
    def _get(self, table: dict, key, compile_fn, what: str):
        exe = table.get(key)
        if exe is None:
            exe = table[key] = compile_fn()
            self.num_compiles_after_warmup += 1
            logger.warning("compiled %s %s outside warm-up", what, key)
        return exe

    def forward(self, shape):
        return self._get(self.forward_executables, shape, partial(self.compile_forward, *shape),
                         "step shape")

    def sample(self, key):
        return self._get(self.sample_executables, key, partial(self.compile_sample, key),
                         "sampling of shape")

    def passes(self, shape):
        return self._get(self.passes_executables, shape, partial(self.compile_passes, *shape),
                         "multi-step shape")

    def activation_bytes(self) -> int:
        """Scratch memory of the largest step, measured from its compiled executables."""
        T, S = self.shapes.all[-1]
        fwd = self.forward_executables.get((T, S)) or self.compile_forward(T, S)
        key = self.sample_key(T, S)
        smp = self.sample_executables.get(key) or self.compile_sample(key)
        # with speculative decoding the verified positions' logits also wait for sampling
        rows = S + (num_verify_rows(T, S, self.num_spec) if self.num_spec else 0)
        scratch = step_scratch_bytes(fwd, smp, rows, self.vocab)
        if self.passes_shapes:  # a multi-step call samples inside it: its scratch is its own
            shape = self.passes_shapes[-1]
            exe = self.passes_executables.get(shape) or self.compile_passes(*shape)
            scratch = max(scratch, passes_scratch_bytes(exe))
        return scratch

    # compiling them all
    def _jobs(self, shapes) -> list:
        """(table, key, compile) for the forward passes of `shapes` and their samplings that
        are not compiled yet."""
        jobs, keys = [], set()
        for s in shapes:  # each shape's sampling right after it: usable as soon as both are
            if s not in self.forward_executables:
                jobs.append((self.forward_executables, s, partial(self.compile_forward, *s)))
            k = self.sample_key(*s)
            if k not in self.sample_executables and k not in keys:
                keys.add(k)
                jobs.append((self.sample_executables, k, partial(self.compile_sample, k)))
        return jobs

    def compile_all(self, progress: bool = True, background: bool = False) -> None:
        """Compile every step shape before returning, or with `background` only the essential
        ones, the rest on a thread."""
        jobs = self._jobs(self.shapes.essential if background else self.shapes.all)
        # a multi-step call's shape is fixed when the scheduler chooses it: all before serving
        jobs += [(self.passes_executables, s, partial(self.compile_passes, *s))
                 for s in self.passes_shapes if s not in self.passes_executables]
        # XLA compiles outside the GIL, so threads overlap the per-shape compiles
        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            futures = [(table, key, pool.submit(fn)) for table, key, fn in jobs]
            bar = tqdm(total=len(futures), desc="compiling step buckets", disable=not progress,
                       unit="shape")
            for table, key, fut in futures:
                table[key] = fut.result()
                bar.update(1)
            bar.close()
        rest = self._jobs(self.shapes.all)
        if rest:
            # one thread: serving keeps the other cores
            self._background = threading.Thread(target=self.compile_remaining, args=(rest,),
                                                name="jaxllm-compile", daemon=True)
            self._background.start()
            # at exit, wait for the executable in progress rather than unload XLA under it
            atexit.register(_stop_thread, self._stop_background, self._background)
            logger.info("%d step executables compile in the background; until each is ready "
                        "its steps pad to a larger compiled shape", len(rest))

    def compile_remaining(self, jobs) -> None:
        """The background thread's work: `jobs` one at a time, until done or stopped, at the
        lowest CPU priority and only while the engine has no request (set_serving): XLA's
        compiler would otherwise take a share of the cores from every step, and until the
        rest are compiled steps pad to essential shapes, which cost little more."""
        _lowest_priority()
        start = time.perf_counter()
        for table, key, fn in jobs:
            while not self._idle.wait(0.5):
                if self._stop_background.is_set():
                    return
            if self._stop_background.is_set():
                return
            try:
                table[key] = fn()
            except Exception:  # steps keep padding to the compiled shapes
                logger.exception("background compilation of step shape %s failed", key)
        self.background_compile_seconds = time.perf_counter() - start
        logger.info("compiled the remaining %d step executables in the background in %.1f s",
                    len(jobs), self.background_compile_seconds)

    def set_serving(self, serving: bool) -> None:
        """Whether the engine has requests: the background compilation pauses meanwhile (a
        shape being compiled finishes first)."""
        if serving:
            self._idle.clear()
        else:
            self._idle.set()

    @property
    def compiling_in_background(self) -> bool:
        return self._background is not None and self._background.is_alive()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the background compilation (if any); True when every shape is compiled."""
        if self._background is not None:
            self._background.join(timeout)
        return all(self.ready(s) for s in self.shapes.all)

    def stop_background(self, wait: bool = True) -> None:
        """Stop after the executable compiling now (XLA cannot be interrupted); `wait`: until
        then."""
        self._stop_background.set()
        if wait and self._background is not None:
            self._background.join()
