"""Shared-prompt packing: one GRPO training pass with each group's prompt trained once (`grpo.share_prompts`, the
default) against every row padded on its own, side by side in one process on the same weights and rows.

Usage: `python bench/bench_packing.py [--model artifacts/smollm2-135m/model] [--groups 3] [--group-size 8]
[--prompt 110] [--completion 24] [--micro 16] [--runs 5] [--threads 1] [--tinker]`

"packed" packs every group; the trainer packs a group only where its estimate (`rl_multilora.packing.pair_cost`)
says packing is cheaper, and the bench prints that estimate and choice beside the measured ratio. `--layers N`: the
random SmolLM2 shape with N decoder layers (the ratio is per layer but for the output head); `--tiny`: the tiny
preset's shape (hidden 128, 4 layers, random).

`--tinker`: the rows are Tinker datums as the server makes them (`ClientOps._row`: every position a target, the
`importance_sampling` loss, advantages zero over the prompt, so the datum's prompt is where its advantages start).

The defaults are the shape of `examples/multi_lora/configs/smollm2-envs.yaml` (three tenants, each step 8 prompts of
about 110 tokens x 8 samples of up to 24 new tokens; one group per tenant here, 16 rows per micro-batch). Without
`--model` the base is a random model of SmolLM2-135M-Instruct's shape (hidden 576, 30 layers, GQA 9/3, vocab
49152), so the bench runs without provisioning; timings do not depend on the weights' values. A run is one
`forward_backward` over every micro-batch of the rows, for each variant in turn (the order alternates between runs),
after a warm-up; CPU time (`time.process_time`) and wall time, medians with min-max, the ratio as the median of the
per-run ratios. Before the timings, both variants' log-probs and gradients are compared (they must agree to float32
rounding).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages when run as a script

from rl_multilora.config import GRPOSettings, OptimSettings  # noqa: E402
from rl_multilora.lora import MultiLoRAModel  # noqa: E402
from rl_multilora.packing import groups, layout_costs, pack, worth_packing  # noqa: E402
from rl_multilora.rows import Row, TokenIndex  # noqa: E402
from rl_multilora.train_ops import TrainOps  # noqa: E402


def base_model(path: str | None, layers: int = 30, tiny: bool = False):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if path:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if tiny:
        from tests.tiny_models import tiny_model

        return tiny_model(hidden=128, layers=4)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).float().eval()


def make_rows(groups: int, size: int, prompt: int, completion: int, vocab: int) -> list[Row]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for k in range(groups):
        name = f"t{k}"
        ids = torch.randint(10, vocab, (prompt,), generator=g).tolist()
        for i in range(size):
            n = completion - (i % 4)  # completions of a group end at different lengths, as sampled ones do
            own = torch.randint(10, vocab, (n,), generator=g).tolist()
            adv = float(torch.randn((), generator=g))
            rows.append(Row(name, ids + own, list(range(prompt, prompt + n)), adv, None, prompt_len=prompt))
    return rows


def tinker_rows(groups: int, size: int, prompt: int, completion: int, vocab: int) -> list[Row]:
    """The same token sequences as `make_rows`, as Tinker `importance_sampling` datums made into rows."""
    import numpy as np

    from rl_multilora.tinker.ops import _datum_row, _prompt_len
    from rl_multilora.tinker.wire import Datum

    rows = []
    for r in make_rows(groups, size, prompt, completion, vocab):
        tokens, n = r.input_ids + [r.input_ids[-1]], len(r.input_ids)  # model_input = the sequence; a last target
        advantages = np.array([0.0] * (prompt - 1) + [r.advantage] * (n - prompt + 1), dtype=np.float32)
        inputs = {"target_tokens": np.array(tokens[1:]), "logprobs": np.full(n, -5.0, dtype=np.float32),
                  "advantages": advantages}  # fmt: skip
        row = _datum_row(r.adapter, "importance_sampling", Datum(np.array(tokens[:-1]), inputs), vocab)
        row.prompt_len = _prompt_len(row)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a local model folder (default: random SmolLM2-135M shape)")
    ap.add_argument("--groups", type=int, default=3, help="groups (one tenant each)")
    ap.add_argument("--group-size", type=int, default=8, help="samples per group")
    ap.add_argument("--prompt", type=int, default=110, help="prompt tokens")
    ap.add_argument("--completion", type=int, default=24, help="longest completion's tokens")
    ap.add_argument("--micro", type=int, default=16, help="rows per micro-batch")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tinker", action="store_true", help="rows made from Tinker datums (importance_sampling)")
    ap.add_argument("--layers", type=int, default=30, help="decoder layers of the random SmolLM2 shape (default 30)")
    ap.add_argument("--tiny", action="store_true", help="the tiny preset's shape instead (hidden 128, 4 layers)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    base = base_model(args.model, args.layers, args.tiny)
    model = MultiLoRAModel.from_model(base, max_loras=args.groups, max_rank=8)
    ops = {share: TrainOps(model, GRPOSettings(share_prompts=share), pad_token_id=0) for share in (True, False)}
    pair = ops[True].pair_cost
    ops[True].pair_cost = 0.0  # "packed" packs every group, whatever the trainer's estimate would choose
    for k in range(args.groups):
        model.add_adapter(f"t{k}", rank=8, alpha=16, seed=k)
        with torch.no_grad():
            for j, p in enumerate(model.adapter_parameters(f"t{k}")):
                if j % 2:
                    p.normal_(0, 0.01)
        for o in ops.values():
            o.add_tenant(f"t{k}", OptimSettings(), lr=1e-4)
    rows = (tinker_rows if args.tinker else make_rows)(
        args.groups, args.group_size, args.prompt, args.completion, base.config.vocab_size
    )
    algos = None
    if args.tinker:
        from rl_multilora.losses import client_algo

        algos = {f"t{k}": client_algo("importance_sampling", None) for k in range(args.groups)}
    micro = [rows[i : i + args.micro] for i in range(0, len(rows), args.micro)]
    plain_tokens = sum(len(r.input_ids) for r in rows)

    def step(share: bool):
        out = [ops[share].forward_backward(m, algos=algos) for m in micro]
        grads = {n: [g.clone() for g in ops[share].tenant(n).grads] for n in ops[share].tenants}
        for t in ops[share].tenants.values():
            t.grads = None
        return out, grads

    # correctness first: the same log-probs and gradients either way
    (out_p, g_p), (out_u, g_u) = step(True), step(False)
    worst_lp = max(
        float((a - b).abs().max())
        for op, ou in zip(out_p, out_u, strict=True)
        for a, b in zip(op.logprobs, ou.logprobs, strict=True)
    )
    worst_g = max(
        float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        for n in g_u
        for a, b in zip(g_p[n], g_u[n], strict=True)
    )
    packed = 0
    for m in micro:
        tok = TokenIndex.build(m, {f"t{k}": k for k in range(args.groups)}, None, "cpu")
        packed += pack(m, tok.row, tok.pos, 0, torch.float32, "cpu").tokens
    print(
        f"rows {len(rows)} in {len(micro)} micro-batches; tokens forwarded: {plain_tokens} unpacked, {packed} packed "
        f"({plain_tokens / packed:.2f}x fewer); max |log-prob diff| {worst_lp:.2e}, max grad diff / grad scale "
        f"{worst_g:.2e}",
        flush=True,
    )
    estimate = {True: 0.0, False: 0.0}  # tokens + pair_cost x attention pairs, summed over the groups
    chosen = 0
    for members in groups(rows):
        lengths = [len(rows[i].input_ids) for i in members]
        packed_cost, unpacked_cost = layout_costs(lengths, args.prompt, pair)
        estimate[True] += packed_cost
        estimate[False] += unpacked_cost
        chosen += worth_packing(lengths, args.prompt, pair)
    print(
        f"the trainer's estimate (pair_cost {pair:.5f}): packed / unpacked {estimate[True] / estimate[False]:.2f}; "
        f"it packs {chosen} of {len(groups(rows))} groups",
        flush=True,
    )

    cpu = {True: [], False: []}
    wall = {True: [], False: []}
    for run in range(args.runs + 1):
        order = (True, False) if run % 2 else (False, True)
        for share in order:
            c0, w0 = time.process_time(), time.perf_counter()
            step(share)
            c1, w1 = time.process_time(), time.perf_counter()
            if run:  # run 0 warms up
                cpu[share].append(c1 - c0)
                wall[share].append(w1 - w0)

    def fmt(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"

    ratio_cpu = [a / b for a, b in zip(cpu[True], cpu[False], strict=True)]
    ratio_wall = [a / b for a, b in zip(wall[True], wall[False], strict=True)]
    print(f"{'':10} {'CPU s':>20} {'wall s':>20}")
    print(f"{'unpacked':10} {fmt(cpu[False]):>20} {fmt(wall[False]):>20}")
    print(f"{'packed':10} {fmt(cpu[True]):>20} {fmt(wall[True]):>20}")
    print(f"packed / unpacked: CPU {fmt(ratio_cpu)}, wall {fmt(ratio_wall)} ({args.runs} runs, {args.threads} thread)")


if __name__ == "__main__":
    main()
