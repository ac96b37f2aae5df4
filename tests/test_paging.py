"""More tenants than slots: gradients only for the slots that hold rows, the host tenant store and its paging.

The exactness tests compare tensors bit for bit (`torch.equal`): paging moves bytes, it never recomputes them.
"""

from __future__ import annotations

import random

import torch

from rl_multilora.config import GRPOSettings, OptimSettings
from rl_multilora.lora import MultiLoRAModel
from rl_multilora.lora.routing import SlotGradSink
from rl_multilora.rows import Row
from rl_multilora.train_ops import TrainOps
from tests.tiny_models import PAD_ID, tiny_model

VOCAB = 128


def _rows(names: list[str], n: int, seed: int) -> list[Row]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 9))]
        out.append(Row(names[i % len(names)], ids, list(range(2, len(ids))), rng.uniform(-1, 1), None))
    return out


def _ops(max_loras: int, names: list[str], ranks: dict[str, int] | None = None) -> tuple[MultiLoRAModel, TrainOps]:
    model = MultiLoRAModel.from_model(tiny_model(seed=0, vocab=VOCAB), max_loras=max_loras, max_rank=16)
    ops = TrainOps(model, GRPOSettings(), pad_token_id=PAD_ID)
    for i, n in enumerate(names):
        r = (ranks or {}).get(n, 8)
        model.add_adapter(n, rank=r, alpha=2 * r, seed=i)
        ops.add_tenant(n, OptimSettings(), lr=1e-2)
    return model, ops


def test_backward_keeps_gradients_of_the_slots_with_rows_only_and_they_equal_the_dense_ones():
    names = [f"t{i}" for i in range(8)]
    ranks = {n: (4, 8, 16)[i % 3] for i, n in enumerate(names)}
    with_rows = ["t1", "t4", "t6"]  # 3 of 8 occupied slots, mixed ranks
    model, ops = _ops(8, names, ranks)
    assert isinstance(model._grad_sink, SlotGradSink)
    seen: list[tuple[int, ...]] = []
    add = model._grad_sink.add

    def spy(stacked, used, compact):
        seen.append((stacked.shape[0], compact.shape[0], *used.tolist()))
        add(stacked, used, compact)

    model._grad_sink.add = spy
    rows = _rows(with_rows, 9, seed=1)
    ops.forward_backward(rows)
    # every stacked LoRA tensor got a gradient for the 3 slots with rows, none for the other 5, nothing in `.grad`
    assert seen and all(s == 8 and u == 3 and tuple(ids) == (1, 4, 6) for s, u, *ids in seen)
    assert all(p.grad is None for k, p in model.named_parameters() if "lora_" in k)
    sparse = {n: [g.clone() for g in ops.tenant(n).grads] for n in with_rows}
    assert all(ops.tenant(n).grads is None for n in names if n not in with_rows)

    dense_model, dense_ops = _ops(8, names, ranks)
    dense_model._grad_sink = None  # the all-slots `.grad` path, as a sharded model keeps it
    dense_ops.forward_backward(_rows(with_rows, 9, seed=1))
    for n in with_rows:
        got, want = sparse[n], dense_ops.tenant(n).grads
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert any(bool(g.abs().sum() > 0) for g in got)
