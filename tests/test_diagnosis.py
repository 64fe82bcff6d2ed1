"""Diagnosis end to end on loopback: a real collector (in this process, so the test can hand it a detector of
its own; nothing is registered) with a real SQLite store, data from agents over the real Ingest stream, and
the real CLI: the analysis loop runs the detector on new data and a finding opens, is watched, listed,
diagnosed on demand, shown in `jobs` and on /metrics, and resolves itself when the job is back at baseline."""

import asyncio
import json
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass
from statistics import median

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import STEPLENS, free_port, wait_for
from steplens.agent import records as r
from steplens.agent.transport.codec import encode_records
from steplens.collector.analysis.base import AnalysisSettings, DetectorConfig, DetectorSpec, Window
from steplens.collector.analysis.engine import AnalysisEngine
from steplens.collector.analysis.findings import Finding, Suspect
from steplens.collector.ingest.clock import ClockEstimate
from steplens.collector.server import Collector, CollectorSettings
from steplens.collector.store.queries import Reader
from steplens.collector.store.writer import BatchJob, StoreWriter
from wire import RawAgent

MS = 10**6
JOB = "torchelastic:job-a"
COMM = "0xdp0"


@dataclass
class OutlierConfig(DetectorConfig):
    ratio: float = 3.0    # a rank's longest op this many times the window's median: slow


class OutlierDetector:
    """A detector for this test only: the rank whose longest comm op in a step is `ratio` x the median of the
    window is to blame. It reads the stored comm summaries through the store reader, like a real one."""

    def __init__(self) -> None:
        self.windows: list[Window] = []

    def detect(self, reader, window: Window, cfg: OutlierConfig) -> list[Finding]:
        self.windows.append(window)
        rows = [x for x in reader.comm_summaries(window.job_key, since_ns=window.since_ns)
                if x["end_ns"] <= window.until_ns]
        if not rows:
            return []
        med = median(x["max_ns"] for x in rows)
        out = []
        for rank in sorted({x["rank"] for x in rows}):
            slow = [x for x in rows if x["rank"] == rank and x["max_ns"] >= cfg.ratio * med]
            if slow:
                worst = max(x["max_ns"] for x in slow) / med
                out.append(Finding(kind="slowdown", onset_ns=min(x["start_ns"] for x in slow),
                                   last_ns=max(x["end_ns"] for x in slow), severity=worst,
                                   summary=f"rank {rank} holds {COMM} up {worst:.1f}x in {len(slow)} steps",
                                   suspects=(Suspect("rank", str(rank), 1.0, "compute", {"steps": len(slow)}),),
                                   evidence={"median_max_ns": med, "steps": [x["step"] for x in slow]}))
        return out


def broken(reader, window, cfg):
    raise RuntimeError("this detector always fails")


