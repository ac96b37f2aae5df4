"""The three synthetic tasks of the tiny preset, their dataset rows, training responses and answer checks.

Tasks (one per tenant in the tiny examples), each with its own answer format, the one its built-in reward expects:

- `gsm8k`: one- or two-step word problems with small numbers, in GSM8K's own columns: `question` and `answer`
  (`"<worked solution>\\n#### N"`). The question carries no format instruction, as in the real dataset.
- `arith`: `problem` = "Compute 17 + 25. Put the final answer in \\boxed{}.", `answer` = "42" (format `\\boxed{42}`).
- `compare`: `question` = "Which is larger: 37 or 52? Give the final answer on the last line as 'Answer: N'.",
  `answer` = "52" (format: last line `Answer: 52`).

Design choices:

- The arith and compare questions always carry the format instruction, so the same rows also make sense for a real
  instruction-following model (the Hub presets write these two tasks with these generators too).
- A training response for the tiny base is rendered either in the task's format or in an off-format one
  ("The answer is 42."), chosen independently of the problem: the pretrained base then samples the right format only
  part of the time, and GRPO has an easy, sample-reachable lever (pick the format) next to the harder one (get the
  number right).
- Every response, in any format, ends with the final answer as its last number, so correctness can be judged apart
  from format (`score_response`): `correct` = last number equals the label, `format_ok` = the strict pattern is
  there, `reward` = the number inside the strict pattern equals the label (on sampled base responses this agrees
  with `rewards` gsm8k (strict), math and the example compare reward on every response checked).
- Numbers are small and of fixed width per task (GSM8K-style operands 1-9, factors 2-5; arith: two-digit addition,
  operands 10-59; compare 10-99). With one token per digit, every operand of a template then sits at a fixed distance
  from where it is used, so a
  ~1M-parameter model learns to copy and combine them by relative position in a few CPU-minutes of pretraining
  (content-based "induction" copying takes far more steps than that budget), and learns it imperfectly.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

TASKS: tuple[str, ...] = ("gsm8k", "arith", "compare")

# Dataset column that holds the prompt text, per task (GSM8K and compare follow GSM8K, arith follows MATH).
PROMPT_FIELD: dict[str, str] = {"gsm8k": "question", "arith": "problem", "compare": "question"}

ARITH_INSTRUCTION = "Put the final answer in \\boxed{}."
COMPARE_INSTRUCTION = "Give the final answer on the last line as 'Answer: N'."

_NAMES: tuple[tuple[str, str], ...] = (
    ("Tom", "He"),
    ("Sara", "She"),
    ("Ben", "He"),
    ("Mia", "She"),
    ("Sam", "He"),
    ("Lily", "She"),
    ("Max", "He"),
    ("Emma", "She"),
    ("Leo", "He"),
    ("Anna", "She"),
    ("Jack", "He"),
    ("Zoe", "She"),
)
_ITEMS: tuple[str, ...] = (
    "apples",
    "pencils",
    "cookies",
    "marbles",
    "stickers",
    "books",
    "shells",
    "cards",
    "candies",
    "eggs",
    "flowers",
    "coins",
)
_THINGS: tuple[str, ...] = ("pen", "cup", "toy", "ball", "hat", "kite", "book", "plant")

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_GSM8K_FORMAT = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_BOXED_FORMAT = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_LINE = re.compile(r"^Answer:\s*(\S+)\s*$")


@dataclass(frozen=True)
class TaskExample:
    """One synthetic problem: its prompt text, bare final answer and worked-solution lines."""

    task: str
    question: str
    label: str
    steps: tuple[str, ...]

    def row(self) -> dict[str, str]:
        """The dataset row, in the task's real-dataset columns."""
        if self.task == "gsm8k":
            return {"question": self.question, "answer": "\n".join(self.steps) + f"\n#### {self.label}"}
        return {PROMPT_FIELD[self.task]: self.question, "answer": self.label}


@dataclass(frozen=True)
class ResponseScore:
    """How a response fares on its task: strict format present, final number right, and both (the reward)."""

    format_ok: bool
    correct: bool
    reward: float


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not a tiny-preset task; allowed: {', '.join(TASKS)}")


def _gsm8k(rng: random.Random) -> TaskExample:
    name, pron = rng.choice(_NAMES)
    item = rng.choice(_ITEMS)
    kind = rng.randrange(6)
    if kind == 0:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        q = f"{name} has {a} {item}. {pron} buys {b} more. How many {item} does {name} have now?"
        steps, ans = (f"{name} has {a} + {b} = {a + b} {item} now.",), a + b
    elif kind == 1:
        a = rng.randint(3, 9)
        b = rng.randint(1, a - 1)
        q = f"{name} had {a} {item}. {pron} gave {b} to a friend. How many {item} does {name} have left?"
        steps, ans = (f"{name} has {a} - {b} = {a - b} {item} left.",), a - b
    elif kind == 2:
        a, b = rng.randint(2, 5), rng.randint(2, 5)
        q = f"{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} buy?"
        steps, ans = (f"{name} buys {a} * {b} = {a * b} {item}.",), a * b
    elif kind == 3:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        c = rng.randint(1, 9)
        q = f"{name} has {a} {item}. {pron} finds {b} more and then loses {c}. How many {item} does {name} have now?"
        s = a + b
        steps, ans = (f"{name} has {a} + {b} = {s} {item}.", f"Then {s} - {c} = {s - c} {item} are left."), s - c
    elif kind == 4:
        a, b, c = rng.randint(2, 5), rng.randint(2, 5), rng.randint(1, 9)
        q = f"{name} has {a} boxes with {b} {item} each and {c} more {item}. How many {item} does {name} have?"
        p = a * b
        steps, ans = (f"The boxes hold {a} * {b} = {p} {item}.", f"In total {p} + {c} = {p + c} {item}."), p + c
    else:
        thing = rng.choice(_THINGS)
        a, b = rng.randint(2, 5), rng.randint(2, 5)
        q = f"A {thing} costs {a} dollars. {name} buys {b} of them. How many dollars does {name} spend?"
        steps, ans = (f"{name} spends {b} * {a} = {a * b} dollars.",), a * b
    return TaskExample("gsm8k", q, str(ans), steps)


