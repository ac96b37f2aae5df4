"""The backend's operations, per tenant: the Tinker primitives that both front doors call, on the multi-LoRA model
of this process (this rank's shard of it on a sharded model).

- `forward_backward(rows, ...)`: one mixed micro-batch of several tenants' rows. One forward routed by each row's
  adapter; each token's loss under its own tenant's settings (the loss registry, `rl_multilora.losses`, through
  `rl_multilora.grpo.token_loss`); one backward of the finite tenants' summed losses. Right after it each tenant's
  part of the stacked LoRA grads is added into the tenant's own buffer and the stacked grads are dropped, so a
  tenant's gradient accumulates across calls (micro-batches, a client's several requests) until its own
  `optim_step`, and no other call (another tenant's step, a GRPO step between a client's requests) can touch it.
  Returns each row's log-probs (and the base model's, when asked) and each tenant's loss sums.
- `optim_step(name, ...)`: clips the tenant's accumulated gradient by its norm over every rank, skips the step when
  the norm or the loss was not finite (the adapter stays bit-identical), steps its AdamW and empties its buffer.
  `adam` (a Tinker client's `AdamParams`) sets this step's learning rate and Adam settings; without it the
  tenant's own LR schedule applies (a GRPO tenant). A client's step that left the adapter non-finite is undone.
- One tenant record (`TenantTrainState`) for both kinds of tenant: its slot, optimizer + schedule + step count
  (`rl_multilora.tenant_optim.TenantOptimizer`), loss settings (`TenantAlgo`; None = the run's `grpo` section) and
  gradient buffer. `rl_multilora.trainer` (GRPO) and `rl_multilora.tinker.ops` (the Tinker API) are its clients.
- Paging (`store`, more tenants than slots): a tenant without a slot waits in the host `TenantStore` with its
  optimizer's moments (`rl_multilora.tenant_store`); `ensure_resident` pages in the tenants an operation needs,
  evicting the least recently used others. Every primitive pages its tenants in first, so callers never see it;
  `TenantTrainState.slot` is -1 while a tenant is paged out.

Forwards run with the model in eval mode (dropout off) so that old, new and reference log-probs come from the same
deterministic function; autograd is unaffected. Log-probs of half-precision models are computed in float32.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from rl_multilora.config import GRPOSettings, OptimSettings
from rl_multilora.errors import bad_value
from rl_multilora.grpo import TokenSettings, per_adapter_sum, token_loss
from rl_multilora.losses import TenantAlgo
from rl_multilora.packing import ForwardInputs, pack, packable, pair_cost
from rl_multilora.ranks import RankCoordinator
from rl_multilora.rows import Row, TokenIndex, pad
from rl_multilora.saved_activations import recompute_elementwise
from rl_multilora.tenant_optim import AdamSettings, TenantOptimizer
from rl_multilora.tenant_store import PagedTenant, TenantStore
from rl_multilora.token_logprobs import token_logp_entropy

if TYPE_CHECKING:
    from rl_multilora.lora import MultiLoRAModel

# What `forward_backward` sums per tenant (reported; the GRPO client adds them over micro-batches and ranks).
SUM_KEYS = (
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
class TenantTrainState:
    """One tenant on the trainer side, whichever door drives it."""

    slot: int  # the model slot its optimizer's parameters belong to (-1: paged out to the tenant store)
    optim: TenantOptimizer
    algo: TenantAlgo | None = None  # its own loss settings; None: the run's GRPOSettings
    grads: list[torch.Tensor | None] | None = None  # accumulated since its last optim_step, `optim.params` order
    nonfinite: bool = False  # some forward_backward since its last optim_step had a non-finite loss of it


@dataclass
class FwdBwdOut:
    """What one `forward_backward` computed."""

    logprobs: list[torch.Tensor]  # per row, (n_targets,), detached: each target token's log-prob
    ref_logprobs: list[torch.Tensor] | None  # per row, the base model's (`want_ref`)
    row_loss: list[float]  # per row, sum over its tokens of weight * loss
    sums: dict[str, dict[str, float]] = field(default_factory=dict)  # per tenant, SUM_KEYS
    nonfinite: set[str] = field(default_factory=set)  # tenants whose loss here was not finite (left out)
    backwarded: set[str] = field(default_factory=set)  # tenants whose loss went into the backward


def pick_states(hidden: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`hidden[rows, positions]`: (P, W, H) -> (N, H), with a backward that sums in a fixed order (hidden states, or
    a model's logits where it has no separate output head).

    A group's samples share their prompt's last state, so the backward sums several tokens' gradients into one
    state. Advanced indexing's backward (`index_put_` with accumulate) adds them on CPU with atomic adds across
    threads, in an order that changed from run to run: two-thread runs of the SmolLM2 example differed in the last
    bits of their gradients, and now and then in a sampled token later. `index_select`'s backward (`index_add_`)
    sums them in index order: the same bits every time, and the same values forward."""
    flat = hidden.reshape(-1, hidden.shape[-1])  # (P * W, H)
    return flat.index_select(0, rows * hidden.shape[1] + positions)


