"""A reviewer's cases for the provisioning commands (`rl-multilora provision`, `python -m
rl_multilora.presets.tiny_agents`, examples/multi_lora/provision.sh and provision_agents.sh): a mistake, a damaged or
unwritable folder and a base of another seed are each an exit 2 that names what is wrong and what to do, never a
traceback, a silently ignored flag or a base mixed with another seed. Fast: builds are a few steps of a small model,
most cases build nothing, and the scripts run with a stand-in Python that only prints what it was called with."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from rl_multilora.presets import tiny_agents
from rl_multilora.presets.tiny_agents import AgentsPresetConfig, provision_agents
from rl_multilora.presets.tiny_config import PRESETS
from rl_multilora.provision import MARKER, main, provision
from tests.test_provision import SMALL as TEST_PROVISION_SMALL

ROOT = Path(__file__).resolve().parents[1]
# test_provision's small preset, with one pretraining step and no eval: the point here is the folder's handling.
SMALL = replace(TEST_PROVISION_SMALL, pretrain_steps=1, eval_prompts=0)
AGENTS = replace(
    AgentsPresetConfig(), pretrain_steps=1, eval_prompts=0, n_train=5, n_test=5, guess_train=5, guess_test=5
)


def _marker(folder: Path, preset: str = "tiny", seed: int = 0, **settings) -> Path:
    """A finished build's record only (what the commands read), so nothing is built."""
    folder.mkdir(parents=True, exist_ok=True)
    record = {"preset": preset, "seed": seed, "settings": PRESETS[preset].settings() | settings}
    (folder / MARKER).write_text(json.dumps(record))
    return folder


def _no_provisioning(*args, **kwargs):
    raise AssertionError(f"provision{args} was called")


# ---------------------------------------------------------------------------------------- tiny-agents and its base


def main_agents(argv: list[str], capsys) -> int:
    """`python -m rl_multilora.presets.tiny_agents ARGV`: its exit code, and never a traceback."""
    code = tiny_agents.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if code:
        assert err.startswith("error: "), err
    return code


def test_agents_refuse_a_base_of_another_seed_instead_of_mixing_seeds(tmp_path, capsys, monkeypatch):
    base = _marker(tmp_path / "base", seed=0)
    monkeypatch.setattr("rl_multilora.provision.provision", _no_provisioning)
    with pytest.raises(ValueError) as err:
        provision_agents(tmp_path / "agents", base, seed=1, config=AGENTS)
    assert f"--seed 1) does not match the tiny base in {str(base)!r}, which holds preset='tiny' seed=0" in str(
        err.value
    )
    assert "--tiny DIR" in str(err.value)
    assert main_agents(["--out", str(tmp_path / "agents"), "--tiny", str(base), "--seed", "1"], capsys) == 2
    assert not (tmp_path / "agents").exists()


