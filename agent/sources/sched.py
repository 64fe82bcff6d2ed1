"""sched: per-thread on-CPU, off-CPU and run-queue time of workload threads, from the scheduler's raw tracepoints.

Probes (bcc, raw tracepoints; no kprobes needed): `sched_switch` (TP_PROTO(bool preempt, struct task_struct
*prev, struct task_struct *next, unsigned int prev_state) since 5.18; before that prev_state is read from
task_struct.__state/state), `sched_wakeup` and `sched_wakeup_new` (TP_PROTO(struct task_struct *p)).
task_struct.pid/tgid are read at offsets from the running kernel's BTF (agent/ebpf.btf_offset), rendered into
sched.bpf.c by the pure function `render_program`. Programs are named `steplens_sw`, `steplens_wk`,
`steplens_wkn`; nothing is pinned, so they go away with the agent's file descriptors (stop() or death).

Only workload processes are accounted: a BPF hash of watched tgids is synced each step from
ctx.workloads.snapshot() (new ones added, exited ones removed). Per thread (tid) the kernel side keeps
cumulative counters that are never cleared while the thread lives (clearing after a read loses the updates
made in between): on-CPU ns (switch-in → switch-out), off-CPU ns (switch-out → switch-in, run-queue wait
included), run-queue ns (wakeup, or involuntary switch-out, → switch-in), switches, and involuntary switches
(preempted or still TASK_RUNNING at switch-out: the kernel's own nivcsw rule, so it matches
/proc/PID/task/TID/status nonvoluntary_ctxt_switches). A read adds each live thread's interval still open
(on CPU since, off CPU since, runnable since; bpf_ktime_get_ns's clock from user space, ebpf.ktime_now_ns), so a
thread spinning alone on a CPU or blocked for minutes in a hung collective shows it between two reads, not at
its next switch; what is emitted never goes below what was emitted before (a copy taken while another CPU is
half-way through a switch can hold an interval twice or not at all). Entries of exited threads/processes are
emitted one last time (closed intervals only) and then deleted.

Emitted (entity `pid:<pid>:<start_ticks>:tid:<tid>`), all cumulative, Prometheus style:
  sched_on_cpu_seconds_total, sched_off_cpu_seconds_total, sched_runqueue_seconds_total,
  sched_switches_total, sched_involuntary_switches_total.
  Every 5 s in sentinel mode (`interval_seconds`), every second in deep mode (`deep_interval_seconds`): five
  series per thread of every workload, and a torch rank has ~15 threads, so at 1 Hz an 8-rank host sent ~600
  metrics a second, most of what its agent streamed in sentinel mode, which nothing in the collector's sentinel
  detection reads (its causes take the main thread's run-queue time from the host source, every second); the
  counters lose nothing between reads, a read only samples them.
  Event kind "sched_map_overflow" (value = failed map inserts since start) whenever that count grows.
Deep mode (set_mode(Mode.DEEP)): a flag in a BPF array makes switch-out also take the user stack
(bpf_get_stackid(BPF_F_USER_STACK)); at switch-in the off-CPU interval is added to (tid, stack_id). Each step
emits, per thread, the `deep_stack_top` stacks with the most off-CPU time since the previous step as
Event(kind="offcpu_stack", message = frames outermost first joined by ";" (agent/ebpf/elfsyms.py, module in
brackets, best effort; an unresolved frame is its hex address), value = seconds in that step). User stacks need
frame pointers to go deeper than a frame or two (CPython built without them, most distro libraries too).
Leaving deep mode clears the stack maps.

Cost (2-core VM, kernel 6.18, busy machine; tests/test_source_sched.py::test_cost_of_programs with the kernel's
bpf_stats): steplens_sw ~300 ns per context switch (every switch on the host runs it, watched or not),
steplens_wk ~210-240 ns per wakeup; ~50k switches + 25-54k wakeups in ~6 s cost 21-41 ms of CPU, i.e.
0.4-0.65% of one core at ~10k switches/s. Deep mode adds a user stack walk at each switch-out of a watched
thread (not measured separately). Memory: the stack map is preallocated (stack_entries × 127 frames ×
8 bytes ≈ 4 MiB at the default 4096) even in sentinel mode; the hashes allocate per entry (~100 bytes per thread). User space: one map walk per step
(~µs per thread) plus, in deep mode, symbolization (bcc caches symbols per pid; the first step of a new
process pays the ELF symbol load, tens of ms for a large process).

Caveats: a thread first seen mid-slice has its first partial interval dropped; times are CLOCK_MONOTONIC
(bpf_ktime_get_ns), so suspend time is not counted.
"""

