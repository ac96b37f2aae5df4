"""SGLangEngine speaks SGLang's API: every request it sends uses only fields SGLang's request structs define
(with the right JSON types), and it parses every response shape SGLang returns.

Field lists and responses come from `tests/fixtures/sglang_api.json`, recorded from the source of sglang 0.5.23
(file paths inside). Requests are captured by a tiny aiohttp server that answers with those fixture responses.
Expert LoRA (MoE `target_parameters`) is checked against the layout and math of SGLang's MoE LoRA loader recorded in
`tests/fixtures/sglang_moe_lora.json`, and (marked `sglang`) against that loader's own code.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pickle
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from aiohttp import web

from rollout.sglang.client import SGLangEngine, SGLangError
from rollout.sglang.launcher import SGLangLauncher
from rollout.sglang.protocol import (
    ADAPTER_VERSION_HEADER,
    SGLANG_EXPERT_MODULES,
    check_lora_config,
    decode_tensors_safetensors,
    encode_tensors_sglang,
    experts_to_sglang,
    generate_payload,
    sglang_expert_shapes,
)
from rollout.types import GenerateRequest, SamplingParams

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "sglang_api.json").read_text())
MOE = json.loads((Path(__file__).parent / "fixtures" / "sglang_moe_lora.json").read_text())
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
        self.loaded: list[dict[str, torch.Tensor]] = []  # tensors of each /load_lora_adapter_from_tensors, decoded
        self.generate_answers: list[tuple[int, dict]] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.url = ""

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        with self._lock:
            self.calls.append((request.method, request.path, body, dict(request.headers)))
        if request.path == "/load_lora_adapter_from_tensors":
            # Decoded while the client's POST waits, as SGLang does: its snapshot is alive only until then.
            data = body["serialized_named_tensors"][0]
            if body.get("load_format") == "safetensors":
                self.loaded.append(decode_tensors_safetensors(data))
            else:
                self.loaded.append({k: v.clone() for k, v in pickle.loads(base64.b64decode(data)).items()})
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
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        max_new_tokens=3,
        stop=["\n"],
        stop_token_ids=[2],
        seed=5,
        ignore_eos=True,
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
        "ignore_eos": True,
    }
    assert "lora_path" not in base_row  # base rows never name an adapter
    assert "stop" not in base_row["sampling_params"] and "sampling_seed" not in base_row["sampling_params"]
    assert "ignore_eos" not in base_row["sampling_params"]  # SGLang's default, left out


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


# -------------------------------------------------------------------------------- expert LoRA (MoE)

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
E, H, INTER = 4, 32, 16  # experts, hidden size, expert intermediate size of the tiny Qwen3-MoE below


def _moe_base():
    """A float32 random 2-layer Qwen3-MoE (hidden 32, 4 experts of width 16, top-2); same weights on every call."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=64,
        moe_intermediate_size=INTER,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=E,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).float().eval()


def _moe_model(expert_lora: str = "per_expert"):
    """`_moe_base()` with LoRA slots (max rank 8) on q_proj, k_proj, v_proj and both expert Parameters."""
    from rl_multilora.lora import MultiLoRAModel

    targets = ["q_proj", "k_proj", "v_proj"]
    return MultiLoRAModel.from_model(_moe_base(), 3, 8, targets, target_parameters=EXPERTS, expert_lora=expert_lora)


def _add_random(m, name: str, rank: int, alpha: float, modules: list[str], params: list[str] | None, seed: int):
    """Add adapter `name` with random non-zero A and B in everything it covers (padding beyond rank stays 0)."""
    m.add_adapter(name, rank=rank, alpha=alpha, target_modules=modules, target_parameters=params)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        params_ = m.adapter_parameters(name)
        for a, b in zip(params_[::2], params_[1::2], strict=True):
            a[..., :rank, :].copy_(torch.randn(a[..., :rank, :].shape, generator=g) * 0.3)
            b[..., :rank].copy_(torch.randn(b[..., :rank].shape, generator=g) * 0.3)


