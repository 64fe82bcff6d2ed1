"""The ClickHouse store: every append-only telemetry table in ClickHouse, the collector's own small state in SQLite.

Chosen with `--store clickhouse://[USER[:PASSWORD]@]HOST[:PORT]/DB` (a server, HTTP interface, via
clickhouse-connect) or `--store chdb:///DIR?database=DB` (chDB: the ClickHouse engine inside the collector's
process, one DIR per process). SQLite (`--db`) stays the default and, with ClickHouse, keeps the state the
collector updates in place: agents, processes, GPUs, series (each one's newest value), communicator members,
findings, topologies, deep dives. What grows with the cluster goes to ClickHouse: metrics, events, gaps,
rejections, stack summaries, flows, connections, comm summaries and progress, steps, iterations, and the
delivery records (batches).

Tables: MergeTree, partitioned by day of their cluster time, ordered for the detectors' range scans (a job's
rows by end time; one node's series by time), TTL = the collector's retention. Every row carries delivery
columns: `_spool`, `_seq` (the batch it came from; '' and 0 for an import) and `_rid`, the write group's id.

Exactly once without transactions: a write group inserts its rows into each table, then commits the state
(SQLite), then inserts one row into `commits` (its writer and _rid). Every row also carries `_writer`, the id of
the collector that wrote it (its collector id; '' for a store with one writer), and each writer's group ids rise:
a row is committed when its _rid is at most its own writer's newest commit. Rows above it belong to a group that
did not finish: the writer deletes its own before it writes again (after a failure, and at start after a crash),
so a batch is either stored with its `batches` record or not at all, its agent is acked only after the commit
row landed, and a resent batch is recognized by its (agent, spool, seq) in `batches`, committed rows only.
Several collectors on one database: each recovers only its own rows (another's group in flight is not touched),
and the unfinished rows of a collector silent for `peer_dead_seconds` are deleted by the survivors. A writer
whose group took longer than `commit_fence_seconds` between its first insert and its commit gives the group up
instead (the agents resend), so a collector paused past the point where a survivor cleaned its rows does not
commit what was cleaned (as with any lease, this holds while the machines' clocks do).
A ClickHouse insert makes a part per table, merged later: the writer gathers a group for up to
`min_group_seconds` (0.2 s, up to 512 batches) where SQLite takes what is queued (the 10,000-GPU stream of
bench/sim_speed.py: 10k -> 26k records/s stored on chDB).
Readers of incremental data (new_data_since, steps_after) read per writer, up to that writer's newest commit: a
mark is each writer's last group read, so a group that commits after a later group of another writer is still
read.
Durability: an insert returns once ClickHouse wrote its part (the OS holds it: a collector crash loses nothing;
the server's fsync settings decide about a power loss, as SQLite's synchronous=NORMAL does here).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

from steplens.collector.store import replication
from steplens.collector.store import writer as w
from steplens.collector.store.diagnosis import (
    DATA_TABLES,
    JOB_COMMS_WINDOW_NS,
    PROCESS_STATE_EVENTS,
    process_event_rows,
)
from steplens.collector.store.queries import _PROGRESS_KEYS, Reader, _progress_row, stack_row
from steplens.collector.store.schema import StoreError

log = logging.getLogger("steplens.collector.clickhouse")

DELIVERY = ("_spool", "_seq", "_rid", "_writer")

# table -> (columns with ClickHouse types, the time column that partitions it and expires it, ORDER BY)
_S, _I, _F, _LC = "String", "Int64", "Float64", "LowCardinality(String)"
TABLES: dict[str, tuple[tuple[tuple[str, str], ...], str, str]] = {
    "metrics": ((("agent_id", _LC), ("name", _LC), ("entity", _LC), ("ts_ns", "Int64 CODEC(Delta, ZSTD)"),
                 ("value", "Float64 CODEC(Gorilla, ZSTD)")), "ts_ns", "agent_id, name, entity, ts_ns"),
    "events": ((("agent_id", _LC), ("ts_ns", _I), ("source", _LC), ("kind", _LC), ("entity", _S), ("message", _S),
                ("value", _F)), "ts_ns", "agent_id, kind, ts_ns"),
    "gaps": ((("agent_id", _LC), ("spool_id", _S), ("ts_ns", _I), ("source", _LC), ("dropped_records", _I),
              ("dropped_batches", _I), ("first_seq", _I), ("last_seq", _I), ("reason", _S)), "ts_ns",
             "agent_id, ts_ns"),
    "rejections": ((("agent_id", _LC), ("ts_ns", _I), ("spool_id", _S), ("seq", _I), ("reason", _S), ("count", _I)),
                   "ts_ns", "agent_id, ts_ns"),
    "stack_summaries": ((("agent_id", _LC), ("start_ns", _I), ("end_ns", _I), ("pid", _I), ("start_ticks", _I),
                         ("tid", _I), ("thread_name", _S), ("python", _LC), ("samples", _I), ("errors", _I),
                         ("last_state", _LC), ("stacks_json", "String CODEC(ZSTD(3))")), "end_ns",
                        "agent_id, pid, start_ticks, end_ns"),
    "flows": ((("agent_id", _LC), ("start_ns", _I), ("end_ns", _I), ("src", _S), ("sport", _I), ("dst", _S),
               ("dport", _I), ("bytes", _I), ("packets", _I), ("pid", _I), ("origin", _LC), ("switches", _S)),
              "end_ns", "start_ns, src, dst"),
    "conn_stats": ((("agent_id", _LC), ("start_ns", _I), ("end_ns", _I), ("src", _S), ("sport", _I), ("dst", _S),
                    ("dport", _I), ("tx_bytes", _I), ("rx_bytes", _I), ("tx_packets", _I), ("rx_packets", _I),
                    ("tx_payload_bytes", _I), ("rx_payload_bytes", _I), ("retransmits", _I), ("srtt_us", _I),
                    ("pid", _I), ("comm", _S), ("source", _LC), ("net_limited_us", _I)), "end_ns",
                   "agent_id, end_ns"),
    "comm_summaries": ((("agent_id", _LC), ("start_ns", _I), ("end_ns", _I), ("pid", _I), ("start_ticks", _I),
                        ("job_key", _LC), ("rank", _I), ("comm_id", _LC), ("op", _LC), ("step", _I), ("calls", _I),
                        ("bytes", _I), ("busy_ns", _I), ("max_ns", _I), ("seq_first", _I), ("seq_last", _I),
                        ("timing", _LC), ("source", _LC), ("issue_latency_ns_sum", _I), ("kernels", _I)), "end_ns",
                       "job_key, end_ns"),
    "comm_progress": ((("agent_id", _LC), ("end_ns", _I), ("pid", _I), ("start_ticks", _I), ("job_key", _LC),
                       ("rank", _I), ("comm_id", _LC), ("last_enqueued", _I), ("last_started", _I),
                       ("last_completed", _I), ("pending_op", _LC), ("pending_seq", _I), ("pending_p2p", _I),
                       ("pending_peer", _I), ("pending_since_ns", _I), ("nranks", _I)), "end_ns", "job_key, end_ns"),
    "steps": ((("agent_id", _LC), ("source", _LC), ("pid", _I), ("start_ticks", _I), ("job_key", _LC), ("rank", _I),
               ("step", _I), ("start_ns", _I), ("end_ns", _I), ("evidence", _LC), ("period_ops", _I), ("ops", _I),
               ("comms_json", "String CODEC(ZSTD(3))")), "end_ns", "job_key, end_ns"),
    "iterations": ((("agent_id", _LC), ("pid", _I), ("start_ticks", _I), ("job_key", _LC), ("rank", _I),
                    ("seq", _I), ("start_ns", _I), ("end_ns", _I), ("anchor", _LC), ("phase", _LC),
                    ("batch_size", _I), ("prefill_requests", _I), ("prefill_tokens", _I), ("decode_requests", _I),
                    ("kv_tokens", _I), ("input_tokens", _I), ("output_tokens", _I), ("tokens", _I),
                    ("micro_batches", _I)), "end_ns", "job_key, end_ns"),
    # the collectors sharing this store (analysis/ownership.py): a heartbeat row each, the newest one counts
    "collectors": ((("collector_id", _LC), ("address", _S), ("started_ns", _I), ("heartbeat_ns", _I)),
                   "heartbeat_ns", "collector_id, heartbeat_ns"),
    # the collectors' shared state (store/replication.py): each replicated SQLite row as it changed
    "state_log": replication.STATE_LOG,
    "batches": ((("agent_id", _LC), ("spool_id", _S), ("seq", _I), ("n_records", _I), ("n_rejected", _I),
                 ("n_bytes", _I), ("received_ns", _I), ("clock_offset_ns", _I), ("clock_uncertainty_ns", _I)),
                "received_ns", "agent_id, spool_id, seq"),
}
# the group's commit record goes in last
COMMITS_DDL = ("CREATE TABLE IF NOT EXISTS {db}.commits (_rid UInt64, ts_ns Int64,"
               " writer LowCardinality(String) DEFAULT '') ENGINE = MergeTree ORDER BY (writer, _rid)")
SCHEMA_VERSION = 1


def _ddl(db: str, table: str, retention_s: float) -> str:
    cols, tcol, order = TABLES[table]
    body = ", ".join(f"{n} {t}" for n, t in cols) + ", _spool String, _seq Int64, _rid UInt64, _writer LowCardinality(String) DEFAULT ''"
    ttl = f" TTL toDateTime(intDiv({tcol}, 1000000000)) + INTERVAL {max(1, int(retention_s))} SECOND" \
        if retention_s > 0 else ""
    return (f"CREATE TABLE IF NOT EXISTS {db}.{table} ({body}) ENGINE = MergeTree"
            f" PARTITION BY toYYYYMMDD(toDateTime(intDiv({tcol}, 1000000000))) ORDER BY ({order}){ttl}")


@dataclass(frozen=True)
class StoreURL:
    kind: str             # sqlite | clickhouse | chdb
    path: str = ""        # sqlite file, chdb directory
    host: str = ""
    port: int = 0
    database: str = "steplens"
    user: str = "default"
    password: str = ""
    secure: bool = False

    def describe(self) -> str:
        if self.kind == "clickhouse":
            return f"clickhouse {self.host}:{self.port}/{self.database}"
        if self.kind == "chdb":
            return f"chdb {self.path} database {self.database}"
        return f"sqlite {self.path}"


def parse_store(url: str) -> StoreURL:
    """`clickhouse://[USER[:PASSWORD]@]HOST[:PORT]/DB` (https via `clickhouses://`), `chdb:///DIR?database=DB`, or a
    SQLite path (`sqlite:///PATH` or a plain path). Raises ValueError with the reason."""
    if "://" not in url:
        if not url:
            raise ValueError("empty store address")
        return StoreURL("sqlite", path=url)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "sqlite":
        if not parts.path:
            raise ValueError(f"{url!r}: sqlite:///PATH names no file")
        return StoreURL("sqlite", path=parts.path)
    db = parse_qs(parts.query).get("database", [""])[0]
    if scheme == "chdb":
        path = (parts.netloc + parts.path) if parts.netloc else parts.path
        if not path:
            raise ValueError(f"{url!r}: chdb:///DIR names no directory")
        return StoreURL("chdb", path=path, database=_dbname(db or "steplens", url))
    if scheme in ("clickhouse", "clickhouses"):
        if not parts.hostname:
            raise ValueError(f"{url!r}: no host")
        try:
            port = parts.port or (8443 if scheme == "clickhouses" else 8123)
        except ValueError:
            raise ValueError(f"{url!r}: the port is not a number") from None
        name = parts.path.strip("/") or db or "steplens"
        return StoreURL("clickhouse", host=parts.hostname, port=port, database=_dbname(name, url),
                        user=unquote(parts.username or "default"), password=unquote(parts.password or ""),
                        secure=scheme == "clickhouses")
    raise ValueError(f"{url!r}: unknown store scheme {scheme!r} (clickhouse://, chdb://, sqlite:// or a path)")


def _dbname(name: str, url: str) -> str:
    if not name.replace("_", "").isalnum() or name[0].isdigit():
        raise ValueError(f"{url!r}: database name {name!r} must be letters, digits and '_'")
    return name


_SHARED: dict[tuple, "CH"] = {}
_SHARED_LOCK = threading.Lock()


class CH:
    """One ClickHouse client, calls serialized (clickhouse-connect clients are not for concurrent use; chDB allows
    one engine per process, so its clients are shared process-wide: `open_ch`)."""

    def __init__(self, url: StoreURL) -> None:
        try:
            import clickhouse_connect
        except ImportError as exc:
            raise StoreError(f"the ClickHouse store needs clickhouse-connect (pip install "
                             f"'steplens[clickhouse]'): {exc}") from None
        self.url = url
        self.db = url.database
        self.lock = threading.RLock()
        try:
            if url.kind == "chdb":
                self.client = clickhouse_connect.get_client(interface="chdb", path=url.path)
            else:
                self.client = clickhouse_connect.get_client(
                    host=url.host, port=url.port, username=url.user, password=url.password, secure=url.secure,
                    connect_timeout=5, send_receive_timeout=60)
            self.client.command(f"CREATE DATABASE IF NOT EXISTS {self.db}")
        except Exception as exc:   # the library raises its own and the driver's errors
            raise StoreError(f"cannot open the ClickHouse store ({url.describe()}): {_short(exc)}") from None

    def query(self, sql: str, args: list | tuple = ()) -> list[tuple]:
        sql, params = _bind(sql, args)
        with self.lock:
            try:
                return list(self.client.query(sql, parameters=params).result_rows)
            except Exception as exc:
                raise w.BackendError(f"ClickHouse query failed: {_short(exc)}") from None

    def dicts(self, sql: str, args: list | tuple = ()) -> list[dict]:
        sql, params = _bind(sql, args)
        with self.lock:
            try:
                res = self.client.query(sql, parameters=params)
            except Exception as exc:
                raise w.BackendError(f"ClickHouse query failed: {_short(exc)}") from None
            names = res.column_names
            return [dict(zip(names, r)) for r in res.result_rows]

    def command(self, sql: str, args: list | tuple = ()) -> None:
        sql, params = _bind(sql, args)
        with self.lock:
            try:
                self.client.command(sql, parameters=params)
            except Exception as exc:
                raise w.BackendError(f"ClickHouse command failed: {_short(exc)}") from None

    def insert(self, table: str, rows: list, cols: tuple, column_oriented: bool = False) -> None:
        """rows: a tuple per row, or (column_oriented) a list per column."""
        with self.lock:
            try:
                self.client.insert(f"{self.db}.{table}", rows, column_names=list(cols), column_oriented=column_oriented)
            except Exception as exc:
                raise w.BackendError(f"ClickHouse insert into {table} failed: {_short(exc)}") from None


def open_ch(url: StoreURL) -> CH:
    key = (url.kind, url.path, url.host, url.port, url.database, url.user)
    if url.kind == "chdb":
        with _SHARED_LOCK:
            ch = _SHARED.get(key)
            if ch is None:
                ch = _SHARED[key] = CH(url)
            return ch
    return CH(url)


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def _bind(sql: str, args) -> tuple[str, dict]:
    """SQLite-style `?` placeholders -> ClickHouse server-side parameters {pN:Type} (a list/tuple: an Array)."""
    if not args:
        return sql, {}
    pieces = sql.split("?")
    if len(pieces) - 1 != len(args):
        raise ValueError(f"{len(pieces) - 1} placeholders for {len(args)} arguments")
    out, params = [pieces[0]], {}
    for i, (a, rest) in enumerate(zip(args, pieces[1:])):
        name = f"p{i}"
        params[name] = list(a) if isinstance(a, (list, tuple)) else a
        out.append(f"{{{name}:{_chtype(a)}}}{rest}")
    return "".join(out), params


def _chtype(a) -> str:
    if isinstance(a, (list, tuple)):
        return f"Array({_chtype(a[0]) if a else 'String'})"
    if isinstance(a, bool) or isinstance(a, int):
        return "Int64"
    if isinstance(a, float):
        return "Float64"
    return "String"


def ensure_schema(ch: CH, retention_s: float) -> None:
    for table in TABLES:
        ch.command(_ddl(ch.db, table, retention_s))
        tcol = TABLES[table][1]
        if retention_s > 0:
            ch.command(f"ALTER TABLE {ch.db}.{table} MODIFY TTL toDateTime(intDiv({tcol}, 1000000000)) + INTERVAL"
                       f" {max(1, int(retention_s))} SECOND SETTINGS materialize_ttl_after_modify = 0")
        elif " TTL " in ch.query("SELECT create_table_query FROM system.tables WHERE database = ? AND name = ?",
                                 [ch.db, table])[0][0]:
            ch.command(f"ALTER TABLE {ch.db}.{table} REMOVE TTL")
        # a database written before rows named their writer: its rows and commits are the one writer ''
        ch.command(f"ALTER TABLE {ch.db}.{table} ADD COLUMN IF NOT EXISTS _writer LowCardinality(String) DEFAULT ''")
    ch.command(COMMITS_DDL.format(db=ch.db))
    ch.command(f"ALTER TABLE {ch.db}.commits ADD COLUMN IF NOT EXISTS writer LowCardinality(String) DEFAULT ''")


def commit_marks(ch: CH) -> dict[str, int]:
    """Each writer's newest commit: its rows up to that _rid are committed."""
    return {str(wr): int(rid) for wr, rid in ch.query(f"SELECT writer, max(_rid) FROM {ch.db}.commits GROUP BY writer")}


