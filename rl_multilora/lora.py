"""Many LoRA adapters on one frozen HF causal LM, each batch row routed through its own adapter slot.

Design choices:

- Slots are pre-allocated: every target `nn.Linear` is replaced in place by a `LoRALinear` that keeps the original
  `weight`/`bias` Parameters (frozen, same state-dict keys) and owns `max_loras` pairs of Parameters
  `lora_A[s]: (max_rank, in)`, `lora_B[s]: (out, max_rank)`. The parameter set never changes as tenants come and go
  (what FSDP sharding and per-tenant optimizers need), and a per-tenant optimizer owns exactly one slot's tensors.
- Mixed ranks: an adapter of rank r < max_rank uses rows/columns `[:r]` only. The forward slices the padded
  Parameters to the true rank, so the padded entries never enter the compute, their gradient is exactly zero
  (slice backward writes zeros) and AdamW leaves them at exactly zero (zero grad -> zero moments -> zero update;
  weight decay of zero is zero). Export slices to the true rank.
- Scale `alpha / r` is kept as a Python float (fp64, applied in the fp32 LoRA compute), never folded into B or
  rounded to the base dtype: a bf16 `32 / 24` would scale training and rollout differently (PRIOR_ART).
- LoRA tensors are float32 by default whatever the base dtype (as PEFT's `autocast_adapter_dtype`): the input is
  cast to the LoRA dtype and base + delta is summed in it and rounded once to the base dtype, like PEFT's LoRA
  `Linear.forward`, so a bf16 base gives PEFT's bf16 logits bit for bit.
- The row-to-slot mapping lives in one `SlotRouter` shared by all LoRA layers (vLLM's punica_wrapper idea), set
  for the duration of one forward and thread-local, so an engine thread and a trainer thread can share the model.
  It is computed once per forward (one host sync at most), not once per layer.
- Fast path (group by slot): each slot does two small matmuls at its true rank on its own rows only. When each
  slot's rows are contiguous in the batch (the trainer groups rows by adapter; a one-adapter batch always is) the
  layer reads row-range views and adds in place: no gather, no scatter. Otherwise rows are permuted once per
  forward; per layer the input is gathered once and the deltas are scattered back with one `index_add_`. Rows of
  one slot never enter another slot's matmuls, so a NaN/inf row cannot leak into other tenants' gradients (a
  one-hot-masked dense formulation would: 0 * NaN = NaN). A plain float32 per-row loop (`reference=True`) is the
  test oracle.
- `LoRABank` is the engine-side copy of all slots (stacked plain tensors, no autograd, shares no storage with the
  trainable Parameters): weight sync writes a trained adapter into the bank while the trainer keeps training.
- Adapters are PEFT folders (`adapter_config.json`, `adapter_model.safetensors`, keys
  `base_model.model.<module>.lora_A.weight`, true rank), so PEFT, vLLM and SGLang load them as they are. An adapter
  may cover a subset of the model's LoRA modules (e.g. a PEFT folder with q_proj/v_proj on an all-linear model);
  uncovered modules of its slot are skipped in the forward and in the export.

Deviations from PEFT: no LoRA dropout (GRPO rollouts and training should see the same function), no rsLoRA, DoRA,
LoRA bias or rank/alpha patterns (SGLang ignores or rejects them; loading such a folder raises).

Activation checkpointing recomputes layers in backward, outside the forward's routing scope: enable it with
`MultiLoRAModel.gradient_checkpointing_enable()`, which hands torch's non-reentrant checkpoint a `context_fn` that
re-installs, for each recompute, the routing captured when that layer ran forward. Checkpointing switched on
directly on `base_model` is refused in training (it would silently recompute without LoRA).
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ADAPTER_NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]+")
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
BASE_SLOT = -1

# PEFT LoraConfig fields whose non-default values change the math in ways this model (and SGLang) does not do.
_UNSUPPORTED_CONFIG = {
    "use_rslora": (False, None),
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "modules_to_save": (None, [], ()),
    "layer_replication": (None,),
    "target_parameters": (None, []),
    "trainable_token_indices": (None,),
}


class UnknownAdapterError(KeyError):
    """An adapter name that is not loaded. A KeyError whose message prints without repr quotes."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class AdapterInfo:
    """One loaded adapter: its name, slot, true rank and alpha (scale = alpha / rank)."""

    name: str
    slot: int
    rank: int
    alpha: float

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def validate_adapter_name(name: Any) -> str:
    """Return `name` if it is a usable adapter name (it becomes a path component), else raise ValueError."""
    if not isinstance(name, str) or not ADAPTER_NAME_PATTERN.fullmatch(name) or name in (".", ".."):
        raise ValueError(
            f"adapter name {name!r} is not allowed; allowed: a non-empty string of letters, digits, '.', '_', '-' "
            "other than '.' and '..'"
        )
    return name