def _our_expert_deltas(m, name: str) -> dict[str, torch.Tensor]:
    """Expert Parameter -> the delta our model adds for adapter `name`: scale * B[s, e] @ A[s, e], (E, out, in)."""
    info, s = m.adapters[name], m.slot_of(name)
    out = {}
    for param, shape in m.expert_shapes.items():
        holder = m.base_model.get_submodule(shape.module).lora(shape.param)
        a = holder.lora_A[s][:, : info.rank].expand(shape.num_experts, -1, -1)  # a shared A has one expert row
        out[param] = info.alpha / info.rank * holder.lora_B[s][..., : info.rank] @ a
    return out


def _sglang_served_deltas(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The per-expert deltas SGLang's MoE LoRA adds for these 3-D tensors, per the fixture's recorded loader math:
    a gate_up A is repeated twice along the rank, gate uses (B[:, :I], A[:, :r]), up (B[:, I:], A[:, r:2r]);
    scale lora_alpha / r. Keyed like our Parameters (`<module>.<param>`)."""
    assert MOE["adapter_config"]["scaling"].startswith("lora_alpha / r")
    r, scale = config["r"], config["lora_alpha"] / config["r"]
    out = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight") or a.dim() != 3:
            continue
        param = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b = tensors[key.replace("lora_A", "lora_B")] * scale
        if param.endswith(".gate_up_proj"):
            a2 = a.repeat(1, 2, 1)  # LoRAAdapter.normalize_gate_up_proj: (E, r, H) -> (E, 2r, H)
            inter = b.shape[1] // 2
            gate, up = b[:, :inter] @ a2[:, :r], b[:, inter:] @ a2[:, r : 2 * r]
            out[param] = torch.cat([gate, up], dim=1)
        else:
            out[param] = b @ a
    return out


@pytest.mark.parametrize(
    "rank, modules, params, expert_lora",
    [
        (3, ["q_proj", "v_proj"], None, "per_expert"),  # Linears and both expert Parameters (nested PEFT keys)
        (5, [], ["mlp.experts.down_proj"], "per_expert"),  # one Parameter of the module: no base_layer nesting
        (8, [], ["mlp.experts.gate_up_proj"], "per_expert"),  # rank = max_rank, gate_up alone
        (4, [], None, "shared_a"),  # one A for all experts: exported per expert, sent per expert
    ],
    ids=["linear_and_experts_r3", "down_only_r5", "gate_up_only_r8", "shared_a_r4"],
)
def test_expert_lora_converts_to_sglangs_layout_with_every_experts_delta_exact(rank, modules, params, expert_lora):
    m = _moe_model(expert_lora)
    _add_random(m, "x", rank, 7.0, modules, params, seed=rank)
    tensors, config = m.adapter_state_dict("x"), m.peft_config("x")
    assert config["target_parameters"]  # PEFT's layout: the Parameter name is not in the expert keys
    out, sglang_config = experts_to_sglang("x", tensors, config, sglang_expert_shapes(m))

    layout = MOE["weight_layouts"]["stacked_3d"]
    dims = {"E": E, "r": rank, "H": H, "I": INTER, "2I": 2 * INTER}
    expert_keys = [k for k in out if re.fullmatch(layout["key_pattern"], k)]
    for key in expert_keys:
        proj, which = re.fullmatch(layout["key_pattern"], key).groups()
        assert tuple(out[key].shape) == tuple(dims[d] for d in layout["shapes"][proj][which]), key
    # The Linears' tensors pass as they are; none of PEFT's expert keys (`...experts[.base_layer].lora_*`) is left.
    linear = {k for k in tensors if ".experts." not in k}
    assert set(out) == linear | set(expert_keys) and all(torch.equal(out[k], tensors[k]) for k in linear)
    served, ours = _sglang_served_deltas(out, sglang_config), _our_expert_deltas(m, "x")
    covered = [p for p, d in ours.items() if d.abs().max() > 0]  # an uncovered Parameter's slot stays zero
    assert sorted(served) == sorted(covered) and len(covered) == 2 * (1 if params else 2)
    for param in covered:  # every layer, every expert
        shape = m.expert_shapes[param]
        assert served[param].shape == ours[param].shape == (E, shape.out_features, shape.in_features)
        torch.testing.assert_close(served[param], ours[param], rtol=1e-5, atol=1e-6)
        assert ours[param].abs().amax(dim=(1, 2)).min() > 0  # a non-zero delta in every expert

    # SGLang reads only target_modules: it names the expert modules, a subset of what the server must enable.
    assert "target_parameters" not in sglang_config
    names = {SGLANG_EXPERT_MODULES[m.expert_shapes[p].param] for p in covered}
    assert set(sglang_config["target_modules"]) == set(config["target_modules"]) | names
    assert names <= set(MOE["server"]["required_target_modules"])
    assert {k: v for k, v in sglang_config.items() if k != "target_modules"} == {
        k: v for k, v in config.items() if k not in ("target_modules", "target_parameters")
    }


def test_sglang_served_expert_lora_reproduces_the_adapters_forward():
    """The base with SGLang's per-expert deltas (and the Linears') merged in gives the logits of our adapter's rows:
    gate/up order and orientation as transformers' packed gate_up_proj (E, 2I, H) uses them."""
    m = _moe_model()
    _add_random(m, "x", 4, 6.0, ["q_proj", "v_proj"], None, seed=11)
    out, config = experts_to_sglang("x", m.adapter_state_dict("x"), m.peft_config("x"), sglang_expert_shapes(m))
    merged = _moe_base()  # the same base weights, no LoRA
    scale = config["lora_alpha"] / config["r"]
    with torch.no_grad():
        for name, delta in _sglang_served_deltas(out, config).items():
            merged.get_parameter(name).add_(delta)
        for key, a in out.items():
            if key.endswith(".lora_A.weight") and a.dim() == 2:
                module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = out[key.replace("lora_A", "lora_B")]
                merged.get_submodule(module).weight.add_(scale * b @ a)
        ids = torch.randint(2, 64, (3, 6), generator=torch.Generator().manual_seed(0))
        got = merged(input_ids=ids).logits
        want = m(ids, adapter_names=["x"] * 3).logits
        base = _moe_base()(input_ids=ids).logits
    assert (want - base).abs().max() > 1e-2  # the adapter changes the output
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_expert_adapter_load_request_carries_sglangs_layout(capture):
    m = _moe_model()
    _add_random(m, "x", 3, 5.0, ["q_proj", "v_proj"], None, seed=3)
    tensors, config = m.adapter_state_dict("x"), m.peft_config("x")
    engine = SGLangEngine(
        capture.url, module_shapes=m.layer_shapes, expert_shapes=sglang_expert_shapes(m), tensor_format="sglang"
    )
    assert engine.load_adapter("x", tensors, config) == 1
    method, path, body, _ = capture.calls[0]
    assert_sglang_request(method, path, body)
    expected, _ = experts_to_sglang("x", tensors, config, m.expert_shapes)
    [received] = capture.loaded
    expert_keys = {k for k in received if re.fullmatch(MOE["weight_layouts"]["stacked_3d"]["key_pattern"], k)}
    assert len(expert_keys) == 8  # 2 layers x (gate_up_proj, down_proj) x (A, B)
    assert all(torch.equal(received[k], expected[k]) for k in expert_keys)
    assert all(k in received for k in expected)  # plus the zero k_proj factors SGLang's q/k/v fusion needs
    sent = body["config_dict"]
    assert sent["target_modules"] == ["down_proj", "gate_up_proj", "k_proj", "q_proj", "v_proj"]
    assert "target_parameters" not in sent and sent["r"] == 3 and sent["lora_alpha"] == 5.0


