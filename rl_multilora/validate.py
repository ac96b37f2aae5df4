"""One validation path: everything that can be checked before a tenant starts, for `--dry-run`, `run`, `serve` and
`submit` alike, so `--dry-run` never calls valid a config that `run` would refuse.

Parsing (`rl_multilora.config`) checks types, ranges, finiteness and cross-field rules without I/O. This module adds
the checks that need the outside world, each reported as one problem in the project's grammar (`errors.bad_value`):

- run level: the model folder and its files (a local path must be a folder with `config.json`; a Hub id is left to
  the loader), the device exists, `model.target_modules` names nn.Linear modules of the model (checked on the model
  built from its config on the meta device: no weights are read), the rollout hooks class imports;
- per adapter (`adapter_problems`, the one admission check of `run`, `serve`, `submit` and `eval`): the facts are
  read first (its targets against the model's LoRA; its reward, environment, dataset rows, eval split and newest
  checkpoint from the outside world) and then judged in one place, against an `Admission` that says what the run
  knows (the model's LoRA, the eval settings, the checkpoints, the rollout settings, who holds the name).

Every function returns problems instead of raising, so one pass reports all of them.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_multilora.checkpoint import CheckpointManager, RunStateError, base_identity, base_mismatch, check_compatible
from rl_multilora.config import (
    AdapterConfig,
    ConfigError,
    EvalSettings,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    staleness_problems,
)
from rl_multilora.errors import bad_value
from rollout.data_source import said_reasons

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


@dataclass(frozen=True)
class Admission:
    """What the run knows when an adapter asks in: the facts `adapter_problems` judges it against.

    `lora_modules` / `lora_parameters`: what the model's LoRA covers (None: not inspected, e.g. a Hub id);
    `eval_settings`: the adapter's eval, whose split must load when it is on; `ckpt`: the run's checkpoints when the
    run resumes (the adapter must fit its newest one); `submitted`: an adapter sent to a running run, which must have
    budget left past that checkpoint; `rollout`: the run's rollout settings (rules that span adapter and run);
    `name_holder`: who already holds the adapter's name, when someone does; `where`: the field prefix of messages
    (default `adapters.<name>.`)."""

    lora_modules: Sequence[str] | None = None
    lora_parameters: Sequence[str] | None = None
    eval_settings: EvalSettings | None = None
    ckpt: CheckpointManager | None = None
    submitted: bool = False
    rollout: RolloutConfig | None = None
    name_holder: str | None = None
    where: str | None = None
    # The run's prompts (a `MultiLoRADataSource`: its tokenizer and the model's context), when the caller has them:
    # then a dataset none of whose rows fits (a template, max_prompt_tokens, the context) is refused, as `run` would.
    prompts: Any = None


@dataclass
class OutsideFacts:
    """What `adapter_problems` reads from the outside world about an adapter (`outside_facts`): each failed probe's
    message by field ("reward", "environment", "dataset", "eval"), the dataset's row count and first usable row, and
    the eval split's row count (None: eval off or not read). Reading them loads the dataset and builds an
    environment, which can take seconds; a caller that just read them passes them on instead of reading again."""

    failed: dict[str, str]
    n_rows: int | None
    usable: Any
    eval_rows: int | None
    skipped: dict[str, int] | None = None  # reason -> rows, before the first usable one (with a prompts source)


def _epochs_used(checkpoint: Path) -> float | None:
    """The epochs of its data an adapter's checkpoint has used (its `data_state.json` cursor), or None unread."""
    try:
        state = json.loads((checkpoint / "data_state.json").read_text())
        return (int(state["epoch"]) * int(state["n_rows"]) + int(state["cursor"])) / int(state["n_rows"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None  # a damaged checkpoint: admission sets it aside and says so


def data_problems(a: AdapterConfig, checkpoint: Path, n_rows: int | None) -> list[str]:
    """The dataset's row count against the one `a`'s checkpoint was trained on (its `data_state.json`): the cursor
    indexes rows of that dataset. A dataset with rows added or removed failed the checkpoint's load, which set every
    good checkpoint aside as damaged and FAILED the adapter (putting the dataset back did not bring them back)."""
    try:
        then = int(json.loads((checkpoint / "data_state.json").read_text())["n_rows"])
    except (OSError, ValueError, KeyError, TypeError):
        return []  # a damaged checkpoint: admission sets it aside and says so
    if n_rows is None or n_rows == then:
        return []
    return [
        bad_value(
            f"adapters.{a.name}.dataset",
            f"{n_rows} rows",
            f"{then} rows, what the checkpoint {checkpoint} was trained on (its data cursor indexes them): resume with "
            "that dataset, or start over with --fresh",
        )
    ]


ASYNC_BUILD_S = 60.0  # how long validation waits for an async environment's constructor (an episode: unbounded)


def _build_environment_once(spec) -> str | None:
    """Build (and close) one instance of environment `spec` as an episode would: a plain class in a daemon thread,
    given `turn_timeout_s`; an async one on an event loop (of its own, in a daemon thread, given ASYNC_BUILD_S).
    What went wrong, or None. A constructor that never returns held `--dry-run` (and a service's submit) for good,
    and a slow one was called valid though every episode would fail on it."""
    import asyncio

    from rollout.environments import EnvironmentLoadError, environment_class, is_async, load_environment

    outcome: dict[str, object] = {}
    try:
        on_loop = is_async(environment_class(spec.path))
    except BaseException as e:  # noqa: BLE001 - SystemExit too: whatever importing raises is the user's problem
        on_loop, outcome["error"] = False, e

    def build():
        try:
            env = load_environment(spec.path, spec.kwargs)
        except BaseException as e:  # noqa: BLE001 - SystemExit too: whatever building raises is the user's problem
            outcome["error"] = e
            return None
        try:
            return env.close()  # a coroutine where close is `async def`
        except Exception:  # noqa: BLE001 - closing is the environment's business: it was built
            return None

    def build_in_a_thread() -> None:
        closing = build()
        if inspect.iscoroutine(closing):
            closing.close()

    async def build_on_a_loop() -> None:  # an async class's constructor may bind the loop it is built on
        closing = build()
        if inspect.isawaitable(closing):
            with contextlib.suppress(Exception):
                await closing

    if "error" not in outcome:
        # A plain class is built as an episode builds it: in a worker thread, cut at turn_timeout_s. An async one is
        # built on the rollout's event loop without that bound; here on a loop of its own, given ASYNC_BUILD_S.
        wait = ASYNC_BUILD_S if on_loop else spec.turn_timeout_s
        target = (lambda: asyncio.run(build_on_a_loop())) if on_loop else build_in_a_thread
        thread = threading.Thread(target=target, name="validate-environment", daemon=True)
        thread.start()
        thread.join(wait)
        if thread.is_alive() and on_loop:
            return (
                f"environment.path={spec.path!r}: building it did not finish within {wait:g} s; allowed: an async "
                "environment whose constructor returns at once (an episode builds it on the event loop every "
                "episode shares, where it would stall them all)"
            )
        if thread.is_alive():
            return (
                f"environment.path={spec.path!r}: building it ran past environment.turn_timeout_s="
                f"{spec.turn_timeout_s:g} (every episode would fail so); allowed: a constructor that returns within "
                "it (or a larger turn_timeout_s)"
            )
    e = outcome.get("error")
    if e is None:
        return None
    if isinstance(e, EnvironmentLoadError):
        return str(e)
    return f"environment.path={spec.path!r}: building it raised {type(e).__name__}: {e}"


def outside_facts(a: AdapterConfig, eval_settings: EvalSettings | None, prompts=None) -> OutsideFacts:
    """Resolve `a`'s reward, build (and close) one environment instance, load its dataset and eval split; with
    `prompts` (a `MultiLoRADataSource`) its rows are read as a run reads them (`Admission.prompts`)."""

    import rewards
    from rollout.data_source import eval_split, first_usable_row, load_dataset_rows

    failed: dict[str, str] = {}  # field -> message, for each probe that raised
    if a.reward is not None:
        try:
            rewards.validate(a.reward)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - whatever resolving raises (SystemExit too) is the user's problem
            failed["reward"] = str(e)
    if a.environment is not None:
        problem = _build_environment_once(a.environment)
        if problem is not None:
            failed["environment"] = problem
    n_rows, usable, skipped = None, None, None
    try:
        rows = load_dataset_rows(a.dataset)
        n_rows = len(rows)
        if prompts is not None:
            usable, skipped = prompts.first_usable_row(a.dataset, rows)
        else:
            usable = first_usable_row(rows, a.dataset)
    except Exception as e:  # noqa: BLE001 - any failure here is a user config problem, reported as such
        failed["dataset"] = str(e)
    eval_rows = None
    if eval_settings is not None and eval_settings.enabled:
        try:
            eval_rows = len(load_dataset_rows(eval_split(a.dataset, eval_settings.split, eval_settings.data_files)))
        except Exception as e:  # noqa: BLE001
            failed["eval"] = str(e)
    return OutsideFacts(failed, n_rows, usable, eval_rows, dict(skipped) if skipped else None)


def adapter_problems(a: AdapterConfig, admission: Admission, facts: OutsideFacts | None = None) -> list[str]:
    """Everything that keeps adapter `a` from starting, each naming the field, the value and what is allowed.

    It reads the facts first (its targets against the model's LoRA, then the reward, environment, dataset, eval split
    (`outside_facts`, unless `facts` holds them already) and checkpoint from the outside world, each failure kept as
    its message) and then judges them in one place, in a fixed order: reward, environment, dataset, targets, expert
    parameters, eval split, checkpoint, name, staleness."""
    ctx = admission
    where = f"adapters.{a.name}." if ctx.where is None else ctx.where
    targets = [a.target_modules] if isinstance(a.target_modules, str) else list(a.target_modules or [])
    unmatched_modules = _unmatched([] if targets == ["all-linear"] else targets, ctx.lora_modules)
    unmatched_parameters = _unmatched(a.target_parameters or [], ctx.lora_parameters)

    # -- facts from the outside world --------------------------------------------------------------------------------
    if facts is None:
        facts = outside_facts(a, ctx.eval_settings, ctx.prompts)
    failed, eval_rows = facts.failed, facts.eval_rows
    eval_on = ctx.eval_settings is not None and ctx.eval_settings.enabled
    found = ctx.ckpt.latest_meta(a.name) if ctx.ckpt is not None else None
    clients = found is not None and found[1].get("label") is not None  # a Tinker client's save_weights wrote it
    resume = []
    if found is not None and not clients:
        try:
            check_compatible(a.name, a.model_dump(mode="json"), found[1].get("config", {}), found[0])
        except ConfigError as e:
            resume = e.problems
        if not resume:
            resume = coverage_problems(a, found[0], ctx.lora_modules, ctx.lora_parameters)
        if not resume:
            resume = data_problems(a, found[0], facts.n_rows)

    # -- the judgement -----------------------------------------------------------------------------------------------
    problems = [
        f"{where}{field}: {failed[field]}" for field in ("reward", "environment", "dataset") if field in failed
    ]
    if facts.n_rows is not None and facts.usable is None:
        what = (
            "has no rows"
            if facts.n_rows == 0
            else f"has no row with a non-empty {a.dataset.prompt_key!r} and {a.dataset.label_key!r}"
        )
        if facts.n_rows and facts.skipped:  # read as a run reads them: every row would be skipped, and why
            what = f"has no usable row: all {facts.n_rows} rows would be skipped ({said_reasons(facts.skipped)})"
        field_name, value = a.dataset.named_by()
        problems.append(
            bad_value(f"{where}{field_name}", value, f"a dataset with at least one usable row; this one {what}")
        )
    elif facts.n_rows is not None and a.prompts_per_step > facts.n_rows:  # drawn by the row: 1e11 filled memory
        problems.append(
            bad_value(
                f"{where}prompts_per_step",
                a.prompts_per_step,
                f"at most the dataset's {facts.n_rows} rows (a step would draw a row more than once)",
            )
        )
    if unmatched_modules:
        leaves = sorted({m.rsplit(".", 1)[-1] for m in ctx.lora_modules})
        problems.append(
            bad_value(
                f"{where}target_modules",
                a.target_modules,
                f"names of the model's LoRA modules ({', '.join(leaves)}); "
                f"{', '.join(map(repr, unmatched_modules))} match none",
            )
        )
    if unmatched_parameters:
        names = sorted({p.split(".layers.")[-1].split(".", 1)[-1] for p in ctx.lora_parameters}) or ["none"]
        problems.append(
            bad_value(
                f"{where}target_parameters",
                a.target_parameters,
                f"the model's expert LoRA Parameters ({', '.join(names)}); "
                f"{', '.join(map(repr, unmatched_parameters))} match none",
            )
        )
    if eval_on:
        split = ctx.eval_settings.split
        fix = (
            f"eval.split={split!r}: give the dataset a '{split}' split, e.g. data_files: {{train: ..., test: ...}}, "
            "or set eval.data_files, or eval.enabled: false"
        )
        if "eval" in failed:  # the split hint where the split is what failed (a bad column is the dataset's own)
            problems.append(f"{where}eval: {failed['eval']}" + (f" ({fix})" if "split" in failed["eval"] else ""))
        elif eval_rows == 0:
            problems.append(f"{where}eval: the split has no rows ({fix})")
    problems += resume
    if found is not None and not clients and not resume and ctx.submitted:
        # admission would resume it at its budget and retire it at once, without a word: say so instead
        done = int(found[1]["adapter_step"])
        if a.max_steps is not None and done >= a.max_steps:
            problems.append(
                bad_value(
                    "max_steps", a.max_steps, f"more than {done}: its checkpoint is already at adapter step {done}"
                )
            )
        used = _epochs_used(found[0])
        if a.epochs is not None and used is not None and used >= a.epochs - 1e-9:
            problems.append(
                bad_value(
                    "epochs", a.epochs, f"more than {used:g}: its checkpoint has used {used:g} epochs of its data"
                )
            )
    if ctx.name_holder is not None:
        problems.append(bad_value("name", a.name, f"a name no live adapter has ({ctx.name_holder})"))
    elif clients:  # resuming from them would hand one tenant's weights to another
        where_ = found[0].parent
        problems.append(bad_value("name", a.name, f"a name without a Tinker client's checkpoints ({where_} has them)"))
    if ctx.rollout is not None:
        problems += staleness_problems(a, ctx.rollout)
    return problems


def coverage_problems(
    a: AdapterConfig, checkpoint: Path, lora_modules: Sequence[str] | None, lora_parameters: Sequence[str] | None
) -> list[str]:
    """The Linears `a`'s checkpoint holds LoRA for against those `a` covers now (its `target_modules` within the
    model's, `model.target_modules`). An adapter that leaves `target_modules` to the model has the same config when
    `model.target_modules` changes, so `check_compatible` passes, and its checkpoints then failed to load and were set
    aside as damaged: every good one, the adapter FAILED, and putting the config back did not bring them back."""
    from safetensors import safe_open

    from rl_multilora.lora.peft_io import PEFT_KEY_PATTERN, matches_target

    if lora_modules is None:
        return []  # the model is not inspected here (a Hub id): the loader checks
    try:
        with safe_open(str(checkpoint / "adapter_model.safetensors"), "pt") as f:
            keys = list(f.keys())
    except Exception:  # noqa: BLE001 - a damaged checkpoint: restore sets it aside and takes an older one
        return []
    experts = {p.rsplit(".", 1)[0] for p in lora_parameters or ()}  # expert LoRA keys name their module too
    then = {
        m.group(1)
        for k in keys
        if (m := PEFT_KEY_PATTERN.fullmatch(k)) and ".base_layer" not in m.group(1) and m.group(1) not in experts
    }
    targets = a.target_modules
    if targets is None or targets == "all-linear":
        now = set(lora_modules)
    else:
        wanted = [targets] if isinstance(targets, str) else list(targets)
        now = {n for n in lora_modules if any(matches_target(n, t) for t in wanted)}
    if then == now:
        return []
    gone, new = sorted(then - now), sorted(now - then)
    said = "; ".join(
        part
        for part in (
            f"{len(gone)} it holds are not covered now (e.g. {gone[0]!r})" if gone else "",
            f"{len(new)} covered now are not in it (e.g. {new[0]!r})" if new else "",
        )
        if part
    )
    return [
        bad_value(
            f"adapters.{a.name}.target_modules",
            a.target_modules,
            f"the modules its checkpoint {checkpoint} was trained on: {said} (model.target_modules changed? put it "
            "back, or start over with --fresh)",
        )
    ]


def _unmatched(wanted: Sequence[str], names: Sequence[str] | None) -> list[str]:
    """The patterns of `wanted` that match none of `names` (PEFT's suffix rule); none when `names` is unknown."""
    from rl_multilora.lora.peft_io import matches_target

    if names is None:
        return []
    return [t for t in wanted if not any(matches_target(n, t) for n in names)]


def allocator_problems(model: ModelConfig) -> list[str]:
    """`model.host_allocator: jemalloc` needs a library `run` can preload (`rl-multilora run` starts itself again
    with it; `host_memory.find_jemalloc`). Whether the loader then accepts the file shows only in that new process."""
    from rl_multilora.host_memory import find_jemalloc, jemalloc_loaded

    if model.host_allocator != "jemalloc" or jemalloc_loaded():
        return []
    try:
        find_jemalloc()
    except ValueError as e:
        return [str(e)]
    return []


def resume_problems(ckpt: CheckpointManager, mode: str, model_path: str | None = None) -> list[str]:
    """`checkpoint.resume` against the run dir: "always" (--resume) needs run state or a checkpoint there, and a
    damaged run_state.json, or one recorded on another base than `model_path`, stops any resume
    (`TenantManager.restore_run_state` reads it)."""
    try:
        state = ckpt.read_run_state()
    except RunStateError as e:
        return [str(e)]
    if state is not None and model_path is not None:
        mismatch = base_mismatch(state, base_identity(model_path), model_path)
        if mismatch is not None:
            return [mismatch]
    if mode == "always" and state is None and not ckpt.has_checkpoints():
        return [
            bad_value(
                "checkpoint.resume",
                mode,
                f"'auto' or 'never' here: {ckpt.run_dir} has no run_state.json and no checkpoint to resume from "
                "(run without --resume to start a new run)",
            )
        ]
    return []


def _prompts(cfg: RunConfig):
    """The run's data source (its tokenizer, the model's context) to read the adapters' rows with, or None when the
    tokenizer does not load (said by the run itself then)."""
    from rl_multilora import components

    try:
        return components.build_data_source(cfg, components.build_tokenizer(cfg.model))
    except Exception:  # noqa: BLE001 - the rows are then checked for a filled prompt and label only
        return None


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
    problems += allocator_problems(cfg.model)
    if cfg.rollout.engine == "sglang" and cfg.rollout.url is None:
        import importlib.util

        if importlib.util.find_spec("sglang") is None:  # launching one would fail after the model loaded
            problems.append(
                bad_value(
                    "rollout.engine",
                    "sglang",
                    "'sglang' where the sglang package is installed (it launches `python -m sglang.launch_server`), "
                    "or rollout.url naming a running server, or 'embedded'",
                )
            )
    run_dir = Path(cfg.run_dir).expanduser()
    if run_dir.exists() and not run_dir.is_dir():
        problems.append(bad_value("run_dir", cfg.run_dir, "a folder, new or a run's (this is a file)"))
    if cfg.logging.wandb.mode != "disabled":
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            problems.append(
                bad_value("logging.wandb.mode", cfg.logging.wandb.mode, "'disabled' here: wandb is not installed")
            )
    ckpt = CheckpointManager(Path(cfg.run_dir)) if cfg.checkpoint.resume != "never" else None
    if ckpt is not None:
        problems += resume_problems(ckpt, cfg.checkpoint.resume, cfg.model.path)
    prompts = _prompts(cfg) if cfg.adapters and not problems else None
    for a in cfg.adapters:
        admission = Admission(lora_modules, lora_parameters, cfg.eval_for(a), ckpt, prompts=prompts)
        problems += adapter_problems(a, admission)
    return problems


def own_config_problems(cfg: RunConfig, source: str | None) -> list[str]:
    """A run writes its resolved config to RUN_DIR/config.yaml; when that is the CONFIG file itself, a user's file
    (comments, layout, `--set`s not in it) was replaced by the dump without a word. A file that is already the dump of
    the config it holds (a run resumed from its own config.yaml, with or without --set, --resume or --fresh) is the
    run's own, so it may be run."""
    from rl_multilora.config import ConfigError, dump_config, load_run_config

    if source is None:
        return []
    target = Path(cfg.run_dir) / "config.yaml"
    try:
        if not target.is_file() or not target.samefile(source):
            return []
        # the file as written, without the command line's --set / --resume / --fresh (they change `cfg`, not it)
        if target.read_text() == dump_config(load_run_config(target)):
            return []
    except (OSError, ConfigError):
        return []
    return [
        bad_value(
            "run_dir",
            cfg.run_dir,
            f"a folder other than the one holding CONFIG ({source}): the run writes its resolved config to "
            "RUN_DIR/config.yaml, which would replace yours (keep the config beside the run dir, e.g. run_dir: "
            "runs/NAME)",
        )
    ]


def check_run(cfg: RunConfig, source: str | None = None, service: bool = False) -> None:
    """Raise ConfigError listing every problem `run_problems` finds; a run (not a `service`, which takes adapters by
    `submit`) needs at least one adapter."""
    problems = run_problems(cfg) + own_config_problems(cfg, source)
    if not cfg.adapters and not service:
        problems.insert(
            0, bad_value("adapters", [], "at least one adapter (`serve` starts without and takes `submit`)")
        )
    if problems:
        raise ConfigError(problems, source)
