"""Controller states move forward only, slots are tracked, step counters advance only on training."""

import pytest

from rl_multilora.config import AdapterConfig
from rl_multilora.controller import AdapterState, ControllerError, MultiLoRAController


def _cfg(name, max_steps=2):
    return AdapterConfig(name=name, dataset={"path": "json"}, reward={"name": "gsm8k"}, max_steps=max_steps, rank=4)


def test_lifecycle_forward_only_and_slots():
    c = MultiLoRAController(max_loras=2)
    for n in "abc":
        c.register(_cfg(n))
    assert [r.name for r in c.pending_in_order()] == ["a", "b", "c"]
    c.activate("a", 0)
    c.activate("b", 1)
    assert c.free_slots() == []
    with pytest.raises(ControllerError, match="cannot move from RUNNING to PENDING|cannot move"):
        c.activate("a", 0)
    c.drain("a", "done")
    assert c.get("a").state == AdapterState.DRAINING
    assert c.mark_drained("a") == 0 and c.free_slots() == [0]
    c.mark_removed("a")
    assert c.get("a").state == AdapterState.REMOVED
    with pytest.raises(ControllerError):
        c.mark_drained("a")
    assert c.fail("b", "boom") == 1
    assert c.get("b").state == AdapterState.FAILED and c.get("b").reason == "boom"
    with pytest.raises(ControllerError):
        c.fail("b", "again")
    assert not c.all_done()  # c is still pending
    c.drain("c")  # a pending adapter that never started goes straight to REMOVED
    assert c.get("c").state == AdapterState.REMOVED and c.all_done()


def test_duplicate_live_name_rejected_but_reusable_after_removal():
    c = MultiLoRAController(max_loras=1)
    c.register(_cfg("a"))
    with pytest.raises(ControllerError, match="already PENDING"):
        c.register(_cfg("a"))
    c.drain("a")
    c.register(_cfg("a"))  # the previous tenant left: the name is free again
    assert c.get("a").state == AdapterState.PENDING


def test_step_counter_and_budget():
    c = MultiLoRAController(max_loras=1)
    c.register(_cfg("a", max_steps=2))
    c.activate("a", 0)
    assert not c.budget_done("a", data_exhausted=False)
    c.mark_trained("a")
    assert c.get("a").adapter_step == 1 and not c.budget_done("a", False)
    c.mark_trained("a")
    assert c.budget_done("a", False)
    assert c.budget_done("a", data_exhausted=True)
    with pytest.raises(ControllerError, match="not registered"):
        c.get("zzz")
