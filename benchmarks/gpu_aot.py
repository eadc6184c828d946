"""Compile for an NVIDIA GPU on a machine that has none (XLA's deviceless ahead-of-time path):

* the Pallas kernels at real model shapes, each reported with ptxas' register and spill count
  and the matrix instructions it uses (wgmma, mma.sync or plain FMA); a kernel that asks for
  more shared memory than the GPU has fails here as it would on the device;
* the engine step of a real-shaped model (default Llama-3-8B in bf16 with the Pallas backend)
  at a few (tokens, sequences) shapes: compile time and XLA's memory analysis, and from them
  the KV-cache blocks that gpu_memory_utilization leaves.

Nothing runs, so nothing here is a speed; it shows that the GPU programs build, and how heavy
they are, before a GPU session spends device time on it. Needs JAX's CUDA plugin
(`pip install "jax[cuda13]"`, in its own environment: with it installed, JAX on a CPU-only
machine complains at every start); no GPU, no driver.

    jaxllm bench aot [--target benchmarks/configs/h100-target.txtpb]
        [--model benchmarks/configs/llama-3-8b] [--steps 8192x256,256x256,32x32,1x1]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import os
import re
import shutil
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp

from benchmarks.common import write_result

DUMP = os.path.join(tempfile.gettempdir(), f"jaxllm_aot_{os.getpid()}")

KERNEL_SHAPES = [  # (name, dtype, heads, kv_heads, head_dim, sliding window, soft cap)
    ("llama-3-8b", "bfloat16", 32, 8, 128, None, None),
    ("qwen2.5-7b", "bfloat16", 28, 4, 128, None, None),
    ("llama-3.2-1b", "bfloat16", 32, 8, 64, None, None),
    ("smollm2-135m", "bfloat16", 9, 3, 64, None, None),
    ("llama-3-8b f32", "float32", 32, 8, 128, None, None),
    ("f32 window soft-cap", "float32", 8, 8, 64, 16, 30.0),
    ("phi-2", "bfloat16", 32, 32, 80, None, None),
    ("head size 96", "bfloat16", 28, 4, 96, None, None),
    ("gemma-2-9b", "bfloat16", 16, 8, 256, 4096, 50.0),
    # quantized caches (bf16 queries): int8 / fp8 values and a scale per token and head
    ("llama-3-8b int8 cache", "int8", 32, 8, 128, None, None),
    ("llama-3.2-1b int8 cache", "int8", 32, 8, 64, None, None),
    ("phi-2 fp8 cache", "fp8", 32, 32, 80, None, None),
    ("gemma-2-9b int8 cache", "int8", 16, 8, 256, 4096, 50.0),
]


def _ptxas() -> str | None:
    try:
        import nvidia
    except ImportError:  # a local CUDA install
        return shutil.which("ptxas")
    for root in nvidia.__path__:
        for cand in glob.glob(os.path.join(root, "*", "bin", "ptxas")):
            return cand
    return shutil.which("ptxas")


def _fresh_dump() -> None:
    shutil.rmtree(DUMP, ignore_errors=True)
    os.makedirs(DUMP)


def _report(kernel: str, ptx: str, ptxas_info: str | None) -> dict:
    """A kernel's matrix instructions from its PTX; registers and spills from ptxas' -v."""
    rep = dict(kernel=kernel, matrix="wgmma" if "wgmma.mma_async" in ptx else
               "mma.sync" if "mma.sync" in ptx else "fma")
    if ptxas_info is not None:
        m = re.search(r"Used (\d+) registers", ptxas_info)
        rep["registers"] = int(m.group(1)) if m else None
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_info)
        rep["spill_store_bytes"], rep["spill_load_bytes"] = (
            (int(m.group(1)), int(m.group(2))) if m else (None, None))
    return rep


def _kernel_reports(arch: str) -> list[dict]:
    """ptxas -v over every Pallas (Triton) kernel in XLA's dump."""
    ptxas = _ptxas()
    out = []
    for path in sorted(glob.glob(os.path.join(DUMP, "*.ptx"))):
        if os.path.basename(path).startswith("jaxllm_mosaic_"):
            continue  # Mosaic's own dump: _mosaic_reports
        text = open(path).read()
        names = re.findall(r"\.visible \.entry (jaxllm_\w+)\(", text)
        if names:
            info = subprocess.run([ptxas, f"-arch={arch}", "-v", path, "-o", os.devnull],
                                  capture_output=True, text=True).stderr if ptxas else None
            out.append(_report(names[0], text, info))
    return out


