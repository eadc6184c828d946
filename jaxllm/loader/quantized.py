"""HF checkpoints quantized by AWQ, GPTQ or compressed-tensors (`quantization_config` in
config.json picks the method): each quantized module's tensors are gathered and converted to
our layouts (jaxllm.quantization.formats) without dequantizing."""
from __future__ import annotations

import numpy as np

from jaxllm.quantization import formats as qf

# the tensors a quantized module has, per method; anything else beside them is a mismatch
_PARTS = {
    "awq": {"qweight", "qzeros", "scales"},
    "gptq": {"qweight", "qzeros", "scales", "g_idx"},
    "compressed-tensors": {"weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
                           "weight", "input_scale", "weight_g_idx"},
}
_ALL_PARTS = set().union(*_PARTS.values()) - {"weight"}


def method_of(config: dict) -> str | None:
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method not in _PARTS:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; "
                         f"supported: {', '.join(_PARTS)}")
    return method


class QuantizedReader:
    """Collects the parts of quantized modules while a checkpoint is read, then converts them."""

    def __init__(self, qc: dict):
        self.method = qc["quant_method"]
        self.qc = qc
        self.modules: dict[str, dict[str, np.ndarray]] = {}
        if self.method in ("awq", "gptq"):
            self.bits = int(qc.get("bits", qc.get("w_bit", 4)))
            if self.bits != 4:
                raise ValueError(f"{self.method} with {self.bits} bits is not supported; supported: 4")
            self.group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        if self.method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"AWQ version {version!r} is not supported; supported: gemm")
            if not qc.get("zero_point", True):
                raise ValueError("AWQ without zero points is not supported")
        if self.method == "gptq" and qc.get("desc_act"):
            raise ValueError("GPTQ checkpoints with desc_act (act-order) are not supported")
        if self.method == "compressed-tensors":
            self._ct_scheme()

    def _ct_scheme(self) -> None:
        qc = self.qc
        self.format = qc.get("format")
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors with {len(groups)} config groups is not supported; "
                             "supported: one")
        g = groups[0]
        if g.get("targets") not in (["Linear"], ("Linear",)):
            raise ValueError(f"compressed-tensors targets {g.get('targets')} are not supported; "
                             "supported: ['Linear']")
        self.weights = w = g.get("weights") or {}
        act = g.get("input_activations")
        self.act = "none"
        if act:
            if not act.get("dynamic", False):
                raise ValueError("compressed-tensors with static activation scales is not supported; "
                                 "supported: dynamic per-token")
            if act.get("strategy") != "token":
                raise ValueError(f"compressed-tensors activation strategy {act.get('strategy')!r} "
                                 "is not supported; supported: token")
            self.act = "int8" if act.get("type") == "int" and act.get("num_bits") == 8 else (
                "fp8" if act.get("type") == "float" and act.get("num_bits") == 8 else None)
            if self.act is None:
                raise ValueError(f"compressed-tensors activations {act} are not supported")
        supported = {"pack-quantized": ("int", 4), "int-quantized": ("int", 8),
                     "float-quantized": ("float", 8)}
        if self.format not in supported or (w.get("type"), w.get("num_bits")) != supported[self.format]:
            raise ValueError(f"compressed-tensors format {self.format!r} with {w.get('type')}"
                             f"{w.get('num_bits')} weights is not supported; supported: "
                             "pack-quantized int4, int-quantized int8, float-quantized fp8")
        if w.get("strategy") not in ("group", "channel", "tensor"):
            raise ValueError(f"compressed-tensors weight strategy {w.get('strategy')!r} is not supported")
        if self.format != "pack-quantized" and not w.get("symmetric", True):
            raise ValueError("compressed-tensors asymmetric 8-bit weights are not supported")
        self.ignore = list(qc.get("ignore") or [])

    def take(self, name: str, tensor: np.ndarray) -> bool:
        """Keep `name` if it is part of a quantized module; False for an ordinary tensor."""
        module, _, part = name.rpartition(".")
        # compressed-tensors int8 / fp8 keep their codes under `weight`: told apart by dtype
        codes = part == "weight" and tensor.dtype in (np.int8, qf.FP8)
        if part in _ALL_PARTS or codes:
            if part not in _PARTS[self.method]:
                other = next((m for m, parts in _PARTS.items() if part in parts), "another method")
                raise ValueError(f"checkpoint tensor {name} belongs to {other}, but "
                                 f"quantization_config says {self.method}")
            self.modules.setdefault(module, {})[part] = tensor
            return True
        return False

    def convert(self, module: str, out_in: tuple[int, int]) -> qf.HostQuant:
        parts = self.modules[module]
        N, K = out_in
        if self.method == "awq":
            qw = parts["qweight"]
            if qw.shape != (K, N // 8):
                raise ValueError(f"{module}.qweight has shape {qw.shape}; AWQ packs [in, out/8] = "
                                 f"{(K, N // 8)}" + (" (the shape says GPTQ)" if qw.shape == (K // 8, N) else ""))
            return qf.from_awq(qw, parts["qzeros"], parts["scales"], self._group(K))
        if self.method == "gptq":
            qw = parts["qweight"]
            if qw.shape != (K // 8, N):
                raise ValueError(f"{module}.qweight has shape {qw.shape}; GPTQ packs [in/8, out] = "
                                 f"{(K // 8, N)}" + (" (the shape says AWQ)" if qw.shape == (K, N // 8) else ""))
            fmt = self.qc.get("checkpoint_format", "gptq")
            return qf.from_gptq(qw, parts["qzeros"], parts["scales"], self._group(K), parts.get("g_idx"),
                                zero_plus_one=fmt != "gptq_v2")
        return self._convert_ct(module, parts, N, K)

    def _group(self, K: int) -> int:
        g = K if self.group in (-1, 0) else self.group
        if K % g:
            raise ValueError(f"{self.method} group_size {g} does not divide the input size {K}")
        return g

    def _convert_ct(self, module, parts, N, K) -> qf.HostQuant:
        if "weight_g_idx" in parts:
            raise ValueError(f"{module}: compressed-tensors activation ordering (weight_g_idx) is "
                             "not supported")
        scale = np.asarray(parts["weight_scale"], np.float32)
        if self.format == "pack-quantized":
            packed = parts["weight_packed"]
            if packed.shape != (N, K // 8):
                raise ValueError(f"{module}.weight_packed has shape {packed.shape}, expected {(N, K // 8)}")
            scale = self._ct_scale(module, scale, N, K)
            return qf.from_pack_quantized(packed, scale, parts.get("weight_zero_point"))
        w = parts.get("weight")
        if w is None or w.shape != (N, K):
            raise ValueError(f"{module}.weight has shape {None if w is None else w.shape}, expected {(N, K)}")
        scale = self._ct_scale(module, scale, N, K)
        if self.format == "int-quantized":
            return qf.HostQuant("int8", np.asarray(w).astype(np.int8), scale)
        return qf.HostQuant("fp8", np.asarray(w).view(qf.FP8), scale)

    def _ct_scale(self, module, scale, N, K) -> np.ndarray:
        """weight_scale as [N, K/G]: per tensor, per channel [N, 1] or per group."""
        if scale.size == 1:
            return np.full((N, 1), float(scale.reshape(-1)[0]), np.float32)
        if scale.ndim == 1:
            scale = scale[:, None]
        if scale.shape[0] != N or K % scale.shape[1]:
            raise ValueError(f"{module}.weight_scale has shape {scale.shape}; it does not fit a "
                             f"[{N}, {K}] weight")
        return scale

    @property
    def activation(self) -> str:
        return getattr(self, "act", "none")
