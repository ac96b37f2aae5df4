"""MultiLoRAModel against PEFT (the oracle for the math and the file format) and against its own float32 loop.

Every model is a tiny random Qwen2 / Qwen3 / Llama built offline in float32, so tolerances are tight.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from tiny_models import FAMILIES, save_tiny_model, tiny_model

from rl_multilora.lora import (
    AdapterInfo,
    LoRABank,
    MultiLoRAModel,
    UnknownAdapterError,
    read_peft_folder,
    validate_adapter_name,
    write_peft_folder,
)
from rollout.engines.embedded import kv_cache_kwarg

VOCAB = 128
TOL = dict(atol=2e-5, rtol=1e-5)


def make_model(family="qwen2", max_loras=4, max_rank=8, target_modules="all-linear", **kw) -> MultiLoRAModel:
    return MultiLoRAModel.from_model(tiny_model(family, **kw), max_loras, max_rank, target_modules)


def randomize(m: MultiLoRAModel, name: str, seed: int) -> None:
    """Give the adapter non-zero B (and a new A) at its true rank; the padding is left as it is (zero)."""
    g = torch.Generator().manual_seed(seed)
    s, r = m.slot_of(name), m.adapters[name].rank
    with torch.no_grad():
        for layer in m.base_model.modules():
            if hasattr(layer, "lora_A"):
                a, b = layer.lora_A[s], layer.lora_B[s]
                a[:r].copy_(torch.randn(a[:r].shape, generator=g) * 0.1)
                b[:, :r].copy_(torch.randn(b[:, :r].shape, generator=g) * 0.1)


def batch(rows=6, length=7, seed=0, left_pad=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    if left_pad:
        mask[1, :2] = 0  # a left-padded row: the mask has to pass through to HF untouched
    return ids, mask


def peft_logits(family, adapter_sd, config, ids, mask):
    """Logits of PEFT's own LoRA (get_peft_model + set_peft_model_state_dict) on a fresh copy of the base."""
    peft_model = get_peft_model(tiny_model(family), config)
    result = set_peft_model_state_dict(peft_model, adapter_sd)
    assert not result.unexpected_keys
    missing = [k for k in result.missing_keys if "lora_" in k]
    assert not missing, missing
    with torch.no_grad():
        return peft_model(input_ids=ids, attention_mask=mask).logits


def add_three(m: MultiLoRAModel) -> dict[str, int]:
    """Three adapters of different ranks (one with a scale 32/6 that is not a short binary fraction)."""
    specs = {"a": (2, 4), "b": (8, 16), "c": (6, 32)}
    for i, (name, (rank, alpha)) in enumerate(specs.items()):
        m.add_adapter(name, rank=rank, alpha=alpha, seed=i)
        randomize(m, name, seed=10 + i)
    return {name: m.slot_of(name) for name in specs}


