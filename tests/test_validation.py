"""One validation path: `--dry-run` and `run` agree on every malformed config, and neither prints a traceback.

Each config below is a mistake a user makes; `run --dry-run` and `run` must both refuse it (exit 2, the same
problem lines, no traceback). The first ones are those `--dry-run` used to call valid before `run` crashed, or that
were silently accepted.
"""

from __future__ import annotations

import copy
import json
import logging
import sys
from pathlib import Path

import pytest
import yaml

from rl_multilora import cli
from tests.tiny_models import save_tiny_model, sum_task_adapter, write_sum_task


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("validation")
    save_tiny_model(root / "model", hidden=32, layers=2)
    write_sum_task(root / "data" / "a.jsonl", 20, 1)
    (root / "data" / "empty_rows.jsonl").write_text("".join(json.dumps({"q": "", "a": ""}) + "\n" for _ in range(5)))
    (root / "data" / "empty.jsonl").write_text("")
    (root / "data" / "nolabel.jsonl").write_text(json.dumps({"q": "1+1="}) + "\n")
    long = "".join(json.dumps({"q": "1+1=" * 300, "a": "2"}) + "\n" for _ in range(4))  # past the tiny context
    (root / "data" / "long.jsonl").write_text(long)
    # a script with sys.exit at top level, as an environment module (written here: pytest's doctest collection
    # imports every module under tests/, and this one would end the collection)
    (root / "plugins").mkdir()
    (root / "plugins" / "env_exits_at_import.py").write_text("import sys\n\nsys.exit(0)\n")
    sys.path.insert(0, str(root / "plugins"))
    (root / "a_file").write_text("x")
    yield root
    sys.path.remove(str(root / "plugins"))


def _base(ws: Path) -> dict:
    return {
        "run_dir": str(ws / "runs" / "x"),
        "model": {"path": str(ws / "model"), "max_loras": 2, "max_rank": 8, "device": "cpu"},
        "rollout": {"n_samples_per_prompt": 2, "max_new_tokens": 4},
        "logging": {"plot": False, "progress": False},
        "rewards": {"num_workers": 1},
        "adapters": [sum_task_adapter(ws / "data", "a", 1, max_steps=2)],
    }


def _adapter(d: dict) -> dict:
    return d["adapters"][0]


