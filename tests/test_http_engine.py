"""SGLangEngine <-> our SGLang-compatible server around a fake RolloutEngine, end to end over real HTTP.

The fake engine makes every token a function of the prompt, the step and the adapter version in effect at that
step, so a response that mixed two versions of an adapter is detectable from its tokens alone.
"""

from __future__ import annotations

import base64
import inspect
import json
import pickle
import threading
import time

import pytest
import requests
import torch
from safetensors.torch import save_file

from rollout.engines.base import RolloutEngine
from rollout.server.http_server import BackgroundServer, serve
from rollout.sglang.client import SGLangEngine, SGLangError
from rollout.sglang.protocol import encode_tensors_safetensors, encode_tensors_sglang
from rollout.types import GenerateRequest, GenerateResult, SamplingParams

VOCAB = 1000
CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}


def expected_token(input_ids: list[int], step: int, version: int | None) -> int:
    return (sum(input_ids) + 7 * step + 100 * (version or 0)) % VOCAB


class FakeEngine(RolloutEngine):
    """Deterministic stand-in for the embedded engine.

    `pause()` holds every generation step until `resume()` (SGLang's in_place semantics), so the server's own
    abort handling is what turns in-flight requests into aborts.
    """

    def __init__(self, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.versions: dict[str, int] = {}
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        self.calls: list[str] = []
        # Steps taken per prompt (keyed by its first token), so tests can wait for a request to be mid-flight.
        self.progress: dict[int, int] = {}
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._running.set()

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return [self._one(r) for r in requests]

    def _one(self, req: GenerateRequest) -> GenerateResult:
        if req.adapter is not None and req.adapter not in self.versions:
            return GenerateResult(finish_reason="error", error=f"adapter {req.adapter!r} is not loaded")
        out, logprobs, version = [], [], None
        for step in range(req.sampling.max_new_tokens):
            self._running.wait()
            with self._lock:
                version = self.versions.get(req.adapter) if req.adapter is not None else None
            token = expected_token(req.input_ids, step, version)
            with self._lock:
                self.progress[req.input_ids[0]] = step + 1
            out.append(token)
            logprobs.append(-(step + 1) / 100)
            if token in req.sampling.stop_token_ids:
                return GenerateResult(out, logprobs, "stop", version)
            if self.step_s:
                time.sleep(self.step_s)
        return GenerateResult(out, logprobs, "length", version)

    def load_adapter(self, name, tensors, config, version=None) -> int:
        with self._lock:
            self.calls.append(f"load {name}")
            new = version if version is not None else self.versions.get(name, 0) + 1
            self.versions[name] = new
            self.tensors[name] = {k: v.clone() for k, v in tensors.items()}
        return new

    def unload_adapter(self, name: str) -> None:
        with self._lock:
            self.calls.append(f"unload {name}")
            if name not in self.versions:
                raise ValueError(f"adapter {name!r} is not loaded")
            del self.versions[name]
            del self.tensors[name]

    def pause(self) -> None:
        self.calls.append("pause")
        self._running.clear()

    def resume(self) -> None:
        self.calls.append("resume")
        self._running.set()

    def health(self) -> bool:
        return True

    def adapter_versions(self) -> dict[str, int]:
        with self._lock:
            return dict(self.versions)


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    return {
        f"{prefix}.lora_A.weight": torch.randn(4, 16, generator=g),
        f"{prefix}.lora_B.weight": torch.randn(16, 4, generator=g),
    }


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the fake engine"
        time.sleep(0.005)


def consistent(req: GenerateRequest, res: GenerateResult) -> bool:
    """Every token was produced by the version the result reports (no mix of versions)."""
    return res.output_ids == [expected_token(req.input_ids, s, res.weight_version) for s in range(len(res.output_ids))]


@pytest.fixture
def served():
    engine = FakeEngine()
    with BackgroundServer(engine) as server:
        yield engine, server


# ---------------------------------------------------------------------------------------------- basics


def test_generate_with_adapters_and_base_rows(served):
    engine, server = served
    client = SGLangEngine(server.url, tensor_format="safetensors")
    assert client.health()
    assert client.load_adapter("a", tensors(0), CONFIG) == 1
    assert client.load_adapter("b", tensors(1), CONFIG, version=5) == 5
    sp = SamplingParams(max_new_tokens=4)
    reqs = [GenerateRequest([1, 2], "a", sp), GenerateRequest([3], None, sp), GenerateRequest([1, 2], "b", sp)]
    results = client.generate(reqs)
    assert [r.finish_reason for r in results] == ["length"] * 3
    assert [r.weight_version for r in results] == [1, None, 5]
    assert all(consistent(q, r) for q, r in zip(reqs, results, strict=True))
    assert results[0].output_ids != results[2].output_ids  # rows really ran on their own adapters
    assert results[0].output_logprobs == pytest.approx([-0.01, -0.02, -0.03, -0.04])
    assert engine.versions == {"a": 1, "b": 5} == client.adapter_versions()


def test_stop_token_and_server_reported_version(served):
    engine, server = served
    client = SGLangEngine(server.url, tensor_format="safetensors")
    client.load_adapter("a", tensors(0), CONFIG, version=3)
    stop = expected_token([5], 1, 3)
    [res] = client.generate([GenerateRequest([5], "a", SamplingParams(max_new_tokens=10, stop_token_ids=[stop]))])
    assert res.finish_reason == "stop" and res.output_ids[-1] == stop and len(res.output_ids) == 2
    body = {"input_ids": [5], "lora_path": "a", "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
    raw = requests.post(server.url + "/generate", json=body, timeout=30).json()
    assert raw["meta_info"]["weight_version"] == "3"  # our server reports the adapter's version
    assert raw["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert [row[1] for row in raw["meta_info"]["output_token_logprobs"]] == raw["output_ids"]


def test_batched_generate_body_is_accepted(served):
    _, server = served
    body = {
        "input_ids": [[1], [2, 3]],
        "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}],
        "rid": "x",
        "some_future_sglang_field": True,  # unknown fields are ignored, as SGLang does
    }
    out = requests.post(server.url + "/generate", json=body, timeout=30).json()
    assert [len(o["output_ids"]) for o in out] == [1, 2]
    assert [o["meta_info"]["id"] for o in out] == ["x_0", "x_1"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "bogus is not an SGLang sampling parameter"),
        ({"input_ids": [1], "sampling_params": {"min_p": 0.5}}, "min_p=0.5 is not allowed; allowed: 0.0"),
        (
            {"input_ids": [1], "sampling_params": {"ignore_eos": 1}},
            "ignore_eos=1 is not allowed; allowed: true or false",
        ),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p=0.0 is not allowed; allowed: a number in (0, 1]"),
        ({"text": "hi"}, "send input_ids"),
        ({"input_ids": [[1], [2]], "lora_path": ["a"]}, "lora_path has 1 entries for a batch of 2"),
    ],
)
def test_bad_generate_bodies_get_a_400_naming_the_field(served, body, needle):
    _, server = served
    resp = requests.post(server.url + "/generate", json=body, timeout=30)
    assert resp.status_code == 400 and needle in resp.json()["message"]


def test_load_from_tensors_unload_and_unknown_adapter(served):
    engine, server = served
    client = SGLangEngine(server.url, tensor_format="safetensors")
    sent = tensors(3)
    client.load_adapter("a", sent, CONFIG)
    assert engine.tensors["a"].keys() == sent.keys()
    assert all(torch.equal(engine.tensors["a"][k], sent[k]) for k in sent)
    client.unload_adapter("a")
    assert engine.versions == {} and client.adapter_versions() == {}
    [res] = client.generate([GenerateRequest([1], "a", SamplingParams(max_new_tokens=2))])
    assert res.finish_reason == "error" and "not loaded" in res.error
    with pytest.raises(SGLangError, match="not loaded"):
        client.unload_adapter("a")


def test_reload_unloads_first(served):
    engine, server = served
    client = SGLangEngine(server.url, tensor_format="safetensors")
    client.load_adapter("a", tensors(0), CONFIG)
    client.load_adapter("a", tensors(1), CONFIG)
    assert engine.calls == ["load a", "unload a", "load a"]
    assert engine.versions["a"] == 2
    assert all(torch.equal(engine.tensors["a"][k], v) for k, v in tensors(1).items())


def test_load_from_peft_folder(served, tmp_path):
    engine, server = served
    save_file(tensors(4), str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(CONFIG))
    client = SGLangEngine(server.url)
    assert client.load_adapter_from_path("p", str(tmp_path)) == 1
    assert all(torch.equal(engine.tensors["p"][k], v) for k, v in tensors(4).items())
    with pytest.raises(SGLangError, match="lora_path=.* is not allowed; allowed: a PEFT folder on this host"):
        client.load_adapter_from_path("q", str(tmp_path / "missing"))


# ---------------------------------------------------------------------------------------------- safety


def test_pickled_payload_is_rejected_and_never_unpickled(served, tmp_path):
    engine, server = served
    # SGLang's own encoding (load_format unset) is refused outright.
    with pytest.raises(SGLangError, match="pickle"):
        SGLangEngine(server.url, tensor_format="sglang").load_adapter("a", tensors(0), CONFIG)

    # A malicious pickle labelled as safetensors is not unpickled either: it just fails to parse.
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    evil = base64.b64encode(pickle.dumps(Exploit())).decode()
    for load_format in (None, "flattened_bucket", "safetensors"):
        body = {
            "lora_name": "a",
            "config_dict": CONFIG,
            "serialized_named_tensors": [evil],
            "load_format": load_format,
        }
        resp = requests.post(server.url + "/load_lora_adapter_from_tensors", json=body, timeout=30)
        assert resp.status_code == 400, load_format
    assert not marker.exists()
    assert engine.calls == []
    assert encode_tensors_sglang(tensors(0))  # the client-side encoder itself works (for a real SGLang server)


def test_use_rslora_is_rejected_by_client_and_server(served):
    engine, server = served
    bad = {**CONFIG, "use_rslora": True}
    with pytest.raises(ValueError, match="use_rslora"):
        SGLangEngine(server.url, tensor_format="safetensors").load_adapter("a", tensors(0), bad)
    body = {
        "lora_name": "a",
        "config_dict": bad,
        "serialized_named_tensors": [encode_tensors_safetensors(tensors(0))],
        "load_format": "safetensors",
    }
    resp = requests.post(server.url + "/load_lora_adapter_from_tensors", json=body, timeout=30)
    assert resp.status_code == 400 and "use_rslora" in resp.json()["error_message"]
    assert engine.calls == []


def test_auth_required_everywhere_but_health():
    engine = FakeEngine()
    with BackgroundServer(engine, api_key="s3cret") as server:
        blob = encode_tensors_safetensors(tensors(0))
        load = {
            "lora_name": "a",
            "config_dict": CONFIG,
            "serialized_named_tensors": [blob],
            "load_format": "safetensors",
        }
        calls = [
            ("post", "/load_lora_adapter_from_tensors", load),
            ("post", "/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}),
            ("post", "/unload_lora_adapter", {"lora_name": "a"}),
            ("post", "/pause_generation", {"mode": "abort"}),
            ("post", "/continue_generation", {}),
            ("post", "/flush_cache", None),
            ("post", "/generate", {"input_ids": [1]}),  # SGLang protects /generate too when --api-key is set
            ("get", "/get_model_info", None),
            ("get", "/model_info", None),
        ]
        for method, path, body in calls:
            # SGLang 0.5.23 reads only `Authorization: Bearer`; an x-api-key header does not count.
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "s3cret"}):
                resp = requests.request(method, server.url + path, json=body, headers=headers, timeout=30)
                assert resp.status_code == 401, path
                assert resp.json() == {"error": "Unauthorized"}
        assert engine.calls == []
        assert requests.get(server.url + "/health", timeout=30).status_code == 200
        assert requests.get(server.url + "/health_generate", timeout=30).status_code == 200

        with pytest.raises(SGLangError, match="api_key"):
            SGLangEngine(server.url, tensor_format="safetensors").load_adapter("a", tensors(0), CONFIG)
        client = SGLangEngine(server.url, api_key="s3cret", tensor_format="safetensors")
        client.load_adapter("a", tensors(0), CONFIG)
        [res] = client.generate([GenerateRequest([1], "a", SamplingParams(max_new_tokens=2))])
        assert res.finish_reason == "length" and res.weight_version == 1
        info = requests.get(server.url + "/model_info", headers={"Authorization": "bearer s3cret"}, timeout=30).json()
        assert info["adapter_versions"] == {"a": 1} and info["is_generation"] is True


