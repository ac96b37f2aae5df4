"""Acceptance: the shipped tiny config, on the provisioned tiny preset, raises every adapter's reward, and every
adapter's held-out reward (test split, `rl-multilora eval`) beats the base's by HELD_OUT_MARGIN.

Slow (about 6 minutes on 2 CPU cores: provisioning plus 80 steps of three adapters); CI runs it with -m slow. The run
evaluates the base and the final adapters only (`eval.every=null`): evaluation never changes the trained weights
(tests/test_eval.py), and the held-out gain asserted here is `rl-multilora eval`'s on the final checkpoints.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rl_multilora.loop import summarize

ROOT = Path(__file__).resolve().parents[1]
# Measured on three 2-core CPU machines (torch 2.13.0+cpu): held-out gains of +0.51 to +0.92 over the base (docs/getting-started.md);
# the margin leaves room for another CPU's different (deterministic per machine) trajectory.
HELD_OUT_MARGIN = 0.1


@pytest.mark.slow
@pytest.mark.timeout(1800)  # provisioning its preset when missing, then the run: past 600 s when loaded
def test_single_run_every_adapter_learns(tmp_path):
    preset = ROOT / "artifacts" / "tiny"
    subprocess.run(["bash", str(ROOT / "examples/multi_lora/provision.sh"), str(preset)], check=True, cwd=ROOT)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rl_multilora.cli", "run", "examples/multi_lora/configs/tiny.yaml",
         "--set", f"run_dir={run_dir}", "--set", "logging.progress=false", "--set", "eval.every=null"],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summarize(run_dir)
    assert set(summary) == {"gsm8k", "arith", "compare"}
    for name, s in summary.items():
        assert s["gain"] >= 0.2, (name, s)
    assert (run_dir / "reward_curves.png").is_file()
    assert "reward first5" in proc.stdout and "held-out: base" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "rl_multilora.cli", "eval", str(run_dir), "--split", "test"],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["adapter"]: r for r in json.loads((run_dir / "eval_test.json").read_text())}
    assert set(rows) == {"gsm8k", "arith", "compare"}
    for name, r in rows.items():
        gain = r["adapter_result"]["reward_mean"] - r["base"]["reward_mean"]
        assert gain >= HELD_OUT_MARGIN, (name, r["base"]["reward_mean"], r["adapter_result"]["reward_mean"])
