"""Tenant states move forward only, slots are recorded, step counters advance only on training."""

import pytest

from rl_multilora.backends.base import AdapterStepStats
from rl_multilora.config import AdapterConfig
from rl_multilora.tenants import TenantError, TenantState, TenantTable


def _cfg(name, max_steps=2):
    return AdapterConfig(name=name, dataset={"path": "json"}, reward={"name": "gsm8k"}, max_steps=max_steps, rank=4)


def test_lifecycle_forward_only_and_slots():
    c = TenantTable()
    for n in "abc":
        c.register(_cfg(n))
    assert [t.name for t in c.pending_in_order()] == ["a", "b", "c"]
    c.activate("a", 0)
    c.activate("b", 1)
    assert c.used_slots() == {0, 1}
    with pytest.raises(TenantError, match="cannot move from RUNNING to PENDING|cannot move"):
        c.activate("a", 0)
    c.drain("a", "done")
    assert c.get("a").state == TenantState.DRAINING
    assert c.mark_drained("a") == 0 and c.used_slots() == {1}
    c.mark_removed("a")
    assert c.get("a").state == TenantState.REMOVED
    with pytest.raises(TenantError):
        c.mark_drained("a")
    assert c.mark_failed("b", "boom") == 1
    assert c.get("b").state == TenantState.FAILED and c.get("b").reason == "boom"
    with pytest.raises(TenantError):
        c.mark_failed("b", "again")
    assert not c.all_done()  # c is still pending
    c.drain("c")  # a pending adapter that never started goes straight to REMOVED
    assert c.get("c").state == TenantState.REMOVED and c.all_done()


def test_duplicate_live_name_rejected_but_reusable_after_removal():
    c = TenantTable()
    c.register(_cfg("a"))
    with pytest.raises(TenantError, match="already PENDING"):
        c.register(_cfg("a"))
    c.drain("a")
    c.register(_cfg("a"))  # the previous tenant left: the name is free again
    assert c.get("a").state == TenantState.PENDING


def test_step_counter_and_budget():
    c = TenantTable()
    t = c.register(_cfg("a", max_steps=2))
    c.activate("a", 0)
    assert t.steps_left() == 2
    t.adapter_step += 1
    assert c.get("a").adapter_step == 1 and t.steps_left() == 1
    t.adapter_step += 1
    assert t.steps_left() == 0
    with pytest.raises(TenantError, match="not registered|a registered adapter"):
        c.get("zzz")


def test_manager_counts_the_optimizer_steps_the_backend_took():
    """record_trained adds the backend's n_steps (ppo_epochs > 1 takes several per step), and only when it stepped."""
    from rl_multilora.tenants import TenantManager

    m = TenantManager.__new__(TenantManager)  # the counting needs no backend, data source or checkpoints
    TenantTable.__init__(m)
    t = m.register(_cfg("a", max_steps=5))
    m.activate("a", 0)
    m.record_trained("a", AdapterStepStats(stepped=True, n_steps=2))
    assert t.adapter_step == 2 and t.dirty and m.step_limits() == {"a": 3}
    t.dirty = False
    m.record_trained("a", AdapterStepStats(stepped=False, skipped_nonfinite=True))
    assert t.adapter_step == 2 and not t.dirty and t.nonfinite_streak == 1
    m.record_trained("a", None)  # no samples this step: nothing changes
    assert t.adapter_step == 2 and t.nonfinite_streak == 1
