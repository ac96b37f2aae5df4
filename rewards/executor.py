"""Score a step's samples in persistent worker processes, with per-call timeouts and per-tenant failure counts.

Design choices:
- Processes, not threads: a reward that hangs in C code or in a `while True` cannot be interrupted in a thread,
  but a process can be killed. Workers are fresh interpreters started with fork + exec (`python -c
  'from rewards._worker import main; ...'`), which is what multiprocessing's "spawn" does, minus its re-import of the parent's
  `__main__` (that re-runs unguarded scripts and imports a training script's torch into every worker). Safe in a
  process with torch loaded and threads running. Workers persist between calls and preload `rewards` and
  math_verify; each runs in its own session, so a kill takes the rewards' own child processes with it.
- Task granularity: a sync reward runs one sample per task, so one bad sample costs one sample. An `async def`
  reward gets chunks of up to `async_concurrency` samples run concurrently in the worker's event loop, each with
  its own timeout. A `@batched` reward gets one task per adapter per call.
- Timeout: each task has `spec.timeout_s` from the moment a worker takes it; past it the worker is killed and
  replaced, and the task's samples score `spec.failure_value`. Importing the reward's module is not part of it: a
  worker imports a custom reward's module the first time it gets a task of that spec, and the clock starts when it
  reports the import done (`_IMPORT_TIMEOUT_S` bounds the import). A module that takes longer than `timeout_s` to
  import (torch, a judge model) would otherwise time out in every fresh worker, and a replacement worker is always
  fresh, so the tenant (and every tenant whose task lands on a replacement) would never score. An async chunk's
  samples each have `timeout_s` from when they start running, and the worker cancels them itself; since sync work
  inside an `async def` blocks the event loop, they may start one after another, so the chunk's clock restarts each
  time one of its samples starts or finishes (the worker reports it). Its worker is killed only when `timeout_s`
  (plus a short grace) passes without that, i.e. the loop is blocked for good, or at the latest `timeout_s` per
  sample of the chunk after it started: a reward that blocks for ever costs one `timeout_s`, a chunk of slow but
  progressing samples is not cut short.
- Fairness: the next free worker takes a task from the adapter with the fewest tasks in flight, so a tenant whose
  reward hangs holds at most one worker while others have work. After one of its tasks times out, that tenant's
  tasks still queued in the same call are not started: a reward that hangs on every sample costs one timeout of
  wall time per call, not one per sample. An adapter whose reward crashed a worker in its previous call goes last:
  its tasks are started only when no other adapter has a task queued, so that it cannot take the last live worker
  (the others may still be starting) from the tenants it would otherwise block.
- Not generated is not scored: a sample whose generation FAILED or was ABORTED (an engine abort, a dropped
  request) is never sent to its reward and counts nowhere in the report (not in `samples`, not as an error): the
  reward would be called on an empty response (an expensive judge included) and fail, and engine trouble would
  fail the tenant as "reward failing". It keeps no reward; the trainer already leaves such samples out.
- Not started is not scored: those samples were never checked, so they get no reward (None) and are marked FAILED
  with the reason in `metadata["error"]`, like a sample whose generation failed; the trainer leaves them out (its
  `excluded`, the step's `failed_samples`) and the rest of their group trains on. Scoring them `failure_value`
  would train the tenant on correct answers as wrong ones. They count in `RewardReport.skipped`, not as errors.
- Crashes: a worker that dies while running a task (the reward segfaults, calls `os._exit`, kills its process, or
  the OOM killer picks it) is treated like a timeout: the task's samples score `spec.failure_value` (they count in
  `RewardReport.errors` and in `RewardReport.crashes`), the tenant's tasks still queued in the same call are not
  started, and the worker is replaced once, in the background, while the other workers keep serving the other
  tenants. So a reward that crashes on some or all of its samples adds at most its own `timeout_s` (its tasks
  already running elsewhere) plus one worker start to a step, not a worker start per sample.
- Failure report: a call lists an adapter in `RewardReport.all_failed` when none of its samples scored (each
  raised, timed out, returned a bad value or was not started) or when its reward crashed a worker, even if its
  other samples scored. The executor keeps no count across calls: the limit (`faults.max_reward_fail_steps` calls
  in a row) is the tenant's own counter (`rl_multilora.tenants`), so it starts clean when a name is submitted
  again. A reward that crashes its worker on only some inputs is thus failed like one that raises on every input:
  it would otherwise cost a worker start every step for ever.
- The parent resolves each spec (cached) only to learn its shape (sync, async, batched); a spec that does not
  resolve fails its own samples with the config error, never the call.
- Data goes to our own workers over a socket pair (pickle between our own processes only).
"""

