"""`MultiLoRAModel`: many LoRA adapters on one frozen HF causal LM, each batch row routed through its own slot.

Design choices:

- Wrapping replaces every target `nn.Linear` in place by a `LoRALinear` (`layer.py`) with `max_loras` pre-allocated
  slots of `max_rank`; the model keeps which adapter (name, rank, alpha, covered modules) lives in which slot.
  Tenants come and go by slot: adding claims the lowest free one, removing zeroes it and drops its grads.
- One forward routes each row by `adapter_names` (None = base) or `adapter_slots` (-1 = base), through the model's
  own slots or, with `lora_bank=`, through a `LoRABank` (`bank.py`, the engine's copy); the routing is built once
  per forward (`routing.py`).
- Adapters load from and export to PEFT folders (`peft_io.py`), at the true rank; an adapter may cover a subset
  of the model's LoRA modules, and uncovered modules of its slot are skipped in the forward and in the export.
- MoE experts: `target_parameters` (PEFT's name, e.g. `["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]`)
  lists packed 3-D expert Parameters that get per-slot, per-expert LoRA (`experts.py`), routed per token with its
  row's slot; they are exported in PEFT's `target_parameters` layout. "all-linear" never wraps a router or gate
  Linear (`gate`, `router`, `shared_expert_gate`, a Linear subclass named like a router): LoRA on a router changes
  which experts a token reaches, so it is only put there when named explicitly. An adapter's slot tensors list its
  Linear modules' A and B first (model order), then its expert Parameters' A and B (model order).
- Activation checkpointing recomputes layers in backward, outside the forward's routing scope: enable it with
  `MultiLoRAModel.gradient_checkpointing_enable()`, which hands torch's non-reentrant checkpoint a `context_fn` that
  re-installs, for each recompute, the routing captured when that layer ran forward. Checkpointing switched on
  directly on `base_model` is refused in training (it would silently recompute without LoRA).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rl_multilora.lora._errors import bad_value
from rl_multilora.lora.bank import LoRABank
from rl_multilora.lora.experts import (
    EXPERT_LORA_MODES,
    EXPERT_PARAMS,
    ExpertLoRA,
    LoRAExperts,
    expert_a_per_expert,
    init_expert_a,
    inject_expert_lora,
    is_packed_experts,
)
from rl_multilora.lora.layer import LoRALinear
from rl_multilora.lora.peft_io import (
    ExpertShape,
    check_alpha,
    check_rank,
    expert_key_stems,
    expert_to_peft,
    matches_target,
    parse_peft_adapter,
    peft_key,
    read_peft_folder,
    target_modules_for,
    target_parameters_for,
    validate_adapter_name,
    write_peft_folder,
)
from rl_multilora.lora.routing import BASE_SLOT, SlotGradSink, SlotRouter, build_routing

# The most bytes paging stages at once (`take_adapters` / `place_adapters` go through a buffer of this size, kept
# between steps; more adapters than fit are staged in runs): 64 MiB, 13 adapters at SmolLM2-135M's shape at rank 4.
STAGING_BYTES = 64 * 2**20

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class _Slot:
    info: AdapterInfo
    modules: frozenset[str]


def _foldable_head_input(module: nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook of the output head: a non-contiguous input of 3+ dims is made contiguous.

    HF models call `lm_head(hidden[:, -k:, :])`: with k shorter than the sequence (an engine's prefill keeps the last
    position, the trainer's logits the loss region) that is a strided view, which `torch.matmul` cannot fold into
    one `(B*k, H) @ (H, V)` product. With a frozen head (no grad, as every base weight here) it then broadcasts the
    weight over the batch into `bmm`; on CPU with a bfloat16 base that copies the whole (V, H) head once per row:
    a 12-row, 60-token prefill took 1.2 s and 650 MiB for what a contiguous input does in 5 ms (float32: 67 ms
    against 27; pytorch/pytorch#186148, #151934). The copy costs B x k x H values, against the B x k x V logits."""
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and x.dim() > 2 and not x.is_contiguous():
        return (x.contiguous(), *args[1:])
    return None


def _scales_logits(key: str) -> bool:
    """Whether a model-config key may scale or cap the logits past `lm_head(hidden)`: Gemma's
    `final_logit_softcapping`, Cohere's `logit_scale`, Granite's `logits_scaling`, Falcon-H1's `lm_head_multiplier`,
    `output_multiplier` and the like. Broad on purpose: a key that is not one (Gemma 2's attention soft-capping) only
    sends the trainer to the model's own logits, which is correct, where a missed one gave wrong log-probs."""
    return "logit" in key or key.startswith(("lm_head", "output_multiplier"))


