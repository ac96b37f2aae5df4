"""Is a tenant's training step the same bits alone as in a mixed batch, and does it repeat? (CPU or CUDA)

Usage: `python bench/isolation_probe.py [--device cuda] [--models tiny smollm2]`

For each model (the tests' tiny Llama; SmolLM2-135M's shape with random weights, nothing downloaded), dtype setting
(float32; a bf16 base with float32 slots, PEFT's default; the same with `lora_autocast`) and rows per tenant (3, 12,
24): two tenants of rank 4 alternate over the rows of one batch of 16 tokens each, and tenant `a`'s loss is
backpropagated with per-slot gradients in a sink (as the trainer keeps them). It prints whether the base alone gives
the same logits for a subset of rows as in the whole batch, whether `a`'s rows alone give the logits and gradients of
the same rows in the mixed batch (and the largest difference), and whether each step repeats bit for bit. On CPU
everything holds to the bit; docs/benchmarks.md ("GPU check") has an H100's answers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_grouped_lora import add, batch, bf16_base, cloned_grads, per_adapter_loss  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

from bench.gpu_check import SMOLLM2  # noqa: E402
from rl_multilora.lora import MultiLoRAModel  # noqa: E402

MODELS = {"tiny": lambda: tiny_model("llama"), "smollm2": lambda: SMOLLM2.build(torch.float32, "cpu")}
SETTINGS = ("float32", "bf16_base_float32_slots", "bf16_base_autocast")


def probe(model: str, setting: str, per: int, device: str) -> str:
    torch.manual_seed(0)
    m = MultiLoRAModel.from_model(MODELS[model](), 8, 8, lora_autocast=setting == "bf16_base_autocast")
    add(m, {"a": (4, 9), "b": (4, 5)})
    if setting != "float32":
        bf16_base(m)
    m.to(device)
    m.use_slot_grads()
    ids = batch(rows=2 * per, length=16, seed=3, left_pad=False)[0].to(device)
    names = ["a", "b"] * per
    rows = [i for i, n in enumerate(names) if n == "a"]
    with torch.no_grad():
        base_same = torch.equal(
            m(ids[rows], adapter_names=[None] * per).logits, m(ids, adapter_names=[None] * len(names)).logits[rows]
        )

    def run(batch_ids, batch_names):
        m.zero_lora_grads()
        logits = m(batch_ids, adapter_names=batch_names).logits
        per_adapter_loss(logits.float(), batch_ids, batch_names, "a").backward()
        return logits.detach(), cloned_grads(m, ["a"])["a"]

    def diff(x, y):
        return max(float((g - h).abs().max()) for g, h in zip(x, y, strict=True) if g is not None)

    mixed, mixed_grads = run(ids, names)
    mixed2, mixed_grads2 = run(ids, names)
    alone, alone_grads = run(ids[rows], ["a"] * per)
    alone2, alone_grads2 = run(ids[rows], ["a"] * per)
    logit_diff = float((alone.float() - mixed[rows].float()).abs().max())
    grad_diff = diff(alone_grads, mixed_grads)
    return (
        f"| {model} | {setting} | {per} | {base_same} | {logit_diff == 0} ({logit_diff:.2e}) | {grad_diff == 0} "
        f"({grad_diff:.2e}) | {torch.equal(mixed, mixed2) and diff(mixed_grads, mixed_grads2) == 0} | "
        f"{torch.equal(alone, alone2) and diff(alone_grads, alone_grads2) == 0} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", nargs="*", choices=list(MODELS), default=["tiny"])
    args = p.parse_args()
    print(f"torch {torch.__version__}, {args.device}")
    print("| model | dtypes | rows per tenant | base: subset = whole | logits alone = mixed (max diff) | "
          "grads alone = mixed (max diff) | mixed repeats | alone repeats |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for setting in SETTINGS:
            for per in (3, 12, 24):
                print(probe(model, setting, per, args.device), flush=True)


if __name__ == "__main__":
    main()
