"""Cost of the multi-LoRA forward+backward as the number of adapters in one batch grows, at fixed rows.

Usage: `python bench/bench_lora.py [--quick] [--device cpu|cuda] [--threads N]`

For each model config the same batch (`rows` x `seq_len` tokens, every adapter rank 8) is timed, all in this one
process with the same weights:

- `base`: every row on the base model (no LoRA compute): the floor.
- `N`: the rows spread round-robin over N adapters (a0 a1 ... a0 a1 ...), N in 1, 8, 64, 256. N = 1 takes the
  one-slot view path; N > 1 the grouped path (per-row gather of the slot's A/B, two batched matmuls).
- `loopN`: the same batch through the previous algorithm (one pair of small matmuls per slot in the batch,
  `_loop_forward` below, swapped in for the measurement): the "before".

Every variant takes `inputs_embeds` that require grad, so each backward runs through the whole network and the
`base` floor pays the same activation backward as the LoRA variants. The variants run round-robin within each run
(load that drifts on a shared machine hits them alike); times are medians, ratios are medians of per-run ratios.

Also printed, per config: training FLOP/s (matmul FLOPs of the trained tokens: forward 2*in*out per token per
Linear, backward 2*in*out for the activation grad, plus 4*r*(in+out) forward+backward and 2*r*(in+out) weight
grads per LoRA Linear; attention score FLOPs are left out) as a share of this process's measured fp32 matmul peak
at the same thread count; and the cost of wrapping the model with max_loras=1024 vs 1 (seconds, LoRA bytes, RSS).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages when run as a script

from rl_multilora.lora import LoRALinear, MultiLoRAModel  # noqa: E402

RANK = 8


@dataclass(frozen=True)
class BenchConfig:
    name: str
    family: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rows: int
    seq_len: int


def hf_config(cfg: BenchConfig):
    common = dict(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=max(256, cfg.seq_len),
        tie_word_embeddings=False,
    )
    return LlamaConfig(**common) if cfg.family == "llama" else Qwen2Config(**common)


def build(cfg: BenchConfig, n_adapters: int, device: str) -> MultiLoRAModel:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(cfg)).float().to(device)
    m = MultiLoRAModel.from_model(model, max_loras=n_adapters, max_rank=RANK)
    for i in range(n_adapters):
        m.add_adapter(f"a{i}", rank=RANK, alpha=2 * RANK, seed=i)
        with torch.no_grad():  # non-zero B so every adapter does real work in the backward
            for p in m.adapter_parameters(f"a{i}")[1::2]:
                p.normal_(0, 0.01)
    return m.train()


def _loop_forward(self: LoRALinear, x: torch.Tensor) -> torch.Tensor:
    """The algorithm before grouped compute: per used slot, two matmuls on its rows (gathered once per layer)."""
    y = F.linear(x, self.weight, self.bias)
    routing = self.router.current
    if routing is None or not routing.groups:
        return y
    out = y.clone()
    for g in routing.groups:
        rows = torch.tensor([i for i, s in enumerate(routing.slots) if s == g.slot], device=x.device)
        xa = F.linear(x.index_select(0, rows), self.lora_A[g.slot, : g.rank])
        out.index_add_(0, rows, F.linear(xa, self.lora_B[g.slot, :, : g.rank]) * g.scale)
    return out


@contextlib.contextmanager
def loop_kernel() -> Iterator[None]:
    grouped = LoRALinear.forward
    LoRALinear.forward = _loop_forward
    try:
        yield
    finally:
        LoRALinear.forward = grouped


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


def fwd_bwd(m: MultiLoRAModel, embeds: torch.Tensor, names: list[str | None], loop: bool = False) -> None:
    m.zero_lora_grads()
    x = embeds.detach().requires_grad_()
    with loop_kernel() if loop else contextlib.nullcontext():
        m(inputs_embeds=x, adapter_names=names).logits.float().mean().backward()


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median over runs of the per-run ratio: robust to load that drifts between runs."""
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def train_flops(m: MultiLoRAModel, tokens: int, with_lora: bool) -> float:
    """Matmul FLOPs of one forward+backward over `tokens` (frozen base: activation grads only)."""
    flops = 0.0
    for _, (fan_in, fan_out) in m.layer_shapes.items():
        flops += 4.0 * fan_in * fan_out  # forward + activation-grad backward
        if with_lora:
            flops += 6.0 * RANK * (fan_in + fan_out)  # forward, activation grad, weight grads of A and B
    head = m.base_model.get_output_embeddings().weight
    flops += 4.0 * head.shape[0] * head.shape[1]
    return flops * tokens


