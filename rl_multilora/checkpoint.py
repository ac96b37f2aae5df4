"""Per-adapter checkpoints and run state, written atomically; resume restores each tenant on its own.

Layout:
    RUN_DIR/run_state.json                       controller registry + global step (atomic replace)
    RUN_DIR/adapters/<name>/step_<k>/            one checkpoint, k = the adapter's own step
        adapter_config.json, adapter_model.safetensors   the PEFT folder (loads in PEFT as it is)
        optimizer.safetensors + trainer_state.json        AdamW moments (tensors) + scheduler/step (JSON)
        data_state.json                                   the adapter's data-source cursor
        checkpoint.json                                   counters; written last, its presence marks completeness

Design choices (PRIOR_ART):
- A checkpoint is built in `.tmp-*` next to its final place and renamed into place, so a crash leaves either the
  previous checkpoint or the new one. Folders without `checkpoint.json` (or with the temp prefix) are ignored.
- The newest checkpoint is found from `checkpoint.json`'s `adapter_step`, never by parsing folder names.
- Restore happens after the adapter's slot exists (the adapter was added, so the load lands in an initialized slot),
  and restores the data cursor too, so a resumed tenant sees exactly the prompts it would have seen.
- Nothing is unpickled: tensors are safetensors, everything else JSON. Optimizer state dicts are flattened into
  tensors + a JSON skeleton (`flatten_tree` / `unflatten_tree`), preserving int keys.
- Each adapter resumes independently: by the isolation invariant its trajectory depends only on its own state.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

CKPT_META = "checkpoint.json"


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}-")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


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


def list_checkpoints(adapter_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of one adapter, oldest first, by the step recorded inside them."""
    found = []
    if not adapter_dir.is_dir():
        return found
    for d in adapter_dir.iterdir():
        meta = d / CKPT_META
        if d.name.startswith(".tmp-") or not d.is_dir() or not meta.is_file():
            continue
        try:
            found.append((int(json.loads(meta.read_text())["adapter_step"]), d))
        except (ValueError, KeyError, json.JSONDecodeError):
            continue  # a damaged meta file means an incomplete checkpoint: skip it
    return sorted(found)


class CheckpointManager:
    def __init__(self, run_dir: Path, keep_last: int = 2):
        self.run_dir = Path(run_dir)
        self.keep_last = keep_last

    def adapter_dir(self, name: str) -> Path:
        return self.run_dir / "adapters" / name

    def latest(self, name: str) -> Path | None:
        cks = list_checkpoints(self.adapter_dir(name))
        return cks[-1][1] if cks else None

    def find(self, name: str, step: int | None = None) -> Path | None:
        for s, d in reversed(list_checkpoints(self.adapter_dir(name))):
            if step is None or s == step:
                return d
        return None

    # -- adapters -------------------------------------------------------------------------------------------------
    def save_adapter(self, name: str, rt) -> Path:
        rec = rt.controller.get(name)
        adir = self.adapter_dir(name)
        adir.mkdir(parents=True, exist_ok=True)
        final = adir / f"step_{rec.adapter_step}"
        tmp = Path(tempfile.mkdtemp(dir=adir, prefix=f".tmp-step_{rec.adapter_step}-"))
        try:
            rt.model.export_adapter(name, tmp)
            save_tree(rt.trainer.optimizer_state_dict(name), tmp, "optimizer")
            (tmp / "data_state.json").write_text(json.dumps(rt.data.state_dict(name)))
            meta = {
                "adapter": name,
                "adapter_step": rec.adapter_step,
                "global_step": rt.controller.global_step,
                "weight_version": rt.sync_.versions.get(name),
                # The adapter's randomness (init, data order, sampling seeds) derives from its own seed and the
                # counters in data_state.json, not from global RNGs shared by every tenant; record the seed.
                "rng": {"adapter_seed": rec.cfg.seed, "sampling_seed_counter": "data_state.json"},
                "config": rec.cfg.model_dump(mode="json"),
            }
            (tmp / CKPT_META).write_text(json.dumps(meta, indent=1))
            if final.exists():  # same step saved twice (e.g. periodic then drain): replace as a whole
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune(name)
        return final

    def _prune(self, name: str) -> None:
        cks = list_checkpoints(self.adapter_dir(name))
        for _, d in cks[: max(0, len(cks) - self.keep_last)]:
            shutil.rmtree(d, ignore_errors=True)

    def restore_adapter(self, name: str, rt) -> Path | None:
        """Load the newest complete checkpoint into the (already added) adapter; None when there is none."""
        ck = self.latest(name)
        if ck is None:
            return None
        cfg = json.loads((ck / "adapter_config.json").read_text())
        rt.model.load_adapter_state_dict(name, load_file(str(ck / "adapter_model.safetensors")), cfg)
        rt.trainer.load_optimizer_state_dict(name, load_tree(ck, "optimizer"))
        rt.data.load_state_dict(name, json.loads((ck / "data_state.json").read_text()))
        meta = json.loads((ck / CKPT_META).read_text())
        rec = rt.controller.get(name)
        rec.adapter_step = int(meta["adapter_step"])
        rec.last_checkpoint = str(ck)
        return ck

    # -- run state ------------------------------------------------------------------------------------------------
    def save_run_state(self, rt) -> None:
        atomic_write_text(self.run_dir / "run_state.json", json.dumps(rt.controller.state_dict(), indent=1))

    def restore_run_state(self, rt) -> bool:
        """Bring back the global step and the adapters that already finished (so they are not retrained)."""
        from rl_multilora.config import AdapterConfig
        from rl_multilora.controller import AdapterRecord, AdapterState

        path = self.run_dir / "run_state.json"
        if rt.cfg.checkpoint.resume == "never" or not path.is_file():
            if rt.cfg.checkpoint.resume == "always":
                raise FileNotFoundError(f"checkpoint.resume: 'always' but {path} does not exist")
            return False
        state = json.loads(path.read_text())
        rt.controller.global_step = int(state["global_step"])
        for name, s in state["adapters"].items():
            st = AdapterState(s["state"])
            if st in (AdapterState.DRAINED, AdapterState.REMOVED, AdapterState.FAILED):
                rec = AdapterRecord(cfg=AdapterConfig.model_validate(s["config"]), state=st)
                rec.adapter_step = s["adapter_step"]
                rec.reason = s.get("reason")
                rec.last_checkpoint = s.get("last_checkpoint")
                rec.last_reward = s.get("last_reward")
                rt.controller.records[name] = rec
        return True
