"""What a model family declares about itself, once: its parameters (shape, logical axes,
init, dtype role), where each checkpoint tensor goes (HF and GGUF names), its KV cache's
axes and how tensor parallelism reshapes its weights. The loader, the sharding rules and the
runner ask the model class; nothing outside models/ knows a family's parameter names."""
from __future__ import annotations

from dataclasses import dataclass, replace

import jax.numpy as jnp
import numpy as np

from jaxllm.layers.dtype_policy import DTypePolicy
from jaxllm.params import ParamSpec


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: our parameter, whether the file stores it transposed
    (HF and GGUF keep [out, in]), and for a fused parameter the segment of its last axis
    (the model's `segments` give each one's offset and size)."""
    name: str
    transpose: bool = False
    segment: str | None = None
    # GGUF only: llama.cpp interleaves the rotary halves of q and k rows; the number of heads
    # ("q" or "k") to undo that with
    unpermute: str | None = None
    # a mixture-of-experts weight: the expert it belongs to (lookup fills it in from the name;
    # the layer table writes the index as "*")
    expert: int | None = None
    # GGUF: one tensor holds every expert's matrix, [experts, out, in]
    all_experts: bool = False
    # the stack a per-layer tensor goes to: the decoder's, or a vision tower's
    stack: str = "layers"

    def param(self, layer: int | None) -> str:
        """The parameter's dotted name: a per-layer tensor's is under its stack."""
        return self.name if layer is None else f"{self.stack}.{self.name}"


class WeightMap:
    """A checkpoint's tensor names -> Targets: per-layer suffixes and whole-model names."""

    def __init__(self, layer_re: str, layer: dict[str, Target], whole: dict[str, Target],
                 ignored_re: str | None = None, stacks: tuple[tuple[str, dict[str, Target]], ...] = (),
                 rename=None):
        """stacks: more per-layer tables (regex, table), e.g. a vision tower's layers;
        rename(name): a checkpoint's name as the tables spell it (None: as it is)."""
        import re
        self._layer_re = re.compile(layer_re)
        self.layer, self.whole = layer, whole
        self._stacks = [(re.compile(r), t) for r, t in stacks]
        self._rename = rename
        self._ignored = re.compile(ignored_re) if ignored_re else None
        self._expert_re = re.compile(r"(.*\.experts)\.(\d+)\.(.+)")

    def lookup(self, name: str) -> tuple[Target, int | None] | None:
        """(target, layer or None); None for a tensor that is safe to skip. A tensor we do
        not know is an error: skipping it would run a different model."""
        if self._rename is not None:
            name = self._rename(name)
        if name in self.whole:
            return self.whole[name], None
        for stack_re, table in self._stacks:
            m = stack_re.fullmatch(name)
            if m and m.group(2) in table:
                return table[m.group(2)], int(m.group(1))
        m = self._layer_re.fullmatch(name)
        if m and m.group(2) in self.layer:
            return self.layer[m.group(2)], int(m.group(1))
        e = m and self._expert_re.fullmatch(m.group(2))
        if e and f"{e.group(1)}.*.{e.group(3)}" in self.layer:
            target = self.layer[f"{e.group(1)}.*.{e.group(3)}"]
            return replace(target, expert=int(e.group(2))), int(m.group(1))
        if self._ignored is not None and self._ignored.fullmatch(name):
            return None
        raise ValueError(f"checkpoint tensor {name} is not used by this model (unsupported "
                         "architecture variant?)")


def param_dtypes(specs: dict[str, ParamSpec], policy: DTypePolicy) -> dict[str, np.dtype]:
    return {k: np.dtype(jnp.dtype(s.dtype_for(policy))) for k, s in specs.items()}


def parameter_counts(specs: dict[str, ParamSpec], arch) -> dict[str, int]:
    """Parameters in all, and those one token uses: of a mixture of experts' stacks, only its
    num_experts_per_tok experts."""
    total = sum(int(np.prod(s.shape)) for s in specs.values())
    experts = sum(int(np.prod(s.shape)) for s in specs.values() if s.per_expert)
    unused = experts - experts // arch.num_experts * arch.num_experts_per_tok if arch.num_experts else 0
    return {"total": total, "active_per_token": total - unused}
