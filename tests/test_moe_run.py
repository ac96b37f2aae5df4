"""A GRPO run on a Qwen3-MoE base with expert LoRA (`model.target_parameters`), end to end through the run loop.

Two tenants on a tiny random Qwen3-MoE (4 experts, top-2): one trains the experts and the attention Linears, one
only the experts' `down_proj`. The run goes through config -> backend -> engine bank -> GRPO -> checkpoints; its
checkpoints are PEFT `target_parameters` folders that PEFT loads with the slot's logits; a stop + resume ends where
an uninterrupted run ends; the tenants' expert LoRA stays within what each one targets.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_multilora.checkpoint import CheckpointManager
from rl_multilora.config import parse_run_config
from rl_multilora.loop import run
from rl_multilora.metrics import read_metrics
from tests.tiny_models import MOE_EXPERTS, save_tiny_model, sum_task_adapter, write_sum_task


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("moe_run")
    save_tiny_model(root / "model", family="qwen3_moe", hidden=32, layers=2)
    write_sum_task(root / "data" / "both.jsonl", 40, 1)
    write_sum_task(root / "data" / "down.jsonl", 40, 3)
    return root


def _config(root: Path, run_dir: Path, expert_lora: str = "per_expert", **over) -> dict:
    cfg = {
        "run_dir": str(run_dir),
        "model": {
            "path": str(root / "model"),
            "max_loras": 2,
            "max_rank": 8,
            "target_modules": ["q_proj", "v_proj"],
            "target_parameters": MOE_EXPERTS,
            "expert_lora": expert_lora,
        },
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 6},
        "grpo": {"micro_batch_size": 8, "drop_uniform_groups": False},
        "checkpoint": {"save_every": 2, "keep_last": 2},
        "logging": {"plot": False, "progress": False},
        "rewards": {"num_workers": 1},
        "adapters": [
            sum_task_adapter(root / "data", "both", 7, max_steps=4),
            sum_task_adapter(
                root / "data", "down", 11, rank=2, max_steps=4, target_modules=[],
                target_parameters=["mlp.experts.down_proj"],
            ),
        ],
    }  # fmt: skip
    cfg.update(over)
    return cfg


@pytest.fixture(scope="module")
def reference(workspace, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    run(parse_run_config(_config(workspace, run_dir)))
    return run_dir


def test_both_tenants_train_their_expert_lora_and_checkpoints_load_in_peft(workspace, reference):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rl_multilora.lora import MultiLoRAModel

    rows = read_metrics(reference)
    assert {r["adapter"] for r in rows} == {"both", "down"}
    assert max(r["adapter_step"] for r in rows if r["adapter"] == "down") == 4
    ckpt = CheckpointManager(reference)
    both, down = ckpt.latest("both"), ckpt.latest("down")
    down_config = json.loads((down / "adapter_config.json").read_text())
    # the shortest PEFT selection of exactly the covered Parameters (PEFT matches it as a name suffix)
    assert down_config["target_parameters"] == ["experts.down_proj"] and down_config["target_modules"] == []
    both_config = json.loads((both / "adapter_config.json").read_text())
    assert sorted(both_config["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]
    assert sorted(both_config["target_modules"]) == ["q_proj", "v_proj"]
    tensors = load_file(str(both / "adapter_model.safetensors"))
    b_keys = [k for k in tensors if "experts" in k and k.endswith("lora_B.weight")]
    assert len(b_keys) == 4 and all(tensors[k].abs().sum() > 0 for k in b_keys)  # experts trained (B starts at 0)

    ids = torch.tensor([[5, 17, 42, 9, 77, 3, 60, 21]])
    path = workspace / "model"
    ml = MultiLoRAModel.from_pretrained(path, 2, 8, ["q_proj", "v_proj"], target_parameters=MOE_EXPERTS)
    for name, folder in (("both", both), ("down", down)):
        ml.load_adapter(name, folder)
        with torch.no_grad():
            slot_logits = ml(ids, adapter_names=[name]).logits
            peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path), folder).eval()
            base = AutoModelForCausalLM.from_pretrained(path).eval()(input_ids=ids).logits
            torch.testing.assert_close(slot_logits, peft(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(slot_logits, base, atol=1e-5), name


def test_stop_then_resume_matches_the_uninterrupted_run(workspace, reference, tmp_path):
    run_dir = tmp_path / "run"
    cfg = _config(workspace, run_dir)
    run(parse_run_config(dict(cfg, max_global_steps=2)))
    run(parse_run_config(cfg))
    for name in ("both", "down"):
        got = load_file(str(CheckpointManager(run_dir).latest(name) / "adapter_model.safetensors"))
        want = load_file(str(CheckpointManager(reference).latest(name) / "adapter_model.safetensors"))
        assert sorted(got) == sorted(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")


def test_shared_a_run_writes_peft_folders_with_one_a_for_all_experts(workspace, tmp_path):
    run_dir = tmp_path / "shared"
    cfg = _config(workspace, run_dir, expert_lora="shared_a")
    cfg["adapters"] = cfg["adapters"][:1]
    cfg["adapters"][0]["max_steps"] = 2
    run(parse_run_config(cfg))
    tensors = load_file(str(CheckpointManager(run_dir).latest("both") / "adapter_model.safetensors"))
    a_keys = [k for k in tensors if "experts" in k and k.endswith("lora_A.weight")]
    assert len(a_keys) == 4
    for key in a_keys:
        per_expert = tensors[key].view(4, 4, -1)  # (E, r, in): the A of every expert is the same trained A
        assert all(torch.equal(per_expert[0], per_expert[e]) for e in range(1, 4)), key
