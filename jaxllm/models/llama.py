"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, SmolLM2) as one Flax NNX model.

Per-layer weights are stacked on a leading layer axis. Off a GPU the layers run under
`jax.lax.scan`, so compile time does not grow with depth. On a GPU they are unrolled: in
XLA's GPU while loop each layer's weights are first copied out of the stack by a
dynamic-slice (a decode step would move every weight three times through HBM instead of
once), while a static slice folds into the matmul that reads it. Weights are stored
`[in, out]`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.layers.attention import AttentionMetadata, attention_block
from jaxllm.layers.norm import rms_norm
from jaxllm.layers.rotary import apply_rope, rope_inv_freq
from jaxllm.models.arch import ArchConfig
from jaxllm.parallel import platform_of


def param_shapes(cfg: ArchConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model by its dotted name."""
    L, E, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    H, K, D, V = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size + cfg.vocab_pad
    shapes = {
        "embed_tokens": (V, E),
        "norm": (E,),
        "layers.input_norm": (L, E),
        "layers.wq": (L, E, H * D),
        "layers.wk": (L, E, K * D),
        "layers.wv": (L, E, K * D),
        "layers.wo": (L, H * D, E),
        "layers.post_norm": (L, E),
        "layers.w_gate": (L, E, F),
        "layers.w_up": (L, E, F),
        "layers.w_down": (L, F, E),
    }
    if cfg.qkv_bias:
        shapes |= {"layers.bq": (L, H * D), "layers.bk": (L, K * D), "layers.bv": (L, K * D)}
    if cfg.o_bias:
        shapes["layers.bo"] = (L, E)
    if cfg.mlp_bias:
        shapes |= {"layers.b_gate": (L, F), "layers.b_up": (L, F), "layers.b_down": (L, E)}
    if cfg.qk_norm:
        shapes |= {"layers.q_norm": (L, D), "layers.k_norm": (L, D)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (E, V)
    return shapes


# logical axes of every parameter (jaxllm.parallel maps them to mesh axes)
PARAM_AXES = {
    "embed_tokens": ("vocab", "embed"),
    "norm": ("embed",),
    "lm_head": ("embed", "vocab"),
    "layers.input_norm": ("layers", "embed"),
    "layers.post_norm": ("layers", "embed"),
    "layers.wq": ("layers", "embed", "heads"),
    "layers.wk": ("layers", "embed", "kv_heads"),
    "layers.wv": ("layers", "embed", "kv_heads"),
    "layers.wo": ("layers", "heads", "embed"),
    "layers.bq": ("layers", "heads"),
    "layers.bk": ("layers", "kv_heads"),
    "layers.bv": ("layers", "kv_heads"),
    "layers.bo": ("layers", "embed"),
    "layers.b_gate": ("layers", "mlp"),
    "layers.b_up": ("layers", "mlp"),
    "layers.b_down": ("layers", "embed"),
    "layers.q_norm": ("layers", "head_dim"),
    "layers.k_norm": ("layers", "head_dim"),
    "layers.w_gate": ("layers", "embed", "mlp"),
    "layers.w_up": ("layers", "embed", "mlp"),
    "layers.w_down": ("layers", "mlp", "embed"),
}
KV_CACHE_AXES = ("layers", "kv", "kv_heads", "slots", "head_dim")


def _init(name: str, shape, dtype, key):
    if name.endswith("norm"):
        return jnp.ones(shape, dtype)
    if name.split(".")[-1].startswith("b"):
        return jnp.zeros(shape, dtype)
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class LlamaLayers(nnx.Module):
    """All decoder layers, each weight stacked over the layer axis."""

    def __init__(self, shapes: dict, dtype, rngs: nnx.Rngs):
        for name, shape in shapes.items():
            setattr(self, name, nnx.Param(_init(name, shape, dtype, rngs.params())))

    def weights(self) -> dict[str, jax.Array]:
        return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}


class LlamaForCausalLM(nnx.Module):
    def __init__(self, cfg: ArchConfig, dtype=jnp.float32, *, rngs: nnx.Rngs,
                 attention_backend: str = "xla", mesh=None, scan_layers: bool | None = None):
        self.cfg = cfg
        self.attention_backend = attention_backend
        self.mesh = mesh  # tensor parallelism: attention runs under shard_map over it
        if scan_layers is None:
            scan_layers = platform_of(mesh) != "gpu"
        self.scan_layers = scan_layers
        shapes = param_shapes(cfg)
        layer_shapes = {k.split(".", 1)[1]: v for k, v in shapes.items() if k.startswith("layers.")}
        self.embed_tokens = nnx.Param(_init("embed_tokens", shapes["embed_tokens"], dtype, rngs.params()))
        self.layers = LlamaLayers(layer_shapes, dtype, rngs)
        self.norm = nnx.Param(jnp.ones(shapes["norm"], dtype))
        self.lm_head = (nnx.Param(_init("lm_head", shapes["lm_head"], dtype, rngs.params()))
                        if "lm_head" in shapes else None)

    def compute_logits(self, h: jax.Array) -> jax.Array:
        """Final-normed hidden states [N, E] -> logits [N, V] in f32."""
        head = self.embed_tokens[...].T if self.lm_head is None else self.lm_head[...]
        logits = (h @ head).astype(jnp.float32)
        return logits[:, :self.cfg.vocab_size] if self.cfg.vocab_pad else logits

    def __call__(self, kv_cache: jax.Array, input_ids: jax.Array,
                 md: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
        """Returns (final-normed hidden states [T, E], new kv_cache)."""
        cfg = self.cfg
        T = input_ids.shape[0]
        H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        inv_freq = jnp.asarray(rope_inv_freq(D, cfg.rope_theta, cfg.rope_scaling))
        scale = D ** -0.5
        embed = self.embed_tokens[...]
        x = embed[input_ids]

        def layer(carry, w):
            x, kv, i = carry
            h = rms_norm(x, w["input_norm"], eps)
            q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
            if cfg.qkv_bias:
                q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
            q, k, v = q.reshape(T, H, D), k.reshape(T, K, D), v.reshape(T, K, D)
            if cfg.qk_norm:
                q, k = rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)
            q = apply_rope(q, md.positions, inv_freq)
            k = apply_rope(k, md.positions, inv_freq)
            o, kv = attention_block(q, k, v, kv, i, md, scale, cfg.sliding_window,
                                    self.attention_backend, self.mesh)
            o = o.reshape(T, H * D) @ w["wo"]
            x = x + (o + w["bo"] if cfg.o_bias else o)
            h = rms_norm(x, w["post_norm"], eps)
            gate, up = h @ w["w_gate"], h @ w["w_up"]
            if cfg.mlp_bias:
                gate, up = gate + w["b_gate"], up + w["b_up"]
            down = (jax.nn.silu(gate) * up) @ w["w_down"]
            x = x + (down + w["b_down"] if cfg.mlp_bias else down)
            return (x, kv, i + 1), None

        weights = self.layers.weights()
        if self.scan_layers:
            (x, kv_cache, _), _ = jax.lax.scan(layer, (x, kv_cache, jnp.int32(0)), weights)
        else:
            for i in range(cfg.num_layers):
                (x, kv_cache, _), _ = layer((x, kv_cache, jnp.int32(i)),
                                            {k: w[i] for k, w in weights.items()})
        return rms_norm(x, self.norm[...], eps), kv_cache
