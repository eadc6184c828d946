"""Request state as the scheduler sees it."""
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


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: "SamplingParams", eos_token_id: int | None,
                 seed: int, arrival_time: float | None = None, priority: int = 0,
                 cache_salt: str | None = None, lora_id: int | None = None,
                 parent_id: str | None = None):
        self.request_id = request_id
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
        self.bad_word_ids: list[list[int]] | None = None  # tokenized SamplingParams.bad_words
        self.grammar = None  # structured outputs: this sequence's matcher (structured_output/)
        # prompt_logprobs needs every prompt token computed: no prefix-cache hits
        self.skip_prefix_cache = sampling_params.prompt_logprobs is not None
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
        """Take back the last n output tokens (a stop string ended the text before them)."""
        if n > 0:
            del self.output_token_ids[-n:]
            del self.all_token_ids[-n:]

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
