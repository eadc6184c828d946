"""Checkpoint tensors -> the model's stacked parameters (`[layers, ...]`, `[in, out]`), by the
model class's WeightMap, checking every shape and that nothing is missing."""
from __future__ import annotations

import numpy as np

from jaxllm.models.base import Target


class StackedWeights:
    """Collects per-layer tensors (and the segments of fused ones) into stacked arrays."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, np.dtype],
                 segments: dict[str, dict[str, int]]):
        self.shapes, self.dtypes = shapes, dtypes
        # fused parameter -> segment -> (offset, width) on its last axis
        self.segments = {}
        for name, parts in segments.items():
            start, table = 0, {}
            for seg, n in parts.items():
                table[seg] = (start, n)
                start += n
            self.segments[name] = table
        self.arrays: dict[str, np.ndarray] = {}
        self.filled: dict[str, set] = {}

    def put(self, target: Target, layer: int | None, value: np.ndarray, source: str) -> None:
        """Store `value` (`value.T` when the target says the file is transposed); per-layer
        targets name their parameter without the stack's "layers." prefix."""
        name = target.name if layer is None else "layers." + target.name
        if name not in self.shapes:
            if name == "lm_head" and "embed_tokens" in self.shapes:
                return  # tied embeddings: some checkpoints store the copy anyway
            raise ValueError(f"checkpoint tensor {source} has no place in this model's "
                             f"configuration (is a config flag such as a bias missing?)")
        full = self.shapes[name]
        want = list(full[1:] if layer is not None else full)
        cols = slice(None)
        if target.segment is not None:
            start, n = self.segments[target.name][target.segment]
            want[-1], cols = n, slice(start, start + n)
        want = tuple(want)
        file_shape = want[::-1] if target.transpose else want
        if tuple(value.shape) != file_shape:
            raise ValueError(f"tensor {source} has shape {tuple(value.shape)}, expected {file_shape}")
        if target.transpose:
            value = value.T
        if layer is not None and layer >= full[0]:
            raise ValueError(f"tensor {source}: layer {layer} but the model has {full[0]} layers")
        arr = self.arrays.get(name)
        if arr is None:
            arr = self.arrays[name] = np.empty(full, dtype=self.dtypes[name])
        if layer is None:
            arr[..., cols] = value
        else:
            arr[layer, ..., cols] = value
        self.filled.setdefault(name, set()).add((layer, target.segment))

    def finish(self) -> dict[str, np.ndarray]:
        for name, shape in self.shapes.items():
            got = self.filled.get(name, set())
            layers = [None] if not name.startswith("layers.") else range(shape[0])
            whole = {(i, None) for i in layers}
            parts = {(i, s) for i in layers for s in self.segments.get(name.split(".")[-1], {})}
            if got == whole or (parts and got == parts):
                continue
            want = parts if parts and not got & whole else whole
            missing = sorted(want - got, key=lambda x: (-1 if x[0] is None else x[0], x[1] or ""))
            what = ", ".join(f"layer {i} {s}" if s else f"layer {i}" for i, s in missing[:5])
            raise ValueError(f"checkpoint is missing {name} ({what}...)" if name.startswith("layers.")
                             else f"checkpoint is missing {name}")
        return self.arrays
