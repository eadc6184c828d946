"""Compiled step executables kept on disk, keyed without tracing.

JAX's persistent cache skips XLA's compile on a second start, but finds its entry by tracing
and lowering the function again, which on a CPU is most of the start-up and holds the GIL.
This cache stores the serialized executable itself under a key made of everything the trace
depends on:

- the code: every source file of the jaxllm package, and the versions of jax, jaxlib and flax;
- the platform: backend, its version, the devices, the process count;
- the settings that change a trace: JAX's tracing flags and the JAX_/XLA_ variables (jaxllm's
  own settings reach a trace through the model's static attributes, below);
- the function: its qualified name and, recursively, the values its closure holds (a model's
  graph definition with its static attributes, sizes, shardings, nested functions);
- the call: each argument's tree structure, shape, dtype and sharding, and the compiler options.

Whatever cannot be described deterministically (a repr with an object address) makes the call
uncachable: it compiles as without the cache. A bad or unreadable entry is removed and compiled again.
`EngineConfig.executable_cache=False` turns the cache off.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import logging
import os
import pickle
import re
import tempfile
import threading
import types
from collections.abc import Mapping

import jax
import numpy as np

from jaxllm.kernels.cpu import build as cpu_build

logger = logging.getLogger("jaxllm")

ENV_PREFIXES = ("JAX_", "XLA_")
# variables that name where things are kept, not what is computed
ENV_IGNORED = {"JAX_COMPILATION_CACHE_DIR"}
ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
FORMAT = 2  # bump when what an entry holds changes

_directory: str | None = None

# XLA:CPU cannot serialize whole an executable that JAX's persistent cache loaded (a later
# load misses its functions: "Function ... not found"), so an executable that came from there
# is not kept. JAX reports its cache hits as events, in the compiling thread.
_compiling = threading.local()
JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"


def _on_event(event: str, **_) -> None:
    if event == JAX_CACHE_HIT:
        _compiling.from_jax_cache = True


jax.monitoring.register_event_listener(_on_event)


def configure(cache_dir: str | None) -> None:
    """Keep executables under cache_dir/executables (None: off)."""
    global _directory
    _directory = os.path.join(cache_dir, "executables") if cache_dir else None


def enabled() -> bool:
    return _directory is not None


class Uncachable(Exception):
    """A value whose description would differ between processes."""


PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the directories whose modules a trace runs: the engine and the Pallas kernels
SOURCES = ("jaxllm", "pallas_kernels")


def fingerprint_of(roots) -> str:
    """The sources under roots (Python and the CPU kernels' C++) and the libraries tracing runs."""
    import flax
    import jaxlib
    h = hashlib.sha256()
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if name.endswith((".py", ".cc", ".h")):
                    path = os.path.join(dirpath, name)
                    h.update(os.path.relpath(path, os.path.dirname(root)).encode())
                    with open(path, "rb") as f:
                        h.update(hashlib.sha256(f.read()).digest())
    h.update(f"jax {jax.__version__} jaxlib {jaxlib.__version__} flax {flax.__version__}".encode())
    return h.hexdigest()


# taken when the package is imported: the code that runs is the code that was imported (an
# edit after that must not lend its key to executables traced from the old code)
_FINGERPRINT = fingerprint_of([os.path.join(PROJECT, d) for d in SOURCES])


def code_fingerprint() -> str:
    return _FINGERPRINT


def _plain(v) -> bool:
    if isinstance(v, (tuple, list)):
        return all(_plain(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str, enum.Enum))


IGNORED_SETTINGS = ("compilation_cache", "persistent_cache", "log")


def environment() -> str:
    """What of the process' settings reaches a trace."""
    from jax._src import config as jax_config
    devices = jax.devices()
    backend = devices[0].client
    flags = [v for v in jax_config.trace_context() if _plain(v)]
    settings = sorted((k, v) for k, v in jax.config.values.items()
                      if _plain(v) and not any(w in k for w in IGNORED_SETTINGS))
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith(ENV_PREFIXES) and k not in ENV_IGNORED)
    machine = ""
    if backend.platform == "cpu":  # kernels built for this CPU's instructions
        machine = cpu_build.cpu_signature()
    return repr((FORMAT, code_fingerprint(), backend.platform, backend.platform_version, machine,
                 [(d.id, d.device_kind, d.process_index) for d in devices],
                 jax.process_count(), flags, settings, env))


def _code_hash(code: types.CodeType) -> str:
    """A function's bytecode and constants, nested functions' code included (two lambdas of
    one scope share a qualified name, not their code)."""
    h = hashlib.sha256(code.co_code)
    for c in code.co_consts:
        h.update((_code_hash(c) if isinstance(c, types.CodeType) else repr(c)).encode())
    h.update(repr(code.co_names).encode())
    return h.hexdigest()[:16]


