"""Stability records: what the server sampled, kept so a `stable_reinforce` datum can name it (Tinker's protocol).

The protocol is Tinker's (SDK 0.38, `tinker/types/provenance_spans.py`, `SampleRequest.record_stability_info`):

- A sampling client made with `record_stability_info=True` sends that flag on every sample request. The server
  answers the request's promise with `sample_sequence_ids`, one per requested sample, and the SDK stamps them on the
  returned sequences (`SampledSequence.sequence_id`). For a recording request each id is fresh and unguessable
  (`secrets.token_urlsafe`, 144 bits) and the server records, under it, the request's prompt tokens, the sampled
  tokens and the sampler's own per-token log-probs, owned by the session that sampled (the first part of the
  sampling session's id). A request without the flag gets labels (`<request>.<i>`) that name no record.
- A forward_backward `Datum` carries provenance (`Datum.with_provenance`, proto fields `model_input_spans` and
  `loss_fn_input_spans`; JSON bodies, SDK < 0.25, have none): runs that tile `model_input` and
  `loss_fn_inputs["target_tokens"]`, each a `PromptProvenanceSpan` (positions offset.. of a sequence's request
  prompt) or a `SampledProvenanceSpan` (positions offset.. of its sampled tokens), naming a `sequence_id`.

What `resolve` checks for a `stable_reinforce` datum (each failure a ValueError naming the field and the value, which the server answers as a user error):
both span lists present and tiling their fields exactly; every sequence_id recorded, not expired and of the
datum's own session (a foreign session's id reads as unknown: the answer does not say it exists); every span inside
its sequence's prompt or sampled tokens; `model_input` under every span equal to the recorded tokens; under a
sampled span the `target_tokens` equal to the sampled tokens, and the input before them exactly that sequence's
prompt plus its sampled tokens before the span (the recorded log-probs hold only in that context); under a prompt
span the advantages 0 (prompt positions carry no loss). Target tokens under a prompt span are not read (rl_loop
sends 0 there). It returns, per target position, the recorded sampler log-prob and 1 on sampled positions (0 and 0
elsewhere): the loss's `old_logp` and mask (`rl_multilora.losses`). Other losses ignore provenance: tinker-cookbook's
`rl/train` attaches it whatever the loss.

Memory is bounded two ways: a record unused (not sampled, not named by a datum) for `ttl_s` (one day; the SDK documents
records as session-scoped and expiring after inactivity) is dropped, and the records hold at most `max_tokens` tokens (a
sequence counts its prompt plus its sampled tokens, though a request's sequences share one prompt array): past it
the least recently used records are evicted (LRU). A sample request that alone could exceed the cap is refused when
it is sent. A session that expires drops its records. Records live in memory only: a restart replays the samples
its journal still holds (those after each model's last snapshot) and records them again under the same ids; older
ones are gone, and naming them is refused as unknown.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rl_multilora.tinker.wire import Datum, Span

DAY_S = 86_400.0
MAX_TOKENS = 2**24  # ~16.8M tokens: at most 8 bytes each (int32 token + float32 log-prob), 128 MiB


@dataclass
class SampledRecord:
    """One recorded sequence: its request's prompt (shared by the request's sequences), its sampled tokens and the
    sampler's log-prob of each, the session that owns it and when it was last used (the store's clock)."""

    session: str
    prompt: np.ndarray  # (P,) int32
    tokens: np.ndarray  # (S,) int32
    logprobs: np.ndarray  # (S,) float32
    used: float = 0.0

    @property
    def size(self) -> int:
        return len(self.prompt) + len(self.tokens)


@dataclass
class Resolved:
    """A datum's sampler side, per target position (N,): the recorded log-prob (0 off sampled tokens) and the
    sampled-token mask (1 on sampled tokens, 0 on prompt positions)."""

    sampler_logprobs: list[float]
    sampled: list[float]


def session_of(key: str) -> str:
    """The session a model id, sampling session id or request id belongs to (its first part).

    >>> session_of("s1:train:0"), session_of("s1.sampler.2"), session_of("s1:train:0.sampler.1")
    ('s1', 's1', 's1')
    """
    return key.split(":")[0].split(".")[0]


class StabilityRecords:
    """The server's stability records (see the module docstring); thread-safe (samples record on the event loop,
    forward_backward resolves on the worker)."""

    def __init__(
        self, ttl_s: float = DAY_S, max_tokens: int = MAX_TOKENS, clock: Callable[[], float] = time.monotonic
    ):
        if not (isinstance(ttl_s, int | float) and not isinstance(ttl_s, bool) and ttl_s > 0):
            raise ValueError(f"ttl_s={ttl_s!r} is not allowed; allowed: seconds > 0 (a record unused this long goes)")
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(
                f"max_tokens={max_tokens!r} is not allowed; allowed: an int >= 1 (tokens of records kept)"
            )
        self.ttl_s = float(ttl_s)
        self.max_tokens = max_tokens
        self.clock = clock
        self._records: OrderedDict[str, SampledRecord] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.tokens = 0  # held now, by `SampledRecord.size`
        self.evicted = 0  # records dropped for the cap (LRU)
        self.expired = 0  # records dropped after ttl_s unused

    @staticmethod
    def new_ids(n: int) -> list[str]:
        """`n` fresh, unguessable sequence ids."""
        return ["seq-" + secrets.token_urlsafe(18) for _ in range(n)]

    def check_room(self, n: int, prompt_len: int, max_new: int) -> None:
        """Refuse a recording sample whose `n` sequences could alone hold more than the cap."""
        need = n * (prompt_len + max_new)
        if need > self.max_tokens:
            raise ValueError(
                f"record_stability_info with num_samples={n} of a {prompt_len}-token prompt and up to {max_new} new "
                f"tokens each could record {need} tokens; allowed: at most {self.max_tokens} (the server's "
                "--stability-max-tokens); ask for fewer samples or tokens"
            )

    def record(
        self, session: str, ids: list[str], prompt: list[int], seqs: list[tuple[list[int], list[float], str]]
    ) -> None:
        """Record each sequence of one sample request (`seqs`: tokens, sampler log-probs, stop reason) under its id."""
        prompt_arr = np.asarray(prompt, dtype=np.int32)
        with self._lock:
            now = self.clock()
            for sid, (tokens, logprobs, _) in zip(ids, seqs, strict=True):
                old = self._records.pop(sid, None)  # a replay records the same id again
                if old is not None:
                    self.tokens -= old.size
                rec = SampledRecord(session, prompt_arr, np.asarray(tokens, dtype=np.int32),
                                    np.asarray(logprobs, dtype=np.float32), now)  # fmt: skip
                self._records[sid] = rec
                self.tokens += rec.size
            self._sweep(now)

    def get(self, session: str, sequence_id: str) -> SampledRecord | None:
        """The record of `session` under `sequence_id`, now its most recently used (TTL refreshed); None when there is
        none, it expired or it is another session's."""
        with self._lock:
            now = self.clock()
            self._sweep(now)
            rec = self._records.get(sequence_id)
            if rec is None or rec.session != session:
                return None
            rec.used = now
            self._records.move_to_end(sequence_id)
            return rec

    def holds_any(self, ids: list[str]) -> bool:
        """Whether any of `ids` still has a record (expired ones dropped first); uses none of them."""
        with self._lock:
            self._sweep(self.clock())
            return any(sid in self._records for sid in ids)

    def drop_session(self, session: str) -> None:
        with self._lock:
            for sid in [k for k, r in self._records.items() if r.session == session]:
                self.tokens -= self._records.pop(sid).size

    def _sweep(self, now: float) -> None:
        """Drop expired records and, past the cap, the least recently used (under `_lock`). The order is last use,
        so both come off the front."""
        while self._records:
            sid, rec = next(iter(self._records.items()))
            if now - rec.used > self.ttl_s:
                self.expired += 1
            elif self.tokens > self.max_tokens:
                self.evicted += 1
            else:
                return
            del self._records[sid]
            self.tokens -= rec.size

    def stats(self) -> dict[str, int]:
        with self._lock:
            nbytes = sum(r.prompt.nbytes + r.tokens.nbytes + r.logprobs.nbytes for r in self._records.values())
            return {"records": len(self._records), "tokens": self.tokens, "bytes": nbytes,
                    "evicted": self.evicted, "expired": self.expired}  # fmt: skip

    # -- a stable_reinforce datum ------------------------------------------------------------------------------------
    def resolve(self, session: str, d: Datum, where: str) -> Resolved:
        """The sampler side of datum `d` (`where`: its name in errors, e.g. "data[3]") from the records its
        provenance names; a ValueError for anything the module docstring lists. `d`'s own fields (lengths, token
        ids, finite values) are checked before this."""
        n = len(d.tokens)
        if not d.input_spans or not d.target_spans:
            has = [k for k, v in (("model_input_spans", d.input_spans), ("loss_fn_input_spans", d.target_spans)) if v]
            raise ValueError(
                f"{where} has {' and '.join(has) or 'no provenance'}{' only' if has else ''}; loss_fn "
                "'stable_reinforce' needs both model_input_spans and loss_fn_input_spans (Datum.with_provenance), "
                "naming sequences a sampling client made with record_stability_info=True returned"
            )
        tokens = np.asarray(d.tokens).reshape(-1)
        targets = np.asarray(d.inputs["target_tokens"]).reshape(-1)
        adv = np.asarray(d.inputs["advantages"], dtype=np.float64).reshape(-1)
        records: dict[str, SampledRecord] = {}

        def record_of(span: Span, name: str) -> tuple[SampledRecord, np.ndarray]:
            if span.kind not in ("prompt", "sampled"):
                raise ValueError(f"{name} is neither prompt_tokens nor sampled_tokens; allowed: one of the two")
            if not isinstance(span.sequence_id, str) or not span.sequence_id:
                raise ValueError(f"{name}.sequence_id={span.sequence_id!r} is not allowed; allowed: a sequence_id")
            rec = records.get(span.sequence_id) or self.get(session, span.sequence_id)
            if rec is None:
                raise ValueError(
                    f"{name}.sequence_id={span.sequence_id!r} is not a sequence this session sampled with "
                    f"record_stability_info=True (unknown, another session's, unused for {self.ttl_s:g} s, or "
                    f"evicted past the server's {self.max_tokens} tokens of records); sample again and name the new "
                    "sequence_id"
                )
            records[span.sequence_id] = rec
            src = rec.prompt if span.kind == "prompt" else rec.tokens
            what = "prompt" if span.kind == "prompt" else "sampled tokens"
            if span.offset < 0 or span.length < 0 or span.offset + span.length > len(src):
                raise ValueError(
                    f"{name} (offset={span.offset}, length={span.length}) is not allowed; allowed: offset >= 0, "
                    f"length >= 0, within the {len(src)} {what} of sequence_id {span.sequence_id!r}"
                )
            return rec, src[span.offset : span.offset + span.length]

        for field, spans in (("model_input_spans", d.input_spans), ("loss_fn_input_spans", d.target_spans)):
            covered = sum(max(s.length, 0) for s in spans)
            if covered != n or any(s.length < 0 for s in spans):
                raise ValueError(
                    f"{where}.{field} cover {covered} positions; allowed: runs of length >= 0 that tile the "
                    f"{n} positions of {'model_input' if field == 'model_input_spans' else 'target_tokens'} exactly"
                )
        pos = 0
        for j, span in enumerate(d.input_spans):
            _, want = record_of(span, f"{where}.model_input_spans[{j}]")
            _same(tokens[pos : pos + span.length], want, pos, f"{where}.model_input", span)
            pos += span.length
        sampler = np.zeros(n, dtype=np.float64)
        sampled = np.zeros(n, dtype=np.float64)
        pos = 0
        for j, span in enumerate(d.target_spans):
            name = f"{where}.loss_fn_input_spans[{j}]"
            rec, want = record_of(span, name)
            end = pos + span.length
            if span.kind == "prompt":
                nonzero = np.flatnonzero(adv[pos:end])
                if nonzero.size:
                    p = pos + int(nonzero[0])
                    raise ValueError(
                        f"{where}.loss_fn_inputs['advantages'][{p}]={float(adv[p])!r} is not allowed: position {p} is a "
                        f"prompt position ({name} is a PromptProvenanceSpan); allowed: 0 (stable_reinforce trains "
                        "sampled tokens only)"
                    )
            elif span.length:
                _same(targets[pos:end], want, pos, f"{where}.loss_fn_inputs['target_tokens']", span)
                # target p is sampled token offset + (p - pos), predicted from model_input[:p + 1]: that must be the
                # sequence's prompt and its sampled tokens before it, the context the sampler scored it in
                start = len(rec.prompt) + span.offset - 1
                context = np.concatenate([rec.prompt, rec.tokens[: span.offset + span.length - 1]])
                if pos != start or not np.array_equal(tokens[:end], context[:end]):
                    raise ValueError(
                        f"{name} puts sampled tokens {span.offset}..{span.offset + span.length - 1} of sequence_id "
                        f"{span.sequence_id!r} at target positions {pos}..{end - 1}; allowed: at positions "
                        f"{start}.., after model_input positions 0..{start} holding exactly that sequence's "
                        f"{len(rec.prompt)}-token prompt and its sampled tokens before {span.offset} (the context "
                        "its sampler log-probs were computed in)"
                    )
                sampler[pos:end] = rec.logprobs[span.offset : span.offset + span.length]
                sampled[pos:end] = 1.0
            pos = end
        return Resolved(sampler.tolist(), sampled.tolist())


def _same(got: np.ndarray, want: np.ndarray, start: int, field: str, span: Span) -> None:
    """A ValueError naming the first position where `got` (the datum's, from position `start`) is not `want`."""
    diff = np.flatnonzero(got != want)
    if diff.size:
        k = int(diff[0])
        what = "prompt token" if span.kind == "prompt" else "sampled token"
        raise ValueError(
            f"{field}[{start + k}]={int(got[k])} is not allowed: the span names {what} {span.offset + k} of "
            f"sequence_id {span.sequence_id!r}, which was {int(want[k])}; allowed: the tokens as they were sampled"
        )
