"""Structured outputs and tool calling through the server, with the official openai client
against `jaxllm serve` on loopback: a tiny checkpoint whose tokenizer carries a Qwen2-style
chat template that renders tools, tool calls and tool results (the default model's template
renders none of them), served with `--enable-auto-tool-choice --tool-call-parser hermes`.

The tiny model's weights are random: what it writes is noise, but under a constraint the noise
has the constraint's shape, which is what these tests check. For `tool_choice: auto` the
model's own tool-call syntax is produced by a grammar (structured_outputs), so the hermes
parser is exercised on real streamed output."""
import json
import os
import re
import shutil

import httpx
import jsonschema
import openai
import pytest

from server_util import start_server, stop
from server_util import SERVER_ENGINE

MODEL = "tiny-tools"
# a Qwen2-style template: tools described in the system turn, calls as <tool_call> JSON, tool
# results as <tool_response> in a user turn
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}Tools:<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
Call: <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
# test_server.py's model and engine shape: its steps are in the compilation cache

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSG = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama):
    """tiny_llama with the template above in place of the default model's."""
    model = tmp_path_factory.mktemp("tiny_tools")
    for name in os.listdir(tiny_llama):
        if name != "chat_template.jinja":
            shutil.copy(os.path.join(tiny_llama, name), model / name)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = HERMES_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    log = tmp_path_factory.mktemp("tools_server") / "server.log"
    proc, base, _ = start_server([str(model), "--served-model-name", MODEL, *SERVER_ENGINE,
                                  "--enable-auto-tool-choice", "--tool-call-parser", "hermes"], log)
    yield {"base": base, "proc": proc, "log": log}
    stop(proc)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="none", max_retries=0)


def check_call(call):
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def streamed_calls(stream) -> tuple[dict, str, list]:
    """Reassembled tool calls (index -> {id, name, arguments}), content and finish reasons."""
    calls, content, reasons = {}, "", []
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or ():
            c = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert c["id"] is None, "the id comes once, first"
                c["id"], c["name"] = d.id, d.function.name
            assert c["id"] is not None, "arguments before the call's header"
            c["arguments"] += d.function.arguments or ""
        if ch.finish_reason:
            reasons.append(ch.finish_reason)
    return calls, content, reasons


def test_named_tool_choice(client):
    kw = dict(model=MODEL, messages=MSG, tools=TOOLS, max_tokens=60, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and len(msg.tool_calls) == 1  # OpenAI's reason
    assert msg.tool_calls[0].function.name == "get_weather" and msg.tool_calls[0].id
    check_call(msg.tool_calls[0])
    calls, content, reasons = streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and not content
    assert json.loads(calls[0]["arguments"]) == json.loads(msg.tool_calls[0].function.arguments)
    assert reasons == ["stop"]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice(client, parallel):
    kw = dict(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required", max_tokens=64,
              parallel_tool_calls=parallel, temperature=0)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls and (parallel or len(choice.message.tool_calls) == 1)
    for call in choice.message.tool_calls:
        check_call(call)
    calls, content, reasons = streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert reasons == ["tool_calls"] and not content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls]


# the model "chooses" to call a tool: a grammar makes it write Hermes' syntax
HERMES_CALLS = ('start: "I will check. " call ("\\n" call)?\n'
                'call: "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": '
                '{\\"city\\": \\"" CITY "\\", \\"days\\": " DAY "}}\\n</tool_call>"\n'
                'CITY: "Paris" | "Rome"\nDAY: /[1-7]/')


def test_auto_tool_choice_parses_the_models_calls(client):
    kw = dict(model=MODEL, messages=MSG, tools=[WEATHER], max_tokens=120, temperature=0,
              extra_body={"structured_outputs": {"grammar": HERMES_CALLS}})
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will check. "
    assert 1 <= len(choice.message.tool_calls) <= 2
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather" and check_call(call)["city"] in ("Paris", "Rome")
    calls, content, reasons = streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert content == "I will check. " and reasons == ["tool_calls"]
    assert [json.loads(c["arguments"]) for c in calls.values()] == \
        [json.loads(t.function.arguments) for t in choice.message.tool_calls]
    # tool_choice none: the same text stays content
    r = client.chat.completions.create(**kw, tool_choice="none")
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content.startswith("I will check. <tool_call>")
    # without calls in the text, auto answers with content
    r = client.chat.completions.create(model=MODEL, messages=MSG, tools=[WEATHER], max_tokens=8,
                                       extra_body={"structured_outputs": {"choice": ["No tools."]}})
    assert r.choices[0].message.content == "No tools." and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_template_gets_tools_and_tool_results(server):
    """The chat template receives the tools, the assistant's earlier calls and the tool's
    result (through /tokenize, which renders chats as /v1/chat/completions does)."""
    history = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = httpx.post(server["base"] + "/tokenize", json={"model": MODEL, "messages": history,
                                                       "tools": TOOLS}, timeout=60)
    assert r.status_code == 200, r.text
    text = httpx.post(server["base"] + "/detokenize", json={"tokens": r.json()["tokens"]},
                      timeout=60).json()["prompt"]
    assert '"name": "get_time"' in text and '"description": "Weather"' in text  # the tools
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


def test_response_format_and_structured_outputs(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    # greedy: at temperature 1 a draw may spend the 40 tokens on the whitespace JSON allows
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=40, temperature=0.0,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "answer", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", r.choices[0].text)
    stream = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20, stream=True,
                                       extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert "".join(c.choices[0].text for c in stream) in ("red", "blue")


BAD = [
    ("uncompilable grammar", {"prompt": "x", "structured_outputs": {
        "grammar": 'start: "a" <|no_such_token|>'}}, "structured_outputs", "unknown special token"),
    ("unsupported schema keyword", {"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {
            "type": "array", "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ("json_schema without a schema", {"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "n"}}}, "response_format", "schema"),
    ("two constraints", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs", "exactly one"),
    ("both fields", {"prompt": "x", "structured_outputs": {"regex": "a"},
                     "response_format": {"type": "json_object"}}, "response_format", "both"),
    ("unknown tool", {"messages": MSG, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ("tool_choice without tools", {"messages": MSG, "tool_choice": "required"}, "tool_choice", "tools"),
    ("forced call and a format", {"messages": MSG, "tools": TOOLS, "tool_choice": "required",
                                  "response_format": {"type": "json_object"}}, "tool_choice", "forced"),
    ("tool message without its call id", {"messages": MSG + [{"role": "tool", "content": "1"}]},
     "messages", "tool_call_id"),
]


@pytest.mark.parametrize("name,body,param,words", BAD, ids=[b[0] for b in BAD])
def test_bad_constraints_answer_400(server, name, body, param, words):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(server["base"] + path, json={"model": MODEL, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_bad_grammar_does_not_harm_other_requests(server, client):
    """A stream runs while a request with a grammar that cannot compile is refused: the
    stream completes, the server stays healthy and idle afterwards."""
    import threading
    results = {}

    def good():
        stream = client.completions.create(model=MODEL, prompt="Go:", max_tokens=40, stream=True,
                                           extra_body={"ignore_eos": True})
        results["good"] = sum(len(c.choices[0].text) > 0 for c in stream)

    t = threading.Thread(target=good)
    t.start()
    for _ in range(3):
        r = httpx.post(server["base"] + "/v1/completions", json={
            "model": MODEL, "prompt": "x", "structured_outputs": {
                "grammar": 'start: "b" <|no_such_token|>'}}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
    t.join(120)
    assert results["good"] > 0
    assert httpx.get(server["base"] + "/health").status_code == 200
