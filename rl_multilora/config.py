"""Run and adapter configuration: pydantic models loaded from YAML, with `key=value` overrides.

Design choices:
- Every field has a help string (`Field(description=...)`, or an attribute docstring in `DatasetSpec` and
  `RewardSpec`); `RunConfig.model_json_schema()` collects them.
- One type per concept: the trainer takes `GRPOSettings` and each adapter's `OptimSettings` as they are, the data
  source takes `DatasetSpec` and the rewards take `RewardSpec`. The last two are the `rollout` package's dataclasses
  (they travel with samples and to reward workers); pydantic validates them here as fields, so there is no
  translator to drift.
- Validation reports every problem at once: first the structural errors pydantic finds (types, ranges, unknown
  keys), then the cross-field checks (rank <= max_rank, unique names, ...). Each line names the field path, the
  value and what is allowed. `ConfigError` carries the list; the CLI prints it and exits 2 without a traceback.
- Checks that need the outside world (does the dataset load, does the reward resolve) run when an adapter is
  registered as a tenant (`rl_multilora.validate`), so a service rejects a bad submission the same way
  a run rejects a bad config.
- Unknown keys are errors (`extra="forbid"`): a typo such as `learning_rate:` must not be silently ignored.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from rl_multilora.errors import bad_value
from rl_multilora.lora.peft_io import validate_adapter_name
from rollout.data_source import DatasetSpec
from rollout.types import EnvironmentSpec, RewardSpec


class ConfigError(ValueError):
    """One or more configuration problems, each a line `field=value is not allowed; allowed: what` (errors.py)."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{len(problems)} configuration problem(s){where}:\n{lines}")


SEED_MAX = 2**32 - 1  # numpy's and the data order's seeds; torch takes more, but a run seeds all three from it


def _top_k(value: int | None) -> int | None:
    """-1 or 0 mean off (vLLM's and HF's spellings; SGLang's is -1, what the engines get); else at least 1."""
    if value is None:
        return None
    if value < -1:
        raise ValueError(bad_value("top_k", value, "-1 or 0 (off), or an integer >= 1"))
    return -1 if value == 0 else value


def _stop_strings(value: list[str] | None) -> list[str] | None:
    if value is not None and any(not isinstance(x, str) or not x for x in value):
        raise ValueError(bad_value("stop", value, "a list of non-empty strings (an empty one would stop at once)"))
    return value


class _Strict(BaseModel):
    # Finite numbers only (`lr: .inf` would train a tenant that never produces a token), and no YAML booleans where
    # a number is meant (`rank: true` would silently become 1).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool):
            annotation = cls.model_fields[info.field_name].annotation
            if bool not in (get_args(annotation) or (annotation,)) and annotation is not Any:
                kind = getattr(annotation, "__name__", str(annotation))
                raise ValueError(f"a value of type {kind}, not true/false")
        return value


class ModelConfig(_Strict):
    """The shared frozen base and its pre-allocated LoRA slots."""

    path: str = Field(description="Base model: a local folder (e.g. artifacts/tiny/model) or a Hub id.")
    max_loras: int = Field(
        4, ge=1, le=256, description="Adapter slots pre-allocated on the base (max concurrent tenants)."
    )
    max_rank: int = Field(
        16, ge=1, le=1024, description="Largest LoRA rank a slot can hold; smaller ranks are zero-padded."
    )
    target_modules: str | list[str] = Field(
        "all-linear",
        description='"all-linear" (every linear layer but lm_head) or a list of module names; "lm_head" in the list '
        "puts a LoRA on the output head (local backend and embedded engine only).",
    )
    target_parameters: list[str] | None = Field(
        None,
        description="MoE: packed expert Parameters that get LoRA too, named as PEFT's target_parameters "
        '(e.g. ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]); null = none.',
    )
    expert_lora: Literal["per_expert", "shared_a"] = Field(
        "per_expert",
        description="Expert LoRA layout: an A and a B per expert, or one A per slot shared by all experts (ModelOpt).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Dtype of the frozen base.")
    lora_autocast: bool = Field(
        False,
        description="With a bfloat16 / float16 base: the trainer's LoRA products run in the base's dtype, the float32 "
        "slots cast to it per forward, as torch.autocast runs PEFT's LoRA under TRL's `bf16: true`; the slots, their "
        "gradients and AdamW stay float32. Fewer passes over activations on a GPU (docs/benchmarks.md, 'GPU check'). "
        "false: activations cast to float32 and base + delta summed in it, PEFT's default (autocast_adapter_dtype). "
        "Engines keep float32 LoRA. Local backend (trainer.world_size 1).",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Training forwards keep only each decoder layer's input and recompute the layer in the backward "
        "(its LoRA routing replayed): the activations of a micro-batch shrink to about one layer's, for about a "
        "third more training compute. Local backend (trainer.world_size 1).",
    )
    malloc_mmap_threshold_kb: int | None = Field(
        None,
        ge=0,
        le=32768,
        description="glibc (Linux) only: host allocations of at least this many KiB (tensors, on CPU) get their own "
        "mapping, returned to the OS when freed. null: glibc's own threshold, which it raises up to 32 MiB as large "
        "blocks are freed, so tensors come from its heap, whose holes can hold the resident size of a CPU training "
        "step at 2-3x its live bytes (docs/benchmarks.md, 'Memory of a run'); a fixed one keeps it near the live "
        "bytes, for system CPU time in page faults. Process-wide: set when the run is built.",
    )
    host_allocator: Literal["glibc", "jemalloc"] = Field(
        "glibc",
        description="The host malloc (tensors, on CPU) of `rl-multilora run`'s process and of `rl-multilora "
        "serve`'s service actor. glibc: the C library's. jemalloc (from Ray's wheel: the jemalloc extra, `pip "
        "install -e '.[jemalloc]'`; or the file RL_MULTILORA_JEMALLOC names; Linux only): `run` starts itself again "
        "with it preloaded, `serve` starts its actor with it, and both start trainer ranks (trainer.world_size > 1) "
        "and engine actors (rollout.engine_actors) with it (Ray's runtime_env; the serve banner and the ranks' and "
        "engines' log lines name the allocator). "
        "It reuses freed tensor memory by size class instead of leaving glibc's heap holes, and purges it between a "
        "step's phases. The same numbers, bit for bit; on the SmolLM2 example (2 CPU cores) the peak fell from "
        "1,602-1,662 to 1,394-1,398 MiB for 1.05x the wall time (docs/benchmarks.md, 'jemalloc'). Child processes "
        "(reward workers, Ray itself, engine servers) keep their own malloc; a Python caller of loop.run "
        "must preload it itself.",
    )
    device: str = Field("auto", description='"auto" (cuda if available, else cpu), "cpu" or "cuda[:N]".')
    max_tenants: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="Tenants (GRPO and Tinker clients) that may be live at once. More than max_loras turns on "
        "paging: max_loras slots stay resident and every other tenant's true-rank adapter and Adam state waits in a "
        "host store, paged into a slot (least recently used evicted) when it is scheduled or called; engines page "
        "their banks the same way. null: max_loras (no paging). Local backend and embedded engine only.",
    )
    host_budget_gb: float | None = Field(
        None,
        gt=0,
        description="Paging: host memory for the paged-out tenants' states; past it the least recently paged-out "
        "spill to disk (spill_dir). null: no limit. An idle tenant takes 3x its true-rank adapter bytes "
        "(weights + two Adam moments).",
    )
    spill_dir: str | None = Field(
        None, description="Paging: where tenants past host_budget_gb are written (null: run_dir/paged)."
    )

    @model_validator(mode="after")
    def _one_allocator_knob(self) -> ModelConfig:
        if self.host_allocator == "jemalloc" and self.malloc_mmap_threshold_kb is not None:
            raise ValueError(
                bad_value(
                    "model.malloc_mmap_threshold_kb",
                    self.malloc_mmap_threshold_kb,
                    "null with model.host_allocator: jemalloc (the threshold is glibc's)",
                )
            )
        return self

    @property
    def paging(self) -> bool:
        """More tenants than slots: a host tenant store pages adapters and optimizer states between them."""
        return self.max_tenants is not None and self.max_tenants > self.max_loras


