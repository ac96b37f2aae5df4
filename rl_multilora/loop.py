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
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from rl_multilora import components, validate
from rl_multilora.backends.base import AdapterStepStats, TrainingBackend
from rl_multilora.checkpoint import CheckpointManager
from rl_multilora.config import AdapterConfig, RunConfig, dump_config
from rl_multilora.evaluate import EvalJob, EvalResult, EvalSet, evaluate_adapters, run_evals
from rl_multilora.metrics import MetricsLogger, StepRecord, console_line, eval_line, plot_reward_curves
from rl_multilora.shares import fair_quotas
from rl_multilora.tenants import TenantManager, TenantState
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
            self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - t0


@dataclass
class StepResult:
    step: int
    records: list[StepRecord] = field(default_factory=list)
    evals: list[EvalResult] = field(default_factory=list)
    sync: SyncStats | None = None
    timings: dict[str, float] = field(default_factory=dict)


class Runtime:
    """All components of a run, built once. See the module docstring for the step order."""

    def __init__(self, cfg: RunConfig, backend: TrainingBackend, tokenizer, engine, launcher, data, generator, scorer):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.backend = backend
        self.tokenizer = tokenizer
        self.engine = engine
        self.launcher = launcher
        self.generator = generator
        self.scorer = scorer
        self.ckpt = CheckpointManager(self.run_dir, keep_last=cfg.checkpoint.keep_last)
        self.tenants = TenantManager(cfg, backend, data, self.ckpt)
        self.weight_sync = WeightSync(engine, backend)
        self.metrics = MetricsLogger(self.run_dir, cfg.logging.wandb, cfg.model_dump(mode="json"))
        self._eval_sets: dict[str, tuple[AdapterConfig, EvalSet]] = {}
        self._stop_requested = False

    @property
    def data(self):
        return self.tenants.data

    # -- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def build(cls, cfg: RunConfig) -> Runtime:
        components.seed_everything(cfg.seed)
        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        tokenizer = components.build_tokenizer(cfg.model)
        backend = components.build_backend(cfg, components.pad_token_id(tokenizer))
        engine, launcher = components.build_engine(cfg, backend, tokenizer)
        generator = components.build_generator(cfg, engine, tokenizer)
        data = components.build_data_source(cfg, tokenizer)
        return cls(cfg, backend, tokenizer, engine, launcher, data, generator, components.build_scorer(cfg))

    # -- tenants --------------------------------------------------------------------------------------------------
    def register(self, a: AdapterConfig):
        """Admit an adapter as PENDING after every admission check (`TenantManager.submit`)."""
        return self.tenants.submit(a)

    def remove(self, name: str, reason: str = "removed by request") -> None:
        """Drain an adapter: no new prompts; it is checkpointed and unloaded at the end of the step."""
        self.tenants.drain(name, reason)

    # -- one step -------------------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        tenants = self.tenants
        res = StepResult(step=tenants.global_step)
        clock = _Clock(res.timings)
        names = [t.name for t in tenants.running()]
        with clock("rollout_s"):
            quotas = fair_quotas(
                {n: self.data.ask(n) for n in names},
                {n: tenants.get(n).cfg.weight for n in names},
                self.cfg.rollout.max_rows_per_step,
            )
            groups = [g for gs in self.data.next_groups(names, quotas).values() for g in gs]
            samples = self.generator.run_sync(groups) if groups else []
        with clock("eval_s"):  # on the versions the rollout used, never trained on
            res.evals = run_evals(self.generator, self.scorer, self._due_evals())
            tenants.apply_evals(res.evals)
        with clock("reward_s"):
            report = self.scorer.score_samples(samples)
        with clock("train_s"):
            stats = self.backend.train_step(samples, tenants.current_versions(), tenants.step_limits())
        mine = {n: [s for s in samples if s.adapter is not None and s.adapter.name == n] for n in names}
        means = {n: _reward_stats(mine[n])[0] for n in names}
        with clock("checkpoint_s"):
            tenants.apply_step(names, stats, means, report.all_failed)
            res.records = [self._record(res.step, n, mine[n], len(samples), stats.get(n), report) for n in names]
            tenants.enforce_faults(names, stats, report.all_failed)
            tenants.retire_finished()
            tenants.admit_pending()
            self._save_due_checkpoints(names, stats)
        with clock("sync_s"):
            res.sync = self.sync_now()
        for rec in res.records:
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

    def idle_step(self) -> None:
        """No tenant RUNNING (the service between submissions): retire drained adapters, admit pending ones and
        sync, without spending a global step."""
        self.tenants.retire_finished()
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
        results = evaluate_adapters(self.generator, self.scorer, jobs, checkpoints, self.cfg.model.max_loras)
        self.tenants.apply_evals(results)
        self._log_evals(self.tenants.global_step, results)
        return results

    def sync_now(self) -> SyncStats:
        push, unload = self.tenants.sync_plan()
        stats = self.weight_sync.sync(push=push, unload=unload)
        self.tenants.apply_sync(stats.pushed, stats.adapters_unloaded)
        return stats

    def _record(
        self, step: int, name: str, mine: list[Sample], n_samples: int, st: AdapterStepStats | None, report
    ) -> StepRecord:
        """One adapter's metrics record for this step (after the tenant manager applied the step)."""
        t = self.tenants.get(name)
        reward_mean, reward_std = _reward_stats(mine)
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
            reward_errors=report.errors.get(name, 0),
            reward_timeouts=report.timeouts.get(name, 0),
            reward_crashes=report.crashes.get(name, 0),
            bad_rows=self.data.stats(name).get("bad_rows", 0),
            weight_version=t.weight_version,
            row_share=round(len(mine) / n_samples, 4) if n_samples else None,
            slot_wait_s=round(t.admitted_at - t.registered_at, 3) if t.admitted_at is not None else None,
            train=st,
            nonfinite_streak=t.nonfinite_streak,
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
        self.tenants.checkpoint_all()

    def close(self) -> None:
        self.metrics.close()
        self.scorer.close()
        self.engine.close()
        self.backend.close()
        if self.launcher is not None:
            self.launcher.stop()


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
        total = cfg.max_global_steps or max((a.max_steps or 0) for a in cfg.adapters) or None
        bar = tqdm(total=total, initial=rt.tenants.global_step, desc="grpo", disable=not cfg.logging.progress)
        # Console lines go through tqdm.write, so they print above the bar instead of through it.
        with logging_redirect_tqdm(), bar:
            while not rt.finished():
                res = rt.step()
                means = [r.reward_mean for r in res.records if r.reward_mean is not None]
                bar.set_postfix(reward=f"{statistics.fmean(means):.3f}" if means else "-", refresh=False)
                bar.update(1)
        # Stopped with adapters still running (max_global_steps): their steps since the last periodic save are
        # checkpointed (nothing trained is lost, and the run resumes from here) and evaluated like finished ones.
        rt.checkpoint_all()
        rt.final_evals(run_over=True)
        if cfg.logging.plot:
            png = plot_reward_curves(cfg.run_dir)
            if png:
                log.info("reward curves: %s", png)
    finally:
        rt.close()
    return rt


