"""Acceptance: the shipped tiny config, on the provisioned tiny preset, raises every adapter's reward.

Slow (about 6 minutes on 2 CPU cores: provisioning plus 80 steps of three adapters); CI runs it with -m slow.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from rl_multilora.loop import summarize

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_single_run_every_adapter_learns(tmp_path):
    preset = ROOT / "artifacts" / "tiny"
    subprocess.run(["bash", str(ROOT / "examples/multi_lora/provision.sh"), str(preset)], check=True, cwd=ROOT)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rl_multilora.cli", "run", "examples/multi_lora/configs/tiny.yaml",
         "--set", f"run_dir={run_dir}", "--set", "logging.progress=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summarize(run_dir)
    assert set(summary) == {"gsm8k", "arith", "compare"}
    for name, s in summary.items():
        assert s["gain"] >= 0.2, (name, s)
    assert (run_dir / "reward_curves.png").is_file()
    assert "reward first5" in proc.stdout
