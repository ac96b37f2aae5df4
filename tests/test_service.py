"""Service mode: submit / remove / status against a live trainer, rejection of bad submissions, stop and resume.

The unmarked tests need no Ray: the client-side parsing (a fake actor handle that must never be reached) and the
status table. The `ray` tests start the real service with `rl-multilora serve` in a subprocess on a local Ray
cluster (so SIGTERM handling and the exit code are tested as a user meets them) on a tiny random Qwen2 model with a
character tokenizer (hidden 32) and three small JSON datasets. Run them with `pytest tests/test_service.py -m ray`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from rl_multilora.config import ModelConfig
from rl_multilora.service import AdapterStatus, ServiceClient, ServiceError, ServiceStatus
from rl_multilora.tenants import TenantState, TenantTable

REPO = Path(__file__).resolve().parents[1]
# Reward 1 when the 4-token response holds a lowercase letter: a random model gets it about half the time, so
# groups have reward variance and every adapter's optimizer steps.
REWARD = {"name": "format", "kwargs": {"pattern": "[a-z]"}}


def adapter_yaml(root: Path, name: str, **over) -> dict:
    data = {
        "name": name,
        "rank": 4,
        "alpha": 8,
        "dataset": {"path": "json", "data_files": {"train": str(root / "data" / f"{name}.jsonl")}},
        "reward": REWARD,
        "lr": 1.0e-2,
        "prompts_per_step": 2,
        # Far past what a test trains: on a quiet machine a tiny step takes 35-50 ms, and a budget of 500 ran out
        # while the lifecycle test's CLI calls ran (c drained on its own before the test removed it).
        "max_steps": 100_000,
        "seed": {"a": 1, "b": 2, "c": 3}.get(name, 0),
    }
    data.update(over)
    return data


def write_yaml(path: Path, data) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# -- no Ray -----------------------------------------------------------------------------------------------------------
class _LocalOnlyClient(ServiceClient):
    """Answers model_config like the actor would; any other call means the bad submission left the client."""

    def __init__(self):
        super().__init__(handle=None)
        self.calls: list[str] = []

    def _call(self, method, *args, timeout=None):
        self.calls.append(method)
        if method == "model_config":
            return ModelConfig(path="unused", max_loras=2, max_rank=8).model_dump(mode="json")
        raise AssertionError(f"a bad submission reached the actor ({method})")


_DROP = object()


@pytest.mark.parametrize(
    "content, expected",
    [
        ("name: x\nrank: [4\n", r"not valid YAML"),
        (b"\xff\xfe name: x\n", r"a UTF-8 text file; this one is not \(invalid start byte at byte 0\)"),
        ({"name": _DROP}, r"name is missing"),
        ({"rank": 64}, r"rank=64 is not allowed; allowed: an integer <= model.max_rank \(8\)"),
        ({"learning_rate": 0.1}, r"learning_rate=0.1 is not allowed; allowed: no such key"),
        ({"name": "bad/name"}, r"name='bad/name' is not allowed; allowed: a string of 1 to 128 letters"),
        ({"max_steps": None}, r"max_steps=None is not allowed; allowed: .*needs a budget"),
        # a whole run config: its sections were listed as unknown keys of one adapter
        (
            "run_dir: r\nmodel: {path: m}\nadapters:\n  - {name: a1}\n  - {name: a2}\n",
            r"this is a run config with an `adapters:` list; allowed: one adapter's mapping .* \(it lists 'a1', 'a2'\)",
        ),
    ],
)
def test_client_rejects_bad_adapter_yaml_before_the_actor(tmp_path, content, expected):
    path = tmp_path / "adapter.yaml"
    if isinstance(content, str):
        path.write_text(content)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        data = {**adapter_yaml(tmp_path, "x"), **content}
        write_yaml(path, {k: v for k, v in data.items() if v is not _DROP})
    client = _LocalOnlyClient()
    with pytest.raises(ServiceError, match=expected) as err:
        client.submit(path)
    assert str(path) in str(err.value)
    assert set(client.calls) <= {"model_config"}


def test_client_rejects_missing_file(tmp_path):
    with pytest.raises(ServiceError, match=r"no such file"):
        _LocalOnlyClient().submit(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "argv", [["serve", "config.yaml"], ["submit", "adapter.yaml"], ["remove", "a"], ["status"]], ids=lambda a: a[0]
)
def test_every_service_verb_without_ray_names_the_extra(monkeypatch, capsys, argv):
    from rl_multilora import cli

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as when it is not installed
    monkeypatch.setattr("sys.path", list(sys.path))  # cli.main puts the working directory on it
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f'`rl-multilora {argv[0]}` needs Ray, which is not installed: pip install -e ".[ray]"' in err, err
    assert "Traceback" not in err


def test_status_table_shows_every_column():
    st = ServiceStatus(
        global_step=7,
        training=True,
        run_dir="runs/x",
        max_loras=2,
        adapters=[
            AdapterStatus("a", "RUNNING", 0, 5, 30, 0.625, "runs/x/adapters/a/step_4"),
            AdapterStatus("b", "PENDING", None, 0, None, None, None),
            AdapterStatus("c", "FAILED", None, 2, 9, None, None, "reward failing"),
        ],
    )
    lines = st.table().splitlines()
    assert lines[0] == "service: training | global step 7 | slots 1/2 | trainer ranks 1 | engines 1 | runs/x"
    assert lines[1].split() == ["NAME", "STATE", "SLOT", "STEPS", "LAST", "REWARD", "CHECKPOINT", "REASON"]
    assert lines[2].split() == ["a", "RUNNING", "0", "5/30", "0.625", "runs/x/adapters/a/step_4"]
    assert lines[3].split() == ["b", "PENDING", "-", "0", "-", "-"]
    assert lines[4].split() == ["c", "FAILED", "-", "2/9", "-", "-", "reward", "failing"]
    assert st.get("b").state == "PENDING" and st.get("zz") is None
    assert json.loads(json.dumps(st.to_dict()))["adapters"][0]["last_reward"] == 0.625
    # Paging: three tenants hold places 0-2 of 3, one of them resident in the only slot (a review found "slots 3/1"
    # and a "slot 2" of a one-slot model)
    paged = ServiceStatus(
        global_step=3,
        training=True,
        run_dir="runs/x",
        max_loras=1,
        adapters=[AdapterStatus(n, "RUNNING", i, 1, 9, 0.5, None, resident=i == 2) for i, n in enumerate("abc")],
        paging={"max_tenants": 3, "resident": 1, "paged": 2, "spilled": 0, "host_mb": 1.8, "page_ins": 4,
                "page_in_s": 0.01},
    )  # fmt: skip
    lines = paged.table().splitlines()
    assert lines[0] == (
        "service: training | global step 3 | slots 1/1, places 3/3 | trainer ranks 1 | engines 1 | runs/x"
    )
    assert lines[2].split()[:3] == ["NAME", "STATE", "PLACE"]
    assert [line.split()[2:4] for line in lines[3:]] == [["0", "(paged)"], ["1", "(paged)"], ["2", "1/9"]]
    idle = ServiceStatus(0, False, "runs/x", 2, error="RuntimeError: boom")
    assert idle.table().splitlines()[:2] == [
        "service: ERROR | global step 0 | slots 0/2 | trainer ranks 1 | engines 1 | runs/x",
        "error: RuntimeError: boom",
    ]


class _OneSlotTenants(TenantTable):
    """The tenant manager's surface without a backend: one slot, retire = drain -> drained, admit = activate."""

    max_loras = 1

    def free_slots(self) -> list[int]:
        return [s for s in range(self.max_loras) if s not in self.used_slots()]

    def retire_finished(self) -> None:
        for t in self.in_state(TenantState.DRAINING):
            self.mark_drained(t.name)
            self.mark_removed(t.name)  # no engine here: what the sync's apply_sync does once it is unloaded

    read_in: list = []  # the threads outside_facts ran in

    def outside_facts(self, a):
        self.read_in.append(threading.current_thread())
        return ("facts of", a.name)

    def admission_problems(self, a, restart: bool = False, facts=None) -> list[str]:
        return []

    def admit_pending(self) -> None:
        for t in self.pending_in_order():
            free = self.free_slots()
            if not free:
                break
            self.activate(t.name, free[0])

    def save_run_state(self) -> None:
        pass


