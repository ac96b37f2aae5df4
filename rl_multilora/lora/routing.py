"""Which LoRA slot each batch row uses, decided once per forward and shared by every LoRA layer.

Design choices:

- The row-to-slot mapping lives in one `SlotRouter` shared by all LoRA layers of a model (vLLM's punica_wrapper
  idea), set for the duration of one forward and thread-local, so an engine thread and a trainer thread can share
  the model. It is computed once per forward (one host sync at most), not once per layer.
- Rows are grouped by slot. A batch whose rows come grouped by adapter (what the trainer builds; a one-adapter
  batch always is) needs no permutation: each slot is a contiguous row range and the layers work on views.
  Otherwise the rows are permuted once here, for all layers.
- A routing carries each used slot's rank, scale (`alpha / r` as a Python float, never rounded to the base dtype)
  and covered modules, plus the `LoRABank` to read instead of the trainable slots, if any.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rl_multilora.lora.bank import LoRABank

BASE_SLOT = -1


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
