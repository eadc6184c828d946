"""Sizing the KV cache from gpu_memory_utilization as a share of the whole device."""
import os

import jax
import pytest
from jax._src import xla_bridge

from jaxllm.engine import kv_sizing
from jaxllm.engine.kv_sizing import (ALLOCATOR_SLACK, MEM_FRACTION_VARS, allocator_fraction,
                                     claim_device_memory, kv_budget_bytes)

GiB = 2**30


@pytest.mark.parametrize("util,fraction,usable", [
    (0.9, 0.9, 64),    # the engine gave the allocator its share; XLA plans for 80% of it
    (0.78, 0.78, 62.4),  # below XLA's share: all of the pool
    (0.9, 0.75, 60),   # JAX's default pool is smaller than the share: the pool bounds it
    (0.5, 0.75, 40),   # a smaller share than the pool
])
def test_kv_budget_is_a_share_of_the_device(util, fraction, usable):
    device = 80 * GiB
    got = kv_budget_bytes(int(fraction * device), 15 * GiB, 1 * GiB, util, fraction)
    want = int(usable * GiB * (1 - ALLOCATOR_SLACK)) - 16 * GiB
    assert abs(got - want) < 1024


@pytest.fixture
def no_fraction_env(monkeypatch):
    for var in MEM_FRACTION_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_claim_sets_the_allocator_share_before_jax_starts(no_fraction_env):
    no_fraction_env.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    assert claim_device_memory(0.85)
    assert os.environ[MEM_FRACTION_VARS[0]] == "0.8500"
    assert allocator_fraction() == pytest.approx(0.85)


def test_claim_leaves_a_running_backend_and_user_choice_alone(no_fraction_env):
    no_fraction_env.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    assert not claim_device_memory(0.9)
    assert allocator_fraction() == 0.75  # JAX's own default
    no_fraction_env.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    no_fraction_env.setenv(MEM_FRACTION_VARS[1], "0.5")
    assert not claim_device_memory(0.9)
    assert MEM_FRACTION_VARS[0] not in os.environ and allocator_fraction() == 0.5


def test_profiled_blocks_count_one_devices_share(monkeypatch):
    """With tensor parallelism each device holds 1/N of every block (its KV heads), and the
    memory stats are one device's: N devices fit N times the blocks of one."""
    import types

    class Device:
        def memory_stats(self):
            return {"bytes_limit": int(0.9 * 80 * GiB), "bytes_in_use": 4 * GiB}

    class Runner:  # the serving runner, built with a probe-sized cache
        def activation_bytes(self):
            return 1 * GiB

    monkeypatch.setattr(kv_sizing.jax, "devices", lambda: [Device()])
    monkeypatch.setenv(MEM_FRACTION_VARS[0], "0.9")
    config = types.SimpleNamespace(num_gpu_blocks_override=None, kv_cache_memory_bytes=None,
                                   gpu_memory_utilization=0.9)
    assert kv_sizing.needs_profile(config, "gpu") and not kv_sizing.needs_profile(config, "cpu")
    per_block = 2 * 2**20
    blocks = {n: kv_sizing.num_blocks(config, "gpu", per_block, Runner(), mesh_size=n)
              for n in (1, 4)}
    budget = int(64 * GiB * (1 - ALLOCATOR_SLACK)) - 5 * GiB  # XLA's 80% of 80 GiB
    assert blocks[1] == budget // per_block and blocks[4] == budget // (per_block // 4)


def test_the_largest_step_is_checked_against_the_headroom_at_start(monkeypatch, caplog):
    """After warm-up on a device: the headroom under gpu_memory_utilization is logged, and a
    largest step that would not fit beside the weights and cache stops the start."""
    import logging

    held = {"bytes": 60 * GiB}

    class Device:
        def memory_stats(self):
            return {"bytes_limit": int(0.9 * 80 * GiB), "bytes_in_use": held["bytes"]}

    class Runner:
        def activation_bytes(self):
            return 8 * GiB

    monkeypatch.setattr(kv_sizing.jax, "devices", lambda: [Device()])
    monkeypatch.setenv(MEM_FRACTION_VARS[0], "0.9")
    with caplog.at_level(logging.INFO, logger="jaxllm"):
        kv_sizing.check_headroom(Runner(), 0.9)
    assert "headroom 4.00 GiB under gpu_memory_utilization 0.90" in caplog.text
    held["bytes"] = 66 * GiB
    with pytest.raises(ValueError, match="2.00 GiB more than gpu_memory_utilization=0.9"):
        kv_sizing.check_headroom(Runner(), 0.9)
    # a lower share of the device than the allocator's pool is the limit
    assert kv_sizing.headroom_bytes(72 * GiB, 40 * GiB, 8 * GiB, 0.6, 0.9) == pytest.approx(0, abs=16)


