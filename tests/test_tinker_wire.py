"""The wire formats of the supported SDK releases (rl_multilora.tinker.wire), without a server: the JSON
forward_backward / forward bodies of SDK 0.16 decode to what the proto of 0.38 decodes to; results kept as protos
read back as the JSON the old SDK's pydantic models take; compressed bodies; bad bodies named."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from rl_multilora.tinker import wire

TOKENS = [5, 6, 7, 8, 9]


def _proto(forward_only: bool = False) -> bytes:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": np.array(TOKENS[1:], np.int64), "advantages": np.full(4, 0.5, np.float32),
                        "logprobs": np.full(4, -1.0, np.float32)},
    )  # fmt: skip
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7}
        ),
        model_id="s0:train:0",
        seq_id=3,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def _json(key: str = "forward_backward_input", **over) -> bytes:
    """What SDK 0.16's pydantic ForwardBackwardRequest (or ForwardRequest) dumps."""
    body = {
        key: {
            "data": [
                {
                    "model_input": {"chunks": [{"type": "encoded_text", "tokens": TOKENS[:-1]}]},
                    "loss_fn_inputs": {
                        "target_tokens": {"data": TOKENS[1:], "dtype": "int64", "shape": [4]},
                        "advantages": {"data": [0.5] * 4, "dtype": "float32", "shape": [4]},
                        "logprobs": {"data": [-1.0] * 4, "dtype": "float32", "shape": [4]},
                    },
                }
            ],
            "loss_fn": "ppo",
            "loss_fn_config": {"clip_low_threshold": 0.7},
        },
        "model_id": "s0:train:0",
        "seq_id": 3,
        **over,
    }
    return json.dumps(body).encode()


def _same(a: wire.FwdBwdBody, b: wire.FwdBwdBody) -> None:
    assert (a.model_id, a.seq_id, a.loss_fn, a.forward_only, a.error) == (
        b.model_id, b.seq_id, b.loss_fn, b.forward_only, b.error,
    )  # fmt: skip
    assert a.loss_fn_config == pytest.approx(b.loss_fn_config)
    assert len(a.data) == len(b.data)
    for x, y in zip(a.data, b.data, strict=True):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        assert x.inputs.keys() == y.inputs.keys()
        for k in x.inputs:
            assert x.inputs[k].dtype == y.inputs[k].dtype
            np.testing.assert_array_equal(x.inputs[k], y.inputs[k])


@pytest.mark.parametrize("forward_only", [False, True])
def test_json_bodies_decode_like_the_proto(forward_only):
    body = _json("forward_input" if forward_only else "forward_backward_input")
    _same(wire.decode_forward_backward(body), wire.decode_forward_backward(_proto(forward_only)))


@pytest.mark.parametrize("encoding", ["zstd", "gzip"])
def test_compressed_bodies(encoding):
    raw = _proto()
    packed = zstandard.ZstdCompressor().compress(raw) if encoding == "zstd" else gzip.compress(raw)
    assert wire.decompress(packed, encoding) == raw and wire.decompress(raw, None) == raw
    with pytest.raises(wire.WireError, match="cannot be decompressed"):
        wire.decompress(b"not compressed", encoding)
    with pytest.raises(wire.WireError, match="'br' is not supported"):
        wire.decompress(raw, "br")


