"""The GRPO driver: one step is draw prompts -> generate -> score -> train -> log -> retire/admit -> sync.

`Runtime.build` wires the components once (each built by `rl_multilora.components`); `Runtime.step` is the page a
reader learns the system from. Single-run
mode loops until every adapter is done; service mode (`rl_multilora.service`) calls `step` forever and admits/retires
adapters between steps through the same tenant manager.

Who owns what: every fact about an adapter is its `Tenant`'s (`rl_multilora.tenants`), and `TenantManager` is their
only writer: it admits adapters, fans each transition out to the training backend (`rl_multilora.backends`: slot +
optimizer), the data source (cursor), checkpoints and, at the next sync, the engine, and applies what the step, the
weight sync and the evaluations return. The loop talks to the backend only through its interface.

Design choices:
- Rollout and training alternate synchronously (colocated, on-policy): every sample trained in step k was generated
  by the adapter version pushed at the end of step k-1. The version check in the trainer still guards it.
- An adapter that runs out of budget drains at the end of the step it finished in: with synchronous steps its
  in-flight samples are exactly that step's, which have already trained.
- The weight sync is the last thing in a step, so the engine is paused once per step, for the adapters that stepped,
  the ones admitted for the next step, and the ones that left.
- `rollout.mode: async` pipelines one step ahead: right after a step's rollout, the groups of the next step are
  drawn for every tenant whose `max_staleness` is at least 1 and generated in a background thread (its own
  `GenerateState`) while this step evaluates, scores and trains; the weight sync then publishes without pausing
  the engine where it can (`publishes_without_pause`), so rows of the next step that started before it finish on
  the old version and later ones get the new. Each sample carries its version; the trainer drops samples more than
  the tenant's `max_staleness` versions behind (counted as stale). Tenants with `max_staleness: 0` roll out at the
  start of each step as in sync mode. The data cursor runs one step ahead, so a resumed run skips the prompts that
  were in flight (at most one step's groups per tenant); every trained step is in its checkpoint. With turns (more
  tenants than a step holds) the next step's tenants are picked one step ahead, and their groups are what is drawn
  ahead; the trainer prefetches their paged-out states (more tenants than slots) while this step trains, so the
  next step's page-ins only copy into slots (`rl_multilora.tenant_store`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import math
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rl_multilora import components, validate
from rl_multilora.backends.base import TrainingBackend, paging_stats_of
from rl_multilora.batch import AdapterStepStats
from rl_multilora.checkpoint import CheckpointManager, base_identity, hold_run_dir
from rl_multilora.config import AdapterConfig, RunConfig, dump_config
from rl_multilora.evaluate import EvalJob, EvalResult, EvalSet, evaluate_adapters, run_evals
from rl_multilora.host_memory import jemalloc_loaded, release_freed_memory, set_mmap_threshold
from rl_multilora.metrics import MetricsLogger, StepRecord, console_line, eval_line, plot_reward_curves
from rl_multilora.shares import fair_quotas
from rl_multilora.tenants import Tenant, TenantManager, TenantState
from rl_multilora.weight_sync import SyncStats, WeightSync
from rollout.types import Sample, SampleStatus

log = logging.getLogger("rl_multilora")


class _Clock:
    """`with clock("train_s"): ...` adds the block's wall time to timings["train_s"]."""

    def __init__(self, timings: dict[str, float]):
        self.timings = timings

    @contextlib.contextmanager
    def __call__(self, key: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if key in _TRIM_AFTER:  # phases that free much of what they allocated (rl_multilora.host_memory)
                release_freed_memory()
            self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - t0


_TRIM_AFTER = frozenset({"rollout_s", "eval_s", "train_s"})


@dataclass
class StepResult:
    step: int
    records: list[StepRecord] = field(default_factory=list)
    evals: list[EvalResult] = field(default_factory=list)
    sync: SyncStats | None = None
    timings: dict[str, float] = field(default_factory=dict)


class _Ahead:
    """Async mode: the next step's groups, generating in a background thread while this step trains."""

    def __init__(
        self,
        pool: concurrent.futures.ThreadPoolExecutor,
        generator,
        names: list[str],
        groups: list[list[Sample]],
        lives: dict[str, Tenant],
    ):
        self.drawn = list(names)  # the tenants whose cursors moved for it (settled when it is taken)
        # name -> the tenant record it was drawn for: a name removed and submitted again is another tenant
        self.lives = lives
        self.names = {s.adapter.name for g in groups for s in g if s.adapter is not None}  # those it has groups of
        self._future = pool.submit(generator.run_sync, groups)

    def samples(self) -> list[Sample]:
        return self._future.result()


class Runtime:
    """All components of a run, built once. See the module docstring for the step order."""

    def __init__(
        self,
        cfg: RunConfig,
        backend: TrainingBackend,
        tokenizer,
        engine,
        launcher,
        data,
        generator,
        scorer,
        ahead_generator=None,
    ):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.backend = backend
        self.tokenizer = tokenizer
        self.engine = engine
        self.launcher = launcher
        self.generator = generator
        self.scorer = scorer
        self.ckpt = CheckpointManager(
            self.run_dir, keep_last=cfg.checkpoint.keep_last, base=base_identity(cfg.model.path)
        )
        self.tenants = TenantManager(cfg, backend, data, self.ckpt)
        self.weight_sync = WeightSync(engine, backend)
        self.metrics = MetricsLogger(self.run_dir, cfg.logging.wandb, cfg.model_dump(mode="json"))
        self._eval_sets: dict[str, tuple[AdapterConfig, EvalSet]] = {}
        self._stop_requested = False
        # The global step that raised before it was done (`step`), if one did: its state is half applied (its
        # optimizer may have stepped, its data cursor moved), so no checkpoint may record it as done.
        self.broken_step: int | None = None
        # Async mode: the next step's rollout (its own GenerateState, in one background thread).
        self.ahead_generator = ahead_generator
        self._ahead: _Ahead | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        if cfg.rollout.mode == "async":
            if ahead_generator is None:
                raise ValueError("rollout.mode async needs a second generator for the rollout ahead")
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")

    @property
    def data(self):
        return self.tenants.data

    # -- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def build(cls, cfg: RunConfig) -> Runtime:
        if cfg.model.malloc_mmap_threshold_kb is not None:  # before the model's tensors are allocated
            set_mmap_threshold(cfg.model.malloc_mmap_threshold_kb * 1024)
        if cfg.model.host_allocator == "jemalloc" and not jemalloc_loaded():
            log.warning(
                "model.host_allocator is jemalloc, but this process was started with the C library's malloc, which it "
                "keeps: `rl-multilora run` starts itself with jemalloc; a Python caller must preload it (LD_PRELOAD)"
            )
        elif jemalloc_loaded():
            log.info("host allocator: jemalloc (freed memory is purged between a step's phases)")
        components.seed_everything(cfg.seed)
        run_dir = Path(cfg.run_dir)
        held = hold_run_dir(run_dir)  # released by `close` (one process trains into a run dir at a time)
        try:
            (run_dir / "config.yaml").write_text(dump_config(cfg))
            tokenizer = components.build_tokenizer(cfg.model)
            backend = components.build_backend(cfg, components.pad_token_id(tokenizer))
            engine, launcher = components.build_engine(cfg, backend, tokenizer)
            generator = components.build_generator(cfg, engine, tokenizer)
            data = components.build_data_source(cfg, tokenizer)
            ahead = components.build_generator(cfg, engine, tokenizer) if cfg.rollout.mode == "async" else None
            scorer = components.build_scorer(cfg)
            rt = cls(cfg, backend, tokenizer, engine, launcher, data, generator, scorer, ahead_generator=ahead)
        except BaseException:
            held.release()
            raise
        rt._run_dir_lock = held
        return rt

    # -- tenants --------------------------------------------------------------------------------------------------
    def register(self, a: AdapterConfig, facts=None):
        """Admit an adapter as PENDING after every admission check (`TenantManager.submit`; `facts`: its outside
        facts when the caller read them, `TenantManager.outside_facts`)."""
        return self.tenants.submit(a, facts=facts)

    def remove(self, name: str, reason: str = "removed by request") -> None:
        """Drain an adapter: no new prompts; it is checkpointed and unloaded at the end of the step."""
        self.tenants.drain(name, reason)

    # -- one step -------------------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        if self.broken_step is not None:
            raise RuntimeError(f"global step {self.broken_step} failed before it was done; resume the run to redo it")
        step = self.tenants.global_step
        try:
            return self._step()
        except BaseException:
            if self.tenants.global_step == step:  # it failed before `finish_step` counted it
                self.broken_step = step
            raise

    def _step(self) -> StepResult:
        tenants = self.tenants
        res = StepResult(step=tenants.global_step)
        clock = _Clock(res.timings)
        names = tenants.scheduled()  # every running tenant, or this step's turns when more run than a step holds
        paging_before = paging_stats_of(self.backend)
        with clock("rollout_s"):
            # Async: the groups generated during the previous step's training (for tenants still running).
            ready, covered = self._take_ahead(names)
            groups = self._draw([n for n in names if n not in covered], among=names)
            samples = ready + (self.generator.run_sync(groups) if groups else [])
            self._start_ahead(names)
        with clock("eval_s"):  # on the versions the rollout used, never trained on
            res.evals = run_evals(self.generator, self.scorer, self._due_evals(), self.cfg.eval.max_wave_tokens)
            tenants.apply_evals(res.evals)
        with clock("reward_s"):
            report = self.scorer.score_samples(samples)
        current = tenants.current_versions()  # the versions training starts from (what the samples lag behind)
        with clock("train_s"):
            stats = self.backend.train_step(samples, self._oldest_versions(current), tenants.step_limits())
        mine = {n: [s for s in samples if s.adapter is not None and s.adapter.name == n] for n in names}
        means = {n: _reward_stats(mine[n])[0] for n in names}
        with clock("checkpoint_s"):
            tenants.apply_step(names, stats, means, report.all_failed)
            lag_from = current if self._pool is not None else {}  # async: samples' lag behind these versions
            res.records = [
                self._record(res.step, n, mine[n], len(samples), stats.get(n), report, lag_from.get(n)) for n in names
            ]
            for rec in res.records:  # what the fault policy's message quotes when a tenant goes idle on failures
                if rec.failed_reason is not None:
                    tenants.get(rec.adapter).last_failed_reason = rec.failed_reason
            tenants.enforce_faults(names, stats, report.all_failed)
            tenants.retire_finished(in_flight=self._ahead.names if self._ahead is not None else ())
            tenants.admit_pending()
            self._save_due_checkpoints(names, stats)
        with clock("sync_s"):
            res.sync = self.sync_now()
        paging = _paging_row(paging_before, paging_stats_of(self.backend), self.engine)
        for rec in res.records:
            rec.paging = paging
            rec.pause_s = res.sync.pause_s
            rec.bytes_pushed = res.sync.bytes_pushed
            rec.bytes_gathered = res.sync.bytes_gathered
            rec.adapters_pushed = len(res.sync.pushed)
            rec.timings = dict(res.timings)
            self.metrics.log(rec)
            log.info(console_line(rec))
        self._log_evals(res.step, res.evals)
        # Last: a step counts as done only once its metrics rows are written (resume redoes unfinished steps).
        tenants.finish_step()
        return res

    # -- rollouts -------------------------------------------------------------------------------------------------
    def _draw(self, names: list[str], among: list[str], ahead: bool = False) -> list[list[Sample]]:
        """The prompt groups of `names` for one step: their fair shares of the step's row cap among the tenants
        `among` that share it (async draws a step's groups in two parts, ahead and at its start; the shares are
        the same as if drawn at once). `ahead`: for the next step (async); checkpoints keep the cursor from before
        them until they are taken."""
        if not names:
            return []
        quotas = fair_quotas(
            {n: self.data.ask(n) for n in among},
            {n: self.tenants.get(n).cfg.weight for n in among},
            self.cfg.rollout.max_rows_per_step,
        )
        return [g for gs in self.data.next_groups(names, quotas, ahead=ahead).values() for g in gs]

    def _take_ahead(self, names: list[str]) -> tuple[list[Sample], set[str]]:
        """Async: the samples generated ahead for `names` (waiting for the generation if it is still running) and
        the tenants they cover; those of tenants that left since are dropped."""
        if self._ahead is None:
            return [], set()
        ahead, self._ahead = self._ahead, None
        same = self._same_tenants(ahead)
        keep = same & set(names)
        self.data.settle(keep)
        # drawn for a tenant that stopped since: never trained, so its cursor goes back before them (its final
        # checkpoint, or a later draw, has those rows again)
        self.data.unwind(same - keep)
        samples = [s for s in ahead.samples() if s.adapter is not None and s.adapter.name in keep]
        return samples, ahead.names & keep

    def _same_tenants(self, ahead: _Ahead) -> set[str]:
        """The tenants `ahead` was drawn for that are still the same tenants (not removed, and not removed and
        submitted again under the same name: that one's data stream and adapter are new)."""
        table = self.tenants.tenants
        return {n for n in ahead.drawn if n in self.data.adapters and table.get(n) is ahead.lives.get(n)}

    def _drop_ahead(self) -> None:
        """Async, with no tenant running (the service between submissions): the look-ahead of the tenants that
        left is waited for and dropped, their cursors put back; a tenant submitted again under one of their names
        must not train the old one's samples."""
        if self._ahead is None:
            return
        ahead, self._ahead = self._ahead, None
        ahead.samples()  # its generation finishes first (it reads the engine)
        self.data.unwind(self._same_tenants(ahead))

    def _start_ahead(self, names: list[str]) -> None:
        """Async: draw the next step's groups of every tenant that may lag (max_staleness >= 1) and is not about to
        spend its budget in this step, and generate them in the background while this step trains. With turns the
        next step's tenants are picked now (`TenantManager.plan_next`), and the trainer prefetches their paged-out
        states in the background too (`TrainingBackend.prefetch`)."""
        if self._pool is None:
            return
        nxt = self.tenants.plan_next() if self.tenants.turns is not None else names
        ahead = []
        for n in nxt:
            t = self.tenants.get(n)
            left = t.steps_left()
            spends = self.cfg.grpo.ppo_epochs if n in names else 0  # optimizer steps it may take in this step
            if self.cfg.max_staleness_for(t.cfg) >= 1 and (left is None or left > spends):
                ahead.append(n)
        groups = self._draw(ahead, among=nxt, ahead=True)
        if groups:
            lives = {n: self.tenants.get(n) for n in ahead}
            self._ahead = _Ahead(self._pool, self.ahead_generator, ahead, groups, lives)
        else:
            self.data.settle(ahead)  # nothing was left to draw: no cursor is held back
        prefetch = getattr(self.backend, "prefetch", None)  # an object standing in for a backend may not page
        if self.tenants.turns is not None and prefetch is not None:
            prefetch(nxt)

    def _oldest_versions(self, current: dict[str, int]) -> dict[str, int]:
        """The oldest weight version each tenant trains on: its `current` one less its max_staleness (sync: 0)."""
        return {
            name: version - self.cfg.max_staleness_for(self.tenants.get(name).cfg) for name, version in current.items()
        }

    def idle_step(self) -> None:
        """No tenant RUNNING (the service between submissions): retire drained adapters, admit pending ones and
        sync, without spending a global step (so a drained adapter's final checkpoint is not the step's)."""
        self._drop_ahead()  # before the retirement's checkpoints: they record the cursors from before it
        self.tenants.retire_finished(in_step=False)
        self.tenants.admit_pending()
        self.sync_now()
        self.tenants.save_run_state()

    # -- held-out evaluation ---------------------------------------------------------------------------------------
    def eval_set(self, a: AdapterConfig) -> EvalSet | None:
        """Adapter `a`'s held-out prompts (built once), or None when its eval is off."""
        settings = self.cfg.eval_for(a)
        if not settings.enabled:
            return None
        cached = self._eval_sets.get(a.name)
        if cached is None or cached[0] != a:  # a name submitted again may come with another dataset
            self._eval_sets[a.name] = (
                a,
                EvalSet(a, settings, self.tokenizer, self.generator.sampling, self.data.context_len),
            )
        return self._eval_sets[a.name][1]

    def _due_evals(self) -> list[EvalJob]:
        """The base before a tenant's first step, then its adapter every `eval.every` adapter steps."""
        jobs = []
        for t in self.tenants.running():
            es = self.eval_set(t.cfg)
            if es is None or t.last_eval_step == t.adapter_step:
                continue
            every = es.settings.every
            if t.adapter_step == 0:
                jobs.append(EvalJob(es, None, 0))
            elif every is not None and t.adapter_step % every == 0:
                jobs.append(EvalJob(es, t.name, t.adapter_step))
        return jobs

    def _log_evals(self, step: int, results: list[EvalResult]) -> None:
        for r in results:
            row = r.to_row(step)
            self.metrics.log_row(row)
            log.info(eval_line(row))

    def final_evals(self, run_over: bool = False) -> list[EvalResult]:
        """Evaluate every adapter that finished its budget on its final checkpoint (its weights after the last step,
        which no rollout used), in batches of as many as the engine has slots. `run_over`: the run stopped (e.g. at
        `max_global_steps`), so adapters still running are evaluated on their newest checkpoint too."""
        from rl_multilora.metrics import read_metrics

        done = {
            (r["adapter"], r["adapter_step"])
            for r in read_metrics(self.run_dir)
            if r.get("kind") == "eval" and not r.get("eval/base")
        }  # a finished run dir run again evaluates nothing twice
        todo = [
            (t, self.eval_set(t.cfg))
            for t in self.tenants.in_state(
                TenantState.DRAINED, TenantState.REMOVED, *((TenantState.RUNNING,) if run_over else ())
            )
            if t.last_checkpoint
            and t.adapter_step > 0
            and t.last_eval_step != t.adapter_step
            and (t.name, t.adapter_step) not in done
            and self.eval_set(t.cfg) is not None
        ]
        checkpoints = {t.name: self.ckpt.read_weights(t.name, folder=t.last_checkpoint) for t, _ in todo}
        jobs = [EvalJob(es, t.name, t.adapter_step) for t, es in todo]
        results = evaluate_adapters(
            self.generator, self.scorer, jobs, checkpoints, self.cfg.model.max_loras, self.cfg.eval.max_wave_tokens
        )
        self.tenants.apply_evals(results)
        self._log_evals(self.tenants.global_step, results)
        return results

    def sync_now(self) -> SyncStats:
        push, unload = self.tenants.sync_plan()
        pause = self.cfg.rollout.mode != "async" or not self.engine.publishes_without_pause
        stats = SyncStats()
        try:
            self.weight_sync.sync(push=push, unload=unload, pause=pause, stats=stats)
        finally:  # what the engine took is recorded even when a later push failed (its versions, its unloads)
            self.tenants.apply_sync(stats.pushed, stats.adapters_unloaded)
        return stats

    def _record(
        self,
        step: int,
        name: str,
        mine: list[Sample],
        n_samples: int,
        st: AdapterStepStats | None,
        report,
        lag_from: int | None = None,
    ) -> StepRecord:
        """One adapter's metrics record for this step (after the tenant manager applied the step). `lag_from`
        (async): the version training started from, which the samples' versions lag behind."""
        t = self.tenants.get(name)
        reward_mean, reward_std = _reward_stats(mine)
        lags = [lag_from - s.weight_version for s in mine if lag_from is not None and s.weight_version is not None]
        return StepRecord(
            step=step,
            adapter=name,
            adapter_step=t.adapter_step,
            reward_mean=reward_mean,
            reward_std=reward_std,
            response_len_mean=statistics.fmean(len(s.response_ids) for s in mine) if mine else None,
            n_samples=len(mine),
            truncated_frac=(sum(s.status == SampleStatus.TRUNCATED for s in mine) / len(mine)) if mine else None,
            failed_samples=sum(s.status in (SampleStatus.FAILED, SampleStatus.ABORTED) for s in mine),
            failed_reason=_failed_reason(mine),
            reward_errors=report.errors.get(name, 0),
            reward_timeouts=report.timeouts.get(name, 0),
            reward_crashes=report.crashes.get(name, 0),
            reward_error_reason=_most_common(
                str(s.metadata["reward_error"]) for s in mine if "reward_error" in s.metadata
            ),
            bad_rows=(data := self.data.stats(name)).get("bad_rows", 0),
            bad_row_reasons=data.get("bad_row_reasons") or None,
            weight_version=t.weight_version,
            row_share=round(len(mine) / n_samples, 4) if n_samples else None,
            slot_wait_s=round(t.admitted_at - t.registered_at, 3) if t.admitted_at is not None else None,
            train=st,
            nonfinite_streak=t.nonfinite_streak,
            version_lag_max=max(lags) if lags else None,
            version_lag_mean=statistics.fmean(lags) if lags else None,
        )

    def _save_due_checkpoints(self, names: list[str], stats: dict[str, AdapterStepStats]) -> None:
        every = self.cfg.checkpoint.save_every
        for name in names:
            t = self.tenants.get(name)
            st = stats.get(name)
            if t.state == TenantState.RUNNING and st is not None and st.stepped and t.adapter_step % every == 0:
                self.tenants.save_checkpoint(t)

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def start(self, checked: bool = False) -> None:
        """Resume run state if any, register the config's adapters, admit, and push the initial weights.

        `checked`: the caller already ran `validate.check_run(cfg)` (as `run` does), so the adapters' admission checks
        are not repeated here.
        """
        self.tenants.restore_run_state()
        for a in self.cfg.adapters:
            if a.name not in self.tenants.tenants:
                self.tenants.submit(a, checked=checked, restart=True)
        self.tenants.admit_pending()
        self.sync_now()
        self.tenants.save_run_state()  # admission may have retired resumed adapters at their budget: record it

    def finished(self) -> bool:
        if self._stop_requested or self.tenants.all_done():
            return True
        m = self.cfg.max_global_steps
        return m is not None and self.tenants.global_step >= m

    def checkpoint_all(self) -> None:
        """Checkpoint every running adapter between steps (a stop). Not after a step that failed half way: its
        adapters' checkpoints would record the step as done with its state half applied (an optimizer step taken
        but not counted, prompts drawn but never trained on); the last committed checkpoints stay the resume point
        and resume redoes that step."""
        if self.broken_step is not None:
            log.warning(
                "global step %d failed before it was done: not checkpointing its half-applied state; resume redoes "
                "it from each adapter's last checkpoint", self.broken_step,
            )  # fmt: skip
            return
        self.tenants.checkpoint_all()

    def close(self) -> None:
        held, self._run_dir_lock = getattr(self, "_run_dir_lock", None), None
        try:
            self._close()
        finally:
            if held is not None:
                held.release()

    def _close(self) -> None:
        self.metrics.close()
        self.scorer.close()
        self.engine.close()  # a rollout still running ahead (async) ends here: its rows come back as errors
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._ahead = None
        self.backend.close()
        if self.launcher is not None:
            self.launcher.stop()


def _paging_row(before, after, engine) -> dict[str, float] | None:
    """This step's paging, for every metrics row of the step: tenants resident vs paged now, page-ins (trainer
    slots) and their time, host memory of the paged states, and the engine bank's page-ins."""
    if after is None:
        return None
    n = after.page_ins - before.page_ins
    seconds = after.page_in_s - before.page_in_s
    row = {
        "tenants_resident": after.resident,
        "tenants_paged": after.paged,
        "tenants_spilled": after.spilled,
        "page_ins": n,
        "page_in_s": round(seconds, 4),
        "page_in_ms_per_adapter": round(1000 * seconds / n, 3) if n else None,
        "page_ins_prefetched": after.prefetched - before.prefetched,  # async: staged while the step before trained
        "paged_host_mb": round(after.host_bytes / 2**20, 3),
    }
    bank = getattr(engine, "bank_page_ins", None)
    if bank is not None:
        row["engine_page_ins"] = bank
    return row


def _most_common(reasons) -> str | None:
    """The most common of `reasons` (each shortened to 500 characters), or None when there is none."""
    counted = collections.Counter(r[:500] for r in reasons)
    return counted.most_common(1)[0][0] if counted else None


def _failed_reason(samples: list[Sample]) -> str | None:
    """The most common reason among the failed samples (`metadata["error"]`, shortened to 500 characters): why an
    environment, a chat template or an engine request failed, which nothing else reports."""
    return _most_common(
        str(s.metadata.get("error") or s.status.value)
        for s in samples
        if s.status in (SampleStatus.FAILED, SampleStatus.ABORTED)
    )


def _reward_stats(mine: list[Sample]) -> tuple[float | None, float | None]:
    """Mean and population std of the samples' rewards (None when there are none)."""
    rewards_ = [s.reward for s in mine if s.reward is not None]
    try:
        mean = statistics.fmean(rewards_) if rewards_ else None
        std = statistics.pstdev(rewards_) if len(rewards_) > 1 else 0.0
    except OverflowError:  # finite rewards whose sum overflows: the trainer skips that step; log them as null
        return None, None
    return mean, std


def run(cfg: RunConfig, source: str | None = None) -> Runtime:
    """Single-run mode: train until every adapter is done, then write the reward curves."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    validate.check_run(cfg, source)  # everything --dry-run checks, before anything is loaded or written
    rt = Runtime.build(cfg)
    try:
        rt.start(checked=True)
        bar = tqdm(
            total=_steps_left(rt),
            initial=rt.tenants.global_step,
            desc="grpo",
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} steps [{elapsed}{postfix}]",  # our estimate, not tqdm's
            disable=not cfg.logging.progress,
        )
        if bar.total is not None:
            bar.total += bar.n
        step_s: list[float] = []
        # Console lines go through tqdm.write, so they print above the bar instead of through it.
        with logging_redirect_tqdm(), bar, _StopOnSignal() as stop:
            while not rt.finished() and stop.signal is None:
                t0 = time.perf_counter()
                res = rt.step()
                step_s.append(time.perf_counter() - t0)
                means = [r.reward_mean for r in res.records if r.reward_mean is not None]
                left = _steps_left(rt)
                if left is not None:
                    bar.total = bar.n + 1 + left
                bar.set_postfix(
                    reward=f"{statistics.fmean(means):.3f}" if means else "-", left=_time_left(step_s, left),
                    refresh=False,
                )  # fmt: skip
                bar.update(1)
        # Stopped with adapters still running (max_global_steps, a signal): their steps since the last periodic save
        # are checkpointed (nothing trained is lost, and the run resumes from here).
        rt.checkpoint_all()
        if stop.signal is not None:
            raise RunStopped(stop.signal, rt.tenants.global_step)
        # ... and evaluated like finished ones
        rt.final_evals(run_over=True)
        if cfg.logging.plot:
            png = plot_reward_curves(cfg.run_dir)
            if png:
                log.info("reward curves: %s", png)
    finally:
        rt.close()
    return rt


class RunStopped(Exception):
    """`run` stopped by SIGINT or SIGTERM between two steps, every running adapter checkpointed."""

    def __init__(self, signum: int, global_step: int) -> None:
        self.signum = signum
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped by {name} after global step {global_step}; every running adapter is checkpointed: run the "
            "same command to resume"
        )


class _StopOnSignal:
    """While `run` trains, the first SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption) asks it to stop after the
    step in flight, which then checkpoints every running adapter; a second one acts at once as it did before (the
    handlers before are back). No-op outside the main thread, where Python cannot take signals."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _on_signal(self, signum: int, _frame) -> None:
        self.signal = signum
        self._restore()
        log.warning("%s: stopping after this step, then checkpointing (send it again to stop at once)",
                    signal.Signals(signum).name)  # fmt: skip

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()


