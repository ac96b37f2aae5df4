"""Reward worker process, started by `RewardExecutor` as `python -c "from rewards._worker import main; ..."`.

Protocol on the socket (multiprocessing `Connection`, pickle between our own processes only):
the worker first sends ("ready", pid); then for each (task_id, sys_path, spec, items) it answers
(task_id, outcomes), one ("ok", reward) | ("error", message) | ("timeout", message) per item; None ends it.
The first task of a spec imports its module first (`import torch` or loading a judge may take a minute) and then
sends (task_id, "imported"): the executor starts the task's `timeout_s` clock there, not at dispatch.
While it runs an `async def` reward's chunk it also sends (task_id, None) each time one of the chunk's samples
starts or finishes, so the executor can tell a chunk that makes progress from an event loop blocked for good.

The worker is a fresh interpreter (fork + exec) rather than a multiprocessing child: it is safe next to torch's
threads like "spawn", and unlike spawn/forkserver it never re-imports the parent's `__main__` (an unguarded
script would re-run, and a training script would import torch into every worker). A watchdog thread exits the
worker when its parent is gone, even if a reward hangs the main thread.

Workers are shared by tenants, so after each task the worker puts back what a reward may leave changed in the
process (`_Home`): working directory, environment, pending alarms and timers, signal handlers and mask, warning
filters, recursion limit, umask, stdout/stderr, the default socket timeout. State a reward module sets at import
is undone the same way after its first task. What cannot be undone cheaply (threads a reward started, modules it
patched) stays.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

Item = tuple[str, str, Any, dict[str, Any]]  # (prompt, response, label, metadata); rewards.registry.Item
Outcome = tuple[str, Any]


def format_exc(exc: BaseException) -> str:
    """`Type: message` of a reward's exception. Its `__str__` is user code too: if that raises, only the message is
    lost, not the worker (which would be charged as a crash)."""
    if isinstance(exc, SystemExit):
        return f"SystemExit: the reward called sys.exit({exc.code!r})"
    try:
        message = str(exc)
    except Exception as str_exc:  # noqa: BLE001 - whatever the user's __str__ raises
        message = f"<str() of the exception raised {type(str_exc).__name__}>"
    return f"{type(exc).__name__}: {message}"


async def _run_async_chunk(fn: Any, spec: Any, items: list[Item], progress: Callable[[], None]) -> list[Outcome]:
    from rewards.registry import acall_reward, spec_label

    async def one(item: Item) -> Outcome:
        progress()  # a sample started
        # Its own clock starts now, not when the chunk did: sync work inside an `async def` holds the event loop, so
        # a chunk's samples may start one after another. (`asyncio.wait_for` starts its clock where it is called
        # and, before Python 3.12, runs the reward in a task of its own that starts later.)
        loop = asyncio.get_running_loop()
        expiry = loop.call_later(spec.timeout_s, asyncio.current_task().cancel)
        try:
            return ("ok", await acall_reward(fn, spec, item))
        except asyncio.CancelledError as exc:
            if loop.time() >= expiry.when():  # its clock ran out
                return ("timeout", f"reward {spec_label(spec)!r} ran past timeout_s={spec.timeout_s}")
            return ("error", format_exc(exc))  # the reward's own (it awaited something cancelled)
        except (Exception, SystemExit) as exc:  # sys.exit() in a reward too: that sample's error, the worker stays
            return ("error", format_exc(exc))
        finally:
            expiry.cancel()
            progress()  # a sample finished

    return list(await asyncio.gather(*(one(item) for item in items)))


def run_task(
    spec: Any,
    items: list[Item],
    resolved: dict[Any, Any],
    progress: Callable[[], None] = lambda: None,
    imported: Callable[[], None] = lambda: None,
) -> list[Outcome]:
    """Score one task; every failure becomes an outcome (`sys.exit()` in a reward too), nothing escapes.

    A per-sample sync reward is called once per item with its own try, so one bad item costs one sample;
    `async def` rewards run concurrently in one event loop, each cancelled `timeout_s` after it starts running,
    and `progress()` is called each time one starts or finishes (the executor then keeps the worker); `imported()`
    is called once `spec`'s module is imported for the first time, before its reward runs; a batched
    reward is one call, so a call that raises fails all its items, but each value it returns is checked on its own:
    a bad one (NaN, None) costs its own sample, with its index in the message.
    """
    from rewards.registry import call_reward, check_reward, is_async, is_batched, resolve, reward_values

    try:
        if spec not in resolved:
            resolved[spec] = resolve(spec)
            imported()
        fn = resolved[spec]
        if is_batched(fn):
            values = reward_values(fn, spec, items)  # one value per item, or it raised
        elif is_async(fn):
            return asyncio.run(_run_async_chunk(fn, spec, items, progress))
    except (Exception, SystemExit) as exc:
        return [("error", format_exc(exc))] * len(items)
    if is_batched(fn):
        return [_outcome(check_reward, fn, spec, items[k], value, k) for k, value in enumerate(values)]
    return [_outcome(lambda item: call_reward(fn, spec, [item])[0], item) for item in items]


def _outcome(score: Callable[..., float], *args: Any) -> Outcome:
    """("ok", score(*args)), or ("error", message) if it raises."""
    try:
        return ("ok", score(*args))
    except (Exception, SystemExit) as exc:
        return ("error", format_exc(exc))


def _exit_when_orphaned(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)  # the executor died without closing us; a hung reward must not keep us alive


def main(fd: int, parent_pid: int) -> None:
    conn = Connection(socket.socket(fileno=fd).detach())
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    import rewards  # noqa: F401 - registers the built-ins before the first task

    try:
        import math_verify  # noqa: F401 - warm the sympy import here instead of inside the first timed task
    except ImportError:
        pass
    conn.send(("ready", os.getpid()))
    home = _Home.capture()  # every task starts from it, whichever tenant's reward ran before
    resolved: dict[Any, Any] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task_id, sys_path, spec, items = msg
        if sys.path != sys_path:  # import custom rewards exactly as the parent would
            sys.path[:] = sys_path
        progress = functools.partial(conn.send, (task_id, None))
        imported = functools.partial(conn.send, (task_id, "imported"))
        with warnings.catch_warnings():  # a reward's simplefilter("error") ends with its task
            outcomes = run_task(spec, items, resolved, progress, imported)
        home.restore()
        conn.send((task_id, outcomes))


# Timers a reward may leave armed (a hand-rolled `signal.alarm` timeout whose success path forgets `alarm(0)`): they
# would fire during the next tenant's reward and kill the worker, charged to that tenant.
_TIMERS = (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)


@dataclass
class _Home:
    """The process state every task starts from. Rewards change it (a code-running reward chdirs into a scratch
    directory, a hand-rolled timeout installs a SIGALRM handler, a noisy one redirects stdout), and the next task may
    be another tenant's: its reward must not see any of it."""

    cwd: str
    environ: dict[str, str]
    handlers: dict[signal.Signals, Any]  # the handlers Python knows of (getsignal is None for the others)
    sigmask: set[signal.Signals]
    recursion_limit: int
    umask: int
    stdout: Any
    stderr: Any
    socket_timeout: float | None

    @classmethod
    def capture(cls) -> _Home:
        handlers = {sig: signal.getsignal(sig) for sig in signal.valid_signals()}
        umask = os.umask(0o022)
        os.umask(umask)
        return cls(
            cwd=os.getcwd(),
            environ=dict(os.environ),
            handlers={sig: h for sig, h in handlers.items() if h is not None},
            sigmask=signal.pthread_sigmask(signal.SIG_BLOCK, []),
            recursion_limit=sys.getrecursionlimit(),
            umask=umask,
            stdout=sys.stdout,
            stderr=sys.stderr,
            socket_timeout=socket.getdefaulttimeout(),
        )

    def restore(self) -> None:
        """Put the process back as `capture` found it (each part only if it changed; all of it takes microseconds)."""
        for timer in _TIMERS:  # first, so that nothing fires while the handlers go back
            signal.setitimer(timer, 0)  # `signal.alarm` is ITIMER_REAL
        for sig, handler in self.handlers.items():
            if signal.getsignal(sig) is not handler:
                try:
                    signal.signal(sig, handler)
                except (OSError, ValueError):  # SIGKILL / SIGSTOP and the like cannot be set
                    pass
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        if blocked != self.sigmask:
            pending = signal.sigpending() & (blocked - self.sigmask)
            if pending:  # a signal held while blocked would be delivered on unblocking: drop it
                for _ in pending:
                    signal.sigtimedwait(pending, 0)
            signal.pthread_sigmask(signal.SIG_SETMASK, self.sigmask)
        try:
            moved = os.getcwd() != self.cwd
        except OSError:  # it chdir'd into a directory it then removed
            moved = True
        if moved:
            os.chdir(self.cwd)
        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
            time.tzset()  # in case it was TZ
        if sys.getrecursionlimit() != self.recursion_limit:
            sys.setrecursionlimit(self.recursion_limit)
        os.umask(self.umask)
        sys.stdout, sys.stderr = self.stdout, self.stderr
        socket.setdefaulttimeout(self.socket_timeout)
