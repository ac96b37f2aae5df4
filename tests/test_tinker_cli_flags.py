"""`rl-multilora tinker-serve`'s flags: a mistake is a usage error (exit 2) naming the flag, the value and what is
allowed, before a model is loaded, a token written or a port bound; never a traceback or pydantic's raw text."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl_multilora.tinker.server import main


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tinker_flags") / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # the flags are checked before anything reads it
    return folder


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "/nonexistent"], "--model='/nonexistent' is not allowed; allowed: a model folder in HF format"),
        (["--max-loras", "0"], "--max-loras=0 is not allowed; allowed: greater than or equal to 1"),
        (["--max-loras", "300"], "--max-loras=300 is not allowed; allowed: less than or equal to 256"),
        (["--max-rank", "0"], "--max-rank=0 is not allowed; allowed: greater than or equal to 1"),
        (["--port", "0"], "--port=0 is not allowed; allowed: a port from 1 to 65535"),
        (["--snapshot-every", "0"], "--snapshot-every=0 is not allowed; allowed: an integer >= 1"),
        (["--max-sampler-versions", "-1"], "--max-sampler-versions=-1 is not allowed; allowed: an integer >= 1"),
        (["--stability-max-tokens", "0"], "--stability-max-tokens=0 is not allowed; allowed: an integer >= 1"),
        (["--max-tokens-cap", "0"], "--max-tokens-cap=0 is not allowed; allowed: an integer >= 1"),
        (["--session-timeout-s", "0"], "--session-timeout-s=0.0 is not allowed; allowed: seconds > 0"),
        (["--session-timeout-s", "nan"], "--session-timeout-s=nan is not allowed; allowed: seconds > 0"),
        (["--max-tenants", "2"], "--max-tenants=2 is not allowed; allowed: an integer >= --max-loras (8) or none"),
        (["--host-budget-gb", "0"], "--host-budget-gb=0.0 is not allowed; allowed: greater than 0"),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else None,
)
def test_a_bad_flag_is_a_usage_error_naming_it(model, tmp_path, capsys, flags, message):
    state = tmp_path / "state"
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(model), "--state-dir", str(state), *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: rl-multilora tinker-serve"), err
    assert message in err, err
    assert "Traceback" not in err and "validation error" not in err
    assert not state.exists()  # refused before the token is written


def test_a_restart_on_fewer_places_than_the_journals_live_models_is_refused(tmp_path, capsys):
    """A reviewer's repro: two models, a kill, a restart with --max-loras 1: the second model's restore failed
    unlogged, its requests answered 'unknown model_id', and a later restart on 2 slots ran the requests its client
    had been told failed. The server now refuses to start, naming the counts and what is allowed."""
    from rl_multilora.tinker.journal import Journal
    from tests.tiny_models import save_tiny_model

    model = save_tiny_model(tmp_path / "model", hidden=32, layers=2)
    state = tmp_path / "state"
    state.mkdir()
    journal = Journal(state / "requests.sqlite")
    for m in ("s1:train:0", "s1:train:1"):  # what the journal records of two models holding a slot
        journal.set_live(m, True)
    journal.close()
    assert main(["--model", str(model), "--state-dir", str(state), "--max-loras", "1"]) == 2
    err = capsys.readouterr().err
    assert "holds 2 models that held a place when the server stopped, more than the 1 this server has" in err, err
    assert "allowed: --max-loras or --max-tenants >= 2, or another --state-dir" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tinker-port", "-1"], "--tinker-port=-1 is not allowed; allowed: a port from 1 to 65535"),
        (["--tinker-port", "8000", "--tinker-snapshot-every", "0"], "--tinker-snapshot-every=0 is not allowed"),
        (["--tinker-port", "8000", "--tinker-max-tokens-cap", "0"], "--tinker-max-tokens-cap=0 is not allowed"),
        (["--tinker-port", "8000", "--tinker-session-timeout-s", "0"], "--tinker-session-timeout-s=0.0 is not"),
    ],
    ids=lambda v: v[-2] if isinstance(v, list) else None,
)
def test_serve_checks_its_tinker_flags_before_a_config_is_read_or_ray_starts(tmp_path, capsys, flags, message):
    """A reviewer's reading: `serve`'s --tinker-* flags went unchecked into the service actor."""
    pytest.importorskip("ray")
    from rl_multilora import cli

    assert cli.main(["serve", str(tmp_path / "missing.yaml"), *flags]) == 2  # the config is not read: it is missing
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
