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
import json
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
from rl_multilora.evaluate import EvalJob, EvalResult, EvalSet, run_evals
from rl_multilora.metrics import MetricsLogger, StepRecord, console_line, eval_line, plot_reward_curves
from rl_multilora.shares import fair_quotas
from rl_multilora.tenants import TenantManager, TenantState
from rl_multilora.weight_sync import SyncStats, WeightSync
from rollout.types import Sample, SampleStatus, SamplingParams

log = logging.getLogger("rl_multilora")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_engine(cfg: RunConfig, backend, tokenizer, placement=None):
    """The rollout engine the config names; all three speak the same RolloutEngine interface (several engines:
    a `MultiEngine` over them). `backend.model` (the multi-LoRA model in this process) is touched only by the
    engines that need it, so trainer ranks with engine actors or a server never load an unsharded copy here.
    `placement(i)`: Ray actor options that colocate engine i with a trainer rank."""
    r = cfg.rollout
    if r.engine == "embedded":
        from rollout.engines.embedded import EmbeddedEngine

        if r.engine_actors:
            return _one_or_many(_ray_engines(cfg, placement)), None
        model = backend.model
        engines = [EmbeddedEngine(model, tokenizer, max_batch_size=r.max_batch_size) for _ in range(r.num_engines)]
        return _one_or_many(engines), None
    from rollout.sglang.client import SGLangEngine
    from rollout.sglang.launcher import SGLangLauncher
    from rollout.sglang.protocol import sglang_expert_shapes

    if r.engine == "http":
        urls = r.urls if r.num_engines > 1 else [r.url]
        return _one_or_many([SGLangEngine(u, api_key=r.api_key, tensor_format="safetensors") for u in urls]), None
    # A model whose expert LoRA SGLang cannot serve exactly fails here, before a minutes-long server start.
    model = backend.model
    expert_shapes = sglang_expert_shapes(model)
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
            expert_lora=bool(expert_shapes),
        )
        url = launcher.start()
    # SGLang wants one serialized copy of the tensors per tensor-parallel rank: take the size from the launch
    # arguments, or ask an attached server.
    tp_size = launcher.tp_size if launcher is not None else None
    engine = SGLangEngine(
        url, api_key=r.api_key, tensor_format="sglang", module_shapes=model.layer_shapes, expert_shapes=expert_shapes
    )
    engine.tp_size = tp_size or engine.server_tp_size() or 1
    return engine, launcher


def _ray_engines(cfg: RunConfig, placement=None) -> list:
    """`rollout.num_engines` embedded engines as Ray actors, each loading the base from `model.path` (a GPU each
    when CUDA is available, or half of trainer rank i's with `placement`). Joins the Ray cluster this process is in,
    or starts a local one."""
    import ray

    from rollout.engines.ray_engine import RayEngine

    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, configure_logging=False, log_to_driver=False)
    m = cfg.model
    kwargs = dict(
        max_loras=m.max_loras, max_rank=m.max_rank, target_modules=m.target_modules,
        target_parameters=m.target_parameters or [], expert_lora=m.expert_lora,
        max_batch_size=cfg.rollout.max_batch_size, dtype=m.dtype,
    )  # fmt: skip
    if placement is not None:
        return [RayEngine(m.path, kwargs, **placement(i)) for i in range(cfg.rollout.num_engines)]
    gpus = 1 if torch.cuda.is_available() and m.device != "cpu" else 0
    return [RayEngine(m.path, kwargs, num_gpus=gpus) for _ in range(cfg.rollout.num_engines)]


def _one_or_many(engines: list):
    if len(engines) == 1:
        return engines[0]
    from rollout.engines.multi import MultiEngine

    return MultiEngine(engines)


