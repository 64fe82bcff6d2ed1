"""The ClickHouse store (collector/store/clickhouse.py) on a real ClickHouse engine: chDB, the engine in-process
(Debian's clickhouse-server 18.16 is too old for clickhouse-connect; FACTS.md). One chDB engine per process: every
test here uses its own database in one directory.

Parity: a simulated job (every record kind an agent sends: ProcessInfo, Step, CommSummary, Metric, Flow,
CommProgress and process-state Events of a hang) goes through the real writer into SQLite and into ClickHouse;
every read the detectors, Control and the CLI make gives the same answer, and every detector finds the same
findings on both."""

import itertools
import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

chdb = pytest.importorskip("chdb")   # a dependency of the test extra; skipped only outside `make test`

from bench.eval import scoring  # noqa: E402
from steplens.agent import records as r  # noqa: E402
from steplens.agent.transport.codec import encode_records  # noqa: E402
from steplens.collector.ingest.clock import ClockEstimate  # noqa: E402
from steplens.collector.store import clickhouse as chs  # noqa: E402
from steplens.collector.store import writer as w  # noqa: E402
from steplens.collector.store.queries import Reader  # noqa: E402
from steplens.sim.faults import parse_fault  # noqa: E402
from steplens.sim.model import ModelConfig  # noqa: E402

_N = itertools.count()
ALL_SOURCES = {r.Step: "flightrec", r.ProcessInfo: "procs", r.CommProgress: "flightrec", r.Event: "procs",
               r.CommSummary: "flightrec", r.Metric: "gpu", r.Flow: "netflows"}


@pytest.fixture
def url(engine_dir):
    return chs.parse_store(f"chdb://{engine_dir}?database=t{os.getpid()}_{next(_N)}")


def _clock():
    return ClockEstimate(offset_ns=time.time_ns() - time.monotonic_ns(), drift_ppm=0.0, ref_mono_ns=0,
                         uncertainty_ns=50_000, best_rtt_ns=100_000, samples=5)


def _submit(writer, agent, seq, records, clock, spool="ab" * 8):
    done = []
    writer.submit(w.BatchJob(agent, spool, seq, len(records), encode_records([("t", x) for x in records]),
                             time.monotonic_ns(), clock, time.time_ns(), lambda *a: done.append(a)))
    deadline = time.monotonic() + 30
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
    return done[0]


def _records(n: int, t0: int, pid: int = 10) -> list:
    return [r.Metric(t0 + i, "gpu_utilization_percent", "gpu0", float(i)) for i in range(n)] + \
        [r.ProcessInfo(t0, pid, 55, job_key="job1", rank=0, world_size=2)]


def test_store_addresses_parse_and_bad_ones_say_why():
    assert chs.parse_store("clickhouse://u:p%40ss@ch1:9000/tele") == chs.StoreURL(
        "clickhouse", host="ch1", port=9000, database="tele", user="u", password="p@ss")
    assert chs.parse_store("clickhouses://ch1/x").port == 8443 and chs.parse_store("clickhouse://ch1").port == 8123
    assert chs.parse_store("chdb:///var/lib/sl?database=abc") == chs.StoreURL("chdb", path="/var/lib/sl",
                                                                               database="abc")
    assert chs.parse_store("/tmp/x.db").kind == "sqlite" and chs.parse_store("sqlite:///tmp/x.db").path == "/tmp/x.db"
    for bad, why in [("clickhouse://", "no host"), ("clickhouse://h:port/x", "port"), ("mysql://h/x", "unknown"),
                     ("clickhouse://h/a-b", "database name"), ("chdb://", "no directory"), ("", "empty")]:
        with pytest.raises(ValueError, match=why):
            chs.parse_store(bad)


def test_an_unreachable_server_is_a_clear_error(tmp_path):
    with pytest.raises(chs.StoreError, match=r"cannot open the ClickHouse store \(clickhouse 127.0.0.1:9/x\)"):
        chs.ClickHouseWriter(str(tmp_path / "s.db"), chs.parse_store("clickhouse://127.0.0.1:9/x"))


