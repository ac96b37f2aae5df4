"""Fair shares: when tenants ask for more rows than a step holds, each gets its weighted share within one group, at
least one group each; a huge ask cannot starve the others; waiting tenants are admitted by priority."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl_multilora.config import AdapterConfig, parse_run_config
from rl_multilora.loop import Runtime
from rl_multilora.shares import fair_quotas
from rl_multilora.tenants import TenantTable
from tests.tiny_models import save_tiny_model, sum_task_adapter, write_sum_task


def _weighted_share(asks, weights, max_rows, name):
    """The ideal (fractional) rows of `name` under weighted max-min fairness, by direct water-filling."""
    left, active, share = max_rows, dict(weights), {}
    demand = {n: g * r for n, (g, r) in asks.items()}
    while active:
        unit = left / sum(active.values())
        capped = {n for n in active if demand[n] <= unit * active[n]}
        if not capped:
            share.update({n: unit * w for n, w in active.items()})
            break
        for n in capped:
            share[n] = demand[n]
            left -= demand[n]
            del active[n]
    return share[name]


@pytest.mark.parametrize(
    ("asks", "weights", "cap"),
    [
        ({"big": (80, 8), "a": (8, 8), "b": (8, 8), "c": (8, 8)}, {"big": 1, "a": 1, "b": 1, "c": 1}, 128),
        ({"big": (80, 8), "a": (8, 8), "b": (8, 8)}, {"big": 2, "a": 1, "b": 1}, 96),
        ({"big": (100, 4), "a": (10, 4), "b": (2, 4)}, {"big": 1, "a": 1, "b": 1}, 80),
        ({"big": (40, 8), "a": (10, 2), "b": (10, 4)}, {"big": 1, "a": 3, "b": 1}, 100),
    ],
)
def test_every_tenant_gets_its_weighted_share_within_one_group(asks, weights, cap):
    quotas = fair_quotas(asks, weights, cap)
    assert sum(quotas[n] * asks[n][1] for n in asks) <= cap
    for name, (groups, size) in asks.items():
        assert 1 <= quotas[name] <= groups
        ideal = _weighted_share(asks, weights, cap, name)
        assert abs(quotas[name] * size - ideal) <= size, (name, quotas, ideal)


def test_one_group_each_even_when_the_cap_is_smaller_than_the_tenants():
    asks = {n: (8, 4) for n in "abcdef"}
    assert fair_quotas(asks, dict.fromkeys(asks, 1.0), max_rows=8) == dict.fromkeys(asks, 1)


def test_no_cap_or_asks_within_it_change_nothing():
    asks = {"a": (8, 8), "b": (3, 4)}
    assert fair_quotas(asks, {"a": 1, "b": 1}, None) == fair_quotas(asks, {"a": 1, "b": 9}, 1000) == {"a": 8, "b": 3}


def test_waiting_tenants_get_slots_by_priority_then_submission_order():
    def cfg(name, priority=0):
        return AdapterConfig(
            name=name, dataset={"path": "json"}, reward={"name": "gsm8k"}, max_steps=2, priority=priority
        )

    table = TenantTable()
    for name, prio in [("first", 0), ("urgent", 5), ("second", 0), ("low", -1)]:
        table.register(cfg(name, prio))
    assert [t.name for t in table.pending_in_order()] == ["urgent", "first", "second", "low"]


def test_a_capped_step_in_the_loop_splits_rows_by_share(tmp_path: Path):
    save_tiny_model(tmp_path / "model", hidden=32, layers=2)
    for name in ("big", "a", "b"):
        write_sum_task(tmp_path / "data" / f"{name}.jsonl", 40, 1)
    adapters = [
        sum_task_adapter(tmp_path / "data", "big", 1, max_steps=2, prompts_per_step=20),
        sum_task_adapter(tmp_path / "data", "a", 2, max_steps=2, prompts_per_step=2),
        sum_task_adapter(tmp_path / "data", "b", 3, max_steps=2, prompts_per_step=4, weight=2.0),
    ]
    cfg = {
        "run_dir": str(tmp_path / "run"),
        "model": {"path": str(tmp_path / "model"), "max_loras": 3, "max_rank": 8},
        "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": 4, "max_rows_per_step": 16},
        "logging": {"plot": False, "progress": False},
        "rewards": {"num_workers": 1},
        "adapters": adapters,
    }
    rt = Runtime.build(parse_run_config(cfg))
    try:
        rt.start()
        res = rt.step()
    finally:
        rt.close()
    rows = {r.adapter: r.n_samples for r in res.records}
    # 16 rows of 2-row groups: a asks 2 groups and gets them; b (weight 2) then gets twice big's share.
    assert rows == {"big": 4, "a": 4, "b": 8}, rows
    assert sum(r.row_share for r in res.records) == pytest.approx(1.0)
    assert all(r.slot_wait_s is not None and r.slot_wait_s >= 0 for r in res.records)
