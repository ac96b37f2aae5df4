"""Hand the memory that the C library's malloc keeps after large frees back to the OS, between a step's phases.

On CPU, PyTorch allocates tensors with the C library's malloc. glibc keeps freed memory in its heaps for reuse (and
raises its mmap threshold after each large free, so later large tensors come from the heap too), so the resident
size after a phase that allocated and freed a lot (a rollout's KV cache, a backward's activations) stays at that
phase's peak, and the next phase's peak stacks on it. `malloc_trim(0)` returns the free parts of every heap. Measured
on the SmolLM2 example (bench/bench_memory.py, docs/benchmarks.md). A no-op where there is no glibc (macOS, musl).
"""

from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)  # glibc only
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Return freed heap memory to the OS; True when some was released."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
