"""The collectors' shared state on ClickHouse: what each one keeps in its SQLite file, replicated to the others.

With `--store clickhouse://…` the telemetry is shared, but the state a collector updates in place stays in its own
SQLite file: the agents whose streams it holds, their processes and GPUs, the communicators' members, the findings
of the jobs it analyses, imported topologies, deep dives. The other collectors need it: a job's ranks on agents
streaming elsewhere, a job's open findings when its analysis moves, `steplens nodes` and `findings` answered alike
on every collector.

How: the writer of each collector records which rows of the replicated tables its group changed (TEMP triggers
into a TEMP table, so nothing in the collector's code that writes them has to know), and at the group's commit
appends each changed row, whole, to ClickHouse's `state_log` (tbl, key, version_ns, row_json) with the group's
other rows: the state log is exactly-once like the telemetry (committed per writer, collector/store/clickhouse.py).
Every collector reads the other writers' committed state-log rows since its own marks (kept in its SQLite file,
in the same transaction as the rows it applies) and applies them into its file: last writer wins per row by
version (the writers' cluster time); an agent's row goes by its streams (the newest Hello holds it, a late
disconnect from a collector that no longer holds it does not count).
A local change and the apply of a remote one are told apart by a flag the triggers read, so nothing echoes.

Not replicated: series' newest values (each collector's own ingest state), batches (in ClickHouse already),
deletions (each collector applies the same retention to its file). The state log expires with the retention: a
collector that joins later than that misses state older than it, as it misses the telemetry.
"""

from __future__ import annotations

import json
import logging
import sqlite3

log = logging.getLogger("steplens.collector.replication")

# table -> the columns of its natural key (the SQLite rowid differs between collectors' files)
REPLICATED: dict[str, tuple[str, ...]] = {
    "agents": ("agent_id",),
    "gpus": ("agent_id", "uuid"),
    "processes": ("agent_id", "pid", "start_ticks"),
    "comm_members": ("comm_id", "rank", "host", "pid"),
    "findings": ("id",),
    "topologies": ("version",),
    "deep_dives": ("command_id",),
}

# the ClickHouse table (its delivery columns are added by the store, as for every telemetry table)
STATE_LOG = ((("tbl", "LowCardinality(String)"), ("key", "String"), ("version_ns", "Int64"),
              ("row_json", "String CODEC(ZSTD(3))")), "version_ns", "tbl, key, version_ns")


def install(conn: sqlite3.Connection) -> None:
    """The TEMP change table, the flag and one trigger per replicated table and verb (per connection)."""
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS _changes (tbl TEXT NOT NULL, rid INTEGER NOT NULL,"
                 " PRIMARY KEY (tbl, rid)) WITHOUT ROWID")
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS _sync (applying INTEGER NOT NULL)")
    if conn.execute("SELECT count(*) FROM temp._sync").fetchone()[0] == 0:
        conn.execute("INSERT INTO temp._sync VALUES (0)")
    for tbl in REPLICATED:
        for verb in ("INSERT", "UPDATE"):
            conn.execute(f"CREATE TEMP TRIGGER IF NOT EXISTS _repl_{tbl}_{verb.lower()} AFTER {verb} ON main.{tbl}"
                         " WHEN (SELECT applying FROM temp._sync) = 0 BEGIN"
                         f" INSERT OR IGNORE INTO _changes VALUES ('{tbl}', NEW.rowid); END")


def _columns(conn: sqlite3.Connection, tbl: str, cache: dict) -> list[str]:
    cols = cache.get(tbl)
    if cols is None:
        cols = cache[tbl] = [r[1] for r in conn.execute(f"PRAGMA main.table_info({tbl})")]
    return cols


AGENT_EVERY_NS = 10 * 10**9   # an agent's row changes with every batch: sent at most this often, or when its
                              # stream comes or goes


