"""The GRPO driver: one step is draw prompts -> generate -> score -> train -> log -> retire/admit -> sync.

`Runtime` wires the components once (`Runtime.build`); `Runtime.step` is the page a reader learns the system from.
Single-run mode loops until every adapter is done; service mode (`rl_multilora.service`) calls `step` forever and
admits/retires adapters between steps through the same controller methods.

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

from rl_multilora.checkpoint import CheckpointManager
from rl_multilora.config import AdapterConfig, RunConfig, dump_config
from rl_multilora.controller import AdapterRecord, AdapterState, MultiLoRAController
from rl_multilora.metrics import MetricsLogger, console_line, plot_reward_curves
from rl_multilora.weight_sync import SyncStats, WeightSync
from rollout.types import AdapterRef, Sample, SampleStatus, SamplingParams

log = logging.getLogger("rl_multilora")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_engine(cfg: RunConfig, model, tokenizer):
    """The rollout engine the config names; all three speak the same RolloutEngine interface."""
    r = cfg.rollout
    if r.engine == "embedded":
        from rollout.engines.embedded import EmbeddedEngine

        return EmbeddedEngine(model, tokenizer, max_batch_size=r.max_batch_size), None
    from rollout.engines.sglang import SGLangEngine, SGLangLauncher

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


def optim_config(a: AdapterConfig):
    from rl_multilora.trainer import OptimConfig

    o = a.optim
    return OptimConfig(
        lr=a.lr,
        weight_decay=o.weight_decay,
        betas=tuple(o.betas),
        schedule=o.schedule,
        warmup_steps=o.warmup_steps,
        total_steps=a.max_steps,
        min_lr_ratio=o.min_lr_ratio,
        max_grad_norm=o.max_grad_norm,
    )


def grpo_config(cfg: RunConfig):
    from rl_multilora.trainer import GRPOConfig

    g = cfg.grpo
    return GRPOConfig(
        eps_clip=g.eps_clip,
        eps_clip_high=g.eps_clip_high,
        kl_coef=g.kl_coef,
        kl_type="k3" if g.kl_type == "low_var_kl" else g.kl_type,
        entropy_coef=g.entropy_coef,
        loss_agg=g.loss_agg,
        normalize_std=g.normalize_std,
        drop_uniform_groups=g.drop_uniform_groups,
        micro_batch_size=g.micro_batch_size,
        # The trainer scales logits like the sampler did, so its log-probs match the rollout's (greedy: none).
        temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
    )


def dataset_spec(a: AdapterConfig):
    from rollout.data_source import DatasetSpec

    return DatasetSpec(**a.dataset.model_dump())


def validate_adapter_resources(a: AdapterConfig) -> list[str]:
    """I/O checks run at registration: the reward resolves and the dataset loads. Returns problems, not raises."""
    import rewards
    from rollout.data_source import load_dataset_rows

    problems = []
    try:
        rewards.validate(a.reward.to_spec())
    except Exception as e:  # noqa: BLE001 - any failure here is a user config problem, reported as such
        problems.append(f"adapters.{a.name}.reward: {e}")
    try:
        load_dataset_rows(dataset_spec(a))
    except Exception as e:  # noqa: BLE001
        problems.append(f"adapters.{a.name}.dataset: {e}")
    return problems


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
    records: list[dict] = field(default_factory=list)
    sync: SyncStats | None = None
    timings: dict[str, float] = field(default_factory=dict)


class Runtime:
    """All components of a run, built once. See the module docstring for the step order."""

    def __init__(self, cfg: RunConfig, model, tokenizer, engine, launcher, data, generator, scorer, trainer):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.model = model
        self.tokenizer = tokenizer
        self.engine = engine
        self.launcher = launcher
        self.data = data
        self.generator = generator
        self.scorer = scorer
        self.trainer = trainer
        self.controller = MultiLoRAController(cfg.model.max_loras)
        self.sync_ = WeightSync(engine, model)
        self.ckpt = CheckpointManager(self.run_dir, keep_last=cfg.checkpoint.keep_last)
        self.metrics = MetricsLogger(self.run_dir, cfg.logging.wandb, cfg.model_dump(mode="json"))
        self._pending_push: list[str] = []
        self._pending_unload: list[str] = []
        self._stop_requested = False

    # -- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def build(cls, cfg: RunConfig) -> Runtime:
        from transformers import AutoTokenizer

        import rewards
        from rl_multilora.lora import MultiLoRAModel
        from rl_multilora.trainer import MultiLoRATrainer
        from rollout.data_source import MultiLoRADataSource
        from rollout.generate_state import GenerateState, load_hooks

        seed_everything(cfg.seed)
        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        device = resolve_device(cfg.model.device)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        model = MultiLoRAModel.from_pretrained(
            cfg.model.path,
            max_loras=cfg.model.max_loras,
            max_rank=cfg.model.max_rank,
            target_modules=cfg.model.target_modules,
            dtype=getattr(torch, cfg.model.dtype),
        ).to(device)
        engine, launcher = build_engine(cfg, model, tokenizer)
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
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        trainer = MultiLoRATrainer(model, grpo_config(cfg), pad_token_id=pad)
        data = MultiLoRADataSource(tokenizer)
        return cls(cfg, model, tokenizer, engine, launcher, data, generator, scorer, trainer)

    # -- tenants --------------------------------------------------------------------------------------------------
    def register(self, a: AdapterConfig) -> AdapterRecord:
        """Validate an adapter (dataset loads, reward resolves) and add it as PENDING."""
        from rl_multilora.config import ConfigError

        problems = validate_adapter_resources(a)
        if problems:
            raise ConfigError(problems)
        return self.controller.register(a)

    def admit_pending(self) -> list[str]:
        """PENDING -> RUNNING for as many as there are free slots, oldest first; returns the admitted names."""
        admitted = []
        for rec in self.controller.pending_in_order():
            free = self.controller.free_slots()
            if not free:
                break
            self._start_adapter(rec)
            admitted.append(rec.name)
        return admitted

    def _start_adapter(self, rec: AdapterRecord) -> None:
        a = rec.cfg
        slot = self.model.add_adapter(a.name, rank=a.rank, alpha=a.alpha, seed=a.seed, target_modules=a.target_modules)
        self.controller.activate(a.name, slot)
        self.trainer.add_adapter(a.name, optim_config(a))
        n = a.n_samples_per_prompt or self.cfg.rollout.n_samples_per_prompt
        self.data.add_adapter(
            AdapterRef(a.name, slot),
            dataset_spec(a),
            a.reward.to_spec(),
            seed=a.seed,
            prompts_per_step=a.prompts_per_step,
            n_samples_per_prompt=n,
            max_epochs=a.epochs,
        )
        restored = self.ckpt.restore_adapter(a.name, self) if self.cfg.checkpoint.resume != "never" else None
        if restored is not None:
            log.info(
                "adapter %s resumed from %s (adapter step %d; %d later metrics rows dropped)",
                a.name,
                restored.path,
                rec.adapter_step,
                restored.metrics_dropped,
            )
            if self.controller.budget_done(a.name, self.data.exhausted(a.name)):
                # Killed after its final checkpoint but before the run state recorded DRAINED: training it would
                # take a step past its budget. It leaves at once, never pushed; its checkpoint is already final.
                self.controller.drain(a.name, "budget reached")
                self._release(rec)
                self.controller.mark_drained(a.name)
                return
            if restored.weight_version is not None:
                # Versions continue from the checkpoint (the push below makes it +1), as in an uninterrupted run.
                self.sync_.versions[a.name] = restored.weight_version
        self._pending_push.append(a.name)

    def remove(self, name: str, reason: str = "removed by request") -> None:
        """Drain an adapter: no new prompts; it is checkpointed and unloaded at the end of the step."""
        self.controller.drain(name, reason)

    def _release(self, rec: AdapterRecord) -> None:
        """Free everything a leaving adapter holds: slot, optimizer, data cursor; unload at the next sync."""
        self.model.remove_adapter(rec.name)
        self.trainer.remove_adapter(rec.name)
        self.data.remove_adapter(rec.name)
        self._pending_unload.append(rec.name)

    def retire_finished(self) -> None:
        """Budgets and drains: checkpoint and free every adapter that is done (DRAINING -> DRAINED)."""
        for rec in self.controller.running():
            if self.controller.budget_done(rec.name, self.data.exhausted(rec.name)):
                self.controller.drain(rec.name, "budget reached")
        for rec in self.controller.in_state(AdapterState.DRAINING):
            rec.last_checkpoint = str(self.ckpt.save_adapter(rec.name, self))
            self._release(rec)
            self.controller.mark_drained(rec.name)

    def fail(self, name: str, reason: str) -> None:
        """FAILED: keep its last good weights in a final checkpoint, free its slot; the others go on."""
        rec = self.controller.get(name)
        log.warning("adapter %s FAILED: %s", name, reason)
        if rec.slot is not None:
            # The trainer never applies a non-finite step, so the slot still holds the last good weights.
            rec.last_checkpoint = str(self.ckpt.save_adapter(name, self, note=f"FAILED: {reason}"))
            self._release(rec)
        self.controller.fail(name, reason)

    # -- one step -------------------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        step = self.controller.global_step
        res = StepResult(step=step)
        clock = _Clock(res.timings)
        names = [r.name for r in self.controller.running()]
        with clock("rollout_s"):
            groups = [g for gs in self.data.next_groups(names).values() for g in gs]
            samples = self.generator.run_sync(groups) if groups else []
        with clock("reward_s"):
            report = self.scorer.score_samples(samples)
        with clock("train_s"):
            stats = self.trainer.train_step(samples, current_versions=dict(self.sync_.versions))
        res.records = [self._account(step, name, samples, stats.get(name), report) for name in names]
        with clock("checkpoint_s"):
            self._handle_faults(report)
            self.retire_finished()
            self.admit_pending()
            self._save_due_checkpoints(names, stats)
        with clock("sync_s"):
            res.sync = self.sync_now()
        self.controller.global_step += 1
        for rec in res.records:
            rec.update(
                pause_s=res.sync.pause_s,
                bytes_pushed=res.sync.bytes_pushed,
                adapters_pushed=len(res.sync.adapters_pushed),
                **{k: round(v, 4) for k, v in res.timings.items()},
            )
            self.metrics.log(rec)
            log.info(console_line(rec))
        # Last: a step counts as done only once its metrics rows are written (resume redoes unfinished steps).
        self.ckpt.save_run_state(self)
        return res

    def sync_now(self) -> SyncStats:
        push, unload = self._pending_push, self._pending_unload
        self._pending_push, self._pending_unload = [], []
        return self.sync_.sync(push=push, unload=unload)

    def _account(self, step: int, name: str, samples: list[Sample], st, report) -> dict:
        """Per-adapter bookkeeping for one step: step counter, rewards, and the metrics record."""
        rec = self.controller.get(name)
        mine = [s for s in samples if s.adapter is not None and s.adapter.name == name]
        rewards_ = [s.reward for s in mine if s.reward is not None]
        if st is not None and st.stepped:
            self.controller.mark_trained(name)
            self._pending_push.append(name)
        try:
            reward_mean = statistics.fmean(rewards_) if rewards_ else None
            reward_std = statistics.pstdev(rewards_) if len(rewards_) > 1 else 0.0
        except OverflowError:  # finite rewards whose sum overflows: the trainer skips that step; log them as null
            reward_mean = reward_std = None
        rec.last_reward = reward_mean
        out = {
            "step": step,
            "adapter": name,
            "adapter_step": rec.adapter_step,
            "reward_mean": reward_mean,
            "reward_std": reward_std,
            "response_len_mean": statistics.fmean(len(s.response_ids) for s in mine) if mine else None,
            "n_samples": len(mine),
            "truncated_frac": (sum(s.status == SampleStatus.TRUNCATED for s in mine) / len(mine)) if mine else None,
            "failed_samples": sum(s.status in (SampleStatus.FAILED, SampleStatus.ABORTED) for s in mine),
            "reward_errors": report.errors.get(name, 0),
            "reward_timeouts": report.timeouts.get(name, 0),
            "bad_rows": self.data.stats(name).get("bad_rows", 0),
            "weight_version": self.sync_.versions.get(name),
        }
        if st is not None:
            out.update(
                loss=st.loss,
                pg_loss=st.pg_loss,
                kl=st.kl,
                entropy=st.entropy,
                grad_norm=st.grad_norm,
                lr=st.lr,
                clip_frac=st.clip_frac,
                logprob_gap=st.logprob_gap,
                dropped_groups=st.dropped_groups,
                skipped_nonfinite=bool(st.skipped_nonfinite),
                stepped=bool(st.stepped),
                stale_samples=getattr(st, "stale", 0),
            )
            rec.nonfinite_streak = rec.nonfinite_streak + 1 if st.skipped_nonfinite else 0
            out["nonfinite_streak"] = rec.nonfinite_streak
        return out

    def _handle_faults(self, report) -> None:
        for name, reason in report.failing.items():
            if self.controller.records.get(name) and self.controller.get(name).state == AdapterState.RUNNING:
                self.fail(name, f"reward failing: {reason}")
        limit = self.cfg.faults.max_nonfinite_steps
        for rec in self.controller.running():
            if rec.nonfinite_streak >= limit:
                self.fail(rec.name, f"non-finite loss/gradients for {rec.nonfinite_streak} consecutive steps")

    def _save_due_checkpoints(self, names: list[str], stats: dict) -> None:
        every = self.cfg.checkpoint.save_every
        for name in names:
            rec = self.controller.records[name]
            st = stats.get(name)
            if rec.state == AdapterState.RUNNING and st is not None and st.stepped and rec.adapter_step % every == 0:
                rec.last_checkpoint = str(self.ckpt.save_adapter(name, self))

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Register the config's adapters, resume run state if any, admit, and push the initial weights."""
        from rl_multilora.config import ConfigError

        problems = []
        for a in self.cfg.adapters:
            problems += validate_adapter_resources(a)
        if problems:
            raise ConfigError(problems)
        self.ckpt.restore_run_state(self)
        # A tenant fails after this many all-failing reward steps: the stricter of the two settings that say so.
        self.scorer.fail_steps = min(self.cfg.rewards.fail_steps, self.cfg.faults.max_reward_fail_steps)
        for a in self.cfg.adapters:
            if a.name not in self.controller.records:
                self.controller.register(a)
        self.admit_pending()
        self.sync_now()
        self.ckpt.save_run_state(self)  # admission may have retired resumed adapters at their budget: record it

    def finished(self) -> bool:
        if self._stop_requested or self.controller.all_done():
            return True
        m = self.cfg.max_global_steps
        return m is not None and self.controller.global_step >= m

    def checkpoint_all(self) -> None:
        for rec in self.controller.in_state(AdapterState.RUNNING, AdapterState.DRAINING):
            rec.last_checkpoint = str(self.ckpt.save_adapter(rec.name, self, in_step=False))
        self.ckpt.save_run_state(self)

    def close(self) -> None:
        self.metrics.close()
        self.scorer.close()
        self.engine.close()
        if self.launcher is not None:
            self.launcher.stop()


def run(cfg: RunConfig) -> Runtime:
    """Single-run mode: train until every adapter is done, then write the reward curves."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    rt = Runtime.build(cfg)
    try:
        rt.start()
        total = cfg.max_global_steps or max((a.max_steps or 0) for a in cfg.adapters) or None
        bar = tqdm(total=total, initial=rt.controller.global_step, desc="grpo", disable=not cfg.logging.progress)
        # Console lines go through tqdm.write, so they print above the bar instead of through it.
        with logging_redirect_tqdm(), bar:
            while not rt.finished():
                res = rt.step()
                means = [r["reward_mean"] for r in res.records if r["reward_mean"] is not None]
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
