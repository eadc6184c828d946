"""HF `architectures` name -> model class. Each family's module is imported only when used."""
from __future__ import annotations

import importlib

# architecture -> (module, class)
_MODELS = {
    "LlamaForCausalLM": ("jaxllm.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("jaxllm.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("jaxllm.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("jaxllm.models.llama", "LlamaForCausalLM"),
    "Phi3ForCausalLM": ("jaxllm.models.phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("jaxllm.models.mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("jaxllm.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "OlmoeForCausalLM": ("jaxllm.models.olmoe", "OlmoeForCausalLM"),
    "LlavaForConditionalGeneration": ("jaxllm.models.llava", "LlavaForConditionalGeneration"),
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(_MODELS)


def resolve_architecture(architectures) -> str:
    for name in architectures or ():
        if name in _MODELS:
            return name
    raise ValueError(f"unsupported architecture {list(architectures or [])}; "
                     f"supported: {', '.join(_MODELS)}")


def get_model_class(architecture: str):
    module, cls = _MODELS[resolve_architecture([architecture])]
    return getattr(importlib.import_module(module), cls)


def model_class_for_gguf(gguf_arch: str, experts: int = 0):
    """The model class that reads a GGUF file of llama.cpp architecture `gguf_arch` (whose
    layers have `experts` experts: Mixtral is llama.cpp's "llama" with experts)."""
    for name in dict.fromkeys(_MODELS):
        cls = get_model_class(name)
        if (gguf_arch in getattr(cls, "GGUF_ARCHITECTURES", ())
                and getattr(cls, "MIXTURE_OF_EXPERTS", False) == bool(experts)):
            return cls
    known = sorted({a for n in _MODELS for a in getattr(get_model_class(n), "GGUF_ARCHITECTURES", ())})
    raise ValueError(f"unsupported GGUF architecture {gguf_arch!r}; supported: {', '.join(known)}")


def arch_from_hf(cfg: dict):
    """An HF config.json dict -> ArchConfig, read by the family's own model class."""
    return get_model_class(resolve_architecture(cfg.get("architectures"))).arch_from_hf(cfg)
