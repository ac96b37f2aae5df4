"""An SGLang-compatible HTTP server around any `RolloutEngine` (aiohttp).

It exposes the endpoints and payloads of SGLang's native API that `SGLangEngine` uses, so the same client
drives a real SGLang server on a GPU box and the embedded torch engine anywhere else.

Design choices (each follows SGLang unless said otherwise):
- Unknown request fields are ignored, as SGLang's request schemas do (`extra_behavior="ignore"`); a missing
  required field or a wrong type answers 400. Unknown `sampling_params` keys answer 400 (SGLang's `/generate`
  contract check rejects them), and so do SGLang sampling options this engine cannot honour (e.g. `min_p`)
  unless they are at their default.
- Adapter names (`lora_name`, and `lora_path` in `/generate`) follow the project's one rule,
  `validate_adapter_name` (a name becomes a path component downstream); any other name answers 400.
- Deviation: `/load_lora_adapter_from_tensors` accepts only `load_format="safetensors"` (base64 safetensors
  bytes in `serialized_named_tensors`). SGLang's own encoding is pickle (0.5.23 reads it with an allow-list
  unpickler; unpickling request data ran arbitrary code before, CVE-2025-10164), so it is refused with a 400
  that says so, and nothing here ever unpickles.
- Auth: with `api_key` set, every endpoint but `/health*` (and SGLang's other exempt prefixes `/ready`,
  `/metrics`, and OPTIONS requests) needs `Authorization: Bearer <key>`, as SGLang does (it reads no other
  header; `x-api-key` is refused); otherwise 401 `{"error": "Unauthorized"}`. There is one key: SGLang's
  `--admin-api-key` split of the control endpoints is not modelled. Binds 127.0.0.1 by default.
- `/pause_generation` implements `mode="abort"` itself: every `/generate` in flight answers at once with
  finish_reason `{"type": "abort", "message": "Aborted by /pause_generation"}` (the engine's result, when it
  comes, is dropped), and requests that arrive while paused wait until `/continue_generation`, as in SGLang.
  `retract` and `in_place` answer 400: the weight sync never uses them because unloading in those modes
  deadlocks SGLang. A row the engine aborts on its own (e.g. its adapter changed mid-request) carries the
  engine's reason as its message, never the pause's.
- The engine's blocking calls (generate, load, unload, pause, resume) run in worker threads
  (`engine.agenerate`, `asyncio.to_thread`), never on the event loop; so do parsing a JSON body and checking a
  `/generate` body, which take a second or more for a body of tens of MB (`/health` stays responsive).
- Request bodies are limited (`max_body_bytes`, `engine-serve --max-body-mb`, 32 MiB by default; adapter tensor
  pushes to `/load_lora_adapter_from_tensors` have their own `max_adapter_body_bytes`, 1 GiB): a larger body
  answers 413 without being buffered. The key is checked first, so without it nothing is read at all.
  Deviation: SGLang (uvicorn) sets no limit.
- A client that goes away (closes its connection, a timeout) has its handler cancelled: its engine rows stop at the
  next decode step as "cancelled" instead of generating for nobody. Control routes (load, unload, pause, continue,
  flush) still run to their end. A shutdown (SIGTERM) answers the requests a pause parked with 503 and aborts those
  in flight before aiohttp waits for the handlers.
- Deviation: loading a name that is loaded replaces it (a new version in a free slot, requests on the old one
  finish on it), where SGLang refuses ("already loaded"); `SGLangEngine` unloads first either way.
- Non-finite numbers (NaN, Infinity, or a literal like 1e999 that overflows to inf) anywhere in a body answer 400
  naming the field; Python's JSON reader would otherwise take them and `temperature: NaN` meant greedy.
- A prompt longer than the context, or a prompt plus an explicit `max_new_tokens` reaching it, answers 400 with
  SGLang's messages and the shape SGLang gives its request ValueErrors (`{"error": {"message"}}`); without
  `max_new_tokens` the context caps the output, as in SGLang.
- Deviation: `meta_info.weight_version` is the request's adapter version (SGLang's is one server-wide string;
  base rows report "default"), and `/model_info` (alias `/get_model_info`) and the LoRA endpoints add
  `adapter_versions`. The adapter version to assign comes in the `X-Adapter-Version` header, since SGLang's
  structs have no field for it.

One file: the request validation (`parse_generate_body`, `_sampling_from_dict`, `_want`), the
handlers and the app wiring are one contract, SGLang's API as this server implements it, and each handler reads
best next to the rules it enforces. What the server shares with the client (payload formats, tensor encodings,
config checks) is in `sglang_protocol.py`; the `engine-serve` entry point is in `serve.py`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

from rl_multilora.lora import CONFIG_NAME, WEIGHTS_NAME, read_peft_folder, validate_adapter_name
from rollout.engines.base import RolloutEngine
from rollout.server.openai_api import add_openai_routes
from rollout.server.state import (
    DEFAULT_MAX_ADAPTER_BODY_BYTES,
    DEFAULT_MAX_BODY_BYTES,
    SHUTDOWN_MESSAGE,
    STATE_KEY,
    NonFiniteNumberError,
    ServerState,
    context_error,
    read_json,
)
from rollout.sglang.protocol import (
    ADAPTER_VERSION_HEADER,
    SAFETENSORS_LOAD_FORMAT,
    check_lora_config,
    decode_tensors_safetensors,
)
from rollout.types import GenerateRequest, GenerateResult, SamplingParams

logger = logging.getLogger(__name__)

# SGLang's SamplingParams API fields (tests/fixtures/sglang_api.json) -> the default a request may leave them at.
_SUPPORTED_SAMPLING = {
    "temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids", "sampling_seed", "ignore_eos"
}  # fmt: skip
_UNSUPPORTED_SAMPLING_DEFAULTS: dict[str, Any] = {
    "stop_regex": None,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "beam_width": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "custom_params": None,
    "stream_interval": None,
    "logit_bias": None,
    "watermark": None,
}
# Paths SGLang serves without a key (k8s probes, Prometheus), matched by prefix as SGLang does.
_AUTH_EXEMPT_PREFIXES = ("/health", "/ready", "/metrics")
_FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
_FLUSH_FAILED_TEXT = "Flush cache failed.\n"
# The abort message of a /generate answered early by /pause_generation; an engine's own abort says why in `error`.
_PAUSE_ABORT_MESSAGE = "Aborted by /pause_generation"


class RequestError(ValueError):
    """A request that fails validation; answered with 400 and this message."""


class SGLangValueError(RequestError):
    """A request SGLang's own checks refuse with a ValueError (e.g. too long for the context): 400 in the shape
    SGLang gives those, `{"error": {"message"}}`."""


# ------------------------------------------------------------------------------------------------ helpers


def _bad_request(message: str) -> web.Response:
    """SGLang's validation-error body (an OpenAI-style ErrorResponse with code 400)."""
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return web.json_response(body, status=400)


