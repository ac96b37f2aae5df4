"""`rl-multilora provision`: the tiny presets' files load through the standard APIs, are seeded, idempotent, and the
Hub path calls the right downloads. `tiny` (Llama) and `tiny-moe` (Qwen3-MoE) share every test that is about the
recipe rather than the architecture. Unit tests shrink the model (hidden 64, 2 layers) and the pretraining; the full
presets and their base-stat targets are the slow tests."""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from datasets import load_dataset
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeForCausalLM

from rl_multilora.presets.tiny_config import PRESETS, SPECIAL_TOKENS, TinyPresetConfig
from rl_multilora.presets.tiny_tasks import TASKS, generate_example, render_response, score_response, strict_answer
from rl_multilora.provision import MARKER, main, provision

ROOT = Path(__file__).resolve().parents[1]

# Small enough for a few seconds on 2 shared cores, trained long enough to learn where responses end.
SMALL = TinyPresetConfig(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    vocab_size=512,
    n_train=40,
    n_test=10,
    pretrain_steps=150,
    batch_size=16,
    eval_prompts=4,
)
# The same, sparse: 4 experts of width 48 per layer, top-2 (48 != 64 / 2, so a transposed expert weight shows).
SMALL_MOE = replace(SMALL, family="qwen3_moe", num_experts=4, top_k=2, moe_intermediate_size=48)
SMALL_BY_PRESET = {"tiny": SMALL, "tiny-moe": SMALL_MOE}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return provision("tiny", tmp_path_factory.mktemp("tiny") / "out", seed=0, config=SMALL)


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory) -> Path:
    return provision("tiny-moe", tmp_path_factory.mktemp("tiny-moe") / "out", seed=0, config=SMALL_MOE)


@pytest.fixture(params=["tiny", "tiny-moe"])
def preset_dir(request) -> Path:
    """Each offline preset's small build, for the tests both must pass."""
    return request.getfixturevalue({"tiny": "tiny_dir", "tiny-moe": "tiny_moe_dir"}[request.param])


def test_model_tokenizer_and_datasets_load(preset_dir):
    record = json.loads((preset_dir / MARKER).read_text())
    tok = AutoTokenizer.from_pretrained(preset_dir / "model")
    model = AutoModelForCausalLM.from_pretrained(preset_dir / "model")
    assert model.config.model_type == record["model"]["family"] and model.config.hidden_size == 64
    # AutoTokenizer must read our tokenizer.json as is (no family tokenizer adding tokens past the embedding table).
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    raw = Tokenizer.from_file(str(preset_dir / "model" / "tokenizer.json"))
    text = "<|bos|><|user|>\nTom has 12 + 30 = 42 apples.  Two  spaces\n#### 42<|end|>"
    assert tok(text)["input_ids"] == raw.encode(text).ids
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<|pad|>", "<|bos|>", "<|end|>")
    assert model.generation_config.eos_token_id == tok.eos_token_id

    columns = {"gsm8k": ["question", "answer"], "arith": ["problem", "answer"], "compare": ["question", "answer"]}
    for task in TASKS:
        files = {s: str(preset_dir / "data" / task / f"{s}.jsonl") for s in ("train", "test")}
        ds = load_dataset("json", data_files=files)
        assert ds["train"].num_rows == SMALL.n_train and ds["test"].num_rows == SMALL.n_test
        assert ds["train"].column_names == columns[task]
        prompt_col = columns[task][0]
        assert not set(ds["train"][prompt_col]) & set(ds["test"][prompt_col]), "train and test must be disjoint"

    assert record["seed"] == 0 and record["settings"] == SMALL_BY_PRESET[record["preset"]].settings()
    assert record["data"]["arith"] == {"train": SMALL.n_train, "test": SMALL.n_test}
    assert set(record["base_stats"]) == set(TASKS)
    assert record["model"]["pretrain"]["final_loss"] < record["model"]["pretrain"]["first_loss"]


