"""Held-out evaluation per tenant: the same reward as training, on prompts of a split it never trains on.

Design choices:
- Each tenant's eval prompts are fixed for the run: the first `n_prompts` of its eval split in the order its seed
  gives (the data source's own order and prompt building, chat template included), so every evaluation of a tenant,
  the base's included, scores the same prompts.
- Greedy answers give `eval/reward_mean`; with `k > 0`, k samples per prompt at the rollout temperature (seeded per
  prompt and sample) give `eval/pass@k` (share of prompts with a sample whose reward >= `pass_threshold`) and
  `eval/sample_reward_mean`. An answer that failed (its episode's environment raised, its reward was never scored)
  counts 0 in all three, so failures cannot raise a score; `eval/errors` says how many there were.
- All due evaluations of a step (every tenant's, base rows included) go to the engine as one batch, right after the
  step's rollout and on the same adapter versions; they are never trained on, and they are not mixed into the
  rollout's own batches, so turning eval on cannot change a training sample (a test checks the adapters end
  bit-identical).
- Eval samples are scored by the tenants' own reward specs under the key `eval:<adapter>`, so their errors never
  count toward the tenant's reward-failure limit.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rl_multilora.checkpoint import AdapterWeights
from rl_multilora.config import AdapterConfig, EvalSettings
from rollout.generate_state import GenerateState, GenerateStateHooks
from rollout.types import AdapterRef, Sample, SampleStatus, SamplingParams

EVAL_PREFIX = "eval:"


@dataclass
class EvalResult:
    """One evaluation of one adapter (or of the base, for that adapter's prompts)."""

    adapter: str
    adapter_step: int
    base: bool
    n_prompts: int
    reward_mean: float | None  # greedy
    k: int
    pass_at_k: float | None
    sample_reward_mean: float | None
    errors: int

    def to_row(self, step: int) -> dict[str, Any]:
        """The metrics.jsonl row (`kind: eval`; `reward_mean` is the held-out greedy reward)."""
        row = {
            "step": step,
            "adapter": self.adapter,
            "adapter_step": self.adapter_step,
            "kind": "eval",
            "reward_mean": self.reward_mean,
            "eval/reward_mean": self.reward_mean,
            "eval/base": self.base,
            "eval/n_prompts": self.n_prompts,
            "eval/errors": self.errors,
        }
        if self.k:
            row[f"eval/pass@{self.k}"] = self.pass_at_k
            row["eval/sample_reward_mean"] = self.sample_reward_mean
        return row


class EvalSet:
    """One tenant's held-out prompts and how to evaluate on them."""

    def __init__(
        self,
        a: AdapterConfig,
        settings: EvalSettings,
        tokenizer,
        rollout_sampling: SamplingParams,
        context_len: int | None = None,
    ):
        from rollout.data_source import MultiLoRADataSource, eval_split

        self.name = a.name
        self.reward = a.reward
        self.settings = settings
        self.seed = a.seed
        self.sampling = rollout_sampling
        spec = eval_split(a.dataset, settings.split, settings.data_files)
        from rl_multilora.components import tenant_sampling

        source = MultiLoRADataSource(tokenizer, context_len)
        source.add_adapter(
            AdapterRef(a.name, 0),
            spec,
            a.reward,
            seed=a.seed,
            prompts_per_step=settings.n_prompts,
            n_samples_per_prompt=1,
            max_epochs=1.0,
            sampling=tenant_sampling(rollout_sampling, a),  # the tenant's own (its episodes' stop strings, lengths)
            environment=a.environment,
        )
        self.prompts = [g[0] for g in source.next_groups([a.name])[a.name]]
        self.tokenizer = tokenizer

    def samples(self, engine_adapter: str | None) -> list[Sample]:
        """Fresh samples to generate; `engine_adapter` None = the base model. Each carries what its request asks for
        (`EvalGeneration.request_params`): `eval_kind` greedy (temperature 0) or sample<j> with its own seed."""
        out = []
        ref = AdapterRef(EVAL_PREFIX + self.name, 0)
        for i, p in enumerate(self.prompts):
            draws: list[tuple[str, int | None]] = [("greedy", None)] if self.settings.greedy else []
            for j in range(self.settings.k):
                seed = int(np.random.SeedSequence([self.seed, 7919, i, j]).generate_state(1)[0] & 0x7FFFFFFF)
                draws.append((f"sample{j}", seed))
            for kind, seed in draws:
                meta = {**p.metadata, "eval_kind": kind, "engine_adapter": engine_adapter}
                meta.pop("sampling_seed", None)
                if seed is not None:
                    meta["sampling_seed"] = seed
                out.append(
                    Sample(
                        prompt=p.prompt,
                        prompt_ids=list(p.prompt_ids),
                        label=p.label,
                        group_index=i,
                        index=len(out),
                        metadata=meta,
                        adapter=ref,
                        reward_spec=self.reward,
                        sampling=p.sampling,
                        environment=p.environment,
                    )
                )
        return out

    def summarize(self, samples: Sequence[Sample], adapter_step: int, base: bool) -> EvalResult:
        greedy = [float(s.reward or 0.0) for s in samples if s.metadata["eval_kind"] == "greedy"]  # a failure: 0
        drawn = [s for s in samples if s.metadata["eval_kind"] != "greedy"]
        pass_at_k = sample_mean = None
        if self.settings.k:
            by_prompt: dict[int, list[float]] = {}
            for s in drawn:
                by_prompt.setdefault(s.group_index, []).append(float(s.reward or 0.0))
            pass_at_k = statistics.fmean(
                any(r >= self.settings.pass_threshold for r in rs) for rs in by_prompt.values()
            )
            sample_mean = statistics.fmean(r for rs in by_prompt.values() for r in rs)
        return EvalResult(
            adapter=self.name,
            adapter_step=adapter_step,
            base=base,
            n_prompts=len(self.prompts),
            reward_mean=statistics.fmean(greedy) if greedy else None,
            k=self.settings.k,
            pass_at_k=pass_at_k,
            sample_reward_mean=sample_mean,
            # answers that failed, and answers whose reward raised, timed out or crashed (scored failure_value)
            errors=sum(
                s.status in (SampleStatus.FAILED, SampleStatus.ABORTED) or "reward_error" in s.metadata
                for s in samples
            ),
        )


@dataclass
class EvalJob:
    """Evaluate `eval_set` on the engine's adapter `engine_adapter` (None: the base) at `adapter_step`."""

    eval_set: EvalSet
    engine_adapter: str | None
    adapter_step: int

    @property
    def base(self) -> bool:
        return self.engine_adapter is None


class EvalGeneration(GenerateState):
    """The rollout path (`GenerateState`: request building, aborts, finish reasons, decoding) for eval samples,
    whose request names the engine adapter under evaluation (None: the base) and, for greedy answers,
    temperature 0."""

    def request_params(self, sample: Sample) -> tuple[str | None, SamplingParams]:
        _, sampling = super().request_params(sample)
        if sample.metadata["eval_kind"] == "greedy":
            sampling = dataclasses.replace(sampling, temperature=0.0, seed=None)
        return sample.metadata["engine_adapter"], sampling


def run_evals(
    generator: GenerateState, scorer, jobs: Sequence[EvalJob], max_wave_tokens: int | None = None
) -> list[EvalResult]:
    """Every job's prompts in one engine batch, scored with each tenant's reward; one result per job.
    `generator`: the run's rollout driver (its engine, tokenizer and sampling settings). `max_wave_tokens`: the
    engine's wave bound while the evals run (`eval.max_wave_tokens`; None: the engine's own)."""
    if not jobs:
        return []
    per_job = [job.eval_set.samples(job.engine_adapter) for job in jobs]
    flat = [s for samples in per_job for s in samples]
    # Single-turn samples in one group: every request reaches the engine in one call, never mixed into a rollout's
    # batches; episodes (tenants with an environment) in a group of their own, all run concurrently.
    plain = [s for s in flat if s.environment is None]
    episodes = [s for s in flat if s.environment is not None]
    gen = EvalGeneration(generator.engine, generator.tokenizer, GenerateStateHooks(), generator.sampling)
    with generator.engine.waves_within(max_wave_tokens):
        gen.run_sync([g for g in (plain, episodes) if g])
    scorer.score_samples(flat)
    return [
        job.eval_set.summarize(samples, job.adapter_step, job.base) for job, samples in zip(jobs, per_job, strict=True)
    ]


def evaluate_adapters(
    generator: GenerateState,
    scorer,
    jobs: Sequence[EvalJob],
    weights: dict[str, AdapterWeights],
    width: int,
    max_wave_tokens: int | None = None,
) -> list[EvalResult]:
    """Evaluate adapters that are not in the engine: load each job's `weights[job.engine_adapter]`, at most `width`
    at a time (the engine's slots), run their jobs (`run_evals`), unload them."""
    results: list[EvalResult] = []
    for start in range(0, len(jobs), width):
        chunk = jobs[start : start + width]
        for job in chunk:
            w = weights[job.engine_adapter]
            generator.engine.load_adapter(job.engine_adapter, w.tensors, w.peft_config, version=job.adapter_step)
        try:
            results += run_evals(generator, scorer, chunk, max_wave_tokens)
        finally:
            for job in chunk:
                generator.engine.unload_adapter(job.engine_adapter)
    return results


def _other_base(ckpt, model_path: str) -> str | None:
    """Why the run's checkpoints may not be evaluated on `model_path`: the run state records the base they were
    trained on, and a model folder replaced or re-pointed since (another config, other weight shapes) would score
    them on a base they never saw, where `run` refuses to resume. None when it is the same base or nothing says."""
    from rl_multilora.checkpoint import RunStateError, base_identity, base_mismatch
    from rl_multilora.errors import bad_value

    try:
        state = ckpt.read_run_state()
    except RunStateError:
        return None  # damaged: the checkpoints themselves are still readable, and `run` says what is wrong
    if state is None or base_mismatch(state, base_identity(model_path), model_path) is None:
        return None
    return bad_value(
        "model.path",
        model_path,
        f"the base this run dir's adapters were trained on, {state['base'].get('path')!r} (the model there now has "
        "another config or other weight shapes): evaluating them on it would score another model",
    )


def checkpointed_adapters(ckpt, skip: set[str] = frozenset()) -> dict[str, AdapterConfig]:
    """name -> adapter config, for each adapter of the run dir with a complete checkpoint whose `checkpoint.json`
    holds the config it was trained with (a GRPO tenant's does; a Tinker client's has none), except the names in
    `skip`."""
    from pydantic import ValidationError

    root = ckpt.run_dir / "adapters"
    found = {}
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if folder.name in skip or not folder.is_dir() or (newest := ckpt.latest_meta(folder.name)) is None:
            continue
        config = newest[1].get("config")
        try:
            a = AdapterConfig.model_validate(config) if isinstance(config, dict) else None
        except ValidationError:  # a config of an older version of this project: not evaluated unless it is listed
            a = None
        if a is not None and a.name == folder.name:
            found[folder.name] = a
    return found


def evaluate_checkpoints(
    run_dir: str,
    adapters: Sequence[str] | None = None,
    step: int | None = None,
    split: str | None = None,
    n: int | None = None,
    peft: str | None = None,
) -> list[dict[str, Any]]:
    """`rl-multilora eval`: the base and saved checkpoints of a run dir (or a PEFT folder for one adapter) on each
    adapter's held-out prompts; one dict per adapter with base and adapter results.

    The run's own config (RUN_DIR/config.yaml) says the model (built as the run built it: dtype, targets, expert
    LoRA), datasets, rewards and eval settings; `split` and `n` override the eval split and the number of prompts.
    Eval is on here whatever the run's `eval.enabled` was.
    """
    from pathlib import Path

    from rl_multilora import components
    from rl_multilora.checkpoint import CheckpointManager
    from rl_multilora.config import ConfigError, load_run_config
    from rl_multilora.errors import bad_value
    from rl_multilora.lora import CONFIG_NAME, AdapterFolderError
    from rl_multilora.validate import Admission, adapter_problems

    root = Path(run_dir)
    if not (root / "config.yaml").is_file():
        raise ConfigError([bad_value("RUN_DIR", run_dir, "a run directory (it holds config.yaml)")])
    cfg = load_run_config(root / "config.yaml")
    listed = {a.name: a for a in cfg.adapters}
    # A service's config.yaml lists no adapters (they were submitted), nor a run's once one was taken out of it:
    # those are known by the config their newest checkpoint was trained with, evaluated when named (--adapter), or
    # by default where the config lists none (a service's run dir).
    needed = not listed or any(x not in listed for x in adapters or [])  # each checkpoint's JSON read only then
    known = listed | (checkpointed_adapters(CheckpointManager(root), skip=set(listed)) if needed else {})
    names = list(dict.fromkeys(adapters)) if adapters else list(listed or known)  # named twice: evaluated once
    problems = [
        bad_value("--adapter", x, f"an adapter of this run ({', '.join(known) or 'none'})")
        for x in names
        if x not in known
    ]
    if peft is not None and len(names) != 1:
        problems.append(bad_value("--peft", peft, "a PEFT folder together with exactly one --adapter NAME"))
    if peft is not None and not (Path(peft) / CONFIG_NAME).is_file():
        problems.append(bad_value("--peft", peft, f"a PEFT folder (it holds {CONFIG_NAME})"))
    if peft is not None and step is not None:
        problems.append(bad_value("--step", step, "none with --peft (the folder is the weights evaluated)"))
    if problems:
        raise ConfigError(problems)
    peft_weights = None
    if peft is not None:  # checked against the run's model before the model is loaded
        try:
            peft_weights = components.read_adapter_folder(cfg.model, peft)
        except (AdapterFolderError, FileNotFoundError) as e:
            raise ConfigError([f"--peft: {e}"]) from None
    ckpt = CheckpointManager(root)
    if peft is None and (mismatch := _other_base(ckpt, cfg.model.path)) is not None:
        raise ConfigError([mismatch])
    weights: dict[str, AdapterWeights] = {}
    for name in names:
        if peft_weights is not None:
            weights[name] = AdapterWeights(Path(peft), *peft_weights, adapter_step=0)
            continue
        try:
            found = ckpt.read_weights(name, step)
        except (AdapterFolderError, FileNotFoundError) as e:
            problems.append(f"--adapter {name}: its checkpoint is damaged: {e}")
            continue
        if found is None:
            which = f"at adapter step {step}" if step is not None else "at any step"
            problems.append(
                bad_value("--adapter", name, f"an adapter with a complete checkpoint {which} in {run_dir}")
            )
            continue
        weights[name] = found
    settings = {}
    for name in names:
        update = {"enabled": True, **({"split": split} if split else {}), **({"n_prompts": n} if n else {})}
        settings[name] = cfg.eval_for(known[name]).model_copy(update=update)
        problems += adapter_problems(known[name], Admission(eval_settings=settings[name]))
    if problems:
        raise ConfigError(problems)

    engine, tokenizer = components.build_embedded_engine(
        cfg.model, cfg.rollout.max_batch_size, max_wave_tokens=cfg.eval.max_wave_tokens or cfg.rollout.max_wave_tokens
    )
    generator = GenerateState(
        engine,
        tokenizer,
        GenerateStateHooks(),
        components.build_sampling(cfg, tokenizer),
        context_length=components.context_length(cfg.model),
    )
    scorer = components.build_scorer(cfg)
    out = []
    try:
        context = components.context_length(cfg.model)
        sets = {name: EvalSet(known[name], settings[name], tokenizer, generator.sampling, context) for name in names}
        base = {r.adapter: r for r in run_evals(generator, scorer, [EvalJob(sets[x], None, 0) for x in names])}
        jobs = [EvalJob(sets[x], x, weights[x].adapter_step) for x in names]
        for r in evaluate_adapters(generator, scorer, jobs, weights, cfg.model.max_loras):
            out.append(
                {
                    "adapter": r.adapter,
                    "checkpoint": str(weights[r.adapter].path),
                    "adapter_step": None if peft is not None else weights[r.adapter].adapter_step,
                    "split": settings[r.adapter].split,
                    "base": dataclasses.asdict(base[r.adapter]),
                    "adapter_result": dataclasses.asdict(r),
                }
            )
    finally:
        scorer.close()
        engine.close()
    return out


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The `rl-multilora eval` table: base vs adapter held-out reward per adapter (`failed`: answers that failed, base /
    adapter, each counted 0)."""
    head = f"{'adapter':<14} {'step':>5} {'split':<6} {'prompts':>7} {'base':>6} {'adapter':>8} {'gain':>7}"
    lines = [f"{head}  {'failed':>9}  pass@k"]
    for row in rows:
        b, a = row["base"], row["adapter_result"]
        gain = a["reward_mean"] - b["reward_mean"] if None not in (a["reward_mean"], b["reward_mean"]) else None

        def f(v, fmt="{:.3f}"):
            return "-" if v is None else fmt.format(v)

        passk = f"{f(b['pass_at_k'])} -> {f(a['pass_at_k'])} (k={a['k']})" if a["k"] else "-"
        lines.append(
            f"{row['adapter']:<14} {f(row['adapter_step'], '{}'):>5} {row['split']:<6} {a['n_prompts']:>7} "
            f"{f(b['reward_mean']):>6} {f(a['reward_mean']):>8} {f(gain, '{:+.3f}'):>7}  "
            f"{str(b['errors']) + ' / ' + str(a['errors']):>9}  {passk}"
        )
    return "\n".join(lines)
