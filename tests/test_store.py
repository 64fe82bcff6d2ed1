"""The SQLite store: migrations, retention, and the read queries, through the real writer."""

import sqlite3
import time

import pytest

from steplens.agent import records as r
from steplens.agent.transport.codec import encode_records
from steplens.collector.ingest.clock import ClockEstimate
from steplens.collector.store import schema
from steplens.collector.store.queries import Reader
from steplens.collector.store.writer import AgentUpdate, BatchJob, StoreWriter

CLOCK = ClockEstimate(offset_ns=1_000_000_000_000, drift_ppm=0.0, ref_mono_ns=0, uncertainty_ns=50_000,
                      best_rtt_ns=100_000, samples=5)


def _write(writer, agent, seq, records, spool="aa" * 8, sent_mono_ns=None):
    done = []
    sent = time.monotonic_ns() if sent_mono_ns is None else sent_mono_ns
    writer.submit(BatchJob(agent, spool, seq, len(records), encode_records([("t", x) for x in records]),
                           sent, CLOCK, time.time_ns(), lambda *a: done.append(a)))
    deadline = time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
    return done[0]


def test_fresh_store_is_at_latest_version(tmp_path):
    db = schema.connect(str(tmp_path / "s.db"))
    assert db.conn.execute("PRAGMA user_version").fetchone()[0] == schema.LATEST_VERSION
    assert {"agents", "batches", "series", "metrics", "gpus", "processes", "events", "gaps",
            "rejections"} <= set(db.table_names())
    assert db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    # reopening applies nothing
    assert schema.migrate(db) == []


def test_newer_store_is_refused(tmp_path):
    path = str(tmp_path / "s.db")
    schema.connect(path).conn.execute(f"PRAGMA user_version={schema.LATEST_VERSION + 1}")
    with pytest.raises(schema.StoreError, match="newer than this collector"):
        schema.connect(path)


def test_migration_failure_rolls_back(tmp_path, monkeypatch):
    path = str(tmp_path / "s.db")
    schema.connect(path).conn.close()
    before = schema.LATEST_VERSION
    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS + [(99, "CREATE TABLE t99 (x); SELECT nonsense(")])
    monkeypatch.setattr(schema, "LATEST_VERSION", 99)
    with pytest.raises(schema.StoreError):
        schema.connect(path)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == before
    assert not conn.execute("SELECT name FROM sqlite_master WHERE name='t99'").fetchall()


def test_writer_stores_and_reader_lists(tmp_path):
    path = str(tmp_path / "s.db")
    w = StoreWriter(path)
    w.start()
    try:
        t = time.monotonic_ns()
        w.submit(AgentUpdate("n1", {"hostname": "h1", "connected": 1,
                                    "sources": {"host": {"up": True, "reason": ""}}}))
        recs = [r.Metric(t, "gpu_utilization_percent", "gpu0", 87.0),
                r.GpuInfo(t, 0, "GPU-x", "H100", "0:1b", 80 * 2**30),
                r.ProcessInfo(t, 10, 55, job_key="job1", rank=2, world_size=4),
                r.Metric(t, "process_cpu_percent", "pid:10:55", 99.0),
                r.Metric(t + 1, "process_resident_memory_bytes", "pid:10:55", 2.0**30)]
        assert _write(w, "n1", 1, recs)[0] == "stored"
        reader = Reader(path)
        (node,) = reader.nodes()
        assert node["node_id"] == "n1" and node["records_stored"] == 5 and node["sources"]["host"]["up"]
        (gpu,) = reader.gpus()
        assert gpu["uuid"] == "GPU-x" and gpu["latest"]["gpu_utilization_percent"]["value"] == 87.0
        assert gpu["latest"]["gpu_utilization_percent"]["ts_ns"] == t + CLOCK.offset_ns  # cluster time
        (proc,) = reader.procs()
        assert proc["rank"] == 2 and proc["alive"] and proc["cpu_percent"] == 99.0 and proc["rss_bytes"] == 2**30
        assert _write(w, "n1", 2, [r.ProcessExit(t + 5, 10, 55)])[0] == "stored"
        assert reader.procs(alive_only=True) == [] and not reader.procs()[0]["alive"]
    finally:
        w.stop()


