"""Batched paging: `MultiLoRAModel.take_adapters` / `place_adapters` move several adapters of mixed ranks and module
sets with one gather / scatter per stacked tensor, bit for bit; a tenant's AdamW moments are at its true rank."""

from __future__ import annotations

import torch

from rl_multilora.config import GRPOSettings, OptimSettings
from rl_multilora.lora import MultiLoRAModel
from rl_multilora.rows import Row
from rl_multilora.train_ops import TrainOps
from tests.tiny_models import PAD_ID, tiny_model

VOCAB = 128


def _model() -> MultiLoRAModel:
    m = MultiLoRAModel.from_model(tiny_model(seed=0, vocab=VOCAB), max_loras=6, max_rank=16)
    m.add_adapter("r4", rank=4, alpha=8, seed=1)
    m.add_adapter("r8", rank=8, alpha=16, seed=2)
    m.add_adapter("r16", rank=16, alpha=32, seed=3)
    m.add_adapter("qv", rank=8, alpha=16, seed=4, target_modules=["q_proj", "v_proj"])
    m.add_adapter("r4b", rank=4, alpha=4, seed=5)
    with torch.no_grad():  # B non-zero, so every tensor of every slot carries its own values
        for name in m.adapters:
            for k, p in enumerate(m.adapter_parameters(name)):
                if k % 2:
                    p[(..., slice(0, m.adapters[name].rank))] = torch.randn_like(p)[..., : m.adapters[name].rank]
    return m


def test_take_and_place_several_adapters_give_back_every_bit_and_leave_the_others_alone():
    m = _model()
    before = {n: m.adapter_state_dict(n) for n in m.adapters}
    slots_before = {n: m.slot_of(n) for n in m.adapters}
    moved = ["r16", "qv", "r4"]  # three ranks, two module sets, in one call
    infos = {n: (m.adapters[n].rank, m.adapters[n].alpha, m.adapter_modules(n)) for n in moved}
    flats = m.take_adapters(moved)
    assert set(m.adapters) == {"r8", "r4b"}
    for n, flat in zip(moved, flats, strict=True):  # true rank only: the flat size is the adapter's, not the slot's
        assert flat.numel() == sum(t.numel() for t in before[n].values())
    for k, p in m.named_parameters():  # freed slots are zero, weights and the others unchanged
        if "lora_" in k:
            assert all(not p[slots_before[n]].any() for n in moved)
    m.add_adapter("other", rank=8, alpha=16, seed=9)  # takes the lowest free slot in between
    m.remove_adapter("other")
    placed = m.place_adapters([(n, *infos[n], f) for n, f in zip(reversed(moved), reversed(flats), strict=True)])
    assert sorted(placed) == sorted(slots_before[n] for n in moved)
    for n in before:
        after = m.adapter_state_dict(n)
        assert after.keys() == before[n].keys()
        assert all(torch.equal(after[k], before[n][k]) for k in after)
    # the ranks above each adapter's rank and the modules it does not cover are exact zeros again
    for name in m.adapters:
        r, covered = m.adapters[name].rank, m.adapter_modules(name)
        for module, layer in m._layers.items():
            a, b = layer.lora_A[m.slot_of(name)], layer.lora_B[m.slot_of(name)]
            if module not in covered:
                assert not a.any() and not b.any()
            else:
                assert not a[r:].any() and not b[:, r:].any()


def test_place_adapters_checks_everything_before_writing_a_slot():
    m = _model()
    flats = m.take_adapters(["r8", "r16"])
    mods = frozenset(m.lora_modules)
    try:
        m.place_adapters([("r8", 8, 16.0, mods, flats[0]), ("r16", 16, 32.0, mods, flats[0])])  # r16's flat is wrong
    except ValueError as e:
        assert "1-D tensors of" in str(e)
    else:
        raise AssertionError("a flat of the wrong size was accepted")
    assert "r8" not in m.adapters and all(not p[[1, 2]].any() for k, p in m.named_parameters() if "lora_" in k)


def test_a_tenants_adam_moments_are_at_its_true_rank_and_page_with_it_unchanged():
    m = MultiLoRAModel.from_model(tiny_model(seed=0, vocab=VOCAB), max_loras=2, max_rank=16)
    from rl_multilora.tenant_store import TenantStore

    ops = TrainOps(m, GRPOSettings(), pad_token_id=PAD_ID, store=TenantStore())
    for i, (n, r) in enumerate((("a", 4), ("b", 8))):
        m.add_adapter(n, rank=r, alpha=2 * r, seed=i)
        ops.add_tenant(n, OptimSettings(), lr=1e-2)
    rows = [Row(n, list(range(3, 12)), list(range(4, 9)), 1.0, None) for n in ("a", "b")]
    ops.forward_backward(rows)
    for n in ("a", "b"):
        assert ops.optim_step(n)[0]
    state = ops.tenant("a").optim.optimizer.state
    shapes = [tuple(t.shape) for t in m.adapter_slot_tensors("a")]
    assert [tuple(state[p]["exp_avg"].shape) for p in ops.tenant("a").optim.params] == shapes
    moments = [{k: v.clone() for k, v in state[p].items()} for p in ops.tenant("a").optim.params]
    ops.page_out("a")
    assert not ops.is_resident("a")
    ops.ensure_resident(["a"])  # moments back as they left, at the true rank
    again = ops.tenant("a").optim.optimizer.state
    for p, want in zip(ops.tenant("a").optim.params, moments, strict=True):
        assert all(torch.equal(again[p][k], v) for k, v in want.items())
