"""The agents example's environments (examples/multi_lora/agents.py) on the rows and transcripts the tiny-agents
preset writes: tool dispatch, game feedback and rewards, and the transcripts' token layout. Fast: no model."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from examples.multi_lora.agents import Calculator, GuessingGame
from rl_multilora.presets.tiny_agents import (
    GUESSES,
    HIGHER,
    LOWER,
    NOT_A_NUMBER,
    AgentExample,
    agent_splits,
    calc_transcript,
    episode_ids,
    extend_tokenizer,
    guess_transcript,
    tool_call_text,
)
from rollout.environments import Task, load_environment

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, list[AgentExample]]]:
    return agent_splits(0, {"calc": (50, 20), "guess": (50, 20)})


def _calc(row: AgentExample) -> Calculator:
    env = load_environment("examples.multi_lora.agents:Calculator")
    env.reset(Task(row.question, row.label))
    return env


def test_splits_are_disjoint_and_rows_are_what_the_config_reads(rows):
    for task, by_split in rows.items():
        train = {(r.question, r.label) for r in by_split["train"]}
        assert not train & {(r.question, r.label) for r in by_split["test"]}, task
        assert set(by_split["train"][0].row()) == {"question", "answer"}
    assert agent_splits(0, {"guess": (5, 5)})["guess"] == agent_splits(0, {"guess": (5, 5)})["guess"]


def test_calculator_dispatches_tool_calls_and_scores_the_final_answer(rows):
    row = rows["calc"]["test"][0]
    a, b = (int(x) for x in row.question.split()[1:4:2])
    env = _calc(row)
    step = env.step("let me call " + tool_call_text("mul", a, b))
    assert not step.done and step.observation == [{"role": "tool", "content": row.label}] and step.reward == 0.0
    # A turn cut at the `</tool_call>` stop string still parses (the tag is in the ids: stops are never trimmed).
    assert env.step(tool_call_text("add", 2, 3)[: -len("</tool_call>")]).observation[0]["content"] == "5"
    assert env.step(f"Answer: {row.label}").done and _calc(row).step(f"Answer: {row.label}").reward == 1.0
    wrong = int(row.label) + 1
    for text in (f"Answer: {wrong}", f"The answer is {row.label}.", ""):
        step = _calc(row).step(text)
        assert step.done and step.reward == 0.0, text


@pytest.mark.parametrize(
    ("call", "error"),
    [
        ('<tool_call>{"name": "div", "arguments": {"a": 1, "b": 2}}</tool_call>', "error: unknown tool 'div'"),
        ('<tool_call>{"name": "mul", "arguments": {"a": "3", "b": 2}}</tool_call>', "error: TypeError: mul takes"),
        ('<tool_call>{"name": "mul", "arguments": {"a": 3}}</tool_call>', "error: TypeError"),
        ("<tool_call>mul(3, 2)</tool_call>", "error: tool call is not JSON"),
    ],
)
def test_calculator_answers_bad_calls_with_an_error_message(rows, call, error):
    step = _calc(rows["calc"]["test"][0]).step(call)
    assert not step.done and step.observation[0]["role"] == "tool"
    assert step.observation[0]["content"].startswith(error)


def test_guessing_game_feedback_turns_and_discounted_reward(rows):
    row = rows["guess"]["test"][0]
    secret = int(row.label)
    env = GuessingGame()
    env.reset(Task(row.question, row.label))
    assert env.step(str(secret - 1)).observation == [{"role": "user", "content": HIGHER}]
    assert env.step(f"{secret + 1}.").observation == [{"role": "user", "content": LOWER}]
    assert env.step("maybe 3 or 4").observation == [{"role": "user", "content": NOT_A_NUMBER}]
    step = env.step(f" {secret}")
    assert step.done and step.reward == pytest.approx(0.8**3) and step.metadata == {"guesses": 4}
    env.reset(Task(row.question, row.label))
    assert env.step(str(secret)).reward == 1.0
    env = GuessingGame(guesses=2, discount=0.5)
    env.reset(Task(row.question, row.label))
    assert not env.step(str(secret + 1)).done
    last = env.step(str(secret + 2))
    assert last.done and last.reward == 0.0
    with pytest.raises(ValueError, match="guesses=0"):
        GuessingGame(guesses=0)


def test_pretraining_transcripts_are_episodes_of_these_environments(rows):
    """Replaying a transcript through its environment gives back its observations and a reward of 1 (tool) or the
    discounted reward of its last guess: the base is pretrained on exactly what the environments answer."""
    rng = random.Random(0)
    for row in rows["calc"]["train"]:
        for use_tool in (True, False):
            messages, env = calc_transcript(row, use_tool, rng), _calc(row)
            for m, nxt in zip(messages[::2], [*messages[1::2], None], strict=True):
                step = env.step(m["content"])
                assert (step.observation or [None])[0] == nxt
            assert step.done and step.reward == float(use_tool), (row, messages)
    for follow_rate in (0.0, 1.0):
        for row in rows["guess"]["train"]:
            messages, env = guess_transcript(row, follow_rate, rng), GuessingGame()
            env.reset(Task(row.question, row.label))
            for m, nxt in zip(messages[::2], [*messages[1::2], None], strict=True):
                step = env.step(m["content"])
                assert (step.observation or [None])[0] == nxt
            solved = messages[-1]["content"] == row.label
            assert step.done == (solved or len(messages) == 2 * GUESSES - 1)
            assert step.reward == (0.8 ** ((len(messages) - 1) // 2) if solved else 0.0)


def test_transcript_ids_mask_only_assistant_turns_and_render_the_tool_role():
    from rl_multilora.presets.tiny import build_tokenizer, tokenizer_corpus

    tok = build_tokenizer(tokenizer_corpus(0, per_task=20), vocab_size=400)
    extend_tokenizer(tok)
    row = AgentExample("calc", "Compute 37 * 46 with the calculator. End with 'Answer: N'.", "1702")
    messages = calc_transcript(row, True, random.Random(0))
    ids, mask = episode_ids(tok, row.question, messages)
    assert len(ids) == len(mask)
    assert tok.decode(ids) == tok.apply_chat_template(
        [{"role": "user", "content": row.question}, *messages], tokenize=False
    ).removesuffix("\n")
    trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == "".join(m["content"] + "<|end|>" for m in messages if m["role"] == "assistant")
    # The tool-call tags are single, non-special tokens: one id each, kept by decode(skip_special_tokens=True).
    call = tok(tool_call_text("mul", 37, 46), add_special_tokens=False)["input_ids"]
    assert (
        tok.convert_ids_to_tokens(call[0]) == "<tool_call>" and tok.convert_ids_to_tokens(call[-1]) == "</tool_call>"
    )
    assert tok.decode(call, skip_special_tokens=True) == tool_call_text("mul", 37, 46)


def test_shipped_agent_configs_validate():
    """agents.yaml (five tenants, two with environments) and the service submission for the tool tenant."""
    from rl_multilora.config import load_run_config, load_yaml, parse_adapter_config

    configs = REPO / "examples" / "multi_lora" / "configs"
    cfg = load_run_config(configs / "agents.yaml")
    names = {a.name: a for a in cfg.adapters}
    assert list(names) == ["gsm8k", "arith", "compare", "calc", "guess"]
    assert names["calc"].environment.path == "examples.multi_lora.agents:Calculator"
    assert names["guess"].environment.path == "examples.multi_lora.agents:GuessingGame"
    for a in cfg.adapters:
        if a.environment is not None:
            load_environment(a.environment.path, a.environment.kwargs)
    service = load_run_config(configs / "agents_service.yaml")
    assert service.adapters == [] and service.model.path == cfg.model.path
    sub = parse_adapter_config(load_yaml(configs / "agents_adapters" / "calc.yaml"), service.model, source="calc.yaml")
    assert sub.name == "calc" and sub.environment == names["calc"].environment and sub.max_steps is not None
