"""Building the CPU kernels: the C++ sources beside this file, compiled on first use with the
machine's C++ compiler against the FFI headers jaxlib ships, cached by source, jaxlib version
and CPU, loaded, and registered with XLA as custom calls. Without a compiler the engine runs
XLA's path and says so once; `EngineConfig.cpu_kernels=False` never builds them.

Why kernels of our own: XLA:CPU dots need materialized operands, so a quantized weight is
first written out whole in float, a bf16 weight is widened to f32 in memory, and a dot on a
slice of the layer stack copies the slice first. These kernels read the wanted layer's codes
or bf16 words in place, and the attention kernels read the paged cache in place.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import jax

from jaxllm import envs

logger = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
# linked into one library; the headers are hashed into its key with them
SOURCES = ("quantized.cc", "dense.cc", "attention.cc")
HEADERS = ("common.h", "bf16_panels.h")
TARGETS = {"jaxllm_qmm": "JaxllmQmm", "jaxllm_qmm_sym": "JaxllmQmmSym",
           "jaxllm_qmm_q8": "JaxllmQmmQ8", "jaxllm_qmm_q8_sym": "JaxllmQmmQ8Sym",
           "jaxllm_w8a8": "JaxllmW8A8", "jaxllm_w8a8_smooth": "JaxllmW8A8Smooth",
           "jaxllm_qmm_sym_bf16": "JaxllmQmmSymBf16",
           "jaxllm_fp8": "JaxllmFp8",
           "jaxllm_bf16_in_out": "JaxllmBf16InOut", "jaxllm_bf16_out_in": "JaxllmBf16OutIn",
           "jaxllm_bf16_panels": "JaxllmBf16Panels",
           "jaxllm_grouped_bf16": "JaxllmGroupedBf16", "jaxllm_grouped_f32": "JaxllmGroupedF32",
           "jaxllm_w8a8_panels": "JaxllmW8A8Panels",
           "jaxllm_w8a8_panels_smooth": "JaxllmW8A8PanelsSmooth",
           "jaxllm_decode_attention": "JaxllmDecodeAttention",
           "jaxllm_prefill_attention": "JaxllmPrefillAttention"}

_lock = threading.Lock()
_state: dict = {}


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build() -> str:
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    src = b"".join(open(os.path.join(HERE, name), "rb").read() for name in SOURCES + HEADERS)
    key = hashlib.sha256(src + jax.__version__.encode() + cxx.encode()
                         + _cpu_signature().encode()).hexdigest()[:16]
    cache = envs.kernel_cache_dir()
    lib = os.path.join(cache, f"kernels-{key}.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(cache, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    flags = [cxx, "-O3", "-march=native", "-std=c++17", "-fPIC", "-w",
             "-I", jax.ffi.include_dir(), "-I", HERE]
    with tempfile.TemporaryDirectory(dir=cache) as objects:
        # each family compiles in its own process, at once, then one link
        jobs = []
        for name in SOURCES:
            obj = os.path.join(objects, name + ".o")
            cmd = flags + ["-c", os.path.join(HERE, name), "-o", obj]
            jobs.append((cmd, obj, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                                    stderr=subprocess.PIPE, text=True)))
        for cmd, _, proc in jobs:
            _, err = proc.communicate()
            if proc.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
        link = [cxx, "-shared", "-fPIC", *(obj for _, obj, _ in jobs), "-o", tmp]
        try:
            res = subprocess.run(link, capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(f"{' '.join(link)} failed:\n{res.stderr[-2000:]}")
            os.replace(tmp, lib)  # atomic: a concurrent build of the same key is harmless
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return lib


def available() -> bool:
    """Build (once) and register the kernels; False, with one warning, if that is not
    possible here."""
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        try:
            lib = ctypes.cdll.LoadLibrary(_build())
            for target, symbol in TARGETS.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                            platform="cpu")
            _state["lib"] = lib
            _state["ok"] = True
        except (OSError, RuntimeError, AttributeError) as e:
            logger.warning("CPU kernels unavailable (%s); matmuls and attention run through "
                           "XLA (slower)", e)
            _state["ok"] = False
        return _state["ok"]


def library():
    """The loaded kernels (ctypes), built if need be; None where they are not available."""
    return _state["lib"] if available() else None


def amx() -> bool:
    """Whether the packed kernels multiply on AMX's tiles (Intel's matrix unit) here: the CPU
    has it, Linux grants it, and `set_amx(False)` has not turned it off; otherwise AVX-512
    runs them."""
    return available() and bool(_state["lib"].JaxllmAmx())


def set_amx(on: bool) -> None:
    """EngineConfig.cpu_amx: let the packed kernels use AMX where the CPU has it (the default),
    or keep them on AVX-512. Process-wide, as the unit is: it changes no shape, only which unit
    multiplies (int8 sums are equal; bf16 sums may round differently)."""
    if available():
        _state["lib"].JaxllmSetAmx(1 if on else 0)


def cpu_signature() -> str:
    """The CPU's architecture and instruction flags: kernels are built for them."""
    return _cpu_signature()


def prepare_async() -> threading.Thread:
    """Start building the kernels in the background (the first build compiles every source)."""
    t = threading.Thread(target=available, daemon=True)
    t.start()
    return t
