"""pystacks: Python stacks of every workload process, sampled from outside (steplens.agent.pyframes).

Sentinel mode samples at a low rate (interval_seconds, 10 Hz by default); deep mode at up to
1 kHz (deep_interval_seconds). Every sample goes to the node-local detail store (raw, bounded
ring); upstream go per-thread summaries every summary_seconds (deep_summary_seconds in deep mode):
distinct stacks with counts, frames interned. New workload processes (from the procs source) are
attached on the next step; exited ones are dropped and their last summary is sent. A process that
cannot be read (not CPython, no permission) is retried with a doubling back-off from 0.25 s up to
retry_seconds: a process attached at its exec (procs sees it at once) has no interpreter yet for a
moment, and one failed read must not cost its first half minute of stacks. The failure is reported
once as an Event, when the process is older than startup_grace_seconds and still cannot be read.
Nothing is ever stopped unless stop_threads is set (see pyframes/seize.py).

Cost: at 10 Hz every sample starts with cold caches; one sample of a 4-thread process with a 26-frame
busy thread is ~180 µs of agent CPU with the sampler's walk in C (bench/pystacks.py, `record`'s in-process
figure, sleeping included; ~350 µs with the walk in Python), and a step of the 8-rank job's 8 samples ~480 µs
(bench/source_steps.py). What the samples add up to (per-thread summaries, detail-store rows) is counted once
a second in one loop (_aggregate), not per sample. Sentinel mode has a per-host budget, max_samples_per_second
(20): each step samples
every process back to back, and the steps are spread so that all processes together stay within it
(`pace`: 8 ranks are sampled at 2.5 Hz each, 25 samples per thread in a 10 s summary; up to 2 processes
keep 10 Hz). Deep mode is not capped here (the governor holds it to the deep budget).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from steplens.agent.records import Event, Mode, StackSummary
from steplens.agent.sources.base import Availability, ConfigError, Source, SourceConfig


@dataclass
class PystacksConfig(SourceConfig):
    interval_seconds: float = 0.1          # sentinel sampling period (10 Hz)
    max_samples_per_second: float = 20.0   # sentinel mode, all processes together: 8 ranks get 2.5 Hz each (0: no cap)
    deep_interval_seconds: float = 0.001   # deep-mode sampling period (1 kHz)
    summary_seconds: float = 10.0          # a summary per thread this often
    deep_summary_seconds: float = 1.0      # ... and this often in deep mode
    max_processes: int = 64                # workload processes sampled at most
    retry_seconds: float = 30.0            # re-try attaching to a process that failed (back-off ceiling)
    startup_grace_seconds: float = 5.0     # a younger process that cannot be read yet is not reported
    stop_threads: bool = False             # stop Python threads for each read (consistent, not free)
    detail_max_samples: int = 2_000_000    # node-local raw samples kept (ring)
    max_stacks_per_summary: int = 200      # distinct stacks per thread and summary; the rest are "other"

    def validate(self) -> None:
        super().validate()
        if self.summary_seconds < self.interval_seconds or self.deep_summary_seconds <= 0:
            raise ConfigError("summary_seconds must be >= interval_seconds and deep_summary_seconds > 0")
        if not (0 <= self.max_samples_per_second <= 100_000):
            raise ConfigError("max_samples_per_second must be within 0..100000 (0: no cap)")
        if not (1 <= self.max_processes <= 4096):
            raise ConfigError("max_processes must be within 1..4096")
        if self.detail_max_samples < 1000:
            raise ConfigError("detail_max_samples must be at least 1000")
        if self.retry_seconds <= 0 or self.startup_grace_seconds < 0:
            raise ConfigError("retry_seconds must be > 0 and startup_grace_seconds >= 0")
        if self.max_stacks_per_summary < 1:
            raise ConfigError("max_stacks_per_summary must be >= 1")


class _Agg:
    """One thread's stacks in the current summary interval."""

    __slots__ = ("tid", "name", "start", "samples", "stacks", "state", "last")

    def __init__(self, tid: int, name: str, start: int) -> None:
        self.tid, self.name, self.start = tid, name, start
        self.samples = 0
        self.stacks: dict[tuple, list[int]] = {}
        self.state = ""
        # (the reader's frame list, its detail-store id, its counts) of the last sample: the reader hands back the
        # very same list for a stack it found unchanged, which then costs no key nor lookup
        self.last: tuple | None = None


