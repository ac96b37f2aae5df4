"""The embedded rollout engine: in-process torch generation with many LoRA adapters in one batch.

Design choices (and where they differ from a textbook `model.generate` loop):

- The frozen base is shared with the trainer (same process, same module), but the LoRA weights are
  not: the engine owns a `LoRABank` (`model.new_bank()`), its own copy of every loaded adapter's
  slot tensors. Only `load_adapter` changes it, so an optimizer step on the model's slots never
  leaks into a running rollout. The engine allocates bank slots itself (lowest free slot), which
  need not match the trainer's slot numbers.
- One background worker thread owns every model call. `generate` and `agenerate` only enqueue
  rows; the worker takes what is queued (up to `max_batch_size` rows, after a short coalescing
  wait so the concurrent `agenerate` calls of one rollout land in the same batch; while continuations of rows that
  just finished with `keep_prefix` are expected, each arrival extends that wait, so the episodes of a rollout
  that come back from their environments together start their next turn in one prefill), prefills them
  in one left-padded batch (attention mask + per-row position ids, HF `DynamicCache`) and decodes
  them in lockstep. Rows of different adapters and base rows (slot -1) share every forward; each
  row is routed to its adapter by `adapter_slots`. Finished rows leave the batch and the KV cache
  after each step (padding columns no remaining row needs are cropped), and queued rows are
  admitted into the freed room between steps (continuous batching: they are prefilled on their
  own, then their cache is left-padded and concatenated to the running one). Admission needs
  plain `DynamicLayer` caches; models with sliding-window layers run queued rows in the next wave.
- Prefix sharing: rows with the same prompt and adapter (the n samples of one GRPO group) are
  prefilled once; the mask and the last logits are then expanded by index, and the KV cache keeps the prompt's
  KV once per distinct prompt (`_SharedPromptLayer`: each row holds only the tokens it fed since), so a group of
  n samples holds its prompt's KV once, not n times. Each layer's attention gets the full per-row KV built for that
  call only (the values a per-row copy would hold, so outputs are unchanged); admitting queued rows into such a
  batch first turns its cache back into per-row copies.
- Prefix reuse across requests (`prefix_cache_bytes`, `prefix_cache.py`): when a row finishes, the KV of its
  prompt and output is kept (when its request sets `keep_prefix`: multi-turn episodes and the OpenAI chat route do)
  in a bounded LRU cache keyed by its adapter's load generation and the token ids. A later
  prompt that starts with tokens of an entry (an episode's next turn, a group sample prefilled after a sibling
  finished) takes their KV and prefills only the rest: the cached KV is left-padded to a common width, the new
  tokens are left-padded after it (a row's mask may then have a gap of padding between the two, which attention
  masks out like any padding) and continue at each row's own position ids. Every `load_adapter` drops the
  adapter's entries. The reused KV was computed by other matmul shapes than a full prefill (decode steps, a longer
  batch), so the logits agree with the uncached path within float tolerance, not bit for bit; a prefill with no
  hit is exactly the uncached one.
- Sampling is per row with the row's own `torch.Generator` (seeded from the request's `seed`, else
  from the engine's seed sequence), so a row's tokens do not depend on which other rows share the
  batch (`sampling.py`).
- `output_logprobs` are the log-softmax of the RAW logits (temperature 1, before top-k/top-p) at
  the chosen token, in float32 (`sampling.token_logprobs`). They equal the trainer's log-probs of
  the same tokens at temperature 1 (and for greedy rollouts, which the trainer scores at 1) only:
  the trainer divides the logits by the rollout temperature, this engine does not, so at other
  temperatures the two differ (see `sampling.py`).
- Stops: EOS (the tokenizer's plus the model's `generation_config`), `stop_token_ids` and stop
  strings finish a row with "stop"; `max_new_tokens` (or reaching the model's context length, as
  SGLang clips it) with "length". Output ids and log-probs are
  never trimmed: the token that ended the row (EOS, stop token, or the token completing a stop
  string) is included, exactly as SGLang's `output_ids` include it. SGLang trims only the *text*;
  callers that want SGLang's text decode the ids and cut at the stop string. Stop strings are
  matched on the decoded text of the last few tokens (enough to cover the longest stop string).
- Weight versions: every adapter has a version (`version` if given, else previous + 1, starting
  at 0 for a name never loaded before; unloading keeps the counter so versions of a name only go
  up). A row records its adapter's slot and version when it is prefilled, and no result ever mixes
  tokens of two versions, even when `load_adapter` is called without a pause.
- Versioned publish (no pause): loading a new version of an adapter whose rows are running writes it
  into a free slot; the running rows finish on the old slot (their result's `weight_version` says
  which), rows that start later get the new one, and the old slot is cleared and freed when its last
  row finishes. Other adapters' rows never stop: a load waits only for the model call in progress
  (one decode step). With no free slot the new version overwrites the old one in place, and the old
  version's running rows come back "abort" (resubmit them), as they do when their adapter is
  unloaded; a new adapter that needs a slot only an older version still holds takes it the same way.
- Bank paging (`page_adapters=True`, a run with more tenants than slots): the engine holds a host copy of every
  loaded adapter and its bank slots are a cache of them. A load with no free slot evicts the least recently used
  adapter that has no running row (parking it: slot -1, its tensors kept); a request for a parked adapter pages it
  back in before its prefill, evicting the same way, and when every slot is busy with running rows it waits in the
  queue until a row finishes (never an error, never another tenant's slot). `bank_page_ins` counts page-ins.
- Pause: `pause(mode="abort")` (default) aborts in-flight rows at the next step boundary (they
  come back with finish_reason "abort" and no output: resubmit them); `pause(mode="wait")` lets
  the running wave finish on the weights it started with. Either way `pause()` returns only once
  no model call is running, and no new wave starts until `resume()`. Requests queued but not yet
  started are kept and run after `resume()` on the then-current weights.
- Bad requests (unknown adapter, bad sampling values, empty prompt) fail that request only, with
  finish_reason "error" and a message naming the field, the value and what is allowed; the other
  requests of the call run normally. Sampling numbers must be finite (a NaN temperature is an error,
  not greedy) and a seed must fit the generator, so no request's settings can raise inside a shared
  batch. A row whose logits come out NaN or inf (e.g. its adapter's weights are) finishes alone with
  "error" before sampling; the rest of its batch goes on. A wave that raises (e.g. out of memory, or an input
  that gets past the checks) runs each of its unfinished rows again alone, from the start (a seeded row samples
  the same tokens): a row that raises alone finishes with "error", the others come back as they would have
  without it. The worker keeps serving later requests.

One file: `EmbeddedEngine` is one worker thread and the state it shares with the callers
(queue, pause flags, adapter table, bank) under two locks; the batch helpers below (`_Row`, `_Batch`)
only exist for that worker. Split up, the locking rules above would be spread over modules that no one
else imports. Sampling, which needs none of that state, is in `sampling.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import math
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rl_multilora.lora import validate_adapter_name
from rl_multilora.lora.peft_io import parse_peft_adapter
from rollout.engines.base import RolloutEngine
from rollout.engines.prefix_cache import BLOCK as PREFIX_BLOCK
from rollout.engines.prefix_cache import AdapterKey, PrefixCache, PrefixEntry
from rollout.engines.sampling import sample_next_tokens, token_logprobs
from rollout.types import GenerateRequest, GenerateResult, SamplingParams

_SAMPLE_ELEMENTS = 1 << 20  # logits sampled at once, rows x vocabulary (`EmbeddedEngine._sample`): 4 MiB in float32
_NONFINITE_ERROR = "the model produced NaN or inf logits for this request (are its adapter's weights finite?)"
_SEED_RANGE = 2**64  # a torch.Generator seed is an unsigned 64-bit integer
DEFAULT_PREFIX_CACHE_BYTES = 256 * 2**20
# The most own-token columns a shared-prompt batch allocates up front per layer (`_SharedPromptLayer`); longer rows
# grow the buffers by doubling. Bounds what a request with a huge max_new_tokens (stopped by EOS long before) reserves.
_OWN_KV_CAPACITY = 1024
_OWN_KV_FIRST = 8  # the columns allocated at first; doubled when full, up to the capacity

PAUSE_MODES = ("abort", "wait")
logger = logging.getLogger(__name__)


@dataclass
class _AdapterEntry:
    """One adapter loaded in the engine's bank."""

    slot: int
    version: int
    generation: int  # bumped by every load_adapter: what the prefix cache keys an adapter's weights by


