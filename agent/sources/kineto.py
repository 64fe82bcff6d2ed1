"""kineto: comm ops (and, on GPU, kernels) from Kineto traces requested on demand over dynolog's IPC.

The agent serves the dynolog-compatible endpoint (agent/kineto/ipc.py) that libkineto polls in every
process launched with KINETO_USE_DAEMON=1 (about every 5 s on torch 2.13, measured). A poll is
answered with an empty config, or with a trace window (ACTIVITIES_LOG_FILE under trace_dir,
ACTIVITIES_DURATION_MSECS, PROFILE_START_TIME=0, ACTIVITIES_WARMUP_PERIOD_SECS, input shapes on):
every polling process gets a window of deep_window_ms as soon as it is free while deep mode is on, and
one of sentinel_window_ms every sentinel_period_seconds otherwise (0 disables). The process writes a
Chrome-trace JSON (libkineto appends _<pid> to the name); step() parses it (agent/kineto/trace.py) into
CommOp/KernelRec, hands them to the node-local detail store and returns CommSummary records.
A requesting pid (or its nearest ancestor) is matched to the workload registry for rank and job_key.

Attaches at run time: nothing. A process must be launched with KINETO_USE_DAEMON=1 (and
KINETO_IPC_SOCKET_DIR=<socket_dir> when socket_dir is set); the agent may start before or after it.
Only one daemon can hold the abstract name "dynolog" per network namespace: start() fails (the source
is down with the reason) when dynolog or another agent holds it.

Hazard (measured, torch 2.13 CPU): a process that exits while its on-demand window is open crashes in
libkineto's teardown (SIGSEGV or SIGABRT "double free or corruption" after the Python program finished;
8 of 8 runs with 4 s windows handed out back to back crashed, 3 of them without PROFILE_REPORT_INPUT_SHAPES;
0 of 2 when deep mode ended and the window had closed before the exit; KINETO_USE_DAEMON alone, without any steplens bootstrap). A scheduler then sees the job
fail. So windows are never handed out unasked: sentinel windows are off by default
(sentinel_period_seconds = 0), and deep mode, an operator's explicit action, keeps windows short
(deep_window_ms). Turn sentinel windows on only for long-running jobs that exit through a drain.

Bad input never raises out of step(): a window whose trace never appears (the process exited, or
tracing failed) is reported as an Event once the process is gone or trace_timeout_seconds have passed;
a truncated/corrupt/oversized trace is reported, skipped and deleted; events whose CLOCK_REALTIME time does
not convert to this boot's monotonic clock (a trace from before the boot, a clock step, a crafted file) are
dropped by CommLog.add and reported (Event kineto_records_dropped, with the reason) while the rest of the
trace is kept; a malformed or unknown datagram is counted (Metric kineto_ipc_unexpected_total) and ignored.

Cost: in the agent, one datagram per process per ~5 s, and parsing a trace after each window (a 1 s
gloo window of ~150 ops is ~80 KB of JSON). In the job, the window itself: Kineto's CPU op callbacks
for its duration; the step-time slowdown is measured in bench/commops.py, not here.
Verified on torch 2.13 CPU with gloo (tests/test_source_kineto.py). GPU traces (CUPTI kernels, launches,
NCCL record_param_comms/kernel args) are parsed and checked on real recorded traces of torch 1.9 to 2.11
(tests/test_gpu_traces_real.py, tests/test_gpu_recorded.py; counts equal HolisticTraceAnalysis', see
bench/compare_hta.py). Not verified: this source's on-demand window on a GPU process (tests/test_gpu_live.py
has not yet passed on a GPU), and so the "ctxt" registration GPU builds send, answered per dynolog's protocol.
"""

from __future__ import annotations

import glob
import os
import threading
from dataclasses import dataclass

from steplens.agent.records import Event, Metric, Mode
from steplens.agent.sources.base import Availability, ConfigError, Source, SourceConfig


