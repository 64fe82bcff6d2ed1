"""The agent's durable outbox: sequence-numbered batches in a node-local SQLite file (WAL).

Batches are appended with the next seq, sent in order by the transport, and deleted when the
collector acknowledges a durable commit. The spool is bounded in bytes: when full, the oldest
batches not in flight are dropped, counted, and a Gap record saying how many is queued, so a loss
always reaches the store. Gap batches are never dropped: an unsent one absorbs later losses in
place, so there is at most one waiting, seqs stay contiguous and the reported totals stay exact. Counters live in the same file and change in the same transaction as
the batches, so produced = acked + dropped + backlog holds across crashes.

Cost: one small transaction per append/ack (~100 µs with synchronous=NORMAL under WAL).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import uuid
from dataclasses import dataclass
from typing import Callable

_SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
  seq INTEGER PRIMARY KEY,
  n_records INTEGER NOT NULL,
  n_bytes INTEGER NOT NULL,
  created_mono_ns INTEGER NOT NULL,
  payload BLOB NOT NULL,
  -- for a batch that carries a Gap record: the loss it reports (merged into the next gap if unsent)
  gap_records INTEGER NOT NULL DEFAULT 0,
  gap_batches INTEGER NOT NULL DEFAULT 0,
  gap_first INTEGER NOT NULL DEFAULT 0,
  gap_last INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value);
"""

_COUNTERS = ("next_seq", "records_produced", "records_acked", "records_dropped", "batches_dropped",
             "pending_gap_records", "pending_gap_batches", "pending_gap_first", "pending_gap_last")


class SpoolError(RuntimeError):
    pass


@dataclass
class SpoolStats:
    spool_id: str
    backlog_batches: int
    backlog_records: int
    backlog_bytes: int
    records_produced: int
    records_acked: int
    records_dropped: int
    batches_dropped: int
    last_acked_seq: int


