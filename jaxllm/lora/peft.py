"""PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors), read with json and
numpy and checked against the base model before anything runs: a rank above max_lora_rank, a
module the model lacks, a shape that does not match the base, another base model or a PEFT
feature we do not run is refused with an error naming the adapter and both values. Nothing is
truncated, padded past its meaning or skipped.

The model class says where each HF projection goes (its HF_WEIGHTS map: `q_proj` -> the `q`
segment of the fused `wqkv`); an adapter becomes, per projection site, A [L, in, parts x R]
and one B [L, R, out_part] per fused part, zero-padded to R = max_lora_rank (zero rows and
columns contribute nothing) and with alpha / r (or alpha / sqrt(r), rsLoRA) folded into B.
Under tensor parallelism the side of the product that the base weight splits goes through the
model's own tp_transform (KV heads repeated, MLP padded, fused columns device-major), so the
adapter is sharded along the base weight's axes.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass

import numpy as np

from jaxllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# LoraConfig fields of variants we do not run: each must be unset
UNSUPPORTED_FIELDS = ("use_dora", "use_qalora", "lora_bias", "fan_in_fan_out", "modules_to_save",
                      "trainable_token_indices", "layer_replication", "alora_invocation_tokens",
                      "target_parameters", "velora_config", "monteclora_config", "use_bdlora",
                      "arrow_config", "kasa_config")
_TENSOR = re.compile(r"base_model\.model\.(.+)\.lora_([AB])(?:\.[\w-]+)?\.weight")


@dataclass(frozen=True)
class Site:
    """A projection LoRA can target: one stacked weight `[L, in, out]`, possibly fused."""
    name: str                       # our parameter ("wqkv", "wo", ...)
    parts: tuple[str | None, ...]   # fused segments in order; (None,) when not fused
    in_dim: int                     # checkpoint shapes
    out_dims: tuple[int, ...]       # per part
    in_dim_rt: int                  # runtime shapes (after tensor-parallel padding)
    out_dims_rt: tuple[int, ...]
    in_axis: str | None             # the base weight's logical axes (jaxllm.parallel)
    out_axis: str | None


class LoRALayout:
    """Where PEFT modules land in one base model on `tp_size` devices, and the shapes of the
    adapter weights of one slot of rank `max_rank`."""

    def __init__(self, cls, ckpt_arch, tp_size: int, max_rank: int):
        from jaxllm.parallel import plan, runtime_arch
        self.cls, self.arch, self.rank = cls, ckpt_arch, max_rank
        self.plan = plan(ckpt_arch, tp_size)
        self.num_layers = ckpt_arch.num_layers
        rt = runtime_arch(ckpt_arch, self.plan)
        specs, specs_rt = cls.param_specs(ckpt_arch), cls.param_specs(rt)
        seg, seg_rt = cls.segments(ckpt_arch), cls.segments(rt)
        # PEFT module suffix ("self_attn.q_proj") -> (site, fused part or None)
        self.modules: dict[str, tuple[str, str | None]] = {}
        for key, target in cls.HF_WEIGHTS.layer.items():
            if key.endswith(".weight") and target.transpose:
                self.modules[key[:-len(".weight")]] = (target.name, target.segment)
        self.sites: dict[str, Site] = {}
        for name in dict.fromkeys(site for site, _ in self.modules.values()):
            s, s_rt = specs["layers." + name], specs_rt["layers." + name]
            fused = name in seg
            self.sites[name] = Site(
                name, tuple(seg[name]) if fused else (None,), s.shape[1],
                tuple(seg[name].values()) if fused else (s.shape[2],), s_rt.shape[1],
                tuple(seg_rt[name].values()) if fused else (s_rt.shape[2],), s.axes[1], s.axes[2])

    @property
    def module_names(self) -> list[str]:
        """What target_modules may name: the projections' last name components."""
        return sorted({m.rsplit(".", 1)[-1] for m in self.modules})

    def slot_shapes(self) -> dict[str, tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]]:
        """Per site, the runtime shapes of one slot: A [L, in, parts*R] and each part's B [L, R, out]."""
        L, R = self.num_layers, self.rank
        return {n: ((L, s.in_dim_rt, len(s.parts) * R), tuple((L, R, w) for w in s.out_dims_rt))
                for n, s in self.sites.items()}

    def to_runtime(self, site: Site, A: np.ndarray, Bs: list[np.ndarray]):
        """Checkpoint-layout A [L, in, P, R] and B_p [L, R, out_p] -> the runtime layout: the
        side the base weight splits over devices goes through the model's tp_transform as if
        it were that weight (its sharded axis is A's input axis or B's output axis)."""
        L, R, P = self.num_layers, self.rank, len(site.parts)
        key = "layers." + site.name
        if self.plan.size == 1:
            return A.reshape(L, site.in_dim, P * R), Bs
        from jaxllm.parallel import LOGICAL_AXIS_RULES
        in_split, out_split = (LOGICAL_AXIS_RULES.get(a) is not None for a in (site.in_axis, site.out_axis))
        if in_split:
            A = self.cls.tp_transform({key: A.reshape(L, site.in_dim, P * R)}, self.arch, self.plan)[key]
        A = A.reshape(L, site.in_dim_rt, P * R)
        if out_split:
            from jaxllm.models.llama import split_device_major
            full = np.zeros((L, P * R, sum(site.out_dims)), np.float32)
            start = 0
            for p, (B, w) in enumerate(zip(Bs, site.out_dims)):
                full[:, p * R:(p + 1) * R, start:start + w] = B
                start += w
            full = self.cls.tp_transform({key: full}, self.arch, self.plan)[key]
            parts = split_device_major(full, list(site.out_dims_rt), self.plan.size)
            Bs = [np.ascontiguousarray(part[:, p * R:(p + 1) * R]) for p, part in enumerate(parts)]
        return A, Bs


