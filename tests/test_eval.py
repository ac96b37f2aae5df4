"""Held-out evaluation: base first, then every N adapter steps and the final adapter; it never changes training;
`rl-multilora eval` scores saved checkpoints and PEFT folders."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from rl_multilora import cli
from rl_multilora.checkpoint import CheckpointManager
from rl_multilora.config import parse_run_config
from rl_multilora.loop import run, summarize
from rl_multilora.metrics import read_metrics, training_points
from tests.tiny_models import MOE_EXPERTS, save_tiny_model, sum_task_adapter, write_sum_task

TIMINGS = {"rollout_s", "reward_s", "train_s", "checkpoint_s", "sync_s", "eval_s", "pause_s", "slot_wait_s"}
# The engine's log-probs of the same tokens can differ in the last bits with how rows were batched (timing), so the
# train/rollout gap is compared to 1e-6; the tokens, rewards, losses and weights are compared exactly.
APPROX = {"logprob_gap"}


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eval")
    save_tiny_model(root / "model", hidden=32, layers=2)
    for name, off in [("a", 1), ("b", 3)]:
        write_sum_task(root / "data" / f"{name}_train.jsonl", 30, off)
        write_sum_task(root / "data" / f"{name}_test.jsonl", 10, off + 20)
    return root


def _cfg(ws: Path, run_dir: Path, eval_on: bool) -> dict:
    adapters = []
    for i, name in enumerate(["a", "b"]):
        a = sum_task_adapter(ws / "data", name, 3 + i, max_steps=4)
        a["dataset"]["data_files"] = {
            "train": str(ws / "data" / f"{name}_train.jsonl"),
            "test": str(ws / "data" / f"{name}_test.jsonl"),
        }
        adapters.append(a)
    adapters[1]["eval"] = {"n_prompts": 4}  # a per-adapter override
    return {
        "run_dir": str(run_dir),
        "model": {"path": str(ws / "model"), "max_loras": 2, "max_rank": 8},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 6},
        "grpo": {"micro_batch_size": 8},
        "logging": {"plot": True, "progress": False},
        "rewards": {"num_workers": 1},
        "checkpoint": {"save_every": 2},
        "eval": {"enabled": eval_on, "every": 2, "n_prompts": 6, "k": 2},
        "adapters": adapters,
    }


def _final(run_dir: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(CheckpointManager(run_dir).latest(name) / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def runs(ws):
    on, off = ws / "runs" / "on", ws / "runs" / "off"
    run(parse_run_config(_cfg(ws, on, True)))
    run(parse_run_config(_cfg(ws, off, False)))
    return on, off


def test_eval_rows_base_every_n_and_final(runs):
    on, _ = runs
    rows = [r for r in read_metrics(on) if r.get("kind") == "eval"]
    for name, n in [("a", 6), ("b", 4)]:
        mine = [r for r in rows if r["adapter"] == name]
        assert [(r["adapter_step"], r["eval/base"]) for r in mine] == [(0, True), (2, False), (4, False)]
        for r in mine:
            assert r["eval/n_prompts"] == n and 0.0 <= r["eval/reward_mean"] <= 1.0 and "eval/pass@2" in r
            assert r["reward_mean"] == r["eval/reward_mean"]
    s = summarize(on)
    assert s["a"]["eval_base"] is not None and s["a"]["eval_final_step"] == 4
    assert (on / "reward_curves.png").stat().st_size > 0


def test_the_plot_puts_a_training_reward_at_the_step_of_the_weights_that_sampled_it(runs):
    """A row's `adapter_step` counts its own update; its rewards were sampled before it, by the weights a held-out
    eval at one step fewer scores (the plot had the training curve one step to the right of the eval dots)."""
    on, _ = runs
    rows = [r for r in read_metrics(on) if r.get("kind") != "eval" and r.get("reward_mean") is not None]
    points = training_points(rows)
    for name in ("a", "b"):
        mine = [r for r in rows if r["adapter"] == name]
        assert mine[0]["stepped"] and mine[0]["optimizer_steps"] == 1 and mine[0]["adapter_step"] == 1
        assert points[name][0] == (0, mine[0]["reward_mean"])  # sampled by the initial weights: step 0
        assert [x for x, _ in points[name]] == [r["adapter_step"] - r["optimizer_steps"] for r in mine]
    assert training_points([{"adapter": "a", "adapter_step": 3, "stepped": True, "reward_mean": 0.5}]) == {
        "a": [(2, 0.5)]
    }  # a row from before the field: one step


def test_eval_never_changes_training(runs):
    on, off = runs
    for name in ("a", "b"):
        w_on, w_off = _final(on, name), _final(off, name)
        assert w_on.keys() == w_off.keys() and all(torch.equal(w_on[k], w_off[k]) for k in w_on)
    drop = TIMINGS | APPROX
    rows_on = [r for r in read_metrics(on) if r.get("kind") != "eval"]
    rows_off = read_metrics(off)
    assert [{k: v for k, v in r.items() if k not in drop} for r in rows_on] == [
        {k: v for k, v in r.items() if k not in drop} for r in rows_off
    ]
    gaps_on = [r.get("logprob_gap") or 0.0 for r in rows_on]
    assert gaps_on == pytest.approx([r.get("logprob_gap") or 0.0 for r in rows_off], abs=1e-6)


def test_eval_cli_on_a_run_dir_and_a_peft_folder(runs, ws, capsys):
    on, _ = runs
    assert cli.main(["eval", str(on), "--n", "5"]) == 0
    out = capsys.readouterr().out
    assert "adapter" in out and "base" in out
    result = json.loads((on / "eval_test.json").read_text())
    assert {r["adapter"] for r in result} == {"a", "b"}
    by = {r["adapter"]: r for r in result}
    assert by["a"]["adapter_step"] == 4 and by["a"]["adapter_result"]["n_prompts"] == 5
    # The final held-out reward the run logged for `a` on 6 prompts is what eval gives on the same 6 prompts.
    assert cli.main(["eval", str(on), "--adapter", "a", "--out", str(ws / "a.json")]) == 0
    logged = [r for r in read_metrics(on) if r.get("kind") == "eval" and r["adapter"] == "a"][-1]
    assert json.loads((ws / "a.json").read_text())[0]["adapter_result"]["reward_mean"] == logged["eval/reward_mean"]
    # A PEFT folder exported from the run evaluates the same.
    peft = ws / "peft_a"
    assert cli.main(["export", str(on), "a", str(peft)]) == 0
    assert cli.main(["eval", str(on), "--adapter", "a", "--peft", str(peft), "--out", str(ws / "p.json")]) == 0
    assert json.loads((ws / "p.json").read_text())[0]["adapter_result"]["reward_mean"] == logged["eval/reward_mean"]
    # An adapter named twice is evaluated once (it ran twice, then failed unloading it twice: a reviewer's repro).
    assert (
        cli.main(["eval", str(on), "--adapter", "a", "--adapter", "a", "--n", "2", "--out", str(ws / "d.json")]) == 0
    )
    assert [r["adapter"] for r in json.loads((ws / "d.json").read_text())] == ["a"]
    # Exporting into the run's own checkpoints would overwrite a checkpoint's weights and not its config.
    step_dir = next((on / "adapters" / "a").glob("step_*"))
    before = (step_dir / "adapter_model.safetensors").read_bytes()
    capsys.readouterr()
    assert cli.main(["export", str(on), "b", str(step_dir)]) == 2
    assert "is inside the run's checkpoints" in capsys.readouterr().err
    assert (step_dir / "adapter_model.safetensors").read_bytes() == before


def test_eval_cli_on_a_run_dir_whose_config_lists_no_adapters(runs, ws, tmp_path, capsys):
    """A service's run dir: its config.yaml says `adapters: []` (they were submitted), so `eval` said "this one has
    none" and refused `--adapter` (a reviewer's find). Its adapters are evaluated with the config their checkpoints
    were trained with, as the same adapters listed in config.yaml are."""
    import shutil

    on, _ = runs
    svc = tmp_path / "svc"
    shutil.copytree(on, svc)
    cfg = yaml.safe_load((svc / "config.yaml").read_text())
    listed = {a["name"]: a for a in cfg["adapters"]}
    (svc / "config.yaml").write_text(yaml.safe_dump({**cfg, "adapters": []}))
    assert cli.main(["eval", str(on), "--n", "3", "--out", str(tmp_path / "listed.json")]) == 0
    assert cli.main(["eval", str(svc), "--n", "3", "--out", str(tmp_path / "svc.json")]) == 0

    def rows(name):  # the checkpoint's folder is the only difference: the copy's
        return [{k: v for k, v in r.items() if k != "checkpoint"} for r in json.loads((tmp_path / name).read_text())]

    assert rows("svc.json") == rows("listed.json")
    assert {r["adapter"] for r in rows("listed.json")} == set(listed) == {"a", "b"}
    assert cli.main(["eval", str(svc), "--adapter", "b", "--n", "3", "--out", str(tmp_path / "b.json")]) == 0
    assert rows("b.json") == [r for r in rows("listed.json") if r["adapter"] == "b"]
    capsys.readouterr()
    assert cli.main(["eval", str(svc), "--adapter", "zzz"]) == 2
    assert "--adapter='zzz' is not allowed; allowed: an adapter of this run (a, b)" in capsys.readouterr().err
    # A run whose config lists `a` only (b was taken out of it): `b` is evaluated when named, not by default, so a
    # checkpoint of it that no longer checks out (its dataset moved) does not stop the eval of `a` (a reviewer's find)
    (svc / "config.yaml").write_text(yaml.safe_dump({**cfg, "adapters": [listed["a"]]}))
    for folder in (svc / "adapters" / "b").glob("step_*"):
        moved = json.loads((folder / "checkpoint.json").read_text())
        moved["config"]["dataset"]["data_files"] = {"train": str(tmp_path / "gone.jsonl")}
        (folder / "checkpoint.json").write_text(json.dumps(moved))
    assert cli.main(["eval", str(svc), "--n", "3", "--out", str(tmp_path / "only_a.json")]) == 0
    assert [r["adapter"] for r in rows("only_a.json")] == ["a"]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--adapter", "zzz"], "--adapter='zzz' is not allowed"),
        (["--peft", "/nonexistent"], "--peft='/nonexistent' is not allowed"),
        (["--step", "99"], "checkpoint at adapter step 99"),
        (["--n", "0"], "--n=0 is not allowed"),
        (["--split", "nope"], "eval.split='nope'"),
        (["--adapter", "a", "--peft", ".", "--step", "1"], "--step=1 is not allowed; allowed: none with --peft"),
        (["--out", "/nonexistent/x.json"], "--out='/nonexistent/x.json' is not allowed"),  # before the evaluation
        (["--out", "."], "--out='.' is not allowed; allowed: a file to write (this is a folder)"),  # was: after it
    ],
)
def test_eval_cli_bad_arguments_exit_2_without_traceback(runs, capsys, argv, fragment):
    on, _ = runs
    assert cli.main(["eval", str(on), *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


def test_eval_cli_needs_a_run_dir(tmp_path, capsys):
    assert cli.main(["eval", str(tmp_path)]) == 2
    assert "RUN_DIR=" in capsys.readouterr().err


def test_eval_split_must_exist_when_eval_is_on(ws, tmp_path, capsys):
    cfg = _cfg(ws, tmp_path / "r", True)
    cfg["adapters"][0]["dataset"]["data_files"] = {"train": str(ws / "data" / "a_train.jsonl")}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cli.main(["run", str(path), "--dry-run"]) == 2
    assert "adapters.a.eval:" in capsys.readouterr().err


@pytest.mark.parametrize(
    "case",
    [
        # MoE: expert LoRA on packed expert Parameters (model.target_parameters) beside attention Linears.
        {"family": "qwen3_moe", "model": {"target_modules": ["q_proj", "v_proj"], "target_parameters": MOE_EXPERTS}},
        # A bfloat16 base (the LoRA slots stay float32).
        {"family": "qwen2", "model": {"dtype": "bfloat16"}},
    ],
    ids=["tiny-moe", "bf16"],
)
def test_eval_cli_scores_exactly_what_the_runs_final_eval_logged(tmp_path, case, monkeypatch):
    """`rl-multilora eval` builds the run's model as the run built it (one builder: dtype, target_parameters,
    expert layout), so on the final checkpoints it scores exactly what the run's own final eval logged: greedy
    reward, pass@k and the sampled rewards (sampling at temperature 1 is what a float32 copy would change first)."""
    root = tmp_path
    save_tiny_model(root / "model", family=case["family"], hidden=32, layers=2)
    adapters = []
    for i, name in enumerate(["a", "b"]):
        write_sum_task(root / "data" / f"{name}_train.jsonl", 30, 1 + 2 * i)
        write_sum_task(root / "data" / f"{name}_test.jsonl", 10, 21 + 2 * i)
        a = sum_task_adapter(root / "data", name, 3 + i, max_steps=3)
        a["dataset"]["data_files"] = {
            "train": str(root / "data" / f"{name}_train.jsonl"),
            "test": str(root / "data" / f"{name}_test.jsonl"),
        }
        adapters.append(a)
    run_dir = root / "run"
    cfg = {
        "run_dir": str(run_dir),
        "model": {"path": str(root / "model"), "max_loras": 2, "max_rank": 8, **case["model"]},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 6},
        "grpo": {"micro_batch_size": 8, "drop_uniform_groups": False},
        "logging": {"plot": False, "progress": False},
        "rewards": {"num_workers": 1},
        "eval": {"enabled": True, "n_prompts": 8, "k": 4},
        "adapters": adapters,
    }
    run(parse_run_config(cfg))
    from rollout.engines.embedded import EmbeddedEngine

    built = []  # the base dtype and expert-LoRA targets of the model eval's engine holds
    init = EmbeddedEngine.__init__

    def spy(self, model, *args, **kwargs):
        base = [p.dtype for n, p in model.named_parameters() if "lora" not in n]
        built.append((base[0], sorted(model.lora_parameters)))
        init(self, model, *args, **kwargs)

    monkeypatch.setattr(EmbeddedEngine, "__init__", spy)
    out = root / "eval.json"
    assert cli.main(["eval", str(run_dir), "--out", str(out)]) == 0
    want_dtype = getattr(torch, case["model"].get("dtype", "float32"))
    assert [(d, bool(p)) for d, p in built] == [(want_dtype, "target_parameters" in case["model"])]
    by = {r["adapter"]: r for r in json.loads(out.read_text())}
    rows = [r for r in read_metrics(run_dir) if r.get("kind") == "eval"]
    for name in ("a", "b"):
        final = [r for r in rows if r["adapter"] == name and not r["eval/base"]][-1]
        base = [r for r in rows if r["adapter"] == name and r["eval/base"]][-1]
        mine = by[name]
        assert mine["adapter_step"] == final["adapter_step"] == 3
        got, want = mine["adapter_result"], final
        assert (got["reward_mean"], got["pass_at_k"], got["sample_reward_mean"]) == (
            want["eval/reward_mean"],
            want["eval/pass@4"],
            want["eval/sample_reward_mean"],
        ), name
        assert (mine["base"]["reward_mean"], mine["base"]["sample_reward_mean"]) == (
            base["eval/reward_mean"],
            base["eval/sample_reward_mean"],
        ), name


def _bad_folders(good: Path, root: Path) -> dict[str, Path]:
    """PEFT folders that must be refused, each made from the good export `good`."""
    import shutil

    out = {}

    def copy(name: str) -> Path:
        d = root / name
        shutil.copytree(good, d)
        out[name] = d
        return d

    d = copy("wrong shapes")
    t = load_file(str(d / "adapter_model.safetensors"))
    from safetensors.torch import save_file

    save_file({k: torch.zeros(v.shape[0], v.shape[1] + 3) for k, v in t.items()}, str(d / "adapter_model.safetensors"))
    d = copy("rank above max")
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, "r": 64}))
    d = copy("missing targets")
    save_file({k.replace("q_proj", "nope_proj"): v for k, v in t.items()}, str(d / "adapter_model.safetensors"))
    d = copy("symlink out")
    secret = root / "outside.safetensors"
    shutil.copy(d / "adapter_model.safetensors", secret)
    (d / "adapter_model.safetensors").unlink()
    (d / "adapter_model.safetensors").symlink_to(secret)
    d = copy("pickle only")
    (d / "adapter_model.safetensors").unlink()
    (d / "adapter_model.bin").write_bytes(b"\x80\x04not really a pickle, and never opened")
    d = copy("all nan")
    save_file({k: torch.full_like(v, float("nan")) for k, v in t.items()}, str(d / "adapter_model.safetensors"))
    return out


def test_eval_refuses_a_bad_peft_folder_before_loading_the_model(runs, ws, capsys, monkeypatch, tmp_path):
    """Every bad folder exits 2 with one message naming it, before the model loads; a pickle is never opened."""
    from rl_multilora import components

    on, _ = runs
    good = tmp_path / "good"
    assert cli.main(["export", str(on), "a", str(good)]) == 0
    capsys.readouterr()

    def no_model(*a, **k):
        raise AssertionError("the model was loaded for a bad adapter folder")

    def no_unpickling(*a, **k):
        raise AssertionError("torch.load was called on an adapter folder")

    monkeypatch.setattr(components, "build_embedded_engine", no_model)
    monkeypatch.setattr(torch, "load", no_unpickling)
    expected = {
        "wrong shapes": "does not fit the model",
        "rank above max": "r=64 is not allowed",
        "missing targets": "nope_proj",
        "symlink out": "link to a file outside the folder",
        "pickle only": "adapter_model.bin (pickle)",
        "all nan": "NaN or inf",
    }
    for name, folder in _bad_folders(good, tmp_path).items():
        code = cli.main(["eval", str(on), "--adapter", "a", "--peft", str(folder)])
        err = capsys.readouterr().err
        assert code == 2, (name, err)
        assert str(folder) in err and expected[name] in err and "Traceback" not in err, (name, err)


def test_a_run_stopped_by_max_global_steps_checkpoints_and_evaluates_its_running_adapters(ws, tmp_path):
    """max_global_steps ends the run between periodic saves (save_every 2, stop after 3): each still-running
    adapter's step 3 is checkpointed (nothing trained is lost) and gets its final eval on exactly those weights."""
    run_dir = tmp_path / "stopped"
    rt = run(parse_run_config(dict(_cfg(ws, run_dir, True), max_global_steps=3)))
    rows = [r for r in read_metrics(run_dir) if r.get("kind") == "eval"]
    for name in ("a", "b"):
        t = rt.tenants.get(name)
        assert t.state.value == "RUNNING" and t.adapter_step == 3
        assert CheckpointManager(run_dir).latest(name).name == "step_3"
        assert [(r["adapter_step"], r["eval/base"]) for r in rows if r["adapter"] == name] == [
            (0, True), (2, False), (3, False)
        ]  # fmt: skip
    assert summarize(run_dir)["a"]["eval_final_step"] == 3


