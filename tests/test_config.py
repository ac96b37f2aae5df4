"""Config validation: every shipped YAML validates; mistakes are all reported at once; overrides; CLI exit codes."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rl_multilora.config import ConfigError, apply_overrides, load_run_config, parse_adapter_config, parse_run_config

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "examples" / "multi_lora" / "configs").glob("*.yaml"))


def _adapter(**kw):
    a = {
        "name": "a",
        "rank": 4,
        "dataset": {"path": "json", "data_files": "x.jsonl"},
        "reward": {"name": "gsm8k"},
        "max_steps": 3,
    }
    a.update(kw)
    return a


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = load_run_config(path)
    assert cfg.model.path
    names = [a.name for a in cfg.adapters]
    assert len(names) == len(set(names))


def test_shipped_configs_exist():
    assert any(p.name == "tiny.yaml" for p in SHIPPED)


def test_every_mistake_reported_at_once():
    data = {
        "model": {"path": "m", "max_rank": 8},
        "rollout": {"engine": "vllm", "temperature": -1},
        "adapters": [
            _adapter(name="bad/name", rank=16),
            _adapter(name="b", lr=-1, learning_rate=1e-3),
            _adapter(name="c", reward={"name": "gsm8k", "path": "m:f"}),
        ],
    }
    with pytest.raises(ConfigError) as ei:
        parse_run_config(data, source="x.yaml")
    msg = str(ei.value)
    for fragment in [
        "rollout.engine='vllm'",
        "rollout.temperature=-1",
        # an adapter is named by its name where that is a valid one of its own (as --set and validation name it),
        # by its index where it is not
        "adapters.b.lr=-1",
        "adapters.b.learning_rate=0.001 is not allowed; allowed: no such key",
        "adapters.c.reward",
        "adapters.0.name='bad/name'",
        "adapters.0.rank=16 is not allowed; allowed: an integer <= model.max_rank (8)",
    ]:
        assert fragment in msg, (fragment, msg)
    assert len(ei.value.problems) == 7


def test_duplicate_names_and_budget():
    data = {"model": {"path": "m"}, "adapters": [_adapter(), _adapter()]}
    with pytest.raises(ConfigError, match="adapters.1.name='a' is not allowed; allowed: a name no other adapter"):
        parse_run_config(data)
    no_budget = _adapter()
    del no_budget["max_steps"]
    with pytest.raises(ConfigError, match="needs a budget"):
        parse_run_config({"model": {"path": "m"}, "adapters": [no_budget]})


def test_the_removed_reward_fail_steps_setting_names_its_replacement():
    data = {"model": {"path": "m"}, "rewards": {"fail_steps": 2}, "adapters": [_adapter()]}
    with pytest.raises(ConfigError) as ei:
        parse_run_config(data)
    assert ei.value.problems == [
        "rewards: fail_steps=2 is not allowed; allowed: no such setting any more: the one limit on consecutive "
        "all-failing reward steps is faults.max_reward_fail_steps"
    ]


@pytest.mark.parametrize("name", ["..", ".", "a b", "x/../y", "", "a" * 129])
def test_adapter_names_that_would_escape_paths_are_rejected(name):
    """Names become folder and file names: none escapes RUN_DIR, and none is too long for the file system (a name of
    256 characters used to be admitted and then fail the step that wrote its first checkpoint, for every tenant)."""
    model = parse_run_config({"model": {"path": "m"}}).model
    with pytest.raises(ConfigError, match="name"):
        parse_adapter_config(_adapter(name=name), model)
    assert parse_adapter_config(_adapter(name="a" * 128), model).name == "a" * 128


def test_overrides_by_index_and_by_adapter_name():
    data = {"model": {"path": "m"}, "adapters": [_adapter(name="x"), _adapter(name="y")]}
    apply_overrides(data, ["adapters.y.lr=3e-4", "adapters.0.rank=2", "grpo.kl_coef=0.05", "rollout.stop=[a, b]"])
    cfg = parse_run_config(data)
    assert cfg.adapters[1].lr == 3e-4 and cfg.adapters[0].rank == 2
    assert cfg.grpo.kl_coef == 0.05 and cfg.rollout.stop == ["a", "b"]
    with pytest.raises(ConfigError, match="no list item 'zzz'"):
        apply_overrides(data, ["adapters.zzz.lr=1"])
    with pytest.raises(ConfigError, match="expected key=value"):
        apply_overrides(data, ["grpo.kl_coef"])


def test_cli_bad_config_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {"model": {"path": "m", "max_rank": 4}, "adapters": [_adapter(rank=8, lr=0), _adapter(name="..")]}
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "rl_multilora.cli", "run", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "adapters.a.lr=0" in proc.stderr and "adapters.a.rank=8" in proc.stderr and "adapters.1.name" in proc.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "rl_multilora.cli", "run", str(tmp_path / "nope.yaml")], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ({"trainer": {"world_size": 2}}, "with trainer.world_size > 1 (an output-head LoRA runs on the local backend"),
        (
            {"rollout": {"engine": "sglang"}},
            "with rollout.engine 'sglang' (an output-head LoRA is served by the embedded",
        ),
    ],
)
def test_output_head_lora_is_refused_where_it_is_untried(extra, fragment):
    data = {"model": {"path": "m", "target_modules": ["q_proj", "lm_head"]}, "adapters": [_adapter()], **extra}
    with pytest.raises(ConfigError) as ei:
        parse_run_config(data)
    assert "model.target_modules=['q_proj', 'lm_head'] is not allowed; allowed: a list without 'lm_head'" in str(
        ei.value
    )
    assert fragment in str(ei.value)
    data = {"model": {"path": "m", "target_modules": ["q_proj", "lm_head"]}, "adapters": [_adapter()]}
    assert parse_run_config(data).model.target_modules == ["q_proj", "lm_head"]  # local backend, embedded engine


@pytest.mark.parametrize(
    "model, extra, fragment",
    [
        ({}, {}, "model.lora_autocast=True is not allowed; allowed: false with model.dtype float32"),
        ({"dtype": "bfloat16"}, {"trainer": {"world_size": 2}}, "model.lora_autocast=True is not allowed; allowed: "
         "false with trainer.world_size > 1 (local backend only)"),
    ],
    ids=["float32-base", "ranks"],
)  # fmt: skip
def test_lora_autocast_is_refused_where_it_would_do_nothing_or_is_untried(model, extra, fragment):
    data = {"model": {"path": "m", "lora_autocast": True, **model}, "adapters": [_adapter()], **extra}
    with pytest.raises(ConfigError) as ei:
        parse_run_config(data)
    assert fragment in str(ei.value)
    data = {"model": {"path": "m", "lora_autocast": True, "dtype": "bfloat16"}, "adapters": [_adapter()]}
    assert parse_run_config(data).model.lora_autocast


def test_build_model_passes_lora_autocast(tmp_path):
    import torch
    from tiny_models import save_tiny_model

    from rl_multilora.components import build_model
    from rl_multilora.config import ModelConfig

    path = save_tiny_model(tmp_path / "m")
    for on in (False, True):
        m = build_model(ModelConfig(path=str(path), dtype="bfloat16", lora_autocast=on, device="cpu"))
        assert m.lora_autocast is on
        slots = {p.dtype for n, p in m.named_parameters() if "lora_" in n}
        assert slots == {torch.float32}  # the slots stay float32 either way


def test_adapter_keys_never_give_two_adapters_one_key():
    """A name of digits is its key only where it is its own index: "1" on the first adapter read as the second's."""
    from rl_multilora.config import adapter_keys

    assert adapter_keys([{"name": "1"}, {"name": "bad/name"}]) == ["adapters.0", "adapters.1"]
    assert adapter_keys([{"name": "0"}, {"name": "b"}, {"name": "B"}]) == ["adapters.0", "adapters.1", "adapters.2"]
    assert adapter_keys([{"name": "math"}, {}]) == ["adapters.math", "adapters.1"]
