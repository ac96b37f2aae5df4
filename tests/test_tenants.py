"""Tenant states move forward only, slots are recorded, step counters advance only on training."""

import pytest

from rl_multilora.batch import AdapterStepStats
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

    m = TenantManager(cfg=None, backend=None, data=None, ckpt=None)  # counting needs none of them
    t = m.table.register(_cfg("a", max_steps=5))
    m.table.activate("a", 0)
    m.record_trained("a", AdapterStepStats(stepped=True, n_steps=2))
    assert t.adapter_step == 2 and t.dirty and m.step_limits() == {"a": 3}
    t.dirty = False
    m.record_trained("a", AdapterStepStats(stepped=False, skipped_nonfinite=True))
    assert t.adapter_step == 2 and not t.dirty and t.nonfinite_streak == 1
    m.record_trained("a", None)  # no samples this step: nothing changes
    assert t.adapter_step == 2 and t.nonfinite_streak == 1


def test_fault_policy_counts_all_failing_reward_steps_per_tenant():
    """faults.max_reward_fail_steps all-failing steps in a row FAIL a tenant; any other step resets its count;
    another tenant's failures never count toward it."""
    from rl_multilora.config import RunConfig
    from rl_multilora.tenants import TenantManager

    cfg = RunConfig(model={"path": "m"}, faults={"max_reward_fail_steps": 3})
    m = TenantManager(cfg=cfg, backend=None, data=None, ckpt=None)
    failed = []
    m.fail = lambda name, reason: failed.append((name, reason))  # the policy's decision, without the fan-out
    for n in ("boom2", "mixed"):
        m.table.register(_cfg(n, max_steps=100))
        m.table.activate(n, 0)
    ok = AdapterStepStats(stepped=True, n_steps=1)

    def step(all_failed: dict[str, str]) -> None:
        m.apply_step(["boom2", "mixed"], {"boom2": ok, "mixed": ok}, {}, all_failed)
        m.enforce_faults(["boom2", "mixed"], {"boom2": ok, "mixed": ok}, all_failed)

    step({"boom2": "2/2 failed"})
    step({"boom2": "2/2 failed"})
    assert failed == []
    step({"boom2": "2/2 failed", "mixed": "2/2 failed"})
    assert [n for n, _ in failed] == ["boom2"] and "3 consecutive" in failed[0][1]  # "mixed": once so far
    step({"mixed": "2/2 failed"})  # a step where boom2 scored resets its count; mixed is at 2
    assert m.get("boom2").reward_fail_streak == 0 and m.get("mixed").reward_fail_streak == 2
    step({"boom2": "x"})
    assert len(failed) == 1 and (m.get("boom2").reward_fail_streak, m.get("mixed").reward_fail_streak) == (1, 0)


class _Backend:
    """A backend with one LoRA module's tensors: enough for a checkpoint."""

    def adapter_state_dict(self, name):
        import torch

        return {"base_model.model.l.q_proj.lora_A.weight": torch.zeros(2, 4),
                "base_model.model.l.q_proj.lora_B.weight": torch.zeros(4, 2)}  # fmt: skip

    def peft_config(self, name):
        return {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}

    def optimizer_state_dict(self, name):
        return {}

    def remove_adapter(self, name):
        pass

    def load_adapter_state_dict(self, *args, **kwargs):
        pass

    def load_optimizer_state_dict(self, *args):
        pass


class _Data:
    """A data cursor per tenant: its position is what a checkpoint's data state records."""

    def __init__(self):
        self.cursor, self.loaded = 0, None

    def state_dict(self, name):
        return {"cursor": self.cursor}

    def exhausted(self, name):
        return False

    def remove_adapter(self, name):
        pass

    def check_state(self, name, state):
        pass  # one dataset, one seed

    def unusable(self, name):
        return None

    def load_state_dict(self, name, state):
        self.loaded = state


