"""Bodies of the Tinker wire format: protobuf, read and written with the SDK's own generated messages, and the JSON
of SDK releases that predate them.

Releases 0.25 and later send `forward_backward` (and `forward`, as `forward_only`) as a `ForwardBackwardRequest`
proto, zstd-compressed (`Content-Encoding: zstd`) when the server's client config asks for it, and ask for
`ForwardBackwardOutput` and `SampleResponse` results as protos (`Accept: application/x-protobuf`); 0.24 does the same
when the client config says `proto_write_fwdbwd` (this server's does). Releases before the protos (0.16) send JSON
bodies (`forward_backward_input`, or `forward_input` to `/api/v1/forward`) and read JSON results. Both decode to one
`FwdBwdBody`; results are kept as proto bytes and written as JSON for a client that does not accept protobuf.
Everything else is JSON in every release. These are the server-side inverses of the SDK's
`tinker/proto/request_conv.py` and `response_conv.py` (and of its pydantic models' JSON, for the old releases).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

PROTO_CONTENT_TYPE = "application/x-protobuf"
_NUMPY_OF = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
_NUMPY_OF_JSON = {"float32": np.float32, "int64": np.int64}  # TensorData.dtype of the JSON bodies
MAX_DECOMPRESSED = 256 * 1024 * 1024  # a compressed body may expand to this many bytes (an uncompressed one's limit)


class WireError(ValueError):
    """A body that is not a request of the wire format at all (the route answers 400 with the reason)."""


def decompress(body: bytes, encoding: str | None) -> bytes:
    """The body as sent before its `Content-Encoding` (none or zstd), at most MAX_DECOMPRESSED bytes."""
    encoding = (encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding in ("gzip", "deflate"):
        import zlib

        d = zlib.decompressobj(wbits=47)  # gzip or zlib header, detected
        try:
            out = d.decompress(body, MAX_DECOMPRESSED + 1)
        except zlib.error as e:
            raise WireError(f"the {encoding} body cannot be decompressed ({e})") from None
    elif encoding == "zstd":
        import zstandard

        try:  # a stream reader: the frame need not state its size, and at most the limit is ever decompressed
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
                out = reader.read(MAX_DECOMPRESSED + 1)
        except zstandard.ZstdError as e:
            raise WireError(f"the zstd body cannot be decompressed ({e})") from None
    else:
        raise WireError(f"Content-Encoding {encoding!r} is not supported; allowed: zstd, gzip, deflate or none")
    if len(out) > MAX_DECOMPRESSED:
        raise WireError(f"the zstd body expands past {MAX_DECOMPRESSED} bytes")
    return out


@dataclass(frozen=True)
class Span:
    """One provenance run (`tinker.types.PromptProvenanceSpan` / `SampledProvenanceSpan`): `length` positions that are
    positions `offset..` of sequence `sequence_id`'s request prompt (`kind` "prompt") or sampled tokens ("sampled")."""

    kind: str
    sequence_id: str
    offset: int
    length: int


@dataclass
class Datum:
    """One training example: input tokens (N,) and its loss inputs by name, each (N,) or (N, ...); its provenance
    (`Datum.with_provenance`: runs tiling `model_input` and `target_tokens`), None when it has none (the proto's
    empty lists; JSON bodies never carry it)."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    input_spans: list[Span] | None = None
    target_spans: list[Span] | None = None


@dataclass
class FwdBwdBody:
    """A decoded forward_backward request."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]
    error: str | None = None  # why its data cannot be read (failed in the request's turn, so later seq_ids still run)


def _tensor(msg: pb.Tensor) -> np.ndarray:
    dtype = _NUMPY_OF.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"tensor dtype {msg.dtype} is not supported; allowed: float32, int64, int32")
    if msg.HasField("sparse_csr"):
        raise ValueError("sparse loss_fn_inputs are not supported; send dense tensors")
    return np.frombuffer(msg.dense, dtype=dtype).reshape(tuple(msg.shape))