class OptimSettings(_Strict):
    """One adapter's AdamW and learning-rate schedule (the peak lr and the step budget are the adapter's fields)."""

    schedule: Literal["constant", "cosine"] = Field(
        "constant", description="LR schedule: constant or warmup + cosine (cosine needs the adapter's max_steps)."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps (optimizer steps): step k uses (k+1)/warmup.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine floor as a fraction of lr.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        (0.9, 0.999), description="AdamW (beta1, beta2), each in [0, 1)."
    )
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Clip this adapter's own grad norm to this value (null = no clipping)."
    )


class EvalSettings(_Strict):
    """Held-out evaluation of a tenant: the same reward as training, on prompts it never trains on."""

    enabled: bool = Field(
        False, description="Evaluate: the base (adapter off) first, every `every` steps, at the end."
    )
    split: str = Field("test", description="Split of the adapter's dataset to evaluate on (e.g. data_files' 'test').")
    data_files: str | list[str] | dict[str, Any] | None = Field(
        None, description="Files to evaluate on instead of the dataset's own data_files (the split still applies)."
    )
    n_prompts: int = Field(64, ge=1, description="Held-out prompts per evaluation (the first n of the split's order).")
    every: int | None = Field(
        None, ge=1, description="Also evaluate every N adapter steps (null: only the base and the final adapter)."
    )
    greedy: bool = Field(True, description="One greedy answer per prompt: eval/reward_mean.")
    k: int = Field(0, ge=0, description="k samples per prompt at rollout temperature: eval/pass@k (0 = off).")
    pass_threshold: float = Field(1.0, description="A sample passes when its reward is >= this (pass@k).")
    max_wave_tokens: int | None = Field(
        None,
        ge=1,
        description="Run-level (an adapter's eval section cannot change it). Embedded engine: the evals' own "
        "rollout.max_wave_tokens while they run, tighter than the rollout's so that a rollout still runs in one wave "
        "while an eval's many distinct prompts, each with its own KV, decode fewer at a time: less memory for more "
        "decode steps. null: the rollout's bound. The same outputs either way.",
    )


class EvalOverride(_Strict):
    """An adapter's changes to the run-level `eval` section (unset fields keep the run's value)."""

    enabled: bool | None = None
    split: str | None = None
    data_files: str | list[str] | dict[str, Any] | None = None
    n_prompts: int | None = Field(None, ge=1)
    every: int | None = Field(None, ge=1)
    greedy: bool | None = None
    k: int | None = Field(None, ge=0)
    pass_threshold: float | None = None

    def apply(self, base: EvalSettings) -> EvalSettings:
        return base.model_copy(update=self.model_dump(exclude_none=True))


