"""Every benchmark command end to end on a tiny model, writing well-formed reports."""
import json
import os
import signal
import subprocess
import sys

import math

import numpy as np
import pytest

from conftest import read_json
from server_util import start_server
from jaxllm.cli import main

ENGINE = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "256",
          "--token-buckets", "16,64", "--seq-buckets", "4,8"]


def run_cli(*argv):
    assert main(list(argv)) == 0


def duration(x) -> bool:
    """A measured time as the reports write it: a finite float of seconds."""
    return isinstance(x, float) and math.isfinite(x) and x >= 0


def test_throughput_random_with_hf_baseline(tiny_llama, tmp_path):
    run_cli("bench", "throughput", "--model", tiny_llama, *ENGINE, "--num-prompts", "6",
            "--input-len", "20", "--output-len", "8", "--results-dir", str(tmp_path), "--tag", "t")
    r = read_json(tmp_path / "t.json")
    assert "jaxllm bench throughput" in r["command"] and r["machine"] and r["date"]
    j, hf = r["jaxllm"], r["hf_transformers"]
    assert j["requests"] == 6 and j["output_tokens"] == 48 and hf["output_tokens"] == 48
    assert r["ratio_vs_hf"] == pytest.approx(j["output_tokens_per_s"] / hf["output_tokens_per_s"])
    mem = j["memory"]
    assert 0 <= mem["kv_waste_perc"] < 100 and mem["peak_running_seqs"] >= 1
    assert mem["static_prealloc_seqs"] == mem["kv_total_slots"] // 256


def test_throughput_prefix_chat_and_sharegpt_mix(tiny_llama, tmp_path):
    run_cli("bench", "throughput", "--model", tiny_llama, *ENGINE, "--dataset-name", "prefix-chat",
            "--num-prompts", "3", "--num-turns", "2", "--system-len", "40", "--input-len", "6",
            "--output-len", "4", "--no-hf-baseline", "--results-dir", str(tmp_path), "--tag", "chat")
    r = read_json(tmp_path / "chat.json")
    assert r["jaxllm"]["requests"] == 6 and r["jaxllm_no_prefix_caching"]["requests"] == 6
    assert r["jaxllm"]["cached_prompt_tokens"] > 0
    assert r["jaxllm_no_prefix_caching"]["cached_prompt_tokens"] == 0
    assert r["ratio_vs_no_prefix_caching"] == pytest.approx(
        r["jaxllm"]["output_tokens_per_s"] / r["jaxllm_no_prefix_caching"]["output_tokens_per_s"])
    run_cli("bench", "throughput", "--model", tiny_llama, *ENGINE, "--dataset-name", "sharegpt",
            "--num-prompts", "5", "--no-hf-baseline", "--results-dir", str(tmp_path), "--tag", "mix")
    r = read_json(tmp_path / "mix.json")
    assert r["jaxllm"]["requests"] == 5 and r["jaxllm"]["output_tokens"] > 0


def test_sharegpt_like_lengths():
    import numpy as np
    from benchmarks import datasets
    src = datasets.TokenSource(32000, set(), 0)
    samples = datasets.sharegpt_like(src, 3000, 4096)
    n_in = np.array([len(s.prompt_token_ids) for s in samples])
    n_out = np.array([s.output_len for s in samples])
    assert 170 < n_in.mean() < 230 and 150 < n_out.mean() < 210
    assert np.percentile(n_in, 99) > 4 * np.median(n_in)  # a long tail
    assert (n_in + n_out <= 4096).all()


def test_quality_method_names():
    """`jaxllm bench quality --methods`: int4's group size and calibration in the name."""
    from benchmarks.quality import method
    assert method("int4-g32-awq", 0.5) == (("hf", "float32", "int4", "auto"),
                                           {"quantization_group_size": 32, "int4_calibration": "awq"})
    assert method("int4-g128-rtn", 0.5)[1] == {"quantization_group_size": 128, "int4_calibration": "none"}
    assert method("int4-g64", 0.5)[1] == {"quantization_group_size": 64}
    assert method("int4-rtn", 0.5)[1] == {"int4_calibration": "none"}
    assert method("int4", 0.5)[1] == {} and method("w8a8-smooth@0.6", 0.5)[1] == {"smoothquant_alpha": 0.6}
    for bad in ("int4-g", "int4-awq-g32", "int4-g32-awq-x", "int4-", "int8-g32"):
        with pytest.raises(ValueError, match="unknown method"):
            method(bad, 0.5)


