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
- any Hub model id (`owner/name`, e.g. `Qwen/Qwen3-4B`): `huggingface_hub.snapshot_download` into `DIR/model`,
  GSM8K from `openai/gsm8k` (config `main`) exported in the layout above; arith and compare are synthetic tasks with
  no Hub counterpart, so they are written by the same seeded generators as for `tiny`. Needs network access.

Design choices:

- PROVISIONED.json is written last, so its presence means the directory is complete. A second call with the same
  preset, seed and settings returns at once; a different recipe in the same directory is an error unless `force`.
- Same seed, same files: every file except PROVISIONED.json (which holds wall times) is byte-identical across runs
  on the same torch build (the tiny build runs on one intra-op thread whatever the machine has).
- Test questions are held out of the tiny model's pretraining, so its base stats are measured on unseen prompts.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from rl_multilora.presets.tiny_config import TinyPresetConfig, named_rng
from rl_multilora.presets.tiny_tasks import TASKS, TaskExample, generate_split

MARKER = "PROVISIONED.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


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


def _provision_tiny(out: Path, seed: int, cfg: TinyPresetConfig) -> dict:
    import torch

    # One intra-op thread: the matmuls are too small to gain from a second one, a shared machine makes two threads
    # wait on each other (seconds per step under load instead of a fraction), and a fixed count keeps the float
    # reductions, hence the weights, identical on any machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _build_tiny(out, seed, cfg)
    finally:
        torch.set_num_threads(threads)


def _build_tiny(out: Path, seed: int, cfg: TinyPresetConfig) -> dict:
    import torch

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

    t0 = time.perf_counter()
    tokenizer = build_tokenizer(tokenizer_corpus(seed), cfg.vocab_size, cfg.max_positions)
    model = build_model(tokenizer, cfg, seed)
    timings["tokenizer_s"] = time.perf_counter() - t0

    exclude = {ex.question for by_split in splits.values() for ex in by_split["test"]}
    train_stats = pretrain(model, tokenizer, cfg, seed, exclude)
    timings["pretrain_s"] = train_stats.seconds
    fold_temperature(model, cfg.fold_temperature)

    t0 = time.perf_counter()
    model_dir = out / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    # "PreTrainedTokenizerFast" loads on transformers 4.x too (5.x saves its new backend class name); either way
    # AutoTokenizer then reads our tokenizer.json as it is.
    config_path = model_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
    timings["save_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    base = evaluate_base(model, tokenizer, {t: s["test"] for t, s in splits.items()}, cfg, seed)
    timings["eval_s"] = time.perf_counter() - t0
    return {
        "model": {
            "family": "llama",
            "parameters": sum(p.numel() for p in model.parameters()),
            "vocab_size": len(tokenizer),
            "torch": torch.__version__,
            "pretrain": asdict(train_stats),
        },
        "data": sizes,
        "base_stats": stats_to_json(base),
        "timings": timings,
    }


def _provision_hub(repo_id: str, out: Path, seed: int, n_train: int, n_test: int) -> dict:
    """Download `repo_id` and GSM8K from the Hub; arith and compare come from the synthetic generators."""
    from datasets import load_dataset
    from huggingface_hub import snapshot_download

    timings = {}
    t0 = time.perf_counter()
    snapshot_download(repo_id=repo_id, local_dir=str(out / "model"))
    timings["model_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
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
    config: TinyPresetConfig | None = None,
) -> Path:
    """Write the base model and the datasets of `preset` into `out`; return `out`.

    `preset` is "tiny" (built offline) or a Hub model id "owner/name" (downloaded). `config` changes the tiny recipe
    (model size, data sizes, pretraining; its `n_train` / `n_test` also size the synthetic arith and compare splits of
    a Hub preset) and `pretrain_steps` overrides its step count (tests pass a handful). If `out` already holds a
    completed provisioning of the same recipe (preset, seed, config), nothing is done unless `force`; a different
    recipe there is an error unless `force`.
    """
    if not isinstance(preset, str) or not (preset == "tiny" or _HUB_ID.match(preset)):
        raise ValueError(f"preset={preset!r} is not allowed; use 'tiny' or a Hub model id like 'Qwen/Qwen3-4B'")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative integer")
    if config is not None and not isinstance(config, TinyPresetConfig):
        raise TypeError(f"config={config!r} must be a TinyPresetConfig or None")
    cfg = config or TinyPresetConfig()
    if pretrain_steps is not None:
        cfg = replace(cfg, pretrain_steps=pretrain_steps)  # validated again, naming the field
    recipe = {"preset": preset, "seed": seed}
    recipe["settings"] = asdict(cfg) if preset == "tiny" else {"n_train": cfg.n_train, "n_test": cfg.n_test}

    out = Path(out)
    marker = out / MARKER
    if marker.exists():
        previous = json.loads(marker.read_text())
        same = all(previous.get(k) == v for k, v in recipe.items())
        if same and not force:
            return out
        if not same and not force:
            raise FileExistsError(
                f"out={str(out)!r} already holds preset={previous.get('preset')!r} seed={previous.get('seed')!r} "
                f"(settings may differ too); pass force=True (--force) to rebuild it or choose another directory"
            )
    # Clear only what provisioning writes; anything else a user keeps in `out` stays.
    marker.unlink(missing_ok=True)
    for sub in ("model", "data"):
        shutil.rmtree(out / sub, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)

    start, cpu_start = time.perf_counter(), time.process_time()
    if preset == "tiny":
        built = _provision_tiny(out, seed, cfg)
    else:
        built = _provision_hub(preset, out, seed, cfg.n_train, cfg.n_test)
    built["timings"]["total_s"] = time.perf_counter() - start
    built["timings"]["cpu_s"] = time.process_time() - cpu_start  # wall time on a shared machine says little
    record = {**recipe, **built, "layout": {"model": "model", "data": {t: f"data/{t}" for t in TASKS}}}
    tmp = out / (MARKER + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(marker)  # atomic: a crash never leaves a half-written marker
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rl-multilora provision", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="'tiny' (offline) or a Hub model id such as Qwen/Qwen3-4B")
    parser.add_argument("--out", required=True, help="output directory (model/, data/, PROVISIONED.json)")
    parser.add_argument("--seed", type=int, default=0, help="seed for data, tokenizer, init and pretraining")
    parser.add_argument("--force", action="store_true", help="rebuild even if DIR is already provisioned")
    parser.add_argument("--pretrain-steps", type=int, default=None, help="tiny preset: AdamW steps (default 300)")
    args = parser.parse_args(argv)
    try:
        out = provision(args.preset, args.out, seed=args.seed, force=args.force, pretrain_steps=args.pretrain_steps)
    except (ValueError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    record = json.loads((out / MARKER).read_text())
    print(f"provisioned {record['preset']} (seed {record['seed']}) in {out}")
    for task, s in record.get("base_stats", {}).items():
        print(
            f"  {task:8s} format {s['format_rate']:.2f}  correct {s['correct_rate']:.2f}  reward {s['reward']:.2f}"
            f"  eos {s['eos_rate']:.2f}  tokens {s['mean_response_tokens']:.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