ESTIMATE_AFTER = 3  # steps before a time estimate: the first holds the base evaluation and the warm-up


def _steps_left(rt: Runtime) -> int | None:
    """Global steps the run needs at least: the largest step budget left of a running or waiting tenant (with
    `ppo_epochs` optimizer steps per global step), capped by `max_global_steps`. A floor, not an exact count: a
    tenant whose groups all score alike takes no optimizer step that step. None when a budget is in epochs only."""
    cfg = rt.cfg
    lefts = [
        t.steps_left() for t in rt.tenants.tenants.values() if t.state in (TenantState.PENDING, TenantState.RUNNING)
    ]
    left = None if None in lefts else -(-max(lefts, default=0) // cfg.grpo.ppo_epochs)
    # More tenants than run in one step (slots, turns): they take turns, so the step total is at least their steps
    # over the lanes (it was the longest budget alone: 3 tenants on one slot showed a third of the run)
    lanes = min(rt.backend.max_loras, cfg.rollout.max_tenants_per_step or rt.backend.max_loras)
    if left is not None and len(lefts) > lanes:
        left = max(left, math.ceil(sum(math.ceil(n / cfg.grpo.ppo_epochs) for n in lefts) / lanes))
    if cfg.max_global_steps is not None:
        cap = max(0, cfg.max_global_steps - rt.tenants.global_step)
        left = cap if left is None else min(left, cap)
    return left


def _time_left(step_s: list[float], steps_left: int | None) -> str:
    """About how long the steps left take, from the median of the last 10 step times; '?' until ESTIMATE_AFTER steps
    are done (tqdm's own estimate extrapolated the first step, base evaluation included: 52 min for a 2 min run)."""
    if steps_left is None or len(step_s) < ESTIMATE_AFTER:
        return "?"
    seconds = int(statistics.median(step_s[-10:]) * steps_left)
    return f"~{seconds // 60}m{seconds % 60:02d}s"


def summarize(run_dir: str | Path, window: int = 5) -> dict[str, dict[str, float | None]]:
    """Per adapter: first-`window` vs last-`window` mean training reward, its optimizer steps (`steps`, what
    `max_steps` counts) and the global steps it took part in (`global_steps`: more, when all its groups of a step
    scored alike and it took no optimizer step), and the held-out reward of the base and of the last evaluated adapter
    (None without eval)."""
    from rl_multilora.metrics import read_metrics

    by: dict[str, list[tuple[int, float]]] = {}
    adapter_steps: dict[str, int] = {}
    evals: dict[str, list[dict]] = {}
    for r in read_metrics(run_dir):
        if r.get("kind") == "eval":
            evals.setdefault(r["adapter"], []).append(r)
        else:
            adapter_steps[r["adapter"]] = max(adapter_steps.get(r["adapter"], 0), r["adapter_step"])
            if r.get("reward_mean") is not None:
                by.setdefault(r["adapter"], []).append((r["step"], r["reward_mean"]))
    out: dict[str, dict[str, float | None]] = {}
    for name, pts in by.items():
        pts.sort()
        vals = [v for _, v in pts]
        k = max(1, min(window, len(vals) // 2))  # windows that do not overlap: a 4-step run compared a set to itself
        first = statistics.fmean(vals[:k])
        last = statistics.fmean(vals[-k:])
        mine = evals.get(name, [])
        base = [r["eval/reward_mean"] for r in mine if r.get("eval/base")]
        held = sorted(
            (r["adapter_step"], r["step"], r["eval/reward_mean"], r.get("eval/errors", 0))
            for r in mine
            if not r.get("eval/base")
        )
        out[name] = {
            "first": first,
            "last": last,
            "window": k,  # steps in each mean: `window`, or half the steps when there are fewer than 2 * window
            "gain": last - first,
            "steps": adapter_steps[name],
            "global_steps": len(vals),
            "eval_base": base[-1] if base else None,
            "eval_final": held[-1][2] if held else None,
            "eval_final_step": held[-1][0] if held else None,
            "eval_final_errors": held[-1][3] if held else None,
        }
    return out
