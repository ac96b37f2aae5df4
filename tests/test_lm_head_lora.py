"""LoRA on `lm_head` (Tinker's `train_unembed`): a LoRA target like any other Linear, against PEFT.

- Logits of a mixed batch (adapters with and without `lm_head`, base rows) equal PEFT's LoRA per adapter, on an
  untied model and on a `tie_word_embeddings` one (SmolLM2's layout), where PEFT (default `ensure_weight_tying=False`)
  puts the LoRA on the output head only and leaves the tied input embedding as it is: so do we.
- The export loads with `PeftModel.from_pretrained` and gives the same logits; PEFT's own folder loads here.
- The trainer's chunked token log-probs (`token_logp_entropy` with `MultiLoRAModel.head_lora`) equal the plain
  full-logits path in values and in every LoRA gradient (lm_head's included), with gradients in `.grad` or in a
  `SlotGradSink`. (A Tinker client's `train_unembed` trains it: tests/test_tinker_server.py.)
"""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM

from rl_multilora.lora import MultiLoRAModel, read_peft_folder
from rl_multilora.token_logprobs import token_logp_entropy
from tests.tiny_models import tiny_config

TOL = dict(atol=2e-5, rtol=1e-5)
TARGETS = ["q_proj", "v_proj", "down_proj", "lm_head"]


def base(tied: bool, dtype=torch.float32):
    config = tiny_config("llama")
    config.tie_word_embeddings = tied
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to(dtype)
    return model.eval()


def model_with_adapters(tied: bool, dtype=torch.float32) -> MultiLoRAModel:
    """Adapters "a" (rank 4, every target, lm_head included), "b" (rank 8, no lm_head), "c" (rank 2, lm_head only),
    each with random A and B at its true rank."""
    m = MultiLoRAModel.from_model(base(tied, dtype), 4, 8, TARGETS, lora_dtype=dtype)
    specs = {"a": (4, 8, None), "b": (8, 16, ["q_proj", "v_proj", "down_proj"]), "c": (2, 32, ["lm_head"])}
    g = torch.Generator().manual_seed(1)
    for i, (name, (rank, alpha, targets)) in enumerate(specs.items()):
        m.add_adapter(name, rank=rank, alpha=alpha, seed=i, target_modules=targets)
    with torch.no_grad():
        for name in specs:
            for t in m.adapter_slot_tensors(name):
                t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64).to(dtype) * 0.3)
    return m


def batch(rows=6, length=7):
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 128, (rows, length), generator=g), torch.ones(rows, length, dtype=torch.long)


def peft_config(m: MultiLoRAModel, name: str) -> LoraConfig:
    info = m.adapters[name]
    targets = sorted({n.rsplit(".", 1)[-1] for n in m.adapter_modules(name)})
    return LoraConfig(r=info.rank, lora_alpha=info.alpha, target_modules=targets, lora_dropout=0.0)


