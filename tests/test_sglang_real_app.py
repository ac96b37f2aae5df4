"""SGLangEngine and the weight sync against SGLang's own code: its HTTP app, auth middleware, request structs,
`/generate` contract check, LoRA registry, restricted unpickler and LoRA weight loader (no GPU needed).

The server is `tests/sglang_real_app_server.py`, run by a Python that has sglang installed: the one named by
`RL_MULTILORA_SGLANG_PYTHON`, else this interpreter if it can import sglang (sglang pins its own torch, so CI
puts it in a venv of its own; see `.ci/run`). Only the model forward is missing; everything the backend received
goes to an event log that these tests read. Marked `sglang`; skipped where no such Python exists.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import torch

from rl_multilora.config import parse_run_config
from rl_multilora.loop import run
from rl_multilora.lora import MultiLoRAModel
from rl_multilora.metrics import read_metrics
from rl_multilora.weight_sync import WeightSync
from rollout.sglang.client import SGLangEngine, SGLangError
from rollout.types import GenerateRequest, SamplingParams
from tests.tiny_models import save_tiny_model, sum_task_adapter, write_sum_task

pytestmark = pytest.mark.sglang

API_KEY = "oracle-key"
SLOW_TOKEN = 99  # prompts starting with this token stay in flight (up to 60 s) until a pause aborts them
ROOT = Path(__file__).resolve().parents[1]


def _sglang_python() -> str | None:
    explicit = os.environ.get("RL_MULTILORA_SGLANG_PYTHON")
    if explicit:
        return explicit
    return sys.executable if importlib.util.find_spec("sglang") is not None else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Oracle:
    def __init__(self, url: str, log: Path, model: Path, data: Path) -> None:
        self.url, self.log, self.model, self.data = url, log, model, data

    def events(self, kind: str | None = None, since: int = 0) -> list[dict]:
        rows = [json.loads(line) for line in self.log.read_text().splitlines()[since:]]
        return [r for r in rows if kind is None or r["event"] == kind]

    def mark(self) -> int:
        return len(self.log.read_text().splitlines())

    def engine(self, **kw) -> SGLangEngine:
        return SGLangEngine(self.url, api_key=kw.pop("api_key", API_KEY), tensor_format="sglang", **kw)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    python = _sglang_python()
    if python is None:
        pytest.skip("needs sglang: set RL_MULTILORA_SGLANG_PYTHON to a Python with sglang installed")
    root = tmp_path_factory.mktemp("sglang_oracle")
    model = save_tiny_model(root / "model", family="llama", hidden=32, layers=2)
    for name, off in [("t1", 1), ("t2", 3)]:
        write_sum_task(root / "data" / f"{name}.jsonl", 40, off)
    port, log = _free_port(), root / "events.jsonl"
    cmd = [python, str(ROOT / "tests" / "sglang_real_app_server.py"), "--model", str(model), "--port", str(port),
           "--api-key", API_KEY, "--log", str(log), "--max-loras-per-batch", "4", "--max-lora-rank", "8"]  # fmt: skip
    env = dict(os.environ, ORACLE_SLOW_FIRST_TOKEN=str(SLOW_TOKEN))
    out = open(root / "server.out", "wb")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    while True:
        if proc.poll() is not None:
            pytest.fail(f"SGLang harness exited with {proc.returncode}:\n{(root / 'server.out').read_text()[-3000:]}")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                break
        except requests.RequestException:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"SGLang harness not healthy in 240 s:\n{(root / 'server.out').read_text()[-3000:]}")
        time.sleep(0.5)
    yield Oracle(url, log, model, root / "data")
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    out.close()


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


def _model(oracle: Oracle) -> MultiLoRAModel:
    model = MultiLoRAModel.from_pretrained(oracle.model, max_loras=4, max_rank=8)
    model.add_adapter("full", rank=4, alpha=8, seed=1)
    model.add_adapter("attn", rank=8, alpha=16, seed=2, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():  # non-zero B, so the bytes SGLang receives are the trained-looking values
        for p in model.adapter_parameters("full") + model.adapter_parameters("attn"):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    return model


def _tenant(name: str, version: int = 0) -> tuple[str, int]:
    """What WeightSync is told to push for a tenant: its name and the version to give it."""
    return (name, version)


def test_weight_sync_reaches_sglangs_lora_loader_bit_exact(oracle):
    model, engine, mark = _model(oracle), oracle.engine(), oracle.mark()
    sync = WeightSync(engine, model)
    t_full, t_attn = _tenant("full"), _tenant("attn")
    stats = sync.sync(push=[t_full, t_attn], unload=[])
    assert stats.adapters_pushed == ["full", "attn"] and engine.adapter_versions() == {"full": 0, "attn": 0}

    received = {e["lora_name"]: e["tensors"] for e in oracle.events("backend_tensors", mark)}
    for name in ("full", "attn"):
        sent = model.adapter_state_dict(name)
        # SGLang's unpickler rebuilt exactly our tensors (names, shapes, dtypes, bytes).
        assert set(received[name]) == set(sent)
        for key, t in sent.items():
            assert received[name][key] == {"sha256": _sha(t), "shape": list(t.shape), "dtype": "float32"}, key
    loaded = {e["lora_name"]: e for e in oracle.events("backend_loaded", mark)}
    assert loaded["full"]["scaling"] == pytest.approx(8 / 4) and loaded["attn"]["scaling"] == pytest.approx(16 / 8)
    # SGLang's loader stacked our per-projection tensors into its fused modules, in every layer.
    for layer in ("0", "1"):
        full = {k.split(f"layers.{layer}.")[1] for k in loaded["full"]["layers"][layer]}
        assert {"self_attn.qkv_proj.lora_A.weight", "self_attn.o_proj.lora_B.weight",
                "mlp.gate_up_proj.lora_A.weight", "mlp.down_proj.lora_B.weight"} <= full  # fmt: skip
        attn = {k.split(f"layers.{layer}.")[1] for k in loaded["attn"]["layers"][layer]}
        assert attn == {"self_attn.qkv_proj.lora_A.weight", "self_attn.qkv_proj.lora_B.weight"}
    # One pause for the whole sync, prefix cache flushed before generation continues.
    order = [e["event"] for e in oracle.events(since=mark) if e["event"] in ("pause", "flush_cache", "continue")]
    assert order == ["pause", "flush_cache", "continue"]
    sync.sync(push=[], unload=[t_full[0], t_attn[0]])


def test_generate_requests_pass_sglangs_contract_and_sampling_checks(oracle):
    model, engine, mark = _model(oracle), oracle.engine(), oracle.mark()
    WeightSync(engine, model).sync(push=[_tenant("full")], unload=[])
    params = [
        SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=5, stop_token_ids=[2]),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=3),
        SamplingParams(temperature=0.0, max_new_tokens=2),
    ]
    reqs = [GenerateRequest([5, 6, 7], "full", params[0]), GenerateRequest([5, 6], "full", params[1]),
            GenerateRequest([8, 9], None, params[2])]  # fmt: skip
    results = engine.generate(reqs)
    for req, res in zip(reqs, results, strict=True):
        assert res.error is None and res.finish_reason == "length"
        assert len(res.output_ids) == req.sampling.max_new_tokens == len(res.output_logprobs)
    assert [r.weight_version for r in results] == [0, 0, None]
    seen = {tuple(e["input_ids"]): e for e in oracle.events("generate", mark)}
    first, second, base = seen[(5, 6, 7)], seen[(5, 6)], seen[(8, 9)]
    assert (first["lora_path"], second["lora_path"], base["lora_path"]) == ("full", "full", None)
    assert first["lora_id"] and first["return_logprob"] is True
    # What SGLang's SamplingParams made of ours: top_k=-1 is the whole vocabulary, greedy is top_k=1.
    assert first["sampling"] == {"max_new_tokens": 5, "temperature": 1.0, "top_p": 1.0, "top_k": 1 << 30,
                                 "stop_token_ids": [2]}  # fmt: skip
    assert second["sampling"]["top_k"] == 20 and second["sampling"]["temperature"] == pytest.approx(0.7)
    assert base["sampling"]["top_k"] == 1
    engine.unload_adapter("full")


def test_sync_aborts_requests_in_flight_and_reloads_after_unload(oracle):
    model, engine, mark = _model(oracle), oracle.engine(), oracle.mark()
    sync = WeightSync(engine, model)
    attn = _tenant("attn")
    sync.sync(push=[attn], unload=[])
    out: list = []
    worker = threading.Thread(
        target=lambda: out.extend(engine.generate([GenerateRequest([SLOW_TOKEN, 1], "attn", SamplingParams())])),
    )
    worker.start()
    deadline = time.time() + 30
    while not any(e["input_ids"][0] == SLOW_TOKEN for e in oracle.events("generate", mark)):
        assert time.time() < deadline, "the slow request never reached the server"
        time.sleep(0.05)
    sync.sync(push=[_tenant("attn", 1)], unload=[])  # new weights under the same name while a request is in flight
    worker.join(timeout=30)
    assert not worker.is_alive()
    # The in-flight request came back aborted (to be resubmitted), not completed on a mix of versions.
    assert len(out) == 1 and out[0].finish_reason == "abort" and out[0].weight_version == 0
    events = [e for e in oracle.events(since=mark) if e["event"] != "generate"]
    step = [e["event"] for e in events][-6:]
    assert step == ["pause", "backend_unloaded", "backend_tensors", "backend_loaded", "flush_cache", "continue"]
    assert events[-6]["mode"] == "abort" and events[-6]["inflight"] == 1
    again = engine.generate([GenerateRequest([1, 2], "attn", SamplingParams(max_new_tokens=2))])
    assert again[0].finish_reason == "length" and again[0].weight_version == 1
    engine.unload_adapter("attn")


def test_tp_size_comes_from_sglangs_server_info(oracle):
    """SGLang wants one serialized tensor copy per TP rank; an attached server says its size in /server_info."""
    assert oracle.engine().server_tp_size() == 1
    assert oracle.engine(api_key="not-the-key").server_tp_size() is None  # refused: the caller falls back to 1


def test_sglangs_auth_and_validation_errors_reach_the_caller(oracle):
    model = _model(oracle)
    wrong = oracle.engine(api_key="not-the-key")
    assert wrong.health()  # /health needs no key in SGLang
    with pytest.raises(SGLangError, match="401.*api_key"):
        wrong.load_adapter("full", model.adapter_state_dict("full"), model.peft_config("full"))
    with pytest.raises(SGLangError, match="401.*api_key"):
        wrong.generate([GenerateRequest([1, 2], None, SamplingParams(max_new_tokens=1))])
    engine = oracle.engine()
    unknown = engine.generate([GenerateRequest([1, 2], "never-loaded", SamplingParams(max_new_tokens=1))])
    assert unknown[0].finish_reason == "error" and "never been loaded: never-loaded" in unknown[0].error
    # Rank 8 is the server's --max-lora-rank; SGLang's memory-pool check refuses rank 16.
    big = MultiLoRAModel.from_pretrained(oracle.model, max_loras=1, max_rank=16)
    big.add_adapter("big", rank=16, alpha=16, seed=0)
    with pytest.raises(SGLangError, match="incompatible with the current LoRA memory pool"):
        engine.load_adapter("big", big.adapter_state_dict("big"), big.peft_config("big"))
    assert "big" not in engine.adapter_versions()


def test_load_from_a_peft_folder_uses_sglangs_file_loader(oracle, tmp_path):
    model, engine, mark = _model(oracle), oracle.engine(), oracle.mark()
    folder = model.export_adapter("attn", tmp_path / "attn")
    assert engine.load_adapter_from_path("attn-disk", str(folder)) == 1
    loaded = oracle.events("backend_loaded", mark)[-1]
    assert loaded["lora_name"] == "attn-disk" and loaded["source"] == "path" and loaded["scaling"] == 2.0
    assert sorted(k.split("layers.0.")[1] for k in loaded["layers"]["0"]) == [
        "self_attn.qkv_proj.lora_A.weight", "self_attn.qkv_proj.lora_B.weight"]  # fmt: skip
    res = engine.generate([GenerateRequest([3, 4], "attn-disk", SamplingParams(max_new_tokens=2))])
    assert res[0].finish_reason == "length" and res[0].weight_version == 1
    engine.unload_adapter("attn-disk")


def test_grpo_loop_drives_sglangs_app(oracle, tmp_path):
    """`rollout.engine: sglang` with `url`: the loop attaches, pushes from memory, pauses once per step."""
    run_dir = tmp_path / "run"
    ads = [sum_task_adapter(oracle.data, name, i, max_steps=2) for i, name in enumerate(["t1", "t2"])]
    cfg = {
        "run_dir": str(run_dir),
        "model": {"path": str(oracle.model), "max_loras": 2, "max_rank": 8},
        "rollout": {
            "engine": "sglang",
            "url": oracle.url,
            "api_key": API_KEY,
            "n_samples_per_prompt": 2,
            "max_new_tokens": 4,
        },  # fmt: skip
        "grpo": {"micro_batch_size": 4, "drop_uniform_groups": False},
        "logging": {"plot": False, "progress": False},
        "rewards": {"num_workers": 1},
        "adapters": ads,
    }
    mark = oracle.mark()
    rt = run(parse_run_config(cfg))
    assert rt.engine.tp_size == 1 and rt.engine.module_shapes == rt.backend.model.layer_shapes
    assert all(rec.state.value == "REMOVED" for rec in rt.tenants.tenants.values())
    rows = read_metrics(run_dir)
    assert sorted((r["adapter"], r["adapter_step"]) for r in rows) == [("t1", 1), ("t1", 2), ("t2", 1), ("t2", 2)]
    assert all(r["failed_samples"] == 0 and r["n_samples"] == 4 for r in rows)
    events = oracle.events(since=mark)
    gens = [e for e in events if e["event"] == "generate" and not e["rid"].startswith("HEALTH")]
    assert gens and all(e["lora_path"] in ("t1", "t2") and e["lora_id"] for e in gens)
    # Initial push + one sync per step, each a single pause; every push after the first replaces a loaded name.
    pauses = [e for e in events if e["event"] == "pause"]
    assert len(pauses) == rt.weight_sync.pauses
    assert all(p["mode"] == "abort" for p in pauses)
    loads = [e["lora_name"] for e in events if e["event"] == "backend_loaded"]
    assert loads.count("t1") >= 2 and loads.count("t2") >= 2


def test_adapter_on_q_proj_alone_loads_with_zero_siblings(oracle):
    """SGLang's loader fuses q/k/v and needs v_proj beside q_proj: the engine fills the group with exact zeros."""
    model = MultiLoRAModel.from_pretrained(oracle.model, max_loras=1, max_rank=8)
    model.add_adapter("qonly", rank=4, alpha=8, seed=0, target_modules=["q_proj"])
    tensors, config = model.adapter_state_dict("qonly"), model.peft_config("qonly")
    with pytest.raises(SGLangError, match="v_proj"):  # what SGLang does with the adapter as PEFT wrote it
        oracle.engine().load_adapter("qonly", tensors, config)
    engine, mark = oracle.engine(module_shapes=model.layer_shapes), oracle.mark()
    assert engine.load_adapter("qonly", tensors, config) == 1
    received = oracle.events("backend_tensors", mark)[-1]["tensors"]
    for key, t in tensors.items():  # the trained factors arrive unchanged, the added ones are zeros
        assert received[key]["sha256"] == _sha(t)
    zeros = {k: v for k, v in received.items() if k not in tensors}
    assert {k.split(".")[-3] for k in zeros} == {"k_proj", "v_proj"}
    assert all(v["sha256"] == _sha(torch.zeros(v["shape"])) for v in zeros.values())
    loaded = oracle.events("backend_loaded", mark)[-1]["layers"]["0"]
    assert sorted(k.split("layers.0.")[1] for k in loaded) == [
        "self_attn.qkv_proj.lora_A.weight", "self_attn.qkv_proj.lora_B.weight"]  # fmt: skip
    engine.unload_adapter("qonly")
