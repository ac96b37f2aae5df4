"""SGLangEngine speaks SGLang's API: every request it sends uses only fields SGLang's request structs define
(with the right JSON types), and it parses every response shape SGLang returns.

Field lists and responses come from `tests/fixtures/sglang_api.json`, recorded from the source of sglang 0.5.23
(file paths inside). Requests are captured by a tiny aiohttp server that answers with those fixture responses.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from aiohttp import web

from rollout.engines.sglang import SGLangEngine, SGLangError
from rollout.engines.sglang_launcher import SGLangLauncher
from rollout.engines.sglang_protocol import (
    ADAPTER_VERSION_HEADER,
    check_lora_config,
    encode_tensors_sglang,
    generate_payload,
)
from rollout.types import GenerateRequest, SamplingParams

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "sglang_api.json").read_text())
REQUESTS = FIXTURE["requests"]
RESPONSES = FIXTURE["responses"]
CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    return {f"{prefix}.lora_A.weight": torch.randn(4, 16, generator=g), f"{prefix}.lora_B.weight": torch.zeros(16, 4)}


# -------------------------------------------------------------------------------- JSON type checks


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_b64(v) -> bool:
    try:
        base64.b64decode(v, validate=True)
    except (ValueError, TypeError):
        return False
    return isinstance(v, str)


_KINDS = {
    "str": lambda v: isinstance(v, str),
    "int": _is_int,
    "float": lambda v: isinstance(v, float),
    "bool": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "dict": lambda v: isinstance(v, dict),
    "list[int]": lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
    "list[list[int]]": lambda v: isinstance(v, list) and all(isinstance(r, list) and all(map(_is_int, r)) for r in v),
    "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "list[str|null]": lambda v: isinstance(v, list) and all(x is None or isinstance(x, str) for x in v),
    "list[bool]": lambda v: isinstance(v, list) and all(isinstance(x, bool) for x in v),
    "list[dict]": lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v),
    "list[base64]": lambda v: isinstance(v, list) and all(_is_b64(x) for x in v),
}


def assert_matches_struct(body: dict, spec: dict, where: str) -> None:
    """Every key is a field of the SGLang struct, of a JSON shape we declared for it; required keys present."""
    fields = spec["fields"]
    for key, value in body.items():
        assert key in fields, f"{where}: {key!r} is not a field of SGLang's {spec['struct']}"
        kinds = fields[key].get("json")
        assert kinds, f"{where}: field {key!r} is sent but the fixture declares no JSON shape for it"
        assert any(_KINDS[k](value) for k in kinds), f"{where}.{key}={value!r} is not one of {kinds}"
    for key in spec.get("required", []):
        assert key in body, f"{where}: required field {key!r} missing"


def assert_sglang_request(method: str, path: str, body: dict | None) -> None:
    assert path in REQUESTS, f"{path} is not an SGLang endpoint in the fixture"
    spec = REQUESTS[path]
    assert method in spec["methods"], f"{method} {path}: SGLang accepts {spec['methods']}"
    if body is None:
        assert not spec["required"], f"{path} needs a body with {spec['required']}"
        return
    assert_matches_struct(body, spec, path)
    if path == "/generate":
        items = body["sampling_params"] if isinstance(body["sampling_params"], list) else [body["sampling_params"]]
        for item in items:
            assert_matches_struct(item, REQUESTS["sampling_params"], "/generate.sampling_params")


# -------------------------------------------------------------------------------- capture server


class CaptureServer:
    """Records every request and answers with SGLang's fixture responses (or a queued /generate answer)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict | None, dict]] = []
        self.generate_answers: list[tuple[int, dict]] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.url = ""

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        with self._lock:
            self.calls.append((request.method, request.path, body, dict(request.headers)))
        if request.path == "/generate":
            with self._lock:
                status, answer = self.generate_answers.pop(0) if self.generate_answers else (200, None)
            if answer is None:
                answer = RESPONSES["/generate"]["examples"]["length"]
            return web.json_response(answer, status=status)
        ok = RESPONSES[request.path]["ok"]
        if "body" in ok:
            return web.json_response(ok["body"], status=ok["status"])
        return web.Response(text=ok["text"], status=ok["status"])

    async def _start(self) -> None:
        app = web.Application(client_max_size=1024**3)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    def __enter__(self) -> CaptureServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def paths(self) -> list[str]:
        return [path for _, path, _, _ in self.calls]


