"""The engine end to end: parity with HF, continuous batching, preemption, chunked prefill,
no leaks, no recompilation, bad input."""
import jax
import numpy as np
import pytest

from conftest import SMALL_ENGINE
from jaxllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "List three colours:\n1.",
    "Explain in one sentence why the sky is blue. The sky is blue because",
    "Translate to French: 'good morning' ->",
    "In 1969 the first humans walked on the Moon. The mission was called Apollo 11, and "
    "the astronauts who landed were Neil Armstrong and",
]


def hf_greedy(model_path: str, prompt_ids: list[list[int]], max_new: int) -> list[list[int]]:
    import os
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = dict(dtype=torch.float32)
    if model_path.endswith(".gguf"):
        kwargs["gguf_file"] = os.path.basename(model_path)
        model_path = os.path.dirname(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs).eval()
    # as ignore_eos: EOS neither stops generation nor is suppressed
    model.generation_config.eos_token_id = None
    # one batch, padded on the left (the positions follow the attention mask)
    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                             pad_token_id=0)
    return out[:, width:].tolist()


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
def test_default_model_greedy_parity_with_hf(default_llm, default_hf_dir):
    outs = default_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    prompt_ids = [o.prompt_token_ids for o in outs]
    assert len({len(p) for p in prompt_ids}) >= 6  # the prompts really differ in length
    ref = hf_greedy(default_hf_dir, prompt_ids, 32)
    for prompt, got, want in zip(PROMPTS, token_ids(outs), ref):
        assert got == want, f"{prompt!r}: {got} != {want}"
    # the text is the detokenized ids
    tok = default_llm.get_tokenizer()
    assert outs[1].outputs[0].text == tok.decode(outs[1].outputs[0].token_ids, skip_special_tokens=True)


def test_an_engine_compiles_the_given_shapes(tiny_llm):
    """tiny_llm is built with FEW_SHAPES (conftest): exactly those step shapes compiled."""
    compiler = tiny_llm.llm_engine.runner.compiler
    assert sorted(compiler.forward_executables) == [(16, 4), (16, 8), (64, 8)]
    assert compiler.num_compiles_after_warmup == 0


def test_request_output_shape(tiny_llm):
    out = tiny_llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    assert out.finished and out.prompt == "Hello there"
    assert out.prompt_token_ids == tiny_llm.get_tokenizer().encode("Hello there")
    c = out.outputs[0]
    assert c.index == 0 and len(c.token_ids) == 5 and c.finish_reason == "length"
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_token_id_prompts_and_dicts(tiny_llm):
    ids = tiny_llm.get_tokenizer().encode("a b c d")
    p = SamplingParams(temperature=0.0, max_tokens=6)
    a, b, c = tiny_llm.generate([ids, {"prompt_token_ids": ids}, "a b c d"], p, use_tqdm=False)
    assert a.prompt is None and a.prompt_token_ids == ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids


def _alone(llm, prompts, params):
    return [token_ids(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]


def test_continuous_batching_staggered_arrivals(tiny_llm):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, 40000, size=n).tolist() for n in (5, 33, 12, 70, 1, 18)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = _alone(tiny_llm, prompts, params)

    engine = tiny_llm.llm_engine
    got, step = {}, 0
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request joins every third step
            i, p = pending.pop(0)
            engine.add_request(f"stagger-{i}", p, params)
        for out in engine.step():
            if out.finished:
                got[int(out.request_id.split("-")[1])] = out.outputs[0].token_ids
        step += 1
    assert [got[i] for i in range(len(prompts))] == alone


def test_preemption_gives_same_outputs(tiny_llama, tiny_llm):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(10, 40000, size=40).tolist() for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    big = token_ids(tiny_llm.generate(prompts, params, use_tqdm=False))
    # 16 usable blocks of 16 tokens hold 256 tokens; the 8 requests need 8 * 70
    small = LLM(tiny_llama, dtype="float32", num_gpu_blocks_override=17, **SMALL_ENGINE)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert token_ids(outs) == big
    assert small.llm_engine.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    kv = small.llm_engine.kv_manager
    assert kv.num_free_blocks == kv.pool.num_usable_blocks


def test_chunked_prefill_matches_one_shot(tiny_llama, tiny_llm):
    rng = np.random.default_rng(3)
    long_prompt = rng.integers(10, 40000, size=200).tolist()  # budget is 64 tokens a step
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    chunked = tiny_llm.generate([long_prompt], params, use_tqdm=False)
    one_shot = LLM(tiny_llama, dtype="float32", max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)
    assert token_ids(chunked) == token_ids(one_shot.generate([long_prompt], params, use_tqdm=False))