def _check_rank(rank: Any, max_rank: int, field: str = "rank") -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= max_rank:
        raise ValueError(f"{field}={rank!r} is not allowed; allowed: an integer from 1 to max_rank={max_rank}")
    return rank


def _check_alpha(alpha: Any, field: str = "alpha") -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"{field}={alpha!r} is not allowed; allowed: a finite number > 0")
    return alpha


# ----------------------------------------------------------------------------------------------------------------
# Routing: which slot each batch row uses, shared by every LoRA layer for one forward.


@dataclass(frozen=True)
class _SlotGroup:
    """The rows of one slot: `rows[start:stop]` of the routing's permutation, or batch rows `start:stop` when the
    routing has no permutation (every slot's rows already contiguous)."""

    slot: int
    rank: int
    scale: float
    modules: frozenset[str]
    start: int
    stop: int


@dataclass(frozen=True)
class _Routing:
    batch_size: int
    slots: tuple[int, ...]  # per row; BASE_SLOT = base model
    groups: tuple[_SlotGroup, ...]
    rows: torch.Tensor | None  # (n_active,) row ids sorted by slot; None when each slot's rows are contiguous
    bank: LoRABank | None
    reference: bool


class SlotRouter:
    """Holds the current forward's row-to-slot routing; every LoRALinear of a model reads it from here."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def current(self) -> _Routing | None:
        return getattr(self._local, "routing", None)

    @contextlib.contextmanager
    def route(self, routing: _Routing) -> Iterator[None]:
        previous = self.current
        self._local.routing = routing
        try:
            yield
        finally:
            self._local.routing = previous


def _build_routing(
    slots: Sequence[int],
    slot_meta: Mapping[int, tuple[int, float, frozenset[str]]],
    device: torch.device,
    bank: LoRABank | None,
    reference: bool,
) -> _Routing:
    """Group rows by slot. `slot_meta[s] = (rank, scale, modules)` for every slot used by some row.

    A batch whose rows come grouped by adapter (what the trainer builds) needs no permutation: each slot is a
    contiguous row range and the layers work on views. Otherwise rows are permuted once here, for all layers.
    """
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(slots):
        if slot != BASE_SLOT:
            by_slot.setdefault(slot, []).append(row)
    if all(rows[-1] - rows[0] + 1 == len(rows) for rows in by_slot.values()):
        groups = [_SlotGroup(s, *slot_meta[s], rows[0], rows[-1] + 1) for s, rows in sorted(by_slot.items())]
        return _Routing(len(slots), tuple(slots), tuple(groups), None, bank, reference)
    groups, order = [], []
    for slot in sorted(by_slot):
        groups.append(_SlotGroup(slot, *slot_meta[slot], len(order), len(order) + len(by_slot[slot])))
        order.extend(by_slot[slot])
    rows = torch.tensor(order, dtype=torch.long, device=device)
    return _Routing(len(slots), tuple(slots), tuple(groups), rows, bank, reference)


# ----------------------------------------------------------------------------------------------------------------
# The layer.


class LoRALinear(nn.Module):
    """A frozen `nn.Linear` plus `max_loras` LoRA slots; the router says which slot each batch row uses.

    Keeps the original `weight` and `bias` Parameters under the same names, so the base state-dict keys do not
    change. Without an active routing (e.g. `base_model` called directly) it is the plain base layer.
    """

    def __init__(self, linear: nn.Linear, name: str, router: SlotRouter, max_loras: int, max_rank: int, dtype):
        super().__init__()
        self.name = name
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.router = router
        device = linear.weight.device
        self.lora_A = nn.ParameterList(
            nn.Parameter(torch.zeros(max_rank, self.in_features, dtype=dtype, device=device)) for _ in range(max_loras)
        )
        self.lora_B = nn.ParameterList(
            nn.Parameter(torch.zeros(self.out_features, max_rank, dtype=dtype, device=device))
            for _ in range(max_loras)
        )

    def extra_repr(self) -> str:
        return f"name={self.name}, in_features={self.in_features}, out_features={self.out_features}"

    def _slot_weights(self, routing: _Routing, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        if routing.bank is not None:
            return routing.bank.lora_weights(self.name, slot)
        return self.lora_A[slot], self.lora_B[slot]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)  # y: (B, ..., out), the base output computed once for all rows
        routing = self.router.current
        if routing is None or not routing.groups:
            return y
        if x.shape[0] != routing.batch_size:
            raise RuntimeError(
                f"LoRA layer {self.name} got input of shape {tuple(x.shape)} whose first dim is not the batch size "
                f"{routing.batch_size}; multi-LoRA routing needs batch-first inputs"
            )
        if routing.reference:
            return self._reference_forward(x, y, routing)
        groups = [g for g in routing.groups if self.name in g.modules]
        if not groups:
            return y
        lora_dtype = self.lora_A[0].dtype if routing.bank is None else routing.bank.dtype
        # Base + delta is summed in the LoRA dtype and rounded once to y's dtype, as PEFT does. `out` is y itself
        # when the dtypes match: updating it in place is safe because F.linear does not save its output.
        out = y.to(lora_dtype)  # out: (B, ..., out)
        if routing.rows is None:  # each slot's rows are contiguous: views in, in-place add out, no copies
            for g in groups:
                lora_a, lora_b = self._slot_weights(routing, g.slot)
                xa = F.linear(x[g.start : g.stop].to(lora_dtype), lora_a[: g.rank])  # x[g] @ A[s, :r].T; (n_s, ..., r)
                # out[g] += scale[s] * xa @ B[s, :, :r].T; add_ on the view (`out[g] += ...` would also setitem)
                out[g.start : g.stop].add_(F.linear(xa, lora_b[:, : g.rank]) * g.scale)
            return out.to(y.dtype)
        xs = x.index_select(0, routing.rows).to(lora_dtype)  # xs[j] = x[rows[j]]; xs: (n_active, ..., in)
        deltas, rows = [], []
        for g in groups:
            lora_a, lora_b = self._slot_weights(routing, g.slot)
            xa = F.linear(xs[g.start : g.stop], lora_a[: g.rank])  # xa = xs[g] @ A[s, :r].T; (n_s, ..., r)
            deltas.append(F.linear(xa, lora_b[:, : g.rank]) * g.scale)  # d = scale[s] * xa @ B[s, :, :r].T
            rows.append(routing.rows[g.start : g.stop])
        delta = torch.cat(deltas) if len(deltas) > 1 else deltas[0]  # delta: (n_covered, ..., out)
        index = routing.rows if len(groups) == len(routing.groups) else torch.cat(rows)
        return out.index_add_(0, index, delta).to(y.dtype)  # y[index[j]] += delta[j]

    def _reference_forward(self, x: torch.Tensor, y: torch.Tensor, routing: _Routing) -> torch.Tensor:
        """Plain float32 loop over rows with the full padded tensors: the oracle for the fast path."""
        meta = {g.slot: g for g in routing.groups}
        out = []
        for i, slot in enumerate(routing.slots):
            row = y[i].float()
            if slot != BASE_SLOT and self.name in meta[slot].modules:
                lora_a, lora_b = self._slot_weights(routing, slot)
                # y[i] += scale[s] * (x[i] @ A[s].T) @ B[s].T, s = slot[i]; x[i]: (..., in)
                row = row + meta[slot].scale * ((x[i].float() @ lora_a.float().T) @ lora_b.float().T)
            out.append(row)
        return torch.stack(out).to(y.dtype)


# ----------------------------------------------------------------------------------------------------------------
# PEFT I/O.


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
    max_rank: int,
    source: str,
) -> _ParsedAdapter:
    """Validate a PEFT LoRA state dict + config against this model's LoRA modules; every problem in one error."""
    config = _config_dict(config)
    problems: list[str] = []
    peft_type = str(config.get("peft_type", "")).split(".")[-1]
    if peft_type != "LORA":
        problems.append(f"peft_type={config.get('peft_type')!r}; allowed: 'LORA'")
    rank = config.get("r")
    try:
        _check_rank(rank, max_rank, "r")
    except ValueError as err:
        problems.append(str(err))
        rank = None
    alpha = config.get("lora_alpha")
    try:
        _check_alpha(alpha, "lora_alpha")
    except ValueError as err:
        problems.append(str(err))
    for key, allowed in _UNSUPPORTED_CONFIG.items():
        if key in config and config[key] not in allowed:
            problems.append(f"{key}={config[key]!r} is not supported; allowed: {allowed[0]!r}")
    targets = config.get("target_modules")
    # A string is a regex or "all-linear" in PEFT: then the keys alone decide which modules are covered.
    target_list = None if isinstance(targets, str) or targets is None else list(targets)

    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        match = re.fullmatch(re.escape(PEFT_PREFIX) + r"(.+)\.lora_(A|B)\.weight", key)
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
        state_dict = torch.load(folder / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{folder} is not a PEFT adapter folder: {WEIGHTS_NAME} is missing")
    with open(config_path) as f:
        config = json.load(f)
    return state_dict, config


# ----------------------------------------------------------------------------------------------------------------
# The engine-side bank.


class LoRABank:
    """Engine-side copy of every slot's LoRA tensors: plain stacked tensors, no autograd, no shared storage.

    Per LoRA module: `A: (max_loras, max_rank, in)`, `B: (max_loras, out, max_rank)`, zero-padded above each slot's
    rank. A slot with rank 0 is empty; routing a row to it raises.
    """

    def __init__(
        self,
        layer_shapes: Mapping[str, tuple[int, int]],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.layer_shapes = dict(layer_shapes)
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self._a = {
            m: torch.zeros(max_loras, max_rank, i, dtype=dtype, device=device)
            for m, (i, o) in self.layer_shapes.items()
        }
        self._b = {
            m: torch.zeros(max_loras, o, max_rank, dtype=dtype, device=device)
            for m, (i, o) in self.layer_shapes.items()
        }
        self._rank = [0] * max_loras
        self._alpha: list[float] = [0.0] * max_loras
        self._modules: list[frozenset[str]] = [frozenset()] * max_loras

    def _check_slot(self, slot: Any) -> int:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_loras:
            raise ValueError(f"slot={slot!r} is not allowed; allowed: an integer from 0 to {self.max_loras - 1}")
        return slot

    def set_adapter(self, slot: int, state_dict: Mapping[str, torch.Tensor], config: Any) -> None:
        """Write a PEFT-named adapter (true rank) into `slot`, zero-padded to max_rank; replaces what was there."""
        self._check_slot(slot)
        parsed = _parse_peft_adapter(state_dict, config, self.layer_shapes, self.max_rank, f"for bank slot {slot}")
        self._write(slot, parsed.rank, parsed.alpha, parsed.tensors)

    def _write(self, slot: int, rank: int, alpha: float, tensors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]):
        with torch.no_grad():
            for module in self.layer_shapes:
                self._a[module][slot].zero_()
                self._b[module][slot].zero_()
            for module, (lora_a, lora_b) in tensors.items():
                self._a[module][slot, :rank].copy_(lora_a)  # A[s, :r] = a; a: (r, in)
                self._b[module][slot, :, :rank].copy_(lora_b)  # B[s, :, :r] = b; b: (out, r)
        self._rank[slot], self._alpha[slot], self._modules[slot] = rank, alpha, frozenset(tensors)

    def clear(self, slot: int) -> None:
        """Empty `slot`: zero its tensors; rows routed to it now raise."""
        self._check_slot(slot)
        self._write(slot, 0, 0.0, {})

    def rank(self, slot: int) -> int:
        """The slot's true rank; 0 when empty."""
        return self._rank[self._check_slot(slot)]

    def is_set(self, slot: int) -> bool:
        return self.rank(slot) > 0

    def lora_weights(self, module: str, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A (max_rank, in), B (out, max_rank)) of `slot` in `module`, views into the bank."""
        return self._a[module][slot], self._b[module][slot]

    def slot_meta(self, slot: int) -> tuple[int, float, frozenset[str]]:
        if self._rank[slot] == 0:
            raise ValueError(f"adapter_slots names bank slot {slot}, which is empty; set it with bank.set_adapter")
        return self._rank[slot], self._alpha[slot] / self._rank[slot], self._modules[slot]


# ----------------------------------------------------------------------------------------------------------------
# The model.


@dataclass(frozen=True)
class _Slot:
    info: AdapterInfo
    modules: frozenset[str]


class MultiLoRAModel(nn.Module):
    """An HF causal LM with frozen base weights and `max_loras` pre-allocated LoRA slots of `max_rank`.

    `forward(input_ids, attention_mask=..., adapter_names=[...] | adapter_slots=..., lora_bank=..., **hf_kwargs)`
    returns the HF output; each row goes through its adapter (None / -1 = base).
    """

    def __init__(
        self,
        base_model: nn.Module,
        max_loras: int,
        max_rank: int,
        target_modules: str | Sequence[str] = "all-linear",
        lora_dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        for field, value in (("max_loras", max_loras), ("max_rank", max_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field}={value!r} is not allowed; allowed: an integer >= 1")
        if any(isinstance(m, LoRALinear) for m in base_model.modules()):
            raise ValueError("base_model already has LoRA layers injected; wrap the plain HF model once")
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.lora_dtype = lora_dtype
        self.router = SlotRouter()
        self.base_model = base_model
        for param in base_model.parameters():
            param.requires_grad_(False)
        names = _select_targets(base_model, target_modules)
        self._layers: dict[str, LoRALinear] = {}
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = base_model.get_submodule(parent_name) if parent_name else base_model
            layer = LoRALinear(getattr(parent, child), name, self.router, max_loras, max_rank, lora_dtype)
            setattr(parent, child, layer)
            self._layers[name] = layer
        self.target_modules = target_modules if isinstance(target_modules, str) else list(target_modules)
        self._slots: list[_Slot | None] = [None] * max_loras
        self.name_or_path = getattr(getattr(base_model, "config", None), "_name_or_path", None) or None
        self._routed_checkpointing = False

    # -- construction ------------------------------------------------------------------------------------------

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        max_loras: int = 4,
        max_rank: int = 16,
        target_modules: str | Sequence[str] = "all-linear",
        lora_dtype: torch.dtype = torch.float32,
    ) -> MultiLoRAModel:
        """Wrap an in-memory HF causal LM (its target Linears are replaced in place)."""
        return cls(model, max_loras, max_rank, target_modules, lora_dtype)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        max_loras: int = 4,
        max_rank: int = 16,
        target_modules: str | Sequence[str] = "all-linear",
        dtype: torch.dtype = torch.float32,
        lora_dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        **hf_kwargs: Any,
    ) -> MultiLoRAModel:
        """Load an HF causal LM from `path` (base in `dtype`, LoRA slots in `lora_dtype`) and wrap it."""
        import transformers
        from transformers import AutoModelForCausalLM

        # transformers renamed `torch_dtype` to `dtype` in 4.56; older versions would silently ignore `dtype`.
        major, minor = (int(v) for v in transformers.__version__.split(".")[:2])
        dtype_kwarg = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
        model = AutoModelForCausalLM.from_pretrained(str(path), **{dtype_kwarg: dtype}, **hf_kwargs)
        if device is not None:
            model = model.to(device)
        wrapped = cls(model.eval(), max_loras, max_rank, target_modules, lora_dtype)
        wrapped.name_or_path = str(path)
        return wrapped

    # -- introspection -----------------------------------------------------------------------------------------

    @property
    def config(self):
        return self.base_model.config

    @property
    def lora_modules(self) -> list[str]:
        """Names (inside base_model) of the LoRA-wrapped Linears, in model order."""
        return list(self._layers)

    @property
    def layer_shapes(self) -> dict[str, tuple[int, int]]:
        return {name: (layer.in_features, layer.out_features) for name, layer in self._layers.items()}

    @property
    def adapters(self) -> dict[str, AdapterInfo]:
        return {s.info.name: s.info for s in self._slots if s is not None}

    @property
    def free_slots(self) -> list[int]:
        return [i for i, s in enumerate(self._slots) if s is None]

    def _slot_record(self, name: str) -> _Slot:
        for record in self._slots:
            if record is not None and record.info.name == name:
                return record
        raise UnknownAdapterError(f"unknown adapter {name!r}; loaded: {sorted(self.adapters) or 'none'}")

    def slot_of(self, name: str) -> int:
        return self._slot_record(name).info.slot

    def adapter_parameters(self, name: str) -> list[nn.Parameter]:
        """The adapter's slot tensors (A then B per covered module, model order): what its optimizer owns."""
        record = self._slot_record(name)
        s = record.info.slot
        params: list[nn.Parameter] = []
        for module, layer in self._layers.items():
            if module in record.modules:
                params += [layer.lora_A[s], layer.lora_B[s]]
        return params

    # -- tenants come and go -----------------------------------------------------------------------------------

    def _claim_slot(self, name: str) -> int:
        validate_adapter_name(name)
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is already loaded in slot {self.slot_of(name)}; remove it first")
        free = self.free_slots
        if not free:
            raise RuntimeError(
                f"no free LoRA slot for adapter {name!r}: all max_loras={self.max_loras} slots are taken by "
                f"{sorted(self.adapters)}; remove one or build the model with a larger max_loras"
            )
        return free[0]

    def _reset_slot(self, slot: int) -> None:
        with torch.no_grad():
            for layer in self._layers.values():
                for param in (layer.lora_A[slot], layer.lora_B[slot]):
                    param.zero_()
                    param.grad = None

    def add_adapter(
        self, name: str, rank: int, alpha: float, seed: int | None = None, target_modules: Sequence[str] | None = None
    ) -> int:
        """Put a fresh adapter in the lowest free slot: A kaiming-uniform (PEFT's init) at rank `rank`, B zero.

        `seed` makes the init reproducible without touching the global RNG; None draws from the global RNG.
        `target_modules` (leaf names like "q_proj" or full module names) restricts the adapter to a subset of the
        model's LoRA modules; the others stay exactly zero and are neither trained nor exported. Returns the slot.
        """
        _check_rank(rank, self.max_rank)
        _check_alpha(alpha)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed={seed!r} is not allowed; allowed: an integer or None")
        covered = frozenset(self._layers)
        if isinstance(target_modules, str) and target_modules != "all-linear":
            target_modules = [target_modules]
        if target_modules is not None and target_modules != "all-linear":
            covered = frozenset(m for m in self._layers if any(_matches_target(m, t) for t in target_modules))
            if not covered:
                raise ValueError(
                    f"target_modules={list(target_modules)!r} matches none of the model's LoRA modules; allowed: "
                    f"names among {sorted({m.rsplit('.', 1)[-1] for m in self._layers})}"
                )
        slot = self._claim_slot(name)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=next(iter(self._layers.values())).lora_A[slot].device)
            generator.manual_seed(seed)
        self._reset_slot(slot)
        with torch.no_grad():
            for module, layer in self._layers.items():
                # The generator advances through every layer, so a subset adapter's covered layers get the same
                # init as the same layers of a full adapter with that seed.
                init = layer.lora_A[slot].new_empty(layer.lora_A[slot][:rank].shape)
                # PEFT's kaiming_uniform_(A, a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)); fan_in = in on the (r, in) view.
                nn.init.kaiming_uniform_(init, a=math.sqrt(5), generator=generator)
                if module in covered:
                    layer.lora_A[slot][:rank] = init
        self._slots[slot] = _Slot(AdapterInfo(name, slot, rank, alpha), covered)
        return slot

    def remove_adapter(self, name: str) -> None:
        """Free the adapter's slot: its tensors are zeroed and its grads dropped, so no trace reaches the next."""
        slot = self.slot_of(name)
        self._reset_slot(slot)
        self._slots[slot] = None

    # -- PEFT I/O ----------------------------------------------------------------------------------------------

    def adapter_state_dict(self, name: str) -> dict[str, torch.Tensor]:
        """PEFT-named detached copies at the true rank: `base_model.model.<module>.lora_A.weight` (r, in), B (out, r).

        Only the adapter's own slot tensors are gathered, never the full model state dict.
        """
        record = self._slot_record(name)
        s, r = record.info.slot, record.info.rank
        out: dict[str, torch.Tensor] = {}
        for module, layer in self._layers.items():
            if module in record.modules:
                out[_peft_key(module, "A")] = layer.lora_A[s][:r].detach().clone()
                out[_peft_key(module, "B")] = layer.lora_B[s][:, :r].detach().clone()
        return out

    def peft_config(self, name: str) -> dict[str, Any]:
        """The adapter_config.json content PEFT would write for this adapter."""
        from peft import LoraConfig

        record = self._slot_record(name)
        config = LoraConfig(
            r=record.info.rank,
            lora_alpha=record.info.alpha,
            target_modules=_target_modules_for(sorted(record.modules), self.lora_modules),
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
            base_model_name_or_path=self.name_or_path,
            inference_mode=True,
        ).to_dict()
        return json.loads(json.dumps({k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}))

    def export_adapter(self, name: str, out_dir: str | Path) -> Path:
        """Write the adapter as a PEFT folder (config + safetensors at the true rank); returns the folder."""
        from safetensors.torch import save_file

        state_dict = {k: v.contiguous().cpu() for k, v in self.adapter_state_dict(name).items()}
        config = self.peft_config(name)
        folder = Path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(state_dict, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
        with open(folder / CONFIG_NAME, "w") as f:
            f.write(json.dumps(config, indent=2, sort_keys=True))
        return folder

    def load_adapter(self, name: str, peft_dir: str | Path) -> int:
        """Load a PEFT folder into adapter `name` (added in the lowest free slot if absent); returns the slot."""
        state_dict, config = read_peft_folder(peft_dir)
        return self.load_adapter_state_dict(name, state_dict, config, source=str(peft_dir))

    def load_adapter_state_dict(
        self, name: str, state_dict: Mapping[str, torch.Tensor], config: Any, source: str | None = None
    ) -> int:
        """In-memory `load_adapter`: PEFT-named tensors + config dict -> the adapter's slot (zero-padded).

        Everything is validated before any slot is touched. An existing adapter keeps its slot and takes the new
        rank/alpha/weights; its stale grads are dropped.
        """
        validate_adapter_name(name)
        parsed = _parse_peft_adapter(state_dict, config, self.layer_shapes, self.max_rank, source or f"for {name!r}")
        slot = self.slot_of(name) if name in self.adapters else self._claim_slot(name)
        self._reset_slot(slot)
        with torch.no_grad():
            for module, (lora_a, lora_b) in parsed.tensors.items():
                layer = self._layers[module]
                layer.lora_A[slot][: parsed.rank].copy_(lora_a)  # A[s, :r] = a; a: (r, in)
                layer.lora_B[slot][:, : parsed.rank].copy_(lora_b)  # B[s, :, :r] = b; b: (out, r)
        self._slots[slot] = _Slot(AdapterInfo(name, slot, parsed.rank, parsed.alpha), frozenset(parsed.tensors))
        return slot

    def new_bank(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> LoRABank:
        """A LoRABank holding copies of every slot's current tensors (no storage shared with the Parameters)."""
        any_layer = next(iter(self._layers.values()))
        bank = LoRABank(
            self.layer_shapes,
            self.max_loras,
            self.max_rank,
            dtype or self.lora_dtype,
            device or any_layer.lora_A[0].device,
        )
        for record in self._slots:
            if record is not None:
                bank.set_adapter(
                    record.info.slot, self.adapter_state_dict(record.info.name), self.peft_config(record.info.name)
                )
        return bank

    # -- activation checkpointing ------------------------------------------------------------------------------

    def _checkpoint_contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        # torch's checkpoint calls this once per checkpointed layer in forward: the second context wraps that
        # layer's recompute in backward, which then sees the routing of the forward that saved it.
        return contextlib.nullcontext(), self.router.route(self.router.current)

    def gradient_checkpointing_enable(self) -> None:
        """Activation checkpointing of the HF decoder layers whose recompute replays each row's LoRA slot."""
        self.base_model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": self._checkpoint_contexts}
        )
        self._routed_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.base_model.gradient_checkpointing_disable()
        self._routed_checkpointing = False

    # -- forward -----------------------------------------------------------------------------------------------

    def _resolve_slots(
        self, batch_size: int, adapter_names: Sequence[str | None] | None, adapter_slots: Any, bank: LoRABank | None
    ) -> list[int]:
        if adapter_names is not None and adapter_slots is not None:
            raise ValueError("pass adapter_names or adapter_slots, not both")
        if adapter_names is not None:
            if bank is not None:
                raise ValueError("with lora_bank, route rows by adapter_slots (bank slots have no names)")
            if isinstance(adapter_names, str) or len(adapter_names) != batch_size:
                raise ValueError(
                    f"adapter_names={adapter_names!r} is not allowed; allowed: a list of {batch_size} names or None"
                )
            return [BASE_SLOT if n is None else self.slot_of(n) for n in adapter_names]
        if adapter_slots is None:
            return [BASE_SLOT] * batch_size
        slots = adapter_slots.tolist() if isinstance(adapter_slots, torch.Tensor) else list(adapter_slots)
        if len(slots) != batch_size or any(
            isinstance(s, bool) or not isinstance(s, numbers.Integral) or not BASE_SLOT <= s < self.max_loras
            for s in slots
        ):
            raise ValueError(
                f"adapter_slots={slots!r} is not allowed; allowed: {batch_size} integers from -1 (base) to "
                f"{self.max_loras - 1}"
            )
        if bank is None:
            empty = sorted({s for s in slots if s != BASE_SLOT and self._slots[s] is None})
            if empty:
                raise ValueError(f"adapter_slots names empty slot(s) {empty}; occupied: {self.adapters}")
        return [int(s) for s in slots]

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        adapter_names: Sequence[str | None] | None = None,
        adapter_slots: torch.Tensor | Sequence[int] | None = None,
        lora_bank: LoRABank | None = None,
        reference: bool = False,
        **hf_kwargs: Any,
    ):
        """Run the base model with each row routed through its adapter slot.

        Rows: `adapter_names` (None = base) or `adapter_slots` (-1 = base); neither = every row on the base.
        `lora_bank`: use the bank's tensors (by slot) instead of the trainable slots, under no_grad.
        `reference`: slow float32 per-row loop instead of the grouped fast path (the test oracle).
        Other kwargs (past_key_values, position_ids, use_cache, labels, ...) go to the HF model as they are.
        """
        embeds = hf_kwargs.get("inputs_embeds")
        batch_size = (input_ids if input_ids is not None else embeds).shape[0]
        if (
            self.training
            and torch.is_grad_enabled()
            and not self._routed_checkpointing
            and _checkpointing_on(self.base_model)
        ):
            raise RuntimeError(
                "gradient checkpointing was enabled on base_model directly: its recompute would run without the "
                "LoRA routing; use MultiLoRAModel.gradient_checkpointing_enable() instead"
            )
        slots = self._resolve_slots(batch_size, adapter_names, adapter_slots, lora_bank)
        if lora_bank is not None:
            meta = {s: lora_bank.slot_meta(s) for s in set(slots) if s != BASE_SLOT}
        else:
            meta = {
                s: (r.info.rank, r.info.scale, r.modules)
                for s in set(slots)
                if s != BASE_SLOT and (r := self._slots[s]) is not None
            }
        device = (input_ids if input_ids is not None else embeds).device
        routing = _build_routing(slots, meta, device, lora_bank, reference)
        grad_context = torch.no_grad() if lora_bank is not None else contextlib.nullcontext()
        with grad_context, self.router.route(routing):
            return self.base_model(input_ids=input_ids, attention_mask=attention_mask, **hf_kwargs)


