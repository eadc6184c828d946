"""A model's graph and the shapes and shardings of its parameters, without memory: what
loading, restoring and compiling ahead of time start from."""
from __future__ import annotations

import jax
from flax import nnx

from jaxllm.layers.dtype_policy import DTypePolicy
from jaxllm.models import ArchConfig, get_model_class
from jaxllm.parallel import sharding
from jaxllm.quantization import QuantSpec, quantized_specs


def param_name(path_keys) -> str:
    keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path_keys]
    if keys and keys[-1] == "value":
        keys = keys[:-1]
    return ".".join(keys)


def abstract_model(arch: ArchConfig, policy: DTypePolicy, attention_backend: str, mesh,
                   quant: QuantSpec | None = None, matmul_backend: str | None = None):
    """The model's graph, the shapes of its parameters (no memory) and their shardings on
    `mesh`; arch is the runtime architecture (after tensor-parallel padding)."""
    cls = get_model_class(arch.architecture)
    specs = quantized_specs(cls.param_specs(arch), quant)
    abstract = nnx.eval_shape(lambda: cls(arch, policy, rngs=nnx.Rngs(0),
                                          attention_backend=attention_backend, mesh=mesh,
                                          quant=quant, matmul_backend=matmul_backend))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = jax.tree_util.tree_map_with_path(
        lambda p, leaf: sharding(mesh, *specs[param_name(p)].axes), abstract_state)
    return graphdef, abstract_state, shardings