def test_agents_never_provision_the_default_base_at_another_seed(tmp_path, capsys, monkeypatch):
    """Without --tiny, a missing artifacts/tiny is provisioned at seed 0 only: the main job trains on it at seed 0."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("rl_multilora.provision.provision", _no_provisioning)
    assert main_agents(["--seed", "1"], capsys) == 2
    with pytest.raises(ValueError, match=r"seed=1 \(--seed 1\) needs a tiny base provisioned with seed 1.*--tiny DIR"):
        provision_agents("artifacts/tiny-agents", seed=1, config=AGENTS)
    assert not (tmp_path / "artifacts").exists()


def test_the_agents_recipe_holds_its_base_so_another_base_is_another_recipe(tmp_path):
    base = provision("tiny", tmp_path / "base", config=SMALL)
    out = provision_agents(tmp_path / "agents", base, config=AGENTS)
    record = json.loads((out / MARKER).read_text())
    assert record["base"] == {"preset": "tiny", "seed": 0, "settings": SMALL.settings()}
    assert provision_agents(out, base, config=AGENTS) == out  # same base: nothing to do

    provision("tiny", base, config=replace(SMALL, pretrain_steps=2), force=True)
    with pytest.raises(FileExistsError, match=r"another recipe \(base.pretrain_steps: 1 there, 2 asked\).*--force"):
        provision_agents(out, base, config=AGENTS)


def test_an_agents_record_from_before_the_base_was_recorded_still_counts_for_its_own_base_folder(tmp_path):
    base = _marker(tmp_path / "base")
    recipe = {"preset": "tiny-agents", "seed": 0, "settings": json.loads(json.dumps(_agents_settings(AGENTS)))}
    out = tmp_path / "agents"
    out.mkdir()
    (out / MARKER).write_text(json.dumps(recipe | {"from": str(base / "model")}))
    assert provision_agents(out, base, config=AGENTS) == out
    (out / MARKER).write_text(json.dumps(recipe | {"from": str(tmp_path / "elsewhere" / "model")}))
    with pytest.raises(FileExistsError, match=r"base: \(none\) there"):
        provision_agents(out, base, config=AGENTS)


def _agents_settings(cfg: AgentsPresetConfig) -> dict:
    from dataclasses import asdict

    return asdict(cfg) | {"mix": list(cfg.mix)}


def test_agents_mistakes_are_exit_2_naming_the_folder_and_what_is_allowed(tmp_path, capsys):
    tiny = _marker(tmp_path / "tiny")
    assert main_agents(["--out", str(tiny), "--tiny", str(tiny)], capsys) == 2
    with pytest.raises(
        FileExistsError, match=r"already holds preset='tiny' seed=0, another recipe \(preset: \"tiny\" there"
    ):
        provision_agents(tiny, tiny, config=AGENTS)
    with pytest.raises(SystemExit) as exit_:
        tiny_agents.main(["--seed", "-3"])
    assert exit_.value.code == 2
    assert "argument --seed: '-3' is not allowed; allowed: an int >= 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"seed=-3 \(--seed\) is not allowed; allowed: an integer >= 0"):
        provision_agents(tmp_path / "agents", tiny, seed=-3)


# ----------------------------------------------------------------------------------------------- the folder itself


def test_a_finished_build_needs_no_write_access_and_an_unwritable_folder_is_exit_2(tmp_path, capsys, monkeypatch):
    """A read-only parent (simulated: the tests may run as root, whom a mode does not stop) answers "nothing to do"
    for a finished build, and names the folder when it has to write; an uncreatable one (under a file) too."""

    def read_only(out):
        raise PermissionError(13, "Permission denied", str(Path(out).parent))

    done = _marker(tmp_path / "ro" / "tiny")
    monkeypatch.setattr("rl_multilora.provision.provision_lock", read_only)
    assert main(["--out", str(done)]) == 0
    assert f"provisioned tiny (seed 0) in {done}" in capsys.readouterr().out
    agents = tmp_path / "ro" / "agents"
    agents.mkdir()
    base = {"preset": "tiny", "seed": 0, "settings": PRESETS["tiny"].settings()}
    recipe = {"preset": "tiny-agents", "seed": 0, "settings": _agents_settings(AGENTS), "base": base}
    (agents / MARKER).write_text(json.dumps(recipe))
    assert provision_agents(agents, done, config=AGENTS) == agents

    assert main(["--out", str(tmp_path / "ro" / "new")]) == 2
    err = capsys.readouterr().err
    assert f"out={str(tmp_path / 'ro' / 'new')!r} cannot be written (Permission denied" in err
    assert "choose a folder you can write" in err and "Traceback" not in err
    monkeypatch.undo()

    (tmp_path / "file").write_text("not a folder")
    assert main(["--out", str(tmp_path / "file" / "tiny")]) == 2
    err = capsys.readouterr().err
    assert f"out={str(tmp_path / 'file' / 'tiny')!r} cannot be written" in err and "Traceback" not in err
    assert main_agents(["--out", str(tmp_path / "file" / "agents"), "--tiny", str(done)], capsys) == 2


@pytest.mark.parametrize("dot", [".", "./"])
def test_out_may_be_the_working_directory(tmp_path, monkeypatch, dot):
    monkeypatch.chdir(tmp_path)
    assert provision("tiny", dot, config=SMALL) == Path(dot)
    assert json.loads((tmp_path / MARKER).read_text())["seed"] == 0 and (tmp_path / "model").is_dir()
    provision("tiny", dot, seed=1, config=SMALL, force=True)
    assert json.loads((tmp_path / MARKER).read_text())["seed"] == 1


@pytest.mark.parametrize("content", ["", "[]", '{"preset": "tiny", "se', '{"seed": 0}'])
def test_a_damaged_marker_names_the_file_and_force_rebuilds(tmp_path, capsys, content):
    out = tmp_path / "tiny"
    out.mkdir()
    (out / MARKER).write_text(content)
    assert main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{str(out / MARKER)!r} is not a provisioning record" in err and "--force" in err
    assert "Traceback" not in err
    provision("tiny", out, config=SMALL, force=True)
    assert json.loads((out / MARKER).read_text())["preset"] == "tiny"


def test_another_recipe_names_the_settings_that_differ(tmp_path, capsys):
    out = _marker(tmp_path / "tiny")
    assert main(["--out", str(out), "--pretrain-steps", "5", "--seed", "2"]) == 2
    err = capsys.readouterr().err
    assert (
        "already holds preset='tiny' seed=0, another recipe (seed: 0 there, 2 asked; pretrain_steps: 1200 there, 5 asked)"
        in err
    )


def test_pretrain_steps_is_refused_where_there_is_no_pretraining(tmp_path, capsys):
    smol = _marker(tmp_path / "smol", preset="tiny")  # what is there does not matter: refused before it is read
    assert main(["--preset", "smollm2-135m", "--out", str(smol), "--pretrain-steps", "5"]) == 2
    err = capsys.readouterr().err
    assert "pretrain_steps=5 (--pretrain-steps) is not allowed for preset='smollm2-135m': it has no pretraining" in err
    with pytest.raises(ValueError, match="not allowed for preset='Qwen/Qwen3-4B': it has no pretraining"):
        provision("Qwen/Qwen3-4B", tmp_path / "hub", pretrain_steps=5)
    assert not (tmp_path / "hub").exists()


def _users_folder(out: Path) -> dict[str, str]:
    """A folder never provisioned, with a model/ and data/ of the user's (and a file beside them)."""
    files = {"data/my_train.jsonl": '{"question": "mine"}\n', "model/config.json": "{}", "notes.txt": "keep"}
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    return files


