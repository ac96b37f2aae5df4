"""The LoRA's rank-wide products for float32 training on an x86-64 CPU: `cpu_kernels.c`, built on first use.

Why a kernel of our own: every product a LoRA Linear adds is thin (one side is the rank), and MKL runs those at
30-55 GFLOP/s on a core where the base's GEMMs run at about 100 (`bench/bench_lora_paths.py --kernels`): at
SmolLM2-135M's shape the LoRA's 2.7 % of the FLOPs cost 7-8 % of a training pass. The C kernels keep the rank-wide
side in registers and stream the activation once (AVX2 + FMA), and compute each output value as one fixed sequence of
fused multiply-adds: a token's values do not follow its row's length, the rows around it or the thread count, which
the BLAS products only gave from 12 tokens up (`layer._rank_major_floor`).

Built with the system's C compiler (`$CC`, else `cc`, `gcc` or `clang`) into a cache folder keyed by the source and
flags (`$RL_MULTILORA_CACHE`, else `$XDG_CACHE_HOME/rl_multilora` or `~/.cache/rl_multilora`), written by rename so
concurrent processes never load half a file. Where there is no compiler, no AVX2, another architecture or
`RL_MULTILORA_CPU_KERNELS=0`, the layer keeps its torch path (the same math; where the build fails, a compiler
missing say, one warning says why).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared", "-std=c99")
OPENMP = "-fopenmp"  # torch's own libgomp.so.1 once loaded: its thread pool; built without where a compiler lacks it
ENV_SWITCH = "RL_MULTILORA_CPU_KERNELS"
FLOPS_PER_THREAD = 2_000_000  # below this much work per thread, fewer threads

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why_not: str | None = None  # set once the library is known to be unusable here
_p = ctypes.c_void_p
_l = ctypes.c_long


def enabled() -> bool:
    """Whether this process may use the kernels at all (before building them): x86-64 with AVX2, not switched off."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return _cpu_has_avx2()


@functools.cache
def _cpu_has_avx2() -> bool:
    """x86-64 with AVX2 (torch's own dispatch level): asked once per process, not per Linear and step."""
    return platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
        "AVX2", "AVX512",
    )  # fmt: skip


def usable(*tensors: torch.Tensor) -> bool:
    """Whether these tensors take the kernels: all float32 on the CPU, and the library built and loaded here."""
    if _why_not is not None or not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return False
    return enabled() and library() is not None


def library() -> ctypes.CDLL | None:
    """The loaded library, building it on first use; None (and one warning) where it cannot be built."""
    global _lib, _why_not
    if _lib is not None or _why_not is not None:
        return _lib
    with _lock:
        if _lib is None and _why_not is None:
            try:
                _lib = _bind(ctypes.CDLL(str(_build())))
            except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                _why_not = str(err)
                warnings.warn(
                    f"rl_multilora: the CPU LoRA kernels are not available ({_why_not}); training uses the torch "
                    f"path (slower, the same math). Set {ENV_SWITCH}=0 to skip the build.",
                    RuntimeWarning, stacklevel=3,
                )  # fmt: skip
    return _lib


def cache_dir() -> Path:
    if root := os.environ.get("RL_MULTILORA_CACHE"):
        return Path(root) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rl_multilora" / "kernels"


def compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    raise RuntimeError("no C compiler found (set $CC, or install gcc or clang)")


def _build() -> Path:
    cc = compiler()
    source = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        for flags in ((*FLAGS, OPENMP), FLAGS):
            done = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300)
            if done.returncode == 0:
                break
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.lora_forward.argtypes = [_p] * 7 + [_l] * 5 + [ctypes.c_int] * 2
    lib.lora_forward.restype = ctypes.c_int
    lib.lora_backward.argtypes = [_p] * 10 + [_l] * 5 + [ctypes.c_int] * 2
    lib.lora_backward.restype = ctypes.c_int
    return lib


