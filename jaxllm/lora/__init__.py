"""Multi-LoRA serving: PEFT adapters read and validated on the host (peft.py), a host LRU of
loaded adapters (registry.py), device slots stacked for one batched computation per step
(slots.py) and the delta every projection adds (ops.py)."""
from jaxllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