# ---------------------------------------------------------------------------------------------------------------
# PEFT as the oracle


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj", "down_proj"]])
def test_mixed_batch_matches_peft_per_row(family, targets):
    m = make_model(family, target_modules=targets)
    add_three(m)
    ids, mask = batch()
    names = ["a", None, "b", "c", "a", None]
    with torch.no_grad():
        logits = m(ids, attention_mask=mask, adapter_names=names).logits
        base = tiny_model(family)(input_ids=ids, attention_mask=mask).logits
    for i, name in enumerate(names):
        if name is None:
            torch.testing.assert_close(logits[i], base[i], **TOL)
    for name, info in m.adapters.items():
        config = LoraConfig(r=info.rank, lora_alpha=info.alpha, target_modules=targets, lora_dropout=0.0)
        expected = peft_logits(family, m.adapter_state_dict(name), config, ids, mask)
        rows = [i for i, n in enumerate(names) if n == name]
        torch.testing.assert_close(logits[rows], expected[rows], **TOL)
        assert not torch.allclose(expected[rows], base[rows], atol=1e-3)  # the adapter does change the output


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj", "down_proj"]])
def test_export_loads_in_peft_and_peft_folder_loads_here(family, targets, tmp_path):
    m = make_model(family, target_modules=targets)
    add_three(m)
    ids, mask = batch()
    with torch.no_grad():
        ours = {n: m(ids, attention_mask=mask, adapter_names=[n] * len(ids)).logits for n in m.adapters}

    # Our export -> PeftModel.from_pretrained.
    for name, info in m.adapters.items():
        folder = m.export_adapter(name, tmp_path / "ours" / name)
        config = json.loads((folder / "adapter_config.json").read_text())
        assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", info.rank, info.alpha)
        peft_model = PeftModel.from_pretrained(tiny_model(family), str(folder))
        with torch.no_grad():
            torch.testing.assert_close(peft_model(input_ids=ids, attention_mask=mask).logits, ours[name], **TOL)

    # A folder written by PEFT's save_pretrained (random A and B) -> load_adapter.
    peft_model = get_peft_model(
        tiny_model(family), LoraConfig(r=3, lora_alpha=5, target_modules=targets, init_lora_weights=False)
    )
    peft_model.save_pretrained(str(tmp_path / "peft"))
    m.remove_adapter("b")
    slot = m.load_adapter("p", tmp_path / "peft")
    assert slot == 1 and m.adapters["p"] == AdapterInfo("p", 1, 3, 5)
    with torch.no_grad():
        expected = peft_model(input_ids=ids, attention_mask=mask).logits
        got = m(ids, attention_mask=mask, adapter_names=["p", None, "a", "p", "c", "p"]).logits
    torch.testing.assert_close(got[[0, 3, 5]], expected[[0, 3, 5]], **TOL)
    torch.testing.assert_close(got[2], ours["a"][2], **TOL)
    # The round trip keeps every tensor bit for bit.
    reloaded = get_peft_model_state_dict(peft_model)
    ours_sd = m.adapter_state_dict("p")
    assert ours_sd.keys() == reloaded.keys()
    for key, tensor in reloaded.items():
        assert torch.equal(ours_sd[key], tensor), key


def test_write_peft_folder_from_tensors_and_config(tmp_path):
    """Code outside the model writes a PEFT folder from tensors + config; it reads back as export_adapter's does."""
    m = make_model("qwen2", target_modules=["q_proj", "v_proj"])
    m.add_adapter("a", rank=4, alpha=8, seed=0)
    randomize(m, "a", seed=1)
    sd, config = m.adapter_state_dict("a"), m.peft_config("a")
    folder = write_peft_folder(tmp_path / "w", sd, config)
    exported = m.export_adapter("a", tmp_path / "e")
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        assert (folder / f).read_bytes() == (exported / f).read_bytes(), f
    got_sd, got_config = read_peft_folder(folder)
    assert got_config == config and got_sd.keys() == sd.keys()
    assert all(torch.equal(got_sd[k], v) for k, v in sd.items())
    # Checked with the readers' rules before anything is written.
    key = next(k for k in sd if k.endswith("lora_B.weight"))
    for bad_sd, bad_config, message in [
        (sd, {**config, "use_dora": True}, "use_dora=True is not allowed"),
        (sd, {**config, "r": 2}, r"has shape \(4, 32\); expected \(2, 32\)"),
        ({k: v for k, v in sd.items() if k != key}, config, "has no lora_B tensor"),
        ({**sd, "lm_head.weight": sd[key]}, config, "unexpected key 'lm_head.weight'"),
    ]:
        with pytest.raises(ValueError, match=message):
            write_peft_folder(tmp_path / "bad", bad_sd, bad_config)
        assert not (tmp_path / "bad").exists()


def test_peft_folder_covering_a_subset_of_modules(tmp_path):
    """A q_proj/v_proj PEFT adapter on an all-linear model: only those modules get its LoRA, export keeps it so."""
    m = make_model("qwen2")
    peft_model = get_peft_model(
        tiny_model("qwen2"),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    peft_model.save_pretrained(str(tmp_path / "peft"))
    m.load_adapter("qv", tmp_path / "peft")
    assert len(m.adapter_parameters("qv")) == 2 * 2 * 2  # (A, B) x (q, v) x 2 layers
    ids, mask = batch()
    with torch.no_grad():
        expected = peft_model(input_ids=ids, attention_mask=mask).logits
        got = m(ids, attention_mask=mask, adapter_names=["qv", None] * 3).logits
        got_ref = m(ids, attention_mask=mask, adapter_names=["qv", None] * 3, reference=True).logits
    torch.testing.assert_close(got[::2], expected[::2], **TOL)
    torch.testing.assert_close(got, got_ref, **TOL)
    assert m.peft_config("qv")["target_modules"] == ["q_proj", "v_proj"]
    folder = m.export_adapter("qv", tmp_path / "again")
    again = PeftModel.from_pretrained(tiny_model("qwen2"), str(folder))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids, attention_mask=mask).logits, expected, **TOL)


