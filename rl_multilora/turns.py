"""Turns: which RUNNING tenants a step takes when more are running than one step holds.

With more tenants than slots (`model.max_tenants` > `model.max_loras`) or `rollout.max_tenants_per_step`, a step
rolls out and trains at most `cap` tenants. `TurnScheduler` picks them by stride scheduling (Waldspurger & Weihl):
each tenant has a virtual time ("pass") that grows by 1 / weight every step it takes part in, and a step takes the
`cap` tenants with the smallest pass (ties: the order they were given in, i.e. registration). So over any window
every running tenant gets turns in proportion to its adapter `weight`; none starves, and a tenant that just joined
starts at the smallest pass of those running (no credit for the time before it came).

Design choices:
- The pick depends on the tenants, their weights and the passes only, never on which tenants are resident: a run
  on few slots takes the same step order as the same run on enough slots (the exactness test relies on it). The
  trainer then pages the step's tenants in.
- The passes are run state (`run_state.json`, written when a step is done): a run killed mid-step and resumed
  picks the same tenants for that step again.
- Passes are fractions of small integers' reciprocals summed in float64; ties are broken by order, so the pick is
  deterministic.
- Asynchronous runs pick one step ahead (`plan`): the next step's tenants are known while this step trains, so their
  prompts are drawn and generated ahead and their states prefetched into the trainer. The planned pick is the one
  `pick` would make then (same passes, same running tenants); the next `pick` returns it, less the tenants that
  stopped running meanwhile (a tenant admitted meanwhile waits for the step after). The plan is run state too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rl_multilora.errors import bad_value


class TurnScheduler:
    """Stride scheduling of running tenants over steps of at most `cap` tenants."""

    def __init__(self, cap: int):
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(bad_value("cap", cap, "an integer >= 1 (tenants per step)"))
        self.cap = cap
        self.passes: dict[str, float] = {}
        self.planned: list[str] | None = None  # the next step's pick, made ahead (`plan`)

    def pick(self, running: Sequence[str], weights: Mapping[str, float]) -> list[str]:
        """This step's tenants among `running` (in `running`'s order), and advance their passes: the planned pick
        when there is one and some of it still runs. Tenants no longer running are forgotten."""
        planned, self.planned = self.planned, None
        if planned is not None:
            chosen = [n for n in running if n in set(planned)]
            if chosen:
                return chosen
        return self._pick(running, weights)

    def plan(self, running: Sequence[str], weights: Mapping[str, float]) -> list[str]:
        """Pick the next step's tenants now (advancing their passes); the next `pick` returns them."""
        self.planned = self._pick(running, weights)
        return list(self.planned)

    def _pick(self, running: Sequence[str], weights: Mapping[str, float]) -> list[str]:
        known = [self.passes[n] for n in running if n in self.passes]
        floor = min(known, default=0.0)
        self.passes = {n: self.passes.get(n, floor) for n in running}
        order = {n: i for i, n in enumerate(running)}
        chosen = set(sorted(running, key=lambda n: (self.passes[n], order[n]))[: self.cap])
        for n in chosen:
            self.passes[n] += 1.0 / weights.get(n, 1.0)
        return [n for n in running if n in chosen]

    def state_dict(self) -> dict[str, Any]:
        return {"cap": self.cap, "passes": dict(self.passes), "planned": self.planned}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.passes = {str(k): float(v) for k, v in state.get("passes", {}).items()}
        planned = state.get("planned")
        self.planned = None if planned is None else [str(n) for n in planned]