def decode_forward_backward(body: bytes) -> FwdBwdBody:
    """A forward_backward (or forward) request: its JSON (a body starting with `{`: releases before the protos; a
    ForwardBackwardRequest proto never starts with that byte, the start of a field-15 group) or its proto. Raises
    WireError / protobuf's DecodeError for a body that is neither; data that cannot be read is `error`."""
    if body.lstrip()[:1] == b"{":
        return _decode_json_forward_backward(body)
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(body)
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = []
    try:
        for d in msg.data:
            parts = []
            for chunk in d.model_input:
                if chunk.WhichOneof("chunk") != "encoded_text":
                    raise ValueError(
                        f"model_input chunk {chunk.WhichOneof('chunk')!r} is not supported; allowed: text"
                    )
                parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
            tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
            inputs = {name: _tensor(t) for name, t in d.loss_fn_inputs.items()}
            data.append(Datum(tokens, inputs, _spans(d.model_input_spans), _spans(d.loss_fn_input_spans)))
    except ValueError as e:  # the request is still acknowledged: refusing it at once would leave a gap in seq_ids
        return FwdBwdBody(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, [], str(e))
    return FwdBwdBody(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def _spans(msgs: Any) -> list[Span] | None:
    """The provenance runs of one datum field (None for none). A run that is neither arm of the oneof has kind ""
    (refused where provenance is read)."""
    out = []
    for m in msgs:
        arm = m.WhichOneof("span")
        run = getattr(m, arm) if arm else None
        kind = {"prompt_tokens": "prompt", "sampled_tokens": "sampled"}.get(arm or "", "")
        out.append(Span(kind, run.sequence_id if run else "", run.offset if run else 0, run.length if run else 0))
    return out or None


def _decode_json_forward_backward(body: bytes) -> FwdBwdBody:
    """The JSON of `ForwardBackwardRequest` / `ForwardRequest` (SDK < 0.24): `{"model_id", "seq_id",
    "forward_backward_input" | "forward_input": {"data": [Datum], "loss_fn", "loss_fn_config"}}`, a Datum being
    `{"model_input": {"chunks": [{"type": "encoded_text", "tokens": [...]}]}, "loss_fn_inputs": {name: TensorData}}`
    and a TensorData `{"data": [...], "dtype": "float32" | "int64", "shape": [...]}`."""
    try:
        msg = json.loads(body)
    except ValueError as e:
        raise WireError(f"forward_backward body is not valid JSON ({e})") from None
    forward_only = isinstance(msg, dict) and "forward_input" in msg
    inp = msg.get("forward_input" if forward_only else "forward_backward_input") if isinstance(msg, dict) else None
    model_id, seq_id = (msg.get("model_id"), msg.get("seq_id")) if isinstance(msg, dict) else (None, None)
    if not isinstance(inp, dict) or not isinstance(model_id, str) or type(seq_id) is not int or seq_id < 0:
        raise WireError(
            "forward_backward JSON body needs model_id (a string), seq_id (an int >= 0) and forward_backward_input "
            "(or forward_input: an object with data, loss_fn, loss_fn_config)"
        )
    loss_fn = inp.get("loss_fn")
    try:
        if not isinstance(loss_fn, str):
            raise ValueError(f"loss_fn={loss_fn!r} is not allowed; allowed: a loss name")
        config = _json_loss_config(inp.get("loss_fn_config"))
        data = [_json_datum(d, i) for i, d in enumerate(_json_list(inp.get("data"), "data"))]
    except (ValueError, TypeError, OverflowError) as e:
        return FwdBwdBody(model_id, seq_id, str(loss_fn), {}, forward_only, [], str(e))
    return FwdBwdBody(model_id, seq_id, loss_fn, config, forward_only, data)


def _json_list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{where}={value!r:.80} is not allowed; allowed: a list")
    return value


def _json_loss_config(config: Any) -> dict[str, float | str]:
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ValueError(f"loss_fn_config={config!r:.80} is not allowed; allowed: an object of numbers or strings")
    out: dict[str, float | str] = {}
    for k, v in config.items():
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise ValueError(f"loss_fn_config.{k}={v!r:.80} is not allowed; allowed: a number or a string")
        out[k] = v if isinstance(v, str) else float(v)
    return out


def _json_datum(d: Any, i: int) -> Datum:
    where = f"data[{i}]"
    if not isinstance(d, dict) or not isinstance(d.get("model_input"), dict):
        raise ValueError(f"{where} is not a Datum; allowed: an object with model_input and loss_fn_inputs")
    parts = []
    for j, chunk in enumerate(_json_list(d["model_input"].get("chunks"), f"{where}.model_input.chunks")):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise ValueError(f"{where}.model_input.chunks[{j}] of type {kind!r} is not supported; allowed: text")
        parts.append(_ints(chunk.get("tokens"), f"{where}.model_input.chunks[{j}].tokens"))
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    inputs = d.get("loss_fn_inputs") or {}
    if not isinstance(inputs, dict):
        raise ValueError(f"{where}.loss_fn_inputs is not an object of TensorData")
    return Datum(tokens, {name: _json_tensor(t, f"{where}.loss_fn_inputs.{name}") for name, t in inputs.items()})


def _ints(values: Any, where: str) -> np.ndarray:
    values = _json_list(values, where)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"{where} holds a value that is not an int")
    return np.asarray(values, dtype=np.int64)  # OverflowError past int64


def _json_tensor(t: Any, where: str) -> np.ndarray:
    if isinstance(t, list):  # a bare list: what the old SDK's TensorData holds
        t = {"data": t}
    if not isinstance(t, dict):
        raise ValueError(f"{where} is not a TensorData; allowed: an object with data, dtype, shape")
    dtype = _NUMPY_OF_JSON.get(t.get("dtype", "float32"))
    if dtype is None:
        raise ValueError(f"{where}.dtype={t.get('dtype')!r} is not supported; allowed: float32, int64")
    data = _json_list(t.get("data"), f"{where}.data")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in data):
        raise ValueError(f"{where}.data holds a value that is not a number")
    array = np.asarray(data, dtype=np.float64 if dtype is np.float32 else np.int64).astype(dtype)
    shape = t.get("shape")
    if shape is not None:
        shape = _ints(shape, f"{where}.shape")
        if (shape < 0).any() or int(np.prod(shape)) != array.size:
            raise ValueError(f"{where}.shape={shape.tolist()} does not hold its {array.size} values")
        array = array.reshape(tuple(int(n) for n in shape))
    return array


