"""Exact resume: a run stopped or SIGKILLed anywhere and resumed ends where an uninterrupted run ends; export.

Three tenants with different budgets (t1: 6 steps, t2: 4 steps, t3: one epoch of a 10-row dataset = 5 steps), so
kills land while some tenants are already DRAINED. "The same" means every tensor of each adapter's final PEFT folder
and optimizer state, its scheduler/step counters, its data cursor, and its metrics series keyed by adapter step.
Killed runs are subprocesses (`python -m tests.fault_plugins POINT:N run CFG`); resumes run in this process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from rl_multilora.checkpoint import CKPT_META, CheckpointManager, RunStateError, list_checkpoints
from rl_multilora.cli import main as cli_main
from rl_multilora.config import parse_run_config
from rl_multilora.loop import Runtime, run
from rl_multilora.metrics import read_metrics
from tests.tiny_models import save_tiny_model, sum_task_adapter, write_sum_task

REPO = Path(__file__).resolve().parents[1]
NAMES = ("t1", "t2", "t3")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("resume")
    save_tiny_model(root / "model", hidden=32, layers=2)
    write_sum_task(root / "data" / "t1.jsonl", 40, 1)
    write_sum_task(root / "data" / "t2.jsonl", 40, 3)
    write_sum_task(root / "data" / "t3.jsonl", 10, 5)
    return root


def _config(root: Path, run_dir: Path, **over) -> dict:
    def adapter(name: str, rank: int, seed: int, **budget) -> dict:
        optim = {"schedule": "cosine", "warmup_steps": 1}
        return sum_task_adapter(root / "data", name, seed, rank=rank, optim=optim, **budget)

    cfg = {
        "run_dir": str(run_dir),
        "model": {"path": str(root / "model"), "max_loras": 3, "max_rank": 8},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 6},
        "grpo": {"micro_batch_size": 8, "drop_uniform_groups": False},
        "checkpoint": {"save_every": 2, "keep_last": 2},
        "logging": {"plot": False, "progress": False},
        "rewards": {"num_workers": 1},
        "adapters": [
            adapter("t1", 4, 7, max_steps=6),
            adapter("t2", 8, 11, max_steps=4),
            adapter("t3", 2, 12, epochs=1.0, max_steps=20),
        ],
    }
    cfg.update(over)
    return cfg


@pytest.fixture(scope="module")
def reference(workspace, tmp_path_factory) -> Path:
    """An uninterrupted run: the ground truth every resumed run must reproduce."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    run(parse_run_config(_config(workspace, run_dir)))
    return run_dir


def _series(run_dir: Path, name: str) -> list[tuple]:
    """An adapter's metrics rows as (adapter_step, reward_mean, loss, lr, weight_version), in logged order."""
    return [
        (r["adapter_step"], r["reward_mean"], r.get("loss"), r.get("lr"), r["weight_version"])
        for r in read_metrics(run_dir)
        if r["adapter"] == name
    ]


def assert_same_as_reference(run_dir: Path, reference: Path) -> None:
    state = json.loads((run_dir / "run_state.json").read_text())
    assert {n: s["state"] for n, s in state["adapters"].items()} == {n: "REMOVED" for n in NAMES}
    for name in NAMES:
        got, want = CheckpointManager(run_dir).latest(name), CheckpointManager(reference).latest(name)
        meta_got, meta_want = (json.loads((d / CKPT_META).read_text()) for d in (got, want))
        assert meta_got["adapter_step"] == meta_want["adapter_step"], name
        for f in ("adapter_model.safetensors", "optimizer.safetensors"):
            a, b = load_file(str(got / f)), load_file(str(want / f))
            assert a.keys() == b.keys(), (name, f)
            for k in b:
                torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7, msg=f"{name}/{f}/{k}")
        # Scheduler state, step counters and the data cursor are plain JSON: they must be identical.
        for f in ("optimizer.json", "data_state.json", "adapter_config.json"):
            assert json.loads((got / f).read_text()) == json.loads((want / f).read_text()), (name, f)
        got_rows, want_rows = _series(run_dir, name), _series(reference, name)
        assert [r[0] for r in got_rows] == [r[0] for r in want_rows], name  # each adapter step logged once
        # pytest.approx takes flat sequences only (pytest >= 9.1 rejects nested tuples).
        flat = [x for row in got_rows for x in row]
        assert flat == pytest.approx([x for row in want_rows for x in row], rel=1e-5, abs=1e-7), name