# (id, how to break the valid base config, a fragment the error must contain)
CASES = [
    # dry-run used to say valid, then run crashed with a traceback
    ("model-path-missing", lambda d, ws: d["model"].update(path=str(ws / "nope")), "model.path="),
    ("model-path-is-file", lambda d, ws: d["model"].update(path=str(ws / "a_file")), "this is a file"),
    ("model-path-no-config", lambda d, ws: d["model"].update(path=str(ws / "data")), "config.json"),
    ("device-tpu", lambda d, ws: d["model"].update(device="tpu"), "model.device='tpu'"),
    ("device-cuda-none", lambda d, ws: d["model"].update(device="cuda:0"), "no CUDA device"),
    ("model-targets-bogus", lambda d, ws: d["model"].update(target_modules=["nope_proj"]), "matches no module"),
    ("adapter-targets-bogus", lambda d, ws: _adapter(d).update(target_modules=["nope_proj"]), "match none"),
    (
        "model-target-parameters-dense",
        lambda d, ws: d["model"].update(target_parameters=["mlp.experts.down_proj"]),
        "model.target_parameters=['mlp.experts.down_proj'] is not allowed",
    ),
    (
        "model-target-parameters-not-experts",
        lambda d, ws: d["model"].update(target_parameters=["mlp.down_proj.weight"]),
        "not a packed 3-D expert weight",
    ),
    (
        "adapter-target-parameters-no-model",
        lambda d, ws: _adapter(d).update(target_parameters=["mlp.experts.down_proj"]),
        "target_parameters=['mlp.experts.down_proj'] is not allowed; allowed: null or []",
    ),
    ("expert-lora-bad", lambda d, ws: d["model"].update(expert_lora="shared_b"), "expert_lora='shared_b'"),
    ("epochs-inf", lambda d, ws: _adapter(d).update(epochs=float("inf")), "epochs=inf"),
    (
        "cosine-max-le-warmup",
        lambda d, ws: _adapter(d).update(optim={"schedule": "cosine", "warmup_steps": 2}),
        "cosine",
    ),
    (
        "cosine-epochs-only",
        lambda d, ws: _adapter(d).update(optim={"schedule": "cosine"}, max_steps=None, epochs=1.0),
        "max_steps=None",
    ),
    ("name-trailing-newline", lambda d, ws: _adapter(d).update(name="a\n"), "name='a\\n'"),
    # silently accepted before
    ("lr-inf", lambda d, ws: _adapter(d).update(lr=float("inf")), "lr=inf"),
    ("rank-true", lambda d, ws: _adapter(d).update(rank=True), "rank=True"),
    (
        "rows-all-empty",
        lambda d, ws: _adapter(d)["dataset"].update(data_files=str(ws / "data" / "empty_rows.jsonl")),
        "at least one usable row",
    ),
    ("hooks-missing", lambda d, ws: d["rollout"].update(hooks="no_such_module_xyz:Hooks"), "rollout.hooks"),
    ("hooks-not-class", lambda d, ws: d["rollout"].update(hooks="rl_multilora.cli:main"), "rollout.hooks"),
    # more mistakes, all refused by both
    (
        "empty-file",
        lambda d, ws: _adapter(d)["dataset"].update(data_files=str(ws / "data" / "empty.jsonl")),
        "at least one usable row; this one has no rows",
    ),
    (
        "eval-split-empty",
        lambda d, ws: d.update(eval={"enabled": True, "data_files": {"test": str(ws / "data" / "empty.jsonl")}}),
        "eval: the split has no rows",
    ),
    (
        "eval-split-missing",
        lambda d, ws: d.update(eval={"enabled": True}),
        "eval.split='test'",
    ),
    (
        "no-label-column",
        lambda d, ws: _adapter(d)["dataset"].update(data_files=str(ws / "data" / "nolabel.jsonl")),
        "label_key",
    ),
    (
        "data-file-missing",
        lambda d, ws: _adapter(d)["dataset"].update(data_files=str(ws / "nope.jsonl")),
        "does not exist",
    ),
    ("prompt-key-wrong", lambda d, ws: _adapter(d)["dataset"].update(prompt_key="question"), "prompt_key"),
    ("reward-unknown", lambda d, ws: _adapter(d).update(reward={"name": "gsm9k"}), "gsm9k"),
    ("reward-both", lambda d, ws: _adapter(d).update(reward={"name": "gsm8k", "path": "m:f"}), "exactly one"),
    ("reward-neither", lambda d, ws: _adapter(d).update(reward={"kwargs": {}}), "exactly one"),
    ("reward-path-bad", lambda d, ws: _adapter(d).update(reward={"path": "no_such_mod_q:f"}), "reward"),
    ("reward-timeout-0", lambda d, ws: _adapter(d)["reward"].update(timeout_s=0), "timeout_s=0"),
    (
        "reward-failure-nan",
        lambda d, ws: _adapter(d)["reward"].update(failure_value=float("nan")),
        "failure_value=nan",
    ),
    ("reward-kwargs-bad", lambda d, ws: _adapter(d)["reward"].update(kwargs={"pattern": "("}), "pattern"),
    ("rank-above-max", lambda d, ws: _adapter(d).update(rank=16), "rank=16"),
    ("rank-zero", lambda d, ws: _adapter(d).update(rank=0), "rank=0"),
    ("alpha-negative", lambda d, ws: _adapter(d).update(alpha=-1), "alpha=-1"),
    ("lr-string", lambda d, ws: _adapter(d).update(lr="fast"), "lr='fast'"),
    ("no-budget", lambda d, ws: _adapter(d).update(max_steps=None), "needs a budget"),
    ("max-steps-float", lambda d, ws: _adapter(d).update(max_steps=2.5), "max_steps=2.5"),
    ("prompts-zero", lambda d, ws: _adapter(d).update(prompts_per_step=0), "prompts_per_step=0"),
    ("unknown-key", lambda d, ws: _adapter(d).update(learning_rate=1e-3), "learning_rate"),
    ("name-slash", lambda d, ws: _adapter(d).update(name="a/b"), "name='a/b'"),
    ("name-dotdot", lambda d, ws: _adapter(d).update(name=".."), "name='..'"),
    ("name-duplicate", lambda d, ws: d["adapters"].append(copy.deepcopy(_adapter(d))), "no other adapter"),
    ("eps-clip-1", lambda d, ws: d.update(grpo={"eps_clip": 1.0}), "eps_clip=1.0"),
    ("kl-type-bad", lambda d, ws: d.update(grpo={"kl_type": "k2"}), "kl_type='k2'"),
    ("ppo-epochs-0", lambda d, ws: d.update(grpo={"ppo_epochs": 0}), "ppo_epochs=0"),
    ("engine-bad", lambda d, ws: d["rollout"].update(engine="vllm"), "engine='vllm'"),
    ("http-no-url", lambda d, ws: d["rollout"].update(engine="http"), "rollout.url"),
    ("temperature-neg", lambda d, ws: d["rollout"].update(temperature=-1), "temperature=-1"),
    ("dtype-bad", lambda d, ws: d["model"].update(dtype="float8"), "dtype='float8'"),
    ("max-loras-0", lambda d, ws: d["model"].update(max_loras=0), "max_loras=0"),
    ("max-idle-0", lambda d, ws: d.update(faults={"max_idle_steps": 0}), "max_idle_steps=0"),
    ("betas-bad", lambda d, ws: _adapter(d).update(optim={"betas": [0.9, 1.5]}), "betas"),
    (
        "resume-always-nothing-to-resume",
        lambda d, ws: d.update(checkpoint={"resume": "always"}),
        "checkpoint.resume='always' is not allowed",
    ),
    ("top-level-list", None, "YAML mapping"),
    # a reviewer's: --dry-run called these valid, then the run crashed, wasted its steps or filled memory
    ("seed-negative", lambda d, ws: d.update(seed=-1), "seed=-1"),
    ("adapter-seed-huge", lambda d, ws: _adapter(d).update(seed=2**70), "less than or equal to 4294967295"),
    ("top-k-negative", lambda d, ws: d["rollout"].update(top_k=-5), "top_k=-5"),
    ("adapter-top-k-negative", lambda d, ws: _adapter(d).update(sampling={"top_k": -2}), "top_k=-2"),
    ("stop-empty-string", lambda d, ws: d["rollout"].update(stop=[""]), "non-empty strings"),
    ("group-of-one", lambda d, ws: d["rollout"].update(n_samples_per_prompt=1), "n_samples_per_prompt=1"),
    ("adapter-group-of-one", lambda d, ws: _adapter(d).update(n_samples_per_prompt=1), "n_samples_per_prompt=1"),
    ("prompts-past-the-dataset", lambda d, ws: _adapter(d).update(prompts_per_step=10**11), "at most the dataset's"),
    ("run-dir-is-a-file", lambda d, ws: d.update(run_dir=str(ws / "a_file")), "run_dir="),
    ("no-adapters", lambda d, ws: d.update(adapters=[]), "adapters=[] is not allowed"),
    # a reviewer's: read by no one (the embedded engine ran), or a crash with a traceback once the engine was built
    ("url-with-embedded", lambda d, ws: d["rollout"].update(url="http://127.0.0.1:1"), "rollout.url='http://127.0"),
    ("url-not-a-url", lambda d, ws: d["rollout"].update(engine="http", url="notaurl"), "rollout.url='notaurl'"),
    # a reviewer's: an environment module that exits at import made both exit 0 having done nothing; the others were
    # called valid, then every episode failed, or no row was ever drawn
    (
        "env-exits-at-import",
        lambda d, ws: _adapter(d).update(environment={"path": "env_exits_at_import:E"}),
        "environment.path='env_exits_at_import:E' does not load: SystemExit: 0 (it exits at import",
    ),
    (
        "env-without-step",
        lambda d, ws: _adapter(d).update(environment={"path": "tests.env_plugins:NoStep"}),
        "NoStep does not define step(action) -> EnvStep",
    ),
    (
        "env-constructor-past-turn-timeout",
        lambda d, ws: _adapter(d).update(
            environment={"path": "tests.env_plugins:SlowInit", "kwargs": {"delay": 3.0}, "turn_timeout_s": 0.3}
        ),
        "building it ran past environment.turn_timeout_s=0.3",
    ),
    (
        "no-prompt-fits-the-context",
        lambda d, ws: _adapter(d)["dataset"].update(data_files=str(ws / "data" / "long.jsonl")),
        "all 4 rows would be skipped (4 prompt_exceeds_context)",
    ),
]


