"""The GRPO driver: one step is draw prompts -> generate -> score -> train -> log -> retire/admit -> sync.

`Runtime.build` wires the components once; `Runtime.step` is the page a reader learns the system from. Single-run
mode loops until every adapter is done; service mode (`rl_multilora.service`) calls `step` forever and admits/retires
adapters between steps through the same tenant manager.

Who owns what: every fact about an adapter is its `Tenant`'s (`rl_multilora.tenants`), and `TenantManager` fans each
transition out to the training backend (`rl_multilora.backends`: slot + optimizer), the data source (cursor),
checkpoints and, at the next sync, the engine. The loop talks to the backend only through its interface.

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
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rl_multilora import validate
from rl_multilora.backends.base import AdapterStepStats, TrainingBackend
from rl_multilora.checkpoint import CheckpointManager
from rl_multilora.config import AdapterConfig, ConfigError, RunConfig, dump_config
from rl_multilora.metrics import MetricsLogger, StepRecord, console_line, plot_reward_curves
from rl_multilora.tenants import TenantManager, TenantState
from rl_multilora.weight_sync import SyncStats, WeightSync
from rollout.types import Sample, SampleStatus, SamplingParams

log = logging.getLogger("rl_multilora")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_engine(cfg: RunConfig, model, tokenizer):
    """The rollout engine the config names; all three speak the same RolloutEngine interface."""
    r = cfg.rollout
    if r.engine == "embedded":
        from rollout.engines.embedded import EmbeddedEngine

        return EmbeddedEngine(model, tokenizer, max_batch_size=r.max_batch_size), None
    from rollout.engines.sglang import SGLangEngine
    from rollout.engines.sglang_launcher import SGLangLauncher

    if r.engine == "http":
        return SGLangEngine(r.url, api_key=r.api_key, tensor_format="safetensors"), None
    launcher = None
    url = r.url
    if url is None:  # launch a colocated SGLang server on this host
        launcher = SGLangLauncher(
            model_path=cfg.model.path,
            port=r.sglang_port,
            # SGLang counts base-model rows as one of the batch's adapters.
            max_loras_per_batch=cfg.model.max_loras + 1,
            max_lora_rank=cfg.model.max_rank,
            lora_target_modules=cfg.model.target_modules,
            lora_backend=r.sglang_lora_backend,
            extra_args=r.sglang_args,
            api_key=r.api_key,
        )
        url = launcher.start()
    # SGLang wants one serialized copy of the tensors per tensor-parallel rank: take the size from the launch
    # arguments, or ask an attached server.
    tp_size = launcher.tp_size if launcher is not None else None
    engine = SGLangEngine(url, api_key=r.api_key, tensor_format="sglang", module_shapes=model.layer_shapes)
    engine.tp_size = tp_size or engine.server_tp_size() or 1
    return engine, launcher


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
        self._stop_requested = False

    @property
    def data(self):
        return self.tenants.data

    # -- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def build(cls, cfg: RunConfig) -> Runtime:
        from transformers import AutoTokenizer

        import rewards
        from rl_multilora.backends.local import LocalBackend
        from rollout.data_source import MultiLoRADataSource
        from rollout.generate_state import GenerateState, load_hooks

        seed_everything(cfg.seed)
        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        backend = LocalBackend.from_config(cfg, pad_token_id=pad)
        engine, launcher = build_engine(cfg, backend.model, tokenizer)
        r = cfg.rollout
        stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        sampling = SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop=list(r.stop),
            stop_token_ids=stop_ids,
        )
        generator = GenerateState(engine, tokenizer, load_hooks(r.hooks), sampling)
        scorer = rewards.RewardExecutor(num_workers=cfg.rewards.num_workers, fail_steps=cfg.rewards.fail_steps)
        data = MultiLoRADataSource(tokenizer)
        return cls(cfg, backend, tokenizer, engine, launcher, data, generator, scorer)

    # -- tenants --------------------------------------------------------------------------------------------------
    def register(self, a: AdapterConfig):
        """Validate an adapter (reward resolves, dataset has usable rows, targets exist) and add it as PENDING."""
        problems = validate.adapter_problems(a, self.backend.lora_modules)
        if problems:
            raise ConfigError(problems)
        return self.tenants.register(a)

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
            groups = [g for gs in self.data.next_groups(names).values() for g in gs]
            samples = self.generator.run_sync(groups) if groups else []
        with clock("reward_s"):
            report = self.scorer.score_samples(samples)
        with clock("train_s"):
            stats = self.backend.train_step(samples, tenants.current_versions(), tenants.step_limits())
        for name in names:
            tenants.record_trained(name, stats.get(name))
        res.records = [self._record(res.step, name, samples, stats.get(name), report) for name in names]
        with clock("checkpoint_s"):
            self._handle_faults(report, stats)
            tenants.retire_finished()
            tenants.admit_pending()
            self._save_due_checkpoints(names, stats)
        with clock("sync_s"):
            res.sync = self.sync_now()
        tenants.global_step += 1
        for rec in res.records:
            rec.pause_s = res.sync.pause_s
            rec.bytes_pushed = res.sync.bytes_pushed
            rec.adapters_pushed = len(res.sync.adapters_pushed)
            rec.timings = dict(res.timings)
            self.metrics.log(rec)
            log.info(console_line(rec))
        # Last: a step counts as done only once its metrics rows are written (resume redoes unfinished steps).
        tenants.save_run_state()
        return res

    def sync_now(self) -> SyncStats:
        return self.weight_sync.sync(push=self.tenants.to_push(), unload=self.tenants.to_unload())

    def _record(self, step: int, name: str, samples: list[Sample], st: AdapterStepStats | None, report) -> StepRecord:
        """One adapter's metrics record for this step (its counters were advanced by `record_trained`)."""
        t = self.tenants.get(name)
        mine = [s for s in samples if s.adapter is not None and s.adapter.name == name]
        rewards_ = [s.reward for s in mine if s.reward is not None]
        try:
            reward_mean = statistics.fmean(rewards_) if rewards_ else None
            reward_std = statistics.pstdev(rewards_) if len(rewards_) > 1 else 0.0
        except OverflowError:  # finite rewards whose sum overflows: the trainer skips that step; log them as null
            reward_mean = reward_std = None
        t.last_reward = reward_mean
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
            bad_rows=self.data.stats(name).get("bad_rows", 0),
            weight_version=t.weight_version,
            train=st,
            nonfinite_streak=t.nonfinite_streak,
        )

    def _handle_faults(self, report, stats: dict[str, AdapterStepStats]) -> None:
        tenants = self.tenants
        for name, reason in report.failing.items():
            if name in tenants.tenants and tenants.get(name).state == TenantState.RUNNING:
                tenants.fail(name, f"reward failing: {reason}")
        faults = self.cfg.faults
        for name, st in stats.items():
            if st.error is not None and tenants.get(name).state == TenantState.RUNNING:
                tenants.fail(name, f"malformed sample: {st.error}")
        for t in tenants.running():
            if t.nonfinite_streak >= faults.max_nonfinite_steps:
                tenants.fail(t.name, f"non-finite loss/gradients for {t.nonfinite_streak} consecutive steps")
            elif t.idle_steps >= faults.max_idle_steps:
                tenants.fail(
                    t.name,
                    f"no optimizer step for {t.idle_steps} consecutive steps (faults.max_idle_steps): every group "
                    "had uniform rewards or every sample failed, so it had nothing to learn from",
                )

    def _save_due_checkpoints(self, names: list[str], stats: dict[str, AdapterStepStats]) -> None:
        every = self.cfg.checkpoint.save_every
        for name in names:
            t = self.tenants.get(name)
            st = stats.get(name)
            if t.state == TenantState.RUNNING and st is not None and st.stepped and t.adapter_step % every == 0:
                self.tenants.save_checkpoint(t)

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Register the config's adapters, resume run state if any, admit, and push the initial weights."""
        problems = [p for a in self.cfg.adapters for p in validate.adapter_problems(a, self.backend.lora_modules)]
        if problems:
            raise ConfigError(problems)
        self.tenants.restore_run_state()
        # A tenant fails after this many all-failing reward steps: the stricter of the two settings that say so.
        self.scorer.fail_steps = min(self.cfg.rewards.fail_steps, self.cfg.faults.max_reward_fail_steps)
        for a in self.cfg.adapters:
            if a.name not in self.tenants.tenants:
                self.tenants.register(a)
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