class _Target:
    __slots__ = ("proc", "key", "threads", "errors", "python")

    def __init__(self, proc, key, python: str) -> None:
        self.proc, self.key, self.python = proc, key, python
        self.threads: dict[int, _Agg] = {}
        self.errors = 0


class PystacksSource(Source):
    name = "pystacks"
    description = "Python stacks of workload processes, read from outside via /proc/PID/mem (CPython 3.9-3.14)"
    config_class = PystacksConfig

    @classmethod
    def probe(cls, ctx) -> Availability:
        me = os.getpid()
        path = os.path.join(ctx.proc_root, str(me), "mem")
        if not os.path.exists(path):
            return Availability.no(f"{path} does not exist (no procfs?)")
        from steplens.agent.pyframes.reader import native_unavailable
        notes = [n for n in (native_unavailable(), "" if os.geteuid() == 0 else
                             "not root: only processes of this user can be read (and Yama may refuse)") if n]
        return Availability.yes("; ".join(notes))

    def start(self) -> None:
        from steplens.agent.detail import open_shared
        self.detail = open_shared(os.path.join(self.ctx.state_dir, "detail.db"), self.config.detail_max_samples)
        self.targets: dict[tuple[int, int], _Target] = {}
        self.failed: dict[tuple[int, int], list] = {}   # key -> [failures, last try, reported]
        self._attached_for = None   # the workload snapshot every target was attached for (and none failed)
        self._pending: list = []    # (mono_ns, target, threads) of the samples not yet counted (_aggregate)
        self.deep = False
        self.period_start = self.ctx.mono_ns()
        self._last_flush = time.monotonic()

    def set_mode(self, mode: Mode) -> None:
        self.deep = mode is Mode.DEEP

    def pace(self) -> float:
        """Sentinel mode: every process is sampled at each step, back to back (the agent's code stays hot from one
        to the next), and the steps are spread so that all of them together stay within max_samples_per_second."""
        cap = self.config.max_samples_per_second
        if self.deep or cap <= 0 or not self.targets:
            return 1.0
        return max(1.0, len(self.targets) / (cap * self.config.interval_seconds))

    def idle(self) -> bool:
        if self.targets:
            return False
        self._aggregate()
        self.detail.flush()  # the raw samples of the processes that just left are written before the wait
        return True

    def step(self) -> list:
        from steplens.agent.pyframes import memory
        out: list = []
        now = time.monotonic()
        workloads = self.ctx.workloads.snapshot()
        if workloads is not self._attached_for or self.failed:   # the same snapshot: nothing to attach or drop
            out += self._attach(workloads, now)
        # sample; what the samples add up to is counted once a second (_aggregate), in one warm loop
        for key, tgt in list(self.targets.items()):
            try:
                sample = tgt.proc.sample(stop_threads=self.config.stop_threads)
            except memory.ProcessChanged:
                changed = self.targets.pop(key)  # exec'd: summarize, then attach anew next step
                out += self._summaries(changed, self.ctx.mono_ns())
                changed.proc.close()
                self._attached_for = None
                continue
            except memory.ProcessGone:
                gone = self.targets.pop(key)
                out += self._summaries(gone, self.ctx.mono_ns())
                gone.proc.close()
                self._attached_for = None
                continue
            except memory.PyFramesError:
                tgt.errors += 1
                continue
            self._pending.append((sample.mono_ns, tgt, sample.threads))
        if now - self._last_flush >= 1.0:
            self._aggregate()
            self.detail.flush()
            self._last_flush = now
        period = self.config.deep_summary_seconds if self.deep else self.config.summary_seconds
        mono = self.ctx.mono_ns()
        if mono - self.period_start >= period * 1e9:
            for tgt in self.targets.values():
                out += self._summaries(tgt, mono)
            self.period_start = mono
        return out

    def _aggregate(self) -> None:
        """Count the samples taken since the last call into their threads' summaries and the detail store. Done
        once a second and before any summary, not per sample: at sentinel rates every step starts cold, and this
        loop over every thread of every sample costs several times less warm."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        detail_add, stack_id = self.detail.add_stack_id_sample, self.detail.stack_id
        for mono, tgt, sample_threads in pending:
            pid, threads = tgt.key[0], tgt.threads
            for th in sample_threads:
                agg = threads.get(th.tid)
                if agg is None:
                    agg = threads[th.tid] = _Agg(th.tid, th.name, self.period_start)
                last = agg.last
                if last is not None and last[0] is th.frames:
                    sid, counts = last[1], last[2]
                else:
                    frames = tuple((f.function, f.qualname, f.file, f.line) for f in th.frames)
                    counts = agg.stacks.get(frames)
                    if counts is None:
                        counts = agg.stacks[frames] = [0, 0, 0]
                    sid = stack_id(frames)
                    agg.last = (th.frames, sid, counts)
                state = th.state
                counts[0] += 1
                counts[1] += th.gil
                counts[2] += state == "running"
                agg.samples += 1
                agg.state = state
                detail_add(mono, pid, th.tid, sid, th.gil, state)

    def _attach(self, workloads: dict, now: float) -> list:
        """Attach new workload processes (those not failing within their back-off), forget those that exited."""
        from steplens.agent.pyframes import memory, reader
        out: list = []
        for key in [k for k in self.targets if k not in workloads]:
            tgt = self.targets.pop(key)
            out += self._summaries(tgt, self.ctx.mono_ns())
            tgt.proc.close()
        for key, info in workloads.items():
            if key in self.targets or len(self.targets) >= self.config.max_processes:
                continue
            fail = self.failed.get(key)
            if fail is not None and now - fail[1] < min(self.config.retry_seconds, 0.25 * 2 ** (fail[0] - 1)):
                continue
            try:
                proc = reader.attach(key[0], self.ctx.proc_root)
                self.targets[key] = _Target(proc, key, ".".join(map(str, proc.version)))
                self.failed.pop(key, None)
            except memory.ProcessGone:
                self._failed(key, now)  # exited before we got to it; procs will report the exit
            except memory.PyFramesError as exc:
                fail = self._failed(key, now)
                if not fail[2] and self._age(key) >= self.config.startup_grace_seconds:
                    fail[2] = True
                    out.append(Event(self.ctx.mono_ns(), "pystacks_attach_failed", f"pid:{key[0]}:{key[1]}",
                                     str(exc)))
        for key in [k for k in self.failed if k not in workloads]:
            del self.failed[key]
        self._attached_for = workloads
        return out

    def _failed(self, key: tuple[int, int], now: float) -> list:
        fail = self.failed.setdefault(key, [0, now, False])
        fail[0] += 1
        fail[1] = now
        return fail

    @staticmethod
    def _age(key: tuple[int, int]) -> float:
        """Seconds since the process started (its start time in clock ticks after boot); unknown: very old."""
        if not key[1]:
            return float("inf")
        return time.clock_gettime(time.CLOCK_BOOTTIME) - key[1] / os.sysconf("SC_CLK_TCK")

    def _summaries(self, tgt: _Target, end_mono: int) -> list:
        self._aggregate()
        out = []
        for tid, agg in tgt.threads.items():
            if not agg.samples:
                continue
            frame_ids: dict[tuple, int] = {}
            stacks = []
            ranked = sorted(agg.stacks.items(), key=lambda kv: -kv[1][0])
            keep, rest = ranked[:self.config.max_stacks_per_summary], ranked[self.config.max_stacks_per_summary:]
            if rest:
                other = [sum(c[i] for _, c in rest) for i in range(3)]
                keep.append(((("<other stacks>", "<other stacks>", "", -1),), other))
            for frames, (count, gil, running) in keep:
                ids = []
                for f in frames:
                    fid = frame_ids.get(f)
                    if fid is None:
                        fid = frame_ids[f] = len(frame_ids)
                    ids.append(fid)
                stacks.append((tuple(ids), count, gil, running))
            out.append(StackSummary(end_mono, tgt.key[0], tgt.key[1], tid, agg.name, agg.start, agg.samples,
                                    list(frame_ids), stacks, tgt.errors, tgt.python, agg.state))
        tgt.threads = {}
        tgt.errors = 0
        return out

    def stop(self) -> None:
        if getattr(self, "detail", None) is not None:
            self._aggregate()   # the samples of the last second still go to the detail store
        for tgt in getattr(self, "targets", {}).values():
            tgt.proc.close()
        self.targets = {}
        if getattr(self, "detail", None) is not None:
            from steplens.agent.detail import release_shared
            release_shared(self.detail)
            self.detail = None
