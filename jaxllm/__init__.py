"""jaxllm: a JAX/XLA re-implementation of vLLM."""
from jaxllm.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jaxllm.config import EngineConfig
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.engine.outputs import CompletionOutput, RequestOutput
from jaxllm.llm import LLM
from jaxllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
           "__version__"]
