"""Acceptance: the agents example (examples/multi_lora/configs/agents.yaml) on the provisioned tiny-agents preset
raises every tenant's training reward, and every tenant's held-out reward beats the base's: the single-turn tenants by
`rl-multilora eval`, the two agent tenants by greedy held-out episodes (`tiny_agents.evaluate_run`; rl-multilora
eval does not run a tenant's environment yet, see examples/multi_lora/configs/agents.yaml).

Slow (provisioning the tiny preset if missing, ~2.5 min; tiny-agents, ~2.5 min; the 5-tenant run, a few minutes on
2 CPU cores); run with -m slow.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rl_multilora.loop import summarize
from rl_multilora.presets.tiny_agents import evaluate_run

ROOT = Path(__file__).resolve().parents[1]
TENANTS = {"gsm8k", "arith", "compare", "calc", "guess"}
AGENTS = ("calc", "guess")


@pytest.mark.slow
def test_agents_run_every_tenant_learns(tmp_path):
    subprocess.run(["bash", str(ROOT / "examples/multi_lora/provision_agents.sh")], check=True, cwd=ROOT)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rl_multilora.cli", "run", "examples/multi_lora/configs/agents.yaml",
         "--set", f"run_dir={run_dir}", "--set", "logging.progress=false", "--set", "eval.every=null"],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summarize(run_dir)
    assert set(summary) == TENANTS
    for name, s in summary.items():
        assert s["gain"] > 0, (name, s)
    proc = subprocess.run(
        [sys.executable, "-m", "rl_multilora.cli", "eval", str(run_dir), "--split", "test",
         *(f"--adapter={name}" for name in sorted(TENANTS - set(AGENTS)))],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["adapter"]: r for r in json.loads((run_dir / "eval_test.json").read_text())}
    assert set(rows) == TENANTS - set(AGENTS)
    for name, r in rows.items():
        base, trained = r["base"]["reward_mean"], r["adapter_result"]["reward_mean"]
        assert trained > base, (name, base, trained)
    agents = evaluate_run(run_dir)
    assert set(agents) == set(AGENTS)
    for name, r in agents.items():
        assert r["trained"] > r["base"], (name, r)
