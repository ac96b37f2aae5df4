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
    examples = tmp_path / "examples" / "multi_lora"
    examples.mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "multi_lora" / script, examples / script)
    (examples / "provision.sh").write_text('echo "provision.sh $*"\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "rl-multilora").write_text('#!/usr/bin/env bash\necho "rl-multilora $*"\n')
    (bin_dir / "rl-multilora").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(["bash", str(examples / script), *args], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == f"rl-multilora {called}", out.stdout