def test_flush_cache_answers_like_sglang():
    class Refusing(FakeEngine):
        def flush_cache(self) -> bool:
            return False

    with BackgroundServer(FakeEngine()) as server:
        resp = requests.post(server.url + "/flush_cache", timeout=30)
        assert resp.status_code == 200 and resp.text.startswith("Cache flushed.")
        assert SGLangEngine(server.url).flush_cache() is True
    with BackgroundServer(Refusing()) as server:
        resp = requests.get(server.url + "/flush_cache", timeout=30)
        assert (resp.status_code, resp.text) == (400, "Flush cache failed.\n")  # SGLang 0.5.23's failure text
        assert SGLangEngine(server.url).flush_cache() is False


def test_binds_loopback_by_default(served):
    _, server = served
    assert server.host == "127.0.0.1"
    assert server._runner.addresses[0][0] == "127.0.0.1"
    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
    assert inspect.signature(BackgroundServer).parameters["host"].default == "127.0.0.1"


def test_pause_modes_other_than_abort_are_refused(served):
    _, server = served
    resp = requests.post(server.url + "/pause_generation", json={"mode": "retract"}, timeout=30)
    assert resp.status_code == 400 and "deadlocks" in resp.json()["message"]
    resp = requests.post(server.url + "/pause_generation", json={"mode": "nap"}, timeout=30)
    assert resp.status_code == 400 and "'abort', 'retract', 'in_place'" in resp.json()["message"]


