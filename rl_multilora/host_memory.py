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

jemalloc (`model.host_allocator: jemalloc`) is the other way out of glibc's holes, without the threshold's page
faults for every tensor: it keeps freed memory in size classes and extents of their own and reuses it, and purges
what it keeps when told (`release_freed_memory` does, between phases) or after its decay time. A malloc cannot be
swapped inside a running process, so `rl-multilora run` starts itself again with jemalloc preloaded
(`exec_with_jemalloc`). The library is the one Ray's wheel ships (`ray/core/libjemalloc.so`, jemalloc 5.3), or the
file `RL_MULTILORA_JEMALLOC` names.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.util
import os
import sys
from pathlib import Path

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


@functools.cache
def _jemalloc_mallctl():
    """jemalloc's `mallctl` when jemalloc serves this process's malloc (LD_PRELOAD), else None."""
    try:
        fn = ctypes.CDLL(None).mallctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_ARENAS_ALL = 4096  # jemalloc's MALLCTL_ARENAS_ALL


def release_freed_memory() -> bool:
    """Return freed heap memory to the OS; True when some was released."""
    mallctl = _jemalloc_mallctl()
    if mallctl is not None:
        return mallctl(f"arena.{_ARENAS_ALL}.purge".encode(), None, None, None, 0) == 0
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
    """Bytes malloc has handed out and not got back, over all its arenas and mappings (None without glibc 2.33+ or
    jemalloc): the live part of the resident size, without what malloc keeps free."""
    mallctl = _jemalloc_mallctl()
    if mallctl is not None:
        epoch, value = ctypes.c_uint64(1), ctypes.c_size_t(0)  # a new epoch refreshes jemalloc's statistics
        size = ctypes.c_size_t(ctypes.sizeof(epoch))
        mallctl(b"epoch", ctypes.byref(epoch), ctypes.byref(size), ctypes.byref(epoch), ctypes.sizeof(epoch))
        size = ctypes.c_size_t(ctypes.sizeof(value))
        if mallctl(b"stats.allocated", ctypes.byref(value), ctypes.byref(size), None, 0) != 0:
            return None
        return value.value
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


# --- jemalloc -------------------------------------------------------------------------------------------------------

JEMALLOC_ENV = "RL_MULTILORA_JEMALLOC"  # a libjemalloc.so to preload instead of the one Ray's wheel ships
# jemalloc's options when the user sets none (MALLOC_CONF): unused dirty pages go back to the OS after 1 s instead of
# 10 s (docs/benchmarks.md, "jemalloc"); the purge between a run's phases returns the rest at once.
JEMALLOC_CONF = "dirty_decay_ms:1000,muzzy_decay_ms:0"
_RESTORE_ENV = "_RL_MULTILORA_ENV_BEFORE_JEMALLOC"  # LD_PRELOAD and MALLOC_CONF as they were, for child processes
_started_again = False  # this process is the one `exec_with_jemalloc` started


def jemalloc_loaded() -> bool:
    """True when jemalloc serves this process's malloc."""
    return _jemalloc_mallctl() is not None


def find_jemalloc(setting: str = "model.host_allocator") -> Path:
    """The jemalloc library `model.host_allocator: jemalloc` (or the serving commands' `--host-allocator`: `setting`)
    preloads; ValueError naming what is allowed when there is none. `RL_MULTILORA_JEMALLOC` first, then Ray's wheel,
    then the system's (`ldconfig`)."""
    if not sys.platform.startswith("linux"):
        raise ValueError(f"{setting}='jemalloc' is not allowed on {sys.platform}; allowed: glibc (Linux only)")
    named = os.environ.get(JEMALLOC_ENV)
    if named:
        if not Path(named).is_file():
            raise ValueError(f"{JEMALLOC_ENV}={named!r} is not allowed; allowed: the path of a libjemalloc.so file")
        return Path(named)
    spec = importlib.util.find_spec("ray")  # where Ray is installed, without importing it
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            bundled = Path(folder) / "core" / "libjemalloc.so"
            if bundled.is_file():
                return bundled
    system = ctypes.util.find_library("jemalloc")
    if system:
        return Path(system)
    raise ValueError(
        f"{setting}='jemalloc' is not allowed here: no jemalloc library was found; allowed: glibc, or "
        f"jemalloc after `pip install 'ray>=2.40'` (its wheel ships libjemalloc.so) or with {JEMALLOC_ENV} naming one"
    )


