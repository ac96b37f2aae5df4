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


def _backend(max_loras: int, max_tenants: int | None, names: list[str], budget: int | None = None, spill=None):
    from rl_multilora.backends.local import LocalBackend
    from rl_multilora.tenant_store import TenantStore
    from rl_multilora.trainer import MultiLoRATrainer

    model = MultiLoRAModel.from_model(tiny_model(seed=0, vocab=VOCAB), max_loras=max_loras, max_rank=16)
    paging = max_tenants is not None and max_tenants > max_loras
    store = TenantStore(budget, spill) if paging else None
    trainer = MultiLoRATrainer(model, GRPOSettings(), pad_token_id=PAD_ID, store=store)
    backend = LocalBackend(model, trainer, max_tenants=max_tenants)
    for i, n in enumerate(names):
        r = (4, 8, 16)[i % 3]
        backend.add_client(n, r, 2.0 * r, seed=i, target_modules=model.lora_modules if i % 4 else ["q_proj"])
    return backend


def _train_in_turns(backend, names: list[str], steps: int, per_step: int) -> None:
    """`steps` rounds: each round `per_step` tenants (rotating) do a mixed forward_backward and an optim_step."""
    from rl_multilora.losses import client_algo
    from rl_multilora.tenant_optim import AdamSettings

    for k in range(steps):
        chosen = [names[(k * per_step + j) % len(names)] for j in range(per_step)]
        rows = _rows(chosen, 2 * per_step, seed=100 + k)
        backend.forward_backward(rows, {n: client_algo("importance_sampling", None) for n in chosen})
        for n in chosen:
            backend.optim_step(n, AdamSettings(learning_rate=1e-2, weight_decay=0.01))


def _state(backend, name: str) -> tuple[dict[str, torch.Tensor], dict]:
    return backend.adapter_state_dict(name), backend.optimizer_state_dict(name)


def _assert_same_state(a, b) -> None:
    (wa, oa), (wb, ob) = a, b
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert oa["scheduler"] == ob["scheduler"]
    assert oa["optimizer"]["param_groups"] == ob["optimizer"]["param_groups"]
    sa, sb = oa["optimizer"]["state"], ob["optimizer"]["state"]
    assert sa.keys() == sb.keys() and sa
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        assert all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i])


def test_16_tenants_on_4_slots_end_bit_identical_to_16_slots(tmp_path):
    names = [f"c{i:02d}" for i in range(16)]
    full = _backend(16, None, names)
    paged = _backend(4, 16, names, budget=200_000, spill=tmp_path / "spill")  # a few tenants spill to disk
    for b in (full, paged):
        _train_in_turns(b, names, steps=10, per_step=3)
        # a client's gradient waits in its state across page-outs until its own optim_step
        _train_in_turns(b, names[:5], steps=1, per_step=5)
    stats = paged.paging_stats()
    assert stats.page_ins > 16 and stats.resident == 4 and stats.paged == 12
    assert paged.trainer.ops.store.stats.spills > 0 and paged.trainer.ops.store.stats.loads > 0
    assert full.paging_stats() is None
    for n in names:
        state = _state(full, n)
        assert any(bool(v.abs().sum() > 0) for k, v in state[0].items() if "lora_B" in k)  # it trained
        _assert_same_state(state, _state(paged, n))
    assert len(paged.model.adapters) == 4  # reading every state paged them in turn through the 4 slots


def test_a_forward_backward_of_more_tenants_than_slots_runs_in_parts_with_the_same_outputs():
    from rl_multilora.losses import client_algo

    names = [f"c{i}" for i in range(6)]
    full, paged = _backend(6, None, names), _backend(2, 8, names)
    rows = _rows(names, 12, seed=5)
    algos = {n: client_algo("importance_sampling", None) for n in names}
    a, b = full.forward_backward(rows, algos), paged.forward_backward(rows, algos)
    assert all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs, strict=True))
    assert a.row_loss == b.row_loss and a.backwarded == b.backwarded == set(names)
    for n in names:
        ga, gb = full.trainer.ops.tenant(n).grads, paged.trainer.ops.tenant(n).grads
        if not paged.trainer.ops.is_resident(n):
            paged.trainer.ops.ensure_resident([n])
            gb = paged.trainer.ops.tenant(n).grads
        assert all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True))


def test_places_resident_and_removal():
    names = [f"c{i}" for i in range(5)]
    b = _backend(2, 6, names)
    assert b.max_tenants == 6 and b.max_loras == 2 and sorted(b.adapters) == names
    assert b.free_slots() == [5]
    b.remove_adapter("c0")  # paged out: its stored state goes
    b.remove_adapter("c4")  # resident: its slot frees
    assert b.free_slots() == [0, 4, 5] and len(b.model.adapters) == 1
    assert b.trainer.ops.store.names == ["c1", "c2"] and b.trainer.ops.resident == ["c3"]
    b.add_client("d", 4, 8.0, seed=1, target_modules=b.model.lora_modules)
    b.add_client("e", 4, 8.0, seed=2, target_modules=b.model.lora_modules)
    b.add_client("f", 4, 8.0, seed=3, target_modules=b.model.lora_modules)
    try:
        b.add_client("g", 4, 8.0, seed=4, target_modules=b.model.lora_modules)
    except RuntimeError as e:
        assert "model.max_tenants=6" in str(e)
    else:
        raise AssertionError("a 7th tenant got a place of 6")
