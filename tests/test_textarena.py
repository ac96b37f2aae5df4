"""TextArena games as tenants (rollout/textarena_env.py): the rows are the games' first observations, a game played on
our engine runs to the game's own end, and its reward is what textarena gives for the same moves."""

from __future__ import annotations

import random

import pytest

ta = pytest.importorskip("textarena", reason='textarena is an optional extra: pip install -e ".[textarena]"')

from rollout.data_source import DatasetError, DatasetSpec, MultiLoRADataSource, load_dataset_rows  # noqa: E402
from rollout.engines.embedded import EmbeddedEngine  # noqa: E402
from rollout.generate_state import GenerateState, MultiLoRAHooks, observation_ids  # noqa: E402
from rollout.textarena_env import ENVIRONMENT_PATH, generate_rows  # noqa: E402
from rollout.types import AdapterRef, EnvironmentSpec, SampleStatus, SamplingParams  # noqa: E402
from tests.tiny_models import EOS_ID, ScriptedEngine, tiny_config, tiny_tokenizer  # noqa: E402

GAME, CONFIG = "GuessTheNumber-v0", {"max_turns": 3}
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=6)


def _library_game(seed: int):
    game = ta.make(GAME, **CONFIG)
    game.reset(num_players=1, seed=seed)
    return game


def _library_play(seed: int, actions: list[str]) -> tuple[float, int]:
    """textarena's own loop over `actions`: the reward it gives and how many actions it took to end."""
    game = _library_game(seed)
    for n, action in enumerate(actions, 1):
        game.get_observation()
        done, _ = game.step(action)
        if done:
            rewards, _ = game.close()
            return rewards[0], n
    raise AssertionError(f"the game did not end after {len(actions)} actions")


def _groups(tok, *, prompts=2, n=2, split="train", seed=5):
    source = MultiLoRADataSource(tok)
    source.add_adapter(
        AdapterRef("game", 0),
        DatasetSpec(source="textarena", task=GAME, config=CONFIG, seed=seed, size=6, test_size=2, split=split),
        None,
        seed=0,
        prompts_per_step=prompts,
        n_samples_per_prompt=n,
        environment=EnvironmentSpec(path=ENVIRONMENT_PATH, max_turns=12, max_tokens=2000),
    )
    return source.next_groups(["game"])["game"]


def _model_turns(tok, sample) -> list[str]:
    turns, current = [], []
    for token, keep in zip(sample.response_ids, sample.loss_mask, strict=True):
        if keep:
            current.append(token)
        elif current:
            turns.append(current)
            current = []
    return [tok.decode(ids, skip_special_tokens=True) for ids in [*turns, current] if ids]


def test_rows_are_the_games_first_observations_one_seed_each():
    train = generate_rows(GAME, CONFIG, 5, 6, 2, "train")
    test = generate_rows(GAME, CONFIG, 5, 6, 2, "test")
    assert [r["metadata"]["textarena"]["seed"] for r in train + test] == list(range(5, 13))
    for row in train + test:
        _, observation = _library_game(row["metadata"]["textarena"]["seed"]).get_observation()
        assert row["prompt"] == observation.strip() and "within 3 turns" in row["prompt"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (dict(task="GuessTheNumbr-v0"), "did you mean 'GuessTheNumber-v0'"),
        (dict(task=GAME, config={"bogus": 1}), "dataset.config={'bogus': 1} is not allowed"),
        (dict(task="TicTacToe-v0"), "a single-player game"),
        (dict(task=GAME, split="test"), "set dataset.test_size >= 1"),
    ],
)
def test_bad_games_are_clear_dataset_errors(spec, message):
    with pytest.raises(DatasetError, match=message):
        load_dataset_rows(DatasetSpec(source="textarena", size=2, **spec))


def test_a_game_on_the_engine_runs_to_its_end_with_the_librarys_reward():
    import torch
    from transformers import AutoModelForCausalLM

    from rl_multilora.lora import MultiLoRAModel

    config = tiny_config()
    config.max_position_embeddings = 2048  # the game's prompt is ~530 characters, one token each
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MultiLoRAModel(AutoModelForCausalLM.from_config(config).float().eval(), max_loras=1, max_rank=4)
    model.add_adapter("game", rank=4, alpha=8, seed=1)
    tok = tiny_tokenizer()
    engine = EmbeddedEngine(model, tok)
    engine.load_adapter("game", model.adapter_state_dict("game"), model.peft_config("game"), version=1)
    try:
        before = random.getstate()
        samples = GenerateState(engine, tok, MultiLoRAHooks(), SAMPLING).run_sync(_groups(tok))
        assert random.getstate() == before  # the games' global random draws were put back
    finally:
        engine.close()
    for s in samples:
        assert s.status == SampleStatus.COMPLETED, s.metadata.get("error")  # the game ended, before our max_turns
        actions = _model_turns(tok, s)
        reward, taken = _library_play(s.metadata["textarena"]["seed"], actions)
        assert taken == len(actions) == s.metadata["turns"] and s.reward == reward
    assert max(s.metadata["turns"] for s in samples) > 1  # feedback turns happened (an invalid move is one)