def test_an_adapter_drained_between_steps_resumes_from_its_final_checkpoint(tmp_path):
    """The service with no tenant running retires a removed adapter between global steps (`Runtime.idle_step`). Its
    final checkpoint used to be marked as taken in the step in progress, which never finished; submitting the name
    again (or a restart) then discarded it as uncommitted and resumed from the last periodic checkpoint, 3 adapter
    steps and their data earlier."""
    from rl_multilora.checkpoint import CheckpointManager, list_checkpoints
    from rl_multilora.loop import Runtime
    from rl_multilora.tenants import TenantManager

    data = _Data()
    ckpt = CheckpointManager(tmp_path, keep_last=1)
    manager = TenantManager(None, _Backend(), data, ckpt)
    t = manager.table.register(_cfg("a", max_steps=100))
    manager.table.activate("a", 0)
    t.adapter_step, data.cursor = 2, 16
    manager.save_checkpoint(t)  # a periodic checkpoint in global step 0
    manager.finish_step()
    for _ in range(3):  # steps 1-3 train it to adapter step 5, no checkpoint
        t.adapter_step, data.cursor = t.adapter_step + 1, data.cursor + 8
        manager.finish_step()
    manager.drain("a", "removed by request")
    # the runtime's weight sync has nothing to push; it frees the drained adapter (DRAINED -> REMOVED)
    idle = type(
        "Idle",
        (),
        {"tenants": manager, "sync_now": lambda self: manager.apply_sync({}, []), "_drop_ahead": lambda self: None},
    )()  # no rollout ahead (a sync run)
    Runtime.idle_step(idle)  # what the service runs while no tenant is RUNNING
    assert [step for step, _ in list_checkpoints(ckpt.adapter_dir("a"))] == [5]
    again = manager.table.register(_cfg("a", max_steps=100))
    manager.table.activate("a", 0)
    manager._restore(again)
    assert again.adapter_step == 5 and data.loaded == {"cursor": 40}


def test_a_checkpoint_restore_skipped_is_set_aside_and_outranks_nothing(tmp_path):
    """A damaged newest checkpoint that restore skipped stayed where it was: pruning kept it among the `keep_last`
    newest and removed good ones, and a save at its adapter step (the same data cursor, as a deterministic replay
    gives) returned the damaged folder instead of writing one, so the next resume fell back further still."""
    from rl_multilora.checkpoint import CheckpointManager, list_checkpoints
    from rl_multilora.tenants import TenantManager

    data = _Data()
    ckpt = CheckpointManager(tmp_path, keep_last=2)
    manager = TenantManager(None, _Backend(), data, ckpt)

    def start():
        t = manager.table.register(_cfg("a", max_steps=100))
        manager.table.activate("a", 0)
        return t

    t = start()
    for step in (5, 10):
        t.adapter_step = data.cursor = step
        manager.save_checkpoint(t)
        manager.finish_step()
    (ckpt.latest("a") / "adapter_model.safetensors").write_bytes(b"garbage")  # step 10 damaged on disk
    manager.table.tenants.pop("a")  # a restart
    t = start()
    manager._restore(t)
    assert t.adapter_step == 5 and (ckpt.adapter_dir("a") / ".damaged-step_10").is_dir()
    for step in (6, 8, 10):  # trains on: the replay reaches adapter step 10 with the damaged one's cursor
        t.adapter_step = data.cursor = step
        manager.save_checkpoint(t)
        manager.finish_step()
    assert [step for step, _ in list_checkpoints(ckpt.adapter_dir("a"))] == [8, 10]
    manager.table.tenants.pop("a")
    t = start()
    manager._restore(t)
    assert t.adapter_step == 10 and data.loaded == {"cursor": 10}


def test_a_name_equal_to_a_live_ones_but_for_case_is_refused_in_the_config_and_at_runtime():
    """Their checkpoint folders would be one folder on macOS's and Windows' file systems."""
    from rl_multilora.config import ConfigError, parse_run_config

    adapter = {"dataset": {"path": "json"}, "reward": {"name": "gsm8k"}, "max_steps": 2, "rank": 4}
    data = {"model": {"path": "m"}, "adapters": [{**adapter, "name": "math"}, {**adapter, "name": "Math"}]}
    with pytest.raises(ConfigError, match="adapters.1.name='Math' is not allowed; allowed: a name that differs from "
                       "adapters.0.name \\('math'\\) in more than letter case .*file systems ignore case"):  # fmt: skip
        parse_run_config(data)

    c = TenantTable()
    c.register(_cfg("math"))
    with pytest.raises(TenantError, match="'math' differs from it in letter case only"):
        c.register(_cfg("MATH"))
    c.drain("math")
    c.register(_cfg("MATH"))  # the other one left: its folders are no one's now
    assert c.get("MATH").state == TenantState.PENDING
