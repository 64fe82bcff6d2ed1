"""Read-side queries behind the Control API and the CLI; each opens its own read-only connection
(WAL lets readers run beside the writer without blocking it)."""

from __future__ import annotations

import json

from steplens.collector.store import schema
from steplens.collector.store.diagnosis import DiagnosisQueries

# per-process metric names emitted by the host source, shown by `steplens procs`
PROC_CPU = "process_cpu_percent"
PROC_RSS = "process_resident_memory_bytes"
PROC_THREADS = "process_threads"

_PROGRESS_KEYS = ("node_id", "pid", "start_ticks", "job_key", "rank", "comm_id", "end_ns", "last_enqueued",
                  "last_started", "last_completed", "pending_op", "pending_seq", "pending_p2p", "pending_peer",
                  "pending_since_ns", "nranks")
_PROGRESS_COLS = ", ".join("agent_id" if k == "node_id" else k for k in _PROGRESS_KEYS)


def _progress_row(row) -> dict:
    d = dict(zip(_PROGRESS_KEYS, row))
    d["pending_p2p"] = bool(d["pending_p2p"])
    return d


def stack_row(r) -> dict:
    """A stack_summaries row (columns by name) as the readers answer it."""
    return {"node_id": r["agent_id"], "pid": r["pid"], "start_ticks": r["start_ticks"], "tid": r["tid"],
            "thread_name": r["thread_name"], "python": r["python"], "start_ns": r["start_ns"], "end_ns": r["end_ns"],
            "samples": r["samples"], "errors": r["errors"], "last_state": r["last_state"],
            "stacks": json.loads(r["stacks_json"])}


