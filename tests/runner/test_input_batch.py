"""The persistent batch: rows handed out lowest first and reused, sampling columns written
from SamplingParams and reset on removal, append-only block tables, the serial that tells a
row's holders apart, and multi-token bad words."""
import numpy as np
import pytest

from jaxllm.core.block_pool import NULL_BLOCK
from jaxllm.core.request import Request
from jaxllm.core.scheduler_output import NewRequestData
from jaxllm.runner.input_batch import COLUMNS, InputBatch
from jaxllm.sampling_params import SamplingParams


def make_batch(rows: int = 4, max_len: int = 32, width: int = 8) -> InputBatch:
    return InputBatch(rows, max_len, width)


def add(batch, rid, tokens=(1, 2, 3), prompt=None, blocks=(5,), params=None, seed=0,
        bad_word_ids=None, lora_id=None):
    """A row for a request of `prompt` prompt tokens (all of them by default), the rest of
    `tokens` its output so far, as the scheduler sends it."""
    params = params or SamplingParams(max_tokens=4)
    prompt = len(tokens) if prompt is None else prompt
    req = Request(rid, list(tokens[:prompt]), params, None, seed, lora_id=lora_id,
                  bad_word_ids=bad_word_ids)
    for t in tokens[prompt:]:
        req.append_output_token(t)
    return batch.add_request(NewRequestData.from_request(req, list(blocks)))


def test_rows_are_handed_out_lowest_first_and_a_freed_row_is_reused_first():
    batch = make_batch()
    assert [add(batch, r) for r in "abc"] == [0, 1, 2]
    assert len(batch) == 3
    assert batch.remove("b") == 1
    assert batch.remove("b") is None  # already gone
    assert add(batch, "d") == 1  # the lowest free row, ahead of row 3
    assert add(batch, "e") == 3
    assert batch.row_of == {"a": 0, "c": 2, "d": 1, "e": 3}


def test_a_full_batch_and_a_duplicate_request_are_refused():
    batch = make_batch(rows=2)
    add(batch, "a")
    with pytest.raises(RuntimeError, match="already has a row"):
        add(batch, "a")
    add(batch, "b")
    with pytest.raises(IndexError):
        add(batch, "c")


def test_tokens_and_counts_are_written_into_the_row():
    batch = make_batch()
    row = add(batch, "a", tokens=(7, 8, 9, 10), prompt=3)
    assert batch.token_ids[row, :4].tolist() == [7, 8, 9, 10]
    assert batch.num_tokens[row] == 4
    assert batch.num_prompt_tokens[row] == 3


def test_sampling_columns_come_from_the_params_and_reset_when_the_row_frees():
    batch = make_batch()
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1,
                            repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.4,
                            min_tokens=2, max_tokens=8, logit_bias={3: 1.0}, logprobs=2,
                            prompt_logprobs=1)
    row = add(batch, "a", params=params, seed=1234)
    c = batch.cols
    got = {name: c[name][row].item() for name in COLUMNS}
    assert got == pytest.approx({
        "temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.1, "seed": 1234,
        "repetition_penalty": 1.2, "frequency_penalty": 0.3, "presence_penalty": 0.4,
        "min_tokens": 2, "has_bias": True, "num_logprobs": 2, "num_prompt_logprobs": 1})
    batch.remove("a")
    assert {name: c[name][row].item() for name in COLUMNS} == {
        name: fill for name, (_, fill) in COLUMNS.items()}


def test_logprobs_are_computed_for_best_of_even_when_not_returned():
    batch = make_batch()
    plain = add(batch, "plain")
    ranked = add(batch, "ranked", params=SamplingParams(n=1, best_of=3, temperature=1.0))
    assert batch.cols["num_logprobs"][plain] == -1
    assert batch.cols["num_logprobs"][ranked] == 0


def test_block_tables_append_and_a_new_holder_starts_from_an_empty_table():
    batch = make_batch(width=6)
    row = add(batch, "a", blocks=(4, 9))
    batch.append_blocks(row, [11])
    batch.append_blocks(row, [])
    assert batch.num_blocks[row] == 3
    assert batch.block_table[row].tolist() == [4, 9, 11] + [NULL_BLOCK] * 3
    batch.remove("a")
    assert add(batch, "b", blocks=(2,)) == row
    assert batch.block_table[row].tolist() == [2] + [NULL_BLOCK] * 5
    assert batch.num_blocks[row] == 1


