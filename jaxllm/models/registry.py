"""HF `architectures` name -> model class."""
from __future__ import annotations

_LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def supported_architectures() -> tuple[str, ...]:
    return _LLAMA_FAMILY


def resolve_architecture(architectures) -> str:
    for name in architectures or ():
        if name in _LLAMA_FAMILY:
            return name
    raise ValueError(f"unsupported architecture {list(architectures or [])}; "
                     f"supported: {', '.join(_LLAMA_FAMILY)}")


def get_model_class(architecture: str):
    resolve_architecture([architecture])
    from jaxllm.models.llama import LlamaForCausalLM
    return LlamaForCausalLM
