"""Typed records that cross every boundary between data, engine, rewards and trainer.

`AdapterRef` and `RewardSpec` are frozen: they are stamped on samples and must not drift while a
sample is in flight. `Sample` is mutable because it is filled in stage by stage (prompt, then
response, then reward, then advantage).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import ConfigDict, Field


@dataclass(frozen=True)
class AdapterRef:
    """Which tenant a sample belongs to: its adapter name and the slot it occupies."""

    name: str
    slot: int


@dataclass(frozen=True)
class RewardSpec:
    """How to score a tenant's samples.

    Exactly one of `name` (a built-in from `rewards`, e.g. "gsm8k", "math") or `path`
    (`module:function`, a custom reward) is set. `kwargs` are passed to the function as keyword
    arguments. A call that raises or runs past `timeout_s` scores `failure_value` and is counted.
    `format_bonus` adds that much for a response in the reward's expected answer format (0 = off).

    This is also the `reward:` section of an adapter's config: pydantic validates it there as it is
    (the constraints below, unknown keys refused); `rewards.validate` checks the rest (exactly one of
    name/path, the function resolves and takes these kwargs).
    """

    __pydantic_config__ = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    name: str | None = None
    """Built-in reward: gsm8k, math, dapo, exact_match, f1, format, reasoning_gym."""
    path: str | None = None
    """Custom reward `module:function` (signature: docs/guides/rewards.md)."""
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)
    """Keyword arguments passed to the reward."""
    timeout_s: Annotated[float, Field(gt=0)] = 10.0
    """Per-call timeout; a call past it scores failure_value."""
    failure_value: float = 0.0
    """Reward given to a sample whose reward call raised or timed out."""
    format_bonus: Annotated[float, Field(ge=0)] = 0.0
    """Added when the response has the reward's answer format."""


@dataclass(frozen=True)
class EnvironmentSpec:
    """A tenant's environment: multi-turn episodes instead of (or with) a single-turn reward.

    `path` names a `rollout.environments.Environment` subclass (`module:Class`), built with `kwargs` once per
    episode. An episode alternates model turns (on the shared engine, with the tenant's adapter) and environment
    turns until the environment says done, `max_turns` model turns, or `max_tokens` response tokens (model and
    environment tokens together). A `step` past `turn_timeout_s`, or an episode past `episode_timeout_s`, costs the
    tenant that episode (FAILED), never another tenant anything.

    This is also the `environment:` section of an adapter's config, validated by pydantic as it is.
    """

    __pydantic_config__ = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    path: str
    """`module:Class` of a rollout.environments.Environment subclass."""
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)
    """Keyword arguments of the class (one instance per episode)."""
    max_turns: Annotated[int, Field(ge=1)] = 4
    """Most model turns in one episode."""
    max_tokens: Annotated[int, Field(ge=1)] = 256
    """Most response tokens in one episode (model and environment turns together)."""
    turn_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    """Longest one reset/step of the environment may take."""
    episode_timeout_s: Annotated[float, Field(gt=0)] = 120.0
    """Longest one whole episode may take."""


class SampleStatus(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class Sample:
    """One prompt-response pair of one adapter, with everything the trainer needs.

    `group_index` identifies the prompt group (the `n_samples_per_prompt` samples of one prompt,
    over which GRPO normalizes advantages); `index` is the sample's position within the step.
    `weight_version` is the version of `adapter` that produced the response: the trainer checks it
    so that a response generated on stale weights is never trained on as if current.
    """

    prompt: str
    prompt_ids: list[int] = field(default_factory=list)
    response: str = ""
    response_ids: list[int] = field(default_factory=list)
    label: Any = None
    reward: float | None = None
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    status: SampleStatus = SampleStatus.PENDING
    finish_reason: str | None = None
    group_index: int = 0
    index: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    adapter: AdapterRef | None = None
    reward_spec: RewardSpec | None = None
    weight_version: int | None = None
    advantage: float = 0.0
    sampling: SamplingParams | None = None  # the tenant's own sampling settings (None: the rollout's)
    environment: EnvironmentSpec | None = None  # set: the sample is a multi-turn episode of this environment


@dataclass
class SamplingParams:
    """Per-request sampling settings (names follow SGLang's `sampling_params`).

    `top_k = -1` and `top_p = 1.0` disable those filters; `temperature = 0` is greedy.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    min_p: float = 0.0  # drop tokens whose probability is below min_p times the top token's (0 = off)
    ignore_eos: bool = False  # the model's EOS does not end the row (SGLang's; Tinker's `stop=[]`)


@dataclass
class GenerateRequest:
    """One generation request. `adapter` is the adapter name, or None for the base model.

    `keep_prefix`: a later request will likely continue this one (an episode's next turn, a chat client's next
    message), so an engine with a prefix cache keeps this one's KV when it finishes. Off for single-turn rows: their
    KV would only take memory (and a reuse rounds differently from a full prefill, so single-turn runs stay exactly
    what they were without the cache).
    """

    input_ids: list[int]
    adapter: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str | None = None
    keep_prefix: bool = False


@dataclass
class GenerateResult:
    """What the engine returns for one request.

    `finish_reason` is "stop" (EOS, stop token or stop string), "length" (max_new_tokens),
    "abort" (cut off by a pause in abort mode; resubmit it) or "error" (see `error`).
    `weight_version` is the version of the request's adapter that produced every token
    (None for base rows).
    """

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"
    weight_version: int | None = None
    error: str | None = None
