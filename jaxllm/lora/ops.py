"""The delta LoRA adds to a projection, for every adapter of a step in one computation.

The device slots hold, per projection site, A [in, N*P*R] (slot-major: slot n's P parts of
rank R) and one B [N*R, out_p] per fused part. A token's delta is
`((x @ A) * onehot(slot)) @ B`: the shrink computes every slot's R columns, the mask keeps
the token's own (none for base-model tokens, so they cost no branch), and the expand sums
over slots. The cost grows with max_loras (the slots), not with how the batch is mixed, and a
new mix never recompiles. Measured on this CPU against a per-token gather of the adapter
weights and against `lax.ragged_dot` over tokens grouped by adapter (`jaxllm bench lora`):
the masked dense form is the fastest at decode batch sizes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jaxllm.layers.dtype_policy import DTypePolicy
from jaxllm.layers.linear import linear


def lora_delta(x: jax.Array, A: jax.Array, Bs, onehot: jax.Array, tp: int,
               policy: DTypePolicy) -> jax.Array:
    """x [T, in] -> [T, out]: each token's own adapter's x @ A @ B. A fused projection's
    parts are put back in its device-major column order (jaxllm.models.llama.device_major)."""
    T, N, P = x.shape[:-1], onehot.shape[-1], len(Bs)
    u = linear(x, A, policy)
    u = u.reshape(*T, N, P, -1) * onehot[..., :, None, None].astype(u.dtype)
    ys = [linear(u[..., p, :].reshape(*T, -1), B, policy) for p, B in enumerate(Bs)]
    if P == 1:
        return ys[0]
    return jnp.concatenate([y.reshape(*T, tp, -1) for y in ys], axis=-1).reshape(*T, -1)


@jax.tree_util.register_dataclass
@dataclass
class LoRAInputs:
    """What the model needs for one step: the slots' weights (stacked over layers; the model
    scans them with its own) and which slot each token runs."""
    weights: dict          # site -> {"A": [L, in, N*P*R], "B": ([L, N*R, out_p], ...)}
    onehot: jax.Array      # [T, N]
    active: jax.Array      # scalar: does any token run an adapter
    tp: int = field(metadata=dict(static=True), default=1)

    @classmethod
    def of(cls, weights: dict, token_slots: jax.Array, num_slots: int, tp: int) -> "LoRAInputs":
        """token_slots [T]: 0 for no adapter, n for slot n - 1."""
        onehot = (token_slots[:, None] == jnp.arange(1, num_slots + 1)).astype(jnp.float32)
        return cls(weights, onehot, jnp.any(token_slots > 0), tp)

    def hook(self, site: str, layer_weights: dict, policy: DTypePolicy):
        """For `linear(..., lora=)`: adds this site's delta to the base output (skipped when
        no token of the step runs an adapter), or None when no adapter can target the site."""
        w = layer_weights.get(site)
        if w is None:
            return None

        def add(x, y):
            return jax.lax.cond(
                self.active, lambda: y + lora_delta(x, w["A"], w["B"], self.onehot, self.tp, policy),
                lambda: y)
        return add
