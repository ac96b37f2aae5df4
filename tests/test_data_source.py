"""MultiLoRADataSource: quotas, budgets, isolation of cursors, exact resume, bad rows, dataset loading."""

import json

import datasets
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rollout.data_source import DatasetError, DatasetSpec, MultiLoRADataSource, eval_split, load_dataset_rows
from rollout.types import AdapterRef, RewardSpec

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """Character-level tokenizer built offline: one token per printable ASCII character or newline."""
    specials = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|system|>", "<|assistant|>"]
    vocab = {token: i for i, token in enumerate(specials + ["\n"] + [chr(c) for c in range(32, 127)])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=specials[3:],
    )
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def rows(prefix: str, n: int) -> list[dict]:
    return [{"prompt": f"{prefix} q{i}", "label": str(i)} for i in range(n)]


def add(source, name, data, *, seed=0, ppp=2, n=3, slot=0, spec=None, **kwargs):
    source.add_adapter(
        AdapterRef(name, slot),
        spec or DatasetSpec(path="inline"),
        RewardSpec(name="gsm8k"),
        seed=seed,
        prompts_per_step=ppp,
        n_samples_per_prompt=n,
        dataset=datasets.Dataset.from_list(data) if isinstance(data, list) else data,
        **kwargs,
    )


def labels(groups) -> list[str]:
    return [group[0].label for group in groups]


def test_quotas_groups_and_tags(tokenizer):
    source = MultiLoRADataSource(tokenizer)
    add(source, "a", rows("a", 10), ppp=2, n=3, slot=0)
    add(source, "b", rows("b", 10), ppp=3, n=2, slot=1)
    out = source.next_groups(["a", "b"])
    assert [len(out["a"]), len(out["b"])] == [2, 3]
    assert all(len(g) == 3 for g in out["a"]) and all(len(g) == 2 for g in out["b"])
    for name, slot in (("a", 0), ("b", 1)):
        group_indices = [g[0].group_index for g in out[name]]
        assert len(set(group_indices)) == len(group_indices)
        for group in out[name]:
            first = group[0]
            assert first.prompt.startswith("<|user|>") and first.prompt.endswith("<|assistant|>")
            assert first.prompt_ids == tokenizer(first.prompt, add_special_tokens=False)["input_ids"]
            for sample in group:
                assert sample.adapter == AdapterRef(name, slot)
                assert sample.reward_spec == RewardSpec(name="gsm8k")
                assert (sample.group_index, sample.prompt_ids, sample.label) == (
                    first.group_index,
                    first.prompt_ids,
                    first.label,
                )
                assert sample.metadata["row_index"] == first.metadata["row_index"]
                assert sample.metadata["epoch"] == 0
            # distinct seeds per sample so the n samples of a prompt are not all identical
            assert len({s.metadata["sampling_seed"] for s in group}) == len(group)
    flat = [s.index for name in ("a", "b") for g in out[name] for s in g]
    assert flat == list(range(len(flat)))


def test_epoch_permutation_and_max_epochs_budget(tokenizer):
    source = MultiLoRADataSource(tokenizer)
    add(source, "a", rows("a", 5), ppp=2, seed=7, max_epochs=2)
    served = []
    while not source.exhausted("a"):
        served.append(labels(source.next_groups(["a"])["a"]))
    # 10 rows over steps of 2; each epoch is a full permutation of the 5 rows, the two epochs differ in order
    flat = [label for step in served for label in step]
    assert [len(step) for step in served] == [2, 2, 2, 2, 2]
    assert sorted(flat[:5]) == sorted(flat[5:]) == [str(i) for i in range(5)]
    assert source.stats("a")["epoch"] == 2 and source.stats("a")["rows_served"] == 10
    assert source.next_groups(["a"]) == {"a": []}

    other = MultiLoRADataSource(tokenizer)
    add(other, "a", rows("a", 5), ppp=5, seed=8, max_epochs=1)
    assert sorted(labels(other.next_groups(["a"])["a"])) == sorted(flat[:5])
    assert labels(other.next_groups(["a"])["a"]) == []


