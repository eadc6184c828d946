"""core/ alone: block pool, KV-cache manager and scheduler, in microseconds."""
import pytest

from jaxllm.core.block_pool import NULL_BLOCK, BlockPool
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.scheduler import Scheduler
from jaxllm.sampling_params import SamplingParams


def req(rid, n_prompt, max_tokens=4, **kw):
    return Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(max_tokens=max_tokens, **kw),
                   eos_token_id=2, seed=0)


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=128,
         caching=False, **kw):
    kv = KVCacheManager(num_blocks, block_size, caching, kw.pop("host_blocks", 0))
    return Scheduler(kv, max_num_seqs, budget, max_model_len, **kw), kv


def run_step(s, token=7):
    out = s.schedule()
    # a multi-step call emits a token per pass
    sampled = {rid: [token] * (out.num_scheduled_tokens[rid] if out.num_passes > 1 else 1)
               for rid in out.sampling_req_ids}
    return out, s.update_from_output(out, sampled)


def test_block_pool_refcounts_and_null_block():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4
    blocks = pool.allocate(4)
    assert NULL_BLOCK not in blocks and sorted(blocks) == [1, 2, 3, 4]
    assert pool.allocate(1) is None
    pool.free(blocks[:2])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        pool.free([blocks[0]])
    with pytest.raises(ValueError):
        BlockPool(1)


def test_allocate_slots_grows_by_blocks():
    kv = KVCacheManager(10, 4)
    r = req("a", 5)
    assert len(kv.allocate_slots(r, 5)) == 2
    r.num_computed_tokens = 5
    assert list(kv.allocate_slots(r, 3)) == []  # fits in the second block
    assert len(kv.allocate_slots(r, 4)) == 1
    kv.free(r)
    assert kv.num_free_blocks == 9


def test_token_budget_and_chunked_prefill():
    s, kv = make(budget=16)
    s.add_request(req("long", 40))
    s.add_request(req("short", 3))
    out, ups = run_step(s)
    assert out.num_scheduled_tokens == {"long": 16}
    assert ups == []  # a partial prefill samples nothing
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"long": 16}
    out, ups = run_step(s)
    # the rest of the long prompt, then the short one fills the budget
    assert out.num_scheduled_tokens == {"long": 8, "short": 3}
    assert [u.request.request_id for u in ups] == ["long", "short"]
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"long": 1, "short": 1}  # both decoding


def test_steps_with_decodes_are_capped():
    s, _ = make(budget=32, max_num_batched_tokens_while_decoding=8)
    s.add_request(req("a", 20, max_tokens=20))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 20}  # nothing decodes yet: the whole budget
    s.add_request(req("b", 9, max_tokens=20))
    s.add_request(req("c", 9, max_tokens=20))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}  # "a" decodes: 8 tokens in all
    out, _ = run_step(s)
    # the running chunk first, then the waiting prompt gets what is left
    assert out.num_scheduled_tokens == {"a": 1, "b": 2, "c": 5}
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 4}
    # more decodes than a quarter of the cap: the step holds 4 tokens per decode
    s3, _ = make(budget=64, max_num_seqs=16, max_num_batched_tokens_while_decoding=8)
    for i in range(3):
        s3.add_request(req(str(i), 2, max_tokens=20))
    run_step(s3)
    s3.add_request(req("late", 30))
    out, _ = run_step(s3)
    assert out.num_scheduled_tokens == {"0": 1, "1": 1, "2": 1, "late": 9}
    s2, _ = make(budget=32)  # without the cap, the budget alone
    s2.add_request(req("a", 20, max_tokens=20))
    run_step(s2)
    s2.add_request(req("b", 9))
    s2.add_request(req("c", 9))
    out, _ = run_step(s2)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9, "c": 9}


