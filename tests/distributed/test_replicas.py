"""Data-parallel replicas on Ray: `jaxllm serve --data-parallel-size 2` driven by the openai
client (routing, streaming and cancellation, LoRA, structured outputs, metrics, a killed
replica, drain on SIGTERM), and LLM(data_parallel_size=2) offline against one engine.

One server serves the module's server tests (Ray starts once, in it); the offline test joins
a Ray cluster started with `ray start`. Both use the shared compilation cache of the run."""
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import SMALL_ENGINE
from lora_util import make_adapter
from server_util import free_port, metric, start_server, stop, wait_for

pytestmark = pytest.mark.slow

MODEL, ADAPTER = "tiny", "ad0"
ENGINE = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
          "--token-buckets", "16,64", "--seq-buckets", "4,8",
          "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]
# a conversation's shared start: several full KV blocks (16 tokens each)
SYSTEM = ("You are a careful assistant for a small bakery. You answer questions about bread, "
          "pastry, opening hours and orders, briefly and politely, and you never invent prices.")


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("replicas")
    make_adapter(d / ADAPTER, tiny_llama, seed=21, r=8, lora_alpha=16,
                 target_modules=["q_proj", "v_proj"])
    proc, base, _ = start_server([tiny_llama, "--served-model-name", MODEL, *ENGINE,
                                  "--data-parallel-size", "2",
                                  "--lora-modules", f"{ADAPTER}={d / ADAPTER}"],
                                 d / "server.log", timeout=600)
    yield {"proc": proc, "base": base, "log": d / "server.log"}
    stop(proc)


def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def health(base) -> dict:
    return httpx.get(base + "/health", timeout=10).json()


def routed(base, replica) -> float:
    return metric(base, "router_requests_total", replica=str(replica))


def test_health_lists_two_replicas_in_their_own_processes(server):
    h = health(server["base"])
    assert h["status"] == "ok"
    assert [r["replica"] for r in h["replicas"]] == [0, 1]
    assert all(r["state"] == "up" and r["restarts"] == 0 for r in h["replicas"])
    pids = {r["pid"] for r in h["replicas"]}
    assert len(pids) == 2 and server["proc"].pid not in pids


def test_a_conversation_stays_on_the_replica_holding_its_prefix(server):
    base, c = server["base"], client(server["base"])
    before = [routed(base, i) for i in (0, 1)]
    cached = []
    for turn in ("Do you sell rye bread?", "And on Sundays?", "Can I order a cake?"):
        r = c.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": turn}])
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    after = [routed(base, i) for i in (0, 1)]
    grew = [a - b for a, b in zip(after, before)]
    assert sorted(grew) == [0, 3], grew  # all three turns on one replica
    home = grew.index(3)
    assert metric(base, "router_requests_total", replica=str(home), reason="prefix") >= 2
    # the shared system prompt came from that replica's prefix cache
    assert cached[0] == 0 and min(cached[1:]) >= 32


