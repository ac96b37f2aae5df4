"""The decode path (`layer.bag_lora`: one token per row, read straight from a bank's rank-minor slots) and the training
node (`layer._LinearLoRA`: base Linear + LoRA in one node) against the float32
per-row loop, over the adapter mixes of `test_grouped_lora.py` (distinct, uniform, skewed, one adapter, base rows
mixed in, mixed ranks, adapters covering a subset of modules, 256 adapters)."""

from __future__ import annotations

import pytest
import torch
from test_grouped_lora import GRAD_TOL, MIXES, TOL, add, batch, make_model, mixed_loss
from tiny_models import FAMILIES
from transformers import DynamicCache

from rl_multilora.lora import layer as layer_module
from rl_multilora.lora.routing import build_routing
from rollout.engines.embedded import kv_cache_kwarg


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def bag_calls(monkeypatch):
    """Counts the decode path's calls, so a test knows the path it checks did run."""
    calls = []
    bag_lora = layer_module.bag_lora

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return bag_lora(*args, **kwargs)

    monkeypatch.setattr(layer_module, "bag_lora", counted)
    return calls


@pytest.mark.parametrize("mix", list(MIXES))
def test_decode_step_through_the_bank_equals_reference_loop(mix, bag_calls):
    names, specs, kw = MIXES[mix]
    kw = dict(kw)
    length = kw.pop("length", 7)
    family = FAMILIES[list(MIXES).index(mix) % len(FAMILIES)]
    m = make_model(family, **{"max_loras": 8, **kw})
    add(m, specs)
    bank = m.new_bank()
    slots = [-1 if n is None else m.slot_of(n) for n in names]
    ids, _ = batch(rows=len(names), length=length, left_pad=False)
    with torch.no_grad():
        ref = m(ids, adapter_names=names, reference=True).logits[:, -1]  # (B, V): the float32 loop, whole sequence
        cache = {kv_cache_kwarg(m.base_model): DynamicCache(config=m.base_model.config)}
        m(ids[:, :-1], adapter_slots=slots, lora_bank=bank, **cache, use_cache=True)
        assert not bag_calls  # the prefill (several tokens per row) gathers
        step = m(ids[:, -1:], adapter_slots=slots, lora_bank=bank, **cache, use_cache=True).logits
    one_adapter_view = len({n for n in names}) == 1  # one slot, contiguous rows: the view path, not the bags
    assert bool(bag_calls) != one_adapter_view
    torch.testing.assert_close(step[:, -1], ref, **TOL)


def test_bag_lora_equals_the_gather_path_per_layer_with_base_rows_and_mixed_ranks():
    m = make_model("qwen2", max_loras=6, max_rank=8, hidden=48)
    add(m, {"a": (2, 5), "b": (8, 12.3), "c": (3, 7)})
    bank = m.new_bank()
    bank.set_adapter(5, m.adapter_state_dict("c"), m.peft_config("c"))
    slots = [5, -1, 0, 1, 1, -1, 2, 0]
    meta = {s: bank.slot_meta(s) for s in set(slots) if s != -1}
    routing = build_routing(slots, meta, torch.device("cpu"), bank, reference=False)
    active = torch.tensor([i for i, s in enumerate(slots) if s != -1])
    g = torch.Generator().manual_seed(0)
    for module, (fan_in, fan_out) in m.layer_shapes.items():
        lora_a, lora_b = bank.stacked(module)
        assert layer_module.rank_minor(lora_a, lora_b)
        x = torch.randn(len(active), fan_in, generator=g)
        scales = routing.scales_for(module)
        bags = layer_module.bag_lora(x, lora_a, lora_b, routing, scales)  # (n, out)
        gathered = torch.zeros(len(active), 1, fan_out)
        layer_module.grouped_lora(gathered, x[:, None], lora_a, lora_b, routing.row_slots, scales, 8, grad=False)
        loop = torch.stack(
            [meta[s][1] * (x[i] @ lora_a[s].T @ lora_b[s].T) for i, s in enumerate(s for s in slots if s != -1)]
        )
        torch.testing.assert_close(bags, loop, **TOL)
        torch.testing.assert_close(gathered[:, 0], loop, **TOL)


