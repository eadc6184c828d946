"""Async scheduling is exact: the same randomized workload (arrivals, aborts, stops, n > 1,
preemption by recompute and by swap, logprobs) gives the same outputs with the host
scheduling step N+1 while the device runs step N as with the synchronous loop. So is
multi-step scheduling (several decode passes per device call, in either loop): greedy and
seeded sampled outputs equal the synchronous single-step ones. (Speculative decoding on the
async loop: test_async_speculation.)"""
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from async_util import ENGINE, assert_same_outputs, request_st, run
from jaxllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engines(peaked_model):
    """Sync and async engines over a tiny model with peaked logits (conftest.peaked_model):
    the two loops batch requests differently (the async one learns of finished requests a
    step later), which must not flip a greedy choice."""
    from jaxllm.engine.llm_engine import LLMEngine
    from jaxllm.config import EngineConfig
    model = peaked_model
    out = {}
    for mode in ("recompute", "swap"):
        for overlap in (False, True):
            out[mode, overlap] = LLMEngine(EngineConfig(
                model=str(model), async_scheduling=overlap, preemption_mode=mode,
                swap_space=0.01, **ENGINE))
            # multi-step scheduling: 4 decode passes per call while every request decodes
            out[mode, overlap, "multi"] = LLMEngine(EngineConfig(
                model=str(model), async_scheduling=overlap, preemption_mode=mode,
                swap_space=0.01, num_scheduler_steps=4, **ENGINE))
    return out