def test_a_cpu_cache_is_checked_against_available_memory(monkeypatch):
    """On the CPU the cache must fit the host's available memory (page cache counts: it is
    given back on demand); past it the engine refuses to start, saying why."""
    import types
    avail = kv_sizing.host_available_bytes()
    with open("/proc/meminfo") as f:
        want = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    assert abs(avail - want) < GiB  # the kernel's own figure, not the free pages alone
    config = types.SimpleNamespace(num_gpu_blocks_override=None, kv_cache_memory_bytes=GiB,
                                   gpu_memory_utilization=0.9)
    monkeypatch.setattr(kv_sizing, "host_available_bytes", lambda: 2 * GiB)
    assert kv_sizing.num_blocks(config, "cpu", 2**20, None) == 1024
    monkeypatch.setattr(kv_sizing, "host_available_bytes", lambda: GiB // 2)
    with pytest.raises(ValueError, match="needs 1.0 GiB of memory but the host has 0.5 GiB available"):
        kv_sizing.num_blocks(config, "cpu", 2**20, None)


def test_the_serving_runner_measures_its_multi_step_scratch(tiny_llama, monkeypatch):
    """The scratch that sizes the cache is the serving runner's: with multi-step scheduling
    its largest multi-step call is measured too, and the cache it is given afterwards
    replaces the probe's in the programs it compiles."""
    from jaxllm.config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny_llama, max_model_len=64, max_num_seqs=4,
                                    max_num_batched_tokens=64,
                                    num_gpu_blocks_override=16,
                                    num_scheduler_steps=4, warmup=False))
    runner, c = engine.runner, engine.runner.compiler
    measured = []
    compile_passes = c.compile_passes
    monkeypatch.setattr(c, "compile_passes", lambda *s: measured.append(s) or compile_passes(*s))
    runner.activation_bytes()
    assert measured == [c.passes_shapes[-1]]
    runner.allocate_kv_cache(24)
    assert runner.num_blocks == 24 and c.num_compiled == 0
    assert [x.shape for x in jax.tree.leaves(c.programs.kv_cache)] == \
        [x.shape for x in jax.tree.leaves(runner.kv_cache)]


def test_the_cache_is_sized_from_the_serving_runner(tiny_llama, monkeypatch):
    """Sizing from a measurement (a GPU's): the runner measured is the one that serves, built
    with a probe-sized cache and then given the sized one, and it generates what a runner
    built with that many blocks from the start does."""
    from jaxllm import LLM, SamplingParams

    args = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
                num_scheduler_steps=4, warmup=False)
    measured = []

    def profile(runner, per_block, utilization, mesh_size=1):
        measured.append((runner, runner.num_blocks, runner.activation_bytes()))
        return 24

    monkeypatch.setattr(kv_sizing, "needs_profile", lambda config, platform: True)
    monkeypatch.setattr(kv_sizing, "profile_blocks", profile)
    sized = LLM(tiny_llama, **args)
    (runner, probe_blocks, _), = measured
    assert runner is sized.llm_engine.runner and probe_blocks == kv_sizing.PROBE_BLOCKS
    assert runner.num_blocks == 24 and sized.llm_engine.kv_manager.pool.num_blocks == 24
    monkeypatch.undo()
    fixed = LLM(tiny_llama, num_gpu_blocks_override=24, **args)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 5, 9, 14]}, {"prompt_token_ids": [1, 7, 3]}]
    assert [o.outputs[0].token_ids for o in sized.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in fixed.generate(prompts, params)]
