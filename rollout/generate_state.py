"""One rollout: submit every prompt group of every adapter to one engine at once, collect the samples.

Design choices:
- One `engine.agenerate` call per prompt group, all groups launched together with `asyncio.gather`,
  so the engine sees the groups of all adapters at the same time and can put them in the same
  decode batches. Per-adapter bookkeeping lives in hooks, not here.
- Hooks are called from the event loop only (never from engine threads), in a fixed order:
  `on_rollout_start`, `on_group_submit` for every group (all before any request is sent, so a hook
  that rejects a group fails the rollout before anything is in flight), then per group each
  `on_sample_done` followed by that group's `on_group_done`, and finally `on_rollout_end`.
- A result with finish_reason "abort" (the engine was paused in abort mode for a weight sync) is
  thrown away whole and the sample is resubmitted with the same seed, up to `max_resubmits` times,
  then marked ABORTED. A single-turn sample is always filled from exactly one result, so it never mixes
  tokens generated under two weight versions. A multi-turn episode sends one request per turn, and an async
  publish between two turns gives its later turns the newer version: it trains as old as its oldest turn
  (`weight_version`), its per-turn versions in `metadata["turn_versions"]` (see `_Episode.fill`).
- Failure is per request: an "error" result, or an engine call that raises, marks only the samples
  of that call FAILED (with `metadata["error"]`); every other group still completes.
- Each request's seed is the sample's `metadata["sampling_seed"]` (set by the data source from the
  adapter's own counters), so an adapter's rollouts do not depend on who shares the batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import logging
import queue
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from rollout.engines.base import RolloutEngine
from rollout.types import AdapterRef, GenerateRequest, GenerateResult, RewardSpec, Sample, SampleStatus, SamplingParams

logger = logging.getLogger(__name__)
_SAID: set[tuple[str, str]] = set()  # (environment path, what) warnings already logged once in this process


def _holds_an_observation(value) -> bool:
    """Whether what an environment's `reset` returned carries text the model was meant to read (a string, messages,
    or a tuple / list starting with one: gymnasium's `(observation, info)`)."""
    if isinstance(value, str):
        return True
    if isinstance(value, tuple | list) and value:
        return isinstance(value[0], str | dict | list)
    return False


_STATUS_BY_FINISH_REASON = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
}


class HooksError(ValueError):
    """A hooks import path that cannot be loaded, or a sample the hooks reject."""


class GenerateStateHooks:
    """Lifecycle callbacks of one rollout; every method is a no-op here. Subclass and override.

    Custom hooks are loaded by import path (`module:Class`, see `load_hooks`) and built with no
    arguments, so their `__init__` must take none (or only defaulted ones).
    """

    def on_rollout_start(self, state: GenerateState) -> None:
        """Before any group is submitted."""

    def on_group_submit(self, state: GenerateState, group: list[Sample]) -> None:
        """Before the group's requests are sent; may fix up the samples' tags or raise to reject them."""

    def on_sample_done(self, state: GenerateState, sample: Sample) -> None:
        """A sample reached its final status (COMPLETED, TRUNCATED, ABORTED or FAILED)."""

    def on_group_done(self, state: GenerateState, group: list[Sample]) -> None:
        """Every sample of the group is done (after their `on_sample_done`)."""

    def on_rollout_end(self, state: GenerateState, samples: list[Sample]) -> None:
        """All groups are done; `samples` is every sample in submission order."""


@dataclass(frozen=True)
class AdapterTags:
    """What every sample of a tenant must carry: its adapter (name, slot) and its reward spec."""

    adapter: AdapterRef
    reward_spec: RewardSpec


