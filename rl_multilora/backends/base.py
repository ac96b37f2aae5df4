"""The training-backend interface and the typed per-adapter result of a step.

Design choices:
- The interface is what a tenant's lifecycle and one GRPO step need, nothing more: add / remove an adapter (slot
  + optimizer), `train_step(samples)` -> `AdapterStepStats` per adapter, the adapter's PEFT state dict (its LoRA
  tensors only, at its true rank) and PEFT config, loading those back, and optimizer state out and in. A backend
  whose weights live in other processes (Ray ranks) gathers only LoRA tensors for `adapter_state_dict`, never the
  base.
- Tensors cross the seam as plain CPU-or-device tensors keyed by PEFT names; optimizer state crosses as the nested
  dict torch's `Optimizer.state_dict` gives (checkpoints flatten it to safetensors + JSON).
- The backend owns the slot numbering of its model (`add_adapter` returns the slot); the tenant records it.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from rl_multilora.batch import AdapterStepStats
    from rl_multilora.config import AdapterConfig
    from rl_multilora.lora import MultiLoRAModel
    from rl_multilora.losses import TenantAlgo
    from rl_multilora.rows import Row
    from rl_multilora.tenant_optim import AdamSettings
    from rl_multilora.train_ops import FwdBwdOut
    from rollout.types import Sample


@dataclass(frozen=True)
class PagingStats:
    """Where a paging backend's tenants are (now) and what paging cost (totals since the start)."""

    resident: int  # tenants in a model slot
    paged: int  # tenants in the host store (spilled ones included)
    spilled: int  # of those, on disk
    host_bytes: int  # host memory the paged tenants' states take
    disk_bytes: int
    page_ins: int
    page_outs: int
    page_in_s: float  # wall time of the page-ins (evictions that made room included)
    page_out_s: float
    prefetched: int = 0  # page-ins whose state a prefetch had staged while an earlier step trained


def paging_stats_of(backend: Any) -> PagingStats | None:
    """`backend.paging_stats()`, or None for an object that serves as a backend without it (a test's stand-in)."""
    stats = getattr(backend, "paging_stats", None)
    return stats() if stats is not None else None


