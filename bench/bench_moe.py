"""Expert LoRA on the tiny MoE preset: mixed-batch forward + backward with 1, 8 and 64 tenants at fixed rows, and
the cost of LoRA (on the Linears only, and on the Linears and the experts) over the base MoE forward.

    python bench/bench_moe.py [--model artifacts/tiny-moe/model] [--rows 64] [--seq 48] [--runs 7] [--warmup 2]

The model is the provisioned tiny MoE preset (`rl-multilora provision --preset tiny-moe`) wrapped with 66 slots:
64 tenants `t00..t63` with LoRA on every Linear and both packed expert Parameters (rank 8, random non-zero A and
B: a mixed batch computes at its largest rank, so equal ranks compare like with like), one tenant `lin` on the Linears only. Every variant runs the same `rows x seq` tokens; the
variants run round-robin in one process (`time_interleaved`), so load drift on the shared machine hits them alike,
and ratios are medians of per-run ratios. One intra-op thread (the models are too small to gain from a second).

Variants, forward + backward to the input embeddings (what a train micro-batch costs without the loss):
  base         no row uses an adapter: the base MoE forward (transformers' experts implementation) and backward
  lin_1        every row uses `lin`: LoRA on the Linears, the experts run the base implementation
  moe_1/8/64   rows split evenly over 1, 8 or 64 tenants with expert LoRA
  moe_1_nodelta  as moe_1 with the expert LoRA delta skipped: the experts computed in the LoRA path, no LoRA math
and the same without autograd (`nograd_*`: a rollout prefill). With expert LoRA in a batch the experts module
computes the experts itself (a loop over the E experts, one matmul each, plus the grouped LoRA over (slot, expert)
pairs), so `moe_1 / lin_1` is the expert LoRA's own cost including that switch of implementation.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages when run as a script

from bench.bench_lora import paired_ratio, time_interleaved  # noqa: E402
from rl_multilora.lora import MultiLoRAModel  # noqa: E402
from rl_multilora.lora.experts import ExpertLoRA  # noqa: E402

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
TENANTS = (1, 8, 64)


@contextlib.contextmanager
def no_expert_delta() -> Iterator[None]:
    """Expert LoRA rows take the LoRA experts forward, but its delta is skipped: what computing the experts in the
    LoRA path (a loop over the E experts) costs by itself."""
    add_delta = ExpertLoRA.add_delta
    ExpertLoRA.add_delta = lambda self, proj, x, pairs: proj
    try:
        yield
    finally:
        ExpertLoRA.add_delta = add_delta


def build(model_dir: str) -> MultiLoRAModel:
    m = MultiLoRAModel.from_pretrained(model_dir, max_loras=66, max_rank=16, target_parameters=EXPERTS)
    g = torch.Generator().manual_seed(0)
    specs = [(f"t{i:02d}", 8, None) for i in range(64)] + [("lin", 8, [])]
    for i, (name, rank, params) in enumerate(specs):
        m.add_adapter(name, rank=rank, alpha=2 * rank, seed=i, target_parameters=params)
        with torch.no_grad():  # B starts at zero: give it values so the LoRA math is not multiplying zeros
            for b in m.adapter_parameters(name)[1::2]:
                b[..., :rank].copy_(torch.randn(b[..., :rank].shape, generator=g) * 0.01)
    return m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="artifacts/tiny-moe/model")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--seq", type=int, default=48)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        sys.exit(
            f"error: --model={args.model!r} has no config.json; provision it: rl-multilora provision --preset tiny-moe"
        )
    torch.set_num_threads(1)
    m = build(args.model)
    cfg = m.config
    embeds = torch.randn(args.rows, args.seq, cfg.hidden_size, generator=torch.Generator().manual_seed(1))

    def names_for(n: int | str | None) -> list[str | None]:
        if n is None or isinstance(n, str):
            return [n] * args.rows
        return [f"t{(r * n) // args.rows:02d}" for r in range(args.rows)]  # contiguous, even split over n tenants

    def fwd_bwd(names):
        m.zero_lora_grads()
        x = embeds.detach().requires_grad_()
        m(inputs_embeds=x, adapter_names=names).logits.float().mean().backward()

    def fwd(names):
        with torch.no_grad():
            m(inputs_embeds=embeds, adapter_names=names)

    cases = {"base": None, "lin_1": "lin", **{f"moe_{n}": n for n in TENANTS}}
    fns = {key: (lambda v=v: fwd_bwd(names_for(v))) for key, v in cases.items()}
    fns |= {f"nograd_{key}": (lambda v=v: fwd(names_for(v))) for key, v in cases.items()}

    def skipped(fn):
        with no_expert_delta():
            fn(names_for(1))

    fns |= {"moe_1_nodelta": lambda: skipped(fwd_bwd), "nograd_moe_1_nodelta": lambda: skipped(fwd)}
    times = time_interleaved(fns, args.warmup, args.runs, "cpu")

    print(
        f"tiny MoE ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} experts of "
        f"{cfg.moe_intermediate_size}, top-{cfg.num_experts_per_tok}); {args.rows} rows x {args.seq} tokens, "
        f"{args.runs} runs (+{args.warmup} warmup), torch {torch.__version__}, 1 thread"
    )
    print(f"{'variant':>16} {'min ms':>9} {'median ms':>10} {'max ms':>9}")
    for key, t in times.items():
        print(f"{key:>16} {min(t):9.1f} {statistics.median(t):10.1f} {max(t):9.1f}")
    print("ratios (median of per-run ratios):")
    for prefix, label in (("", "forward + backward"), ("nograd_", "forward, no autograd")):

        def r(a: str, b: str, prefix: str = prefix) -> float:
            return paired_ratio(times[prefix + a], times[prefix + b])

        tenants = ", ".join(f"{n}: {r(f'moe_{n}', 'moe_1'):.2f}" for n in TENANTS[1:])
        print(
            f"  {label}: tenants N/1 {tenants}; lin_1/base {r('lin_1', 'base'):.2f}, moe_1/base "
            f"{r('moe_1', 'base'):.2f}, moe_1/lin_1 {r('moe_1', 'lin_1'):.2f}, moe_1_nodelta/lin_1 "
            f"{r('moe_1_nodelta', 'lin_1'):.2f}"
        )


if __name__ == "__main__":
    main()
