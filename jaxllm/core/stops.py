"""When a request's new tokens end it: length limits, EOS and stop token ids (stop strings
are the detokenizer's)."""
from __future__ import annotations

from jaxllm.core.request import Request, RequestStatus


def none_stop(req: Request, tokens: list[int], max_model_len: int) -> bool:
    """None of these tokens, appended in order, would end the request (check_stop's
    conditions for all of them at once; min_tokens only delays a stop, so it is left out)."""
    n, max_tokens = len(tokens), req.sampling_params.max_tokens
    if len(req.all_token_ids) + n >= max_model_len:
        return False
    if max_tokens is not None and len(req.output_token_ids) + n >= max_tokens:
        return False
    return req.stop_ids.isdisjoint(tokens)


def check_stop(req: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """How the request ends with `token`, its newest token, appended; None: it goes on."""
    params = req.sampling_params
    if len(req.all_token_ids) >= max_model_len:  # (no properties: per request per step)
        return RequestStatus.FINISHED_LENGTH
    num_output = len(req.output_token_ids)
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if token not in req.stop_ids:  # EOS (unless ignored) and the stop ids
        return None
    if num_output < params.min_tokens:
        return None
    if not params.ignore_eos and token == req.eos_token_id:
        return RequestStatus.FINISHED_STOPPED
    req.stop_reason = token
    return RequestStatus.FINISHED_STOPPED
