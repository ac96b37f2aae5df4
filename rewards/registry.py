"""Resolve a `RewardSpec` to a callable, validate it at config load, and call it uniformly.

Design choices:
- Built-ins live in one registry filled by the `@register(name)` decorator at import of `rewards.builtin`;
  `BUILTINS` is a read-only view of it, so nothing outside this module can change what a name means.
- Custom rewards are `module:function` (the attribute may be dotted, `module:Class.method`). Their shape is
  declared with attributes set by decorators (`@batched`, `@with_format_check(check)`) rather than by naming
  conventions, so a plain function stays a plain function.
- Validation binds the signature against the exact call the executor makes, `fn(prompt, response, label,
  metadata, **spec.kwargs)` (or the same four by keyword for keyword-only functions), so an unknown kwarg or a
  missing parameter is a config error at adapter registration, not a failure counted at every step.
- `reward_values` is the single place that invokes a reward (sync or async, per-sample or batched) and
  `check_reward` the one that checks a value (a finite number) and adds the format bonus, each value on its own, so
  one bad value of a batch costs that sample only. `call_reward` runs both and raises on the first failure
  (`score`); the executor's workers call them separately.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rollout.types import RewardSpec

# A reward function: fn(prompt, response, label, metadata, **kwargs) -> float, or an `async def` of the same
# shape; with `@batched`, fn(prompts, responses, labels, metadatas, **kwargs) -> list[float].
RewardFn = Callable[..., Any]
FormatCheck = Callable[[str], bool]

_BATCHED_ATTR = "__reward_batched__"
_FORMAT_ATTR = "__reward_format_check__"
_ARGS = ("prompt", "response", "label", "metadata")
_BATCH_ARGS = ("prompts", "responses", "labels", "metadatas")


class RewardConfigError(ValueError):
    """A `RewardSpec` that cannot work: the message names the field, the value and what is allowed."""


@dataclass(frozen=True)
class _Builtin:
    fn: RewardFn
    format_check: FormatCheck | None
    check_kwargs: Callable[[dict[str, Any]], None] | None


_REGISTRY: dict[str, _Builtin] = {}


def register(
    name: str,
    *,
    format_check: FormatCheck | None = None,
    check_kwargs: Callable[[dict[str, Any]], None] | None = None,
) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a built-in reward under `name`.

    `format_check(response) -> bool` says whether a response is in the reward's expected answer format (used by
    `RewardSpec.format_bonus`); None means the reward has no format and a bonus is a config error.
    `check_kwargs(kwargs)` raises ValueError for kwarg values the function cannot use (run at validate time).
    """

    def decorate(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY:
            raise ValueError(f"reward name {name!r} is already registered (by {_REGISTRY[name].fn.__qualname__})")
        _REGISTRY[name] = _Builtin(fn, format_check, check_kwargs)
        if format_check is not None:
            setattr(fn, _FORMAT_ATTR, format_check)
        return fn

    return decorate


class _BuiltinsView(Mapping[str, RewardFn]):
    """Read-only, always-current view of the registry: name -> function."""

    def __getitem__(self, name: str) -> RewardFn:
        return _REGISTRY[name].fn

    def __iter__(self):
        return iter(sorted(_REGISTRY))

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __repr__(self) -> str:
        return f"BUILTINS({', '.join(sorted(_REGISTRY))})"


BUILTINS: Mapping[str, RewardFn] = _BuiltinsView()


def batched(fn: RewardFn) -> RewardFn:
    """Mark a reward as batched: fn(prompts, responses, labels, metadatas, **kwargs) -> list[float].

    The executor then calls it once per adapter per step with that adapter's samples (lists of equal length,
    in sample order) and one `timeout_s` for the whole call. Works on `def` and `async def`.
    """
    setattr(fn, _BATCHED_ATTR, True)
    return fn


def with_format_check(check: FormatCheck) -> Callable[[RewardFn], RewardFn]:
    """Declare a custom reward's answer format, so `RewardSpec.format_bonus` can be used with it.

    `check(response) -> bool`; the bonus is added to the reward when it returns True.
    """

    def decorate(fn: RewardFn) -> RewardFn:
        setattr(fn, _FORMAT_ATTR, check)
        return fn

    return decorate


def is_batched(fn: RewardFn) -> bool:
    return bool(getattr(fn, _BATCHED_ATTR, False))


def is_async(fn: RewardFn) -> bool:
    # an instance whose class defines `async def __call__` is async too
    return inspect.iscoroutinefunction(fn) or (
        not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)
    )


