"""Built-in rewards, registered by name: gsm8k, math, dapo, exact_match, f1, format (reasoning_gym: its own module).

Each is a plain function `fn(prompt, response, label, metadata, **kwargs) -> float` with a doctest, and declares
its answer format (`format_check`) for `RewardSpec.format_bonus`.

Design choices and deviations:
- Numbers are compared as exact fractions after normalization ("1,234", "$5", "72.0", "-3", " 0.50 "), never as
  strings and never as binary floats, so "0.1" equals 0.1 and "72.0" equals "72".
- A thousands separator must be a well-formed group (",\\d{3}"): "3,4" is the two numbers 3 and 4, not 34.
- `math` compares the last `\\boxed{}` with the label for mathematical equivalence with math_verify; a bare label
  is wrapped in `\\boxed{}` before parsing so intervals and tuples such as "(2, 3)" parse as they do in answers.
  math_verify's own timeout is signal-based and only works in a main thread, so it is turned off elsewhere
  (the executor's workers call rewards in their main thread; its kill-on-timeout covers every thread).
- `dapo` follows DAPO-Math-17k: the answer is on the last `Answer:` line, +1.0 if right and -1.0 otherwise. Like
  DAPO it compares normalized final-answer strings; unlike DAPO it also accepts numerically equal answers
  ("0.50" vs "1/2"), which DAPO's integer labels never exercise.
- A label that cannot be read (None, no number in a GSM8K solution, unparseable LaTeX) raises: that is a bad
  dataset row, counted as an error for the tenant, not silently scored 0.
"""

from __future__ import annotations

import re
import string
import threading
from collections import Counter
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache
from typing import Any

from rewards.registry import register

_MINUS = "-\N{MINUS SIGN}"
# sign (not after a word or ")", so "2-3" is 2 and 3) right before the digits or a "$", optional "$" on either side
# of it, then digits. Whitespace only after a "$": two optional `\s*` side by side split a run of N spaces N^2 ways
# at each of N places (a model that emits 1,000 spaces took 16 s to score), and "10 - 5" or a "- 18" bullet is not -5.
_NUMBER_RE = re.compile(
    rf"(?P<sign>(?<![\w)])[{_MINUS}])?(?:\$\s*)?(?P<sign2>[{_MINUS}])?"
    r"(?P<num>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"  # "1,2345" is not 1,234 then 5
)

_FRACTION_RE = re.compile(r"\d\s*/\s*\.?\d")


def _numbers(text: str) -> list[Fraction]:
    """All numbers in `text`, in order, as exact fractions.

    >>> _numbers("He paid $1,234.50, then -$3 and 72.0; 3,4 are two.")
    [Fraction(2469, 2), Fraction(-3, 1), Fraction(72, 1), Fraction(3, 1), Fraction(4, 1)]
    >>> _numbers("1,2345 and 1,234567")  # a bad thousands group: the digits as written, no 1,234 made up
    [Fraction(1, 1), Fraction(2345, 1), Fraction(1, 1), Fraction(234567, 1)]
    """
    out = []
    for m in _NUMBER_RE.finditer(text):
        value = Fraction(m["num"].replace(",", ""))
        out.append(-value if (m["sign"] is not None) != (m["sign2"] is not None) else value)
    return out


def _label_number(label: Any, reward: str) -> Fraction:
    """The number a label stands for: a number, a numeric string, or a GSM8K solution ending in `#### N`."""
    if isinstance(label, bool) or label is None:
        raise ValueError(f"{reward} label {label!r} is not a number or a solution ending in '#### N'")
    if isinstance(label, (int, Fraction)):
        return Fraction(label)
    if isinstance(label, (float, Decimal)):
        return Fraction(str(label))  # str() keeps the decimal the dataset wrote: 0.1 -> 1/10
    text = str(label)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    if _FRACTION_RE.search(text):  # "1/2" would read as 1, as a response's "#### 1/2" does (lm-eval's strict match)
        raise ValueError(
            f"{reward} label {label!r} is a fraction; allowed: one number (GSM8K's answers are numbers; the built-in "
            "'math' reward compares fractions)"
        )
    found = _numbers(text)
    if not found:
        raise ValueError(f"{reward} label {label!r} has no number (after '####' when present)")
    return found[0]


def _gsm8k_strict_answer(response: str) -> Fraction | None:
    if "####" not in response:
        return None
    line = response.rsplit("####", 1)[1].split("\n", 1)[0]
    found = _numbers(line)
    return found[0] if found else None


def _has_gsm8k_format(response: str) -> bool:
    return _gsm8k_strict_answer(response) is not None


def _check_gsm8k_kwargs(kwargs: dict[str, Any]) -> None:
    mode = kwargs.get("mode", "strict")
    if mode not in ("strict", "flexible"):
        raise ValueError(f"mode={mode!r} is not allowed; allowed: 'strict' (the number after '####') or 'flexible'")


