"""The Tinker API served by the GRPO service (`rl-multilora serve CONFIG --tinker-port PORT`): one model, one slot
pool, one engine and one TenantManager for GRPO tenants and Tinker clients, driven by the real `tinker` SDK.

No Ray here: a `ServiceCore` (what the service actor runs) with the Tinker app on its Runtime, on a tiny random
model built offline (tests.tiny_models); the standalone server of tests/test_tinker_server.py is the reference.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import yaml
from tinker import types

from rl_multilora.config import parse_adapter_config, parse_run_config
from rl_multilora.loop import Runtime
from rl_multilora.service import ServiceCore, ServiceError
from rl_multilora.tinker.ops import slot_name
from rl_multilora.tinker.server import BackgroundApp, build_server, build_service_server
from tests.test_tinker_server import BASE, TOKEN, _datum, _free_port, _sft
from tests.tiny_models import save_tiny_model, sum_task_adapter, write_sum_task

TOKENS = list(range(5, 25))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinker-service")
    save_tiny_model(root / "model", hidden=32, layers=2)
    for name, off in [("t1", 1), ("t2", 3)]:
        write_sum_task(root / "data" / f"{name}.jsonl", 40, off)
    return root


def _reference_losses(workspace, tmp_path, steps: int) -> list[float]:
    """A client's losses over `steps` SFT steps (rank 4, seed 10) on the standalone server, alone on the same base."""
    ref = BackgroundApp(
        build_server(  # the service config's targets: all-linear, no LoRA on lm_head
            str(workspace / "model"),
            tmp_path / "ref",
            TOKEN,
            base_model=BASE,
            max_loras=2,
            max_rank=8,
            unembed_lora=False,
        ),
        "127.0.0.1",
        port := _free_port(),
    )
    try:
        sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=TOKEN)
        return _sft(sc.create_lora_training_client(base_model=BASE, rank=4, seed=10).result(), steps, TOKENS)
    finally:
        ref.close()


