"""The collector's single store writer: group commit of batches from every agent, then acks.

One thread owns the write connection. It takes whatever is queued (up to a few dozen batches),
writes it in one transaction, commits, and only then reports each batch done, so an ack always
means "durable". Per batch: dedupe on (agent_id, spool_id, seq), decode and validate, convert
every agent mono_ns to cluster time with the clock estimate the stream attached, check that each
series moves forward in time, insert. A batch that is refused as a whole writes nothing but its
rejection row. If the store itself fails (disk full, I/O error), the transaction rolls back and
every batch in it is reported failed, unacknowledged, so agents keep them and resend.

Cost on this 2-core machine: see bench/ingest.py (rows/s and CPU seconds per 100k rows).
"""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Callable

from steplens.collector.ingest.clock import ClockEstimate
from steplens.collector.ingest.decode import BatchRejected, decode_batch, process_row, stacks_json, step_comms_json
from steplens.collector.store import schema

log = logging.getLogger("steplens.collector.writer")

MODE_NAMES = {1: "sentinel", 2: "deep"}

# the append-only tables' columns, in the order the writer builds their rows (the ClickHouse store adds its own
# delivery columns: clickhouse.py)
METRIC_COLS = ("series_id", "ts_ns", "value")
EVENT_COLS = ("agent_id", "ts_ns", "source", "kind", "entity", "message", "value")
GAP_COLS = ("agent_id", "spool_id", "ts_ns", "source", "dropped_records", "dropped_batches", "first_seq", "last_seq",
            "reason")
REJECTION_COLS = ("agent_id", "ts_ns", "spool_id", "seq", "reason", "count")
STACK_COLS = ("agent_id", "start_ns", "end_ns", "pid", "start_ticks", "tid", "thread_name", "python", "samples",
              "errors", "last_state", "stacks_json")
FLOW_COLS = ("agent_id", "start_ns", "end_ns", "src", "sport", "dst", "dport", "bytes", "packets", "pid", "origin",
             "switches")
CONN_COLS = ("agent_id", "start_ns", "end_ns", "src", "sport", "dst", "dport", "tx_bytes", "rx_bytes", "tx_packets",
             "rx_packets", "tx_payload_bytes", "rx_payload_bytes", "retransmits", "srtt_us", "pid", "comm", "source",
             "net_limited_us")
COMM_SUMMARY_COLS = ("agent_id", "start_ns", "end_ns", "pid", "start_ticks", "job_key", "rank", "comm_id", "op",
                     "step", "calls", "bytes", "busy_ns", "max_ns", "seq_first", "seq_last", "timing", "source",
                     "issue_latency_ns_sum", "kernels")
COMM_PROGRESS_COLS = ("agent_id", "end_ns", "pid", "start_ticks", "job_key", "rank", "comm_id", "last_enqueued",
                      "last_started", "last_completed", "pending_op", "pending_seq", "pending_p2p", "pending_peer",
                      "pending_since_ns", "nranks")
STEP_COLS = ("agent_id", "source", "pid", "start_ticks", "job_key", "rank", "step", "start_ns", "end_ns", "evidence",
             "period_ops", "ops", "comms_json")
ITERATION_COLS = ("agent_id", "pid", "start_ticks", "job_key", "rank", "seq", "start_ns", "end_ns", "anchor", "phase",
                  "batch_size", "prefill_requests", "prefill_tokens", "decode_requests", "kv_tokens", "input_tokens",
                  "output_tokens", "tokens", "micro_batches")
BATCH_COLS = ("agent_id", "spool_id", "seq", "n_records", "n_rejected", "n_bytes", "received_ns", "clock_offset_ns",
              "clock_uncertainty_ns")


class BackendError(RuntimeError):
    """A store other than the SQLite state file failed (clickhouse.py): the group is not durable."""


@dataclass
class BatchJob:
    agent_id: str
    spool_id: str
    seq: int
    n_records: int
    payload: bytes
    sent_mono_ns: int
    clock: ClockEstimate
    received_ns: int
    done: Callable[[str, int, str], None]  # (outcome: stored|duplicate|rejected|failed, rejected, note)