def test_new_conversations_spread_over_the_replicas(server):
    """Concurrent new conversations go to the least loaded replica, so the load spreads."""
    base, c = server["base"], client(server["base"])
    before = [routed(base, i) for i in (0, 1)]

    def ask(k):
        return c.completions.create(model=MODEL, prompt=f"Conversation {k}: " + "word " * (20 + 3 * k),
                                    max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    with ThreadPoolExecutor(6) as pool:
        assert all(r.usage.completion_tokens == 40 for r in pool.map(ask, range(6)))
    grew = [routed(base, i) - b for i, b in zip((0, 1), before)]
    assert sum(grew) == 6 and min(grew) >= 2, grew


def test_streams_on_both_replicas_and_their_cancellation(server):
    """Two streams run on the two replicas; closing them aborts both where they run (they
    stop generating long before max_tokens)."""
    base, c = server["base"], client(server["base"])
    gen_before = metric(base, "generation_tokens_total")
    streams = [c.completions.create(model=MODEL, prompt=f"Stream {k} begins", max_tokens=240,
                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
               for k in range(2)]
    texts = ["".join(next(s).choices[0].text for _ in range(3)) for s in streams]
    assert all(texts)
    wait_for(lambda: all(metric(base, "replica_num_requests_running", replica=str(i)) >= 1
                         for i in (0, 1)), timeout=30, what="a stream on each replica")
    for s in streams:
        s.close()
    wait_for(lambda: all(metric(base, "replica_num_requests_running", replica=str(i)) == 0
                         for i in (0, 1)), timeout=30, what="the replicas to drop the streams")
    time.sleep(1)  # (a request not aborted would go on generating)
    generated = metric(base, "generation_tokens_total") - gen_before
    assert 6 <= generated < 2 * 240 - 40, generated


def test_lora_and_structured_outputs_through_the_replicas(server):
    c = client(server["base"])
    assert {m.id for m in c.models.list().data} == {MODEL, ADAPTER}
    prompt = "The bakery opens at"
    base_out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                    logprobs=1)
    for _ in range(2):  # whichever replica it lands on, the adapter is there
        r = c.completions.create(model=ADAPTER, prompt=prompt, max_tokens=1, temperature=0,
                                 logprobs=1)
        assert r.model == ADAPTER
        assert r.choices[0].logprobs.token_logprobs != base_out.choices[0].logprobs.token_logprobs
    schema = {"type": "object", "properties": {"open": {"type": "boolean"}}, "required": ["open"]}
    r = c.chat.completions.create(model=MODEL, max_tokens=40, temperature=0, messages=[
        {"role": "user", "content": "Is the bakery open?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": schema}})
    assert isinstance(json.loads(r.choices[0].message.content)["open"], bool)
    # an unknown adapter is still the caller's error
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt=prompt, max_tokens=2)


def test_metrics_count_routing_and_hits_per_replica(server):
    base = server["base"]
    for name in ("replica_up", "replica_kv_cache_usage_perc", "router_prompt_tokens_total",
                 "router_cached_tokens_total", "router_expected_cached_tokens_total",
                 "router_pending_prefill_tokens"):
        assert f"jaxllm:{name}" in httpx.get(base + "/metrics").text, name
    assert metric(base, "replica_up") == 2
    # every request so far was answered: no prompt waits for its first token (the gauge is
    # read from the router a few times a second)
    deadline = time.monotonic() + 10
    while metric(base, "router_pending_prefill_tokens") != 0 and time.monotonic() < deadline:
        time.sleep(0.25)
    assert metric(base, "router_pending_prefill_tokens") == 0
    # the totals are the replicas' sums, and the hits come from the conversation above
    assert metric(base, "router_cached_tokens_total") >= 64
    assert metric(base, "prefix_cache_hits_total") >= metric(base, "router_cached_tokens_total")
    assert metric(base, "generation_tokens_total") > 0


