"""A chat's token budget (serve/context_budget.py): over random conversations, what is kept is
a valid conversation within the budget, system messages and the latest user turn always stay,
the cut is the first allowed one that fits, the same history is always trimmed the same way,
and a growing conversation keeps its cut until the budget moves it."""
import asyncio

import pytest
from hypothesis import given, settings, strategies as st

from serve.context_budget import cuts, trim, turns
from serve.errors import APIError


def render(messages):
    """A stand-in for template and tokenizer: a few tokens per message and one per word."""
    async def go():
        n = 3 + sum(4 + len((m["content"] or "").split()) for m in messages)
        return list(range(n))
    return go()


def run_trim(messages, budget, step=0.0):
    """step: the allowed cuts' spacing as a fraction of the budget."""
    return asyncio.run(trim(messages, render, budget, int(step * budget)))


words = st.integers(1, 30).map(lambda n: " ".join(["w"] * n))


@st.composite
def conversations(draw):
    msgs, calls = [], 0
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(words)})
    for _ in range(draw(st.integers(1, 12))):
        msgs.append({"role": "user", "content": draw(words)})
        if draw(st.integers(0, 3)) == 0:  # the assistant calls tools, which answer
            ids = [f"call_{calls + i}" for i in range(draw(st.integers(1, 2)))]
            calls += len(ids)
            msgs.append({"role": "assistant", "content": None,
                         "tool_calls": [{"id": i, "type": "function",
                                         "function": {"name": "f", "arguments": {}}} for i in ids]})
            msgs += [{"role": "tool", "tool_call_id": i, "content": draw(words)} for i in ids]
        if draw(st.integers(0, 5)) == 0:
            msgs.append({"role": "system", "content": draw(words)})
        msgs.append({"role": "assistant", "content": draw(words)})
    ending = draw(st.sampled_from(["user", "assistant", "tools"]))
    if ending == "user":
        msgs.append({"role": "user", "content": draw(words)})
    elif ending == "tools":  # an agent loop: the model is asked again after its tools answered
        msgs.append({"role": "user", "content": draw(words)})
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_last", "type": "function", "function": {"name": "f", "arguments": {}}}]})
        msgs.append({"role": "tool", "tool_call_id": "call_last", "content": draw(words)})
    return msgs


def count(messages) -> int:
    return len(asyncio.run(render(messages)))


def always_kept(messages) -> list[int]:
    _, kept = turns(messages)
    return sorted(kept)


steps = st.sampled_from([0.0, 0.1, 0.25, 0.5])


@settings(max_examples=300, deadline=None)
@given(conversations(), st.floats(0.05, 1.2), steps)
def test_trimmed_conversations_keep_the_rules(messages, fraction, step):
    budget = max(1, int(count(messages) * fraction))
    floor = count([messages[i] for i in always_kept(messages)])
    if floor > budget:
        with pytest.raises(APIError) as e:
            run_trim(messages, budget, step)
        assert e.value.status == 400 and f"{budget}" in e.value.message and f"{floor}" in e.value.message
        return
    out = run_trim(messages, budget, step)
    kept = out.messages
    assert len(out.ids) == count(kept) <= budget
    assert out.dropped_messages == len(messages) - len(kept)
    assert out.dropped_tokens == count(messages) - count(kept)
    # a subsequence of the original, in order, with everything that is always kept
    pos = [next(i for i in range(len(messages)) if messages[i] is m) for m in kept]
    assert pos == sorted(pos)
    assert set(always_kept(messages)) <= set(pos)
    assert all(m in kept for m in messages if m["role"] == "system")
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is not None:
        assert set(range(last_user, len(messages))) <= set(pos)
    # valid: after any drop the conversation starts (past system messages) with a user turn,
    # and every tool result follows the assistant message that called it
    rest = [m for m in kept if m["role"] != "system"]
    if out.dropped_messages:
        assert rest[0]["role"] == "user"
    called = set()
    for m in kept:
        if m["role"] == "assistant":
            called |= {c["id"] for c in m.get("tool_calls") or ()}
        if m["role"] == "tool":
            assert m["tool_call_id"] in called
    groups, _ = turns(messages)
    dropped_turns = [g for g in groups if not set(g) & set(pos)]
    assert dropped_turns == groups[:len(dropped_turns)]  # oldest first
    if dropped_turns:
        # the first allowed cut that fits: every allowed cut before it keeps too much
        allowed = cuts(messages, int(step * budget))
        chosen = min(k for k in allowed if dropped_by(messages, k) == dropped_turns)
        for k in allowed:
            if k < chosen:
                assert count(without(messages, dropped_by(messages, k))) > budget
        if step == 0:  # the fewest turns: keeping the newest dropped turn as well would not fit
            back = sorted(set(pos) | set(dropped_turns[-1]))
            assert count([messages[i] for i in back]) > budget
    # deterministic
    assert run_trim(messages, budget, step).messages == kept


