"""Rollout throughput of the embedded multi-LoRA engine: one mixed batch vs the alternatives.

For N adapters (1, 8, 64) the same workload (`rows` prompts, each generating exactly `new` tokens; EOS is
disabled so every strategy does the same work) is run five ways, all in one process on the same base:

- mixed:       one `EmbeddedEngine.generate` call, row i on adapter i % N (what a multi-tenant step does;
               N = 1 is the same work as one-adapter, so their gap shows the timing noise);
- one-adapter: the same batch with every row on one adapter (the best case for a single-LoRA engine);
- base:        the same batch on the base model, no LoRA (the LoRA overhead floor);
- sequential:  N engine calls, one adapter's rows at a time (what swapping adapters between batches costs);
- hf-peft:     N HF `generate` calls with PEFT, `set_adapter` per adapter (the textbook baseline).

Prompts are distinct (no prefix sharing helps any strategy). Greedy decoding, so the engine and HF do the same
arithmetic. Every number is the median of `--repeats` timed runs after one warm-up run. Run:

    python bench/bench_rollout.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.tiny_models when run as a script

from rl_multilora.lora import MultiLoRAModel  # noqa: E402
from rollout.engines.embedded import EmbeddedEngine  # noqa: E402
from rollout.types import GenerateRequest, SamplingParams  # noqa: E402
from tests.tiny_models import tiny_model  # noqa: E402

ADAPTER_COUNTS = (1, 8, 64)


@dataclass(frozen=True)
class Workload:
    """One benchmark setting: model size and batch shape."""

    name: str
    hidden: int
    layers: int
    vocab: int
    rows: int
    prompt_len: int
    new_tokens: int
    rank: int = 8


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def median_seconds(fns: dict[str, Callable[[], object]], repeats: int, clock: Callable[[], float]) -> dict[str, float]:
    """Median time of each callable over `interleaved_seconds`' rounds."""
    return {key: statistics.median(t) for key, t in interleaved_seconds(fns, repeats, clock).items()}


def interleaved_seconds(
    fns: dict[str, Callable[[], object]], repeats: int, clock: Callable[[], float]
) -> dict[str, list[float]]:
    """Every callable's time per round. Rounds are interleaved (every callable once per round), so a burst of load
    from other processes hits all strategies alike instead of skewing whichever ran during it."""
    for fn in fns.values():
        fn()  # warm-up: first-call allocations and lazy inits are not what we measure
    times: dict[str, list[float]] = {key: [] for key in fns}
    keys = list(fns)
    for r in range(repeats):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:  # each goes first in turn (fixed: later ones slower)
            fn = fns[key]
            start = clock()
            fn()
            times[key].append(clock() - start)
    return times


