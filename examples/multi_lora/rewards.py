"""Custom reward for the tiny GRPO example's "compare" task, loaded as
`reward: {path: "examples.multi_lora.rewards:compare_reward"}` (run from the repository root).

The task asks which of two numbers is larger; the model must end with a line `Answer: N`. This file is the
template for a custom reward: a plain function with the contract signature and a doctest.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

_ANSWER_LINE = re.compile(r"Answer:\s*(-?\d+(?:\.\d+)?)\.?")


def compare_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any], **kwargs: Any) -> float:
    """1.0 if the response's last non-empty line is `Answer: N` and N equals the label (as a number), else 0.0.

    >>> compare_reward("Which is larger, 17 or 42?", "42 is more than 17.\\nAnswer: 42", 42, {})
    1.0
    >>> compare_reward("Which is larger, 17 or 42?", "Answer: 17", "42", {})
    0.0
    >>> compare_reward("Which is larger, 17 or 42?", "Answer: 42\\nI hope that helps.", 42, {})
    0.0
    """
    lines = [line.strip() for line in response.strip().splitlines() if line.strip()]
    match = _ANSWER_LINE.fullmatch(lines[-1]) if lines else None
    if match is None:
        return 0.0
    try:
        expected = Decimal(str(label))
    except InvalidOperation as exc:  # a bad dataset row: raise so the executor counts it, not a silent 0
        raise ValueError(f"compare label {label!r} is not a number") from exc
    return 1.0 if Decimal(match[1]) == expected else 0.0