class TrainOps:
    """The per-tenant primitives over one `MultiLoRAModel` (see the module docstring)."""

    def __init__(
        self,
        model: MultiLoRAModel,
        cfg: GRPOSettings,
        pad_token_id: int,
        temperature: float = 1.0,
        store: TenantStore | None = None,
    ):
        """`cfg`: the loss settings of tenants without their own (`TenantAlgo`); `temperature`: theirs too (the
        rollouts' sampling temperature: logits are divided by it, so log-probs are those the engine sampled from).
        `store`: where tenants without a slot wait (paging on; None: every tenant holds a slot)."""
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
        self.tenants: dict[str, TenantTrainState] = {}
        self.ranks = RankCoordinator.of(model)
        self.store = store
        self._resident: OrderedDict[str, None] = OrderedDict()  # tenants in a slot, least recently used first
        self._peft_configs: dict[str, tuple[tuple, dict[str, Any]]] = {}  # paging: per tenant, see _peft_config
        # called with every tensor a training forward keeps for its backward as it is (a memory probe's; None: none)
        self.saved_observer = None
        # shared-prompt packing: a group packs only where that is estimated cheaper (rl_multilora.packing; 0: always)
        self.pair_cost = pair_cost(model.base_model.config)
        if store is not None and self.ranks.world > 1:
            raise ValueError(bad_value("store", "a TenantStore", "None on a model sharded over ranks"))
        if self.ranks.world == 1:  # sharded, the reduce-scatter needs the stacked grads
            model.use_slot_grads()  # a backward allocates gradients for the slots that hold rows only

    # ----- tenants -----

    def add_tenant(
        self, name: str, optim: OptimSettings, lr: float, max_steps: int | None = None, algo: TenantAlgo | None = None
    ) -> None:
        """Create `name`'s AdamW (over its own slot's parameters only) and LR schedule; the model must hold it.
        `lr` is the peak learning rate, `max_steps` the budget in optimizer steps (what a cosine schedule decays
        over)."""
        if name in self.tenants:
            raise ValueError(
                bad_value("name", name, "a new adapter; it already has an optimizer (remove_adapter it first)")
            )
        if name not in self.model.adapters:
            raise ValueError(bad_value("name", name, f"an adapter of the model ({sorted(self.model.adapters)})"))
        optimizer = TenantOptimizer(name, self.model.adapter_parameters(name, true_rank=True), optim, lr, max_steps)
        self.tenants[name] = TenantTrainState(slot=self.model.adapters[name].slot, optim=optimizer, algo=algo)
        self._resident[name] = None

    def remove_tenant(self, name: str) -> None:
        """Drop `name`'s optimizer, schedule, step counter and gradient buffer (its slot is the caller's to free; a
        paged-out tenant's stored state goes here)."""
        self.tenant(name).optim.drop_grads()
        if self.store is not None and name in self.store:
            self.store.drop(name)
        self._resident.pop(name, None)
        self._peft_configs.pop(name, None)
        del self.tenants[name]

    # ----- paging (more tenants than slots) -----

    def is_resident(self, name: str) -> bool:
        return self.tenant(name).slot >= 0

    @property
    def resident(self) -> list[str]:
        """Tenants in a slot, least recently used first."""
        return list(self._resident)

    def make_room(self, keep: Collection[str] = ()) -> None:
        """With paging, free a model slot when none is: page out the least recently used resident tenant not in
        `keep`. Without paging nothing happens (the model's own "no free slot" error says why)."""
        if self.store is None or self.model.free_slots:
            return
        self._page_out(self._victims(1, keep))

    def _victims(self, n: int, keep: Collection[str]) -> list[str]:
        """The `n` least recently used resident tenants not in `keep`."""
        victims = [name for name in self._resident if name not in keep][:n]
        if len(victims) < n:
            raise RuntimeError(
                f"no LoRA slot to page a tenant into: all model.max_loras={self.model.max_loras} slots hold tenants "
                f"this operation needs ({sorted(keep)}); give one call at most max_loras tenants"
            )
        return victims

    def ensure_resident(self, names: Iterable[str]) -> None:
        """Page every tenant of `names` into a slot (evicting least recently used others) and mark them the most
        recently used. A no-op without paging."""
        if self.store is None:
            return
        wanted = sorted(set(names))
        if len(wanted) > self.model.max_loras:
            raise RuntimeError(
                f"{len(wanted)} tenants need a slot at once but model.max_loras is {self.model.max_loras}; a step or "
                "call may hold at most max_loras tenants (the scheduler and LocalBackend.forward_backward split them)"
            )
        for name in wanted:
            if self.is_resident(name):
                self._resident.move_to_end(name)
        missing = [name for name in wanted if not self.is_resident(name)]
        if missing:
            self._page_in(missing, keep=wanted)

    def page_out(self, name: str) -> None:
        """Move `name`'s slot (true rank), AdamW moments and pending gradient to the store; free its slot."""
        self._page_out([name])

    def page_in(self, name: str, keep: Collection[str] = ()) -> None:
        """Bring `name` back into a free slot (made by evicting a tenant not in `keep`), bit for bit as it left."""
        self._page_in([name], keep)

    def _page_out(self, names: list[str]) -> None:
        """`page_out` of several tenants at once: their slots leave in one gather per stacked tensor
        (`MultiLoRAModel.take_adapters`); their moments are handed over as the optimizer held them (no copy) when
        they are host tensors at the true rank already."""
        assert self.store is not None
        t0 = time.perf_counter()
        infos = [self.model.adapters[n] for n in names]
        modules = [self.model.adapter_modules(n) for n in names]
        configs = [
            self._peft_config(n, info.rank, info.alpha, m) for n, info, m in zip(names, infos, modules, strict=True)
        ]
        weights = self.model.take_adapters(names)
        on_host = self.model.lora_device.type == "cpu"
        for name, info, covered, config, flat in zip(names, infos, modules, configs, weights, strict=True):
            t = self.tenant(name)
            states = t.optim.release()  # moments at the true rank, the shapes of its parameters
            if on_host:
                moments = states  # kept as the optimizer held them, no copy
            else:
                moments = [{k: _host(v) if v.dim() > 0 else v for k, v in state.items()} for state in states]
            grads = None if t.grads is None else [None if g is None else _owned_host(g) for g in t.grads]
            paged = PagedTenant(info.rank, info.alpha, covered, flat, moments, grads)
            paged.peft_config = config  # a sync may push it from here (`paged_state_dict`)
            t.slot, t.grads = -1, None
            del self._resident[name]
            self.store.put(name, paged)
        self.store.stats.page_outs += len(names)
        self.store.stats.page_out_s += time.perf_counter() - t0

    def _peft_config(self, name: str, rank: int, alpha: float, modules: frozenset[str]) -> dict[str, Any]:
        """`model.peft_config(name)` (the tenant must be resident), made once per rank, alpha and modules of the
        tenant (a LoraConfig takes as long as a page-out's copies on the tiny preset)."""
        key = (rank, alpha, modules)
        cached = self._peft_configs.get(name)
        if cached is None or cached[0] != key:
            cached = self._peft_configs[name] = (key, self.model.peft_config(name))
        return cached[1]

    def _page_in(self, names: list[str], keep: Collection[str] = ()) -> None:
        """`page_in` of several tenants at once: the least recently used others not in `keep` make room (one batched
        page-out), then the tenants' slots are written in one scatter per stacked tensor
        (`MultiLoRAModel.place_adapters`). The time counted includes the eviction."""
        assert self.store is not None
        t0 = time.perf_counter()
        short = len(names) - len(self.model.free_slots)
        victims = self._victims(short, {*keep, *names}) if short > 0 else []
        # taken before the victims are put: the store's host bytes dip, then come back, instead of going over the
        # budget by a step's tenants and spilling as many idle ones to disk every step
        pageds: list[PagedTenant] = []
        try:
            for name in names:
                pageds.append(self._prepare(self.store.take(name)))  # a no-op for a prefetched tenant
            if victims:
                self._page_out(victims)
            slots = self.model.place_adapters(
                [(n, p.rank, p.alpha, p.modules, p.weights) for n, p in zip(names, pageds, strict=True)]
            )
        except BaseException:  # what was taken goes back: a tenant is never lost between the store and a slot
            for name, paged in zip(names, pageds, strict=False):
                if name not in self.model.adapters:
                    self.store.put_back(name, paged)
            raise
        stats = self.store.stats
        for name, paged, slot in zip(names, pageds, slots, strict=True):
            t = self.tenant(name)
            t.slot = slot
            t.optim.attach(self.model.slot_parameters(name), paged.moments)
            t.grads = paged.grads
            self._resident[name] = None
            stats.by_tenant[name] = stats.by_tenant.get(name, 0) + 1
        stats.page_ins += len(names)
        stats.page_in_s += time.perf_counter() - t0

    def prefetch(self, names: Iterable[str]) -> list[str]:
        """Prepare the paged-out tenants of `names` for their page-in, in the store's background thread (see
        `TenantStore.stage`): what a step's page-in then does is the slot copy. Returns those staged now."""
        if self.store is None:
            return []
        out = [n for n in names if n in self.tenants and not self.is_resident(n)]
        return self.store.stage(out[: self.model.max_loras], self._prepare)

    def _prepare(self, paged: PagedTenant) -> PagedTenant:
        """What a page-in puts into a slot and its optimizer, from a stored tenant: weights, gradient and moments
        on the slots' device (moments and gradient at the true rank, the shapes of the tenant's parameters; a step
        count stays where AdamW keeps it). Runs in the prefetch thread too: it reads only `paged` and the model's
        fixed shapes, never a slot. On a host model with nothing spilled it has nothing to do."""
        if paged.prepared:
            return paged
        device = self.model.lora_device
        if paged.weights.device != device:  # a page-out keeps all of a tenant's tensors on one device
            paged.weights = paged.weights.to(device)
            paged.moments = [{k: v.to(device) if v.dim() > 0 else v for k, v in st.items()} for st in paged.moments]
            paged.grads = None if paged.grads is None else [None if g is None else g.to(device) for g in paged.grads]
        paged.prepared = True
        return paged

    def paged_state_dict(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """A paged-out tenant's PEFT tensors (true rank) and adapter_config.json content, read from the store
        without paging it in: what a weight sync pushes for a changed adapter that was evicted before the sync."""
        assert self.store is not None
        paged = self.store.peek(name)
        return peft_tensors(self.model, paged), dict(paged.peft_config)

    def tenant(self, name: str) -> TenantTrainState:
        if name not in self.tenants:
            raise KeyError(bad_value("adapter", name, f"an adapter with an optimizer ({sorted(self.tenants)})"))
        return self.tenants[name]

    def check_slot(self, name: str) -> None:
        """The tenant still sits in the slot its optimizer was made for: stepping it after the model re-slotted the
        name (or gave the slot to another tenant) would move someone else's weights."""
        tenant = self.tenant(name)
        info = self.model.adapters.get(name)
        if info is None or info.slot != tenant.slot:
            now = "is no longer in the model" if info is None else f"now sits in slot {info.slot}"
            raise RuntimeError(
                f"adapter {name!r} had slot {tenant.slot} when its optimizer was created but {now}; "
                "call trainer.remove_adapter and trainer.add_adapter after changing the model's adapters"
            )

    # ----- the primitives -----

    def forward_backward(
        self,
        rows: Sequence[Row],
        weights: Mapping[int, float] | None = None,
        *,
        want_ref: bool = False,
        backward: bool = True,
        filler: bool = False,
        algos: Mapping[str, TenantAlgo] | None = None,
        collect: Sequence[str] | None = None,
    ) -> FwdBwdOut:
        """Forward + backward of one mixed micro-batch (see the module docstring).

        `weights`: id(row) -> the aggregation weight of each of its tokens (None: 1, token sums). A row's old
        log-probs are its `old_logprobs` when given, else this forward's own (detached: the policy before any step);
        its reference log-probs (KL) its `ref_logprobs`, or the base model's forward when `want_ref`. `backward`
        False: a forward only (no graph, no gradient). `filler`: a zero-weight stand-in on a rank short of rows,
        which runs the same forwards and backward as the other ranks (their FSDP collectives). `algos`: this call's
        loss per tenant (a Tinker client's `loss_fn`), instead of the tenant's own settings. `collect`: the tenants
        whose slot gradients to keep after the backward (default: those whose loss went into it); on a sharded model
        the reduce-scatter hands this rank gradients of rows other ranks ran, so the GRPO client names every tenant
        of the step on every rank, filler calls included."""
        self.ensure_resident(r.adapter for r in rows)
        for name in {r.adapter for r in rows}:
            self.check_slot(name)
        self.model.eval()  # never flipped back: an engine sharing the base may be generating (async runs)
        device = next(self.model.parameters()).device
        names = sorted({r.adapter for r in rows})
        slot_of = {n: i for i, n in enumerate(names)}
        tok = TokenIndex.build(rows, slot_of, weights, device)
        adapter_names: list[str | None] = [r.adapter for r in rows]
        inputs = self._inputs(rows, tok, device)
        own = [(algos or {}).get(n, self.tenants[n].algo) for n in names]
        settings = TokenSettings.of(own, self.cfg, self.temperature, tok.adapter)
        need_ref, temp_tok = settings.need_ref, settings.temperature

        ref_logp = None
        if want_ref:
            with torch.no_grad():
                ref_logp, _ = self._forward_logp(inputs, [None] * len(rows), tok, temp_tok)  # (N,)
        with torch.set_grad_enabled(backward):
            logp, entropy = self._forward_logp(inputs, adapter_names, tok, temp_tok)  # (N,), (N,)
        if tok.given_old is None or filler:
            old_logp = logp.detach()  # no optimizer step since this forward's weights: it IS the old policy
        elif tok.has_old is None:
            old_logp = tok.given_old
        else:  # some rows bring their sampler's log-probs, the others use this forward's
            old_logp = torch.where(tok.has_old, tok.given_old.to(logp.dtype), logp.detach())
        if need_ref and ref_logp is None:
            given = [r.ref_logprobs for r in rows]
            ref_logp = torch.cat(given) if not filler and all(g is not None for g in given) else logp.detach()
        out_ref = ref_logp
        if not need_ref:
            ref_logp = None  # no token here has a KL term (a 0 * inf term would still be NaN)
        loss = token_loss(self.cfg, settings, tok, logp, old_logp, ref_logp, entropy, len(rows))

        def per_adapter(values: torch.Tensor) -> torch.Tensor:
            return per_adapter_sum(values, tok.adapter, len(names))  # (N,) -> (n_adapters,)

        weighted = tok.weight * loss.total  # (N,)
        loss_a = per_adapter(weighted)  # (n_adapters,)
        finite = torch.isfinite(loss_a)  # (n_adapters,)
        # Only finite terms enter the backward; a non-finite tenant is reported by name. Sharded, every rank runs the
        # backward even with nothing finite here: it holds the FSDP reduce-scatters the others wait in.
        finite_list = finite.tolist()
        backwarded = {n for n, ok in zip(names, finite_list, strict=True) if ok} if backward else set()
        for n in names:
            if backward and not finite_list[slot_of[n]]:
                self.tenants[n].nonfinite = True  # its optim_step is skipped: the adapter stays as it was
        if backward and (bool(finite.any()) or self.ranks.world > 1):
            loss_a[finite].sum().backward()
            self._take_grads(set(collect) if collect is not None else backwarded)

        with torch.no_grad():
            sums_a = {
                "loss": loss_a.detach(),
                "pg_loss": per_adapter(tok.weight * loss.pg.detach()),
                "kl": per_adapter(tok.weight * loss.kl.detach()),
                "entropy": per_adapter(tok.weight * entropy.detach()),
                "clipped": per_adapter(loss.clipped.float()),
                "tokens": per_adapter(torch.ones_like(logp)),
                "gap": per_adapter(
                    torch.where(tok.has_rollout, (tok.rollout_logp - old_logp).abs(), torch.zeros_like(old_logp))
                ),
                "gap_tokens": per_adapter(tok.has_rollout.float()),
            }
            if loss.tis is not None:  # (weights, applied, capped), each (N,)
                w, applied, capped = loss.tis
                sums_a["tis_w"] = per_adapter(torch.where(applied, w, torch.zeros_like(w)))
                sums_a["tis_n"] = per_adapter(applied.float())
                sums_a["tis_capped"] = per_adapter(capped.float())
            lists = {k: v.tolist() for k, v in sums_a.items()}
            row_loss = torch.zeros(len(rows), dtype=weighted.dtype, device=device).index_add_(
                0, tok.row, weighted.detach()
            )
        detached = logp.detach()
        return FwdBwdOut(
            logprobs=list(detached.split(tok.counts)),
            ref_logprobs=list(out_ref.split(tok.counts)) if out_ref is not None else None,
            row_loss=row_loss.tolist(),
            sums={n: {k: v[i] for k, v in lists.items()} for n, i in slot_of.items()},
            nonfinite={n for n, ok in zip(names, finite_list, strict=True) if not ok},
            backwarded=backwarded,
        )

    def optim_step(
        self, name: str, skip: bool = False, reached: bool | None = None, adam: AdamSettings | None = None
    ) -> tuple[bool, float | None]:
        """Clip, check and apply `name`'s accumulated gradient, then empty its buffer; returns (stepped, pre-clip
        grad norm: None without a gradient). `skip`: its loss was not finite somewhere (the step is dropped; also
        when a forward_backward since its last step saw a non-finite loss of it); `reached`: whether any rank's
        backward reached the tenant (the GRPO client agrees it over ranks itself; default: agreed here from whether
        each rank has a gradient). `adam`: this step's settings instead of the tenant's schedule."""
        self.ensure_resident([name])
        t = self.tenant(name)
        grads = t.grads
        t.grads = None
        skip = skip or t.nonfinite
        t.nonfinite = False
        if reached is None and self.ranks.world > 1:  # every rank the same flags, or the norm's collective hangs
            bad, good = self.ranks.agree([name], {name} if skip else set(), {name} if grads is not None else set())
            skip, reached = name in bad, name in good
        for p, g in zip(t.optim.params, grads or [None] * len(t.optim.params), strict=True):
            p.grad = g
        if adam is not None:
            t.optim.set_adam(adam)
        reached = grads is not None if reached is None else reached
        grad_norm = self.ranks.grad_norm(t.optim.grads(), reached=reached)  # every rank, same tenant order
        guard = None
        if adam is not None:  # a client's step: undone on every rank when it left any rank's shard non-finite

            def guard(finite: bool) -> bool:
                return name not in self.ranks.agree([name], set() if finite else {name}, set())[0]

        return t.optim.step(grad_norm, skip, guard)

    def _take_grads(self, names: set[str]) -> None:
        """Add each tenant's slot part of the stacked grads into its own buffer, then drop the stacked grads."""
        for name in sorted(names):
            t = self.tenants[name]
            fresh = self.model.adapter_grads(name, true_rank=True)
            if not fresh:  # a slot another rank holds
                continue
            if t.grads is None:
                t.grads = [None if g is None else g.clone() for g in fresh]
            else:
                t.grads = [
                    old if g is None else (g.clone() if old is None else old.add_(g))
                    for old, g in zip(t.grads, fresh, strict=True)
                ]
        self.model.zero_lora_grads()

    def _inputs(self, rows: Sequence[Row], tok: TokenIndex, device) -> ForwardInputs:
        """The forward's inputs for `rows`: packed by shared prompt (`rl_multilora.packing`) when the run shares
        prompts, the model takes the packed mask and some two rows share a prompt; else each row right-padded."""
        base = self.model.base_model
        if self.cfg.share_prompts and packable(base.config):
            dtype = base.get_input_embeddings().weight.dtype
            packed = pack(rows, tok.row, tok.pos, self.pad_token_id, dtype, device, self.pair_cost)
            if packed is not None:
                return packed
        input_ids, attention_mask = pad(rows, self.pad_token_id, device)  # (B, T), (B, T)
        tokens = sum(len(r.input_ids) for r in rows)
        return ForwardInputs(
            input_ids, attention_mask, list(range(len(rows))), tok.row, tok.pos - 1, tok.first_pos - 1, tokens
        )

    def _forward_logp(
        self,
        inputs: ForwardInputs,
        adapter_names: list[str | None],
        tok: TokenIndex,
        temperature: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-prob of each loss token and the entropy of its predictive distribution; both (N,), at least float32.
        `adapter_names`: one per row of the micro-batch (None: the base).

        With a plain output head (`MultiLoRAModel.output_head`), from the decoder's hidden states at the loss
        positions through `token_logp_entropy`: chunks of tokens, no full-vocabulary logits kept for the backward.
        Otherwise from the model's logits at the kept positions."""
        # What the backward needs of the cheap elementwise steps (SwiGLU's silu and product, RMSNorm's output) is
        # recomputed from what it keeps anyway, bit for bit (`rl_multilora.saved_activations`): about a third less
        # kept per token and layer, for a few elementwise passes in the backward. Not when sharded: FSDP's own hooks
        # free and refetch params.
        recompute = torch.is_grad_enabled() and self.ranks.world == 1
        with recompute_elementwise(self.saved_observer) if recompute else contextlib.nullcontext():
            names = [adapter_names[i] for i in inputs.firsts]  # one per sequence of the forward
            extra = {} if inputs.position_ids is None else {"position_ids": inputs.position_ids}
            head = self.model.output_head()
            if head is not None:
                hidden = self.model.forward_hidden(
                    inputs.input_ids, attention_mask=inputs.attention_mask, adapter_names=names, **extra
                )
                # (N, H): the state before each loss token
                picked = pick_states(hidden, inputs.state_row, inputs.state_pos)
                inv_t = 1.0 / (self.temperature if temperature is None else temperature)
                lora = self.model.head_lora(names, inputs.state_row)  # each token's LoRA on lm_head, if it is a target
                return token_logp_entropy(picked, head.weight, head.bias, tok.target, inv_t, lora=lora)
            width = inputs.input_ids.shape[1]
            # Logits at position t predict token t + 1. HF's `logits_to_keep` (last k positions) skips the lm_head over
            # the prompt region, whose (B, T, V) logits dominate memory at real vocab sizes.
            keep = width - inputs.first_state
            out = self.model(
                inputs.input_ids,
                attention_mask=inputs.attention_mask,
                adapter_names=names,
                logits_to_keep=keep,
                **extra,
            )
            logits = out.logits  # (B, K, V), positions width - K .. width - 1 (K = T for a model that ignores it)
            offset = width - logits.shape[1]
            # gathering before the softmax keeps it at (N, V), not (B, K, V)
            picked = pick_states(logits, inputs.state_row, inputs.state_pos - offset)  # (N, V)
            # Half-precision logits are upcast for the softmax; float64 models (used by exactness tests) stay float64.
            picked = picked.float() if picked.element_size() < 4 else picked  # (N, V)
            # Each token's own tenant temperature when some tenant has one, else the run's (one scalar).
            picked = picked / (self.temperature if temperature is None else temperature.to(picked.dtype)[:, None])
            logp_all = F.log_softmax(picked, dim=-1)  # (N, V)
            logp = logp_all.gather(-1, tok.target[:, None]).squeeze(-1)  # (N,)
            entropy = -(logp_all.exp() * logp_all).sum(-1)  # (N,)
            return logp, entropy

    # ----- optimizer state -----

    def optimizer_state_dict(self, name: str) -> dict[str, Any]:
        """`name`'s optimizer and scheduler state, for checkpoints (the scheduler's `last_epoch` is its step count)."""
        self.ensure_resident([name])
        return self.tenant(name).optim.state_dict()

    def load_optimizer_state_dict(self, name: str, state: dict[str, Any]) -> None:
        """Restore what `optimizer_state_dict` returned into `name` (added with the same OptimSettings). A rank that
        does not hold the slot (sharded model) takes the schedule and learning rate only."""
        self.ensure_resident([name])
        self.tenant(name).optim.load_state_dict(state, name)


def _host(t: torch.Tensor) -> torch.Tensor:
    """A compact host-memory copy of `t` (never a view of a slot)."""
    return t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)


def _owned_host(t: torch.Tensor) -> torch.Tensor:
    """A tenant's own tensor (its gradient buffer) for the store: itself when it is in host memory, else a copy."""
    return t.detach() if t.device.type == "cpu" else _host(t)


def peft_tensors(model: MultiLoRAModel, paged: PagedTenant) -> dict[str, torch.Tensor]:
    """A stored tenant's weights with PEFT key names, as `MultiLoRAModel.adapter_state_dict` names its slot's: the
    weights are `adapter_slot_tensors` order (A then B per covered module in model order, then per covered expert
    Parameter), at true rank."""
    from rl_multilora.lora.experts import expert_a_per_expert
    from rl_multilora.lora.peft_io import expert_key_stems, expert_to_peft, peft_key

    weights = model.split_adapter_tensors(paged.weights, paged.rank, paged.modules)
    pairs = iter(zip(weights[0::2], weights[1::2], strict=True))
    out: dict[str, torch.Tensor] = {}
    for module in model.lora_modules:
        if module in paged.modules:
            a, b = next(pairs)
            out[peft_key(module, "A")], out[peft_key(module, "B")] = a.detach().clone(), b.detach().clone()
    shapes = model.expert_shapes
    covered = [p for p in model.lora_parameters if p in paged.modules]
    stems = expert_key_stems(covered, shapes)
    for param in covered:
        a, b = next(pairs)
        stem = stems[param]
        lora_a, lora_b = expert_to_peft(expert_a_per_expert(a.detach(), shapes[param].num_experts), b.detach())
        out[f"{stem}.lora_A.weight"], out[f"{stem}.lora_B.weight"] = lora_a.clone(), lora_b.contiguous().clone()
    return out
