"""Checkpoint file helpers: optimizer trees round-trip exactly; incomplete and temp folders are ignored."""

import json

import torch

from rl_multilora.checkpoint import CKPT_META, list_checkpoints, load_tree, save_tree


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
