"""Asynchronous vs synchronous steps on the same rows: step throughput, and the pause other tenants see at publish.

Workload: the tiny preset's config (`examples/multi_lora/configs/tiny.yaml`: three tenants, 8 prompts x 8 samples
each per step, one embedded engine), eval off, checkpoints off. Each run builds a fresh `Runtime` in this process and
times `--steps` steps after one warm-up step; `sync` and `async` runs alternate, `--repeats` each. Reported: medians
(min-max) of seconds per step and rows per second, the ratio async / sync of throughput (median of the per-pair
ratios), the per-step pause (the engine's pause at publish: what other tenants' requests wait), and the phase times
of the sync runs. From those phases, the GPU case is modelled: a synchronous step costs rollout + eval + reward +
train + sync, an asynchronous one max(rollout, reward + train) + sync's publish, if generation and training run on
separate devices (engine actors on their own GPU) and so do not share cores as they do here.

    python bench/bench_async.py [--preset DIR] [--steps 8] [--repeats 3] [--engine-actors]

`--engine-actors`: the engine runs as a Ray actor in its own process (`rollout.engine_actors`), apart from the
trainer, as on a GPU cluster (needs the `ray` extra).

Provision the tiny preset first (`bash examples/multi_lora/provision.sh`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from rl_multilora.config import parse_run_config  # noqa: E402
from rl_multilora.loop import Runtime  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def one_run(mode: str, preset: Path, steps: int, run_dir: Path, engine_actors: bool = False) -> dict:
    data = yaml.safe_load((ROOT / "examples/multi_lora/configs/tiny.yaml").read_text())
    text = yaml.safe_dump(data).replace("artifacts/tiny", str(preset))
    data = yaml.safe_load(text)
    data.update(run_dir=str(run_dir), max_global_steps=steps + 1)
    data["rollout"]["mode"] = mode
    data["rollout"]["engine_actors"] = engine_actors
    data["eval"] = {"enabled": False}
    data["checkpoint"] = {"save_every": 10_000, "keep_last": 1}
    data["logging"] = {"plot": False, "progress": False}
    cfg = parse_run_config(data)
    rt = Runtime.build(cfg)
    try:
        rt.start(checked=False)
        rt.step()  # warm-up (and, async, the first rollout ahead)
        rows = 0
        pauses, phases = [], {}
        t0 = time.perf_counter()
        for _ in range(steps):
            res = rt.step()
            rows += sum(r.n_samples for r in res.records)
            pauses.append(res.sync.pause_s if res.sync is not None else 0.0)
            for k, v in res.timings.items():
                phases[k] = phases.get(k, 0.0) + v
        wall = time.perf_counter() - t0
    finally:
        rt.close()
    return {
        "step_s": wall / steps,
        "rows_per_s": rows / wall,
        "pause_s": statistics.median(pauses),
        "phases": {k: v / steps for k, v in phases.items()},
    }


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="artifacts/tiny")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="runs/bench_async")
    p.add_argument("--engine-actors", action="store_true", help="the engine as a Ray actor, apart from the trainer")
    args = p.parse_args()
    if args.engine_actors:
        import ray

        ray.init(address="local", include_dashboard=False, configure_logging=False, log_to_driver=False)
    preset = Path(args.preset).resolve()
    results: dict[str, list[dict]] = {"sync": [], "async": []}
    for i in range(args.repeats):
        for mode in ("sync", "async"):
            out = Path(args.out) / f"{mode}-{i}"
            results[mode].append(one_run(mode, preset, args.steps, out, args.engine_actors))
            print(f"run {i} {mode}: {results[mode][-1]['step_s']:.3f} s/step", flush=True)
    where = "engine as a Ray actor" if args.engine_actors else "engine in this process"
    print(f"\n{args.steps} steps x {args.repeats} runs per mode, tiny preset (3 tenants x 64 rows per step), {where}")
    print("| mode | s/step | rows/s | pause at publish, s |")
    print("|---|---|---|---|")
    for mode, runs in results.items():
        print(
            f"| {mode} | {spread([r['step_s'] for r in runs])} | {spread([r['rows_per_s'] for r in runs], '{:.1f}')} "
            f"| {spread([r['pause_s'] for r in runs], '{:.4f}')} |"
        )
    ratio = [a["rows_per_s"] / s["rows_per_s"] for a, s in zip(results["async"], results["sync"], strict=True)]
    print(f"throughput async / sync: {spread(ratio)}")
    ph = {k: statistics.median(r["phases"].get(k, 0.0) for r in results["sync"]) for k in results["sync"][0]["phases"]}
    print("sync phases, s/step (median): " + ", ".join(f"{k} {v:.3f}" for k, v in ph.items()))
    serial = sum(ph.values())
    overlap = max(ph.get("rollout_s", 0.0), ph.get("reward_s", 0.0) + ph.get("train_s", 0.0) + ph.get("eval_s", 0.0))
    rest = ph.get("checkpoint_s", 0.0)
    print(
        f"modelled with generation and training on separate devices: sync {serial:.3f} s/step, async "
        f"{overlap + rest:.3f} s/step (no pause), speed-up {serial / (overlap + rest):.2f}x"
    )


if __name__ == "__main__":
    main()
