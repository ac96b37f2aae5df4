"""GRPO's math, free of any model: group advantages, the clipped policy loss, the KL estimators, the per-token loss
of a mixed micro-batch and its per-adapter sums, the LR schedule.

Each function states its shapes; the trainer (`rl_multilora.trainer`) applies them per adapter over a mixed batch.
Deviations from the textbook: warmup is (step + 1) / warmup_steps so the first step already learns; group std is the
unbiased one (as TRL and verl) and a uniform group's advantages are exactly 0.

Design choices of the mixed-batch loss (`token_loss`):

- Each token's loss is its own tenant's: a tenant with its own algorithm (`rl_multilora.losses.TenantAlgo`) has its
  own surrogate, clip range, KL coefficient, sampling temperature and TIS weight; the others use the run's
  `GRPOSettings`. Aggregation is not here: the batch builder's per-token weights (`rl_multilora.batch`) turn token
  losses into each adapter's own normalized loss (`per_adapter_sum` of weight * loss).
- The KL reference is the base model: the same rows with every adapter switched off, so no second model is kept. The
  old log-probs are the trainer's own first-epoch forward (the rollout engine's are only compared against them).
- Entropy enters the loss only with `entropy_coef > 0`; otherwise it is reported, detached.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rl_multilora.config import AdapterConfig, GRPOSettings, OptimSettings
from rl_multilora.errors import bad_value
from rl_multilora.losses import LOSS_DEFAULTS, REGISTRY, TenantAlgo, TokenBatch, tis_weights, token_losses
from rollout.types import Sample

if TYPE_CHECKING:
    from rl_multilora.rows import TokenIndex

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
    rows = torch.zeros_like(logp, dtype=torch.long)  # the surrogate is per token: every token one row
    return token_losses("grpo", logp, old_logp, advantages, rows, 1, eps_clip, eps_clip_high)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL(policy || ref) estimate from sampled-token log-probs; (N,) -> (N,).

    k1 = logp - ref (unbiased, can be negative); k3 = exp(ref - logp) - (ref - logp) - 1 (unbiased, always >= 0,
    lower variance); verl's 'low_var_kl' is k3 with `ref - logp` clamped to [-20, 20] before the exp and the result
    to [-10, 10]: without the first clamp a gap past ~88 nats overflowed the exp, and the second clamp's zero
    gradient times inf was a NaN gradient that skipped the tenant's whole step.
    """
    if kl_type == "k1":
        return logp - ref_logp
    if kl_type in ("k3", "low_var_kl"):
        log_ratio = ref_logp - logp  # (N,)
        if kl_type == "low_var_kl":
            log_ratio = torch.clamp(log_ratio, -20.0, 20.0)
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
        # (all +inf compare equal: non-finite is not uniform, its advantages stay non-finite and skip the step)
        uniform = bool(torch.all(rewards == rewards[0])) and bool(torch.isfinite(rewards).all())
        if (normalize_std_of or {}).get(name, normalize_std) and len(idx) > 1:
            centered = centered / (rewards.std() + 1e-6)  # verl's epsilon; TRL's is 1e-4 (a 1.5 is 1.4997 there)
        for i, a in zip(idx, centered.tolist(), strict=True):
            samples[i].advantage = 0.0 if uniform else a
        if uniform and drop_uniform_groups:
            n_dropped[name] += 1
            for i in idx:
                kept[i] = False
    return AdvantageStats(kept=kept, groups=dict(n_groups), dropped_groups=dict(n_dropped))


# ----------------------------------------------------------------------------- the loss of a mixed micro-batch


