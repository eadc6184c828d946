"""HF checkpoint names -> jaxllm parameter names (stacked per layer, `[in, out]`)."""
from __future__ import annotations

import re

import numpy as np

# HF suffix -> (our name, transpose)
_LAYER = {
    "input_layernorm.weight": ("input_norm", False),
    "post_attention_layernorm.weight": ("post_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.o_proj.bias": ("bo", False),
    "mlp.gate_proj.bias": ("b_gate", False),
    "mlp.up_proj.bias": ("b_up", False),
    "mlp.down_proj.bias": ("b_down", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}
_GLOBAL = {
    "model.embed_tokens.weight": ("embed_tokens", False),
    "model.norm.weight": ("norm", False),
    "lm_head.weight": ("lm_head", True),
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


# tensors some checkpoints carry that hold nothing the model needs (RoPE's inverse
# frequencies, recomputed from the config)
_IGNORED_RE = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def map_hf_name(name: str) -> tuple[str, int | None, bool] | None:
    """(our name, layer index or None, transpose); None for a tensor that is safe to skip.
    A tensor we do not know is an error: skipping it would run a different model."""
    if name in _GLOBAL:
        ours, t = _GLOBAL[name]
        return ours, None, t
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in _LAYER:
        ours, t = _LAYER[m.group(2)]
        return "layers." + ours, int(m.group(1)), t
    if _IGNORED_RE.fullmatch(name):
        return None
    raise ValueError(f"checkpoint tensor {name} is not used by this model (unsupported "
                     "architecture variant?)")


class StackedWeights:
    """Collects per-layer tensors into stacked arrays, checking every shape."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype):
        self.shapes = shapes
        self.dtype = dtype
        self.arrays: dict[str, np.ndarray] = {}
        self.filled: dict[str, set] = {}

    def put(self, name: str, layer: int | None, value: np.ndarray, source: str,
            transpose: bool = False) -> None:
        """Store `value` (`value.T` when `transpose`), checking its shape as the file has it."""
        if name not in self.shapes:
            if name == "lm_head" and "embed_tokens" in self.shapes:
                return  # tied embeddings: some checkpoints store the copy anyway
            raise ValueError(f"checkpoint tensor {source} has no place in this model's "
                             f"configuration (is a config flag such as a bias missing?)")
        full = self.shapes[name]
        want = tuple(full[1:] if layer is not None else full)
        file_shape = want[::-1] if transpose else want
        if tuple(value.shape) != file_shape:
            raise ValueError(f"tensor {source} has shape {tuple(value.shape)}, expected {file_shape}")
        if transpose:
            value = value.T
        if layer is None:
            self.arrays[name] = np.asarray(value, dtype=self.dtype)
            self.filled[name] = {None}
            return
        if layer >= full[0]:
            raise ValueError(f"tensor {source}: layer {layer} but the model has {full[0]} layers")
        arr = self.arrays.get(name)
        if arr is None:
            arr = self.arrays[name] = np.empty(full, dtype=self.dtype)
        arr[layer] = value
        self.filled.setdefault(name, set()).add(layer)

    def finish(self) -> dict[str, np.ndarray]:
        for name, shape in self.shapes.items():
            got = self.filled.get(name, set())
            want = {None} if not name.startswith("layers.") else set(range(shape[0]))
            if got != want:
                missing = sorted(want - got, key=lambda x: -1 if x is None else x)
                raise ValueError(f"checkpoint is missing {name} (layers {missing[:5]}...)"
                                 if name.startswith("layers.") else f"checkpoint is missing {name}")
        return self.arrays
