"""tinker-cookbook's `sl_loop` and `rl_loop`, unmodified, against the Tinker server on the tiny preset.

The recipes run in a subprocess through `python -m rl_multilora.tinker.cookbook` (which only registers the served
model's tokenizer and renderer with the cookbook's public registries). They read their datasets with
`datasets.load_dataset("HuggingFaceH4/no_robots")` / `("openai/gsm8k", "main")`; the tests write local folders of
those names into the working directory, from the preset's own task data. Skipped when tinker-cookbook is not
installed (`pip install --no-deps tinker-cookbook==0.6.1` plus the `cookbook` extra; docs/guides/tinker.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tinker

from tests.test_tinker_server import ROOT, TOKEN, _Running

pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (docs/guides/tinker.md)")
pytestmark = pytest.mark.slow

NAME = "meta-llama/Llama-3.2-1B:tiny"  # the cookbook's table gives this entry the role_colon renderer
PRESET = ROOT / "artifacts" / "tiny"
SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."  # rl_loop's own


@pytest.fixture(scope="module")
def preset():
    subprocess.run(["bash", str(ROOT / "examples/multi_lora/provision.sh"), str(PRESET)], check=True, cwd=ROOT)
    return PRESET


@pytest.fixture
def served(tmp_path, preset):
    import tests.test_tinker_server as base

    s = _Running(tmp_path / "state", preset / "model")
    s.server.base_model = NAME  # what `--base-model-name meta-llama/Llama-3.2-1B:tiny` sets
    assert base.BASE != NAME  # the module default stays untouched for the other tests
    yield s
    s.close()


def _rows(task: str) -> list[dict]:
    return [json.loads(line) for line in (PRESET / "data" / task / "train.jsonl").open()]


def _write_datasets(work: Path) -> None:
    """`HuggingFaceH4/no_robots` (conversations: a tiny-gsm8k question and its worked answer) and `openai/gsm8k`
    (config `main`: the preset's arith problems, answers as `#### N`), as local folders `datasets` reads first."""
    sl = work / "HuggingFaceH4" / "no_robots"
    sl.mkdir(parents=True)
    with (sl / "train.jsonl").open("w") as f:
        for r in _rows("gsm8k")[:128]:
            msgs = [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    rl = work / "openai" / "gsm8k"
    (rl / "main").mkdir(parents=True)
    (rl / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n---\n"
    )
    with (rl / "main" / "train.jsonl").open("w") as f:
        for r in _rows("arith")[:32]:
            f.write(json.dumps({"question": r["problem"].split(" Put")[0], "answer": f"#### {r['answer']}"}) + "\n")


RL_LOOP_PREFIX = [  # rl_loop's own few-shot turn (recipes/rl_loop.py)
    {"role": "user", "content": "How many r's are in strawberry?" + SUFFIX},
    {
        "role": "assistant",
        "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w 6) b 7) e 8) r 9) r "
        "10) y. We have r's at positions 3, 8, and 9. \\boxed{3}",
    },
]


def _one_questions() -> list[str]:
    return ["Compute 2 - 1."] * 32


def _write_one_dataset(work: Path) -> None:
    """`openai/gsm8k` (config `main`) of 32 short questions whose answer is 1."""
    rl = work / "openai" / "gsm8k"
    (rl / "main").mkdir(parents=True)
    (rl / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n---\n"
    )
    with (rl / "main" / "train.jsonl").open("w") as f:
        for q in _one_questions():
            f.write(json.dumps({"question": q, "answer": "#### 1"}) + "\n")


def _recipe(served, work: Path, recipe: str, *args: str, renderer: str = "table") -> subprocess.CompletedProcess:
    env = dict(os.environ, TINKER_API_KEY=TOKEN, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_DATASETS_CACHE=str(work / "hf-cache"), PYTHONPATH=str(ROOT), WANDB_MODE="disabled")  # fmt: skip
    cmd = [sys.executable, "-m", "rl_multilora.tinker.cookbook", recipe, "--model-dir", str(PRESET / "model"),
           "--renderer", renderer, f"base_url={served.url}", f"model_name={NAME}", f"log_path={work / recipe}",
           "save_every=0", "lora_rank=8", *args]  # fmt: skip
    out = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.open()]


def test_sl_loop_as_is_loss_falls(served, tmp_path):
    """sl_loop with the table's renderer (role_colon): 8 steps of 16 conversations, its train_mean_nll falls, and
    its final checkpoint is the server's (listed by the SDK's RestClient)."""
    _write_datasets(tmp_path)
    _recipe(served, tmp_path, "sl_loop", "batch_size=16", "learning_rate=3e-3")
    nll = [m["train_mean_nll"] for m in _metrics(tmp_path / "sl_loop" / "metrics.jsonl")]
    assert len(nll) == 8 and nll[-1] < 0.6 * nll[0], nll
    saved = _metrics(tmp_path / "sl_loop" / "checkpoints.jsonl")[-1]
    model_id = saved["state_path"].removeprefix("tinker://").split("/")[0]
    rest = tinker.ServiceClient(base_url=served.url, api_key=TOKEN).create_rest_client()
    names = [c.checkpoint_id for c in rest.list_checkpoints(model_id).result().checkpoints]
    assert "weights/final" in names, names


def test_rl_loop_as_is_runs_importance_sampling(served, tmp_path):
    """rl_loop with `loss_fn=importance_sampling` (a loss Tinker publishes) and the served model's chat template: it samples groups, grades them, trains on every group whose
    rewards differ, saves its final state and sampler weights, and the sampler it publishes samples.

    Reward is not asserted to rise: rl_loop's fixed GSM8K few-shot prompt is 240-260 tokens of text this toy base
    (256 positions, three synthetic tasks) scores at ~26 nats per token, so its rewards stay ~0 in a few steps."""
    _write_datasets(tmp_path)
    _recipe(served, tmp_path, "rl_loop", "batch_size=4", "group_size=4", "max_tokens=8",
            "loss_fn=importance_sampling", "learning_rate=1e-3", renderer="chat_template")  # fmt: skip
    metrics = _metrics(tmp_path / "rl_loop" / "metrics.jsonl")
    assert [m["progress/batch"] for m in metrics] == list(range(8)), metrics
    assert all(0.0 <= m["reward/total"] <= 1.0 for m in metrics), metrics
    saved = _metrics(tmp_path / "rl_loop" / "checkpoints.jsonl")[-1]
    assert saved["name"] == "final" and saved["sampler_path"].startswith("tinker://"), saved
    sc = tinker.ServiceClient(base_url=served.url, api_key=TOKEN)
    sampler = sc.create_sampling_client(model_path=saved["sampler_path"])
    prompt = tinker.types.ModelInput.from_ints([1, 4, 40])
    out = sampler.sample(prompt, 1, tinker.types.SamplingParams(max_tokens=4)).result()
    assert 1 <= len(out.sequences[0].tokens) <= 4


def _warm_start(served, log_path: Path) -> None:
    """A state rl_loop resumes from (its own `checkpoint_utils.get_last_checkpoint`, through the cookbook's own
    `save_checkpoint`): the tiny base never writes `\\boxed{}` after rl_loop's few-shot prompt, so every reward
    would be 0 and no step would train. Cross-entropy steps on that very prompt teach it to answer `\\boxed{1}` or
    `\\boxed{2}`; the dataset's answer is 1, so groups' rewards differ and rl_loop's steps train."""
    from tinker_cookbook import checkpoint_utils
    from transformers import AutoTokenizer

    from rl_multilora.tinker.cookbook import ChatTemplateRenderer

    renderer = ChatTemplateRenderer(AutoTokenizer.from_pretrained(str(PRESET / "model")))
    sc = tinker.ServiceClient(base_url=served.url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=NAME, rank=8, seed=0).result()
    data = []
    for i, q in enumerate(_one_questions()[:8]):
        prompt = renderer.build_generation_prompt([*RL_LOOP_PREFIX, {"role": "user", "content": q + SUFFIX}])
        answer = renderer.tokenizer.encode(f"\\boxed{{{1 + i % 2}}}", add_special_tokens=False)
        full = prompt.to_ints() + answer + [renderer.tokenizer.eos_token_id]
        n = prompt.length - 1
        weights = [0.0] * n + [1.0] * (len(full) - 1 - n)
        data.append(tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(full[:-1]),
                                       loss_fn_inputs={"target_tokens": full[1:], "weights": weights}))  # fmt: skip
    for _ in range(30):  # the loss flattens at 8 ln 2 (an even split of 1 and 2) after about 25 steps
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(tinker.types.AdamParams(learning_rate=5e-3)).result()
    log_path.mkdir(parents=True)
    checkpoint_utils.save_checkpoint(training_client=tc, name="warm", log_path=str(log_path), kind="state",
                                     loop_state={"batch": 0})  # fmt: skip