class MultiLoRAModel(nn.Module):
    """An HF causal LM with frozen base weights and `max_loras` pre-allocated LoRA slots of `max_rank`.

    `forward(input_ids, attention_mask=..., adapter_names=[...] | adapter_slots=..., lora_bank=..., **hf_kwargs)`
    returns the HF output; each row goes through its adapter (None / -1 = base).

    `lora_autocast`: the LoRA products of the model's own slots run in the base's dtype (bf16 / fp16), the
    `lora_dtype` slots cast to it per forward, as `torch.autocast` runs PEFT's LoRA under TRL's `bf16: true`; the
    slots, their gradients and the optimizer stay in `lora_dtype`. Off (the default), an input is cast to
    `lora_dtype` and base + delta summed in it, PEFT's default (`autocast_adapter_dtype`) bit for bit. A bank's
    forwards (engines) keep the bank's dtype; expert LoRA and the `reference` loop ignore it.
    """

    def __init__(
        self,
        base_model: nn.Module,
        max_loras: int,
        max_rank: int,
        target_modules: str | Sequence[str] = "all-linear",
        lora_dtype: torch.dtype = torch.float32,
        target_parameters: Sequence[str] | None = None,
        expert_lora: str = "per_expert",
        lora_autocast: bool = False,
    ):
        super().__init__()
        if expert_lora not in EXPERT_LORA_MODES:
            raise ValueError(bad_value("expert_lora", expert_lora, " or ".join(repr(m) for m in EXPERT_LORA_MODES)))
        for field, value in (("max_loras", max_loras), ("max_rank", max_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(bad_value(field, value, "an integer >= 1"))
        if any(isinstance(m, (LoRALinear, LoRAExperts)) for m in base_model.modules()):
            raise ValueError("base_model already has LoRA layers injected; wrap the plain HF model once")
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.lora_dtype = lora_dtype
        self.lora_autocast = bool(lora_autocast)
        self.router = SlotRouter()
        self.base_model = base_model
        self._head_is_plain: bool | None = None  # `output_head`'s probe, run once
        for param in base_model.parameters():
            param.requires_grad_(False)
        expert_targets = select_parameters(base_model, target_parameters)
        names = select_targets(base_model, target_modules, allow_empty=bool(expert_targets))
        self._layers: dict[str, LoRALinear] = {}
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = base_model.get_submodule(parent_name) if parent_name else base_model
            layer = LoRALinear(getattr(parent, child), name, self.router, max_loras, max_rank, lora_dtype)
            setattr(parent, child, layer)
            self._layers[name] = layer
        self._experts: dict[str, ExpertLoRA] = {}  # full Parameter name -> its slots, model order
        self._expert_shapes: dict[str, ExpertShape] = {}
        for module_name, params in expert_targets.items():
            module = base_model.get_submodule(module_name)
            holders = inject_expert_lora(
                module, module_name, params, self.router, max_loras, max_rank, lora_dtype, expert_lora == "shared_a"
            )
            for (name, holder), param in zip(holders.items(), params, strict=True):
                self._experts[name] = holder
                shape = (holder.num_experts, holder.in_features, holder.out_features)
                self._expert_shapes[name] = ExpertShape(
                    module_name, param, *shape, shared_a=holder.shared_a, transposed=holder.is_transposed
                )
        head = base_model.get_output_embeddings() if hasattr(base_model, "get_output_embeddings") else None
        self._head_fold = head.register_forward_pre_hook(_foldable_head_input) if isinstance(head, nn.Module) else None
        self.target_modules = target_modules if isinstance(target_modules, str) else list(target_modules)
        self.target_parameters = list(target_parameters) if target_parameters else []
        self.expert_lora = expert_lora
        self._slots: list[_Slot | None] = [None] * max_loras
        self.name_or_path = getattr(getattr(base_model, "config", None), "_name_or_path", None) or None
        self._routed_checkpointing = False
        self._grad_sink: SlotGradSink | None = None  # `use_slot_grads`
        self._slot_params: dict[tuple[int, int], dict[str, tuple[nn.Parameter, nn.Parameter]]] = {}  # (slot, rank)
        self._slot_params_of: tuple[int, torch.dtype] | None = None  # the slots they alias
        self._staging: torch.Tensor | None = None  # paging's staging buffer (`_staging_buffer`)

    # -- construction ------------------------------------------------------------------------------------------

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        max_loras: int = 4,
        max_rank: int = 16,
        target_modules: str | Sequence[str] = "all-linear",
        lora_dtype: torch.dtype = torch.float32,
        target_parameters: Sequence[str] | None = None,
        expert_lora: str = "per_expert",
        lora_autocast: bool = False,
    ) -> MultiLoRAModel:
        """Wrap an in-memory HF causal LM (its target Linears are replaced in place, its target expert modules get
        LoRA slots)."""
        return cls(
            model, max_loras, max_rank, target_modules, lora_dtype, target_parameters, expert_lora, lora_autocast
        )

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
        target_parameters: Sequence[str] | None = None,
        expert_lora: str = "per_expert",
        lora_autocast: bool = False,
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
        args = (max_loras, max_rank, target_modules, lora_dtype, target_parameters, expert_lora, lora_autocast)
        wrapped = cls(model.eval(), *args)
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
    def lora_parameters(self) -> list[str]:
        """Full names (inside base_model) of the packed expert Parameters with LoRA slots, in model order."""
        return list(self._experts)

    @property
    def expert_shapes(self) -> dict[str, ExpertShape]:
        """Per expert LoRA Parameter: its module, name, number of experts and the matmul's in/out sizes."""
        return dict(self._expert_shapes)

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

    def adapter_parameters(self, name: str, true_rank: bool = False) -> list[nn.Parameter]:
        """Leaf Parameters that alias the adapter's slot in the stacked tensors (A `(max_rank, in)` then B
        `(out, max_rank)` per covered module, model order; then A `(E, max_rank, in)` and B `(E, out, max_rank)` per
        covered expert Parameter, model order): what its optimizer owns.

        They share storage with the slot, so an optimizer step on them updates the model in place, and they are
        what the adapter had before slots were stacked (same shapes, order and optimizer state). The forward's
        gradients land in the stacked tensors' `.grad`; `attach_slot_grads` points these views' `.grad` at the
        slot's part of it. On a model sharded over ranks (FSDP2) only the rank holding the slot gets them; the others
        get an empty list.

        `true_rank`: views of the adapter's first `rank` ranks only (A `(..., r, in)`, B `(..., out, r)`, a strided
        view of the slot), what the trainer's optimizer steps: its AdamW moments are then the size of the adapter,
        not of the slot (the ranks above hold exact zeros, get exactly zero gradient and would stay zero; an
        elementwise AdamW gives every entry below the rank the same bits either way).
        """
        if true_rank:
            return [nn.Parameter(v) for v in self.adapter_slot_tensors(name)]
        views = [_local_slot(stacked.detach(), s) for stacked, s in self._slot_tensors(name)]
        return [nn.Parameter(v) for v in views if v is not None]

    def slot_parameters(self, name: str) -> list[nn.Parameter]:
        """`adapter_parameters(name, true_rank=True)`, but the same Parameter objects for every adapter of that rank
        that sits in that slot: made once per slot, module and rank, not per call. For a trainer that pages: it re-attaches an optimizer after every
        page-in, and making 2 Parameters per module each time was a fifth of a page-in on the tiny preset. Whoever
        held them before must have let go (`TenantOptimizer.release`). Unsharded models only."""
        record = self._slot_record(name)
        first = self._first_stacked()
        if self._slot_params_of != (first.data_ptr(), first.dtype):  # the slots moved (`model.to`): made afresh
            self._slot_params.clear()
            self._slot_params_of = (first.data_ptr(), first.dtype)
        s, r = record.info.slot, record.info.rank
        per_module = self._slot_params.setdefault((s, r), {})
        out: list[nn.Parameter] = []
        for module, holder in (*self._layers.items(), *self._experts.items()):
            if module in record.modules:
                pair = per_module.get(module)
                if pair is None:
                    a, b = holder.lora_A.detach(), holder.lora_B.detach()
                    pair = per_module[module] = (
                        nn.Parameter(a[s][_rank_index(a, r, "A")]),
                        nn.Parameter(b[s][_rank_index(b, r, "B")]),
                    )
                out += pair
        return out

    def _first_stacked(self) -> nn.Parameter:
        """The first stacked LoRA tensor (`_stacked_pairs()[0][0]` without building the list)."""
        return next(iter(self._layers.values())).lora_A if self._layers else next(iter(self._experts.values())).lora_A

    def _local_slot_tensors(self, name: str) -> list[tuple[torch.Tensor, int]]:
        """`_slot_tensors` of the slot rows this rank holds (all of them unless the model is sharded)."""
        return [
            (stacked, s) for stacked, s in self._slot_tensors(name) if _local_slot(stacked.detach(), s) is not None
        ]

    def _slot_tensors(self, name: str) -> list[tuple[nn.Parameter, int]]:
        record = self._slot_record(name)
        s = record.info.slot
        pairs: list[tuple[nn.Parameter, int]] = []
        for module, layer in self._layers.items():
            if module in record.modules:
                pairs += [(layer.lora_A, s), (layer.lora_B, s)]
        for name, holder in self._experts.items():
            if name in record.modules:
                pairs += [(holder.lora_A, s), (holder.lora_B, s)]
        return pairs

    def _stacked_pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(lora_A, lora_B) of every LoRA Linear and every expert Parameter: all slots' tensors."""
        return [(m.lora_A, m.lora_B) for m in (*self._layers.values(), *self._experts.values())]

    def attach_slot_grads(self, name: str, params: Sequence[torch.Tensor]) -> None:
        """Set each of `params`' (from `adapter_parameters(name)`) `.grad` to the slot's part of the stacked grads
        (a view: clipping it in place clips the stacked grad), or None where the backward left none."""
        pairs = self._local_slot_tensors(name)
        if len(pairs) != len(params):
            raise ValueError(f"adapter {name!r} has {len(pairs)} slot tensors, got {len(params)} parameters")
        for param, (stacked, s) in zip(params, pairs, strict=True):
            view = _local_slot(stacked.detach(), s)
            if param.data_ptr() != view.data_ptr() or param.shape != view.shape:
                raise ValueError(f"parameters given for adapter {name!r} do not alias its slot {s}")
            param.grad = None if stacked.grad is None else _local_slot(stacked.grad, s)

    def use_slot_grads(self) -> None:
        """From now on the backward keeps the Linear LoRA gradients of the slots that had rows only (a
        `SlotGradSink`, read through `adapter_grads`) instead of zero-filled all-slots `.grad` tensors: what a trainer
        that takes each tenant's gradient right after the backward wants (`rl_multilora.train_ops`). Not for a model
        sharded over ranks, whose reduce-scatter needs the stacked grads."""
        self._grad_sink = SlotGradSink()

    def adapter_grads(self, name: str, true_rank: bool = False) -> list[torch.Tensor | None]:
        """The slot's part of the stacked grads, in `adapter_parameters` order (views; None before any backward).
        A slot without rows in the backward gets exactly zero here (None from a `use_slot_grads` sink): the gather's
        backward adds only into the slots that rows used. `true_rank`: the first `rank` ranks only, the shapes of
        `adapter_parameters(name, true_rank=True)`."""
        sink = self._grad_sink
        grads = [
            sink.slot_grad(stacked, s)
            if sink is not None and sink.holds(stacked)
            else (None if stacked.grad is None else _local_slot(stacked.grad, s))
            for stacked, s in self._local_slot_tensors(name)
        ]
        if not true_rank:
            return grads
        r = self._slot_record(name).info.rank
        return [None if g is None else _at_rank(g, r, i) for i, g in enumerate(grads)]

    def zero_lora_grads(self) -> None:
        """Drop the stacked LoRA grads of every slot (what the next backward accumulates into)."""
        for lora_a, lora_b in self._stacked_pairs():
            lora_a.grad = None
            lora_b.grad = None
        if self._grad_sink is not None:
            self._grad_sink.clear()

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
            for pair in self._stacked_pairs():
                for stacked in pair:
                    for tensor in (stacked, stacked.grad):
                        view = None if tensor is None else _local_slot(tensor, slot)
                        if view is not None:
                            view.zero_()

    def add_adapter(
        self,
        name: str,
        rank: int,
        alpha: float,
        seed: int | None = None,
        target_modules: Sequence[str] | None = None,
        target_parameters: Sequence[str] | None = None,
    ) -> int:
        """Put a fresh adapter in the lowest free slot: A kaiming-uniform (PEFT's init) at rank `rank`, B zero.

        `seed` makes the init reproducible without touching the global RNG; None draws from the global RNG.
        `target_modules` (leaf names like "q_proj" or full module names) restricts the adapter to a subset of the
        model's LoRA modules, `target_parameters` (e.g. "mlp.experts.down_proj") to a subset of its expert LoRA
        Parameters; None means all of them, [] none. The others stay exactly zero and are neither trained nor
        exported. Returns the slot.
        """
        check_rank(rank, self.max_rank)
        check_alpha(alpha)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(bad_value("seed", seed, "an integer or None"))
        covered = _covered(self._layers, target_modules, "target_modules", all_name="all-linear")
        covered |= _covered(self._experts, target_parameters, "target_parameters")
        if not covered:
            raise ValueError(
                bad_value(
                    "target_modules", target_modules, "a selection covering at least one LoRA module or parameter"
                )
            )
        slot = self._claim_slot(name)
        first = self._stacked_pairs()[0][0]
        generator = None
        if seed is not None:
            generator = torch.Generator(device=first.device)
            generator.manual_seed(seed)
        self._reset_slot(slot)
        with torch.no_grad():
            for module, layer in self._layers.items():
                # The generator advances through every layer, so a subset adapter's covered layers get the same
                # init as the same layers of a full adapter with that seed.
                a = layer.lora_A
                init = torch.empty((rank, *a.shape[2:]), dtype=a.dtype, device=a.device)
                # PEFT's kaiming_uniform_(A, a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)); fan_in = in on the (r, in) view.
                nn.init.kaiming_uniform_(init, a=math.sqrt(5), generator=generator)
                if module in covered and (view := _local_slot(a, slot)) is not None:
                    view[:rank] = init
            for param, holder in self._experts.items():  # after the Linears: a Linear-only model draws as before
                a = holder.lora_A
                like = torch.empty((), dtype=a.dtype, device=a.device).expand(a.shape[1:])  # the slot's shape
                init = init_expert_a(like, rank, generator)  # (E, r, in)
                if param in covered and (view := _local_slot(a, slot)) is not None:
                    view[:, :rank] = init
        self._slots[slot] = _Slot(AdapterInfo(name, slot, rank, alpha), covered)
        return slot

    def remove_adapter(self, name: str) -> None:
        """Free the adapter's slot: its tensors are zeroed and its grads dropped, so no trace reaches the next."""
        slot = self.slot_of(name)
        self._reset_slot(slot)
        self._slots[slot] = None

    # -- paging (a host tenant store holds the tenants without a slot: rl_multilora.tenant_store) ---------------

    @property
    def lora_device(self) -> torch.device:
        """Where the LoRA slots live."""
        return self._first_stacked().device

    def adapter_modules(self, name: str) -> frozenset[str]:
        """The LoRA modules and expert Parameters `name`'s slot covers."""
        return self._slot_record(name).modules

    def adapter_slot_tensors(self, name: str) -> list[torch.Tensor]:
        """`adapter_parameters(name)`' tensors at the adapter's true rank (views; A `(..., r, in)`, B
        `(..., out, r)`): everything of the slot that is not an exact zero."""
        r = self._slot_record(name).info.rank
        return [
            _local_slot(stacked.detach(), s)[_rank_index(stacked, r, "B" if i % 2 else "A")]
            for i, (stacked, s) in enumerate(self._local_slot_tensors(name))
        ]

    def adapter_tensor_shapes(self, rank: int, modules: frozenset[str]) -> list[torch.Size]:
        """The shapes of `adapter_slot_tensors` of an adapter of `rank` covering `modules` (A `(..., r, in)`, B
        `(..., out, r)`), in their order: how `take_adapters`' flat tensor splits."""
        return [_at_rank(stacked, rank, i).shape[1:] for i, stacked in enumerate(self._covered_stacked(modules))]

    def split_adapter_tensors(self, flat: torch.Tensor, rank: int, modules: frozenset[str]) -> list[torch.Tensor]:
        """A flat tensor of `take_adapters` as the `adapter_slot_tensors` it holds (views of it)."""
        shapes = self.adapter_tensor_shapes(rank, modules)
        parts = flat.split([s.numel() for s in shapes])
        return [p.view(s) for p, s in zip(parts, shapes, strict=True)]

    def take_adapters(self, names: Sequence[str]) -> list[torch.Tensor]:
        """Remove the adapters `names` (paging them out) and return each one's slot at its true rank as one flat
        host tensor: its `adapter_slot_tensors`, flattened one after the other (`split_adapter_tensors` splits it).

        One gather per stacked tensor for all the adapters of one rank and module set, instead of one copy per
        adapter and tensor (the per-tensor Python and dispatch cost was most of a page-out on the tiny preset); the
        freed slots are zeroed, grads included, as `remove_adapter` does. Not for a model sharded over ranks."""
        records = [self._slot_record(n) for n in names]
        if len({id(r) for r in records}) != len(records):
            raise ValueError(bad_value("names", list(names), "distinct adapter names"))
        self._check_unsharded()
        device = self.lora_device
        out: list[torch.Tensor | None] = [None] * len(records)
        groups: dict[tuple[int, frozenset[str]], list[int]] = {}
        for i, record in enumerate(records):
            groups.setdefault((record.info.rank, record.modules), []).append(i)
        with torch.no_grad():
            for (rank, modules), group in groups.items():
                # every slot of each tensor at the true rank: A (S, ..., r, in), B (S, ..., out, r)
                parts = [_at_rank(t.detach(), rank, i) for i, t in enumerate(self._covered_stacked(modules))]
                sizes = [math.prod(p.shape[1:]) for p in parts]
                for members in self._staging_chunks(group, sum(sizes)):
                    slots = torch.tensor([records[i].info.slot for i in members], device=device)
                    staging = self._staging_buffer(len(members), sum(sizes))  # (k, total)
                    offset = 0
                    for part, size in zip(parts, sizes, strict=True):
                        # staging[m, offset:offset + size] = part[slots[m]].flatten(), for every member m at once
                        view = staging[:, offset : offset + size].view(-1, *part.shape[1:])
                        torch.index_select(part, 0, slots, out=view)
                        offset += size
                    for row, i in zip(staging, members, strict=True):
                        out[i] = row.to("cpu", copy=True)  # its own storage: the store frees and spills one by one
            self._zero_slots([r.info.slot for r in records])
        for record in records:
            self._slots[record.info.slot] = None
        return out

    def place_adapters(self, adapters: Sequence[tuple[str, int, float, frozenset[str], torch.Tensor]]) -> list[int]:
        """Put adapters back into the lowest free slots from `take_adapters`' flat tensors: `adapters` holds (name,
        rank, alpha, modules, flat) each. A free slot holds zeros (`remove_adapter` and `take_adapters` zero what
        they free), so writing the true ranks of the covered tensors gives back the whole slot: one scatter per
        stacked tensor for all the adapters of one rank and module set. Everything is checked before any slot is
        written. Returns their slots, in order."""
        self._check_unsharded()
        free = self.free_slots
        if len(adapters) > len(free):
            raise RuntimeError(
                f"no free LoRA slot for {len(adapters) - len(free)} of {[a[0] for a in adapters]}: "
                f"{len(free)} of max_loras={self.max_loras} slots are free"
            )
        names = [a[0] for a in adapters]
        for name in names:
            validate_adapter_name(name)
        if len(set(names)) != len(names) or set(names) & set(self.adapters):
            raise ValueError(bad_value("adapters", names, "distinct names of adapters that are not loaded"))
        groups: dict[tuple[int, frozenset[str]], list[int]] = {}
        for i, (_, rank, _, modules, _) in enumerate(adapters):
            unknown = set(modules) - set(self._layers) - set(self._experts)
            if unknown:
                raise ValueError(
                    bad_value("modules", sorted(unknown), "LoRA modules or expert Parameters of the model")
                )
            check_rank(rank, self.max_rank)
            groups.setdefault((rank, frozenset(modules)), []).append(i)
        plans = []  # per group: its members and its tensors' true-rank views of every slot; all checked before writing
        for (rank, modules), members in groups.items():
            parts = [_at_rank(t.detach(), rank, i) for i, t in enumerate(self._covered_stacked(modules))]
            total = sum(math.prod(p.shape[1:]) for p in parts)
            flats = [adapters[i][4] for i in members]
            if any(f.dim() != 1 or f.numel() != total for f in flats):
                raise ValueError(bad_value("flat", [tuple(f.shape) for f in flats], f"1-D tensors of {total} values"))
            plans.append((members, parts, flats))
        slots = free[: len(adapters)]
        device = self.lora_device
        with torch.no_grad():  # the free slots hold zeros (`remove_adapter` and `take_adapters` zero what they free)
            for group, parts, flats in plans:
                total = flats[0].numel()
                for members in self._staging_chunks(range(len(group)), total):
                    source = self._staging_buffer(len(members), total)  # (k, total)
                    torch.stack([flats[m] for m in members], out=source)  # from host memory when the slots are not
                    index = torch.tensor([slots[group[m]] for m in members], device=device)
                    offset = 0
                    for part in parts:
                        size = math.prod(part.shape[1:])
                        # part[index[m]] = source[m, offset:offset + size], for every member m at once
                        part.index_copy_(0, index, source[:, offset : offset + size].view(-1, *part.shape[1:]))
                        offset += size
        for (name, rank, alpha, modules, _), slot in zip(adapters, slots, strict=True):
            self._slots[slot] = _Slot(AdapterInfo(name, slot, rank, alpha), frozenset(modules))
        return slots

    def _staging_chunks(self, members: Sequence[int], total: int) -> list[Sequence[int]]:
        """`members` in runs whose `(k, total)` staging fits `STAGING_BYTES` (one member at least)."""
        per = max(1, STAGING_BYTES // (total * self.lora_dtype.itemsize))
        return [members[k : k + per] for k in range(0, len(members), per)]

    def _staging_buffer(self, k: int, total: int) -> torch.Tensor:
        """A `(k, total)` view of the model's paging staging buffer (kept between calls and grown on demand: a fresh
        buffer of a step's adapters cost more in page faults than the copies through it, 4x at SmolLM2's shape).
        Its content is only valid until the next call."""
        need = k * total
        if self._staging is None or self._staging.numel() < need or self._staging.device != self.lora_device:
            self._staging = torch.empty(need, dtype=self.lora_dtype, device=self.lora_device)
        return self._staging[:need].view(k, total)

    def _covered_stacked(self, modules: frozenset[str]) -> list[nn.Parameter]:
        """The stacked tensors of an adapter covering `modules`, in `adapter_parameters` order."""
        out: list[nn.Parameter] = []
        for module, layer in self._layers.items():
            if module in modules:
                out += [layer.lora_A, layer.lora_B]
        for param, holder in self._experts.items():
            if param in modules:
                out += [holder.lora_A, holder.lora_B]
        return out

    def _zero_slots(self, slots: Sequence[int]) -> None:
        """`_reset_slot` of several slots at once: one `index_fill_` per stacked tensor and grad."""
        if not slots:
            return
        index = torch.tensor(list(slots), device=self.lora_device)
        with torch.no_grad():
            for pair in self._stacked_pairs():
                for stacked in pair:
                    for tensor in (stacked.detach(), stacked.grad):
                        if tensor is not None:
                            tensor.index_fill_(0, index, 0)

    def _check_unsharded(self) -> None:
        if getattr(self._first_stacked(), "device_mesh", None) is not None:
            raise RuntimeError("paging adapters in and out is not supported on a model sharded over ranks")

    # -- PEFT I/O ----------------------------------------------------------------------------------------------

    def adapter_state_dict(self, name: str, read_slot=None) -> dict[str, torch.Tensor]:
        """PEFT-named detached copies at the true rank: `base_model.model.<module>.lora_A.weight` (r, in), B (out, r);
        expert Parameters in PEFT's `target_parameters` keys and layout (`peft_io.py`).

        Only the adapter's own slot tensors are gathered, never the full model state dict, and only their first r
        ranks. `read_slot(stacked, s, index)` returns `stacked[s][index]` (the default; a sharded model fetches it
        from the rank holding slot `s`, so only the true-rank part travels).
        """
        record = self._slot_record(name)
        s, r = record.info.slot, record.info.rank
        read = read_slot or (lambda stacked, slot, index: stacked[slot][index])
        out: dict[str, torch.Tensor] = {}
        for module, layer in self._layers.items():
            if module in record.modules:
                out[peft_key(module, "A")] = read(layer.lora_A, s, _rank_index(layer.lora_A, r, "A")).detach().clone()
                out[peft_key(module, "B")] = read(layer.lora_B, s, _rank_index(layer.lora_B, r, "B")).detach().clone()
        stems = expert_key_stems(record.modules, self._expert_shapes)
        for param, stem in stems.items():
            holder = self._experts[param]
            # PEFT's layout: A (E * r, in) expert-major, B (out, r * E) expert-fastest; (E, r, in) / (E, out, r) here
            # (a shared A is written once per expert: PEFT and every per-expert loader read it as it is)
            a_slot = read(holder.lora_A, s, _rank_index(holder.lora_A, r, "A")).detach()
            lora_a = expert_a_per_expert(a_slot, holder.num_experts)
            lora_a, lora_b = expert_to_peft(
                lora_a, read(holder.lora_B, s, _rank_index(holder.lora_B, r, "B")).detach()
            )
            out[f"{stem}.lora_A.weight"] = lora_a.clone()
            out[f"{stem}.lora_B.weight"] = lora_b.contiguous().clone()
        return out

    def peft_config(self, name: str) -> dict[str, Any]:
        """The adapter_config.json content PEFT would write for this adapter."""
        from peft import LoraConfig

        record = self._slot_record(name)
        modules = sorted(m for m in record.modules if m in self._layers)
        params = sorted(p for p in record.modules if p in self._experts)
        extra = {}
        if params:  # PEFT matches target_parameters against the base model's Parameter names
            base_params = [n for n, _ in self.base_model.named_parameters() if "lora_" not in n]
            extra["target_parameters"] = target_parameters_for(params, base_params)
        # PEFT matches target_modules against every module of the base model, not only this model's LoRA ones: a
        # leaf name is exact only if no other module has it (LoRA on layer 0's q_proj alone is written by full name)
        base_modules = [n for n, _ in self.base_model.named_modules() if n and "lora_" not in n]
        config = LoraConfig(
            r=record.info.rank,
            lora_alpha=record.info.alpha,
            target_modules=target_modules_for(modules, base_modules) if modules else [],
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
            base_model_name_or_path=self.name_or_path,
            inference_mode=True,
            **extra,
        ).to_dict()
        return json.loads(json.dumps({k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}))

    def export_adapter(self, name: str, out_dir: str | Path) -> Path:
        """Write the adapter as a PEFT folder (config + safetensors at the true rank); returns the folder."""
        return write_peft_folder(
            out_dir, self.adapter_state_dict(name), self.peft_config(name), expert_shapes=self._expert_shapes
        )

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
        parsed = parse_peft_adapter(
            state_dict, config, self.layer_shapes, self.max_rank, source or f"for {name!r}", self._expert_shapes
        )
        differ = [
            m
            for m, w in parsed.base_copies.items()
            if not torch.equal(w.to(self._layers[m].weight), self._layers[m].weight)
        ]
        if differ:
            raise ValueError(
                f"adapter {source or name!r} holds base weights for {differ} (PEFT's save_embedding_layers) that differ "
                "from this model's: every slot shares one base, so an adapter cannot bring its own; save it with "
                "save_embedding_layers=False on this base"
            )
        slot = self.slot_of(name) if name in self.adapters else self._claim_slot(name)
        self._reset_slot(slot)
        with torch.no_grad():
            r = parsed.rank
            for module, (lora_a, lora_b) in parsed.tensors.items():
                layer = self._layers[module]
                if (view := _local_slot(layer.lora_A, slot)) is not None:
                    view[:r].copy_(lora_a)  # A[s, :r] = a; a: (r, in)
                if (view := _local_slot(layer.lora_B, slot)) is not None:
                    view[:, :r].copy_(lora_b)  # B[s, :, :r] = b; b: (out, r)
            for param, (lora_a, lora_b) in parsed.experts.items():
                holder = self._experts[param]
                if (view := _local_slot(holder.lora_A, slot)) is not None:
                    view[:, :r].copy_(lora_a)  # A[s, :, :r] = a; a: (E, r, in) or shared (1, r, in)
                if (view := _local_slot(holder.lora_B, slot)) is not None:
                    view[:, :, :r].copy_(lora_b)  # B[s, :, :, :r] = b; b: (E, out, r)
        covered = frozenset(parsed.tensors) | frozenset(parsed.experts)
        self._slots[slot] = _Slot(AdapterInfo(name, slot, parsed.rank, parsed.alpha), covered)
        return slot

    def new_bank(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> LoRABank:
        """A LoRABank holding copies of every slot's current tensors (no storage shared with the Parameters)."""
        first = self._stacked_pairs()[0][0]
        bank = LoRABank(
            self.layer_shapes,
            self.max_loras,
            self.max_rank,
            dtype or self.lora_dtype,
            device or first.device,
            expert_shapes=self._expert_shapes,
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
        kwargs = {"use_reentrant": False, "context_fn": self._checkpoint_contexts}
        # transformers 5.2x renamed gradient_checkpointing_* to activation_checkpointing_* (the old names warn).
        if hasattr(self.base_model, "activation_checkpointing_enable"):
            self.base_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.base_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self._routed_checkpointing = True
        self.train(self.training)  # the layer flags below, in whichever mode the model is

    def gradient_checkpointing_disable(self) -> None:
        if hasattr(self.base_model, "activation_checkpointing_disable"):
            self.base_model.activation_checkpointing_disable()
        else:
            self.base_model.gradient_checkpointing_disable()
        self._routed_checkpointing = False
        self.train(self.training)

    def train(self, mode: bool = True) -> MultiLoRAModel:
        """`nn.Module.train`, plus: with routed checkpointing on, each checkpointing decoder layer module keeps
        `training = True` in eval mode too. HF recomputes a layer only while the layer itself is in training mode,
        and the trainer runs its forwards in eval mode (dropout off: old, new and reference log-probs are one
        function); the layer's submodules (attention and its dropout, MLP) follow the model's mode as usual."""
        super().train(mode)
        if getattr(self, "_routed_checkpointing", False):  # (unset while __init__ runs)
            for module in self.base_model.modules():
                if getattr(module, "gradient_checkpointing", False):
                    module.training = True
        return self

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
                raise ValueError(bad_value("adapter_names", adapter_names, f"a list of {batch_size} names or None"))
            return [BASE_SLOT if n is None else self.slot_of(n) for n in adapter_names]
        if adapter_slots is None:
            return [BASE_SLOT] * batch_size
        slots = adapter_slots.tolist() if isinstance(adapter_slots, torch.Tensor) else list(adapter_slots)
        if len(slots) != batch_size or any(
            isinstance(s, bool) or not isinstance(s, numbers.Integral) or not BASE_SLOT <= s < self.max_loras
            for s in slots
        ):
            raise ValueError(
                bad_value("adapter_slots", slots, f"{batch_size} integers from -1 (base) to {self.max_loras - 1}")
            )
        if bank is None:
            empty = sorted({s for s in slots if s != BASE_SLOT and self._slots[s] is None})
            if empty:
                occupied = [i for i, r in enumerate(self._slots) if r is not None]
                raise ValueError(
                    bad_value(
                        "adapter_slots",
                        slots,
                        f"-1 (base) or occupied slots {occupied}; it names empty slot(s) {empty}",
                    )
                )
        return [int(s) for s in slots]

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        adapter_names: Sequence[str | None] | None = None,
        adapter_slots: torch.Tensor | Sequence[int] | None = None,
        lora_bank: LoRABank | None = None,
        reference: bool = False,
        decoder_only: bool = False,
        **hf_kwargs: Any,
    ):
        """Run the base model with each row routed through its adapter slot.

        Rows: `adapter_names` (None = base) or `adapter_slots` (-1 = base); neither = every row on the base.
        `lora_bank`: use the bank's tensors (by slot) instead of the trainable slots, under no_grad.
        `reference`: slow float32 per-row loop instead of the grouped fast path (the test oracle).
        `decoder_only`: run the decoder without the output head (`forward_hidden`).
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
        dtype = lora_bank.dtype if lora_bank is not None else self.lora_dtype
        sink = self._grad_sink if lora_bank is None and torch.is_grad_enabled() else None
        autocast = self.lora_autocast and lora_bank is None
        routing = build_routing(slots, meta, device, lora_bank, reference, dtype, grad_sink=sink, autocast=autocast)
        grad_context = torch.no_grad() if lora_bank is not None else contextlib.nullcontext()
        module = self.base_model.get_decoder() if decoder_only else self.base_model
        with grad_context, self.router.route(routing):
            return module(input_ids=input_ids, attention_mask=attention_mask, **hf_kwargs)

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        adapter_names: Sequence[str | None] | None = None,
        **hf_kwargs: Any,
    ) -> torch.Tensor:
        """The decoder's last hidden states `(B, T, H)` under the same routing as `forward`, without the output
        head: for a caller that applies `output_head()` itself to the positions it needs (the trainer's chunked
        token log-probs, which never form the full-vocabulary logits of a batch)."""
        out = self.forward(input_ids, attention_mask, adapter_names, decoder_only=True, **hf_kwargs)
        return out.last_hidden_state

    def output_head(self) -> nn.Linear | LoRALinear | None:
        """The output head when logits are exactly `lm_head(hidden)` (plus, when `lm_head` is a LoRA target, the
        rows' LoRA delta, which `head_lora` describes): a plain Linear or a `LoRALinear`, unsharded, and no logit
        soft-capping or scaling in the model's config, and the base's logits are `head(hidden)` bit for bit on a
        probe input (`_probe_head`). None otherwise: callers then use `forward`'s logits. Its
        `weight` / `bias` are the frozen base head's; calling it outside `forward` gives the base logits only."""
        head = self.base_model.get_output_embeddings()
        if type(head) not in (nn.Linear, LoRALinear) or any(  # a DTensor: FSDP shards the head or its slots
            hasattr(t, "placements") for t in (head.weight, getattr(head, "lora_A", None))
        ):
            return None
        config = self.base_model.config
        for key, value in vars(config).items():  # the config's own attributes, read in place (to_dict copies)
            if _scales_logits(key) and isinstance(value, int | float) and not isinstance(value, bool) and value != 1:
                return None
        if self._head_is_plain is None:
            self._head_is_plain = self._probe_head(head)
        return head if self._head_is_plain else None

    def _probe_head(self, head: nn.Linear | LoRALinear) -> bool:
        """Whether the base model's logits are `head(last hidden state)` bit for bit, on a 4-token input (run once):
        what a config key cannot say, a forward that scales the hidden states or the logits in code (MiniCPM divides
        the hidden states by `hidden_size / dim_model_base` before its head) or a remote-code model's own head.
        Eval mode for the probe (dropout would make the two forwards differ); no routing, so the base's head. Every
        module's mode is put back as it was, not reset by `train(mode)`: the decoder layers' `training = True` that
        routed checkpointing keeps in eval mode (`train`) would be lost, and with it the recompute of the forward
        that asked (the first training micro-batch: the SmolLM2 example's kept 338 MiB for its backward instead of
        31 and set the run's peak; the trainer's next `eval()` put the flags back)."""
        modes = [(module, module.training) for module in self.base_model.modules()]
        ids = torch.arange(1, 5, device=head.weight.device).remainder(head.weight.shape[0]).unsqueeze(0)  # (1, 4)
        try:
            self.base_model.eval()
            with torch.no_grad():
                logits = self.base_model(input_ids=ids).logits
                hidden = self.base_model.get_decoder()(input_ids=ids).last_hidden_state
                plain = F.linear(hidden, head.weight, head.bias)
        except Exception as e:  # noqa: BLE001 - a model the probe cannot run: its own logits are always right
            log.info("output head probe failed (%s: %s); the trainer uses the model's logits", type(e).__name__, e)
            return False
        finally:
            for module, mode in modes:
                module.training = mode
        same = logits.shape == plain.shape and torch.equal(logits, plain.to(logits.dtype))
        if not same:
            log.info("the model's logits are not lm_head(hidden states): the trainer uses the model's logits")
        return same

    def head_lora(self, adapter_names: Sequence[str | None], rows: torch.Tensor) -> HeadLoRA | None:
        """The output head's LoRA for N tokens taken from the batch rows `rows` ((N,) each token's row) of a forward
        routed by `adapter_names`: what `rl_multilora.token_logprobs` adds to `hidden @ W.T` per token. None when
        `lm_head` is not a LoRA target or no token's adapter covers it (the frozen base head for every token)."""
        head = self.output_head()
        if not isinstance(head, LoRALinear):
            return None
        slots = self._resolve_slots(len(adapter_names), adapter_names, None, None)
        scale = {
            s: r.info.scale
            for s in set(slots)
            if s != BASE_SLOT and (r := self._slots[s]) is not None and head.name in r.modules
        }
        if not scale:
            return None
        per_row = [s if s in scale else BASE_SLOT for s in slots]  # a row whose adapter skips lm_head: the base head
        token_slots = torch.tensor(per_row, dtype=torch.long, device=rows.device)[rows]  # (N,)
        token_scales = torch.tensor([scale.get(s, 0.0) for s in per_row], device=rows.device)[rows]  # (N,) float32
        rank = max(self._slots[s].info.rank for s in scale)
        sink = self._grad_sink if torch.is_grad_enabled() else None
        return HeadLoRA(head.lora_A, head.lora_B, token_slots, token_scales, rank, sink)


@dataclass(frozen=True)
class HeadLoRA:
    """The output head's LoRA slots and, per token, the slot and scale that token's logits use:
    `z[i] = h[i] @ W.T + b + scales[i] * (h[i] @ A[s].T) @ B[s].T`, s = slots[i] (-1: no delta).

    lora_a: (S, R, H), lora_b: (S, V, R) the stacked Parameters (every slot); slots: (N,) long; scales: (N,); rank:
    the largest true rank among the used slots (the product runs at it; higher ranks are exact zeros); sink: where
    the gradients of A and B go (a `SlotGradSink`, used slots only), None for the Parameters' `.grad`."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    slots: torch.Tensor
    scales: torch.Tensor
    rank: int
    sink: SlotGradSink | None = None


def _checkpointing_on(model: nn.Module) -> bool:
    # transformers 5 renamed is_gradient_checkpointing (now deprecated) to is_activation_checkpointing.
    for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), attr):
            return bool(getattr(model, attr))
    return False


# Linear modules that route tokens or gate a branch (MoE routers, Qwen2/3.5-MoE's shared_expert_gate): LoRA there
# changes which experts a token reaches, so "all-linear" leaves them out; naming them explicitly still wraps them.
_ROUTER_LEAVES = frozenset({"gate", "router", "shared_expert_gate", "router_gate"})


def _is_router(name: str, module: nn.Module) -> bool:
    """A router's Linear: named as one, of a router class, or inside a router module (Hunyuan-MoE's `mlp.gate.wg`,
    Gemma 4's `router.proj`)."""
    return any(part in _ROUTER_LEAVES for part in name.split(".")) or "Router" in type(module).__name__


def _covered(
    names: Mapping[str, Any], selection: str | Sequence[str] | None, field: str, all_name: str | None = None
) -> frozenset[str]:
    """The names an adapter's `selection` covers (PEFT's suffix rule): all for None (or `all_name`), none for []."""
    if selection is None or (all_name is not None and selection == all_name):
        return frozenset(names)
    selection = [selection] if isinstance(selection, str) else list(selection)
    covered = frozenset(n for n in names if any(matches_target(n, t) for t in selection))
    if selection and not covered:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ValueError(
            bad_value(field, selection, f"names among {leaves} (this list matches none of the model's LoRA {field})")
        )
    return covered


def select_targets(model: nn.Module, target_modules: str | Sequence[str], allow_empty: bool = False) -> list[str]:
    """Names of the Linears to wrap: every Linear but the output embedding and routers, or those matching a list
    (PEFT rule). `allow_empty`: an empty list (or an "all-linear" matching nothing) is fine, e.g. when experts are
    targeted through `target_parameters`."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if isinstance(target_modules, str):
        if target_modules != "all-linear":
            raise ValueError(
                bad_value("target_modules", target_modules, "'all-linear' or a list of module names (e.g. ['q_proj'])")
            )
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        names = [
            n
            for n, m in linears.items()
            if m is not output and n.rsplit(".", 1)[-1] != "lm_head" and not _is_router(n, m)
        ]
        if not names and not allow_empty:
            raise ValueError(
                bad_value("target_modules", "all-linear", "a list of module names ('all-linear' matched no nn.Linear)")
            )
        return names
    targets = list(target_modules)
    if not targets and allow_empty:
        return []
    if not targets or any(not isinstance(t, str) or not t for t in targets):
        raise ValueError(bad_value("target_modules", targets, "a non-empty list of module names"))
    all_names = [name for name, _ in model.named_modules()]
    problems = []
    for t in targets:
        matched = [n for n in all_names if matches_target(n, t)]
        if not matched:
            problems.append(f"{t!r} matches no module")
        problems += [f"{t!r} matches {n!r}, which is not an nn.Linear" for n in matched if n not in linears]
    if problems:
        raise ValueError(
            bad_value("target_modules", targets, "names of nn.Linear modules (" + "; ".join(problems) + ")")
        )
    return [n for n in linears if any(matches_target(n, t) for t in targets)]


def _rank_index(stacked: torch.Tensor, rank: int, factor: str) -> tuple[slice, ...]:
    """Index into one slot of a stacked LoRA tensor keeping its first `rank` ranks: A (S, R, in) and expert A
    (S, E, R, in) hold the rank on the slot's second-to-last dim, B (S, out, R) and expert B (S, E, out, R) on its
    last."""
    index = [slice(None)] * (stacked.dim() - 1)
    index[-2 if factor == "A" else -1] = slice(0, rank)
    return tuple(index)


def _at_rank(stacked: torch.Tensor, rank: int, i: int) -> torch.Tensor:
    """Tensor `i` of an adapter (`adapter_parameters` order: A, B per module) at its first `rank` ranks, as a view:
    A (..., r, in), B (..., out, r); for every slot of a stacked tensor, or for one slot's part."""
    return stacked.narrow(stacked.dim() - 1 if i % 2 else stacked.dim() - 2, 0, rank)


def _local_slot(stacked: torch.Tensor, slot: int) -> torch.Tensor | None:
    """Slot `slot` of a stacked LoRA tensor as a writable view; None when it lives on another rank (a DTensor that
    FSDP2 shards on the slot dim in chunks of ceil(slots / world))."""
    mesh = getattr(stacked, "device_mesh", None)
    if mesh is None:
        return stacked[slot]
    per_rank = -(-stacked.shape[0] // mesh.size())
    if slot // per_rank != mesh.get_local_rank():
        return None
    return stacked.to_local()[slot % per_rank]


def select_parameters(model: nn.Module, target_parameters: Sequence[str] | None) -> dict[str, list[str]]:
    """Experts module name -> its Parameters to give LoRA (its Parameter order), for PEFT-style `target_parameters`
    (a full name or a suffix such as "mlp.experts.down_proj"); every problem in one error."""
    if target_parameters is None:
        return {}
    targets = [target_parameters] if isinstance(target_parameters, str) else list(target_parameters)
    if not targets:
        return {}
    if any(not isinstance(t, str) or not t for t in targets):
        raise ValueError(bad_value("target_parameters", targets, "a list of parameter names"))
    selected: dict[str, list[str]] = {}
    problems = []
    matched_any = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            hits = [t for t in targets if matches_target(full, t)]
            if not hits:
                continue
            matched_any.update(hits)
            if not is_packed_experts(module) or param_name not in EXPERT_PARAMS or param.dim() != 3:
                problems.append(
                    f"{hits[0]!r} matches {full!r}, which is not a packed 3-D expert weight "
                    f"({'/'.join(EXPERT_PARAMS)} of a transformers experts module)"
                )
                continue
            selected.setdefault(module_name, []).append(param_name)
    problems += [f"{t!r} matches no parameter" for t in targets if t not in matched_any]
    if problems:
        raise ValueError(
            bad_value("target_parameters", targets, "packed expert parameters (" + "; ".join(problems) + ")")
        )
    return selected
