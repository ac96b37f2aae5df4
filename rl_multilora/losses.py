"""The one loss registry: every policy and supervised loss, defined once, free of any model.

Both front doors use it: a GRPO tenant's `loss` (`GRPO_LOSSES`, each a surrogate of the registry with the advantage
normalization and aggregation it is defined with, `LOSS_DEFAULTS`) and a Tinker client's `loss_fn` (`SDK_LOSSES`,
with its `loss_fn_config`). The config's choices and the server's accepted names are these tuples; a loss added to
`REGISTRY` is a Tinker client's at once, and a GRPO tenant's once `GRPO_SURROGATE` names it.

Every loss works on the flattened loss tokens of a mixed batch (`TokenBatch`): `logp`, `old_logp`, `adv`, `weights`,
`rows` are (N,), `rows[t]` the batch row of token t (sequence-level quantities are segment reductions over `rows`).
It returns the per-token loss and where its clip was active; how token losses become a tenant's loss is the
caller's per-token weight (GRPO's aggregation, 1 for a Tinker client, whose losses are sums over tokens).
`old_logp` is the policy that sampled the tokens: the trainer's own first-epoch forward for GRPO tenants, the
sampler's `logprobs` input for Tinker clients, and for `stable_reinforce` the log-probs the server itself recorded
when it sampled the tokens (`rl_multilora.tinker.stability`), never the client's.

| loss                | per-token loss                                                               | config (default) |
|---------------------|------------------------------------------------------------------------------|------------------|
| cross_entropy       | -w logp                                                                      | -                |
| importance_sampling | -r A, r = exp(logp - old)                                                    | -                |
| ppo                 | -min(r A, clip(r, lo, hi) A)                                                 | lo 0.8, hi 1.2   |
| cispo               | -sg(clip(r, lo, hi)) A logp (the IS weight is clipped, the gradient flows through logp) | lo 0, hi 4 |
| gspo                | -min(s A, clip(s, lo, hi) A), s = exp(mean of (logp - old) over the row's tokens that `sequence_ratio_mask` marks, all by default), per token sg(s) exp(logp - sg(logp)) (GSPO-token) | lo 0.8, hi 1.2 |
| dro                 | -(A logp - beta / 2 (logp - old)^2)                                         | beta 0.05        |
| stable_reinforce    | m (-sg(w) A logp + kl_coeff k3), w = min(exp(logp - old), tis_cap), k3 = exp(old - logp) - (old - logp) - 1; old = the server-recorded sampler log-probs, m = 1 on sampled tokens, 0 on prompt positions; this project's objective, not Tinker's (unpublished) | kl_coeff 0, tis_cap 2 |

`stable_reinforce` is this project's own objective under the name the SDK and tinker-cookbook use; Tinker does not
publish its objective, so its numbers differ from Tinker's service. It is REINFORCE on the sampled tokens with the
truncated importance weight (TIS) of Yao et al. (2025) between the trainer and the sampler, computed from the
sampler's own log-probs that the server recorded (`record_stability_info`) and the datum's provenance names, plus an
optional k3 estimate (Schulman, "Approximating KL divergence") of KL(train || sampler) per sampled token. It needs
that provenance (`LossDef.provenance`): `old` and `m` are filled by the server, not read from `loss_fn_inputs`. It is
a Tinker client's loss only: a GRPO tenant's surrogates take the trainer's own old log-probs, and its engine-vs-
trainer mismatch is the `tis` setting's.

GRPO tenants' names (`GRPO_LOSSES`), with lo = 1 - eps_clip and hi = 1 + eps_clip_high:

| loss     | surrogate | advantages | aggregation             |
|----------|-----------|------------|-------------------------|
| grpo     | ppo       | group std  | seq-mean-token-mean     |
| dapo     | ppo (clip-higher, eh > el) | group std | token-mean |
| dr_grpo  | ppo       | no std     | seq-mean-token-sum-norm |
| gspo     | gspo      | group std  | seq-mean-token-mean     |
| cispo    | cispo (weight in [0, 1 + eh]) | group std  | token-mean |

TIS (`tis_weights`): the trainer's old log-probs and the engine's rollout log-probs of the same tokens differ
(kernels, precision, batching). Each token's loss is multiplied by sg(w), w = min(exp(old - rollout), cap) per
token, or per sequence w = min(exp(sum over the row of (old - rollout)), cap): the truncated importance weight of
Yao et al. (2025, "Your efficient RL framework secretly brings you off-policy RL training").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

TIS_MODES = ("token", "sequence")
CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
# The ratio's bounds: a ratio is > 0, so a bound below 0 clips nothing (and a negative high one flips the sign of
# every token's loss); `LossDef.resolve` also refuses a low bound above the high one (clamp's result is then `high`
# for every token whatever the ratio: no gradient, a loss that looked like a working one).
CLIP_RULES = {
    "clip_low_threshold": (lambda v: v >= 0.0, "a finite number >= 0 (a bound on the ratio)"),
    "clip_high_threshold": (lambda v: v > 0.0, "a finite number > 0 (a bound on the ratio)"),
}


@dataclass(frozen=True)
class TokenBatch:
    """A loss's inputs over the flattened loss tokens of a batch, all (N,) but `n_rows`."""

    logp: torch.Tensor  # the policy's log-prob of each target token (the one tensor with a gradient)
    old_logp: torch.Tensor  # the sampling policy's log-probs (zeros where a loss needs none)
    adv: torch.Tensor  # advantages (zeros where a loss needs none)
    weights: torch.Tensor  # cross_entropy's per-token weights (ones elsewhere)
    rows: torch.Tensor  # each token's row in the batch
    n_rows: int