def graph_nodes(tensor: torch.Tensor) -> set[str]:
    """Names of the autograd nodes `tensor` was computed through."""
    seen, stack, names = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.parametrize("sink", [False, True], ids=["dense_grads", "slot_grad_sink"])
@pytest.mark.parametrize(
    "names",
    [["c"] * 5, ["a", "b", "c", "a", "b"], ["b", "b", "c", "b", "b"]],
    ids=["one_slot", "distinct_and_repeated", "skewed"],
)
def test_training_node_equals_reference_loop(names, sink):
    m = make_model("llama", max_loras=4)
    add(m, {"a": (2, 5), "b": (8, 12.3), "c": (6, 7)})
    if sink:
        m.use_slot_grads()
    ids, mask = batch(rows=len(names))
    used = sorted(set(names))
    results = []
    for reference in (False, True):
        m.zero_lora_grads()
        x = m.base_model.get_input_embeddings()(ids).detach().requires_grad_()
        logits = m(inputs_embeds=x, attention_mask=mask, adapter_names=names, reference=reference).logits
        assert ("_LinearLoRABackward" in graph_nodes(logits)) != reference
        mixed_loss(logits, ids, names).backward()
        grads = {n: [None if g is None else g.clone() for g in m.adapter_grads(n)] for n in m.adapters}
        results.append((logits.detach(), x.grad.clone(), grads))
    (fast, fast_x, fast_grads), (ref, ref_x, ref_grads) = results
    torch.testing.assert_close(fast, ref, **TOL)
    torch.testing.assert_close(fast_x, ref_x, **GRAD_TOL)
    for name in m.adapters:
        for g_fast, g_ref in zip(fast_grads[name], ref_grads[name], strict=True):
            if name in used:
                assert torch.count_nonzero(g_fast) > 0
                torch.testing.assert_close(g_fast, g_ref, **GRAD_TOL)
            else:
                assert g_fast is None or torch.count_nonzero(g_fast) == 0, name


def test_the_routing_holds_the_used_slots_so_no_layer_backward_computes_them(monkeypatch):
    """`Routing.slot_index()` is `torch.unique(row_slots, return_inverse=True)`, built on the host once per forward;
    a training backward through every Linear reads it instead of calling unique (a device sync per layer on a GPU)."""
    routing = build_routing([5, -1, 0, 2, 2, -1, 0], {s: (4, 1.0, frozenset()) for s in (0, 2, 5)}, torch.device("cpu"),
                            None, reference=False)  # fmt: skip
    used, inverse = torch.unique(routing.row_slots, return_inverse=True)
    assert torch.equal(routing.slot_index()[0], used) and torch.equal(routing.slot_index()[1], inverse)
    m = make_model("qwen2")
    add(m, {"a": (4, 8), "b": (8, 16)})
    m.train()
    m.use_slot_grads()
    ids, _ = batch(rows=4, length=6, left_pad=False)
    calls = []
    unique = torch.unique
    monkeypatch.setattr(torch, "unique", lambda *a, **k: calls.append(1) or unique(*a, **k))
    for names in (["a", "b", "a", "b"], ["a", None, "b", "a"]):  # every row on an adapter / base rows mixed in
        m(ids, adapter_names=names).logits.float().mean().backward()
    assert calls == []


def test_concat_probe_computes_what_the_trainer_node_does():
    """bench/bench_lora_concat.py's concatenated GEMMs (an idea measured and not taken, docs/benchmarks.md) check
    their outputs, input and per-slot gradients against `_LinearLoRA` before timing: one slot and one slot per row."""
    from bench.bench_lora_concat import linear_variants

    variants = linear_variants(24, 16, rows=3, seq_len=5)  # raises where the probe's numbers differ
    assert set(variants) == {"base", "one slot, now", "one slot, concat", "mixed, now", "mixed, concat"}
    for run in variants.values():
        run()
