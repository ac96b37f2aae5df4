"""One fused kernel per LoRA module for a decode step on CUDA (Triton): shrink, scale, expand and add, in place.

Design choices:

- A decode step (one token per row, no autograd) is launch-bound at small shapes: at SmolLM2-135M's (hidden 576, 30
  layers, 210 LoRA modules) the torch ops of the gather path (convert x and y, gather A and B per row, two batched
  matmuls, scale, add, convert back: about 8 kernels and their Python per module) cost more than the base model's own
  step, and a mix of 64 adapters took a different path with more ops than one adapter's. Here every mix, one adapter
  included, is one launch per module: program (i, j) computes row i's `xa = scale_i * x_i @ A[s_i, :r].T` (r <= 64
  values, recomputed by each of the row's output blocks, which is `in * r` MACs) and adds `xa @ B[s_i, j-block, :r].T`
  into its block of `y`. It reads each row's own slot straight from the stacked tensors (BGMV, as Punica / S-LoRA),
  so 64 distinct adapters cost one adapter's launches; what grows with the mix is the bytes read (64 slots' A and
  B instead of one slot's from cache), small against the base's weights on a GPU.
- Numerics are the grouped path's: x and y are read in their own dtype and widened to float32, `xa` is rounded once
  to the LoRA dtype (a no-op for the default float32 LoRA), the sum `y + delta` is taken in float32 and rounded once
  to y's dtype, as PEFT sums base + delta in the adapter dtype and rounds once. Only the order of the float32
  reductions differs from cuBLAS's, so values agree with the float32 loop to rounding (tests/test_triton_decode.py,
  on the GPU and under Triton's interpreter).
- Used only where it applies (`usable`): a CUDA tensor, Triton installed, one token per row, no autograd, rank at
  most 64. Everything else (CPU, prefill, training) keeps its path; `RL_MULTILORA_TRITON_DECODE=0` turns it off.
  Triton is imported on the first CUDA decode step (the kernel lives in `_triton_kernels.py`), so importing the
  layers costs nothing on CPU.
"""

from __future__ import annotations

import importlib.util
import os

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None  # CUDA builds of torch bring it; imported on first use

MAX_RANK = 64
_KERNEL = None  # `_triton_kernels.lora_decode_kernel` once loaded
ENABLED = os.environ.get("RL_MULTILORA_TRITON_DECODE", "1") != "0"


def usable(x: torch.Tensor, lora_a: torch.Tensor) -> bool:
    """Whether `lora_decode` serves this decode step: CUDA, Triton present, enabled, a rank it handles."""
    return ENABLED and HAVE_TRITON and x.is_cuda and lora_a.dim() == 3 and lora_a.shape[1] <= MAX_RANK


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
    global _KERNEL
    if _KERNEL is None:  # Triton is imported on the first CUDA decode step, not with the layers
        from rl_multilora.lora._triton_kernels import lora_decode_kernel

        _KERNEL = lora_decode_kernel
    n = slots.shape[0]
    if n == 0 or rank == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    if y.stride(-1) != 1:
        raise ValueError("lora_decode writes y in place and needs its last dim contiguous")
    fan_in, fan_out = x.shape[-1], y.shape[-1]
    block_r = max(2, _next_power_of_2(rank))
    block_in = min(256, _next_power_of_2(fan_in))
    block_out = min(256, _next_power_of_2(fan_out))
    grid = (n, -(-fan_out // block_out))
    _KERNEL[grid](
        y, x, lora_a, lora_b, slots, scales, slots if rows is None else rows,
        fan_out, rank,
        x.stride(0), y.stride(0),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        FAN_IN=fan_in, HAS_ROWS=rows is not None, BLOCK_R=block_r, BLOCK_IN=block_in, BLOCK_OUT=block_out,
    )  # fmt: skip


def _next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (n >= 1).

    >>> [_next_power_of_2(n) for n in (1, 5, 8, 576)]
    [1, 8, 8, 1024]
    """
    return 1 << (n - 1).bit_length()
