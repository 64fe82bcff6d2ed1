"""Store side of diagnosis: findings and topologies written in the writer thread, read for Control and the CLI.

Writes are functions of a sqlite3 connection run inside the store writer's transaction (writer.StoreJob), so
a findings merge reads the stored findings and writes its changes atomically, and a topology import lands
whole or not at all. Reads are DiagnosisQueries, mixed into queries.Reader (one read-only connection per call).
Cost: findings and topologies are small tables; `jobs()` reads the newest 10 minutes of comm summaries per job
through the (job_key, end_ns) index.
"""

from __future__ import annotations

import json
import sqlite3

from steplens.collector.analysis.findings import Change, Finding, Suspect
from steplens.collector.topology import Topology, from_dict

JOB_COMMS_WINDOW_NS = 600 * 10**9
# per-job data: what makes the analysis loop run a job
DATA_TABLES = ("comm_summaries", "steps", "comm_progress", "iterations")
LISTED = ("open", "resolved")
PROCESS_STATE_EVENTS = ("process_stopped", "process_blocked", "process_zombie", "process_running")

_FCOLS = ("id, job_key, detector, kind, status, suspect_kind, suspect_id, onset_ns, last_ns, resolved_ns,"
          " first_seen_ns, severity, peak_severity, summary, suspects_json, evidence_json, confirmations,"
          " created_ns, updated_ns")


def finding_from_row(r) -> Finding:
    r = dict(r)
    return Finding(kind=r["kind"], onset_ns=r["onset_ns"], last_ns=r["last_ns"], severity=r["severity"],
                   summary=r["summary"], suspects=tuple(Suspect.from_json(s) for s in json.loads(r["suspects_json"])),
                   evidence=json.loads(r["evidence_json"]), job_key=r["job_key"], detector=r["detector"],
                   id=r["id"], status=r["status"], resolved_ns=r["resolved_ns"], peak_severity=r["peak_severity"],
                   confirmations=r["confirmations"], first_seen_ns=r["first_seen_ns"])


def _dict_rows(cur: sqlite3.Cursor) -> list[dict]:
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def live_findings(conn: sqlite3.Connection, job_key: str, detector: str) -> list[Finding]:
    """Pending and open findings of one job and detector (what findings.merge folds new output into)."""
    cur = conn.execute(f"SELECT {_FCOLS} FROM findings WHERE job_key=? AND detector=? AND status IN"
                       " ('pending', 'open')", (job_key, detector))
    return [finding_from_row(r) for r in _dict_rows(cur)]


def resolved_since(conn: sqlite3.Connection, job_key: str, detector: str, since_ns: int) -> list[Finding]:
    """Resolved findings of one job and detector whose span reaches since_ns or later (findings.merge: an output
    that is over and one of these already reported is not stored again)."""
    cur = conn.execute(f"SELECT {_FCOLS} FROM findings WHERE job_key=? AND detector=? AND status='resolved' AND"
                       " last_ns >= ?", (job_key, detector, since_ns))
    return [finding_from_row(r) for r in _dict_rows(cur)]


def write_changes(conn: sqlite3.Connection, changes: list[Change], now_ns: int) -> int:
    """Store the lifecycle's changes: insert new findings, update the others, delete dropped pending ones."""
    for ch in changes:
        f = ch.finding
        if ch.action == "dropped":
            conn.execute("DELETE FROM findings WHERE id=? AND status='pending'", (f.id,))
            continue
        top = f.suspects[0] if f.suspects else None
        conn.execute(
            f"INSERT INTO findings({_FCOLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
            " ON CONFLICT(id) DO UPDATE SET status=excluded.status, onset_ns=excluded.onset_ns,"
            " last_ns=excluded.last_ns, resolved_ns=excluded.resolved_ns, severity=excluded.severity,"
            " peak_severity=excluded.peak_severity, summary=excluded.summary, suspects_json=excluded.suspects_json,"
            " evidence_json=excluded.evidence_json, confirmations=excluded.confirmations,"
            " updated_ns=excluded.updated_ns",
            (f.id, f.job_key, f.detector, f.kind, f.status, top.kind if top else "", top.id if top else "",
             f.onset_ns, f.last_ns, f.resolved_ns, f.first_seen_ns, f.severity, max(f.peak_severity, f.severity),
             f.summary, json.dumps([s.to_json() for s in f.suspects]), json.dumps(f.evidence), f.confirmations,
             now_ns, now_ns))
    return len(changes)