@pytest.fixture
def capture():
    with CaptureServer() as server:
        yield server


# -------------------------------------------------------------------------------- tests: requests


def test_generate_requests_use_only_sglang_fields(capture):
    engine = SGLangEngine(capture.url, api_key="k", tensor_format="safetensors")
    sp = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=3, stop=["\n"], stop_token_ids=[2], seed=5
    )
    engine.generate(
        [
            GenerateRequest(input_ids=[1, 2, 3], adapter="a", sampling=sp, rid="r0"),
            GenerateRequest(input_ids=[4, 5], adapter=None, sampling=SamplingParams(temperature=0.0)),
        ]
    )
    bodies = {b["input_ids"][0]: b for _, path, b, _ in capture.calls if path == "/generate"}
    assert len(capture.calls) == 2
    for method, path, body, headers in capture.calls:
        assert_sglang_request(method, path, body)
        assert headers["Authorization"] == "Bearer k"
    assert FIXTURE["auth"]["headers"] == ["Authorization: Bearer <key>"]  # the only header SGLang reads
    adapter_row, base_row = bodies[1], bodies[4]
    assert adapter_row["lora_path"] == "a" and adapter_row["return_logprob"] is True and adapter_row["rid"] == "r0"
    assert adapter_row["sampling_params"] == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "max_new_tokens": 3,
        "stop": ["\n"],
        "stop_token_ids": [2],
        "sampling_seed": 5,
    }
    assert "lora_path" not in base_row  # base rows never name an adapter
    assert "stop" not in base_row["sampling_params"] and "sampling_seed" not in base_row["sampling_params"]


def test_adapter_request_is_never_sent_without_its_name():
    assert generate_payload(GenerateRequest(input_ids=[1], adapter="t0"))["lora_path"] == "t0"
    with pytest.raises(ValueError, match="adapter=''"):
        generate_payload(GenerateRequest(input_ids=[1], adapter=""))
    with pytest.raises(ValueError, match=r"input_ids=\[\] is not allowed"):
        generate_payload(GenerateRequest(input_ids=[], adapter="t0"))


@pytest.mark.parametrize("tensor_format", ["safetensors", "sglang"])
def test_adapter_and_sync_requests_use_only_sglang_fields(capture, tensor_format):
    engine = SGLangEngine(capture.url, tensor_format=tensor_format, tp_size=2)
    assert engine.load_adapter("a", _tensors(0), CONFIG) == 1
    engine.pause()
    assert engine.load_adapter("a", _tensors(1), CONFIG) == 2  # reload: SGLang needs an unload first
    engine.resume()
    engine.unload_adapter("a")
    assert engine.health()
    assert capture.paths() == [
        "/load_lora_adapter_from_tensors",
        "/pause_generation",
        "/unload_lora_adapter",
        "/load_lora_adapter_from_tensors",
        "/flush_cache",  # adapters changed during the pause
        "/continue_generation",
        "/unload_lora_adapter",
        "/health",
    ]
    for method, path, body, _ in capture.calls:
        if path in ("/health",):
            assert method == "GET"
            continue
        assert_sglang_request(method, path, body)
    load = capture.calls[0][2]
    assert len(load["serialized_named_tensors"]) == 2  # one copy per TP rank
    assert load["config_dict"] == CONFIG
    assert capture.calls[0][3][ADAPTER_VERSION_HEADER] == "1" and capture.calls[3][3][ADAPTER_VERSION_HEADER] == "2"
    assert ("load_format" in load) == (tensor_format == "safetensors")
    assert capture.calls[1][2] == {"mode": "abort"}  # never retract / in_place: unloading there deadlocks
    assert engine.adapter_versions() == {}


def test_load_from_path_uses_sglang_fields(capture, tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps(CONFIG))
    engine = SGLangEngine(capture.url)
    assert engine.load_adapter_from_path("p", str(tmp_path)) == 1
    method, path, body, _ = capture.calls[0]
    assert_sglang_request(method, path, body)
    assert body == {"lora_name": "p", "lora_path": str(tmp_path), "pinned": False}