def _error(message: str, status: int) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _lora_response(state: ServerState, ok: bool, error: str | None = None) -> web.Response:
    """SGLang's LoRAUpdateOutput, plus our per-adapter versions."""
    versions = state.engine.adapter_versions()
    body = {
        "rid": None,
        "http_worker_ipc": None,
        "success": ok,
        "error_message": error,
        "loaded_adapters": {name: "__tensor__" for name in versions} if ok else None,
        "adapter_versions": versions,
    }
    return web.json_response(body, status=200 if ok else 400)


async def _json_body(request: web.Request, required: tuple[str, ...] = ()) -> dict[str, Any]:
    if not request.can_read_body:
        body: Any = {}
    else:
        try:
            body = await read_json(request)  # parsed in a thread
        except NonFiniteNumberError as exc:  # NaN / Infinity / 1e999, naming the field
            raise RequestError(str(exc)) from exc
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise RequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {type(body).__name__}")
    missing = [k for k in required if k not in body]
    if missing:
        raise RequestError(f"missing required field(s): {', '.join(missing)}")
    return body


def _want(body: dict[str, Any], key: str, kind: type | tuple[type, ...], allowed: str) -> Any:
    value = body.get(key)
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise RequestError(f"{key}={value!r} is not allowed; allowed: {allowed}")
    if not isinstance(value, kind):
        raise RequestError(f"{key}={value!r} is not allowed; allowed: {allowed}")
    return value


