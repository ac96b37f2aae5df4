"""The durable request log: every request the server acknowledges is committed here first, and the log stays bounded
by each client's snapshots.

One SQLite file (WAL, synchronous=FULL): a row per acknowledged request, keyed by its deterministic request id, with
its kind, body and the model (and seq_id) it belongs to. A restarted server replays the rows in the order they were
acknowledged through the same scheduler (requests of one model still run in seq_id order), so models, optimizer
states, sampler versions and the results clients still poll for are rebuilt and no acknowledged request is lost.
Replay recomputes; it does not read results back, so a replayed mixed batch may group rows differently than the first
run (same math, float rounding).

Bounded by snapshots: every `snapshot_every` optimizer steps of a model (and at each of its `save_state` and
`load_weights`; never while a forward_backward's gradient waits for its optim_step), the server writes the model's
state as a run checkpoint (weights, optimizer, step count; its live sampler versions' tensors go into `samplers`) and
`compact` swaps, in one transaction, the model's requests before that point for the snapshot and their results. A
restart restores the snapshot and replays only what came after it, so its time follows the snapshot interval, not the
client's history. Results of compacted requests are kept for the two latest snapshots of a model (`done`): a client
that polls a future it had not fetched before the restart still gets it.

A second table records which models hold a slot (written when a create or load makes one and when an unload frees
it): a restarted service holds slots for those models before it admits GRPO tenants, so the replay finds them.
A create that was refused (no free slot) is in the log but not here, so it gets no slot it never had.

An ended session leaves one row, its end (a restart must refuse it still: a session the server does not know is
taken on, and a retried create of it would run again); its models' results join those of finished samples once
they are unloaded (`retire`), and its other rows are gone.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FINISHED_KEPT = 1024  # results of finished samples (`Journal.finish`) a journal keeps, newest first


@dataclass
class Snapshot:
    """A model's state as of its request `next_seq` (all requests before it done): `info` says how to rebuild it
    (checkpoint label, rank, LoRA config, seed, sampler versions), `samplers` holds those versions' tensors."""

    model_id: str
    next_seq: int
    generation: int
    info: dict[str, Any]
    samplers: dict[str, bytes]  # sampler path -> safetensors bytes of its tensors


