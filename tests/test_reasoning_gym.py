"""reasoning-gym tasks as tenants: the generated rows and the reward equal the library's own, by seed.

The rows of `dataset: {source: reasoning_gym}` must be the library's entries (`reasoning_gym.create_dataset`), the
reward must be the task's own `score_answer` (right answer 1, wrong answer what the library gives, no answer 0),
and the same seed must give the same rows. reasoning-gym is in the `dev` extra; without it this module is skipped.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

reasoning_gym = pytest.importorskip(
    "reasoning_gym", reason="reasoning-gym is not installed (pip install -e '.[envs]')"
)

import rewards  # noqa: E402
from rewards.reasoning_gym import extract_answer  # noqa: E402
from rl_multilora import cli  # noqa: E402
from rl_multilora.config import ConfigError, ModelConfig, parse_adapter_config  # noqa: E402
from rollout.data_source import DatasetError, DatasetSpec, MultiLoRADataSource, load_dataset_rows  # noqa: E402
from rollout.reasoning_gym_source import NO_ORACLE  # noqa: E402
from rollout.types import AdapterRef, RewardSpec  # noqa: E402
from tests.tiny_models import save_tiny_model, tiny_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REWARD = RewardSpec(name="reasoning_gym")
# Tasks with different scorers: the default one (exact, partial credit for a containing answer), their own numeric
# ones, a string one, and one without a single oracle answer (graph_color: any proper colouring scores 1).
TASKS = [
    ("basic_arithmetic", {"max_terms": 3, "max_digits": 2}),
    ("chain_sum", {"min_terms": 2, "max_terms": 2}),
    ("count_bits", {}),
    ("spell_backward", {}),
    ("decimal_arithmetic", {}),
    ("graph_color", {}),
]


def _spec(task: str = "basic_arithmetic", config=None, seed: int = 3, size: int = 12, test_size: int = 6, **kw):
    return DatasetSpec(
        source="reasoning_gym", task=task, config=config, seed=seed, size=size, test_size=test_size, **kw
    )


def _score(row: dict, response: str) -> float:
    return rewards.score(REWARD, row["prompt"], response, row["label"], row["metadata"])


@pytest.mark.parametrize(("task", "config"), TASKS, ids=[t for t, _ in TASKS])
def test_rows_and_scores_equal_the_librarys(task, config):
    spec = _spec(task, config)
    library = reasoning_gym.create_dataset(task, seed=3, size=12 + 6, **config)
    train = load_dataset_rows(spec)
    test = load_dataset_rows(dataclasses.replace(spec, split="test"))
    assert len(train) == 12 and 1 <= len(test) <= 6
    train_questions = {row["prompt"] for row in train}
    for rows in (train, test):
        for row in rows:
            meta = row["metadata"]["reasoning_gym"]
            entry = library[meta["index"]]  # the library's own entry for this row
            assert row["prompt"] == entry["question"]
            assert row["label"] == (NO_ORACLE if entry["answer"] is None else entry["answer"])
            assert meta["index"] < 12 if rows is train else meta["index"] >= 12
            # right answer: 1, as the library scores it; wrong answer and no answer: what the library gives, < 1
            if entry["answer"] is not None:
                assert _score(row, f"Thinking... <answer>{entry['answer']}</answer>") == 1.0
                assert library.score_answer(entry["answer"], entry) == 1.0
            wrong = "certainly not the answer 0"
            assert _score(row, f"<answer>{wrong}</answer>") == library.score_answer(wrong, entry) < 1.0
            assert _score(row, "no tag") == library.score_answer(None, entry) == 0.0
    assert not any(row["prompt"] in train_questions for row in test)  # held out means held out


def test_a_task_without_one_answer_scores_a_valid_answer_one():
    row = load_dataset_rows(_spec("graph_color", size=1, test_size=0))[0]
    entry = row["metadata"]["reasoning_gym"]["entry"]
    colors = _greedy_coloring(entry["metadata"])
    import json

    assert _score(row, f"<answer>{json.dumps(colors)}</answer>") == 1.0
    assert _score(row, "<answer>{}</answer>") < 1.0


def _greedy_coloring(meta: dict) -> dict[str, int]:
    """A proper colouring of graph_color's puzzle (its metadata: the vertices, edges and colours allowed)."""
    puzzle = meta["puzzle"]
    edges = [tuple(e) for e in puzzle["edges"]]
    colors: dict[str, int] = {}
    for v in puzzle["vertices"]:
        used = {colors.get(str(u)) for a, b in edges for u in (a, b) if v in (a, b) and u != v}
        colors[str(v)] = next(c for c in puzzle["color_options"] if c not in used)
    return colors


