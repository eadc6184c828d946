"""The server for real: a uvicorn process on 127.0.0.1 driven by the official openai client.

Tests run in file order against one server; the last one sends SIGTERM and checks the drain.
"""
import asyncio
import json
import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_util import SERVER_ENGINE, start_server, stop

KEY = "test-key"
MODEL = "tiny"
# the same engine shape in every server test: compiled once per run (shared compilation cache)


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc, base, seen_loading = start_server(
        [tiny_llama, "--served-model-name", MODEL, "--api-key", KEY, *SERVER_ENGINE,
         "--max-queue-len", "100", "--shutdown-timeout", "60", "--log-interval", "2"], log)
    yield {"base": base, "proc": proc, "log": log, "seen_loading": seen_loading}
    stop(proc)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture()
def aclient(server):
    return openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0)


def metrics(server) -> dict:
    text = httpx.get(server["base"] + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, 0.0)
            out[s.name] += s.value
    return out


def wait_idle(server, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = metrics(server)
        if (m.get("jaxllm:num_requests_running", 1) == 0 and m.get("jaxllm:num_requests_waiting", 1) == 0
                and m.get("jaxllm:kv_cache_usage_perc", 1) == 0):
            return m
        time.sleep(0.2)
    raise AssertionError(f"server not idle: {m}")


def test_health_ready_models_version(server, client):
    assert server["seen_loading"]  # /health/ready said 503 while the model loaded
    assert httpx.get(server["base"] + "/health").status_code == 200
    assert httpx.get(server["base"] + "/health/ready").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server["base"] + "/version").json()["version"]
    # serve is ready before every step shape is compiled (compile_in_background)
    assert "compile in the background" in server["log"].read_text()


def test_completion_and_usage(server, client):
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.finish_reason == "length" and c.index == 0 and c.text
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    tok = httpx.post(server["base"] + "/tokenize", json={"prompt": "Hello there"}).json()
    assert r.usage.prompt_tokens == tok["count"]


def test_streamed_equals_non_streamed(client):
    kw = dict(model=MODEL, prompt="The sky is", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    ids = {c.id for c in chunks}
    assert len(ids) == 1
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 12


def test_chat_streamed_and_not(client):
    msgs = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_finish_reason_stop_and_length(client):
    kw = dict(model=MODEL, prompt="Count: one two three", temperature=0, max_tokens=16,
              extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    assert len(text) > 4
    stop = text[2:4]
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:text.index(stop)]
    assert client.completions.create(**kw).choices[0].finish_reason == "length"


def test_n_choices_and_token_prompts(client):
    r = client.completions.create(model=MODEL, prompt=["first prompt", "second prompt"], n=3,
                                  max_tokens=5, temperature=1.0, seed=4, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == list(range(6))
    assert r.usage.completion_tokens == 30
    r = client.completions.create(model=MODEL, prompt=[[100, 200, 300], [7, 8]], max_tokens=2,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 2 and r.usage.prompt_tokens == 5
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                       max_tokens=4, temperature=1.0, seed=1)
    assert [c.index for c in r.choices] == [0, 1]


def test_n_streams_end_each_choice_once(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "two ways"}], n=2, max_tokens=6,
        temperature=1.0, seed=2, stream=True, extra_body={"stop_token_ids": [300], "min_tokens": 0}))
    ends = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(ends) == [0, 1]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", n=1, best_of=3, stream=True)
    assert e.value.body["param"] == "best_of"


def test_logprobs_shapes(client):
    r = client.completions.create(model=MODEL, prompt="log probs", max_tokens=4, temperature=0,
                                  logprobs=3, echo=True, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 4 and lp.token_logprobs[0] is None
    assert all(len(t) >= 3 for t in lp.top_logprobs[n_prompt:])
    assert r.choices[0].text.startswith("log probs")
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= 0 for t in content)