@dataclass(frozen=True)
class LossDef:
    """One loss: its per-token function, the Tinker `loss_fn_inputs` it reads besides `target_tokens`, and its
    `loss_fn_config` keys with their defaults."""

    name: str
    fn: Callable[[TokenBatch, Mapping[str, float]], tuple[torch.Tensor, torch.Tensor]]
    inputs: tuple[str, ...]
    config: Mapping[str, float] = field(default_factory=dict)
    optional_inputs: tuple[str, ...] = ()
    # config key -> (is the value allowed?, what is allowed), beyond being a finite number
    config_rules: Mapping[str, tuple[Callable[[float], bool], str]] = field(default_factory=dict)
    # the loss reads the sampler's log-probs the server recorded, through the datum's provenance: `old_logp` is those
    # on sampled tokens, `weights` 1 on sampled tokens and 0 elsewhere (`rl_multilora.tinker.stability`)
    provenance: bool = False

    def resolve(self, config: Mapping[str, float] | None) -> dict[str, float]:
        """This loss's config: `config` over the defaults; an unknown key or a non-finite value is a ValueError that
        names it."""
        got = dict(config or {})
        unknown = sorted(set(got) - set(self.config))
        if unknown:
            allowed = ", ".join(sorted(self.config)) or "none"
            raise ValueError(f"loss_fn_config {unknown} is not allowed for loss_fn {self.name!r}; allowed: {allowed}")
        out = dict(self.config)
        for key, value in got.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"loss_fn_config[{key!r}]={value!r} is not allowed; allowed: a finite number")
            ok, allowed = self.config_rules.get(key, (None, ""))
            if ok is not None and not ok(float(value)):
                raise ValueError(f"loss_fn_config[{key!r}]={value!r} is not allowed; allowed: {allowed}")
            out[key] = float(value)
        low, high = out.get("clip_low_threshold"), out.get("clip_high_threshold")
        if low is not None and high is not None and low > high:
            raise ValueError(
                f"loss_fn_config clip_low_threshold={low!r} > clip_high_threshold={high!r} is not allowed for loss_fn "
                f"{self.name!r}; allowed: clip_low_threshold <= clip_high_threshold"
            )
        return out


