"""The leader's side of multi-process runs, and the follower's loop.

With several processes, process 0 (the leader) announces each device operation and shares
its host inputs (jaxllm.parallel.multiprocess.Channel) so that every other process launches
the same computation on the same values. On one process nothing is announced and inputs
pass through unchanged. The host/device transfers here take the multi-process form only
where there are several processes.
"""
from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from jaxllm.parallel import multiprocess as mp


class Leader:
    """Announces device operations to the followers (when there are several processes)."""

    def __init__(self):
        self.channel = mp.Channel() if jax.process_count() > 1 else None

    @property
    def multiprocess(self) -> bool:
        """Whether other processes follow this one's operations (or it follows process 0's)."""
        return self.channel is not None

    def broadcast(self, op: int, a: int = 0, b: int = 0, inputs=None, announced: bool = False):
        """Announce `op` with its two ints (unless a follower replays an announced one) and
        share `inputs`: their values as process 0 has them, on every process."""
        if self.channel is None:
            return inputs
        if not announced:
            self.channel.announce(op, a, b)
        return None if inputs is None else self.channel.share(inputs)

    def follow(self, handlers: dict[int, Callable[[int, int], None]]) -> None:
        """Followers: run process 0's operations, each by its handler(a, b), until it stops."""
        while True:
            op, a, b = self.channel.announce(0)
            if op == mp.STOP:
                return
            handler = handlers.get(op)
            if handler is None:
                raise RuntimeError(f"unknown operation {op} from process 0")
            handler(a, b)

    def stop_followers(self) -> None:
        if self.channel is not None and self.channel.is_leader:
            self.channel.announce(mp.STOP)
            self.channel = None


def device_put(tree, replicated):
    """A pytree of host arrays on the devices, replicated."""
    if jax.process_count() == 1:  # one batched transfer for all the inputs
        leaves, treedef = jax.tree.flatten(tree)
        return jax.tree.unflatten(treedef, jax.device_put([np.asarray(x) for x in leaves],
                                                          replicated))
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(replicated, np.asarray(x)), tree)


def call_args(tree, replicated):
    """A step's host inputs as an executable takes them. On one process that is the numpy
    arrays themselves: the executable's C++ call transfers them, far faster than
    device_put's Python path for a step's few dozen small inputs."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    return device_put(tree, replicated)


def to_host(x) -> np.ndarray:
    """A replicated result on the host (with several processes, this process's copy)."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))