@register("gsm8k", format_check=_has_gsm8k_format, check_kwargs=_check_gsm8k_kwargs)
def gsm8k_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any], *, mode: str = "strict") -> float:
    """1.0 if the response's final answer equals the label's as a number, else 0.0.

    `mode="strict"`: the number after the last `####`; `mode="flexible"`: the last number in the response.
    The label is a bare number or a full GSM8K solution (the number after its `####` is used).

    >>> solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\\nShe sold 48+24 = <<48+24=72>>72 clips.\\n#### 72"
    >>> gsm8k_reward("q", "48 + 24 = 72 clips.\\n#### 72", solution, {})
    1.0
    >>> gsm8k_reward("q", "The total is $1,234.00\\n#### $1,234", "1234", {})
    1.0
    >>> gsm8k_reward("q", "So she has 71 clips.", solution, {})
    0.0
    >>> gsm8k_reward("q", "So she has 72 clips.", solution, {}, mode="flexible")
    1.0
    """
    if mode == "flexible":
        found = _numbers(response)
        answer = found[-1] if found else None
    else:
        answer = _gsm8k_strict_answer(response)
    return 1.0 if answer is not None and answer == _label_number(label, "gsm8k") else 0.0


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`, `\\boxed 5`), nested braces kept; None if absent.

    >>> last_boxed("so \\\\boxed{1} or rather \\\\boxed{\\\\frac{1}{\\\\sqrt{2}}}.")
    '\\\\frac{1}{\\\\sqrt{2}}'
    >>> last_boxed("no box") is None
    True
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start + (6 if text.startswith("\\boxed", start) else 5) :]
    if rest.startswith(" ") and rest.strip()[:1] not in ("{", ""):
        return rest.split()[0].rstrip("$.")  # "\boxed 5": the one token after it
    rest = rest.lstrip()
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return rest[1:i]
    return None  # unbalanced: the response was cut off inside the box


def _math_verify_timeout() -> int | None:
    # math_verify's timeout uses signal.alarm, which Python allows only in the main thread.
    return 5 if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=4096)
def _parse_gold(text: str) -> list[Any]:
    from math_verify import parse  # sympy-heavy: imported on first use, preloaded by executor workers

    gold = parse(text if "\\boxed" in text else f"\\boxed{{{text}}}", parsing_timeout=_math_verify_timeout())
    if not gold:
        raise ValueError(f"math label {text!r} could not be parsed as a math expression by math_verify")
    return gold


def _has_boxed(response: str) -> bool:
    return last_boxed(response) is not None


@register("math", format_check=_has_boxed)
def math_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """1.0 if the last `\\boxed{}` in the response is mathematically equivalent to the label, else 0.0.

    The label may be bare ("0.5", "(2, 3)") or boxed. Equivalence is math_verify's (`parse` + `verify`).

    >>> math_reward("q", "Thus the answer is $\\\\boxed{\\\\dfrac{1}{2}}$.", "0.5", {})
    1.0
    >>> math_reward("q", "$x \\\\in \\\\boxed{\\\\left(2, 3\\\\right)}$", "(2,3)", {})
    1.0
    >>> math_reward("q", "\\\\boxed{\\\\frac{1}{3}}", "\\\\boxed{0.5}", {})
    0.0
    """
    if label is None or isinstance(label, bool):
        raise ValueError(f"math label {label!r} is not an answer")
    from math_verify import parse, verify

    boxed = last_boxed(response)
    if boxed is None:
        return 0.0
    timeout = _math_verify_timeout()
    answer = parse(f"\\boxed{{{boxed}}}", parsing_timeout=timeout)
    if not answer:
        return 0.0
    return 1.0 if verify(_parse_gold(str(label)), answer, timeout_seconds=timeout) else 0.0


_UNITS = (
    "dollars|dollar|cents|cent|degrees|degree|units|unit|meters|cm|km|inches|inch|feet|foot|hours|hour|"
    "minutes|minute|seconds|mph|ways|students|points|square|sq"
)
_ANSWER_RE = re.compile(r"answer\s*:\s*([^\n]*)", re.IGNORECASE)
_FRAC_RE = re.compile(r"\\frac\s*(\{[^{}]*\}|\w)\s*(\{[^{}]*\}|\w)")  # \frac's two arguments, braced or not


def _normalize_final_answer(text: str) -> str:
    """Normalize a final answer for string comparison (Minerva/DAPO style: drop $, \\text, units, spaces).

    >>> _normalize_final_answer(" $x = \\\\dfrac{3}{4}$ meters. ")
    '\\\\frac{3}{4}'
    >>> _normalize_final_answer("1,000")
    '1000'
    >>> [_normalize_final_answer(a) for a in ("\\\\$18.90", "\\\\frac12", "1{,}234", "\\\\sqrt2", "** 34**")]
    ['18.90', '\\\\frac{1}{2}', '1234', '\\\\sqrt{2}', '34']
    """
    boxed = last_boxed(text)
    text = (boxed if boxed is not None else text).split("=")[-1]
    text = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", text)
    for token in ("\\$", "$", "\\!", "\\,", "\\;", "\\ ", "\\left", "\\right", "{,}"):  # "\\$" first
        text = text.replace(token, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\N{MINUS SIGN}", "-")
    # DAPO's (Minerva's) `\frac12` -> `\frac{1}{2}` and `\sqrt2` -> `\sqrt{2}`: one-character arguments braced
    text = _FRAC_RE.sub(lambda m: f"\\frac{{{m[1].strip('{}')}}}{{{m[2].strip('{}')}}}", text)
    text = re.sub(r"\\sqrt\s*(\w)", r"\\sqrt{\1}", text)
    text = re.sub(r"\^\s*\{?\\circ\}?", "", text)
    text = re.sub(rf"(?<=[\d}}\s])(?:{_UNITS})\b\.?", "", text.strip())
    text = re.sub(r"\s+", "", text).rstrip(".").strip("*")  # "**Answer:** 34": markdown bold around the answer
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
        text = text.replace(",", "")
    return text


def _as_plain_number(text: str) -> Fraction | None:
    m = re.fullmatch(r"(-?)(\d+(?:\.\d+)?|\.\d+)(?:/(\d+))?|(-?)\\frac\{(\d+)\}\{(\d+)\}", text)
    if m is None:
        return None
    if m[5] is not None:
        value = Fraction(int(m[5]), int(m[6])) if int(m[6]) else None
        return -value if value is not None and m[4] else value
    if m[3] is not None and int(m[3]) == 0:
        return None
    value = Fraction(m[2]) / (int(m[3]) if m[3] is not None else 1)
    return -value if m[1] else value


def _last_answer_line(response: str) -> str | None:
    found = _ANSWER_RE.findall(response)
    return found[-1] if found else None


def _has_answer_last_line(response: str) -> bool:
    lines = [line for line in response.strip().splitlines() if line.strip()]
    return bool(lines) and re.match(r"\s*answer\s*:\s*\S", lines[-1], re.IGNORECASE) is not None


@register("dapo", format_check=_has_answer_last_line)
def dapo_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """+1.0 if the last `Answer: ...` equals the label after normalization (or as a number), else -1.0 (as DAPO).

    >>> dapo_reward("q", "Adding them up gives 34.\\nAnswer: 34", "34", {})
    1.0
    >>> dapo_reward("q", "Answer: $\\\\frac{1}{2}$", "0.5", {})
    1.0
    >>> dapo_reward("q", "I think it is 34.", "34", {})
    -1.0
    """
    if label is None or isinstance(label, bool):
        raise ValueError(f"dapo label {label!r} is not an answer")
    line = _last_answer_line(response)
    if line is None:
        return -1.0
    pred, gold = _normalize_final_answer(line), _normalize_final_answer(str(label))
    if pred and pred == gold:
        return 1.0
    pred_num, gold_num = _as_plain_number(pred), _as_plain_number(gold)
    return 1.0 if pred_num is not None and pred_num == gold_num else -1.0


def _squad_normalize(text: str) -> str:
    """SQuAD answer normalization: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in str(text).lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def _gold_answers(label: Any, reward: str) -> list[str]:
    answers = list(label) if isinstance(label, (list, tuple)) else [label]
    if not answers or any(a is None for a in answers):
        raise ValueError(f"{reward} label {label!r} must be an answer string or a non-empty list of them")
    return [str(a) for a in answers]


@register("exact_match")
def exact_match_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """1.0 if the response equals the label (or any label in a list) after SQuAD normalization, else 0.0.

    >>> exact_match_reward("q", "The Eiffel Tower!", ["eiffel tower", "la tour eiffel"], {})
    1.0
    >>> exact_match_reward("q", "the tower", "Eiffel Tower", {})
    0.0
    """
    pred = _squad_normalize(response)
    return 1.0 if any(pred == _squad_normalize(g) for g in _gold_answers(label, "exact_match")) else 0.0


def _token_f1(pred: str, gold: str) -> float:
    pred_tokens, gold_tokens = _squad_normalize(pred).split(), _squad_normalize(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


@register("f1")
def f1_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any]) -> float:
    """Token-level F1 between the normalized response and the label (the best over a list of labels).

    >>> f1_reward("q", "the Eiffel Tower, Paris", "Eiffel Tower", {})
    0.8
    >>> f1_reward("q", "London", ["Paris", "Eiffel Tower"], {})
    0.0
    """
    return max(_token_f1(response, g) for g in _gold_answers(label, "f1"))


def _check_format_kwargs(kwargs: dict[str, Any]) -> None:
    pattern = kwargs.get("pattern")
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"pattern={pattern!r} is not allowed; allowed: a non-empty regular expression string")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"pattern: {pattern!r} is not a valid regular expression ({exc})") from exc


@register("format", check_kwargs=_check_format_kwargs)
def format_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any], *, pattern: str) -> float:
    """1.0 if the regex `pattern` matches somewhere in the response (`re.search`, DOTALL), else 0.0.

    Anchor with `\\A` / `\\Z` to require the whole response to match. The label is ignored.

    >>> format_reward("q", "<think>hmm</think>\\n<answer>4</answer>", None, {},
    ...               pattern=r"\\A<think>.*</think>\\s*<answer>.*</answer>\\Z")
    1.0
    >>> format_reward("q", "4", None, {}, pattern=r"<answer>.*</answer>")
    0.0
    """
    return 1.0 if re.search(pattern, response, re.DOTALL) else 0.0
