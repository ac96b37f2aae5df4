"""SGLang's native HTTP API as data: request payloads, response parsing, tensor encodings, adapter configs.

Pure functions and constants, no network I/O: the client (`sglang.py`) builds its requests with them and our server
(`http_server.py`) reads the same formats, so both ends share one definition. The payloads are checked against
fields recorded from SGLang's source in `tests/fixtures/sglang_api.json`.

Design choices:
- A request for an adapter always carries `lora_path=<name>`: SGLang runs a request without it on the base
  model without complaint (Miles #2075), so `generate_payload` refuses to build such a payload. Base rows omit it.
- Scaling in SGLang is always `lora_alpha / r`: configs with `use_rslora: true` (and DoRA, which SGLang does not
  implement) are rejected instead of being served with the wrong scale. `check_lora_config` applies the PEFT-config
  rules of `rl_multilora.lora` (`peft_config_problems`), the same the trainer's model and the embedded engine apply.
- SGLang's loader fuses q/k/v and gate/up projections: `complete_fused_groups` fills the members an adapter does
  not train with exact-zero factors, so SGLang serves exactly the trained adapter.
- Expert LoRA (PEFT `target_parameters` on packed MoE Parameters): SGLang (>= 0.5.10) never reads
  `target_parameters` and cannot parse PEFT's expert keys (no Parameter name in them), but its FusedMoE LoRA takes
  one 3-D tensor per projection and layer, `<...>.experts.gate_up_proj.lora_A.weight (E, r, H)` / `lora_B (E, 2I, r)`
  and `down_proj` `(E, r, I)` / `(E, H, r)`: our per-expert A and B as they are (`experts_to_sglang`; the facts
  and sources are in `tests/fixtures/sglang_moe_lora.json`). It splits a gate_up LoRA into gate and up by output
  rows with the same A, which is exact. What it cannot take exactly (non-gated `up_proj` experts, transposed /
  interleaved layouts such as gpt-oss) is refused when the engine is built (`sglang_expert_problems`).
- Loading from memory has two encodings (`TENSOR_FORMATS`): "sglang" is SGLang's own MultiprocessingSerializer
  format (torch's ForkingPickler: pickle, with tensors passed as shared-memory / CUDA IPC handles). It only works
  when the server runs on the same host, and the server unpickles it, so use it only with a trusted server.
  "safetensors" sends base64 safetensors bytes with `load_format="safetensors"`; our own server accepts only
  that and never unpickles. A real SGLang server does not understand it.
"""

from __future__ import annotations

import base64
import io
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as torch_mp  # also registers torch's tensor reductions on ForkingPickler
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from rl_multilora.lora import ExpertShape, peft_config_problems
from rl_multilora.lora.peft_io import PEFT_PREFIX, expert_from_peft, expert_key_stems, matches_target
from rollout.types import GenerateRequest, SamplingParams

TENSOR_FORMATS = ("sglang", "safetensors")
# `load_format` value that marks base64 safetensors bytes in `serialized_named_tensors` (our server's format).
SAFETENSORS_LOAD_FORMAT = "safetensors"
# Header carrying the adapter version to our server; SGLang's request structs have no version field and a real
# SGLang server ignores unknown headers.
ADAPTER_VERSION_HEADER = "X-Adapter-Version"
# SGLang finish_reason.type -> our GenerateResult.finish_reason.
_FINISH_TYPES = {"stop": "stop", "length": "length", "abort": "abort"}


def check_lora_config(config: dict[str, Any], allow_target_parameters: bool = False) -> None:
    """Reject PEFT LoRA configs that SGLang would serve with other math than the adapter was trained with.

    The rules are `rl_multilora.lora.peft_config_problems` (peft_type LORA, `r` an integer >= 1, a finite
    `lora_alpha` > 0, no rsLoRA, DoRA, LoRA bias, rank/alpha patterns, ...); every problem is reported.
    `allow_target_parameters`: accept expert LoRA (a list of `target_parameters`): the SGLang client converts it
    (`experts_to_sglang`), our own server hands it to a model that checks it.

    >>> check_lora_config({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]})
    >>> check_lora_config({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_rslora": True})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: config.use_rslora=True is not allowed; allowed: False (rsLoRA scales by lora_alpha / sqrt(r); ...)
    """
    if not isinstance(config, dict):
        raise ValueError(f"config must be a PEFT LoRA config dict, got {type(config).__name__}")
    problems = peft_config_problems(config, field_prefix="config.", allow_target_parameters=allow_target_parameters)
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        raise ValueError("config has several problems:\n  - " + "\n  - ".join(problems))


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