@dataclass
class Adapter:
    """One validated adapter in the runtime layout of a slot: per targeted site (A, Bs)."""
    request: LoRARequest
    weights: dict[str, tuple[np.ndarray, list[np.ndarray]]]
    modules: tuple[str, ...]   # the projections it targets ("q_proj", ...)
    rank: int                  # its largest rank

    @property
    def nbytes(self) -> int:
        return sum(A.nbytes + sum(B.nbytes for B in Bs) for A, Bs in self.weights.values())


def same_model(name: str, known) -> bool:
    """A base model named `name` is one of `known` (paths or hub ids): the same path, or the
    same last component (a hub id and the local directory or file it was saved to)."""
    def last(s):
        return os.path.basename(os.path.normpath(s)).casefold()
    name_full = os.path.normpath(os.path.expanduser(name))
    return any(name_full == os.path.normpath(k) or last(name) == last(k) for k in known if k)


def base_model_names(path: str, given: str | None) -> list[str]:
    """What an adapter's base_model_name_or_path may say for the model at `path` (`given`:
    how the user named it; None for the default model): the path, the name given, the name
    its config.json records, and a GGUF file's name before its quantization suffix."""
    from jaxllm.loader.loader import DEFAULT_MODEL_NAME
    names = [os.path.abspath(path)]
    if given:
        names.append(given)
    else:
        names.append(DEFAULT_MODEL_NAME)
    if path.endswith(".gguf"):
        names.append(os.path.basename(path).split(".")[0])
    config = os.path.join(path, "config.json")
    if os.path.isfile(config):
        try:
            with open(config) as f:
                recorded = json.load(f).get("_name_or_path")
        except (OSError, ValueError):
            recorded = None
        if recorded:
            names.append(recorded)
    return list(dict.fromkeys(names))


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the module's name
    or a dotted suffix of it."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def load_adapter(req: LoRARequest, layout: LoRALayout, base_names=()) -> Adapter:
    """Read, check and lay out one adapter; ValueError naming the adapter on any mismatch."""
    from jaxllm.loader.safetensors_io import read_safetensors
    path = os.path.expanduser(req.lora_path)
    who = f"LoRA adapter {req.lora_name!r} ({path})"
    config_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):
        raise ValueError(f"{who}: no {ADAPTER_CONFIG} there (a PEFT adapter directory is expected)")
    try:
        with open(config_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{who}: cannot read {ADAPTER_CONFIG}: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{who}: peft_type {cfg.get('peft_type')!r} is not supported; only LORA is")
    for name in UNSUPPORTED_FIELDS:
        if cfg.get(name) not in (None, False, [], {}, ""):
            raise ValueError(f"{who}: {name}={cfg[name]!r} is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{who}: bias={cfg['bias']!r} is not supported; only 'none' is")
    base = cfg.get("base_model_name_or_path")
    known = [n for n in base_names if n]
    if base and known and not same_model(base, known):
        raise ValueError(f"{who}: its base model is {base!r} (base_model_name_or_path) but this "
                         f"engine serves {known[0]!r} (also known as {', '.join(map(repr, known[1:])) or 'nothing else'}); "
                         "an adapter runs only on the model it was trained on")
    if not base:
        logger.warning("%s names no base_model_name_or_path; only its shapes are checked", who)
    targets = cfg.get("target_modules")
    allowed = layout.module_names
    if isinstance(targets, (list, tuple)):
        for t in targets:
            if str(t).rsplit(".", 1)[-1] not in allowed:
                raise ValueError(f"{who}: target module {t!r} is not a projection of "
                                 f"{layout.arch.architecture} that LoRA can adapt ({', '.join(allowed)})")
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights_path):
        extra = (" (adapter_model.bin is a pickle: save it with safe_serialization=True)"
                 if os.path.exists(os.path.join(path, "adapter_model.bin")) else "")
        raise ValueError(f"{who}: no {ADAPTER_WEIGHTS}{extra}")
    tensors = read_safetensors(weights_path)

    pairs: dict[str, dict[str, np.ndarray]] = {}
    for name, t in tensors.items():
        m = _TENSOR.fullmatch(name)
        if m is None:
            raise ValueError(f"{who}: tensor {name} is not a LoRA A/B weight of a projection "
                             "(LoRA on embeddings or the LM head, modules_to_save and DoRA are "
                             "not supported)")
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    if not pairs:
        raise ValueError(f"{who}: {ADAPTER_WEIGHTS} holds no LoRA weights")

    L, R = layout.num_layers, layout.rank
    A_of: dict[str, np.ndarray] = {}
    B_of: dict[str, list[np.ndarray]] = {}
    targeted, max_rank = set(), 0
    for module, ab in sorted(pairs.items()):
        try:
            found = layout.cls.HF_WEIGHTS.lookup(module + ".weight")
        except ValueError:
            found = None
        if found is None or found[1] is None or not found[0].transpose or found[0].name not in layout.sites:
            raise ValueError(f"{who}: targets module {module!r}, which "
                             f"{layout.arch.architecture} does not have as a LoRA-able projection "
                             f"({', '.join(allowed)})")
        target, layer = found
        site_name, part = target.name, target.segment
        suffix = module.rsplit(".", 1)[-1]
        if layer >= L:
            raise ValueError(f"{who}: {module} is in layer {layer} but the base model has {L} layers")
        for side in "AB":
            if side not in ab:
                raise ValueError(f"{who}: {module} has no lora_{side} weight")
        A, B = ab["A"], ab["B"]
        site = layout.sites[site_name]
        out = sum(site.out_dims) if part is None else site.out_dims[site.parts.index(part)]
        r = A.shape[0] if A.ndim == 2 else -1
        if A.ndim != 2 or B.ndim != 2 or A.shape[1] != site.in_dim or B.shape != (out, r):
            raise ValueError(f"{who}: {module} has lora_A {tuple(A.shape)} and lora_B "
                             f"{tuple(B.shape)}; the base model's {suffix} "
                             f"needs lora_A (r, {site.in_dim}) and lora_B ({out}, r)")
        if r > R:
            raise ValueError(f"{who}: {module} has rank {r}, above max_lora_rank={R}; raise "
                             f"max_lora_rank to at least {r} to serve it")
        want_r = _pattern_value(cfg.get("rank_pattern"), module, cfg.get("r", r))
        if want_r != r:
            raise ValueError(f"{who}: {module} has rank {r} but adapter_config.json says r={want_r}")
        if not (np.isfinite(A).all() and np.isfinite(B).all()):
            raise ValueError(f"{who}: {module} has non-finite weights")
        alpha = _pattern_value(cfg.get("alpha_pattern"), module, cfg.get("lora_alpha", 8))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        P = len(site.parts)
        if site_name not in A_of:
            A_of[site_name] = np.zeros((L, site.in_dim, P, R), np.float32)
            B_of[site_name] = [np.zeros((L, R, w), np.float32) for w in site.out_dims]
        Bt = B.astype(np.float32).T * np.float32(scale)  # [r, out]
        if part is None and P > 1:  # a fused projection of a fused checkpoint (Phi-3's qkv_proj)
            start = 0
            for p, w in enumerate(site.out_dims):
                A_of[site_name][layer, :, p, :r] = A.T
                B_of[site_name][p][layer, :r] = Bt[:, start:start + w]
                start += w
        else:
            p = site.parts.index(part)
            A_of[site_name][layer, :, p, :r] = A.T
            B_of[site_name][p][layer, :r] = Bt
        targeted.add(suffix)
        max_rank = max(max_rank, r)
    weights = {name: layout.to_runtime(layout.sites[name], A_of[name], B_of[name]) for name in A_of}
    return Adapter(req, weights, tuple(sorted(targeted)), max_rank)