def test_no_leak_after_finish_and_abort(tiny_llm):
    engine = tiny_llm.llm_engine
    kv = engine.kv_manager
    rng = np.random.default_rng(4)
    for i in range(6):
        engine.add_request(f"leak-{i}", rng.integers(10, 40000, size=30 + 7 * i).tolist(),
                           SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert kv.num_free_blocks < kv.pool.num_usable_blocks
    engine.abort_request(["leak-0", "leak-3"])
    while engine.has_unfinished_requests():
        engine.step()
        if engine.is_unfinished("leak-5"):
            engine.abort_request("leak-5")
    assert kv.num_free_blocks == kv.pool.num_usable_blocks
    assert len(engine.runner.batch) == 0 or not engine.scheduler.has_unfinished_requests()


def random_params(rng) -> SamplingParams:
    """A random mix of every sampling knob."""
    kw = dict(temperature=float(rng.choice([0.0, 0.8])), top_k=int(rng.integers(0, 50)),
              top_p=float(rng.uniform(0.5, 1.0)), min_p=float(rng.choice([0.0, 0.1])),
              seed=int(rng.integers(0, 1000)), max_tokens=int(rng.integers(2, 20)))
    extras = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.5, presence_penalty=0.2),
              dict(logprobs=3), dict(prompt_logprobs=2), dict(logit_bias={100: 5.0}),
              dict(allowed_token_ids=list(range(100, 400))), dict(bad_words=["the"]),
              dict(min_tokens=2), dict(n=2), dict(n=1, best_of=2), dict(stop=["x"]), {}]
    for i in rng.choice(len(extras), size=2, replace=False):
        kw.update(extras[i])
    return SamplingParams(**kw)


def test_no_recompilation_after_warmup(tiny_llm):
    compiles = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    engine = tiny_llm.llm_engine
    before = engine.runner.num_compiles_after_warmup
    rng = np.random.default_rng(5)
    try:
        for round_ in range(4):
            n = int(rng.integers(1, 9))
            prompts = [rng.integers(10, 40000, size=int(rng.integers(1, 120))).tolist() for _ in range(n)]
            params = [random_params(rng) for _ in range(n)]
            tiny_llm.generate(prompts, params, use_tqdm=False)
    finally:
        jax.monitoring.clear_event_listeners()
    assert engine.runner.num_compiles_after_warmup == before
    assert compiles == []


def test_truncate_prompt_tokens_keeps_the_last_k(tiny_llm):
    """As vLLM: the prompt's last k tokens (-1: up to max_model_len), for text and token ids;
    a prompt over max_model_len runs once truncated."""
    ids = list(range(100, 400))  # longer than max_model_len (256)
    greedy = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = tiny_llm.generate([ids[-20:]], SamplingParams(**greedy), use_tqdm=False)[0]
    got = tiny_llm.generate([ids], SamplingParams(truncate_prompt_tokens=20, **greedy),
                            use_tqdm=False)[0]
    assert got.prompt_token_ids == ids[-20:]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    text = tiny_llm.generate(["one two three four five six"], SamplingParams(
        truncate_prompt_tokens=3, **greedy), use_tqdm=False)[0]
    assert text.prompt_token_ids == tiny_llm.get_tokenizer().encode("one two three four five six")[-3:]
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match="truncate_prompt_tokens .1000. is greater than max_model_len"):
        tiny_llm.generate([ids], SamplingParams(truncate_prompt_tokens=1000), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):  # -1 keeps 256: no room to generate
        tiny_llm.generate([ids], SamplingParams(truncate_prompt_tokens=-1), use_tqdm=False)


