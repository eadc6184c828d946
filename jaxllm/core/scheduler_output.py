"""What one scheduled step tells the runner (SchedulerOutput and the request data it carries)
and what the scheduler hands back per request once the step's tokens are known."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaxllm.core.request import Request

if TYPE_CHECKING:
    from jaxllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has no state for: sent in full once, with the facts its request
    decided (jaxllm.core.request), which the runner reads rather than decides again."""
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: "SamplingParams"
    seed: int
    eos_token_id: int | None = None
    bad_word_ids: list[list[int]] | None = None
    lora_id: int | None = None  # the adapter's key (jaxllm.lora.registry); None: the base model
    stop_ids: frozenset[int] = frozenset()  # banned until min_tokens are out
    banned_token_ids: list[int] = field(default_factory=list)  # one-token bad words
    multi_token_bad_words: list[list[int]] | None = None
    num_logprobs: int = -1         # per sampled token; -1: none
    num_prompt_logprobs: int = -1  # per prompt token; -1: none
    mm: list | None = None  # Request.mm: images' places in the prompt and their features

    @classmethod
    def from_request(cls, req: Request, block_ids: list[int]) -> "NewRequestData":
        return cls(req.request_id, list(req.all_token_ids), req.num_prompt_tokens, block_ids,
                   req.num_computed_tokens, req.sampling_params, req.seed, req.eos_token_id,
                   req.bad_word_ids, req.lora_id, req.stop_ids, req.banned_token_ids,
                   req.multi_token_bad_words, req.num_logprobs, req.num_prompt_logprobs, req.mm)


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds: only the diff."""
    req_id: str
    new_block_ids: Sequence[int]  # (most steps: kv_cache_manager.NO_BLOCKS)
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # requests whose runner-side state must be dropped (finished, aborted or preempted)
    finished_req_ids: set[str] = field(default_factory=set)
    # block moves the runner does before the step, in this order
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host, device)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)      # (src, dst)
    # requests whose scheduled tokens reach their end: they sample their next token
    sampling_req_ids: set[str] = field(default_factory=set)
    # speculative decoding: the proposed tokens scheduled after each request's known tokens
    # (the last ones of its scheduled tokens; -1: held on the device)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # the requests scheduled, as objects: an id finished and reused while the step ran must
    # not receive the step's tokens (host side only; the runner never reads it)
    scheduled_reqs: dict[str, Request] = field(default_factory=dict, repr=False)
    # multi-step scheduling: the passes of this step (> 1: every scheduled request decodes,
    # num_scheduled_tokens[r] passes of them for r, one output token per pass)
    num_passes: int = 1

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def has_block_ops(self) -> bool:
        return bool(self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_copy)


@dataclass(slots=True)
class RequestUpdate:
    request: Request
    new_token_ids: list[int]
