"""What every route of the engine server shares: the per-app state and the key it is stored under.

Its own module so that the SGLang routes (`http_server.py`) and the OpenAI routes (`openai_api.py`) both read it
without importing each other.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from rollout.engines.base import RolloutEngine


@dataclass
class ServerState:
    engine: RolloutEngine
    api_key: str | None
    model_name: str
    tokenizer: Any = None
    # Set while generation may run; cleared by /pause_generation.
    running: asyncio.Event = field(default_factory=asyncio.Event)
    # One event per /generate call in flight; set by an abort-mode pause.
    inflight: set[asyncio.Event] = field(default_factory=set)
    # Engine calls abandoned by an abort, kept referenced until they finish.
    orphans: set[asyncio.Task] = field(default_factory=set)


STATE_KEY = web.AppKey("rl_multilora_state", ServerState)


def _no_constants(name: str):
    raise ValueError(f"{name} is not a number JSON allows: send finite numbers")


def strict_json_loads(text: str):
    """`json.loads` without Python's NaN / Infinity extension (RFC 8259): a `temperature: NaN` is a request error,
    not a float that silently means greedy."""
    return json.loads(text, parse_constant=_no_constants)
