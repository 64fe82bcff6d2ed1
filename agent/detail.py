"""Node-local detail store: high-rate data that stays on the node (Holmes) in a bounded SQLite ring.

Holds raw Python stack samples and the comm-op/kernel streams (CommOp, KernelRec records). Each kind has a
bound in records (stack samples, comm-op/kernel records); writes are batched (one transaction per flush) and,
past the bound, the oldest rows are deleted in chunks and counted, never silently. The collector reads it only on
demand (FetchDetail). Stacks are interned: a sample row is (mono_ns, pid, tid, stack_id, gil, state).

Records are kept unencoded, a row per (source, kind, process, rank) of each flush: their field values as tuples
(marshal) compressed with zlib level 1, with the row's time span, count and the columns a fetch filters on
(record_batches; at most BATCH_RECORDS a row, and the bound deletes whole rows). Each record is checked at
add_records against its protobuf field types (codec.record_problem), so one the encoder would refuse is refused
then, as before. A fetch (`records`) rebuilds and encodes only what it returns. Why: every op of a job goes
through here all the time, a fetch reads only what a diagnosis asks about. bench/flightrec_ops.py: 12.5 -> 7.6 µs
per op for the CommLog (the store, summaries, segmenter), a fetch 0.6 -> 8.5 µs per op returned, ~27 bytes of
disk per op instead of ~210 plus a row (bench/README.md, "Twentieth session"). The field names are stored with
each row, so a row written by an agent whose record had other fields is still read (by name; a field this
version lacks is left out). Rows of the per-record layout (`records`, an older agent's) are still read, counted
in the bound and dropped first.
"""

from __future__ import annotations

