"""More tenants than slots: training step time with paging vs the same tenants always resident, host bytes per idle
tenant, page-in time per adapter; and the backward's gradient cost with many slots (items 4 and 5 of issue 36).

    python bench/bench_paging.py [--shape tiny|smollm2] [--model PATH] [--tenants N] [--slots S] [--rank 4]
                                 [--rows-per-tenant R] [--seq T] [--steps K] [--runs 3] [--pool-groups 2]
                                 [--host-budget-gb G] [--prefetch] [--threads 1] [--one-registration]
                                 [--page-only | --grads]

`--shape tiny` (default): the tiny preset, 4,096 tenants on 64 slots, 2 rows of 64 tokens per tenant.
`--shape smollm2`: SmolLM2-135M (artifacts/smollm2-135m/model, or random weights of its config when that folder is
absent: the shape is what paging costs depend on), 1,024 tenants on 32 slots, 1 row of 32 tokens per tenant.

Each run builds two backends over the same base and steps them in turns, so machine load hits both alike:
- `paged`: `--tenants` client tenants registered on `--slots` resident slots (model.max_tenants = tenants); the step
  trains one group of `--slots` tenants of a pool of `--pool-groups` groups, the next group each step (what the
  run's turns do with equal weights), so every step pages `--slots` tenants in and as many out. The pool is trained
  once before the timed steps, so timed page-ins move tenants with their AdamW moments (what a long run pages); the
  other registered tenants stay idle in the store (spilled past `--host-budget-gb`);
- `resident`: `--slots` tenants on `--slots` slots, all trained every step.
A step is one mixed `forward_backward` over the same number of rows (`--rows-per-tenant` each, `--seq` tokens, the
second half of them loss tokens) and one `optim_step` per tenant: the calls a GRPO step makes. `--prefetch` stages
the next group's states (`LocalBackend.prefetch`, what an async run does) while the step runs.

Torch runs one thread (`--threads`): on a shared 2-core machine two threads spin-wait on each other and a tiny step
took 3-40 s instead of about 1 s. Each step is timed in wall time and in this process's CPU time (all its threads):
on a machine others load, wall time swings 3x between steps and the CPU time is the cost to compare. Per run:
medians over its `--steps` timed steps; then the median over `--runs` runs with the range (min-max).
Reported: step time paged / resident (and the median of each paged step over the resident step right after it),
page-ins and their time per adapter (the eviction that made room included), and the host bytes of a paged tenant
against its true-rank adapter + two AdamW moments.

`--page-only` instead times paging alone: after the warm-up, `--steps` x `--runs` calls that page the pool's next
group in (`TrainOps.ensure_resident`, the evictions included), CPU time per adapter (use `--tenants` of twice
`--slots` to skip registering idle tenants, which only the store's spill needs).

`--grads` instead times one forward+backward with 4 tenants' rows on 64 and 256 slots with gradients kept only for
the slots with rows (the default) and with the dense all-slots `.grad` (what the model did before): CPU time of this
process, medians of 10.
"""

from __future__ import annotations

import argparse
import gc
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

SHAPES = {  # --shape -> defaults
    "tiny": {"model": "artifacts/tiny/model", "tenants": 4096, "slots": 64, "rows_per_tenant": 2, "seq": 64},
    "smollm2": {
        "model": "artifacts/smollm2-135m/model",
        "tenants": 1024,
        "slots": 32,
        "rows_per_tenant": 1,
        "seq": 32,
    },
}
# SmolLM2-135M's config (HuggingFaceTB/SmolLM2-135M), for random weights when its folder is absent.
SMOLLM2 = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    head_dim=64, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)  # fmt: skip


def load_model(path: str, slots: int, rank: int) -> MultiLoRAModel:
    if Path(path, "config.json").exists():
        return MultiLoRAModel.from_pretrained(path, max_loras=slots, max_rank=rank)
    import transformers

    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2))
    return MultiLoRAModel.from_model(base, max_loras=slots, max_rank=rank)


def backend(args, slots: int, tenants: int, budget: int | None, spill: str) -> LocalBackend:
    model = load_model(args.model, slots, args.rank)
    store = TenantStore(budget, spill) if tenants > slots else None
    trainer = MultiLoRATrainer(model, GRPOSettings(), pad_token_id=0, store=store)
    b = LocalBackend(model, trainer, max_tenants=tenants)
    for i in range(tenants):
        b.add_client(f"t{i:05d}", args.rank, 2.0 * args.rank, seed=i, target_modules=model.lora_modules)
    return b