def segment_sum(values: torch.Tensor, rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    """out[i] = sum of values[t] over tokens t with rows[t] == i; (N,) -> (n_rows,)."""
    return torch.zeros(n_rows, dtype=values.dtype, device=values.device).index_add(0, rows, values)


def _cross_entropy(x: TokenBatch, cfg: Mapping[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    return -(x.weights * x.logp), torch.zeros_like(x.logp, dtype=torch.bool)


def _importance_sampling(x: TokenBatch, cfg: Mapping[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = torch.exp(x.logp - x.old_logp)  # (N,)
    return -ratio * x.adv, torch.zeros_like(x.logp, dtype=torch.bool)


def _clipped(value: torch.Tensor, adv: torch.Tensor, cfg: Mapping[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(v A, clip(v, lo, hi) A) and where the clipped branch is strictly the active (larger-loss) one."""
    unclipped = -value * adv  # (N,)
    clipped = -torch.clamp(value, cfg["clip_low_threshold"], cfg["clip_high_threshold"]) * adv  # (N,)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _ppo(x: TokenBatch, cfg: Mapping[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    return _clipped(torch.exp(x.logp - x.old_logp), x.adv, cfg)


def _cispo(x: TokenBatch, cfg: Mapping[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = torch.exp(x.logp - x.old_logp).detach()  # (N,)
    weight = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -weight * x.adv * x.logp, weight != ratio


def _gspo(x: TokenBatch, cfg: Mapping[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO-token over the tokens `x.weights` marks (Tinker's `sequence_ratio_mask`; all ones for GRPO tenants)."""
    count = segment_sum(x.weights, x.rows, x.n_rows).clamp_min(1.0)  # (R,)
    log_s = segment_sum(x.weights * (x.logp - x.old_logp), x.rows, x.n_rows) / count  # (R,) log sequence ratio
    # the value is the sequence ratio s_i, the gradient s_i * d logp_t (sg = detach)
    s = torch.exp(log_s.detach()[x.rows] + x.logp - x.logp.detach())  # (N,)
    return _clipped(s, x.adv, cfg)


def _dro(x: TokenBatch, cfg: Mapping[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    log_ratio = x.logp - x.old_logp  # (N,)
    return -(x.logp * x.adv - 0.5 * cfg["beta"] * log_ratio * log_ratio), torch.zeros_like(x.logp, dtype=torch.bool)


def _stable_reinforce(x: TokenBatch, cfg: Mapping[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """This project's `stable_reinforce` (not Tinker's, which is unpublished; see the module docstring): `x.old_logp`
    the server-recorded sampler log-probs, `x.weights` the sampled-token mask m (prompt positions 0)."""
    sampled = x.weights > 0  # (N,)
    # log pi_train - log pi_sampler, 0 off the sampled tokens so exp() there never overflows (their old is a placeholder)
    log_ratio = torch.where(sampled, x.logp - x.old_logp, torch.zeros_like(x.logp))  # (N,)
    ratio = torch.exp(log_ratio.detach())  # (N,)
    w = ratio.clamp(max=cfg["tis_cap"])  # truncated importance weight, no gradient
    k3 = torch.exp(-log_ratio) + log_ratio - 1.0  # (N,) k3 of KL(train || sampler): (r - 1) - log r, r = pi_s / pi_t
    loss = x.weights * (-w * x.adv * x.logp + cfg["kl_coeff"] * k3)
    return loss, sampled & (ratio > cfg["tis_cap"])


REGISTRY: dict[str, LossDef] = {
    d.name: d
    for d in (
        LossDef("cross_entropy", _cross_entropy, inputs=(), optional_inputs=("weights",)),
        LossDef("importance_sampling", _importance_sampling, inputs=("logprobs", "advantages")),
        LossDef("ppo", _ppo, inputs=("logprobs", "advantages"), config=CLIP_DEFAULTS, config_rules=CLIP_RULES),
        LossDef(
            "cispo",
            _cispo,
            inputs=("logprobs", "advantages"),
            config={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
            config_rules=CLIP_RULES,
        ),
        LossDef(
            "gspo",
            _gspo,
            inputs=("logprobs", "advantages"),
            optional_inputs=("sequence_ratio_mask",),
            config=CLIP_DEFAULTS,
            config_rules=CLIP_RULES,
        ),
        LossDef(
            "dro",
            _dro,
            inputs=("logprobs", "advantages"),
            config={"beta": 0.05},
            # a negative beta turns the proximity penalty into an unbounded reward for drifting from the sampler
            config_rules={"beta": (lambda v: v >= 0.0, "a finite number >= 0")},
        ),
        LossDef(
            "stable_reinforce",
            _stable_reinforce,
            inputs=("advantages",),
            config={"kl_coeff": 0.0, "tis_cap": 2.0},
            config_rules={
                "kl_coeff": (lambda v: v >= 0.0, "a finite number >= 0"),
                "tis_cap": (lambda v: v > 0.0, "a finite number > 0"),
            },
            provenance=True,
        ),
    )
}
# Which TokenBatch field each Tinker input fills (`target_tokens` is the target ids themselves).
INPUT_FIELDS = {"logprobs": "old_logp", "advantages": "adv", "weights": "weights", "sequence_ratio_mask": "weights"}

# The names the Tinker SDK 0.38 defines, every one served (`stable_reinforce` as this project's own objective).
SDK_LOSS_NAMES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce")
SDK_LOSSES = tuple(n for n in SDK_LOSS_NAMES if n in REGISTRY)

# A GRPO tenant's `loss`: its registry surrogate, (normalize advantages by the group std, loss aggregation).
GRPO_SURROGATE = {"grpo": "ppo", "dapo": "ppo", "dr_grpo": "ppo", "gspo": "gspo", "cispo": "cispo"}
GRPO_LOSSES = tuple(GRPO_SURROGATE)
LOSSES = GRPO_LOSSES  # the config's choices
LOSS_DEFAULTS: dict[str, tuple[bool, str]] = {
    "grpo": (True, "seq-mean-token-mean"),
    "dapo": (True, "token-mean"),
    "dr_grpo": (False, "seq-mean-token-sum-norm"),
    "gspo": (True, "seq-mean-token-mean"),
    "cispo": (True, "token-mean"),
}


def sdk_loss(name: object) -> LossDef:
    """The registry's loss a Tinker client names, or a ValueError that says what is allowed."""
    if not isinstance(name, str) or name not in SDK_LOSSES:
        raise ValueError(f"loss_fn={name!r} is not supported; allowed: {', '.join(SDK_LOSSES)}")
    return REGISTRY[name]


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
    """(loss, clipped) per token of GRPO loss `kind` (see the module tables), clip range [1 - eps_low, 1 + eps_high]
    ([0, 1 + eps_high] for cispo's weight); both (N,). `clipped` marks tokens where clipping changed the value (for `clip_frac`)."""
    if kind not in GRPO_SURROGATE:
        why = (
            " (a Tinker client's loss: it needs the sampler log-probs the Tinker server records and a datum's "
            "provenance names; a GRPO tenant corrects its engine-vs-trainer mismatch with `tis`)"
            if kind in REGISTRY and REGISTRY[kind].provenance
            else ""
        )
        raise ValueError(f"loss={kind!r} is not allowed{why}; allowed: one of {', '.join(GRPO_LOSSES)}")
    x = TokenBatch(logp, old_logp, adv, torch.ones_like(logp), rows, n_rows)
    # CISPO caps its IS weight from above only, at 1 + eps_high (MiniMax-M1's form; no lower bound). TRL's cap is its
    # epsilon_high itself (clamp(ratio, max=epsilon_high), 5.0 recommended): TRL's 5.0 is eps_clip_high 4.0 here.
    low = 0.0 if kind == "cispo" else 1.0 - eps_low
    cfg = {"clip_low_threshold": low, "clip_high_threshold": 1.0 + eps_high}
    return REGISTRY[GRPO_SURROGATE[kind]].fn(x, cfg)


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
    """One tenant's loss settings where they are not the run's `grpo` section: a GRPO tenant's own algorithm
    (`rl_multilora.grpo.tenant_algo`) or a Tinker client's loss (`client_algo`)."""

    loss: str  # a GRPO_LOSSES name, or an SDK_LOSSES name for a client
    normalize_std: bool
    loss_agg: str
    kl_coef: float
    eps_low: float
    eps_high: float
    temperature: float  # the tenant's sampling temperature (1 for greedy): the trainer's logits are divided by it
    norm_len: int  # dr_grpo's constant divisor: the tenant's response budget
    tis_mode: str | None = None
    tis_cap: float = 2.0
    config: tuple[tuple[str, float], ...] = ()  # an SDK loss's resolved loss_fn_config, sorted by key
    sdk: bool = False  # `loss` names a registry loss with `config` (a Tinker client's), not a GRPO tenant's loss


def client_algo(loss_fn: object, loss_fn_config: Mapping[str, float] | None) -> TenantAlgo:
    """A Tinker client's loss as a tenant algorithm: the registry's loss with its config, token sums (the weight of
    every token is 1), no KL, temperature 1 (the engine's log-probs are those of the raw logits)."""
    d = sdk_loss(loss_fn)
    cfg = d.resolve(loss_fn_config)
    return TenantAlgo(
        loss=d.name,
        normalize_std=False,
        loss_agg="token-sum",
        kl_coef=0.0,
        eps_low=0.0,
        eps_high=0.0,
        temperature=1.0,
        norm_len=1,
        config=tuple(sorted(cfg.items())),
        sdk=True,
    )