from __future__ import annotations

import itertools
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path

from rewards._worker import Item, Outcome, format_exc
from rewards.registry import RewardConfigError, RewardFn, is_async, is_batched, resolve, spec_label
from rollout.types import RewardSpec, Sample, SampleStatus

# A worker answering an async chunk reports its own per-sample timeouts and progress; give it this long to send them.
_ASYNC_GRACE_S = 0.25
# A fresh worker imports rewards and math_verify (sympy) before it takes work; past this it is broken.
_STARTUP_TIMEOUT_S = 120.0
# The longest a worker may take to import a custom reward's module, before the reward's own timeout_s starts.
_IMPORT_TIMEOUT_S = 120.0
# Generation did not finish: the response is empty or cut short, nothing a reward should judge.
_NOT_GENERATED = (SampleStatus.FAILED, SampleStatus.ABORTED)
_MAX_STARTUP_FAILURES = 3
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)
# The package root goes first so that this `rewards` package is imported even when the working directory holds
# another `rewards` module (examples/multi_lora/rewards.py, say); `python -c` puts the working directory first.
_WORKER_CMD = "import sys; sys.path.insert(0, {root!r}); from rewards._worker import main; main({fd}, {ppid})"


@dataclass
class RewardReport:
    """What one `score_samples` call did, per adapter name ("" for samples without an adapter).

    `errors` / `timeouts`: samples whose reward raised / ran past `timeout_s` (they scored `failure_value`);
    `skipped`: samples not started after an earlier task of the adapter timed out or crashed (no reward, marked
    FAILED); `all_failed`: adapters none of whose samples scored, or whose reward crashed a worker, in this call,
    with the reason; `samples`: samples per adapter sent to the reward (not those whose generation failed or was
    aborted: they are not scored); `last_error`: the last failure message per adapter; `seconds`:
    wall time; `crashes`: the part of `errors` lost to a worker that died under the adapter's reward (the samples of
    the task it was running).
    """

    errors: dict[str, int] = field(default_factory=dict)
    timeouts: dict[str, int] = field(default_factory=dict)
    all_failed: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    samples: dict[str, int] = field(default_factory=dict)
    last_error: dict[str, str] = field(default_factory=dict)
    crashes: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)


@dataclass
class _Task:
    task_id: int
    adapter: str
    spec: RewardSpec
    sample_ids: list[int]
    deadline: float = math.inf  # its worker is killed past it
    limit: float = math.inf  # the latest the deadline may move to as an async chunk's samples progress
    importing: bool = False  # its worker is importing the reward's module: timeout_s has not started


_Finish = Callable[..., None]  # finish(task, outcomes, started=True): record a task's outcomes


@dataclass
class _Worker:
    process: subprocess.Popen
    conn: Connection
    started_at: float
    ready: bool = False
    task: _Task | None = None
    imported: set[RewardSpec] = field(default_factory=set)  # specs it resolved: their tasks start the clock at once