def test_the_schema_is_partitioned_ordered_and_expires(url, tmp_path):
    wr = chs.ClickHouseWriter(str(tmp_path / "s.db"), url, retention_seconds=3 * 86400)
    try:
        ddl = wr.ch.query("SELECT create_table_query FROM system.tables WHERE database = ? AND name = 'steps'",
                          [url.database])[0][0]
        assert "MergeTree" in ddl and "PARTITION BY toYYYYMMDD" in ddl and "ORDER BY (job_key, end_ns)" in ddl
        assert "TTL" in ddl and "toIntervalSecond(259200)" in ddl
        # the writer builds each table's rows in the order its columns are declared here
        for table, cols in [("events", w.EVENT_COLS), ("gaps", w.GAP_COLS), ("rejections", w.REJECTION_COLS),
                            ("stack_summaries", w.STACK_COLS), ("flows", w.FLOW_COLS), ("conn_stats", w.CONN_COLS),
                            ("comm_summaries", w.COMM_SUMMARY_COLS), ("comm_progress", w.COMM_PROGRESS_COLS),
                            ("steps", w.STEP_COLS), ("iterations", w.ITERATION_COLS), ("batches", w.BATCH_COLS)]:
            assert tuple(c for c, _ in chs.TABLES[table][0]) == cols, table
    finally:
        wr.stop()
    # a collector started with a shorter retention changes the TTL; with none, removes it

    def ddl_after(retention):
        chs.ClickHouseWriter(str(tmp_path / "s.db"), url, retention_seconds=retention).stop()
        return wr.ch.query("SELECT create_table_query FROM system.tables WHERE database = ? AND name = 'metrics'",
                           [url.database])[0][0]
    assert "toIntervalSecond(3600)" in ddl_after(3600)
    assert " TTL " not in ddl_after(0)


def test_exactly_once_across_a_restart(url, tmp_path):
    clock, path = _clock(), str(tmp_path / "s.db")
    t0 = time.monotonic_ns()
    wr = chs.ClickHouseWriter(path, url)
    wr.start()
    assert _submit(wr, "n1", 1, _records(50, t0), clock)[0] == "stored"
    assert _submit(wr, "n1", 1, _records(50, t0), clock)[0] == "duplicate"
    wr.stop()
    wr = chs.ClickHouseWriter(path, url)   # a new collector on the same stores: the dedupe key survives
    wr.start()
    try:
        assert wr.last_seq("n1", "ab" * 8) == 1
        assert _submit(wr, "n1", 1, _records(50, t0), clock)[0] == "duplicate"
        assert _submit(wr, "n1", 2, _records(50, t0 + 100), clock)[0] == "stored"
        rd = chs.ClickHouseReader(path, url)
        pts = rd.metric_points("n1", ["gpu_utilization_percent"])[("gpu_utilization_percent", "gpu0")]
        assert len(pts) == 100 and len({t for t, _ in pts}) == 100
        (node,) = rd.nodes()
        assert node["batches_stored"] == 2 and node["batches_duplicate"] == 2 and node["records_stored"] == 102
    finally:
        wr.stop()


@pytest.mark.parametrize("fail_on", ["metrics", "batches", "commits"])
def test_a_write_that_fails_midway_leaves_nothing_and_the_resend_lands_once(url, tmp_path, fail_on):
    """ClickHouse has no transaction over tables: an insert that fails after others landed (into metrics: the first
    table; batches: the delivery record; commits: after the state committed) must leave no row behind, and the
    agent's resend (the batch was not acked) must store every record exactly once."""
    clock, path = _clock(), str(tmp_path / "s.db")
    t0 = time.monotonic_ns()
    wr = chs.ClickHouseWriter(path, url)
    real = wr.ch.insert
    armed = [True]

    def flaky(table, rows, cols, **kw):
        if table == fail_on and armed[0]:
            armed[0] = False
            raise w.BackendError(f"injected: {table} refused")
        return real(table, rows, cols, **kw)
    wr.ch.insert = flaky
    wr.start()
    try:
        out = _submit(wr, "n1", 1, _records(40, t0), clock)
        assert out[0] == "failed" and "injected" in out[2]
        db = url.database
        for table in ("metrics", "batches"):
            assert wr.ch.query(f"SELECT count() FROM {db}.{table}")[0][0] == 0, table
        assert _submit(wr, "n1", 1, _records(40, t0), clock)[0] == "stored"
        assert _submit(wr, "n1", 1, _records(40, t0), clock)[0] == "duplicate"
        rd = chs.ClickHouseReader(path, url)
        pts = rd.metric_points("n1", ["gpu_utilization_percent"])[("gpu_utilization_percent", "gpu0")]
        assert [v for _, v in pts] == [float(i) for i in range(40)]
        assert wr.ch.query(f"SELECT count() FROM {db}.metrics")[0][0] == 40
        assert rd.procs()[0]["job_key"] == "job1"
    finally:
        wr.stop()


