"""One process trains into a run dir at a time: a second `run` (or `serve`) of the same run dir exits 2 naming the
process that holds it, before it writes anything there. Two runs of one run dir used to both exit 0, having
deleted each other's metrics rows and written each other's checkpoints and run state (a reviewer's repro)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import yaml

from rl_multilora import service
from rl_multilora.checkpoint import hold_run_dir
from rl_multilora.cli import main as cli_main
from tests.test_resume import _config, workspace  # noqa: F401 - fixtures


def test_a_second_process_in_a_run_dir_is_refused_naming_the_first(workspace, tmp_path, capsys, monkeypatch):  # noqa: F811
    run_dir = tmp_path / "run"
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(_config(workspace, run_dir, max_global_steps=1)))
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from pathlib import Path
            from rl_multilora.checkpoint import hold_run_dir
            held = hold_run_dir(Path({str(run_dir)!r}))
            print("held", flush=True)
            time.sleep(120)
        """)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        assert cli_main(["run", str(path)]) == 2  # after waiting 10 s for the holder to go
        err = capsys.readouterr().err
        assert f"run_dir='{run_dir}' is not allowed" in err and f"pid {holder.pid} on " in err, err
        assert "Traceback" not in err
        assert not (run_dir / "config.yaml").exists() and not (run_dir / "metrics.jsonl").exists()
        # `serve` says so before it starts a Ray cluster: its actor's refusal came about 30 s later, behind Ray's copy
        # of the actor's traceback (a reviewer's find)
        pytest.importorskip("ray")
        monkeypatch.setattr(service, "_ray_init", lambda *a, **k: pytest.fail("serve started Ray"))
        assert cli_main(["serve", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"run_dir='{run_dir}' is not allowed" in err and f"pid {holder.pid} on " in err, err
        assert "Traceback" not in err
    finally:
        holder.kill()
        holder.wait()
    assert cli_main(["run", str(path)]) == 0  # the holder gone, the run trains
    assert (run_dir / "metrics.jsonl").exists()
    assert cli_main(["run", str(path)]) == 0  # one process, runs one after another: the lock is released each time
    first = hold_run_dir(run_dir)
    second = hold_run_dir(run_dir, wait_s=0)  # re-entrant within a process
    second.release()
    first.release()


def test_a_second_tinker_server_on_a_state_dir_is_refused(tmp_path):
    """The same for `tinker-serve --state-dir`: two servers replayed one journal and wrote one set of checkpoints."""
    from rl_multilora.tinker.server import build_server
    from tests.tiny_models import save_tiny_model

    model = tmp_path / "model"
    save_tiny_model(model, hidden=32, layers=2)
    state = tmp_path / "state"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; from pathlib import Path; from rl_multilora.checkpoint import "
         f"hold_run_dir; held = hold_run_dir(Path({str(state)!r})); print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=f"--state-dir='{state}' is not allowed.*pid {holder.pid} on "):
            build_server(str(model), state, "tml-lock-test")
    finally:
        holder.kill()
        holder.wait()
    build_server(str(model), state, "tml-lock-test")  # the holder gone


def test_a_run_dir_that_cannot_be_created_is_named(tmp_path):
    """`run_dir: /proc/x` said only `[Errno 2] No such file or directory: '/proc/x'` (a reviewer's repro)."""
    from rl_multilora.config import ConfigError

    blocked = tmp_path / "a_file"
    blocked.write_text("")
    with pytest.raises(ConfigError, match=r"run_dir='.*a_file/run' is not allowed; allowed: a folder this user can"):
        hold_run_dir(blocked / "run")
