"""The GRPO loop over HTTP: `rollout.engine: http` against `rl-multilora engine-serve` in another process
reaches the same rewards and weights as the embedded engine with the same seeds."""

import os
import socket
import subprocess
import sys
import time

import pytest
import requests
import torch

from rl_multilora.config import parse_run_config
from rl_multilora.loop import run
from rl_multilora.metrics import read_metrics
from tests.test_loop import _config, _weights, workspace  # noqa: F401 - shared fixture


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def engine_server(workspace):  # noqa: F811
    port = _free_port()
    env = dict(os.environ, RL_MULTILORA_API_KEY="secret-token")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rl_multilora.cli", "engine-serve", "--model", str(workspace / "model"),
         "--port", str(port), "--max-loras", "3", "--max-rank", "8"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"engine-serve exited early:\n{proc.stdout.read()}")
        try:
            if requests.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except requests.ConnectionError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("engine-serve did not become healthy in 120 s")
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_http_engine_run_matches_embedded(workspace, engine_server, tmp_path):  # noqa: F811
    names = ["t1", "t2"]
    embedded = tmp_path / "embedded"
    http = tmp_path / "http"
    run(parse_run_config(_config(workspace, embedded, names, steps=2)))
    cfg = _config(workspace, http, names, steps=2)
    cfg["rollout"].update(engine="http", url=engine_server, api_key="secret-token")
    run(parse_run_config(cfg))
    for name in names:
        r_emb = [r["reward_mean"] for r in read_metrics(embedded) if r["adapter"] == name]
        r_http = [r["reward_mean"] for r in read_metrics(http) if r["adapter"] == name]
        assert len(r_http) == 2 and r_http == pytest.approx(r_emb, abs=1e-6)
        w_emb, w_http = _weights(embedded, name), _weights(http, name)
        for k in w_emb:
            torch.testing.assert_close(w_http[k], w_emb[k], rtol=1e-4, atol=1e-5)
    # Every version pushed over HTTP reached the server (the run's final sync unloads drained adapters).
    info = requests.get(f"{engine_server}/get_model_info", headers={"Authorization": "Bearer secret-token"}).json()
    assert info.get("adapter_versions", {}) == {}


@pytest.mark.parametrize("server", ["silent", "none"])
def test_an_http_engine_url_that_is_silent_is_a_config_error_within_the_wait(workspace, tmp_path, monkeypatch, server):  # noqa: F811,E501
    """rollout.url where a server accepts connections and never answers (or nothing listens): the run exits 2
    naming rollout.url after HTTP_ENGINE_WAIT_S; each /health try waited up to 30 s of its own before."""
    from rl_multilora import components
    from rl_multilora.config import ConfigError

    monkeypatch.setattr(components, "HTTP_ENGINE_WAIT_S", 1.0)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        if server == "silent":
            listener.listen(8)  # the kernel completes the handshakes; nothing ever reads or answers
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        cfg = _config(workspace, tmp_path / "run", ["t1"], steps=1)
        cfg["rollout"].update(engine="http", url=url)
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match=rf"rollout.url='{url}' is not allowed; allowed: a server that answers"):
            components.build_engine(parse_run_config(cfg), backend=None, tokenizer=None)
        assert time.monotonic() - t0 < 5
