"""rl_multilora.host_memory: the glibc knobs a run uses to keep its resident size near its live bytes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl_multilora.host_memory import (
    MKL_BUFFER_CACHE_ENV,
    heap_in_use,
    no_mkl_buffer_cache,
    release_freed_memory,
    set_mmap_threshold,
)

glibc = pytest.mark.skipif(heap_in_use() is None, reason="needs glibc >= 2.33 (mallinfo2)")


@glibc
def test_heap_in_use_counts_a_live_tensor_and_forgets_a_freed_one():
    before = heap_in_use()
    t = torch.ones(16 * 2**20 // 4)  # 16 MiB, float32
    held = heap_in_use() - before
    del t
    freed = heap_in_use() - before
    assert 15 * 2**20 < held < 17 * 2**20
    assert abs(freed) < 2**20


@glibc
def test_a_fixed_mmap_threshold_returns_a_freed_tensor_to_the_os():
    # in a child process: the threshold is process-wide and would stay set for the rest of the test session
    code = """
import psutil, torch
from rl_multilora.host_memory import set_mmap_threshold
assert set_mmap_threshold(128 * 1024)
proc = psutil.Process()
torch.ones(4 * 2**20).sum()  # 16 MiB freed: glibc alone would now raise its threshold above it
rss = proc.memory_info().rss
t = torch.ones(2 * 2**20)  # 8 MiB
assert proc.memory_info().rss - rss > 7 * 2**20
del t
assert proc.memory_info().rss - rss < 2**20, (proc.memory_info().rss - rss) / 2**20
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_trimming_runs_anywhere():
    assert release_freed_memory() in (True, False)


def test_a_bad_threshold_is_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match="an int >= 0"):
        set_mmap_threshold(-1)


def _env_without_mkl_switch() -> dict[str, str]:
    """This environment as a fresh shell has it: without the switch an in-process `cli.main` may have set."""
    return {k: v for k, v in os.environ.items() if k != MKL_BUFFER_CACHE_ENV}


_MKL_PRODUCTS = """
import sys
from rl_multilora.host_memory import heap_in_use, no_mkl_buffer_cache
took = no_mkl_buffer_cache() if sys.argv[1] == "off" else False
import torch
torch.set_num_threads(2)
x, w = torch.randn(412, 576), torch.randn(8192, 576)
before = heap_in_use()
for _ in range(3):
    y = x @ w.t()
    del y
print(took, (heap_in_use() - before) / 2**20)
"""


@glibc
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch does not use Intel MKL")
def test_without_mkl_buffer_cache_a_product_keeps_no_buffer_after_it():
    env = _env_without_mkl_switch()
    root = Path(__file__).resolve().parents[1]
    kept = {}
    for mode in ("cache", "off"):
        out = subprocess.run([sys.executable, "-c", _MKL_PRODUCTS, mode], check=True, cwd=root, env=env,
                             capture_output=True, text=True).stdout.split()  # fmt: skip
        assert out[0] == str(mode == "off")  # the switch took effect only where asked, before torch was imported
        kept[mode] = float(out[1])  # MiB still held after the products' outputs were freed
    assert kept["cache"] > 4, kept  # MKL's own cache holds its buffers...
    assert abs(kept["off"]) < 1, kept  # ...and without it nothing stays


def test_the_mkl_switch_changes_nothing_once_torch_is_imported(monkeypatch):
    monkeypatch.delenv(MKL_BUFFER_CACHE_ENV, raising=False)
    assert not no_mkl_buffer_cache()  # torch is imported here: too late for MKL to read it
    assert MKL_BUFFER_CACHE_ENV not in os.environ


def test_the_cli_turns_the_mkl_cache_off_before_torch_loads():
    code = """
import os, sys
from rl_multilora import cli
try:
    cli.main(["--help"])
except SystemExit:
    pass
print(os.environ.get("MKL_DISABLE_FAST_MM"), "torch" in sys.modules)
"""
    env = _env_without_mkl_switch()
    out = subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.split()  # fmt: skip
    assert out[-2:] == ["1", "False"], out
