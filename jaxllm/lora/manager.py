"""An engine's adapters: the registry of those it knows (with the host cache), the device
slots a step reads, and what the engine's API does with them (add, remove, list), with the
per-adapter request counts /metrics exports."""
from __future__ import annotations

import logging

from jaxllm.core.request import RequestStatus
from jaxllm.lora.peft import LoRALayout, base_model_names
from jaxllm.lora.registry import LoRARegistry
from jaxllm.lora.slots import LoRASlots
from jaxllm.models import get_model_class

logger = logging.getLogger("jaxllm")


class LoRAManager:
    def __init__(self, loaded, config, mesh, weight_dtype, model_names=()):
        """loaded: the base model; model_names: what else the base model is called, for the
        adapters' base-model check."""
        layout = LoRALayout(get_model_class(loaded.arch.architecture),
                            loaded.checkpoint_arch or loaded.arch, mesh.size, config.max_lora_rank)
        self.max_loras = config.max_loras
        self.registry = LoRARegistry(layout, config.max_cpu_loras or config.max_loras,
                                     base_model_names(loaded.path, config.model))
        self.registry.base_names += list(model_names)
        self.slots = LoRASlots(layout, config.max_loras, weight_dtype, mesh, self.registry.adapter)
        logger.info("LoRA: %d device slots of rank %d over %s (%.1f MiB), %d adapters cached on "
                    "the host", config.max_loras, config.max_lora_rank,
                    ", ".join(layout.module_names), self.slots.nbytes / 2**20,
                    self.registry.max_cpu_loras)

    def add(self, lora_request, adapter=None) -> int:
        """Register an adapter, read and checked now (ValueError naming it if refused) unless
        `adapter` is its read(); returns its key."""
        return self.registry.add(lora_request, adapter)

    def read(self, lora_request):
        """Read and check an adapter for add() (safe to call from another thread)."""
        return self.registry.read(lora_request)

    def key_of(self, lora_request) -> int | None:
        """The key an adapter is registered under, or None."""
        return self.registry.key_of(lora_request)

    def remove(self, lora_int_id: int, requests) -> bool:
        """Unregister an adapter; requests (of `requests`) already running with it finish with
        it, and its device slot is freed when none does."""
        key = self.registry.remove(lora_int_id)
        if key is None:
            return False
        if not any(r.lora_id == key for r in requests):
            self.slots.evict(key)
        return True

    def list(self) -> set[int]:
        return {r.lora_int_id for r in self.registry.list()}

    def unregister_failed(self, failures: dict[int, str]) -> None:
        """Adapters that could not be read again (the host cache had let them go and their
        files changed): unregistered, the reason logged."""
        for key, why in failures.items():
            req = self.registry.requests[key]
            logger.error("LoRA adapter %r could not be read again, its requests are aborted "
                         "and it is unregistered: %s", req.lora_name, why)
            self.registry.remove_key(key)

    def stats(self, requests) -> dict:
        """Requests running and waiting per adapter name (vLLM's lora_requests_info)."""
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for r in requests:
            if r.lora_id:
                side = running if r.status == RequestStatus.RUNNING else waiting
                name = self.registry.name_of(r.lora_id)
                side[name] = side.get(name, 0) + 1
        return {"lora_running": running, "lora_waiting": waiting, "max_lora": self.max_loras}
