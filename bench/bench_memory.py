"""Memory profile of a GRPO run by component and by phase: where a run's resident memory goes.

    python bench/bench_memory.py                                   # the SmolLM2 3-tenant example, 3 steps
    python bench/bench_memory.py --config examples/multi_lora/configs/tiny.yaml --steps 5
    python bench/bench_memory.py --threads 2                       # as `rl-multilora run` on a 2-core machine

In one process: builds the run from its config (eval off by default: `--eval` keeps it), then samples, every 10 ms
while the steps run, the resident set size (RSS) of this process, the bytes malloc has handed out and not got back
(the live heap, `host_memory.heap_in_use`; glibc or jemalloc) and, apart, the RSS of its children (the reward workers), each
sample tagged with the step phase it fell in (`rollout_s`, `reward_s`, `train_s`, ... as the step's own timings name
them). Prints, and with `--json` writes:

- held: bytes of what the run holds as tensors: the base weights, the LoRA slots (trainer), the engine's adapter bank,
  the tenants' optimizer states (after the last step);
- per phase: the peak RSS of this process and its rise (the peak above the RSS at the phase's start: what the phase
  itself allocated; the largest over the steps), the same two of the live heap, the process's CPU time in the phase
  (user + system, summed over the steps) and the children's peak;
- train: the largest bytes one micro-batch's forward saved for its backward (autograd's saved tensors, parameters
  left out: with activation checkpointing, each layer's input and the head's inputs);
- the peak RSS: the largest sample, and the kernel's own high-water mark of the process (`ru_maxrss`), which also
  holds a peak that fell between two samples;
- the peak by component: the RSS before the model is built (interpreter, torch, libraries), the base weights
  (file-backed pages of the mapped safetensors, RssFile's rise), the live heap between steps less the heap before
  the build, which the first term holds already (the held tensors above, Python objects), each phase's live-heap
  rise (rollout: the KV cache and logits; train: saved activations and temporaries), and the rest of the peak:
  mostly pages malloc kept free (a fragmented heap).

RSS is what the OS charges; on CPU, PyTorch's allocator is the C library's malloc, so a peak includes what a phase
freed but malloc kept. Peaks vary little run to run (the data and the seeds are fixed); CPU times vary with the
machine's load (other processes share its caches and memory bus).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rl_multilora.host_memory import (  # noqa: E402
    MKL_BUFFER_CACHE_ENV,
    exec_with_jemalloc,
    heap_in_use,
    jemalloc_loaded,
    no_mkl_buffer_cache,
    restore_child_env,
)

restore_child_env()  # started again under jemalloc (--set model.host_allocator=jemalloc): children get the old env
no_mkl_buffer_cache()  # as `rl-multilora run` does, before torch is imported
import torch  # noqa: E402

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
        self.heap_peak: dict[str, int] = {}  # phase -> peak live heap
        self.heap_rise: dict[str, int] = {}  # phase -> its largest peak above the live heap at its start
        self._heap_start = 0
        self._entry_heap_peak = 0
        self.cpu_s: dict[str, float] = {}  # phase -> process CPU time (user + system) in it, summed over entries
        self._cpu_start = 0.0
        self._own_cpu = 0.0  # the sampler thread's own CPU seconds, as of its last sample
        # A sample counts toward the current entry's peak only if that entry began before the sample was read: without
        # this, a sample read late in training and applied after the next phases began (the thread waits for the GIL
        # between the two) showed up as a 0.6-2 GB rise of the weight sync.
        self._entry = 0
        self._lock = threading.Lock()
        self._halt = threading.Event()

    def rss(self) -> int:
        return self.proc.memory_info().rss

    @staticmethod
    def heap() -> int:
        return heap_in_use() or 0

    def cpu(self) -> float:
        """The process's CPU seconds but this sampler's own (about 0.14 CPU s per wall s at a 10 ms period here,
        which grew a slow phase's count with its wall time, not its work)."""
        t = os.times()
        return t.user + t.system - self._own_cpu

    def children_rss(self) -> int:
        total = 0
        for c in self.proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += c.memory_info().rss
        return total

    def enter(self, phase: str) -> int:
        start = self.rss()
        with self._lock:
            self._entry += 1
            self._entry_peak = start
            self._heap_start = self._entry_heap_peak = self.heap()
            self.phase = phase
        self._cpu_start = self.cpu()
        self.start_rss.setdefault(phase, start)
        return start

    def leave(self) -> None:
        with self._lock:
            self._entry += 1
            self.phase = "between"

    def record(self, phase: str, start: int) -> None:
        with self._lock:
            entry_peak, entry_heap_peak = self._entry_peak, self._entry_heap_peak
        top = max(entry_peak, self.rss())
        self.peak[phase] = max(self.peak.get(phase, 0), top)
        self.rise[phase] = max(self.rise.get(phase, 0), top - start)
        heap_top = max(entry_heap_peak, self.heap())
        self.heap_peak[phase] = max(self.heap_peak.get(phase, 0), heap_top)
        self.heap_rise[phase] = max(self.heap_rise.get(phase, 0), heap_top - self._heap_start)
        self.cpu_s[phase] = self.cpu_s.get(phase, 0.0) + self.cpu() - self._cpu_start

    def run(self) -> None:
        while not self._halt.is_set():
            with self._lock:
                phase, entry = self.phase, self._entry
            now, heap, kids = self.rss(), self.heap(), self.children_rss()
            with self._lock:
                self.peak[phase] = max(self.peak.get(phase, 0), now)
                self.heap_peak[phase] = max(self.heap_peak.get(phase, 0), heap)
                if entry == self._entry:
                    self._entry_peak = max(self._entry_peak, now)
                    self._entry_heap_peak = max(self._entry_heap_peak, heap)
            self.children_peak[phase] = max(self.children_peak.get(phase, 0), kids)
            self._own_cpu = time.thread_time()  # this thread's CPU seconds so far (`cpu` leaves them out)
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


def rss_file() -> int:
    """Resident file-backed pages of this process (mapped libraries and weight files), bytes (0 off Linux)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    return 0


class SavedForBackward:
    """The bytes a forward saves for its backward (autograd's saved tensors, storages counted once, parameters left
    out), largest over the calls wrapped by `track`. Read through `TrainOps.saved_observer`: the tensors the forward
    keeps as they are, not those it recomputes in the backward (`rl_multilora.saved_activations`)."""

    def __init__(self, params):
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.largest = 0

    @contextlib.contextmanager
    def track(self):
        sizes: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.param_storages:
                sizes[storage.data_ptr()] = storage.nbytes()
            return t

        self.observe = pack
        try:
            yield
        finally:
            self.observe = None
        self.largest = max(self.largest, sum(sizes.values()))


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
    import rl_multilora.train_ops as train_ops
    from rl_multilora.config import load_run_config

    sampler = Sampler()
    rss_before, file_before, heap_before = sampler.rss(), rss_file(), sampler.heap()
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
        sampler.leave()

    forward_logp = train_ops.TrainOps._forward_logp
    saved: SavedForBackward | None = None

    def tracked_forward_logp(self, *args, **kwargs):
        with saved.track():
            self.saved_observer = saved.observe  # what the forward keeps as it is (rl_multilora.saved_activations)
            try:
                return forward_logp(self, *args, **kwargs)
            finally:
                self.saved_observer = None

    loop._Clock.__call__ = tagged
    train_ops.TrainOps._forward_logp = tracked_forward_logp
    sampler.start()
    try:
        rt = loop.Runtime.build(cfg)
        saved = SavedForBackward(rt.backend.model.parameters())
        rss_built = sampler.rss()
        rt.start()
        for _ in range(steps):
            if rt.finished():
                break
            rt.step()
        heap_between = sampler.heap()
        components = held(rt)
        file_after = rss_file()
        rt.close()
    finally:
        loop._Clock.__call__ = original
        train_ops.TrainOps._forward_logp = forward_logp
        sampler.stop()
    peak_phase = max(sampler.peak, key=sampler.peak.get)
    peak = sampler.peak[peak_phase]
    by_component = {
        "interpreter_torch_libraries": rss_before,
        "base_weights_file_backed": file_after - file_before,
        # the heap the build and the steps added: the heap before the build (imports: ~90 MiB) is in the RSS above
        "live_heap_between_steps_since_build": heap_between - heap_before,
        f"{peak_phase}_live_heap_rise": sampler.heap_rise.get(peak_phase, 0),
    }
    # the rest: pages malloc keeps free, other memory; negative where the estimates overlap (RssFile's rise also
    # counts the tokenizer's and the configs' files; the live heap is read at the end, not at the peak phase's start)
    by_component["rest_malloc_kept_free_and_other"] = peak - sum(by_component.values())
    return {
        "config": str(config),
        "overrides": list(overrides or []),
        "steps": steps,
        "torch_threads": torch.get_num_threads(),
        "mkl_buffer_cache": "off" if os.environ.get(MKL_BUFFER_CACHE_ENV) == "1" else "on",
        "rss_before_build_mib": rss_before / MIB,
        "rss_after_build_mib": rss_built / MIB,
        "heap_before_build_mib": heap_before / MIB,
        "rss_peak_mib": max(sampler.peak.values()) / MIB,
        # the kernel's own high-water mark of this process's RSS (KiB on Linux): a peak between two samples is in it
        "rss_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "held_mib": {k: v / MIB for k, v in components.items()},
        "phase_peak_mib": {k: v / MIB for k, v in sampler.peak.items()},
        "phase_rise_mib": {k: v / MIB for k, v in sampler.rise.items()},
        "children_peak_mib": {k: v / MIB for k, v in sampler.children_peak.items()},
        "heap_peak_mib": {k: v / MIB for k, v in sampler.heap_peak.items()},
        "heap_rise_mib": {k: v / MIB for k, v in sampler.heap_rise.items()},
        "phase_cpu_s": dict(sampler.cpu_s),
        "train_saved_for_backward_mib": saved.largest / MIB,
        "peak_phase": peak_phase,
        "peak_by_component_mib": {k: v / MIB for k, v in by_component.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "examples/multi_lora/configs/smollm2.yaml")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--eval", action="store_true", help="keep the config's held-out evals (off by default)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, as `run --set`")
    p.add_argument("--json", type=Path, help="write the result here")
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (`rl-multilora run` uses the machine's cores)"
    )
    args = p.parse_args()
    from rl_multilora.config import load_run_config

    if load_run_config(args.config, args.set).model.host_allocator == "jemalloc" and not jemalloc_loaded():
        exec_with_jemalloc([__file__, *sys.argv[1:]])  # as `rl-multilora run` does: malloc is fixed at a start
    torch.set_num_threads(args.threads)
    res = profile(args.config, args.steps, args.eval, args.set)
    print(
        f"{res['config']}: {res['steps']} steps, torch threads {res['torch_threads']}, MKL's buffer cache "
        f"{res['mkl_buffer_cache']}, malloc {'jemalloc' if jemalloc_loaded() else 'the C library'}"
    )
    print(f"RSS before build {res['rss_before_build_mib']:.0f} MiB, after build {res['rss_after_build_mib']:.0f} MiB, "
          f"peak {res['rss_peak_mib']:.0f} MiB (sampled every 10 ms; the kernel's high-water mark, ru_maxrss: "
          f"{res['rss_maxrss_mib']:.0f} MiB)")  # fmt: skip
    print("held as tensors (MiB): " + ", ".join(f"{k} {v:.1f}" for k, v in res["held_mib"].items()))
    print(
        f"{'phase':<14} {'peak RSS':>9} {'rise':>6} {'live heap':>10} {'rise':>6} {'CPU s':>7} {'children':>9}  (MiB)"
    )
    for phase, peak in res["phase_peak_mib"].items():
        rise = res["phase_rise_mib"].get(phase)
        heap, heap_rise = res["heap_peak_mib"].get(phase, 0.0), res["heap_rise_mib"].get(phase)
        cpu = res["phase_cpu_s"].get(phase)
        kids = res["children_peak_mib"].get(phase, 0.0)
        print(f"{phase:<14} {peak:>9.0f} {'' if rise is None else f'{rise:.0f}':>6} {heap:>10.0f} "
              f"{'' if heap_rise is None else f'{heap_rise:.0f}':>6} {'' if cpu is None else f'{cpu:.1f}':>7} "
              f"{kids:>9.0f}")  # fmt: skip
    print(f"train: largest micro-batch's saved-for-backward {res['train_saved_for_backward_mib']:.0f} MiB")
    print(f"peak {res['rss_peak_mib']:.0f} MiB (in {res['peak_phase']}), by component (MiB): "
          + ", ".join(f"{k} {v:.0f}" for k, v in res["peak_by_component_mib"].items()))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