def test_a_won_game_pays_the_games_reward_and_its_feedback_is_an_environment_turn():
    tok = tiny_tokenizer()
    (group, *_) = _groups(tok, prompts=1, n=1)
    seed = group[0].metadata["textarena"]["seed"]
    target = _library_game(seed).state.game_state["game_number"]
    first = 20 if target != 20 else 1
    engine = ScriptedEngine(tok, [f"[{first}]", f"I guess [{target}]"])
    (s,) = GenerateState(engine, tok, MultiLoRAHooks(), SAMPLING).run_sync([group])
    assert s.status == SampleStatus.COMPLETED and s.metadata["turns"] == 2
    assert s.reward == _library_play(seed, [f"[{first}]", f"I guess [{target}]"])[0] == 1.0
    hint = "lower" if first > target else "higher"
    feedback = {"role": "user", "content": f"[Player] [{first}]\n[GAME] The target number is {hint}."}
    turn = observation_ids(tok, [feedback], ended_turn=True)
    first_ids = tok(f"[{first}]", add_special_tokens=False)["input_ids"] + [EOS_ID]
    assert s.response_ids[: len(first_ids) + len(turn)] == first_ids + turn
    assert s.loss_mask[len(first_ids) : len(first_ids) + len(turn)] == [0] * len(turn)
    assert engine.requests[1].input_ids == engine.requests[0].input_ids + first_ids + turn


def test_config_names_the_environment_that_plays_the_games():
    from pydantic import ValidationError

    from rl_multilora.config import AdapterConfig

    rows = {"source": "textarena", "task": GAME}
    with pytest.raises(ValidationError, match=f"allowed: {ENVIRONMENT_PATH} with dataset.source: textarena"):
        AdapterConfig(name="a", dataset=rows, environment={"path": "tests.env_plugins:Echo"}, max_steps=1)
    assert AdapterConfig(name="a", dataset=rows, environment={"path": ENVIRONMENT_PATH}, max_steps=1).reward is None


def test_a_rows_seed_fixes_its_game_whatever_else_drew_from_random():
    """A reviewer's case: the global random state was put back after every call into a game, the seeded reset's
    included, so 2048's new tiles came from whatever state the process had: the same row played twice with the same
    moves gave another board. Each game now keeps its own stream from its seeded reset on."""
    from rollout.environments import Task
    from rollout.textarena_env import TextArenaEnvironment

    (row,) = generate_rows("2048-v0", {}, seed=7, size=1, test_size=0, split="train")

    def play(outside: int) -> tuple[list[str], list[float]]:
        random.seed(outside)  # whatever the rest of the process did with `random`
        env = TextArenaEnvironment()
        env.reset(Task(row["prompt"], row["label"], row["metadata"]))
        boards, draws = [], []
        for move in ("[up]", "[left]", "[down]", "[right]", "[up]"):
            draws.append(random.random())  # the process draws between the game's turns
            step = env.step(move)
            boards.append(step.observation[0]["content"] if step.observation else f"done {step.reward}")
        return boards, draws

    first, draws = play(1)
    assert play(2)[0] == first and play(1)[0] == first
    random.seed(1)
    assert draws == [random.random() for _ in draws]  # and the process's stream is its own, games in between


def test_generated_rows_that_do_not_fit_are_named_by_their_source():
    """TextArena's rows, none of which fits the model: the refusal named dataset.path=None, a field the user never
    wrote (a reviewer's find); it names dataset.source."""
    from rl_multilora.config import AdapterConfig
    from rl_multilora.validate import Admission, OutsideFacts, adapter_problems

    a = AdapterConfig(name="guess", dataset={"source": "textarena", "task": "GuessTheNumber-v0"},
                      environment={"path": ENVIRONMENT_PATH}, max_steps=1)  # fmt: skip
    facts = OutsideFacts({}, n_rows=500, usable=None, eval_rows=None, skipped={"prompt_exceeds_context": 500})
    (problem,) = adapter_problems(a, Admission(), facts)
    assert problem.startswith(
        "adapters.guess.dataset.source='textarena' is not allowed; allowed: a dataset with at "
        "least one usable row; this one has no usable row: all 500 rows would be skipped"
    ), problem
