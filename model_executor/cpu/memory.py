"""glibc malloc settings for a rank process on the CPU.

Each step allocates activations of several MB. By default glibc serves such blocks with mmap and
returns them on free, so every step page-faults them in again; on a VM whose host reclaims free
pages (this project's CI machines do), that made fresh processes several times slower for tens
of seconds. Keeping freed memory in the heap makes the second step's allocations reuse the first
step's pages. The cost: resident memory stays at its peak, which a server preallocating its KV
cache has anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger("srt.cpu_memory")

# mallopt parameter numbers from glibc's malloc.h
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from the heap, not from fresh mmaps
_TRIM_THRESHOLD = 2**31 - 1  # (mallopt takes an int) practically never give the heap's top back
_TOP_PAD = 1 << 28  # grow the heap 256 MiB at a time


@functools.cache
def keep_freed_memory() -> bool:
    """Applies the settings once per process; False where libc has no mallopt (not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD),
            (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
            (_M_TOP_PAD, _TOP_PAD),
        )
    )
    if not ok:
        logger.warning("mallopt refused a setting: large allocations keep glibc's defaults")
    return ok