BAD_NAMES = ["../x", "a/b", "", "a\n", ".", "..", 5]
NAME_RULE = "a string of 1 to 128 letters, digits, '.', '_' and '-', other than '.' and '..'"


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_adapter_names_are_validated_on_every_endpoint(served, tmp_path, bad):
    """`lora_name` (load, load from a path, unload) and `/generate`'s `lora_path` follow `validate_adapter_name`:
    a 400 in the project's grammar, and the engine is never reached."""
    engine, server = served
    save_file(tensors(0), str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(CONFIG))
    blob = encode_tensors_safetensors(tensors(0))
    load = {"lora_name": bad, "config_dict": CONFIG, "serialized_named_tensors": [blob], "load_format": "safetensors"}
    calls = [
        ("/load_lora_adapter_from_tensors", load, "lora_name"),
        ("/load_lora_adapter", {"lora_name": bad, "lora_path": str(tmp_path)}, "lora_name"),
        ("/unload_lora_adapter", {"lora_name": bad}, "lora_name"),
        ("/generate", {"input_ids": [1], "lora_path": bad}, "lora_path"),
        ("/generate", {"input_ids": [[1], [2]], "lora_path": [None, bad]}, "lora_path[1]"),
    ]
    for path, body, field in calls:
        resp = requests.post(server.url + path, json=body, timeout=30)
        assert resp.status_code == 400, (path, resp.text)
        message = resp.json()["message"]
        assert message.startswith(f"{field}={bad!r} is not allowed; allowed: ") and NAME_RULE in message, message
    assert engine.calls == [] and engine.versions == {}
    # A valid name still works on each endpoint.
    assert requests.post(server.url + "/load_lora_adapter", json={"lora_name": "ok-1.a_b", "lora_path": str(tmp_path)})
    assert engine.versions == {"ok-1.a_b": 1}