def _write(ws: Path, case_id: str, mutate) -> Path:
    path = ws / f"{case_id}.yaml"
    if mutate is None:
        path.write_text("- a\n- b\n")
        return path
    data = _base(ws)
    mutate(data, ws)
    path.write_text(yaml.safe_dump(data))
    return path


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    code = cli.main(argv)  # in process: an uncaught exception (a traceback) fails the test here
    err = capsys.readouterr().err
    # the error report only (progress bars of `datasets` also write to stderr)
    return code, "\n".join(line for line in err.splitlines() if line.startswith(("error:", "  - ", "Traceback")))


@pytest.mark.parametrize(("case_id", "mutate", "fragment"), CASES, ids=[c[0] for c in CASES])
def test_dry_run_and_run_agree_on_malformed_configs(ws, capsys, case_id, mutate, fragment):
    path = _write(ws, case_id, mutate)
    dry_code, dry_err = _cli(["run", str(path), "--dry-run"], capsys)
    run_code, run_err = _cli(["run", str(path)], capsys)
    assert (dry_code, run_code) == (2, 2), (dry_err, run_err)
    assert fragment in dry_err, dry_err
    assert dry_err == run_err  # the same problems, found by the same path
    assert "Traceback" not in dry_err + run_err
    assert not (ws / "runs" / "x" / "run_state.json").exists()  # run refused before writing anything


