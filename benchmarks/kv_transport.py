"""`jaxllm bench kv-transport`: moving KV blocks between two processes, by transport.

The candidates for disaggregated prefill/decode's KV transfer, each moving the same
payloads (1, 16 and 128 blocks of the default model's float32 CPU cache: 0.7, 11 and 90
MiB; 128 blocks are a 2,048-token prompt) from a producer process into a registered buffer
of a consumer process, timed at the consumer, the contents checked:

- Ray's object store: the producer actor returns the payload (put into the node's shared
  memory store), the consumer gets it and copies it into its buffer (what the decode replica
  does before writing its cache). Includes the call's round trip.
- Mooncake's transfer engine (`mooncake-transfer-engine-non-cuda`, TCP protocol, peer to
  peer handshake): the consumer reads the producer's registered buffer.
- NIXL (`nixl` with its UCX backend, host memory): the consumer reads the producer's
  registered buffer.

A transport whose package is missing or fails here is reported as such, with the error.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
import traceback

import numpy as np

from benchmarks.common import write_result

BLOCK_BYTES = 737_280  # the default model's block: 30 layers x 2 x 3 heads x 16 x 64 x 4 bytes


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", default="1,16,128", help="payload sizes, in blocks")
    p.add_argument("--block-bytes", type=int, default=BLOCK_BYTES)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--transports", default="ray,mooncake,nixl")
    p.add_argument("--results-dir", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--tag", default=None)


def _payload(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)


def _summary(times: list[float], nbytes: int) -> dict:
    med = statistics.median(times)
    return {"bytes": nbytes, "median_ms": med * 1e3, "min_ms": min(times) * 1e3,
            "gib_per_s": nbytes / med / 2**30}


# Ray's object store
def bench_ray(sizes: list[int], repeats: int) -> dict:
    import ray
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False,
             log_to_driver=False)
    try:
        @ray.remote(num_cpus=1)
        class Producer:
            def __init__(self):
                self.buf = {}

            def fill(self, n, seed):
                self.buf[n] = _payload(n, seed)
                return int(self.buf[n][::4096].sum())

            def payload(self, n):
                return self.buf[n]

        @ray.remote(num_cpus=1)
        class Consumer:
            def fetch(self, producer, n, repeats, check):
                dst = np.empty(n, np.uint8)
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    arr = ray.get(producer.payload.remote(n))
                    np.copyto(dst, arr)
                    times.append(time.perf_counter() - start)
                return times, int(dst[::4096].sum()) == check

        prod, cons = Producer.remote(), Consumer.remote()
        out = {}
        for n in sizes:
            check = ray.get(prod.fill.remote(n, n))
            times, ok = ray.get(cons.fetch.remote(prod, n, repeats, check))
            if not ok:
                raise RuntimeError("the payload arrived changed")
            out[str(n)] = _summary(times, n)
        return out
    finally:
        ray.shutdown()


# Mooncake's transfer engine and NIXL: a producer process and a consumer process
def _mooncake_producer(conn, sizes):
    from mooncake.engine import TransferEngine
    eng = TransferEngine()
    if eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake: initialize failed")
    bufs = {n: _payload(n, n) for n in sizes}
    for b in bufs.values():
        if eng.register_memory(b.ctypes.data, b.nbytes) != 0:
            raise RuntimeError("mooncake: register_memory failed")
    conn.send((f"127.0.0.1:{eng.get_rpc_port()}",
               {n: (b.ctypes.data, int(b[::4096].sum())) for n, b in bufs.items()}))
    conn.recv()  # until the consumer is done


def _mooncake_consumer(conn, sizes, repeats):
    from mooncake.engine import TransferEngine
    session, remote = conn.recv()
    eng = TransferEngine()
    if eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake: initialize failed")
    out = {}
    for n in sizes:
        dst = np.empty(n, np.uint8)
        eng.register_memory(dst.ctypes.data, n)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            if eng.transfer_sync_read(session, dst.ctypes.data, remote[n][0], n) != 0:
                raise RuntimeError("mooncake: transfer_sync_read failed")
            times.append(time.perf_counter() - start)
        if int(dst[::4096].sum()) != remote[n][1]:
            raise RuntimeError("the payload arrived changed")
        out[str(n)] = _summary(times, n)
    conn.send("done")
    return out


def _nixl_api():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:  # the CUDA-variant wheels install under their own names
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


def _nixl_producer(conn, sizes):
    nixl_agent, nixl_agent_config = _nixl_api()
    agent = nixl_agent("producer", nixl_agent_config(backends=["UCX"]))
    bufs = {n: _payload(n, n) for n in sizes}
    descs = {}
    for n, b in bufs.items():
        region = [(b.ctypes.data, b.nbytes, 0)]  # host memory: (address, length, device 0)
        agent.register_memory([(*region[0], "")], "DRAM")  # (registrations carry a name)
        descs[n] = (agent.get_serialized_descs(agent.get_xfer_descs(region, "DRAM")),
                    int(b[::4096].sum()))
    conn.send((agent.get_agent_metadata(), descs))
    conn.recv()


def _nixl_consumer(conn, sizes, repeats):
    nixl_agent, nixl_agent_config = _nixl_api()
    meta, descs = conn.recv()
    agent = nixl_agent("consumer", nixl_agent_config(backends=["UCX"]))
    peer = agent.add_remote_agent(meta)
    out, keep, regs = {}, [], []
    for n in sizes:
        dst = np.empty(n, np.uint8)
        keep.append(dst)
        region = [(dst.ctypes.data, n, 0)]
        regs.append(agent.register_memory([(*region[0], "")], "DRAM"))
        handle = agent.initialize_xfer("READ", agent.get_xfer_descs(region, "DRAM"),
                                       agent.deserialize_descs(descs[n][0]), peer)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError("nixl: the transfer failed")
            times.append(time.perf_counter() - start)
        agent.release_xfer_handle(handle)
        if int(dst[::4096].sum()) != descs[n][1]:
            raise RuntimeError("the payload arrived changed")
        out[str(n)] = _summary(times, n)
    conn.send("done")
    for reg in regs:  # released before the interpreter goes (NIXL's teardown needs it)
        agent.deregister_memory(reg)
    agent.remove_remote_agent(peer)
    return out


def _run_producer(target, conn, sizes, errors):
    try:
        target(conn, sizes)
    except BaseException:
        errors.put(traceback.format_exc(limit=3))


def _pair(producer, consumer, sizes, repeats) -> dict:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    errors = ctx.Queue()
    proc = ctx.Process(target=_run_producer, args=(producer, a, sizes, errors), daemon=True)
    proc.start()
    try:
        if not b.poll(120):
            raise RuntimeError(errors.get(timeout=5) if not errors.empty() else
                               "the producer did not start")
        return consumer(b, sizes, repeats)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def run(args) -> int:
    sizes = [int(x) * args.block_bytes for x in args.blocks.split(",")]
    result = {"block_bytes": args.block_bytes, "blocks": [int(x) for x in args.blocks.split(",")],
              "repeats": args.repeats, "transports": {}}
    for name in [t.strip() for t in args.transports.split(",") if t.strip()]:
        try:
            if name == "ray":
                got = bench_ray(sizes, args.repeats)
            elif name == "mooncake":
                got = _pair(_mooncake_producer, _mooncake_consumer, sizes, args.repeats)
            elif name == "nixl":
                got = _pair(_nixl_producer, _nixl_consumer, sizes, args.repeats)
            else:
                raise ValueError(f"--transports: unknown {name!r} (ray, mooncake, nixl)")
        except ValueError:
            raise
        except Exception as e:  # missing package or a transport that fails here: say so
            got = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"}
        result["transports"][name] = got
        for size, r in got.items():
            if size == "error":
                print(f"{name:>9}: {r}")
            else:
                print(f"{name:>9} {int(size) / 2**20:8.1f} MiB: {r['median_ms']:8.2f} ms, "
                      f"{r['gib_per_s']:6.2f} GiB/s", flush=True)
    write_result(args, result, "kv-transport")
    return 0
