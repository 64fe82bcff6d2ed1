"""The runner isolates sources: a failing, slow or stuck source never stalls the others, errors
are counted with their reason, and queue overflow becomes a counted gap."""

import dataclasses
import time

from steplens.agent.records import Gap, Metric
from steplens.agent.runner import BatchPolicy, Runner
from steplens.agent.sources.base import Availability, HostContext, Source, SourceConfig
from steplens.agent.transport.codec import decode_records, encode_records


class ListSpool:
    def __init__(self):
        self.batches = []
        self.lost = 0

    def append(self, payload, n, mono):
        self.batches.append(decode_records(payload))
        return len(self.batches)

    def count_lost(self, n):
        self.lost += n

    def records(self):
        return [x for b in self.batches for x in b]


class Ticker(Source):
    name = "ticker"
    description = "emits one metric per step"

    def step(self):
        return [Metric(time.monotonic_ns(), "tick", "", 1.0)]


class Failing(Source):
    name = "failing"
    description = "raises every step"

    def step(self):
        raise RuntimeError("sensor on fire")


class Stuck(Source):
    name = "stuck"
    description = "never returns from step"

    def step(self):
        time.sleep(3600)


class Unavailable(Source):
    name = "unavailable"
    description = "cannot run here"

    @classmethod
    def probe(cls, ctx):
        return Availability.no("no such hardware")


class Flood(Source):
    name = "flood"
    description = "emits more than the queue holds"

    def step(self):
        t = time.monotonic_ns()
        return [Metric(t + i, "flood", "", float(i)) for i in range(5000)]


def _runner(sources, policy=None):
    spool = ListSpool()
    cfg = SourceConfig(interval_seconds=0.02, step_timeout_seconds=0.5)
    runner = Runner(HostContext("t"), {c.name: (c, cfg) for c in sources}, encode_records, spool,
                    policy or BatchPolicy(max_records=500, max_delay_seconds=0.05))
    return runner, spool


def test_failing_and_stuck_sources_do_not_stall_others():
    runner, spool = _runner([Ticker, Failing, Stuck, Unavailable])
    runner.start()
    time.sleep(1.2)
    runner.stalled_check()
    states = {n: dataclasses.replace(s) for n, s in runner.states.items()}
    runner.stop(timeout=1.0)
    ticks = [x for x in spool.records() if x[0] == "ticker"]
    assert len(ticks) > 20
    assert states["ticker"].up and states["ticker"].errors == 0
    assert not states["failing"].up and "sensor on fire" in states["failing"].reason
    assert states["failing"].errors > 10
    assert not states["stuck"].up and states["stuck"].reason.startswith("stalled")
    assert not states["unavailable"].up and states["unavailable"].reason == "no such hardware"


def test_queue_overflow_is_a_gap_not_silence():
    runner, spool = _runner([Flood], BatchPolicy(max_records=100, max_delay_seconds=0.5, queue_max_records=1000))
    runner.start()
    time.sleep(0.5)
    runner.stop(timeout=1.0)
    gaps = [rec for src, rec in spool.records() if isinstance(rec, Gap)]
    assert gaps and sum(g.dropped_records for g in gaps) == spool.lost == runner.queue.dropped_total > 0
    assert all(g.reason == "agent record queue full" for g in gaps)


def test_stop_is_idempotent_and_flushes():
    runner, spool = _runner([Ticker])
    runner.start()
    time.sleep(0.2)
    runner.stop(timeout=1.0)
    runner.stop(timeout=1.0)
    assert len(runner.queue) == 0 and spool.records()


class OutOfRange(Source):
    name = "outofrange"
    description = "emits, among good records, ones with values their protobuf fields cannot hold"

    def step(self):
        from steplens.agent.records import CommOp, ConnStats
        t = time.monotonic_ns()
        return [Metric(t, "good", "", 1.0), CommOp(-163470956672636, "cpu_enqueue", 1, "pg:0", "all_reduce"),
                ConnStats(t, t, "a", 1, "b", 2, tx_bytes=1 << 64), Metric(t, "good", "", 2.0)]