def summarize(run_dir: str | Path, window: int = 5) -> dict[str, dict[str, float | None]]:
    """Per adapter: first-`window` vs last-`window` mean training reward, and the held-out reward of the base and of
    the last evaluated adapter (None without eval)."""
    from rl_multilora.metrics import read_metrics

    by: dict[str, list[tuple[int, float]]] = {}
    evals: dict[str, list[dict]] = {}
    for r in read_metrics(run_dir):
        if r.get("kind") == "eval":
            evals.setdefault(r["adapter"], []).append(r)
        elif r.get("reward_mean") is not None:
            by.setdefault(r["adapter"], []).append((r["step"], r["reward_mean"]))
    out: dict[str, dict[str, float | None]] = {}
    for name, pts in by.items():
        pts.sort()
        vals = [v for _, v in pts]
        first = statistics.fmean(vals[:window])
        last = statistics.fmean(vals[-window:])
        mine = evals.get(name, [])
        base = [r["eval/reward_mean"] for r in mine if r.get("eval/base")]
        held = sorted((r["adapter_step"], r["step"], r["eval/reward_mean"]) for r in mine if not r.get("eval/base"))
        out[name] = {
            "first": first,
            "last": last,
            "gain": last - first,
            "steps": len(vals),
            "eval_base": base[-1] if base else None,
            "eval_final": held[-1][2] if held else None,
            "eval_final_step": held[-1][0] if held else None,
        }
    return out