def test_at_least_40_cases():
    assert len(CASES) >= 40


def test_the_valid_base_config_is_valid(ws, capsys):
    path = _write(ws, "valid", lambda d, ws: None)
    code, err = _cli(["run", str(path), "--dry-run"], capsys)
    assert code == 0, err


def test_top_k_zero_means_off_and_wandb_must_be_importable(ws, capsys, monkeypatch):
    """top_k 0 is off in HF and vLLM: it becomes the engines' -1 (it failed every sample before). wandb turned on
    without wandb installed is refused before the run (it raised ModuleNotFoundError once the run had started)."""
    import importlib.util

    from rl_multilora.config import parse_run_config

    cfg = _base(ws)
    cfg["rollout"]["top_k"] = 0
    _adapter(cfg)["sampling"] = {"top_k": 0}
    parsed = parse_run_config(cfg)
    assert parsed.rollout.top_k == -1 and parsed.adapters[0].sampling.top_k == -1
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    path = _write(ws, "wandb-missing", lambda d, ws: d.update(logging={"wandb": {"mode": "offline"}}))
    for extra in (["--dry-run"], []):
        code, err = _cli(["run", str(path), *extra], capsys)
        assert code == 2 and "logging.wandb.mode='offline' is not allowed; allowed: 'disabled' here" in err, err


def test_export_refuses_a_name_that_is_not_a_folder_name(ws, capsys):
    code, err = _cli(["export", str(ws / "runs" / "x"), "../../etc", str(ws / "out")], capsys)
    assert code == 2 and "NAME: " in err and "'../../etc'" in err and "Traceback" not in err
    assert not (ws / "out").exists()


def test_a_full_disk_ends_with_a_clear_message_and_the_last_checkpoint_intact(ws, capsys, monkeypatch):
    """ENOSPC while a checkpoint is written: exit 2 naming the path, no traceback; the previous checkpoint loads."""
    import errno

    from rl_multilora.checkpoint import CheckpointManager

    data = _base(ws)
    data["run_dir"] = str(ws / "runs" / "disk")
    _adapter(data).update(max_steps=4)
    data["checkpoint"] = {"save_every": 1, "keep_last": 5}
    path = ws / "disk.yaml"
    path.write_text(yaml.safe_dump(data))
    real_save = CheckpointManager.save_adapter
    calls = []

    def save_then_fail(self, name, snap):
        calls.append(name)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.adapter_dir(name) / ".tmp-step_2"))
        return real_save(self, name, snap)

    monkeypatch.setattr(CheckpointManager, "save_adapter", save_then_fail)
    logging.getLogger("rl_multilora").setLevel(logging.WARNING)
    code, err = _cli(["run", str(path)], capsys)
    assert code == 2 and "Traceback" not in err
    assert "No space left on device" in err and "ENOSPC" in err and ".tmp-step_2" in err
    cks = CheckpointManager(ws / "runs" / "disk").latest("a")
    assert cks is not None and json.loads((cks / "checkpoint.json").read_text())["adapter_step"] == 1


def test_temp_files_left_by_a_kill_are_removed_at_the_next_start(ws, capsys):
    data = _base(ws)
    run_dir = ws / "runs" / "temps"
    data["run_dir"] = str(run_dir)
    _adapter(data).update(max_steps=1)
    (run_dir / "adapters" / "a" / ".tmp-step_3-abc").mkdir(parents=True)
    (run_dir / ".tmp-run_state.json-xyz").write_text("{")
    path = ws / "temps.yaml"
    path.write_text(yaml.safe_dump(data))
    code, err = _cli(["run", str(path)], capsys)
    assert code == 0, err
    assert not (run_dir / ".tmp-run_state.json-xyz").exists()
    assert not (run_dir / "adapters" / "a" / ".tmp-step_3-abc").exists()


