"""Quantized weights: which method, which parameters, in which layout.

`quantization=` (vLLM's name) picks a method:
  int8   weight-only int8, one scale per output channel (W8A16), quantized at load
  int4   weight-only int4 in groups along the input (quantization_group_size: 32, 64 or 128;
         unset, DEFAULT_INT4_GROUP, or 32 where that does not divide), asymmetric (scale and
         offset per group), quantized at load; int4_calibration="awq" first scales the
         layers' matrices per input channel by AWQ's activation-aware search (awq.py)
  w8a8   int8 weights per channel and int8 activations quantized per token at run time
  fp8    e4m3 weights per channel and e4m3 activations per token (the GPU path: Hopper's fp8
         matrix units; on a CPU the kernels multiply the e4m3 values as bf16, which is exact)
  awq, gptq, compressed-tensors, gguf   a checkpoint quantized that way, kept quantized
  none   dequantize a quantized checkpoint to --dtype at load (jaxllm's; for comparisons)
Left unset, a quantized checkpoint runs as shipped and a float one unquantized.

int8 quantizes every matrix, the embedding and LM head included (they are a fifth of a small
model); int4 keeps those two int8 per channel, as llama.cpp's 4-bit files keep them at 8 or 6
bits (in 4 bits they cost the default model most of int4's perplexity); w8a8 keeps them
weight-only int8 and fp8 in float, as logits are the most sensitive to activation
quantization. Layouts are in formats.py.

`smoothquant_alpha` (w8a8 only) adds SmoothQuant to w8a8's layer matrices: smoothquant.py.
Both SmoothQuant and AWQ leave a per-input-channel vector (`smooth`) that activations are
divided by at run time.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.params import ParamSpec
from jaxllm.quantization import formats as F
from jaxllm.quantization.formats import HostQuant

ONLINE_METHODS = ("int8", "int4", "w8a8", "fp8")
CHECKPOINT_METHODS = ("awq", "gptq", "compressed-tensors", "gguf")
METHODS = ONLINE_METHODS + CHECKPOINT_METHODS + ("none",)
INT4_GROUPS = (32, 64, 128)  # as GGUF's Q4 (32) and GPTQ/AWQ checkpoints (64, 128) group
# chosen by measuring the default model's perplexity (docs/quantization.md)
DEFAULT_INT4_GROUP = 32
INT4_CALIBRATIONS = ("awq", "none")
# AWQ searches at load, where the default model gains nothing at groups of 32 (docs)
DEFAULT_INT4_CALIBRATION = "none"


def validate_method(method: str | None) -> None:
    if method is not None and method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")


def validate_smoothquant(alpha, method: str | None) -> None:
    """SmoothQuant's migration strength, given only with w8a8 (the one method that quantizes
    activations to int8, whose outliers it eases)."""
    if alpha is None:
        return
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smoothquant_alpha must be a number in [0, 1] (0.5 is SmoothQuant's "
                         f"usual choice), got {alpha!r}")
    if method != "w8a8":
        hint = (" (a compressed-tensors W8A8 checkpoint made with SmoothQuant has it folded into "
                "its norm weights already: load it without smoothquant_alpha)"
                if method == "compressed-tensors" else "")
        raise ValueError(f"smoothquant_alpha needs quantization='w8a8' (SmoothQuant eases int8 "
                         f"activations), got quantization={method!r}{hint}")


def validate_int4_options(group_size, calibration, method: str | None) -> None:
    """quantization_group_size and int4_calibration: given only with int4 (the online
    method they shape)."""
    if group_size is not None:
        if isinstance(group_size, bool) or group_size not in INT4_GROUPS:
            raise ValueError(f"quantization_group_size must be one of {INT4_GROUPS}, got {group_size!r}")
        if method != "int4":
            raise ValueError(f"quantization_group_size needs quantization='int4' (the one method "
                             f"quantized in groups at load), got quantization={method!r}")
    if calibration is not None:
        if calibration not in INT4_CALIBRATIONS:
            raise ValueError(f"int4_calibration must be one of {INT4_CALIBRATIONS}, got {calibration!r}")
        if method != "int4":
            raise ValueError(f"int4_calibration needs quantization='int4', got quantization={method!r}")


@dataclass(frozen=True)
class QuantLayout:
    """How one parameter is stored: kind (int4 | int8 | fp8), group along the input, whether
    it has offsets and a SmoothQuant vector, and how its activations are quantized."""
    kind: str
    group: int
    offset: bool = False
    smooth: bool = False
    act: str = "none"
    scale_dtype: str = "float32"  # of scale and offset: float16 where exact (formats.py)


@dataclass(frozen=True)
class QuantSpec:
    """The quantized parameters of a model (a static part of its graph)."""
    method: str
    layouts: tuple[tuple[str, QuantLayout], ...]
    backend: str = "xla"  # "cpu": the C++ kernels; "xla": dequantizing dots (GPU, reference)
    # EngineConfig.int4_activations: "float", or "int8" (4-bit weights in the CPU kernels
    # multiply activations rounded to int8 per block of 32, as llama.cpp runs them: faster at
    # few rows, but the rounding makes outputs depend on how requests were batched)
    int4_activations: str = "float"

    def get(self, name: str) -> QuantLayout | None:
        return dict(self.layouts).get(name)

    def names(self) -> list[str]:
        return [n for n, _ in self.layouts]

    def act_of(self, name: str, in_features: int) -> str:
        """How a matrix's activations are quantized as it runs: its layout's, except that
        4-bit weights in the CPU kernels may take int8 activations per block of 32, as
        llama.cpp runs them (int4_activations)."""
        layout = self.get(name)
        if (layout.act == "none" and layout.kind == "int4" and self.backend == "cpu"
                and self.int4_activations == "int8" and layout.group % 32 == 0 and in_features % 64 == 0):
            return "int8_block"
        return layout.act


INT4_ACTIVATIONS = ("float", "int8")


def validate_int4_activations(value: str) -> None:
    if value not in INT4_ACTIVATIONS:
        raise ValueError(f"int4_activations must be one of {INT4_ACTIVATIONS}, got {value!r}")


def layout_of(h: HostQuant, act: str = "none", smooth: bool = False) -> QuantLayout:
    return QuantLayout(h.kind, h.group, h.offset is not None, smooth, act, h.scale.dtype.name)


def out_in(spec_shape: tuple[int, ...], matrix: str) -> tuple[int, int]:
    """(out, in) sizes of one matrix of a parameter declared [.., in, out] or [.., out, in]."""
    a, b = spec_shape[-2:]
    return (b, a) if matrix == "in_out" else (a, b)


def part_specs(name: str, spec, layout: QuantLayout) -> dict:
    """The parameters one quantized matrix becomes: name.q, name.scale (.offset, .smooth),
    each with the float parameter's logical axes in out-major order."""
    lead, lead_axes = spec.shape[:-2], spec.axes[:-2]
    N, K = out_in(spec.shape, spec.matrix)
    ax_out, ax_in = (spec.axes[-1], spec.axes[-2]) if spec.matrix == "in_out" else spec.axes[-2:]
    axes = (*lead_axes, ax_out, ax_in)
    if K % layout.group:
        raise ValueError(f"{name}: group size {layout.group} does not divide its input size {K}")
    code_dtype = {"int4": jnp.uint8, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[layout.kind]
    width = K // 2 if layout.kind == "int4" else K
    groups = (*lead, N, K // layout.group)
    # one scale per output channel is whole on every device of a row-parallel split
    group_axes = axes if K // layout.group > 1 else (*lead_axes, ax_out, None)
    out = {f"{name}.q": ParamSpec((*lead, N, width), axes, init=f"codes_{layout.kind}",
                                  dtype=code_dtype),
           f"{name}.scale": ParamSpec(groups, group_axes, init=f"scale_{layout.kind}",
                                      dtype=jnp.dtype(layout.scale_dtype))}
    if layout.offset:
        out[f"{name}.offset"] = ParamSpec(groups, group_axes, init=f"offset_{layout.kind}",
                                          dtype=jnp.dtype(layout.scale_dtype))
    if layout.smooth:
        out[f"{name}.smooth"] = ParamSpec((*lead, K), (*lead_axes, ax_in), init="ones",
                                          dtype=jnp.float32)
    return out


def quantized_specs(specs: dict, quant: QuantSpec | None) -> dict:
    """The model's parameter table with each quantized matrix replaced by its parts."""
    if quant is None:
        return specs
    out = {}
    for name, spec in specs.items():
        layout = quant.get(name)
        if layout is None:
            out[name] = spec
        else:
            out.update(part_specs(name, spec, layout))
    return out


def int4_group_of(name: str, K: int, group_size: int | None) -> int:
    """The group a matrix of input size K takes: quantization_group_size, which must divide
    K, or unset the default (32 where it does not divide: int4 packs in 32s)."""
    if group_size is None:
        return F.int4_group(K, DEFAULT_INT4_GROUP)
    if K % group_size:
        fits = [g for g in INT4_GROUPS if K % g == 0]
        raise ValueError(f"quantization_group_size={group_size} does not divide the input size {K} "
                         f"of {name}; choose {' or '.join(map(str, fits)) or 'another model'}")
    return group_size


def online_layout(method: str, name: str, spec, smooth: bool = False,
                  group_size: int | None = None) -> QuantLayout | None:
    """The layout `method` gives a float matrix parameter (None: it stays float); `smooth`:
    the matrix carries a SmoothQuant (w8a8) or AWQ (int4, the layers' matrices) vector;
    `group_size`: int4's quantization_group_size."""
    if spec.matrix is None:
        return None
    N, K = out_in(spec.shape, spec.matrix)
    head = name in ("embed_tokens", "lm_head")
    if method == "int8":
        return QuantLayout("int8", K, scale_dtype="float16")
    if method == "int4":
        if head:  # the logits are the most sensitive to 4-bit weights
            return QuantLayout("int8", K, scale_dtype="float16")
        return QuantLayout("int4", int4_group_of(name, K, group_size), offset=True, smooth=smooth,
                           scale_dtype="float16")
    # w8a8 and fp8 leave the head (and a tied embedding) float, as vLLM's W8A8 and FP8
    # checkpoints do: logits are the most sensitive to activation quantization
    if method == "w8a8":
        return None if head else QuantLayout("int8", K, smooth=smooth, act="int8")
    if method == "fp8":
        return None if head else QuantLayout("fp8", K, act="fp8")
    raise ValueError(f"{method!r} is not an online quantization method")


def quantize_host(w: np.ndarray, layout: QuantLayout) -> HostQuant:
    """A float matrix (stack) [.., N, K] -> our layout."""
    if layout.kind == "int8":
        return F.quantize_int8(w, None if layout.group == w.shape[-1] else layout.group)
    if layout.kind == "int4":
        return F.quantize_int4(w, layout.group)
    return F.quantize_fp8(w)


def to_out_in(w: np.ndarray, matrix: str) -> np.ndarray:
    return np.swapaxes(w, -1, -2) if matrix == "in_out" else w


def quantize_online(weights: dict, specs: dict, method: str,
                    smooth: dict[str, np.ndarray] | None = None,
                    group_size: int | None = None) -> tuple[dict, dict[str, QuantLayout]]:
    """Float host weights -> the method's layouts, layer by layer (one float layer at a time
    in extra memory). `smooth`: SmoothQuant or AWQ vectors ([(L,) K] per matrix name), by
    which the weights' input columns are multiplied before quantization (smoothquant.py,
    awq.py); `group_size`: int4's quantization_group_size."""
    smooth = smooth or {}
    out, layouts = dict(weights), {}
    for name, spec in specs.items():
        layout = online_layout(method, name, spec, name in smooth, group_size)
        if layout is None or name not in weights:
            continue
        w, s = weights[name], smooth.get(name)

        def one(m, s_m):
            m = np.asarray(to_out_in(m, spec.matrix), np.float32)
            h = quantize_host(np.ascontiguousarray(m if s_m is None else m * s_m), layout)
            h.smooth = None if s_m is None else np.asarray(s_m, np.float32)
            return h
        if w.ndim == 3:
            out[name] = stack([one(w[i], None if s is None else s[i]) for i in range(w.shape[0])])
        else:
            out[name] = one(w, s)
        layouts[name] = layout_of(out[name], layout.act, s is not None)
    return out, layouts


def stack(parts: list[HostQuant]) -> HostQuant:
    first = parts[0]
    opt = (lambda f: None if getattr(first, f) is None else np.stack([getattr(p, f) for p in parts]))
    return HostQuant(first.kind, np.stack([p.q for p in parts]), np.stack([p.scale for p in parts]),
                     opt("offset"), opt("smooth"))


def weight_bytes(state) -> int:
    """Bytes of every parameter array (what the weights occupy on the device)."""
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state))
