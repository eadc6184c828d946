"""max_loras device slots of adapter weights, stacked for one batched computation per step.

Per projection site the slots are A [L, in, N*P*R] and one B [L, N*R, out_p] per fused part,
sharded along the base weight's axes (A's input axis for a row-parallel projection, B's
output axis for a column-parallel one). They are plain arrays passed into the jitted step,
never baked into its program: bringing an adapter in is one compiled, donated in-place
update of its slot, and the step does not recompile. Slots are reused least recently used
first, never for an adapter of the step being prepared.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.lora.peft import Adapter, LoRALayout
from jaxllm.parallel import sharding
from jaxllm import executable_cache

logger = logging.getLogger(__name__)


def _write(weights, slot, new):
    """Slot `slot` of every site's A and Bs <- `new` (one slot's worth)."""
    out = {}
    for site, w in weights.items():
        nA, nBs = new[site]["A"], new[site]["B"]
        A = jax.lax.dynamic_update_slice(w["A"], nA.astype(w["A"].dtype), (0, 0, slot * nA.shape[-1]))
        Bs = tuple(jax.lax.dynamic_update_slice(B, nB.astype(B.dtype), (0, slot * nB.shape[1], 0))
                   for B, nB in zip(w["B"], nBs))
        out[site] = {"A": A, "B": Bs}
    return out


class LoRASlots:
    def __init__(self, layout: LoRALayout, max_loras: int, dtype, mesh,
                 fetch: Callable[[int], Adapter]):
        """fetch(key): the host copy of an adapter (jaxllm.lora.registry), read again from
        disk if the host cache let it go."""
        self.layout, self.num_slots, self.fetch = layout, max_loras, fetch
        N = max_loras
        one = layout.slot_shapes()
        self.shardings = {
            name: {"A": sharding(mesh, "layers", s.in_axis, None),
                   "B": tuple(sharding(mesh, "layers", None, s.out_axis) for _ in s.parts)}
            for name, s in layout.sites.items()}
        shapes = {name: {"A": a[:2] + (N * a[2],), "B": tuple(b[:1] + (N * b[1],) + b[2:] for b in bs)}
                  for name, (a, bs) in one.items()}
        self.weights = jax.jit(
            lambda: jax.tree.map(lambda s: jnp.zeros(s, dtype), shapes,
                                 is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)),
            out_shardings=self.shardings)()
        # one slot's worth of zeros, for the sites an adapter does not target
        self._zeros = {name: (np.zeros(a, np.float32), [np.zeros(b, np.float32) for b in bs])
                       for name, (a, bs) in one.items()}
        self._writer = jax.jit(_write, donate_argnums=(0,),
                               in_shardings=(self.shardings, sharding(mesh), self.shardings),
                               out_shardings=self.shardings)
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter key -> slot, LRU first
        self.num_loads = 0  # adapters written into a slot (slot churn)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.weights))

    def _new(self, adapter: Adapter) -> dict:
        return {name: {"A": adapter.weights.get(name, zero)[0], "B": tuple(adapter.weights.get(name, zero)[1])}
                for name, zero in self._zeros.items()}

    def compile(self) -> None:
        sds = jax.ShapeDtypeStruct
        abstract = jax.tree.map(lambda x: sds(x.shape, x.dtype, sharding=x.sharding), self.weights)
        new = jax.tree.map(lambda x: sds(x.shape, x.dtype), {
            name: {"A": a, "B": tuple(bs)} for name, (a, bs) in self._zeros.items()})
        self._writer = executable_cache.compile(self._writer, abstract, sds((), jnp.int32), new)

    def activate(self, keys) -> tuple[dict[int, int], dict[int, str]]:
        """Make the adapters `keys` (this step's, at most max_loras) resident. Returns
        ({key: token slot id (slot + 1)}, {key: why it could not be brought in})."""
        keys = [k for k in dict.fromkeys(keys) if k]
        if len(keys) > self.num_slots:
            raise RuntimeError(f"a step with {len(keys)} adapters, above max_loras={self.num_slots} "
                               "(the scheduler must not do that)")
        for k in keys:
            if k in self.resident:
                self.resident.move_to_end(k)
        used = set(self.resident.values())
        free = [s for s in range(self.num_slots) if s not in used]
        failed = {}
        for k in keys:
            if k in self.resident:
                continue
            try:
                adapter = self.fetch(k)
            except (ValueError, OSError) as e:
                failed[k] = str(e)
                continue
            if free:
                slot = free.pop(0)
            else:  # the least recently used adapter not in this step gives its slot up
                victim = next(v for v in self.resident if v not in keys)
                slot = self.resident.pop(victim)
            self.weights = self._writer(self.weights, np.int32(slot), self._new(adapter))
            self.resident[k] = slot
            self.num_loads += 1
        return {k: self.resident[k] + 1 for k in keys if k in self.resident}, failed

    def evict(self, key: int) -> None:
        """An unloaded adapter's slot becomes free (its weights are overwritten when reused)."""
        self.resident.pop(key, None)
