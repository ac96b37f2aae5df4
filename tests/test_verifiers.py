"""verifiers environments as tenants (rollout/verifiers_env.py): their rows, their episodes on our engine, and their
rubric's reward, checked against the library's own rollout and scoring of the same model turns.

The environments below are ordinary verifiers environments, loaded by import path (`tests.test_verifiers:...`) as a
user's are. The library's own scoring is `env.run_rollout` with a `vf.Client` that replays the model turns our
engine produced: verifiers' whole rollout (its parser, `env_response`, tool calls, stop conditions) and rubric, with
none of this project's code in the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

vf = pytest.importorskip("verifiers", reason='verifiers is an optional extra: pip install -e ".[verifiers]"')

from datasets import Dataset  # noqa: E402

from rollout.data_source import DatasetError, DatasetSpec, MultiLoRADataSource  # noqa: E402
from rollout.engines.embedded import EmbeddedEngine  # noqa: E402
from rollout.generate_state import GenerateState, MultiLoRAHooks, observation_ids  # noqa: E402
from rollout.types import (  # noqa: E402
    AdapterRef,
    EnvironmentSpec,
    GenerateRequest,
    RewardSpec,
    SampleStatus,
    SamplingParams,
)
from rollout.verifiers_env import ENVIRONMENT_PATH, generate_rows, load_verifiers_env  # noqa: E402
from tests.tiny_models import CHAT_TEMPLATE, EOS_ID, ScriptedEngine, tiny_model, tiny_tokenizer  # noqa: E402

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=8)
# The tiny template plus the tools, as Hermes-style templates render them (names only: the tiny vocabulary is ASCII)
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{{ '\\n' }}{% endif %}"
)
HERE = "tests.test_verifiers"


# ----------------------------------------------------------------------------------------- the environments


def _sums(n: int, offset: int = 0) -> Dataset:
    return Dataset.from_list([{"question": f"{a}+{a + 1}=", "answer": str(2 * a + 1)} for a in range(offset, n)])


def _rubric(parser) -> vf.Rubric:
    """An exact-answer reward and a graded one (share of digits in the parsed answer), so that random text scores
    something other than 0 and two scorings that disagree show it."""

    def exact(completion, answer, **kwargs) -> float:
        return float((parser.parse_answer(completion) or "").strip() == answer)

    def digits(completion, **kwargs) -> float:
        text = parser.parse_answer(completion) or ""
        return sum(c.isdigit() for c in text) / (1 + len(text))

    return vf.Rubric(funcs=[exact, digits], weights=[1.0, 0.5], parser=parser)


def single_turn(n: int = 12) -> vf.Environment:
    parser = vf.Parser()
    return vf.SingleTurnEnv(
        dataset=_sums(n), eval_dataset=_sums(n + 4, n), system_prompt="Add.", parser=parser, rubric=_rubric(parser)
    )


class Nag(vf.MultiTurnEnv):
    """Answers every model turn with a user message naming the turn; its own max_turns ends the episode."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content=f"turn {len(state['trajectory'])}: again")]


def multi_turn(turns: int = 3) -> vf.Environment:
    parser = vf.Parser()
    return Nag(max_turns=turns, dataset=_sums(8), parser=parser, rubric=_rubric(parser))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def tools() -> vf.Environment:
    parser = vf.Parser()
    return vf.ToolEnv(tools=[add], max_turns=4, dataset=_sums(4), parser=parser, rubric=_rubric(parser))


def rewriter() -> vf.Environment:
    """A multi-turn environment that rewrites the conversation instead of appending to it."""

    class Rewriter(Nag):
        async def get_prompt_messages(self, state):
            messages = await super().get_prompt_messages(state)
            return [{"role": "user", "content": "forget all that"}] if state["trajectory"] else messages

    parser = vf.Parser()
    return Rewriter(max_turns=3, dataset=_sums(4), parser=parser, rubric=_rubric(parser))


def cancelling() -> vf.Environment:
    """A multi-turn environment whose env_response raises CancelledError (a tool awaiting a closed session, say)."""

    class Cancelling(Nag):
        async def env_response(self, messages, state, **kwargs):
            raise asyncio.CancelledError()

    parser = vf.Parser()
    return Cancelling(max_turns=3, dataset=_sums(4), parser=parser, rubric=_rubric(parser))


