"""Tasks for the SmolLM2-135M-Instruct preset: ones on which the real base has signal under sampling.

The tiny preset's tasks (`\\boxed{}`, `#### N`, `Answer: N`) score 0 in 240 samples on SmolLM2-135M-Instruct: it
rarely uses those formats, so GRPO has nothing to rank. These three were chosen by sampling the base and keeping
tasks whose full-credit rate lies between about 10 % and 60 % (measured rates: `PROVISIONED.json`, README):

- `equation`: "What is 7 + 5? Reply in the form 7 + 5 = N and write nothing else." -> label `"7 + 5 = 12"`.
  Short arithmetic with partial credit: 1.0 for the bare equation, 0.5 when the right result is the response's
  last number in any wording ("7 + 5 = 12 is correct."), 0.25 for the bare form with a wrong result. Addition and
  subtraction, operands 1-10, results >= 0. This 135M base is weak at arithmetic: full credit is the rarest of the
  three tasks at the start (about 5-10 %), the partial credit gives GRPO groups a gradient before it is common.
  (Asking "for example 2 + 2 = 4" instead gave 4 % full credit; this wording about 10 %.)
- `prefix`: "Tell me one fact about rain. Begin your reply with the word 'Indeed'." -> label `"Indeed"`.
  Format-following: 1.0 when the reply starts with that word (case as given), else 0.0.
- `list`: "Name 3 fruits. Write them on one line, separated by commas, with no other text." -> label `"3"`.
  An instruction constraint: 1.0 for exactly N short comma-separated items on one line and nothing else, 0.25 for
  a one-line comma list of the wrong length.

Rows are `{"question": ..., "answer": ...}` (prompt_key `question`, label_key `answer`, as GSM8K). Each reward is a
plain function with the contract signature of `rewards` (`prompt, response, label, metadata, **kwargs`), so a
config names it by import path: `reward: {path: "rl_multilora.presets.smollm2_tasks:equation_reward"}`.

Design choices:

- Every question of a task is one template over a small grid of values, enumerated and shuffled with a seeded rng;
  the test split is the first `n_test`, train the rest, so the splits are disjoint by construction and the held-out
  gain measures the learned behaviour on unseen values, not memorized answers.
- Tried and dropped: "Is 37 larger than 52? Answer with only Yes or No." (base 40 % full credit) collapsed under
  GRPO within 3 steps to one near-deterministic bare word per prompt, so its groups had no variance left (an
  all-equal group has zero advantage) and it stayed at chance; "the opposite of 'hot', one word only" and "write
  X in capital letters" had 0 % full credit in 40-64 samples (the model answers in sentences).
- Rewards read only the response text and the label (no prompt parsing), strip surrounding whitespace and a final
  period, and compare case-insensitively where the instruction does not fix case.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

TASKS: tuple[str, ...] = ("equation", "prefix", "list")

_CATEGORIES: tuple[str, ...] = (
    "fruits",
    "colors",
    "animals",
    "countries",
    "vegetables",
    "sports",
    "cities",
    "flowers",
    "birds",
    "musical instruments",
    "kitchen tools",
    "planets",
    "trees",
    "insects",
    "vehicles",
    "clothes",
    "drinks",
    "desserts",
    "tools",
    "metals",
)
_TOPICS: tuple[str, ...] = (
    "the moon",
    "cats",
    "rain",
    "the ocean",
    "music",
    "trees",
    "coffee",
    "winter",
    "bees",
    "the sun",
    "mountains",
    "bread",
    "horses",
    "volcanoes",
    "snow",
    "rivers",
    "owls",
    "chess",
    "deserts",
    "bicycles",
)
_PREFIXES: tuple[str, ...] = ("Sure", "Indeed", "Yes", "Well", "Actually", "Honestly", "Interestingly", "Notably")
_NUMBER = re.compile(r"-?\d+")
_SPACES = re.compile(r"\s+")


@dataclass(frozen=True)
class TaskExample:
    """One dataset row: the question as the user sends it and the label its reward reads."""

    question: str
    answer: str

    def row(self) -> dict[str, str]:
        return {"question": self.question, "answer": self.answer}


def _equation_examples() -> list[TaskExample]:
    out = []
    for a in range(1, 11):
        for b in range(1, 11):
            for op, result in (("+", a + b), ("-", a - b)):
                if result >= 0:
                    equation = f"{a} {op} {b}"
                    question = f"What is {equation}? Reply in the form {equation} = N and write nothing else."
                    out.append(TaskExample(question, f"{equation} = {result}"))
    return out


def _prefix_examples() -> list[TaskExample]:
    return [
        TaskExample(f"Tell me one fact about {topic}. Begin your reply with the word '{word}'.", word)
        for topic in _TOPICS
        for word in _PREFIXES
    ]


def _list_examples() -> list[TaskExample]:
    return [
        TaskExample(f"Name {n} {category}. Write them on one line, separated by commas, with no other text.", str(n))
        for n in range(2, 6)
        for category in _CATEGORIES
    ]


_GENERATORS = {"equation": _equation_examples, "prefix": _prefix_examples, "list": _list_examples}


def task_examples(task: str) -> list[TaskExample]:
    """Every question of `task`, in a fixed order (the splits shuffle them)."""
    if task not in _GENERATORS:
        raise ValueError(f"task={task!r} is not allowed; allowed: {', '.join(TASKS)}")
    return _GENERATORS[task]()


def make_splits(task: str, n_test: int, seed: int) -> dict[str, list[TaskExample]]:
    """Shuffle the task's questions with `seed`; the first `n_test` are the test split, the rest train."""
    examples = task_examples(task)
    random.Random(f"smollm2-{task}-{seed}").shuffle(examples)
    if not 0 < n_test < len(examples):
        raise ValueError(f"n_test={n_test!r} is not allowed for task {task!r}; allowed: 1 to {len(examples) - 1}")
    return {"train": examples[n_test:], "test": examples[:n_test]}


