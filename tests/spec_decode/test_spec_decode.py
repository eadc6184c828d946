"""Speculative decoding: configuration, n-gram proposals, the rejection sampler's distribution,
the scheduler's budget and rollback, and engines whose outputs must equal the unspeculated
ones (greedy and seeded sampling) under continuous batching, preemption, chunked prefill,
n > 1 and aborts, with both proposers."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxllm.config import EngineConfig
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request
from jaxllm.core.scheduler import Scheduler
from jaxllm.runner import rejection_sampler as RS
from jaxllm.runner import sampler as S
from jaxllm.sampling_params import SamplingParams
from jaxllm.spec_decode.config import SpeculativeConfig
from jaxllm.spec_decode.ngram import propose_ngram


# configuration
@pytest.mark.parametrize("cfg,field", [
    ({"num_speculative_tokens": 3}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/x"}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "draft_model", "model": "/x", "num_speculative_tokens": 2,
      "prompt_lookup_max": 3}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"},
     "draft_sample_method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_model": "x"}, "speculative_model"),
])
def test_bad_config_names_the_field(cfg, field):
    with pytest.raises(ValueError, match=f"speculative_config.{field}"):
        EngineConfig(speculative_config=cfg)


def test_speculation_with_lora_is_refused():
    with pytest.raises(ValueError, match="speculative_config is not supported with enable_lora"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                     enable_lora=True)


def test_multi_step_with_speculation_is_refused():
    with pytest.raises(ValueError, match="num_scheduler_steps > 1 does not combine with speculative_config"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                     num_scheduler_steps=4)
    with pytest.raises(ValueError, match="num_scheduler_steps > 1 is not supported across processes"):
        EngineConfig(num_scheduler_steps=2, num_processes=2, distributed_coordinator="localhost:1")
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="num_scheduler_steps must be a positive integer"):
            EngineConfig(num_scheduler_steps=bad)


def test_config_defaults_and_json():
    c = SpeculativeConfig.parse('{"model": "[ngram]", "num_speculative_tokens": 4}')
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max, c.model) == ("ngram", 5, 5, None)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.parse({"model": "/some/dir", "num_speculative_tokens": 2})
    assert c.method == "draft_model" and c.draft_sample_method == "greedy"
    with pytest.raises(ValueError, match="JSON"):
        SpeculativeConfig.parse("{not json")
    from jaxllm.cli import add_engine_args, engine_config_from_args
    import argparse
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--speculative-config", json.dumps(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5})])
    cfg = engine_config_from_args(args).speculative_config
    assert (cfg.method, cfg.k, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 4, 2, 5)


# n-gram proposals
def lookup_reference(tokens, min_n, max_n, k):
    """vLLM's rule, spelled out: the longest n-gram (n <= max_n) ending the tokens that also
    occurs earlier, at its earliest occurrence; the k tokens after it."""
    total = len(tokens)
    best_n, best_end = 0, None
    for n in range(1, max_n + 1):
        suffix = tokens[total - n:]
        for end in range(n - 1, total - 1):
            if tokens[end - n + 1:end + 1] == suffix:
                best_n, best_end = n, end
                break
        else:
            break  # no n-gram this long: none longer either
    if best_n < min_n or total < min_n:
        return []
    return tokens[best_end + 1:best_end + 1 + k]


def test_ngram_matches_the_rule_on_random_batches():
    rng = np.random.default_rng(0)
    for _ in range(400):
        B, L = int(rng.integers(1, 6)), int(rng.integers(1, 40))
        lengths = rng.integers(1, L + 1, size=B)
        tokens = rng.integers(0, int(rng.integers(2, 6)), size=(B, L)).astype(np.int32)
        num = rng.integers(0, 5, size=B)
        mn = int(rng.integers(1, 4))
        mx = int(rng.integers(mn, 6))
        skip = rng.integers(0, 2, size=B)
        drafts, count = propose_ngram(tokens, lengths, num, mn, mx, skip)
        for b in range(B):
            row = tokens[b, :lengths[b]].tolist()
            want = lookup_reference(row, mn, mx, int(num[b]) + int(skip[b]))[int(skip[b]):] if num[b] else []
            assert drafts[b, :count[b]].tolist() == list(want), (row, mn, mx, num[b], skip[b])


# the rejection sampler on its own
def metadata(n, **cols):
    base = dict(temperature=np.zeros(n, np.float32), top_k=np.zeros(n, np.int32),
                top_p=np.ones(n, np.float32), min_p=np.zeros(n, np.float32),
                seeds=np.arange(n, dtype=np.uint32), gen_index=np.zeros(n, np.int32),
                rows=np.arange(n, dtype=np.int32), is_final=np.ones(n, bool),
                repetition_penalty=np.ones(n, np.float32), frequency_penalty=np.zeros(n, np.float32),
                presence_penalty=np.zeros(n, np.float32), min_tokens=np.zeros(n, np.int32),
                has_bias=np.zeros(n, bool), banned=np.full((n, S.MAX_BANNED), -1, np.int32),
                next_ids=np.zeros(1, np.int32))
    for key, v in cols.items():
        base[key] = np.broadcast_to(np.asarray(v, dtype=base[key].dtype), base[key].shape).copy()
    t = base["temperature"] >= S.GREEDY_EPS
    flags = dict(any_random=t.any(), any_filter=(t & ((base["top_k"] > 0) | (base["top_p"] < 1))).any(),
                 any_penalty=False, any_bias=False, any_min_tokens=False, any_banned=False,
                 any_logprobs=True, any_prompt_logprobs=False)
    return S.SamplingMetadata(**base, **{key: np.bool_(v) for key, v in flags.items()})


V, K = 8, 2
TARGET = np.random.default_rng(3).standard_normal((K + 1, V)).astype(np.float32) * 1.5


def verify_batch(drafts, q, n, probabilistic, **cols):
    """n sequences, each [x0, d1..dK] with the same target logits at every position (the
    distribution at position j does not depend on the tokens before it)."""
    ids = np.zeros((n, 1 + K), np.int32)
    ids[:, 1:] = drafts
    R = n * K
    token_idx = (np.arange(n)[:, None] * (1 + K) + np.arange(K)[None, :]).reshape(-1)
    vmd = RS.VerifyMetadata(token_idx.astype(np.int32), np.repeat(np.arange(n), K).astype(np.int32),
                            np.tile(np.arange(K), n).astype(np.int32), np.ones(R, bool),
                            np.full(n, K, np.int32), np.full(n, probabilistic), np.bool_(True),
                            np.bool_(probabilistic))
    smd = metadata(n, seeds=np.arange(n) + 11, gen_index=10 + K, **cols)
    state = S.init_state(n, V)
    probs = (np.broadcast_to(q, (n + 1, K, V)).astype(np.float32) if probabilistic
             else np.zeros((1, K, 1), np.float32))
    spec = RS.SpecState(jnp.zeros((n + 1, K), jnp.int32), jnp.asarray(probs))

    @jax.jit
    def run(raw_v, base_logits, input_ids, smd, vmd, state, spec):
        base, state = S.sample(base_logits, smd, state)
        drafts = input_ids[vmd.token_idx + 1]  # as the forward pass gives them
        return RS.verify(raw_v, drafts, base, smd, vmd, state, spec, K, probabilistic)

    tokens, num, st, state = run(jnp.asarray(np.tile(TARGET[:K], (n, 1))),
                                 jnp.asarray(np.tile(TARGET[K], (n, 1))), ids.reshape(-1), smd,
                                 vmd, state, spec)
    return np.asarray(tokens), np.asarray(num), [np.asarray(x) for x in st], state


def chi2_ok(sample, p):
    counts = np.bincount(sample, minlength=V)
    chi2 = ((counts - len(sample) * p) ** 2 / (len(sample) * p)).sum()
    return chi2 < stats.chi2.ppf(0.999, V - 1), (counts, len(sample) * p)


@pytest.mark.parametrize("probabilistic", [False, True])
def test_rejection_sampling_follows_the_target_with_wrong_drafts(probabilistic):
    """Deliberately wrong proposals (a token below the median, every time; or drawn from a q
    that puts most of its mass on one token) do not bias the emitted tokens: each follows the target's
    distribution, the first one always and the second when the first was accepted."""
    n, rng = 20000, np.random.default_rng(0)
    q = np.full((K, V), 0.02)
    q[:, 0] = 1 - 0.02 * (V - 1)
    if probabilistic:
        drafts = np.stack([rng.choice(V, size=n, p=q[j]) for j in range(K)], 1)
    else:
        drafts = np.tile(np.argsort(TARGET[:K], axis=1)[:, V // 2 - 1], (n, 1))
    tokens, num, st, state = verify_batch(drafts, q, n, probabilistic, temperature=1.0)
    p = np.exp(TARGET - TARGET.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ok, info = chi2_ok(tokens[:, 0], p[0])
    assert ok, info
    accepted = tokens[:, 0] == drafts[:, 0]
    assert 100 < accepted.sum() < n - 100  # both outcomes happen
    ok, info = chi2_ok(tokens[accepted, 1], p[1])
    assert ok, info
    # logprobs are the target's raw logprobs of what was emitted, position by position
    logp = TARGET - np.log(np.exp(TARGET).sum(1, keepdims=True))
    for j in range(K + 1):
        sel = num > j
        np.testing.assert_allclose(st[0][sel, j], logp[j][tokens[sel, j]], atol=1e-5)
    # the sampler state counts exactly what was emitted and ends on the last emitted token
    counts = np.asarray(state.out_counts)[:n]
    want = np.zeros((n, V), np.int64)
    for i in range(n):
        np.add.at(want[i], tokens[i, :num[i]], 1)
    assert (counts == want).all()
    assert (np.asarray(state.last_token)[:n] == tokens[np.arange(n), num - 1]).all()


def test_one_hot_verification_emits_the_samplers_own_tokens():
    """With deterministic proposals every emitted token is the one the sampler draws at that
    output index with the request's seed: speculation does not change seeded outputs."""
    n = 64
    drafts = np.random.default_rng(1).integers(0, V, size=(n, K))
    tokens, num, _, _ = verify_batch(drafts, None, n, False, temperature=0.8, top_k=5)
    for j in range(K + 1):
        md = metadata(n, temperature=0.8, top_k=5, seeds=np.arange(n) + 11, gen_index=10 + j)
        want, *_ = jax.jit(S.sample)(jnp.asarray(np.tile(TARGET[j], (n, 1))), md, S.init_state(n, V))[0]
        sel = num > j
        assert (tokens[sel, j] == np.asarray(want)[sel]).all()
    assert (num > 1).any() and (num == 1).any()


