"""Custom reward functions used by the contract tests in tests/test_rewards.py, loaded by import path.

One per supported shape (sync, async, batched, kwargs, keyword-only, declared format) and one per failure the
executor must contain (raises, hangs in Python or in an event loop, kills its process, returns junk).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import rewards


def sync_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any], *, scale: float = 1.0) -> float:
    """`scale` if the stripped response equals str(label), else 0.0; "ERR" in the response raises.

    >>> sync_reward("p", " 4 ", 4, {}, scale=2.0)
    2.0
    """
    if "ERR" in response:
        raise ValueError(f"cannot score {response!r}")
    return scale if response.strip() == str(label) else 0.0


async def async_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """Like `sync_reward`, but awaits (as a reward calling a remote judge would); "SLOW" in the response never ends."""
    await asyncio.sleep(3600 if "SLOW" in response else 0.01)
    return 1.0 if response.strip() == str(label) else 0.0


@rewards.batched
def batched_reward(
    prompts: list[str],
    responses: list[str],
    labels: list[Any],
    metadatas: list[dict[str, Any]],
    *,
    offset: float = 0.0,
) -> list[float]:
    """One call for many samples: 1.0 per exact match, plus `offset`."""
    return [offset + float(r.strip() == str(y)) for r, y in zip(responses, labels, strict=True)]


@rewards.batched
def partly_bad_batched_reward(
    prompts: list[str], responses: list[str], labels: list[Any], metadatas: list[dict[str, Any]]
) -> list[Any]:
    """Like `batched_reward`, but NaN for a "NAN" response and None for a "NONE" one (a judge that gave up on them)."""
    bad = {"NAN": float("nan"), "NONE": None}
    return [bad[r] if r in bad else float(r.strip() == str(y)) for r, y in zip(responses, labels, strict=True)]


@rewards.batched
async def batch_size_reward(
    prompts: list[str], responses: list[str], labels: list[Any], metadatas: list[dict[str, Any]]
) -> list[float]:
    """An async batched reward that scores every sample with the size of the batch it arrived in."""
    await asyncio.sleep(0)
    return [float(len(responses))] * len(responses)


def kwargs_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any], *, weight: float) -> float:
    """Requires the `weight` kwarg; multiplies it with metadata["difficulty"] (default 1)."""
    return weight * metadata.get("difficulty", 1.0) * float(response.strip() == str(label))


def keyword_only_reward(*, prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """Takes the four data arguments by name only."""
    return float(len(response) + len(prompt))


def _ends_with_answer(response: str) -> bool:
    return response.rstrip().endswith("</answer>")


@rewards.with_format_check(_ends_with_answer)
def tagged_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """1.0 if `<answer>label</answer>` is in the response; declares its format so format_bonus can be used."""
    return float(f"<answer>{label}</answer>" in response)


def raising_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """Always raises, like a reward with a bug."""
    return 1.0 / 0


def hanging_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """Never returns (a busy loop: nothing short of killing the process stops it)."""
    while True:
        time.sleep(0.01)


def hang_on_marker_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """Hangs only on responses containing "HANG", like a regex that blows up on one input; 1.0 otherwise."""
    while "HANG" in response:
        time.sleep(0.01)
    return 1.0


async def blocking_async_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """An `async def` that blocks its event loop, so `asyncio.wait_for` cannot cancel it."""
    time.sleep(3600)
    return 1.0


async def sync_work_async_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """An `async def` that does 0.2 s of sync work (parsing, sympy) before it awaits: a chunk's samples run one after
    another."""
    time.sleep(0.2)
    await asyncio.sleep(0)
    return 1.0


def exiting_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """Kills its own process, like a segfault in a native extension."""
    os._exit(3)


def crash_on_marker_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """SIGKILLs its own process on responses containing "CRASH" (a native extension that segfaults on some inputs);
    otherwise 1.0 if the stripped response equals str(label), else 0.0."""
    if "CRASH" in response:
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0 if response.strip() == str(label) else 0.0


def string_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> str:
    """Returns a string, which is not a reward."""
    return "1.0"


def nan_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """Returns NaN, which would poison the advantages."""
    return float("nan")


def two_arg_reward(prompt: str, response: str) -> float:
    """Wrong signature: no label or metadata."""
    return 0.0


NOT_CALLABLE = 42


def wandering_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """Moves the worker's working directory and sets an environment variable, as code-running rewards do."""
    import os

    os.chdir("/")
    os.environ["RL_MULTILORA_TEST_WANDERED"] = "1"
    return 1.0


def relative_file_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """1 when `label_file.txt`, relative to the run's directory, holds the label and nothing moved the process."""
    import os

    with open("label_file.txt") as f:
        ok = f.read().strip() == str(label) and "RL_MULTILORA_TEST_WANDERED" not in os.environ
    return float(ok)


@rewards.batched
def numpy_batched_reward(prompts, responses, labels, metadatas):
    """A batched reward returning a numpy array, as vectorized reward code does."""
    import numpy as np

    return np.array([float(r == str(label)) for r, label in zip(responses, labels, strict=True)])


def yielding_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any]):
    yield 1.0  # a generator function: refused at validation (it passed dry-run and failed every sample at run time)


class YieldingScorer:
    def __call__(self, prompt, response, label, metadata):
        yield 1.0


yielding_scorer = YieldingScorer()


def trl_style(prompts, completions, **kwargs):  # TRL's GRPOTrainer signature: refused, naming @rewards.batched
    return [1.0 for _ in completions]