def _run_killed(cfg: dict, kill_at: str, tmp_path: Path) -> str:
    """Run `rl-multilora run` in a subprocess that SIGKILLs itself at `kill_at`; returns its stderr."""
    path = tmp_path / f"config-{kill_at.replace(':', '-')}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fault_plugins", kill_at, "run", str(path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, f"expected a SIGKILL at {kill_at}, got {proc.returncode}\n{proc.stderr}"
    return proc.stderr


def test_stop_then_resume_ignores_half_written_checkpoints_and_matches(workspace, reference, tmp_path):
    run_dir = tmp_path / "run"
    cfg = _config(workspace, run_dir)
    run(parse_run_config(dict(cfg, max_global_steps=3)))  # stops after 3 global steps: t1 at adapter step 3
    t1 = run_dir / "adapters" / "t1"
    # step 2 is the periodic save; step 3 the stop's (nothing trained is lost when max_global_steps ends a run)
    assert [s for s, _ in list_checkpoints(t1)] == [2, 3]
    # What a crash mid-save can leave: a temp folder that looks complete, and a folder without checkpoint.json.
    # Both claim a newer step, with weights that would be wrong; resume must use step_3.
    for fake, step in [(".tmp-step_5-x1", 5), ("step_4", 4)]:
        shutil.copytree(t1 / "step_3", t1 / fake)
        zeros = {k: torch.zeros_like(v) for k, v in load_file(str(t1 / fake / "adapter_model.safetensors")).items()}
        save_file(zeros, str(t1 / fake / "adapter_model.safetensors"))
        meta = json.loads((t1 / fake / CKPT_META).read_text()) | {"adapter_step": step}
        (t1 / fake / CKPT_META).write_text(json.dumps(meta))
    (t1 / "step_4" / CKPT_META).unlink()
    rows_before = len(read_metrics(run_dir))
    assert rows_before == 9

    rt = run(parse_run_config(cfg))  # checkpoint.resume: auto
    assert rt.tenants.global_step > 3  # it continued from the run state, it did not start over
    assert not list(t1.glob(".tmp-*"))  # stale temp folders are cleaned up on resume
    assert_same_as_reference(run_dir, reference)


def _kill_then_resume(workspace, reference, tmp_path, kill_points: list[str]) -> None:
    run_dir = tmp_path / "run"
    cfg = _config(workspace, run_dir)
    for kill_at in kill_points:  # each killed process resumes what the previous one left
        _run_killed(cfg, kill_at, tmp_path)
        assert (run_dir / "metrics.jsonl").is_file()
        if kill_at.startswith("checkpoint"):  # killed mid-write: the half-written temp folder is still there
            assert list((run_dir / "adapters").glob("*/.tmp-step_*"))
    run(parse_run_config(cfg))
    assert_same_as_reference(run_dir, reference)


def test_kill_during_checkpoint_write_then_resume_matches(workspace, reference, tmp_path):
    # Checkpoints 1-3 are step 2 of every tenant; the 5th is written while t2 drains at its budget (step 4).
    _kill_then_resume(workspace, reference, tmp_path, ["checkpoint:5"])


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["rollout:30", "train:8"])
def test_kill_during_rollout_or_training_then_resume_matches(workspace, reference, tmp_path, kill_at):
    # 24 samples and 3 optimizer steps per global step: rollout:30 is mid-step 1, train:8 mid-step 2.
    _kill_then_resume(workspace, reference, tmp_path, [kill_at])


@pytest.mark.slow
def test_killed_three_times_then_resume_matches(workspace, reference, tmp_path):
    # Every resumed process is killed again at another kind of point, then the last one finishes.
    _kill_then_resume(workspace, reference, tmp_path, ["rollout:40", "train:5", "checkpoint:2"])