def _clean(text: str) -> str:
    """Whitespace collapsed, surrounding spaces and one final period or exclamation mark dropped."""
    text = _SPACES.sub(" ", text.strip())
    return text[:-1].rstrip() if text.endswith((".", "!")) else text


def equation_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any], **kwargs: Any) -> float:
    """1.0 for the bare equation; 0.5 when the right result is the response's last number; 0.25 for the asked form
    with a wrong result (`7 + 5 = 13` alone); else 0.0.

    >>> equation_reward("What is 7 + 5? ...", "7 + 5 = 12", "7 + 5 = 12", {})
    1.0
    >>> equation_reward("What is 7 + 5? ...", "7 + 5 = 12 is correct. The answer is 12.", "7 + 5 = 12", {})
    0.5
    >>> equation_reward("What is 7 + 5? ...", "7 + 5 = 13", "7 + 5 = 12", {})
    0.25
    >>> equation_reward("What is 7 + 5? ...", "The answer is 13.", "7 + 5 = 12", {})
    0.0
    """
    label = str(label)
    text = _clean(response)
    if text == label:
        return 1.0
    numbers = _NUMBER.findall(response)
    left, result = (part.strip() for part in label.rsplit("=", 1))
    if numbers and numbers[-1] == result:
        return 0.5
    return 0.25 if re.fullmatch(re.escape(left) + r" = -?\d+", text) else 0.0


def prefix_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any], **kwargs: Any) -> float:
    """1.0 when the reply's first word is the label (as written; punctuation may follow), else 0.0.

    >>> prefix_reward("... Begin your reply with the word 'Indeed'.", "Indeed, rain is water.", "Indeed", {})
    1.0
    >>> prefix_reward("... Begin your reply with the word 'Indeed'.", "Indeedly so.", "Indeed", {})
    0.0
    >>> prefix_reward("... Begin your reply with the word 'Indeed'.", "Rain is water. Indeed.", "Indeed", {})
    0.0
    """
    return 1.0 if re.match(re.escape(str(label)) + r"\b", response.strip()) else 0.0


def list_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any], **kwargs: Any) -> float:
    """1.0 for exactly N short comma-separated items on one line, 0.25 for a one-line list of another length.

    An item is one to three words without digits (a numbered list or a sentence is not an item).

    >>> list_reward("Name 3 fruits. ...", "Apple, Banana, Cherry", "3", {})
    1.0
    >>> list_reward("Name 3 fruits. ...", "Apple, Banana", "3", {})
    0.25
    >>> list_reward("Name 3 fruits. ...", "1. Apple\\n2. Banana\\n3. Cherry", "3", {})
    0.0
    """
    text = _clean(response)
    if not text or "\n" in response.strip():
        return 0.0
    items = [item.strip() for item in text.split(",")]
    if len(items) < 2 or any(not item or len(item.split()) > 3 or _NUMBER.search(item) for item in items):
        return 0.0
    return 1.0 if len(items) == int(label) else 0.25


REWARDS = {"equation": equation_reward, "prefix": prefix_reward, "list": list_reward}
REWARD_PATHS = {task: f"{__name__}:{fn.__name__}" for task, fn in REWARDS.items()}
