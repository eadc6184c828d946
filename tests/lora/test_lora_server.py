"""LoRA on the real server (uvicorn on loopback, the official openai client): adapters from
--lora-modules listed in /v1/models with their parent and picked by `model`; adapters
loaded and unloaded at run time (JAXLLM_ALLOW_RUNTIME_LORA_UPDATING) while another request
streams; refusals as 4xx; a bad adapter at start-up stops the server with its reason."""
import asyncio
import json
import subprocess
import sys

import httpx
import openai
import pytest

from server_util import free_port, start_server, stop
from lora_util import hf_greedy, make_adapter

MODEL = "tiny"
# the engine of test_lora.py's lora_llm: its programs come from the shared compilation cache
ENGINE = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
          "--token-buckets", "16,64", "--seq-buckets", "4,8",
          "--enable-lora", "--max-loras", "3", "--max-lora-rank", "16"]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("server_adapters")
    made = {}
    for i, (name, kw) in enumerate({
            "ad0": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
            "ad1": dict(r=4, lora_alpha=4, target_modules=["o_proj", "up_proj"]),
            "ad2": dict(r=16, lora_alpha=8, target_modules="all-linear"),
            "big": dict(r=32, lora_alpha=32, target_modules=["q_proj"])}.items()):
        made[name] = (str(d / name), make_adapter(d / name, tiny_llama, seed=20 + i, **kw))
    return made


@pytest.fixture(scope="module")
def server(tiny_llama, adapters, tmp_path_factory):
    log = tmp_path_factory.mktemp("lora_server") / "server.log"
    ad1 = json.dumps({"name": "ad1", "path": adapters["ad1"][0], "base_model_name": "custom-parent"})
    proc, base, _ = start_server(
        [tiny_llama, "--served-model-name", MODEL, *ENGINE,
         "--lora-modules", f"ad0={adapters['ad0'][0]}", ad1], log,
        env={"JAXLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    yield {"base": base, "proc": proc, "log": log}
    stop(proc)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="x", max_retries=0)


PROMPT = [int(t) for t in range(300, 330)]


def test_models_lists_adapters_with_parent(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL, "ad0", "ad1"}
    assert models["ad0"].model_extra["parent"] == MODEL
    assert models["ad1"].model_extra["parent"] == "custom-parent"
    assert models[MODEL].model_extra["parent"] is None


def test_model_picks_the_adapter(client, adapters, tiny_llama):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    texts = {}
    for name in (MODEL, "ad0", "ad1"):
        r = client.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.model == name
        texts[name] = r.choices[0].text
    for name in ("ad0", "ad1"):
        assert texts[name] == tok.decode(hf_greedy(adapters[name][1], PROMPT, 6), skip_special_tokens=True)
        assert texts[name] != texts[MODEL]


def test_load_and_unload_while_another_request_streams(server, client, adapters, tiny_llama):
    base = server["base"]

    async def scenario():
        aclient = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        stream = await aclient.completions.create(model="ad0", prompt=PROMPT, max_tokens=120,
                                                  temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True})
        chunks = []
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            async for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 3:  # the stream runs: change the adapters under it
                    r = await http.post("/v1/load_lora_adapter",
                                        json={"lora_name": "ad2", "lora_path": adapters["ad2"][0]})
                    assert r.status_code == 200, r.text
                    r = await http.post("/v1/load_lora_adapter",
                                        json={"lora_name": "ad2", "lora_path": adapters["ad2"][0]})
                    assert r.status_code == 400 and "already been loaded" in r.text
                    r = await http.post("/v1/load_lora_adapter",
                                        json={"lora_name": "big", "lora_path": adapters["big"][0]})
                    assert r.status_code == 400
                    assert "'big'" in r.text and "rank 32, above max_lora_rank=16" in r.text
                    got = await aclient.completions.create(model="ad2", prompt=PROMPT, max_tokens=4,
                                                           temperature=0)
                    assert got.model == "ad2" and got.usage.completion_tokens == 4
                    r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "ad0"})
                    assert r.status_code == 200, r.text
        return chunks

    chunks = asyncio.run(scenario())
    assert chunks[-1].choices[0].finish_reason == "length"
    # the stream kept its adapter to the end, after it was unloaded
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tok.decode(
        hf_greedy(adapters["ad0"][1], PROMPT, 120), skip_special_tokens=True)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="ad0", prompt=PROMPT, max_tokens=2)
    r = httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": "ad0"})
    assert r.status_code == 404
    assert {m.id for m in client.models.list().data} == {MODEL, "ad1", "ad2"}


def test_lora_metrics(server, client):
    client.completions.create(model="ad1", prompt=PROMPT, max_tokens=3)
    text = httpx.get(server["base"] + "/metrics").text
    # per-request metrics are per adapter (a tenant) and per base model
    for name in ("time_to_first_token_seconds_count", "request_queue_time_seconds_count",
                 "request_prefill_time_seconds_count", "request_decode_time_seconds_count"):
        count = next(line for line in text.splitlines()
                     if line.startswith(f'jaxllm:{name}{{model_name="ad1"}}'))
        assert float(count.rsplit(" ", 1)[1]) >= 1, count
    assert 'jaxllm:request_success_total{finished_reason="length",model_name="ad1"}' in text
    assert 'jaxllm:lora_requests_info{max_lora="3"' in text
    assert 'jaxllm:lora_num_requests_running{lora_name="ad1",model_name="tiny"} 0.0' in text


def test_bad_adapter_at_start_stops_the_server(tiny_llama, adapters, tmp_path):
    log = tmp_path / "bad.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "jaxllm.cli", "serve", tiny_llama, *ENGINE,
                               "--lora-modules", f"ok={adapters['ad0'][0]}",
                               f"big={adapters['big'][0]}", "--port", str(free_port())],
                              stdout=f, stderr=subprocess.STDOUT, timeout=300)
    text = log.read_text()
    assert proc.returncode == 1, text[-2000:]
    assert "engine failed to start: ValueError: LoRA adapter 'big'" in text
    assert "rank 32, above max_lora_rank=16" in text
    proc = subprocess.run([sys.executable, "-m", "jaxllm.cli", "serve", tiny_llama,
                           "--lora-modules", f"ok={adapters['ad0'][0]}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "--lora-modules needs --enable-lora" in proc.stderr
