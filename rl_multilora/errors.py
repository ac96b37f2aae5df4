"""The one grammar of bad-input errors: `<field>=<value> is not allowed; allowed: <what is allowed>`.

Every message names the field (its dotted config path where there is one), the value as given (`repr`) and what
would be accepted, so a user can fix the input from the message alone. Config validation, the trainer, the data
source, the rewards registry and the engines all use it. `rl_multilora.lora` keeps its own one-line copy, because
that subpackage imports nothing else of the project.
"""

from __future__ import annotations

from typing import Any


def bad_value(field: str, value: Any, allowed: str) -> str:
    """The message for `field` holding `value`, which is not allowed.

    >>> bad_value("adapters.0.rank", 32, "an integer <= model.max_rank (16)")
    'adapters.0.rank=32 is not allowed; allowed: an integer <= model.max_rank (16)'
    """
    return f"{field}={value!r} is not allowed; allowed: {allowed}"