def test_rl_loop_as_shipped_trains_with_stable_reinforce(served, tmp_path):
    """rl_loop as shipped, with its default loss `stable_reinforce` (this project's objective; Tinker's is
    unpublished), from a warm start that answers `\\boxed{1}` or `\\boxed{2}` to a question whose answer is 1:
    its sampling client records every sequence, its datums' provenance is checked against the records, its steps
    train on the recorded sampler log-probs, and its reward rises (measured: 0.5, 0.5, 0.75, 1, 1, 1 and 0.5, 0.5, 1, 1, 1, 1)."""
    _write_one_dataset(tmp_path)
    _warm_start(served, tmp_path / "rl_loop")
    warm_batches = len(served.server.ops.batch_sizes)
    _recipe(served, tmp_path, "rl_loop", "batch_size=4", "group_size=4", "max_tokens=12", "max_steps=6",
            "learning_rate=1e-3", renderer="chat_template")  # fmt: skip
    metrics = _metrics(tmp_path / "rl_loop" / "metrics.jsonl")
    assert [m["progress/batch"] for m in metrics] == list(range(6)), metrics
    rewards = [m["reward/total"] for m in metrics]
    assert rewards[0] < 1.0 and np.mean(rewards[-2:]) > rewards[0], rewards
    assert len(served.server.ops.batch_sizes) > warm_batches  # stable_reinforce steps ran (groups with mixed rewards)
    assert served.server.ops.records.stats()["records"] == 6 * 16  # every sampled sequence, recorded
    saved = _metrics(tmp_path / "rl_loop" / "checkpoints.jsonl")[-1]
    assert saved["name"] == "final" and saved["sampler_path"].startswith("tinker://"), saved


def test_unknown_model_name_is_refused_naming_the_fix():
    out = subprocess.run(
        [sys.executable, "-m", "rl_multilora.tinker.cookbook", "sl_loop", "--model-dir", str(PRESET / "model"),
         "model_name=tiny"], capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 2 and "model_name='tiny'" in out.stderr and "meta-llama/Llama-3.2-1B:tiny" in out.stderr
