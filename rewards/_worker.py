"""Reward worker process, started by `RewardExecutor` as `python -c "from rewards._worker import main; ..."`.

Protocol on the socket (multiprocessing `Connection`, pickle between our own processes only):
the worker first sends ("ready", pid); then for each (task_id, sys_path, spec, items) it answers
(task_id, outcomes), one ("ok", reward) | ("error", message) | ("timeout", message) per item; None ends it.
While it runs an `async def` reward's chunk it also sends (task_id, None) each time one of the chunk's samples
starts or finishes, so the executor can tell a chunk that makes progress from an event loop blocked for good.

The worker is a fresh interpreter (fork + exec) rather than a multiprocessing child: it is safe next to torch's
threads like "spawn", and unlike spawn/forkserver it never re-imports the parent's `__main__` (an unguarded
script would re-run, and a training script would import torch into every worker). A watchdog thread exits the
worker when its parent is gone, even if a reward hangs the main thread.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

Item = tuple[str, str, Any, dict[str, Any]]  # (prompt, response, label, metadata); rewards.registry.Item
Outcome = tuple[str, Any]


def format_exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


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
        except Exception as exc:
            return ("error", format_exc(exc))
        finally:
            expiry.cancel()
            progress()  # a sample finished

    return list(await asyncio.gather(*(one(item) for item in items)))


def run_task(
    spec: Any, items: list[Item], resolved: dict[Any, Any], progress: Callable[[], None] = lambda: None
) -> list[Outcome]:
    """Score one task; every failure becomes an outcome, nothing escapes.

    A per-sample sync reward is called once per item with its own try, so one bad item costs one sample;
    `async def` rewards run concurrently in one event loop, each cancelled `timeout_s` after it starts running,
    and `progress()` is called each time one starts or finishes (the executor then keeps the worker); a batched
    reward is one call, so a call that raises fails all its items, but each value it returns is checked on its own:
    a bad one (NaN, None) costs its own sample, with its index in the message.
    """
    from rewards.registry import call_reward, check_reward, is_async, is_batched, resolve, reward_values

    try:
        if spec not in resolved:
            resolved[spec] = resolve(spec)
        fn = resolved[spec]
        if is_batched(fn):
            values = reward_values(fn, spec, items)  # one value per item, or it raised
        elif is_async(fn):
            return asyncio.run(_run_async_chunk(fn, spec, items, progress))
    except Exception as exc:
        return [("error", format_exc(exc))] * len(items)
    if is_batched(fn):
        return [_outcome(check_reward, fn, spec, items[k], value, k) for k, value in enumerate(values)]
    return [_outcome(lambda item: call_reward(fn, spec, [item])[0], item) for item in items]


def _outcome(score: Callable[..., float], *args: Any) -> Outcome:
    """("ok", score(*args)), or ("error", message) if it raises."""
    try:
        return ("ok", score(*args))
    except Exception as exc:
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
    home = (os.getcwd(), dict(os.environ))  # every task starts from these, whichever tenant's reward ran before
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
        outcomes = run_task(spec, items, resolved, progress)
        _restore(*home)
        conn.send((task_id, outcomes))


def _restore(cwd: str, environ: dict[str, str]) -> None:
    """Undo what a reward changed of the process that the next task (maybe another tenant's) would see: the working
    directory (rewards that run code often chdir into a scratch directory, then relative paths of the next tenant's
    reward broke) and the environment variables."""
    try:
        moved = os.getcwd() != cwd
    except OSError:  # it chdir'd into a directory it then removed
        moved = True
    if moved:
        os.chdir(cwd)
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
