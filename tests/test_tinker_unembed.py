"""`train_unembed` through the real `tinker` SDK: LoRA on `lm_head`, trained when a client asks for it (the SDK's
default), left alone when it does not, and saved as a PEFT folder that PEFT loads to the same log-probs, on a
`tie_word_embeddings` model (SmolLM2's layout)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tinker
import torch
from peft import PeftModel
from tinker import types
from transformers import AutoModelForCausalLM

from tests.test_tinker_server import BASE, MODEL, TOKEN, _datum, _logprobs, _Running, _sft
from tests.tiny_models import save_tiny_model, tiny_config, tiny_tokenizer

TOKENS = list(range(5, 25))


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    """A tiny Llama whose lm_head is tied to its input embedding, with the character tokenizer."""
    path = tmp_path_factory.mktemp("tied") / "model"
    config = tiny_config("llama")
    config.tie_word_embeddings = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def _head(ops, tc) -> dict[str, torch.Tensor]:
    """The client's lm_head LoRA tensors in its PEFT state dict (empty when its adapter does not cover lm_head)."""
    return {k: v for k, v in ops.backend.adapter_state_dict(ops.tenants[tc.model_id].name).items() if "lm_head" in k}


def test_train_unembed_trains_the_lm_head_lora_and_peft_loads_it(tied_model, tmp_path):
    server = _Running(tmp_path / "state", tied_model)
    try:
        ops = server.server.ops
        assert "lm_head" in ops.backend.lora_modules
        sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
        default = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()  # train_unembed=True
        without = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0, train_unembed=False).result()
        only = sc.create_lora_training_client(
            base_model=BASE, rank=4, seed=1, train_attn=False, train_mlp=False, train_unembed=True
        ).result()
        info = {tc: ops.tenants[tc.model_id].lora_config for tc in (default, without, only)}
        assert info[default] == {"train_attn": True, "train_mlp": True, "train_unembed": True}
        assert info[without]["train_unembed"] is False and info[only] == {
            "train_attn": False, "train_mlp": False, "train_unembed": True,
        }  # fmt: skip
        weights_info = (
            tinker.RestClient(base_url=server.url, api_key=TOKEN)
            .get_weights_info_by_tinker_path(default.save_state("s0").result().path)
            .result()
        )
        assert weights_info.train_unembed is True

        before = {tc: _head(ops, tc) for tc in (default, without, only)}
        assert before[without] == {} and set(before[only]) == {
            "base_model.model.lm_head.lora_A.weight", "base_model.model.lm_head.lora_B.weight",
        }  # fmt: skip
        assert all(
            t["base_model.model.lm_head.lora_B.weight"].abs().sum() == 0 for t in (before[default], before[only])
        )
        losses = {tc: _sft(tc, 3, TOKENS) for tc in (default, without, only)}
        assert all(v[-1] < v[0] for v in losses.values()), losses
        assert _head(ops, without) == {}  # no LoRA on its head: nothing to train there
        slot = ops.backend.shared_model.slot_of(ops.tenants[without.model_id].name)
        head = ops.backend.shared_model.base_model.lm_head
        assert head.lora_A[slot].abs().sum() == 0 and head.lora_B[slot].abs().sum() == 0
        for tc in (default, only):
            after = _head(ops, tc)
            assert after["base_model.model.lm_head.lora_B.weight"].abs().sum() > 0
            assert not torch.equal(after["base_model.model.lm_head.lora_A.weight"],
                                   before[tc]["base_model.model.lm_head.lora_A.weight"])  # fmt: skip
        # three steps of the same data with the same seed: with the head's LoRA the loss falls differently
        assert losses[default][-1] != pytest.approx(losses[without][-1], rel=1e-4)

        # the engine samples with the head LoRA too: its log-probs of the sampled tokens are the trainer's
        sampler = default.save_weights_and_get_sampling_client().result()
        seq = sampler.sample(types.ModelInput.from_ints(TOKENS[:4]), 1, types.SamplingParams(max_tokens=6, seed=0))
        seq = seq.result().sequences[0]
        full = TOKENS[:4] + list(seq.tokens)
        trainer_lp = _logprobs(default, full)[3:]  # the log-probs of the sampled positions
        np.testing.assert_allclose(seq.logprobs, trainer_lp, rtol=1e-4, atol=1e-5)
        base = sc.create_sampling_client(base_model=BASE)
        base_lp = base.compute_logprobs(types.ModelInput.from_ints(full)).result()[4:]
        assert not np.allclose(base_lp, trainer_lp, atol=1e-3)

        # save_state writes the PEFT folder: PEFT loads it on the tied base and gives the client's log-probs
        path = default.save_state("after").result().path
        folder = max((tmp_path / "state" / "adapters" / ops.tenants[default.model_id].name).glob("step_3*"))
        assert path.endswith("/weights/after") and (folder / "adapter_config.json").is_file()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PEFT warns that a tied layer is part of the adapter
            peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tied_model), str(folder))
        assert "lm_head" in peft_model.peft_config["default"].target_modules
        with torch.no_grad():
            logits = peft_model(input_ids=torch.tensor([TOKENS[:-1]])).logits[0].double()
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(TOKENS[1:])[:, None]).squeeze(-1)
        np.testing.assert_allclose(_logprobs(default, TOKENS), expected.numpy(), rtol=1e-4, atol=1e-5)
    finally:
        server.close()


def test_without_an_lm_head_lora_train_unembed_is_reported_false_and_alone_refused(tmp_path):
    save_tiny_model(MODEL, hidden=32, layers=2)
    server = _Running(tmp_path / "state", unembed_lora=False)
    try:
        ops = server.server.ops
        assert "lm_head" not in ops.backend.lora_modules
        sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
        tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
        assert ops.tenants[tc.model_id].lora_config["train_unembed"] is False
        tc.forward_backward([_datum(TOKENS)], "cross_entropy").result()
        with pytest.raises(tinker.RequestFailedError, match="no LoRA on lm_head"):
            sc.create_lora_training_client(
                base_model=BASE, rank=4, train_attn=False, train_mlp=False, train_unembed=True
            ).result()
    finally:
        server.close()