def test_beam_search_on_the_server(client):
    r = client.completions.create(model=MODEL, prompt="beams", max_tokens=3, n=2,
                                  extra_body={"use_beam_search": True})
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text != r.choices[1].text


def test_prefix_cache_reported_in_usage(client):
    prompt = "shared system prompt " * 12
    client.completions.create(model=MODEL, prompt=prompt + "a", max_tokens=2)
    r = client.completions.create(model=MODEL, prompt=prompt + "b", max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16


def test_tokenize_detokenize(server):
    base = server["base"]
    toks = httpx.post(base + "/tokenize", json={"prompt": "round trip"}).json()["tokens"]
    assert httpx.post(base + "/detokenize", json={"tokens": toks}).json()["prompt"].endswith("round trip")
    chat = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2


def test_concurrent_streams_all_complete(aclient):
    async def one(i):
        stream = await aclient.completions.create(model=MODEL, prompt=f"stream {i}", max_tokens=16,
                                                  temperature=0.5, seed=i, stream=True,
                                                  extra_body={"ignore_eos": True})
        n, reason = 0, None
        async for chunk in stream:
            n += 1
            reason = chunk.choices[0].finish_reason or reason
        return reason

    async def main():
        return await asyncio.gather(*(one(i) for i in range(64)))

    assert asyncio.run(main()) == ["length"] * 64


def test_cancelled_streams_free_everything(server, aclient, client):
    async def one(i):
        stream = await aclient.completions.create(model=MODEL, prompt=f"cancel me {i}", max_tokens=200,
                                                  stream=True, extra_body={"ignore_eos": True})
        got = 0
        async for _ in stream:
            got += 1
            if got == 2:
                break
        await stream.close()
        return got

    async def main():
        return await asyncio.gather(*(one(i) for i in range(50)))

    assert asyncio.run(main()) == [2] * 50
    wait_idle(server)
    r = client.completions.create(model=MODEL, prompt="after the storm", max_tokens=4)
    assert r.choices[0].text is not None and r.usage.completion_tokens >= 1


def test_cancelled_non_streamed_request_is_aborted(server):
    before = metrics(server)["jaxllm:generation_tokens_total"]

    async def main():
        async with httpx.AsyncClient() as c:
            task = asyncio.create_task(c.post(
                server["base"] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                json={"model": MODEL, "prompt": "long", "max_tokens": 250, "ignore_eos": True}))
            while metrics(server)["jaxllm:num_requests_running"] < 1:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    after = wait_idle(server)["jaxllm:generation_tokens_total"]
    assert after - before < 250  # aborted part way, not run to the end


def _status(resp):
    return resp.status_code, resp.json()["error"]


def test_bad_inputs_answer_openai_errors(server, client):
    base, auth = server["base"], {"Authorization": f"Bearer {KEY}"}
    cases = [
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
        ({"model": MODEL, "prompt": "x", "top_p": 2}, 400, "top_p"),
        ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 300}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
        ({"model": "other-model", "prompt": "x"}, 404, "model"),
    ]
    for body, status, param in cases:
        code, err = _status(httpx.post(base + "/v1/completions", json=body, headers=auth))
        assert code == status, (body, err)
        assert err["param"] == param and err["message"] and "type" in err and "code" in err
    code, err = _status(httpx.post(base + "/v1/completions", content=b"{not json", headers={
        **auth, "Content-Type": "application/json"}))
    assert code == 400
    code, err = _status(httpx.post(base + "/v1/completions", content=b"prompt=x", headers={
        **auth, "Content-Type": "application/x-www-form-urlencoded"}))
    assert code == 400
    code, err = _status(httpx.post(base + "/v1/chat/completions", json={"model": MODEL, "messages": []},
                                   headers=auth))
    assert code == 400 and err["param"] == "messages"
    # the key: missing, wrong, right
    assert httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
    bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # non-/v1 routes stay open for probes
    assert httpx.get(base + "/health").status_code == 200
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1000)
    assert e.value.status_code == 400
    # still healthy and serving
    assert httpx.get(base + "/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=2).choices


def test_queue_full_answers_429(server, client):
    async def main():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=400)) as c:
            async def one(i):
                return await c.post(server["base"] + "/v1/completions",
                                    headers={"Authorization": f"Bearer {KEY}"},
                                    json={"model": MODEL, "prompt": f"flood {i}", "max_tokens": 200,
                                          "ignore_eos": True})
            tasks = [asyncio.create_task(one(i)) for i in range(250)]
            # long requests keep the queue full; the refused ones come back at once
            done, pending = await asyncio.wait(tasks, timeout=15)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            return [t.result() for t in done]

    results = asyncio.run(main())
    codes = [r.status_code for r in results]
    assert 429 in codes and set(codes) <= {200, 429}
    limited = next(r for r in results if r.status_code == 429)
    assert limited.headers.get("retry-after") and limited.json()["error"]["type"] == "rate_limit_error"
    assert metrics(server)["jaxllm:request_admission_rejections_total"] == codes.count(429)
    wait_idle(server)
    assert client.completions.create(model=MODEL, prompt="calm again", max_tokens=2).choices