def rows_for(names: list[str], per: int, seq: int, vocab: int, seed: int) -> list[Row]:
    rng = random.Random(seed)
    return [
        Row(n, [rng.randrange(3, vocab) for _ in range(seq)], list(range(seq // 2, seq)), rng.uniform(-1, 1), None)
        for n in names
        for _ in range(per)
    ]


def step(b: LocalBackend, names: list[str], rows: list[Row], then: list[str] | None = None) -> tuple[float, float]:
    """One step's (wall, CPU) seconds; CPU is this process's, every thread (a prefetch's too)."""
    t0, c0 = time.perf_counter(), time.process_time()
    if then:
        b.prefetch(then)  # staged in the background while this step runs
    b.forward_backward(rows, {n: client_algo("importance_sampling", None) for n in names})
    for n in names:
        b.optim_step(n, AdamSettings(learning_rate=1e-3))
    return time.perf_counter() - t0, time.process_time() - c0


class Pair:
    """The paged and the resident backend of one registration, the pool trained once (the warm-up)."""

    def __init__(self, args, spill: str):
        budget = None if args.host_budget_gb is None else int(args.host_budget_gb * 2**30)
        t0 = time.perf_counter()
        self.paged = backend(args, args.slots, args.tenants, budget, spill)
        self.register_s = time.perf_counter() - t0
        self.resident = backend(args, args.slots, args.slots, None, spill)
        self.vocab = self.paged.model.config.vocab_size
        names = sorted(self.paged.adapters)
        self.groups = [names[g * args.slots : (g + 1) * args.slots] for g in range(args.pool_groups)]
        self.res_names = sorted(self.resident.adapters)
        self.k = 0
        self.steps(args, args.pool_groups)  # the pool's first pass makes its moments: what later page-ins move

    def steps(self, args, n: int) -> dict[str, list[tuple[float, float]]]:
        """`n` steps of each backend in turns; their (wall, CPU) seconds."""
        times: dict[str, list[tuple[float, float]]] = {"paged": [], "resident": []}
        for _ in range(n):
            k, self.k = self.k, self.k + 1
            chosen = self.groups[k % len(self.groups)]
            then = self.groups[(k + 1) % len(self.groups)] if args.prefetch else None
            paged_rows = rows_for(chosen, args.rows_per_tenant, args.seq, self.vocab, seed=k)
            resident_rows = rows_for(self.res_names, args.rows_per_tenant, args.seq, self.vocab, seed=k)
            # the two take turns going first (a fixed order made the later one measure 1-4 % slower elsewhere)
            for which in ("paged", "resident") if k % 2 == 0 else ("resident", "paged"):
                if which == "paged":
                    times["paged"].append(step(self.paged, chosen, paged_rows, then))
                else:
                    times["resident"].append(step(self.resident, self.res_names, resident_rows))
        return times


def one_run(args, run: int, pair: Pair) -> dict[str, float]:
    """`--steps` timed steps of `pair`; this run's medians."""
    stats0 = pair.paged.paging_stats()
    times = pair.steps(args, args.steps)
    st = pair.paged.paging_stats()
    med = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    n_in, n_out = st.page_ins - stats0.page_ins, st.page_outs - stats0.page_outs
    store = pair.paged.trainer.ops.store
    held = [store._tenants[n] for n in store.names if store._tenants[n].weights is not None]
    trained = [p for p in held if p.moments and p.moments[0]]
    adapter = held[0].weights.numel() * held[0].weights.element_size()
    per = statistics.median(p.nbytes for p in trained)
    out = {
        "paged_ms": med["paged"] * 1000,
        "resident_ms": med["resident"] * 1000,
        "ratio": med["paged"] / med["resident"],
        "paged_cpu_ms": cpu["paged"] * 1000,
        "resident_cpu_ms": cpu["resident"] * 1000,
        "cpu_ratio": cpu["paged"] / cpu["resident"],
        # each paged step over the resident step right after it (the same load, mostly): robust to slow drifts
        "pair_ratio": statistics.median(p[1] / r[1] for p, r in zip(times["paged"], times["resident"], strict=True)),
        "page_ins_per_step": n_in / args.steps,
        "page_in_ms": (st.page_in_s - stats0.page_in_s) / max(n_in, 1) * 1000,
        "page_out_ms": (st.page_out_s - stats0.page_out_s) / max(n_out, 1) * 1000,
        "paging_cpu_ms": (cpu["paged"] - cpu["resident"]) * 1000 / max(n_in / args.steps, 1),
        "tenant_bytes": per,
        "adapter_bytes": adapter,
        "per_adapter_x": per / adapter,
        "register_s": pair.register_s,
    }
    print(
        f"run {run + 1}: step CPU paged {out['paged_cpu_ms']:.0f} ms / resident {out['resident_cpu_ms']:.0f} ms = "
        f"{out['cpu_ratio']:.3f}x (step by step {out['pair_ratio']:.3f}x); wall {out['paged_ms']:.0f} / {out['resident_ms']:.0f} ms = {out['ratio']:.3f}x "
        "(steps wall/CPU: paged " + " ".join(f"{w * 1000:.0f}/{c * 1000:.0f}" for w, c in times["paged"])
        + " | resident " + " ".join(f"{w * 1000:.0f}/{c * 1000:.0f}" for w, c in times["resident"])
        + f"); page-ins {n_in} ({out['page_in_ms']:.2f} ms wall each, eviction included), page-outs {n_out} "
        f"({out['page_out_ms']:.2f} ms each); resident {st.resident}, paged {st.paged}, spilled {st.spilled}, "
        f"host {store.host_bytes / 2**20:.0f} MiB, disk {store.disk_bytes / 2**20:.0f} MiB; registering "
        f"{args.tenants}: {pair.register_s:.1f} s",
        flush=True,
    )  # fmt: skip
    return out


def all_runs(args) -> list[dict[str, float]]:
    """`--runs` runs, each with its own registration, or all on one (`--one-registration`)."""
    out = []
    with tempfile.TemporaryDirectory() as spill:
        pair = None
        for r in range(args.runs):
            if pair is None or not args.one_registration:
                torch.manual_seed(r)
                pair = None
                gc.collect()
                pair = Pair(args, str(Path(spill) / f"run{r}"))
            out.append(one_run(args, r, pair))
    return out


def paging(args) -> None:
    print(
        f"{args.model}: {args.tenants} tenants on {args.slots} slots (pool of {args.pool_groups * args.slots} "
        f"trained in turns) vs {args.slots} on {args.slots}, rank {args.rank}, {args.slots * args.rows_per_tenant} "
        f"rows x {args.seq} tokens per step, {args.steps} timed steps per run, {args.runs} runs"
        + (", next group prefetched" if args.prefetch else ""),
        flush=True,
    )
    runs = all_runs(args)

    def med(key: str, fmt: str = ".3f") -> str:
        vals = [r[key] for r in runs]
        return f"{statistics.median(vals):{fmt}} ({min(vals):{fmt}}-{max(vals):{fmt}})"

    print(f"median of {args.runs} runs (min-max):")
    print(f"  step CPU time paged / resident: {med('cpu_ratio')}x; paged {med('paged_cpu_ms', '.0f')} ms, resident "
          f"{med('resident_cpu_ms', '.0f')} ms; paired step by step {med('pair_ratio')}x")  # fmt: skip
    print(f"  step wall time paged / resident: {med('ratio')}x; paged {med('paged_ms', '.0f')} ms, resident "
          f"{med('resident_ms', '.0f')} ms")  # fmt: skip
    print(f"  page-ins per step {med('page_ins_per_step', '.0f')}; page-in {med('page_in_ms', '.2f')} ms wall per "
          f"adapter (eviction included); page-out {med('page_out_ms', '.2f')} ms; paging's CPU per adapter (step CPU "
          f"paged - resident, per page-in) {med('paging_cpu_ms', '.2f')} ms")  # fmt: skip
    print(
        f"  host bytes per paged trained tenant {med('tenant_bytes', ',.0f')} B = {med('per_adapter_x')}x its "
        f"true-rank adapter ({runs[0]['adapter_bytes']:,.0f} B; adapter + 2 AdamW moments = 3.000x)"
    )
    print(f"  registering {args.tenants} tenants: {med('register_s', '.1f')} s")


def page_only(args) -> None:
    """Paging alone: the CPU time of `ensure_resident` of the pool's next group (its page-ins and the evictions that
    make room), per adapter, after the pool's warm-up; medians over `--steps` x `--runs` calls."""
    with tempfile.TemporaryDirectory() as spill:
        pair = Pair(args, spill)
        ops = pair.paged.trainer.ops
        per = []
        for k in range(args.steps * args.runs):
            group = pair.groups[k % len(pair.groups)]
            c0 = time.process_time()
            ops.ensure_resident(group)
            per.append((time.process_time() - c0) / len(group) * 1000)
    print(
        f"{args.model}: paging CPU per adapter (a page-in and the eviction that made room, {args.slots} per call, "
        f"{len(per)} calls): median {statistics.median(per):.2f} ms ({min(per):.2f}-{max(per):.2f})"
    )


def grads(args) -> None:
    from rl_multilora.config import OptimSettings
    from rl_multilora.lora.routing import SlotGradSink
    from rl_multilora.train_ops import TrainOps

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
        for i in range(12):
            for mode in list(res)[:: 1 if i % 2 == 0 else -1]:  # each mode goes first every other round
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
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="defaults of the options below")
    p.add_argument("--model", default=None)
    p.add_argument("--tenants", type=int, default=None)
    p.add_argument("--slots", type=int, default=None)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--rows-per-tenant", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--steps", type=int, default=5, help="timed steps per run")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--pool-groups", type=int, default=2, help="groups of --slots tenants trained in turns")
    p.add_argument("--host-budget-gb", type=float, default=None)
    p.add_argument("--one-registration", action="store_true", help="all runs on one registration and warm-up")
    p.add_argument("--prefetch", action="store_true", help="stage the next group while a step runs")
    p.add_argument("--threads", type=int, default=1, help="torch threads (more spin-wait on a shared machine)")
    p.add_argument("--grads", action="store_true", help="time the backward's gradients instead (see above)")
    p.add_argument("--page-only", action="store_true", help="time paging alone instead (see above)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for key, value in SHAPES[args.shape].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    grads(args) if args.grads else page_only(args) if args.page_only else paging(args)


if __name__ == "__main__":
    main()