def test_a_record_the_encoder_refuses_is_dropped_and_reported_not_the_batch():
    """A negative CLOCK_MONOTONIC time (a REALTIME time from before boot) or an overflowing counter makes the
    protobuf encoder raise: the batch keeps its other records, the rest is counted and reported, and the
    batcher goes on."""
    runner, spool = _runner([OutOfRange, Ticker])
    runner.start()
    time.sleep(0.5)
    runner.stop(timeout=1.0)
    recs = spool.records()
    good = [r for s, r in recs if s == "outofrange"]
    assert good and all(isinstance(r, Metric) for r in good) and len(good) % 2 == 0
    from steplens.agent.records import Event
    rejected = [r for s, r in recs if s == "agent" and isinstance(r, Event) and r.kind == "records_rejected"]
    assert rejected and all(e.entity == "outofrange" for e in rejected)
    assert runner.records_rejected == sum(e.value for e in rejected) == len(good)  # two of each per step
    assert len([r for s, r in recs if s == "ticker"]) > 5  # the batcher kept going


class WorkloadWatcher(Source):
    """Idle (Source.idle) while it has seen no workload: it must not be stepped then."""
    name = "watcher"
    description = "steps only while there are workloads"
    steps_total = 0

    def idle(self):
        return True

    def step(self):
        WorkloadWatcher.steps_total += 1
        return [Metric(time.monotonic_ns(), "watch", "", float(len(self.ctx.workloads.snapshot())))]


def test_an_idle_source_waits_for_a_workload_without_stepping():
    from steplens.agent.records import ProcessInfo
    WorkloadWatcher.steps_total = 0
    runner, spool = _runner([Ticker, WorkloadWatcher])
    runner.start()
    time.sleep(0.5)  # ~25 ticker intervals
    assert WorkloadWatcher.steps_total == 0
    assert runner.states["watcher"].idle and runner.states["watcher"].up
    assert "waiting for a workload" in runner.states["watcher"].reason
    runner.ctx.workloads.replace({(1, 1): ProcessInfo(0, 1, 1)})
    time.sleep(0.3)
    stepped = WorkloadWatcher.steps_total
    assert stepped >= 5 and not runner.states["watcher"].idle
    runner.ctx.workloads.replace({})
    time.sleep(0.2)
    assert WorkloadWatcher.steps_total - stepped <= 2  # at most the step in progress, then idle again
    t0 = time.monotonic()
    runner.stop(timeout=2.0)  # a waiting source is woken by stop, not left until its join times out
    assert time.monotonic() - t0 < 1.5
    assert [r for s, r in spool.records() if s == "watcher"]
    assert not any(t.is_alive() for t in runner._threads)


def test_batches_wait_longer_while_the_node_has_no_workload():
    """No workload, sentinel mode: a batch waits idle_delay_factor x max_delay_seconds; with one, max_delay."""
    from steplens.agent.records import ProcessInfo
    runner, spool = _runner([Ticker], BatchPolicy(max_records=100_000, max_delay_seconds=0.1, idle_delay_factor=5))
    runner.start()
    time.sleep(1.6)
    idle_batches = len(spool.batches)
    runner.ctx.workloads.replace({(1, 1): ProcessInfo(0, 1, 1)})
    time.sleep(0.6)  # the batcher's current idle wait (<= 0.5 s) ends, then 0.1 s batches
    before = len(spool.batches)
    time.sleep(1.0)
    busy_batches = len(spool.batches) - before
    runner.stop(timeout=1.0)
    assert 2 <= idle_batches <= 5, idle_batches      # ~1.6 s / 0.5 s
    assert busy_batches >= 6, busy_batches           # ~1.0 s / 0.1 s