def test_evals_own_wave_bound_holds_only_while_they_run_and_scores_the_same(runs, ws, monkeypatch):
    # eval.max_wave_tokens: the engine bounds its waves by it while the evals run (an eval row here: a prompt of
    # about 5 tokens and 6 new ones, so 24 positions hold 2 rows) and by the rollout's own bound (none) otherwise;
    # the evals score what the unbounded run's did, and training is the same.
    from rollout.engines.embedded import EmbeddedEngine

    waves = []  # (the engine's bound when the decode step ran, rows, positions the rows hold)
    base_rows = []  # the bound of every decode step with base rows: only the base's evals have those
    real = EmbeddedEngine._decode_step

    def decode_step(self, batch):
        waves.append((self._max_wave_tokens, len(batch.rows), sum(self._row_tokens(r) for r in batch.rows)))
        if any(r.request.adapter is None for r in batch.rows):
            base_rows.append(self._max_wave_tokens)
        return real(self, batch)

    monkeypatch.setattr(EmbeddedEngine, "_decode_step", decode_step)
    on, _ = runs
    bounded = ws / "runs" / "eval_bounded"
    cfg = _cfg(ws, bounded, True)
    cfg["eval"]["max_wave_tokens"] = 24
    cfg["logging"]["plot"] = False
    run(parse_run_config(cfg))
    in_evals = [w for w in waves if w[0] == 24]
    assert in_evals and all(held <= 24 or rows == 1 for _, rows, held in in_evals), in_evals
    assert {bound for bound, _, _ in waves} == {None, 24}  # the rollouts ran under the engine's own bound
    assert base_rows and set(base_rows) == {24}  # the base's evals (in the step) too, not only the final ones
    assert max(rows for bound, rows, _ in waves if bound is None) > max(rows for _, rows, _ in in_evals)
    drop = TIMINGS | APPROX
    assert [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(bounded)] == [
        {k: v for k, v in r.items() if k not in drop} for r in read_metrics(on)
    ]