def _adapter_name(value: Any, where: str, base_allowed: bool = False) -> str | None:
    """`value` if it is a valid adapter name (`validate_adapter_name`, the project's one rule), else a 400."""
    if value is None and base_allowed:
        return None
    try:
        return validate_adapter_name(value)
    except ValueError as exc:
        allowed = str(exc).partition("; allowed: ")[2] or "a valid adapter name"
        if base_allowed:
            allowed = f"a loaded adapter's name ({allowed}), or null for the base"
        raise RequestError(f"{where}={value!r} is not allowed; allowed: {allowed}") from None


def _sampling_from_dict(raw: Any, where: str) -> SamplingParams:
    """Validate one SGLang `sampling_params` dict and convert it to our `SamplingParams`."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(f"{where}={raw!r} is not allowed; allowed: a JSON object")
    for key, value in raw.items():
        if key in _SUPPORTED_SAMPLING:
            continue
        if key not in _UNSUPPORTED_SAMPLING_DEFAULTS:
            allowed = ", ".join(sorted(_SUPPORTED_SAMPLING))
            raise RequestError(f"{where}.{key} is not an SGLang sampling parameter; this server supports: {allowed}")
        if value is not None and value != _UNSUPPORTED_SAMPLING_DEFAULTS[key]:
            raise RequestError(
                f"{where}.{key}={value!r} is not allowed; allowed: {_UNSUPPORTED_SAMPLING_DEFAULTS[key]!r} "
                "(this server does not implement it)"
            )
    sp = SamplingParams()
    if raw.get("temperature") is not None:
        sp.temperature = float(_want(raw, "temperature", (int, float), "a number >= 0"))
        if sp.temperature < 0:
            raise RequestError(f"{where}.temperature={sp.temperature!r} is not allowed; allowed: a number >= 0")
    if raw.get("top_p") is not None:
        sp.top_p = float(_want(raw, "top_p", (int, float), "a number in (0, 1]"))
        if not 0.0 < sp.top_p <= 1.0:
            raise RequestError(f"{where}.top_p={sp.top_p!r} is not allowed; allowed: a number in (0, 1]")
    if raw.get("top_k") is not None:
        sp.top_k = _want(raw, "top_k", int, "-1 (off) or an integer >= 1")
        if sp.top_k != -1 and sp.top_k < 1:
            raise RequestError(f"{where}.top_k={sp.top_k!r} is not allowed; allowed: -1 (off) or an integer >= 1")
    if raw.get("max_new_tokens") is not None:
        sp.max_new_tokens = _want(raw, "max_new_tokens", int, "an integer >= 0")
        if sp.max_new_tokens < 0:
            raise RequestError(
                f"{where}.max_new_tokens={sp.max_new_tokens!r} is not allowed; allowed: an integer >= 0"
            )
    stop = raw.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise RequestError(f"{where}.stop={raw['stop']!r} is not allowed; allowed: a string or a list of strings")
        sp.stop = list(stop)
    ids = raw.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError(f"{where}.stop_token_ids={ids!r} is not allowed; allowed: a list of token ids")
        sp.stop_token_ids = list(ids)
    if raw.get("ignore_eos") is not None:
        sp.ignore_eos = _want(raw, "ignore_eos", bool, "true or false")
    if raw.get("sampling_seed") is not None:
        sp.seed = _want(raw, "sampling_seed", int, "an integer in [0, 2**64)")
        if not 0 <= sp.seed < 2**64:  # a torch.Generator seed; a larger one raised inside the engine's batch
            raise RequestError(f"{where}.sampling_seed={sp.seed!r} is not allowed; allowed: an integer in [0, 2**64)")
    return sp


def _per_item(value: Any, n: int, name: str, single: bool) -> list[Any]:
    """Broadcast a scalar field over the batch, or check a per-item list's length (SGLang's normalization)."""
    if single or not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise RequestError(f"{name} has {len(value)} entries for a batch of {n} prompts")
    return value


def parse_generate_body(body: dict[str, Any]) -> tuple[list[GenerateRequest], list[bool], bool]:
    """SGLang `/generate` body -> (requests, return_logprob per request, is_single)."""
    if body.get("stream"):
        raise RequestError(
            f"stream={body.get('stream')!r} is not allowed; allowed: false (this server does not stream)"
        )
    if body.get("input_ids") is None:
        if body.get("text") is not None:
            raise RequestError("text prompts are not supported by this server; send input_ids (token ids)")
        raise RequestError("input_ids is required (a list of token ids, or a list of such lists for a batch)")
    ids = body["input_ids"]
    if not isinstance(ids, list) or not ids:
        raise RequestError(f"input_ids={str(ids)[:80]} is not allowed; allowed: a non-empty list of token ids")

    def _check_row(row: Any, where: str) -> list[int]:
        if (
            not isinstance(row, list)
            or not row
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in row)
        ):
            raise RequestError(f"{where}={str(row)[:80]} is not allowed; allowed: a non-empty list of token ids")
        return row

    single = isinstance(ids[0], int)
    rows = [_check_row(ids, "input_ids")] if single else [_check_row(r, f"input_ids[{i}]") for i, r in enumerate(ids)]
    n = len(rows)
    sampling = body.get("sampling_params")
    if isinstance(sampling, list) and single:
        raise RequestError("sampling_params is a list but input_ids is a single prompt")
    sampling_items = _per_item(sampling, n, "sampling_params", single)
    loras = _per_item(body.get("lora_path"), n, "lora_path", single)
    logprob_flags = _per_item(body.get("return_logprob"), n, "return_logprob", single)
    rid = body.get("rid")
    if isinstance(rid, str) and not single:
        rids = [f"{rid}_{i}" for i in range(n)]  # SGLang's expansion of a string rid over a batch
    else:
        rids = _per_item(rid, n, "rid", single)
    for i, r in enumerate(rids):  # SGLang's `rid: str | list[str] | None`; anything else would become a dict key
        if r is not None and not isinstance(r, str):
            where = "rid" if single or not isinstance(rid, list) else f"rid[{i}]"
            raise RequestError(f"{where}={str(r)[:80]} is not allowed; allowed: a string (or a list of them)")
    requests = []
    for i in range(n):
        where = "sampling_params" if single else f"sampling_params[{i}]"
        sp = _sampling_from_dict(sampling_items[i], where)
        lora = _adapter_name(loras[i], "lora_path" if single else f"lora_path[{i}]", base_allowed=True)
        requests.append(GenerateRequest(input_ids=list(rows[i]), adapter=lora, sampling=sp, rid=rids[i]))
    return requests, [bool(f) for f in logprob_flags], single


def _parse_and_check(body: dict[str, Any], context_len: int | None) -> tuple[list[GenerateRequest], list[bool], bool]:
    """`parse_generate_body` plus SGLang's length checks (run in a thread: a body may hold millions of ids)."""
    reqs, logprob_flags, single = parse_generate_body(body)
    raw = _per_item(body.get("sampling_params"), len(reqs), "sampling_params", single)
    for req, sampling in zip(reqs, raw, strict=True):
        explicit = sampling.get("max_new_tokens") if isinstance(sampling, dict) else None
        if (message := context_error(len(req.input_ids), explicit, context_len)) is not None:
            raise SGLangValueError(message)
    return reqs, logprob_flags, single