class _GatedRuntime:
    """The Runtime surface ServiceCore uses, with a real tenant table and checkpoint manager but no model.

    Each `step()` announces itself on `started` and then waits for the test to open `gate` (until `free_run` is
    set), so the test can act while a step is in flight. `in_step` records whether a register/remove ran inside a step (it never should).
    """

    def __init__(self, tmp: Path):
        from rl_multilora.checkpoint import CheckpointManager
        from rl_multilora.config import RunConfig

        self.cfg = RunConfig(model=ModelConfig(path=str(tmp), max_loras=1, max_rank=8), run_dir=str(tmp / "run"))
        self.run_dir = Path(self.cfg.run_dir)
        self.tenants = _OneSlotTenants()
        self.backend = SimpleNamespace(lora_modules=None, lora_parameters=None, world_size=1)  # no model
        self.ckpt = CheckpointManager(self.run_dir)
        self.started = threading.Semaphore(0)
        self.gate = threading.Semaphore(0)
        self.free_run = threading.Event()  # set: steps no longer wait for the gate
        self.in_step = False
        self.fail_next = False
        self.events: list = []
        self.registered_with: list = []  # (facts, thread) of each register

    def start(self) -> None:
        self.events.append("start")

    def register(self, a, facts=None):
        self.events.append(("register", a.name, self.in_step))
        self.registered_with.append((facts, threading.current_thread()))
        return self.tenants.register(a)

    def remove(self, name: str, reason: str = "removed by request") -> None:
        self.events.append(("remove", name, self.in_step))
        self.tenants.drain(name, reason)

    def step(self) -> None:
        self.in_step = True
        self.started.release()
        if not self.free_run.is_set():
            assert self.gate.acquire(timeout=30), "the test never let the step finish"
        try:
            if self.fail_next:
                raise RuntimeError("boom in step")
            for t in self.tenants.running():
                t.adapter_step += 1
            self.tenants.retire_finished()
            self.tenants.admit_pending()
            self.tenants.global_step += 1
        finally:
            self.in_step = False

    def sync_now(self) -> None:
        self.events.append("sync")

    def idle_step(self) -> None:
        self.tenants.retire_finished()
        self.tenants.admit_pending()
        self.sync_now()

    def checkpoint_all(self) -> None:
        self.events.append("checkpoint_all")

    def close(self) -> None:
        self.events.append("close")


