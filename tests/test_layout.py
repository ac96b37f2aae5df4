"""Package layout rules, checked on the source with `ast` (nothing is imported to find the imports).

- `rl_multilora.lora` is a leaf package: no module under `rl_multilora/lora/` imports a project module outside it
  (`rl_multilora.*` other than `rl_multilora.lora*`, `rollout*`, `rewards*`, `examples*`, `tests*`). Every import
  counts: nested in functions, under `TYPE_CHECKING`, and relative ones, resolved against the importing module, so
  `from .. import config` is caught too.
- `rl_multilora.lora.peft_io` (the adapter-name and PEFT-config rules that config validation uses) imports without
  torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEAF = "rl_multilora.lora"
PROJECT_PACKAGES = ("rl_multilora", "rollout", "rewards", "examples", "tests")


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _outside_leaf(name: str) -> bool:
    """A project module that the leaf package must not import."""
    return name.split(".")[0] in PROJECT_PACKAGES and not _inside(name, LEAF)


def forbidden_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """`line: what` for every import in `source` (the code of `module`) of a project module outside LEAF."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if _outside_leaf(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:
                parts = package.split(".")
                if node.level - 1 >= len(parts):
                    found.append(f"{node.lineno}: relative import of level {node.level} climbs out of the project")
                    continue
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            if not _outside_leaf(base):
                continue
            # `from rl_multilora import lora` imports the leaf itself; `from rl_multilora import trainer` does not.
            bad = [a.name for a in node.names if _outside_leaf(f"{base}.{a.name}")]
            if bad:
                found.append(f"{node.lineno}: from {base} import {', '.join(bad)}")
    return found


def _module_of(path: Path) -> tuple[str, bool]:
    parts = path.relative_to(ROOT).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def test_lora_package_imports_nothing_else_of_the_project():
    files = sorted((ROOT / "rl_multilora" / "lora").rglob("*.py"))
    assert {"__init__.py", "model.py", "layer.py", "routing.py", "bank.py", "peft_io.py"} <= {f.name for f in files}
    problems = {}
    for path in files:
        module, is_package = _module_of(path)
        found = forbidden_imports(path.read_text(), module, is_package)
        if found:
            problems[str(path.relative_to(ROOT))] = found
    assert not problems, f"{LEAF} must import nothing else of the project: {problems}"


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("from rl_multilora.trainer import GRPOTrainer", True),
        ("import rl_multilora.errors", True),
        ("import rl_multilora", True),
        ("import rollout.types", True),
        ("from rewards import registry", True),
        ("from examples.multi_lora import rewards", True),
        ("def f():\n    import tests.tiny_models", True),
        ("if TYPE_CHECKING:\n    from rl_multilora.loop import build_engine", True),
        ("from rl_multilora import lora, trainer", True),
        ("from .. import config", True),  # rl_multilora.config
        ("from ..trainer import GRPOTrainer", True),
        ("from ...rollout import types", True),  # three levels up from rl_multilora.lora.model: rollout.types
        ("from .... import anything", True),  # above the top level
        ("import torch\nfrom torch import nn\nimport safetensors.torch", False),
        ("from rl_multilora.lora.bank import LoRABank\nimport rl_multilora.lora.routing", False),
        ("from rl_multilora import lora", False),
        ("from . import bank\nfrom .routing import BASE_SLOT", False),
        ("from ..lora import peft_io\nfrom ..lora.layer import LoRALinear", False),
        ("from rolloutish import x\nimport testsuite", False),  # only the project's own packages count
    ],
)
def test_the_layout_check_catches_imports_out_of_the_leaf(source, flagged):
    assert bool(forbidden_imports(source, "rl_multilora.lora.model")) == flagged


def test_relative_imports_resolve_from_the_package_init():
    # In rl_multilora/lora/__init__.py, "." is rl_multilora.lora itself and ".." is rl_multilora.
    assert not forbidden_imports("from .model import MultiLoRAModel", LEAF, is_package=True)
    assert forbidden_imports("from .. import config", LEAF, is_package=True)


def test_adapter_name_rules_import_without_torch():
    code = "import sys, rl_multilora.lora.peft_io; assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