class _Job:
    """One `generate` / `agenerate` call: its results in request order and who to tell when done."""

    def __init__(self, n: int, on_done: Callable[[list[GenerateResult]], None]) -> None:
        self.results: list[GenerateResult | None] = [None] * n
        self.remaining = n
        self.on_done = on_done
        self.cancelled = False

    def has(self, index: int) -> bool:
        return self.results[index] is not None

    def set(self, index: int, result: GenerateResult) -> None:
        self.results[index] = result
        self.remaining -= 1
        if self.remaining == 0:
            try:
                self.on_done(list(self.results))  # type: ignore[arg-type]
            except Exception:  # a caller's callback must not take the engine's worker (every tenant's rows) down
                logger.exception("embedded engine: delivering a request's results failed; the caller misses them")


@dataclass
class _Row:
    """One request in flight: its sampling state and what it has produced so far."""

    job: _Job
    index: int
    request: GenerateRequest
    seed: int
    slot: int = -1
    version: int | None = None
    holds_slot: bool = False  # counted in the engine's rows per slot until it finishes
    cache_key: AdapterKey = (None, 0)  # the prefix cache's key of the weights it runs on
    reused: PrefixEntry | None = None  # the prefix cache entry its prefill reused whole, if any
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    alone: bool = False  # its wave raised: it runs again in a wave of its own, and an error there is its own

    @property
    def params(self) -> SamplingParams:
        return self.request.sampling