def describe(v, depth: int = 0) -> str:
    """A deterministic text of a value the trace depends on. An allow-list: a value of any
    other kind (an object whose repr might leave out what matters) is Uncachable."""
    if depth > 16:
        raise Uncachable("nested too deeply")
    d = functools.partial(describe, depth=depth + 1)
    if isinstance(v, jax.ShapeDtypeStruct) or (isinstance(v, jax.Array) and not depth):
        return (f"{type(v).__name__}({v.shape}, {v.dtype}, weak={getattr(v, 'weak_type', False)}, "
                f"{d(getattr(v, 'sharding', None))})")
    if isinstance(v, (jax.Array, np.ndarray, np.generic)):  # a constant the trace bakes in
        a = np.asarray(v)
        return f"array({a.shape}, {a.dtype}, {hashlib.sha256(a.tobytes()).hexdigest()})"
    if _plain(v) and not isinstance(v, (tuple, list)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return f"{type(v).__name__}[{', '.join(d(x) for x in v)}]"
    if isinstance(v, Mapping):
        return f"{type(v).__name__}{{" + ", ".join(f"{d(k)}: {d(x)}" for k, x in v.items()) + "}"
    if isinstance(v, types.FunctionType):
        code = v.__code__
        body = _code_hash(code)
        cells = [d(c.cell_contents) for c in (v.__closure__ or ())]
        return (f"fn {v.__module__}.{v.__qualname__}:{code.co_firstlineno}:{body}"
                f"({', '.join(cells)}; {d(v.__defaults__)}; {d(v.__kwdefaults__)})")
    if isinstance(v, functools.partial):
        return f"partial({d(v.func)}, {d(v.args)}, {d(v.keywords)})"
    if hasattr(v, "__wrapped__") and hasattr(v, "_jit_info"):  # a jitted function
        return f"jit {v._jit_info!r} {d(v.__wrapped__)}"
    if isinstance(v, type) or isinstance(v, np.dtype):  # a dtype or a class
        return repr(v)
    if isinstance(v, jax.sharding.Mesh):
        return f"Mesh({v.axis_names}, {v.axis_sizes}, {v.device_ids.tolist()}, {v.axis_types})"
    if isinstance(v, jax.sharding.NamedSharding):
        return f"NamedSharding({d(v.mesh)}, {v.spec!r}, {v.memory_kind!r})"
    if isinstance(v, jax.sharding.PartitionSpec):
        return repr(v)
    if type(v).__name__ == "GraphDef" and hasattr(v, "attributes"):  # an nnx model's structure
        return f"GraphDef({v.nodes!r}, {d(list(v.attributes))})"
    if type(v).__module__.startswith("flax.nnx") and not dataclasses.is_dataclass(v):
        text = repr(v)  # the graph's own records (node and attribute kinds): no values
        if type(v).__name__ not in ("NodeAttr", "LeafAttr") or ADDRESS.search(text):
            raise Uncachable(f"{type(v).__name__}")
        return text
    if dataclasses.is_dataclass(v) and not isinstance(v, type):  # every field, shown or not
        return (f"{type(v).__module__}.{type(v).__qualname__}("
                + ", ".join(f"{f.name}={d(getattr(v, f.name))}" for f in dataclasses.fields(v)) + ")")
    raise Uncachable(f"a {type(v).__module__}.{type(v).__qualname__}")


def key_of(fn, args: tuple, options) -> str:
    leaves, tree = jax.tree.flatten(args)
    # arguments are described by shape (depth 0): their values are inputs, not constants
    text = "\n".join([environment(), describe(fn), repr(options), str(tree),
                      *(describe(x) for x in leaves)])
    if ADDRESS.search(text):
        raise Uncachable("an object address in the description")
    return hashlib.sha256(text.encode()).hexdigest()


def compile(fn, *args, options=None):
    """fn.lower(*args).compile(options), from disk when this exact executable was kept."""
    if _directory is None or jax.process_count() > 1:
        return fn.lower(*args).compile(options)
    from jax.experimental import serialize_executable
    try:
        key = key_of(fn, args, options)
    except Uncachable as e:
        logger.debug("executable cache: %s is not cachable (%s)", getattr(fn, "__name__", fn), e)
        return fn.lower(*args).compile(options)
    path = os.path.join(_directory, key[:2], key)
    if os.path.exists(path):
        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree, device_ids = pickle.loads(f.read())
            # the devices it was compiled for: by default a loaded executable would span every
            # device of the process (a one-device step on a machine of eight)
            by_id = {d.id: d for d in jax.devices()}
            return serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
        except Exception as e:  # noqa: BLE001  (a bad entry costs a compile, nothing else)
            logger.warning("executable cache: dropping unreadable entry %s (%s)", path, e)
            try:
                os.remove(path)
            except OSError:
                pass
    _compiling.from_jax_cache = False
    compiled = fn.lower(*args).compile(options)
    if _compiling.from_jax_cache:
        logger.debug("executable cache: %s came from JAX's cache, not kept", path)
        return compiled
    try:
        device_ids = [d.id for d in compiled.runtime_executable().local_devices()]
        blob = pickle.dumps((*serialize_executable.serialize(compiled), device_ids))
    except Exception as e:  # noqa: BLE001  (some executables cannot be serialized)
        logger.debug("executable cache: not kept (%s)", e)
        return compiled
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)  # atomic: a reader sees a whole entry or none
    except OSError as e:  # a full or read-only disk costs the next start a compile, no more
        logger.warning("executable cache: could not keep %s (%s)", path, e)
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
    return compiled