class SamplingOverride(_Strict):
    """A tenant's own sampling settings; each field left out is the run's (`rollout.*`)."""

    temperature: float | None = Field(None, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling.")
    top_k: int | None = Field(None, description="Top-k sampling (-1 or 0 = off).")
    min_p: float | None = Field(None, ge=0, le=1, description="Drop tokens below min_p times the top probability.")
    max_new_tokens: int | None = Field(None, ge=1, description="Response length limit (per model turn).")
    stop: list[str] | None = Field(None, description="Stop strings (e.g. '</tool_call>' for tool-calling tenants).")

    _check_top_k = field_validator("top_k")(_top_k)
    _check_stop = field_validator("stop")(_stop_strings)


class TISSettings(_Strict):
    """Truncated importance sampling: weight each token's loss by min(pi_trainer_old / pi_engine, cap)."""

    mode: Literal["token", "sequence"] = Field("token", description="Per-token weights, or one per sequence.")
    cap: float = Field(2.0, gt=0, description="Upper bound of the importance weight (C in Yao et al. 2025).")


class AdapterConfig(_Strict):
    name: str = Field(description="Unique adapter name, [A-Za-z0-9._-]+, 1 to 128 characters; used as a folder name.")
    rank: int = Field(8, ge=1, description="LoRA rank r (<= model.max_rank).")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; scaling is alpha / r (as PEFT and SGLang).")
    target_modules: str | list[str] | None = Field(
        None, description="Modules this adapter trains; must equal the model's targets or be a subset. None = model's."
    )
    target_parameters: list[str] | None = Field(
        None,
        description="Expert Parameters this adapter trains: a subset of model.target_parameters. None = the model's.",
    )
    dataset: DatasetSpec = Field(description="The adapter's own dataset (fields: rollout.data_source.DatasetSpec).")
    reward: RewardSpec | None = Field(
        None, description="The adapter's own reward function (fields: rollout.types.RewardSpec); or an environment."
    )
    environment: EnvironmentSpec | None = Field(
        None,
        description="Multi-turn episodes (tools, observations) instead of or with a reward "
        "(fields: rollout.types.EnvironmentSpec).",
    )
    sampling: SamplingOverride | None = Field(None, description="The adapter's own sampling settings.")
    loss: Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo"] | None = Field(
        None,
        description="The adapter's own policy loss, with the advantage normalization and aggregation it is defined "
        "with (docs/guides/losses.md); None = the run's grpo section as it is.",
    )
    kl_coef: float | None = Field(None, ge=0, description="The adapter's own KL coefficient (None = grpo.kl_coef).")
    eps_clip: float | None = Field(None, ge=0, lt=1, description="Its own low clip (None = grpo.eps_clip).")
    eps_clip_high: float | None = Field(None, ge=0, description="Its own high clip (None = grpo.eps_clip_high).")
    tis: TISSettings | None = Field(None, description="Correct the engine-vs-trainer mismatch (off when None).")
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="rollout.mode async: weight versions its samples may lag behind its current one (0: strictly "
        "on-policy, its rollouts wait for its training); None = rollout.max_staleness.",
    )
    lr: float = Field(1e-4, gt=0, description="Peak learning rate of the adapter's AdamW.")
    optim: OptimSettings = Field(default_factory=OptimSettings, description="Schedule, decay, clipping.")
    prompts_per_step: int = Field(4, ge=1, description="Prompts drawn from this adapter's dataset per step.")
    n_samples_per_prompt: int | None = Field(
        None, ge=2, description="Group size override (default: rollout's); GRPO compares a group's samples, so >= 2."
    )
    max_steps: int | None = Field(
        None, ge=1, description="Budget in optimizer steps (grpo.ppo_epochs per step); the adapter drains at it."
    )
    epochs: float | None = Field(None, gt=0, description="Data budget in epochs; the adapter drains when used up.")
    seed: int = Field(
        0,
        ge=0,
        le=SEED_MAX,
        description="Seeds the adapter's init, data order and sampling (isolation: only its own).",
    )
    weight: float = Field(
        1.0,
        gt=0,
        description="Fair-share weight when a step's rows are capped, and of turns when more tenants run than a step "
        "holds (rollout.max_tenants_per_step, paging).",
    )
    priority: int = Field(0, description="Waiting adapters with a higher priority get a free slot first.")
    eval: EvalOverride | None = Field(None, description="Changes to the run-level eval section for this adapter.")

    @field_validator("reward")
    @classmethod
    def _one_reward(cls, reward: RewardSpec | None) -> RewardSpec | None:
        if reward is not None and (reward.name is None) == (reward.path is None):
            raise ValueError(
                bad_value("name/path", (reward.name, reward.path), "exactly one of name (a built-in) or path")
            )
        return reward

    @model_validator(mode="after")
    def _reward_or_environment(self) -> AdapterConfig:
        if self.reward is None and self.environment is None:
            raise ValueError(bad_value("reward", None, "a reward, an environment, or both"))
        return self

    @model_validator(mode="after")
    def _reasoning_gym_reward_needs_its_rows(self) -> AdapterConfig:
        # The reward scores with the task stored in each row's metadata; rows of any other source have none.
        if self.reward is not None and self.reward.name == "reasoning_gym" and self.dataset.source != "reasoning_gym":
            raise ValueError(
                bad_value(
                    "reward.name",
                    "reasoning_gym",
                    "reasoning_gym only with dataset.source: reasoning_gym (it scores with the task each such row "
                    f"carries; this adapter's rows are {self.dataset.describe()}): another reward, or reasoning-gym's "
                    "rows (docs/guides/reasoning-gym.md)",
                )
            )
        return self

    @model_validator(mode="after")
    def _library_rows_and_episodes_together(self) -> AdapterConfig:
        # A verifiers environment or a textarena game plays the episode its row names; the rows are its own prompts.
        from rollout import textarena_env, verifiers_env

        for source, path in (
            ("verifiers", verifiers_env.ENVIRONMENT_PATH),
            ("textarena", textarena_env.ENVIRONMENT_PATH),
        ):
            rows = self.dataset.source == source
            episodes = self.environment is not None and self.environment.path == path
            if rows and not episodes:
                where = None if self.environment is None else self.environment.path
                raise ValueError(bad_value("environment.path", where, f"{path} with dataset.source: {source}"))
            if episodes and not rows:  # named by what the user wrote: the environment (the source may be a default)
                raise ValueError(
                    bad_value(
                        "environment.path",
                        path,
                        f"{path} only with dataset.source: {source} (it plays the episode each such row names; this "
                        f"adapter's rows are {self.dataset.describe()})",
                    )
                )
        return self

    @model_validator(mode="after")
    def _budget(self) -> AdapterConfig:
        if self.max_steps is None and self.epochs is None:
            raise ValueError(
                bad_value("max_steps", None, "an integer >= 1 when epochs is null too: an adapter needs a budget")
            )
        return self