def raising_rubric(returns_none: bool = False) -> vf.Environment:
    """A single-turn environment one of whose reward functions raises (or returns None) on every rollout: verifiers
    logs it and scores it 0."""
    parser = vf.Parser()
    rubric = _rubric(parser)

    def broken(completion, **kwargs) -> float:
        if returns_none:
            return None
        raise RuntimeError("rubric boom")

    rubric.add_reward_func(broken)
    return vf.SingleTurnEnv(dataset=_sums(4), parser=parser, rubric=rubric)


def raising_rubric_none() -> vf.Environment:
    return raising_rubric(returns_none=True)


def grouped() -> vf.Environment:
    rubric = vf.Rubric()

    def best_of_group(completions, **kwargs) -> list[float]:
        return [1.0] * len(completions)

    rubric.add_reward_func(best_of_group)
    return vf.SingleTurnEnv(dataset=_sums(4), rubric=rubric)


# ----------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def setup():
    from rl_multilora.lora import MultiLoRAModel

    model = MultiLoRAModel(tiny_model(), max_loras=2, max_rank=4)
    model.add_adapter("vf", rank=4, alpha=8, seed=1)
    model.add_adapter("plain", rank=4, alpha=8, seed=2)
    tok = _tools_tokenizer()
    engine = EmbeddedEngine(model, tok)
    for name in ("vf", "plain"):
        engine.load_adapter(name, model.adapter_state_dict(name), model.peft_config(name), version=3)
    yield engine, tok
    engine.close()


def _tools_tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE + CHAT_TEMPLATE
    return tok


def _groups(tok, env: str, *, prompts: int = 2, n: int = 2, split: str = "train", max_tokens: int = 120, **spec):
    source = MultiLoRADataSource(tok)
    source.add_adapter(
        AdapterRef("vf", 0),
        DatasetSpec(source="verifiers", task=f"{HERE}:{env}", split=split, **spec),
        None,
        seed=0,
        prompts_per_step=prompts,
        n_samples_per_prompt=n,
        environment=EnvironmentSpec(path=ENVIRONMENT_PATH, max_turns=6, max_tokens=max_tokens),
    )
    return source.next_groups(["vf"])["vf"]


def _run(engine, tok, groups):
    return GenerateState(engine, tok, MultiLoRAHooks(), SAMPLING).run_sync(groups)


def _model_turns(tok, sample) -> list[str]:
    """The text of each model turn of an episode (the runs of loss-masked-in ids), decoded as the episode did."""
    turns, current = [], []
    for token, keep in zip(sample.response_ids, sample.loss_mask, strict=True):
        if keep:
            current.append(token)
        elif current:
            turns.append(current)
            current = []
    if current:
        turns.append(current)
    return [tok.decode(ids, skip_special_tokens=True) for ids in turns]


class Replay(vf.Client):
    """A verifiers client that answers each model call with the next recorded message (text, optional tool calls)."""

    def __init__(self, messages: list[tuple[str, list]]):
        super().__init__(object())
        self.messages = list(messages)
        self.prompts = []

    async def get_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        self.prompts.append(prompt)
        content, calls = self.messages.pop(0)
        message = vf.types.ResponseMessage(
            content=content or None,
            finish_reason="tool_calls" if calls else "stop",
            is_truncated=False,
            tool_calls=calls or None,
        )
        return vf.types.Response(id="replay", created=0, model=model, message=message)

    def setup_client(self, config): ...
    async def to_native_tool(self, tool): ...
    async def to_native_prompt(self, messages): ...
    async def get_native_response(self, *args, **kwargs): ...
    async def raise_from_native_response(self, response): ...
    async def from_native_response(self, response): ...
    async def close(self): ...


def _library_reward(sample, messages: list[tuple[str, list]]) -> dict:
    """verifiers' own rollout and scoring of the row, the model turns replayed."""
    import asyncio

    meta = sample.metadata["verifiers"]
    env = load_verifiers_env(meta["env"], meta["env_args"])
    replay = Replay(messages)
    output = asyncio.run(env.run_rollout(dict(meta["input"]), replay, "replay", {}))
    assert not replay.messages, "the library's rollout asked for fewer model turns than the episode had"
    return output


# ----------------------------------------------------------------------------------------- rows


