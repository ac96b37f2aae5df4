"""Per-adapter prompt streams: each tenant draws prompt groups from its own dataset with its own cursor.

Design choices:
- One `_AdapterStream` per adapter. Streams share nothing but the tokenizer, so adding or removing a
  tenant never moves another tenant's cursor, and an adapter's prompts, order and sampling seeds are
  the same whether it trains alone or next to others (the isolation invariant).
- Each epoch visits the rows in a permutation derived only from `(seed, epoch)`, so the whole data
  state is `epoch + cursor + counters`: a resumed stream re-derives the permutation instead of
  storing it, and hands out exactly the prompts the uninterrupted one would have.
- Rows are validated and tokenized lazily when they are drawn (a dataset may be far larger than
  what a run consumes). A bad row (missing prompt or label, empty prompt, too many tokens, a prompt
  template that does not apply) is skipped and remembered by index, so it is counted once and never
  re-tokenized; a dataset where every row is bad reports itself exhausted instead of looping.
- Budgets: `max_epochs` counts rows visited (good or bad) over the dataset size, so 0.5 epochs is
  half a pass (rounded up to a whole row); `max_rows` counts prompts actually served. Whichever ends first exhausts the stream;
  the step in which it ends gets the groups that were still available (possibly fewer than its quota).
- `group_index` is the adapter's running group counter, not a position in the step: it is unique
  per adapter for the whole run (so groups never collide even if a step draws twice) and, with the
  adapter seed and sample index, it is the only input of the per-sample `sampling_seed`.
- `Sample.index` is the sample's position in the flattened result of one `next_groups` call (in
  the order of `names`); it is bookkeeping only and feeds no seed.
- Rows are read with `datasets`, or generated (`source: reasoning_gym`, rollout/reasoning_gym_source.py) as a plain
  list of row dicts, since different tasks' metadata has no common Arrow schema; the stream takes either.
- One file: loading (`load_dataset_rows`), the per-tenant stream (order, budget,
  cursor, bad rows) and building a row into a prompt are one contract with the checkpointed state.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import string
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import ConfigDict

from rl_multilora.errors import bad_value
from rollout.types import AdapterRef, EnvironmentSpec, RewardSpec, Sample, SamplingParams

logger = logging.getLogger(__name__)

_STATE_VERSION = 1
# What the source writes into every sample's metadata (a row's own keys of these names are replaced).
SOURCE_METADATA_KEYS = frozenset({"row_index", "epoch", "sample_index", "sampling_seed"})
# File extensions that a bare local file path may have, and the `datasets` builder that reads them.
_BUILDER_BY_EXTENSION = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
    ".arrow": "arrow",
}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst")  # `datasets` reads these compressed files as the inner format


class DatasetError(ValueError):
    """A dataset spec or dataset that cannot be used; the message names the field and the fix."""


@dataclass
class DatasetSpec:
    """Where an adapter's prompts come from and how each row becomes a prompt.

    This is also the `dataset:` section of an adapter's config: pydantic validates it there as it is (unknown keys
    are errors; each field's docstring is its help), so there is no second config type to translate from.
    """

    __pydantic_config__ = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    path: str | None = None
    """`datasets.load_dataset` path: a builder name ("json", "csv", "parquet") used with `data_files`,
    a local file or directory, or a Hub id. Required with source `datasets`."""
    name: str | None = None
    """Dataset configuration name (the `name` argument of `datasets.load_dataset`)."""
    data_files: str | list[str] | dict | None = None
    """Files for a builder path such as "json"."""
    split: str = "train"
    """Split to read."""
    prompt_key: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages ({"role", "content"})."""
    label_key: str = "label"
    """Column holding the reference answer passed to the reward function."""
    metadata_key: str | None = None
    """Optional column holding a dict of per-row metadata copied into `Sample.metadata`."""
    apply_chat_template: bool = True
    """Wrap the prompt in the tokenizer's chat template (user turn + generation prompt)."""
    system_prompt: str | None = None
    """System message (chat template) or text prepended to the prompt (no template)."""
    prompt_template: str | None = None
    """Python format string applied to a string prompt (not to chat messages) before the chat template, e.g.
    "{prompt}\\nPut the final answer in \\\\boxed{{}}."; other row columns are available by name."""
    max_prompt_tokens: int | None = None
    """Rows whose final prompt has more tokens than this are bad rows (skipped and counted)."""
    source: Literal["datasets", "reasoning_gym", "verifiers", "textarena"] = "datasets"
    """Where the rows come from: `datasets` (path, name, data_files), `reasoning_gym` (a task generated offline from
    task, config, seed, size and test_size; rows are prompt / label / metadata, split `train` or `test`) or
    `verifiers` (a verifiers environment's own rows, rollout/verifiers_env.py: task, config, size; split `train` or
    `test`) or `textarena` (one game per seed, rollout/textarena_env.py: task, config, seed, size, test_size)."""
    task: str | None = None
    """Source reasoning_gym: the task name, e.g. "basic_arithmetic" (`reasoning_gym.factory.DATASETS`). Source
    verifiers: the environment, an installed package's id or `module:attr`. Source textarena: the game's env id, e.g.
    "GuessTheNumber-v0"."""
    config: dict[str, Any] | None = None
    """Source reasoning_gym: the task's config fields other than seed and size, e.g. {"max_terms": 3}. Source
    verifiers: the environment's `load_environment` arguments. Source textarena: the game's arguments."""
    seed: int | None = None
    """Source reasoning_gym: the generator's seed (default 0); the same seed gives the same rows."""
    size: int | None = None
    """Source reasoning_gym: rows in the train split (default 500). Source verifiers: the first `size` rows of the
    split (default all)."""
    test_size: int | None = None
    """Source reasoning_gym: rows generated after the train rows for the test split (default 0; a test question that
    is also a train question is dropped)."""

    def __post_init__(self) -> None:
        if self.source in ("reasoning_gym", "verifiers", "textarena"):
            self._check_generated()
        elif not isinstance(self.path, str) or not self.path:
            raise DatasetError(bad_value("dataset.path", self.path, "a builder name, a local path or a Hub id"))
        else:
            for gym_field in _GYM_FIELDS:
                if getattr(self, gym_field) is not None:
                    raise DatasetError(
                        bad_value(
                            f"dataset.{gym_field}", getattr(self, gym_field), "null unless source: reasoning_gym"
                        )
                    )
        if not self.split:
            raise DatasetError(bad_value("dataset.split", self.split, "a split name such as 'train'"))
        for key_field in ("prompt_key", "label_key"):
            value = getattr(self, key_field)
            if not isinstance(value, str) or not value:
                raise DatasetError(bad_value(f"dataset.{key_field}", value, "a column name"))
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise DatasetError(
                bad_value("dataset.max_prompt_tokens", self.max_prompt_tokens, "an integer >= 1 or null")
            )
        if self.prompt_template is not None:
            _check_template(self.prompt_template)

    def named_by(self) -> tuple[str, Any]:
        """The field and value that name these rows in a message: `dataset.path`, or `dataset.source` for generated
        rows (which have no path)."""
        return ("dataset.path", self.path) if self.source == "datasets" else ("dataset.source", self.source)

    def describe(self) -> str:
        """These rows in a message: `dataset.path 'json'`, or `dataset.source 'textarena'` for generated rows."""
        field_name, value = self.named_by()
        return f"{field_name} {value!r}"

    def _check_generated(self) -> None:
        source = self.source
        for file_field in ("path", "name", "data_files", "metadata_key"):
            if getattr(self, file_field) is not None:
                value = getattr(self, file_field)
                raise DatasetError(bad_value(f"dataset.{file_field}", value, f"null with source: {source}"))
        for key_field, column in (("prompt_key", "prompt"), ("label_key", "label")):
            if getattr(self, key_field) != column:
                value = getattr(self, key_field)
                raise DatasetError(bad_value(f"dataset.{key_field}", value, f"{column!r} with source: {source}"))
        if not isinstance(self.task, str) or not self.task:
            what = {
                "reasoning_gym": "a reasoning-gym task name such as 'basic_arithmetic'",
                "verifiers": "a verifiers environment: an installed package's id or 'module:attr'",
                "textarena": "a textarena env id such as 'GuessTheNumber-v0'",
            }[source]
            raise DatasetError(bad_value("dataset.task", self.task, what))
        if source == "verifiers":  # the rows are the environment's prompts as its episodes will ask for them
            for unused in ("seed", "test_size", "system_prompt", "prompt_template"):
                if getattr(self, unused) is not None:
                    value = getattr(self, unused)
                    raise DatasetError(bad_value(f"dataset.{unused}", value, "null with source: verifiers"))
            if not self.apply_chat_template:
                raise DatasetError(bad_value("dataset.apply_chat_template", False, "true with source: verifiers"))
        if self.config is not None and not isinstance(self.config, Mapping):
            raise DatasetError(bad_value("dataset.config", self.config, "a mapping of the task's config fields"))
        for count_field, least in (("seed", 0), ("size", 1), ("test_size", 0)):
            value = getattr(self, count_field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise DatasetError(bad_value(f"dataset.{count_field}", value, f"an integer >= {least} or null"))


_GYM_FIELDS = ("task", "config", "seed", "size", "test_size")


def _is_local_path(path: str) -> bool:
    return "://" not in path and not any(ch in path for ch in "*?[")


def _looks_local(path: str) -> bool:
    """A path the user meant as a local file or folder (a Hub id like "openai/gsm8k" also has a slash)."""
    return path.startswith(("/", "./", "../", "~")) or os.path.splitext(path)[1].lower() in _BUILDER_BY_EXTENSION


def _check_data_files_exist(data_files: str | list[str] | dict) -> None:
    """Fail early, naming the file, instead of letting `datasets` raise from deep inside a builder."""
    if isinstance(data_files, str):
        files = [data_files]
    elif isinstance(data_files, Mapping):
        files = []
        for value in data_files.values():
            files.extend([value] if isinstance(value, str) else list(value))
    else:
        files = list(data_files)
    for file in files:
        if isinstance(file, str) and _is_local_path(file) and not os.path.exists(file):
            where = "" if os.path.isabs(file) else f" (relative to {os.getcwd()}, where this runs)"
            raise DatasetError(f"dataset.data_files: file {file!r} does not exist{where}")


def load_dataset_rows(spec: DatasetSpec):
    """Load `spec`'s split as a `datasets.Dataset` and check that the prompt and label columns exist.

    A local file is read with the builder its extension names, a directory written by
    `Dataset.save_to_disk` with `load_from_disk`; anything else goes to `datasets.load_dataset`.
    Every failure is a `DatasetError` naming the spec field at fault.
    """
    import datasets

    if spec.source == "reasoning_gym":
        return _reasoning_gym_rows(spec)
    if spec.source == "verifiers":
        from rollout.verifiers_env import generate_rows

        try:
            return generate_rows(spec.task, spec.config, spec.split, spec.size)
        except ValueError as exc:
            raise DatasetError(str(exc)) from exc
    if spec.source == "textarena":
        return _textarena_rows(spec)
    path, data_files = os.path.expanduser(spec.path), spec.data_files
    if data_files is not None:
        _check_data_files_exist(data_files)
    is_saved_dir = os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, marker)) for marker in ("state.json", "dataset_dict.json")
    )
    try:
        if is_saved_dir:
            loaded = datasets.load_from_disk(path)
            if isinstance(loaded, datasets.DatasetDict):
                if spec.split not in loaded:
                    raise DatasetError(
                        f"dataset.split={spec.split!r} not found in {path!r}; available: {sorted(loaded)}"
                    )
                loaded = loaded[spec.split]
            elif spec.split != "train":  # one saved Dataset has no splits: it is the training rows
                raise DatasetError(
                    f"dataset.split={spec.split!r} cannot be read from {path!r}: it holds one Dataset (saved without "
                    "splits); allowed: 'train', or save a DatasetDict with that split (or give eval.data_files)"
                )
            rows = loaded
        else:
            extension = _extension(path)
            if os.path.isfile(path) and extension in _BUILDER_BY_EXTENSION:  # the file, or the data_files given
                path, data_files = _BUILDER_BY_EXTENSION[extension], path if data_files is None else data_files
            elif (_looks_local(path) or extension in _BUILDER_BY_EXTENSION) and not os.path.exists(path):
                raise DatasetError(f"dataset.path={spec.path!r} does not exist")  # not sent to the Hub as an id
            features = _csv_as_text(data_files) if path == "csv" else None
            rows = datasets.load_dataset(
                path, name=spec.name, data_files=data_files, split=spec.split, features=features
            )
    except DatasetError:
        raise
    except FileNotFoundError as exc:
        raise DatasetError(f"dataset.path={spec.path!r} / data_files={spec.data_files!r}: {exc}") from exc
    except ValueError as exc:
        if "split" in str(exc).lower():
            raise DatasetError(f"dataset.split={spec.split!r} cannot be read from {spec.path!r}: {exc}") from exc
        raise DatasetError(f"dataset {spec.path!r} cannot be loaded: {exc}") from exc
    except StopIteration:  # what `datasets` raises for an empty file: a dataset without rows, which admission refuses
        return datasets.Dataset.from_dict({})
    except Exception as exc:  # datasets raises many types (hub, network, parsing): report them all the same way
        # with the cause: `datasets` wraps a parse error (the file, the line, mismatched columns) in a generic one
        cause = exc.__cause__ or exc.__context__
        why = f"{type(exc).__name__}: {exc}"
        lines = [line.strip() for line in str(cause or "").splitlines() if line.strip()]
        if lines and lines[-1] not in str(exc):  # its last line: the error itself, not a worker's traceback text
            text = lines[-1] if len(lines[-1]) <= 400 else lines[-1][:400] + "..."
            why += f" (because {type(cause).__name__}: {text})"
        raise DatasetError(f"dataset.path={spec.path!r} cannot be loaded: {why}") from exc
    _check_columns(spec, list(rows.column_names))
    return rows


