"""Bad input and failed starts, for real: every bad request gets an OpenAI 4xx body and the
server keeps serving (nothing leaks); an engine that cannot start makes `jaxllm serve` say why
in one line and exit 1; a dead engine makes /health answer 500."""
import json
import subprocess
import sys
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from server_util import start_server, stop
from server_util import SERVER_ENGINE

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("inputs_server") / "server.log"
    proc, base, _ = start_server([tiny_llama, "--served-model-name", MODEL, *SERVER_ENGINE], log)
    yield {"base": base, "proc": proc, "log": log}
    stop(proc)


def post(base: str, path: str, body=None, raw: bytes | None = None) -> httpx.Response:
    if raw is not None:
        return httpx.post(base + path, content=raw, headers={"Content-Type": "application/json"},
                          timeout=120)
    return httpx.post(base + path, json=body, timeout=120)


def assert_error(resp: httpx.Response, status: int, param: str | None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"] and "code" in err
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_serving(base: str) -> None:
    """Healthy, answering, and back to idle: no request or KV block left behind."""
    assert httpx.get(base + "/health").status_code == 200
    r = post(base, "/v1/completions", {"model": MODEL, "prompt": "still here", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"]
    deadline = time.time() + 60
    while time.time() < deadline:
        text = httpx.get(base + "/metrics").text
        vals = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith(("jaxllm:num_requests_running", "jaxllm:num_requests_waiting",
                                    "jaxllm:kv_cache_usage_perc"))}
        if vals and all(v == 0 for v in vals.values()):
            return
        time.sleep(0.2)
    raise AssertionError(f"not idle: {vals}")


CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
HUGE = 2 ** 70

BAD_INPUTS = [
    # token ids outside the vocabulary (they reached the tokenizer's decode: 500 OverflowError)
    ("negative token id", CMPL, {"prompt": [1, -5, 3]}, 400, "prompt"),
    ("out-of-vocabulary token id", CMPL, {"prompt": [1, 10**9]}, 400, "prompt"),
    ("huge token id", CMPL, {"prompt": [HUGE]}, 400, "prompt"),
    ("ids in a batch of prompts", CMPL, {"prompt": [[1, 2], [-1]]}, 400, "prompt"),
    ("ids to detokenize", "/detokenize", {"tokens": [HUGE]}, 400, "tokens"),
    # non-finite numbers: JSON literals and strings
    ("temperature NaN string", CMPL, {"prompt": "x", "temperature": "NaN"}, 400, "temperature"),
    ("top_p Infinity string", CHAT, {"messages": MSG, "top_p": "Infinity"}, 400, "top_p"),
    ("logit_bias -inf", CMPL, {"prompt": "x", "logit_bias": {"5": "-Infinity"}}, 400, None),
    ("stream_options without stream", CHAT,
     {"messages": MSG, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("n beyond the cap", CMPL, {"prompt": "x", "n": 10000}, 400, "n"),
    ("best_of beyond the cap", CMPL, {"prompt": "x", "best_of": 10000}, 400, "best_of"),
    ("top_logprobs without logprobs", CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs above 20", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs"),
    ("logprobs above 20", CMPL, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    # tool_choice "auto" (the default with tools) needs a tool-call parser, which this server
    # was not given
    ("tools without a parser", CHAT,
     {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ("tool_choice without tools", CHAT, {"messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),
    ("bad response_format", CHAT, {"messages": MSG, "response_format": {"type": "yaml"}}, 400,
     "response_format.type"),
    ("unsupported schema keyword", CMPL, {"prompt": "x", "structured_outputs": {
        "json": {"type": "object", "propertyNames": {"pattern": "^a"}}}}, 400, "structured_outputs"),
    # known fields not implemented: refused by name, never ignored
    ("functions", CHAT, {"messages": MSG, "functions": [{"name": "f"}]}, 400, "functions"),
    ("truncate_prompt_tokens 0", CMPL, {"prompt": "x", "truncate_prompt_tokens": 0}, 400,
     "truncate_prompt_tokens"),
    ("truncate_prompt_tokens past the model's length", CHAT,
     {"messages": MSG, "truncate_prompt_tokens": 1000}, 400, "truncate_prompt_tokens"),
    ("context_budget 0", CHAT, {"messages": MSG, "context_budget": 0}, 400, "context_budget"),
    ("guided_json", CMPL, {"prompt": "x", "guided_json": {"type": "object"}}, 400, "guided_json"),
    ("guided_choice", CHAT, {"messages": MSG, "guided_choice": ["a", "b"]}, 400, "guided_choice"),
    ("lora_request", CMPL, {"prompt": "x", "lora_request": {"lora_name": "a"}}, 400, "lora_request"),
    # as OpenAI: only an assistant's message (one calling tools) may have null content
    ("null user content", CHAT, {"messages": [{"role": "user", "content": None}]}, 400,
     "messages.0.content"),
    ("null system content", CHAT, {"messages": [{"role": "system", "content": None}] + MSG}, 400,
     "messages.0.content"),
    ("an image to a text-only model", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400, "messages"),
    ("tool result without its call", CHAT,
     {"messages": MSG + [{"role": "tool", "content": "42"}]}, 400, "messages"),
    ("beam search with a constraint", CMPL,
     {"prompt": "x", "use_beam_search": True, "structured_outputs": {"regex": "a+"}}, 400,
     "structured_outputs"),
    # beam search: what it cannot honour is refused
    ("beam search with stop", CMPL, {"prompt": "x", "use_beam_search": True, "stop": ["a"]}, 400, "stop"),
    ("beam search with seed", CMPL, {"prompt": "x", "use_beam_search": True, "seed": 3}, 400, "seed"),
    ("beam search with logprobs", CHAT, {"messages": MSG, "use_beam_search": True, "logprobs": True},
     400, "logprobs"),
    ("beam search with a penalty", CMPL,
     {"prompt": "x", "use_beam_search": True, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("beam search with logit_bias", CMPL,
     {"prompt": "x", "use_beam_search": True, "logit_bias": {"5": 1}}, 400, "logit_bias"),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_a_4xx(server, name, path, body, status, param):
    if path != "/detokenize":
        body = {"model": MODEL, **body}
    assert_error(post(server["base"], path, body), status, param)


RAW_INPUTS = [
    # a lone UTF-16 surrogate is valid JSON but no text (the tokenizer raised TypeError: 500)
    ("lone surrogate prompt", CMPL, b'{"prompt": "a \\ud800 b"}', "prompt"),
    ("lone surrogate in a message", CHAT,
     b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
    ("lone surrogate to tokenize", "/tokenize", b'{"prompt": "\\ud83d"}', "prompt"),
    # nesting beyond Python's recursion limit (json.loads raised RecursionError: 500) and
    # beyond what any request needs
    ("deep nesting", CMPL, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
    ("nesting past the limit", CMPL, b'{"prompt": "x", "stop": ' + b"[" * 40 + b"]" * 40 + b"}", "stop"),
    ("NaN literal", CMPL, b'{"prompt": "x", "temperature": NaN}', "temperature"),
    ("Infinity literal", CMPL, b'{"prompt": "x", "frequency_penalty": -Infinity}', "frequency_penalty"),
]


@pytest.mark.parametrize("name,path,raw,param", RAW_INPUTS, ids=[c[0] for c in RAW_INPUTS])
def test_malformed_body_gets_a_400(server, name, path, raw, param):
    assert_error(post(server["base"], path, raw=raw), 400, param)


def test_unknown_fields_are_accepted_and_named_once(server):
    base = server["base"]
    for _ in range(2):
        r = post(base, CMPL, {"model": MODEL, "prompt": "x", "max_tokens": 2,
                              "frobnicate_level": 3, "metadata": {"a": "b"}})
        assert r.status_code == 200
    r = post(base, CHAT, {"model": MODEL, "max_tokens": 2,
                          "messages": [{"role": "user", "content": "x", "sparkle": 1}]})
    assert r.status_code == 200
    deadline = time.time() + 10
    while "messages.sparkle" not in server["log"].read_text() and time.time() < deadline:
        time.sleep(0.1)
    log = server["log"].read_text()
    warnings = [line for line in log.splitlines() if "request fields ignored" in line]
    assert sum("frobnicate_level" in w for w in warnings) == 1
    assert any("metadata" in w for w in warnings) and any("messages.sparkle" in w for w in warnings)
    # the known-but-unimplemented ones are refused, not warned about
    assert not any("tools" in w for w in warnings)


def test_openapi_document(server):
    doc = httpx.get(server["base"] + "/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    for path in (CMPL, CHAT, "/tokenize", "/detokenize"):
        assert "requestBody" in doc["paths"][path]["post"]
    schemas = doc["components"]["schemas"]
    assert schemas["CompletionRequest"]["properties"]["n"]["maximum"] == 128


# --- fuzzing: request bodies drawn from the published OpenAPI document ------------------------

JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.sampled_from([-HUGE, -1, 0, 1, 2, HUGE]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(st.characters(codec="utf-8") | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
            max_size=12))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
# generation length and the number of choices stay small so that requests that are valid
# finish quickly; everything else is drawn from the schema or is any JSON at all
SMALL = {"n": st.sampled_from([-1, 0, 1, 2, 3, 129]), "best_of": st.sampled_from([None, 0, 1, 3, 200]),
         "max_tokens": st.sampled_from([None, -1, 0, 1, 4, 16, 10**6]),
         "max_completion_tokens": st.sampled_from([None, 0, 3, 10**6])}


def body_strategy(doc: dict, model: str):
    """A body valid by the schema (with a few optional fields), then up to two fields replaced
    by any JSON at all (or a not-implemented or unknown field added): both the engine's own
    checks and the parsing are exercised."""
    from hypothesis_jsonschema import from_schema
    from serve.protocol import NOT_IMPLEMENTED

    schema = doc["components"]["schemas"][model]
    valid = {name: SMALL[name] if name in SMALL else from_schema({**prop, "components": doc["components"]})
             for name, prop in schema["properties"].items()}
    required = {n: valid.pop(n) for n in schema.get("required", [])}
    names = sorted(schema["properties"]) + sorted(NOT_IMPLEMENTED) + ["some_unknown_field"]

    @st.composite
    def body(draw):
        out = draw(st.fixed_dictionaries(required))
        for name in draw(st.lists(st.sampled_from(sorted(valid)), max_size=5, unique=True)):
            out[name] = draw(valid[name])
        for name in draw(st.lists(st.sampled_from(names), max_size=2, unique=True)):
            out[name] = draw(JSON_VALUES)
        return out

    return body()


@pytest.mark.slow
def test_fuzzed_requests_never_answer_500(server):
    base = server["base"]
    doc = httpx.get(base + "/openapi.json").json()
    seen = {}

    for path, model in ((CMPL, "CompletionRequest"), (CHAT, "ChatCompletionRequest"),
                        ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        @settings(max_examples=40, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(body=body_strategy(doc, model))
        def one(body):
            if path in (CMPL, CHAT):
                body = {**body, "model": MODEL}
            raw = json.dumps(body).encode()  # NaN and Infinity go out as literals
            with httpx.stream("POST", base + path, content=raw, timeout=300,
                              headers={"Content-Type": "application/json"}) as r:
                payload = r.read()
            assert r.status_code < 500, (body, payload[:500])
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            if r.status_code >= 400:
                err = json.loads(payload)["error"]
                assert err["message"] and err["type"], payload
            elif body.get("stream") is True:
                assert payload.rstrip().endswith(b"data: [DONE]"), payload[-300:]

        one()
    print("status codes drawn:", seen)
    assert seen.get(200) and any(400 <= s < 500 for s in seen), seen  # both kinds were drawn
    assert_serving(base)


# --- an engine that cannot start, and one that dies ------------------------------------------

def _serve_args(tmp_path, tiny_llama):
    unsupported = tmp_path / "gpt2"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    return {
        "missing model path": (["/nonexistent/model"], "model path"),
        "unsupported architecture": ([str(unsupported)], "unsupported architecture"),
        "KV cache smaller than max_model_len": (
            [tiny_llama, "--num-gpu-blocks-override", "4", "--max-model-len", "256"],
            "fewer than max_model_len"),
        "out of memory": ([tiny_llama, "--kv-cache-memory-bytes", str(10**15)], "memory"),
    }


def test_engine_that_cannot_start_exits_1_with_the_reason(tmp_path, tiny_llama):
    from server_util import free_port
    cases = _serve_args(tmp_path, tiny_llama)
    procs = {}
    for name, (args, _) in cases.items():
        log = tmp_path / f"{len(procs)}.log"
        procs[name] = (subprocess.Popen(
            [sys.executable, "-m", "jaxllm.cli", "serve", *args, "--port", str(free_port())],
            stdout=open(log, "w"), stderr=subprocess.STDOUT), log, time.time())
    for name, (proc, log, start) in procs.items():
        assert proc.wait(timeout=240) == 1, (name, log.read_text()[-2000:])
        text = log.read_text()
        lines = [line for line in text.splitlines() if "engine failed to start:" in line]
        assert len(lines) == 1 and cases[name][1] in lines[0], (name, text[-2000:])


def test_failed_steps_answer_500_until_too_many_stop_the_server(tmp_path, tiny_llama):
    """Every step fails on purpose: each request's answer is a 500 naming the failure (a
    stream's an error event), the server keeps answering, and the third failed step stops
    it with exit status 1."""
    proc, base, _ = start_server([tiny_llama, "--served-model-name", MODEL, *SERVER_ENGINE,
                                  "--inject-step-faults", "1", "--max-step-failures", "3"],
                                 tmp_path / "server.log")
    try:
        r = post(base, CMPL, {"model": MODEL, "prompt": "x", "max_tokens": 3})
        err = assert_error(r, 500, None)
        assert err["code"] == "step_failed" and "injected step fault" in err["message"]
        assert httpx.get(base + "/health").status_code == 200  # one failure: still serving
        deadline = time.time() + 10  # the counters follow the step's end
        while f'jaxllm:num_failed_steps_total{{model_name="{MODEL}"}} 1.0' not in (
                text := httpx.get(base + "/metrics").text):
            assert time.time() < deadline, text
            time.sleep(0.05)
        assert f'jaxllm:request_success_total{{finished_reason="error",model_name="{MODEL}"}} 1.0' in text
        with httpx.stream("POST", base + CHAT, json={"model": MODEL, "messages": MSG, "stream": True},
                          timeout=120) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-2][6:])["error"]["code"] == "step_failed"
        assert events[-1] == "data: [DONE]"
        r = post(base, CMPL, {"model": MODEL, "prompt": "x", "max_tokens": 3})
        assert r.status_code in (500, 503), r.text
        assert proc.wait(timeout=60) == 1
        assert "3 failed steps within" in (tmp_path / "server.log").read_text()
    finally:
        stop(proc)


def test_cli_generate_says_why_in_one_line():
    r = subprocess.run([sys.executable, "-m", "jaxllm.cli", "generate", "hi", "--model",
                        "/nonexistent/model"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("jaxllm generate: error: model path")


def test_dead_engine_health_500_and_fatal_callback(tiny_llama):
    """In process: the engine loop dies; requests fail (not hang), /health says 500, and the
    server's fatal hook fires (`jaxllm serve` then exits 1)."""
    from starlette.testclient import TestClient

    from jaxllm.config import EngineConfig
    from serve.app import OpenAIServer, ServerConfig

    fatal = []
    from conftest import SMALL_ENGINE
    srv = OpenAIServer(EngineConfig(model=tiny_llama, **SMALL_ENGINE),
                       ServerConfig(MODEL), on_fatal=lambda: fatal.append(True))
    with TestClient(srv.app()) as client:
        deadline = time.time() + 240
        while client.get("/health/ready").status_code != 200:
            assert time.time() < deadline
            time.sleep(0.1)

        def boom():
            raise RuntimeError("device lost")
        srv.engine.engine.step = boom
        r = client.post(CMPL, json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert client.get("/health").status_code == 500
        deadline = time.time() + 10
        while not fatal and time.time() < deadline:
            time.sleep(0.05)
        assert fatal
