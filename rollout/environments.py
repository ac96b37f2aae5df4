"""Per-tenant environments: multi-turn episodes (tool calls, observations, a simulated user) on the shared engine.

The interface is gymnasium's `reset` / `step` over text, as SkyRL-gym's `BaseTextEnv` and verl's tool agents
write it: the environment sees the model's turn as text and answers with chat messages (a tool result, an
observation, the next user turn), a reward and whether the episode is done. Why this one: it is the shape most RL
users already wrote an environment in (gymnasium, SkyRL-gym, verl, `verifiers`' `env_response`), it needs no
tokens or renderer on the user's side, and the token bookkeeping that must be exact (which ids the engine saw and
produced, which carry loss) stays in this module, where it is tested once for every environment.

```python
from rollout.environments import Environment, EnvStep

class Countdown(Environment):
    def __init__(self, turns: int = 3):
        self.left = turns

    def reset(self, task):                 # task.prompt (text), task.label, task.metadata (the dataset row's)
        self.target = int(task.label)

    def step(self, action: str) -> EnvStep: # the model's turn as text; may be `async def`
        self.left -= 1
        if action.strip() == str(self.target):
            return EnvStep(reward=1.0, done=True)
        return EnvStep(observation=[{"role": "user", "content": "try again"}], done=self.left == 0)
```

Design choices:
- One instance per episode (built with the tenant's `environment.kwargs`), so episodes share no state; `close()`
  is called at the end whatever happened.
- Token exactness: an episode's response is the engine's output ids of each model turn, as produced, followed by
  the ids of each environment turn (the chat template's rendering of its messages, computed as the text the
  template adds after an assistant turn, so the model's own tokens are never re-tokenized). Environment ids carry
  `loss_mask` 0 and log-prob 0.0; every model id carries the engine's log-prob.
- The episode's reward is the sum of its steps' rewards (`metadata["turn_rewards"]` keeps each).
- Faults stay with the episode: `reset`/`step` that raise, exceed `turn_timeout_s`, return something that is not an
  `EnvStep` or a non-finite reward, or an episode past `episode_timeout_s`, mark that sample FAILED with the reason
  (the trainer leaves it out); reaching `max_turns` or `max_tokens` ends it TRUNCATED with the reward so far.
  A synchronous `step` runs in a worker thread; one that never returns is abandoned there after its timeout
  (Python cannot kill a thread), so environments that can hang for ever should be `async` or bound their own work.
- Tool calls: `parse_tool_calls` reads the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of
  the Hermes / Qwen chat templates; `ToolEnv` dispatches them to methods and answers with `tool` messages. A
  tenant that uses tools usually sets `sampling.stop: ["</tool_call>"]`, so a model turn ends at its call.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]


@dataclass(frozen=True)
class Task:
    """What an episode starts from: the dataset row's prompt text (as the tenant's dataset renders it), label and
    metadata."""

    prompt: str
    label: Any = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class EnvStep:
    """One environment turn: messages for the model to read next (None when done), a reward, done."""

    observation: list[Message] | None = None
    reward: float = 0.0
    done: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


class Environment:
    """Subclass and override `step` (and `reset`, `close` when needed). Either may be `async def`."""

    def reset(self, task: Task) -> None:
        """A new episode on `task`."""

    def step(self, action: str) -> EnvStep:
        """The model's turn `action` (decoded, special tokens dropped) -> the environment's answer."""
        raise NotImplementedError

    def close(self) -> None:
        """The episode ended (done, truncated or failed)."""


class EnvironmentLoadError(ValueError):
    """An environment import path that does not load."""


def load_environment(path: str, kwargs: Mapping[str, Any] | None = None) -> Environment:
    """Build `module:Class` with `kwargs`; the class must subclass `Environment`."""
    return build_environment(environment_class(path), kwargs, path)


def build_environment(cls: type[Environment], kwargs: Mapping[str, Any] | None, path: str) -> Environment:
    """An instance of `cls` (`path` names it, for the message) with its own deep copy of `kwargs`."""
    try:
        return cls(**copy.deepcopy(dict(kwargs or {})))  # an episode changing its kwargs changes no other's
    except TypeError as e:
        raise EnvironmentLoadError(f"environment.kwargs do not fit {path}: {e}") from None


def is_async(cls: type) -> bool:
    """Whether `cls` plays on the rollout's event loop (an `async def` reset or step): its constructor runs there too
    (it may bind loop objects); a plain class is built in a worker thread, under the turn timeout."""
    return any(inspect.iscoroutinefunction(getattr(cls, name, None)) for name in ("reset", "step"))


def environment_class(path: str) -> type[Environment]:
    """The `Environment` subclass `module:Class` names, or EnvironmentLoadError saying what is wrong."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise EnvironmentLoadError(f"environment.path={path!r} is not allowed; allowed: 'module:Class'")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # SystemExit too: a module that exits at import must not end (or pass) the run
        hint = ""
        if isinstance(e, SystemExit):
            hint = " (it exits at import, e.g. argparse at top level: move that under `if __name__ == '__main__':`)"
        raise EnvironmentLoadError(f"environment.path={path!r} does not load: {type(e).__name__}: {e}{hint}") from None
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise EnvironmentLoadError(
            f"environment.path={path!r} is not allowed; allowed: a subclass of rollout.environments.Environment"
        )
    if cls.step is Environment.step:  # every episode would fail with an empty NotImplementedError
        raise EnvironmentLoadError(
            f"environment.path={path!r} is not allowed: {cls.__name__} does not define step(action) -> EnvStep; "
            "allowed: a subclass of rollout.environments.Environment that overrides step"
        )
    return cls