def test_bad_input_is_rejected_and_engine_keeps_serving(tiny_llm):
    engine = tiny_llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = token_ids(tiny_llm.generate(["good prompt"], params, use_tqdm=False))[0]
    engine.add_request("good", "good prompt", params)
    engine.step()
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", "", params)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty-ids", {"prompt_token_ids": []}, params)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", list(range(10, 10 + 300)), params)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long-out", "a prompt", SamplingParams(max_tokens=1000))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("oov", [10**7], params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", "again", params)
    engine.add_request("pair", "two samples", SamplingParams(n=2, max_tokens=3))
    with pytest.raises(ValueError, match="collides"):
        engine.add_request("0_pair", "clash", params)  # the name of pair's first sequence
    with pytest.raises(ValueError):
        tiny_llm.generate(["fine", ""], params, use_tqdm=False)  # nothing runs
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert sorted(o.request_id for o in outs) == ["good", "pair"]
    outs = [o for o in outs if o.request_id == "good"]
    assert outs[0].outputs[0].token_ids == expected


def test_sampling_seed_reproducible_and_stops(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=123, max_tokens=16, ignore_eos=True)
    a = token_ids(tiny_llm.generate(["x y z"], p, use_tqdm=False))[0]
    # the same seed in a different batch draws the same tokens
    batch = tiny_llm.generate(["other prompt", "x y z", "more"], p, use_tqdm=False)
    assert token_ids(batch)[1] == a
    other = token_ids(tiny_llm.generate(["x y z"], SamplingParams(
        temperature=1.0, seed=124, max_tokens=16, ignore_eos=True), use_tqdm=False))[0]
    assert other != a
    # stop_token_ids end the request on the chosen token and report it
    stop_at = a[5]
    out = tiny_llm.generate(["x y z"], SamplingParams(
        temperature=1.0, top_p=0.9, top_k=40, seed=123, max_tokens=16, ignore_eos=True,
        stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    first = a.index(stop_at)
    assert out.token_ids == a[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at
    assert tok is not None


def test_chat_uses_template(default_llm):
    tok = default_llm.get_tokenizer()
    messages = [{"role": "user", "content": "What is 2+2?"}]
    out = default_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == want and "<|im_start|>assistant" in want
    assert len(out.outputs[0].token_ids) >= 1


def test_final_only_requests_get_one_output(tiny_llm):
    """FINAL_ONLY (what LLM.generate asks for) yields one output, at the end, equal to the
    last of a CUMULATIVE request's per-step outputs."""
    from jaxllm.sampling_params import RequestOutputKind
    engine = tiny_llm.llm_engine
    prompt = [11, 12, 13, 14]
    engine.add_request("final", prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                       output_kind=RequestOutputKind.FINAL_ONLY))
    engine.add_request("every", prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    seen = {"final": [], "every": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert [o.finished for o in seen["final"]] == [True]
    assert len(seen["every"]) == 5 and seen["every"][-1].finished
    assert seen["final"][0].outputs[0].token_ids == seen["every"][-1].outputs[0].token_ids
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="final")


def test_warns_near_the_memory_map_limit(caplog):
    """A process near the kernel's limit on memory mappings is told so, with the limit's name
    (past it, a compile cannot map its code and the process crashes)."""
    import logging

    from jaxllm.engine.builder import near_memory_map_limit
    with caplog.at_level(logging.WARNING, logger="jaxllm"):
        assert not near_memory_map_limit(limit=10**9)
        assert not caplog.records
        assert near_memory_map_limit(limit=100)  # any process with JAX loaded holds more
    assert "vm.max_map_count" in caplog.text



def test_freeze_gc_heap_freezes_what_start_up_left(tiny_llama):
    """freeze_gc_heap: once ready, the engine's start-up objects sit in the permanent
    generation (full collections skip them) and it generates as without; what the frozen heap
    drops is collected when the next such engine starts; the CLI's engines freeze by
    default, Python's do not."""
    import argparse
    import gc
    import weakref

    from jaxllm.cli import add_engine_args, engine_config_from_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).freeze_gc_heap is True
    assert engine_config_from_args(p.parse_args(["--no-freeze-gc-heap"])).freeze_gc_heap is False
    with pytest.raises(ValueError, match="freeze_gc_heap"):
        LLM(tiny_llama, freeze_gc_heap="yes", **SMALL_ENGINE)
    gc.unfreeze()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = LLM(tiny_llama, **SMALL_ENGINE)
    assert gc.get_freeze_count() == 0
    expected = plain.generate(["Hi there"], params)[0].outputs[0].token_ids

    class Cycle:
        pass
    try:
        cycle = Cycle()
        cycle.me = cycle  # garbage only a collection frees, once dropped
        alive = weakref.ref(cycle)
        frozen = LLM(tiny_llama, freeze_gc_heap=True, **SMALL_ENGINE)
        # the engine's own objects are among the frozen ones: collections do not see them
        scheduler = frozen.llm_engine.scheduler
        assert gc.get_freeze_count() > 0
        assert not any(o is scheduler for o in gc.get_objects())
        assert frozen.generate(["Hi there"], params)[0].outputs[0].token_ids == expected
        del cycle, frozen, scheduler
        gc.collect()
        assert alive() is not None  # frozen: left alone
        # the next freezing engine collects what the frozen heap dropped before it starts
        again = LLM(tiny_llama, freeze_gc_heap=True, **SMALL_ENGINE)
        assert alive() is None
        assert again.generate(["Hi there"], params)[0].outputs[0].token_ids == expected
    finally:
        gc.unfreeze()


def test_gc_young_threshold_is_set_once_ready(tiny_llama):
    """gc_young_threshold: once ready, the engine sets the youngest generation's threshold
    (the older two kept); 0 (Python's default) leaves it; the CLI's engines use 10,000; a
    bad value is refused naming the field."""
    import argparse
    import gc

    from jaxllm.cli import add_engine_args, engine_config_from_args
    from jaxllm.config import EngineConfig
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).gc_young_threshold == 10000
    assert engine_config_from_args(p.parse_args(["--gc-young-threshold", "0"])).gc_young_threshold == 0
    assert EngineConfig().gc_young_threshold == 0
    for bad in (-1, 2.5, "many", True):
        with pytest.raises(ValueError, match="gc_young_threshold"):
            EngineConfig(gc_young_threshold=bad)
    before = gc.get_threshold()
    assert before[0] != 4321
    llm = LLM(tiny_llama, gc_young_threshold=4321, **SMALL_ENGINE)
    assert gc.get_threshold() == (4321, *before[1:])
    gc.set_threshold(*before)
    LLM(tiny_llama, **SMALL_ENGINE)
    assert gc.get_threshold() == before  # 0: left as it was
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate(["Hi"], params)[0].outputs[0].token_ids) == 4
