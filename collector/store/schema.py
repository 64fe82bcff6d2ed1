"""The collector's SQLite schema and its migrations (PRAGMA user_version), applied at open.

Layout, chosen for the ingest hot path:
- metrics(series_id, ts_ns, value) is a WITHOUT ROWID table keyed by (series_id, ts_ns): one b-tree,
  appends at each series' tail, "last 10 minutes of one series" is a range scan. Series names live
  once in `series`, which also holds each series' latest value for the listing commands.
- batches(agent_id, spool_id, seq) records every accepted batch: the dedupe key, and the proof of
  contiguous, exactly-once delivery.
- ts_ns columns are cluster time; the clock offset and uncertainty used are kept per batch.
"""

from __future__ import annotations

import sqlite3
import time

import sqlite_utils

MIGRATIONS: list[tuple[int, str]] = [
    (1, """
CREATE TABLE agents (
  agent_id TEXT PRIMARY KEY, hostname TEXT, agent_version TEXT, boot_id TEXT, spool_id TEXT,
  first_seen_ns INTEGER, last_seen_ns INTEGER, connected INTEGER NOT NULL DEFAULT 0, peer TEXT,
  clock_offset_ns INTEGER, clock_drift_ppm REAL, clock_uncertainty_ns INTEGER, clock_rtt_ns INTEGER,
  clock_samples INTEGER, sources_json TEXT NOT NULL DEFAULT '{}',
  spool_backlog INTEGER NOT NULL DEFAULT 0, records_produced INTEGER NOT NULL DEFAULT 0,
  records_acked INTEGER NOT NULL DEFAULT 0, records_dropped INTEGER NOT NULL DEFAULT 0,
  records_stored INTEGER NOT NULL DEFAULT 0, records_rejected INTEGER NOT NULL DEFAULT 0,
  batches_stored INTEGER NOT NULL DEFAULT 0, batches_duplicate INTEGER NOT NULL DEFAULT 0,
  mode TEXT NOT NULL DEFAULT 'sentinel', mode_until_ns INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE batches (
  agent_id TEXT NOT NULL, spool_id TEXT NOT NULL, seq INTEGER NOT NULL, n_records INTEGER NOT NULL,
  n_rejected INTEGER NOT NULL DEFAULT 0, n_bytes INTEGER NOT NULL, received_ns INTEGER NOT NULL,
  clock_offset_ns INTEGER, clock_uncertainty_ns INTEGER,
  PRIMARY KEY (agent_id, spool_id, seq)
) WITHOUT ROWID;
CREATE TABLE series (
  id INTEGER PRIMARY KEY, agent_id TEXT NOT NULL, name TEXT NOT NULL, entity TEXT NOT NULL,
  last_ts_ns INTEGER, last_mono_ns INTEGER, last_value REAL,
  UNIQUE (agent_id, name, entity)
);
CREATE TABLE metrics (
  series_id INTEGER NOT NULL, ts_ns INTEGER NOT NULL, value REAL NOT NULL,
  PRIMARY KEY (series_id, ts_ns)
) WITHOUT ROWID;
CREATE TABLE gpus (
  agent_id TEXT NOT NULL, uuid TEXT NOT NULL, gpu_index INTEGER, name TEXT, pci_bus_id TEXT,
  memory_total_bytes INTEGER, driver_version TEXT, cuda_driver_version TEXT, nvlink_count INTEGER,
  serial TEXT, first_seen_ns INTEGER, last_seen_ns INTEGER,
  PRIMARY KEY (agent_id, uuid)
);
CREATE TABLE processes (
  agent_id TEXT NOT NULL, pid INTEGER NOT NULL, start_ticks INTEGER NOT NULL, ppid INTEGER, exe TEXT,
  cmdline TEXT, framework TEXT, job_key TEXT, rank INTEGER, local_rank INTEGER, world_size INTEGER,
  master_addr TEXT, master_port INTEGER, env_json TEXT, container_id TEXT, uid INTEGER,
  started_ns INTEGER, exited_ns INTEGER,
  PRIMARY KEY (agent_id, pid, start_ticks)
);
CREATE INDEX processes_job ON processes (job_key, rank);
CREATE TABLE events (
  agent_id TEXT NOT NULL, ts_ns INTEGER NOT NULL, source TEXT, kind TEXT NOT NULL, entity TEXT,
  message TEXT, value REAL
);
CREATE INDEX events_agent_ts ON events (agent_id, ts_ns);
CREATE INDEX events_kind_ts ON events (kind, ts_ns);
CREATE TABLE gaps (
  agent_id TEXT NOT NULL, spool_id TEXT, ts_ns INTEGER NOT NULL, source TEXT, dropped_records INTEGER,
  dropped_batches INTEGER, first_seq INTEGER, last_seq INTEGER, reason TEXT
);
CREATE INDEX gaps_agent_ts ON gaps (agent_id, ts_ns);
CREATE TABLE rejections (
  agent_id TEXT NOT NULL, ts_ns INTEGER NOT NULL, spool_id TEXT, seq INTEGER, reason TEXT NOT NULL,
  count INTEGER NOT NULL
);
CREATE INDEX rejections_agent_ts ON rejections (agent_id, ts_ns);
"""),
]

