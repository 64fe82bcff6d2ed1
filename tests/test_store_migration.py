"""Schema 6 (findings, topologies): a store made by the schema before it upgrades in place when a collector opens
it, keeps its data, and serves jobs and findings from it."""

import sqlite3

from conftest import CollectorProc
from steplens.collector.store import schema


def _make_v5(path: str) -> None:
    """A store exactly as the collector before schema 6 left it (its migrations, applied the same way)."""
    conn = sqlite3.connect(path, isolation_level=None)
    for version, sql in schema.MIGRATIONS:
        if version > 5:
            break
        for stmt in [s for s in sql.split(";") if s.strip()]:
            conn.execute(stmt)
        conn.execute(f"PRAGMA user_version={version}")
    conn.execute("INSERT INTO agents(agent_id, first_seen_ns, last_seen_ns) VALUES ('n0', 1, 2)")
    conn.execute("INSERT INTO processes(agent_id, pid, start_ticks, job_key, rank, local_rank, world_size, started_ns)"
                 " VALUES ('n0', 100, 7, 'torchelastic:old', 0, 0, 2, 1000), ('n0', 101, 8, 'torchelastic:old', 1, 1, 2,"
                 " 1000)")
    conn.execute("INSERT INTO comm_members(comm_id, rank, nranks, host, pid, cuda_dev, nvml_dev, bus_id, global_rank,"
                 " job_key, via, agent_id, seen_ns) VALUES ('0xabc', 0, 2, 'n0', 100, 0, 0, '', 0, 'torchelastic:old',"
                 " 'nccl_log', 'n0', 5), ('0xabc', 1, 2, 'n0', 101, 1, 1, '', 1, '', 'nccl_log', 'n0', 5)")
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 5
    conn.close()


def test_v5_store_upgrades_and_serves(tmp_path):
    path = str(tmp_path / "old.db")
    _make_v5(path)
    c = CollectorProc(tmp_path, db=path).start()
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        assert conn.execute("PRAGMA user_version").fetchone()[0] == schema.LATEST_VERSION >= 6
        assert {"findings", "topologies"} <= {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        assert conn.execute("SELECT COUNT(*) FROM processes").fetchone()[0] == 2
        jobs = c.cli("jobs")
        assert [j["job_key"] for j in jobs] == ["torchelastic:old"]
        job = jobs[0]
        assert job["world_size"] == 2 and [r["rank"] for r in job["ranks"]] == [0, 1] and job["nodes"] == ["n0"]
        assert job["comms"] == [{"comm_id": "0xabc", "nranks": 2, "ranks": [0, 1], "ops": [], "via": ["nccl_log"]}]
        assert job["step_seconds"] is None and job["baseline_step_seconds"] is None and job["open_findings"] == []
        assert c.cli("findings") == [] and c.cli("topology") is None
    finally:
        c.stop()
    # and a second start applies nothing more
    db = schema.connect(path)
    assert schema.migrate(db) == []