def _wait(what, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_client_and_grpo_tenant_share_one_service(workspace, tmp_path):
    """A Tinker client next to a GRPO tenant: its losses are the standalone server's, the GRPO tenant keeps
    training, both hold slots of one pool (a third tenant is refused or waits), status lists both, and the client
    leaving frees its slot for the waiting GRPO tenant."""
    # Reference: the standalone server on the same base and seed.
    expected = _reference_losses(workspace, tmp_path, 3)

    run_dir = tmp_path / "run"
    cfg = parse_run_config(
        {
            "run_dir": str(run_dir),
            "model": {"path": str(workspace / "model"), "max_loras": 2, "max_rank": 8},
            "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 6},
            "grpo": {"micro_batch_size": 8, "drop_uniform_groups": False},
            "logging": {"plot": False, "progress": False},
            "rewards": {"num_workers": 1},
            "service_poll_s": 0.2,
            "adapters": [sum_task_adapter(workspace / "data", "t1", 7, max_steps=500)],
        }
    )
    core = ServiceCore(Runtime.build(cfg), cfg.service_poll_s)
    core.start()
    app = BackgroundApp(
        build_service_server(core, run_dir / "tinker", TOKEN, base_model=BASE, poll_s=5), "127.0.0.1", _free_port()
    )
    url = f"http://127.0.0.1:{app.runner.addresses[0][1]}"
    try:
        assert app.server.ops.backend is core.rt.backend and app.server.ops.engine is core.rt.engine
        # the same token rules as the standalone server
        for headers in ({}, {"X-API-Key": "tml-wrong"}):
            assert httpx.post(url + "/api/v1/create_session", json={}, headers=headers).status_code == 401
        with pytest.raises(tinker.AuthenticationError):
            tinker.ServiceClient(base_url=url, api_key="tml-wrong").create_lora_training_client(
                base_model=BASE, rank=4
            ).result()

        sc = tinker.ServiceClient(base_url=url, api_key=TOKEN)
        tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=10).result()
        step_before = core.status().global_step
        losses = _sft(tc, 3, TOKENS)
        np.testing.assert_allclose(losses, expected, rtol=1e-4)
        # the GRPO tenant trained meanwhile, and keeps training
        _wait(lambda: core.status().global_step >= step_before + 2)
        assert core.status().get("t1").adapter_step > 0

        name = slot_name(tc.model_id)
        # the status is a snapshot published after each GRPO step: on a loaded machine both steps above can end
        # before the client's third optimizer step, so wait for a snapshot taken after it
        _wait(lambda: getattr(core.status().get(name), "adapter_step", None) == 3)
        st = core.status()
        client = st.get(name)
        assert client is not None and client.state == "RUNNING" and client.adapter_step == 3
        assert {client.slot, st.get("t1").slot} == {0, 1} and "slots 2/2" in st.table()

        # Full: a second client is refused; a GRPO tenant submitted now waits for a slot.
        with pytest.raises(tinker.RequestFailedError, match="no free LoRA slot"):
            sc.create_lora_training_client(base_model=BASE, rank=4, seed=11).result()
        waiting = core.submit(parse_adapter_config(sum_task_adapter(workspace / "data", "t2", 8, max_steps=500),
                                                   cfg.model))  # fmt: skip
        assert waiting.state == "PENDING" and waiting.slot is None
        with pytest.raises(ServiceError, match="a name no live adapter has"):
            core.submit(parse_adapter_config(sum_task_adapter(workspace / "data", name, 8, max_steps=5), cfg.model))

        saved = tc.save_state("kept").result().path

        # The client leaves through the same release path: its slot goes to the waiting GRPO tenant.
        headers = {"X-API-Key": TOKEN}
        key = httpx.post(url + "/api/v1/unload_model", json={"model_id": tc.model_id}, headers=headers).json()
        httpx.post(url + "/api/v1/retrieve_future", json=key, headers=headers, timeout=30).raise_for_status()
        st = _wait(lambda: (s := core.status()).get("t2").state == "RUNNING" and s)
        assert st.get(name).state == "REMOVED" and st.get(name).slot is None
        assert st.get("t2").slot == client.slot
        _wait(lambda: core.status().get("t2").adapter_step > 0)
        # Its name stays the client's: a GRPO tenant of that name would resume from the client's checkpoint.
        with pytest.raises(ServiceError, match=r"name=.*a name without a Tinker client's checkpoints"):
            core.submit(parse_adapter_config(sum_task_adapter(workspace / "data", name, 8, max_steps=5), cfg.model))
        assert saved.endswith("/weights/kept") and core.status().error is None
    finally:
        app.close()
        core.stop(timeout=60)


def _service_config(workspace, run_dir, adapters: list[str]) -> dict:
    return {
        "run_dir": str(run_dir),
        "model": {"path": str(workspace / "model"), "max_loras": 2, "max_rank": 8},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 6},
        "grpo": {"micro_batch_size": 8, "drop_uniform_groups": False},
        "logging": {"plot": False, "progress": False},
        "rewards": {"num_workers": 1},
        "checkpoint": {"save_every": 2, "keep_last": 1},
        "service_poll_s": 0.2,
        "adapters": [sum_task_adapter(workspace / "data", n, 7 + k, max_steps=500) for k, n in enumerate(adapters)],
    }


def _start_service(cfg, port: int):
    """A service with the Tinker app, in `serve`'s order: the app is built (holding the slots of the clients its
    journal replays) before the Runtime starts and admits GRPO tenants."""
    core = ServiceCore(Runtime.build(cfg), cfg.service_poll_s)
    server = build_service_server(core, Path(cfg.run_dir) / "tinker", TOKEN, base_model=BASE, poll_s=5)
    core.start()
    return core, BackgroundApp(server, "127.0.0.1", port)