def test_core_applies_mutations_between_steps_only(tmp_path):
    from rl_multilora.config import AdapterConfig
    from rl_multilora.service import ServiceCore

    (tmp_path / "data").mkdir()
    for name in "abc":
        (tmp_path / "data" / f"{name}.jsonl").write_text(json.dumps({"prompt": "p", "label": "l"}) + "\n")
    cfg = {n: AdapterConfig.model_validate(adapter_yaml(tmp_path, n)) for n in "abc"}
    rt = _GatedRuntime(tmp_path)
    core = ServiceCore(rt, poll_s=0.05)
    core.start()
    try:
        assert core.submit(cfg["a"]).state == "PENDING"  # idle: applied at once, admitted, and a step starts
        assert rt.started.acquire(timeout=10)
        with ThreadPoolExecutor(2) as pool:
            sub_b = pool.submit(core.submit, cfg["b"])
            rm_a = pool.submit(core.remove, "a")
            time.sleep(0.3)
            # Both wait for the step in flight to end; nothing changed under it.
            assert not sub_b.done() and not rm_a.done()
            assert "b" not in rt.tenants.tenants and rt.tenants.get("a").state == TenantState.RUNNING
            rt.gate.release()
            assert sub_b.result(10).state == "PENDING" and rm_a.result(10).state == "DRAINING"
        assert all(not e[2] for e in rt.events if isinstance(e, tuple)), rt.events
        # What a submission reads from the outside world (dataset, reward, environment) is read in the caller's
        # thread and handed to the training thread, which does not read it again under the turn lock.
        assert [facts for facts, _ in rt.registered_with] == [("facts of", "a"), ("facts of", "b")]
        assert not {thread for _, thread in rt.registered_with} & set(rt.tenants.read_in)
        # One slot: b is admitted once a has drained; a is then REMOVED (its name may be submitted again).
        assert rt.started.acquire(timeout=10)
        st = core.status()
        assert (st.get("a").state, st.get("b").state, st.get("b").slot) == ("REMOVED", "RUNNING", 0)
        assert st.training and st.get("a").adapter_step == 1
        rt.free_run.set()  # from here on steps run freely; requests are applied between them
        rt.gate.release()
        with pytest.raises(ServiceError, match=r"cannot remove 'a': adapter 'a' is REMOVED"):
            core.remove("a")
        with pytest.raises(ServiceError, match=r"'zz' is not registered"):
            core.remove("zz")

        # A failing step stops training, is reported in status, and later requests get the reason.
        rt.fail_next = True
        deadline = time.monotonic() + 10
        while core.status().error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert core.status().error == "RuntimeError: boom in step" and not core.status().training
        with pytest.raises(ServiceError, match=r"stopped training after an error: RuntimeError: boom"):
            core.submit(cfg["c"])
    finally:
        core.stop(timeout=10)
    core.stop(timeout=10)
    assert rt.events.count("checkpoint_all") == 1 and rt.events[-1] == "close"


def test_a_submit_that_reads_its_dataset_while_the_service_stops_is_refused_not_left_waiting(tmp_path):
    """`submit` passed its open check, read its dataset (seconds for a large one), and meanwhile `stop()` drained the
    queue and finished: the late mutation was queued after the last drain, and the caller waited for ever."""
    from rl_multilora.config import AdapterConfig
    from rl_multilora.service import ServiceCore

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text(json.dumps({"prompt": "p", "label": "l"}) + "\n")
    rt = _GatedRuntime(tmp_path)
    rt.free_run.set()
    core = ServiceCore(rt, poll_s=0.05)
    core.start()
    stopped = threading.Event()

    def facts_while_stopping(a):
        core.stop(timeout=10)  # the service stops while this submission reads the outside world
        stopped.set()
        return ("facts of", a.name)

    rt.tenants.outside_facts = facts_while_stopping
    with ThreadPoolExecutor(1) as pool:
        late = pool.submit(core.submit, AdapterConfig.model_validate(adapter_yaml(tmp_path, "a")))
        with pytest.raises(ServiceError, match="the service is stopping"):
            late.result(timeout=10)
    assert stopped.is_set() and rt.events.count("checkpoint_all") == 1