MIGRATIONS.append((2, """
CREATE TABLE stack_summaries (
  agent_id TEXT NOT NULL, start_ns INTEGER NOT NULL, end_ns INTEGER NOT NULL, pid INTEGER NOT NULL,
  start_ticks INTEGER NOT NULL, tid INTEGER NOT NULL, thread_name TEXT, python TEXT, samples INTEGER NOT NULL,
  errors INTEGER NOT NULL, last_state TEXT, stacks_json TEXT NOT NULL
);
CREATE INDEX stack_summaries_proc ON stack_summaries (agent_id, pid, start_ticks, end_ns);
CREATE INDEX stack_summaries_end ON stack_summaries (end_ns);
"""))

MIGRATIONS.append((3, """
CREATE TABLE flows (
  agent_id TEXT NOT NULL, start_ns INTEGER NOT NULL, end_ns INTEGER NOT NULL, src TEXT NOT NULL,
  sport INTEGER NOT NULL, dst TEXT NOT NULL, dport INTEGER NOT NULL, bytes INTEGER NOT NULL,
  packets INTEGER NOT NULL, pid INTEGER NOT NULL, origin TEXT NOT NULL, switches TEXT NOT NULL DEFAULT '[]'
);
CREATE INDEX flows_end ON flows (end_ns);
CREATE INDEX flows_pair ON flows (src, dst, end_ns);
CREATE TABLE conn_stats (
  agent_id TEXT NOT NULL, start_ns INTEGER NOT NULL, end_ns INTEGER NOT NULL, src TEXT NOT NULL,
  sport INTEGER NOT NULL, dst TEXT NOT NULL, dport INTEGER NOT NULL, tx_bytes INTEGER, rx_bytes INTEGER,
  tx_packets INTEGER, rx_packets INTEGER, tx_payload_bytes INTEGER, rx_payload_bytes INTEGER,
  retransmits INTEGER, srtt_us INTEGER, pid INTEGER, comm TEXT
);
CREATE INDEX conn_stats_end ON conn_stats (end_ns);
"""))

MIGRATIONS.append((4, """
CREATE TABLE comm_summaries (
  agent_id TEXT NOT NULL, start_ns INTEGER NOT NULL, end_ns INTEGER NOT NULL, pid INTEGER NOT NULL,
  start_ticks INTEGER NOT NULL, job_key TEXT NOT NULL, rank INTEGER NOT NULL, comm_id TEXT NOT NULL,
  op TEXT NOT NULL, step INTEGER NOT NULL, calls INTEGER NOT NULL, bytes INTEGER NOT NULL, busy_ns INTEGER NOT NULL,
  max_ns INTEGER NOT NULL, seq_first INTEGER NOT NULL, seq_last INTEGER NOT NULL, timing TEXT NOT NULL,
  source TEXT NOT NULL, issue_latency_ns_sum INTEGER NOT NULL, kernels INTEGER NOT NULL
);
CREATE INDEX comm_summaries_job ON comm_summaries (job_key, end_ns);
CREATE INDEX comm_summaries_end ON comm_summaries (end_ns);
"""))

MIGRATIONS.append((5, """
CREATE TABLE comm_members (
  comm_id TEXT NOT NULL, rank INTEGER NOT NULL, nranks INTEGER NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL,
  cuda_dev INTEGER NOT NULL, nvml_dev INTEGER NOT NULL, bus_id TEXT NOT NULL, global_rank INTEGER NOT NULL,
  job_key TEXT NOT NULL, via TEXT NOT NULL, agent_id TEXT NOT NULL, seen_ns INTEGER NOT NULL,
  PRIMARY KEY (comm_id, rank, host, pid)
);
CREATE INDEX comm_members_job ON comm_members (job_key);
"""))

