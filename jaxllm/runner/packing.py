"""A step's small host inputs as two flat buffers.

A step hands the device a few dozen small arrays (token ids, attention and sampling
metadata). An executable's call converts and transfers each argument on its own, and on a
GPU that per-argument work is most of the host's time in a call; packed into one int32 and
one float32 buffer they cross as two arguments and are sliced apart inside the program
(slices of an argument cost the device nothing).

`Packed` is a pytree whose layout (the original tree and where each leaf sits) is static:
it belongs to the compiled shape, as the arrays' shapes do.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

# how each dtype travels: in the int32 buffer (bits kept) or the float32 one
_INT, _FLOAT = 0, 1
_KINDS = {"int32": _INT, "uint32": _INT, "bool": _INT, "float32": _FLOAT}
# per input structure (tree and leaves' shapes and dtypes): how to pack it
_PLANS: dict = {}


def _kind(dtype) -> int:
    kind = _KINDS.get(np.dtype(dtype).name)
    if kind is None:
        raise TypeError(f"a packed step input must be int32, uint32, bool or float32, "
                        f"got {np.dtype(dtype).name}")
    return kind


@functools.partial(jax.tree_util.register_dataclass, data_fields=["ints", "floats"],
                   meta_fields=["layout"])
@dataclasses.dataclass
class Packed:
    """`ints` [n] int32 and `floats` [m] float32 (None when m = 0) holding the leaves of a
    pytree; `layout` = (treedef, ((shape, dtype name, kind, offset), ...))."""
    ints: object
    floats: object
    layout: tuple

    @staticmethod
    def _layout(leaves, treedef):
        specs, sizes = [], [0, 0]
        for x in leaves:
            kind = _kind(x.dtype)
            shape = tuple(x.shape)
            specs.append((shape, np.dtype(x.dtype).name, kind, sizes[kind]))
            sizes[kind] += math.prod(shape)
        return (treedef, tuple(specs)), sizes

    @classmethod
    def pack(cls, tree) -> "Packed":
        """Host (numpy) leaves into two numpy buffers."""
        leaves, treedef = jax.tree.flatten(tree)
        key = (treedef, *[(x.shape, x.dtype) for x in leaves])
        plan = _PLANS.get(key)
        if plan is None:
            layout, _ = cls._layout(leaves, treedef)
            specs = layout[1]
            plan = _PLANS[key] = (layout, [i for i, sp in enumerate(specs) if sp[2] == _INT],
                                  [i for i, sp in enumerate(specs) if sp[2] == _FLOAT],
                                  {i for i, sp in enumerate(specs) if sp[1] == "uint32"})
        layout, int_at, float_at, uint_at = plan
        ints = np.concatenate([leaves[i].view(np.int32).ravel() if i in uint_at
                               else leaves[i].ravel() for i in int_at], dtype=np.int32)
        floats = (np.concatenate([leaves[i].ravel() for i in float_at], dtype=np.float32)
                  if float_at else None)
        return cls(ints, floats, layout)

    @classmethod
    def abstract(cls, tree, sharding=None) -> "Packed":
        """The packed form of a tree of ShapeDtypeStructs (for compiling)."""
        leaves, treedef = jax.tree.flatten(tree)
        layout, sizes = cls._layout(leaves, treedef)
        sds = jax.ShapeDtypeStruct
        floats = sds((sizes[_FLOAT],), jnp.float32, sharding=sharding) if sizes[_FLOAT] else None
        return cls(sds((sizes[_INT],), jnp.int32, sharding=sharding), floats, layout)

    def unpack(self):
        """The original tree (inside a jitted program: slices of the two buffers)."""
        treedef, specs = self.layout
        leaves = []
        for shape, dtype, kind, off in specs:
            n = math.prod(shape)
            x = (self.floats if kind == _FLOAT else self.ints)[off:off + n].reshape(shape)
            if dtype == "uint32":
                x = jax.lax.bitcast_convert_type(x, jnp.uint32)
            elif dtype == "bool":
                x = x != 0
            leaves.append(x)
        return jax.tree.unflatten(treedef, leaves)
