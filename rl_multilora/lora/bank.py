"""`LoRABank`: the engine-side copy of every LoRA slot.

Design choices:

- Stacked plain tensors per LoRA module (`A: (max_loras, max_rank, in)`, `B: (max_loras, out, max_rank)`), no
  autograd, sharing no storage with the model's trainable Parameters: weight sync writes a trained adapter into the
  bank while the trainer keeps training, and an optimizer step never leaks into a running rollout.
- On CPU a Linear module's slots are stored rank-minor, A as `(max_loras, in, max_rank)` and B as `(max_loras,
  max_rank, out)`, and handed out as transposed views of the usual shapes: a decode step (one token per row) then
  sums each row's slot rows straight from the bank (`layer.bag_lora`) instead of gathering a copy per row. On a GPU
  they keep the model's layout, which the gather + batched-matmul path reads fastest there (SmolLM2-shaped decode,
  64 mixed adapters over one adapter's tokens/s, `bench/gpu_check.py` on one H100 lease: 0.84x with the rank-minor
  layout, 0.94x without; one run each).
- Slots are zero-padded above their rank, like the model's, so `LoRALinear` reads a bank slot exactly as it reads
  its own Parameters (`MultiLoRAModel.forward(..., lora_bank=bank)`). A slot with rank 0 is empty.
- Writes go through the same PEFT validation as the model (`peft_io`), all of it before the slot is touched.
- Expert LoRA (`target_parameters` on packed MoE experts) is held the same way per expert Parameter:
  `A: (max_loras, E, max_rank, in)` (`(max_loras, 1, max_rank, in)` for a shared A), `B: (max_loras, E, out,
  max_rank)`, under the Parameter's full name; `LoRAExperts` reads them through `stacked(name)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rl_multilora.lora._errors import bad_value
from rl_multilora.lora.peft_io import ExpertShape, parse_peft_adapter


class LoRABank:
    """Engine-side copy of every slot's LoRA tensors: plain stacked tensors, no autograd, no shared storage.

    Per LoRA module: `A: (max_loras, max_rank, in)`, `B: (max_loras, out, max_rank)` (on CPU views of rank-minor
    storage), zero-padded above each slot's rank; per expert Parameter in `expert_shapes` the same with an expert dim
    after the slot's. A slot with rank 0 is empty; routing a row to it raises.
    """

    def __init__(
        self,
        layer_shapes: Mapping[str, tuple[int, int]],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        expert_shapes: Mapping[str, ExpertShape] | None = None,
    ):
        self.layer_shapes = dict(layer_shapes)
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = torch.device(device)

        def zeros(rows: int, cols: int) -> torch.Tensor:
            """(max_loras, rows, cols), on CPU a view of (max_loras, cols, rows) storage."""
            if self.device.type == "cpu":  # rank-minor: what `layer.bag_lora` reads (`layer.rank_minor`)
                return torch.zeros(max_loras, cols, rows, dtype=dtype, device=device).transpose(1, 2)
            return torch.zeros(max_loras, rows, cols, dtype=dtype, device=device)

        self._a = {m: zeros(max_rank, i) for m, (i, o) in self.layer_shapes.items()}
        self._b = {m: zeros(o, max_rank) for m, (i, o) in self.layer_shapes.items()}
        self.expert_shapes = dict(expert_shapes or {})
        for name, shape in self.expert_shapes.items():
            a_experts = 1 if shape.shared_a else shape.num_experts
            e, i, o = shape.num_experts, shape.in_features, shape.out_features
            self._a[name] = torch.zeros(max_loras, a_experts, max_rank, i, dtype=dtype, device=device)
            self._b[name] = torch.zeros(max_loras, e, o, max_rank, dtype=dtype, device=device)
        self._rank = [0] * max_loras
        self._alpha: list[float] = [0.0] * max_loras
        self._modules: list[frozenset[str]] = [frozenset()] * max_loras

    def _check_slot(self, slot: Any) -> int:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_loras:
            raise ValueError(bad_value("slot", slot, f"an integer from 0 to {self.max_loras - 1}"))
        return slot

    def set_adapter(self, slot: int, state_dict: Mapping[str, torch.Tensor], config: Any) -> None:
        """Write a PEFT-named adapter (true rank) into `slot`, zero-padded to max_rank; replaces what was there."""
        self._check_slot(slot)
        parsed = parse_peft_adapter(
            state_dict, config, self.layer_shapes, self.max_rank, f"for bank slot {slot}", self.expert_shapes
        )
        self._write(slot, parsed.rank, parsed.alpha, {**parsed.tensors, **parsed.experts})

    def _write(self, slot: int, rank: int, alpha: float, tensors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]):
        with torch.no_grad():
            for module in self._a:
                self._a[module][slot].zero_()
                self._b[module][slot].zero_()
            for module, (lora_a, lora_b) in tensors.items():
                self._a[module][slot][..., :rank, :].copy_(lora_a)  # A[s, (e,) :r] = a; a: ((E,) r, in)
                self._b[module][slot][..., :rank].copy_(lora_b)  # B[s, (e,) :, :r] = b; b: ((E,) out, r)
        self._rank[slot], self._alpha[slot], self._modules[slot] = rank, alpha, frozenset(tensors)

    def clear(self, slot: int) -> None:
        """Empty `slot`: zero its tensors; rows routed to it now raise."""
        self._check_slot(slot)
        self._write(slot, 0, 0.0, {})

    def rank(self, slot: int) -> int:
        """The slot's true rank; 0 when empty."""
        return self._rank[self._check_slot(slot)]

    def is_set(self, slot: int) -> bool:
        return self.rank(slot) > 0

    def lora_weights(self, module: str, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A (max_rank, in), B (out, max_rank)) of `slot` in `module` (with a leading expert dim for an expert
        Parameter), views into the bank."""
        return self._a[module][slot], self._b[module][slot]

    def stacked(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A (max_loras, max_rank, in), B (max_loras, out, max_rank)) of `module`, or of an expert Parameter with
        an expert dim after the slot's: every slot, what the grouped paths gather from."""
        return self._a[module], self._b[module]

    def slot_meta(self, slot: int) -> tuple[int, float, frozenset[str]]:
        if self._rank[slot] == 0:
            raise ValueError(f"adapter_slots names bank slot {slot}, which is empty; set it with bank.set_adapter")
        return self._rank[slot], self._alpha[slot] / self._rank[slot], self._modules[slot]
