"""One run of N adapters vs N runs of one adapter each, with the same per-adapter work.

    python bench/bench_multi_vs_single.py [--preset-dir artifacts/tiny] [--adapters 4] [--steps 6] [--repeats 3]

Every run is its own process (`rl-multilora run`), as separate jobs would be. Reported, as medians over
`--repeats` interleaved repetitions (the multi run first in even ones, the singles first in odd ones):
- wall time: one N-adapter run vs the N one-adapter runs back to back (what a user waits for either way);
- peak memory (max RSS of the run process): the N-adapter run vs one single-adapter run, and vs N single runs
  running side by side, computed as N x one run's peak, not measured: each RSS counts the file-backed library pages
  N colocated jobs would share, so it overstates them (reward workers are left out on both sides);
- the share of step time spent in rollout, reward, train, checkpoint and sync, from metrics.jsonl.
Each process pays the same start-up (imports, model load, reward workers); that is part of what one run saves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PHASES = ["rollout_s", "reward_s", "train_s", "checkpoint_s", "sync_s"]


def adapter_cfg(i: int, data_dir: Path, steps: int) -> dict:
    return {
        "name": f"arith{i}",
        "rank": 8,
        "alpha": 16,
        "dataset": {
            "path": "json",
            "data_files": {"train": str(data_dir / "arith" / "train.jsonl")},
            "prompt_key": "problem",
            "label_key": "answer",
        },
        "reward": {"name": "math"},
        "lr": 2e-3,
        "prompts_per_step": 4,
        "max_steps": steps,
        "seed": 100 + i,
    }


def run_config(run_dir: Path, preset: Path, adapters: list[dict]) -> dict:
    return {
        "run_dir": str(run_dir),
        "model": {"path": str(preset / "model"), "max_loras": max(4, len(adapters)), "max_rank": 8},
        "rollout": {"n_samples_per_prompt": 8, "max_new_tokens": 40},
        "grpo": {"micro_batch_size": 32},
        "checkpoint": {"save_every": 1000, "resume": "never"},
        "logging": {"plot": False, "progress": False},
        "rewards": {"num_workers": 1},
        "adapters": adapters,
    }


def timed_run(cfg: dict, workdir: Path) -> tuple[float, float, list[dict]]:
    """Wall seconds, peak RSS (MiB) of the run process, metrics rows."""
    path = workdir / f"cfg-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    # A tiny wrapper reports the child's own max RSS, so concurrent runs of this script do not mix.
    code = (
        "import resource,sys; sys.argv=['rl-multilora','run',sys.argv[1]];"
        "from rl_multilora.cli import main; rc=main(sys.argv[1:]);"
        "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"run failed:\n{proc.stderr[-3000:]}")
    rss_kb = int([line for line in proc.stderr.splitlines() if line.startswith("MAXRSS_KB")][-1].split()[1])
    rows = [json.loads(line) for line in (Path(cfg["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return wall, rss_kb / 1024, rows


def phase_shares(rows: list[dict]) -> dict[str, float]:
    per_step: dict[int, dict[str, float]] = {}
    for r in rows:  # phase timings are per step, repeated on each adapter's row
        per_step[r["step"]] = {k: r.get(k) or 0.0 for k in PHASES}
    totals = {k: sum(s[k] for s in per_step.values()) for k in PHASES}
    whole = sum(totals.values()) or 1.0
    return {k: totals[k] / whole for k in PHASES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset-dir", default=str(ROOT / "artifacts" / "tiny"))
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    preset = Path(args.preset_dir)
    if not (preset / "model").is_dir():
        sys.exit(f"no provisioned preset at {preset}: run examples/multi_lora/provision.sh first")
    n = args.adapters
    multi_wall, single_wall, multi_rss, single_rss, shares_multi, shares_single = [], [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for rep in range(args.repeats):
            ads = [adapter_cfg(i, preset / "data", args.steps) for i in range(n)]

            def multi(rep=rep, ads=ads):
                w, rss, rows = timed_run(run_config(work / f"multi{rep}", preset, ads), work)
                multi_wall.append(w)
                multi_rss.append(rss)
                shares_multi.append(phase_shares(rows))

            def singles(rep=rep, ads=ads):
                walls, rsss = [], []
                for i, a in enumerate(ads):
                    w, rss, rows = timed_run(run_config(work / f"single{rep}-{i}", preset, [a]), work)
                    walls.append(w)
                    rsss.append(rss)
                    shares_single.append(phase_shares(rows))
                single_wall.append(sum(walls))
                single_rss.append(max(rsss))

            for side in (multi, singles) if rep % 2 == 0 else (singles, multi):  # each side goes first in turn
                side()
            print(f"rep {rep}: multi {multi_wall[-1]:.1f}s / {multi_rss[-1]:.0f} MiB; "
                  f"{n} singles {single_wall[-1]:.1f}s / {single_rss[-1]:.0f} MiB each", flush=True)  # fmt: skip
    med = statistics.median
    print(f"\nmachine: {os.cpu_count()} CPU cores; {n} adapters x {args.steps} steps, 4 prompts x 8 samples/step, "
          f"tiny preset; medians of {args.repeats}")  # fmt: skip
    print(f"{'':34}{'1 run, N adapters':>20}{'N runs, 1 adapter':>20}{'ratio':>10}")
    print(
        f"{'wall time (s)':34}{med(multi_wall):>20.1f}{med(single_wall):>20.1f}{med(multi_wall) / med(single_wall):>10.2f}"
    )
    print(f"{'peak RSS vs one single run (MiB)':34}{med(multi_rss):>20.0f}{med(single_rss):>20.0f}"
          f"{med(multi_rss) / med(single_rss):>10.2f}")  # fmt: skip
    print(f"{'peak RSS vs N singles side by side':34}{med(multi_rss):>20.0f}{n * med(single_rss):>20.0f}"
          f"{med(multi_rss) / (n * med(single_rss)):>10.2f}")  # fmt: skip
    print("\nshare of step time (median over runs):")
    print(f"{'phase':14}{'1 run, N adapters':>20}{'1-adapter runs':>20}")
    for k in PHASES:
        print(f"{k[:-2]:14}{med(s[k] for s in shares_multi):>20.1%}{med(s[k] for s in shares_single):>20.1%}")


if __name__ == "__main__":
    main()