class MultiLoRAHooks(GenerateStateHooks):
    """Default hooks: every sample must carry an AdapterRef and a RewardSpec; in-flight groups per adapter.

    A sample missing its RewardSpec (or its AdapterRef, when `metadata["adapter_name"]` names the
    tenant) is tagged from `registry` (given at construction); a sample that cannot be tagged is rejected with a
    HooksError, because an untagged request would silently run on the base model and be scored by no one.
    `in_flight(name)` counts the adapter's submitted groups that are not done yet (`drained(name)`: none). One
    rollout at a time per hooks object: `on_rollout_start` clears counts left behind by a rollout that raised.
    """

    def __init__(self, registry: Mapping[str, AdapterTags] | None = None) -> None:
        self.registry: dict[str, AdapterTags] = dict(registry or {})
        self._in_flight: dict[str, int] = {}
        self._groups_done: dict[str, int] = {}
        self._status_counts: dict[str, dict[str, int]] = {}

    def in_flight(self, name: str) -> int:
        """Groups of adapter `name` submitted and not yet done."""
        return self._in_flight.get(name, 0)

    def drained(self, name: str) -> bool:
        """True when adapter `name` has no group in flight."""
        return self.in_flight(name) == 0

    def stats(self, name: str) -> dict[str, Any]:
        """Per-adapter counters over the hooks' lifetime: groups done and samples by final status."""
        return {
            "in_flight_groups": self.in_flight(name),
            "groups_done": self._groups_done.get(name, 0),
            "samples_by_status": dict(self._status_counts.get(name, {})),
        }

    def on_rollout_start(self, state: GenerateState) -> None:
        # One rollout at a time per hooks object: counts left by a rollout that raised are stale, not in flight.
        stale = {name: count for name, count in self._in_flight.items() if count}
        if stale:
            logger.warning("in-flight group counts %s left by an interrupted rollout; resetting them", stale)
        self._in_flight = dict.fromkeys(self._in_flight, 0)

    def on_group_submit(self, state: GenerateState, group: list[Sample]) -> None:
        for sample in group:
            self._tag(sample)
        names = {sample.adapter.name for sample in group}
        if len(names) != 1:
            raise HooksError(f"a prompt group must belong to one adapter; this group mixes {sorted(names)}")
        name = names.pop()
        self._in_flight[name] = self._in_flight.get(name, 0) + 1

    def on_sample_done(self, state: GenerateState, sample: Sample) -> None:
        counts = self._status_counts.setdefault(sample.adapter.name, {})
        counts[sample.status.value] = counts.get(sample.status.value, 0) + 1

    def on_group_done(self, state: GenerateState, group: list[Sample]) -> None:
        name = group[0].adapter.name
        self._in_flight[name] -= 1
        self._groups_done[name] = self._groups_done.get(name, 0) + 1

    def _tag(self, sample: Sample) -> None:
        if sample.adapter is not None and (sample.reward_spec is not None or sample.environment is not None):
            return  # an episode's environment gives its reward
        name = sample.adapter.name if sample.adapter is not None else sample.metadata.get("adapter_name")
        tags = self.registry.get(name) if name is not None else None
        if tags is None:
            missing = "AdapterRef" if sample.adapter is None else "RewardSpec"
            raise HooksError(
                f"sample (group_index={sample.group_index}, index={sample.index}) has no {missing} and adapter "
                f"{name!r} is not in the hooks registry (known: {sorted(self.registry)}); tag samples in the data "
                "source or give the hooks a registry"
            )
        if sample.adapter is None:
            sample.adapter = tags.adapter
        if sample.reward_spec is None:
            sample.reward_spec = tags.reward_spec


def load_hooks(path: str | None, **kwargs: Any) -> GenerateStateHooks:
    """Build the hooks named by `path` ("module:Class"); None gives `MultiLoRAHooks(**kwargs)`.

    `kwargs` go to the class's constructor (a custom class that takes none is built with none).
    """
    if path is None:
        return MultiLoRAHooks(**kwargs)
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise HooksError(f"hooks path={path!r} is not allowed; allowed: 'module:Class', e.g. 'my_pkg.hooks:MyHooks'")
    module_name, attr = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise HooksError(f"hooks path={path!r}: cannot import module {module_name!r}: {exc}") from exc
    if not hasattr(module, attr):
        raise HooksError(f"hooks path={path!r}: module {module_name!r} has no attribute {attr!r}")
    cls = getattr(module, attr)
    if not isinstance(cls, type) or not issubclass(cls, GenerateStateHooks):
        raise HooksError(
            f"hooks path={path!r}: {attr!r} is {cls!r}, not a subclass of rollout.generate_state.GenerateStateHooks"
        )
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise HooksError(f"hooks path={path!r}: cannot construct {attr}(**{sorted(kwargs)}): {exc}") from exc


