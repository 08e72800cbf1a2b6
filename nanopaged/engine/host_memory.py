"""Keep freed host memory in the process on CPU inference (glibc's malloc).

A CPU forward pass allocates and frees the same activation sizes every step. glibc serves
blocks above its mmap threshold (128 KiB to start) with fresh mappings and trims the heap
top back to the kernel when enough of it is free, so those steps fault their pages in again,
every time. Where page faults are dear (virtual machines) a loop of such blocks ran up to a
hundred times slower (see docs/cpu.md). Raising both thresholds keeps the blocks in the
heap for reuse; the price is that the process keeps its peak heap size.

`NANOPAGED_MALLOC_TUNING=0` leaves malloc as it is. Other C libraries: nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Allocations below this come from the heap; glibc refuses more than half its largest heap.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process (CPU models call this when
    they load). True when the thresholds are (now or already) raised."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("NANOPAGED_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith(
        "linux"
    ):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return False
    # Only glibc names its version; musl has no mallopt thresholds.
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return _applied