def test_block_table_entries_go_to_the_device_in_order_and_the_table_matches():
    """The entries made since the last step come out in order; a step holds the last of
    them and the earlier ones go ahead in chunks; written on the device, masked by the
    block counts, the step's rows are the host's, stale columns of a reused row hidden."""
    import jax.numpy as jnp
    from jaxllm.runner import block_table as bt
    batch = make_batch(width=6)
    a = add(batch, "a", blocks=(4, 9))
    batch.append_blocks(a, [11])
    b = add(batch, "b", blocks=(7,))
    rows, cols, blocks = batch.take_writes()
    assert list(zip(rows.tolist(), cols.tolist(), blocks.tolist())) == [
        (a, 0, 4), (a, 1, 9), (a, 2, 11), (b, 0, 7)]
    assert all(len(x) == 0 for x in batch.take_writes())  # taken once
    # a reused row: its old holder's columns stay on the device, masked
    batch.remove("a")
    assert add(batch, "c", blocks=(2,)) == a
    batch.append_blocks(b, [8, 13])
    more = batch.take_writes()
    # (the device table after the first step's entries)
    tables = bt.write(jnp.full((5, 6), NULL_BLOCK, jnp.int32), rows, cols, blocks)
    step_rows = np.array([b, a, 4, 4], np.int32)  # two sequences, two padded (the spare row)
    nb = np.zeros(4, np.int32)
    nb[:2] = batch.num_blocks[step_rows[:2]]
    writes, chunks = bt.split_writes(*more, 1, 4, nb)  # room for one entry in the step
    assert writes.rows.tolist() == [b] and writes.blocks.tolist() == [13]
    assert len(chunks) == 1 and chunks[0][0][:2].tolist() == [a, b]
    assert chunks[0][0][2:].tolist() == [4] * (bt.WRITE_CHUNK - 2)  # padding: the spare row
    tables = bt.write(tables, *chunks[0])
    tables, gathered = bt.resolve(tables, writes, jnp.asarray(step_rows))
    gathered = np.asarray(gathered)
    np.testing.assert_array_equal(gathered[:2], batch.block_table[step_rows[:2]])
    assert (gathered[2:] == NULL_BLOCK).all() and (np.asarray(tables)[4] == NULL_BLOCK).all()
    assert np.asarray(tables)[a, :3].tolist() == [2, 9, 11]  # stale past the mask


def test_each_holder_of_a_row_gets_a_new_serial():
    batch = make_batch()
    row = add(batch, "a")
    first = batch.serial[row]
    batch.remove("a")
    assert add(batch, "a") == row  # the same id, the same row, another request
    assert batch.serial[row] > first


def test_lora_ids_are_kept_per_row_and_cleared_on_removal():
    batch = make_batch()
    row = add(batch, "a", lora_id=3)
    other = add(batch, "b")
    assert batch.lora_id[row] == 3 and batch.lora_id[other] == 0
    batch.remove("a")
    assert batch.lora_id[row] == 0


def test_only_multi_token_bad_words_are_kept():
    batch = make_batch()
    single = add(batch, "single", bad_word_ids=[[5]])
    multi = add(batch, "multi", bad_word_ids=[[5], [6, 7]])
    assert batch.bad_words[single] is None
    assert batch.bad_words[multi] == [[6, 7]]
    assert batch.rows_with_bad_words == {multi}
    batch.remove("multi")
    assert batch.rows_with_bad_words == set() and batch.bad_words[multi] is None


def test_a_bad_word_is_banned_when_the_output_ends_with_its_other_tokens():
    batch = make_batch()
    row = add(batch, "a", tokens=(1, 2, 6), prompt=2, bad_word_ids=[[6, 7], [8, 6, 9], [3, 4]])
    assert batch.banned_tokens(row) == [7]  # [8, 6] needs two output tokens
    # the output grows as the runner writes sampled tokens into the row
    batch.token_ids[row, 3] = 8
    batch.token_ids[row, 4] = 6
    batch.num_tokens[row] = 5
    assert sorted(batch.banned_tokens(row)) == [7, 9]
    # the prompt's tokens do not count: only the output
    prompt_only = add(batch, "b", tokens=(6,), prompt=1, bad_word_ids=[[6, 7]])
    assert batch.banned_tokens(prompt_only) == []
    assert batch.banned_tokens(add(batch, "c")) == []