def _arith(rng: random.Random) -> TaskExample:
    a, b = rng.randint(10, 59), rng.randint(10, 59)
    tens, ones = (a // 10 + b // 10) * 10, a % 10 + b % 10
    # The worked line adds tens and ones apart ("17 + 25 = 30 + 12 = 42"): each step reads two digits at fixed
    # offsets, which a tiny model learns in far fewer steps than the 4-digit function behind "17 + 25 = 42".
    q = f"Compute {a} + {b}. {ARITH_INSTRUCTION}"
    return TaskExample("arith", q, str(a + b), (f"{a} + {b} = {tens} + {ones} = {a + b}",))


def _compare(rng: random.Random) -> TaskExample:
    a, b = rng.sample(range(10, 100), 2)
    word = rng.choice(("larger", "smaller"))
    ans = max(a, b) if word == "larger" else min(a, b)
    q = f"Which is {word}: {a} or {b}? {COMPARE_INSTRUCTION}"
    return TaskExample("compare", q, str(ans), (f"Comparing {a} and {b}, the {word} one is {ans}.",))


_GENERATORS = {"gsm8k": _gsm8k, "arith": _arith, "compare": _compare}


def generate_example(task: str, rng: random.Random) -> TaskExample:
    """Draw one problem of `task` from `rng`."""
    _check_task(task)
    return _GENERATORS[task](rng)


def generate_split(task: str, n: int, rng: random.Random, exclude: set[str] | frozenset[str] = frozenset()):
    """`n` problems of `task` with distinct questions, none of them in `exclude` (e.g. the test questions)."""
    _check_task(task)
    seen: set[str] = set()
    out: list[TaskExample] = []
    # The arith space holds 2,500 distinct questions; 50 draws per needed row is far more than a
    # 2,000 + 200 split needs, and turns an impossible request into an error instead of a hang.
    for _ in range(50 * n + 100):
        if len(out) == n:
            break
        ex = _GENERATORS[task](rng)
        if ex.question in seen or ex.question in exclude:
            continue
        seen.add(ex.question)
        out.append(ex)
    if len(out) < n:
        raise ValueError(f"n={n} distinct {task} questions are more than the generator can produce (got {len(out)})")
    return out


def render_response(example: TaskExample, right_format: bool) -> str:
    """A training response for `example`, in the task's format or in its off-format ("The answer is 42.").

    Both end with the same worked lines and differ at one token (the format choice), so the pretrained base's
    format rate is one logit that GRPO can move, and the correctness of the number does not depend on it.
    """
    body = "\n".join(example.steps)
    label = example.label
    if example.task == "gsm8k":
        return f"{body}\n#### {label}" if right_format else f"{body}\nThe answer is {label}."
    if example.task == "arith":
        return (
            f"{body}, so the answer is \\boxed{{{label}}}." if right_format else f"{body}, so the answer is {label}."
        )
    return f"{body}\nAnswer: {label}" if right_format else f"{body}\nThe answer is {label}."


def _same_number(text: str | None, label: str) -> bool:
    if text is None:
        return False
    try:
        return float(text.replace(",", "").replace("$", "").strip()) == float(label)
    except ValueError:
        return False


def strict_answer(task: str, response: str) -> str | None:
    """The answer inside the task's strict format, or None when the format is missing.

    >>> strict_answer("arith", "3 + 4 = 7, so the answer is \\\\boxed{7}.")
    '7'
    >>> strict_answer("compare", "Comparing 3 and 9, the larger one is 9.") is None
    True
    """
    _check_task(task)
    if task == "gsm8k":
        found = _GSM8K_FORMAT.findall(response)
        return found[-1] if found else None
    if task == "arith":
        found = _BOXED_FORMAT.findall(response)
        return found[-1] if found else None
    lines = [line for line in response.strip().splitlines() if line.strip()]
    match = _ANSWER_LINE.match(lines[-1].strip()) if lines else None
    return match.group(1) if match else None


def score_response(task: str, response: str, label: str) -> ResponseScore:
    """Score `response` against the bare `label`: strict format, correct final number, and both.

    >>> score_response("gsm8k", "Tom has 2 + 3 = 5 apples now.\\nThe answer is 5.", "5")
    ResponseScore(format_ok=False, correct=True, reward=0.0)
    >>> score_response("compare", "Comparing 3 and 9, the larger one is 9.\\nAnswer: 9", "9")
    ResponseScore(format_ok=True, correct=True, reward=1.0)
    """
    strict = strict_answer(task, response)
    numbers = _NUMBER.findall(response)
    correct = _same_number(numbers[-1] if numbers else None, label)
    return ResponseScore(format_ok=strict is not None, correct=correct, reward=float(_same_number(strict, label)))
