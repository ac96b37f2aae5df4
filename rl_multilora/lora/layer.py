"""`LoRALinear`: a frozen `nn.Linear` plus `max_loras` pre-allocated LoRA slots, routed per batch row.

Design choices:

- Slots are stacked: every target `nn.Linear` is replaced in place by a `LoRALinear` that keeps the original
  `weight`/`bias` Parameters (frozen, same state-dict keys) and owns two Parameters holding all slots,
  `lora_A: (max_loras, max_rank, in)` and `lora_B: (max_loras, out, max_rank)`. A model holds two LoRA Parameters
  per wrapped Linear whatever `max_loras` is, and wrapping allocates only the slots' bytes (zero-filled). The
  parameter set never changes as tenants come and go (what FSDP sharding needs); a tenant's optimizer owns leaf
  views of its own slot (`MultiLoRAModel.adapter_parameters`).
- Mixed ranks: an adapter of rank r < max_rank uses rows/columns `[:r]` only; the entries above stay exactly zero.
  The grouped path computes at the batch's largest rank, where a lower-rank slot's extra rows of A and columns of
  B are zeros: they add exact zeros to the output, get exactly zero gradient (their products are with zeros), and
  AdamW leaves them at zero (zero grad -> zero moments -> zero update; weight decay of zero is zero).
- Scale `alpha / r` is a Python float on the view path and a per-row tensor in the LoRA dtype on the grouped path
  (applied to the rank-wide `x @ A.T`, then `out += xa @ B.T` in place with `baddbmm_`), never rounded to the base
  dtype: a bf16 `32 / 24` would scale training and rollout differently (PRIOR_ART).
- LoRA tensors are float32 by default whatever the base dtype (as PEFT's `autocast_adapter_dtype`): the input is
  cast to the LoRA dtype and base + delta is summed in it and rounded once to the base dtype, like PEFT's LoRA
  `Linear.forward`, so a bf16 base gives PEFT's bf16 logits bit for bit (one adapter: the view path below).
- Grouped compute whose cost does not grow with the number of slots (BGMV, as Punica/S-LoRA): each row that uses an
  adapter gathers its own slot's A and B (`index_select` over the stacked tensors: `rows x rank x (in + out)`
  values, small next to the base matmul), then two batched matmuls `x_i @ A_i.T @ B_i.T` over all rows at once.
  The backward of the gather adds each row's gradient into its own slot only (`index_add`), so rows of one slot
  never enter another slot's gradient and a NaN/inf row cannot leak into other tenants (a one-hot-masked dense
  formulation would: 0 * NaN = NaN). Measured on CPU (`bench/bench_lora.py`), this costs the same with 1, 64 or
  256 adapters in the batch, where the former per-slot loop of small matmuls cost 2.4x at 64. torch's
  `grouped_mm` has no usable CPU kernel for these layouts here; a padded per-slot `bmm` pads skewed mixes.
- The backward is written out (`_GroupedLoRA`) instead of left to autograd: every batched matmul gets its rank-wide
  operand in the layout the CPU kernels are fast with, and the base output is updated in place. At hidden 1024 this
  made a mixed 8-adapter forward+backward 1.12-1.14x the same batch without LoRA, where autograd through PEFT's
  ops (the one-adapter path before) cost 1.33x.
- Inference of one used slot whose rows are contiguous (a one-adapter engine batch, a PEFT parity check) takes the
  view path instead: PEFT's ops in PEFT's order at the true rank on a row-range view, so a bf16 base gives PEFT's
  logits bit for bit. Training always takes the grouped path (its backward is the cheaper one).
- A plain float32 per-row loop (`reference=True`) is the test oracle for both paths.
- An adapter may cover a subset of the model's LoRA modules: its rows get scale 0 in the others (whose slot tensors
  are zero too). With a `LoRABank` in the routing, the layer reads the bank's stacked tensors instead of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rl_multilora.lora.routing import BASE_SLOT, Routing, SlotRouter


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
        self.lora_A = nn.Parameter(torch.zeros(max_loras, max_rank, self.in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(max_loras, self.out_features, max_rank, dtype=dtype, device=device))

    def extra_repr(self) -> str:
        return f"name={self.name}, in_features={self.in_features}, out_features={self.out_features}"

    def _stacked(self, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        if routing.bank is not None:
            return routing.bank.stacked(self.name)
        return self.lora_A, self.lora_B

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.router.current
        if routing is not None and routing.groups and x.dim() == 2 and x.shape[0] != routing.batch_size:
            if x.shape[0] % routing.batch_size == 0:  # tokens flattened to (B * L, in), e.g. Qwen2-MoE's shared expert
                y3 = self.forward(x.reshape(routing.batch_size, -1, x.shape[-1]))  # (B, L, out)
                return y3.reshape(x.shape[0], self.out_features)
        y = F.linear(x, self.weight, self.bias)  # y: (B, ..., out), the base output computed once for all rows
        if routing is None or not routing.groups:
            return y
        if x.shape[0] != routing.batch_size:
            raise RuntimeError(
                f"LoRA layer {self.name} got input of shape {tuple(x.shape)} whose first dim is not the batch size "
                f"{routing.batch_size}; multi-LoRA routing needs batch-first inputs"
            )
        if routing.reference:
            return self._reference_forward(x, y, routing)
        scales = routing.scales_for(self.name)  # (n_active,) or None when no used adapter covers this module
        if scales is None:
            return y
        lora_a, lora_b = self._stacked(routing)  # (S, R, in), (S, out, R)
        # Base + delta is summed in the LoRA dtype and rounded once to y's dtype, as PEFT does. `out` is y itself
        # when the dtypes match: updating it in place is safe because F.linear does not save its output.
        out = y if y.dtype == lora_a.dtype else y.to(lora_a.dtype)  # out: (B, ..., out)
        g = routing.single
        grad = torch.is_grad_enabled() and (lora_a.requires_grad or x.requires_grad)
        if g is not None and not grad:  # one slot, contiguous rows, no autograd: PEFT's ops in PEFT's order
            xa = F.linear(x[g.start : g.stop].to(lora_a.dtype), lora_a[g.slot, : g.rank])  # x[g] @ A[s, :r].T
            out[g.start : g.stop].add_(F.linear(xa, lora_b[g.slot, :, : g.rank]) * g.scale)  # += scale * xa @ B.T
            return out.to(y.dtype)
        sink = routing.grad_sink if routing.bank is None else None
        xs = x if routing.active is None else x.index_select(0, routing.active)  # (n, ..., in), n active rows
        n = xs.shape[0]
        x3 = (xs if xs.dtype == lora_a.dtype else xs.to(lora_a.dtype)).reshape(n, -1, self.in_features)  # (n, L, in)
        if routing.active is None and out.dim() == 3:  # out[i] += scale[i] * x[i] @ A[s_i].T @ B[s_i].T, in place
            # (in place only on `out` itself: a Function may not dirty a view, and F.linear does not save its output)
            grouped_lora(out, x3, lora_a, lora_b, routing.row_slots, scales, routing.max_rank, grad, sink=sink)
        else:
            delta = out.new_zeros(n, x3.shape[1], self.out_features)
            grouped_lora(delta, x3, lora_a, lora_b, routing.row_slots, scales, routing.max_rank, grad, sink=sink)
            delta = delta.view(*xs.shape[:-1], self.out_features)
            if routing.active is None:
                out.add_(delta)
            else:
                out.index_add_(0, routing.active, delta)  # out[active[i]] += delta[i]
        return out if out.dtype == y.dtype else out.to(y.dtype)

    def _reference_forward(self, x: torch.Tensor, y: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Plain float32 loop over rows with the full padded tensors: the oracle for the fast paths."""
        meta = {g.slot: g for g in routing.groups}
        lora_a, lora_b = self._stacked(routing)
        out = []
        for i, slot in enumerate(routing.slots):
            row = y[i].float()
            if slot != BASE_SLOT and self.name in meta[slot].modules:
                # y[i] += scale[s] * (x[i] @ A[s].T) @ B[s].T, s = slot[i]; x[i]: (..., in)
                row = row + meta[slot].scale * ((x[i].float() @ lora_a[slot].float().T) @ lora_b[slot].float().T)
            out.append(row)
        return torch.stack(out).to(y.dtype)


