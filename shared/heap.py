"""The C heap (glibc malloc) of a process that runs an engine.

A forward allocates and frees the same large temporaries every step (a 2,048-token
prefill: GEMM outputs and activations of 1-13 MB each). glibc serves blocks of
128 KB or more from fresh ``mmap`` regions at first and returns freed heap tops to
the OS, so each step faulted its temporaries in again and zeroed them (7% of a
2,048-token bf16 prefill on 2 cores). :func:`keep_freed_memory` keeps them in
the heap for the next step instead; :func:`release_freed_memory` trims on
purpose, after a one-off peak (loading and packing the weights)."""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None  # not glibc: its allocator keeps its own policy


def keep_freed_memory() -> bool:
    """Serve blocks up to 32 MB from the heap and keep up to 1 GB of freed heap top
    (a forward's temporaries, reused by the next step) instead of unmapping it.
    False where the C library is not glibc or refused a setting."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    taken = True
    for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (M_TOP_PAD, TOP_PAD),
    ):
        if mallopt(param, value) != 1:
            log.debug("mallopt(%d, %d) was refused", param, value)
            taken = False
    return taken


def release_freed_memory() -> None:
    """Give the heap's free pages back to the OS: glibc keeps memory freed from its
    arenas (a load's intermediate copies) resident until asked to trim."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim(0)
