"""Giving freed memory back to the system. CPython's allocator and glibc's malloc keep the pages of many
small freed buffers (a burst of stalled readers' answers) in their heap: the memory is free for the
process but still counted in its RSS, which a container's memory limit reads. ``malloc_trim`` returns
what is free at the top and in the middle of the heap. Without glibc (musl, another OS), nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time

_LIBC: ctypes.CDLL | None
try:
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
except (OSError, AttributeError):
    _LIBC = None

MIN_PERIOD = 1.0  # seconds between two trims: each walks the heap (a few ms)
_last = 0.0


def give_back() -> bool:
    """Collect garbage and return the heap's free pages to the system, at most every :data:`MIN_PERIOD`
    seconds; whether it did."""
    global _last
    now = time.monotonic()
    if _LIBC is None or now - _last < MIN_PERIOD:
        return False
    _last = now
    gc.collect()
    _LIBC.malloc_trim(0)
    return True