@dataclass
class TokenSettings:
    """The loss settings of each token of a micro-batch: its own tenant's where some tenant has its own algorithm."""

    algos: list[TenantAlgo | None]  # per adapter of the micro-batch (`TokenIndex.adapter`); None: the run's settings
    temperature: torch.Tensor | None  # (N,) each token's sampling temperature; None: the run's, for every token
    kl_coef: torch.Tensor | None  # (N,) each token's KL coefficient; None: the run's, for every token
    need_ref: bool  # whether some token has a KL term (so the reference forward must run)

    @property
    def custom(self) -> bool:
        """Whether some tenant of the micro-batch has its own algorithm."""
        return any(a is not None for a in self.algos)

    @staticmethod
    def needs_ref(algos: list[TenantAlgo | None], cfg: GRPOSettings) -> bool:
        """Whether some of these tenants (None: the run's settings) has a KL term."""
        return any((cfg.kl_coef if a is None else a.kl_coef) > 0.0 for a in algos)

    @staticmethod
    def of(
        algos: list[TenantAlgo | None], cfg: GRPOSettings, temperature: float, adapter: torch.Tensor
    ) -> TokenSettings:
        """`algos` per adapter of the micro-batch, `temperature` the run's, `adapter` (N,) each token's adapter."""
        if not any(a is not None for a in algos):
            return TokenSettings(algos, None, None, TokenSettings.needs_ref(algos, cfg))
        per_name = [(a.temperature, a.kl_coef) if a else (temperature, cfg.kl_coef) for a in algos]
        device = adapter.device
        temp_tok = torch.tensor([t for t, _ in per_name], dtype=torch.float32, device=device)[adapter]  # (N,)
        kl_coef_tok = torch.tensor([k for _, k in per_name], dtype=torch.float32, device=device)[adapter]  # (N,)
        return TokenSettings(algos, temp_tok, kl_coef_tok, TokenSettings.needs_ref(algos, cfg))


@dataclass
class TokenLoss:
    """The per-token loss terms of one micro-batch, all (N,)."""

    total: torch.Tensor  # pg + kl_coef * kl - entropy_coef * entropy: the token's loss before its aggregation weight
    pg: torch.Tensor  # policy-gradient surrogate (times the TIS weight where a tenant uses TIS)
    kl: torch.Tensor  # KL(policy || base) estimate; zeros without a KL term
    clipped: torch.Tensor  # bool: the clip changed the token's surrogate
    tis: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (weight, applied, capped) when some tenant uses TIS


def token_loss(
    cfg: GRPOSettings,
    settings: TokenSettings,
    tok: TokenIndex,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    entropy: torch.Tensor,
    n_rows: int,
) -> TokenLoss:
    """Each token's loss under its own tenant's settings. `logp`, `old_logp`, `entropy`: (N,); `ref_logp`: (N,) the
    base model's log-probs, None when no token has a KL term; `n_rows`: the micro-batch's rows (`tok.row` < n_rows)."""
    if ref_logp is not None and settings.custom:
        # A tenant without a KL term gets none, whoever shares its micro-batch: its tokens' reference is their own
        # log-prob (k3 of a zero gap: 0, gradient 0), not the base's, whose k3 overflows past an 88-nat gap and made
        # 0 * inf = NaN, skipping its step because a neighbour wanted the base's log-probs.
        ref_logp = torch.where(settings.kl_coef > 0, ref_logp, logp.detach())  # (N,)
    kl_tok = kl_penalty(logp, ref_logp, cfg.kl_type) if ref_logp is not None else torch.zeros_like(logp)  # (N,)
    ent_term = entropy if cfg.entropy_coef > 0.0 else entropy.detach()  # (N,)
    if settings.custom:
        pg_tok, clipped, tis = tenant_policy_loss(cfg, settings.algos, tok, logp, old_logp, n_rows)
        total = pg_tok + settings.kl_coef * kl_tok - cfg.entropy_coef * ent_term  # (N,)
    else:
        pg_tok, clipped = policy_loss(logp, old_logp, tok.advantage, cfg.eps_clip, cfg.eps_clip_high)
        tis = None
        total = pg_tok + cfg.kl_coef * kl_tok - cfg.entropy_coef * ent_term  # (N,)
    return TokenLoss(total=total, pg=pg_tok, kl=kl_tok, clipped=clipped, tis=tis)


