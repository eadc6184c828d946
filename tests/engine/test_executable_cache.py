"""The on-disk executable cache: a hit skips tracing and computes the same; anything the trace
depends on (closure values, baked-in constants, argument shapes, settings, code) changes the
key; what cannot be described is compiled, not cached; a bad entry is compiled again."""
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import executable_cache as ec


TRACES = []  # a global, not a closure value: counting must not change the key


@pytest.fixture
def cache(tmp_path, monkeypatch):
    ec.configure(str(tmp_path))
    TRACES.clear()
    yield tmp_path / "executables"
    ec.configure(os.environ["JAXLLM_COMPILATION_CACHE_DIR"])


def entries(d) -> int:
    return sum(len(files) for _, _, files in os.walk(d))


def scaled(scale, traces: list, offset=None):
    """A jitted function closing over `scale` (and a constant array), counting its traces."""
    assert traces is TRACES

    def f(x):
        TRACES.append(1)
        y = x * scale
        return y if offset is None else y + offset
    return jax.jit(f)


def test_a_hit_skips_tracing_and_computes_the_same(cache):
    x = jnp.arange(6, dtype=jnp.float32)
    traces = TRACES
    first = ec.compile(scaled(3.0, traces), jax.ShapeDtypeStruct((6,), jnp.float32))
    assert traces == [1] and entries(cache) == 1
    again = ec.compile(scaled(3.0, traces), jax.ShapeDtypeStruct((6,), jnp.float32))
    assert traces == [1], "a hit must not trace"
    np.testing.assert_array_equal(np.asarray(again(x)), np.asarray(first(x)))
    np.testing.assert_array_equal(np.asarray(again(x)), 3.0 * np.arange(6))


def test_what_the_trace_depends_on_changes_the_key(cache, monkeypatch):
    x = jnp.arange(6, dtype=jnp.float32)
    six = jax.ShapeDtypeStruct((6,), jnp.float32)
    traces = TRACES
    ec.compile(scaled(3.0, traces), six)
    # a closure value
    assert np.asarray(ec.compile(scaled(4.0, traces), six)(x))[1] == 4.0
    # a constant array baked into the trace: same shape, other values
    a = ec.compile(scaled(1.0, traces, np.ones(6, np.float32)), six)
    b = ec.compile(scaled(1.0, traces, np.full(6, 2, np.float32)), six)
    assert np.asarray(a(x))[0] == 1.0 and np.asarray(b(x))[0] == 2.0
    # an argument's shape, and its dtype
    ec.compile(scaled(3.0, traces), jax.ShapeDtypeStruct((7,), jnp.float32))
    ec.compile(scaled(3.0, traces), jax.ShapeDtypeStruct((6,), jnp.int32))
    # compiler options
    ec.compile(scaled(3.0, traces), six, options={"xla_cpu_enable_fast_math": False})
    # a setting read while tracing
    monkeypatch.setenv("JAX_SOMETHING", "1")
    ec.compile(scaled(3.0, traces), six)
    assert len(traces) == 8 and entries(cache) == 8
    # and the same again is a hit for each
    ec.compile(scaled(3.0, traces), six)
    monkeypatch.delenv("JAX_SOMETHING")
    ec.compile(scaled(1.0, traces, np.full(6, 2, np.float32)), six)
    assert len(traces) == 8