def format_check_of(fn: RewardFn) -> FormatCheck | None:
    return getattr(fn, _FORMAT_ATTR, None)


def spec_label(spec: RewardSpec) -> str:
    """Short human name of a spec for messages: the built-in name or the import path."""
    return spec.name if spec.name is not None else str(spec.path)


def _import_path(path: str) -> RewardFn:
    if not isinstance(path, str) or not re.fullmatch(r"[\w.]+:[\w.]+", path):
        raise RewardConfigError(
            f"reward.path: {path!r} is not an import path; allowed: 'package.module:function' "
            "(e.g. 'my_rewards:score_answer')"
        )
    module_name, attr_path = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name) and module_name[len(exc.name) :][:1] in ("", "."):
            raise RewardConfigError(
                f"reward.path: {path!r}: module {exc.name!r} not found; check the module name and that its folder "
                "is on sys.path (installed, or run from the directory that contains it)"
            ) from exc
        raise RewardConfigError(f"reward.path: {path!r}: importing module {module_name!r} failed: {exc!r}") from exc
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit too: a script that parses its argv at import must not end the run
        hint = ""
        if isinstance(exc, SystemExit):
            hint = " (it exits at import, e.g. argparse at top level: move that under `if __name__ == '__main__':`)"
        raise RewardConfigError(
            f"reward.path: {path!r}: importing module {module_name!r} failed: {exc!r}{hint}"
        ) from exc
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            callables = [n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))]
            raise RewardConfigError(
                f"reward.path: {path!r}: {getattr(obj, '__name__', obj)!r} has no attribute {part!r}; "
                f"callables there: {', '.join(callables) or '(none)'}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardConfigError(
            f"reward.path: {path!r} names a {type(obj).__name__}, not a function; allowed: a function "
            "fn(prompt, response, label, metadata, **kwargs) -> float"
        )
    if inspect.isclass(obj):  # callable, but calling it builds an instance: every sample would fail as "not a float"
        raise RewardConfigError(
            f"reward.path: {path!r} names the class {obj.__name__!r}, not a function; allowed: a function "
            "fn(prompt, response, label, metadata, **kwargs) -> float, or an instance of a class with such a "
            f"__call__ (e.g. `score = {obj.__name__}()` in the module and reward.path '{module_name}:score')"
        )
    call = obj if inspect.isroutine(obj) else type(obj).__call__
    if inspect.isgeneratorfunction(call) or inspect.isasyncgenfunction(call):  # each call would return a generator
        raise RewardConfigError(
            f"reward.path: {path!r} is a generator function (it yields); allowed: a function that returns a float "
            "(`return score`, not `yield score`)"
        )
    return obj


def _lookup(spec: RewardSpec) -> RewardFn:
    if (spec.name is None) == (spec.path is None):
        raise RewardConfigError(
            f"reward: name={spec.name!r}, path={spec.path!r}: set exactly one of them "
            f"(name: a built-in, one of {', '.join(sorted(_REGISTRY))}; path: 'module:function')"
        )
    if spec.name is not None:
        if spec.name not in _REGISTRY:
            raise RewardConfigError(
                f"reward.name: {spec.name!r} is not a built-in reward; allowed: {', '.join(sorted(_REGISTRY))} "
                "(or set reward.path to 'module:function' for a custom one)"
            )
        return _REGISTRY[spec.name].fn
    return _import_path(spec.path)


