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
- Imports no torch at module level: the name and config rules are usable (e.g. by config validation) without it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl_multilora.lora._errors import bad_value

if TYPE_CHECKING:
    import torch

ADAPTER_NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]+")  # used with fullmatch: "a\n" is refused
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_PEFT_KEY = re.compile(re.escape(PEFT_PREFIX) + r"(.+)\.lora_(A|B)\.weight")

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
}


def validate_adapter_name(name: Any) -> str:
    """Return `name` if it is a usable adapter name (it becomes a path component), else raise ValueError.

    >>> validate_adapter_name("math-v2.1_a")
    'math-v2.1_a'
    >>> validate_adapter_name("a\\n")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: adapter name='a\\n' is not allowed; allowed: a non-empty string of letters, digits, ...
    """
    if not isinstance(name, str) or not ADAPTER_NAME_PATTERN.fullmatch(name) or name in (".", ".."):
        raise ValueError(
            bad_value(
                "adapter name",
                name,
                "a non-empty string of letters, digits, '.', '_' and '-', other than '.' and '..'",
            )
        )
    return name


def _valid_rank(rank: Any, max_rank: int | None) -> bool:
    return (
        not isinstance(rank, bool) and isinstance(rank, int) and rank >= 1 and (max_rank is None or rank <= max_rank)
    )


def _check_rank(rank: Any, max_rank: int | None, field: str = "rank") -> int:
    if not _valid_rank(rank, max_rank):
        allowed = "an integer >= 1" if max_rank is None else f"an integer from 1 to max_rank={max_rank}"
        raise ValueError(bad_value(field, rank, allowed))
    return rank


def _check_alpha(alpha: Any, field: str = "alpha") -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(bad_value(field, alpha, "a finite number > 0"))
    return alpha


def peft_config_problems(config: Mapping[str, Any], max_rank: int | None = None, field_prefix: str = "") -> list[str]:
    """What makes a PEFT adapter config unusable here, one message per problem ([] when it is fine).

    Checks the config alone: peft_type LORA, `r` an integer in [1, max_rank] (no upper bound for None), a finite
    `lora_alpha` > 0, and no field from `_UNSUPPORTED_CONFIG` at a value that changes the math.
    `field_prefix` is put before each field name in the messages (e.g. "config.").

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
        _check_rank(config.get("r"), max_rank, f"{field_prefix}r")
    except ValueError as err:
        problems.append(str(err))
    try:
        _check_alpha(config.get("lora_alpha"), f"{field_prefix}lora_alpha")
    except ValueError as err:
        problems.append(str(err))
    for key, (allowed, why) in _UNSUPPORTED_CONFIG.items():
        if key in config and config[key] not in allowed:
            problems.append(bad_value(f"{field_prefix}{key}", config[key], f"{allowed[0]!r} ({why})"))
    return problems


@dataclass(frozen=True)
class _ParsedAdapter:
    rank: int
    alpha: float
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A (r, in), B (out, r))


def _peft_key(module: str, which: str) -> str:
    return f"{PEFT_PREFIX}{module}.lora_{which}.weight"


def _matches_target(module: str, target: str) -> bool:
    """PEFT's rule for a target_modules list entry: the module name equals it or ends with '.' + it."""
    return module == target or module.endswith("." + target)


def _config_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    raise TypeError(f"adapter config must be a dict (adapter_config.json content), got {type(config).__name__}")


def _parse_peft_adapter(
    state_dict: Mapping[str, torch.Tensor],
    config: Any,
    layer_shapes: Mapping[str, tuple[int, int]],
    max_rank: int | None,
    source: str,
) -> _ParsedAdapter:
    """Validate a PEFT LoRA state dict + config against this model's LoRA modules; every problem in one error."""
    config = _config_dict(config)
    problems = peft_config_problems(config, max_rank)
    rank = config.get("r") if _valid_rank(config.get("r"), max_rank) else None  # None: reported, no shape checks
    alpha = config.get("lora_alpha")
    targets = config.get("target_modules")
    # A string is a regex or "all-linear" in PEFT: then the keys alone decide which modules are covered.
    target_list = None if isinstance(targets, str) or targets is None else list(targets)

    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        match = _PEFT_KEY.fullmatch(key)
        if match is None:
            problems.append(
                f"unexpected key {key!r}; allowed: '{PEFT_PREFIX}<module>.lora_A.weight' / '.lora_B.weight'"
            )
            continue
        module, which = match.groups()
        if module not in layer_shapes:
            problems.append(f"key {key!r}: module {module!r} is not a LoRA target of this model")
            continue
        if target_list is not None and not any(_matches_target(module, t) for t in target_list):
            problems.append(f"key {key!r}: module {module!r} is not in the config's target_modules={targets!r}")
        found.setdefault(module, {})[which] = tensor
    if not found and not problems:
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
                        f"{_peft_key(module, which)} has shape {tuple(pair[which].shape)}; expected {want} "
                        f"(r={rank}, in={in_features}, out={out_features})"
                    )
        tensors[module] = (pair["A"], pair["B"])
    if problems:
        raise ValueError(f"adapter {source} does not match this model:\n  - " + "\n  - ".join(problems))
    return _ParsedAdapter(rank, alpha, tensors)


def _target_modules_for(covered: Sequence[str], all_modules: Sequence[str]) -> list[str]:
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


def read_peft_folder(peft_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a PEFT adapter folder: (state dict, adapter_config.json content)."""
    from safetensors.torch import load_file

    folder = Path(peft_dir)
    config_path = folder / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} is not a PEFT adapter folder: {CONFIG_NAME} is missing")
    weights_path = folder / WEIGHTS_NAME
    if weights_path.is_file():
        state_dict = load_file(str(weights_path))
    elif (folder / "adapter_model.bin").is_file():
        import torch

        state_dict = torch.load(folder / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{folder} is not a PEFT adapter folder: {WEIGHTS_NAME} is missing")
    with open(config_path) as f:
        config = json.load(f)
    return state_dict, config


def write_peft_folder(out_dir: str | Path, tensors: Mapping[str, torch.Tensor], config: Any) -> Path:
    """Write a PEFT adapter folder from PEFT-named tensors at the true rank and the adapter_config.json content.

    `tensors`: `base_model.model.<module>.lora_A.weight` (r, in) and `...lora_B.weight` (out, r) per module;
    `config`: a dict (or a PEFT `LoraConfig`). Both are checked first with the rules the readers apply (config
    fields, key names, A/B pairs, shapes at rank r, target_modules), so a bad adapter writes nothing and what is
    written loads with `MultiLoRAModel.load_adapter` on a model with those modules. The weights are written before
    the config: a folder holding adapter_config.json is complete. Returns the folder (created if missing).
    """
    from safetensors.torch import save_file

    folder = Path(out_dir)
    config = _config_dict(config)
    _parse_peft_adapter(tensors, config, _implied_shapes(tensors), None, f"to write to {folder}")
    state_dict = {k: v.contiguous().cpu() for k, v in tensors.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state_dict, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    with open(folder / CONFIG_NAME, "w") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True))
    return folder