def test_abort_message_is_the_engines_reason_not_the_pause():
    """An abort the engine reports itself keeps its reason; only the server's own pause abort says /pause_generation."""
    reason = "adapter 'a' changed from version 1 to 2 mid-request; resubmit it"

    class Aborting(FakeEngine):
        def _one(self, req):
            if req.input_ids[0] == 666:
                return GenerateResult(finish_reason="abort", weight_version=1, error=reason)
            return super()._one(req)

    engine = Aborting(step_s=0.01)
    with BackgroundServer(engine) as server:
        raw = requests.post(server.url + "/generate", json={"input_ids": [666]}, timeout=30).json()
        assert raw["meta_info"]["finish_reason"] == {
            "type": "abort",
            "message": reason,
            "status_code": None,
            "err_type": None,
        }
        box: dict[str, dict] = {}
        body = {"input_ids": [3], "sampling_params": {"max_new_tokens": 500}}
        worker = threading.Thread(
            target=lambda: box.__setitem__("r", requests.post(server.url + "/generate", json=body, timeout=60).json())
        )
        worker.start()
        wait_until(lambda: engine.progress.get(3, 0) >= 2)
        requests.post(server.url + "/pause_generation", json={"mode": "abort"}, timeout=30).raise_for_status()
        worker.join(30)
        requests.post(server.url + "/continue_generation", json={}, timeout=30).raise_for_status()
        assert box["r"]["meta_info"]["finish_reason"]["message"] == "Aborted by /pause_generation"