def _kill(worker: _Worker) -> None:
    """SIGKILL the worker's whole session (a hung reward cannot ignore it), reap it, close its socket."""
    if worker.process.poll() is None:  # still ours (not reaped), so its pid and group id cannot be reused yet
        try:
            os.killpg(worker.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            worker.process.kill()
        worker.process.wait()
    worker.conn.close()


def _stop_workers(workers: list[_Worker]) -> None:
    """Ask every worker to exit, kill those that do not within 2 s, and reap them all (no zombies)."""
    for worker in workers:
        try:
            worker.conn.send(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 2.0
    for worker in workers:
        try:
            worker.process.wait(max(0.0, deadline - time.monotonic()))
            worker.conn.close()
        except subprocess.TimeoutExpired:
            _kill(worker)
    workers.clear()


class RewardExecutor:
    """Scores samples with each one's `RewardSpec` in `num_workers` persistent, killable worker processes.

    `async_concurrency`: samples of
    an `async def` reward run concurrently in one worker. One call at a time (a lock enforces it). Use as a context manager or `close()`.
    """

    def __init__(self, num_workers: int = 2, *, async_concurrency: int = 32) -> None:
        for name, value in (
            ("num_workers", num_workers),
            ("async_concurrency", async_concurrency),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RewardExecutor.{name}={value!r} is not allowed; allowed: an integer >= 1")
        self.num_workers = num_workers
        self.async_concurrency = async_concurrency
        self._lock = threading.Lock()
        self._task_ids = itertools.count()
        self._resolved: dict[RewardSpec, RewardFn | RewardConfigError] = {}
        self._crashed: set[str] = set()  # adapters whose reward crashed a worker in their previous call
        self._startup_failures = 0
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        self._workers.extend(self._spawn() for _ in range(num_workers))

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        parent_sock, child_sock = socket.socketpair()
        try:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _WORKER_CMD.format(root=_PACKAGE_ROOT, fd=child_sock.fileno(), ppid=os.getpid()),
                ],
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # own process group: killed as a whole, and Ctrl-C stays with the parent
            )
        finally:
            child_sock.close()  # only the worker holds its end now, so a dead worker reads as EOF here
        return _Worker(process, Connection(parent_sock.detach()), started_at=time.monotonic())

    def _replace(self, worker: _Worker) -> None:
        _kill(worker)
        self._workers[self._workers.index(worker)] = self._spawn()

    def close(self) -> None:
        """Stop and reap every worker. Idempotent; later `score_samples` calls raise."""
        self._finalizer()

    def __enter__(self) -> RewardExecutor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def wait_ready(self) -> None:
        """Block until every worker has started (imports done), e.g. before the first timed step."""
        with self._lock:
            while any(not w.ready for w in self._workers):
                self._wait_and_collect(lambda *args, **kwargs: None)  # no tasks are in flight outside a call

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (they change when a hung worker is replaced)."""
        return [w.process.pid for w in self._workers]

    # -- scoring -----------------------------------------------------------------------------------------------

    def score_samples(self, samples: list[Sample]) -> RewardReport:
        """Set `sample.reward` on every sample (its reward, or `failure_value` on error / timeout); report counts.

        A sample not started because an earlier task of its adapter timed out or crashed gets None and is marked
        FAILED (see the module docstring). A sample whose generation FAILED or was ABORTED is not scored: it gets no
        reward (None) and counts nowhere in the report. A multi-turn episode (`sample.environment` set) already
        holds the reward its environment gave: without a RewardSpec it keeps it; with one, its reward function's
        score is added to it (a failed episode, whose reward is None, keeps None; a not started one gets None)."""
        episodes = {id(s): s.reward for s in samples if s.environment is not None}
        samples = [s for s in samples if s.environment is None or s.reward_spec is not None]
        report = self._score(samples)
        for s in samples:
            if id(s) in episodes:
                s.reward = None if episodes[id(s)] is None or s.reward is None else episodes[id(s)] + s.reward
        return report

    def _score(self, samples: list[Sample]) -> RewardReport:
        for i, sample in enumerate(samples):
            if not isinstance(sample.reward_spec, RewardSpec):
                raise ValueError(
                    f"samples[{i}].reward_spec={sample.reward_spec!r} is not allowed; allowed: a RewardSpec "
                    "(the data source stamps it on every sample)"
                )
        with self._lock:
            if not self._finalizer.alive:
                raise RuntimeError("RewardExecutor is closed")
            start = time.monotonic()
            report = RewardReport()
            outcomes: list[Outcome | None] = [
                ("unscored", "") if s.status in _NOT_GENERATED else None for s in samples
            ]
            self._run(self._make_tasks(samples, report, outcomes), samples, outcomes)
            self._apply(samples, outcomes, report)
            report.seconds = time.monotonic() - start
            return report

    def _resolve(self, spec: RewardSpec) -> RewardFn | RewardConfigError:
        if spec not in self._resolved:
            try:
                self._resolved[spec] = resolve(spec)
            except RewardConfigError as exc:
                self._resolved[spec] = exc
        return self._resolved[spec]

    def _make_tasks(self, samples: list[Sample], report: RewardReport, outcomes: list[Outcome | None]) -> list[_Task]:
        groups: dict[tuple[str, RewardSpec], list[int]] = {}
        for i, sample in enumerate(samples):
            if outcomes[i] is not None:  # its generation failed: nothing to score
                continue
            adapter = sample.adapter.name if sample.adapter is not None else ""
            report.samples[adapter] = report.samples.get(adapter, 0) + 1
            groups.setdefault((adapter, sample.reward_spec), []).append(i)
        tasks = []
        for (adapter, spec), ids in groups.items():
            fn = self._resolve(spec)
            if isinstance(fn, RewardConfigError):
                for i in ids:
                    outcomes[i] = ("error", format_exc(fn))
                continue
            if is_batched(fn):
                chunks = [ids]
            elif is_async(fn):
                chunks = [ids[k : k + self.async_concurrency] for k in range(0, len(ids), self.async_concurrency)]
            else:
                chunks = [[i] for i in ids]
            tasks.extend(_Task(next(self._task_ids), adapter, spec, chunk) for chunk in chunks)
        return tasks

    def _run(self, tasks: list[_Task], samples: list[Sample], outcomes: list[Outcome | None]) -> None:
        """Feed tasks to free workers until all are done, killing workers whose task passes its deadline."""
        queues: dict[str, deque[_Task]] = defaultdict(deque)
        for task in tasks:
            queues[task.adapter].append(task)
        in_flight: dict[str, int] = defaultdict(int)
        last_pick: dict[str, int] = {}
        picks = itertools.count()

        def finish(task: _Task, results: list[Outcome], started: bool = True) -> None:
            in_flight[task.adapter] -= started
            for i, outcome in zip(task.sample_ids, results, strict=True):
                outcomes[i] = outcome
            if started and results and results[0][0] == "crash":  # its worker died (see `_receive`)
                skip_rest(task.adapter, results[0][1])

        def skip_rest(adapter: str, message: str) -> None:
            """Drop the adapter's tasks still queued in this call without starting them; their samples stay unscored."""
            skipped = f"not started: an earlier call in this step: {message}"
            while queues[adapter]:
                rest = queues[adapter].popleft()
                finish(rest, [("skipped", skipped)] * len(rest.sample_ids), started=False)

        while any(queues.values()) or any(w.task is not None for w in self._workers):
            for worker in self._workers:
                while worker.ready and worker.task is None and any(queues.values()):
                    # the adapter with the fewest tasks in flight goes next; ties: the one served longest ago;
                    # one whose reward crashed a worker last time only when no other has a task queued
                    adapter = min(
                        (a for a, q in queues.items() if q),
                        key=lambda a: (a in self._crashed, in_flight[a], last_pick.get(a, -1)),
                    )
                    task = queues[adapter].popleft()
                    if not self._dispatch(worker, task, samples, finish):
                        queues[adapter].appendleft(task)  # that worker was dead; a fresh one is starting
                        break
                    last_pick[adapter] = next(picks)
                    in_flight[adapter] += worker.task is task
            self._wait_and_collect(finish)
            now = time.monotonic()
            for worker in list(self._workers):
                task = worker.task
                if task is None or task.deadline > now:
                    continue
                worker.task = None
                self._replace(worker)
                if task.importing:
                    message = (
                        f"reward {spec_label(task.spec)!r}: its module did not import within "
                        f"{_IMPORT_TIMEOUT_S:.0f} s; worker killed"
                    )
                else:
                    message = (
                        f"reward {spec_label(task.spec)!r} ran past timeout_s={task.spec.timeout_s}; worker killed"
                    )
                finish(task, [("timeout", message)] * len(task.sample_ids))
                skip_rest(task.adapter, message)

    def _wait_and_collect(self, finish: _Finish) -> None:
        """Block until a worker answers, a worker becomes ready, or the nearest task deadline passes."""
        busy = [w for w in self._workers if w.task is not None]
        starting = [w for w in self._workers if not w.ready]
        deadlines = [w.task.deadline for w in busy] + [w.started_at + _STARTUP_TIMEOUT_S for w in starting]
        if not deadlines:
            return
        ready = wait([w.conn for w in busy + starting], timeout=max(0.0, min(deadlines) - time.monotonic()))
        for worker in starting:
            if worker.conn in ready:
                try:
                    worker.conn.recv()  # ("ready", pid)
                    worker.ready = True
                    self._startup_failures = 0
                except (EOFError, OSError):
                    # killed while starting (replace it), unless workers keep dying: then the environment is broken
                    code = worker.process.wait()
                    self._startup_failures += 1
                    if self._startup_failures >= _MAX_STARTUP_FAILURES:
                        raise RuntimeError(
                            f"{self._startup_failures} reward workers in a row exited during startup (last exit "
                            f"code {code}); see their stderr"
                        ) from None
                    self._replace(worker)
            elif time.monotonic() > worker.started_at + _STARTUP_TIMEOUT_S:
                raise RuntimeError(f"reward worker did not start within {_STARTUP_TIMEOUT_S:.0f} s")
        for worker in busy:
            if worker.conn in ready:
                self._receive(worker, finish)

    def _dispatch(self, worker: _Worker, task: _Task, samples: list[Sample], finish: _Finish) -> bool:
        """Send `task` to an idle worker and start its clock (after the import, if the worker has yet to import the
        reward's module); False if the worker turned out to be dead."""
        items: list[Item] = [
            (s.prompt, s.response, s.label, dict(s.metadata)) for s in (samples[i] for i in task.sample_ids)
        ]
        try:
            worker.conn.send((task.task_id, list(sys.path), task.spec, items))
        except OSError:  # the worker died while idle (e.g. the OOM killer): not the tenant's fault, retry elsewhere
            self._replace(worker)
            return False
        except Exception as exc:  # unpicklable label or metadata: these samples fail, nothing was sent
            message = f"could not send samples to a reward worker: {format_exc(exc)}"
            finish(task, [("error", message)] * len(items), started=False)
            return True
        if task.spec in worker.imported:
            self._start_clock(task)
        else:  # `_receive` starts the clock when the worker reports the import done
            task.importing = True
            task.deadline = task.limit = time.monotonic() + _IMPORT_TIMEOUT_S
        worker.task = task
        return True

    def _start_clock(self, task: _Task) -> None:
        now = time.monotonic()
        task.importing = False
        if is_async(self._resolved[task.spec]):  # `_receive` moves the deadline on as the chunk progresses
            task.deadline = now + task.spec.timeout_s + _ASYNC_GRACE_S
            task.limit = now + task.spec.timeout_s * len(task.sample_ids) + _ASYNC_GRACE_S
        else:
            task.deadline = task.limit = now + task.spec.timeout_s

    def _receive(self, worker: _Worker, finish: _Finish) -> None:
        task = worker.task
        try:
            task_id, results = worker.conn.recv()
        except (EOFError, OSError):  # the worker died mid-task (os._exit, segfault, SIGKILL, OOM)
            worker.task = None
            try:
                # its socket closed as it exited: the status follows at once; this blocks every tenant, so not long
                code = worker.process.wait(0.25)
            except subprocess.TimeoutExpired:
                code = None  # it closed its socket but lives on: `_replace` kills it
            self._replace(worker)  # one respawn per death; it starts while the other workers keep working
            how = "closed its connection and was killed" if code is None else f"exit code {code}{_signal_name(code)}"
            died = f"reward {spec_label(task.spec)!r} crashed its worker ({how})"
            finish(task, [("crash", died)] * len(task.sample_ids))  # `_run` skips the adapter's queued tasks
            return
        if task_id != task.task_id:
            raise RuntimeError(f"reward worker answered task {task_id}, expected {task.task_id}")
        if results == "imported":  # the reward's module is imported: its timeout_s starts now
            worker.imported.add(task.spec)
            self._start_clock(task)
            return
        if results is None:  # a sample of its async chunk started or finished: the event loop is not blocked
            task.deadline = min(task.limit, time.monotonic() + task.spec.timeout_s + _ASYNC_GRACE_S)
            return
        worker.task = None
        finish(task, results)

    def _apply(self, samples: list[Sample], outcomes: list[Outcome | None], report: RewardReport) -> None:
        for sample, outcome in zip(samples, outcomes, strict=True):
            adapter = sample.adapter.name if sample.adapter is not None else ""
            status, value = outcome if outcome is not None else ("error", "no result")
            if status == "ok":
                sample.reward = float(value)
                continue
            if status == "unscored":  # its generation failed (see the module docstring)
                sample.reward = None
                continue
            report.last_error[adapter] = value
            if status == "skipped":  # never scored: not trained on (see the module docstring)
                sample.reward = None
                sample.status = SampleStatus.FAILED
                sample.metadata.setdefault("error", value)
                report.skipped[adapter] = report.skipped.get(adapter, 0) + 1
                continue
            sample.reward = float(sample.reward_spec.failure_value)
            sample.metadata.setdefault("reward_error", f"{status}: {value}")  # what a held-out evaluation counts
            counter = report.timeouts if status == "timeout" else report.errors
            counter[adapter] = counter.get(adapter, 0) + 1
            if status == "crash":
                report.crashes[adapter] = report.crashes.get(adapter, 0) + 1
        for adapter, n in report.samples.items():
            failed = report.errors.get(adapter, 0) + report.timeouts.get(adapter, 0)
            crashed = report.crashes.get(adapter, 0)
            skipped = report.skipped.get(adapter, 0)
            if crashed:
                self._crashed.add(adapter)
            else:
                self._crashed.discard(adapter)
            if failed + skipped == n or crashed:
                report.all_failed[adapter] = (
                    f"{failed}/{n} failed this step, {crashed} to a crash, {skipped} not started; "
                    f"last: {report.last_error[adapter]}"
                )


def _signal_name(code: int | None) -> str:
    """The signal's name after a comma for a worker killed by one (exit code -9: ", SIGKILL"), else nothing."""
    if code is None or code >= 0:
        return ""
    try:
        return f", {signal.Signals(-code).name}"
    except ValueError:
        return ""