# ----------------------------------------------------------------------------------------------- expert LoRA

# Our packed expert Parameter -> the target module SGLang's FusedMoE LoRA loads it as (sglang >= 0.5.10, recorded
# from 0.5.23 in tests/fixtures/sglang_moe_lora.json). SGLang wraps its FusedMoE layers only when both modules are
# in --lora-target-modules (`SGLangLauncher(expert_lora=True)` adds them).
SGLANG_EXPERT_MODULES = {"gate_up_proj": "gate_up_proj", "down_proj": "down_proj"}
# SGLang files a weight under the layer `layers.<i>.` in its name says, and routes a 3-D weight to the MoE buffers
# when the name contains "experts" and not "shared_experts.".
_LAYER = re.compile(r"(^|\.)layers\.\d+\.")


def sglang_expert_problems(expert_shapes: Mapping[str, ExpertShape]) -> list[str]:
    """Why SGLang's MoE LoRA cannot serve these expert LoRA targets exactly, one message per Parameter ([] if it can).

    It takes `gate_up_proj` (gate rows first, then up: out = 2 * I) and `down_proj` of a module named `experts` under
    `layers.<i>`, stored `(E, out, in)`. Parameters stored `(E, in, out)` (`ExpertShape.transposed`: gpt-oss) have
    gate/up columns SGLang orders differently (it interleaves a [gate; up] LoRA B itself).

    >>> ok = ExpertShape("model.layers.0.mlp.experts", "gate_up_proj", 4, 32, 32)
    >>> sglang_expert_problems({ok.name: ok})
    []
    >>> up = ExpertShape("model.layers.0.mlp.experts", "up_proj", 4, 32, 16)
    >>> sglang_expert_problems({up.name: up})  # doctest: +ELLIPSIS
    ["model.layers.0.mlp.experts.up_proj: SGLang's FusedMoE LoRA takes ['down_proj', 'gate_up_proj'] ..."]
    """
    problems = []
    for name, shape in expert_shapes.items():
        if shape.param not in SGLANG_EXPERT_MODULES:
            problems.append(
                f"{name}: SGLang's FusedMoE LoRA takes {sorted(SGLANG_EXPERT_MODULES)} (gated experts); "
                f"{shape.param!r} (non-gated experts) is not converted"
            )
        elif shape.transposed:
            problems.append(
                f"{name}: stored (E, in, out) with interleaved gate/up columns (gpt-oss layout); the client converts "
                "only the (E, out, in) [gate; up] layout"
            )
        elif shape.module.rsplit(".", 1)[-1] != "experts" or not _LAYER.search(shape.module + "."):
            problems.append(
                f"{name}: SGLang finds expert LoRA by a 'layers.<i>.' and an 'experts' module in the weight name; "
                f"module {shape.module!r} has not both"
            )
        elif shape.param == "gate_up_proj" and shape.out_features % 2:
            problems.append(f"{name}: out_features={shape.out_features} is not 2 * intermediate size")
    return problems


def sglang_expert_refusal(problems: Sequence[str], what: str) -> str:
    """The error for expert LoRA SGLang cannot serve: what, why, what SGLang supports and the way out."""
    return (
        f"{what}: SGLang's MoE LoRA loader (sglang >= 0.5.10, checked against 0.5.23) cannot serve it exactly:\n  - "
        + "\n  - ".join(problems)
        + "\nSGLang supports per-expert gate_up_proj / down_proj LoRA of gated MoE experts stored (E, out, in) "
        "(Qwen2/3-MoE, Mixtral, DeepSeek-V3, ...); use rollout.engine: embedded (or http), or leave these "
        "Parameters out of model.target_parameters"
    )


def sglang_expert_shapes(model: Any) -> dict[str, ExpertShape]:
    """`model.expert_shapes` (a `MultiLoRAModel`'s) if SGLang can serve every one exactly, else ValueError.

    Call it before launching a server, so that a model SGLang cannot serve fails at once, and pass the result as
    `SGLangEngine(expert_shapes=...)`.
    """
    shapes = dict(model.expert_shapes)
    problems = sglang_expert_problems(shapes)
    if problems:
        raise ValueError(sglang_expert_refusal(problems, f"the model's expert LoRA ({', '.join(shapes)})"))
    return shapes