class Spool:
    """Thread-safe; one connection guarded by a lock (appends and acks are short)."""

    def __init__(self, path: str, max_bytes: int = 256 * 1024 * 1024,
                 gap_encoder: Callable[[int, int, int, int], tuple[bytes, int]] | None = None) -> None:
        if max_bytes < 64 * 1024:
            raise SpoolError(f"spool max_bytes must be at least 64 KiB, got {max_bytes}")
        self.path = path
        self.max_bytes = max_bytes
        # (dropped_records, dropped_batches, first_seq, last_seq) -> (payload, n_records)
        self._gap_encoder = gap_encoder
        self._lock = threading.Lock()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise SpoolError(f"cannot open spool {path!r}: {exc}") from None
        with self._tx():
            if self._meta("spool_id") is None:
                self._set("spool_id", uuid.uuid4().hex)
                for key in _COUNTERS:
                    self._set(key, 1 if key == "next_seq" else 0)
                self._set("last_acked_seq", 0)
        self.spool_id: str = self._meta("spool_id")
        self._backlog_bytes = self._db.execute("SELECT COALESCE(SUM(n_bytes),0) FROM batches").fetchone()[0]
        self._listeners: list = []  # called after each append (the transport's sender wakes up)
        self._in_flight_floor = 0  # seqs >= this may be in flight; never dropped (0: none in flight)
        self._last_handed = 0

    # -- helpers --------------------------------------------------------------------------
    def _tx(self):
        db = self._db

        class _Tx:
            def __enter__(self_inner):
                db.execute("BEGIN IMMEDIATE")

            def __exit__(self_inner, et, ev, tb):
                db.execute("COMMIT" if et is None else "ROLLBACK")
                return False
        return _Tx()

    def _meta(self, key: str):
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def _set(self, key: str, value) -> None:
        self._db.execute("INSERT INTO meta(key,value) VALUES(?,?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                         (key, value))

    def _add(self, key: str, delta: int) -> None:
        self._db.execute("UPDATE meta SET value = value + ? WHERE key=?", (delta, key))

    # -- API ------------------------------------------------------------------------------
    def append(self, payload: bytes, n_records: int, mono_ns: int) -> int:
        """Store one encoded batch; returns its seq. Drops oldest batches first if over the bound."""
        with self._lock:
            try:
                with self._tx():
                    self._make_room(len(payload))
                    seq = self._insert(payload, n_records, mono_ns)
                    self._flush_gap(mono_ns)
            except sqlite3.Error as exc:
                raise SpoolError(f"spool append failed: {exc}") from None
        for listener in self._listeners:
            listener()
        return seq

    def add_listener(self, fn) -> None:
        self._listeners.append(fn)

    def _insert(self, payload: bytes, n_records: int, mono_ns: int, gap: tuple = (0, 0, 0, 0)) -> int:
        seq = self._meta("next_seq")
        self._db.execute("INSERT INTO batches(seq,n_records,n_bytes,created_mono_ns,payload,gap_records,gap_batches,"
                         "gap_first,gap_last) VALUES(?,?,?,?,?,?,?,?,?)",
                         (seq, n_records, len(payload), mono_ns, payload, *gap))
        self._set("next_seq", seq + 1)
        self._add("records_produced", n_records)
        self._backlog_bytes += len(payload)
        return seq

    def _make_room(self, incoming: int) -> None:
        while self._backlog_bytes + incoming > self.max_bytes:
            row = self._db.execute(
                "SELECT seq, n_records, n_bytes FROM batches WHERE seq < ? AND gap_batches = 0 ORDER BY seq LIMIT 1",
                (self._in_flight_floor or (1 << 62),)).fetchone()
            if row is None:
                return  # only in-flight batches left; let the spool exceed its bound briefly
            seq, n, nbytes = row
            self._db.execute("DELETE FROM batches WHERE seq=?", (seq,))
            self._backlog_bytes -= nbytes
            self._add("records_dropped", n)
            self._add("batches_dropped", 1)
            self._add("pending_gap_records", n)
            self._add("pending_gap_batches", 1)
            if not self._meta("pending_gap_first"):
                self._set("pending_gap_first", seq)
            self._set("pending_gap_last", seq)

    def _flush_gap(self, mono_ns: int) -> None:
        dropped = self._meta("pending_gap_records")
        batches = self._meta("pending_gap_batches")
        if not batches or self._gap_encoder is None:
            return
        first, last = self._meta("pending_gap_first"), self._meta("pending_gap_last")
        for key in ("pending_gap_records", "pending_gap_batches", "pending_gap_first", "pending_gap_last"):
            self._set(key, 0)
        # an unsent gap batch absorbs the new loss in place (same seq: no hole, no second gap record)
        row = self._db.execute("SELECT seq, n_bytes, gap_records, gap_batches, gap_first, gap_last FROM batches"
                               " WHERE gap_batches > 0 AND seq < ? ORDER BY seq DESC LIMIT 1",
                               (self._in_flight_floor or (1 << 62),)).fetchone()
        if row is not None:
            seq, nbytes, g_rec, g_bat, g_first, g_last = row
            gap = (dropped + g_rec, batches + g_bat, min(first, g_first), max(last, g_last))
            payload, _ = self._gap_encoder(*gap)
            self._db.execute("UPDATE batches SET payload=?, n_bytes=?, gap_records=?, gap_batches=?, gap_first=?,"
                             " gap_last=? WHERE seq=?", (payload, len(payload), *gap, seq))
            self._backlog_bytes += len(payload) - nbytes
            return
        payload, n = self._gap_encoder(dropped, batches, first, last)
        self._insert(payload, n, mono_ns, (dropped, batches, first, last))

    def count_lost(self, n_records: int) -> None:
        """Records lost before reaching the spool (agent queue overflow): produced and dropped."""
        with self._lock, self._tx():
            self._add("records_produced", n_records)
            self._add("records_dropped", n_records)

    def reset_in_flight(self) -> None:
        """The stream broke: nothing is in flight any more (unacked batches will be sent again)."""
        with self._lock:
            self._in_flight_floor = 0
            self._last_handed = 0

    def take_for_send(self, after_seq: int, limit: int = 16) -> list[tuple[int, int, bytes]]:
        """Batches with seq > after_seq, oldest first: (seq, n_records, payload). They count as in flight
        from this moment (under the same lock), so overflow never drops or rewrites a batch being sent."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, n_records, payload FROM batches WHERE seq > ? ORDER BY seq LIMIT ?",
                (after_seq, limit)).fetchall()
            if rows:
                if not self._in_flight_floor:
                    self._in_flight_floor = rows[0][0]
                self._last_handed = max(self._last_handed, rows[-1][0])
            return rows

    def ack(self, seq: int) -> int:
        """Delete every batch up to seq (the collector committed them). Returns records acked."""
        with self._lock:
            with self._tx():
                row = self._db.execute("SELECT COALESCE(SUM(n_records),0), COALESCE(SUM(n_bytes),0) "
                                       "FROM batches WHERE seq <= ?", (seq,)).fetchone()
                n, nbytes = row
                self._db.execute("DELETE FROM batches WHERE seq <= ?", (seq,))
                if self._in_flight_floor:
                    self._in_flight_floor = seq + 1 if self._last_handed > seq else 0
                self._add("records_acked", n)
                if seq > (self._meta("last_acked_seq") or 0):
                    self._set("last_acked_seq", seq)
                self._backlog_bytes -= nbytes
            return n

    def stats(self) -> SpoolStats:
        with self._lock:
            b, rec, nbytes = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(n_records),0), COALESCE(SUM(n_bytes),0) FROM batches").fetchone()
            m = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        return SpoolStats(self.spool_id, b, rec, nbytes, m["records_produced"], m["records_acked"],
                          m["records_dropped"], m["batches_dropped"], m["last_acked_seq"])

    def close(self) -> None:
        with self._lock:
            try:
                self._db.close()
            except sqlite3.Error:
                pass
