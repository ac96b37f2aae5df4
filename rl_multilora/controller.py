"""MultiLoRAController: the registry of tenants, their states, slots and step counters.

States only move forward: PENDING -> RUNNING -> DRAINING -> DRAINED -> REMOVED, and any live state -> FAILED.
- PENDING: registered and validated, waiting for a free slot; starts at the next step once it has one.
- RUNNING: gets prompts every step.
- DRAINING: gets no new prompts; its in-flight samples still finish and train, then it is checkpointed.
- DRAINED: final checkpoint written; its slot is freed and the engine unloads it at the next sync.
- REMOVED: unloaded everywhere; the record stays for status and metrics.
- FAILED: stopped for a reason (kept in `reason`); its last good weights are checkpointed and its slot freed.

The controller owns no tensors: it decides who trains; the model, trainer, data source and weight sync act on it.
Step counters: `adapter_step` advances only through `mark_trained`, called for adapters whose optimizer stepped,
so an adapter that got no usable samples in a step does not skip data it never trained on (Miles #1141 review).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from rl_multilora.config import AdapterConfig


class AdapterState(str, enum.Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    DRAINING = "DRAINING"
    DRAINED = "DRAINED"
    REMOVED = "REMOVED"
    FAILED = "FAILED"


_ORDER = [
    AdapterState.PENDING,
    AdapterState.RUNNING,
    AdapterState.DRAINING,
    AdapterState.DRAINED,
    AdapterState.REMOVED,
]
_LIVE = {AdapterState.PENDING, AdapterState.RUNNING, AdapterState.DRAINING}


class ControllerError(ValueError):
    """A registry operation that the current state does not allow (clear message, no state change)."""


@dataclass
class AdapterRecord:
    cfg: AdapterConfig
    state: AdapterState = AdapterState.PENDING
    slot: int | None = None
    adapter_step: int = 0
    reason: str | None = None
    last_reward: float | None = None
    last_checkpoint: str | None = None
    registered_at: float = field(default_factory=time.time)
    # Consecutive steps that failed (non-finite loss, all rewards failing); reset by a good step.
    nonfinite_streak: int = 0

    @property
    def name(self) -> str:
        return self.cfg.name

    def to_status(self) -> dict:
        return {
            "name": self.name,
            "state": self.state.value,
            "slot": self.slot,
            "adapter_step": self.adapter_step,
            "max_steps": self.cfg.max_steps,
            "last_reward": self.last_reward,
            "last_checkpoint": self.last_checkpoint,
            "reason": self.reason,
        }


class MultiLoRAController:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.records: dict[str, AdapterRecord] = {}
        self.global_step = 0

    # -- registry -------------------------------------------------------------------------------------------------
    def register(self, cfg: AdapterConfig) -> AdapterRecord:
        """Add a validated adapter as PENDING. A name may be reused only after its previous tenant left."""
        old = self.records.get(cfg.name)
        if old is not None and old.state in _LIVE | {AdapterState.DRAINED}:
            raise ControllerError(f"name: {cfg.name!r} -> an adapter with this name is already {old.state.value}")
        rec = AdapterRecord(cfg=cfg)
        self.records[cfg.name] = rec
        return rec

    def get(self, name: str) -> AdapterRecord:
        if name not in self.records:
            known = ", ".join(sorted(self.records)) or "none"
            raise ControllerError(f"adapter {name!r} is not registered (known: {known})")
        return self.records[name]

    def in_state(self, *states: AdapterState) -> list[AdapterRecord]:
        return [r for r in self.records.values() if r.state in states]

    def running(self) -> list[AdapterRecord]:
        return self.in_state(AdapterState.RUNNING)

    def used_slots(self) -> set[int]:
        return {r.slot for r in self.records.values() if r.slot is not None}

    def free_slots(self) -> list[int]:
        used = self.used_slots()
        return [s for s in range(self.max_loras) if s not in used]

    def all_done(self) -> bool:
        """True when no adapter is live (single-run mode exits then)."""
        return not any(r.state in _LIVE for r in self.records.values())

    # -- transitions ----------------------------------------------------------------------------------------------
    def _move(self, rec: AdapterRecord, new: AdapterState) -> None:
        if rec.state == AdapterState.FAILED or (
            new != AdapterState.FAILED and _ORDER.index(new) <= _ORDER.index(rec.state)
        ):
            raise ControllerError(f"adapter {rec.name!r}: cannot move from {rec.state.value} to {new.value}")
        rec.state = new

    def activate(self, name: str, slot: int) -> None:
        rec = self.get(name)
        self._move(rec, AdapterState.RUNNING)
        rec.slot = slot

    def pending_in_order(self) -> list[AdapterRecord]:
        return sorted(self.in_state(AdapterState.PENDING), key=lambda r: r.registered_at)

    def drain(self, name: str, reason: str | None = None) -> None:
        rec = self.get(name)
        if rec.state == AdapterState.PENDING:  # never started: nothing in flight, nothing to checkpoint
            rec.state = AdapterState.REMOVED
            rec.reason = reason
            return
        if rec.state == AdapterState.RUNNING:
            self._move(rec, AdapterState.DRAINING)
            rec.reason = reason

    def mark_drained(self, name: str) -> int | None:
        """DRAINING -> DRAINED; frees the slot and returns it."""
        rec = self.get(name)
        self._move(rec, AdapterState.DRAINED)
        slot, rec.slot = rec.slot, None
        return slot

    def mark_removed(self, name: str) -> None:
        rec = self.get(name)
        if rec.state == AdapterState.DRAINED:
            self._move(rec, AdapterState.REMOVED)

    def fail(self, name: str, reason: str) -> int | None:
        """Any live state -> FAILED; frees the slot and returns it."""
        rec = self.get(name)
        self._move(rec, AdapterState.FAILED)
        rec.reason = reason
        slot, rec.slot = rec.slot, None
        return slot

    def mark_trained(self, name: str) -> None:
        self.get(name).adapter_step += 1

    def budget_done(self, name: str, data_exhausted: bool) -> bool:
        rec = self.get(name)
        steps_done = rec.cfg.max_steps is not None and rec.adapter_step >= rec.cfg.max_steps
        return steps_done or data_exhausted

    # -- persistence ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "global_step": self.global_step,
            "adapters": {
                n: {**r.to_status(), "config": r.cfg.model_dump(mode="json"), "registered_at": r.registered_at}
                for n, r in self.records.items()
            },
        }

    def status(self) -> list[dict]:
        return [r.to_status() for r in sorted(self.records.values(), key=lambda r: r.registered_at)]
