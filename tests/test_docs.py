"""The docs stay true to the code: the generated reference pages are current, the site builds with warnings as
errors, and the README stays short and holds the test command CI runs verbatim."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_reference_is_current():
    stale = _generator().stale_pages()
    assert not stale, f"{stale} differ from the code: run python docs/gen_reference.py and commit the pages"


def test_reference_covers_every_config_field_command_and_route():
    gen = _generator()
    config, cli, http = gen.render_config(), gen.render_cli(), gen.render_http()
    for field in ("`model.max_loras`", "`adapters[].reward.path`", "`adapters[].environment.max_turns`", "`seed`"):
        assert field in config
    for command in ("provision", "run", "export", "eval", "engine-serve", "tinker-serve", "serve", "submit", "status"):
        assert f"## `rl-multilora {command}`" in cli
    for route in (
        "`/generate`",
        "`/load_lora_adapter_from_tensors`",
        "`/v1/chat/completions`",
        "`/api/v1/forward_backward`",
    ):
        assert route in http


def test_docs_site_builds_with_warnings_as_errors(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="the docs extra: pip install -e '.[docs]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_readme_is_short_and_ci_runs_its_test_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "python -m venv .venv && . .venv/bin/activate" in readme
    commands = re.findall(r"^(pip install .*python -m pytest\b.*)$", readme, flags=re.M)
    assert len(commands) == 1, commands
    assert commands[0] in (ROOT / ".ci" / "run").read_text().splitlines()