def test_restarted_service_gives_replayed_clients_their_slots_first(workspace, tmp_path, monkeypatch):
    """Both slots held (GRPO t1 and a client) and GRPO t2 waiting; the service goes down without a final checkpoint
    (as after a kill) and restarts with t2 in its config. The replayed client gets its slot back before t1 and t2 are
    admitted: the same TrainingClient trains on with the losses of an uninterrupted run, t1 resumes from its
    checkpoint, and t2 still waits. Client checkpoints are the run's: under RUN_DIR/adapters, never pruned."""
    from rl_multilora.checkpoint import list_checkpoints

    expected = _reference_losses(workspace, tmp_path, 5)

    run_dir, port = tmp_path / "run", _free_port()
    cfg = parse_run_config(_service_config(workspace, run_dir, ["t1"]))
    core, app = _start_service(cfg, port)
    try:
        sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=TOKEN)
        tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=10).result()
        name = slot_name(tc.model_id)
        losses = _sft(tc, 2, TOKENS)
        saved = tc.save_state("two").result().path
        losses += _sft(tc, 1, TOKENS)
        assert core.submit(parse_adapter_config(sum_task_adapter(workspace / "data", "t2", 8, max_steps=500),
                                                cfg.model)).state == "PENDING"  # fmt: skip
        st = _wait(lambda: (s := core.status()).get("t1").adapter_step >= 4 and s)
        assert st.get("t2").state == "PENDING" and st.get(name).slot is not None
        ck = core.rt.ckpt  # the client's checkpoint is the run's, next to t1's, and keep_last does not prune it
        assert [s for s, _ in list_checkpoints(ck.adapter_dir(name))] == [2] and ck.labels(name) == ["two"]
        # keep_last 1, plus the checkpoint a resume takes while a newer one's step has not finished yet
        assert len(list_checkpoints(ck.adapter_dir("t1"))) in (1, 2)
        t1_saved = ck.latest_meta("t1")[1]["adapter_step"]
        monkeypatch.setattr(core.rt, "checkpoint_all", lambda: None)  # down as after a kill: no final checkpoint
    finally:
        app.close()
        core.stop(timeout=60)

    cfg = parse_run_config(_service_config(workspace, run_dir, ["t1", "t2"]))
    core, app = _start_service(cfg, port)
    try:
        st = core.status()  # the start admitted t1 only: the client's slot is held for the replay
        assert (st.get("t1").state, st.get("t2").state) == ("RUNNING", "PENDING")
        losses += _sft(tc, 2, TOKENS)  # the same TrainingClient, its next seq_ids
        np.testing.assert_allclose(losses, expected, rtol=1e-4)
        # status is published when the Tinker turn ends, which can be just after the client has its result
        st = _wait(lambda: (s := core.status()).get(name).adapter_step >= 5 and s)
        assert (
            st.get(name).state == "RUNNING" and st.get(name).adapter_step == 5 and not core.rt.tenants.reserved_clients
        )
        assert {st.get(name).slot, st.get("t1").slot} == {0, 1} and st.get("t2").slot is None
        _wait(lambda: core.status().get("t1").adapter_step >= t1_saved + 2)
        assert core.status().get("t2").state == "PENDING" and core.status().error is None
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        t1_steps = [r["adapter_step"] for r in rows if r["adapter"] == "t1"]
        assert t1_steps == sorted(t1_steps) and len(t1_steps) == len(set(t1_steps))  # resumed: no step twice
        # the checkpoint saved before the restart loads (the replayed save found it and wrote no second one)
        assert [s for s, _ in list_checkpoints(core.rt.ckpt.adapter_dir(name))] == [2]
        tc.load_state_with_optimizer(saved).result()
        np.testing.assert_allclose(_sft(tc, 1, TOKENS), expected[2:3], rtol=1e-4)
    finally:
        app.close()
        core.stop(timeout=60)