def test_failed_answers_count_zero_and_are_shown(capsys):
    """A failed greedy answer (its environment raised; reward None) was left out of `eval/reward_mean`: an environment
    failing on half the held-out prompts reported 1.0, and the table and summary never said anything had failed."""
    from types import SimpleNamespace

    from rl_multilora.evaluate import EvalSet, format_table
    from rl_multilora.metrics import eval_line
    from rollout.types import Sample, SampleStatus

    es = EvalSet.__new__(EvalSet)  # summarize reads only these
    es.name, es.prompts = "env", [None] * 4
    es.settings = SimpleNamespace(k=2, pass_threshold=1.0, greedy=True)
    samples = []
    for i, (greedy, drawn) in enumerate(
        [(1.0, (1.0, 0.0)), (None, (None, None)), (1.0, (0.0, 0.0)), (None, (1.0, None))]
    ):
        for kind, reward in [("greedy", greedy), ("sample0", drawn[0]), ("sample1", drawn[1])]:
            status = SampleStatus.FAILED if reward is None else SampleStatus.COMPLETED
            samples.append(
                Sample(prompt="p", group_index=i, reward=reward, status=status, metadata={"eval_kind": kind})
            )
    r = es.summarize(samples, adapter_step=3, base=False)
    assert (r.reward_mean, r.pass_at_k, r.sample_reward_mean, r.errors) == (0.5, 0.5, 0.25, 5)
    assert eval_line(r.to_row(7)).endswith("| 5 answers failed (counted 0)")
    base = dataclasses.replace(r, base=True, errors=0)
    table = format_table([{"adapter": "env", "adapter_step": 3, "split": "test", "base": dataclasses.asdict(base),
                           "adapter_result": dataclasses.asdict(r)}])  # fmt: skip
    assert "failed" in table.splitlines()[0] and "0 / 5" in table.splitlines()[1]