@pytest.mark.parametrize("passes", [1, 3])
def test_latency(tiny_llama, tmp_path, passes):
    """With multi-step scheduling (3 passes per call) the step is a pass: the replayed call's
    time is divided by its passes, and the decode phase's steps are counted in passes."""
    import gc
    callbacks = list(gc.callbacks)
    run_cli("bench", "latency", "--model", tiny_llama, *ENGINE, "--input-len", "16",
            "--output-len", "10", "--batch-size", "4", "--num-iters", "2", "--results-dir",
            str(tmp_path), "--tag", "lat", "--num-scheduler-steps", str(passes))
    assert gc.callbacks == callbacks  # the pause counter is gone with its engine
    r = read_json(tmp_path / "lat.json")
    assert r["num_scheduler_steps"] == passes
    for key in ("batch_1", "batch_4"):
        assert r[key]["decode_step_s"]["n"] == 2 and duration(r[key]["ttft_s"]["mean"])
        assert r[key]["e2e_s"]["n"] == 2
        # the replayed step is a decode step of that batch
        assert r[key]["step_shape"][1] >= int(key.split("_")[1])
        assert r[key]["replayed_passes"] == passes
        assert duration(r[key]["device_step_s"]) and duration(r[key]["host_cpu_s"])
        # the decode phase's launches, and how many found the device idle (then no bound)
        assert r[key]["decode_launches"] >= 1
        assert r[key]["launches_found_device_idle"] in range(r[key]["decode_launches"] + 1)
        # the collector's pauses in that phase (full ones counted), timed on the engine thread
        assert isinstance(r[key]["gc_full_collections"], int) and duration(r[key]["gc_seconds"])
        if r[key]["launches_found_device_idle"] == 0:
            assert r[key]["exposed_host_bound_s"] == r[key]["host_cpu_s"]
        else:
            assert "exposed_host_bound_s" not in r[key]


def test_detok(tiny_llama, tmp_path):
    """The detokenizer's cost per token in three windows of one stream, with a stop string
    searched at every token; the deltas read out make up the whole decoded text."""
    run_cli("bench", "detok", "--model", tiny_llama, "--num-tokens", "3000", "--window", "500",
            "--tokens-per-step", "2", "--stop", "NEVER-IN-THE-TEXT", "--results-dir", str(tmp_path),
            "--tag", "detok")
    r = read_json(tmp_path / "detok.json")
    assert [w["where"] for w in r["windows"]] == ["start", "middle", "end"]
    assert [w["first_token"] for w in r["windows"]] == [0, 1500, 2500]
    assert all(w["tokens"] == 500 and duration(w["us_per_token"]) for w in r["windows"])
    assert r["last_over_first"] == r["windows"][-1]["us_per_token"] / r["windows"][0]["us_per_token"]
    assert r["deltas_join_to_the_full_decode"] is True and r["text_chars"] > 3000
    assert r["stop"] == ["NEVER-IN-THE-TEXT"] and r["tokens_per_step"] == 2


def test_serve_peer_ratios_are_medians_over_starts_against_vllm():
    """vLLM's server cannot run here; the report's arithmetic can: per configuration and
    round, medians over starts, and jaxllm's against vLLM's of the same round."""
    from benchmarks.serve_peer import _ratios, _report

    def run(server, rounds):
        return {"server": server, "rounds": [dict(output_throughput=t, p99_itl_ms=p,
                                                  median_itl_ms=1.0, median_ttft_ms=2.0)
                                             for t, p in rounds]}
    runs = [run("vllm", [(100, 50), (110, 40)]), run("jaxllm:a", [(150, 60), (160, 30)]),
            run("vllm", [(120, 70), (130, 60)]), run("jaxllm:a", [(170, 20), (180, 50)])]
    r = _ratios(runs, 2)
    assert r["vllm"][0]["output_throughput"] == 110 and r["vllm"][1]["p99_itl_ms"] == 50
    assert r["jaxllm:a"][0]["throughput_vs_vllm"] == pytest.approx(160 / 110)
    assert r["jaxllm:a"][0]["p99_itl_vs_vllm"] == pytest.approx(40 / 60)
    assert r["jaxllm:a"][1]["throughput_vs_vllm"] == pytest.approx(170 / 120)
    lines = _report(r)
    assert len(lines) == 4 and "1.45x vLLM" in lines[2] and "from ready" in lines[2]
    assert "throughput_vs_vllm" not in _ratios(runs[1::2], 2)["jaxllm:a"][0]  # no peer: no ratio