def test_same_seed_same_rows_and_prompts_other_seed_other_rows():
    assert load_dataset_rows(_spec(seed=5)) == load_dataset_rows(_spec(seed=5))
    assert [r["prompt"] for r in load_dataset_rows(_spec(seed=5))] != [r["prompt"] for r in load_dataset_rows(_spec())]

    def drawn(adapter_seed: int) -> list[str]:
        source = MultiLoRADataSource(tiny_tokenizer())
        spec = _spec(apply_chat_template=False)
        source.add_adapter(
            AdapterRef("a", 0), spec, REWARD, seed=adapter_seed, prompts_per_step=4, n_samples_per_prompt=2
        )
        return [g[0].prompt for g in source.next_groups(["a"])["a"]]

    assert drawn(1) == drawn(1)
    assert drawn(1) != drawn(2)


def test_samples_from_the_data_source_carry_what_the_reward_needs():
    source = MultiLoRADataSource(tiny_tokenizer())
    source.add_adapter(
        AdapterRef("a", 0),
        _spec(apply_chat_template=False),
        REWARD,
        seed=0,
        prompts_per_step=3,
        n_samples_per_prompt=2,
    )
    for group in source.next_groups(["a"])["a"]:
        for s in group:
            assert s.metadata["reasoning_gym"]["task"] == "basic_arithmetic"
            assert rewards.score(s.reward_spec, s.prompt, f"<answer>{s.label}</answer>", s.label, s.metadata) == 1.0


@pytest.mark.parametrize(
    "response",
    [
        "<answer>4</answer>",
        "a <answer> 4 </answer> b <answer>\n5\n</answer>",
        "<answer></answer>",
        "none",
        "<answer>x",
    ],
)
def test_answer_extraction_is_the_librarys(response):
    from reasoning_gym.utils import extract_answer as library_extract

    assert extract_answer(response) == library_extract(response)


