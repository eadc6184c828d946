"""A chat's token budget: when the rendered conversation is longer than its budget, whole
messages are dropped, oldest first, until it fits.

Always kept: system (and developer) messages, the latest user message and everything after it,
and the last assistant message that called tools together with its tool results. Messages are
dropped a turn at a time (a user message and the replies and tool results that follow it, up
to the next user message), so what remains still alternates as chat templates require and no
tool result loses its call. The choice depends only on the messages and the budget: the same
history is trimmed the same way every time, and prefix caching keeps working on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

from serve.errors import APIError


@dataclass
class Trimmed:
    messages: list[dict]
    ids: list[int]              # the kept conversation, rendered and tokenized
    dropped_messages: int
    dropped_tokens: int         # prompt tokens saved by the dropping


def turns(messages: list[dict]) -> tuple[list[list[int]], set[int]]:
    """The droppable turns (message indices, oldest first) and the indices always kept."""
    kept = {i for i, m in enumerate(messages) if m["role"] == "system"}
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if users:
        kept.update(range(users[-1], len(messages)))
    else:
        kept.update(range(len(messages)))
    groups: list[list[int]] = []
    for i, m in enumerate(messages):
        if m["role"] == "system":
            continue
        if m["role"] == "user" or not groups:
            groups.append([])
        groups[-1].append(i)
    # the last assistant message that called tools: its turn (with its results) stays whole
    callers = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("tool_calls")]
    if callers:
        kept.update(next(g for g in groups if callers[-1] in g))
    return [g for g in groups if not kept.intersection(g)], kept


async def trim(messages: list[dict], render: Callable[[list[dict]], Awaitable[list[int]]],
               budget: int) -> Trimmed:
    """The longest suffix of droppable turns that fits `budget` prompt tokens (fewest turns
    dropped, by bisection: rendering is the cost); a 400 naming the sizes when even the
    messages always kept do not fit."""
    ids = await render(messages)
    if len(ids) <= budget:
        return Trimmed(messages, ids, 0, 0)
    groups, _ = turns(messages)

    def without(k: int) -> list[dict]:
        dropped = {i for g in groups[:k] for i in g}
        return [m for i, m in enumerate(messages) if i not in dropped]

    floor = await render(without(len(groups)))
    if len(floor) > budget:
        raise APIError(400, f"the conversation needs {len(ids)} prompt tokens and its budget is "
                       f"{budget}; the messages that are always kept (system messages, the latest "
                       f"user turn and the last tool calls with their results) need {len(floor)}",
                       param="messages", code="context_length_exceeded")
    lo, hi, best = 1, len(groups), floor  # dropping hi turns fits; dropping lo - 1 does not
    while lo < hi:
        mid = (lo + hi) // 2
        got = await render(without(mid))
        if len(got) <= budget:
            hi, best = mid, got
        else:
            lo = mid + 1
    kept = without(hi)
    return Trimmed(kept, best, len(messages) - len(kept), len(ids) - len(best))