def test_expert_lora_goes_to_our_server_in_peft_layout(capture):
    """Our server (tensor_format "safetensors") reads PEFT's own layout; nothing is converted for it."""
    m = _moe_model()
    _add_random(m, "x", 2, 4.0, [], None, seed=5)
    tensors, config = m.adapter_state_dict("x"), m.peft_config("x")
    SGLangEngine(capture.url, tensor_format="safetensors").load_adapter("x", tensors, config)
    [received] = capture.loaded
    assert received.keys() == tensors.keys() and all(torch.equal(received[k], tensors[k]) for k in tensors)
    assert capture.calls[0][2]["config_dict"] == config


def test_expert_lora_without_expert_shapes_fails_before_anything_is_sent(capture):
    m = _moe_model()
    _add_random(m, "moe-a", 2, 4.0, [], None, seed=1)
    engine = SGLangEngine(capture.url, module_shapes=m.layer_shapes)
    with pytest.raises(ValueError, match=r"adapter 'moe-a' has expert LoRA \(target_parameters=.*expert_shapes="):
        engine.load_adapter("moe-a", m.adapter_state_dict("moe-a"), m.peft_config("moe-a"))
    assert capture.calls == []


def test_experts_sglang_cannot_serve_are_refused_when_the_engine_is_built(capture):

    from rl_multilora.lora import ExpertShape

    up = ExpertShape("model.layers.0.mlp.experts", "up_proj", E, H, INTER)  # non-gated experts
    with pytest.raises(ValueError, match=r"(?s)up_proj.*SGLang's MoE LoRA loader.*rollout\.engine: embedded"):
        SGLangEngine(capture.url, expert_shapes={up.name: up})
    odd = ExpertShape("model.layers.0.mlp.moe", "gate_up_proj", E, H, 2 * INTER)  # SGLang finds experts by name
    with pytest.raises(ValueError, match=r"module 'model\.layers\.0\.mlp\.moe' has not both"):
        SGLangEngine(capture.url, expert_shapes={odd.name: odd})

    # A transposed (gpt-oss) experts Parameter: its gate/up columns are interleaved; the model's shapes say so.
    gate_up = ExpertShape("model.layers.0.mlp.experts", "gate_up_proj", E, H, 2 * INTER, transposed=True)
    model = type("Model", (), {"expert_shapes": {gate_up.name: gate_up}})()
    with pytest.raises(
        ValueError, match=r"(?s)the model's expert LoRA .*gate_up_proj: stored \(E, in, out\).*gpt-oss"
    ):
        sglang_expert_shapes(model)
    with pytest.raises(ValueError, match=r"gate_up_proj: stored \(E, in, out\)"):  # an engine given them directly
        SGLangEngine(capture.url, expert_shapes={gate_up.name: gate_up})
    plain = ExpertShape("model.layers.0.mlp.experts", "gate_up_proj", E, H, 2 * INTER)
    model.expert_shapes = {plain.name: plain}
    assert sglang_expert_shapes(model) == {plain.name: plain}
    assert capture.calls == []