def test_a_resumed_run_does_not_evaluate_an_adapter_step_again(ws, tmp_path):
    """A reviewer's case: a tenant whose groups all scored alike took no optimizer step, so its evaluation at adapter
    step k was logged in a step its stop checkpoint covers; the resumed run evaluated step k again (the same row
    twice in metrics.jsonl, the eval work twice). Here `b` never steps (exact_match of a 6-token answer: 0 always)."""
    from rl_multilora.metrics import read_metrics

    run_dir = tmp_path / "run"
    cfg = _cfg(ws, run_dir, True)
    cfg["adapters"][1]["reward"] = {"name": "exact_match"}
    cfg["faults"] = {"max_idle_steps": 50}
    cfg["logging"]["plot"] = False
    run(parse_run_config({**cfg, "max_global_steps": 2}))
    run(parse_run_config({**cfg, "max_global_steps": 3}))
    rows = [(r["adapter"], r["adapter_step"], bool(r.get("eval/base"))) for r in read_metrics(run_dir)
            if r.get("kind") == "eval"]  # fmt: skip
    assert ("b", 0, True) in rows and len(rows) == len(set(rows)), rows


def test_answers_whose_reward_raised_are_counted_in_eval_errors(ws, tmp_path):
    """A reviewer's case: a reward raising on every answer gave eval/reward_mean 0.0 and eval/errors 0, which reads
    as a weak base, not a broken reward (the training rows did say reward_errors)."""
    from rl_multilora.metrics import read_metrics

    cfg = _cfg(ws, tmp_path / "run", True)
    cfg["adapters"][1]["reward"] = {"path": "tests.reward_plugins:raising_reward"}
    cfg["faults"] = {"max_reward_fail_steps": 50}
    cfg["logging"]["plot"] = False
    run(parse_run_config({**cfg, "max_global_steps": 1}))
    base = {r["adapter"]: r for r in read_metrics(tmp_path / "run") if r.get("kind") == "eval" and r.get("eval/base")}
    # every answer: 4 prompts' greedy ones and their k = 2 samples each
    assert base["b"]["eval/errors"] == base["b"]["eval/n_prompts"] * 3 == 12 and base["a"]["eval/errors"] == 0


def test_eval_refuses_a_base_other_than_the_one_the_run_trained_on(ws, runs, tmp_path, capsys):
    """`run` refused to resume on a model folder whose config or weight shapes changed, but `eval` scored the run's
    adapters on it (a reviewer's repro: rope_theta and rms_norm_eps changed). The same base moved is fine."""
    import shutil

    from rl_multilora.evaluate import _other_base

    on, _ = runs
    moved = tmp_path / "same_model"
    shutil.copytree(ws / "model", moved)
    assert _other_base(CheckpointManager(on), str(moved)) is None  # the same base in another folder
    other = tmp_path / "other_model"
    shutil.copytree(ws / "model", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    run_dir = tmp_path / "run"
    shutil.copytree(on, run_dir)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg["model"]["path"] = str(other)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["eval", str(run_dir), "--adapter", "a", "--n", "2"]) == 2
    err = capsys.readouterr().err
    assert f"model.path={str(other)!r} is not allowed" in err and "trained on" in err and "Traceback" not in err, err