def test_prefill_cap_flag_and_its_platform_default():
    import argparse
    from jaxllm.cli import add_engine_args, engine_config_from_args
    from jaxllm.config import EngineConfig
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args([]))
    assert cfg.max_num_batched_tokens_while_decoding == 0  # offline: no cap
    cfg = engine_config_from_args(p.parse_args(["--max-num-batched-tokens-while-decoding", "auto"]))
    assert cfg.max_num_batched_tokens_while_decoding is None
    cfg.resolve("cpu", 512)
    assert cfg.max_num_batched_tokens_while_decoding == 64
    gpu = EngineConfig(max_num_batched_tokens_while_decoding=None)
    gpu.resolve("gpu", 512)
    assert gpu.max_num_batched_tokens_while_decoding == 0
    with pytest.raises(SystemExit):
        p.parse_args(["--max-num-batched-tokens-while-decoding", "some"])
    with pytest.raises(ValueError, match="max_num_batched_tokens_while_decoding"):
        EngineConfig(max_num_batched_tokens_while_decoding=-1).resolve("cpu", 512)


def test_max_num_seqs_limits_running():
    s, _ = make(max_num_seqs=2)
    for i in range(4):
        s.add_request(req(str(i), 2))
    out, _ = run_step(s)
    assert set(out.num_scheduled_tokens) == {"0", "1"}
    assert s.num_waiting == 2


def test_preemption_newest_yields_and_resumes():
    # 6 usable blocks of 4 tokens; two requests of 8 prompt tokens each need 2 blocks, and grow
    s, kv = make(num_blocks=7, block_size=4, budget=64, max_model_len=24)
    a, b, c = req("a", 8, max_tokens=12), req("b", 8, max_tokens=12), req("c", 7, max_tokens=12)
    for r in (a, b, c):
        s.add_request(r)
    run_step(s)
    assert kv.num_free_blocks == 0
    out, _ = run_step(s)  # a needs a third block: c (newest) is preempted
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert s.num_preemptions >= 1
    assert "c" in out.finished_req_ids
    assert s.waiting[0] is c
    # finishing the others lets c back in, recomputing its prompt and its output so far
    while s.has_unfinished_requests():
        out, _ = run_step(s)
    assert c.num_output_tokens == 12 and a.num_output_tokens == 12
    assert kv.num_free_blocks == 6


def test_stops_on_eos_stop_ids_and_length():
    s, kv = make()
    s.add_request(req("eos", 3, max_tokens=10))
    s.add_request(req("ignore", 3, max_tokens=2, ignore_eos=True))
    s.add_request(req("stopid", 3, max_tokens=10, stop_token_ids=[2]))
    s.add_request(req("minimum", 3, max_tokens=10, min_tokens=2))
    run_step(s, token=2)
    assert s.num_running == 2  # "ignore" and "minimum" go on
    assert set(r.request_id for r in s.running) == {"ignore", "minimum"}
    run_step(s, token=2)
    assert s.num_running == 0
    assert kv.num_free_blocks == 63


def test_pool_must_hold_one_max_len_request():
    with pytest.raises(ValueError, match="max_model_len"):
        make(num_blocks=5, block_size=4, max_model_len=17)


def test_finish_reason_and_max_model_len():
    s, kv = make(max_model_len=6)
    r = req("r", 4, max_tokens=None)
    s.add_request(r)
    while s.has_unfinished_requests():
        run_step(s)
    assert r.num_tokens == 6 and r.finish_reason == "length"


def test_abort_frees_blocks_everywhere():
    s, kv = make(max_num_seqs=1)
    a, b = req("a", 9), req("b", 9)
    s.add_request(a)
    s.add_request(b)
    run_step(s)
    s.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert kv.num_free_blocks == 63
    out = s.schedule()
    assert out.is_empty and {"a", "b"} <= out.finished_req_ids


def test_duplicate_request_id_rejected():
    s, _ = make()
    s.add_request(req("x", 2))
    with pytest.raises(ValueError, match="request_id"):
        s.add_request(req("x", 2))


