"""Expert LoRA on packed MoE weights (`target_parameters`) against oracles.

Oracles: PEFT 0.21's own `target_parameters` LoRA (`ParamWrapper`) on the same tiny random Qwen3-MoE base, each
adapter run alone, the model's float32 per-pair loop (`reference=True`), the router's own top-k choices (captured
with hooks) for where gradients may land, and a clean run for NaN isolation. Every model is built offline in float32
(hidden 32, 2 layers, 4 experts, top-2), so tolerances are tight.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

from rl_multilora.lora import LoRAExperts, MultiLoRAModel, write_peft_folder

VOCAB = 128
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
TOL = dict(atol=1e-5, rtol=1e-5)
GRAD_TOL = dict(atol=1e-6, rtol=1e-5)
PEFT_TOL = dict(atol=2e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors on a shared 2-core box: intra-op threads only add barrier waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_moe(seed: int = 0, layers: int = 2):
    """A float32 random Qwen3-MoE (hidden 32, 4 experts of width 16, top-2); same arguments, same weights."""
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float()
        with torch.no_grad():  # a peaked router: tokens of a short row reach only some of the experts
            for layer in model.model.layers:
                layer.mlp.gate.weight.mul_(10)
    return model.eval()


def make_model(max_loras=6, max_rank=8, target_modules="all-linear", target_parameters=EXPERTS) -> MultiLoRAModel:
    return MultiLoRAModel.from_model(
        tiny_moe(), max_loras, max_rank, target_modules, target_parameters=target_parameters
    )


def randomize(m: MultiLoRAModel, name: str, seed: int) -> None:
    """Non-zero A and B at the adapter's true rank in everything it covers (Linears and experts); padding stays 0."""
    g = torch.Generator().manual_seed(seed)
    s, r = m.slot_of(name), m.adapters[name].rank
    with torch.no_grad():
        for a, b in zip(m.adapter_parameters(name)[::2], m.adapter_parameters(name)[1::2], strict=True):
            a[..., :r, :].copy_(torch.randn(a[..., :r, :].shape, generator=g) * 0.2)
            b[..., :r].copy_(torch.randn(b[..., :r].shape, generator=g) * 0.2)
    assert m.slot_of(name) == s


def add(m: MultiLoRAModel, specs: dict, seed: int = 0) -> None:
    """Add and randomize adapters `specs[name] = (rank, alpha[, target_modules, target_parameters])`."""
    for i, (name, (rank, alpha, *targets)) in enumerate(specs.items()):
        modules, params = (targets + [None, None])[:2]
        m.add_adapter(name, rank=rank, alpha=alpha, seed=seed + i, target_modules=modules, target_parameters=params)
        randomize(m, name, seed=1000 + seed + i)


