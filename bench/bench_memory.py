"""Memory profile of a GRPO run by component and by phase: where a run's resident memory goes.

    python bench/bench_memory.py                                   # the SmolLM2 3-tenant example, 3 steps
    python bench/bench_memory.py --config examples/multi_lora/configs/tiny.yaml --steps 5

In one process: builds the run from its config (eval off by default: `--eval` keeps it), then samples the resident
set size (RSS) of this process and, apart, of its children (the reward workers) every 10 ms while the steps run,
each sample tagged with the step phase it fell in (`rollout_s`, `reward_s`, `train_s`, ... as the step's own
timings name them). Prints, and with `--json` writes:

- held: bytes of what the run holds as tensors: the base weights, the LoRA slots (trainer), the engine's adapter bank,
  the tenants' optimizer states (after the last step);
- per phase: the peak RSS of this process and its rise, the peak above the RSS at the phase's start (what the phase
  itself allocated; the largest over the steps), and the children's peak;
- the process's RSS before the model is built, after the run is built, and its peak.

RSS is what the OS charges; on CPU, PyTorch's allocator is the C library's malloc, so a peak includes what a phase
freed but malloc kept. Peaks vary little run to run (the data and the seeds are fixed); timings here mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 2**30
MIB = 2**20


class Sampler(threading.Thread):
    """RSS of this process and of its children every `period` s, tagged with the phase `self.phase` names."""

    def __init__(self, period: float = 0.01):
        super().__init__(daemon=True)
        self.proc = psutil.Process()
        self.period = period
        self.phase = "build"
        self.peak: dict[str, int] = {}  # phase -> peak RSS of this process
        self.start_rss: dict[str, int] = {}  # phase -> RSS when it (first) began
        self.rise: dict[str, int] = {}  # phase -> its largest peak above the RSS at its start (over its entries)
        self._entry_peak = 0  # the peak RSS since the current phase entry began
        self.children_peak: dict[str, int] = {}
        self._halt = threading.Event()

    def rss(self) -> int:
        return self.proc.memory_info().rss

    def children_rss(self) -> int:
        total = 0
        for c in self.proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += c.memory_info().rss
        return total

    def enter(self, phase: str) -> int:
        start = self.rss()
        self._entry_peak = start
        self.phase = phase
        self.start_rss.setdefault(phase, start)
        return start

    def record(self, phase: str, start: int) -> None:
        top = max(self._entry_peak, self.rss())
        self.peak[phase] = max(self.peak.get(phase, 0), top)
        self.rise[phase] = max(self.rise.get(phase, 0), top - start)

    def run(self) -> None:
        while not self._halt.is_set():
            phase, now, kids = self.phase, self.rss(), self.children_rss()
            self.peak[phase] = max(self.peak.get(phase, 0), now)
            self._entry_peak = max(self._entry_peak, now)
            self.children_peak[phase] = max(self.children_peak.get(phase, 0), kids)
            time.sleep(self.period)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def _tensors(obj, depth: int = 2):
    """Tensors reachable from `obj`'s attributes (through dicts, lists and tuples, `depth` levels)."""
    items = vars(obj).values() if hasattr(obj, "__dict__") else obj
    for v in items:
        if isinstance(v, torch.Tensor):
            yield v
        elif depth and isinstance(v, dict):
            yield from _tensors(list(v.values()), depth - 1)
        elif depth and isinstance(v, list | tuple):
            yield from _tensors(list(v), depth - 1)


def held(rt) -> dict[str, int]:
    """Bytes of the tensors the run holds, by component (storages counted once)."""
    backend = rt.backend
    model = backend.model
    named = list(model.base_model.named_parameters())
    out = {
        "base_weights": tensor_bytes(p for n, p in named if "lora_" not in n),
        "lora_slots_trainer": tensor_bytes(p for n, p in named if "lora_" in n),
    }
    states = []
    for t in backend.trainer.ops.tenants.values():
        for st in t.optim.optimizer.state.values():
            states.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        states.extend(t.grads or [])
    out["optimizer_states_and_grad_buffers"] = tensor_bytes(states)
    engine = getattr(rt.generator, "engine", None)
    bank = getattr(engine, "_bank", None)
    if bank is not None:
        out["engine_adapter_bank"] = tensor_bytes(_tensors(bank))
    return out


def profile(config: Path, steps: int, keep_eval: bool, overrides: list[str] | None = None) -> dict:
    import rl_multilora.loop as loop
    from rl_multilora.config import load_run_config

    sampler = Sampler()
    rss_before = sampler.rss()
    cfg = load_run_config(config, overrides or [])
    data = cfg.model_dump(mode="json")
    data.update(
        run_dir=str(Path("/tmp") / f"bench_memory_{config.stem}"),
        max_global_steps=steps,
        checkpoint={**data["checkpoint"], "resume": "never"},
        logging={**data["logging"], "plot": False, "progress": False},
    )
    if not keep_eval:
        data["eval"] = {**data["eval"], "enabled": False}
    cfg = type(cfg).model_validate(data)

    original = loop._Clock.__call__

    @contextlib.contextmanager
    def tagged(self, key):
        start = sampler.enter(key)
        with original(self, key):
            yield
        sampler.record(key, start)
        sampler.phase = "between"

    loop._Clock.__call__ = tagged
    sampler.start()
    try:
        rt = loop.Runtime.build(cfg)
        rss_built = sampler.rss()
        rt.start()
        for _ in range(steps):
            if rt.finished():
                break
            rt.step()
        components = held(rt)
        rt.close()
    finally:
        loop._Clock.__call__ = original
        sampler.stop()
    return {
        "config": str(config),
        "overrides": list(overrides or []),
        "steps": steps,
        "torch_threads": torch.get_num_threads(),
        "rss_before_build_mib": rss_before / MIB,
        "rss_after_build_mib": rss_built / MIB,
        "rss_peak_mib": max(sampler.peak.values()) / MIB,
        "held_mib": {k: v / MIB for k, v in components.items()},
        "phase_peak_mib": {k: v / MIB for k, v in sampler.peak.items()},
        "phase_rise_mib": {k: v / MIB for k, v in sampler.rise.items()},
        "children_peak_mib": {k: v / MIB for k, v in sampler.children_peak.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "examples/multi_lora/configs/smollm2.yaml")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--eval", action="store_true", help="keep the config's held-out evals (off by default)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, as `run --set`")
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args()
    torch.set_num_threads(1)
    res = profile(args.config, args.steps, args.eval, args.set)
    print(f"{res['config']}: {res['steps']} steps, torch threads {res['torch_threads']}")
    print(f"RSS before build {res['rss_before_build_mib']:.0f} MiB, after build {res['rss_after_build_mib']:.0f} MiB, "
          f"peak {res['rss_peak_mib']:.0f} MiB")  # fmt: skip
    print("held as tensors (MiB): " + ", ".join(f"{k} {v:.1f}" for k, v in res["held_mib"].items()))
    print(f"{'phase':<14} {'peak RSS':>10} {'rise':>10} {'children':>10}  (MiB)")
    for phase, peak in res["phase_peak_mib"].items():
        rise = res["phase_rise_mib"].get(phase)
        kids = res["children_peak_mib"].get(phase, 0.0)
        print(f"{phase:<14} {peak:>10.0f} {'' if rise is None else f'{rise:.0f}':>10} {kids:>10.0f}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
