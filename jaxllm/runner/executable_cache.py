"""Compiled step executables kept on disk, keyed without tracing.

JAX's persistent cache skips XLA's compile on a second start, but finds its entry by tracing
and lowering the function again: for the default model on a 2-core CPU that is most of the
start-up (seconds, under the GIL). This cache stores the serialized executable itself under a
key made of everything the trace depends on:

- the code: every source file of the jaxllm package, and the versions of jax, jaxlib and flax;
- the platform: backend, its version, the devices, the process count;
- the settings that change a trace: JAX's tracing flags and the JAXLLM_/JAX_/XLA_ variables;
- the function: its qualified name and, recursively, the values its closure holds (a model's
  graph definition with its static attributes, sizes, shardings, nested functions);
- the call: each argument's tree structure, shape, dtype and sharding, and the compiler options.

Whatever cannot be described deterministically (a repr with an object address) makes the call
uncachable: it compiles as before. A bad or unreadable entry is removed and compiled again.
`JAXLLM_EXECUTABLE_CACHE=0` turns the cache off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import re
import tempfile
import types

import jax
import numpy as np

logger = logging.getLogger("jaxllm")

ENV_PREFIXES = ("JAXLLM_", "JAX_", "XLA_")
# variables that name where things are kept, not what is computed
ENV_IGNORED = {"JAXLLM_COMPILATION_CACHE_DIR", "JAXLLM_TOKENIZER_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR"}
ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
FORMAT = 1  # bump when what an entry holds changes

_directory: str | None = None


def configure(cache_dir: str | None) -> None:
    """Keep executables under cache_dir/executables (None or JAXLLM_EXECUTABLE_CACHE=0: off)."""
    global _directory
    off = os.environ.get("JAXLLM_EXECUTABLE_CACHE", "1")
    if off not in ("0", "1"):
        raise ValueError(f"JAXLLM_EXECUTABLE_CACHE must be 0 or 1, not {off!r}")
    _directory = os.path.join(cache_dir, "executables") if cache_dir and off == "1" else None


class Uncachable(Exception):
    """A value whose description would differ between processes."""


PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def code_fingerprint(root: str = PACKAGE) -> str:
    """The package's sources (Python and the CPU kernels' C++) and the libraries tracing runs."""
    import flax
    import jaxlib
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith((".py", ".cc", ".h")):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    h.update(f"jax {jax.__version__} jaxlib {jaxlib.__version__} flax {flax.__version__}".encode())
    return h.hexdigest()


def _plain(v) -> bool:
    if isinstance(v, (tuple, list)):
        return all(_plain(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str)) or type(v).__module__ == "enum" \
        or hasattr(type(v), "__members__")


def environment() -> str:
    """What of the process' settings reaches a trace."""
    from jax._src import config as jax_config
    devices = jax.devices()
    backend = devices[0].client
    flags = [v for v in jax_config.trace_context() if _plain(v)]
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith(ENV_PREFIXES) and k not in ENV_IGNORED)
    return repr((FORMAT, code_fingerprint(), backend.platform, backend.platform_version,
                 [(d.id, d.device_kind, d.process_index) for d in devices],
                 jax.process_count(), flags, env))


def describe(v, depth: int = 0) -> str:
    """A deterministic text of a value the trace depends on."""
    if depth > 12:
        raise Uncachable("nested too deeply")
    if isinstance(v, jax.ShapeDtypeStruct) or (isinstance(v, jax.Array) and not depth):
        return f"{type(v).__name__}({v.shape}, {v.dtype}, {getattr(v, 'sharding', None)!r})"
    if isinstance(v, (jax.Array, np.ndarray, np.generic)):  # a constant the trace bakes in
        a = np.asarray(v)
        return f"array({a.shape}, {a.dtype}, {hashlib.sha256(a.tobytes()).hexdigest()})"
    if isinstance(v, types.FunctionType):
        cells = [describe(c.cell_contents, depth + 1) for c in (v.__closure__ or ())]
        return f"fn {v.__module__}.{v.__qualname__}({', '.join(cells)}; " \
               f"{describe(v.__defaults__, depth + 1)})"
    if isinstance(v, functools.partial):
        return f"partial({describe(v.func, depth + 1)}, {describe(v.args, depth + 1)}, " \
               f"{describe(v.keywords, depth + 1)})"
    if hasattr(v, "__wrapped__") and callable(v):  # a jitted function: its settings, what it wraps
        return f"wrapped {getattr(v, '_jit_info', '')!r} {describe(v.__wrapped__, depth + 1)}"
    if type(v).__name__ == "GraphDef" and hasattr(v, "attributes"):  # an nnx model's structure
        return f"GraphDef({v.nodes!r}, {v.attributes!r})"
    if isinstance(v, (list, tuple)):
        return f"{type(v).__name__}[{', '.join(describe(x, depth + 1) for x in v)}]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {describe(x, depth + 1)}" for k, x in v.items()) + "}"
    if isinstance(v, types.ModuleType):
        return f"module {v.__name__}"
    text = repr(v)
    if ADDRESS.search(text) or "..." in text:  # an address, or a summary (numpy's long arrays)
        raise Uncachable(text[:200])
    return text


def key_of(fn, args: tuple, options, context=()) -> str:
    leaves, tree = jax.tree.flatten(args)
    # arguments are described by shape (depth 0): their values are inputs, not constants
    text = "\n".join([environment(), describe(fn), repr(options), describe(context), str(tree),
                      *(describe(x) for x in leaves)])
    if ADDRESS.search(text):
        raise Uncachable("an object address in the description")
    return hashlib.sha256(text.encode()).hexdigest()


def compile(fn, *args, options=None, context=()):
    """fn.lower(*args).compile(options), from disk when this exact executable was kept.
    context: what else the trace depends on that fn's closure and args do not show."""
    if _directory is None or jax.process_count() > 1:
        return fn.lower(*args).compile(options)
    from jax.experimental import serialize_executable
    try:
        key = key_of(fn, args, options, context)
    except Uncachable as e:
        logger.debug("executable cache: %s is not cachable (%s)", getattr(fn, "__name__", fn), e)
        return fn.lower(*args).compile(options)
    path = os.path.join(_directory, key[:2], key)
    if os.path.exists(path):
        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.loads(f.read())
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # noqa: BLE001  (a bad entry costs a compile, nothing else)
            logger.warning("executable cache: dropping unreadable entry %s (%s)", path, e)
            try:
                os.remove(path)
            except OSError:
                pass
    compiled = fn.lower(*args).compile(options)
    try:
        blob = pickle.dumps(serialize_executable.serialize(compiled))
    except Exception as e:  # noqa: BLE001  (some executables cannot be serialized)
        logger.debug("executable cache: not kept (%s)", e)
        return compiled
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
    os.replace(tmp, path)  # atomic: a reader sees a whole entry or none
    return compiled
