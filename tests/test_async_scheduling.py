"""Async scheduling is exact: the same randomized workload (arrivals, aborts, stops, n > 1,
preemption by recompute and by swap, logprobs) gives the same outputs with the host
scheduling step N+1 while the device runs step N as with the synchronous loop. So is
speculative decoding (host proposals and a draft model's, accepted and rejected) on top of
the async loop, and multi-step scheduling (several decode passes per device call, in either
loop): greedy and seeded sampled outputs equal the synchronous single-step ones."""
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jaxllm.sampling_params import SamplingParams

# a small KV pool (39 blocks of 16 tokens) so that the workload preempts. float32: the loops
# batch requests differently, and the CPU bf16 policy's roundings (activations at the dots,
# the KV cache) turn that float noise into bf16 steps of ~1e-3 in a logprob; these tests are
# about the loops, so they compare at float noise
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
              num_gpu_blocks_override=40, dtype="float32")


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


request_st = st.fixed_dictionaries({
    "prompt_len": st.one_of(st.integers(3, 75), st.integers(50, 75)),
    "max_tokens": st.one_of(st.integers(1, 60), st.integers(40, 60)),
    "sampled": st.booleans(),
    "n": st.sampled_from([1, 1, 2, 3]),
    "arrive": st.integers(0, 8),
    "abort": st.one_of(st.none(), st.integers(1, 30)),
    "stop_ids": st.booleans(),
    "logprobs": st.sampled_from([None, 0, 2]),
    "stop_string": st.booleans(),
})


def run(engine, workload, tokens):
    """Drive the engine step by step: requests arrive and are aborted at given step numbers;
    returns each request's final outputs (token ids, text, finish reasons, logprobs)."""
    finals, step = {}, 0
    pending = sorted(range(len(workload)), key=lambda i: workload[i]["arrive"])
    while pending or engine.has_unfinished_requests():
        while pending and workload[pending[0]]["arrive"] <= step:
            i = pending.pop(0)
            w = workload[i]
            params = SamplingParams(
                max_tokens=w["max_tokens"], n=w["n"], seed=100 + i, logprobs=w["logprobs"],
                temperature=0.9 if w["sampled"] else 0.0, ignore_eos=not w["stop_ids"],
                stop_token_ids=[int(tokens[i][0])] if w["stop_ids"] else None,
                stop=[" the"] if w["stop_string"] else None)
            engine.add_request(f"r{i}", {"prompt_token_ids": tokens[i][:w["prompt_len"]].tolist()}, params)
        for i, w in enumerate(workload):
            if w["abort"] == step and engine.is_unfinished(f"r{i}"):
                engine.abort_request(f"r{i}")
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs
        step += 1
        assert step < 2000
    kv = engine.kv_manager
    assert kv.num_free_blocks == kv.pool.num_usable_blocks  # nothing leaked
    assert kv.host_pool.num_free_blocks == kv.host_pool.num_blocks
    assert not engine.scheduler.has_unfinished_requests()
    return finals


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


def assert_same_outputs(a, b, rid):
    """Tokens, text and finish reasons exactly; logprobs to float noise (the two loops batch
    differently)."""
    assert len(a) == len(b), rid
    for x, y in zip(a, b):
        assert (x.index, x.token_ids, x.text, x.finish_reason, x.stop_reason) == \
            (y.index, y.token_ids, y.text, y.finish_reason, y.stop_reason), rid
        assert (x.logprobs is None) == (y.logprobs is None), rid
        for t, ex, ey in zip(x.token_ids, x.logprobs or (), y.logprobs or ()):
            # a sampled token deep in the distribution has neighbours within float noise
            assert abs(ex[t].logprob - ey[t].logprob) < 1e-3 and abs(ex[t].rank - ey[t].rank) <= 2, rid
            np.testing.assert_allclose(sorted(lp.logprob for lp in ex.values()),
                                       sorted(lp.logprob for lp in ey.values()), atol=1e-3)


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
            calls.append((out.num_steps, engine._in_flight is not None)), dispatch(out, *a))[1]
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


