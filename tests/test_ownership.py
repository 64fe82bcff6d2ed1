"""Several collectors on one store, each job's analysis on one of them (collector/analysis/ownership.py; issue
"Scale-out", item 2): rendezvous hashing over the collectors whose heartbeat in the store is fresh. Real stores:
two writers and readers on one SQLite file (two collectors sharing it), and on one chDB database (ClickHouse's
engine; the table every collector on a ClickHouse server reads). Then the engine: a job another collector owns
is not run here, and it is once that collector's heartbeat ages out."""

from __future__ import annotations

import itertools
import os
import threading
import time

import pytest

from steplens.agent import records as r
from steplens.agent.transport.codec import encode_records
from steplens.collector.analysis.base import AnalysisSettings, ConfigError, DetectorConfig, DetectorSpec
from steplens.collector.analysis.engine import AnalysisEngine
from steplens.collector.analysis.ownership import FLOWS_KEY, Ownership, owner_of
from steplens.collector.ingest.clock import ClockEstimate
from steplens.collector.store.queries import Reader
from steplens.collector.store.writer import BatchJob, StoreWriter

KEYS = [f"job-{i}" for i in range(300)] + [FLOWS_KEY]


class Clock:
    def __init__(self) -> None:
        self.t = time.time_ns()

    def __call__(self) -> int:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += int(seconds * 1e9)


def test_rendezvous_owner_is_one_and_moves_little():
    a, b, c = "host-a/10.0.0.1:7707", "host-b/10.0.0.2:7707", "host-c/10.0.0.3:7707"
    two = {k: owner_of(k, [a, b]) for k in KEYS}
    assert two == {k: owner_of(k, [b, a]) for k in KEYS}   # the order the rows come in does not matter
    share = sum(v == a for v in two.values()) / len(KEYS)
    assert 0.4 <= share <= 0.6, share
    three = {k: owner_of(k, [a, b, c]) for k in KEYS}
    moved = [k for k in KEYS if three[k] != two[k]]
    assert all(three[k] == c for k in moved), "a collector that joins only takes jobs, to itself"
    assert 0.2 <= len(moved) / len(KEYS) <= 0.45
    back = {k: owner_of(k, [a, c]) for k in KEYS}   # b leaves: only b's jobs move
    assert all(back[k] == three[k] for k in KEYS if three[k] != b)
    assert owner_of("x", []) == ""


def _pair(make_writer, make_reader, clock):
    ws = [make_writer(), make_writer()]
    for w in ws:
        w.start()
    owns = [Ownership(w, make_reader(), cid, f"10.0.0.{i + 1}:7707", heartbeat_seconds=2, ttl_seconds=10,
                      now_ns=clock)
            for i, (w, cid) in enumerate(zip(ws, ("collector-a", "collector-b")))]
    return ws, owns


def _until_both_live(owns, deadline_s=20.0):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if all(live == ("collector-a", "collector-b") for live in [o.refresh(force=True) for o in owns]):
            return
        time.sleep(0.05)
    raise AssertionError(f"live sets {[o.live for o in owns]}")


def _check_failover(make_writer, make_reader):
    clock = Clock()
    ws, (a, b) = _pair(make_writer, make_reader, clock)
    try:
        assert a.owns("anything") and a.live == ()   # never read a live set: a lone collector owns every job
        _until_both_live([a, b])
        mine_a = {k for k in KEYS if a.owns(k)}
        mine_b = {k for k in KEYS if b.owns(k)}
        assert mine_a.isdisjoint(mine_b) and mine_a | mine_b == set(KEYS)
        assert 0.35 <= len(mine_a) / len(KEYS) <= 0.65
        assert {p["id"]: p["address"] for p in a.peers} == {"collector-a": "10.0.0.1:7707",
                                                              "collector-b": "10.0.0.2:7707"}
        # b dies (no more heartbeats): within the TTL a still leaves b's jobs to it, after it a takes them all
        clock.advance(6)
        assert a.refresh(force=True) == ("collector-a", "collector-b")
        clock.advance(6)
        deadline = time.monotonic() + 20
        while a.refresh(force=True) != ("collector-a",) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.live == ("collector-a",) and all(a.owns(k) for k in KEYS) and a.moves >= 1
        # b comes back: it takes back exactly the jobs it had
        _until_both_live([a, b])
        assert {k for k in KEYS if b.owns(k)} == mine_b
    finally:
        for w in ws:
            w.stop()


def test_two_collectors_on_one_sqlite_store_split_the_jobs_and_take_over(tmp_path):
    path = str(tmp_path / "shared.db")
    _check_failover(lambda: StoreWriter(path), lambda: Reader(path))


_N = itertools.count()


def test_two_collectors_on_one_clickhouse_database_split_the_jobs_and_take_over(tmp_path, engine_dir):
    pytest.importorskip("chdb")
    from steplens.collector.store import clickhouse as chs
    url = chs.parse_store(f"chdb://{engine_dir}?database=own{os.getpid()}_{next(_N)}")
    # each collector its own SQLite state beside the shared ClickHouse database
    states = iter([str(tmp_path / "a.db"), str(tmp_path / "b.db")])
    paths = []

    def writer():
        paths.append(next(states))
        return chs.ClickHouseWriter(paths[-1], url)
    _check_failover(writer, lambda: chs.ClickHouseReader(paths[0], url))


