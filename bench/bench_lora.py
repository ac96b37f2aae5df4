"""Cost of the multi-LoRA forward+backward: one mixed batch of N adapters vs no LoRA vs N one-adapter passes.

Usage: `python bench/bench_lora.py [--quick] [--device cpu|cuda]`

For each model config and each N in (1, 4, 8), the same B rows (B / N rows per adapter, every adapter rank 16) are
timed four ways, all in this one process with the same weights:

- `base`: the wrapped model with every row on the base (no LoRA compute): the floor.
- `grouped`: one forward+backward over the mixed batch with each adapter's rows contiguous (a0 a0 a1 a1 ..., what
  the trainer builds): the zero-copy view path.
- `interlvd`: the same batch with rows interleaved (a0 a1 a0 a1 ...): the permute/gather/scatter path.
- `separate`: N forward+backward passes, one per adapter over its own rows (what a one-adapter trainer does).

Every variant takes `inputs_embeds` that require grad, so each backward runs through the whole network and the
`base` floor pays the same activation backward as the LoRA variants. Each timing is the median of >= 5 runs after
warmup; the variants run round-robin within each run and the ratios are medians of per-run ratios, so load that
drifts on a shared machine hits every variant alike. `grp/base` and `int/base` are the multi-LoRA overheads,
`grp/sep` < 1 means one mixed pass beats N one-adapter passes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rl_multilora.lora import MultiLoRAModel


@dataclass(frozen=True)
class BenchConfig:
    name: str
    hidden: int
    layers: int
    heads: int
    vocab: int
    rows: int
    seq_len: int


def build(cfg: BenchConfig, max_loras: int, device: str) -> MultiLoRAModel:
    config = Qwen2Config(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.hidden * 11 // 4,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=max(1, cfg.heads // 4),
        max_position_embeddings=max(256, cfg.seq_len),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().to(device)
    m = MultiLoRAModel.from_model(model, max_loras=max_loras, max_rank=16)
    for i in range(max_loras):
        m.add_adapter(f"a{i}", rank=16, alpha=32, seed=i)
        with torch.no_grad():  # non-zero B so every adapter does real work in the backward
            for p in m.adapter_parameters(f"a{i}")[1::2]:
                p.normal_(0, 0.01)
    return m.train()


def time_interleaved(
    fns: dict[str, Callable[[], None]], warmup: int, runs: int, device: str
) -> dict[str, list[float]]:
    """Wall times (ms) of every fn per run, round-robin, so load drift on a shared machine hits all variants alike."""
    times: dict[str, list[float]] = {key: [] for key in fns}
    for i in range(warmup + runs):
        for key, fn in fns.items():
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times[key].append((time.perf_counter() - start) * 1e3)
    return times


def fwd_bwd(m: MultiLoRAModel, embeds: torch.Tensor, names: list[str | None]) -> None:
    m.zero_grad(set_to_none=True)
    x = embeds.detach().requires_grad_()
    m(inputs_embeds=x, adapter_names=names).logits.float().mean().backward()


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median over runs of the per-run ratio: robust to load that drifts between runs."""
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def bench_config(cfg: BenchConfig, ns: tuple[int, ...], warmup: int, runs: int, device: str) -> list[dict]:
    m = build(cfg, max_loras=max(ns), device=device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (cfg.rows, cfg.seq_len), generator=g).to(device)
    embeds = m.base_model.get_input_embeddings()(ids).detach()
    fns: dict[str, Callable[[], None]] = {"base": lambda: fwd_bwd(m, embeds, [None] * cfg.rows)}
    for n in ns:
        grouped = [f"a{i * n // cfg.rows}" for i in range(cfg.rows)]  # a0 a0 a1 a1 ...: contiguous views
        interleaved = [f"a{i % n}" for i in range(cfg.rows)]  # a0 a1 a0 a1 ...: gather/scatter path
        fns[f"grouped{n}"] = lambda names=grouped: fwd_bwd(m, embeds, names)
        fns[f"interleaved{n}"] = lambda names=interleaved: fwd_bwd(m, embeds, names)

        per_adapter = [[i for i, name in enumerate(interleaved) if name == f"a{k}"] for k in range(n)]

        def separate(per_adapter=per_adapter):
            for k, idx in enumerate(per_adapter):
                fwd_bwd(m, embeds[idx], [f"a{k}"] * len(idx))

        fns[f"separate{n}"] = separate
    times = time_interleaved(fns, warmup, runs, device)
    med = {key: statistics.median(t) for key, t in times.items()}
    return [
        dict(
            n=n,
            base=med["base"],
            grouped=med[f"grouped{n}"],
            interleaved=med[f"interleaved{n}"],
            separate=med[f"separate{n}"],
            grouped_over_base=paired_ratio(times[f"grouped{n}"], times["base"]),
            interleaved_over_base=paired_ratio(times[f"interleaved{n}"], times["base"]),
            grouped_over_separate=paired_ratio(times[f"grouped{n}"], times[f"separate{n}"]),
        )
        for n in ns
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="shorter sequences, 5 timed runs (a few minutes on 2 CPU cores)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads; 1 by default because on a loaded shared 2-core machine OpenMP threads that get "
        "descheduled made timings 10-50x slower and noisy",
    )
    args = parser.parse_args()
    threads = args.threads if args.device == "cpu" else torch.get_num_threads()
    torch.set_num_threads(threads)
    warmup, runs = (1, 5) if args.quick else (2, 7)
    configs = [
        BenchConfig("tiny h64 L2", hidden=64, layers=2, heads=4, vocab=256, rows=8, seq_len=32),
        BenchConfig(
            "large h1024 L2", hidden=1024, layers=2, heads=16, vocab=2048, rows=8, seq_len=16 if args.quick else 64
        ),
    ]
    ns = (1, 4, 8)
    print(
        f"device={args.device} threads={threads} torch={torch.__version__} warmup={warmup} runs={runs} "
        "(median ms of forward+backward, fp32, rank 16, all-linear)"
    )
    header = (
        f"{'config':<15} {'rows x T':>8} {'N':>2} {'base':>8} {'grouped':>8} {'interlvd':>8} {'separate':>8} "
        f"{'grp/base':>8} {'int/base':>8} {'grp/sep':>8}"
    )
    print(header)
    print("-" * len(header), flush=True)
    for cfg in configs:
        for r in bench_config(cfg, ns, warmup, runs, args.device):
            print(
                f"{cfg.name:<15} {f'{cfg.rows}x{cfg.seq_len}':>8} {r['n']:>2} {r['base']:>8.1f} {r['grouped']:>8.1f} "
                f"{r['interleaved']:>8.1f} {r['separate']:>8.1f} {r['grouped_over_base']:>8.2f} "
                f"{r['interleaved_over_base']:>8.2f} {r['grouped_over_separate']:>8.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