def run(cfg: RunConfig, source: str | None = None) -> Runtime:
    """Single-run mode: train until every adapter is done, then write the reward curves."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    validate.check_run(cfg, source)  # everything --dry-run checks, before anything is loaded or written
    rt = Runtime.build(cfg)
    try:
        rt.start()
        total = cfg.max_global_steps or max((a.max_steps or 0) for a in cfg.adapters) or None
        bar = tqdm(total=total, initial=rt.tenants.global_step, desc="grpo", disable=not cfg.logging.progress)
        # Console lines go through tqdm.write, so they print above the bar instead of through it.
        with logging_redirect_tqdm(), bar:
            while not rt.finished():
                res = rt.step()
                means = [r.reward_mean for r in res.records if r.reward_mean is not None]
                bar.set_postfix(reward=f"{statistics.fmean(means):.3f}" if means else "-", refresh=False)
                bar.update(1)
        if cfg.logging.plot:
            png = plot_reward_curves(cfg.run_dir)
            if png:
                log.info("reward curves: %s", png)
    finally:
        rt.close()
    return rt


def summarize(run_dir: str | Path, window: int = 5) -> dict[str, dict[str, float]]:
    """First-`window` vs last-`window` mean reward per adapter (the acceptance numbers)."""
    from rl_multilora.metrics import read_metrics

    by: dict[str, list[tuple[int, float]]] = {}
    for r in read_metrics(run_dir):
        if r.get("reward_mean") is not None:
            by.setdefault(r["adapter"], []).append((r["step"], r["reward_mean"]))
    out = {}
    for name, pts in by.items():
        pts.sort()
        vals = [v for _, v in pts]
        first = statistics.fmean(vals[:window])
        last = statistics.fmean(vals[-window:])
        out[name] = {"first": first, "last": last, "gain": last - first, "steps": len(vals)}
    return out