def rollout_sampling(cfg: RunConfig, tokenizer) -> SamplingParams:
    """The rollouts' sampling settings (the eval's too, with temperature 0 for its greedy answers)."""
    r = cfg.rollout
    return SamplingParams(
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop=list(r.stop),
        stop_token_ids=[tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [],
    )


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
        if cfg.trainer.world_size > 1:
            from rl_multilora.backends.ray_fsdp import RayFSDPBackend

            backend = RayFSDPBackend(cfg, pad_token_id=pad)
        else:
            backend = LocalBackend.from_config(cfg, pad_token_id=pad)
        placement = backend.engine_placement if cfg.trainer.colocate_engines else None
        engine, launcher = build_engine(cfg, backend, tokenizer, placement)
        generator = GenerateState(engine, tokenizer, load_hooks(cfg.rollout.hooks), rollout_sampling(cfg, tokenizer))
        scorer = rewards.RewardExecutor(num_workers=cfg.rewards.num_workers, fail_steps=cfg.rewards.fail_steps)
        data = MultiLoRADataSource(tokenizer)
        return cls(cfg, backend, tokenizer, engine, launcher, data, generator, scorer)

    # -- tenants --------------------------------------------------------------------------------------------------
    def _resume_ckpt(self) -> CheckpointManager | None:
        return self.ckpt if self.cfg.checkpoint.resume != "never" else None

    def register(self, a: AdapterConfig):
        """Validate an adapter (reward resolves, dataset has usable rows, targets exist, its checkpoint fits) and add
        it as PENDING."""
        problems = validate.adapter_problems(
            a,
            self.backend.lora_modules,
            self.cfg.eval_for(a),
            ckpt=self._resume_ckpt(),
            lora_parameters=self.backend.lora_parameters,
        )
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
            quotas = fair_quotas(
                {n: self.data.ask(n) for n in names},
                {n: tenants.get(n).cfg.weight for n in names},
                self.cfg.rollout.max_rows_per_step,
            )
            groups = [g for gs in self.data.next_groups(names, quotas).values() for g in gs]
            samples = self.generator.run_sync(groups) if groups else []
        with clock("eval_s"):  # on the versions the rollout used, never trained on
            res.evals = run_evals(self.engine, self.scorer, self._due_evals())
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
            rec.bytes_gathered = res.sync.bytes_gathered
            rec.adapters_pushed = len(res.sync.adapters_pushed)
            rec.timings = dict(res.timings)
            self.metrics.log(rec)
            log.info(console_line(rec))
        self._log_evals(res.step, res.evals)
        # Last: a step counts as done only once its metrics rows are written (resume redoes unfinished steps).
        tenants.save_run_state()
        return res

    # -- held-out evaluation ---------------------------------------------------------------------------------------
    def eval_set(self, a: AdapterConfig) -> EvalSet | None:
        """Adapter `a`'s held-out prompts (built once), or None when its eval is off."""
        settings = self.cfg.eval_for(a)
        if not settings.enabled:
            return None
        cached = self._eval_sets.get(a.name)
        if cached is None or cached[0] != a:  # a name submitted again may come with another dataset
            self._eval_sets[a.name] = (a, EvalSet(a, settings, self.tokenizer, self.generator.sampling))
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
            else:
                continue
            t.last_eval_step = t.adapter_step
        return jobs

    def _log_evals(self, step: int, results: list[EvalResult]) -> None:
        for r in results:
            row = r.to_row(step)
            self.metrics.log_row(row)
            log.info(eval_line(row))

    def final_evals(self) -> list[EvalResult]:
        """Evaluate every adapter that finished its budget on its final checkpoint (its weights after the last step,
        which no rollout used), in batches of as many as the engine has slots."""
        from safetensors.torch import load_file

        from rl_multilora.lora import CONFIG_NAME, WEIGHTS_NAME
        from rl_multilora.metrics import read_metrics

        done = {
            (r["adapter"], r["adapter_step"])
            for r in read_metrics(self.run_dir)
            if r.get("kind") == "eval" and not r.get("eval/base")
        }  # a finished run dir run again evaluates nothing twice
        todo = [
            t
            for t in self.tenants.in_state(TenantState.DRAINED, TenantState.REMOVED)
            if t.last_checkpoint
            and t.last_eval_step != t.adapter_step
            and (t.name, t.adapter_step) not in done
            and self.eval_set(t.cfg) is not None
        ]
        results: list[EvalResult] = []
        width = self.cfg.model.max_loras
        for start in range(0, len(todo), width):
            chunk = todo[start : start + width]
            for t in chunk:
                ck = Path(t.last_checkpoint)
                config = json.loads((ck / CONFIG_NAME).read_text())
                self.engine.load_adapter(t.name, load_file(str(ck / WEIGHTS_NAME)), config, version=t.adapter_step)
            try:
                jobs = [EvalJob(self.eval_set(t.cfg), t.name, t.adapter_step) for t in chunk]
                results += run_evals(self.engine, self.scorer, jobs)
            finally:
                for t in chunk:
                    self.engine.unload_adapter(t.name)
            for t in chunk:
                t.last_eval_step = t.adapter_step
        self._log_evals(self.tenants.global_step, results)
        return results

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
            reward_crashes=report.crashes.get(name, 0),
            bad_rows=self.data.stats(name).get("bad_rows", 0),
            weight_version=t.weight_version,
            row_share=round(len(mine) / len(samples), 4) if samples else None,
            slot_wait_s=round(t.admitted_at - t.registered_at, 3) if t.admitted_at is not None else None,
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
    def start(self, checked: bool = False) -> None:
        """Register the config's adapters, resume run state if any, admit, and push the initial weights.

        `checked`: the caller already ran `validate.check_run(cfg)` (as `run` does), so the adapters' I/O checks
        (datasets, rewards, checkpoints) are not repeated here.
        """
        if not checked:
            problems = [
                p
                for a in self.cfg.adapters
                for p in validate.adapter_problems(
                    a,
                    self.backend.lora_modules,
                    self.cfg.eval_for(a),
                    ckpt=self._resume_ckpt(),
                    lora_parameters=self.backend.lora_parameters,
                )
            ]
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
        rt.final_evals()
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