def test_partial_epoch_and_max_rows_budget(tokenizer):
    source = MultiLoRADataSource(tokenizer)
    add(source, "half", rows("h", 10), ppp=4, max_epochs=0.5)
    add(source, "rows", rows("r", 10), ppp=4, max_rows=6)
    first = source.next_groups(["half", "rows"])
    second = source.next_groups(["half", "rows"])
    assert [len(first["half"]), len(second["half"])] == [4, 1]
    assert [len(first["rows"]), len(second["rows"])] == [4, 2]
    assert source.exhausted("half") and source.exhausted("rows")
    assert source.stats("rows")["rows_served"] == 6


def test_add_remove_mid_run_does_not_move_other_cursors(tokenizer):
    alone = MultiLoRADataSource(tokenizer)
    add(alone, "a", rows("a", 7), seed=3)
    alone_steps = [alone.next_groups(["a"])["a"] for _ in range(5)]

    shared = MultiLoRADataSource(tokenizer)
    add(shared, "a", rows("a", 7), seed=3)
    shared_steps = [shared.next_groups(["a"])["a"]]
    add(shared, "b", rows("b", 4), seed=3, slot=1)
    shared_steps.append(shared.next_groups(["b", "a"])["a"])
    shared_steps.append(shared.next_groups(["a", "b"])["a"])
    shared.remove_adapter("b")
    add(shared, "c", rows("c", 9), seed=11, slot=1)
    shared_steps.append(shared.next_groups(["c", "a"])["a"])
    shared_steps.append(shared.next_groups(["a"])["a"])

    # same prompts, group ids and sampling seeds whoever shares the batch
    def key(steps):
        return [
            (g[0].label, g[0].group_index, [s.metadata["sampling_seed"] for s in g]) for step in steps for g in step
        ]

    assert key(shared_steps) == key(alone_steps)
    with pytest.raises(DatasetError, match="'b' is not in the data source"):
        shared.next_groups(["b"])


def test_exact_resume_from_state_dict(tokenizer):
    data = rows("a", 6) + [{"prompt": "", "label": "x"}]

    def fresh():
        source = MultiLoRADataSource(tokenizer)
        add(source, "a", data, seed=5, ppp=4, max_epochs=3)
        return source

    def key(groups):
        return [(g[0].label, g[0].group_index, g[0].metadata["epoch"], g[0].metadata["sampling_seed"]) for g in groups]

    uninterrupted = fresh()
    expected = [key(uninterrupted.next_groups(["a"])["a"]) for _ in range(6)]

    first = fresh()
    got = [key(first.next_groups(["a"])["a"]) for _ in range(2)]
    state = json.loads(json.dumps(first.state_dict("a")))  # must survive JSON
    resumed = fresh()
    resumed.load_state_dict("a", state)
    got += [key(resumed.next_groups(["a"])["a"]) for _ in range(4)]
    assert got == expected
    assert resumed.stats("a") == uninterrupted.stats("a")

    other_seed = MultiLoRADataSource(tokenizer)
    add(other_seed, "a", data, seed=6)
    with pytest.raises(DatasetError, match="seed=5"):
        other_seed.load_state_dict("a", state)


def test_bad_rows_are_skipped_and_counted(tokenizer):
    data = [
        {"prompt": "good one", "label": "1"},
        {"prompt": None, "label": "2"},
        {"prompt": "   ", "label": "3"},
        {"prompt": "no label", "label": None},
        {"prompt": "x" * 50, "label": "5"},
        {"prompt": "good two", "label": "6"},
    ]
    source = MultiLoRADataSource(tokenizer)
    add(source, "a", data, ppp=10, max_epochs=2, spec=DatasetSpec(path="inline", max_prompt_tokens=30))
    assert sorted(labels(source.next_groups(["a"])["a"])) == ["1", "1", "6", "6"]
    stats = source.stats("a")
    # counted once per row, not once per epoch
    assert stats["bad_rows"] == 4
    assert stats["bad_row_reasons"] == {
        "missing_prompt": 1,
        "empty_prompt": 1,
        "missing_label": 1,
        "prompt_too_long": 1,
    }