def experts_to_sglang(
    name: str,
    tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    expert_shapes: Mapping[str, ExpertShape],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Adapter `name`'s PEFT `target_parameters` tensors in SGLang's MoE LoRA layout; the Linears' keys pass as they are.

    Per covered Parameter `<module>.<param>` (E experts, matmul in/out, rank r), PEFT's A `(E * r, in)` and B
    `(out, r * E)` under its nested key stem (`rl_multilora.lora.peft_io`) become
    `base_model.model.<module>.<param>.lora_A.weight (E, r, in)` and `.lora_B.weight (E, out, r)`:
    `delta_e = lora_alpha / r * B[e] @ A[e]` for every expert e, the delta our model adds. SGLang repeats a gate_up A
    to `(E, 2r, in)` and adds `gate += B[e, :I] @ A[e]`, `up += B[e, I:] @ A[e]`, i.e. the fused delta split by
    output rows: exact. The config's `target_parameters` gives way to SGLang's module names in `target_modules`, the
    only targets SGLang reads. Every problem is reported at once; returns new (tensors, config).
    """
    rank = config["r"]
    wanted = list(config.get("target_parameters") or [])
    problems = [
        f"target_parameters entry {t!r} matches none of the model's expert LoRA targets {sorted(expert_shapes)}"
        for t in wanted
        if not any(matches_target(n, t) for n in expert_shapes)
    ]
    covered = [n for n in expert_shapes if any(matches_target(n, t) for t in wanted)]
    problems += sglang_expert_problems({n: expert_shapes[n] for n in covered})
    if problems:
        raise ValueError(sglang_expert_refusal(problems, f"adapter {name!r} (target_parameters={wanted})"))
    out, converted = dict(tensors), {}
    for param, stem in expert_key_stems(covered, expert_shapes).items():
        shape = expert_shapes[param]
        pair = {w: out.pop(f"{stem}.lora_{w}.weight", None) for w in ("A", "B")}
        missing = [f"{stem}.lora_{w}.weight" for w, t in pair.items() if t is None]
        if missing:
            problems.append(f"{param}: no {' / '.join(missing)} (PEFT writes both for every targeted Parameter)")
            continue
        e, i, o = shape.num_experts, shape.in_features, shape.out_features
        want = {"A": (e * rank, i), "B": (o, rank * e)}
        bad = [f"lora_{w} {tuple(pair[w].shape)}, expected {want[w]}" for w in "AB" if tuple(pair[w].shape) != want[w]]
        if bad:
            problems.append(f"{param} ({stem}): {'; '.join(bad)} (E={e}, r={rank}, in={i}, out={o})")
            continue
        lora_a, lora_b = expert_from_peft(pair["A"], pair["B"], e, rank)  # (E, r, in), (E, out, r)
        key = f"{PEFT_PREFIX}{shape.module}.{SGLANG_EXPERT_MODULES[shape.param]}"
        converted[f"{key}.lora_A.weight"] = lora_a.contiguous()
        converted[f"{key}.lora_B.weight"] = lora_b.contiguous()
    expert_prefixes = tuple(f"{PEFT_PREFIX}{s.module}." for s in expert_shapes.values())
    problems += [
        f"key {k!r} is expert LoRA that target_parameters={wanted} does not name"
        for k in out
        if k.startswith(expert_prefixes)
    ]
    if problems:
        raise ValueError(
            f"adapter {name!r}: expert LoRA tensors do not match the model:\n  - " + "\n  - ".join(problems)
        )
    sglang_config = {k: v for k, v in config.items() if k != "target_parameters"}
    targets = config.get("target_modules")
    added = {SGLANG_EXPERT_MODULES[expert_shapes[p].param] for p in covered}
    if added and not isinstance(targets, str):  # a list or None; "all-linear" covers SGLang's expert modules
        sglang_config["target_modules"] = sorted(set(targets or []) | added)
    return {**out, **converted}, sglang_config


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
    if sp.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def generate_payload(request: GenerateRequest) -> dict[str, Any]:
    """The `/generate` body for one request; an adapter request always names its adapter in `lora_path`."""
    if not request.input_ids:
        raise ValueError(
            f"GenerateRequest.input_ids={request.input_ids!r} is not allowed; allowed: a non-empty list of token ids "
            "(SGLang rejects an empty prompt)"
        )
    if request.adapter is not None and (not isinstance(request.adapter, str) or not request.adapter):
        raise ValueError(
            f"GenerateRequest.adapter={request.adapter!r} is not allowed; allowed: a non-empty adapter name, or None "
            "for the base model"
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