class InProcessCollector:
    def __init__(self, tmp_path, detectors: dict, configs: dict, analysis: AnalysisSettings) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.db = str(tmp_path / "collector.db")
        self.c = Collector(CollectorSettings(db=self.db, listen=f"127.0.0.1:{self.port}", insecure=True,
                                             analysis=analysis, detectors=detectors, detector_configs=configs,
                                             metrics_listen=f"127.0.0.1:{self.metrics_port}"))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.c.start(), self.loop).result(30)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([STEPLENS, "--collector", self.address, "--insecure", *args], capture_output=True,
                             text=True, timeout=60)
        if check:
            assert out.returncode == 0, out.stderr
        return out

    def json(self, *args: str):
        return json.loads(self.cli(*args, "--json").stdout)

    def metrics(self) -> dict:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        return {s.name + json.dumps(s.labels, sort_keys=True): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.c.stop(0.5), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def steps(base: int, first: int, last: int, slow_rank: int = -1) -> dict[str, list]:
    """Per-step comm summaries of a 4-rank job (ranks 0, 1 on n0; 2, 3 on n1), one step per 100 ms."""
    out = {"n0": [], "n1": []}
    for s in range(first, last + 1):
        for rank in range(4):
            start = base + s * 100 * MS
            longest = 200 * MS if rank == slow_rank else 20 * MS
            out["n0" if rank < 2 else "n1"].append(r.CommSummary(
                start + 30 * MS, 1000 + rank, COMM, "allreduce", start, 4, 1 << 20, 25 * MS, longest, start_ticks=7,
                job_key=JOB, rank=rank, step=s))
    return out


@pytest.fixture
def setup(tmp_path):
    det = OutlierDetector()
    specs = {"outlier": DetectorSpec("outlier", "test: a rank's ops far above the window's median", ("slowdown",),
                                     OutlierConfig, det.detect),
             "broken": DetectorSpec("broken", "test: always raises", ("slowdown",), DetectorConfig, broken)}
    configs = {"outlier": OutlierConfig(window_seconds=1.0, resolve_after_seconds=2.0)}
    col = InProcessCollector(tmp_path, specs, configs, AnalysisSettings(interval_seconds=0.2, max_cpu_fraction=1.0))
    agents = {n: RawAgent(col.address, n) for n in ("n0", "n1")}
    for a in agents.values():
        a.hello()
    yield col, det, agents
    for a in agents.values():
        a.close()
    col.stop()


def test_findings_lifecycle_through_the_collector(setup):
    col, det, agents = setup
    base = time.monotonic_ns() - 20 * 10**9
    seqs = {"n0": 0, "n1": 0}

    def send(batches: dict[str, list]) -> None:
        for node, recs in batches.items():
            seqs[node] += 1
            agents[node].batch(seqs[node], recs)
            assert agents[node].wait_ack(seqs[node]).rejected_records == 0

    watch = subprocess.Popen([STEPLENS, "--collector", col.address, "--insecure", "findings", "--watch", "--job", JOB],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    events: list[dict] = []
    reader = threading.Thread(target=lambda: [events.append(json.loads(line)) for line in watch.stdout], daemon=True)
    reader.start()
    try:
        # processes with job, rank and world size; the communicator; 20 normal steps
        first = steps(base, 0, 19)
        for node, ranks in (("n0", (0, 1)), ("n1", (2, 3))):
            first[node] = [r.ProcessInfo(base, 1000 + k, 7, framework="torch", job_key=JOB, rank=k, local_rank=k % 2,
                                         world_size=4) for k in ranks] + \
                          [r.CommMember(base, COMM, k, 4, node, 1000 + k, k % 2, k % 2, f"0000:0{k}:00.0", k, JOB)
                           for k in ranks] + first[node]
        send(first)
        wait_for(lambda: col.c.analysis.stats["outlier"].runs >= 1, 20, what="the loop to run the detector")
        assert col.json("findings") == []
        assert det.windows[0].job_key == JOB and det.windows[0].until_ns - det.windows[0].since_ns == 10**9

        # rank 2 holds the all-reduce up for 10 steps: the loop opens a finding
        send(steps(base, 20, 29, slow_rank=2))
        found = wait_for(lambda: col.json("findings", "--open"), 20, what="an open finding")
        assert len(found) == 1
        f = found[0]
        assert f["job_key"] == JOB and f["kind"] == "slowdown" and f["detector"] == "outlier"
        assert f["status"] == "open" and f["severity"] == pytest.approx(10.0)
        assert f["suspects"][0] == {"kind": "rank", "id": "2", "score": 1.0, "cause": "compute",
                                    "evidence": {"steps": 10}}
        assert f["evidence"]["steps"] == list(range(20, 30)) and "rank 2" in f["summary"]
        assert 0 < f["onset_ns"] < f["last_ns"] and abs(time.time_ns() - f["last_ns"]) < 60 * 10**9

        # jobs: ranks, nodes, the communicator, step time now and baseline, the open finding
        jobs = col.json("jobs")
        assert [j["job_key"] for j in jobs] == [JOB]
        j = jobs[0]
        assert j["world_size"] == 4 and [x["rank"] for x in j["ranks"]] == [0, 1, 2, 3]
        assert j["nodes"] == ["n0", "n1"] and all(x["alive"] and x["source"] == "procs" for x in j["ranks"])
        assert j["comms"] == [{"comm_id": COMM, "nranks": 4, "ranks": [0, 1, 2, 3], "ops": ["allreduce"],
                               "via": ["comm_summaries", "nccl_log"]}]
        assert j["step_seconds"] == pytest.approx(0.1) and j["baseline_step_seconds"] == pytest.approx(0.1)
        assert j["step_source"] == "comm_summaries" and [x["id"] for x in j["open_findings"]] == [f["id"]]
        assert "torchelastic:job-a" in col.cli("jobs").stdout

        # diagnose on demand: every detector now; the same finding re-confirmed; a failing one is reported
        out = col.cli("diagnose", JOB, "--since", "1h", "--json", check=False)
        assert out.returncode == 1 and "detector broken failed: RuntimeError: this detector always fails" in out.stderr
        diag = json.loads(out.stdout)
        assert [(d["id"], d["status"]) for d in diag] == [(f["id"], "open")] and diag[0]["confirmations"] >= 2
        assert col.c.analysis.stats["outlier"].runs >= 3

        m = col.metrics()
        assert m['steplens_collector_findings_open{"job_key": "torchelastic:job-a", "kind": "slowdown"}'] == 1
        assert m['steplens_collector_detector_success{"detector": "outlier"}'] == 1
        assert m['steplens_collector_detector_success{"detector": "broken"}'] == 0
        assert m['steplens_collector_detector_errors_total{"detector": "broken"}'] >= 2
        assert m['steplens_collector_detector_runs_total{"detector": "outlier"}'] >= 3
        assert m["steplens_collector_analysis_seconds_count{}"] >= 3
        assert m["steplens_collector_analysis_lag_seconds_count{}"] >= 2
        assert m['steplens_collector_finding_changes_total{"action": "opened"}'] == 1
        # the detectors' fetches of node-local detail (none here: the outlier detector reads the store only)
        assert m["steplens_collector_detail_fetch_asks_total{}"] == 0
        assert m['steplens_collector_detail_fetch_rows_total{"source": "agents"}'] == 0
        # ingest and per-agent figures (what deploy/prometheus's agent alerts read)
        assert m["steplens_collector_ingest_batches_total{}"] >= 4
        assert m["steplens_collector_ingest_records_total{}"] > 0
        for node in ("n0", "n1"):
            assert m[f'steplens_collector_agent_connected{{"node": "{node}"}}'] == 1
            assert m[f'steplens_collector_agent_records_stored_total{{"node": "{node}"}}'] > 0
            assert 0 <= m[f'steplens_collector_agent_last_seen_age_seconds{{"node": "{node}"}}'] < 60

        # back at baseline for 3 s of data time: the finding resolves itself
        send(steps(base, 30, 59))
        done = wait_for(lambda: [x for x in col.json("findings") if x["status"] == "resolved"], 20,
                        what="the finding resolved")
        assert done[0]["id"] == f["id"] and done[0]["resolved_ns"] > f["last_ns"] and done[0]["peak_severity"] >= 10
        assert col.json("findings", "--open") == [] and col.json("jobs")[0]["open_findings"] == []
        assert col.json("findings", "--job", "other") == [] and col.json("findings", "--since", "5s") == []
        assert len(col.json("findings", "--since", "1h")) == 1
        metrics = col.metrics()
        assert not any(k.startswith("steplens_collector_findings_open{") for k in metrics if metrics[k])
        # an operator's diagnose over the old window shows the event as history, it does not reopen it
        diag = json.loads(col.cli("diagnose", JOB, "--since", "1h", "--json", check=False).stdout)
        assert [(d["id"], d["status"]) for d in diag] == [(f["id"], "resolved")]
        assert col.json("findings", "--open") == []

        # the watch stream saw it open and resolve
        wait_for(lambda: any(e["event"] == "resolved" for e in events), 10, what="the resolved event")
        kinds = [e["event"] for e in events]
        assert kinds[0] == "opened" and "resolved" in kinds and set(kinds) <= {"opened", "updated", "resolved"}
        assert {e["finding"]["id"] for e in events} == {f["id"]} and all(e["dropped"] == 0 for e in events)
    finally:
        watch.kill()
        watch.wait(5)


def test_diagnose_needs_a_known_job(setup):
    col, _, _ = setup
    out = col.cli("diagnose", "no-such-job", check=False)
    assert out.returncode == 1 and "NOT_FOUND" in out.stderr and "no job 'no-such-job'" in out.stderr


CLOCK = ClockEstimate(offset_ns=0, drift_ppm=0.0, ref_mono_ns=0, uncertainty_ns=1000, best_rtt_ns=1000, samples=5)


def _write(writer: StoreWriter, seq: int, records: list) -> None:
    done = threading.Event()
    writer.submit(BatchJob("n0", "ab" * 8, seq, len(records), encode_records([("t", x) for x in records]),
                           time.monotonic_ns(), CLOCK, time.time_ns(), lambda *a: done.set()))
    assert done.wait(10)


def test_ops_of_no_group_are_not_another_communicator_where_a_named_one_has_them(tmp_path):
    """`make run`'s demo listed two communicators, pg:0 and pg:?: the deep dive's Kineto window of a gloo job names
    no group (agent/kineto/trace.py). Where a named communicator of the job holds their ranks and ops they are its;
    elsewhere (other ranks, other ops, or no named one) pg:? stays."""
    path = str(tmp_path / "c.db")
    writer = StoreWriter(path)
    writer.start()
    try:
        t = time.monotonic_ns() - 10**9

        def summ(job, comm, rank, op="allreduce"):
            return r.CommSummary(t, 1 + rank, comm, op, t, 1, 1, 1, 1, job_key=job, rank=rank, step=0)
        _write(writer, 1, [summ("a", "pg:0", k) for k in range(4)] + [summ("a", "pg:?", k) for k in range(4)]
               + [summ("b", "pg:0", k) for k in range(2)] + [summ("b", "pg:?", k) for k in range(4)]
               + [summ("c", "pg:?", k) for k in range(2)]
               + [summ("d", "pg:0", k) for k in range(2)] + [summ("d", "pg:?", k, "broadcast") for k in range(2)])
        jobs = {j["job_key"]: [c["comm_id"] for c in j["comms"]] for j in Reader(path).jobs()}
    finally:
        writer.stop()
    assert jobs == {"a": ["pg:0"], "b": ["pg:?", "pg:0"], "c": ["pg:?"], "d": ["pg:0", "pg:?"]}


def test_a_slow_analysis_of_a_job_is_logged_with_what_it_spent(tmp_path, monkeypatch, caplog):
    """A job's analysis that holds the loop up (SLOW_PASS_SECONDS, wall) is said in the log with its CPU and its
    slowest detectors: a finding that came late can be traced to it."""
    from steplens.collector.analysis import engine as eng_mod
    monkeypatch.setattr(eng_mod, "SLOW_PASS_SECONDS", 0.05)
    path = str(tmp_path / "l.db")
    writer = StoreWriter(path)
    writer.start()
    try:
        t = time.monotonic_ns() - 10**9
        _write(writer, 1, [r.CommSummary(t, 1, COMM, "allreduce", t, 1, 1, 1, 1, job_key="slowjob", rank=0, step=0)])

        def sleepy(reader, window, cfg):
            time.sleep(0.1)
            return []
        eng = AnalysisEngine(Reader(path), writer, AnalysisSettings(max_cpu_fraction=1.0),
                             {"sleepy": DetectorSpec("sleepy", "sleeps 0.1 s", (), DetectorConfig, sleepy)})
        with caplog.at_level("WARNING", logger="steplens.collector.analysis"):
            assert eng.run_pass() == 1
        said = [m for m in caplog.messages if "analysis of job slowjob took" in m]
        assert said and "slowest detectors: sleepy 0.1" in said[0], caplog.messages
    finally:
        writer.stop()


def test_loop_stays_within_its_cpu_budget(tmp_path):
    """The loop's duty cycle: a detector burning CPU on every job is paced to max_cpu_fraction of a core."""
    path = str(tmp_path / "s.db")
    writer = StoreWriter(path)
    writer.start()
    try:
        t = time.monotonic_ns() - 10**9
        _write(writer, 1, [r.CommSummary(t + i, 1, COMM, "allreduce", t, 1, 1, 1, 1, job_key=f"job{i}", rank=0, step=0)
                           for i in range(4)])

        def burn(reader, window, cfg):
            c0 = time.thread_time()
            while time.thread_time() - c0 < 0.05:
                pass
            reader.comm_summaries(window.job_key)
            return []
        eng = AnalysisEngine(Reader(path), writer, AnalysisSettings(max_cpu_fraction=0.25),
                             {"burn": DetectorSpec("burn", "burns 50 ms of CPU", (), DetectorConfig, burn)})
        t0, c0 = time.monotonic(), time.thread_time()
        assert eng.run_pass() == 4
        wall, cpu = time.monotonic() - t0, time.thread_time() - c0
        assert eng.stats["burn"].runs == 4 and eng.jobs_analysed == 4
        assert cpu >= 0.2 and cpu / wall <= 0.3, (cpu, wall)
        # nothing new: the next pass runs nothing
        assert eng.run_pass() == 0
        # with no detector registered the loop finds the jobs and runs nothing
        _write(writer, 2, [r.CommSummary(t + 9, 1, COMM, "allreduce", t, 1, 1, 1, 1, job_key="job9", rank=0)])
        idle = AnalysisEngine(Reader(path), writer, detectors={})
        assert idle.run_pass() == 0 and idle.detectors == {}
    finally:
        writer.stop()


def test_a_job_whose_data_stopped_is_run_through_the_idle_detectors_up_to_now(tmp_path):
    """A job that stops sending (stopped, hung in an op no source reports) wakes no pass on new data; the detectors
    marked on_idle (the hang detector) still run on it, the window ending now, while a process of it lives."""
    import sqlite3
    path = str(tmp_path / "s.db")
    writer = StoreWriter(path)
    writer.start()
    try:
        t = time.monotonic_ns() - 10**9
        _write(writer, 1, [r.CommSummary(t + i, 1, COMM, "allreduce", t, 1, 1, 1, 1, job_key=job, rank=0, step=0)
                           for i, job in enumerate(("live", "gone"))])
        conn = sqlite3.connect(path)
        for job, exited in (("live", None), ("gone", time.time_ns())):
            conn.execute("INSERT INTO processes(agent_id, pid, start_ticks, job_key, rank, exited_ns) VALUES"
                         " (?,?,?,?,?,?)", ("n0", 100 if job == "live" else 101, 1, job, 0, exited))
        conn.commit()
        conn.close()
        calls = []

        def spec(name, on_idle):
            return DetectorSpec(name, name, (), DetectorConfig,
                                lambda reader, w, cfg: calls.append((name, w.job_key, w.until_ns)) or [],
                                on_idle=on_idle)
        eng = AnalysisEngine(Reader(path), writer, AnalysisSettings(interval_seconds=0.05),
                             {"probe": spec("probe", True), "other": spec("other", False)})
        assert eng.run_pass() == 2 and len(calls) == 4
        mark = max(u for _, _, u in calls)
        calls.clear()
        assert eng.run_pass() == 0 and calls == []     # nothing new, and not idle for long yet
        time.sleep(1.1)
        before = time.time_ns()
        assert eng.run_pass() == 1 and eng.idle_runs == 1
        (name, job, until), = calls
        assert (name, job) == ("probe", "live") and until >= before > mark
    finally:
        writer.stop()


def test_progressive_fetch_paths(setup):
    """Control's FetchCommOps and the detectors' reader.fetch_commops share one implementation (control/fetch.py):
    an unknown job is NOT_FOUND, a rank whose agent is gone is reported offline, and the analysis thread's
    fetcher reaches the event loop and counts the ranks it asked for."""
    col, _, agents = setup
    t = time.monotonic_ns() - 10**9
    agents["n1"].batch(1, [r.ProcessInfo(t, 1002, 7, job_key=JOB, rank=2, world_size=4)])
    agents["n1"].wait_ack(1)
    agents["n1"].close()
    wait_for(lambda: not col.c.ingest.sessions.get("n1"), 10, what="n1 disconnected")
    out = col.cli("commops", "nojob", check=False)
    assert out.returncode == 1 and "NOT_FOUND" in out.stderr
    out = col.cli("commops", JOB, "--json", check=False)
    assert out.returncode == 1 and json.loads(out.stdout) == []
    from steplens.collector.analysis.engine import AnalysisReader
    reader = AnalysisReader(Reader(col.db), col.c.analysis.fetch)
    assert reader.fetch_commops(JOB, [2], 0, 0) == [] and reader.ranks_fetched == {2}
    assert reader.jobs(JOB)[0]["ranks"][0]["rank"] == 2  # every store read passes through
