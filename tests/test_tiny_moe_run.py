"""Acceptance: the shipped tiny-moe config, on the provisioned tiny MoE preset (a Qwen3-MoE base; LoRA on the
attention Linears and the packed experts, none on the routers), raises every tenant's reward.

Slow (provisioning plus three tenants' GRPO on a Qwen3-MoE base on 2 CPU cores); CI runs it with -m slow. Held-out
evaluation is off: it never changes the trained weights (tests/test_eval.py) and this test asserts training rewards.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rl_multilora.loop import summarize

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_tiny_moe_run_every_tenant_learns(tmp_path):
    preset = ROOT / "artifacts" / "tiny-moe"
    subprocess.run(
        [sys.executable, "-m", "rl_multilora.provision", "--preset", "tiny-moe", "--out", str(preset)],
        check=True, cwd=ROOT,
    )  # fmt: skip
    assert json.loads((preset / "model" / "config.json").read_text())["model_type"] == "qwen3_moe"
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rl_multilora.cli", "run", "examples/multi_lora/configs/tiny-moe.yaml",
         "--set", f"run_dir={run_dir}", "--set", "logging.progress=false", "--set", "eval.enabled=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summarize(run_dir)
    assert set(summary) == {"gsm8k", "arith", "compare"}
    for name, s in summary.items():
        assert s["gain"] >= 0.2, (name, s)
    config = json.loads(next((run_dir / "adapters" / "arith").glob("step_*/adapter_config.json")).read_text())
    assert sorted(config["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]
