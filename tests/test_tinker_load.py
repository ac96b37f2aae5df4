"""bench/bench_tinker_load.py, short (slow): SDK clients at once, the server SIGKILLed in the middle and restarted;
every call answered, and each client's final checkpoint holds exactly the optim_steps it was answered."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.test_tinker_server import ROOT


@pytest.mark.slow
def test_load_with_a_kill_9_in_the_middle_loses_no_acknowledged_request(tmp_path):
    preset = ROOT / "artifacts" / "tiny"
    subprocess.run(["bash", str(ROOT / "examples/multi_lora/provision.sh"), str(preset)], check=True, cwd=ROOT)
    out = tmp_path / "report.json"
    cmd = [sys.executable, str(ROOT / "bench/bench_tinker_load.py"), "--model", str(preset / "model"),
           "--clients", "8", "--duration", "26", "--kill-at", "7", "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=85)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["errors"] == [] and r["lost_steps"] == 0
    assert len(r["steps_saved"]) == 8 and r["steps_saved"] == r["steps_answered"]
    assert r["killed_at"] is not None and r["back_at"] > r["killed_at"]
    # the clients were answered before the kill and went on after the restart
    assert r["answered_before_kill"] >= 8 and r["begun_after_restart"] >= 8 and r["all"]["sample"]["answered"] >= 8