def committed_rid(ch: CH, writer: str | None = None) -> int:
    """One writer's newest commit (None: the newest of any writer)."""
    marks = commit_marks(ch)
    if writer is not None:
        return marks.get(writer, 0)
    return max(marks.values(), default=0)


def committed_cond(marks: dict[str, int]) -> tuple[str, list]:
    """SQL condition (and its arguments) true for the committed rows of `marks`' writers."""
    if not marks:
        return "0", []
    parts, args = [], []
    for wr, top in sorted(marks.items()):
        parts.append("(_writer = ? AND _rid <= ?)")
        args += [wr, top]
    return "(" + " OR ".join(parts) + ")", args


Mark = tuple   # ((writer, rid), ...) sorted: what an incremental reader has read, per writer


def as_marks(mark) -> dict[str, int]:
    """A reader's mark as a dict; 0 or a tuple of numbers (a fresh reader, another store's mark) is nothing read."""
    if isinstance(mark, (tuple, list)) and mark and isinstance(mark[0], (tuple, list)):
        return {str(wr): int(rid) for wr, rid in mark}
    return {}


def to_mark(marks: dict[str, int]) -> Mark:
    return tuple(sorted((wr, rid) for wr, rid in marks.items() if rid))


def span_cond(after: dict[str, int], upto: dict[str, int]) -> tuple[str, list]:
    """Rows committed after `after` and up to `upto`, per writer (a writer whose commits went back below what
    was read, a store emptied and begun again, is read from its start)."""
    parts, args = [], []
    for wr, top in sorted(upto.items()):
        lo = after.get(wr, 0)
        lo = lo if lo <= top else 0
        if top > lo:
            parts.append("(_writer = ? AND _rid > ? AND _rid <= ?)")
            args += [wr, lo, top]
    return ("(" + " OR ".join(parts) + ")", args) if parts else ("0", [])


