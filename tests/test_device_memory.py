"""Sizing the KV cache from gpu_memory_utilization as a share of the whole device."""
import os

import pytest
from jax._src import xla_bridge

from jaxllm.engine.llm_engine import (ALLOCATOR_SLACK, MEM_FRACTION_VARS, allocator_fraction,
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
    from jaxllm.engine import llm_engine

    class Device:
        def memory_stats(self):
            return {"bytes_limit": int(0.9 * 80 * GiB), "bytes_in_use": 4 * GiB}

    class Probe:
        def __init__(self, *args, **kwargs):
            pass

        def activation_bytes(self):
            return 1 * GiB

    monkeypatch.setattr(llm_engine.jax, "devices", lambda: [Device()])
    monkeypatch.setattr(llm_engine, "ModelRunner", Probe)
    monkeypatch.setenv(MEM_FRACTION_VARS[0], "0.9")
    config = types.SimpleNamespace(block_size=16, max_model_len=256, max_num_seqs=8,
                                   max_num_batched_tokens=64, attention_backend="xla",
                                   gpu_memory_utilization=0.9, kv_cache_dtype="auto",
                                   speculative_config=None)
    per_block = 2 * 2**20
    blocks = {}
    for n in (1, 4):
        engine = types.SimpleNamespace(config=config, dtype=None,
                                       mesh=types.SimpleNamespace(size=n))
        blocks[n] = llm_engine.LLMEngine._profile_blocks(engine, per_block, None)
    budget = int(64 * GiB * (1 - ALLOCATOR_SLACK)) - 5 * GiB  # XLA's 80% of 80 GiB
    assert blocks[1] == budget // per_block and blocks[4] == budget // (per_block // 4)