# diagnosis: findings (collector/analysis/findings.py: one row per finding, `pending` rows are not listed)
# and the imported physical topologies (collector/topology.py; the newest version is the current one)
MIGRATIONS.append((6, """
CREATE TABLE findings (
  id TEXT PRIMARY KEY, job_key TEXT NOT NULL, detector TEXT NOT NULL, kind TEXT NOT NULL, status TEXT NOT NULL,
  suspect_kind TEXT NOT NULL, suspect_id TEXT NOT NULL, onset_ns INTEGER NOT NULL, last_ns INTEGER NOT NULL,
  resolved_ns INTEGER NOT NULL DEFAULT 0, first_seen_ns INTEGER NOT NULL, severity REAL NOT NULL,
  peak_severity REAL NOT NULL, summary TEXT NOT NULL, suspects_json TEXT NOT NULL, evidence_json TEXT NOT NULL,
  confirmations INTEGER NOT NULL, created_ns INTEGER NOT NULL, updated_ns INTEGER NOT NULL
);
CREATE INDEX findings_job ON findings (job_key, detector, status);
CREATE INDEX findings_status ON findings (status, last_ns);
CREATE TABLE topologies (
  version INTEGER PRIMARY KEY, origin TEXT NOT NULL, imported_ns INTEGER NOT NULL, digest TEXT NOT NULL,
  name TEXT NOT NULL, nodes INTEGER NOT NULL, gpus INTEGER NOT NULL, nics INTEGER NOT NULL,
  switches INTEGER NOT NULL, links INTEGER NOT NULL, doc_json TEXT NOT NULL
);
"""))

# per-rank steps segmented on the agent (agent/steps.py, issue 13 item 3); comms_json: the step's per-communicator
# summaries, [{comm_id, op, calls, bytes, busy_ns, wait_ns, seq_first, issue_offsets_ns, offsets_dropped}]
MIGRATIONS.append((7, """
CREATE TABLE steps (
  agent_id TEXT NOT NULL, source TEXT NOT NULL, pid INTEGER NOT NULL, start_ticks INTEGER NOT NULL,
  job_key TEXT NOT NULL, rank INTEGER NOT NULL, step INTEGER NOT NULL, start_ns INTEGER NOT NULL,
  end_ns INTEGER NOT NULL, evidence TEXT NOT NULL, period_ops INTEGER NOT NULL, ops INTEGER NOT NULL,
  comms_json TEXT NOT NULL
);
CREATE INDEX steps_job ON steps (job_key, end_ns);
CREATE INDEX steps_end ON steps (end_ns);
"""))

# where each process stands on each communicator (CommProgress from the flightrec source, for hang detection):
# end_ns is the cluster time the state was read, pending_since_ns the pending op's issue time (0 none)
MIGRATIONS.append((8, """
CREATE TABLE comm_progress (
  agent_id TEXT NOT NULL, end_ns INTEGER NOT NULL, pid INTEGER NOT NULL, start_ticks INTEGER NOT NULL,
  job_key TEXT NOT NULL, rank INTEGER NOT NULL, comm_id TEXT NOT NULL, last_enqueued INTEGER NOT NULL,
  last_started INTEGER NOT NULL, last_completed INTEGER NOT NULL, pending_op TEXT NOT NULL,
  pending_seq INTEGER NOT NULL, pending_p2p INTEGER NOT NULL, pending_peer INTEGER NOT NULL,
  pending_since_ns INTEGER NOT NULL, nranks INTEGER NOT NULL
);
CREATE INDEX comm_progress_job ON comm_progress (job_key, end_ns);
CREATE INDEX comm_progress_end ON comm_progress (end_ns);
"""))

# why a rank is slow (analysis/causes.py) reads one node's connections over an episode
MIGRATIONS.append((9, """
CREATE INDEX conn_stats_agent ON conn_stats (agent_id, end_ns);
"""))

# two agent sources report connections (netflows: eBPF; tcpinfo: sock_diag): which one, so a reader counts each once
MIGRATIONS.append((10, """
ALTER TABLE conn_stats ADD COLUMN source TEXT NOT NULL DEFAULT '';
"""))

# time a connection's sender was held back by the network (tcpinfo's TCP chrono figures; 0 unknown)
MIGRATIONS.append((11, """
ALTER TABLE conn_stats ADD COLUMN net_limited_us INTEGER NOT NULL DEFAULT 0;
"""))

# iterations bounded by anchors inside the job (agent/sources/iters.py) with their workload: what the sentinel
# (analysis/sentinel.py) fits its latency baseline on; job_key '' for a process outside any job (a serving engine
# without one: its key is then "pid:<node>:<pid>" at read time)
MIGRATIONS.append((12, """
CREATE TABLE iterations (
  agent_id TEXT NOT NULL, pid INTEGER NOT NULL, start_ticks INTEGER NOT NULL, job_key TEXT NOT NULL,
  rank INTEGER NOT NULL, seq INTEGER NOT NULL, start_ns INTEGER NOT NULL, end_ns INTEGER NOT NULL,
  anchor TEXT NOT NULL, phase TEXT NOT NULL, batch_size INTEGER NOT NULL, prefill_requests INTEGER NOT NULL,
  prefill_tokens INTEGER NOT NULL, decode_requests INTEGER NOT NULL, kv_tokens INTEGER NOT NULL,
  input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL, tokens INTEGER NOT NULL,
  micro_batches INTEGER NOT NULL
);
CREATE INDEX iterations_job ON iterations (job_key, end_ns);
CREATE INDEX iterations_end ON iterations (end_ns);
"""))

