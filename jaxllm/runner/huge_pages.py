"""Transparent huge pages under the engine's long-lived CPU arrays: the weights and the KV cache.

A CPU step streams every weight and reads KV blocks from anywhere in the pool; on 4 KiB pages
that is a TLB miss per page. Linux gives anonymous memory huge pages only where asked when its
THP mode is `madvise` (a common default). XLA:CPU allocates through malloc, so the engine asks
once the arrays exist: MADV_HUGEPAGE, then MADV_COLLAPSE (Linux 6.1+) to rebuild the pages
already written as 2 MiB ones. The kernel does that on live memory (as its khugepaged does),
so it runs on a thread while the engine serves. `EngineConfig.huge_pages=False` turns it off.
"""
from __future__ import annotations

import ctypes
import logging
import threading

import jax

logger = logging.getLogger(__name__)

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE = 2 << 20
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str | None:
    """The kernel's THP mode (always / madvise / never), or None where it has none."""
    try:
        with open(THP_MODE) as f:
            text = f.read()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _ranges(arrays):
    """(start, end) of the whole 2 MiB pages inside each CPU buffer under `arrays`."""
    for leaf in jax.tree.leaves(arrays):
        if not isinstance(leaf, jax.Array) or leaf.is_deleted():
            continue
        for shard in leaf.addressable_shards:
            data = shard.data
            if shard.device.platform != "cpu" or data.nbytes < 2 * HUGE:
                continue
            p = data.unsafe_buffer_pointer()
            a, b = -(-p // HUGE) * HUGE, (p + data.nbytes) // HUGE * HUGE
            if b > a:
                yield a, b


def _enabled() -> bool:
    return thp_mode() not in (None, "never")


def _apply(ranges) -> tuple[int, int]:
    """(bytes collapsed to huge pages now, bytes only asked for): the kernel may decline a
    collapse (no MADV_COLLAPSE before Linux 6.1; EAGAIN or ENOMEM when it cannot gather 2 MiB
    pages now), and then khugepaged collapses the asked-for ranges in its own time."""
    madvise = _madvise()
    collapsed = asked = 0
    for a, b in ranges:
        if madvise(a, b - a, MADV_HUGEPAGE):
            continue
        if madvise(a, b - a, MADV_COLLAPSE) == 0:
            collapsed += b - a
        else:
            asked += b - a
    return collapsed, asked


def advise(arrays) -> tuple[int, int]:
    """Ask for huge pages under the CPU arrays in `arrays` (a pytree) and collapse the pages
    they already have; returns (bytes collapsed, bytes asked for but not collapsed yet), both
    0 where THP is off."""
    return _apply(list(_ranges(arrays))) if _enabled() else (0, 0)


def advise_in_background(arrays, on_done=None) -> threading.Thread | None:
    """advise(arrays) with the syscalls on a daemon thread; on_done(collapsed, asked) when it
    has finished. The buffers' addresses are read here: a donated array (the KV cache, once a
    step has run) cannot be asked for its buffer, and donation keeps the buffer in place."""
    if not _enabled():
        return None
    ranges = list(_ranges(arrays))

    def run():
        try:
            collapsed, asked = _apply(ranges)
        except OSError as e:  # a hint to the kernel: never worth failing the engine for
            logger.warning("huge pages not applied: %s", e)
            collapsed = asked = 0
        if collapsed or asked:
            logger.info("huge pages under %.0f MiB of weights and KV cache (%.0f MiB more asked "
                        "for)", collapsed / 2**20, asked / 2**20)
        if on_done is not None:
            on_done(collapsed, asked)

    t = threading.Thread(target=run, name="jaxllm-huge-pages", daemon=True)
    t.start()
    return t