def test_tiny_moe_is_qwen3_moe_with_packed_experts_and_the_tiny_tokenizer_and_data(tiny_moe_dir, tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir / "model")
    assert type(model) is Qwen3MoeForCausalLM
    config = model.config
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 2, 48)
    assert config.norm_topk_prob and not config.output_router_logits
    assert config.decoder_sparse_step == 1 and config.mlp_only_layers == [], "every layer sparse"
    params = dict(model.named_parameters())
    for i in range(SMALL_MOE.num_layers):
        mlp = f"model.layers.{i}.mlp"
        assert params[f"{mlp}.experts.gate_up_proj"].shape == (4, 2 * 48, 64)  # (E, 2I, H), packed
        assert params[f"{mlp}.experts.down_proj"].shape == (4, 64, 48)  # (E, H, I)
        assert params[f"{mlp}.gate.weight"].shape == (4, 64)  # router (E, H)
        experts = {name.removeprefix(f"{mlp}.experts.") for name in params if name.startswith(f"{mlp}.experts.")}
        assert experts == {"gate_up_proj", "down_proj"}, "packed 3-D Parameters, no per-expert Linears"

    # transformers maps qwen3_moe to Qwen2Tokenizer; the saved tokenizer_class must keep AutoTokenizer on ours.
    moe_tok = AutoTokenizer.from_pretrained(tiny_moe_dir / "model")
    tiny_tok = AutoTokenizer.from_pretrained(tiny_dir / "model")
    assert type(moe_tok) is type(tiny_tok) and len(moe_tok) == len(tiny_tok) == model.config.vocab_size
    assert moe_tok.get_vocab() == tiny_tok.get_vocab()
    assert moe_tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(len(SPECIAL_TOKENS)))
    assert (moe_tok.pad_token_id, moe_tok.bos_token_id, moe_tok.eos_token_id) == (0, 1, 2)
    moe_files, tiny_files = _files(tiny_moe_dir), _files(tiny_dir)
    for name in ("model/tokenizer.json", "model/tokenizer_config.json", "model/chat_template.jinja"):
        assert moe_files[name] == tiny_files[name], name
    for name in (n for n in tiny_files if n.startswith("data/")):
        assert moe_files[name] == tiny_files[name], f"{name}: same seed, same datasets"

    record, tiny_record = (json.loads((d / MARKER).read_text()) for d in (tiny_moe_dir, tiny_dir))
    assert record["preset"] == "tiny-moe" and record["model"]["family"] == "qwen3_moe"
    counts = {k: record["model"][k] for k in ("num_experts", "top_k", "moe_intermediate_size")}
    assert counts == {"num_experts": 4, "top_k": 2, "moe_intermediate_size": 48}
    assert record["settings"]["family"] == "qwen3_moe" and record["settings"]["num_experts"] == 4
    # The dense record reads as before the MoE fields existed (old `tiny` directories still match their recipe).
    assert tiny_record["model"]["family"] == "llama" and "num_experts" not in tiny_record["model"]
    assert not {"family", "num_experts", "top_k", "moe_intermediate_size"} & set(tiny_record["settings"])


def test_dataset_rows_hold_the_right_answers(tiny_dir):
    gsm8k = [json.loads(line) for line in (tiny_dir / "data/gsm8k/train.jsonl").read_text().splitlines()]
    for row in gsm8k:
        assert strict_answer("gsm8k", row["answer"]) is not None, "GSM8K solutions end with '#### N'"
    for line in (tiny_dir / "data/arith/test.jsonl").read_text().splitlines():
        row = json.loads(line)
        a, b = row["problem"].removeprefix("Compute ").split(".")[0].split(" + ")
        assert int(row["answer"]) == int(a) + int(b)
        assert "\\boxed{}" in row["problem"]
    for line in (tiny_dir / "data/compare/test.jsonl").read_text().splitlines():
        row = json.loads(line)
        word = row["question"].split(":")[0].removeprefix("Which is ")
        a, b = (int(x) for x in row["question"].split(": ")[1].split("?")[0].split(" or "))
        assert int(row["answer"]) == (max(a, b) if word == "larger" else min(a, b))


