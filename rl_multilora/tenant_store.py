"""The host tenant store: adapters and optimizer states of the tenants that do not sit in a model slot right now.

More tenants than slots (`model.max_tenants` > `model.max_loras`): the model keeps `max_loras` resident slots and
every other tenant's state waits here, in host memory, spilled to disk past `model.host_budget_gb`. The trainer's
per-tenant operations (`rl_multilora.train_ops.TrainOps`) page a tenant into a slot when something needs it (a GRPO
step that trains it, a client request, a checkpoint) and evict the least recently used resident tenant to make room.

Design choices:
- What is stored is exactly what the slot and the optimizer held, at the adapter's true rank: each slot tensor's
  first `rank` ranks (A `(r, in)`, B `(out, r)`, experts with their expert dim) and the same slice of every AdamW
  moment; the step counts, param-group settings and LR schedule never leave the tenant's `TenantOptimizer`. The
  ranks above `rank` hold exact zeros in the slot and in its moments (`rl_multilora.lora.layer`), so a page-in that
  zero-pads them gives back every bit: a run on few slots ends bit-identical to the same step order on enough slots
  (`tests/test_paging.py`). An idle tenant costs its true-rank adapter plus two moments: 3x its adapter bytes.
- A tenant's accumulated gradient (a Tinker client between `forward_backward` and `optim_step`) travels with it, at
  full slot shape: it is rare, and a non-finite value above the rank must still reach the norm.
- The budget counts host bytes of paged tenants; past it the least recently paged-out ones are written to
  `spill_dir` (one `torch.save` file each, read back with `weights_only`) and their host copies dropped. Spill files
  are a cache, not checkpoints: resume reads checkpoints, and the store starts empty.
- Page-in time is measured by the caller that pages (it includes the eviction that made room); the store counts
  its own spills and loads.
"""

from __future__ import annotations

import tempfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rl_multilora.errors import bad_value


@dataclass
class PagedTenant:
    """One tenant's slot and optimizer state outside the model, at its true rank."""

    rank: int
    alpha: float
    modules: frozenset[str]  # the LoRA modules / expert Parameters its slot covers
    weights: list[torch.Tensor] | None  # per slot tensor (`adapter_parameters` order), its first `rank` ranks
    moments: list[dict[str, torch.Tensor]] | None  # per slot tensor, its AdamW state (moments at true rank)
    grads: list[torch.Tensor | None] | None = None  # accumulated since its last optim_step, full slot shape
    spilled: Path | None = None  # where its tensors are while they are not in host memory

    @property
    def nbytes(self) -> int:
        tensors = [*(self.weights or []), *(self.grads or [])]
        tensors += [v for state in self.moments or [] for v in state.values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class StoreStats:
    """Counters since the store was made (callers take differences per step)."""

    page_ins: int = 0
    page_outs: int = 0
    page_in_s: float = 0.0
    page_out_s: float = 0.0
    spills: int = 0
    loads: int = 0
    by_tenant: dict[str, int] = field(default_factory=dict)  # page-ins per tenant


class TenantStore:
    """Paged-out tenants by name: host memory up to `budget_bytes` (None: no limit), the rest in `spill_dir` (a
    temporary folder when None, made on the first spill)."""

    def __init__(self, budget_bytes: int | None = None, spill_dir: str | Path | None = None):
        if budget_bytes is not None and (isinstance(budget_bytes, bool) or budget_bytes < 0):
            raise ValueError(bad_value("budget_bytes", budget_bytes, "a number of bytes >= 0 or None"))
        self.budget_bytes = budget_bytes
        self._spill_dir = Path(spill_dir) if spill_dir is not None else None
        self._tenants: OrderedDict[str, PagedTenant] = OrderedDict()  # least recently paged out first
        self.host_bytes = 0
        self.disk_bytes = 0
        self.stats = StoreStats()

    def __contains__(self, name: str) -> bool:
        return name in self._tenants

    def __len__(self) -> int:
        return len(self._tenants)

    @property
    def names(self) -> list[str]:
        return list(self._tenants)

    def spilled(self) -> list[str]:
        return [n for n, p in self._tenants.items() if p.spilled is not None]

    def put(self, name: str, paged: PagedTenant) -> None:
        """Hold `name`'s state (its tensors must already be host copies); spill past the budget."""
        if name in self._tenants:
            raise ValueError(bad_value("name", name, "a tenant that is not paged out already"))
        self._tenants[name] = paged
        self.host_bytes += paged.nbytes
        self._spill_over_budget()

    def take(self, name: str) -> PagedTenant:
        """Remove and return `name`'s state, read back from disk when it was spilled."""
        paged = self._tenants.pop(name)
        if paged.spilled is None:
            self.host_bytes -= paged.nbytes
            return paged
        path, paged.spilled = paged.spilled, None
        saved = torch.load(path, weights_only=True)
        paged.weights, paged.moments, paged.grads = saved["weights"], saved["moments"], saved["grads"]
        self.disk_bytes -= path.stat().st_size
        path.unlink()
        self.stats.loads += 1
        return paged

    def drop(self, name: str) -> None:
        """Forget `name` (a tenant that left) and its spill file."""
        paged = self._tenants.pop(name)
        if paged.spilled is not None:
            self.disk_bytes -= paged.spilled.stat().st_size
            paged.spilled.unlink()
        else:
            self.host_bytes -= paged.nbytes

    def _spill_over_budget(self) -> None:
        if self.budget_bytes is None:
            return
        for name, paged in self._tenants.items():
            if self.host_bytes <= self.budget_bytes:
                return
            if paged.spilled is None:
                self._spill(name, paged)

    def _spill(self, name: str, paged: PagedTenant) -> None:
        if self._spill_dir is None:
            self._spill_dir = Path(tempfile.mkdtemp(prefix="rl-multilora-paged-"))
        self._spill_dir.mkdir(parents=True, exist_ok=True)
        path = self._spill_dir / f"{name}.pt"
        nbytes = paged.nbytes
        torch.save({"weights": paged.weights, "moments": paged.moments, "grads": paged.grads}, path)
        paged.weights = paged.moments = paged.grads = None
        paged.spilled = path
        self.host_bytes -= nbytes
        self.disk_bytes += path.stat().st_size
        self.stats.spills += 1
