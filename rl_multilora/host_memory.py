"""Hand the memory that the C library's malloc keeps after large frees back to the OS, between a step's phases.

On CPU, PyTorch allocates tensors with the C library's malloc. glibc keeps freed memory in its heaps for reuse (and
raises its mmap threshold after each large free, so later large tensors come from the heap too), so the resident
size after a phase that allocated and freed a lot (a rollout's KV cache, a backward's activations) stays at that
phase's peak, and the next phase's peak stacks on it. `malloc_trim(0)` returns the free parts of every heap. Measured
on the SmolLM2 example (bench/bench_memory.py, docs/benchmarks.md). A no-op where there is no glibc (macOS, musl).

Trimming between phases does not lower a phase's own peak. Within one training micro-batch glibc's heap grew about
3x past the bytes live in it (SmolLM2 example: +1.2 GB of RSS for +0.4 GB live at most): big short-lived tensors
(activations, recomputed layers) are carved from the heap, interleaved with smaller longer-lived ones (saved layer
inputs, LoRA gradients), and their holes do not fit the next ones. glibc serves allocations above its mmap threshold
with their own mapping, unmapped on free; it raises that threshold by itself up to 32 MB after freeing such a
chunk, which sends nearly every tensor to the heap. `set_mmap_threshold(n)` fixes it at n bytes (and turns the
raising off): the resident size then follows the live bytes, for the kernel's zero-filled page faults of every
new large tensor (system CPU time; measured in docs/benchmarks.md). `heap_in_use()` reads the live bytes.

Intel MKL (torch's BLAS on x86) keeps the packing buffers of its matrix products in a cache of its own, per thread,
and never hands them back: on the SmolLM2 example with two torch threads that cache held 45-70 MiB of the run's peak.
`no_mkl_buffer_cache()` turns it off for a process that has not imported torch yet (the `rl-multilora` command does
it first thing); MKL then takes its buffers from malloc and frees them after each product.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


class _MallInfo2(ctypes.Structure):  # glibc >= 2.33, malloc.h; every field in bytes but the counts
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


@functools.cache
def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None  # glibc only


@functools.cache
def _malloc_trim():
    libc = _glibc()
    if libc is None:
        return None
    trim = libc.malloc_trim
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Return freed heap memory to the OS; True when some was released."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


def set_mmap_threshold(nbytes: int) -> bool:
    """Serve every allocation of at least `nbytes` with its own mapping, returned to the OS when freed, and stop glibc
    from raising that threshold by itself; True when set (glibc only)."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"nbytes={nbytes!r} is not allowed; allowed: an int >= 0")
    libc = _glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, nbytes))


def heap_in_use() -> int | None:
    """Bytes malloc has handed out and not got back, over all its arenas and mappings (None without glibc 2.33+):
    the live part of the resident size, without what malloc keeps free."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


MKL_BUFFER_CACHE_ENV = "MKL_DISABLE_FAST_MM"  # Intel MKL's switch for its own memory manager, read when MKL loads


def no_mkl_buffer_cache() -> bool:
    """Turn off MKL's cache of its products' buffers in this process and the processes it starts; True when that
    takes effect. MKL reads its switch when it is loaded, so this must run before `torch` is imported: afterwards,
    or when the user set `MKL_DISABLE_FAST_MM` themselves (`=0` keeps the cache), it changes nothing."""
    if "torch" in sys.modules or MKL_BUFFER_CACHE_ENV in os.environ:
        return False
    os.environ[MKL_BUFFER_CACHE_ENV] = "1"
    return True
