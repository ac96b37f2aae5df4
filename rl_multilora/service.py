"""Service mode: the trainer as a long-running Ray actor that tenants join and leave while it trains.

`rl-multilora serve CONFIG` starts (or joins) a Ray cluster and creates one NAMED, DETACHED actor, `controller` in
namespace `rl_multilora`, that owns a `Runtime`. `submit`, `remove` and `status` are short-lived clients that find
that actor by name. The pieces:

- `ServiceCore` (no Ray): a `Runtime` plus a training thread. The thread calls `rt.step()` while any adapter is
  RUNNING, admits PENDING adapters when a slot is free, and otherwise idles, waking every `cfg.service_poll_s` (or
  at once when a mutation arrives). It never exits on its own; only `stop()` ends it.
- Mutations (submit, remove) are queued and applied by the training thread between steps, never mid-step, so a
  step always sees one fixed set of tenants. The caller blocks on a future until its mutation is applied, and gets
  the adapter's status or the reason it was rejected.
- Status is a snapshot the training thread publishes after every step and mutation, so `status` answers at once
  even while a long step runs (it never waits for the step's lock).
- `ServiceActor` wraps a `ServiceCore` for Ray; it is a threaded actor (`max_concurrency`), so a submit waiting for
  the current step to end does not block `status`. Actor methods return `Reply` values instead of raising, so a
  rejected submission reaches the client as one clean message, not a remote traceback.
- Tinker API (`serve --tinker-port`): the Tinker app (`rl_multilora.tinker.server.build_service_server`) runs on
  this Runtime's model, engine and TenantManager. It is built before the Runtime starts, so on a restart the clients
  its journal replays keep their slots and the run's GRPO tenants are admitted around them. The training thread and the Tinker worker take turns on the model
  through one FIFO lock (`turn`): a step (with the mutations before it) is one turn, a batch of Tinker requests is
  one turn, and whoever asked first goes next, so neither a slow GRPO step nor a stream of client requests starves
  the other. Status is published at the end of every turn.
- Drained adapters are marked REMOVED once the step's weight sync has unloaded them, so a name can be submitted
  again; the Runtime's admission then resumes it from its newest checkpoint (`checkpoint.resume != "never"`).

Why one file: the core, the actor, the client and the CLI verbs share the values that cross the
actor boundary (`AdapterStatus`, `ServiceStatus`, `Reply`) and the Ray setup; split, each part would import the
others. The Ray-free core is the first half and can be read alone.

Security: token authentication stays on. Ray 2.60 enables it by default for a cluster that `ray.init()` starts
when RAY_AUTH_MODE is unset; `serve` keeps that default (an explicit `RAY_AUTH_MODE=disabled` is respected, with a
warning) and makes the generated token file (`~/.ray/auth_token`) readable by its owner only. Clients on the same
machine pick the token up from that file. The dashboard's web UI and APIs are off (`include_dashboard=False`), but
Ray 2.60 still runs a `dashboard.py` process for usage stats and metrics. Ray's gRPC servers listen on every
interface even for a local cluster (it maps 127.0.0.1 to the node IP) and refuse calls without the token; three
read-only Prometheus metrics ports answer without it (tests/test_security.py names them). Firewall Ray's ports on
shared networks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import math
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from rl_multilora import plugin_probe
from rl_multilora.backends.base import paging_stats_of
from rl_multilora.checkpoint import CheckpointManager, hold_run_dir
from rl_multilora.config import (
    AdapterConfig,
    ConfigError,
    ModelConfig,
    RunConfig,
    load_run_config,
    load_yaml,
    parse_adapter_config,
    parse_run_config,
)
from rl_multilora.host_memory import allocator_name, enter_ray_process, jemalloc_ray_options
from rl_multilora.tenants import TenantError, TenantState

log = logging.getLogger("rl_multilora.service")

NAMESPACE = "rl_multilora"
ACTOR_NAME = "controller"
NO_SERVICE = "no rl-multilora service is running (start one with rl-multilora serve CONFIG)"
# Idle lines repeat at most this often: one per poll would flood the terminal of a service that idles for hours.
IDLE_LOG_EVERY_S = 60.0


class ServiceError(RuntimeError):
    """A user-facing service problem (no service, rejected submission, unknown adapter): exit 2, no traceback."""


class ServiceTimeout(ServiceError):
    """The service did not answer a call within its timeout (it may still be running: busy, or stuck)."""


# -- values that cross the actor boundary ---------------------------------------------------------------------------
@dataclass(frozen=True)
class AdapterStatus:
    name: str
    state: str
    slot: int | None
    adapter_step: int
    max_steps: int | None
    last_reward: float | None
    last_checkpoint: str | None
    reason: str | None = None
    resident: bool | None = None  # paging: whether it sits in a model slot now (None: no paging)

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> AdapterStatus:
        return cls(**{k: d.get(k) for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class ServiceStatus:
    global_step: int
    training: bool
    run_dir: str
    max_loras: int
    adapters: list[AdapterStatus] = field(default_factory=list)
    error: str | None = None
    engines: int = 1  # rollout engines (rollout.num_engines)
    trainer_ranks: int = 1  # training processes (the backend's world size)
    paging: dict[str, float] | None = None  # more tenants than slots: max_tenants, resident, paged, page-ins

    def get(self, name: str) -> AdapterStatus | None:
        return next((a for a in self.adapters if a.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        used = sum(a.slot is not None for a in self.adapters)
        mode = "ERROR" if self.error else ("training" if self.training else "idle")
        # Paging: a tenant holds a place (of model.max_tenants), and the resident ones of them sit in the slots.
        held = f"slots {used}/{self.max_loras}"
        if self.paging is not None:
            held = f"slots {self.paging['resident']}/{self.max_loras}, places {used}/{self.paging['max_tenants']}"
        head = (
            f"service: {mode} | global step {self.global_step} | {held} | "
            f"trainer ranks {self.trainer_ranks} | engines {self.engines} | {self.run_dir}"
        )
        lines = [head]
        if self.paging is not None:
            p = self.paging
            lines.append(
                f"paging: {p['resident']} resident in {self.max_loras} slots, {p['paged']} paged "
                f"({p['spilled']} on disk, {p['host_mb']:.1f} MB in host memory) of {p['max_tenants']} places | "
                f"page-ins {p['page_ins']} ({p['page_in_s']:.2f} s)"
            )
        if self.error:
            lines.append(f"error: {self.error}")
        if not self.adapters:
            lines.append("no adapters (submit one with rl-multilora submit ADAPTER.yaml)")
            return "\n".join(lines)
        held_in = "SLOT" if self.paging is None else "PLACE"
        rows = [("NAME", "STATE", held_in, "STEPS", "LAST REWARD", "CHECKPOINT", "REASON")]
        for a in self.adapters:
            steps = f"{a.adapter_step}/{a.max_steps}" if a.max_steps is not None else str(a.adapter_step)
            paged = " (paged)" if a.resident is False and a.slot is not None else ""
            rows.append(
                (
                    a.name,
                    a.state,
                    ("-" if a.slot is None else str(a.slot)) + paged,
                    steps,
                    "-" if a.last_reward is None else f"{a.last_reward:.3f}",
                    a.last_checkpoint or "-",
                    a.reason or "",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        return "\n".join(lines)


def _paging_status(backend) -> dict[str, float] | None:
    st = paging_stats_of(backend)
    if st is None:
        return None
    return {
        "max_tenants": backend.max_tenants,
        "resident": st.resident,
        "paged": st.paged,
        "spilled": st.spilled,
        "host_mb": st.host_bytes / 2**20,
        "page_ins": st.page_ins,
        "page_in_s": st.page_in_s,
    }


@dataclass(frozen=True)
class Reply:
    """An actor method's answer: `error` (a user-facing reason) or the adapter's status after the change."""

    adapter: AdapterStatus | None = None
    error: str | None = None


@dataclass
class _Mutation:
    kind: Literal["submit", "remove"]
    adapter: AdapterConfig | None = None
    facts: Any = None  # a submission's validate.OutsideFacts, read in the caller's thread
    name: str | None = None
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


# -- the service without Ray ----------------------------------------------------------------------------------------
class TurnLock:
    """A FIFO lock (`with turn(): ...`): turns are given in the order they were asked for. Not reentrant."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0  # the ticket the next caller draws
        self._serving = 0  # the ticket that holds the lock

    @contextlib.contextmanager
    def __call__(self):
        with self._cond:
            ticket = self._next
            self._next += 1
            while ticket != self._serving:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._serving += 1
                self._cond.notify_all()