def test_remove_of_a_tinker_clients_model_says_how_it_is_released(tmp_path):
    from rl_multilora.service import ServiceCore
    from rl_multilora.tenants import ClientTenant

    rt = _GatedRuntime(tmp_path)
    rt.tenants.clients["m1"] = ClientTenant(name="m1", rank=8, slot=0)
    core = ServiceCore(rt, poll_s=0.05)
    with pytest.raises(ServiceError, match=r"'m1' is a Tinker client's model: it is released through the Tinker API"):
        core._drain("m1")


def test_serve_watch_tolerates_a_slow_status_and_gives_up_on_a_stuck_one(monkeypatch):
    """A status that timed out once (submits waiting for the step held the actor's threads) ended `serve` with the
    actor killed, before its final checkpoint; now a few late answers in a row are tolerated."""
    import rl_multilora.service as service

    answers = iter([service.ServiceTimeout("late"), SimpleNamespace(error=None), service.ServiceTimeout("late")])

    class Client:
        calls = 0

        def status(self):
            Client.calls += 1
            answer = next(answers, service.ServiceTimeout("late"))
            if isinstance(answer, Exception):
                raise answer
            return answer

    stop = threading.Event()
    monkeypatch.setattr(service, "_auth_mode", lambda: "token")
    monkeypatch.setattr(service, "token_location", lambda: "here")
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="127.0.0.1:1"))
    cfg = SimpleNamespace(run_dir="run", model=SimpleNamespace(max_loras=1, max_rank=8))
    with pytest.raises(ServiceError, match="5 times in a row: the service looks stuck"):
        service._run_until_signal(Client(), cfg, stop, health_every_s=0.001, started=True)
    assert Client.calls == 2 + service._MAX_LATE_STATUS  # late, fine, then late five times


def test_shipped_service_configs_validate():
    """configs/service.yaml starts empty; each configs/adapters/*.yaml is a valid submission against its model."""
    from rl_multilora.config import load_run_config, load_yaml, parse_adapter_config

    configs = REPO / "examples" / "multi_lora" / "configs"
    cfg = load_run_config(configs / "service.yaml")
    assert cfg.adapters == [] and cfg.checkpoint.resume != "never"
    names = []
    for path in sorted((configs / "adapters").glob("*.yaml")):
        a = parse_adapter_config(load_yaml(path), cfg.model, source=str(path))
        assert a.name == path.stem and a.max_steps is not None
        names.append(a.name)
    assert names == ["arith", "compare", "gsm8k"]
    # submit_schedule.sh submits exactly these files.
    schedule = (REPO / "examples" / "multi_lora" / "submit_schedule.sh").read_text()
    assert sorted(re.findall(r"\$adapters/(\w+)\.yaml", schedule)) == names


# -- on a local Ray cluster -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """Tiny model, one 64-row dataset per adapter, the service config and one YAML per adapter."""
    from tests.tiny_models import save_tiny_model

    root = tmp_path_factory.mktemp("service")
    save_tiny_model(root / "model", hidden=32, layers=2)
    (root / "data").mkdir()
    for name in ("a", "b", "c"):
        rows = [{"prompt": f"{name} says {i}", "label": name} for i in range(64)]
        (root / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        write_yaml(root / f"{name}.yaml", adapter_yaml(root, name))
    write_yaml(root / "service.yaml", service_config(root, root / "run"))
    jemalloc = service_config(root, root / "run")  # the same service, its actor under jemalloc (model.host_allocator)
    jemalloc["model"]["host_allocator"] = "jemalloc"
    write_yaml(root / "service-jemalloc.yaml", jemalloc)
    return root


def service_config(root: Path, run_dir: Path, adapters: list | None = None) -> dict:
    return {
        "run_dir": str(run_dir),
        "model": {"path": str(root / "model"), "max_loras": 2, "max_rank": 8, "device": "cpu"},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 4},
        "grpo": {"micro_batch_size": 16},
        "rewards": {"num_workers": 1},
        "checkpoint": {"save_every": 3, "keep_last": 2},
        "logging": {"plot": False, "progress": False},
        "service_poll_s": 0.5,
        "adapters": adapters or [],
    }


class Served:
    """`rl-multilora serve` in a subprocess, as a user runs it; `address` is parsed from its banner."""

    def __init__(self, root: Path, timeout: float = 240, config: str = "service.yaml"):
        self.log = root / f"serve-{time.time_ns()}.log"
        self._fh = self.log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rl_multilora.cli", "serve", str(root / config)],
            cwd=root,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + timeout
        while not (m := re.search(r"service ready \(Ray (\S+), namespace", self.log.read_text())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"serve did not become ready (rc {self.proc.returncode}):\n{self.tail()}")
            time.sleep(0.5)
        self.address = m.group(1)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text().splitlines()[-n:])

    def stop(self, timeout: float = 180) -> int:
        disconnect()  # a Ray driver whose cluster goes away exits its process a minute later: leave first
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._fh.close()


