"""rollout.mode async: the next step's rollouts generate while a step trains, each tenant's samples lag at most its
max_staleness versions, publishing pauses no one, budgets still end where they should, and a run SIGKILLed in
async mode resumes without losing a trained step.

Three tenants on a tiny model: t1 may lag one version (the run's default), t2 is strictly on-policy
(max_staleness 0), t3 has a data budget (one epoch of 10 rows), so it also checks that groups drawn ahead do not
retire a tenant before they are trained.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rl_multilora.checkpoint import CKPT_META, CheckpointManager
from rl_multilora.cli import main as cli_main
from rl_multilora.config import ConfigError, parse_run_config
from rl_multilora.loop import run
from rl_multilora.metrics import read_metrics
from tests.tiny_models import save_tiny_model, sum_task_adapter, write_sum_task

REPO = Path(__file__).resolve().parents[1]
BUDGETS = {"t1": 6, "t2": 4, "t3": 5}  # t3: 10 rows / 2 prompts per step


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("async")
    save_tiny_model(root / "model", hidden=32, layers=2)
    for name, n, offset in [("t1", 40, 1), ("t2", 40, 3), ("t3", 10, 5)]:
        write_sum_task(root / "data" / f"{name}.jsonl", n, offset)
    return root


def _config(root: Path, run_dir: Path, mode: str = "async", **over) -> dict:
    data = root / "data"
    cfg = {
        "run_dir": str(run_dir),
        "model": {"path": str(root / "model"), "max_loras": 3, "max_rank": 8},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 6, "mode": mode},
        "grpo": {"micro_batch_size": 8, "drop_uniform_groups": False},
        "checkpoint": {"save_every": 2, "keep_last": 2},
        "logging": {"plot": False, "progress": False},
        "rewards": {"num_workers": 1},
        "adapters": [
            sum_task_adapter(data, "t1", 7, max_steps=6),
            sum_task_adapter(data, "t2", 11, max_steps=4, **({"max_staleness": 0} if mode == "async" else {})),
            sum_task_adapter(data, "t3", 12, epochs=1.0, max_steps=20),
        ],
    }
    cfg.update(over)
    return cfg


def _series(run_dir: Path, name: str) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r.get("adapter") == name and r.get("kind") != "eval"]


def test_async_run_bounds_each_tenants_staleness_and_publishes_without_a_pause(workspace, tmp_path):
    run_dir = tmp_path / "run"
    rt = run(parse_run_config(_config(workspace, run_dir)))
    for name, budget in BUDGETS.items():
        t = rt.tenants.get(name)
        assert t.state.value == "REMOVED" and t.adapter_step == budget, (name, t.state, t.adapter_step)
    lagged = []
    for name in BUDGETS:
        rows = _series(run_dir, name)
        assert [r["adapter_step"] for r in rows] == list(range(1, BUDGETS[name] + 1)), name
        for r in rows:
            assert r["stale_samples"] == 0 and r["pause_s"] == 0.0  # nothing older than its bound; no pause
            assert 0 <= r["version_lag_max"] <= (0 if name == "t2" else 1), (name, r)
            lagged += [r["version_lag_max"]] if name != "t2" else []
    # The rollout really ran ahead: most steps after the first trained on samples of the version before.
    assert sum(lag == 1 for lag in lagged) >= len(lagged) // 2, lagged


def test_max_staleness_is_refused_in_a_sync_run_and_must_be_a_count(workspace, tmp_path, capsys):
    cfg = _config(workspace, tmp_path / "run", mode="sync")
    cfg["adapters"][0]["max_staleness"] = 2
    with pytest.raises(ConfigError, match=r"adapters\.t1\.max_staleness.*2.*null unless rollout\.mode is 'async'"):
        parse_run_config(cfg)
    cfg = _config(workspace, tmp_path / "run")
    cfg["rollout"]["max_staleness"] = -1
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cli_main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "rollout.max_staleness" in err and "Traceback" not in err


def test_async_run_killed_then_resumed_loses_no_trained_step(workspace, tmp_path):
    run_dir = tmp_path / "run"
    cfg = _config(workspace, run_dir)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fault_plugins", "train:9", "run", str(path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    saved = {}
    for name in BUDGETS:
        latest = CheckpointManager(run_dir).latest(name)
        saved[name] = 0 if latest is None else int(yaml.safe_load((latest / CKPT_META).read_text())["adapter_step"])
    assert any(saved.values())  # the kill came after some checkpoints
    rt = run(parse_run_config(cfg))
    for name, budget in BUDGETS.items():
        t = rt.tenants.get(name)
        assert t.state.value == "REMOVED" and t.adapter_step == budget, (name, t.adapter_step)
        # every adapter step trained and logged exactly once across the two processes: the steps after the last
        # checkpoint were dropped from the metrics and trained again, none before it
        assert [r["adapter_step"] for r in _series(run_dir, name)] == list(range(1, budget + 1)), name
        meta = yaml.safe_load((CheckpointManager(run_dir).latest(name) / CKPT_META).read_text())
        assert meta["adapter_step"] == budget


def test_async_run_stopped_at_max_global_steps_with_a_rollout_ahead_resumes_every_step_once(workspace, tmp_path):
    """The stop comes while the next step's rollout is generating: the run still exits, its checkpoints hold the
    cursor from before those groups, and the resumed run trains every adapter step exactly once."""
    run_dir = tmp_path / "run"
    cfg = _config(workspace, run_dir)
    first = run(parse_run_config(dict(cfg, max_global_steps=3)))
    assert first._ahead is None and first.tenants.get("t1").adapter_step == 3
    rt = run(parse_run_config(cfg))
    for name, budget in BUDGETS.items():
        assert rt.tenants.get(name).adapter_step == budget, name
        assert [r["adapter_step"] for r in _series(run_dir, name)] == list(range(1, budget + 1)), name


def test_a_row_cap_holds_for_steps_drawn_in_two_parts(workspace, tmp_path):
    """rollout.max_rows_per_step caps a step's rows in async mode too: the groups drawn ahead and those drawn at
    the step's start (the strict tenant's) are fair shares of one cap, never two caps."""
    run_dir = tmp_path / "run"
    cfg = _config(workspace, run_dir)
    cfg["rollout"]["max_rows_per_step"] = 12  # 3 tenants ask 2 groups x 4 rows each: one group each fits
    run(parse_run_config(dict(cfg, max_global_steps=4)))
    per_step: dict[int, int] = {}
    for r in read_metrics(run_dir):
        if r.get("kind") != "eval":
            per_step[r["step"]] = per_step.get(r["step"], 0) + r["n_samples"]
    assert per_step and all(n <= 12 for n in per_step.values()), per_step
    assert max(per_step.values()) == 12


def _spied_runtime(cfg: dict):
    """A built async Runtime whose trainer records each step's (adapter, prompt, group) rows."""
    from rl_multilora.loop import Runtime

    rt = Runtime.build(parse_run_config(cfg))
    steps: list[list[tuple]] = []
    train_step = rt.backend.train_step

    def spy(samples, *args, **kwargs):
        steps.append([(s.adapter.name, s.prompt, s.group_index) for s in samples if s.adapter is not None])
        return train_step(samples, *args, **kwargs)

    rt.backend.train_step = spy
    rt.start(checked=True)
    return rt, steps


