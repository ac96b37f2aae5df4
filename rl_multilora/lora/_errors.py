"""The project's grammar for bad-input errors, kept here as a one-line copy.

`rl_multilora.lora` is a leaf package (it imports nothing else of the project), so it cannot use the project-wide
helper; this is the same rule: `<field>=<value!r> is not allowed; allowed: <what is allowed>`.
"""

from __future__ import annotations

from typing import Any


def bad_value(field: str, value: Any, allowed: str) -> str:
    """The message for `field` holding `value`, which is not allowed.

    >>> bad_value("rank", 32, "an integer from 1 to max_rank=16")
    'rank=32 is not allowed; allowed: an integer from 1 to max_rank=16'
    """
    return f"{field}={value!r} is not allowed; allowed: {allowed}"