def test_a_service_step_that_fails_half_way_is_not_checkpointed_and_resume_redoes_it(workspace, reference, tmp_path):
    """The service stops training on a failing step and checkpoints at its stop: not that step's half-applied
    state (here the optimizers stepped, then the step raised), which a checkpoint would record as done (an optimizer
    step ahead of the adapter's step count, prompts drawn but never trained on). Resume redoes the step."""
    from rl_multilora.service import ServiceCore

    run_dir = tmp_path / "run"
    cfg = parse_run_config(_config(workspace, run_dir))
    rt = Runtime.build(cfg)
    train_step, calls = rt.backend.train_step, []

    def fails_on_the_fourth(*args, **kwargs):
        stats = train_step(*args, **kwargs)  # the optimizers step ...
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("boom after the optimizer step")  # ... then something after them fails
        return stats

    rt.backend.train_step = fails_on_the_fourth
    rt.start()
    core = ServiceCore(rt, poll_s=0.05)
    core.start()
    deadline = time.monotonic() + 120
    while core.status().error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert core.status().error == "RuntimeError: boom after the optimizer step"
    with pytest.raises(RuntimeError, match="global step 3 failed before it was done"):
        rt.step()  # the runtime refuses to go on from a half-applied step
    core.stop(timeout=30)
    assert json.loads((run_dir / "run_state.json").read_text())["global_step"] == 3
    for name in NAMES:  # step 2's periodic checkpoints stay the latest: the stop did not commit step 3
        assert [s for s, _ in list_checkpoints(run_dir / "adapters" / name)] == [2], name

    run(cfg)  # resume redoes global step 3 and goes on
    assert_same_as_reference(run_dir, reference)


