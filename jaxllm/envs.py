"""The environment variables jaxllm reads: where things are kept, and secrets. Behaviour is
configuration (EngineConfig fields and their flags), never an environment switch."""
from __future__ import annotations

import os


def _path(name: str, default: str) -> str:
    return os.environ.get(name) or os.path.expanduser(default)


def compilation_cache_dir() -> str:
    """XLA's persistent cache and jaxllm's executables (EngineConfig.compilation_cache_dir's default)."""
    return _path("JAXLLM_COMPILATION_CACHE_DIR", "~/.cache/jaxllm/xla")


def tokenizer_cache_dir() -> str:
    """Tokenizers built from GGUF metadata."""
    return _path("JAXLLM_TOKENIZER_CACHE_DIR", "~/.cache/jaxllm/tokenizers")


def kernel_cache_dir() -> str:
    """The CPU kernels' shared libraries, built on first use."""
    return _path("JAXLLM_KERNEL_CACHE_DIR", "~/.cache/jaxllm/kernels")


def api_key() -> str | None:
    """The bearer key /v1 requires when `--api-key` is not given."""
    return os.environ.get("JAXLLM_API_KEY") or None


def allow_runtime_lora_updating() -> bool:
    """vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter and /v1/unload_lora_adapter
    (also `--enable-runtime-lora-updating`)."""
    return os.environ.get("JAXLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true", "yes")


# variables that name where things are kept: they never change what a trace computes
PATH_VARIABLES = ("JAXLLM_COMPILATION_CACHE_DIR", "JAXLLM_TOKENIZER_CACHE_DIR",
                  "JAXLLM_KERNEL_CACHE_DIR")