def test_revisions(tiny_llama, tmp_path, capsys):
    """One benchmark at two revisions, each from a worktree of its own, alternated; the
    worktrees are gone afterwards. HEAD against itself: the deterministic field agrees."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    trees = subprocess.run(["git", "worktree", "list"], capture_output=True, text=True).stdout
    run_cli("bench", "revisions", "--before", "HEAD", "--after", head, "--pairs", "1",
            "--metric", "text_chars,num_tokens", "--results-dir", str(tmp_path), "--tag", "rev",
            "--", "detok", "--model", tiny_llama, "--num-tokens", "300", "--window", "100")
    r = read_json(tmp_path / "rev.json")
    assert r["before"]["revision"] == r["after"]["revision"] == head
    assert len(r["before"]["runs"]) == len(r["after"]["runs"]) == 1
    assert r["metric"] == "text_chars" and r["before"]["runs"][0] == r["after"]["runs"][0] > 300
    assert r["after_over_before"] == 1.0 and r["benchmark"].startswith("jaxllm bench detok")
    # each metric compared; the first one is also the result's headline
    assert [c["metric"] for c in r["compared"]] == ["text_chars", "num_tokens"]
    assert r["compared"][0]["before"] == r["before"]
    assert r["compared"][1]["before"]["runs"] == r["compared"][1]["after"]["runs"] == [300.0]
    assert [len(r["results"][side]) for side in ("before", "after")] == [1, 1]
    assert subprocess.run(["git", "worktree", "list"], capture_output=True, text=True).stdout == trees
    assert main(["bench", "revisions", "--before", "HEAD", "--metric", "no.such", "--results-dir",
                 str(tmp_path), "--", "detok", "--model", tiny_llama, "--num-tokens", "300",
                 "--window", "100"]) == 1
    assert "--metric: the result has no field 'no.such'" in capsys.readouterr().err
    assert main(["bench", "revisions", "--before", "no-such-revision", "--results-dir", str(tmp_path),
                 "--", "detok", "--model", tiny_llama]) == 1
    assert "not a revision" in capsys.readouterr().err


def test_structured(tiny_llama, tmp_path):
    run_cli("bench", "structured", "--model", tiny_llama, *ENGINE, "--num-requests", "4",
            "--output-len", "6", "--rounds", "1", "--num-ttft", "1", "--results-dir",
            str(tmp_path), "--tag", "so")
    r = read_json(tmp_path / "so.json")
    t = r["throughput"]
    # every run produced the same tokens: the schemas ask for more than the output length
    assert {x["output_tokens"] for runs in t.values() for x in runs} == {24}
    assert len(t["unconstrained"]) == 2 and t["json_schema_new"][0]["masks"] >= 6
    assert t["unconstrained"][0]["masks"] == 0
    # each constrained run against the mean of the unconstrained runs around it
    free = [x["output_tok_s"] for x in t["unconstrained"]]
    for name in ("json_schema_new", "json_schema_cached"):
        assert all(x["ratio_to_unconstrained"] == pytest.approx(x["output_tok_s"] / ((free[i] + free[i + 1]) / 2))
                   for i, x in enumerate(t[name]))
        assert r["ratio_to_unconstrained_median"][name] == pytest.approx(
            float(np.median([x["ratio_to_unconstrained"] for x in t[name]])))
    assert duration(r["split_step"]["one_call"]) and duration(r["split_step"]["two_calls"])
    assert all(v["n"] == 1 and duration(v["median"]) for v in r["ttft_s"].values())


def test_structured_adherence(tiny_llama, tmp_path):
    from benchmarks.structured import adheres, open_schema
    run_cli("bench", "structured", "--adherence", "--model", tiny_llama, *ENGINE, "--num-schemas",
            "2", "--max-tokens", "12", "--results-dir", str(tmp_path), "--tag", "adh")
    r = read_json(tmp_path / "adh.json")
    assert [json.dumps(s) for s in r["workload"]["schemas"]] == [json.dumps(open_schema(i)[1])
                                                                 for i in range(2)]
    assert "additionalProperties" not in json.dumps(r["workload"]["schemas"])
    assert set(r["modes"]) == {"strict", "permissive"}
    for mode in r["modes"].values():
        rows, summary = mode["outputs"], mode["summary"]
        assert len(rows) == 2 and all(1 <= x["tokens"] <= 12 for x in rows)
        for key in ("parses", "valid", "adheres"):
            assert summary[key] == sum(x[key] for x in rows) / 2
        assert summary["length_finished"] == sum(x["finish_reason"] == "length" for x in rows) / 2
        assert all(x["adheres"] <= x["valid"] <= x["parses"] for x in rows)
    # the strict engine never writes a key its schema does not name
    assert all(x["adheres"] == x["parses"] for x in r["modes"]["strict"]["outputs"])
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "integer"}}}}}
    assert adheres('{"a": {"b": 1}}', schema) == {"parses": True, "valid": True, "adheres": True}
    assert adheres('{"a": {"b": 1, "c": 2}}', schema) == {"parses": True, "valid": True,
                                                          "adheres": False}
    assert adheres('{"a": {"b": "x"}}', schema)["valid"] is False
    assert adheres('{"a": ', schema)["parses"] is False


@pytest.mark.slow
def test_lora(tiny_llama, tmp_path):
    run_cli("bench", "lora", "--model", tiny_llama, *ENGINE, "--num-prompts", "4",
            "--input-len", "12", "--output-len", "4", "--num-adapters", "2", "--lora-rank", "4",
            "--decode-batch", "4", "--replay-steps", "2", "--num-iters", "1", "--no-ops",
            "--results-dir", str(tmp_path), "--tag", "lora")
    r = read_json(tmp_path / "lora.json")
    assert r["base_outputs_identical_with_lora_enabled"]
    best = {k: max(x["output_tokens_per_s"] for x in r["runs"][k]) for k in ("base", "lora")}
    assert r["throughput_ratio_adapters_vs_base"]["output_tokens_per_s"] == pytest.approx(
        best["lora"] / best["base"])
    step = r["decode_step"]["lora_engine"]
    assert step["shape"][1] >= 4 and all(duration(step[f"{k}_adapters"]["wall_s"]) for k in range(3))
    assert r["compilations_after_warmup"] == 0


def test_dummy_weights_from_a_bare_config(tmp_path):
    from conftest import _tiny_config
    d = tmp_path / "cfg"
    d.mkdir()
    cfg = _tiny_config("LlamaForCausalLM")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.to_json_file(d / "config.json")
    run_cli("bench", "throughput", "--model", str(d), "--load-format", "dummy", "--dtype", "bfloat16",
            *ENGINE, "--num-prompts", "3", "--input-len", "10", "--output-len", "4",
            "--results-dir", str(tmp_path), "--tag", "dummy")
    r = read_json(tmp_path / "dummy.json")
    assert r["jaxllm"]["output_tokens"] == 12 and "hf_transformers" not in r
    assert r["engine"]["dtype"] == "bfloat16"


def test_real_shape_configs_parse():
    from jaxllm.models.arch import ArchConfig
    here = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs")
    shapes = {}
    for name in ("llama-3-8b", "qwen2.5-7b", "llama-3.2-1b"):
        with open(os.path.join(here, name, "config.json")) as f:
            a = ArchConfig.from_hf(json.load(f))
        shapes[name] = (a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim, a.vocab_size)
    assert shapes["llama-3-8b"] == (32, 32, 8, 128, 128256)
    assert shapes["qwen2.5-7b"] == (28, 28, 4, 128, 152064)
    assert shapes["llama-3.2-1b"] == (16, 32, 8, 64, 128256)


@pytest.fixture(scope="module")
def bench_server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("bench_server") / "server.log"
    proc, base, _ = start_server([tiny_llama, *ENGINE], log)
    yield base
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def test_serve_sweep_with_plots(bench_server, tmp_path):
    run_cli("bench", "serve", "--base-url", bench_server, "--num-prompts", "12",
            "--random-input-len", "16", "--random-output-len", "6", "--ignore-eos",
            "--max-concurrency", "1,4", "--vocab-size", "40000", "--save-result", "--plot",
            "--results-dir", str(tmp_path), "--tag", "srv")
    r = read_json(tmp_path / "srv.json")
    assert [x["max_concurrency"] for x in r["runs"]] == [1, 4]
    for run in r["runs"]:
        assert run["successful_requests"] == 12 and run["failed_requests"] == 0
        assert run["total_output_tokens"] == 72
        for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert run[k]["mean"] > 0 and run[k]["p99"] >= run[k]["median"]
        assert run["memory"]["peak_running_seqs"] >= 1
    assert r["runs"][1]["request_throughput"] > 0
    for suffix in ("_throughput.png", "_latency.png", ".md"):
        assert (tmp_path / f"srv{suffix}").stat().st_size > 0
    md = (tmp_path / "srv.md").read_text()
    assert "| 1 |" in md and "| 4 |" in md


def test_serve_opens_at_most_max_active_conversations(monkeypatch, capsys):
    """--max-active-conversations N: N conversations are open at a time, in the workload's
    order, the next opening when one has had its last turn (vLLM's multi-turn benchmark's
    flag); a conversation's turns go in order."""
    import argparse
    import asyncio
    from benchmarks import serve as bench_serve
    args = argparse.Namespace(
        dataset_name="prefix-chat", num_prompts=7, num_turns=3, system_len=8, random_input_len=4,
        random_output_len=2, num_tenants=1, tokenizer=None, vocab_size=1000, seed=0,
        request_rate=float("inf"), think_time=0.002, ignore_eos=True, max_active_conversations=2,
        base_url="http://unused", endpoint="/v1/completions", api_key=None)
    chains = bench_serve.build_workload(args)
    where = {id(s): (c, t) for c, chain in enumerate(chains) for t, s in enumerate(chain)}
    events, open_now, most = [], set(), [0]

    async def fake(client, url, model, sample, ignore_eos, headers):
        c, t = where[id(sample)]
        events.append((c, t))
        open_now.add(c)
        most[0] = max(most[0], len(open_now))
        await asyncio.sleep(0.001 * (1 + (c * 7 + t) % 3))
        if t == len(chains[c]) - 1:
            open_now.discard(c)
        return bench_serve.Outcome(True, prompt_tokens=len(sample.prompt_token_ids))
    monkeypatch.setattr(bench_serve, "one_request", fake)
    outcomes, _ = asyncio.run(bench_serve.run_load(args, chains, "m", concurrency=None))
    assert len(outcomes) == 21 and most[0] == 2
    firsts = [c for c, t in events if t == 0]
    assert firsts == list(range(7))
    for c in range(7):
        assert [t for x, t in events if x == c] == [0, 1, 2]
    # a conversation opens only once an earlier one has ended
    ended = 0
    for i, (c, t) in enumerate(events):
        if t == 0 and c >= 2:
            done = {x for x, y in events[:i] if y == 2}
            assert len(done) >= c - 1
            ended += 1
    assert ended == 5
    for bench in ("serve", "replicas"):  # refused by the parser, naming the flag
        with pytest.raises(SystemExit):
            run_cli("bench", bench, "--max-active-conversations", "0")
        assert "--max-active-conversations: must be at least 1, got 0" in capsys.readouterr().err


