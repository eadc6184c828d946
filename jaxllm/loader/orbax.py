"""Orbax checkpoints of the engine's own parameter layout.

`jaxllm convert` loads a model once (HF safetensors or GGUF: read, dequantized, cast,
stacked, padded and fused for its tensor-parallel size) and writes the resulting state with
orbax-checkpoint, with the tokenizer and a metadata file. `LLM(model=dir)` restores it straight
into the mesh's shardings: each device reads only its shard of every array, nothing is
transformed on the host.

The state is saved as a flat {name: array} dict (names from the pytree path, e.g.
`layers.wqkv`), not as an NNX State: the names stay stable across Flax's pytree
representations, and any leaf (quantized ints, scales, nested nodes) is just another entry.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxllm import quantization as qmethods
from jaxllm.kernels.cpu.panels import pack_state
from jaxllm.loader.abstract import abstract_model
from jaxllm.models import ArchConfig

logger = logging.getLogger(__name__)

METADATA_FILE = "jaxllm_checkpoint.json"
PARAMS_DIR = "params"
FORMAT = "jaxllm-orbax"
# Bump when a model's parameter layout (names, stacking, fusing, padding) changes: older
# checkpoints are then refused with the command that converts them again.
LAYOUT_VERSION = 1


@contextlib.contextmanager
def _quiet_orbax():
    """orbax logs several INFO lines (through absl) per array it reads or writes."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        log.setLevel(level)


