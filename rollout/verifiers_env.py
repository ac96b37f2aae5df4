"""`verifiers` environments as tenants: their rows, parser, multi-turn logic, tools and rubric, our engine's tokens.

A tenant names a verifiers environment twice over, in two short sections:

```yaml
dataset: {source: verifiers, task: my-env, config: {difficulty: easy}, split: train}   # the env's own rows
environment: {path: rollout.verifiers_env:VerifiersEnvironment, max_turns: 8}           # its episodes
```

`task` is an installed environment package's id (what `vf.load_environment(id, **config)` imports: `my-env` ->
module `my_env`, its `load_environment(**config)`), or an import path `module:attr` to a `vf.Environment` instance,
or to a class or function that builds one from `config`.

Design choices:
- The classic verifiers stack (`import verifiers as vf`: `vf.Environment`, `Parser`, `Rubric`, `MultiTurnEnv`,
  `ToolEnv`, `load_environment`) is what environment packages are written against; verifiers 0.3.1 is the newest
  release that ships it (0.4.0 keeps only the `verifiers.v1` taskset/harness stack, whose model calls leave through
  a harness program and an HTTP interception server; see docs/guides/environments.md).
- The environment drives its own rollout (`env.run_rollout`: its `setup_state`, stop conditions, `env_response`,
  tool calls, then its rubric's `score_rollout`), unchanged, in the episode's event loop. Its model is a
  `vf.Client` whose `get_response` hands each model turn to this project's episode loop
  (rollout/generate_state.py): the turn is generated on the shared engine with the tenant's adapter, in the same
  batches as every other tenant's requests, and its decoded text comes back to the environment as the response.
  So the trained ids and log-probs are the engine's own; the environment's turns (tool results, feedback) are the
  chat template's rendering of the messages it appended, loss-masked, as for every environment.
- Token exactness needs a linear conversation: the first model call must ask for exactly the row's prompt (which
  the data source rendered with the environment's tools), and every later call for the previous call's messages,
  the assistant message this module returned, then new environment messages. An environment that rewrites history
  fails its episode with the reason, rather than training on ids the model never saw.
- Tool calls are read from the model's text the way the Hermes / Qwen chat templates write them
  (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as `rollout.environments.parse_tool_calls`), and
  only when the environment offers tools; the blocks are removed from the message content, as OpenAI-compatible
  servers do.
- The reward is the environment's: the whole episode's `state["reward"]` from its rubric, given on the last step.
  A rollout whose state carries an error (a tool that raised one of its `stop_errors`, a failing `setup_state`)
  fails the episode with that error. Rubrics with group-level reward functions are refused at load (episodes are
  scored one by one here).
- One environment object per process and (id, config), built once (rows and episodes share it): verifiers
  environments keep per-rollout data in the rollout's state, not on the object. Its constructor would install
  process-wide SIGINT / SIGTERM handlers (and fails off the main thread); those calls are made no-ops in verifiers'
  module, so a tenant never changes how the trainer process handles signals.
- The tenant's sampling settings apply to every model turn; the environment's own `sampling_args` are not used.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import json
import logging
import math
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from rl_multilora.errors import bad_value
from rollout.environments import Environment, EnvStep, Task, ToolCall, parse_tool_calls

SPLITS = ("train", "test")
ENVIRONMENT_PATH = "rollout.verifiers_env:VerifiersEnvironment"  # a tenant's `environment.path` for these rows
# The label of a row whose environment has no reference answer (games, open-ended tasks): its rubric decides.
NO_ANSWER = "(no reference answer: the environment's rubric decides)"
_TOOL_CALL_BLOCK = r"<tool_call>.*?(?:</tool_call>|$)"


class _NoSignalHandlers:
    """What verifiers' environment module sees as `signal`: installing a handler is a no-op (see module doc)."""

    def __init__(self, real) -> None:
        self._real = real

    def signal(self, signalnum, handler):
        return self._real.getsignal(signalnum)

    def __getattr__(self, name: str):
        return getattr(self._real, name)


# verifiers' Rubric catches a reward function that raises (or returns what float() refuses, None say), logs "Error
# calling reward function <name>: <error>" on its own logger and scores it 0: the episode trained as a plain 0 and no
# metric counted it. Each rubric's logger is wrapped (`_RubricLogger`, whatever logging is configured to show): its
# errors are collected for the episode whose rollout reported them (a context var, which the rollout's task inherits
# from its episode), and the episode fails with the first.
_RUBRIC_ERRORS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("rubric_errors", default=None)