def read_span(ch: CH, table: str, select: str, where: list[str], args: list, after: dict[str, int],
              upto: dict[str, int], limit: int) -> tuple[list[dict], dict[str, int]]:
    """Rows of `table` committed after `after` and up to `upto` (per writer) that match `where`, at most `limit`
    of them but whole write groups (a cut read goes on after the group it stopped in), in storage order (group
    id); and the marks read up to."""
    span, span_args = span_cond(after, upto)
    rows = ch.dicts(f"SELECT _writer, _rid, {select} FROM {ch.db}.{table} WHERE {' AND '.join([*where, span])}"
                    " ORDER BY _writer, _rid LIMIT ? WITH TIES", [*args, *span_args, limit])
    read = {wr: max(top, after.get(wr, 0)) for wr, top in upto.items()}
    if len(rows) >= limit:   # writers before the cut one: read to their top; after it: not read
        cut_w, cut_rid = rows[-1]["_writer"], rows[-1]["_rid"]
        read = {wr: (top if wr < cut_w else cut_rid if wr == cut_w else after.get(wr, 0))
                for wr, top in read.items()}
    rows.sort(key=lambda r: r["_rid"])
    return rows, read


class ClickHouseWriter(w.StoreWriter):
    """StoreWriter whose append-only tables live in ClickHouse (the module's docstring: order of a group's
    writes, recovery); the state stays in the SQLite file at `path`."""

    def __init__(self, path: str, url: StoreURL, writer_id: str = "", commit_fence_seconds: float = 60.0,
                 peer_dead_seconds: float = 600.0, min_group_seconds: float = 0.2, **kw) -> None:
        if not 0 < commit_fence_seconds < peer_dead_seconds:
            raise ValueError(f"need 0 < commit_fence_seconds < peer_dead_seconds, got {commit_fence_seconds} and"
                             f" {peer_dead_seconds}")
        # each group writes a part per table it touches: fewer, larger groups (the ack waits up to this long)
        kw.setdefault("max_group", 512)
        super().__init__(path, min_group_seconds=min_group_seconds, **kw)
        self.url = url
        self.writer_id = writer_id
        self.commit_fence_s = commit_fence_seconds
        self.peer_dead_ns = int(peer_dead_seconds * 1e9)
        self.ch = open_ch(url)
        ensure_schema(self.ch, self.retention_ns / 1e9)
        self._buf: dict[str, list] = {}
        self._series_before: dict[tuple, tuple] = {}
        self._rid = 0
        self._group_t0 = 0.0
        self._recovery_due = True
        self._peers_cleaned: dict[str, int] = {}   # silent peer -> its last heartbeat when this writer cleaned
        self._peers_checked = 0.0
        self.ch_inserts = 0
        self.recoveries = 0   # recoveries that removed rows
        self.peer_cleanups = 0
        self.fenced = 0       # groups given up at the commit fence
        # the collectors' shared state (store/replication.py): only where the store has writers to share it with
        self._repl_cols: dict[str, list[str]] = {}
        self._agents_sent: dict[str, tuple] = {}
        self._state_last: list[tuple] = []
        self._state_retry: list[tuple] = []
        self.state_sent = self.state_applied = 0
        if writer_id:
            replication.install(self.conn)
            # what this collector held before it stopped is held by nobody now (the agents reconnect anywhere)
            self.conn.execute("UPDATE agents SET connected = 0 WHERE connected = 1 AND collector_id = ''")
        try:
            self._recover()
        except w.BackendError as exc:   # the next group retries first
            log.error("ClickHouse store recovery failed: %s", exc)

    # -- rows ------------------------------------------------------------------------------
    def _append(self, job, table: str, cols: tuple, rows: list) -> None:
        """Kept by columns (a batch's rows transposed at C speed; its spool and seq once), inserted column-oriented:
        building and transposing a tuple per row was 30 % of the writer's time at 150k rows/s."""
        if rows:
            spool, seq = (job.spool_id, job.seq) if job is not None else ("", 0)
            self._buf.setdefault(table, []).append((list(zip(*rows)), spool, seq, len(rows)))

    def _metric_row(self, s: list, agent: str, name: str, entity: str, ts: int, value: float) -> tuple:
        self._series_before.setdefault((agent, name, entity), (s, s[1], s[2], s[3]))
        return (agent, name, entity, ts, value)

    def _heartbeat_rows(self, conn, row: tuple) -> int:
        """Into ClickHouse, where every collector on this store reads it (the SQLite beside it is this one's);
        and the other collectors' state since the last heartbeat into this one's SQLite."""
        self._append(None, "collectors", tuple(c for c, _ in TABLES["collectors"][0]), [row])
        try:
            self._sync_state(conn)
        except w.BackendError as exc:   # the heartbeat stands; the next one syncs again
            log.error("ClickHouse store: reading the other collectors' state failed: %s", exc)
        return 1

    def sync_state(self) -> bool:
        """Apply the other collectors' state now (in the writer's next group; the heartbeat does it regularly)."""
        return self.submit(w.StoreJob(self._sync_state, lambda *_: None))

    def _sync_state(self, conn, limit: int = 20_000) -> int:
        """The other writers' committed state-log rows since this collector's marks, applied to its SQLite."""
        if not self.writer_id:
            return 0
        upto = {wr: rid for wr, rid in commit_marks(self.ch).items() if wr != self.writer_id}
        after = replication.marks(conn)
        if not span_cond(after, upto)[1]:
            return 0
        rows, read = read_span(self.ch, "state_log", "tbl, key, version_ns, row_json", ["1"], [], after, upto, limit)
        n = replication.apply(conn, [(r["_writer"], r["tbl"], r["key"], r["version_ns"], r["row_json"])
                                     for r in rows], read, self._repl_cols)
        self.state_applied += n
        return n

    # -- a group ---------------------------------------------------------------------------
    def _write_group(self, group: list) -> None:
        if self._recovery_due:
            try:
                self._recover()
            except w.BackendError as exc:
                self.failures += 1
                self.last_error = f"store write failed: {exc}"
                for item in group:
                    if isinstance(item, (w.BatchJob, w.ImportJob, w.StoreJob)):
                        item.done("failed", 0, self.last_error)
                return
        self._buf = {}
        self._series_before = {}
        self._rid = max(self._rid + 1, time.time_ns())
        self._group_t0 = time.monotonic()
        super()._write_group(group)
        if time.monotonic() - self._peers_checked > self.peer_dead_ns / 4e9:
            try:
                self._clean_dead_peers()
            except w.BackendError as exc:
                log.error("ClickHouse store: cleaning a dead collector's unfinished rows failed: %s", exc)

    def _before_commit(self) -> None:
        rid, me = self._rid, self.writer_id
        if me:
            # a group that failed after its state committed sends its state rows again (same versions: a row
            # that did land is applied once)
            state = self._state_retry + replication.collect(self.conn, self.now_ns(), me, self._repl_cols,
                                                            self._agents_sent)
            self._state_retry, self._state_last = [], state
            if state:
                self._append(None, "state_log", (), state)
                self.state_sent += len(state)
        for table in sorted(self._buf, key=lambda t: t == "batches"):
            chunks = self._buf[table]
            cols = tuple(c for c, _ in TABLES[table][0]) + DELIVERY
            n = sum(c[3] for c in chunks)
            data = [list(itertools.chain.from_iterable(c[0][i] for c in chunks)) for i in range(len(chunks[0][0]))]
            data.append(list(itertools.chain.from_iterable(itertools.repeat(c[1], c[3]) for c in chunks)))
            data.append(list(itertools.chain.from_iterable(itertools.repeat(c[2], c[3]) for c in chunks)))
            data += [[rid] * n, [me] * n]
            self.ch.insert(table, data, cols, column_oriented=True)
            self.ch_inserts += 1

    def _after_commit(self) -> str:
        if not self._buf:
            return ""
        took = time.monotonic() - self._group_t0
        if took > self.commit_fence_s:   # a survivor may have taken this writer for dead and cleaned its rows
            self.fenced += 1
            self._restore_series()
            return (f"the write took {took:.0f} s, past the commit fence ({self.commit_fence_s:g} s): given up,"
                    " the agents resend")
        try:
            self.ch.insert("commits", [(self._rid, self.now_ns(), self.writer_id)], ("_rid", "ts_ns", "writer"))
        except w.BackendError as exc:
            self._restore_series()
            return str(exc)
        self._buf = {}
        self._state_last = []
        return ""

    def _on_failure(self) -> None:
        self._recovery_due = True
        self._buf = {}
        self._state_retry, self._state_last = self._state_last, []
        try:
            self._recover()
        except w.BackendError as exc:
            log.error("ClickHouse store recovery failed (retried before the next write): %s", exc)

    def _restore_series(self) -> None:
        """The state committed, the telemetry did not: put the series' last sample back where it was, so the
        resent batch's samples are not taken for old ones."""
        back = []
        for s, mono, ts, value in self._series_before.values():
            s[1], s[2], s[3] = mono, ts, value
            back.append((mono, ts, value, s[0]))
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            self.conn.executemany("UPDATE series SET last_mono_ns=?, last_ts_ns=?, last_value=? WHERE id=?", back)
            self.conn.execute("COMMIT")
        except Exception as exc:
            try:
                self.conn.execute("ROLLBACK")
            except Exception:
                pass
            self._series.clear()
            log.error("could not put the series back after a failed ClickHouse write: %s", exc)

    def _delete_unfinished(self, writer: str, top: int) -> int:
        """Delete `writer`'s rows above its newest commit `top`; how many went."""
        removed = 0
        for table in TABLES:
            n = self.ch.query(f"SELECT count() FROM {self.ch.db}.{table} WHERE _writer = ? AND _rid > ?",
                              [writer, top])[0][0]
            if n:
                self.ch.command(f"DELETE FROM {self.ch.db}.{table} WHERE _writer = ? AND _rid > ?", [writer, top])
                removed += n
        return removed

    def _recover(self) -> int:
        """Delete this writer's rows of groups that never committed (another writer's are its own to judge);
        returns how many went."""
        top = committed_rid(self.ch, self.writer_id)
        removed = self._delete_unfinished(self.writer_id, top)
        if removed:
            log.warning("ClickHouse store: removed %d rows of unfinished writes (writer %r, above commit %d)",
                        removed, self.writer_id, top)
            self.recoveries += 1
        self._rid = max(self._rid, top)
        self._recovery_due = False
        self._clean_dead_peers()
        return removed

    def _clean_dead_peers(self) -> int:
        """The unfinished rows of collectors on this store silent for peer_dead_seconds (by their heartbeats):
        what a collector killed between its inserts left, which it would have deleted itself had it come back."""
        self._peers_checked = time.monotonic()
        if not self.writer_id:   # a store with one writer: nobody else's rows
            return 0
        db, removed = self.ch.db, 0
        silent = self.ch.query(f"SELECT collector_id, max(heartbeat_ns) AS hb FROM {db}.collectors"
                               " GROUP BY collector_id HAVING hb < ?", [self.now_ns() - self.peer_dead_ns])
        marks = None
        for peer, hb in silent:
            if peer == self.writer_id or self._peers_cleaned.get(peer) == hb:
                continue
            marks = marks if marks is not None else commit_marks(self.ch)
            n = self._delete_unfinished(peer, marks.get(peer, 0))
            self._peers_cleaned[peer] = hb
            if n:
                log.warning("ClickHouse store: removed %d rows of unfinished writes of collector %r, silent for"
                            " more than %.0f s", n, peer, self.peer_dead_ns / 1e9)
                self.peer_cleanups += 1
                removed += n
        return removed

    # -- dedupe ----------------------------------------------------------------------------
    def _committed_seq(self, key: tuple[str, str]) -> int:
        seq = self._last_seq.get(key)
        if seq is None:
            seq = self._max_seq(*key)
            self._last_seq[key] = seq
        return seq

    def _max_seq(self, agent_id: str, spool_id: str) -> int:
        cond, args = committed_cond(commit_marks(self.ch))
        rows = self.ch.query(f"SELECT max(seq) FROM {self.ch.db}.batches WHERE agent_id = ? AND spool_id = ?"
                             f" AND {cond}", [agent_id, spool_id] + args)
        return int(rows[0][0] or 0) if rows else 0

    def last_seq(self, agent_id: str, spool_id: str) -> int:
        """At an agent's Hello: its spool's newest committed seq in the store. Several collectors share the store
        and an agent moves between them: what this one remembered of the agent (from an earlier stream) is
        forgotten, so the writer reads the store again before the agent's next batch (a batch another collector
        stored but could not ack before it died comes again: a duplicate here, not a second copy)."""
        self._last_seq.pop((agent_id, spool_id), None)
        try:
            return self._max_seq(agent_id, spool_id)
        except w.BackendError as exc:
            raise StoreError(str(exc)) from None

    def apply_retention(self, cutoff_ns: int) -> int:
        """The state file's own tables (ClickHouse expires its rows by TTL)."""
        return super().apply_retention(cutoff_ns)