def test_a_users_model_and_data_are_refused_not_deleted(tmp_path, capsys, monkeypatch):
    """`provision --preset Qwen/Qwen3-4B --out X` deleted X/model and X/data before its download, so a network
    error lost the user's files (a reviewer's repro): a folder with neither PROVISIONED.json nor .provisioning is
    the user's, refused with exit 2 naming it unless --force, for every preset and for tiny-agents."""
    monkeypatch.setattr("rl_multilora.provision._provision_hub", _no_provisioning)
    monkeypatch.setattr("rl_multilora.provision._provision_tiny", _no_provisioning)
    out = tmp_path / "x"
    files = _users_folder(out)
    for preset in ["Qwen/Qwen3-4B", "tiny"]:
        assert main(["--preset", preset, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        held = f"error: out={str(out)!r} already holds {str(out / 'model')!r}, which provisioning did not write"
        assert err.startswith(held), err
        assert "--force" in err and "--out" in err and "Traceback" not in err
    tiny = _marker(tmp_path / "tiny")
    assert main_agents(["--out", str(out), "--tiny", str(tiny)], capsys) == 2
    with pytest.raises(FileExistsError, match="which provisioning did not write"):
        provision_agents(out, tiny, config=AGENTS)
    assert {name: (out / name).read_text() for name in files} == files
    assert sorted(p.name for p in out.iterdir()) == ["data", "model", "notes.txt"]  # no .provisioning either

    def hub(repo_id, out, seed, n_train, n_test):
        (out / "model").mkdir()
        (out / "data").mkdir()
        return {"model": {"repo_id": repo_id}, "data": {}, "timings": {}}

    monkeypatch.setattr("rl_multilora.provision._provision_hub", hub)
    provision("Qwen/Qwen3-4B", out, force=True)  # --force replaces them; the file beside them stays
    assert not (out / "data" / "my_train.jsonl").exists() and (out / "notes.txt").read_text() == "keep"
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "data", "model", "notes.txt"]


def test_a_build_stopped_half_way_is_redone_without_force(tmp_path, monkeypatch):
    """.provisioning, written before anything is cleared and removed once PROVISIONED.json is, marks model/ and
    data/ as provisioning's own: a failed download (or a kill) is redone by the next call, no --force needed."""
    out = tmp_path / "x"
    out.mkdir()
    (out / "notes.txt").write_text("keep")

    def failing(repo_id, out, seed, n_train, n_test):
        (out / "model").mkdir()
        (out / "model" / "part.safetensors").write_text("half")
        raise ConnectionError("network is down")

    monkeypatch.setattr("rl_multilora.provision._provision_hub", failing)
    with pytest.raises(ConnectionError):
        provision("Qwen/Qwen3-4B", out)
    assert (out / ".provisioning").exists() and (out / "model" / "part.safetensors").exists()

    def hub(repo_id, out, seed, n_train, n_test):
        assert not (out / "model").exists()  # the half-written model was cleared first
        (out / "model").mkdir()
        (out / "data").mkdir()
        return {"model": {"repo_id": repo_id}, "data": {}, "timings": {}}

    monkeypatch.setattr("rl_multilora.provision._provision_hub", hub)
    assert provision("Qwen/Qwen3-4B", out) == out
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "data", "model", "notes.txt"]
    assert json.loads((out / MARKER).read_text())["preset"] == "Qwen/Qwen3-4B"
    monkeypatch.setattr("rl_multilora.provision._provision_hub", _no_provisioning)
    assert provision("Qwen/Qwen3-4B", out) == out  # done: nothing to do