def test_rows_are_the_environments_own_and_render_its_tools():
    env = load_verifiers_env(f"{HERE}:single_turn")
    rows = generate_rows(f"{HERE}:single_turn", {}, "train", None)
    want = env.get_dataset()
    assert len(rows) == len(want) == 12
    for row, ref in zip(rows, want, strict=True):
        assert row["prompt"] == [{"role": "system", "content": "Add."}, {"role": "user", "content": ref["question"]}]
        assert (
            row["label"] == ref["answer"] and row["metadata"]["verifiers"]["input"]["example_id"] == ref["example_id"]
        )
    test = generate_rows(f"{HERE}:single_turn", {}, "test", 2)
    assert [r["label"] for r in test] == [r["answer"] for r in env.get_eval_dataset(n=2)]
    assert generate_rows(f"{HERE}:single_turn", {"n": 5}, "train", None)[-1]["label"] == "9"  # config = its arguments
    # A tool environment's rows carry its tools, and the data source renders them with the chat template.
    tok = _tools_tokenizer()
    (group, *_) = _groups(tok, "tools", prompts=1, n=1)
    assert group[0].prompt.startswith("<tools>add;\n<user>")
    assert group[0].label == group[0].metadata["verifiers"]["input"]["answer"]
    assert generate_rows(f"{HERE}:tools", {}, "train", 1)[0]["tools"][0]["function"]["parameters"]["required"] == [
        "a",
        "b",
    ]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (dict(task="no_such_verifiers_env"), "dataset.task='no_such_verifiers_env' is not allowed"),
        (dict(task=f"{HERE}:missing"), "an importable 'module:attr'"),
        (dict(task=f"{HERE}:single_turn", config={"bogus": 1}), "dataset.config={'bogus': 1}"),
        (dict(task=f"{HERE}:multi_turn", split="test"), "has no eval_dataset"),
        (dict(task=f"{HERE}:grouped"), "no group rewards"),
        (dict(task=f"{HERE}:single_turn", split="validation"), "allowed: train or test"),
    ],
)
def test_bad_environments_are_clear_dataset_errors(spec, message):
    from rollout.data_source import load_dataset_rows

    with pytest.raises(DatasetError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_dataset_rows(DatasetSpec(source="verifiers", **spec))


def test_config_names_the_environment_that_plays_the_rows():
    for bad, message in (
        (dict(seed=3), "dataset.seed=3 is not allowed; allowed: null with source: verifiers"),
        (dict(system_prompt="hi"), "dataset.system_prompt='hi'"),
        (dict(task=None), "a verifiers environment"),
    ):
        with pytest.raises(DatasetError, match=message):
            DatasetSpec(**{"source": "verifiers", "task": "x", **bad})
    from pydantic import ValidationError

    from rl_multilora.config import AdapterConfig

    rows = {"source": "verifiers", "task": f"{HERE}:single_turn"}
    with pytest.raises(ValidationError, match=f"environment.path=None is not allowed; allowed: {ENVIRONMENT_PATH}"):
        AdapterConfig(name="a", dataset=rows, reward={"name": "gsm8k"}, max_steps=1)
    with pytest.raises(ValidationError, match=f"environment.path='{ENVIRONMENT_PATH}' is not allowed; allowed: "
                       f"{ENVIRONMENT_PATH} only with dataset.source: verifiers"):  # fmt: skip
        AdapterConfig(name="a", dataset={"path": "x.jsonl"}, environment={"path": ENVIRONMENT_PATH}, max_steps=1)
    assert AdapterConfig(name="a", dataset=rows, environment={"path": ENVIRONMENT_PATH}, max_steps=1).reward is None


# ----------------------------------------------------------------------------------------- episodes


def test_a_single_turn_episode_gets_the_librarys_reward_and_the_engines_tokens(setup):
    engine, tok = setup
    groups = _groups(tok, "single_turn")
    plain = [
        dataclasses.replace(s, adapter=AdapterRef("plain", 1), environment=None, reward_spec=RewardSpec(name="f1"))
        for s in _groups(tok, "single_turn")[1]
    ]
    samples = _run(engine, tok, [*groups, [dataclasses.replace(s, group_index=9) for s in plain]])
    episodes = [s for s in samples if s.environment is not None]
    assert len(episodes) == 4 and all(s.status == SampleStatus.COMPLETED for s in episodes)
    scored = []
    for s in episodes:
        assert s.metadata["turns"] == 1 and s.loss_mask == [1] * len(s.response_ids) and s.weight_version == 3
        # the trained ids and log-probs are the engine's: the same request, alone, gives the same ones
        seeded = dataclasses.replace(SAMPLING, seed=s.metadata["sampling_seed"])
        (again,) = engine.generate([GenerateRequest(list(s.prompt_ids), "vf", seeded)])
        assert s.response_ids == again.output_ids
        assert s.rollout_logprobs == pytest.approx(again.output_logprobs, abs=1e-5)
        (text,) = _model_turns(tok, s)
        library = _library_reward(s, [(text, [])])
        assert s.reward == pytest.approx(library["reward"], abs=1e-12)
        scored.append(s.reward)
    assert any(r > 0 for r in scored), "every reward was 0: the comparison would not tell two scorers apart"


def test_a_multi_turn_episode_runs_to_the_environments_end(setup):
    engine, tok = setup
    (group, *_) = _groups(tok, "multi_turn", prompts=1, n=3, max_tokens=400)
    samples = _run(engine, tok, [group])
    for s in samples:
        assert s.status == SampleStatus.COMPLETED and s.metadata["turns"] == 3  # the environment's max_turns
        texts = _model_turns(tok, s)
        assert len(texts) == 3
        # between model turns: exactly the template's rendering of the environment's message, no gradient
        first = s.loss_mask.index(0)  # the first model turn's length
        ended = s.response_ids[first - 1] == EOS_ID
        obs = observation_ids(tok, [{"role": "user", "content": "turn 1: again"}], ended)
        assert s.response_ids[first : first + len(obs)] == obs and set(s.loss_mask[first : first + len(obs)]) == {0}
        library = _library_reward(s, [(t, []) for t in texts])
        assert s.reward == pytest.approx(library["reward"], abs=1e-12)
        assert library["metrics"]["num_turns"] == 3


def test_a_tool_call_is_dispatched_by_the_environment_and_its_result_is_an_environment_turn():
    tok = _tools_tokenizer()
    (group, *_) = _groups(tok, "tools", prompts=1, n=1)
    a, b = (int(x) for x in group[0].metadata["verifiers"]["input"]["prompt"][-1]["content"].rstrip("=").split("+"))
    arguments = {"a": a, "b": b}
    call = f'<tool_call>{{"name": "add", "arguments": {json.dumps(arguments)}}}</tool_call>'
    engine = ScriptedEngine(tok, [call, str(a + b)])  # the model calls the tool, then answers with its result
    (s,) = _run(engine, tok, [group])
    assert s.status == SampleStatus.COMPLETED and s.metadata["turns"] == 2
    first, second = engine.requests
    result = {"role": "tool", "content": str(a + b), "tool_call_id": "call_0_0"}  # the environment's add ran
    tool_turn = observation_ids(tok, [result], ended_turn=True)
    # the second call's context is the prompt, the model's own ids, then the tool result as the template renders it
    call_ids = tok(call, add_special_tokens=False)["input_ids"] + [EOS_ID]
    answer_ids = tok(str(a + b), add_special_tokens=False)["input_ids"] + [EOS_ID]
    assert second.input_ids == first.input_ids + call_ids + tool_turn
    assert s.response_ids == call_ids + tool_turn + answer_ids
    assert s.loss_mask == [1] * len(call_ids) + [0] * len(tool_turn) + [1] * len(answer_ids)
    assert s.rollout_logprobs == [-0.5] * len(call_ids) + [0.0] * len(tool_turn) + [-0.5] * len(answer_ids)
    library_call = vf.types.ToolCall(id="c", name="add", arguments=json.dumps(arguments))
    library = _library_reward(s, [("", [library_call]), (str(a + b), [])])
    assert library["metrics"]["total_tool_calls"] == 1 and library["metrics"]["exact"] == 1.0
    assert s.reward == library["reward"]


def test_an_environment_that_rewrites_the_conversation_fails_its_own_episodes_only(setup):
    engine, tok = setup
    (bad, *_) = _groups(tok, "rewriter", prompts=1, n=2)
    (good, *_) = _groups(tok, "single_turn", prompts=1, n=2)
    samples = _run(engine, tok, [bad, [dataclasses.replace(s, group_index=5) for s in good]])
    for s in samples[:2]:
        assert s.status == SampleStatus.FAILED and "does not continue the conversation" in s.metadata["error"]
    assert all(s.status == SampleStatus.COMPLETED and s.reward is not None for s in samples[2:])


def test_a_cancelled_verifiers_rollout_fails_its_own_episodes_only(setup):
    """verifiers' rollout task ending cancelled: `Task.exception()` would raise its CancelledError into the episode,
    which then read as the whole rollout being cancelled (every tenant's step lost)."""
    engine, tok = setup
    (bad, *_) = _groups(tok, "cancelling", prompts=1, n=2)
    (good, *_) = _groups(tok, "single_turn", prompts=1, n=2)
    samples = _run(engine, tok, [bad, [dataclasses.replace(s, group_index=5) for s in good]])
    for s in samples[:2]:
        assert s.status == SampleStatus.FAILED and "the verifiers rollout was cancelled" in s.metadata["error"]
    assert all(s.status == SampleStatus.COMPLETED and s.reward is not None for s in samples[2:])


def test_a_verifiers_tenant_trains_and_evaluates_next_to_a_plain_tenant(tmp_path):
    from rl_multilora.config import parse_run_config
    from rl_multilora.loop import run
    from rl_multilora.metrics import read_metrics
    from tests.tiny_models import save_tiny_model, sum_task_adapter, write_sum_task

    save_tiny_model(tmp_path / "model", hidden=32, layers=2)
    write_sum_task(tmp_path / "data" / "plain.jsonl", 30, 3)
    tenant = {
        "name": "vf",
        "dataset": {"source": "verifiers", "task": f"{HERE}:single_turn"},
        "environment": {"path": ENVIRONMENT_PATH, "max_tokens": 12},
        "sampling": {"max_new_tokens": 6},
        "prompts_per_step": 2,
        "max_steps": 2,
        "seed": 4,
        "eval": {"enabled": True, "n_prompts": 3},  # on the environment's eval_dataset
    }
    cfg = {
        "run_dir": str(tmp_path / "run"),
        "model": {"path": str(tmp_path / "model"), "max_loras": 2, "max_rank": 8},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 6},
        "grpo": {"micro_batch_size": 8, "drop_uniform_groups": False},
        "logging": {"plot": False, "progress": False},
        "rewards": {"num_workers": 1},
        "adapters": [sum_task_adapter(tmp_path / "data", "plain", 6, max_steps=2), tenant],
    }
    run(parse_run_config(cfg))
    rows = [r for r in read_metrics(tmp_path / "run") if r["adapter"] == "vf"]
    train = [r for r in rows if r.get("kind") != "eval"]
    assert [r["adapter_step"] for r in train] == [1, 2]
    assert all(r["failed_samples"] == 0 and r["reward_mean"] is not None for r in train)
    evals = [r for r in rows if r.get("kind") == "eval"]
    assert evals and all(r["eval/n_prompts"] == 3 and r["eval/errors"] == 0 for r in evals)