def test_expert_tensors_that_do_not_match_are_reported_together():
    m = _moe_model()
    _add_random(m, "x", 3, 5.0, [], None, seed=2)
    tensors, config = m.adapter_state_dict("x"), m.peft_config("x")
    stem = "base_model.model.model.layers.0.mlp.experts"
    tensors[f"{stem}.lora_A.weight"] = tensors[f"{stem}.lora_A.weight"][:-1]  # down_proj A one row short
    del tensors[f"{stem}.base_layer.lora_B.weight"]  # gate_up_proj without B
    with pytest.raises(
        ValueError,
        match=r"(?s)adapter 'x'.*layers\.0\.mlp\.experts\.gate_up_proj: no .*lora_B.*"
        r"layers\.0\.mlp\.experts\.down_proj .*lora_A \(11, 16\), expected \(12, 16\)",
    ):
        experts_to_sglang("x", tensors, config, m.expert_shapes)
    with pytest.raises(ValueError, match=r"target_parameters entry 'mlp\.shared\.w1' matches none"):
        experts_to_sglang("x", tensors, {**config, "target_parameters": ["mlp.shared.w1"]}, m.expert_shapes)
    # Expert tensors the config does not name would reach SGLang as unknown modules.
    with pytest.raises(ValueError, match=r"is expert LoRA that target_parameters=\['experts.down_proj'\] does not"):
        experts_to_sglang(
            "x", m.adapter_state_dict("x"), {**config, "target_parameters": ["experts.down_proj"]}, m.expert_shapes
        )


