"""A real SGLang server with LoRA: launch it, push an adapter from memory, generate, sync. Opt-in: `-m gpu`.

Needs `sglang` importable, a CUDA GPU, and a model folder: `RL_MULTILORA_GPU_MODEL`, else
`$RL_MULTILORA_PROVISION_DIR/model` (what `rl-multilora provision` writes). Skipped otherwise.
Tensors go in SGLang's own encoding (pickled CUDA IPC handles), which is valid because the server runs here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from pathlib import Path

import pytest
import torch

from rollout.sglang.launcher import SGLangLauncher
from rollout.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.gpu

# The tiny preset is float32 with head_dim 32: FA3 and FlashInfer want bf16/fp16 and head_dim 64+, so serve it in
# bf16 through the Triton attention kernels, in a small slice of the GPU. (--disable-cuda-graph is deprecated in
# sglang 0.5.23 but still accepted; older releases know only it.)
TINY_MODEL_ARGS = ["--dtype", "bfloat16", "--attention-backend", "triton", "--mem-fraction-static", "0.3",
                   "--disable-cuda-graph"]  # fmt: skip


def _model_dir() -> Path | None:
    explicit = os.environ.get("RL_MULTILORA_GPU_MODEL")
    if explicit:
        return Path(explicit)
    provisioned = os.environ.get("RL_MULTILORA_PROVISION_DIR")
    return Path(provisioned) / "model" if provisioned else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_real_sglang_loads_an_adapter_from_tensors_and_generates(tmp_path):
    if importlib.util.find_spec("sglang") is None or not torch.cuda.is_available():
        pytest.skip("needs sglang and a CUDA GPU")
    model_dir = _model_dir()
    if model_dir is None or not (model_dir / "config.json").is_file():
        pytest.skip("set RL_MULTILORA_GPU_MODEL or RL_MULTILORA_PROVISION_DIR to a provisioned model")
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    targets = ["q_proj", "v_proj"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft_model = get_peft_model(
            base, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False)
        )
    # Scale B up so the adapter visibly changes greedy output.
    tensors = {
        k: (v * 4 if "lora_B" in k else v).detach().to("cuda")
        for k, v in get_peft_model_state_dict(peft_model).items()
    }
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": targets, "bias": "none"}

    launcher = SGLangLauncher(
        str(model_dir),
        port=_free_port(),
        max_loras_per_batch=2,
        max_lora_rank=8,
        lora_target_modules=targets,
        extra_args=TINY_MODEL_ARGS,
        log_path=str(tmp_path / "sglang.log"),
        startup_timeout_s=600,
    )
    with launcher:
        engine = SGLangLauncher.attach(launcher.start(), tensor_format="sglang")
        assert engine.load_adapter("a", tensors, config) == 1
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
        prompt = [1, 2, 3, 4, 5, 6]
        lora_row, base_row = engine.generate(
            [GenerateRequest(prompt, "a", greedy), GenerateRequest(prompt, None, greedy)]
        )
        for row in (lora_row, base_row):
            assert row.finish_reason in ("stop", "length"), (row.error, launcher.log_tail())
            assert row.output_ids and len(row.output_logprobs) == len(row.output_ids)
        assert (lora_row.weight_version, base_row.weight_version) == (1, None)
        assert lora_row.output_ids != base_row.output_ids, "the adapter did not change the output"

        engine.pause()
        assert engine.load_adapter("a", {k: v * 0 for k, v in tensors.items()}, config) == 2  # a zero adapter
        engine.resume()
        after, base_again = engine.generate(
            [GenerateRequest(prompt, "a", greedy), GenerateRequest(prompt, None, greedy)]
        )
        assert after.weight_version == 2 and after.output_ids == base_again.output_ids


def test_tiny_grpo_run_against_a_real_sglang_server(tmp_path):
    """The shipped tiny config, a few steps, rolled out by a launched SGLang server instead of the embedded engine."""
    if importlib.util.find_spec("sglang") is None or not torch.cuda.is_available():
        pytest.skip("needs sglang and a CUDA GPU")
    import subprocess
    import sys

    from rl_multilora.metrics import read_metrics

    root = Path(__file__).resolve().parents[1]
    subprocess.run(["bash", str(root / "examples/multi_lora/provision.sh"), "artifacts/tiny"], check=True, cwd=root)
    run_dir = tmp_path / "run"
    sets = [f"run_dir={run_dir}", "rollout.engine=sglang", f"rollout.sglang_port={_free_port()}",
            "model.device=cuda", "logging.progress=false", "logging.plot=false",
            "rollout.sglang_args=" + json.dumps(TINY_MODEL_ARGS)]  # fmt: skip
    sets += [f"adapters.{i}.max_steps=3" for i in range(3)]
    cmd = [sys.executable, "-m", "rl_multilora.cli", "run", "examples/multi_lora/configs/tiny.yaml"]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(run_dir)
    assert {r["adapter"] for r in rows} == {"gsm8k", "arith", "compare"}
    assert all(r["failed_samples"] == 0 and r["n_samples"] > 0 for r in rows)
    # Versions advance with each push, and train/inference log-probs agree roughly (same weights, bf16 kernels).
    for name in ("gsm8k", "arith", "compare"):
        mine = [r for r in rows if r["adapter"] == name]
        assert mine[-1]["weight_version"] >= 1
        gaps = [r["logprob_gap"] for r in mine if r.get("logprob_gap") is not None]
        assert gaps and max(gaps) < 0.5
