"""jaxllm: a JAX/XLA re-implementation of vLLM.

Names are imported on first use, so that `import jaxllm.core` (pure Python) does not pull in
JAX through the engine."""
import importlib

__version__ = "0.1.0"

_WHERE = {
    "LLM": "jaxllm.llm",
    "LLMEngine": "jaxllm.engine.llm_engine",
    "EngineConfig": "jaxllm.config",
    "SamplingParams": "jaxllm.sampling_params",
    "RequestOutputKind": "jaxllm.sampling_params",
    "StructuredOutputsParams": "jaxllm.sampling_params",
    "RequestOutput": "jaxllm.engine.outputs",
    "CompletionOutput": "jaxllm.engine.outputs",
    "BeamSearchParams": "jaxllm.beam_search",
    "BeamSearchOutput": "jaxllm.beam_search",
    "BeamSearchSequence": "jaxllm.beam_search",
}
__all__ = [*_WHERE, "__version__"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