def test_rows_of_a_write_cut_by_a_crash_are_removed_at_start(url, tmp_path):
    clock, path = _clock(), str(tmp_path / "s.db")
    t0 = time.monotonic_ns()
    wr = chs.ClickHouseWriter(path, url)
    wr.start()
    assert _submit(wr, "n1", 1, _records(10, t0), clock)[0] == "stored"
    wr.stop()
    # what a collector killed between its inserts leaves: rows of seq 2, no commit row
    top = chs.committed_rid(wr.ch)
    wr.ch.insert("metrics", [("n1", "gpu_utilization_percent", "gpu0", time.time_ns(), 1.0, "ab" * 8, 2, top + 5,
                              "")], tuple(c for c, _ in chs.TABLES["metrics"][0]) + chs.DELIVERY)
    wr.ch.insert("batches", [("n1", "ab" * 8, 2, 1, 0, 10, time.time_ns(), 0, 0, "ab" * 8, 2, top + 5, "")],
                 tuple(c for c, _ in chs.TABLES["batches"][0]) + chs.DELIVERY)
    wr2 = chs.ClickHouseWriter(path, url)
    wr2.start()
    try:
        assert wr2.recoveries == 1
        assert wr2.last_seq("n1", "ab" * 8) == 1   # seq 2 was never acked: the agent resends it
        assert _submit(wr2, "n1", 2, _records(10, t0 + 100), clock)[0] == "stored"
        assert wr2.ch.query(f"SELECT count() FROM {url.database}.metrics")[0][0] == 20
    finally:
        wr2.stop()


def _canon(x):
    """Order-free form of a read's answer (rows with equal sort keys may come in either store's storage order)."""
    if isinstance(x, dict):
        return ("dict", tuple(sorted(((repr(k), _canon(v)) for k, v in x.items()), key=repr)))
    if isinstance(x, (list, tuple)):
        items = [_canon(v) for v in x]
        return sorted(items, key=repr) if isinstance(x, list) else tuple(items)
    return x


