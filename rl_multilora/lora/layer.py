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
  `grouped_mm` has no usable CPU kernel for these layouts here; a padded per-slot `bmm` pads skewed mixes. A
  training batch whose rows all use one slot reads that slot as a stride-0 view instead of a copy per row: the same
  GEMMs on the same values, so the same bits as the mixed path.
- The backward is written out (`_GroupedLoRA`) instead of left to autograd: every batched matmul gets its rank-wide
  operand in the layout the CPU kernels are fast with, and the base output is updated in place. At hidden 1024 this
  made a mixed 8-adapter forward+backward 1.12-1.14x the same batch without LoRA, where autograd through PEFT's
  ops (the one-adapter path before) cost 1.33x.
- Training with every row on an adapter runs the base Linear and its LoRA as one autograd node (`_LinearLoRA`): the
  LoRA's input gradient is added into the base's `grad @ W` in place instead of being summed by autograd (a pass over
  an activation-sized tensor per Linear). On CPU a batch on one slot takes the same path as a mixed one, so a
  tenant's numbers do not depend on who shares its batch (folding the slot into the weight, `W + scale * B @ A`,
  saved about 3 % of a one-adapter step but rounded differently from the mixed path). On CUDA they differ at rounding
  anyway, and a one-slot batch's weight gradients are one GEMM each (`one_gemm_weight_grads`). Profiled at
  SmolLM2-135M's shape (1 thread, 16 x 64 tokens): the LoRA's cost was its rank-8 products, each one a memory-bound
  pass over an activation (50 % of the matmul peak at best), and the extra input-gradient sum; per-op overhead was
  under 1 % (`bench/bench_lora_paths.py`).
- Float32 training on an x86-64 CPU runs those rank-wide products in C kernels of our own (`cpu_kernels`, AVX2 +
  FMA, built on first use; `_kernel_forward` / `_kernel_backward`, both Functions): MKL ran them at 30-55 GFLOP/s
  against about 100 for the base's GEMMs, the kernels at 84-103 on hot data, and each output value is one fixed
  sequence of fused multiply-adds, so a token's values follow neither the thread count, its row's length nor its
  batch mates. `_LinearLoRA` writes the LoRA's delta first and the base GEMM accumulates onto it (`addmm_`), in the
  forward and for the input gradient: MKL's large outputs leave the caches, and adding the delta after read them
  back from memory. Where the kernels are not built (no compiler, no AVX2, `RL_MULTILORA_CPU_KERNELS=0`) and on
  CUDA the torch ops below run. There the thin products that read an activation (`x @ A.T` forward, `grad @ B`
  backward; `_shrink`) run rank-major on CPU, `A @ x.T` with results `(n, r, L)`: 1.6x as fast in MKL as
  token-major, but it rounds a token differently in rows of under 12 tokens, so shorter rows are zero-padded up to
  that floor (probed once per shape, `_rank_major_floor`) and a token's values do not follow its row's length (a
  tenant's numbers would otherwise follow its micro-batch's padding, and a packed row's its neighbours').
