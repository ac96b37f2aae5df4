"""What every route of the engine server shares: the per-app state and the key it is stored under.

Its own module so that the SGLang routes (`http_server.py`) and the OpenAI routes (`openai_api.py`) both read it
without importing each other.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from rollout.engines.base import RolloutEngine

# The general request-body limit and the one for adapter tensor pushes (`engine-serve --max-body-mb` and
# `--max-adapter-body-mb`): a prompt has no business near the size of a weight sync's safetensors payload.
DEFAULT_MAX_BODY_BYTES = 32 * 1024**2
DEFAULT_MAX_ADAPTER_BODY_BYTES = 1024**3


@dataclass
class ServerState:
    engine: RolloutEngine
    api_key: str | None
    model_name: str
    tokenizer: Any = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_adapter_body_bytes: int = DEFAULT_MAX_ADAPTER_BODY_BYTES
    adapter_root: Path | None = None  # resolved; /load_lora_adapter reads only folders inside it when set
    closing: bool = False  # the server is shutting down: waiting and new requests answer 503
    # Set while generation may run; cleared by /pause_generation.
    running: asyncio.Event = field(default_factory=asyncio.Event)
    # One event per /generate call in flight; set by an abort-mode pause.
    inflight: set[asyncio.Event] = field(default_factory=set)
    # Engine calls abandoned by an abort, kept referenced until they finish.
    orphans: set[asyncio.Task] = field(default_factory=set)

    @property
    def context_length(self) -> int | None:
        """The served model's max positions (prompt + output), when its engine says (`EmbeddedEngine` does)."""
        value = getattr(self.engine, "context_length", None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None


STATE_KEY = web.AppKey("rl_multilora_state", ServerState)
SHUTDOWN_MESSAGE = "the server is shutting down; send the request to another server or after its restart"


def context_error(input_len: int, max_new_tokens: int | None, context_len: int | None) -> str | None:
    """SGLang's request-length checks (its tokenizer manager's), with its messages; None when the request fits.

    The prompt alone must be shorter than the context, and with an explicit max_new_tokens the two together too;
    without one, the context caps the output.
    """
    if context_len is None:
        return None
    if input_len >= context_len:
        return f"The input ({input_len} tokens) is longer than the model's context length ({context_len} tokens)."
    if max_new_tokens is not None and max_new_tokens + input_len >= context_len:
        return (
            f"Requested token count exceeds the model's maximum context length of {context_len} tokens. You requested "
            f"a total of {max_new_tokens + input_len} tokens: {input_len} tokens from the input messages and "
            f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input messages or "
            "the completion to fit within the limit."
        )
    return None


class NonFiniteNumberError(ValueError):
    """A NaN / Infinity (or a literal that overflows a double, e.g. 1e999) in a request body; `field` is where."""

    def __init__(self, field: str, spelling: str) -> None:
        why = "is not a number JSON allows" if spelling.lstrip("-") in ("NaN", "Infinity") else "overflows a double"
        super().__init__(
            f"{field}={spelling} is not allowed; allowed: a finite number ({spelling} {why}: send finite numbers)"
        )
        self.field = field


class _NonFinite(float):
    """A parsed non-finite literal that remembers how the body spelled it, so the error can quote it."""

    spelling = ""


def _find_non_finite(node: Any, path: str) -> tuple[str, _NonFinite] | None:
    """(path like `a.b[2].c`, value) of the first `_NonFinite` under `node`, or None."""
    if isinstance(node, _NonFinite):
        return path or "body", node
    if isinstance(node, dict):
        for key, value in node.items():
            if (found := _find_non_finite(value, f"{path}.{key}" if path else str(key))) is not None:
                return found
    elif isinstance(node, list):
        for i, value in enumerate(node):
            if (found := _find_non_finite(value, f"{path}[{i}]")) is not None:
                return found
    return None


_YIELDING_PARSE_BYTES = 1024**2  # smaller bodies parse in under ~20 ms: the C scanner's GIL hold does not matter


def _yielding_int(spelling: str) -> int:
    return int(spelling)


def strict_json_loads(text: str | bytes) -> Any:
    """`json.loads` that refuses non-finite numbers, naming the field: Python's NaN / Infinity extension (not
    RFC 8259) and literals such as 1e999 that parse to inf. A `temperature: NaN` is a request error, not a float
    that silently means greedy. Raises `NonFiniteNumberError` (a ValueError) or json's own ValueErrors."""
    seen: list[_NonFinite] = []

    def non_finite(spelling: str) -> _NonFinite:
        value = _NonFinite(spelling if spelling.lstrip("-") in ("NaN", "Infinity") else float(spelling))
        value.spelling = spelling
        seen.append(value)
        return value

    def parse_float(spelling: str) -> float:
        value = float(spelling)
        return value if math.isfinite(value) else non_finite(spelling)

    # json's C scanner holds the GIL for a whole parse (0.7 s for 16M prompt ids, the event loop frozen meanwhile,
    # even with the parse in a thread); a Python hook per integer lets the loop in between, at ~2.5x the parse time,
    # so large bodies only. (Floats already go through parse_float.)
    parse_int = _yielding_int if len(text) > _YIELDING_PARSE_BYTES else None
    try:
        body = json.loads(text, parse_constant=non_finite, parse_float=parse_float, parse_int=parse_int)
    except RecursionError:  # arrays nested ~100,000 deep: a client's malformed body, not a server error (a 500)
        raise ValueError("request body nests too deeply; allowed: JSON nested at most a few thousand levels") from None
    if seen:  # only then walk the body, to say where
        field, value = _find_non_finite(body, "") or ("body", seen[0])
        raise NonFiniteNumberError(field, value.spelling)
    return body


async def read_json(request: web.Request) -> Any:
    """The request's JSON body, parsed in a worker thread: a body of tens of MB takes a second to parse, which on the
    event loop would stall every other request (`/health` included). Raises ValueError for a body that is not JSON
    (`NonFiniteNumberError` for NaN / Infinity); aiohttp's 413 when it is over the route's limit."""
    raw = await request.read()
    return await asyncio.to_thread(strict_json_loads, raw)