@dataclass
class KinetoConfig(SourceConfig):
    interval_seconds: float = 1.0          # how often finished traces are collected
    socket_dir: str = ""                   # "": abstract socket "\0dynolog\0"; else <socket_dir>/dynolog
    trace_dir: str = ""                    # where processes write traces; "": <state_dir>/kineto
    deep_window_ms: int = 2000             # trace window per process in deep mode
    sentinel_window_ms: int = 500          # periodic short window in sentinel mode (0: none)
    sentinel_period_seconds: float = 0.0   # ... this often per process (0: none; see "Hazard" above)
    warmup_seconds: int = 0                # ACTIVITIES_WARMUP_PERIOD_SECS (GPU builds may want 1-5 s)
    trace_timeout_seconds: float = 30.0    # a trace not written this long after its window ends is missing
    max_trace_bytes: int = 256 * 1024 * 1024  # larger trace files are skipped
    detail_max_records: int = 2_000_000    # node-local CommOp/KernelRec ring (detail.db)
    forget_seconds: float = 60.0           # a process that stopped polling this long is forgotten

    def validate(self) -> None:
        super().validate()
        if not (10 <= self.deep_window_ms <= 60_000):
            raise ConfigError("deep_window_ms must be within 10..60000")
        if self.sentinel_window_ms and not (10 <= self.sentinel_window_ms <= 60_000):
            raise ConfigError("sentinel_window_ms must be 0 or within 10..60000")
        if self.sentinel_period_seconds and self.sentinel_period_seconds * 1000 < self.sentinel_window_ms:
            raise ConfigError("sentinel_period_seconds must be 0 or longer than sentinel_window_ms")
        if self.sentinel_period_seconds < 0 or self.sentinel_window_ms < 0:
            raise ConfigError("sentinel_period_seconds and sentinel_window_ms must be >= 0")
        if not (0 <= self.warmup_seconds <= 60):
            raise ConfigError("warmup_seconds must be within 0..60")
        if self.trace_timeout_seconds <= 0 or self.forget_seconds <= 0:
            raise ConfigError("trace_timeout_seconds and forget_seconds must be > 0")
        if self.max_trace_bytes < 1024 * 1024:
            raise ConfigError("max_trace_bytes must be at least 1 MiB")
        if self.detail_max_records < 1000:
            raise ConfigError("detail_max_records must be at least 1000")
        if len(self.socket_dir.encode()) > 107 - 53:
            # libkineto binds <socket_dir>/dynoconfigclient<uuid4> (53 chars) into a 108-byte sun_path
            raise ConfigError("socket_dir must be at most 54 bytes long (AF_UNIX path limit)")


@dataclass
class _Window:
    wid: int
    pid: int
    start_ticks: int
    rank: int
    job_key: str
    stem: str               # ACTIVITIES_LOG_FILE without ".json"
    kind: str               # deep | sentinel
    handed_mono_ns: int
    due_mono_ns: int        # when the trace should be written: hand-out + warmup + duration


@dataclass
class _Proc:
    pid: int
    first_mono_ns: int
    last_poll_mono_ns: int
    next_sentinel_mono_ns: int
    start_ticks: int = 0
    rank: int = -1
    job_key: str = ""
    matched: bool = False
    window: _Window | None = None