def write_topology(conn: sqlite3.Connection, topo: Topology, origin: str, now_ns: int) -> int:
    """Store a validated topology as the new current version; returns the version number."""
    c = topo.counts()
    cur = conn.execute("INSERT INTO topologies(origin, imported_ns, digest, name, nodes, gpus, nics, switches,"
                       " links, doc_json) VALUES (?,?,?,?,?,?,?,?,?,?)",
                       (origin, now_ns, topo.digest(), topo.name, c["nodes"], c["gpus"], c["nics"], c["switches"],
                        c["links"], json.dumps(topo.to_dict())))
    return cur.lastrowid


_DCOLS = ("command_id, job_key, finding_id, trigger, requested_ns, start_ns, duration_ns, reference_since_ns,"
          " reference_until_ns, nodes_json, ranks_json, status, note, result_json, updated_ns")


def write_deep_dive(conn: sqlite3.Connection, d: dict, now_ns: int) -> int:
    """Insert or update one deep dive (analysis/deepdive.py's DeepDive.row())."""
    conn.execute(f"INSERT INTO deep_dives({_DCOLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT(command_id)"
                 " DO UPDATE SET finding_id=excluded.finding_id, status=excluded.status, note=excluded.note,"
                 " result_json=excluded.result_json, updated_ns=excluded.updated_ns",
                 (d["command_id"], d["job_key"], d["finding_id"], d["trigger"], d["requested_ns"], d["start_ns"],
                  d["duration_ns"], d["reference_since_ns"], d["reference_until_ns"], json.dumps(d["nodes"]),
                  json.dumps(d["ranks"]), d["status"], d["note"], json.dumps(d.get("result") or {}), now_ns))
    return 1


def deep_dive_json(r: dict) -> dict:
    """A stored deep dive as the `deep_dive` of a finding's JSON (and `steplens deep list --json`)."""
    res = json.loads(r["result_json"] or "{}")
    return {"command_id": r["command_id"], "job_key": r["job_key"], "finding_id": r["finding_id"],
            "trigger": r["trigger"], "requested_ns": r["requested_ns"], "start_ns": r["start_ns"],
            "duration_ns": r["duration_ns"], "reference_since_ns": r["reference_since_ns"],
            "reference_until_ns": r["reference_until_ns"], "nodes": json.loads(r["nodes_json"]),
            "ranks": json.loads(r["ranks_json"]), "status": r["status"], "note": r["note"],
            "causes": res.get("causes", []), "started": res.get("started", {}),
            "start_spread_ns": res.get("start_spread_ns"), "data": res.get("data", {})}


def process_event_rows(rows) -> list[dict]:
    """(agent_id, ts_ns, kind, entity "pid:start_ticks", message, value) rows as process-state events; rows whose
    entity names no process are left out."""
    out = []
    for agent, ts, kind, entity, message, value in rows:
        pid, _, ticks = (entity or "").partition(":")
        if not pid.isdigit() or not ticks.isdigit():
            continue
        out.append({"node_id": agent, "ts_ns": ts, "kind": kind, "pid": int(pid), "start_ticks": int(ticks),
                    "message": message or "", "value": value or 0.0})
    return out


