"""The local training backend: the multi-LoRA model and the GRPO trainer in this process, on one device.

It is what CPU runs and single-GPU runs use, and what the embedded engine shares its frozen base with (the engine
keeps its own copy of the LoRA slots, so a trained adapter reaches rollouts only through the weight sync).

More tenants than slots (`max_tenants` > the model's `max_loras`, with the trainer's `TenantStore`): a tenant holds a
*place* (0 .. max_tenants - 1, what `add_adapter` returns, `free_slots` lists and the tenant records as its slot)
for its whole life, and a model slot only while it is resident; the trainer's operations page tenants in and out
(`rl_multilora.train_ops`). Writing a tenant's adapter or reading or writing its optimizer pages it in; reading its
adapter (a weight sync, a checkpoint) reads the stored copy and evicts no one. `prefetch` stages the tenants of a
coming step while this one trains (async runs). A `forward_backward`
whose rows name more tenants than there are slots runs as several calls of at most `max_loras` tenants each.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rl_multilora.backends.base import PagingStats, TrainingBackend
from rl_multilora.batch import AdapterStepStats
from rl_multilora.config import AdapterConfig, OptimSettings
from rl_multilora.errors import bad_value
from rl_multilora.grpo import tenant_algo
from rl_multilora.lora import MultiLoRAModel
from rl_multilora.losses import TenantAlgo
from rl_multilora.rows import Row
from rl_multilora.tenant_optim import AdamSettings
from rl_multilora.train_ops import FwdBwdOut
from rl_multilora.trainer import MultiLoRATrainer
from rollout.types import Sample

# A client's optimizer before its first optim_step names its settings (the SDK's AdamParams defaults).
CLIENT_OPTIM = OptimSettings(betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, max_grad_norm=None)


class LocalBackend(TrainingBackend):
    """`MultiLoRAModel` + `MultiLoRATrainer` behind the `TrainingBackend` interface."""

    def __init__(self, model: MultiLoRAModel, trainer: MultiLoRATrainer, max_tenants: int | None = None):
        self.model = model
        self.trainer = trainer
        self._max_tenants = max_tenants or model.max_loras
        if self._max_tenants < model.max_loras:
            raise ValueError(bad_value("max_tenants", max_tenants, f"None or >= max_loras ({model.max_loras})"))
        if self.paging and trainer.ops.store is None:
            raise ValueError(
                bad_value(
                    "max_tenants", max_tenants, f"<= max_loras ({model.max_loras}) for a trainer without a store"
                )
            )
        self._places: dict[str, int] = {}  # paging: each tenant's place
        self._free_places = list(range(self._max_tenants)) if self.paging else []  # lowest first

    @property
    def paging(self) -> bool:
        return self._max_tenants > self.model.max_loras

    @property
    def max_tenants(self) -> int:
        return self._max_tenants

    def paging_stats(self) -> PagingStats | None:
        ops = self.trainer.ops
        if ops.store is None:
            return None
        st = ops.store.stats
        return PagingStats(
            resident=len(ops.resident),
            paged=len(ops.store),
            spilled=len(ops.store.spilled()),
            host_bytes=ops.store.host_bytes,
            disk_bytes=ops.store.disk_bytes,
            page_ins=st.page_ins,
            page_outs=st.page_outs,
            page_in_s=st.page_in_s,
            page_out_s=st.page_out_s,
            prefetched=st.staged_taken,
        )

    def resident(self, name: str) -> bool:
        return name in self.model.adapters

    def _take_place(self, name: str, slot: int) -> int:
        if not self.paging:
            return slot
        place = self._free_places.pop(0)
        self._places[name] = place
        return place

    def _free_place(self, name: str) -> None:
        place = self._places.pop(name, None)
        if place is not None:
            bisect.insort(self._free_places, place)

    @property
    def shared_model(self) -> MultiLoRAModel:
        return self.model

    @property
    def max_rank(self) -> int:
        return self.model.max_rank

    @property
    def max_loras(self) -> int:
        return self.model.max_loras

    @property
    def lora_modules(self) -> list[str]:
        return self.model.lora_modules

    @property
    def lora_parameters(self) -> list[str]:
        return self.model.lora_parameters

    @property
    def adapters(self) -> list[str]:
        return list(self._places) if self.paging else list(self.model.adapters)

    def free_slots(self) -> list[int]:
        return list(self._free_places) if self.paging else self.model.free_slots

    def _check_room(self, name: str) -> None:
        if self.paging and not self._free_places:
            raise RuntimeError(
                f"no free place for adapter {name!r}: all model.max_tenants={self._max_tenants} are taken; remove "
                "one or raise model.max_tenants"
            )
        if self.paging and name in self._places:
            raise ValueError(f"adapter {name!r} is already loaded; remove it first")
        self.trainer.ops.make_room()

    def add_adapter(self, cfg: AdapterConfig) -> int:
        self._check_room(cfg.name)
        slot = self.model.add_adapter(
            cfg.name,
            rank=cfg.rank,
            alpha=cfg.alpha,
            seed=cfg.seed,
            target_modules=cfg.target_modules,
            target_parameters=cfg.target_parameters,
        )
        try:
            t = self.trainer
            algo = tenant_algo(t.cfg, cfg, t.temperature, t.norm_len or 1)
            t.add_adapter(cfg.name, cfg.optim, lr=cfg.lr, max_steps=cfg.max_steps, algo=algo)
        except BaseException:
            self.model.remove_adapter(cfg.name)
            raise
        return self._take_place(cfg.name, slot)

    def add_client(self, name: str, rank: int, alpha: float, seed: int | None, target_modules: list[str]) -> int:
        self._check_room(name)
        slot = self.model.add_adapter(name, rank, alpha, seed=seed, target_modules=target_modules)
        try:
            self.trainer.ops.add_tenant(name, CLIENT_OPTIM, lr=AdamSettings().learning_rate)
        except BaseException:
            self.model.remove_adapter(name)
            raise
        return self._take_place(name, slot)

    def forward_backward(
        self, rows: Sequence[Row], losses: Mapping[str, TenantAlgo], backward: bool = True
    ) -> FwdBwdOut:
        names = sorted({r.adapter for r in rows})
        if len(names) <= self.model.max_loras:
            return self.forward_backward_share(rows, losses, backward)[1]
        # paging: more tenants than slots in one call -> calls of at most max_loras tenants, outputs in row order
        size = self.model.max_loras
        order: list[int] = []
        parts: list[FwdBwdOut] = []
        for k in range(0, len(names), size):
            chunk = set(names[k : k + size])
            index = [i for i, r in enumerate(rows) if r.adapter in chunk]
            order += index
            parts.append(self.forward_backward_share([rows[i] for i in index], losses, backward)[1])
        at = {i: j for j, i in enumerate(order)}
        logprobs = [lp for p in parts for lp in p.logprobs]
        refs = [x for p in parts for x in (p.ref_logprobs or [])] if all(p.ref_logprobs for p in parts) else None
        row_loss = [x for p in parts for x in p.row_loss]
        n = len(rows)
        return FwdBwdOut(
            logprobs=[logprobs[at[i]] for i in range(n)],
            ref_logprobs=[refs[at[i]] for i in range(n)] if refs is not None else None,
            row_loss=[row_loss[at[i]] for i in range(n)],
            sums={k: v for p in parts for k, v in p.sums.items()},
            nonfinite=set().union(*(p.nonfinite for p in parts)),
            backwarded=set().union(*(p.backwarded for p in parts)),
        )

    def forward_backward_share(
        self, rows: Sequence[Row], losses: Mapping[str, TenantAlgo], backward: bool = True
    ) -> tuple[list[int], FwdBwdOut]:
        """This rank's share of one mixed batch (all of it in one process): (the indices of its rows, their outputs).
        Every rank is handed the same rows and runs exactly one forward (and backward), on a zero-weight stand-in
        when it has no rows, so the sharded model's collectives line up; every tenant of the batch collects the
        gradient the reduce-scatter hands this rank."""
        ops = self.trainer.ops
        index = {id(r): i for i, r in enumerate(rows)}
        mine = ops.ranks.split(list(rows))[ops.ranks.rank]
        if ops.ranks.world == 1:
            return [index[id(r)] for r in mine], ops.forward_backward(mine, None, algos=losses, backward=backward)
        collect = sorted({r.adapter for r in rows})
        if not mine:
            filler = rows[0]
            ops.forward_backward(
                [filler], {id(filler): 0.0}, algos=losses, backward=backward, filler=True, collect=collect
            )
            return [], FwdBwdOut(logprobs=[], ref_logprobs=None, row_loss=[])
        weights = {id(r): 1.0 for r in mine}
        out = ops.forward_backward(mine, weights, algos=losses, backward=backward, collect=collect)
        return [index[id(r)] for r in mine], out

    def optim_step(self, name: str, adam: AdamSettings) -> tuple[bool, float | None]:
        return self.trainer.ops.optim_step(name, adam=adam)

    def adapter_step(self, name: str) -> int:
        return self.trainer.adapter_step(name)

    def remove_adapter(self, name: str) -> None:
        paged_out = name in self.trainer.adapters and not self.trainer.ops.is_resident(name)
        if name in self.trainer.adapters:
            self.trainer.remove_adapter(name)
        if not paged_out:
            self.model.remove_adapter(name)
        self._free_place(name)

    def train_step(
        self, samples: Sequence[Sample], current_versions: Mapping[str, int], max_steps: Mapping[str, int]
    ) -> dict[str, AdapterStepStats]:
        return self.trainer.train_step(samples, current_versions=dict(current_versions), max_steps=dict(max_steps))

    def _page_in(self, name: str) -> None:
        if name in self.trainer.adapters:
            self.trainer.ops.ensure_resident([name])

    def _paged_out(self, name: str) -> bool:
        ops = self.trainer.ops
        return ops.store is not None and name in ops.tenants and not ops.is_resident(name)

    def prefetch(self, names: Sequence[str]) -> list[str]:
        return self.trainer.ops.prefetch(names)

    def adapter_state_dict(self, name: str) -> dict[str, torch.Tensor]:
        if self._paged_out(name):  # read where it waits: a sync or checkpoint never evicts a tenant for a read
            return self.trainer.ops.paged_state_dict(name)[0]
        return self.model.adapter_state_dict(name)

    def peft_config(self, name: str) -> dict[str, Any]:
        if self._paged_out(name):
            return self.trainer.ops.paged_state_dict(name)[1]
        return self.model.peft_config(name)

    def load_adapter_state_dict(
        self, name: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], source: str
    ) -> None:
        self._page_in(name)
        self.model.load_adapter_state_dict(name, tensors, config, source=source)

    def optimizer_state_dict(self, name: str) -> dict[str, Any]:
        return self.trainer.optimizer_state_dict(name)

    def load_optimizer_state_dict(self, name: str, state: Mapping[str, Any]) -> None:
        self.trainer.load_optimizer_state_dict(name, state)

    def close(self) -> None:
        if self.trainer.ops.store is not None:
            self.trainer.ops.store.close()
