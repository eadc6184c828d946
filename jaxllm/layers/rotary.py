"""Rotary position embeddings (rotate-half layout, as HF), with Llama-3, linear and LongRoPE
scaling, over all of head_dim or its first part."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "freq_factors":  # per-frequency divisors, as GGUF's rope_freqs tensor holds them
        factors = np.asarray(scaling["factors"], np.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope frequency factors have shape {factors.shape}, expected {inv_freq.shape}")
        return (inv_freq / factors).astype(np.float32)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    if kind == "longrope":
        # the short factors: the model is run within its original context (see phi3.py)
        factors = np.asarray(scaling["short_factor"], np.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope short_factor has {factors.size} entries, expected {inv_freq.size}")
        return (inv_freq / factors).astype(np.float32)
    raise ValueError(f"unsupported rope scaling type {kind!r}")


def rope_mscale(scaling: dict | None) -> float:
    """The factor cos and sin are multiplied by (LongRoPE's attention factor; else 1)."""
    return float((scaling or {}).get("attention_factor", 1.0))


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
               mscale: float = 1.0) -> jax.Array:
    """x: [T, heads, head_dim]; positions: [T]. The first 2 * len(inv_freq) dims rotate."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    rot = 2 * inv_freq.shape[0]
    xr, rest = x[..., :rot], x[..., rot:]
    half = rot // 2
    x1, x2 = xr[..., :half], xr[..., half:]
    out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    return jnp.concatenate(out + ([rest] if rest.shape[-1] else []), axis=-1)
