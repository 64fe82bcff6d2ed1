"""The analysis engine: runs the registered detectors per job, merges their output into stored findings, and
announces the changes; its loop does that on new data, on a thread of its own, within a CPU budget.

  run_job()   every enabled detector on one job's window, each timed and isolated (an exception is counted and
              reported, the others run on); then one writer.StoreJob that reads the job's live findings, merges
              (findings.merge: `for` and resolve) and writes the changes in the writer's transaction, so the loop
              and an operator's `diagnose` never race; then the changes go to WatchFindings subscribers (hub).
  the loop    every interval_seconds asks the store which jobs got data since the last pass (an incremental read
              past the last rowid seen) and runs those jobs with the window ending at their newest data.
              Bounded CPU: after each job it sleeps long enough that its thread's CPU time stays under
              max_cpu_fraction of one core, and it runs at a lower priority (nice), so ingest (the event loop and
              the writer thread) keeps the cores; it never writes except through the writer's queue.
With no detector registered the loop finds the jobs and runs nothing (and says so in /metrics: runs stay 0).
Cost: one small indexed read per pass; per job, what its detectors cost, capped by the duty cycle.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from steplens.collector.analysis import causes
from steplens.collector.analysis.base import AnalysisSettings, DetectorConfig, DetectorSpec, Window, no_gc
from steplens.collector.analysis.findings import Change, Finding, merge
from steplens.collector.store import diagnosis as store
from steplens.collector.store.writer import StoreJob

log = logging.getLogger("steplens.collector.analysis")

MEMO_JOBS = 64   # jobs whose per-step results are kept between passes (each: its window's steps, compact)
MEMO_ROWS = 2_000_000   # Step rows kept across all jobs' memos at most (irregularity._rows; ~330k for a 4,096-GPU
                        # job's 60 s window): the least recently analysed jobs' memos go first
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _memo_rows(memo: dict) -> int:
    cache = memo.get(("irregularity", "rows"))
    return len(cache["rows"]) if cache else 0


class FetchUnavailable(RuntimeError):
    """Progressive fetching is not wired to this reader (a test store, or a collector without agents)."""


class AnalysisReader:
    """What a detector reads: the store's Reader (every read method), plus `fetch_commops` for progressive
    fetching of node-local CommOps from the ranks a search visits; counts what was fetched. step_memo: the
    job's per-step results kept across passes (irregularity.per_step; the engine keeps one per job)."""

    def __init__(self, reader, fetch: Callable | None = None, step_memo: dict | None = None,
                 flowview=None) -> None:
        self._reader = reader
        self._fetch = fetch
        self.step_memo = step_memo
        self.flowview = flowview
        self.ranks_fetched: set[int] = set()

    def flow_snapshot(self, until_ns: int = 0):
        """The black-box flow analysis (flowjobs.FlowView) of the newest flows up to until_ns; None without
        flows or without the flows detector."""
        return self.flowview.snapshot(self._reader, until_ns) if self.flowview is not None else None

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def fetch_commops(self, job_key: str, ranks: list[int], since_ns: int, until_ns: int, limit: int = 0) -> list[dict]:
        if self._fetch is None:
            raise FetchUnavailable("no agent connection to fetch CommOps from")
        self.ranks_fetched.update(ranks)
        return self._fetch(job_key, list(ranks), since_ns, until_ns, limit)

    def fetch_kernels(self, job_key: str, ranks: list[int], since_ns: int, until_ns: int, limit: int = 0
                      ) -> list[dict]:
        """The node-local GPU kernel records (CUPTI / Kineto) of some ranks, as FetchDetail rows."""
        if self._fetch is None:
            raise FetchUnavailable("no agent connection to fetch kernels from")
        self.ranks_fetched.update(ranks)
        try:
            return self._fetch(job_key, list(ranks), since_ns, until_ns, limit, kinds=["kernels"])
        except TypeError as exc:  # a fetcher of CommOps only (the simulator's)
            raise FetchUnavailable(f"this fetcher brings CommOps only ({exc})") from None