# the scheduler
def sreq(rid, n_prompt, max_tokens=32):
    return Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(max_tokens=max_tokens,
                                                                       ignore_eos=True), 2, 0)


def test_scheduler_budget_rollback_and_prefix_cache():
    kv = KVCacheManager(64, 4, True)
    s = Scheduler(kv, 8, 16, 64, num_spec_tokens=3, num_lookahead_tokens=3)
    a, b = sreq("a", 6), sreq("b", 5, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    s.update_from_output(out, {"a": [100], "b": [200]})
    a.spec_token_ids, b.spec_token_ids = [101, 102, 103], [201, 202, 203]
    out = s.schedule()
    # b may emit 2 more tokens (max_tokens 3): one proposal at most; a gets its three
    assert out.scheduled_spec_decode_tokens == {"a": [101, 102, 103], "b": [201]}
    assert out.num_scheduled_tokens == {"a": 4, "b": 2}
    assert a.num_computed_tokens == 10 and a.spec_token_ids == []
    # held slots: a's 10 scheduled tokens and 3 lookahead need 4 blocks of 4
    assert len(kv.get_blocks("a")) == 4
    # the proposals are not known tokens: only blocks full of known tokens are cached
    assert len(a.block_hashes) == 1
    ups = s.update_from_output(out, {"a": [101, 500], "b": [201, 300]})
    assert [u.new_token_ids for u in ups] == [[101, 500], [201, 300]]
    assert a.num_computed_tokens == 8  # two proposals rejected: computed again
    assert a.all_token_ids[-3:] == [100, 101, 500] and b.status.finished
    assert (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens) == (2, 4, 2)
    assert s.spec_accepted_per_pos == [2, 0, 0]
    # the budget leaves a token for every running request after a speculating one
    s2 = Scheduler(KVCacheManager(64, 4, False), 8, 6, 64, num_spec_tokens=3)
    reqs = [sreq(f"r{i}", 2) for i in range(3)]
    for r in reqs:
        s2.add_request(r)
    out = s2.schedule()
    s2.update_from_output(out, {r.request_id: [50] for r in reqs})
    for r in reqs:
        r.spec_token_ids = [1, 2, 3]
    out = s2.schedule()
    assert out.num_scheduled_tokens == {"r0": 4, "r1": 1, "r2": 1}


# engines on tiny checkpoints (the shapes of conftest.SMALL_ENGINE)
def spec_llm(model, spec, **kw):
    from conftest import SMALL_LIMITS, few_shapes
    from jaxllm import LLM
    kw = {**SMALL_LIMITS, **kw}
    return LLM(model, speculative_config=spec,
               **few_shapes(kw["max_num_seqs"], kw["max_num_batched_tokens"]), **kw)


@pytest.fixture(scope="module")
def self_draft_llm(peaked_model):
    """The draft is the target itself."""
    return spec_llm(peaked_model, {"method": "draft_model", "model": peaked_model,
                                   "num_speculative_tokens": 3, "disable_by_batch_size": 4})


def spec_counts(llm):
    s = llm.llm_engine.stats()
    return np.array([s["spec_decode_num_drafts"], s["spec_decode_num_draft_tokens"],
                     s["spec_decode_num_accepted_tokens"]])


def test_a_draft_equal_to_the_target_accepts_everything(self_draft_llm):
    llm = self_draft_llm
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": rng.integers(10, 40000, size=n).tolist()} for n in (5, 40, 90)]
    before = spec_counts(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, n=2),
                        use_tqdm=False)
    drafts, drafted, accepted = spec_counts(llm) - before
    assert drafts > 0 and accepted == drafted
    assert all(len(c.token_ids) == 30 for o in outs for c in o.outputs)
    eng = llm.llm_engine
    per_pos = eng.stats()["spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == eng.stats()["spec_decode_num_accepted_tokens"]
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.pool.num_usable_blocks
    assert eng.runner.num_compiles_after_warmup == 0
    assert eng.runner.drafter.num_compiles_after_warmup == 0


def test_metrics_mirror_vllms_spec_decode_counters(self_draft_llm):
    from prometheus_client import generate_latest
    from serve.metrics import Metrics
    eng = self_draft_llm.llm_engine
    m = Metrics("tiny")
    self_draft_llm.generate({"prompt_token_ids": list(range(200, 230))},
                            SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    m.on_step(eng, [], 0.0)
    text = generate_latest(m.registry).decode()
    s = eng.stats()
    for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
        assert f'jaxllm:{key}_total{{model_name="tiny"}} {float(s[key])}' in text
    for pos, v in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
        assert (f'jaxllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",'
                f'position="{pos}"}} {float(v)}') in text
    assert s["spec_decode_num_drafts"] > 0
    assert "mean acceptance length" in m.log_line()


def test_disable_by_batch_size(self_draft_llm, monkeypatch):
    """With more than 4 running requests nothing is proposed; with 4 or fewer the same engine
    speculates."""
    eng = self_draft_llm.llm_engine
    rng = np.random.default_rng(3)
    for i, n in enumerate((2, 3, 20, 20, 20, 20)):
        eng.add_request(f"d{i}", {"prompt_token_ids": rng.integers(10, 40000, size=6).tolist()},
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    seen, schedule = [], eng.scheduler.schedule

    def recording():
        running = eng.scheduler.num_running
        out = schedule()
        seen.append((running, len(out.scheduled_spec_decode_tokens)))
        return out

    monkeypatch.setattr(eng.scheduler, "schedule", recording)
    while eng.has_unfinished_requests():
        eng.step()
    assert any(n > 4 for n, _ in seen)
    assert all(d == 0 for n, d in seen if n > 4) and any(d > 0 for n, d in seen if n <= 4)


def test_structured_outputs_are_refused_while_speculating(self_draft_llm):
    """Verified proposals are not masked by a grammar: a constrained request is refused up
    front, naming the field, and the engine carries on."""
    from jaxllm.sampling_params import StructuredOutputsParams
    llm = self_draft_llm
    eng = llm.llm_engine
    params = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    with pytest.raises(ValueError, match="structured_outputs is not supported with speculative_config"):
        llm.generate({"prompt_token_ids": list(range(300, 310))}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs is not supported with speculative_config"):
        eng.add_request("s0", {"prompt_token_ids": list(range(300, 310))}, params)
    assert not eng.has_unfinished_requests() and not eng.scheduler.has_unfinished_requests()
    out = llm.generate({"prompt_token_ids": list(range(300, 310))},
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_quantized_kv_cache_with_a_draft_model(peaked_model):
    """kv_cache_dtype applies to the draft's cache too (QuantizedKV over the same blocks): a
    draft equal to the target still proposes exactly the target's greedy tokens."""
    spec = {"method": "draft_model", "model": peaked_model, "num_speculative_tokens": 2}
    llm = spec_llm(peaked_model, spec, kv_cache_dtype="int8", max_num_seqs=4,
                   max_num_batched_tokens=16, max_model_len=64)
    eng = llm.llm_engine
    from jaxllm.quantization.kv import QuantizedKV
    assert isinstance(eng.runner.kv_cache, QuantizedKV)
    assert isinstance(eng.runner.drafter.kv_cache, QuantizedKV)
    rng = np.random.default_rng(4)
    prompts = [{"prompt_token_ids": rng.integers(10, 40000, size=n).tolist()} for n in (3, 20)]
    before = spec_counts(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)
    drafts, drafted, accepted = spec_counts(llm) - before
    assert drafts > 0 and accepted == drafted
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.pool.num_usable_blocks
    assert eng.runner.num_compiles_after_warmup == 0
    assert eng.runner.drafter.num_compiles_after_warmup == 0


def test_draft_vocabulary_must_match(peaked_model, tmp_path, tokenizer_dir):
    from conftest import make_tiny_checkpoint
    make_tiny_checkpoint(tmp_path, "llama3", tokenizer_dir, vocab_size=49000)
    with pytest.raises(ValueError, match="speculative_config.model: the draft's vocabulary"):
        spec_llm(peaked_model, {"method": "draft_model", "model": str(tmp_path),
                                "num_speculative_tokens": 2})


@pytest.mark.slow
def test_sampled_outputs_follow_the_target_with_a_wrong_draft(peaked_model, tmp_path):
    """End to end, with a draft that is the target with heavy noise on its layers, sampling
    its own q ("probabilistic"): the second output token, always decided by verification
    (accepted, or drawn from the residual), follows the target's distribution given the
    first, as HF transformers computes it."""
    import torch
    import transformers
    from conftest import noisy_copy
    draft = noisy_copy(peaked_model, tmp_path / "draft", 1.0)
    # few step shapes: this engine's compiled programs are its own (probabilistic proposals)
    llm = spec_llm(peaked_model, {"method": "draft_model", "model": draft,
                                  "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"},
                   max_num_batched_tokens=16, max_model_len=64)
    prompt = list(range(100, 120))
    n = 300
    params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=s) for s in range(n)]
    before = spec_counts(llm)
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    drafts, drafted, accepted = spec_counts(llm) - before
    assert drafts >= n and 0 < accepted < drafted
    pairs = [o.outputs[0].token_ids[:2] for o in outs]
    firsts = sorted({a for a, _ in pairs})
    hf = transformers.AutoModelForCausalLM.from_pretrained(peaked_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + [a] for a in firsts])).logits[:, -1]
    probs = dict(zip(firsts, torch.softmax(logits, -1).numpy().astype(np.float64)))
    bins = [1, 2, 3, 6, 21, 10**9]  # ranks 1, 2, 3-5, 6-20, beyond
    observed, expected = np.zeros(5), np.zeros(5)
    for a, b in pairs:
        p = probs[a]
        order = np.argsort(-p)
        rank = int(np.nonzero(order == b)[0][0]) + 1
        observed[np.searchsorted(bins, rank, side="right") - 1] += 1
        for i in range(5):
            expected[i] += p[order[bins[i] - 1:bins[i + 1] - 1]].sum()
    assert expected.min() > 5, expected
    chi2 = ((observed - expected) ** 2 / expected).sum()
    assert chi2 < stats.chi2.ppf(0.999, 4), (observed, expected)
    assert llm.llm_engine.runner.num_compiles_after_warmup == 0


@pytest.mark.slow
def test_default_model_ngram_greedy_identical_on_copy_prompts(default_llm):
    """The default model copying paragraphs: n-gram proposals are mostly accepted, and the
    greedy tokens are the unspeculated engine's, chunked prefill and n = 2 included."""
    from benchmarks import datasets
    from jaxllm import LLM
    # fewer step shapes than default_llm's: the speculating step compiles for this test only
    llm = LLM(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512,
              token_buckets=[16, 64], seq_buckets=[2, 4], speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    src = datasets.TokenSource(llm.llm_engine.arch.vocab_size, set(), 0)
    samples = datasets.copy_dataset(src, llm.get_tokenizer(), 2, output_len=48)
    prompts = [{"prompt_token_ids": s.prompt_token_ids} for s in samples]
    params = [SamplingParams(temperature=0.0, max_tokens=s.output_len, n=1 + i)
              for i, s in enumerate(samples)]
    want = default_llm.generate(prompts, params, use_tqdm=False)
    before = spec_counts(llm)
    got = llm.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert [c.token_ids for c in w.outputs] == [c.token_ids for c in g.outputs]
    drafts, drafted, accepted = spec_counts(llm) - before
    assert accepted > drafted / 2  # it copies
    assert llm.llm_engine.runner.num_compiles_after_warmup == 0