class RolloutConfig(_Strict):
    """The rollout engine(s), sampling and the sync/async pipeline, shared by every tenant unless it overrides them."""

    engine: Literal["embedded", "sglang", "http"] = Field(
        "embedded",
        description="embedded (in-process torch), sglang (launch/attach a server), http (any server at url).",
    )
    url: str | None = Field(None, description="Server URL for engine http, or sglang to attach instead of launching.")
    num_engines: int = Field(
        1,
        ge=1,
        le=64,
        description="Rollout engines: each step's prompt groups are spread over them (least in flight) and every sync "
        "reaches all. Embedded: engines in this process over the shared base; http: one per URL in `urls`.",
    )
    engine_actors: bool = Field(
        False,
        description="Engine embedded: run each of the num_engines engines as a Ray actor that loads the base from "
        "model.path itself (one GPU each when CUDA is available), instead of in this process.",
    )
    urls: list[str] | None = Field(
        None, description="Engine http with num_engines > 1: one server URL per engine (instead of url)."
    )
    api_key: str | None = Field(None, description="Bearer token for the server's state-changing endpoints.")
    n_samples_per_prompt: int = Field(
        8, ge=2, description="GRPO group size (samples per prompt); a group's advantages compare its samples, so >= 2."
    )
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    top_k: int = Field(-1, description="Top-k sampling (-1 or 0 = off).")
    max_new_tokens: int = Field(64, ge=1, description="Response length limit.")
    stop: list[str] = Field(default_factory=list, description="Stop strings.")

    _check_top_k = field_validator("top_k")(_top_k)
    _check_stop = field_validator("stop")(_stop_strings)
    hooks: str | None = Field(
        None, description="GenerateStateHooks subclass `module:Class` (default: multi-LoRA hooks)."
    )
    max_batch_size: int = Field(256, ge=1, description="Embedded engine: most rows in one decode batch.")
    prefix_cache_mb: int = Field(
        256,
        ge=0,
        description="Embedded engine: MiB of KV kept after requests finish, so a later prompt that starts with the "
        "same tokens under the same adapter weights (an episode's next turn) prefills only its new tokens; least "
        "recently used evicted, an adapter's entries dropped when it is reloaded. 0 = off. A token costs "
        "layers x 2 x kv_heads x head_dim x dtype bytes (46 KiB for SmolLM2-135M in float32).",
    )
    max_wave_tokens: int | None = Field(
        None,
        ge=1,
        description="Embedded engine: most KV token positions one decode wave may come to hold (each row its prompt "
        "and max_new_tokens, a prompt shared by a group's samples once); queued rows wait for room. Bounds the "
        "memory of a batch of many distinct prompts, such as a held-out eval, for decode steps over fewer rows. "
        "A token costs what prefix_cache_mb says. null: rows are bounded by max_batch_size only.",
    )
    mode: Literal["sync", "async"] = Field(
        "sync",
        description="sync: rollout, then training, then one paused weight sync per step (on-policy, exact resume). "
        "async: the next step's rollouts generate while this step trains, and new versions are published without "
        "pausing the engine (where it can); each tenant's samples lag at most its max_staleness versions.",
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="mode async: versions a sample may lag behind its adapter's current one (adapters may set their "
        "own); older samples are dropped and counted as stale. 0 makes every tenant wait for its own training.",
    )
    max_tenants_per_step: int | None = Field(
        None,
        ge=1,
        description="Most RUNNING tenants one step rolls out and trains (at most model.max_loras, the resident "
        "slots); when more are running, each step takes those furthest behind in weighted fair share (adapter "
        "`weight`), so every tenant gets its turn. null: model.max_loras.",
    )
    max_rows_per_step: int | None = Field(
        None,
        ge=1,
        description="Most rows (samples) one step generates; when the tenants ask for more, the step is split by "
        "weighted fair share (adapter `weight`), at least one prompt group per RUNNING tenant. null: no cap.",
    )

    @property
    def logit_temperature(self) -> float:
        """What the trainer divides logits by, so its log-probs are those of the distribution the engine sampled
        from: the sampling temperature, or 1 for greedy rollouts."""
        return self.temperature if self.temperature > 0 else 1.0

    sglang_port: int = Field(30000, ge=1, le=65535, description="Port for a launched SGLang server.")
    sglang_lora_backend: str = Field("triton", description="SGLang --lora-backend.")
    sglang_args: list[str] = Field(default_factory=list, description="Extra sglang.launch_server arguments.")


class GRPOSettings(_Strict):
    """Loss settings shared by all adapters; the trainer takes this section as it is."""

    eps_clip: float = Field(0.2, ge=0, lt=1, description="PPO clip, low side: the ratio is clipped at 1 - eps_clip.")
    eps_clip_high: float = Field(0.28, ge=0, description="PPO clip, high side (DAPO clip-higher).")
    kl_coef: float = Field(0.0, ge=0, description="KL to the base model (adapter switched off); 0 = off.")
    kl_type: Literal["k1", "k3", "low_var_kl"] = Field(
        "k3",
        description="KL estimator: k1 (logp - ref), k3 (Schulman's), low_var_kl (verl's: k3 of a log-ratio clamped to [-20, 20], clamped to [-10, 10]).",
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "token-mean", description="Loss aggregation within each adapter."
    )
    normalize_std: bool = Field(True, description="Divide advantages by the group std (False = Dr. GRPO).")
    drop_uniform_groups: bool = Field(True, description="Drop groups whose rewards are all equal (no signal).")
    micro_batch_size: int = Field(16, ge=1, description="Rows per forward/backward micro-batch.")
    share_prompts: bool = Field(
        True,
        description="Rows of a micro-batch with the same tenant and prompt (a group's samples) train as one packed "
        "sequence: the prompt once, each completion attending to it, so its forward and backward run once per group "
        "instead of once per sample. Same losses and gradients up to float rounding; models with eager or SDPA "
        "attention and no sliding window (others train each row on its own). A group packs only where that is "
        "estimated cheaper: its attention is dense over prompt + every completion, which long completions beside a "
        "short prompt (multi-turn episodes) make dearer than the prompt saved. false: each row padded on its own.",
    )
    ppo_epochs: int = Field(
        1, ge=1, description="Optimizer steps per rollout batch; each counts against the adapter's max_steps."
    )


