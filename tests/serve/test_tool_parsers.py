"""Tool-call parsers on their own: whole outputs, and the same outputs streamed in random
pieces, give the same content and calls; the stream's deltas are OpenAI's (the id and name
once, first, then pieces of the arguments)."""
import json
import random

import pytest

from serve.tool_parsers import REQUIRED, get_parser

HERMES_TWO = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
              '"tags": ["a}", "{b"], "n": {"x": 1}}}\n</tool_call>\n<tool_call>\n'
              '{"name": "get_time", "arguments": {}}\n</tool_call>')
CASES = [
    # parser, text, content, [(name, arguments)]
    ("hermes", HERMES_TWO, "Let me look.\n",
     [("get_weather", {"city": "Paris", "tags": ["a}", "{b"], "n": {"x": 1}}), ("get_time", {})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"q": "say \\"hi\\" <tool_call>"}}</tool_call>',
     None, [("f", {"q": 'say "hi" <tool_call>'})]),
    # the name after the arguments: sent once the object is complete
    ("hermes", '<tool_call>{"arguments": {"name": "inner"}, "name": "outer"}</tool_call>', None,
     [("outer", {"name": "inner"})]),
    # arguments written as a string of JSON
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', None,
     [("f", {"a": 1})]),
    ("hermes", "No call here, only a < and <tool", "No call here, only a < and <tool", []),
    # a call that does not parse, or one cut off: the whole output is content (a stream has
    # sent the call's start by then; the test checks that it sends no content after it)
    ("hermes", 'Hm <tool_call>{"name": "f", "arguments": {"a": }</tool_call>',
     'Hm <tool_call>{"name": "f", "arguments": {"a": }</tool_call>', []),
    ("hermes", 'x<tool_call>{"name": "f", "arguments": {"a": 1', 'x<tool_call>{"name": "f", "arguments": {"a": 1', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                    '{"name": "get_time", "parameters": {"zone": "UTC"}}', None,
     [("get_weather", {"city": "Rome"}), ("get_time", {"zone": "UTC"})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": [1, 2]}}', None, [("f", {"a": [1, 2]})]),
    ("llama3_json", "  The answer is {42}.", "  The answer is {42}.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("required", '[{"name": "f", "parameters": {"a": "]"}}, {"name": "g", "parameters": {}}]', None,
     [("f", {"a": "]"}), ("g", {})]),
    ("required", '[ {"name": "f", "parameters": {"a": true}} ]', None, [("f", {"a": True})]),
]


def parser(name):
    return REQUIRED if name == "required" else get_parser(name)


def stream(p, text: str, rng: random.Random):
    s = p.stream()
    content, calls, order = "", {}, []
    i = 0
    while i < len(text):
        k = rng.randint(1, 7)
        c, deltas = s.feed(text[i:i + k], final=i + k >= len(text))
        i += k
        content += c
        for d in deltas:
            if "id" in d:
                assert d["index"] not in calls and d["type"] == "function"
                assert d["function"]["arguments"] == ""
                calls[d["index"]] = [d["function"]["name"], ""]
                order.append(d["index"])
            else:
                assert d["index"] in calls  # the header came first
                calls[d["index"]][1] += d["function"]["arguments"]
    assert order == sorted(order)
    return content, [(n, a) for n, a in calls.values()]


@pytest.mark.parametrize("name,text,content,expected", CASES)
def test_whole_and_streamed_agree(name, text, content, expected):
    p = parser(name)
    got_content, calls = p.extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == len(calls)
    for seed in range(5):
        s_content, s_calls = stream(p, text, random.Random(seed))
        if expected:
            assert s_content == (content or "")
            assert [(n, json.loads(a)) for n, a in s_calls] == expected
        elif s_calls:  # a broken call whose start was streamed
            assert s_content == text[:text.index("<tool_call>")] and len(s_calls) == 1
        else:
            assert s_content == text


def test_arguments_stream_before_the_call_ends():
    s = get_parser("hermes").stream()
    _, d1 = s.feed('<tool_call>{"name": "f", "arguments": {"city": "Par')
    assert d1[0]["function"]["name"] == "f" and d1[1]["function"]["arguments"] == '{"city": "Par'
    _, d2 = s.feed('is"}}</tool_call>')
    assert [d["function"]["arguments"] for d in d2] == ['is"}']


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        get_parser("nope")