def test_resume_and_fresh_flags(ws, capsys):
    """--resume on a run dir with nothing to resume is refused by --dry-run as by run; --resume --fresh is a usage
    error (they used to be accepted together, --fresh winning)."""
    path = _write(ws, "flags", lambda d, ws: d.update(run_dir=str(ws / "runs" / "empty")))
    dry_code, dry_err = _cli(["run", str(path), "--resume", "--dry-run"], capsys)
    run_code, run_err = _cli(["run", str(path), "--resume"], capsys)
    assert (dry_code, run_code) == (2, 2) and dry_err == run_err, (dry_err, run_err)
    assert "has no run_state.json and no checkpoint" in dry_err and "Traceback" not in dry_err
    assert _cli(["run", str(path), "--dry-run"], capsys)[0] == 0
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", str(path), "--resume", "--fresh", "--dry-run"])
    assert exit_.value.code == 2
    assert "argument --fresh: not allowed with argument --resume" in capsys.readouterr().err


def test_dry_run_refuses_a_jemalloc_run_cannot_find(ws, capsys, monkeypatch):
    from rl_multilora.host_memory import JEMALLOC_ENV, jemalloc_loaded

    if jemalloc_loaded():
        pytest.skip("this process runs under jemalloc: model.host_allocator needs no library to preload")
    monkeypatch.setenv(JEMALLOC_ENV, str(ws / "nonexistent.so"))
    path = _write(ws, "jemalloc", lambda d, ws: d["model"].update(host_allocator="jemalloc"))
    dry_code, dry_err = _cli(["run", str(path), "--dry-run"], capsys)
    run_code, run_err = _cli(["run", str(path)], capsys)
    assert (dry_code, run_code) == (2, 2) and dry_err == run_err, (dry_err, run_err)
    assert f"{JEMALLOC_ENV}='{ws / 'nonexistent.so'}' is not allowed" in dry_err


def test_run_exits_1_when_an_adapter_failed_and_keeps_the_others(ws, capsys):
    """An adapter whose reward always raises ends FAILED: `run` prints the summary, then exits 1 naming it and why;
    the healthy adapter trained to its budget and its checkpoint is there."""
    run_dir = ws / "runs" / "failed"

    def mutate(d, ws):
        d["run_dir"] = str(run_dir)
        d["faults"] = {"max_reward_fail_steps": 1}
        raising = sum_task_adapter(
            ws / "data", "a", 2, max_steps=2, reward={"path": "tests.reward_plugins:raising_reward"}
        )
        d["adapters"].append({**raising, "name": "boom"})

    path = _write(ws, "failed", mutate)
    logging.getLogger("rl_multilora").setLevel(logging.WARNING)
    code = cli.main(["run", str(path)])
    out, err = capsys.readouterr()
    assert code == 1, err[-2000:]
    assert "run finished" in out and "Traceback" not in err
    assert "error: 1 of 2 adapter(s) FAILED (boom: " in err, err[-2000:]
    lines = [line.split()[:2] for line in out.splitlines() if line.startswith("  ")]
    assert lines == [["a", "REMOVED"], ["boom", "FAILED"]], out
    from rl_multilora.checkpoint import CheckpointManager

    healthy = CheckpointManager(run_dir).latest("a")
    assert healthy is not None and json.loads((healthy / "checkpoint.json").read_text())["adapter_step"] == 2


def test_the_summary_has_a_line_for_a_tenant_none_of_whose_samples_was_scored(ws, capsys):
    """Every episode of `envboom` fails: no metrics row holds a reward mean, and the summary left it out (a
    reviewer's find: the tenant that needs a look was the one not shown)."""

    def mutate(d, ws):
        d["run_dir"] = str(ws / "runs" / "unscored")
        d["max_global_steps"] = 2
        episodes = sum_task_adapter(
            ws / "data", "a", 3, max_steps=2, environment={"path": "tests.env_plugins:Raising"}
        )
        d["adapters"].append({**episodes, "name": "envboom"})

    assert cli.main(["run", str(_write(ws, "unscored", mutate))]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines() if line.startswith("  ")] == ["a", "envboom"], out
    assert "  envboom      RUNNING  no reward in its metrics: no step scored a sample (0 steps)" in out, out