def matmul_peak(device: str, runs: int = 7) -> float:
    """fp32 GFLOP/s of a 1024^3 matmul in this process at the current thread count (median of `runs`)."""
    a, b = torch.randn(1024, 1024, device=device), torch.randn(1024, 1024, device=device)
    times = []
    for _ in range(runs + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * 1024**3 / statistics.median(times[1:]) / 1e9


def bench_config(cfg: BenchConfig, ns: tuple[int, ...], loop_ns: tuple[int, ...], warmup: int, runs: int, device: str):
    m = build(cfg, max(ns), device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (cfg.rows, cfg.seq_len), generator=g).to(device)
    embeds = m.base_model.get_input_embeddings()(ids).detach()
    fns: dict[str, Callable[[], None]] = {"base": lambda: fwd_bwd(m, embeds, [None] * cfg.rows)}
    for n in ns:
        names = [f"a{i % n}" for i in range(cfg.rows)]
        fns[str(n)] = lambda names=names: fwd_bwd(m, embeds, names)
        if n in loop_ns:
            fns[f"loop{n}"] = lambda names=names: fwd_bwd(m, embeds, names, loop=True)
    times = time_interleaved(fns, warmup, runs, device)
    med = {key: statistics.median(t) for key, t in times.items()}
    tokens = cfg.rows * cfg.seq_len
    lora_flops = train_flops(m, tokens, with_lora=True)
    rows = []
    for n in ns:
        row = dict(
            n=n,
            ms=med[str(n)],
            over_one=paired_ratio(times[str(n)], times[str(ns[0])]),
            over_base=paired_ratio(times[str(n)], times["base"]),
            gflops=lora_flops / med[str(n)] / 1e6,
        )
        if n in loop_ns:
            row.update(
                loop_ms=med[f"loop{n}"],
                loop_over_one=paired_ratio(times[f"loop{n}"], times[str(ns[0])]),
                loop_gflops=lora_flops / med[f"loop{n}"] / 1e6,
            )
        rows.append(row)
    return med["base"], rows


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def wrap_cost(cfg: BenchConfig, max_loras: int, device: str, runs: int = 3) -> dict[str, float]:
    """Median seconds to wrap (max_loras vs 1 slot), the LoRA tensors' bytes, and the RSS growth of wrapping."""
    torch.manual_seed(0)
    out: dict[str, list[float]] = {"s": [], "s1": [], "rss": []}
    lora_bytes, n_params = 0, 0
    for _ in range(runs):
        for slots in (1, max_loras):
            model = AutoModelForCausalLM.from_config(hf_config(cfg)).float().to(device)
            gc.collect()
            before = rss_mib()
            start = time.perf_counter()
            m = MultiLoRAModel.from_model(model, max_loras=slots, max_rank=RANK)
            elapsed = time.perf_counter() - start
            if slots == max_loras:
                out["s"].append(elapsed)
                out["rss"].append(rss_mib() - before)
                lora = [p for n, p in m.named_parameters() if "lora_" in n]
                lora_bytes, n_params = sum(p.numel() * p.element_size() for p in lora), len(lora)
            else:
                out["s1"].append(elapsed)
            del m, model
    return dict(
        seconds=statistics.median(out["s"]),
        seconds_one=statistics.median(out["s1"]),
        lora_mib=lora_bytes / 2**20,
        rss_mib=statistics.median(out["rss"]),
        n_params=n_params,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 timed runs instead of 5")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads (default 1: on a loaded shared 2-core machine descheduled OpenMP threads made timings "
        "noisy); the FLOP/s share is against the matmul peak at this thread count",
    )
    parser.add_argument("--only", choices=["tiny", "h1024"], help="run one model config only")
    args = parser.parse_args()
    threads = args.threads if args.device == "cpu" else torch.get_num_threads()
    torch.set_num_threads(threads)
    warmup, runs = (1, 3) if args.quick else (1, 5)
    configs = [
        # the tiny preset's shape (examples/multi_lora/configs/tiny.yaml: llama, hidden 128, 4 layers)
        BenchConfig("tiny preset", "llama", 128, 384, 4, 4, 2, 512, rows=256, seq_len=32),
        BenchConfig("qwen2 h1024 L2", "qwen2", 1024, 2816, 2, 16, 4, 2048, rows=256, seq_len=16),
    ]
    if args.only:
        configs = [configs[0]] if args.only == "tiny" else [configs[1]]
    ns, loop_ns = (1, 8, 64, 256), (8, 64, 256)
    peak = matmul_peak(args.device)
    print(
        f"device={args.device} threads={threads} torch={torch.__version__} warmup={warmup} runs={runs} rank={RANK} "
        f"fp32 matmul peak={peak:.1f} GFLOP/s (1024^3, this process)"
    )
    header = (
        f"{'config':<15} {'rows x T':>8} {'N':>4} {'base ms':>8} {'ms':>8} {'N/1':>6} {'N/base':>7} {'GFLOP/s':>8} "
        f"{'%peak':>6} | {'loop ms':>8} {'loop/1':>7} {'%peak':>6}"
    )
    print(header)
    print("-" * len(header), flush=True)
    for cfg in configs:
        base_ms, rows = bench_config(cfg, ns, loop_ns, warmup, runs, args.device)
        for r in rows:
            loop = (
                f"{r['loop_ms']:>8.1f} {r['loop_over_one']:>7.2f} {100 * r['loop_gflops'] / peak:>5.1f}%"
                if "loop_ms" in r
                else f"{'':>8} {'':>7} {'':>6}"
            )
            print(
                f"{cfg.name:<15} {f'{cfg.rows}x{cfg.seq_len}':>8} {r['n']:>4} {base_ms:>8.1f} {r['ms']:>8.1f} "
                f"{r['over_one']:>6.2f} {r['over_base']:>7.2f} {r['gflops']:>8.1f} {100 * r['gflops'] / peak:>5.1f}% "
                f"| {loop}",
                flush=True,
            )
    print("\nwrapping with max_loras=1024 (rank 8) vs 1, median of 3:")
    for cfg in configs:
        w = wrap_cost(cfg, 1024, args.device)
        print(
            f"{cfg.name:<15} {w['seconds']:.3f} s (1 slot: {w['seconds_one']:.3f} s); {w['n_params']} LoRA Parameters; "
            f"LoRA tensors {w['lora_mib']:.1f} MiB; RSS growth {w['rss_mib']:.1f} MiB",
            flush=True,
        )


if __name__ == "__main__":
    main()