def _extension(path: str) -> str:
    """`.jsonl` of `train.jsonl` and of `train.jsonl.gz` (a compressed file is read as its inner format)."""
    root, extension = os.path.splitext(path)
    if extension.lower() in _COMPRESSION:
        extension = os.path.splitext(root)[1]
    return extension.lower()


def _csv_as_text(data_files: Any) -> Any:
    """Every column of a CSV read as the text the file holds: inferred, a label "007" became 7 and a column with one
    empty cell became floats (72 -> 72.0), so a reward comparing text scored right answers 0. None when the header
    cannot be read here (the builder's inference then)."""
    import csv

    import datasets

    first = data_files
    while isinstance(first, dict | list | tuple):
        first = next(iter(first.values() if isinstance(first, dict) else first), None)
    if not isinstance(first, str) or not os.path.isfile(first) or _extension(first) != ".csv":
        return None
    import bz2
    import gzip
    import lzma

    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(os.path.splitext(first)[1].lower(), open)
    try:
        with opener(first, "rt", encoding="utf-8-sig", newline="") as fh:
            header = next(csv.reader(fh), None)
    except (OSError, UnicodeDecodeError, csv.Error):
        return None
    if not header or len(set(header)) != len(header):
        return None
    return datasets.Features({column: datasets.Value("string") for column in header})