def _bind_mode(fn: RewardFn, spec: RewardSpec) -> str:
    """How the four data arguments are passed: "positional", or "keyword" for keyword-only parameters."""
    names = _BATCH_ARGS if is_batched(fn) else _ARGS
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "positional"  # callables implemented in C have no signature; trust the call
    calls = {"positional": (names, {}), "keyword": ((), dict(zip(names, names, strict=True)))}
    for mode, (args, by_name) in calls.items():
        try:
            sig.bind(*args, **by_name, **spec.kwargs)
            return mode
        except TypeError:
            pass
    where = f"reward {spec_label(spec)!r}{sig}"
    shape = f"fn({', '.join(names)}, **kwargs)"
    data_errors = []
    for args, by_name in calls.values():  # do the data arguments fit, leaving spec.kwargs aside?
        try:
            bound = sig.bind_partial(*args, **by_name)
        except TypeError as exc:
            data_errors.append(str(exc))
            continue
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        missing = [
            p.name
            for p in sig.parameters.values()
            if p.name not in bound.arguments and p.default is p.empty and p.kind not in variadic
        ]
        trl = [m for m in missing if m in _TRL_DATA_PARAMETERS and m not in spec.kwargs]
        if trl:  # the data comes from the samples, not from reward.kwargs: a TRL reward function's signature
            raise RewardConfigError(
                f"reward.path: {where} takes TRL's batched data arguments ({', '.join(map(repr, trl))}); allowed: "
                f"{shape} for one sample (returning a float), or a function decorated with @rewards.batched taking "
                "fn(prompts, responses, labels, metadatas, **kwargs) and returning one float per sample "
                "(docs/guides/rewards.md)"
            )
        if any(name not in spec.kwargs for name in missing):
            raise RewardConfigError(
                f"reward.kwargs: {spec.kwargs!r} lacks {', '.join(repr(m) for m in missing if m not in spec.kwargs)}, "
                f"required by {where}; allowed: kwargs that give every extra parameter without a default"
            )
        accepted = [
            p.name for p in sig.parameters.values() if p.name not in bound.arguments and p.kind not in variadic
        ]
        if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
            accepted.append("any (**kwargs)")
        raise RewardConfigError(
            f"reward.kwargs: {spec.kwargs!r} cannot be passed to {where}; allowed keys: {', '.join(accepted) or '(none)'}"
        )
    raise RewardConfigError(f"reward.path: {where} has the wrong signature ({data_errors[0]}); allowed: {shape}")


# Parameters a TRL reward function takes for its batch's data (GRPOTrainer's reward_funcs): missing from a call of
# ours, they were reported as missing reward.kwargs, and passing them there passed --dry-run and failed every sample.
_TRL_DATA_PARAMETERS = frozenset({"prompts", "completions", "completion_ids", "prompt_ids", "trainer_state"})


# The longest a tenant may let one sample's reward run: the step's other tenants wait for it (their rewards are in the
# same step), so a day-long timeout on a reward that hangs would stall every tenant for a day.
MAX_TIMEOUT_S = 600.0


