"""Handing freed CPU memory back to the system after a long attention call.

glibc's ``malloc`` serves blocks below its mmap threshold from the heap, and raises that threshold (up to 32 MiB)
each time a larger block is freed, so after the first layers a long prefill's temporaries of a few MiB come from
the heap; freed, they stay resident, and the MLP's large blocks that follow are mapped on top of them. The
region kernels' temporaries (rotated query blocks, per-call outputs) are such blocks, where SDPA's at the same
length are one large block each. Measured on the default model at 16k tokens (``scripts/bench_attention.py``):
with a fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_=131072``) a window method's prefill adds what SDPA's adds
(1.01x); with the default one, 1.25x, the difference being freed heap memory kept resident. ``malloc_trim(0)``
after a long call returns it (a few milliseconds a call; not done for short calls, decoding among them).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

#: a call with at least this many (query, key) pairs per head trims the heap afterwards
TRIM_PAIRS = 1 << 22


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc.malloc_trim if libc is not None and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def trim_heap() -> None:
    """glibc's ``malloc_trim(0)``: freed heap memory back to the system (nothing without glibc)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def release_freed_memory(queries: int, keys: int, device_type: str) -> None:
    """After a CPU attention call over ``queries x keys`` pairs of at least ``TRIM_PAIRS``: ``trim_heap``
    (nothing elsewhere)."""
    if device_type == "cpu" and queries * keys >= TRIM_PAIRS:
        trim_heap()
