"""`bench/bench_head_fold.py` as a user runs it, at 1 layer: the table has every row, and both ways of feeding the
output head pick the same greedy tokens (the sampled GRPO rows may differ: the two products round differently, and a
last-bit change in a logit can flip a sampled token; at 1 layer they did). The full run, at 30 layers and in
bfloat16, is in docs/benchmarks.md."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_head_fold_runs_both_ways_to_the_same_greedy_tokens():
    proc = subprocess.run(
        [sys.executable, "bench/bench_head_fold.py", "--dtypes", "float32", "--rounds", "1", "--layers", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["grpo"], ["prefill"])]
    table = {(r[0], r[1]): r for r in rows if r[1] in ("folded", "strided") and r[2] != "/"}
    assert set(table) == {(w, h) for w in ("grpo", "prefill") for h in ("folded", "strided")}, proc.stdout
    assert table[("prefill", "folded")][-1] == table[("prefill", "strided")][-1] == "yes", proc.stdout