def _mosaic_reports() -> list[dict]:
    """The Mosaic GPU kernels in the dump: Mosaic's own pipeline writes their PTX and ptxas'
    report there (MOSAIC_GPU_DUMP_*, set in run()); each kernel is there once, when first
    compiled."""
    out = []
    for path in sorted(glob.glob(os.path.join(DUMP, "jaxllm_mosaic_*.ptxas"))):
        ptx = path[:-len("ptxas")] + "ptx"
        text = open(ptx).read() if os.path.exists(ptx) else ""
        rep = _report(re.sub(r"_\d+$", "", os.path.basename(path)[:-len(".ptxas")]), text,
                      open(path).read())
        out.append({**rep, "tma": "cp.async.bulk.tensor" in text})
    return out


_LAUNCHING = ("kCustomKernel", "kKernel", "kCustomCall", "kGemm", "kCublasLtMatmul", "kCopy",
              "kMemset32BitValue", "kMemzero", "kSort", "kTriangularSolve", "kFft")


def _launch_report(program: str) -> dict | None:
    """How a compiled program's step reaches the GPU, from XLA's final thunk sequence: the
    command buffers (CUDA graphs, one launch each) and what they hold, and what runs outside
    them: kernels, custom calls (the Pallas kernels), copies, each a launch of its own, and
    conditionals, each of which reads its predicate back to the host before going on (a wait
    for the device). Counted once per thunk; a loop's body is counted once."""
    paths = glob.glob(os.path.join(DUMP, f"*{program}*thunk_sequence_after_thunk_passes.txt"))
    if not paths:
        return None
    top, in_graphs, outside, total, branches = {}, 0, 0, 0, 0
    stack: list[tuple[int, str]] = []  # (indentation, kind) of the enclosing thunks
    for line in open(paths[0]):
        m = re.match(r"(\s*)\d+: (k\w+)", line)
        if not m:
            continue
        depth, kind = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        if not stack:
            top[kind] = top.get(kind, 0) + 1
        captured = any(k == "kCommandBuffer" for _, k in stack)
        if kind in _LAUNCHING:
            total += 1
            if captured:
                in_graphs += 1
            else:
                outside += 1
        elif kind == "kConditional" and not captured:
            branches += 1  # (nested in another's branch too: a wait when that branch runs)
        stack.append((depth, kind))
    return dict(top_level=dict(sorted(top.items())), launches=total,
                launches_in_command_buffers=in_graphs, launches_outside_command_buffers=outside,
                command_buffers=top.get("kCommandBuffer", 0),
                top_level_conditionals=top.get("kConditional", 0),
                conditionals_outside_command_buffers=branches)


_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}


def _hlo_report() -> dict:
    """From the optimized HLO of the step: instructions the compiler rematerialized (each a
    recomputation, matmuls included) and dynamic slices copied out to buffers of 16 MiB or
    more (weights sliced out of their layer stack are what this looks for)."""
    remat, copies = 0, 0
    for path in glob.glob(os.path.join(DUMP, "*jit_forward*after_optimizations.txt")):
        for line in open(path):
            if re.match(r"\s*(ROOT )?%\S+\.remat\d* = ", line):
                remat += 1
            m = re.match(r"%fused_dynamic_slice\S* \(.*\) -> (\w+)\[([\d,]*)\]", line)
            if m:
                size = _BYTES.get(m.group(1), 4)
                for d in filter(None, m.group(2).split(",")):
                    size *= int(d)
                copies += size >= 16 * 2**20
    return dict(rematerialized_instructions=remat, large_dynamic_slice_copies=copies)


