"""The durable request log: every request the server acknowledges is committed here first.

One SQLite file (WAL, synchronous=FULL): a row per acknowledged request, keyed by its deterministic request id, with
its kind and body. A restarted server replays the rows in the order they were acknowledged through the same
scheduler (requests of one model still run in seq_id order), so models, optimizer states, sampler versions and the
results clients still poll for are rebuilt and no acknowledged request is lost. Replay recomputes; it does not read
results back, so a replayed mixed batch may group rows differently than the first run (same math, float rounding).
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

    def close(self) -> None:
        with self._lock:
            self._db.close()