def short_repr(value: Any, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters for a message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_step(result: Any) -> EnvStep:
    """`result` as an EnvStep, or ValueError saying what is wrong with it (garbage from an environment)."""
    if not isinstance(result, EnvStep):
        raise ValueError(f"step returned {type(result).__name__}, not an EnvStep")
    reward = result.reward  # what a reward function may return: anything float() takes but text (numpy scalars, bool)
    if isinstance(reward, str | bytes) or not hasattr(reward, "__float__") or not math.isfinite(float(reward)):
        raise ValueError(f"step returned reward={reward!r}; allowed: a finite number")
    result.reward = float(reward)
    done = result.done  # "False" is truthy: it ended every episode after one turn, silently
    if not (isinstance(done, bool) or (type(done).__module__ == "numpy" and type(done).__name__ in ("bool", "bool_"))):
        raise ValueError(f"step returned done={done!r} ({type(done).__name__}); allowed: True or False")
    result.done = bool(done)
    if not result.done:
        obs = result.observation
        if obs is None or (isinstance(obs, list) and not obs):
            raise ValueError("step returned done=False without observation messages")
        if not isinstance(obs, list):
            raise ValueError(
                f"step returned observation={short_repr(obs)} ({type(obs).__name__}); allowed: a list of "
                "{'role': str, 'content': str} messages, e.g. [{'role': 'user', 'content': 'try again'}]"
            )
        for m in obs:
            if (
                not isinstance(m, Mapping)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise ValueError(f"observation message {m!r} is not {{'role': str, 'content': str}}")
    return result


# ------------------------------------------------------------------------------------------------ tool calls

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def parse_tool_calls(text: str) -> list[ToolCall | str]:
    """The `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of a model turn (Hermes / Qwen chat
    templates; a block cut off by a `</tool_call>` stop string counts), each a ToolCall or the reason it is not one.

    >>> parse_tool_calls('let me add <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    [ToolCall(name='add', arguments={'a': 1, 'b': 2})]
    >>> parse_tool_calls("<tool_call>not json</tool_call>")
    ['tool call is not JSON: not json']
    """
    out: list[ToolCall | str] = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except ValueError:
            out.append(f"tool call is not JSON: {body[:80]}")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            out.append(f"tool call has no name: {body[:80]}")
            continue
        args = call.get("arguments", {})
        out.append(
            ToolCall(call["name"], args) if isinstance(args, dict) else f"arguments of {call['name']} not an object"
        )
    return out


class ToolEnv(Environment):
    """An environment whose model turns call tools: each `<tool_call>` is dispatched to the method of that name in
    `tools()` and answered with a `tool` message; a turn without a call is the final answer, scored by `answer`.

    Override `tools()` (name -> callable taking the call's arguments as keywords) and `answer(text) -> reward`.
    A call to an unknown tool or with bad arguments is answered with an error message (the model may retry).
    """

    def reset(self, task: Task) -> None:
        self.task = task

    def tools(self) -> dict[str, Callable[..., Any]]:
        return {}

    def answer(self, text: str) -> float:
        raise NotImplementedError

    def step(self, action: str) -> EnvStep:
        calls = parse_tool_calls(action)
        if not calls:
            return EnvStep(reward=float(self.answer(action)), done=True)
        tools = self.tools()
        results = []
        for call in calls:
            if isinstance(call, str):
                results.append(f"error: {call}")
            elif call.name not in tools:
                results.append(f"error: unknown tool {call.name!r} (tools: {', '.join(sorted(tools))})")
            else:
                try:
                    results.append(str(tools[call.name](**call.arguments)))
                except Exception as e:  # noqa: BLE001 - a bad call is the model's mistake, answered as such
                    results.append(f"error: {type(e).__name__}: {e}")
        return EnvStep(observation=[{"role": "tool", "content": r} for r in results])
