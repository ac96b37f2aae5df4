"""The local training backend: the multi-LoRA model and the GRPO trainer in this process, on one device.

It is what CPU runs and single-GPU runs use, and what the embedded engine shares its frozen base with (the engine
keeps its own copy of the LoRA slots, so a trained adapter reaches rollouts only through the weight sync).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rl_multilora.backends.base import TrainingBackend
from rl_multilora.batch import AdapterStepStats
from rl_multilora.config import AdapterConfig, OptimSettings
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

    def __init__(self, model: MultiLoRAModel, trainer: MultiLoRATrainer):
        self.model = model
        self.trainer = trainer

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
        return list(self.model.adapters)

    def free_slots(self) -> list[int]:
        return self.model.free_slots

    def add_adapter(self, cfg: AdapterConfig) -> int:
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
        return slot

    def add_client(self, name: str, rank: int, alpha: float, seed: int | None, target_modules: list[str]) -> int:
        slot = self.model.add_adapter(name, rank, alpha, seed=seed, target_modules=target_modules)
        try:
            self.trainer.ops.add_tenant(name, CLIENT_OPTIM, lr=AdamSettings().learning_rate)
        except BaseException:
            self.model.remove_adapter(name)
            raise
        return slot

    def forward_backward(
        self, rows: Sequence[Row], losses: Mapping[str, TenantAlgo], backward: bool = True
    ) -> FwdBwdOut:
        return self.forward_backward_share(rows, losses, backward)[1]

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
        if name in self.trainer.adapters:
            self.trainer.remove_adapter(name)
        self.model.remove_adapter(name)

    def train_step(
        self, samples: Sequence[Sample], current_versions: Mapping[str, int], max_steps: Mapping[str, int]
    ) -> dict[str, AdapterStepStats]:
        return self.trainer.train_step(samples, current_versions=dict(current_versions), max_steps=dict(max_steps))

    def adapter_state_dict(self, name: str) -> dict[str, torch.Tensor]:
        return self.model.adapter_state_dict(name)

    def peft_config(self, name: str) -> dict[str, Any]:
        return self.model.peft_config(name)

    def load_adapter_state_dict(
        self, name: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], source: str
    ) -> None:
        self.model.load_adapter_state_dict(name, tensors, config, source=source)

    def optimizer_state_dict(self, name: str) -> dict[str, Any]:
        return self.trainer.optimizer_state_dict(name)

    def load_optimizer_state_dict(self, name: str, state: Mapping[str, Any]) -> None:
        self.trainer.load_optimizer_state_dict(name, state)
