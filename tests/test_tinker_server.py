"""The Tinker-API server driven by the real `tinker` SDK: protocol, batching, auth and resume on a tiny random
model built offline (tests.tiny_models); the two learning loops on the provisioned tiny preset (slow: a random base
this small barely learns a sequence through LoRA).

Each test starts a server on a free local port; the SDK talks to it over HTTP exactly as to Tinker.
"""

from __future__ import annotations

import asyncio
import atexit
import copy
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from aiohttp import web
from tinker import types

from rl_multilora.tinker.server import SHUTDOWN_S, build_server
from tests.tiny_models import save_tiny_model

ROOT = Path(__file__).resolve().parents[1]
MODEL = Path(tempfile.mkdtemp(prefix="tinker-model-")) / "model"
atexit.register(shutil.rmtree, MODEL.parent, ignore_errors=True)  # each test process's copy, gone when it ends
TOKEN = "tml-test-token"
BASE = "tiny"


@pytest.fixture(scope="module", autouse=True)
def tiny_model_folder():
    """The base every test serves: a tiny Qwen2 with the character tokenizer, written once for the module."""
    save_tiny_model(MODEL, hidden=32, layers=2)
    yield MODEL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Running:
    """A TinkerServer on its own event loop thread."""

    def __init__(self, state_dir: Path, model: Path = MODEL, **options) -> None:
        self.server = build_server(str(model), state_dir, TOKEN, base_model=BASE, poll_s=5, **options)
        self.port = _free_port()
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(self.server.app(), shutdown_timeout=SHUTDOWN_S)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def server(tmp_path):
    s = _Running(tmp_path / "state")
    yield s
    s.close()


@pytest.fixture
def preset_server(tmp_path):
    """A server on the provisioned tiny preset (provisioned here when missing, as tests/test_tiny_run.py does)."""
    preset = ROOT / "artifacts" / "tiny"
    subprocess.run(["bash", str(ROOT / "examples/multi_lora/provision.sh"), str(preset)], check=True, cwd=ROOT)
    s = _Running(tmp_path / "state", preset / "model")
    yield s
    s.close()


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "weights": np.ones(len(tokens) - 1, dtype=np.float32),
        },
    )