# synchronized deep dives (analysis/deepdive.py): who started one (a finding, or an operator), when every node was
# told to switch (cluster time), which nodes and ranks, the reference window, and what the ranking found
MIGRATIONS.append((13, """
CREATE TABLE deep_dives (
  command_id TEXT PRIMARY KEY, job_key TEXT NOT NULL, finding_id TEXT NOT NULL, trigger TEXT NOT NULL,
  requested_ns INTEGER NOT NULL, start_ns INTEGER NOT NULL, duration_ns INTEGER NOT NULL,
  reference_since_ns INTEGER NOT NULL, reference_until_ns INTEGER NOT NULL, nodes_json TEXT NOT NULL,
  ranks_json TEXT NOT NULL, status TEXT NOT NULL, note TEXT NOT NULL, result_json TEXT NOT NULL,
  updated_ns INTEGER NOT NULL
);
CREATE INDEX deep_dives_job ON deep_dives (job_key, start_ns);
CREATE INDEX deep_dives_finding ON deep_dives (finding_id);
"""))

# the agent's overhead governor (agent/governor.py): its own CPU and its budget, from its status
MIGRATIONS.append((14, """
ALTER TABLE agents ADD COLUMN agent_cpu_cores REAL NOT NULL DEFAULT 0;
ALTER TABLE agents ADD COLUMN cpu_budget_cores REAL NOT NULL DEFAULT 0;
"""))

MIGRATIONS.append((15, """
CREATE TABLE collectors (
  id TEXT PRIMARY KEY, address TEXT NOT NULL, started_ns INTEGER NOT NULL, heartbeat_ns INTEGER NOT NULL
);
"""))

# the collectors' shared state on ClickHouse (store/replication.py): which collector holds an agent's stream ('':
# this one) since when (its Hello there), each replicated row's version, and each other collector's last state-log group applied here
MIGRATIONS.append((16, """
ALTER TABLE agents ADD COLUMN collector_id TEXT NOT NULL DEFAULT '';
ALTER TABLE agents ADD COLUMN connected_ns INTEGER NOT NULL DEFAULT 0;
CREATE TABLE state_versions (
  tbl TEXT NOT NULL, key TEXT NOT NULL, version_ns INTEGER NOT NULL, writer TEXT NOT NULL,
  PRIMARY KEY (tbl, key)
) WITHOUT ROWID;
CREATE TABLE state_marks (writer TEXT PRIMARY KEY, rid INTEGER NOT NULL);
"""))

LATEST_VERSION = MIGRATIONS[-1][0]


WRITER_CACHE_KIB = 64 * 1024   # the writer connection's page cache


class StoreError(RuntimeError):
    pass


def connect(path: str, readonly: bool = False) -> sqlite_utils.Database:
    """Open the store; the writer (readonly=False) also applies pending migrations."""
    try:
        if readonly:
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        else:
            conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA busy_timeout=5000")
        db = sqlite_utils.Database(conn)
        if not readonly:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            # The writer appends to every series at once: the leaf at each series' end of the metrics B-tree is
            # touched by every batch (1,600 series: ~6 MiB of pages), past SQLite's default 2 MiB cache, which
            # then re-reads and re-spills pages each group. 64 MiB holds the insertion points of ~16k series.
            conn.execute(f"PRAGMA cache_size=-{WRITER_CACHE_KIB}")
            migrate(db)
        else:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > LATEST_VERSION:
                raise StoreError(f"store {path!r} has schema {version}, newer than this collector ({LATEST_VERSION})")
        return db
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open store {path!r}: {exc}") from None


def migrate(db: sqlite_utils.Database) -> list[int]:
    """Apply every migration above the file's user_version, each in its own transaction."""
    conn = db.conn
    current = conn.execute("PRAGMA user_version").fetchone()[0]
    if current > LATEST_VERSION:
        raise StoreError(f"store has schema version {current}, newer than this collector knows "
                         f"({LATEST_VERSION}); upgrade steplens")
    applied = []
    for version, sql in MIGRATIONS:
        if version <= current:
            continue
        conn.execute("BEGIN IMMEDIATE")
        try:
            for stmt in [s for s in sql.split(";") if s.strip()]:
                conn.execute(stmt)
            conn.execute(f"PRAGMA user_version={version}")
            conn.execute("COMMIT")
        except sqlite3.Error:
            conn.execute("ROLLBACK")
            raise
        applied.append(version)
    if applied:
        db["schema_log"].insert({"version": applied[-1], "applied_ns": time.time_ns()}, alter=True)
    return applied