def test_finished_run_is_not_retrained_nor_an_adapter_resumed_at_its_budget(workspace, reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    # t2 RUNNING with a finished checkpoint at its budget (as when max_steps is lowered before resuming):
    # it must leave at once rather than train one step past the budget.
    state = json.loads((run_dir / "run_state.json").read_text())
    state["adapters"]["t2"]["state"] = "RUNNING"
    (run_dir / "run_state.json").write_text(json.dumps(state))
    before = {n: sorted(p.name for p in (run_dir / "adapters" / n).iterdir()) for n in NAMES}
    rows = len(read_metrics(run_dir))
    rt = run(parse_run_config(_config(workspace, run_dir)))
    # t2 resumed at its budget and left at once; t1 and t3 stayed finished; nothing trained, nothing was saved.
    assert {n: r.state.value for n, r in rt.tenants.tenants.items()} == {n: "REMOVED" for n in NAMES}
    assert rt.tenants.global_step == state["global_step"]
    assert {n: sorted(p.name for p in (run_dir / "adapters" / n).iterdir()) for n in NAMES} == before
    assert len(read_metrics(run_dir)) == rows
    assert_same_as_reference(run_dir, reference)


def test_fresh_archives_the_previous_run_and_resume_requires_one(workspace, reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    rt = Runtime.build(parse_run_config(_config(workspace, run_dir, checkpoint={"resume": "never"})))
    try:
        rt.start()
        assert {r.state.value for r in rt.tenants.tenants.values()} == {"RUNNING"}
        assert rt.tenants.global_step == 0 and all(r.adapter_step == 0 for r in rt.tenants.tenants.values())
    finally:
        rt.close()
    (archive,) = (run_dir / "archive").iterdir()
    assert list_checkpoints(archive / "adapters" / "t1") and (archive / "run_state.json").is_file()
    assert len(read_metrics(archive)) == len(read_metrics(reference)) and read_metrics(run_dir) == []
    assert not (run_dir / "adapters").exists() or not any((run_dir / "adapters").iterdir())

    empty = tmp_path / "empty"
    with pytest.raises(FileNotFoundError, match="resume: 'always'"):
        Runtime.build(parse_run_config(_config(workspace, empty, checkpoint={"resume": "always"}))).start()


def test_a_resume_with_a_changed_lr_trains_at_the_new_one_on_the_same_schedule(workspace, reference, tmp_path):
    """The checkpoint restored the saved learning rate, so a resume with a new `lr` (allowed: only rank, alpha,
    targets and seed must match) went on at the old one, silently. Now the new base follows the schedule from the
    restored step; an unchanged tenant's rates are the uninterrupted run's, bit for bit."""
    run_dir = tmp_path / "run"
    run(parse_run_config(_config(workspace, run_dir, max_global_steps=2)))
    cfg = _config(workspace, run_dir)
    cfg["adapters"][0]["lr"] = cfg["adapters"][0].get("lr", 1e-2) / 100
    run(parse_run_config(cfg))

    def lrs(run_dir: Path, name: str) -> dict[int, float]:
        return {r["adapter_step"]: r["lr"] for r in read_metrics(run_dir) if r["adapter"] == name and "lr" in r}

    ref, got = lrs(reference, "t1"), lrs(run_dir, "t1")
    assert set(got) == set(ref) and len(ref) == 6
    for step in ref:
        assert got[step] == pytest.approx(ref[step] / 100 if step > 2 else ref[step], rel=1e-12), step
    assert lrs(run_dir, "t2") == lrs(reference, "t2")


def test_resume_refuses_a_changed_rank(workspace, reference, tmp_path):
    from rl_multilora.config import ConfigError

    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    (run_dir / "run_state.json").unlink()  # the adapters would otherwise be DRAINED and never restored
    cfg = _config(workspace, run_dir)
    cfg["adapters"][0]["rank"] = 8
    rt = Runtime.build(parse_run_config(cfg))
    try:
        with pytest.raises(
            ConfigError,
            match=r"adapters\.t1\.rank=8 is not allowed; allowed: 4, what the checkpoint .* was trained with",
        ):
            rt.start()
    finally:
        rt.close()


def test_a_resume_on_another_base_is_refused_before_anything_is_touched(workspace, reference, tmp_path, capsys):
    """A reviewer's case: resuming a run dir with model.path on a base of other shapes passed --dry-run, then set the
    good checkpoints aside as damaged and failed the adapters (and a later resume on the right base refused them).
    The run state records its base; another one is refused first, naming model.path and the run's base. The same
    base moved to another folder resumes."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    recorded = json.loads((run_dir / "run_state.json").read_text())["base"]
    assert recorded["path"] == str((workspace / "model").resolve()) and len(recorded["fingerprint"]) == 64
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    other = save_tiny_model(tmp_path / "other", hidden=16, layers=2)
    cfg = _config(workspace, run_dir, model={"path": str(other), "max_loras": 3, "max_rank": 8})
    config_file = tmp_path / "other.yaml"
    config_file.write_text(yaml.safe_dump(cfg))
    for extra in (["--dry-run"], []):
        assert cli_main(["run", str(config_file), *extra]) == 2
        err = capsys.readouterr().err
        assert f"model.path={str(other)!r} is not allowed; allowed: the base this run dir was trained on" in err, err
        assert str(workspace / "model") in err and "Traceback" not in err
    with pytest.raises(RunStateError, match=r"model.path=.* \(its config or weight shapes differ"):
        Runtime.build(parse_run_config(cfg)).start()  # the Python API refuses too, before any checkpoint is read
    after = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    assert [p for p in after if p not in before] in ([], ["config.yaml"]) and not list(run_dir.rglob(".damaged-*"))
    moved = tmp_path / "moved"
    shutil.copytree(workspace / "model", moved)
    rt = run(parse_run_config(_config(workspace, run_dir, model={"path": str(moved), "max_loras": 3, "max_rank": 8})))
    assert {r.state.value for r in rt.tenants.tenants.values()} == {"REMOVED"}  # finished; nothing retrained
    assert_same_as_reference(run_dir, reference)


def test_exported_adapter_loads_in_peft_with_the_slot_logits(workspace, reference, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rl_multilora.lora import MultiLoRAModel

    out = tmp_path / "t1_export"
    assert cli_main(["export", str(reference), "t1", str(out)]) == 0
    latest = CheckpointManager(reference).latest("t1")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (out / "adapter_model.safetensors").read_bytes() == (latest / "adapter_model.safetensors").read_bytes()
    assert cli_main(["export", str(reference), "t1", str(tmp_path / "old"), "--step", "4"]) == 0
    old = load_file(str(tmp_path / "old" / "adapter_model.safetensors"))
    new = load_file(str(out / "adapter_model.safetensors"))
    assert any(not torch.equal(old[k], new[k]) for k in new)  # step 4 is not step 6
    assert cli_main(["export", str(reference), "nope", str(tmp_path / "x")]) == 2
    assert "no complete checkpoint of adapter 'nope'" in capsys.readouterr().err

    ids = torch.tensor([[5, 17, 42, 9, 77, 3, 60, 21]])
    model_path = workspace / "model"
    ml = MultiLoRAModel.from_pretrained(model_path, max_loras=2, max_rank=8, target_modules="all-linear")
    ml.add_adapter("other", rank=8, alpha=16, seed=3)  # t1 lands in slot 1, beside another tenant
    ml.load_adapter("t1", latest)
    ml.eval()
    with torch.no_grad():
        slot_logits = ml(ids, adapter_names=["t1"]).logits  # (1, T, vocab)
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path), out).eval()
        peft_logits = peft(input_ids=ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(model_path).eval()(input_ids=ids).logits
    assert not torch.allclose(peft_logits, base_logits, atol=1e-4)  # the adapter changes the output
    torch.testing.assert_close(slot_logits, peft_logits, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_external_sigkill_at_a_random_moment_then_resume_matches(workspace, reference, tmp_path):
    """A plain `rl-multilora run` killed from outside, at a random moment of a random step, twice."""
    import random
    import time

    run_dir = tmp_path / "run"
    cfg = _config(workspace, run_dir)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    rng = random.Random(1234)
    for _ in range(2):
        # Wait for rows of a step this process trained (the first rows may be the previous process's), then kill.
        target = len(read_metrics(run_dir)) + 3  # the full run logs 15 rows: both kills land well before the end
        proc = subprocess.Popen(
            [sys.executable, "-m", "rl_multilora.cli", "run", str(path)],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            while proc.poll() is None and len(read_metrics(run_dir)) < target:
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.25))  # a step takes ~0.3-1 s here: kill somewhere in the next one
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
    run(parse_run_config(cfg))
    assert_same_as_reference(run_dir, reference)


def test_metrics_rollback_is_in_place_and_finishes_an_interrupted_rewrite(tmp_path):
    from rl_multilora.checkpoint import METRICS_JOURNAL, prune_metrics

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "adapter": a, "adapter_step": s + 1, "reward_mean": 0.5} for s in range(4) for a in "ab"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "adap')  # a row torn by a kill
    logger_handle = path.open("a")  # what MetricsLogger holds while the run resumes
    assert prune_metrics(tmp_path, {"a": 1}) == 3  # a's steps 2 and 3, and the torn row
    logger_handle.write(json.dumps({"step": 4, "adapter": "a", "adapter_step": 3, "reward_mean": 1.0}) + "\n")
    logger_handle.close()
    got = [(r["step"], r["adapter"]) for r in read_metrics(tmp_path)]
    assert got == [(0, "a"), (0, "b"), (1, "a"), (1, "b"), (2, "b"), (3, "b"), (4, "a")]
    # A kill between writing the journal and copying it over: the next call finishes the copy.
    (tmp_path / METRICS_JOURNAL).write_text(json.dumps(rows[0]) + "\n")
    assert prune_metrics(tmp_path, {}) == 0
    assert read_metrics(tmp_path) == [rows[0]] and not (tmp_path / METRICS_JOURNAL).exists()
    assert prune_metrics(tmp_path, {"b": None}) == 0 and prune_metrics(tmp_path, {"a": None}) == 1
    assert read_metrics(tmp_path) == []


def test_raising_a_finished_adapters_budget_trains_it_further(workspace, reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    cfg = _config(workspace, run_dir)
    cfg["adapters"][1]["max_steps"] = 5  # t2 finished at 4
    rt = run(parse_run_config(cfg))
    assert {n: (r.state.value, r.adapter_step) for n, r in rt.tenants.tenants.items()} == {
        "t1": ("REMOVED", 6),
        "t2": ("REMOVED", 5),
        "t3": ("REMOVED", 5),
    }
    assert [r[0] for r in _series(run_dir, "t2")] == [1, 2, 3, 4, 5]
    assert _series(run_dir, "t1") == _series(reference, "t1")  # the others did not train again
    assert [s for s, _ in list_checkpoints(run_dir / "adapters" / "t2")] == [4, 5]


def test_sigterm_stops_after_the_step_checkpoints_every_adapter_and_resume_matches(workspace, reference, tmp_path):
    """A scheduler's preemption (SIGTERM) or Ctrl-C: `run` finishes the step in flight, checkpoints every running
    adapter (the steps since the last periodic save were lost before: SIGTERM killed the process, exit 143 without
    a checkpoint) and exits 128 + signal, saying how to resume; the resumed run ends as an uninterrupted one."""
    import time

    run_dir = tmp_path / "run"
    cfg = _config(workspace, run_dir)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "rl_multilora.cli", "run", str(path)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        while proc.poll() is None and len(read_metrics(run_dir)) < 3:  # the first step's rows (save_every: 2)
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "stopped by SIGTERM after global step" in stderr and "run the same command to resume" in stderr
    assert "Traceback" not in stderr
    rows = read_metrics(run_dir)
    for name in NAMES:
        trained = max(r["adapter_step"] for r in rows if r["adapter"] == name)
        assert [s for s, _ in list_checkpoints(run_dir / "adapters" / name)][-1] == trained, name
    run(parse_run_config(cfg))
    assert_same_as_reference(run_dir, reference)
