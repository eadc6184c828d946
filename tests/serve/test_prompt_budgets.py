"""Prompt budgets through the official client on a real server: truncate_prompt_tokens keeps a
prompt's last k tokens (completions and chat, as vLLM), and a chat longer than its budget
loses its oldest turns (--chat-context-policy trim, --max-prompt-tokens, a request's
context_budget), saying so in usage and a header; what is kept answers as if sent alone."""
import httpx
import openai
import pytest

from server_util import SERVER_ENGINE, start_server, stop

MODEL = "tiny"
BUDGET = 160
GREEDY = dict(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("budget_server") / "server.log"
    proc, base, _ = start_server([tiny_llama, "--served-model-name", MODEL, *SERVER_ENGINE,
                                  "--chat-context-policy", "trim", "--max-prompt-tokens",
                                  str(BUDGET)], log)
    yield base
    stop(proc)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def tokenize(base, **body) -> list[int]:
    r = httpx.post(base + "/tokenize", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def conversation(turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You answer in one word."}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Question {i}: " + "tell me about the sea " * 3})
        msgs.append({"role": "assistant", "content": f"Answer {i}: " + "waves and salt " * 3})
    msgs.append({"role": "user", "content": "And the sky?"})
    return msgs


def test_truncate_prompt_tokens_keeps_the_last_k(server, client):
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    ids = tokenize(server, prompt=prompt)
    k = 5
    got = client.completions.create(model=MODEL, prompt=prompt, extra_body={"truncate_prompt_tokens": k},
                                    **GREEDY)
    want = client.completions.create(model=MODEL, prompt=ids[-k:], **GREEDY)
    assert got.usage.prompt_tokens == k
    assert got.choices[0].text == want.choices[0].text
    # -1: the model's length, which this prompt is within
    whole = client.completions.create(model=MODEL, prompt=prompt, extra_body={"truncate_prompt_tokens": -1},
                                      **GREEDY)
    assert whole.usage.prompt_tokens == len(ids)
    # echo gives back the text of the tokens kept
    echo = client.completions.create(model=MODEL, prompt=prompt, echo=True,
                                     extra_body={"truncate_prompt_tokens": k}, **GREEDY)
    assert echo.choices[0].text.startswith(client.completions.create(
        model=MODEL, prompt=ids[-k:], echo=True, **GREEDY).choices[0].text[:10])
    # chat: the rendered conversation's last k tokens
    msgs = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs,
                                          extra_body={"truncate_prompt_tokens": k}, **GREEDY)
    assert chat.usage.prompt_tokens == k


def test_a_long_chat_loses_its_oldest_turns(server, client):
    msgs = conversation(12)
    full = len(tokenize(server, messages=msgs, add_generation_prompt=True))
    assert full > BUDGET
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, **GREEDY)
    got = raw.parse()
    dropped = int(raw.headers["x-jaxllm-trimmed-messages"])
    usage = got.usage.model_dump()
    assert dropped > 0 and dropped % 2 == 0  # whole turns: a question and its answer
    assert usage["trimmed_messages"] == dropped
    assert got.usage.prompt_tokens <= BUDGET
    assert usage["trimmed_prompt_tokens"] == full - got.usage.prompt_tokens
    # what was kept (the system message, then the newest turns) answers as if sent alone
    kept = msgs[:1] + msgs[1 + dropped:]
    alone = client.chat.completions.create(model=MODEL, messages=kept, **GREEDY)
    assert alone.usage.prompt_tokens == got.usage.prompt_tokens
    assert alone.choices[0].message.content == got.choices[0].message.content
    # the same history is trimmed the same way: its prefix is cached
    again = client.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
    assert again.usage.prompt_tokens == got.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    # a request's own budget, smaller than the server's
    small = client.chat.completions.create(model=MODEL, messages=msgs,
                                           extra_body={"context_budget": 60}, **GREEDY)
    assert small.usage.prompt_tokens <= 60 < got.usage.prompt_tokens
    text = httpx.get(server + "/metrics").text
    assert f'jaxllm:request_prompts_trimmed_total{{model_name="{MODEL}"}} 3.0' in text


def test_a_trimmed_stream_reports_in_its_usage(server, client):
    with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=conversation(12), stream=True,
            stream_options={"include_usage": True}, **GREEDY) as resp:
        dropped = int(resp.headers["x-jaxllm-trimmed-messages"])
        chunks = list(resp.parse())
    usage = chunks[-1].usage.model_dump()
    assert dropped > 0 and usage["trimmed_messages"] == dropped
    assert usage["prompt_tokens"] <= BUDGET


def test_what_must_be_kept_and_does_not_fit_is_a_400(server, client):
    msgs = conversation(2)
    msgs[-1]["content"] = "sky " * 300  # the latest user turn alone is over the budget
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msgs, **GREEDY)
    err = e.value.body
    assert err["param"] == "messages" and err["code"] == "context_length_exceeded"
    assert str(BUDGET) in err["message"]
    # a conversation within the budget is untouched
    short = client.chat.completions.with_raw_response.create(model=MODEL, messages=conversation(1),
                                                             **GREEDY)
    assert short.headers["x-jaxllm-trimmed-messages"] == "0"
    assert short.parse().usage.model_dump()["trimmed_messages"] == 0


def test_a_growing_chat_keeps_its_cut_and_its_cache(server, client):
    """A chat replayed turn by turn past its budget: the cut stays put for several turns at a
    time (--chat-trim-step), and while it does each turn's prompt is served from the cache up
    to the previous turn's."""
    msgs = [{"role": "system", "content": "You answer in one word."}]
    seen = []  # (messages dropped, prompt tokens, cached tokens) per turn
    for i in range(24):
        msgs.append({"role": "user", "content": f"Q{i}: the sea?"})
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, **GREEDY)
        got = raw.parse()
        seen.append((int(raw.headers["x-jaxllm-trimmed-messages"]), got.usage.prompt_tokens,
                     got.usage.prompt_tokens_details.cached_tokens))
        assert got.usage.prompt_tokens <= BUDGET
        msgs.append({"role": "assistant", "content": f"A{i}: waves."})
    trimmed = [s for s in seen if s[0]]
    assert trimmed and max(s[0] for s in trimmed) > min(s[0] for s in trimmed)  # it moved
    block = 16
    kept_with_cache = [b for a, b in zip(seen, seen[1:])
                       if a[0] and b[0] == a[0] and b[2] >= a[1] - block]
    assert len(kept_with_cache) >= 3, seen