class _RubricLogger:
    """A rubric's logger that also hands its "Error calling ... reward function" messages to the episode."""

    def __init__(self, inner: logging.Logger) -> None:
        self._inner = inner

    def error(self, msg, *args, **kwargs) -> None:
        errors = _RUBRIC_ERRORS.get()
        text = str(msg) % args if args else str(msg)
        if errors is not None and text.startswith(("Error calling reward function", "Error calling group reward")):
            errors.append(text)
        self._inner.error(msg, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def _watch_rubrics(rubric) -> None:
    """Wrap the logger of `rubric` and of every rubric it groups (`RubricGroup.rubrics`), once."""
    if rubric is None:
        return
    if isinstance(getattr(rubric, "logger", None), logging.Logger):
        rubric.logger = _RubricLogger(rubric.logger)
    for inner in getattr(rubric, "rubrics", None) or []:
        _watch_rubrics(inner)


def _import_verifiers():
    try:
        import verifiers as vf
        import verifiers.envs.environment as environment_module
    except ImportError as exc:
        raise ValueError(
            bad_value(
                "dataset.source", "verifiers", 'the verifiers package: pip install -e ".[verifiers]" (Python >= 3.11)'
            )
            + f" ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(environment_module.signal, _NoSignalHandlers):
        environment_module.signal = _NoSignalHandlers(environment_module.signal)
    return vf


@lru_cache(maxsize=16)
def _load(env: str, env_args_json: str):
    vf = _import_verifiers()
    env_args = json.loads(env_args_json)
    if ":" in env:
        module_name, _, attr = env.partition(":")
        try:
            target = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(
                bad_value("dataset.task", env, f"an importable 'module:attr' ({type(exc).__name__}: {exc})")
            ) from exc
        if isinstance(target, vf.Environment):
            if env_args:
                raise ValueError(
                    bad_value("dataset.config", env_args, f"empty: {env} is an Environment instance, not a builder")
                )
            loaded = target
        elif callable(target):
            try:
                loaded = target(**env_args)
            except TypeError as exc:
                raise ValueError(bad_value("dataset.config", env_args, f"arguments {env} takes ({exc})")) from exc
        else:
            raise ValueError(bad_value("dataset.task", env, "a vf.Environment, or a class or function building one"))
    else:
        try:
            loaded = vf.load_environment(env, **env_args)
        except ValueError as exc:  # verifiers' "Could not import ..." for an id whose package is not installed
            raise ValueError(
                bad_value("dataset.task", env, "an installed verifiers environment package's id, or 'module:attr'")
                + f" ({exc})"
            ) from exc
    if not isinstance(loaded, vf.Environment):
        raise ValueError(bad_value("dataset.task", env, f"something that builds a vf.Environment, not {type(loaded)}"))
    if loaded.requires_group_rollouts:
        raise ValueError(
            bad_value("dataset.task", env, "an environment whose rubric scores rollouts one by one (no group rewards)")
        )
    _watch_rubrics(getattr(loaded, "rubric", None))
    return loaded


def load_verifiers_env(env: str, env_args: Mapping[str, Any] | None = None):
    """The verifiers environment `env` (an installed package's id or `module:attr`) built with `env_args`, once per
    process; every failure is a ValueError naming the dataset field at fault."""
    if not isinstance(env, str) or not env:
        raise ValueError(bad_value("dataset.task", env, "a verifiers environment id or 'module:attr'"))
    try:
        key = json.dumps(dict(env_args or {}), sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(bad_value("dataset.config", env_args, f"JSON-like arguments ({exc})")) from exc
    return _load(env, key)


def _wire_tools(tool_defs) -> list[dict[str, Any]] | None:
    """vf.Tool definitions in the chat templates' (OpenAI function) format."""
    tools = [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in tool_defs or []
    ]
    return tools or None


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def generate_rows(env: str, env_args: Mapping[str, Any] | None, split: str, size: int | None) -> list[dict[str, Any]]:
    """The environment's own rows of `split` (train: `get_dataset`, test: `get_eval_dataset`), first `size` of
    them (all when None): `{"prompt": messages, "label", "tools", "metadata": {"verifiers": {...}}}`."""
    if split not in SPLITS:
        raise ValueError(bad_value("dataset.split", split, "train or test (the environment's dataset, eval_dataset)"))
    vf_env = load_verifiers_env(env, env_args)
    if split == "test" and vf_env.build_eval_dataset() is None:
        # verifiers would fall back to the train rows: held-out would not be held out
        raise ValueError(bad_value("dataset.split", split, f"train: environment {env} has no eval_dataset"))
    if split == "train" and vf_env.build_dataset() is None:
        raise ValueError(bad_value("dataset.split", split, f"test: environment {env} has no train dataset"))
    n = -1 if size is None else size
    dataset = vf_env.get_dataset(n=n) if split == "train" else vf_env.get_eval_dataset(n=n)
    from verifiers.utils.message_utils import normalize_messages

    rows = []
    for raw in dataset:
        info = raw.get("info") or {}
        if isinstance(info, str):
            info = json.loads(info)
        tool_defs = info.get("tool_defs") if isinstance(info, Mapping) and "tool_defs" in info else vf_env.tool_defs
        prompt = [_dump(m) for m in normalize_messages(raw["prompt"], field_name="prompt")]
        answer = raw.get("answer")
        entry = {"prompt": prompt, "example_id": raw["example_id"], "info": info}
        if answer is not None:
            entry["answer"] = answer
        if raw.get("task") is not None:
            entry["task"] = raw["task"]
        entry = _jsonable(entry)
        rows.append(
            {
                "prompt": prompt,
                "label": answer if isinstance(answer, str) and answer.strip() else NO_ANSWER,
                "tools": _jsonable(_wire_tools(vf_env._normalize_tool_defs(tool_defs))),
                "metadata": {"verifiers": {"env": env, "env_args": dict(env_args or {}), "input": entry}},
            }
        )
    return rows


def _dump(message) -> dict[str, Any]:
    return message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)


def _text(content: Any) -> str:
    """A message's content as text: a string, or text-only content parts joined."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else [content]
    texts = [p.get("text") if isinstance(p, Mapping) else getattr(p, "text", None) for p in parts]
    if any(not isinstance(t, str) for t in texts):
        raise ValueError(f"an environment message with non-text content ({type(content).__name__}) is not supported")
    return "".join(texts)


class _EngineClient:
    """Built by `VerifiersEnvironment` as a `vf.Client` subclass (verifiers is optional): each `get_response` is one
    model turn, handed to the episode loop through `turns` and answered when the episode's `step` gets its text."""

    def __init__(self, turns: asyncio.Queue) -> None:
        self.turns = turns

    async def get_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        reply: asyncio.Future = asyncio.get_running_loop().create_future()
        await self.turns.put((list(prompt), list(tools or []), reply))
        return await reply


@lru_cache(maxsize=1)
def _client_class():
    vf = _import_verifiers()

    class EngineClient(_EngineClient, vf.Client):
        def __init__(self, turns: asyncio.Queue) -> None:
            vf.Client.__init__(self, turns)
            _EngineClient.__init__(self, turns)

        def setup_client(self, config):  # never given a config: the engine is not a server
            raise NotImplementedError

        async def to_native_tool(self, tool):
            return tool

        async def to_native_prompt(self, messages):
            return messages, {}

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            raise NotImplementedError

        async def raise_from_native_response(self, response) -> None:
            return None

        async def from_native_response(self, response):
            return response

        async def close(self) -> None:
            return None

    return EngineClient


class VerifiersEnvironment(Environment):
    """One episode of the verifiers environment named in the row's metadata (a `source: verifiers` dataset row).

    `reset` starts the environment's own rollout and waits for its first model call; each `step` answers the pending
    call with the model's turn and waits for the next call (-> the environment's new messages) or the rollout's end
    (-> its rubric's reward, done).
    """

    _rollout: asyncio.Future | None = None

    async def reset(self, task: Task) -> None:
        meta = task.metadata.get("verifiers") if isinstance(task.metadata, Mapping) else None
        if not isinstance(meta, Mapping):
            raise ValueError(
                "row metadata has no 'verifiers' entry; allowed: rows of a dataset with source: verifiers"
            )
        vf_env = load_verifiers_env(meta["env"], meta["env_args"])
        self._loop = asyncio.get_running_loop()
        self._turns: asyncio.Queue = asyncio.Queue()
        self._reply: asyncio.Future | None = None
        self._turn = 0
        rollout_input = json.loads(json.dumps(meta["input"]))  # the environment may change its input; rows stay
        self._rubric_errors: list[str] = []
        said = _RUBRIC_ERRORS.set(self._rubric_errors)  # the rollout's task copies this context: its errors land here
        try:
            self._rollout = asyncio.ensure_future(
                vf_env.run_rollout(rollout_input, _client_class()(self._turns), "rl-multilora", {})
            )
        finally:
            _RUBRIC_ERRORS.reset(said)
        first = await self._next()
        if first is None:
            raise RuntimeError(f"the verifiers rollout ended before its first model turn{self._error_suffix()}")
        self._messages, self._tools = first
        prompt = [_dump(m) for m in _normalize(meta["input"]["prompt"])]
        if self._messages != prompt:
            raise ValueError(
                "the environment's first model call is not the row's prompt (its setup_state or get_prompt_messages "
                f"changed it): {self._messages!r} != {prompt!r}"
            )

    async def step(self, action: str) -> EnvStep:
        if self._reply is None:
            raise RuntimeError("step without a pending model call")
        response = self._respond(action)
        # What the next call must start with: the messages of this call, then the assistant message verifiers makes
        # of the response (its MultiTurnEnv keeps the message's content and tool calls, not its finish reason).
        said = {"role": "assistant", "content": response.message.content, "tool_calls": response.message.tool_calls}
        context = [*self._messages, _dump(_normalize([said])[0])]
        self._reply.set_result(response)
        self._reply = None
        self._turn += 1
        nxt = await self._next()
        if nxt is None:
            return self._final()
        messages, tools = nxt
        if tools != self._tools:
            raise ValueError("the environment changed its tools mid-episode; the prompt showed the first ones")
        if messages[: len(context)] != context:
            raise ValueError(
                "the environment's next model call does not continue the conversation (it rewrote earlier messages); "
                "a linear conversation is needed to keep the trained tokens exactly the model's"
            )
        self._messages = messages
        observation = []
        for m in messages[len(context) :]:
            entry = {"role": m["role"], "content": _text(m.get("content") or "")}
            if isinstance(m.get("tool_call_id"), str):
                entry["tool_call_id"] = m["tool_call_id"]
            observation.append(entry)
        if not observation:
            raise ValueError("the environment asked for another model turn without adding a message")
        return EnvStep(observation=observation)

    def close(self) -> None:
        # Called from a worker thread (a synchronous close): the rollout task belongs to the episode's loop.
        if self._rollout is not None and not self._rollout.done():
            with contextlib.suppress(RuntimeError):  # the loop is already closed: so is the task
                self._loop.call_soon_threadsafe(self._rollout.cancel)

    async def _next(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None] | None:
        """The environment's next model call (its messages and tools), or None when its rollout ended."""
        get = asyncio.ensure_future(self._turns.get())
        await asyncio.wait({get, self._rollout}, return_when=asyncio.FIRST_COMPLETED)
        if not get.done():
            get.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await get
            return None
        messages, tool_defs, self._reply = get.result()
        return [_dump(m) for m in messages], _wire_tools(tool_defs)

    def _final(self) -> EnvStep:
        """The ended rollout's reward, or the error it ended with."""
        if self._rollout.cancelled():  # `exception()` would raise the CancelledError into the episode's task
            raise RuntimeError(f"the verifiers rollout was cancelled{self._error_suffix()}")
        exc = self._rollout.exception()
        if exc is not None:
            raise RuntimeError(f"the verifiers rollout raised {type(exc).__name__}: {exc}") from exc
        output = self._rollout.result()
        if output.get("error"):
            raise RuntimeError(f"the verifiers rollout ended with an error{self._error_suffix()}")
        if self._rubric_errors:  # verifiers scored the function 0; trained so, a broken rubric looked like a bad model
            more = f" (and {len(self._rubric_errors) - 1} more)" if len(self._rubric_errors) > 1 else ""
            raise RuntimeError(
                f"the environment's rubric failed: {self._rubric_errors[0]}{more}; verifiers scores such a function 0, "
                "so the episode is not trained on"
            )
        reward = output.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise ValueError(f"the environment's rubric gave reward={reward!r}; allowed: a finite number")
        return EnvStep(reward=float(reward), done=True, metadata={"metrics": dict(output.get("metrics") or {})})

    def _error_suffix(self) -> str:
        if not self._rollout.done() or self._rollout.cancelled():
            return ""
        if self._rollout.exception() is not None:
            exc = self._rollout.exception()
            return f": {type(exc).__name__}: {exc}"
        error = self._rollout.result().get("error")
        return f": {error.get('error')}: {error.get('message')}" if error else ""

    def _respond(self, text: str):
        """The model's turn as the vf.Response an OpenAI-compatible server would give: tool calls parsed (when the
        environment offers tools) and their blocks removed from the content."""
        from verifiers.types import Response, ResponseMessage
        from verifiers.types import ToolCall as VfToolCall

        calls = [c for c in parse_tool_calls(text) if isinstance(c, ToolCall)] if self._tools else []
        content = re.sub(_TOOL_CALL_BLOCK, "", text, flags=re.DOTALL).strip() if calls else text
        tool_calls = [
            VfToolCall(id=f"call_{self._turn}_{i}", name=c.name, arguments=json.dumps(c.arguments))
            for i, c in enumerate(calls)
        ]
        message = ResponseMessage(
            content=content or None,
            finish_reason="tool_calls" if tool_calls else "stop",
            is_truncated=False,
            tool_calls=tool_calls or None,
        )
        return Response(id=f"rl-multilora-{self._turn}", created=0, model="rl-multilora", message=message)


def _normalize(messages):
    from verifiers.utils.message_utils import normalize_messages

    return normalize_messages(messages, field_name="prompt")