def test_sqlite_and_clickhouse_give_the_same_answers_and_findings(url, tmp_path):
    cfg = ModelConfig(dp=4, pp=2, tp=2, micro_batches=4, iterations=40, gpus_per_node=8, nodes_per_leaf=2, spines=2,
                      seed=5)
    faults = [parse_fault(s, cfg.topology()) for s in ("slow_gpu:5:12:20:3", "hang:9:30:31:40")]
    sql_path, ch_state = str(tmp_path / "a.db"), str(tmp_path / "b.db")
    for path, writer in [(sql_path, None), (ch_state, chs.ClickHouseWriter(ch_state, url, retention_seconds=0))]:
        # retention 0: the simulated job ran on a fixed date long ago (a TTL would expire its rows on insert)
        feed = scoring.StoreFeed(cfg, path, batch=500, writer=writer, sources=ALL_SOURCES)
        try:
            for aid, rec in scoring.agentview.agent_records(cfg, faults, scoring.JOB, scoring.MONO_BASE):
                feed.add(aid, rec)
            feed.flush()
            feed.topology(cfg)
            feed.wait()
        finally:
            feed.close()
        feed.check()
    a, b = Reader(sql_path), chs.ClickHouseReader(ch_state, url)
    sizes = b.table_sizes()
    for table in ("metrics", "steps", "comm_summaries", "comm_progress", "flows", "events", "batches"):
        assert sizes.get(table, {}).get("rows", 0) > 0, (table, sizes)
    job = scoring.JOB
    steps = a.steps(job, with_comms=True)
    mid = steps[len(steps) // 2]["end_ns"]
    nodes = [n["node_id"] for n in a.nodes()]
    reads = {
        "jobs": lambda x: x.jobs(),
        "steps": lambda x: x.steps(job, with_comms=True),
        "steps_ranks": lambda x: x.steps(job, ranks=[1, 5], since_ns=mid),
        "steps_after": lambda x: x.steps_after(job, 0)[0],
        "steps_after_before": lambda x: x.steps_after(job, 0, since_ns=mid, before_ns=mid + 10**9)[0],
        "comm_summaries": lambda x: x.comm_summaries(job, limit=10**6),
        "comm_summaries_ranks": lambda x: x.comm_summaries(job, ranks=[3], since_ns=mid),
        "comm_progress": lambda x: x.comm_progress(job),
        "comm_progress_latest": lambda x: x.comm_progress_latest(job),
        "comm_progress_latest_mid": lambda x: x.comm_progress_latest(job, until_ns=mid),
        "metric_points": lambda x: [x.metric_points(n, ["gpu_utilization_percent", "gpu_sm_clock_mhz"])
                                    for n in nodes],
        "metric_points_window": lambda x: x.metric_points(nodes[0], ["gpu_power_watts"], ["gpu0", "gpu3"],
                                                          since_ns=mid, until_ns=mid + 5 * 10**9),
        "flow_rows": lambda x: x.flow_rows(0, 1 << 62),
        "flows_pair": lambda x: x.flows(by="pair", limit=10**6),
        "flows_conn": lambda x: x.flows(by="connection", node_id=nodes[1], limit=10**6),
        "process_events": lambda x: x.process_events(),
        "node_events": lambda x: [x.node_events(n, ("process_stopped", "process_running")) for n in nodes],
        "data_watermarks": lambda x: x.data_watermarks([job, "nope"]),
        "new_data": lambda x: x.new_data_since(0)[1],
        "iterations": lambda x: x.iterations(job),
        "gaps": lambda x: x.gaps(),
        "stacks": lambda x: x.stacks(),
        "procs": lambda x: x.procs(),
        "comms": lambda x: x.comms(job),
    }
    for name, read in reads.items():
        got_a, got_b = read(a), read(b)
        assert _canon(got_a) == _canon(got_b), name
        if name in ("steps", "comm_progress", "process_events", "flow_rows", "metric_points"):
            assert got_a, name   # a read that finds nothing in both proves nothing
    # incremental reads go on from where they stopped: nothing new, then what a later write brings
    marks, _ = b.new_data_since(0)
    assert b.new_data_since(marks)[1] == {}
    rows, top = b.steps_after(job, 0)
    assert b.steps_after(job, top) == ([], top)
    # every detector finds the same on both stores (findings' ids are content hashes: equal findings, equal ids)
    def key(found):
        return sorted((n, f.kind, f.onset_ns, tuple((s.kind, s.id, s.cause) for s in f.suspects)) for n, f in found)
    kinds = set()
    in_hang = next(s["end_ns"] for s in steps if s["rank"] == 9 and s["step"] == 29) + 25 * 10**9
    for end in (in_hang, max(s["end_ns"] for s in steps) + 1):
        fa, _ = scoring.run_detectors(scoring.AnalysisReader(a, scoring.sim_fetcher(cfg, faults)), end)
        fb, _ = scoring.run_detectors(scoring.AnalysisReader(b, scoring.sim_fetcher(cfg, faults)), end)
        assert key(fa) == key(fb)
        kinds |= {f.kind for _, f in fa}
    assert {"hang", "slowdown"} <= kinds, kinds


def test_a_collector_on_chdb_serves_a_real_agent(tmp_path):
    """The collector's own process holds the engine: `steplens-collector serve --store chdb://...` with a real
    agent over gRPC; the CLI lists the node, its metrics and its processes, read from ClickHouse."""
    import sqlite3

    from tests.conftest import AgentProc, CollectorProc, wait_for
    engine = str(tmp_path / "engine")
    c = CollectorProc(tmp_path, extra=["--store", f"chdb://{engine}?database=e2e"]).start()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "torch.distributed.run"],
                           env=dict(env, RANK="0", WORLD_SIZE="1", STEPLENS_JOB="chjob"))
    a = AgentProc(tmp_path, "n-ch", c.address).start()
    try:
        node = wait_for(lambda: (c.node("n-ch") or {}).get("records_stored", 0) > 0 and c.node("n-ch"), 90,
                        interval=1, what="records stored")
        assert node["batches_stored"] > 0 and node["gaps"] == 0
        wait_for(lambda: any(p["job_key"] == "chjob" and p["rss_bytes"] for p in c.cli("procs")), 60, interval=1,
                 what="the job's process with its figures")
        (j,) = [j for j in c.cli("jobs") if j["job_key"] == "chjob"]
        assert [r["rank"] for r in j["ranks"]] == [0] and j["nodes"] == ["n-ch"]
    finally:
        job.kill()
        job.wait()
        a.stop()
        c.stop()
    with open(c.log.name, errors="replace") as fh:
        log = fh.read()
    assert f"store chdb {engine} database e2e (state {c.db})" in log, log[-2000:]
    # the telemetry went to ClickHouse, the state file kept the series' newest values only
    db = sqlite3.connect(c.db)
    assert db.execute("SELECT COUNT(*) FROM metrics").fetchone()[0] == 0
    assert db.execute("SELECT COUNT(*) FROM series").fetchone()[0] > 0
    q = subprocess.run([sys.executable, "-c",
                        "import clickhouse_connect; c = clickhouse_connect.get_client(interface='chdb', "
                        f"path={engine!r}); print(c.query('SELECT count() FROM e2e.metrics').result_rows[0][0])"],
                       capture_output=True, text=True, timeout=120)
    assert q.returncode == 0 and int(q.stdout.strip()) > 0, q.stderr[-2000:]


