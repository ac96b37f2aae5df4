"""Per-adapter checkpoints and run state, written atomically; resume restores each tenant on its own.

Layout:
    RUN_DIR/run_state.json                       the tenants (rl_multilora.tenants) + global step (atomic replace)
    RUN_DIR/adapters/<name>/step_<k>/            one checkpoint, k = the adapter's own step
        adapter_config.json, adapter_model.safetensors   the PEFT folder (loads in PEFT as it is)
        optimizer.safetensors + optimizer.json            AdamW moments (tensors) + scheduler (JSON skeleton)
        data_state.json                                   the adapter's data-source cursor and counters
        checkpoint.json                                   counters; written last, its presence marks completeness
    RUN_DIR/tinker/requests.sqlite               the Tinker API's request journal (`serve --tinker-port`)
    RUN_DIR/archive/<utc time>/                  what a `--fresh` start found in the run dir (nothing is deleted)

Design choices (PRIOR_ART):
- A checkpoint is built in `.tmp-*` next to its final place, fsynced, and renamed into place, so a crash leaves
  either the previous checkpoint or the new one. Folders without `checkpoint.json` (or with the temp prefix) are
  ignored, and stale temp folders are removed when the adapter is restored. Nothing is deleted before its
  replacement exists: a second checkpoint at the same adapter step (a FAILED or final save after steps that
  consumed data but did not train) gets its own folder (`step_<k>.<n>`), and pruning renames a folder to a temp
  name before removing it. A save whose state equals the newest checkpoint's (same adapter step and data cursor)
  reuses that checkpoint.
- Checkpoints are ordered by (`adapter_step`, `save_seq`) read from `checkpoint.json`, never by folder names.
- A checkpoint counts on resume only once the run state records the global step it was written in as finished
  (`steps_done` <= the run state's `global_step`); one from an unfinished step is discarded and that step is
  trained again. Otherwise a kill between an adapter's checkpoint and the end of the step would resume it past
  the step's metrics row, which was never written, and (for a drain) leave the run state saying RUNNING.
  So pruning (`keep_last`) never removes the newest checkpoint that counts while a newer one does not yet: with
  `keep_last: 1` a kill in that window would otherwise leave the adapter nothing to resume from.
  Without a run_state.json (a kill inside the very first step, or checkpoints copied into a new run dir) there is
  no record to check against and every complete checkpoint counts.
- Restore happens after the adapter's slot exists (the adapter was added, so the load lands in an initialized slot),
  and restores the data cursor too, so a resumed tenant sees exactly the prompts it would have seen. Rank, alpha,
  targets and seed must match the checkpoint; the rest of the adapter config (lr, budgets) may change on resume.
- Nothing is unpickled: tensors are safetensors, everything else JSON. Optimizer state dicts are flattened into
  tensors + a JSON skeleton (`flatten_tree` / `unflatten_tree`), preserving int keys and tuples.
- RNG: no tenant draws from a global RNG. Slot init comes from the adapter's seed, prompt order from
  (seed, epoch) and every sample's sampling seed from (seed, group counter, sample index); the counters are in
  data_state.json, so seed + cursor is the whole random state of a tenant (recorded in checkpoint.json).
- Each adapter resumes independently from its own newest checkpoint: by the isolation invariant its trajectory
  depends only on its own state, so tenants resuming from different steps still reproduce an uninterrupted run.
- metrics.jsonl on resume: the rows an adapter logged after the global step of the checkpoint it resumes from (all
  its rows when it has none) are dropped, because that adapter trains those steps again; so every adapter's series
  has each adapter step once. The file is rewritten in place behind a journal (`.metrics.jsonl.rewrite`): the
  open MetricsLogger appends to the same file, and a crash mid-rewrite is finished by the next start. The loop
  writes a step's metrics rows before it saves the run state, so a kill in between redoes that step on resume.
- Labeled checkpoints (`save_labeled`): a Tinker API client's `save_weights(name)` is a checkpoint of the same
  layout under `adapters/<its adapter name>/`, with the name (`label`) and the request id in checkpoint.json. It is
  never pruned (a client may load any name it saved) and a replayed request finds its checkpoint instead of writing
  another; `find_labeled` reads it back and `export(label=...)` (`rl-multilora export`) copies its PEFT folder.
- This module sees files only. A tenant hands it an `AdapterSnapshot` (PEFT tensors + config, optimizer state, data
  cursor, counters) and gets one back; which tenant to save or restore, and when, is `rl_multilora.tenants`'.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rl_multilora.errors import bad_value
from rl_multilora.lora import CONFIG_NAME, WEIGHTS_NAME, AdapterFolderError, read_peft_folder, write_peft_folder

CKPT_META = "checkpoint.json"
TMP_PREFIX = ".tmp-"
DAMAGED_PREFIX = ".damaged-"  # a checkpoint folder restore could not use, set aside (kept, never a candidate)
METRICS_FILE = "metrics.jsonl"
METRICS_JOURNAL = ".metrics.jsonl.rewrite"
TINKER_JOURNAL = "tinker/requests.sqlite"  # with SQLite's -wal and -shm files beside it
# Adapter config fields that shape the slot or the data stream: a checkpoint only resumes into the same values.
_MUST_MATCH = ("rank", "alpha", "target_modules", "target_parameters", "seed")


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{TMP_PREFIX}{path.name}-")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_tree(folder: Path) -> None:
    """Flush every file of `folder` and the folder itself, so the rename that follows publishes complete data."""
    for f in folder.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def flatten_tree(obj: Any, tensors: dict[str, torch.Tensor], prefix: str = "t") -> Any:
    """JSON skeleton of a nested dict/list/tuple; tensors move to `tensors` under a path key."""
    if isinstance(obj, torch.Tensor):
        key = prefix
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {
            "__dict__": [
                [flatten_tree(k, tensors, f"{prefix}.k{i}"), flatten_tree(v, tensors, f"{prefix}.{i}")]
                for i, (k, v) in enumerate(obj.items())
            ]
        }
    if isinstance(obj, list | tuple):
        items = [flatten_tree(v, tensors, f"{prefix}.{i}") for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"cannot checkpoint a value of type {type(obj).__name__} at {prefix}")


def unflatten_tree(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {unflatten_tree(k, tensors): unflatten_tree(v, tensors) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(unflatten_tree(v, tensors) for v in obj["__tuple__"])
    if isinstance(obj, list):
        return [unflatten_tree(v, tensors) for v in obj]
    return obj


def save_tree(obj: Any, folder: Path, stem: str) -> None:
    tensors: dict[str, torch.Tensor] = {}
    skeleton = flatten_tree(obj, tensors)
    save_file(tensors, str(folder / f"{stem}.safetensors"))
    (folder / f"{stem}.json").write_text(json.dumps(skeleton))


def load_tree(folder: Path, stem: str) -> Any:
    tensors = load_file(str(folder / f"{stem}.safetensors"))
    return unflatten_tree(json.loads((folder / f"{stem}.json").read_text()), tensors)


def _complete(adapter_dir: Path) -> list[tuple[tuple[int, int], Path, dict]]:
    """((adapter_step, save_seq), folder, meta) of every complete checkpoint, oldest first."""
    found = []
    if not adapter_dir.is_dir():
        return found
    for d in adapter_dir.iterdir():
        meta_file = d / CKPT_META
        if d.name.startswith((TMP_PREFIX, DAMAGED_PREFIX)) or not d.is_dir() or not meta_file.is_file():
            continue
        try:
            meta = json.loads(meta_file.read_text())
            found.append(((int(meta["adapter_step"]), int(meta.get("save_seq", 0))), d, meta))
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            continue  # a damaged meta file means an incomplete checkpoint: skip it
        except OSError:  # pruned by the training thread between the listing and the read (a submission's check)
            continue
    return sorted(found, key=lambda f: (f[0], f[1].name))


def list_checkpoints(adapter_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of one adapter, oldest first, by the step (then save order) recorded inside them."""
    return [(key[0], d) for key, d, _ in _complete(Path(adapter_dir))]