class ServiceCore:
    """A Runtime driven by a training thread; mutations are applied between steps. See the module docstring."""

    def __init__(self, rt, poll_s: float):
        self.rt = rt
        self.poll_s = poll_s
        self.error: str | None = None
        self._queue: queue.Queue[_Mutation] = queue.Queue()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._status: ServiceStatus | None = None
        self._thread: threading.Thread | None = None
        self._training = False
        self._finished = False
        self.turn = TurnLock()  # the model: the training thread's steps and the Tinker worker's batches take turns

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Resume the run directory's state (and any adapters in the config), then start the training thread."""
        self.rt.start()
        self._publish()
        self._thread = threading.Thread(target=self._loop, name="rl-multilora-service", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Finish the current step, checkpoint every live adapter, close the runtime. Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise ServiceError(f"the training loop did not stop within {timeout} s")
        self._finish()

    # -- requests (any thread) ------------------------------------------------------------------------------------
    def submit(self, a: AdapterConfig) -> AdapterStatus:
        """Validate and register `a` as PENDING before the next step; raise ServiceError with the reason if not."""
        self._check_open()
        # The admission checks run here too, in the caller's thread, so a bad submission is rejected at once instead
        # of after the current step. What they read from the outside world (reward, environment, dataset and eval
        # split: seconds for a large dataset) is read here only; rt.register repeats the checks against the run's
        # state, authoritative, between steps, with these facts, so a submission does not pause every tenant's
        # training for as long as its dataset takes to load.
        # Its reward module and environment are loaded in a throwaway process first: one that exits or crashes when
        # imported would end this process, and every tenant's unsaved steps with it.
        problems = plugin_probe.probe(a)
        if problems:
            raise ServiceError(f"adapter {a.name!r} rejected: {ConfigError(problems)}")
        facts = self.rt.tenants.outside_facts(a)
        problems = self.rt.tenants.admission_problems(a, facts=facts)
        if problems:
            raise ServiceError(f"adapter {a.name!r} rejected: {ConfigError(problems)}")
        return self._enqueue(_Mutation("submit", adapter=a, facts=facts))

    def remove(self, name: str) -> AdapterStatus:
        """Drain `name` (PENDING: removed at once; RUNNING: checkpointed and unloaded at the end of the next step)."""
        self._check_open()
        return self._enqueue(_Mutation("remove", name=name))

    def status(self) -> ServiceStatus:
        with self._lock:
            assert self._status is not None, "status() before start()"
            return self._status

    def model_config(self) -> ModelConfig:
        return self.rt.cfg.model

    @contextlib.contextmanager
    def tinker_turn(self):
        """One turn of the Tinker worker on the model and the tenants; status is published at its end."""
        with self.turn():
            yield
            self._publish()

    # -- the training thread --------------------------------------------------------------------------------------
    def _loop(self) -> None:
        last_idle_log = 0.0
        while not self._stop.is_set():
            with self.turn():
                self._apply_mutations(block_s=0.0)
                worked = self.error is None and self._has_work()
                if worked:
                    try:
                        self._training = True
                        self._step()
                    except Exception as e:  # noqa: BLE001 - a bug must not kill the service silently: report it
                        log.exception("service step failed; training stopped (status shows the error)")
                        self.error = f"{type(e).__name__}: {e}"
                        self._training = False
                    self._publish()
                else:
                    if self._training or time.monotonic() - last_idle_log >= IDLE_LOG_EVERY_S:
                        log.info("idle: no RUNNING adapters (global step %d)", self.rt.tenants.global_step)
                        last_idle_log = time.monotonic()
                    self._training = False
                    self._publish()
            if worked:
                last_idle_log = 0.0
                continue
            self._apply_mutations(block_s=self.poll_s)
        self._finish()

    def _has_work(self) -> bool:
        c = self.rt.tenants
        waiting = bool(c.pending_in_order()) and bool(c.free_slots())
        return bool(c.running()) or waiting or bool(c.in_state(TenantState.DRAINING))

    def _step(self) -> None:
        if self.rt.tenants.running():
            self.rt.step()
        else:
            self.rt.idle_step()  # nothing to train: retire, admit and sync without a wasted global step

    def _apply_mutations(self, block_s: float) -> None:
        """Apply every queued mutation. `block_s` > 0: wait that long for the first one (outside the model's turn),
        then take a turn to apply them; 0: the caller already holds the turn."""
        try:
            m = self._queue.get(timeout=block_s) if block_s > 0 else self._queue.get_nowait()
        except queue.Empty:
            return
        with self.turn() if block_s > 0 else contextlib.nullcontext():
            while True:
                self._apply(m)
                try:
                    m = self._queue.get_nowait()
                except queue.Empty:
                    break
            self._publish()

    def _apply(self, m: _Mutation) -> None:
        try:
            if self.error is not None:
                raise ServiceError(f"the service stopped training after an error: {self.error}")
            if m.kind == "submit":
                tenant = self.rt.register(m.adapter, facts=m.facts)
                free = len(self.rt.tenants.free_slots())
                held_in = "place(s)" if self.rt.cfg.model.paging else "slot(s)"  # paging: the free ones are places
                log.info("submitted %s: PENDING (%d free %s)", tenant.name, free, held_in)
            else:
                tenant = self._drain(m.name)
            m.done.set_result(AdapterStatus.from_record(tenant.to_status()))
        except (ConfigError, TenantError, ServiceError) as e:
            what = f"adapter {m.adapter.name!r} rejected" if m.kind == "submit" else f"cannot remove {m.name!r}"
            m.done.set_exception(ServiceError(f"{what}: {e}"))
        except Exception as e:  # noqa: BLE001 - the caller gets the failure; the service keeps running
            log.exception("applying %s failed", m.kind)
            m.done.set_exception(ServiceError(f"{m.kind} failed inside the service: {type(e).__name__}: {e}"))

    def _drain(self, name: str):
        if name in self.rt.tenants.clients:  # listed by `status`, but not this API's to remove
            raise ServiceError(
                f"adapter {name!r} is a Tinker client's model: it is released through the Tinker API (its session's "
                "end, or POST /api/v1/unload_model with its model_id), not by remove"
            )
        tenant = self.rt.tenants.get(name)
        if tenant.state not in (TenantState.PENDING, TenantState.RUNNING):
            # a state error, not a bad value: said the way the tenant state machine says it
            raise ServiceError(
                f"adapter {name!r} is {tenant.state.value}; only PENDING or RUNNING adapters can be removed"
            )
        self.rt.remove(name)
        log.info("remove %s: %s", name, tenant.state.value)
        return tenant

    def _publish(self) -> None:
        c = self.rt.tenants
        snap = ServiceStatus(
            global_step=c.global_step,
            training=self._training,
            run_dir=str(self.rt.run_dir),
            max_loras=c.max_loras,
            adapters=[AdapterStatus.from_record(d) for d in c.status()],
            error=self.error,
            engines=self.rt.cfg.rollout.num_engines,
            trainer_ranks=self.rt.backend.world_size,
            paging=_paging_status(self.rt.backend),
        )
        with self._lock:
            self._status = snap

    def _finish(self) -> None:
        """Runs once, in the training thread when it exits (or in stop() if the thread never ran)."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
        for m in self._drain_queue():
            m.done.set_exception(ServiceError("the service is stopping"))
        with self.turn():  # a Tinker batch still running finishes first
            try:
                self.rt.checkpoint_all()
                log.info("checkpointed every live adapter (global step %d)", self.rt.tenants.global_step)
            except Exception:  # noqa: BLE001 - still close the engine and reward workers
                log.exception("final checkpoint failed")
            self._training = False
            self._publish()
            self.rt.close()

    def _drain_queue(self) -> list[_Mutation]:
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def _enqueue(self, m: _Mutation) -> AdapterStatus:
        with self._lock:  # `_finish` drains the queue once under this lock: a mutation is queued before or refused
            if self._finished:
                raise ServiceError("the service is stopping")
            self._queue.put(m)
        return m.done.result()

    def _check_open(self) -> None:
        if self._stop.is_set():
            raise ServiceError("the service is stopping")
        if self.error is not None:
            raise ServiceError(f"the service stopped training after an error: {self.error}")


# -- the Ray actor --------------------------------------------------------------------------------------------------
# The calls that must never wait behind mutations (`status`, `model_config`, `shutdown`) run in a concurrency group
# of their own: each `submit` and `remove` holds one of the default group's 16 threads until the current step ends,
# so 16 of them at once (a shell loop of `rl-multilora submit ... &`) queued every `status` behind them, and
# `serve`'s health check timed out.
UNQUEUED = ("status", "model_config", "shutdown")
UNQUEUED_GROUP = "unqueued"


class ServiceActor:
    """Ray-side wrapper of ServiceCore; created by `serve` as `ray.remote(...)(ServiceActor).options(...)`."""

    def __init__(self, cfg_data: dict[str, Any], workdir: str | None = None, tinker: dict[str, Any] | None = None):
        _setup_worker(workdir)
        from rl_multilora.loop import Runtime

        cfg = parse_run_config(cfg_data, source="serve")
        try:  # started with jemalloc preloaded (serve's runtime_env); the reward workers get the environment back
            enter_ray_process(cfg.model.host_allocator == "jemalloc")
        except ValueError as e:
            raise ServiceError(str(e)) from None
        held = hold_run_dir(Path(cfg.run_dir))  # before --fresh archives anything: a live run's files stay its own
        try:
            if tinker is not None and cfg.checkpoint.resume == "never":
                # --fresh: the earlier run (its Tinker journal too) is archived before the Tinker app opens the journal.
                CheckpointManager(Path(cfg.run_dir)).archive_previous()
            runtime = Runtime.build(cfg)  # takes the same lock again (re-entrant), which its close releases
        finally:
            held.release()
        self.core = ServiceCore(runtime, cfg.service_poll_s)
        self.tinker = None
        server = None
        if tinker is not None:  # the Tinker API on this Runtime (see rl_multilora.tinker.server)
            from rl_multilora.tinker.server import BackgroundApp, build_service_server, resolve_token

            state_dir = tinker_state_dir(cfg)
            # Before the start: the clients the journal replays keep their slots; GRPO tenants are admitted around them.
            server = build_service_server(
                self.core,
                state_dir,
                resolve_token(state_dir),
                tinker.get("base_model"),
                snapshot_every=tinker.get("snapshot_every", 50),
                max_tokens_cap=tinker.get("max_tokens_cap"),
                session_timeout_s=tinker.get("session_timeout_s", 120.0),
                **(
                    {"stability_max_tokens": tinker["stability_max_tokens"]}
                    if "stability_max_tokens" in tinker
                    else {}
                ),
            )
        self.core.start()
        if server is not None:
            self.tinker = BackgroundApp(server, tinker["host"], tinker["port"])
        log.info("service ready: %d slot(s), run dir %s", cfg.model.max_loras, cfg.run_dir)

    def ready(self) -> str:
        """The malloc serving the actor (`host_memory.allocator_name`), for the banner."""
        return allocator_name()

    def model_config(self) -> dict[str, Any]:
        return self.core.model_config().model_dump(mode="json")

    def submit(self, adapter_data: dict[str, Any]) -> Reply:
        try:
            a = parse_adapter_config(adapter_data, self.core.model_config())
            return Reply(adapter=self.core.submit(a))
        except (ConfigError, ServiceError) as e:
            name = adapter_data.get("name") if isinstance(adapter_data, dict) else None
            msg = str(e) if isinstance(e, ServiceError) else f"adapter {name!r} rejected: {e}"
            return Reply(error=msg)
        except Exception as e:  # noqa: BLE001 - the submitter gets one line, not the actor's traceback
            log.exception("submit failed")
            return Reply(error=f"submit failed: {type(e).__name__}: {e}")

    def remove(self, name: str) -> Reply:
        try:
            return Reply(adapter=self.core.remove(name))
        except ServiceError as e:
            return Reply(error=str(e))

    def status(self) -> ServiceStatus:
        return self.core.status()

    def shutdown(self) -> ServiceStatus:
        if self.tinker is not None:  # no client request may start once the final checkpoint is under way
            self.tinker.close()
            self.tinker = None
        self.core.stop()
        return self.core.status()


def tinker_state_dir(cfg: RunConfig) -> Path:
    """The Tinker API's request journal, client checkpoints and token, inside the run directory."""
    return Path(cfg.run_dir) / "tinker"


def _setup_worker(workdir: str | None) -> None:
    """Make the actor's process resolve relative paths and `module:function` plugins as the serve process does."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if workdir and Path(workdir).is_dir():
        os.chdir(workdir)
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)


# -- Ray connection -------------------------------------------------------------------------------------------------
def _prepare_client_auth(address: str | None) -> None:
    """Use the local token with an explicit address too (Ray itself does this only for `address="auto"`).

    Ray caches its auth mode at import, so setting RAY_AUTH_MODE now is not enough; Ray's own helper sets it and
    refreshes the cache (a private function: if a later Ray moves it, set RAY_AUTH_MODE=token yourself).
    """
    if address in (None, "auto") or "RAY_AUTH_MODE" in os.environ:
        return
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _restrict_token_file() -> None:
    """The token grants code execution on the cluster: keep the default token file private to its owner."""
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    path = Path.home() / ".ray" / "auth_token"
    if path.is_file() and path.stat().st_uid == os.getuid():
        path.chmod(0o600)


def _auth_mode() -> str:
    """The auth mode this process runs with ("token" or "disabled"), as Ray resolved it."""
    from ray._raylet import AuthenticationMode, get_authentication_mode

    return "token" if get_authentication_mode() == AuthenticationMode.TOKEN else "disabled"


def token_location() -> str:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "the RAY_AUTH_TOKEN environment variable"
    return os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")


def _ray_init(address: str | None, start_cluster: bool) -> None:
    import ray

    if ray.is_initialized():
        return
    if start_cluster:
        # Ray >= 2.59 turns token auth on (and writes a token) for a cluster ray.init() starts when RAY_AUTH_MODE
        # is unset; only an explicit RAY_AUTH_MODE=disabled turns it off, which we respect but warn about.
        # include_dashboard=False keeps the dashboard's web server (UI, Jobs API) off; Ray 2.60 still starts a
        # dashboard.py process (usage stats and a metrics exporter) and nothing in ray.init skips it.
        ray.init(address="local", namespace=NAMESPACE, include_dashboard=False, configure_logging=False)
        if _auth_mode() == "token":
            _restrict_token_file()
        else:
            log.warning(
                "token authentication is OFF (RAY_AUTH_MODE=%s): anyone who can reach this machine's Ray ports can "
                "run code on it. Unset RAY_AUTH_MODE to keep it on.",
                os.environ.get("RAY_AUTH_MODE"),
            )
        return
    # Ray logs "token authentication is enabled" on every connect; for a one-shot client it is noise.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    if address is not None and (why := _unreachable(address)) is not None:  # ray.init retries a dead one for minutes
        raise ServiceError(f"no Ray cluster answers at --address {address!r} ({why}); {NO_SERVICE}")
    _prepare_client_auth(address)
    try:
        ray.init(
            address=address or "auto",
            namespace=NAMESPACE,
            logging_level=logging.WARNING,
            log_to_driver=False,
            configure_logging=False,
        )
    except ConnectionError as e:
        raise ServiceError(f"{NO_SERVICE}; Ray says: {e}") from None
    except Exception as e:  # noqa: BLE001 - auth failures and bad addresses come as several Ray types
        hint = ""
        if "auth" in str(e).lower() or "token" in str(e).lower():
            hint = " (token auth: copy the cluster's token to ~/.ray/auth_token or set RAY_AUTH_TOKEN)"
        raise ServiceError(f"cannot connect to Ray at {address or 'auto'!r}: {type(e).__name__}: {e}{hint}") from None


def _unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why nothing listens at a `HOST:PORT` Ray address, or None (it answers, or the address has another form, e.g.
    `ray://`, which Ray itself then judges). A wrong port made `status --address` print Ray's connection warnings for
    minutes instead of an error."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return None
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return None
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"


class ServiceClient:
    """Handle on a running service. `connect()` finds it; every method raises ServiceError on a user problem."""

    def __init__(self, handle):
        self.handle = handle

    @classmethod
    def connect(cls, address: str | None = None) -> ServiceClient:
        import ray

        _ray_init(address, start_cluster=False)
        try:
            return cls(ray.get_actor(ACTOR_NAME, namespace=NAMESPACE))
        except ValueError:
            raise ServiceError(NO_SERVICE) from None

    def _call(self, method: str, *args, timeout: float | None = None):
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        remote = getattr(self.handle, method)
        if method in UNQUEUED:  # never queued behind submits and removes that wait for the step to end
            remote = remote.options(concurrency_group=UNQUEUED_GROUP)
        try:
            return ray.get(remote.remote(*args), timeout=timeout)
        except RayActorError as e:
            raise ServiceError(f"the rl-multilora service is not running any more ({e})") from None
        except GetTimeoutError:
            raise ServiceTimeout(f"the service did not answer {method} within {timeout} s") from None

    def model_config(self) -> ModelConfig:
        return ModelConfig.model_validate(self._call("model_config", timeout=60))

    def submit(self, adapter: str | Path | dict[str, Any]) -> AdapterStatus:
        """Submit an adapter (a YAML path or its dict); parsed here against the service's model, then by the actor."""
        source = str(adapter) if isinstance(adapter, str | Path) else None
        try:
            data = load_yaml(adapter) if source is not None else adapter
            a = parse_adapter_config(data, self.model_config(), source=source)
        except ConfigError as e:
            raise ServiceError(f"rejected {source or 'adapter'}: {e}") from None
        return self._reply(self._call("submit", a.model_dump(mode="json")))

    def remove(self, name: str) -> AdapterStatus:
        return self._reply(self._call("remove", name))

    def status(self) -> ServiceStatus:
        return self._call("status", timeout=60)

    def shutdown(self, timeout: float | None = None) -> ServiceStatus:
        """Finish the current step, checkpoint every live adapter and stop training (the actor stays until killed)."""
        return self._call("shutdown", timeout=timeout)

    @staticmethod
    def _reply(r: Reply) -> AdapterStatus:
        if r.error is not None:
            raise ServiceError(r.error)
        assert r.adapter is not None
        return r.adapter


# -- serve ----------------------------------------------------------------------------------------------------------
def _actor_resources(cfg: RunConfig) -> dict[str, float]:
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    device = cfg.model.device
    if device.startswith("cuda") and gpus < 1:
        raise ServiceError(f"model.device: {device!r} -> the Ray cluster has no GPU; use 'auto' or 'cpu'")
    if cfg.trainer.world_size > 1:  # the trainer ranks are actors with resources of their own
        return {"num_cpus": 0, "num_gpus": 0}
    return {"num_cpus": 1, "num_gpus": 1 if device != "cpu" and gpus >= 1 else 0}


def serve(
    cfg: RunConfig,
    address: str | None = None,
    health_every_s: float = 5.0,
    tinker: dict[str, Any] | None = None,
    source: str | None = None,
) -> int:
    """Run the service until SIGINT/SIGTERM: then checkpoint, stop, kill the actor, shut Ray down. Returns the exit code.

    `tinker`: {"host", "port", "base_model", "snapshot_every", "max_tokens_cap", "session_timeout_s"} (and optionally
    "stability_max_tokens") to serve the
    Tinker API from the same process as the GRPO tenants."""
    import ray

    from rl_multilora.validate import check_run

    if tinker is not None:
        from rl_multilora.tinker.server import resolve_token, service_problems

        problems = service_problems(cfg)
        if problems:
            raise ServiceError("--tinker-port needs the embedded engine: " + "; ".join(problems))
        resolve_token(tinker_state_dir(cfg))  # written (0600) here, so the banner can point at it
    # what --dry-run checks, before a cluster starts; the service's own files are read here too
    check_run(cfg, source, service=True)
    # A run dir another process trains into, said now: the actor takes the lock for good, but its refusal comes after
    # a Ray cluster has started (about 30 s) and behind Ray's copy of the actor's traceback.
    hold_run_dir(Path(cfg.run_dir)).release()
    try:  # the actor's process starts with jemalloc preloaded (model.host_allocator; Ray's runtime_env)
        actor_env = jemalloc_ray_options(cfg.model.host_allocator == "jemalloc")
    except ValueError as e:
        raise ServiceError(str(e)) from None
    # Handlers first: a signal while the actor is still building (a large model takes minutes) must still kill it,
    # or a detached actor would outlive this process on a cluster we joined.
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum, _frame):
        received.append(signal.Signals(signum).name)
        stop.set()

    _ray_init(address, start_cluster=address is None)
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    handle = None
    try:
        try:
            ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
            raise ServiceError(
                f"a service is already running in this Ray cluster (actor {ACTOR_NAME!r}, namespace {NAMESPACE!r}); "
                "use rl-multilora submit/status/remove against it, or stop its serve process first"
            )
        except ValueError:
            pass
        opts = {**_actor_resources(cfg), **actor_env}
        if actor_env:  # a worker with the actor's environment first: the loader only warns when it cannot preload
            got = ray.get(ray.remote(allocator_name).options(num_cpus=0, **actor_env).remote())
            if got != "jemalloc":
                raise ServiceError(
                    f"model.host_allocator='jemalloc' is not allowed here: a Ray worker started with "
                    f"LD_PRELOAD={actor_env['runtime_env']['env_vars']['LD_PRELOAD']} has {got} (see the loader's "
                    "message above); allowed: glibc, or RL_MULTILORA_JEMALLOC naming a libjemalloc.so this system "
                    "can load"
                )
        handle = (
            ray.remote(concurrency_groups={UNQUEUED_GROUP: 4})(ServiceActor)  # not an `.options()` setting in Ray
            .options(name=ACTOR_NAME, namespace=NAMESPACE, lifetime="detached", max_concurrency=16, **opts)
            .remote(cfg.model_dump(mode="json"), os.getcwd(), tinker)
        )
        ready = handle.ready.remote()
        while not stop.is_set() and not ray.wait([ready], timeout=1.0)[0]:
            pass
        if stop.is_set():
            log.info("%s during startup: stopping", received[0])
            return 0
        try:
            allocator = ray.get(ready)
        except Exception as e:  # noqa: BLE001 - a bad model path etc. surfaces as RayActorError with the cause
            raise ServiceError(f"the service failed to start: {_cause(e)}") from None
        client = ServiceClient(handle)
        if tinker is not None:
            token_at = (
                "$RL_MULTILORA_TINKER_TOKEN"
                if os.environ.get("RL_MULTILORA_TINKER_TOKEN")
                else tinker_state_dir(cfg) / "token"
            )
            print(f"  tinker API: http://{tinker['host']}:{tinker['port']} (token in {token_at})", flush=True)
        stuck = False
        try:
            code = _run_until_signal(client, cfg, stop, health_every_s, started=address is None, allocator=allocator)
        except ServiceError as e:  # the actor is gone, or no answer for long: still try to checkpoint before the kill
            log.error("%s", e)
            code, stuck = 1, True
        log.info("%s: checkpointing and stopping the service", received[0] if received else "error")
        try:  # a stuck service gets a bounded wait: the `finally` below kills the actor either way
            print(client.shutdown(timeout=STUCK_SHUTDOWN_S if stuck else None).table(), flush=True)
        except ServiceError as e:
            log.error("the service did not stop cleanly (%s); killing it: adapters keep their last checkpoints", e)
        return code
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if handle is not None:
            ray.kill(handle)
        ray.shutdown()