# ---------------------------------------------------------------------------------------------------- the scripts


def _script(tmp_path: Path, name: str, args: list[str], cwd: Path) -> tuple[str, list[str]]:
    """examples/multi_lora/<name> run with a PYTHON that prints its working directory and arguments, one a line."""
    stub = tmp_path / "python-stand-in"
    stub.write_text('#!/usr/bin/env bash\necho "$PWD"\nfor a in "$@"; do echo "$a"; done\n')
    stub.chmod(0o755)
    env = dict(os.environ, PYTHON=str(stub))
    proc = subprocess.run(
        ["bash", str(ROOT / "examples" / "multi_lora" / name), *args],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    where, *argv = proc.stdout.splitlines()
    return where, argv


@pytest.mark.parametrize(
    ("script", "module", "default"),
    [("provision.sh", "rl_multilora.provision", "artifacts/tiny"),
     ("provision_agents.sh", "rl_multilora.presets.tiny_agents", "artifacts/tiny-agents")],
)  # fmt: skip
def test_a_leading_flag_is_not_taken_for_dir(tmp_path, script, module, default):
    _, argv = _script(tmp_path, script, ["--force", "--seed", "1"], cwd=tmp_path)
    assert argv[:2] == ["-m", module]
    assert argv[argv.index("--out") + 1] == default and argv[-3:] == ["--force", "--seed", "1"]


def test_provision_agents_takes_dir_and_tiny_relative_to_the_caller(tmp_path):
    caller = tmp_path / "caller dir"
    caller.mkdir()
    where, argv = _script(tmp_path, "provision_agents.sh", ["rel/out", "--tiny", "my base", "--seed", "1"], caller)
    assert where == str(ROOT)  # the module runs from the checkout, its default folders are the checkout's
    assert argv[2:] == ["--out", f"{caller}/rel/out", "--tiny", f"{caller}/my base", "--seed", "1"]
    _, argv = _script(tmp_path, "provision_agents.sh", ["/abs/out", "--tiny=b"], caller)
    assert argv[2:] == ["--out", "/abs/out", f"--tiny={caller}/b"]