class RewardsSettings(_Strict):
    """The reward worker pool (each adapter names its own reward function)."""

    num_workers: int = Field(
        2, ge=1, le=256, description="Reward worker processes (killable on timeout), started at once: at most 256."
    )

    @model_validator(mode="before")
    @classmethod
    def _one_setting_per_limit(cls, data: Any) -> Any:
        if isinstance(data, dict) and "fail_steps" in data:
            raise ValueError(
                bad_value(
                    "fail_steps",
                    data["fail_steps"],
                    "no such setting any more: the one limit on consecutive all-failing reward steps is "
                    "faults.max_reward_fail_steps",
                )
            )
        return data


class CheckpointSettings(_Strict):
    """How often each adapter is checkpointed, how many checkpoints it keeps, and whether a run resumes."""

    save_every: int = Field(10, ge=1, description="Checkpoint an adapter every N adapter steps (and when it drains).")
    keep_last: int = Field(
        2,
        ge=1,
        description="Checkpoints kept per adapter (one more while the newest was written in a step that has not "
        "finished: the one a resume would take is never pruned before a newer one counts).",
    )
    resume: Literal["auto", "always", "never"] = Field(
        "auto", description="auto: resume when the run dir has checkpoints; always: require them; never: start fresh."
    )


class FaultSettings(_Strict):
    """Per-tenant fault limits: past one, that tenant FAILS and the others train on."""

    max_nonfinite_steps: int = Field(3, ge=1, description="Consecutive NaN/inf steps before an adapter FAILS.")
    max_reward_fail_steps: int = Field(3, ge=1, description="Consecutive all-failing reward steps before it FAILS.")
    max_idle_steps: int = Field(
        20,
        ge=1,
        description="Consecutive steps without an optimizer step (all groups uniform, all samples failed) before an "
        "adapter FAILS, so a tenant with nothing to learn from cannot keep a run from ending.",
    )


class WandbSettings(_Strict):
    mode: Literal["disabled", "offline", "online"] = Field("disabled", description="wandb logging mode.")
    project: str = Field("rl-multilora", description="wandb project.")
    entity: str | None = Field(None, description="wandb entity.")
    name: str | None = Field(None, description="wandb run name (default: run_dir's name).")


class LoggingSettings(_Strict):
    """Console progress, the reward plot and wandb."""

    wandb: WandbSettings = Field(default_factory=WandbSettings, description="Weights & Biases (off by default).")
    plot: bool = Field(True, description="Write reward_curves.png at the end of the run.")
    progress: bool = Field(True, description="Show a progress bar.")


class TrainerConfig(_Strict):
    """Where the trainable slots live: one process, or ranks on Ray with the base sharded by FSDP2."""

    world_size: int = Field(
        1,
        ge=1,
        le=1024,
        description="Trainer ranks. 1: this process. N > 1: N Ray actors (one GPU each with CUDA, else one CPU), the "
        "base and the LoRA slots sharded over them with FSDP2; needs the ray extra.",
    )
    colocate_engines: bool = Field(
        False,
        description="With world_size > 1 and rollout.engine_actors: place engine i in trainer rank i's placement-group "
        "bundle, on the same node and sharing its GPU (each takes half of the bundle's GPU and CPU), instead of on "
        "resources of its own. Needs rollout.num_engines <= world_size.",
    )


