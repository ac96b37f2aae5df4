"""TextArena games as tenants: `dataset: {source: textarena, task: GuessTheNumber-v0}` and this module's environment.

```yaml
dataset: {source: textarena, task: GuessTheNumber-v0, config: {max_turns: 5}, seed: 0, size: 500, test_size: 50}
environment: {path: rollout.textarena_env:TextArenaEnvironment, max_turns: 6}
```

Design choices:
- A row is one game: `task` (a textarena env id, made with `textarena.make(task, **config)`, its registered wrappers
  included) and a seed, a fresh game object for each (textarena's observation wrappers keep their history across
  resets). Rows `0 .. size-1` are seeds `seed .. seed+size-1` (train), the next `test_size` seeds the
  test split. The row's prompt is the game's first observation after `reset(num_players=1, seed=...)`, so the first
  model turn reads exactly what the game shows; the environment replays the same reset and checks that it does.
- Each model turn is the game's action (`env.step(text)`, the game's own parsing and action wrappers); the next user
  message is what the game's observation adds to what the model already read: textarena's LLM observation wrappers
  return the whole history every turn, so the part after the previous observation is sent, or the whole observation
  when it does not extend the previous one (wrappers that redraw a board).
- The episode's reward is the game's: `rewards[0]` of `env.close()` when the game says done (a win, a loss, the
  game's own turn limit, too many invalid moves). Single-player games only (`num_players=1`).
- textarena seeds and draws from Python's global `random` module; every call into a game holds one lock and restores
  the global random state afterwards, so concurrent episodes neither race on it nor disturb the rest of the process.
- textarena is optional (the `textarena` extra) and imported only when such a dataset or environment is used.
"""

from __future__ import annotations

import contextlib
import difflib
import random
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from rl_multilora.errors import bad_value
from rollout.environments import Environment, EnvStep, Task

SPLITS = ("train", "test")
ENVIRONMENT_PATH = "rollout.textarena_env:TextArenaEnvironment"  # a tenant's `environment.path` for these rows
NO_ANSWER = "(a game: its own reward decides)"
_GAMES = threading.Lock()


@contextlib.contextmanager
def _game_call(own: dict[str, Any] | None = None) -> Iterator[None]:
    """One call into a textarena game: serialized, the global random state as it was before. textarena games draw
    from the global `random` (2048's new tiles, dice) and seed it in `reset`: `own` holds one game's stream
    between its calls (its state after the seeded reset, then after each step), so a row's seed fixes its game
    whatever else drew in between."""
    with _GAMES:
        outside = random.getstate()
        if own is not None and "random" in own:
            random.setstate(own["random"])
        try:
            yield
        finally:
            if own is not None:
                own["random"] = random.getstate()
            random.setstate(outside)


def make_game(task: str, config: Mapping[str, Any] | None):
    """`textarena.make(task, **config)`, every failure a ValueError naming the dataset field at fault."""
    try:
        import textarena as ta
        from textarena.envs.registration import ENV_REGISTRY
    except ImportError as exc:
        raise ValueError(
            bad_value("dataset.source", "textarena", 'the textarena package: pip install -e ".[textarena]"')
            + f" ({exc})"
        ) from exc
    if task not in ENV_REGISTRY:
        close = difflib.get_close_matches(task, ENV_REGISTRY, n=3)
        hint = f"did you mean {', '.join(map(repr, close))}? " if close else ""
        raise ValueError(bad_value("dataset.task", task, f"a textarena env id ({hint}{len(ENV_REGISTRY)} registered)"))
    try:
        with _game_call():
            return ta.make(task, **dict(config or {}))
    except Exception as exc:  # noqa: BLE001 - a game's constructor raises TypeError, AssertionError, ...
        raise ValueError(
            bad_value("dataset.config", config, f"arguments {task} accepts ({type(exc).__name__}: {exc})")
        ) from exc


def _reset(game, seed: int, own: dict[str, Any] | None = None) -> str:
    """Start `game` with `seed` (one player); its first observation. `own`: the game's random stream (`_game_call`)."""
    with _game_call(own):
        try:
            game.reset(num_players=1, seed=seed)
        except AssertionError as exc:  # textarena's players-count checks
            raise ValueError(
                bad_value("dataset.task", getattr(game, "env_id", game), f"a single-player game ({exc})")
            ) from exc
        _, observation = game.get_observation()
    return _text(observation)


def _text(observation: Any) -> str:
    if isinstance(observation, str):
        return observation.strip()
    # raw games (the `-raw` ids) give (sender, message, type) tuples
    return "\n".join(str(m[1]) if isinstance(m, tuple | list) and len(m) > 1 else str(m) for m in observation).strip()


def generate_rows(
    task: str, config: Mapping[str, Any] | None, seed: int, size: int, test_size: int, split: str
) -> list[dict[str, Any]]:
    """The games of `split`: one row per seed, its prompt the game's first observation."""
    if split not in SPLITS:
        raise ValueError(bad_value("dataset.split", split, "train or test (the generated splits)"))
    if split == "test" and test_size == 0:
        raise ValueError(bad_value("dataset.split", split, "train, or set dataset.test_size >= 1 for a test split"))
    seeds = range(seed, seed + size) if split == "train" else range(seed + size, seed + size + test_size)
    meta = {"task": task, "config": dict(config or {})}
    # A fresh game per seed: textarena's observation wrappers keep their history across resets.
    return [
        {
            "prompt": _reset(make_game(task, config), s),
            "label": NO_ANSWER,
            "metadata": {"textarena": {**meta, "seed": s}},
        }
        for s in seeds
    ]


class TextArenaEnvironment(Environment):
    """One game of the row's textarena env (a `source: textarena` dataset row), played to the game's end."""

    def reset(self, task: Task) -> None:
        meta = task.metadata.get("textarena") if isinstance(task.metadata, Mapping) else None
        if not isinstance(meta, Mapping):
            raise ValueError(
                "row metadata has no 'textarena' entry; allowed: rows of a dataset with source: textarena"
            )
        self.game = make_game(meta["task"], meta["config"])
        self.random: dict[str, Any] = {}  # the game's own random stream, from its seeded reset on
        self.seen = _reset(self.game, meta["seed"], self.random)
        if self.seen not in task.prompt:
            raise ValueError("the game's first observation is not the row's prompt (a game that is not seeded?)")

    def step(self, action: str) -> EnvStep:
        with _game_call(self.random):
            done, _ = self.game.step(action)
            if done:
                rewards = self.game.close()
                rewards = rewards[0] if isinstance(rewards, tuple) else rewards  # (rewards, game_info) since 0.7
                return EnvStep(reward=float(rewards[0]), done=True)
            _, observation = self.game.get_observation()
        text = _text(observation)
        new = text[len(self.seen) :].strip() if text.startswith(self.seen) else text
        self.seen = text
        return EnvStep(observation=[{"role": "user", "content": new or text}])
