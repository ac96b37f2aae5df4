"""Tinker-API server costs on the tiny preset, measured on the model work the server runs (`ClientOps`).

1. forward_backward of N clients (one datum of L tokens each): one mixed batch (what the server does when their
   calls arrive together) vs N calls served one at a time. Reports datums/s of each and the ratio.
2. A sampler publish (`save_weights_for_sampler`: slot tensors copied in memory into the engine's bank) vs a disk
   round trip of the same adapter (safetensors write + read + engine load).

Each number is the median of --repeats runs after one warm-up. Run: python bench/bench_tinker.py [--clients 8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rl_multilora.tinker.ops import FwdBwdItem
from rl_multilora.tinker.server import build_server
from rl_multilora.tinker.wire import Datum


def _median(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="artifacts/tiny/model")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        server = build_server(args.model, Path(tmp), "tml-bench", max_loras=max(8, args.clients + 2), max_rank=16)
        ops = server.ops
        rng = np.random.default_rng(0)
        items = []
        for k in range(args.clients):
            ops.create(f"c{k}", 8, k, {})
            toks = rng.integers(3, 500, args.tokens + 1)
            inputs = {"target_tokens": toks[1:].astype(np.int64), "weights": np.ones(args.tokens, np.float32)}
            items.append(FwdBwdItem(f"c{k}", "cross_entropy", {}, [Datum(toks[:-1].astype(np.int64), inputs)], False))
        batched = _median(lambda: ops.forward_backward(items), args.repeats)
        alone = _median(lambda: [ops.forward_backward([it]) for it in items], args.repeats)
        n = args.clients
        print(f"forward_backward, {n} clients x 1 datum x {args.tokens} tokens ({torch.get_num_threads()} threads)")
        print(f"  one mixed batch : {batched * 1e3:8.1f} ms  {n / batched:8.1f} datums/s")
        print(f"  one at a time   : {alone * 1e3:8.1f} ms  {n / alone:8.1f} datums/s")
        print(f"  throughput ratio batched/alone: {alone / batched:.2f}x")

        def publish() -> None:
            ops.publish_sampler("c0", None)

        def disk() -> None:
            folder = Path(tmp) / "roundtrip"
            folder.mkdir(exist_ok=True)
            save_file({k: v.contiguous() for k, v in ops.backend.adapter_state_dict("c0").items()}, folder / "a.st")
            ops.engine.load_adapter("disk", load_file(folder / "a.st"), ops.backend.peft_config("c0"))
            ops.engine.unload_adapter("disk")

        rt = _median(disk, args.repeats)  # first: publishes fill engine slots (LRU) that "disk" would need
        pub = _median(publish, args.repeats)
        print(f"sampler publish in memory: {pub * 1e3:.2f} ms; disk round trip: {rt * 1e3:.2f} ms ({rt / pub:.1f}x)")


if __name__ == "__main__":
    main()
