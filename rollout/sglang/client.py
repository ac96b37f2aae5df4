"""SGLang client engine (`SGLangEngine`): a `RolloutEngine` over SGLang's native HTTP API.

It drives a real `sglang.launch_server --enable-lora` (started by `sglang_launcher.py` or attached to) as well
as our own server around any `RolloutEngine` (`rollout/server/http_server.py`). The payloads, response parsing
and tensor encodings are in `sglang_protocol.py`.

Design choices:
- One HTTP request per `GenerateRequest`, sent concurrently with aiohttp (bounded by `max_concurrency`).
  Batching one big `/generate` list would make one slow or aborted row hold back every other row; SGLang's
  scheduler batches concurrent requests anyway.
- Weight sync uses `pause_generation(mode="abort")`. Unloading an adapter while paused in `retract` or
  `in_place` mode waits forever for requests that cannot finish; in `abort` mode in-flight requests come back
  with finish_reason "abort" and the caller (GenerateState) resubmits them. The other way out is versioned
  names (`name@v7`: load the new version under a new name, switch requests to it, unload the old one when
  drained); it avoids aborts but doubles adapter memory during the switch and is not implemented here.
- SGLang refuses to load a name that is already loaded, so a reload unloads first; a name the server holds that this
  client did not load (attached to a running server, a load whose answer timed out) is unloaded and loaded again
  on that refusal. A failed control call raises an error naming the URL; `resume` releases the requests held
  client side whatever the server answered, and so does `close`. Adapter names follow
  `rl_multilora.lora.validate_adapter_name`, and configs are checked (`check_lora_config`) before anything is sent.
- Versions are tracked client side, per adapter: SGLang's `meta_info.weight_version` is one server-wide string
  for the base weights, not per adapter. A result is stamped with the adapter's version at send time; if the
  adapter changed while the request was in flight and the result did not come back aborted, the client cannot
  tell which weights produced it, so it reports it as "abort" (resubmit) rather than risk a mix (ART #661).
  While paused the client holds new requests, so this only costs a resubmit in the rare race.
- `/flush_cache` runs before `/continue_generation` when adapters changed during the pause: SGLang keys its
  radix cache by adapter id, but flushing once per sync is cheap and rules out stale prefix blocks
  (vLLM #42125, ART #661). After an abort-mode pause nothing is running, so the flush succeeds.
- Log-probs: SGLang reports those of the distribution it sampled from, softmax(logits / temperature) before
  top-k/top-p (the raw logits' for greedy rows); see `sampling.py` for how the embedded engine's differ.
- Expert LoRA (`target_parameters`): pushed from memory in the 3-D per-expert layout SGLang's FusedMoE LoRA loads
  (`experts_to_sglang`), which needs the model's `expert_shapes`; a model whose experts SGLang cannot serve exactly
  fails when the engine is built, and a PEFT folder with expert LoRA is never handed to SGLang's loader by path.
- `sglang` is an optional extra: nothing here imports it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path
from typing import Any

import aiohttp
import requests
import torch

from rl_multilora.lora import CONFIG_NAME, ExpertShape, validate_adapter_name
from rollout.engines.base import RolloutEngine
from rollout.sglang.protocol import (
    ADAPTER_VERSION_HEADER,
    SAFETENSORS_LOAD_FORMAT,
    TENSOR_FORMATS,
    check_lora_config,
    complete_fused_groups,
    encode_tensors_safetensors,
    encode_tensors_sglang,
    experts_to_sglang,
    generate_payload,
    parse_generate_response,
    sglang_expert_problems,
    sglang_expert_refusal,
)
from rollout.types import GenerateRequest, GenerateResult

logger = logging.getLogger(__name__)


class SGLangError(RuntimeError):
    """An SGLang control call (load, unload, pause, resume, flush) failed."""


# ------------------------------------------------------------------------------------------------- engine


class SGLangEngine(RolloutEngine):
    """`RolloutEngine` over SGLang's HTTP API (a real SGLang server or our `http_server`).

    `tensor_format` picks how `load_adapter` ships tensors ("sglang": SGLang's pickled same-host encoding;
    "safetensors": base64 safetensors for our server). `tp_size` is the server's tensor-parallel size: SGLang
    wants one serialized copy per TP rank. `api_key` is sent as `Authorization: Bearer <key>`. `module_shapes`
    (the trainer model's LoRA module -> (in, out) features) lets `load_adapter` complete SGLang's fused groups with
    zero factors (`complete_fused_groups`), so adapters on a subset such as q_proj alone load correctly.
    `expert_shapes` (the model's, checked by `sglang_expert_shapes(model)`) lets it push expert LoRA
    (`target_parameters`) to SGLang; expert shapes SGLang cannot serve exactly are refused here, at once.
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
        expert_shapes: dict[str, ExpertShape] | None = None,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url={base_url!r} is not allowed; allowed: 'http://host:port' (or https)")
        if tensor_format not in TENSOR_FORMATS:
            raise ValueError(f"tensor_format={tensor_format!r} is not allowed; allowed: {', '.join(TENSOR_FORMATS)}")
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size={tp_size!r} is not allowed; allowed: a positive integer")
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency!r} is not allowed; allowed: a positive integer")
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout={timeout!r} is not allowed; allowed: a positive number of seconds")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = float(timeout)
        self.tensor_format = tensor_format
        self.tp_size = tp_size
        self.max_concurrency = max_concurrency
        self.flush_cache_on_resume = flush_cache_on_resume
        self.module_shapes = dict(module_shapes) if module_shapes is not None else None
        self.expert_shapes = dict(expert_shapes) if expert_shapes is not None else None
        if self.expert_shapes and tensor_format == "sglang":
            problems = sglang_expert_problems(self.expert_shapes)
            if problems:
                raise ValueError(sglang_expert_refusal(problems, f"expert_shapes ({', '.join(self.expert_shapes)})"))
        self._lock = threading.Lock()
        self._versions: dict[str, int] = {}
        # Last version ever given to a name, so a name that is unloaded and loaded again never reuses a version.
        self._last_version: dict[str, int] = {}
        # Bumped on every load or unload of a name (versions given by the caller may repeat; this cannot).
        self._changes: dict[str, int] = {}
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._closed = False
        self._changed_while_paused = False
        self._http = requests.Session()

    # -- plumbing

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _post(self, path: str, body: dict[str, Any] | None, extra_headers: dict[str, str] | None = None) -> Any:
        url, resp = self._send(path, json=body, headers={**self._headers(), **(extra_headers or {})})
        return self._check(url, resp)

    def _send(self, path: str, **kwargs: Any) -> tuple[str, requests.Response]:
        """POST `path` (the URL and the response); a timeout or a refused connection is an SGLangError naming both."""
        url = self.base_url + path
        try:
            return url, self._http.post(url, timeout=self.timeout, **kwargs)
        except requests.RequestException as exc:
            raise SGLangError(f"{url} failed: {type(exc).__name__}: {exc} (timeout={self.timeout:g} s)") from exc

    def _check(self, url: str, resp: requests.Response) -> Any:
        try:
            payload = resp.json()
        except ValueError:
            payload = resp.text
        if resp.status_code in (401, 403):
            raise SGLangError(f"{url}: {resp.status_code} {payload}; check api_key")
        if resp.status_code != 200:
            detail = payload.get("error_message") if isinstance(payload, dict) else None  # LoRAUpdateOutput's
            raise SGLangError(f"{url} failed with HTTP {resp.status_code}: {detail or _error_message(payload)}")
        if isinstance(payload, dict) and payload.get("success") is False:
            raise SGLangError(f"{url} failed: {payload.get('error_message') or payload}")
        return payload

    def _next_version(self, name: str, version: int | None) -> int:
        if version is None:
            return self._last_version.get(name, 0) + 1
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version={version!r} is not allowed; allowed: a non-negative integer or None")
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
            # Hold new requests while a sync is in progress (polling: pause() runs on another thread). resume()
            # always releases them, whether or not the server answered, and so does close().
            while not self._unpaused.is_set():
                await asyncio.sleep(0.005)
            if self._closed:
                return GenerateResult(finish_reason="error", error=f"{self.base_url}: the engine client was closed")
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
        """Push adapter `name` from memory; a loaded name is unloaded first (SGLang cannot reload in place).

        `tensors` and `config` are PEFT's (expert LoRA in `target_parameters` keys and layout); for a real SGLang
        server (tensor_format "sglang") expert LoRA is converted to SGLang's layout first (`experts_to_sglang`).
        """
        validate_adapter_name(name)
        experts = isinstance(config, dict) and bool(config.get("target_parameters"))
        check_lora_config(config, allow_target_parameters=True)  # our server checks its model; SGLang's is below
        if not tensors:
            raise ValueError(f"tensors for adapter {name!r} are empty; expected PEFT-named lora_A/lora_B tensors")
        if self.tensor_format == "sglang" and (experts or self.expert_shapes):
            if self.expert_shapes is None:
                raise ValueError(
                    f"adapter {name!r} has expert LoRA (target_parameters={config['target_parameters']}), which "
                    "SGLang loads only in its own per-expert layout; converting needs the model's expert shapes: "
                    "build the engine with expert_shapes=sglang_expert_shapes(model)"
                )
            tensors, config = experts_to_sglang(name, tensors, config, self.expert_shapes)
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
        self._load("/load_lora_adapter_from_tensors", name, body, new_version)
        del snapshot  # the server has its copy now
        self._record(name, new_version)
        return new_version

    def load_adapter_from_path(self, name: str, path: str, version: int | None = None, pinned: bool = False) -> int:
        """Load adapter `name` from a PEFT folder that the server can read (`/load_lora_adapter`)."""
        validate_adapter_name(name)
        config_file = Path(path) / CONFIG_NAME
        # The folder may only exist on the server's host; check its config here when we can read it.
        if config_file.is_file():
            config = json.loads(config_file.read_text())
            check_lora_config(config, allow_target_parameters=True)
            if config.get("target_parameters") and self.tensor_format == "sglang":
                raise ValueError(
                    f"adapter {name!r} at {path} has expert LoRA (target_parameters={config['target_parameters']}): "
                    "SGLang's loader reads neither target_parameters nor PEFT's expert keys (they do not name the "
                    "Parameter); push it from memory instead, load_adapter(name, *read_peft_folder(path)), which "
                    "converts it to SGLang's per-expert layout"
                )
        new_version = self._next_version(name, version)
        body = {"lora_name": name, "lora_path": str(path), "pinned": bool(pinned)}
        self._load("/load_lora_adapter", name, body, new_version)
        self._record(name, new_version)
        return new_version

    def unload_adapter(self, name: str) -> None:
        validate_adapter_name(name)
        self._post("/unload_lora_adapter", {"lora_name": name})
        with self._lock:
            self._versions.pop(name, None)
            self._changes[name] = self._changes.get(name, 0) + 1
            self._changed_while_paused = not self._unpaused.is_set() or self._changed_while_paused

    def _load(self, path: str, name: str, body: dict[str, Any], version: int) -> None:
        """POST a load of `name`, unloading it first when this client loaded it. A server that holds the name though
        this client did not load it (a client attached to a running server, e.g. a resumed run; a load whose answer
        timed out but which the server finished) answers "already loaded": unloaded, then loaded once more."""
        self._replace(name)
        headers = {ADAPTER_VERSION_HEADER: str(version)}
        try:
            self._post(path, body, headers)
        except SGLangError as exc:
            if "already loaded" not in str(exc):
                raise
            logger.warning(
                "%s: adapter %r was loaded already (not by this client): unloading it first", self.base_url, name
            )
            self.unload_adapter(name)
            self._post(path, body, headers)

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
        """Flush the prefix cache if adapters changed during the pause, then `/continue_generation`.

        The requests held client side are released even when a call fails (the error is raised): held, they would
        wait for good; sent to a server that stayed paused, they end at the client's timeout with an error."""
        with self._lock:
            changed, self._changed_while_paused = self._changed_while_paused, False
        try:
            if changed and self.flush_cache_on_resume:
                self.flush_cache()
            self._post("/continue_generation", {})
        except BaseException:
            with self._lock:  # a later resume flushes again: the cache may still hold the old adapters' prefixes
                self._changed_while_paused = self._changed_while_paused or changed
            raise
        finally:
            self._unpaused.set()

    def flush_cache(self) -> bool:
        """`/flush_cache`; False (and a warning) when SGLang refuses because requests are still running."""
        url, resp = self._send("/flush_cache", headers=self._headers())
        if resp.status_code in (401, 403):
            raise SGLangError(f"{url}: HTTP {resp.status_code}; check api_key")
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

    def health(self, timeout_s: float | None = None) -> bool:
        """Whether the server answers GET /health with 200 within `timeout_s` (default: the client's timeout, at most
        30 s)."""
        wait = min(self.timeout, 30) if timeout_s is None else max(0.1, timeout_s)
        try:
            resp = self._http.get(self.base_url + "/health", headers=self._headers(), timeout=wait)
        except requests.RequestException:
            return False
        return resp.status_code == 200

    def close(self) -> None:
        self._closed = True
        self._unpaused.set()  # requests held by a pause end with an error instead of waiting for good
        self._http.close()


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