@pytest.mark.slow
@settings(max_examples=12, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(workload=st.lists(request_st, min_size=4, max_size=16), mode=st.sampled_from(["recompute", "swap"]),
       seed=st.integers(0, 2**16))
def test_async_equals_sync(engines, workload, mode, seed):
    tokens = np.random.default_rng(seed).integers(10, 40000, size=(len(workload), 80))
    sync = run(engines[mode, False], workload, tokens)
    overlapped = run(engines[mode, True], workload, tokens)
    aborted = {f"r{i}" for i, w in enumerate(workload) if w["abort"] is not None}
    # an aborted request may finish in one loop before the abort and not in the other
    for rid in set(sync) | set(overlapped):
        if rid not in aborted:
            assert_same_outputs(sync[rid], overlapped[rid], rid)


@pytest.mark.slow
@settings(max_examples=20, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(workload=st.lists(request_st, min_size=4, max_size=16), mode=st.sampled_from(["recompute", "swap"]),
       overlap=st.booleans(), seed=st.integers(0, 2**16))
def test_multi_step_equals_sync(engines, workload, mode, overlap, seed):
    tokens = np.random.default_rng(seed).integers(10, 40000, size=(len(workload), 80))
    sync = run(engines[mode, False], workload, tokens)
    eng = engines[mode, overlap, "multi"]
    multi = run(eng, workload, tokens)
    aborted = {f"r{i}" for i, w in enumerate(workload) if w["abort"] is not None}
    for rid in set(sync) | set(multi):
        if rid not in aborted:
            assert_same_outputs(sync[rid], multi[rid], rid)
    assert eng.runner.num_compiles_after_warmup == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_multi_step_runs_several_passes_per_call(engines, overlap):
    """Requests that end in the middle of a call (a stop id first sampled at output 13, a
    max_tokens not a multiple of the passes), sampled, seeded, with penalties, logprobs and
    n = 2, and a late arrival: the outputs equal the synchronous single-step loop's, and the
    decode ran as calls of 4 passes."""
    prompts = np.random.default_rng(11).integers(10, 40000, size=(5, 40)).tolist()

    def params(i, stop=None):
        return SamplingParams(max_tokens=(37, 30, 60, 23, 18)[i], n=1 + (i == 1), seed=i,
                              temperature=0.8 * (i % 2), ignore_eos=True, stop_token_ids=stop,
                              logprobs=2 if i == 3 else None,
                              presence_penalty=0.5 if i == 4 else 0.0)

    def drive(engine, stop):
        calls, finals = [], {}
        dispatch = engine.runner.dispatch
        # each call's passes, and whether the step before it was still unread (in flight)
        engine.runner.dispatch = lambda out, *a: (
            calls.append((out.num_passes, engine._in_flight is not None)), dispatch(out, *a))[1]
        try:
            for i in range(4):
                engine.add_request(f"m{i}", prompts[i], params(i, stop if i == 2 else None))
            step = 0
            while engine.has_unfinished_requests():
                if step == 9:  # arrives while the others decode
                    engine.add_request("m4", prompts[4], params(4))
                for out in engine.step():
                    if out.finished:
                        finals[out.request_id] = out.outputs
                step += 1
        finally:
            del engine.runner.dispatch
        assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_usable_blocks
        return calls, finals

    _, free = drive(engines["recompute", False], None)
    out2 = free["m2"][0].token_ids
    stop = next(t for j, t in enumerate(out2) if j >= 13 and t not in out2[:j])
    _, sync = drive(engines["recompute", False], [stop])
    calls, got = drive(engines["recompute", overlap, "multi"], [stop])
    assert sync["m2"][0].finish_reason == "stop" and sync["m2"][0].token_ids[-1] == stop
    for rid in sync:
        assert_same_outputs(sync[rid], got[rid], rid)
    passes = [n for n, _ in calls]
    assert passes.count(4) >= 10 and 1 in passes  # decode in calls of 4 passes; prefills single
    # the async loop launches a call while the one before it runs
    overlapped = sum(ahead for n, ahead in calls if n == 4)
    assert overlapped >= (9 if overlap else 0) and (overlap or overlapped == 0)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_while_in_flight_keeps_its_token(engines, mode):
    """A request preempted while its step is in flight still gets that step's token (swapped
    out, it would otherwise come back one token short), and its output equals the
    synchronous engine's."""
    eng = engines[mode, True]
    prompts = np.random.default_rng(7).integers(10, 40000, size=(8, 60))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    outs = {}
    for e in (engines[mode, False], eng):
        before = e.num_preemptions
        for i, p in enumerate(prompts):
            e.add_request(f"p{i}", p.tolist(), params)
        got = {}
        while e.has_unfinished_requests():
            for o in e.step():
                if o.finished:
                    got[o.request_id] = o.outputs[0].token_ids
        assert e.num_preemptions > before  # the pool was too small for all eight
        if mode == "swap":
            assert e.scheduler.num_swaps > 0
        outs[e is eng] = got
    assert outs[True] == outs[False]


def test_core_imports_no_jax():
    code = ("import sys, jaxllm, jaxllm.core.scheduler, jaxllm.core.kv_cache_manager, "
            "jaxllm.sampling_params, jaxllm.engine.input_processor\n"
            "from jaxllm import SamplingParams\n"
            "assert 'jax' not in sys.modules, 'jax was imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


CONSTRAINTS = [
    {"choice": ["alpha", "beta", "gamma delta"]},
    {"regex": "[a-z]{2,6}( [a-z]{2,6}){0,2}"},
    {"json": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "c": {"type": "string", "enum": ["x", "y"]},
        "l": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
        "required": ["n", "c"], "additionalProperties": False}, "disable_any_whitespace": True},
]


def matches(constraint: dict, text: str) -> bool:
    import json
    import re
    import jsonschema
    if "choice" in constraint:
        return text in constraint["choice"]
    if "regex" in constraint:
        return re.fullmatch(constraint["regex"], text) is not None
    jsonschema.validate(json.loads(text), constraint["json"])
    return True


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constrained_requests_async_equals_sync(engines, mode):
    """Structured outputs in both loops, with preemption: the async loop computes a row's
    token mask after reading the previous step (while the forward pass runs) and its outputs
    equal the synchronous loop's; each constrained output satisfies its constraint; the free
    requests get exactly what they get without constrained ones beside them."""
    from jaxllm.sampling_params import StructuredOutputsParams
    prompts = np.random.default_rng(3).integers(10, 40000, size=(10, 70))
    kinds = [CONSTRAINTS[i % 3] if i % 2 == 0 else None for i in range(10)]

    def params(i, kind):
        if kind is None:
            return SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.7 * (i % 4 == 1),
                                  seed=i)
        return SamplingParams(max_tokens=30, n=2 if i == 4 else 1, seed=i, temperature=0.7 * (i == 4),
                              structured_outputs=StructuredOutputsParams(**kind))

    def run_all(engine, which):
        for i in which:
            p = params(i, kinds[i])
            if p.structured_outputs is not None:  # compiled now: both loops batch alike
                engine.structured.compile(engine.structured.prepare(p.structured_outputs)).result()
            engine.add_request(f"c{i}", prompts[i].tolist(), p)
        finals = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.outputs
        kv = engine.kv_manager
        assert kv.num_free_blocks == kv.pool.num_usable_blocks
        return finals

    before = engines[mode, True].num_preemptions
    sync = run_all(engines[mode, False], range(10))
    overlapped = run_all(engines[mode, True], range(10))
    assert engines[mode, True].num_preemptions > before  # the pool is too small for all ten
    for rid in sync:
        assert_same_outputs(sync[rid], overlapped[rid], rid)
    for i, kind in enumerate(kinds):
        for c in overlapped[f"c{i}"]:
            if kind is not None:
                assert c.finish_reason == "stop" and matches(kind, c.text), (kind, c.text)
    free = [i for i, k in enumerate(kinds) if k is None]
    alone = run_all(engines[mode, True], free)
    for i in free:
        assert alone[f"c{i}"][0].token_ids == overlapped[f"c{i}"][0].token_ids