- Decode (one token per row, no autograd, float32 on CPU) through an engine bank reads each row's slot straight from
  the bank with two segmented weighted sums (`bag_lora`: `embedding_bag`, one bag per row) instead of gathering a
  copy of A and B per row: on CPU the bank stores its slots rank-minor (`(S, in, R)`, `(S, R, out)`), so a slot's A
  is a table of `in` rows of R values and its B one of R rows of `out`. At SmolLM2's shape, 64 rows on 64 adapters
  made the per-row gathers move 625 MB per decode step (more than the base's 540 MB of weights) and write it once
  more; the bags read it once. Reading it once is the floor: 64 distinct adapters are 64x one adapter's bytes.
- Decode on CUDA (Triton present) is one fused kernel per module for every mix, one adapter included
  (`triton_decode.lora_decode`: shrink, scale, expand and add in one launch); the torch ops below were about 8
  launches per module, a launch-bound cost at small shapes, and 64 mixed adapters took a longer path than one.
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

from rl_multilora.lora import cpu_kernels, triton_decode
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
        if routing is not None and routing.groups and (fused := self._linear_lora(x, routing)) is not None:
            return fused
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
        grad = torch.is_grad_enabled() and (lora_a.requires_grad or x.requires_grad)
        dtype = _compute_dtype(routing, x, lora_a)
        decode = not grad and x.dim() == 3 and x.shape[1] == 1
        if decode and dtype == lora_a.dtype and triton_decode.usable(x, lora_a):  # CUDA decode step
            batch = x.shape[0]
            triton_decode.lora_decode(
                y.view(batch, self.out_features), x.reshape(batch, self.in_features), lora_a, lora_b,
                routing.row_slots, scales, routing.max_rank, routing.active,
            )  # fmt: skip
            return y
        # Base + delta is summed in the LoRA dtype and rounded once to y's dtype, as PEFT does. `out` is y itself
        # when the dtypes match: updating it in place is safe because F.linear does not save its output.
        out = _as(y, dtype)  # out: (B, ..., out)
        g = routing.single
        if g is not None and not grad:  # one slot, contiguous rows, no autograd: PEFT's ops in PEFT's order
            a_s, b_s = _as(lora_a[g.slot, : g.rank], dtype), _as(lora_b[g.slot, :, : g.rank], dtype)
            xa = F.linear(_as(x[g.start : g.stop], dtype), a_s)  # x[g] @ A[s, :r].T
            out[g.start : g.stop].add_(F.linear(xa, b_s) * g.scale)  # += scale * xa @ B.T
            return out.to(y.dtype)
        sink = routing.grad_sink if routing.bank is None else None
        xs = x if routing.active is None else x.index_select(0, routing.active)  # (n, ..., in), n active rows
        n = xs.shape[0]
        x3 = _as(xs, dtype).reshape(n, -1, self.in_features)  # (n, L, in)
        if not grad and x3.shape[1] == 1 and bag_layout(lora_a, lora_b, x3):  # decode: one token per row
            delta2 = bag_lora(x3.view(n, self.in_features), lora_a, lora_b, routing, scales)  # (n, out)
            out2 = out.view(-1, self.out_features)  # (B, out): one token per row
            if routing.active is None:
                out2.add_(delta2)
            else:
                out2.index_add_(0, routing.active, delta2)  # out[active[i]] += delta[i]
            return _as(out, y.dtype)
        if routing.active is None and out.dim() == 3:  # out[i] += scale[i] * x[i] @ A[s_i].T @ B[s_i].T, in place
            # (in place only on `out` itself: a Function may not dirty a view, and F.linear does not save its output)
            grouped_lora(
                out, x3, lora_a, lora_b, routing.row_slots, scales, routing.max_rank, grad, sink=sink,
                slot_index=routing.slot_index() if grad else None,
            )  # fmt: skip
        else:
            delta = out.new_zeros(n, x3.shape[1], self.out_features)
            grouped_lora(
                delta, x3, lora_a, lora_b, routing.row_slots, scales, routing.max_rank, grad, sink=sink,
                slot_index=routing.slot_index() if grad else None,
            )  # fmt: skip
            delta = delta.view(*xs.shape[:-1], self.out_features)
            if routing.active is None:
                out.add_(delta)
            else:
                out.index_add_(0, routing.active, delta)  # out[active[i]] += delta[i]
        return _as(out, y.dtype)

    def _linear_lora(self, x: torch.Tensor, routing: Routing) -> torch.Tensor | None:
        """Training with every row on an adapter: the base Linear and the LoRA in one autograd node (`_LinearLoRA`);
        None where that does not apply (no autograd, base rows, a bank, a trainable base). Float32 slots over a bf16
        base compute in float32 (PEFT's default), or in bf16 with autocast.

        Rows on one slot are still B segments, not one `(1, B * L, in)` segment: one GEMM over all tokens would
        round the slot's products and gradient sums differently from the same rows in a mixed batch, and a tenant's
        numbers must not depend on who shares its batch (paging's and isolation's bit-exact tests).
        """
        params = self._parameters  # read once: each Parameter attribute is an nn.Module.__getattr__ (per module)
        lora_a, lora_b, weight, bias = params["lora_A"], params["lora_B"], params["weight"], params.get("bias")
        if (
            routing.reference
            or routing.active is not None
            or routing.bank is not None
            or x.dim() != 3
            or x.shape[0] != routing.batch_size
            or not torch.is_grad_enabled()
            or not (lora_a.requires_grad or x.requires_grad)
            or weight.requires_grad
            or (bias is not None and bias.requires_grad)
            or x.dtype != weight.dtype
        ):
            return None
        scales = routing.scales_for(self.name)  # (B,)
        if scales is None:
            return None
        group = routing.single
        single = group.slot if group is not None else None  # every row on this slot
        compute = _compute_dtype(routing, x, lora_a)
        y3 = _LinearLoRA.apply(
            x, weight, bias, lora_a, lora_b, routing.row_slots, scales, routing.max_rank, routing.grad_sink,
            routing.slot_index(), single, compute,
        )  # fmt: skip
        return y3.view(*x.shape[:-1], self.out_features)

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


def grouped_lora(
    y3, x3, lora_a, lora_b, slots, scales, r: int, grad: bool, a_slots=None, sink=None, slot_index=None
) -> None:
    """`y3[i] += scale[i] * (x3[i] @ A[a_slot[i], :r].T) @ B[slot[i], :, :r].T` in place, for every row i
    (`a_slots` defaults to `slots`; expert LoRA with a shared A indexes A by slot and B by (slot, expert)).

    With autograd (training) through `_GroupedLoRA`; without (rollout, eval) as plain ops that gather B in its
    stored layout (an index_select of the transposed B costs 2-4x more than of B as stored, which only the backward
    repays) and skip the Function's bookkeeping: a decode step is a few microseconds per layer. `sink`
    (`routing.SlotGradSink`, Linear LoRA only): the backward's A and B gradients go there, for the used slots only.
    `slot_index`: `torch.unique(slots, return_inverse=True)` when the caller has it (`Routing.slot_index()`).
    """
    if grad:
        _GroupedLoRA.apply(y3, x3, lora_a, lora_b, slots, scales, r, a_slots, sink, slot_index)
        return
    a_slots = slots if a_slots is None else a_slots
    if rank_minor(lora_a, lora_b):  # a bank's layout: gather the (in, r) and (r, out) blocks as they are stored
        at = lora_a.transpose(1, 2).narrow(2, 0, r).index_select(0, a_slots)  # at[i] = A[a_slot[i], :r].T; (n, in, r)
        # `x @ at` with `at` (in, r)-contiguous ran 2x as long as with its rows (r, in)-contiguous (24 x 40 tokens)
        at = at.transpose(1, 2).contiguous().transpose(1, 2)  # (n, in, r), a view of (n, r, in)
        bt = lora_b.transpose(1, 2).narrow(1, 0, r).index_select(0, slots)  # bt[i] = B[slot[i], :, :r].T; (n, r, out)
    else:  # gather A and B as stored: an index_select of a transposed view costs 2-4x more
        at = lora_a.narrow(1, 0, r).index_select(0, a_slots).transpose(1, 2)  # (n, in, r)
        bt = lora_b.narrow(2, 0, r).index_select(0, slots).transpose(1, 2)  # (n, r, out)
    at, bt = _as(at, x3.dtype), _as(bt, x3.dtype)  # autocast: the gathered slots in the input's dtype
    # the fp32 scale times the product, rounded once to the LoRA dtype (as PEFT's float `scaling` does)
    xa = _scale_(torch.bmm(x3, at), scales)  # (n, L, r)
    y3.baddbmm_(xa, bt)


def _compute_dtype(routing: Routing, x: torch.Tensor, lora_a: torch.Tensor) -> torch.dtype:
    """The dtype the LoRA's products run in: the slots' (PEFT's default), or the input's with autocast (the slots cast
    to it)."""
    return x.dtype if routing.autocast else lora_a.dtype


def _scale_(prod: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`prod[i] *= scale[i]` in place, `prod: (n, L, r)`: the product times the float32 scale, computed in float32 and
    rounded once to `prod`'s dtype (a bf16 LoRA's product: the same bits as `(prod * scales).to(bf16)`, in one
    kernel instead of two and no new tensor)."""
    return prod.mul_(scales.view(-1, 1, 1))


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`: itself when it already is (a no-op `.to` still costs a dispatch, per module and step)."""
    return t if t.dtype == dtype else t.to(dtype)


def rank_minor(lora_a: torch.Tensor, lora_b: torch.Tensor) -> bool:
    """Whether stacked `A: (S, R, in)` and `B: (S, out, R)` are stored as `(S, in, R)` and `(S, R, out)` (a
    `LoRABank`'s layout): every slot's A is then a table of `in` rows of R values and its B one of R rows of `out`."""
    return lora_a.dim() == 3 and lora_a.transpose(1, 2).is_contiguous() and lora_b.transpose(1, 2).is_contiguous()


def bag_layout(lora_a: torch.Tensor, lora_b: torch.Tensor, x3: torch.Tensor) -> bool:
    """Whether `bag_lora` serves these tensors: float32 on CPU (fbgemm's embedding_bag kernels) and rank-minor."""
    return x3.device.type == "cpu" and lora_a.dtype == torch.float32 == x3.dtype and rank_minor(lora_a, lora_b)


def bag_lora(x2, lora_a, lora_b, routing: Routing, scales) -> torch.Tensor:
    """`delta[i] = scale[i] * (x2[i] @ A[s_i, :r].T) @ B[s_i, :, :r].T`, s = row_slots[i]; x2: (n, in) -> (n, out).

    Decode (one token per row) without a per-row gather: with A stored as `(S * in, R)` rows and B as `(S * R, out)`
    rows (`rank_minor`), row i's `x2[i] @ A[s].T` is the sum of A's `in` rows of slot s weighted by `x2[i]`, and
    `xa[i] @ B[s].T` the sum of B's first r rows of slot s weighted by `xa[i]`: two segmented weighted sums
    (`embedding_bag`, one bag per row), which read each row's slot once where the gather path copies it and reads it
    again. A is summed at its stored width R (the columns above r are exact zeros and are dropped before B).
    """
    n, fan_in = x2.shape
    big_r, r = lora_a.shape[1], routing.max_rank
    table_a = lora_a.transpose(1, 2).reshape(-1, big_r)  # (S * in, R), a view
    table_b = lora_b.transpose(1, 2).reshape(-1, lora_b.shape[1])  # (S * R, out), a view
    index, offsets = routing.bag_index(fan_in, fan_in)
    xa = F.embedding_bag(index, table_a, offsets, mode="sum", per_sample_weights=x2.reshape(-1))  # (n, R)
    xa = xa[:, :r] * scales.view(-1, 1)  # xa[i] = scale[i] * x[i] @ A[s_i, :r].T; (n, r)
    index, offsets = routing.bag_index(big_r, r)
    return F.embedding_bag(index, table_b, offsets, mode="sum", per_sample_weights=xa.reshape(-1))  # (n, out)


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
    def forward(ctx, y3, x3, lora_a, lora_b, slots, scales, r, a_slots=None, sink=None, slot_index=None):
        # x3: (n, L, in), y3: (n, L, out), lora_a: (S, R, in), lora_b: (S, out, R), slots: (n,), scales: (n,)
        # a_slots: (n,) A's index per row when it differs from B's (a shared expert A), else None
        ctx.stacked = (lora_a.shape, lora_b.shape, r, lora_a.dtype)
        ctx.sink = (sink, lora_a, lora_b) if sink is not None else None
        ctx.slot_index = slot_index
        ctx.single = None  # rows are gathered per slot here (`_LinearLoRA` passes a one-slot batch's slot)
        ctx.mark_dirty(y3)
        ctx.kernel = a_slots is None and x3.dtype == torch.float32 and _kernels(x3, lora_a, lora_b, scales)
        if ctx.kernel:
            ctx.save_for_backward(*_kernel_forward(ctx, y3, x3, lora_a, lora_b, slots, scales, r)[1])
            return y3
        a_slots = slots if a_slots is None else a_slots
        a, bt, xa = _grouped_forward(y3, x3, lora_a, lora_b, slots, scales, r, a_slots)
        ctx.save_for_backward(x3, a, bt, xa, slots, scales, a_slots)
        return y3

    @staticmethod
    def backward(ctx, grad):  # grad: (n, L, out)
        grad = grad.contiguous()
        if ctx.kernel:
            need_x = ctx.needs_input_grad[1]
            saved = ctx.saved_tensors
            grad_x = grad.new_zeros(saved[0].shape) if need_x else None
            grad_x, grad_a, grad_b = _kernel_backward(ctx, saved, grad, grad_x, (1, 2, 3))
            return grad, grad_x, grad_a, grad_b, None, None, None, None, None, None
        x3, a, bt, xa, slots, scales, a_slots = ctx.saved_tensors
        grad_x, grad_a, grad_b = _grouped_backward(ctx, grad, None, x3, a, bt, xa, slots, scales, a_slots, (1, 2, 3))
        return grad, grad_x, grad_a, grad_b, None, None, None, None, None, None


class _LinearLoRA(torch.autograd.Function):
    """`y = x @ W.T + bias` of a frozen Linear, then `y[i] += scale[i] * (x[i] @ A[slot[i], :r].T) @ B[slot[i], :,
    :r].T`, in one autograd node: training with every row on an adapter (`LoRALinear._linear_lora`).

    One node instead of the base Linear's and `_GroupedLoRA`'s: the backward adds the LoRA's input gradient into the
    base's `grad @ W` in place (`baddbmm_`) where autograd would allocate a second input gradient and sum the two, a
    pass over an activation-sized tensor per Linear; and the input is saved once, not by both nodes. The LoRA math,
    its per-slot weight gradients and the sink are `_GroupedLoRA`'s. x3: (n, L, in) -> (n, L, out).

    `compute`: the LoRA's dtype when it differs from the base's (float32 slots over a bf16 base without autocast,
    PEFT's default): the input is cast to it, base + delta summed in it and rounded once to the base's dtype (the
    float32 delta added into the bf16 base output in place: one kernel that computes in float32 and rounds, where
    casting the output up and back took two more): the unfused path's forward bits, in one node that keeps the input
    in the base's dtype for the backward (the unfused path keeps a float32 copy: twice the bytes) and casts it again
    there. The input gradient sums the base's and the LoRA's (rounded to the base's dtype) here, before autograd
    sums those of the Linears that share the input: the same bf16 terms in another association, so the gradients
    differ from the unfused path's at bf16 rounding.
    """

    @staticmethod
    def forward(
        ctx, x3, weight, bias, lora_a, lora_b, slots, scales, r, sink=None, slot_index=None, single=None, compute=None
    ):
        cast = compute is not None and compute != x3.dtype
        ctx.stacked = (lora_a.shape, lora_b.shape, r, lora_a.dtype)
        ctx.sink = (sink, lora_a, lora_b) if sink is not None else None
        ctx.slot_index = slot_index
        ctx.kernel = (x3.dtype if compute is None else compute) == torch.float32 and _kernels(
            x3, lora_a, lora_b, scales
        )
        if ctx.kernel:
            ctx.weight = weight  # a frozen Parameter: held, not saved (nothing in the forward changes it)
            if cast:  # a bf16 base: its output first, the float32 delta added and rounded once
                y3, saved = _kernel_forward(ctx, F.linear(x3, weight, bias), x3, lora_a, lora_b, slots, scales, r)
            else:
                y3, saved = _kernel_forward(ctx, None, x3, lora_a, lora_b, slots, scales, r, weight, bias)
            ctx.save_for_backward(*saved)
            return y3
        y3 = F.linear(x3, weight, bias)  # (n, L, out)
        xc = x3.to(compute) if cast else x3  # (n, L, in)
        a, bt, xa = _grouped_forward(y3, xc, lora_a, lora_b, slots, scales, r, slots, single)
        ctx.save_for_backward(x3, weight, a, bt, xa, slots, scales)
        ctx.compute = compute if cast else None
        ctx.single = single
        return y3

    @staticmethod
    def backward(ctx, grad):  # grad: (n, L, out)
        grad = grad.contiguous()
        if ctx.kernel:
            saved = ctx.saved_tensors
            if saved[0].dtype == torch.float32:  # the LoRA's input gradient, the base's added onto it
                grad_x, grad_a, grad_b = _kernel_backward(ctx, saved, grad, None, (0, 3, 4), ctx.weight)
            else:  # a bf16 base: its input gradient, then the LoRA's float32 one added and rounded
                grad_x = torch.matmul(grad, ctx.weight) if ctx.needs_input_grad[0] else None
                grad_x, grad_a, grad_b = _kernel_backward(ctx, saved, grad, grad_x, (0, 3, 4))
            return grad_x, None, None, grad_a, grad_b, None, None, None, None, None, None, None
        x3, weight, a, bt, xa, slots, scales = ctx.saved_tensors
        base_x = None
        if ctx.needs_input_grad[0]:  # grad @ W: (n, L, in)
            base_x = torch.matmul(grad, weight)
        inputs = (0, 3, 4)
        if ctx.compute is None:
            grad_x, grad_a, grad_b = _grouped_backward(ctx, grad, base_x, x3, a, bt, xa, slots, scales, slots, inputs)
        else:  # the unfused path's order: the LoRA's input gradient in `compute`, rounded, then summed with the base's
            gc, xc = grad.to(ctx.compute), x3.to(ctx.compute)
            lora_x, grad_a, grad_b = _grouped_backward(ctx, gc, None, xc, a, bt, xa, slots, scales, slots, inputs)
            grad_x = None if base_x is None else base_x.add_(lora_x.to(base_x.dtype))
        return grad_x, None, None, grad_a, grad_b, None, None, None, None, None, None, None


def _kernels(x3, lora_a, lora_b, scales) -> bool:
    """Whether a training forward whose LoRA computes in float32 takes the C kernels (`cpu_kernels`): float32 slots
    on a CPU that has them (a bf16 base's input is cast to float32 for them, as the torch path casts it)."""
    return cpu_kernels.usable(lora_a, lora_b, scales) and x3.device.type == "cpu"


def _kernel_forward(ctx, y3, x3, lora_a, lora_b, slots, scales, r, weight=None, bias=None):
    """`y3[i] += scale[i] * (x3[i] @ A[slot[i], :r].T) @ B[slot[i], :, :r].T` in place with `cpu_kernels.forward`,
    in float32 (a bf16 `y3` gets the float32 sum rounded once, as the torch path does); returns `(y3, saved)`,
    `saved` the tensors its backward reads: the input as given (a bf16 input stays bf16), the used slots' A and B
    (copies padded to a multiple of 8 ranks), `xa`, the used slots and each row's index into them, the scales.

    With `weight` (`_LinearLoRA`, float32, y3 None) the base's product is added after the LoRA's instead of before:
    the kernel writes the delta into a new output and the base GEMM accumulates onto it (`addmm_`, beta 1) while
    each tile is in cache, where adding the delta to the GEMM's output read it back from memory (MKL's large
    outputs leave the caches): 0.9 against 0.37 ms at SmolLM2's MLP width (16 x 64 tokens, one thread)."""
    used, inverse = _slot_index(ctx, slots)  # (U,), (n,)
    xc = x3.to(torch.float32).contiguous()
    at, bt, a, b = cpu_kernels.slot_weights(lora_a, lora_b, used, r)  # A.T, B.T, A, B of the used slots
    if weight is not None:
        y3 = xc.new_empty(*xc.shape[:-1], weight.shape[0])
        xa = cpu_kernels.forward(y3, xc, at, bt, inverse, scales, fresh=True)  # y3 = delta
        y2 = y3.view(-1, weight.shape[0])
        if bias is not None:
            y2.add_(bias)
        y2.addmm_(xc.view(-1, xc.shape[-1]), weight.t())  # y3 += x3 @ W.T
    else:
        yc = (
            y3
            if y3.dtype == torch.float32 and y3.is_contiguous()
            else y3.to(torch.float32, memory_format=torch.contiguous_format)
        )
        xa = cpu_kernels.forward(yc, xc, at, bt, inverse, scales)  # (n, L, R8)
        if yc is not y3:
            y3.copy_(yc)
    return y3, (x3 if x3.dtype != torch.float32 else xc, a, b, xa, used, inverse, scales)


def _kernel_backward(ctx, saved, grad, grad_x, inputs, weight=None):
    """`_kernel_forward`'s gradients: the LoRA's input gradient (float32) added into `grad_x` in place (rounded to its
    dtype when that is not float32), the used slots' A and B gradients to the sink or as stacked gradients (other
    slots exactly zero). Returns (grad_x, grad_a, grad_b), None for what the sink took or no input needs.

    With `weight` (`_LinearLoRA`, float32, grad_x None) the input gradient is made here, the LoRA's part first and
    the base's `grad @ W` accumulated onto it (`addmm_`), for the forward's reason; None when x needs none."""
    x3, a, b, xa, used, inverse, scales = saved  # ctx.saved_tensors, unpacked once (activation checkpointing)
    shape_a, shape_b, r, dtype = ctx.stacked
    need_x, need_a, need_b = (ctx.needs_input_grad[i] for i in inputs)
    xc, gc = x3.to(torch.float32).contiguous(), grad.to(torch.float32).contiguous()
    if weight is not None:
        grad_x = xc.new_empty(xc.shape) if need_x else None
        ga, gb = cpu_kernels.backward(xc, gc, xa, a, b, inverse, scales, grad_x, fresh=True)
        if grad_x is not None:
            grad_x.view(-1, xc.shape[-1]).addmm_(gc.view(-1, gc.shape[-1]), weight)  # += grad @ W
    else:
        lora_x = (
            grad_x
            if grad_x is None or grad_x.dtype == torch.float32
            else torch.zeros_like(grad_x, dtype=torch.float32)
        )
        ga, gb = cpu_kernels.backward(xc, gc, xa, a, b, inverse, scales, lora_x)  # (U, R8, in), (U, R8, out)
        if lora_x is not grad_x:
            grad_x.add_(lora_x.to(grad_x.dtype))
    compact_a = _padded(ga.narrow(1, 0, r).contiguous(), shape_a[1], 1)  # (U, R, in): ga itself at r = R8 = R
    compact_b = _padded(gb.narrow(1, 0, r).transpose(1, 2).contiguous(), shape_b[2], 2)  # (U, out, R)
    if ctx.sink is not None:
        sink, lora_a, lora_b = ctx.sink
        if need_a:
            sink.add(lora_a, used, _as(compact_a, dtype))
        if need_b:
            sink.add(lora_b, used, _as(compact_b, dtype))
        return grad_x, None, None
    grad_a = compact_a.new_zeros(shape_a).index_copy_(0, used, compact_a) if need_a else None
    grad_b = compact_b.new_zeros(shape_b).index_copy_(0, used, compact_b) if need_b else None
    return grad_x, grad_a, grad_b


def _grouped_forward(y3, x3, lora_a, lora_b, slots, scales, r, a_slots, single=None):
    """`y3[i] += scale[i] * (x3[i] @ a[i].T) @ bt[i]` in place; returns `a: (n, r, in)`, `bt: (n, r, out)` (each
    row's slot) and `xa = scale * x3 @ a.T: (n, L, r)`, which the backward reads.

    `single`: the slot every row uses, when there is one (a batch of one tenant): `a` and `bt` are then that slot
    expanded over the rows (stride 0, no copy) instead of a gathered copy per row, which at SmolLM2's shape was as
    many bytes as the layer's activations and was kept for the backward. On CPU the slot's `B.T` is copied
    contiguous once (`r x out` values), the layout a gathered row has: each row's batched product is then the same
    GEMM on the same values in the same layout either way, so the results are the same bit for bit
    (tests/test_grouped_lora.py). Read as a stride-0 view of B as stored, the backward's `grad @ B` was another MKL
    kernel (a tenant's gradients differed from the same rows in a mixed batch at SmolLM2's widths) and 2.5-4.4x
    slower (0.68 against 0.27 ms at width 576, 1.86 against 0.76 at 1,536; 16 x 64 tokens, 1 thread)."""
    dtype = x3.dtype  # autocast: the slots are cast to the input's dtype, before the expand (one slot's bytes)
    if single is not None:
        n = x3.shape[0]
        a = _as(lora_a.narrow(0, single, 1).narrow(1, 0, r), dtype).expand(n, -1, -1)  # (n, r, in): A[single, :r]
        bt = _as(lora_b.narrow(0, single, 1).narrow(2, 0, r).transpose(1, 2), dtype)  # (1, r, out): B[single].T
        if _copy_slot_b(x3):
            bt = bt.contiguous()  # one `(r, out)` copy: the layout of a gathered row
        bt = bt.expand(n, -1, -1)  # (n, r, out)
    else:
        a = _as(lora_a.narrow(1, 0, r).index_select(0, a_slots), dtype)  # a[i] = A[a_slot[i], :r]; (n, r, in)
        bt = _as(lora_b.narrow(2, 0, r).transpose(1, 2).index_select(0, slots), dtype)  # B[slot[i], :, :r].T
    xa = _scale_(_shrink(x3, a), scales)  # xa[i] = scale[i] * x[i] @ a[i].T; (n, L, r)
    if y3.dtype == xa.dtype:
        y3.baddbmm_(xa, bt)  # y[i] += xa[i] @ bt[i]
    else:  # a bf16 base's output, a float32 LoRA: summed in float32, rounded once (y3 + delta in y3's kernel)
        y3.add_(torch.bmm(xa, bt))  # y[i] += xa[i] @ bt[i]
    return a, bt, xa


def _shrink(x3: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x3[i] @ w[i].T` for every row: x3 `(n, L, k)`, w `(n, r, k)` -> `(n, L, r)`.

    On CPU computed rank-major (`w @ x3.T`, returned as a transposed view), which MKL ran 1.7x as fast as the
    token-major product at SmolLM2's widths; it computes a token's values alike for every row length from
    `_rank_major_floor` tokens on, so shorter rows are zero-padded up to it (a tenant's numbers must not follow its
    micro-batch's padding)."""
    if x3.is_cuda or (floor := _rank_major_floor(w.shape[1], x3.shape[2], x3.dtype)) is None:
        return torch.bmm(x3, w.transpose(1, 2))
    length = x3.shape[1]
    if length >= floor:
        return torch.bmm(w, x3.transpose(1, 2)).transpose(1, 2)
    padded = torch.bmm(w, F.pad(x3, (0, 0, 0, floor - length)).transpose(1, 2))  # (n, r, floor)
    return padded.narrow(2, 0, length).contiguous().transpose(1, 2)  # the backward keeps no padding


_FLOORS: dict[tuple[int, int, torch.dtype], int | None] = {}


def _rank_major_floor(r: int, k: int, dtype: torch.dtype) -> int | None:
    """The fewest tokens from which a rank-major `w @ x.T` (`(r, k) x (k, N)`) gives each token the same bits
    whatever N is on this machine's CPU kernels (12 with MKL here), probed once per shape; None when it never does up
    to 64 (the token-major product is used then)."""
    key = (r, k, dtype)
    if key not in _FLOORS:
        with torch.autocast("cpu", enabled=False), torch.no_grad():  # the probe's own dtype, whatever the caller's
            _FLOORS[key] = _probe_floor(r, k, dtype)
    return _FLOORS[key]


def _probe_floor(r: int, k: int, dtype: torch.dtype) -> int | None:
    """`_rank_major_floor`'s measurement: the products of every length from 64 down, against one of 160 tokens."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1, r, k, generator=g).to(dtype)
    x = torch.randn(1, 160, k, generator=g).to(dtype)
    ref = torch.bmm(w, x.transpose(1, 2))  # (1, r, 160)
    floor = None
    for n in range(64, 0, -1):
        if not all(torch.equal(torch.bmm(w, x[:, :m].transpose(1, 2)), ref[..., :m]) for m in (n, n + 96)):
            break
        floor = n
    return floor


def _copy_slot_b(x: torch.Tensor) -> bool:
    """Whether a one-slot batch copies its slot's `B.T` contiguous (`_grouped_forward`): on CPU. cuBLAS takes either
    layout at one speed, and there a one-slot batch's numbers differ from a mixed batch's at rounding anyway
    (`one_gemm_weight_grads`): the copy would be one more kernel launch per Linear and forward."""
    return not x.is_cuda


def _slot_index(ctx, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(used slots ascending (U,), each row's index into them (n,)): the routing's when the Function was given it."""
    index = getattr(ctx, "slot_index", None)
    return index if index is not None else torch.unique(slots, return_inverse=True)


def _grouped_backward(ctx, grad, grad_x, x3, a, bt, xa, slots, scales, a_slots, inputs):
    """Input and per-slot weight gradients of `_grouped_forward`, for a Function whose x3 / lora_a / lora_b inputs
    are at positions `inputs`. `grad_x`, when given (the base's), gets the LoRA's input gradient added in place.
    Returns (grad_x, grad_a, grad_b); with a
    sink (see SlotGradSink) the weight grads go there."""
    shape_a, shape_b, r, dtype = ctx.stacked  # dtype: the stacked slots' (the gradients'), autocast or not
    need_x, need_a, need_b = (ctx.needs_input_grad[i] for i in inputs)
    g_xa = _scale_(_shrink(grad, bt), scales)  # d/d(x[i] @ a[i].T); (n, L, r)
    if need_x:
        grad_x = torch.bmm(g_xa, a) if grad_x is None else grad_x.baddbmm_(g_xa, a)  # (n, L, in)
    if ctx.single is not None and one_gemm_weight_grads(grad):
        grad_a, grad_b = _single_slot_weight_grads(ctx, ctx.single, slots, grad, x3, xa, g_xa, need_a, need_b)
        return grad_x, grad_a, grad_b
    grad_a = grad_b = None
    if ctx.sink is not None:  # only the used slots' gradients, handed to the sink (see SlotGradSink)
        sink, lora_a, lora_b = ctx.sink
        used, inverse = _slot_index(ctx, slots)  # (U,), (n,)
        if need_a:
            rows = _as(torch.bmm(g_xa.transpose(1, 2), x3), dtype)  # dA[slot[i]] += g_xa[i].T @ x[i]; (n, r, in)
            compact = rows.new_zeros(len(used), *shape_a[1:])  # (U, R, in)
            compact.narrow(1, 0, r).index_add_(0, inverse, rows)  # same rows, same order as the dense path
            sink.add(lora_a, used, compact)
        if need_b:
            sink.add(lora_b, *_b_grad_per_used_slot(ctx, grad, xa, slots))
        return grad_x, None, None
    if need_a:
        rows = _as(torch.bmm(g_xa.transpose(1, 2), x3), dtype)  # dA[slot[i]] += g_xa[i].T @ x[i]; (n, r, in)
        grad_a = rows.new_zeros(shape_a)  # slots without rows get exactly zero
        grad_a.narrow(1, 0, r).index_add_(0, a_slots, rows)
    if need_b:
        used, compact = _b_grad_per_used_slot(ctx, grad, xa, slots)
        grad_b = compact.new_zeros(shape_b).index_copy_(0, used, compact)  # slots without rows get exactly zero
    return grad_x, grad_a, grad_b


def _b_grad_per_used_slot(ctx, grad, xa, slots) -> tuple[torch.Tensor, torch.Tensor]:
    """(used slots (U,), B's gradient of each `(U, out, R)`): `dB[slot[i]].T += xa[i].T @ grad[i]` summed per slot
    with `index_add_`, rows in order. On CUDA the rows are added straight into the transposed view of the result (one
    kernel); on CPU, where `index_add_` into a transposed view took 10-13x the time of one into a contiguous tensor
    (16 rows at SmolLM2's MLP width), into a contiguous `(U, r, out)` and then one copy. The same additions in the
    same order either way."""
    shape_b, r, dtype = ctx.stacked[1], ctx.stacked[2], ctx.stacked[3]
    used, inverse = _slot_index(ctx, slots)  # (U,), (n,)
    rows = _as(torch.bmm(xa.transpose(1, 2), grad), dtype)  # (n, r, out)
    compact = rows.new_zeros(len(used), *shape_b[1:])  # (U, out, R)
    if rows.is_cuda:
        compact.narrow(2, 0, r).transpose(1, 2).index_add_(0, inverse, rows)
    else:
        per_slot = rows.new_zeros(len(used), r, shape_b[1]).index_add_(0, inverse, rows)  # (U, r, out)
        compact.narrow(2, 0, r).copy_(per_slot.transpose(1, 2))
    return used, compact


def one_gemm_weight_grads(t: torch.Tensor) -> bool:
    """Whether a one-slot batch's weight gradients are one GEMM over all its tokens (`_single_slot_weight_grads`)
    instead of a product per row summed into the slot with `index_add_`: on CUDA.

    On CPU the per-row path stays: there a tenant's gradients are the same bits whoever shares its batch (the paging
    and isolation tests hold that). On CUDA they are not (`bench/isolation_probe.py` on an H100: cuBLAS picks its
    kernels by the batch's size, and from 24 rows on a micro-batch's gradients did not even repeat, as `index_add_`
    over more than 16 indices adds with atomics). So the one GEMM costs no property there, and it saves 4 of a LoRA
    Linear's 16-18 kernels a step (with the trainer's gradient sink), the per-row `(n, r, in)` and `(n, r, out)`
    products, and the atomics: a one-slot batch's gradients repeat."""
    return t.is_cuda


def _single_slot_weight_grads(ctx, single, slots, grad, x3, xa, g_xa, need_a, need_b):
    """A and B gradients of a batch on one slot, each one GEMM over all `n * L` tokens:
    `dA[s, :r] = g_xa.T @ x`, `dB[s, :, :r] = grad.T @ xa` (rows flattened). Into the sink as a one-slot compact
    tensor, or into zero-filled stacked gradients (the other slots exactly zero). Returns (grad_a, grad_b)."""
    shape_a, shape_b, r, dtype = ctx.stacked
    da = _as(torch.mm(g_xa.reshape(-1, r).t(), x3.reshape(-1, shape_a[2])), dtype) if need_a else None  # (r, in)
    db = _as(torch.mm(grad.reshape(-1, shape_b[1]).t(), xa.reshape(-1, r)), dtype) if need_b else None  # (out, r)
    if ctx.sink is not None:
        sink, lora_a, lora_b = ctx.sink
        used, _ = _slot_index(ctx, slots)  # (1,): the slot
        if da is not None:
            sink.add(lora_a, used, _padded(da, shape_a[1], 0).unsqueeze(0))  # (1, R, in)
        if db is not None:
            sink.add(lora_b, used, _padded(db, shape_b[2], 1).unsqueeze(0))  # (1, out, R)
        return None, None
    grad_a = grad_b = None
    if da is not None:
        grad_a = da.new_zeros(shape_a)
        grad_a[single].narrow(0, 0, r).copy_(da)
    if db is not None:
        grad_b = db.new_zeros(shape_b)
        grad_b[single].narrow(1, 0, r).copy_(db)
    return grad_a, grad_b


def _padded(t: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """`t` zero-padded along `dim` to `size` (itself when it is that size already: a slot at the batch's max rank)."""
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size
    out = t.new_zeros(shape)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out