def test_serve_poisson_and_prefix_chat(bench_server, tmp_path):
    run_cli("bench", "serve", "--base-url", bench_server, "--dataset-name", "prefix-chat",
            "--num-prompts", "3", "--num-turns", "2", "--system-len", "40", "--random-input-len", "6",
            "--random-output-len", "4", "--request-rate", "20", "--vocab-size", "40000",
            "--save-result", "--results-dir", str(tmp_path), "--tag", "chat",
            "--save-trace", str(tmp_path / "trace.jsonl"))
    r = read_json(tmp_path / "chat.json")
    assert r["runs"][0]["successful_requests"] == 6
    # the requests as sent, replayed through the router on simulated replicas
    lines = [json.loads(x) for x in open(tmp_path / "trace.jsonl")]
    assert [x["chain"] for x in lines] == [0, 0, 1, 1, 2, 2]
    assert lines[1]["prompt_token_ids"][:len(lines[0]["prompt_token_ids"])] == lines[0]["prompt_token_ids"]
    run_cli("bench", "replicas", "--parts", "simulate", "--trace", str(tmp_path / "trace.jsonl"),
            "--sim-replicas", "1,2", "--sim-policies", "prefix,round_robin", "--think-time", "0.5",
            "--routing-cache-blocks", "64", "--sim-seeds", "2", "--results-dir", str(tmp_path),
            "--tag", "sim")
    sim = read_json(tmp_path / "sim.json")["simulate"]
    assert sim["requests"] == 6 and sim["source"].endswith("trace.jsonl")
    assert [(x["replicas"], x["policy"]) for x in sim["runs"]] == [
        (1, "prefix"), (2, "prefix"), (2, "round_robin")]
    assert all(x["requests"] == 6 and 0 <= x["cached_token_fraction"] <= 1 for x in sim["runs"])
    for x in sim["runs"]:  # two runs each (other think times), averaged
        assert len(x["per_seed"]) == 2 and x["cached_token_fraction"] == pytest.approx(
            sum(s["cached_token_fraction"] for s in x["per_seed"]) / 2)
    # an unreachable server: every request fails, and the report says so
    run_cli("bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "2",
            "--save-result", "--results-dir", str(tmp_path), "--tag", "down")
    down = read_json(tmp_path / "down.json")["runs"][0]
    assert down["failed_requests"] == 2 and down["successful_requests"] == 0 and down["errors"]


