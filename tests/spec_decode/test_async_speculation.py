"""Speculative decoding on top of the async loop is exact: host proposals and a draft model's,
accepted and rejected, give the same outputs as the synchronous loop without speculation.
(Apart from test_async_scheduling: each engine here compiles a draft model as well, and the
two modules' engines together came within a few thousand of the process's memory-mapping
limit, vm.max_map_count, past which XLA:CPU cannot map compiled code.)"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from async_util import ENGINE, assert_same_outputs, request_st, run


@pytest.fixture(scope="module")
def engines(peaked_model):
    """The synchronous references, one per kind of preemption."""
    from jaxllm.config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine
    return {(mode, False): LLMEngine(EngineConfig(model=str(peaked_model), async_scheduling=False,
                                                  preemption_mode=mode, swap_space=0.01, **ENGINE))
            for mode in ("recompute", "swap")}


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


def run_speculating(eng, method, sync, workload, tokens):
    """The workload on a speculating engine (the oracle proposer reads the synchronous run's
    outputs): its outputs, and the tokens it proposed and had accepted."""
    if method == "ngram":
        eng.speculator.reference = {
            (rid if len(outs) == 1 else f"{o.index}_{rid}"): o.token_ids
            for rid, outs in sync.items() for o in outs}
    before = eng.stats()
    outputs = run(eng, workload, tokens)
    after = eng.stats()
    return (outputs,
            after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"],
            after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"])


@pytest.mark.slow
@settings(max_examples=8, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(workload=st.lists(request_st, min_size=4, max_size=12), mode=st.sampled_from(["recompute", "swap"]),
       method=st.sampled_from(["ngram", "draft"]), seed=st.integers(0, 2**16))
def test_speculation_equals_sync(engines, spec_engines, workload, mode, method, seed):
    tokens = np.random.default_rng(seed).integers(10, 40000, size=(len(workload), 80))
    sync = run(engines[mode, False], workload, tokens)
    eng = spec_engines[method, mode]
    speculated, drafted, accepted = run_speculating(eng, method, sync, workload, tokens)
    aborted = {f"r{i}" for i, w in enumerate(workload) if w["abort"] is not None}
    for rid in set(sync) | set(speculated):
        if rid not in aborted:
            assert_same_outputs(sync[rid], speculated[rid], rid)
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
        got, drafted, accepted = run_speculating(spec_engines[method, "recompute"], method, sync,
                                                 workload, tokens)
        for rid in sync:
            assert_same_outputs(sync[rid], got[rid], rid)
        assert 0 < accepted < drafted, (method, accepted, drafted)
