"""The trainer's rank coordinator: which rows each rank trains and the few numbers the ranks must agree on.

Design choices:

- Over several ranks (a model sharded with FSDP2, `rl_multilora/backends/fsdp.py`) every rank gets the same samples
  and computes the same rows, advantages and per-tenant weights (normalized over the whole batch), then trains its
  own share of the rows (`split`, balanced by tokens) in the same number of micro-batches (a rank short of rows runs
  one at weight zero, so every collective is joined). Each row stays on its rank for every PPO epoch of the step.
- The reduce-scatter sums the ranks' grads into the rank holding each slot; each tenant's grad norm is all-reduced
  (`grad_norm`) in the same tenant order on every rank, and so are the non-finite / backward flags (`agree`), so
  clipping and the NaN skip agree everywhere; only the holding rank's optimizer has parameters (the others keep the
  schedule in step). Reported sums are added over ranks at the end of the step (`sum_floats`).
- One process is world 1: no collective runs, `split` gives every row to rank 0, and `grad_norm` is torch's own
  `get_total_norm` in the grads' dtype, so one process clips exactly as `clip_grad_norm_` would.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rl_multilora.lora import MultiLoRAModel
    from rl_multilora.rows import Row


class RankCoordinator:
    """The trainer's view of the ranks a sharded model spans (world 1 for an unsharded one). Every method that
    communicates is called by all ranks, in the same order, with the same names."""

    def __init__(self, world: int = 1, rank: int = 0):
        self.world, self.rank = world, rank

    @classmethod
    def of(cls, model: MultiLoRAModel) -> RankCoordinator:
        """The ranks `model` is sharded over (world 1 unless its parameters are FSDP-sharded in a process group)."""
        import torch.distributed as dist

        sharded = any(getattr(p, "device_mesh", None) is not None for p in model.parameters())
        if not sharded or not dist.is_initialized():
            return cls(1, 0)
        return cls(dist.get_world_size(), dist.get_rank())

    def split(self, rows: list[Row]) -> list[list[Row]]:
        """Each rank's share of `rows`, balanced by tokens (each row to the rank with the fewest tokens so far, ties to
        the lowest rank), every share in the rows' order. The same on every rank."""
        if self.world == 1:
            return [rows]
        shares: list[list[Row]] = [[] for _ in range(self.world)]
        load = [0] * self.world
        for r in rows:
            k = min(range(self.world), key=lambda i: (load[i], i))
            shares[k].append(r)
            load[k] += len(r.input_ids)
        return shares

    def agree(self, names: list[str], bad: set[str], good: set[str]) -> tuple[set[str], set[str]]:
        """A tenant's loss is non-finite if it was on any rank, and it had a backward if it had one on any."""
        if self.world == 1 or not names:
            return bad, good
        flags = self._all_reduce([float(n in bad) for n in names] + [float(n in good) for n in names], "max")
        k = len(names)
        return {n for n, f in zip(names, flags[:k], strict=True) if f}, {
            n for n, f in zip(names, flags[k:], strict=True) if f
        }

    def grad_norm(self, grads: list[torch.Tensor], reached: bool) -> torch.Tensor | float | None:
        """The L2 norm of one tenant's grads over every rank's part; None when no backward reached it.

        `grads`: this rank's part (empty on a rank that does not hold the slot); `reached`: whether any rank's
        backward reached the tenant (the same on every rank). One process: torch's `get_total_norm` of `grads`, a
        0-dim tensor in their dtype (None when there are none). Ranks: a float, the square root of the all-reduced
        float64 sums of squares (every rank calls it for the same tenants in the same order)."""
        if self.world == 1:
            return torch.nn.utils.get_total_norm(grads) if grads else None
        if not reached:
            return None
        local = sum(float(g.double().pow(2).sum()) for g in grads)
        return math.sqrt(self._all_reduce([local])[0])

    def sum_floats(self, values: list[float]) -> list[float]:
        """`values` summed element-wise over ranks (as they are with one rank)."""
        if self.world == 1 or not values:
            return values
        return self._all_reduce(values)

    def _all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.tolist()