def grouped_lora(y3, x3, lora_a, lora_b, slots, scales, r: int, grad: bool, a_slots=None, sink=None) -> None:
    """`y3[i] += scale[i] * (x3[i] @ A[a_slot[i], :r].T) @ B[slot[i], :, :r].T` in place, for every row i
    (`a_slots` defaults to `slots`; expert LoRA with a shared A indexes A by slot and B by (slot, expert)).

    With autograd (training) through `_GroupedLoRA`; without (rollout, eval) as plain ops that gather B in its
    stored layout (an index_select of the transposed B costs 2-4x more than of B as stored, which only the backward
    repays) and skip the Function's bookkeeping: a decode step is a few microseconds per layer. `sink`
    (`routing.SlotGradSink`, Linear LoRA only): the backward's A and B gradients go there, for the used slots only.
    """
    if grad:
        _GroupedLoRA.apply(y3, x3, lora_a, lora_b, slots, scales, r, a_slots, sink)
        return
    a_slots = slots if a_slots is None else a_slots
    a = (lora_a if r == lora_a.shape[1] else lora_a.narrow(1, 0, r)).index_select(0, a_slots)  # (n, r, in)
    b = (lora_b if r == lora_b.shape[2] else lora_b.narrow(2, 0, r)).index_select(0, slots)  # (n, out, r)
    # the fp32 scale times the product, rounded once to the LoRA dtype (as PEFT's float `scaling` does)
    xa = (torch.bmm(x3, a.transpose(1, 2)) * scales.view(-1, 1, 1)).to(x3.dtype)  # (n, L, r)
    y3.baddbmm_(xa, b.transpose(1, 2))


