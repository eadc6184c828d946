"""Sampling: parameter validation, the sampler's distribution (chi-square), penalties and
masks exactly as vLLM defines them, logprobs against HF, seeds, best_of and beam search."""
import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxllm import BeamSearchParams, SamplingParams
from jaxllm.runner import sampler as S


# validation
@pytest.mark.parametrize("field,value", [
    ("n", 0), ("best_of", 1), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -1),
    ("prompt_logprobs", -2), ("seed", 1.5), ("stop", [""]), ("stop_token_ids", [-1]),
    ("bad_words", [""]), ("logit_bias", {"x": 1}), ("allowed_token_ids", []),
])
def test_invalid_values_name_the_field(field, value):
    kwargs = {field: value}
    if field == "best_of":
        kwargs["n"] = 2
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    p = SamplingParams(top_k=-1, logit_bias={"5": 300.0}, stop="END")
    assert p.top_k == 0 and p.logit_bias == {5: 100.0} and p.stop_strings == ["END"]
    assert p.max_tokens == 16 and p.temperature == 1.0 and p.n == 1
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=3)


@pytest.mark.parametrize("V", [100, 3 * S.ARGMAX_CHUNK, 5000])
def test_two_pass_argmax_equals_argmax(V):
    """The chunked argmax returns jnp.argmax's index: the first maximum, ties across and
    inside chunks, rows of -inf, NaN (the first NaN), a vocabulary the chunk does not divide
    (padded)."""
    rng = np.random.default_rng(V)
    x = rng.standard_normal((8, V)).astype(np.float32)
    x[1, [7, V - 3]] = 50.0               # a tie far apart: the first wins
    x[2, [V // 2, V // 2 + 1]] = 50.0     # a tie inside one chunk
    x[3] = -np.inf
    x[4, [V // 3, V - 1]] = np.nan
    x[5, V - 1] = 60.0                    # in the padded last chunk
    x[6] = np.round(x[6])                 # many ties
    got = np.asarray(jax.jit(S.argmax)(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert got[1] == 7 and got[2] == V // 2 and got[4] == V // 3 and got[5] == V - 1


# the sampler on its own
def metadata(num_rows: int, vocab_rows=None, **cols) -> S.SamplingMetadata:
    n = num_rows
    base = dict(temperature=np.zeros(n, np.float32), top_k=np.zeros(n, np.int32),
                top_p=np.ones(n, np.float32), min_p=np.zeros(n, np.float32),
                seeds=np.arange(n, dtype=np.uint32), gen_index=np.zeros(n, np.int32),
                rows=np.arange(n, dtype=np.int32), is_final=np.ones(n, bool),
                repetition_penalty=np.ones(n, np.float32), frequency_penalty=np.zeros(n, np.float32),
                presence_penalty=np.zeros(n, np.float32), min_tokens=np.zeros(n, np.int32),
                has_bias=np.zeros(n, bool), banned=np.full((n, S.MAX_BANNED), -1, np.int32),
                next_ids=np.zeros(1, np.int32))
    for k, v in cols.items():
        base[k] = np.broadcast_to(np.asarray(v, dtype=base[k].dtype), base[k].shape).copy()
    t = base["temperature"] >= S.GREEDY_EPS
    flags = dict(
        any_random=t.any(),
        any_filter=(t & ((base["top_k"] > 0) | (base["top_p"] < 1) | (base["min_p"] > 0))).any(),
        any_penalty=((base["repetition_penalty"] != 1) | (base["frequency_penalty"] != 0)
                     | (base["presence_penalty"] != 0)).any(),
        any_bias=base["has_bias"].any(), any_min_tokens=(base["min_tokens"] > base["gen_index"]).any(),
        any_banned=(base["banned"] >= 0).any(), any_logprobs=True, any_prompt_logprobs=False)
    return S.SamplingMetadata(**base, **{k: np.bool_(v) for k, v in flags.items()})


def expected_distribution(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM's semantics in plain numpy: temperature, min_p, top-k, top-p (renormalised)."""
    x = logits / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-x, kind="stable")
    keep = p >= min_p * p.max()
    if top_k > 0:
        keep[order[top_k:]] = False
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    mass_before = np.cumsum(q[order]) - q[order]
    drop = order[mass_before >= top_p]
    q[drop] = 0.0
    return q / q.sum()


@pytest.mark.parametrize("cfg", [
    dict(temperature=1.0), dict(temperature=0.6), dict(temperature=1.3, top_k=3),
    dict(temperature=1.0, top_p=0.7), dict(temperature=0.9, min_p=0.15),
    dict(temperature=1.1, top_k=5, top_p=0.8, min_p=0.05),
])
def test_sampling_matches_expected_distribution(cfg):
    logits = np.array([2.0, 1.5, 1.2, 0.7, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0], np.float32)
    n = 6000
    md = metadata(n, **cfg)
    state = S.init_state(n, logits.size)
    (tokens, *_), _ = jax.jit(S.sample)(jnp.tile(logits, (n, 1)), md, state)
    counts = np.bincount(np.asarray(tokens), minlength=logits.size)
    want = expected_distribution(logits.astype(np.float64), cfg["temperature"], cfg.get("top_k", 0),
                                 cfg.get("top_p", 1.0), cfg.get("min_p", 0.0))
    assert counts[want == 0].sum() == 0, "a filtered-out token was sampled"
    live = want > 0
    if live.sum() > 1:
        chi2 = (((counts[live] - n * want[live]) ** 2) / (n * want[live])).sum()
        assert chi2 < stats.chi2.ppf(0.999, live.sum() - 1), (counts, n * want)


def test_filter_from_candidates_equals_the_full_sort(monkeypatch):
    """filter_logits decides a row from its 64 largest logits when its kept prefix ends among
    them, else from 1,024, else by sorting the row, with the sort's mask in every case. Which
    path ran shows by replacing the sort with NaNs: peaked rows never reach it, a top-k past
    the candidates (whose mass is then unknown) and flat rows do. A row without filters keeps
    every token beside filtered ones."""
    rng = np.random.default_rng(7)
    V = 3000
    peaked = (rng.standard_normal((12, V)) * 4).astype(np.float32)
    top_k = np.array([0, 5, 0, 0, 2000, 0, 40, 0, 0, 1500, 0, 0], np.int32)
    top_p = np.array([1.0, 1.0, 0.9, 0.5, 0.95, 1.0, 0.8, 0.999, 1.0, 1.0, 0.3, 0.99], np.float32)
    min_p = np.array([0.0, 0.0, 0.0, 0.1, 0.0, 0.05, 0.0, 0.0, 0.0, 0.001, 0.2, 0.0], np.float32)
    sets = {"64": [0, 1, 3, 6, 10], "1024": [2, 7, 9, 11, 8], "sort": list(range(12))}
    want = {name: np.asarray(S._filter_sorted(peaked[r], top_k[r], top_p[r], min_p[r]))
            for name, r in sets.items()}
    flat = (rng.standard_normal((2, V)) * 0.5).astype(np.float32)
    flat_args = (np.zeros(2, np.int32), np.array([0.9, 1.0], np.float32), np.zeros(2, np.float32))
    want["flat"] = np.asarray(S._filter_sorted(flat, *flat_args))
    assert np.isinf(want["flat"][0]).any() and not np.isinf(want["flat"][1]).any()
    assert (~np.isinf(want["1024"])).sum(-1)[:3].max() > 64  # beyond the first candidates
    monkeypatch.setattr(S, "_filter_sorted", lambda x, *_: jnp.full_like(x, jnp.nan))
    for name in ("64", "1024"):
        r = sets[name]
        got = np.asarray(S.filter_logits(peaked[r], top_k[r], top_p[r], min_p[r]))
        np.testing.assert_array_equal(got, want[name])
    r = sets["sort"]
    assert np.isnan(np.asarray(S.filter_logits(peaked[r], top_k[r], top_p[r], min_p[r]))).all()
    assert np.isnan(np.asarray(S.filter_logits(flat, *flat_args))).all()
    monkeypatch.setattr(S, "FILTER_CANDIDATES", (64,))
    r = sets["1024"]
    assert np.isnan(np.asarray(S.filter_logits(peaked[r], top_k[r], top_p[r], min_p[r]))).all()


def test_gumbel_rows_draw_uniformly_over_a_wide_row():
    """The hashed Gumbel noise: equal logits over 600 entries, 36,000 draws from consecutive
    seeds and token indices, spread evenly (chi-square) with no pull toward low or high
    entries; the same (seed, index) gives the same noise."""
    V, n = 600, 36000
    seeds = np.arange(n, dtype=np.uint32) // 6
    index = (np.arange(n) % 6).astype(np.int32)
    noise = jax.jit(S.gumbel_rows, static_argnums=2)(seeds, index, V)
    tokens = np.asarray(S.argmax(noise))
    counts = np.bincount(tokens, minlength=V)
    chi2 = ((counts - n / V) ** 2 / (n / V)).sum()
    assert chi2 < stats.chi2.ppf(0.999, V - 1), chi2
    assert abs(tokens.mean() - (V - 1) / 2) < 4 * np.sqrt((V ** 2 - 1) / 12 / n)
    g = np.asarray(noise[:200]).ravel()  # standard Gumbel: mean 0.5772, variance pi^2 / 6
    assert abs(g.mean() - 0.5772) < 0.02 and abs(g.var() - np.pi ** 2 / 6) < 0.05
    again = np.asarray(S.gumbel_rows(seeds[:5], index[:5], V))
    np.testing.assert_array_equal(again, np.asarray(noise[:5]))


def test_seed_draws_do_not_depend_on_the_batch():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((8, 50)).astype(np.float32)
    md = metadata(8, temperature=1.0, seeds=np.arange(100, 108), gen_index=3)
    state = S.init_state(8, 50)
    (alone, *_), _ = jax.jit(S.sample)(jnp.asarray(logits), md, state)
    # the same rows shuffled among other rows draw the same tokens
    perm = rng.permutation(8)
    md2 = metadata(8, temperature=1.0, seeds=np.arange(100, 108)[perm], gen_index=3)
    (shuffled, *_), _ = jax.jit(S.sample)(jnp.asarray(logits[perm]), md2, state)
    assert np.array_equal(np.asarray(alone)[perm], np.asarray(shuffled))


def test_penalties_match_vllm_definitions():
    rng = np.random.default_rng(1)
    R, V = 4, 30
    logits = rng.standard_normal((R, V)).astype(np.float32) * 3
    counts = rng.integers(0, 3, size=(R, V)).astype(np.int32) * (rng.random((R, V)) < 0.3)
    prompt = rng.random((R, V)) < 0.2
    rep = np.array([1.0, 1.3, 0.8, 2.0], np.float32)
    freq = np.array([0.0, 0.5, -0.4, 1.0], np.float32)
    pres = np.array([0.0, 0.7, 0.3, -1.0], np.float32)
    got = np.asarray(S.apply_penalties(jnp.asarray(logits), jnp.asarray(counts), jnp.asarray(prompt),
                                       rep, freq, pres))
    want = logits.copy()
    for r in range(R):
        for v in range(V):
            x = want[r, v]
            if counts[r, v] > 0 or prompt[r, v]:
                x = x / rep[r] if x > 0 else x * rep[r]
            x -= freq[r] * counts[r, v]
            x -= pres[r] * (counts[r, v] > 0)
            want[r, v] = x
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_plain_greedy_batch_matches_the_general_path():
    """A greedy batch with nothing else to apply takes a shortcut (only the argmax; no branch
    returns a copy of the logits): its tokens and state are the general path's, and a token
    bitmask still applies."""
    rng = np.random.default_rng(1)
    V = 3000  # > 2 chunks: the two-pass argmax
    logits = rng.standard_normal((4, V)).astype(np.float32)
    full = metadata(4, is_final=[True, True, False, True])
    plain = dataclasses.replace(full, any_logprobs=np.bool_(False))
    run = jax.jit(S.sample)
    (t_plain, lp_plain, *_), st_plain = run(logits, plain, S.init_state(4, V))
    (t_full, lp_full, *_), st_full = run(logits, full, S.init_state(4, V))
    want = logits.argmax(-1)
    assert np.asarray(t_plain).tolist() == want.tolist() == np.asarray(t_full).tolist()
    assert not np.asarray(lp_plain).any() and np.asarray(lp_full).all()
    for a, b in zip(jax.tree.leaves(st_plain), jax.tree.leaves(st_full)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(st_plain.out_counts)[2].sum() == 0  # a partial prefill's token
    # the argmax of each row banned by a bitmask: the runner-up is taken
    words = np.full((4, -(-V // 32)), 0xFFFFFFFF, np.uint32)
    for r, t in enumerate(want):
        words[r, t // 32] &= ~np.uint32(1 << (t % 32))
    (t_mask, *_), _ = run(logits, plain, S.init_state(4, V), words.view(np.int32), np.bool_(True))
    assert np.asarray(t_mask).tolist() == np.argsort(-logits, -1)[:, 1].tolist()


def test_sampler_state_rows_and_counts():
    V = 12
    state = S.init_state(3, V)
    tokens = np.zeros((8, 10), np.int32)
    tokens[0, :6] = [1, 2, 2, 5, 5, 5]  # prompt of 3, outputs 5, 5, 5
    rows = np.array([1] + [3] * 7, np.int32)
    bias = np.zeros((8, V), np.float32)
    bias[0, 4] = 2.5
    stop = np.zeros((8, V), bool)
    stop[0, 7] = True
    n_prompt = np.array([3] + [0] * 7, np.int32)
    n_tok = np.array([6] + [0] * 7, np.int32)
    state = jax.jit(S.set_rows)(state, rows, tokens, n_prompt, n_tok, bias, stop)
    assert np.asarray(state.out_counts)[1].tolist() == [0, 0, 0, 0, 0, 3] + [0] * 6
    assert np.nonzero(np.asarray(state.prompt_mask)[1])[0].tolist() == [1, 2]
    assert np.asarray(state.bias)[1, 4] == 2.5 and np.asarray(state.stop_mask)[1, 7]
    # a sampled final token counts; a partial prefill's does not
    md = metadata(2, rows=[1, 3], is_final=[True, False])
    logits = np.zeros((2, V), np.float32)
    logits[:, 9] = 5.0
    _, state = jax.jit(S.sample)(jnp.asarray(logits), md, state)
    assert np.asarray(state.out_counts)[1, 9] == 1 and np.asarray(state.out_counts)[3, 9] == 0


# end to end against HF's raw logits
def hf_model(path):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logprobs(model, ids):
    import torch
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy(), logits.numpy()


def processed_reference(raw, prompt, outputs, p: SamplingParams, eos, bad_ids):
    """What vLLM's sampler does to raw logits before greedy argmax, in numpy."""
    x = raw.astype(np.float64).copy()
    V = x.size
    if p.allowed_token_ids is not None:
        mask = np.full(V, -np.inf)
        mask[p.allowed_token_ids] = 0.0
        x += mask
    for w in bad_ids:
        if len(w) == 1 or (len(outputs) >= len(w) - 1 and outputs[len(outputs) - len(w) + 1:] == w[:-1]):
            x[w[-1]] = -np.inf
    if len(outputs) < p.min_tokens:
        for t in list(p.stop_token_ids) + ([] if p.ignore_eos else [eos]):
            x[t] = -np.inf
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    counts = np.bincount(outputs, minlength=V) if outputs else np.zeros(V, int)
    seen = (counts > 0) | np.isin(np.arange(V), prompt)
    r = np.where(seen, p.repetition_penalty, 1.0)
    x = np.where(x > 0, x / r, x * r)
    x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return x


@pytest.mark.parametrize("knobs", [
    dict(repetition_penalty=1.8), dict(frequency_penalty=1.5, presence_penalty=0.8),
    dict(repetition_penalty=0.7, presence_penalty=-0.5),
    dict(logit_bias={300: 9.0, 301: -50.0}, min_tokens=6, stop_token_ids=[300]),
    dict(allowed_token_ids=[11, 300, 301, 302, 5000, 6000], repetition_penalty=1.3),
    dict(bad_words=["hello world", "the"], frequency_penalty=0.5),
])
def test_greedy_with_knobs_matches_reference(tiny_llm, tiny_llama, knobs):
    engine = tiny_llm.llm_engine
    hf = hf_model(tiny_llama)
    prompt = engine.tokenizer.encode("the cat sat on the mat and the dog")
    p = SamplingParams(temperature=0.0, max_tokens=12, **knobs)
    out = tiny_llm.generate({"prompt_token_ids": prompt}, p, use_tqdm=False)[0].outputs[0]
    bad_ids = engine.process_inputs({"prompt_token_ids": prompt}, p).bad_word_ids or []
    for t, tok in enumerate(out.token_ids):
        _, raw = hf_logprobs(hf, prompt + out.token_ids[:t])
        ref = processed_reference(raw[-1], prompt, out.token_ids[:t], p, engine.eos_token_id, bad_ids)
        # equal, or a tie within float noise
        assert tok == int(np.argmax(ref)) or ref.max() - ref[tok] < 1e-4, (t, tok, int(np.argmax(ref)))
        if p.allowed_token_ids:
            assert tok in p.allowed_token_ids
    if p.min_tokens:
        assert len(out.token_ids) >= p.min_tokens


def check_position(entry: dict, chosen: int, ref_row: np.ndarray, k: int):
    assert chosen in entry
    assert abs(entry[chosen].logprob - ref_row[chosen]) < 1e-4
    assert entry[chosen].rank == 1 + int((ref_row > ref_row[chosen] + 1e-6).sum())
    top = np.argsort(-ref_row)[:k]
    others = {t: lp for t, lp in entry.items() if lp.rank is not None and lp.rank <= k}
    assert len(others) >= k
    for t in top:
        if t in entry:
            assert abs(entry[t].logprob - ref_row[t]) < 1e-4
    got_top = sorted((lp.logprob for lp in entry.values()), reverse=True)[:k]
    np.testing.assert_allclose(got_top, np.sort(ref_row)[::-1][:k], atol=1e-4)


def test_logprobs_and_prompt_logprobs_match_hf(tiny_llm, tiny_llama):
    hf = hf_model(tiny_llama)
    prompt = tiny_llm.get_tokenizer().encode("logprobs are the log of probabilities, really")
    p = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=3)
    out = tiny_llm.generate({"prompt_token_ids": prompt}, p, use_tqdm=False)[0]
    toks = out.outputs[0].token_ids
    ref, _ = hf_logprobs(hf, prompt + toks)
    assert len(out.outputs[0].logprobs) == len(toks)
    for t, (tok, entry) in enumerate(zip(toks, out.outputs[0].logprobs)):
        check_position(entry, tok, ref[len(prompt) - 1 + t], 5)
    cum = sum(ref[len(prompt) - 1 + t, tok] for t, tok in enumerate(toks))
    assert abs(out.outputs[0].cumulative_logprob - cum) < 1e-3
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        check_position(out.prompt_logprobs[pos], prompt[pos], ref[pos - 1], 3)


@pytest.mark.slow
def test_default_model_logprobs_match_hf(default_llm, default_hf_dir):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_hf_dir, dtype=torch.float32).eval()
    p = SamplingParams(temperature=0.0, max_tokens=8, logprobs=4, prompt_logprobs=2)
    out = default_llm.generate("The quick brown fox jumps over", p, use_tqdm=False)[0]
    prompt, toks = out.prompt_token_ids, out.outputs[0].token_ids
    ref, _ = hf_logprobs(hf, prompt + toks)
    for t, (tok, entry) in enumerate(zip(toks, out.outputs[0].logprobs)):
        check_position(entry, tok, ref[len(prompt) - 1 + t], 4)
    for pos in range(1, len(prompt)):
        check_position(out.prompt_logprobs[pos], prompt[pos], ref[pos - 1], 2)


def test_best_of_returns_the_most_likely(tiny_llm):
    prompt = {"prompt_token_ids": list(range(500, 520))}
    all4 = tiny_llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8,
                                                    logprobs=0), use_tqdm=False)[0]
    best = tiny_llm.generate(prompt, SamplingParams(n=2, best_of=4, temperature=1.0, seed=3,
                                                    max_tokens=8), use_tqdm=False)[0]
    ranked = sorted(all4.outputs, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in best.outputs] == [o.token_ids for o in ranked]
    assert [o.index for o in best.outputs] == [0, 1]
    assert all(o.cumulative_logprob is None and o.logprobs is None for o in best.outputs)


def reference_beam_search(hf, prompt, width, steps, eos, length_penalty):
    beams, done = [(list(prompt), 0.0)], []

    def score(b):
        n = len(b[0]) - (1 if b[0][-1] == eos else 0)
        return b[1] / n ** length_penalty

    for _ in range(steps):
        grown = []
        for toks, cum in beams:
            lp, _ = hf_logprobs(hf, toks)
            for t in np.argsort(-lp[-1])[:2 * width]:
                new = (toks + [int(t)], cum + float(lp[-1, t]))
                (done if t == eos else grown).append(new)
        beams = sorted(grown, key=score, reverse=True)[:width]
    return sorted(done + beams, key=score, reverse=True)[:width]


def test_beam_search_matches_reference_and_shares_blocks(tiny_llm, tiny_llama):
    hf = hf_model(tiny_llama)
    # long enough that the beams' common prefix fills whole blocks
    prompt = tiny_llm.get_tokenizer().encode("beam search keeps several hypotheses " * 6)
    engine = tiny_llm.llm_engine
    hits0 = engine.kv_manager.prefix_hits
    out = tiny_llm.beam_search({"prompt_token_ids": prompt},
                               BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=0.8))[0]
    ref = reference_beam_search(hf, prompt, 3, 5, engine.eos_token_id, 0.8)
    assert [s.tokens for s in out.sequences] == [r[0] for r in ref]
    for s, r in zip(out.sequences, ref):
        assert abs(s.cum_logprob - r[1]) < 1e-3
    assert engine.kv_manager.prefix_hits > hits0  # beams reuse their common prefix's blocks
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=3)


def test_stop_strings_and_include_stop_str(tiny_llm):
    p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = tiny_llm.generate("stop strings end text", p, use_tqdm=False)[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = tiny_llm.generate("stop strings end text", SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.text == full.text[:full.text.index(stop)] and cut.finish_reason == "stop"
    assert cut.stop_reason == stop
    kept = tiny_llm.generate("stop strings end text", SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]


def test_stop_string_on_the_last_allowed_token_wins(tiny_llm):
    p = dict(temperature=0.0, max_tokens=10, ignore_eos=True)
    full = tiny_llm.generate("the last word", SamplingParams(**p), use_tqdm=False)[0].outputs[0]
    tail = full.text[-2:]
    assert len(tail) == 2 and full.text.find(tail) == len(full.text) - 2, "pick another prompt"
    out = tiny_llm.generate("the last word", SamplingParams(stop=[tail], **p), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids  # the 10th token completes the stop string
    assert out.finish_reason == "stop" and out.stop_reason == tail and out.text == full.text[:-2]


def test_invalid_token_ids_in_params_are_rejected(tiny_llm):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        tiny_llm.generate("x", SamplingParams(allowed_token_ids=[10**7]), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        tiny_llm.generate("x", SamplingParams(logprobs=50), use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()