def test_the_tinker_api_is_served_on_every_trainer_and_engine_placement_but_server_engines(workspace):
    """Trainer ranks, engine actors, several engines and async rollouts serve clients as they serve GRPO tenants (one
    trainer behind both doors); a server engine (SGLang, http) is refused, naming the setting."""
    from rl_multilora.tinker.server import service_problems

    def cfg(**over):
        return parse_run_config(
            {
                "run_dir": "unused",
                "model": {"path": str(workspace / "model"), "max_loras": 2, "max_rank": 8},
                "adapters": [sum_task_adapter(workspace / "data", "t1", 7, max_steps=5)],
                **over,
            }
        )

    assert service_problems(cfg()) == []
    scaled = cfg(rollout={"engine_actors": True, "num_engines": 2, "mode": "async"}, trainer={"world_size": 2})
    assert service_problems(scaled) == []
    problems = service_problems(cfg(rollout={"engine": "http", "url": "http://127.0.0.1:1"}))
    assert len(problems) == 1 and problems[0].startswith("rollout.engine='http' is not allowed; allowed: 'embedded'")


# -- `rl-multilora serve CONFIG --tinker-port PORT` as a user runs it --------------------------------------------------
REPO = Path(__file__).resolve().parents[1]


class _Serve:
    """`rl-multilora serve CONFIG --tinker-port PORT` in a subprocess (on its own local Ray cluster). Every process
    it starts carries `RL_MULTILORA_TEST_MARK` in its environment, so `kill_9` can SIGKILL all of them (the serve
    process, Ray's GCS and raylet, the service actor's worker): the whole service dies at once, as in a crash."""

    def __init__(self, config: Path, port: int, log: Path, timeout: float = 240, extra: tuple[str, ...] = ()) -> None:
        self.mark = f"tinker-serve-{time.time_ns()}"
        self.log = log
        self._fh = log.open("w")
        env = {**os.environ, "RL_MULTILORA_TINKER_TOKEN": TOKEN, "RL_MULTILORA_TEST_MARK": self.mark}
        cmd = [sys.executable, "-m", "rl_multilora.cli", "serve", str(config), "--tinker-port", str(port),
               "--tinker-base-model", BASE, *extra]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._fh, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + timeout
        while "tinker API: http://" not in log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill_9()
                pytest.fail(f"serve did not become ready (rc {self.proc.returncode}):\n{log.read_text()[-4000:]}")
            time.sleep(0.5)

    def _marked(self) -> list[int]:
        pids = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                if f"RL_MULTILORA_TEST_MARK={self.mark}".encode() in environ.read_bytes().split(b"\0"):
                    pids.append(int(environ.parent.name))
            except OSError:  # gone meanwhile, or not ours
                continue
        return pids

    def kill_9(self) -> None:
        deadline = time.monotonic() + 30
        while (pids := self._marked()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        self.proc.wait(30)
        self._fh.close()
        assert not self._marked(), "processes of the killed service are still alive"


def _journal_rows(run_dir: Path, kinds: tuple[str, ...], min_seq: int = 0) -> int:
    """Requests of `kinds` in the journal with seq_id >= `min_seq` (a snapshot compacts the earlier ones)."""
    db = sqlite3.connect(f"file:{run_dir / 'tinker' / 'requests.sqlite'}?mode=ro", uri=True)
    try:
        marks = ",".join("?" * len(kinds))
        query = f"SELECT COUNT(*) FROM requests WHERE kind IN ({marks}) AND seq >= ?"
        return db.execute(query, (*kinds, min_seq)).fetchone()[0]
    finally:
        db.close()


def _metrics(run_dir: Path, name: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r["adapter"] == name]


@pytest.mark.ray  # serve always runs on Ray (about 35 s on 2 CPUs: two starts of a local cluster)
def test_serve_with_tinker_port_survives_kill_9(workspace, tmp_path):
    """`rl-multilora serve cfg.yaml --tinker-port P`, driven by the real SDK next to a GRPO tenant, SIGKILLed (every
    process of it) with a forward_backward and an optim_step acknowledged but maybe not run, restarted on the same
    run dir: the same TrainingClient's pending futures resolve and its losses are those of an uninterrupted run (no
    acknowledged request lost), its checkpoint is still there, and the GRPO tenant resumes from its checkpoint."""
    from rl_multilora.checkpoint import CheckpointManager, list_checkpoints

    expected = _reference_losses(workspace, tmp_path, 6)

    run_dir, port = tmp_path / "run", _free_port()
    config = tmp_path / "service.yaml"
    config.write_text(yaml.safe_dump(_service_config(workspace, run_dir, ["t1"]) | {"model": {
        "path": str(workspace / "model"), "max_loras": 2, "max_rank": 8, "device": "cpu"}}))  # fmt: skip
    ckpt = CheckpointManager(run_dir)
    served = _Serve(config, port, tmp_path / "serve-1.log")
    try:
        sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=TOKEN)
        tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=10).result()
        name = slot_name(tc.model_id)
        losses = _sft(tc, 3, TOKENS)
        saved = tc.save_state("three").result().path
        _wait(lambda: list_checkpoints(ckpt.adapter_dir("t1")), timeout=120)  # t1 has a checkpoint to resume from
        fb = tc.forward_backward([_datum(TOKENS)], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        # both acknowledged: requests 8 and 9 of the model (create 0, three steps 1-6, save_state 7; the save_state
        # is a journal snapshot, so the requests before it may already be compacted away)
        _wait(lambda: _journal_rows(run_dir, ("forward_backward", "optim_step"), min_seq=8) == 2)
    finally:
        served.kill_9()
    before = _metrics(run_dir, "t1")
    assert before and "resumed from" not in served.log.read_text()

    served = _Serve(config, port, tmp_path / "serve-2.log")
    try:
        losses.append(fb.result(timeout=180).metrics["loss:sum"])
        opt.result(timeout=180)
        losses += _sft(tc, 2, TOKENS)
        np.testing.assert_allclose(losses, expected, rtol=1e-4)
        assert ckpt.find_labeled(name, "three") is not None and saved.endswith("/weights/three")
        _wait(lambda: len(_metrics(run_dir, "t1")) >= len(before) + 2, timeout=120)
    finally:
        served.kill_9()
    log = served.log.read_text()
    resumed = re.search(r"adapter t1 resumed from (\S+) \(adapter step (\d+);", log)
    assert resumed, log[-4000:]
    step = int(resumed.group(2))
    rows = _metrics(run_dir, "t1")
    # The restart redid the steps after the checkpoint: t1's rows continue from it, each global step once.
    assert [r["step"] for r in rows] == sorted({r["step"] for r in rows})
    assert rows[-1]["adapter_step"] > step >= 2
    kept = [r for r in rows if r["adapter_step"] <= step]
    assert kept == [r for r in before if r["adapter_step"] <= step]

    # --fresh archives the journal with the checkpoints it refers to: nothing is replayed, so the old client holds
    # no slot (t1 + it would fill both) and a new client starts from the base like the first one did.
    served = _Serve(config, port, tmp_path / "serve-3.log", extra=("--fresh",))
    try:
        assert list((run_dir / "archive").glob("*/tinker/requests.sqlite"))
        fresh = sc.create_lora_training_client(base_model=BASE, rank=4, seed=10).result()
        np.testing.assert_allclose(_sft(fresh, 1, TOKENS), expected[:1], rtol=1e-4)
        assert ckpt.find_labeled(name, "three") is None
    finally:
        served.kill_9()


def test_serve_refuses_the_tinker_port_on_a_server_engine(workspace, tmp_path):
    """A server engine (http / SGLang) is refused for the Tinker API before a cluster starts: exit 2, the setting
    named, no traceback."""
    config = tmp_path / "service.yaml"
    data = _service_config(workspace, tmp_path / "run", ["t1"])
    data["rollout"].update(engine="http", url="http://127.0.0.1:1")
    config.write_text(yaml.safe_dump(data))
    out = subprocess.run([sys.executable, "-m", "rl_multilora.cli", "serve", str(config), "--tinker-port",
                          str(_free_port())], cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: --tinker-port needs the embedded engine: ")
    assert "rollout.engine='http' is not allowed; allowed: 'embedded'" in out.stderr
    assert "Traceback" not in out.stderr and "service ready" not in out.stdout
    assert not (tmp_path / "run").exists()  # refused before anything was written


def _sample(sc, path: str) -> tuple[list[int], list[float]]:
    sampler = sc.create_sampling_client(model_path=path).result()
    params = types.SamplingParams(max_tokens=6, temperature=0.0, seed=1)
    seq = sampler.sample(types.ModelInput.from_ints(TOKENS[:5]), 1, params).result().sequences[0]
    return list(seq.tokens), list(seq.logprobs)


@pytest.mark.ray
def test_serve_with_trainer_ranks_and_engine_actors_serves_a_client_like_one_process(workspace, tmp_path):
    """One trainer behind both doors, at scale: `serve CONFIG --tinker-port P` with two FSDP2 trainer ranks on Ray,
    two colocated engine actors and async rollouts, driven by the real SDK next to a GRPO tenant that keeps
    training: the client's losses and sampled log-probs equal the single-process server's (rtol 1e-4)."""
    ref = BackgroundApp(
        build_server(  # the service config's targets: all-linear, no LoRA on lm_head
            str(workspace / "model"),
            tmp_path / "ref",
            TOKEN,
            base_model=BASE,
            max_loras=2,
            max_rank=8,
            unembed_lora=False,
        ),
        "127.0.0.1",
        ref_port := _free_port(),
    )
    try:
        sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{ref_port}", api_key=TOKEN)
        tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=10).result()
        expected = _sft(tc, 3, TOKENS)
        expected_sample = _sample(sc, tc.save_weights_for_sampler("s3").result().path)
    finally:
        ref.close()

    run_dir, port = tmp_path / "run", _free_port()
    data = _service_config(workspace, run_dir, ["t1"])
    data["model"]["device"] = "cpu"
    data["trainer"] = {"world_size": 2, "colocate_engines": True}
    data["rollout"].update(engine_actors=True, num_engines=2, mode="async")  # 2 CPUs: ranks and engines share
    config = tmp_path / "service.yaml"
    config.write_text(yaml.safe_dump(data))
    served = _Serve(config, port, tmp_path / "serve.log")
    try:
        sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=TOKEN)
        tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=10).result()
        np.testing.assert_allclose(_sft(tc, 3, TOKENS), expected, rtol=1e-4)
        tokens, logprobs = _sample(sc, tc.save_weights_for_sampler("s3").result().path)
        assert tokens == expected_sample[0]
        np.testing.assert_allclose(logprobs, expected_sample[1], rtol=1e-4, atol=1e-6)
        _wait(lambda: len(_metrics(run_dir, "t1")) >= 2, timeout=180)  # the GRPO tenant trains next to it
    finally:
        served.kill_9()
    assert "Traceback" not in served.log.read_text()