def test_peft_folder_with_expert_lora_is_not_handed_to_sglang_by_path(capture, tmp_path):
    config = {**CONFIG, "target_modules": [], "target_parameters": EXPERTS}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"(?s)adapter 'p' at .* has expert LoRA.*read_peft_folder"):
        SGLangEngine(capture.url).load_adapter_from_path("p", str(tmp_path))
    assert capture.calls == []


def test_launcher_enables_sglangs_expert_modules_for_expert_lora():
    required = MOE["server"]["required_target_modules"]
    launcher = SGLangLauncher("/m", lora_target_modules=["q_proj", "v_proj"], expert_lora=True)
    assert launcher.target_modules() == ["q_proj", "v_proj", *required]
    assert SGLangLauncher("/m", lora_target_modules="all-linear", expert_lora=True).target_modules() == ["all"]
    assert SGLangLauncher("/m", lora_target_modules=["q_proj"]).target_modules() == ["q_proj"]
    with pytest.raises(ValueError, match="--experts-shared-outer-loras, which is not allowed with expert_lora"):
        SGLangLauncher("/m", expert_lora=True, extra_args=["--experts-shared-outer-loras"])


def _sglang_python() -> str | None:
    explicit = os.environ.get("RL_MULTILORA_SGLANG_PYTHON")
    if explicit:
        return explicit
    return sys.executable if _has_sglang() else None