class KinetoSource(Source):
    governed = False   # its buffer or ring must be read at its interval (agent/governor.py)
    name = "kineto"
    description = ("Kineto traces on demand over a dynolog-compatible socket (jobs launched with "
                   "KINETO_USE_DAEMON=1): comm ops, kernels and launches")
    config_class = KinetoConfig

    @classmethod
    def probe(cls, ctx) -> Availability:
        import socket
        if not hasattr(socket, "AF_UNIX"):
            return Availability.no("no AF_UNIX sockets on this platform")
        return Availability.yes("only processes launched with KINETO_USE_DAEMON=1 are traced")

    def start(self) -> None:
        from steplens.agent.commlog import CommLog, RealtimeClock
        from steplens.agent.kineto.ipc import DynologEndpoint
        cfg = self.config
        self.trace_dir = cfg.trace_dir or os.path.join(self.ctx.state_dir, "kineto")
        os.makedirs(self.trace_dir, exist_ok=True)
        os.chmod(self.trace_dir, 0o1733)  # workload processes of any user write traces; none can list them
        for stale in glob.glob(os.path.join(self.trace_dir, "w*.json")):
            os.unlink(stale)              # windows of an earlier run: nobody will claim them
        self.clock = RealtimeClock(monotonic_ns=self.ctx.mono_ns)
        self.log = CommLog(self.ctx.state_dir, self.name, max_records=cfg.detail_max_records,
                           monotonic_ns=self.ctx.mono_ns)
        self._lock = threading.Lock()
        self.procs: dict[int, _Proc] = {}
        self.deep = self.ctx.mode() is Mode.DEEP
        self._next_wid = 1
        self._unexpected_sent = 0
        self.traces_total = self.traces_failed = 0
        self.endpoint = DynologEndpoint(self._on_request, cfg.socket_dir)
        self.endpoint.start()  # bind errors (EADDRINUSE: dynolog runs) surface here, before any step

    def set_mode(self, mode: Mode) -> None:
        self.deep = mode is Mode.DEEP

    def idle(self) -> bool:
        with self._lock:
            return not self.procs   # no process has polled within forget_seconds, no window open

    # ---- endpoint thread: must answer within libkineto's ~50 ms ----
    def _on_request(self, req) -> str:
        now = self.ctx.mono_ns()
        cfg = self.config
        with self._lock:
            proc = self.procs.get(req.pids[0])
            if proc is None:
                period = int(cfg.sentinel_period_seconds * 1e9)
                proc = self.procs[req.pids[0]] = _Proc(req.pids[0], now, now, now + period)
            proc.last_poll_mono_ns = now
            if not proc.matched:
                self._match(proc, req.pids)
            if proc.window is not None:
                return ""
            if self.deep:
                kind, ms = "deep", cfg.deep_window_ms
            elif cfg.sentinel_window_ms and cfg.sentinel_period_seconds and now >= proc.next_sentinel_mono_ns:
                kind, ms = "sentinel", cfg.sentinel_window_ms
            else:
                return ""
            wid, self._next_wid = self._next_wid, self._next_wid + 1
            stem = os.path.join(self.trace_dir, f"w{wid}")
            proc.window = _Window(wid, proc.pid, proc.start_ticks, proc.rank, proc.job_key, stem, kind, now,
                                  now + (cfg.warmup_seconds * 1000 + ms) * 1_000_000)
        return (f"ACTIVITIES_LOG_FILE={stem}.json\nACTIVITIES_DURATION_MSECS={ms}\nPROFILE_START_TIME=0\n"
                f"ACTIVITIES_WARMUP_PERIOD_SECS={cfg.warmup_seconds}\nPROFILE_REPORT_INPUT_SHAPES=true\n")

    def _match(self, proc: _Proc, pids) -> None:
        """Rank and job_key from the workload registry: the polling pid, else its nearest ancestor
        (job_key only: an ancestor's rank is not this process's)."""
        by_pid = {}
        for (pid, ticks), info in self.ctx.workloads.snapshot().items():
            by_pid[pid] = (ticks, info)
        for i, pid in enumerate(pids):
            hit = by_pid.get(pid)
            if hit is None:
                continue
            ticks, info = hit
            if i == 0:
                proc.start_ticks, proc.rank = ticks, info.rank
            proc.job_key = info.job_key
            proc.matched = i == 0
            return

    # ---- runner thread ----
    def step(self) -> list:
        out: list = []
        now = self.ctx.mono_ns()
        with self._lock:
            for pid, proc in list(self.procs.items()):
                if proc.window is None and now - proc.last_poll_mono_ns > self.config.forget_seconds * 1e9:
                    del self.procs[pid]
            windows = [p.window for p in self.procs.values() if p.window is not None]
        for w in windows:
            done = self._collect(w, now, out)
            if done:
                with self._lock:
                    proc = self.procs.get(w.pid)
                    if proc is not None and proc.window is w:
                        proc.window = None
                        proc.next_sentinel_mono_ns = now + int(self.config.sentinel_period_seconds * 1e9)
        unexpected = self.endpoint.unexpected
        if unexpected != self._unexpected_sent:
            out.append(Metric(now, "kineto_ipc_unexpected_total", self.ctx.node_id, float(unexpected)))
            self._unexpected_sent = unexpected
        return out

    def _collect(self, w: _Window, now: int, out: list) -> bool:
        """Parse the window's trace if it is there; True when the window is finished (parsed or given up)."""
        from steplens.agent.kineto import trace
        entity = f"pid:{w.pid}:{w.start_ticks}"
        files = sorted(glob.glob(glob.escape(w.stem) + "*.json"))
        if not files:
            if now > w.due_mono_ns + self.config.trace_timeout_seconds * 1e9:
                self.traces_failed += 1
                out.append(Event(now, "kineto_trace_missing", entity,
                                 f"no trace {self.config.trace_timeout_seconds:g} s after its {w.kind} window ended"))
                return True
            if not self._alive(w) and now - w.handed_mono_ns > 1e9:
                self.traces_failed += 1
                out.append(Event(now, "kineto_trace_missing", entity,
                                 f"the process exited before writing its {w.kind} window's trace"))
                return True
            return False
        path = files[0]
        try:
            doc = trace.load(path, self.config.max_trace_bytes)
        except trace.TraceError as exc:
            try:
                age_ns = now - (self.clock.to_mono(os.stat(path).st_mtime_ns))
            except OSError:
                age_ns = 1 << 62
            # still being written? libkineto writes in place; give it a moment unless the writer is gone
            if age_ns < 2e9 and self._alive(w) and now < w.due_mono_ns + self.config.trace_timeout_seconds * 1e9:
                return False
            self.traces_failed += 1
            out.append(Event(now, "kineto_trace_corrupt", entity, f"{os.path.basename(path)}: {exc}"))
            self._remove(files)
            return True
        try:
            parsed = trace.parse(doc, self.clock.to_mono, w.pid, w.start_ticks, w.rank, w.job_key)
        except Exception as exc:  # a shape parse() did not anticipate: report, never raise
            self.traces_failed += 1
            out.append(Event(now, "kineto_trace_corrupt", entity, f"{os.path.basename(path)}: {exc!r}"))
            self._remove(files)
            return True
        self._remove(files)
        self.traces_total += 1
        out += self.log.add(parsed.ops, parsed.kernels, parsed.steps)
        if parsed.skipped:
            self.errors += 1
            out.append(Event(now, "kineto_trace_events_skipped", entity,
                             f"{parsed.skipped} of {parsed.events} events malformed", parsed.skipped))
        return True

    def _alive(self, w: _Window) -> bool:
        try:
            with open(os.path.join(self.ctx.proc_root, str(w.pid), "stat"), "rb") as fh:
                stat = fh.read()
        except OSError:
            return False
        fields = stat[stat.rfind(b")") + 2:].split()
        if not fields or fields[0] in (b"Z", b"X"):
            return False  # exited, not yet reaped
        return not w.start_ticks or (len(fields) > 19 and int(fields[19]) == w.start_ticks)

    @staticmethod
    def _remove(files: list[str]) -> None:
        for f in files:
            try:
                os.unlink(f)
            except OSError:
                pass

    def stop(self) -> None:
        endpoint = getattr(self, "endpoint", None)
        if endpoint is not None:
            endpoint.close()
            self.endpoint = None
        if getattr(self, "log", None) is not None:
            self.log.close()
            self.log = None