def test_a_config_inside_its_own_run_dir_is_not_replaced_by_the_run(ws, capsys):
    """`run_dir: .` beside CONFIG (or RUN_DIR/config.yaml as CONFIG): the run wrote its resolved config over the
    user's file, comments and layout gone, without a word (a reviewer's repro). Refused now, naming run_dir; a file
    that is already the run's own dump of this config (resuming from it) is fine."""
    from rl_multilora.config import dump_config, parse_run_config

    folder = ws / "own"
    folder.mkdir()
    data = _base(ws)
    data["run_dir"] = str(folder)
    path = folder / "config.yaml"
    text = "# my notes\n" + yaml.safe_dump(data)
    path.write_text(text)
    for extra in (["--dry-run"], []):
        code, err = _cli(["run", str(path), *extra], capsys)
        assert code == 2 and f"run_dir={str(folder)!r} is not allowed" in err and "Traceback" not in err, err
    assert path.read_text() == text
    path.write_text(dump_config(parse_run_config(data)))  # what a run writes there: a resume may run from it
    for extra in ([], ["--resume"], ["--fresh"], ["--set", "seed=3"]):  # the command line changes cfg, not the file
        code, err = _cli(["run", str(path), "--dry-run", *extra], capsys)
        assert code == 0 or "run_dir=" not in err, (extra, err)


def test_a_folder_as_config_and_a_set_without_a_key_say_so(ws, capsys):
    code, err = _cli(["run", str(ws), "--dry-run"], capsys)
    assert code == 2 and "a YAML file; this is a folder" in err, err
    path = _write(ws, "valid-set", lambda d, ws: None)
    code, err = _cli(["run", str(path), "--set", "=3", "--dry-run"], capsys)
    assert code == 2 and "--set '=3': expected key=value" in err, err


def test_set_values_with_a_hash_and_duplicate_yaml_keys(ws, capsys):
    """A reviewer's repros: `--set` parsed its value as YAML, so ` #` and all after it went as a comment
    (`system_prompt=... end with #### N` lost its format); a key written twice in a config kept the last silently."""
    from rl_multilora.config import load_run_config

    path = _write(ws, "hash", lambda d, ws: None)
    prompt = "Solve it and end with #### N"
    cfg = load_run_config(path, [f"adapters.0.dataset.system_prompt={prompt}", "seed=3", 'run_dir="runs/x #1"'])
    assert cfg.adapters[0].dataset.system_prompt == prompt and cfg.seed == 3 and cfg.run_dir == "runs/x #1"
    text = path.read_text()
    path.write_text("? [1, 2]\n: x\n" + text)  # an unhashable key: YAML's own error, not a TypeError's traceback
    code, err = _cli(["run", str(path), "--dry-run"], capsys)
    assert code == 2 and "not valid YAML: while constructing a mapping" in err and "Traceback" not in err, err
    path.write_text("seed: 1\nseed: 2\n" + text)
    code, err = _cli(["run", str(path), "--dry-run"], capsys)
    assert code == 2 and "the key 'seed' appears twice in one mapping" in err, err


def test_a_dataset_that_does_not_parse_says_why(tmp_path):
    """`datasets` wraps a parse error in a generic one ("An error occurred while generating the dataset"), which was
    all the error said: no file, no line, no reason (a reviewer's repro). Its cause is said too now."""
    from rollout.data_source import DatasetError, DatasetSpec, load_dataset_rows

    path = tmp_path / "unparseable.jsonl"
    path.write_text('{"q": "1", "a": "2"}\n{"q": "3", "a": \n')
    with pytest.raises(DatasetError, match=r"DatasetGenerationError: .* \(because ArrowInvalid: .*in row 1\)"):
        load_dataset_rows(DatasetSpec(path="json", data_files=str(path), prompt_key="q", label_key="a"))


def test_set_names_an_adapter_before_an_index():
    """A reviewer's repro: with adapters named "2", "0", "1", `--set adapters.2.rank=99` changed the third adapter
    (named "1"), not the one named "2"."""
    from rl_multilora.config import apply_overrides

    data = {"adapters": [{"name": "2"}, {"name": "0"}, {"name": "b"}]}
    apply_overrides(data, ["adapters.2.rank=99", "adapters.b.rank=7", "adapters.1.rank=5"])
    assert data["adapters"] == [{"name": "2", "rank": 99}, {"name": "0", "rank": 5}, {"name": "b", "rank": 7}]