def test_rslora_and_dora_are_rejected_before_anything_is_sent(capture, tmp_path):
    engine = SGLangEngine(capture.url, tensor_format="safetensors")
    with pytest.raises(ValueError, match="use_rslora=True is not allowed.*lora_alpha / r"):
        engine.load_adapter("a", _tensors(), {**CONFIG, "use_rslora": True})
    with pytest.raises(ValueError, match="use_dora"):
        engine.load_adapter("a", _tensors(), {**CONFIG, "use_dora": True})
    (tmp_path / "adapter_config.json").write_text(json.dumps({**CONFIG, "use_rslora": True}))
    with pytest.raises(ValueError, match="use_rslora"):
        engine.load_adapter_from_path("a", str(tmp_path))
    with pytest.raises(ValueError, match=r"config\.r=0"):
        check_lora_config({**CONFIG, "r": 0})
    # The model's PEFT-config rules (rl_multilora.lora), all problems at once.
    with pytest.raises(
        ValueError, match=r"(?s)config\.peft_type='IA3'.*config\.bias='all' is not allowed; allowed: 'none'"
    ):
        check_lora_config({**CONFIG, "peft_type": "IA3", "bias": "all"})
    # The adapter-name rule of rl_multilora.lora, before anything is sent.
    for name in ("", "a/b", "a\n", ".."):
        with pytest.raises(ValueError, match=r"adapter name=.* is not allowed; allowed: "):
            engine.load_adapter(name, _tensors(), CONFIG)
        with pytest.raises(ValueError, match=r"adapter name=.* is not allowed; allowed: "):
            engine.unload_adapter(name)
    assert capture.calls == []


def test_sglang_tensor_encoding_decodes_in_an_unrelated_process_on_this_host(tmp_path):
    """What SGLang's MultiprocessingSerializer.deserialize does (base64 -> pickle.loads) works in a process that
    is not our multiprocessing child, as a separately launched server is not."""
    sent = _tensors(2)
    snapshot = {k: v.clone() for k, v in sent.items()}  # kept alive until the reader is done
    code = (
        "import base64, pickle, sys, torch\n"
        "d = pickle.loads(base64.b64decode(sys.stdin.read(), validate=True))\n"
        "torch.save(d, sys.argv[1])\n"
    )
    target = tmp_path / "received.pt"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(target)],
        input=encode_tensors_sglang(snapshot),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    received = torch.load(target)
    assert received.keys() == sent.keys()
    assert all(torch.equal(received[k], sent[k]) for k in sent)


def test_sglang_tensor_encoding_passes_sglangs_restricted_unpickler():
    """SGLang 0.5.23 unpickles serialized_named_tensors with an allow-list of globals; our encoding of a dict of
    CPU tensors must name only globals on that list (the subset recorded in the fixture)."""
    import io
    import pickle

    allowed = {
        tuple(g) for g in REQUESTS["/load_lora_adapter_from_tensors"]["allowed_globals_used_by_a_cpu_tensor_dict"]
    }
    seen: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    sent = {**_tensors(3), "x.lora_B.weight": torch.ones(2, 3, dtype=torch.bfloat16)}
    snapshot = {k: v.clone() for k, v in sent.items()}  # kept alive until read back
    received = Recording(io.BytesIO(base64.b64decode(encode_tensors_sglang(snapshot)))).load()
    assert seen <= allowed, f"globals SGLang's SafeUnpickler would block: {sorted(seen - allowed)}"
    assert all(torch.equal(received[k], sent[k]) for k in sent)


# -------------------------------------------------------------------------------- tests: responses


@pytest.mark.parametrize(
    ("example", "finish"),
    [
        ("stop_token", "stop"),
        ("stop_str", "stop"),
        ("stop_token_list", "stop"),
        ("length", "length"),
        ("abort", "abort"),
        ("abort_waiting", "abort"),
        ("abort_error", "error"),
    ],
)
def test_every_generate_response_shape_is_parsed(capture, example, finish):
    answer = RESPONSES["/generate"]["examples"][example]
    capture.generate_answers.append((200, answer))
    [result] = SGLangEngine(capture.url).generate([GenerateRequest(input_ids=[1, 2])])
    assert result.finish_reason == finish
    if finish in ("stop", "length"):
        assert result.output_ids == answer["output_ids"]
        assert result.output_logprobs == [row[0] for row in answer["meta_info"]["output_token_logprobs"]]
        assert result.error is None
    if finish == "error":
        assert "context length" in result.error


def test_generate_without_output_ids_takes_ids_from_logprobs(capture):
    answer = json.loads(json.dumps(RESPONSES["/generate"]["examples"]["length"]))
    del answer["output_ids"]
    capture.generate_answers.append((200, answer))
    [result] = SGLangEngine(capture.url).generate([GenerateRequest(input_ids=[1])])
    assert result.output_ids == [7, 8, 9]


