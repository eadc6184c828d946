"""The facts a request owns (jaxllm.core.request), decided once when it is made, and the
scheduler as the one place that ends a request."""
import ast
from pathlib import Path

import pytest

from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import (Request, RequestStatus, num_sampled_logprobs, split_bad_words,
                                 wants_cumulative_logprob)
from jaxllm.core.scheduler import Scheduler
from jaxllm.core.scheduler_output import NewRequestData
from jaxllm.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
EOS = 2


def req(rid="a", n_prompt=5, bad_word_ids=None, **kw):
    kw.setdefault("max_tokens", 8)
    return Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(**kw), EOS, seed=0,
                   bad_word_ids=bad_word_ids)


def make(num_blocks=32, block_size=4, **kw):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(kv, 8, 64, 64, **kw), kv


def step(s, token=7):
    out = s.schedule()
    return out, s.update_from_output(out, {rid: [token] for rid in out.sampling_req_ids})


# stop set
def test_stop_ids_are_eos_and_stop_token_ids():
    assert req(stop_token_ids=[5, 6]).stop_ids == {5, 6, EOS}
    assert req(stop_token_ids=[5], ignore_eos=True).stop_ids == {5}
    no_eos = Request("a", [1, 2], SamplingParams(), None, seed=0)
    assert no_eos.stop_ids == frozenset()


# bad words
def test_bad_words_split_into_fixed_bans_and_words_that_need_context():
    assert split_bad_words(None) == ([], None)
    assert split_bad_words([[5], [6, 7], [8]]) == ([5, 8], [[6, 7]])
    r = req(bad_word_ids=[[5], [6, 7]])
    assert r.banned_token_ids == [5] and r.multi_token_bad_words == [[6, 7]]
    assert r.needs_host_tokens
    single = req(bad_word_ids=[[5]])
    assert single.banned_token_ids == [5] and single.multi_token_bad_words is None
    assert not single.needs_host_tokens and not req().needs_host_tokens


def test_bad_word_ids_set_after_construction_decide_the_same_facts():
    r = req()
    r.bad_word_ids = [[3, 4]]
    assert r.multi_token_bad_words == [[3, 4]] and r.needs_host_tokens and r.banned_token_ids == []


# logprobs
@pytest.mark.parametrize("kw, num, cumulative", [
    ({}, -1, False),
    (dict(logprobs=0), 0, True),
    (dict(logprobs=3), 3, True),
    (dict(n=2, best_of=4), 0, True),      # ranked by cumulative logprob, not returned
    (dict(n=2, best_of=2), -1, False),    # nothing to rank
    (dict(n=1, best_of=3, logprobs=2), 2, True),
])
def test_logprob_needs(kw, num, cumulative):
    params = SamplingParams(**kw)
    r = Request("a", [1, 2], params, EOS, seed=0)
    assert r.num_logprobs == num_sampled_logprobs(params) == num
    assert r.wants_cumulative_logprob == wants_cumulative_logprob(params) == cumulative


def test_prompt_logprobs_need_every_prompt_token_computed():
    assert req(prompt_logprobs=2).num_prompt_logprobs == 2
    assert req(prompt_logprobs=2).skip_prefix_cache
    assert req().num_prompt_logprobs == -1 and not req().skip_prefix_cache


# token ids
def test_the_request_owns_its_tokens():
    prompt = [1, 2, 3]
    r = Request("a", prompt, SamplingParams(), EOS, seed=0)
    prompt.append(4)  # the caller's list is not the request's
    assert r.all_token_ids == [1, 2, 3] and r.num_prompt_tokens == 3
    r.append_output_tokens([7, 8])
    assert r.output_token_ids == [7, 8] and r.all_token_ids == [1, 2, 3, 7, 8]


# the scheduler's output carries the facts
def test_new_request_data_carries_the_request_facts():
    s, _ = make()
    r = req(bad_word_ids=[[5], [6, 7]], logprobs=2, prompt_logprobs=1, stop_token_ids=[9])
    s.add_request(r)
    new, = s.schedule().scheduled_new_reqs
    assert isinstance(new, NewRequestData)
    assert new.token_ids == r.all_token_ids and new.token_ids is not r.all_token_ids
    assert new.stop_ids == {9, EOS}
    assert new.banned_token_ids == [5] and new.multi_token_bad_words == [[6, 7]]
    assert new.num_logprobs == 2 and new.num_prompt_logprobs == 1


