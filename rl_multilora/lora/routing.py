"""Which LoRA slot each batch row uses, decided once per forward and shared by every LoRA layer.

Design choices:

- The row-to-slot mapping lives in one `SlotRouter` shared by all LoRA layers of a model (vLLM's punica_wrapper
  idea), set for the duration of one forward and thread-local, so an engine thread and a trainer thread can share
  the model. It is computed once per forward (one host-to-device copy of two small index tensors), not per layer.
- The grouped path (`layer.py`) needs, per row that uses an adapter, its slot and its scale: `row_slots` and
  `scales_for(module)`, plus the rows themselves (`active`, None when every row uses an adapter). These cost
  O(rows), whatever the number of slots.
- A routing also keeps one `_SlotGroup` per used slot (its rank, scale `alpha / r` as a Python float, covered
  modules, rows): the one-slot view path and the float32 reference loop read them.
- `SlotGradSink`: a trainer that reads gradients per slot (`rl_multilora.train_ops`) puts one in the routing, and
  the grouped backward writes only the used slots' gradients there instead of a zero-filled all-slots `.grad`.
- `bag_index`: the decode path (`layer.py`, one token per row) reads each row's slot straight from the stacked tensors
  with `embedding_bag`; the bag indices depend on the rows' slots and the module's width only, so they are built once
  per forward and width.
- Scales are per row and per module: a row whose adapter does not cover a module gets scale 0 there, and its
  slot's tensors in that module are zero anyway, so the delta is exactly zero.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rl_multilora.lora.bank import LoRABank

BASE_SLOT = -1


class SlotGradSink:
    """Per-slot LoRA gradients of the backward, kept only for the slots that had rows in it.

    With a sink in the routing, the grouped path's backward hands each stacked tensor's gradient here as one compact
    `(U, ...)` tensor over the U slots its rows used (plus their slot ids), instead of returning a zero-filled
    `(max_loras, ...)` gradient to autograd: a backward allocates and zeroes gradient memory for the slots that hold
    rows only, whatever `max_loras` is. Values are those of the dense gradient's slot parts bit for bit (the same
    `index_add_` over the same rows in the same order). Entries accumulate over backwards until `clear`.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self._lists: dict[int, list[int]] = {}  # id(used tensor) -> its slot ids, read once

    def add(self, stacked: torch.Tensor, used: torch.Tensor, compact: torch.Tensor) -> None:
        """`compact[i]` is the gradient of `stacked[used[i]]`; used: (U,) slot ids, compact: (U, *stacked.shape[1:])."""
        self._entries.setdefault(id(stacked), (stacked, []))[1].append((used, compact))

    def holds(self, stacked: torch.Tensor) -> bool:
        """Whether a backward handed gradients of `stacked` here (its `.grad` stays None then)."""
        return id(stacked) in self._entries

    def slot_grad(self, stacked: torch.Tensor, slot: int) -> torch.Tensor | None:
        """The accumulated gradient of `stacked[slot]`; None when no row of that slot reached `stacked`."""
        total = None
        for used, compact in self._entries.get(id(stacked), (None, []))[1]:
            ids = self._lists.get(id(used))
            if ids is None:
                ids = self._lists[id(used)] = used.tolist()
            if slot in ids:
                part = compact[ids.index(slot)]
                total = part if total is None else total + part
        return total

    def clear(self) -> None:
        self._entries.clear()
        self._lists.clear()


@dataclass(frozen=True)
class _SlotGroup:
    """One used slot: its rank, scale, covered modules, and its rows `start:stop` when they are contiguous in the
    batch (`contiguous`), else the span from its first to its last row."""

    slot: int
    rank: int
    scale: float
    modules: frozenset[str]
    start: int
    stop: int
    contiguous: bool


