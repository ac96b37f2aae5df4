"""Tenants: the one record of each adapter in a run, and the one place that moves it through its life.

A `Tenant` owns every fact about its adapter: config, state, slot, adapter step (optimizer steps taken), weight
version (what the engine was last given) and whether the engine holds a current copy. Nothing else keeps these:
the training backend, the data source and the engine act on a tenant when `TenantManager` tells them to, and the
weight sync, checkpoints and metrics read the tenant.

States only move forward: PENDING -> RUNNING -> DRAINING -> DRAINED -> REMOVED, and any live state -> FAILED.
- PENDING: registered and validated, waiting for a free slot; starts at the next step once it has one.
- RUNNING: gets prompts every step.
- DRAINING: gets no new prompts; its in-flight samples still finish and train, then it is checkpointed.
- DRAINED: final checkpoint written; its slot is freed and the engine unloads it at the next sync.
- REMOVED: unloaded everywhere; the record stays for status and metrics.
- FAILED: stopped for a reason (kept in `reason`); its last good weights are checkpointed and its slot freed.

`TenantTable` is the state machine alone (no I/O, testable on its own). `TenantManager` wraps one and is the only
writer of tenant facts: admission (every check a new adapter must pass, for single runs and the service alike),
the fan-out of each transition (start: backend slot + optimizer, data cursor, checkpoint restore, push at the next
sync; release: backend, data, unload at the next sync; retire: budget -> final checkpoint -> release; fail), the
fault policy (one setting per limit, `faults.*`, over counters the `Tenant` owns, so a name submitted again starts
clean), and the results others return to it: a step's training stats and rewards (`apply_step`), a weight sync's
pushes and unloads (`apply_sync`; DRAINED -> REMOVED once the engine no longer holds the adapter, in single runs
and the service alike), evaluations (`apply_evals`). It also persists the run state (`run_state.json`).

Client-driven tenants (the Tinker API, `rl_multilora.tinker`) are tenants of their own kind, `ClientTenant`: no
dataset, reward or GRPO optimizer (the client steps its own AdamW), never drawn for rollouts, trained or
checkpointed by the GRPO step. They take a slot of the same model (`add_client`: a free slot or a clear refusal,
never ahead of a GRPO tenant already waiting for one), count against `model.max_loras`, appear in `status`, and
leave through `release_client`, which frees the slot for the next tenant of either kind. Their durability is the
Tinker request journal, not `run_state.json`: after a restart, the clients that held slots get them back first
(`reserve_client_slots`, before the GRPO tenants are admitted; the replay then takes them), so a GRPO tenant that was
waiting still waits instead of taking a replayed client's slot.

Step counters: `adapter_step` advances by the optimizer steps the backend reports for the tenant
(`AdapterStepStats.n_steps`), so an adapter that got no usable samples does not skip data it never trained on
(Miles #1141 review), and with `grpo.ppo_epochs > 1` counter, budget (`max_steps`) and LR schedule count the same
optimizer steps. Each train step is capped at the tenant's remaining budget.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rl_multilora.backends.base import paging_stats_of
from rl_multilora.checkpoint import (
    AdapterSnapshot,
    DamagedCheckpoint,
    RunStateError,
    base_mismatch,
    check_compatible,
    prune_metrics,
)
from rl_multilora.config import CASE_REASON, AdapterConfig, ConfigError
from rl_multilora.errors import bad_value
from rl_multilora.turns import TurnScheduler
from rollout.data_source import DatasetError
from rollout.types import AdapterRef

if TYPE_CHECKING:
    from rl_multilora.backends.base import TrainingBackend
    from rl_multilora.batch import AdapterStepStats
    from rl_multilora.checkpoint import CheckpointManager
    from rl_multilora.config import RunConfig
    from rl_multilora.validate import Admission
    from rollout.data_source import MultiLoRADataSource

log = logging.getLogger("rl_multilora")


class TenantState(str, enum.Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    DRAINING = "DRAINING"
    DRAINED = "DRAINED"
    REMOVED = "REMOVED"
    FAILED = "FAILED"


_ORDER = [TenantState.PENDING, TenantState.RUNNING, TenantState.DRAINING, TenantState.DRAINED, TenantState.REMOVED]
LIVE = frozenset({TenantState.PENDING, TenantState.RUNNING, TenantState.DRAINING})
FINISHED = frozenset({TenantState.DRAINED, TenantState.REMOVED, TenantState.FAILED})


class TenantError(ValueError):
    """A tenant operation the current state does not allow (clear message, no state change)."""


@dataclass
class Tenant:
    """One adapter of the run. See the module docstring for who may change what."""

    cfg: AdapterConfig
    state: TenantState = TenantState.PENDING
    slot: int | None = None  # the backend's slot while it holds one (RUNNING, DRAINING)
    adapter_step: int = 0  # optimizer steps taken
    weight_version: int | None = None  # version of the last push (continues from a resumed checkpoint)
    in_engine: bool = False  # the engine holds a copy (pushed and not unloaded since)
    dirty: bool = False  # the slot changed since the last push: the next sync pushes it
    reason: str | None = None
    last_reward: float | None = None
    last_checkpoint: str | None = None
    registered_at: float = field(default_factory=time.time)
    admitted_at: float | None = None  # when it got its slot (its wait is admitted_at - registered_at)
    # Fault counters (`faults.*` limits); a new registration of the name is a new Tenant, so they start at 0.
    nonfinite_streak: int = 0  # consecutive steps skipped for non-finite loss/grads; reset by a good step
    idle_steps: int = 0  # consecutive global steps RUNNING without an optimizer step; reset by a step
    last_failed_reason: str | None = None  # why its samples last failed (environment, template, engine), if ever
    reward_fail_streak: int = 0  # consecutive steps whose rewards all failed (or crashed a worker); reset otherwise
    last_eval_step: int | None = None  # adapter step of its last held-out evaluation (a checkpoint keeps it)

    @property
    def name(self) -> str:
        return self.cfg.name

    def steps_left(self) -> int | None:
        """Optimizer steps left in the budget (None: no step budget)."""
        return None if self.cfg.max_steps is None else max(0, self.cfg.max_steps - self.adapter_step)

    def to_status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state.value,
            "slot": self.slot,
            "adapter_step": self.adapter_step,
            "max_steps": self.cfg.max_steps,
            "weight_version": self.weight_version,
            "last_reward": self.last_reward,
            "last_checkpoint": self.last_checkpoint,
            "reason": self.reason,
        }


@dataclass
class ClientTenant:
    """A tenant driven from outside through the Tinker API: a slot of the shared model and its step count. RUNNING
    while it holds the slot, REMOVED once released."""

    name: str
    rank: int
    slot: int | None
    state: TenantState = TenantState.RUNNING
    adapter_step: int = 0  # the client's optim_step calls
    registered_at: float = field(default_factory=time.time)

    def to_status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state.value,
            "slot": self.slot,
            "adapter_step": self.adapter_step,
            "max_steps": None,
            "weight_version": None,
            "last_reward": None,
            "last_checkpoint": None,
            "reason": "tinker client",
        }


class TenantTable:
    """The registry of tenants and their state machine; no tensors, no files."""

    def __init__(self) -> None:
        self.tenants: dict[str, Tenant] = {}
        self.clients: dict[str, ClientTenant] = {}  # Tinker-API tenants, by adapter name
        self.global_step = 0

    # -- views ----------------------------------------------------------------------------------------------------
    def get(self, name: str) -> Tenant:
        if name not in self.tenants:
            known = ", ".join(sorted(self.tenants)) or "none"
            raise TenantError(
                bad_value("adapter", name, f"a registered adapter; {name!r} is not registered (known: {known})")
            )
        return self.tenants[name]

    def in_state(self, *states: TenantState) -> list[Tenant]:
        return [t for t in self.tenants.values() if t.state in states]

    def running(self) -> list[Tenant]:
        return self.in_state(TenantState.RUNNING)

    def pending_in_order(self) -> list[Tenant]:
        """Waiting tenants in the order they get free slots: higher `priority` first, then submission order."""
        return sorted(self.in_state(TenantState.PENDING), key=lambda t: (-t.cfg.priority, t.registered_at))

    def used_slots(self) -> set[int]:
        return {t.slot for t in (*self.tenants.values(), *self.clients.values()) if t.slot is not None}

    def all_done(self) -> bool:
        """True when no adapter is live (single-run mode exits then)."""
        return not any(t.state in LIVE for t in self.tenants.values())

    def status(self) -> list[dict[str, Any]]:
        everyone: list[Tenant | ClientTenant] = [*self.tenants.values(), *self.clients.values()]
        return [t.to_status() for t in sorted(everyone, key=lambda t: t.registered_at)]

    # -- transitions ----------------------------------------------------------------------------------------------
    def case_twin(self, name: str) -> str | None:
        """Another live adapter's or running client's name equal to `name` but for letter case (their folders would
        be one folder on a case-insensitive file system), else None."""
        live = [n for n, t in self.tenants.items() if t.state in LIVE | {TenantState.DRAINED}]
        live += [n for n, c in self.clients.items() if c.state == TenantState.RUNNING]
        return next((n for n in live if n != name and n.casefold() == name.casefold()), None)

    def register(self, cfg: AdapterConfig) -> Tenant:
        """Add a validated adapter as PENDING. A name may be reused only after its previous tenant left."""
        old = self.tenants.get(cfg.name)
        if old is not None and old.state in LIVE | {TenantState.DRAINED}:
            raise TenantError(
                bad_value("name", cfg.name, f"a name no live adapter has (it is already {old.state.value})")
            )
        if (twin := self.case_twin(cfg.name)) is not None:
            raise TenantError(bad_value("name", cfg.name, f"a name no live adapter has ({twin!r} differs from it in "
                                        f"letter case only, and {CASE_REASON})"))  # fmt: skip
        t = Tenant(cfg=cfg)
        self.tenants[cfg.name] = t
        return t

    def _move(self, t: Tenant, new: TenantState) -> None:
        if t.state == TenantState.FAILED or (new != TenantState.FAILED and _ORDER.index(new) <= _ORDER.index(t.state)):
            raise TenantError(f"adapter {t.name!r}: cannot move from {t.state.value} to {new.value}")
        t.state = new

    def activate(self, name: str, slot: int) -> Tenant:
        t = self.get(name)
        self._move(t, TenantState.RUNNING)
        t.slot = slot
        return t

    def drain(self, name: str, reason: str | None = None) -> None:
        t = self.get(name)
        if t.state == TenantState.PENDING:  # never started: nothing in flight, nothing to checkpoint
            t.state = TenantState.REMOVED
            t.reason = reason
            return
        if t.state == TenantState.RUNNING:
            self._move(t, TenantState.DRAINING)
            t.reason = reason

    def mark_drained(self, name: str) -> int | None:
        """DRAINING -> DRAINED; frees the slot and returns it."""
        t = self.get(name)
        self._move(t, TenantState.DRAINED)
        slot, t.slot = t.slot, None
        return slot

    def mark_removed(self, name: str) -> None:
        t = self.get(name)
        if t.state == TenantState.DRAINED:
            self._move(t, TenantState.REMOVED)

    def mark_failed(self, name: str, reason: str) -> int | None:
        """Any live state -> FAILED; frees the slot and returns it."""
        t = self.get(name)
        self._move(t, TenantState.FAILED)
        t.reason = reason
        slot, t.slot = t.slot, None
        return slot

    # -- persistence ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "adapters": {
                n: {**t.to_status(), "config": t.cfg.model_dump(mode="json"), "registered_at": t.registered_at}
                for n, t in self.tenants.items()
            },
        }


class TenantManager:
    """The one writer of tenant facts: a `TenantTable` plus admission, the fan-out of every transition to backend,
    data source, checkpoints and sync, the fault policy, and the results of steps, syncs and evaluations."""

    def __init__(
        self, cfg: RunConfig, backend: TrainingBackend, data: MultiLoRADataSource, ckpt: CheckpointManager
    ) -> None:
        self.table = TenantTable()
        self.cfg = cfg
        self.backend = backend
        self.data = data
        self.ckpt = ckpt
        self.reserved_clients: list[str] = []  # client tenants a restart's journal replay recreates (see below)
        # More running tenants than a step holds (paging, or rollout.max_tenants_per_step): whose turn each step is.
        self.turns: TurnScheduler | None = None
        if cfg is not None and (cfg.model.paging or cfg.rollout.max_tenants_per_step):
            self.turns = TurnScheduler(
                min(cfg.model.max_loras, cfg.rollout.max_tenants_per_step or cfg.model.max_loras)
            )

    # -- views (read-only for everyone else) -----------------------------------------------------------------------
    @property
    def tenants(self) -> dict[str, Tenant]:
        return self.table.tenants

    @property
    def clients(self) -> dict[str, ClientTenant]:
        return self.table.clients

    @property
    def global_step(self) -> int:
        return self.table.global_step

    def get(self, name: str) -> Tenant:
        return self.table.get(name)

    def in_state(self, *states: TenantState) -> list[Tenant]:
        return self.table.in_state(*states)

    def running(self) -> list[Tenant]:
        return self.table.running()

    def pending_in_order(self) -> list[Tenant]:
        return self.table.pending_in_order()

    def all_done(self) -> bool:
        return self.table.all_done()

    def status(self) -> list[dict[str, Any]]:
        """Every tenant's status; with paging each live one also says whether it sits in a slot (`resident`)."""
        rows = self.table.status()
        if paging_stats_of(self.backend) is not None:
            for row in rows:
                row["resident"] = row["slot"] is not None and self.backend.resident(row["name"])
        return rows

    @property
    def max_loras(self) -> int:
        return self.backend.max_loras

    def scheduled(self) -> list[str]:
        """The RUNNING tenants this step takes: all of them, or their turns (`rl_multilora.turns`) when more are
        running than a step holds. Advances the turns: call once per step."""
        names = [t.name for t in self.running()]
        if self.turns is None:
            return names
        return self.turns.pick(names, {n: self.get(n).cfg.weight for n in names})

    def plan_next(self) -> list[str]:
        """The RUNNING tenants the next step takes, decided now (async: drawn, generated and prefetched ahead); with
        turns the next `scheduled` returns this pick (`TurnScheduler.plan`)."""
        names = [t.name for t in self.running()]
        if self.turns is None:
            return names
        return self.turns.plan(names, {n: self.get(n).cfg.weight for n in names})

    def free_slots(self) -> list[int]:
        """Slots a new tenant may take: the backend's free ones, less those held for replayed client tenants."""
        free = self.backend.free_slots()
        return free[: max(0, len(free) - len(self.reserved_clients))]

    def finish_step(self) -> None:
        """The global step is done (its metrics are written): count it and record the run state."""
        self.table.global_step += 1
        self.save_run_state()

    # -- submission -------------------------------------------------------------------------------------------------
    def admission_problems(self, a: AdapterConfig, restart: bool = False, facts=None) -> list[str]:
        """Everything that keeps `a` from being registered now (`validate.adapter_problems` judges it against what
        this run knows), each naming the field, the value and what is allowed.

        `restart`: `a` is an adapter of the run's own config being registered again at start; one whose checkpoint
        is at its budget was killed before the run state recorded it done, and leaves at once instead of being
        refused. `facts`: its `validate.OutsideFacts` when the caller read them already (`outside_facts`)."""
        from rl_multilora import validate

        admission = self.admission(a, restart)
        return validate.adapter_problems(a, admission, facts)

    def outside_facts(self, a: AdapterConfig):
        """`validate.outside_facts` of `a` under this run's eval settings: its reward, environment and datasets read
        (seconds for a large dataset), with no lock held, so the checks that need the run's state can reuse them."""
        from rl_multilora import validate

        return validate.outside_facts(a, self.cfg.eval_for(a), self.data)

    def admission(self, a: AdapterConfig, restart: bool = False) -> Admission:
        """The facts adapter `a` is admitted against: the model's LoRA, its eval, this run's checkpoints (when it
        resumes), the rollout settings and who already holds its name."""
        from rl_multilora.validate import Admission

        client, old = self.table.clients.get(a.name), self.tenants.get(a.name)
        holder = None
        if client is not None and client.state == TenantState.RUNNING:
            holder = "a Tinker client tenant has it"
        elif old is not None and old.state in LIVE | {TenantState.DRAINED}:
            holder = f"it is already {old.state.value}"
        elif (twin := self.table.case_twin(a.name)) is not None:
            holder = f"{twin!r} differs from it in letter case only, and {CASE_REASON}"
        return Admission(
            lora_modules=self.backend.lora_modules,
            lora_parameters=self.backend.lora_parameters,
            eval_settings=self.cfg.eval_for(a),
            ckpt=self.ckpt if self.cfg.checkpoint.resume != "never" else None,
            submitted=not restart,
            rollout=self.cfg.rollout,
            name_holder=holder,
            prompts=self.data,
        )

    def submit(self, a: AdapterConfig, checked: bool = False, restart: bool = False, facts=None) -> Tenant:
        """Register `a` as PENDING after `admission_problems` (skipped when `checked`: the caller just ran the same
        checks, as `run` does through `validate.check_run`); raises `ConfigError` listing every problem. `facts`:
        `a`'s outside facts, read by the caller (`outside_facts`): only the checks against the run's state run here."""
        if not checked:
            problems = self.admission_problems(a, restart, facts)
            if problems:
                raise ConfigError(problems)
        return self.table.register(a)

    def drain(self, name: str, reason: str | None = None) -> None:
        """No new prompts; checkpointed and released at the end of the step (PENDING: REMOVED at once)."""
        self.table.drain(name, reason)

    # -- client-driven tenants (Tinker API) -----------------------------------------------------------------------
    def add_client(self, name: str, rank: int, alpha: float, seed: int | None, target_modules: list[str]) -> int:
        """A slot of the shared model for a Tinker client tenant, now or a TenantError saying why not. A GRPO tenant
        already waiting (PENDING) keeps its claim on the next free slot."""
        old = self.tenants.get(name)
        live = self.table.clients.get(name)
        if (old is not None and old.state in LIVE | {TenantState.DRAINED}) or (
            live is not None and live.state == TenantState.RUNNING
        ):
            raise TenantError(bad_value("name", name, "a name no live adapter has"))
        reserved = name in self.reserved_clients
        if reserved:  # a client the journal replays after a restart: its slot was held for it (reserve_client_slots)
            self.reserved_clients.remove(name)
        free, waiting = len(self.free_slots()), 0 if reserved else len(self.pending_in_order())
        if free <= waiting:
            room = (
                f"all {self.backend.max_tenants} places (model.max_tenants)"
                if self.backend.max_tenants > self.max_loras
                else f"all {self.max_loras} (model.max_loras)"
            )
            raise TenantError(
                f"no free LoRA slot: {room} are held by GRPO and Tinker tenants"
                + (f" or promised to {waiting} waiting GRPO tenant(s)" if waiting else "")
                + "; unload a model or remove an adapter first"
            )
        slot = self.backend.add_client(name, rank, alpha, seed, target_modules)
        self.table.clients[name] = ClientTenant(name, rank, slot)
        return slot

    def reserve_client_slots(self, names: list[str]) -> list[str]:
        """A restart: hold a slot for each client tenant `names` that held one when the service went down (the
        Tinker journal knows them), before the run's GRPO tenants are admitted, so the journal's replay finds their
        slots free instead of taken by a GRPO tenant that was waiting. Held slots are not `free_slots` to anyone else
        until the client's `add_client` takes one or `end_client_reservations`. Returns the names held (at most as
        many as there are free slots, in the order given)."""
        room = len(self.backend.free_slots())
        self.reserved_clients = [n for n in dict.fromkeys(names) if n not in self.table.clients][:room]
        return list(self.reserved_clients)

    def end_client_reservations(self) -> None:
        """The replay has recreated its clients: slots still held (a client whose replay failed) are free again."""
        self.reserved_clients = []

    def record_client_step(self, name: str, adapter_step: int) -> None:
        self.table.clients[name].adapter_step = adapter_step

    def release_client(self, name: str) -> None:
        """The client tenant leaves: its slot is free for the next tenant of either kind."""
        t = self.table.clients[name]
        self.backend.remove_adapter(name)
        t.state, t.slot = TenantState.REMOVED, None

    # -- admission ------------------------------------------------------------------------------------------------
    def admit_pending(self) -> list[str]:
        """PENDING -> RUNNING for as many as there are free slots, by priority then age; returns those admitted."""
        admitted = []
        for t in self.pending_in_order():
            if not self.free_slots():
                break
            try:
                self._start(t)
            except Exception as e:  # noqa: BLE001 - whatever one tenant's start raises stays with that tenant
                self._start_failed(t, e)
                continue
            admitted.append(t.name)
        return admitted

    def _start_failed(self, t: Tenant, e: Exception) -> None:
        """Undo what `_start` had done for `t` and mark it FAILED; nothing of it stays in the backend or data source."""
        if isinstance(e, (DamagedCheckpoint, ConfigError)):  # said in one line: the reason is the whole story
            log.warning("adapter %s could not start: %s", t.name, e)
        else:
            log.exception("adapter %s could not start", t.name)
        if t.name in self.data.adapters:
            self.data.remove_adapter(t.name)
        if t.name in self.backend.adapters:
            self.backend.remove_adapter(t.name)
        t.dirty = False
        self.table.mark_failed(t.name, f"could not start: {type(e).__name__}: {e}")

    def _start(self, t: Tenant) -> None:
        """Slot + optimizer, data cursor, restore from its newest checkpoint, and a push at the next sync."""
        a = t.cfg
        self.table.activate(a.name, self.backend.add_adapter(a))
        t.admitted_at = time.time()
        n = a.n_samples_per_prompt or self.cfg.rollout.n_samples_per_prompt
        from rl_multilora.components import build_sampling, tenant_sampling

        self.data.add_adapter(
            AdapterRef(a.name, t.slot),
            a.dataset,
            a.reward,
            seed=a.seed,
            prompts_per_step=a.prompts_per_step,
            n_samples_per_prompt=n,
            max_epochs=a.epochs,
            sampling=tenant_sampling(build_sampling(self.cfg, self.data.tokenizer), a),
            environment=a.environment,
        )
        if self.cfg.checkpoint.resume == "never":
            # A name this run dir trained before (removed, then submitted again) starts over: its earlier checkpoints
            # are moved aside, not left beside the new ones, where pruning by adapter step deleted the new ones as
            # they were written and export and a later `resume: auto` took the old weights.
            archived = self.ckpt.archive_adapter(t.name)
            if archived is not None:
                log.warning("adapter %s: checkpoint.resume is never: its earlier checkpoints and metrics rows in this "
                            "run dir moved to %s", t.name, archived)  # fmt: skip
        elif self._restore(t) and self.budget_done(t):
            # Killed after its final checkpoint but before the run state recorded DRAINED: training it would take a
            # step past its budget. It leaves at once, never pushed; its checkpoint is already final.
            self.drain(t.name, "budget reached")
            self._release(t)
            self.table.mark_drained(t.name)
            return
        t.dirty = True

    def _restore(self, t: Tenant) -> bool:
        """Load `t`'s newest committed checkpoint into its (already added) slot, optimizer and data cursor.

        Also rolls metrics.jsonl back to that checkpoint, including when there is none: the adapter then starts over
        and its earlier rows go (see rl_multilora.checkpoint).
        """
        committed = self.table.global_step if self.ckpt.read_run_state() is not None else None
        skipped: list[str] = []  # the candidates set aside, by their new names
        for path, meta in self.ckpt.restore_candidates(t.name, committed):
            try:
                snap = self.ckpt.read_snapshot(path, meta)
                check_compatible(t.name, t.cfg.model_dump(mode="json"), snap.meta.get("config", {}), path)
            except DamagedCheckpoint as e:
                aside = self.ckpt.set_aside(path)
                skipped.append(aside.name)
                log.warning("adapter %s: skipped damaged checkpoint %s; set aside as %s", t.name, e, aside.name)
                continue
            # A dataset other than the checkpoint's (another row count or seed) is the config's mistake, not the
            # checkpoint's damage: setting it aside lost every good checkpoint (validation says so before; this is
            # for a dataset that changed between the check and the start).
            try:
                self.data.check_state(t.name, snap.data_state)
            except DatasetError as e:
                why = f"adapters.{t.name}.dataset: {e} (checkpoint {path}; or start over with --fresh)"
                raise ConfigError([why]) from None
            try:
                self.backend.load_adapter_state_dict(t.name, snap.tensors, snap.peft_config, source=str(path))
                self.backend.load_optimizer_state_dict(t.name, snap.optimizer)
                self.data.load_state_dict(t.name, snap.data_state)
                adapter_step = snap.adapter_step
            except Exception as e:  # noqa: BLE001 - tensors of another model, a garbage cursor: try an older one
                aside = self.ckpt.set_aside(path)
                skipped.append(aside.name)
                log.warning("adapter %s: skipped checkpoint %s: it does not load (%s: %s); set aside as %s", t.name,
                            path, type(e).__name__, e, aside.name)  # fmt: skip
                continue
            t.adapter_step = adapter_step
            t.last_checkpoint = str(path)
            t.last_reward = snap.meta.get("last_reward")
            t.last_eval_step = snap.meta.get("last_eval_step")
            # Versions continue from the checkpoint (the next push makes it +1), as in an uninterrupted run.
            t.weight_version = snap.meta.get("weight_version")
            dropped = prune_metrics(self.ckpt.run_dir, {t.name: int(snap.meta["global_step"])})
            log.info(
                "adapter %s resumed from %s (adapter step %d; %d later metrics rows dropped)",
                t.name,
                path,
                t.adapter_step,
                dropped,
            )
            return True
        if skipped:
            # Not a silent start over (its metrics rows would be dropped and a half-loaded candidate's weights,
            # moments or cursor kept): the tenant fails, saying so; the next start finds none and starts over.
            raise DamagedCheckpoint(
                f"adapter {t.name!r}: every checkpoint in {self.ckpt.adapter_dir(t.name)} is damaged or does not load "
                f"(set aside, kept: {', '.join(skipped)}); submit it again, or run again, to train it from the start"
            )
        prune_metrics(self.ckpt.run_dir, {t.name: None})
        return False

    # -- leaving --------------------------------------------------------------------------------------------------
    def _release(self, t: Tenant) -> None:
        """Free everything a leaving adapter holds: slot and optimizer, data cursor; unloaded at the next sync."""
        self.backend.remove_adapter(t.name)
        self.data.remove_adapter(t.name)
        t.dirty = False

    def budget_done(self, t: Tenant, in_flight: Collection[str] = ()) -> bool:
        """Its step budget is spent, or its data is (unless it has groups `in_flight`, drawn and not trained)."""
        return t.steps_left() == 0 or (t.name not in in_flight and self.data.exhausted(t.name))

    def retire_finished(self, in_flight: Collection[str] = (), in_step: bool = True) -> None:
        """Budgets and drains: checkpoint and free every adapter that is done (DRAINING -> DRAINED). `in_flight`:
        tenants with groups drawn but not trained yet (an asynchronous run's next rollout), whose data is not used
        up while those groups wait. `in_step`: called inside a global step that will be committed (`finish_step`);
        False between steps (the service with no tenant running), where a checkpoint marked as the uncommitted step's
        would be discarded by the next restore of the name as a step that never finished."""
        for t in self.running():
            if self.budget_done(t, in_flight):
                why = self.data.unusable(t.name) if t.name not in in_flight else None
                if why is not None:  # every row bad: not a spent budget (it said "budget reached" and exited 0)
                    self.fail(t.name, why)
                    continue
                self.drain(t.name, "budget reached")
        for t in self.in_state(TenantState.DRAINING):
            self.save_checkpoint(t, in_step=in_step)
            self._release(t)
            self.table.mark_drained(t.name)

    def fail(self, name: str, reason: str) -> None:
        """FAILED: keep its last good weights in a final checkpoint, free its slot; the others go on."""
        t = self.get(name)
        log.warning("adapter %s FAILED: %s", name, reason)
        had_slot = t.slot is not None
        self.table.mark_failed(name, reason)  # first, so its final checkpoint records the state FAILED
        if had_slot:
            # The trainer never applies a non-finite step, so the slot still holds the last good weights.
            self.save_checkpoint(t, note=f"FAILED: {reason}")
            self._release(t)

    # -- results of a step ------------------------------------------------------------------------------------------
    def step_limits(self) -> dict[str, int]:
        """Optimizer steps each running tenant may still take (only tenants with a step budget)."""
        return {t.name: left for t in self.running() if (left := t.steps_left()) is not None}

    def current_versions(self) -> dict[str, int]:
        return {t.name: t.weight_version for t in self.tenants.values() if t.weight_version is not None}

    def record_trained(self, name: str, st: AdapterStepStats | None) -> None:
        """Count the optimizer steps `name` took this step; a stepped adapter is pushed at the next sync."""
        t = self.get(name)
        t.idle_steps = 0 if st is not None and st.stepped else t.idle_steps + 1
        if st is None:
            return
        if st.stepped:
            t.adapter_step += st.n_steps
            t.dirty = True
        t.nonfinite_streak = t.nonfinite_streak + 1 if st.skipped_nonfinite else 0

    def apply_step(
        self,
        names: list[str],
        stats: dict[str, AdapterStepStats],
        reward_means: dict[str, float | None],
        rewards_all_failed: dict[str, str],
    ) -> None:
        """What one step did to each tenant that was RUNNING in it: optimizer steps, its last reward, its fault
        counters. `enforce_faults` then applies the fault policy (after the step's metrics are taken)."""
        for name in names:
            t = self.get(name)
            self.record_trained(name, stats.get(name))
            t.last_reward = reward_means.get(name)
            t.reward_fail_streak = t.reward_fail_streak + 1 if name in rewards_all_failed else 0

    def enforce_faults(
        self, names: list[str], stats: dict[str, AdapterStepStats], rewards_all_failed: dict[str, str]
    ) -> None:
        """The fault policy over the step's tenants: FAIL each one past a limit (the others go on)."""
        for name in names:
            t = self.get(name)
            if t.state != TenantState.RUNNING:
                continue
            reason = self.fault(t, stats.get(name), rewards_all_failed.get(name))
            if reason is not None:
                self.fail(name, reason)

    def fault(self, t: Tenant, st: AdapterStepStats | None, reward_failure: str | None) -> str | None:
        """The fault policy, the one place that decides a tenant FAILS: why `t` must stop now, or None."""
        f = self.cfg.faults
        if t.reward_fail_streak >= f.max_reward_fail_steps:
            return (
                f"reward failing: no sample was scored, or a worker crashed, in each of {t.reward_fail_streak} "
                f"consecutive steps (faults.max_reward_fail_steps); this step: {reward_failure}"
            )
        if st is not None and st.error is not None:
            return f"malformed sample: {st.error}"
        if t.nonfinite_streak >= f.max_nonfinite_steps:
            return f"non-finite loss/gradients for {t.nonfinite_streak} consecutive steps"
        if t.idle_steps >= f.max_idle_steps:
            return (
                f"no optimizer step for {t.idle_steps} consecutive steps (faults.max_idle_steps): every group "
                "had uniform rewards or every sample failed, so it had nothing to learn from"
                + (f"; its samples last failed with: {t.last_failed_reason}" if t.last_failed_reason else "")
            )
        return None

    def apply_evals(self, results) -> None:
        """Evaluations done (`rl_multilora.evaluate.EvalResult`s): each tenant's adapter step last evaluated."""
        for r in results:
            if r.adapter in self.tenants:
                self.get(r.adapter).last_eval_step = r.adapter_step

    # -- sync -------------------------------------------------------------------------------------------------------
    def sync_plan(self) -> tuple[list[tuple[str, int]], list[str]]:
        """What the next weight sync does: push (name, next version) for every tenant whose slot changed since the
        engine last got it (trained, or just admitted), and unload every tenant that left (no slot) while the
        engine still holds it."""
        push = [
            (t.name, 0 if t.weight_version is None else t.weight_version + 1)
            for t in self.tenants.values()
            if t.dirty and t.slot is not None
        ]
        unload = [t.name for t in self.tenants.values() if t.in_engine and t.slot is None]
        return push, unload

    def apply_sync(self, pushed: dict[str, int], unloaded: list[str]) -> None:
        """A weight sync's result: versions the engine now holds, adapters it dropped. A DRAINED tenant the engine
        no longer holds is REMOVED (its name may be submitted again)."""
        for name in unloaded:
            self.get(name).in_engine = False
        for name, version in pushed.items():
            t = self.get(name)
            t.weight_version, t.in_engine, t.dirty = version, True, False
        for t in self.in_state(TenantState.DRAINED):
            if not t.in_engine:
                self.table.mark_removed(t.name)

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def snapshot(self, t: Tenant, note: str | None = None, in_step: bool = True) -> AdapterSnapshot:
        """What a checkpoint of `t` holds. `in_step`: taken during global step `global_step` (committed once the
        run state records that step as done), or between steps (committed already)."""
        version = t.weight_version
        if not t.dirty and version is not None:  # the engine already has these weights: the version before them
            version = version - 1 if version > 0 else None
        return AdapterSnapshot(
            tensors=self.backend.adapter_state_dict(t.name),
            peft_config=self.backend.peft_config(t.name),
            optimizer=self.backend.optimizer_state_dict(t.name),
            data_state=self.data.state_dict(t.name),
            meta={
                "adapter_step": t.adapter_step,
                "global_step": self.global_step,
                "steps_done": self.global_step + int(in_step),
                # The version before these weights: resume's first push gives them the version they have in an
                # uninterrupted run (a checkpoint taken after the engine got these weights, as a stop's, steps back).
                "weight_version": version,
                "state": t.state.value,
                "note": note,
                "last_reward": t.last_reward,
                # its held-out evaluation at this step, when one ran before the checkpoint: resume does not redo it
                "last_eval_step": t.last_eval_step,
                "rng": {"adapter_seed": t.cfg.seed, "counters": "data_state.json (epoch, cursor, group_counter)"},
                "config": t.cfg.model_dump(mode="json"),
            },
        )

    def save_checkpoint(self, t: Tenant, note: str | None = None, in_step: bool = True) -> None:
        t.last_checkpoint = str(self.ckpt.save_adapter(t.name, self.snapshot(t, note, in_step)))

    def checkpoint_all(self) -> None:
        """Between steps (a stop): checkpoint every adapter that holds a slot, then the run state."""
        for t in self.in_state(TenantState.RUNNING, TenantState.DRAINING):
            self.save_checkpoint(t, in_step=False)
        self.save_run_state()

    # -- run state ------------------------------------------------------------------------------------------------
    def save_run_state(self) -> None:
        state = self.table.state_dict()
        if self.turns is not None:
            state["turns"] = self.turns.state_dict()
        self.ckpt.write_run_state(state)

    def restore_run_state(self) -> bool:
        """Bring back the global step and the adapters that already finished (so they are not retrained).

        An adapter that finished its budget and whose budget (`max_steps`, `epochs`) is different in this run's
        config is not brought back as finished: it resumes from its checkpoint under the new budget.

        `checkpoint.resume`: "never" archives whatever an earlier run left (`archive_previous`) and starts clean;
        "always" requires run state or a checkpoint; "auto" resumes when there is something to resume.
        """
        for p in self.ckpt.remove_stale_temps():
            log.info("removed %s, left by an interrupted write", p)
        mode = self.cfg.checkpoint.resume
        if mode == "never":
            self.ckpt.archive_previous()
            return False
        state = self.ckpt.read_run_state()
        mismatch = (
            None
            if state is None or self.ckpt.base is None
            else base_mismatch(state, self.ckpt.base, self.cfg.model.path)
        )
        if mismatch is not None:  # before any checkpoint is read: one of another base would be set aside as damaged
            raise RunStateError(f"{self.ckpt.run_state_path}: {mismatch}")
        if mode == "always" and state is None and not self.ckpt.has_checkpoints():
            raise FileNotFoundError(
                f"checkpoint.resume: 'always' (--resume) but {self.ckpt.run_dir} has no run_state.json and no "
                "checkpoint; run without --resume to start a new run"
            )
        prune_metrics(self.ckpt.run_dir, {})  # finish an interrupted rewrite, drop a torn last row
        if state is None:
            return False
        self.table.global_step = int(state["global_step"])
        if self.turns is not None and "turns" in state:
            self.turns.load_state_dict(state["turns"])
        configured = {a.name: a for a in self.cfg.adapters}
        for name, s in state["adapters"].items():
            st = TenantState(s["state"])
            if st not in FINISHED:
                if self.cfg.adapters and name not in configured:  # renamed or dropped from a run's config: say so
                    log.warning(
                        "adapter %s (%s at adapter step %s in this run dir) is not in the config, so it does not "
                        "train in this run; its checkpoints stay in %s (put it back to resume it)", name, st.value,
                        s.get("adapter_step"), self.ckpt.adapter_dir(name),
                    )  # fmt: skip
                continue
            cfg = AdapterConfig.model_validate(s["config"])
            new = configured.get(name)
            if (
                st != TenantState.FAILED
                and s.get("reason") == "budget reached"
                and new is not None
                and (new.max_steps, new.epochs) != (cfg.max_steps, cfg.epochs)
            ):
                # Its budget was changed for this run: it registers from the config and resumes from its
                # checkpoint, to train further (or leaves at once when it is still at or past the new budget).
                continue
            t = Tenant(cfg=cfg, state=st)
            t.adapter_step = s["adapter_step"]
            t.reason = s.get("reason")
            t.last_checkpoint = s.get("last_checkpoint")
            t.last_reward = s.get("last_reward")
            t.registered_at = s.get("registered_at", t.registered_at)
            self.tenants[name] = t
        return True
