"""PEFT adapter folders in and out, and the one copy of the rules an adapter's name and config must follow.

Design choices:

- Adapters are PEFT folders (`adapter_config.json`, `adapter_model.safetensors`, keys
  `base_model.model.<module>.lora_A.weight`, true rank), so PEFT, vLLM and SGLang load them as they are. An adapter
  may cover a subset of the model's LoRA modules (e.g. a PEFT folder with q_proj/v_proj on an all-linear model).
- Deviations from PEFT: no LoRA dropout (GRPO rollouts and training should see the same function), no rsLoRA, DoRA,
  LoRA bias or rank/alpha patterns (SGLang ignores or rejects them). `peft_config_problems` refuses such configs
  for the model, the bank and the SGLang client alike, so an adapter is never served with other math than it was
  trained with.
- Validation reports every problem of an adapter in one error and runs before any slot is touched, so a bad
  adapter leaves the model (or bank) as it was. `write_peft_folder` checks with the same rules before it writes.
- An adapter name becomes a path component (checkpoint and export folders): `validate_adapter_name` is the one rule,
  used by the model, the engines and the run config.
- Expert LoRA (PEFT's `target_parameters` on packed 3-D expert Parameters) is written exactly as PEFT 0.21's
  `ParamWrapper` saves it: the Parameter's name is not in the key, which is that of the experts module, and when
  several Parameters of one module are targeted PEFT nests its wrappers in the module's Parameter order, so the last
  targeted one has `<module>.lora_A.weight` and each earlier one one more `.base_layer` (`gate_up_proj` of a Qwen3-MoE
  layer with both targeted: `mlp.experts.base_layer.lora_A.weight`). A is `(E * r, in)` with rows expert-major
  (`A.view(E, r, in)[e]` is expert e's), B is `(out, r * E)` with columns expert-fastest
  (`B.view(out, r, E)[:, :, e]` is expert e's). Only models with expert targets accept such configs
  (`peft_config_problems(..., allow_target_parameters=True)`), and the engine's bank holds them the same way.
- Imports no torch at module level: the name and config rules are usable (e.g. by config validation) without it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl_multilora.lora._errors import bad_value

if TYPE_CHECKING:
    import torch

ADAPTER_NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]+")  # used with fullmatch: "a\n" is refused
# Names become folder and file names (RUN_DIR/adapters/<name>/, a paged tenant's <name>.pt): far under the 255 bytes
# a file name may have, so a long name is refused when it is submitted, not by the file system in a training step.
MAX_ADAPTER_NAME = 128
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_PEFT_KEY = re.compile(re.escape(PEFT_PREFIX) + r"(.+)\.lora_(A|B)\.weight")
PEFT_KEY_PATTERN = _PEFT_KEY  # `<prefix><module>.lora_A|B.weight`; group 1: the module
# A copy of a LoRA module's base weight: PEFT's `save_embedding_layers="auto"` writes the output head's (and the input
# embedding's) base weight next to a LoRA on `lm_head`, for a vocabulary the adapter resized.
_BASE_COPY_KEY = re.compile(re.escape(PEFT_PREFIX) + r"(.+)\.base_layer\.weight")

# PEFT LoraConfig fields whose non-default values change the math in ways this model (and SGLang) does not do:
# field -> (allowed values, the first being PEFT's default; why another value is refused).
_UNSUPPORTED_CONFIG: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_rslora": (
        (False, None),
        "rsLoRA scales by lora_alpha / sqrt(r); this model and SGLang scale by lora_alpha / r",
    ),
    "use_dora": ((False, None), "DoRA is implemented neither here nor in SGLang"),
    "fan_in_fan_out": ((False, None), "only nn.Linear's (out, in) weight layout is supported"),
    "bias": (("none", None), "LoRA bias terms are neither trained nor loaded"),
    "lora_bias": ((False, None), "LoRA bias terms are neither trained nor loaded"),
    "rank_pattern": (({}, None), "one r per adapter: per-module ranks are not supported"),
    "alpha_pattern": (({}, None), "one lora_alpha per adapter: per-module alphas are not supported"),
    "modules_to_save": ((None, [], ()), "fully trained extra modules are not part of a LoRA slot"),
    "layer_replication": ((None,), "layer replication is not supported"),
    "target_parameters": ((None, []), "LoRA on bare parameters (not nn.Linear modules) is not supported"),
    "trainable_token_indices": ((None,), "trainable token embeddings are not supported"),
    # LoRA variants: another forward than `W x + scale * B A x` (PEFT's `is_lora_variant` fields, and aLoRA, which
    # applies the adapter only after its invocation tokens)
    "alora_invocation_tokens": ((None, []), "aLoRA applies the adapter only after its invocation tokens"),
    "use_bdlora": ((None, False), "BD-LoRA's block-diagonal factors are not supported"),
    "velora_config": ((None,), "VeLoRA is not supported"),
    "monteclora_config": ((None,), "MonteCLoRA is not supported"),
    "arrow_config": ((None,), "Arrow routing is not supported"),
    "kasa_config": ((None,), "KaSA is not supported"),
}
# `init_lora_weights` values whose adapter only makes sense on a base that PEFT changes when it loads the adapter
# (the residual W - B0 A0): saved without PEFT's conversion (`path_initial_model_for_weight_conversion`), applied
# to the unchanged base they give other logits. Prefixes (PiSSA's "pissa_niter_16").
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


def validate_adapter_name(name: Any) -> str:
    """Return `name` if it is a usable adapter name (it becomes a path component), else raise ValueError.

    >>> validate_adapter_name("math-v2.1_a")
    'math-v2.1_a'
    >>> validate_adapter_name("a\\n")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: adapter name='a\\n' is not allowed; allowed: a string of 1 to 128 letters, digits, ...
    """
    ok = isinstance(name, str) and ADAPTER_NAME_PATTERN.fullmatch(name) and name not in (".", "..")
    if not ok or len(name) > MAX_ADAPTER_NAME:
        raise ValueError(
            bad_value(
                "adapter name",
                name,
                f"a string of 1 to {MAX_ADAPTER_NAME} letters, digits, '.', '_' and '-', other than '.' and '..'",
            )
        )
    return name


def _valid_rank(rank: Any, max_rank: int | None) -> bool:
    return (
        not isinstance(rank, bool) and isinstance(rank, int) and rank >= 1 and (max_rank is None or rank <= max_rank)
    )


def check_rank(rank: Any, max_rank: int | None, field: str = "rank") -> int:
    if not _valid_rank(rank, max_rank):
        allowed = "an integer >= 1" if max_rank is None else f"an integer from 1 to max_rank={max_rank}"
        raise ValueError(bad_value(field, rank, allowed))
    return rank


def check_alpha(alpha: Any, field: str = "alpha") -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(bad_value(field, alpha, "a finite number > 0"))
    return alpha


def peft_config_problems(
    config: Mapping[str, Any],
    max_rank: int | None = None,
    field_prefix: str = "",
    allow_target_parameters: bool = False,
) -> list[str]:
    """What makes a PEFT adapter config unusable here, one message per problem ([] when it is fine).

    Checks the config alone: peft_type LORA, `r` an integer in [1, max_rank] (no upper bound for None), a finite
    `lora_alpha` > 0, and no field from `_UNSUPPORTED_CONFIG` at a value that changes the math.
    `field_prefix` is put before each field name in the messages (e.g. "config.").
    `allow_target_parameters`: accept a list of `target_parameters` (expert LoRA; only a model with expert targets
    can use it).

    >>> peft_config_problems({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]})
    []
    >>> for problem in peft_config_problems({"peft_type": "LORA", "r": 0, "lora_alpha": 16, "use_dora": True}, 8):
    ...     print(problem)
    r=0 is not allowed; allowed: an integer from 1 to max_rank=8
    use_dora=True is not allowed; allowed: False (DoRA is implemented neither here nor in SGLang)
    """
    problems: list[str] = []
    peft_type = str(config.get("peft_type", "")).split(".")[-1]
    if peft_type != "LORA":
        problems.append(bad_value(f"{field_prefix}peft_type", config.get("peft_type"), "'LORA'"))
    try:
        check_rank(config.get("r"), max_rank, f"{field_prefix}r")
    except ValueError as err:
        problems.append(str(err))
    try:
        check_alpha(config.get("lora_alpha"), f"{field_prefix}lora_alpha")
    except ValueError as err:
        problems.append(str(err))
    for key, (allowed, why) in _UNSUPPORTED_CONFIG.items():
        if key == "target_parameters" and allow_target_parameters:
            value = config.get(key)
            if value is not None and (
                isinstance(value, str) or not all(isinstance(t, str) and t for t in _as_list(value))
            ):
                problems.append(bad_value(f"{field_prefix}{key}", value, "a list of parameter names or None"))
            continue
        if key in config and config[key] not in allowed:
            problems.append(bad_value(f"{field_prefix}{key}", config[key], f"{allowed[0]!r} ({why})"))
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        problems.append(
            bad_value(
                f"{field_prefix}init_lora_weights",
                init,
                "true, false, 'gaussian', 'eva', 'orthogonal' or 'mica' (a PiSSA/OLoRA/CorDA/LoftQ/LoRA-GA adapter "
                "goes with a base PEFT changes when loading it: save it with PEFT's "
                "path_initial_model_for_weight_conversion to get a plain LoRA)",
            )
        )
    return problems


def _as_list(value: Any) -> list[Any]:
    try:
        return list(value)
    except TypeError:
        return [value]


@dataclass(frozen=True)
class ExpertShape:
    """One packed expert Parameter that takes LoRA: its experts module, its name there, and the matmul's sizes."""

    module: str  # e.g. "model.layers.0.mlp.experts"
    param: str  # e.g. "gate_up_proj"
    num_experts: int
    in_features: int
    out_features: int
    shared_a: bool = False  # one A per slot for all experts (expert_lora="shared_a"): A comes back as (1, r, in)
    transposed: bool = False  # stored (E, in, out), gate/up interleaved (gpt-oss): in/out above are the matmul's

    @property
    def name(self) -> str:
        return f"{self.module}.{self.param}" if self.module else self.param