def test_add_adapter_on_a_subset_of_modules_trains_and_exports_only_those(tmp_path):
    """add_adapter(target_modules=[q_proj, v_proj]) on an all-linear model: only q/v are covered, trained, exported."""
    m = make_model("qwen2")
    m.add_adapter("full", rank=4, alpha=8, seed=3)
    m.add_adapter("qv", rank=4, alpha=8, seed=3, target_modules=["q_proj", "v_proj"])
    params = m.adapter_parameters("qv")
    assert len(params) == 2 * 2 * 2  # (A, B) x (q, v) x 2 layers
    full = m.adapter_state_dict("full")
    before = m.adapter_state_dict("qv")
    for k, v in before.items():  # same seed: the covered modules start from the full adapter's init
        torch.testing.assert_close(v, full[k], rtol=0, atol=0)
    ids, mask = batch()
    names = ["qv"] * ids.shape[0]
    loss = m(ids, attention_mask=mask, adapter_names=names).logits.square().mean()
    loss.backward()
    m.attach_slot_grads("qv", params)  # the backward filled the stacked grads; the views now see their slot's part
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    opt.step()
    sd = m.adapter_state_dict("qv")
    assert {k.split(".")[-3] for k in sd} == {"q_proj", "v_proj"}
    assert all(not torch.equal(v, before[k]) for k, v in sd.items())  # every covered tensor trained
    folder = m.export_adapter("qv", tmp_path / "qv")
    again = PeftModel.from_pretrained(tiny_model("qwen2"), str(folder))
    with torch.no_grad():
        expected = again(input_ids=ids, attention_mask=mask).logits
        got = m(ids, attention_mask=mask, adapter_names=names).logits
    torch.testing.assert_close(got, expected, **TOL)
    with pytest.raises(ValueError, match="matches none"):
        m.add_adapter("bad", rank=2, alpha=4, target_modules=["nope_proj"])


def test_bf16_base_matches_peft_with_fp32_scale():
    """bf16 base, fp32 LoRA: scale 32/24 is applied in fp32 like PEFT (autocast_adapter_dtype), not rounded."""
    base = tiny_model("qwen2").to(torch.bfloat16)
    m = MultiLoRAModel.from_model(base, max_loras=2, max_rank=24)
    m.add_adapter("a", rank=24, alpha=32, seed=0)
    randomize(m, "a", seed=1)
    assert m.adapter_parameters("a")[0].dtype == torch.float32
    ids, mask = batch()
    peft_model = get_peft_model(
        tiny_model("qwen2").to(torch.bfloat16), LoraConfig(r=24, lora_alpha=32, target_modules="all-linear")
    )
    set_peft_model_state_dict(peft_model, m.adapter_state_dict("a"))
    with torch.no_grad():
        got = m(ids, attention_mask=mask, adapter_names=["a"] * 6).logits
        expected = peft_model(input_ids=ids, attention_mask=mask).logits
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# Fast path against the float32 loop reference