def prune_metrics(run_dir: Path, after: dict[str, int | None]) -> int:
    """Drop metrics.jsonl rows of adapter `n` with step > after[n] (all of its rows when None); returns the count.

    Lines that do not parse (a row torn by a kill mid-write) are dropped too. The rewrite goes through a journal,
    in place, so the MetricsLogger's open append handle keeps pointing at the file.
    """
    run_dir = Path(run_dir)
    path, journal = run_dir / METRICS_FILE, run_dir / METRICS_JOURNAL
    _finish_metrics_rewrite(path, journal)
    if not path.is_file():
        return 0
    text = path.read_text()
    keep, dropped = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            name, step = row["adapter"], int(row["step"])
        except (ValueError, KeyError, TypeError):
            dropped += 1
            continue
        if name in after and (after[name] is None or step > after[name]):
            dropped += 1
            continue
        keep.append(line + "\n")
    torn_tail = bool(text) and not text.endswith("\n")
    if dropped or torn_tail:
        atomic_write_text(journal, "".join(keep))
        _finish_metrics_rewrite(path, journal)
    return dropped


def _finish_metrics_rewrite(path: Path, journal: Path) -> None:
    """Copy a pending journal over metrics.jsonl in place (idempotent, so a crash here is finished next time)."""
    if not journal.is_file():
        return
    text = journal.read_text()
    with path.open("r+" if path.exists() else "w") as fh:
        fh.write(text)
        fh.truncate()
        fh.flush()
        os.fsync(fh.fileno())
    journal.unlink()


