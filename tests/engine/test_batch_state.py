"""The runner's persistent batch is kept by deltas (rows added, blocks appended, sampled
tokens written, rows freed); after random arrivals, finishes, aborts, preemptions (recompute
and swap) and n > 1 forks it equals a batch rebuilt from scratch out of the scheduler's
running requests, at every step, in the synchronous, async and multi-step loops. So do the
on-device sampler rows (output counts, prompt masks, biases, stop masks) that penalties and
biases read, and the block table the device keeps by the entries each step sends."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from async_util import ENGINE, request_st, run
from jaxllm.core.block_pool import NULL_BLOCK
from jaxllm.core.scheduler_output import NewRequestData
from jaxllm.runner.input_batch import COLUMNS, InputBatch
from jaxllm.sampling_params import SamplingParams

# sampling knobs that give a row state of its own, host side or on the device
EXTRAS = [{}, dict(repetition_penalty=1.3), dict(frequency_penalty=0.5, presence_penalty=0.2),
          dict(logit_bias={100: 5.0, 7: -3.0}), dict(allowed_token_ids=list(range(100, 400))),
          dict(min_tokens=3), dict(bad_words=["the", "of the"]), dict(top_k=5, top_p=0.9)]

LOOPS = {"sync-swap": dict(async_scheduling=False, preemption_mode="swap"),
         "async-recompute": dict(async_scheduling=True, preemption_mode="recompute"),
         "multi-step-swap": dict(async_scheduling=True, preemption_mode="swap",
                                 num_scheduler_steps=4)}


@pytest.fixture(scope="module")
def engines(peaked_model):
    from jaxllm.config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine
    return {name: LLMEngine(EngineConfig(model=str(peaked_model), swap_space=0.01,
                                         **{**ENGINE, **loop}))
            for name, loop in LOOPS.items()}


def rebuilt(req, blocks: list[int], max_model_len: int, width: int) -> InputBatch:
    """A one-row batch built from scratch out of the request as it stands."""
    ref = InputBatch(1, max_model_len, width)
    ref.add_request(NewRequestData.from_request(req, blocks))
    return ref


def check_rows(engine, device: bool) -> int:
    """Every running request has a row equal to its from-scratch rebuild, no other request
    has one, and free rows hold the empty row's values. `device`: the sampler rows too (in
    the synchronous loop, where no sampled token is still on its way to the host). Returns
    how many rows carry on-device state that was checked."""
    runner, sched, kv = engine.runner, engine.scheduler, engine.kv_manager
    batch = runner.batch
    running = {r.request_id: r for r in sched.running}
    assert set(batch.row_of) == set(running)
    live = sorted(batch.row_of.values())
    assert len(set(live)) == len(live)
    assert sorted(live + batch._free_rows) == list(range(batch.max_num_seqs))
    assert len(set(batch.serial[live].tolist())) == len(live)  # each holder told apart
    width = batch.block_table.shape[1]
    state = None
    checked = 0
    for rid, req in running.items():
        row = batch.row_of[rid]
        ref = rebuilt(req, kv.get_blocks(rid), batch.max_model_len, width)
        n = int(ref.num_tokens[0])
        assert batch.num_tokens[row] == n, rid
        np.testing.assert_array_equal(batch.token_ids[row, :n], ref.token_ids[0, :n], rid)
        assert batch.num_prompt_tokens[row] == ref.num_prompt_tokens[0], rid
        assert batch.num_blocks[row] == ref.num_blocks[0], rid
        np.testing.assert_array_equal(batch.block_table[row], ref.block_table[0], rid)
        for name in COLUMNS:
            assert batch.cols[name][row] == ref.cols[name][0], (rid, name)
        assert batch.bad_words[row] == ref.bad_words[0], rid
        assert (row in batch.rows_with_bad_words) == bool(ref.bad_words[0]), rid
        assert batch.lora_id[row] == ref.lora_id[0], rid
        p = req.sampling_params
        if device and (p.has_penalties or p.has_bias or p.min_tokens > 0):
            if state is None:
                state = {k: np.asarray(v) for k, v in vars(runner.sampler_state).items()}
            V = state["out_counts"].shape[1]
            outputs = req.all_token_ids[req.num_prompt_tokens:]
            np.testing.assert_array_equal(state["out_counts"][row],
                                          np.bincount(outputs, minlength=V), rid)
            prompt = np.zeros(V, bool)
            prompt[req.prompt_token_ids] = True
            np.testing.assert_array_equal(state["prompt_mask"][row], prompt, rid)
            bias = np.zeros(V, np.float32)
            if p.allowed_token_ids is not None:
                bias[:] = -np.inf
                bias[p.allowed_token_ids] = 0.0
            for t, v in (p.logit_bias or {}).items():
                bias[t] += v
            bias[req.banned_token_ids] = -np.inf
            np.testing.assert_array_equal(state["bias"][row], bias, rid)
            stop = np.zeros(V, bool)
            if p.min_tokens > 0:
                stop[list(req.stop_ids)] = True
            np.testing.assert_array_equal(state["stop_mask"][row], stop, rid)
            checked += 1
    for row in batch._free_rows:
        for name, (_, fill) in COLUMNS.items():
            assert batch.cols[name][row] == fill, (row, name)
        assert batch.bad_words[row] is None and batch.lora_id[row] == 0
    return checked


def check_device_table(runner) -> None:
    """The block table on the device, as a step gathers it (each row masked past its block
    count), equals the host's for every live row, and the spare row is all null. Called
    when every entry made so far has gone out with a step."""
    batch = runner.batch
    device = np.asarray(runner.tables)
    assert (device[batch.max_num_seqs] == NULL_BLOCK).all()
    for rid, row in batch.row_of.items():
        nb = int(batch.num_blocks[row])
        np.testing.assert_array_equal(device[row, :nb], batch.block_table[row, :nb], rid)
        assert (batch.block_table[row, nb:] == NULL_BLOCK).all(), rid


def watched(engine, device: bool, seen: dict):
    """Check the rows each time the runner has applied a scheduler output (the moment the
    batch must match what the scheduler holds), before the step's inputs are read; and
    the device's block table just before, when the last step took every entry made (a step
    with nothing to compute leaves them for the next). The engine contains a failed step
    (its requests end with an error), so a failed check is also kept in seen["failures"].
    seen["chunks"] counts the entries written ahead of a step that could not hold them."""
    runner = engine.runner
    update, write_chunk = runner._update_states, runner._write_chunk

    def chunk_and_count(chunk, *a, **kw):
        seen["chunks"] = seen.get("chunks", 0) + 1
        write_chunk(chunk, *a, **kw)
    runner._write_chunk = chunk_and_count

    def update_and_check(out):
        if not runner.batch._writes:
            try:
                check_device_table(runner)
            except AssertionError as e:
                seen["failures"].append(e)
                raise
            seen["device_tables"] = seen.get("device_tables", 0) + 1
        update(out)
        seen["steps"] += 1
        try:
            seen["device_rows"] += check_rows(engine, device)
        except AssertionError as e:
            seen["failures"].append(e)
            raise
        seen["preemptions"] = engine.scheduler.num_preemptions
        seen["swaps"] = engine.scheduler.num_swaps
    return update_and_check


def _with_extra(w: dict, extra: dict) -> dict:
    """A request of async_util's workload with more sampling knobs (min_tokens within its
    max_tokens)."""
    if "min_tokens" in extra:
        extra = {**extra, "min_tokens": min(extra["min_tokens"], w["max_tokens"])}
    return {**w, "extra": extra}


with_extras = st.builds(_with_extra, request_st, st.sampled_from(EXTRAS))


@pytest.mark.slow
@settings(max_examples=15, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(workload=st.lists(with_extras, min_size=4, max_size=14),
       loop=st.sampled_from(sorted(LOOPS)), seed=st.integers(0, 2**16))
def test_the_batch_kept_by_deltas_equals_a_rebuild(engines, workload, loop, seed):
    engine = engines[loop]
    tokens = np.random.default_rng(seed).integers(10, 40000, size=(len(workload), 80))
    seen = {"steps": 0, "device_rows": 0, "failures": []}
    engine.runner._update_states = watched(engine, not engine.config.async_scheduling, seen)
    try:
        run(engine, workload, tokens)
    finally:
        del engine.runner._update_states, engine.runner._write_chunk
    assert not seen["failures"], seen["failures"][0]
    assert seen["steps"] > 0 and seen["device_tables"] > 0
    # rows of requests that finished last are freed by the next step's output, which names them
    assert set(engine.runner.batch.row_of) <= engine.scheduler._finished_ids


def test_the_check_sees_preemptions_swaps_and_device_rows(engines):
    """The workload above does reach what it claims to check: a fixed heavy workload in the
    synchronous swap loop preempts, swaps and checks on-device rows; and a row that drifts
    from its request is caught."""
    engine = engines["sync-swap"]
    workload = [dict(prompt_len=70, max_tokens=60, sampled=i % 2 == 1, n=1 + (i == 3),
                     arrive=i % 3, abort=25 if i == 5 else None, stop_ids=False,
                     logprobs=None, stop_string=False, extra=EXTRAS[i % len(EXTRAS)])
                for i in range(8)]
    tokens = np.random.default_rng(5).integers(10, 40000, size=(8, 80))
    seen = {"steps": 0, "device_rows": 0, "failures": []}
    engine.runner._update_states = watched(engine, True, seen)
    try:
        before = engine.scheduler.num_preemptions, engine.scheduler.num_swaps
        run(engine, workload, tokens)
    finally:
        del engine.runner._update_states, engine.runner._write_chunk
    assert not seen["failures"], seen["failures"][0]
    assert seen["preemptions"] > before[0] and seen["swaps"] > before[1]
    assert seen["device_rows"] > 0 and seen["device_tables"] > 0

    # a drifted row fails the check
    engine.add_request("drift", {"prompt_token_ids": tokens[0][:20].tolist()},
                       SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    row = engine.runner.batch.row_of["drift"]
    engine.runner.batch.block_table[row, engine.runner.batch.num_blocks[row]] = 3
    with pytest.raises(AssertionError):
        check_rows(engine, True)
    engine.runner.batch.block_table[row, engine.runner.batch.num_blocks[row]] = NULL_BLOCK
    # and so does a device table that missed an entry
    check_device_table(engine.runner)
    good = engine.runner.tables
    engine.runner.tables = good.at[row, 0].set(good[row, 0] + 1)
    with pytest.raises(AssertionError):
        check_device_table(engine.runner)
    engine.runner.tables = good
    engine.abort_request("drift")
    while engine.has_unfinished_requests():
        engine.step()


def test_entries_a_step_cannot_hold_go_ahead_of_it(engines):
    """A request arriving with a long cached prefix brings more block-table entries than
    its small step holds (block_table.write_capacity): the rest are written ahead of the
    step, the device's table matches the host's, and the request continues as the one that
    computed the prefix did (greedy, the same prompt)."""
    engine = engines["sync-swap"]
    prompt, other = np.random.default_rng(7).integers(10, 40000, size=(2, 200)).tolist()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    seen = {"steps": 0, "device_rows": 0, "failures": []}
    outputs = {}

    def run_all():
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
    # the first row goes to another prompt, so that the row the cached request takes holds
    # other blocks from before (the entries written ahead must replace them)
    engine.add_request("other", {"prompt_token_ids": other}, params)
    engine.add_request("computes", {"prompt_token_ids": prompt}, params)
    run_all()
    engine.runner._update_states = watched(engine, True, seen)
    try:
        engine.add_request("cached", {"prompt_token_ids": prompt}, params)
        run_all()
    finally:
        del engine.runner._update_states, engine.runner._write_chunk
    assert not seen["failures"], seen["failures"][0]
    assert seen.get("chunks", 0) > 0 and seen["device_tables"] > 0
    assert outputs["cached"] == outputs["computes"]
