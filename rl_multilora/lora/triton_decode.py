"""One fused kernel per LoRA module for a decode step on CUDA (Triton): shrink, scale, expand and add, in place.

Design choices:

- A decode step (one token per row, no autograd) is launch-bound at small shapes: at SmolLM2-135M's (hidden 576, 30
  layers, 210 LoRA modules) the torch ops of the gather path (convert x and y, gather A and B per row, two batched
  matmuls, scale, add, convert back: about 8 kernels and their Python per module) cost more than the base model's own
  step, and a mix of 64 adapters took a different path with more ops than one adapter's. Here every mix, one adapter
  included, is one launch per module: program (i, j) computes row i's `xa = scale_i * x_i @ A[s_i, :r].T` (r <= 16
  values, recomputed by each of the row's output blocks, which is `in * r` MACs) and adds `xa @ B[s_i, j-block, :r].T`
  into its block of `y`. It reads each row's own slot straight from the stacked tensors (BGMV, as Punica / S-LoRA),
  so 64 distinct adapters cost one adapter's launches; what grows with the mix is the bytes read (64 slots' A and
  B instead of one slot's from cache), small against the base's weights on a GPU.
- Numerics are the grouped path's: x and y are read in their own dtype and widened to float32, `xa` is rounded once
  to the LoRA dtype (a no-op for the default float32 LoRA), the sum `y + delta` is taken in float32 and rounded once
  to y's dtype, as PEFT sums base + delta in the adapter dtype and rounds once. Only the order of the float32
  reductions differs from cuBLAS's, so values agree with the float32 loop to rounding (tests/test_triton_decode.py,
  on the GPU and under Triton's interpreter).
- Used only where it applies (`usable`): a CUDA tensor, Triton importable, one token per row, no autograd, rank at
  most 64. Everything else (CPU, prefill, training) keeps its path; `RL_MULTILORA_TRITON_DECODE=0` turns it off.
"""

from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of torch; CPU installs do without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

MAX_RANK = 64
ENABLED = os.environ.get("RL_MULTILORA_TRITON_DECODE", "1") != "0"


def usable(x: torch.Tensor, lora_a: torch.Tensor) -> bool:
    """Whether `lora_decode` serves this decode step: CUDA, Triton present, enabled, a rank it handles."""
    return ENABLED and triton is not None and x.is_cuda and lora_a.dim() == 3 and lora_a.shape[1] <= MAX_RANK


def lora_decode(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
    scales: torch.Tensor,
    rank: int,
    rows: torch.Tensor | None = None,
) -> None:
    """`y[rows[i]] += scale[i] * (x[rows[i]] @ A[slot[i], :rank].T) @ B[slot[i], :, :rank].T` in place, for every i.

    y: (B, out), x: (B, in), lora_a: (S, R, in), lora_b: (S, out, R) (any strides), slots and scales: (n,), rows:
    (n,) row indices into x and y (None: row i is i, n == B).
    """
    n = slots.shape[0]
    if n == 0 or rank == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    if y.stride(-1) != 1:
        raise ValueError("lora_decode writes y in place and needs its last dim contiguous")
    fan_in, fan_out = x.shape[-1], y.shape[-1]
    block_r = max(2, triton.next_power_of_2(rank))
    block_in = min(256, triton.next_power_of_2(fan_in))
    block_out = min(256, triton.next_power_of_2(fan_out))
    grid = (n, triton.cdiv(fan_out, block_out))
    _lora_decode_kernel[grid](
        y, x, lora_a, lora_b, slots, scales, slots if rows is None else rows,
        fan_out, rank,
        x.stride(0), y.stride(0),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        FAN_IN=fan_in, HAS_ROWS=rows is not None, BLOCK_R=block_r, BLOCK_IN=block_in, BLOCK_OUT=block_out,
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _lora_decode_kernel(
        y_ptr, x_ptr, a_ptr, b_ptr, slot_ptr, scale_ptr, row_ptr,
        fan_out, rank,
        stride_x, stride_y,
        stride_as, stride_ar, stride_ai,
        stride_bs, stride_bo, stride_br,
        FAN_IN: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_IN: tl.constexpr, BLOCK_OUT: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0)  # the i-th row on an adapter
        j = tl.program_id(1)  # its block of output features
        if HAS_ROWS:
            row = tl.load(row_ptr + i).to(tl.int64)
        else:
            row = i.to(tl.int64)
        slot = tl.load(slot_ptr + i).to(tl.int64)
        scale = tl.load(scale_ptr + i).to(tl.float32)
        r = tl.arange(0, BLOCK_R)
        r_in = r < rank
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, FAN_IN, BLOCK_IN):  # xa = x[row] @ A[slot, :rank].T
            k = k0 + tl.arange(0, BLOCK_IN)
            k_in = k < FAN_IN
            xk = tl.load(x_ptr + row * stride_x + k, mask=k_in, other=0.0).to(tl.float32)
            a = tl.load(
                a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :] * stride_ai,
                mask=r_in[:, None] & k_in[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(a * xk[None, :], axis=1)
        xa = (acc * scale).to(a_ptr.dtype.element_ty).to(tl.float32)  # rounded once to the LoRA dtype
        o = j * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        o_in = o < fan_out
        b = tl.load(
            b_ptr + slot * stride_bs + o[:, None] * stride_bo + r[None, :] * stride_br,
            mask=o_in[:, None] & r_in[None, :],
            other=0.0,
        ).to(tl.float32)
        delta = tl.sum(b * xa[None, :], axis=1)  # (BLOCK_OUT,)
        y_at = y_ptr + row * stride_y + o
        base = tl.load(y_at, mask=o_in, other=0.0).to(tl.float32)
        tl.store(y_at, (base + delta).to(y_ptr.dtype.element_ty), mask=o_in)