@pytest.mark.filterwarnings("ignore:.*tie_word_embeddings=True")  # PEFT's warning about a LoRA on a tied head
@pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`")
@pytest.mark.parametrize("tied", [False, True])
def test_mixed_batch_and_export_match_peft(tied, tmp_path):
    m = model_with_adapters(tied)
    head = m.base_model.get_output_embeddings()
    assert (head.weight is m.base_model.get_input_embeddings().weight) == tied  # wrapping keeps the tie
    ids, mask = batch()
    names = ["a", None, "b", "c", "a", None]
    with torch.no_grad():
        logits = m(ids, attention_mask=mask, adapter_names=names).logits
        plain = base(tied)(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits[[1, 5]], plain[[1, 5]], **TOL)
    for name in ("a", "b", "c"):
        rows = [i for i, n in enumerate(names) if n == name]
        peft_model = get_peft_model(base(tied), peft_config(m, name))
        result = set_peft_model_state_dict(peft_model, m.adapter_state_dict(name))
        assert not result.unexpected_keys and not [k for k in result.missing_keys if "lora_" in k]
        # PEFT's LoRA is on the head only: the input embedding is the base's, still tied to it
        if tied and name != "b":
            inner = peft_model.base_model.model
            assert inner.model.embed_tokens.weight is inner.lm_head.base_layer.weight
        with torch.no_grad():
            expected = peft_model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(logits[rows], expected[rows], **TOL)
        assert not torch.allclose(logits[rows], plain[rows], atol=1e-3)

        folder = m.export_adapter(name, tmp_path / name)
        config = json.loads((folder / "adapter_config.json").read_text())
        assert ("lm_head" in config["target_modules"]) == (name != "b")
        with torch.no_grad():
            loaded = PeftModel.from_pretrained(base(tied), str(folder))(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(loaded[rows], logits[rows], **TOL)

    # PEFT's own folder (random lm_head LoRA) loads into a slot and gives PEFT's logits
    peft_model = get_peft_model(base(tied), LoraConfig(r=3, lora_alpha=6, target_modules=["lm_head"],
                                                       init_lora_weights=False))  # fmt: skip
    peft_model.save_pretrained(str(tmp_path / "peft"))
    m.remove_adapter("b")
    m.load_adapter("p", tmp_path / "peft")
    with torch.no_grad():
        got = m(ids, attention_mask=mask, adapter_names=["p"] * 6).logits
        torch.testing.assert_close(got, peft_model(input_ids=ids, attention_mask=mask).logits, **TOL)
    # the base head copy PEFT's save_embedding_layers writes is checked against this model's, never loaded
    state, config = read_peft_folder(tmp_path / "peft")
    assert "base_model.model.lm_head.base_layer.weight" in state
    state["base_model.model.lm_head.base_layer.weight"] = state["base_model.model.lm_head.base_layer.weight"] + 1
    with pytest.raises(ValueError, match="differ from this model's"):
        m.load_adapter_state_dict("q", state, config)


def _plain_logp(m, ids, mask, names, rows, pos, targets):
    logits = m(ids, attention_mask=mask, adapter_names=names).logits.double()
    logp_all = torch.log_softmax(logits[rows, pos - 1], dim=-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def _chunked_logp(m, ids, mask, names, rows, pos, targets, chunk):
    hidden = m.forward_hidden(ids, attention_mask=mask, adapter_names=names)
    head = m.output_head()
    lora = m.head_lora(names, rows)
    return token_logp_entropy(hidden[rows, pos - 1], head.weight, head.bias, targets, 1.0, chunk=chunk, lora=lora)


@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, 1024])
def test_chunked_token_logprobs_include_the_lm_head_lora_values_and_grads(chunk, sink):
    """float64 model: the chunked path's log-probs, entropies and every slot gradient (lm_head's A and B included)
    equal autograd through the full logits."""
    m = model_with_adapters(tied=True, dtype=torch.float64)
    if sink:
        m.use_slot_grads()
    ids, mask = batch()
    names = ["a", None, "b", "c", "a", "c"]
    g = torch.Generator().manual_seed(2)
    rows = torch.tensor([0, 0, 1, 2, 3, 3, 3, 4, 5, 5])
    pos = torch.tensor([1, 4, 2, 6, 1, 2, 5, 3, 3, 6])
    targets = torch.randint(0, 128, (len(rows),), generator=g)
    w_logp, w_ent = torch.randn(len(rows), generator=g, dtype=torch.float64), torch.randn(len(rows), generator=g)
    results = []
    for fn in (_plain_logp, lambda *a: _chunked_logp(*a, chunk=chunk)):
        m.zero_lora_grads()
        logp, ent = fn(m, ids, mask, names, rows, pos, targets)
        ((logp * w_logp).sum() + (ent.double() * w_ent.double()).sum()).backward()
        grads = {n: [None if t is None else t.clone() for t in m.adapter_grads(n)] for n in ("a", "b", "c")}
        results.append((logp.detach().double(), ent.detach().double(), grads))
    (want_logp, want_ent, want_grads), (logp, ent, grads) = results
    torch.testing.assert_close(logp, want_logp, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ent, want_ent, atol=1e-10, rtol=1e-10)
    head_index = [i for i, name in enumerate(m.adapter_modules("c"))]  # "c" covers lm_head only: A, B
    assert len(head_index) == 1 and len(grads["c"]) == 2
    for name in grads:
        for got, want in zip(grads[name], want_grads[name], strict=True):
            torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    assert grads["c"][1].abs().sum() > 0  # lm_head's B of "c" got a gradient


def test_head_lora_is_none_without_an_lm_head_target_or_covering_adapter():
    m = model_with_adapters(tied=False)
    assert m.head_lora(["b", None], torch.tensor([0, 1])) is None  # "b" does not cover lm_head
    assert m.head_lora(["a", "b"], torch.tensor([0, 1])).slots.tolist() == [m.slot_of("a"), -1]
    plain = MultiLoRAModel.from_model(base(False), 2, 4, "all-linear")
    assert "lm_head" not in plain.lora_modules and type(plain.output_head()) is torch.nn.Linear
    plain.add_adapter("x", 4, 8)
    assert plain.head_lora(["x"], torch.tensor([0])) is None
