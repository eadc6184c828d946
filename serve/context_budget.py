"""A chat's token budget: when the rendered conversation is longer than its budget, whole
messages are dropped, oldest first, until it fits.

Always kept: system (and developer) messages, the latest user message and everything after it,
and the last assistant message that called tools together with its tool results. Messages are
dropped a turn at a time (a user message and the replies and tool results that follow it, up
to the next user message), so what remains still alternates as chat templates require and no
tool result loses its call. The choice depends only on the messages and the budget: the same
history is trimmed the same way every time.

Where the cut may fall is fixed by the history before it: the turns are walked from the start,
and a cut is allowed where their running size in tokens (each message's text as the tokenizer
counts it, plus a few tokens for the template) crosses a multiple of `step_tokens`. The cut
then stays put while a conversation grows, turn after turn, until the budget forces it to the
next allowed place, so that the trimmed history of one turn is a prefix of the next one's
and the prefix cache serves it. `step_tokens=0` allows a cut after every turn: the fewest
turns dropped, but each new turn moves the cut.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Awaitable, Callable

from serve.errors import APIError

# These only space the allowed cuts; what fits is measured by rendering.
TOKENS_PER_MESSAGE = 4  # the template's own tokens around each message
CHARS_PER_TOKEN = 4     # sizes guessed from characters when no tokenizer counts them


@dataclass
class Trimmed:
    messages: list[dict]
    ids: list[int]              # the kept conversation, rendered and tokenized
    dropped_messages: int
    dropped_tokens: int         # prompt tokens saved by the dropping


def _groups(messages: list[dict]) -> list[list[int]]:
    """The turns, oldest first: message indices from one user message to the next (system
    messages belong to none)."""
    groups: list[list[int]] = []
    for i, m in enumerate(messages):
        if m["role"] == "system":
            continue
        if m["role"] == "user" or not groups:
            groups.append([])
        groups[-1].append(i)
    return groups


def _kept(messages: list[dict], groups: list[list[int]]) -> set[int]:
    kept = {i for i, m in enumerate(messages) if m["role"] == "system"}
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    kept.update(range(users[-1] if users else 0, len(messages)))
    # the last assistant message that called tools: its turn (with its results) stays whole
    callers = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("tool_calls")]
    if callers:
        kept.update(next(g for g in groups if callers[-1] in g))
    return kept


def turns(messages: list[dict]) -> tuple[list[list[int]], set[int]]:
    """The droppable turns (message indices, oldest first) and the indices always kept."""
    groups = _groups(messages)
    kept = _kept(messages, groups)
    return [g for g in groups if not kept.intersection(g)], kept


def text_of(m: dict) -> str:
    """What of a message the model reads as text: its content and its tool calls."""
    content = m.get("content")
    if isinstance(content, list):
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    text = content or ""
    if m.get("tool_calls"):
        text += json.dumps(m["tool_calls"], sort_keys=True, default=str)
    return text


def cuts(messages: list[dict], step_tokens: int, sizes: list[int] | None = None) -> list[int]:
    """The allowed cuts, ascending: cut k drops the droppable turns among the first k turns.
    `sizes`: each message's tokens (guessed from its characters when None). Each cut depends
    only on the turns before it, so appending turns never moves one."""
    groups = _groups(messages)
    if step_tokens <= 0:
        return list(range(1, len(groups) + 1))
    if sizes is None:
        sizes = [len(text_of(m)) // CHARS_PER_TOKEN for m in messages]
    allowed, total = [], 0
    for k, g in enumerate(groups, start=1):
        before = total // step_tokens
        total += sum(sizes[i] + TOKENS_PER_MESSAGE for i in g)
        if total // step_tokens > before:
            allowed.append(k)
    if not allowed or allowed[-1] != len(groups):
        allowed.append(len(groups))  # dropping every droppable turn is always allowed
    return allowed


async def trim(messages: list[dict], render: Callable[[list[dict]], Awaitable[list[int]]],
               budget: int, step_tokens: int = 0,
               count: Callable[[list[str]], Awaitable[list[int]]] | None = None) -> Trimmed:
    """The first allowed cut (see `cuts`) whose kept conversation fits `budget` prompt tokens,
    found by bisection since rendering is the cost; a 400 naming the sizes when even the
    messages always kept do not fit. `count`: the tokens of each of a list of texts (the
    messages' sizes for `cuts`)."""
    ids = await render(messages)
    if len(ids) <= budget:
        return Trimmed(messages, ids, 0, 0)
    groups = _groups(messages)
    kept = _kept(messages, groups)

    def without(k: int) -> list[dict]:
        dropped = {i for g in groups[:k] if not kept.intersection(g) for i in g}
        return [m for i, m in enumerate(messages) if i not in dropped]

    sizes = await count([text_of(m) for m in messages]) if count is not None and step_tokens > 0 else None
    allowed = cuts(messages, step_tokens, sizes)
    floor = await render(without(len(groups)))
    if len(floor) > budget:
        raise APIError(400, f"the conversation needs {len(ids)} prompt tokens and its budget is "
                       f"{budget}; the messages that are always kept (system messages, the latest "
                       f"user turn and the last tool calls with their results) need {len(floor)}",
                       param="messages", code="context_length_exceeded")
    # allowed[hi] fits; every cut before allowed[lo] does not
    lo, hi, best = 0, len(allowed) - 1, floor
    while lo < hi:
        mid = (lo + hi) // 2
        got = await render(without(allowed[mid]))
        if len(got) <= budget:
            hi, best = mid, got
        else:
            lo = mid + 1
    out = without(allowed[hi])
    return Trimmed(out, best, len(messages) - len(out), len(ids) - len(best))