def test_kernels_small_grid(tmp_path, monkeypatch):
    from benchmarks import kernels
    # the sweep's code path with two of each family's tile variants (each compiles in the
    # interpreter for seconds; the GPU runs them all)
    monkeypatch.setattr(kernels, "DECODE_VARIANTS", kernels.DECODE_VARIANTS[:1])
    monkeypatch.setattr(kernels, "PREFILL_VARIANTS", kernels.PREFILL_VARIANTS[:1])
    monkeypatch.setattr(kernels, "MOSAIC_DECODE_VARIANTS", kernels.MOSAIC_DECODE_VARIANTS[-1:])
    monkeypatch.setattr(kernels, "MOSAIC_PREFILL_VARIANTS", kernels.MOSAIC_PREFILL_VARIANTS[1:2])
    # one decode and one prefill case (the rows' code is the same for each)
    monkeypatch.setitem(kernels.GRIDS, "small", dict(decode=[(4, 256)], prefill=[32]))
    run_cli("bench", "kernels", "--grid", "small", "--iters", "1", "--heads", "8", "--kv-heads", "2",
            "--head-dim", "64", "--dtype", "bfloat16", "--results-dir", str(tmp_path), "--tag", "k",
            "--sweep")
    r = read_json(tmp_path / "k.json")
    assert r["interpret"] is True and r["peaks"]["copy_gb_s"] > 0 and r["mosaic_left_out"] is None
    assert len(r["decode"]) == 1 and len(r["prefill"]) == 1
    for row in r["decode"]:
        for name in ("jaxllm_triton", "jaxllm_mosaic", "xla"):
            assert row[name]["gb_s"] > 0
        assert "gb_s" in row["jax_paged_attention"] or "error" in row["jax_paged_attention"]
    for row in r["prefill"]:
        for name in ("jaxllm_triton", "jaxllm_mosaic"):
            assert row[name]["tflop_s"] > 0 and 0 < row[name]["frac_of_matmul"]
    sweep = r["sweep"]
    assert [(v["kernels"], v.get("keys"), v.get("num_warps"), v.get("stages"), v["k_splits"])
            for v in sweep["decode"]] == (
        [("triton", k, w, None, s) for k, w, s in kernels.DECODE_VARIANTS]
        + [("mosaic", None, None, st, s) for st, s in kernels.MOSAIC_DECODE_VARIANTS])
    assert [v["kernels"] for v in sweep["prefill"]] == ["triton", "mosaic"]
    assert all(v["gb_s"] > 0 for v in sweep["decode"]) and all(v["tflop_s"] > 0 for v in sweep["prefill"])

    # an int8 cache: both families read it (bytes: 1 per value and 4 per token's scale)
    monkeypatch.setitem(kernels.GRIDS, "small", dict(decode=[(1, 64)], prefill=[32]))
    run_cli("bench", "kernels", "--grid", "small", "--iters", "1", "--heads", "8", "--kv-heads", "2",
            "--head-dim", "64", "--kv-cache-dtype", "int8", "--results-dir", str(tmp_path),
            "--tag", "k8")
    r = read_json(tmp_path / "k8.json")
    assert r["shape"]["kv_cache_dtype"] == "int8" and r["mosaic_left_out"] is None
    row = r["decode"][0]
    assert row["kv_bytes"] == 1 * 64 * 2 * (64 + 4) * 2
    assert all(row[n]["gb_s"] > 0 for n in ("jaxllm_triton", "jaxllm_mosaic", "xla"))
    assert "float caches only" in row["jax_paged_attention"]["error"]