@dataclass
class ImportJob:
    """Flows exported by switches, validated by the caller; written in one transaction.
    rows: (start_ns, end_ns, src, sport, dst, dport, bytes, packets, switches_json)."""

    origin: str
    rows: list
    done: Callable[[str, int, str], None]


@dataclass
class StoreJob:
    """Any other write (a topology import, findings of the analysis engine): apply(conn) runs in the writer
    thread inside the group's transaction, under a savepoint of its own, so an exception in it undoes only
    its own writes and reports it "failed" (the rest of the group commits). done runs after the commit with
    (outcome, apply's return value, note)."""

    apply: Callable[[sqlite3.Connection], int]
    done: Callable[[str, int, str], None]
    result: int = 0


async def submit_and_wait(writer, make: Callable[[Callable[[str, int, str], None]], object]) -> tuple[str, int, str]:
    """From an asyncio task: submit the job make(done) builds (a StoreJob or ImportJob), waiting while the writer's
    queue is full, and wait for its commit: (outcome, n, note)."""
    import asyncio
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    job = make(lambda outcome, n, note: loop.call_soon_threadsafe(
        lambda: fut.done() or fut.set_result((outcome, n, note))))
    while not writer.submit(job):
        await asyncio.sleep(0.01)
    return await fut


@dataclass
class AgentUpdate:
    agent_id: str
    fields: dict