def test_metrics_exposition(server, client):
    for _ in client.completions.create(model=MODEL, prompt="a stream", max_tokens=4, stream=True):
        pass  # its outputs' gaps are inter-token latencies
    wait_idle(server)
    m = metrics(server)
    for name in ["jaxllm:num_requests_running", "jaxllm:num_requests_waiting",
                 "jaxllm:kv_cache_usage_perc", "jaxllm:prompt_tokens_total",
                 "jaxllm:generation_tokens_total", "jaxllm:num_preemptions_total",
                 "jaxllm:request_success_total", "jaxllm:prefix_cache_queries_total",
                 "jaxllm:prefix_cache_hits_total", "jaxllm:time_to_first_token_seconds_count",
                 "jaxllm:time_per_output_token_seconds_count", "jaxllm:e2e_request_latency_seconds_count",
                 "jaxllm:request_queue_time_seconds_count",
                 "jaxllm:request_prefill_time_seconds_count", "jaxllm:request_decode_time_seconds_count",
                 "jaxllm:inter_token_latency_seconds_count", "jaxllm:request_prefix_cache_queries_total",
                 "jaxllm:request_prefix_cache_hits_total", "jaxllm:num_failed_steps_total",
                 "jaxllm:num_failed_requests_total"]:
        assert name in m, name
    assert m["jaxllm:inter_token_latency_seconds_count"] >= 3
    assert m["jaxllm:request_prefix_cache_queries_total"] >= m["jaxllm:request_prefix_cache_hits_total"]
    assert m["jaxllm:generation_tokens_total"] > 0 and m["jaxllm:request_success_total"] > 0
    assert m["jaxllm:time_to_first_token_seconds_count"] > 0
    log = server["log"].read_text()
    assert "Avg generation throughput" in log and "KV cache usage" in log


def test_sigterm_drains_in_flight_requests(server):
    """Last: SIGTERM while streams are running; they finish, then the process exits 0."""
    proc = server["proc"]
    results = []

    async def one(i, c):
        got = []
        async with c.stream("POST", server["base"] + "/v1/completions",
                            headers={"Authorization": f"Bearer {KEY}"},
                            json={"model": MODEL, "prompt": f"drain {i}", "max_tokens": 40,
                                  "ignore_eos": True, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got.append(json.loads(line[6:])["choices"][0]["finish_reason"])
                if line == "data: [DONE]":
                    got.append("DONE")
        results.append(got)

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            tasks = [asyncio.create_task(one(i, c)) for i in range(6)]
            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            await asyncio.gather(*tasks)

    asyncio.run(main())
    assert proc.wait(timeout=60) == 0
    assert len(results) == 6
    for got in results:
        assert got[-1] == "DONE" and got[-2] == "length"
