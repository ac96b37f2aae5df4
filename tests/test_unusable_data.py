"""An adapter none of whose rows can be trained on ends FAILED with the reason, not REMOVED with "budget reached":
the run exits 1. It used to finish its budget-less tenant silently, print no summary line for it and exit 0 (a
reviewer's repro: a chat dataset with a role the template refuses, every row skipped)."""

from __future__ import annotations

import yaml

from rl_multilora.cli import main as cli_main
from rl_multilora.config import parse_run_config
from rl_multilora.loop import run
from tests.test_resume import _config, workspace  # noqa: F401 - fixtures


def test_a_tenant_whose_every_row_is_skipped_is_refused_or_fails(workspace, tmp_path, capsys, monkeypatch):  # noqa: F811
    cfg = _config(workspace, tmp_path / "run", max_global_steps=6)
    t1 = cfg["adapters"][0]
    t1["dataset"] = {**t1["dataset"], "max_prompt_tokens": 1}  # every prompt is longer: every row is skipped
    # --dry-run and run read the rows as the run would, and refuse it before anything trains (a reviewer's find:
    # a dataset none of whose prompts fit the context was called valid)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(dict(cfg, run_dir=str(tmp_path / "run2"))))
    for argv in (["run", str(path), "--dry-run"], ["run", str(path)]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert "adapters.t1.dataset.path='json' is not allowed" in err, err
        assert "all 40 rows would be skipped (40 prompt_too_long)" in err and "Traceback" not in err, err
    # Past validation (rows that change under a run, a caller without a tokenizer there), the run fails the tenant
    # with the reason and trains the others.
    from rl_multilora import validate

    monkeypatch.setattr(validate, "_prompts", lambda cfg: None)
    rt = run(parse_run_config(cfg))
    t = rt.tenants.get("t1")
    assert t.state.value == "FAILED" and t.adapter_step == 0, (t.state, t.reason)
    assert "no usable row: all 40 rows of its dataset were skipped" in t.reason, t.reason
    assert rt.tenants.get("t2").adapter_step > 0  # the others train on
    path.write_text(yaml.safe_dump(dict(cfg, run_dir=str(tmp_path / "run3"))))
    assert cli_main(["run", str(path)]) == 1
    assert "t1: no usable row" in capsys.readouterr().err


def test_an_adapter_renamed_in_the_config_is_named_in_a_warning_and_the_summary(workspace, tmp_path, capsys, caplog):  # noqa: F811
    """A reviewer's repro: renaming (or dropping) a RUNNING adapter in the config on resume forgot it without a word;
    the summary printed its state as `?`. Its checkpoints stay; putting the name back resumes it."""
    import logging

    cfg = _config(workspace, tmp_path / "run", max_global_steps=2)
    run(parse_run_config(cfg))
    t1 = dict(cfg["adapters"][0], name="t1b")
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(dict(cfg, adapters=[t1, *cfg["adapters"][1:]], max_global_steps=3)))
    with caplog.at_level(logging.WARNING, logger="rl_multilora"):
        assert cli_main(["run", str(path)]) == 0
    assert any("adapter t1 (RUNNING at adapter step" in r.getMessage() and "not in the config" in r.getMessage()
               for r in caplog.records), caplog.text  # fmt: skip
    out = capsys.readouterr().out
    assert "  t1           ABSENT" in out, out
