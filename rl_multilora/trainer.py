"""GRPO trainer for many LoRA adapters on one frozen base, one optimizer per tenant: a composition of its parts.

- `rl_multilora.batch`: samples -> rows (exclusions, stale versions, dropped groups), each adapter's per-token
  weights (its loss normalized over its own rows), micro-batches, padding, the token index.
- `rl_multilora.grpo`: the loss (advantages, policy loss, KL, entropy per token, per-adapter sums).
- `rl_multilora.tenant_optim`: one tenant's AdamW + LR schedule, its clipping, NaN skip and step count.
- `rl_multilora.ranks`: the rank coordinator (rows per rank, the all-reduced norms, flags and sums; world 1 alone).

This module runs the forwards and backwards and steps the tenants. Design choices (each part's own are in its module):

- Old log-probs are the trainer's own (not the rollout engine's): the forward of the first PPO epoch runs before any
  optimizer step, so its detached log-probs are exactly the "old" policy and no extra no-grad pass is needed. The
  rollout log-probs are only compared against them (`logprob_gap`) to expose train/inference mismatch.
- The KL reference is the base model: the same rows with every adapter switched off (`adapter_names=None` per row),
  under no_grad, in the first epoch only (cached per row with the old log-probs).
- Forward passes run with the model in eval mode (dropout off) so that the old, new and reference log-probs come from
  the same deterministic function; autograd is unaffected. The previous mode is restored afterwards.
- Non-finite rewards or advantages are caught before the forward (the batch builder); non-finite losses or grads
  produced by the model itself (e.g. a diverged adapter) are caught per adapter after the backward: only finite
  adapters' losses enter it, and the tenant's step is skipped. After each epoch every adapter with rows steps (or
  skips) on its own; the stacked grads are dropped after each epoch.
- A `train_step` takes up to `ppo_epochs` optimizer steps per adapter, never more than the adapter's remaining budget
  (`max_steps` argument), and reports how many it took (`AdapterStepStats.n_steps`); the tenant's step counter adds
  exactly that, so counter, budget and LR schedule count the same optimizer steps.
- Settings are the validated config sections as they are: `GRPOSettings` for the loss, each adapter's
  `OptimSettings` + lr + max_steps for its optimizer and schedule (`rl_multilora.config`); no twin types.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from rl_multilora.backends.base import AdapterStepStats
from rl_multilora.batch import Row, TokenIndex, build_batch, micro_batches, pad, token_weights
from rl_multilora.config import GRPOSettings, OptimSettings
from rl_multilora.errors import bad_value
from rl_multilora.grpo import TokenSettings, adapter_name_of, per_adapter_sum, token_loss
from rl_multilora.losses import TenantAlgo
from rl_multilora.ranks import RankCoordinator
from rl_multilora.tenant_optim import TenantOptimizer
from rollout.types import Sample

if TYPE_CHECKING:
    from rl_multilora.lora import MultiLoRAModel

# The reported per-adapter sums, added over ranks at the end of a step.
RANK_SUMMED = (
    "loss",
    "pg_loss",
    "kl",
    "entropy",
    "clipped",
    "tokens",
    "gap",
    "gap_tokens",
    "tis_w",
    "tis_n",
    "tis_capped",
)


@dataclass
class _Tenant:
    slot: int  # the model slot the optimizer's parameters belong to (to catch a caller that re-slotted the name)
    optim: TenantOptimizer
    algo: TenantAlgo | None = None  # its own loss, KL, clip, TIS, temperature; None: the run's GRPOSettings


class _Sums:
    """Per-adapter running sums over micro-batches and epochs (plain floats: they are only reported)."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def add(self, name: str, key: str, value: float) -> None:
        self.values[name][key] += value

    def get(self, name: str, key: str) -> float:
        return self.values[name][key]


