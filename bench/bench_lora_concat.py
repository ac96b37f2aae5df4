"""Would appending the LoRA to the base weight's GEMMs bring one adapter's LoRA near 1.06x? A per-Linear probe.

Usage: `python bench/bench_lora_concat.py [--rows 16] [--seq-len 64] [--runs 5] [--reps 20] [--threads 1] [--step]`

The idea: the forward's `x @ A.T` and the backward's `grad @ B` are each a pass over an activation, and the base
GEMMs read the same activations, so `x @ [W; A].T` gives `y` and `x @ A.T` from one read of `x`, and
`grad @ [W, B]` gives `grad @ W` and `grad @ B` from one read of `grad` (on this CPU the base columns of the
concatenated products are the base GEMM's bits, and a row's results do not depend on how many rows share the GEMM,
so a tenant's numbers could stay independent of its batch if every batch ran it per run of rows on one slot).
What stays: `y += xa @ B.T`, `grad_x += g_xa @ A`, and the weight gradients `g_xa.T @ x` and `xa.T @ grad`, four
passes, and the concatenation itself copies `W` twice per call (the frozen weight cannot hold both layouts).

Each of a SmolLM2-135M decoder layer's seven Linears (q, k, v, o, gate, up, down; random float32 weights, rank 8)
runs one forward+backward of `rows x seq-len` tokens, `x` requiring grad:
- `base`: `F.linear` under autograd (the weight frozen: only the input gradient);
- `one slot, now`: `_LinearLoRA` (the trainer's node), every row on one slot, per-row weight gradients;
- `one slot, concat`: the concatenated GEMMs over all rows at once, then the four passes (weight gradients per row,
  as the trainer keeps them), written as plain ops, no autograd node (favouring it by that node's overhead);
- `mixed, now` and `mixed, concat`: every row on its own slot; the concatenated GEMMs then run per row.
Variants run round-robin, `reps` calls each per run, median of the calls' thread CPU time; ratios are medians of
per-run ratios over `base`. The last row weights each Linear by its base time: the decoder layer's Linears together.

`--step`: the whole model instead (bench_lora_paths.py's training pass: SmolLM2-135M's config, random weights, one
forward+backward of `rows x seq-len` tokens with the trainer's slot-gradient sink), `base`, `one slot, now` and
`one slot, concat`, where `_LinearLoRA` is swapped for `_ConcatLoRA` (the concatenated GEMMs as an autograd node;
the Linear's output and input gradient are then column slices of the wider products) for one-slot float32 calls.
`runs` interleaved steps after one warm-up, medians of per-run ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages when run as a script

from rl_multilora.lora import layer as lora_layer  # noqa: E402
from rl_multilora.lora.layer import _LinearLoRA  # noqa: E402

RANK, SCALE = 8, 2.0
HIDDEN, KV, MLP = 576, 192, 1536  # SmolLM2-135M: hidden 576, 3 KV heads of 64, MLP 1536
LINEARS = {"q": (HIDDEN, HIDDEN), "k": (HIDDEN, KV), "v": (HIDDEN, KV), "o": (HIDDEN, HIDDEN),
           "gate": (HIDDEN, MLP), "up": (HIDDEN, MLP), "down": (MLP, HIDDEN)}  # fmt: skip
VARIANTS = ("base", "one slot, now", "one slot, concat", "mixed, now", "mixed, concat")


def concat_step(x3, grad3, weight, a, b, segment: int) -> tuple[torch.Tensor, ...]:
    """Forward and backward of `y = x @ W.T + SCALE * (x @ a.T) @ b.T` with the concatenated GEMMs, `segment` rows
    per GEMM (rows of one slot in a run). x3: (n, L, in), grad3: (n, L, out), a: (S, r, in), b: (S, out, r), row i on
    slot i % S."""
    n, length, fan_in = x3.shape
    fan_out, r = weight.shape[0], a.shape[1]
    x2, g2 = x3.reshape(-1, fan_in), grad3.reshape(-1, fan_out)
    tokens, step = n * length, segment * length
    fwd = torch.empty(tokens, fan_out + r)  # [y | x @ a.T]
    bwd = torch.empty(tokens, fan_in + r)  # [grad @ W | grad @ b]
    for start in range(0, tokens, step):
        s = (start // length) % a.shape[0]
        rows = slice(start, start + step)
        torch.mm(x2[rows], torch.cat([weight, a[s]], 0).T, out=fwd[rows])  # one read of x: (T, out + r)
    y, xa = fwd[:, :fan_out], fwd[:, fan_out:].mul_(SCALE)
    for start in range(0, tokens, step):
        s, rows = (start // length) % a.shape[0], slice(start, start + step)
        y[rows].addmm_(xa[rows], b[s].T)  # y += xa @ b.T, in place in the strided view
        torch.mm(g2[rows], torch.cat([weight, b[s]], 1), out=bwd[rows])  # one read of grad: (T, in + r)
    grad_x, g_xa = bwd[:, :fan_in], bwd[:, fan_in:].mul_(SCALE)
    for start in range(0, tokens, step):
        s, rows = (start // length) % a.shape[0], slice(start, start + step)
        grad_x[rows].addmm_(g_xa[rows], a[s])  # grad_x += g_xa @ a
    grad_a = torch.bmm(g_xa.reshape(n, length, r).transpose(1, 2), x3)  # dA per row: (n, r, in)
    grad_bt = torch.bmm(xa.reshape(n, length, r).transpose(1, 2), grad3)  # dB.T per row: (n, r, out)
    return y, grad_x, grad_a, grad_bt


class _ConcatLoRA(torch.autograd.Function):
    """`_LinearLoRA` for a batch on one slot (float32, no bias, a slot-gradient sink) with the concatenated GEMMs:
    `[y | x @ a.T] = x @ [W; a].T` and `[grad @ W | grad @ b] = grad @ [W, b]`; the weight gradients per row into
    the sink, as `_LinearLoRA`'s. Returns the column slice `y` of the wider product (strided)."""

    @staticmethod
    def forward(ctx, x3, weight, lora_a, lora_b, slots, scales, r, sink, slot_index, single):
        n, length, fan_in = x3.shape
        fan_out = weight.shape[0]
        wide = torch.empty(n * length, fan_out + r)  # [y | x @ a.T]: (T, out + r)
        torch.mm(x3.reshape(-1, fan_in), torch.cat([weight, lora_a[single, :r]], 0).T, out=wide)
        xa = wide[:, fan_out:].view(n, length, r).mul_(scales.view(-1, 1, 1))  # scale[i] * x[i] @ a.T
        wide[:, :fan_out].addmm_(wide[:, fan_out:], lora_b[single, :, :r].T)  # y += xa @ b.T
        ctx.save_for_backward(x3, weight, xa, slots, scales)
        ctx.stacked = (lora_a.shape, lora_b.shape, r, lora_a.dtype)
        ctx.sink, ctx.slot_index, ctx.single = (sink, lora_a, lora_b), slot_index, single
        return wide[:, :fan_out].view(n, length, fan_out)

    @staticmethod
    def backward(ctx, grad):  # grad: (n, L, out)
        x3, weight, xa, slots, scales = ctx.saved_tensors
        (sink, lora_a, lora_b), r, single = ctx.sink, ctx.stacked[2], ctx.single
        grad = grad.contiguous()
        n, length, fan_in = x3.shape
        wide = torch.empty(n * length, fan_in + r)  # [grad @ W | grad @ b]: (T, in + r)
        torch.mm(grad.view(n * length, -1), torch.cat([weight, lora_b[single, :, :r]], 1), out=wide)
        g_xa = wide[:, fan_in:].view(n, length, r).mul_(scales.view(-1, 1, 1))
        wide[:, :fan_in].addmm_(wide[:, fan_in:], lora_a[single, :r])  # grad_x += g_xa @ a
        used, inverse = lora_layer._slot_index(ctx, slots)
        rows = torch.bmm(g_xa.transpose(1, 2), x3)  # dA per row: (n, r, in)
        compact = rows.new_zeros(len(used), *ctx.stacked[0][1:])
        compact.narrow(1, 0, r).index_add_(0, inverse, rows)
        sink.add(lora_a, used, compact)
        sink.add(lora_b, *lora_layer._b_grad_per_used_slot(ctx, grad, xa, slots))
        return wide[:, :fan_in].view(n, length, fan_in), None, None, None, None, None, None, None, None, None