class _GroupedLoRA(torch.autograd.Function):
    """`y[i] += scale[i] * (x[i] @ A[slot[i], :r].T) @ B[slot[i], :, :r].T` for every row i, in place on `y`.

    Forward gathers each row's slot (A as `(n, r, in)`, B already transposed as `(n, r, out)`) and runs two batched
    matmuls. The backward is written out so that every batched matmul has a rank-wide operand in the layout the CPU
    kernels are fast with (autograd's own bmm backward multiplied a transposed activation by a thin matrix, 3-7x
    slower), and each row's weight grad goes into its own slot with one `index_add_`: no slot sees another slot's
    rows, so a NaN row stays in its own tenant. `y` is the first input (autograd's rule for an in-place op on a
    view) and must not be a tensor a backward reads (the layer passes the base output, which none does).
    """

    @staticmethod
    def forward(ctx, y3, x3, lora_a, lora_b, slots, scales, r, a_slots=None, sink=None):
        # x3: (n, L, in), y3: (n, L, out), lora_a: (S, R, in), lora_b: (S, out, R), slots: (n,), scales: (n,)
        # a_slots: (n,) A's index per row when it differs from B's (a shared expert A), else None
        a_slots = slots if a_slots is None else a_slots
        a = lora_a.narrow(1, 0, r).index_select(0, a_slots)  # a[i] = A[a_slot[i], :r]; (n, r, in)
        bt = lora_b.narrow(2, 0, r).transpose(1, 2).index_select(0, slots)  # bt[i] = B[slot[i], :, :r].T; (n, r, out)
        xa = torch.bmm(x3, a.transpose(1, 2)) * scales.view(-1, 1, 1)  # xa[i] = scale[i] * x[i] @ a[i].T; (n, L, r)
        xa = xa.to(x3.dtype)  # the fp32 scales promote a bf16 LoRA's product: round it back once
        y3.baddbmm_(xa, bt)  # y[i] += xa[i] @ bt[i]
        ctx.mark_dirty(y3)
        ctx.save_for_backward(x3, a, bt, xa, slots, scales, a_slots)
        ctx.stacked = (lora_a.shape, lora_b.shape, r)
        ctx.sink = (sink, lora_a, lora_b) if sink is not None else None
        return y3

    @staticmethod
    def backward(ctx, grad):  # grad: (n, L, out)
        x3, a, bt, xa, slots, scales, a_slots = ctx.saved_tensors
        shape_a, shape_b, r = ctx.stacked
        grad = grad.contiguous()
        g_xa = torch.bmm(grad, bt.transpose(1, 2)) * scales.view(-1, 1, 1)  # d/d(x[i] @ a[i].T); (n, L, r)
        g_xa = g_xa.to(grad.dtype)
        grad_x = torch.bmm(g_xa, a) if ctx.needs_input_grad[1] else None  # (n, L, in)
        grad_a = grad_b = None
        if ctx.sink is not None:  # only the used slots' gradients, handed to the sink (see SlotGradSink)
            sink, lora_a, lora_b = ctx.sink
            used, inverse = torch.unique(slots, return_inverse=True)  # (U,), (n,)
            if ctx.needs_input_grad[2]:
                rows = torch.bmm(g_xa.transpose(1, 2), x3)  # dA[slot[i]] += g_xa[i].T @ x[i]; (n, r, in)
                compact = rows.new_zeros(len(used), *shape_a[1:])  # (U, R, in)
                compact.narrow(1, 0, r).index_add_(0, inverse, rows)  # same rows, same order as the dense path
                sink.add(lora_a, used, compact)
            if ctx.needs_input_grad[3]:
                rows = torch.bmm(xa.transpose(1, 2), grad)  # (n, r, out)
                per_slot = rows.new_zeros(len(used), r, shape_b[1]).index_add_(0, inverse, rows)  # (U, r, out)
                compact = rows.new_zeros(len(used), *shape_b[1:])  # (U, out, R)
                compact.narrow(2, 0, r).copy_(per_slot.transpose(1, 2))
                sink.add(lora_b, used, compact)
            return grad, grad_x, None, None, None, None, None, None, None
        if ctx.needs_input_grad[2]:
            rows = torch.bmm(g_xa.transpose(1, 2), x3)  # dA[slot[i]] += g_xa[i].T @ x[i]; (n, r, in)
            grad_a = rows.new_zeros(shape_a)  # slots without rows get exactly zero
            grad_a.narrow(1, 0, r).index_add_(0, a_slots, rows)
        if ctx.needs_input_grad[3]:
            rows = torch.bmm(xa.transpose(1, 2), grad)  # dB[slot[i]].T += xa[i].T @ grad[i]; (n, r, out)
            used, inverse = torch.unique(slots, return_inverse=True)
            per_slot = rows.new_zeros(len(used), r, shape_b[1]).index_add_(0, inverse, rows)  # (U, r, out)
            grad_b = rows.new_zeros(shape_b)
            grad_b.narrow(2, 0, r).index_copy_(0, used, per_slot.transpose(1, 2))  # only the used slots are written
        return grad, grad_x, grad_a, grad_b, None, None, None, None, None