def test_reward_kwargs_and_rows_without_task_metadata_are_refused():
    with pytest.raises(rewards.RewardConfigError, match="extract='tag'"):
        rewards.validate(RewardSpec(name="reasoning_gym", kwargs={"extract": "tag"}))
    with pytest.raises(ValueError, match="metadata\\['reasoning_gym'\\] is missing"):
        rewards.BUILTINS["reasoning_gym"]("p", "<answer>1</answer>", "1", {})


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"task": "basic_arithmetc"}, "dataset.task='basic_arithmetc' is not allowed; allowed: a reasoning-gym task"),
        ({"task": "basic_arithmetc"}, "did you mean 'basic_arithmetic'"),
        (
            {"config": {"max_term": 3}},
            "dataset.config.max_term=3 is not allowed; allowed: a field of basic_arithmetic",
        ),
        ({"config": {"seed": 1}}, "dataset.config.seed=1 is not allowed; allowed: dataset.seed instead"),
        ({"config": {"min_terms": 0}}, "min_terms must be positive"),
        ({"split": "validation"}, "dataset.split='validation' is not allowed; allowed: train or test"),
        ({"split": "test", "test_size": 0}, "set dataset.test_size >= 1"),
        ({"task": "arc_agi", "size": 1}, "dataset.task='arc_agi' is not allowed"),  # its scorer needs tuples
    ],
)
def test_load_errors_name_the_field_the_value_and_what_is_allowed(fields, fragment):
    with pytest.raises(DatasetError) as info:
        load_dataset_rows(_spec(**{"test_size": 2, **fields}))
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"source": "reasoning_gym"}, "dataset.task=None is not allowed"),
        (
            {"source": "reasoning_gym", "task": "x", "path": "json"},
            "dataset.path='json' is not allowed; allowed: null",
        ),
        ({"source": "reasoning_gym", "task": "x", "label_key": "a"}, "dataset.label_key='a' is not allowed"),
        (
            {"source": "reasoning_gym", "task": "x", "size": 0},
            "dataset.size=0 is not allowed; allowed: an integer >= 1",
        ),
        ({"source": "reasoning_gym", "task": "x", "seed": -1}, "dataset.seed=-1 is not allowed"),
        (
            {"path": "json", "task": "chain_sum"},
            "dataset.task='chain_sum' is not allowed; allowed: null unless source",
        ),
    ],
)
def test_spec_errors_name_the_field_the_value_and_what_is_allowed(fields, fragment):
    with pytest.raises(DatasetError) as info:
        DatasetSpec(**fields)
    assert fragment in str(info.value)


def test_config_refuses_the_reward_on_rows_of_another_source_and_bad_sources():
    model = ModelConfig(path="m", max_rank=8)

    def adapter(dataset: dict, reward: dict) -> dict:
        return {"name": "a", "rank": 4, "dataset": dataset, "reward": reward, "max_steps": 1}

    # it named dataset.source='datasets', a default the user never wrote (a reviewer's find)
    with pytest.raises(ConfigError, match="reward.name='reasoning_gym' is not allowed; allowed: reasoning_gym only with "
                       "dataset.source: reasoning_gym .* this adapter's rows are dataset.path 'json'"):  # fmt: skip
        parse_adapter_config(adapter({"path": "json"}, {"name": "reasoning_gym"}), model)
    with pytest.raises(ConfigError, match="dataset.source"):
        parse_adapter_config(adapter({"source": "gym", "task": "x"}, {"name": "reasoning_gym"}), model)
    a = parse_adapter_config(
        adapter({"source": "reasoning_gym", "task": "chain_sum"}, {"name": "reasoning_gym"}), model
    )
    assert a.dataset.task == "chain_sum" and a.dataset.source == "reasoning_gym"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("rg") / "model", hidden=32, layers=2)


def _example(model_dir: Path, run_dir: Path) -> dict:
    data = yaml.safe_load((ROOT / "examples" / "multi_lora" / "configs" / "reasoning_gym.yaml").read_text())
    data["model"]["path"] = str(model_dir)
    data["run_dir"] = str(run_dir)
    return data


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    code = cli.main(argv)
    err = capsys.readouterr().err
    return code, "\n".join(line for line in err.splitlines() if line.startswith(("error:", "  - ", "Traceback")))


def test_the_shipped_example_passes_the_dry_run_and_a_bad_task_does_not(model_dir, tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(_example(model_dir, tmp_path / "run")))
    code, err = _cli(["run", str(good), "--dry-run"], capsys)
    assert code == 0, err

    data = _example(model_dir, tmp_path / "run")
    data["adapters"][0]["dataset"]["task"] = "chain_summ"
    data["adapters"][1]["dataset"]["config"] = {"max_term": 2}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    code, err = _cli(["run", str(bad), "--dry-run"], capsys)
    assert code == 2 and "Traceback" not in err
    assert f"adapters.{data['adapters'][0]['name']}.dataset: dataset.task='chain_summ' is not allowed" in err
    assert f"adapters.{data['adapters'][1]['name']}.dataset: dataset.config.max_term=2 is not allowed" in err
    assert not (tmp_path / "run" / "run_state.json").exists()


