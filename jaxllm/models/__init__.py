from jaxllm.models.arch import ArchConfig
from jaxllm.models.registry import get_model_class, supported_architectures

__all__ = ["ArchConfig", "get_model_class", "supported_architectures"]
