"""Step time of the 64-tenant example vs 3 tenants at the same rows per step, side by side in one process.

    python bench/bench_many.py [--config examples/multi_lora/configs/many.yaml] [--steps 6] [--warmup 1]

Both runs are built from `many.yaml` on the tiny preset (`examples/multi_lora/provision.sh` makes it): `many` is the
config as it is (64 tenants, one prompt group each per step); `three` keeps three of its tenants (one per task,
ranks 4, 8 and 16, as in tiny.yaml) and gives them the same total prompts per step, so both steps hold the same
rows. Held-out eval and periodic
checkpoints are off in both (they are not step cost). The two runtimes step in turns (many, three, many, ...) so
load that drifts on a shared machine hits both alike; reported are medians over steps of the step wall time, of
each phase, and of the wall time per generated token (responses differ in length between the two policies), and
the ratios many / three.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages when run as a script

from rl_multilora.config import RunConfig, load_run_config  # noqa: E402
from rl_multilora.loop import Runtime  # noqa: E402

PHASES = ("rollout_s", "reward_s", "train_s", "checkpoint_s", "sync_s")


def variants(cfg: RunConfig, run_root: Path) -> dict[str, RunConfig]:
    common = {
        "eval": {"enabled": False},
        "checkpoint": {"save_every": 10_000, "resume": "never"},
        "logging": {"plot": False, "progress": False},
    }
    rows = sum(a.prompts_per_step for a in cfg.adapters)
    # one tenant per task with ranks 4, 8 and 16 (many.yaml's t00, t04, t08), like tiny.yaml's three: the engine
    # computes a mixed batch at its largest rank, so three rank-4 tenants would be a cheaper batch than the same rows
    # of 64 tenants of ranks 4-16
    three = [a.model_copy() for a in (cfg.adapters[0], cfg.adapters[4], cfg.adapters[8])]
    for i, a in enumerate(three):
        a.prompts_per_step = rows // 3 + (1 if i < rows % 3 else 0)
    base = cfg.model_dump(mode="json")
    out = {}
    for name, adapters in (("many", cfg.adapters), ("three", three)):
        data = {**base, **common, "run_dir": str(run_root / name)}
        data["adapters"] = [a.model_dump(mode="json") for a in adapters]
        out[name] = RunConfig.model_validate(data)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/multi_lora/configs/many.yaml")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per runtime (median over them)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps per runtime")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error(f"--steps={args.steps} is too few: use >= 3 so the median means something")
    logging.basicConfig(level=logging.WARNING)
    cfg = load_run_config(args.config)
    with tempfile.TemporaryDirectory() as tmp:
        cfgs = variants(cfg, Path(tmp))
        runtimes = {name: Runtime.build(c) for name, c in cfgs.items()}
        try:
            for rt in runtimes.values():
                rt.start()
            times: dict[str, list[dict[str, float]]] = {name: [] for name in runtimes}
            order = list(runtimes.items())
            for i in range(args.warmup + args.steps):
                # the variants take turns going first: a fixed order made later ones measure 1-4 % slower
                for name, rt in order[i % len(order) :] + order[: i % len(order)]:
                    t0 = time.perf_counter()
                    res = rt.step()
                    wall = time.perf_counter() - t0
                    tokens = sum(r.response_len_mean * r.n_samples for r in res.records if r.n_samples)
                    rows = sum(r.n_samples for r in res.records)
                    if i >= args.warmup:
                        times[name].append({"step_s": wall, "tokens": tokens, "rows": rows, **res.timings})
        finally:
            for rt in runtimes.values():
                rt.close()

    def med(name: str, key: str) -> float:
        return statistics.median(t.get(key, 0.0) for t in times[name])

    def per_token_ms(name: str) -> float:
        return statistics.median(1e3 * t["step_s"] / t["tokens"] for t in times[name])

    tenants = {name: len(c.adapters) for name, c in cfgs.items()}
    print(
        f"{args.config}: medians over {args.steps} steps after {args.warmup} warm-up, runtimes stepping in turns; "
        f"rows/step many={med('many', 'rows'):.0f} three={med('three', 'rows'):.0f}"
    )
    header = f"{'':<22} {'many (' + str(tenants['many']) + ')':>12} {'three (3)':>12} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    lines = [("step wall (s)", med("many", "step_s"), med("three", "step_s"))]
    lines += [(f"  {p}", med("many", p), med("three", p)) for p in PHASES]
    lines += [("generated tokens", med("many", "tokens"), med("three", "tokens"))]
    lines += [("ms per generated token", per_token_ms("many"), per_token_ms("three"))]
    for label, a, b in lines:
        print(f"{label:<22} {a:>12.3f} {b:>12.3f} {a / b if b else float('nan'):>7.2f}")


if __name__ == "__main__":
    main()