def padded_rank(r: int) -> int:
    """The rank the kernels compute at: r rounded up to a multiple of 8 (the extra columns are zeros)."""
    return -(-r // 8) * 8


def slot_weights(lora_a: torch.Tensor, lora_b: torch.Tensor, used: torch.Tensor, r: int):
    """The used slots' A and B in the kernels' layouts, zero-padded to `padded_rank(r)` ranks, from stacked
    `lora_a (S, R, in)`, `lora_b (S, out, R)`: `(at (U, in, R8), bt (U, R8, out), a (U, R8, in), b (U, out, R8))`,
    A.T and B.T for the forward's shrink and expand, A and B for the backward's."""
    r8 = padded_rank(r)
    a = lora_a.narrow(1, 0, r).index_select(0, used)  # (U, r, in), contiguous
    b = lora_b.narrow(2, 0, r).index_select(0, used)  # (U, out, r), contiguous
    if r8 != r:
        a = F.pad(a, (0, 0, 0, r8 - r))
        b = F.pad(b, (0, r8 - r))
    return a.transpose(1, 2).contiguous(), b.transpose(1, 2).contiguous(), a, b


def _threads(flops: float) -> int:
    return max(1, min(torch.get_num_threads(), int(flops // FLOPS_PER_THREAD)))


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def forward(y3, x3, at, bt, idx, scales, fresh: bool = False):
    """`xa[i] = scale[i] * x3[i] @ at[idx[i]]` and `y3[i] += xa[i] @ bt[idx[i]]` (in place) for every row i, or
    `y3[i] = ...` with `fresh` (y3's values are not read); returns `xa: (n, L, R8)`. x3 `(n, L, in)`, y3
    `(n, L, out)`, both contiguous float32."""
    n, length, fan_in = x3.shape
    fan_out, r8 = y3.shape[2], at.shape[2]
    _check(x3, y3, at, bt)
    xa = x3.new_empty(n, length, r8)
    idx, scales = idx.contiguous(), scales.contiguous()
    threads = _threads(2.0 * n * length * r8 * (fan_in + fan_out))
    library().lora_forward(
        _ptr(x3), _ptr(y3), _ptr(xa), _ptr(at), _ptr(bt), _ptr(idx), _ptr(scales), n, length, fan_in, fan_out, r8,
        int(fresh), threads,
    )  # fmt: skip
    return xa


def backward(x3, grad, xa, a, b, idx, scales, dx: torch.Tensor | None, fresh: bool = False):
    """The LoRA's gradients from `forward`'s saved tensors and `slot_weights`' `a (U, R8, in)`, `b (U, out, R8)`:
    `dx += g_xa @ A` in place (when dx is given; `dx = ...` with `fresh`) and the used slots' `(gA (U, R8, in),
    gB (U, R8, out))`, each summed over the slot's tokens in batch order."""
    n, length, fan_in = x3.shape
    fan_out, r8, used = grad.shape[2], a.shape[1], a.shape[0]
    _check(x3, grad, xa, a, b, *([] if dx is None else [dx]))
    ga = x3.new_zeros(used, r8, fan_in)
    gb = x3.new_zeros(used, r8, fan_out)
    idx, scales = idx.contiguous(), scales.contiguous()
    threads = _threads(2.0 * n * length * r8 * (fan_in + fan_out))
    if library().lora_backward(
        _ptr(x3), _ptr(grad), _ptr(xa), _ptr(a), _ptr(b), _ptr(idx), _ptr(scales), _ptr(dx), _ptr(ga), _ptr(gb), n,
        length, fan_in, fan_out, r8, int(fresh), threads,
    ):  # fmt: skip
        raise MemoryError(f"cpu_kernels: no memory for a {length} x {r8} scratch")
    return ga, gb


def _check(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not (t.is_contiguous() and t.dtype == torch.float32 and t.device.type == "cpu"):
            raise ValueError(
                f"cpu_kernels: expected contiguous float32 CPU tensors, got {t.dtype} {tuple(t.stride())}"
            )
