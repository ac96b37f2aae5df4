"""Load on the Tinker server: N SDK clients at once, a kill -9 of the server in the middle, nothing acknowledged lost.

    python bench/bench_tinker_load.py                          # 32 clients for 60 s, a SIGKILL + restart at 30 s
    python bench/bench_tinker_load.py --clients 8 --duration 20 --json out.json

Starts `python -m rl_multilora.tinker.server` on the tiny preset as a subprocess (`--max-loras` = clients), then N
threads, each with its own `tinker.ServiceClient` (its own session) and training client, loop until the duration is
over: `forward_backward` (one 16-token cross-entropy datum), `optim_step`, and every 4th round
`save_weights_and_get_sampling_client` + `sample` (8 tokens). Each call is timed from the SDK call to its result.
At `--kill-at` seconds (once at least N calls were answered) the server gets SIGKILL and is started again on the same state dir and port; the clients
are not told (the SDK retries while the port is closed; the restarted server replays its request journal).

At the end each client does a `save_state("final")`: the checkpoint's step count (`checkpoint.json`'s
`adapter_step`, written by the server) must equal the client's count of answered `optim_step` calls, so no
acknowledged step was lost or run twice across the kill. Reports per call p50 / p99 (all calls, and those that did
not overlap the restart), calls/s and datums/s, the restart's downtime, failed calls (must be 0) and lost steps.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tinker_clients import BASE, ROOT, TOKEN, _free_port, start_server  # noqa: E402

CALLS = ("forward_backward", "optim_step", "save_weights_for_sampler", "sample")


@dataclass
class Call:
    kind: str
    start: float
    end: float
    ok: bool


@dataclass
class Report:
    clients: int
    duration_s: float
    killed_at: float | None = None  # seconds after the load began
    back_at: float | None = None  # when the restarted server answered /healthz
    calls: list[Call] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    steps_answered: dict[str, int] = field(default_factory=dict)  # model id -> optim_steps the client got back
    steps_saved: dict[str, int] = field(default_factory=dict)  # model id -> the final checkpoint's adapter_step

    def lost_steps(self) -> int:
        return sum(abs(self.steps_saved.get(m, -1) - n) for m, n in self.steps_answered.items())

    def stats(self, kind: str, steady: bool) -> tuple[int, float, float]:
        """(count, p50 ms, p99 ms) of the answered calls of `kind`; `steady`: only those that ended before the kill
        or began after the restarted server answered."""
        lat = [
            (c.end - c.start) * 1e3
            for c in self.calls
            if c.kind == kind
            and c.ok
            and (
                not steady or self.killed_at is None or c.end < self.killed_at or c.start > (self.back_at or 0)
            )  # fmt: skip
        ]
        if not lat:
            return 0, float("nan"), float("nan")
        lat.sort()
        return len(lat), statistics.median(lat), lat[min(len(lat) - 1, int(0.99 * len(lat)))]


def _worker(url: str, k: int, t0: float, stop: threading.Event, report: Report, lock: threading.Lock) -> None:
    import numpy as np
    import tinker
    from tinker import types

    def timed(kind: str, fn):
        start = time.perf_counter() - t0
        try:
            out = fn()
            ok = True
            return out
        except Exception as e:  # noqa: BLE001 - a failed call is what this bench counts
            ok = False
            with lock:
                report.errors.append(f"client {k} {kind}: {type(e).__name__}: {e}"[:300])
            return None
        finally:
            with lock:
                report.calls.append(Call(kind, start, time.perf_counter() - t0, ok))

    sc = tinker.ServiceClient(base_url=url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=k).result()
    tokens = [5 + (k * 7 + i) % 300 for i in range(17)]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                        "weights": np.ones(16, dtype=np.float32)},
    )  # fmt: skip
    steps, rounds = 0, 0
    while not stop.is_set():
        timed("forward_backward", lambda: tc.forward_backward([datum], "cross_entropy").result())
        if timed("optim_step", lambda: tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()) is not None:
            steps += 1
        if rounds % 4 == 0:
            sampler = timed("save_weights_for_sampler", lambda: tc.save_weights_and_get_sampling_client().result())
            if sampler is not None:
                prompt = types.ModelInput.from_ints(tokens[:4])
                timed(
                    "sample", lambda s=sampler, pr=prompt: s.sample(pr, 1, types.SamplingParams(max_tokens=8)).result()
                )
        rounds += 1
    tc.save_state("final").result()
    with lock:
        report.steps_answered[tc.model_id] = steps


def run(model: str, clients: int, duration: float, kill_at: float | None, state_dir: Path) -> Report:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    start = lambda: start_server(model, state_dir, port, clients, clients, 1.0)  # noqa: E731
    proc = start()
    report = Report(clients, duration)
    stop, lock = threading.Event(), threading.Lock()
    try:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=_worker, args=(url, k, t0, stop, report, lock)) for k in range(clients)]
        for t in threads:
            t.start()
        if kill_at is not None:
            time.sleep(max(0.0, kill_at - (time.perf_counter() - t0)))
            while sum(c.ok for c in report.calls) < clients and time.perf_counter() - t0 < duration:
                time.sleep(0.1)  # in the middle of the load: every client could have been answered once
            report.killed_at = time.perf_counter() - t0
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc = start()
            report.back_at = time.perf_counter() - t0
            print(f"killed at {report.killed_at:.1f} s, answering again at {report.back_at:.1f} s", flush=True)
        time.sleep(max(0.0, duration - (time.perf_counter() - t0)))
        stop.set()
        for t in threads:
            t.join(600)
        report.duration_s = time.perf_counter() - t0
    finally:
        proc.kill()
        proc.wait()
    for model_id in report.steps_answered:
        folder = state_dir / "adapters" / model_id.replace(":", ".")
        for meta in folder.glob("step_*/checkpoint.json"):
            info = json.loads(meta.read_text())
            if info.get("label") == "final":
                report.steps_saved[model_id] = int(info["adapter_step"])
    return report


def print_report(r: Report) -> None:
    window = (
        f"; SIGKILL at {r.killed_at:.1f} s, answering again at {r.back_at:.1f} s (down {r.back_at - r.killed_at:.1f} s)"
        if r.killed_at is not None
        else ""
    )
    print(f"\n{r.clients} SDK clients at once for {r.duration_s:.0f} s{window}")
    print(f"{'call':<26}{'answered':>9}{'p50 ms':>9}{'p99 ms':>9}{'steady p50':>12}{'steady p99':>12}")
    for kind in CALLS:
        n, p50, p99 = r.stats(kind, steady=False)
        _, s50, s99 = r.stats(kind, steady=True)
        print(f"{kind:<26}{n:>9}{p50:>9.0f}{p99:>9.0f}{s50:>12.0f}{s99:>12.0f}")
    ok = sum(c.ok for c in r.calls)
    fb = sum(c.ok for c in r.calls if c.kind == "forward_backward")
    print(f"throughput: {ok / r.duration_s:.1f} calls/s, {fb / r.duration_s:.1f} forward_backward datums/s")
    print(f"failed calls: {len(r.errors)}; optim_steps answered {sum(r.steps_answered.values())}, in the final "
          f"checkpoints {sum(r.steps_saved.values())}: lost or doubled {r.lost_steps()}")  # fmt: skip
    for e in r.errors[:5]:
        print("  ", e)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(ROOT / "artifacts/tiny/model"))
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--kill-at", type=float, default=None, help="SIGKILL + restart at this second (default: half way)")
    p.add_argument("--no-kill", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    kill_at = None if args.no_kill else (args.kill_at if args.kill_at is not None else args.duration / 2)
    with tempfile.TemporaryDirectory() as tmp:
        r = run(args.model, args.clients, args.duration, kill_at, Path(tmp))
    print_report(r)
    if args.json:
        summary = {
            kind: dict(zip(("answered", "p50_ms", "p99_ms"), r.stats(kind, False), strict=True)) for kind in CALLS
        }
        steady = {
            kind: dict(zip(("answered", "p50_ms", "p99_ms"), r.stats(kind, True), strict=True)) for kind in CALLS
        }
        extra = {
            "all": summary,
            "steady": steady,
            "lost_steps": r.lost_steps(),
            "answered": sum(c.ok for c in r.calls),
            "answered_before_kill": sum(c.ok and c.end < (r.killed_at or 0) for c in r.calls),
            "begun_after_restart": sum(c.ok and c.start > (r.back_at or 1e9) for c in r.calls),
        }
        args.json.write_text(json.dumps({**{k: v for k, v in asdict(r).items() if k != "calls"}, **extra}, indent=1))
    return 0 if not r.errors and r.lost_steps() == 0 and len(r.steps_saved) == r.clients else 1


if __name__ == "__main__":
    raise SystemExit(main())
