"""Mixture-of-experts feed-forward: the one seam every MoE family's layers call.

Each token's router picks its top-k experts. The (token, expert) pairs are sorted by expert,
so that each expert's rows are contiguous, and each of the two expert projections is one
grouped matmul over them (`grouped_matmul`): on a GPU the Pallas kernel of
pallas_kernels/grouped_matmul.py, on a CPU the C++ kernel that reads each used expert's weights
in place, once, elsewhere `jax.lax.ragged_dot`. (XLA lowers ragged_dot on a CPU and on a GPU
as one product with every expert, masked: the all-experts FLOPs this block exists to avoid.)
The pairs' outputs are weighted and added back to their tokens.

Under tensor parallelism the block runs per device under shard_map. Without expert
parallelism every device holds each expert's share of the hidden columns, as a dense MLP is
split; with it (`ArchConfig.expert_parallel`) a device holds whole experts, 1/n of them, and
computes only the pairs routed to its own. Tokens are replicated on every device between
layers, so dispatching them to their experts' devices is a local selection, and the way back
is one all-reduce of the partial outputs: the collective a dense MLP needs anyway.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.layers.dtype_policy import DTypePolicy
from jaxllm.quantization.qweight import QWeight, dequantize, fake_quant_blocks, quantize_activations


@jax.tree_util.register_dataclass
@dataclass
class ExpertStack:
    """The layers' stack of one expert projection, [L, X, K, N] (bf16 or f32), for the CPU
    kernel, which reads the layer's experts in place at `layer` (no slice of the stack is
    copied)."""
    w: jax.Array
    layer: jax.Array | int | None = None

    def at(self, layer) -> "ExpertStack":
        return ExpertStack(self.w, layer)


def route(logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits [T, X] -> (weights [T, k] f32, experts [T, k] int32): the softmax's top
    k, renormalised to sum to one when `normalize` (Mixtral, and Qwen3-MoE's norm_topk_prob)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def _kernel(x: jax.Array, stack: jax.Array, layer, group_sizes: jax.Array) -> jax.Array:
    """The CPU kernel: x [M, K] f32 @ each group's expert of stack [L, X, K, N] -> [M, N] f32;
    rows past the groups come back as zeros."""
    from jaxllm.kernels.cpu import build
    if not build.available():  # registers the kernels (built once)
        raise RuntimeError("the CPU kernels are not available for the experts' grouped matmul")
    target = "jaxllm_grouped_bf16" if stack.dtype == jnp.bfloat16 else "jaxllm_grouped_f32"
    out = jax.ShapeDtypeStruct((x.shape[0], stack.shape[-1]), jnp.float32)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    return jax.ffi.ffi_call(target, out)(x.astype(jnp.float32), stack, index,
                                         group_sizes.astype(jnp.int32))


def _ragged(x: jax.Array, w: jax.Array, group_sizes: jax.Array, policy: DTypePolicy,
            impl: str) -> jax.Array:
    """x [M, K] times each group's w [X, K, N] in the policy's dot dtype: the Pallas kernel
    ("pallas", or "pallas_interpret" in its interpreter), or jax.lax.ragged_dot ("ragged")."""
    x, w = x.astype(policy.dot), w.astype(policy.dot)
    if impl.startswith("pallas"):
        from pallas_kernels import grouped_matmul as gm
        if gm.supports(w.shape[1], w.shape[2]):
            return gm.grouped_matmul(x, w, group_sizes, interpret=impl == "pallas_interpret")
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=policy.accum).astype(jnp.float32)


def grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, policy: DTypePolicy,
                   impl: str = "ragged") -> jax.Array:
    """x [M, K], its rows sorted into groups of `group_sizes` [X] (rows past their sum are
    padding: zeros out), times each group's expert: w [X, K, N] float, an ExpertStack (the
    CPU kernel), or a quantized stack (QWeight [X, N, K'], out-major). `impl`: where float
    [X, K, N] products run (_ragged). Returns [M, N] f32."""
    if isinstance(w, QWeight):
        m = w.matrix()
        if m.smooth is not None:
            x = x / m.smooth
        if m.act == "int8_block":
            x = fake_quant_blocks(x)
        elif m.act in ("int8", "fp8"):  # per-token activations, as their dense matmuls take them
            xq, xs = quantize_activations(x, m.act)
            x = xq.astype(jnp.float32) * xs
        dot = jnp.float32 if m.backend == "cpu" else policy.dot
        weights = jnp.swapaxes(dequantize(m, dot), -1, -2)  # [X, K, N]
        if m.backend == "cpu":
            return _kernel(x, weights[None], 0, group_sizes)
        return _ragged(x, weights, group_sizes, policy, impl)
    if policy.round_to_bf16:  # as linear() rounds a float weight's activations
        x = x.astype(jnp.bfloat16).astype(jnp.float32)
    if isinstance(w, ExpertStack):
        return _kernel(x, w.w, w.layer, group_sizes)
    return _ragged(x, w, group_sizes, policy, impl)


def num_local_experts(w) -> int:
    if isinstance(w, ExpertStack):
        return w.w.shape[1]
    if isinstance(w, QWeight):
        return w.q.shape[-3]
    return w.shape[0]


def moe_local(h: jax.Array, logits: jax.Array, gate_up, down, *, k: int, normalize: bool,
              policy: DTypePolicy, real, first_expert=0, impl: str = "ragged") -> jax.Array:
    """The experts' output for tokens h [T, E] given their router logits [T, X], from the
    experts this device holds: gate_up [X', E, 2F'] (each expert's gate columns, then its up
    columns) and down [X', F', E], experts first_expert .. first_expert + X'. Rows from
    `real` on pad the step and go to no expert. Returns [T, E] f32 (this device's part)."""
    T = h.shape[0]
    weights, experts = route(logits, k, normalize)
    local_n = num_local_experts(gate_up)
    local = experts - first_expert
    mine = (jnp.arange(T) < real)[:, None] & (local >= 0) & (local < local_n)
    key = jnp.where(mine, local, local_n).reshape(-1)   # [T * k]; local_n: not here
    order = jnp.argsort(key, stable=True)
    token = order // k
    group_sizes = jnp.bincount(key, length=local_n + 1)[:local_n].astype(jnp.int32)
    xs = h[token]
    gu = grouped_matmul(xs, gate_up, group_sizes, policy, impl).astype(policy.activation)
    F = gu.shape[-1] // 2
    act = jax.nn.silu(gu[:, :F]) * gu[:, F:]
    y = grouped_matmul(act, down, group_sizes, policy, impl)
    scale = jnp.where(mine.reshape(-1)[order], weights.reshape(-1)[order], 0.0)
    y = jnp.where(scale[:, None] != 0, y * scale[:, None], 0.0)
    return jnp.zeros((T, y.shape[-1]), jnp.float32).at[token].add(y)


def moe_dense(h: jax.Array, logits: jax.Array, gate_up: jax.Array, down: jax.Array, *, k: int,
              normalize: bool, policy: DTypePolicy) -> jax.Array:
    """The reference the grouped path is measured against: every expert applied to every
    token, each output weighted by the router (zero for experts not chosen). [T, E] f32."""
    T, X = h.shape[0], gate_up.shape[0]
    weights, experts = route(logits, k, normalize)
    dense = jnp.zeros((T, X), jnp.float32).at[jnp.arange(T)[:, None], experts].set(weights)
    ein = (lambda spec, a, b: jnp.einsum(spec, a.astype(policy.dot), b.astype(policy.dot),
                                         preferred_element_type=policy.accum))
    gu = ein("te,xef->txf", h, gate_up).astype(policy.activation)
    F = gu.shape[-1] // 2
    y = ein("txf,xfe->txe", jax.nn.silu(gu[..., :F]) * gu[..., F:], down)
    return jnp.einsum("txe,tx->te", y.astype(jnp.float32), dense)


def moe_block(h: jax.Array, logits: jax.Array, gate_up, down, *, k: int, normalize: bool,
              policy: DTypePolicy, real, mesh=None, expert_parallel: bool = False,
              impl: str = "ragged") -> jax.Array:
    """moe_local over the model's devices (see the module's docstring): [T, E] in the
    policy's activation dtype."""
    if mesh is None or mesh.size == 1:
        y = moe_local(h, logits, gate_up, down, k=k, normalize=normalize, policy=policy, real=real,
                      impl=impl)
        return y.astype(policy.activation)
    if isinstance(gate_up, (QWeight, ExpertStack)):  # (refused at load: MoeForCausalLM)
        raise ValueError("quantized or CPU-kernel experts run on one device only")
    from jax.sharding import PartitionSpec as P

    from jaxllm.parallel import TP
    if expert_parallel:
        specs = (P(TP, None, None), P(TP, None, None))
    else:  # the gate/up columns are device-major: each device's shard is its gate, then its up
        specs = (P(None, None, TP), P(None, TP, None))

    def local(h, logits, gate_up, down, real):
        first = jax.lax.axis_index(TP) * gate_up.shape[0] if expert_parallel else 0
        y = moe_local(h, logits, gate_up, down, k=k, normalize=normalize, policy=policy,
                      real=real, first_expert=first, impl=impl)
        return jax.lax.psum(y, TP)

    y = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), *specs, P()), out_specs=P(),
                      check_vma=False)(h, logits, gate_up, down, real)
    return y.astype(policy.activation)
