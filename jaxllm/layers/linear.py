"""The one linear seam: every projection (q/k/v, o, gate/up, down, the LM head) is a call to
`linear`, which applies the dtype policy (dtype_policy.py) and picks the matmul for the
weight's kind: a float array (XLA's dot), a bf16 matrix for the CPU kernel (DenseWeight), or a
quantized weight (QWeight: the CPU kernels, the Pallas kernel or XLA's dequantizing dot, as
its backend says). LoRA adds its delta here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.kernels.cpu import matmul as cpu_matmul
from jaxllm.kernels.cpu.panels import DenseWeight
from jaxllm.layers.dtype_policy import DTypePolicy
from jaxllm.quantization.qweight import QWeight, matmul_pallas, matmul_xla


def quantized_matmul(x: jax.Array, w: QWeight, policy: DTypePolicy, rows=None) -> jax.Array:
    """x [.., K] @ W^T -> [.., N] f32 for a quantized weight, where its backend says. rows: how
    many leading rows of x are real; the CPU kernels skip the others (zeros)."""
    if w.smooth is not None and w.act in ("none", "int8_block"):
        # weight-only codes scaled per input channel (AWQ): the division is an elementwise
        # pass over the activations, so the kernels take x already divided
        x = x / (w.smooth if w.layer is None else w.smooth[w.layer])
        w = QWeight(w.q, w.scale, w.offset, None, w.layer, w.act, w.backend)
    if w.backend == "cpu":
        if w.kind != "fp8" or cpu_matmul.fp8_apply(w):  # else XLA emulates the fp8 dot
            return cpu_matmul.matmul(x, w, rows,
                                     bf16_activations=policy.round_to_bf16 and w.per_channel_int8)
    grouped = w.kind == "int4" or (w.kind == "int8" and w.group < w.in_features)
    if w.backend.startswith("pallas") and grouped and w.act == "none" and w.smooth is None:
        return matmul_pallas(x, w, policy, interpret=w.backend == "pallas_interpret")
    return matmul_xla(x, w, policy)


def linear(x: jax.Array, w, policy: DTypePolicy, bias: jax.Array | None = None,
           lora=None, rows=None) -> jax.Array:
    """x[..., in] @ w (+ bias) in the policy's dtypes; returns `policy.activation`. w is a
    float [in, out] array, a DenseWeight (the CPU bf16 kernel) or a quantized weight
    (jaxllm.quantization.qweight.QWeight, out-major, read by its own matmul). `lora(x, y)`
    (jaxllm.lora.ops) adds the adapters' delta to the output. rows (a traced scalar): only
    the first `rows` rows of x [T, in] are real, the rest pad the step to its bucket; the CPU
    kernels then skip the padding (its outputs are not meaningful), XLA's dots compute it."""
    if policy.round_to_bf16 and (not isinstance(w, QWeight) or w.per_channel_int8):
        x = x.astype(jnp.bfloat16).astype(jnp.float32)
    if isinstance(w, QWeight):
        y = quantized_matmul(x, w, policy, rows)
    elif isinstance(w, DenseWeight):
        y = cpu_matmul.dense_bf16(x, w.w, w.layer, w.out_major, rows, w.panels)
    elif policy.accum == policy.dot:
        y = jnp.dot(x.astype(policy.dot), w.astype(policy.dot))
    else:
        y = jax.lax.dot_general(x.astype(policy.dot), w.astype(policy.dot),
                                (((x.ndim - 1,), (0,)), ((), ())),
                                preferred_element_type=policy.accum)
    y = y.astype(policy.activation)
    y = y if bias is None else y + bias.astype(policy.activation)
    return y if lora is None else lora(x, y)
