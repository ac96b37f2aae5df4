"""The `reasoning_gym` built-in reward: a reasoning-gym task's own `score_answer` on the response's answer.

It scores samples of a `dataset: {source: reasoning_gym, ...}` tenant (rollout/reasoning_gym_source.py), whose
metadata carries the task, its config, the generator's seed and size, and the entry. reasoning-gym is imported only
when a sample is scored (the optional `envs` extra).

Design choices:
- The answer is taken as reasoning-gym's own evaluation takes it: the last `<answer>...</answer>` of the response,
  stripped (`reasoning_gym.utils.extract_answer`); a response without one scores what `score_answer(None, entry)`
  gives (0 for every task). `extract: last_line` or `full` are for prompts that ask for the answer otherwise.
- The task object is rebuilt from the row's metadata (same task, config, seed and size), because some scorers read
  their own config; it is cached per process (a reward worker scores many samples of the same tenant).
- The score is the task's, unchanged: partial credit where the task gives it (e.g. 0.05 for a wrong but well-formed
  answer in some tasks), 1.0 for a right answer.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from rewards.registry import register

_EXTRACT_MODES = ("answer_tag", "last_line", "full")
# reasoning_gym.utils.extract_answer's pattern (tests/test_reasoning_gym.py checks that the two agree).
_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", flags=re.DOTALL)


def extract_answer(response: str, extract: str = "answer_tag") -> str | None:
    """The answer part of `response`, or None when it has none.

    >>> extract_answer("5 - 3 = 2, then 2 - 6 = -4. <answer> -4 </answer>")
    '-4'
    >>> extract_answer("the answer is\\n-4\\n", "last_line")
    '-4'
    >>> extract_answer("no tag here") is None
    True
    """
    if extract == "answer_tag":
        matches = _ANSWER_TAG.findall(response)
        return matches[-1].strip() if matches else None
    if extract == "last_line":
        lines = [line.strip() for line in response.splitlines() if line.strip()]
        return lines[-1] if lines else None
    return response.strip() or None


def _has_answer_tag(response: str) -> bool:
    return extract_answer(response) is not None


def _check_kwargs(kwargs: dict[str, Any]) -> None:
    extract = kwargs.get("extract", "answer_tag")
    if extract not in _EXTRACT_MODES:
        raise ValueError(f"reward.kwargs.extract={extract!r} is not allowed; allowed: {', '.join(_EXTRACT_MODES)}")


@lru_cache(maxsize=32)
def _task(task: str, config_json: str, seed: int, size: int):
    from rollout.reasoning_gym_source import create_task

    return create_task(task, json.loads(config_json), seed, size)


@register("reasoning_gym", format_check=_has_answer_tag, check_kwargs=_check_kwargs)
def reasoning_gym_reward(
    prompt: str, response: str, label: Any, metadata: dict[str, Any], *, extract: str = "answer_tag"
) -> float:
    """The row's reasoning-gym task scores the response's answer with its own `score_answer`.

    Needs a row of a `source: reasoning_gym` dataset: its metadata's "reasoning_gym" entry (task, config, seed,
    size, entry). A row without it raises (a bad row for this reward, counted for the tenant).
    """
    meta = metadata.get("reasoning_gym") if isinstance(metadata, dict) else None
    if not isinstance(meta, dict):
        raise ValueError("metadata['reasoning_gym'] is missing; allowed: rows of a dataset with source: reasoning_gym")
    task = _task(meta["task"], json.dumps(meta["config"], sort_keys=True), meta["seed"], meta["size"])
    return float(task.score_answer(extract_answer(response, extract), meta["entry"]))