def eval_split(spec: DatasetSpec, split: str, data_files: Any = None) -> DatasetSpec:
    """`spec` for a held-out evaluation on `split`: of `data_files` when given (a file or a list of them: that split's
    files, which `datasets` would otherwise name 'train'), else of the dataset's own files."""
    if isinstance(data_files, str | list):
        data_files = {split: data_files}
    return dataclasses.replace(spec, split=split, data_files=data_files or spec.data_files)


def _reasoning_gym_rows(spec: DatasetSpec) -> list[dict[str, Any]]:
    """The generated rows of `spec.split` (rollout/reasoning_gym_source.py), a plain list: entries of different
    tasks carry metadata of different shapes, which one Arrow schema would not hold."""
    from rollout.reasoning_gym_source import generate_rows

    return _generated_rows(spec, generate_rows)


def _textarena_rows(spec: DatasetSpec) -> list[dict[str, Any]]:
    """One game per seed (rollout/textarena_env.py), the same defaults as reasoning_gym's."""
    from rollout.textarena_env import generate_rows

    return _generated_rows(spec, generate_rows)


def _generated_rows(spec: DatasetSpec, generate_rows) -> list[dict[str, Any]]:
    """`generate_rows(task, config, seed, size, test_size, split)` with the sources' shared defaults (500 train rows,
    no test rows, seed 0); its ValueError becomes a DatasetError."""
    size = 500 if spec.size is None else spec.size
    test_size = 0 if spec.test_size is None else spec.test_size
    seed = 0 if spec.seed is None else spec.seed
    try:
        return generate_rows(spec.task, spec.config, seed, size, test_size, spec.split)
    except ValueError as exc:
        raise DatasetError(str(exc)) from exc


