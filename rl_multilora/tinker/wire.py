"""Protobuf bodies of the Tinker wire format, read and written with the SDK's own generated messages.

The SDK sends `forward_backward` as a `ForwardBackwardRequest` proto and asks for `ForwardBackwardOutput` and
`SampleResponse` results as protos (`Accept: application/x-protobuf`); everything else is JSON. These are the
server-side inverses of `tinker/proto/request_conv.py` and `response_conv.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

PROTO_CONTENT_TYPE = "application/x-protobuf"
_NUMPY_OF = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass
class Datum:
    """One training example: input tokens (N,) and its loss inputs by name, each (N,) or (N, ...)."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


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
            data.append(Datum(tokens, {name: _tensor(t) for name, t in d.loss_fn_inputs.items()}))
    except ValueError as e:  # the request is still acknowledged: refusing it at once would leave a gap in seq_ids
        return FwdBwdBody(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, [], str(e))
    return FwdBwdBody(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


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