# Rows grouped by adapter take the contiguous (view) path, the others the permuted (gather/scatter) path.
MIXES = {
    "one_adapter": ["a"] * 6,
    "all_distinct": ["a", "b", "c", "d"],
    "skewed_grouped": ["b"] * 5 + ["d"],
    "grouped_with_base": [None, "a", None, "c", "c", None],
    "all_base": [None] * 3,
    "interleaved": ["a", "b", "a", "c", "b", "a"],
    "skewed_interleaved": ["b", "b", "d", "b", "b", "b"],
    "interleaved_with_base": ["c", None, "d", "c", None, "d"],
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_fast_path_equals_reference_values_and_grads(mix):
    m = make_model("qwen3", max_loras=6, max_rank=8)
    add_three(m)
    m.add_adapter("d", rank=1, alpha=3, seed=3)
    randomize(m, "d", seed=13)
    m.add_adapter("gone", rank=4, alpha=4, seed=4)
    m.remove_adapter("gone")  # an empty slot between occupied ones
    names = MIXES[mix]
    ids, mask = batch(rows=len(names), left_pad=len(names) > 1)
    results = []
    for reference in (False, True):
        m.zero_grad(set_to_none=True)
        logits = m(ids, attention_mask=mask, adapter_names=names, reference=reference).logits
        if logits.requires_grad:  # an all-base batch touches no LoRA tensor, so it has no graph at all
            logits.square().mean().backward()
        grads = {n: m.adapter_grads(n) for n in m.adapters}
        results.append((logits.detach(), grads))
    (fast, fast_grads), (ref, ref_grads) = results
    torch.testing.assert_close(fast, ref, **TOL)
    for name in m.adapters:
        for g_fast, g_ref in zip(fast_grads[name], ref_grads[name], strict=True):
            if name in names:
                torch.testing.assert_close(g_fast, g_ref, atol=1e-6, rtol=1e-5)
            else:  # slots without rows get exactly zero (the gather's backward adds only into used slots)
                assert g_fast is None or torch.count_nonzero(g_fast) == 0, name


# ---------------------------------------------------------------------------------------------------------------
# Gradients, slots, padding


def per_adapter_loss(logits, ids, names, adapter):
    """Mean next-token NLL over `adapter`'s rows only (GRPO normalizes per adapter the same way)."""
    rows = [i for i, n in enumerate(names) if n == adapter]
    logp = torch.log_softmax(logits[rows, :-1], dim=-1)  # (n_rows, T-1, V)
    return -logp.gather(-1, ids[rows, 1:, None]).mean()


def test_mixed_batch_grads_equal_each_adapter_alone():
    m = make_model("llama")
    add_three(m)
    m.add_adapter("idle", rank=4, alpha=8, seed=9)
    ids, mask = batch()
    names = ["a", "b", None, "a", "c", "b"]
    logits = m(ids, attention_mask=mask, adapter_names=names).logits
    sum(per_adapter_loss(logits, ids, names, n) for n in ("a", "b", "c")).backward()
    mixed = {n: [g.clone() for g in m.adapter_grads(n)] for n in ("a", "b", "c")}
    assert all(torch.count_nonzero(g) == 0 for g in m.adapter_grads("idle"))
    assert all(p.grad is None for p in m.base_model.parameters() if not p.requires_grad)
    assert not any(p.requires_grad for n, p in m.named_parameters() if "lora_" not in n)
    for name in ("a", "b", "c"):
        m.zero_grad(set_to_none=True)
        rows = [i for i, n in enumerate(names) if n == name]
        alone = m(ids[rows], attention_mask=mask[rows], adapter_names=[name] * len(rows)).logits
        per_adapter_loss(alone, ids[rows], [name] * len(rows), name).backward()
        for g_mixed, g_alone in zip(mixed[name], m.adapter_grads(name), strict=True):
            torch.testing.assert_close(g_mixed, g_alone, atol=1e-6, rtol=1e-5)
    r = m.adapters["a"].rank
    a_grad, b_grad = mixed["a"][:2]
    assert torch.count_nonzero(a_grad[r:]) == 0 and torch.count_nonzero(b_grad[:, r:]) == 0


def test_padding_stays_exactly_zero_under_adamw_and_only_the_trained_slot_moves():
    m = make_model("qwen2")
    add_three(m)
    before = {n: [p.detach().clone() for p in m.adapter_parameters(n)] for n in m.adapters}
    base_before = {n: p.detach().clone() for n, p in m.base_model.named_parameters() if "lora_" not in n}
    views = m.adapter_parameters("a")
    optim = torch.optim.AdamW(views, lr=1e-2, weight_decay=0.1)
    ids, mask = batch()
    names = ["a", "b", "a", None, "c", "a"]
    for _ in range(4):
        m.zero_lora_grads()
        logits = m(ids, attention_mask=mask, adapter_names=names).logits
        per_adapter_loss(logits, ids, names, "a").backward()
        m.attach_slot_grads("a", views)
        optim.step()
    r = m.adapters["a"].rank
    params = m.adapter_parameters("a")
    for a, b in zip(params[::2], params[1::2], strict=True):
        assert torch.count_nonzero(a[r:]) == 0 and torch.count_nonzero(b[:, r:]) == 0
    assert all(not torch.equal(p, q) for p, q in zip(params, before["a"], strict=True))
    for name in ("b", "c"):
        assert all(torch.equal(p, q) for p, q in zip(m.adapter_parameters(name), before[name], strict=True))
    assert all(torch.equal(p, base_before[n]) for n, p in m.base_model.named_parameters() if "lora_" not in n)


def test_slot_reuse_leaves_no_trace():
    m = make_model("qwen2", max_loras=2)
    m.add_adapter("old", rank=8, alpha=16, seed=0)
    randomize(m, "old", seed=1)
    ids, mask = batch()
    m(ids, attention_mask=mask, adapter_names=["old"] * 6).logits.sum().backward()
    m.remove_adapter("old")
    assert m.free_slots == [0, 1]
    slot = m.add_adapter("new", rank=4, alpha=8, seed=5)
    assert slot == 0
    fresh = make_model("qwen2", max_loras=2)
    fresh.add_adapter("new", rank=4, alpha=8, seed=5)
    for p, q in zip(m.adapter_parameters("new"), fresh.adapter_parameters("new"), strict=True):
        assert torch.equal(p, q)
    assert all(torch.count_nonzero(g) == 0 for g in m.adapter_grads("new"))  # the old tenant's grads are gone
    with torch.no_grad():  # B is zero again, so the new tenant starts exactly at the base model
        torch.testing.assert_close(
            m(ids, attention_mask=mask, adapter_names=["new"] * 6).logits,
            tiny_model("qwen2")(input_ids=ids, attention_mask=mask).logits,
            atol=0,
            rtol=0,
        )
    # The fresh A is PEFT's kaiming-uniform: U(-1/sqrt(in), 1/sqrt(in)) on the true rank, zero padding.
    a = m.adapter_parameters("new")[0]
    assert a[:4].abs().max() <= 1 / a.shape[1] ** 0.5 and a[:4].abs().min() > 0 and torch.count_nonzero(a[4:]) == 0


def test_base_state_dict_keys_unchanged_and_base_frozen():
    plain = tiny_model("qwen3")
    m = make_model("qwen3")
    base_keys = {k for k in m.base_model.state_dict() if "lora_" not in k}
    assert base_keys == set(plain.state_dict())
    assert not any(p.requires_grad for n, p in m.base_model.named_parameters() if "lora_" not in n)
    assert len(m.lora_modules) == 2 * 7 and "lm_head" not in m.lora_modules


def test_from_pretrained_folder_with_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    path = save_tiny_model(tmp_path / "base", family="llama")
    m = MultiLoRAModel.from_pretrained(path, max_loras=2, max_rank=4, target_modules=["q_proj", "o_proj"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tokenizer("Q: 2+2?\nA:")["input_ids"]])
    assert tokenizer.decode(ids[0]) == "Q: 2+2?\nA:" and int(ids.max()) < VOCAB
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, tiny_model("llama")(input_ids=ids).logits, atol=0, rtol=0)
    m.add_adapter("a", rank=4, alpha=8)
    assert m.peft_config("a")["base_model_name_or_path"] == str(path)
    assert m.peft_config("a")["target_modules"] == ["o_proj", "q_proj"]