class ClickHouseReader(Reader):
    """Reader whose telemetry queries go to ClickHouse; state queries (findings, processes, GPUs, members,
    topology, deep dives) read the SQLite file at `path`."""

    def __init__(self, path: str, url: StoreURL) -> None:
        super().__init__(path)
        self.url = url
        self.ch = open_ch(url)

    def _t(self, table: str) -> str:
        return f"{self.ch.db}.{table}"

    def nodes(self, node_id: str = "") -> list[dict]:
        out = super().nodes(node_id)
        counts = dict(self.ch.query(f"SELECT agent_id, count() FROM {self._t('gaps')} GROUP BY agent_id"))
        for n in out:
            n["gaps"] = int(counts.get(n["node_id"], 0))
        return out

    def gaps(self, node_id: str = "") -> list[dict]:
        where, args = ("WHERE agent_id = ?", [node_id]) if node_id else ("", [])
        return [{"node_id": r["agent_id"], "ts_ns": r["ts_ns"], "dropped_records": r["dropped_records"],
                 "dropped_batches": r["dropped_batches"], "first_seq": r["first_seq"], "last_seq": r["last_seq"],
                 "reason": r["reason"]}
                for r in self.ch.dicts(f"SELECT * FROM {self._t('gaps')} {where} ORDER BY ts_ns, _rid", args)]

    def comm_summaries(self, job_key: str, ranks: list[int] | None = None, since_ns: int = 0,
                       limit: int = 5000) -> list[dict]:
        cond, args = ["job_key = ?", "end_ns >= ?"], [job_key, since_ns]
        if ranks:
            cond.append("rank IN ?")
            args.append(list(ranks))
        cols = ", ".join(c for c, _ in TABLES["comm_summaries"][0])
        rows = self.ch.dicts(f"SELECT {cols} FROM {self._t('comm_summaries')} WHERE {' AND '.join(cond)}"
                             " ORDER BY end_ns DESC, _rid DESC LIMIT ?", args + [limit])
        return [dict(r, node_id=r.pop("agent_id")) for r in reversed(rows)]

    def comm_progress(self, job_key: str, since_ns: int = 0, until_ns: int = 0, ranks: list[int] | None = None,
                      limit: int = 200_000) -> list[dict]:
        cond, args = ["job_key = ?", "end_ns >= ?"], [job_key, since_ns]
        if until_ns:
            cond.append("end_ns <= ?")
            args.append(until_ns)
        if ranks:
            cond.append("rank IN ?")
            args.append(list(ranks))
        cols = ", ".join("agent_id" if k == "node_id" else k for k in _PROGRESS_KEYS)
        rows = self.ch.query(f"SELECT {cols} FROM {self._t('comm_progress')} WHERE {' AND '.join(cond)}"
                             " ORDER BY end_ns DESC, _rid DESC LIMIT ?", args + [limit])
        return [_progress_row(r) for r in reversed(rows)]

    def comm_progress_latest(self, job_key: str, until_ns: int = 0) -> list[dict]:
        cols = ", ".join("agent_id" if k == "node_id" else k for k in _PROGRESS_KEYS)
        rows = self.ch.query(f"SELECT {cols} FROM {self._t('comm_progress')} WHERE job_key = ? AND end_ns <= ?"
                             " ORDER BY end_ns DESC, _rid DESC LIMIT 1 BY agent_id, pid, comm_id",
                             [job_key, until_ns or (1 << 63) - 1])
        out = [_progress_row(r) for r in rows]
        out.sort(key=lambda r: (r["rank"], r["comm_id"], r["node_id"], r["pid"]))
        return out

    def stacks(self, node_id: str = "", pid: int = 0, since_ns: int = 0, limit: int = 200) -> list[dict]:
        cond, args = ["end_ns >= ?"], [since_ns]
        if node_id:
            cond.append("agent_id = ?")
            args.append(node_id)
        if pid:
            cond.append("pid = ?")
            args.append(pid)
        rows = self.ch.dicts(f"SELECT * FROM {self._t('stack_summaries')} WHERE {' AND '.join(cond)}"
                             " ORDER BY end_ns DESC, pid, tid LIMIT ?", args + [limit])
        return [stack_row(r) for r in rows]

    def flows(self, since_ns: int = 0, by: str = "pair", node_id: str = "", limit: int = 1000) -> list[dict]:
        if by not in ("pair", "connection"):
            raise ValueError("by is 'pair' or 'connection'")
        keys = "src, dst" if by == "pair" else "src, sport, dst, dport"
        cond, args = ["end_ns >= ?"], [since_ns]
        if node_id:
            cond.append("agent_id = ?")
            args.append(node_id)
        rows = self.ch.dicts(
            f"SELECT {keys}, sum(bytes) AS bytes, sum(packets) AS packets, count() AS flows, min(start_ns) AS first_ns,"
            f" max(end_ns) AS last_ns, arrayStringConcat(arraySort(groupUniqArray(toString(origin))), ',') AS origins"
            f" FROM {self._t('flows')} WHERE {' AND '.join(cond)} GROUP BY {keys} ORDER BY bytes DESC LIMIT ?",
            args + [limit])
        return [{**r, "origins": (r["origins"] or "").split(",")} for r in rows]

    def process_events(self, since_ns: int = 0, until_ns: int = 0, node_ids: list[str] | None = None,
                       kinds: tuple[str, ...] = PROCESS_STATE_EVENTS, limit: int = 100_000) -> list[dict]:
        cond, args = ["kind IN ?", "ts_ns >= ?"], [list(kinds), since_ns]
        if until_ns:
            cond.append("ts_ns <= ?")
            args.append(until_ns)
        if node_ids:
            cond.append("agent_id IN ?")
            args.append(list(node_ids))
        rows = self.ch.query(f"SELECT agent_id, ts_ns, kind, entity, message, value FROM {self._t('events')} WHERE"
                             f" {' AND '.join(cond)} ORDER BY ts_ns, _rid LIMIT ?", args + [limit])
        return process_event_rows(rows)

    def node_events(self, node_id: str, kinds: tuple[str, ...], since_ns: int = 0, until_ns: int = 0,
                    limit: int = 1000) -> list[dict]:
        cond, args = ["agent_id = ?", "kind IN ?", "ts_ns >= ?"], [node_id, list(kinds), since_ns]
        if until_ns:
            cond.append("ts_ns <= ?")
            args.append(until_ns)
        return self.ch.dicts(f"SELECT ts_ns, kind, entity, message, value FROM {self._t('events')}"
                             f" WHERE {' AND '.join(cond)} ORDER BY ts_ns, _rid LIMIT ?", args + [limit])

    def metric_points(self, node_id: str, names: list[str], entities: list[str] | None = None, since_ns: int = 0,
                      until_ns: int = 0, limit: int = 100_000) -> dict[tuple[str, str], list[tuple[int, float]]]:
        if not names:
            return {}
        cond, args = ["agent_id = ?", "name IN ?", "ts_ns >= ?"], [node_id, list(names), since_ns]
        if entities is not None:
            if not entities:
                return {}
            cond.append("entity IN ?")
            args.append(list(entities))
        if until_ns:
            cond.append("ts_ns <= ?")
            args.append(until_ns)
        # the newest sample of a (series, time) wins, as SQLite's key does
        rows = self.ch.query(f"SELECT name, entity, ts_ns, argMax(value, _rid) FROM {self._t('metrics')}"
                             f" WHERE {' AND '.join(cond)} GROUP BY name, entity, ts_ns"
                             " ORDER BY name, entity, ts_ns LIMIT ?", args + [limit])
        out: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for name, entity, ts, value in rows:
            out.setdefault((name, entity), []).append((ts, value))
        return out

    def conn_stats_of(self, node_id: str, since_ns: int = 0, until_ns: int = 0, limit: int = 50_000) -> list[dict]:
        cond, args = ["agent_id = ?", "end_ns >= ?"], [node_id, since_ns]
        if until_ns:
            cond.append("end_ns <= ?")
            args.append(until_ns)
        rows = self.ch.dicts("SELECT start_ns, end_ns, src, sport, dst, dport, tx_bytes, rx_bytes, tx_packets,"
                             " retransmits, srtt_us, pid, source, net_limited_us"
                             f" FROM {self._t('conn_stats')} WHERE {' AND '.join(cond)} ORDER BY end_ns, _rid LIMIT ?",
                             args + [limit])
        sources = {r["source"] for r in rows}
        if len(sources) > 1:
            keep = "tcpinfo" if "tcpinfo" in sources else sorted(sources)[0]
            rows = [r for r in rows if r["source"] == keep]
        return rows

    def flow_rows(self, since_ns: int, until_ns: int, limit: int = 5_000_000) -> list[tuple]:
        return [tuple(r) for r in self.ch.query(
            f"SELECT start_ns, end_ns, src, dst, bytes, switches, origin, sport, dport FROM {self._t('flows')}"
            " WHERE start_ns >= ? AND start_ns < ? ORDER BY start_ns, _rid LIMIT ?", [since_ns, until_ns, limit])]

    def live_collectors(self, since_ns: int) -> list[dict]:
        rows = self.ch.query(f"SELECT collector_id, argMax(address, heartbeat_ns), argMax(started_ns, heartbeat_ns),"
                             f" max(heartbeat_ns) AS hb FROM {self._t('collectors')} GROUP BY collector_id"
                             " HAVING hb >= ? ORDER BY collector_id", [since_ns])
        return [{"id": a, "address": b, "started_ns": c, "heartbeat_ns": d} for a, b, c, d in rows]

    def flow_watermark(self) -> tuple:
        """(a mark that changes with every flow stored, 0 without any; the newest flow's end). Several writers'
        group ids interleave: the mark is the count beside the newest id."""
        n, rid, end = self.ch.query(f"SELECT count(), max(_rid), max(end_ns) FROM {self._t('flows')}")[0]
        return ((int(n), int(rid or 0)) if n else 0), int(end or 0)

    def data_watermarks(self, job_keys: list[str]) -> dict[str, int]:
        if not job_keys:
            return {}
        out: dict[str, int] = {}
        for table in DATA_TABLES:
            for key, top in self.ch.query(f"SELECT job_key, max(end_ns) FROM {self._t(table)} WHERE job_key IN ?"
                                          " GROUP BY job_key", [list(job_keys)]):
                if top:
                    out[key] = max(out.get(key, 0), top)
        return out

    def new_data_since(self, rowid: int | tuple = 0) -> tuple[Mark, dict[str, int]]:
        """As the SQLite reader's, over each writer's committed write groups instead of rowids (the mark: each
        writer's newest commit read)."""
        after, upto = as_marks(rowid), commit_marks(self.ch)
        cond, args = span_cond(after, upto)
        out: dict[str, int] = {}
        if args:
            for table in DATA_TABLES:
                for key, v in self.ch.query(f"SELECT job_key, max(end_ns) FROM {self._t(table)} WHERE {cond}"
                                            " AND job_key != '' GROUP BY job_key", args):
                    if v:
                        out[key] = max(out.get(key, 0), v)
        return to_mark(upto), out

    def steps(self, job_key: str, ranks: list[int] | None = None, since_ns: int = 0, limit: int = 200_000,
              with_comms: bool = False) -> list[dict]:
        cond, args = ["job_key = ?", "end_ns >= ?"], [job_key, since_ns]
        if ranks:
            cond.append("rank IN ?")
            args.append(list(ranks))
        names = [c for c, _ in TABLES["steps"][0] if with_comms or c != "comms_json"]
        rows = self.ch.dicts(f"SELECT {', '.join(names)} FROM {self._t('steps')} WHERE {' AND '.join(cond)}"
                             " ORDER BY end_ns DESC, _rid DESC LIMIT ?", args + [limit])
        for r in rows:
            r["node_id"] = r.pop("agent_id")
            if with_comms:
                r["comms"] = json.loads(r.pop("comms_json"))
        rows.reverse()
        return rows

    def steps_after(self, job_key: str, after_rowid: Mark | int, since_ns: int = 0, limit: int = 2_000_000,
                    before_ns: int = 0, upto_rowid: Mark | int = 0) -> tuple[list[dict], Mark]:
        """As the SQLite reader's, over each writer's committed write groups (marks as new_data_since's). A cut
        read goes on after the group it stopped in: rows of one group are read whole, so `limit` may be passed by
        the rest of that group. Rows come in storage order (group id, then end time)."""
        after = as_marks(after_rowid)
        upto = as_marks(upto_rowid) or commit_marks(self.ch)
        cond, args = ["job_key = ?", "end_ns >= ?"], [job_key, since_ns]
        if before_ns:
            cond.append("end_ns < ?")
            args.append(before_ns)
        names = ", ".join(c for c, _ in TABLES["steps"][0])
        rows, read = read_span(self.ch, "steps", names, cond, args, after, upto, limit)
        rows.sort(key=lambda r: (r["_rid"], r["end_ns"]))
        for r in rows:
            r["node_id"] = r.pop("agent_id")
            r["comms"] = json.loads(r.pop("comms_json"))
            del r["_rid"], r["_writer"]
        return rows, to_mark(read)

    def iterations(self, job_key: str, since_ns: int = 0, until_ns: int = 0, limit: int = 500_000) -> list[dict]:
        cond, args = ["job_key = ?", "end_ns > ?"], [job_key, since_ns]
        if until_ns:
            cond.append("end_ns <= ?")
            args.append(until_ns)
        names = ", ".join(c for c, _ in TABLES["iterations"][0])
        rows = self.ch.dicts(f"SELECT {names} FROM {self._t('iterations')} WHERE {' AND '.join(cond)}"
                             " ORDER BY end_ns DESC, _rid DESC LIMIT ?", args + [limit])
        for r in rows:
            r["node_id"] = r.pop("agent_id")
        rows.reverse()
        return rows

    def _job_comm_rows(self, conn, job_key: str) -> dict[str, list[dict]]:
        where, args = ("AND job_key = ?", [job_key]) if job_key else ("", [])
        t = self._t("comm_summaries")
        summ: dict[str, list[dict]] = {}
        for key, last in self.ch.query(f"SELECT job_key, max(end_ns) FROM {t} WHERE job_key != '' {where}"
                                       " GROUP BY job_key", args):
            summ[key] = self.ch.dicts(
                "SELECT rank, comm_id, agent_id, arrayStringConcat(groupUniqArray(toString(op)), ',') AS ops,"
                f" min(start_ns) AS first_ns, max(end_ns) AS last_ns FROM {t} WHERE job_key = ? AND end_ns >= ?"
                " GROUP BY rank, comm_id, agent_id", [key, last - JOB_COMMS_WINDOW_NS])
        return summ

    def table_sizes(self) -> dict[str, dict]:
        """Per table: rows and bytes on disk (compressed), for `bench/ingest.py`."""
        return {t: {"rows": int(r), "bytes": int(b)} for t, r, b in self.ch.query(
            "SELECT table, sum(rows), sum(bytes_on_disk) FROM system.parts WHERE database = ? AND active"
            " GROUP BY table", [self.ch.db])}


def make_store(db: str, store: str = ""):
    """(writer class and kwargs maker, reader factory) for a collector: store '' or a SQLite address keeps
    everything in `db`; a ClickHouse address puts the telemetry there."""
    url = parse_store(store) if store else StoreURL("sqlite", path=db)
    if url.kind == "sqlite":
        path = url.path if store else db
        def sqlite_writer(writer_id: str = "", **kw):   # one writer per file: no writer id to keep
            return w.StoreWriter(path, **kw)
        return url, sqlite_writer, (lambda: Reader(path))
    return url, (lambda **kw: ClickHouseWriter(db, url, **kw)), (lambda: ClickHouseReader(db, url))


__all__ = ["ClickHouseReader", "ClickHouseWriter", "StoreURL", "parse_store", "make_store"]
