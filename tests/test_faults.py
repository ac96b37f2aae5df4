"""Faults stay with their tenant: two healthy tenants end exactly as in a run without the faulty ones.

One run holds two healthy tenants (h1, h2) beside one tenant per fault, plus a tenant (h3) that waits for a slot:
- f_raise: its reward raises on every sample -> errors counted, FAILED after `faults.max_reward_fail_steps`
  all-failing steps;
- f_hang: its reward never returns -> timeouts counted (the worker is killed), FAILED the same way;
- f_nan: trains one good step, then its rewards overflow so its advantages (and loss) are NaN -> the trainer skips
  its steps, FAILED after `faults.max_nonfinite_steps`, final checkpoint = its weights after the good step;
- f_data: a dataset with bad rows and a one-epoch budget -> bad rows skipped and counted, DRAINED when used up.
Each FAILED tenant has its reason in the status and the log, a final checkpoint, and its slot freed (h3 gets one).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_multilora.checkpoint import CKPT_META, CheckpointManager, list_checkpoints
from rl_multilora.config import parse_run_config
from rl_multilora.loop import run
from rl_multilora.metrics import read_metrics
from tests.tiny_models import save_tiny_model, sum_task_adapter

HEALTHY = ("h1", "h2")


def _write_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _task(n: int, offset: int) -> list[dict]:
    return [{"q": f"{i % 7 + offset}+{i % 5}=", "a": str(i % 7 + offset + i % 5)} for i in range(n)]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    save_tiny_model(root / "model", hidden=32, layers=2)
    for name, off in [("h1", 1), ("h2", 3), ("h3", 4), ("f_raise", 2), ("f_hang", 5)]:
        _write_rows(root / "data" / f"{name}.jsonl", _task(20, off))
    _write_rows(root / "data" / "f_nan.jsonl", _task(2, 6))  # 2 rows = one step per epoch
    # 5 good rows and 3 bad ones (no label, empty prompt, no prompt): 3 steps of 2, 2 and 1 prompts.
    bad = [{"q": "1+1="}, {"q": "  ", "a": "0"}, {"q": None, "a": "1"}]
    _write_rows(root / "data" / "f_data.jsonl", _task(5, 0)[:3] + bad + _task(5, 0)[3:])
    return root


def _adapter(root: Path, name: str, seed: int, reward: dict, **over) -> dict:
    return sum_task_adapter(root / "data", name, seed, reward=reward, **{"max_steps": 4, **over})


def _config(root: Path, run_dir: Path, with_faults: bool) -> dict:
    digit = {"name": "format", "kwargs": {"pattern": "[0-9]"}}
    adapters = [_adapter(root, "h1", 7, digit), _adapter(root, "h2", 11, digit, rank=8)]
    if with_faults:
        adapters += [
            _adapter(root, "f_raise", 21, {"path": "tests.reward_plugins:raising_reward"}),
            _adapter(root, "f_hang", 22, {"path": "tests.reward_plugins:hanging_reward", "timeout_s": 0.5}),
            _adapter(
                root,
                "f_nan",
                23,
                {"path": "tests.fault_plugins:overflow_reward", "kwargs": {"from_epoch": 1}},
                max_steps=10,
            ),
            _adapter(root, "f_data", 24, digit, epochs=1.0, max_steps=10),
            _adapter(root, "h3", 25, digit, max_steps=2),  # waits: every slot is taken at the start
        ]
    return {
        "run_dir": str(run_dir),
        "model": {"path": str(root / "model"), "max_loras": 6, "max_rank": 8},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 6},
        "grpo": {"micro_batch_size": 16, "drop_uniform_groups": False},
        "checkpoint": {"save_every": 1, "keep_last": 3},
        "logging": {"plot": False, "progress": False},
        "rewards": {"num_workers": 1},
        "faults": {"max_nonfinite_steps": 2, "max_reward_fail_steps": 2},
        "adapters": adapters,
    }


@pytest.fixture(scope="module")
def runs(workspace, tmp_path_factory):
    """(faulty run dir, its Runtime, captured log text, clean run dir)."""
    base = tmp_path_factory.mktemp("fault_runs")
    clean = base / "clean"
    run(parse_run_config(_config(workspace, clean, with_faults=False)))
    faulty = base / "faulty"
    handler = _ListHandler()
    logger = logging.getLogger("rl_multilora")
    logger.addHandler(handler)
    try:
        rt = run(parse_run_config(_config(workspace, faulty, with_faults=True)))
    finally:
        logger.removeHandler(handler)
    return faulty, rt, "\n".join(handler.lines), clean


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _rows(run_dir: Path, name: str) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r["adapter"] == name]


def test_healthy_tenants_are_untouched_by_the_faulty_ones(runs):
    faulty, rt, _, clean = runs
    for name in HEALTHY:
        assert rt.tenants.get(name).state.value == "REMOVED"
        got, want = CheckpointManager(faulty).latest(name), CheckpointManager(clean).latest(name)
        for f in ("adapter_model.safetensors", "optimizer.safetensors"):
            a, b = load_file(str(got / f)), load_file(str(want / f))
            assert a.keys() == b.keys()
            for k in b:
                torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7, msg=f"{name}/{f}/{k}")
        assert any(b.abs().sum() > 0 for k, b in load_file(str(want / "adapter_model.safetensors")).items())
        per_step = [(r["adapter_step"], r["reward_mean"], r["loss"]) for r in _rows(faulty, name)]
        alone = [(r["adapter_step"], r["reward_mean"], r["loss"]) for r in _rows(clean, name)]
        assert [r[0] for r in per_step] == [r[0] for r in alone]
        # pytest.approx takes flat sequences only (pytest >= 9.1 rejects nested tuples).
        flat = [x for row in per_step for x in row]
        assert flat == pytest.approx([x for row in alone for x in row], rel=1e-5, abs=1e-7)


def _assert_failed(rt, run_dir: Path, log: str, name: str, reason: str) -> dict:
    rec = rt.tenants.get(name)
    status = {s["name"]: s for s in rt.tenants.status()}[name]
    assert rec.state.value == "FAILED" and status["state"] == "FAILED"
    assert reason in status["reason"], status["reason"]
    assert f"adapter {name} FAILED: {status['reason']}" in log
    assert rec.slot is None and name not in rt.backend.model.adapters and name not in rt.backend.trainer.adapters
    assert not rec.in_engine and name not in rt.engine.adapter_versions()  # unloaded from the engine
    final = Path(rec.last_checkpoint)
    meta = json.loads((final / CKPT_META).read_text())
    assert meta["note"] == f"FAILED: {status['reason']}" and final == CheckpointManager(run_dir).latest(name)
    assert meta["state"] == "FAILED"  # the final checkpoint records the state it was written for
    state = json.loads((run_dir / "run_state.json").read_text())["adapters"][name]
    assert state["state"] == "FAILED" and state["reason"] == status["reason"]
    return meta


def test_raising_reward_is_counted_then_fails_its_tenant(runs):
    faulty, rt, log, _ = runs
    rows = _rows(faulty, "f_raise")
    assert len(rows) == 2  # rewards.fail_steps=2 all-failing steps, then FAILED
    assert [r["reward_errors"] for r in rows] == [r["n_samples"] for r in rows] == [8, 8]
    assert all(r["reward_mean"] == 0.0 for r in rows)  # failure_value
    _assert_failed(rt, faulty, log, "f_raise", "ZeroDivisionError")


def test_hanging_reward_times_out_then_fails_its_tenant(runs):
    faulty, rt, log, _ = runs
    rows = _rows(faulty, "f_hang")
    assert len(rows) == 2
    # One worker: the first sample timed out (failure_value); the other 7 were not started, so never scored: FAILED,
    # left out of training, not trained as failure_value.
    assert all(r["n_samples"] == 8 and r["reward_timeouts"] == 1 and r["failed_samples"] == 7 for r in rows)
    _assert_failed(rt, faulty, log, "f_hang", "timeout_s=0.5")


def test_nan_loss_skips_steps_then_fails_with_last_good_weights(runs):
    faulty, rt, log, _ = runs
    rows = _rows(faulty, "f_nan")
    assert [(r["adapter_step"], r["skipped_nonfinite"], r["nonfinite_streak"]) for r in rows] == [
        (1, False, 0),
        (1, True, 1),
        (1, True, 2),
    ]
    meta = _assert_failed(rt, faulty, log, "f_nan", "non-finite")
    assert meta["adapter_step"] == 1
    # The final checkpoint holds exactly the weights and optimizer state of the good step's checkpoint.
    (good, _), *_ = [(d, s) for s, d in list_checkpoints(faulty / "adapters" / "f_nan") if s == 1]
    final = Path(rt.tenants.get("f_nan").last_checkpoint)
    assert good != final
    for f in ("adapter_model.safetensors", "optimizer.safetensors"):
        a, b = load_file(str(good / f)), load_file(str(final / f))
        assert all(torch.equal(a[k], b[k]) and torch.isfinite(b[k]).all() for k in b)


def test_bad_rows_are_counted_and_an_exhausted_dataset_drains(runs):
    faulty, rt, _, _ = runs
    rows = _rows(faulty, "f_data")
    assert [r["n_samples"] for r in rows] == [8, 8, 4]  # 5 good rows: 2 + 2 + 1 prompts
    assert rows[-1]["bad_rows"] == 3
    rec = rt.tenants.get("f_data")
    assert rec.state.value == "REMOVED" and rec.reason == "budget reached" and rec.adapter_step == 3
    data_state = json.loads((CheckpointManager(faulty).latest("f_data") / "data_state.json").read_text())
    assert len(data_state["bad_rows"]) == 3


def test_a_failed_tenants_slot_goes_to_a_waiting_one(runs):
    faulty, rt, _, _ = runs
    rows = _rows(faulty, "h3")
    assert rt.tenants.get("h3").state.value == "REMOVED" and [r["adapter_step"] for r in rows] == [1, 2]
    first_h3_step = rows[0]["step"]
    failed_at = min(_rows(faulty, "f_raise")[-1]["step"], _rows(faulty, "f_hang")[-1]["step"])
    assert first_h3_step == failed_at + 1  # admitted in the step its slot was freed, trained in the next


def test_a_name_submitted_again_after_failing_starts_with_clean_failure_counters(workspace, tmp_path):
    """The reward-failure streak is the tenant's own: a name that FAILED for it, submitted again, starts at 0 (it
    used to be kept by the reward executor under the name, so the new tenant failed after its first bad step)."""
    from rl_multilora.config import AdapterConfig
    from rl_multilora.loop import Runtime

    cfg = _config(workspace, tmp_path / "run", with_faults=False)
    raising = _adapter(workspace, "f_raise", 21, {"path": "tests.reward_plugins:raising_reward"})
    cfg["adapters"] = [{**cfg["adapters"][0], "max_steps": 10}, raising]
    rt = Runtime.build(parse_run_config(cfg))
    try:
        rt.start()
        for _ in range(2):  # faults.max_reward_fail_steps
            rt.step()
        first = rt.tenants.get("f_raise")
        assert first.state.value == "FAILED" and first.reward_fail_streak == 2, first.reason
        rt.register(AdapterConfig.model_validate(raising))  # the same name and the same failing reward
        rt.tenants.admit_pending()
        rt.sync_now()
        rt.step()
        again = rt.tenants.get("f_raise")
        assert again is not first and again.state.value == "RUNNING" and again.reward_fail_streak == 1
        rt.step()
        assert again.state.value == "FAILED" and "2 consecutive" in again.reason
        assert rt.tenants.get("h1").state.value == "RUNNING"  # the other tenant never noticed
    finally:
        rt.close()