# ---------------------------------------------------------------------------------------------------------------
# Bank and KV cache


def test_bank_matches_trainable_slots_and_is_independent_of_training():
    m = make_model("qwen2")
    slots = add_three(m)
    bank = m.new_bank()
    for slot in range(m.max_loras):
        bank.clear(slot)
    assert isinstance(bank, LoRABank) and not bank.is_set(slots["a"])
    for name, slot in slots.items():
        bank.set_adapter(slot, m.adapter_state_dict(name), m.peft_config(name))
    # A bank slot need not be the trainer's slot: adapter "c" also goes to bank slot 3.
    bank.set_adapter(3, m.adapter_state_dict("c"), m.peft_config("c"))
    ids, mask = batch()
    names = ["a", None, "b", "c", "a", "c"]
    bank_slots = torch.tensor([slots["a"], -1, slots["b"], slots["c"], slots["a"], 3])
    with torch.no_grad():
        trained = m(ids, attention_mask=mask, adapter_names=names).logits
    from_bank = m(ids, attention_mask=mask, adapter_slots=bank_slots, lora_bank=bank).logits
    assert not from_bank.requires_grad
    torch.testing.assert_close(from_bank, trained, **TOL)

    views = m.adapter_parameters("a")
    optim = torch.optim.AdamW(views, lr=1e-1)
    per_adapter_loss(m(ids, attention_mask=mask, adapter_names=names).logits, ids, names, "a").backward()
    m.attach_slot_grads("a", views)
    optim.step()
    with torch.no_grad():
        assert not torch.allclose(m(ids, attention_mask=mask, adapter_names=names).logits[0], trained[0])
    torch.testing.assert_close(m(ids, attention_mask=mask, adapter_slots=bank_slots, lora_bank=bank).logits, trained)


