"""WeightSync: after each step, one engine pause that pushes every changed adapter and unloads departed ones.

Only LoRA tensors travel, from memory, at their true rank (the backend's `adapter_state_dict`); the base is never
re-sent (Miles' profiling: exporting adapters through files took 66-95 % of trainer time). Every pushed adapter gets
the next weight version, which the engine stamps on every sample, so the trainer can tell stale samples from current
ones. The version and the "engine holds it" flag are the tenant's (`rl_multilora.tenants.Tenant`): the tenant
manager says what to push (with each adapter's next version) and what to unload (`TenantManager.sync_plan`), and
applies the returned `SyncStats` (`TenantManager.apply_sync`); this module writes no tenant fact. Engines are told
the version, so the embedded engine and the SGLang client number versions the same way (0, 1, 2, ...).

More tenants than slots: a changed adapter that lost its slot before the sync is still pushed, read from the host
tenant store where it waits (`LocalBackend.adapter_state_dict`); the sync never pages a tenant in.

Ordering within the pause: unload first (SGLang cannot reload a name without unloading it, and unloading must not
happen while paused in retract/in_place mode, which is why engines pause in abort mode), then push.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollout.engines.base import RolloutEngine

if TYPE_CHECKING:
    from rl_multilora.backends.base import TrainingBackend

logger = logging.getLogger(__name__)


@dataclass
class SyncStats:
    pause_s: float = 0.0
    bytes_pushed: int = 0
    bytes_gathered: int = 0  # moved between trainer ranks to gather the pushed adapters (backend.gathered_bytes)
    pushed: dict[str, int] = field(default_factory=dict)  # name -> the version the engine now holds
    adapters_unloaded: list[str] = field(default_factory=list)
    paused: bool = False

    @property
    def adapters_pushed(self) -> list[str]:
        return list(self.pushed)


class WeightSync:
    def __init__(self, engine: RolloutEngine, backend: TrainingBackend):
        self.engine = engine
        self.backend = backend
        self.pauses = 0  # total pauses, for the one-pause-per-step invariant test

    def sync(
        self,
        push: Sequence[tuple[str, int]],
        unload: Sequence[str],
        pause: bool = True,
        stats: SyncStats | None = None,
    ) -> SyncStats:
        """Pause once, unload the adapters named in `unload`, push each `(name, version)` of `push` from the
        backend's slots, resume. No-op when both are empty. `pause=False` (an asynchronous run, on an engine that
        `publishes_without_pause`): no pause; other adapters' requests keep running and an adapter's running
        requests finish on the version they started with. `stats`: filled in as the sync goes, so a caller whose
        sync raised part way still knows which unloads and pushes the engine took."""
        stats = SyncStats() if stats is None else stats
        if not push and not unload:
            return stats
        t0 = time.perf_counter()
        gathered = getattr(self.backend, "gathered_bytes", 0)  # a bare MultiLoRAModel serves as a backend too
        try:
            if pause:  # inside the try: a pause that fails part way (one engine of several) is resumed below
                self.pauses += 1
                stats.paused = True
                self.engine.pause()
            for name in unload:
                self.engine.unload_adapter(name)
                stats.adapters_unloaded.append(name)
            for name, version in push:
                tensors = self.backend.adapter_state_dict(name)
                self.engine.load_adapter(name, tensors, self.backend.peft_config(name), version=version)
                stats.bytes_pushed += sum(x.numel() * x.element_size() for x in tensors.values())
                stats.pushed[name] = version
        except BaseException:
            if pause:  # never leave the engine paused; the sync's own error is the one raised
                try:
                    self.engine.resume()
                except Exception:
                    logger.exception("weight sync: resuming the engine after a failed sync failed too")
            raise
        if pause:
            self.engine.resume()
        stats.pause_s = time.perf_counter() - t0 if pause else 0.0
        stats.bytes_gathered = getattr(self.backend, "gathered_bytes", 0) - gathered
        return stats
