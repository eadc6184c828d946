"""The adapters an engine knows and a host LRU cache of the loaded ones (numpy only).

Each adapter registered gets an internal key that is never reused: the device slots and the
prefix cache key on it, so an id unloaded and loaded again with other weights is another
adapter, and requests still running with the old one keep it. The host cache holds at most
max_cpu_loras adapters; one it let go is read from disk again (and checked again) when a
step needs it.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict

from jaxllm.lora.peft import Adapter, LoRALayout, load_adapter
from jaxllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRARegistry:
    def __init__(self, layout: LoRALayout, max_cpu_loras: int, base_names=()):
        self.layout = layout
        self.max_cpu_loras = max_cpu_loras
        self.base_names = list(base_names)  # what the adapters' base_model_name_or_path may say
        self.requests: dict[int, LoRARequest] = {}   # key -> request, for every key ever given
        self._by_id: dict[int, int] = {}              # lora_int_id -> key, registered now
        self._by_name: dict[str, int] = {}
        self._cache: OrderedDict[int, Adapter] = OrderedDict()
        self._next_key = 1
        self.num_disk_loads = 0

    # registration
    def key_of(self, req: LoRARequest) -> int | None:
        """The key `req` is registered under, or None; a request that reuses a registered id
        or name for another adapter is refused."""
        if not isinstance(req, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(req).__name__}")
        key = self._by_id.get(req.lora_int_id)
        if key is not None:
            known = self.requests[key]
            if known.lora_name != req.lora_name or _path(known.lora_path) != _path(req.lora_path):
                raise ValueError(f"lora_int_id {req.lora_int_id} is registered for adapter "
                                 f"{known.lora_name!r} ({known.lora_path}), not {req.lora_name!r} "
                                 f"({req.lora_path})")
            return key
        if req.lora_name in self._by_name:
            known = self.requests[self._by_name[req.lora_name]]
            raise ValueError(f"lora_name {req.lora_name!r} is registered with lora_int_id "
                             f"{known.lora_int_id}, not {req.lora_int_id}")
        return None

    def read(self, req: LoRARequest) -> Adapter:
        """Read and check an adapter without registering it (safe off the engine's thread)."""
        return load_adapter(req, self.layout, self.base_names)

    def add(self, req: LoRARequest, adapter: Adapter | None = None) -> int:
        """Register `req`, read and checked now unless `adapter` is its read() (ValueError
        if it is refused); returns its key."""
        key = self.key_of(req)
        if key is not None:
            return key
        adapter = self._read(req) if adapter is None else adapter
        key, self._next_key = self._next_key, self._next_key + 1
        self.requests[key] = req
        self._by_id[req.lora_int_id] = key
        self._by_name[req.lora_name] = key
        self._put(key, adapter)
        logger.info("LoRA adapter %r (id %d) loaded from %s: %s, rank %d, %.1f MiB on the host",
                    req.lora_name, req.lora_int_id, req.lora_path, ", ".join(adapter.modules),
                    adapter.rank, adapter.nbytes / 2**20)
        return key

    def remove(self, lora_int_id: int) -> int | None:
        """Unregister; returns the key it had (requests running with it finish with it)."""
        key = self._by_id.pop(lora_int_id, None)
        if key is not None:
            del self._by_name[self.requests[key].lora_name]
            self._cache.pop(key, None)
        return key

    def remove_key(self, key: int) -> None:
        """Unregister the adapter of `key` if it is still registered."""
        req = self.requests[key]
        if self._by_id.get(req.lora_int_id) == key:
            self.remove(req.lora_int_id)

    def list(self) -> list[LoRARequest]:
        return [self.requests[k] for k in self._by_id.values()]

    def name_of(self, key: int) -> str:
        return self.requests[key].lora_name

    # host cache
    def adapter(self, key: int) -> Adapter:
        """The host copy of an adapter, read from disk again if the cache let it go."""
        adapter = self._cache.get(key)
        if adapter is not None:
            self._cache.move_to_end(key)
            return adapter
        adapter = self._read(self.requests[key])
        self._put(key, adapter)
        return adapter

    def _read(self, req: LoRARequest) -> Adapter:
        self.num_disk_loads += 1
        return self.read(req)

    def _put(self, key: int, adapter: Adapter) -> None:
        self._cache[key] = adapter
        self._cache.move_to_end(key)
        while len(self._cache) > self.max_cpu_loras:
            self._cache.popitem(last=False)

    @property
    def cached_keys(self) -> list[int]:
        return list(self._cache)


def _path(p: str) -> str:
    return os.path.normpath(os.path.abspath(os.path.expanduser(p)))