def test_new_requests_sent_in_full_once_then_as_diffs():
    s, _ = make(block_size=4)
    s.add_request(req("a", 5))
    out, _ = run_step(s)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a"]
    assert out.scheduled_new_reqs[0].block_ids and not out.scheduled_cached_reqs
    out, _ = run_step(s)
    assert not out.scheduled_new_reqs
    assert out.scheduled_cached_reqs[0].num_computed_tokens == 5


def test_step_shapes_cover_every_batch():
    from jaxllm.runner.buckets import StepShapes, make_buckets
    assert make_buckets(16, 8192, linear_from=1024) == [16, 32, 64, 128, 256, 512, 1024, 2048,
                                                        3072, 4096, 5120, 6144, 7168, 8192]
    for decode in ((), (1, 2, 4, 8)):
        shapes = StepShapes(make_buckets(16, 512), make_buckets(1, 64), decode_buckets=decode)
        assert len(shapes.all) < 20 + len(decode)
        for tokens in range(1, 513):
            for seqs in range(1, min(tokens, 64) + 1):
                t, s = shapes.pick(tokens, seqs)
                assert (t, s) in shapes.all and t >= tokens and s >= seqs and s <= t
        # a small decode batch runs at its own size, not padded to 16 tokens
        assert shapes.pick(1, 1) == ((1, 1) if decode else (16, 2))
        assert shapes.pick(5, 5) == ((8, 8) if decode else (16, 8))
    # speculating with k = 4: a verifying sequence runs 5 tokens, two of them 10
    shapes = StepShapes(make_buckets(16, 512), make_buckets(1, 64), decode_buckets=(1, 2, 4, 8),
                        spec_width=5)
    assert shapes.pick(5, 1) == (5, 1) and shapes.pick(10, 2) == (10, 2)
    assert shapes.pick(1, 1) == (1, 1) and shapes.pick(6, 1) == (8, 8)
    for tokens in range(1, 65):
        for seqs in range(1, min(tokens, 64) + 1):
            t, s = shapes.pick(tokens, seqs)
            assert (t, s) in shapes.all and t >= tokens and s >= seqs and s <= t


def test_the_gpu_shape_set_holds_every_step_the_scheduler_can_make():
    """The shapes a GPU engine derives from its limits (no decode shapes of their own: a GPU
    pads for free) hold every step the scheduler can make, with and without speculation:
    any token count up to max_num_batched_tokens in any number of sequences up to
    max_num_seqs and the tokens. And they are few, each one a compilation at start. Square
    shapes are decode-only there (no room for prefill tiles): a decode step takes one (every
    batch size has one), any other step never does."""
    from jaxllm.runner.buckets import step_shapes
    for budget, seqs_max in ((8192, 256), (1024, 128), (2048, 200)):
        for spec in (0, 4):
            shapes = step_shapes("gpu", budget, seqs_max, spec)
            assert shapes.seqs_for.keys() == set(shapes.token_buckets)
            assert len(shapes.all) <= 32
            compiled = set(shapes.all)
            for tokens in range(1, budget + 1):
                for seqs in range(1, min(tokens, seqs_max) + 1):
                    t, s = shapes.pick(tokens, seqs)
                    assert t >= tokens and s >= seqs and (t, s) in compiled, (tokens, seqs)
                    assert (t == s) == (tokens == seqs), (tokens, seqs)
            assert shapes.tiles(64, 64, 32) == 0 and shapes.tiles(64, 32, 32) == 2 + 32
    # a CPU engine's set of the same limits adds square decode shapes below 16 tokens
    cpu = step_shapes("cpu", 1024, 128)
    assert set(cpu.all) - set(step_shapes("gpu", 1024, 128).all) == {(1, 1), (2, 2), (4, 4), (8, 8)}
    assert cpu.tiles(64, 64, 32) == 2 + 64  # (a CPU branches on tiles at run time, cheaply)