@dataclass
class AdapterSnapshot:
    """Everything a tenant hands a checkpoint, and gets back on restore.

    `tensors`/`peft_config` are its PEFT folder (LoRA tensors only, true rank), `optimizer` its optimizer and LR
    schedule state, `data_state` its data-source cursor; `meta` the counters and config written to checkpoint.json
    (`adapter_step`, `global_step`, `steps_done`, `weight_version`, `state`, `note`, `config`, ...).
    """

    tensors: dict[str, torch.Tensor]
    peft_config: dict[str, Any]
    optimizer: dict[str, Any]
    data_state: dict[str, Any]
    meta: dict[str, Any]

    @property
    def adapter_step(self) -> int:
        return int(self.meta["adapter_step"])


class DamagedCheckpoint(ValueError):
    """A checkpoint folder that cannot be read back (truncated or garbage files); says which folder and why."""


class RunStateError(ValueError):
    """A run_state.json that cannot be read, or one of another base; names the file (the CLI exits 2 with this
    message)."""


def base_identity(model_path: str) -> dict[str, Any]:
    """What identifies a run's base in its run_state.json: the path as resolved, and for a local folder a fingerprint
    of its `config.json` (less the saving library's version and `_` keys) and its safetensors headers (every
    tensor's name, dtype and shape; no weight is read, so a 135M model and a 70B one cost alike). A Hub id is its
    own identity (fingerprint None)."""
    path = Path(os.path.expanduser(model_path))
    if not path.is_dir():
        return {"path": model_path, "fingerprint": None}
    digest = hashlib.sha256()
    config = path / "config.json"
    if config.is_file():
        fields = {
            k: v for k, v in json.loads(config.read_text()).items() if k != "transformers_version" and k[:1] != "_"
        }
        digest.update(json.dumps(fields, sort_keys=True).encode())
    for weights in sorted(path.glob("*.safetensors")):
        with open(weights, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")) or b"{}")
        header.pop("__metadata__", None)
        shapes = {k: (v.get("dtype"), v.get("shape")) for k, v in header.items() if isinstance(v, dict)}
        digest.update(json.dumps(shapes, sort_keys=True).encode())
    return {"path": str(path.resolve()), "fingerprint": digest.hexdigest()}


def base_mismatch(state: dict[str, Any], current: dict[str, Any], path_given: str) -> str | None:
    """Why a run dir's run state (`state`) cannot resume on the base `current` (`base_identity`), or None. A base
    whose config or weight shapes differ would set the run's checkpoints aside as damaged; a path change alone with
    the same fingerprint (the folder moved) is allowed. Run states from before bases were recorded pass."""
    stored = state.get("base")
    if not isinstance(stored, dict):
        return None
    if stored.get("fingerprint") is not None and current["fingerprint"] is not None:
        if stored["fingerprint"] == current["fingerprint"]:
            return None
        why = "its config or weight shapes differ from this one's"
    elif stored.get("path") == current["path"]:
        return None
    else:
        why = "another model"
    return bad_value(
        "model.path",
        path_given,
        f"the base this run dir was trained on, {stored.get('path')!r} ({why}); or a new run_dir, or --fresh "
        "(which archives this run dir; nothing is deleted)",
    )


@dataclass
class AdapterWeights:
    """An adapter's LoRA weights as a checkpoint holds them (what evaluation loads; no optimizer, no cursor)."""

    path: Path
    tensors: dict[str, torch.Tensor]
    peft_config: dict[str, Any]
    adapter_step: int


def _out_error(out: Path, err: OSError) -> str:
    where = f" ({err.filename})" if err.filename and str(err.filename) != str(out) else ""
    return (
        f"OUT: {str(out)!r} cannot be written: {err.strerror or err}{where} -> give a folder you can create and write"
    )


def _refuse_checkpoint_out(out: Path) -> None:
    """FileNotFoundError naming OUT when it is, or lies inside, a run's checkpoint folder (one holding checkpoint.json)
    or a run directory's adapters/ folder (beside its run_state.json): an export there would put one adapter's weights
    beside another checkpoint's optimizer state and checkpoint.json."""
    resolved = out.resolve()
    for folder in (resolved, *resolved.parents):
        if (folder / CKPT_META).exists():
            raise FileNotFoundError(
                f"OUT: {str(out)!r} is inside the run checkpoint {str(folder)!r} (it holds {CKPT_META}) -> give a "
                f"folder outside any run's checkpoints"
            )
        if folder.name == "adapters" and (folder.parent / "run_state.json").exists():
            raise FileNotFoundError(
                f"OUT: {str(out)!r} is inside the run checkpoints {str(folder)!r} (of the run {str(folder.parent)!r}) "
                f"-> give a folder outside any run's checkpoints"
            )


class CheckpointManager:
    """The files of a run directory: adapter checkpoints, the run state, the metrics rewrite. It never sees the
    runtime: tenants hand it `AdapterSnapshot`s and get them back (`rl_multilora.tenants` decides when)."""

    def __init__(self, run_dir: Path, keep_last: int = 2, base: dict[str, Any] | None = None):
        self.run_dir = Path(run_dir)
        self.keep_last = keep_last
        self.base = base  # `base_identity` of the run's model, recorded in every run_state.json written
        self._prune_after_commit: set[str] = set()

    def adapter_dir(self, name: str) -> Path:
        return self.run_dir / "adapters" / name

    def latest(self, name: str) -> Path | None:
        cks = list_checkpoints(self.adapter_dir(name))
        return cks[-1][1] if cks else None

    def find(self, name: str, step: int | None = None) -> Path | None:
        """The newest complete checkpoint of `name` (at adapter step `step` when given), or None."""
        for s, d in reversed(list_checkpoints(self.adapter_dir(name))):
            if step is None or s == step:
                return d
        return None

    def latest_meta(self, name: str) -> tuple[Path, dict[str, Any]] | None:
        """`name`'s newest complete checkpoint and its `checkpoint.json`, or None."""
        found = _complete(self.adapter_dir(name))
        return (found[-1][1], found[-1][2]) if found else None

    def export(self, name: str, out: Path, step: int | None = None, label: str | None = None) -> Path:
        """Copy `name`'s checkpoint (newest, at adapter step `step`, or the newest labeled `label`) into `out` as a
        PEFT folder; returns the checkpoint folder. Raises FileNotFoundError naming the steps (labels) there are, or
        naming OUT when it is a file, lies inside any run's checkpoints (a folder holding checkpoint.json, or a run
        directory's adapters/), or cannot be created or written (the OS error's reason said with it)."""
        if label is not None:
            found = self.find_labeled(name, label)
            ck = found[0] if found is not None and (step is None or found[1]["adapter_step"] == step) else None
        else:
            ck = self.find(name, step)
        if ck is None:
            which = f"step {step}" if step is not None else "any step"
            which = f"label {label!r}, {which}" if label is not None else which
            steps = sorted({s for s, _ in list_checkpoints(self.adapter_dir(name))})
            have = f"; its checkpointed steps: {', '.join(map(str, steps))}" if steps else ""
            labels = self.labels(name)
            have += f"; its labels: {', '.join(labels)}" if labels else ""
            raise FileNotFoundError(f"no complete checkpoint of adapter {name!r} ({which}) in {self.run_dir}{have}")
        try:
            if out.exists() and not out.is_dir():
                raise FileNotFoundError(f"OUT: {str(out)!r} is a file -> give a folder (it is created if missing)")
            adapters = (self.run_dir / "adapters").resolve()
            if out.resolve().is_relative_to(adapters):  # the folder itself too
                raise FileNotFoundError(  # writing there would overwrite a checkpoint's weights (and not its config)
                    f"OUT: {str(out)!r} is inside the run's checkpoints ({adapters}) -> give a folder outside it"
                )
            _refuse_checkpoint_out(out)  # any run's checkpoints, not only this run's
            for parent in out.parents:  # a file where a folder of OUT's path would be: said as such, not ENOTDIR
                if parent.exists() and not parent.is_dir():
                    raise FileNotFoundError(f"OUT: {str(parent)!r} is a file -> give a folder whose path has no file")
            out.mkdir(parents=True, exist_ok=True)
            # A folder with adapter_config.json is a complete PEFT folder: an earlier export's config goes first, then
            # the weights and the config each land by rename, so an interrupted export never leaves new weights beside
            # an old config. A rename replaces a symlink at OUT's file names instead of writing through it (a link
            # into a run's checkpoint overwrote that checkpoint's weights).
            (out / CONFIG_NAME).unlink(missing_ok=True)
            for f in (WEIGHTS_NAME, CONFIG_NAME):
                fd, tmp = tempfile.mkstemp(dir=out, prefix=f"{TMP_PREFIX}{f}-")  # its own: two exports never share it
                os.close(fd)
                try:
                    shutil.copy2(ck / f, tmp)
                    os.replace(tmp, out / f)
                finally:  # a failed or interrupted copy leaves no temp file in OUT
                    Path(tmp).unlink(missing_ok=True)
        except FileNotFoundError as err:
            if err.errno is None:  # one of ours above, already naming OUT
                raise
            raise FileNotFoundError(_out_error(out, err)) from None
        except OSError as err:  # a read-only, full or special folder (/proc): named as OUT, not a bare errno
            raise FileNotFoundError(_out_error(out, err)) from None
        return ck

    def read_weights(
        self, name: str, step: int | None = None, folder: Path | str | None = None
    ) -> AdapterWeights | None:
        """`name`'s LoRA weights from its newest complete checkpoint (at adapter step `step` when given, or the
        checkpoint `folder`); None when there is no such checkpoint."""
        ck = Path(folder) if folder is not None else self.find(name, step)
        if ck is None:
            return None
        meta = json.loads((ck / CKPT_META).read_text())
        tensors, config = read_peft_folder(ck)
        return AdapterWeights(path=ck, tensors=tensors, peft_config=config, adapter_step=int(meta["adapter_step"]))

    # -- adapters -------------------------------------------------------------------------------------------------
    def save_adapter(self, name: str, snap: AdapterSnapshot) -> Path:
        """Write `snap` as `name`'s newest checkpoint (atomically) and prune old ones; returns its folder.

        A snapshot with the same adapter step and data cursor as the newest checkpoint, and no `note`, is already
        on disk: that checkpoint is returned and nothing is written.
        """
        adir = self.adapter_dir(name)
        adir.mkdir(parents=True, exist_ok=True)
        existing = _complete(adir)
        step = snap.adapter_step
        if snap.meta.get("note") is None and existing and existing[-1][0][0] == step:
            last = existing[-1][1]
            # Same adapter step (no optimizer step since) and same data cursor: the newest checkpoint already holds
            # exactly this state, e.g. a drain or a service stop right after a periodic save. Reuse it.
            try:
                same = json.loads((last / "data_state.json").read_text()) == json.loads(json.dumps(snap.data_state))
            except (OSError, ValueError):  # a damaged newest checkpoint is never reused: write a new one
                same = False
            if same:
                return last
        final = self._write(name, snap, existing)
        self._prune(name)
        return final

    def _write(self, name: str, snap: AdapterSnapshot, existing: list[tuple[tuple[int, int], Path, dict]]) -> Path:
        """Build the checkpoint folder in a temp folder, fsync it and rename it into place; returns its folder."""
        adir = self.adapter_dir(name)
        step = snap.adapter_step
        seq = max((key[1] for key, _, _ in existing), default=0) + 1
        final = adir / f"step_{step}"
        n = 0
        while final.exists():  # a second save at this adapter step: keep the first until pruning
            n += 1
            final = adir / f"step_{step}.{n}"
        tmp = Path(tempfile.mkdtemp(dir=adir, prefix=f"{TMP_PREFIX}{final.name}-"))
        try:
            write_peft_folder(tmp, snap.tensors, snap.peft_config)
            save_tree(snap.optimizer, tmp, "optimizer")
            (tmp / "data_state.json").write_text(json.dumps(snap.data_state))
            meta = {"adapter": name, **snap.meta, "save_seq": seq, "saved_at": time.time()}
            (tmp / CKPT_META).write_text(json.dumps(meta, indent=1))
            _fsync_tree(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    # -- labeled checkpoints (the Tinker API's save_weights) ------------------------------------------------------
    def save_labeled(self, name: str, snap: AdapterSnapshot, label: str, key: str | None = None) -> Path:
        """Write `snap` as a checkpoint of `name` that its client named `label` (Tinker's `save_weights` name);
        returns its folder. The same folder, files and atomic write as `save_adapter`, with `label` and the
        request `key` in checkpoint.json.

        Unlike `save_adapter` it is never pruned (a client may load any name it saved, at any later time) and never
        reused for another save, except a checkpoint of the same `key` already on disk: that is the same request
        replayed after a restart, and its checkpoint (what the client was told) is returned as it is.
        """
        adir = self.adapter_dir(name)
        adir.mkdir(parents=True, exist_ok=True)
        existing = _complete(adir)
        if key is not None:
            for _, d, meta in existing:
                if meta.get("request") == key:
                    return d
        labeled = AdapterSnapshot(
            snap.tensors,
            snap.peft_config,
            snap.optimizer,
            snap.data_state,
            {**snap.meta, "label": label, "request": key},
        )
        return self._write(name, labeled, existing)

    def find_labeled(self, name: str, label: str) -> tuple[Path, dict[str, Any]] | None:
        """`name`'s complete checkpoint labeled `label` that was saved last, and its `checkpoint.json`, or None.
        Last saved, not highest step: a client that loaded an earlier checkpoint may save the same name again."""
        found = [(key[1], d, meta) for key, d, meta in _complete(self.adapter_dir(name)) if meta.get("label") == label]
        if not found:
            return None
        _, d, meta = max(found, key=lambda f: f[0])
        return d, meta

    def labels(self, name: str) -> list[str]:
        """The labels of `name`'s complete checkpoints, oldest first, each once."""
        return list(dict.fromkeys(m["label"] for _, _, m in _complete(self.adapter_dir(name)) if m.get("label")))

    def _prune(self, name: str, state: dict[str, Any] | None = None) -> None:
        """Keep `name`'s newest `keep_last` checkpoints and, beside them, the newest one a resume would take now.

        A checkpoint written inside a step counts only once the run state records that step as finished
        (`restore_candidates`); until then the committed one before it is the adapter's only restore point. With
        `keep_last: 1` pruning it at the save would leave a kill before the step's end nothing to resume from: the
        adapter would start over. It goes once the run state that makes a newer one count is written. `state`: that
        run state when the caller has it in hand (`write_run_state`), else it is read from disk."""
        found = _complete(self.adapter_dir(name))
        keep = {d for _, d, _ in found[-self.keep_last :]}
        if state is None:
            try:
                state = self.read_run_state()
            except RunStateError:
                return  # cannot tell which checkpoint counts: remove none (a resume reports the damaged file)
        if state is not None:
            counted = [d for _, d, meta in found if _steps_done(meta) <= int(state["global_step"])]
            if counted and counted[-1] not in keep:
                keep.add(counted[-1])
                self._prune_after_commit.add(name)  # `write_run_state` prunes it once the newer one counts
        for _, d, _ in found:
            if d not in keep:
                self._discard(d)

    def restore_candidates(self, name: str, committed_step: int | None) -> list[tuple[Path, dict[str, Any]]]:
        """`name`'s complete checkpoints that count, newest first, each with its `checkpoint.json`.

        `committed_step` is the run state's finished global step count (None without a run state): checkpoints
        written in a later, unfinished step are discarded (see the module docstring). Stale temp folders go too.
        A caller tries them in order and falls back to an older one when `read_snapshot` finds one damaged.
        """
        self.remove_stale_temps(name)
        found = _complete(self.adapter_dir(name))
        while found and committed_step is not None and _steps_done(found[-1][2]) > committed_step:
            self._discard(found.pop()[1])
        return [(ck, meta) for _, ck, meta in reversed(found)]

    def read_snapshot(self, ck: Path, meta: dict[str, Any]) -> AdapterSnapshot:
        """Read one checkpoint folder back; raises `DamagedCheckpoint` naming the file that is truncated, garbage or
        missing. Shapes against the model and the cursor against the dataset are checked where they are loaded."""
        parts: dict[str, Any] = {}
        try:  # the one adapter-folder loader: safetensors, finite, a LoRA config
            parts["tensors"], parts["peft_config"] = read_peft_folder(ck)
        except (AdapterFolderError, FileNotFoundError) as e:
            raise DamagedCheckpoint(str(e)) from None
        readers = {
            "optimizer": ("optimizer.safetensors/.json", lambda: load_tree(ck, "optimizer")),
            "data_state": ("data_state.json", lambda: json.loads((ck / "data_state.json").read_text())),
        }
        for key, (what, read) in readers.items():
            try:
                parts[key] = read()
            except Exception as e:  # noqa: BLE001 - any read failure means this folder is damaged
                raise DamagedCheckpoint(f"{ck}: {what} cannot be read ({type(e).__name__}: {e})") from e
        if not isinstance(parts["data_state"], dict):
            raise DamagedCheckpoint(f"{ck}: data_state.json is not a JSON object")
        return AdapterSnapshot(meta=meta, **parts)

    def discard(self, ck: Path) -> Path:
        """Remove one checkpoint folder of this run (a superseded journal snapshot), atomically as pruning does."""
        if self.run_dir.resolve() not in ck.resolve().parents:
            raise ValueError(f"{ck} is not a checkpoint of the run in {self.run_dir}")
        return self._discard(ck)

    def set_aside(self, ck: Path) -> Path:
        """Rename a checkpoint folder restore could not use (damaged, or not loadable) to `.damaged-<name>` and
        return the new path. Left where it was, it stayed a candidate: pruning counted it among the `keep_last`
        newest and removed good ones, and a later save at its step, finding the same data cursor, returned it instead
        of writing a new checkpoint. Kept for inspection; nothing reads or prunes it."""
        target = ck.with_name(f"{DAMAGED_PREFIX}{ck.name}")
        n = 1
        while target.exists():
            target = ck.with_name(f"{DAMAGED_PREFIX}{ck.name}.{n}")
            n += 1
        os.rename(ck, target)
        return target

    def _discard(self, ck: Path) -> Path:
        """Remove a checkpoint folder; renamed first, so a kill during rmtree leaves nothing that looks complete."""
        doomed = ck.with_name(f"{TMP_PREFIX}discard-{ck.name}")
        os.rename(ck, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        return ck

    def remove_stale_temps(self, name: str | None = None) -> list[Path]:
        """Temp files and folders a killed or failed write left: of adapter `name`'s checkpoints, or (None) of the
        whole run dir (run state, checkpoints). Only this process writes the run dir. Returns what was removed."""
        adapters = self.run_dir / "adapters"
        if name is not None:
            roots = [self.adapter_dir(name)]
        else:
            roots = [self.run_dir] + ([d for d in adapters.iterdir() if d.is_dir()] if adapters.is_dir() else [])
        removed = []
        for root in roots:
            if not root.is_dir():
                continue
            for p in root.iterdir():
                if p.name.startswith(TMP_PREFIX):
                    if p.is_dir():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        p.unlink(missing_ok=True)
                    removed.append(p)
        return removed

    # -- run state ------------------------------------------------------------------------------------------------
    @property
    def run_state_path(self) -> Path:
        return self.run_dir / "run_state.json"

    def write_run_state(self, state: dict[str, Any]) -> None:
        if self.base is not None:
            state = {**state, "base": self.base}
        atomic_write_text(self.run_state_path, json.dumps(state, indent=1))
        pending, self._prune_after_commit = self._prune_after_commit, set()
        for name in sorted(pending):  # checkpoints kept past keep_last until this commit (see `_prune`)
            self._prune(name, state)

    def read_run_state(self) -> dict[str, Any] | None:
        """The run state, or None without one; raises `RunStateError` naming the file when it is damaged."""
        path = self.run_state_path
        if not path.is_file():
            return None
        try:
            state = json.loads(path.read_text())
            int(state["global_step"])
            if not isinstance(state["adapters"], dict):
                raise TypeError("'adapters' is not an object")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise RunStateError(
                f"{path} is damaged ({type(e).__name__}: {e}); restore it from a backup, or start over with --fresh "
                "(which archives this run dir, nothing is deleted)"
            ) from None
        return state

    def has_checkpoints(self) -> bool:
        adapters = self.run_dir / "adapters"
        return adapters.is_dir() and any(list_checkpoints(d) for d in adapters.iterdir() if d.is_dir())

    def archive_previous(self) -> Path | None:
        """Move an earlier run's run_state, checkpoints, metrics rows and Tinker request journal (whose replay would
        load those checkpoints) to RUN_DIR/archive/<utc time>/. The journal must not be open."""
        state, adapters, metrics = (
            self.run_state_path,
            self.run_dir / "adapters",
            self.run_dir / METRICS_FILE,
        )
        journal = self.run_dir / TINKER_JOURNAL
        journal_files = [p for p in (journal, Path(f"{journal}-wal"), Path(f"{journal}-shm")) if p.exists()]
        has_metrics = metrics.is_file() and metrics.stat().st_size > 0
        if not (state.exists() or adapters.exists() or has_metrics or journal_files):
            return None
        dest = self._new_archive()
        for p in (state, adapters):
            if p.exists():
                os.rename(p, dest / p.name)
        for p in journal_files:
            (dest / "tinker").mkdir(exist_ok=True)
            os.rename(p, dest / "tinker" / p.name)
        if has_metrics:
            # Copied then emptied in place: the MetricsLogger already holds the file open for appending.
            shutil.copy2(metrics, dest / METRICS_FILE)
            with metrics.open("r+") as fh:
                fh.truncate()
        return dest

    def archive_adapter(self, name: str) -> Path | None:
        """Move one adapter's earlier checkpoints and metrics rows to RUN_DIR/archive/<utc time>/ (its folder under
        `adapters/`, its rows into that archive's metrics.jsonl), as `archive_previous` does for a whole run: a name
        that starts over with `checkpoint.resume: never` in a run dir that trained it before (removed, then
        submitted again). None when there was nothing of it."""
        folder = self.adapter_dir(name)
        metrics = self.run_dir / METRICS_FILE
        _finish_metrics_rewrite(metrics, self.run_dir / METRICS_JOURNAL)
        rows = [line for line in _metrics_lines(metrics) if _row_adapter(line) == name]
        if not folder.exists() and not rows:
            return None
        dest = self._new_archive(f"-{name}")
        (dest / "adapters").mkdir()
        if folder.exists():
            os.rename(folder, dest / "adapters" / name)
        if rows:
            atomic_write_text(dest / METRICS_FILE, "".join(line + "\n" for line in rows))
            prune_metrics(self.run_dir, {name: None})  # only once the copy is written
        return dest

    def _new_archive(self, suffix: str = "") -> Path:
        """A new, empty RUN_DIR/archive/<utc time><suffix>[-n]/ (`-n` when that second already has one)."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        dest, n = self.run_dir / "archive" / f"{stamp}{suffix}", 0
        while dest.exists():
            n += 1
            dest = self.run_dir / "archive" / f"{stamp}{suffix}-{n}"
        dest.mkdir(parents=True)
        return dest


def _metrics_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _row_adapter(line: str) -> str | None:
    try:
        return json.loads(line)["adapter"]
    except (ValueError, KeyError, TypeError):
        return None


def _steps_done(meta: dict) -> int:
    """Global steps that must be finished for this checkpoint to count (see the module docstring)."""
    return int(meta.get("steps_done", int(meta["global_step"]) + 1))


RUN_DIR_LOCK = ".lock"  # in a run dir: held by the process that trains into it (`hold_run_dir`)
RUN_DIR_OWNER = ".lock-owner"  # beside it: that process's pid and host, for the message a second one gets


def hold_run_dir(run_dir: Path, field: str = "run_dir", wait_s: float = 10.0):
    """An exclusive lock on `run_dir` for this process (a `filelock.FileLock`, held until its `release()` or the
    process's end), or a ConfigError naming `field` and the process that holds it. Two runs (or a run and `serve`)
    in one run dir wrote each other's checkpoints, run state and metrics rows, and both exited 0. Within one process
    it is re-entrant (a library caller's runs one after another, or one left open). It waits up to `wait_s` for a
    holder that is on its way out (a service restarted at once: its old actor's process ends a moment later)."""
    import socket

    from filelock import FileLock, Timeout

    from rl_multilora.config import ConfigError

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # /proc/x, a read-only mount, a file on the way
        raise ConfigError(
            [bad_value(field, str(run_dir), f"a folder this user can create ({e.strerror or e})")]
        ) from None
    # the resolved path: one lock object per run dir in this process, however the path is spelled
    lock = FileLock(str((run_dir / RUN_DIR_LOCK).resolve()), thread_local=False, is_singleton=True)
    try:
        lock.acquire(timeout=wait_s)
    except Timeout:
        try:
            owner = (run_dir / RUN_DIR_OWNER).read_text().strip() or "another process"
        except OSError:
            owner = "another process"
        raise ConfigError(
            [
                bad_value(
                    field,
                    str(run_dir),
                    f"a run dir no other process is training into ({owner} holds it: stop "
                    "it first, or choose another run_dir)",
                )
            ]  # fmt: skip
        ) from None
    (run_dir / RUN_DIR_OWNER).write_text(f"pid {os.getpid()} on {socket.gethostname()}\n")
    return lock


def check_compatible(name: str, now: dict, then: dict, ck: Path) -> None:
    """Raise ConfigError when adapter config `now` cannot resume checkpoint `ck`, trained with config `then`."""
    from rl_multilora.config import ConfigError

    problems = [
        bad_value(
            f"adapters.{name}.{key}",
            now.get(key),
            f"{then[key]!r}, what the checkpoint {ck} was trained with (or start over with --fresh)",
        )
        for key in _MUST_MATCH
        if key in then and now.get(key) != then[key]
    ]
    if problems:
        raise ConfigError(problems)