class _KVScratch:
    """The one pair of buffers that every `_SharedPromptLayer` of a batch builds its attention's full KV in, layer after
    layer and step after step: a layer's attention is done with its full KV before the next layer's `update`
    (decoding runs under `inference_mode`, nothing keeps them), so the batch holds one layer's full KV at a time, in
    memory allocated once instead of two new (B, H, P + S, D) tensors per layer per decode step. Each call gets a
    contiguous view of the size it needs (the same layout a fresh tensor has); a size past the capacity (never, when
    the batch's rows stay within the capacity it was made for) takes a bigger pair."""

    def __init__(self, numel: int, like: torch.Tensor):
        self.keys = like.new_empty(numel)
        self.values = like.new_empty(numel)

    def take(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        n = math.prod(shape)
        if n > self.keys.numel():
            self.keys, self.values = self.keys.new_empty(n), self.values.new_empty(n)
        return self.keys[:n].view(shape), self.values[:n].view(shape)


class _SharedPromptLayer(DynamicLayer):
    """One layer's KV cache for rows of which several share a prompt (a GRPO group's samples).

    `prompt_keys` / `prompt_values` (U, H, P, D) hold each distinct prompt's KV once, `row_prompt` (B,) says whose
    each row is, and `keys` / `values` (B, H, S, D) are each row's own tokens since the prefill. Attention gets the
    full (B, H, P + S, D) KV from `update`, built for that layer's call only: the same values a `DynamicLayer` whose
    prompt KV was copied to every row holds, so outputs are unchanged, while the cache holds U/B of the prompt part.

    Bounded buffers: a row's own tokens go into a (B, H, capacity, D) buffer allocated once (`keys` / `values` are
    views of its first S columns), not into a new, one-column-longer tensor per decode step, and the full KV is built
    in the batch's `_KVScratch`. A step's allocations are then the same few small tensors every step: a growing
    series of large ones, freed in between live ones, fragmented glibc's heap (the rollout's resident size rose
    several times its live bytes). A layer that is fed past its capacity (a row longer than the batch was sized
    for) doubles it, so nothing depends on the capacity being right but the memory.
    """

    def __init__(self, layer: DynamicLayer, row_prompt: torch.Tensor, capacity: int, scratch: _KVScratch):
        super().__init__()
        self.prompt_keys, self.prompt_values = layer.keys, layer.values  # (U, H, P, D)
        self.row_prompt = row_prompt  # (B,) index into the prompt rows
        _, h, _, d = layer.keys.shape
        self._limit = max(capacity, 1)  # growth stops here (doubling on past it)
        first = min(self._limit, _OWN_KV_FIRST)
        self._key_buf = layer.keys.new_empty(len(row_prompt), h, first, d)  # (B, H, columns allocated, D)
        self._value_buf = layer.values.new_empty(len(row_prompt), h, first, d)
        self._length = 0  # S: the columns of the buffers in use
        self._view()
        self.scratch = scratch
        self.device = layer.device
        self.is_initialized = True

    def _view(self) -> None:
        self.keys = self._key_buf[:, :, : self._length]  # (B, H, S, D)
        self.values = self._value_buf[:, :, : self._length]

    @property
    def capacity(self) -> int:
        return self._key_buf.shape[-2]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: (B, H, q, D), the tokens fed in this call
        end = self._length + key_states.shape[-2]
        if end > self.capacity:  # past what the batch was sized for: grow (doubling), copying the columns in use
            grown = max(end, 2 * self.capacity)
            grown = min(grown, self._limit) if end <= self._limit else grown
            b, h, _, d = self._key_buf.shape
            key_buf, value_buf = self._key_buf.new_empty(b, h, grown, d), self._value_buf.new_empty(b, h, grown, d)
            key_buf[:, :, : self._length] = self.keys
            value_buf[:, :, : self._length] = self.values
            self._key_buf, self._value_buf = key_buf, value_buf
        self._key_buf[:, :, self._length : end] = key_states
        self._value_buf[:, :, self._length : end] = value_states
        self._length = end
        self._view()
        return self.full(self.scratch)

    def full(self, scratch: _KVScratch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's keys and values, its prompt's then its own: (B, H, P + S, D) each; in `scratch`'s buffers (valid
        until the next layer's call) when given, else new tensors."""
        b, h, s, d = self.keys.shape
        shape = (b, h, self.prompt_keys.shape[-2] + s, d)
        out_k, out_v = scratch.take(shape) if scratch is not None else (None, None)
        return (
            _gather_rows(self.prompt_keys, self.row_prompt, self.keys, out_k),
            _gather_rows(self.prompt_values, self.row_prompt, self.values, out_v),
        )

    def get_seq_length(self) -> int:
        return self.prompt_keys.shape[-2] + self._length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices` (B',); prompts no row uses any more are dropped."""
        self._key_buf, self._value_buf = self._key_buf[indices], self._value_buf[indices]
        self._view()
        row_prompt = self.row_prompt[indices]
        used, self.row_prompt = torch.unique(row_prompt, return_inverse=True)  # (U',), (B',)
        if len(used) < self.prompt_keys.shape[0]:
            self.prompt_keys, self.prompt_values = self.prompt_keys[used], self.prompt_values[used]

    def drop_leading(self, n: int) -> None:
        """Drop the first n columns, padding for every row (so within the prompt part: each row's own are real)."""
        self.prompt_keys, self.prompt_values = self.prompt_keys[:, :, n:], self.prompt_values[:, :, n:]


def _gather_rows(
    prompt: torch.Tensor, row_prompt: torch.Tensor, own: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """out[b] = cat(prompt[row_prompt[b]], own[b]) along the sequence; prompt: (U, H, P, D), own: (B, H, S, D); `out`:
    where to write it, (B, H, P + S, D) (None: a new tensor)."""
    p = prompt.shape[-2]
    if out is None:
        out = own.new_empty(own.shape[0], own.shape[1], p + own.shape[2], own.shape[3])  # (B, H, P + S, D)
    torch.index_select(prompt, 0, row_prompt, out=out[:, :, :p])
    out[:, :, p:] = own
    return out


@dataclass
class _Batch:
    """The rows decoding together and their tensors; row i of every tensor belongs to `rows[i]`."""

    rows: list[_Row]
    cache: DynamicCache
    mask: torch.Tensor  # (B, T) 1 = real token, 0 = left padding; T = cache length
    last_pos: torch.Tensor  # (B,) position id of each row's last fed token
    slots: torch.Tensor  # (B,) bank slot per row, -1 = base
    logits: torch.Tensor  # (B, V) float32 next-token logits

    def expand(self, index: torch.Tensor) -> None:
        """Row j becomes a copy of row index[j] (fan a shared prompt out to its samples); index: (B',)."""
        self.cache.batch_select_indices(index)
        self.mask, self.last_pos, self.slots = self.mask[index], self.last_pos[index], self.slots[index]
        self.logits = self.logits[index]

    def share(self, index: torch.Tensor, capacity: int) -> None:
        """As `expand` (row j becomes a copy of row index[j]), but the cache keeps each prompt row's KV once
        (`_SharedPromptLayer`) where its layers are plain `DynamicLayer`s; index: (B',). `capacity`: the most tokens a
        row will feed after this (each layer's own-token buffers are allocated for it once)."""
        if not self.can_merge():
            return self.expand(index)
        first = self.cache.layers[0]
        _, h, p, d = first.keys.shape
        scratch = _KVScratch(len(index) * h * (p + max(capacity, 1)) * d, first.keys)
        self.cache.layers = [_SharedPromptLayer(layer, index, capacity, scratch) for layer in self.cache.layers]
        self.mask, self.last_pos, self.slots = self.mask[index], self.last_pos[index], self.slots[index]
        self.logits = self.logits[index]

    def unshare(self) -> None:
        """Give every row its own copy of its prompt's KV again (plain `DynamicLayer`s)."""
        for i, layer in enumerate(self.cache.layers):
            if isinstance(layer, _SharedPromptLayer):
                plain = DynamicLayer()
                plain.keys, plain.values = layer.full()  # (B, H, P + S, D)
                plain.device, plain.is_initialized = layer.device, True
                self.cache.layers[i] = plain

    def select(self, keep: list[int]) -> None:
        """Keep only rows `keep` (finished rows leave the batch and the cache), then drop dead padding."""
        self.expand(torch.tensor(keep, device=self.mask.device))
        self.rows = [self.rows[i] for i in keep]
        if not self.can_merge():
            return
        # Columns that are padding for every remaining row (the long prompts left) cost attention for nothing.
        lead = int(self.mask.any(dim=0).int().argmax())
        if lead > 0:
            for layer in self.cache.layers:
                if isinstance(layer, _SharedPromptLayer):
                    layer.drop_leading(lead)
                else:  # (B, H, T - lead, D)
                    layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
            self.mask = self.mask[:, lead:]

    def can_merge(self) -> bool:
        return all(
            type(layer) in (DynamicLayer, _SharedPromptLayer) and layer.is_initialized for layer in self.cache.layers
        )

    def merge(self, other: _Batch) -> None:
        """Append `other`'s rows: left-pad the shorter cache and mask to a common length, then concatenate."""
        self.unshare()
        other.unshare()
        width = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            # keys/values: (B, H, T, D) -> (B + B', H, width, D), zeros at the new left padding (masked out)
            mine.keys = torch.cat([_left_pad(mine.keys, width, -2), _left_pad(theirs.keys, width, -2)])
            mine.values = torch.cat([_left_pad(mine.values, width, -2), _left_pad(theirs.values, width, -2)])
        self.mask = torch.cat([_left_pad(self.mask, width, -1), _left_pad(other.mask, width, -1)])  # (B + B', width)
        self.last_pos = torch.cat([self.last_pos, other.last_pos])
        self.slots = torch.cat([self.slots, other.slots])
        self.logits = torch.cat([self.logits, other.logits])
        self.rows = self.rows + other.rows

    def row_kv(self, i: int, runs: list[tuple[int, int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of row i's keys and values at columns `runs` ([start, end) ranges of the cache's T columns, in
        order) for every layer, (H, n, D) each with n = the runs' total length: one copy per tensor, straight out of
        the cache (a `_SharedPromptLayer` row's prompt columns come from its prompt's KV)."""
        keys, values = [], []
        for layer in self.cache.layers:
            if isinstance(layer, _SharedPromptLayer):
                u, p = int(layer.row_prompt[i]), layer.prompt_keys.shape[-2]
                sources = (
                    (layer.prompt_keys[u], layer.prompt_values[u], 0, p),
                    (layer.keys[i], layer.values[i], p, None),
                )
            else:
                sources = ((layer.keys[i], layer.values[i], 0, None),)
            k_parts, v_parts = [], []
            for k, v, lo, hi in sources:  # the runs' pieces inside this source's columns [lo, hi)
                for a, b in runs:
                    a, b = max(a, lo), b if hi is None else min(b, hi)
                    if a < b:
                        k_parts.append(k[:, a - lo : b - lo])
                        v_parts.append(v[:, a - lo : b - lo])
            keys.append(k_parts[0].clone() if len(k_parts) == 1 else torch.cat(k_parts, dim=-2))
            values.append(v_parts[0].clone() if len(v_parts) == 1 else torch.cat(v_parts, dim=-2))
        return keys, values


def _runs(mask_row: list[int]) -> list[tuple[int, int]]:
    """The [start, end) ranges of the 1s of a mask row, in order."""
    runs, start = [], None
    for t, bit in enumerate(mask_row):
        if bit and start is None:
            start = t
        elif not bit and start is not None:
            runs.append((start, t))
            start = None
    if start is not None:
        runs.append((start, len(mask_row)))
    return runs


def _finite(value: Any) -> bool:
    """A real, finite number (bools are not sampling numbers)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Zero-pad `t` on the left of dimension `dim` (-1 or -2) up to `width`."""
    pad = width - t.shape[dim]
    if pad == 0:
        return t
    return torch.nn.functional.pad(t, (pad, 0) if dim == -1 else (0, 0, pad, 0))


def kv_cache_kwarg(hf_model: torch.nn.Module) -> str:
    """The name the HF model's forward takes its KV cache by: `cache` from transformers 5.2x on (where passing
    `past_key_values` prints a FutureWarning on every call), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"


def nonfinite_rows(logits: torch.Tensor) -> list[int]:
    """The rows of (B, V) `logits` with a NaN or an infinite value, in order; [] when every row is finite.

    A row's sum is finite only if every value is (NaN and inf propagate through it), so one cheap pass over the batch
    and one host sync settle the usual case, where `isfinite(logits).all(-1)` took 12 ms a decode step for 96 rows of
    a 49k vocabulary (2-core CPU). The exact check runs only when some sum is not finite: huge finite logits can
    overflow a sum."""
    if bool(torch.isfinite(logits.sum(dim=-1)).all()):
        return []
    return (~torch.isfinite(logits).all(dim=-1)).nonzero().squeeze(1).tolist()


def _check_wave_tokens(max_wave_tokens: int | None) -> None:
    if max_wave_tokens is not None and (
        not isinstance(max_wave_tokens, int) or isinstance(max_wave_tokens, bool) or max_wave_tokens < 1
    ):
        allowed = "an integer >= 1 (token positions), or None for no bound"
        raise ValueError(f"max_wave_tokens={max_wave_tokens!r} is not allowed; allowed: {allowed}")


class EmbeddedEngine(RolloutEngine):
    """Serves many LoRA adapters of one `MultiLoRAModel` in shared decode batches.

    Publishes without a pause (versioned publish, see the module docstring).

    `model` is the `MultiLoRAModel` (its frozen base is shared; its LoRA slots are not used),
    `tokenizer` is used for EOS and stop strings (may be None when no request uses stop strings),
    `max_batch_size` caps the rows of one wave, `batch_wait_s` is how long the worker waits for
    more requests once the first one arrives, `seed` seeds the per-row generators of requests
    without their own seed, `eos_token_ids` overrides the EOS set, `prefix_cache_bytes` bounds the KV kept for reuse
    by later requests (0 = off; see the module docstring), `continuation_wait_s` caps how long the coalescing wait
    extends while continuations of `keep_prefix` rows are expected (multi-turn episodes' next turns).
    `max_wave_tokens` bounds the KV a wave may come to hold, in token positions (None: no bound beyond
    `max_batch_size`): rows join a wave, in queue order, while its positions stay within it, each row counting its
    max_new_tokens and each distinct prompt (adapter and tokens) its length once, as a shared-prompt wave holds it;
    rows joining a running wave count their prompts per row, as a merged wave holds them. The rest wait for room. A
    row alone over the bound still runs (alone). What it trades: a batch of many distinct prompts (an eval) decodes in
    steps over fewer rows, and its KV, which grows with the rows at once, stays bounded.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        max_batch_size: int = 256,
        *,
        batch_wait_s: float = 0.002,
        seed: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        page_adapters: bool = False,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        continuation_wait_s: float = 0.05,
        max_wave_tokens: int | None = None,
    ) -> None:
        self.publishes_without_pause = True
        _check_wave_tokens(max_wave_tokens)
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size!r} is not allowed; allowed: an integer >= 1")
        if not isinstance(prefix_cache_bytes, int) or isinstance(prefix_cache_bytes, bool) or prefix_cache_bytes < 0:
            allowed = "an int >= 0 (0 = no prefix cache)"
            raise ValueError(f"prefix_cache_bytes={prefix_cache_bytes!r} is not allowed; allowed: {allowed}")
        if batch_wait_s < 0:
            raise ValueError(f"batch_wait_s={batch_wait_s!r} is not allowed; allowed: a number of seconds >= 0")
        if not _finite(continuation_wait_s) or continuation_wait_s < 0:
            allowed = "a number of seconds >= 0"
            raise ValueError(f"continuation_wait_s={continuation_wait_s!r} is not allowed; allowed: {allowed}")
        self._model = model
        self._tokenizer = tokenizer
        self._max_batch_size = max_batch_size
        self._max_wave_tokens = max_wave_tokens
        self._batch_wait_s = batch_wait_s
        self._base = model.base_model
        self._config = self._base.config
        text_config = self._config.get_text_config(decoder=True)
        self._vocab_size = int(text_config.vocab_size)
        self._context_len: int | None = getattr(text_config, "max_position_embeddings", None)
        self._device = next(self._base.parameters()).device
        self._cache_kwarg = kv_cache_kwarg(self._base)
        self._max_loras = int(model.max_loras)
        self._max_rank = int(model.max_rank)
        self._eos_ids = frozenset(eos_token_ids) if eos_token_ids is not None else self._default_eos_ids()
        self._seed_rng = random.Random(seed)
        # new_bank() copies the trainer's current slots; the engine starts empty and serves only what
        # load_adapter gave it, in slots it allocates itself.
        self._bank = model.new_bank()
        for slot in range(self._max_loras):
            self._bank.clear(slot)
        self._adapters: dict[str, _AdapterEntry] = {}
        self._last_version: dict[str, int] = {}
        # Versioned publish: rows running per slot, and the slots that hold an older version of an adapter
        # (slot -> (name, version)) until their last row finishes. `_slots_lock` guards both; it is taken
        # after `_weights_lock` where both are held, never the other way round.
        self._slots_lock = threading.Lock()
        self._slot_rows: dict[int, int] = {}
        self._retiring: dict[int, tuple[str, int, int]] = {}  # slot -> (name, version, generation)
        # Bank paging: every loaded adapter's tensors (name -> (tensors, config)) and the bank-resident ones, least
        # recently used first. Guarded like the adapter table (`_weights_lock`, then `_slots_lock`).
        self._page = page_adapters
        self._host: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()
        self.bank_page_ins = 0
        self.bank_page_in_s = 0.0
        # Prefix reuse: only over plain `DynamicLayer` caches, whose KV can be seeded and left-padded (a sliding-window
        # layer keeps a rolling window). The counters: prompt tokens asked for, and those whose KV came from the cache.
        plain = all(type(layer) is DynamicLayer for layer in DynamicCache(config=self._config).layers)
        self._prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes and plain else None
        self._generations = 0
        self.prompt_tokens = 0
        self.reused_tokens = 0

        # `_cond` guards the queue, the pause flags and `_busy`; `_weights_lock` is held by the
        # worker around each model call and by load/unload, so weights never change mid-forward.
        self._cond = threading.Condition()
        self._weights_lock = threading.Lock()
        self._queue: deque[_Row] = deque()
        self._paused = False
        self._pause_mode = "abort"
        self._busy = False
        self._closed = False
        self._worker_error: BaseException | None = None
        self._in_flight: list[_Row] = []  # rows taken from the queue by the running wave (worker thread only)
        # Rows finished with `keep_prefix` whose continuation has not been submitted yet (a guess: every submitted
        # request counts as one); while > 0 the coalescing wait slides (see `_next_wave`). Guarded by `_cond`.
        self._awaiting = 0
        self._continuation_wait_s = continuation_wait_s
        self._worker = threading.Thread(target=self._worker_loop, name="embedded-engine", daemon=True)
        self._worker.start()

    @property
    def eos_ids(self) -> frozenset[int]:
        """The ids every request stops on (besides its own `stop_token_ids`): the tokenizer's EOS and the model's
        `generation_config` EOS ids, or the `eos_token_ids` given."""
        return self._eos_ids

    def _default_eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        eos = getattr(self._tokenizer, "eos_token_id", None) if self._tokenizer is not None else None
        gen_eos = getattr(getattr(self._base, "generation_config", None), "eos_token_id", None)
        for value in (eos, gen_eos):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return frozenset(ids)

    # ------------------------------------------------------------------ adapters

    def load_adapter(
        self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any], version: int | None = None
    ) -> int:
        validate_adapter_name(name)
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            raise ValueError(f"version={version!r} is not allowed; allowed: an int or None (adapter {name!r})")
        with self._weights_lock, self._slots_lock:
            entry = self._adapters.get(name)
            if self._page:
                return self._load_paged(name, tensors, config, version, entry)
            used = {e.slot for e in self._adapters.values()} | set(self._retiring)
            free = [s for s in range(self._max_loras) if s not in used]
            retire = entry is not None and self._slot_rows.get(entry.slot, 0) > 0 and bool(free)
            if entry is None and not free and self._retiring:
                # A new adapter needs a slot that only an older version still holds: that version's running rows
                # come back "abort" at their next step (before any forward on the new weights), as on an unload.
                reclaimed = next(iter(self._retiring))
                del self._retiring[reclaimed]
                free = [reclaimed]
            if entry is not None and not retire:
                slot = entry.slot  # nothing of it is running (or no room to keep it): overwrite in place
            else:
                if not free:
                    raise RuntimeError(
                        f"cannot load adapter {name!r}: all {self._max_loras} engine slots are in use by "
                        f"{sorted(self._adapters)}"
                        + (f" and older versions still running ({len(self._retiring)})" if self._retiring else "")
                        + "; unload one first"
                    )
                slot = free[0]
            # The bank validates everything (peft_type LORA, 1 <= r <= max_rank, no rsLoRA/DoRA, every key a
            # LoRA module of the model, shapes at rank r) before it touches the slot, so a bad adapter leaves
            # the engine as it was.
            try:
                self._bank.set_adapter(slot, tensors, config)
            except (ValueError, TypeError) as err:
                raise ValueError(f"cannot load adapter {name!r} into the engine: {err}") from err
            new_version = version if version is not None else self._last_version.get(name, -1) + 1
            if retire:  # its running rows finish on the old slot, which is freed after the last of them
                self._retiring[entry.slot] = (name, entry.version, entry.generation)
            self._adapters[name] = _AdapterEntry(slot=slot, version=new_version, generation=self._new_generation(name))
            self._last_version[name] = new_version
        return new_version

    def _new_generation(self, name: str) -> int:
        """A new load of `name`'s weights: its prefix cache entries of earlier loads are dropped."""
        self._generations += 1
        if self._prefix_cache is not None:
            self._prefix_cache.set_generation(name, self._generations)
        return self._generations

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache (its `hits`, `misses`, `evictions`, `nbytes`), or None when off."""
        return self._prefix_cache

    def _free_bank_slots(self) -> list[int]:
        used = {e.slot for e in self._adapters.values()} | set(self._retiring)
        return [s for s in range(self._max_loras) if s not in used]

    def _evict_one(self, keep: str | None = None) -> int | None:
        """Bank paging: park the least recently used adapter that has no running row (and is not `keep`); its slot,
        now empty, or None when every resident adapter has rows running. Caller holds both locks."""
        for name in self._lru:
            entry = self._adapters[name]
            if name != keep and entry.slot >= 0 and self._slot_rows.get(entry.slot, 0) == 0:
                self._bank.clear(entry.slot)
                slot, entry.slot = entry.slot, -1
                del self._lru[name]
                return slot
        return None

    def _load_paged(
        self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any], version: int | None, entry
    ) -> int:
        """`load_adapter` with bank paging (caller holds both locks): overwrite its slot when nothing of it runs, a
        free or evicted slot otherwise, or park it (validated, tensors kept) when every slot has rows running."""
        if entry is not None and entry.slot >= 0 and self._slot_rows.get(entry.slot, 0) == 0:
            slot = entry.slot  # resident and idle: in place
        else:
            free = self._free_bank_slots()
            slot = free[0] if free else self._evict_one(keep=name)
        try:
            if slot is None:  # validate now: a bad adapter must fail at load, not when a request pages it in
                parse_peft_adapter(
                    tensors, config, self._bank.layer_shapes, self._max_rank, f"for {name!r}", self._bank.expert_shapes
                )
            else:
                self._bank.set_adapter(slot, tensors, config)
        except (ValueError, TypeError) as err:
            raise ValueError(f"cannot load adapter {name!r} into the engine: {err}") from err
        new_version = version if version is not None else self._last_version.get(name, -1) + 1
        if entry is not None and entry.slot >= 0 and entry.slot != slot:  # its running rows finish on the old slot
            self._retiring[entry.slot] = (name, entry.version, entry.generation)
        self._adapters[name] = _AdapterEntry(
            slot=-1 if slot is None else slot, version=new_version, generation=self._new_generation(name)
        )
        self._last_version[name] = new_version
        self._host[name] = (tensors, config)
        self._lru.pop(name, None)
        if slot is not None:
            self._lru[name] = None
        return new_version

    def _page_in(self, name: str, entry: _AdapterEntry) -> bool:
        """Bring parked adapter `name` into a bank slot (caller holds `_weights_lock`); False when every slot has
        rows running (the request waits)."""
        t0 = time.perf_counter()
        with self._slots_lock:
            free = self._free_bank_slots()
            slot = free[0] if free else self._evict_one(keep=name)
            if slot is None:
                return False
            self._bank.set_adapter(slot, *self._host[name])
            entry.slot = slot
            self._lru[name] = None
        self.bank_page_ins += 1
        self.bank_page_in_s += time.perf_counter() - t0
        return True

    def unload_adapter(self, name: str) -> None:
        with self._weights_lock, self._slots_lock:
            entry = self._adapters.pop(name, None)
            if entry is None:
                raise KeyError(f"adapter {name!r} is not loaded in the engine; loaded: {sorted(self._adapters)}")
            self._host.pop(name, None)
            self._lru.pop(name, None)
            if self._prefix_cache is not None:
                self._prefix_cache.forget(name)
            if entry.slot < 0:  # parked: nothing in the bank
                return
            self._bank.clear(entry.slot)
            # Its older versions' rows stop too (they come back "abort"); their slots free when those rows finish.

    def adapter_versions(self) -> dict[str, int]:
        with self._weights_lock:
            return {name: entry.version for name, entry in self._adapters.items()}

    @property
    def context_length(self) -> int | None:
        """The model's max positions (prompt + output), or None when its config has none; servers check it."""
        return self._context_len

    # ------------------------------------------------------------------ generation API

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        done = threading.Event()
        box: list[list[GenerateResult]] = []

        def on_done(results: list[GenerateResult]) -> None:
            box.append(results)
            done.set()

        self._submit(requests, on_done)
        done.wait()
        return box[0]

    async def agenerate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[GenerateResult]] = loop.create_future()

        def set_result(results: list[GenerateResult]) -> None:
            if not future.done():
                future.set_result(results)

        def on_done(results: list[GenerateResult]) -> None:
            if loop.is_closed():  # the caller's loop is gone (e.g. its episode timed out and was torn down)
                return
            try:
                loop.call_soon_threadsafe(set_result, results)
            except RuntimeError:  # it closed between the check and the call: nobody waits for these results
                pass

        job = self._submit(requests, on_done)
        try:
            return await future
        except asyncio.CancelledError:
            # Nobody will read the results: let the worker drop these rows at its next step.
            job.cancelled = True
            raise

    def _submit(self, requests: list[GenerateRequest], on_done: Callable[[list[GenerateResult]], None]) -> _Job:
        job = _Job(len(requests), on_done)
        if not requests:
            on_done([])
            return job
        rows: list[_Row] = []
        errors = [self._check_request(request) for request in requests]  # outside the lock: the worker is not held up
        with self._cond:
            for i, (request, error) in enumerate(zip(requests, errors, strict=True)):
                if error is None and self._closed:
                    error = "the engine is closed"
                if error is not None:
                    version = None
                    if request.adapter is not None and request.adapter in self._adapters:
                        version = self._adapters[request.adapter].version
                    job.set(i, GenerateResult(finish_reason="error", weight_version=version, error=error))
                    continue
                seed = request.sampling.seed if request.sampling.seed is not None else self._seed_rng.getrandbits(63)
                rows.append(_Row(job=job, index=i, request=request, seed=seed))
            self._queue.extend(rows)
            self._awaiting = max(0, self._awaiting - len(rows))
            self._cond.notify_all()
        return job

    def _check_request(self, request: GenerateRequest) -> str | None:
        """A clear message when the request cannot run, else None."""
        if not isinstance(request, GenerateRequest):
            return f"request is a {type(request).__name__}: use rollout.types.GenerateRequest"
        ids = request.input_ids
        if not ids:
            return "input_ids=[] is not allowed; allowed: a list of at least one prompt token id"
        if self._context_len is not None and len(ids) >= self._context_len:  # first: O(1) for a huge prompt
            return (
                f"len(input_ids)={len(ids)} is not allowed; allowed: a prompt shorter than the model's context length "
                f"{self._context_len}"
            )
        fast = set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < self._vocab_size  # C loops, no per-id
        bad = [] if fast else [i for i, t in enumerate(ids) if not isinstance(t, int) or not 0 <= t < self._vocab_size]
        if bad:
            allowed = f"a token id (int) in [0, {self._vocab_size})"
            return f"input_ids[{bad[0]}]={ids[bad[0]]!r} is not allowed; allowed: {allowed}"
        if request.adapter is not None and request.adapter not in self._adapters:
            return self._unknown_adapter(request.adapter)
        p = request.sampling
        if not _finite(p.temperature) or p.temperature < 0:
            return f"sampling.temperature={p.temperature!r} is not allowed; allowed: a finite number >= 0 (0 = greedy)"
        if not _finite(p.top_p) or not 0 < p.top_p <= 1:
            return f"sampling.top_p={p.top_p!r} is not allowed; allowed: a number in (0, 1]"
        if not _finite(p.min_p) or not 0 <= p.min_p <= 1:
            return f"sampling.min_p={p.min_p!r} is not allowed; allowed: a number in [0, 1] (0 = off)"
        if p.seed is not None and (
            not isinstance(p.seed, int) or isinstance(p.seed, bool) or not 0 <= p.seed < _SEED_RANGE
        ):
            return f"sampling.seed={p.seed!r} is not allowed; allowed: None or an integer in [0, 2**64)"
        if not isinstance(p.top_k, int) or (p.top_k != -1 and p.top_k < 1):
            return f"sampling.top_k={p.top_k!r} is not allowed; allowed: -1 (off) or an int >= 1"
        if not isinstance(p.max_new_tokens, int) or p.max_new_tokens < 0:
            return f"sampling.max_new_tokens={p.max_new_tokens!r} is not allowed; allowed: an int >= 0"
        if p.stop and (self._tokenizer is None or any(not isinstance(s, str) or not s for s in p.stop)):
            allowed = "non-empty strings, with a tokenizer given to the engine"
            return f"sampling.stop={p.stop!r} is not allowed; allowed: {allowed}"
        if any(not isinstance(t, int) for t in p.stop_token_ids):
            return f"sampling.stop_token_ids={p.stop_token_ids!r} is not allowed; allowed: a list of ints"
        return None

    def _unknown_adapter(self, name: str) -> str:
        loaded = sorted(self._adapters)
        return f"adapter={name!r} is not allowed; allowed: an adapter loaded in the engine ({loaded}) or None (base)"

    # ------------------------------------------------------------------ pause / lifecycle

    def pause(self, mode: str = "abort") -> None:
        """Stop generation steps; returns once no model call is running (see the module docstring)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode={mode!r} is not allowed; allowed: one of {PAUSE_MODES}")
        with self._cond:
            self._paused = True
            self._pause_mode = mode
            self._cond.notify_all()
            while self._busy and self._worker.is_alive():
                self._cond.wait()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def is_paused(self) -> bool:
        with self._cond:
            return self._paused

    def health(self) -> bool:
        return not self._closed and self._worker.is_alive() and self._worker_error is None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join()
        with self._cond:
            leftover = list(self._queue)
            self._queue.clear()
        for row in leftover:
            self._finish(row, "error", error="the engine was closed before this request ran")

    # ------------------------------------------------------------------ worker

    def _worker_loop(self) -> None:
        try:
            while True:
                rows = self._next_wave()
                if rows is None:
                    return
                self._in_flight = list(rows)
                try:
                    self._run_wave(rows)
                except Exception as exc:  # e.g. out of memory; keep serving
                    logger.exception("embedded engine: a generation wave failed")
                    unfinished = [row for row in self._in_flight if not row.job.has(row.index)]
                    if len(unfinished) > 1:  # one row may be the cause: each runs again alone, from the start
                        for row in unfinished:
                            self._restart(row)
                        with self._cond:
                            self._queue.extendleft(reversed(unfinished))
                    else:  # a row alone (or nothing left): the error is its own
                        for row in unfinished:
                            self._finish(row, "error", error=f"generation failed: {exc!r}")
                finally:
                    self._in_flight = []
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
        except BaseException as exc:  # the worker itself broke: fail every waiting caller loudly
            self._worker_error = exc
            with self._cond:
                leftover = list(self._queue)
                self._queue.clear()
                self._cond.notify_all()
            for row in leftover:
                self._finish(row, "error", error=f"engine worker died: {exc!r}")
            raise

    def _next_wave(self) -> list[_Row] | None:
        """Block until rows may run; take up to `max_batch_size` of them. None when closed."""
        with self._cond:
            while True:
                while not self._closed and (self._paused or not self._queue):
                    self._cond.wait()
                if self._closed:
                    return None
                # Coalesce: the concurrent agenerate calls of one rollout arrive within a few ms. While continuations
                # of rows that just finished with `keep_prefix` (episodes' next turns) are still expected, every
                # arrival extends the wait by `batch_wait_s`, up to `continuation_wait_s` in all: the episodes that
                # come back together start their next turn in one prefill instead of one admission each.
                start = time.monotonic()
                deadline = start + self._batch_wait_s
                while len(self._queue) < self._max_batch_size and not (self._closed or self._paused):
                    left = deadline - time.monotonic()
                    before = len(self._queue)
                    if left <= 0 or (self._cond.wait(left) and len(self._queue) == before):
                        break
                    if len(self._queue) > before and self._awaiting > 0:
                        deadline = min(time.monotonic() + self._batch_wait_s, start + self._continuation_wait_s)
                if self._closed or self._paused or not self._queue:
                    continue  # paused while coalescing: wait for resume (or close) with the rows still queued
                n = self._fitting(list(itertools.islice(self._queue, self._max_batch_size)), 0, share=True)
                if self._queue[0].alone:  # a row of a wave that raised: in a wave of its own
                    n = 1
                else:  # and not beside the rows that are not
                    n = next((i for i, row in enumerate(itertools.islice(self._queue, n)) if row.alone), n)
                self._busy = True
                return [self._queue.popleft() for _ in range(n)]

    def _finish(self, row: _Row, reason: str, error: str | None = None) -> None:
        self._release_slot(row)
        keep_output = reason in ("stop", "length")
        result = GenerateResult(
            output_ids=list(row.output_ids) if keep_output else [],
            output_logprobs=list(row.logprobs) if keep_output else [],
            finish_reason=reason,
            weight_version=row.version,
            error=error,
        )
        row.job.set(row.index, result)

    def _release_slot(self, row: _Row) -> None:
        if row.holds_slot:
            row.holds_slot = False
            with self._slots_lock:
                left = self._slot_rows[row.slot] = self._slot_rows[row.slot] - 1
                if left == 0 and row.slot in self._retiring:  # an older version's last row: free its slot
                    del self._retiring[row.slot]
                    self._bank.clear(row.slot)

    def _restart(self, row: _Row) -> None:
        """Put an unfinished row of a wave that raised back to its state before the wave, to run alone."""
        self._release_slot(row)
        row.slot, row.version, row.cache_key, row.reused, row.generator = -1, None, (None, 0), None, None
        row.output_ids.clear()
        row.logprobs.clear()
        row.alone = True

    def _abort_requested(self) -> bool:
        with self._cond:
            return self._closed or (self._paused and self._pause_mode == "abort")

    def _still_current(self, row: _Row) -> bool:
        """False (and the row finished as "abort") when its adapter changed or its caller went away.

        Caller holds `_weights_lock`. This is what keeps every result on one weight version, even when
        `load_adapter` is called without a pause.
        """
        name = row.request.adapter
        entry = self._adapters.get(name) if name is not None else None
        if row.job.cancelled:
            reason = "cancelled"
        elif name is not None and entry is None:
            reason = f"adapter {name!r} was unloaded while the request was running; resubmit it"
        elif entry is not None and (
            entry.version != row.version or entry.slot != row.slot or entry.generation != row.cache_key[1]
        ):  # the generation too: a reload may keep the version number (given by the caller) and the slot
            with self._slots_lock:
                if self._retiring.get(row.slot) == (name, row.version, row.cache_key[1]):
                    return True  # a newer version was published beside it: it finishes on its own
            reason = (
                f"adapter {name!r} changed from version {row.version} to {entry.version} mid-request"
                + (" (reloaded under the same version)" if entry.version == row.version else "")
                + "; resubmit it"
            )
        else:
            return True
        self._finish(row, "abort", error=reason)
        return False

    def _run_wave(self, rows: list[_Row]) -> None:
        """Prefill `rows` together, then decode in lockstep, admitting queued rows as others finish."""
        with torch.inference_mode(), self._eval_mode():
            with self._weights_lock:
                if self._abort_requested():
                    # Paused (or closed) before the first token: these rows never ran, so they go back
                    # to the queue instead of coming back "abort".
                    with self._cond:
                        self._queue.extendleft(reversed(rows))
                    return
                batch = self._start(rows)
            while batch is not None:
                # A row whose logits are not finite (e.g. its adapter's weights are NaN) finishes alone with an error;
                # sampling it would raise for the whole batch, every other request included.
                bad = nonfinite_rows(batch.logits)
                if bad:
                    for i in bad:
                        self._finish(batch.rows[i], "error", error=_NONFINITE_ERROR)
                    good = sorted(set(range(len(batch.rows))) - set(bad))
                    if not good:
                        return
                    with self._weights_lock:
                        batch.select(good)
                tokens, logprobs = self._sample(batch.logits, batch.rows)  # (B,), (B,)
                reasons = [self._append(row, tokens[i], logprobs[i]) for i, row in enumerate(batch.rows)]
                done = [i for i, reason in enumerate(reasons) if reason is not None]
                if done and self._prefix_cache is not None:  # before the callers hear back: their next turn hits
                    self._keep_prefixes(batch, done)
                if done:  # requests that said a continuation follows: the next wave's coalescing waits for them
                    continuing = sum(1 for i in done if batch.rows[i].request.keep_prefix)
                    if continuing:
                        with self._cond:
                            self._awaiting = continuing
                for i in done:
                    self._finish(batch.rows[i], reasons[i])
                keep = [i for i, reason in enumerate(reasons) if reason is None]
                with self._weights_lock:
                    if self._abort_requested():
                        error = "aborted by pause(mode='abort') or close(); resubmit the request"
                        return self._abort([batch.rows[i] for i in keep], error)
                    keep = [i for i in keep if self._still_current(batch.rows[i])]
                    if not keep:
                        return  # queued rows (if any) start the next wave
                    if len(keep) < len(batch.rows):
                        batch.select(keep)
                    batch.logits = self._decode_step(batch)
                    self._admit(batch)

    def _start(self, rows: list[_Row]) -> _Batch | None:
        """Resolve adapters and prefill `rows`; None when none of them can run (caller holds `_weights_lock`)."""
        rows = self._resolve_adapters(rows)
        return self._prefill(rows) if rows else None

    def _admit(self, batch: _Batch) -> None:
        """Continuous batching: prefill queued rows into the free room of a running batch.

        Not while paused (a wait-mode pause must not grow the running wave) and only for caches made of
        plain `DynamicLayer`s, whose KV tensors can be left-padded and concatenated (sliding-window
        layers keep a rolling window and are left to the next wave).
        """
        room = self._max_batch_size - len(batch.rows)
        if room <= 0 or not batch.can_merge():
            return
        with self._cond:
            if self._paused or self._closed or not self._queue:
                return
            queued = list(itertools.takewhile(lambda r: not r.alone, itertools.islice(self._queue, room)))
            if not queued:  # a row of a wave that raised runs alone, in a wave of its own
                return
            held = sum(self._row_tokens(r) for r in batch.rows) if self._max_wave_tokens is not None else 0
            rows = [self._queue.popleft() for _ in range(self._fitting(queued, held, share=False))]
            if not rows:
                return
        self._in_flight.extend(rows)
        new = self._start(rows)
        if new is not None:
            batch.merge(new)

    def _decode_step(self, batch: _Batch) -> torch.Tensor:
        """Feed every row its last sampled token; returns the next logits, (B, V) float32."""
        next_ids = torch.tensor([[row.output_ids[-1]] for row in batch.rows], device=self._device)  # (B, 1)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch.rows), 1)], dim=1)  # (B, T + 1)
        batch.last_pos = batch.last_pos + 1  # (B,) each row's position id continues from its own length
        return self._forward(next_ids, batch.mask, batch.last_pos[:, None], batch.slots, batch.cache)

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        """Run a wave with the model in eval mode (no dropout), restoring the caller's mode after.

        The trainer trains in eval mode and leaves the model in it, so on a base shared with a trainer
        that runs at the same time (an asynchronous run) the mode is already eval and never flips here.
        """
        was_training = self._model.training
        if was_training:
            self._model.eval()
        try:
            yield
        finally:
            if was_training:
                self._model.train()

    def _resolve_adapters(self, rows: list[_Row]) -> list[_Row]:
        """Give each row its adapter's slot and current version; error rows whose adapter is gone."""
        active = []
        waiting: list[_Row] = []  # bank paging: every slot has rows running; these wait in the queue
        for row in rows:
            name = row.request.adapter
            if row.job.cancelled:
                self._finish(row, "abort", error="cancelled")
                continue
            if name is not None:
                entry = self._adapters.get(name)
                if entry is None:  # it was loaded when the request came (checked then): unloaded while queued
                    error = f"adapter {name!r} was unloaded while the request was queued; resubmit it"
                    self._finish(row, "abort", error=error)
                    continue
                if entry.slot < 0 and not self._page_in(name, entry):
                    waiting.append(row)
                    continue
                if self._page:
                    self._lru.move_to_end(name)
                row.slot, row.version = entry.slot, entry.version
                row.cache_key = (name, entry.generation)
                with self._slots_lock:
                    self._slot_rows[row.slot] = self._slot_rows.get(row.slot, 0) + 1
                row.holds_slot = True
            if row.params.max_new_tokens == 0:
                self._finish(row, "length")
                continue
            if row.params.temperature > 0:
                row.generator = torch.Generator().manual_seed(row.seed)
            active.append(row)
        if waiting:
            ids = {id(r) for r in waiting}
            self._in_flight = [r for r in self._in_flight if id(r) not in ids]
            with self._cond:
                self._queue.extendleft(reversed(waiting))
        return active

    def _abort(self, rows: list[_Row], error: str) -> None:
        for row in rows:
            self._finish(row, "abort", error=error)

    def _prefill(self, rows: list[_Row]) -> _Batch:
        """Left-padded batched prefill of each distinct (prompt, adapter), expanded to one cache row per row.

        With the prefix cache, a prompt whose first m tokens have cached KV feeds only its last n - m: row u's cache
        is [left padding | its m cached columns] (width W0 = max m) and its new tokens are left-padded after it, so
        its mask reads [0.. 1*m 0.. 1*(n - m)]. With no hit W0 = 0 and this is the plain left-padded prefill.
        """
        unique: dict[tuple[tuple[int, ...], int], int] = {}
        row_to_unique = [unique.setdefault((tuple(r.request.input_ids), r.slot), len(unique)) for r in rows]
        prompts = list(unique)
        first = {u: row for u, row in reversed(list(zip(row_to_unique, rows, strict=True)))}  # a row of each prompt
        hits: list[tuple[PrefixEntry | None, int]] = [(None, 0)] * len(prompts)
        if self._prefix_cache is not None:  # reuse at most n - 1 tokens: the last one's logits are needed
            hits = [
                self._prefix_cache.lookup(first[u].cache_key, ids, len(ids) - 1) for u, (ids, _) in enumerate(prompts)
            ]
        for row, u in zip(rows, row_to_unique, strict=True):
            entry, m = hits[u]
            row.reused = entry if entry is not None and m == len(entry.tokens) else None
        self.prompt_tokens += sum(len(ids) for ids, _ in prompts)
        self.reused_tokens += sum(m for _, m in hits)
        width = max(len(ids) - m for (ids, _), (_, m) in zip(prompts, hits, strict=True))
        input_ids = torch.zeros(len(prompts), width, dtype=torch.long)  # (U, S) left-padded with token 0
        mask = torch.zeros(len(prompts), width, dtype=torch.long)  # (U, S) 1 = real token
        reused = torch.zeros(len(prompts), dtype=torch.long)  # (U,) m: tokens whose KV comes from the cache
        for i, ((ids, _), (_, m)) in enumerate(zip(prompts, hits, strict=True)):
            input_ids[i, width - len(ids) + m :] = torch.tensor(ids[m:])
            mask[i, width - len(ids) + m :] = 1
            reused[i] = m
        input_ids, mask, reused = input_ids.to(self._device), mask.to(self._device), reused.to(self._device)
        # (U, S) real tokens count from m after the padding
        positions = (mask.cumsum(-1) - 1).clamp_min(0) + reused[:, None]
        slots = torch.tensor([slot for _, slot in prompts], device=self._device)  # (U,) -1 = base
        cache = DynamicCache(config=self._config)
        if any(m for _, m in hits):
            past_mask = self._seed_cache(cache, hits)  # (U, W0)
            mask = torch.cat([past_mask, mask], dim=1)  # (U, W0 + S)
        logits = self._forward(input_ids, mask, positions, slots, cache)  # (U, V)
        batch = _Batch(list(rows), cache, mask, positions[:, -1], slots, logits)
        if len(prompts) < len(rows):
            # (B,) unique prompt of each row; a row feeds at most its max_new_tokens - 1 tokens after the prefill
            capacity = max(self._tokens_left(r) for r in rows) - 1
            batch.share(torch.tensor(row_to_unique, device=self._device), min(capacity, _OWN_KV_CAPACITY))
        return batch

    def _seed_cache(self, cache: DynamicCache, hits: list[tuple[PrefixEntry | None, int]]) -> torch.Tensor:
        """Fill `cache` with each prompt's cached KV, right-aligned at width W0 = max m; returns the mask, (U, W0)."""
        width = max(m for _, m in hits)
        reused = torch.tensor([m for _, m in hits], device=self._device)  # (U,)
        mask = (torch.arange(width, device=self._device) >= width - reused[:, None]).long()  # (U, W0)
        found = [(u, entry, m) for u, (entry, m) in enumerate(hits) if entry is not None and m > 0]
        every = len(found) == len(hits) and all(m == width for _, _, m in found)  # no row has padding
        if not every:  # where each cached column goes: row u, columns W0 - m .. W0 - 1
            where_u = torch.tensor([u for u, _, m in found for _ in range(m)], device=self._device)
            where_t = torch.tensor([t for _, _, m in found for t in range(width - m, width)], device=self._device)
        for layer_idx, layer in enumerate(cache.layers):
            tensors = []
            for kind in ("keys", "values"):
                parts = [getattr(entry, kind)[layer_idx][:, :m] for _, entry, m in found]  # (H, m, D) each
                if every:
                    tensors.append(torch.stack(parts))  # (U, H, W0, D)
                    continue
                h, _, d = parts[0].shape
                out = parts[0].new_zeros(len(hits), h, width, d)  # (U, H, W0, D) zeros = padding
                out.permute(0, 2, 1, 3)[where_u, where_t] = torch.cat(parts, dim=1).transpose(0, 1)  # (sum m, H, D)
                tensors.append(out)
            layer.update(*tensors)
        return mask

    def _keep_prefixes(self, batch: _Batch, done: list[int]) -> None:
        """Copy the KV of finished rows `done` (prompt + output but the last token, never fed) into the prefix cache;
        only rows whose request says a continuation will follow (`keep_prefix`)."""
        keep = [i for i in done if batch.rows[i].request.keep_prefix]
        if not keep:
            return
        masks = batch.mask[keep].tolist()  # the rows' real columns: their padding and any gap are left out
        for i, mask_row in zip(keep, masks, strict=True):
            row = batch.rows[i]
            tokens = list(row.request.input_ids) + row.output_ids[:-1]
            if len(tokens) < PREFIX_BLOCK:
                continue
            runs = _runs(mask_row)
            if sum(b - a for a, b in runs) != len(tokens):  # never expected: a misaligned entry feeds rows wrong KV
                logger.warning("embedded engine: a finished row's KV does not match its tokens; not cached")
                continue
            keys, values = batch.row_kv(i, runs)  # per layer (H, n, D) copies
            replaces = row.reused.id if row.reused is not None else None
            self._prefix_cache.insert(row.cache_key, tokens, keys, values, replaces=replaces)

    def _forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cache: DynamicCache,
    ) -> torch.Tensor:
        """One model call through the engine's bank; returns the last position's logits, (B, V) float32."""
        out = self._model(
            input_ids,
            attention_mask=mask,
            position_ids=positions,
            adapter_slots=slots,
            lora_bank=self._bank,
            **{self._cache_kwarg: cache},
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :].float()

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> tuple[list[int], list[float]]:
        """Pick each row's next token and its raw (temperature-1) log-prob; logits: (B, V) float32.

        In chunks of at most `_SAMPLE_ELEMENTS` logits: the sampler's temporaries (a copy of the logits,
        probabilities, CDF, log-softmax) are each (rows, V), 18 MiB apiece for 96 rows of a 49k vocabulary at once
        (21 rows a chunk there; a small vocabulary samples every row at once, where more calls would cost more than
        they save). Every step of it is per row (a row's own generator, settings and logits), so the chunking
        changes no token or log-prob."""
        tokens: list[int] = []
        logprobs: list[float] = []
        step = max(1, _SAMPLE_ELEMENTS // logits.shape[-1])  # rows per chunk
        for start in range(0, len(rows), step):
            part, chunk = logits[start : start + step], rows[start : start + step]
            picked = sample_next_tokens(part, [r.params for r in chunk], [r.generator for r in chunk])  # (b,)
            tokens += picked.tolist()
            logprobs += token_logprobs(part, picked).tolist()
        return tokens, logprobs

    @contextlib.contextmanager
    def waves_within(self, max_wave_tokens: int | None) -> Iterator[None]:
        """Within the block, rows join waves within `max_wave_tokens` positions instead of the engine's own bound
        (None: the engine's own): a held-out eval's many distinct prompts under a tighter bound than the rollout's.
        Admissions made meanwhile follow it, whoever's rows they are; rows already running keep their room. Not for
        two threads at once (the run's evals come from its one step loop)."""
        if max_wave_tokens is None:
            yield
            return
        _check_wave_tokens(max_wave_tokens)
        with self._cond:
            own, self._max_wave_tokens = self._max_wave_tokens, max_wave_tokens
        try:
            yield
        finally:
            with self._cond:
                self._max_wave_tokens = own

    def _row_tokens(self, row: _Row) -> int:
        """The positions `row` holds in a wave's KV by the time it finishes: its prompt, and every token it may
        generate (those it has and those left)."""
        return len(row.request.input_ids) + len(row.output_ids) + self._tokens_left(row)

    def _fitting(self, rows: list[_Row], held: int, share: bool) -> int:
        """How many of `rows` (a prefix, in order) join a wave already holding `held` positions within
        `max_wave_tokens`: at least one when the wave is empty. `share`: a prompt seen before in `rows` (same adapter
        and tokens) is counted once."""
        if self._max_wave_tokens is None:
            return len(rows)
        seen: set[tuple[str | None, tuple[int, ...]]] = set()  # with `share`: the prompts counted so far
        for n, row in enumerate(rows):
            cost = self._row_tokens(row)
            if share:
                key = (row.request.adapter, tuple(row.request.input_ids))
                if key in seen:
                    cost -= len(row.request.input_ids)
                seen.add(key)
            if held + cost > self._max_wave_tokens and (n > 0 or held > 0):
                return n
            held += cost
        return len(rows)

    def _tokens_left(self, row: _Row) -> int:
        """The most tokens `row` can still generate: its max_new_tokens, capped by the model's context length."""
        left = row.params.max_new_tokens - len(row.output_ids)
        if self._context_len is not None:
            left = min(left, self._context_len - len(row.request.input_ids) - len(row.output_ids))
        return max(left, 0)

    def _append(self, row: _Row, token: int, logprob: float) -> str | None:
        """Record the row's new token; its finish reason when it is done, else None."""
        row.output_ids.append(token)
        row.logprobs.append(logprob)
        params = row.params
        if (token in self._eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if params.stop and self._hits_stop_string(row.output_ids, params.stop):
            return "stop"
        if len(row.output_ids) >= params.max_new_tokens or (
            self._context_len is not None and len(row.request.input_ids) + len(row.output_ids) >= self._context_len
        ):
            return "length"  # as SGLang: the context length caps max_new_tokens
        return None

    def _hits_stop_string(self, output_ids: list[int], stops: list[str]) -> bool:
        # A stop string of n characters spans at most 4n tokens (a byte-level token can carry a
        # single byte of a 4-byte character), so decoding that tail is enough and stays O(1) per step.
        window = 4 * max(len(s) for s in stops) + 1
        text = self._tokenizer.decode(output_ids[-window:])
        return any(s in text for s in stops)
