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
    """rl_loop with `loss_fn=importance_sampling` (its default, stable_reinforce, is refused: Tinker does not publish
    its objective) and the served model's chat template: it samples groups, grades them, trains on every group whose
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


def test_rl_loop_default_loss_is_refused_saying_why(served, tmp_path):
    """rl_loop as shipped (stable_reinforce) fails on its first forward_backward with the server's reason."""
    _write_datasets(tmp_path)
    env = dict(os.environ, TINKER_API_KEY=TOKEN, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "hf-cache"), PYTHONPATH=str(ROOT))  # fmt: skip
    cmd = [sys.executable, "-m", "rl_multilora.tinker.cookbook", "rl_loop", "--model-dir", str(PRESET / "model"),
           "--renderer", "chat_template", f"base_url={served.url}", f"model_name={NAME}", "batch_size=4",
           "group_size=4", "max_tokens=8", "save_every=0", "lora_rank=8", f"log_path={tmp_path / 'rl'}"]  # fmt: skip
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode != 0 and "stable_reinforce" in out.stderr, out.stderr[-3000:]


def test_unknown_model_name_is_refused_naming_the_fix():
    out = subprocess.run(
        [sys.executable, "-m", "rl_multilora.tinker.cookbook", "sl_loop", "--model-dir", str(PRESET / "model"),
         "model_name=tiny"], capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 2 and "model_name='tiny'" in out.stderr and "meta-llama/Llama-3.2-1B:tiny" in out.stderr