class Histogram:
    def __init__(self, buckets=DURATION_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.count += 1
        self.sum += v
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def cumulative(self) -> list[tuple[str, int]]:
        return [(repr(float(b)), c) for b, c in zip(self.buckets, self.counts)] + [("+Inf", self.count)]


@dataclass
class DetectorStats:
    runs: int = 0
    errors: int = 0
    last_duration_seconds: float = 0.0
    last_success: bool = True
    findings: int = 0
    duration: Histogram = field(default_factory=Histogram)


@dataclass
class RunResult:
    job_key: str
    since_ns: int
    until_ns: int
    detectors: list[str]
    errors: dict[str, str]
    findings: list[Finding]      # what this run found, after the merge (open, or pending under `for`), best first
    changes: list[Change]
    seconds: float
    ranks_fetched: int = 0


class Subscription:
    """One WatchFindings stream: a bounded queue on the subscriber's event loop (oldest dropped, counted)."""

    def __init__(self, loop, job_key: str, size: int) -> None:
        import asyncio
        self.loop = loop
        self.job_key = job_key
        self.items: collections.deque = collections.deque()
        self.size = size
        self.dropped = 0
        self.event = asyncio.Event()

    def _push(self, items: list) -> None:  # on the subscriber's loop
        for it in items:
            if len(self.items) >= self.size:
                self.items.popleft()
                self.dropped += 1
            self.items.append(it)
        self.event.set()

    async def get(self) -> tuple[str, Finding, int]:
        while not self.items:
            self.event.clear()
            await self.event.wait()
        event, finding = self.items.popleft()
        dropped, self.dropped = self.dropped, 0
        return event, finding, dropped


class FindingsHub:
    """Fans finding changes out to subscribers; publish() is callable from any thread."""

    def __init__(self, queue_size: int = 1024) -> None:
        self.queue_size = queue_size
        self._subs: set[Subscription] = set()
        self._lock = threading.Lock()
        self.published = 0

    def subscribe(self, loop, job_key: str = "") -> Subscription:
        sub = Subscription(loop, job_key, self.queue_size)
        with self._lock:
            self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.discard(sub)

    @property
    def watchers(self) -> int:
        return len(self._subs)

    def publish(self, changes: list[Change]) -> None:
        events = [(c.action, c.finding) for c in changes if c.action in ("opened", "updated", "resolved")]
        if not events:
            return
        self.published += len(events)
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            mine = [e for e in events if not sub.job_key or e[1].job_key == sub.job_key]
            if mine:
                try:
                    sub.loop.call_soon_threadsafe(sub._push, mine)
                except RuntimeError:  # its loop is closed: the stream is gone
                    self.unsubscribe(sub)


SLOW_PASS_SECONDS = 5.0   # a job's analysis taking this long (wall) is logged with what it spent


class AnalysisEngine:
    def __init__(self, reader, writer, settings: AnalysisSettings | None = None,
                 detectors: dict[str, DetectorSpec] | None = None,
                 configs: dict[str, DetectorConfig] | None = None, now_ns: Callable[[], int] = time.time_ns,
                 fetch: Callable | None = None) -> None:
        self.reader = reader
        self.writer = writer
        self.settings = settings or AnalysisSettings()
        self.settings.validate()
        if detectors is None:
            from steplens.collector.analysis import all_specs
            detectors = all_specs()
        self.detectors = dict(detectors)
        self.configs = {n: (configs or {}).get(n) or s.config_class() for n, s in self.detectors.items()}
        for cfg in self.configs.values():
            cfg.validate()
        self.now_ns = now_ns
        self.fetch = fetch
        self.flowview = None
        if "flows" in self.detectors and self.configs["flows"].enabled:
            from steplens.collector.analysis.flowjobs import FlowConfig, FlowView
            self.flowview = FlowView(self.settings.flows_window_seconds, self.settings.flows_interval_seconds,
                                     FlowConfig(segmenter=self.settings.flows_segmenter,
                                                ignore_ports=tuple(self.settings.flows_ignore_ports)))
        self._flow_mark = 0
        self.ownership = None   # several collectors on one store: which jobs are this one's (ownership.py)
        s = self.settings
        if s.collector_id and hasattr(writer, "heartbeat") and hasattr(reader, "live_collectors"):
            from steplens.collector.analysis.ownership import Ownership
            self.ownership = Ownership(writer, reader, s.collector_id, s.collector_address, s.heartbeat_seconds,
                                       s.collector_ttl_seconds, now_ns=now_ns)
        self.jobs_elsewhere = 0   # jobs with new data left to the collector that owns them, over the passes
        self.hub = FindingsHub(self.settings.watch_queue_size)
        self.stats = {n: DetectorStats() for n in self.detectors}
        self.cycle = Histogram()
        self.lag = Histogram((0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
        self.changes = collections.Counter()
        self.cpu_seconds = 0.0
        self.jobs_analysed = 0
        self.passes = 0
        self.jobs_waiting = 0
        self.store_failures = 0
        self.cause_errors = 0
        self.cause_seconds = 0.0
        self._locks: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)
        self._memos: collections.OrderedDict[str, dict] = collections.OrderedDict()  # job -> per-step memo
        self._memo_lock = threading.Lock()
        self._marks: dict[str, int] = {}
        self._seen: dict[str, tuple[int, float]] = {}   # job -> (newest data mark, monotonic time it last moved)
        self.idle_runs = 0
        self._rowid = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- on demand and from the loop --------------------------------------------------------------
    def run_job(self, job_key: str, since_ns: int = 0, until_ns: int = 0, confirm: bool = False,
                data_ns: int = 0, timeout: float = 60.0, only: tuple[str, ...] = ()) -> RunResult:
        """Run every enabled detector on one job. until_ns: window end (default now); since_ns: window start
        (default: each detector's window_seconds before until_ns); confirm: open findings at once (`diagnose`);
        data_ns: newest data time of the job (resolution clock; default read from the store); only: these
        detectors only (a job known from its flows alone has nothing the others read)."""
        t0 = time.perf_counter()
        until = until_ns or self.now_ns()
        outputs: dict[str, list[Finding]] = {}
        errors: dict[str, str] = {}
        ran = []
        with self._locks[job_key], no_gc():
            reader = AnalysisReader(self.reader, self.fetch, self._memo(job_key), self.flowview)
            for name, spec in self.detectors.items():
                cfg = self.configs[name]
                if not cfg.enabled or (only and name not in only):
                    continue
                since = since_ns or max(0, until - int(cfg.window_seconds * 1e9))
                st = self.stats[name]
                d0 = time.perf_counter()
                try:
                    out = spec.detect(reader, Window(job_key, since, until), cfg)
                    outputs[name] = [self._own(f, job_key, name) for f in out or []]
                    st.last_success = True
                except Exception as exc:  # one failing detector never stops the others
                    errors[name] = f"{type(exc).__name__}: {exc}"
                    st.errors += 1
                    st.last_success = False
                    log.warning("detector %s failed on job %s: %s", name, job_key, errors[name])
                st.runs += 1
                st.last_duration_seconds = time.perf_counter() - d0
                st.duration.observe(st.last_duration_seconds)
                st.findings += len(outputs.get(name, []))
                ran.append(name)
            if any(outputs.values()) and self.settings.causes:   # why each leading suspect is slow (causes.py)
                c0 = time.perf_counter()
                try:
                    onsets = {f.key: f.onset_ns for f in self.reader.findings(job_key, open_only=True)} \
                        if hasattr(self.reader, "findings") else {}
                    outputs = causes.attach(reader, job_key, outputs, until_ns=until, open_onsets=onsets)
                except Exception as exc:  # the findings still go out, with the detectors' own causes
                    errors["causes"] = f"{type(exc).__name__}: {exc}"
                    self.cause_errors += 1
                    log.warning("causes failed on job %s: %s", job_key, errors["causes"])
                self.cause_seconds += time.perf_counter() - c0
            changes: list[Change] = []
            if outputs:
                if not data_ns:
                    data_ns = max(self.reader.data_watermarks([job_key]).get(job_key, 0),
                                  max((f.last_ns for fs in outputs.values() for f in fs), default=0))
                changes = self._store(job_key, outputs, data_ns, confirm, timeout)
        self.hub.publish(changes)
        for c in changes:
            self.changes[c.action] += 1
        emitted = {f.key for fs in outputs.values() for f in fs}
        found = sorted((c.finding for c in changes if c.finding.key in emitted and c.action != "dropped"),
                       key=lambda f: -f.severity)
        seconds = time.perf_counter() - t0
        self.cycle.observe(seconds)
        return RunResult(job_key, since_ns or min((max(0, until - int(self.configs[n].window_seconds * 1e9))
                                                  for n in ran), default=until), until, ran, errors, found, changes,
                         seconds, len(reader.ranks_fetched))

    def _memo(self, job_key: str) -> dict:
        """The job's per-step memo (irregularity.per_step), the most recently analysed MEMO_JOBS jobs' kept
        (called under the job's lock)."""
        with self._memo_lock:
            memo = self._memos.pop(job_key, None)
            self._memos[job_key] = memo = {} if memo is None else memo
            while len(self._memos) > MEMO_JOBS:
                self._memos.popitem(last=False)
            rows = {k: _memo_rows(m) for k, m in self._memos.items()}
            total = sum(rows.values())
            for k in list(self._memos):
                if total <= MEMO_ROWS or k == job_key:
                    break
                total -= rows[k]
                del self._memos[k]
        return memo

    @staticmethod
    def _own(f: Finding, job_key: str, name: str) -> Finding:
        if not isinstance(f, Finding):
            raise TypeError(f"a detector returns Finding objects, got {type(f).__name__}")
        if not f.kind or not f.summary or not math.isfinite(f.severity):
            raise ValueError(f"a finding needs a kind, a summary and a finite severity: {f!r}")
        return replace(f, job_key=job_key, detector=name)

    def _store(self, job_key: str, outputs: dict[str, list[Finding]], data_ns: int, confirm: bool,
               timeout: float) -> list[Change]:
        policies = {n: self.configs[n].policy() for n in outputs}
        now = self.now_ns()
        result: list[Change] = []

        def apply(conn) -> int:
            result.clear()
            for name, found in outputs.items():
                back = data_ns - int(self.configs[name].window_seconds * 1e9) if name in self.configs else data_ns
                result.extend(merge(store.live_findings(conn, job_key, name), found, data_ns, policies[name], confirm,
                                    lambda n=name, b=back: store.resolved_since(conn, job_key, n, b)))
            return store.write_changes(conn, result, now)
        done = threading.Event()
        outcome: list = []

        def finished(status: str, n: int, note: str) -> None:
            outcome.append((status, note))
            done.set()
        while not self.writer.submit(StoreJob(apply, finished)):
            if self._stop.wait(0.01):
                return []
        if not done.wait(timeout) or outcome[0][0] != "stored":
            self.store_failures += 1
            note = outcome[0][1] if outcome else f"no commit within {timeout:.0f} s"
            raise RuntimeError(f"findings of job {job_key!r} were not stored: {note}")
        return list(result)

    # -- the loop -----------------------------------------------------------------------------------
    def start(self) -> None:
        if not self.settings.enabled or self._thread is not None:
            return
        if self.ownership is not None:
            self.ownership.start()
        self._thread = threading.Thread(target=self._main, name="analysis", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self.ownership is not None:
            self.ownership.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def _main(self) -> None:
        try:  # Linux: niceness is per thread
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.settings.nice)
        except (OSError, AttributeError):
            pass
        s = self.settings
        while not self._stop.wait(s.interval_seconds):
            try:
                self.run_pass()
            except Exception as exc:  # the store went away for a moment, a bug: log and go on
                log.error("analysis pass failed: %s: %s", type(exc).__name__, exc)

    def run_pass(self) -> int:
        """One pass of the loop: jobs with new data since the last pass, each run within the CPU budget."""
        self.passes += 1
        self._rowid, marks = self.reader.new_data_since(self._rowid)
        if self.ownership is not None:   # another collector on this store runs the others' analysis
            self.ownership.refresh()
            mine = {job: mark for job, mark in marks.items() if self.ownership.owns(job)}
            self.jobs_elsewhere += len(marks) - len(mine)
            marks = mine
            for job in [j for j in self._marks if not self.ownership.owns(j)]:
                del self._marks[job]
            for job in [j for j in self._seen if not self.ownership.owns(j)]:
                del self._seen[job]
        for job, mark in marks.items():
            self._marks[job] = max(self._marks.get(job, 0), mark)
        due = sorted(self._marks.items(), key=lambda kv: kv[1])
        self.jobs_waiting = max(0, len(due) - self.settings.max_jobs_per_cycle)
        ran = 0
        for job, mark in due[:self.settings.max_jobs_per_cycle]:
            if self._stop.is_set():
                break
            del self._marks[job]
            if not self.detectors:
                continue
            c0, w0, k0 = time.thread_time(), time.monotonic(), self.cause_seconds
            try:
                self.run_job(job, until_ns=mark, data_ns=mark)
            except Exception as exc:
                log.error("analysis of job %s failed: %s", job, exc)
            cpu = time.thread_time() - c0
            wall = time.monotonic() - w0
            if wall >= SLOW_PASS_SECONDS:   # what held the loop up: said, so that a late finding can be traced to it
                log.warning("analysis of job %s took %.1f s (%.2f s of CPU; causes %.2f s; slowest detectors: %s)",
                            job, wall, cpu, self.cause_seconds - k0, ", ".join(
                                f"{n} {st.last_duration_seconds:.2f} s" for n, st in sorted(
                                    self.stats.items(), key=lambda kv: -kv[1].last_duration_seconds)[:3]))
            self.cpu_seconds += cpu
            self.jobs_analysed += 1
            self.lag.observe(max(0.0, (self.now_ns() - mark) / 1e9))
            ran += 1
            self._duty(cpu)
        return ran + self._idle_pass(marks) + self._flow_pass()

    def _idle_pass(self, marks: dict[str, int]) -> int:
        """Jobs whose data stopped coming: run the detectors that look for that (DetectorSpec.on_idle: the hang
        detector) on them, up to now. A job blocked in an op that no source reports as pending (gloo's send/recv,
        a stopped rank's peers), or whose every rank is stopped, sends nothing the loop wakes on; without this pass
        it would never be called hung. Jobs whose processes all exited are left out (the detector says so itself
        where they hung first)."""
        s = self.settings
        now_mono = time.monotonic()
        for job, mark in marks.items():
            old = self._seen.get(job)
            if old is None or mark > old[0]:
                self._seen[job] = (mark, now_mono)
        on_idle = tuple(n for n, spec in self.detectors.items() if spec.on_idle and self.configs[n].enabled)
        if not on_idle or not s.idle_watch_seconds:
            return 0
        idle = [job for job, (mark, moved) in self._seen.items()
                if now_mono - moved >= max(2 * s.interval_seconds, 1.0) and job not in self._marks]
        for job in [j for j in idle if now_mono - self._seen[j][1] > s.idle_watch_seconds]:
            del self._seen[job]
        idle = [j for j in idle if j in self._seen]
        if not idle:
            return 0
        alive = {p["job_key"] for p in self.reader.procs(alive_only=True)} if hasattr(self.reader, "procs") else set()
        ran = 0
        for job in idle:
            if self._stop.is_set() or job not in alive:
                continue
            c0 = time.thread_time()
            try:
                self.run_job(job, until_ns=self.now_ns(), data_ns=self._seen[job][0], only=on_idle)
                self.idle_runs += 1
            except Exception as exc:
                log.error("idle check of job %s failed: %s", job, exc)
            cpu = time.thread_time() - c0
            self.cpu_seconds += cpu
            ran += 1
            self._duty(cpu)
        return ran

    def _duty(self, cpu: float) -> None:
        f = self.settings.max_cpu_fraction
        if f < 1.0 and cpu > 0:
            self._stop.wait(cpu * (1.0 / f - 1.0))

    def _flow_pass(self) -> int:
        """The jobs the flows alone show (flowjobs.FlowView), each run through the flows detector, when flows
        arrived and the last flow analysis is flows_interval_seconds of data time old; jobs matched to one known
        from its processes are analysed with it (the flows detector finds them by the match)."""
        if self.flowview is None or self._stop.is_set():
            return 0
        if self.ownership is not None:
            from steplens.collector.analysis.ownership import FLOWS_KEY
            if not self.ownership.owns(FLOWS_KEY):   # the cluster's flows are another collector's to analyse
                return 0
        c0 = time.thread_time()
        rowid, newest = self.reader.flow_watermark()
        if not rowid or rowid == self._flow_mark:
            return 0
        snap = self.flowview.snapshot(self.reader, newest)
        if snap is None or snap.until_ns < newest - self.flowview.refresh_ns:
            return 0
        self._flow_mark = rowid
        matched = set(snap.matched.values())
        ran = 0
        for fj in snap.jobs:
            if fj.key in matched or self._stop.is_set():
                continue
            try:
                self.run_job(fj.key, until_ns=snap.until_ns, data_ns=snap.until_ns, only=("flows",))
            except Exception as exc:
                log.error("flow analysis of job %s failed: %s", fj.key, exc)
            ran += 1
        cpu = time.thread_time() - c0
        self.cpu_seconds += cpu
        self._duty(cpu)
        return ran