def _die_with_parent() -> None:
    """Runs in the serve child: SIGTERM it if pytest dies, so no service outlives a crashed test run (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def disconnect() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def connect(address: str) -> ServiceClient:
    disconnect()
    return ServiceClient.connect(address)


def cli(root: Path, served: Served, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rl_multilora.cli", *args, "--address", served.address]
    return subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=180)


def wait_until(client: ServiceClient, served: Served, pred, what: str, timeout: float = 180) -> ServiceStatus:
    deadline = time.monotonic() + timeout
    while True:
        st = client.status()
        try:
            if pred(st):
                return st
        except AttributeError:  # an adapter not in the status yet
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n{st.table()}\n--- serve log ---\n{served.tail()}")
        time.sleep(0.3)


def adapter_rows(run_dir: Path, name: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sorted((r for r in rows if r["adapter"] == name), key=lambda r: r["step"])


def saved_step(checkpoint: str | Path) -> int:
    """The adapter step a checkpoint folder holds, from its metadata (folder names are not a contract)."""
    return json.loads(Path(checkpoint, "checkpoint.json").read_text())["adapter_step"]


def checkpoint_step(run_dir: Path, name: str) -> int:
    """`name`'s step at shutdown, checked against the checkpoint the run state points to."""
    state = json.loads((run_dir / "run_state.json").read_text())["adapters"][name]
    assert saved_step(state["last_checkpoint"]) == state["adapter_step"], f"{name}: no checkpoint at its last step"
    return state["adapter_step"]


@pytest.fixture(scope="module")
def ray_client_cleanup():
    """This test process connects to each service's cluster as a client; disconnect before pytest reports."""
    yield
    disconnect()


@pytest.mark.ray
def test_service_lifecycle(workspace, ray_client_cleanup):
    """Submit two, add a third while they train, remove one, stop, restart, resume; reject bad ones; compare.

    The lifecycle events come first and back to back (in-process client calls take milliseconds) so b's trajectory
    under comparison stays short: over a hundred steps, float-level differences between a mixed batch and a solo
    batch can flip one sampled token and the two runs part ways, which is not what this test is about.
    """
    root, run = workspace, workspace / "run"
    first = Served(root)
    try:
        client = connect(first.address)
        st = client.status()
        assert st.adapters == [] and not st.training and st.max_loras == 2

        assert client.submit(root / "a.yaml").state == "PENDING"
        assert client.submit(root / "b.yaml").state == "PENDING"
        st = wait_until(
            client, first, lambda s: s.get("a").adapter_step >= 3 and s.get("b").adapter_step >= 3, "a, b training"
        )
        assert st.training and {st.get("a").slot, st.get("b").slot} == {0, 1}

        # Both slots are busy: c waits as PENDING.
        assert client.submit(root / "c.yaml").state == "PENDING"
        st = client.status()
        assert (st.get("c").state, st.get("c").slot) == ("PENDING", None)

        # Remove a: it drains (final checkpoint, slot freed) and c takes the slot.
        assert client.remove("a").state == "DRAINING"
        st = wait_until(
            client,
            first,
            lambda s: s.get("a").state == "REMOVED" and s.get("c").adapter_step >= 3,
            "a removed and c training",
        )
        a = st.get("a")
        assert a.slot is None and saved_step(a.last_checkpoint) == a.adapter_step
        assert Path(a.last_checkpoint, "adapter_model.safetensors").is_file()
        assert st.get("c").state == "RUNNING" and st.get("b").state == "RUNNING"
        assert first.stop() == 0, first.tail()
    finally:
        first.kill()
    assert "checkpointed every live adapter" in first.log.read_text()
    steps = {name: checkpoint_step(run, name) for name in ("a", "b", "c")}
    first_global_steps = json.loads((run / "run_state.json").read_text())["global_step"]
    assert steps["a"] == a.adapter_step

    assert "host allocator: glibc" in first.log.read_text()
    # Restart on the same run dir: finished tenants are remembered, resubmitted ones resume from their checkpoints.
    # The restarted actor runs under jemalloc (Ray's runtime_env preloads it): b's trajectory below, across both
    # allocators, must still equal b trained alone.
    second = Served(root, config="service-jemalloc.yaml")
    assert "host allocator: jemalloc" in second.log.read_text(), second.tail()
    try:
        client = connect(second.address)
        st = client.status()
        assert [(x.name, x.state) for x in st.adapters] == [("a", "REMOVED")] and not st.training
        client.submit(root / "b.yaml")
        client.submit(root / "c.yaml")
        st = wait_until(client, second, lambda s: s.get("b").adapter_step >= steps["b"] + 3, "b resumed")
        assert st.get("c").state == "RUNNING" and st.get("c").adapter_step >= steps["c"]
        # a was removed in the first session: resubmitted, it waits for a slot, then resumes from its drain checkpoint.
        assert client.submit(root / "a.yaml").state == "PENDING"
        client.remove("b")
        st = wait_until(client, second, lambda s: s.get("a").adapter_step >= steps["a"] + 2, "a resumed")
        assert st.get("b").state == "REMOVED"

        # Bad submissions are rejected with the reason; nothing else changes and training goes on.
        step0 = st.global_step
        (root / "broken.yaml").write_text("name: x\nrank: [4\n")
        out = cli(root, second, "submit", str(root / "broken.yaml"))
        assert out.returncode == 2 and "not valid YAML" in out.stderr and "Traceback" not in out.stderr
        unknown_reward = write_yaml(root / "r.yaml", adapter_yaml(root, "r", reward={"name": "no_such_reward"}))
        out = cli(root, second, "submit", str(unknown_reward))
        assert out.returncode == 2 and "adapter 'r' rejected" in out.stderr and "reward" in out.stderr
        bad = {
            "rank=64 is not allowed; allowed: an integer <= model.max_rank (8)": adapter_yaml(root, "big", rank=64),
            "already RUNNING": adapter_yaml(root, "c"),
            "dataset": adapter_yaml(root, "d", dataset={"path": "json", "data_files": str(root / "none.jsonl")}),
            "already at adapter step": adapter_yaml(root, "b", max_steps=steps["b"]),
        }
        for reason, data in bad.items():
            with pytest.raises(ServiceError, match=re.escape(reason)):
                client.submit(data)
        st = wait_until(client, second, lambda s: s.global_step >= step0 + 3, "training to continue")
        assert {x.name: x.state for x in st.adapters} == {"a": "RUNNING", "b": "REMOVED", "c": "RUNNING"}

        # The CLI verbs against the same service.
        out = cli(root, second, "status", "--json")
        assert out.returncode == 0, out.stderr
        states = {x["name"]: x["state"] for x in json.loads(out.stdout)["adapters"]}
        assert states == {"a": "RUNNING", "b": "REMOVED", "c": "RUNNING"}
        out = cli(root, second, "status")
        assert out.returncode == 0 and re.search(r"^c\s+RUNNING\s+\d", out.stdout, re.M), out.stdout
        out = cli(root, second, "remove", "zz")
        assert out.returncode == 2 and "'zz' is not registered" in out.stderr
        out = cli(root, second, "remove", "c")
        assert out.returncode == 0 and "draining" in out.stdout, out.stderr
        wait_until(client, second, lambda s: s.get("c").state == "REMOVED", "c removed")
        assert second.stop() == 0, second.tail()
    finally:
        second.kill()
    for name in ("a", "b", "c"):  # each one's first step after the restart continues from its checkpoint
        later = [r for r in adapter_rows(run, name) if r["step"] >= first_global_steps]
        assert later and later[0]["adapter_step"] in (steps[name], steps[name] + 1), (name, later[:1])

    # b's whole trajectory (next to a, then next to c, stop, restart, resume) equals b trained alone.
    rows = adapter_rows(run, "b")
    solo = service_config(root, root / "solo_b", [adapter_yaml(root, "b")])
    solo["max_global_steps"] = len(rows)
    from rl_multilora.config import parse_run_config
    from rl_multilora.loop import run as run_alone

    run_alone(parse_run_config(solo))
    alone = adapter_rows(root / "solo_b", "b")
    assert [r["adapter_step"] for r in rows] == [r["adapter_step"] for r in alone]
    assert [r["reward_mean"] for r in rows] == pytest.approx([r["reward_mean"] for r in alone], abs=1e-6)
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in alone], abs=1e-5)