def _sft(tc, steps: int, tokens: list[int], lr: float = 1e-2) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward([_datum(tokens)], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


@pytest.mark.slow
def test_supervised_loop_learns_and_samples(preset_server):
    server = preset_server
    sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    assert tc.get_info().lora_rank == 8
    tokens = list(range(5, 25))
    losses = _sft(tc, 8, tokens)
    assert losses[-1] < 0.5 * losses[0], losses
    # forward (no backward) sees the trained weights and changes nothing
    out = tc.forward([_datum(tokens)], "cross_entropy").result().metrics["loss:sum"]
    again = tc.forward([_datum(tokens)], "cross_entropy").result().metrics["loss:sum"]
    assert out == again < 0.5 * losses[0]
    sampler = tc.save_weights_and_get_sampling_client()
    res = sampler.sample(
        types.ModelInput.from_ints(tokens[:4]), 3, types.SamplingParams(max_tokens=6, seed=1)
    ).result()
    assert len(res.sequences) == 3
    assert all(len(s.tokens) == len(s.logprobs) > 0 for s in res.sequences)
    # the sampler serves exactly the trained weights: its log-probs are the trainer's on the same tokens
    for seq in res.sequences:
        full = tokens[:4] + seq.tokens
        lp = tc.forward([_datum(full)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        np.testing.assert_allclose(lp[3:], seq.logprobs, atol=1e-4)
    base = sc.create_sampling_client(base_model=BASE)
    seq = base.sample(types.ModelInput.from_ints(tokens[:4]), 1, types.SamplingParams(max_tokens=6, seed=1))
    seq = seq.result().sequences[0]
    lp = tc.forward([_datum(tokens[:4] + seq.tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    assert not np.allclose(lp.tolist()[3:], seq.logprobs, atol=1e-3)  # the base is not the trained adapter


def test_token_is_required(server):
    import httpx

    assert httpx.get(server.url + "/api/v1/healthz").status_code == 200
    for headers in ({}, {"X-API-Key": "tml-wrong"}, {"Authorization": "Bearer tml-wrong"}):
        r = httpx.post(server.url + "/api/v1/create_session", json={}, headers=headers)
        assert r.status_code == 401 and "detail" in r.json()
    assert httpx.post(server.url + "/api/v1/create_session", json={}, headers={"X-API-Key": TOKEN}).status_code == 200
    sc = tinker.ServiceClient(base_url=server.url, api_key="tml-wrong")
    with pytest.raises(tinker.AuthenticationError):
        sc.create_lora_training_client(base_model=BASE, rank=4).result()


@pytest.mark.slow
def test_rl_loop_importance_sampling_learns(preset_server):
    server = preset_server
    """sample -> reward (share of tokens with id < 40) -> importance_sampling forward_backward -> optim_step ->
    new sampler; the mean reward goes up."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=1).result()
    prompts = [[1, 30 + i, 40 + i] for i in range(4)]
    rewards = []
    sampler = tc.save_weights_and_get_sampling_client()
    for it in range(8):
        futs = [
            sampler.sample(types.ModelInput.from_ints(p), 8, types.SamplingParams(max_tokens=6, seed=it))
            for p in prompts
        ]
        data, rs = [], []
        for p, f in zip(prompts, futs, strict=True):
            seqs = f.result().sequences
            r = np.array([np.mean([t < 40 for t in s.tokens]) for s in seqs])
            rs.append(r.mean())
            for s, a in zip(seqs, r - r.mean(), strict=True):
                full = p + s.tokens
                n_prompt = len(p) - 1
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={
                            "target_tokens": np.array(full[1:], dtype=np.int64),
                            "logprobs": np.array([0.0] * n_prompt + list(s.logprobs), dtype=np.float32),
                            "advantages": np.array([0.0] * n_prompt + [a] * len(s.tokens), dtype=np.float32),
                        },
                    )
                )
        rewards.append(float(np.mean(rs)))
        tc.forward_backward(data, "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        sampler = tc.save_weights_and_get_sampling_client()
    assert np.mean(rewards[-2:]) > rewards[0] + 0.2, rewards


def test_two_clients_batched_equal_alone(tmp_path):
    tokens_of = {0: list(range(5, 25)), 1: list(range(60, 72))}

    def train(url: str, k: int, out: dict) -> None:
        sc = tinker.ServiceClient(base_url=url, api_key=TOKEN)
        tc = sc.create_lora_training_client(base_model=BASE, rank=4 + 4 * k, seed=10 + k).result()
        out[k] = _sft(tc, 4, tokens_of[k])

    alone: dict[int, list[float]] = {}
    s = _Running(tmp_path / "alone")
    for k in (0, 1):
        train(s.url, k, alone)
    s.close()
    together: dict[int, list[float]] = {}
    # a coalescing window wide enough that the two clients' calls meet on a loaded machine too (20 ms, the
    # default, missed every time in one run beside other jobs on 2 cores)
    s = _Running(tmp_path / "together", batch_wait_s=0.5)
    threads = [threading.Thread(target=train, args=(s.url, k, together)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    sizes = list(s.server.ops.batch_sizes)
    s.close()
    for k in (0, 1):
        np.testing.assert_allclose(together[k], alone[k], rtol=1e-4)
    assert max(sizes) == 2, sizes  # at least one forward_backward ran both clients in one batch


def test_resume_after_kill_9(tmp_path):
    """A server killed with SIGKILL and restarted on the same state dir replays its journal: the same
    TrainingClient goes on, and its losses equal those of an uninterrupted run."""
    tokens = list(range(5, 25))
    reference = _Running(tmp_path / "ref")
    sc = tinker.ServiceClient(base_url=reference.url, api_key=TOKEN)
    expected = _sft(sc.create_lora_training_client(base_model=BASE, rank=8, seed=3).result(), 5, tokens)
    reference.close()

    port = _free_port()
    env = {**os.environ, "RL_MULTILORA_TINKER_TOKEN": TOKEN}
    cmd = [sys.executable, "-m", "rl_multilora.tinker.server", "--model", str(MODEL), "--state-dir",
           str(tmp_path / "state"), "--base-model-name", BASE, "--port", str(port)]  # fmt: skip

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(1200):  # 2 minutes: a loaded 2-core machine has taken more than 30 s to start it
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                return proc
            except OSError:
                time.sleep(0.1)
        proc.kill()
        raise AssertionError("server did not start")

    proc = start()
    try:
        sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=TOKEN)
        tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=3).result()
        first = _sft(tc, 3, tokens)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc = start()
        rest = _sft(tc, 2, tokens)
    finally:
        proc.kill()
        proc.wait(10)
    np.testing.assert_allclose(first + rest, expected, rtol=1e-4)


def _logprobs(tc, tokens: list[int]) -> list[float]:
    return tc.forward([_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()


def test_training_client_from_state_resumes(server):
    """save_state -> a new TrainingClient from it (the SDK names that model `<session>:train:<n>` itself): its
    weights are the saved ones; with the optimizer it trains on exactly as the original does, without it from a
    fresh AdamW."""
    ops = server.server.ops
    tokens = list(range(5, 25))
    sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=3, train_mlp=False).result()
    _sft(tc, 3, tokens)
    path = tc.save_state("step-3").result().path
    assert path == f"tinker://{tc.model_id}/weights/step-3"
    resumed = sc.create_training_client_from_state_with_optimizer(path).result()
    fresh = sc.create_training_client_from_state(path).result()
    assert len({tc.model_id, resumed.model_id, fresh.model_id}) == 3
    saved_weights = ops.backend.adapter_state_dict(ops.tenants[tc.model_id].name)  # tc has not trained since its save
    saved_optim = copy.deepcopy(ops.backend.optimizer_state_dict(ops.tenants[tc.model_id].name)["optimizer"]["state"])
    assert saved_optim and all("mlp" not in k for k in saved_weights)
    for client in (resumed, fresh):
        t = ops.tenants[client.model_id]
        assert client.get_info().lora_rank == 8 and t.lora_config["train_mlp"] is False
        weights = ops.backend.adapter_state_dict(t.name)
        assert weights.keys() == saved_weights.keys()
        for k, v in saved_weights.items():
            torch.testing.assert_close(weights[k], v, rtol=0, atol=0)
    state = ops.backend.optimizer_state_dict(ops.tenants[resumed.model_id].name)["optimizer"]["state"]
    assert state.keys() == saved_optim.keys() and ops.backend.adapter_step(ops.tenants[resumed.model_id].name) == 3
    for i, moments in saved_optim.items():
        for k, v in moments.items():
            torch.testing.assert_close(state[i][k], v, rtol=0, atol=0)
    assert (
        ops.backend.optimizer_state_dict(ops.tenants[fresh.model_id].name)["optimizer"]["state"] == {}
        and ops.backend.adapter_step(ops.tenants[fresh.model_id].name) == 0
    )

    expected_lp = _logprobs(tc, tokens)
    np.testing.assert_allclose(_logprobs(resumed, tokens), expected_lp, rtol=1e-6)
    np.testing.assert_allclose(_logprobs(fresh, tokens), expected_lp, rtol=1e-6)
    expected = _sft(tc, 3, tokens)
    np.testing.assert_allclose(_sft(resumed, 3, tokens), expected, rtol=1e-5)
    fresh_losses = _sft(fresh, 3, tokens)
    assert fresh_losses[0] == pytest.approx(expected[0], rel=1e-5)  # same weights, then a different optimizer
    assert abs(fresh_losses[1] - expected[1]) > 1e-4 and fresh_losses[2] < fresh_losses[0], (fresh_losses, expected)
    # load_state (weights only) into a model with moments: "optimizer resets", as the SDK says; it kept the old moments
    # (a reviewer's repro), so the next steps were neither a fresh AdamW's nor the continued run's
    with pytest.warns(FutureWarning):
        tc.load_state(path).result()
    np.testing.assert_allclose(_sft(tc, 3, tokens), fresh_losses, rtol=1e-6)


def test_model_ids_and_checkpoint_names_stay_inside_the_state_dir(server, tmp_path):
    import httpx

    sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    for name in ("../escape", "a/b", ".."):
        with pytest.raises(tinker.RequestFailedError, match="is not allowed"):
            tc.save_state(name).result()
    good = tc.save_state("ok").result().path
    run = good.split("/")[2]
    for path in ("tinker://..:train:0/weights/ok", f"tinker://{run}/weights/..", "tinker://../weights/ok",
                 f"/{run}/weights/ok", f"tinker://{run}/sampler_weights/ok"):  # fmt: skip
        with pytest.raises(tinker.RequestFailedError, match="is not allowed|is not a training checkpoint"):
            sc.create_training_client_from_state(path).result()
    headers = {"X-API-Key": TOKEN}
    body = {"session_id": "../x", "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 4}}
    r = httpx.post(server.url + "/api/v1/create_model", json=body, headers=headers)
    assert r.status_code == 400 and "is not allowed" in r.json()["detail"]
    state = tmp_path / "state"
    written = sorted(str(p.relative_to(state)) for p in state.rglob("*") if p.is_file())
    assert [p for p in written if p.startswith("adapters/")] == [f"adapters/{run.replace(':', '.')}/step_0/{f}"
                                                                 for f in CHECKPOINT_FILES]  # fmt: skip
    assert not (tmp_path / "escape").exists()


CHECKPOINT_FILES = ["adapter_config.json", "adapter_model.safetensors", "checkpoint.json", "data_state.json",
                    "optimizer.json", "optimizer.safetensors"]  # fmt: skip


def test_client_checkpoints_are_run_checkpoints(server, tmp_path, capsys):
    """save_state writes a GRPO tenant's checkpoint (rl_multilora.checkpoint): CheckpointManager lists it,
    `rl-multilora export` copies it out as a PEFT folder that PEFT loads with our model's logits for the adapter,
    and load_state_with_optimizer resumes from it exactly (the losses the original run had after that save)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rl_multilora.checkpoint import CheckpointManager, list_checkpoints
    from rl_multilora.cli import main as cli_main

    ops, state = server.server.ops, tmp_path / "state"
    tokens = list(range(5, 25))
    sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=7).result()
    _sft(tc, 2, tokens)
    early = tc.save_state("early").result().path
    later_losses = _sft(tc, 2, tokens)
    path = tc.save_state("step-4").result().path
    name = ops.tenants[tc.model_id].name

    ckpt = CheckpointManager(state)
    assert [step for step, _ in list_checkpoints(ckpt.adapter_dir(name))] == [2, 4]
    folder, meta = ckpt.find_labeled(name, "step-4")
    assert ckpt.latest_meta(name)[0] == folder and sorted(p.name for p in folder.iterdir()) == CHECKPOINT_FILES
    assert meta["adapter_step"] == 4 and meta["tinker"]["model_id"] == tc.model_id and meta["tinker"]["rank"] == 4
    assert ckpt.labels(name) == ["early", "step-4"]

    out = tmp_path / "peft"
    assert cli_main(["export", str(state), path, str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert cli_main(["export", str(state), name, str(tmp_path / "by-step"), "--step", "2"]) == 0
    assert (tmp_path / "by-step" / "adapter_model.safetensors").read_bytes() == (
        ckpt.find_labeled(name, "early")[0] / "adapter_model.safetensors"
    ).read_bytes()
    capsys.readouterr()
    assert cli_main(["export", str(state), f"tinker://{tc.model_id}/weights/nope", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "no complete checkpoint" in err and "label 'nope'" in err and "its labels: early, step-4" in err
    assert cli_main(["export", str(state), "tinker://../weights/x", str(tmp_path / "x")]) == 2
    assert "model_id='..' is not allowed" in capsys.readouterr().err

    ids = torch.tensor([tokens])
    with torch.no_grad():
        ours = ops.backend.shared_model(ids, adapter_names=[name]).logits
        base = ops.backend.shared_model(ids, adapter_names=[None]).logits
        theirs = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(MODEL), out).eval()(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
    assert (ours - base).abs().max() > 1e-3  # the adapter is not the base

    # Back to the first save, AdamW state and step count included: the next steps are the original run's.
    tc.load_state_with_optimizer(early).result()
    assert ops.backend.adapter_step(ops.tenants[tc.model_id].name) == 2
    np.testing.assert_allclose(_sft(tc, 2, tokens), later_losses, rtol=1e-6)
    # a load writes no client checkpoint, only the journal's snapshot of the model (a replay would read "early" again)
    assert [step for step, _ in list_checkpoints(ckpt.adapter_dir(name))] == [2, 2, 4]
    assert sorted(ckpt.labels(name)) == ["_journal-snapshot", "early", "step-4"]


def test_labeled_checkpoints_last_save_wins_and_a_replayed_save_writes_nothing(tmp_path):
    from rl_multilora.checkpoint import AdapterSnapshot, CheckpointManager, list_checkpoints

    ckpt = CheckpointManager(tmp_path, keep_last=1)
    a = torch.full((2, 8), 0.5)
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, 2)}  # fmt: skip
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 32, "target_modules": ["q_proj"]}

    def snap(step: int) -> AdapterSnapshot:
        return AdapterSnapshot(tensors, config, {"state": {}}, {}, {"adapter_step": step})

    first = ckpt.save_labeled("c", snap(5), "x", key="m.3")
    again = ckpt.save_labeled("c", snap(2), "x", key="m.9")  # after loading an earlier checkpoint: same name again
    assert ckpt.find_labeled("c", "x")[0] == again != first
    assert ckpt.save_labeled("c", snap(7), "x", key="m.3") == first  # request m.3 replayed: its checkpoint
    ckpt.save_labeled("c", snap(6), "y", key="m.11")
    assert len(list_checkpoints(ckpt.adapter_dir("c"))) == 3  # keep_last=1 prunes GRPO checkpoints, not these
    assert ckpt.labels("c") == ["x", "y"] and ckpt.find_labeled("c", "z") is None


def _sample(sampler) -> list[int]:
    prompt = types.ModelInput.from_ints([1, 2, 3])
    return sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, seed=0)).result().sequences[0].tokens


def test_sampler_versions_are_bounded_and_freed_on_unload(tmp_path):
    """At most max_sampler_versions in-memory versions per model, the least recently used (published or sampled)
    freed first; a sample of a freed version is a user error naming it and the limit; unload_model frees them all."""
    import httpx

    s = _Running(tmp_path / "state", max_sampler_versions=2)
    try:
        ops = s.server.ops
        sc = tinker.ServiceClient(base_url=s.url, api_key=TOKEN)
        tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
        other = sc.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
        other_path = other.save_weights_for_sampler("o1").result().path
        paths, samplers = [], []
        for i in range(3):
            _sft(tc, 1, list(range(5 + i, 20)))
            paths.append(tc.save_weights_for_sampler(f"v{i}").result().path)
            samplers.append(sc.create_sampling_client(model_path=paths[-1]).result())
            if i == 1:
                assert _sample(samplers[0])  # v0 is now more recently used than v1: publishing v2 frees v1
        assert list(ops.tenants[tc.model_id].sampler_paths) == [paths[0], paths[2]]
        assert set(ops.samplers) == {paths[0], paths[2], other_path}
        tc_name = ops.tenants[tc.model_id].name
        assert f"{tc_name}.s2" not in ops.engine.adapter_versions()  # v1's engine copy is gone too
        assert _sample(samplers[0]) and _sample(samplers[2])
        with pytest.raises(tinker.RequestFailedError, match="at most 2 sampler versions per model") as err:
            _sample(samplers[1])
        assert paths[1] in str(err.value) and err.value.category == types.RequestErrorCategory.User

        headers = {"X-API-Key": TOKEN}
        body = {"model_id": tc.model_id, "type": "unload_model"}
        key = httpx.post(s.url + "/api/v1/unload_model", json=body, headers=headers).json()["request_id"]
        done = httpx.post(s.url + "/api/v1/retrieve_future", json={"request_id": key}, headers=headers, timeout=30)
        assert types.UnloadModelResponse.model_validate(done.json()).model_id == tc.model_id
        assert tc.model_id not in ops.tenants and set(ops.samplers) == {other_path}
        assert (
            ops.tenants[other.model_id].name in ops.backend.shared_model.adapters
            and len(ops.backend.shared_model.adapters) == 1
        )
        assert not [name for name in ops.engine.adapter_versions() if name.startswith(tc_name + ".")]
        for sampler, path, why in zip(samplers, paths, ("was unloaded", "evicted", "was unloaded"), strict=True):
            with pytest.raises(tinker.RequestFailedError, match=f"{re.escape(path)}.*{why}"):
                _sample(sampler)
        with pytest.raises(tinker.RequestFailedError, match="unknown model_id"):
            tc.forward([_datum(list(range(5, 15)))], "cross_entropy").result()
        assert _sample(sc.create_sampling_client(model_path=other_path).result())  # the other model is untouched
        assert s.server._worker.is_alive()  # a failed forward_backward fails its future, not the worker
        assert len(_sft(other, 1, list(range(5, 15)))) == 1
    finally:
        s.close()


def test_inflight_sampling_clients_share_one_target_that_each_inflight_save_updates(tmp_path):
    """SDK 0.38's `kind="inflight"`: every inflight sampling client of a model samples the newest inflight weights,
    and the target is one version however many inflight saves there are. The server ignored `kind`: each save was a
    snapshot of its own, the first client kept the old weights and broke once later saves evicted its version."""
    s = _Running(tmp_path / "state", max_sampler_versions=2)
    try:
        sc = tinker.ServiceClient(base_url=s.url, api_key=TOKEN)
        tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
        first = tc.save_weights_and_get_sampling_client(kind="inflight").result()
        seq = types.ModelInput.from_ints(list(range(5, 15)))
        before = first.compute_logprobs(seq).result()
        _sft(tc, 2, list(range(5, 15)), lr=5e-2)
        snapshot = tc.save_weights_and_get_sampling_client().result()  # the trained weights, fixed
        for _ in range(4):  # more inflight saves than the model keeps versions: still one target
            second = tc.save_weights_and_get_sampling_client(kind="inflight").result()
        trained = snapshot.compute_logprobs(seq).result()
        assert trained != before
        assert first.compute_logprobs(seq).result() == trained == second.compute_logprobs(seq).result()
        assert _sample(first) == _sample(second)
        paths = list(s.server.ops.tenants[tc.model_id].sampler_paths)
        assert len(paths) == 2 and sum(p.endswith("/sampler_weights/_inflight") for p in paths) == 1, paths
        for i in range(3):  # named snapshots past the limit evict each other, never the inflight target
            tc.save_weights_for_sampler(f"named{i}").result()
        assert first.compute_logprobs(seq).result() == trained
        with pytest.raises(tinker.BadRequestError, match="path='_inflight' is not allowed"):
            tc.save_weights_for_sampler("_inflight").result()
    finally:
        s.close()


def test_the_sdk_splits_a_large_forward_backward_into_requests_of_at_most_request_tokens(tmp_path):
    """A forward_backward runs as one pass over its datums, so a large call took memory in proportion (a reviewer:
    0.5 GB at 2,048 tokens, 2.8 GB at 65,536, the tiny model). client/config now tells SDK 0.38 to split calls into
    requests of at most `request_tokens` tokens; their gradients accumulate as one call's would."""
    data = [_datum(list(range(5 + i, 25 + i))) for i in range(12)]  # 12 datums of 19 tokens, 304 bytes to the SDK
    results = {}
    for request_tokens in (64, 16384):
        s = _Running(tmp_path / f"state-{request_tokens}", request_tokens=request_tokens)
        try:
            sc = tinker.ServiceClient(base_url=s.url, api_key=TOKEN)
            tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
            loss = tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            requests = [k for k, kind, *_ in s.server.journal.replay() if kind == "forward_backward"]
            name = s.server.ops.tenants[tc.model_id].name
            weights = {k: v.clone() for k, v in s.server.ops.backend.adapter_state_dict(name).items()}
            results[request_tokens] = (loss, len(requests), weights)
        finally:
            s.close()
    (small_loss, small_n, small_w), (big_loss, big_n, big_w) = results[64], results[16384]
    assert (small_n, big_n) == (12, 1)  # 512 bytes a request hold one datum
    assert small_loss == pytest.approx(big_loss, rel=1e-5)
    for key, value in big_w.items():
        torch.testing.assert_close(small_w[key], value, rtol=1e-4, atol=1e-6)


def test_ppo_loss_is_clipped_surrogate(server):
    """forward_backward with loss_fn="ppo" and its loss_fn_config: each token's loss is
    -min(r A, clip(r, low, high) A), r = exp(logp - sampler_logp), checked in float64 token by token (one-hot
    advantages) and summed over a datum."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
    tokens = list(range(5, 17))
    logp = np.array(_logprobs(tc, tokens), dtype=np.float64)  # the policy's log-probs; no step runs in this test
    n = len(logp)
    # ratios below, inside and above [0.7, 1.3] (and between the default 0.8 / 1.2), advantages of both signs and 0
    ratio = np.array([0.5, 0.75, 1.0, 1.25, 1.6, 0.5, 0.75, 1.0, 1.25, 1.6, 1.1])[:n]
    adv = np.array([1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -2.0, -1.0, -1.5, -1.0, 0.0])[:n]
    sampler_logp = (logp - np.log(ratio)).astype(np.float32)
    config = {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}

    def datum(advantages: np.ndarray) -> types.Datum:
        inputs = {"target_tokens": np.array(tokens[1:], dtype=np.int64), "logprobs": sampler_logp,
                  "advantages": advantages.astype(np.float32)}  # fmt: skip
        return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)

    r = np.exp(logp - sampler_logp.astype(np.float64))
    a = adv.astype(np.float32).astype(np.float64)
    expected = -np.minimum(r * a, np.clip(r, 0.7, 1.3) * a)  # (N,) float64
    assert np.abs(expected - (-np.minimum(r * a, np.clip(r, 0.8, 1.2) * a))).max() > 0.05  # the config matters
    futures = [tc.forward_backward([datum(np.eye(n)[k] * adv[k])], "ppo", config) for k in range(n)]
    per_token = np.array([f.result().metrics["loss:sum"] for f in futures])
    np.testing.assert_allclose(per_token, expected, rtol=1e-5, atol=1e-6)
    whole = tc.forward_backward([datum(adv), datum(adv)], "ppo", config).result()
    assert whole.metrics["loss:sum"] == pytest.approx(2 * expected.sum(), rel=1e-5)
    np.testing.assert_allclose(whole.loss_fn_outputs[0]["logprobs"].tolist(), logp, rtol=1e-6)


def test_replayed_sample_waits_for_its_sampler_weights(tmp_path, monkeypatch):
    """After a restart the journal's sample request runs again; the sampler version it names is republished by a
    replayed save_weights_for_sampler on the worker, which here is slow: the sample waits for it and succeeds."""
    import httpx

    from rl_multilora.tinker.journal import Journal
    from rl_multilora.tinker.ops import ClientOps

    finish = Journal.finish
    monkeypatch.setattr(Journal, "finish", lambda *_a, **_k: None)  # killed before its row is swapped for its result
    first = _Running(tmp_path / "state")
    sc = tinker.ServiceClient(base_url=first.url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    _sft(tc, 3, list(range(5, 20)), lr=5e-2)

    def sample(sampler) -> list[int]:
        prompt = types.ModelInput.from_ints([5, 6, 7])
        return sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, seed=0)).result().sequences[0].tokens

    tokens = sample(tc.save_weights_and_get_sampling_client())
    assert tokens != sample(sc.create_sampling_client(base_model=BASE))  # a base sample would not pass for it
    [key] = [k for k, kind, _, owner, _ in first.server.journal.replay() if kind == "sample" and owner is not None]
    first.close()
    monkeypatch.setattr(Journal, "finish", finish)

    publish = ClientOps.publish_sampler

    def slow_publish(self, *args, **kwargs):
        time.sleep(1.0)  # the replayed sample task starts at once on the event loop; this publish comes later
        return publish(self, *args, **kwargs)

    monkeypatch.setattr(ClientOps, "publish_sampler", slow_publish)
    again = _Running(tmp_path / "state")
    try:
        r = httpx.post(again.url + "/api/v1/retrieve_future", json={"request_id": key},
                       headers={"X-API-Key": TOKEN}, timeout=30)  # fmt: skip
        assert r.headers["content-type"].startswith("application/x-protobuf"), r.text
        from tinker.proto import tinker_public_pb2 as pb

        out = pb.SampleResponse()
        out.ParseFromString(r.content)
        assert list(np.frombuffer(out.sequences[0].tokens, dtype=np.int32)) == tokens
    finally:
        again.close()


def test_tinker_serve_refuses_a_token_the_sdk_would_refuse_without_a_traceback(tmp_path):
    """A user mistake exits 2 with the reason and no traceback (the token check ran after the CLI's error handling)."""
    from tests.tiny_models import save_tiny_model

    model = save_tiny_model(tmp_path / "model")
    env = {**os.environ, "RL_MULTILORA_TINKER_TOKEN": "not-a-tinker-key"}
    out = subprocess.run(
        [sys.executable, "-m", "rl_multilora.cli", "tinker-serve", "--model", str(model), "--state-dir",
         str(tmp_path / "state"), "--port", "1"],
        env=env, capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert "token must start with 'tml-'" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_leaving_a_service_clients_with_block_finishes_its_session_after_its_requests(tmp_path):
    """`with tinker.ServiceClient() as sc:` (SDK 0.38) ends in `close("success")`, a POST to the session's `finish`
    (a 404 here raised at the end of every such script): the session's models are unloaded after every request of
    theirs that was acknowledged (a save_state the script never waited for is still written), later requests of the
    session are refused, a second finish answers as the first, and a restart does not load the models again."""
    import httpx

    first = _Running(tmp_path / "state")
    try:
        with tinker.ServiceClient(base_url=first.url, api_key=TOKEN) as sc:
            tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
            _sft(tc, 2, list(range(5, 15)))
            saved = tc.save_state("unwaited")  # a future nobody reads before the block ends
            model_id, session = tc.model_id, tc.model_id.split(":")[0]
            other = tinker.ServiceClient(base_url=first.url, api_key=TOKEN)
            kept = other.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
        ops = first.server.ops
        deadline = time.monotonic() + 30
        while model_id in ops.tenants and time.monotonic() < deadline:
            time.sleep(0.05)
        assert model_id not in ops.tenants and kept.model_id in ops.tenants  # the other session's model stays
        assert saved.result().path.endswith("/weights/unwaited")  # ran before the unload
        headers = {"X-API-Key": TOKEN}
        body = {"session_id": session, "model_seq_id": 7, "base_model": BASE, "lora_config": {"rank": 4}}
        r = httpx.post(first.url + "/api/v1/create_model", json=body, headers=headers)
        assert r.status_code == 400 and "was finished by its client (success)" in r.json()["detail"], r.text
        r = httpx.post(first.url + f"/api/v1/sessions/{session}/finish", json={"reason": {"type": "errored"}},
                       headers=headers)  # fmt: skip
        assert r.status_code == 200 and first.server._finished[session] == "success"  # the first reason wins
        r = httpx.post(first.url + "/api/v1/sessions/a%2Fb/finish", json={}, headers=headers)
        assert r.status_code == 400 and "session_id='a/b' is not allowed" in r.json()["detail"], r.text
        r = httpx.post(first.url + f"/api/v1/sessions/{session}/finish", json={})
        assert r.status_code == 401  # it changes state: a token is required
        assert _sft(kept, 1, list(range(5, 15)))
    finally:
        first.close()
    again = _Running(tmp_path / "state")
    try:
        deadline = time.monotonic() + 30
        while again.server._replayed and not all(res.event.is_set() for res in again.server._replayed):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert model_id not in again.server.ops.tenants and kept.model_id in again.server.ops.tenants
    finally:
        again.close()


def test_load_state_of_a_checkpoint_with_other_layers_into_a_model_is_refused_naming_both(server):
    """`load_state` onto an existing model checked only the rank: a checkpoint trained on attention and MLP went into
    a model training attention alone, and the model's optimizer no longer matched its adapter (the next page-in
    failed). Refused now, naming what each trains; a new client from the state takes the checkpoint's layers."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    both = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    attn = sc.create_lora_training_client(base_model=BASE, rank=4, seed=1, train_mlp=False).result()
    path = both.save_state("both").result().path
    why = r"trains train_attn, train_mlp(, train_unembed)?; model .* trains train_attn(, train_unembed)?; "
    with pytest.raises(tinker.RequestFailedError, match=why):
        attn.load_state(path).result()
    assert len(_sft(attn, 1, list(range(5, 15)))) == 1  # the model goes on as it was
    assert sc.create_training_client_from_state(path).result().get_info().model_data is not None