def test_bad_json_bodies_are_refused_or_fail_in_their_turn():
    for body in (b"{", b'{"model_id": "s0:train:0"}', _json(seq_id="3"), _json(seq_id=-1), b"{}"):
        with pytest.raises(wire.WireError):
            wire.decode_forward_backward(body)
    # readable id and seq_id, unreadable data: acknowledged, failed in its turn (later seq_ids still run)
    bad = json.loads(_json())
    cases = {
        "a value that is not an int": lambda b: b["forward_backward_input"]["data"][0]["model_input"]["chunks"][
            0
        ].__setitem__("tokens", [1, "x"]),
        "does not hold its 4 values": lambda b: b["forward_backward_input"]["data"][0]["loss_fn_inputs"][
            "advantages"
        ].__setitem__("shape", [5]),
        "'image' is not supported": lambda b: b["forward_backward_input"]["data"][0]["model_input"]["chunks"][
            0
        ].__setitem__("type", "image"),
        "loss_fn_config.beta": lambda b: b["forward_backward_input"].__setitem__("loss_fn_config", {"beta": [1]}),
        "dtype='bfloat16'": lambda b: b["forward_backward_input"]["data"][0]["loss_fn_inputs"]["logprobs"].__setitem__(
            "dtype", "bfloat16"
        ),
    }
    for reason, mutate in cases.items():
        body = json.loads(json.dumps(bad))
        mutate(body)
        decoded = wire.decode_forward_backward(json.dumps(body).encode())
        assert decoded.error is not None and reason in decoded.error, (reason, decoded.error)
        assert (decoded.model_id, decoded.seq_id, decoded.data) == ("s0:train:0", 3, [])


def test_proto_results_read_back_as_the_old_sdks_json():
    per_datum = [{"logprobs": np.array([-1.0, -2.0], np.float32)}, {"logprobs": np.array([-0.5], np.float32)}]
    out = wire.forward_backward_output_json(wire.encode_forward_backward_output(per_datum, {"loss:sum": 3.5}))
    assert out == {
        "loss_fn_output_type": "ArrayRecord",
        "loss_fn_outputs": [
            {"logprobs": {"data": [-1.0, -2.0], "dtype": "float32", "shape": [2]}},
            {"logprobs": {"data": [-0.5], "dtype": "float32", "shape": [1]}},
        ],
        "metrics": {"loss:sum": 3.5},
    }
    prompt = np.array([np.nan, -1.5, -0.25], np.float32)
    ids = np.array([[0, 0], [4, 7], [9, 2]], np.int32)
    lps = np.array([[wire.MASK_LOGPROB] * 2, [-0.5, -1.0], [-0.25, -3.0]], np.float32)
    sample = wire.sample_response_json(
        wire.encode_sample_response([([3, 4], [-0.5, -0.75], "length"), ([5], [-1.0], "stop")], prompt, (ids, lps))
    )
    assert sample == {
        "type": "sample",
        "sequences": [
            {"stop_reason": "length", "tokens": [3, 4], "logprobs": [-0.5, -0.75]},
            {"stop_reason": "stop", "tokens": [5], "logprobs": [-1.0]},
        ],
        "prompt_logprobs": [None, -1.5, -0.25],
        "topk_prompt_logprobs": [None, [(4, -0.5), (7, -1.0)], [(9, -0.25), (2, -3.0)]],
    }


