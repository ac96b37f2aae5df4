"""Multi-LoRA cost at a real shape: SmolLM2-135M-Instruct (hidden 576, 30 layers, GQA 9/3, vocab 49152).

Usage: `python bench/bench_smollm2.py [--model artifacts/smollm2-135m/model] [--threads 1] [--runs 7] [--quick]`
(provision the model first: `rl-multilora provision --preset smollm2-135m --out artifacts/smollm2-135m`).

Training, one forward+backward over the same batch (`rows` x `seq_len` tokens, every adapter rank 8 on every Linear,
non-zero B), in this one process with the same weights:

- `base`: every row on the base model (no LoRA compute), `inputs_embeds` requiring grad so the backward runs through
  the whole network as in the LoRA variants: the floor;
- `1`: every row on one adapter; `64`: the rows spread round-robin over 64 adapters.

Decode, through the embedded engine (the rollout path): `rows` greedy requests of `prompt_len` tokens generating
`new_tokens` each (EOS off, so every row decodes the same length): all on the base, all on one adapter, and spread
over 64 adapters; output tokens per second.

Variants run round-robin within each run (load that drifts on a shared machine hits them alike); the table shows
medians over runs, the min-max spread, and ratios as medians of per-run ratios. The LoRA FLOP share (matmul FLOPs of
the adapter's forward, activation-grad and weight-grad products over the whole pass's) is what a perfect kernel
would add.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages when run as a script

from rl_multilora.lora import MultiLoRAModel  # noqa: E402
from rollout.engines.embedded import EmbeddedEngine  # noqa: E402
from rollout.types import GenerateRequest, SamplingParams  # noqa: E402

RANK = 8
N_MANY = 64


def time_interleaved(fns: dict[str, Callable[[], object]], warmup: int, runs: int) -> dict[str, list[float]]:
    """Wall seconds of every fn per run, round-robin."""
    times: dict[str, list[float]] = {key: [] for key in fns}
    for i in range(warmup + runs):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            if i >= warmup:
                times[key].append(time.perf_counter() - start)
    return times


def paired_ratio(num: list[float], den: list[float]) -> list[float]:
    return [a / b for a, b in zip(num, den, strict=True)]


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def build(path: str) -> MultiLoRAModel:
    m = MultiLoRAModel.from_pretrained(path, max_loras=N_MANY, max_rank=RANK, target_modules="all-linear")
    for i in range(N_MANY):
        m.add_adapter(f"a{i}", rank=RANK, alpha=2 * RANK, seed=i)
        with torch.no_grad():  # non-zero B so every adapter does real work
            for p in m.adapter_parameters(f"a{i}")[1::2]:
                p.normal_(0, 0.01)
    return m


def lora_flop_share(m: MultiLoRAModel) -> float:
    """LoRA matmul FLOPs over the whole forward+backward's, per token (frozen base: activation grads only)."""
    base = lora = 0.0
    for fan_in, fan_out in m.layer_shapes.values():
        base += 4.0 * fan_in * fan_out
        lora += 6.0 * RANK * (fan_in + fan_out)  # forward, activation grad, weight grads of A and B
    head = m.base_model.get_output_embeddings().weight
    base += 4.0 * head.shape[0] * head.shape[1]
    return lora / (base + lora)


def bench_train(m: MultiLoRAModel, rows: int, seq_len: int, warmup: int, runs: int) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.base_model.config.vocab_size, (rows, seq_len), generator=g)
    embeds = m.base_model.get_input_embeddings()(ids).detach()
    m.train()

    def step(names):
        m.zero_lora_grads()
        x = embeds.detach().requires_grad_()
        m(inputs_embeds=x, adapter_names=names).logits.float().mean().backward()

    fns = {
        "base": lambda: step([None] * rows),
        "1": lambda: step(["a0"] * rows),
        str(N_MANY): lambda: step([f"a{i % N_MANY}" for i in range(rows)]),
    }
    times = time_interleaved(fns, warmup, runs)
    print(f"\ntraining forward+backward, {rows} rows x {seq_len} tokens, rank {RANK} on every Linear, {runs} runs")
    print(f"LoRA FLOP share of the pass: {lora_flop_share(m):.1%} (the ideal overhead over base)")
    print("| variant | seconds median (min-max) | over base | over 1 adapter |")
    print("|---|---|---|---|")
    for key, t in times.items():
        over_base = spread(paired_ratio(t, times["base"]))
        over_one = spread(paired_ratio(t, times["1"]))
        print(f"| {key} | {spread(t)} | {over_base} | {over_one} |")


def bench_decode(m: MultiLoRAModel, tokenizer, rows: int, prompt_len: int, new_tokens: int, warmup: int, runs: int):
    m.eval()
    engine = EmbeddedEngine(m, tokenizer, max_batch_size=rows, eos_token_ids=[])
    try:
        for i in range(N_MANY):
            state = m.adapter_state_dict(f"a{i}")
            engine.load_adapter(f"a{i}", state, {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK,
                                                 "target_modules": sorted({k.split(".")[-3] for k in state})})  # fmt: skip
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(0, m.base_model.config.vocab_size, (rows, prompt_len), generator=g).tolist()
        params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)

        def gen(names):
            results = engine.generate(
                [GenerateRequest(p, adapter=n, sampling=params) for p, n in zip(prompts, names, strict=True)]
            )
            assert all(len(r.output_ids) == new_tokens for r in results)

        fns = {
            "base": lambda: gen([None] * rows),
            "1": lambda: gen(["a0"] * rows),
            str(N_MANY): lambda: gen([f"a{i % N_MANY}" for i in range(rows)]),
        }
        times = time_interleaved(fns, warmup, runs)
    finally:
        engine.close()
    tokens = rows * new_tokens
    print(
        f"\ndecode (embedded engine, greedy), {rows} rows, prompt {prompt_len}, {new_tokens} new tokens, {runs} runs"
    )
    print("| variant | tokens/s median (min-max) | vs base | vs 1 adapter |")
    print("|---|---|---|---|")
    for key, t in times.items():
        tps = [tokens / s for s in t]
        vs_base = spread(paired_ratio(times["base"], t))  # throughput ratio = inverse time ratio
        vs_one = spread(paired_ratio(times["1"], t))
        print(f"| {key} | {spread(tps, '{:.0f}')} | {vs_base} | {vs_one} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="artifacts/smollm2-135m/model")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--decode-rows", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="3 runs, smaller batches (a smoke test)")
    p.add_argument("--skip-decode", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    runs, rows, seq_len, drows = args.runs, args.rows, args.seq_len, args.decode_rows
    if args.quick:
        runs, rows, seq_len, drows = 3, 8, 32, 16
    from transformers import AutoTokenizer

    print(f"SmolLM2-135M-Instruct ({args.model}), torch {torch.__version__}, {args.threads} thread(s)")
    m = build(args.model)
    bench_train(m, rows, seq_len, warmup=1, runs=runs)
    if not args.skip_decode:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        bench_decode(m, tokenizer, drows, prompt_len=32, new_tokens=32, warmup=1, runs=runs)


if __name__ == "__main__":
    main()
