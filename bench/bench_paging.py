"""More tenants than slots: training step time with paging vs the same tenants always resident, host bytes per idle
tenant, page-in time per adapter; and the backward's gradient cost with many slots (item 4 of issue 36).

    python bench/bench_paging.py [--model artifacts/tiny/model] [--tenants 4096] [--slots 64] [--rank 4]
                                 [--rows-per-tenant 2] [--seq 64] [--steps 7] [--host-budget-gb G]

Two backends over the same base, stepped in turns so machine load hits both alike:
- `paged`: `--tenants` client tenants registered on `--slots` resident slots (model.max_tenants = tenants); each
  step trains the next `--slots` tenants in registration order (what the run's turns do with equal weights), so
  every step pages `--slots` tenants in and as many out;
- `resident`: `--slots` tenants on `--slots` slots, all trained every step.
A step is one mixed `forward_backward` over the same number of rows (`--rows-per-tenant` each, `--seq` tokens, the
second half of them loss tokens) and one `optim_step` per tenant: the backend calls a GRPO step makes. Reported are
medians over steps (the first is a warm-up and dropped), the ratio paged / resident, page-ins and their time per
adapter, and the host bytes a paged tenant takes against its true-rank adapter + two AdamW moments.

`--grads` instead times one forward+backward with 4 tenants' rows on 64 and 256 slots with gradients kept only for
the slots with rows (the default) and with the dense all-slots `.grad` (what the model did before): CPU time of this
process, medians of 10.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages when run as a script

import torch  # noqa: E402

from rl_multilora.backends.local import LocalBackend  # noqa: E402
from rl_multilora.config import GRPOSettings  # noqa: E402
from rl_multilora.lora import MultiLoRAModel  # noqa: E402
from rl_multilora.losses import client_algo  # noqa: E402
from rl_multilora.rows import Row  # noqa: E402
from rl_multilora.tenant_optim import AdamSettings  # noqa: E402
from rl_multilora.tenant_store import TenantStore  # noqa: E402
from rl_multilora.trainer import MultiLoRATrainer  # noqa: E402


def backend(path: str, slots: int, tenants: int, rank: int, budget: int | None, spill: str) -> LocalBackend:
    model = MultiLoRAModel.from_pretrained(path, max_loras=slots, max_rank=rank)
    store = TenantStore(budget, spill) if tenants > slots else None
    trainer = MultiLoRATrainer(model, GRPOSettings(), pad_token_id=0, store=store)
    b = LocalBackend(model, trainer, max_tenants=tenants)
    for i in range(tenants):
        b.add_client(f"t{i:05d}", rank, 2.0 * rank, seed=i, target_modules=model.lora_modules)
    return b


def rows_for(names: list[str], per: int, seq: int, vocab: int, seed: int) -> list[Row]:
    rng = random.Random(seed)
    return [
        Row(n, [rng.randrange(3, vocab) for _ in range(seq)], list(range(seq // 2, seq)), rng.uniform(-1, 1), None)
        for n in names
        for _ in range(per)
    ]


def step(b: LocalBackend, names: list[str], rows: list[Row]) -> float:
    t0 = time.perf_counter()
    b.forward_backward(rows, {n: client_algo("importance_sampling", None) for n in names})
    for n in names:
        b.optim_step(n, AdamSettings(learning_rate=1e-3))
    return time.perf_counter() - t0


def paging(args) -> None:
    torch.manual_seed(0)
    budget = None if args.host_budget_gb is None else int(args.host_budget_gb * 2**30)
    with tempfile.TemporaryDirectory() as spill:
        t0 = time.perf_counter()
        paged = backend(args.model, args.slots, args.tenants, args.rank, budget, spill)
        reg = time.perf_counter() - t0
        resident = backend(args.model, args.slots, args.slots, args.rank, None, spill)
        vocab = paged.model.config.vocab_size
        all_names = sorted(paged.adapters)
        times: dict[str, list[float]] = {"paged": [], "resident": []}
        stats0 = paged.paging_stats()
        for k in range(args.steps):
            chosen = [all_names[(k * args.slots + j) % len(all_names)] for j in range(args.slots)]
            rows = rows_for(chosen, args.rows_per_tenant, args.seq, vocab, seed=k)
            times["paged"].append(step(paged, chosen, rows))
            names = sorted(resident.adapters)
            rows = rows_for(names, args.rows_per_tenant, args.seq, vocab, seed=k)
            times["resident"].append(step(resident, names, rows))
        st = paged.paging_stats()
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        print(
            f"{args.model}: {args.tenants} tenants on {args.slots} slots vs {args.slots} on {args.slots}, rank "
            f"{args.rank}, {args.slots * args.rows_per_tenant} rows x {args.seq} tokens per step, {args.steps - 1} "
            f"timed steps (registration of {args.tenants}: {reg:.1f} s)"
        )
        print(
            f"step time median: paged {med['paged'] * 1000:.1f} ms, resident {med['resident'] * 1000:.1f} ms, "
            f"ratio {med['paged'] / med['resident']:.3f}  (all: paged "
            + " ".join(f"{t * 1000:.0f}" for t in times["paged"])
            + " | resident "
            + " ".join(f"{t * 1000:.0f}" for t in times["resident"])
            + ")"
        )
        n_in = st.page_ins - stats0.page_ins
        n_out = st.page_outs - stats0.page_outs
        print(
            f"page-ins {n_in} ({(st.page_in_s - stats0.page_in_s) / max(n_in, 1) * 1000:.3f} ms per adapter, its "
            f"eviction included), page-outs {n_out} "
            f"({(st.page_out_s - stats0.page_out_s) / max(n_out, 1) * 1000:.3f} ms each); "
            f"resident {st.resident}, paged {st.paged}, spilled {st.spilled}"
        )
        store = paged.trainer.ops.store
        trained = [p for n in store.names if (p := store._tenants[n]).moments and p.moments[0]]
        idle = [p for n in store.names if (p := store._tenants[n]).weights is not None]
        adapter = sum(w.numel() * w.element_size() for w in idle[0].weights) if idle else 0
        if trained:
            per = statistics.median(p.nbytes for p in trained if p.weights is not None)
            print(
                f"host bytes per paged tenant that has trained: {per:,.0f} B = {per / adapter:.3f} x its true-rank "
                f"adapter ({adapter:,} B; adapter + 2 AdamW moments = 3.000 x); never trained: "
                f"{adapter:,} B (no moments yet); {len(trained)} trained of {len(store)} paged; host total "
                f"{store.host_bytes / 2**20:.1f} MiB, disk {store.disk_bytes / 2**20:.1f} MiB"
            )


def grads(args) -> None:
    from rl_multilora.config import OptimSettings
    from rl_multilora.lora.routing import SlotGradSink
    from rl_multilora.train_ops import TrainOps

    torch.set_num_threads(1)
    for slots in (64, 256):
        torch.manual_seed(0)
        m = MultiLoRAModel.from_pretrained(args.model, max_loras=slots, max_rank=16)
        ops = TrainOps(m, GRPOSettings(), pad_token_id=0)
        names = [f"t{i}" for i in range(4)]
        for i, n in enumerate(names):
            m.add_adapter(n, rank=16, alpha=32, seed=i)
            ops.add_tenant(n, OptimSettings(), lr=1e-3)
        rows = rows_for(names, 4, args.seq, m.config.vocab_size, seed=0)
        res: dict[str, list[float]] = {"dense": [], "slots with rows": []}
        for _ in range(12):
            for mode in res:
                m._grad_sink = SlotGradSink() if mode != "dense" else None
                t0 = time.process_time()
                ops.forward_backward(rows)
                res[mode].append(time.process_time() - t0)
                for n in names:
                    ops.tenant(n).grads = None
        lora = sum(p.numel() * p.element_size() for k, p in m.named_parameters() if "lora_" in k)
        print(
            f"{slots} slots, 4 with rows ({len(rows)} rows x {args.seq}): "
            + ", ".join(f"{k} {statistics.median(v[2:]) * 1000:.1f} ms" for k, v in res.items())
            + f"; dense zero-fills {lora / 2**20:.1f} MiB per backward, the sink {4 * lora / slots / 2**20:.2f} MiB"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="artifacts/tiny/model")
    p.add_argument("--tenants", type=int, default=4096)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--rows-per-tenant", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--host-budget-gb", type=float, default=None)
    p.add_argument("--grads", action="store_true", help="time the backward's gradients instead (see above)")
    args = p.parse_args()
    grads(args) if args.grads else paging(args)


if __name__ == "__main__":
    main()
