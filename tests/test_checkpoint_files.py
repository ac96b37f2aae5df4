"""Checkpoint file helpers: optimizer trees round-trip exactly; incomplete and temp folders are ignored."""

import json

import torch

from rl_multilora.checkpoint import (
    CKPT_META,
    AdapterSnapshot,
    CheckpointManager,
    list_checkpoints,
    load_tree,
    save_tree,
)


def test_optimizer_state_round_trip(tmp_path):
    p = torch.nn.Parameter(torch.randn(3, 4))
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    p.grad = torch.randn(3, 4)
    opt.step()
    sched.step()
    tree = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict() | {"lr_lambdas": [None]}, "step": 7}
    save_tree(tree, tmp_path, "optimizer")
    back = load_tree(tmp_path, "optimizer")
    assert back["step"] == 7
    assert set(back["optimizer"]["state"]) == {0}  # int keys survive
    for k, v in tree["optimizer"]["state"][0].items():
        assert torch.equal(back["optimizer"]["state"][0][k], v)
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    opt2 = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone())], lr=1e-3)
    opt2.load_state_dict(back["optimizer"])  # loads as a real optimizer state
    assert not list(tmp_path.glob("*.pkl")) and not list(tmp_path.glob("*.pt"))


def test_list_checkpoints_uses_meta_not_names(tmp_path):
    for name, step, complete in [
        ("step_3", 3, True),
        ("step_latest", 5, True),
        ("step_9", 9, False),
        (".tmp-step_7-x", 7, True),
    ]:
        d = tmp_path / name
        d.mkdir()
        if complete:
            (d / CKPT_META).write_text(json.dumps({"adapter_step": step}))
    (tmp_path / "step_8").mkdir()
    (tmp_path / "step_8" / CKPT_META).write_text("{half-written")
    assert [(s, d.name) for s, d in list_checkpoints(tmp_path)] == [(3, "step_3"), (5, "step_latest")]


def test_a_checkpoint_pruned_while_it_is_listed_is_skipped(tmp_path, monkeypatch):
    """A service submission lists a RUNNING adapter's checkpoints in the caller's thread while the training thread
    may prune one: its meta file is gone between the listing and the read (a reviewer hit FileNotFoundError 3 times
    in 505,967 checks)."""
    from pathlib import Path

    for step in (2, 4):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / CKPT_META).write_text(json.dumps({"adapter_step": step}))
    read_text = Path.read_text

    def pruned_meanwhile(self, *args, **kwargs):
        if self.parent.name == "step_2":
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", pruned_meanwhile)
    assert [(s, d.name) for s, d in list_checkpoints(tmp_path)] == [(4, "step_4")]


def _snapshot(adapter_step: int, global_step: int) -> AdapterSnapshot:
    """A checkpoint written inside global step `global_step` (it counts once the run state records that step done)."""
    tensors = {
        "base_model.model.l.lora_A.weight": torch.full((2, 3), float(adapter_step)),
        "base_model.model.l.lora_B.weight": torch.zeros(3, 2),
    }
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["l"]}
    meta = {"adapter_step": adapter_step, "global_step": global_step, "steps_done": global_step + 1}
    return AdapterSnapshot(tensors, config, {"step": adapter_step}, {"cursor": adapter_step}, meta)


def test_keep_last_one_keeps_the_committed_checkpoint_until_a_newer_one_counts(tmp_path):
    """keep_last 1: a save inside a step, then a kill before the run state records that step done. The checkpoint
    before it is still there, and it is what a resume takes (it was pruned at the save, and the adapter started
    over: a CI run of `rl-multilora serve` killed with SIGKILL resumed its GRPO tenant at adapter step 1)."""
    ckpt = CheckpointManager(tmp_path, keep_last=1)
    ckpt.save_adapter("t1", _snapshot(adapter_step=4, global_step=9))
    ckpt.write_run_state({"global_step": 10, "adapters": {}})  # step 9 finished: the step-4 checkpoint counts
    ckpt.save_adapter("t1", _snapshot(adapter_step=5, global_step=11))  # inside step 11; killed before its end
    assert [s for s, _ in list_checkpoints(ckpt.adapter_dir("t1"))] == [4, 5]
    candidates = ckpt.restore_candidates("t1", committed_step=10)
    assert [meta["adapter_step"] for _, meta in candidates] == [4]
    assert [s for s, _ in list_checkpoints(ckpt.adapter_dir("t1"))] == [4]  # the uncommitted one is discarded
    # Step 11 again, and this time it finishes: the run state's commit prunes down to keep_last.
    ckpt.save_adapter("t1", _snapshot(adapter_step=5, global_step=11))
    assert [s for s, _ in list_checkpoints(ckpt.adapter_dir("t1"))] == [4, 5]
    ckpt.write_run_state({"global_step": 12, "adapters": {}})
    assert [s for s, _ in list_checkpoints(ckpt.adapter_dir("t1"))] == [5]