def test_embedded_engine_abort_reason_reaches_the_http_response(tmp_path):
    """The real engine aborts a row whose adapter was reloaded mid-request (no pause) when no free slot can keep its
    version running; the response says so."""
    from rl_multilora.engine_serve import build_embedded_engine
    from tests.tiny_models import EOS_ID, save_tiny_model

    model_dir = save_tiny_model(tmp_path / "base")
    engine, tokenizer = build_embedded_engine(str(model_dir), max_loras=2, max_rank=8)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    g = torch.Generator().manual_seed(0)
    adapter = {f"{prefix}.lora_A.weight": torch.randn(4, 32, generator=g)}
    adapter[f"{prefix}.lora_B.weight"] = torch.randn(32, 4, generator=g)
    first_step, release = threading.Event(), threading.Event()
    sample = engine._sample

    def gated_sample(logits, rows):
        # Hold the worker after its first token (outside the weights lock) until the adapter has been reloaded;
        # never let that token be EOS, so the row is still running when the worker checks its adapter.
        tokens, logprobs = sample(logits, rows)
        if not first_step.is_set():
            first_step.set()
            release.wait(30)
        return [EOS_ID + 1 if t == EOS_ID else t for t in tokens], logprobs

    engine._sample = gated_sample
    try:
        with BackgroundServer(engine, tokenizer=tokenizer) as server:
            client = SGLangEngine(server.url, tensor_format="safetensors")
            old = client.load_adapter("a", adapter, CONFIG)
            client.load_adapter("b", adapter, CONFIG)  # both slots taken: a new version of a overwrites the old one
            box: dict[str, dict] = {}
            body = {"input_ids": [5, 6, 7], "lora_path": "a", "sampling_params": {"max_new_tokens": 8}}
            worker = threading.Thread(
                target=lambda: box.__setitem__("r", requests.post(server.url + "/generate", json=body, timeout=60))
            )
            worker.start()
            assert first_step.wait(30)
            new = engine.load_adapter("a", adapter, CONFIG)  # a new version, without a pause
            release.set()
            worker.join(30)
    finally:
        release.set()
        engine.close()
    finish = box["r"].json()["meta_info"]["finish_reason"]
    assert finish["type"] == "abort"
    assert finish["message"] == f"adapter 'a' changed from version {old} to {new} mid-request; resubmit it"


# ---------------------------------------------------------------------------------------------- sync


def test_requests_in_flight_during_a_sync_complete_on_one_version_or_abort():
    engine = FakeEngine(step_s=0.01)
    with BackgroundServer(engine) as server:
        client = SGLangEngine(server.url, tensor_format="safetensors")
        client.load_adapter("a", tensors(0), CONFIG)
        sp_long, sp_short = SamplingParams(max_new_tokens=40), SamplingParams(max_new_tokens=1)
        reqs = [GenerateRequest([i], "a", sp_long) for i in range(4)] + [GenerateRequest([9], "a", sp_short)]
        reqs += [GenerateRequest([50], None, sp_long)]
        box: dict[str, list[GenerateResult]] = {}
        worker = threading.Thread(target=lambda: box.__setitem__("first", client.generate(reqs)))
        worker.start()
        # Pause only once every 40-token request is mid-flight.
        wait_until(lambda: all(engine.progress.get(i, 0) >= 2 for i in (0, 1, 2, 3, 50)))

        client.pause()
        during: dict[str, list[GenerateResult]] = {}
        late = [GenerateRequest([7], "a", SamplingParams(max_new_tokens=3))]
        late_worker = threading.Thread(target=lambda: during.__setitem__("late", client.generate(late)))
        late_worker.start()  # sent while paused: held until resume, then runs on the new version
        assert client.load_adapter("a", tensors(1), CONFIG) == 2
        time.sleep(0.05)
        client.resume()
        worker.join(30)
        late_worker.join(30)

        first = box["first"]
        aborted = [q for q, r in zip(reqs, first, strict=True) if r.finish_reason == "abort"]
        # Every 40-token request was mid-flight when the pause came (the engine holds steps while paused).
        assert [first[i].finish_reason for i in (0, 1, 2, 3, 5)] == ["abort"] * 5
        for q, r in zip(reqs, first, strict=True):
            assert r.finish_reason in ("length", "abort")
            if r.finish_reason == "length":
                assert consistent(q, r), "a completed response mixed adapter versions"
                assert r.weight_version == (1 if q.adapter else None)  # finished before the pause
        assert engine.calls[:4] == ["load a", "pause", "unload a", "load a"] and "resume" in engine.calls

        [late_res] = during["late"]
        assert late_res.finish_reason == "length" and late_res.weight_version == 2 and consistent(late[0], late_res)

        # What GenerateState does with aborts: resubmit; they now run wholly on version 2.
        again = client.generate(aborted)
        for q, r in zip(aborted, again, strict=True):
            assert r.finish_reason == "length" and consistent(q, r)
            assert r.weight_version == (2 if q.adapter else None)


