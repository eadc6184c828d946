"""`jaxllm bench startup`: start-to-ready of a model from its source (HF safetensors or GGUF)
and from an Orbax checkpoint converted from it, cold (an empty compilation cache) and warm,
each start in a fresh process; and the time to load the weights alone from each format.

Start-to-ready runs from the process's creation (interpreter and imports included) to the
end of LLM(); the engine's own split (load, compile) comes with it. With
--compile-in-background (as `jaxllm serve` starts) LLM() returns once the essential shapes are
compiled; the time every shape is compiled, and a first request's latency, come with it. With
--random-checkpoint CONFIG_DIR the source is a safetensors checkpoint of random weights with
that config's shapes, written first (e.g. benchmarks/configs/llama-3.2-1b). Tokenizer caches
(GGUF tokenizers are built once per file) stay warm in every run."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import percentiles, write_result


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--random-checkpoint", metavar="CONFIG_DIR", default=None,
                   help="start from safetensors of random weights shaped by this directory's "
                        "config.json instead of --model")
    g.add_argument("--warm-runs", type=int, default=2, help="warm starts per format")
    g.add_argument("--load-runs", type=int, default=3, help="weight loads per format")
    g.add_argument("--no-cold", action="store_true",
                   help="leave the cold starts (which fill the cache) out of the report")
    g.add_argument("--work-dir", default=None,
                   help="checkpoints and compilation caches (default: a temporary directory)")
    o = p.add_argument_group("output")
    o.add_argument("--results-dir", default=os.environ.get("OUT") or "benchmarks/results")
    o.add_argument("--tag", default=None)


# child processes: one start or one load, reported as a RESULT line

def _process_seconds() -> float:
    import psutil
    return time.time() - psutil.Process().create_time()


def _child_start(cfg: dict) -> dict:
    t_imports = _process_seconds()
    from jaxllm import SamplingParams
    from jaxllm.config import EngineConfig
    from jaxllm.llm import LLM
    t_llm = _process_seconds()
    llm = LLM(config=EngineConfig(**cfg))
    ready = _process_seconds()
    engine = llm.llm_engine
    compiled_at_ready = engine.runner.compiler.num_compiled
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    first_s = _process_seconds() - ready
    assert len(out[0].outputs[0].token_ids) == 2
    assert engine.runner.wait_compiled()  # with compile_in_background: the rest, after ready
    return {"ready_s": ready, "python_start_s": t_imports, "imports_s": t_llm - t_imports,
            "engine_s": engine.startup_seconds, "load_s": engine.load_seconds,
            "compile_s": engine.compile_seconds, "step_shapes": len(engine.runner.shapes.all),
            "executables_at_ready": compiled_at_ready, "first_request_s": first_s,
            "all_compiled_s": _process_seconds(),
            "compiles_after_warmup": engine.runner.num_compiles_after_warmup}


def _child_load(cfg: dict) -> dict:
    import jax
    from jaxllm.kernels import matmul_backend
    from jaxllm.layers.dtype_policy import resolve_policy
    from jaxllm.loader import load_model
    from jaxllm.parallel import make_mesh
    backend = matmul_backend(jax.default_backend(), cfg["tensor_parallel_size"])
    policy = resolve_policy(cfg["dtype"], jax.default_backend(), backend)
    mesh = make_mesh(cfg["tensor_parallel_size"])  # starts the backend outside the timing
    t = time.perf_counter()
    loaded = load_model(cfg["model"], policy, mesh=mesh, load_tokenizer=False,
                        matmul_backend=backend)
    jax.block_until_ready(loaded.state)
    secs = time.perf_counter() - t
    nbytes = sum(x.nbytes for x in jax.tree.leaves(loaded.state))
    return {"load_s": secs, "bytes": nbytes}


def _spawn(mode: str, cfg: dict) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.startup", mode, json.dumps(cfg)],
                          capture_output=True, text=True, timeout=3600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} of {cfg['model']} failed:\n{proc.stderr[-3000:]}")
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def write_random_checkpoint(config_dir: str, out: str, dtype: str, seed: int = 0) -> str:
    """An HF checkpoint (config.json, model.safetensors, a tokenizer) of random weights with the
    shapes of `config_dir`'s config.json, named as the model family's HF weight map reads them."""
    import ml_dtypes
    from safetensors.numpy import save_file

    from jaxllm.loader.loader import get_tokenizer
    from jaxllm.models import get_model_class
    from jaxllm.models.registry import arch_from_hf

    with open(os.path.join(config_dir, "config.json")) as f:
        hf_cfg = json.load(f)
    arch = arch_from_hf(hf_cfg)
    cls = get_model_class(arch.architecture)
    specs, segments = cls.param_specs(arch), cls.segments(arch)
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}.get(dtype, np.float32)
    # the values do not matter for timing, only that they are not constant
    pool = (np.random.default_rng(seed).standard_normal(1 << 22, np.float32) * 0.02).astype(np_dtype)

    def tensor(name: str, target, layer_axis: bool):
        spec = specs[name]
        shape = list(spec.shape[1:] if layer_axis else spec.shape)
        if target.segment is not None:
            shape[-1] = segments[target.name][target.segment]
        if target.transpose:
            shape = shape[::-1]
        if spec.init != "normal":
            return np.ones(shape, np_dtype) if spec.init == "ones" else np.zeros(shape, np_dtype)
        n = int(np.prod(shape))
        start = (len(tensors) * 7919) % len(pool)
        return np.resize(np.roll(pool, -start), n).reshape(shape)

    weights = cls.HF_WEIGHTS
    tensors: dict[str, np.ndarray] = {}
    for hf_name, target in weights.whole.items():
        if target.name in specs:
            tensors[hf_name] = tensor(target.name, target, False)
    for i in range(arch.num_layers):
        for suffix, target in weights.layer.items():
            if "layers." + target.name in specs:  # biases and q/k norms only where configured
                tensors[f"model.layers.{i}.{suffix}"] = tensor("layers." + target.name, target, True)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_cfg, f)
    # any tokenizer serves start-up timing (prompts are token ids); the default model's
    get_tokenizer(None).save_pretrained(out)
    return out


def run(args) -> int:
    from jaxllm.cli import engine_config_from_args
    from jaxllm.loader.loader import resolve_model_path

    config = engine_config_from_args(args)
    base = dataclasses.asdict(config)
    load_before = os.getloadavg()  # other work on the machine shows in every timing
    work = args.work_dir or tempfile.mkdtemp(prefix="jaxllm-startup-")
    os.makedirs(work, exist_ok=True)
    try:
        if args.random_checkpoint:
            t = time.perf_counter()
            source = write_random_checkpoint(args.random_checkpoint, os.path.join(work, "source"),
                                             config.dtype, config.seed)
            print(f"wrote random weights to {source} in {time.perf_counter() - t:.1f} s", flush=True)
        else:
            source = os.path.abspath(resolve_model_path(config.model))
        orbax_dir = os.path.join(work, "orbax")
        shutil.rmtree(orbax_dir, ignore_errors=True)
        cmd = [sys.executable, "-m", "jaxllm.cli", "convert", source, orbax_dir, "--dtype",
               config.dtype, "--tensor-parallel-size", str(config.tensor_parallel_size)]
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        convert_s = time.perf_counter() - t
        if proc.returncode != 0:
            raise RuntimeError(f"convert failed:\n{proc.stderr[-3000:]}")
        print(f"converted to {orbax_dir} in {convert_s:.1f} s", flush=True)

        formats = {"source": source, "orbax": orbax_dir}
        starts = {}
        for fmt, model in formats.items():
            cache = os.path.join(work, f"xla-{fmt}")
            shutil.rmtree(cache, ignore_errors=True)
            cfg = dict(base, model=model, compilation_cache_dir=cache)
            entry = {}
            cold = _spawn("start", cfg)  # fills the cache for the warm starts
            if not args.no_cold:
                entry["cold"] = cold
                print(f"{fmt} cold: ready in {cold['ready_s']:.1f} s (every shape compiled at "
                      f"{cold['all_compiled_s']:.1f} s)", flush=True)
            entry["warm"] = []
            for _ in range(args.warm_runs):
                entry["warm"].append(_spawn("start", cfg))
                print(f"{fmt} warm: ready in {entry['warm'][-1]['ready_s']:.1f} s", flush=True)
            starts[fmt] = entry
        loads = {fmt: [] for fmt in formats}
        for _ in range(args.load_runs):  # interleaved: drifting machine load hits both alike
            for fmt, model in formats.items():
                loads[fmt].append(_spawn("load", dict(base, model=model))["load_s"])
        print("load s: " + ", ".join(f"{k} {np.median(v):.2f}" for k, v in loads.items()), flush=True)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)

    def summary(runs, key):
        return percentiles([r[key] for r in runs])

    result = {"model": source if not args.random_checkpoint else f"random weights shaped by {args.random_checkpoint}",
              "engine_config": {k: v for k, v in base.items() if k not in ("model", "compilation_cache_dir")},
              "load_average_1m": {"start": load_before[0], "end": os.getloadavg()[0]},
              "convert_s": convert_s, "starts": starts, "weight_load_s": {k: percentiles(v) for k, v in loads.items()}}
    for fmt in formats:
        result[f"{fmt}_warm_ready_s"] = summary(starts[fmt]["warm"], "ready_s")
    result["ratio_orbax_vs_source"] = {
        "weight_load": float(np.median(loads["orbax"]) / np.median(loads["source"])),
        "warm_ready": (result["orbax_warm_ready_s"]["median"] / result["source_warm_ready_s"]["median"]
                       if args.warm_runs else None),
        "cold_ready": (starts["orbax"]["cold"]["ready_s"] / starts["source"]["cold"]["ready_s"]
                       if not args.no_cold else None),
    }
    write_result(args, result, "startup")
    r = result["ratio_orbax_vs_source"]
    print(f"orbax / source: weight load {r['weight_load']:.2f}x, warm start "
          f"{r['warm_ready'] if r['warm_ready'] is None else round(r['warm_ready'], 2)}x, cold start "
          f"{r['cold_ready'] if r['cold_ready'] is None else round(r['cold_ready'], 2)}x")
    return 0


if __name__ == "__main__":
    mode, cfg = sys.argv[1], json.loads(sys.argv[2])
    res = {"start": _child_start, "load": _child_load}[mode](cfg)
    print("RESULT " + json.dumps(res), flush=True)
