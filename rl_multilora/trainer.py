"""GRPO as a client of the backend's operations: one GRPO step = build each tenant's rows from its samples, then
`forward_backward` over micro-batches and `optim_step` for every tenant that trained, for each PPO epoch.

- `rl_multilora.batch`: samples -> rows (exclusions, stale versions, dropped groups), each adapter's per-token
  weights (its loss normalized over its own rows), micro-batches.
- `rl_multilora.train_ops`: the primitives (`forward_backward`, `optim_step`) and the one tenant record, which the
  Tinker server (`rl_multilora.tinker.ops`) calls too; the loss is the registry's (`rl_multilora.losses`).
- `rl_multilora.ranks`: the rank coordinator (rows per rank, the all-reduced norms, flags and sums; world 1 alone).

Design choices (each part's own are in its module):

- Old log-probs are the trainer's own (not the rollout engine's): the forward of the first PPO epoch runs before any
  optimizer step, so its detached log-probs are exactly the "old" policy and no extra no-grad pass is needed; later
  epochs hand them back as each row's `old_logprobs`. The rollout log-probs are only compared against them
  (`logprob_gap`) to expose train/inference mismatch, and weigh the loss for tenants with TIS.
- The KL reference is the base model: the same rows with every adapter switched off, under no_grad, in the first
  epoch only (`want_ref`; kept on each row as `ref_logprobs`).
- Non-finite rewards or advantages are caught before the forward (the batch builder); non-finite losses or grads
  produced by the model itself (e.g. a diverged adapter) are caught per adapter: only finite adapters' losses enter
  the backward, and the tenant's step is skipped. After each epoch every adapter with rows steps (or skips) on its
  own.
- A `train_step` takes up to `ppo_epochs` optimizer steps per adapter, never more than the adapter's remaining budget
  (`max_steps` argument), and reports how many it took (`AdapterStepStats.n_steps`); the tenant's step counter adds
  exactly that, so counter, budget and LR schedule count the same optimizer steps.
- Settings are the validated config sections as they are: `GRPOSettings` for the loss, each adapter's
  `OptimSettings` + lr + max_steps for its optimizer and schedule (`rl_multilora.config`); no twin types.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rl_multilora.batch import AdapterStepStats, Batch, build_batch, micro_batches, token_weights
from rl_multilora.config import GRPOSettings, OptimSettings
from rl_multilora.grpo import TokenSettings, adapter_name_of
from rl_multilora.losses import TenantAlgo
from rl_multilora.tenant_store import TenantStore
from rl_multilora.train_ops import SUM_KEYS, TrainOps
from rollout.types import Sample

if TYPE_CHECKING:
    from rl_multilora.lora import MultiLoRAModel

FIRST_EPOCH_ONLY = ("gap", "gap_tokens", "tis_w", "tis_n", "tis_capped")  # about the rollout: counted once


class _Sums:
    """Per-adapter running sums over micro-batches and epochs (plain floats: they are only reported)."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def add(self, name: str, key: str, value: float) -> None:
        self.values[name][key] += value

    def get(self, name: str, key: str) -> float:
        return self.values[name][key]


