"""Acceptance: the shipped 64-tenant config trains every tenant on the tiny preset, and every tenant's held-out reward
(greedy, 20 prompts of its test split) ends above its base's.

Slow (about 7 minutes on 2 CPU cores after provisioning); CI runs it with -m slow.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from rl_multilora.loop import summarize
from rl_multilora.tenants import TenantState

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # provisioning (when the preset is not there yet) plus about 7 minutes of training
def test_sixty_four_tenants_all_learn(tmp_path):
    preset = ROOT / "artifacts" / "tiny"
    subprocess.run(["bash", str(ROOT / "examples/multi_lora/provision.sh"), str(preset)], check=True, cwd=ROOT)
    run_dir = tmp_path / "many"
    proc = subprocess.run(
        [sys.executable, "-m", "rl_multilora.cli", "run", "examples/multi_lora/configs/many.yaml",
         "--set", f"run_dir={run_dir}", "--set", "logging.progress=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summarize(run_dir)
    assert len(summary) == 64
    assert f" {TenantState.FAILED.value} " not in proc.stdout
    for name, s in summary.items():
        assert s["eval_base"] is not None and s["eval_final"] is not None, name
        assert s["eval_final_step"] == 40, (name, s)
        assert s["eval_final"] > s["eval_base"], (name, s["eval_base"], s["eval_final"])
