"""Environments for tests/test_environments.py, loaded by import path as users' environments are."""

from __future__ import annotations

import asyncio
import time

from rollout.environments import Environment, EnvStep, ToolEnv


class Echo(Environment):
    """Answers every turn with a fixed user message; done after `turns` model turns, reward 0.25 per turn plus 1
    when the model's last turn held a digit."""

    def __init__(self, turns: int = 3, reply: str = "again"):
        self.turns, self.reply, self.seen = turns, reply, 0

    def reset(self, task):
        self.seen = 0

    def step(self, action: str) -> EnvStep:
        self.seen += 1
        if self.seen >= self.turns:
            return EnvStep(reward=0.25 + float(any(c.isdigit() for c in action)), done=True)
        return EnvStep(observation=[{"role": "user", "content": self.reply}], reward=0.25)


class AsyncEcho(Echo):
    async def step(self, action: str) -> EnvStep:
        await asyncio.sleep(0)
        return Echo.step(self, action)


class Raising(Environment):
    def step(self, action: str) -> EnvStep:
        raise RuntimeError("environment bug")


class Hanging(Environment):
    def step(self, action: str) -> EnvStep:
        time.sleep(3600)  # never returns in a test's time: abandoned in its thread
        return EnvStep(done=True)


class AsyncHanging(Environment):
    async def step(self, action: str) -> EnvStep:
        await asyncio.sleep(3600)
        return EnvStep(done=True)


class Exiting(Environment):
    def step(self, action: str) -> EnvStep:
        raise SystemExit(3)  # a library that calls sys.exit


class AsyncExiting(Environment):
    async def step(self, action: str) -> EnvStep:
        raise SystemExit(3)


class AsyncCancelled(Environment):
    async def step(self, action: str) -> EnvStep:
        raise asyncio.CancelledError()  # awaiting something a library cancelled: not the episode's cancellation


class ExitingInit(Environment):
    def __init__(self):
        raise KeyboardInterrupt("from the constructor")

    def step(self, action: str) -> EnvStep:
        return EnvStep(done=True)


class SlowInit(Environment):
    """A constructor that blocks (connects to a sandbox, loads a file)."""

    def __init__(self, delay: float = 3.0):
        time.sleep(delay)

    def step(self, action: str) -> EnvStep:
        return EnvStep(reward=1.0, done=True)


class DrawsFromItsDeck(Environment):
    """Keeps its `deck` kwarg and draws from it: episodes must share no state through their kwargs."""

    def __init__(self, deck=()):
        self.deck = deck

    def step(self, action: str) -> EnvStep:
        return EnvStep(reward=float(self.deck.pop(0)), done=True)


class NeverDone(Environment):
    def step(self, action: str) -> EnvStep:
        return EnvStep(observation=[{"role": "user", "content": "more"}], reward=0.1)


class Garbage(Environment):
    def step(self, action: str):
        return {"reward": 1.0}


class NaNReward(Environment):
    def step(self, action: str) -> EnvStep:
        return EnvStep(reward=float("nan"), done=True)


class Calculator(ToolEnv):
    """Tools: add(a, b); the final answer (a turn without a call) scores 1 when it equals the label."""

    def tools(self):
        return {"add": lambda a, b: a + b}

    def answer(self, text: str) -> float:
        return float(text.strip() == str(self.task.label))


class GatedEcho(Echo):
    """Echo whose first step holds until `release` is set (`entered` says it got there): a test publishes a new
    adapter version while the episode waits between turns."""

    import threading as _threading

    entered = _threading.Event()
    release = _threading.Event()

    async def step(self, action: str) -> EnvStep:
        if self.seen == 0:
            GatedEcho.entered.set()
            while not GatedEcho.release.is_set():
                await asyncio.sleep(0.01)
        return Echo.step(self, action)


class DoneString(Environment):
    def step(self, action: str) -> EnvStep:  # "False" is truthy: it ended every episode after one turn, silently
        return EnvStep(observation=[{"role": "user", "content": "again"}], reward=1.0, done="False")


class ObsString(Environment):
    def step(self, action: str) -> EnvStep:
        return EnvStep(observation="try again")


class ResetReturnsObs(Environment):
    """A gymnasium port: reset returns (observation, info), which the episode would drop."""

    def reset(self, task):
        return "Welcome! The rules: ...", {}

    def step(self, action: str) -> EnvStep:
        return EnvStep(reward=1.0, done=True)


class NumpyDone(Environment):
    def step(self, action: str) -> EnvStep:
        import numpy as np

        return EnvStep(reward=np.float32(0.5), done=np.bool_(True))


class NoStep(Environment):
    """Overrides nothing: every episode would fail with an empty NotImplementedError."""


class CloseRaises(Environment):
    def step(self, action: str) -> EnvStep:
        return EnvStep(reward=1.0, done=True)

    def close(self):
        raise RuntimeError("close boom")


class ResetReturnsTrue(Environment):
    def reset(self, task):
        return True  # no observation in it: ignored, as before

    def step(self, action: str) -> EnvStep:
        return EnvStep(reward=1.0, done=True)


class BindsTheLoop(Environment):
    """An async environment whose constructor binds the loop it is built on (as an episode builds it)."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()

    async def step(self, action: str) -> EnvStep:
        return EnvStep(reward=1.0, done=True)
