"""Disaggregated prefill/decode: a prompt's KV blocks moved from a producer engine to a
consumer, whose greedy outputs equal one engine's token for token.

First the pair in this process (two Replica objects, no Ray: the payload is handed over as
the object store would hand it), with a failed and a mismatched transfer falling back to
computing the prompt; then `jaxllm serve --kv-transfer-config` with a prefill replica and a
decode replica on Ray, driven over HTTP."""
import asyncio
import gc
import json

import httpx
import pytest

from conftest import SMALL_ENGINE
from server_util import metric, start_server, stop

pytestmark = pytest.mark.slow

PROMPTS = ["The river ran past the mill and the old stone bridge, " * k + "and then" for k in (2, 4, 7)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference(peaked_model):
    from jaxllm import LLM, SamplingParams
    llm = LLM(peaked_model, **SMALL_ENGINE)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


@pytest.fixture(scope="class")
def pair(peaked_model):
    """(Class-scoped: its two engines are gone before the served pair below starts its own.)"""
    from jaxllm.config import EngineConfig
    from jaxllm.distributed.replica import Replica
    producer = Replica(EngineConfig(peaked_model, **SMALL_ENGINE), 0, None)
    consumer = Replica(EngineConfig(peaked_model, **SMALL_ENGINE), 1, None)
    yield producer, consumer
    producer.shutdown()
    consumer.shutdown()
    del producer, consumer
    gc.collect()


async def _value(x):
    return x


async def _fails():
    raise ConnectionError("the producer went away")


async def _decode(consumer, rid, prompt, kv):
    from jaxllm.sampling_params import RequestOutputKind, SamplingParams
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    req = consumer.engine.engine.process_inputs(prompt, params)
    received = await consumer.receive(rid, req, kv)
    outs = [o async for o in consumer.generate(rid, req, 0)]
    assert received == (consumer.kv["kv_transfer_failures"] == _decode.failures)
    _decode.failures = consumer.kv["kv_transfer_failures"]
    return outs[-1], req


_decode.failures = 0


class TestInProcessPair:
    def test_moved_blocks_give_one_engines_outputs(self, pair, reference):
        from jaxllm.distributed.replica_set import prefill_request
        producer, consumer = pair

        async def run():
            for k, (prompt, (want_ids, _)) in enumerate(zip(PROMPTS, reference)):
                before = dict(consumer.kv)
                req = producer.engine.engine.process_inputs(prompt)
                summary, payload = await producer.prefill(f"p{k}", prefill_request(req))
                bs = payload["block_size"]
                assert payload["num_blocks"] == len(req.prompt_token_ids) // bs
                assert summary["nbytes"] == payload["nbytes"] > 0 and "values" not in summary
                out, _ = await _decode(consumer, f"d{k}", prompt, [_value(payload)])
                assert list(out.outputs[0].token_ids) == list(want_ids)
                # the moved blocks were the consumer's prefix-cache hits: only the rest ran there
                usable = (len(req.prompt_token_ids) - 1) // bs
                assert out.num_cached_tokens == usable * bs
                assert consumer.kv["kv_transfer_received_bytes"] - before["kv_transfer_received_bytes"] \
                    == payload["nbytes"]
                # blocks shared with the previous prompts were cached already: not written again
                written = consumer.kv["kv_transfer_imported_blocks"] - before["kv_transfer_imported_blocks"]
                assert 0 < written <= payload["num_blocks"]
        asyncio.run(run())
        assert producer.kv["kv_transfer_sent_bytes"] == consumer.kv["kv_transfer_received_bytes"]
        assert consumer.kv["kv_transfer_failures"] == 0


    def test_a_failed_or_mismatched_transfer_falls_back_to_computing_the_prompt(self, pair, reference, caplog):
        from jaxllm.distributed.replica_set import prefill_request
        producer, consumer = pair
        prompt, (want_ids, _) = "A new prompt nobody cached: " + PROMPTS[2], reference[2]

        async def run():
            failures = consumer.kv["kv_transfer_failures"]
            out, _ = await _decode(consumer, "lost", prompt, [_fails()])
            assert consumer.kv["kv_transfer_failures"] == failures + 1
            assert out.num_cached_tokens == 0 and len(out.outputs[0].token_ids) == MAX_TOKENS
            # blocks of another layout (a wrong block size) are refused, loudly
            req = producer.engine.engine.process_inputs(PROMPTS[1])
            _, payload = await producer.prefill("p-odd", prefill_request(req))
            odd = {**payload, "block_size": payload["block_size"] * 2}
            out, _ = await _decode(consumer, "odd", PROMPTS[1], [_value(odd)])
            assert consumer.kv["kv_transfer_failures"] == failures + 2
            assert list(out.outputs[0].token_ids) == list(reference[1][0])
            return want_ids
        with caplog.at_level("ERROR", logger="jaxllm"):
            asyncio.run(run())
        assert sum("KV transfer" in r.getMessage() and "computed here instead" in r.getMessage()
                   for r in caplog.records) == 2


@pytest.fixture(scope="module")
def server(peaked_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("pd")
    kv = {"kv_connector": "RayObjectStoreConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"prefill_replicas": 1}}
    engine = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL_ENGINE.items()
              if k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len")]
    buckets = [f"--token-buckets={','.join(map(str, SMALL_ENGINE['token_buckets']))}",
               f"--seq-buckets={','.join(map(str, SMALL_ENGINE['seq_buckets']))}"]
    proc, base, _ = start_server([peaked_model, *engine, *buckets, "--data-parallel-size", "2",
                                  "--kv-transfer-config", json.dumps(kv)], d / "server.log",
                                 timeout=600)
    yield base
    stop(proc)


def test_served_prefill_decode_pair_matches_one_engine(server, reference):
    h = httpx.get(server + "/health").json()
    assert [(r["replica"], r["role"]) for r in h["replicas"]] == [(0, "prefill"), (1, "decode")]
    for prompt, (_, want_text) in zip(PROMPTS, reference):
        r = httpx.post(server + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}).json()
        assert r["choices"][0]["text"] == want_text
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # streamed too
    with httpx.stream("POST", server + "/v1/completions", timeout=120, json={
            "prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}) as s:
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in s.iter_lines()
                       if line.startswith("data: {"))
    assert text == reference[2][1]
    # the KV bytes moved are counted, and every prefill went to the prefill replica
    moved = metric(server, "kv_transfer_received_bytes_total")
    assert moved > 0 and metric(server, "kv_transfer_failures_total") == 0
    assert metric(server, "router_requests_total", replica="0") == 4
    assert metric(server, "router_requests_total", replica="1") == 4