from __future__ import annotations

import ctypes as ct
import os
import platform
from dataclasses import dataclass

from steplens.agent import ebpf
from steplens.agent.records import Event, Metric, Mode
from steplens.agent.sources.base import Availability, ConfigError, HostContext, Source, SourceConfig

BPF_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sched.bpf.c")
PROGRAMS = (("sched_switch", "steplens_sw"), ("sched_wakeup", "steplens_wk"), ("sched_wakeup_new", "steplens_wkn"))


@dataclass
class SchedConfig(SourceConfig):
    interval_seconds: float = 5.0      # sentinel: the counters accumulate in the kernel; read and sent this often
    deep_interval_seconds: float = 1.0  # deep mode: every second, with the off-CPU stacks
    max_processes: int = 1024          # watched tgids (BPF hash entries)
    max_threads: int = 65536           # per-thread counter entries; a failed insert counts as overflow
    deep_stack_top: int = 5            # off-CPU stacks per thread per step in deep mode
    stack_entries: int = 4096          # BPF stack map size (preallocated: ~1 KiB per entry)
    max_offcpu_stacks: int = 16384     # (tid, stack) -> off-CPU ns entries in deep mode

    def validate(self) -> None:
        super().validate()
        for key, low, high in (("max_processes", 1, 1 << 20), ("max_threads", 16, 1 << 22),
                               ("deep_stack_top", 0, 1000), ("stack_entries", 16, 1 << 20),
                               ("max_offcpu_stacks", 16, 1 << 22)):
            value = getattr(self, key)
            if not (low <= value <= high):
                raise ConfigError(f"{key} must be within {low}..{high}, got {value}")


def prev_state_is_arg(release: str) -> bool:
    """sched_switch gained its prev_state argument in Linux 5.18."""
    try:
        major, minor = (int(x) for x in release.split("-")[0].split(".")[:2])
    except ValueError:
        return True
    return (major, minor) >= (5, 18)


def render_program(template: str, *, pid_off: int, tgid_off: int, state_off: int, prev_state_arg: bool,
                   config: SchedConfig) -> str:
    """The BPF C text for these offsets and sizes (pure: no kernel, no bcc)."""
    return render(template, TASK_PID_OFF=pid_off, TASK_TGID_OFF=tgid_off, TASK_STATE_OFF=state_off,
                  PREV_STATE_IS_ARG=int(prev_state_arg), MAX_PROCESSES=config.max_processes,
                  MAX_THREADS=config.max_threads, STACK_ENTRIES=config.stack_entries,
                  MAX_OFFCPU_STACKS=config.max_offcpu_stacks)


def render(template: str, **values) -> str:
    from steplens.agent.ebpf import render as _render

    return _render(template, **values)


def _state_offset() -> int:
    from steplens.agent.ebpf import EbpfUnavailable, btf_offset

    try:
        return btf_offset("task_struct", "__state")
    except EbpfUnavailable:
        return btf_offset("task_struct", "state")  # before 5.14