def test_retention_deletes_old_rows_and_keeps_dedupe(tmp_path):
    path = str(tmp_path / "s.db")
    w = StoreWriter(path)
    w.start()
    try:
        t = max(time.monotonic_ns(), 200 * 10**9)  # rows reach 100 s back: never before boot on a fresh machine
        # sent at t, as an agent whose clock reads t sends them (a fresh machine's clock reads less: the store
        # would refuse rows ahead of the send time, and this test would pass only once the machine was up 140 s)
        _write(w, "n1", 1, [r.Metric(t - 10**9 * i, "m", "e", float(i)) for i in range(100, 0, -1)], sent_mono_ns=t)
        _write(w, "n1", 2, [r.Metric(t, "m", "e", 0.0), r.Event(t, "xid", "gpu0", "old", 1)], sent_mono_ns=t)
    finally:
        w.stop()
    w2 = StoreWriter(path)
    cutoff = t + CLOCK.offset_ns - 50 * 10**9  # keep the last 50 s
    w2.apply_retention(cutoff)
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT COUNT(*) FROM metrics").fetchone()[0] == 51  # t-50 s .. t-1 s, and t
    assert conn.execute("SELECT MIN(ts_ns) >= ? FROM metrics", (cutoff,)).fetchone()[0] == 1
    # the newest batch row per spool survives, so a replay after retention is still a duplicate
    assert conn.execute("SELECT MAX(seq) FROM batches").fetchone()[0] == 2
    w2.start()
    try:
        assert _write(w2, "n1", 2, [r.Metric(t + 5, "m", "e", 0.0)], sent_mono_ns=t + 5)[0] == "duplicate"
    finally:
        w2.stop()


def test_store_failure_leaves_batch_unacknowledged(tmp_path):
    path = str(tmp_path / "s.db")
    w = StoreWriter(path)
    w.start()
    try:
        t = time.monotonic_ns()
        assert _write(w, "n1", 1, [r.Metric(t, "m", "e", 1.0)])[0] == "stored"
        # simulate a full disk: SQLite refuses to grow the file past its current page count
        pages = w.conn.execute("PRAGMA page_count").fetchone()[0]
        w.conn.execute(f"PRAGMA max_page_count={pages}")
        big = [r.Metric(t + i + 1, f"m{i}", "e" * 200, 1.0) for i in range(3000)]
        outcome, _, note = _write(w, "n1", 2, big)
        assert outcome == "failed" and "full" in note
        w.conn.execute("PRAGMA max_page_count=1073741823")
        # nothing of the failed batch was written; the same batch is accepted when resent
        assert _write(w, "n1", 2, big)[0] == "stored"
        assert w.conn.execute("SELECT COUNT(*) FROM metrics").fetchone()[0] == 3001
    finally:
        w.stop()


def test_writer_groups_keep_rejections_duplicates_and_cluster_time(tmp_path):
    """41 batches queued at once (groups of many): a malformed payload among good ones is rejected alone, a resent
    batch is a duplicate, and samples keep the drifting clock's cluster time (ClockEstimate.to_cluster)."""
    drifting = ClockEstimate(offset_ns=1_000_000_000_000, drift_ppm=37.5, ref_mono_ns=123_456_789,
                             uncertainty_ns=50_000, best_rtt_ns=100_000, samples=9)
    w = StoreWriter(str(tmp_path / "s.db"))
    w.start()
    outcomes = {}
    try:
        t0 = 5_000_000_000
        jobs = []
        for seq in range(1, 41):
            recs = [r.Metric(t0 + seq * 1_000_003 + k, f"m{k % 7}", f"e{k % 3}", float(seq)) for k in range(50)]
            payload = encode_records([("t", x) for x in recs])
            if seq == 17:
                payload = b"\xff\xff not a RecordList"
            jobs.append(BatchJob("n1", "aa" * 8, seq, len(recs), payload, t0 + 10**12, drifting, time.time_ns(),
                                 lambda *a, seq=seq: outcomes.setdefault(seq, a)))
        jobs.append(BatchJob("n1", "aa" * 8, 5, 50, b"", t0 + 10**12, drifting, time.time_ns(),
                             lambda *a: outcomes.setdefault("resent", a)))
        for job in jobs:
            while not w.submit(job):
                time.sleep(0.001)
        deadline = time.monotonic() + 20
        while len(outcomes) < 41 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        w.stop()
    assert outcomes[17][0] == "rejected" and "malformed records payload" in outcomes[17][2]
    assert outcomes["resent"][0] == "duplicate"
    assert all(outcomes[s][0] == "stored" for s in range(1, 41) if s != 17)
    conn = sqlite3.connect(str(tmp_path / "s.db"))
    n, = conn.execute("SELECT COUNT(*) FROM metrics").fetchone()
    assert n == 39 * 50
    # the last sample of series (m0, e0): seq 40, k = 42 (k % 7 == 0 and k % 3 == 0)
    ts, value = conn.execute("SELECT m.ts_ns, m.value FROM metrics m JOIN series s ON s.id = m.series_id"
                             " WHERE s.name='m0' AND s.entity='e0' ORDER BY m.ts_ns DESC LIMIT 1").fetchone()
    assert value == 40.0 and ts == drifting.to_cluster(t0 + 40 * 1_000_003 + 42)
    assert ts != t0 + 40 * 1_000_003 + 42 + drifting.offset_ns   # the drift term is really there