class StoreWriter:
    def __init__(self, path: str, now_ns: Callable[[], int] = time.time_ns, retention_seconds: float = 7 * 86400,
                 retention_check_seconds: float = 300.0, max_group: int = 64, queue_size: int = 2048,
                 min_group_seconds: float = 0.0) -> None:
        self.path = path
        self.db = schema.connect(path)
        self.conn: sqlite3.Connection = self.db.conn
        self.now_ns = now_ns
        self.retention_ns = int(retention_seconds * 1e9)
        self.retention_check_seconds = retention_check_seconds
        self.max_group = max_group
        self.min_group_seconds = min_group_seconds   # >0: gather a group this long (ClickHouse: a part per table)
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._series: dict[tuple[str, str, str], list] = {}  # key -> [id, last_mono, last_ts, last_value, dirty]
        self._last_seq: dict[tuple[str, str], int] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.rows_written = 0       # metric samples
        self.records_written = 0    # records of every kind stored from agent batches
        self.batches_written = 0
        self.commits = 0
        self.failures = 0
        self.last_error = ""
        self._next_retention = time.monotonic() + retention_check_seconds

    # -- public API (any thread) -----------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="store-writer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self.queue.put_nowait(None)
        except queue.Full:
            pass
        if self._thread is not None:
            self._thread.join(timeout)
        try:
            self.conn.close()
        except sqlite3.Error:
            pass

    def submit(self, job: BatchJob | AgentUpdate) -> bool:
        """False when the writer is backlogged; the caller should slow down (stop reading)."""
        try:
            self.queue.put_nowait(job)
            return True
        except queue.Full:
            return False

    def last_seq(self, agent_id: str, spool_id: str) -> int:
        """Highest committed seq for this spool (asks the writer thread's view via a read connection)."""
        ro = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
        try:
            row = ro.execute("SELECT MAX(seq) FROM batches WHERE agent_id=? AND spool_id=?",
                             (agent_id, spool_id)).fetchone()
            return row[0] or 0
        finally:
            ro.close()

    # -- writer thread ---------------------------------------------------------------------
    def _main(self) -> None:
        while True:
            try:
                first = self.queue.get(timeout=1.0)
            except queue.Empty:
                self._maybe_retention()
                continue
            if first is None:
                self._drain_remaining()
                return
            group = [first]
            until = time.monotonic() + self.min_group_seconds if self.min_group_seconds > 0 else 0.0
            while len(group) < self.max_group:
                try:
                    if until:   # a store that pays per write gathers its group a little longer
                        item = self.queue.get(timeout=max(0.0, until - time.monotonic()))
                    else:
                        item = self.queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._write_group(group)
                    self._drain_remaining()
                    return
                group.append(item)
            self._write_group(group)
            self._maybe_retention()

    def _drain_remaining(self) -> None:
        group = []
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                group.append(item)
        if group:
            self._write_group(group)

    def _write_group(self, group: list) -> None:
        outcomes: list[tuple[BatchJob, str, int, str]] = []
        conn = self.conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            updates: dict[str, dict] = {}
            imports = []
            jobs: list[tuple[StoreJob, str, str]] = []
            for item in group:
                if isinstance(item, StoreJob):
                    jobs.append((item, *self._apply_job(item)))
                elif isinstance(item, AgentUpdate):
                    updates.setdefault(item.agent_id, {}).update(item.fields)
                elif isinstance(item, ImportJob):
                    self._append(None, "flows", FLOW_COLS,
                                 [("", *row[:8], 0, f"import:{item.origin}", row[8]) for row in item.rows])
                    imports.append(item)
                else:
                    outcomes.append((item, *self._write_batch(item)))
            for agent_id, fields in updates.items():
                self._update_agent(agent_id, fields)
            self._flush_series()
            self._before_commit()
            conn.execute("COMMIT")
            self.commits += 1
        except (sqlite3.Error, BackendError) as exc:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            self.failures += 1
            self.last_error = f"store write failed: {exc}"
            log.error("%s; %d batches left unacknowledged", self.last_error, len(outcomes))
            self._series.clear()
            self._last_seq.clear()
            self._on_failure()
            for item in group:
                if isinstance(item, (BatchJob, ImportJob, StoreJob)):
                    item.done("failed", 0, self.last_error)
            return
        for sj, outcome, note in jobs:
            sj.done(outcome, sj.result, note)
        late = self._after_commit()
        if late:   # the telemetry store failed after the state committed: the agents resend
            self.failures += 1
            self.last_error = f"store write failed: {late}"
            log.error("%s; %d batches left unacknowledged", self.last_error, len(outcomes))
            self._last_seq.clear()
            self._on_failure()
            for item in [*imports, *(o[0] for o in outcomes)]:
                item.done("failed", 0, self.last_error)
            return
        for imp in imports:
            imp.done("stored", len(imp.rows), "")
        for job, outcome, rejected, note in outcomes:
            if outcome == "stored":
                self.batches_written += 1
            job.done(outcome, rejected, note)

    def _apply_job(self, job: StoreJob) -> tuple[str, str]:
        conn = self.conn
        conn.execute("SAVEPOINT store_job")
        try:
            job.result = job.apply(conn) or 0
        except Exception as exc:  # its own writes are undone; a store failure still fails the whole group
            conn.execute("ROLLBACK TO store_job")
            conn.execute("RELEASE store_job")
            if isinstance(exc, sqlite3.OperationalError):
                raise
            log.warning("store job failed: %s: %s", type(exc).__name__, exc)
            return "failed", f"{type(exc).__name__}: {exc}"
        conn.execute("RELEASE store_job")
        return "stored", ""

    def heartbeat(self, collector_id: str, address: str, started_ns: int, now_ns: int) -> bool:
        """The collector's heartbeat row (analysis/ownership.py), written in the next group; False when the queue
        is full (the next heartbeat tries again)."""
        row = (collector_id, address, int(started_ns), int(now_ns))
        return self.submit(StoreJob(lambda conn: self._heartbeat_rows(conn, row), lambda *_: None))

    def _heartbeat_rows(self, conn, row: tuple) -> int:
        conn.execute("INSERT INTO collectors(id, address, started_ns, heartbeat_ns) VALUES (?, ?, ?, ?)"
                     " ON CONFLICT(id) DO UPDATE SET address = excluded.address, started_ns = excluded.started_ns,"
                     " heartbeat_ns = MAX(heartbeat_ns, excluded.heartbeat_ns)", row)
        return 1

    def _committed_seq(self, key: tuple[str, str]) -> int:
        seq = self._last_seq.get(key)
        if seq is None:
            row = self.conn.execute("SELECT MAX(seq) FROM batches WHERE agent_id=? AND spool_id=?", key).fetchone()
            seq = row[0] or 0
            self._last_seq[key] = seq
        return seq

    def _write_batch(self, job: BatchJob) -> tuple[str, int, str]:
        conn = self.conn
        key = (job.agent_id, job.spool_id)
        if job.seq <= self._committed_seq(key):
            conn.execute("UPDATE agents SET batches_duplicate = batches_duplicate + 1 WHERE agent_id=?",
                         (job.agent_id,))
            return "duplicate", 0, "duplicate batch ignored"
        try:
            dec = decode_batch(job.payload, job.n_records, job.sent_mono_ns)
        except BatchRejected as exc:
            reason = str(exc)
            self._append(job, "rejections", REJECTION_COLS,
                         [(job.agent_id, job.received_ns, job.spool_id, job.seq, reason, job.n_records)])
            self._record_batch(job, 0, job.n_records)
            return "rejected", job.n_records, reason
        to_cluster = job.clock.to_cluster
        rejected = dec.rejected
        append = self._append
        # metrics: series lookup, forward-in-time check, cluster time
        rows = []
        series = self._series
        agent = job.agent_id
        metric_row = self._metric_row
        for mono, name, entity, value in dec.metrics:
            s = series.get((agent, name, entity))
            if s is None:
                s = self._load_series(agent, name, entity)
            if s[1] is not None and mono <= s[1]:
                rejected["non-monotonic time within a series"] += 1
                continue
            ts = to_cluster(mono)
            rows.append(metric_row(s, agent, name, entity, ts, value))   # before s moves on: a hook may keep it
            s[1], s[2], s[3], s[4] = mono, ts, value, True
        if rows:
            append(job, "metrics", METRIC_COLS, rows)
        for mono, g in dec.gpus:
            ts = to_cluster(mono)
            conn.execute(
                "INSERT INTO gpus(agent_id, uuid, gpu_index, name, pci_bus_id, memory_total_bytes, driver_version,"
                " cuda_driver_version, nvlink_count, serial, first_seen_ns, last_seen_ns)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT(agent_id, uuid) DO UPDATE SET gpu_index=excluded.gpu_index,"
                " name=excluded.name, pci_bus_id=excluded.pci_bus_id, memory_total_bytes=excluded.memory_total_bytes,"
                " driver_version=excluded.driver_version, cuda_driver_version=excluded.cuda_driver_version,"
                " nvlink_count=excluded.nvlink_count, serial=excluded.serial, last_seen_ns=excluded.last_seen_ns",
                (agent, g.uuid, g.index, g.name, g.pci_bus_id, g.memory_total_bytes, g.driver_version,
                 g.cuda_driver_version, g.nvlink_count, g.serial, ts, ts))
        for mono, p in dec.processes:
            row = process_row(p)
            row.update(agent_id=agent, started_ns=to_cluster(mono), exited_ns=None)
            cols = ",".join(row)
            conn.execute(f"INSERT INTO processes({cols}) VALUES ({','.join('?' * len(row))})"
                         " ON CONFLICT(agent_id, pid, start_ticks) DO UPDATE SET exited_ns=NULL,"
                         " job_key=excluded.job_key, rank=excluded.rank, env_json=excluded.env_json",
                         list(row.values()))
        for mono, pid, start_ticks in dec.exits:
            conn.execute("UPDATE processes SET exited_ns=? WHERE agent_id=? AND pid=? AND start_ticks=?",
                         (to_cluster(mono), agent, pid, start_ticks))
        events = [(agent, to_cluster(m), src, k, e, msg, v) for m, src, k, e, msg, v in dec.events]
        for mono, m in dec.modes:
            mode = MODE_NAMES.get(m.mode, "unknown")
            until = job.clock.to_cluster(m.until_mono_ns) if m.until_mono_ns else 0
            events.append((agent, to_cluster(mono), "agent", "mode", mode,
                           f"{mode} ({m.reason}) command {m.command_id}", until))
        if events:
            append(job, "events", EVENT_COLS, events)
        if dec.gaps:
            append(job, "gaps", GAP_COLS,
                   [(agent, job.spool_id, to_cluster(mono), src, g.dropped_records, g.dropped_batches, g.first_seq,
                     g.last_seq, g.reason) for mono, src, g in dec.gaps])
        if dec.stacks:
            append(job, "stack_summaries", STACK_COLS,
                   [(agent, to_cluster(st.start_mono_ns), to_cluster(m), st.pid, st.start_ticks, st.tid,
                     st.thread_name, st.python, st.samples, st.errors, st.last_state, stacks_json(st))
                    for m, st in dec.stacks])
        if dec.flows:
            append(job, "flows", FLOW_COLS,
                   [(agent, to_cluster(f.start_mono_ns), to_cluster(m), f.src, f.sport, f.dst, f.dport, f.bytes,
                     f.packets, f.pid, "ebpf", "[]") for m, f in dec.flows])
        if dec.conns:
            append(job, "conn_stats", CONN_COLS,
                   [(agent, to_cluster(c.start_mono_ns), to_cluster(m), c.src, c.sport, c.dst, c.dport, c.tx_bytes,
                     c.rx_bytes, c.tx_packets, c.rx_packets, c.tx_payload_bytes, c.rx_payload_bytes, c.retransmits,
                     c.srtt_us, c.pid, c.comm, src, c.net_limited_us) for m, c, src in dec.conns])
        if dec.comm_summaries:
            append(job, "comm_summaries", COMM_SUMMARY_COLS,
                   [(agent, to_cluster(c.start_mono_ns), to_cluster(m), c.pid, c.start_ticks, c.job_key, c.rank,
                     c.comm_id, c.op, c.step, c.calls, c.bytes, c.busy_ns, c.max_ns, c.seq_first, c.seq_last,
                     c.timing, src, c.issue_latency_ns_sum, c.kernels) for m, src, c in dec.comm_summaries])
        if dec.comm_members:
            # a (comm, rank, host, pid) seen again (RAS and a log, several agents) keeps its newest report
            conn.executemany(
                "INSERT INTO comm_members(comm_id, rank, nranks, host, pid, cuda_dev, nvml_dev, bus_id, global_rank,"
                " job_key, via, agent_id, seen_ns) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)"
                " ON CONFLICT(comm_id, rank, host, pid) DO UPDATE SET nranks=excluded.nranks,"
                " cuda_dev=excluded.cuda_dev, nvml_dev=excluded.nvml_dev, bus_id=excluded.bus_id,"
                " global_rank=MAX(comm_members.global_rank, excluded.global_rank),"
                " job_key=CASE WHEN excluded.job_key != '' THEN excluded.job_key ELSE comm_members.job_key END,"
                " via=excluded.via, agent_id=excluded.agent_id, seen_ns=MAX(comm_members.seen_ns, excluded.seen_ns)",
                [(c.comm_id, c.rank, c.nranks, c.host, c.pid, c.cuda_dev, c.nvml_dev, c.bus_id, c.global_rank,
                  c.job_key, c.via, agent, to_cluster(m)) for m, c in dec.comm_members])
        if dec.comm_progress:
            append(job, "comm_progress", COMM_PROGRESS_COLS,
                   [(agent, to_cluster(m), c.pid, c.start_ticks, c.job_key, c.rank, c.comm_id, c.last_enqueued,
                     c.last_started, c.last_completed, c.pending_op, c.pending_seq, int(c.pending_p2p),
                     c.pending_peer, to_cluster(c.pending_since_mono_ns) if c.pending_since_mono_ns else 0,
                     c.nranks) for m, c in dec.comm_progress])
        if dec.steps:
            append(job, "steps", STEP_COLS,
                   [(agent, src, st.pid, st.start_ticks, st.job_key, st.rank, st.step, to_cluster(st.start_mono_ns),
                     to_cluster(st.end_mono_ns), st.evidence, st.period_ops, st.ops, step_comms_json(st))
                    for m, src, st in dec.steps])
        if dec.iterations:
            append(job, "iterations", ITERATION_COLS,
                   [(agent, it.pid, it.start_ticks, it.job_key, it.rank, it.seq, to_cluster(it.start_mono_ns),
                     to_cluster(it.end_mono_ns), it.anchor, it.phase, it.batch_size, it.prefill_requests,
                     it.prefill_tokens, it.decode_requests, it.kv_tokens, it.input_tokens, it.output_tokens,
                     it.tokens, it.micro_batches) for m, it in dec.iterations])
        n_rej = sum(rejected.values())
        if rejected:
            append(job, "rejections", REJECTION_COLS,
                   [(agent, job.received_ns, job.spool_id, job.seq, reason, count)
                    for reason, count in rejected.items()])
        self._record_batch(job, job.n_records - n_rej, n_rej)
        self.rows_written += len(rows)
        self.records_written += job.n_records - n_rej
        note = "; ".join(f"{c} x {r}" for r, c in rejected.items())
        return "stored", n_rej, note

    # hooks of a store that keeps its append-only tables elsewhere (clickhouse.ClickHouseWriter)
    def _before_commit(self) -> None:
        """Before the state's COMMIT; raising BackendError rolls the group back."""

    def _after_commit(self) -> str:
        """After it: '' when the group is durable, else why not (its batches and imports then fail)."""
        return ""

    def _on_failure(self) -> None:
        """After a failed group: undo what the group left behind."""

    def _append(self, job: BatchJob | None, table: str, cols: tuple, rows: list) -> None:
        """Rows for an append-only table (job: the batch they came from; None for an import). metrics is keyed by
        (series_id, ts_ns): a sample whose cluster time equals the previous one's (a clock estimate moved back)
        replaces it."""
        verb = "INSERT OR REPLACE" if table == "metrics" else "INSERT"
        self.conn.executemany(f"{verb} INTO {table}({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})", rows)

    def _metric_row(self, s: list, agent: str, name: str, entity: str, ts: int, value: float) -> tuple:
        return (s[0], ts, value)

    def _record_batch(self, job: BatchJob, stored: int, rejected: int) -> None:
        conn = self.conn
        self._append(job, "batches", BATCH_COLS, [(job.agent_id, job.spool_id, job.seq, job.n_records, rejected,
                                                   len(job.payload), job.received_ns, job.clock.offset_ns,
                                                   job.clock.uncertainty_ns)])
        cur = conn.execute("UPDATE agents SET records_stored = records_stored + ?, records_rejected = records_rejected + ?,"
                           " batches_stored = batches_stored + 1, last_seen_ns = ? WHERE agent_id=?",
                           (stored, rejected, job.received_ns, job.agent_id))
        if cur.rowcount == 0:
            conn.execute("INSERT INTO agents(agent_id, first_seen_ns, last_seen_ns, records_stored, records_rejected,"
                         " batches_stored) VALUES (?,?,?,?,?,1)",
                         (job.agent_id, job.received_ns, job.received_ns, stored, rejected))
        self._last_seq[(job.agent_id, job.spool_id)] = job.seq

    def _load_series(self, agent: str, name: str, entity: str) -> list:
        row = self.conn.execute("SELECT id, last_mono_ns, last_ts_ns, last_value FROM series"
                                " WHERE agent_id=? AND name=? AND entity=?", (agent, name, entity)).fetchone()
        if row is None:
            cur = self.conn.execute("INSERT INTO series(agent_id, name, entity) VALUES (?,?,?)", (agent, name, entity))
            s = [cur.lastrowid, None, None, None, False]
        else:
            s = [row[0], row[1], row[2], row[3], False]
        self._series[(agent, name, entity)] = s
        return s

    def _flush_series(self) -> None:
        dirty = [(s[1], s[2], s[3], s[0]) for s in self._series.values() if s[4]]
        if dirty:
            self.conn.executemany("UPDATE series SET last_mono_ns=?, last_ts_ns=?, last_value=? WHERE id=?", dirty)
            for s in self._series.values():
                s[4] = False

    def _update_agent(self, agent_id: str, fields: dict) -> None:
        fields = dict(fields)
        if "sources" in fields:
            fields["sources_json"] = json.dumps(fields.pop("sources"), sort_keys=True)
        fields.setdefault("last_seen_ns", self.now_ns())
        held = ""
        if fields.get("connected"):   # its stream is on this collector since now (store/replication.py)
            fields["collector_id"] = ""
            fields["connected_ns"] = fields["last_seen_ns"]
        elif "connected" in fields:   # a stream lost here: says nothing of an agent another collector holds now
            held = " AND collector_id = ''"
        cols = list(fields)
        cur = self.conn.execute(f"UPDATE agents SET {', '.join(c + '=?' for c in cols)} WHERE agent_id=?{held}",
                                [fields[c] for c in cols] + [agent_id])
        if cur.rowcount == 0 and held and self.conn.execute("SELECT 1 FROM agents WHERE agent_id=?",
                                                            (agent_id,)).fetchone():
            return
        if cur.rowcount == 0:
            fields.setdefault("first_seen_ns", fields["last_seen_ns"])
            cols = list(fields)
            self.conn.execute(f"INSERT INTO agents(agent_id, {', '.join(cols)}) VALUES (?{', ?' * len(cols)})",
                              [agent_id] + [fields[c] for c in cols])

    def _maybe_retention(self) -> None:
        if time.monotonic() < self._next_retention or self.retention_ns <= 0:
            return
        self._next_retention = time.monotonic() + self.retention_check_seconds
        self.apply_retention(self.now_ns() - self.retention_ns)

    def apply_retention(self, cutoff_ns: int) -> int:
        """Delete everything older than cutoff_ns, one series at a time (short transactions)."""
        deleted = 0
        ids = [r[0] for r in self.conn.execute("SELECT id FROM series").fetchall()]
        try:
            for i in range(0, len(ids), 200):
                self.conn.execute("BEGIN IMMEDIATE")
                for sid in ids[i:i + 200]:
                    deleted += self.conn.execute("DELETE FROM metrics WHERE series_id=? AND ts_ns < ?",
                                                 (sid, cutoff_ns)).rowcount
                self.conn.execute("COMMIT")
            self.conn.execute("BEGIN IMMEDIATE")
            deleted += self.conn.execute("DELETE FROM stack_summaries WHERE end_ns < ?", (cutoff_ns,)).rowcount
            deleted += self.conn.execute("DELETE FROM flows WHERE end_ns < ?", (cutoff_ns,)).rowcount
            deleted += self.conn.execute("DELETE FROM conn_stats WHERE end_ns < ?", (cutoff_ns,)).rowcount
            deleted += self.conn.execute("DELETE FROM comm_summaries WHERE end_ns < ?", (cutoff_ns,)).rowcount
            deleted += self.conn.execute("DELETE FROM steps WHERE end_ns < ?", (cutoff_ns,)).rowcount
            deleted += self.conn.execute("DELETE FROM iterations WHERE end_ns < ?", (cutoff_ns,)).rowcount
            deleted += self.conn.execute("DELETE FROM comm_progress WHERE end_ns < ?", (cutoff_ns,)).rowcount
            for table in ("events", "gaps", "rejections"):
                deleted += self.conn.execute(f"DELETE FROM {table} WHERE ts_ns < ?", (cutoff_ns,)).rowcount
            deleted += self.conn.execute("DELETE FROM batches WHERE received_ns < ? AND seq < ("
                                         "SELECT MAX(seq) FROM batches b2 WHERE b2.agent_id = batches.agent_id"
                                         " AND b2.spool_id = batches.spool_id)", (cutoff_ns,)).rowcount
            deleted += self.conn.execute("DELETE FROM processes WHERE exited_ns IS NOT NULL AND exited_ns < ?",
                                         (cutoff_ns,)).rowcount
            deleted += self.conn.execute("DELETE FROM findings WHERE status != 'open' AND updated_ns < ?",
                                         (cutoff_ns,)).rowcount
            deleted += self.conn.execute("DELETE FROM deep_dives WHERE updated_ns < ?", (cutoff_ns,)).rowcount
            self.conn.execute("COMMIT")
        except sqlite3.Error as exc:
            try:
                self.conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            log.error("retention failed: %s", exc)
        return deleted
