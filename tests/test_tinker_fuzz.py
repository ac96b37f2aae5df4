"""Abuse of the Tinker server's HTTP routes: malformed JSON and protobuf bodies, wrong types, huge values.

Every answer must be a success or a 4xx whose JSON `detail` says why (never a 5xx, never a hang), and the server must
still train a real SDK client after all of it. The cases are generated from a fixed seed (mutations of the bodies the
SDK sends), so a failure names a reproducible request.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import requests
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.test_tinker_server import BASE, TOKEN, _datum, _Running, _sft, tiny_model_folder  # noqa: F401

HEADERS = {"X-API-Key": TOKEN, "Content-Type": "application/json"}
HUGE = [10**30, -(10**30), 2**63, 1e308, -1e308, float("inf"), float("nan"), "x" * 100_000, [0] * 100_000]
WRONG = [None, True, 0, -1, 1.5, "", "abc", [], [1, "a"], {}, {"a": {"b": None}}]


@pytest.fixture
def server(tmp_path):
    s = _Running(tmp_path / "state", session_timeout_s=600)
    yield s
    s.close()


def _post(server, route: str, body: bytes | str, content_type: str = "application/json") -> requests.Response:
    headers = {**HEADERS, "Content-Type": content_type}
    return requests.post(f"{server.url}/api/v1/{route}", data=body, headers=headers, timeout=30)


def _json_of(value) -> str:
    # Python's json writes NaN / Infinity, which is what a careless client would send too
    return json.dumps(value)


def _assert_answered(resp: requests.Response, what: str) -> None:
    assert resp.status_code < 500, f"{what} -> {resp.status_code} {resp.text[:300]}"
    if resp.status_code >= 400:
        detail = resp.json().get("detail")
        assert isinstance(detail, str) and detail, f"{what} -> {resp.status_code} without a reason: {resp.text[:300]}"


def _valid_bodies(session_id: str, model_id: str) -> dict[str, dict]:
    """One well-formed JSON body per JSON route, as the SDK 0.38 sends them."""
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}
    return {
        "create_session": {"tags": [], "user_metadata": None, "sdk_version": "0.38.0", "type": "create_session"},
        "session_heartbeat": {"session_id": session_id, "type": "session_heartbeat"},
        "create_model": {
            "session_id": session_id,
            "model_seq_id": 7,
            "base_model": BASE,
            "lora_config": {"rank": 4, "seed": 0},
            "type": "create_model",
        },  # fmt: skip
        "get_info": {"model_id": model_id, "type": "get_info"},
        "optim_step": {
            "model_id": model_id,
            "seq_id": 1,
            "adam_params": {"learning_rate": 1e-3},
            "type": "optim_step",
        },  # fmt: skip
        "save_weights": {"model_id": model_id, "seq_id": 1, "path": "ckpt", "type": "save_weights"},
        "save_weights_for_sampler": {
            "model_id": model_id,
            "seq_id": 1,
            "path": "s",
            "type": "save_weights_for_sampler",
        },
        "load_weights": {
            "model_id": model_id,
            "seq_id": 1,
            "path": f"tinker://{model_id}/weights/ckpt",
            "type": "load_weights",
        },  # fmt: skip
        "unload_model": {"model_id": model_id, "type": "unload_model"},
        "create_sampling_session": {
            "session_id": session_id,
            "sampling_session_seq_id": 3,
            "base_model": BASE,
            "type": "create_sampling_session",
        },  # fmt: skip
        "asample": {
            "base_model": BASE,
            "prompt": prompt,
            "num_samples": 1,
            "seq_id": 0,
            "sampling_params": {"max_tokens": 2, "temperature": 1.0},
            "type": "sample",
        },  # fmt: skip
        "retrieve_future": {"request_id": f"{model_id}.0"},
        "weights_info": {"tinker_path": f"tinker://{model_id}/weights/ckpt"},
        "telemetry": {"events": []},
    }


def _mutations(body: dict, rng: random.Random):
    """Bodies that differ from `body` in one field (each key: dropped, a wrong type, a huge value, a nested wrong
    type), plus a few whole-body shapes."""
    for key in body:
        yield f"drop {key}", {k: v for k, v in body.items() if k != key}
        for value in rng.sample(WRONG, 4) + rng.sample(HUGE, 3):
            yield f"{key}={str(value)[:30]}", {**body, key: value}
        if isinstance(body[key], dict):
            for sub in body[key]:
                yield f"{key}.{sub}=huge", {**body, key: {**body[key], sub: rng.choice(HUGE)}}
                yield f"{key}.{sub}=wrong", {**body, key: {**body[key], sub: rng.choice(WRONG)}}
    yield "a list", [body]
    yield "a string", "body"
    yield "null", None


RAW = [b"", b"{", b'{"a":', b"\xff\xfe\x00", b"[" * 10_000 + b"]" * 10_000, b"NaN", b"{}" * 1000, b"\x00" * 64]


def test_every_malformed_body_gets_a_4xx_with_a_reason_and_the_server_lives(server):
    """Each JSON route with raw garbage and with every one-field mutation of a valid body; forward_backward with
    garbage bytes, truncated and bit-flipped protobufs and protos of wrong values; then a real client trains."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    # the abuse targets a second model of the same session (it may be unloaded, stepped, overwritten: the token is
    # the client's own); the first one must train afterwards as if nothing happened
    target = sc.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    model_id, session_id = target.model_id, target.model_id.split(":")[0]
    rng = random.Random(0)
    answered = {"2xx": 0, "4xx": 0}
    for route, body in _valid_bodies(session_id, model_id).items():
        for raw in RAW:
            resp = _post(server, route, raw)
            _assert_answered(resp, f"{route} raw {raw[:20]!r}")
            answered["4xx" if resp.status_code >= 400 else "2xx"] += 1
        for what, mutated in _mutations(body, rng):
            resp = _post(server, route, _json_of(mutated))
            _assert_answered(resp, f"{route} {what}")
            answered["4xx" if resp.status_code >= 400 else "2xx"] += 1

    good = _forward_backward_proto(model_id, seq_id=10**6)
    protos = [good[: len(good) // 2], good[:-1], b"\x0a\xff\xff\xff\xff\x0f", b"garbage" * 100]
    for _ in range(30):  # bit flips of a valid body
        flipped = bytearray(good)
        flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        protos.append(bytes(flipped))
    for tokens, inputs in [
        ([2**31 - 1, 2], {}),  # a token far outside the vocabulary
        ([-5, 2], {}),
        ([5, 6], {"weights": np.array([np.nan, 1.0], np.float32)}),
        ([5, 6], {"weights": np.array([1.0], np.float32)}),  # the wrong length
        ([], {}),
    ]:
        protos.append(_forward_backward_proto(model_id, seq_id=10**6 + len(protos), tokens=tokens, inputs=inputs))
    for raw in protos:
        resp = _post(server, "forward_backward", raw, "application/x-protobuf")
        _assert_answered(resp, f"forward_backward proto {raw[:20]!r}")
        answered["4xx" if resp.status_code >= 400 else "2xx"] += 1
    for route in ["training_runs?limit=-1", "training_runs?limit=abc", f"training_runs/{'x' * 5000}",
                  "training_runs/../../etc/checkpoints", f"training_runs/{model_id}/checkpoints",
                  "samplers/nope"]:  # fmt: skip
        resp = requests.get(f"{server.url}/api/v1/{route}", headers=HEADERS, timeout=30)
        _assert_answered(resp, f"GET {route}")
    resp = requests.delete(f"{server.url}/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/x",
                           headers=HEADERS, timeout=30)  # fmt: skip
    _assert_answered(resp, "DELETE sampler_weights")
    assert answered["4xx"] > 200, answered  # the mutations were refused, not silently accepted en masse

    # the server is alive and the client it had before the abuse trains as usual (its seq_ids were not disturbed)
    assert requests.get(f"{server.url}/api/v1/healthz", timeout=5).json() == {"status": "ok"}
    losses = _sft(tc, 3, list(range(5, 15)))
    assert losses[-1] < losses[0], losses


def _forward_backward_proto(model_id: str, seq_id: int, tokens=(5, 6, 7), inputs=None) -> bytes:
    """The SDK's own encoding of a forward_backward request (`tinker.proto.request_conv`), of any values."""
    tokens = list(tokens)
    loss_inputs = {"weights": np.ones(max(len(tokens) - 1, 0), np.float32)} if inputs is None else inputs
    loss_inputs = {"target_tokens": np.array(tokens[1:], np.int64), **loss_inputs}
    datum = types.Datum(
        model_input=types.ModelInput(chunks=[types.EncodedTextChunk.model_construct(tokens=tokens[:-1])]),
        loss_fn_inputs={k: types.TensorData.from_numpy(v) for k, v in loss_inputs.items()},
    )
    fb_input = types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy")
    request = types.ForwardBackwardRequest(forward_backward_input=fb_input, model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_huge_num_samples_and_max_tokens_are_refused_at_once(server):
    """A sample that asks for more than the server serves is a 400 naming the field, answered before any work."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    sampler = sc.create_sampling_client(base_model=BASE)
    prompt = types.ModelInput.from_ints([5, 6, 7])
    for params, n, field in [
        (types.SamplingParams(max_tokens=10**9), 1, "max_tokens"),
        (types.SamplingParams(max_tokens=2), 10**9, "num_samples"),
    ]:
        with pytest.raises(tinker.BadRequestError, match=field):
            sampler.sample(prompt, num_samples=n, sampling_params=params).result()
    out = sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=2)).result()
    assert len(out.sequences) == 2 and all(1 <= len(s.tokens) <= 2 for s in out.sequences), out.sequences