def is_orbax_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def _key(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def flatten(tree) -> tuple[list[str], list, object]:
    """(dotted leaf names, leaves, treedef); an NNX Variable's trailing `value` is dropped."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = []
    for path, _ in with_path:
        keys = [_key(k) for k in path]
        if len(keys) > 1 and keys[-1] == "value":
            keys = keys[:-1]
        names.append(".".join(keys))
    if len(set(names)) != len(names):
        raise ValueError("parameter names collide after flattening the model state")
    return names, [leaf for _, leaf in with_path], treedef


def read_metadata(path: str) -> dict:
    file = os.path.join(path, METADATA_FILE)
    try:
        with open(file) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the checkpoint metadata {file}: {e}") from e
    keys = ("format", "layout_version", "architecture", "tensor_parallel_size", "params")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or any(k not in meta for k in keys):
        raise ValueError(f"{file} is not jaxllm checkpoint metadata (it needs format={FORMAT!r} "
                         f"and the keys {', '.join(keys)})")
    return meta


def convert_command(meta: dict, path: str, tensor_parallel_size: int | None = None,
                    quantization: str | None = None, smoothquant_alpha: float | None = None) -> str:
    """The command that writes this checkpoint again (for another layout when given)."""
    tp = tensor_parallel_size or meta.get("tensor_parallel_size", 1)
    quant = quantization if quantization is not None else meta.get("quantization")
    if smoothquant_alpha is None and quant == meta.get("quantization"):
        smoothquant_alpha = (meta.get("smoothquant") or {}).get("alpha")
    parts = ["jaxllm convert", meta.get("source") or "MODEL", path]
    if meta.get("dtype"):
        parts.append(f"--dtype {meta['dtype']}")
    if quant:
        parts.append(f"--quantization {quant}")
    if smoothquant_alpha is not None and quant == "w8a8":
        parts.append(f"--smoothquant-alpha {smoothquant_alpha:g}")
    if tp != 1 or tensor_parallel_size is not None:
        parts.append(f"--tensor-parallel-size {tp}")
    return " ".join(parts)


def check_compatible(meta: dict, path: str, tensor_parallel_size: int,
                     quantization: str | None = None, smoothquant_alpha: float | None = None) -> None:
    """Refuse a checkpoint whose layout this engine cannot run, saying how to convert again.
    `quantization` None accepts the checkpoint's own, as does `smoothquant_alpha` None (the
    smoothing is part of the stored weights: a checkpoint holds one alpha's or none)."""
    from jaxllm import __version__
    if meta["layout_version"] != LAYOUT_VERSION:
        raise ValueError(
            f"{path} was written by jaxllm {meta.get('jaxllm_version', '?')} with parameter "
            f"layout {meta['layout_version']}; jaxllm {__version__} reads layout {LAYOUT_VERSION}. "
            f"Convert it again: {convert_command(meta, path)}")
    tp = meta["tensor_parallel_size"]
    if tp != tensor_parallel_size:
        raise ValueError(
            f"{path} was converted for tensor_parallel_size={tp} (its padded and fused shapes are "
            f"laid out for {tp} devices) but the engine runs tensor_parallel_size="
            f"{tensor_parallel_size}. Convert again for it: "
            f"{convert_command(meta, path + '-tp' + str(tensor_parallel_size), tensor_parallel_size)}")
    stored = meta.get("quantization")
    # None runs the checkpoint as written; "none" asks for float weights
    if quantization is not None and (None if quantization == "none" else quantization) != stored:
        raise ValueError(
            f"{path} holds {'unquantized' if stored is None else repr(stored)} weights but "
            f"quantization={quantization!r} was asked. Leave quantization unset, or convert "
            f"again: {convert_command(meta, path, quantization=quantization)}")
    smoothed = (meta.get("smoothquant") or {}).get("alpha")
    if smoothquant_alpha is not None and smoothquant_alpha != smoothed:
        held = ("no SmoothQuant vectors" if smoothed is None
                else f"SmoothQuant vectors of alpha {smoothed:g}")
        again = convert_command(meta, path + "-sq", quantization="w8a8",
                                smoothquant_alpha=smoothquant_alpha)
        raise ValueError(
            f"{path} holds {held} but smoothquant_alpha={smoothquant_alpha:g} was asked (smoothing "
            f"is made when converting). Leave smoothquant_alpha unset, or convert again: {again}")


def quant_spec(meta: dict, backend: str, int4_activations: str = "float"):
    """The QuantSpec of a checkpoint's quantized matrices (None: float weights), with the
    matmul backend of the mesh it is restored onto and the engine's int4 activations (not
    properties of the stored layout)."""
    layouts = meta.get("quant_layouts")
    if not meta.get("quantization"):
        return None
    if not isinstance(layouts, dict) or not layouts:
        raise ValueError(f"{METADATA_FILE} names quantization {meta['quantization']!r} but not how "
                         f"its matrices are stored (quant_layouts); convert it again: "
                         f"{convert_command(meta, 'OUT')}")
    try:
        parsed = tuple(sorted((n, qmethods.QuantLayout(**lay)) for n, lay in layouts.items()))
    except TypeError as e:
        raise ValueError(f"unreadable quant_layouts in {METADATA_FILE}: {e}; convert it again: "
                         f"{convert_command(meta, 'OUT')}") from e
    return qmethods.QuantSpec(meta["quantization"], parsed, backend, int4_activations)


def _check_params(meta: dict, path: str, names: list[str], abstract: list) -> None:
    stored = meta["params"]
    hint = f"convert it again: {convert_command(meta, path)}"
    missing = [n for n in names if n not in stored]
    extra = [n for n in stored if n not in set(names)]
    if missing or extra:
        raise ValueError(f"{path} does not match the model it describes (missing: "
                         f"{', '.join(missing) or 'none'}; unexpected: {', '.join(extra) or 'none'}); {hint}")
    for name, leaf in zip(names, abstract):
        shape, dtype = tuple(stored[name]["shape"]), np.dtype(stored[name]["dtype"])
        if shape != tuple(leaf.shape):
            raise ValueError(f"{path}: parameter {name} has shape {shape} but the model expects "
                             f"{tuple(leaf.shape)}; {hint}")
        want = np.dtype(leaf.dtype)
        # floats are cast to the engine's dtype policy on the way in; integer (quantized)
        # data never is
        floats = all(jax.numpy.issubdtype(d, jax.numpy.floating) for d in (dtype, want))
        if dtype != want and not floats:
            raise ValueError(f"{path}: parameter {name} is stored as {dtype} but the model "
                             f"expects {want}; {hint}")


def _root_cause(e: BaseException) -> str:
    """The innermost error: tensorstore's says what is wrong with which file, orbax's wrappers
    print whole specs."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {str(e)[:300]}"


def restore(path: str, policy, attention_backend: str, mesh, quant=None, progress: bool = True,
            matmul_backend: str | None = None):
    """(runtime architecture, graphdef, state, metadata) of an Orbax checkpoint, restored into
    the shardings of `mesh`: each device reads its own shards. `quant` is quant_spec(meta)."""
    import orbax.checkpoint as ocp

    meta = read_metadata(path)
    check_compatible(meta, path, mesh.size)
    try:
        arch = ArchConfig(**meta["architecture"])
    except TypeError as e:
        raise ValueError(f"{path}: unreadable architecture in {METADATA_FILE}: {e}") from e
    graphdef, abstract_state, shardings = abstract_model(arch, policy, attention_backend, mesh, quant,
                                                         matmul_backend)
    names, abstract, treedef = flatten(abstract_state)
    _check_params(meta, path, names, abstract)
    targets = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
               for a, s in zip(abstract, jax.tree.leaves(shardings))]
    params = os.path.join(os.path.abspath(path), PARAMS_DIR)
    total = sum(int(np.prod(t.shape)) * np.dtype(meta["params"][n]["dtype"]).itemsize
                for n, t in zip(names, targets))
    start = time.perf_counter()
    arrays = []
    bar = tqdm(total=total, desc="restoring weights", unit="B", unit_scale=True,
               disable=not progress)
    # one partial restore per array: a progress bar at no measurable cost (orbax reads the
    # shards of each array concurrently)
    with _quiet_orbax(), ocp.PyTreeCheckpointer() as ckptr:
        for name, target in zip(names, targets):
            item = {name: target}
            try:
                out = ckptr.restore(params, args=ocp.args.PyTreeRestore(
                    item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                    partial_restore=True))
            except Exception as e:  # orbax and tensorstore raise many kinds; say which array
                raise ValueError(f"cannot restore {name} from {params}: {_root_cause(e)} "
                                 f"(incomplete or corrupt checkpoint? convert it again: "
                                 f"{convert_command(meta, path)})") from e
            arrays.append(out[name])
            bar.update(int(np.prod(target.shape)) * np.dtype(meta["params"][name]["dtype"]).itemsize)
    bar.close()
    state = jax.block_until_ready(jax.tree_util.tree_unflatten(treedef, arrays))
    logger.info("restored %d arrays (%.2f GiB) from %s in %.2f s", len(arrays), total / 2**30,
                path, time.perf_counter() - start)
    return arch, graphdef, state, meta


def save(loaded, out: str, *, dtype: str, source: str, load_format: str = "auto") -> str:
    """Write a loaded model (jaxllm.loader.LoadedModel) as a checkpoint directory `out`."""
    import orbax.checkpoint as ocp

    from jaxllm import __version__
    out = os.path.abspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"output directory {out} already exists and is not empty")
    # a CPU engine's bf16 layer stacks and w8a8 codes are packed for its kernels: the
    # checkpoint holds them as any other engine reads them
    names, leaves, _ = flatten(pack_state(loaded.state, pack=False))
    start = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    # uncompressed: weights shrink little under zstd and decompressing slows every start
    with _quiet_orbax(), ocp.PyTreeCheckpointer(use_compression=False) as ckptr:
        ckptr.save(os.path.join(out, PARAMS_DIR), dict(zip(names, leaves)))
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(out)
    else:
        logger.warning("%s has no tokenizer; the checkpoint takes token-id prompts only", source)
    meta = {
        "format": FORMAT,
        "layout_version": LAYOUT_VERSION,
        "jaxllm_version": __version__,
        "source": source,
        "load_format": load_format,
        "dtype": dtype,
        # the method the weights were loaded with (a GGUF or AWQ checkpoint's own, or the
        # online one asked for) and how each quantized matrix is stored
        "quantization": loaded.quant.method if loaded.quant is not None else None,
        "quant_layouts": ({n: dataclasses.asdict(lay) for n, lay in loaded.quant.layouts}
                          if loaded.quant is not None else None),
        # SmoothQuant's alpha and calibration when the w8a8 matrices carry smoothing vectors
        "smoothquant": loaded.smoothquant,
        "tensor_parallel_size": loaded.mesh.size,
        "tokenizer": loaded.tokenizer is not None,
        # the runtime architecture: shapes already padded / repeated for tensor_parallel_size
        "architecture": dataclasses.asdict(loaded.arch),
        "params": {n: {"shape": list(x.shape), "dtype": np.dtype(x.dtype).name}
                   for n, x in zip(names, leaves)},
        "versions": {"jax": jax.__version__, "orbax-checkpoint": ocp.__version__},
    }
    # written last: a directory without it is not a checkpoint (an interrupted convert)
    with open(os.path.join(out, METADATA_FILE), "w") as f:
        json.dump(meta, f, indent=1)
    nbytes = sum(x.nbytes for x in leaves)
    logger.info("wrote %d arrays (%.2f GiB) to %s in %.2f s", len(leaves), nbytes / 2**30, out,
                time.perf_counter() - start)
    return out