def test_all_bad_rows_report_exhausted_without_looping(tokenizer):
    source = MultiLoRADataSource(tokenizer)
    add(source, "bad", [{"prompt": "", "label": "1"}, {"prompt": None, "label": "2"}], ppp=4)  # no epoch limit
    add(source, "good", rows("g", 3), ppp=1, slot=1)
    out = source.next_groups(["bad", "good"])
    assert out["bad"] == [] and len(out["good"]) == 1
    assert source.exhausted("bad") and not source.exhausted("good")
    assert source.stats("bad")["bad_rows"] == 2


def test_prompt_formatting_options(tokenizer):
    source = MultiLoRADataSource(tokenizer)
    data = [{"question": "2+2?", "answer": "4", "meta": {"source": "unit"}, "unit": "apples"}]
    spec = DatasetSpec(
        path="inline",
        prompt_key="question",
        label_key="answer",
        metadata_key="meta",
        system_prompt="Be brief.",
        prompt_template="{prompt} ({unit})",
    )
    add(source, "a", data, ppp=1, n=1, spec=spec)
    sample = source.next_groups(["a"])["a"][0][0]
    assert sample.prompt == "<|system|>Be brief.<eos><|user|>2+2? (apples)<eos><|assistant|>"
    assert sample.label == "4" and sample.metadata["source"] == "unit"

    plain = MultiLoRADataSource(make_tokenizer(chat_template=None))
    add(
        plain,
        "p",
        data,
        ppp=1,
        n=1,
        spec=DatasetSpec(
            path="inline", prompt_key="question", label_key="answer", apply_chat_template=False, system_prompt="Sys"
        ),
    )
    sample = plain.next_groups(["p"])["p"][0][0]
    assert sample.prompt == "Sys\n\n2+2?"
    assert plain.tokenizer.decode(sample.prompt_ids) == "Sys\n\n2+2?"

    with pytest.raises(DatasetError, match="apply_chat_template"):
        add(plain, "q", data, spec=DatasetSpec(path="inline", prompt_key="question", label_key="answer"))


def test_load_from_json_files(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows("f", 4)))
    spec = DatasetSpec(path="json", data_files=str(path))
    assert len(load_dataset_rows(spec)) == 4
    assert len(load_dataset_rows(DatasetSpec(path=str(path)))) == 4  # a bare file path picks its builder

    source = MultiLoRADataSource(tokenizer)
    source.add_adapter(
        AdapterRef("a", 0),
        spec,
        RewardSpec(name="math"),
        seed=0,
        prompts_per_step=4,
        n_samples_per_prompt=1,
        max_epochs=1,
    )
    assert sorted(labels(source.next_groups(["a"])["a"])) == ["0", "1", "2", "3"]


def test_the_eval_split_of_a_bare_file_path_or_a_saved_dataset(tmp_path):
    """A reviewer's repros: `path: train.jsonl` with `eval.data_files` went to `load_dataset` as a Hub name (only a
    path without data_files picked its builder), and a saved Dataset without splits gave its training rows for any
    split, so an eval there ran on training data."""
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows("t", 4)))
    test.write_text("".join(json.dumps(r) + "\n" for r in rows("e", 2)))
    spec = DatasetSpec(path=str(train))
    for files in (str(test), [str(test)], {"test": str(test)}):  # eval.data_files as a file, a list or a mapping
        got = load_dataset_rows(eval_split(spec, "test", files))
        assert [r["prompt"] for r in got] == [r["prompt"] for r in rows("e", 2)], files

    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows("t", 4)).save_to_disk(str(saved))
    assert len(load_dataset_rows(DatasetSpec(path=str(saved)))) == 4  # split 'train': the whole saved Dataset
    with pytest.raises(DatasetError, match=r"dataset\.split='test' cannot be read from .*saved.*holds one Dataset"):
        load_dataset_rows(eval_split(DatasetSpec(path=str(saved)), "test"))


