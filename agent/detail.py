"""Node-local detail store: high-rate data that stays on the node (Holmes) in a bounded SQLite ring.

Holds raw Python stack samples and the comm-op/kernel streams (CommOp, KernelRec records, kept as
their protobuf Record bytes with the columns a fetch filters on). Each kind is a table with a row
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
CREATE TABLE IF NOT EXISTS records (
  mono_ns INTEGER NOT NULL, kind TEXT NOT NULL, pid INTEGER NOT NULL, rank INTEGER NOT NULL, record BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS records_time ON records (kind, mono_ns);
CREATE TABLE IF NOT EXISTS counters (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


_SHARED: dict[str, list] = {}  # realpath -> [store, users]
_SHARED_LOCK = threading.Lock()


def open_shared(path: str, max_stack_samples: int | None = None, max_records: int | None = None) -> "DetailStore":
    """The agent process's one DetailStore for `path`: every source writes through the same connection, so
    there is one SQLite writer and one bound per kind (the largest any source asked for; a reader such as the
    fetch handler passes no bounds and changes none). Release with `release_shared()`; the last release
    closes it."""
    key = os.path.realpath(path)
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
        if entry is None:
            entry = _SHARED[key] = [DetailStore(path, max_stack_samples or 2_000_000, max_records or 2_000_000), 0,
                                    {"stack": max_stack_samples is not None, "records": max_records is not None}]
        store, _, asked = entry
        if max_stack_samples is not None:
            store.max_stack_samples = max(store.max_stack_samples, max_stack_samples) if asked["stack"] \
                else max_stack_samples
            asked["stack"] = True
        if max_records is not None:
            store.max_records = max(store.max_records, max_records) if asked["records"] else max_records
            asked["records"] = True
        entry[1] += 1
        return store


def release_shared(store: "DetailStore") -> None:
    key = os.path.realpath(store.path)
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
        if entry is None or entry[0] is not store:
            store.close()
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del _SHARED[key]
            store.close()
        else:
            store.flush()


class DetailStore:
    def __init__(self, path: str, max_stack_samples: int = 2_000_000, max_records: int = 2_000_000) -> None:
        if max_stack_samples < 1000 or max_records < 1000:
            raise ValueError("max_stack_samples and max_records must be at least 1000")
        self.max_records = max_records
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
        self._pending_records: list[tuple] = []
        self._rows = self._db.execute("SELECT COUNT(*) FROM stack_samples").fetchone()[0]
        self._record_rows = self._db.execute("SELECT COUNT(*) FROM records").fetchone()[0]
        self.dropped = self._counter("stack_samples_dropped")
        self.records_dropped = self._counter("records_dropped")
        self.records_rejected = 0  # records the codec refused (add_records), this process

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

    def add_records(self, source: str, records: list) -> list[tuple[object, str]]:
        """CommOp / KernelRec records (any Record the codec knows) for the ring; kind is the class name
        in lower case ("commop", "kernelrec"). A record the codec refuses (a value out of its field's range)
        is left out, counted in `records_rejected`, and returned with the reason: the others are kept."""
        from steplens.agent.transport.codec import encode_each
        rejected = []
        for rec, blob in zip(records, encode_each(source, records)):
            if isinstance(blob, Exception):
                rejected.append((rec, f"{type(blob).__name__}: {blob}"))
                continue
            self._pending_records.append((rec.mono_ns, type(rec).__name__.lower(), getattr(rec, "pid", 0),
                                          getattr(rec, "rank", -1), blob))
        self.records_rejected += len(rejected)
        return rejected

    def records(self, kinds: list[str], since_mono_ns: int = 0, until_mono_ns: int = (1 << 63) - 1,
                pids: set | None = None, ranks: set | None = None, limit: int = 100_000) -> list[bytes]:
        """Serialized Record messages of those kinds in the time range, oldest first. With both pids and ranks,
        a record matches either (a source may know a process's rank, or only its pid)."""
        cond = ["kind IN (%s)" % ",".join("?" * len(kinds)), "mono_ns BETWEEN ? AND ?"]
        args: list = [*kinds, since_mono_ns, until_mono_ns]
        who = []
        for col, vals in (("pid", pids), ("rank", ranks)):
            if vals is not None:
                who.append(f"{col} IN (%s)" % ",".join("?" * len(vals)) if vals else "0")
                args += sorted(vals)
        if who:
            cond.append("(" + " OR ".join(who) + ")")
        q = f"SELECT record FROM records WHERE {' AND '.join(cond)} ORDER BY mono_ns LIMIT ?"
        with self._lock:
            return [blob for (blob,) in self._db.execute(q, (*args, limit))]

    def flush(self) -> int:
        """Write what is pending in one transaction, then enforce the bounds. Returns rows written."""
        pending, self._pending = self._pending, []
        precs, self._pending_records = self._pending_records, []
        if not pending and not precs:
            return 0
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if precs:
                    self._db.executemany("INSERT INTO records VALUES (?,?,?,?,?)", precs)
                    self._record_rows += len(precs)
                    over = self._record_rows - self.max_records
                    if over > 0:
                        chunk = over + self.max_records // 20
                        self._db.execute("DELETE FROM records WHERE rowid IN (SELECT rowid FROM records "
                                         "ORDER BY rowid LIMIT ?)", (chunk,))
                        self._record_rows -= chunk
                        self.records_dropped += chunk
                        self._db.execute("INSERT INTO counters(key, value) VALUES ('records_dropped', ?) "
                                         "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                                         (self.records_dropped,))
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
        return len(pending) + len(precs)

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