def _check_numbers(spec: RewardSpec) -> None:
    for field_name, allowed, ok in (
        (
            "timeout_s",
            f"a number in (0, {MAX_TIMEOUT_S:g}] (seconds a sample's check may take; a step waits for its "
            "slowest, every tenant's training with it)",
            lambda v: math.isfinite(v) and 0 < v <= MAX_TIMEOUT_S,
        ),
        ("failure_value", "a finite number", math.isfinite),
        ("format_bonus", "a finite number >= 0", lambda v: math.isfinite(v) and v >= 0),
    ):
        value = getattr(spec, field_name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            raise RewardConfigError(f"reward.{field_name}={value!r} is not allowed; allowed: {allowed}")
    if not isinstance(spec.kwargs, dict) or not all(isinstance(k, str) for k in spec.kwargs):
        raise RewardConfigError(f"reward.kwargs={spec.kwargs!r} is not allowed; allowed: a mapping of str keys")


def as_spec(spec: RewardSpec | Mapping[str, Any]) -> RewardSpec:
    """`spec`, or the RewardSpec a mapping written like the config's `reward:` section gives (anything else is
    returned as it is, for the caller to refuse)."""
    if not isinstance(spec, Mapping):
        return spec
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(RewardSpec).validate_python(dict(spec))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise RewardConfigError(f"reward: {dict(spec)!r}: {where}: {first['msg']}") from None


def resolve(spec: RewardSpec) -> RewardFn:
    """Validate `spec` and return its reward function (the built-in or the imported custom function).

    Raises `RewardConfigError` naming the field, the value and what is allowed.
    """
    spec = as_spec(spec)
    if not isinstance(spec, RewardSpec):
        raise RewardConfigError(
            f"reward: {spec!r} is a {type(spec).__name__}; allowed: a rollout.types.RewardSpec, or a mapping like the "
            "config's reward: section"
        )
    _check_numbers(spec)
    fn = _lookup(spec)
    builtin = _REGISTRY.get(spec.name) if spec.name is not None else None
    if builtin is not None and builtin.check_kwargs is not None:
        try:
            builtin.check_kwargs(spec.kwargs)
        except ValueError as exc:
            raise RewardConfigError(f"reward.kwargs for {spec.name!r}: {exc}") from exc
    _bind_mode(fn, spec)
    if spec.format_bonus > 0 and format_check_of(fn) is None:
        raise RewardConfigError(
            f"reward.format_bonus: {spec.format_bonus!r} needs a format check, and reward {spec_label(spec)!r} "
            "declares none; allowed: 0 here, or a built-in with a format (gsm8k, math, dapo), or a custom "
            "function decorated with @rewards.with_format_check(check)"
        )
    return fn


def validate(spec: RewardSpec) -> None:
    """Raise `RewardConfigError` if `spec` cannot be scored (call at config load / adapter registration)."""
    resolve(spec)


def _as_reward(value: Any, spec: RewardSpec, index: int | None = None) -> float:
    at = "" if index is None else f" at index {index} of its batch"
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(
            f"reward {spec_label(spec)!r} returned {value!r} ({type(value).__name__}){at}; a reward must be a float"
        )
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"reward {spec_label(spec)!r} returned {reward}{at}; a reward must be finite")
    return reward


