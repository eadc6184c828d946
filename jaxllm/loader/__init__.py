from jaxllm.loader.loader import LoadedModel, load_model, resolve_model_path

__all__ = ["LoadedModel", "load_model", "resolve_model_path"]
