"""SGLang client engine (`SGLangEngine`) and a launcher for a local SGLang server (`SGLangLauncher`).

The client speaks SGLang's native HTTP API (the payloads are checked against fields recorded from SGLang's
source in `tests/fixtures/sglang_api.json`), so it drives a real `sglang.launch_server --enable-lora` as well
as our own server around any `RolloutEngine` (`rollout/engines/http_server.py`).

Design choices:
- One HTTP request per `GenerateRequest`, sent concurrently with aiohttp (bounded by `max_concurrency`).
  Batching one big `/generate` list would make one slow or aborted row hold back every other row; SGLang's
  scheduler batches concurrent requests anyway.
- A request for an adapter always carries `lora_path=<name>`: SGLang runs a request without it on the base
  model without complaint (Miles #2075), so the client refuses to build such a payload. Base rows omit it.
- Weight sync uses `pause_generation(mode="abort")`. Unloading an adapter while paused in `retract` or
  `in_place` mode waits forever for requests that cannot finish; in `abort` mode in-flight requests come back
  with finish_reason "abort" and the caller (GenerateState) resubmits them. The other way out is versioned
  names (`name@v7`: load the new version under a new name, switch requests to it, unload the old one when
  drained); it avoids aborts but doubles adapter memory during the switch and is not implemented here.
- SGLang refuses to load a name that is already loaded, so a reload unloads first. Scaling in SGLang is always
  `lora_alpha / r`: configs with `use_rslora: true` (and DoRA, which SGLang does not implement) are rejected
  instead of being served with the wrong scale.
- Versions are tracked client side, per adapter: SGLang's `meta_info.weight_version` is one server-wide string
  for the base weights, not per adapter. A result is stamped with the adapter's version at send time; if the
  adapter changed while the request was in flight and the result did not come back aborted, the client cannot
  tell which weights produced it, so it reports it as "abort" (resubmit) rather than risk a mix (ART #661).
  While paused the client holds new requests, so this only costs a resubmit in the rare race.
- `/flush_cache` runs before `/continue_generation` when adapters changed during the pause: SGLang keys its
  radix cache by adapter id, but flushing once per sync is cheap and rules out stale prefix blocks
  (vLLM #42125, ART #661). After an abort-mode pause nothing is running, so the flush succeeds.
- Loading from memory has two encodings (`tensor_format`): "sglang" is SGLang's own MultiprocessingSerializer
  format (torch's ForkingPickler: pickle, with tensors passed as shared-memory / CUDA IPC handles). It only works
  when the server runs on the same host, and the server unpickles it, so use it only with a trusted server.
  "safetensors" sends base64 safetensors bytes with `load_format="safetensors"`; our own server accepts only
  that and never unpickles. A real SGLang server does not understand it.
- `sglang` is an optional extra: nothing here imports it; the launcher only runs it as a subprocess.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import aiohttp
import requests
import torch
import torch.multiprocessing as torch_mp  # also registers torch's tensor reductions on ForkingPickler
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from rollout.engines.base import RolloutEngine
from rollout.types import GenerateRequest, GenerateResult, SamplingParams

logger = logging.getLogger(__name__)

TENSOR_FORMATS = ("sglang", "safetensors")
# `load_format` value that marks base64 safetensors bytes in `serialized_named_tensors` (our server's format).
SAFETENSORS_LOAD_FORMAT = "safetensors"
# Header carrying the adapter version to our server; SGLang's request structs have no version field and a real
# SGLang server ignores unknown headers.
ADAPTER_VERSION_HEADER = "X-Adapter-Version"
# SGLang finish_reason.type -> our GenerateResult.finish_reason.
_FINISH_TYPES = {"stop": "stop", "length": "length", "abort": "abort"}


class SGLangError(RuntimeError):
    """An SGLang control call (load, unload, pause, resume, flush) failed."""


# ----------------------------------------------------------------------------------------------- payloads


def check_lora_config(config: dict[str, Any]) -> None:
    """Reject PEFT LoRA configs that SGLang would serve with the wrong math.

    >>> check_lora_config({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]})
    >>> check_lora_config({"r": 8, "lora_alpha": 16, "use_rslora": True})
    Traceback (most recent call last):
    ...
    ValueError: config.use_rslora=True is not supported: SGLang always scales LoRA by lora_alpha / r (rsLoRA's lora_alpha / sqrt(r) would be ignored); train with use_rslora=False
    """
    if not isinstance(config, dict):
        raise ValueError(f"config must be a PEFT LoRA config dict, got {type(config).__name__}")
    if config.get("use_rslora"):
        raise ValueError(
            f"config.use_rslora={config['use_rslora']!r} is not supported: SGLang always scales LoRA by "
            "lora_alpha / r (rsLoRA's lora_alpha / sqrt(r) would be ignored); train with use_rslora=False"
        )
    if config.get("use_dora"):
        raise ValueError(f"config.use_dora={config['use_dora']!r} is not supported: SGLang does not implement DoRA")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"config.peft_type={peft_type!r} is not supported; only 'LORA' adapters can be served")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"config.{key}={value!r} is invalid; a positive number is required")


# SGLang fuses these projections when it loads an adapter (q/k/v -> qkv_proj, gate/up -> gate_up_proj). Its loader
# (sglang 0.5.23, `LoRAAdapter.normalize_qkv_proj` / `normalize_gate_up_proj`) needs q_proj and v_proj whenever a
# layer has any of q/k/v (it fails with a KeyError on q without v, and drops k or v without q), and gate_proj
# whenever the layer has up_proj (an up_proj alone is dropped).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def complete_fused_groups(
    tensors: dict[str, torch.Tensor], config: dict[str, Any], module_shapes: dict[str, tuple[int, int]]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Add exact-zero LoRA factors for the missing members of every fused group the adapter touches.

    A zero A and zero B add nothing to the output, so SGLang then serves exactly the trained adapter. Keys are
    PEFT names (`base_model.model.<module>.lora_A.weight`); `module_shapes` maps module -> (in, out) features.
    Returns new (tensors, config); the inputs are not modified.

    >>> shapes = {"l.q_proj": (4, 4), "l.k_proj": (4, 2), "l.v_proj": (4, 2)}
    >>> t = {"base_model.model.l.q_proj.lora_A.weight": torch.ones(2, 4),
    ...      "base_model.model.l.q_proj.lora_B.weight": torch.ones(4, 2)}
    >>> out, cfg = complete_fused_groups(t, {"r": 2, "target_modules": ["q_proj"]}, shapes)
    >>> sorted((k.split(".")[3], k.split(".")[4], tuple(v.shape)) for k, v in out.items())[4:]
    [('v_proj', 'lora_A', (2, 4)), ('v_proj', 'lora_B', (2, 2))]
    >>> cfg["target_modules"], float(out["base_model.model.l.v_proj.lora_B.weight"].abs().sum())
    (['k_proj', 'q_proj', 'v_proj'], 0.0)
    """
    prefix, suffix_a, suffix_b = "base_model.model.", ".lora_A.weight", ".lora_B.weight"
    present = {k[len(prefix) : -len(suffix_a)]: k for k in tensors if k.startswith(prefix) and k.endswith(suffix_a)}
    out, added = dict(tensors), []
    for module, key_a in present.items():
        parent, leaf = module.rsplit(".", 1) if "." in module else ("", module)
        for group in FUSED_GROUPS:
            if leaf not in group:
                continue
            a = tensors[key_a]
            for sibling in group:
                name = f"{parent}.{sibling}" if parent else sibling
                if f"{prefix}{name}{suffix_a}" in out:  # trained, or filled for an earlier member
                    continue
                if name not in module_shapes:
                    raise ValueError(
                        f"adapter targets {module!r} but not {name!r}, which SGLang loads together with it, and the "
                        f"model has no LoRA module {name!r} to fill with zeros; add {sibling!r} to "
                        "model.target_modules"
                    )
                in_features, out_features = module_shapes[name]
                out[f"{prefix}{name}{suffix_a}"] = a.new_zeros(a.shape[0], in_features)
                out[f"{prefix}{name}{suffix_b}"] = a.new_zeros(out_features, a.shape[0])
                added.append(name)
    config = dict(config)
    targets = config.get("target_modules")
    if added and isinstance(targets, list):
        leaves_only = all("." not in t for t in targets)
        config["target_modules"] = sorted(set(targets) | {n.rsplit(".", 1)[-1] if leaves_only else n for n in added})
    return out, config


def sampling_params_payload(sp: SamplingParams) -> dict[str, Any]:
    """SGLang `sampling_params` for our `SamplingParams` (empty stop lists and a None seed are left out)."""
    payload: dict[str, Any] = {
        "temperature": float(sp.temperature),
        "top_p": float(sp.top_p),
        "top_k": int(sp.top_k),
        "max_new_tokens": int(sp.max_new_tokens),
    }
    if sp.stop:
        payload["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        payload["stop_token_ids"] = [int(t) for t in sp.stop_token_ids]
    if sp.seed is not None:
        payload["sampling_seed"] = int(sp.seed)
    return payload


def generate_payload(request: GenerateRequest) -> dict[str, Any]:
    """The `/generate` body for one request; an adapter request always names its adapter in `lora_path`."""
    if not request.input_ids:
        raise ValueError("GenerateRequest.input_ids is empty; SGLang rejects an empty prompt")
    if request.adapter is not None and (not isinstance(request.adapter, str) or not request.adapter):
        raise ValueError(
            f"GenerateRequest.adapter={request.adapter!r} is invalid: use a non-empty adapter name, or None for "
            "the base model"
        )
    payload: dict[str, Any] = {
        "input_ids": [int(t) for t in request.input_ids],
        "sampling_params": sampling_params_payload(request.sampling),
        "return_logprob": True,
    }
    if request.rid is not None:
        payload["rid"] = str(request.rid)
    if request.adapter is not None:
        payload["lora_path"] = request.adapter
    # Guard against a refactor dropping the name: SGLang would silently serve such a request on the base model.
    if request.adapter is not None and payload.get("lora_path") != request.adapter:
        raise AssertionError(f"refusing to send a request for adapter {request.adapter!r} without its lora_path")
    return payload


@dataclass
class ParsedGenerate:
    """The parts of one SGLang `/generate` response object that we use."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str
    error: str | None = None
    weight_version: str | None = None


def parse_finish_reason(finish: Any) -> tuple[str, str | None]:
    """Map SGLang's `meta_info.finish_reason` to (our finish reason, error message).

    An abort with an HTTP-style `status_code` is SGLang rejecting the request (bad input), not a pause: it is
    reported as "error" so that it is not resubmitted forever.

    >>> parse_finish_reason({"type": "length", "length": 3})
    ('length', None)
    >>> parse_finish_reason({"type": "abort", "message": "Abort all", "status_code": None})
    ('abort', None)
    >>> parse_finish_reason({"type": "abort", "message": "too long", "status_code": 400})
    ('error', 'too long')
    """
    if finish is None:
        return "error", "SGLang returned no finish_reason (request not finished)"
    if not isinstance(finish, dict) or "type" not in finish:
        return "error", f"unexpected finish_reason {finish!r}"
    kind = finish["type"]
    if kind == "abort" and finish.get("status_code") is not None and int(finish["status_code"]) >= 400:
        return "error", str(finish.get("message") or f"aborted with status {finish['status_code']}")
    if kind not in _FINISH_TYPES:
        return "error", f"unknown finish_reason type {kind!r}: {finish.get('message', '')}"
    return _FINISH_TYPES[kind], None


def parse_generate_response(body: Any) -> ParsedGenerate:
    """Parse one non-streaming `/generate` response object (`text`, `output_ids`, `meta_info`)."""
    if not isinstance(body, dict) or "meta_info" not in body:
        raise ValueError(f"unexpected /generate response (no meta_info): {str(body)[:200]}")
    meta = body["meta_info"]
    finish, error = parse_finish_reason(meta.get("finish_reason"))
    # output_token_logprobs rows are [logprob, token_id, text-or-null].
    rows = meta.get("output_token_logprobs") or []
    logprobs = [float(row[0]) if row[0] is not None else float("nan") for row in rows]
    if body.get("output_ids") is not None:
        output_ids = [int(t) for t in body["output_ids"]]
    else:
        output_ids = [int(row[1]) for row in rows]
    if finish in ("stop", "length") and len(logprobs) != len(output_ids):
        raise ValueError(
            f"/generate response {meta.get('id')!r} has {len(output_ids)} output ids but {len(logprobs)} logprobs"
        )
    version = meta.get("weight_version")
    return ParsedGenerate(output_ids, logprobs, finish, error, None if version is None else str(version))


def encode_tensors_safetensors(tensors: dict[str, torch.Tensor]) -> str:
    """Base64 safetensors bytes of `tensors` (what our server accepts; no pickle involved)."""
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    return base64.b64encode(safetensors_save(cpu)).decode("ascii")


def decode_tensors_safetensors(data: str) -> dict[str, torch.Tensor]:
    """Inverse of `encode_tensors_safetensors`; raises ValueError on anything that is not safetensors."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"serialized tensors are not valid base64: {exc}") from exc
    try:
        return safetensors_load(raw)
    except Exception as exc:  # safetensors raises its own SafetensorError type
        raise ValueError(f"serialized tensors are not safetensors bytes: {exc}") from exc


_SHARING_LOCK = threading.Lock()


def encode_tensors_sglang(tensors: dict[str, torch.Tensor]) -> str:
    """SGLang's MultiprocessingSerializer encoding: base64 of torch's ForkingPickler dump of the dict.

    This is pickle. Tensors travel as shared-memory (CPU) or CUDA IPC handles, so the server must run on this
    host and must trust this process, and the tensors must stay alive until the server has loaded them (pass
    contiguous snapshots, as `SGLangEngine.load_adapter` does). It mirrors SGLang's format without importing
    sglang. CPU tensors are shared by file name (torch's "file_system" strategy, switched on only for this dump):
    the default "file_descriptor" strategy hands fds over a socket that only processes of our own
    multiprocessing tree may open, and the server is not one of them.
    """
    buf = io.BytesIO()
    with _SHARING_LOCK:
        previous = torch_mp.get_sharing_strategy()
        torch_mp.set_sharing_strategy("file_system")
        try:
            ForkingPickler(buf).dump(dict(tensors))
        finally:
            torch_mp.set_sharing_strategy(previous)
    return base64.b64encode(buf.getvalue()).decode("ascii")


# ------------------------------------------------------------------------------------------------- engine


class SGLangEngine(RolloutEngine):
    """`RolloutEngine` over SGLang's HTTP API (a real SGLang server or our `http_server`).

    `tensor_format` picks how `load_adapter` ships tensors ("sglang": SGLang's pickled same-host encoding;
    "safetensors": base64 safetensors for our server). `tp_size` is the server's tensor-parallel size: SGLang
    wants one serialized copy per TP rank. `api_key` is sent as `Authorization: Bearer <key>`. `module_shapes`
    (the trainer model's LoRA module -> (in, out) features) lets `load_adapter` complete SGLang's fused groups with
    zero factors (`complete_fused_groups`), so adapters on a subset such as q_proj alone load correctly.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float = 600.0,
        tensor_format: str = "sglang",
        tp_size: int = 1,
        max_concurrency: int = 256,
        flush_cache_on_resume: bool = True,
        module_shapes: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url={base_url!r} is invalid; expected 'http://host:port'")
        if tensor_format not in TENSOR_FORMATS:
            raise ValueError(f"tensor_format={tensor_format!r} is invalid; allowed: {', '.join(TENSOR_FORMATS)}")
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size={tp_size!r} is invalid; a positive integer is required")
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency!r} is invalid; a positive integer is required")
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout={timeout!r} is invalid; a positive number of seconds is required")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = float(timeout)
        self.tensor_format = tensor_format
        self.tp_size = tp_size
        self.max_concurrency = max_concurrency
        self.flush_cache_on_resume = flush_cache_on_resume
        self.module_shapes = dict(module_shapes) if module_shapes is not None else None
        self._lock = threading.Lock()
        self._versions: dict[str, int] = {}
        # Last version ever given to a name, so a name that is unloaded and loaded again never reuses a version.
        self._last_version: dict[str, int] = {}
        # Bumped on every load or unload of a name (versions given by the caller may repeat; this cannot).
        self._changes: dict[str, int] = {}
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._changed_while_paused = False
        self._http = requests.Session()

    # -- plumbing

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _post(self, path: str, body: dict[str, Any] | None, extra_headers: dict[str, str] | None = None) -> Any:
        headers = {**self._headers(), **(extra_headers or {})}
        resp = self._http.post(self.base_url + path, json=body, headers=headers, timeout=self.timeout)
        return self._check(path, resp)

    def _check(self, path: str, resp: requests.Response) -> Any:
        try:
            payload = resp.json()
        except ValueError:
            payload = resp.text
        if resp.status_code in (401, 403):
            raise SGLangError(f"{path}: {resp.status_code} {payload}; check api_key")
        if resp.status_code != 200:
            raise SGLangError(f"{path} failed with HTTP {resp.status_code}: {payload}")
        if isinstance(payload, dict) and payload.get("success") is False:
            raise SGLangError(f"{path} failed: {payload.get('error_message') or payload}")
        return payload

    def _next_version(self, name: str, version: int | None) -> int:
        if version is None:
            return self._last_version.get(name, 0) + 1
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version={version!r} is invalid; a non-negative integer is required")
        return version

    # -- generation

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.agenerate(requests))
        raise RuntimeError("SGLangEngine.generate() was called inside a running event loop; await agenerate()")

    async def agenerate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        # Build every payload first so one bad request fails the call before anything is sent.
        payloads = [generate_payload(r) for r in requests]
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        limit = asyncio.Semaphore(self.max_concurrency)
        async with aiohttp.ClientSession(headers=self._headers(), timeout=timeout) as session:
            results = await asyncio.gather(
                *(self._generate_one(session, limit, r, p) for r, p in zip(requests, payloads, strict=True))
            )
        return list(results)

    async def _generate_one(
        self, session: aiohttp.ClientSession, limit: asyncio.Semaphore, request: GenerateRequest, payload: dict
    ) -> GenerateResult:
        async with limit:
            # Hold new requests while a sync is in progress (polling: pause() runs on another thread).
            while not self._unpaused.is_set():
                await asyncio.sleep(0.005)
            with self._lock:
                sent_version = self._versions.get(request.adapter) if request.adapter is not None else None
                sent_change = self._changes.get(request.adapter, 0) if request.adapter is not None else 0
            try:
                async with session.post(self.base_url + "/generate", json=payload) as resp:
                    status = resp.status
                    text = await resp.text()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                return GenerateResult(finish_reason="error", error=f"/generate failed: {type(exc).__name__}: {exc}")
        if status in (401, 403):
            raise SGLangError(f"/generate: HTTP {status} {text[:200]}; check api_key")
        try:
            body = json.loads(text)
        except ValueError:
            body = text
        if status != 200:
            return GenerateResult(finish_reason="error", error=f"/generate HTTP {status}: {_error_message(body)}")
        try:
            parsed = parse_generate_response(body)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            return GenerateResult(finish_reason="error", error=str(exc))
        if request.adapter is None:
            return GenerateResult(parsed.output_ids, parsed.output_logprobs, parsed.finish_reason, None, parsed.error)
        with self._lock:
            changed = self._changes.get(request.adapter, 0) != sent_change
        if parsed.finish_reason in ("stop", "length") and changed:
            # The adapter changed while this request was in flight: we cannot tell which weights produced it.
            return GenerateResult(finish_reason="abort", weight_version=sent_version)
        version = sent_version if sent_version is not None else _int_or_none(parsed.weight_version)
        return GenerateResult(parsed.output_ids, parsed.output_logprobs, parsed.finish_reason, version, parsed.error)

    # -- adapters

    def load_adapter(
        self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any], version: int | None = None
    ) -> int:
        """Push adapter `name` from memory; a loaded name is unloaded first (SGLang cannot reload in place)."""
        _check_name(name)
        check_lora_config(config)
        if not tensors:
            raise ValueError(f"tensors for adapter {name!r} are empty; expected PEFT-named lora_A/lora_B tensors")
        new_version = self._next_version(name, version)
        if self.module_shapes is not None:
            tensors, config = complete_fused_groups(tensors, config, self.module_shapes)
        body: dict[str, Any] = {"lora_name": name, "config_dict": config}
        if self.tensor_format == "sglang":
            # A snapshot the server reads through shared-memory / CUDA IPC handles: the caller's tensors (live
            # trainer parameters) are neither moved to shared memory nor read after a later optimizer step.
            # It must stay alive until the server has loaded it, i.e. until the POST below returns.
            snapshot = {k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}
            # One entry per TP rank, as SGLang expects (each rank deserializes its own).
            body["serialized_named_tensors"] = [encode_tensors_sglang(snapshot) for _ in range(self.tp_size)]
        else:
            snapshot = None
            body["load_format"] = SAFETENSORS_LOAD_FORMAT
            body["serialized_named_tensors"] = [encode_tensors_safetensors(tensors)] * self.tp_size
        self._replace(name)
        self._post("/load_lora_adapter_from_tensors", body, {ADAPTER_VERSION_HEADER: str(new_version)})
        del snapshot  # the server has its copy now
        self._record(name, new_version)
        return new_version

    def load_adapter_from_path(self, name: str, path: str, version: int | None = None, pinned: bool = False) -> int:
        """Load adapter `name` from a PEFT folder that the server can read (`/load_lora_adapter`)."""
        _check_name(name)
        config_file = Path(path) / "adapter_config.json"
        # The folder may only exist on the server's host; check its config here when we can read it.
        if config_file.is_file():
            check_lora_config(json.loads(config_file.read_text()))
        new_version = self._next_version(name, version)
        self._replace(name)
        body = {"lora_name": name, "lora_path": str(path), "pinned": bool(pinned)}
        self._post("/load_lora_adapter", body, {ADAPTER_VERSION_HEADER: str(new_version)})
        self._record(name, new_version)
        return new_version

    def unload_adapter(self, name: str) -> None:
        _check_name(name)
        self._post("/unload_lora_adapter", {"lora_name": name})
        with self._lock:
            self._versions.pop(name, None)
            self._changes[name] = self._changes.get(name, 0) + 1
            self._changed_while_paused = not self._unpaused.is_set() or self._changed_while_paused

    def _replace(self, name: str) -> None:
        with self._lock:
            loaded = name in self._versions
        if loaded:
            self.unload_adapter(name)

    def _record(self, name: str, version: int) -> None:
        with self._lock:
            self._versions[name] = version
            self._changes[name] = self._changes.get(name, 0) + 1
            self._last_version[name] = max(version, self._last_version.get(name, 0))
            self._changed_while_paused = not self._unpaused.is_set() or self._changed_while_paused

    def adapter_versions(self) -> dict[str, int]:
        with self._lock:
            return dict(self._versions)

    # -- sync control

    def pause(self) -> None:
        """`/pause_generation` in abort mode: in-flight requests come back "abort"; new ones wait client side."""
        self._unpaused.clear()
        try:
            self._post("/pause_generation", {"mode": "abort"})
        except Exception:
            self._unpaused.set()
            raise

    def resume(self) -> None:
        """Flush the prefix cache if adapters changed during the pause, then `/continue_generation`."""
        with self._lock:
            changed, self._changed_while_paused = self._changed_while_paused, False
        if changed and self.flush_cache_on_resume:
            self.flush_cache()
        self._post("/continue_generation", {})
        self._unpaused.set()

    def flush_cache(self) -> bool:
        """`/flush_cache`; False (and a warning) when SGLang refuses because requests are still running."""
        resp = self._http.post(self.base_url + "/flush_cache", headers=self._headers(), timeout=self.timeout)
        if resp.status_code in (401, 403):
            raise SGLangError(f"/flush_cache: HTTP {resp.status_code}; check api_key")
        if resp.status_code != 200:
            logger.warning("/flush_cache refused (HTTP %s): %s", resp.status_code, resp.text.strip()[:200])
            return False
        return True

    def server_tp_size(self) -> int | None:
        """The server's tensor-parallel size from SGLang's `/server_info` (None if it does not say)."""
        try:
            resp = self._http.get(
                self.base_url + "/server_info", headers=self._headers(), timeout=min(self.timeout, 30)
            )
            value = resp.json().get("tp_size") if resp.status_code == 200 else None
        except (requests.RequestException, ValueError, AttributeError):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None

    def health(self) -> bool:
        try:
            resp = self._http.get(self.base_url + "/health", headers=self._headers(), timeout=min(self.timeout, 30))
        except requests.RequestException:
            return False
        return resp.status_code == 200

    def close(self) -> None:
        self._http.close()


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"adapter name {name!r} is invalid; a non-empty string is required")


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _error_message(body: Any) -> str:
    """The message of an SGLang error body ({"error": {"message"}} or an OpenAI-style ErrorResponse)."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
        if err is not None:
            return str(err)
    return str(body)[:500]


def tp_size_from_args(args: list[str]) -> int:
    """The tensor-parallel size that `sglang.launch_server` arguments ask for (1 when they do not say).

    >>> tp_size_from_args(["--mem-fraction-static", "0.5", "--tp-size", "4"])
    4
    >>> tp_size_from_args(["--tensor-parallel-size=2"]), tp_size_from_args(["--tp", "8"]), tp_size_from_args([])
    (2, 8, 1)
    """
    flags = ("--tp-size", "--tensor-parallel-size", "--tp")
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in flags:
            raw = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if not raw.isdigit() or int(raw) < 1:
                raise ValueError(f"{name} {raw!r} in the SGLang arguments is invalid; a positive integer is required")
            return int(raw)
    return 1


# ----------------------------------------------------------------------------------------------- launcher


@dataclass
class SGLangLauncher:
    """Starts `python -m sglang.launch_server` with LoRA enabled and waits until it can generate.

    Ready means `/health_generate` answered 200 (the server generated a token), not just that the process is
    alive. If the process dies while starting, `start()` fails at once with the tail of its log. `stop()` sends
    SIGTERM to the server's process group, then SIGKILL after `stop_grace_s`.
    """

    model_path: str
    port: int = 30000
    max_loras_per_batch: int = 8
    max_lora_rank: int = 64
    lora_target_modules: list[str] | str = "all"
    lora_backend: str = "triton"
    extra_args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    api_key: str | None = None
    python: str = sys.executable
    log_path: str | None = None
    startup_timeout_s: float = 900.0
    stop_grace_s: float = 30.0
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _log_file: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError(f"model_path={self.model_path!r} is invalid; a model folder or hub id is required")
        for key in ("port", "max_loras_per_batch", "max_lora_rank"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r} is invalid; a positive integer is required")
        if not isinstance(self.lora_backend, str) or not self.lora_backend:
            raise ValueError(f"lora_backend={self.lora_backend!r} is invalid; e.g. 'triton' or 'csgmv'")
        if not isinstance(self.extra_args, (list, tuple)) or not all(isinstance(a, str) for a in self.extra_args):
            raise ValueError(f"extra_args={self.extra_args!r} is invalid; a list of command-line strings is required")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def tp_size(self) -> int:
        """Tensor-parallel size asked for in `extra_args` (SGLang wants one serialized tensor copy per rank)."""
        return tp_size_from_args(list(self.extra_args))

    def target_modules(self) -> list[str]:
        """`--lora-target-modules` values; PEFT's "all-linear" is SGLang's "all"."""
        mods = [self.lora_target_modules] if isinstance(self.lora_target_modules, str) else self.lora_target_modules
        out = ["all" if m == "all-linear" else m for m in mods]
        if not out or not all(isinstance(m, str) and m for m in out):
            raise ValueError(f"lora_target_modules={self.lora_target_modules!r} is invalid; e.g. 'all' or ['q_proj']")
        return out

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "sglang.launch_server", "--model-path", self.model_path]
        cmd += ["--host", self.host, "--port", str(self.port), "--enable-lora"]
        cmd += ["--max-loras-per-batch", str(self.max_loras_per_batch), "--max-lora-rank", str(self.max_lora_rank)]
        cmd += ["--lora-target-modules", *self.target_modules(), "--lora-backend", self.lora_backend]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd + list(self.extra_args)

    def start(self) -> str:
        """Launch the server, wait until it generates, and return its URL (`attach(url)` gives a client)."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"SGLang server already running (pid {self._proc.pid})")
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix="sglang_", suffix=".log")
            os.close(fd)
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        # A new session makes the server the leader of its own process group, so stop() reaches its workers.
        self._proc = subprocess.Popen(
            self.command(), stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.url

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            code = self._proc.poll() if self._proc is not None else None
            if code is not None:
                raise RuntimeError(f"SGLang server exited with code {code} while starting:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health_generate", timeout=30).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"SGLang server not ready after {self.startup_timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return "(no log)"
        with open(self.log_path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, self.stop_grace_s), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    @staticmethod
    def attach(url: str, api_key: str | None = None, **engine_kwargs: Any) -> SGLangEngine:
        """A client for an already running server; fails unless `/health` answers 200."""
        engine = SGLangEngine(url, api_key=api_key, **engine_kwargs)
        if not engine.health():
            raise RuntimeError(f"no healthy SGLang server at {url} (GET /health did not answer 200)")
        return engine

    def __enter__(self) -> SGLangLauncher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