def _finish_json(result: GenerateResult) -> dict[str, Any]:
    """Our finish reason -> SGLang's `BaseFinishReason.to_json()` shape."""
    if result.finish_reason == "stop":
        return {"type": "stop", "matched": result.output_ids[-1] if result.output_ids else None}
    if result.finish_reason == "length":
        return {"type": "length", "length": len(result.output_ids)}
    if result.finish_reason == "abort":
        # The engine's own reason (e.g. the adapter changed mid-request), or the server's pause abort.
        message = result.error or "aborted by the engine; resubmit the request"
        return {"type": "abort", "message": message, "status_code": None, "err_type": None}
    # An engine-side failure for this row: SGLang reports request errors as an abort with an HTTP status.
    return {
        "type": "abort",
        "message": result.error or "generation failed",
        "status_code": 500,
        "err_type": "InternalServerError",
    }


def _response_item(
    state: ServerState, req: GenerateRequest, result: GenerateResult, rid: str, with_logprob: bool
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": _finish_json(result),
        "prompt_tokens": len(req.input_ids),
        "weight_version": "default" if result.weight_version is None else str(result.weight_version),
        "completion_tokens": len(result.output_ids),
        "cached_tokens": 0,
    }
    if with_logprob:
        # SGLang rows are [logprob, token_id, text]; text is null unless return_text_in_logprobs.
        meta["output_token_logprobs"] = [
            [float(lp), int(t), None] for lp, t in zip(result.output_logprobs, result.output_ids, strict=False)
        ]
    text = ""
    if state.tokenizer is not None and result.output_ids:
        text = state.tokenizer.decode(result.output_ids, skip_special_tokens=True)
    return {"text": text, "output_ids": list(result.output_ids), "meta_info": meta}


