"""Tests for what a reward may do to its worker process: import slowly, change process state another tenant's
reward would see, exit, raise an exception that cannot be printed; and for what is never sent to a reward (samples
whose generation failed) or never accepted as one (a class).

The rewards here are written to a temporary module per test session, so each can misbehave in its own way at import
as well as when called; the executor sends `sys.path` to its workers, which then import them by the same path.
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from rewards import RewardConfigError, RewardExecutor, validate
from rewards._worker import run_task
from rollout.types import AdapterRef, RewardSpec, Sample, SampleStatus

PLUGINS = "rewards_worker_plugins"
# Sleeps at import in the reward workers only (the parent's pid is written in): the parent imports it to learn its
# shape, which is not what the test times.
SLOW_IMPORT_S = 0.8

MODULES = {
    PLUGINS: '''
        import io, signal, socket, sys, time, warnings

        def ok(prompt, response, label, metadata):
            return 1.0

        def hang(prompt, response, label, metadata):
            while True:
                time.sleep(0.01)

        def messes_up(prompt, response, label, metadata):
            """A hand-rolled per-call timeout whose success path forgets to disarm it, and more process state."""
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
            warnings.simplefilter("error")
            sys.setrecursionlimit(300)
            sys.stdout = io.StringIO()
            socket.setdefaulttimeout(0.01)
            return 1.0

        def inspects(prompt, response, label, metadata):
            """A well-behaved reward: fine in a fresh worker, and it must stay fine after `messes_up` ran there."""
            time.sleep(0.4)  # past the timer `messes_up` left armed
            warnings.warn("harmless", DeprecationWarning)
            leaks = {
                "SIGUSR1 handler": signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN,
                "recursion limit": sys.getrecursionlimit() == 300,
                "stdout": isinstance(sys.stdout, io.StringIO),
                "socket timeout": socket.getdefaulttimeout() is not None,
            }
            if any(leaks.values()):
                raise AssertionError(f"left by another reward: {[k for k, v in leaks.items() if v]}")
            return 1.0

        class Unprintable(Exception):
            def __str__(self):
                raise RuntimeError("str broken")

        def unprintable(prompt, response, label, metadata):
            raise Unprintable()

        def exits(prompt, response, label, metadata):
            sys.exit(3)

        def raises_on_empty(prompt, response, label, metadata):
            if not response:
                raise ValueError("no answer in an empty response")
            return 1.0

        class ClassReward:
            def __init__(self, prompt, response, label, metadata):
                pass

        class Judge:
            def __call__(self, prompt, response, label, metadata):
                return 0.5

        judge = Judge()
    ''',
    f"{PLUGINS}_slow": f"""
        import os, time

        if os.getpid() != {os.getpid()}:
            time.sleep({SLOW_IMPORT_S})  # `import torch`, loading a judge

        def score(prompt, response, label, metadata):
            return 1.0
    """,
    f"{PLUGINS}_argv": """
        import argparse

        parser = argparse.ArgumentParser()
        parser.add_argument("--data", required=True)
        ARGS = parser.parse_args(["--no-such-flag"])  # a training script that also defines the reward

        def score(prompt, response, label, metadata):
            return 1.0
    """,
}


@pytest.fixture(scope="module", autouse=True)
def plugins_on_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reward_plugins")
    for name, source in MODULES.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(source))
    sys.path.insert(0, str(folder))
    yield
    sys.path.remove(str(folder))
    for name in MODULES:
        sys.modules.pop(name, None)


def spec(name: str, module: str = PLUGINS, **kwargs) -> RewardSpec:
    return RewardSpec(path=f"{module}:{name}", **kwargs)


def make_samples(adapter: str, spec: RewardSpec, n: int, response: str = "x") -> list[Sample]:
    return [
        Sample(prompt="p", response=response, label="4", adapter=AdapterRef(adapter, 0), reward_spec=spec)
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def one_worker():
    with RewardExecutor(num_workers=1) as ex:  # one worker: every task runs in the process the one before ran in
        ex.wait_ready()
        yield ex


def test_a_module_slower_to_import_than_timeout_s_still_scores():
    """Its import used to run inside the first task's `timeout_s`: it timed out, the worker was replaced by a fresh
    one that imported again inside the next task, for ever, and the tenant FAILED without one scored sample."""
    slow = spec("score", f"{PLUGINS}_slow", timeout_s=0.3)
    with RewardExecutor(num_workers=1) as ex:
        ex.wait_ready()
        samples = make_samples("slow", slow, 2)
        report = ex.score_samples(samples)
        assert [s.reward for s in samples] == [1.0, 1.0], report.last_error
        assert report.timeouts == {} and report.seconds >= SLOW_IMPORT_S  # the import ran in the worker

        # Another tenant's timeout replaces the worker; the fresh one imports the slow module again, untimed.
        report = ex.score_samples(make_samples("hung", spec("hang", timeout_s=0.3), 1))
        assert report.timeouts == {"hung": 1} and report.seconds < 0.3 + 2.0  # timed from after its (fast) import
        samples = make_samples("slow", slow, 2)
        report = ex.score_samples(samples)
        assert [s.reward for s in samples] == [1.0, 1.0], report.last_error
        assert report.timeouts == {}


def test_a_reward_leaves_nothing_armed_or_changed_for_the_next_tenants_reward(one_worker):
    """Tenant A's leftover timer used to kill the worker during tenant B's reward (charged to B as a crash), and
    its `warnings.simplefilter("error")` turned B's DeprecationWarning into B's error."""
    for _ in range(2):
        a = make_samples("a", spec("messes_up"), 1)
        assert one_worker.score_samples(a).errors == {}
        b = make_samples("b", spec("inspects", timeout_s=5.0), 1)
        report = one_worker.score_samples(b)
        assert b[0].reward == 1.0 and report.errors == {} and report.crashes == {}, report.last_error


def test_an_exception_that_cannot_be_printed_or_sys_exit_costs_one_sample(one_worker):
    """An exception whose `__str__` raises used to kill the worker (charged as a crash, the tenant's other samples
    not started); `sys.exit(3)` in a reward did too, and the message did not always say its code."""
    pid = one_worker.worker_pids[0]
    unprintable = make_samples("unprintable", spec("unprintable"), 2)
    exits = make_samples("exits", spec("exits"), 2)
    report = one_worker.score_samples(unprintable + exits)
    assert [s.reward for s in unprintable + exits] == [0.0] * 4
    assert report.errors == {"unprintable": 2, "exits": 2} and report.crashes == {} and report.skipped == {}
    assert unprintable[0].metadata["reward_error"].startswith("error: Unprintable: <str() of the exception raised")
    assert "sys.exit(3)" in exits[0].metadata["reward_error"]
    assert one_worker.worker_pids == [pid]  # the same worker goes on

    # the same in process, where the worker calls it
    items = [("p", "x", "4", {})]
    assert run_task(spec("unprintable"), items, {})[0][1].startswith("Unprintable: ")
    assert run_task(spec("exits"), items, {}) == [("error", "SystemExit: the reward called sys.exit(3)")]


def test_a_module_that_exits_at_import_is_a_config_error_naming_the_path(one_worker):
    """argparse at the top of a module used to end the whole run with its usage text, out of `validate`."""
    argv = spec("score", f"{PLUGINS}_argv")
    with pytest.raises(RewardConfigError) as info:
        validate(argv)
    assert f"reward.path: '{PLUGINS}_argv:score'" in str(info.value) and "SystemExit(2)" in str(info.value)
    samples = make_samples("argv", argv, 2)  # unvalidated, at scoring: its own samples fail, not the call
    report = one_worker.score_samples(samples)
    assert report.errors == {"argv": 2} and "SystemExit(2)" in report.last_error["argv"]


def test_samples_whose_generation_failed_are_not_scored_nor_counted(one_worker):
    """They used to be sent to the reward (an empty response: it raised) and counted as reward errors, so engine
    aborts failed the tenant as "reward failing". They get no reward and the trainer leaves them out."""
    from rl_multilora.batch import build_batch

    raising = spec("raises_on_empty")
    samples = make_samples("gen", raising, 4, response="")
    samples[0].response = "an answer"
    samples[0].status = SampleStatus.COMPLETED
    samples[1].status = samples[2].status = SampleStatus.ABORTED
    samples[3].status = SampleStatus.FAILED
    aborted = make_samples("all_aborted", raising, 2, response="")
    for s in aborted:
        s.status = SampleStatus.ABORTED
    report = one_worker.score_samples(samples + aborted)
    assert [s.reward for s in samples + aborted] == [1.0] + [None] * 5
    assert report.errors == {} and report.all_failed == {} and report.samples == {"gen": 1}
    assert [s.status for s in samples[1:]] == [SampleStatus.ABORTED, SampleStatus.ABORTED, SampleStatus.FAILED]

    for s in samples:  # as the rollout leaves them
        s.prompt_ids, s.response_ids = [1, 2], [3] if s.response else []
    stats = build_batch(samples, drop_uniform_groups=False).stats["gen"]
    assert stats.error is None and stats.excluded == 3 and stats.n_rows == 1


def test_a_class_is_refused_as_a_reward_but_a_callable_instance_is_not():
    with pytest.raises(RewardConfigError, match=r"reward.path: '.*:ClassReward' names the class 'ClassReward'"):
        validate(spec("ClassReward"))
    validate(spec("judge"))
    items = [("p", "x", "4", {})]
    assert run_task(spec("judge"), items, {}) == [("ok", 0.5)]