def random_adapter(model: MultiLoRAModel, rank: int, seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    """A PEFT-named adapter with non-zero A and B (a trained adapter, not PEFT's B = 0 init)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (in_features, out_features) in model.layer_shapes.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * 0.05
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.05
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": "all-linear"}
    return tensors, config


def run_workload(w: Workload, repeats: int, clock: Callable[[], float]) -> list[dict]:
    heads = max(2, w.hidden // 32)
    base = tiny_model("qwen2", seed=0, hidden=w.hidden, layers=w.layers, vocab=w.vocab, heads=heads)
    model = MultiLoRAModel.from_model(base, max_loras=max(ADAPTER_COUNTS), max_rank=w.rank)
    names = [f"t{i}" for i in range(max(ADAPTER_COUNTS))]
    engine = EmbeddedEngine(model, None, max_batch_size=w.rows, eos_token_ids=[])
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, w.vocab, (w.prompt_len,), generator=gen).tolist() for _ in range(w.rows)]
    params = SamplingParams(temperature=0.0, max_new_tokens=w.new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            tensors, config = random_adapter(model, w.rank, seed=100 + i)
            model.load_adapter_state_dict(name, tensors, config)
            model.export_adapter(name, Path(tmp) / name)
            engine.load_adapter(name, tensors, config)
        peft_model = PeftModel.from_pretrained(
            tiny_model("qwen2", seed=0, hidden=w.hidden, layers=w.layers, vocab=w.vocab, heads=heads),
            Path(tmp) / names[0],
            adapter_name=names[0],
        )
        for name in names[1:]:
            peft_model.load_adapter(Path(tmp) / name, adapter_name=name)
    peft_model.eval()
    peft_model.generation_config.eos_token_id = None  # same fixed-length work as the engine
    peft_model.generation_config.pad_token_id = 0

    def engine_call(adapters: list[str | None]) -> Callable[[], object]:
        requests = [GenerateRequest(p, adapter=a, sampling=params) for p, a in zip(prompts, adapters, strict=True)]
        return lambda: engine.generate(requests)

    def engine_sequential(n: int) -> Callable[[], object]:
        calls = [engine_call_rows(names[k], [p for i, p in enumerate(prompts) if i % n == k]) for k in range(n)]
        return lambda: [c() for c in calls]

    def engine_call_rows(name: str, rows: list[list[int]]) -> Callable[[], object]:
        requests = [GenerateRequest(p, adapter=name, sampling=params) for p in rows]
        return lambda: engine.generate(requests)

    def hf_sequential(n: int) -> Callable[[], object]:
        chunks = [torch.tensor([p for i, p in enumerate(prompts) if i % n == k]) for k in range(n)]

        def run():
            with torch.inference_mode():
                for k, ids in enumerate(chunks):
                    peft_model.set_adapter(names[k])
                    peft_model.generate(
                        input_ids=ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=w.new_tokens,
                        do_sample=False,
                    )

        return run

    fns = {"one": engine_call([names[0]] * w.rows), "base": engine_call([None] * w.rows)}
    for n in ADAPTER_COUNTS:
        fns[f"mixed{n}"] = engine_call([names[i % n] for i in range(w.rows)])
        fns[f"sequential{n}"] = engine_sequential(n)
        fns[f"hf{n}"] = hf_sequential(n)
    tokens = w.rows * w.new_tokens
    rate = {key: tokens / seconds for key, seconds in median_seconds(fns, repeats, clock).items()}
    table = [
        dict(
            n=n,
            mixed=rate[f"mixed{n}"],
            one=rate["one"],
            base=rate["base"],
            sequential=rate[f"sequential{n}"],
            hf=rate[f"hf{n}"],
        )
        for n in ADAPTER_COUNTS
    ]
    engine.close()
    return table


def print_table(w: Workload, table: list[dict], repeats: int, clock: str) -> None:
    print(
        f"\n{w.name}: qwen2 hidden={w.hidden} layers={w.layers} vocab={w.vocab} rank={w.rank} | rows={w.rows} "
        f"prompt={w.prompt_len} new={w.new_tokens} | generated tokens/s ({clock} clock), median of {repeats}"
    )
    header = (
        f"{'N':>3} {'mixed':>9} {'one-adapter':>12} {'base':>9} {'sequential':>11} {'hf-peft':>9} "
        f"{'mixed/one':>10} {'mixed/seq':>10} {'mixed/hf':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in table:
        print(
            f"{r['n']:>3} {r['mixed']:>9.0f} {r['one']:>12.0f} {r['base']:>9.0f} {r['sequential']:>11.0f} "
            f"{r['hf']:>9.0f} {r['mixed'] / r['one']:>10.2f} {r['mixed'] / r['sequential']:>10.2f} "
            f"{r['mixed'] / r['hf']:>9.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small batch, one model, 3 repeats (about a minute)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per number (default 3 quick, 5 full)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1 avoids OpenMP spin on shared cores)"
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: elapsed time; cpu: this process's CPU time (stable when other jobs share the cores)",
    )
    parser.add_argument("--only", choices=["tiny", "small"], help="run one of the full workloads only")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 5)
    if repeats < 3:
        parser.error(f"--repeats={repeats} is too few: use >= 3 so the median means something")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.quick:
        workloads = [Workload("tiny", hidden=128, layers=4, vocab=512, rows=64, prompt_len=16, new_tokens=16)]
    else:
        workloads = [
            Workload("tiny", hidden=128, layers=4, vocab=512, rows=64, prompt_len=32, new_tokens=32),
            Workload("small", hidden=512, layers=8, vocab=4096, rows=64, prompt_len=32, new_tokens=32),
        ]
    if args.only:
        workloads = [w for w in workloads if w.name == args.only]
    for w in workloads:
        print_table(w, run_workload(w, repeats, CLOCKS[args.clock]), repeats, args.clock)


if __name__ == "__main__":
    main()