# ---------------------------------------------------------------------------------------------- handlers


@web.middleware
async def _auth_middleware(request: web.Request, handler):
    state: ServerState = request.app[STATE_KEY]
    if state.api_key and request.method != "OPTIONS" and not request.path.startswith(_AUTH_EXEMPT_PREFIXES):
        authz = request.headers.get("Authorization", "")
        scheme, _, token = authz.partition(" ")
        ok = scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), state.api_key.encode())
        if not ok:
            return web.json_response({"error": "Unauthorized"}, status=401)
    try:
        return await handler(request)
    except SGLangValueError as exc:
        return _error(str(exc), 400)
    except RequestError as exc:
        return _bad_request(str(exc))


@web.middleware
async def _body_limit_middleware(request: web.Request, handler):
    """413 for a body over the route's limit: at once from Content-Length (the body is discarded, never buffered),
    or when a chunked body crosses it while being read."""
    state: ServerState = request.app[STATE_KEY]
    adapter_push = request.path == "/load_lora_adapter_from_tensors"
    limit = state.max_adapter_body_bytes if adapter_push else state.max_body_bytes
    flag = "--max-adapter-body-mb" if adapter_push else "--max-body-mb"
    size = request.content_length
    if size is None or size <= limit:
        try:
            return await handler(request.clone(client_max_size=limit))
        except web.HTTPRequestEntityTooLarge:
            size = None
    actual = f", actual body size {size}" if size is not None else ""
    message = (
        f"Maximum request body size {limit} exceeded{actual} (the server's limit: engine-serve {flag}, "
        f"{limit / 1024**2:g} MiB)"
    )
    if request.path.startswith("/v1/"):
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
        return web.json_response(body, status=413)
    return _error(message, 413)


