"""Checkpoint tensors -> the model's stacked parameters (`[layers, ...]`, `[in, out]`), by the
model class's WeightMap, checking every shape and that nothing is missing. Quantized tensors
(jaxllm.quantization.formats.HostQuant, out-major) are stacked the same way into one
HostQuant per parameter, its segments concatenated along the output rows."""
from __future__ import annotations

import numpy as np

from jaxllm.models.base import Target
from jaxllm.quantization import formats as qf


def _stacked(name: str) -> bool:
    """A per-layer stack: the decoder's layers or a vision tower's (Target.stack)."""
    return name.startswith(("layers.", "vision_layers."))


class StackedWeights:
    """Collects per-layer tensors (and the segments of fused ones) into stacked arrays."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, np.dtype],
                 segments: dict[str, dict[str, int]], matrices: dict[str, str] | None = None,
                 experts: frozenset = frozenset()):
        self.shapes, self.dtypes = shapes, dtypes
        # stacks [layers, experts, ...]: each tensor of the checkpoint is one expert's
        self.experts = experts
        self.matrices = matrices or {}  # name -> "in_out" | "out_in" for quantizable matrices
        # quantized parts: name -> [(target, layer, HostQuant, source)]
        self.quant: dict[str, list] = {}
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

    def put(self, target: Target, layer: int | None, value, source: str) -> None:
        """Store `value` (`value.T` when the target says the file is transposed); per-layer
        targets name their parameter without the stack's "layers." prefix. A HostQuant value
        is kept quantized."""
        name = target.param(layer)
        if isinstance(value, qf.HostQuant):
            if target.expert is not None:
                raise ValueError(f"checkpoint tensor {source}: quantized mixture-of-experts "
                                 "checkpoints are not supported; load a float checkpoint (online "
                                 "quantization applies to its experts)")
            self._put_quant(name, target, layer, value, source)
            return
        if name not in self.shapes:
            if name == "lm_head" and "embed_tokens" in self.shapes:
                return  # tied embeddings: some checkpoints store the copy anyway
            raise ValueError(f"checkpoint tensor {source} has no place in this model's "
                             f"configuration (is a config flag such as a bias missing?)")
        full = self.shapes[name]
        expert = target.expert
        if target.all_experts:
            self._put_all_experts(name, target, layer, value, source)
            return
        if (expert is not None) != (name in self.experts):
            raise ValueError(f"checkpoint tensor {source} does not match this model's "
                             f"{'per-expert' if expert is None else 'dense'} {name}")
        want = list(full[1:] if layer is not None else full)
        if expert is not None:
            if expert >= full[1]:
                raise ValueError(f"tensor {source}: expert {expert} but the model has {full[1]} experts")
            want = want[1:]
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
        elif expert is not None:
            arr[layer, expert, ..., cols] = value
        else:
            arr[layer, ..., cols] = value
        slot = layer if expert is None else (layer, expert)
        self.filled.setdefault(name, set()).add((slot, target.segment))

    def _put_all_experts(self, name: str, target: Target, layer: int, value, source: str) -> None:
        """Every expert's matrix of one layer at once (a GGUF stack [experts, out, in])."""
        if name not in self.experts:
            raise ValueError(f"checkpoint tensor {source} holds experts, but {name} has none")
        full = self.shapes[name]
        want, cols = list(full[1:]), slice(None)
        if target.segment is not None:
            start, n = self.segments[target.name][target.segment]
            want[-1], cols = n, slice(start, start + n)
        file_shape = (want[0], want[2], want[1]) if target.transpose else tuple(want)
        if tuple(value.shape) != file_shape:
            raise ValueError(f"tensor {source} has shape {tuple(value.shape)}, expected {file_shape}")
        if layer >= full[0]:
            raise ValueError(f"tensor {source}: layer {layer} but the model has {full[0]} layers")
        arr = self.arrays.get(name)
        if arr is None:
            arr = self.arrays[name] = np.empty(full, dtype=self.dtypes[name])
        arr[layer, ..., cols] = np.swapaxes(value, -1, -2) if target.transpose else value
        self.filled.setdefault(name, set()).update(((layer, e), target.segment) for e in range(full[1]))

    def _put_quant(self, name: str, target: Target, layer, value: qf.HostQuant, source: str) -> None:
        if name not in self.shapes:
            if name == "lm_head" and "embed_tokens" in self.shapes:
                return
            raise ValueError(f"checkpoint tensor {source} has no place in this model's "
                             f"configuration (is a config flag such as a bias missing?)")
        matrix = self.matrices.get(name)
        if matrix is None:
            raise ValueError(f"checkpoint tensor {source} is quantized but {name} is not a matrix")
        full = self.shapes[name]
        a, b = full[-2:]
        want_out, want_in = (b, a) if matrix == "in_out" else (a, b)
        if target.segment is not None:
            want_out = self.segments[target.name][target.segment][1]
        got = (value.out_features, value.in_features)
        if got != (want_out, want_in):
            raise ValueError(f"tensor {source} has shape {got} (out, in), expected {(want_out, want_in)}")
        if layer is not None and layer >= full[0]:
            raise ValueError(f"tensor {source}: layer {layer} but the model has {full[0]} layers")
        self.quant.setdefault(name, []).append((target, layer, value, source))
        self.filled.setdefault(name, set()).add((layer, target.segment))

    def _assemble(self, name: str) -> qf.HostQuant:
        """Quantized parts -> one HostQuant [(L,) N, K'] in one common layout (exact)."""
        entries = self.quant[name]
        parts = qf.common_layout([e[2] for e in entries])
        by_key = {(e[1], e[0].segment): p for e, p in zip(entries, parts)}
        fused = all(e[0].segment is not None for e in entries)
        order = list(self.segments[name.split(".")[-1]]) if fused else [None]
        layers = [None] if not _stacked(name) else range(self.shapes[name][0])

        def cat(arrays):
            return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=-2)

        stacked = []
        for i in layers:
            segs = [by_key[(i, s)] for s in order]
            off = None if segs[0].offset is None else cat([p.offset for p in segs])
            stacked.append(qf.HostQuant(segs[0].kind, cat([p.q for p in segs]),
                                        cat([p.scale for p in segs]), off))
        if layers == [None]:
            return stacked[0]
        from jaxllm.quantization import stack
        return stack(stacked)

    def finish(self) -> dict:
        """Every parameter: a float array, or a HostQuant for a quantized matrix. A matrix
        whose parts came partly in float is kept in float (its quantized parts dequantized)."""
        for name in [n for n in self.quant if n in self.arrays]:
            for target, layer, value, source in self.quant.pop(name):
                # out-major, as the file stores a matrix
                self.put(target, layer, value.dequantize(), source)
        out = self._check_complete()
        for name in self.quant:
            out[name] = self._assemble(name)
        return out

    def _check_complete(self) -> dict[str, np.ndarray]:
        for name, shape in self.shapes.items():
            got = self.filled.get(name, set())
            layers = [None] if not _stacked(name) else range(shape[0])
            if name in self.experts:
                layers = [(i, e) for i in layers for e in range(shape[1])]
            whole = {(i, None) for i in layers}
            parts = {(i, s) for i in layers for s in self.segments.get(name.split(".")[-1], {})}
            if got == whole or (parts and got == parts):
                continue
            want = parts if parts and not got & whole else whole
            missing = sorted(want - got, key=lambda x: (-1 if x[0] is None else x[0], x[1] or ""))
            slot = (lambda i: f"layer {i[0]} expert {i[1]}" if isinstance(i, tuple) else f"layer {i}")
            what = ", ".join(f"{slot(i)} {s}" if s else slot(i) for i, s in missing[:5])
            raise ValueError(f"checkpoint is missing {name} ({what}...)" if _stacked(name)
                             else f"checkpoint is missing {name}")
        return self.arrays