def _run_coroutine(coro: Any) -> Any:
    """Run a coroutine to completion from sync code, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    result: dict[str, Any] = {}

    def target() -> None:  # a notebook's loop is running here: use a fresh loop in a helper thread
        try:
            result["value"] = asyncio.run(coro)
        except BaseException as exc:  # re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def add_format_bonus(fn: RewardFn, spec: RewardSpec, response: str, reward: float) -> float:
    check = format_check_of(fn)
    if spec.format_bonus > 0 and check is not None and check(response):
        return reward + spec.format_bonus
    return reward


def _invoke(fn: RewardFn, spec: RewardSpec, mode: str, args: tuple[Any, ...]) -> Any:
    """Call `fn` with the four data arguments (positionally or by name) plus `spec.kwargs`; may be awaitable."""
    names = _BATCH_ARGS if is_batched(fn) else _ARGS
    if mode == "positional":
        return fn(*args, **spec.kwargs)
    return fn(**dict(zip(names, args, strict=True)), **spec.kwargs)


def _check_batch(out: Any, spec: RewardSpec, n: int) -> list[Any]:
    if _is_1d_array(out):  # a numpy array or a torch tensor of one value per sample, as reward code often returns
        out = out.tolist()
    if not isinstance(out, (list, tuple)) or len(out) != n:
        got = f"{type(out).__name__} of length {len(out)}" if hasattr(out, "__len__") else type(out).__name__
        raise TypeError(
            f"batched reward {spec_label(spec)!r} returned {got} for {n} samples; "
            "it must return a list (or a 1-D numpy array / torch tensor) with one float per sample"
        )
    return list(out)


def _is_1d_array(out: Any) -> bool:
    """A one-dimensional numpy array or torch tensor (duck-typed: neither library is imported here)."""
    return type(out).__module__.split(".")[0] in ("numpy", "torch") and getattr(out, "ndim", None) == 1


Item = tuple[str, str, Any, dict[str, Any]]  # (prompt, response, label, metadata)


def reward_values(fn: RewardFn, spec: RewardSpec, items: list[Item]) -> list[Any]:
    """What `fn` returns for `items`, one value per item, not checked yet (`check_reward` checks each).

    A batched function gets one call with four lists (raises unless it returns one value per item); a per-sample
    one is called once per item (async ones are driven to completion), raising on the first failure: the executor
    sends one sample per call to isolate them.
    """
    mode = _bind_mode(fn, spec)
    if is_batched(fn):
        columns = tuple(list(col) for col in zip(*items, strict=True)) if items else ([], [], [], [])
        out = _invoke(fn, spec, mode, columns)
        return _check_batch(_run_coroutine(out) if inspect.isawaitable(out) else out, spec, len(items))
    values = []
    for item in items:
        out = _invoke(fn, spec, mode, item)
        values.append(_run_coroutine(out) if inspect.isawaitable(out) else out)
    return values


def check_reward(fn: RewardFn, spec: RewardSpec, item: Item, value: Any, index: int | None = None) -> float:
    """The reward of `item` from the value `fn` returned for it, plus the format bonus; raises naming the value (and
    `index`, its position in a batch) unless it is a finite number."""
    return add_format_bonus(fn, spec, item[1], _as_reward(value, spec, index))


def call_reward(fn: RewardFn, spec: RewardSpec, items: list[Item]) -> list[float]:
    """Score `items` (prompt, response, label, metadata) with `fn`, synchronously, in this thread; raises on the
    first failure (`reward_values`, then `check_reward` on each value)."""
    batch = is_batched(fn)
    return [
        check_reward(fn, spec, item, value, k if batch else None)
        for k, (item, value) in enumerate(zip(items, reward_values(fn, spec, items), strict=True))
    ]


async def acall_reward(fn: RewardFn, spec: RewardSpec, item: Item) -> float:
    """Score one item with a per-sample reward from async code (awaits `async def` rewards in this loop)."""
    out = _invoke(fn, spec, _bind_mode(fn, spec), item)
    return check_reward(fn, spec, item, await out if inspect.isawaitable(out) else out)


def score(
    spec: RewardSpec | Mapping[str, Any],
    prompt: str,
    response: str,
    label: Any,
    metadata: dict[str, Any] | None = None,
) -> float:
    """Score one sample in this process, synchronously (tests, notebooks, debugging). `spec`: a RewardSpec, or a
    mapping written like the config's `reward:` section.

    No timeout and no isolation: exceptions from the reward propagate with their traceback. The training loop
    uses `RewardExecutor` instead.

    >>> from rollout.types import RewardSpec
    >>> score(RewardSpec(name="gsm8k"), "How many?", "2 + 3 = 5\\n#### 5", "#### 5")
    1.0
    >>> score(RewardSpec(name="gsm8k", format_bonus=0.1), "How many?", "#### 4", "5")
    0.1
    >>> score({"name": "exact_match"}, "Capital of France?", "Paris", "Paris")
    1.0
    """
    spec = as_spec(spec)
    fn = resolve(spec)
    return call_reward(fn, spec, [(prompt, response, label, dict(metadata or {}))])[0]