def test_serve_passes_the_tinker_flags_to_the_service(monkeypatch):
    """`serve --tinker-port ... --tinker-stability-max-tokens N` reaches the Tinker app's settings; a bad value is
    argparse's usage error (exit 2, no traceback)."""
    from rl_multilora import cli, service

    seen = {}
    monkeypatch.setattr(service, "serve", lambda cfg, address=None, tinker=None, source=None: seen.update(tinker) or 0)
    config = str(REPO / "examples/multi_lora/configs/tiny.yaml")
    args = cli.build_parser().parse_args(
        [
            "serve",
            config,
            "--tinker-port",
            "8123",
            "--tinker-max-tokens-cap",
            "64",
            "--tinker-stability-max-tokens",
            "5000",
        ]
    )
    assert service.cli(args) == 0
    assert seen["port"] == 8123 and seen["max_tokens_cap"] == 64 and seen["stability_max_tokens"] == 5000
    seen.clear()
    service.cli(cli.build_parser().parse_args(["serve", config, "--tinker-port", "8123"]))
    assert "stability_max_tokens" not in seen  # the server's own default
    with pytest.raises(SystemExit) as bad:
        cli.build_parser().parse_args(["serve", config, "--tinker-port", "1", "--tinker-stability-max-tokens", "0"])
    assert bad.value.code == 2