def test_a_killed_replica_fails_or_resends_its_requests_and_comes_back(server):
    """Replica 1 is killed while each replica runs one stream and one non-streamed request:
    its stream ends with an error naming the replica, its non-streamed request (nothing
    sent yet) is re-sent and completes, replica 0's are untouched; /health is degraded until
    Ray has restarted replica 1, and no request hangs."""
    base, c = server["base"], client(server["base"])
    victim = health(base)["replicas"][1]["pid"]
    start = sum(routed(base, i) for i in (0, 1))
    results: dict = {}

    started = {0: threading.Event(), 1: threading.Event()}

    def stream(k):
        got, error = [], None
        try:
            for chunk in c.completions.create(model=MODEL, prompt=f"Story {k}:", max_tokens=240,
                                              temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}):
                got.append(chunk.choices[0].text)
                started[k].set()
        except openai.APIError as e:
            error = str(e)
        results[f"stream{k}"] = (len(got), error)

    def whole(k):
        try:
            r = c.completions.create(model=MODEL, prompt=f"Poem {k}:", max_tokens=240,
                                     temperature=0, extra_body={"ignore_eos": True})
            results[f"whole{k}"] = (r.usage.completion_tokens, None)
        except openai.APIError as e:
            results[f"whole{k}"] = (0, str(e))

    threads = []
    # Routed one at a time; the prompts are shorter than a block (cached nowhere), so each
    # goes where the fewest prompt tokens wait for a first token, then where the fewest
    # requests are in flight. A stream's first token comes before the next request is sent:
    # the streams land on the two replicas, then the non-streamed requests do.
    for fn, k in ((stream, 0), (stream, 1), (whole, 0), (whole, 1)):
        threads.append(threading.Thread(target=fn, args=(k,)))
        threads[-1].start()
        wait_for(lambda: sum(routed(base, i) for i in (0, 1)) >= start + len(threads), timeout=30)
        if fn is stream:  # it has sent tokens: the victim's cannot be re-sent
            assert started[k].wait(60)
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: health(base)["status"] == "degraded", timeout=30, every=0.1)
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a request hung"
    failed = [k for k, (_, err) in results.items() if err]
    assert len(failed) == 1 and failed[0].startswith("stream"), results
    assert "replica 1 failed" in results[failed[0]][1] and results[failed[0]][0] >= 1
    assert all(results[k] == (240, None) for k in results if k not in failed), results
    assert metric(base, "replica_failed_requests_total", outcome="resent") >= 1
    assert metric(base, "replica_failed_requests_total", outcome="failed") == 1
    # Ray restarts it; the server says so, and it serves again
    h = wait_for(lambda: (h := health(base))["status"] == "ok" and h, timeout=180, every=0.5,
                 what="the replica to come back")
    assert h["replicas"][1]["restarts"] == 1 and h["replicas"][1]["pid"] != victim
    r = client(base).completions.create(model=ADAPTER, prompt="Back again", max_tokens=4)
    assert r.usage.completion_tokens == 4


def test_sigterm_drains_the_streams_and_stops_the_replicas(server):
    base, proc = server["base"], server["proc"]
    pids = [r["pid"] for r in health(base)["replicas"]]
    s = client(base).completions.create(model=MODEL, prompt="Last story:", max_tokens=60,
                                        temperature=0, stream=True, extra_body={"ignore_eos": True},
                                        stream_options={"include_usage": True})
    next(s)
    proc.send_signal(signal.SIGTERM)
    rest = list(s)
    assert rest[-1].usage.completion_tokens == 60  # the stream ran to its end
    assert proc.wait(timeout=60) == 0
    # the replicas went with it
    wait_for(lambda: not any(_alive(p) for p in pids), timeout=30, what="the replicas to exit")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split(")")[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A Ray cluster started as an operator would (`ray start --head`), for LLM to join;
    stopped with its process group (`ray stop` would stop every cluster on the machine)."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("ray") / "head.log", "w")
    # the cluster's shared secret, as an operator sets it on every node and on the server
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head",
                             f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                             "--disable-usage-stats", "--block"], env={**os.environ, **auth},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def listening():
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0
    wait_for(listening, timeout=120, every=0.2, what="the Ray head")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in auth.items():
            mp.setenv(k, v)
        yield f"127.0.0.1:{port}"
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=5)
    except subprocess.TimeoutExpired:  # (its orderly stop takes half a minute; nothing to keep)
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=30)
    log.close()


def test_offline_replicas_give_one_engines_outputs(peaked_model, ray_cluster):
    """LLM(data_parallel_size=2) on a joined cluster: greedy outputs equal one engine's,
    spread over both replicas; with one replica gone for good, its share runs on the other."""
    import ray
    from jaxllm import LLM, SamplingParams

    prompts = [f"Item {k} of the list is" + " more" * (k % 4) for k in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0)
    single = LLM(peaked_model, **SMALL_ENGINE)
    want = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    del single
    llm = LLM(peaked_model, data_parallel_size=2, data_parallel_address=ray_cluster, **SMALL_ENGINE)
    try:
        engine = llm.llm_engine
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        assert all(r["routed"] >= 2 for r in engine.router.stats())
        ray.kill(engine.set.handle(1), no_restart=True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        stats = engine.router.stats()
        assert not stats[1]["alive"] and stats[0]["routed"] >= 8 + 2
    finally:
        llm.llm_engine.shutdown()
