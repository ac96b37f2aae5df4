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


# ----------------------------------------------------------------------------------------------- the whole project

SOURCE_PACKAGES = ("rl_multilora", "rollout", "rewards")


def _project_modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for package in SOURCE_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module, is_package = _module_of(path)
            out[module] = (path, is_package)
    return out


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def project_imports(
    source: str, module: str, is_package: bool, known: set[str], type_checking: bool = True
) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import of a project module in `source`, nested ones
    included, and those under `if TYPE_CHECKING:` unless `type_checking` is False (a cycle hidden behind it is
    still a cycle of design)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST) -> None:
        if not type_checking and _is_type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, None, node.lineno) for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for a in node.names:
                if f"{base}.{a.name}" in known:  # `from pkg import submodule`
                    found.append((f"{base}.{a.name}", None, node.lineno))
                elif base in known:
                    found.append((base, a.name, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def _import_graph() -> dict[str, dict[str, int]]:
    modules = _project_modules()
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, (path, is_package) in modules.items():
        for target, _, line in project_imports(path.read_text(), module, is_package, set(modules)):
            if target != module:
                graph[module].setdefault(target, line)
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            strong(v)
    return out


def test_the_project_has_no_import_cycles():
    # A package's __init__ re-exporting its submodules is not a cycle of design: leave the package-to-own-child
    # edges out, keep everything else (nested imports and TYPE_CHECKING ones too).
    graph = {
        m: {t: line for t, line in targets.items() if not t.startswith(m + ".")}
        for m, targets in _import_graph().items()
    }
    assert not find_cycles(graph)


def test_the_cycle_check_finds_a_cycle():
    assert find_cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_module_imports_another_modules_underscored_names():
    modules = _project_modules()
    problems = []
    for module, (path, is_package) in modules.items():
        for target, name, line in project_imports(path.read_text(), module, is_package, set(modules)):
            if name is not None and name.startswith("_") and not name.startswith("__") and target != module:
                problems.append(f"{path.relative_to(ROOT)}:{line}: from {target} import {name}")
    assert not problems, problems


def test_type_checking_imports_count_for_cycles():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rl_multilora.batch import Row\n"
    known = {"rl_multilora.batch"}
    assert project_imports(source, "rl_multilora.grpo", False, known) == [("rl_multilora.batch", "Row", 3)]
    assert project_imports(source, "rl_multilora.grpo", False, known, type_checking=False) == []


# Modules of `rl_multilora` that `rollout` may import: the leaves that import nothing of `rollout` back.
ROLLOUT_MAY_IMPORT = ("rl_multilora.lora", "rl_multilora.errors", "rl_multilora.host_memory")


def rollout_problems(graph: dict[str, dict[str, int]]) -> list[str]:
    """`module:line -> target` for every import in `rollout` of an `rl_multilora` module other than its leaves."""
    return [
        f"{module}:{line} -> {target}"
        for module, targets in graph.items()
        if _inside(module, "rollout")
        for target, line in targets.items()
        if _inside(target, "rl_multilora") and not any(_inside(target, leaf) for leaf in ROLLOUT_MAY_IMPORT)
    ]


def test_rollout_imports_only_the_leaves_of_rl_multilora():
    assert not rollout_problems(_import_graph())


def test_the_rollout_check_flags_what_imports_rollout_back():
    graph = {"rollout.x": {"rl_multilora.components": 3, "rl_multilora.lora.peft_io": 4, "rl_multilora.errors": 5}}
    assert rollout_problems(graph) == ["rollout.x:3 -> rl_multilora.components"]


# Where the multi-LoRA model is built from a config: `components` (one process, engines) and the sharded build.
MODEL_BUILDERS = ("rl_multilora.components", "rl_multilora.backends.fsdp")


def model_builds(source: str) -> list[int]:
    """Lines that build a multi-LoRA model (`MultiLoRAModel.from_pretrained` / `.from_model`)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("from_pretrained", "from_model")
        and "MultiLoRAModel" in ast.unparse(node.func.value)
    ]


def test_only_components_and_the_sharded_build_make_the_model():
    found = {
        module: lines
        for module, (path, _) in _project_modules().items()
        if module not in MODEL_BUILDERS and not _inside(module, LEAF)
        for lines in [model_builds(path.read_text())]
        if lines
    }
    assert not found, f"the model is built only in {MODEL_BUILDERS}: {found}"
    assert model_builds("m = MultiLoRAModel.from_pretrained(p)\nx = lora.MultiLoRAModel.from_model(b)") == [1, 2]