class RunConfig(_Strict):
    def eval_for(self, a: AdapterConfig) -> EvalSettings:
        """The eval settings of adapter `a`: the run's, with the adapter's overrides."""
        return a.eval.apply(self.eval) if a.eval is not None else self.eval

    def max_staleness_for(self, a: AdapterConfig) -> int:
        """Versions adapter `a`'s samples may lag (0 in a synchronous run: every sample is on-policy)."""
        if self.rollout.mode != "async":
            return 0
        return a.max_staleness if a.max_staleness is not None else self.rollout.max_staleness

    run_dir: str = Field("runs/default", description="Where config.yaml, metrics.jsonl and checkpoints go.")
    seed: int = Field(
        0, ge=0, le=SEED_MAX, description="Global seed (base init of slots uses each adapter's own seed)."
    )
    model: ModelConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    grpo: GRPOSettings = Field(default_factory=GRPOSettings)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    rewards: RewardsSettings = Field(default_factory=RewardsSettings)
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    faults: FaultSettings = Field(default_factory=FaultSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    eval: EvalSettings = Field(default_factory=EvalSettings, description="Held-out evaluation (off by default).")
    max_global_steps: int | None = Field(None, ge=1, description="Stop after this many global steps (None = budgets).")
    service_poll_s: float = Field(2.0, gt=0, description="Service mode: idle polling interval.")
    adapters: list[AdapterConfig] = Field(default_factory=list, description="Tenants trained in this run.")


def adapter_keys(adapters: Any) -> list[str]:
    """How messages name each adapter of a config's `adapters:` list: `adapters.<name>`, as `--set`, validation and
    the run's own messages do, where its name is a valid one that no other adapter's equals in letter case;
    `adapters.<index>` where it is not (missing, malformed, or shared)."""
    items = adapters if isinstance(adapters, list) else []
    names = [item.get("name") if isinstance(item, dict) else None for item in items]
    folded = Counter(n.casefold() for n in names if isinstance(n, str))
    keys = []
    for i, name in enumerate(names):
        ok = isinstance(name, str) and folded[name.casefold()] == 1 and not _name_problem(name, "")
        ok = ok and (not name.isdigit() or name == str(i))  # "1" of the first adapter would read as the second's index
        keys.append(f"adapters.{name}" if ok else f"adapters.{i}")
    return keys


def _format_pydantic(err: ValidationError, prefix: str = "", data: Any = None) -> list[str]:
    problems = []
    keys = adapter_keys(data.get("adapters")) if isinstance(data, dict) else []
    for e in err.errors():
        loc_parts = list(e["loc"])
        if (
            len(loc_parts) >= 2
            and loc_parts[0] == "adapters"
            and isinstance(loc_parts[1], int)
            and loc_parts[1] < len(keys)
        ):
            loc_parts[:2] = [keys[loc_parts[1]]]  # the adapter by its name
        loc = ".".join(str(p) for p in loc_parts)
        loc = f"{prefix}{loc}" if loc else prefix.rstrip(".") or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] in ("missing", "missing_argument"):
            problems.append(f"{loc} is missing; allowed: a value (this field is required)")
        elif e["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            problems.append(bad_value(loc, e["input"], "no such key: remove it or check the spelling"))
        elif "is not allowed; allowed:" in msg:  # a validator's message, already in the grammar: say where
            problems.append(f"{loc}: {msg}")
        else:
            problems.append(bad_value(loc, e["input"], _pydantic_allowed(msg)))
    return problems


def _pydantic_allowed(msg: str) -> str:
    """pydantic's 'Input should be greater than 0' -> 'greater than 0'."""
    return msg.removeprefix("Input should be ")


def _name_problem(name: Any, where: str) -> list[str]:
    try:
        validate_adapter_name(name)
    except ValueError as e:
        return [f"{where}name={name!r} is not allowed; allowed: {_allowed_part(e)}"]
    return []


def _allowed_part(e: Exception) -> str:
    """The `allowed: ...` tail of a message in the project's grammar (or the whole message)."""
    text = str(e)
    return text.split("allowed: ", 1)[1] if "allowed: " in text else text


def adapter_problems(a: AdapterConfig, model: ModelConfig, where: str = "") -> list[str]:
    """Cross-field checks of one adapter against the model (no I/O)."""
    p = _name_problem(a.name, where)
    own_temp = a.sampling.temperature if a.sampling is not None else None
    if a.tis is not None and own_temp not in (None, 0.0, 1.0):
        p.append(_tis_temperature_problem(f"{where}tis", own_temp))
    if a.rank > model.max_rank:
        p.append(bad_value(f"{where}rank", a.rank, f"an integer <= model.max_rank ({model.max_rank})"))
    if a.target_modules is not None and a.target_modules != model.target_modules:
        subset = f"a subset of model.target_modules ({model.target_modules!r})"
        if isinstance(a.target_modules, str) or isinstance(model.target_modules, str):
            if model.target_modules != "all-linear":
                p.append(bad_value(f"{where}target_modules", a.target_modules, subset))
        elif not set(a.target_modules) <= set(model.target_modules):
            p.append(bad_value(f"{where}target_modules", a.target_modules, subset))
    if a.target_parameters and not set(a.target_parameters) <= set(model.target_parameters or []):
        allowed = f"a subset of model.target_parameters ({model.target_parameters!r})"
        if not model.target_parameters:
            allowed = "null or [] while model.target_parameters is unset (set it to give the model expert LoRA)"
        p.append(bad_value(f"{where}target_parameters", a.target_parameters, allowed))
    if a.optim.schedule == "cosine" and not (a.max_steps is not None and a.max_steps > a.optim.warmup_steps):
        p.append(
            bad_value(
                f"{where}max_steps",
                a.max_steps,
                f"an integer > optim.warmup_steps ({a.optim.warmup_steps}) with optim.schedule 'cosine', which "
                "decays over max_steps; or optim.schedule 'constant'",
            )
        )
    return p


def _tis_temperature_problem(where: str, temperature: float) -> str:
    # Engines report log-probs at temperature 1 (before any filter) while the trainer's are at the tenant's sampling
    # temperature: their ratio would be the temperature's, not the engine-vs-trainer mismatch TIS corrects.
    return bad_value(
        where,
        "set",
        f"null with a sampling temperature of {temperature} (TIS needs temperature 1, or 0 for greedy, until engines "
        "report log-probs at the sampling temperature)",
    )


def staleness_problems(a: AdapterConfig, rollout: RolloutConfig, where: str = "") -> list[str]:
    """An adapter's own `max_staleness` means something only in an asynchronous run."""
    if a.max_staleness is not None and rollout.mode != "async":
        return [bad_value(f"{where}max_staleness", a.max_staleness, "null unless rollout.mode is 'async'")]
    return []


def paging_problems(cfg: RunConfig) -> list[str]:
    """More tenants than slots runs on the local backend with in-process embedded engines (their banks page too)."""
    m, problems = cfg.model, []
    if m.max_tenants is not None and m.max_tenants < m.max_loras:
        problems.append(bad_value("model.max_tenants", m.max_tenants, f"null or >= model.max_loras ({m.max_loras})"))
    if not m.paging:
        for key in ("host_budget_gb", "spill_dir"):
            if getattr(m, key) is not None:
                problems.append(
                    bad_value(f"model.{key}", getattr(m, key), "null unless model.max_tenants > max_loras")
                )
        return problems
    if cfg.trainer.world_size > 1:
        problems.append(
            bad_value(
                "model.max_tenants",
                m.max_tenants,
                f"null or <= model.max_loras ({m.max_loras}) with trainer.world_size > 1: paging tenants between "
                "slots and host memory is served by the local backend only (trainer.world_size 1)",
            )
        )
    if cfg.rollout.engine != "embedded" or cfg.rollout.engine_actors:
        problems.append(
            bad_value(
                "model.max_tenants",
                m.max_tenants,
                f"null or <= model.max_loras ({m.max_loras}) unless rollout.engine is 'embedded' in this process "
                "(engine_actors false): only the embedded engine pages its adapter bank on demand (an SGLang "
                "adapter loaded from tensors cannot be reloaded after eviction)",
            )
        )
    cap = cfg.rollout.max_tenants_per_step
    if cap is not None and cap > m.max_loras:
        problems.append(
            bad_value("rollout.max_tenants_per_step", cap, f"null or <= model.max_loras ({m.max_loras}) with paging")
        )
    return problems


def unembed_problems(cfg: RunConfig) -> list[str]:
    """A LoRA on the output head (`lm_head` in model.target_modules, what a Tinker client's train_unembed trains) is
    built, exported and checked against PEFT on the local backend with embedded engines only: the FSDP2 ranks and
    SGLang's loader have not been tried with it, so those layouts refuse it instead of guessing."""
    targets = cfg.model.target_modules
    if isinstance(targets, str) or "lm_head" not in targets:
        return []
    allowed = "a list without 'lm_head'"
    problems = []
    if cfg.trainer.world_size > 1:
        problems.append(
            bad_value(
                "model.target_modules",
                targets,
                f"{allowed} with trainer.world_size > 1 (an output-head LoRA runs on the local backend only)",
            )
        )
    if cfg.rollout.engine == "sglang":
        problems.append(
            bad_value(
                "model.target_modules",
                targets,
                f"{allowed} with rollout.engine 'sglang' (an output-head LoRA is served by the embedded engine only)",
            )
        )
    return problems


CASE_REASON = (
    "its checkpoints and exports are folders named after it, and macOS's and Windows' file systems ignore case"
)


def _semantic_problems(cfg: RunConfig) -> list[str]:
    problems = []
    seen: dict[str, tuple[int, str]] = {}  # casefolded name -> (index, the name)
    keys = adapter_keys([{"name": a.name} for a in cfg.adapters])
    for i, a in enumerate(cfg.adapters):
        where = f"{keys[i]}."
        problems += adapter_problems(a, cfg.model, where)
        problems += staleness_problems(a, cfg.rollout, where)
        own_temp = a.sampling.temperature if a.sampling is not None else None
        if a.tis is not None and own_temp is None and cfg.rollout.temperature not in (0.0, 1.0):
            problems.append(_tis_temperature_problem(f"{where}tis", cfg.rollout.temperature))
        j, other = seen.get(a.name.casefold(), (None, None))
        if other == a.name:
            problems.append(bad_value(f"{where}name", a.name, "a name no other adapter of this config has"))
        elif other is not None:
            problems.append(bad_value(f"{where}name", a.name, f"a name that differs from adapters.{j}.name "
                                      f"({other!r}) in more than letter case ({CASE_REASON})"))  # fmt: skip
        seen.setdefault(a.name.casefold(), (i, a.name))
    r = cfg.rollout
    problems += paging_problems(cfg)
    problems += unembed_problems(cfg)
    if cfg.model.lora_autocast and cfg.model.dtype == "float32":
        problems.append(
            bad_value("model.lora_autocast", True, "false with model.dtype float32 (a float32 base computes its LoRA "
                      "in float32 already); set model.dtype: bfloat16 or float16 to use it")
        )  # fmt: skip
    for flag in ("gradient_checkpointing", "lora_autocast"):
        if getattr(cfg.model, flag) and cfg.trainer.world_size > 1:
            problems.append(bad_value(f"model.{flag}", True, "false with trainer.world_size > 1 (local backend only)"))
    if r.engine == "http" and r.num_engines == 1 and not r.url:
        problems.append(
            bad_value("rollout.url", None, "the server URL with engine 'http' (e.g. http://127.0.0.1:30000)")
        )
    if r.engine == "http" and r.num_engines > 1 and len(r.urls or []) != r.num_engines:
        problems.append(
            bad_value("rollout.urls", r.urls, f"{r.num_engines} server URLs (one per engine, rollout.num_engines)")
        )
    if r.urls is not None and (r.engine != "http" or r.num_engines == 1):
        problems.append(bad_value("rollout.urls", r.urls, "null unless engine is 'http' with num_engines > 1"))
    if r.url is not None and r.engine == "embedded":  # read by no one: the run would use the embedded engine anyway
        problems.append(bad_value("rollout.url", r.url, "null unless engine is 'http' or 'sglang'"))
    for field, urls in (("rollout.url", [r.url]), ("rollout.urls", r.urls or [])):
        for u in urls:
            if u is not None and not re.fullmatch(r"https?://[^\s/?#]+(/\S*)?", u):
                problems.append(bad_value(field, u, "an http:// or https:// URL (e.g. http://127.0.0.1:30000)"))
    if r.engine_actors and r.engine != "embedded":
        problems.append(bad_value("rollout.engine_actors", True, "false unless engine is 'embedded'"))
    if cfg.trainer.colocate_engines:
        t = cfg.trainer
        if t.world_size == 1 or not r.engine_actors:
            problems.append(
                bad_value(
                    "trainer.colocate_engines",
                    True,
                    "false unless trainer.world_size > 1 and rollout.engine_actors is true (engines as Ray actors)",
                )
            )
        elif r.num_engines > t.world_size:
            problems.append(
                bad_value(
                    "rollout.num_engines",
                    r.num_engines,
                    f"at most trainer.world_size ({t.world_size}) with trainer.colocate_engines (one engine per rank)",
                )
            )
    if (r.engine != "embedded" or r.engine_actors) and cfg.eval.max_wave_tokens is not None:
        problems.append(
            bad_value(
                "eval.max_wave_tokens",
                cfg.eval.max_wave_tokens,
                "null unless rollout.engine is 'embedded' in this process (not rollout.engine_actors)",
            )
        )
    if r.engine != "embedded" and r.max_wave_tokens is not None:
        problems.append(
            bad_value(
                "rollout.max_wave_tokens",
                r.max_wave_tokens,
                f"null with engine {r.engine!r} (the embedded engine's bound; SGLang bounds its KV pool itself: "
                "--max-total-tokens N in rollout.sglang_args, or on the server behind engine 'http')",
            )
        )
    if r.engine == "sglang" and r.num_engines > 1:
        problems.append(
            bad_value(
                "rollout.num_engines",
                r.num_engines,
                "1 with engine 'sglang' (several SGLang servers: start them yourself and use engine 'http' with "
                "urls, or SGLang's own data parallelism, --dp-size in rollout.sglang_args)",
            )
        )
    return problems


def parse_run_config(data: Any, source: str | None = None) -> RunConfig:
    """Validate a dict (already YAML-loaded) into a RunConfig, raising ConfigError listing every problem."""
    if not isinstance(data, dict):
        raise ConfigError([bad_value("(top level)", type(data).__name__, "a YAML mapping (the run config)")], source)
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as e:
        problems = _format_pydantic(e, data=data)
        # Cross-field checks still run on the adapters that did validate, so one pass reports everything.
        problems += _partial_adapter_problems(data)
        raise ConfigError(problems, source) from None
    problems = _semantic_problems(cfg)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def _partial_adapter_problems(data: dict) -> list[str]:
    """Cross-field checks on raw adapter dicts, so they are reported even when pydantic found other problems."""
    try:
        model = ModelConfig.model_validate(data.get("model", {}))
    except ValidationError:
        return []
    problems = []
    raw_adapters = data.get("adapters") or []
    keys = adapter_keys(raw_adapters)
    for i, raw in enumerate(raw_adapters if isinstance(raw_adapters, list) else []):
        if not isinstance(raw, dict):
            continue
        name, rank = raw.get("name"), raw.get("rank")
        if isinstance(name, str):
            problems += _name_problem(name, f"{keys[i]}.")
        if isinstance(rank, int) and rank > model.max_rank:
            problems.append(bad_value(f"{keys[i]}.rank", rank, f"an integer <= model.max_rank ({model.max_rank})"))
    return problems


def parse_adapter_config(data: Any, model: ModelConfig, source: str | None = None) -> AdapterConfig:
    """Validate one adapter (a service submission) against the running model."""
    if not isinstance(data, dict):
        raise ConfigError([bad_value("(top level)", type(data).__name__, "a YAML mapping (one adapter)")], source)
    if "adapters" in data and "name" not in data:  # a whole run config: its sections would each be an unknown key
        names = (
            [a.get("name") for a in data["adapters"] if isinstance(a, dict)]
            if isinstance(data["adapters"], list)
            else []
        )
        listed = f" (it lists {', '.join(map(repr, names))})" if names else ""
        raise ConfigError(
            [
                "(top level): this is a run config with an `adapters:` list; allowed: one adapter's mapping (name, "
                f"dataset, reward, ...): put each adapter of the list in a file of its own and submit each{listed}"
            ],
            source,
        )
    try:
        a = AdapterConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_pydantic(e), source) from None
    problems = adapter_problems(a, model)
    if problems:
        raise ConfigError(problems, source)
    return a