class _ConcatWhereOneSlot:
    """Stands in for `_LinearLoRA` in `--step`: `_ConcatLoRA` where it applies, `_LinearLoRA` elsewhere."""

    @staticmethod
    def apply(x3, weight, bias, lora_a, lora_b, slots, scales, r, sink, slot_index, single, compute):
        if single is None or bias is not None or sink is None or (compute is not None and compute != x3.dtype):
            return _LinearLoRA.apply(x3, weight, bias, lora_a, lora_b, slots, scales, r, sink, slot_index, single,
                                     compute)  # fmt: skip
        return _ConcatLoRA.apply(x3, weight, lora_a, lora_b, slots, scales, r, sink, slot_index, single)


def bench_step(rows: int, seq_len: int, runs: int) -> None:
    from bench.bench_lora_paths import build, print_table, time_interleaved

    m = build()
    m.train()
    m.use_slot_grads()
    ids = torch.randint(0, m.base_model.config.vocab_size, (rows, seq_len), generator=torch.Generator().manual_seed(0))
    embeds = m.base_model.get_input_embeddings()(ids).detach()

    def step(names, node) -> torch.Tensor:
        lora_layer._LinearLoRA = node
        try:
            m.zero_lora_grads()
            x = embeds.detach().requires_grad_()
            m(inputs_embeds=x, adapter_names=names).logits.float().mean().backward()
            return x.grad
        finally:
            lora_layer._LinearLoRA = _LinearLoRA

    one = ["a0"] * rows
    torch.testing.assert_close(step(one, _ConcatWhereOneSlot), step(one, _LinearLoRA), rtol=1e-4, atol=1e-7)
    fns = {
        "base": lambda: step([None] * rows, _LinearLoRA),
        "one slot, now": lambda: step(one, _LinearLoRA),
        "one slot, concat": lambda: step(one, _ConcatWhereOneSlot),
    }
    times = time_interleaved(fns, 1, runs)
    print_table(f"training forward+backward, SmolLM2-135M's shape, {rows} x {seq_len} tokens, {runs} runs", times,
                ["base", "one slot, now"], lambda s: s, "{:.2f}", "seconds")  # fmt: skip