class TrainingBackend(abc.ABC):
    """Where the trainable adapter slots live and how one GRPO step updates them."""

    @property
    @abc.abstractmethod
    def max_loras(self) -> int:
        """Slots of the model (the most adapters that train at once)."""

    @property
    def max_tenants(self) -> int:
        """Tenants that may hold a place at once: `max_loras` unless the backend pages tenants between its slots and
        a host store (`model.max_tenants`)."""
        return self.max_loras

    def paging_stats(self) -> PagingStats | None:
        """Resident vs paged tenants and the cost of paging so far; None when the backend does not page."""
        return None

    def resident(self, name: str) -> bool:
        """Whether `name` sits in a model slot now (always, for a backend that does not page)."""
        return True

    def prefetch(self, names: Sequence[str]) -> list[str]:
        """Start preparing the paged-out tenants of `names` for their page-in in the background (a coming step's
        tenants, while this step trains); returns those started. Nothing to do for a backend that does not page."""
        return []

    @property
    @abc.abstractmethod
    def lora_modules(self) -> list[str]:
        """Names of the modules the model's LoRA slots cover (what an adapter's target_modules may name)."""

    @property
    def gathered_bytes(self) -> int:
        """LoRA bytes moved between trainer ranks by `adapter_state_dict` so far (0 in one process)."""
        return 0

    @property
    def world_size(self) -> int:
        """Training processes (ranks) behind this backend."""
        return 1

    @property
    def shared_model(self) -> MultiLoRAModel | None:
        """The multi-LoRA model in this process, whose frozen base an in-process rollout engine may share; None when
        the weights live in other processes (trainer ranks), so an in-process engine loads its own copy."""
        return None

    def engine_placement(self, i: int) -> dict[str, Any]:
        """Ray actor options that colocate rollout engine `i` with this backend's trainer rank i
        (`trainer.colocate_engines`); only backends with trainer ranks have any."""
        raise ValueError(f"engine {i} cannot be colocated: {type(self).__name__} has no trainer ranks to share")

    @property
    def lora_parameters(self) -> list[str]:
        """Full names of the packed expert Parameters the model's LoRA slots cover (what an adapter's
        target_parameters may name); none unless the model has expert LoRA."""
        return []

    @property
    @abc.abstractmethod
    def adapters(self) -> list[str]:
        """Names of the adapters that hold a slot."""

    @abc.abstractmethod
    def free_slots(self) -> list[int]:
        """Slots no adapter holds, lowest first."""

    @abc.abstractmethod
    def add_adapter(self, cfg: AdapterConfig) -> int:
        """Give `cfg.name` a fresh slot (initialized from `cfg.seed`) and its own optimizer; returns the slot."""

    @abc.abstractmethod
    def remove_adapter(self, name: str) -> None:
        """Free `name`'s slot and drop its optimizer (whichever of the two it has, after a failed add); the next
        adapter in that slot sees nothing of it."""

    @abc.abstractmethod
    def train_step(
        self, samples: Sequence[Sample], current_versions: Mapping[str, int], max_steps: Mapping[str, int]
    ) -> dict[str, AdapterStepStats]:
        """One GRPO update of every adapter with rows in `samples` (at most `max_steps[name]` optimizer steps each);
        samples older than `current_versions[name]` are not trained on."""

    def add_client(self, name: str, rank: int, alpha: float, seed: int | None, target_modules: list[str]) -> int:
        """A slot and an optimizer for a Tinker client tenant (its Adam settings come with each `optim_step`);
        returns the slot."""
        raise NotImplementedError(f"{type(self).__name__} does not serve Tinker client tenants")

    def forward_backward(
        self, rows: Sequence[Row], losses: Mapping[str, TenantAlgo], backward: bool = True
    ) -> FwdBwdOut:
        """One mixed forward (and backward) over tenants' rows, each tenant's tokens under its loss in `losses`;
        each tenant's gradient accumulates in its own state until its `optim_step`."""
        raise NotImplementedError(f"{type(self).__name__} does not serve forward_backward")

    def optim_step(self, name: str, adam: AdamSettings) -> tuple[bool, float | None]:
        """Step `name` on its accumulated gradient with `adam`'s settings; (stepped, pre-clip grad norm). A step
        whose norm is not finite is skipped and the adapter stays as it was."""
        raise NotImplementedError(f"{type(self).__name__} does not serve optim_step")

    def adapter_step(self, name: str) -> int:
        """Optimizer steps `name` has taken (its schedule's count)."""
        raise NotImplementedError(f"{type(self).__name__} does not count steps")

    @property
    def max_rank(self) -> int:
        """The largest LoRA rank a slot holds."""
        raise NotImplementedError

    @abc.abstractmethod
    def adapter_state_dict(self, name: str) -> dict[str, torch.Tensor]:
        """`name`'s LoRA tensors with PEFT key names at its true rank (never base weights)."""

    @abc.abstractmethod
    def peft_config(self, name: str) -> dict[str, Any]:
        """`name`'s `adapter_config.json` content."""

    @abc.abstractmethod
    def load_adapter_state_dict(
        self, name: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], source: str
    ) -> None:
        """Write PEFT tensors into `name`'s (already added) slot; `source` names where they came from, for errors."""

    @abc.abstractmethod
    def optimizer_state_dict(self, name: str) -> dict[str, Any]:
        """`name`'s optimizer and LR-schedule state."""

    @abc.abstractmethod
    def load_optimizer_state_dict(self, name: str, state: Mapping[str, Any]) -> None:
        """Restore what `optimizer_state_dict` returned into `name` (added with the same config)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release processes or devices the backend holds."""