@pytest.mark.parametrize("kind", ["error", "validation_error", "contract_error", "http_error"])
def test_generate_error_bodies_become_error_results(capture, kind):
    spec = RESPONSES["/generate"][kind]
    capture.generate_answers.append((spec["status"], spec["body"]))
    [result] = SGLangEngine(capture.url).generate([GenerateRequest(input_ids=[1], adapter="zzz")])
    assert result.finish_reason == "error"
    body = spec["body"]
    error = body.get("error")
    expected = error["message"] if isinstance(error, dict) else error if error is not None else body["message"]
    assert expected in result.error


def test_unauthorized_raises_instead_of_failing_silently(capture):
    capture.generate_answers.append((401, FIXTURE["auth"]["unauthorized"]["body"]))
    with pytest.raises(SGLangError, match="api_key"):
        SGLangEngine(capture.url).generate([GenerateRequest(input_ids=[1])])


def test_versions_are_tracked_per_adapter_client_side(capture):
    engine = SGLangEngine(capture.url, tensor_format="safetensors")
    engine.load_adapter("a", _tensors(), CONFIG)
    engine.load_adapter("b", _tensors(), CONFIG, version=7)
    capture.generate_answers += [(200, RESPONSES["/generate"]["examples"]["length"])] * 3
    res = engine.generate([GenerateRequest([1], "a"), GenerateRequest([1], "b"), GenerateRequest([1], None)])
    assert [r.weight_version for r in res] == [1, 7, None]
    engine.unload_adapter("a")
    assert engine.load_adapter("a", _tensors(), CONFIG) == 2  # a re-added name never reuses a version


# -------------------------------------------------------------------------------- launcher


def test_launcher_command_uses_sglang_flags():
    launcher = SGLangLauncher(
        "/models/tiny", port=31000, max_loras_per_batch=4, max_lora_rank=16, lora_target_modules="all-linear"
    )
    cmd = launcher.command()
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    for flag, value in [
        ("--model-path", "/models/tiny"),
        ("--port", "31000"),
        ("--host", "127.0.0.1"),
        ("--max-loras-per-batch", "4"),
        ("--max-lora-rank", "16"),
        ("--lora-target-modules", "all"),
        ("--lora-backend", "triton"),
    ]:
        assert cmd[cmd.index(flag) + 1] == value
        assert flag in FIXTURE["sources"]["launch_flags"]["note"]
    assert "--enable-lora" in cmd
    assert launcher.lora_backend in FIXTURE["sources"]["launch_flags"]["flags"]["--lora-backend"]["choices"]
    with pytest.raises(ValueError, match="max_lora_rank=0"):
        SGLangLauncher("/m", max_lora_rank=0)


def test_launcher_fails_fast_with_log_tail_when_the_server_dies(tmp_path):
    # No sglang here: `python -m sglang.launch_server` exits at once, and start() must say why.
    launcher = SGLangLauncher("/m", port=1, python=sys.executable, log_path=str(tmp_path / "log"))
    if _has_sglang():
        pytest.skip("sglang is installed; this test needs it missing")
    with pytest.raises(RuntimeError, match=r"(?s)exited with code \d+.*No module named .sglang"):
        launcher.start()


def _has_sglang() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


class _StubLauncher(SGLangLauncher):
    """Runs a stand-in server that answers 200 on every GET, to test readiness and stop()."""

    def command(self) -> list[str]:
        code = (
            "import http.server as h\n"
            "class H(h.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        self.send_response(200); self.end_headers()\n"
            "    def log_message(self, *a): pass\n"
            f"h.HTTPServer(('127.0.0.1', {self.port}), H).serve_forever()\n"
        )
        return [self.python, "-c", code]


def test_launcher_waits_for_health_generate_and_stops_the_process_group(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = _StubLauncher("/m", port=port, log_path=str(tmp_path / "log"), stop_grace_s=5)
    url = launcher.start()
    proc = launcher._proc
    assert url == f"http://127.0.0.1:{port}" and proc.poll() is None
    assert SGLangLauncher.attach(url).health()
    launcher.stop()
    assert proc.poll() is not None
    with pytest.raises(RuntimeError, match="no healthy SGLang server"):
        SGLangLauncher.attach(f"http://127.0.0.1:{port}")
