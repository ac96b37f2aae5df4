"""Guards for benchmark scripts no other test runs: that a `--before` revision's layer code still runs against this
checkout's routing (bench/bench_lora_paths.py swaps it in; if that broke, its "before" rows would measure nothing),
that variants take turns going first, and that bench_memory's CPU seconds leave its own sampler out."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import bench_lora_paths, bench_rollout  # noqa: E402
from rl_multilora.lora import MultiLoRAModel  # noqa: E402
from tests.tiny_models import tiny_model  # noqa: E402


def _train_pass(m: MultiLoRAModel, ids: torch.Tensor, names: list[str], layer) -> tuple[torch.Tensor, list]:
    m.zero_grad(set_to_none=True)
    with bench_lora_paths.layer_code(layer):
        logits = m(ids, adapter_names=names).logits
        logits.float().logsumexp(-1).mean().backward()
    stacked = [p for n, p in m.named_parameters() if "lora_" in n]  # every slot's A and B, per Linear
    return logits.detach(), [p.grad.clone() for p in stacked if p.grad is not None]


def test_a_revisions_layer_code_runs_against_this_routing_and_computes_the_same():
    before = bench_lora_paths.load_revision_layer("HEAD")
    m = MultiLoRAModel.from_model(tiny_model(hidden=32, layers=2), 4, 8)
    for i, name in enumerate(("a", "b")):
        m.add_adapter(name, rank=8, alpha=16, seed=i)
        with torch.no_grad():
            for p in m.adapter_parameters(name)[1::2]:
                p.normal_(0, 0.1)  # non-zero B: the LoRA does work
    m.train()
    ids = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    for names in (["a"] * 4, ["a", "b", "a", "b"]):
        now, now_grads = _train_pass(m, ids, names, None)
        then, then_grads = _train_pass(m, ids, names, before.LoRALinear)
        torch.testing.assert_close(then, now)
        assert len(then_grads) == len(now_grads) > 0
        for g, h in zip(then_grads, now_grads, strict=True):
            torch.testing.assert_close(g, h)
    bank = m.new_bank()  # a revision with `bag_layout` reads the bank as stored; an older one gets its own layout
    assert bench_lora_paths._bank_of(before, bank) is bank
    older = type(sys)("older")
    assert bench_lora_paths._bank_of(older, bank) is not bank


def test_rollout_rounds_let_every_variant_go_first_in_turn():
    calls: list[str] = []
    fns = {k: (lambda k=k: calls.append(k)) for k in ("one", "mixed8", "mixed64")}
    times = bench_rollout.interleaved_seconds(fns, 3, time.perf_counter)
    assert {k: len(v) for k, v in times.items()} == {"one": 3, "mixed8": 3, "mixed64": 3}
    rounds = [calls[3 + 3 * r : 6 + 3 * r] for r in range(3)]  # after the warm-up round
    assert [r[0] for r in rounds] == ["one", "mixed8", "mixed64"]


def test_the_memory_bench_counts_the_cpu_of_the_work_not_of_its_own_sampler():
    from bench.bench_memory import Sampler

    sampler = Sampler(period=0.0005)  # a fast sampler: at 10 ms it took about 0.14 CPU s per wall s
    sampler.start()
    try:
        time.sleep(0.2)
        start = sampler.cpu()
        time.sleep(1.0)  # no work at all here
        idle = sampler.cpu() - start
    finally:
        sampler.stop()
    assert idle < 0.05, idle