@pytest.mark.parametrize(
    ("task", "why"), [("raising_rubric", "broken: rubric boom"), ("raising_rubric_none", "NoneType")]
)
@pytest.mark.parametrize("quiet", [False, True], ids=["logging", "verifiers-logging-off"])
def test_a_rubric_function_that_raises_fails_its_own_episodes(setup, task, why, quiet, monkeypatch):
    """verifiers scores a rubric function that raises (or returns None) 0 and logs it: the tenant trained on 0 with
    reward_errors and failed_samples at 0 (a reviewer's find). The episode fails naming it, as a NaN reward does,
    whatever logging shows (VF_LOG_LEVEL=CRITICAL, or a vf.setup_logging that clears handlers)."""
    import logging

    if quiet:
        for name in ("verifiers", "verifiers.legacy.rubrics.rubric"):
            monkeypatch.setattr(logging.getLogger(name), "level", logging.CRITICAL)
        monkeypatch.setattr(logging.getLogger("verifiers"), "handlers", [])
    engine, tok = setup
    (bad, *_) = _groups(tok, task, prompts=1, n=2)
    (good, *_) = _groups(tok, "single_turn", prompts=1, n=2)
    samples = _run(engine, tok, [bad, [dataclasses.replace(s, group_index=5) for s in good]])
    for s in samples[:2]:
        assert s.status == SampleStatus.FAILED, s.metadata
        assert "the environment's rubric failed: Error calling reward function broken" in s.metadata["error"]
        assert why in s.metadata["error"]
    assert all(s.status == SampleStatus.COMPLETED and s.reward is not None for s in samples[2:])