_MAX_LATE_STATUS = 5  # serve's health check gives up on a service whose status timed out this many times in a row
STUCK_SHUTDOWN_S = 120.0  # how long serve waits for a service it found stuck to checkpoint and stop, before the kill


def _cause(e: BaseException) -> str:
    """The last line of a remote failure (the exception itself), not Ray's page of context around it."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(e).__name__


def _run_until_signal(
    client: ServiceClient,
    cfg: RunConfig,
    stop: threading.Event,
    health_every_s: float,
    started: bool,
    allocator: str = "glibc",
) -> int:
    """Print the banner, then watch the service until a signal (0) or a training error (1)."""
    import ray

    ctx = ray.get_runtime_context()
    if _auth_mode() != "token":
        auth = "DISABLED (RAY_AUTH_MODE=disabled)" if started else "no token sent; the cluster's RAY_AUTH_MODE decides"
    elif started:
        auth = f"token (in {token_location()})"
    else:
        auth = f"token sent (from {token_location()}); the cluster's RAY_AUTH_MODE decides whether it is required"
    address = "" if started else f" --address {ctx.gcs_address}"
    print(
        f"rl-multilora service ready (Ray {ctx.gcs_address}, namespace {NAMESPACE!r}, actor {ACTOR_NAME!r})\n"
        f"  run dir: {cfg.run_dir}   slots: {cfg.model.max_loras}   max rank: {cfg.model.max_rank}   "
        f"host allocator: {allocator}\n"
        f"  auth: {auth}\n"
        f"  submit: rl-multilora submit ADAPTER.yaml{address} | status: rl-multilora status{address} | stop: Ctrl-C",
        flush=True,
    )
    late = 0  # status calls in a row that timed out
    while not stop.wait(health_every_s):
        try:
            st = client.status()
        except ServiceTimeout as e:
            late += 1
            if late < _MAX_LATE_STATUS:
                log.warning("%s (%d in a row); still watching", e, late)
                continue
            raise ServiceError(f"{e}, {late} times in a row: the service looks stuck") from None
        late = 0
        if st.error is not None:
            log.error("the service stopped training after an error: %s", st.error)
            return 1
    return 0


# -- CLI ------------------------------------------------------------------------------------------------------------
def _tinker_flag_problems(tinker: dict[str, Any]) -> list[str]:
    """`serve --tinker-*` flags out of range, each naming the flag (the bounds `tinker-serve` holds its flags to)."""
    from rl_multilora.errors import bad_value

    problems = []
    if not 1 <= tinker["port"] <= 65535:
        problems.append(bad_value("--tinker-port", tinker["port"], "a port from 1 to 65535"))
    for key, flag in (("snapshot_every", "--tinker-snapshot-every"), ("max_tokens_cap", "--tinker-max-tokens-cap"),
                      ("stability_max_tokens", "--tinker-stability-max-tokens")):  # fmt: skip
        value = tinker.get(key)
        if value is not None and value < 1:
            problems.append(bad_value(flag, value, "an integer >= 1"))
    if not 0 < tinker["session_timeout_s"] < math.inf:
        problems.append(bad_value("--tinker-session-timeout-s", tinker["session_timeout_s"], "seconds > 0"))
    return problems


def cli(args) -> int:
    """Entry point for `rl-multilora serve | submit | remove | status` (routed here by rl_multilora.cli)."""
    try:
        import ray  # noqa: F401 - every verb talks to a Ray cluster: say so before a config is read
    except ImportError:
        raise ServiceError(
            f'`rl-multilora {args.command}` needs Ray, which is not installed: pip install -e ".[ray]" in the '
            "checkout (the ray extra)"
        ) from None
    if args.command == "serve":
        tinker = None
        if args.tinker_port is not None:
            tinker = {
                "host": args.host,
                "port": args.tinker_port,
                "base_model": args.tinker_base_model,
                "snapshot_every": getattr(args, "tinker_snapshot_every", 50),
                "max_tokens_cap": getattr(args, "tinker_max_tokens_cap", None),
                "session_timeout_s": getattr(args, "tinker_session_timeout_s", 120.0),
            }
            if getattr(args, "tinker_stability_max_tokens", None) is not None:
                tinker["stability_max_tokens"] = args.tinker_stability_max_tokens
            problems = _tinker_flag_problems(tinker)
            if problems:  # before a config is read or a Ray cluster starts, as tinker-serve checks its own flags
                raise ServiceError("; ".join(problems))
        cfg = load_run_config(args.config, args.set)
        if args.fresh:
            cfg.checkpoint.resume = "never"
        return serve(cfg, address=args.address, tinker=tinker, source=args.config)
    client = ServiceClient.connect(args.address)
    if args.command == "submit":
        st = client.submit(args.target)
        print(f"accepted {st.name}: {st.state} (trains from the next step once a slot is free)")
        return 0
    if args.command == "remove":
        st = client.remove(args.target)
        if st.state == TenantState.REMOVED.value:
            print(f"{st.name}: removed (it never started)")
        else:
            print(f"{st.name}: draining; checkpointed and unloaded at the end of the current step")
        return 0
    if args.command == "status":
        s = client.status()
        print(json.dumps(s.to_dict(), indent=1) if args.json else s.table())
        return 0
    raise ServiceError(f"command: {args.command!r} -> allowed: serve, submit, remove, status")
