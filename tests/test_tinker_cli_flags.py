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
