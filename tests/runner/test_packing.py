"""A step's host inputs packed into two buffers (jaxllm.runner.packing): what a program
unpacks is what the host packed, bit for bit, and the compiled layout is the packed one."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.runner.packing import Packed


def _tree():
    return {"ids": np.array([3, -1, 7], np.int32),
            "seeds": np.array([0, 2**32 - 1, 2**31 + 5], np.uint32),  # past int32's range
            "flags": np.array([[True, False], [False, True]]),
            "scalar": np.bool_(True),
            "temps": np.array([0.5, np.inf, -0.0], np.float32),
            "none": None}


def test_unpacked_inside_a_program_equals_what_was_packed():
    tree = _tree()
    packed = Packed.pack(tree)
    assert packed.ints.dtype == np.int32 and packed.floats.dtype == np.float32
    assert packed.ints.size == 3 + 3 + 4 + 1 and packed.floats.size == 3
    out = jax.jit(lambda p: p.unpack())(packed)
    assert out["none"] is None
    for name in ("ids", "seeds", "flags", "scalar", "temps"):
        got = np.asarray(out[name])
        assert got.dtype == np.asarray(tree[name]).dtype and got.shape == np.shape(tree[name])
        np.testing.assert_array_equal(got, tree[name])


def test_the_compiled_layout_is_the_packed_one():
    """Compiled from ShapeDtypeStructs, called with the host's packing of the same shapes;
    another shape is another layout, refused by the compiled call."""
    tree = _tree()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree)
    exe = jax.jit(lambda p: p.unpack()["seeds"].astype(jnp.float32).sum()).lower(
        Packed.abstract(abstract)).compile()
    assert Packed.abstract(abstract).layout == Packed.pack(tree).layout
    assert float(exe(Packed.pack(tree))) == pytest.approx(float(tree["seeds"].astype(np.float64).sum()), rel=1e-6)
    longer = dict(tree, ids=np.zeros(4, np.int32))
    assert Packed.pack(longer).layout != Packed.pack(tree).layout
    with pytest.raises(Exception):
        exe(Packed.pack(longer))
    # no float leaves: no float buffer to transfer
    assert Packed.pack({"a": np.zeros(2, np.int32)}).floats is None


def test_other_dtypes_are_refused():
    with pytest.raises(TypeError, match="int64"):
        Packed.pack({"a": np.zeros(2, np.int64)})
    with pytest.raises(TypeError, match="float16"):
        Packed.abstract({"a": jax.ShapeDtypeStruct((2,), jnp.float16)})
