"""Starting `jaxllm serve` for real on loopback, for the tests that drive it over HTTP."""
import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], log_path, timeout: float = 300, env: dict | None = None):
    """`jaxllm serve ARGS --port P`, waited on until /health/ready says 200. Returns
    (process, base URL, whether /health/ready said 503 while loading)."""
    port = free_port()
    with open(log_path, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "jaxllm.cli", "serve", *args, "--port",
                                 str(port)], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    seen_loading = False
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n"
                                 + open(log_path).read()[-3000:])
        try:
            r = httpx.get(f"{base}/health/ready", timeout=2)
            if r.status_code == 200:
                return proc, base, seen_loading
            seen_loading |= r.status_code == 503
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise AssertionError("server did not become ready:\n" + open(log_path).read()[-3000:])
        time.sleep(0.1)


def stop(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


# the server tests' engine: small, with few step shapes, so that they compile quickly
SERVER_ENGINE = ["--max-model-len", "256", "--max-num-seqs", "16", "--max-num-batched-tokens", "128",
                 "--token-buckets", "16,128", "--seq-buckets", "8,16"]


def wait_for(fn, timeout: float = 60.0, every: float = 0.05, what: str = "the condition"):
    """fn()'s first truthy result, polled until `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every)


def metric(base: str, name: str, **labels) -> float:
    """The sum of the `jaxllm:{name}` series whose labels include `labels`, from /metrics."""
    text = httpx.get(base + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(f"jaxllm:{name}") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            if line.split("{")[0].split(" ")[0] == f"jaxllm:{name}":
                total += float(line.rsplit(" ", 1)[1])
    return total