def forward_backward_output_json(proto_bytes: bytes) -> dict[str, Any]:
    """A ForwardBackwardOutput proto (what `encode_forward_backward_output` wrote) as the JSON the SDK's pydantic
    `ForwardBackwardOutput` reads: per datum, each field as a TensorData."""
    out = pb.ForwardBackwardOutput()
    out.ParseFromString(proto_bytes)
    outputs: list[dict[str, Any]] = []
    for record in out.loss_fn_outputs:
        per_datum: list[dict[str, Any]] = [{} for _ in range(record.num_datums)]
        for name, bt in record.fields.items():
            values = np.frombuffer(bt.data, dtype=np.float32)
            offsets = np.frombuffer(bt.offsets, dtype=np.int64) // 4  # byte offsets -> float32 offsets
            for i in range(record.num_datums):
                part = values[offsets[i] : offsets[i + 1]]
                per_datum[i][name] = {"data": part.tolist(), "dtype": "float32", "shape": [len(part)]}
        outputs += per_datum
    return {"loss_fn_output_type": out.loss_fn_output_type or "ArrayRecord", "loss_fn_outputs": outputs,
            "metrics": dict(out.metrics)}  # fmt: skip


def sample_response_json(proto_bytes: bytes) -> dict[str, Any]:
    """A SampleResponse proto (what `encode_sample_response` wrote) as the JSON the SDK's pydantic `SampleResponse`
    reads (unscored prompt positions, NaN in the proto, are null)."""
    out = pb.SampleResponse()
    out.ParseFromString(proto_bytes)
    sequences = [
        {
            "stop_reason": "length" if seq.stop_reason == pb.STOP_REASON_LENGTH else "stop",
            "tokens": np.frombuffer(seq.tokens, dtype=np.int32).tolist(),
            "logprobs": np.frombuffer(seq.logprobs, dtype=np.float32).tolist(),
        }
        for seq in out.sequences
    ]
    answer: dict[str, Any] = {"type": "sample", "sequences": sequences}
    if out.prompt_logprobs:
        answer["prompt_logprobs"] = [None if np.isnan(v) else float(v)
                                     for v in np.frombuffer(out.prompt_logprobs, dtype=np.float32)]  # fmt: skip
    if out.HasField("topk_prompt_logprobs"):
        t = out.topk_prompt_logprobs
        ids = np.frombuffer(t.token_ids, dtype=np.int32).reshape(t.length, t.k)
        logprobs = np.frombuffer(t.logprobs, dtype=np.float32).reshape(t.length, t.k)
        answer["topk_prompt_logprobs"] = [
            None if not (row_lp > MASK_LOGPROB).any() else
            [(int(i), float(v)) for i, v in zip(row_ids, row_lp, strict=True) if v > MASK_LOGPROB]
            for row_ids, row_lp in zip(ids, logprobs, strict=True)
        ]  # fmt: skip
    return answer


MASK_LOGPROB = -99999.0  # an empty top-k cell (rl_multilora.tinker.ops.MASK_LOGPROB, tinker.types.topk_logprobs)


def encode_forward_backward_output(per_datum: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """Per-datum outputs (each field a 1-D float32 array of the datum's length) as one batched ArrayRecord."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    record = out.loss_fn_outputs.add(num_datums=len(per_datum))
    for name in per_datum[0] if per_datum else []:
        arrays = [np.ascontiguousarray(d[name], dtype=np.float32) for d in per_datum]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        bt = record.fields[name]
        bt.dtype = pb.DTYPE_FLOAT32
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
    return out.SerializeToString()


def encode_sample_response(
    sequences: list[tuple[list[int], list[float], str]],
    prompt_logprobs: np.ndarray | None = None,
    topk: tuple[np.ndarray, np.ndarray] | None = None,
) -> bytes:
    """(tokens, logprobs, stop_reason "stop" | "length") per sampled sequence; the prompt's log-probs (N,) float32
    (NaN where not scored) and its top-k (ids, log-probs), each (N, k), when asked for."""
    out = pb.SampleResponse()
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if topk is not None:
        ids, logprobs = topk
        out.topk_prompt_logprobs.token_ids = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
        out.topk_prompt_logprobs.logprobs = np.ascontiguousarray(logprobs, dtype=np.float32).tobytes()
        out.topk_prompt_logprobs.length, out.topk_prompt_logprobs.k = ids.shape
    for tokens, logprobs, stop in sequences:
        seq = out.sequences.add()
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
        seq.stop_reason = pb.STOP_REASON_LENGTH if stop == "length" else pb.STOP_REASON_STOP
    return out.SerializeToString()