@pytest.mark.ray
@pytest.mark.parametrize("colocated", [False, True], ids=["ranks", "ranks_and_colocated_engines"])
def test_service_trains_with_two_trainer_ranks(workspace, ray_client_cleanup, colocated):
    """`serve` with trainer.world_size 2 on a 2-CPU cluster: the ranks get their placement group (the service actor
    reserves nothing), a submitted tenant trains, status shows the ranks, and a stop checkpoints it. Colocated: two
    engine actors share the ranks' bundles (half a CPU each) and fit the same 2-CPU cluster."""
    root = workspace
    name = "run_colocated" if colocated else "run_ranks"
    cfg = service_config(root, root / name)
    cfg["trainer"] = {"world_size": 2, "colocate_engines": colocated}
    if colocated:
        cfg["rollout"].update(engine_actors=True, num_engines=2)
    # The service actor, both ranks and (colocated) both engine actors start under jemalloc (model.host_allocator;
    # Ray's runtime_env).
    cfg["model"]["host_allocator"] = "jemalloc"
    write_yaml(root / f"service_{name}.yaml", cfg)
    served = Served(root, config=f"service_{name}.yaml")
    try:
        client = connect(served.address)
        assert client.submit(root / "a.yaml").state == "PENDING"
        st = wait_until(client, served, lambda s: s.get("a").adapter_step >= 2, "a training on 2 ranks")
        engines = 2 if colocated else 1
        assert st.trainer_ranks == 2 and f"trainer ranks 2 | engines {engines}" in st.table()
        assert served.stop() == 0, served.tail()
    finally:
        served.kill()
    assert checkpoint_step(root / name, "a") >= 2
    log = served.log.read_text()
    assert "host allocator: jemalloc" in log, log[-3000:]
    assert "trainer ranks: 2, host allocator jemalloc" in log, log[-3000:]
    assert ("engine actors: 2, host allocator jemalloc" in log) == colocated, log[-3000:]