def exec_with_jemalloc(argv: list[str], setting: str = "model.host_allocator") -> None:
    """Replace this process with `python argv...` that has jemalloc preloaded (never returns; OSError if exec fails).
    The new process's children get the environment back as it was (`restore_child_env`). ValueError when this
    process is already such a start and still has no jemalloc (the loader could not preload the library)."""
    library = find_jemalloc(setting)
    if _started_again:
        raise ValueError(
            f"{setting}='jemalloc' is not allowed here: {library} could not be preloaded (see the loader's "
            f"message above); allowed: glibc, or {JEMALLOC_ENV} naming a libjemalloc.so this system can load"
        )
    env = {**os.environ, **_preload_env(library)}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)


def _preload_env(library: Path) -> dict[str, str]:
    """The variables that start a process with `library` preloaded and jemalloc's options, and that tell it
    (`restore_child_env`) what LD_PRELOAD and MALLOC_CONF were before, for the processes it starts."""
    env = {_RESTORE_ENV: repr({k: os.environ.get(k) for k in ("LD_PRELOAD", "MALLOC_CONF")})}
    before = os.environ.get("LD_PRELOAD")
    env["LD_PRELOAD"] = f"{library}:{before}" if before else str(library)
    env["MALLOC_CONF"] = os.environ.get("MALLOC_CONF", JEMALLOC_CONF)
    return env


def jemalloc_env(setting: str = "model.host_allocator") -> dict[str, str]:
    """The environment variables that start another process with jemalloc preloaded, for a starter that is not this
    process's exec: a Ray actor's `runtime_env` (`rl-multilora serve`). The process calls `restore_child_env` first,
    then `check_jemalloc_started` (the loader only warns when it cannot preload a file). ValueError naming `setting`
    when no jemalloc can be used."""
    return _preload_env(find_jemalloc(setting))


def jemalloc_ray_options(wanted: bool, setting: str = "model.host_allocator") -> dict:
    """Options for a Ray actor or task (`.options(**...)`) that start its process with jemalloc preloaded when
    `wanted` (its `runtime_env`, `jemalloc_env`); `{}` otherwise. The process calls `enter_ray_process(wanted)`
    first."""
    return {"runtime_env": {"env_vars": jemalloc_env(setting)}} if wanted else {}


def enter_ray_process(wanted: bool, setting: str = "model.host_allocator") -> None:
    """First thing in a Ray actor started with `jemalloc_ray_options(wanted)`: give its children the environment back
    (`restore_child_env`; a no-op without jemalloc) and, when `wanted`, refuse to go on without jemalloc
    (`check_jemalloc_started`)."""
    restore_child_env()
    if wanted:
        check_jemalloc_started(setting)


def check_jemalloc_started(setting: str = "model.host_allocator") -> None:
    """In a process started with `jemalloc_env`: ValueError naming `setting` when jemalloc does not serve it."""
    if not jemalloc_loaded():
        raise ValueError(
            f"{setting}='jemalloc' is not allowed here: this process started without it ({find_jemalloc(setting)} "
            f"could not be preloaded: see the loader's message); allowed: glibc, or {JEMALLOC_ENV} naming a "
            "libjemalloc.so this system can load"
        )


def restore_child_env() -> None:
    """After `exec_with_jemalloc`: put LD_PRELOAD and MALLOC_CONF back as they were, so the processes this one starts
    (reward workers, Ray, engine servers) keep their own malloc. A no-op elsewhere."""
    global _started_again
    before = os.environ.pop(_RESTORE_ENV, None)
    if before is None:
        return
    _started_again = True
    import ast

    for key, value in ast.literal_eval(before).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def start_with_jemalloc(command: list[str], process_entry: bool, setting: str = "model.host_allocator") -> None:
    """Start `python -m rl_multilora.cli COMMAND...` again with jemalloc preloaded (`exec_with_jemalloc`) unless
    jemalloc already serves this process; `rl-multilora run` (`model.host_allocator`) and the serving commands
    (`--host-allocator`: `setting`) call it. Called in-process (`process_entry` false) it only checks that a library
    is there: the caller keeps the malloc it has. ValueError naming `setting` when no jemalloc can be used."""
    if jemalloc_loaded():
        return
    find_jemalloc(setting)
    if process_entry:
        exec_with_jemalloc(["-m", "rl_multilora.cli", *command], setting)


def allocator_name() -> str:
    """The malloc serving this process, for a server's start line: `jemalloc` or `glibc`."""
    return "jemalloc" if jemalloc_loaded() else "glibc"