def test_given_buckets_are_the_shapes():
    """EngineConfig.token_buckets / seq_buckets: exactly the shapes of those lists (the maxima
    added), no decode shapes of their own; every batch still finds one."""
    from jaxllm.config import EngineConfig
    from jaxllm.runner.buckets import StepShapes
    cfg = EngineConfig(token_buckets=[16], seq_buckets=[4], max_num_seqs=8, max_num_batched_tokens=64)
    cfg.resolve("cpu", 256)
    assert cfg.token_buckets == [16, 64] and cfg.seq_buckets == [4, 8]
    shapes = StepShapes(cfg.token_buckets, cfg.seq_buckets)
    assert shapes.all == [(16, 4), (16, 8), (64, 8)]
    assert shapes.pick(1, 1) == (16, 4) and shapes.pick(17, 3) == (64, 8)
    for tokens in range(1, 65):
        for seqs in range(1, min(tokens, 8) + 1):
            t, s = shapes.pick(tokens, seqs)
            assert (t, s) in shapes.all and t >= tokens and s >= seqs
    # a token bucket below the smallest seq bucket holds no step: derived lists drop it
    assert StepShapes([2, 16], [4, 8]).token_buckets == [16]
    for bad, match in ((dict(token_buckets=[64, 16]), "token_buckets must be a non-empty ascending"),
                       (dict(seq_buckets=[]), "seq_buckets must be a non-empty ascending"),
                       (dict(seq_buckets=[0, 4]), "seq_buckets must be"),
                       (dict(token_buckets="16"), "token_buckets must be")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)
    for bad, match in ((dict(token_buckets=[128]), r"token_buckets: 128 exceeds max_num_batched_tokens \(64\)"),
                       (dict(seq_buckets=[16]), r"seq_buckets: 16 exceeds max_num_seqs \(8\)"),
                       (dict(token_buckets=[2], seq_buckets=[4]), "cannot hold the smallest seq bucket")):
        cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, **bad)
        with pytest.raises(ValueError, match=match):
            cfg.resolve("cpu", 256)


def test_bucket_flags():
    import argparse
    from jaxllm.cli import add_engine_args, engine_config_from_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args(["--token-buckets", "16,64", "--seq-buckets", "4"]))
    assert cfg.token_buckets == [16, 64] and cfg.seq_buckets == [4]
    assert engine_config_from_args(p.parse_args([])).token_buckets is None
    with pytest.raises(SystemExit):
        p.parse_args(["--token-buckets", "16,x"])


def test_essential_shapes_are_few_and_hold_every_step():
    """Compiled before serving when the rest compile in the background: the largest shape
    holds every step, and a decode batch finds a square shape at most 4x its size."""
    from jaxllm.runner.buckets import StepShapes, make_buckets
    cpu = StepShapes(make_buckets(16, 512), make_buckets(1, 64), decode_buckets=(1, 2, 4, 8))
    assert cpu.essential == [(1, 1), (4, 4), (16, 16), (64, 64), (512, 64)]
    gpu = StepShapes(make_buckets(16, 8192, linear_from=1024), make_buckets(1, 256))
    assert gpu.essential == [(16, 2), (16, 4), (16, 16), (64, 64), (256, 256), (8192, 256)]
    # few sequences and many tokens: no square shape at all
    few = StepShapes(make_buckets(16, 8192, linear_from=1024), make_buckets(1, 8))
    assert few.essential == [(16, 2), (16, 8), (8192, 8)]
    for shapes in (cpu, gpu, few):
        assert set(shapes.essential) <= set(shapes.all) and shapes.all[-1] in shapes.essential
        assert len(shapes.essential) * 3 < len(shapes.all)
        for seqs in range(1, shapes.seq_buckets[-1] + 1):
            t, s = min((t, s) for t, s in shapes.essential if s >= seqs and t >= seqs)
            assert t <= 4 * shapes.pick(seqs, seqs)[0] and s <= 4 * shapes.pick(seqs, seqs)[1]


