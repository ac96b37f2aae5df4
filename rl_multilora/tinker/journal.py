"""The durable request log: every request the server acknowledges is committed here first.

One SQLite file (WAL, synchronous=FULL): a row per acknowledged request, keyed by its deterministic request id, with
its kind and body. A restarted server replays the rows in the order they were acknowledged through the same
scheduler (requests of one model still run in seq_id order), so models, optimizer states, sampler versions and the
results clients still poll for are rebuilt and no acknowledged request is lost. Replay recomputes; it does not read
results back, so a replayed mixed batch may group rows differently than the first run (same math, float rounding).

A second table records which models hold a slot (written when a create or load makes one and when an unload frees
it): a restarted service holds slots for those models before it admits GRPO tenants, so the replay finds them.
A create that was refused (no free slot) is in the log but not here, so it gets no slot it never had.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path


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
        self._db.execute("CREATE TABLE IF NOT EXISTS models (model_id TEXT PRIMARY KEY, live INTEGER NOT NULL)")
        self._lock = threading.Lock()

    def append(self, key: str, kind: str, body: bytes) -> bool:
        """Commit the request; False when `key` is already logged (a retry)."""
        with self._lock:
            cur = self._db.execute(
                "INSERT OR IGNORE INTO requests (key, kind, body) VALUES (?, ?, ?)", (key, kind, body)
            )
            return cur.rowcount == 1

    def replay(self) -> list[tuple[str, str, bytes]]:
        with self._lock:
            return list(self._db.execute("SELECT key, kind, body FROM requests ORDER BY n"))

    def set_live(self, model_id: str, live: bool) -> None:
        """Record whether `model_id` holds a slot now (idempotent: a replay writes the same)."""
        with self._lock:
            self._db.execute(
                "INSERT INTO models (model_id, live) VALUES (?, ?) ON CONFLICT(model_id) DO UPDATE SET live = ?",
                (model_id, int(live), int(live)),
            )

    def live_models(self) -> list[str]:
        """Models that held a slot when the server stopped, in the order they were first created."""
        with self._lock:
            return [m for (m,) in self._db.execute("SELECT model_id FROM models WHERE live = 1 ORDER BY rowid")]

    def close(self) -> None:
        with self._lock:
            self._db.close()