def test_moe_against_every_expert_and_the_dense_twin(tmp_path):
    run_cli("bench", "moe", "--hidden-size", "64", "--num-layers", "1", "--num-heads", "2",
            "--num-experts", "4", "--experts-per-token", "2", "--expert-size", "32",
            "--vocab-size", "256", "--batch-sizes", "1,2", "--iters", "1", "--context", "20",
            "--results-dir", str(tmp_path), "--tag", "m")
    r = read_json(tmp_path / "m.json")
    models = r["models"]
    assert set(models) == {"moe_grouped", "moe_dense", "dense"}
    moe, dense = models["moe_grouped"]["parameters"], models["dense"]["parameters"]
    # the dense twin is the MoE's active parameters less its router (64 x 4 per layer) and
    # OLMoE's q/k norms (64 each)
    assert moe["active_per_token"] - dense["total"] == 64 * 4 + 2 * 64
    assert moe["total"] - moe["active_per_token"] == 2 * 3 * 64 * 32  # two unused experts
    for b in (1, 2):
        assert all(m[f"batch_{b}_step_s"] > 0 for m in models.values())
        assert r["ratios"][f"batch_{b}"]["dense_active_over_grouped"] > 0


def test_vision_ttft_first_and_cached(tmp_path):
    run_cli("bench", "vision", "--vision-hidden", "32", "--vision-layers", "2", "--vision-heads", "2",
            "--vision-intermediate", "64", "--image-size", "28", "--patch-size", "14",
            "--text-hidden", "64", "--text-layers", "1", "--text-heads", "2", "--text-kv-heads", "1",
            "--text-intermediate", "64", "--prompt-tokens", "40", "--iters", "1",
            "--results-dir", str(tmp_path), "--tag", "v")
    r = read_json(tmp_path / "v.json")
    assert r["model"]["tokens_per_image"] == 4 and r["workload"]["prompt_tokens"] == 44
    assert r["cached_prompt_tokens"] == 32  # two blocks of 16 (the last token is computed)
    assert r["ttft_first_s"]["n"] == r["ttft_cached_s"]["n"] == 1 and r["first_over_cached"] > 0


