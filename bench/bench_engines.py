"""Rollout tokens/s with 1 and 2 engines (`rollout.num_engines`), on the tiny preset, side by side in one process.

    python bench/bench_engines.py [--model artifacts/tiny/model] [--groups 16] [--group-size 8] [--new 32] [--runs 5]

A step's rollout as the loop issues it: `groups` prompt groups of `group-size` samples (8 adapters, groups spread
over them), one `agenerate` call per group, all at once (GenerateState's way), T=1 seeded sampling with EOS off so
every variant generates exactly `groups x group-size x new` tokens. Variants, round-robin in one process:

  one        one in-process embedded engine
  two        a MultiEngine over two in-process embedded engines (each its own decode thread, one shared base)

Each engine thread runs torch ops with the process's intra-op threads (set to 1 here, so two engines can use the
two cores of this machine). With Ray actor engines (`rollout.engine_actors`), each engine is its own process with
its own base copy; on a GPU machine each would have its own GPU. Reported: median tokens/s and the median of
per-run ratios two / one.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages when run as a script

from bench.bench_lora import paired_ratio  # noqa: E402
from rl_multilora.lora import MultiLoRAModel  # noqa: E402
from rollout.engines.embedded import EmbeddedEngine  # noqa: E402
from rollout.engines.multi import MultiEngine  # noqa: E402
from rollout.types import GenerateRequest, SamplingParams  # noqa: E402

ADAPTERS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="artifacts/tiny/model")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        sys.exit(f"error: --model={args.model!r} has no config.json; run examples/multi_lora/provision.sh first")
    torch.set_num_threads(1)
    model = MultiLoRAModel.from_pretrained(args.model, max_loras=ADAPTERS, max_rank=8)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    g = torch.Generator().manual_seed(0)
    for i in range(ADAPTERS):
        model.add_adapter(f"a{i}", rank=8, alpha=16, seed=i)
        with torch.no_grad():
            for b in model.adapter_parameters(f"a{i}")[1::2]:
                b.copy_(torch.randn(b.shape, generator=g) * 0.01)
    engines = {
        "one": EmbeddedEngine(model, tokenizer, eos_token_ids=[]),  # EOS off: fixed-length work
        "two": MultiEngine([EmbeddedEngine(model, tokenizer, eos_token_ids=[]) for _ in range(2)]),
    }
    for engine in engines.values():
        engine.pause()
        for i in range(ADAPTERS):
            engine.load_adapter(f"a{i}", model.adapter_state_dict(f"a{i}"), model.peft_config(f"a{i}"), version=0)
        engine.resume()
    vocab = len(tokenizer)
    prompts = [torch.randint(10, vocab, (24,), generator=g).tolist() for _ in range(args.groups)]

    def groups(run: int) -> list[list[GenerateRequest]]:
        return [
            [
                GenerateRequest(
                    prompts[k],
                    f"a{k % ADAPTERS}",
                    SamplingParams(temperature=1.0, max_new_tokens=args.new, seed=run * 10_000 + k * 100 + j),
                )  # fmt: skip
                for j in range(args.group_size)
            ]
            for k in range(args.groups)
        ]

    async def step(engine, run: int) -> int:
        out = await asyncio.gather(*(engine.agenerate(group) for group in groups(run)))
        return sum(len(r.output_ids) for group in out for r in group)

    times: dict[str, list[float]] = {k: [] for k in engines}
    tokens = 0
    for run in range(args.runs + 1):  # the first run of each is a warm-up
        for name, engine in engines.items():
            start = time.perf_counter()
            tokens = asyncio.run(step(engine, run))
            if run:
                times[name].append(time.perf_counter() - start)
    for engine in engines.values():
        engine.close()
    print(
        f"tiny preset ({args.model}), {ADAPTERS} adapters rank 8; {args.groups} groups x {args.group_size} samples x "
        f"{args.new} new tokens = {tokens} tokens per step; {args.runs} runs (+1 warm-up), 1 intra-op thread, "
        f"torch {torch.__version__}"
    )
    for name, t in times.items():
        rates = [tokens / s for s in t]
        print(f"  {name}: tokens/s min {min(rates):.0f} median {statistics.median(rates):.0f} max {max(rates):.0f}")
    print(f"  two / one tokens/s (median of per-run ratios): {paired_ratio(times['one'], times['two']):.2f}")


if __name__ == "__main__":
    main()