async def _generate(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    body = await _json_body(request)
    reqs, logprob_flags, single = await asyncio.to_thread(_parse_and_check, body, state.context_length)
    rids = [r.rid or uuid.uuid4().hex for r in reqs]
    await state.running.wait()  # requests that arrive during a pause wait for /continue_generation
    if state.closing:
        return _error(SHUTDOWN_MESSAGE, 503)
    aborted = asyncio.Event()
    state.inflight.add(aborted)
    task = asyncio.ensure_future(state.engine.agenerate(reqs))
    abort_wait = asyncio.ensure_future(aborted.wait())
    try:
        await asyncio.wait({task, abort_wait}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()  # the client went away: nobody will read these rows
        raise
    finally:
        state.inflight.discard(aborted)
        abort_wait.cancel()
    if not task.done():
        # Aborted by /pause_generation: SGLang answers at once. Cancelling lets an engine whose agenerate
        # supports it (EmbeddedEngine) drop the rows; a thread-backed one finishes and its result is dropped.
        task.cancel()
        state.orphans.add(task)
        task.add_done_callback(_forget_orphan(state))
        message = SHUTDOWN_MESSAGE if state.closing else _PAUSE_ABORT_MESSAGE
        results = [GenerateResult(finish_reason="abort", error=message) for _ in reqs]
    else:
        try:
            results = task.result()
        except (ValueError, KeyError) as exc:
            return _error(f"Invalid request: {exc}", 400)
        except Exception as exc:
            logger.exception("engine.agenerate failed")
            return _error(f"{type(exc).__name__}: {exc}", 500)
        if len(results) != len(reqs):
            return _error(f"engine returned {len(results)} results for {len(reqs)} requests", 500)
        # The engine's request checks (a prompt longer than the context, a bad token id) answer in the
        # "X is not allowed; allowed: Y" grammar: the request's fault, which SGLang answers with a 400.
        invalid = [
            r.error for r in results if r.finish_reason == "error" and " is not allowed; allowed: " in (r.error or "")
        ]
        if invalid:
            return _bad_request(invalid[0])
    items = [
        _response_item(state, q, r, rid, flag)
        for q, r, rid, flag in zip(reqs, results, rids, logprob_flags, strict=True)
    ]
    return web.json_response(items[0] if single else items)


def _forget_orphan(state: ServerState):
    def _done(task: asyncio.Task) -> None:
        state.orphans.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("aborted engine call ended with %r", task.exception())

    return _done


def _version_header(request: web.Request) -> int | None:
    raw = request.headers.get(ADAPTER_VERSION_HEADER)
    if raw is None:
        return None
    try:
        version = int(raw)
    except ValueError:
        raise RequestError(
            f"{ADAPTER_VERSION_HEADER}={raw!r} is not allowed; allowed: a non-negative integer"
        ) from None
    if not 0 <= version < 2**63:  # the version is an int64 wherever it travels on (metrics, the journal, a tensor)
        raise RequestError(
            f"{ADAPTER_VERSION_HEADER}={raw[:40]!r} is not allowed; allowed: a non-negative integer below 2**63"
        )
    return version


async def _load_tensors(
    state: ServerState, name: str, tensors: dict, config: dict, version: int | None
) -> web.Response:
    kinds = [k for k, t in tensors.items() if not t.is_floating_point()]
    if kinds:  # an int or bool tensor would be cast to the slot's float dtype without a word
        dtype = str(tensors[kinds[0]].dtype).removeprefix("torch.")
        return _lora_response(
            state, False, f"Failed to load LoRA adapter {name}: {kinds[0]} is {dtype}; allowed: a floating-point dtype"
        )
    bad = [k for k, t in tensors.items() if t.is_floating_point() and not bool(t.isfinite().all())]
    if bad:  # sampling from it would raise inside a shared batch: refused here, before the engine sees it
        return _lora_response(state, False, f"Failed to load LoRA adapter {name}: {bad[0]} holds NaN or inf values")
    try:
        check_lora_config(config, allow_target_parameters=True)  # expert LoRA: the engine's model checks it
        await asyncio.to_thread(state.engine.load_adapter, name, tensors, config, version)
    except (ValueError, KeyError, RuntimeError) as exc:
        return _lora_response(state, False, f"Failed to load LoRA adapter {name}: {exc}")
    return _lora_response(state, True)


async def _load_lora_adapter_from_tensors(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    body = await _json_body(request, ("lora_name", "config_dict"))
    name = _adapter_name(body["lora_name"], "lora_name")
    config = _want(body, "config_dict", dict, "the PEFT adapter_config as a JSON object")
    load_format = body.get("load_format")
    if load_format != SAFETENSORS_LOAD_FORMAT:
        raise RequestError(
            f"load_format={load_format!r} is not allowed; allowed: 'safetensors' (base64 safetensors bytes in "
            "serialized_named_tensors). SGLang's default encoding is pickle, and unpickling request data can run "
            "arbitrary code, so it is never unpickled here."
        )
    if body.get("added_tokens_config"):
        raise RequestError(
            f"added_tokens_config={body['added_tokens_config']!r} is not allowed; allowed: null (not supported here)"
        )
    blobs = body.get("serialized_named_tensors")
    if blobs is None and isinstance(body.get("serialized_tensors"), str):
        blobs = [body["serialized_tensors"]]  # SGLang releases before the msgspec rewrite
    if not isinstance(blobs, list) or not blobs or not all(isinstance(b, str) for b in blobs):
        raise RequestError("serialized_named_tensors is required: a list of base64 safetensors strings")
    try:
        tensors = decode_tensors_safetensors(blobs[0])
    except ValueError as exc:
        raise RequestError(f"serialized_named_tensors[0]: {exc}") from exc
    return await _load_tensors(state, name, tensors, config, _version_header(request))


async def _load_lora_adapter(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    body = await _json_body(request, ("lora_name", "lora_path"))
    name = _adapter_name(body["lora_name"], "lora_name")
    folder = Path(_want(body, "lora_path", str, "a PEFT adapter folder on the server's host"))
    if state.adapter_root is not None and not folder.resolve().is_relative_to(state.adapter_root):
        raise RequestError(
            f"lora_path={str(folder)!r} is not allowed; allowed: a folder inside the server's --adapter-root "
            f"{str(state.adapter_root)!r}"
        )
    if not (folder / CONFIG_NAME).is_file() or not (folder / WEIGHTS_NAME).is_file():
        raise RequestError(
            f"lora_path={str(folder)!r} is not allowed; allowed: a PEFT folder on this host (with {CONFIG_NAME} "
            f"and {WEIGHTS_NAME})"
        )
    try:  # the one adapter-folder loader: safetensors only, no links out, a LoRA config, finite tensors
        tensors, config = await asyncio.to_thread(read_peft_folder, folder)
    except (OSError, ValueError) as exc:  # as a failed load in SGLang: LoRAUpdateOutput, naming the adapter
        return _lora_response(state, False, f"Failed to load LoRA adapter {name}: lora_path={str(folder)!r}: {exc}")
    return await _load_tensors(state, name, tensors, config, _version_header(request))


async def _unload_lora_adapter(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    body = await _json_body(request, ("lora_name",))
    name = _adapter_name(body["lora_name"], "lora_name")
    if name not in state.engine.adapter_versions():
        return _lora_response(state, False, f"LoRA adapter {name} is not loaded")
    try:
        await asyncio.to_thread(state.engine.unload_adapter, name)
    except (ValueError, KeyError, RuntimeError) as exc:
        return _lora_response(state, False, f"Failed to unload LoRA adapter {name}: {exc}")
    return _lora_response(state, True)


async def _pause_generation(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    body = await _json_body(request)
    mode = body.get("mode", "abort")
    if mode != "abort":
        if mode in ("retract", "in_place"):
            raise RequestError(
                f"mode={mode!r} is not allowed; allowed: 'abort' (unloading an adapter while paused in 'retract' or "
                "'in_place' mode deadlocks SGLang, so the weight sync never uses them)"
            )
        raise RequestError(
            f"mode={mode!r} is not allowed; allowed: 'abort' (SGLang's modes are 'abort', 'retract', 'in_place'; "
            "this server implements 'abort')"
        )
    state.running.clear()
    for event in list(state.inflight):
        event.set()
    await asyncio.to_thread(state.engine.pause)
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def _continue_generation(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    await _json_body(request)
    await asyncio.to_thread(state.engine.resume)
    state.running.set()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def _flush_cache(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    flush = getattr(state.engine, "flush_cache", None)
    ok = True
    if callable(flush):
        ok = await asyncio.to_thread(flush) is not False
    return web.Response(text=_FLUSH_TEXT, status=200) if ok else web.Response(text=_FLUSH_FAILED_TEXT, status=400)


async def _health(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    healthy = await asyncio.to_thread(state.engine.health)
    return web.Response(status=200 if healthy else 503)


async def _health_generate(request: web.Request) -> web.Response:
    """SGLang's deep check: generate one token on the base model (skipped while paused, as no step can run)."""
    state: ServerState = request.app[STATE_KEY]
    if not state.running.is_set():
        return await _health(request)
    probe = GenerateRequest(input_ids=[0], sampling=SamplingParams(temperature=0.0, max_new_tokens=1))
    try:
        results = await asyncio.wait_for(state.engine.agenerate([probe]), timeout=20)
    except Exception as exc:
        logger.warning("health_generate failed: %r", exc)
        return web.Response(status=503)
    return web.Response(status=200 if results and results[0].finish_reason != "error" else 503)


async def _get_model_info(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    return web.json_response(
        {
            "model_path": state.model_name,
            "tokenizer_path": state.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "adapter_versions": state.engine.adapter_versions(),
        }
    )


# ---------------------------------------------------------------------------------------------- app + run


def _to_the_end(handler):
    """`handler`, run to its end even when its client goes away (the server cancels the handlers of clients that do):
    a pause or load half done would leave the server's state and the engine's apart."""

    async def shielded(request: web.Request) -> web.StreamResponse:
        return await asyncio.shield(handler(request))

    return shielded


def make_app(
    engine: RolloutEngine,
    api_key: str | None = None,
    model_name: str = "rl-multilora",
    tokenizer: Any = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_adapter_body_bytes: int = DEFAULT_MAX_ADAPTER_BODY_BYTES,
    adapter_root: str | Path | None = None,
) -> web.Application:
    """The aiohttp app. `tokenizer` (optional, with `.decode`) fills the `text` field of responses.
    `max_body_bytes`: a larger body is refused with 413, unread; `max_adapter_body_bytes` is that limit for
    `/load_lora_adapter_from_tensors` (adapter tensor pushes are the big bodies). `adapter_root`: when given,
    `/load_lora_adapter` reads only folders inside it (links resolved first); else any folder on the host, as
    SGLang's route does."""
    if not isinstance(engine, RolloutEngine):
        raise TypeError(f"engine must be a RolloutEngine, got {type(engine).__name__}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be a non-empty string or None")
    for key, value in (("max_body_bytes", max_body_bytes), ("max_adapter_body_bytes", max_adapter_body_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r} is not allowed; allowed: a positive number of bytes")
    root = None
    if adapter_root is not None:
        root = Path(adapter_root).expanduser().resolve()
        if not root.is_dir():
            raise ValueError(f"adapter_root={str(adapter_root)!r} is not allowed; allowed: an existing folder")
    # Auth first: a request without the key is answered before its body is read. The body limit is per route.
    app = web.Application(middlewares=[_auth_middleware, _body_limit_middleware])

    async def _on_startup(app: web.Application) -> None:
        # Events must be created on the serving loop.
        state = ServerState(
            engine=engine,
            api_key=api_key,
            model_name=model_name,
            tokenizer=tokenizer,
            max_body_bytes=max_body_bytes,
            max_adapter_body_bytes=max_adapter_body_bytes,
            adapter_root=root,
        )
        state.running.set()
        app[STATE_KEY] = state

    async def _on_shutdown(app: web.Application) -> None:
        # Before aiohttp waits for the handlers: requests parked by a pause and those in flight answer at once
        # (503 / abort) instead of holding the exit for aiohttp's two 60 s waits with no answer
        state = app[STATE_KEY]
        state.closing = True
        state.running.set()
        for aborted in list(state.inflight):
            aborted.set()

    app.on_startup.append(_on_startup)
    app.on_shutdown.append(_on_shutdown)
    app.router.add_route("POST", "/generate", _generate)
    app.router.add_route("PUT", "/generate", _generate)
    # Control routes change the server's state: one whose client gives up (a timeout) still runs to its end (the
    # handlers are cancelled when a client goes away, for /generate's sake)
    app.router.add_post("/load_lora_adapter_from_tensors", _to_the_end(_load_lora_adapter_from_tensors))
    app.router.add_post("/load_lora_adapter", _to_the_end(_load_lora_adapter))
    app.router.add_post("/unload_lora_adapter", _to_the_end(_unload_lora_adapter))
    app.router.add_post("/pause_generation", _to_the_end(_pause_generation))
    app.router.add_post("/continue_generation", _to_the_end(_continue_generation))
    app.router.add_route("GET", "/flush_cache", _to_the_end(_flush_cache))
    app.router.add_route("POST", "/flush_cache", _to_the_end(_flush_cache))
    app.router.add_get("/health", _health)
    app.router.add_get("/health_generate", _health_generate)
    app.router.add_get("/get_model_info", _get_model_info)
    app.router.add_get("/model_info", _get_model_info)  # SGLang's current name; /get_model_info is deprecated
    add_openai_routes(app)  # /v1/models, /v1/completions, /v1/chat/completions (openai_api.py)
    return app


def serve(
    engine: RolloutEngine,
    host: str = "127.0.0.1",
    port: int = 30000,
    api_key: str | None = None,
    model_name: str = "rl-multilora",
    tokenizer: Any = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_adapter_body_bytes: int = DEFAULT_MAX_ADAPTER_BODY_BYTES,
    adapter_root: str | Path | None = None,
) -> None:
    """Serve `engine` until interrupted. Binds 127.0.0.1 unless told otherwise."""
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        logger.warning("serving on %s without an api_key: anyone who can reach it can load adapters", host)
    app = make_app(engine, api_key, model_name, tokenizer, max_body_bytes, max_adapter_body_bytes, adapter_root)
    # handler_cancellation: a client that goes away cancels its handler, so its rows stop at the next decode step
    # (aiohttp's default kept generating every abandoned row to the end: a retrying client tripled the work)
    web.run_app(app, host=host, port=port, print=None, handler_cancellation=True, shutdown_timeout=10)


class BackgroundServer:
    """Runs `make_app(...)` on its own event loop in a daemon thread (tests, in-process serving).

    `port=0` picks a free ephemeral port; `url` is valid after `start()`.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        model_name: str = "rl-multilora",
        tokenizer: Any = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_adapter_body_bytes: int = DEFAULT_MAX_ADAPTER_BODY_BYTES,
        adapter_root: str | Path | None = None,
    ) -> None:
        self.app = make_app(
            engine, api_key, model_name, tokenizer, max_body_bytes, max_adapter_body_bytes, adapter_root
        )
        self.host, self.port = host, port
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="rl-multilora-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout)
            self._runner = None
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