def test_code_fingerprint_follows_the_sources(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("X = 1\n")
    (pkg / "k.cc").write_text("int f() { return 1; }\n")
    before = ec.fingerprint_of([str(pkg)])
    (pkg / "a.py").write_text("X = 2\n")
    changed = ec.fingerprint_of([str(pkg)])
    (pkg / "a.py").write_text("X = 1\n")
    (pkg / "k.cc").write_text("int f() { return 2; }\n")
    assert len({before, changed, ec.fingerprint_of([str(pkg)])}) == 3
    (pkg / "k.cc").write_text("int f() { return 1; }\n")
    assert ec.fingerprint_of([str(pkg)]) == before
    # the Pallas kernels are part of what a trace runs
    assert "pallas_kernels" in ec.SOURCES


class Opaque:
    """Its repr carries an address: it cannot be part of a key."""
    def __init__(self, scale):
        self.scale = scale


def test_an_undescribable_closure_is_compiled_not_cached(cache):
    traces = TRACES
    thing = Opaque(2.0)
    six = jax.ShapeDtypeStruct((6,), jnp.float32)
    for _ in range(2):
        def f(x):
            TRACES.append(1)
            return x * thing.scale
        out = ec.compile(jax.jit(f), six)
    assert len(traces) == 2 and entries(cache) == 0
    assert np.asarray(out(jnp.ones(6, jnp.float32)))[0] == 2.0


def test_a_corrupt_entry_is_dropped_and_compiled_again(cache, caplog):
    six = jax.ShapeDtypeStruct((6,), jnp.float32)
    traces = TRACES
    ec.compile(scaled(5.0, traces), six)
    [path] = [os.path.join(d, f) for d, _, files in os.walk(cache) for f in files]
    with open(path, "r+b") as f:
        f.truncate(100)
    with caplog.at_level(logging.WARNING, logger="jaxllm"):
        fn = ec.compile(scaled(5.0, traces), six)
    assert "unreadable entry" in caplog.text and len(traces) == 2
    assert np.asarray(fn(jnp.ones(6, jnp.float32)))[0] == 5.0
    ec.compile(scaled(5.0, traces), six)  # the rewritten entry is whole again
    assert len(traces) == 2


def test_switched_off_and_a_bad_setting(tmp_path):
    from jaxllm.config import EngineConfig
    ec.configure(None)
    try:
        traces = TRACES
        ec.compile(scaled(3.0, traces), jax.ShapeDtypeStruct((6,), jnp.float32))
        assert not (tmp_path / "executables").exists()
        with pytest.raises(ValueError, match="executable_cache must be a bool"):
            EngineConfig(executable_cache="yes")
    finally:
        ec.configure(os.environ["JAXLLM_COMPILATION_CACHE_DIR"])


def test_a_second_engine_start_compiles_nothing(tiny_llama, tmp_path, monkeypatch):
    """Two starts of the same engine in one cache: the second lowers nothing (every step,
    sampling and block executable comes from disk) and generates the same; an engine of
    other shapes does not take the first one's executables."""
    from jaxllm import LLM, SamplingParams
    lowered = []
    real = jax.stages.Traced.lower

    def counting(self, *a, **k):
        lowered.append(1)
        return real(self, *a, **k)
    monkeypatch.setattr(jax.stages.Traced, "lower", counting)
    # one step shape: each start compiles (or reads) as little as an engine can
    args = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, token_buckets=[32],
                seq_buckets=[4], compilation_cache_dir=str(tmp_path))
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    first = LLM(tiny_llama, **args)
    assert lowered, "a cold start compiles"
    want = [o.outputs[0].token_ids for o in first.generate(prompts, p, use_tqdm=False)]
    n = entries(tmp_path / "executables")
    assert n >= first.llm_engine.runner.compiler.num_compiled
    del first
    lowered.clear()
    second = LLM(tiny_llama, **args)
    assert not lowered and second.llm_engine.runner.compiler.num_compiled > 0
    assert [o.outputs[0].token_ids for o in second.generate(prompts, p, use_tqdm=False)] == want
    del second
    other = LLM(tiny_llama, **dict(args, max_num_seqs=2, seq_buckets=[2]))
    assert lowered and entries(tmp_path / "executables") > n
    assert [o.outputs[0].token_ids for o in other.generate(prompts, p, use_tqdm=False)] == want


KEY_SCRIPT = """
import jax, jax.numpy as jnp
from jaxllm.parallel import make_mesh, sharding
from jaxllm import executable_cache as ec
from jaxllm.runner.step_programs import build_sample
fn = build_sample(sharding(make_mesh(1)), num_spec=2)  # nested functions, a closure
print(ec.key_of(fn, (jax.ShapeDtypeStruct((4, 8), jnp.float32),), None))
"""


def test_keys_are_the_same_in_another_process():
    """What a key describes must not depend on the process (object addresses, hash seeds):
    a key computed here and one computed in a fresh interpreter agree."""
    import subprocess
    import sys

    from jaxllm.parallel import make_mesh, sharding
    from jaxllm.runner.step_programs import build_sample
    here = ec.key_of(build_sample(sharding(make_mesh(1)), num_spec=2),
                     (jax.ShapeDtypeStruct((4, 8), jnp.float32),), None)
    there = subprocess.run([sys.executable, "-c", KEY_SCRIPT], capture_output=True, text=True,
                           check=True, env=dict(os.environ, PYTHONHASHSEED="123"))
    assert there.stdout.split()[-1] == here
    other = ec.key_of(build_sample(sharding(make_mesh(1)), num_spec=3),
                      (jax.ShapeDtypeStruct((4, 8), jnp.float32),), None)
    assert other != here


