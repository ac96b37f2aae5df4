"""A bounded LRU cache of KV for the embedded engine: a request reuses the KV of the tokens it shares with an
earlier one and prefills only the rest.

Design choices (and where they differ from SGLang's radix tree or vLLM's block table):

- An entry is the KV of one token sequence under one adapter load: per decoder layer, keys and values of shape
  (H, n, D), copied out of the running batch when a row finishes (its prompt and every output token but the last,
  which was never fed). An episode's next turn (prompt + its turns + the environment's tokens) finds its previous
  turn; a GRPO sample prefilled after a sibling finished finds the sibling's.
- Partial matches count: the KV at position t depends only on tokens 0..t, so the first m tokens of any entry that
  shares m tokens with a query serve it (what a radix tree gives, without the tree). Entries are whole copies, not
  shared pages: a turn that extends an entry it consumed whole replaces it, so an episode holds one entry, not one
  per turn.
- Key: (adapter name, load generation), not (slot, version): the engine gives every `load_adapter` a new generation,
  so a weight sync invalidates its adapter's entries (dropped at once) even when the caller reuses a version number,
  and bank paging, which moves an adapter between slots without changing its weights, keeps them.
- Lookup without a scan: each entry is indexed by the chained hash of each of its full `BLOCK`-token blocks (the
  adapter key seeds the chain, so no adapter ever finds another's entry). A query's chain finds the entries sharing
  its longest run of full blocks; their tokens are then compared exactly (a hash collision is never a hit) and the
  match extended into the next block. Matches shorter than one block are not reused.
- Bound: the bytes of the stored tensors; an insert past it evicts least recently used entries (a hit refreshes).
  An entry larger than the whole bound is not stored.
- Threads: the engine's worker looks up and inserts; `load_adapter` / `unload_adapter` (callers' threads)
  invalidate. One lock guards the table; entries are never written after insert, so a looked-up entry stays valid
  after the lock is released, even if it is evicted meanwhile.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

BLOCK = 16  # tokens per hashed block: the smallest reusable prefix

AdapterKey = tuple[str | None, int]  # (adapter name or None for the base, load generation)


@dataclass(frozen=True)
class PrefixEntry:
    """The KV of `tokens` under adapter `adapter`; keys[l], values[l]: (H, len(tokens), D) for decoder layer l."""

    id: int
    adapter: AdapterKey
    tokens: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    chain: tuple[int, ...]  # chained hash of each full block of `tokens`
    nbytes: int


def _chain(adapter: AdapterKey, tokens: Sequence[int], blocks: int) -> list[int]:
    """h[j] = hash(h[j-1], tokens of block j), h[-1] = hash(adapter); one per full block, up to `blocks`."""
    out, h = [], hash(adapter)
    for j in range(blocks):
        h = hash((h, tuple(tokens[j * BLOCK : (j + 1) * BLOCK])))
        out.append(h)
    return out


class PrefixCache:
    """Entries of KV by (adapter key, tokens), at most `max_bytes` of tensors, evicted least recently used."""

    def __init__(self, max_bytes: int) -> None:
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes!r} is not allowed; allowed: an int >= 1")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = self.misses = self.evictions = 0
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # least recently used first
        self._index: dict[int, dict[int, None]] = {}  # block chain hash -> ids of the entries that contain it
        self._live: dict[str, int] = {}  # adapter name -> its current load generation
        self._next_id = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    # ------------------------------------------------------------------ invalidation

    def set_generation(self, name: str, generation: int) -> None:
        """Adapter `name` was (re)loaded: drop its entries of every other generation; only `generation` is stored."""
        with self._lock:
            self._live[name] = generation
            self._drop_where(lambda e: e.adapter[0] == name and e.adapter[1] != generation)

    def forget(self, name: str) -> None:
        """Adapter `name` was unloaded: drop its entries and store none until it is loaded again."""
        with self._lock:
            self._live.pop(name, None)
            self._drop_where(lambda e: e.adapter[0] == name)

    def clear(self) -> None:
        with self._lock:
            self._drop_where(lambda e: True)

    def _drop_where(self, pred) -> None:
        for entry in [e for e in self._entries.values() if pred(e)]:
            self._remove(entry.id)

    def _is_live(self, adapter: AdapterKey) -> bool:
        name, generation = adapter
        return name is None or self._live.get(name) == generation

    # ------------------------------------------------------------------ lookup / insert

    def lookup(self, adapter: AdapterKey, tokens: Sequence[int], max_len: int) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the longest prefix with `tokens` and that prefix's length, at most `max_len`; (None, 0)
        when no entry shares a full block. A hit becomes the most recently used entry."""
        with self._lock:
            entry, m = self._longest(adapter, tokens)
            m = min(m, max_len)
            if entry is None or m < BLOCK:
                self.misses += 1
                return None, 0
            self._entries.move_to_end(entry.id)
            self.hits += 1
            return entry, m

    def _longest(self, adapter: AdapterKey, tokens: Sequence[int]) -> tuple[PrefixEntry | None, int]:
        if not self._is_live(adapter):
            return None, 0
        full = 0  # blocks of `tokens` some entry also has, in a row from the start
        candidates: dict[int, None] = {}
        for h in _chain(adapter, tokens, len(tokens) // BLOCK):
            ids = self._index.get(h)
            if ids is None:
                break
            full, candidates = full + 1, ids
        best, best_len = None, 0
        start = full * BLOCK
        for entry_id in candidates:
            entry = self._entries[entry_id]
            if entry.adapter != adapter or tuple(tokens[:start]) != entry.tokens[:start]:
                continue  # a hash collision, never a hit
            m, end = start, min(len(tokens), len(entry.tokens))
            while m < end and tokens[m] == entry.tokens[m]:  # fewer than BLOCK more: block full + 1 did not match
                m += 1
            if m > best_len:
                best, best_len = entry, m
        return best, best_len

    def insert(
        self,
        adapter: AdapterKey,
        tokens: Sequence[int],
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        replaces: int | None = None,
    ) -> bool:
        """Store the KV of `tokens` (keys[l], values[l]: (H, len(tokens), D)); False when not stored (shorter than a
        block, larger than the bound, its adapter reloaded or unloaded since, or an entry already covers it).
        `replaces`: the id of an entry this one extends (the earlier turn it reused whole), dropped when stored."""
        tokens = tuple(tokens)
        nbytes = sum(t.nbytes for t in keys) + sum(t.nbytes for t in values)
        with self._lock:
            if len(tokens) < BLOCK or nbytes > self.max_bytes or not self._is_live(adapter):
                return False
            old = self._entries.get(replaces) if replaces is not None else None
            if old is not None and old.adapter == adapter and tokens[: len(old.tokens)] == old.tokens:
                self._remove(old.id)
            covering, m = self._longest(adapter, tokens)
            if covering is not None and m == len(tokens):
                self._entries.move_to_end(covering.id)
                return False
            while self.nbytes + nbytes > self.max_bytes:
                self._remove(next(iter(self._entries)))
                self.evictions += 1
            entry = PrefixEntry(
                self._next_id,
                adapter,
                tokens,
                tuple(keys),
                tuple(values),
                tuple(_chain(adapter, tokens, len(tokens) // BLOCK)),
                nbytes,
            )
            self._next_id += 1
            self._entries[entry.id] = entry
            for h in entry.chain:
                self._index.setdefault(h, {})[entry.id] = None
            self.nbytes += nbytes
            return True

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self.nbytes -= entry.nbytes
        for h in entry.chain:
            ids = self._index[h]
            ids.pop(entry_id, None)
            if not ids:
                del self._index[h]