def collect(conn: sqlite3.Connection, version_ns: int, writer: str, cache: dict, sent: dict | None = None) -> list[tuple]:
    """The rows this group changed, as state-log rows (tbl, key, version_ns, row_json); records their versions
    and empties the change table. `sent` (agent key -> (version, its stream) last sent) spaces an agent's rows
    AGENT_EVERY_NS apart. Runs inside the group's transaction."""
    changed: dict[str, list[int]] = {}
    for tbl, rid in conn.execute("SELECT tbl, rid FROM temp._changes"):
        changed.setdefault(tbl, []).append(rid)
    if not changed:
        return []
    out, versions = [], []
    for tbl, rids in changed.items():
        cols, keys = _columns(conn, tbl, cache), REPLICATED[tbl]
        for i in range(0, len(rids), 500):
            part = rids[i:i + 500]
            for vals in conn.execute(f"SELECT {', '.join(cols)} FROM main.{tbl} WHERE rowid IN"
                                     f" ({', '.join('?' * len(part))})", part):
                row = dict(zip(cols, vals))
                key = json.dumps([row[k] for k in keys])
                if tbl == "agents" and sent is not None:
                    last = sent.get(key)
                    session = (row.get("connected"), row.get("connected_ns"), row.get("collector_id"))
                    if last is not None and last[1] == session and version_ns - last[0] < AGENT_EVERY_NS:
                        continue
                    sent[key] = (version_ns, session)
                out.append((tbl, key, version_ns, json.dumps(row, separators=(",", ":"))))
                versions.append((tbl, key, version_ns, writer))
    conn.executemany("INSERT OR REPLACE INTO state_versions(tbl, key, version_ns, writer) VALUES (?, ?, ?, ?)",
                     versions)
    conn.execute("DELETE FROM temp._changes")
    return out


def marks(conn: sqlite3.Connection) -> dict[str, int]:
    """Each other writer's last state-log group applied here."""
    return dict(conn.execute("SELECT writer, rid FROM state_marks"))


def _agent_row_applies(conn: sqlite3.Connection, row: dict, writer: str) -> bool:
    """An agent's row goes by its streams, not by when a collector wrote it: a collector notices a lost stream
    late (its keepalive), after the agent's Hello elsewhere. The newest Hello (connected_ns) holds the agent; a
    disconnect counts only from the collector that holds it."""
    local = conn.execute("SELECT connected, collector_id, connected_ns FROM agents WHERE agent_id = ?",
                         (row.get("agent_id"),)).fetchone()
    if local is None or not local[0]:
        return True
    if row.get("connected"):
        return (row.get("connected_ns") or 0) >= local[2]
    return local[1] == writer


def apply(conn: sqlite3.Connection, rows: list[tuple], new_marks: dict[str, int], cache: dict) -> int:
    """Apply other writers' state-log rows, each (writer, tbl, key, version_ns, row_json) in commit order: a row
    replaces the local one unless the local version is as new or newer; an agent's row by who holds its stream
    (_agent_row_applies). Returns how many were applied. Runs inside the group's transaction."""
    applied = 0
    conn.execute("UPDATE temp._sync SET applying = 1")
    try:
        for writer, tbl, key, version, row_json in rows:
            if tbl not in REPLICATED:
                continue
            row = json.loads(row_json)
            if tbl == "agents":
                if not _agent_row_applies(conn, row, writer):
                    continue
                row["collector_id"] = writer
            else:
                have = conn.execute("SELECT version_ns FROM state_versions WHERE tbl = ? AND key = ?",
                                    (tbl, key)).fetchone()
                if have is not None and have[0] >= version:
                    continue
            cols = [c for c in _columns(conn, tbl, cache) if c in row]
            conn.execute(f"INSERT OR REPLACE INTO main.{tbl}({', '.join(cols)}) VALUES"
                         f" ({', '.join('?' * len(cols))})", [row[c] for c in cols])
            conn.execute("INSERT OR REPLACE INTO state_versions(tbl, key, version_ns, writer) VALUES (?, ?, ?, ?)",
                         (tbl, key, version, writer))
            applied += 1
        conn.executemany("INSERT OR REPLACE INTO state_marks(writer, rid) VALUES (?, ?)", list(new_marks.items()))
    finally:
        conn.execute("UPDATE temp._sync SET applying = 0")
    return applied


__all__ = ["REPLICATED", "STATE_LOG", "install", "collect", "marks", "apply"]
