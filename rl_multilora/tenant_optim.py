"""One tenant's optimizer: AdamW + LR schedule over the leaf views of its own slot, one clipping path, the NaN skip.

Design choices:

- One AdamW and one LambdaLR per adapter, over `model.adapter_parameters(name, true_rank=True)` only: leaf views of
  its own slot's first `rank` ranks in the model's stacked LoRA tensors, so each tenant's optimizer is exactly the
  per-tenant AdamW it would be over separate tensors of its rank (same shapes, state and results) while the forward
  runs every slot in one grouped path, and its moments take its rank's bytes, not the slot's `max_rank`. The
  backward accumulates into the stacked grads; before a tenant steps, the trainer hands its views the true-rank
  part of its slot's gradient (`MultiLoRAModel.adapter_grads`). Moments saved at the slot's rank (older
  checkpoints) are cut to the true rank on load: the ranks above hold exact zeros.
- One clipping path (`clip_grads_`) for one process and for ranks: the grad norm comes from the rank coordinator
  (`rl_multilora.ranks.RankCoordinator.grad_norm`), one process being world 1. A non-finite norm or loss skips the
  step (counted by the caller, nobody else affected); the grads are dropped either way.
- A Tinker client's step (`guard`) is checked after it is taken: one that made any parameter non-finite (a finite
  but huge learning rate overflows the dtype, or torch refuses it part way) is undone, weights and Adam moments
  restored from a copy taken just before, and reported as skipped, so the adapter stays bit-identical. GRPO steps
  are not copied: their learning rates come from a validated config and the copy would cost two adapter-sized
  buffers per step.
- A tenant with no rows is not stepped at all: AdamW with weight decay would otherwise still move it, and its schedule
  and step counter would drift from the data it saw. The scheduler's `last_epoch` is the tenant's step count.
- Warmup is (step + 1) / warmup_steps (`rl_multilora.grpo.lr_multiplier`), so the first step already learns.
- A rank that does not hold the slot (sharded model) keeps an optimizer over an empty placeholder, so its schedule and
  learning rate stay in step with the holding rank's.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rl_multilora.config import OptimSettings
from rl_multilora.errors import bad_value
from rl_multilora.grpo import lr_multiplier


@dataclass(frozen=True)
class AdamSettings:
    """One optimizer step's settings as a Tinker client sends them with `optim_step` (the SDK's `AdamParams`)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0: no clipping


def clip_grads_(grads: Sequence[torch.Tensor], grad_norm: torch.Tensor | float, max_norm: float) -> None:
    """g *= min(1, max_norm / (grad_norm + 1e-6)) for every g in `grads`, in place: `clip_grad_norm_`'s rule.

    The coefficient is computed in `grad_norm`'s own arithmetic: a 0-dim tensor (one process) gives exactly what
    `clip_grad_norm_` computes, a float (the float64 norm over ranks) the same rule in float64."""
    coef = min(1.0, float(float(max_norm) / (grad_norm + 1e-6)))
    for g in grads:
        g.mul_(coef)