def test_max_loras_per_step_base_requests_go_on_no_adapter_starves():
    """Running requests use at most max_loras adapters (so every step does); a request whose
    adapter does not fit waits in its place while base requests go on, and later requests
    with adapters queue behind it, so the running adapters drain and it gets in."""
    s, _ = make(max_num_seqs=8, budget=64, max_loras=2)

    def lreq(rid, lora, n=4):
        return Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=n), eos_token_id=2,
                       seed=0, lora_id=lora)
    for rid, lora in (("a1", 1), ("b1", 2), ("c1", 3), ("base", None), ("a2", 1)):
        s.add_request(lreq(rid, lora, n=6 if rid == "a1" else 3))
    out, _ = run_step(s)
    assert set(out.num_scheduled_tokens) == {"a1", "b1", "base"}  # c1 waits, a2 behind it
    assert [r.request_id for r in s.waiting] == ["c1", "a2"]
    seen_c = False
    for _ in range(20):
        out, _ = run_step(s)
        running = {r.lora_id for r in s.running if r.lora_id}
        assert len(running) <= 2
        seen_c |= "c1" in out.num_scheduled_tokens
        if "a1" in out.num_scheduled_tokens and not seen_c:
            s.add_request(lreq(f"a{len(s.requests) + 10}", 1))  # a stream of adapter-1 requests
        if not s.has_unfinished_requests():
            break
    assert seen_c and not s.has_unfinished_requests()
    with pytest.raises(ValueError, match="max_loras"):
        make()[0].add_request(lreq("x", 5))


def test_multi_step_only_while_every_request_decodes():
    """num_scheduler_steps = 4: a call of several passes only when every running request has
    one token to compute and no waiting request could join; each request gets as many passes
    as its length limits allow, its placeholders cover them, and the tokens of a pass after a
    stop are dropped."""
    s, kv = make(num_scheduler_steps=4)
    s.add_request(req("a", 5, max_tokens=10))
    s.add_request(req("b", 3, max_tokens=2))
    out, _ = run_step(s)  # prompts: one pass
    assert out.num_passes == 1 and out.num_scheduled_tokens == {"a": 5, "b": 3}
    out = s.schedule()  # both decode: b may emit 1 more token, a 4
    assert out.num_passes == 4 and out.num_scheduled_tokens == {"a": 4, "b": 1}
    # its tokens past the first are the requests' own, not proposals to verify (a step with
    # proposals is read before the next is scheduled: the async loop would stop overlapping)
    assert not out.scheduled_spec_decode_tokens
    a, b = s.requests["a"], s.requests["b"]
    assert (a.num_computed_tokens, a.num_output_placeholders) == (9, 4)
    assert (b.num_computed_tokens, b.num_output_placeholders) == (4, 1)
    assert len(kv.get_blocks("a")) == 3  # 9 computed tokens in blocks of 4
    s.update_from_output(out, {"a": [7, 8, 2, 9], "b": [5]})  # a's EOS at the third pass
    assert a.status == RequestStatus.FINISHED_STOPPED and a.output_token_ids == [7, 7, 8, 2]
    assert b.status == RequestStatus.FINISHED_LENGTH and b.output_token_ids == [7, 5]
    assert kv.num_free_blocks == 63

    s.add_request(req("c", 3, max_tokens=20))
    run_step(s)
    out = s.schedule()  # async: scheduled again before the last call's tokens are known
    assert out.num_passes == 4 and out.num_scheduled_tokens == {"c": 4}
    out2 = s.schedule()
    assert out2.num_passes == 4 and out2.num_scheduled_tokens == {"c": 4}
    assert s.requests["c"].num_output_placeholders == 8
    s.add_request(req("d", 3))  # an arrival: the next step is single, and admits it
    out3 = s.schedule()
    assert out3.num_passes == 1 and out3.num_scheduled_tokens == {"c": 1, "d": 3}
    for o in (out, out2, out3):
        s.update_from_output(o, {rid: [7] * (o.num_scheduled_tokens[rid] if o.num_passes > 1 else 1)
                                 for rid in o.sampling_req_ids})
    assert s.requests["c"].num_output_tokens == 1 + 4 + 4 + 1
    assert s.requests["c"].num_output_placeholders == 0
    assert s.schedule().num_passes == 4  # both decode now

    s2, _ = make(num_scheduler_steps=4, budget=4)
    s2.add_request(req("long", 9, max_tokens=5))
    out = s2.schedule()  # a prompt over two steps: single passes until it decodes
    assert out.num_passes == 1 and out.num_scheduled_tokens == {"long": 4}