class Reader(DiagnosisQueries):
    def __init__(self, path: str) -> None:
        self.path = path

    def _db(self):
        return schema.connect(self.path, readonly=True)

    def nodes(self, node_id: str = "") -> list[dict]:
        db = self._db()
        try:
            where, args = ("WHERE a.agent_id = ?", [node_id]) if node_id else ("", [])
            rows = list(db.query(
                f"""SELECT a.*, (SELECT COUNT(*) FROM gaps g WHERE g.agent_id = a.agent_id) AS gaps
                    FROM agents a {where} ORDER BY a.agent_id""", args))
        finally:
            db.conn.close()
        out = []
        for r in rows:
            sources = json.loads(r.get("sources_json") or "{}")
            out.append({
                "node_id": r["agent_id"], "hostname": r["hostname"] or "", "agent_version": r["agent_version"] or "",
                "connected": bool(r["connected"]), "peer": r["peer"] or "",
                # the collector that holds its stream, when another on a shared store ('' : this one)
                "collector": r.get("collector_id") or "",
                "first_seen_ns": r["first_seen_ns"] or 0, "last_seen_ns": r["last_seen_ns"] or 0,
                "clock_offset_ns": r["clock_offset_ns"] or 0, "clock_uncertainty_ns": r["clock_uncertainty_ns"] or 0,
                "clock_drift_ppm": r["clock_drift_ppm"] or 0.0, "clock_rtt_ns": r["clock_rtt_ns"] or 0,
                "clock_samples": r["clock_samples"] or 0,
                "sources": {n: {"up": bool(s.get("up")), "reason": s.get("reason", ""),
                                "last_duration_seconds": s.get("last_duration_seconds", 0.0),
                                "errors": s.get("errors", 0), "cpu_cores": s.get("cpu_cores", 0.0),
                                "rate_scale": s.get("rate_scale", 1.0)} for n, s in sorted(sources.items())},
                "spool_backlog": r["spool_backlog"], "records_produced": r["records_produced"],
                "records_acked": r["records_acked"], "records_dropped": r["records_dropped"],
                "records_stored": r["records_stored"], "records_rejected": r["records_rejected"],
                "batches_stored": r["batches_stored"], "batches_duplicate": r["batches_duplicate"],
                "gaps": r["gaps"], "mode": r["mode"], "mode_until_ns": r["mode_until_ns"] or 0,
                "agent_cpu_cores": r["agent_cpu_cores"] or 0.0, "cpu_budget_cores": r["cpu_budget_cores"] or 0.0,
            })
        return out

    def gpus(self, node_id: str = "") -> list[dict]:
        db = self._db()
        try:
            where, args = ("WHERE agent_id = ?", [node_id]) if node_id else ("", [])
            gpus = list(db.query(f"SELECT * FROM gpus {where} ORDER BY agent_id, gpu_index", args))
            out = []
            for g in gpus:
                latest = list(db.query(
                    "SELECT name, last_value AS value, last_ts_ns AS ts_ns FROM series WHERE agent_id=? AND entity=?"
                    " AND last_ts_ns IS NOT NULL ORDER BY name", [g["agent_id"], f"gpu{g['gpu_index']}"]))
                out.append({"node_id": g["agent_id"], "index": g["gpu_index"], "uuid": g["uuid"], "name": g["name"],
                            "pci_bus_id": g["pci_bus_id"], "memory_total_bytes": g["memory_total_bytes"],
                            "driver_version": g["driver_version"], "last_seen_ns": g["last_seen_ns"],
                            "latest": {m["name"]: {"value": m["value"], "ts_ns": m["ts_ns"]} for m in latest}})
            return out
        finally:
            db.conn.close()

    def procs(self, node_id: str = "", alive_only: bool = False) -> list[dict]:
        db = self._db()
        try:
            cond, args = [], []
            if node_id:
                cond.append("p.agent_id = ?")
                args.append(node_id)
            if alive_only:
                cond.append("p.exited_ns IS NULL")
            where = ("WHERE " + " AND ".join(cond)) if cond else ""
            rows = list(db.query(f"""
                SELECT p.*,
                  (SELECT last_value FROM series s WHERE s.agent_id = p.agent_id AND s.name = '{PROC_CPU}'
                     AND s.entity = 'pid:' || p.pid || ':' || p.start_ticks) AS cpu_percent,
                  (SELECT last_value FROM series s WHERE s.agent_id = p.agent_id AND s.name = '{PROC_RSS}'
                     AND s.entity = 'pid:' || p.pid || ':' || p.start_ticks) AS rss_bytes,
                  (SELECT last_value FROM series s WHERE s.agent_id = p.agent_id AND s.name = '{PROC_THREADS}'
                     AND s.entity = 'pid:' || p.pid || ':' || p.start_ticks) AS threads
                FROM processes p {where} ORDER BY p.job_key, p.rank, p.agent_id, p.pid""", args))
        finally:
            db.conn.close()
        out = []
        for r in rows:
            out.append({"node_id": r["agent_id"], "pid": r["pid"], "start_ticks": r["start_ticks"], "exe": r["exe"],
                        "cmdline": " ".join(json.loads(r["cmdline"] or "[]")), "framework": r["framework"],
                        "job_key": r["job_key"], "rank": r["rank"], "local_rank": r["local_rank"],
                        "world_size": r["world_size"], "master_addr": r["master_addr"],
                        "master_port": r["master_port"], "started_ns": r["started_ns"] or 0,
                        "exited_ns": r["exited_ns"] or 0, "alive": r["exited_ns"] is None,
                        "cpu_percent": r["cpu_percent"] or 0.0, "rss_bytes": int(r["rss_bytes"] or 0),
                        "threads": int(r["threads"] or 0)})
        return out

    def comm_summaries(self, job_key: str, ranks: list[int] | None = None, since_ns: int = 0,
                       limit: int = 5000) -> list[dict]:
        """The newest `limit` CommSummary rows of a job (optionally some ranks), oldest first."""
        db = self._db()
        try:
            cond, args = ["job_key = ?", "end_ns >= ?"], [job_key, since_ns]
            if ranks:
                cond.append("rank IN (%s)" % ",".join("?" * len(ranks)))
                args += list(ranks)
            rows = list(db.query(f"SELECT * FROM comm_summaries WHERE {' AND '.join(cond)} ORDER BY end_ns DESC"
                                 f" LIMIT ?", args + [limit]))
        finally:
            db.conn.close()
        return [dict(r, node_id=r.pop("agent_id")) for r in reversed(rows)]

    def comm_progress(self, job_key: str, since_ns: int = 0, until_ns: int = 0, ranks: list[int] | None = None,
                      limit: int = 200_000) -> list[dict]:
        """The newest `limit` CommProgress rows of a job with since_ns <= end_ns <= until_ns (0: no bound), optionally
        of some ranks, oldest first: {node_id, pid, start_ticks, job_key, rank, comm_id, end_ns, last_enqueued,
        last_started, last_completed, pending_op, pending_seq, pending_p2p, pending_peer, pending_since_ns, nranks}
        (end_ns: when the state was read; pending_since_ns 0: none or unknown; cluster times)."""
        cond, args = ["job_key = ?", "end_ns >= ?"], [job_key, since_ns]
        if until_ns:
            cond.append("end_ns <= ?")
            args.append(until_ns)
        if ranks:
            cond.append("rank IN (%s)" % ",".join("?" * len(ranks)))
            args += list(ranks)
        db = self._db()
        try:
            rows = db.conn.execute(f"SELECT {_PROGRESS_COLS} FROM comm_progress WHERE {' AND '.join(cond)}"
                                   " ORDER BY end_ns DESC, rowid DESC LIMIT ?", args + [limit]).fetchall()
        finally:
            db.conn.close()
        return [_progress_row(r) for r in reversed(rows)]

    def comm_progress_latest(self, job_key: str, until_ns: int = 0) -> list[dict]:
        """Per (node_id, pid, comm_id) of a job, its newest CommProgress row with end_ns <= until_ns (0: no bound),
        as comm_progress() has them, ordered by rank, comm_id, node_id, pid."""
        db = self._db()
        try:
            # SQLite's bare-column rule: with MAX() the other columns come from the row holding the maximum
            rows = db.conn.execute(
                f"SELECT {_PROGRESS_COLS}, MAX(end_ns) FROM comm_progress WHERE job_key = ? AND end_ns <= ?"
                " GROUP BY agent_id, pid, comm_id", (job_key, until_ns or (1 << 63) - 1)).fetchall()
        finally:
            db.conn.close()
        out = [_progress_row(r[:-1]) for r in rows]
        out.sort(key=lambda r: (r["rank"], r["comm_id"], r["node_id"], r["pid"]))
        return out

    def comms(self, job_key: str = "", comm_id: str = "") -> list[dict]:
        """Communicator members, newest report per (comm, rank, host, pid). A job filter keeps whole
        communicators that have at least one member of the job (members on other hosts may carry no job)."""
        db = self._db()
        try:
            if job_key:
                rows = list(db.query("SELECT * FROM comm_members WHERE comm_id IN (SELECT comm_id FROM comm_members"
                                     " WHERE job_key = ?) AND (? = '' OR comm_id = ?) ORDER BY comm_id, rank, seen_ns",
                                     [job_key, comm_id, comm_id]))
            else:
                rows = list(db.query("SELECT * FROM comm_members WHERE (? = '' OR comm_id = ?)"
                                     " ORDER BY comm_id, rank, seen_ns", [comm_id, comm_id]))
        finally:
            db.conn.close()
        return [dict(r, node_id=r["agent_id"]) for r in rows]

    def gaps(self, node_id: str = "") -> list[dict]:
        db = self._db()
        try:
            where, args = ("WHERE agent_id = ?", [node_id]) if node_id else ("", [])
            return [{"node_id": r["agent_id"], "ts_ns": r["ts_ns"], "dropped_records": r["dropped_records"],
                     "dropped_batches": r["dropped_batches"], "first_seq": r["first_seq"], "last_seq": r["last_seq"],
                     "reason": r["reason"]}
                    for r in db.query(f"SELECT * FROM gaps {where} ORDER BY ts_ns", args)]
        finally:
            db.conn.close()

    def stacks(self, node_id: str = "", pid: int = 0, since_ns: int = 0, limit: int = 200) -> list[dict]:
        """Stack summaries, newest first: one row per thread and interval."""
        db = self._db()
        try:
            cond, args = ["end_ns >= ?"], [since_ns]
            if node_id:
                cond.append("agent_id = ?")
                args.append(node_id)
            if pid:
                cond.append("pid = ?")
                args.append(pid)
            rows = list(db.query(f"SELECT * FROM stack_summaries WHERE {' AND '.join(cond)}"
                                 f" ORDER BY end_ns DESC, pid, tid LIMIT ?", args + [limit]))
        finally:
            db.conn.close()
        return [stack_row(r) for r in rows]

    def flows(self, since_ns: int = 0, by: str = "pair", node_id: str = "", limit: int = 1000) -> list[dict]:
        """Flows aggregated per (src, dst) address pair, or per connection (with ports)."""
        if by not in ("pair", "connection"):
            raise ValueError("by is 'pair' or 'connection'")
        keys = "src, dst" if by == "pair" else "src, sport, dst, dport"
        db = self._db()
        try:
            cond, args = ["end_ns >= ?"], [since_ns]
            if node_id:
                cond.append("agent_id = ?")
                args.append(node_id)
            rows = list(db.query(
                f"SELECT {keys}, SUM(bytes) AS bytes, SUM(packets) AS packets, COUNT(*) AS flows,"
                f" MIN(start_ns) AS first_ns, MAX(end_ns) AS last_ns, GROUP_CONCAT(DISTINCT origin) AS origins"
                f" FROM flows WHERE {' AND '.join(cond)} GROUP BY {keys} ORDER BY bytes DESC LIMIT ?",
                args + [limit]))
        finally:
            db.conn.close()
        return [{**r, "origins": (r["origins"] or "").split(",")} for r in rows]
