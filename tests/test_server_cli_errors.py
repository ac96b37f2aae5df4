"""`engine-serve` and `tinker-serve`: a user's mistake in where to listen, what to serve or where to keep state exits 2
with a message naming the flag (or the token's source), the value and what is allowed, before a model is loaded;
never a traceback. A reviewer's repros, run in-process through `rl_multilora.cli.main`."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rl_multilora.cli import main as cli_main


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


@pytest.fixture
def stub_model(tmp_path) -> Path:
    """A folder that passes the up-front --model check; anything that reads it as a model fails (so a test shows
    the refusal came before the model loaded)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


@pytest.fixture(autouse=True)
def _no_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # engine-serve's generated key goes here
    monkeypatch.setenv("RL_MULTILORA_API_KEY", "test-key")  # ...or rather nowhere
    monkeypatch.delenv("RL_MULTILORA_TINKER_TOKEN", raising=False)


def refused(capsys, command: str, model: Path, tmp_path: Path, *flags: str, state: Path | None = None) -> str:
    """`rl-multilora COMMAND --model MODEL ...FLAGS` in-process (tinker-serve: `--state-dir STATE`, default
    tmp_path/state): asserts it exits 2 without a traceback; its stderr."""
    if command == "tinker-serve":
        flags = ("--state-dir", str(state or tmp_path / "state"), *flags)
    try:
        code = cli_main([command, "--model", str(model), *flags])
    except SystemExit as e:  # argparse's usage error
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", ["engine-serve", "tinker-serve"])
def test_a_busy_port_is_refused_before_the_model_loads(capsys, stub_model, tmp_path, command):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        err = refused(capsys, command, stub_model, tmp_path, "--port", str(port))
    assert f"--port={port} is not allowed; allowed: a free port (127.0.0.1:{port} is in use)" in err, err
    assert not (tmp_path / "state").exists()  # tinker-serve: no state dir or token written


@pytest.mark.parametrize("command", ["engine-serve", "tinker-serve"])
def test_a_host_that_does_not_resolve_is_refused_naming_host(capsys, stub_model, tmp_path, command):
    err = refused(capsys, command, stub_model, tmp_path, "--host", "nosuch.invalid", "--port", str(free_port()))
    assert (
        "--host='nosuch.invalid' is not allowed; allowed: an address of this machine, or a name that resolves" in err
    )


@pytest.mark.parametrize("command", ["engine-serve", "tinker-serve"])
@pytest.mark.parametrize("port", ["70000", "0"])
def test_a_port_outside_1_to_65535_is_refused(capsys, stub_model, tmp_path, command, port):
    err = refused(capsys, command, stub_model, tmp_path, "--port", port)
    assert f"--port={port} is not allowed; allowed: a port from 1 to 65535" in err, err


def test_engine_serve_needs_a_config_json(capsys, tmp_path):
    folder = tmp_path / "not_a_model"
    folder.mkdir()
    err = refused(capsys, "engine-serve", folder, tmp_path, "--port", str(free_port()))
    assert f"--model={str(folder)!r} is not allowed; allowed: an existing model folder (HF format, with its config.json)" in err  # fmt: skip


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        (
            "--target-modules",
            "nope_proj",
            "--target-modules=['nope_proj'] is not allowed; allowed: names of nn.Linear",
        ),
        (
            "--target-parameters",
            "mlp.experts.down_proj",
            "--target-parameters=['mlp.experts.down_proj'] is not allowed; allowed: packed expert parameters",
        ),
    ],
)
def test_engine_serve_names_a_target_flag_that_matches_nothing(capsys, tmp_path, flag, value, message):
    from tests.tiny_models import save_tiny_model

    model = save_tiny_model(tmp_path / "tiny", hidden=32, layers=1)
    err = refused(capsys, "engine-serve", model, tmp_path, "--port", str(free_port()), flag, value)
    assert message in err and "matches no" in err, err


def test_only_target_selections_value_errors_become_usage_errors():
    from rl_multilora.engine_serve import _target_flag

    assert _target_flag("target_modules=['x'] is not allowed; allowed: ...") == "--target-modules"
    assert _target_flag("target_parameters=['x'] is not allowed; allowed: ...") == "--target-parameters"
    assert _target_flag("dtype='x' is not allowed") is None and _target_flag("bad target_modules=") is None


def test_tinker_serve_names_a_state_dir_that_is_a_file(capsys, stub_model, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    for state, allowed in ((afile, "a folder, or a path to create one at (it is a file)"),
                           (afile / "sub", "a folder this user can create (Not a directory)")):  # fmt: skip
        err = refused(capsys, "tinker-serve", stub_model, tmp_path, "--port", str(free_port()), state=state)
        assert f"--state-dir={str(state)!r} is not allowed; allowed: {allowed}" in err, err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_tinker_serve_names_a_state_dir_it_cannot_create(capsys, stub_model, tmp_path):
    err = refused(capsys, "tinker-serve", stub_model, tmp_path, "--port", str(free_port()), state=Path("/proc/nope"))
    assert "--state-dir='/proc/nope' is not allowed; allowed: a folder this user can create" in err, err


def test_tinker_serve_names_the_file_an_empty_token_came_from(capsys, stub_model, tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "token").write_text("\n")
    err = refused(capsys, "tinker-serve", stub_model, tmp_path, "--port", str(free_port()))
    token_file = tmp_path / "state" / "token"
    assert f"the token file {token_file} holding '' is not allowed: token must start with 'tml-'" in err, err
    assert "delete the file and the next start writes a new one" in err


@pytest.mark.parametrize(("value", "shown"), [(" ", "' '"), ("sk-secret", "<9 characters, not shown>")])
def test_tinker_serve_names_the_env_var_a_bad_token_came_from(capsys, stub_model, tmp_path, monkeypatch, value, shown):
    monkeypatch.setenv("RL_MULTILORA_TINKER_TOKEN", value)
    err = refused(capsys, "tinker-serve", stub_model, tmp_path, "--port", str(free_port()))
    assert f"RL_MULTILORA_TINKER_TOKEN={shown} is not allowed: token must start with 'tml-'" in err, err
    assert "sk-secret" not in err  # a key that is not a Tinker token may be another service's: never echoed