class MultiLoRATrainer:
    """GRPO over a `MultiLoRAModel`: one mixed batch, one AdamW + LR schedule + step counter per adapter, all through
    the per-tenant primitives of `ops` (made here unless a backend shares its own with the Tinker door)."""

    def __init__(
        self,
        model: MultiLoRAModel,
        cfg: GRPOSettings,
        pad_token_id: int,
        temperature: float = 1.0,
        norm_len: int | None = None,
        ops: TrainOps | None = None,
        store: TenantStore | None = None,
    ):
        """`temperature`: the rollouts' sampling temperature; logits are divided by it before the softmax, so the
        trainer's log-probs are those of the distribution the engine sampled from (pass 1.0 for greedy rollouts).
        A tenant with its own algorithm (`add_adapter(..., algo=)`) has its own temperature, loss, KL, clip and TIS.
        `norm_len`: unused by the run's own losses; kept for tenants' dr_grpo (their `TenantAlgo.norm_len`).
        `store`: the host tenant store when there are more tenants than slots (`rl_multilora.tenant_store`)."""
        self.ops = ops if ops is not None else TrainOps(model, cfg, pad_token_id, temperature, store=store)
        self.model = model
        self.cfg = cfg
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        self.norm_len = norm_len

    # ----- tenants -----

    def add_adapter(
        self, name: str, optim: OptimSettings, lr: float, max_steps: int | None = None, algo: TenantAlgo | None = None
    ) -> None:
        """Create `name`'s AdamW (over its own slot's parameters only) and LR schedule; the model must hold it.

        `lr` is the peak learning rate and `max_steps` the adapter's budget in optimizer steps (what a cosine
        schedule decays over), both as in the adapter's config.
        """
        self.ops.add_tenant(name, optim, lr, max_steps, algo)

    def remove_adapter(self, name: str) -> None:
        """Drop `name`'s optimizer, schedule and step counter (the model's slot is the caller's to free)."""
        self.ops.remove_tenant(name)

    @property
    def adapters(self) -> list[str]:
        return list(self.ops.tenants)

    def adapter_step(self, name: str) -> int:
        """Optimizer steps `name` has taken, as its LR scheduler counts them (the tenant's counter must agree)."""
        return self.ops.tenant(name).optim.step_count

    def adapter_lr(self, name: str) -> float:
        """The learning rate `name`'s next optimizer step will use."""
        return self.ops.tenant(name).optim.lr

    def optimizer_state_dict(self, name: str) -> dict[str, Any]:
        """`name`'s optimizer and scheduler state, for checkpoints (the scheduler's `last_epoch` is its step count)."""
        return self.ops.optimizer_state_dict(name)

    def holds(self, name: str) -> bool:
        """Whether this rank holds `name`'s slot (always, unless the model is sharded over ranks)."""
        return self.ops.tenant(name).optim.holds

    def load_optimizer_state_dict(self, name: str, state: dict[str, Any]) -> None:
        """Restore what `optimizer_state_dict` returned into `name` (added with the same OptimSettings). A rank that
        does not hold the slot (sharded model) takes the schedule and learning rate only."""
        self.ops.load_optimizer_state_dict(name, state)

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
        names = {adapter_name_of(s) for s in samples}
        for name in sorted(names):
            self.ops.tenant(name)  # unknown adapters are a caller bug: fail first
        self.ops.ensure_resident(names)  # paging: the step's tenants stay in their slots for all its epochs
        for name in names:
            self.ops.check_slot(name)  # re-slotted adapters are a caller bug too
        tenants = self.ops.tenants
        own = {n: t.algo.normalize_std for n, t in tenants.items() if t.algo is not None}
        batch = build_batch(
            samples, current_versions, self.cfg.normalize_std, self.cfg.drop_uniform_groups, normalize_std_of=own
        )
        for name, st in batch.stats.items():
            st.lr = self.adapter_lr(name)
        if batch.by_adapter:
            self._optimize(batch, max_steps or {})
        return batch.stats

    def _optimize(self, batch: Batch, max_steps: dict[str, int]) -> None:
        """Run `ppo_epochs` passes over the rows, stepping each adapter after every pass (up to its `max_steps`)."""
        order, rows_by_adapter, stats = batch.rows, batch.by_adapter, batch.stats
        algos = {n: t.algo for n, t in self.ops.tenants.items()}
        weights = token_weights(rows_by_adapter, self.cfg.loss_agg, algos)
        # Reference log-probs are computed in the first epoch for every row when any tenant of the step has KL: a
        # tenant leaving after an epoch re-cuts the micro-batches, so a row can meet a KL tenant's rows only later.
        # One flag for the step also keeps every rank's count of forwards the same (FSDP collectives).
        step_ref = TokenSettings.needs_ref([algos[n] for n in rows_by_adapter], self.cfg)
        sums = _Sums()
        active = set(rows_by_adapter)
        ranks = self.ops.ranks
        # Each row stays on one rank for every epoch: its old and reference log-probs are kept where it ran first.
        assigned = ranks.split(order)
        for epoch in range(self.cfg.ppo_epochs):
            rows = [r for r in order if r.adapter in active]  # every rank: the same rows, in the same order
            if not rows:
                break
            shares = [[r for r in share if r.adapter in active] for share in assigned]
            # sharded: the reduce-scatter brings this rank grads of rows the others ran, whatever its own rows are
            collect = sorted(active) if ranks.world > 1 else None
            nonfinite_loss: set[str] = set()
            backwarded: set[str] = set()
            for micro in micro_batches(shares, ranks.rank, self.cfg.micro_batch_size, self.cfg.share_prompts):
                if not micro:  # this rank is short of rows: join the collectives (same forwards) at weight zero
                    filler = rows[0]  # and keep what the reduce-scatter brings every slot held here (`collect`)
                    self.ops.forward_backward(
                        [filler], {id(filler): 0.0}, want_ref=epoch == 0 and step_ref, filler=True, collect=collect
                    )
                    continue
                out = self.ops.forward_backward(micro, weights, want_ref=epoch == 0 and step_ref, collect=collect)
                if epoch == 0:  # the policy before any step, and the base: what later epochs compare against
                    refs = out.ref_logprobs or [None] * len(micro)
                    for r, old, ref in zip(micro, out.logprobs, refs, strict=True):
                        r.old_logprobs, r.ref_logprobs = old, ref
                for name, values in out.sums.items():
                    for key in SUM_KEYS:
                        if key in values and (epoch == 0 or key not in FIRST_EPOCH_ONLY):
                            sums.add(name, key, values[key])
                nonfinite_loss |= out.nonfinite
                backwarded |= out.backwarded
            nonfinite_loss, backwarded = ranks.agree(sorted(active), nonfinite_loss, backwarded)
            for name in sorted({r.adapter for r in rows}):
                sums.add(name, "epochs", 1.0)
                lr = self.adapter_lr(name)
                stepped, grad_norm = self.ops.optim_step(name, skip=name in nonfinite_loss, reached=name in backwarded)
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
        for r in order:  # the rows are the caller's batch: leave no tensors on them
            r.old_logprobs = r.ref_logprobs = None
        names = sorted(rows_by_adapter)
        summed = ranks.sum_floats([sums.get(n, k) for n in names for k in SUM_KEYS])
        for i, n in enumerate(names):
            for j, k in enumerate(SUM_KEYS):
                sums.values[n][k] = summed[i * len(SUM_KEYS) + j]
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
