"""`model.gradient_checkpointing` changes what a training step keeps for its backward, never what it computes: a run
with it writes the same metrics and the same adapter weights, bit for bit, as the run without it. The SmolLM2
example turns it on (examples/multi_lora/configs/smollm2.yaml), so this checks the whole GRPO step (shared-prompt
packing, the recomputed elementwise activations, per-tenant ranks in one micro-batch) on a llama-family model, the
SmolLM2 family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_multilora.checkpoint import CheckpointManager
from rl_multilora.config import parse_run_config
from rl_multilora.loop import run
from rl_multilora.metrics import read_metrics
from tests.tiny_models import save_tiny_model, sum_task_adapter, write_sum_task

TIMINGS = ("_s",)  # wall-time fields (rollout_s, train_s, pause_s, ...): the only ones allowed to differ


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("checkpointing")
    save_tiny_model(root / "model", family="llama", hidden=32, layers=3)
    for name, off in [("a", 1), ("b", 3)]:
        write_sum_task(root / "data" / f"{name}.jsonl", 30, off)
    return root


def _run(ws: Path, run_dir: Path, checkpointing: bool) -> list[dict]:
    cfg = {
        "run_dir": str(run_dir),
        "model": {"path": str(ws / "model"), "max_loras": 2, "max_rank": 8, "gradient_checkpointing": checkpointing},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 6},
        "grpo": {"micro_batch_size": 4},  # several micro-batches per step, each mixing both tenants' rows
        "logging": {"plot": False, "progress": False},
        "rewards": {"num_workers": 1},
        "adapters": [
            sum_task_adapter(ws / "data", "a", 5, max_steps=3),
            sum_task_adapter(ws / "data", "b", 7, max_steps=3, rank=8, alpha=8),
        ],
    }
    run(parse_run_config(cfg))
    return [r for r in read_metrics(run_dir) if r.get("kind") != "eval"]


def test_a_run_with_gradient_checkpointing_equals_the_run_without_bit_for_bit(ws, tmp_path, monkeypatch):
    from rl_multilora.lora import LoRALinear

    lora_forward = LoRALinear.forward
    calls = {(c, b): 0 for c in (False, True) for b in (False, True)}  # (checkpointing, in a backward): LoRA forwards

    def counted(self, x):
        if torch.is_grad_enabled():  # training's forwards (rollout and reference passes run without autograd)
            calls[checkpointing, torch._C._current_graph_task_id() != -1] += 1
        return lora_forward(self, x)

    monkeypatch.setattr(LoRALinear, "forward", counted)
    rows = {}
    for checkpointing in (False, True):
        rows[checkpointing] = _run(ws, tmp_path / f"ckpt_{checkpointing}", checkpointing)
    # The recompute really ran: every LoRA Linear a training forward ran, once more in the backward. Equal metrics alone
    # did not show it: a head probe that reset the layers' training flags turned checkpointing off for the first
    # training micro-batch (43f9afb), and every number stayed the same.
    assert calls[False, False] > 0 and calls[False, True] == 0, calls
    assert calls[True, False] == calls[False, False] and calls[True, True] == calls[True, False], calls
    plain, ckpt = rows[False], rows[True]
    assert len(plain) == len(ckpt) == 6  # 2 tenants x 3 steps
    assert sum(r.get("stepped", False) for r in plain) >= 4  # the comparison covers optimizer steps, not skips
    for a, b in zip(plain, ckpt, strict=True):
        keep = [k for k in a if not k.endswith(TIMINGS)]
        assert {k: a[k] for k in keep} == {k: b.get(k) for k in keep}, (a["adapter"], a["step"])
    for name in ("a", "b"):
        got = [load_file(str(CheckpointManager(tmp_path / f"ckpt_{c}").latest(name) / "adapter_model.safetensors"))
               for c in (False, True)]  # fmt: skip
        assert got[0].keys() == got[1].keys() and len(got[0]) > 0
        for key in got[0]:
            assert torch.equal(got[0][key], got[1][key]), (name, key)
        # the adapters trained: B starts at zero, so a non-zero B means optimizer steps landed
        assert any(k.endswith("lora_B.weight") and got[0][k].abs().sum() > 0 for k in got[0])