class SchedSource(Source):
    governed = False   # its buffer or ring must be read at its interval (agent/governor.py)
    name = "sched"
    config_class = SchedConfig
    description = "per-thread on/off-CPU and run-queue time of workload threads (eBPF raw tracepoints; deep: off-CPU stacks)"

    config: SchedConfig

    def __init__(self, ctx: HostContext, config: SchedConfig) -> None:
        super().__init__(ctx, config)
        self._bpf = None
        self._watched: dict[int, int] = {}      # tgid -> start_ticks
        self._deep = False
        self._overflow_reported = 0
        self._prev_stacks: dict[tuple[int, int], int] = {}  # (tid, stack_id) -> ns at the previous step
        self._emitted: dict[int, tuple[int, int, int]] = {}    # tid -> (on, off, runq) ns last emitted

    @classmethod
    def probe(cls, ctx: HostContext) -> Availability:
        from steplens.agent.ebpf import unavailable_reason

        reason = unavailable_reason(ctx.proc_root)
        return Availability.no(reason) if reason else Availability.yes()

    @classmethod
    def planned_mode(cls, ctx: HostContext, config: SchedConfig) -> tuple[str, str]:
        """(mode, why) for `steplens-agent check`: one build only, needing no BTF program type."""
        return "raw-tracepoints", ("classic raw tracepoints on " + ", ".join(tp for tp, _ in PROGRAMS) +
                                   ", the only build (no BTF program types needed)")

    def start(self) -> None:
        from steplens.agent.ebpf import btf_offset

        with open(BPF_FILE) as fh:
            template = fh.read()
        text = render_program(template, pid_off=btf_offset("task_struct", "pid"),
                              tgid_off=btf_offset("task_struct", "tgid"), state_off=_state_offset(),
                              prev_state_arg=prev_state_is_arg(platform.release()), config=self.config)
        b = ebpf.compile_program(text, tables=("deep", "offstacks", "stacks", "watched", "stats", "overflow"))
        try:
            for tp, fn in PROGRAMS:
                b.attach_raw_tracepoint(tp=tp.encode(), fn_name=fn.encode())
        except Exception:
            ebpf.cleanup(b)
            raise
        self._bpf = b
        self._watched = {}
        self._overflow_reported = 0
        self._prev_stacks = {}
        self._emitted = {}
        self._apply_deep(self._deep)

    def stop(self) -> None:
        b, self._bpf = self._bpf, None
        if b is not None:
            ebpf.cleanup(b)
        self._watched = {}
        self._prev_stacks = {}
        self._emitted = {}

    def set_mode(self, mode: Mode) -> None:
        self._deep = mode == Mode.DEEP
        if self._bpf is not None:
            self._apply_deep(self._deep)

    def idle(self) -> bool:
        return not self._watched   # the last step after the workloads left emitted their final values

    def _apply_deep(self, on: bool) -> None:
        b = self._bpf
        b[b"deep"][ct.c_int(0)] = ct.c_uint32(1 if on else 0)
        if not on:
            b[b"offstacks"].clear()
            b[b"stacks"].clear()
            self._prev_stacks = {}

    # -- step -------------------------------------------------------------------------------------

    def step(self) -> list:
        if self._bpf is None:
            return []
        now = self.ctx.mono_ns()
        b = self._bpf
        current = {pid: start for pid, start in self.ctx.workloads.snapshot()}
        watched = b[b"watched"]
        stats = b[b"stats"]
        gone_tgids = set()
        for tgid, start in list(self._watched.items()):
            if current.get(tgid) != start:
                try:
                    del watched[watched.Key(tgid)]
                except KeyError:
                    pass
                gone_tgids.add(tgid)
        for tgid, start in current.items():
            if self._watched.get(tgid) != start:
                watched[watched.Key(tgid)] = watched.Leaf(1)
        previous, self._watched = self._watched, dict(current)

        out: list = []
        live_tasks: dict[int, set[int] | None] = {}
        stale = []
        # bpf_ktime_get_ns's clock (whatever ctx.mono_ns is), read before the walk: an interval opened after it
        # counts nothing now and all of itself at its close.
        kernel_now = ebpf.ktime_now_ns()
        for key, s in stats.items():
            tid, tgid = key.value, s.tgid
            start = previous.get(tgid) if tgid in gone_tgids else current.get(tgid)
            if start is None:
                stale.append(key)
                continue
            live = False
            if tgid not in gone_tgids:
                if tgid not in live_tasks:
                    live_tasks[tgid] = self._tasks(tgid)
                tasks = live_tasks[tgid]
                live = tasks is not None and tid in tasks
            times = _with_open_intervals(s, kernel_now) if live else (s.on_cpu_ns, s.off_cpu_ns, s.runq_ns)
            # A copy taken while a switch on another CPU is half written may hold an interval both closed and
            # open, or neither: the counters never go back below what was already emitted.
            on, off, runq = times = tuple(map(max, times, self._emitted.get(tid, (0, 0, 0))))
            self._emitted[tid] = times
            entity = f"pid:{tgid}:{start}:tid:{tid}"
            out.append(Metric(now, "sched_on_cpu_seconds_total", entity, on / 1e9))
            out.append(Metric(now, "sched_off_cpu_seconds_total", entity, off / 1e9))
            out.append(Metric(now, "sched_runqueue_seconds_total", entity, runq / 1e9))
            out.append(Metric(now, "sched_switches_total", entity, float(s.switches)))
            out.append(Metric(now, "sched_involuntary_switches_total", entity, float(s.involuntary)))
            if tgid in gone_tgids:
                stale.append(key)  # emitted a last time; the process is gone
            elif live_tasks[tgid] is not None and not live:
                stale.append(key)  # the thread is gone
        for key in stale:
            self._emitted.pop(key.value, None)
            try:
                del stats[key]
            except KeyError:
                pass

        overflow = int(b[b"overflow"].sum(0).value)
        if overflow > self._overflow_reported:
            out.append(Event(now, "sched_map_overflow", "",
                             f"{overflow - self._overflow_reported} BPF map insert(s) failed since the last report "
                             f"(max_threads={self.config.max_threads}, stack_entries={self.config.stack_entries}, "
                             f"max_offcpu_stacks={self.config.max_offcpu_stacks})", float(overflow)))
            self._overflow_reported = overflow

        if self._deep and self.config.deep_stack_top > 0:
            out.extend(self._offcpu_stacks(now, current))
        return out

    def _tasks(self, tgid: int) -> set[int] | None:
        try:
            return {int(t) for t in os.listdir(os.path.join(self.ctx.proc_root, str(tgid), "task"))}
        except (OSError, ValueError):
            return None

    def _offcpu_stacks(self, now: int, current: dict[int, int]) -> list:
        b = self._bpf
        totals: dict[tuple[int, int], int] = {}
        for k, v in b[b"offstacks"].items():
            totals[(k.tid, k.stack_id)] = v.value
        per_thread: dict[int, list[tuple[int, int]]] = {}
        for (tid, sid), ns in totals.items():
            delta = ns - self._prev_stacks.get((tid, sid), 0)
            if delta > 0:
                per_thread.setdefault(tid, []).append((delta, sid))
        self._prev_stacks = totals
        tgid_of = {k.value: s.tgid for k, s in b[b"stats"].items()}
        out = []
        stacks = b[b"stacks"]
        for tid, items in per_thread.items():
            tgid = tgid_of.get(tid)
            if tgid is None or tgid not in current:
                continue
            entity = f"pid:{tgid}:{current[tgid]}:tid:{tid}"
            items.sort(reverse=True)
            for delta, sid in items[: self.config.deep_stack_top]:
                frames = []
                try:
                    for addr in stacks.walk(sid):
                        frames.append(_symbol(b, addr, tgid))
                except Exception:  # the stack id was evicted; report it without frames
                    frames = []
                frames.reverse()  # folded-stack order: outermost first
                out.append(Event(now, "offcpu_stack", entity, ";".join(frames) or f"[stack {sid} unavailable]",
                                 delta / 1e9))
        return out


def _with_open_intervals(s, now_ns: int) -> tuple[int, int, int]:
    """A live thread's on-CPU, off-CPU and run-queue ns with the interval still open at `now_ns` added: a thread
    that spins without ever switching out, or blocks for minutes (a hung collective), shows it as it happens,
    not at its next switch."""
    on, off, runq = s.on_cpu_ns, s.off_cpu_ns, s.runq_ns
    if s.last_in_ns:
        on += max(0, now_ns - s.last_in_ns)
    if s.last_out_ns:
        off += max(0, now_ns - s.last_out_ns)
    if s.enqueued_ns:
        runq += max(0, now_ns - s.enqueued_ns)
    return on, off, runq


def _symbol(b, addr: int, pid: int) -> str:
    try:
        text = b.sym(addr, pid)
    except Exception:
        return hex(addr)
    return hex(addr) if not text or text.startswith("[unknown]") else text
