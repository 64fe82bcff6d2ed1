"""Runs the agent's sources: one thread each, timed, isolated and bounded.

Each source's step() runs on its own thread at its interval (its deep interval while deep mode is
on), so a slow or failing source never stalls another. Records go into one bounded queue that
drops the oldest and counts it; a batcher thread cuts batches by size and age, encodes them and
appends them to the spool. Queue drops become a Gap record, so a loss is never silent; a record the
encoder refuses (a value out of its field's range) is left out of its batch and reported as an Event.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from steplens.agent.governor import Governor, GovernorSettings, name_native_thread
from steplens.agent.records import Event, Gap, Mode
from steplens.agent.sources.base import Availability, HostContext, Source, SourceConfig

log = logging.getLogger("steplens.agent.runner")


def _release_build_state() -> None:
    """Drop what starting an eBPF source needed and running it does not (the kernel's BTF, ~6 MB): read again if
    another source starts later."""
    ebpf = sys.modules.get("steplens.agent.ebpf")
    if ebpf is not None:
        ebpf.release_btf()


@dataclass
class SourceState:
    name: str
    enabled: bool
    up: bool = False
    reason: str = ""
    last_duration_seconds: float = 0.0
    steps: int = 0
    errors: int = 0            # failed steps plus the non-fatal errors the source counts itself
    step_errors: int = 0
    records: int = 0
    step_started: float = 0.0  # time.monotonic() of a step in progress, 0 when idle
    idle: bool = False         # waiting for a workload process (Source.idle)
    cpu_cores: float = 0.0     # its steps' CPU over the governor's last period (CPU seconds per second)
    rate_scale: float = 1.0    # the governor's interval divisor (1: as configured)

    def as_dict(self) -> dict:
        return {"up": self.up, "reason": self.reason, "last_duration_seconds": self.last_duration_seconds,
                "steps": self.steps, "errors": self.errors, "records": self.records, "cpu_cores": self.cpu_cores,
                "rate_scale": self.rate_scale}


@dataclass
class BatchPolicy:
    max_records: int = 2000
    max_bytes: int = 1024 * 1024
    max_delay_seconds: float = 1.0
    queue_max_records: int = 100_000
    # while the node has no workload process and is in sentinel mode, batches wait this many times longer: host
    # metrics are still taken every interval, but each batch costs a spool write, a send and an ack
    idle_delay_factor: float = 5.0


class RecordQueue:
    """Bounded FIFO of (source, record); drops the oldest when full and counts it."""

    def __init__(self, max_records: int) -> None:
        self._items: collections.deque = collections.deque()
        self._max = max_records
        self._cond = threading.Condition()
        self._woken = False
        self._want = 1   # what the take() waiting now waits for: a put wakes it only once that many are there
        self.dropped_total = 0

    def put_many(self, source: str, records: list) -> None:
        with self._cond:
            items = self._items
            for rec in records:
                items.append((source, rec))
            over = len(items) - self._max
            if over > 0:
                for _ in range(over):
                    items.popleft()
                self.dropped_total += over
            if len(items) >= self._want:   # (a wake-up before would only find too few and wait again: every
                self._cond.notify()        # source's every step woke the batcher, ~40 times a second)

    def wake(self) -> None:
        """End every take() waiting now (shutdown: flush what is there)."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def take(self, max_items: int, wait_seconds: float, min_items: int) -> list:
        """Wait up to wait_seconds for min_items (or a wake()), then take at most max_items."""
        deadline = time.monotonic() + wait_seconds
        with self._cond:
            self._want = max(1, min_items)
            while len(self._items) < min_items and not self._woken:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            n = min(max_items, len(self._items))
            return [self._items.popleft() for _ in range(n)]

    def __len__(self) -> int:
        return len(self._items)


class Runner:
    def __init__(self, ctx: HostContext, sources: dict[str, tuple[type[Source], SourceConfig]],
                 encode: Callable[[list], bytes], spool, policy: BatchPolicy,
                 observers: list[Callable[[list], None]] | None = None, governor: Governor | None = None) -> None:
        self.ctx = ctx
        self.governor = governor or Governor(GovernorSettings())
        self.spool = spool
        self.policy = policy
        self._encode = encode
        self._observers = observers or []
        self.queue = RecordQueue(policy.queue_max_records)
        self._stop = threading.Event()
        self._pokes: dict[str, threading.Event] = {name: threading.Event() for name in sources}  # refresh()
        self._batcher_stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._instances: dict[str, Source] = {}
        self._specs = sources
        self.states: dict[str, SourceState] = {
            name: SourceState(name, cfg.enabled, reason="" if cfg.enabled else "disabled in config")
            for name, (_, cfg) in sources.items()}
        self._mode = Mode.SENTINEL
        self._queue_drops_reported = 0
        self.batch_errors = 0
        self.records_rejected = 0   # records the encoder refused, left out of their batch
        self.on_source_started: Callable[[], None] | None = None  # after each source's start, up or not

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        for name, (cls, cfg) in self._specs.items():
            if not cfg.enabled:
                continue
            t = threading.Thread(target=self._source_main, args=(name, cls, cfg), name=f"source-{name}", daemon=True)
            self._threads.append(t)
            t.start()
        b = threading.Thread(target=self._batcher_main, name="batcher", daemon=True)
        self._batcher = b
        b.start()
        g = threading.Thread(target=self._governor_main, name="governor", daemon=True)
        self._threads.append(g)
        g.start()

    def _governor_main(self) -> None:
        name_native_thread("sl-governor")
        gov = self.governor
        while not self._stop.wait(gov.settings.period_seconds):
            gov.tick()
            for name, c in gov.costs.items():
                st = self.states.get(name)
                if st is not None:
                    st.cpu_cores, st.rate_scale = c.cores, c.scale

    def refresh(self, name: str, timeout: float = 3.0, until_mono_ns: int = 0, pids=None) -> bool:
        """Have source `name` run a step now that reads what it would otherwise read later (Source.refresh: the
        Flight Recorder rings before a FetchDetail, so node-local detail is not up to a read interval old), and
        wait for that step, at most `timeout` s. until_mono_ns / pids: the fetch's window end and processes; a
        source whose refresh() says what it stored already covers them (returns False) is not stepped. False when
        the source is not running or did not finish in time."""
        inst, state = self._instances.get(name), self.states.get(name)
        if inst is None or state is None or not state.up or state.idle or not hasattr(inst, "refresh"):
            return False
        before = state.steps + (1 if state.step_started else 0)   # a step under way may have passed its checks
        if inst.refresh(until_mono_ns, pids) is False:
            return True
        self._pokes[name].set()
        deadline = time.monotonic() + timeout
        while state.steps <= before and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.01)
        return state.steps > before

    def stop(self, timeout: float = 5.0) -> None:
        """Stop sources (each gets its share of timeout), then flush the queue into the spool."""
        if self._stop.is_set() and self._batcher_stop.is_set():
            return
        self._stop.set()
        for poke in self._pokes.values():
            poke.set()
        self.ctx.workloads.wake()   # sources waiting for a workload (Source.idle) look at the stop event
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for name, t in zip([n for n, (_, c) in self._specs.items() if c.enabled], self._threads):
            if t.is_alive():
                log.warning("source %s did not stop within %.1fs; abandoning its thread", name, timeout)
        self._batcher_stop.set()
        self.queue.wake()
        if getattr(self, "_batcher", None) is not None:
            self._batcher.join(max(1.0, deadline - time.monotonic()))

    # -- mode ------------------------------------------------------------------------------
    @property
    def mode(self) -> Mode:
        return self._mode

    def set_mode(self, mode: Mode) -> None:
        self._mode = mode
        self.governor.set_deep(mode is Mode.DEEP)
        for name, inst in list(self._instances.items()):
            try:
                inst.set_mode(mode)
            except Exception as exc:  # a source's mode switch failing must not hurt the others
                self.states[name].errors += 1
                self.states[name].reason = f"set_mode failed: {exc}"

    def emit(self, source: str, records: list) -> None:
        """Records made by the agent itself (mode changes) take the same path as sources'."""
        self.queue.put_many(source, records)

    # -- threads ---------------------------------------------------------------------------
    def _started(self) -> None:
        """A source's start ended, up or not: tell the transport (a status at once)."""
        if self.on_source_started is not None:
            try:
                self.on_source_started()
            except Exception:
                log.debug("on_source_started failed", exc_info=True)

    def _source_main(self, name: str, cls: type[Source], cfg: SourceConfig) -> None:
        name_native_thread(f"sl-{name}")
        state = self.states[name]
        try:
            avail: Availability = cls.probe(self.ctx)
        except Exception as exc:
            avail = Availability.no(f"probe failed: {type(exc).__name__}: {exc}")
        if not avail.ok:
            state.up, state.reason = False, avail.reason
            self._started()
            return
        try:
            inst = cls(self.ctx, cfg)
            inst.start()
        except Exception as exc:
            state.up, state.reason = False, f"start failed: {type(exc).__name__}: {exc}"
            state.errors += 1
            self._started()
            return
        finally:
            _release_build_state()
        self._instances[name] = inst
        if self._mode is not Mode.SENTINEL:
            try:
                inst.set_mode(self._mode)
            except Exception:
                state.errors += 1
        state.up, state.reason = True, avail.reason
        self._started()
        self.governor.register(name, bool(getattr(cls, "governed", True)))
        next_at = time.monotonic()
        cpu_mark = time.thread_time()   # this thread's CPU: its steps (and the loop around them), for the governor
        try:
            while not self._stop.is_set():
                if not self.ctx.workloads.snapshot() and inst.idle():
                    # nothing to do until a workload appears: wait for one instead of stepping
                    state.idle, state.reason = True, "idle: waiting for a workload process"
                    self.ctx.workloads.wait_nonempty(self._stop)
                    state.idle = False
                    next_at = time.monotonic()
                    cpu_mark = time.thread_time()
                    continue
                t0 = time.monotonic()
                state.step_started = t0
                try:
                    recs = inst.step()
                    ok = True
                except Exception as exc:
                    ok = False
                    state.step_errors += 1
                    state.up, state.reason = False, f"step failed: {type(exc).__name__}: {exc}"
                    log.debug("source %s step failed", name, exc_info=True)
                    recs = []
                dt = time.monotonic() - t0
                cpu_now = time.thread_time()   # one clock read per step: a 1 kHz sampler's loop is a hot path
                self.governor.add_cpu(name, cpu_now - cpu_mark)
                cpu_mark = cpu_now
                state.step_started = 0.0
                state.last_duration_seconds = dt
                state.steps += 1
                # a source may count partial failures (one NVML field unsupported on one GPU) in `errors`
                own = getattr(inst, "errors", 0)
                state.errors = state.step_errors + (own if isinstance(own, int) else 0)
                if ok:
                    state.up, state.reason = True, avail.reason
                if recs:
                    state.records += len(recs)
                    self.queue.put_many(name, recs)
                deep = self._mode is Mode.DEEP and cfg.deep_interval_seconds
                pace = max(1.0, inst.pace())            # the source's own stretch (pystacks: its sample budget)
                interval = (cfg.deep_interval_seconds if deep else cfg.interval_seconds) * pace
                interval /= self.governor.scale(name)   # stretched over the CPU budget (agent/governor.py)
                if deep:   # ... but deep mode never reads a source less often than sentinel mode does: a dive
                    # ranks causes by the host's counters, which a 1 % budget had stretched to one per 5 s
                    interval = min(interval, cfg.interval_seconds * pace)
                next_at += interval
                now = time.monotonic()
                if next_at < now:  # overran: skip the missed ticks rather than bursting
                    next_at = now + interval - ((now - next_at) % interval)
                poke = self._pokes[name]
                if poke.wait(next_at - now) and not self._stop.is_set():
                    poke.clear()           # refresh(): a step now, then the schedule goes on from it
                    next_at = time.monotonic()
        finally:
            try:
                inst.stop()
            except Exception as exc:
                log.warning("source %s stop failed: %s", name, exc)
            state.up = False
            if not state.reason or state.reason == avail.reason:
                state.reason = "stopped"

    def _encodable(self, items: list) -> list:
        keep, bad = [], collections.Counter()
        first: dict[str, str] = {}
        for source, rec in items:
            try:
                self._encode([(source, rec)])
            except (ValueError, TypeError, OverflowError) as exc:
                bad[source] += 1
                first.setdefault(source, f"{type(rec).__name__}: {type(exc).__name__}: {exc}")
                continue
            keep.append((source, rec))
        now = self.ctx.mono_ns()
        for source, n in bad.items():
            self.records_rejected += n
            log.warning("source %s emitted %d record(s) the encoder refused (first: %s)", source, n, first[source])
            keep.append(("agent", Event(now, "records_rejected", source, f"{n} record(s) of source {source} "
                                        f"dropped: a value out of its field's range (first: {first[source]})",
                                        float(n))))
        return keep

    def stalled_check(self) -> None:
        """Mark sources whose step has run past their step timeout as down (called by status)."""
        now = time.monotonic()
        for name, (_, cfg) in self._specs.items():
            st = self.states[name]
            if st.step_started and now - st.step_started > cfg.step_timeout_seconds:
                st.up, st.reason = False, f"stalled: step running for {now - st.step_started:.1f}s"

    def _batcher_main(self) -> None:
        name_native_thread("sl-batcher")
        p = self.policy
        while True:
            stopping = self._batcher_stop.is_set()
            delay = p.max_delay_seconds
            if not self.ctx.workloads.snapshot() and self._mode is Mode.SENTINEL:
                delay *= p.idle_delay_factor
            items = self.queue.take(p.max_records, 0.05 if stopping else delay, p.max_records)
            drops = self.queue.dropped_total - self._queue_drops_reported
            if drops:
                self._queue_drops_reported += drops
                self.spool.count_lost(drops)
                items.append(("agent", Gap(self.ctx.mono_ns(), drops, 0, 0, 0, "agent record queue full")))
            if items:
                for obs in self._observers:
                    try:
                        obs(items)
                    except Exception:
                        log.debug("observer failed", exc_info=True)
                self._write(items)
            elif stopping:
                return

    def _write(self, items: list) -> None:
        try:
            payload = self._encode(items)
        except (ValueError, TypeError, OverflowError):
            # one record with a value its field cannot hold (a source's bug or a crafted input) must not take
            # the batch, or the batcher thread, with it: keep the others, count and report the rest
            items = self._encodable(items)
            if not items:
                return
            payload = self._encode(items)
        if len(payload) > self.policy.max_bytes and len(items) > 1:
            half = len(items) // 2
            self._write(items[:half])
            self._write(items[half:])
            return
        try:
            self.spool.append(payload, len(items), self.ctx.mono_ns())
        except Exception as exc:  # disk full, I/O error: count it, keep running, records are lost visibly
            self.batch_errors += 1
            self.spool_error = str(exc)
            log.error("spool append failed, %d records lost: %s", len(items), exc)
