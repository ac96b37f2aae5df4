"""The run's end-of-run summary and progress bar say what the budgets count: optimizer steps per tenant, global
steps the run takes, and no time estimate before a few steps are done."""

import json
from types import SimpleNamespace

from rl_multilora.loop import ESTIMATE_AFTER, _steps_left, _time_left, summarize
from rl_multilora.tenants import TenantState


def test_summary_counts_optimizer_steps_and_global_steps(tmp_path):
    # Tenant "a" takes no optimizer step at global step 1 (all its groups scored alike): 3 optimizer steps in 4 global
    # steps, which is what `max_steps: 3` budgets and what the summary's "N steps" must say.
    rows = [
        {"step": 0, "adapter": "a", "adapter_step": 1, "reward_mean": 0.0},
        {"step": 1, "adapter": "a", "adapter_step": 1, "reward_mean": 1.0},
        {"step": 2, "adapter": "a", "adapter_step": 2, "reward_mean": 0.5},
        {"step": 3, "adapter": "a", "adapter_step": 3, "reward_mean": 1.0},
        {"step": 3, "adapter": "a", "adapter_step": 3, "kind": "eval", "eval/reward_mean": 0.7},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summarize(tmp_path, window=2)["a"]
    assert (s["steps"], s["global_steps"]) == (3, 4)
    assert (s["first"], s["last"], s["eval_final"], s["eval_final_step"]) == (0.5, 0.75, 0.7, 3)
    # a run shorter than two windows compares its halves: first5 and last5 of 4 steps were the same mean, gain 0
    s = summarize(tmp_path)["a"]
    assert (s["window"], s["first"], s["last"]) == (2, 0.5, 0.75)


def _runtime(lefts, global_step=0, max_global_steps=None, ppo_epochs=1, slots=8, per_step=None):
    tenants = {f"t{i}": SimpleNamespace(state=state, steps_left=lambda n=n: n) for i, (state, n) in enumerate(lefts)}
    cfg = SimpleNamespace(
        max_global_steps=max_global_steps,
        grpo=SimpleNamespace(ppo_epochs=ppo_epochs),
        rollout=SimpleNamespace(max_tenants_per_step=per_step),
    )
    return SimpleNamespace(
        cfg=cfg,
        tenants=SimpleNamespace(tenants=tenants, global_step=global_step),
        backend=SimpleNamespace(max_loras=slots),
    )


def test_tenants_taking_turns_need_their_steps_over_the_lanes():
    """A reviewer's run: 3 tenants of 4 steps on one slot took 12 steps, and the bar said 4 (a third of the run)."""
    running, pending = TenantState.RUNNING, TenantState.PENDING
    assert _steps_left(_runtime([(running, 4), (pending, 4), (pending, 4)], slots=1)) == 12
    assert _steps_left(_runtime([(running, 4)] * 3, slots=8, per_step=1)) == 12  # turns: one tenant a step
    assert _steps_left(_runtime([(running, 10), (running, 2), (pending, 2)], slots=2)) == 10  # the longest bounds
    assert _steps_left(_runtime([(running, 4)] * 3, slots=8)) == 4  # all at once


def test_steps_left_is_the_longest_budget_of_a_live_tenant():
    running, done = TenantState.RUNNING, TenantState.REMOVED
    assert _steps_left(_runtime([(running, 12), (TenantState.PENDING, 30), (done, 99)])) == 30
    assert _steps_left(_runtime([(running, 12)], ppo_epochs=4)) == 3  # up to 4 optimizer steps per global step
    assert _steps_left(_runtime([(running, 12)], global_step=5, max_global_steps=10)) == 5
    assert _steps_left(_runtime([(running, None)])) is None  # an epochs budget: unknown
    assert _steps_left(_runtime([(running, None)], global_step=5, max_global_steps=10)) == 5
    assert _steps_left(_runtime([])) == 0


def test_time_estimate_waits_for_steps_and_ignores_the_slow_first_one():
    first = [60.0]  # the first step holds the base evaluation and the warm-up
    assert _time_left(first, 100) == "?"
    assert _time_left(first + [2.0] * (ESTIMATE_AFTER - 2), 100) == "?"
    assert _time_left(first + [2.0] * (ESTIMATE_AFTER - 1), 100) == "~3m20s"  # the median: 2 s x 100 steps
    assert _time_left(first + [2.0] * 5, None) == "?"


def test_wandb_gets_an_eval_rows_values_under_eval_only(tmp_path, monkeypatch):
    """A reviewer's run with wandb: an eval row's reward_mean (held-out) and adapter_step were logged as
    `<adapter>/reward_mean` and `<adapter>/adapter_step` at the training row's step, replacing its values there."""
    import sys

    from rl_multilora.config import WandbSettings
    from rl_multilora.metrics import MetricsLogger

    logged: list[tuple[dict, int]] = []
    run = SimpleNamespace(log=lambda payload, step: logged.append((payload, step)), finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(init=lambda **kw: run))
    metrics = MetricsLogger(tmp_path, WandbSettings(mode="offline"))
    metrics.log_row({"step": 3, "adapter": "a", "adapter_step": 4, "reward_mean": 0.5})
    metrics.log_row({"step": 3, "adapter": "a", "adapter_step": 3, "kind": "eval", "reward_mean": 0.1,
                     "eval/reward_mean": 0.1, "eval/base": 0})  # fmt: skip
    metrics.close()
    assert logged == [
        ({"a/step": 3, "a/adapter_step": 4, "a/reward_mean": 0.5}, 3),
        ({"a/eval/reward_mean": 0.1, "a/eval/base": 0}, 3),
    ]
