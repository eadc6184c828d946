"""LLaVA (`LlavaForConditionalGeneration`): a CLIP vision tower, a two-layer projector, and a
Llama-family language model. An image becomes `tokens_per_image` feature vectors that take
the place of as many image placeholder tokens in the prompt; the language model then runs as
any other, image tokens in the paged KV cache like text.

The vision tower runs in its own call (`encode_images`, jitted by the caller with its own
shape buckets: the number of images); its weights stay float under quantization and are
replicated under tensor parallelism. The language model is the Llama family's class, with
the checkpoint's names mapped onto it (transformers writes them as `language_model.model.*`,
older LLaVA files as `language_model.model.*` with `vision_tower.vision_model.*`, newer ones
as `model.language_model.*`).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.models.arch import ArchConfig
from jaxllm.models.base import Target, WeightMap
from jaxllm.models.llama import _HF_WHOLE, LlamaForCausalLM, _Layers, _hf_layer
from jaxllm.params import ParamSpec

TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                      "qwen2": "Qwen2ForCausalLM"}

# transformers' defaults for what a LLaVA config may leave out (LlamaConfig, MistralConfig,
# Qwen2Config, CLIPVisionConfig): read from the classes once, kept here so that reading a
# config needs no transformers import on the loader's thread
_TEXT_DEFAULTS = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, hidden_act="silu", max_position_embeddings=2048,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                    max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=10000.0,
                    sliding_window=4096, tie_word_embeddings=False),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, hidden_act="silu",
                  max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=False),
}
_CLIP_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                      num_attention_heads=12, num_channels=3, image_size=224, patch_size=32,
                      hidden_act="quick_gelu", layer_norm_eps=1e-5)

_RENAMES = [(re.compile(p), r) for p, r in (
    (r"^(?:model\.)?language_model\.(?:model\.)?(?=layers\.|embed_tokens\.|norm\.)", "model."),
    (r"^language_model\.lm_head\.", "lm_head."),
    (r"^model\.vision_tower\.", "vision_tower."),
    (r"^vision_tower\.vision_model\.", "vision_tower."),
    (r"^model\.multi_modal_projector\.", "multi_modal_projector."))]


def _rename(name: str) -> str:
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


def _vision_layer() -> dict[str, Target]:
    v = (lambda name, transpose=False, segment=None: Target(name, transpose, segment, stack="vision_layers"))
    table = {"layer_norm1.weight": v("ln1_w"), "layer_norm1.bias": v("ln1_b"),
             "layer_norm2.weight": v("ln2_w"), "layer_norm2.bias": v("ln2_b"),
             "self_attn.out_proj.weight": v("vo", True), "self_attn.out_proj.bias": v("vbo"),
             "mlp.fc1.weight": v("fc1", True), "mlp.fc1.bias": v("fc1_b"),
             "mlp.fc2.weight": v("fc2", True), "mlp.fc2.bias": v("fc2_b")}
    for part in "qkv":
        table[f"self_attn.{part}_proj.weight"] = v("vqkv", True, part)
        table[f"self_attn.{part}_proj.bias"] = v("vbqkv", False, part)
    return table


_VISION_WHOLE = {
    "vision_tower.embeddings.patch_embedding.weight": Target("vision_patch"),
    "vision_tower.embeddings.class_embedding": Target("vision_class"),
    "vision_tower.embeddings.position_embedding.weight": Target("vision_pos"),
    "vision_tower.pre_layrnorm.weight": Target("vision_pre_w"),
    "vision_tower.pre_layrnorm.bias": Target("vision_pre_b"),
    "multi_modal_projector.linear_1.weight": Target("projector_w1", True),
    "multi_modal_projector.linear_1.bias": Target("projector_b1"),
    "multi_modal_projector.linear_2.weight": Target("projector_w2", True),
    "multi_modal_projector.linear_2.bias": Target("projector_b2"),
}

_ACTS = {"quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
         "gelu": lambda x: jax.nn.gelu(x, approximate=False),
         "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def _act(name: str, what: str):
    if name not in _ACTS:
        raise ValueError(f"LlavaForConditionalGeneration: {what} {name!r} is not supported; "
                         f"supported: {', '.join(_ACTS)}")
    return _ACTS[name]


def _layer_norm(x, w, b, eps):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, -1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * w + b).astype(x.dtype)


class LlavaForConditionalGeneration(LlamaForCausalLM):
    HF_WEIGHTS = WeightMap(r"model\.layers\.(\d+)\.(.+)", _hf_layer(fused_in_checkpoint=False),
                           _HF_WHOLE | _VISION_WHOLE,
                           ignored_re=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq|"
                                       r"vision_tower\.post_layernorm\..*|"
                                       r"vision_tower\.embeddings\.position_ids"),
                           stacks=((r"vision_tower\.encoder\.layers\.(\d+)\.(.+)", _vision_layer()),),
                           rename=_rename)
    GGUF_ARCHITECTURES = ()
    # LoRA adapts the language model (the Llama sites)

    @classmethod
    def arch_from_hf(cls, cfg: dict) -> ArchConfig:
        text = dict(cfg.get("text_config") or {})
        kind = text.get("model_type", "llama")
        if kind not in TEXT_ARCHITECTURES:
            raise ValueError(f"LlavaForConditionalGeneration: a {kind!r} language model is not "
                             f"supported; supported: {', '.join(TEXT_ARCHITECTURES)}")
        # llava-hf's files list only what differs from the configs' defaults: fill them in
        text = {**_TEXT_DEFAULTS[kind], **text}
        text["architectures"] = [TEXT_ARCHITECTURES[kind]]
        arch = ArchConfig.from_hf(text)
        vc = dict(cfg.get("vision_config") or {})
        if vc.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"LlavaForConditionalGeneration: a {vc.get('model_type')!r} vision tower "
                             "is not supported; supported: clip_vision_model")
        vc = {**_CLIP_DEFAULTS, **vc}
        layers = vc["num_hidden_layers"]
        feature = cfg.get("vision_feature_layer", -2)
        feature = tuple(feature) if isinstance(feature, (list, tuple)) else (feature,)
        # hidden_states[i]: the embeddings (0) or the output of layer i; negative from the end
        feature = tuple(f if f >= 0 else layers + 1 + f for f in feature)
        if not all(0 <= f <= layers for f in feature):
            raise ValueError(f"vision_feature_layer {cfg.get('vision_feature_layer')} is outside "
                             f"the vision tower's {layers} layers")
        select = cfg.get("vision_feature_select_strategy", "default")
        if select not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {select!r} is not supported; "
                             "supported: default, full")
        image, patch = vc["image_size"], vc["patch_size"]
        per_image = (image // patch) ** 2 + (select == "full")
        act, proj_act = vc["hidden_act"], cfg.get("projector_hidden_act", "gelu")
        _act(act, "vision hidden_act")
        _act(proj_act, "projector_hidden_act")
        arch.architecture = "LlavaForConditionalGeneration"
        arch.vision = dict(
            hidden=vc["hidden_size"], intermediate=vc["intermediate_size"],
            layers=layers, heads=vc["num_attention_heads"], image_size=image,
            patch_size=patch, channels=vc["num_channels"], eps=vc["layer_norm_eps"],
            act=act, feature_layers=list(feature), select=select, projector_act=proj_act,
            projector_bias=cfg.get("multimodal_projector_bias", True),
            # (transformers' default when the config gives none)
            image_token_id=cfg.get("image_token_index", cfg.get("image_token_id", 32000)),
            tokens_per_image=per_image)
        return arch

    @staticmethod
    def segments(cfg: ArchConfig) -> dict[str, dict[str, int]]:
        seg = LlamaForCausalLM.segments(cfg)
        Dv = cfg.vision["hidden"]
        qkv = {"q": Dv, "k": Dv, "v": Dv}
        return seg | {"vqkv": qkv, "vbqkv": qkv}

    @classmethod
    def param_specs(cls, cfg: ArchConfig) -> dict[str, ParamSpec]:
        specs = super().param_specs(cfg)
        v = cfg.vision
        Dv, Fv, Lv, C, p = v["hidden"], v["intermediate"], v["layers"], v["channels"], v["patch_size"]
        P, E = (v["image_size"] // p) ** 2, cfg.hidden_size
        act = dict(init="ones", role="activation")
        zero = dict(init="zeros", role="activation")
        # replicated on every device, float under quantization (no `matrix`)
        rep = (lambda shape, **kw: ParamSpec(shape, (None,) * len(shape), **kw))
        specs.update({
            "vision_patch": rep((Dv, C, p, p)), "vision_class": rep((Dv,)),
            "vision_pos": rep((P + 1, Dv)), "vision_pre_w": rep((Dv,), **act),
            "vision_pre_b": rep((Dv,), **zero),
            "vision_layers.ln1_w": rep((Lv, Dv), **act), "vision_layers.ln1_b": rep((Lv, Dv), **zero),
            "vision_layers.vqkv": rep((Lv, Dv, 3 * Dv)), "vision_layers.vbqkv": rep((Lv, 3 * Dv), **zero),
            "vision_layers.vo": rep((Lv, Dv, Dv)), "vision_layers.vbo": rep((Lv, Dv), **zero),
            "vision_layers.ln2_w": rep((Lv, Dv), **act), "vision_layers.ln2_b": rep((Lv, Dv), **zero),
            "vision_layers.fc1": rep((Lv, Dv, Fv)), "vision_layers.fc1_b": rep((Lv, Fv), **zero),
            "vision_layers.fc2": rep((Lv, Fv, Dv)), "vision_layers.fc2_b": rep((Lv, Dv), **zero),
            "projector_w1": rep((Dv * len(v["feature_layers"]), E)), "projector_w2": rep((E, E)),
        })
        if v["projector_bias"]:
            specs.update({"projector_b1": rep((E,), **zero), "projector_b2": rep((E,), **zero)})
        return specs

    def __init__(self, cfg: ArchConfig, policy=None, *, rngs: nnx.Rngs, **kwargs):
        super().__init__(cfg, policy, rngs=rngs, **kwargs)
        specs = self.param_specs(cfg)

        def param(name):
            return nnx.Param(specs[name].initial(rngs.params(), specs[name].dtype_for(self.policy)))
        for name in specs:
            if name.startswith(("vision_", "projector_")) and "." not in name:
                setattr(self, name, param(name))
        self.vision_layers = _Layers({k.split(".", 1)[1]: param(k) for k in specs
                                      if k.startswith("vision_layers.")})

    def encode_images(self, pixels: jax.Array) -> jax.Array:
        """Images [B, C, S, S] (normalised as the checkpoint's processor does) -> their
        features in the language model's space, [B, tokens_per_image, E]."""
        v, pol = self.cfg.vision, self.policy
        Dv, H, p, eps = v["hidden"], v["heads"], v["patch_size"], v["eps"]
        B, C, S, _ = pixels.shape
        g = S // p
        patches = pixels.reshape(B, C, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(B, g * g, C * p * p)
        dot = (lambda a, b: jnp.matmul(a.astype(pol.dot), b.astype(pol.dot),
                                       preferred_element_type=pol.accum).astype(pol.activation))
        x = dot(patches, self.vision_patch[...].reshape(Dv, -1).T)
        cls = jnp.broadcast_to(self.vision_class[...].astype(x.dtype), (B, 1, Dv))
        x = jnp.concatenate([cls, x], axis=1) + self.vision_pos[...].astype(x.dtype)
        x = _layer_norm(x, self.vision_pre_w[...], self.vision_pre_b[...], eps)
        act = _ACTS[v["act"]]
        D = Dv // H

        def layer(x, w):
            h = _layer_norm(x, w["ln1_w"], w["ln1_b"], eps)
            qkv = dot(h, w["vqkv"]) + w["vbqkv"].astype(h.dtype)
            q, k, val = (t.reshape(B, -1, H, D) for t in jnp.split(qkv, 3, axis=-1))
            s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * D ** -0.5
            o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), val.astype(jnp.float32))
            x = x + dot(o.reshape(B, -1, Dv).astype(x.dtype), w["vo"]) + w["vbo"].astype(x.dtype)
            h = _layer_norm(x, w["ln2_w"], w["ln2_b"], eps)
            h = act(dot(h, w["fc1"]) + w["fc1_b"].astype(h.dtype))
            x = x + dot(h, w["fc2"]) + w["fc2_b"].astype(x.dtype)
            return x, x

        needed = max(v["feature_layers"])
        weights = jax.tree.map(lambda a: a[:needed], self.vision_layers.weights())
        _, outs = jax.lax.scan(layer, x, weights)
        hidden = [x if f == 0 else outs[f - 1] for f in v["feature_layers"]]
        if v["select"] == "default":  # the class token's row left out
            hidden = [h[:, 1:] for h in hidden]
        feats = jnp.concatenate(hidden, axis=-1)
        b1 = getattr(self, "projector_b1", None)
        b2 = getattr(self, "projector_b2", None)
        h = dot(feats, self.projector_w1[...]) + (0 if b1 is None else b1[...].astype(pol.activation))
        h = _ACTS[v["projector_act"]](h)
        return dot(h, self.projector_w2[...]) + (0 if b2 is None else b2[...].astype(pol.activation))
