"""Many Tinker clients, one after another, on one server with few slots: none refused, memory within the budget.

    python bench/bench_tinker_clients.py                       # 1,000 clients, 8 slots, tiny preset, 64 MB budget
    python bench/bench_tinker_clients.py --clients 40 --every 8 --json out.json

Starts `python -m rl_multilora.tinker.server` as a subprocess (so its resident memory is the server's alone) with
`--max-loras 8 --max-tenants <clients> --host-budget-gb <budget>`, then drives it with the unmodified `tinker` SDK
from one `ServiceClient`: client after client is created (`create_lora_training_client`) and does one
`forward_backward`, one `optim_step`, `save_weights_and_get_sampling_client` and one `sample`, and stays registered
(paged out once 8 newer clients hold the slots). Every `--every` clients it reads the server's RSS and its memory by
component (`GET /api/v1/memory`, `rl_multilora.tinker.memory`). At the end the first client samples again from its
sampler version (by then spilled to disk) and gets the same greedy tokens it got at first.

Reports: refusals (must be 0), the RSS once the slots are full and at the end, RSS growth per client, the host
bytes per paged client (tenant store + sampler versions, host and disk) and how much of them the budget keeps in
memory, and checks the stated budget:

    RSS(N clients) <= RSS(slots full) + host budget + warm-up + N x BOOKKEEPING_BYTES

BOOKKEEPING_BYTES is what a client costs the server beyond its tensors (its futures' results, its Python records,
its journal rows in sqlite's cache); the warm-up, max(WARMUP_BYTES, WARMUP_CLIENTS x one paged client's bytes), the
one-time growth once paging starts: the allocator's arenas keep freed spill buffers, which are a paged client's size
(10-25 MiB measured on the tiny preset, 117 MiB with SmolLM2-135M's 47 MiB paged clients). Both are stated here and
checked by the run.

    python bench/bench_tinker_clients.py --model artifacts/smollm2-135m/model --clients 32 --every 8   # SmolLM2

`--host-allocator jemalloc` starts the server with jemalloc (its `--host-allocator`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
TOKEN = "tml-bench-clients"
BASE = "tiny"
BOOKKEEPING_BYTES = 64 * 1024  # stated per-client bytes beyond its tensors (the run measures and checks it)
WARMUP_BYTES = 32 * MIB  # stated one-time growth once clients are paged, at least
WARMUP_CLIENTS = 4  # ... or this many paged clients' bytes, when more (freed spill buffers the allocator keeps)


@dataclass
class Report:
    clients: int
    max_loras: int
    rank: int
    host_budget_bytes: int
    refused: int = 0
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    rows: list[dict] = field(default_factory=list)  # {"clients": n, "rss": bytes, "memory": {...}} every --every
    resampled_equal: bool = False

    @property
    def first(self) -> dict:
        """The row taken once every slot is held (the first at or past max_loras clients)."""
        return next(r for r in self.rows if r["clients"] >= self.max_loras)

    @property
    def last(self) -> dict:
        return self.rows[-1]

    def warmup_bytes(self) -> int:
        return max(WARMUP_BYTES, int(WARMUP_CLIENTS * self.per_paged_client()))

    def budget_bytes(self) -> int:
        return self.first["rss"] + self.host_budget_bytes + self.warmup_bytes() + self.clients * BOOKKEEPING_BYTES

    def per_paged_client(self) -> float:
        m = self.last["memory"]
        held = m["paged_host"] + m["paged_disk"] + m["samplers_host"] + m["samplers_disk"]
        return held / max(1, m["counts"]["models"] - self.max_loras)

    def growth_per_client(self) -> float:
        return (self.last["rss"] - self.first["rss"]) / max(1, self.last["clients"] - self.first["clients"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, path: str) -> dict:
    req = urllib.request.Request(url + path, headers={"X-API-Key": TOKEN})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def start_server(
    model: str,
    state_dir: Path,
    port: int,
    max_loras: int,
    max_tenants: int,
    budget_gb: float,
    max_rank: int = 16,
    extra: list[str] = (),
) -> subprocess.Popen:
    """The server as a subprocess, answering /healthz; its log in state_dir/server.log."""
    state_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "rl_multilora.tinker.server", "--model", model, "--state-dir", str(state_dir),
           "--base-model-name", BASE, "--port", str(port), "--max-loras", str(max_loras), "--max-rank", str(max_rank),
           "--max-tenants", str(max_tenants), "--host-budget-gb", str(budget_gb), "--session-timeout-s", "3600",
           *extra]  # fmt: skip
    log = open(state_dir / "server.log", "ab")
    env = {**os.environ, "RL_MULTILORA_TINKER_TOKEN": TOKEN, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {(state_dir / 'server.log').read_text()[-2000:]}")
        try:
            _get(url, "/api/v1/healthz")
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not answer /healthz within 120 s")


def run(
    model: str,
    clients: int,
    max_loras: int,
    rank: int,
    budget_gb: float,
    every: int,
    state_dir: Path,
    max_rank: int = 16,
    host_allocator: str = "glibc",
) -> Report:
    import numpy as np
    import tinker
    from tinker import types

    port = _free_port()
    proc = start_server(
        model, state_dir, port, max_loras, clients, budget_gb, max_rank, ["--host-allocator", host_allocator]
    )
    url = f"http://127.0.0.1:{port}"
    report = Report(clients, max_loras, rank, int(budget_gb * 2**30))
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    try:
        sc = tinker.ServiceClient(base_url=url, api_key=TOKEN)
        t0 = time.perf_counter()
        first = None
        for i in range(clients):
            tokens = [5 + i % 400, 6 + i % 7, 7, 8, 9, 10, 11, 12]
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": np.array(tokens[1:], dtype=np.int64),
                                "weights": np.ones(len(tokens) - 1, dtype=np.float32)},
            )  # fmt: skip
            try:
                tc = sc.create_lora_training_client(base_model=BASE, rank=rank, seed=i).result()
                tc.forward_backward([datum], "cross_entropy").result()
                tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
                sampler = tc.save_weights_and_get_sampling_client().result()
                prompt = types.ModelInput.from_ints(tokens[:3])
                out = sampler.sample(prompt, 1, greedy).result()
                if i == 0:
                    first = (sampler, prompt, out.sequences[0].tokens)
            except Exception as e:  # noqa: BLE001 - a refusal is what this bench counts
                report.refused += 1
                report.errors.append(f"client {i}: {type(e).__name__}: {e}"[:300])
            n = i + 1
            if n % every == 0 or n == clients or n == max_loras:
                memory = _get(url, "/api/v1/memory")
                report.rows.append({"clients": n, "rss": memory["rss"], "wall_s": time.perf_counter() - t0,
                                    "memory": memory})  # fmt: skip
                print(
                    f"{n:6d} clients  RSS {memory['rss'] / MIB:8.1f} MiB  {time.perf_counter() - t0:7.1f} s",
                    flush=True,
                )
        report.wall_s = time.perf_counter() - t0
        if first is not None:
            sampler, prompt, tokens = first
            report.resampled_equal = sampler.sample(prompt, 1, greedy).result().sequences[0].tokens == tokens
            report.rows.append({"clients": clients, "rss": _get(url, "/api/v1/memory")["rss"],
                                "wall_s": time.perf_counter() - t0, "memory": _get(url, "/api/v1/memory")})  # fmt: skip
    finally:
        proc.kill()
        proc.wait()
    return report


def print_report(r: Report) -> None:
    print(f"\n{r.clients} clients one after another, {r.max_loras} slots, rank {r.rank}, host budget "
          f"{r.host_budget_bytes / MIB:.0f} MiB: {r.refused} refused, {r.wall_s:.0f} s "
          f"({r.wall_s / r.clients * 1e3:.0f} ms per client); first client's spilled sampler resampled equal: "
          f"{r.resampled_equal}")  # fmt: skip
    for e in r.errors[:5]:
        print("  ", e)
    keys = ["base", "slots", "gradients", "optimizer", "paged_host", "samplers_host", "engine", "results", "other",
            "rss", "paged_disk", "samplers_disk"]  # fmt: skip
    print("\nserver memory by component (MiB)")
    print(f"{'clients':>8}  " + " ".join(f"{k:>13}" for k in keys))
    for row in r.rows:
        m = row["memory"]
        print(f"{row['clients']:>8}  " + " ".join(f"{m[k] / MIB:13.2f}" for k in keys))
    m = r.last["memory"]
    print(f"\nRSS with the slots full ({r.first['clients']} clients): {r.first['rss'] / MIB:.1f} MiB; at the end: "
          f"{r.last['rss'] / MIB:.1f} MiB; growth {r.growth_per_client() / 1024:.1f} KiB per client")  # fmt: skip
    print(
        f"host bytes per paged client (tenant store + sampler versions, host and disk): "
        f"{r.per_paged_client() / 1024:.1f} KiB; in memory now: paged {m['paged_host'] / MIB:.1f} MiB + samplers "
        f"{m['samplers_host'] / MIB:.1f} MiB = {(m['paged_host'] + m['samplers_host']) / MIB:.1f} MiB of "
        f"{r.host_budget_bytes / MIB:.0f} MiB budget; on disk {(m['paged_disk'] + m['samplers_disk']) / MIB:.1f} MiB"
    )
    budget = r.budget_bytes()
    verdict = "within" if r.last["rss"] <= budget else "OVER"
    print(f"stated budget: RSS(slots full) + host budget + {r.warmup_bytes() / MIB:.0f} MiB warm-up (max of "
          f"{WARMUP_BYTES // MIB} MiB and {WARMUP_CLIENTS} paged clients) + {r.clients} x "
          f"{BOOKKEEPING_BYTES // 1024} KiB = "
          f"{budget / MIB:.1f} MiB; RSS at the end {r.last['rss'] / MIB:.1f} MiB: {verdict}")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(ROOT / "artifacts/tiny/model"))
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--max-rank", type=int, default=16, help="the server's --max-rank (slot size)")
    p.add_argument("--host-budget-gb", type=float, default=1 / 16, help="default 64 MiB")
    p.add_argument("--every", type=int, default=100, help="read the server's memory every this many clients")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--host-allocator", choices=("glibc", "jemalloc"), default="glibc", help="the server's malloc")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        r = run(
            args.model,
            args.clients,
            args.max_loras,
            args.rank,
            args.host_budget_gb,
            args.every,
            Path(tmp),
            args.max_rank,
            args.host_allocator,
        )
    print_report(r)
    if args.json:
        args.json.write_text(json.dumps({**asdict(r), "budget_bytes": r.budget_bytes(),
                                         "per_paged_client": r.per_paged_client()}, indent=1))  # fmt: skip
    ok = r.refused == 0 and r.last["rss"] <= r.budget_bytes() and r.resampled_equal
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