@dataclass(frozen=True)
class _ParsedAdapter:
    rank: int
    alpha: float
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A (r, in), B (out, r))
    experts: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )  # param -> A (E, r, in) (shared A: (1, r, in)), B (E, out, r)
    # module -> the copy of its base weight (out, in) the file holds (PEFT's save_embedding_layers); the loader
    # checks that it is the model's own (one base serves every slot)
    base_copies: dict[str, torch.Tensor] = field(default_factory=dict)


def expert_key_stems(covered: Sequence[str], expert_shapes: Mapping[str, ExpertShape]) -> dict[str, str]:
    """Full Parameter name -> PEFT key stem (key without `.lora_A.weight`) for an adapter covering `covered`.

    PEFT wraps the targeted Parameters of one module in the module's Parameter order, each wrapper around the
    previous one: the last is outermost (`<module>`), each earlier one a `.base_layer` deeper. `expert_shapes` is in
    model order, which within a module is its Parameter order.
    """
    by_module: dict[str, list[str]] = {}
    for name, shape in expert_shapes.items():
        if name in covered:
            by_module.setdefault(shape.module, []).append(name)
    stems = {}
    for module, names in by_module.items():
        for i, name in enumerate(names):
            stems[name] = f"{PEFT_PREFIX}{module}" + ".base_layer" * (len(names) - 1 - i)
    return stems


