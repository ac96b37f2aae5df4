"""The example scripts hand their arguments on as their usage lines say: a first argument is the config only when it is
not a flag. Each runs in a copy of examples/multi_lora/ whose provision.sh and `rl-multilora` only print what they
were called with, so nothing is provisioned or trained."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = "examples/multi_lora/configs/tiny.yaml"
SERVICE = "examples/multi_lora/configs/service.yaml"


@pytest.mark.parametrize(
    ("script", "args", "called"),
    [
        ("single_run.sh", [], f"run {TINY}"),
        ("single_run.sh", ["--set", "adapters.gsm8k.lr=1e-3"], f"run {TINY} --set adapters.gsm8k.lr=1e-3"),
        ("single_run.sh", ["my.yaml", "--set", "a=1"], "run my.yaml --set a=1"),
        ("start_service.sh", [], f"serve {SERVICE}"),
        ("start_service.sh", ["--address", "10.0.0.1:6379"], f"serve {SERVICE} --address 10.0.0.1:6379"),
        ("start_service.sh", ["svc.yaml", "--set", "a=1"], "serve svc.yaml --set a=1"),
    ],
)
def test_a_leading_flag_is_not_taken_for_the_config(tmp_path, script, args, called):
    out = _run_copy(tmp_path, script, args)
    assert out.stdout.splitlines()[-1] == f"rl-multilora {called}", out.stdout


def _run_copy(tmp_path: Path, script: str, args: list[str], cwd: Path | None = None, **env_over: str):
    """`script` from a copy of examples/multi_lora/ whose provision.sh and `rl-multilora` (and a PYTHON, when given)
    only print what they were called with."""
    examples = tmp_path / "examples" / "multi_lora"
    examples.mkdir(parents=True, exist_ok=True)
    for name in (script, "cli.sh"):
        shutil.copy(ROOT / "examples" / "multi_lora" / name, examples / name)
    (examples / "provision.sh").write_text('echo "provision.sh $*"\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("rl-multilora", "python-stand-in"):
        (bin_dir / name).write_text(f'#!/usr/bin/env bash\necho "{name} $*"\n')
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **env_over)
    out = subprocess.run(
        ["bash", str(examples / script), *args], env=env, capture_output=True, text=True, timeout=30, cwd=cwd
    )
    assert out.returncode == 0, out.stderr
    return out


def test_single_run_takes_a_config_relative_to_the_caller_a_python_and_provisions_only_tiny(tmp_path):
    """A reviewer's cases: a relative CONFIG was looked up in the checkout (cd first), PYTHON ran the provisioning
    but not the training (a stale console script on PATH ran it), and any config provisioned artifacts/tiny."""
    here = tmp_path / "elsewhere"
    here.mkdir()
    (here / "mine.yaml").write_text("model:\n  path: artifacts/tiny-moe/model\n")
    out = _run_copy(tmp_path, "single_run.sh", ["mine.yaml"], cwd=here)
    assert out.stdout.splitlines()[-1] == f"rl-multilora run {here / 'mine.yaml'}"
    assert "provision.sh" not in out.stdout and "does not train on artifacts/tiny" in out.stdout
    (here / "tiny.yaml").write_text("model:\n  path: ./artifacts/tiny/model\n")
    python = str(tmp_path / "bin" / "python-stand-in")
    out = _run_copy(tmp_path, "single_run.sh", ["tiny.yaml"], cwd=here, PYTHON=python)
    assert "provision.sh artifacts/tiny" in out.stdout
    assert out.stdout.splitlines()[-1] == f"python-stand-in -m rl_multilora.cli run {here / 'tiny.yaml'}"
