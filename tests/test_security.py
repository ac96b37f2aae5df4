"""Every security statement of the docs (guides/engines.md, guides/service.md), checked against what really runs.

`engine-serve` (no Ray): it is never open by default (a key is generated and written to an owner-only file when none
is given), binds 127.0.0.1, keeps `/health*` open as SGLang does, and `--no-api-key` opens it only with a warning.
Run as a user runs it: `rl-multilora engine-serve` in a subprocess on a tiny model.

The service (`-m ray`): `rl-multilora serve` in a subprocess starts its own local Ray cluster, with HOME pointing at
an empty folder so Ray's first start (token generation) is what is tested and the user's own ~/.ray is never touched.
Every process of that cluster is found from the serve process down (psutil), every port they listen on is probed
without the token: a gRPC call (each Ray gRPC service checks the token per method, so the probe uses a read-only
method each service has) and an HTTP GET. What answers is compared with what the service guide says answers.
"""

from __future__ import annotations

import http.client
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import requests
import yaml

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def docs_paragraph(page: str, start: str) -> str:
    """The paragraph of docs/`page` that begins with `start`, whitespace-normalised: the security claims the guides
    make are checked here."""
    text = (REPO / "docs" / page).read_text()
    i = text.index(start)
    j = text.find("\n\n", i)
    return " ".join(text[i : j if j != -1 else None].split())


def listening(procs: list[psutil.Process]) -> list[tuple[psutil.Process, psutil._common.addr]]:
    out = []
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out += [(p, c.laddr) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- engine-serve -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tests.tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("engine_serve") / "model")


