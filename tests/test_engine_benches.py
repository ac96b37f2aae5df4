"""The embedded engine's benches as a user runs them, small: `bench/bench_head_fold.py` and `bench/bench_sampler.py`
(their full runs are in docs/benchmarks.md)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_head_fold_runs_both_ways_to_the_same_greedy_tokens():
    """At 1 layer: the table has every row, and both ways of feeding the output head pick the same greedy tokens (the
    sampled GRPO rows may differ: the two products round differently, and a last-bit change in a logit can flip a
    sampled token; at 1 layer they did)."""
    proc = subprocess.run(
        [sys.executable, "bench/bench_head_fold.py", "--dtypes", "float32", "--rounds", "1", "--layers", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["grpo"], ["prefill"])]
    table = {(r[0], r[1]): r for r in rows if r[1] in ("folded", "strided") and r[2] != "/"}
    assert set(table) == {(w, h) for w in ("grpo", "prefill") for h in ("folded", "strided")}, proc.stdout
    assert table[("prefill", "folded")][-1] == table[("prefill", "strided")][-1] == "yes", proc.stdout


@pytest.mark.parametrize("greedy", [False, True])
def test_bench_sampler_times_both_ways_to_the_same_tokens(greedy):
    """The per-step check and sampling as they are and as they were pick the same tokens (the same draws from the
    same generators; the argmax only where a row is greedy)."""
    proc = subprocess.run(
        [sys.executable, "bench/bench_sampler.py", "--rows", "40", "--vocab", "3000", "--rounds", "2",
         *(["--greedy"] if greedy else [])],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "same tokens: yes", proc.stdout
    assert [line.split()[0] for line in lines[1:3]] == ["now", "before"], proc.stdout