def test_aot_without_cuda_compiler_says_what_to_install():
    """`bench aot` needs JAX's CUDA plugin (never installed by the project's own setup)."""
    import importlib.util
    if importlib.util.find_spec("jax_plugins") is not None:
        pytest.skip("JAX plugins are installed here: bench aot may find a CUDA compiler")
    res = subprocess.run([sys.executable, "-m", "jaxllm.cli", "bench", "aot"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert 'pip install "jax[cuda13]"' in res.stderr


FAKE_VLLM = '''#!{python}
import json, os, sys
script, workload = sys.argv[1], sys.argv[2]
w = json.load(open(workload))
assert os.path.basename(script) == "vllm_peer.py" and os.path.dirname(script) == os.getcwd()
n = sum(w["output_lens"])
print("RESULT " + json.dumps({{"vllm_version": "fake", "dtype": "bfloat16", "seconds": 2.0,
      "requests": len(w["prompts"]), "requests_per_s": len(w["prompts"]) / 2.0, "output_tokens": n,
      "output_tokens_per_s": n / 2.0, "total_tokens_per_s": n / 2.0, "cwd": os.getcwd(),
      "engine_kwargs": w["engine_kwargs"], "tokens": [[0] * k for k in w["output_lens"]]}}))
'''


def test_vllm_baseline_plumbing(tiny_llama, tmp_path):
    """--baseline vllm hands the same prompts to a python that runs vLLM (a stand-in here, as
    CI has no vLLM), from a directory of its own, and reports the ratio; a comparison that
    cannot run is refused before anything is measured."""
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_VLLM.format(python=sys.executable))
    fake.chmod(0o755)
    run_cli("bench", "throughput", "--model", tiny_llama, *ENGINE, "--num-prompts", "3",
            "--input-len", "10", "--output-len", "4", "--no-hf-baseline", "--baseline", "vllm",
            "--vllm-python", str(fake), "--vllm-dtype", "float32", "--results-dir", str(tmp_path),
            "--tag", "v")
    r = read_json(tmp_path / "v.json")
    v = r["vllm"]
    assert v["output_tokens"] == 12 and v["requests"] == 3 and "tokens" not in v
    assert v["engine_kwargs"] == {"dtype": "float32"}
    assert not v["cwd"].startswith(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r["ratio_vs_vllm"] == pytest.approx(r["jaxllm"]["output_tokens_per_s"] / 6.0)
    assert v["same_tokens"] == 0  # the stand-in answers zeros
    assert main(["bench", "throughput", "--model", tiny_llama, "--baseline", "vllm"]) == 1


def test_soak_passes_with_faults_injected(tiny_llama, tmp_path):
    """A short soak on the tiny model with a step failing about one in 15: every request is
    answered or refused as it should be, the server comes back to idle and stays up. (The
    report's timing checks, RSS and TTFT over time, are for real runs: not asserted here.)"""
    from server_util import SERVER_ENGINE, free_port
    main(["bench", "soak", "--model", tiny_llama, "--serve-args", " ".join(SERVER_ENGINE),
            "--minutes", "0.15", "--concurrency", "4", "--fault-every", "10", "--max-tokens", "8",
            "--replay-turns", "6", "--replay-budget", "120", "--sample-seconds", "2",
            "--port", str(free_port()), "--results-dir", str(tmp_path), "--tag", "soak"])
    r = read_json(tmp_path / "soak.json")
    for check in ("no request lost or hung", "no unexpected answer", "the server is still up",
                  "back to idle: no request, no KV block held", "every replayed turn answered"):
        assert r["checks"][check], (check, r["by_outcome"])
    by = r["by_outcome"]
    assert by.get("ok", 0) > 0 and by.get("refused", 0) > 0 and set(by) <= {
        "ok", "refused", "step_failed", "cancelled", "disconnected"}
    assert r["idle_after"]["jaxllm:num_failed_steps_total"] >= 1  # faults really happened
    assert r["replay"]["answered"] == 6 and r["replay"]["turns_trimmed"] >= 1
    assert r["replay"]["max_prompt_tokens"] <= 120
    assert os.path.exists(tmp_path / "soak.png")


def test_results_keep_series_on_one_line():
    """Reports stay readable in review: a series is one line, the structure stays indented,
    and the file reads back as what was written."""
    from benchmarks.common import dumps
    result = {"samples": {"rss": list(range(500)), "tags": ["a [ b", "c\nd", None, "e ]"]},
              "rows": [{"x": [1.5, 2.5], "y": {"z": True}}], "empty": []}
    text = dumps(result)
    assert json.loads(text) == result
    assert text.count("\n") < 25
    assert '"rss": [0, 1, 2,' in text and '"x": [1.5, 2.5]' in text