def test_a_store_that_fails_under_a_control_call_answers_unavailable_with_the_reason(url, tmp_path):
    """A ClickHouse server that goes away under the collector: `steplens nodes` says so (UNAVAILABLE and the
    driver's reason), and answers again once it is back."""
    import asyncio
    import threading

    from steplens.collector.server import Collector, CollectorSettings
    from tests.conftest import STEPLENS, free_port
    port = free_port()
    c = Collector(CollectorSettings(db=str(tmp_path / "c.db"), store=f"chdb://{url.path}?database={url.database}",
                                    listen=f"127.0.0.1:{port}", insecure=True))
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    asyncio.run_coroutine_threadsafe(c.start(), loop).result(30)
    client = c.control.reader.ch.client
    real = client.query

    def gone(*a, **k):
        raise ConnectionError("HTTPConnectionPool(host='ch1', port=8123): Max retries exceeded")
    try:
        cli = [STEPLENS, "--collector", f"127.0.0.1:{port}", "--insecure", "nodes"]
        client.query = gone
        out = subprocess.run(cli, capture_output=True, text=True, timeout=30)
        assert out.returncode != 0 and "UNAVAILABLE" in out.stderr and "Max retries exceeded" in out.stderr, out
        client.query = real
        assert subprocess.run(cli, capture_output=True, text=True, timeout=30).returncode == 0
    finally:
        client.query = real
        asyncio.run_coroutine_threadsafe(c.stop(0.5), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        th.join(10)


def test_two_collectors_on_one_store_store_a_batch_once_when_its_agent_moves_between_them(url, tmp_path):
    """Two collectors' writers on one ClickHouse database (each with its own state file): the agent streams seq 1
    to `a`, moves to `b` (seq 2 stored there; `b` dies before acking it), and comes back to `a`, which still
    remembers seq 1 from the first stream. The Hello's last_seq reads the store again, so `a` takes the resent
    seq 2 for the duplicate it is."""
    clock = _clock()
    t0 = time.monotonic_ns()
    a = chs.ClickHouseWriter(str(tmp_path / "a.db"), url)
    b = chs.ClickHouseWriter(str(tmp_path / "b.db"), url)
    a.start()
    b.start()
    try:
        assert _submit(a, "n1", 1, _records(20, t0), clock)[0] == "stored"
        assert _submit(b, "n1", 2, _records(20, t0 + 100), clock)[0] == "stored"
        assert a.last_seq("n1", "ab" * 8) == 2   # the agent's Hello on `a` again
        assert _submit(a, "n1", 2, _records(20, t0 + 100), clock)[0] == "duplicate"
        assert a.ch.query(f"SELECT count() FROM {url.database}.metrics")[0][0] == 40
    finally:
        a.stop()
        b.stop()


def _steps(job: str, rank: int, t0: int, n: int = 3) -> list:
    return [r.Step(t0 + (i + 1) * 1000, 10 + rank, 55, job, rank, i, t0 + i * 1000, t0 + (i + 1) * 1000,
                   "comm_pattern", 4, 4) for i in range(n)]


class _Paused:
    """Holds a writer's group after its first insert (into `table`) until released: a collector caught between
    its inserts, its group in flight while others write."""

    def __init__(self, writer, table: str = "metrics") -> None:
        import threading
        self.table = table
        self.holding, self.release = threading.Event(), threading.Event()
        writer.ch = _Wrapped(writer.ch, self)


class _Wrapped:
    def __init__(self, ch, pause: _Paused) -> None:
        self._ch, self._pause = ch, pause

    def __getattr__(self, name):
        return getattr(self._ch, name)

    def insert(self, table, rows, cols, **kw):
        out = self._ch.insert(table, rows, cols, **kw)
        if table == self._pause.table and not self._pause.release.is_set():
            self._pause.holding.set()
            assert self._pause.release.wait(30)
        return out


def test_two_writers_on_one_store_recover_only_their_own_rows_and_readers_miss_no_late_commit(url, tmp_path):
    """Collector b's group is caught between its inserts (its rows in, no commit) after collector a's last commit;
    a restarts (its recovery runs) and stores a later group. b's rows stay (they are b's to judge, b is alive);
    a reader's incremental marks taken while b's group was in flight still read b's group once it commits, though
    a group of a with a higher id committed first."""
    import threading
    clock = _clock()
    t0 = time.monotonic_ns()
    db = url.database
    a = chs.ClickHouseWriter(str(tmp_path / "a.db"), url, writer_id="a")
    b = chs.ClickHouseWriter(str(tmp_path / "b.db"), url, writer_id="b")
    a.start()
    b.start()
    rd = chs.ClickHouseReader(str(tmp_path / "a.db"), url)
    pause = _Paused(b)
    out_b: list = []
    try:
        assert _submit(a, "na", 1, _records(20, t0) + _steps("jobA", 0, t0), clock)[0] == "stored"
        mark0, jobs = rd.new_data_since(0)
        assert set(jobs) == {"jobA"}
        th = threading.Thread(target=lambda: out_b.append(
            _submit(b, "nb", 1, _records(20, t0, pid=20) + _steps("jobB", 1, t0), clock)))
        th.start()
        assert pause.holding.wait(30)
        a.stop()
        a = chs.ClickHouseWriter(str(tmp_path / "a.db"), url, writer_id="a")   # a restarts: recovery runs
        a.start()
        assert a.ch.query(f"SELECT count() FROM {db}.metrics WHERE _writer = 'b'")[0][0] == 20   # b's rows stay
        assert _submit(a, "na", 2, _steps("jobA", 0, t0 + 10_000), clock)[0] == "stored"
        mark1, jobs = rd.new_data_since(mark0)
        assert set(jobs) == {"jobA"}            # b's group is in flight: not read yet
        steps_b, smark = rd.steps_after("jobB", 0)
        assert steps_b == []
        pause.release.set()
        th.join(30)
        assert out_b and out_b[0][0] == "stored"
        mark2, jobs = rd.new_data_since(mark1)
        assert set(jobs) == {"jobB"}            # committed after a's later group, read all the same
        assert rd.new_data_since(mark2)[1] == {}
        more, _ = rd.steps_after("jobB", smark)
        assert [s["step"] for s in more] == [0, 1, 2]
        assert a.ch.query(f"SELECT count() FROM {db}.metrics")[0][0] == 40
        assert a.last_seq("nb", "ab" * 8) == 1 and a.last_seq("na", "ab" * 8) == 2
    finally:
        pause.release.set()
        a.stop()
        b.stop()


def test_a_dead_collectors_unfinished_rows_are_removed_by_a_survivor_and_a_live_ones_are_not(url, tmp_path):
    """What a collector killed between its inserts leaves (rows, no commit) is deleted by another collector once
    the dead one's heartbeats are older than peer_dead_seconds; a collector heard from lately keeps its rows in
    flight. Committed rows of either stay."""
    clock = _clock()
    t0 = time.monotonic_ns()
    db = url.database
    dead = chs.ClickHouseWriter(str(tmp_path / "d.db"), url, writer_id="dead")
    dead.start()
    assert _submit(dead, "nd", 1, _records(5, t0), clock)[0] == "stored"
    dead.stop()
    now = time.time_ns()
    cols = tuple(c for c, _ in chs.TABLES["metrics"][0]) + chs.DELIVERY
    hb_cols = tuple(c for c, _ in chs.TABLES["collectors"][0]) + chs.DELIVERY
    top = chs.committed_rid(dead.ch, "dead")
    for peer, hb in (("dead", now - 700 * 10**9), ("live", now)):
        dead.ch.insert("collectors", [(peer, "x:1", hb, hb, "", 0, 1, peer)], hb_cols)
        dead.ch.insert("commits", [(1, hb, peer)], ("_rid", "ts_ns", "writer"))
        dead.ch.insert("metrics", [("n-" + peer, "m", "e", now, 1.0, "ab" * 8, 2, top + 10, peer)], cols)
    sv = chs.ClickHouseWriter(str(tmp_path / "s.db"), url, writer_id="survivor", peer_dead_seconds=600)
    try:
        assert sv.peer_cleanups == 1
        left = dict(sv.ch.query(f"SELECT _writer, count() FROM {db}.metrics GROUP BY _writer"))
        assert left == {"dead": 5, "live": 1}   # the dead one's committed rows stay, its unfinished row went
    finally:
        sv.stop()


def test_a_group_past_the_commit_fence_is_given_up_and_its_resend_lands_once(url, tmp_path):
    """A collector paused between its inserts for longer than the fence (a survivor may have judged it dead and
    cleaned its rows) does not commit: the batch fails unacked, the rows go, and the resend is stored once."""
    clock = _clock()
    t0 = time.monotonic_ns()
    wr = chs.ClickHouseWriter(str(tmp_path / "s.db"), url, writer_id="w", commit_fence_seconds=0.2)
    real = wr.ch.insert

    def slow(table, rows, cols, **kw):
        if table == "batches" and wr.commit_fence_s < 1:
            time.sleep(0.4)
        return real(table, rows, cols, **kw)
    wr.ch.insert = slow
    wr.start()
    try:
        out = _submit(wr, "n1", 1, _records(10, t0), clock)
        assert out[0] == "failed" and "commit fence" in out[2] and wr.fenced == 1
        assert wr.ch.query(f"SELECT count() FROM {url.database}.metrics")[0][0] == 0
        wr.commit_fence_s = 60.0
        assert _submit(wr, "n1", 1, _records(10, t0), clock)[0] == "stored"
        assert _submit(wr, "n1", 1, _records(10, t0), clock)[0] == "duplicate"
        assert wr.ch.query(f"SELECT count() FROM {url.database}.metrics")[0][0] == 10
    finally:
        wr.stop()


def test_a_database_written_before_writer_ids_reads_on(url, tmp_path):
    """Tables made by the schema before rows named their writer gain the column (rows and commits of writer
    ''), and what was stored reads and deduplicates as before."""
    clock = _clock()
    t0 = time.monotonic_ns()
    ch = chs.open_ch(url)
    db = url.database
    for table, (cols, tcol, order) in chs.TABLES.items():
        body = ", ".join(f"{n} {t}" for n, t in cols) + ", _spool String, _seq Int64, _rid UInt64"
        ch.command(f"CREATE TABLE {db}.{table} ({body}) ENGINE = MergeTree ORDER BY ({order})")
    ch.command(f"CREATE TABLE {db}.commits (_rid UInt64, ts_ns Int64) ENGINE = MergeTree ORDER BY _rid")
    old = tuple(c for c, _ in chs.TABLES["batches"][0]) + ("_spool", "_seq", "_rid")
    ch.insert("batches", [("n1", "ab" * 8, 1, 1, 0, 10, time.time_ns(), 0, 0, "ab" * 8, 1, 7)], old)
    ch.insert("commits", [(7, time.time_ns())], ("_rid", "ts_ns"))
    wr = chs.ClickHouseWriter(str(tmp_path / "s.db"), url, writer_id="new")
    wr.start()
    try:
        assert wr.last_seq("n1", "ab" * 8) == 1
        assert _submit(wr, "n1", 1, _records(5, t0), clock)[0] == "duplicate"
        assert _submit(wr, "n1", 2, _records(5, t0), clock)[0] == "stored"
        assert chs.commit_marks(wr.ch).keys() == {"", "new"}
    finally:
        wr.stop()


def _sync(writer) -> None:
    """The writer's state sync, run now and waited for (the heartbeat runs it every few seconds)."""
    done = []
    writer.submit(w.StoreJob(writer._sync_state, lambda *a: done.append(a)))
    deadline = time.monotonic() + 30
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done and done[0][0] == "stored", done


def test_collectors_on_one_clickhouse_share_agents_processes_findings_and_deep_dives(url, tmp_path):
    """Two collectors, each with its own SQLite state: a job's two ranks stream to different collectors, one
    collector finds something; after a sync both list the job with both ranks, both agents (each with the
    collector that holds it), the finding, and the deep dive. An agent that moves is held by its new collector,
    whose row the other collector's stale one does not overwrite. A restart applies nothing twice."""
    from steplens.collector.analysis.findings import Change, Finding, Suspect
    from steplens.collector.store.diagnosis import write_changes
    clock = _clock()
    t0 = time.monotonic_ns()
    a = chs.ClickHouseWriter(str(tmp_path / "a.db"), url, writer_id="a")
    b = chs.ClickHouseWriter(str(tmp_path / "b.db"), url, writer_id="b")
    a.start()
    b.start()
    try:
        a.submit(w.AgentUpdate("na", {"hostname": "host-a", "connected": 1}))
        b.submit(w.AgentUpdate("nb", {"hostname": "host-b", "connected": 1}))
        assert _submit(a, "na", 1, [r.ProcessInfo(t0, 10, 55, job_key="job1", rank=0, world_size=2)], clock)[0] \
            == "stored"
        assert _submit(b, "nb", 1, [r.ProcessInfo(t0, 20, 56, job_key="job1", rank=1, world_size=2)], clock)[0] \
            == "stored"
        f = Finding("slowdown", 1000, 2000, 1.5, "rank 1 is slow", (Suspect("rank", "1", 1.0, "compute"),),
                    job_key="job1", detector="irregularity", id="f1")
        done = []
        a.submit(w.StoreJob(lambda conn: write_changes(conn, [Change("opened", f)], time.time_ns()),
                            lambda *x: done.append(x)))
        while not done:
            time.sleep(0.01)
        for x in (a, b, a, b):
            _sync(x)
        for name in ("a.db", "b.db"):
            rd = chs.ClickHouseReader(str(tmp_path / name), url)
            (job,) = rd.jobs()
            assert job["job_key"] == "job1" and sorted(x["rank"] for x in job["ranks"]) == [0, 1], (name, job)
            assert {x["node_id"] for x in job["ranks"]} == {"na", "nb"}, job
            nodes = {n["node_id"]: n["collector"] for n in rd.nodes()}
            assert nodes == ({"na": "", "nb": "b"} if name == "a.db" else {"na": "a", "nb": ""})
            assert [f.id for f in rd.findings()] == ["f1"], name
        assert b.state_applied >= 3 and a.state_applied >= 2
        held = dict(b.conn.execute("SELECT agent_id, collector_id FROM agents"))
        assert held == {"na": "a", "nb": ""}
        # nb moves to a, and b notices the lost stream only after the Hello on a (its keepalive): a holds it, and
        # b's late disconnect does not undo that, on either collector
        a.submit(w.AgentUpdate("nb", {"hostname": "host-b", "connected": 1}))
        _sync(a)
        b.submit(w.AgentUpdate("nb", {"connected": 0}))
        _sync(b)
        for x in (a, b, a):
            _sync(x)
        assert a.conn.execute("SELECT connected, collector_id FROM agents WHERE agent_id = 'nb'").fetchone() == (1, "")
        assert b.conn.execute("SELECT connected, collector_id FROM agents WHERE agent_id = 'nb'").fetchone() == (1, "a")
        before = b.state_applied
        b.stop()
        b = chs.ClickHouseWriter(str(tmp_path / "b.db"), url, writer_id="b")   # marks kept: nothing again
        b.start()
        _sync(b)
        assert b.state_applied == 0 and before > 0
    finally:
        a.stop()
        b.stop()


def test_state_of_a_group_that_failed_after_its_state_committed_is_sent_again(url, tmp_path):
    """The commit row's insert fails: the state (a new process) is in this collector's SQLite, its state-log
    row was deleted with the group's other rows. It goes with the next group, and the other collector sees it."""
    clock = _clock()
    t0 = time.monotonic_ns()
    a = chs.ClickHouseWriter(str(tmp_path / "a.db"), url, writer_id="a")
    b = chs.ClickHouseWriter(str(tmp_path / "b.db"), url, writer_id="b")
    real = a.ch.insert
    armed = [True]

    def flaky(table, rows, cols, **kw):
        if table == "commits" and armed[0]:
            armed[0] = False
            raise w.BackendError("injected: commits refused")
        return real(table, rows, cols, **kw)
    a.ch.insert = flaky
    a.start()
    b.start()
    try:
        out = _submit(a, "na", 1, [r.ProcessInfo(t0, 10, 55, job_key="job1", rank=0, world_size=1)], clock)
        assert out[0] == "failed"
        assert a.conn.execute("SELECT count(*) FROM processes").fetchone()[0] == 1   # the state committed
        metrics = [r.Metric(t0 + 10 + i, "gpu_utilization_percent", "gpu0", 1.0) for i in range(3)]
        assert _submit(a, "na", 2, metrics, clock)[0] == "stored"   # nothing in it changes a process
        _sync(b)
        assert b.conn.execute("SELECT agent_id, pid FROM processes").fetchall() == [("na", 10)]
    finally:
        a.stop()
        b.stop()