def test_multi_step_call_admits_no_prompt_through_prefix_hits():
    """A waiting request that fits only through prefix-cache hits (which the choice of a
    multi-step call does not count) does not join that call: its passes take one token per
    request, and a prompt would be computed as one token. It joins through a single step."""
    s, kv = make(num_blocks=12, max_model_len=40, caching=True, num_scheduler_steps=4)
    s.add_request(req("a", 16, max_tokens=6))
    s.add_request(Request("b", list(range(500, 516)), SamplingParams(max_tokens=20),
                          eos_token_id=2, seed=0))
    run_step(s)  # two prompts of 4 blocks each: 3 blocks free
    s.add_request(req("c", 16))  # a's prompt: 3 of its blocks are hits, 1 more would do
    out, _ = run_step(s)
    assert out.num_passes == 4 and set(out.num_scheduled_tokens) == {"a", "b"}
    assert s.waiting[0].request_id == "c" and s.waiting[0].num_computed_tokens == 0
    out, _ = run_step(s)  # a ends (6 tokens): its blocks come back and c joins, single step
    assert s.requests.get("a") is None
    out, _ = run_step(s)
    assert out.num_passes == 1 and set(out.num_scheduled_tokens) == {"b", "c"}
    assert out.num_scheduled_tokens["c"] == 4  # past its 12 cached tokens


def test_multi_step_goes_on_while_the_waiting_head_cannot_fit():
    """A waiting request whose tokens do not fit in the free blocks does not turn the running
    requests' calls into single passes; once blocks are free it joins through a single step."""
    s, kv = make(num_blocks=12, max_model_len=40, num_scheduler_steps=4)  # 11 usable blocks
    s.add_request(req("a", 14, max_tokens=2))
    s.add_request(req("b", 14, max_tokens=20))
    run_step(s)  # two prompts: 8 blocks
    s.add_request(req("big", 20))  # needs 6 blocks: 3 are free
    out, _ = run_step(s)
    assert out.num_passes == 4 and out.num_scheduled_tokens == {"a": 1, "b": 4}
    assert s.requests.get("a") is None and s.waiting[0].request_id == "big"
    out, _ = run_step(s)  # a's blocks are back: big fits and joins in a single step
    assert out.num_passes == 1 and set(out.num_scheduled_tokens) == {"b", "big"}


def test_failed_requests_leave_the_cache_and_lost_state_recomputes_the_rest():
    s, kv = make(caching=True, budget=32)
    a, b, c = req("a", 9), req("b", 9), req("c", 9)
    for r in (a, b, c):
        s.add_request(r)
    out, _ = run_step(s)
    assert set(out.num_scheduled_tokens) == {"a", "b", "c"}
    a_blocks = kv.get_blocks("a")
    assert any(kv.pool.block_hash[blk] is not None for blk in a_blocks)
    failed = s.fail_requests(["a", "nobody"], "boom")
    assert failed == [a] and a.status == RequestStatus.FINISHED_ERROR and a.finish_reason == "error"
    assert a.error == "boom" and "a" not in s.requests
    assert all(kv.pool.block_hash[blk] is None for blk in a_blocks)  # never found again
    s.recompute_running()  # the device lost the cache
    assert [r.request_id for r in s.waiting] == ["b", "c"] and not s.running
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and kv.num_free_blocks == kv.pool.num_usable_blocks
    assert not kv.pool.cached
    out, _ = run_step(s)
    assert {"b", "c"} <= out.finished_req_ids  # the runner drops their old rows
    # b's prompt and sampled token again, nothing found in the cache (c, the same prompt,
    # finds b's blocks of this very step)
    assert out.num_scheduled_tokens["b"] == 10 and set(out.num_scheduled_tokens) == {"b", "c"}