def test_a_row_from_the_schedulers_output_takes_the_request_facts():
    from jaxllm.core.kv_cache_manager import KVCacheManager
    from jaxllm.core.request import Request
    from jaxllm.core.scheduler import Scheduler
    sched = Scheduler(KVCacheManager(16, 4), 4, 64, 32)
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=4, n=1, best_of=2, prompt_logprobs=1),
                  2, seed=9, bad_word_ids=[[5], [6, 7]])
    sched.add_request(req)
    new, = sched.schedule().scheduled_new_reqs
    batch = make_batch()
    row = batch.add_request(new)
    assert batch.token_ids[row, :3].tolist() == [1, 2, 3] and batch.num_tokens[row] == 3
    assert batch.cols["num_logprobs"][row] == req.num_logprobs == 0
    assert batch.cols["num_prompt_logprobs"][row] == 1 and batch.cols["seed"][row] == 9
    assert batch.bad_words[row] == [[6, 7]] and batch.rows_with_bad_words == {row}
    # a sibling with the same parameters gets the same columns
    other = add(batch, "b", tokens=(1, 2, 3), params=req.sampling_params, seed=9,
                bad_word_ids=[[5], [6, 7]])
    for name in COLUMNS:
        assert batch.cols[name][other] == batch.cols[name][row], name
    assert batch.bad_words[other] == batch.bad_words[row]


def test_one_token_steps_metadata_matches_the_ragged_layout():
    """A decode step's attention metadata (one token per sequence, its own path) is the flat
    ragged layout: token i is sequence i at its next position, written to its slot; and a
    step where one sequence has two tokens (the general path) agrees on the others."""
    from jaxllm.core.block_pool import NULL_BLOCK
    from jaxllm.layers.attention_metadata import attention_metadata
    rng = np.random.default_rng(0)
    bs, width, T, S = 4, 6, 8, 8
    tables = rng.integers(1, 100, (5, width)).astype(np.int32)
    starts = np.array([0, 3, 4, 11, 22], np.int32)
    md = attention_metadata(starts, np.ones(5, np.int32), tables, T, S, bs, qt=4)
    np.testing.assert_array_equal(md.token_seq_ids, [0, 1, 2, 3, 4, 0, 0, 0])
    np.testing.assert_array_equal(md.positions, [*starts, 0, 0, 0])
    np.testing.assert_array_equal(md.query_start_loc, [0, 1, 2, 3, 4, 5, 5, 5, 5])
    np.testing.assert_array_equal(md.seq_lens, [*(starts + 1), 0, 0, 0])
    slots = [tables[i, p // bs] * bs + p % bs for i, p in enumerate(starts)]
    np.testing.assert_array_equal(md.slot_mapping, slots + [NULL_BLOCK * bs] * 3)
    assert md.block_tables.shape == (S, width) and (md.block_tables[5:] == NULL_BLOCK).all()
    assert int(md.num_tiles) == 0 and md.tile_seq.shape == md.tile_start.shape
    # the general path, the last sequence with one more token: the first four agree
    two = attention_metadata(starts, np.array([1, 1, 1, 1, 2], np.int32), tables, T, S, bs, qt=4)
    for name in ("positions", "slot_mapping", "token_seq_ids"):
        np.testing.assert_array_equal(getattr(two, name)[:5], getattr(md, name)[:5])
    np.testing.assert_array_equal(two.query_start_loc[:5], md.query_start_loc[:5])
    np.testing.assert_array_equal(two.seq_lens[:4], md.seq_lens[:4])
    assert md.tile_seq.shape == two.tile_seq.shape and int(two.num_tiles) == 1
    # as many tokens as sequences, but not one each: the general path
    uneven = attention_metadata(starts[:2], np.array([2, 0], np.int32), tables[:2], T, S, bs, qt=4)
    np.testing.assert_array_equal(uneven.token_seq_ids[:2], [0, 0])
    np.testing.assert_array_equal(uneven.positions[:2], [0, 1])
