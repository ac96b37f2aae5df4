"""The stacked-slot LoRA layer's grouped path (gather + bmm) and view path against oracles.

Oracles: the model's own float32 per-row loop (`reference=True`), PEFT's LoRA for the math, and a plain per-tenant
`torch.optim.AdamW` over separate cloned tensors for the optimizer. Every model is a tiny random Qwen2 / Qwen3 /
Llama built offline in float32, so tolerances are tight.
"""

from __future__ import annotations

import collections

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tiny_models import FAMILIES, assert_same_bits, tiny_model

from rl_multilora.lora import LoRALinear, MultiLoRAModel, cpu_kernels

VOCAB = 128
TOL = dict(atol=1e-5, rtol=1e-5)
GRAD_TOL = dict(atol=1e-6, rtol=1e-5)
PEFT_TOL = dict(atol=2e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny: intra-op threads only add barrier waits, which cost 50x on a busy 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_model(family="qwen2", max_loras=8, max_rank=8, target_modules="all-linear", **kw) -> MultiLoRAModel:
    return MultiLoRAModel.from_model(tiny_model(family, **kw), max_loras, max_rank, target_modules)


def lora_layers(m: MultiLoRAModel) -> list[LoRALinear]:
    return [layer for layer in m.base_model.modules() if isinstance(layer, LoRALinear)]


def bf16_base(m: MultiLoRAModel) -> MultiLoRAModel:
    """The base to bf16 and the slots back to float32: PEFT's default dtypes (`autocast_adapter_dtype`)."""
    m.base_model.to(torch.bfloat16)
    for layer in lora_layers(m):
        layer.lora_A.data, layer.lora_B.data = layer.lora_A.data.float(), layer.lora_B.data.float()
    return m


def randomize(m: MultiLoRAModel, name: str, seed: int) -> None:
    """Give the adapter non-zero B (and a new A) at its true rank in its covered modules; padding stays zero.

    Writes the stacked Parameters directly (not through `adapter_parameters`, which a test checks on its own)."""
    g = torch.Generator().manual_seed(seed)
    s, r = m.slot_of(name), m.adapters[name].rank
    covered = {k.split("base_model.model.", 1)[1].rsplit(".lora_", 1)[0] for k in m.adapter_state_dict(name)}
    with torch.no_grad():
        for module in m.lora_modules:
            if module in covered:
                layer = m.base_model.get_submodule(module)
                a, b = layer.lora_A[s], layer.lora_B[s]
                a[:r].copy_(torch.randn(a[:r].shape, generator=g) * 0.1)
                b[:, :r].copy_(torch.randn(b[:, :r].shape, generator=g) * 0.1)


def add(m: MultiLoRAModel, specs: dict, seed: int = 0) -> None:
    """Add and randomize adapters `specs[name] = (rank, alpha)` or `(rank, alpha, target_modules)`."""
    for i, (name, spec) in enumerate(specs.items()):
        rank, alpha, *targets = spec
        m.add_adapter(name, rank=rank, alpha=alpha, seed=seed + i, target_modules=targets[0] if targets else None)
        randomize(m, name, seed=1000 + seed + i)


def batch(rows=6, length=7, seed=0, left_pad=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    if left_pad and rows > 1:
        mask[1, :2] = 0  # a left-padded row: the mask has to pass through to HF untouched
    return ids, mask


def per_adapter_loss(logits, ids, names, adapter):
    """Mean next-token NLL over `adapter`'s rows only (GRPO normalizes per adapter the same way)."""
    rows = [i for i, n in enumerate(names) if n == adapter]
    logp = torch.log_softmax(logits[rows, :-1], dim=-1)  # (n_rows, T-1, V)
    return -logp.gather(-1, ids[rows, 1:, None]).mean()


def mixed_loss(logits, ids, names, adapters=None):
    used = sorted({n for n in names if n is not None}) if adapters is None else adapters
    return sum(per_adapter_loss(logits, ids, names, n) for n in used)


def cloned_grads(m: MultiLoRAModel, names) -> dict[str, list[torch.Tensor | None]]:
    return {n: [None if g is None else g.clone() for g in m.adapter_grads(n)] for n in names}


# ---------------------------------------------------------------------------------------------------------------
# Fast path (grouped or view) against the float32 per-row loop

# name -> (rank, alpha[, target_modules]); most scales alpha / rank are not short binary fractions (7/3, 12.3/8).
SPECS = {"a": (2, 5), "b": (8, 12.3), "c": (6, 7), "d": (1, 0.7), "e": (3, 7), "f": (5, 11)}
MIXES = {
    "distinct": (["a", "b", "c", "d", "e", "f"], SPECS, {}),
    "uniform": (["a", "b", "c", "d"] * 2, SPECS, {}),
    "skewed": (["b", "b", "b", "a", "b", "b", "d", "b"], SPECS, {}),
    "one_adapter": (["c"] * 5, SPECS, {}),
    "base_rows_mixed_in": ([None, "a", None, "b", "b", None, "d"], SPECS, {}),
    "mixed_ranks": (["r1", "r3", "r8", "r1", "r8", "r3"], {"r1": (1, 0.7), "r3": (3, 7), "r8": (8, 12.3)}, {}),
    "subset_adapters": (
        ["qv", "full", "qv", None, "full"],
        {"qv": (4, 9, ["q_proj", "v_proj"]), "full": (3, 5)},
        {},
    ),
    "256_adapters": (
        [f"t{i}" for i in range(256)],
        {f"t{i}": (1 + i % 2, 3 + i % 5) for i in range(256)},
        dict(max_loras=256, max_rank=2, hidden=16, layers=1, length=4),
    ),
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_fast_path_equals_reference_loop_values_and_grads(mix):
    names, specs, kw = MIXES[mix]
    kw = dict(kw)
    length = kw.pop("length", 7)
    family = FAMILIES[list(MIXES).index(mix) % len(FAMILIES)]
    m = make_model(family, **{"max_loras": 8, **kw})
    add(m, specs)
    if m.free_slots:  # an idle adapter and, after it, an empty slot: neither may get anything
        m.add_adapter("idle", rank=1, alpha=2, seed=99)
        randomize(m, "idle", seed=99)
    ids, mask = batch(rows=len(names), length=length)
    used = sorted({n for n in names if n is not None})
    results = []
    for reference in (False, True):
        m.zero_lora_grads()
        logits = m(ids, attention_mask=mask, adapter_names=names, reference=reference).logits
        mixed_loss(logits, ids, names).backward()
        results.append((logits.detach(), cloned_grads(m, m.adapters)))
    (fast, fast_grads), (ref, ref_grads) = results
    torch.testing.assert_close(fast, ref, **TOL)
    with torch.no_grad():
        base = m(ids, attention_mask=mask).logits
    lora_rows = [i for i, n in enumerate(names) if n is not None]
    base_rows = [i for i, n in enumerate(names) if n is None]
    assert not torch.allclose(fast[lora_rows], base[lora_rows], atol=1e-4)  # the adapters do change the output
    torch.testing.assert_close(fast[base_rows], base[base_rows], atol=0, rtol=0)
    for name in m.adapters:
        for g_fast, g_ref in zip(fast_grads[name], ref_grads[name], strict=True):
            if name in used:
                torch.testing.assert_close(g_fast, g_ref, **GRAD_TOL)
            else:
                assert g_fast is None or torch.count_nonzero(g_fast) == 0, name
    for name in used:  # every used adapter really gets a gradient (else the comparison above proves little)
        assert any(torch.count_nonzero(g) > 0 for g in fast_grads[name]), name
    for s in m.free_slots:
        for layer in lora_layers(m):
            for stacked in (layer.lora_A, layer.lora_B):
                assert stacked.grad is None or torch.count_nonzero(stacked.grad[s]) == 0


# ---------------------------------------------------------------------------------------------------------------
# Exact zeros above each rank and in unused slots

RANKS = {"r1": (1, 3), "r3": (3, 7), "r5": (5, 9), "r8": (8, 12.3), "idle": (4, 5)}


@pytest.mark.parametrize(
    "names",
    [
        ["r1", "r8", "r3", None, "r5", "r1", "r8"],  # grouped at max_rank
        ["r3", "r5", "r1", "r5", None, "r3"],  # grouped below max_rank (computed at rank 5 of 8)
        [None, "r3", "r3", "r3", None],  # one slot, contiguous rows: the view path
        ["r5", None, "r5"],  # one slot, rows not contiguous: grouped
    ],
    ids=["grouped_max_rank", "grouped_below_max_rank", "view_path", "one_slot_gathered"],
)
def test_grads_above_rank_and_of_unused_slots_are_exactly_zero(names):
    m = make_model("qwen3", max_loras=8, max_rank=8)
    add(m, RANKS)
    m.add_adapter("gone", rank=8, alpha=8, seed=7)
    randomize(m, "gone", seed=7)
    m.remove_adapter("gone")
    assert m.free_slots == [5, 6, 7]
    ids, mask = batch(rows=len(names))
    logits = m(ids, attention_mask=mask, adapter_names=names).logits
    mixed_loss(logits, ids, names).backward()
    used = {n for n in names if n is not None}
    for name, info in m.adapters.items():
        r = info.rank
        grads = m.adapter_grads(name)
        assert all(g is not None for g in grads)
        for ga, gb in zip(grads[::2], grads[1::2], strict=True):
            assert torch.count_nonzero(ga[r:]) == 0 and torch.count_nonzero(gb[:, r:]) == 0, name
            if name not in used:
                assert torch.count_nonzero(ga) == 0 and torch.count_nonzero(gb) == 0, name
        if name in used:
            assert all(torch.count_nonzero(g[:r]) > 0 for g in grads[::2]), name
            assert all(torch.count_nonzero(g[:, :r]) > 0 for g in grads[1::2]), name
    for layer in lora_layers(m):
        for s in m.free_slots:
            assert torch.count_nonzero(layer.lora_A.grad[s]) == 0 and torch.count_nonzero(layer.lora_B.grad[s]) == 0


# ---------------------------------------------------------------------------------------------------------------
# NaN / inf of one tenant stays in that tenant


@pytest.mark.parametrize("poison", ["nan_B", "inf_A", "nan_input"])
def test_nonfinite_tenant_does_not_leak_into_other_tenants_grads(poison):
    m = make_model("llama", max_loras=6)
    add(m, {"a": (4, 8), "b": (2, 5), "c": (8, 12.3), "bad": (3, 7)})
    names = ["a", "bad", "b", "c", "bad", "a", "c", "b"]
    good = ["a", "b", "c"]
    bad_rows = [i for i, n in enumerate(names) if n == "bad"]
    good_rows = [i for i, n in enumerate(names) if n != "bad"]
    ids, mask = batch(rows=len(names))
    clean_embeds = m.base_model.get_input_embeddings()(ids).detach()

    def run(embeds, loss_of):
        m.zero_lora_grads()
        logits = m(attention_mask=mask, adapter_names=names, inputs_embeds=embeds).logits
        mixed_loss(logits, ids, names, loss_of).backward()
        return logits.detach(), cloned_grads(m, good)

    clean = {"all": run(clean_embeds, good), **{t: run(clean_embeds, [t]) for t in good}}

    embeds = clean_embeds.clone()
    slot = m.slot_of("bad")
    if poison == "nan_input":
        embeds[bad_rows] = float("nan")
    else:
        module = "model.layers.0.mlp.up_proj" if poison == "nan_B" else "model.layers.1.self_attn.q_proj"
        layer = m.base_model.get_submodule(module)
        with torch.no_grad():
            if poison == "nan_B":
                layer.lora_B[slot, :, :3] = float("nan")
            else:
                layer.lora_A[slot, :3] = float("inf")
    poisoned = {"all": run(embeds, good), **{t: run(embeds, [t]) for t in good}}

    for key, (logits, grads) in poisoned.items():
        assert not torch.isfinite(logits[bad_rows]).any(), key  # the poison did reach the bad tenant's rows
        torch.testing.assert_close(logits[good_rows], clean[key][0][good_rows], atol=1e-6, rtol=0)
        for name in good:
            for g, g_clean in zip(grads[name], clean[key][1][name], strict=True):
                assert torch.isfinite(g).all(), (key, name)
                torch.testing.assert_close(g, g_clean, atol=1e-6, rtol=0)
            if key in ("all", name):
                assert any(torch.count_nonzero(g) > 0 for g in grads[name]), (key, name)


# ---------------------------------------------------------------------------------------------------------------
# PEFT parity with mixed ranks in one batch


def test_mixed_ranks_in_one_batch_match_peft_per_adapter(tmp_path):
    family = "qwen3"
    m = make_model(family, max_loras=6, max_rank=8)
    peft_models = {}
    # Built in PEFT with random A and B (init_lora_weights=False), saved, loaded here.
    peft_specs = {
        "p1": (1, 0.7, "all-linear"),
        "p3": (3, 7, ["q_proj", "v_proj", "down_proj"]),
        "p8": (8, 12.3, "all-linear"),
    }
    for i, (name, (rank, alpha, targets)) in enumerate(peft_specs.items()):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(100 + i)
            pm = get_peft_model(
                tiny_model(family),
                LoraConfig(
                    r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, init_lora_weights=False
                ),
            )
        pm.save_pretrained(str(tmp_path / name))
        m.load_adapter(name, tmp_path / name)
        assert (m.adapters[name].rank, m.adapters[name].alpha) == (rank, alpha)
        peft_models[name] = pm
    # Built here, exported, loaded in PEFT.
    add(m, {"x5": (5, 11)}, seed=50)
    peft_models["x5"] = PeftModel.from_pretrained(tiny_model(family), str(m.export_adapter("x5", tmp_path / "x5")))

    names = ["p1", "p8", None, "x5", "p3", "p1", "x5", "p3", "p8"]
    ids, mask = batch(rows=len(names))
    with torch.no_grad():
        got = m(ids, attention_mask=mask, adapter_names=names).logits
        base = tiny_model(family)(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[2], base[2], atol=0, rtol=0)
    for name, pm in peft_models.items():
        rows = [i for i, n in enumerate(names) if n == name]
        with torch.no_grad():
            expected = pm(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(got[rows], expected[rows], **PEFT_TOL)
        assert not torch.allclose(expected[rows], base[rows], atol=1e-3), name  # the adapter changes the output


# ---------------------------------------------------------------------------------------------------------------
# Per-slot AdamW (views of the stacked tensors) against per-tenant AdamW over separate tensors

OPTIM = {
    "a": dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0),
    "b": dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
    "c": dict(lr=5e-2, betas=(0.5, 0.9), eps=1e-4, weight_decay=0.5),
}
# Which rows each step has: c sits out step 1, a and b sit out step 2 (c alone: the view path), a sits out step 3.
STEPS = [
    ["a", "b", "c", "a", "c", "b"],
    ["b", "a", None, "a", "b", "b"],
    ["c", "c", "c", None, None, None],
    [None, "c", "b", "c", "b", None],
    ["c", "a", "b", "b", "a", "c"],
]


def test_per_slot_adamw_equals_per_tenant_adamw_bit_for_bit():
    m = make_model("qwen2", max_loras=4, max_rank=8)
    add(m, {"a": (2, 5), "b": (5, 7), "c": (8, 12.3, ["q_proj", "v_proj"])})
    views = {n: m.adapter_parameters(n) for n in OPTIM}
    optims = {n: torch.optim.AdamW(views[n], **OPTIM[n]) for n in OPTIM}
    copies = {n: [p.detach().clone().requires_grad_(True) for p in views[n]] for n in OPTIM}
    copy_optims = {n: torch.optim.AdamW(copies[n], **OPTIM[n]) for n in OPTIM}
    ids, mask = batch(rows=6)
    for step, names in enumerate(STEPS):
        before = {n: [p.detach().clone() for p in m.adapter_parameters(n)] for n in OPTIM}
        m.zero_lora_grads()
        logits = m(ids, attention_mask=mask, adapter_names=names).logits
        mixed_loss(logits, ids, names).backward()
        present = sorted({n for n in names if n is not None})
        for name in present:
            m.attach_slot_grads(name, views[name])
            # views of the stacked grad (what in-place clipping relies on), not copies
            assert [p.grad.data_ptr() for p in views[name]] == [g.data_ptr() for g in m.adapter_grads(name)]
            for copy, g in zip(copies[name], m.adapter_grads(name), strict=True):
                copy.grad = g.clone()
            assert all(p.grad is not None and torch.count_nonzero(p.grad) > 0 for p in views[name])
            optims[name].step()
            copy_optims[name].step()
        for name in OPTIM:
            now = m.adapter_parameters(name)  # fresh views of the slot: the optimizer updated the model in place
            for p, view, copy in zip(now, views[name], copies[name], strict=True):
                assert torch.equal(p, copy), (step, name)
                assert torch.equal(view, copy), (step, name)
            if name in present:
                assert all(not torch.equal(p, q) for p, q in zip(now, before[name], strict=True)), (step, name)
            else:  # no rows, no step: not even weight decay moves it
                assert all(torch.equal(p, q) for p, q in zip(now, before[name], strict=True)), (step, name)
            r = m.adapters[name].rank
            for a, b in zip(now[::2], now[1::2], strict=True):
                assert torch.count_nonzero(a[r:]) == 0 and torch.count_nonzero(b[:, r:]) == 0, (step, name)
    shapes = m.layer_shapes
    for name, optim in optims.items():
        modules = [mod for mod in m.lora_modules if name != "c" or mod.endswith(("q_proj", "v_proj"))]
        expected = [s for mod in modules for s in ((8, shapes[mod][0]), (shapes[mod][1], 8))]
        state = optim.state_dict()["state"]
        assert len(state) == len(expected) == len(views[name])
        for i, shape in enumerate(expected):
            assert tuple(state[i]["exp_avg"].shape) == shape and tuple(state[i]["exp_avg_sq"].shape) == shape
        n_steps = sum(name in s for s in STEPS)
        assert int(state[0]["step"]) == n_steps == int(copy_optims[name].state_dict()["state"][0]["step"])
        for i, s in copy_optims[name].state_dict()["state"].items():
            assert torch.equal(state[i]["exp_avg"], s["exp_avg"]) and torch.equal(
                state[i]["exp_avg_sq"], s["exp_avg_sq"]
            )


# ---------------------------------------------------------------------------------------------------------------
# Wrap cost and far slots


def test_two_lora_parameters_per_linear_whatever_max_loras_and_slot_1000_works():
    for max_loras in (1, 1024):
        m = MultiLoRAModel.from_model(tiny_model("qwen2"), max_loras=max_loras, max_rank=8)
        assert sum("lora_" in n for n, _ in m.named_parameters()) == 2 * len(m.lora_modules) == 2 * 2 * 7
    layer = m.base_model.get_submodule("model.layers.0.mlp.down_proj")
    assert layer.lora_A.shape == (1024, 8, 64) and layer.lora_B.shape == (1024, 32, 8)

    for i in range(1000):
        m.add_adapter(f"t{i}", rank=1 + i % 8, alpha=2, seed=i)
    randomize(m, "t0", seed=1)
    randomize(m, "t999", seed=2)
    snapshot = [(layer.lora_A.detach().clone(), layer.lora_B.detach().clone()) for layer in lora_layers(m)]

    def others_untouched():
        for layer, (a, b) in zip(lora_layers(m), snapshot, strict=True):
            for now, then in ((layer.lora_A, a), (layer.lora_B, b)):
                assert torch.equal(now[:1000], then[:1000]) and torch.equal(now[1001:], then[1001:])

    assert m.add_adapter("far", rank=8, alpha=12.3, seed=5) == 1000
    randomize(m, "far", seed=3)
    others_untouched()
    names = ["far", "t999", None, "far", "t0"]
    ids, mask = batch(rows=len(names))
    results = []
    for reference in (False, True):
        m.zero_lora_grads()
        logits = m(ids, attention_mask=mask, adapter_names=names, reference=reference).logits
        mixed_loss(logits, ids, names).backward()
        results.append((logits.detach(), cloned_grads(m, ["far", "t0", "t999", "t500"])))
    (fast, fast_grads), (ref, ref_grads) = results
    torch.testing.assert_close(fast, ref, **TOL)
    for name in ("far", "t0", "t999"):
        for g_fast, g_ref in zip(fast_grads[name], ref_grads[name], strict=True):
            torch.testing.assert_close(g_fast, g_ref, **GRAD_TOL)
        assert any(torch.count_nonzero(g) > 0 for g in fast_grads[name])
    assert all(torch.count_nonzero(g) == 0 for g in fast_grads["t500"])
    with torch.no_grad():
        base = m(ids, attention_mask=mask).logits
    assert not torch.allclose(fast[[0, 3]], base[[0, 3]], atol=1e-3)

    m.remove_adapter("far")
    assert m.free_slots == list(range(1000, 1024)) and "far" not in m.adapters
    others_untouched()
    for layer in lora_layers(m):
        for stacked in (layer.lora_A, layer.lora_B):
            assert torch.count_nonzero(stacked[1000]) == 0 and torch.count_nonzero(stacked.grad[1000]) == 0
    with torch.no_grad():  # the other tenants' rows are as before; the freed slot's rows are now base rows
        after = m(ids, attention_mask=mask, adapter_names=[None, "t999", None, None, "t0"]).logits
    torch.testing.assert_close(after[[1, 2, 4]], fast[[1, 2, 4]], **TOL)
    torch.testing.assert_close(after[[0, 3]], base[[0, 3]], atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# Bank path


@pytest.mark.parametrize(
    "slot_mix",
    [
        [0, -1, 1, 2, -1, 0, 3, 2],  # grouped, base rows between, mixed ranks, a subset adapter
        [-1, 2, 2, 2, -1],  # one slot, contiguous rows: the view path
        [3, -1, 3, 1],  # grouped, one subset slot spread out
    ],
    ids=["mixed", "view_path", "subset_spread"],
)
def test_bank_path_equals_reference_loop(slot_mix):
    m = make_model("qwen2", max_loras=6, max_rank=8)
    add(m, {"a": (2, 5), "b": (8, 12.3), "c": (3, 7), "qv": (6, 9, ["q_proj", "v_proj"])})
    bank = m.new_bank()
    bank.set_adapter(5, m.adapter_state_dict("c"), m.peft_config("c"))  # a bank-only slot holding c
    ids, mask = batch(rows=len(slot_mix))
    fast = m(ids, attention_mask=mask, adapter_slots=slot_mix, lora_bank=bank).logits
    assert not fast.requires_grad
    with torch.no_grad():
        ref = m(ids, attention_mask=mask, adapter_slots=slot_mix, reference=True).logits
        base = m(ids, attention_mask=mask).logits
    ref_bank = m(ids, attention_mask=mask, adapter_slots=slot_mix, lora_bank=bank, reference=True).logits
    torch.testing.assert_close(fast, ref, **TOL)
    torch.testing.assert_close(fast, ref_bank, **TOL)
    base_rows = [i for i, s in enumerate(slot_mix) if s == -1]
    lora_rows = [i for i, s in enumerate(slot_mix) if s != -1]
    torch.testing.assert_close(fast[base_rows], base[base_rows], atol=0, rtol=0)
    assert not torch.allclose(fast[lora_rows], base[lora_rows], atol=1e-3)
    # The bank-only slot 5 holds c: rows routed to it equal rows routed to c's own slot 2.
    moved = [5 if s == 2 else s for s in slot_mix]
    torch.testing.assert_close(m(ids, attention_mask=mask, adapter_slots=moved, lora_bank=bank).logits, fast, **TOL)


def test_attach_slot_grads_refuses_parameters_of_another_slot_even_before_any_backward():
    m = make_model("qwen2", max_loras=3)
    m.add_adapter("a", rank=2, alpha=4, seed=0)
    m.add_adapter("b", rank=2, alpha=4, seed=1)
    with pytest.raises(ValueError, match="do not alias its slot"):
        m.attach_slot_grads("a", m.adapter_parameters("b"))
    m.attach_slot_grads("a", m.adapter_parameters("a"))  # its own views: fine, no grads yet


def test_a_model_wholly_in_bf16_runs_the_grouped_path_and_tracks_the_fp32_loop():
    """A base *and* LoRA in bf16 (`model.to(torch.bfloat16)`): the fp32 per-row scales must not promote the product
    to fp32 (bmm refuses mixed dtypes; first seen on an H100 in the expert test). Values and grads track the same
    model's float32 loop to bf16 tolerance; every grad stays bf16."""
    names = ["a", None, "b", "c", "a", "c"]
    m = make_model()
    add(m, {"a": (3, 5), "b": (8, 12.3), "c": (5, 7)})
    ids, mask = batch(rows=len(names))
    m.zero_lora_grads()
    want = m(ids, attention_mask=mask, adapter_names=names, reference=True).logits
    mixed_loss(want, ids, names).backward()
    want_grads = cloned_grads(m, ["a", "b", "c"])
    m.base_model.to(torch.bfloat16)
    m.zero_lora_grads()
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            got = m(ids, attention_mask=mask, adapter_names=names).logits
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.05)
        if grad:
            mixed_loss(got.float(), ids, names).backward()
    for name, grads in cloned_grads(m, ["a", "b", "c"]).items():
        for g, w in zip(grads, want_grads[name], strict=True):
            if w is None:
                continue
            assert g.dtype == torch.bfloat16
            torch.testing.assert_close(g.float(), w, atol=2e-2, rtol=0.1)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_one_slot_batch_equals_the_same_rows_in_a_mixed_batch_bit_for_bit(family):
    """Training with every row on an adapter (`_LinearLoRA`): a batch of one slot reads that slot as a stride-0 view
    (no per-row copy), a mixed batch gathers each row's slot. Both compute each row's products with the same GEMMs,
    so a tenant's logits and gradients do not depend on who shares its batch, to the bit (to float rounding where
    the machine's own matrix products are not: `tiny_models.gemm_rows_independent`)."""
    m = make_model(family)
    add(m, {"a": (4, 9), "b": (4, 5)})
    ids, _ = batch(rows=6, length=7, seed=3, left_pad=False)
    names = ["a", "b", "a", "a", "b", "b"]
    m.zero_grad(set_to_none=True)
    mixed = m(ids, adapter_names=names).logits
    per_adapter_loss(mixed, ids, names, "a").backward()
    mixed_grads = cloned_grads(m, ["a"])["a"]
    rows = [i for i, n in enumerate(names) if n == "a"]
    m.zero_grad(set_to_none=True)
    alone = m(ids[rows], adapter_names=["a"] * len(rows)).logits
    per_adapter_loss(alone, ids[rows], ["a"] * len(rows), "a").backward()
    assert_same_bits(alone, mixed[rows])
    alone_grads = cloned_grads(m, ["a"])["a"]
    assert len(alone_grads) == len(mixed_grads) > 0
    for g, h in zip(alone_grads, mixed_grads, strict=True):
        assert_same_bits(g, h)
    assert any(torch.count_nonzero(g) > 0 for g in alone_grads)


class _ProductDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the operand dtypes of every matrix product over more than one term (the rotary embedding's float32
    outer product, over one, is left out): the base's Linears and attention, and the LoRA's products, the CPU
    kernels' (`cpu_kernels.forward` / `backward`, outside torch's dispatch) included."""

    OPS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2), "baddbmm_": (1, 2), "linear": (0, 1)}

    def __init__(self):
        super().__init__()
        self.seen: set[torch.dtype] = set()
        self._patches: list = []

    def __enter__(self):
        from rl_multilora.lora import cpu_kernels

        for name in ("forward", "backward"):
            real = getattr(cpu_kernels, name)

            def spied(*args, _real=real, **kwargs):
                self.seen.update(a.dtype for a in args[:4] if isinstance(a, torch.Tensor))
                return _real(*args, **kwargs)

            self._patches.append((cpu_kernels, name, real))
            setattr(cpu_kernels, name, spied)
        return super().__enter__()

    def __exit__(self, *exc):
        for module, name, real in self._patches:
            setattr(module, name, real)
        self._patches.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        which = self.OPS.get(func.overloadpacket.__name__)
        if which is not None and args[which[0]].shape[-1] > 1:
            self.seen.update(args[i].dtype for i in which)
        return func(*args, **(kwargs or {}))


AUTOCAST_MIXES = {
    "one_slot": ["a"] * 4,
    "mixed": ["a", "b", "c", "a", "c"],
    "base_rows_mixed_in": ["a", None, "b", "c", "a", "c"],
}


@pytest.mark.parametrize("mix", list(AUTOCAST_MIXES))
def test_lora_autocast_computes_in_the_base_dtype_and_tracks_the_fp32_loop(mix):
    """`lora_autocast` on a bf16 base with float32 slots: every product runs in bf16 (with it off, the LoRA's in float32),
    in training (`_LinearLoRA`; `_GroupedLoRA` with base rows) and inference alike; values and grads track the float32
    loop to bf16 tolerance; the slots and their grads stay float32."""
    check_lora_autocast(AUTOCAST_MIXES[mix], "cpu")


@pytest.mark.gpu
def test_lora_autocast_on_cuda():
    """The same on a GPU, where the option is meant to pay (fewer passes over activations than float32 products)."""
    for names in AUTOCAST_MIXES.values():
        check_lora_autocast(names, "cuda")


def check_lora_autocast(names, device):
    used = sorted({n for n in names if n is not None})
    m = make_model()
    add(m, {"a": (3, 5), "b": (8, 12.3), "c": (5, 7)})
    m.to(device)
    # no left padding: on CUDA, transformers lets a fully masked query row attend to every key (SDPA), so a padded
    # position's logits are arbitrary; in run 12 of the GPU check (H100) the largest bf16 vs float32 differences,
    # 0.29, were at a padded position (row 1, position 0)
    ids, mask = (t.to(device) for t in batch(rows=len(names), left_pad=False))
    m.zero_lora_grads()
    want = m(ids, attention_mask=mask, adapter_names=names, reference=True).logits
    mixed_loss(want, ids, names).backward()
    want_grads = cloned_grads(m, used)
    bf16_base(m)
    outputs = {}
    for autocast in (False, True):
        m.lora_autocast = autocast
        m.zero_lora_grads()
        for grad in (True, False):
            spy = _ProductDtypes()
            with torch.set_grad_enabled(grad), spy:
                got = m(ids, attention_mask=mask, adapter_names=names).logits
                if grad:
                    mixed_loss(got.float(), ids, names).backward()
            # the base's products are bf16 either way; the LoRA's are float32 unless autocast
            assert spy.seen == ({torch.bfloat16} if autocast else {torch.bfloat16, torch.float32}), (autocast, grad)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.05)
            outputs[autocast, grad] = got.detach()
        for name, grads in cloned_grads(m, used).items():
            assert any(torch.count_nonzero(g) > 0 for g in grads)
            for g, w in zip(grads, want_grads[name], strict=True):
                assert g.dtype == torch.float32
                torch.testing.assert_close(g, w, atol=2e-2, rtol=0.1)
    assert not torch.equal(outputs[False, True], outputs[True, True])  # autocast does round differently


@pytest.mark.parametrize("autocast", [False, True], ids=["float32_products", "autocast"])
def test_float32_slots_over_a_bf16_base_one_slot_batch_equals_the_same_rows_in_a_mixed_batch_bit_for_bit(autocast):
    """Isolation holds over a bf16 base with float32 slots, in float32 products (PEFT's default) or bf16 ones
    (autocast): a tenant's numbers do not depend on who shares its batch (to the bit where the machine's matrix
    products allow it, `tiny_models.gemm_rows_independent`)."""
    m = MultiLoRAModel.from_model(tiny_model("llama"), 8, 8, lora_autocast=autocast)
    add(m, {"a": (4, 9), "b": (4, 5)})
    bf16_base(m)
    ids, _ = batch(rows=6, length=7, seed=3, left_pad=False)
    names = ["a", "b", "a", "a", "b", "b"]
    rows = [i for i, n in enumerate(names) if n == "a"]
    results = []
    for batch_ids, batch_names in ((ids, names), (ids[rows], ["a"] * len(rows))):
        m.zero_grad(set_to_none=True)
        logits = m(batch_ids, adapter_names=batch_names).logits
        per_adapter_loss(logits.float(), batch_ids, batch_names, "a").backward()
        results.append((logits.detach(), cloned_grads(m, ["a"])["a"]))
    (mixed, mixed_grads), (alone, alone_grads) = results
    assert_same_bits(alone, mixed[rows])
    assert len(alone_grads) == len(mixed_grads) > 0
    for g, h in zip(alone_grads, mixed_grads, strict=True):
        assert g.dtype == torch.float32
        assert_same_bits(g, h)
    assert any(torch.count_nonzero(g) > 0 for g in alone_grads)


@pytest.mark.parametrize("names", [["a"] * 4, ["a", "b", "a", "b"]], ids=["one_slot", "mixed"])
def test_float32_lora_over_a_bf16_base_trains_in_one_node_and_saves_less(names, monkeypatch):
    """PEFT's default dtypes (float32 slots, bf16 base) in training: `_LinearLoRA` with `compute=float32` gives the
    unfused path's logits bit for bit (the casts, the base Linear and `_GroupedLoRA` as separate autograd nodes) and
    its gradients to bf16 rounding (one node sums a Linear's base and LoRA input gradients before autograd sums those
    of q, k and v: another association of the same bf16 terms), and keeps each LoRA Linear's input in bf16 for the
    backward instead of a float32 copy (one slot: a view of it, not a per-row copy)."""
    m = make_model()
    add(m, {"a": (3, 5), "b": (8, 12.3)})
    bf16_base(m)
    ids, _ = batch(rows=len(names), left_pad=False)
    with torch.no_grad():
        embeds = m.base_model.get_input_embeddings()(ids)

    def step():
        m.zero_lora_grads()
        x = embeds.detach().requires_grad_()
        saved = {}  # storage -> bytes: a tensor saved by several nodes (q, k and v's input) is held once
        params = {p.untyped_storage().data_ptr() for p in m.parameters()}  # held anyway (a slot's view, W)

        def pack(t):
            if isinstance(t, torch.Tensor) and (ptr := t.untyped_storage().data_ptr()) not in params:
                saved[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = m(inputs_embeds=x, adapter_names=names).logits
        mixed_loss(logits.float(), ids, names).backward()
        return logits.detach(), cloned_grads(m, ["a", "b"]), x.grad, sum(saved.values())

    calls = []
    fused = LoRALinear._linear_lora
    monkeypatch.setattr(LoRALinear, "_linear_lora", lambda self, x, r: calls.append(1) or fused(self, x, r))
    one = step()
    assert len(calls) == len(lora_layers(m))  # every LoRA Linear took the fused node
    monkeypatch.setattr(LoRALinear, "_linear_lora", lambda self, x, r: None)  # the unfused path
    other = step()
    assert torch.equal(one[0], other[0])
    torch.testing.assert_close(one[2], other[2], atol=1e-2, rtol=0.05)
    for name in ("a", "b") if "b" in names else ("a",):
        grads = [(g, h) for g, h in zip(one[1][name], other[1][name], strict=True) if h is not None]
        assert grads and all(g.dtype == torch.float32 for g, _ in grads)
        assert any(torch.count_nonzero(g) > 0 for g, _ in grads)
        for g, h in grads:
            torch.testing.assert_close(g, h, atol=5e-3, rtol=0.05)
    # bytes saved for the backward, parameters left out. The CPU kernels save the used slots' weights, not a copy per
    # row, on either path: one slot 0.72x, mixed 0.77x (the input in bf16, not float32). The torch path: one slot
    # 0.47x (a view of the slot against per-row copies), mixed 0.83x (the per-row slot copies stay).
    if cpu_kernels.usable(lora_layers(m)[0].lora_A):
        limit = 0.8
    else:
        limit = 0.5 if len(set(names)) == 1 else 0.9
    assert one[3] < limit * other[3], (one[3], other[3])


def _dtype_model(setting: str, device="cpu") -> MultiLoRAModel:
    m = MultiLoRAModel.from_model(tiny_model("llama"), 4, 8, lora_autocast=setting == "bf16_base_autocast")
    add(m, {"a": (8, 16), "low": (3, 7)})  # a at the max rank; low below it (its padding must stay exact zeros)
    return (m if setting == "float32" else bf16_base(m)).to(device)


class _KernelOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that compute (launch a kernel on a GPU): every op but views, metadata and autograd's detaches."""

    FREE = {"view", "_unsafe_view", "transpose", "t", "slice", "select", "expand", "detach", "alias", "lift_fresh",
            "as_strided", "unsqueeze", "squeeze", "reshape", "permute", "_reshape_alias"}  # fmt: skip

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.FREE:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


# what one LoRA Linear adds to a training forward+backward on a one-slot batch, on CPU: the 2 products each way and
# the 2 weight-gradient products; per product of a row-scaled rank the scale, applied in place (one kernel with the
# rounding); 2 zero-filled gradients and their index_add_, and B's through a contiguous sum and a copy (CUDA adds
# into B's transposed view: 2 ops fewer); the casts of PEFT's default dtypes (the input each way, grad, the LoRA's
# input gradient) or of autocast (the slots each forward, the weight gradients to float32); on CPU the slot's B.T
# made contiguous once per forward (`clone`: the layout of a gathered row)
_B_GRAD_ON_CPU = {"new_zeros": 3, "index_add_": 2, "copy_": 1, "clone": 1}
LORA_OPS_PER_LINEAR = {
    "float32": {"bmm": 4, "baddbmm_": 2, "mul_": 2, **_B_GRAD_ON_CPU},
    "bf16_base_float32_slots": {"bmm": 6, "add_": 2, "mul_": 2, "_to_copy": 4, **_B_GRAD_ON_CPU},
    "bf16_base_autocast": {"bmm": 4, "baddbmm_": 2, "mul_": 2, "_to_copy": 4, **_B_GRAD_ON_CPU},
}


# the same on CUDA (`one_gemm_weight_grads`): each weight gradient one `mm` over all tokens, no zero-fill or index_add_
LORA_OPS_PER_LINEAR_ONE_GEMM = {
    "float32": {"bmm": 2, "baddbmm_": 2, "mul_": 2, "mm": 2},
    "bf16_base_float32_slots": {"bmm": 4, "add_": 2, "mul_": 2, "mm": 2, "_to_copy": 4},
    "bf16_base_autocast": {"bmm": 2, "baddbmm_": 2, "mul_": 2, "mm": 2, "_to_copy": 4},
}


@pytest.mark.parametrize("one_gemm", [False, True], ids=["cpu_path", "cuda_path"])
@pytest.mark.parametrize("dtypes", list(LORA_OPS_PER_LINEAR))
def test_ops_a_lora_linear_adds_to_a_training_step(dtypes, one_gemm, monkeypatch):
    """On a GPU a small model's training step is bound by launching kernels (the GPU check's profile: the H100 busy
    40 ms of a 426 ms step), so the ops each LoRA Linear adds are its cost there: this pins them per dtype setting,
    one slot, with per-slot gradients in a sink as the trainer keeps them; on the CPU path and on the one CUDA
    takes for a one-slot batch's weight gradients (forced on here)."""
    import rl_multilora.lora.layer as layer_mod

    monkeypatch.setattr(layer_mod, "_kernels", lambda *tensors: False)  # the torch path (CUDA's; a CPU without them)
    monkeypatch.setattr(layer_mod, "one_gemm_weight_grads", lambda t: one_gemm)
    monkeypatch.setattr(layer_mod, "_copy_slot_b", lambda t: not one_gemm)  # as CUDA does on its path
    if one_gemm:  # CUDA's thin products are token-major (`_shrink`)
        monkeypatch.setattr(layer_mod, "_rank_major_floor", lambda *shape: None)
    m = _dtype_model(dtypes)
    m.use_slot_grads()
    ids, _ = batch(rows=4, length=16, left_pad=False)  # rows past the rank-major floor (12 here): no padding
    with torch.no_grad():
        embeds = m.base_model.get_input_embeddings()(ids)
    counts = {}
    for names in ([None] * 4, ["a"] * 4, ["a"] * 4):  # a first step on the adapter probes `_rank_major_floor`
        m.zero_lora_grads()
        with _KernelOps() as spy:
            x = embeds.detach().requires_grad_()
            m(inputs_embeds=x, adapter_names=names).logits.float().logsumexp(-1).mean().backward()
        counts[names[0]] = spy.ops
    extra = counts["a"] - counts[None]
    n = len(lora_layers(m))
    want = (LORA_OPS_PER_LINEAR_ONE_GEMM if one_gemm else LORA_OPS_PER_LINEAR)[dtypes]
    assert {op: c / n for op, c in extra.items()} == want


def _one_slot_grads(m, ids, names, sink):
    if sink:
        m.use_slot_grads()
    m.zero_lora_grads()
    logits = m(ids, adapter_names=names).logits
    per_adapter_loss(logits.float(), ids, names, names[0]).backward()
    return logits.detach(), cloned_grads(m, [names[0]])[names[0]]


@pytest.mark.parametrize("sink", [False, True], ids=["stacked_grads", "sink"])
@pytest.mark.parametrize("setting", list(LORA_OPS_PER_LINEAR))
@pytest.mark.parametrize("adapter", ["a", "low"])
def test_one_gemm_weight_grads_of_a_one_slot_batch_track_the_per_row_path(adapter, setting, sink, monkeypatch):
    """The CUDA path for a one-slot batch's A and B gradients (one GEMM over all tokens, `one_gemm_weight_grads`),
    forced on here on CPU: its gradients equal the per-row path's to rounding (the same sums, another order), the
    logits are untouched, the ranks above the adapter's stay exactly zero, and no other slot gets a gradient."""
    import rl_multilora.lora.layer as layer_mod

    monkeypatch.setattr(layer_mod, "_kernels", lambda *tensors: False)  # two torch paths, CUDA's and the per-row one
    m = _dtype_model(setting)
    ids, _ = batch(rows=5, length=6, left_pad=False)
    names = [adapter] * 5
    want_logits, want = _one_slot_grads(m, ids, names, sink)
    calls = []
    monkeypatch.setattr(layer_mod, "one_gemm_weight_grads", lambda t: calls.append(1) or True)
    got_logits, got = _one_slot_grads(m, ids, names, sink)
    assert len(calls) == len(lora_layers(m))
    assert torch.equal(got_logits, want_logits)
    tol = dict(atol=1e-6, rtol=1e-5) if setting == "float32" else dict(atol=1e-4, rtol=2e-2)
    rank = m.adapters[adapter].rank
    assert len(got) == len(want) > 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype == torch.float32
        torch.testing.assert_close(g, w, **tol)
        above = g[rank:] if i % 2 == 0 else g[:, rank:]  # A (R, in), then B (out, R), per module
        assert torch.count_nonzero(above) == 0
    assert any(torch.count_nonzero(g) > 0 for g in got)
    other = "low" if adapter == "a" else "a"
    assert all(g is None or torch.count_nonzero(g) == 0 for g in cloned_grads(m, [other])[other])


@pytest.mark.gpu
@pytest.mark.parametrize("setting", list(LORA_OPS_PER_LINEAR))
def test_on_cuda_a_tenant_alone_matches_it_mixed_to_rounding_and_one_slot_grads_repeat(setting):
    """On CUDA, isolation holds to float tolerance (DESIGN's contract), not to the bit as on CPU: cuBLAS picks kernels
    by the batch's size and `index_add_` of more than 16 rows adds with atomics (the GPU check's probe, H100). A
    one-slot batch's gradients (one GEMM each, no atomics) repeat bit for bit."""
    m = _dtype_model(setting, "cuda")
    m.use_slot_grads()
    ids, _ = batch(rows=40, length=16, seed=3, left_pad=False)
    ids = ids.cuda()
    names = ["a", "low"] * 20
    rows = [i for i, n in enumerate(names) if n == "a"]
    mixed_logits, mixed = _one_slot_grads(m, ids, names, True)
    alone_logits, alone = _one_slot_grads(m, ids[rows], ["a"] * len(rows), True)
    again_logits, again = _one_slot_grads(m, ids[rows], ["a"] * len(rows), True)
    assert torch.equal(alone_logits, again_logits)
    assert all(torch.equal(g, h) for g, h in zip(alone, again, strict=True))
    tol = dict(atol=1e-5, rtol=1e-4) if setting == "float32" else dict(atol=0.25, rtol=0.05)
    torch.testing.assert_close(alone_logits.float(), mixed_logits[rows].float(), **tol)
    for g, h in zip(alone, mixed, strict=True):
        torch.testing.assert_close(g, h, atol=1e-4 if setting == "float32" else 5e-3, rtol=0.05)


def test_a_one_slot_batch_equals_the_same_rows_in_a_mixed_batch_at_a_real_width():
    """The same property at SmolLM2-like widths (hidden 576, MLP 1,152, rank 8, 64-token rows), bit for bit on every
    machine: a one-slot batch's B.T is made contiguous as a gathered row's is, so each row's products are the same
    GEMM in the same layout. (Reading B as stored, a stride-0 view of its transpose, took MKL's other kernel at these
    widths: A's gradients differed from the mixed batch's by up to 5e-8 on the AMD machine, 2026-11-29.)"""
    m = MultiLoRAModel.from_model(tiny_model("llama", hidden=576, layers=1, heads=8), 4, 8, "all-linear")
    add(m, {"a": (8, 16), "b": (8, 16)})
    ids, _ = batch(rows=6, length=64, seed=5, left_pad=False)
    names = ["a", "b", "a", "a", "b", "b"]
    rows = [i for i, n in enumerate(names) if n == "a"]
    results = []
    for sub_ids, sub_names in ((ids, names), (ids[rows], ["a"] * len(rows))):
        m.zero_grad(set_to_none=True)
        logits = m(sub_ids, adapter_names=sub_names).logits
        per_adapter_loss(logits, sub_ids, sub_names, "a").backward()
        mine = logits[rows] if len(sub_names) == len(names) else logits
        results.append((mine.detach(), [g for g in cloned_grads(m, ["a"])["a"] if g is not None]))
    (mixed, mixed_grads), (alone, alone_grads) = results
    assert torch.equal(alone, mixed)
    assert len(alone_grads) == len(mixed_grads) == 14
    for g, h in zip(alone_grads, mixed_grads, strict=True):
        assert torch.equal(g, h), float((g - h).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [40, 192, 576])
def test_the_thin_product_gives_a_token_the_same_bits_whatever_its_rows_length(width, dtype):
    """`_shrink` (the LoRA's `x @ A.T` and `grad @ B`): on CPU rank-major with rows shorter than the probed floor
    zero-padded up to it, so a token's values are the same bits in a row of any length (a tenant's numbers must not
    follow its micro-batch's padding), and they are the product's to float rounding."""
    from rl_multilora.lora.layer import _shrink

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 80, width, generator=g).to(dtype)
    w = torch.randn(8, width, generator=g).to(dtype).expand(3, -1, -1)
    whole = _shrink(x, w)  # (3, 80, 8)
    torch.testing.assert_close(whole.double(), x.double() @ w[0].double().T, rtol=0.02, atol=0.05 * width**0.5)
    for length in range(1, 80):
        part = _shrink(x[:, :length], w)
        assert part.shape == (3, length, 8)
        assert torch.equal(part, whole[:, :length]), length


def test_the_floor_probe_measures_its_own_dtype_under_autocast():
    """First probed inside a CPU autocast, the float32 probe ran in bf16 and cached bf16's floor (1) for float32."""
    import rl_multilora.lora.layer as layer_mod

    key = (8, 200, torch.float32)
    layer_mod._FLOORS.pop(key, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = layer_mod._rank_major_floor(*key)
    layer_mod._FLOORS.pop(key, None)
    assert inside == layer_mod._rank_major_floor(*key)
