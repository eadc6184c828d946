"""compile_in_background: the engine is ready once the shapes that hold any step are compiled
(StepShapes.essential); the others compile on a thread while steps pad to compiled shapes."""
import threading

import numpy as np
import pytest

from conftest import SMALL_LIMITS
from jaxllm import LLM, SamplingParams
from jaxllm.runner.compiler import StepCompiler


@pytest.fixture()
def held_background(monkeypatch):
    """The background compilation waits until the test sets the returned event."""
    release = threading.Event()
    original = StepCompiler.compile_remaining

    def held(self, jobs):
        release.wait()
        original(self, jobs)

    monkeypatch.setattr(StepCompiler, "compile_remaining", held)
    yield release
    release.set()


def test_steps_pad_to_essential_shapes_until_the_rest_compile(tiny_llama, tiny_llm, held_background):
    llm = LLM(tiny_llama, dtype="float32", compile_in_background=True, **SMALL_LIMITS)
    runner = llm.llm_engine.runner
    shapes = runner.shapes
    compiled = runner.compiler.forward_executables
    assert set(compiled) == set(shapes.essential) and len(shapes.essential) < len(shapes.all)
    used = []
    pick = runner.pick_shape

    def spy(tokens, seqs):
        shape = pick(tokens, seqs)
        used.append((shapes.pick(tokens, seqs), shape))
        return shape

    runner.pick_shape = spy
    rng = np.random.default_rng(3)
    prompts = [rng.integers(10, 40000, size=n).tolist() for n in (3, 17, 40, 5, 9)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    got = llm.generate(prompts, params, use_tqdm=False)
    want = tiny_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    # every step ran in a compiled shape, some padded past their own bucket
    assert all(shape in shapes.essential for _, shape in used)
    assert any(ideal != shape for ideal, shape in used)
    assert runner.num_compiles_after_warmup == 0
    del runner.pick_shape

    held_background.set()
    assert runner.wait_compiled(timeout=600)
    assert set(compiled) == set(shapes.all)
    assert runner.compiler.background_compile_seconds is not None
    assert all(runner.pick_shape(t, s) == shapes.pick(t, s) for t in range(1, 65) for s in (1, 3, 8) if s <= t)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in want]
    assert runner.num_compiles_after_warmup == 0
    llm.llm_engine.shutdown()


def test_shutdown_stops_the_background_compilation(tiny_llama, held_background):
    llm = LLM(tiny_llama, dtype="float32", compile_in_background=True, **SMALL_LIMITS)
    runner = llm.llm_engine.runner
    compiled = runner.compiler.forward_executables
    before = set(compiled)
    # as shutdown does, before the held thread may start
    runner.compiler.stop_background(wait=False)
    held_background.set()
    llm.llm_engine.shutdown()
    assert not runner.compiler.compiling_in_background
    assert set(compiled) == before and not runner.wait_compiled(timeout=0)


def test_a_failed_background_compile_pads_and_never_compiles_in_a_step(tiny_llama, tiny_llm, monkeypatch):
    """A shape whose background compilation fails stays padded to a compiled one after the
    thread ends: no step compiles it."""
    original = StepCompiler.compile_forward

    def failing(self, T, S):
        if threading.current_thread().name == "jaxllm-compile" and (T, S) == (1, 1):
            raise RuntimeError("out of memory (test)")
        return original(self, T, S)

    monkeypatch.setattr(StepCompiler, "compile_forward", failing)
    llm = LLM(tiny_llama, dtype="float32", compile_in_background=True, **SMALL_LIMITS)
    runner = llm.llm_engine.runner
    assert not runner.wait_compiled(timeout=600)  # finished, one shape missing
    assert (1, 1) not in runner.compiler.forward_executables
    assert not runner.compiler.compiling_in_background
    assert runner.pick_shape(1, 1) == (2, 2)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    want = tiny_llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert runner.num_compiles_after_warmup == 0
    llm.llm_engine.shutdown()


def test_background_compilation_waits_while_requests_run(tiny_llama, held_background):
    """The rest of the shapes compile only while the engine has no request: a step being
    served never shares the cores with XLA's compiler."""
    llm = LLM(tiny_llama, dtype="float32", compile_in_background=True, **SMALL_LIMITS)
    engine, compiler = llm.llm_engine, llm.llm_engine.runner.compiler
    before = set(compiler.forward_executables)
    engine.add_request("r", list(range(10, 30)), SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()
    held_background.set()  # the thread may start: it finds the engine serving
    assert not compiler.wait_compiled(timeout=2)
    assert set(compiler.forward_executables) == before
    while engine.has_unfinished_requests():
        engine.step()
    assert compiler.wait_compiled(timeout=600)  # idle: it goes on
    assert len(compiler.forward_executables) > len(before)


def test_while_compiling_a_gpu_step_never_takes_a_decode_only_shape():
    """On a GPU a square shape is decode-only: while the shapes compile, a step whose own
    shape is not ready takes the smallest ready one that holds it, and a step with a
    prefill never a square one."""
    from jaxllm.runner.buckets import step_shapes
    from jaxllm.runner.compiler import StepCompiler
    compiler = StepCompiler(None, step_shapes("gpu", 512, 256), 100, 16, 64, lambda T: 16, 256)
    compiler._background = object()  # (compiling in the background)
    for shape in ((64, 64), (512, 256)):
        compiler.forward_executables[shape] = compiler.sample_executables[shape[1]] = object()
    assert compiler.pick_shape(40, 20) == (512, 256)  # (64, 32) not ready, (64, 64) decode-only
    assert compiler.pick_shape(20, 20) == (64, 64)
    compiler.forward_executables[64, 32] = compiler.sample_executables[32] = object()
    assert compiler.pick_shape(40, 20) == (64, 32)


def test_a_gpu_shape_set_serves_the_same_tokens(tiny_llama, tiny_llm, monkeypatch):
    """A GPU's shape set through a whole engine (on the CPU): decode steps run in square,
    decode-only shapes (no prefill-tile attention compiled in), steps with a prefill in
    shapes with T > S, and greedy tokens equal the CPU shape set's, with nothing compiled
    after warm-up."""
    from jaxllm.runner import buckets, model_runner

    def gpu_shapes(platform, *args, **kw):
        return buckets.step_shapes("gpu", *args, **kw)
    monkeypatch.setattr(model_runner, "step_shapes", gpu_shapes)
    llm = LLM(tiny_llama, dtype="float32", max_num_seqs=16, max_num_batched_tokens=64,
              max_model_len=256, token_buckets=[16, 64], seq_buckets=[4, 8, 16])
    runner = llm.llm_engine.runner
    assert runner.shapes.square_decodes and runner.shapes.squares == [16]
    used = []
    prepare = runner.inputs.prepare

    def recorded(out, pick):
        res = prepare(out, pick)
        used.append((res[1], out.total_num_scheduled_tokens == len(out.num_scheduled_tokens)))
        return res
    runner.inputs.prepare = recorded
    prompts = [list(range(10 + i, 10 + i + 5 + 9 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = llm.generate(prompts, params, use_tqdm=False)
    want = tiny_llm.generate(prompts, params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    assert any(decode for _, decode in used) and any(not decode for _, decode in used)
    for (T, S), decode in used:
        assert (T == S) == decode, (T, S)
    assert runner.num_compiles_after_warmup == 0
    llm.llm_engine.shutdown()
