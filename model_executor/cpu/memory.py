"""Host memory settings for a rank process on the CPU: glibc's malloc and oneDNN's caches.

Each step allocates activations of several MB. By default glibc serves such blocks with mmap and
returns them on free, so every step page-faults them in again; on a VM whose host reclaims free
pages (this project's CI machines do), that made fresh processes several times slower for tens
of seconds. Keeping freed memory in the heap makes the second step's allocations reuse the first
step's pages. The cost: resident memory stays at its peak, which a server preallocating its KV
cache has anyway.

That holds only while what stays allocated between steps is bounded. Where a linear runs on torch's
oneDNN (prefill steps above the AMX kernel's row limit, every linear on AVX-512 without BF16), oneDNN
builds a primitive for each shape and two caches keep it: ideep's (LRU_CACHE_CAPACITY) and oneDNN's
own (ONEDNN_PRIMITIVE_CACHE_CAPACITY), 1024 shapes each by default. A prefill's rows are its step's
tokens, so nearly every prefill is a new shape; each primitive kept splits the freed activation
blocks around it, and the heap grew far faster than what it held (issue 36, pytorch/pytorch#27971;
figures in docs/performance-log.md). bound_onednn_caches keeps the last ONEDNN_CACHE_SHAPES shapes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from typing import Any

logger = logging.getLogger("srt.cpu_memory")

# mallopt parameter numbers from glibc's malloc.h
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from the heap, not from fresh mmaps
_TRIM_THRESHOLD = 2**31 - 1  # (mallopt takes an int) practically never give the heap's top back
_TOP_PAD = 1 << 28  # grow the heap 256 MiB at a time
# Shapes each oneDNN cache keeps: a step needs four or five (qkv, o, gate_up, down, the LM head), so
# this holds the last half-dozen batch sizes or prefill lengths. Fewer primitives kept also leave
# fewer pieces for freed blocks to be split around: at 128 the heap still levelled off at several
# times what it held (docs/performance-log.md, 2026-12-04).
ONEDNN_CACHE_SHAPES = 32
# (ideep reads the first when a thread first uses it, oneDNN the second at its first primitive)
_ONEDNN_CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


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


def release_freed_memory() -> bool:
    """Gives the heap's free pages back to the system (glibc's malloc_trim): once after loading,
    where the weights read as loaded and replaced by their packed forms were freed into a heap that
    keep_freed_memory never trims, so that they count as available when the KV budget is sized.
    False where libc has no malloc_trim."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Any | None:
    """libc's malloc_trim, looked up once (find_library runs ldconfig)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def bound_onednn_caches() -> dict[str, str]:
    """Caps oneDNN's primitive caches at ONEDNN_CACHE_SHAPES shapes each, through the environment
    variables torch's oneDNN reads, where the user set none; returns the values in force. Call
    before the process's first oneDNN matmul (the CPU wing does, at start-up): later, a cache that
    already exists keeps its capacity."""
    for name in _ONEDNN_CACHE_VARIABLES:
        os.environ.setdefault(name, str(ONEDNN_CACHE_SHAPES))
    return {name: os.environ[name] for name in _ONEDNN_CACHE_VARIABLES}
