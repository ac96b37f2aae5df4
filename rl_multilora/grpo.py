"""GRPO's math, free of any model: group advantages, the clipped policy loss, the KL estimators, the LR schedule.

Each function states its shapes; the trainer (`rl_multilora.trainer`) applies them per adapter over a mixed batch.
Deviations from the textbook: warmup is (step + 1) / warmup_steps so the first step already learns; group std is the
unbiased one (as TRL and verl) and a uniform group's advantages are exactly 0.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rl_multilora.config import OptimSettings
from rl_multilora.errors import bad_value
from rollout.types import Sample

KL_TYPES = ("k1", "k3", "low_var_kl")


def lr_multiplier(step: int, optim: OptimSettings, total_steps: int | None) -> float:
    """The factor on the adapter's lr for 0-based optimizer step `step` (the LambdaLR lambda).

    Warmup is (step + 1) / warmup_steps so that the first step already learns (HF's step / warmup wastes step 0);
    cosine then decays from 1 at `warmup_steps` to `min_lr_ratio` at `total_steps` (the adapter's max_steps) and
    stays there.

    >>> cfg = OptimSettings(schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    >>> [round(lr_multiplier(k, cfg, total_steps=6), 4) for k in range(7)]
    [0.5, 1.0, 1.0, 0.8682, 0.55, 0.2318, 0.1]
    """
    if step < optim.warmup_steps:
        return (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return 1.0
    if total_steps is None or total_steps <= optim.warmup_steps:
        raise ValueError(
            bad_value("max_steps", total_steps, f"an integer > warmup_steps ({optim.warmup_steps}) with cosine")
        )
    progress = min(1.0, (step - optim.warmup_steps) / (total_steps - optim.warmup_steps))
    return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped surrogate with asymmetric clip (DAPO) and where the clipped branch was taken.

    Returns (loss, clipped), both (N,): loss = -min(r * A, clip(r, 1 - eps_clip, 1 + eps_clip_high) * A) with
    r = exp(logp - old_logp); clipped is True where the clipped term is strictly the active (larger-loss) one.
    """
    ratio = torch.exp(logp - old_logp)  # (N,)
    unclipped = -ratio * advantages  # (N,)
    clipped_loss = -torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high) * advantages  # (N,)
    return torch.maximum(unclipped, clipped_loss), clipped_loss > unclipped


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL(policy || ref) estimate from sampled-token log-probs; (N,) -> (N,).

    k1 = logp - ref (unbiased, can be negative); k3 = exp(ref - logp) - (ref - logp) - 1 (unbiased, always >= 0,
    lower variance; verl's 'low_var_kl' which additionally clamps to [-10, 10] for stability).
    """
    if kl_type == "k1":
        return logp - ref_logp
    if kl_type in ("k3", "low_var_kl"):
        log_ratio = ref_logp - logp  # (N,)
        kl = torch.exp(log_ratio) - log_ratio - 1.0  # (N,)
        return torch.clamp(kl, -10.0, 10.0) if kl_type == "low_var_kl" else kl
    raise ValueError(bad_value("kl_type", kl_type, f"one of {KL_TYPES}"))


@dataclass
class AdvantageStats:
    """What `compute_advantages` did: which samples keep a learning signal and how many groups were dropped."""

    kept: list[bool]  # per input sample; False for members of dropped uniform groups
    groups: dict[str, int]  # groups seen per adapter
    dropped_groups: dict[str, int]  # uniform groups dropped per adapter


def adapter_name_of(sample: Sample) -> str:
    if sample.adapter is None:
        raise ValueError(
            f"sample index={sample.index} group_index={sample.group_index} has adapter=None: the trainer trains "
            "adapters only, every sample must carry an AdapterRef"
        )
    return sample.adapter.name


def compute_advantages(
    samples: Sequence[Sample],
    normalize_std: bool = True,
    drop_uniform_groups: bool = True,
    normalize_std_of: Mapping[str, bool] | None = None,
) -> AdvantageStats:
    """GRPO advantages, written to `sample.advantage`, per (adapter name, group_index) group.

    A = r - mean(r), divided by (std(r) + 1e-6) when `normalize_std` (std is the unbiased one, as in TRL and verl;
    a one-sample group has std 0). Groups of different adapters never mix even when their group_index is equal.
    A group whose rewards are all equal has A = 0 everywhere; with `drop_uniform_groups` it is marked not kept and
    counted. Non-finite rewards are not dropped here: they give non-finite advantages, which the trainer turns into a
    skipped step for that adapter. `normalize_std_of` overrides `normalize_std` per adapter name (per-tenant losses).
    """
    groups: dict[tuple[str, int], list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        if s.reward is None:
            raise ValueError(
                f"sample index={s.index} of adapter {adapter_name_of(s)!r} (group_index={s.group_index}) has "
                "reward=None: score every sample before training (failed reward calls score failure_value)"
            )
        groups[(adapter_name_of(s), s.group_index)].append(i)

    kept = [True] * len(samples)
    n_groups: dict[str, int] = defaultdict(int)
    n_dropped: dict[str, int] = defaultdict(int)
    for (name, _), idx in groups.items():
        n_groups[name] += 1
        rewards = torch.tensor([float(samples[i].reward) for i in idx], dtype=torch.float64)  # (G,)
        centered = rewards - rewards.mean()  # (G,)
        uniform = bool(torch.all(rewards == rewards[0]))
        if (normalize_std_of or {}).get(name, normalize_std) and len(idx) > 1:
            centered = centered / (rewards.std() + 1e-6)
        for i, a in zip(idx, centered.tolist(), strict=True):
            samples[i].advantage = 0.0 if uniform else a
        if uniform and drop_uniform_groups:
            n_dropped[name] += 1
            for i in idx:
                kept[i] = False
    return AdvantageStats(kept=kept, groups=dict(n_groups), dropped_groups=dict(n_dropped))