@pytest.mark.parametrize("use_bank", [False, True])
def test_kv_cache_decoding_with_mixed_slots_equals_full_forward(use_bank):
    m = make_model("qwen3")
    slots = add_three(m)
    ids, _ = batch(rows=3, length=9, left_pad=False)
    names = ["a", None, "c"]
    route = (
        dict(adapter_slots=[slots["a"], -1, slots["c"]], lora_bank=m.new_bank())
        if use_bank
        else dict(adapter_names=names)
    )
    with torch.no_grad():
        full = m(ids, **route).logits
        prefill = 5
        out = m(ids[:, :prefill], use_cache=True, **route)
        steps = [out.logits]
        past = out.past_key_values
        cache_kwarg = kv_cache_kwarg(m.base_model)
        for t in range(prefill, ids.shape[1]):
            out = m(ids[:, t : t + 1], **{cache_kwarg: past}, use_cache=True, **route)
            past = out.past_key_values
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)


# ---------------------------------------------------------------------------------------------------------------
# Errors


def test_adapter_lifecycle_errors():
    m = make_model("qwen2", max_loras=2)
    m.add_adapter("a", rank=4, alpha=8)
    with pytest.raises(UnknownAdapterError, match="unknown adapter 'zz'"):
        m.slot_of("zz")
    with pytest.raises(UnknownAdapterError, match="unknown adapter 'zz'"):
        m(torch.zeros(1, 3, dtype=torch.long), adapter_names=["zz"])
    with pytest.raises(UnknownAdapterError):
        m.remove_adapter("zz")
    with pytest.raises(ValueError, match="rank=9 is not allowed.*max_rank=8"):
        m.add_adapter("b", rank=9, alpha=8)
    with pytest.raises(ValueError, match="rank=0"):
        m.add_adapter("b", rank=0, alpha=8)
    with pytest.raises(ValueError, match="alpha=-1"):
        m.add_adapter("b", rank=2, alpha=-1)
    with pytest.raises(ValueError, match="already loaded in slot 0"):
        m.add_adapter("a", rank=4, alpha=8)
    for bad in ("", ".", "..", "a/b", "a b", "../x", "a\n", "\na", None):
        with pytest.raises(ValueError, match=r"adapter name=.* is not allowed; allowed: "):
            m.add_adapter(bad, rank=2, alpha=2)
        with pytest.raises(ValueError, match=r"adapter name=.* is not allowed; allowed: "):
            validate_adapter_name(bad)
    assert validate_adapter_name("math-v2.1_a") == "math-v2.1_a"
    m.add_adapter("b", rank=2, alpha=2)
    with pytest.raises(RuntimeError, match="no free LoRA slot for adapter 'c'.*max_loras=2"):
        m.add_adapter("c", rank=2, alpha=2)
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="not both"):
        m(ids, adapter_names=["a", "b"], adapter_slots=[0, 1])
    with pytest.raises(ValueError, match="adapter_names=.*list of 2 names"):
        m(ids, adapter_names=["a"])
    with pytest.raises(ValueError, match="adapter_slots=.*from -1"):
        m(ids, adapter_slots=[0, 2])
    m.remove_adapter("b")
    with pytest.raises(ValueError, match=r"empty slot\(s\) \[1\]"):
        m(ids, adapter_slots=[0, 1])
    bank = m.new_bank()
    with pytest.raises(ValueError, match="bank slot 1, which is empty"):
        m(ids, adapter_slots=[0, 1], lora_bank=bank)
    with pytest.raises(ValueError, match="route rows by adapter_slots"):
        m(ids, adapter_names=["a", None], lora_bank=bank)


def test_target_modules_errors():
    with pytest.raises(ValueError, match="target_modules='q_proj' is not allowed"):
        make_model(target_modules="q_proj")
    with pytest.raises(ValueError, match="'nope' matches no module"):
        make_model(target_modules=["q_proj", "nope"])
    with pytest.raises(ValueError, match="'mlp' matches 'model.layers.0.mlp', which is not an nn.Linear"):
        make_model(target_modules=["mlp"])
    with pytest.raises(ValueError, match="max_rank=0"):
        make_model(max_rank=0)


