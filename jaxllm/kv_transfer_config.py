"""KVTransferConfig: vLLM's `kv_transfer_config` dict, validated (a ValueError names the field).

One jaxllm server runs both roles: of its `data_parallel_size` replicas, the first
`kv_connector_extra_config.prefill_replicas` are producers (they prefill each request and
hand its KV blocks over) and the rest consumers (they import the blocks and decode). So the
server's own role is "kv_both"; "kv_producer" and "kv_consumer" name the replicas' roles.
Pure Python: the engine config imports it without JAX.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from jaxllm import config_dicts

CONNECTORS = ("RayObjectStoreConnector",)  # KV blocks through Ray's object store
ROLES = ("kv_both",)


def _error(name: str, msg: str) -> ValueError:
    return ValueError(f"kv_transfer_config.{name} {msg}")


@dataclass
class KVTransferConfig:
    kv_connector: str = "RayObjectStoreConnector"
    kv_role: str = "kv_both"
    # prefill_replicas: how many of the replicas prefill (default: half, at least one)
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kv_connector not in CONNECTORS:
            raise _error("kv_connector", f"must be one of {CONNECTORS}, got {self.kv_connector!r}")
        if self.kv_role not in ROLES:
            raise _error("kv_role", f"must be 'kv_both' (this server runs the producers and "
                         f"the consumers as its replicas), got {self.kv_role!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise _error("kv_connector_extra_config", "must be a dict")
        unknown = sorted(set(self.kv_connector_extra_config) - {"prefill_replicas"})
        if unknown:
            raise _error(f"kv_connector_extra_config.{unknown[0]}", "is not a known field "
                         "(known: prefill_replicas)")
        n = self.kv_connector_extra_config.get("prefill_replicas")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise _error("kv_connector_extra_config.prefill_replicas",
                         f"must be a positive integer, got {n!r}")

    @classmethod
    def parse(cls, value) -> "KVTransferConfig | None":
        """None, a KVTransferConfig, a dict or its JSON text (the --kv-transfer-config flag)."""
        return config_dicts.parse(cls, value, "kv_transfer_config")

    def num_prefill(self, num_replicas: int) -> int:
        """Producers among `num_replicas` (the first ones); at least one consumer is left."""
        n = self.kv_connector_extra_config.get("prefill_replicas", max(1, num_replicas // 2))
        if n >= num_replicas:
            raise _error("kv_connector_extra_config.prefill_replicas",
                         f"({n}) must leave at least one decode replica of data_parallel_size "
                         f"({num_replicas})")
        return n