def test_a_run_scores_both_tenants_in_the_reward_workers(model_dir, tmp_path, capsys):
    """Two steps of the shipped example on a tiny model: the rows reach the reward worker processes and every
    sample is scored by its task (no reward errors), for both tenants."""
    import json

    data = _example(model_dir, tmp_path / "run")
    data["rollout"].update(n_samples_per_prompt=2, max_new_tokens=4)
    data["eval"]["enabled"] = False
    data["logging"] = {"plot": False, "progress": False}
    data["rewards"] = {"num_workers": 1}
    # two global steps: a tiny model may score a whole group alike (no GRPO signal, no optimizer step), and a tenant
    # that never steps ends FAILED after faults.max_idle_steps, which `run` reports with exit 1
    data["max_global_steps"] = 2
    for a in data["adapters"]:
        a.update(max_steps=2, prompts_per_step=2)
        a["dataset"].update(size=8, test_size=0, apply_chat_template=False)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    code, err = _cli(["run", str(path)], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    names = {a["name"] for a in data["adapters"]}
    scored = [r for r in rows if r.get("adapter") in names and "reward_errors" in r]
    assert {r["adapter"] for r in scored} == names
    assert all(r["reward_errors"] == 0 and r["reward_timeouts"] == 0 and r["n_samples"] == 4 for r in scored)


_VF_ARGS = {
    "gym": [{"name": "spell_backward", "weight": 1, "config": {"max_word_len": 4}}],
    "num_train_examples": 5,
    "num_eval_examples": 3,
    "seed": 2,
    "system_prompt": "Reply with only the answer, as <answer>answer</answer>.",
}
_SHOTS = [
    {"role": "user", "content": "Spell this word backward (example: sun -> nus): cat"},
    {"role": "assistant", "content": "<answer>tac</answer>"},
]


def test_verifiers_env_is_verifiers_own_reasoning_gym_env_with_few_shot_turns():
    """`rollout.reasoning_gym_source:verifiers_env` is verifiers' ReasoningGymEnv: the same rows with the few-shot
    turns between the system prompt and the question, and the same parser and rubric (a tagged answer scores what
    the library's score_answer gives, in both)."""
    import asyncio

    pytest.importorskip("verifiers", reason='verifiers is an optional extra: pip install -e ".[verifiers]"')
    from verifiers.envs.integrations.reasoninggym_env import ReasoningGymEnv

    from rollout.reasoning_gym_source import verifiers_env

    env, own = verifiers_env(few_shot=_SHOTS, **_VF_ARGS), ReasoningGymEnv(**_VF_ARGS)
    for mine, theirs in ((env.get_dataset(), own.get_dataset()), (env.get_eval_dataset(), own.get_eval_dataset())):
        assert len(mine) == len(theirs) > 0
        for a, b in zip(mine, theirs, strict=True):
            assert a["prompt"] == [b["prompt"][0], *_SHOTS, *b["prompt"][1:]]
            assert a["answer"] == b["answer"]
    assert type(env.parser) is type(own.parser) and env.parser.answer_field == own.parser.answer_field == "answer"
    assert env.rubric._get_reward_func_names() == own.rubric._get_reward_func_names()
    scored = 0
    for index in range(len(own.rg_dataset)):
        entry = own.rg_dataset[index]
        for response in (entry["answer"], entry["answer"][:-1] + "x"):
            completion = [{"role": "assistant", "content": f"<answer>{response}</answer>"}]
            expected = own.rg_dataset.score_answer(response, entry)
            for e in (env, own):
                got = asyncio.run(e.rubric.funcs[0](completion=completion, answer=str(index)))
                assert got == pytest.approx(expected)
            scored += expected < 1
    assert scored > 0  # the wrong answers scored below full credit: the comparison saw more than one value


@pytest.mark.parametrize(
    ("few_shot", "fragments"),
    [
        ({"role": "user"}, ["dataset.config.few_shot={'role': 'user'} is not allowed", "alternating"]),
        (_SHOTS[:1], ["dataset.config.few_shot=[{", "the last an assistant's"]),
        ([_SHOTS[1], _SHOTS[0]], ["dataset.config.few_shot.0={", "allowed: {role: user, content: text}"]),
        (
            [_SHOTS[0], {"role": "assistant", "text": "x"}],
            ["dataset.config.few_shot.1={", "'text': 'x'}", "{role: assistant"],
        ),
    ],
)
def test_verifiers_env_refuses_few_shot_turns_that_are_not_user_assistant_pairs(few_shot, fragments):
    pytest.importorskip("verifiers", reason='verifiers is an optional extra: pip install -e ".[verifiers]"')
    spec = DatasetSpec(
        source="verifiers",
        task="rollout.reasoning_gym_source:verifiers_env",
        config={**_VF_ARGS, "few_shot": few_shot},
    )
    with pytest.raises(DatasetError) as ei:
        load_dataset_rows(spec)
    for fragment in fragments:
        assert fragment in str(ei.value)


def test_verifiers_env_held_out_only_drops_eval_questions_that_are_train_questions():
    """ReasoningGymEnv splits by index, so on a task with few distinct questions its eval rows repeat train ones;
    `held_out_only: true` keeps only the eval rows whose question no train row asks (and refuses a non-boolean)."""
    pytest.importorskip("verifiers", reason='verifiers is an optional extra: pip install -e ".[verifiers]"')
    from verifiers.envs.integrations.reasoninggym_env import ReasoningGymEnv

    from rollout.reasoning_gym_source import verifiers_env

    args = {
        "gym": [{"name": "products", "weight": 1, "config": {"min_digits": 1, "max_digits": 1}}],
        "num_train_examples": 60,
        "num_eval_examples": 40,
    }
    env, own = verifiers_env(held_out_only=True, **args), ReasoningGymEnv(**args)
    train = set(own.get_dataset()["question"])
    theirs = list(own.get_eval_dataset())
    mine = list(env.get_eval_dataset())
    assert 0 < len(mine) < len(theirs)  # 100 distinct questions: some eval rows repeat train ones, not all do
    assert mine == [row for row in theirs if row["question"] not in train]
    assert list(env.get_dataset()) == list(own.get_dataset())
    spec = DatasetSpec(
        source="verifiers", task="rollout.reasoning_gym_source:verifiers_env", config={**args, "held_out_only": "yes"}
    )
    with pytest.raises(DatasetError, match="dataset.config.held_out_only='yes' is not allowed"):
        load_dataset_rows(spec)


def test_verifiers_env_plain_parser_scores_the_whole_reply_with_the_librarys_scorer():
    """`parser: plain` is verifiers' base Parser: an untagged reply is the answer, scored by the task's own
    score_answer (partial credit for a reply that contains it); an unknown parser is refused."""
    import asyncio

    pytest.importorskip("verifiers", reason='verifiers is an optional extra: pip install -e ".[verifiers]"')
    from rollout.reasoning_gym_source import verifiers_env

    env = verifiers_env(parser="plain", **_VF_ARGS)
    for index in range(len(env.rg_dataset)):
        entry = env.rg_dataset[index]
        for reply in (entry["answer"], f"it is {entry['answer']}", "no"):
            completion = [{"role": "assistant", "content": reply}]
            got = asyncio.run(env.rubric.funcs[0](completion=completion, answer=str(index)))
            assert got == pytest.approx(env.rg_dataset.score_answer(reply, entry))
    spec = DatasetSpec(
        source="verifiers", task="rollout.reasoning_gym_source:verifiers_env", config={**_VF_ARGS, "parser": "json"}
    )
    with pytest.raises(DatasetError, match="dataset.config.parser='json' is not allowed"):
        load_dataset_rows(spec)