def expert_to_peft(lora_a: torch.Tensor, lora_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our (A (E, r, in), B (E, out, r)) -> PEFT's (A (E * r, in) expert-major, B (out, r * E) expert-fastest)."""
    num_experts, rank, in_features = lora_a.shape
    out_features = lora_b.shape[1]
    peft_a = lora_a.reshape(num_experts * rank, in_features)  # peft_a[e * r + k] = A[e, k]
    peft_b = lora_b.permute(1, 2, 0).reshape(out_features, rank * num_experts)  # peft_b[:, k * E + e] = B[e, :, k]
    return peft_a, peft_b


def expert_from_peft(
    peft_a: torch.Tensor, peft_b: torch.Tensor, num_experts: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's (A (E * r, in), B (out, r * E)) -> our (A (E, r, in), B (E, out, r)); the inverse of `expert_to_peft`."""
    lora_a = peft_a.reshape(num_experts, rank, peft_a.shape[-1])
    lora_b = peft_b.reshape(peft_b.shape[0], rank, num_experts).permute(2, 0, 1)
    return lora_a, lora_b


def target_parameters_for(covered: Sequence[str], all_params: Sequence[str]) -> list[str]:
    """Shortest PEFT target_parameters selecting exactly `covered` among `all_params` (the base model's Parameter
    names): the last k name segments of each, for the smallest k that does (PEFT matches by equality or suffix)."""
    depth = max(n.count(".") + 1 for n in covered)
    for k in range(2, depth + 1):  # k >= 2: "<module leaf>.<param>", the form PEFT's docs use
        suffixes = {".".join(n.split(".")[-k:]) for n in covered}
        if {n for n in all_params if any(matches_target(n, t) for t in suffixes)} == set(covered):
            return sorted(suffixes)
    return sorted(covered)


def peft_key(module: str, which: str) -> str:
    return f"{PEFT_PREFIX}{module}.lora_{which}.weight"


def matches_target(module: str, target: str) -> bool:
    """PEFT's rule for a target_modules list entry: the module name equals it or ends with '.' + it."""
    return module == target or module.endswith("." + target)


def _config_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    raise TypeError(f"adapter config must be a dict (adapter_config.json content), got {type(config).__name__}")


def parse_peft_adapter(
    state_dict: Mapping[str, torch.Tensor],
    config: Any,
    layer_shapes: Mapping[str, tuple[int, int]],
    max_rank: int | None,
    source: str,
    expert_shapes: Mapping[str, ExpertShape] | None = None,
) -> _ParsedAdapter:
    """Validate a PEFT LoRA state dict + config against this model's LoRA modules; every problem in one error.

    `expert_shapes` (full Parameter name -> shape, model order): the model's expert LoRA targets; with them a config
    may have `target_parameters`, whose tensors come back in `experts` in our layout.
    """
    config = _config_dict(config)
    problems = peft_config_problems(config, max_rank, allow_target_parameters=bool(expert_shapes))
    rank = config.get("r") if _valid_rank(config.get("r"), max_rank) else None  # None: reported, no shape checks
    alpha = config.get("lora_alpha")
    targets = config.get("target_modules")
    # A string is a regex or "all-linear" in PEFT: then the keys alone decide which modules are covered.
    target_list = None if isinstance(targets, str) or targets is None else list(targets)

    expert_stems: dict[str, str] = {}  # PEFT key stem -> full Parameter name
    target_parameters = config.get("target_parameters") if expert_shapes else None
    if expert_shapes and target_parameters and not isinstance(target_parameters, str):
        wanted = _as_list(target_parameters)
        covered = [n for n in expert_shapes if any(matches_target(n, t) for t in wanted)]
        problems += [
            f"target_parameters entry {t!r} matches none of this model's expert LoRA targets "
            f"{sorted({s.param for s in expert_shapes.values()})}"
            for t in wanted
            if isinstance(t, str) and not any(matches_target(n, t) for n in expert_shapes)
        ]
        expert_stems = {stem: name for name, stem in expert_key_stems(covered, expert_shapes).items()}

    found: dict[str, dict[str, torch.Tensor]] = {}
    found_experts: dict[str, dict[str, torch.Tensor]] = {}
    base_copies: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        match = _PEFT_KEY.fullmatch(key)
        copy = _BASE_COPY_KEY.fullmatch(key) if match is None else None
        if copy is not None and copy.group(1) in layer_shapes:
            in_features, out_features = layer_shapes[copy.group(1)]
            if tuple(tensor.shape) == (out_features, in_features):
                base_copies[copy.group(1)] = tensor
                continue
            problems.append(
                f"key {key!r} has shape {tuple(tensor.shape)}; the base weight is {(out_features, in_features)}"
            )
            continue
        if match is None:
            problems.append(
                f"unexpected key {key!r}; allowed: '{PEFT_PREFIX}<module>.lora_A.weight' / '.lora_B.weight'"
            )
            continue
        module, which = match.groups()
        if f"{PEFT_PREFIX}{module}" in expert_stems:
            found_experts.setdefault(expert_stems[f"{PEFT_PREFIX}{module}"], {})[which] = tensor
            continue
        if module not in layer_shapes:
            problems.append(f"key {key!r}: module {module!r} is not a LoRA target of this model")
            continue
        if target_list is not None and not any(matches_target(module, t) for t in target_list):
            problems.append(f"key {key!r}: module {module!r} is not in the config's target_modules={targets!r}")
        found.setdefault(module, {})[which] = tensor
    if not found and not found_experts and not problems:
        problems.append("no LoRA tensors found")
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in layer_shapes:  # model order, so exports and bank writes are deterministic
        if module not in found:
            continue
        pair = found[module]
        missing = [w for w in ("A", "B") if w not in pair]
        if missing:
            problems.append(f"module {module!r} has no {' / '.join(f'lora_{w}' for w in missing)} tensor")
            continue
        in_features, out_features = layer_shapes[module]
        if rank is not None:
            for which, want in (("A", (rank, in_features)), ("B", (out_features, rank))):
                if tuple(pair[which].shape) != want:
                    problems.append(
                        f"{peft_key(module, which)} has shape {tuple(pair[which].shape)}; expected {want} "
                        f"(r={rank}, in={in_features}, out={out_features})"
                    )
        tensors[module] = (pair["A"], pair["B"])
    experts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for stem, name in expert_stems.items():
        pair = found_experts.get(name, {})
        missing = [w for w in ("A", "B") if w not in pair]
        if missing:  # PEFT writes every targeted Parameter: a missing one is a broken or foreign file
            problems.append(
                f"expert parameter {name!r} (keys {stem}.lora_A/B.weight) has no "
                f"{' / '.join(f'lora_{w}' for w in missing)} tensor"
            )
            continue
        shape = expert_shapes[name]
        e, i, o = shape.num_experts, shape.in_features, shape.out_features
        if rank is not None:
            bad = [
                (w, tuple(pair[w].shape), want)
                for w, want in (("A", (e * rank, i)), ("B", (o, rank * e)))
                if tuple(pair[w].shape) != want
            ]
            if bad:
                problems += [
                    f"{stem}.lora_{w}.weight ({name}) has shape {got}; expected {want} (E={e}, r={rank}, in={i}, out={o})"
                    for w, got, want in bad
                ]
                continue
            lora_a, lora_b = expert_from_peft(pair["A"], pair["B"], e, rank)
            if shape.shared_a:  # a shared-A model takes a file whose experts all have the same A (what it exports)
                if not all(lora_a[0].equal(lora_a[k]) for k in range(1, e)):
                    problems.append(
                        f"{stem}.lora_A.weight ({name}) has a different A per expert, but this model is built with "
                        "expert_lora='shared_a' (one A per slot shared by all experts); load it into a model built "
                        "with expert_lora='per_expert'"
                    )
                    continue
                lora_a = lora_a[:1]
            experts[name] = (lora_a, lora_b)
    if problems:
        raise ValueError(f"adapter {source} does not match this model:\n  - " + "\n  - ".join(problems))
    return _ParsedAdapter(rank, alpha, tensors, experts, base_copies)


def target_modules_for(covered: Sequence[str], all_modules: Sequence[str]) -> list[str]:
    """Shortest PEFT target_modules that selects exactly `covered`: leaf names if they do, else full names."""
    leaves = {m.rsplit(".", 1)[-1] for m in covered}
    if {m for m in all_modules if m.rsplit(".", 1)[-1] in leaves} == set(covered):
        return sorted(leaves)
    return sorted(covered)


def _implied_shapes(state_dict: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """module -> (in, out) as the tensors themselves say (A is (r, in), B is (out, r)); -1 where they do not."""
    shapes: dict[str, tuple[int, int]] = {}
    for key, tensor in state_dict.items():
        match = _PEFT_KEY.fullmatch(key)
        if match is None:
            continue
        module, which = match.groups()
        in_features, out_features = shapes.get(module, (-1, -1))
        dims = tuple(tensor.shape)
        if len(dims) == 2:
            in_features, out_features = (dims[1], out_features) if which == "A" else (in_features, dims[0])
        shapes[module] = (in_features, out_features)
    return shapes


class AdapterFolderError(ValueError):
    """A PEFT adapter folder that is not loaded: every problem found, the folder named in the message."""


def read_peft_folder(
    peft_dir: str | Path, max_rank: int | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a PEFT adapter folder: (state dict, adapter_config.json content). The one loader of adapter folders.

    Checked before anything is used, every problem in one `AdapterFolderError` naming the folder (a missing file is
    a FileNotFoundError): the files are
    inside the folder (no symlink out of it), the weights are `adapter_model.safetensors` (a pickle-only
    `adapter_model.bin` is refused without being opened: unpickling runs code), the config is a LoRA config with
    `r` <= `max_rank`, and every tensor is finite. Shapes and targets against a model are checked where the
    adapter meets one (`parse_peft_adapter`).
    """
    from safetensors.torch import load_file

    folder = Path(peft_dir)
    config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME

    def fail(problems: list[str]) -> AdapterFolderError:
        return AdapterFolderError(f"adapter folder {folder}: " + "; ".join(problems))

    if not folder.is_dir() or not config_path.is_file():  # FileNotFoundError, as open() would say
        raise FileNotFoundError(f"adapter folder {folder}: {CONFIG_NAME} is missing: not a PEFT adapter folder")
    if not weights_path.is_file():
        if (folder / "adapter_model.bin").exists():
            raise fail(
                [
                    "only adapter_model.bin (pickle) is there, which is never opened here (unpickling can run code); "
                    f"save it as {WEIGHTS_NAME} (PEFT: save_pretrained(..., safe_serialization=True))"
                ]
            )
        raise FileNotFoundError(f"adapter folder {folder}: {WEIGHTS_NAME} is missing")
    root = folder.resolve()
    escaped = [p.name for p in (config_path, weights_path) if not p.resolve().is_relative_to(root)]
    if escaped:
        raise fail([f"{', '.join(escaped)} is a link to a file outside the folder"])
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise fail([f"{CONFIG_NAME} is not valid JSON ({e})"]) from None
    if not isinstance(config, dict):
        raise fail([f"{CONFIG_NAME} is not a JSON object"])
    try:
        state_dict = load_file(str(weights_path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for truncated or garbage files
        raise fail([f"{WEIGHTS_NAME} cannot be read ({type(e).__name__}: {e})"]) from None
    problems = peft_config_problems(config, max_rank, allow_target_parameters=True)
    nonfinite = [k for k, t in state_dict.items() if t.is_floating_point() and not bool(t.isfinite().all())]
    if nonfinite:
        problems.append(f"{len(nonfinite)} tensor(s) hold NaN or inf values (first: {nonfinite[0]})")
    if problems:
        raise fail(problems)
    return state_dict, config


def write_peft_folder(
    out_dir: str | Path,
    tensors: Mapping[str, torch.Tensor],
    config: Any,
    expert_shapes: Mapping[str, ExpertShape] | None = None,
) -> Path:
    """Write a PEFT adapter folder from PEFT-named tensors at the true rank and the adapter_config.json content.

    `tensors`: `base_model.model.<module>.lora_A.weight` (r, in) and `...lora_B.weight` (out, r) per module, and for
    `target_parameters` PEFT's expert keys (A `(E * r, in)`, B `(out, r * E)`, see the module docstring);
    `config`: a dict (or a PEFT `LoraConfig`). Both are checked first with the rules the readers apply (config
    fields, key names, A/B pairs, shapes at rank r, target_modules), so a bad adapter writes nothing and what is
    written loads with `MultiLoRAModel.load_adapter` on a model with those modules. `expert_shapes` (the model's
    expert targets) checks expert tensors fully; without it they are checked for what the tensors alone say (A rows
    = B columns = a multiple of r). The weights are written before the config: a folder holding adapter_config.json
    is complete. Returns the folder (created if missing).
    """
    from safetensors.torch import save_file

    folder = Path(out_dir)
    config = _config_dict(config)
    source = f"to write to {folder}"
    if config.get("target_parameters") and expert_shapes is None:
        linear, experts = _split_implied_experts(tensors, config)
        problems = peft_config_problems(config, None, allow_target_parameters=True)
        problems += [] if problems else _implied_expert_problems(experts, config["r"])
        if not linear and not experts:
            problems.append("no LoRA tensors found")
        if problems:
            raise ValueError(f"adapter {source} does not match this model:\n  - " + "\n  - ".join(problems))
        if linear:
            parse_peft_adapter(linear, {**config, "target_parameters": None}, _implied_shapes(linear), None, source)
    else:
        shapes = _implied_shapes(tensors)
        parse_peft_adapter(tensors, config, shapes, None, source, expert_shapes=expert_shapes)
    state_dict = {k: v.contiguous().cpu() for k, v in tensors.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state_dict, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    with open(folder / CONFIG_NAME, "w") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True))
    return folder


def _split_implied_experts(
    tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Without the model: keys of modules the config's target_modules select are linear, the others expert keys
    (stem -> {"A", "B"})."""
    targets = config.get("target_modules")
    target_list = [] if targets is None or isinstance(targets, str) else list(targets)
    linear: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _PEFT_KEY.fullmatch(key)
        module = match.group(1) if match else None
        if match is None or any(matches_target(module, t) for t in target_list) or isinstance(targets, str):
            linear[key] = tensor
        else:
            experts.setdefault(module, {})[match.group(2)] = tensor
    return linear, experts


def _implied_expert_problems(experts: Mapping[str, Mapping[str, torch.Tensor]], rank: int) -> list[str]:
    problems = []
    for module, pair in experts.items():
        missing = [w for w in ("A", "B") if w not in pair]
        if missing:
            problems.append(f"module {module!r} has no {' / '.join(f'lora_{w}' for w in missing)} tensor")
            continue
        a, b = tuple(pair["A"].shape), tuple(pair["B"].shape)
        if len(a) != 2 or len(b) != 2 or a[0] != b[1] or a[0] % rank:
            problems.append(
                f"expert tensors of {module!r} have shapes A {a}, B {b}; expected A (E * r, in) and B (out, r * E) "
                f"with r={rank}"
            )
    return problems
