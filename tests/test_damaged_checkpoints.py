"""A damaged newest checkpoint costs its tenant the steps since the previous one, never the tenant; a damaged run
state names its file and exits 2.

Each case stops a run after 5 global steps (t1 has checkpoints at adapter steps 2 and 4), damages t1's newest
checkpoint one way, and resumes: t1 must fall back to step 2 with one log line naming the folder it skipped and why
(no traceback), train steps 3-6 again, and end exactly where the uninterrupted run ends.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from rl_multilora import validate
from rl_multilora.checkpoint import list_checkpoints
from rl_multilora.cli import main as cli_main
from rl_multilora.config import parse_run_config
from rl_multilora.loop import run
from rl_multilora.metrics import read_metrics
from tests.test_resume import _config, assert_same_as_reference, reference, workspace  # noqa: F401 - fixtures


def _truncate(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _other_model(path) -> None:
    """Same keys, shapes of another model (one more input feature everywhere)."""
    tensors = load_file(str(path))
    save_file({k: torch.zeros(*t.shape[:-1], t.shape[-1] + 1) for k, t in tensors.items()}, str(path))


DAMAGE = {
    "truncated weights": lambda ck: _truncate(ck / "adapter_model.safetensors"),
    "garbage weights": lambda ck: (ck / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 100),
    "truncated optimizer": lambda ck: _truncate(ck / "optimizer.safetensors"),
    "corrupt cursor": lambda ck: (ck / "data_state.json").write_text('{"version": 1, "cursor": "x'),
    "tensors from another model": lambda ck: _other_model(ck / "adapter_model.safetensors"),
    "nan weights": lambda ck: save_file(
        {k: torch.full_like(t, float("nan")) for k, t in load_file(str(ck / "adapter_model.safetensors")).items()},
        str(ck / "adapter_model.safetensors"),
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resume_falls_back_to_the_newest_intact_checkpoint(workspace, reference, tmp_path, caplog, damage):  # noqa: F811
    run_dir = tmp_path / "run"
    cfg = _config(workspace, run_dir, checkpoint={"save_every": 2, "keep_last": 3})
    run(parse_run_config(dict(cfg, max_global_steps=5)))
    cks = list_checkpoints(run_dir / "adapters" / "t1")
    assert [s for s, _ in cks] == [2, 4, 5]  # periodic saves, then the stop's (max_global_steps)
    newest = cks[-1][1]
    DAMAGE[damage](newest)
    with caplog.at_level(logging.INFO, logger="rl_multilora"):
        rt = run(parse_run_config(cfg))
    assert rt.tenants.get("t1").state.value == "REMOVED" and rt.tenants.get("t1").adapter_step == 6
    skipped = [r for r in caplog.records if "skipped" in r.getMessage() and str(newest) in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].exc_info is None, [r.getMessage() for r in caplog.records]
    assert not any(r.exc_info for r in caplog.records)  # no traceback in the log
    resumed = [r.getMessage() for r in caplog.records if "adapter t1 resumed from" in r.getMessage()]
    assert resumed and "step_4" in resumed[0] and "adapter step 4" in resumed[0]
    aside = newest.with_name(f".damaged-{newest.name}")  # set aside: kept, no longer a candidate nor pruned
    assert aside.is_dir() and aside not in [p for _, p in list_checkpoints(run_dir / "adapters" / "t1")]
    assert_same_as_reference(run_dir, reference)


def test_a_damaged_run_state_names_the_file_and_exits_2(workspace, tmp_path, capsys):  # noqa: F811
    run_dir = tmp_path / "run"
    cfg = _config(workspace, run_dir)
    run(parse_run_config(dict(cfg, max_global_steps=2)))
    state = run_dir / "run_state.json"
    _truncate(state)
    damaged = state.read_bytes()
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cli_main(["run", str(path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"{state} is damaged" in err and "Traceback" not in err and "--fresh" in err
    assert state.read_bytes() == damaged  # left as it was, for the user to restore


def test_when_every_checkpoint_is_damaged_the_tenant_fails_saying_so_and_the_others_go_on(workspace, tmp_path):  # noqa: F811
    """Every candidate set aside used to leave the adapter starting over silently, with its metrics rows dropped and
    the last rejected candidate's weights or moments kept when it failed part-way through loading (a reviewer's
    repro: the cursor refused after the weights and moments were in). Now it is FAILED with the reason; the set-aside
    folders and its metrics rows stay; the other tenants resume and finish."""
    run_dir = tmp_path / "run"
    cfg = _config(workspace, run_dir, checkpoint={"save_every": 2, "keep_last": 3})
    run(parse_run_config(dict(cfg, max_global_steps=5)))
    rows_before = [r for r in read_metrics(run_dir) if r["adapter"] == "t1"]
    cks = [p for _, p in list_checkpoints(run_dir / "adapters" / "t1")]
    assert len(cks) == 3
    for ck in cks:  # readable JSON the data source refuses: fails after the weights and optimizer loaded
        state = json.loads((ck / "data_state.json").read_text())
        state["cursor"] = 10**9  # past the dataset's rows
        (ck / "data_state.json").write_text(json.dumps(state))
    rt = run(parse_run_config(cfg))
    t1 = rt.tenants.get("t1")
    assert t1.state.value == "FAILED" and "every checkpoint" in t1.reason and ".damaged-step_5" in t1.reason, t1.reason
    assert all(ck.with_name(f".damaged-{ck.name}").is_dir() for ck in cks)
    assert [r for r in read_metrics(run_dir) if r["adapter"] == "t1"] == rows_before
    assert rt.tenants.get("t2").state.value == "REMOVED" and rt.tenants.get("t2").adapter_step == 4


def test_a_changed_model_target_modules_is_refused_and_nothing_set_aside(workspace, tmp_path, capsys):  # noqa: F811
    """An adapter that leaves `target_modules` to the model had the same config when `model.target_modules` changed:
    its checkpoints then failed to load and were set aside as damaged, the adapter FAILED, and putting the config
    back did not bring them back (a reviewer's repro). Now `run` refuses before touching anything."""
    run_dir = tmp_path / "run"
    cfg = _config(workspace, run_dir)
    run(parse_run_config(dict(cfg, max_global_steps=2)))
    before = sorted(p.name for p in (run_dir / "adapters" / "t1").iterdir())
    changed = dict(cfg, model={**cfg["model"], "target_modules": ["q_proj", "v_proj"]})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(changed))
    assert cli_main(["run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "adapters.t1.target_modules=None is not allowed" in err and "model.target_modules changed" in err, err
    assert "Traceback" not in err
    assert sorted(p.name for p in (run_dir / "adapters" / "t1").iterdir()) == before  # nothing set aside
    path.write_text(yaml.safe_dump(cfg))
    assert cli_main(["run", str(path), "--dry-run"]) == 0  # the config put back resumes


def test_a_dataset_with_another_row_count_is_refused_and_nothing_set_aside(workspace, tmp_path, capsys, monkeypatch):  # noqa: F811,E501
    """A reviewer's repro: resuming with a dataset of another row count (rows added, or a smaller file) failed the
    data cursor's load, which set every good checkpoint aside as damaged and FAILED the adapter for good (putting the
    dataset back did not bring them back). Now `run` refuses it before touching anything, naming the dataset; a
    mismatch found only at the start (the file changed after the check) fails the adapter and keeps its checkpoints."""
    run_dir = tmp_path / "run"
    cfg = _config(workspace, run_dir)
    run(parse_run_config(dict(cfg, max_global_steps=2)))
    before = sorted(p.name for p in (run_dir / "adapters" / "t1").iterdir())
    smaller = tmp_path / "t1-smaller.jsonl"
    rows = (workspace / "data" / "t1.jsonl").read_text().splitlines()
    smaller.write_text("\n".join(rows[: len(rows) // 2]) + "\n")
    t1 = dict(cfg["adapters"][0], dataset={**cfg["adapters"][0]["dataset"], "data_files": str(smaller)})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(dict(cfg, adapters=[t1, *cfg["adapters"][1:]])))
    for argv in (["run", str(path), "--dry-run"], ["run", str(path)]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert f"adapters.t1.dataset='{len(rows) // 2} rows' is not allowed; allowed: {len(rows)} rows" in err, err
        assert "Traceback" not in err
    assert sorted(p.name for p in (run_dir / "adapters" / "t1").iterdir()) == before  # nothing set aside
    # past validation (a dataset that changed between the check and the start): t1 fails, its checkpoints stay
    monkeypatch.setattr(validate, "data_problems", lambda *a: [])
    rt = run(parse_run_config(dict(cfg, adapters=[t1, *cfg["adapters"][1:]], max_global_steps=3)))
    assert rt.tenants.get("t1").state.value == "FAILED" and "n_rows" in rt.tenants.get("t1").reason
    assert sorted(p.name for p in (run_dir / "adapters" / "t1").iterdir()) == before
    path.write_text(yaml.safe_dump(cfg))
    assert cli_main(["run", str(path), "--dry-run"]) == 0  # the dataset put back resumes


def test_export_over_links_into_a_checkpoint_replaces_the_links_and_leaves_the_checkpoint_alone(reference, tmp_path):  # noqa: F811,E501
    """OUT held symlinks to another adapter's checkpoint files: the copy wrote through them, and that checkpoint held
    the exported adapter's weights and rank beside its own optimizer state (a reviewer's repro)."""
    from rl_multilora.checkpoint import CheckpointManager

    ckpt = CheckpointManager(reference)
    t1 = ckpt.latest("t1")
    before = {f: (t1 / f).read_bytes() for f in ("adapter_config.json", "adapter_model.safetensors")}
    out = tmp_path / "out"
    out.mkdir()
    for f in before:
        (out / f).symlink_to(t1 / f)
    ck = ckpt.export("t2", out)
    assert {f: (t1 / f).read_bytes() for f in before} == before  # t1's checkpoint untouched
    for f in before:
        assert not (out / f).is_symlink() and (out / f).read_bytes() == (ck / f).read_bytes()
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 8  # t2's rank, not t1's 4
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]


def test_export_refuses_another_runs_checkpoints_naming_out(reference, tmp_path, capsys):  # noqa: F811
    """`export RUN_A NAME RUN_B/adapters/NAME/step_N` exited 0 and put RUN_A's weights into RUN_B's checkpoint,
    beside its own optimizer state and checkpoint.json (a reviewer's repro): any run's checkpoints are refused."""
    import shutil

    from rl_multilora.checkpoint import CheckpointManager

    run_b = tmp_path / "run_b"
    shutil.copytree(reference, run_b)
    step = CheckpointManager(run_b).latest("t1")
    before = {p: p.read_bytes() for p in sorted(run_b.rglob("*")) if p.is_file()}
    for out in [
        step,  # the checkpoint folder itself
        step / "sub",  # inside it
        run_b / "adapters" / "t1" / "new",  # inside a run's adapters/ (beside its run_state.json)
        run_b / "adapters",
    ]:
        assert cli_main(["export", str(reference), "t2", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"OUT: {str(out)!r} is inside the run checkpoint" in err and "Traceback" not in err, err
        assert "outside any run's checkpoints" in err, err
    assert {p: p.read_bytes() for p in sorted(run_b.rglob("*")) if p.is_file()} == before  # nothing written
    assert cli_main(["export", str(reference), "t2", str(run_b / "exported")]) == 0  # beside the run is fine


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs Linux /proc")
def test_export_to_an_uncreatable_out_names_out(reference, tmp_path, capsys):  # noqa: F811
    """`export RUN arith /proc/x` said only "error: [Errno 2] ..." (a reviewer's repro): it names OUT and why."""
    assert cli_main(["export", str(reference), "t2", "/proc/x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: OUT: '/proc/x' cannot be written: ") and "[Errno" not in err, err
    assert "give a folder you can create and write" in err and "Traceback" not in err


def test_export_to_an_empty_out_or_from_a_missing_run_dir_says_which(reference, tmp_path, monkeypatch, capsys):  # noqa: F811
    """`export RUN NAME ''` (an unset shell variable) wrote the adapter into the current folder and exited 0; a run dir
    that does not exist was said as "no complete checkpoint" (a reviewer's finds)."""
    monkeypatch.chdir(tmp_path)
    for out in ["", "  "]:
        assert cli_main(["export", str(reference), "t2", out]) == 2
        err = capsys.readouterr().err
        assert f"OUT={out!r} is not allowed; allowed: a folder path" in err and "Traceback" not in err, err
    assert not list(tmp_path.iterdir())  # nothing written where the command ran
    assert cli_main(["export", str(tmp_path / "nosuch"), "t2", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"RUN_DIR={str(tmp_path / 'nosuch')!r} is not allowed; allowed: an existing run dir" in err, err
    assert not (tmp_path / "out").exists()


def test_an_export_that_fails_mid_copy_leaves_no_temp_file_in_out(reference, tmp_path, monkeypatch):  # noqa: F811
    import shutil

    from rl_multilora.checkpoint import CheckpointManager

    def full_disk(src, dst, **kw):
        raise OSError(28, "No space left on device", str(dst))

    monkeypatch.setattr(shutil, "copy2", full_disk)
    out = tmp_path / "out"
    with pytest.raises(FileNotFoundError, match="OUT"):
        CheckpointManager(reference).export("t2", out)
    assert list(out.iterdir()) == []