_CODES = ("u8", "s8", "f8e4m3fn")


def _dequantized_copies() -> list[dict]:
    """Fusions that read quantized codes and write a float tensor about as large as the codes
    (a dequantized weight in HBM) rather than feeding them to a matmul in the same fusion."""
    found = []
    for path in glob.glob(os.path.join(DUMP, "*jit_forward*after_optimizations.txt")):
        text = open(path).read()
        for comp in re.split(r"\n(?=\S)", text):
            params = re.findall(r"= (u8|s8|f8e4m3fn)\[([\d,]+)\]\{[^}]*\} parameter\(", comp)
            big = [int(np_prod(d)) for t, d in params if int(np_prod(d)) >= 2**20]
            if not big:
                continue
            m = re.search(r"ROOT %\S+ = (bf16|f16|f32)\[([\d,]*)\]\S* (\w[\w-]*)\(", comp)
            if m is None or m.group(3) in ("dot", "custom-call", "convolution"):
                continue
            out = int(np_prod(m.group(2)))
            if out >= max(big) // 2:
                found.append(dict(computation=comp.split(" ", 1)[0], output=f"{m.group(1)}[{m.group(2)}]",
                                  codes=max(big)))
    return found


def np_prod(dims: str) -> int:
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n


def compile_kernels(rep, arch: str) -> list[dict]:
    from jaxllm.layers.attention_metadata import table_width
    from jaxllm.runner.step_programs import abstract_step_inputs
    from pallas_kernels import mosaic_paged_attention as mosaic
    from pallas_kernels.ragged_paged_attention import q_tile, ragged_paged_attention

    T, S, bs, max_len, blocks, layers = 512, 64, 16, 4096, 2048, 2
    rows = []
    from jaxllm.quantization import kv as kvq
    for name, dtype, H, KVH, D, window, cap in KERNEL_SHAPES:
        values = kvq.storage_dtype(dtype) if dtype in kvq.KV_CACHE_DTYPES else None
        dt = jnp.dtype(jnp.bfloat16 if values is not None else dtype)
        sds = lambda shape, d: jax.ShapeDtypeStruct(shape, d, sharding=rep)  # noqa: E731
        md = abstract_step_inputs(T, S, bs, q_tile(H // KVH))[1]
        md = dataclasses.replace(md, block_tables=jax.ShapeDtypeStruct(
            (S, table_width(max_len, bs)), jnp.int32))
        md = jax.tree.map(lambda x: sds(x.shape, x.dtype), md)
        shape = (layers, 2, KVH, blocks * bs, D)
        cache = (sds(shape, dt) if values is None else
                 kvq.QuantizedKV(sds(shape, values), sds(shape[:-1], jnp.float32)))
        for kernels in ("triton", "mosaic"):
            if kernels == "mosaic" and mosaic.supports(dt, D, values):
                continue
            fn = jax.jit(lambda q, c, md, D=D, window=window, cap=cap, k=kernels:
                         ragged_paged_attention(q, c, 1, md, D ** -0.5, window, cap, kernels=k))
            _fresh_dump()
            row = dict(shape=name, family=kernels, dtype=dtype, heads=H, kv_heads=KVH,
                       head_dim=D)
            t0 = time.perf_counter()
            try:
                fn.lower(sds((T, H, D), dt), cache, md).compile()
                row["compile_s"] = round(time.perf_counter() - t0, 2)
                row["kernels"] = _kernel_reports(arch) if kernels == "triton" else _mosaic_reports()
            except Exception as e:  # a kernel that does not build is the finding
                row["error"] = str(e).splitlines()[0][:400]
            rows.append(row)
            print(row, flush=True)
    return rows


def compile_steps(mesh, device_memory: int, args) -> dict:
    from jaxllm.engine.kv_sizing import kv_budget_bytes
    from jaxllm.kernels import matmul_backend
    from jaxllm.layers.dtype_policy import uniform_policy
    from jaxllm.loader.abstract import abstract_model
    from jaxllm.models.registry import arch_from_hf, get_model_class
    from jaxllm.parallel import plan, platform_of, runtime_arch, sharding
    from jaxllm.runner.kv_cache import kv_bytes_per_block, kv_cache_sharding
    from jaxllm.layers.attention_metadata import kv_cache_shape, table_width
    from jaxllm.runner.step_programs import (abstract_sample_inputs, abstract_step_inputs,
                                             build_forward, build_sample, packed_step,
                                             step_compiler_options, step_scratch_bytes)
    from jaxllm.runner.sampler import init_state
    import json

    with open(os.path.join(args.model, "config.json")) as f:
        ckpt_arch = arch_from_hf(json.load(f))
    if args.enable_expert_parallel:
        ckpt_arch = dataclasses.replace(ckpt_arch, expert_parallel=True)
    arch = runtime_arch(ckpt_arch, plan(ckpt_arch, mesh.size))
    dtype = jnp.dtype(args.dtype)
    quant = None
    if args.quantization:
        from jaxllm import quantization as qm
        specs = get_model_class(arch.architecture).param_specs(arch)
        layouts = {n: lay for n, sp in specs.items()
                   if (lay := qm.online_layout(args.quantization, n, sp)) is not None}
        quant = qm.QuantSpec(args.quantization, tuple(sorted(layouts.items())),
                             matmul_backend(platform_of(mesh), mesh.size))
    graphdef, abstract_state, shardings = abstract_model(arch, uniform_policy(dtype),
                                                         args.attention_backend, mesh, quant)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         abstract_state, shardings)
    # per device: each holds its shard of every weight
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state)) // mesh.size
    from jaxllm.quantization import kv as kvq
    rep = sharding(mesh)
    bs = args.block_size
    width = table_width(args.max_model_len, bs)
    qt_of = lambda T: (__import__("jaxllm.layers.attention", fromlist=["q_tile_size"])  # noqa: E731
                       .q_tile_size(T, args.attention_backend, arch.num_heads // arch.num_kv_heads))
    steps = [tuple(int(v) for v in s.split("x")) for s in args.steps.split(",")]
    max_seqs = max(S for _, S in steps)
    from jaxllm.runner.buckets import step_shapes
    # (a square shape is decode-only in the GPU shape set: no prefill tiles)
    step_set = step_shapes("gpu", max(T for T, _ in steps), max_seqs)
    sampler = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep),
                           jax.eval_shape(lambda: init_state(max_seqs, arch.vocab_size)))
    tables = jax.ShapeDtypeStruct((max_seqs + 1, width), jnp.int32, sharding=rep)

    def cache(num_blocks):
        shapes = jax.eval_shape(lambda: kvq.make_cache(kv_cache_shape(arch, num_blocks, bs), dtype,
                                                       args.kv_cache_dtype))
        return shapes, kv_cache_sharding(mesh, arch, shapes)

    forward = build_forward(graphdef, arch.vocab_size, shardings, cache(2)[1], rep)
    sample = build_sample(rep)

    def compile_one(T, S, num_blocks):
        shapes, kv_sh = cache(num_blocks)
        kv = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, kv_sh)
        ins = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep),
                           abstract_step_inputs(T, S, bs, qt_of(T),
                                                num_tile_slots=step_set.tiles(T, S, qt_of(T))))
        t0 = time.perf_counter()
        exe = forward.lower(state, kv, tables, sampler, *packed_step(ins)).compile(
            step_compiler_options("gpu"))
        return exe, time.perf_counter() - t0

    def compile_sample(S):
        ins = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep),
                           abstract_sample_inputs(S, arch.vocab_size,
                                                  abstract_step_inputs(S, S, bs, qt_of(S))[-1]))
        logits, smd, mask, use = ins
        return sample.lower(logits, sampler, smd, mask, use).compile(step_compiler_options("gpu"))

    # as the engine sizes the cache: a 2-block probe of the largest step measures its scratch
    # (its forward pass and its sampling are two compiled calls)
    T_max, S_max = max(steps)
    _fresh_dump()
    probe, _ = compile_one(T_max, S_max, 2)
    scratch = step_scratch_bytes(probe, compile_sample(S_max), S_max, arch.vocab_size)
    # (sampling compiles once per sequence count: a later step of S_max sequences reuses it)
    sample_launches = {S_max: _launch_report("jit_sample_step")}
    per_block = kv_bytes_per_block(arch, bs, dtype, args.kv_cache_dtype)
    # the engine gives JAX's allocator gpu_memory_utilization of the device, then sizes the cache
    util = args.gpu_memory_utilization
    budget = kv_budget_bytes(int(util * device_memory), weight_bytes, scratch, util, util)
    num_blocks = max(2, budget // (per_block // mesh.size))  # per device, as the engine does
    rows = []
    for T, S in steps:
        _fresh_dump()
        exe, secs = compile_one(T, S, num_blocks)
        compile_sample(S)  # (into the same dump: its launches)
        ma = exe.memory_analysis()
        kernels = _kernel_reports(args.arch) + _mosaic_reports()
        # the Mosaic kernels compiled for this step: one per call site (layers unrolled) or
        # one per distinct kernel
        mosaic_compiles = len(glob.glob(os.path.join(DUMP, "jaxllm_mosaic_*.ptxas")))
        rows.append(dict(tokens=T, seqs=S, compile_s=round(secs, 1), **_hlo_report(),
                         mosaic_kernel_compiles=mosaic_compiles,
                         dequantized_weight_copies=_dequantized_copies(),
                         launches=dict(forward=_launch_report("jit_forward"),
                                       sample=(_launch_report("jit_sample_step")
                                               or sample_launches.get(S))),
                         temp_gib=round(ma.temp_size_in_bytes / 2**30, 3),
                         argument_gib=round(ma.argument_size_in_bytes / 2**30, 3),
                         output_gib=round(ma.output_size_in_bytes / 2**30, 3),
                         alias_gib=round(ma.alias_size_in_bytes / 2**30, 3),
                         pallas_kernels=sorted({k["kernel"] for k in kernels})))
        print(rows[-1], flush=True)
    return dict(model=args.model, dtype=args.dtype, attention_backend=args.attention_backend,
                quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                weight_gib=round(weight_bytes / 2**30, 3), step_scratch_gib=round(scratch / 2**30, 3),
                kv_blocks=num_blocks, kv_tokens=(num_blocks - 1) * bs,
                kv_gib_per_device=round(num_blocks * per_block / mesh.size / 2**30, 3),
                gpu_memory_utilization=args.gpu_memory_utilization, steps=rows)


def add_args(p: argparse.ArgumentParser) -> None:
    configs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
    p.add_argument("--target", default=os.path.join(configs, "h100-target.txtpb"),
                   help="XLA GPU target description (device limits, compute capability)")
    p.add_argument("--arch", default="sm_90a", help="ptxas architecture for the register report")
    p.add_argument("--model", default=os.path.join(configs, "llama-3-8b"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "w8a8", "fp8"],
                   help="compile the step with weights quantized this way (weight bytes and any "
                        "dequantized copy of a weight in the compiled program are reported)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"])
    p.add_argument("--attention-backend", default="pallas",
                   choices=["pallas", "pallas-mosaic", "pallas-triton", "xla"],
                   help="pallas: chosen for the target GPU and cache as the engine chooses")
    p.add_argument("--steps", default="8192x256,256x256,32x32,1x1",
                   help="TOKENSxSEQS step shapes to compile ('' to skip the engine step)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="compile the step for this many GPUs of the target kind")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="a mixture-of-experts model's experts split whole over those GPUs")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--on-device", action="store_true",
                   help="compile for the GPUs of this machine instead of --target, with its "
                        "driver (what XLA captures in command buffers may depend on it); "
                        "nothing runs")
    p.add_argument("--results-dir", default=os.environ.get("OUT") or "benchmarks/results")
    p.add_argument("--tag", default=None)


