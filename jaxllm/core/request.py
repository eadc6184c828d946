"""A request and its facts, owned here once.

What a request needs is decided when it is made, from its SamplingParams and its prompt: the
tokens that stop it, its bad words by kind, the logprobs its sampling computes. The engine,
the runner and the output processor read these facts (the runner through the scheduler's
output) and never decide them again. The request owns its token ids; the runner's persistent
batch mirrors them while the request runs. Only the scheduler changes a request's status and
stop reason, and takes tokens back.
"""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    # `finished` is a plain attribute of each member: the loop reads it several times per
    # request per step, and a property on an enum costs several times an attribute
    def __new__(cls, value: int, finished: bool = False):
        member = int.__new__(cls, value)
        member._value_ = value
        member.finished = finished
        return member

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # recompute: waits with no blocks
    SWAPPED = 3    # swap: waits with its blocks in host memory
    FINISHED_STOPPED = 4, True
    FINISHED_LENGTH = 5, True
    FINISHED_ABORTED = 6, True
    FINISHED_ERROR = 7, True  # its step failed (Request.error says how)


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def split_bad_words(bad_word_ids) -> tuple[list[int], list[list[int]] | None]:
    """(tokens banned at every position, multi-token words or None) of tokenized bad words.
    A one-token word is a fixed ban; a longer one bans its last token only after its other
    tokens, so its check needs the tokens before each position on the host."""
    single = [w[0] for w in bad_word_ids or () if len(w) == 1]
    multi = [w for w in bad_word_ids or () if len(w) > 1]
    return single, multi or None


def num_sampled_logprobs(params: "SamplingParams") -> int:
    """Top logprobs computed per sampled token: -1 none. best_of ranks its sequences by
    cumulative logprob, so those are computed even when not returned."""
    if params.logprobs is not None:
        return params.logprobs
    return 0 if params.num_sequences > params.n else -1


def wants_cumulative_logprob(params: "SamplingParams") -> bool:
    """The sampled tokens' logprobs are summed: returned with logprobs, ranked by best_of."""
    return num_sampled_logprobs(params) >= 0


def num_prompt_logprobs(params: "SamplingParams") -> int:
    """Top logprobs computed per prompt token: -1 none."""
    return -1 if params.prompt_logprobs is None else params.prompt_logprobs


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: "SamplingParams", eos_token_id: int | None,
                 seed: int, arrival_time: float | None = None, priority: int = 0,
                 cache_salt: str | None = None, lora_id: int | None = None,
                 parent_id: str | None = None,
                 bad_word_ids: list[list[int]] | None = None, mm: list | None = None):
        self.request_id = request_id
        # a vision-language model's images: (offset, length, hash, features [length, E]) of
        # each, in prompt order (their tokens' places and what takes them)
        self.mm = mm
        self.parent_id = request_id if parent_id is None else parent_id  # n > 1: the request's id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        # the tokens that can end this request once min_tokens are out (one set test per step)
        self.stop_ids = frozenset(sampling_params.stop_token_ids or ()) | (
            frozenset() if sampling_params.ignore_eos or eos_token_id is None else {eos_token_id})
        # Every request samples from its own key stream, so a seeded request draws the same
        # tokens whatever shares its batch.
        self.seed = seed
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.lora_id = lora_id  # the adapter's key (jaxllm.lora.registry); None: the base model
        # keys mixed into the first block's hash: requests differing here never share blocks
        self.cache_extra = (cache_salt, lora_id) if (cache_salt or lora_id) else None
        self.block_hashes: list = []  # prefix-cache keys of this request's full blocks
        self.num_cached_tokens = -1   # prompt tokens found in the prefix cache (-1: not yet looked)
        self.forks: list[Request] = []  # n > 1: siblings that share this request's prompt blocks
        self.bad_word_ids = bad_word_ids  # tokenized SamplingParams.bad_words
        self.num_logprobs = num_sampled_logprobs(sampling_params)
        self.wants_cumulative_logprob = wants_cumulative_logprob(sampling_params)
        self.num_prompt_logprobs = num_prompt_logprobs(sampling_params)
        self.grammar = None  # structured outputs: this sequence's matcher (structured_output/)
        # prompt_logprobs needs every prompt token computed: no prefix-cache hits
        self.skip_prefix_cache = self.num_prompt_logprobs >= 0
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        # tokens whose KV is computed or scheduled: advanced when a step is scheduled
        self.num_computed_tokens = 0
        # tokens sampled by steps still in flight (async scheduling): not known to the host
        self.num_output_placeholders = 0
        # speculative decoding: proposed tokens for the next step (-1: held on the device),
        # verified there and never part of the request's tokens until accepted
        self.spec_token_ids: list[int] = []
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # why its step failed (FINISHED_ERROR)

    @property
    def bad_word_ids(self) -> list[list[int]] | None:
        return self._bad_word_ids

    @bad_word_ids.setter
    def bad_word_ids(self, ids: list[list[int]] | None) -> None:
        # (set once, before the request is queued)
        self._bad_word_ids = ids
        self.banned_token_ids, self.multi_token_bad_words = split_bad_words(ids)
        # its sampling reads the tokens before each position on the host: no step may
        # sample on the device from tokens the host has not seen
        self.needs_host_tokens = self.multi_token_bad_words is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def append_output_tokens(self, token_ids: list[int]) -> None:
        self.output_token_ids += token_ids
        self.all_token_ids += token_ids

    def drop_last_output_tokens(self, n: int) -> None:
        """Take back the last n output tokens (a stop string ended the text before them):
        through Scheduler.finish_request, which ends the request with it."""
        if n > 0:
            del self.output_token_ids[-n:]
            del self.all_token_ids[-n:]

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