def read_row(rows, index: int) -> Mapping[str, Any] | str:
    """Row `index` of a loaded dataset, or the reason it cannot be read (a bad row): a JSONL line that is not valid
    UTF-8 loads with its file and fails only when the row is decoded."""
    try:
        return rows[index]
    except UnicodeDecodeError:
        return "undecodable_row"


def said_reasons(reasons) -> str:
    """Skip reasons (one per row, or a mapping reason -> rows) in a message, the most common first: `20
    prompt_exceeds_context, 2 missing_q`."""
    counts = Counter(reasons) if not isinstance(reasons, Mapping) else Counter(dict(reasons))
    return ", ".join(f"{n} {reason}" for reason, n in counts.most_common())


def first_usable_row(rows, spec: DatasetSpec) -> int | None:
    """Index of the first row with a non-empty prompt and label (None when there is none): a dataset without one
    could never give a step. Undecodable rows are bad rows, counted when drawn; they never stop the search."""
    for i in range(len(rows)):
        row = read_row(rows, i)
        if not isinstance(row, str) and _filled(row.get(spec.prompt_key)) and _filled(row.get(spec.label_key)):
            return i
    return None


def _filled(value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, str | list | dict | tuple):
        return len(value) > 0 and (not isinstance(value, str) or bool(value.strip()))
    return True


def _check_columns(spec: DatasetSpec, columns: list[str]) -> None:
    for key_field in ("prompt_key", "label_key", "metadata_key"):
        column = getattr(spec, key_field)
        if column is not None and column not in columns:
            raise DatasetError(f"dataset.{key_field}={column!r} is not a column of {spec.path!r}; columns: {columns}")
    for name in template_fields(spec.prompt_template) - {"prompt"}:
        if name not in columns:
            raise DatasetError(
                f"dataset.prompt_template names {{{name}}}, which is not a column of {spec.path!r}; columns: "
                f"{columns} (and {{prompt}}, the prompt_key's text)"
            )


def template_fields(template: str | None) -> set[str]:
    """The `{name}` fields of a prompt template (checked by `_check_template`); none without one."""
    if template is None:
        return set()
    return {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}


def _check_template(template: str) -> None:
    """`dataset.prompt_template` is a `str.format` string whose fields are `{prompt}` and column names; literal braces
    are doubled. Checked at load: a template that cannot format failed every row (the tenant ran out of rows with a
    warning per row) or raised for every tenant's step."""
    allowed = "a format string containing '{prompt}', other fields column names, literal braces doubled ('{{', '}}')"
    try:
        fields = template_fields(template)
    except ValueError as e:  # an unmatched brace
        raise DatasetError(f"{bad_value('dataset.prompt_template', template, allowed)} ({e})") from None
    if "prompt" not in fields:
        raise DatasetError(bad_value("dataset.prompt_template", template, allowed))
    for name in fields:
        if not name.isidentifier():  # '' or '0' (positional: a literal brace not doubled), 'a.b' or 'a[0]'
            raise DatasetError(
                f"{bad_value('dataset.prompt_template', template, allowed)}; {{{name}}} is not a column name"
            )