# status and stop reason: only through the scheduler
def test_finish_request_frees_blocks_and_sets_status_and_stop_reason():
    s, kv = make()
    r = req()
    s.add_request(r)
    step(s)
    step(s)
    assert r.status == RequestStatus.RUNNING and r.output_token_ids == [7, 7]
    free = kv.num_free_blocks
    s.finish_request(r, RequestStatus.FINISHED_STOPPED, "stop!", num_dropped_tokens=1)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.finish_reason == "stop"
    assert r.stop_reason == "stop!"
    assert r.output_token_ids == [7] and r.all_token_ids[-1] == 7 and r.num_tokens == 6
    assert kv.num_free_blocks > free and not kv.get_blocks("a")
    assert "a" not in s.requests and not s.has_unfinished_requests()
    assert s.schedule().finished_req_ids == {"a"}  # the runner drops the row


def test_a_stop_after_a_length_limit_wins():
    s, _ = make()
    r = req(max_tokens=1)
    s.add_request(r)
    step(s)
    assert r.status == RequestStatus.FINISHED_LENGTH
    s.finish_request(r, RequestStatus.FINISHED_STOPPED, "x")
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == "x"


def test_a_request_the_scheduler_never_held_is_only_marked():
    s, _ = make()
    r = req()
    s.finish_request(r, RequestStatus.FINISHED_ABORTED)
    assert r.status == RequestStatus.FINISHED_ABORTED and r.finish_reason == "abort"
    # a different request under a live request's id is not that request
    live = req()
    s.add_request(live)
    s.finish_request(req(), RequestStatus.FINISHED_ABORTED)
    assert live.status == RequestStatus.WAITING and s.requests["a"] is live


def test_a_stop_token_sets_the_stop_reason_in_the_scheduler():
    s, _ = make()
    r = req(stop_token_ids=[9])
    s.add_request(r)
    step(s, token=9)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 9


def test_needs_host_tokens_while_a_live_request_has_multi_token_bad_words():
    s, _ = make()
    plain, multi = req("p"), req("m", bad_word_ids=[[6, 7]])
    s.add_request(plain)
    assert not s.needs_host_tokens
    s.add_request(multi, [req("m1", bad_word_ids=[[6, 7]])])
    assert s.needs_host_tokens
    s.finish_requests(["m"], RequestStatus.FINISHED_ABORTED)
    assert s.needs_host_tokens  # its sibling still runs
    s.finish_requests(["m1", "p"], RequestStatus.FINISHED_ABORTED)
    assert not s.needs_host_tokens


# which attributes are the scheduler's to change, and on what
_OWNED = {"status", "stop_reason"}


def _assignments_outside_core():
    found = []
    for base in ("jaxllm", "serve"):
        for path in sorted((ROOT / base).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("jaxllm/core/"):
                continue
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                targets = []
                if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                      and node.func.id == "setattr" and len(node.args) > 1
                      and isinstance(node.args[1], ast.Constant) and node.args[1].value in _OWNED):
                    found.append(f"{rel}:{node.lineno}")
                found += [f"{rel}:{node.lineno}" for t in targets if _sets_owned(t)]
    return found


def _sets_owned(target) -> bool:
    """An assignment target sets `status` or `stop_reason` of an object reached from outside
    (a Request is never `self` outside core; an exception's own `self.status` is not one)."""
    return any(isinstance(sub, ast.Attribute) and sub.attr in _OWNED
               and not (isinstance(sub.value, ast.Name) and sub.value.id == "self")
               for sub in ast.walk(target))  # tuple targets too


def test_the_scan_finds_assignments_to_a_request():
    tree = ast.parse("req.status = 1\nreq.stop_reason, n = hit\nseq.request.status = 2\n"
                     "self.status, self.message = 400, 'bad'\n")
    assert [_sets_owned(n.targets[0]) for n in tree.body] == [True, True, True, False]


def test_only_core_changes_a_request_status_or_stop_reason():
    assert _assignments_outside_core() == []