class GenerateState:
    """Runs one rollout of many adapters' prompt groups on one engine, calling the hooks on the way."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        hooks: GenerateStateHooks,
        sampling: SamplingParams,
        max_resubmits: int = 3,
        resubmit_backoff_s: float = 0.0,
        context_length: int | None = None,
    ) -> None:
        """`context_length`: the model's (positions a prompt plus its output may take); episodes stop their token
        budget there and end TRUNCATED. None: the engine's own `context_length` when it says (the embedded engine
        does; an engine behind HTTP or several engines do not)."""
        if max_resubmits < 0:
            raise ValueError(f"max_resubmits={max_resubmits!r} is not allowed; allowed: >= 0")
        if resubmit_backoff_s < 0:
            raise ValueError(f"resubmit_backoff_s={resubmit_backoff_s!r} is not allowed; allowed: >= 0")
        if not isinstance(hooks, GenerateStateHooks):
            raise HooksError(f"hooks={hooks!r} is not a GenerateStateHooks; build it with load_hooks()")
        self.engine = engine
        self.tokenizer = tokenizer
        self.hooks = hooks
        self.sampling = sampling
        self.max_resubmits = max_resubmits
        self.resubmit_backoff_s = resubmit_backoff_s
        self.context_length = context_length if context_length is not None else getattr(engine, "context_length", None)
        self._pending = 0
        self._running = False

    @property
    def pending(self) -> int:
        """Samples submitted and not yet done."""
        return self._pending

    async def run(self, groups: list[list[Sample]]) -> list[Sample]:
        """Generate every group concurrently; return all samples in submission order, filled in."""
        for position, group in enumerate(groups):
            if not group:
                raise ValueError(f"groups[{position}] is empty: every prompt group needs at least one sample")
        if self._running:
            raise RuntimeError("GenerateState.run is already running: use one GenerateState per concurrent rollout")
        self._running = True
        tasks: list[asyncio.Task] = []
        try:
            self.hooks.on_rollout_start(self)
            for group in groups:
                self.hooks.on_group_submit(self, group)
                self._pending += len(group)
            tasks = [asyncio.create_task(self._run_group(group)) for group in groups]
            await asyncio.gather(*tasks)
        except BaseException:
            # A hook that raised (or a cancellation) ends the rollout: stop the other groups instead of
            # leaving them running against the engine with nobody collecting their results.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            self._pending = 0
            self._running = False
        samples = [sample for group in groups for sample in group]
        self.hooks.on_rollout_end(self, samples)
        return samples

    def run_sync(self, groups: list[list[Sample]]) -> list[Sample]:
        """`run` from synchronous code. Inside a running event loop (a notebook, an async server) it runs
        on a fresh loop in a worker thread, because `asyncio.run` cannot nest."""
        try:
            asyncio.get_running_loop()
            in_loop = True
        except RuntimeError:
            in_loop = False
        if not in_loop:  # outside the except block: an exception of the run would carry "no running event loop"
            return asyncio.run(self.run(groups))
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(asyncio.run, self.run(groups)).result()

    async def _run_group(self, group: list[Sample]) -> None:
        if len({s.environment is None for s in group}) > 1:
            raise ValueError("a group mixes episodes (samples with an environment) and single-turn samples")
        if group[0].environment is not None:  # multi-turn episodes: each sample is one, all run concurrently
            await asyncio.gather(*(self._run_episode(sample) for sample in group))
            for sample in group:
                self._pending -= 1
                self.hooks.on_sample_done(self, sample)
            self.hooks.on_group_done(self, group)
            return
        todo = list(group)
        attempt = 0
        while todo:
            results = await self._generate(todo, attempt)
            retry = []
            for sample, result in zip(todo, results, strict=True):
                if result.finish_reason == "abort" and attempt < self.max_resubmits:
                    retry.append(sample)
                    continue
                self._fill(sample, result, attempt)
                self._pending -= 1
                self.hooks.on_sample_done(self, sample)
            if retry:
                attempt += 1
                if self.resubmit_backoff_s:
                    await asyncio.sleep(self.resubmit_backoff_s * attempt)
            todo = retry
        self.hooks.on_group_done(self, group)

    async def _generate(self, samples: list[Sample], attempt: int) -> list[GenerateResult]:
        """One engine call for `samples`; an engine exception or a wrong result count fails these samples only."""
        requests = [self._request(sample, attempt) for sample in samples]
        try:
            results = await self.engine.agenerate(requests)
        except Exception as exc:  # the engine's failure costs this group, never the whole rollout
            logger.warning("engine call for %d request(s) failed: %r", len(requests), exc)
            return [GenerateResult(finish_reason="error", error=f"{type(exc).__name__}: {exc}") for _ in requests]
        if len(results) != len(requests):
            error = f"engine returned {len(results)} results for {len(requests)} requests"
            return [GenerateResult(finish_reason="error", error=error) for _ in requests]
        return list(results)

    def request_params(self, sample: Sample) -> tuple[str | None, SamplingParams]:
        """The engine adapter and sampling settings of `sample`'s request: its tenant's adapter, and its tenant's
        sampling (or the rollout's) with the sample's own seed. Override to ask for something else (evaluation
        does)."""
        name = sample.adapter.name if sample.adapter is not None else None
        base = sample.sampling or self.sampling
        # Same seed on every attempt: a resubmitted sample is the same draw, not a new one.
        return name, replace(base, seed=sample.metadata.get("sampling_seed", base.seed))

    # -- multi-turn episodes -----------------------------------------------------------------------------------------
    async def _run_episode(self, sample: Sample) -> None:
        """One episode of `sample.environment` (see rollout.environments): model turns on the engine with the
        sample's adapter, environment turns appended as loss-masked tokens; the sample ends filled in, FAILED with
        the reason when the environment misbehaved."""
        spec = sample.environment
        episode = _Episode(self, sample)
        try:
            await asyncio.wait_for(_contained(episode.run()), timeout=spec.episode_timeout_s)
        except asyncio.TimeoutError:
            episode.fail(f"episode ran past environment.episode_timeout_s={spec.episode_timeout_s}")
        except _EpisodeError as e:
            episode.fail(str(e))
        except Exception as e:  # noqa: BLE001 - whatever an environment does costs its own episode only
            episode.fail(f"environment raised {type(e).__name__}: {e}")
        finally:
            await episode.close()
        episode.fill()

    async def generate_turn(self, request: GenerateRequest) -> GenerateResult:
        """One request, resubmitted with the same seed after an abort (a weight sync), as rollout samples are."""
        for attempt in range(self.max_resubmits + 1):
            try:
                results = await self.engine.agenerate([replace(request, rid=f"{request.rid}/a{attempt}")])
            except Exception as exc:  # noqa: BLE001 - the engine's failure costs this episode only
                return GenerateResult(finish_reason="error", error=f"{type(exc).__name__}: {exc}")
            result = results[0] if len(results) == 1 else GenerateResult(finish_reason="error", error="no result")
            if result.finish_reason != "abort":
                return result
            if self.resubmit_backoff_s:
                await asyncio.sleep(self.resubmit_backoff_s * (attempt + 1))
        return result

    def _request(self, sample: Sample, attempt: int) -> GenerateRequest:
        name, sampling = self.request_params(sample)
        rid = f"{name or 'base'}/g{sample.group_index}/s{sample.index}/a{attempt}"
        return GenerateRequest(input_ids=list(sample.prompt_ids), adapter=name, sampling=sampling, rid=rid)

    def _fill(self, sample: Sample, result: GenerateResult, attempt: int) -> None:
        """Set every response field from this one result (overwriting, never appending)."""
        sample.response_ids = list(result.output_ids)
        sample.rollout_logprobs = list(result.output_logprobs)
        sample.loss_mask = [1] * len(sample.response_ids)
        sample.finish_reason = result.finish_reason
        sample.weight_version = result.weight_version
        sample.metadata["resubmits"] = attempt
        sample.metadata.pop("error", None)
        try:
            sample.response = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        except Exception as exc:  # an id outside the vocabulary is this sample's failure, not the rollout's
            sample.response = ""
            sample.status = SampleStatus.FAILED
            sample.metadata["error"] = f"cannot decode response_ids: {type(exc).__name__}: {exc}"
            return
        if result.finish_reason == "abort":
            sample.status = SampleStatus.ABORTED
        elif result.finish_reason == "error":
            sample.status = SampleStatus.FAILED
            sample.metadata["error"] = result.error or "engine reported an error without a message"
        elif result.finish_reason not in _STATUS_BY_FINISH_REASON:
            sample.status = SampleStatus.FAILED
            sample.metadata["error"] = f"unknown finish_reason {result.finish_reason!r}"
        elif result.output_logprobs and len(result.output_logprobs) != len(result.output_ids):
            # Training on misaligned logprobs would silently corrupt the importance ratios.
            sample.status = SampleStatus.FAILED
            sample.metadata["error"] = (
                f"engine returned {len(result.output_logprobs)} logprobs for {len(result.output_ids)} tokens"
            )
        else:
            sample.status = _STATUS_BY_FINISH_REASON[result.finish_reason]


class _EpisodeError(RuntimeError):
    """A misbehaving environment or engine: the episode fails with this message."""


class _DaemonThreads:
    """Daemon threads for synchronous environment calls, reused: a call takes an idle thread (or starts one), and
    the thread goes back to the idle ones when the call returns; one idle for `idle_s` exits. A call that never
    returns keeps its thread for ever (abandoned, as a thread of its own was before); the next call starts another.
    Reuse saves a thread start per call (an episode's reset, every step and close: five per 3-turn episode)."""

    def __init__(self, idle_s: float = 10.0) -> None:
        self._idle: list[queue.SimpleQueue] = []  # the inboxes of idle threads, most recently idle last
        self._lock = threading.Lock()
        self._idle_s = idle_s

    def submit(self, work: Callable[[], None]) -> None:
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name="rl-multilora-env", daemon=True).start()
        inbox.put(work)

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            try:
                work = inbox.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:  # still idle: exit; else a submitter took it and its work is coming
                        self._idle.remove(inbox)
                        return
                continue
            work()  # never raises: `_call`'s work catches everything
            with self._lock:
                self._idle.append(inbox)


_ENV_THREADS = _DaemonThreads()


async def _call(fn, *args, timeout: float):
    """`fn(*args)`, awaited when it is a coroutine function, else in a daemon thread (`_DaemonThreads`: reused, never
    shared by two calls at once); at most `timeout` seconds. Not the loop's default executor: `asyncio.run` joins its
    threads on exit, so one environment call that never returns would hold up the whole rollout; a daemon thread is
    abandoned instead."""
    if asyncio.iscoroutinefunction(fn):
        return await asyncio.wait_for(_contained(fn(*args)), timeout=timeout)
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def work() -> None:
        try:
            result, error = fn(*args), None
        except Exception as e:  # noqa: BLE001 - handed to the awaiting episode
            result, error = None, e
        except BaseException as e:  # noqa: BLE001 - SystemExit & co. would stop the rollout's loop: the episode's
            result, error = None, _EpisodeError(f"environment raised {type(e).__name__}: {e}")
        try:
            loop.call_soon_threadsafe(_settle, future, result, error)
        except RuntimeError:  # the rollout's loop is gone: nobody waits for this call any more
            pass

    _ENV_THREADS.submit(work)
    return await asyncio.wait_for(future, timeout=timeout)


async def _contained(coro):
    """Awaits an environment's coroutine, its escapes turned into the episode's failure: a `SystemExit` or
    `KeyboardInterrupt` raised in a task stops the whole event loop (asyncio re-raises them), and a `CancelledError`
    that is not this task's own cancellation (an environment awaiting something a library cancelled) would read as
    the rollout being cancelled. (Ctrl-C does not arrive as either inside the loop: `asyncio.run` cancels the main
    task instead.)"""
    try:
        return await coro
    except asyncio.CancelledError:
        if _cancelled_from_outside():
            raise
        raise _EpisodeError("environment raised CancelledError (nothing cancelled the episode)") from None
    except (SystemExit, KeyboardInterrupt) as e:
        raise _EpisodeError(f"environment raised {type(e).__name__}: {e}") from None


def _cancelled_from_outside() -> bool:
    """Whether the current task is being cancelled (a timeout, the rollout stopping), as opposed to merely seeing a
    `CancelledError` raised below it. `Task.cancelling()` is Python 3.11+; before it every one counts as a
    cancellation."""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    return cancelling is None or cancelling() > 0


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # timed out and abandoned
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class _Episode:
    """The state of one multi-turn episode while it runs (token lists, rewards, the environment instance)."""

    def __init__(self, state: GenerateState, sample: Sample) -> None:
        self.state = state
        self.sample = sample
        self.spec = sample.environment
        self.env = None
        self.ids: list[int] = []  # response: model and environment turns
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.logprobs_missing = False  # a model turn came back without log-probs (an engine may omit them)
        self.turn_rewards: list[float] = []
        self.versions: list[int | None] = []  # each model turn's adapter version
        self.status = SampleStatus.TRUNCATED
        self.finish_reason = "length"
        self.error: str | None = None
        self.turns = 0

    async def _env(self, method: str, *args):
        try:
            return await _call(getattr(self.env, method), *args, timeout=self.spec.turn_timeout_s)
        except asyncio.TimeoutError:
            raise _EpisodeError(
                f"environment {method} ran past environment.turn_timeout_s={self.spec.turn_timeout_s}"
            ) from None

    async def run(self) -> None:
        from rollout.environments import (
            Task,
            build_environment,
            check_step,
            environment_class,
            is_async,
            short_repr,
        )

        state, sample, spec = self.state, self.sample, self.spec
        try:  # a plain class's constructor that blocks (opens a connection, loads a file) must not stall every other
            # episode: in a worker thread, under the turn timeout; an async class's on the loop (it may bind to it)
            cls = environment_class(spec.path)
            if is_async(cls):
                self.env = build_environment(cls, spec.kwargs, spec.path)
            else:
                self.env = await _call(build_environment, cls, spec.kwargs, spec.path, timeout=spec.turn_timeout_s)
        except asyncio.TimeoutError:
            raise _EpisodeError(
                f"environment {spec.path} construction ran past environment.turn_timeout_s={spec.turn_timeout_s}"
            ) from None
        got = await self._env("reset", Task(sample.prompt, sample.label, dict(sample.metadata)))
        if _holds_an_observation(got):  # a gymnasium port's (observation, info): its text would never reach the model
            raise _EpisodeError(
                f"environment reset returned {short_repr(got)} ({type(got).__name__}); allowed: None (the episode's first "
                "text is the dataset row's prompt; put an opening observation there, or return it from the first "
                "step)"
            )
        if got is not None and (spec.path, "reset") not in _SAID:  # anything else is ignored, as it always was
            _SAID.add((spec.path, "reset"))
            logger.warning("environment %s: reset returned %s, which is ignored", spec.path, type(got).__name__)
        adapter, sampling = state.request_params(sample)
        # the episode's tokens after the prompt: its max_tokens, and no more than the model's context holds (a prompt
        # too long for it is left to the engine, which fails the turn naming both lengths)
        cap, context = spec.max_tokens, state.context_length
        if context is not None and len(sample.prompt_ids) < context:
            cap = min(cap, context - len(sample.prompt_ids))
        for turn in range(spec.max_turns):
            budget = cap - len(self.ids)
            if budget <= 0:
                return  # TRUNCATED: out of tokens
            seed = None if sampling.seed is None else (sampling.seed + 7919 * turn) & 0x7FFFFFFF
            request = GenerateRequest(
                input_ids=list(sample.prompt_ids) + self.ids,
                adapter=adapter,
                sampling=replace(sampling, max_new_tokens=min(sampling.max_new_tokens, budget), seed=seed),
                rid=f"{adapter or 'base'}/g{sample.group_index}/s{sample.index}/t{turn}",
                keep_prefix=turn + 1 < spec.max_turns,  # the next turn re-sends this context: keep its KV
            )
            result = await state.generate_turn(request)
            if result.finish_reason in ("error", "abort"):
                raise _EpisodeError(f"model turn {turn}: {result.finish_reason}: {result.error or 'no message'}")
            if result.output_logprobs and len(result.output_logprobs) != len(result.output_ids):
                raise _EpisodeError(f"model turn {turn}: engine returned misaligned logprobs")
            out = list(result.output_ids)
            self.ids += out
            self.mask += [1] * len(out)
            self.logprobs += list(result.output_logprobs) or [0.0] * len(out)
            self.logprobs_missing |= bool(out) and not result.output_logprobs
            self.versions.append(result.weight_version)
            self.turns = turn + 1
            text = state.tokenizer.decode(out, skip_special_tokens=True)
            try:
                step = check_step(await self._env("step", text))
            except ValueError as e:
                raise _EpisodeError(f"environment step: {e}") from None
            self.turn_rewards.append(float(step.reward))
            if step.done:
                self.status, self.finish_reason = SampleStatus.COMPLETED, "stop"
                return
            ended = bool(out) and out[-1] in _stop_ids(state, request.sampling)
            end_text = state.tokenizer.decode(out[-1:]) if ended else None  # the turn-end marker it generated
            obs = observation_ids(state.tokenizer, step.observation, ended_turn=ended, end_text=end_text)
            if len(self.ids) + len(obs) >= cap:
                return  # TRUNCATED: the environment's answer does not fit (max_tokens or the context)
            self.ids += obs
            self.mask += [0] * len(obs)
            self.logprobs += [0.0] * len(obs)
        # TRUNCATED: max_turns model turns without done

    def fail(self, reason: str) -> None:
        self.status, self.finish_reason, self.error = SampleStatus.FAILED, "error", reason

    async def close(self) -> None:
        if self.env is not None:
            try:
                await _call(self.env.close, timeout=self.spec.turn_timeout_s)
            except Exception as e:  # noqa: BLE001 - a failing close changes nothing about the episode
                said = (self.spec.path, f"close {type(e).__name__}")
                if said not in _SAID:  # the first per environment and exception type, not one per episode
                    _SAID.add(said)
                    logger.warning(
                        "environment %s: close failed (%s again is not logged)",
                        self.spec.path, type(e).__name__, exc_info=True,
                    )  # fmt: skip

    def fill(self) -> None:
        s = self.sample
        # None of the episode's log-probs when a turn had none: as for a single-turn sample without them (the trainer
        # then uses no rollout log-probs); placeholders of 0 read as p = 1 and scaled every token's TIS weight down.
        s.response_ids, s.loss_mask = self.ids, self.mask
        s.rollout_logprobs = [] if self.logprobs_missing else self.logprobs
        s.status, s.finish_reason = self.status, self.finish_reason
        # An async publish between two turns (nothing of the episode runs while its environment answers) gives the
        # later turns the newer version. The episode stays a valid sample: each token's rollout log-prob is that of
        # the version that sampled it (what an importance-sampling correction needs, as in AReaL's interruptible
        # rollouts), and it counts as old as its oldest turn, so staleness limits hold for all of its tokens.
        known = [v for v in self.versions if v is not None]
        s.weight_version = min(known) if known else None
        if len(set(self.versions)) > 1:
            s.metadata["turn_versions"] = list(self.versions)
        s.response = self.state.tokenizer.decode(
            [t for t, m in zip(self.ids, self.mask, strict=True) if m], skip_special_tokens=True
        )
        s.metadata["turns"] = self.turns
        s.metadata["turn_rewards"] = list(self.turn_rewards)
        s.metadata.pop("error", None)
        if self.error is not None:
            s.metadata["error"] = self.error
        else:
            s.reward = float(sum(self.turn_rewards))


def _stop_ids(state: GenerateState, sampling: SamplingParams) -> set[int]:
    """The token ids a model turn can end on: the tokenizer's EOS, the engine's (the embedded one adds the model's
    `generation_config` EOS ids, e.g. a Gemma-style `<end_of_turn>` that is not the tokenizer's `eos_token`) and
    the request's `stop_token_ids`."""
    ids: set[int] = set(getattr(state.engine, "eos_ids", ())) | set(sampling.stop_token_ids or ())
    eos = state.tokenizer.eos_token_id
    ids |= {eos} if isinstance(eos, int) else set(eos or [])
    return ids


_OBS_CACHE_SIZE = 1024  # observations kept per tokenizer
_obs_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> OrderedDict(key -> ids), LRU
_obs_lock = threading.Lock()


def _freeze(obj: Any) -> Any:
    """A hashable stand-in for JSON-like `obj` that tells apart whatever a template could render differently (key
    order, list vs tuple, 1 vs 1.0 vs True); TypeError for anything else (such messages are not cached)."""
    if obj is None or type(obj) in (str, int, float, bool):
        return (type(obj).__name__, obj)
    if type(obj) is dict:
        return ("dict", tuple((_freeze(k), _freeze(v)) for k, v in obj.items()))
    if type(obj) in (list, tuple):
        return (type(obj).__name__, tuple(_freeze(v) for v in obj))
    raise TypeError(type(obj).__name__)


def observation_ids(tokenizer, messages: list[dict], ended_turn: bool, end_text: str | None = None) -> list[int]:
    """The token ids of an environment turn after a model turn: what the chat template writes after an assistant
    message's content (its end-of-turn marker, unless the model already produced it), the observation messages, and
    the next generation prompt. Computed as text differences of the template, so the model's own tokens are never
    re-tokenized. `ended_turn`: the model's turn ended on a stop token, whose text is `end_text` (default the
    tokenizer's `eos_token`): the template's marker is left out when it starts with that text.

    Cached per tokenizer (LRU, keyed by the messages' exact content, `ended_turn` and the chat template): an
    environment that answers alike (a fixed prompt, a common tool error) renders and tokenizes it once, not twice per
    turn per episode. Messages with values other than JSON-like ones are rendered every time."""
    try:
        key = (_freeze(messages), bool(ended_turn), end_text, getattr(tokenizer, "chat_template", None))
        hash(key)
        with _obs_lock:
            cache = _obs_caches.get(tokenizer)
            if cache is None:
                cache = _obs_caches.setdefault(tokenizer, OrderedDict())
            ids = cache.get(key)
            if ids is not None:
                cache.move_to_end(key)
                return list(ids)
    except TypeError:  # unhashable chat template, messages that are not JSON-like, or a tokenizer without weakrefs
        return _observation_ids(tokenizer, messages, ended_turn, end_text)
    ids = tuple(_observation_ids(tokenizer, messages, ended_turn, end_text))  # outside the lock: other threads
    with _obs_lock:
        cache[key] = ids
        if len(cache) > _OBS_CACHE_SIZE:
            cache.popitem(last=False)
    return list(ids)


def _observation_ids(tokenizer, messages: list[dict], ended_turn: bool, end_text: str | None = None) -> list[int]:
    probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "\x00MARK\x00"}]
    before = tokenizer.apply_chat_template(probe, tokenize=False)
    after = tokenizer.apply_chat_template([*probe, *messages], tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        raise _EpisodeError("the chat template renders a conversation differently once messages are appended")
    tail = before[before.rindex("\x00MARK\x00") + len("\x00MARK\x00") :]
    marker = (tokenizer.eos_token or "") if end_text is None else end_text
    if ended_turn and marker and tail.startswith(marker):
        tail = tail[len(marker) :]
    return list(tokenizer(tail + after[len(before) :], add_special_tokens=False)["input_ids"])