@dataclass
class _PreparedRow:
    prompt: str
    prompt_ids: list[int]
    label: Any
    metadata: dict[str, Any]


@dataclass
class _AdapterStream:
    """One adapter's dataset, budget, cursor and counters."""

    ref: AdapterRef
    spec: DatasetSpec
    reward_spec: RewardSpec | None
    rows: Any  # datasets.Dataset or a sequence of dicts: anything with len() and [int] -> dict
    seed: int
    prompts_per_step: int
    n_samples_per_prompt: int
    max_epochs: float | None
    max_rows: int | None
    sampling: SamplingParams | None = None
    environment: EnvironmentSpec | None = None
    epoch: int = 0
    cursor: int = 0  # position in the current epoch's permutation
    rows_served: int = 0
    samples_served: int = 0
    group_counter: int = 0
    bad_rows: dict[int, str] = field(default_factory=dict)  # row index -> reason
    _perm_epoch: int = -1
    _perm: np.ndarray | None = None

    @property
    def n_rows(self) -> int:
        return len(self.rows)

    @property
    def positions_visited(self) -> int:
        return self.epoch * self.n_rows + self.cursor

    @property
    def epoch_limit(self) -> int | None:
        # ceil: any positive epoch budget serves at least one row; the epsilon absorbs float error (0.3 * 10).
        return math.ceil(self.max_epochs * self.n_rows - 1e-9) if self.max_epochs is not None else None

    def exhausted(self) -> bool:
        if self.n_rows == 0 or len(self.bad_rows) >= self.n_rows:
            return True
        if self.max_rows is not None and self.rows_served >= self.max_rows:
            return True
        return self.epoch_limit is not None and self.positions_visited >= self.epoch_limit

    def groups_left(self) -> int | None:
        """At most how many more groups the data budget allows (bad rows may make it fewer); None without one."""
        left = [n for n in (None if self.max_rows is None else self.max_rows - self.rows_served,
                            None if self.epoch_limit is None else self.epoch_limit - self.positions_visited)
                if n is not None]  # fmt: skip
        return max(0, min(left)) if left else None

    def permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            # The permutation depends only on (seed, epoch), so resuming needs no stored order.
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.n_rows)
            self._perm_epoch = self.epoch
        return self._perm

    def next_row(self) -> tuple[int, int] | None:
        """Advance the cursor by one row; return (row index, epoch of that row) or None when exhausted."""
        if self.exhausted():
            return None
        row_index = int(self.permutation()[self.cursor])
        epoch = self.epoch
        self.cursor += 1
        if self.cursor >= self.n_rows:
            self.epoch, self.cursor = self.epoch + 1, 0
        return row_index, epoch

    def sampling_seed(self, group: int, sample: int) -> int:
        # Only (adapter seed, group counter, sample index): the seed is the same whoever shares the batch.
        return int(np.random.SeedSequence([self.seed, group, sample]).generate_state(1)[0] & 0x7FFFFFFF)