def test_a_tenant_that_leaves_gives_back_its_look_ahead_and_a_new_one_of_its_name_draws_its_own(workspace, tmp_path):
    """Reviewers' repros, both with a rollout ahead in flight when a tenant left: (1) the service went idle,
    the name was submitted again on another dataset, and the new tenant trained the old one's samples (the look-ahead
    was matched by name); (2) a tenant drained beside a running one took a final checkpoint whose data cursor was
    past the groups drawn ahead for it and never trained (a resume on it would skip them for good)."""
    import json

    from rl_multilora.config import AdapterConfig

    write_sum_task(tmp_path / "data2" / "t1.jsonl", 40, 50)  # the new t1's prompts start at "50+"
    cfg = _config(workspace, tmp_path / "run1")
    cfg["adapters"] = [sum_task_adapter(workspace / "data", "t1", 7, max_steps=50)]
    rt, steps = _spied_runtime(cfg)
    try:
        rt.step()  # t1 trains; its next groups are drawn and generated ahead
        assert rt._ahead is not None and rt._ahead.names == {"t1"}
        rt.remove("t1")
        rt.idle_step()  # nothing runs: the service's idle turn retires t1
        rt.register(AdapterConfig.model_validate(sum_task_adapter(tmp_path / "data2", "t1", 7, max_steps=50)))
        rt.idle_step()  # admits the new t1
        rt.step()
        assert steps[-1] and all(int(p.split("+")[0].split(">")[-1]) >= 50 for _, p, _ in steps[-1]), steps[-1]
    finally:
        rt.close()

    cfg = _config(workspace, tmp_path / "run2")
    cfg["adapters"] = [sum_task_adapter(workspace / "data", n, s, max_steps=50) for n, s in (("t1", 7), ("t2", 8))]
    rt, steps = _spied_runtime(cfg)
    try:
        rt.step()
        rt.remove("t1")
        rt.step()  # t2 trains; t1 is drained and checkpointed at the end of the step
        trained = len({g for step in steps for name, _, g in step if name == "t1"})
        t1 = rt.tenants.get("t1")
        data = json.loads((Path(t1.last_checkpoint) / "data_state.json").read_text())
        assert t1.state.value == "REMOVED" and data["group_counter"] == trained == 2, (data, trained)
    finally:
        rt.close()
