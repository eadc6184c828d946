"""Architecture hyper-parameters, read from an HF config.json dict or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    vocab_pad: int = 0  # zero rows added for tensor parallelism; their logits are cut off
    tp_size: int = 1    # devices the runtime shapes are split over (fused columns are device-major)
    rotary_dim: int | None = None  # RoPE on the first rotary_dim of head_dim (None: all of it)
    # OLMoE: q and k normed over all their heads at once (not per head), and q/k/v clipped
    qk_norm_all_heads: bool = False
    clip_qkv: float | None = None
    # mixture of experts (0: a dense MLP); intermediate_size is then each expert's
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True   # the top-k router weights renormalised to sum to 1
    expert_parallel: bool = False  # runtime: experts split over the devices, not their columns
    # a vision-language model's vision tower and projector (models/llava.py reads it), None
    # for text-only models
    vision: dict | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 "
                             f"and the number of experts ({self.num_experts})")

    @classmethod
    def from_hf(cls, cfg: dict) -> "ArchConfig":
        """The Llama family's reading of an HF config; other families adjust it (their model
        class's arch_from_hf)."""
        from jaxllm.models.registry import resolve_architecture
        arch = resolve_architecture(cfg.get("architectures"))
        act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported for {arch}; only 'silu' is")
        heads = cfg["num_attention_heads"]
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if kind == "default" else rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases and never an o bias; the others follow attention_bias
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=_sliding_window(cfg, arch),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
        )


def _sliding_window(cfg: dict, arch: str) -> int | None:
    """One window for every layer, or None. Qwen's use_sliding_window / max_window_layers (and
    transformers' layer_types) may give some layers a window and others none; that mix is
    refused rather than run with the wrong attention."""
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None and arch.startswith("Qwen"):
        if not cfg.get("use_sliding_window", False):
            return None
        first = cfg.get("max_window_layers", layers)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if types is None:
        return cfg.get("sliding_window")
    kinds = set(types)
    if kinds <= {"full_attention"}:
        return None
    if kinds == {"sliding_attention"} and cfg.get("sliding_window"):
        return cfg["sliding_window"]
    raise ValueError(f"{arch}: sliding-window attention on some layers only ({types.count('sliding_attention')} "
                     f"of {layers}, from use_sliding_window/max_window_layers/layer_types) is not "
                     "supported; all layers or none must use the window")