class MultiLoRADataSource:
    """Draws each adapter's quota of prompt groups from that adapter's own dataset.

    Usage::

        source = MultiLoRADataSource(tokenizer)
        source.add_adapter(AdapterRef("a", 0), DatasetSpec("json", data_files="a.jsonl"),
                           RewardSpec(name="gsm8k"), seed=0, prompts_per_step=4, n_samples_per_prompt=8)
        groups = source.next_groups(["a"])["a"]   # 4 groups of 8 samples each
    """

    def __init__(self, tokenizer, context_len: int | None = None) -> None:
        """`context_len`: the model's context length; a row whose prompt leaves no room in it for one response token
        is a bad row of its tenant (the engine would refuse the request and fail the whole group)."""
        if tokenizer is None:
            raise DatasetError(
                "tokenizer=None is not allowed; allowed: a tokenizer (MultiLoRADataSource builds prompt_ids with it)"
            )
        self.tokenizer = tokenizer
        self.context_len = context_len
        self._streams: dict[str, _AdapterStream] = {}
        self._before_ahead: dict[str, dict[str, Any]] = {}  # cursor states from before groups drawn ahead
        self._clash_warned: set[str] = set()  # adapters told that their rows' metadata reuses the source's keys

    @property
    def adapters(self) -> list[str]:
        return list(self._streams)

    def add_adapter(
        self,
        ref: AdapterRef,
        spec: DatasetSpec,
        reward_spec: RewardSpec | None,
        *,
        seed: int,
        prompts_per_step: int,
        n_samples_per_prompt: int,
        max_epochs: float | None = None,
        max_rows: int | None = None,
        dataset=None,
        sampling: SamplingParams | None = None,
        environment: EnvironmentSpec | None = None,
    ) -> None:
        """Register adapter `ref.name` with its dataset (loaded from `spec` unless `dataset` is given).

        `dataset` may be a `datasets.Dataset` or a list of row dicts (rows missing a key become bad rows).
        `sampling` (the tenant's own settings) and `environment` (multi-turn episodes) are stamped on its samples;
        `reward_spec` may be None only with an environment.
        """
        name = ref.name
        if name in self._streams:
            raise DatasetError(f"adapter {name!r} is already in the data source; remove it first")
        if reward_spec is None and environment is None:
            raise DatasetError(f"adapter {name!r}: reward_spec=None is not allowed without an environment")
        if not isinstance(seed, int) or seed < 0:
            raise DatasetError(f"adapter {name!r}: seed={seed!r} is not allowed; allowed: a non-negative integer")
        if prompts_per_step < 1:
            raise DatasetError(
                f"adapter {name!r}: prompts_per_step={prompts_per_step!r} is not allowed; allowed: >= 1"
            )
        if n_samples_per_prompt < 1:
            raise DatasetError(
                f"adapter {name!r}: n_samples_per_prompt={n_samples_per_prompt!r} is not allowed; allowed: >= 1"
            )
        if max_epochs is not None and not max_epochs > 0:
            raise DatasetError(f"adapter {name!r}: max_epochs={max_epochs!r} is not allowed; allowed: > 0 or None")
        if max_rows is not None and max_rows < 1:
            raise DatasetError(f"adapter {name!r}: max_rows={max_rows!r} is not allowed; allowed: >= 1 or None")
        if spec.apply_chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise DatasetError(
                f"adapter {name!r}: dataset.apply_chat_template=True but the tokenizer has no chat template; "
                "set apply_chat_template: false"
            )
        if dataset is None:
            rows = load_dataset_rows(spec)
        else:
            rows = dataset
            if hasattr(rows, "column_names"):
                _check_columns(spec, list(rows.column_names))
        self._streams[name] = _AdapterStream(
            ref=ref,
            spec=spec,
            reward_spec=reward_spec,
            sampling=sampling,
            environment=environment,
            rows=rows,
            seed=seed,
            prompts_per_step=prompts_per_step,
            n_samples_per_prompt=n_samples_per_prompt,
            max_epochs=max_epochs,
            max_rows=max_rows,
        )

    def remove_adapter(self, name: str) -> None:
        """Forget adapter `name` and its cursor; no other adapter's state changes."""
        self._stream(name)
        del self._streams[name]
        self._before_ahead.pop(name, None)

    def next_groups(
        self, names: list[str], quotas: Mapping[str, int] | None = None, ahead: bool = False
    ) -> dict[str, list[list[Sample]]]:
        """For each adapter in `names`, up to `prompts_per_step` groups of `n_samples_per_prompt` samples (or up to
        `quotas[name]` groups, when a step's row cap splits it by fair share).

        An adapter whose budget ends mid-step gets the groups still available; an exhausted one gets [].
        `ahead`: groups of a later step, drawn before they train (an asynchronous run): until `settle(name)`,
        `state_dict(name)` is the state from before this draw, so a checkpoint resumes by drawing them again.
        """
        streams = [self._stream(name) for name in names]
        if len(set(names)) != len(names):
            raise DatasetError(f"names={names!r} is not allowed; allowed: each adapter at most once")
        if ahead:
            for name in names:
                self._before_ahead.pop(name, None)
                self._before_ahead[name] = self.state_dict(name)
        out: dict[str, list[list[Sample]]] = {}
        position = 0
        for stream in streams:
            groups = []
            for _ in range((quotas or {}).get(stream.ref.name, stream.prompts_per_step)):
                group = self._next_group(stream, position)
                if group is None:
                    break
                position += len(group)
                groups.append(group)
            out[stream.ref.name] = groups
        return out

    def ask(self, name: str) -> tuple[int, int]:
        """(groups, rows per group) adapter `name` asks for in a step: `prompts_per_step`, or fewer when its data
        budget ends sooner (an ask past it kept a fair share of a capped step for groups never drawn, which went to
        no one)."""
        stream = self._stream(name)
        left = stream.groups_left()
        groups = stream.prompts_per_step if left is None else max(1, min(stream.prompts_per_step, left))
        return groups, stream.n_samples_per_prompt

    def exhausted(self, name: str) -> bool:
        """True when the adapter's data budget (epochs or rows) is used up or it has no usable row."""
        return self._stream(name).exhausted()

    def first_usable_row(self, spec: DatasetSpec, rows) -> tuple[int | None, Counter]:
        """The index of the first of `rows` this source would train on under `spec` (its chat template, system
        prompt, max_prompt_tokens and the model's context all applied, as when it is drawn), or None, and the skip
        reasons of the rows before it: what `--dry-run` checks, where `first_usable_row` (the module's) only looks
        for a filled prompt and label."""
        stream = _AdapterStream(AdapterRef("(validation)", -1), spec, None, rows, 0, 1, 1, None, None)
        self._clash_warned.add(stream.ref.name)  # no metadata warning for a check
        skipped: Counter = Counter()
        for i in range(len(rows)):
            got = self._prepare_row(stream, i)
            if not isinstance(got, str):
                return i, skipped
            skipped[got] += 1
        return None, skipped

    def unusable(self, name: str) -> str | None:
        """Why none of the adapter's rows can be trained on (every row skipped as bad: a chat template that refuses
        them, a prompt over max_prompt_tokens, ...), or None while some row can. Its data is then "exhausted" too,
        which is no budget reached: the adapter trained nothing."""
        stream = self._stream(name)
        if stream.n_rows == 0 or len(stream.bad_rows) < stream.n_rows:
            return None
        return f"no usable row: all {stream.n_rows} rows of its dataset were skipped ({said_reasons(stream.bad_rows.values())})"

    def stats(self, name: str) -> dict[str, Any]:
        """Counters for metrics: rows and samples served, epoch progress, bad rows by reason."""
        stream = self._stream(name)
        reasons = dict(Counter(stream.bad_rows.values()))
        return {
            "rows_served": stream.rows_served,
            "samples_served": stream.samples_served,
            "groups_served": stream.group_counter,
            "epoch": stream.epoch,
            "epoch_progress": stream.positions_visited / stream.n_rows if stream.n_rows else 0.0,
            "cursor": stream.cursor,
            "n_rows": stream.n_rows,
            "bad_rows": len(stream.bad_rows),
            "bad_row_reasons": reasons,
            "exhausted": stream.exhausted(),
        }

    def settle(self, names: Collection[str]) -> None:
        """The groups drawn ahead for `names` are now this step's: `state_dict` includes them again."""
        for name in names:
            self._before_ahead.pop(name, None)

    def unwind(self, names: Collection[str]) -> None:
        """The groups drawn ahead for `names` will never train (the tenant left): their cursors go back to before
        that draw, so a later draw (or the tenant's final checkpoint) has those rows again."""
        for name in names:
            before = self._before_ahead.get(name)
            if before is not None:
                self.load_state_dict(name, before)

    def state_dict(self, name: str) -> dict[str, Any]:
        """JSON-serializable cursor state; the per-epoch permutation is re-derived from (seed, epoch)."""
        if name in self._before_ahead:
            return dict(self._before_ahead[name])
        stream = self._stream(name)
        return {
            "version": _STATE_VERSION,
            "seed": stream.seed,
            "n_rows": stream.n_rows,
            "epoch": stream.epoch,
            "cursor": stream.cursor,
            "rows_served": stream.rows_served,
            "samples_served": stream.samples_served,
            "group_counter": stream.group_counter,
            "bad_rows": {str(index): reason for index, reason in sorted(stream.bad_rows.items())},
        }

    def check_state(self, name: str, state: Mapping[str, Any]) -> None:
        """A DatasetError when `state` (a checkpoint's cursor) was taken on another dataset or seed than `name`'s
        now; nothing else is checked or changed (`load_state_dict` checks the rest)."""
        stream = self._stream(name)
        if not isinstance(state, Mapping):
            return  # damaged: load_state_dict says so
        if "seed" in state and state["seed"] != stream.seed:
            raise DatasetError(
                f"data state of {name!r}: seed={state['seed']!r} differs from the adapter's seed={stream.seed!r}; "
                "resume with the seed the run started with"
            )
        if "n_rows" in state and state["n_rows"] != stream.n_rows:
            raise DatasetError(
                f"data state of {name!r}: n_rows={state['n_rows']!r} differs from the dataset's {stream.n_rows} rows; "
                "resume with the same dataset"
            )

    def load_state_dict(self, name: str, state: Mapping[str, Any]) -> None:
        """Restore `name`'s cursor; the adapter must be added with the same seed and dataset first."""
        stream = self._stream(name)
        self._before_ahead.pop(name, None)
        if state.get("version") != _STATE_VERSION:
            raise DatasetError(
                f"data state of {name!r}: version={state.get('version')!r} is not supported (expected {_STATE_VERSION})"
            )
        missing = sorted({"seed", "n_rows"} - set(state))
        if missing:
            raise DatasetError(f"data state of {name!r}: {', '.join(missing)} missing")
        self.check_state(name, state)
        if not 0 <= state["cursor"] < max(stream.n_rows, 1):
            raise DatasetError(f"data state of {name!r}: cursor={state['cursor']!r} is outside [0, {stream.n_rows})")
        stream.epoch = int(state["epoch"])
        stream.cursor = int(state["cursor"])
        stream.rows_served = int(state["rows_served"])
        stream.samples_served = int(state["samples_served"])
        stream.group_counter = int(state["group_counter"])
        stream.bad_rows = {int(index): str(reason) for index, reason in state["bad_rows"].items()}

    # -- internals ---------------------------------------------------------------------------------

    def _stream(self, name: str) -> _AdapterStream:
        try:
            return self._streams[name]
        except KeyError:
            raise DatasetError(f"adapter {name!r} is not in the data source; known: {sorted(self._streams)}") from None

    def _next_group(self, stream: _AdapterStream, position: int) -> list[Sample] | None:
        """Skip bad rows until a good one; build its group. None when the budget ends first."""
        while True:
            drawn = stream.next_row()
            if drawn is None:
                return None
            row_index, epoch = drawn
            if row_index in stream.bad_rows:
                continue
            prepared = self._prepare_row(stream, row_index)
            if isinstance(prepared, str):
                stream.bad_rows[row_index] = prepared
                logger.warning("adapter %r: skipping bad row %d (%s)", stream.ref.name, row_index, prepared)
                continue
            break
        group_index = stream.group_counter
        stream.group_counter += 1
        stream.rows_served += 1
        stream.samples_served += stream.n_samples_per_prompt
        group = []
        for sample_index in range(stream.n_samples_per_prompt):
            metadata = copy.deepcopy(prepared.metadata)
            metadata.update(
                row_index=row_index,
                epoch=epoch,
                sample_index=sample_index,
                sampling_seed=stream.sampling_seed(group_index, sample_index),
            )
            group.append(
                Sample(
                    prompt=prepared.prompt,
                    prompt_ids=list(prepared.prompt_ids),
                    label=copy.deepcopy(prepared.label),
                    group_index=group_index,
                    index=position + sample_index,
                    metadata=metadata,
                    adapter=stream.ref,
                    reward_spec=stream.reward_spec,
                    sampling=stream.sampling,
                    environment=stream.environment,
                )
            )
        return group

    def _prepare_row(self, stream: _AdapterStream, row_index: int) -> _PreparedRow | str:
        """The row as a prompt, or the reason it is a bad row."""
        spec = stream.spec
        row = read_row(stream.rows, row_index)
        if isinstance(row, str):
            return row
        if not isinstance(row, Mapping):
            return "row_not_a_dict"
        prompt = row.get(spec.prompt_key)
        label = row.get(spec.label_key)
        if prompt is None:
            return f"missing_{spec.prompt_key}"
        if label is None or (spec.source == "datasets" and not _filled(label)):  # "" would pay an empty answer
            return f"missing_{spec.label_key}"
        if isinstance(prompt, str):
            if not prompt.strip():
                return "empty_prompt"
            if spec.prompt_template is not None:
                try:
                    prompt = spec.prompt_template.format_map({**row, "prompt": prompt})
                except Exception:  # noqa: BLE001 - a row the template cannot format (a column missing in it) is bad
                    return "prompt_template_error"
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
            messages = [dict(m) for m in prompt]  # already chat messages; the template applies as is
        else:
            return "empty_prompt" if isinstance(prompt, Sequence) and not prompt else "prompt_not_text"

        if spec.apply_chat_template:
            if spec.system_prompt is not None and messages[0].get("role") != "system":
                messages = [{"role": "system", "content": spec.system_prompt}, *messages]
            # Generated rows may name tools (a verifiers environment's): the template shows them to the model.
            tools = row.get("tools") if spec.source != "datasets" else None
            # A conversation that ends in an assistant turn is a prefill the model continues, as TRL renders it
            prefill = messages[-1].get("role") == "assistant"
            try:  # a row the template refuses (a role it does not know, a message without content) is a bad row
                text = self.tokenizer.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=not prefill, continue_final_message=prefill,
                    tokenize=False,
                )  # fmt: skip
                # The template already holds BOS/role tokens; letting the tokenizer add them again would double them.
                prompt_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            except Exception:  # noqa: BLE001 - jinja's TemplateError, UndefinedError, a TypeError: the row's fault
                return "chat_template_error"
        else:
            if len(messages) != 1 or messages[0].get("role") != "user":
                return "chat_prompt_without_template"
            text = str(messages[0]["content"])
            if spec.system_prompt is not None:
                text = f"{spec.system_prompt}\n\n{text}"
            prompt_ids = self.tokenizer(text)["input_ids"]
        if spec.max_prompt_tokens is not None and len(prompt_ids) > spec.max_prompt_tokens:
            return "prompt_too_long"
        if self.context_len is not None and len(prompt_ids) >= self.context_len:
            return "prompt_exceeds_context"
        metadata_key = "metadata" if spec.source != "datasets" else spec.metadata_key
        raw_metadata = row.get(metadata_key) if metadata_key else None
        if raw_metadata is None:
            metadata: dict[str, Any] = {}
        elif isinstance(raw_metadata, Mapping):
            metadata = dict(raw_metadata)
        else:
            metadata = {"row_metadata": raw_metadata}  # keep non-dict metadata rather than dropping the row
        if spec.source == "datasets":  # the row's other columns, as TRL hands them to reward functions
            other = {k: v for k, v in row.items() if k not in (spec.prompt_key, spec.label_key, metadata_key)}
            if other:
                metadata.setdefault("columns", other)
        clash = sorted(SOURCE_METADATA_KEYS & metadata.keys())
        if clash and stream.ref.name not in self._clash_warned:  # the source's own keys win; say so once
            self._clash_warned.add(stream.ref.name)
            logger.warning(
                "adapter %r: row metadata keys %s are the data source's (%s) and are replaced by its values; "
                "rename them in the dataset to keep them",
                stream.ref.name, clash, ", ".join(sorted(SOURCE_METADATA_KEYS)),
            )  # fmt: skip
        return _PreparedRow(prompt=text, prompt_ids=list(prompt_ids), label=label, metadata=metadata)
