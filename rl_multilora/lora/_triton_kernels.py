"""The Triton kernel behind `rl_multilora.lora.triton_decode` (see there), in a module of its own so that importing the
LoRA layers never imports Triton: it is imported on a CUDA decode step's first use."""

from __future__ import annotations

try:  # CUDA builds of torch bring Triton; without it this module defines nothing
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:

    @triton.jit
    def lora_decode_kernel(
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