# Runs in the sglang Python: SGLang's own LoRAManager config check, LoRAAdapter normalization and
# LoRAMemoryPool.load_lora_weight_to_buffer, with CPU buffers and a FusedMoEWithLoRA that only carries what the
# loader reads (no kernels: the buffers are then sliced as the fixture records lora_moe_runners does).
_SGLANG_LOADER = """
import json, sys, warnings
warnings.filterwarnings("ignore")
from types import SimpleNamespace
import torch
from transformers import Qwen3MoeConfig
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.lora.layers import FusedMoEWithLoRA
from sglang.srt.lora.lora_config import LoRAConfig
from sglang.srt.lora.lora_manager import LoRAManager
from sglang.srt.lora.lora_registry import LoRARef
from sglang.srt.lora.mem_pool import LoRAMemoryPool
from sglang.srt.lora.utils import get_normalized_target_modules

args = json.loads(sys.argv[1])
E, H, I, R, L = args["E"], args["H"], args["I"], args["max_rank"], 2
hf = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_hidden_layers=L, vocab_size=64)
manager = LoRAManager.__new__(LoRAManager)
manager.__dict__.update(base_hf_config=hf, load_config=LoadConfig(), lora_backend=None, base_model=None,
    speculative_algorithm=None, attn_dp_enabled=False, max_loras_per_batch=2, loras={}, configs={}, lora_refs={},
    num_pinned_loras=0)
pool = LoRAMemoryPool.__new__(LoRAMemoryPool)
nan = lambda *shape: [torch.full(shape, float("nan")) for _ in range(L)]
pool.__dict__.update(max_lora_rank=R, lora_added_tokens_size=0, num_layer=L, experts_shared_outer_loras=False,
    target_modules=get_normalized_target_modules(args["server_target_modules"]), strict_loading=True,
    base_model=SimpleNamespace(), tp_rank=0, pin_memory_available=False, enable_lora_overlap_loading=False,
    moe_use_local_expert_ids=False, moe_ep_rank=0, _num_experts_local=E, embedding_A_buffer={},
    embedding_B_buffer={}, lm_head_A_buffer={}, lm_head_B_buffer={}, new_embeddings_buffer={},
    A_buffer={"gate_up_proj_moe": nan(2, E, 2 * R, H), "down_proj_moe": nan(2, E, R, I)},
    B_buffer={"gate_up_proj_moe": nan(2, E, 2 * I, R), "down_proj_moe": nan(2, E, H, R)})
manager.memory_pool = pool
moe = FusedMoEWithLoRA.__new__(FusedMoEWithLoRA)
torch.nn.Module.__init__(moe)
moe.base_layer = SimpleNamespace(is_shared_fused_moe=False, moe_tp_rank=0, moe_runner_config=SimpleNamespace(is_gated=True))
moe.tp_size, moe._uses_interleaved_gate_up = 1, False
sent = torch.load(args["tensors"])
ref = LoRARef(lora_id="x-id", lora_name="x", lora_path="x", pinned=False)
result = manager._load_lora_adapter_from_tensors(ref, sent, args["config"])
assert result.success, result.error_message
pool.load_lora_weight_to_buffer(ref.lora_id, 1, manager.loras[ref.lora_id], [{"model.layers.%d.mlp.experts" % l: moe} for l in range(L)], None, None)
served = {}
for l in range(L):
    ga, gb = pool.A_buffer["gate_up_proj_moe"][l][1], pool.B_buffer["gate_up_proj_moe"][l][1]
    da, db = pool.A_buffer["down_proj_moe"][l][1], pool.B_buffer["down_proj_moe"][l][1]
    assert not any(t.isnan().any() for t in (ga, gb, da, db)), "the loader left part of the slot unwritten"
    served["model.layers.%d.mlp.experts.gate_up_proj" % l] = torch.cat([gb[:, :I] @ ga[:, :R], gb[:, I:] @ ga[:, R:2 * R]], dim=1)
    served["model.layers.%d.mlp.experts.down_proj" % l] = db @ da
torch.save(served, args["out"])
"""


@pytest.mark.sglang
@pytest.mark.parametrize("params", [None, ["mlp.experts.down_proj"]], ids=["both", "down_only"])
def test_sglang_0_5_23_loader_serves_converted_expert_lora(tmp_path, params):
    """SGLang's own loader takes what the client sends and fills its MoE LoRA buffers with exactly our deltas."""
    python = _sglang_python()
    if python is None:
        pytest.skip("needs a Python with sglang (RL_MULTILORA_SGLANG_PYTHON; bash tests/setup_sglang_oracle.sh)")
    m = _moe_model()
    _add_random(m, "x", 3, 7.0, [], params, seed=9)
    out, config = experts_to_sglang("x", m.adapter_state_dict("x"), m.peft_config("x"), sglang_expert_shapes(m))
    torch.save(out, tmp_path / "sent.pt")
    args = {
        "E": E,
        "H": H,
        "I": INTER,
        "max_rank": 8,
        "config": config,
        "tensors": str(tmp_path / "sent.pt"),
        "out": str(tmp_path / "served.pt"),
        "server_target_modules": MOE["server"]["required_target_modules"],
    }
    proc = subprocess.run(
        [python, "-c", _SGLANG_LOADER, json.dumps(args)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    served, ours = torch.load(tmp_path / "served.pt"), _our_expert_deltas(m, "x")
    assert served.keys() == ours.keys()
    for param, delta in served.items():  # a Parameter the adapter does not cover: zero in ours, zeroed by SGLang
        torch.testing.assert_close(delta, ours[param], rtol=1e-5, atol=1e-6)
    assert sum(bool(d.abs().max() > 0) for d in served.values()) == (2 if params else 4)
