"""Prefix caching, parallel sampling and preemption modes through the whole engine."""
import numpy as np

from conftest import SMALL_ENGINE
from jaxllm import LLM, SamplingParams


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_shared_system_prompt_hits_cache_with_identical_outputs(tiny_llama):
    rng = np.random.default_rng(10)
    system = rng.integers(10, 40000, size=200).tolist()
    prompts = [system + rng.integers(10, 40000, size=int(rng.integers(3, 12))).tolist()
               for _ in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    on = LLM(tiny_llama, enable_prefix_caching=True, **SMALL_ENGINE)
    off = LLM(tiny_llama, enable_prefix_caching=False, **SMALL_ENGINE)
    outs_on = on.generate(prompts, params, use_tqdm=False)
    outs_off = off.generate(prompts, params, use_tqdm=False)
    assert token_ids(outs_on) == token_ids(outs_off)
    skipped = sum(o.num_cached_tokens for o in outs_on)
    assert skipped >= 0.9 * 31 * len(system), skipped
    assert sum(o.num_cached_tokens for o in outs_off) == 0
    stats = on.llm_engine.stats()
    assert stats["prefix_cache_hits"] == skipped and stats["prefix_cache_queries"] >= skipped
    kv = on.llm_engine.kv_manager
    assert kv.num_free_blocks == kv.pool.num_usable_blocks


def test_multi_turn_chat_reuses_previous_turns(tiny_llm):
    rng = np.random.default_rng(11)
    conv = rng.integers(10, 40000, size=40).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    cached = []
    for turn in range(3):
        out = tiny_llm.generate([conv], params, use_tqdm=False)[0]
        cached.append(out.num_cached_tokens)
        conv = conv + out.outputs[0].token_ids + rng.integers(10, 40000, size=9).tolist()
    # each turn finds the previous turn's full blocks
    assert cached[1] >= 32 and cached[2] > cached[1]


def test_greedy_identical_under_swap_recompute_and_no_preemption(tiny_llama, tiny_llm):
    rng = np.random.default_rng(12)
    prompts = [rng.integers(10, 40000, size=40).tolist() for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    roomy = token_ids(tiny_llm.generate(prompts, params, use_tqdm=False))
    results = {}
    for mode in ("recompute", "swap"):
        llm = LLM(tiny_llama, dtype="float32", num_gpu_blocks_override=17, preemption_mode=mode, swap_space=0.01,
                  enable_prefix_caching=False, **SMALL_ENGINE)
        results[mode] = token_ids(llm.generate(prompts, params, use_tqdm=False))
        sched = llm.llm_engine.scheduler
        assert sched.num_preemptions > 0
        if mode == "swap":
            assert sched.num_swaps > 0
        kv = llm.llm_engine.kv_manager
        assert kv.num_free_blocks == kv.pool.num_usable_blocks
        assert kv.host_pool.num_free_blocks == kv.host_pool.num_blocks
    assert results["recompute"] == roomy
    assert results["swap"] == roomy


def test_parallel_sampling_shares_prompt_blocks(tiny_llm):
    engine = tiny_llm.llm_engine
    kv = engine.kv_manager
    bs = kv.block_size
    prompt = np.random.default_rng(13).integers(10, 40000, size=70).tolist()  # 4 full blocks + 6
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    engine.add_request("par", {"prompt_token_ids": prompt}, params)
    seen_shared = False
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
        tables = [kv.req_to_blocks.get(f"{i}_par") for i in range(4)]
        if all(tables):
            shared = (len(prompt) - 1) // bs
            assert all(t[:shared] == tables[0][:shared] for t in tables)
            assert all(kv.pool.ref_cnt[b] == 4 for b in tables[0][:shared])
            assert len({t[shared] for t in tables}) == 4  # the partial block is copied
            seen_shared = True
    assert seen_shared
    completions = [tuple(c.token_ids) for c in final.outputs]
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert len(set(completions)) == 4 and all(len(c) == 12 for c in completions)
    assert kv.num_free_blocks == kv.pool.num_usable_blocks
    # the same seed gives the same four completions
    again = tiny_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == completions
