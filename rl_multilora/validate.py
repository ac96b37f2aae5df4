"""One validation path: everything that can be checked before a tenant starts, for `--dry-run`, `run`, `serve` and
`submit` alike, so `--dry-run` never calls valid a config that `run` would refuse.

Parsing (`rl_multilora.config`) checks types, ranges, finiteness and cross-field rules without I/O. This module adds
the checks that need the outside world, each reported as one problem in the project's grammar (`errors.bad_value`):

- run level: the model folder and its files (a local path must be a folder with `config.json`; a Hub id is left to
  the loader), the device exists, `model.target_modules` names nn.Linear modules of the model (checked on the model
  built from its config on the meta device: no weights are read), the rollout hooks class imports;
- per adapter: the reward resolves (`rewards.validate`), the dataset loads and has at least one row with a non-empty
  prompt and label, and its `target_modules` match modules the model's LoRA covers.

Every function returns problems instead of raising, so one pass reports all of them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rl_multilora.checkpoint import CheckpointManager
from rl_multilora.config import AdapterConfig, ConfigError, EvalSettings, ModelConfig, RunConfig
from rl_multilora.errors import bad_value

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _looks_local(path: str) -> bool:
    """A path the user meant as a local folder: it exists, is absolute or explicit, or is not shaped like a Hub id."""
    return os.path.exists(path) or path.startswith(("/", "./", "../", "~")) or not _HUB_ID.match(path)


def model_problems(model: ModelConfig) -> list[str]:
    """The model folder, its config and the device (no weights are read)."""
    problems = []
    path = os.path.expanduser(model.path)
    if _looks_local(path):
        if os.path.isfile(path):
            problems.append(bad_value("model.path", model.path, "a folder of an HF model (this is a file)"))
        elif not os.path.isdir(path):
            problems.append(bad_value("model.path", model.path, "an existing folder of an HF model, or a Hub id"))
        elif not os.path.isfile(os.path.join(path, "config.json")):
            problems.append(bad_value("model.path", model.path, "a folder holding an HF model's config.json"))
    problems += _device_problems(model.device)
    return problems


def _device_problems(device: str) -> list[str]:
    import torch

    allowed = "'auto', 'cpu', 'cuda' or 'cuda:N' (N < the number of CUDA devices)"
    if device == "auto":
        return []
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return [bad_value("model.device", device, allowed)]
    if dev.type == "cpu":
        return []
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            return [bad_value("model.device", device, f"{allowed}; this machine has no CUDA device")]
        if dev.index is not None and dev.index >= n:
            return [bad_value("model.device", device, f"{allowed}; this machine has {n}")]
        return []
    return [bad_value("model.device", device, allowed)]


def model_lora_modules(model: ModelConfig) -> tuple[list[str] | None, list[str]]:
    """(names of the Linears the model's LoRA wraps, problems); names is None when the model cannot be inspected."""
    targets, problems = model_lora_targets(model)
    return (None if targets is None else targets[0]), problems


def model_lora_targets(model: ModelConfig) -> tuple[tuple[list[str], list[str]] | None, list[str]]:
    """((LoRA Linears, expert LoRA Parameters) of the model, problems), read from a meta-device skeleton; None when
    the model cannot be inspected (no local folder: a Hub id the loader fetches, or a path model_problems reports)."""
    path = os.path.expanduser(model.path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        return None, []  # reported by model_problems, or a Hub id the loader will fetch
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl_multilora.lora.model import select_parameters, select_targets

    try:
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 - any failure to read the config is the user's model folder
        return None, [bad_value("model.path", model.path, f"an HF causal LM folder ({type(e).__name__}: {e})")]
    try:
        experts = select_parameters(skeleton, model.target_parameters)
    except ValueError as e:
        return None, [f"model.{e}"]
    params = [f"{m}.{p}" if m else p for m, ps in experts.items() for p in ps]
    try:
        linears = select_targets(skeleton, model.target_modules, allow_empty=bool(params))
    except ValueError as e:
        return None, [f"model.{e}"]
    return (linears, params), []


def adapter_target_problems(a: AdapterConfig, lora_modules: Sequence[str], where: str) -> list[str]:
    """Each of the adapter's `target_modules` must match a module the model's LoRA covers (PEFT's suffix rule)."""
    from rl_multilora.lora.peft_io import matches_target

    targets = a.target_modules
    if targets is None or targets == "all-linear":
        return []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unmatched = [t for t in targets if not any(matches_target(m, t) for m in lora_modules)]
    if not unmatched:
        return []
    leaves = sorted({m.rsplit(".", 1)[-1] for m in lora_modules})
    return [
        bad_value(
            f"{where}target_modules",
            a.target_modules,
            f"names of the model's LoRA modules ({', '.join(leaves)}); {', '.join(map(repr, unmatched))} match none",
        )
    ]


def dataset_problems(a: AdapterConfig, where: str) -> list[str]:
    """The dataset loads and has at least one row with a non-empty prompt and label."""
    from rollout.data_source import load_dataset_rows, read_row

    try:
        rows = load_dataset_rows(a.dataset)
    except Exception as e:  # noqa: BLE001 - any failure here is a user config problem, reported as such
        return [f"{where}dataset: {e}"]
    spec = a.dataset
    for i in range(len(rows)):
        row = read_row(rows, i)  # an undecodable row is a bad row, counted when drawn; it never stops the check
        if not isinstance(row, str) and _filled(row.get(spec.prompt_key)) and _filled(row.get(spec.label_key)):
            return []
    what = (
        "has no rows" if len(rows) == 0 else f"has no row with a non-empty {spec.prompt_key!r} and {spec.label_key!r}"
    )
    return [bad_value(f"{where}dataset.path", spec.path, f"a dataset with at least one usable row; this one {what}")]


def _filled(value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, str | list | dict | tuple):
        return len(value) > 0 and (not isinstance(value, str) or bool(value.strip()))
    return True


def adapter_parameter_problems(a: AdapterConfig, lora_parameters: Sequence[str], where: str) -> list[str]:
    """Each of the adapter's `target_parameters` must match an expert Parameter the model's LoRA covers."""
    from rl_multilora.lora.peft_io import matches_target

    unmatched = [t for t in a.target_parameters or [] if not any(matches_target(p, t) for p in lora_parameters)]
    if not unmatched:
        return []
    names = sorted({p.split(".layers.")[-1].split(".", 1)[-1] for p in lora_parameters}) or ["none"]
    return [
        bad_value(
            f"{where}target_parameters",
            a.target_parameters,
            f"the model's expert LoRA Parameters ({', '.join(names)}); {', '.join(map(repr, unmatched))} match none",
        )
    ]


def adapter_problems(
    a: AdapterConfig,
    lora_modules: Sequence[str] | None,
    eval_settings: EvalSettings | None = None,
    where: str | None = None,
    ckpt: CheckpointManager | None = None,
    lora_parameters: Sequence[str] | None = None,
    submitted: bool = False,
) -> list[str]:
    """I/O checks of one adapter: reward, dataset, (when known) its target modules against the model, its eval split
    when its eval is on, and (with `ckpt`, when the run resumes) that its newest checkpoint can resume it (and, for a
    `submitted` adapter, is below its budget)."""
    import rewards

    where = f"adapters.{a.name}." if where is None else where
    problems = []
    if a.reward is not None:
        try:
            rewards.validate(a.reward)
        except Exception as e:  # noqa: BLE001
            problems.append(f"{where}reward: {e}")
    if a.environment is not None:
        problems += environment_problems(a, where)
    problems += dataset_problems(a, where)
    if lora_modules is not None:
        problems += adapter_target_problems(a, lora_modules, where)
    if lora_parameters is not None:
        problems += adapter_parameter_problems(a, lora_parameters, where)
    if eval_settings is not None and eval_settings.enabled:
        problems += _eval_problems(a, eval_settings, where)
    if ckpt is not None:
        problems += resume_problems(a, ckpt, submitted)
    return problems


def environment_problems(a: AdapterConfig, where: str) -> list[str]:
    """The environment class imports, subclasses `Environment` and takes its kwargs (one instance is built)."""
    from rollout.environments import load_environment

    try:
        env = load_environment(a.environment.path, a.environment.kwargs)
    except Exception as e:  # noqa: BLE001 - whatever building it raises is the user's environment problem
        return [f"{where}environment: {e}"]
    try:
        env.close()
    except Exception:  # noqa: BLE001, S110 - closing an unused instance: nothing to report
        pass
    return []


def resume_problems(a: AdapterConfig, ckpt: CheckpointManager, submitted: bool = False) -> list[str]:
    """Rank, alpha, targets and seed must equal those of the checkpoint the adapter would resume from; a `submitted`
    adapter (not one of the run's own, registered again at start) must have budget left past that checkpoint."""
    from rl_multilora.checkpoint import check_compatible

    found = ckpt.latest_meta(a.name)
    if found is None:
        return []
    latest, meta = found
    try:
        check_compatible(a.name, a.model_dump(mode="json"), meta.get("config", {}), latest)
    except ConfigError as e:
        return e.problems
    done = int(meta["adapter_step"])
    if submitted and a.max_steps is not None and done >= a.max_steps:
        # Admission would resume it at its budget and retire it at once: say so instead of accepting it.
        return [
            bad_value("max_steps", a.max_steps, f"more than {done}: its checkpoint is already at adapter step {done}")
        ]
    return []


def _eval_problems(a: AdapterConfig, settings: EvalSettings, where: str) -> list[str]:
    """The eval split loads (`eval.split` of `eval.data_files`, or of the dataset's own files)."""
    import dataclasses

    from rollout.data_source import load_dataset_rows

    spec = dataclasses.replace(a.dataset, split=settings.split, data_files=settings.data_files or a.dataset.data_files)
    try:
        load_dataset_rows(spec)
    except Exception as e:  # noqa: BLE001
        return [
            f"{where}eval: {e} (eval.split={settings.split!r}: give the dataset a '{settings.split}' split, e.g. "
            "data_files: {train: ..., test: ...}, or set eval.data_files, or eval.enabled: false)"
        ]
    return []


def run_problems(cfg: RunConfig) -> list[str]:
    """Everything `run` needs before it starts: model, device, targets, hooks, and each adapter's I/O checks."""
    from rollout.generate_state import HooksError, load_hooks

    problems = model_problems(cfg.model)
    if cfg.trainer.world_size > 1:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            problems.append(
                bad_value(
                    "trainer.world_size", cfg.trainer.world_size, "1 without Ray; install the ray extra for more ranks"
                )
            )
    targets, found = model_lora_targets(cfg.model) if not problems else (None, [])
    lora_modules, lora_parameters = targets if targets is not None else (None, None)
    problems += found
    if cfg.rollout.hooks is not None:
        try:
            load_hooks(cfg.rollout.hooks)
        except HooksError as e:
            problems.append(f"rollout.hooks: {e}")
    ckpt = CheckpointManager(Path(cfg.run_dir)) if cfg.checkpoint.resume != "never" else None
    for a in cfg.adapters:
        problems += adapter_problems(a, lora_modules, cfg.eval_for(a), ckpt=ckpt, lora_parameters=lora_parameters)
    return problems


def check_run(cfg: RunConfig, source: str | None = None) -> None:
    """Raise ConfigError listing every problem `run_problems` finds."""
    problems = run_problems(cfg)
    if problems:
        raise ConfigError(problems, source)