def tenant_policy_loss(
    cfg: GRPOSettings,
    algos: list[TenantAlgo | None],
    tok: TokenIndex,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    n_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """Per-token policy loss of a micro-batch where some tenants have their own algorithm: each tenant's tokens
    get its own surrogate and clip range (rl_multilora.losses), times its TIS weight when it asks for one.
    Returns (loss, clipped, TIS (weight, applied, capped) or None), all (N,)."""
    device = logp.device
    groups: dict[tuple[str, float, float, tuple[tuple[str, float], ...], bool], list[int]] = {}
    for i, a in enumerate(algos):
        key = (
            (a.loss, a.eps_low, a.eps_high, a.config, a.sdk)
            if a
            else ("grpo", cfg.eps_clip, cfg.eps_clip_high, (), False)
        )
        groups.setdefault(key, []).append(i)
    loss_weight = tok.loss_weight if tok.loss_weight is not None else torch.ones_like(logp)
    loss = torch.zeros_like(logp)
    clipped = torch.zeros_like(logp, dtype=torch.bool)
    for (kind, eps_low, eps_high, config, sdk), members in groups.items():
        sel = torch.isin(tok.adapter, torch.tensor(members, device=device)).nonzero().squeeze(1)  # (M,)
        if sdk:  # a client's loss, with its own loss_fn_config
            x = TokenBatch(logp[sel], old_logp[sel], tok.advantage[sel], loss_weight[sel], tok.row[sel], n_rows)
            part, part_clipped = REGISTRY[kind].fn(x, dict(config))
        else:
            part, part_clipped = token_losses(
                kind, logp[sel], old_logp[sel], tok.advantage[sel], tok.row[sel], n_rows, eps_low, eps_high
            )
        loss = loss.index_put((sel,), part)  # out of place: the graph keeps every tenant's part
        clipped[sel] = part_clipped
    with_tis = [i for i, a in enumerate(algos) if a is not None and a.tis_mode is not None]
    if not with_tis:
        return loss, clipped, None
    weight = torch.ones_like(logp)
    applied = torch.zeros_like(logp, dtype=torch.bool)
    capped = torch.zeros_like(logp, dtype=torch.bool)
    for i in with_tis:
        a = algos[i]
        sel = ((tok.adapter == i) & tok.has_rollout).nonzero().squeeze(1)  # rows without engine log-probs: 1
        w = tis_weights(old_logp[sel], tok.rollout_logp[sel], tok.row[sel], n_rows, a.tis_mode, a.tis_cap)
        weight[sel] = w.to(weight.dtype)
        applied[sel] = True
        capped[sel] = w >= a.tis_cap
    return loss * weight, clipped, (weight, applied, capped)


def per_adapter_sum(values: torch.Tensor, adapter: torch.Tensor, n_adapters: int) -> torch.Tensor:
    """out[a] = sum over tokens i with adapter[i] = a of values[i]; values, adapter: (N,) -> (n_adapters,)."""
    return torch.zeros(n_adapters, device=values.device, dtype=values.dtype).index_add_(0, adapter, values)


def tenant_algo(grpo: GRPOSettings, a: AdapterConfig, temperature: float, max_new_tokens: int) -> TenantAlgo | None:
    """Adapter `a`'s algorithm: None when it sets nothing of its own (the run's grpo section applies as it is);
    otherwise its loss (with that loss's advantage normalization and aggregation, `LOSS_DEFAULTS`; without a `loss`,
    the run's), KL, clip range, TIS and sampling temperature. `temperature` / `max_new_tokens`: the run's."""
    own_temp = a.sampling.temperature if a.sampling is not None else None
    own = (a.loss, a.kl_coef, a.eps_clip, a.eps_clip_high, a.tis, own_temp)
    if all(x is None for x in own):
        return None
    normalize_std, agg = LOSS_DEFAULTS[a.loss] if a.loss is not None else (grpo.normalize_std, grpo.loss_agg)
    temp = own_temp if own_temp is not None else temperature
    budget = a.environment.max_tokens if a.environment is not None else None
    if budget is None and a.sampling is not None and a.sampling.max_new_tokens is not None:
        budget = a.sampling.max_new_tokens
    return TenantAlgo(
        loss=a.loss or "grpo",
        normalize_std=normalize_std,
        loss_agg=agg,
        kl_coef=grpo.kl_coef if a.kl_coef is None else a.kl_coef,
        eps_low=grpo.eps_clip if a.eps_clip is None else a.eps_clip,
        eps_high=grpo.eps_clip_high if a.eps_clip_high is None else a.eps_clip_high,
        temperature=temp if temp > 0 else 1.0,
        norm_len=budget or max_new_tokens,
        tis_mode=a.tis.mode if a.tis is not None else None,
        tis_cap=a.tis.cap if a.tis is not None else 2.0,
    )
