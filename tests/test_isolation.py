"""No tenant can stop the others: a bad submission, a failing start, a malformed sample or a tenant with nothing to
learn from ends that tenant alone (rejected or FAILED, with its reason), and the healthy tenant trains on exactly
as it would without it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_multilora.checkpoint import CheckpointManager
from rl_multilora.config import ConfigError, parse_adapter_config, parse_run_config
from rl_multilora.loop import Runtime, run
from rl_multilora.metrics import read_metrics
from tests.tiny_models import save_tiny_model, sum_task_adapter, write_sum_task


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("isolation")
    save_tiny_model(root / "model", hidden=32, layers=2)
    for name, off in [("h", 1), ("p", 3), ("q", 4)]:
        write_sum_task(root / "data" / f"{name}.jsonl", 30, off)
    return root


def _cfg(ws: Path, run_dir: Path, adapters: list[dict], **over) -> dict:
    cfg = {
        "run_dir": str(run_dir),
        "model": {"path": str(ws / "model"), "max_loras": 3, "max_rank": 8},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 6},
        "grpo": {"micro_batch_size": 8},
        "logging": {"plot": False, "progress": False},
        "rewards": {"num_workers": 1},
        "adapters": adapters,
    }
    cfg.update(over)
    return cfg


def _healthy(ws: Path, steps: int = 4) -> dict:
    return sum_task_adapter(ws / "data", "h", 5, max_steps=steps)


def _series(run_dir: Path, name: str) -> list[float]:
    """(adapter_step, reward_mean, loss) of each of its rows, flattened: pytest >= 9.1's approx takes flat sequences."""
    rows = [r for r in read_metrics(run_dir) if r["adapter"] == name and r.get("kind") != "eval"]
    return [x for r in rows for x in (r["adapter_step"], r["reward_mean"], r.get("loss") or 0.0)]


def _final_weights(run_dir: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(CheckpointManager(run_dir).latest(name) / "adapter_model.safetensors"))


def test_a_tenant_with_no_learning_signal_ends_and_the_run_ends(ws, tmp_path):
    """A reward that never varies makes every group uniform: the tenant never steps; after faults.max_idle_steps it
    FAILS with a reason, so the run ends, and the healthy tenant is untouched."""
    flat = sum_task_adapter(ws / "data", "p", 7, max_steps=50, reward={"name": "format", "kwargs": {"pattern": "§"}})
    cfg = _cfg(ws, tmp_path / "r", [_healthy(ws), flat], faults={"max_idle_steps": 3})
    rt = run(parse_run_config(cfg))
    p, h = rt.tenants.get("p"), rt.tenants.get("h")
    assert p.state.value == "FAILED" and "no optimizer step for 3 consecutive steps" in p.reason
    assert p.adapter_step == 0 and h.state.value == "REMOVED" and h.adapter_step == 4
    alone = run(parse_run_config(_cfg(ws, tmp_path / "alone", [_healthy(ws)])))
    assert alone.tenants.get("h").adapter_step == 4
    assert _series(tmp_path / "r", "h") == pytest.approx(_series(tmp_path / "alone", "h"))


def test_a_tenant_whose_start_fails_is_failed_alone(ws, tmp_path, monkeypatch):
    """Any error while one tenant starts marks it FAILED with the reason; the step and the others go on."""
    cfg = parse_run_config(
        _cfg(ws, tmp_path / "r", [_healthy(ws), sum_task_adapter(ws / "data", "p", 7, max_steps=4)])
    )
    rt = Runtime.build(cfg)
    real_add = rt.backend.add_adapter

    def add(a):
        if a.name == "p":
            real_add(a)  # half-started: it holds a slot when the error comes
            raise RuntimeError("boom while starting p")
        return real_add(a)

    monkeypatch.setattr(rt.backend, "add_adapter", add)
    try:
        rt.start()
        p = rt.tenants.get("p")
        assert p.state.value == "FAILED" and "could not start: RuntimeError: boom while starting p" in p.reason
        assert "p" not in rt.backend.model.adapters and "p" not in rt.data.adapters  # nothing of it stays
        while not rt.finished():
            rt.step()
        assert rt.tenants.get("h").state.value == "REMOVED" and rt.tenants.get("h").adapter_step == 4
    finally:
        rt.close()


def test_a_malformed_sample_fails_its_tenant_only(ws, tmp_path):
    """A sample the trainer cannot use (here: a hook-style bug, an empty prompt) costs its adapter, not the step."""
    cfg = parse_run_config(
        _cfg(ws, tmp_path / "r", [_healthy(ws), sum_task_adapter(ws / "data", "p", 7, max_steps=4)])
    )
    rt = Runtime.build(cfg)
    real_run = rt.generator.run_sync

    def corrupt(groups):
        samples = real_run(groups)
        for s in samples:
            if s.adapter.name == "p":
                s.prompt_ids = []
        return samples

    rt.generator.run_sync = corrupt
    try:
        rt.start()
        rt.step()
        p = rt.tenants.get("p")
        assert p.state.value == "FAILED" and "malformed sample" in p.reason and "prompt_ids is empty" in p.reason
        while not rt.finished():
            rt.step()
        assert rt.tenants.get("h").adapter_step == 4
    finally:
        rt.close()


POISONED = {
    "newline-name": lambda ws: sum_task_adapter(ws / "data", "p\n", 7, max_steps=4),
    "targets-match-nothing": lambda ws: sum_task_adapter(ws / "data", "p", 7, max_steps=4, target_modules=["zz_proj"]),
    "cosine-epochs-only": lambda ws: sum_task_adapter(ws / "data", "p", 7, epochs=1.0, optim={"schedule": "cosine"}),
    "epochs-inf": lambda ws: sum_task_adapter(ws / "data", "p", 7, epochs=float("inf")),
}