def test_dataset_errors_name_the_field(tmp_path):
    with pytest.raises(DatasetError, match=r"data_files: file .*missing\.jsonl.* does not exist"):
        load_dataset_rows(DatasetSpec(path="json", data_files=str(tmp_path / "missing.jsonl")))
    with pytest.raises(DatasetError, match=r"dataset\.path=.*nope.* does not exist"):
        load_dataset_rows(DatasetSpec(path=str(tmp_path / "nope")))

    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "q", "label": "1"}) + "\n")
    with pytest.raises(DatasetError, match=r"dataset\.prompt_key='prompt' is not a column.*question"):
        load_dataset_rows(DatasetSpec(path="json", data_files=str(path)))
    with pytest.raises(DatasetError, match=r"dataset\.label_key='answer' is not a column"):
        load_dataset_rows(DatasetSpec(path="json", data_files=str(path), prompt_key="question", label_key="answer"))
    with pytest.raises(DatasetError, match=r"dataset\.split='test'"):
        load_dataset_rows(DatasetSpec(path="json", data_files=str(path), prompt_key="question", split="test"))
    with pytest.raises(DatasetError, match=r"max_prompt_tokens=0"):
        DatasetSpec(path="json", max_prompt_tokens=0)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("Solve: {question}", "a format string containing '{prompt}'"),
        ("{prompt}\nPut the answer in \\boxed{}.", r"literal braces doubled.*\{\} is not a column name"),
        ("{prompt} ({label.kind})", r"\{label\.kind\} is not a column name"),
        ("{prompt} {0}", r"\{0\} is not a column name"),
        ("{prompt} }", "Single '}'"),
    ],
)
def test_a_prompt_template_that_cannot_format_is_a_config_error(template, message):
    """A template that cannot format every row used to pass the load: '\\boxed{}' failed every row (the tenant ran
    out of data, a warning per row), '{label.kind}' raised from next_groups for every tenant's step."""
    with pytest.raises(DatasetError, match=r"dataset\.prompt_template=.*" + message):
        DatasetSpec(path="json", prompt_template=template)
    DatasetSpec(path="json", prompt_template="{prompt}\nPut the answer in \\boxed{{}}.")  # doubled: fine


def test_a_prompt_template_names_columns_of_the_dataset(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "q", "label": "1", "unit": "kg"}) + "\n")
    load_dataset_rows(DatasetSpec(path="json", data_files=str(path), prompt_template="{prompt} ({unit})"))
    with pytest.raises(DatasetError, match=r"names \{units\}, which is not a column.*'unit'"):
        load_dataset_rows(DatasetSpec(path="json", data_files=str(path), prompt_template="{prompt} ({units})"))


def test_add_adapter_validates_arguments(tokenizer):
    source = MultiLoRADataSource(tokenizer)
    add(source, "a", rows("a", 2))
    with pytest.raises(DatasetError, match="already in the data source"):
        add(source, "a", rows("a", 2))
    with pytest.raises(DatasetError, match="prompts_per_step=0"):
        add(source, "b", rows("b", 2), ppp=0)
    with pytest.raises(DatasetError, match="max_epochs=0"):
        add(source, "b", rows("b", 2), max_epochs=0)
    with pytest.raises(DatasetError, match="seed=-1"):
        add(source, "b", rows("b", 2), seed=-1)


# -- a reviewer's cases: rows that crashed every tenant's step, rendered unlike TRL, or changed type on the way -----


def test_a_row_the_chat_template_refuses_is_a_bad_row_not_a_crash(tokenizer):
    """A `developer` role (or a message without content) made the template raise inside `next_groups`, which draws
    every tenant's prompts at once: the step failed for all of them, and resume met the same row again."""
    strict = make_tokenizer(
        "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('role must be system, user or assistant') }}{% endif %}"
        "<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    data = [
        {"prompt": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "1+1?"}], "label": "2"},
        {"prompt": [{"role": "tool", "content": "{}"}], "label": "3"},
        {"prompt": [{"role": "user", "content": "2+2?"}], "label": "4"},
    ]
    source = MultiLoRADataSource(strict)
    add(source, "a", tuple(data), ppp=3, n=1, max_epochs=1)
    assert labels(source.next_groups(["a"])["a"]) == ["4"]
    assert source.stats("a")["bad_row_reasons"] == {"chat_template_error": 2}


