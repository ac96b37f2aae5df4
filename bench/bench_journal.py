"""How long a Tinker server's restart takes as a client's history grows: the journal is bounded by snapshots.

For each history length (--steps, default 10 and 1000 acknowledged optimizer steps of one client, one
forward_backward + one optim_step each, through the real `tinker` SDK over HTTP), the server is stopped and started
again on its state dir --restarts times; a restart is timed from building the server to the answer of the client's
next request (every acknowledged request before it restored or replayed). Reported per history: the median restart
and the requests left in the journal, with snapshots (--snapshot-every, default 50) and, for comparison, without
(a snapshot interval larger than the history: every request since the first start is replayed).

Run: python bench/bench_journal.py [--model artifacts/tiny/model] [--steps 10 1000] [--restarts 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import tinker
import torch
from tinker import types

from rl_multilora.tinker.server import BackgroundApp, build_server

TOKEN = "tml-bench"
TOKENS = list(range(5, 37))


def _datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(TOKENS[1:], np.int64),
            "weights": np.ones(len(TOKENS) - 1, np.float32),
        },
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_history(model: str, steps: int, snapshot_every: int, restarts: int) -> tuple[list[float], int]:
    """(restart seconds, journal rows) after `steps` optimizer steps of one client."""
    with tempfile.TemporaryDirectory() as tmp:
        state, port = Path(tmp), _free_port()
        app = BackgroundApp(build_server(model, state, TOKEN, snapshot_every=snapshot_every), "127.0.0.1", port)
        sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=TOKEN)
        tc = sc.create_lora_training_client(base_model=model, rank=8, seed=0).result()
        for _ in range(steps):  # each step waited for: a client that runs ahead only fills the queue
            tc.forward_backward([_datum()], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        tc.forward([_datum()], "cross_entropy").result()  # every acknowledged request has run
        rows = app.server.journal.size()
        app.close()
        times = []
        for _ in range(restarts):
            t0 = time.perf_counter()
            app = BackgroundApp(build_server(model, state, TOKEN, snapshot_every=snapshot_every), "127.0.0.1", port)
            tc.forward([_datum()], "cross_entropy").result()
            times.append(time.perf_counter() - t0)
            app.close()
        return times, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="artifacts/tiny/model")
    p.add_argument("--steps", type=int, nargs="+", default=[10, 1000])
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument("--snapshot-every", type=int, default=50)
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"model {args.model}, {torch.get_num_threads()} threads, medians of {args.restarts} restarts")
    print(f"{'steps':>6} {'snapshots':>10} {'journal rows':>13} {'restart s (median)':>19} {'min-max':>14}")
    medians: dict[tuple[int, bool], float] = {}
    for steps in args.steps:
        for snapshots in (True, False):
            every = args.snapshot_every if snapshots else max(args.steps) + 1
            times, rows = one_history(args.model, steps, every, args.restarts)
            med = statistics.median(times)
            medians[(steps, snapshots)] = med
            label = f"every {every}" if snapshots else "none"
            print(f"{steps:>6} {label:>10} {rows:>13} {med:>19.2f} {min(times):>6.2f}-{max(times):.2f}")
    lo, hi = min(args.steps), max(args.steps)
    print(f"restart after {hi} steps / after {lo}: {medians[(hi, True)] / medians[(lo, True)]:.2f}x with snapshots, "
          f"{medians[(hi, False)] / medians[(lo, False)]:.2f}x without")  # fmt: skip


if __name__ == "__main__":
    main()