def dropped_by(messages, k):
    """The droppable turns among the first k turns (system messages are in none)."""
    groups, kept = turns(messages)
    every = []
    for i, m in enumerate(messages):
        if m["role"] != "system":
            if m["role"] == "user" or not every:
                every.append([])
            every[-1].append(i)
    return [g for g in every[:k] if g in groups]


def without(messages, dropped):
    gone = {i for g in dropped for i in g}
    return [m for i, m in enumerate(messages) if i not in gone]


@settings(max_examples=200, deadline=None)
@given(conversations(), st.lists(st.tuples(words, words), min_size=1, max_size=6),
       st.floats(0.2, 0.9), st.sampled_from([0.1, 0.25, 0.5]))
def test_a_growing_conversation_keeps_its_cut(messages, more, fraction, step):
    """Turns appended one at a time under a fixed budget: the allowed cuts before the last
    resort (dropping every droppable turn) never move, and a cut that is still allowed and
    still fits is kept, so each turn's trimmed history is a prefix of the next one's."""
    if messages[-1]["role"] != "assistant" or messages[-1].get("tool_calls"):
        messages = messages + [{"role": "assistant", "content": "ok"}]
    budget = max(1, int(count(messages) * fraction))
    before = None  # (allowed cuts, the chosen cut) at the previous turn
    for question, answer in more:
        messages = messages + [{"role": "user", "content": question}]
        allowed = cuts(messages, int(step * budget))
        if before is not None:
            assert before[0][:-1] == allowed[:len(before[0]) - 1]
        try:
            out = run_trim(messages, budget, step)
        except APIError:
            return
        groups, _ = turns(messages)
        dropped = [g for g in groups if not any(messages[g[0]] is m for m in out.messages)]
        chosen = 0 if not dropped else min(k for k in allowed if dropped_by(messages, k) == dropped)
        if before is not None and before[1] in allowed:
            old = without(messages, dropped_by(messages, before[1]))
            if count(old) <= budget:
                assert chosen == before[1]
                assert out.messages == old
            else:
                assert chosen > before[1]
        before = (allowed, chosen)
        messages = messages + [{"role": "assistant", "content": answer}]


def test_a_conversation_that_fits_is_untouched():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = run_trim(msgs, 100)
    assert out.messages == msgs and out.dropped_messages == 0 and out.dropped_tokens == 0


def test_the_last_tool_calls_stay_with_their_turn():
    """A user turn that ended in tool calls, then a new user message: the turn with the last
    calls and their results is kept, the older turn goes."""
    msgs = [{"role": "user", "content": "old " * 50},
            {"role": "assistant", "content": "sure " * 50},
            {"role": "user", "content": "look it up"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "found"},
            {"role": "user", "content": "thanks"}]
    out = run_trim(msgs, 40)
    assert out.messages == msgs[2:] and out.dropped_messages == 2


def test_cuts_are_spaced_by_the_tokenizers_count():
    """Sizes come from the tokenizer when one counts them: text of one token a character (as
    CJK often is) gets cuts four times closer than the characters-based guess would place."""
    msgs = []
    for i in range(12):
        msgs += [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "y" * 40}]
    msgs.append({"role": "user", "content": "last"})
    guessed = cuts(msgs, 100)
    counted = cuts(msgs, 100, [len(m["content"]) for m in msgs])
    assert guessed[:3] == [4, 8, 11] and counted[:3] == [2, 3, 4]
    seen = []

    async def count(texts):
        seen.append(len(texts))
        return [len(t) for t in texts]
    out = asyncio.run(trim(msgs, render, 60, 100, count))
    assert seen == [len(msgs)] and out.dropped_messages in [2 * k for k in counted]
