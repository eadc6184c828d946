"""Multi-process (multi-host) runs through jax.distributed: process 0 owns the scheduler and
the server; every other process follows its device operations step by step.

JAX is multi-controller: each process must launch the same computations with the same
(replicated) inputs. Process 0 announces each operation with a small fixed-size header and
then shares its inputs, both by jax's broadcast_one_to_all; followers rebuild zero inputs of
the announced shapes, receive process 0's values and run the same operation.
"""
from __future__ import annotations

import logging

import jax
import numpy as np

logger = logging.getLogger("jaxllm")

# operations
INIT, STEP, SET_ROWS, COPY, STOP, SAMPLE, TABLE = range(7)
_HEADER = 4


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """jax.distributed.initialize, with gloo collectives when the devices are CPUs."""
    if jax.distributed.is_initialized():
        return
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except Exception:  # older JAX: the flag may be absent; GPUs use NCCL regardless
        pass
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)
    logger.info("process %d of %d joined %s; %d devices in all", process_id, num_processes,
                coordinator, jax.device_count())


class Channel:
    """Process 0 -> all: (operation, two ints) headers and numpy pytrees of known shapes."""

    def __init__(self):
        from jax.experimental import multihost_utils
        self._broadcast = multihost_utils.broadcast_one_to_all
        self.is_leader = jax.process_index() == 0

    def announce(self, op: int, a: int = 0, b: int = 0) -> tuple[int, int, int]:
        header = np.array([op, a, b, 0], np.int32) if self.is_leader else np.zeros(_HEADER, np.int32)
        out = np.asarray(self._broadcast(header))
        return int(out[0]), int(out[1]), int(out[2])

    def share(self, tree):
        """Process 0's values of `tree` everywhere (followers pass zeros of the same shapes)."""
        # the broadcast sums over processes, which turns booleans into integers
        return jax.tree.map(lambda got, like: np.asarray(got).astype(np.asarray(like).dtype),
                            self._broadcast(tree), tree)