@pytest.mark.parametrize("reload_version", [None, 1])  # 1: the caller reuses the version number
def test_result_is_aborted_when_its_adapter_changed_while_in_flight(reload_version):
    """Client-side guard: a completion that straddles a version change (even without a server abort) is not
    trusted, since SGLang's weight_version cannot say which adapter version produced it."""
    engine = FakeEngine(step_s=0.01)
    with BackgroundServer(engine) as server:
        client = SGLangEngine(server.url, tensor_format="safetensors")
        client.load_adapter("a", tensors(0), CONFIG)
        box: dict[str, list[GenerateResult]] = {}
        req = GenerateRequest([1], "a", SamplingParams(max_new_tokens=30))
        worker = threading.Thread(target=lambda: box.__setitem__("r", client.generate([req])))
        worker.start()
        wait_until(lambda: engine.progress.get(1, 0) >= 2)
        client.load_adapter("a", tensors(1), CONFIG, version=reload_version)  # no pause: nothing is aborted
        worker.join(30)
        [res] = box["r"]
        assert res.finish_reason == "abort"


# ---------------------------------------------------------------------------------------------- real engine


def test_embedded_engine_served_over_http_matches_peft_generate(tmp_path):
    """`engine-serve`'s engine behind the server: adapters pushed over HTTP give PEFT's greedy output."""
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict

    from rl_multilora.engine_serve import build_embedded_engine
    from tests.tiny_models import save_tiny_model, tiny_model

    model_dir = save_tiny_model(tmp_path / "base")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
        peft_model = get_peft_model(tiny_model(), lora)
    folder = tmp_path / "peft"
    peft_model.save_pretrained(folder)
    peft_tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}
    config = json.loads((folder / "adapter_config.json").read_text())

    prompt = [5, 17, 33, 48]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    engine, tokenizer = build_embedded_engine(str(model_dir), max_loras=2, max_rank=8)
    try:
        with BackgroundServer(engine, tokenizer=tokenizer) as server:
            client = SGLangEngine(server.url, tensor_format="safetensors")
            client.load_adapter("mem", peft_tensors, config)
            client.load_adapter_from_path("disk", str(folder))
            names = ["mem", None, "disk"]
            results = client.generate([GenerateRequest(prompt, n, greedy) for n in names])
    finally:
        engine.close()

    def hf_greedy(model) -> list[int]:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        return out[0, len(prompt) :].tolist()

    with_adapter = hf_greedy(PeftModel.from_pretrained(tiny_model(), folder).eval())
    base = hf_greedy(tiny_model())
    assert [r.finish_reason in ("stop", "length") for r in results] == [True] * 3
    assert results[0].output_ids == with_adapter == results[2].output_ids
    assert results[1].output_ids == base != with_adapter
    assert [r.weight_version for r in results] == [1, None, 1]


