"""Per-tenant policy losses and the truncated importance-sampling (TIS) correction, free of any model.

Every function works on the flattened loss tokens of a mixed batch: `logp`, `old_logp`, `adv`, `rows` are (N,),
`rows[t]` the batch row of token t (so sequence-level quantities are segment reductions over `rows`). Aggregation
(how token losses become a tenant's loss) is the trainer's per-token weights; `LOSS_DEFAULTS` says which one and
which advantage normalization each loss is defined with.

| loss     | surrogate per token                                                   | advantages | aggregation |
|----------|-----------------------------------------------------------------------|------------|-------------|
| grpo     | -min(r A, clip(r, 1-el, 1+eh) A), r = exp(logp - old)                  | group std  | seq-mean-token-mean |
| dapo     | the same, clip-higher (eh > el)                                         | group std  | token-mean |
| dr_grpo  | the same                                                              | no std     | seq-mean-token-sum-norm |
| gspo     | -min(s A, clip(s, 1-el, 1+eh) A), s = exp(mean over the row of (logp - old)), per token as sg(s) * exp(logp - sg(logp)) (GSPO-token) | group std | seq-mean-token-mean |
| cispo    | -sg(clip(r, 1-el, 1+eh)) A logp (the IS weight is clipped, the gradient flows through logp only) | group std | token-mean |

TIS (`tis_weights`): the trainer's old log-probs and the engine's rollout log-probs of the same tokens differ
(kernels, precision, batching). Each token's loss is multiplied by sg(w), w = min(exp(old - rollout), cap) per
token, or per sequence w = min(exp(sum over the row of (old - rollout)), cap): the truncated importance weight of
Yao et al. (2025, "Your efficient RL framework secretly brings you off-policy RL training").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rl_multilora.config import AdapterConfig, GRPOSettings

LOSSES = ("grpo", "dapo", "dr_grpo", "gspo", "cispo")
TIS_MODES = ("token", "sequence")

# (normalize advantages by the group std, loss aggregation) each loss is defined with.
LOSS_DEFAULTS: dict[str, tuple[bool, str]] = {
    "grpo": (True, "seq-mean-token-mean"),
    "dapo": (True, "token-mean"),
    "dr_grpo": (False, "seq-mean-token-sum-norm"),
    "gspo": (True, "seq-mean-token-mean"),
    "cispo": (True, "token-mean"),
}


def segment_sum(values: torch.Tensor, rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    """out[i] = sum of values[t] over tokens t with rows[t] == i; (N,) -> (n_rows,)."""
    return torch.zeros(n_rows, dtype=values.dtype, device=values.device).index_add(0, rows, values)


def token_losses(
    kind: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    rows: torch.Tensor,
    n_rows: int,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, clipped) per token for loss `kind` (see the module table); both (N,). `clipped` marks tokens where
    clipping changed the value (for `clip_frac`)."""
    if kind in ("grpo", "dapo", "dr_grpo"):
        ratio = torch.exp(logp - old_logp)  # (N,)
        unclipped = -ratio * adv
        clipped = -torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
        return torch.maximum(unclipped, clipped), clipped > unclipped
    if kind == "gspo":
        count = segment_sum(torch.ones_like(logp), rows, n_rows).clamp_min(1.0)  # (R,)
        log_s = segment_sum(logp - old_logp, rows, n_rows) / count  # (R,) log of the sequence ratio
        # GSPO-token: the value is the sequence ratio s_i, the gradient s_i * d logp_t (sg = detach).
        s = torch.exp(log_s.detach()[rows] + logp - logp.detach())  # (N,)
        unclipped = -s * adv
        clipped = -torch.clamp(s, 1.0 - eps_low, 1.0 + eps_high) * adv
        return torch.maximum(unclipped, clipped), clipped > unclipped
    if kind == "cispo":
        ratio = torch.exp(logp - old_logp).detach()  # (N,)
        weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
        return -weight * adv * logp, weight != ratio
    raise ValueError(f"loss={kind!r} is not allowed; allowed: one of {', '.join(LOSSES)}")


def tis_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, rows: torch.Tensor, n_rows: int, mode: str, cap: float
) -> torch.Tensor:
    """Detached truncated importance weights (N,) of trainer-old vs engine log-probs (see the module docstring)."""
    log_w = (old_logp - rollout_logp).detach()  # (N,)
    if mode == "token":
        return torch.exp(log_w).clamp(max=cap)
    if mode == "sequence":
        return torch.exp(segment_sum(log_w, rows, n_rows)).clamp(max=cap)[rows]
    raise ValueError(f"tis.mode={mode!r} is not allowed; allowed: one of {', '.join(TIS_MODES)}")


@dataclass(frozen=True)
class TenantAlgo:
    """One tenant's own algorithm settings, resolved against the run's `grpo` section (see `tenant_algo`)."""

    loss: str
    normalize_std: bool
    loss_agg: str
    kl_coef: float
    eps_low: float
    eps_high: float
    temperature: float  # the tenant's sampling temperature (1 for greedy): the trainer's logits are divided by it
    norm_len: int  # dr_grpo's constant divisor: the tenant's response budget
    tis_mode: str | None = None
    tis_cap: float = 2.0


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