class DiagnosisQueries:
    """Read side; mixed into queries.Reader, whose _db() opens a read-only connection."""

    def findings(self, job_key: str = "", since_ns: int = 0, open_only: bool = False, limit: int = 1000,
                 ids: list[str] | None = None) -> list[Finding]:
        """Open and resolved findings (never pending ones), newest activity first."""
        cond, args = ["status IN ('open', 'resolved')", "last_ns >= ?"], [since_ns]
        if job_key:
            cond.append("job_key = ?")
            args.append(job_key)
        if open_only:
            cond.append("status = 'open'")
        if ids is not None:
            cond.append("id IN (%s)" % ",".join("?" * len(ids)))
            args += list(ids)
        db = self._db()
        try:
            cur = db.conn.execute(f"SELECT {_FCOLS} FROM findings WHERE {' AND '.join(cond)}"
                                  " ORDER BY status = 'open' DESC, last_ns DESC, severity DESC LIMIT ?", args + [limit])
            return [finding_from_row(r) for r in _dict_rows(cur)]
        finally:
            db.conn.close()

    def deep_dives(self, job_key: str = "", finding_ids: list[str] | None = None, command_id: str = "",
                   limit: int = 100) -> list[dict]:
        """Deep dives, newest first, as deep_dive_json() objects."""
        cond, args = ["1=1"], []
        if job_key:
            cond.append("job_key = ?")
            args.append(job_key)
        if command_id:
            cond.append("command_id = ?")
            args.append(command_id)
        if finding_ids is not None:
            if not finding_ids:
                return []
            cond.append("finding_id IN (%s)" % ",".join("?" * len(finding_ids)))
            args += list(finding_ids)
        db = self._db()
        try:
            cur = db.conn.execute(f"SELECT {_DCOLS} FROM deep_dives WHERE {' AND '.join(cond)}"
                                  " ORDER BY start_ns DESC LIMIT ?", args + [limit])
            return [deep_dive_json(r) for r in _dict_rows(cur)]
        finally:
            db.conn.close()

    def deep_dives_for(self, findings: list) -> dict:
        """finding id -> the deep dive that observed it: the newest one it started, else the newest one of its job
        whose window overlaps the finding's span (a dive covers the whole job: a second finding that opened while
        one ran, in its cool-down, gets that one)."""
        out: dict = {}
        by_job: dict[str, list] = {}
        for f in findings:
            by_job.setdefault(f.job_key, []).append(f)
        for job, fs in by_job.items():
            dives = self.deep_dives(job_key=job, limit=200)
            for f in fs:
                own = [d for d in dives if d["finding_id"] == f.id]
                end = (f.resolved_ns or f.last_ns) + 2 * 10**9
                near = [d for d in dives if d["start_ns"] <= end and d["start_ns"] + d["duration_ns"] >= f.onset_ns]
                pick = (own or near)[:1]
                if pick:
                    out[f.id] = pick[0]
        return out

    def open_finding_counts(self) -> list[tuple[str, str, int]]:
        """(job_key, kind, open findings) for /metrics."""
        db = self._db()
        try:
            return db.conn.execute("SELECT job_key, kind, COUNT(*) FROM findings WHERE status = 'open'"
                                   " GROUP BY job_key, kind ORDER BY job_key, kind").fetchall()
        finally:
            db.conn.close()

    def topology_record(self) -> dict | None:
        """The current topology: {version, origin, imported_ns, digest, name, counts..., topology (Topology)}.
        The parsed Topology is kept while the newest version and digest stay the same (one small read per call):
        the analysis reads it every pass, and its path and downstream caches live on the object."""
        db = self._db()
        try:
            head = db.conn.execute("SELECT version, digest FROM topologies ORDER BY version DESC LIMIT 1").fetchone()
            kept = getattr(self, "_topology_kept", None)
            if head is None:
                return None
            if kept is not None and kept[0] == tuple(head):
                return dict(kept[1])
            rows = _dict_rows(db.conn.execute("SELECT * FROM topologies WHERE version = ?", (head[0],)))
        finally:
            db.conn.close()
        if not rows:
            return None
        r = rows[0]
        r["topology"] = from_dict(json.loads(r.pop("doc_json")))
        self._topology_kept = ((r["version"], r["digest"]), r)
        return dict(r)

    def process_events(self, since_ns: int = 0, until_ns: int = 0, node_ids: list[str] | None = None,
                       kinds: tuple[str, ...] = PROCESS_STATE_EVENTS, limit: int = 100_000) -> list[dict]:
        """The procs source's process-state Events (stopped, blocked, zombie, running again), oldest first:
        {node_id, ts_ns, kind, pid, start_ticks, message, value}; entity "pid:start_ticks" parsed (an entity
        that does not parse is skipped). until_ns 0: no upper bound."""
        cond, args = [f"kind IN ({','.join('?' * len(kinds))})", "ts_ns >= ?"], [*kinds, since_ns]
        if until_ns:
            cond.append("ts_ns <= ?")
            args.append(until_ns)
        if node_ids:
            cond.append(f"agent_id IN ({','.join('?' * len(node_ids))})")
            args += list(node_ids)
        db = self._db()
        try:
            rows = db.conn.execute(f"SELECT agent_id, ts_ns, kind, entity, message, value FROM events WHERE"
                                   f" {' AND '.join(cond)} ORDER BY ts_ns LIMIT ?", args + [limit]).fetchall()
        finally:
            db.conn.close()
        return process_event_rows(rows)

    def node_events(self, node_id: str, kinds: tuple[str, ...], since_ns: int = 0, until_ns: int = 0,
                    limit: int = 1000) -> list[dict]:
        """One node's Events of the given kinds in [since_ns, until_ns] (until 0: no bound), oldest first:
        {ts_ns, kind, entity, message, value}."""
        cond, args = ["agent_id = ?", f"kind IN ({','.join('?' * len(kinds))})", "ts_ns >= ?"], [node_id, *kinds,
                                                                                              since_ns]
        if until_ns:
            cond.append("ts_ns <= ?")
            args.append(until_ns)
        db = self._db()
        try:
            cur = db.conn.execute(f"SELECT ts_ns, kind, entity, message, value FROM events WHERE {' AND '.join(cond)}"
                                  " ORDER BY ts_ns LIMIT ?", args + [limit])
            return _dict_rows(cur)
        finally:
            db.conn.close()

    def job_processes(self, job_key: str) -> list[dict]:
        """Every process the agents reported for one job, by rank: {node_id, pid, start_ticks, rank, local_rank,
        started_ns, exited_ns} (exited_ns 0 while alive), newest process of a rank last."""
        db = self._db()
        try:
            rows = db.conn.execute("SELECT agent_id, pid, start_ticks, rank, local_rank, started_ns, exited_ns FROM"
                                   " processes WHERE job_key=? ORDER BY rank, started_ns", (job_key,)).fetchall()
        finally:
            db.conn.close()
        return [{"node_id": a, "pid": p, "start_ticks": t, "rank": r if r is not None else -1,
                 "local_rank": lr if lr is not None else -1, "started_ns": s or 0, "exited_ns": e or 0}
                for a, p, t, r, lr, s, e in rows]

    def metric_points(self, node_id: str, names: list[str], entities: list[str] | None = None, since_ns: int = 0,
                      until_ns: int = 0, limit: int = 100_000) -> dict[tuple[str, str], list[tuple[int, float]]]:
        """One node's samples of the named metrics (all entities, or those listed) in [since_ns, until_ns]
        (until 0: no bound), oldest first per series: {(name, entity): [(ts_ns, value)]}."""
        if not names:
            return {}
        cond = ["s.agent_id = ?", f"s.name IN ({','.join('?' * len(names))})", "m.ts_ns >= ?"]
        args: list = [node_id, *names, since_ns]
        if entities is not None:
            if not entities:
                return {}
            cond.append(f"s.entity IN ({','.join('?' * len(entities))})")
            args += list(entities)
        if until_ns:
            cond.append("m.ts_ns <= ?")
            args.append(until_ns)
        db = self._db()
        try:
            rows = db.conn.execute(f"SELECT s.name, s.entity, m.ts_ns, m.value FROM series s JOIN metrics m ON"
                                   f" m.series_id = s.id WHERE {' AND '.join(cond)} ORDER BY s.id, m.ts_ns LIMIT ?",
                                   args + [limit]).fetchall()
        finally:
            db.conn.close()
        out: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for name, entity, ts, value in rows:
            out.setdefault((name, entity), []).append((ts, value))
        return out

    def conn_stats_of(self, node_id: str, since_ns: int = 0, until_ns: int = 0, limit: int = 50_000) -> list[dict]:
        """One node's per-connection TCP figures (ConnStats) whose interval ends in [since_ns, until_ns], oldest
        first: {start_ns, end_ns, src, sport, dst, dport, tx_bytes, rx_bytes, retransmits, srtt_us, pid, source,
        net_limited_us}.
        Where both sources report (netflows and tcpinfo), only one's rows: tcpinfo's (the kernel's own TCP
        figures), so no connection counts twice."""
        cond, args = ["agent_id = ?", "end_ns >= ?"], [node_id, since_ns]
        if until_ns:
            cond.append("end_ns <= ?")
            args.append(until_ns)
        db = self._db()
        try:
            cur = db.conn.execute("SELECT start_ns, end_ns, src, sport, dst, dport, tx_bytes, rx_bytes, tx_packets,"
                                  " retransmits, srtt_us, pid, source, net_limited_us FROM conn_stats"
                                  f" WHERE {' AND '.join(cond)} ORDER BY end_ns LIMIT ?", args + [limit])
            rows = _dict_rows(cur)
        finally:
            db.conn.close()
        sources = {r["source"] for r in rows}
        if len(sources) > 1:
            keep = "tcpinfo" if "tcpinfo" in sources else sorted(sources)[0]
            rows = [r for r in rows if r["source"] == keep]
        return rows

    def flow_rows(self, since_ns: int, until_ns: int, limit: int = 5_000_000) -> list[tuple]:
        """Every flow starting in [since_ns, until_ns) as (start_ns, end_ns, src, dst, bytes, switches_json,
        origin, sport, dport) tuples, oldest first (the black-box analysis's window:
        flowjobs.FlowWindow.from_rows). The (end_ns) index bounds the scan; a flow ends after it starts, so
        end_ns >= since_ns holds for all."""
        db = self._db()
        try:
            return db.conn.execute("SELECT start_ns, end_ns, src, dst, bytes, switches, origin, sport, dport FROM flows"
                                   " WHERE end_ns >= ? AND start_ns >= ? AND start_ns < ? ORDER BY start_ns LIMIT ?",
                                   (since_ns, since_ns, until_ns, limit)).fetchall()
        finally:
            db.conn.close()

    def flow_watermark(self) -> tuple[int, int]:
        """(highest rowid, newest end_ns) of the flows table: whether flows arrived since a snapshot."""
        db = self._db()
        try:
            row = db.conn.execute("SELECT MAX(rowid), MAX(end_ns) FROM flows").fetchone()
            return int(row[0] or 0), int(row[1] or 0)
        finally:
            db.conn.close()

    def topology(self) -> Topology | None:
        rec = self.topology_record()
        return rec["topology"] if rec else None

    def data_watermarks(self, job_keys: list[str]) -> dict[str, int]:
        """Newest cluster time of per-job data of these jobs (the resolution clock of findings.merge), over the
        per-step tables (DATA_TABLES)."""
        db = self._db()
        try:
            out = {}
            for key in job_keys:
                for table in DATA_TABLES:
                    row = db.conn.execute(f"SELECT MAX(end_ns) FROM {table} WHERE job_key = ?", (key,)).fetchone()
                    if row and row[0]:
                        out[key] = max(out.get(key, 0), row[0])
            return out
        finally:
            db.conn.close()

    def live_collectors(self, since_ns: int) -> list[dict]:
        """The collectors whose newest heartbeat is at or after since_ns: {id, address, started_ns, heartbeat_ns},
        by id (analysis/ownership.py)."""
        db = self._db()
        try:
            rows = db.conn.execute("SELECT id, address, started_ns, heartbeat_ns FROM collectors"
                                   " WHERE heartbeat_ns >= ? ORDER BY id", (since_ns,)).fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):   # a store this collector has not migrated yet (read-only opened)
                return []
            raise
        finally:
            db.conn.close()
        return [{"id": a, "address": b, "started_ns": c, "heartbeat_ns": d} for a, b, c, d in rows]

    def new_data_since(self, rowid: int | tuple = 0) -> tuple[tuple, dict[str, int]]:
        """Per-job data stored after `rowid` (an incremental read, so a pass costs what arrived, not what is
        kept): (new high rowids, {job_key: newest end_ns among the new rows}). rowid: what the previous call
        returned (one rowid per DATA_TABLES entry), or 0 to read everything."""
        marks = tuple(rowid) if isinstance(rowid, (tuple, list)) else (rowid,) + (0,) * (len(DATA_TABLES) - 1)
        tops, out = [], {}
        db = self._db()
        try:
            for table, since in zip(DATA_TABLES, marks):
                top = db.conn.execute(f"SELECT MAX(rowid) FROM {table}").fetchone()[0] or 0
                if top < since:  # the table was emptied (retention, a new store): start over
                    since = 0
                rows = db.conn.execute(f"SELECT job_key, MAX(end_ns) FROM {table} WHERE rowid > ? AND rowid <= ?"
                                       " AND job_key != '' GROUP BY job_key", (since, top)).fetchall()
                for k, v in rows:
                    if v:
                        out[k] = max(out.get(k, 0), v)
                tops.append(top)
        finally:
            db.conn.close()
        return tuple(tops), out

    def steps(self, job_key: str, ranks: list[int] | None = None, since_ns: int = 0, limit: int = 200_000,
              with_comms: bool = False) -> list[dict]:
        """The newest `limit` Step rows of a job (optionally some ranks), oldest first; `comms` (the parsed
        comms_json) only with with_comms."""
        cond, args = ["job_key = ?", "end_ns >= ?"], [job_key, since_ns]
        if ranks:
            cond.append("rank IN (%s)" % ",".join("?" * len(ranks)))
            args += list(ranks)
        cols = "*" if with_comms else ("agent_id, source, pid, start_ticks, job_key, rank, step, start_ns, end_ns,"
                                       " evidence, period_ops, ops")
        db = self._db()
        try:
            rows = _dict_rows(db.conn.execute(f"SELECT {cols} FROM steps WHERE {' AND '.join(cond)}"
                                              " ORDER BY end_ns DESC LIMIT ?", args + [limit]))
        finally:
            db.conn.close()
        for r in rows:
            r["node_id"] = r.pop("agent_id")
            if with_comms:
                r["comms"] = json.loads(r.pop("comms_json"))
        rows.reverse()
        return rows

    def steps_after(self, job_key: str, after_rowid: int, since_ns: int = 0, limit: int = 2_000_000,
                    before_ns: int = 0, upto_rowid: int = 0) -> tuple[list[dict], int]:
        """The job's Step rows stored after `after_rowid` (an incremental read: what arrived since the previous
        call, late rows of old steps included) whose step ended in [since_ns, before_ns) (before 0: no bound), in
        storage order, with their comms; and the rowid to pass next time. The table's end is read first and the
        rows up to it (upto_rowid: up to that one instead), so a row committed during the read comes next time; a
        read cut by `limit` goes on after its last row. after_rowid 0 reads through the (job_key, end_ns) index."""
        db = self._db()
        try:
            top = upto_rowid or db.conn.execute("SELECT MAX(rowid) FROM steps").fetchone()[0] or 0
            cond, args = ["job_key = ?", "end_ns >= ?", "rowid <= ?"], [job_key, since_ns, top]
            if after_rowid:
                cond.append("rowid > ?")
                args.append(after_rowid)
            if before_ns:
                cond.append("end_ns < ?")
                args.append(before_ns)
            cur = db.conn.execute(f"SELECT rowid AS _rowid, * FROM steps WHERE {' AND '.join(cond)} ORDER BY rowid"
                                  " LIMIT ?", args + [limit])
            rows = _dict_rows(cur)
            if len(rows) >= limit:   # cut: go on after the last row read
                top = rows[-1]["_rowid"]
        finally:
            db.conn.close()
        for r in rows:
            r["node_id"] = r.pop("agent_id")
            r["comms"] = json.loads(r.pop("comms_json"))
            del r["_rowid"]
        return rows, max(top, after_rowid)

    def iterations(self, job_key: str, since_ns: int = 0, until_ns: int = 0, limit: int = 500_000) -> list[dict]:
        """The job's Iteration rows (anchored iterations with their workload, sentinel input) that ended in
        (since_ns, until_ns] (until 0: no bound), oldest first; the newest `limit` when there are more."""
        cond, args = ["job_key = ?", "end_ns > ?"], [job_key, since_ns]
        if until_ns:
            cond.append("end_ns <= ?")
            args.append(until_ns)
        db = self._db()
        try:
            rows = _dict_rows(db.conn.execute(f"SELECT * FROM iterations WHERE {' AND '.join(cond)}"
                                              " ORDER BY end_ns DESC LIMIT ?", args + [limit]))
        finally:
            db.conn.close()
        for r in rows:
            r["node_id"] = r.pop("agent_id")
        rows.reverse()
        return rows

    def _job_comm_rows(self, conn, job_key: str) -> dict[str, list[dict]]:
        """Per job (or the one asked for), who ran ops on which communicator in its newest JOB_COMMS_WINDOW_NS:
        {job_key: [{rank, comm_id, agent_id, ops (comma-joined), first_ns, last_ns}]}."""
        where, args = ("AND job_key = ?", [job_key]) if job_key else ("", [])
        tails = conn.execute(f"SELECT job_key, MAX(end_ns) FROM comm_summaries WHERE job_key != '' {where}"
                             " GROUP BY job_key", args).fetchall()
        summ: dict[str, list[dict]] = {}
        for key, last in tails:
            summ[key] = _dict_rows(conn.execute(
                "SELECT rank, comm_id, agent_id, GROUP_CONCAT(DISTINCT op) AS ops, MIN(start_ns) AS first_ns,"
                " MAX(end_ns) AS last_ns FROM comm_summaries WHERE job_key = ? AND end_ns >= ?"
                " GROUP BY rank, comm_id, agent_id", (key, last - JOB_COMMS_WINDOW_NS)))
        return summ

    def jobs(self, job_key: str = "") -> list[dict]:
        """Every job known from processes (job key, rank, world size) or comm summaries, with its ranks,
        nodes and communicators (members from NCCL topology records and from who ran ops on which comm)."""
        db = self._db()
        try:
            conn = db.conn
            where, args = ("AND job_key = ?", [job_key]) if job_key else ("", [])
            procs = _dict_rows(conn.execute(
                "SELECT agent_id, pid, start_ticks, job_key, rank, local_rank, world_size, started_ns, exited_ns"
                f" FROM processes WHERE job_key IS NOT NULL AND job_key != '' {where}"
                " ORDER BY job_key, rank, started_ns", args))
            summ = self._job_comm_rows(conn, job_key)
            members = _dict_rows(conn.execute(
                "SELECT m.*, (SELECT j.job_key FROM comm_members j WHERE j.comm_id = m.comm_id AND j.job_key != ''"
                " LIMIT 1) AS comm_job FROM comm_members m ORDER BY comm_id, rank"))
        finally:
            db.conn.close()
        jobs: dict[str, dict] = {}

        def job(key: str) -> dict:
            return jobs.setdefault(key, {"job_key": key, "world_size": -1, "ranks": {}, "comms": {},
                                         "first_seen_ns": 0, "last_seen_ns": 0})
        for p in procs:
            j = job(p["job_key"])
            j["world_size"] = max(j["world_size"], p["world_size"] if p["world_size"] is not None else -1)
            seen = [x for x in (p["started_ns"], p["exited_ns"]) if x]
            if seen:
                j["first_seen_ns"] = min([j["first_seen_ns"] or seen[0]] + seen)
                j["last_seen_ns"] = max([j["last_seen_ns"]] + seen)
            rank = p["rank"] if p["rank"] is not None else -1
            alive = p["exited_ns"] is None
            key = rank if rank >= 0 else f"pid:{p['agent_id']}:{p['pid']}"
            old = j["ranks"].get(key)
            # a rank restarted (or re-found) keeps its live process, else its newest one
            if old is None or (alive and not old["alive"]) or (alive == old["alive"] and
                                                              (p["started_ns"] or 0) >= old["_started"]):
                j["ranks"][key] = {"rank": rank, "node_id": p["agent_id"], "pid": p["pid"],
                                   "local_rank": p["local_rank"] if p["local_rank"] is not None else -1,
                                   "alive": alive, "exited_ns": p["exited_ns"] or 0, "source": "procs",
                                   "_started": p["started_ns"] or 0}
        for key, rows in summ.items():
            j = job(key)
            for r in rows:
                j["last_seen_ns"] = max(j["last_seen_ns"], r["last_ns"] or 0)
                if r["rank"] >= 0 and r["rank"] not in j["ranks"]:
                    j["ranks"][r["rank"]] = {"rank": r["rank"], "node_id": r["agent_id"], "pid": 0, "local_rank": -1,
                                             "alive": None, "source": "comm_summaries", "_started": 0}
                if r["comm_id"]:
                    c = j["comms"].setdefault(r["comm_id"], {"comm_id": r["comm_id"], "nranks": 0, "ranks": set(),
                                                             "ops": set(), "via": set()})
                    if r["rank"] >= 0:
                        c["ranks"].add(r["rank"])
                    c["ops"].update(x for x in (r["ops"] or "").split(",") if x)
                    c["via"].add("comm_summaries")
        for m in members:
            key = m["job_key"] or m["comm_job"]
            if not key or (job_key and key != job_key):
                continue
            c = job(key)["comms"].setdefault(m["comm_id"], {"comm_id": m["comm_id"], "nranks": 0, "ranks": set(),
                                                             "ops": set(), "via": set()})
            c["nranks"] = max(c["nranks"], m["nranks"])
            if m["global_rank"] >= 0:
                c["ranks"].add(m["global_rank"])
            c["via"].add(m["via"])
        out = []
        for key in sorted(jobs):
            j = jobs[key]
            # "pg:?": ops a trace could not place in a group (a Kineto window of a gloo build has no group names);
            # where a named communicator of the job has their ranks and ops, they are its, not another one
            unnamed = j["comms"].get("pg:?")
            if unnamed and any(k != "pg:?" and unnamed["ranks"] <= c["ranks"] and unnamed["ops"] <= c["ops"]
                               for k, c in j["comms"].items()):
                del j["comms"]["pg:?"]
            ranks = sorted(j["ranks"].values(), key=lambda x: (x["rank"] < 0, x["rank"], x["node_id"], x["pid"]))
            for r in ranks:
                r.pop("_started")
            comms = []
            for c in sorted(j["comms"].values(), key=lambda c: (-max(c["nranks"], len(c["ranks"])), c["comm_id"])):
                comms.append({"comm_id": c["comm_id"], "nranks": max(c["nranks"], len(c["ranks"])),
                              "ranks": sorted(c["ranks"]), "ops": sorted(c["ops"]), "via": sorted(c["via"])})
            out.append({"job_key": key, "world_size": j["world_size"], "ranks": ranks,
                        "nodes": sorted({r["node_id"] for r in ranks if r["node_id"]}),
                        "alive": any(r["alive"] for r in ranks if r["source"] == "procs"),
                        "first_seen_ns": j["first_seen_ns"], "last_seen_ns": j["last_seen_ns"], "comms": comms})
        return out