class Refreshable(Source):
    """Steps every 30 s; refresh() asks its next step to read everything now (flightrec's rings before a fetch)."""
    name = "refreshable"
    description = "reads on request"

    def start(self):
        self.asked = False
        self.reads = []
        self.covered = 1_000

    def refresh(self, until_mono_ns=0, pids=None):
        if until_mono_ns and until_mono_ns <= self.covered:
            return False   # stored already covers the window: no step
        self.asked = True
        return True

    def step(self):
        asked, self.asked = self.asked, False
        self.reads.append("fetch" if asked else "scheduled")
        return []


def test_refresh_runs_a_step_now_and_waits_for_it():
    spool = ListSpool()
    runner = Runner(HostContext("t"), {"refreshable": (Refreshable, SourceConfig(interval_seconds=30.0)),
                                       "ticker": (Ticker, SourceConfig(interval_seconds=30.0))},
                    encode_records, spool, BatchPolicy(max_records=500, max_delay_seconds=0.05))
    runner.start()
    try:
        deadline = time.monotonic() + 10
        while runner.states["refreshable"].steps < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        inst = runner._instances["refreshable"]
        assert inst.reads == ["scheduled"]
        t0 = time.monotonic()
        assert runner.refresh("refreshable", timeout=5.0) and inst.reads == ["scheduled", "fetch"]
        assert time.monotonic() - t0 < 2.0          # not at the next interval, 30 s away
        assert runner.refresh("refreshable", timeout=5.0) and inst.reads[-1] == "fetch"
        # a window the source says it covers: True at once, no step
        n = len(inst.reads)
        assert runner.refresh("refreshable", 5.0, 900, {1}) and len(inst.reads) == n
        assert runner.refresh("refreshable", 5.0, 2_000, {1}) and inst.reads[n:] == ["fetch"]
        assert not runner.refresh("ticker") and not runner.refresh("no-such-source")   # no refresh(): False at once
    finally:
        t0 = time.monotonic()
        runner.stop(timeout=5.0)
        assert time.monotonic() - t0 < 3.0         # the poke wakes a source waiting out its interval


class Paced(Ticker):
    name = "paced"
    description = "asks for 4x its interval after each step"

    def pace(self):
        return 4.0


def test_a_source_that_paces_itself_steps_that_much_less_often():
    runner, spool = _runner([Ticker, Paced])
    runner.start()
    time.sleep(1.0)
    runner.stop(timeout=1.0)
    n = {name: sum(1 for src, _ in spool.records() if src == name) for name in ("ticker", "paced")}
    # 20 ms vs 80 ms: ~50 and ~13 steps in the second (a loaded machine may skip some of either)
    assert n["paced"] >= 5 and 2.5 <= n["ticker"] / n["paced"] <= 6, n


def test_queue_wakes_a_waiting_take_only_when_it_has_what_it_waits_for():
    """A take() waiting for N records is woken once the Nth is put, not by every put before it (each source's
    every step used to wake the batcher to find too few and wait again); a shorter wait still returns what is
    there at its deadline."""
    import threading

    from steplens.agent.runner import RecordQueue
    q = RecordQueue(1000)
    notified = []
    real = q._cond.notify
    q._cond.notify = lambda *a: (notified.append(len(q)), real(*a))
    got: list = []
    t = threading.Thread(target=lambda: got.append((q.take(100, 30.0, 10), time.monotonic())))
    t.start()
    time.sleep(0.2)
    for i in range(9):
        q.put_many("s", [i])
    time.sleep(0.2)
    assert notified == [] and not got
    put_at = time.monotonic()
    q.put_many("s", [9])
    t.join(10)
    assert notified == [10] and [r for _, r in got[0][0]] == list(range(10))
    assert got[0][1] - put_at < 5.0                      # woken by the put, far before its 30 s deadline
    q.put_many("s", [10, 11])
    assert [r for _, r in q.take(100, 0.05, 10)] == [10, 11]   # the deadline returns what is there
