"""The oldest and the newest supported `tinker` SDK release, each in a venv of its own holding only the SDK and its
declared dependencies, drive a server started from this repository's venv (tests/sdk_versions.sh): create,
forward, forward_backward + optim_step, save_state, sampler weights, sample. The releases between them run with
`tests/sdk_versions.sh` (all five: about 3 minutes a fresh venv, seconds once made; docs/guides/tinker.md).

Slow: a fresh venv installs the SDK and its dependencies (transformers among them) from the package registry; the
script keeps the venvs in $SDK_VENVS (default ~/.cache/rl-multilora/sdk-venvs) and reuses them. A release the
registry does not hold is skipped, naming it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "sdk_versions.sh"
OLDEST, NEWEST = "0.16.1", "0.38.0"  # the supported range's ends (SUPPORTED in the script)


def test_script_supports_the_range_the_docs_state():
    supported = next(line for line in SCRIPT.read_text().splitlines() if line.startswith("SUPPORTED="))
    versions = supported.split("(", 1)[1].split(")", 1)[0].split()
    assert versions[0] == OLDEST and versions[-1] == NEWEST
    assert f"`>={OLDEST},<0.39`" in (ROOT / "docs" / "guides" / "tinker.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_sdk_release_in_its_own_venv_runs_a_session(version):
    done = subprocess.run(["bash", str(SCRIPT), version], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    if done.returncode == 3:
        pytest.skip(f"tinker=={version} is not installable from the package registry: {done.stdout[-500:]}")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith(f"ok {version} "))
    report = json.loads(line.split(" ", 2)[2])
    assert report["sdk"] == version
    assert report["losses"][-1] < report["losses"][0] and len(report["sampled"]) == 2
