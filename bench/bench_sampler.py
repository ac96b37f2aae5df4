"""The embedded engine's per-decode-step work outside the model: the finiteness check, sampling and log-probs.

    python bench/bench_sampler.py                 # 96 rows of SmolLM2's 49,152-token vocabulary, 50 rounds
    python bench/bench_sampler.py --rows 192 --vocab 522

Times, interleaved round by round in one process on the same float32 logits, the engine's step as it is
(`nonfinite_rows`, `sample_next_tokens` over row chunks, `token_logprobs`) and as it was before commit "Cheaper
per-step checks" (`isfinite(logits).all(-1)`, and an argmax over every row even when every row samples). Rows sample
at temperature 0.7 (the SmolLM2 example's rollout) or, with `--greedy`, at temperature 0. Prints the medians (min-max)
in ms and checks both ways pick the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rollout.engines import sampling  # noqa: E402
from rollout.engines.embedded import _SAMPLE_ELEMENTS, nonfinite_rows  # noqa: E402
from rollout.types import SamplingParams  # noqa: E402


def before_check(logits) -> list[int]:
    """The decode loop's check before: every value's finiteness, then the rows that are not."""
    finite = torch.isfinite(logits).all(dim=-1)
    return [] if bool(finite.all()) else (~finite).nonzero().squeeze(1).tolist()


def before_sample(logits, params, generators):
    """`sample_next_tokens` before: the argmax over every row first."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if rows:
        index = torch.tensor(rows)
        tokens[index] = sampling._inverse_cdf_sample(
            logits[index], [params[i] for i in rows], [generators[i] for i in rows], False
        )
    return tokens


def step(logits, params, seeds, check, sample) -> list[int]:
    """One decode step's work after the forward, as `EmbeddedEngine._run_wave` and `_sample` do it."""
    assert check(logits) == []
    tokens: list[int] = []
    chunk = max(1, _SAMPLE_ELEMENTS // logits.shape[-1])
    for start in range(0, len(params), chunk):
        part = logits[start : start + chunk]
        gens = [torch.Generator().manual_seed(s) for s in seeds[start : start + chunk]]
        picked = sample(part, params[start : start + chunk], gens)
        tokens += picked.tolist()
        sampling.token_logprobs(part, picked).tolist()
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--greedy", action="store_true", help="temperature 0 for every row")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=0.0 if args.greedy else 0.7)] * args.rows
    seeds = list(range(args.rows))
    ways = {
        "now": (nonfinite_rows, sampling.sample_next_tokens),
        "before": (before_check, before_sample),
    }
    picked = {name: step(logits, params, seeds, *fns) for name, fns in ways.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(args.rounds):
        for name in ways if r % 2 else reversed(ways):
            start = time.perf_counter()
            step(logits, params, seeds, *ways[name])
            times[name].append((time.perf_counter() - start) * 1e3)
    print(
        f"{args.rows} rows x {args.vocab} logits, {'greedy' if args.greedy else 'temperature 0.7'}, "
        f"torch threads {torch.get_num_threads()}, {args.rounds} rounds; ms per decode step"
    )
    for name, values in times.items():
        print(f"{name:<7} {statistics.median(values):8.2f} ({min(values):.2f}-{max(values):.2f})")
    ratio = [b / n for b, n in zip(times["before"], times["now"], strict=True)]
    print(f"before / now: {statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f})")
    print(f"same tokens: {'yes' if picked['now'] == picked['before'] else 'NO'}")


if __name__ == "__main__":
    main()