def test_a_conversation_ending_in_an_assistant_turn_is_continued_as_trl_renders_it(tokenizer):
    data = [{"prompt": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is"}], "label": "4"}]
    source = MultiLoRADataSource(tokenizer)
    add(source, "a", data, ppp=1, n=1)
    (group,) = source.next_groups(["a"])["a"]
    assert group[0].prompt == "<|user|>2+2?<eos><|assistant|>It is"  # no closed turn, no new empty assistant turn


def test_an_empty_label_is_a_bad_row(tokenizer):
    """Admission called such rows unusable but the stream served them, and exact_match paid 1.0 for an empty answer."""
    source = MultiLoRADataSource(tokenizer)
    data = (
        {"prompt": "a", "label": ""},
        {"prompt": "b", "label": "  "},
        {"prompt": "c", "label": "ok"},
        {"prompt": "d", "label": 0},
    )  # fmt: skip  (mixed label types: a plain sequence, not arrow)
    add(source, "a", data, ppp=4, n=1, max_epochs=1)
    assert sorted(labels(source.next_groups(["a"])["a"]), key=str) == [0, "ok"]
    assert source.stats("a")["bad_row_reasons"] == {"missing_label": 2}


def test_csv_columns_are_the_text_the_file_holds(tmp_path):
    """Inferred types made "007" the int 7 and, with one empty cell in the column, 72 the float 72.0: a reward
    comparing text scored right answers 0. A compressed file is read by its inner extension, not sent to the Hub."""
    import gzip

    text = "question,answer\nq1,72\nq2,\nq3,007\n"
    (tmp_path / "d.csv").write_text(text)
    with gzip.open(tmp_path / "d.csv.gz", "wt") as fh:
        fh.write(text)
    for path in ("d.csv", "d.csv.gz"):
        got = load_dataset_rows(DatasetSpec(path=str(tmp_path / path), prompt_key="question", label_key="answer"))
        assert got["answer"] == ["72", None, "007"], path
    with pytest.raises(DatasetError, match="does not exist"):  # fast and clear, not ~20 s of Hub retries
        load_dataset_rows(DatasetSpec(path="no_such_file.jsonl.gz", prompt_key="question", label_key="answer"))


def test_a_rows_other_columns_reach_the_reward_and_the_sources_keys_are_said(tokenizer, caplog):
    """TRL hands a reward function every column of the row; here they were dropped (a `test_cases` column could not
    reach a code reward without packing it into the metadata column). They are `metadata["columns"]`. A row whose
    metadata reuses a key the source writes (row_index, epoch, ...) had it replaced silently: said once now."""
    data = [{"prompt": "q", "label": "1", "difficulty": 3, "tests": ["a", "b"], "meta": {"epoch": "2023", "k": 1}}]
    source = MultiLoRADataSource(tokenizer)
    spec = DatasetSpec(path="inline", metadata_key="meta")
    with caplog.at_level("WARNING"):
        add(source, "a", data, ppp=1, n=2, spec=spec)
        (group,) = source.next_groups(["a"])["a"]
        source.next_groups(["a"])
    meta = group[0].metadata
    assert meta["columns"] == {"difficulty": 3, "tests": ["a", "b"]} and meta["k"] == 1 and meta["epoch"] == 0
    assert group[1].metadata["columns"] is not meta["columns"]  # each sample its own copy
    warned = [r.message for r in caplog.records if "data source's" in r.message]
    assert len(warned) == 1 and "['epoch']" in warned[0]


def test_a_tenant_near_the_end_of_its_budget_asks_only_for_what_is_left(tokenizer):
    """A reviewer's case: under rollout.max_rows_per_step a tenant with one group left still asked for
    prompts_per_step, and fair shares held back rows for groups it never drew (a 16-row step ran 12 rows, the other
    tenant asking for more)."""
    source = MultiLoRADataSource(tokenizer)
    add(source, "epochs", rows("e", 10), ppp=4, n=3, max_epochs=0.5)  # 5 rows
    add(source, "rows", rows("r", 10), ppp=4, n=3, slot=1, max_rows=6)
    add(source, "open", rows("o", 10), ppp=4, n=3, slot=2)
    assert [source.ask(n) for n in ("epochs", "rows", "open")] == [(4, 3), (4, 3), (4, 3)]
    source.next_groups(["epochs", "rows", "open"])
    assert [source.ask(n) for n in ("epochs", "rows", "open")] == [(1, 3), (2, 3), (4, 3)]
    source.next_groups(["epochs", "rows"])
    assert source.exhausted("epochs") and source.exhausted("rows")