class TenantOptimizer:
    """`name`'s AdamW (peak `lr`) and LR schedule over `params` (its slot's leaf views; empty on a rank that does not
    hold the slot); `max_steps` is its budget in optimizer steps (what a cosine schedule decays over)."""

    def __init__(
        self, name: str, params: list[torch.nn.Parameter], optim: OptimSettings, lr: float, max_steps: int | None
    ):
        if not isinstance(optim, OptimSettings):
            raise TypeError(bad_value(f"{name}.optim", type(optim).__name__, "a rl_multilora.config.OptimSettings"))
        if not lr > 0.0:
            raise ValueError(bad_value(f"{name}.lr", lr, "a number > 0"))
        if optim.schedule == "cosine" and not (max_steps is not None and max_steps > optim.warmup_steps):
            # the same rule as config validation: fail here, at admission, never mid-run
            raise ValueError(bad_value(f"{name}.max_steps", max_steps, "an integer > warmup_steps with cosine"))
        for p in params:
            p.requires_grad_(True)
            p.grad = None
        self.settings = optim
        self.params = params
        held = params or [torch.nn.Parameter(torch.zeros(0))]
        self.optimizer = torch.optim.AdamW(
            held, lr=lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(optim, max_steps))
        self._clip_once: float | None = None  # `set_adam`'s clip for the next step (0: none)

    @property
    def holds(self) -> bool:
        """Whether this rank holds the slot (has parameters to step)."""
        return bool(self.params)

    @property
    def step_count(self) -> int:
        """Optimizer steps taken, as the LR scheduler counts them."""
        return self.scheduler.last_epoch

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step will use."""
        return self.optimizer.param_groups[0]["lr"]

    def grads(self) -> list[torch.Tensor]:
        """This rank's grads of the tenant (the parameters that have one)."""
        return [p.grad for p in self.params if p.grad is not None]

    def set_adam(self, adam: AdamSettings) -> None:
        """The next step's learning rate, betas, eps, weight decay and clipping (a Tinker client's `optim_step`); the
        LR schedule does not apply to it."""
        for group in self.optimizer.param_groups:
            group["lr"] = adam.learning_rate
            group["betas"] = (adam.beta1, adam.beta2)
            group["eps"] = adam.eps
            group["weight_decay"] = adam.weight_decay
        self._clip_once = adam.grad_clip_norm

    def step(
        self,
        grad_norm: torch.Tensor | float | None,
        skip: bool,
        guard: Callable[[bool], bool] | None = None,
    ) -> tuple[bool, float | None]:
        """Clip the grads by `grad_norm` (over all ranks, from the rank coordinator; None when no backward reached
        the tenant) and step, unless `skip` (its loss was not finite) or the norm is not finite; drop the grads
        either way. `guard`: undo a step that left a parameter non-finite; it maps this rank's "all finite" to
        every rank's (so all ranks undo together). Returns (stepped, the pre-clip grad norm or None)."""
        norm = None if grad_norm is None else float(grad_norm)
        max_norm = self.settings.max_grad_norm if self._clip_once is None else (self._clip_once or None)
        self._clip_once = None
        if norm is not None and max_norm is not None and not skip and math.isfinite(norm):
            clip_grads_(self.grads(), grad_norm, max_norm)
        ok = not skip and (norm is None or math.isfinite(norm))
        if ok:
            if guard is None:
                self.optimizer.step()
                self.scheduler.step()
            elif self._guarded_step(guard):
                self.scheduler.step()
            else:
                ok = False
        self.optimizer.zero_grad(set_to_none=True)
        return ok, norm

    def _guarded_step(self, guard: Callable[[bool], bool]) -> bool:
        """Step AdamW from a copy of the weights and moments; put the copy back when `guard` says some rank's result
        is not finite. Returns whether the step stands."""
        weights = [p.detach().clone() for p in self.params]
        state = copy.deepcopy(self.optimizer.state_dict())
        try:
            self.optimizer.step()
            finite = all(bool(torch.isfinite(p).all()) for p in self.params)
        except RuntimeError:  # "value cannot be converted to type float without overflow", after some params
            finite = False
        if guard(finite):
            return True
        with torch.no_grad():
            for p, w in zip(self.params, weights, strict=True):
                p.copy_(w)
        self.optimizer.load_state_dict(state)
        return False

    def release(self) -> list[dict[str, torch.Tensor]]:
        """Let go of the slot (its tenant is paged out): returns each parameter's AdamW state, in `params` order;
        the schedule, step count and param-group settings stay here. `attach` takes the slot back."""
        states = [self.optimizer.state.pop(p, {}) for p in self.params]
        self.optimizer.param_groups[0]["params"] = []
        self.params = []
        return states

    def attach(self, params: list[torch.nn.Parameter], states: list[dict[str, torch.Tensor]]) -> None:
        """Step `params` (the tenant's slot views, after a page-in) from now on, with the AdamW state `release`
        returned."""
        if len(params) != len(states):
            raise ValueError(f"{len(params)} parameters but {len(states)} optimizer states")
        for p, state in zip(params, states, strict=True):
            p.requires_grad_(True)
            p.grad = None
            if state:
                self.optimizer.state[p] = state
        self.optimizer.param_groups[0]["params"] = list(params)
        self.params = list(params)

    def drop_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        """Optimizer and scheduler state, for checkpoints (the scheduler's `last_epoch` is the step count)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any], name: str) -> None:
        """Restore what `state_dict` returned: the moments and the step count (the schedule's position). The
        hyperparameters are this tenant's settings now, not the checkpoint's: a resume may change `lr`, betas, eps
        and weight decay (`checkpoint.py`), and the learning rate is the schedule's at the restored step, computed as
        the scheduler computes it (so an unchanged config resumes bit for bit). torch's `load_state_dict` would put
        back the saved ones, and a changed `lr` was ignored. Without the slot (sharded model) the moments are on the
        ranks and only the step count is taken here. `name`: the tenant, for the error message."""
        missing = {"optimizer", "scheduler"} - set(state)
        if missing:
            raise ValueError(
                bad_value(f"optimizer state of {name!r}", sorted(state), f"keys including {sorted(missing)}")
            )
        settings = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in self.optimizer.param_groups]
        if self.params:
            self.optimizer.load_state_dict(state["optimizer"])
            for p in self.params:  # moments saved at the slot's rank (before they were kept at the true rank)
                held = self.optimizer.state.get(p, {})
                for k, v in held.items():
                    if v.dim() > 0 and v.shape != p.shape:
                        held[k] = v[tuple(slice(0, n) for n in p.shape)].clone()  # the rest are exact zeros
        self.scheduler.load_state_dict(state["scheduler"])
        self.scheduler.base_lrs = [mine["initial_lr"] for mine in settings]
        step = self.scheduler.last_epoch
        for group, mine, base, fn in zip(
            self.optimizer.param_groups, settings, self.scheduler.base_lrs, self.scheduler.lr_lambdas, strict=True
        ):
            group.update(mine)
            group["lr"] = base * fn(step)  # LambdaLR.get_lr's product


def _lr_lambda(optim: OptimSettings, total_steps: int | None) -> Callable[[int], float]:
    # A plain function, not a functools.partial: LambdaLR's state_dict saves the __dict__ of callable objects.
    def fn(step: int) -> float:
        return lr_multiplier(step, optim, total_steps)

    return fn