@dataclass(frozen=True)
class Routing:
    batch_size: int
    slots: tuple[int, ...]  # per row; BASE_SLOT = base model
    groups: tuple[_SlotGroup, ...]  # one per used slot, by slot
    active: torch.Tensor | None  # (n_active,) rows that use an adapter; None when all rows do
    row_slots: torch.Tensor  # (n_active,) the slot of each active row
    max_rank: int  # the largest rank among the used slots: the grouped path computes at this rank
    bank: LoRABank | None
    reference: bool
    dtype: torch.dtype  # the LoRA compute dtype (of the scales)
    all_slots: frozenset[int]  # the used slots
    common_modules: frozenset[str]  # the modules every used adapter covers
    _scales: dict[str, torch.Tensor | None]  # per module, filled on first use (see scales_for)
    _by_covering: dict[frozenset[int], torch.Tensor]  # scales tensor per set of covering slots, shared by modules
    grad_sink: SlotGradSink | None = None  # where the grouped backward puts slot gradients (None: into `.grad`)
    autocast: bool = False  # LoRA products in the input's (the base's) dtype, the slots cast to it (`lora_autocast`)
    _slot_index: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # slot_index's, once built
    _bags: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # bag_index cache

    @property
    def single(self) -> _SlotGroup | None:
        """The one used slot when there is exactly one and its rows are contiguous: the view path needs no gather."""
        if len(self.groups) == 1 and self.groups[0].contiguous:
            return self.groups[0]
        return None

    def scales_for(self, module: str) -> torch.Tensor | None:
        """(n_active,) scale of each active row in `module` (0 where its adapter does not cover it); None if no
        used adapter covers it. One small host-to-device copy per distinct set of covering slots and forward."""
        if module not in self._scales:
            if module in self.common_modules:  # the usual case: every used adapter covers it
                covering = self.all_slots
            else:
                covering = frozenset(g.slot for g in self.groups if module in g.modules)
            if not covering:
                self._scales[module] = None
            else:
                if covering not in self._by_covering:
                    scale = {g.slot: (g.scale if g.slot in covering else 0.0) for g in self.groups}
                    values = [scale[s] for s in self.slots if s != BASE_SLOT]
                    self._by_covering[covering] = torch.tensor(values, dtype=self.dtype, device=self.row_slots.device)
                self._scales[module] = self._by_covering[covering]
        return self._scales[module]

    def slot_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(U,) the used slots ascending and (n_active,) each active row's index into them: `torch.unique(row_slots,
        return_inverse=True)`, built on the host once per forward (on first use: training's backward) instead of by
        every layer's backward (on a GPU each unique is a device sync)."""
        if not self._slot_index:
            used = sorted(self.all_slots)
            at = {s: i for i, s in enumerate(used)}
            device = self.row_slots.device
            self._slot_index.append((
                torch.tensor(used, dtype=torch.long, device=device),
                torch.tensor([at[s] for s in self.slots if s != BASE_SLOT], dtype=torch.long, device=device),
            ))  # fmt: skip
        return self._slot_index[0]

    def bag_index(self, stride: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices and offsets of one `embedding_bag` bag per active row over a table holding `stride` rows per slot:
        bag i is rows `slot[i] * stride + [0, count)`. indices: (n_active * count,), offsets: (n_active,). Built once
        per forward and (stride, count), shared by every module of that width (the decode path in `layer.py`)."""
        key = (stride, count)
        if key not in self._bags:
            device = self.row_slots.device
            rows = self.row_slots[:, None] * stride + torch.arange(count, device=device)  # (n_active, count)
            offsets = torch.arange(0, rows.numel(), count, device=device)
            self._bags[key] = (rows.flatten(), offsets)
        return self._bags[key]


class SlotRouter:
    """Holds the current forward's row-to-slot routing; every LoRALinear of a model reads it from here."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def current(self) -> Routing | None:
        return getattr(self._local, "routing", None)

    @contextlib.contextmanager
    def route(self, routing: Routing) -> Iterator[None]:
        previous = self.current
        self._local.routing = routing
        try:
            yield
        finally:
            self._local.routing = previous


def build_routing(
    slots: Sequence[int],
    slot_meta: Mapping[int, tuple[int, float, frozenset[str]]],
    device: torch.device,
    bank: LoRABank | None,
    reference: bool,
    dtype: torch.dtype = torch.float32,
    grad_sink: SlotGradSink | None = None,
    autocast: bool = False,
) -> Routing:
    """The routing of one forward. `slot_meta[s] = (rank, scale, modules)` for every slot used by some row.
    `autocast`: the layers compute the LoRA products in their input's dtype (see `MultiLoRAModel`'s
    `lora_autocast`)."""
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(slots):
        if slot != BASE_SLOT:
            by_slot.setdefault(slot, []).append(row)
    groups = tuple(
        _SlotGroup(s, *slot_meta[s], rows[0], rows[-1] + 1, rows[-1] - rows[0] + 1 == len(rows))
        for s, rows in sorted(by_slot.items())
    )
    active_rows = [row for row, slot in enumerate(slots) if slot != BASE_SLOT]
    all_active = len(active_rows) == len(slots)
    active = None if all_active else torch.tensor(active_rows, dtype=torch.long, device=device)
    row_slots = torch.tensor([slots[row] for row in active_rows], dtype=torch.long, device=device)
    max_rank = max((g.rank for g in groups), default=0)
    common = frozenset.intersection(*(g.modules for g in groups)) if groups else frozenset()
    return Routing(
        len(slots), tuple(slots), groups, active, row_slots, max_rank, bank, reference, dtype, frozenset(by_slot),
        common, {}, {}, grad_sink, autocast,
    )  # fmt: skip