def test_descriptions_show_what_reprs_leave_out():
    """A dataclass field hidden from its repr still counts; a value of a kind the cache does
    not know (a module holding arrays, whose repr shows no values) is refused, not guessed."""
    import dataclasses

    from flax import nnx

    @dataclasses.dataclass(frozen=True)
    class Settings:
        a: int
        b: int = dataclasses.field(default=0, repr=False)
    assert repr(Settings(1, 2)) == repr(Settings(1, 3))
    assert ec.describe(Settings(1, 2)) != ec.describe(Settings(1, 3))

    class Holder(nnx.Module):
        def __init__(self, w):
            self.w = nnx.Param(w)
    with pytest.raises(ec.Uncachable):
        ec.describe(Holder(jnp.ones(3)))
    with pytest.raises(ec.Uncachable):
        ec.describe(Opaque(1.0))


JAX_CACHE_SCRIPT = """
import os, sys, jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from jaxllm import executable_cache as ec
ec.configure(sys.argv[2])
def make():
    def f(x):
        return (x.astype(jnp.bfloat16) * 3).astype(jnp.float32).sum()
    return jax.jit(f)
x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
make().lower(x).compile()            # fills JAX's persistent cache
got = ec.compile(make(), x)          # traced again: JAX's cache answers
print(float(got(jnp.ones((64, 128)))))
print(sum(len(f) for _, _, f in os.walk(os.path.join(sys.argv[2], "executables"))))
"""


def test_an_executable_from_jax_cache_is_not_kept(tmp_path):
    """XLA:CPU cannot serialize whole an executable that JAX's persistent cache loaded (a
    later load misses its functions), so such an executable is used but not kept."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", JAX_CACHE_SCRIPT, str(tmp_path / "jax"),
                          str(tmp_path / "ours")], capture_output=True, text=True, check=True)
    value, kept = out.stdout.split()[-2:]
    assert float(value) == 3.0 * 64 * 128 and kept == "0"


def test_the_engine_uses_one_persistent_cache(tmp_path, monkeypatch):
    """With the executable cache on, JAX's persistent cache stays off (its hits could never
    reach ours); with it off, JAX's cache is used as before."""
    from jaxllm.engine.builder import setup_compilation_cache
    before = jax.config.jax_compilation_cache_dir
    try:
        setup_compilation_cache(str(tmp_path / "a"))
        assert ec.enabled() and jax.config.jax_compilation_cache_dir == before
        setup_compilation_cache(str(tmp_path / "b"), executables=False)
        assert not ec.enabled() and jax.config.jax_compilation_cache_dir == str(tmp_path / "b")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        ec.configure(os.environ["JAXLLM_COMPILATION_CACHE_DIR"])


DEVICES_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxllm import executable_cache as ec
ec.configure(sys.argv[1])
devs = jax.devices()
for ds in ([devs[0]], devs[2:6]):
    rep = NamedSharding(Mesh(np.array(ds), ("tp",)), P())
    f = jax.jit(lambda x: x * 2, in_shardings=rep, out_shardings=rep)
    exe = ec.compile(f, jax.ShapeDtypeStruct((4,), jnp.float32, sharding=rep))
    print(len(ds), float(exe(jax.device_put(np.ones(4, np.float32), rep)).sum()))
"""


def test_an_executable_loads_onto_the_devices_it_was_compiled_for(tmp_path):
    """An executable kept for a mesh of some of the process' devices (one of eight, four of
    eight) loads onto those devices in another process, not onto all eight."""
    import subprocess
    import sys
    runs = [subprocess.run([sys.executable, "-c", DEVICES_SCRIPT, str(tmp_path)], capture_output=True,
                           text=True, timeout=300) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.split() == ["1", "8.0", "4", "8.0"]
    assert entries(tmp_path / "executables") == 2  # the second process loaded both
