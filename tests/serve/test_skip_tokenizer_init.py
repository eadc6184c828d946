"""skip_tokenizer_init: a checkpoint without tokenizer files serves token ids in and out,
through the Python API and the server; whatever needs text is refused by name."""
import argparse

import httpx
import pytest

from conftest import SMALL_ENGINE, make_tiny_checkpoint
from server_util import SERVER_ENGINE, start_server, stop

from jaxllm.config import EngineConfig
from jaxllm.sampling_params import SamplingParams, StructuredOutputsParams

PROMPT = [1, 422, 1159, 314, 253]


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """tiny_llama's weights (the same seed and variant), without its tokenizer files."""
    d = tmp_path_factory.mktemp("bare_llama")
    make_tiny_checkpoint(d, "llama3")
    return str(d)


@pytest.fixture(scope="module")
def bare_llm(bare):
    from jaxllm import LLM
    return LLM(bare, dtype="float32", skip_tokenizer_init=True, **SMALL_ENGINE)


def test_config_and_flags():
    from jaxllm.cli import add_engine_args, engine_config_from_args
    with pytest.raises(ValueError, match="tokenizer and skip_tokenizer_init"):
        EngineConfig(tokenizer="x", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="skip_tokenizer_init must be a bool"):
        EngineConfig(skip_tokenizer_init="yes")
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--skip-tokenizer-init"])).skip_tokenizer_init
    assert not engine_config_from_args(p.parse_args([])).skip_tokenizer_init
    with pytest.raises(ValueError, match="stop strings need detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_without_the_flag_the_missing_tokenizer_is_named(bare):
    from jaxllm import LLM
    with pytest.raises(ValueError, match="(?s)cannot load the tokenizer.*skip_tokenizer_init"):
        LLM(bare, dtype="float32", **SMALL_ENGINE)


def test_token_ids_in_and_out(bare_llm, tiny_llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    (out,) = bare_llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    (ref,) = tiny_llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    c = out.outputs[0]
    assert c.text == "" and out.prompt is None and out.prompt_token_ids == PROMPT
    # the same weights with a tokenizer: the same tokens, the same logprobs, no text
    assert list(c.token_ids) == list(ref.outputs[0].token_ids) and len(c.token_ids) == 6
    assert all(e[t].decoded_token is None for t, e in zip(c.token_ids, c.logprobs))
    assert [e[t].logprob for t, e in zip(c.token_ids, c.logprobs)] == pytest.approx(
        [e[t].logprob for t, e in zip(c.token_ids, ref.outputs[0].logprobs)], abs=1e-4)
    (plain,) = bare_llm.generate([PROMPT], SamplingParams(max_tokens=2, stop_token_ids=[5]),
                                 use_tqdm=False)
    assert len(plain.outputs[0].token_ids) >= 1


@pytest.mark.parametrize("prompt,params,message", [
    ("Hello", SamplingParams(max_tokens=2), "prompt is text, but this engine has no tokenizer"),
    ({"prompt": "Hello"}, SamplingParams(max_tokens=2), "prompt is text"),
    (PROMPT, SamplingParams(max_tokens=2, stop=["."]), "stop strings need a tokenizer"),
    (PROMPT, SamplingParams(max_tokens=2, bad_words=["x"]), "bad_words needs a tokenizer"),
    (PROMPT, SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+")),
     "structured_outputs needs a tokenizer"),
])
def test_what_needs_text_is_refused(bare_llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        bare_llm.generate(prompt, params, use_tqdm=False)


def test_chat_is_refused(bare_llm):
    with pytest.raises(ValueError, match="messages: chat needs a tokenizer"):
        bare_llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)


def test_server(bare, tmp_path):
    proc, base, _ = start_server([bare, "--skip-tokenizer-init", *SERVER_ENGINE], tmp_path / "log")
    try:
        def post(path, body):
            return httpx.post(base + path, json=body, timeout=120)

        r = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                     "ignore_eos": True, "return_token_ids": True, "logprobs": 1})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["text"] == "" and c["prompt_token_ids"] == PROMPT and len(c["token_ids"]) == 3
        assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
        stream = httpx.post(base + "/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}, timeout=120).text
        assert '"token_ids"' in stream and "[DONE]" in stream
        for path, body, param in (
                ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}, "prompt"),
                ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stop": ["."]}, "stop"),
                ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2,
                                     "response_format": {"type": "json_object"}}, "response_format"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
                ("/tokenize", {"prompt": "hi"}, "prompt"),
                ("/detokenize", {"tokens": PROMPT}, "tokens")):
            r = post(path, body)
            assert r.status_code == 400, (path, body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and "tokenizer" in err["message"], err
    finally:
        stop(proc)