def test_expert_lora_served_over_http_matches_peft_generate(tmp_path):
    """`engine-serve --target-parameters ...` on a MoE base: an expert adapter pushed over HTTP in PEFT's own
    target_parameters layout gives PEFT's greedy output."""
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict

    from rl_multilora.engine_serve import build_embedded_engine
    from tests.tiny_models import MOE_EXPERTS, save_tiny_model, tiny_model

    model_dir = save_tiny_model(tmp_path / "base", family="qwen3_moe")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=MOE_EXPERTS,
                          init_lora_weights=False)  # fmt: skip
        peft_model = get_peft_model(tiny_model("qwen3_moe"), lora)
    peft_tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}
    peft_model.save_pretrained(tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())

    prompt = [5, 17, 33, 48]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=[])
    engine, tokenizer = build_embedded_engine(str(model_dir), 2, 8, "q_proj", ",".join(MOE_EXPERTS))
    try:
        with BackgroundServer(engine, tokenizer=tokenizer) as server:
            client = SGLangEngine(server.url, tensor_format="safetensors")
            client.load_adapter("moe", peft_tensors, config)
            results = client.generate([GenerateRequest(prompt, n, greedy) for n in ("moe", None)])
    finally:
        engine.close()
    ids = torch.tensor([prompt])
    expected = []
    for model in (
        PeftModel.from_pretrained(tiny_model("qwen3_moe"), tmp_path / "peft").eval(),
        tiny_model("qwen3_moe"),
    ):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             eos_token_id=None)  # fmt: skip
        expected.append(out[0, len(prompt) :].tolist())
    assert [r.output_ids for r in results] == expected
    assert expected[0] != expected[1]


def test_engine_serve_bounds_its_waves_with_the_same_outputs(tmp_path):
    """`engine-serve --max-batch-size B` and `--max-wave-tokens N` (with `--prefix-cache-mb 0`): the served engine
    runs distinct prompts sent in one batch in waves of at most B rows, or within N positions, with the greedy tokens
    and log-probs of the unbounded engine served the same way."""
    from rl_multilora.engine_serve import build_embedded_engine
    from tests.test_wave_tokens import _record_waves
    from tests.tiny_models import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "base")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=[])
    batch = [GenerateRequest([5 + i, 17, 33 + i, 48], None, greedy) for i in range(8)]  # 10 positions a row
    bounds = {
        "none": {},
        "rows": {"max_batch_size": 3},
        "tokens": {"max_wave_tokens": 25, "prefix_cache_mb": 0},  # 2 rows fit, 3 do not
    }
    served, waves = {}, {}
    for name, kw in bounds.items():
        engine, tokenizer = build_embedded_engine(str(model_dir), max_loras=2, max_rank=8, **kw)
        waves[name] = _record_waves(engine)
        assert (engine._prefix_cache is None) == (kw.get("prefix_cache_mb") == 0)  # the flag reached the engine
        try:
            with BackgroundServer(engine, tokenizer=tokenizer) as server:
                served[name] = SGLangEngine(server.url).generate(batch)
        finally:
            engine.close()
    assert max(rows for rows, _, _ in waves["rows"]) == 3
    assert max(rows for rows, _, _ in waves["tokens"]) == 2
    assert all(per_row <= 25 for _, per_row, _ in waves["tokens"]), waves["tokens"]
    for name in ("rows", "tokens"):
        assert [r.output_ids for r in served[name]] == [r.output_ids for r in served["none"]]
        for got, want in zip(served[name], served["none"], strict=True):
            torch.testing.assert_close(torch.tensor(got.output_logprobs), torch.tensor(want.output_logprobs))


@pytest.mark.parametrize(
    "flag, value, allowed",
    [
        ("--max-wave-tokens", "0", "a positive integer (or leave it out)"),
        ("--max-batch-size", "0", "a positive integer"),
        ("--prefix-cache-mb", "-1", "an integer >= 0 (0: off)"),
    ],
)
def test_engine_serve_cli_rejects_bad_engine_bounds(tmp_path, capsys, flag, value, allowed):
    from rl_multilora.engine_serve import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(tmp_path), flag, value])
    assert exit_info.value.code == 2
    assert f"{flag}={int(value)!r} is not allowed; allowed: {allowed}" in capsys.readouterr().err


def test_engine_serve_cli_rejects_bad_arguments(tmp_path, capsys):
    from rl_multilora.engine_serve import main

    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path / "missing")])
    assert "is not allowed; allowed: an existing model folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path), "--max-rank", "0"])
    assert "--max-rank=0 is not allowed; allowed: a positive integer" in capsys.readouterr().err