def test_json_client_over_http_trains_like_a_proto_client(tmp_path):
    """An SDK-0.16-style client over raw HTTP (JSON bodies, `Accept: application/json`, `/api/v1/forward`) and the
    proto one (zstd body, protobuf results) on one server: the same forward log-probs and first loss."""
    import httpx

    from tests.test_tinker_server import BASE, MODEL, TOKEN, _Running
    from tests.tiny_models import save_tiny_model

    save_tiny_model(MODEL, hidden=32, layers=2)
    server = _Running(tmp_path / "state")
    headers = {"X-API-Key": TOKEN, "Accept": "application/json"}

    def post(route: str, body: bytes | dict, extra: dict | None = None) -> httpx.Response:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        return httpx.post(f"{server.url}/api/v1/{route}", headers={**headers, **(extra or {})}, timeout=60, **kw)

    def result(request_id: str, accept: str = "application/json") -> httpx.Response:
        while True:
            r = post("retrieve_future", {"request_id": request_id}, {"Accept": accept})
            if not (r.headers["content-type"].startswith("application/json") and r.json().get("type") == "try_again"):
                return r

    try:
        session = post("create_session", {}).json()["session_id"]
        for seq in (0, 1):
            create = {
                "session_id": session,
                "model_seq_id": seq,
                "base_model": BASE,
                "lora_config": {"rank": 4, "seed": 0},
            }
            result(post("create_model", create).json()["request_id"])
        model_a, model_b = f"{session}:train:0", f"{session}:train:1"
        body = json.loads(_json("forward_input", model_id=model_a, seq_id=1))
        body["forward_input"]["loss_fn"] = "cross_entropy"
        body["forward_input"]["loss_fn_config"] = None
        del body["forward_input"]["data"][0]["loss_fn_inputs"]["advantages"]
        del body["forward_input"]["data"][0]["loss_fn_inputs"]["logprobs"]
        out = result(post("forward", json.dumps(body).encode()).json()["request_id"]).json()
        json_lp = out["loss_fn_outputs"][0]["logprobs"]
        assert json_lp["dtype"] == "float32" and json_lp["shape"] == [4] and all(v < 0 for v in json_lp["data"])

        proto = pb_request(model_b, 1, forward_only=True)
        packed = zstandard.ZstdCompressor().compress(proto)
        r = result(post("forward_backward", packed, {"Content-Encoding": "zstd"}).json()["request_id"],
                   accept="application/x-protobuf")  # fmt: skip
        assert r.headers["content-type"].startswith("application/x-protobuf")
        assert wire.forward_backward_output_json(r.content)["loss_fn_outputs"][0]["logprobs"]["data"] == (
            pytest.approx(json_lp["data"], rel=1e-6)
        )  # same seed, same base: the same adapter
        bad = post("forward_backward", b"\x28\xb5\x2f\xfd garbage", {"Content-Encoding": "zstd"})
        assert bad.status_code == 400 and "cannot be decompressed" in bad.json()["detail"]
    finally:
        server.close()


def pb_request(model_id: str, seq_id: int, forward_only: bool) -> bytes:
    """A cross_entropy ForwardBackwardRequest proto of TOKENS, as SDK 0.38 writes it."""
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": np.array(TOKENS[1:], np.int64), "weights": np.ones(4, np.float32)},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def test_provenance_spans_and_loss_fn_config_v2_decode_as_the_sdk_writes_them():
    """`Datum.with_provenance` travels as the proto's `model_input_spans` / `loss_fn_input_spans` (oneof prompt /
    sampled runs), `loss_fn_config` as `loss_fn_config_v2` (numbers, and text, which the registry then refuses); a
    datum without provenance decodes to None (the JSON bodies never carry any)."""
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": np.array(TOKENS[1:], np.int64), "advantages": np.ones(4, np.float32)},
    )
    spans = datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="seq-a", length=2),
                     types.SampledProvenanceSpan(sequence_id="seq-a", length=2)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="seq-a", offset=1, length=1),
                        types.SampledProvenanceSpan(sequence_id="seq-a", offset=0, length=3)],
    )  # fmt: skip
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[spans, datum], loss_fn="stable_reinforce", loss_fn_config={"kl_coeff": 0.01, "mode": "x"}
        ),
        model_id="s0:train:0",
        seq_id=1,
    )
    msg = forward_backward_request_to_proto(request)
    assert dict(msg.loss_fn_config) == pytest.approx({"kl_coeff": 0.01})  # the old map holds numbers only
    fb = wire.decode_forward_backward(msg.SerializeToString())
    assert fb.error is None and fb.loss_fn == "stable_reinforce"
    assert fb.loss_fn_config == {"kl_coeff": pytest.approx(0.01), "mode": "x"}
    with_spans, without = fb.data
    assert with_spans.input_spans == [wire.Span("prompt", "seq-a", 0, 2), wire.Span("sampled", "seq-a", 0, 2)]
    assert with_spans.target_spans == [wire.Span("prompt", "seq-a", 1, 1), wire.Span("sampled", "seq-a", 0, 3)]
    assert without.input_spans is None and without.target_spans is None
    assert all(d.input_spans is None for d in wire.decode_forward_backward(_json()).data)