def linear_variants(fan_in: int, fan_out: int, rows: int, seq_len: int) -> dict[str, Callable[[], None]]:
    g = torch.Generator().manual_seed(fan_in * 7 + fan_out)
    weight = torch.randn(fan_out, fan_in, generator=g) * 0.02
    a = (torch.randn(rows, RANK, fan_in, generator=g) * 0.02).requires_grad_()
    b = (torch.randn(rows, fan_out, RANK, generator=g) * 0.02).requires_grad_()
    x = torch.randn(rows, seq_len, fan_in, generator=g).requires_grad_()
    grad = torch.randn(rows, seq_len, fan_out, generator=g)
    scales = torch.full((rows,), SCALE)
    one, mixed = torch.zeros(rows, dtype=torch.long), torch.arange(rows)

    def base():
        F.linear(x, weight).backward(grad)
        x.grad = None

    def now(slots, single):
        used = torch.unique(slots, return_inverse=True)
        _LinearLoRA.apply(x, weight, None, a, b, slots, scales, RANK, None, used, single, None).backward(grad)
        x.grad = a.grad = b.grad = None

    x3, a0, b0 = x.detach(), a.detach(), b.detach()
    for slots, s_a, s_b, segment in ((one, a0[:1], b0[:1], rows), (mixed, a0, b0, 1)):  # the probe computes the same
        y, grad_x, grad_a, grad_bt = concat_step(x3, grad, weight, s_a, s_b, segment)
        y_now = _LinearLoRA.apply(x, weight, None, a, b, slots, scales, RANK, None, None, None, None)
        y_now.backward(grad)
        per_slot_a = torch.zeros_like(a).index_add_(0, slots, grad_a)
        per_slot_b = torch.zeros_like(a.new_empty(rows, RANK, fan_out)).index_add_(0, slots, grad_bt)
        for got, want in ((y, y_now), (grad_x, x.grad), (per_slot_a, a.grad), (per_slot_b, b.grad.transpose(1, 2))):
            torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-4, atol=1e-4)  # float32 rounding
        x.grad = a.grad = b.grad = None
    return {
        "base": base,
        "one slot, now": lambda: now(one, 0),
        "one slot, concat": lambda: concat_step(x3, grad, weight, a0[:1], b0[:1], rows),
        "mixed, now": lambda: now(mixed, None),
        "mixed, concat": lambda: concat_step(x3, grad, weight, a0, b0, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--reps", type=int, default=20, help="calls per variant per run (the run's value: their median)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--step", action="store_true", help="the whole model's training pass instead of one per Linear")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.step:
        bench_step(args.rows, args.seq_len, args.runs)
        return
    fns = {name: linear_variants(*shape, args.rows, args.seq_len) for name, shape in LINEARS.items()}
    cpu = {(lin, v): [] for lin in LINEARS for v in VARIANTS}  # per run: median seconds of `reps` calls
    for run in range(args.runs + 1):  # run 0 warms up
        for lin, variants in fns.items():
            order = VARIANTS[run % len(VARIANTS) :] + VARIANTS[: run % len(VARIANTS)]
            for v in order:
                calls = []
                for _ in range(args.reps):
                    start = time.thread_time()
                    variants[v]()
                    calls.append(time.thread_time() - start)
                if run:
                    cpu[(lin, v)].append(statistics.median(calls))

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

    print(
        f"one forward+backward per Linear, {args.rows} x {args.seq_len} tokens, rank {RANK}, {args.threads} thread(s), "
        f"{args.runs} runs x {args.reps} calls; ms (base) and ratios over base, CPU time, medians (min-max over runs)"
    )
    print("| Linear | base ms | " + " | ".join(VARIANTS[1:]) + " |")
    print("|---|---|" + "---|" * (len(VARIANTS) - 1))
    rows = list(LINEARS) + ["layer"]
    for lin in rows:
        names = list(LINEARS) if lin == "layer" else [lin]
        per_run = {v: [sum(cpu[(n, v)][i] for n in names) for i in range(args.runs)] for v in VARIANTS}
        base = per_run["base"]
        ratios = [cell([t / b for t, b in zip(per_run[v], base, strict=True)]) for v in VARIANTS[1:]]
        label = f"{lin} {LINEARS[lin][0]}->{LINEARS[lin][1]}" if lin != "layer" else "all seven"
        print(f"| {label} | {statistics.median(base) * 1e3:.2f} | " + " | ".join(ratios) + " |", flush=True)


if __name__ == "__main__":
    main()
