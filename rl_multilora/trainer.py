"""GRPO trainer for many LoRA adapters on one frozen base, one optimizer per tenant.

Design choices (and where they differ from a single-adapter GRPO trainer such as TRL's or verl's):

- Tenant isolation is the first invariant. Every aggregation is expressed as a per-token weight that depends only on
  the token's own adapter (token-mean: 1 / that adapter's token count in the whole batch; seq-mean-*: 1 / that
  adapter's row count, times 1 / the row's token count for token-mean rows). Each adapter's loss is therefore
  normalized over its own rows only, and its gradient does not depend on who else shares the batch or how the batch
  is cut into micro-batches. The adapters' normalized losses are summed and each micro-batch has one backward; since
  every adapter's parameters only see their own rows, the sum keeps the gradients separate.
- One AdamW and one LambdaLR per adapter, over `model.adapter_parameters(name)` only: leaf views of its own slot in
  the model's stacked LoRA tensors, so each tenant's optimizer is exactly the per-tenant AdamW it would be over
  separate tensors (same shapes, state and results) while the forward runs every slot in one grouped path. The
  backward accumulates into the stacked grads; before a tenant steps, its views' `.grad` are pointed at its slot's
  part (`attach_slot_grads`), and the stacked grads are dropped after each epoch. After the backward passes each
  adapter with rows checks its own grads for NaN/inf (skip and count, nobody else affected), clips its own grad norm
  and steps. Adapters with no rows are not touched at all: AdamW with weight decay would otherwise still move them,
  and their schedules and step counters would drift from the data they saw.
- Old log-probs are the trainer's own (not the rollout engine's): the forward of the first PPO epoch runs before any
  optimizer step, so its detached log-probs are exactly the "old" policy and no extra no-grad pass is needed. The
  rollout log-probs are only compared against them (`logprob_gap`) to expose train/inference mismatch.
- The KL reference is the base model: the same rows with every adapter switched off (`adapter_names=None` per row),
  under no_grad. No second model is kept.
- Forward passes run with the model in eval mode (dropout off) so that the old, new and reference log-probs come from
  the same deterministic function; autograd is unaffected. The previous mode is restored afterwards.
- Non-finite rewards or advantages are caught before the forward: that adapter's rows leave the batch and its step is
  skipped. Non-finite losses or grads produced by the model itself (e.g. a diverged adapter) are caught per adapter
  after the backward. A `train_step` takes up to `ppo_epochs` optimizer steps per adapter, never more than the
  adapter's remaining budget (`max_steps` argument), and reports how many it took (`AdapterStepStats.n_steps`); the
  tenant's step counter adds exactly that, so counter, budget and LR schedule count the same optimizer steps.
- One file (about 540 lines): the mixed-batch step (rows, token index, per-adapter weights, micro-batches, per-tenant
  clip/NaN/step) is one algorithm whose parts share private row types; GRPO's model-free math is in `grpo.py`.
- Over several ranks (a model sharded with FSDP2, `rl_multilora/backends/fsdp.py`) every rank gets the same samples
  and computes the same rows, advantages and per-tenant weights (normalized over the whole batch), then trains its
  own share of the rows (balanced by tokens) in the same number of micro-batches (a rank short of rows runs one at
  weight zero, so every collective is joined). The reduce-scatter sums the ranks' grads into the rank holding each
  slot; each tenant's grad norm is all-reduced in the same tenant order on every rank, so clipping and the NaN skip
  agree everywhere, and only the holding rank's optimizer has parameters (the others keep the schedule in step).
- Settings are the validated config sections as they are: `GRPOSettings` for the loss, each adapter's
  `OptimSettings` + lr + max_steps for its optimizer and schedule (`rl_multilora.config`); no twin types.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from rl_multilora.backends.base import AdapterStepStats
from rl_multilora.config import GRPOSettings, OptimSettings
from rl_multilora.errors import bad_value
from rl_multilora.grpo import adapter_name_of, compute_advantages, kl_penalty, lr_multiplier, policy_loss
from rl_multilora.losses import TenantAlgo, tis_weights, token_losses
from rollout.types import Sample, SampleStatus

if TYPE_CHECKING:
    from rl_multilora.lora import MultiLoRAModel

EXCLUDED_STATUSES = (SampleStatus.FAILED, SampleStatus.ABORTED)


@dataclass
class _Row:
    """One training row: prompt + response token ids and the loss positions inside it."""

    adapter: str
    input_ids: list[int]
    targets: list[int]  # positions (into input_ids) of the response tokens that carry loss
    advantage: float
    rollout_logprobs: list[float] | None  # aligned with `targets`


@dataclass
class _Tenant:
    slot: int  # the model slot the optimizer's parameters belong to (to catch a caller that re-slotted the name)
    optim_cfg: OptimSettings
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
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
        self._ranks = _Ranks.of(model)
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
        if not isinstance(optim, OptimSettings):
            raise TypeError(bad_value(f"{name}.optim", type(optim).__name__, "a rl_multilora.config.OptimSettings"))
        if not lr > 0.0:
            raise ValueError(bad_value(f"{name}.lr", lr, "a number > 0"))
        if optim.schedule == "cosine" and not (max_steps is not None and max_steps > optim.warmup_steps):
            # the same rule as config validation: fail here, at admission, never mid-run
            raise ValueError(bad_value(f"{name}.max_steps", max_steps, "an integer > warmup_steps with cosine"))
        params = list(self.model.adapter_parameters(name))
        for p in params:
            p.requires_grad_(True)
            p.grad = None
        # A rank that does not hold the slot keeps an optimizer over a placeholder, so its schedule stays in step.
        held = params or [torch.nn.Parameter(torch.zeros(0))]
        optimizer = torch.optim.AdamW(
            held, lr=lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(optim, max_steps))
        slot = self.model.adapters[name].slot
        self._tenants[name] = _Tenant(
            slot=slot, optim_cfg=optim, params=params, optimizer=optimizer, scheduler=scheduler, algo=algo
        )

    def remove_adapter(self, name: str) -> None:
        """Drop `name`'s optimizer, schedule and step counter (the model's slot is the caller's to free)."""
        tenant = self._tenant(name)
        for p in tenant.params:
            p.grad = None
        del self._tenants[name]

    @property
    def adapters(self) -> list[str]:
        return list(self._tenants)

    def adapter_step(self, name: str) -> int:
        """Optimizer steps `name` has taken, as its LR scheduler counts them (the tenant's counter must agree)."""
        return self._tenant(name).scheduler.last_epoch

    def adapter_lr(self, name: str) -> float:
        """The learning rate `name`'s next optimizer step will use."""
        return self._tenant(name).optimizer.param_groups[0]["lr"]

    def optimizer_state_dict(self, name: str) -> dict[str, Any]:
        """`name`'s optimizer and scheduler state, for checkpoints (the scheduler's `last_epoch` is its step count)."""
        tenant = self._tenant(name)
        return {"optimizer": tenant.optimizer.state_dict(), "scheduler": tenant.scheduler.state_dict()}

    def holds(self, name: str) -> bool:
        """Whether this rank holds `name`'s slot (always, unless the model is sharded over ranks)."""
        return bool(self._tenant(name).params)

    def load_optimizer_state_dict(self, name: str, state: dict[str, Any]) -> None:
        """Restore what `optimizer_state_dict` returned into `name` (added with the same OptimSettings). A rank that
        does not hold the slot (sharded model) takes the schedule and learning rate only."""
        tenant = self._tenant(name)
        missing = {"optimizer", "scheduler"} - set(state)
        if missing:
            raise ValueError(
                bad_value(f"optimizer state of {name!r}", sorted(state), f"keys including {sorted(missing)}")
            )
        if tenant.params:
            tenant.optimizer.load_state_dict(state["optimizer"])
        else:
            for group, saved in zip(tenant.optimizer.param_groups, state["optimizer"]["param_groups"], strict=True):
                group["lr"] = saved["lr"]
        tenant.scheduler.load_state_dict(state["scheduler"])

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
        stats: dict[str, AdapterStepStats] = {}
        live: list[Sample] = []
        for s in samples:
            name = adapter_name_of(s)
            self._check_slot(name)  # unknown or re-slotted adapters are a caller bug: fail before any work
            st = stats.setdefault(name, AdapterStepStats())
            current = (current_versions or {}).get(name)
            if s.status in EXCLUDED_STATUSES or not s.response_ids:
                st.excluded += 1
            elif current is not None and s.weight_version is not None and s.weight_version < current:
                st.stale += 1
            else:
                live.append(s)

        # A malformed sample (no reward, empty prompt, mismatched mask or log-probs: a hook's or a data bug) costs its
        # own adapter this step, with the reason in `error`; the other adapters train as if it were not there.
        made: dict[int, _Row | None] = {}  # id(sample) -> its row (built once; the advantage is set below)
        for s in live:
            st = stats[adapter_name_of(s)]
            if st.error is None:
                try:
                    if s.reward is None:
                        raise ValueError(
                            f"sample index={s.index} (group_index={s.group_index}) has reward=None: score every "
                            "sample before training"
                        )
                    made[id(s)] = _make_row(s)
                except ValueError as e:
                    st.error = str(e)
        live = [s for s in live if stats[adapter_name_of(s)].error is None]

        own = {n: t.algo.normalize_std for n, t in self._tenants.items() if t.algo is not None}
        adv = compute_advantages(live, self.cfg.normalize_std, self.cfg.drop_uniform_groups, normalize_std_of=own)
        for name, n in adv.dropped_groups.items():
            stats[name].dropped_groups = n

        rows: list[_Row] = []  # in the caller's order, so adapters stay interleaved across micro-batches
        for s, kept in zip(live, adv.kept, strict=True):
            if not kept:
                continue
            row = made[id(s)]
            if row is None:
                stats[adapter_name_of(s)].excluded += 1  # all-zero loss mask: nothing to learn from
            else:
                row.advantage = float(s.advantage)
                rows.append(row)

        # Non-finite rewards/advantages: the tenant's step is skipped before its rows can reach the forward.
        for name in {r.adapter for r in rows if not math.isfinite(r.advantage)}:
            stats[name].skipped_nonfinite = True
        rows = [r for r in rows if not stats[r.adapter].skipped_nonfinite]
        rows_by_adapter: dict[str, list[_Row]] = defaultdict(list)
        for r in rows:
            rows_by_adapter[r.adapter].append(r)

        for name, own in rows_by_adapter.items():
            stats[name].n_rows = len(own)
            stats[name].n_tokens = sum(len(r.targets) for r in own)
        for name, st in stats.items():
            st.lr = self.adapter_lr(name)
        if rows_by_adapter:
            was_training = self.model.training
            self.model.eval()  # dropout off: old, new and reference log-probs must be the same function
            try:
                self._optimize(rows, rows_by_adapter, stats, max_steps or {})
            finally:
                self.model.train(was_training)
        return stats

    def _optimize(
        self,
        order: list[_Row],
        rows_by_adapter: dict[str, list[_Row]],
        stats: dict[str, AdapterStepStats],
        max_steps: dict[str, int],
    ) -> None:
        """Run `ppo_epochs` passes over the rows, stepping each adapter after every pass (up to its `max_steps`)."""
        cache: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # id(row) -> (old_logp, ref_logp)
        weights = self._token_weights(rows_by_adapter)
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
            mine = shares[ranks.rank]
            mbs = self.cfg.micro_batch_size
            n_micro = max(-(-len(share) // mbs) for share in shares)  # the same count on every rank
            nonfinite_loss: set[str] = set()
            backwarded: set[str] = set()
            for i in range(n_micro):
                micro = mine[i * mbs : (i + 1) * mbs]
                if not micro:  # this rank is short of rows: join the collectives (same forwards) at weight zero
                    self._micro_step([rows[0]], {id(rows[0]): 0.0}, {}, _Sums(), first_epoch=epoch == 0, filler=True)
                    continue
                bad, good = self._micro_step(micro, weights, cache, sums, first_epoch=epoch == 0)
                nonfinite_loss |= bad
                backwarded |= good
            nonfinite_loss, backwarded = ranks.agree(sorted(active), nonfinite_loss, backwarded)
            for name in sorted({r.adapter for r in rows}):
                sums.add(name, "epochs", 1.0)
                lr = self.adapter_lr(name)
                tenant = self._tenants[name]
                if name in backwarded:  # the forward's grads are in the stacked tensors: view this slot's part
                    self.model.attach_slot_grads(name, tenant.params)
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
        ranks.sum_over_ranks(sums, sorted(rows_by_adapter), _RANK_SUMMED)
        for name in rows_by_adapter:
            st = stats[name]
            n_epochs = max(1.0, sums.get(name, "epochs"))
            for key in ("loss", "pg_loss", "kl", "entropy"):
                setattr(st, key, sums.get(name, key) / n_epochs)
            st.clip_frac = sums.get(name, "clipped") / max(1.0, sums.get(name, "tokens"))
            n_gap = sums.get(name, "gap_tokens")  # (summed over ranks below when sharded)
            st.logprob_gap = sums.get(name, "gap") / n_gap if n_gap > 0 else None
            n_tis = sums.get(name, "tis_n")
            if n_tis > 0:
                st.tis_weight_mean = sums.get(name, "tis_w") / n_tis
                st.tis_capped_frac = sums.get(name, "tis_capped") / n_tis

    def _token_weights(self, rows_by_adapter: dict[str, list[_Row]]) -> dict[int, float]:
        """Per-row weight of each of its tokens, so that sum(weight * token_loss) is that adapter's own aggregate."""
        weights: dict[int, float] = {}
        for name, rows in rows_by_adapter.items():
            algo = self._tenants[name].algo
            agg = self.cfg.loss_agg if algo is None else algo.loss_agg
            n_rows = len(rows)
            n_tokens = sum(len(r.targets) for r in rows)
            for r in rows:
                if agg == "token-mean":
                    weights[id(r)] = 1.0 / n_tokens
                elif agg == "seq-mean-token-mean":
                    weights[id(r)] = 1.0 / (n_rows * len(r.targets))
                elif agg == "seq-mean-token-sum-norm":  # Dr. GRPO: token sums over a constant (the budget)
                    weights[id(r)] = 1.0 / (n_rows * algo.norm_len)
                else:  # seq-mean-token-sum
                    weights[id(r)] = 1.0 / n_rows
        return weights

    def _forward_logp(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        adapter_names: list[str | None],
        tok: _TokenIndex,
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
        micro: list[_Row],
        weights: dict[int, float],
        cache: dict[int, tuple[torch.Tensor, torch.Tensor | None]],
        sums: _Sums,
        first_epoch: bool,
        filler: bool = False,
    ) -> tuple[set[str], set[str]]:
        """Forward + backward of one micro-batch; returns the adapters whose loss here was not finite, and those
        whose loss went into the backward. `filler`: a zero-weight stand-in on a rank short of rows, which runs the
        same forwards and backward as the other ranks (their FSDP collectives) and caches nothing."""
        device = next(self.model.parameters()).device
        names = sorted({r.adapter for r in micro})
        slot_of = {n: i for i, n in enumerate(names)}
        input_ids, attention_mask = _pad(micro, self.pad_token_id, device)  # (B, T), (B, T)
        tok = _TokenIndex.build(micro, slot_of, weights, device)
        adapter_names: list[str | None] = [r.adapter for r in micro]

        algos = [self._tenants[n].algo for n in names]
        custom = any(a is not None for a in algos)  # some tenant has its own loss / KL / clip / TIS / temperature
        temp_tok = kl_coef_tok = None
        if custom:
            per_name = [(a.temperature, a.kl_coef) if a else (self.temperature, self.cfg.kl_coef) for a in algos]
            temp_tok = torch.tensor([t for t, _ in per_name], dtype=torch.float32, device=device)[tok.adapter]  # (N,)
            kl_coef_tok = torch.tensor([k for _, k in per_name], dtype=torch.float32, device=device)[tok.adapter]
            need_ref = any(k > 0.0 for _, k in per_name)
        else:
            need_ref = self.cfg.kl_coef > 0.0
        if first_epoch and need_ref:
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
            splits_ref = ref_logp.split(tok.counts) if need_ref else [None] * len(micro)
            for r, o, f in zip(micro, splits_old, splits_ref, strict=True):
                cache[id(r)] = (o, f)
        else:
            old_logp = torch.cat([cache[id(r)][0] for r in micro])  # (N,)
            if need_ref:
                ref_logp = torch.cat([cache[id(r)][1] for r in micro])  # (N,)

        kl_tok = kl_penalty(logp, ref_logp, self.cfg.kl_type) if need_ref else torch.zeros_like(logp)  # (N,)
        ent_term = entropy if self.cfg.entropy_coef > 0.0 else entropy.detach()  # (N,)
        tis_w = None
        if custom:
            pg_tok, clipped, tis_w = self._tenant_policy_loss(names, algos, tok, logp, old_logp, len(micro))
            tok_loss = pg_tok + kl_coef_tok * kl_tok - self.cfg.entropy_coef * ent_term  # (N,)
        else:
            pg_tok, clipped = policy_loss(logp, old_logp, tok.advantage, self.cfg.eps_clip, self.cfg.eps_clip_high)
            tok_loss = pg_tok + self.cfg.kl_coef * kl_tok - self.cfg.entropy_coef * ent_term  # (N,)

        def per_adapter(values: torch.Tensor) -> torch.Tensor:
            # out[a] = sum_{i: adapter(i) = a} values[i]; values: (N,) -> (n_adapters,)
            return torch.zeros(len(names), device=device, dtype=values.dtype).index_add_(0, tok.adapter, values)

        loss_a = per_adapter(tok.weight * tok_loss)  # (n_adapters,)
        finite = torch.isfinite(loss_a)  # (n_adapters,)
        # Only finite terms enter the backward; a non-finite tenant is skipped by name below. Sharded, every rank
        # runs the backward even with nothing finite here: it holds the FSDP reduce-scatters the others wait in.
        if bool(finite.any()) or self._ranks.world > 1:
            loss_a[finite].sum().backward()
        finite_list = finite.tolist()
        nonfinite = {n for n, ok in zip(names, finite_list, strict=True) if not ok}
        backwarded = {n for n, ok in zip(names, finite_list, strict=True) if ok}

        with torch.no_grad():
            pg_a = per_adapter(tok.weight * pg_tok.detach()).tolist()
            kl_a = per_adapter(tok.weight * kl_tok.detach()).tolist()
            ent_a = per_adapter(tok.weight * entropy.detach()).tolist()
            clip_a = per_adapter(clipped.float()).tolist()
            ntok_a = per_adapter(torch.ones_like(logp)).tolist()
            gap = torch.where(tok.has_rollout, (tok.rollout_logp - old_logp).abs(), torch.zeros_like(old_logp))
            gap_a = per_adapter(gap).tolist()
            gap_n_a = per_adapter(tok.has_rollout.float()).tolist()
            loss_vals = loss_a.detach().tolist()
            if tis_w is not None:  # (weights, applied, capped), each (N,)
                weight, applied, capped = tis_w
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
                if tis_w is not None:
                    for key, values in tis_sums.items():
                        sums.add(n, key, values[i])
        return nonfinite, backwarded

    def _tenant_policy_loss(
        self,
        names: list[str],
        algos: list[TenantAlgo | None],
        tok: _TokenIndex,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        n_rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        """Per-token policy loss of a micro-batch where some tenants have their own algorithm: each tenant's tokens
        get its own surrogate and clip range (rl_multilora.losses), times its TIS weight when it asks for one.
        Returns (loss, clipped, TIS (weight, applied, capped) or None), all (N,)."""
        device = logp.device
        groups: dict[tuple[str, float, float], list[int]] = {}
        for i, a in enumerate(algos):
            key = (a.loss, a.eps_low, a.eps_high) if a else ("grpo", self.cfg.eps_clip, self.cfg.eps_clip_high)
            groups.setdefault(key, []).append(i)
        loss = torch.zeros_like(logp)
        clipped = torch.zeros_like(logp, dtype=torch.bool)
        for (kind, eps_low, eps_high), members in groups.items():
            sel = torch.isin(tok.adapter, torch.tensor(members, device=device)).nonzero().squeeze(1)  # (M,)
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

    def _step_adapter(self, name: str, skip: bool, grads: bool = True) -> tuple[bool, float | None]:
        """Check, clip and apply `name`'s accumulated grads; returns (stepped, pre-clip grad norm: None without
        grads). `grads`: whether any rank's backward reached the tenant (the same on every rank)."""
        tenant = self._tenants[name]
        params = [p for p in tenant.params if p.grad is not None]
        grad_norm: float | None = None
        if self._ranks.world > 1 and grads:  # every rank, same tenant order: the norm of its shards on all ranks
            grad_norm = self._ranks.norm([p.grad for p in params])
            max_norm = tenant.optim_cfg.max_grad_norm
            if max_norm is not None and not skip and math.isfinite(grad_norm):
                coef = min(1.0, max_norm / (grad_norm + 1e-6))  # clip_grad_norm_'s rule
                for p in params:
                    p.grad.mul_(coef)
        elif params and self._ranks.world == 1:
            max_norm = tenant.optim_cfg.max_grad_norm
            if max_norm is None or skip:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            else:
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            grad_norm = float(norm)
        ok = not skip and (grad_norm is None or math.isfinite(grad_norm))
        if ok:
            tenant.optimizer.step()
            tenant.scheduler.step()
        tenant.optimizer.zero_grad(set_to_none=True)
        return ok, grad_norm


_RANK_SUMMED = (
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


class _Ranks:
    """The trainer's view of the ranks a sharded model spans (world 1 for an unsharded one)."""

    def __init__(self, world: int, rank: int):
        self.world, self.rank = world, rank

    @classmethod
    def of(cls, model: MultiLoRAModel) -> _Ranks:
        import torch.distributed as dist

        sharded = any(getattr(p, "device_mesh", None) is not None for p in model.parameters())
        if not sharded or not dist.is_initialized():
            return cls(1, 0)
        return cls(dist.get_world_size(), dist.get_rank())

    def split(self, rows: list[_Row]) -> list[list[_Row]]:
        """Each rank's share of `rows`, balanced by tokens (each row to the rank with the fewest tokens so far),
        every share in the rows' order. The same on every rank."""
        if self.world == 1:
            return [rows]
        shares: list[list[_Row]] = [[] for _ in range(self.world)]
        load = [0] * self.world
        for r in rows:
            k = min(range(self.world), key=lambda i: (load[i], i))
            shares[k].append(r)
            load[k] += len(r.input_ids)
        return shares

    def _all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.tolist()

    def agree(self, names: list[str], bad: set[str], good: set[str]) -> tuple[set[str], set[str]]:
        """A tenant's loss is non-finite if it was on any rank, and it had a backward if it had one on any."""
        if self.world == 1 or not names:
            return bad, good
        flags = self._all_reduce([float(n in bad) for n in names] + [float(n in good) for n in names], "max")
        k = len(names)
        return {n for n, f in zip(names, flags[:k], strict=True) if f}, {
            n for n, f in zip(names, flags[k:], strict=True) if f
        }

    def norm(self, grads: list[torch.Tensor]) -> float:
        """The L2 norm over every rank's part of one tenant's grads (all ranks call it, in the same order)."""
        local = sum(float(g.double().pow(2).sum()) for g in grads)
        return math.sqrt(self._all_reduce([local])[0])

    def sum_over_ranks(self, sums: _Sums, names: list[str], keys: Sequence[str]) -> None:
        if self.world == 1 or not names:
            return
        flat = self._all_reduce([sums.get(n, k) for n in names for k in keys])
        for i, n in enumerate(names):
            for j, k in enumerate(keys):
                sums.values[n][k] = flat[i * len(keys) + j]


@dataclass
class _TokenIndex:
    """Flat per-loss-token tensors of one micro-batch, all (N,), tokens ordered row by row."""

    row: torch.Tensor  # row in the micro-batch
    pos: torch.Tensor  # position of the target token in the row
    target: torch.Tensor  # target token id
    adapter: torch.Tensor  # index into the micro-batch's sorted adapter names
    advantage: torch.Tensor
    weight: torch.Tensor  # aggregation weight (see MultiLoRATrainer._token_weights)
    rollout_logp: torch.Tensor
    has_rollout: torch.Tensor  # bool
    counts: list[int]  # tokens per row
    first_pos: int  # smallest target position (host-side, so slicing the logits needs no device sync)

    @staticmethod
    def build(micro: list[_Row], slot_of: dict[str, int], weights: dict[int, float], device) -> _TokenIndex:
        row, pos, target, adapter, advantage, weight, rollout, has_rollout, counts = ([] for _ in range(9))
        for b, r in enumerate(micro):
            n = len(r.targets)
            counts.append(n)
            row += [b] * n
            pos += r.targets
            target += [r.input_ids[t] for t in r.targets]
            adapter += [slot_of[r.adapter]] * n
            advantage += [r.advantage] * n
            weight += [weights[id(r)]] * n
            rollout += r.rollout_logprobs if r.rollout_logprobs is not None else [0.0] * n
            has_rollout += [r.rollout_logprobs is not None] * n

        def long(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=device)

        def flt(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.float32, device=device)

        return _TokenIndex(
            row=long(row),
            pos=long(pos),
            target=long(target),
            adapter=long(adapter),
            advantage=flt(advantage),
            weight=flt(weight),
            rollout_logp=flt(rollout),
            has_rollout=torch.tensor(has_rollout, dtype=torch.bool, device=device),
            counts=counts,
            first_pos=min(pos),
        )


def _make_row(s: Sample) -> _Row | None:
    """The training row of a finished sample, or None when no response token carries loss."""
    name = adapter_name_of(s)
    where = f"sample index={s.index} of adapter {name!r}"
    n_resp = len(s.response_ids)
    if not s.prompt_ids:
        raise ValueError(f"{where}: prompt_ids is empty; the first response token needs a prompt to be predicted from")
    mask = s.loss_mask if s.loss_mask else [1] * n_resp
    if len(mask) != n_resp:
        raise ValueError(f"{where}: loss_mask has {len(mask)} entries, response_ids has {n_resp}; they must match")
    if s.rollout_logprobs and len(s.rollout_logprobs) != n_resp:
        raise ValueError(
            f"{where}: rollout_logprobs has {len(s.rollout_logprobs)} entries, response_ids has {n_resp}; "
            "they must match (or be empty)"
        )
    start = len(s.prompt_ids)
    keep = [j for j, m in enumerate(mask) if m]
    if not keep:
        return None
    rollout = [float(s.rollout_logprobs[j]) for j in keep] if s.rollout_logprobs else None
    return _Row(
        adapter=name,
        input_ids=list(s.prompt_ids) + list(s.response_ids),
        targets=[start + j for j in keep],
        advantage=float(s.advantage),
        rollout_logprobs=rollout,
    )


def _pad(rows: list[_Row], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad rows into (B, T) input ids and a (B, T) attention mask."""
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long, device=device)  # (B, T)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)  # (B, T)
    for b, r in enumerate(rows):
        ids[b, : len(r.input_ids)] = torch.tensor(r.input_ids, dtype=torch.long, device=device)
        mask[b, : len(r.input_ids)] = 1
    return ids, mask


def _lr_lambda(optim: OptimSettings, total_steps: int | None) -> Callable[[int], float]:
    def fn(step: int) -> float:
        return lr_multiplier(step, optim, total_steps)

    return fn
