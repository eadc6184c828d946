"""vLLM's dict-valued options (speculative_config, kv_transfer_config): given as a dataclass,
a dict or its JSON text (the flag), read into the dataclass with unknown fields refused by
name. Pure Python: the engine config imports it without JAX."""
from __future__ import annotations

import json
from dataclasses import fields


def parse(cls, value, name: str):
    """None, a `cls`, a dict or its JSON text, as a `cls` (a ValueError names the field)."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict (or its JSON), got {type(value).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}.{unknown[0]} is not a known field (known: "
                         f"{', '.join(sorted(known))})")
    return cls(**value)