@pytest.mark.ray
def test_serve_refuses_a_jemalloc_its_workers_cannot_preload(workspace, tmp_path):
    """model.host_allocator: jemalloc with RL_MULTILORA_JEMALLOC naming a file the loader cannot preload: serve
    exits 2 with the reason before the service actor is built, without a traceback, and trains nothing."""
    broken = tmp_path / "libjemalloc.so"
    broken.write_text("not a shared object")
    cfg = service_config(workspace, tmp_path / "run")
    cfg["model"]["host_allocator"] = "jemalloc"
    write_yaml(tmp_path / "service.yaml", cfg)
    env = {**os.environ, "RL_MULTILORA_JEMALLOC": str(broken)}
    out = subprocess.run([sys.executable, "-m", "rl_multilora.cli", "serve", str(tmp_path / "service.yaml")],
                         cwd=workspace, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    assert f"a Ray worker started with LD_PRELOAD={broken} has glibc" in out.stderr, text[-3000:]
    assert "Traceback" not in text and 'File "' not in text, text[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_name_submitted_again_with_resume_never_starts_over_and_keeps_its_first_life(workspace, tmp_path):
    """`serve --fresh` (`checkpoint.resume: never`): a name removed and submitted again starts at adapter step 0. Its
    new checkpoints went into the folder that still held the first life's higher-step ones, and pruning by adapter
    step deleted the new ones as they were written (`status` named a checkpoint that did not exist; `export` and a
    later `resume: auto` took the first life's weights). The first life is archived now, checkpoints and rows."""
    from rl_multilora.config import AdapterConfig, parse_run_config
    from rl_multilora.loop import Runtime
    from rl_multilora.service import ServiceCore

    run_dir = tmp_path / "run"
    cfg = service_config(workspace, run_dir)
    cfg["checkpoint"].update(resume="never", save_every=2, keep_last=2)
    core = ServiceCore(Runtime.build(parse_run_config(cfg)), poll_s=0.05)

    def until(pred, what):
        deadline = time.monotonic() + 120
        while not pred(core.status()):
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{core.status().table()}"
            time.sleep(0.05)
        return core.status()

    adapter = AdapterConfig.model_validate(adapter_yaml(workspace, "a"))
    core.start()
    try:
        core.submit(adapter)
        until(lambda st: st.get("a").adapter_step >= 5, "a's first life")
        core.remove("a")
        first = until(lambda st: st.get("a").state == "REMOVED", "a removed").get("a").adapter_step
        core.submit(adapter)
        until(lambda st: st.get("a").adapter_step >= 1, "a's second life")
        core.remove("a")
        second = until(lambda st: st.get("a").state == "REMOVED", "a removed again").get("a")
    finally:
        core.stop(timeout=60)
    assert second.adapter_step < first
    assert second.last_checkpoint is not None and Path(second.last_checkpoint).is_dir()
    steps = sorted(int(p.name.split("_")[1]) for p in (run_dir / "adapters" / "a").glob("step_*"))
    assert steps and max(steps) == second.adapter_step  # only the second life's checkpoints
    (archived,) = (run_dir / "archive").iterdir()
    old = sorted(int(p.name.split("_")[1]) for p in (archived / "adapters" / "a").glob("step_*"))
    assert max(old) == first
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    mine = [r["adapter_step"] for r in rows if r.get("adapter") == "a" and "adapter_step" in r]
    assert mine and mine[0] == 1 and max(mine) == second.adapter_step
    old_rows = [json.loads(line) for line in (archived / "metrics.jsonl").read_text().splitlines()]
    assert {r["adapter"] for r in old_rows} == {"a"} and len(old_rows) >= first


def test_an_adapter_whose_epochs_ran_out_is_refused_when_submitted_again_unchanged(workspace, tmp_path):
    """Accepted as PENDING ("trains from the next step"), then retired at admission without a step or a word; a
    `max_steps` already reached was refused up front, and `epochs` now is too, naming the field."""
    from rl_multilora.config import AdapterConfig, parse_run_config
    from rl_multilora.loop import Runtime
    from rl_multilora.service import ServiceCore

    core = ServiceCore(Runtime.build(parse_run_config(service_config(workspace, tmp_path / "run"))), poll_s=0.05)
    a = adapter_yaml(workspace, "a", epochs=1, prompts_per_step=32)  # 64 rows: two steps
    core.start()
    try:
        core.submit(AdapterConfig.model_validate(a))
        deadline = time.monotonic() + 120
        while core.status().get("a").state != "REMOVED":
            assert time.monotonic() < deadline, core.status().table()
            time.sleep(0.05)
        with pytest.raises(ServiceError, match=r"epochs=1\.0 is not allowed; allowed: more than 1: its checkpoint"):
            core.submit(AdapterConfig.model_validate(a))
        assert core.submit(AdapterConfig.model_validate({**a, "epochs": 2})).state == "PENDING"  # a larger budget
    finally:
        core.stop(timeout=60)


def test_status_at_an_address_nothing_listens_on_is_a_quick_clear_error(capsys):
    """`status --address` with a wrong port printed Ray's connection warnings for minutes instead of an error."""
    import socket

    pytest.importorskip("ray")
    from rl_multilora.cli import main

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    assert main(["status", "--address", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert f"no Ray cluster answers at --address '127.0.0.1:{port}'" in err and "Traceback" not in err, err
    assert time.monotonic() - started < 30


def _plugin_module(folder: Path, name: str, body: str) -> str:
    (folder / f"{name}.py").write_text(body)
    return name


def test_a_submitted_plugin_that_ends_its_process_at_import_is_refused_and_the_others_keep_training(
    workspace, tmp_path, monkeypatch
):
    """A reward module that called `os._exit(3)` at import, submitted to a running service, ended the service's
    process and every tenant's unsaved steps with it (a reviewer's repro). Plugins are loaded in a throwaway process
    first (rl_multilora/plugin_probe.py): the submission is refused naming the field, and `a` trains on. Were the
    probe gone, this test's own process would end here."""
    from rl_multilora.config import AdapterConfig, parse_run_config
    from rl_multilora.loop import Runtime
    from rl_multilora.service import ServiceCore

    monkeypatch.syspath_prepend(str(tmp_path))
    _plugin_module(tmp_path, "exits_at_import", "import os\nos._exit(3)\ndef fn(prompt, response, label, metadata):\n"
                   "    return 0.0\n")  # fmt: skip
    _plugin_module(tmp_path, "env_exits_when_built", "import os\nfrom rollout.environments import Environment\n"
                   "class Env(Environment):\n    def __init__(self):\n        os._exit(4)\n"
                   "    def step(self, action):\n        return None\n")  # fmt: skip
    core = ServiceCore(Runtime.build(parse_run_config(service_config(workspace, tmp_path / "run"))), poll_s=0.05)
    core.start()
    try:
        core.submit(AdapterConfig.model_validate(adapter_yaml(workspace, "a")))
        bad = adapter_yaml(workspace, "b", reward={"path": "exits_at_import:fn"})
        with pytest.raises(ServiceError, match=r"reward\.path='exits_at_import:fn' is not allowed: loading it ended the "
                           r"process \(exit code 3\)"):  # fmt: skip
            core.submit(AdapterConfig.model_validate(bad))
        env = adapter_yaml(workspace, "c", reward=None, environment={"path": "env_exits_when_built:Env"})
        with pytest.raises(ServiceError, match=r"environment\.path='env_exits_when_built:Env' is not allowed: .*exit "
                           r"code 4"):  # fmt: skip
            core.submit(AdapterConfig.model_validate(env))
        seen = core.status().get("a").adapter_step
        deadline = time.monotonic() + 120
        while core.status().get("a").adapter_step < seen + 2:
            assert time.monotonic() < deadline, core.status().table()
            time.sleep(0.05)
        assert core.status().get("b") is None and core.status().get("c") is None
    finally:
        core.stop(timeout=60)


def test_the_plugin_probe_says_how_a_plugin_ended_its_process(tmp_path, monkeypatch):
    from rl_multilora import plugin_probe
    from rl_multilora.config import AdapterConfig

    monkeypatch.syspath_prepend(str(tmp_path))
    fn = "\ndef fn(prompt, response, label, metadata):\n    return 0.0\n"
    _plugin_module(tmp_path, "fine", fn)
    _plugin_module(tmp_path, "raises", "raise ValueError('no')" + fn)  # the in-process checks say it, as before
    _plugin_module(tmp_path, "crashes", "import ctypes\nctypes.string_at(0)" + fn)
    _plugin_module(tmp_path, "hangs", "import time\ntime.sleep(60)" + fn)
    # a module that prints a partial line, or replaces sys.stdout, was read as one that ended its process (a
    # reviewer's find: the probe's marks shared its stdout)
    _plugin_module(tmp_path, "chatty", "import sys\nsys.stdout.write('loading...')" + fn)
    _plugin_module(tmp_path, "quiet", "import os, sys\nsys.stdout = open(os.devnull, 'w')" + fn)

    def adapter(module):
        return AdapterConfig.model_validate(
            {"name": "x", "dataset": {"path": "json", "data_files": {"train": "x.jsonl"}},
             "reward": {"path": f"{module}:fn"}, "max_steps": 1}
        )  # fmt: skip

    assert plugin_probe.probe(adapter("fine")) == []
    assert plugin_probe.probe(adapter("raises")) == []
    assert plugin_probe.probe(adapter("chatty")) == [] and plugin_probe.probe(adapter("quiet")) == []
    assert (
        plugin_probe.probe(AdapterConfig.model_validate({**adapter("fine").model_dump(), "reward": {"name": "gsm8k"}}))
        == []
    )
    (crashed,) = plugin_probe.probe(adapter("crashes"))
    assert crashed.startswith(
        "reward.path='crashes:fn' is not allowed: loading it ended the process (killed by SIGSEGV"
    )
    (hung,) = plugin_probe.probe(adapter("hangs"), timeout_s=3)
    assert hung.startswith("reward.path='hangs:fn' is not allowed: loading it did not finish within 3 s (the limit")