def _checkpointing_on(model: nn.Module) -> bool:
    # transformers 5 renamed is_gradient_checkpointing (now deprecated) to is_activation_checkpointing.
    for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), attr):
            return bool(getattr(model, attr))
    return False


def _select_targets(model: nn.Module, target_modules: str | Sequence[str]) -> list[str]:
    """Names of the Linears to wrap: every Linear but the output embedding, or those matching a list (PEFT rule)."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if isinstance(target_modules, str):
        if target_modules != "all-linear":
            raise ValueError(
                f"target_modules={target_modules!r} is not allowed; allowed: 'all-linear' or a list of module names "
                "(e.g. ['q_proj', 'v_proj'])"
            )
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        names = [n for n, m in linears.items() if m is not output and n.rsplit(".", 1)[-1] != "lm_head"]
        if not names:
            raise ValueError("target_modules='all-linear' matched no nn.Linear in the model")
        return names
    targets = list(target_modules)
    if not targets or any(not isinstance(t, str) or not t for t in targets):
        raise ValueError(f"target_modules={targets!r} is not allowed; allowed: a non-empty list of module names")
    all_names = [name for name, _ in model.named_modules()]
    problems = []
    for t in targets:
        matched = [n for n in all_names if _matches_target(n, t)]
        if not matched:
            problems.append(f"{t!r} matches no module")
        problems += [f"{t!r} matches {n!r}, which is not an nn.Linear" for n in matched if n not in linears]
    if problems:
        raise ValueError(f"target_modules={targets!r} is not allowed: " + "; ".join(problems))
    return [n for n in linears if any(_matches_target(n, t) for t in targets)]
