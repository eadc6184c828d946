"""Failed steps: how many the engine absorbs before it stops, and faults injected on purpose
to test that (EngineConfig.inject_step_faults, `jaxllm bench soak`)."""
from __future__ import annotations

import collections
import time

import jax
import numpy as np


class InjectedFault(RuntimeError):
    """A step failure made on purpose."""


class StepFailures:
    """Failed steps within a sliding window: too many, and the engine stops."""

    def __init__(self, limit: int, window: float):
        self.limit, self.window = limit, window
        self.times: collections.deque[float] = collections.deque()
        self.total = 0

    def record(self) -> bool:
        """Count a failure; True when `limit` have happened within the window."""
        now = time.monotonic()
        self.total += 1
        self.times.append(now)
        while self.times and now - self.times[0] > self.window:
            self.times.popleft()
        return len(self.times) >= self.limit


def describe(e: BaseException) -> str:
    """One line naming a failure (device errors carry long multi-line messages)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


class FaultInjector:
    """About one step in `every` (seeded) raises InjectedFault before it runs; every second
    fault first deletes the KV cache, as a device call that failed after taking its donated
    buffers leaves it."""

    def __init__(self, every: int, seed: int = 0):
        self.every = every
        self.rng = np.random.default_rng(seed)
        self.num_injected = 0

    def maybe_fail(self, runner) -> None:
        if self.rng.random() * self.every >= 1.0:
            return
        self.num_injected += 1
        if self.num_injected % 2 == 0:
            for x in jax.tree.leaves(runner.kv_cache):  # (a quantized cache is a tree)
                x.delete()
            raise InjectedFault("injected step fault (the KV cache was lost)")
        raise InjectedFault("injected step fault")
