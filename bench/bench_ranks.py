"""Train step time and memory with 1 and 2 trainer ranks (FSDP2 over gloo on CPU), and the communication share.

    python bench/bench_ranks.py [--only tiny|h1024] [--steps 4]

For each config the same GRPO `train_step` (3 tenants of ranks 4/8/16, `rows` rows of `seq` tokens, 1 PPO epoch,
micro-batches of 16) runs in one unsharded process (1 rank) and on 2 ranks (`torch.multiprocessing`, gloo, the
model sharded per decoder layer and at the root, each rank training half of the rows). Reported per world size:
median step time over `--steps` steps after one warm-up, the bytes of parameters each rank holds (the base's share
should halve) and its peak RSS, and on 2 ranks the share of the step spent in FSDP2's collectives (the
`FSDP::all_gather*` and `FSDP::post_backward_reduce` regions, torch profiler, one profiled step).

Every process runs one intra-op thread, so 1 rank uses one core of this 2-core machine and 2 ranks use both: the
step-time ratio says what splitting the rows over two workers gains net of the collectives, not what two GPUs would.
gloo moves the shards through memory on one host; what transfers to a GPU cluster is the communication share and the
memory split (with NVLink or InfiniBand the collectives are much cheaper than here, and FSDP2 overlaps them with
compute).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages when run as a script

from rl_multilora.config import GRPOSettings, OptimSettings  # noqa: E402
from rollout.types import AdapterRef, Sample, SampleStatus  # noqa: E402

CONFIGS = {
    "tiny": {"model": "artifacts/tiny/model", "rows": 64, "seq": 48},
    "h1024": {"hidden": 1024, "layers": 2, "vocab": 4096, "rows": 32, "seq": 48},
}
TENANTS = {"a": 4, "b": 8, "c": 16}


def _samples(rows: int, seq: int, vocab: int) -> list[Sample]:
    rng = random.Random(0)
    out = []
    per = rows // len(TENANTS)
    for i, name in enumerate(TENANTS):
        for g in range(per // 4):
            prompt = [rng.randrange(10, vocab) for _ in range(seq // 2)]
            for k in range(4):
                response = [rng.randrange(10, vocab) for _ in range(seq // 2)]
                out.append(Sample(prompt="", prompt_ids=prompt, response_ids=response, reward=float(k % 2),
                                  group_index=g, adapter=AdapterRef(name, i), status=SampleStatus.COMPLETED))  # fmt: skip
    return out


def _trainer(model):
    from rl_multilora.trainer import MultiLoRATrainer

    trainer = MultiLoRATrainer(model, GRPOSettings(micro_batch_size=16, ppo_epochs=1), pad_token_id=0)
    for i, (name, r) in enumerate(TENANTS.items()):
        model.add_adapter(name, rank=r, alpha=2 * r, seed=i)
        trainer.add_adapter(name, OptimSettings(), lr=1e-4)
    return trainer


def _local_bytes(model) -> int:
    total = 0
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total


def _time_steps(trainer, samples, steps: int) -> list[float]:
    trainer.train_step(samples)  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step(samples)
        times.append(time.perf_counter() - t0)
    return times


def _comm_share(trainer, samples) -> float:
    from torch.profiler import profile

    with profile() as prof:
        t0 = time.perf_counter()
        trainer.train_step(samples)
        wall = time.perf_counter() - t0
    comm = sum(
        e.cpu_time_total for e in prof.key_averages() if e.key.startswith(("FSDP::all_gather", "FSDP::post_backward"))
    )
    return comm / 1e6 / wall


def _rank_worker(rank: int, folder: str, port: int, steps: int, rows: int, seq: int, vocab: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rl_multilora.backends.fsdp import load_sharded

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = load_sharded(folder, init_device_mesh("cpu", (2,)), max_loras=4, max_rank=16)
    trainer = _trainer(model)
    samples = _samples(rows, seq, vocab)
    times = _time_steps(trainer, samples, steps)
    share = _comm_share(trainer, samples)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(out, f"rank{rank}.json").write_text(json.dumps({"times": times, "comm": share, "bytes": _local_bytes(model),
                                                          "rss_mib": rss}))  # fmt: skip
    dist.destroy_process_group()


def _one_rank(folder: str, steps: int, rows: int, seq: int, vocab: int) -> dict:
    from rl_multilora.lora import MultiLoRAModel

    torch.set_num_threads(1)
    model = MultiLoRAModel.from_pretrained(folder, max_loras=4, max_rank=16)
    trainer = _trainer(model)
    samples = _samples(rows, seq, vocab)
    times = _time_steps(trainer, samples, steps)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"times": times, "bytes": _local_bytes(model), "rss_mib": rss}


def _one_rank_proc(folder, steps, rows, seq, vocab, out) -> None:  # its own process, for a clean peak RSS
    Path(out, "one.json").write_text(json.dumps(_one_rank(folder, steps, rows, seq, vocab)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CONFIGS))
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    for name, c in CONFIGS.items():
        if args.only and name != args.only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            folder = c.get("model")
            if folder is None:
                from tests.tiny_models import save_tiny_model

                folder = str(save_tiny_model(Path(tmp) / "model", hidden=c["hidden"], layers=c["layers"],
                                             vocab=c["vocab"]))  # fmt: skip
            elif not (Path(folder) / "config.json").is_file():
                sys.exit(f"error: {folder} has no config.json; run examples/multi_lora/provision.sh first")
            vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
            ctx = mp.get_context("spawn")
            p = ctx.Process(target=_one_rank_proc, args=(folder, args.steps, c["rows"], c["seq"], vocab, tmp))
            p.start()
            p.join()
            one = json.loads(Path(tmp, "one.json").read_text())
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(_rank_worker, args=(folder, port, args.steps, c["rows"], c["seq"], vocab, tmp), nprocs=2)
            ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
        step_two = statistics.median(max(a, b) for a, b in zip(ranks[0]["times"], ranks[1]["times"], strict=True))
        step_one = statistics.median(one["times"])
        print(f"{name}: {c['rows']} rows x {c['seq']} tokens, 3 tenants (ranks 4/8/16), {args.steps} steps after a "
              f"warm-up, 1 thread per rank, torch {torch.__version__}")  # fmt: skip
        print(f"  1 rank : step {step_one:.3f} s (min {min(one['times']):.3f}, max {max(one['times']):.3f}); "
              f"params held {one['bytes'] / 2**20:.1f} MiB; peak RSS {one['rss_mib']:.0f} MiB")  # fmt: skip
        for r, rep in enumerate(ranks):
            print(f"  2 ranks, rank {r}: step median {statistics.median(rep['times']):.3f} s; params held "
                  f"{rep['bytes'] / 2**20:.1f} MiB; peak RSS {rep['rss_mib']:.0f} MiB; FSDP collectives "
                  f"{100 * rep['comm']:.0f} % of a profiled step")  # fmt: skip
        print(f"  2 ranks / 1 rank step time: {step_two / step_one:.2f}")


if __name__ == "__main__":
    main()