def test_chat_template_and_digit_tokens(preset_dir):
    tok = AutoTokenizer.from_pretrained(preset_dir / "model")
    messages = [{"role": "user", "content": "Compute 17 + 25."}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|bos|><|user|>\nCompute 17 + 25.<|end|>\n<|assistant|>\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == tok(text)["input_ids"], "encoding the rendered template must not add a second BOS"
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1

    digits = tok("9081726354", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(digits) == list("9081726354")
    for sample in ("Tom has 12 + 30 = 42 apples.\n#### 42", "17 + 25 = 30 + 12 = 42, so the answer is \\boxed{42}."):
        assert tok.decode(tok(sample)["input_ids"]) == sample
    with pytest.raises(Exception, match="role"):
        tok.apply_chat_template([{"role": "robot", "content": "hi"}], tokenize=False)


def test_model_generates_a_response_that_ends_in_eos(preset_dir):
    tok = AutoTokenizer.from_pretrained(preset_dir / "model")
    model = AutoModelForCausalLM.from_pretrained(preset_dir / "model")
    rows = [json.loads((preset_dir / "data" / t / "test.jsonl").read_text().splitlines()[0]) for t in TASKS]
    prompts = [tok.apply_chat_template([{"role": "user", "content": r.get("question", r.get("problem"))}],
                                       add_generation_prompt=True, tokenize=False) for r in rows]  # fmt: skip
    batch = tok(prompts, padding=True, return_tensors="pt")
    assert (batch["attention_mask"][:, 0] == 0).any(), "padding side is left, ready for generation"
    out = model.generate(**batch, do_sample=False, max_new_tokens=48)  # (3, P + new)
    for row in out[:, batch["input_ids"].shape[1] :].tolist():
        assert tok.eos_token_id in row, tok.decode(row)
        assert tok.decode(row[: row.index(tok.eos_token_id)]).strip(), "a non-empty response before EOS"


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_same_seed_same_files_other_seed_other_data(tmp_path, preset):
    cfg = replace(SMALL_BY_PRESET[preset], pretrain_steps=2, eval_prompts=0)
    a = _files(provision(preset, tmp_path / "a", seed=3, config=cfg))
    b = _files(provision(preset, tmp_path / "b", seed=3, config=cfg))
    a.pop(MARKER), b.pop(MARKER)  # the marker records wall times
    assert a.keys() == b.keys() and "model/model.safetensors" in a and "model/tokenizer.json" in a
    for name in a:
        assert a[name] == b[name], f"{name} differs between two runs with the same seed"
    c = _files(provision(preset, tmp_path / "c", seed=4, config=cfg))
    assert c["data/arith/train.jsonl"] != a["data/arith/train.jsonl"]
    assert c["model/model.safetensors"] != a["model/model.safetensors"]


def test_progress_callback_sees_every_step_and_changes_nothing():
    """The progress display hooks into pretraining; a slow, jittery hook must leave the weights as they were."""
    from rl_multilora.presets.tiny import build_model, build_tokenizer, pretrain, tokenizer_corpus

    cfg = replace(SMALL, pretrain_steps=6)
    tok = build_tokenizer(tokenizer_corpus(0, per_task=40), cfg.vocab_size, cfg.max_positions)
    jitter = random.Random(0)
    weights, losses = [], []
    for on_step in (None, lambda done, loss: (losses.append((done, loss)), time.sleep(jitter.random() / 50))):
        model = build_model(tok, cfg, 0)
        pretrain(model, tok, cfg, 0, exclude=set(), on_step=on_step)
        weights.append(model.state_dict())
    assert [done for done, _ in losses] == list(range(1, 7))
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_phases_are_logged_and_pretraining_shows_a_bar(tmp_path, caplog, capsys):
    cfg = replace(SMALL, pretrain_steps=14, eval_prompts=2)
    with caplog.at_level(logging.INFO, logger="rl_multilora.provision"):
        provision("tiny", tmp_path / "out", seed=0, config=cfg, progress=True)
        provision("tiny", tmp_path / "out", seed=0, config=cfg)
    text = caplog.text
    for line in ("provisioning tiny (seed 0)", "datasets: gsm8k, arith, compare", "tokenizer: byte-level BPE",
                 "pretraining 14 steps of 16 examples: about", "s/step over steps 3-12",
                 "pretraining done: 14 steps in", "evaluating the base model: 2 held-out prompts", "base reward: gsm8k",
                 "provisioned tiny into", "already holds tiny (seed 0): nothing to do"):  # fmt: skip
        assert line in text, line
    assert "pretraining step" not in text, "with a bar, no periodic progress lines"
    bar = capsys.readouterr().err
    assert "pretraining" in bar and "14/14" in bar and "loss=" in bar

    # No terminal (a log file, a pipe): no bar, a progress line every 10 % of the steps instead.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rl_multilora.provision"):
        quiet = replace(cfg, pretrain_steps=20, eval_prompts=0)
        provision("tiny", tmp_path / "out", seed=0, config=quiet, force=True, progress=False)
    assert "pretraining step 2/20  loss" in caplog.text and "pretraining step 18/20" in caplog.text
    assert "evaluating the base model" not in caplog.text and "14/14" not in capsys.readouterr().err


def test_idempotent_unless_forced(tmp_path):
    cfg = replace(SMALL, pretrain_steps=1, eval_prompts=0)
    out = provision("tiny", tmp_path / "out", seed=0, config=cfg)
    marker = out / MARKER
    first = marker.read_text()
    weights_mtime = (out / "model/model.safetensors").stat().st_mtime_ns
    assert provision("tiny", out, seed=0, config=cfg) == out
    assert marker.read_text() == first and (out / "model/model.safetensors").stat().st_mtime_ns == weights_mtime

    with pytest.raises(FileExistsError, match="force"):
        provision("tiny", out, seed=1, config=cfg)
    (out / "keep.txt").write_text("user file")
    provision("tiny", out, seed=1, force=True, config=cfg)
    assert json.loads(marker.read_text())["seed"] == 1
    assert (out / "keep.txt").read_text() == "user file", "force clears only what provisioning writes"

    moe = replace(SMALL_MOE, pretrain_steps=1, eval_prompts=0)
    with pytest.raises(FileExistsError, match="preset='tiny' seed=1"):
        provision("tiny-moe", out, seed=1, config=moe)  # same seed and sizes, other architecture: another recipe
    provision("tiny-moe", out, seed=1, force=True, config=moe)
    assert json.loads(marker.read_text())["model"]["family"] == "qwen3_moe"


def test_hub_preset_downloads_model_and_gsm8k(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub

    calls = {}

    def fake_snapshot_download(repo_id, local_dir, **kwargs):
        calls["snapshot"] = (repo_id, local_dir, kwargs)
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        (Path(local_dir) / "config.json").write_text("{}")
        return local_dir

    gsm8k = {
        "train": [{"question": "Natalia sold 48 clips. How many?", "answer": "She sold 48.\n#### 48"}],
        "test": [{"question": "Q1?", "answer": "1 + 1 = <<1+1=2>>2\n#### 2"}, {"question": "Q2?", "answer": "#### 3"}],
    }

    def fake_load_dataset(path, name=None, **kwargs):
        calls["dataset"] = (path, name, kwargs)
        return gsm8k

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = TinyPresetConfig(n_train=30, n_test=5)
    out = provision("Qwen/Qwen3-4B", tmp_path / "hub", seed=0, config=cfg)

    assert calls["snapshot"][:2] == ("Qwen/Qwen3-4B", str(out / "model"))
    assert calls["dataset"][:2] == ("openai/gsm8k", "main")
    test_rows = [json.loads(line) for line in (out / "data/gsm8k/test.jsonl").read_text().splitlines()]
    assert test_rows == gsm8k["test"]
    assert len((out / "data/arith/train.jsonl").read_text().splitlines()) == 30
    assert len((out / "data/compare/test.jsonl").read_text().splitlines()) == 5
    record = json.loads((out / MARKER).read_text())
    assert record["preset"] == "Qwen/Qwen3-4B" and record["data"]["gsm8k"] == {"train": 1, "test": 2}


def test_bad_input_names_the_field(tmp_path, capsys):
    with pytest.raises(
        ValueError, match="preset='tiny-ish' is not allowed; use 'tiny', 'tiny-moe', 'smollm2-135m' or a Hub model id"
    ):
        provision("tiny-ish", tmp_path)
    with pytest.raises(ValueError, match="config.family='llama' does not fit preset='tiny-moe'"):
        provision("tiny-moe", tmp_path, config=SMALL)
    with pytest.raises(ValueError, match="num_experts=4 needs family='qwen3_moe'"):
        TinyPresetConfig(num_experts=4)
    with pytest.raises(ValueError, match="family='mixtral' must be one of 'llama', 'qwen3_moe'"):
        TinyPresetConfig(family="mixtral")
    with pytest.raises(ValueError, match=r"top_k=3 must be in \[1, num_experts=2\]"):
        replace(PRESETS["tiny-moe"], num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="seed=-1"):
        provision("tiny", tmp_path, seed=-1)
    with pytest.raises(ValueError, match="pretrain_steps=-5"):
        provision("tiny", tmp_path, pretrain_steps=-5)
    with pytest.raises(ValueError, match="hidden_size=0.*right_format_rate=1.5"):
        TinyPresetConfig(hidden_size=0, right_format_rate=1.5)
    assert not (tmp_path / MARKER).exists()
    assert main(["--preset", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "'tiny', 'tiny-moe'" in capsys.readouterr().err


def test_the_console_command_refuses_mistakes_with_exit_2_and_no_traceback(tmp_path, capsys, monkeypatch):
    """`rl-multilora provision` (cli.main) reports a mistake as `python -m rl_multilora.provision` does: exit 2 and the
    reason; only a marker is written here, so nothing is built."""
    from rl_multilora import cli

    monkeypatch.setattr("sys.path", list(sys.path))  # cli.main puts the working directory on it
    out = tmp_path / "tiny"
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"preset": "tiny", "seed": 0, "settings": PRESETS["tiny"].settings()}))
    assert cli.main(["provision", "--out", str(out), "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert "already holds preset='tiny' seed=0" in err and "--force" in err and "Traceback" not in err
    assert cli.main(["provision", "--preset", "tinyy", "--out", str(tmp_path / "x")]) == 2
    assert "preset='tinyy' is not allowed" in capsys.readouterr().err
    for flag in ("--seed", "--pretrain-steps"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["provision", "--out", str(out), flag, "-1"])
        assert exit_.value.code == 2
        assert f"argument {flag}: '-1' is not allowed; allowed: an int >= 0" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_without_out_a_preset_goes_to_artifacts_preset(tmp_path, capsys, monkeypatch, preset):
    from rl_multilora import cli

    monkeypatch.setattr("sys.path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    recipe = {"preset": preset, "seed": 0, "settings": PRESETS[preset].settings()}
    (tmp_path / "artifacts" / preset).mkdir(parents=True)
    (tmp_path / "artifacts" / preset / MARKER).write_text(json.dumps(recipe))  # already provisioned: nothing built
    assert cli.main(["provision", "--preset", preset]) == 0
    assert f"provisioned {preset} (seed 0) in artifacts/{preset}" in capsys.readouterr().out


@pytest.mark.parametrize("task", TASKS)
def test_rendered_responses_score_by_format_and_number(task):
    rng = random.Random(0)
    for _ in range(50):
        ex = generate_example(task, rng)
        right = score_response(task, render_response(ex, right_format=True), ex.label)
        off = score_response(task, render_response(ex, right_format=False), ex.label)
        assert (right.format_ok, right.correct, right.reward) == (True, True, 1.0)
        assert (off.format_ok, off.correct, off.reward) == (False, True, 0.0)
        wrong = render_response(ex, right_format=True).replace(ex.label, str(int(ex.label) + 1))
        assert score_response(task, wrong, ex.label).reward == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_full_tiny_preset_base_stats_in_target_range(tmp_path, preset):
    # The folder the run tests train on (artifacts/<preset>, seed 0): provisioned once per checkout, so CI builds each
    # preset once. A checkout that holds another recipe there provisions a fresh copy in tmp_path instead.
    torch.manual_seed(0)
    try:
        out = provision(preset, ROOT / "artifacts" / preset, seed=0)
    except FileExistsError:
        out = provision(preset, tmp_path / preset, seed=0)
    record = json.loads((out / MARKER).read_text())
    for task, stats in record["base_stats"].items():
        # Target 0.15-0.5 with ~0.04 sampling error on 96 prompts: a little slack on both ends.
        assert 0.12 <= stats["reward"] <= 0.55, (task, stats)
        assert 0.2 <= stats["format_rate"] <= 0.7, (task, stats)
        assert stats["correct_rate"] >= 0.35, (task, stats)
        assert stats["eos_rate"] >= 0.9 and stats["mean_response_tokens"] <= 40, (task, stats)
    assert record["timings"]["total_s"] < 600


def test_two_provisionings_of_one_directory_at_once_build_it_once(tmp_path):
    """Two provisionings of the same folder at the same time (CI's side-by-side slow tests, two shells): the second
    waits on `<out>.lock` and then finds the first's marker, instead of clearing the folder under it."""
    import threading

    from rl_multilora.provision import _build

    calls, out = [], tmp_path / "preset"

    def build(folder: Path) -> dict:
        calls.append(threading.get_ident())
        (folder / "model").mkdir()
        time.sleep(0.5)  # the other thread arrives while this one is building
        return {"timings": {}}

    recipe = {"preset": "fake", "seed": 0}
    threads = [threading.Thread(target=_build, args=(out, recipe, False, build, (), True)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == 1
    assert json.loads((out / MARKER).read_text())["preset"] == "fake" and (out / "model").is_dir()
