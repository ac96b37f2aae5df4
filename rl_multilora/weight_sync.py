"""WeightSync: after each step, one engine pause that pushes every changed adapter and unloads departed ones.

Only LoRA tensors travel, from memory, at their true rank (the backend's `adapter_state_dict`); the base is never
re-sent (Miles' profiling: exporting adapters through files took 66-95 % of trainer time). Every pushed adapter gets
the next weight version, which the engine stamps on every sample, so the trainer can tell stale samples from current
ones. The version and the "engine holds it" flag are the tenant's (`rl_multilora.tenants.Tenant`); engines are told
the version, so the embedded engine and the SGLang client number versions the same way (0, 1, 2, ...).

Ordering within the pause: unload first (SGLang cannot reload a name without unloading it, and unloading must not
happen while paused in retract/in_place mode, which is why engines pause in abort mode), then push.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollout.engines.base import RolloutEngine

if TYPE_CHECKING:
    from rl_multilora.backends.base import TrainingBackend
    from rl_multilora.tenants import Tenant


@dataclass
class SyncStats:
    pause_s: float = 0.0
    bytes_pushed: int = 0
    bytes_gathered: int = 0  # moved between trainer ranks to gather the pushed adapters (backend.gathered_bytes)
    adapters_pushed: list[str] = field(default_factory=list)
    adapters_unloaded: list[str] = field(default_factory=list)
    paused: bool = False


class WeightSync:
    def __init__(self, engine: RolloutEngine, backend: TrainingBackend):
        self.engine = engine
        self.backend = backend
        self.pauses = 0  # total pauses, for the one-pause-per-step invariant test

    def sync(self, push: Sequence[Tenant], unload: Sequence[Tenant]) -> SyncStats:
        """Pause once, unload `unload`, push `push` from the backend's slots, resume. No-op when both are empty."""
        stats = SyncStats()
        if not push and not unload:
            return stats
        t0 = time.perf_counter()
        gathered = getattr(self.backend, "gathered_bytes", 0)
        self.engine.pause()
        self.pauses += 1
        stats.paused = True
        try:
            for t in unload:
                self.engine.unload_adapter(t.name)
                t.in_engine = False
                stats.adapters_unloaded.append(t.name)
            for t in push:
                tensors = self.backend.adapter_state_dict(t.name)
                version = 0 if t.weight_version is None else t.weight_version + 1
                self.engine.load_adapter(t.name, tensors, self.backend.peft_config(t.name), version=version)
                t.weight_version, t.in_engine, t.dirty = version, True, False
                stats.bytes_pushed += sum(x.numel() * x.element_size() for x in tensors.values())
                stats.adapters_pushed.append(t.name)
        finally:
            self.engine.resume()
        stats.pause_s = time.perf_counter() - t0
        stats.bytes_gathered = getattr(self.backend, "gathered_bytes", 0) - gathered
        return stats