class OracleSpeculator:
    """Host proposals from a reference run's outputs, some corrupted: exact control over what
    is accepted and rejected (the real n-gram proposer rarely matches on a random model)."""

    def __init__(self, speculator, seed: int):
        self.inner, self.reference = speculator, {}
        self.rng = np.random.default_rng(seed)

    def enabled_for(self, n):
        return self.inner.enabled_for(n)

    def propose(self, running):
        k = self.inner.config.k
        for r in self.inner.eligible(running):
            ref = self.reference.get(r.request_id, [])
            start = r.num_output_tokens + r.num_output_placeholders
            drafts = list(ref[start:start + k])
            if drafts and self.rng.random() < 0.4:  # a wrong token somewhere
                drafts[int(self.rng.integers(len(drafts)))] = int(self.rng.integers(10, 40000))
            r.spec_token_ids = drafts


@pytest.fixture(scope="module")
def spec_engines(peaked_model, tmp_path_factory):
    """Async engines that speculate 3 tokens: host proposals (the n-gram method's path, fed by
    OracleSpeculator) and a draft model (the target with a little noise on its layers: it
    proposes right about a fifth of the time), each with both kinds of preemption."""
    from conftest import noisy_copy
    from jaxllm.engine.llm_engine import LLMEngine
    from jaxllm.config import EngineConfig
    draft = noisy_copy(peaked_model, tmp_path_factory.mktemp("noisy_draft"), 0.05)
    out = {}
    for method, spec in (("ngram", {"method": "ngram", "num_speculative_tokens": 3}),
                         ("draft", {"method": "draft_model", "model": draft, "num_speculative_tokens": 3})):
        for mode in ("recompute", "swap"):
            eng = LLMEngine(EngineConfig(model=peaked_model, preemption_mode=mode, swap_space=0.01,
                                         speculative_config=spec, **ENGINE))
            if method == "ngram":
                eng.speculator = OracleSpeculator(eng.speculator, 0)
            out[method, mode] = eng
    return out


@pytest.mark.slow
@settings(max_examples=8, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(workload=st.lists(request_st, min_size=4, max_size=12), mode=st.sampled_from(["recompute", "swap"]),
       method=st.sampled_from(["ngram", "draft"]), seed=st.integers(0, 2**16))
def test_speculation_equals_sync(engines, spec_engines, workload, mode, method, seed):
    tokens = np.random.default_rng(seed).integers(10, 40000, size=(len(workload), 80))
    sync = run(engines[mode, False], workload, tokens)
    eng = spec_engines[method, mode]
    if method == "ngram":
        eng.speculator.reference = {
            (rid if len(outs) == 1 else f"{o.index}_{rid}"): o.token_ids
            for rid, outs in sync.items() for o in outs}
    before = eng.stats()
    speculated = run(eng, workload, tokens)
    after = eng.stats()
    aborted = {f"r{i}" for i, w in enumerate(workload) if w["abort"] is not None}
    for rid in set(sync) | set(speculated):
        if rid not in aborted:
            assert_same_outputs(sync[rid], speculated[rid], rid)
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert 0 <= accepted <= drafted
    assert eng.runner.num_compiles_after_warmup == 0
    assert eng.runner.drafter is None or eng.runner.drafter.num_compiles_after_warmup == 0


def test_speculation_accepts_and_rejects(engines, spec_engines):
    """The randomized test above must exercise both outcomes: on a fixed workload with long
    outputs, each proposer has proposals accepted and rejected."""
    workload = [dict(prompt_len=p, max_tokens=40, sampled=bool(i % 2), n=1 + (i == 1), arrive=i,
                     abort=None, stop_ids=False, logprobs=None, stop_string=False)
                for i, p in enumerate((20, 70, 9, 33))]
    tokens = np.random.default_rng(5).integers(10, 40000, size=(len(workload), 80))
    sync = run(engines["recompute", False], workload, tokens)
    for method in ("ngram", "draft"):
        eng = spec_engines[method, "recompute"]
        if method == "ngram":
            eng.speculator.reference = {
                (rid if len(outs) == 1 else f"{o.index}_{rid}"): o.token_ids
                for rid, outs in sync.items() for o in outs}
        before = eng.stats()
        got = run(eng, workload, tokens)
        after = eng.stats()
        for rid in sync:
            assert_same_outputs(sync[rid], got[rid], rid)
        drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        assert 0 < accepted < drafted, (method, accepted, drafted)


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
