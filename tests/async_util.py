"""What the async-loop tests share: the engines' limits, a randomized workload, and a driver
that runs one through an engine step by step."""
import numpy as np
from hypothesis import strategies as st

from jaxllm.sampling_params import SamplingParams

# a small KV pool (39 blocks of 16 tokens) so that the workload preempts. float32: the loops
# batch requests differently, and the CPU bf16 policy's roundings (activations at the dots,
# the KV cache) turn that float noise into bf16 steps of ~1e-3 in a logprob; these tests are
# about the loops, so they compare at float noise
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
              num_gpu_blocks_override=40, dtype="float32", token_buckets=[16, 64], seq_buckets=[4, 8])


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
    """Drive the engine step by step: requests arrive and are aborted at given step numbers
    (a request's "extra": more SamplingParams); returns each request's final outputs (token ids, text, finish reasons, logprobs)."""
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
                stop=[" the"] if w["stop_string"] else None, **w.get("extra", {}))
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
