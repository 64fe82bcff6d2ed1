"""Node-local detail store: high-rate data that stays on the node (Holmes) in a bounded SQLite ring.

Holds raw Python stack samples now (comm ops and kernels later). Each kind is a table with a row
bound; writes are batched (one transaction per flush) and, past the bound, the oldest rows are
deleted in chunks and counted, never silently. The collector reads it only on demand
(FetchDetail). Stacks are interned: a sample row is (mono_ns, pid, tid, stack_id, gil, state).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading

_SCHEMA = """
CREATE TABLE IF NOT EXISTS stacks (id INTEGER PRIMARY KEY, key TEXT NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS stack_samples (
  mono_ns INTEGER NOT NULL, pid INTEGER NOT NULL, tid INTEGER NOT NULL, stack_id INTEGER NOT NULL,
  gil INTEGER NOT NULL, state TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS stack_samples_time ON stack_samples (mono_ns);
CREATE TABLE IF NOT EXISTS counters (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


class DetailStore:
    def __init__(self, path: str, max_stack_samples: int = 2_000_000) -> None:
        if max_stack_samples < 1000:
            raise ValueError("max_stack_samples must be at least 1000")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self.max_stack_samples = max_stack_samples
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()
        self._stack_ids: dict[tuple, int] = {}
        self._pending: list[tuple] = []
        self._rows = self._db.execute("SELECT COUNT(*) FROM stack_samples").fetchone()[0]
        self.dropped = self._counter("stack_samples_dropped")

    def _counter(self, key: str) -> int:
        row = self._db.execute("SELECT value FROM counters WHERE key=?", (key,)).fetchone()
        return row[0] if row else 0

    def stack_id(self, frames: tuple) -> int:
        """frames: tuple of (function, qualname, file, line), innermost first."""
        sid = self._stack_ids.get(frames)
        if sid is None:
            key = json.dumps(frames, ensure_ascii=False, separators=(",", ":"))
            with self._lock:
                self._db.execute("INSERT OR IGNORE INTO stacks(key) VALUES (?)", (key,))
                sid = self._db.execute("SELECT id FROM stacks WHERE key=?", (key,)).fetchone()[0]
            if len(self._stack_ids) > 100_000:
                self._stack_ids.clear()
            self._stack_ids[frames] = sid
        return sid

    def add_stack_sample(self, mono_ns: int, pid: int, tid: int, frames: tuple, gil: bool, state: str) -> None:
        self._pending.append((mono_ns, pid, tid, self.stack_id(frames), int(gil), state))

    def flush(self) -> int:
        """Write what is pending in one transaction, then enforce the bound. Returns rows written."""
        pending, self._pending = self._pending, []
        if not pending:
            return 0
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany("INSERT INTO stack_samples VALUES (?,?,?,?,?,?)", pending)
                self._rows += len(pending)
                over = self._rows - self.max_stack_samples
                if over > 0:
                    chunk = over + self.max_stack_samples // 20  # delete in chunks, not row by row
                    self._db.execute("DELETE FROM stack_samples WHERE rowid IN (SELECT rowid FROM stack_samples "
                                     "ORDER BY rowid LIMIT ?)", (chunk,))
                    self._rows -= chunk
                    self.dropped += chunk
                    self._db.execute("INSERT INTO counters(key, value) VALUES ('stack_samples_dropped', ?) "
                                     "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (self.dropped,))
                self._db.execute("COMMIT")
            except sqlite3.Error:
                self._db.execute("ROLLBACK")
                raise
        return len(pending)

    def stack_samples(self, since_mono_ns: int = 0, until_mono_ns: int = (1 << 63) - 1, pid: int = 0,
                      limit: int = 100_000) -> list[dict]:
        with self._lock:
            rows = self._db.execute(
                "SELECT s.mono_ns, s.pid, s.tid, k.key, s.gil, s.state FROM stack_samples s JOIN stacks k"
                " ON k.id = s.stack_id WHERE s.mono_ns BETWEEN ? AND ? AND (? = 0 OR s.pid = ?)"
                " ORDER BY s.mono_ns LIMIT ?", (since_mono_ns, until_mono_ns, pid, pid, limit)).fetchall()
        return [{"mono_ns": m, "pid": p, "tid": t, "frames": [tuple(f) for f in json.loads(k)], "gil": bool(g),
                 "state": st} for m, p, t, k, g, st in rows]

    def close(self) -> None:
        try:
            self.flush()
        finally:
            with self._lock:
                self._db.close()
