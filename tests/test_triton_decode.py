"""The fused CUDA decode kernel (`rl_multilora.lora.triton_decode`) against the float32 per-row loop.

On a CUDA GPU (marked `gpu`) the compiled kernel runs, alone and inside a model's decode step through an engine bank;
where Triton is installed without a GPU, the same kernel runs under Triton's interpreter (`TRITON_INTERPRET=1`) on
CPU tensors. CPU installs carry no Triton, so there both skip; the layer never takes this path on CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_grouped_lora import MIXES, TOL, add, batch, make_model
from tiny_models import FAMILIES
from transformers import DynamicCache

from rl_multilora.lora import triton_decode
from rollout.engines.embedded import kv_cache_kwarg

# (fan_in, fan_out, rank, R, lora dtype, base dtype): SmolLM2's widths, odd widths, ranks below R, bf16 LoRA
CASES = [
    (576, 1536, 8, 8, torch.float32, torch.bfloat16),
    (1536, 576, 5, 8, torch.float32, torch.bfloat16),
    (48, 80, 3, 4, torch.float32, torch.float32),
    (300, 7, 16, 16, torch.bfloat16, torch.bfloat16),
    (64, 64, 1, 1, torch.float32, torch.float16),
]


def loop(y, x, lora_a, lora_b, slots, scales, rank, rows, lora_dtype):
    """The grouped path's numerics, one row at a time in float32: xa rounded to the LoRA dtype, y + delta once."""
    out = y.clone()
    for i, (slot, scale) in enumerate(zip(slots.tolist(), scales.tolist(), strict=True)):
        row = i if rows is None else int(rows[i])
        xa = (x[row].float() @ lora_a[slot, :rank].float().T) * scale
        xa = xa.to(lora_dtype).float()
        out[row] = (y[row].float() + xa @ lora_b[slot, :, :rank].float().T).to(y.dtype)
    return out


def tolerance(want: torch.Tensor, base_dtype, lora_dtype) -> dict:
    """float32 throughout: rounding; a 16-bit y or xa: a few units in the last place of the output's magnitude (the
    float32 sums' order differs from the loop's, so a value can round to the neighbouring 16-bit number)."""
    if base_dtype == lora_dtype == torch.float32:
        return {"atol": 2e-5, "rtol": 2e-5}
    return {"atol": 2e-2 * float(want.float().abs().max()), "rtol": 2e-2}


def run_cases(kernel_module, device: str) -> None:
    g = torch.Generator().manual_seed(0)
    for fan_in, fan_out, rank, big_r, lora_dtype, base_dtype in CASES:
        slots_total, batch_rows = 9, 12
        lora_a = torch.randn(slots_total, big_r, fan_in, generator=g).to(lora_dtype)
        lora_b = torch.randn(slots_total, fan_out, big_r, generator=g).to(lora_dtype)
        x = torch.randn(batch_rows, fan_in, generator=g).to(base_dtype)
        y = torch.randn(batch_rows, fan_out, generator=g).to(base_dtype)
        for rows in (None, torch.tensor([0, 2, 3, 7, 11])):  # every row on an adapter / base rows left alone
            n = batch_rows if rows is None else len(rows)
            for slots in (torch.randint(0, slots_total, (n,), generator=g), torch.full((n,), 4)):  # mixed / one
                scales = torch.rand(n, generator=g) * 2
                want = loop(y, x, lora_a, lora_b, slots, scales, rank, rows, lora_dtype)
                got = y.clone().to(device)
                kernel_module.lora_decode(
                    got, x.to(device), lora_a.to(device), lora_b.to(device), slots.to(device), scales.to(device),
                    rank, None if rows is None else rows.to(device),
                )  # fmt: skip
                tol = tolerance(want, base_dtype, lora_dtype)
                torch.testing.assert_close(got.cpu(), want, **tol)
                if rows is not None:  # base rows are untouched, bit for bit
                    untouched = [r for r in range(batch_rows) if r not in rows.tolist()]
                    assert torch.equal(got.cpu()[untouched], y[untouched])
        # rank-minor storage (a CPU bank's layout) through strides
        a_rm = lora_a.transpose(1, 2).contiguous().transpose(1, 2)
        b_rm = lora_b.transpose(1, 2).contiguous().transpose(1, 2)
        slots = torch.randint(0, slots_total, (batch_rows,), generator=g)
        scales = torch.rand(batch_rows, generator=g)
        got = y.clone().to(device)
        kernel_module.lora_decode(got, x.to(device), a_rm.to(device), b_rm.to(device), slots.to(device),
                                  scales.to(device), rank)  # fmt: skip
        want = loop(y, x, lora_a, lora_b, slots, scales, rank, None, lora_dtype)
        torch.testing.assert_close(got.cpu(), want, **tol)


def test_kernel_equals_float32_loop_under_the_interpreter():
    """Triton's interpreter is chosen when Triton is imported, so the cases run in a fresh interpreter."""
    pytest.importorskip("triton")
    tests = Path(__file__).parent
    code = "import test_triton_decode as t; from rl_multilora.lora import triton_decode as k; t.run_cases(k, 'cpu')"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.gpu
def test_kernel_equals_float32_loop_on_cuda():
    pytest.importorskip("triton")
    run_cases(triton_decode, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("mix", list(MIXES))
def test_decode_step_through_the_bank_on_cuda_equals_reference_loop(mix, monkeypatch):
    """A model's decode step on CUDA takes the kernel (counted) and gives the float32 loop's logits."""
    pytest.importorskip("triton")
    calls = []
    kernel = triton_decode.lora_decode
    monkeypatch.setattr(triton_decode, "lora_decode", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    names, specs, kw = MIXES[mix]
    kw = dict(kw)
    length = kw.pop("length", 7)
    family = FAMILIES[list(MIXES).index(mix) % len(FAMILIES)]
    m = make_model(family, **{"max_loras": 8, **kw}).to("cuda")
    add(m, specs)
    bank = m.new_bank()
    slots = [-1 if n is None else m.slot_of(n) for n in names]
    ids, _ = batch(rows=len(names), length=length, left_pad=False)
    ids = ids.to("cuda")
    with torch.no_grad():
        ref = m(ids, adapter_names=names, reference=True).logits[:, -1]
        cache = {kv_cache_kwarg(m.base_model): DynamicCache(config=m.base_model.config)}
        m(ids[:, :-1], adapter_slots=slots, lora_bank=bank, **cache, use_cache=True)
        assert not calls  # the prefill (several tokens per row) keeps its path
        step = m(ids[:, -1:], adapter_slots=slots, lora_bank=bank, **cache, use_cache=True).logits
    assert calls or all(n is None for n in names)
    torch.testing.assert_close(step[:, -1], ref, **TOL)
