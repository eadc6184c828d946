"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, SmolLM2) as one Flax NNX model.

Per-layer weights are stacked on a leading layer axis. Off a GPU the layers run under
`jax.lax.scan`, so compile time does not grow with depth. On a GPU they are unrolled: in
XLA's GPU while loop each layer's weights are first copied out of the stack by a
dynamic-slice (a decode step would move every weight three times through HBM instead of
once), while a static slice folds into the matmul that reads it. Weights are stored
`[in, out]`. q/k/v are one fused projection and gate/up another (one dot each instead of
three and two); under tensor parallelism their columns are laid out device-major (device
d's q heads, then its k and v heads), so each device's shard is its own q/k/v.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.layers.attention import AttentionMetadata, attention_block
from jaxllm.kernels import matmul_backend as default_matmul_backend
from jaxllm.kernels.cpu.panels import DenseWeight, dense_weight, embed_from_panels, is_bf16_panels
from jaxllm.layers.dtype_policy import DTypePolicy, uniform_policy, uses_dense_kernel
from jaxllm.layers.linear import linear
from jaxllm.layers.moe import ExpertStack
from jaxllm.layers.norm import rms_norm
from jaxllm.layers.rotary import apply_rope, rope_inv_freq, rope_mscale
from jaxllm.models.arch import ArchConfig
from jaxllm.models.base import Target, WeightMap
from jaxllm.params import ParamSpec
from jaxllm.parallel import platform_of
from jaxllm.quantization import QuantSpec, out_in, quantized_specs
from jaxllm.quantization.qweight import QWeight, embed_rows


def _hf_layer(fused_in_checkpoint: bool) -> dict[str, Target]:
    table = {
        "input_layernorm.weight": Target("input_norm"),
        "post_attention_layernorm.weight": Target("post_norm"),
        "self_attn.o_proj.weight": Target("wo", True),
        "self_attn.o_proj.bias": Target("bo"),
        "self_attn.q_norm.weight": Target("q_norm"),
        "self_attn.k_norm.weight": Target("k_norm"),
        "mlp.down_proj.weight": Target("w_down", True),
        "mlp.down_proj.bias": Target("b_down"),
    }
    if fused_in_checkpoint:
        return table | {"self_attn.qkv_proj.weight": Target("wqkv", True),
                        "mlp.gate_up_proj.weight": Target("w_gate_up", True)}
    for part in "qkv":
        table[f"self_attn.{part}_proj.weight"] = Target("wqkv", True, part)
        table[f"self_attn.{part}_proj.bias"] = Target("bqkv", False, part)
    for part in ("gate", "up"):
        table[f"mlp.{part}_proj.weight"] = Target("w_gate_up", True, part)
        table[f"mlp.{part}_proj.bias"] = Target("b_gate_up", False, part)
    return table


_HF_WHOLE = {
    "model.embed_tokens.weight": Target("embed_tokens"),
    "model.norm.weight": Target("norm"),
    "lm_head.weight": Target("lm_head", True),
}
_GGUF_LAYER = {
    "attn_norm.weight": Target("input_norm"),
    "ffn_norm.weight": Target("post_norm"),
    "attn_q.weight": Target("wqkv", True, "q", unpermute="q"),
    "attn_k.weight": Target("wqkv", True, "k", unpermute="k"),
    "attn_v.weight": Target("wqkv", True, "v"),
    "attn_output.weight": Target("wo", True),
    "ffn_gate.weight": Target("w_gate_up", True, "gate"),
    "ffn_up.weight": Target("w_gate_up", True, "up"),
    "ffn_down.weight": Target("w_down", True),
    "attn_q.bias": Target("bqkv", False, "q", unpermute="q"),
    "attn_k.bias": Target("bqkv", False, "k", unpermute="k"),
    "attn_v.bias": Target("bqkv", False, "v"),
    "attn_output.bias": Target("bo"),
    "ffn_gate.bias": Target("b_gate_up", False, "gate"),
    "ffn_up.bias": Target("b_gate_up", False, "up"),
    "ffn_down.bias": Target("b_down"),
}
_GGUF_WHOLE = {
    "token_embd.weight": Target("embed_tokens"),
    "output_norm.weight": Target("norm"),
    "output.weight": Target("lm_head", True),
}


def device_major(parts: list[np.ndarray], tp: int) -> np.ndarray:
    """Concatenate `parts` on the last axis so that each of `tp` equal column shards holds
    its share of every part, in order."""
    split = [p.reshape(*p.shape[:-1], tp, p.shape[-1] // tp) for p in parts]
    out = np.concatenate(split, axis=-1)
    return out.reshape(*out.shape[:-2], -1)


def split_device_major(y: jax.Array, sizes: list[int], tp: int) -> list[jax.Array]:
    """The inverse of device_major on a traced array: each part with its full width."""
    y = y.reshape(*y.shape[:-1], tp, y.shape[-1] // tp)
    out, start = [], 0
    for n in sizes:
        part = y[..., start:start + n // tp]
        out.append(part.reshape(*part.shape[:-2], n))
        start += n // tp
    return out


class LlamaForCausalLM(nnx.Module):
    # checkpoint tensor names -> our parameters
    HF_WEIGHTS = WeightMap(r"model\.layers\.(\d+)\.(.+)", _hf_layer(fused_in_checkpoint=False), _HF_WHOLE,
                           # RoPE's inverse frequencies, recomputed from the config
                           ignored_re=r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
    GGUF_WEIGHTS = WeightMap(r"blk\.(\d+)\.(.+)", _GGUF_LAYER, _GGUF_WHOLE)
    GGUF_ARCHITECTURES = ("llama",)
    KV_CACHE_AXES = ("layers", "kv", "kv_heads", "slots", "head_dim")
    # the matrices each layer applies, by parameter name: where adapters add and `observe` looks
    PROJECTION_SITES = ("wqkv", "wo", "w_gate_up", "w_down")

    @classmethod
    def arch_from_hf(cls, cfg: dict) -> ArchConfig:
        return ArchConfig.from_hf(cfg)

    @classmethod
    def arch_from_gguf(cls, arch: ArchConfig, field) -> ArchConfig:
        """The family's adjustments to what a GGUF file's common metadata gave (`field(key,
        default)` reads the file's keys of its architecture)."""
        return arch

    @staticmethod
    def segments(cfg: ArchConfig) -> dict[str, dict[str, int]]:
        """The parts of each fused parameter's last axis, in order, with their widths."""
        H, K, D, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        qkv = {"q": H * D, "k": K * D, "v": K * D}
        return {"wqkv": qkv, "bqkv": qkv, "w_gate_up": {"gate": F, "up": F},
                "b_gate_up": {"gate": F, "up": F}}

    @classmethod
    def param_specs(cls, cfg: ArchConfig) -> dict[str, ParamSpec]:
        """Every parameter by its dotted name: shape, logical axes, init and dtype role."""
        L, E, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        H, K, D, V = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size + cfg.vocab_pad
        norm = dict(init="ones", role="activation")
        bias = dict(init="zeros", role="activation")
        specs = {
            "embed_tokens": ParamSpec((V, E), ("vocab", "embed"), matrix="out_in"),
            "norm": ParamSpec((E,), ("embed",), **norm),
            "layers.input_norm": ParamSpec((L, E), ("layers", "embed"), **norm),
            # the fused axes are sharded whole: device_major puts each device's part together
            "layers.wqkv": ParamSpec((L, E, (H + 2 * K) * D), ("layers", "embed", "heads"),
                                     matrix="in_out"),
            "layers.wo": ParamSpec((L, H * D, E), ("layers", "heads", "embed"), matrix="in_out"),
            "layers.post_norm": ParamSpec((L, E), ("layers", "embed"), **norm),
            "layers.w_gate_up": ParamSpec((L, E, 2 * F), ("layers", "embed", "mlp"), matrix="in_out"),
            "layers.w_down": ParamSpec((L, F, E), ("layers", "mlp", "embed"), matrix="in_out"),
        }
        if cfg.qkv_bias:
            specs["layers.bqkv"] = ParamSpec((L, (H + 2 * K) * D), ("layers", "heads"), **bias)
        if cfg.o_bias:
            specs["layers.bo"] = ParamSpec((L, E), ("layers", "embed"), **bias)
        if cfg.mlp_bias:
            specs["layers.b_gate_up"] = ParamSpec((L, 2 * F), ("layers", "mlp"), **bias)
            specs["layers.b_down"] = ParamSpec((L, E), ("layers", "embed"), **bias)
        if cfg.qk_norm and cfg.qk_norm_all_heads:  # over q's and k's whole widths
            specs["layers.q_norm"] = ParamSpec((L, H * D), ("layers", None), **norm)
            specs["layers.k_norm"] = ParamSpec((L, K * D), ("layers", None), **norm)
        elif cfg.qk_norm:
            specs["layers.q_norm"] = ParamSpec((L, D), ("layers", "head_dim"), **norm)
            specs["layers.k_norm"] = ParamSpec((L, D), ("layers", "head_dim"), **norm)
        if not cfg.tie_word_embeddings:
            specs["lm_head"] = ParamSpec((E, V), ("embed", "vocab"), matrix="in_out")
        return specs

    @classmethod
    def tp_transform(cls, weights: dict[str, np.ndarray], cfg: ArchConfig, plan) -> dict[str, np.ndarray]:
        """Checkpoint-shaped host weights -> the runtime layout for `plan` (jaxllm.parallel):
        KV heads repeated, MLP and vocabulary padded, fused columns device-major. Any subset
        of the parameters may be given (LoRA passes adapter factors shaped like one side)."""
        if plan.size == 1:
            return weights
        out = dict(weights)
        tp, D = plan.size, cfg.head_dim
        seg = cls.segments(cfg)

        def parts(name):
            w, start, res = out[name], 0, []
            for n in seg[name.split(".")[-1]].values():
                res.append(w[..., start:start + n])
                start += n
            return res

        def repeat_heads(w):
            heads = w.shape[-1] // D
            w = np.repeat(w.reshape(*w.shape[:-1], heads, D), plan.kv_repeat, axis=-2)
            return w.reshape(*w.shape[:-2], heads * plan.kv_repeat * D)

        def pad_last(w, n):
            return np.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, n)])

        for name in ("layers.wqkv", "layers.bqkv"):
            if name in out:
                q, k, v = parts(name)
                out[name] = device_major([q, repeat_heads(k), repeat_heads(v)], tp)
        if cfg.qk_norm_all_heads and plan.kv_repeat > 1 and "layers.k_norm" in out:
            out["layers.k_norm"] = repeat_heads(out["layers.k_norm"])
        for name in ("layers.w_gate_up", "layers.b_gate_up"):
            if name in out:
                out[name] = device_major([pad_last(p, plan.mlp_pad) for p in parts(name)], tp)
        if plan.mlp_pad and "layers.w_down" in out:
            out["layers.w_down"] = np.pad(out["layers.w_down"], ((0, 0), (0, plan.mlp_pad), (0, 0)))
        if plan.vocab_pad and "embed_tokens" in out:
            out["embed_tokens"] = np.pad(out["embed_tokens"], ((0, plan.vocab_pad), (0, 0)))
            if "lm_head" in out:
                out["lm_head"] = pad_last(out["lm_head"], plan.vocab_pad)
        return out

    def __init__(self, cfg: ArchConfig, policy: DTypePolicy | None = None, *, rngs: nnx.Rngs,
                 attention_backend: str = "xla", mesh=None, scan_layers: bool | None = None,
                 quant: QuantSpec | None = None, matmul_backend: str | None = None):
        """matmul_backend: where matmuls run (jaxllm.kernels.matmul_backend; None: the default
        for `mesh`)."""
        self.cfg = cfg
        self.policy = policy = policy or uniform_policy(jnp.float32)
        self.attention_backend = attention_backend
        self.mesh = mesh  # tensor parallelism: attention runs under shard_map over it
        if scan_layers is None:
            scan_layers = platform_of(mesh) != "gpu"
        self.scan_layers = scan_layers
        self.quant = quant
        # bf16 float matrices on a CPU go through the kernel that widens them in registers
        if matmul_backend is None:
            matmul_backend = default_matmul_backend(platform_of(mesh), 1 if mesh is None else mesh.size)
        self.matmul_backend = matmul_backend
        self.dense_kernel = uses_dense_kernel(policy, matmul_backend)
        specs = self.param_specs(cfg)
        full = quantized_specs(specs, quant)

        def param(name):
            layout = quant.get(name) if quant is not None else None
            if layout is not None:  # a quantized matrix: its parts
                parts = {k.rsplit(".", 1)[1]: nnx.Param(full[k].initial(rngs.params(), full[k].dtype_for(policy)))
                         for k in full if k.startswith(name + ".")}
                K = out_in(specs[name].shape, specs[name].matrix)[1]
                return QParam(parts, quant.act_of(name, K), quant.backend)
            return nnx.Param(specs[name].initial(rngs.params(), specs[name].dtype_for(policy)))

        self.embed_tokens = param("embed_tokens")
        self.layers = _Layers({k.split(".", 1)[1]: param(k) for k in specs if k.startswith("layers.")})
        self.norm = param("norm")
        self.lm_head = param("lm_head") if "lm_head" in specs else None

    def compute_logits(self, h: jax.Array, rows=None) -> jax.Array:
        """Final-normed hidden states [N, E] -> logits [N, V] in f32. rows: how many leading
        rows are real (padded ones may come back as anything)."""
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        if isinstance(head, QParam):  # quantized matrices are out-major: the table itself
            head = head.weight()
        elif self.dense_kernel:
            head = dense_weight(head[...], out_major=self.lm_head is None)
        elif self.lm_head is None:
            head = head[...].T
        else:
            head = head[...]
        logits = linear(h, head, self.policy, rows=rows).astype(jnp.float32)
        return logits[:, :self.cfg.vocab_size] if self.cfg.vocab_pad else logits

    def rope(self):
        cfg = self.cfg
        rot = cfg.rotary_dim or cfg.head_dim
        return jnp.asarray(rope_inv_freq(rot, cfg.rope_theta, cfg.rope_scaling)), rope_mscale(cfg.rope_scaling)

    def __call__(self, kv_cache: jax.Array, input_ids: jax.Array, md: AttentionMetadata,
                 lora=None, observe=None, mm=None) -> tuple[jax.Array, jax.Array]:
        """Returns (final-normed hidden states [T, E], new kv_cache). `lora`: the step's
        adapters (jaxllm.lora.ops.LoRAInputs), their weights scanned with the layers'.
        `observe(site, layer, x)`, traced: sees the input x of each of PROJECTION_SITES of each layer (a traced index); calibration records it.
        `mm`: (embeddings [T, E], mask [T]) put in place of the masked tokens' embeddings
        (a vision-language model's image features)."""
        cfg, pol = self.cfg, self.policy
        T = input_ids.shape[0]
        H, K, D, tp = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.tp_size
        eps = cfg.rms_norm_eps
        inv_freq, mscale = self.rope()
        scale = D ** -0.5
        real = md.query_start_loc[-1]  # tokens before the bucket's padding: linear skips the rest
        if isinstance(self.embed_tokens, QParam):
            x = embed_rows(self.embed_tokens.weight(), input_ids, pol.activation)
        elif is_bf16_panels(self.embed_tokens[...]):  # a tied table kept as the head's panels
            x = embed_from_panels(self.embed_tokens[...], input_ids).astype(pol.activation)
        else:
            x = self.embed_tokens[...][input_ids].astype(pol.activation)
        if mm is not None:  # (embeddings [T, E], mask [T]): an image's tokens replace theirs
            x = jnp.where(mm[1][:, None], mm[0].astype(pol.activation), x)

        def layer(carry, w):
            x, kv, i = carry

            def adapters(site):
                adapter = None if lora is None else lora.hook(site, w["lora"], pol)
                if observe is None:
                    return adapter

                def observed(x, y):
                    observe(site, i, x)
                    return y if adapter is None else adapter(x, y)
                return observed

            h = rms_norm(x, w["input_norm"], eps)
            qkv = linear(h, w["wqkv"], pol, w.get("bqkv"), adapters("wqkv"), real)
            q, k, v = split_device_major(qkv, [H * D, K * D, K * D], tp)
            if cfg.qk_norm and cfg.qk_norm_all_heads:
                q, k = rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)
            if cfg.clip_qkv is not None:  # after the norms, as OLMoE clips
                q, k, v = (jnp.clip(a, -cfg.clip_qkv, cfg.clip_qkv) for a in (q, k, v))
            q, k, v = q.reshape(T, H, D), k.reshape(T, K, D), v.reshape(T, K, D)
            if cfg.qk_norm and not cfg.qk_norm_all_heads:
                q, k = rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)
            q = apply_rope(q, md.positions, inv_freq, mscale)
            k = apply_rope(k, md.positions, inv_freq, mscale)
            o, kv = attention_block(q, k, v, kv, i, md, scale, cfg.sliding_window,
                                    self.attention_backend, self.mesh)
            x = x + linear(o.reshape(T, H * D), w["wo"], pol, w.get("bo"), adapters("wo"), real)
            h = rms_norm(x, w["post_norm"], eps)
            x = x + self.feed_forward(h, w, real, adapters)
            return (x, kv, i + 1), None

        weights = self.layers.weights()
        if self.dense_kernel:
            # layer stacks are [L, K, N] bf16, or panels packed at load
            weights = {k: w if isinstance(w, QWeight) else
                       dense_weight(w) if w.ndim == 3 or is_bf16_panels(w) else w
                       for k, w in weights.items()}
        weights = self.in_place_weights(weights)
        # quantized (and kernel-read) stacks are read in place at the layer's index
        kinds = (QWeight, DenseWeight, ExpertStack)
        stacked = {k: w for k, w in weights.items() if not isinstance(w, kinds)}
        in_place = {k: w for k, w in weights.items() if isinstance(w, kinds)}
        if lora is not None:  # the adapters' stacked weights are scanned with the layers'
            stacked["lora"] = lora.weights

        def layer_of(carry, w):
            return layer(carry, {**w, **{k: q.at(carry[2]) for k, q in in_place.items()}})

        if self.scan_layers:
            (x, kv_cache, _), _ = jax.lax.scan(layer_of, (x, kv_cache, jnp.int32(0)), stacked)
        else:
            for i in range(cfg.num_layers):
                (x, kv_cache, _), _ = layer((x, kv_cache, jnp.int32(i)),
                                            {**jax.tree.map(lambda a: a[i], stacked),
                                             **{k: q.at(i) for k, q in in_place.items()}})
        return rms_norm(x, self.norm[...], eps), kv_cache

    def feed_forward(self, h: jax.Array, w: dict, real, adapters) -> jax.Array:
        """The MLP of one layer: h [T, E] -> [T, E] (an MoE family routes it to experts)."""
        F, tp, pol = self.cfg.intermediate_size, self.cfg.tp_size, self.policy
        gate, up = split_device_major(linear(h, w["w_gate_up"], pol, w.get("b_gate_up"),
                                             adapters("w_gate_up"), real), [F, F], tp)
        return linear(jax.nn.silu(gate) * up, w["w_down"], pol, w.get("b_down"),
                      adapters("w_down"), real)

    def in_place_weights(self, weights: dict) -> dict:
        """The layer stacks as the layers read them (an MoE family wraps its experts' stacks
        for the CPU kernel)."""
        return weights


class _Layers(nnx.Module):
    """All decoder layers, each weight stacked over the layer axis."""

    def __init__(self, params: dict):
        for name, p in params.items():
            setattr(self, name, p)

    def weights(self) -> dict:
        """Float stacks as arrays, quantized ones as QWeights (no layer chosen)."""
        out = {}
        for k, v in vars(self).items():
            if isinstance(v, nnx.Param):
                out[k] = v[...]
            elif isinstance(v, QParam):
                out[k] = v.weight()
        return out


class QParam(nnx.Module):
    """A quantized matrix (or stack of them): its parts q, scale (offset, smooth) as Params."""

    def __init__(self, parts: dict[str, nnx.Param], act: str, backend: str):
        for name, p in parts.items():
            setattr(self, name, p)
        self.act, self.backend = act, backend

    def weight(self) -> QWeight:
        part = (lambda n: getattr(self, n)[...] if hasattr(self, n) else None)
        return QWeight(part("q"), part("scale"), part("offset"), part("smooth"),
                       act=self.act, backend=self.backend)
