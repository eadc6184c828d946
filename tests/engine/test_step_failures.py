"""A failed step harms only its requests: they end with finish_reason "error" and the reason,
their blocks come back, everything else finishes exactly as it would have, and the engine
serves on; a step that loses the KV cache rebuilds it and the other running requests compute
their tokens again; a request whose logits are NaN fails alone; too many failures in a window
stop the engine."""
import os
import shutil

import jax
import numpy as np
import pytest

from conftest import SMALL_ENGINE
from jaxllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


class FailAt:
    """The engine's fault hook: the listed steps (counted from 1) raise as a device would;
    `lose_state`: they delete the KV cache first, as a failed donated call can."""

    def __init__(self, steps, lose_state=False):
        self.steps, self.lose_state, self.n = set(steps), lose_state, 0

    def maybe_fail(self, runner):
        self.n += 1
        if self.n in self.steps:
            if self.lose_state:
                for x in jax.tree.leaves(runner.kv_cache):
                    x.delete()
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while trying to allocate (test)")


def run(engine, prompts, faults=None) -> dict:
    """Every prompt added at once, stepped to the end: the final output of each, by id."""
    engine.faults = faults
    try:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, GREEDY)
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
        return done
    finally:
        engine.faults = None


def assert_idle(engine) -> None:
    """Nothing left behind: no request, every KV block free."""
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests
    assert engine.kv_cache_usage() == 0.0


def alone(llm, prompt) -> list[int]:
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", **SMALL_ENGINE)


PROMPTS = [[10 + i, 200 + i, 3000 + i] for i in range(10)]  # two more than max_num_seqs


def test_a_failed_step_fails_its_requests_only(llm, tiny_llm):
    eng = llm.llm_engine
    before = eng.stats()
    done = run(eng, PROMPTS, FailAt({3}))
    failed = {rid for rid, o in done.items() if o.outputs[0].finish_reason == "error"}
    # the eight running at step 3 fail; the two waiting for a slot run afterwards
    assert failed == {str(i) for i in range(8)}
    assert all("out of memory" in done[r].outputs[0].error for r in failed)
    for i in (8, 9):
        assert done[str(i)].outputs[0].finish_reason == "length"
        assert done[str(i)].outputs[0].token_ids == alone(tiny_llm, PROMPTS[i])
    assert_idle(eng)
    after = eng.stats()
    assert after["num_failed_steps"] - before["num_failed_steps"] == 1
    assert after["num_failed_requests"] - before["num_failed_requests"] == 8
    assert after["num_device_state_resets"] == before["num_device_state_resets"]
    # the engine serves on, with the same results as ever (the failed prompts included: their
    # blocks left the prefix cache, unwritten)
    assert alone(llm, PROMPTS[0]) == alone(tiny_llm, PROMPTS[0])


def test_a_step_that_loses_the_cache_rebuilds_it(llm, tiny_llm):
    """The failed step took the KV cache: a fresh one, the waiting requests run in it as
    they would have, and a prompt cached before is computed again (its blocks' contents are
    gone), with the same result."""
    eng = llm.llm_engine
    cached = list(range(500, 540))  # two full blocks in the prefix cache
    alone(llm, cached)
    resets = eng.stats()["num_device_state_resets"]
    done = run(eng, PROMPTS, FailAt({2}, lose_state=True))
    assert eng.stats()["num_device_state_resets"] == resets + 1
    assert {r for r, o in done.items() if o.outputs[0].finish_reason == "error"} == {
        str(i) for i in range(8)}
    for i in (8, 9):
        assert done[str(i)].outputs[0].token_ids == alone(tiny_llm, PROMPTS[i])
    assert_idle(eng)
    again = llm.generate([cached], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == alone(tiny_llm, cached)


def test_too_many_failures_stop_the_engine(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", max_step_failures=2, step_failure_window=600,
              **SMALL_ENGINE)
    eng = llm.llm_engine
    done = run(eng, PROMPTS[:1], FailAt({1}))  # the first failure is absorbed
    assert done["0"].outputs[0].finish_reason == "error"
    with pytest.raises(RuntimeError, match="out of memory"):
        run(eng, PROMPTS[1:2], FailAt({1}))


@pytest.fixture(scope="module")
def nan_model(tiny_llama, tmp_path_factory):
    """tiny_llama with token 77's embedding NaN: any request holding 77 has NaN logits."""
    from safetensors.numpy import save_file

    from jaxllm.loader.safetensors_io import read_safetensors
    d = tmp_path_factory.mktemp("nan_model")
    shutil.copytree(tiny_llama, d, dirs_exist_ok=True)
    path = os.path.join(d, "model.safetensors")
    weights = {k: np.array(v) for k, v in read_safetensors(path).items()}
    weights["model.embed_tokens.weight"][77] = np.nan
    save_file(weights, path)
    return str(d)


def test_nan_logits_fail_their_request_alone(nan_model):
    # 16 usable blocks (the least for max_model_len 256), one per request
    llm = LLM(nan_model, dtype="float32", num_gpu_blocks_override=17, **SMALL_ENGINE)
    eng = llm.llm_engine
    prompts = [[5, 6, 7], [8, 77, 9], [10, 11, 12], [77]]
    want = {str(i): alone(llm, p) for i, p in enumerate(prompts) if 77 not in p}
    done = run(eng, prompts)
    for i, p in enumerate(prompts):
        out = done[str(i)].outputs[0]
        if 77 in p:
            assert out.finish_reason == "error" and "NaN" in out.error and out.token_ids == []
        else:
            assert out.finish_reason == "length" and out.token_ids == want[str(i)]
    assert_idle(eng)
    # the blocks the NaN requests wrote are handed out again (18 requests go through every
    # block, least recently used first), and nothing of them shows
    again = run(eng, [prompts[0], prompts[2]] * 9)
    assert [again[str(i)].outputs[0].token_ids for i in range(18)] == [want["0"], want["2"]] * 9


def test_outputs_made_before_a_failure_in_the_same_call_still_go_out(llm, tiny_llm, monkeypatch):
    """A call to step() reads one step, finishing a request, then fails later on: the
    finished request's output is returned all the same (its stream would otherwise wait
    forever); only the steps not yet read fail."""
    eng = llm.llm_engine
    made, real = [], eng.outputs.make_outputs

    def recording(*a, **k):
        outs = real(*a, **k)
        made.extend(o for o in outs if o.finished)
        return outs

    def failing_once():
        if made and not failed:
            failed.append(True)
            raise RuntimeError("a failure after the read (test)")

    failed = []
    monkeypatch.setattr(eng.outputs, "make_outputs", recording)
    monkeypatch.setattr(eng.engine_stats, "account_step", failing_once)
    done = run(eng, [PROMPTS[0]])
    assert failed and done["0"].outputs[0].finish_reason == "length"
    assert done["0"].outputs[0].token_ids == alone(tiny_llm, PROMPTS[0])
    assert_idle(eng)
