"""reasoning-gym tasks as a tenant's dataset: `dataset: {source: reasoning_gym, task: ..., size: ..., seed: ...}`.

Design choices:
- The rows are generated, not downloaded: one `reasoning_gym.create_dataset(task, seed=seed, size=size + test_size,
  **config)`; entries `0 .. size-1` are the train split and the next `test_size` the test split. reasoning-gym
  derives entry `i` from `seed + i`, so one generator with disjoint index ranges keeps the splits apart, where a
  second seed for the test split would overlap (entry `i` of seed `s + 1` is entry `i + 1` of seed `s` for most
  tasks). A test question that also occurs in the train split (tiny tasks repeat) is dropped, so held-out stays
  held out; the test split may then be shorter than `test_size`.
- A row is `{"prompt": question, "label": answer, "metadata": {"reasoning_gym": {...}}}` where the metadata holds
  what `score_answer` needs: the task, its config, the generator's seed and size, the entry's index and the entry
  itself after a JSON round trip (rows travel to reward workers and into checkpoints as JSON-like data). The reward
  (`rewards.reasoning_gym`) scores that round-tripped entry with the task's own `score_answer`.
- reasoning-gym is optional (the `envs` extra) and imported only when such a dataset is loaded.
- `verifiers_env` is the other way in, for a verifiers tenant: verifiers' own `ReasoningGymEnv` (its rows, parser and
  rubric) plus verifiers' `few_shot` turns, which that class does not pass on (docs/guides/reasoning-gym.md).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from typing import Any

from rl_multilora.errors import bad_value

SPLITS = ("train", "test")
# The label of an entry without one answer (a task with many correct answers, e.g. graph_color): the row stays usable
# and the task's score_answer judges the response against the entry's metadata.
NO_ORACLE = "(no single answer: the task's score_answer decides)"
# The generator's own fields, set by the dataset spec's `seed` and `size`; the rest of a task's config is `config`.
_SPEC_FIELDS = ("seed", "size")


def task_names() -> list[str]:
    """The registered reasoning-gym task names (imports reasoning-gym)."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def create_task(task: str, config: Mapping[str, Any] | None, seed: int, size: int):
    """`reasoning_gym.create_dataset(task, seed=seed, size=size, **config)`, every failure a `ValueError` naming the
    dataset field at fault (the task, a config key, a config value) and what is allowed."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError as exc:
        raise ValueError(
            bad_value("dataset.source", "reasoning_gym", 'the reasoning-gym package: pip install -e ".[envs]"')
            + f" ({exc})"
        ) from exc
    if task not in DATASETS:
        close = difflib.get_close_matches(task, DATASETS, n=3)
        hint = f"did you mean {', '.join(map(repr, close))}? " if close else ""
        raise ValueError(
            bad_value("dataset.task", task, f"a reasoning-gym task ({hint}{len(DATASETS)} in reasoning_gym.factory)")
        )
    config = dict(config or {})
    allowed = [f.name for f in dataclasses.fields(DATASETS[task][1]) if f.name not in _SPEC_FIELDS]
    for key in config:
        if key in _SPEC_FIELDS:
            raise ValueError(bad_value(f"dataset.config.{key}", config[key], f"dataset.{key} instead of config.{key}"))
        if key not in allowed:
            raise ValueError(
                bad_value(f"dataset.config.{key}", config[key], f"a field of {task}: {', '.join(allowed)}")
            )
    try:
        return reasoning_gym.create_dataset(task, seed=seed, size=size, **config)
    except Exception as exc:  # noqa: BLE001 - the config's own validate() raises AssertionError, ValueError, ...
        raise ValueError(
            bad_value("dataset.config", config, f"values {task} accepts ({type(exc).__name__}: {exc})")
        ) from exc


def generate_rows(
    task: str, config: Mapping[str, Any] | None, seed: int, size: int, test_size: int, split: str
) -> list[dict[str, Any]]:
    """The rows of `split` ("train" or "test") of task `task`, generated offline; the same arguments give the same
    rows in every process."""
    if split not in SPLITS:
        raise ValueError(bad_value("dataset.split", split, "train or test (the generated splits)"))
    if split == "test" and test_size == 0:
        raise ValueError(bad_value("dataset.split", split, "train, or set dataset.test_size >= 1 for a test split"))
    generator = create_task(task, config, seed, size + test_size)
    if split == "train":
        return [_row(generator, task, config, seed, size + test_size, i, generator[i]) for i in range(size)]
    train_questions = {generator[i]["question"] for i in range(size)}
    rows = []
    for i in range(size, size + test_size):
        entry = generator[i]
        if entry["question"] not in train_questions:
            rows.append(_row(generator, task, config, seed, size + test_size, i, entry))
    return rows


def _row(
    generator, task: str, config: Mapping[str, Any] | None, seed: int, size: int, index: int, entry: dict
) -> dict:
    try:
        stored = json.loads(json.dumps(entry))
    except (TypeError, ValueError) as exc:
        raise ValueError(
            bad_value("dataset.task", task, f"a task whose entries are JSON data (entry {index}: {exc})")
        ) from exc
    # The reward scores the stored entry; a task whose scorer reads what JSON changes (arc_agi's tuple grids) would
    # score its own oracle answer wrong, so it is refused here rather than trained on a broken reward.
    if entry["answer"] is not None and generator.score_answer(entry["answer"], stored) != generator.score_answer(
        entry["answer"], entry
    ):
        raise ValueError(
            bad_value(
                "dataset.task", task, f"a task whose score_answer reads its entries as JSON data (entry {index})"
            )
        )
    entry = stored
    label = NO_ORACLE if entry["answer"] is None else entry["answer"]
    meta = {"task": task, "config": dict(config or {}), "seed": seed, "size": size, "index": index, "entry": entry}
    return {"prompt": entry["question"], "label": label, "metadata": {"reasoning_gym": meta}}


_FEW_SHOT_ROLES = ("user", "assistant")
_PARSERS = ("xml", "plain")


def verifiers_env(
    few_shot: list[Mapping[str, Any]] | None = None, held_out_only: bool = False, parser: str = "xml", **env_args
):
    """verifiers' own `ReasoningGymEnv` (its rows, `XMLParser(["answer"])` parser and rubric, unchanged), built with
    `env_args` (`gym`, `num_train_examples`, `num_eval_examples`, `system_prompt`, `seed`), with `few_shot` chat
    turns between its system prompt and every question.

    `few_shot` is verifiers' own `Environment(few_shot=...)` option (user / assistant messages, alternating, the last
    one an assistant's), which `ReasoningGymEnv` does not pass on; a small model that never writes `<answer>` tags
    when only told to (SmolLM2-135M: 0 of 32) writes them after two such turns. A verifiers tenant names it as
    `dataset: {source: verifiers, task: "rollout.reasoning_gym_source:verifiers_env", config: {gym: ..., few_shot:
    [...]}}`.

    `held_out_only: true` drops the eval rows whose question is also a train row's, as the `reasoning_gym` source does
    for its test split: `ReasoningGymEnv` splits by index, so a task with few distinct questions (one-digit products,
    small GCDs) repeats train questions in its eval rows, and a held-out score on them would partly measure recall.

    `parser: plain` hands `ReasoningGymEnv` verifiers' base `Parser` (the whole reply is the answer) instead of its
    default `XMLParser(["answer"])`, for a model that does not write tags: the task's scorer then gives its partial
    credit for a reply that contains the answer, as the `reasoning_gym` reward's `extract: full` does.
    """
    shots = _check_few_shot(few_shot)
    if not isinstance(held_out_only, bool):
        raise ValueError(bad_value("dataset.config.held_out_only", held_out_only, "true or false"))
    if parser not in _PARSERS:
        raise ValueError(bad_value("dataset.config.parser", parser, "xml (<answer> tags, the default) or plain"))
    try:
        from verifiers.envs.integrations.reasoninggym_env import ReasoningGymEnv
    except ImportError as exc:
        raise ValueError(
            bad_value("dataset.task", "verifiers_env", 'verifiers and reasoning-gym: pip install -e ".[verifiers]"')
            + f" ({exc})"
        ) from exc

    class FewShotReasoningGymEnv(ReasoningGymEnv):
        # verifiers formats each question as [system, *few_shot, user] in `_format_dataset_source`, reading
        # `self.few_shot`; the base constructor sets that to None before it builds the datasets, so the turns are
        # handed to the formatter directly.
        def _format_dataset_source(self, dataset):
            return self._format_dataset(dataset, self.system_prompt, shots, map_kwargs=self.map_kwargs)

    if parser == "plain":
        from verifiers import Parser

        env_args["parser"] = Parser()
    env = FewShotReasoningGymEnv(**env_args)
    env.few_shot = shots
    if held_out_only and env.eval_dataset is not None:
        seen = set(env.dataset["question"])
        env.eval_dataset = env.eval_dataset.filter(lambda row: row["question"] not in seen)
    return env


def _check_few_shot(few_shot) -> list[dict[str, str]]:
    if few_shot is None:
        return []
    allowed = "a list of {role, content} messages, roles user then assistant alternating, the last an assistant's"
    if not isinstance(few_shot, list) or len(few_shot) % 2:
        raise ValueError(bad_value("dataset.config.few_shot", few_shot, allowed))
    shots = []
    for i, message in enumerate(few_shot):
        role = _FEW_SHOT_ROLES[i % 2]
        if (
            not isinstance(message, Mapping)
            or set(message) != {"role", "content"}
            or message["role"] != role
            or not isinstance(message["content"], str)
        ):
            raise ValueError(bad_value(f"dataset.config.few_shot.{i}", message, f"{{role: {role}, content: text}}; "
                                       + allowed))  # fmt: skip
        shots.append({"role": role, "content": message["content"]})
    return shots
