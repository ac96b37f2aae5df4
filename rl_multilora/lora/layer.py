"""`LoRALinear`: a frozen `nn.Linear` plus `max_loras` pre-allocated LoRA slots, routed per batch row.

Design choices:

- Slots are pre-allocated: every target `nn.Linear` is replaced in place by a `LoRALinear` that keeps the original
  `weight`/`bias` Parameters (frozen, same state-dict keys) and owns `max_loras` pairs of Parameters
  `lora_A[s]: (max_rank, in)`, `lora_B[s]: (out, max_rank)`. The parameter set never changes as tenants come and go
  (what FSDP sharding and per-tenant optimizers need), and a per-tenant optimizer owns exactly one slot's tensors.
- Mixed ranks: an adapter of rank r < max_rank uses rows/columns `[:r]` only. The forward slices the padded
  Parameters to the true rank, so the padded entries never enter the compute, their gradient is exactly zero
  (slice backward writes zeros) and AdamW leaves them at exactly zero (zero grad -> zero moments -> zero update;
  weight decay of zero is zero). Export slices to the true rank.
- Scale `alpha / r` is kept as a Python float (fp64, applied in the fp32 LoRA compute), never folded into B or
  rounded to the base dtype: a bf16 `32 / 24` would scale training and rollout differently (PRIOR_ART).
- LoRA tensors are float32 by default whatever the base dtype (as PEFT's `autocast_adapter_dtype`): the input is
  cast to the LoRA dtype and base + delta is summed in it and rounded once to the base dtype, like PEFT's LoRA
  `Linear.forward`, so a bf16 base gives PEFT's bf16 logits bit for bit.
- Fast path (group by slot): each slot does two small matmuls at its true rank on its own rows only. When each
  slot's rows are contiguous in the batch (the trainer groups rows by adapter; a one-adapter batch always is) the
  layer reads row-range views and adds in place: no gather, no scatter. Otherwise rows are permuted once per
  forward (`routing.py`); per layer the input is gathered once and the deltas are scattered back with one
  `index_add_`. Rows of one slot never enter another slot's matmuls, so a NaN/inf row cannot leak into other
  tenants' gradients (a one-hot-masked dense formulation would: 0 * NaN = NaN). A plain float32 per-row loop
  (`reference=True`) is the test oracle.
- An adapter may cover a subset of the model's LoRA modules: a layer skips the slots whose adapter does not cover
  it. With a `LoRABank` in the routing, the layer reads the bank's tensors instead of its own Parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rl_multilora.lora.routing import BASE_SLOT, SlotRouter, _Routing


class LoRALinear(nn.Module):
    """A frozen `nn.Linear` plus `max_loras` LoRA slots; the router says which slot each batch row uses.

    Keeps the original `weight` and `bias` Parameters under the same names, so the base state-dict keys do not
    change. Without an active routing (e.g. `base_model` called directly) it is the plain base layer.
    """

    def __init__(self, linear: nn.Linear, name: str, router: SlotRouter, max_loras: int, max_rank: int, dtype):
        super().__init__()
        self.name = name
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.router = router
        device = linear.weight.device
        self.lora_A = nn.ParameterList(
            nn.Parameter(torch.zeros(max_rank, self.in_features, dtype=dtype, device=device)) for _ in range(max_loras)
        )
        self.lora_B = nn.ParameterList(
            nn.Parameter(torch.zeros(self.out_features, max_rank, dtype=dtype, device=device))
            for _ in range(max_loras)
        )

    def extra_repr(self) -> str:
        return f"name={self.name}, in_features={self.in_features}, out_features={self.out_features}"

    def _slot_weights(self, routing: _Routing, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        if routing.bank is not None:
            return routing.bank.lora_weights(self.name, slot)
        return self.lora_A[slot], self.lora_B[slot]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)  # y: (B, ..., out), the base output computed once for all rows
        routing = self.router.current
        if routing is None or not routing.groups:
            return y
        if x.shape[0] != routing.batch_size:
            raise RuntimeError(
                f"LoRA layer {self.name} got input of shape {tuple(x.shape)} whose first dim is not the batch size "
                f"{routing.batch_size}; multi-LoRA routing needs batch-first inputs"
            )
        if routing.reference:
            return self._reference_forward(x, y, routing)
        groups = [g for g in routing.groups if self.name in g.modules]
        if not groups:
            return y
        lora_dtype = self.lora_A[0].dtype if routing.bank is None else routing.bank.dtype
        # Base + delta is summed in the LoRA dtype and rounded once to y's dtype, as PEFT does. `out` is y itself
        # when the dtypes match: updating it in place is safe because F.linear does not save its output.
        out = y.to(lora_dtype)  # out: (B, ..., out)
        if routing.rows is None:  # each slot's rows are contiguous: views in, in-place add out, no copies
            for g in groups:
                lora_a, lora_b = self._slot_weights(routing, g.slot)
                xa = F.linear(x[g.start : g.stop].to(lora_dtype), lora_a[: g.rank])  # x[g] @ A[s, :r].T; (n_s, ..., r)
                # out[g] += scale[s] * xa @ B[s, :, :r].T; add_ on the view (`out[g] += ...` would also setitem)
                out[g.start : g.stop].add_(F.linear(xa, lora_b[:, : g.rank]) * g.scale)
            return out.to(y.dtype)
        xs = x.index_select(0, routing.rows).to(lora_dtype)  # xs[j] = x[rows[j]]; xs: (n_active, ..., in)
        deltas, rows = [], []
        for g in groups:
            lora_a, lora_b = self._slot_weights(routing, g.slot)
            xa = F.linear(xs[g.start : g.stop], lora_a[: g.rank])  # xa = xs[g] @ A[s, :r].T; (n_s, ..., r)
            deltas.append(F.linear(xa, lora_b[:, : g.rank]) * g.scale)  # d = scale[s] * xa @ B[s, :, :r].T
            rows.append(routing.rows[g.start : g.stop])
        delta = torch.cat(deltas) if len(deltas) > 1 else deltas[0]  # delta: (n_covered, ..., out)
        index = routing.rows if len(groups) == len(routing.groups) else torch.cat(rows)
        return out.index_add_(0, index, delta).to(y.dtype)  # y[index[j]] += delta[j]

    def _reference_forward(self, x: torch.Tensor, y: torch.Tensor, routing: _Routing) -> torch.Tensor:
        """Plain float32 loop over rows with the full padded tensors: the oracle for the fast path."""
        meta = {g.slot: g for g in routing.groups}
        out = []
        for i, slot in enumerate(routing.slots):
            row = y[i].float()
            if slot != BASE_SLOT and self.name in meta[slot].modules:
                lora_a, lora_b = self._slot_weights(routing, slot)
                # y[i] += scale[s] * (x[i] @ A[s].T) @ B[s].T, s = slot[i]; x[i]: (..., in)
                row = row + meta[slot].scale * ((x[i].float() @ lora_a.float().T) @ lora_b.float().T)
            out.append(row)
        return torch.stack(out).to(y.dtype)