def run(args) -> None:
    if jax._src.xla_bridge.backends_are_initialized():
        raise RuntimeError("jaxllm bench aot must set XLA_FLAGS before JAX starts a backend")
    # the CUDA plugin's version checks look for a driver; the dump holds the PTX
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={DUMP}".strip()
    # the Mosaic GPU kernels' PTX and ptxas report, from their own compiler
    os.environ.update(MOSAIC_GPU_DUMP_TO=DUMP, MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1")
    from jax.experimental import topologies
    from jaxllm.parallel import make_mesh, sharding

    if args.on_device:  # the GPUs here: their driver decides what command buffers capture
        devices = jax.devices()
        if devices[0].platform != "gpu":
            raise SystemExit(f"--on-device compiles for the GPUs here; this machine's JAX "
                             f"sees {devices[0].platform} devices")
        devices = devices[:args.tensor_parallel_size]
        compute_capability = getattr(devices[0], "compute_capability", None)
        memory = int((devices[0].memory_stats() or {}).get("bytes_limit", 0))
        target = None
    else:
        with open(args.target) as f:
            target = f.read()
        try:
            devices = topologies.get_topology_desc(
                platform="cuda", target_config=target,
                topology=f"1x1x{args.tensor_parallel_size}").devices
        except Exception as e:
            raise SystemExit(f"no CUDA compiler here ({e}); install JAX's CUDA plugin: "
                             'pip install "jax[cuda13]"') from e
        cc = re.search(r"cuda_compute_capability\s*{\s*major:\s*(\d+)(?:\s*minor:\s*(\d+))?",
                       target)
        compute_capability = f"{cc.group(1)}.{cc.group(2) or 0}" if cc else None
        memory = int(re.search(r"device_memory_size:\s*(\d+)", target).group(1))
    if args.attention_backend == "pallas":  # as the engine would choose on this GPU
        from jaxllm.kernels import attention_backend
        from jaxllm.quantization import kv as kvq
        args.attention_backend = attention_backend(
            "pallas", "gpu", jnp.dtype(args.dtype), kvq.storage_dtype(args.kv_cache_dtype),
            compute_capability=compute_capability)[0]
    mesh = make_mesh(args.tensor_parallel_size, devices=devices)
    device = devices[0].device_kind
    print(f"deviceless target: {device} ({memory / 2**30:.1f} GiB), jax {jax.__version__}",
          flush=True)
    result = dict(device=device, deviceless=not args.on_device, jax=jax.__version__,
                  target=None if args.on_device else args.target,
                  tensor_parallel_size=args.tensor_parallel_size)
    if not args.skip_kernels:
        result["kernels"] = compile_kernels(sharding(mesh), args.arch)
    if args.steps:
        result["engine_step"] = compile_steps(mesh, memory, args)
    tp = f"tp{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    if args.enable_expert_parallel:
        tp += "-ep"
    result["model"] = os.path.basename(os.path.normpath(args.model))
    model = None if result["model"] == "llama-3-8b" else result["model"]
    args.tag = args.tag or "_".join(x for x in ["aot", model, datetime.date.today().isoformat(),
                                                device.replace(" ", "-"), tp, args.quantization,
                                                None if args.kv_cache_dtype == "auto" else f"kv-{args.kv_cache_dtype}",
                                                None if args.on_device else "deviceless"]
                                               if x)
    write_result(args, result, "aot")
    shutil.rmtree(DUMP, ignore_errors=True)