def test_a_store_that_fails_keeps_the_last_live_set():
    class Broken:
        def heartbeat(self, *a):
            raise OSError("disk full")

        def live_collectors(self, since):
            raise AssertionError("not reached")
    o = Ownership(Broken(), Broken(), "c1")
    assert o.refresh(force=True) == () and o.owns("job") and o.errors == 1 and "disk full" in o.last_error
    with pytest.raises(ValueError):
        Ownership(Broken(), Broken(), "")
    with pytest.raises(ValueError):
        Ownership(Broken(), Broken(), "c1", heartbeat_seconds=10, ttl_seconds=5)
    with pytest.raises(ConfigError):
        AnalysisSettings(heartbeat_seconds=10, collector_ttl_seconds=5).validate()


CLOCK = ClockEstimate(offset_ns=0, drift_ppm=0.0, ref_mono_ns=0, uncertainty_ns=1000, best_rtt_ns=1000, samples=5)
COMM = "0x" + "ab" * 8


def test_each_job_analysed_by_its_owner_only_and_by_the_survivor_after(tmp_path):
    """Two analysis engines (two collectors) on one store, 12 jobs with new data: each job runs on exactly one
    of them; once one engine's heartbeat is older than the TTL, the other runs its jobs too."""
    path = str(tmp_path / "s.db")
    writers = [StoreWriter(path), StoreWriter(path)]
    for w in writers:
        w.start()
    try:
        t = time.monotonic_ns() - 10**9
        done = threading.Event()
        jobs = [f"job{i}" for i in range(12)]
        writers[0].submit(BatchJob("n0", "ab" * 8, 1, len(jobs), encode_records(
            [("t", r.CommSummary(t + i, 1, COMM, "allreduce", t, 1, 1, 1, 1, job_key=j, rank=0, step=0))
             for i, j in enumerate(jobs)]), time.monotonic_ns(), CLOCK, time.time_ns(), lambda *a: done.set()))
        assert done.wait(10)
        ran: dict[str, list[str]] = {"a": [], "b": []}

        def engine(name, writer):
            spec = DetectorSpec("count", "records the jobs it ran on", (), DetectorConfig,
                                lambda reader, w, cfg: ran[name].append(w.job_key) or [])
            return AnalysisEngine(Reader(path), writer, AnalysisSettings(collector_id=f"collector-{name}",
                                                                       heartbeat_seconds=0.2,
                                                                       collector_ttl_seconds=1.0),
                                  {"count": spec})
        ea, eb = engine("a", writers[0]), engine("b", writers[1])
        for e in (ea, eb):   # both heartbeats in the store before the data pass
            e.ownership.refresh(force=True)
        deadline = time.monotonic() + 10
        while not all(len(live) == 2 for live in [e.ownership.refresh(force=True) for e in (ea, eb)]):
            assert time.monotonic() < deadline, (ea.ownership.live, eb.ownership.live)
            time.sleep(0.05)
        ea.run_pass()
        eb.run_pass()
        assert sorted(ran["a"] + ran["b"]) == sorted(jobs), ran
        assert set(ran["a"]).isdisjoint(ran["b"]) and ran["a"] and ran["b"]
        assert ea.jobs_elsewhere == len(ran["b"]) and eb.jobs_elsewhere == len(ran["a"])
        # b stops (its heartbeat ages out); new data for every job: a runs all of them
        time.sleep(1.3)
        done.clear()
        writers[0].submit(BatchJob("n0", "ab" * 8, 2, len(jobs), encode_records(
            [("t", r.CommSummary(t + 100 + i, 1, COMM, "allreduce", t + 50, 1, 1, 1, 1, job_key=j, rank=0, step=1))
             for i, j in enumerate(jobs)]), time.monotonic_ns(), CLOCK, time.time_ns(), lambda *a: done.set()))
        assert done.wait(10)
        ran["a"].clear()
        ea.ownership._next_ns = 0
        ea.run_pass()
        assert ea.ownership.live == ("collector-a",)
        assert sorted(ran["a"]) == sorted(jobs)
    finally:
        for w in writers:
            w.stop()


def test_heartbeat_thread_keeps_a_collector_live_and_stopping_ages_it_out(tmp_path):
    """start(): heartbeats on their own thread (an analysis pass or its duty-cycle sleep can outlast the TTL);
    after stop() the peer sees the collector gone once the TTL has passed."""
    path = str(tmp_path / "s.db")
    wa, wb = StoreWriter(path), StoreWriter(path)
    for w in (wa, wb):
        w.start()
    a = Ownership(wa, Reader(path), "collector-a", heartbeat_seconds=0.2, ttl_seconds=1.0)
    b = Ownership(wb, Reader(path), "collector-b", heartbeat_seconds=0.2, ttl_seconds=1.0)
    try:
        a.start()
        b.start()
        deadline = time.monotonic() + 10
        while (a.live, b.live) != (("collector-a", "collector-b"),) * 2:
            assert time.monotonic() < deadline, (a.live, b.live)
            time.sleep(0.05)
        time.sleep(1.5)   # more than the TTL, no refresh() from here: the threads keep both live
        assert (a.live, b.live) == (("collector-a", "collector-b"),) * 2
        b.stop()
        deadline = time.monotonic() + 10
        while a.live != ("collector-a",):
            assert time.monotonic() < deadline, a.live
            time.sleep(0.05)
        assert all(a.owns(k) for k in KEYS)
    finally:
        a.stop()
        b.stop()
        for w in (wa, wb):
            w.stop()