import json
import marshal
import operator
import os
import sqlite3
import threading
import zlib

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
CREATE TABLE IF NOT EXISTS record_batches (
  mono_lo INTEGER NOT NULL, mono_hi INTEGER NOT NULL, source TEXT NOT NULL, kind TEXT NOT NULL,
  pid INTEGER NOT NULL, rank INTEGER NOT NULL, n INTEGER NOT NULL, blob BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS record_batches_time ON record_batches (kind, mono_lo);
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


BATCH_RECORDS = 4096   # records per record_batches row at most (what the bound deletes at once, beyond its chunk)
_FORMAT = 1   # a record_batches blob: zlib(marshal((_FORMAT, field names, [field tuple, ...])))
_GETTERS: dict[type, operator.attrgetter] = {}


def _record_types() -> dict[str, type]:
    from steplens.agent import records as r
    return {t.__name__.lower(): t for t in (r.CommOp, r.KernelRec)}


_RECORD_TYPES = _record_types()


def _getter(t: type) -> operator.attrgetter:
    g = _GETTERS.get(t)
    if g is None:
        g = _GETTERS[t] = operator.attrgetter(*t.__slots__)
    return g


def _first(x: tuple) -> int:
    return x[0]


def _unpack(kind: str, blob: bytes) -> list:
    """A record_batches blob -> its records. A blob of another format is skipped (an empty list); one written
    with other fields is rebuilt by name. The blob is the agent's own (its state directory), and zlib's checksum
    refuses a damaged one before marshal reads it."""
    t = _RECORD_TYPES[kind]
    try:
        fmt, names, tuples = marshal.loads(zlib.decompress(blob))
    except (zlib.error, ValueError, EOFError, TypeError):
        return []
    if fmt != _FORMAT:
        return []
    names = tuple(names)
    try:
        if names == t.__slots__:
            return [t(*v) for v in tuples]
        known = [(i, n) for i, n in enumerate(names) if n in t.__slots__]
        return [t(**{n: v[i] for i, n in known}) for v in tuples]
    except TypeError:   # a field this version requires is not there
        return []


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
        self._pending_lock = threading.Lock()
        self._stack_ids: dict[tuple, int] = {}
        self._pending: list[tuple] = []
        self._pending_records: dict[tuple, list] = {}   # (source, kind, pid, rank) -> field tuples
        self._rows = self._db.execute("SELECT COUNT(*) FROM stack_samples").fetchone()[0]
        self._legacy_rows = self._db.execute("SELECT COUNT(*) FROM records").fetchone()[0]
        self._record_rows = self._legacy_rows + \
            self._db.execute("SELECT COALESCE(SUM(n), 0) FROM record_batches").fetchone()[0]
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
        self.add_stack_id_sample(mono_ns, pid, tid, self.stack_id(frames), gil, state)

    def add_stack_id_sample(self, mono_ns: int, pid: int, tid: int, stack_id: int, gil: bool, state: str) -> None:
        """add_stack_sample of a stack whose stack_id() the caller holds (ids are never reused or dropped)."""
        self._pending.append((mono_ns, pid, tid, stack_id, int(gil), state))

    def add_records(self, source: str, records: list, checked: bool = False) -> list[tuple[object, str]]:
        """CommOp / KernelRec records (any plain Record the codec knows) for the ring; kind is the class name
        in lower case ("commop", "kernelrec"). A record the codec would refuse (a value out of its field's range,
        a field of the wrong type) is left out, counted in `records_rejected`, and returned with the reason: the
        others are kept. checked: the caller made every record within those ranges (flightrec.OpConverter), so
        none is checked again here (~1 us a CommOp)."""
        from steplens.agent.transport.codec import record_problem
        rejected = []
        pending: dict[tuple, list] = {}
        last = kind = fields = None
        for rec in records:
            why = None if checked else record_problem(rec)
            if why is not None:
                rejected.append((rec, why))
                continue
            t = type(rec)
            if t is not last:
                last, kind, fields = t, t.__name__.lower(), _getter(t)
            key = (source, kind, getattr(rec, "pid", 0), getattr(rec, "rank", -1))
            rows = pending.get(key)
            if rows is None:
                rows = pending[key] = []
            rows.append(fields(rec))
        with self._pending_lock:   # sources add from threads of their own; flush swaps the dict under this lock
            for key, rows in pending.items():
                self._pending_records.setdefault(key, []).extend(rows)
            self.records_rejected += len(rejected)
        return rejected

    def records(self, kinds: list[str], since_mono_ns: int = 0, until_mono_ns: int = (1 << 63) - 1,
                pids: set | None = None, ranks: set | None = None, limit: int = 100_000) -> list[bytes]:
        """Serialized Record messages of those kinds in the time range, oldest first (by mono_ns), at most
        `limit`. With both pids and ranks, a record matches either (a source may know a process's rank, or only
        its pid)."""
        from steplens.agent.transport.codec import encode_each
        kinds = [k for k in kinds if k in _RECORD_TYPES]
        if not kinds or limit <= 0:
            return []
        cond = ["kind IN (%s)" % ",".join("?" * len(kinds))]
        args: list = list(kinds)
        who = []
        for col, vals in (("pid", pids), ("rank", ranks)):
            if vals is not None:
                who.append(f"{col} IN (%s)" % ",".join("?" * len(vals)) if vals else "0")
                args += sorted(vals)
        if who:
            cond.append("(" + " OR ".join(who) + ")")
        where = " AND ".join(cond)
        found: list[tuple[int, bytes | tuple]] = []   # (mono_ns, encoded Record | (source, record))
        with self._lock:
            if self._legacy_rows:
                found += self._db.execute(f"SELECT mono_ns, record FROM records WHERE {where} AND mono_ns BETWEEN "
                                          "? AND ? ORDER BY mono_ns LIMIT ?",
                                          (*args, since_mono_ns, until_mono_ns, limit)).fetchall()
            batches = self._db.execute(f"SELECT mono_lo, source, kind, blob FROM record_batches WHERE {where} AND "
                                       "mono_lo <= ? AND mono_hi >= ? ORDER BY mono_lo",
                                       (*args, until_mono_ns, since_mono_ns))
            for lo, source, kind, blob in batches:
                if len(found) >= limit:   # every later row starts after the limit-th record so far: done
                    found.sort(key=_first)
                    del found[limit:]
                    if lo > found[-1][0]:
                        break
                found += [(rec.mono_ns, (source, rec)) for rec in _unpack(kind, blob)
                          if since_mono_ns <= rec.mono_ns <= until_mono_ns]
        found.sort(key=_first)
        del found[limit:]
        out: list = [x for _, x in found]
        by_source: dict[str, list[int]] = {}
        for i, x in enumerate(out):
            if type(x) is tuple:
                by_source.setdefault(x[0], []).append(i)
        for source, at in by_source.items():
            for i, blob in zip(at, encode_each(source, [out[i][1] for i in at])):
                out[i] = blob
        # an encoding error left out: a record rebuilt by name from an older agent's row, with a value this
        # version refuses (records checked at add_records encode)
        return [x for x in out if type(x) is bytes]

    def flush(self) -> int:
        """Write what is pending in one transaction, then enforce the bounds. Returns rows written."""
        pending, self._pending = self._pending, []
        with self._pending_lock:
            precs, self._pending_records = self._pending_records, {}
        if not pending and not precs:
            return 0
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if precs:
                    self._store_records(precs)
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
        return len(pending) + sum(len(v) for v in precs.values())

    def _store_records(self, pending: dict[tuple, list]) -> None:
        """Inside flush's transaction: a row per (source, kind, pid, rank), then the bound."""
        rows = []
        for (source, kind, pid, rank), every in pending.items():
            for at in range(0, len(every), BATCH_RECORDS):
                tuples = every[at:at + BATCH_RECORDS]
                times = [t[0] for t in tuples]   # mono_ns is every record's first field
                blob = zlib.compress(marshal.dumps((_FORMAT, _RECORD_TYPES[kind].__slots__, tuples)), 1)
                rows.append((min(times), max(times), source, kind, pid, rank, len(tuples), blob))
            self._record_rows += len(every)
        self._db.executemany("INSERT INTO record_batches VALUES (?,?,?,?,?,?,?,?)", rows)
        over = self._record_rows - self.max_records
        if over <= 0:
            return
        want = over + self.max_records // 20   # delete in chunks, oldest first: an older agent's rows, then rows
        gone = 0
        if self._legacy_rows:
            n = min(want, self._legacy_rows)
            self._db.execute("DELETE FROM records WHERE rowid IN (SELECT rowid FROM records ORDER BY rowid "
                             "LIMIT ?)", (n,))
            self._legacy_rows -= n
            gone += n
        if gone < want:
            last = None
            for rowid, n in self._db.execute("SELECT rowid, n FROM record_batches ORDER BY rowid"):
                last, gone = rowid, gone + n
                if gone >= want:
                    break
            if last is not None:
                self._db.execute("DELETE FROM record_batches WHERE rowid <= ?", (last,))
        self._record_rows -= gone
        self.records_dropped += gone
        self._db.execute("INSERT INTO counters(key, value) VALUES ('records_dropped', ?) "
                         "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (self.records_dropped,))

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