def test_peft_folder_mismatch_errors(tmp_path):
    m = make_model("qwen2", target_modules=["q_proj", "v_proj"])
    m.add_adapter("a", rank=4, alpha=8, seed=0)
    sd, config = m.adapter_state_dict("a"), m.peft_config("a")
    key = next(iter(sd))

    def load(state_dict=sd, **changes):
        return m.load_adapter_state_dict("x", state_dict, {**config, **changes})

    with pytest.raises(ValueError, match=r"lora_A.weight has shape \(4, 32\); expected \(2, 32\)"):
        load(r=2)
    with pytest.raises(ValueError, match="r=16 is not allowed.*max_rank=8"):
        load(r=16)
    with pytest.raises(ValueError, match="peft_type='IA3'"):
        load(peft_type="IA3")
    with pytest.raises(ValueError, match="use_dora=True is not allowed; allowed: False"):
        load(use_dora=True)
    with pytest.raises(ValueError, match="use_rslora=True is not allowed; allowed: False"):
        load(use_rslora=True)
    with pytest.raises(ValueError, match="not in the config's target_modules"):
        load(target_modules=["k_proj"])
    with pytest.raises(ValueError, match="has no lora_B tensor"):
        load({k: v for k, v in sd.items() if not k.endswith("lora_B.weight")})
    with pytest.raises(ValueError, match="'model.layers.0.mlp.up_proj' is not a LoRA target"):
        load({**sd, "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": sd[key]})
    with pytest.raises(ValueError, match="unexpected key 'lm_head.weight'"):
        load({**sd, "lm_head.weight": sd[key]})
    with pytest.raises(ValueError, match="adapter name='../x' is not allowed"):
        m.load_adapter_state_dict("../x", sd, config)
    assert "x" not in m.adapters and m.free_slots == [1, 2, 3]  # a failed load claims no slot
    with pytest.raises(FileNotFoundError, match="adapter_config.json is missing"):
        m.load_adapter("x", tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors is missing"):
        m.load_adapter("x", tmp_path)
    bank = m.new_bank()
    with pytest.raises(ValueError, match="slot=4 is not allowed"):
        bank.set_adapter(4, sd, config)
    with pytest.raises(ValueError, match="bank slot 1 does not match"):
        bank.set_adapter(1, sd, {**config, "r": 2})


def test_gradient_checkpointing_recomputes_in_eval_mode_too_with_the_same_grads():
    """The trainer runs its forwards in eval mode (dropout off); HF checkpoints a layer only while the layer is in
    training mode, so with routed checkpointing on the decoder layers keep that flag: each layer's forward runs again
    in the backward (counted by a hook), the grads equal the plain backward's, and the submodules stay in eval."""
    m = make_model("qwen2")
    add_three(m)
    m.eval()
    ids, mask = batch()
    names = ["a", "b", None, "a", "c", "b"]
    layer = m.base_model.get_decoder().layers[0]
    calls = []
    layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1))  # (the recompute calls the layer's forward)

    def grads():
        m.zero_grad(set_to_none=True)
        m.zero_lora_grads()
        logits = m(ids, attention_mask=mask, adapter_names=names).logits
        sum(per_adapter_loss(logits, ids, names, n) for n in ("a", "b", "c")).backward()
        return [g.clone() for n in ("a", "b", "c") for g in m.adapter_grads(n)]

    plain = grads()
    assert len(calls) == 1
    m.gradient_checkpointing_enable()
    calls.clear()
    checkpointed = grads()
    assert len(calls) == 2  # the forward, then its recompute in the backward
    assert layer.training and not layer.self_attn.training and not m.training
    for g_ckpt, g_plain in zip(checkpointed, plain, strict=True):
        torch.testing.assert_close(g_ckpt, g_plain, atol=1e-6, rtol=1e-5)
    m.gradient_checkpointing_disable()
    assert not layer.training


def test_gradient_checkpointing_replays_routing_and_direct_enable_is_refused():
    m = make_model("qwen2")
    add_three(m)
    m.train()
    ids, mask = batch()
    names = ["a", "b", None, "a", "c", "b"]

    def grads():
        m.zero_grad(set_to_none=True)
        logits = m(ids, attention_mask=mask, adapter_names=names).logits
        sum(per_adapter_loss(logits, ids, names, n) for n in ("a", "b", "c")).backward()
        return [g.clone() for n in ("a", "b", "c") for g in m.adapter_grads(n)]

    plain = grads()
    m.gradient_checkpointing_enable()
    assert m.base_model.is_activation_checkpointing
    for g_ckpt, g_plain in zip(grads(), plain, strict=True):
        torch.testing.assert_close(g_ckpt, g_plain, atol=1e-6, rtol=1e-5)
    m.gradient_checkpointing_disable()
    m.base_model.activation_checkpointing_enable()
    with pytest.raises(RuntimeError, match="use MultiLoRAModel.gradient_checkpointing_enable"):
        m(ids, adapter_names=names)