def _service_run(ws: Path, run_dir: Path, poison: bool) -> dict[str, str]:
    """The healthy tenant in a Ray-free service; with `poison`, every poisoned adapter is submitted while it trains,
    plus one that passes validation but cannot start (its dataset disappears before admission)."""
    from rl_multilora.service import ServiceCore, ServiceError

    cfg = parse_run_config(_cfg(ws, run_dir, [_healthy(ws, steps=6)], service_poll_s=0.05))
    core = ServiceCore(Runtime.build(cfg), poll_s=0.05)
    core.start()
    outcomes = {}
    try:
        if poison:
            for key, make in POISONED.items():
                try:
                    core.submit(parse_adapter_config(make(ws), cfg.model))
                    outcomes[key] = "accepted"
                except (ConfigError, ServiceError) as e:
                    outcomes[key] = f"rejected: {e}"
            vanishing = ws / "data" / "q_copy.jsonl"
            vanishing.write_bytes((ws / "data" / "q.jsonl").read_bytes())
            doomed = sum_task_adapter(ws / "data", "q", 9, max_steps=4)
            doomed["dataset"]["data_files"] = str(vanishing)
            outcomes["vanishing-dataset"] = core.submit(parse_adapter_config(doomed, cfg.model)).state
            vanishing.unlink()  # before the next step admits it
        deadline = time.monotonic() + 120
        while core.status().get("h").state != "REMOVED" and core.status().get("h").state != "DRAINED":
            assert core.error is None, core.error
            assert time.monotonic() < deadline, core.status().table()
            time.sleep(0.05)
        if poison:
            q = core.status().get("q")
            outcomes["vanishing-dataset"] += f" -> {q.state}: {q.reason}"
        assert core.error is None
    finally:
        core.stop(timeout=60)
    return outcomes


def test_service_poisoned_submissions_never_touch_the_healthy_tenant(ws, tmp_path):
    outcomes = _service_run(ws, tmp_path / "poisoned", poison=True)
    for key in POISONED:
        assert outcomes[key].startswith("rejected"), (key, outcomes[key])
    assert "newline" not in outcomes["newline-name"] or "name='p\\n'" in outcomes["newline-name"]
    assert "zz_proj" in outcomes["targets-match-nothing"]
    assert outcomes["vanishing-dataset"].startswith("PENDING -> FAILED: could not start"), outcomes
    _service_run(ws, tmp_path / "clean", poison=False)
    assert _series(tmp_path / "poisoned", "h") == pytest.approx(_series(tmp_path / "clean", "h"))
    w_p, w_c = _final_weights(tmp_path / "poisoned", "h"), _final_weights(tmp_path / "clean", "h")
    assert w_p.keys() == w_c.keys() and all(torch.equal(w_p[k], w_c[k]) for k in w_p)


def test_a_tenant_whose_episodes_all_fail_says_why(ws, tmp_path):
    """An environment that raised on every episode (a typo in it, say) ended its tenant FAILED with only 'no optimizer
    step for N consecutive steps': the reason was in no log line, metrics row or message."""
    from rl_multilora.metrics import console_line

    broken = sum_task_adapter(ws / "data", "p", 7, max_steps=50)
    broken["environment"] = {"path": "tests.env_plugins:Raising"}
    cfg = _cfg(ws, tmp_path / "r", [_healthy(ws), broken], faults={"max_idle_steps": 2})
    rt = run(parse_run_config(cfg))
    p = rt.tenants.get("p")
    why = "environment raised RuntimeError: environment bug"
    assert p.state.value == "FAILED" and f"its samples last failed with: {why}" in p.reason
    rows = [r for r in read_metrics(tmp_path / "r") if r["adapter"] == "p"]
    assert rows and all(r["failed_samples"] == r["n_samples"] > 0 and why in r["failed_reason"] for r in rows)
    healthy = [r for r in read_metrics(tmp_path / "r") if r["adapter"] == "h"]
    assert all(r["failed_samples"] == 0 and r["failed_reason"] is None for r in healthy)
    line = console_line(rt_record(rows[0]))
    assert f"| failed {rows[0]['n_samples']}/{rows[0]['n_samples']}: {why}" in line


def rt_record(row: dict):
    """A StepRecord carrying a metrics row's fields that `console_line` reads."""
    from rl_multilora.metrics import StepRecord

    fields = {k: row[k] for k in StepRecord.__dataclass_fields__ if k in row and k not in ("train", "timings")}
    return StepRecord(**fields)


def test_reward_errors_are_on_the_console_line_from_the_first_step(ws, tmp_path):
    """A reward that returns None scores failure_value and trains: the console showed `reward 0.000` for steps until
    the tenant FAILED (a reviewer's find). Its line says how many samples' reward failed, and why, from the first."""
    from rl_multilora.metrics import console_line

    broken = sum_task_adapter(
        ws / "data", "p", 7, max_steps=50, reward={"path": "tests.reward_plugins:raising_reward"}
    )
    cfg = _cfg(ws, tmp_path / "r", [_healthy(ws), broken], faults={"max_reward_fail_steps": 2})
    run(parse_run_config(cfg))
    rows = [r for r in read_metrics(tmp_path / "r") if r["adapter"] == "p"]
    assert rows and all("ZeroDivisionError" in r["reward_error_reason"] for r in rows)
    line = console_line(rt_record(rows[0]))
    assert f"| reward errors {rows[0]['n_samples']}/{rows[0]['n_samples']}: " in line and "ZeroDivisionError" in line
    healthy = [r for r in read_metrics(tmp_path / "r") if r["adapter"] == "h"]
    assert all(r["reward_error_reason"] is None and "reward errors" not in console_line(rt_record(r)) for r in healthy)