class MultiLoRATrainer:
    """GRPO over a `MultiLoRAModel`: one mixed batch, one AdamW + LR schedule + step counter per adapter."""

    def __init__(
        self,
        model: MultiLoRAModel,
        cfg: GRPOSettings,
        pad_token_id: int,
        temperature: float = 1.0,
        norm_len: int | None = None,
    ):
        """`temperature`: the rollouts' sampling temperature; logits are divided by it before the softmax, so the
        trainer's log-probs are those of the distribution the engine sampled from (pass 1.0 for greedy rollouts).
        A tenant with its own algorithm (`add_adapter(..., algo=)`) has its own temperature, loss, KL, clip and TIS.
        `norm_len`: unused by the run's own losses; kept for tenants' dr_grpo (their `TenantAlgo.norm_len`)."""
        if not isinstance(cfg, GRPOSettings):
            raise TypeError(bad_value("cfg", type(cfg).__name__, "a rl_multilora.config.GRPOSettings"))
        if not isinstance(pad_token_id, int) or pad_token_id < 0:
            raise ValueError(bad_value("pad_token_id", pad_token_id, "a non-negative token id"))
        if not temperature > 0.0:
            raise ValueError(bad_value("temperature", temperature, "a number > 0"))
        self.model = model
        self.cfg = cfg
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        self._tenants: dict[str, _Tenant] = {}
        self._ranks = RankCoordinator.of(model)
        self.norm_len = norm_len

    # ----- tenants -----

    def add_adapter(
        self, name: str, optim: OptimSettings, lr: float, max_steps: int | None = None, algo: TenantAlgo | None = None
    ) -> None:
        """Create `name`'s AdamW (over its own slot's parameters only) and LR schedule; the model must hold it.

        `lr` is the peak learning rate and `max_steps` the adapter's budget in optimizer steps (what a cosine
        schedule decays over), both as in the adapter's config.
        """
        if name in self._tenants:
            raise ValueError(
                bad_value("name", name, "a new adapter; it already has an optimizer (remove_adapter it first)")
            )
        if name not in self.model.adapters:
            raise ValueError(bad_value("name", name, f"an adapter of the model ({sorted(self.model.adapters)})"))
        optimizer = TenantOptimizer(name, list(self.model.adapter_parameters(name)), optim, lr, max_steps)
        self._tenants[name] = _Tenant(slot=self.model.adapters[name].slot, optim=optimizer, algo=algo)

    def remove_adapter(self, name: str) -> None:
        """Drop `name`'s optimizer, schedule and step counter (the model's slot is the caller's to free)."""
        self._tenant(name).optim.drop_grads()
        del self._tenants[name]

    @property
    def adapters(self) -> list[str]:
        return list(self._tenants)

    def adapter_step(self, name: str) -> int:
        """Optimizer steps `name` has taken, as its LR scheduler counts them (the tenant's counter must agree)."""
        return self._tenant(name).optim.step_count

    def adapter_lr(self, name: str) -> float:
        """The learning rate `name`'s next optimizer step will use."""
        return self._tenant(name).optim.lr

    def optimizer_state_dict(self, name: str) -> dict[str, Any]:
        """`name`'s optimizer and scheduler state, for checkpoints (the scheduler's `last_epoch` is its step count)."""
        return self._tenant(name).optim.state_dict()

    def holds(self, name: str) -> bool:
        """Whether this rank holds `name`'s slot (always, unless the model is sharded over ranks)."""
        return self._tenant(name).optim.holds

    def load_optimizer_state_dict(self, name: str, state: dict[str, Any]) -> None:
        """Restore what `optimizer_state_dict` returned into `name` (added with the same OptimSettings). A rank that
        does not hold the slot (sharded model) takes the schedule and learning rate only."""
        self._tenant(name).optim.load_state_dict(state, name)

    def _check_slot(self, name: str) -> None:
        # The optimizer holds the slot's Parameters: stepping it after the model re-slotted the name (or gave the
        # slot to another tenant) would move someone else's weights.
        tenant = self._tenant(name)
        info = self.model.adapters.get(name)
        if info is None or info.slot != tenant.slot:
            now = "is no longer in the model" if info is None else f"now sits in slot {info.slot}"
            raise RuntimeError(
                f"adapter {name!r} had slot {tenant.slot} when its optimizer was created but {now}; "
                "call trainer.remove_adapter and trainer.add_adapter after changing the model's adapters"
            )

    def _tenant(self, name: str) -> _Tenant:
        if name not in self._tenants:
            raise KeyError(bad_value("adapter", name, f"an adapter with an optimizer ({sorted(self._tenants)})"))
        return self._tenants[name]

    # ----- training -----

    def train_step(
        self,
        samples: Sequence[Sample],
        current_versions: dict[str, int] | None = None,
        max_steps: dict[str, int] | None = None,
    ) -> dict[str, AdapterStepStats]:
        """One GRPO update of every adapter that has rows in `samples`; returns stats per adapter seen in them.

        `current_versions` maps adapter name to its current weight version; samples with an older
        `weight_version` are excluded and counted as stale. `max_steps` caps the optimizer steps an adapter may take
        in this call (its remaining budget; default `ppo_epochs`).
        """
        for s in samples:
            self._check_slot(adapter_name_of(s))  # unknown or re-slotted adapters are a caller bug: fail before work
        own = {n: t.algo.normalize_std for n, t in self._tenants.items() if t.algo is not None}
        batch = build_batch(
            samples, current_versions, self.cfg.normalize_std, self.cfg.drop_uniform_groups, normalize_std_of=own
        )
        for name, st in batch.stats.items():
            st.lr = self.adapter_lr(name)
        if batch.by_adapter:
            # Dropout off: old, new and reference log-probs must be the same function. The model stays in eval mode
            # (nothing here needs train mode), so an engine generating on the shared base at the same time (an
            # asynchronous run) never sees the mode flip under it.
            self.model.eval()
            self._optimize(batch.rows, batch.by_adapter, batch.stats, max_steps or {})
        return batch.stats

    def _optimize(
        self,
        order: list[Row],
        rows_by_adapter: dict[str, list[Row]],
        stats: dict[str, AdapterStepStats],
        max_steps: dict[str, int],
    ) -> None:
        """Run `ppo_epochs` passes over the rows, stepping each adapter after every pass (up to its `max_steps`)."""
        cache: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # id(row) -> (old_logp, ref_logp)
        algos = {n: t.algo for n, t in self._tenants.items()}
        weights = token_weights(rows_by_adapter, self.cfg.loss_agg, algos)
        # Reference log-probs are cached in the first epoch for every row when any tenant of the step has KL: a
        # tenant leaving after an epoch re-cuts the micro-batches, so a row can meet a KL tenant's rows only later.
        # One flag for the step also keeps every rank's count of forwards the same (FSDP collectives).
        step_ref = TokenSettings.needs_ref([algos[n] for n in rows_by_adapter], self.cfg)
        sums = _Sums()
        active = set(rows_by_adapter)
        ranks = self._ranks
        self.model.zero_lora_grads()
        # Each row stays on one rank for every epoch: its old and reference log-probs are cached where it ran first.
        assigned = ranks.split(order)
        for epoch in range(self.cfg.ppo_epochs):
            rows = [r for r in order if r.adapter in active]  # every rank: the same rows, in the same order
            if not rows:
                break
            shares = [[r for r in share if r.adapter in active] for share in assigned]
            nonfinite_loss: set[str] = set()
            backwarded: set[str] = set()
            for micro in micro_batches(shares, ranks.rank, self.cfg.micro_batch_size):
                if not micro:  # this rank is short of rows: join the collectives (same forwards) at weight zero
                    self._micro_step([rows[0]], {id(rows[0]): 0.0}, {}, _Sums(), epoch == 0, step_ref, filler=True)
                    continue
                bad, good = self._micro_step(micro, weights, cache, sums, epoch == 0, step_ref)
                nonfinite_loss |= bad
                backwarded |= good
            nonfinite_loss, backwarded = ranks.agree(sorted(active), nonfinite_loss, backwarded)
            for name in sorted({r.adapter for r in rows}):
                sums.add(name, "epochs", 1.0)
                lr = self.adapter_lr(name)
                stepped, grad_norm = self._step_adapter(name, skip=name in nonfinite_loss, grads=name in backwarded)
                st = stats[name]
                st.grad_norm = grad_norm
                if stepped:
                    st.stepped = True
                    st.n_steps += 1
                    st.lr = lr
                    if st.n_steps >= max_steps.get(name, self.cfg.ppo_epochs):
                        active.discard(name)  # its budget is spent: it sits out the remaining epochs
                else:
                    st.skipped_nonfinite = True
                    active.discard(name)  # a diverged tenant sits out the remaining epochs of this batch
            self.model.zero_lora_grads()
        names = sorted(rows_by_adapter)
        summed = ranks.sum_floats([sums.get(n, k) for n in names for k in RANK_SUMMED])
        for i, n in enumerate(names):
            for j, k in enumerate(RANK_SUMMED):
                sums.values[n][k] = summed[i * len(RANK_SUMMED) + j]
        for name in rows_by_adapter:
            st = stats[name]
            n_epochs = max(1.0, sums.get(name, "epochs"))
            for key in ("loss", "pg_loss", "kl", "entropy"):
                setattr(st, key, sums.get(name, key) / n_epochs)
            st.clip_frac = sums.get(name, "clipped") / max(1.0, sums.get(name, "tokens"))
            n_gap = sums.get(name, "gap_tokens")
            st.logprob_gap = sums.get(name, "gap") / n_gap if n_gap > 0 else None
            n_tis = sums.get(name, "tis_n")
            if n_tis > 0:
                st.tis_weight_mean = sums.get(name, "tis_w") / n_tis
                st.tis_capped_frac = sums.get(name, "tis_capped") / n_tis

    def _forward_logp(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        adapter_names: list[str | None],
        tok: TokenIndex,
        temperature: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-prob of each loss token and the entropy of its predictive distribution; both (N,), at least float32."""
        width = input_ids.shape[1]
        # Logits at position t predict token t + 1. HF's `logits_to_keep` (last k positions) skips the lm_head over
        # the prompt region, whose (B, T, V) logits dominate memory at real vocab sizes.
        keep = width - tok.first_pos + 1
        out = self.model(input_ids, attention_mask=attention_mask, adapter_names=adapter_names, logits_to_keep=keep)
        logits = out.logits  # (B, K, V), positions width - K .. width - 1 (K = T for a model that ignores it)
        offset = width - logits.shape[1]
        # gathering before the softmax keeps it at (N, V), not (B, K, V)
        picked = logits[tok.row, tok.pos - 1 - offset]  # (N, V)
        # Half-precision logits are upcast for the softmax; float64 models (used by exactness tests) stay float64.
        picked = picked.float() if picked.element_size() < 4 else picked  # (N, V)
        # Each token's own tenant temperature when some tenant has one, else the run's (one scalar).
        picked = picked / (self.temperature if temperature is None else temperature.to(picked.dtype)[:, None])
        logp_all = F.log_softmax(picked, dim=-1)  # (N, V)
        logp = logp_all.gather(-1, tok.target[:, None]).squeeze(-1)  # (N,)
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # (N,)
        return logp, entropy

    def _micro_step(
        self,
        micro: list[Row],
        weights: dict[int, float],
        cache: dict[int, tuple[torch.Tensor, torch.Tensor | None]],
        sums: _Sums,
        first_epoch: bool,
        step_ref: bool,
        filler: bool = False,
    ) -> tuple[set[str], set[str]]:
        """Forward + backward of one micro-batch; returns the adapters whose loss here was not finite, and those
        whose loss went into the backward. `step_ref`: whether some tenant of the whole step has KL (the first
        epoch then caches every row's reference log-probs). `filler`: a zero-weight stand-in on a rank short of rows, which runs the
        same forwards and backward as the other ranks (their FSDP collectives) and caches nothing."""
        device = next(self.model.parameters()).device
        names = sorted({r.adapter for r in micro})
        slot_of = {n: i for i, n in enumerate(names)}
        input_ids, attention_mask = pad(micro, self.pad_token_id, device)  # (B, T), (B, T)
        tok = TokenIndex.build(micro, slot_of, weights, device)
        adapter_names: list[str | None] = [r.adapter for r in micro]
        settings = TokenSettings.of([self._tenants[n].algo for n in names], self.cfg, self.temperature, tok.adapter)
        need_ref, temp_tok = settings.need_ref, settings.temperature

        ref_logp = None
        if first_epoch and step_ref:
            with torch.no_grad():
                ref_logp, _ = self._forward_logp(input_ids, attention_mask, [None] * len(micro), tok, temp_tok)  # (N,)
        logp, entropy = self._forward_logp(input_ids, attention_mask, adapter_names, tok, temp_tok)  # (N,), (N,)
        if filler:
            old_logp = logp.detach()
            if need_ref and not first_epoch:
                ref_logp = old_logp
        elif first_epoch:
            # No optimizer step has happened yet in this train_step: this forward IS the old policy.
            old_logp = logp.detach()
            splits_old = old_logp.split(tok.counts)
            splits_ref = ref_logp.split(tok.counts) if step_ref else [None] * len(micro)
            for r, o, f in zip(micro, splits_old, splits_ref, strict=True):
                cache[id(r)] = (o, f)
        else:
            old_logp = torch.cat([cache[id(r)][0] for r in micro])  # (N,)
            if need_ref:
                ref_logp = torch.cat([cache[id(r)][1] for r in micro])  # (N,)
        if not need_ref:
            ref_logp = None  # no token of this micro-batch has a KL term (a 0 * inf term would still be NaN)
        loss = token_loss(self.cfg, settings, tok, logp, old_logp, ref_logp, entropy, len(micro))

        def per_adapter(values: torch.Tensor) -> torch.Tensor:
            return per_adapter_sum(values, tok.adapter, len(names))  # (N,) -> (n_adapters,)

        loss_a = per_adapter(tok.weight * loss.total)  # (n_adapters,)
        finite = torch.isfinite(loss_a)  # (n_adapters,)
        # Only finite terms enter the backward; a non-finite tenant is skipped by name below. Sharded, every rank
        # runs the backward even with nothing finite here: it holds the FSDP reduce-scatters the others wait in.
        if bool(finite.any()) or self._ranks.world > 1:
            loss_a[finite].sum().backward()
        finite_list = finite.tolist()
        nonfinite = {n for n, ok in zip(names, finite_list, strict=True) if not ok}
        backwarded = {n for n, ok in zip(names, finite_list, strict=True) if ok}

        with torch.no_grad():
            pg_a = per_adapter(tok.weight * loss.pg.detach()).tolist()
            kl_a = per_adapter(tok.weight * loss.kl.detach()).tolist()
            ent_a = per_adapter(tok.weight * entropy.detach()).tolist()
            clip_a = per_adapter(loss.clipped.float()).tolist()
            ntok_a = per_adapter(torch.ones_like(logp)).tolist()
            gap = torch.where(tok.has_rollout, (tok.rollout_logp - old_logp).abs(), torch.zeros_like(old_logp))
            gap_a = per_adapter(gap).tolist()
            gap_n_a = per_adapter(tok.has_rollout.float()).tolist()
            loss_vals = loss_a.detach().tolist()
            if loss.tis is not None:  # (weights, applied, capped), each (N,)
                weight, applied, capped = loss.tis
                tis_sums = {
                    "tis_w": per_adapter(torch.where(applied, weight, torch.zeros_like(weight))).tolist(),
                    "tis_n": per_adapter(applied.float()).tolist(),
                    "tis_capped": per_adapter(capped.float()).tolist(),
                }
        for n, i in slot_of.items():
            sums.add(n, "loss", loss_vals[i])
            sums.add(n, "pg_loss", pg_a[i])
            sums.add(n, "kl", kl_a[i])
            sums.add(n, "entropy", ent_a[i])
            sums.add(n, "clipped", clip_a[i])
            sums.add(n, "tokens", ntok_a[i])
            if first_epoch:
                sums.add(n, "gap", gap_a[i])
                sums.add(n, "gap_tokens", gap_n_a[i])
                if loss.tis is not None:
                    for key, values in tis_sums.items():
                        sums.add(n, key, values[i])
        return nonfinite, backwarded

    def _step_adapter(self, name: str, skip: bool, grads: bool) -> tuple[bool, float | None]:
        """Clip, check and apply `name`'s accumulated grads; returns (stepped, pre-clip grad norm: None without
        grads). `grads`: whether any rank's backward reached the tenant (the same on every rank)."""
        tenant = self._tenants[name]
        if grads:  # the forward's grads are in the stacked tensors: view this slot's part
            self.model.attach_slot_grads(name, tenant.optim.params)
        grad_norm = self._ranks.grad_norm(tenant.optim.grads(), reached=grads)  # every rank, same tenant order
        return tenant.optim.step(grad_norm, skip)
