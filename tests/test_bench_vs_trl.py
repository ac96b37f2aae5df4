"""bench/bench_vs_trl.py at its smallest setting (tiny preset, one tenant, one step, one run), so the comparison
with TRL cannot rot: both sides train, every table row is printed, and the numbers are the measured ones.

Needs the bench extra (`pip install -e ".[bench]"`); skipped without TRL. About 40 s on 2 CPU cores (two jobs, each
loading its model, and the held-out evaluator); the tiny preset is provisioned here when missing, as in
tests/test_tiny_run.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason='TRL is not installed: pip install -e ".[bench]"')

ROOT = Path(__file__).resolve().parents[1]
ROWS = [
    "wall time (s)",
    "CPU time (s)",
    "peak RSS, side by side (MiB)",
    "peak RSS, one at a time (MiB)",
    "tokens generated",
    "train reward, first steps",
    "train reward, last steps",
    "held-out reward, final adapters",
    "tokens per CPU second",
]


def test_one_tenant_one_step_prints_every_row_with_measured_numbers(tmp_path):
    preset = ROOT / "artifacts" / "tiny"
    subprocess.run(["bash", str(ROOT / "examples/multi_lora/provision.sh"), str(preset)], check=True, cwd=ROOT)
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "bench/bench_vs_trl.py", "--preset", "tiny", "--tenants", "1", "--steps", "1",
         "--runs", "1", "--eval-prompts", "4", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "matched settings" in text and "trl 1." in text and "known differences" in text
    assert "| metric" in text and "rl-multilora, 1 run" in text and "TRL, 1 job(s) in turn" in text
    table = {line.split("|")[1].strip(): line.split("|")[2:5] for line in text.splitlines() if line.startswith("| ")}
    for row in ROWS:
        assert row in table, row
        ours, theirs = (float(cell.split()[0]) for cell in table[row][:2])
        assert ours >= 0 and theirs >= 0, (row, ours, theirs)
    assert "torch threads per process: rl-multilora [1], TRL [1]" in text
    assert "held-out reward of the base" in text

    (run,) = json.loads(out.read_text())["runs"]["1"]
    for side in ("multilora", "trl"):
        numbers = run[side]
        assert numbers["wall_s"] > 0 and numbers["cpu_s"] > 0 and numbers["tokens"] > 0
        assert numbers["rss_one_at_a_time_mib"] > 100  # a torch process with a model loaded
        assert numbers["steps_logged"] == 1 and numbers["threads"] == [1]
        assert len(numbers["procs"]) == 1 and 0 <= numbers["reward_first"] <= 1
    assert float(table["wall time (s)"][0]) == pytest.approx(run["multilora"]["wall_s"], abs=0.06)


def test_repetitions_alternate_which_side_runs_first(monkeypatch, tmp_path):
    """A drift in the machine's speed over a repetition must not always favour the side that runs first."""
    sys.path.insert(0, str(ROOT))
    import bench.bench_vs_trl as b

    order: list[str] = []
    monkeypatch.setattr(b, "run_multilora", lambda s, tenants, work: order.append("multilora") or {"side": 1})
    monkeypatch.setattr(b, "run_trl", lambda s, tenants, work: order.append("trl") or {"side": 2})
    monkeypatch.setattr(b, "summarize", lambda s, tenants, sides, held: sides)
    settings = type("S", (), {"eval_prompts": 0})()
    for rep in range(3):
        sides = b.one_run(settings, [], tmp_path, trl_first=rep % 2 == 1)
        assert sides == {"multilora": {"side": 1}, "trl": {"side": 2}}
    assert order == ["multilora", "trl", "trl", "multilora", "multilora", "trl"]