def _ops(fn) -> set[str]:
    """The aten ops `fn` runs (the profiler's names)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_frozen_head_folds_a_sliced_input_into_one_product(dtype):
    """HF's `lm_head(hidden[:, -k:, :])` with k shorter than the sequence (an engine's prefill keeps the last
    position): a strided input and a frozen head make `torch.matmul` broadcast the head over the rows into `bmm`,
    on CPU in bf16 a copy of the whole head per row (1.2 s and 650 MiB for a 12-row SmolLM2 prefill). The wrapped
    model's head runs one product over the rows instead, with the same logits."""
    m = make_model("llama").to(dtype)
    ids, mask = batch()
    head = m.base_model.get_output_embeddings()
    with torch.no_grad():
        hidden = m(ids, attention_mask=mask, decoder_only=True).last_hidden_state  # (6, 7, H)
        sliced = hidden[:, -1:, :]
        assert not sliced.is_contiguous() and not head.weight.requires_grad
        # the control: torch's own linear on this input goes through bmm, so the check below can fail
        strided = torch.nn.functional.linear(sliced, head.weight)
        assert "aten::bmm" in _ops(lambda: torch.nn.functional.linear(sliced, head.weight))
        ops = _ops(lambda: head(sliced))  # the head module, as HF calls it
        assert "aten::bmm" not in ops and {"aten::mm", "aten::addmm"} & ops, sorted(ops)
        folded = head(sliced)
        logits = m(ids, attention_mask=mask, logits_to_keep=1).logits
    assert torch.equal(logits, folded)  # the model's own call takes the folded path
    # the same values as the broadcast product, to its rounding (the two sum in another order)
    torch.testing.assert_close(folded, strided, **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))


def test_export_of_a_model_with_lora_on_one_layers_module_names_it_in_full(tmp_path):
    """A model built with LoRA on layer 0's q_proj alone exported `target_modules: ['q_proj']`, which PEFT matches in
    every layer (it wrapped layer 1's q_proj too and warned of missing keys): the leaf name is checked against every
    module of the base now, so the full name is written and PEFT wraps exactly the adapter's modules."""
    import warnings

    m = MultiLoRAModel.from_model(tiny_model("qwen2"), max_loras=1, max_rank=8,
                                  target_modules=["model.layers.0.self_attn.q_proj"])  # fmt: skip
    m.add_adapter("a", rank=4, alpha=8, seed=1)
    with torch.no_grad():
        for p in m.adapter_parameters("a"):
            p.add_(0.1)
    m.export_adapter("a", tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"] == [
        "model.layers.0.self_attn.q_proj"
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(tiny_model("qwen2"), str(tmp_path))
    assert not [w for w in caught if "missing adapter keys" in str(w.message)], [str(w.message) for w in caught]
    wrapped = sorted(n for n, mod in pm.named_modules() if hasattr(mod, "lora_A") and mod.lora_A)
    assert wrapped == ["base_model.model.model.layers.0.self_attn.q_proj"]
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(m(ids, adapter_names=["a"]).logits, pm(ids).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens=[5, 6] is not allowed; allowed: None (aLoRA"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa' is not allowed"),
        ({"init_lora_weights": "olora"}, "init_lora_weights='olora' is not allowed"),
    ],
)
def test_a_peft_adapter_whose_math_is_not_plain_lora_is_refused(tmp_path, changes, message):
    """A reviewer's repros: PEFT applies an aLoRA adapter only after its invocation tokens, and rebuilds the base of
    a PiSSA / OLoRA adapter (W - B0 A0) when it loads one; both loaded here without an error and gave other logits
    (0.54 and 0.14-0.27 off). Made by PEFT itself, refused with the field named."""
    import copy

    base = tiny_model("llama")
    peft = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], **changes))
    peft.save_pretrained(tmp_path)
    m = MultiLoRAModel.from_model(base, max_loras=2, max_rank=8)
    with pytest.raises(ValueError, match=re.escape(message)):
        m.load_adapter("x", tmp_path)
    assert "x" not in m.adapters