class EngineServe:
    """`rl-multilora engine-serve` in a subprocess with its own XDG_CACHE_HOME and no key in the environment."""

    def __init__(self, model: Path, tmp: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cache = tmp / "cache"
        env = dict(os.environ, XDG_CACHE_HOME=str(self.cache))
        env.pop("RL_MULTILORA_API_KEY", None)
        self.log = tmp / f"engine-serve-{self.port}.log"
        self._fh = self.log.open("w")
        cmd = [sys.executable, "-m", "rl_multilora.cli", "engine-serve", "--model", str(model)]
        self.proc = subprocess.Popen(
            [*cmd, "--port", str(self.port), "--max-loras", "2", "--max-rank", "8", *flags],
            env=env,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"engine-serve did not become healthy (rc {self.proc.returncode}):\n{self.output()}")
            try:
                if requests.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                time.sleep(0.3)

    def output(self) -> str:
        return self.log.read_text()

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(20)
        self._fh.close()
        return self.output()


PROTECTED = [
    ("get", "/model_info", None),
    ("post", "/load_lora_adapter", {"lora_name": "a", "lora_path": "/nonexistent"}),
    ("post", "/unload_lora_adapter", {"lora_name": "a"}),
    ("post", "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}),
    ("post", "/pause_generation", {"mode": "abort"}),
]


def test_engine_serve_without_a_key_generates_one_in_an_owner_only_file(tiny_model_dir, tmp_path):
    """The engines guide: engine-serve is never open by default; the generated key's file is the only place it appears."""
    server = EngineServe(tiny_model_dir, tmp_path)
    try:
        key_file = server.cache / "rl-multilora" / f"engine-serve-{server.port}.key"
        assert key_file.is_file(), server.output()
        assert mode(key_file) == 0o600 and mode(key_file.parent) == 0o700
        key = key_file.read_text()
        assert len(key) >= 40 and key.strip() == key  # token_urlsafe(32): 43 characters, no newline
        for method, path, body in PROTECTED:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": key}):
                resp = requests.request(method, server.url + path, json=body, headers=headers, timeout=30)
                assert resp.status_code == 401, (path, headers)
        assert requests.get(server.url + "/health", timeout=30).status_code == 200  # open, as SGLang's
        auth = {"Authorization": f"Bearer {key}"}
        assert requests.get(server.url + "/model_info", headers=auth, timeout=30).status_code == 200
        # Binds 127.0.0.1 only (the CLI's default, not just the library's).
        addresses = {addr.ip for _, addr in listening([psutil.Process(server.proc.pid)])}
        assert addresses == {"127.0.0.1"}
    finally:
        out = server.stop()
    assert str(key_file) in out and key not in out  # says where the key is, never the key
    engine_serve = docs_paragraph("guides/engines.md", "`engine-serve` has SGLang's endpoints")
    assert "engine-serve-<port>.key" in engine_serve and "--no-api-key" in engine_serve
    assert "127.0.0.1" in docs_paragraph("guides/engines.md", "```bash\nrl-multilora engine-serve")


def test_engine_serve_no_api_key_serves_open_with_a_warning(tiny_model_dir, tmp_path):
    server = EngineServe(tiny_model_dir, tmp_path, "--no-api-key")
    try:
        assert requests.get(server.url + "/model_info", timeout=30).status_code == 200
    finally:
        out = server.stop()
    assert "WARNING" in out and "--no-api-key" in out and "without authentication" in out
    assert not (server.cache / "rl-multilora").exists()


def test_engine_serve_key_sources_and_conflicts(tmp_path, monkeypatch, capsys):
    """--api-key / RL_MULTILORA_API_KEY are used as given (no file); --key-file moves the generated key; a key and
    --no-api-key together are refused in the project's grammar, and no message ever shows a key."""
    import rl_multilora.engine_serve as serve_module
    import rollout.server.http_server as http_server

    served: list[str | None] = []
    monkeypatch.setattr(serve_module, "build_embedded_engine", lambda *a, **k: (_Closable(), None))
    monkeypatch.setattr(http_server, "serve", lambda engine, **kw: served.append(kw["api_key"]))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("RL_MULTILORA_API_KEY", raising=False)
    (tmp_path / "config.json").write_text("{}")  # engine-serve checks it before the (stubbed) build
    model = ["--model", str(tmp_path), "--port", str(free_port())]

    key_file = tmp_path / "keys" / "nested" / "k"
    assert serve_module.main([*model, "--key-file", str(key_file)]) == 0
    assert key_file.read_text() == served[-1] and mode(key_file) == 0o600
    err = capsys.readouterr().err
    assert str(key_file) in err and served[-1] not in err
    assert not (tmp_path / "cache").exists()

    assert serve_module.main([*model, "--api-key", "given-key"]) == 0 and served[-1] == "given-key"
    monkeypatch.setenv("RL_MULTILORA_API_KEY", "env-key")
    assert serve_module.main(model) == 0 and served[-1] == "env-key"
    assert not (tmp_path / "cache").exists()  # a given key is never written anywhere
    assert "env-key" not in capsys.readouterr().err

    refused = {
        ("--no-api-key",): "--no-api-key together with RL_MULTILORA_API_KEY is not allowed; allowed: one of them",
        ("--api-key", "k", "--no-api-key"): "--no-api-key together with --api-key is not allowed",
        ("--api-key", ""): "--api-key='' is not allowed; allowed: a non-empty key, or --no-api-key",
        ("--api-key", "k", "--key-file", "f"): "--key-file='f' together with --api-key is not allowed; allowed:",
    }
    for flags, message in refused.items():
        with pytest.raises(SystemExit):
            serve_module.main([*model, *flags])
        err = capsys.readouterr().err
        assert message in err, err
    monkeypatch.delenv("RL_MULTILORA_API_KEY")
    with pytest.raises(SystemExit):
        serve_module.main([*model, "--no-api-key", "--key-file", "f"])
    assert "--no-api-key together with --key-file is not allowed" in capsys.readouterr().err
    assert len(served) == 3  # nothing refused was served

    # A busy port is refused before any key is written: a second engine-serve on the port of a running one must
    # not overwrite that server's key file.
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit):
            serve_module.main(["--model", str(tmp_path), "--port", str(port)])
    err = capsys.readouterr().err
    assert f"--port={port} is not allowed; allowed: a free port (127.0.0.1:{port} is in use)" in err, err
    assert not (tmp_path / "cache").exists() and len(served) == 3


class _Closable:
    def close(self) -> None:
        pass


# -- the service's Ray cluster ----------------------------------------------------------------------------------------
# One read-only method per Ray gRPC service: Ray checks the token per method, so a method the server does not have
# answers UNIMPLEMENTED whatever the token. ObjectManagerService has no read-only method; Pull is sent without a
# token only (an empty Pull asks for nothing).
GRPC_PROBES = (
    "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo",  # GCS
    "/ray.rpc.NodeManagerService/GetSystemConfig",  # raylet
    "/ray.rpc.CoreWorkerService/NumPendingTasks",  # the driver and every worker
    "/ray.rpc.LogService/ListLogs",  # dashboard agent
    "/ray.rpc.ReporterService/HealthCheck",  # dashboard agent
    "/ray.rpc.ObjectManagerService/Pull",  # raylet's object manager
)


def reachable(addr) -> str:
    """The address to probe a listening socket on: loopback for a wildcard bind, else the address it is bound to."""
    return "127.0.0.1" if addr.ip in ("0.0.0.0", "::") else addr.ip


def grpc_status(addr, token: str | None = None) -> str | None:
    """The gRPC status of the first probe the server at `addr` implements; None when it is not a gRPC server."""
    import grpc

    metadata = (("authorization", f"Bearer {token}"),) if token else None
    for method in GRPC_PROBES:
        if token and method.endswith("/Pull"):
            continue
        with grpc.insecure_channel(f"{reachable(addr)}:{addr.port}") as channel:
            try:
                channel.unary_unary(method)(b"", timeout=10, metadata=metadata)
                return "OK"
            except grpc.RpcError as e:
                code = e.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            return None  # not HTTP/2: not a gRPC server
        if code != grpc.StatusCode.UNIMPLEMENTED:
            return code.name
    return "UNIMPLEMENTED"


def http_get(addr, path: str) -> tuple[int, bytes] | None:
    """(status, body) of a plain HTTP GET without credentials; None when the port does not speak HTTP/1."""
    conn = http.client.HTTPConnection(reachable(addr), addr.port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (http.client.HTTPException, OSError):
        return None
    finally:
        conn.close()


def role(p: psutil.Process) -> str:
    cmd = " ".join(p.cmdline())
    for needle, name in (
        ("gcs_server", "gcs_server"),
        ("raylet/raylet", "raylet"),
        ("dashboard/dashboard.py", "dashboard"),
        ("autoscaler/_private/monitor.py", "autoscaler monitor"),
        ("log_monitor.py", "log monitor"),
        ("rl_multilora.cli serve", "serve (Ray driver)"),
    ):
        if needle in cmd:
            return name
    for agent in ("DashboardAgent", "RuntimeEnvAgent"):
        if cmd.startswith(f"ray::{agent}"):
            return agent
    return "worker" if p.name().startswith("ray::") or "default_worker.py" in cmd else cmd[:80]


class ServeCluster:
    """`rl-multilora serve` in a subprocess on the cluster it starts; HOME is a fresh folder (Ray's first start)."""

    def __init__(self, root: Path, home: Path, **env_over: str) -> None:
        from tests.test_service import _die_with_parent

        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
        env.update(HOME=str(home), **env_over)
        self.env = env
        self.log = root / f"serve-{time.time_ns()}.log"
        self._fh = self.log.open("w")
        # a run dir of its own (under `home`): the module's cluster may be serving root/run, and one process trains
        # into a run dir at a time
        config = yaml.safe_load((root / "service.yaml").read_text())
        config["run_dir"] = str(home / "run")
        (home / "service.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rl_multilora.cli", "serve", str(home / "service.yaml")],
            cwd=root,
            env=env,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + 240
        while not (m := re.search(r"service ready \(Ray (\S+), namespace", self.output())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"serve did not become ready (rc {self.proc.returncode}):\n{self.output()[-4000:]}")
            time.sleep(0.5)
        self.address = m.group(1)
        self.gcs_port = int(self.address.rsplit(":", 1)[1])

    def output(self) -> str:
        return self.log.read_text()

    def processes(self) -> list[psutil.Process]:
        me = psutil.Process(self.proc.pid)
        return [me, *me.children(recursive=True)]

    def ports(self) -> list[tuple[psutil.Process, psutil._common.addr]]:
        return listening(self.processes())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._fh.close()


@pytest.fixture(scope="module")
def service_root(tmp_path_factory) -> Path:
    from tests.test_service import service_config
    from tests.tiny_models import save_tiny_model

    root = tmp_path_factory.mktemp("security")
    save_tiny_model(root / "model", hidden=32, layers=2)
    (root / "service.yaml").write_text(yaml.safe_dump(service_config(root, root / "run"), sort_keys=False))
    return root


@pytest.fixture(scope="module")
def cluster(service_root):
    """The cluster `serve` starts, as a user gets it. The two metrics exporters get free ports (Ray reads them from
    the environment) so a concurrent Ray cluster on this machine cannot take them and hide them from the probes."""
    metrics = {"AUTOSCALER_METRIC_PORT": str(free_port()), "DASHBOARD_METRIC_PORT": str(free_port())}
    served = ServeCluster(service_root, service_root / "home", **metrics)
    served.metric_ports = {name: int(port) for name, port in metrics.items()}
    try:
        # The exporters start in their own processes; give them a moment after the banner.
        deadline = time.monotonic() + 60
        while {a.port for _, a in served.ports()} < set(served.metric_ports.values()):
            assert time.monotonic() < deadline, f"metrics ports never listened: {served.ports()}"
            time.sleep(0.5)
        yield served
    finally:
        served.stop()


@dataclass
class Port:
    role: str
    addr: Any
    answer: str  # "grpc UNAUTHENTICATED", "http 401", "http 200 metrics", ...


def probe(cluster: ServeCluster) -> list[Port]:
    """Every port the cluster listens on, with what it answers to a request that carries no token."""
    ports = []
    for proc, addr in cluster.ports():
        status = grpc_status(addr)
        if status is not None:
            ports.append(Port(role(proc), addr, f"grpc {status}"))
            continue
        got = http_get(addr, "/metrics")
        if got is None:
            answer = "nothing"
        elif got[0] == 200 and b"# TYPE " in got[1]:
            answer = "http 200 metrics"  # Prometheus text format
        else:
            answer = f"http {got[0]}"
        ports.append(Port(role(proc), addr, answer))
    return ports


def loopback(port: int) -> Any:
    return SimpleNamespace(ip="127.0.0.1", port=port)


@pytest.mark.ray
def test_ray_grpc_ports_refuse_calls_without_the_token(cluster):
    """The service guide: token authentication stays on. Every gRPC server of the cluster (GCS, raylet, object manager, the
    serve driver's and every worker's core worker, the dashboard agent) answers UNAUTHENTICATED without the token,
    and OK with it. They listen on every interface (the guide says so), so the token is what keeps other machines out."""
    grpc_ports = [p for p in probe(cluster) if p.answer.startswith("grpc ")]
    for p in grpc_ports:
        assert p.answer == "grpc UNAUTHENTICATED", p
        assert p.addr.ip in ("::", "0.0.0.0"), p
    roles = [p.role for p in grpc_ports]
    assert {"gcs_server", "raylet", "serve (Ray driver)", "worker", "DashboardAgent"} <= set(roles), roles
    assert roles.count("raylet") == 2  # node manager and object manager
    token = (cluster.home / ".ray" / "auth_token").read_text().strip()
    assert grpc_status(loopback(cluster.gcs_port), token) == "OK"
    assert grpc_status(loopback(cluster.gcs_port), "not-the-token") == "UNAUTHENTICATED"


@pytest.mark.ray
def test_token_file_is_generated_and_owner_only(cluster):
    """The service guide: on the first start Ray writes a random token to ~/.ray/auth_token and serve makes it 0600 (Ray itself
    writes it with the umask's mode, 0644 here)."""
    token_file = cluster.home / ".ray" / "auth_token"
    assert token_file.is_file() and len(token_file.read_text().strip()) >= 32
    assert mode(token_file) == 0o600
    assert f"auth: token (in {token_file})" in cluster.output()


@pytest.mark.ray
def test_only_the_three_metrics_exporters_answer_without_the_token(cluster):
    """The service guide names every port that answers without the token, and why: three Prometheus exporters (read-only
    metrics over plain HTTP, on every interface). Every other port is gRPC or HTTP that answers 401."""
    from ray.autoscaler._private import constants as autoscaler_consts
    from ray.dashboard import consts as dashboard_consts

    ports = probe(cluster)
    open_ports = [p for p in ports if p.answer not in ("grpc UNAUTHENTICATED", "http 401")]
    for p in open_ports:
        assert p.answer == "http 200 metrics" and p.addr.ip in ("0.0.0.0", "::"), p
    m = cluster.metric_ports
    assert sorted((p.role, p.addr.port) for p in open_ports if p.role != "DashboardAgent") == [
        ("autoscaler monitor", m["AUTOSCALER_METRIC_PORT"]),
        ("dashboard", m["DASHBOARD_METRIC_PORT"]),
    ], ports
    # The dashboard agent's exporter is Ray's metrics export port (random unless `ray start` fixes it).
    assert [p.role for p in open_ports].count("DashboardAgent") == 1, ports
    # The agents' HTTP servers are token-protected: the dashboard agent's (52365 by default) and the runtime env's.
    assert {"DashboardAgent", "RuntimeEnvAgent"} <= {p.role for p in ports if p.answer == "http 401"}, ports
    # The service guide names them, by their default ports and the variables that move them.
    assert autoscaler_consts.AUTOSCALER_METRIC_PORT == 44217 and dashboard_consts.DASHBOARD_METRIC_PORT == 44227
    security = docs_paragraph("guides/service.md", "**Security.**")
    for needle in ("44217", "44227", "AUTOSCALER_METRIC_PORT", "DASHBOARD_METRIC_PORT", "metrics export port"):
        assert needle in security, needle


@pytest.mark.ray
def test_agent_metrics_exporter_closes_with_metrics_collection_off(service_root, tmp_path):
    """The service guide: RAY_enable_metrics_collection=0 in serve's environment closes the dashboard agent's exporter; the
    other two stay (nothing in Ray 2.60 turns them off)."""
    served = ServeCluster(service_root, tmp_path / "home", RAY_enable_metrics_collection="0")
    try:
        time.sleep(3)  # the exporters start in their own processes, shortly after the banner
        open_ports = [p for p in probe(served) if p.answer not in ("grpc UNAUTHENTICATED", "http 401")]
    finally:
        served.stop()
    assert {p.role for p in open_ports} <= {"autoscaler monitor", "dashboard"}, open_ports
    assert "RAY_enable_metrics_collection=0" in docs_paragraph("guides/service.md", "**Security.**")


@pytest.mark.ray
def test_dashboard_process_runs_without_ui_or_http_api(cluster):
    """The service guide: Ray 2.60 starts dashboard.py even with include_dashboard=False (nothing turns it off), but only with
    its usage-stats module and no web server: no UI, no REST/Jobs API answers on any port of the cluster."""
    dashboards = [p for p in cluster.processes() if role(p) == "dashboard"]
    assert len(dashboards) == 1, [role(p) for p in cluster.processes()]
    cmd = dashboards[0].cmdline()
    assert "--disable-frontend" in cmd and "--modules-to-load=UsageStatsHead" in cmd, cmd
    for proc, addr in cluster.ports():
        for path in ("/", "/api/version", "/api/jobs/"):
            got = http_get(addr, path)
            if got is not None:
                assert got[0] == 401 or b"# TYPE " in got[1], (role(proc), addr, path, got)
    security = docs_paragraph("guides/service.md", "**Security.**")
    assert "dashboard is not started" not in security.lower()
    assert "dashboard.py" in security and "no web UI" in security


@pytest.mark.ray
def test_clients_read_the_token_file_and_are_refused_without_a_token(cluster, tmp_path):
    """The service guide: clients on the same machine read ~/.ray/auth_token; RAY_AUTH_TOKEN and RAY_AUTH_TOKEN_PATH
    override it (with RAY_AUTH_MODE=token for an explicit --address); a client without the token is refused."""
    token_file = cluster.home / ".ray" / "auth_token"
    empty_home = tmp_path / "nobody"
    empty_home.mkdir()
    elsewhere = tmp_path / "token"
    shutil.copy2(token_file, elsewhere)

    def status(**env: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "rl_multilora.cli", "status", "--json", "--address", cluster.address]
        return subprocess.run(cmd, env={**cluster.env, **env}, capture_output=True, text=True, timeout=180)

    ok = status(HOME=str(cluster.home))
    assert ok.returncode == 0 and '"adapters": []' in ok.stdout, ok.stderr[-2000:]
    refused = status(HOME=str(empty_home))
    assert refused.returncode == 2 and "token" in refused.stderr.lower(), refused.stderr[-2000:]
    token = token_file.read_text().strip()
    by_value = status(HOME=str(empty_home), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    assert by_value.returncode == 0, by_value.stderr[-2000:]
    by_path = status(HOME=str(empty_home), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(elsewhere))
    assert by_path.returncode == 0, by_path.stderr[-2000:]


@pytest.mark.ray
def test_auth_mode_disabled_is_honoured_with_a_warning(service_root, tmp_path):
    """The service guide: an explicit RAY_AUTH_MODE=disabled is honoured, with a warning (and the banner says so)."""
    served = ServeCluster(service_root, tmp_path / "home", RAY_AUTH_MODE="disabled")
    try:
        out = served.output()
        assert "token authentication is OFF (RAY_AUTH_MODE=disabled)" in out
        assert "auth: DISABLED" in out
        assert grpc_status(loopback(served.gcs_port)) == "OK"  # what the warning is about
    finally:
        served.stop()