class Journal:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS requests (n INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT UNIQUE NOT NULL,"
            " kind TEXT NOT NULL, body BLOB NOT NULL)"
        )
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(requests)")}
        for column, kind in (("model_id", "TEXT"), ("seq", "INTEGER")):  # a journal written before snapshots
            if column not in columns:
                self._db.execute(f"ALTER TABLE requests ADD COLUMN {column} {kind}")
        self._db.execute("CREATE TABLE IF NOT EXISTS models (model_id TEXT PRIMARY KEY, live INTEGER NOT NULL)")
        self._db.execute("DELETE FROM models WHERE live = 0")  # an unloaded model's row, which `set_live` kept once
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS snapshots (model_id TEXT PRIMARY KEY, next_seq INTEGER NOT NULL,"
            " generation INTEGER NOT NULL, info TEXT NOT NULL)"
        )
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS samplers (path TEXT PRIMARY KEY, model_id TEXT NOT NULL, tensors BLOB NOT NULL)"
        )
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS done (key TEXT PRIMARY KEY, model_id TEXT NOT NULL, generation INTEGER NOT NULL,"
            " result BLOB NOT NULL, is_json INTEGER NOT NULL)"
        )
        self._lock = threading.Lock()

    def append(self, key: str, kind: str, body: bytes, model_id: str | None = None, seq: int | None = None) -> bool:
        """Commit the request (of `model_id`'s request `seq`, when it has one); False when `key` is already logged
        (a retry)."""
        with self._lock:
            cur = self._db.execute(
                "INSERT OR IGNORE INTO requests (key, kind, body, model_id, seq) VALUES (?, ?, ?, ?, ?)",
                (key, kind, body, model_id, seq),
            )
            return cur.rowcount == 1

    def replay(self) -> list[tuple[str, str, bytes, str | None, int | None]]:
        """(request id, kind, body, model id, seq) of every request in the log, in the order they were logged."""
        with self._lock:
            return list(self._db.execute("SELECT key, kind, body, model_id, seq FROM requests ORDER BY n"))

    def size(self) -> int:
        """Requests in the log (what a restart replays)."""
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM requests").fetchone()[0]

    def snapshots(self) -> list[Snapshot]:
        """The latest snapshot of every model that has one, oldest model first."""
        with self._lock:
            rows = list(self._db.execute("SELECT model_id, next_seq, generation, info FROM snapshots ORDER BY rowid"))
            out = []
            for model_id, next_seq, generation, info in rows:
                samplers = dict(self._db.execute("SELECT path, tensors FROM samplers WHERE model_id = ?", (model_id,)))
                out.append(Snapshot(model_id, next_seq, generation, json.loads(info), samplers))
            return out

    def result(self, key: str) -> bytes | dict[str, Any] | None:
        """The kept result of compacted (or finished) request `key`; None when there is none."""
        with self._lock:
            row = self._db.execute("SELECT result, is_json FROM done WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        return json.loads(row[0]) if row[1] else bytes(row[0])

    def has_result(self, key: str) -> bool:
        """Whether compacted (or finished) request `key` has a kept result."""
        with self._lock:
            return self._db.execute("SELECT 1 FROM done WHERE key = ?", (key,)).fetchone() is not None

    def finish(self, key: str, result: bytes | dict[str, Any], keep: int = FINISHED_KEPT) -> None:
        """Swap a finished sample (of the base, or of any sampler weights) for its result, in one transaction; the
        results of the `keep` latest such requests are kept."""
        with self._transaction():
            self._db.execute(
                "INSERT OR REPLACE INTO done (key, model_id, generation, result, is_json) VALUES (?, '', 0, ?, ?)",
                (key, *_encoded(result)),
            )
            self._db.execute("DELETE FROM requests WHERE key = ?", (key,))
            self._trim_finished(keep)

    def compact(
        self,
        model_id: str,
        next_seq: int,
        info: dict[str, Any] | None,
        samplers: dict[str, bytes],
        results: dict[str, bytes | dict[str, Any]],
        sample_keys: list[str],
    ) -> int:
        """Swap `model_id`'s requests before `next_seq` (and its finished samples `sample_keys`) for its snapshot
        `info` (None: the model is gone, forget it) with its sampler versions, keeping the results of what is
        removed. One transaction: a kill leaves the log before or after, never between. Returns the generation."""
        with self._transaction():
            row = self._db.execute("SELECT generation FROM snapshots WHERE model_id = ?", (model_id,)).fetchone()
            generation = (row[0] if row else 0) + 1
            removed = [
                key
                for (key,) in self._db.execute(
                    "SELECT key FROM requests WHERE model_id = ? AND (seq < ? OR seq IS NULL)",
                    (model_id, next_seq),
                )
                if key in results or key in sample_keys
            ]
            for key in removed:
                value = results.get(key)
                if value is not None:
                    self._db.execute(
                        "INSERT OR REPLACE INTO done (key, model_id, generation, result, is_json) VALUES (?, ?, ?, ?, ?)",
                        (key, model_id, generation, *_encoded(value)),
                    )
                self._db.execute("DELETE FROM requests WHERE key = ?", (key,))
            self._db.execute("DELETE FROM done WHERE model_id = ? AND generation < ?", (model_id, generation - 1))
            self._db.execute("DELETE FROM samplers WHERE model_id = ?", (model_id,))
            if info is None:
                self._db.execute("DELETE FROM snapshots WHERE model_id = ?", (model_id,))
            else:
                for path, tensors in samplers.items():
                    self._db.execute(
                        "INSERT INTO samplers (path, model_id, tensors) VALUES (?, ?, ?)",
                        (path, model_id, tensors),
                    )
                self._db.execute(
                    "INSERT INTO snapshots (model_id, next_seq, generation, info) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT(model_id) DO UPDATE SET next_seq = excluded.next_seq, "
                    "generation = excluded.generation, info = excluded.info",
                    (model_id, next_seq, generation, json.dumps(info)),
                )
        return generation

    def retire(self, model_id: str, keep: int = FINISHED_KEPT) -> None:
        """Move the kept results of `model_id`, unloaded and of an ended session, to those of finished samples (the
        `keep` newest kept): no snapshot of it comes again to drop them, so every ended session left its models'
        results for ever. A request of an ended session is refused, never run again, once its result is gone."""
        with self._transaction():
            self._db.execute("UPDATE done SET model_id = '', generation = 0 WHERE model_id = ?", (model_id,))
            self._trim_finished(keep)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One SQLite transaction under `_lock`: all of it lands or none (a kill leaves the log before or after)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _trim_finished(self, keep: int) -> None:
        """Keep the results of the `keep` latest finished requests (in a transaction, under `_lock`)."""
        self._db.execute(
            "DELETE FROM done WHERE model_id = '' AND rowid NOT IN "
            "(SELECT rowid FROM done WHERE model_id = '' ORDER BY rowid DESC LIMIT ?)",
            (keep,),
        )

    def drop(self, keys: list[str]) -> None:
        """Forget requests that need no replay any more (a session's rows once it has ended, a sampling session
        whose weights were freed); their results are not kept."""
        if not keys:
            return
        with self._lock:
            self._db.executemany("DELETE FROM requests WHERE key = ?", [(k,) for k in keys])

    def set_live(self, model_id: str, live: bool) -> None:
        """Record whether `model_id` holds a slot now (idempotent: a replay writes the same). A model that holds
        none has no row (an unloaded one kept its row for ever)."""
        with self._lock:
            if live:
                self._db.execute(
                    "INSERT INTO models (model_id, live) VALUES (?, 1) ON CONFLICT(model_id) DO UPDATE SET live = 1",
                    (model_id,),
                )
            else:
                self._db.execute("DELETE FROM models WHERE model_id = ?", (model_id,))

    def live_models(self) -> list[str]:
        """Models that held a slot when the server stopped, in the order they were first created."""
        with self._lock:
            return [m for (m,) in self._db.execute("SELECT model_id FROM models WHERE live = 1 ORDER BY rowid")]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _encoded(result: bytes | dict[str, Any]) -> tuple[bytes, int]:
    """A result as the `done` table stores it: (bytes, is_json)."""
    return (result, 0) if isinstance(result, bytes) else (json.dumps(result).encode(), 1)
