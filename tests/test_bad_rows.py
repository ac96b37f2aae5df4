"""Rows that cannot be used are bad rows of their tenant, counted in `bad_rows`, and never stop the run: a JSONL line
that is not valid UTF-8 (it loads with its file and fails only when decoded) and a prompt longer than the model's
context (the engine would refuse it and fail its whole group)."""

from __future__ import annotations

import json
from pathlib import Path

from rl_multilora.config import parse_run_config
from rl_multilora.loop import run
from rl_multilora.metrics import read_metrics
from tests.tiny_models import save_tiny_model, sum_task_adapter, write_sum_task

CONTEXT = 256  # the tiny model's max_position_embeddings


def _write_with_bad_rows(path: Path) -> None:
    good = [json.dumps({"q": f"{i % 7}+{i % 5}=", "a": str(i % 7 + i % 5)}).encode() for i in range(6)]
    undecodable = b'{"q": "3+\xff\xfe=", "a": "3"}'
    too_long = json.dumps({"q": "1+" * CONTEXT + "1=", "a": "0"}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join([undecodable, *good[:3], too_long, *good[3:]]) + b"\n")


def _cfg(root: Path, run_dir: Path) -> dict:
    return {
        "run_dir": str(run_dir),
        "model": {"path": str(root / "model"), "max_loras": 2, "max_rank": 8},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 6},
        "grpo": {"micro_batch_size": 8, "drop_uniform_groups": False},
        "logging": {"plot": False, "progress": False},
        "rewards": {"num_workers": 1},
        "checkpoint": {"save_every": 1},
        "adapters": [
            sum_task_adapter(root / "data", "bad", 5, epochs=1.0, max_steps=20),
            sum_task_adapter(root / "data", "good", 6, max_steps=3),
        ],
    }


def test_undecodable_and_over_long_rows_are_bad_rows_of_their_tenant(tmp_path):
    save_tiny_model(tmp_path / "model", hidden=32, layers=2)
    _write_with_bad_rows(tmp_path / "data" / "bad.jsonl")
    write_sum_task(tmp_path / "data" / "good.jsonl", 20, 1)
    cfg = parse_run_config(_cfg(tmp_path, tmp_path / "run"))
    rt = run(cfg)
    bad, good = rt.tenants.get("bad"), rt.tenants.get("good")
    assert bad.state.value == "REMOVED" and bad.reason == "budget reached"  # its 6 good rows used: 3 steps of 2
    assert good.state.value == "REMOVED" and good.adapter_step == 3
    rows = [r for r in read_metrics(tmp_path / "run") if r["adapter"] == "bad"]
    assert rows[-1]["bad_rows"] == 2 and sum(r["n_samples"] for r in rows) == 6 * 4
    assert rows[-1]["bad_row_reasons"] == {"undecodable_row": 1, "prompt_exceeds_context": 1}, rows[-1]
    assert all(r["failed_samples"] == 0 for r in read_metrics(tmp_path / "run") if "failed_samples" in r)
    # The same command again resumes (nothing left to do) instead of crashing on the same rows.
    again = run(cfg)
    assert again.tenants.get("bad").state.value == "REMOVED"


def test_the_data_source_names_each_bad_rows_reason(tmp_path):
    from rollout.data_source import DatasetSpec, MultiLoRADataSource
    from rollout.types import AdapterRef, RewardSpec
    from tests.tiny_models import tiny_tokenizer

    _write_with_bad_rows(tmp_path / "bad.jsonl")
    source = MultiLoRADataSource(tiny_tokenizer(), context_len=CONTEXT)
    spec = DatasetSpec("json", data_files=str(tmp_path / "bad.jsonl"), prompt_key="q", label_key="a")
    source.add_adapter(
        AdapterRef("a", 0), spec, RewardSpec(name="gsm8k"), seed=0, prompts_per_step=8, n_samples_per_prompt=1,
        max_epochs=1.0,
    )  # fmt: skip
    groups = source.next_groups(["a"])["a"]
    assert len(groups) == 6
    assert source.stats("a")["bad_row_reasons"] == {"undecodable_row": 1, "prompt_exceeds_context": 1}