def _set_path(data: Any, dotted: str, value: Any, original: str) -> None:
    keys = dotted.split(".")
    node = data
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            # adapters.<name>.field addresses an adapter by name, and a name wins over an index: an adapter named
            # "2" is the one `adapters.2` means (it was the third adapter, whatever its name)
            matches = [j for j, item in enumerate(node) if isinstance(item, dict) and str(item.get("name")) == key]
            if matches:
                idx = matches[0]
            elif key.isdigit() and int(key) < len(node):
                idx = int(key)
            else:
                raise ConfigError([f"--set {original}: no list item {key!r} (use an index or an adapter name)"])
            if last:
                node[idx] = value
            else:
                node = node[idx]
        elif isinstance(node, dict):
            if last:
                node[key] = value
            else:
                node = node.setdefault(key, {})
        else:
            raise ConfigError([f"--set {original}: {'.'.join(keys[:i])} is not a mapping or list"])


_COMMENT = re.compile(r"(^|\s)#")  # where YAML starts a comment in a plain (unquoted) scalar


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `key.sub=value` overrides (values parsed as YAML: 1e-3, true, [a, b]). A plain value holding ` #` is
    taken whole as a string: YAML would read the rest as a comment and drop it (`system_prompt=... #### N`, a
    run_dir `runs/my #1`); a quoted or bracketed value is YAML's to read."""
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ConfigError([f"--set {item!r}: expected key=value (e.g. grpo.kl_coef=0.01)"])
        key, raw = item.split("=", 1)
        if raw.strip()[:1] not in ("'", '"', "[", "{") and _COMMENT.search(raw):
            value = raw.strip()
        else:
            try:
                value = yaml.load(raw, Loader=_UniqueKeyLoader)
            except yaml.YAMLError:
                value = raw
        _set_path(data, key.strip(), value, item)
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that names a key twice (plain YAML keeps the last one silently: a
    second `lr:` further down an adapter overrode the first without a word)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:  # the keys written here (a `<<:` merge's may be overridden, as YAML allows)
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                continue  # an unhashable key: the constructor below refuses it with its own message
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"the key {key!r} appears twice in one mapping (first {seen[key]})",
                    key_node.start_mark,
                )
            seen[key] = f"at line {key_node.start_mark.line + 1}"
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path) -> Any:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            [
                bad_value(
                    "config", str(path), f"a YAML file; this is a folder (a run dir's own is {path / 'config.yaml'})"
                )
            ]
        )
    if not path.is_file():
        raise ConfigError(
            [bad_value("config", str(path), "the path of an existing YAML file (there is no such file)")]
        )
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ConfigError(
            [bad_value("config", str(path), f"a valid YAML file; this one is not valid YAML: {e}")]
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError([bad_value("config", str(path), f"a UTF-8 text file; this one is not ({e.reason} at byte "
                                     f"{e.start})")]) from None  # fmt: skip
    except OSError as e:  # unreadable: a directory's permissions, a FIFO gone
        raise ConfigError([bad_value("config", str(path), f"a readable file ({e.strerror})")]) from None


def load_run_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    data = load_yaml(path)
    if isinstance(data, dict):
        data = apply_overrides(data, overrides or [])
    return parse_run_config(data, source=str(path))


def dump_config(cfg: BaseModel) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