def batch(rows: int, length: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def probe_loss(logits: torch.Tensor, rows: list[int], seed: int = 0) -> torch.Tensor:
    """A fixed random linear function of every position's logits of `rows` (every token feeds it), as a mean."""
    probe = torch.randn(logits.shape[1:], generator=torch.Generator().manual_seed(seed))
    return (logits[rows] * probe).mean()


def expert_lora(m: MultiLoRAModel, name: str):
    """The slots of expert Parameter `name`: `lora_A (S, E, R, in)`, `lora_B (S, E, out, R)`."""
    shape = m.expert_shapes[name]
    return m.base_model.get_submodule(shape.module).lora(shape.param)


def expert_grads(m: MultiLoRAModel) -> dict[str, torch.Tensor]:
    """Stacked (all slots) expert LoRA grads, cloned: `<param>.A` (S, E, R, in), `<param>.B` (S, E, out, R)."""
    out = {}
    for name in m.lora_parameters:
        holder = expert_lora(m, name)
        for which, t in (("A", holder.lora_A), ("B", holder.lora_B)):
            out[f"{name}.{which}"] = torch.zeros_like(t) if t.grad is None else t.grad.clone()
    return out


# ---------------------------------------------------------------------------------------------------------------
# One adapter against PEFT's target_parameters LoRA


@pytest.mark.parametrize(
    "rank, targets, params",
    [
        (8, [], EXPERTS),  # rank = max_rank, experts only
        (3, ["q_proj", "v_proj"], EXPERTS),  # rank below max_rank, Linears and experts
        (5, [], ["mlp.experts.down_proj"]),  # one Parameter of the module: no base_layer nesting in the keys
    ],
    ids=["experts_r8", "linear_and_experts_r3", "down_proj_only_r5"],
)
def test_one_adapter_matches_peft_target_parameters(rank, targets, params, tmp_path):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        pm = get_peft_model(
            tiny_moe(),
            LoraConfig(
                r=rank,
                lora_alpha=11,
                target_modules=targets,
                target_parameters=params,
                lora_dropout=0.0,
                init_lora_weights=False,  # random A and B
            ),
        )
    pm.save_pretrained(str(tmp_path / "peft"))
    m = make_model()
    m.load_adapter("p", tmp_path / "peft")
    covered = [n for n in m.lora_parameters if any(n.endswith(p) for p in params)]
    assert len(m.adapter_parameters("p")) == 2 * (len(covered) + 2 * len(targets))  # 2 layers
    ids = batch(3)
    with torch.no_grad():
        expected = pm(input_ids=ids).logits
        base = tiny_moe()(input_ids=ids).logits
        got = m(ids, adapter_names=["p"] * 3).logits
        ref = m(ids, adapter_names=["p"] * 3, reference=True).logits
    assert not torch.allclose(expected, base, atol=1e-2)  # the adapter (experts included) changes the output
    torch.testing.assert_close(got, expected, **PEFT_TOL)
    torch.testing.assert_close(ref, expected, **PEFT_TOL)
    # Our export of it is PEFT's own state dict, key for key and tensor for tensor.
    ours = m.adapter_state_dict("p")
    theirs = get_peft_model_state_dict(pm)
    assert sorted(ours) == sorted(theirs)
    for key, tensor in theirs.items():
        assert torch.equal(ours[key], tensor), key


def test_experts_only_adapter_changes_nothing_but_experts():
    """An experts-only adapter leaves attention exactly as the base: its Linear slots stay zero and get no grad."""
    m = make_model()
    add(m, {"x": (4, 9, [], None)})
    assert len(m.adapter_parameters("x")) == 2 * len(m.lora_parameters)
    ids = batch(2)
    probe_loss(m(ids, adapter_names=["x", "x"]).logits, [0, 1]).backward()
    for layer_name in m.lora_modules:
        layer = m.base_model.get_submodule(layer_name)
        assert layer.lora_A.grad is None or torch.count_nonzero(layer.lora_A.grad) == 0
    assert all(torch.count_nonzero(g) > 0 for g in m.adapter_grads("x"))


# ---------------------------------------------------------------------------------------------------------------
# Many adapters in one batch

SPECS = {
    "a": (2, 5),  # Linears and experts
    "b": (8, 12.3, [], None),  # experts only, at max_rank
    "c": (3, 7, ["q_proj"], ["mlp.experts.gate_up_proj"]),  # subsets of both
    "d": (5, 11, None, ["model.layers.1.mlp.experts.down_proj"]),  # one layer's down_proj only
}
MIXES = {
    "distinct_with_base": ["a", None, "b", "c", "d"],
    "skewed": ["b", "b", "a", "b", None, "b"],
    "one_adapter": ["c", "c", "c"],
    "one_slot_spread": ["d", None, "d"],
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_mixed_batch_each_row_equals_its_adapter_alone_and_the_reference_loop(mix):
    names = MIXES[mix]
    m = make_model()
    add(m, SPECS)
    ids = batch(len(names))
    used = sorted({n for n in names if n is not None})
    results = []
    for reference in (False, True):
        m.zero_lora_grads()
        logits = m(ids, adapter_names=names, reference=reference).logits
        sum(
            probe_loss(logits, [i for i, n in enumerate(names) if n == a], seed=j) for j, a in enumerate(used)
        ).backward()
        results.append((logits.detach(), {a: [g.clone() for g in m.adapter_grads(a)] for a in used}))
    (fast, fast_grads), (ref, ref_grads) = results
    torch.testing.assert_close(fast, ref, **TOL)
    for a in used:
        for g_fast, g_ref in zip(fast_grads[a], ref_grads[a], strict=True):
            torch.testing.assert_close(g_fast, g_ref, **GRAD_TOL)
        assert all(torch.count_nonzero(g) > 0 for g in fast_grads[a]), a
    with torch.no_grad():
        base = tiny_moe()(input_ids=ids).logits
        for a in used:
            rows = [i for i, n in enumerate(names) if n == a]
            alone = m(ids[rows], adapter_names=[a] * len(rows)).logits
            torch.testing.assert_close(fast[rows], alone, **TOL)
            assert not torch.allclose(fast[rows], base[rows], atol=1e-3), a
    base_rows = [i for i, n in enumerate(names) if n is None]
    torch.testing.assert_close(fast[base_rows], base[base_rows], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# Where gradients land


def routed_experts(m: MultiLoRAModel, ids: torch.Tensor, names: list) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Run forward with hooks on every router: logits and, per layer, (B, L, top_k) expert ids."""
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda mod, inp, out, i=i: seen.__setitem__(i, out[2].detach()))
        for i, layer in enumerate(m.base_model.model.layers)
    ]
    try:
        logits = m(ids, adapter_names=names).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, {i: idx.view(*ids.shape, -1) for i, idx in seen.items()}


def test_grads_land_only_in_routed_experts_of_each_rows_slot():
    m = make_model(max_loras=6)
    add(m, {"a": (2, 5), "b": (8, 12.3, [], None), "c": (3, 7), "idle": (4, 9)})
    m.add_adapter("gone", rank=8, alpha=8, seed=9)
    randomize(m, "gone", seed=9)
    m.remove_adapter("gone")
    names = ["a", "b", None, "c"]  # one short row each: its tokens reach only some experts
    ids = batch(len(names), length=2, seed=3)
    logits, routed = routed_experts(m, ids, names)
    probe_loss(logits, [0, 1, 3]).backward()
    grads = expert_grads(m)
    zero_blocks = 0
    for slot in range(m.max_loras):
        name = next((n for n, info in m.adapters.items() if info.slot == slot), None)
        rows = [i for i, n in enumerate(names) if n == name and n is not None]
        for param in m.lora_parameters:
            layer = int(param.split(".")[2])
            hit = set(routed[layer][rows].flatten().tolist())
            for which in ("A", "B"):
                g = grads[f"{param}.{which}"][slot]  # (E, R, in) / (E, out, R)
                for e in range(g.shape[0]):
                    if e in hit:
                        r = m.adapters[name].rank
                        block = g[e, :r] if which == "A" else g[e, :, :r]
                        above = g[e, r:] if which == "A" else g[e, :, r:]
                        assert torch.count_nonzero(block) > 0, (slot, param, which, e)
                        assert torch.count_nonzero(above) == 0, (slot, param, which, e)  # above the true rank
                    else:
                        assert torch.count_nonzero(g[e]) == 0, (slot, param, which, e)
                        zero_blocks += 1
    # The zero checks above must have bitten on used slots too, not only on idle and empty ones.
    used_misses = sum(
        len(set(range(4)) - set(routed[layer][[i]].flatten().tolist())) for layer in routed for i in (0, 1, 3)
    )
    assert used_misses > 0 and zero_blocks > used_misses


# ---------------------------------------------------------------------------------------------------------------
# NaN / inf of one tenant stays in that tenant


@pytest.mark.parametrize("poison", ["nan_expert_B", "inf_expert_A", "nan_input"])
def test_nonfinite_tenant_leaves_other_tenants_grads_finite_and_unchanged(poison):
    m = make_model(max_loras=5)
    add(m, {"a": (4, 8), "b": (2, 5, [], None), "bad": (3, 7)})
    names = ["a", "bad", "b", "bad", "a"]
    good, bad_rows = ["a", "b"], [1, 3]
    good_rows = [0, 2, 4]
    ids = batch(len(names), length=4)
    clean_embeds = m.base_model.get_input_embeddings()(ids).detach()

    def run(embeds):
        m.zero_lora_grads()
        logits = m(adapter_names=names, inputs_embeds=embeds).logits
        (probe_loss(logits, [0, 4], seed=1) + probe_loss(logits, [2], seed=2)).backward()
        return logits.detach(), {n: [g.clone() for g in m.adapter_grads(n)] for n in good}

    clean_logits, clean_grads = run(clean_embeds)
    embeds = clean_embeds.clone()
    slot = m.slot_of("bad")
    if poison == "nan_input":
        embeds[bad_rows] = float("nan")
    else:
        with torch.no_grad():
            for name in m.lora_parameters:  # every expert of every layer, so the bad rows surely reach one
                holder = expert_lora(m, name)
                if poison == "nan_expert_B":
                    holder.lora_B[slot, :, :, :2] = float("nan")
                else:
                    holder.lora_A[slot, :, :2] = float("inf")
    logits, grads = run(embeds)
    assert not torch.isfinite(logits[bad_rows]).any()  # the poison did reach the bad tenant's rows
    # Not bit for bit: the poisoned tokens route elsewhere, so the per-expert matmuls hold other row counts.
    torch.testing.assert_close(logits[good_rows], clean_logits[good_rows], **TOL)
    for name in good:
        for g, g_clean in zip(grads[name], clean_grads[name], strict=True):
            assert torch.isfinite(g).all(), name
            torch.testing.assert_close(g, g_clean, **GRAD_TOL)
        assert all(torch.count_nonzero(g) > 0 for g in grads[name]), name


# ---------------------------------------------------------------------------------------------------------------
# Files and slots


def test_export_round_trip_through_peft_and_back(tmp_path):
    m = make_model()
    add(m, {"x": (3, 7, ["q_proj", "o_proj"], None), "y": (6, 10, [], ["mlp.experts.gate_up_proj"])})
    ids = batch(4)
    with torch.no_grad():
        got = m(ids, adapter_names=["x", "x", "y", "y"]).logits
    for name, rows in (("x", [0, 1]), ("y", [2, 3])):
        folder = m.export_adapter(name, tmp_path / name)
        config = m.peft_config(name)
        assert config["r"] == m.adapters[name].rank and config["target_parameters"]
        pm = PeftModel.from_pretrained(tiny_moe(), str(folder))
        with torch.no_grad():
            expected = pm(input_ids=ids[rows]).logits
        torch.testing.assert_close(got[rows], expected, **PEFT_TOL)
        # PEFT's own state dict of what it loaded equals what we wrote, tensor for tensor (every expert's slice).
        ours = m.adapter_state_dict(name)
        theirs = get_peft_model_state_dict(pm)
        assert sorted(ours) == sorted(theirs)
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
        # And back: a fresh model loads the folder into the same slot tensors; so does a folder written without
        # the model's shapes (what checkpoints do), whose expert tensors are checked by their own shapes.
        plain = write_peft_folder(tmp_path / f"{name}_plain", m.adapter_state_dict(name), m.peft_config(name))
        again = make_model()
        again.load_adapter(name, plain)
        for p, q in zip(m.adapter_parameters(name), again.adapter_parameters(name), strict=True):
            assert torch.equal(p, q)
        with torch.no_grad():
            torch.testing.assert_close(again(ids[rows], adapter_names=[name] * 2).logits, got[rows], **TOL)


def test_reused_slot_holds_nothing_of_the_previous_tenant():
    m = make_model(max_loras=2)
    add(m, {"old": (8, 12.3), "other": (2, 5)})
    ids = batch(3)
    slot = m.slot_of("old")
    probe_loss(m(ids, adapter_names=["old", "other", "old"]).logits, [0, 1, 2]).backward()
    assert all(torch.count_nonzero(g) > 0 for g in m.adapter_grads("old"))
    m.remove_adapter("old")
    for name in m.lora_parameters:
        holder = expert_lora(m, name)
        for t in (holder.lora_A, holder.lora_B):
            assert torch.count_nonzero(t[slot]) == 0 and torch.count_nonzero(t.grad[slot]) == 0
    # The new tenant covers fewer targets at a lower rank: everything else of the slot must be exact zeros.
    assert m.add_adapter("new", rank=2, alpha=3, seed=4, target_parameters=["mlp.experts.down_proj"]) == slot
    randomize(m, "new", seed=5)
    for name in m.lora_parameters:
        holder = expert_lora(m, name)
        if name.endswith("gate_up_proj"):
            assert torch.count_nonzero(holder.lora_A[slot]) == 0 and torch.count_nonzero(holder.lora_B[slot]) == 0
        else:
            assert torch.count_nonzero(holder.lora_A[slot, :, 2:]) == 0
    fresh = make_model(max_loras=2)
    fresh.add_adapter("new", rank=2, alpha=3, seed=4, target_parameters=["mlp.experts.down_proj"])
    randomize(fresh, "new", seed=5)
    with torch.no_grad():
        got = m(ids, adapter_names=["new", None, "new"]).logits
        expected = fresh(ids, adapter_names=["new", None, "new"]).logits
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_per_slot_adamw_trains_only_its_own_experts():
    m = make_model(max_loras=3)
    add(m, {"a": (3, 5), "b": (2, 4, [], None)})
    views = m.adapter_parameters("a")
    optim = torch.optim.AdamW(views, lr=1e-2, weight_decay=0.1)
    before = {n: [p.detach().clone() for p in m.adapter_parameters(n)] for n in ("a", "b")}
    ids = batch(3)
    m.zero_lora_grads()
    probe_loss(m(ids, adapter_names=["a", "b", "a"]).logits, [0, 2]).backward()
    m.attach_slot_grads("a", views)
    optim.step()
    after = {n: m.adapter_parameters(n) for n in ("a", "b")}
    r = m.adapters["a"].rank
    experts_from = 2 * len(m.lora_modules)  # Linears' A and B first, then the experts'
    for i, (p, q) in enumerate(zip(after["a"], before["a"], strict=True)):
        assert not torch.equal(p, q), i
        if i >= experts_from:
            assert p.shape[0] == 4  # (E, R, in) / (E, out, R)
            assert torch.count_nonzero(p[:, r:] if i % 2 == 0 else p[..., r:]) == 0  # padding stays zero
    assert all(torch.equal(p, q) for p, q in zip(after["b"], before["b"], strict=True))


# ---------------------------------------------------------------------------------------------------------------
# Targets and errors


def test_all_linear_never_wraps_a_router():
    config = Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(config).float().eval()
    m = MultiLoRAModel.from_model(base, max_loras=2, max_rank=2, target_parameters=EXPERTS)
    assert "model.layers.0.mlp.shared_expert.gate_proj" in m.lora_modules  # shared experts are plain Linears
    assert not any(n.endswith(("mlp.gate", "shared_expert_gate")) for n in m.lora_modules)
    assert isinstance(m.base_model.get_submodule("model.layers.0.mlp.experts"), LoRAExperts)
    qwen3 = make_model()
    assert not any(n.endswith("mlp.gate") for n in qwen3.lora_modules)
    # Named explicitly, a gate Linear is wrapped.
    explicit = MultiLoRAModel.from_model(
        AutoModelForCausalLM.from_config(config).eval(), 2, 2, target_modules=["shared_expert_gate"]
    )
    assert explicit.lora_modules == ["model.layers.0.mlp.shared_expert_gate"]


def test_a_router_linear_inside_a_router_module_is_never_wrapped_and_flattened_linears_route_per_row():
    """Hunyuan-V1-MoE keeps its router Linear inside a gate module (`mlp.gate.wg`) and, like Qwen2-MoE, runs its
    shared MLP on the tokens flattened to (B * L, H): all-linear leaves the router alone, and a mixed batch gives
    each row what its adapter gives alone (base rows: the base)."""
    from transformers import HunYuanMoEV1Config

    config = HunYuanMoEV1Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_experts=4, moe_topk=2, max_position_embeddings=32, head_dim=8,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(config).float().eval()
    plain = base(input_ids=batch(3, length=5)).logits.detach()
    m = MultiLoRAModel.from_model(base, max_loras=2, max_rank=4, target_parameters=EXPERTS)
    assert not any(".gate." in n or n.endswith(".gate") for n in m.lora_modules), m.lora_modules
    assert "model.layers.0.mlp.shared_mlp.down_proj" in m.lora_modules
    for i, name in enumerate(("a", "b")):
        m.add_adapter(name, rank=4, alpha=8, seed=i)
        with torch.no_grad():
            for t in m.adapter_parameters(name):
                t.normal_(0, 0.2, generator=torch.Generator().manual_seed(i))
    ids = batch(3, length=5)
    with torch.no_grad():
        mixed = m(ids, adapter_names=["a", None, "b"]).logits
        alone = {n: m(ids, adapter_names=[n] * 3).logits for n in ("a", "b")}
    torch.testing.assert_close(mixed[1], plain[1], **TOL)
    torch.testing.assert_close(mixed[0], alone["a"][0], **TOL)
    torch.testing.assert_close(mixed[2], alone["b"][2], **TOL)
    assert not torch.allclose(alone["a"][0], plain[0], atol=1e-3)


def test_base_keys_unchanged_and_target_errors(tmp_path):
    m = make_model()
    base_keys = set(tiny_moe().state_dict())
    keys = {k for k in m.base_model.state_dict() if "lora_" not in k}
    assert keys == base_keys
    assert all(not p.requires_grad for n, p in m.base_model.named_parameters() if "lora_" not in n)
    with pytest.raises(ValueError, match="'q_proj.weight' matches .* not a packed 3-D expert weight"):
        make_model(target_parameters=["q_proj.weight"])
    with pytest.raises(ValueError, match="'nope' matches no parameter"):
        make_model(target_parameters=["nope"])
    with pytest.raises(ValueError, match="matches none"):
        m.add_adapter("bad", rank=2, alpha=4, target_parameters=["mlp.experts.up_proj"])
    # A PEFT file for 4 experts does not load into a model of 4 experts at another rank layout, and says why.
    add(m, {"x": (3, 5, [], None)})
    state, config = m.adapter_state_dict("x"), m.peft_config("x")
    key = next(k for k in state if k.endswith("experts.lora_B.weight"))
    broken = {**state, key: state[key][:, :-1]}
    with pytest.raises(ValueError, match=r"has shape \(32, 11\); expected \(32, 12\)"):
        m.load_adapter_state_dict("y", broken, config)
    with pytest.raises(ValueError, match=r"expected A \(E \* r, in\) and B \(out, r \* E\) with r=3"):
        write_peft_folder(tmp_path / "broken", broken, config)
    assert not (tmp_path / "broken").exists()
    with pytest.raises(ValueError, match="target_parameters=.* is not allowed"):
        make_model(target_parameters=None).load_adapter_state_dict("y", state, config)
    assert "y" not in m.adapters


# ---------------------------------------------------------------------------------------------------------------
# The engine side: LoRABank copies of expert LoRA, greedy decoding against HF + PEFT


def test_bank_serves_expert_lora_like_the_model_and_stays_apart_from_training():
    m = make_model()
    add(m, {"a": (3, 5), "b": (8, 16, ["q_proj"], ["mlp.experts.down_proj"]), "c": (5, 7, [], EXPERTS)})
    bank = m.new_bank()
    names = ["a", None, "b", "c", "a", "c"]
    slots = [-1 if n is None else m.slot_of(n) for n in names]
    ids = batch(len(names), length=6)
    with torch.no_grad():
        own = m(ids, adapter_names=names).logits
        banked = m(ids, adapter_slots=slots, lora_bank=bank).logits
        banked_ref = m(ids, adapter_slots=slots, lora_bank=bank, reference=True).logits
    torch.testing.assert_close(banked, own, **TOL)
    torch.testing.assert_close(banked_ref, own, **TOL)
    # Training the model's slots does not reach the bank until the adapter is written into it again.
    with torch.no_grad():
        expert_lora(m, "model.layers.0.mlp.experts.gate_up_proj").lora_B[m.slot_of("a")].add_(1.0)
        changed = m(ids, adapter_names=names).logits
        still = m(ids, adapter_slots=slots, lora_bank=bank).logits
    torch.testing.assert_close(still, banked, atol=0, rtol=0)
    assert not torch.allclose(changed, own, atol=1e-3)
    bank.set_adapter(m.slot_of("a"), m.adapter_state_dict("a"), m.peft_config("a"))
    with torch.no_grad():
        torch.testing.assert_close(m(ids, adapter_slots=slots, lora_bank=bank).logits, changed, **TOL)
    bank.clear(m.slot_of("a"))
    with pytest.raises(ValueError, match="empty"):
        m(ids, adapter_slots=slots, lora_bank=bank)


def test_embedded_engine_greedy_matches_peft_generate_in_mixed_batches(tmp_path):
    from rollout.engines.embedded import EmbeddedEngine
    from rollout.types import GenerateRequest, SamplingParams
    from tests.tiny_models import tiny_tokenizer

    specs = {"a": (4, 8, [], EXPERTS), "b": (2, 5, ["q_proj", "o_proj"], ["mlp.experts.gate_up_proj"])}
    folders = {}
    for i, (name, (rank, alpha, modules, params)) in enumerate(specs.items()):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(20 + i)
            config = LoraConfig(
                r=rank, lora_alpha=alpha, target_modules=modules, target_parameters=params, init_lora_weights=False
            )
            pm = get_peft_model(tiny_moe(), config)
        pm.save_pretrained(str(tmp_path / name))
        folders[name] = tmp_path / name
    engine = EmbeddedEngine(make_model(), tiny_tokenizer())
    try:
        for name, folder in folders.items():
            from rl_multilora.lora import read_peft_folder

            engine.load_adapter(name, *read_peft_folder(folder))
        prompts = [[5, 17, 33, 48, 9, 71], [12, 40], [3, 99, 64, 21]]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=[])
        requests = [GenerateRequest(p, adapter=n, sampling=greedy) for p in prompts for n in ("a", None, "b")]
        results = engine.generate(requests)
    finally:
        engine.close()
    outputs = {}
    for request, result in zip(requests, results, strict=True):
        ref = tiny_moe()
        if request.adapter is not None:
            ref = PeftModel.from_pretrained(ref, str(folders[request.adapter])).eval()
        ids = torch.tensor([request.input_ids])
        expected = ref.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, eos_token_id=None
        )[0, ids.shape[1] :].tolist()
        assert result.output_ids == expected, (request.adapter, request.input_ids)
        outputs.setdefault(tuple(request.input_ids), set()).add(tuple(result.output_ids))
    assert any(len(v) == 3 for v in outputs.values()), "each adapter must change some greedy output"


# ---------------------------------------------------------------------------------------------------------------
# expert_lora="shared_a": one A per slot and Parameter shared by all experts, one B per expert (ModelOpt's layout)


def make_shared(**kw) -> MultiLoRAModel:
    return MultiLoRAModel.from_model(tiny_moe(), 6, 8, "all-linear", target_parameters=EXPERTS, expert_lora="shared_a")


def test_shared_a_holds_one_a_per_slot_and_matches_peft_with_that_a_repeated(tmp_path):
    m = make_shared()
    holder = expert_lora(m, "model.layers.1.mlp.experts.down_proj")
    assert holder.lora_A.shape == (6, 1, 8, 16) and holder.lora_B.shape == (6, 4, 32, 8)
    add(m, {"a": (3, 5), "b": (6, 9, [], EXPERTS)})
    names = ["a", "b", None, "b"]
    ids = batch(4, length=6)
    with torch.no_grad():
        got = m(ids, adapter_names=names).logits
        ref = m(ids, adapter_names=names, reference=True).logits
    torch.testing.assert_close(got, ref, **TOL)
    # Its PEFT export repeats the shared A per expert: PEFT's own per-expert LoRA gives the same logits.
    folder = m.export_adapter("b", tmp_path / "b")
    pm = PeftModel.from_pretrained(tiny_moe(), str(folder)).eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=ids[1:2]).logits, got[1:2], **PEFT_TOL)
    # ... and a per-expert model loads it exactly; a shared-A model takes it back, but not a per-expert A.
    per_expert = make_model()
    per_expert.load_adapter("b", folder)
    with torch.no_grad():
        torch.testing.assert_close(per_expert(ids[1:2], adapter_names=["b"]).logits, got[1:2], **TOL)
    m.load_adapter("b2", folder)
    with torch.no_grad():
        torch.testing.assert_close(m(ids[1:2], adapter_names=["b2"]).logits, got[1:2], **TOL)
    add(per_expert, {"p": (4, 4)})
    with pytest.raises(ValueError, match="different A per expert.*expert_lora='shared_a'"):
        m.load_adapter_state_dict("p", per_expert.adapter_state_dict("p"), per_expert.peft_config("p"))
    assert "p" not in m.adapters
    with pytest.raises(ValueError, match="expert_lora=.*'per_expert' or 'shared_a'"):
        MultiLoRAModel.from_model(tiny_moe(), 2, 4, target_parameters=EXPERTS, expert_lora="shared")


def test_shared_a_grads_match_autograd_through_the_reference_loop():
    m = make_shared()
    add(m, {"a": (3, 5), "b": (6, 9)})
    names = ["a", "b", None, "a"]
    ids = batch(4, length=6)
    grads = {}
    for reference in (False, True):
        m.zero_lora_grads()
        probe_loss(m(ids, adapter_names=names, reference=reference).logits, [0, 1, 3]).backward()
        grads[reference] = expert_grads(m)
    for key in grads[True]:
        torch.testing.assert_close(grads[False][key], grads[True][key], **GRAD_TOL)
    shared = grads[False]["model.layers.0.mlp.experts.gate_up_proj.A"]
    assert shared[m.slot_of("a")].abs().sum() > 0 and shared[m.slot_of("b")].abs().sum() > 0
    assert shared[[s for s in range(6) if s not in (m.slot_of("a"), m.slot_of("b"))]].abs().sum() == 0
    # the bank serves a shared-A model too
    bank = m.new_bank()
    with torch.no_grad():
        torch.testing.assert_close(
            m(ids, adapter_slots=[m.slot_of(n) if n else -1 for n in names], lora_bank=bank).logits,
            m(ids, adapter_names=names).logits,
            **TOL,
        )


# ---------------------------------------------------------------------------------------------------------------
# Other MoE families: Mixtral, DeepSeek-V3 (with shared experts) and gpt-oss (transposed experts with biases and
# interleaved gate/up, router `mlp.router`), each against PEFT's target_parameters LoRA


def _family_config(family: str):
    from transformers import DeepseekV3Config, GptOssConfig, MixtralConfig, Qwen2MoeConfig

    common = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    if family == "mixtral":
        return MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, head_dim=8, **common)
    if family == "qwen2_moe":  # its shared expert (plain Linears) runs on the tokens flattened to (B * L, H)
        return Qwen2MoeConfig(
            intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], head_dim=8, **common,
        )  # fmt: skip
    if family == "deepseek_v3":
        return DeepseekV3Config(
            intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
            topk_group=1, n_shared_experts=1, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16,
            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, head_dim=4, **common,
        )  # fmt: skip
    return GptOssConfig(
        intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, head_dim=8, layer_types=["full_attention"] * 2,
        **common,
    )  # fmt: skip


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "gpt_oss", "qwen2_moe"])
def test_other_moe_families_match_peft_one_adapter_and_mixed(family, tmp_path):
    def base():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return AutoModelForCausalLM.from_config(_family_config(family)).float().eval()

    folders = {}
    shared = ["down_proj"] if family == "qwen2_moe" else []  # LoRA on the shared expert's (flattened) Linear too
    for i, (name, modules) in enumerate((("p", []), ("q", ["o_proj", *shared]))):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(5 + i)
            config = LoraConfig(
                r=4 - 2 * i, lora_alpha=8, target_modules=modules, target_parameters=EXPERTS, init_lora_weights=False
            )
            pm = get_peft_model(base(), config)
        pm.save_pretrained(str(tmp_path / name))
        folders[name] = pm
    m = MultiLoRAModel.from_model(base(), 3, 8, "all-linear", target_parameters=EXPERTS)
    assert not any("router" in n or n.endswith("mlp.gate") for n in m.lora_modules)  # never a router
    assert any("shared_expert" in n for n in m.lora_modules) == (family in ("deepseek_v3", "qwen2_moe"))  # Linears
    assert not any(n.endswith("shared_expert_gate") for n in m.lora_modules)  # Qwen2-MoE's gate: never LoRA
    assert {s.transposed for s in m.expert_shapes.values()} == {family == "gpt_oss"}  # the layout travels with it
    for name in folders:
        m.load_adapter(name, tmp_path / name)
    ids = batch(4, length=6)
    with torch.no_grad():
        alone = {name: pm(input_ids=ids).logits for name, pm in folders.items()}
        plain = base()(input_ids=ids).logits
        mixed = m(ids, adapter_names=["p", None, "q", "p"]).logits
        ref = m(ids, adapter_names=["p", None, "q", "p"], reference=True).logits
    assert not torch.allclose(alone["p"], plain, atol=1e-2)
    for row, want in enumerate((alone["p"], plain, alone["q"], alone["p"])):
        torch.testing.assert_close(mixed[row], want[row], **PEFT_TOL)
    torch.testing.assert_close(ref, mixed, **PEFT_TOL)


@pytest.mark.gpu
def test_mixed_batch_on_cuda_matches_the_cpu_model_in_logits_and_grads():
    """The grouped expert path on CUDA (bf16 base, fp32 LoRA): each row's logits and every slot's grads match the
    same model on CPU in fp32 to bf16 tolerance."""
    cpu = make_model()
    add(cpu, {"a": (3, 5), "b": (8, 16, ["q_proj"], ["mlp.experts.down_proj"]), "c": (5, 7)})
    gpu = make_model()
    gpu.load_state_dict(cpu.state_dict())
    for name in ("a", "b", "c"):
        gpu.load_adapter_state_dict(name, cpu.adapter_state_dict(name), cpu.peft_config(name))
    gpu.base_model.to(device="cuda", dtype=torch.bfloat16)
    for holder in gpu._experts.values():
        holder.to(device="cuda", dtype=torch.float32)
    names = ["a", None, "b", "c", "a", "c"]
    ids = batch(len(names), length=6)
    for m, device in ((cpu, "cpu"), (gpu, "cuda")):
        m.zero_lora_grads()
        probe_loss(m(ids.to(device), adapter_names=names).logits.float().cpu(), [0, 2, 3, 4, 5]).backward()
    with torch.no_grad():
        got = gpu(ids.cuda(), adapter_names=names).logits.float().cpu()
        want = cpu(ids, adapter_names=names).logits
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
    for name, holder in cpu._experts.items():
        other = gpu._experts[name]
        torch.testing.assert_close(other.lora_B.grad.cpu(), holder.lora_B.grad, atol=5e-2, rtol=5e-2)
