"""Many LoRA adapters on one frozen HF causal LM, each batch row routed through its own adapter slot.

A leaf package: it imports nothing else of the project (`tests/test_layout.py` checks this), so the trainer, the
engines and the run config can all depend on it. Modules:

- `model.py`: `MultiLoRAModel`, the wrapped HF model (tenants come and go by slot, PEFT load/export, forward).
- `layer.py`: `LoRALinear`, the per-row-routed LoRA layer that replaces each target `nn.Linear`.
- `experts.py`: `LoRAExperts` / `ExpertLoRA`, per-slot per-expert LoRA on packed MoE expert weights
  (`target_parameters`), routed per token with its row's slot.
- `routing.py`: `SlotRouter` and the row-to-slot routing built once per forward.
- `bank.py`: `LoRABank`, the engine-side copy of every slot.
- `peft_io.py`: PEFT folders in and out, and the one copy of the adapter-name and PEFT-config rules.

The names below are imported on first use (PEP 562), so `import rl_multilora.lora.peft_io` (e.g. for
`validate_adapter_name` in config validation) does not import torch; `from rl_multilora.lora import X` works as
for any package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_multilora.lora.bank import LoRABank
    from rl_multilora.lora.experts import ExpertLoRA, LoRAExperts
    from rl_multilora.lora.layer import LoRALinear
    from rl_multilora.lora.model import AdapterInfo, MultiLoRAModel, UnknownAdapterError
    from rl_multilora.lora.peft_io import (
        ADAPTER_NAME_PATTERN,
        CONFIG_NAME,
        PEFT_PREFIX,
        WEIGHTS_NAME,
        AdapterFolderError,
        ExpertShape,
        peft_config_problems,
        read_peft_folder,
        validate_adapter_name,
        write_peft_folder,
    )
    from rl_multilora.lora.routing import BASE_SLOT, SlotRouter

_EXPORTS = {
    "MultiLoRAModel": "model",
    "AdapterInfo": "model",
    "UnknownAdapterError": "model",
    "LoRABank": "bank",
    "LoRALinear": "layer",
    "ExpertLoRA": "experts",
    "LoRAExperts": "experts",
    "ExpertShape": "peft_io",
    "SlotRouter": "routing",
    "BASE_SLOT": "routing",
    "ADAPTER_NAME_PATTERN": "peft_io",
    "CONFIG_NAME": "peft_io",
    "WEIGHTS_NAME": "peft_io",
    "PEFT_PREFIX": "peft_io",
    "peft_config_problems": "peft_io",
    "read_peft_folder": "peft_io",
    "AdapterFolderError": "peft_io",
    "validate_adapter_name": "peft_io",
    "write_peft_folder": "peft_io",
}

__all__ = [
    "ADAPTER_NAME_PATTERN",
    "AdapterInfo",
    "BASE_SLOT",
    "CONFIG_NAME",
    "ExpertLoRA",
    "ExpertShape",
    "LoRABank",
    "LoRAExperts",
    "LoRALinear",
    "MultiLoRAModel",
    "PEFT_PREFIX",
    "SlotRouter",
    "UnknownAdapterError",
    "WEIGHTS_NAME",
    "peft_config_problems",
    "AdapterFolderError",
    "read_peft_folder",
    "validate_adapter_name",
    "write_peft_folder",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
