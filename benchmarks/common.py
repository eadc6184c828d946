"""What every benchmark shares: percentiles, the machine line, writing results."""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time

import numpy as np


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    import argparse
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def percentiles(values) -> dict:
    if len(values) == 0:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan"), "n": 0}
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p99": float(np.percentile(a, 99)), "n": int(a.size)}


def machine() -> str:
    import jax
    dev = jax.devices()[0]
    line = (f"{platform.machine()} {os.cpu_count()} cores, jax {jax.__version__} on "
            f"{dev.platform} ({dev.device_kind})")
    if dev.platform == "cpu":  # which CPU, and whether the kernels multiply on AMX's tiles (cpu.amx)
        from jaxllm.kernels.cpu import build
        try:
            with open("/proc/cpuinfo") as f:
                name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
        except OSError:
            name = ""
        line += f"; {name or 'CPU'}, AMX {'on' if build.amx() else 'off'}"
    return line


def command_line(args=None) -> str:
    """The command as typed."""
    argv = getattr(args, "argv", None)
    return " ".join(["jaxllm"] + [shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])])


def write_result(args, result: dict, kind: str) -> str:
    """benchmarks/results/<kind>_<dataset>_<date>_<device>.json (or $OUT), with the command,
    date and machine that produced it."""
    full = {"command": command_line(args),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), **result}
    result.clear()
    result.update(full)  # the caller's dict carries the provenance too
    os.makedirs(args.results_dir, exist_ok=True)
    device = "gpu" if " on gpu" in result["machine"] else "cpu"
    dataset = getattr(args, "dataset_name", None)
    tag = args.tag or "_".join(x for x in (kind, dataset, datetime.date.today().isoformat(), device) if x)
    path = os.path.join(args.results_dir, f"{tag}.json")
    with open(path, "w") as f:
        f.write(dumps(result))
    print(f"wrote {path}")
    return path


_FLAT_LIST = re.compile(r"\[[^\[\]{}]*\]")


def dumps(result) -> str:
    """JSON indented for reading, with lists of plain values (series over a run) on one line
    each rather than one value a line. (JSON escapes newlines inside strings, so only the
    layout's own are joined.)"""
    text = json.dumps(result, indent=2)
    def flat(m):  # only whitespace around a newline is layout: strings keep their spaces
        inner = re.sub(r"\s*\n\s*$", "", re.sub(r"^\s*\n\s*", "", m.group(0)[1:-1]))
        return "[" + re.sub(r"\s*\n\s*", " ", inner) + "]"
    return _FLAT_LIST.sub(flat, text) + "\n"


def memory_line(m: dict) -> str:
    return (f"KV cache: {m['kv_waste_perc']:.2f}% of allocated slots unused over the run; peak "
            f"{m['peak_running_seqs']} sequences at once, where static max-length preallocation "
            f"({m['max_model_len']} tokens each) admits {m['static_prealloc_seqs']}")


def start_server(model: str | None, serve_args: str, port: int, log, extra=()) -> tuple[subprocess.Popen, str]:
    """`jaxllm serve [MODEL] --port PORT SERVE_ARGS EXTRA` on loopback, its output to `log`,
    waited on until /health/ready says 200. Returns (process, base URL)."""
    import httpx
    cmd = [sys.executable, "-m", "jaxllm.cli", "serve", *([model] if model else []),
           "--port", str(port), *shlex.split(serve_args), *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(base + "/health/ready", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError("the server was not ready in 15 minutes")
        time.sleep(0.5)
