"""procs: finds the training/inference processes on this node and says which job and rank each belongs to.

Each step lists ctx.proc_root and reads /proc/PID/stat (start time, parent, comm, state, PF_KTHREAD flag)
of every new PID, of every workload, and of each known non-workload once per recheck_seconds (to catch
exec and PID reuse cheaply). For a process not seen before (new pid, start time or comm, since exec and
setproctitle change comm) it reads cmdline, the exe link, environ, cgroup and, for Python processes the
cmdline does not classify, /proc/PID/maps. A process is a workload when
  * it is Python (exe basename or argv[0] matches python*) and its cmdline names a framework launcher or
    module (torchrun, torch.distributed.run, vllm, sglang, megatron, deepspeed, VLLM::* process titles), or
    /proc/PID/maps shows the framework's native libraries loaded (an executable mapping of libtorch*.so,
    vllm/_C, sgl_kernel, ...; a file only mmap'd for reading, as a symbolizer does, is not loaded); or
  * its joined cmdline matches one of the configured `patterns` (framework "pattern:<regex>").
The agent itself (proc_root's `self`) is never a workload: its off-CPU stack symbolizer maps the libraries it
reads, and a pattern may match its own command line.
A Python process that has not imported torch yet maps nothing telling, so its maps are re-read with a
doubling back-off (1 s, 2 s, 4 s ... up to maps_recheck_max_seconds) instead of once; a classified process
is never re-read.

Job key: STEPLENS_JOB, else torchelastic:<TORCHELASTIC_RUN_ID>, else slurm:<SLURM_JOB_ID>, else for torchrun's
default run id ("none", see below) torchrun:<endpoint>[@<node>:<launcher pid>.<start ticks>], else
master:<MASTER_ADDR>:<MASTER_PORT>, else pid:<top-most workload ancestor>. Unless include_helpers is set, a
workload whose parent is a workload of the same rank (a forked DataLoader or compile worker) is left out.

torchrun without --rdzv-id sets TORCHELASTIC_RUN_ID=none in every worker of every such job (torch 2.13: when
--master-port, --rdzv-endpoint or --nnodes > 1 is given; a plain single-node launch gets a random uuid), so
that value alone would merge all of them into one job. The key must be equal on every rank, also on other
hosts and after a restart, and differ between jobs. What a worker's environment and its launcher offer:
  * the rendezvous endpoint: the launcher's --rdzv-endpoint (c10d, etcd backends) as typed on every host's
    command line, else MASTER_ADDR:MASTER_PORT (static backend: --master-addr/--master-port, the same on
    every host and kept across restarts). Shared across hosts and restarts, and no two running jobs can
    share it: the endpoint is a listening TCP store. MASTER_PORT itself is not used for c10d, where the
    rank-0 agent picks a fresh port per rendezvous round (it would change on restart).
  * the launch time or pid of the launcher: host-local, so a host could not derive the key another host
    uses. Only when the whole job runs under one launcher (WORLD_SIZE == LOCAL_WORLD_SIZE) is it shared by
    every rank; it survives restarts (the launcher restarts its workers) and tells apart jobs run one after
    the other on the same endpoint, and with the node it keeps single-node jobs of different hosts (all on
    localhost:29500) apart.
  * nothing else: TORCHELASTIC_ERROR_FILE's directory is random per host, RESTART_COUNT changes by design.
So a multi-host job is torchrun:<endpoint>, and two multi-host jobs run one after the other on the same
endpoint share a key (set --rdzv-id or STEPLENS_JOB to tell them apart); a single-host job is
torchrun:<endpoint>@<node>:<launcher pid>.<launcher start ticks>. Without a visible launcher (ancestor within
8 generations running torchrun or torch.distributed.run/launch), torchrun:<MASTER_ADDR>:<MASTER_PORT>.

Emits ProcessInfo when a (pid, start_ticks) is first seen (everything present on the first step), again if
exec changed what it runs, and ProcessExit when it is gone (a zombie counts as gone); keeps ctx.workloads
current for the other sources.

Process state (for hang diagnosis): the state letter of every reported workload (its stat is read every scan,
helpers included; only known non-workloads are skipped between verifications) is followed across scans, and
each transition is one Event, entity "<pid>:<start_ticks>", message naming rank and job key:
  * process_stopped: 'T' (group stop: SIGSTOP, SIGTSTP, ...) at the first scan that sees it, value 0 then;
    't' (ptrace stop: a debugger, or the agent's own pyframes sampler, which stops threads for microseconds)
    only once it has lasted stopped_after_seconds, value = seconds since first seen in it;
  * process_blocked: 'D' (uninterruptible sleep) once it has lasted blocked_after_seconds, value likewise;
  * process_running: a process reported stopped or blocked is seen in any other state but those (R, S, ...);
    value = seconds since the onset of what was reported (a stop that turned into a block counts whole);
  * process_zombie: a reported workload is seen as 'Z' (exited, not reaped); its ProcessExit follows in the
    same step, as before.
"Lasted" means seen in the state at two scans that far apart with the process not run in between: two
scans can each catch a different short stop or disk wait (a busy sampler, a data loader doing I/O), so while
a workload sits unreported in 't' or 'D' its /proc/PID/schedstat (run time, times scheduled in) is read and
any change restarts the clock. Without schedstat (kernel without CONFIG_SCHED_INFO) the two scans decide.
A state the process stays in is reported once; Z and X are never tracked (gone).

Privileges: /proc/PID/environ and /proc/PID/exe of other users' processes need root (or CAP_SYS_PTRACE);
without them the process is still reported with what cmdline and stat say (no rank, env empty).

Cost (2-core Debian 12 VM, ~75 processes of which 6 unclassified Python ones; tests/test_source_procs.py::
test_step_cost, process_time over 120 steps with the clock advanced 1 s per step, after a 60 s warm-up):
~0.3 ms of CPU per scan, ~0.03% of a core at 1 Hz. A known non-workload costs nothing between its
verifications (a stat read every recheck_seconds); a workload one stat read (~7 µs) per scan; an
unclassified Python process one maps read (~0.5 ms for a large interpreter) per maps_recheck_max_seconds
once the back-off has ramped up; a new process one classification (~0.1-1 ms). State tracking adds a dict
update per workload per scan and one schedstat read (~5 µs) per workload sitting unreported in 't' or 'D'.
While no process was created since the previous full scan (/proc/loadavg's last field, the last PID handed out,
unchanged) and no re-read is due, a scan is skipped with no workload to follow (one read of /proc/loadavg), and
with workloads reads only their stat (no listing of /proc; with an 8-rank job here a step's median went from
533-611 to 376-410 µs, its mean, full scans after other processes' forks included, from 706-771 to 612-633):
an idle host costs a full scan every recheck_seconds, a host running a job too. Not where the agent's PID
namespace is below the one proc_root shows (that field is the reader's namespace's).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from steplens.agent.records import Event, ProcessExit, ProcessInfo
from steplens.agent.sources.base import Availability, ConfigError, HostContext, Source, SourceConfig

ENV_KEYS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
    "GROUP_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "STEPLENS_JOB", "GROUP_WORLD_SIZE",
)
TORCHRUN_DEFAULT_RUN_ID = "none"  # torchrun's --rdzv-id default: shared by every job launched without one
_ENV_KEYS_B = {k.encode(): k for k in ENV_KEYS}

_PF_KTHREAD = 0x00200000
_PYTHON_RE = re.compile(r"^python[0-9.]*(d|m|dm)?$")
# A container runtime's 64-hex id in a cgroup path: docker-<id>.scope, cri-containerd-<id>.scope,
# crio-<id>.scope, /docker/<id>, /kubepods/.../<id>.
_CONTAINER_RE = re.compile(r"(?<![0-9a-f])([0-9a-f]{64})(?![0-9a-f])")

# cmdline rules, most specific first: (framework, test on argv tokens)
_MODULE_PREFIXES = (
    ("vllm", ("vllm.",)),
    ("sglang", ("sglang.", "sgl_")),
    ("megatron", ("megatron.",)),
    ("deepspeed", ("deepspeed.",)),
    ("torch", ("torch.distributed.run", "torch.distributed.launch", "torch.distributed.elastic")),
)
_SCRIPT_NAMES = {"torchrun": "torch", "vllm": "vllm", "deepspeed": "deepspeed", "ds": "deepspeed"}
# substrings of mapped file paths, most specific first
_MAPS_MARKERS = (
    (b"/vllm/", "vllm"),
    (b"sgl_kernel", "sglang"),
    (b"/sglang/", "sglang"),
    (b"/megatron/", "megatron"),
    (b"/deepspeed/", "deepspeed"),
    (b"libtorch_python.so", "torch"),
    (b"libtorch_cuda.so", "torch"),
    (b"libtorch_cpu.so", "torch"),
    (b"libtorch.so", "torch"),
)


@dataclass
class ProcsConfig(SourceConfig):
    patterns: list[str] = field(default_factory=list)  # regexes on the space-joined cmdline; a match is a workload
    include_helpers: bool = False  # also report workloads whose parent is a workload of the same rank (DataLoader workers)
    detect_by_maps: bool = True  # read /proc/PID/maps of Python processes to spot libtorch & co.
    maps_recheck_max_seconds: float = 30.0  # longest wait between maps re-reads of an unclassified Python process
    recheck_seconds: float = 5.0  # a known non-workload process is re-read this often (catches exec); 0: every scan
    max_cmdline_bytes: int = 4096  # cmdline kept in ProcessInfo is cut to this many bytes
    stopped_after_seconds: float = 2.0  # a workload in ptrace stop ('t') is reported once it lasts this long; 'T' at once
    blocked_after_seconds: float = 5.0  # a workload in uninterruptible sleep ('D') is reported once it lasts this long

    def validate(self) -> None:
        super().validate()
        for p in self.patterns:
            try:
                re.compile(p)
            except re.error as exc:
                raise ConfigError(f"patterns: {p!r} is not a valid regex: {exc}") from None
        if self.maps_recheck_max_seconds < 0:
            raise ConfigError("maps_recheck_max_seconds must be >= 0")
        if not (0 <= self.recheck_seconds <= 3600):
            raise ConfigError(f"recheck_seconds must be within 0..3600, got {self.recheck_seconds}")
        if self.max_cmdline_bytes < 64:
            raise ConfigError("max_cmdline_bytes must be >= 64")
        # 0 would report every microsecond sampler stop and every disk wait a scan happens to catch
        if not (0 < self.stopped_after_seconds <= 3600):
            raise ConfigError(f"stopped_after_seconds must be within (0, 3600], got {self.stopped_after_seconds}")
        if not (0 < self.blocked_after_seconds <= 3600):
            raise ConfigError(f"blocked_after_seconds must be within (0, 3600], got {self.blocked_after_seconds}")


@dataclass
class _Seen:
    """What one scan keeps of a process between scans."""

    comm: bytes
    info: ProcessInfo | None  # None: not a workload (yet)
    python: bool = False
    cmdline: list[str] = field(default_factory=list)
    maps_next_ns: int = 0  # when to re-read maps of an unclassified Python process; 0: never
    maps_wait_ns: int = 0
    ppid: int = 0
    verify_ns: int = 0  # a non-workload is not re-read (stat) before this


_STOPPED, _BLOCKED = "stopped", "blocked"
_STATE_CLASS = {b"T": _STOPPED, b"t": _STOPPED, b"D": _BLOCKED}
_NEEDS_CONTINUITY = (b"t", b"D")  # reported only when they last: checked against schedstat


@dataclass
class _RunState:
    """The state of one reported workload across scans."""

    cls: str  # _STOPPED, _BLOCKED or "" (running, sleeping, ...)
    since_ns: int  # first scan that saw it in cls (without running in between, for 't' and 'D')
    mark: tuple | None = None  # schedstat (run time, times scheduled in) at since_ns, for 't' and 'D'
    reported: str = ""  # the class last reported; "" none (or reported back running)
    reported_since_ns: int = 0  # onset of the reported episode


class ProcsSource(Source):
    name = "procs"
    config_class = ProcsConfig
    description = "Workload process discovery (torch, vLLM, SGLang, Megatron, DeepSpeed, patterns) with job/rank from environ"

    config: ProcsConfig

    def __init__(self, ctx: HostContext, config: ProcsConfig) -> None:
        super().__init__(ctx, config)
        self._patterns = [(p, re.compile(p)) for p in config.patterns]
        self._seen: dict[tuple[int, int], _Seen] = {}
        self._by_pid: dict[int, tuple[int, int]] = {}
        self._reported: dict[tuple[int, int], ProcessInfo] = {}
        self._states: dict[tuple[int, int], _RunState] = {}
        self._last_pid_path = ""   # /proc/loadavg where it speaks for proc_root's PID namespace, else ""
        self._last_pid = b""       # its last field at the previous full scan
        self._due_ns = 0           # the earliest re-read a full scan set (a non-workload's recheck, a maps read)
        self._own_pid = -1         # this agent as proc_root shows it: never a workload
        self.scans_skipped = 0
        self.scans_known_only = 0   # scans that read only the known processes' due stat (no fork since the last)

    @classmethod
    def probe(cls, ctx: HostContext) -> Availability:
        root = ctx.proc_root
        try:
            names = os.listdir(root)
        except OSError as exc:
            return Availability.no(f"cannot list {root}: {exc}")
        if not any(n.isdigit() for n in names):
            return Availability.no(f"{root} lists no processes (not a procfs?)")
        if os.geteuid() != 0:
            return Availability.yes("not root: environ of other users' processes is unreadable, rank/job may be missing")
        return Availability.yes()

    def start(self) -> None:
        os.listdir(self.ctx.proc_root)
        self._seen = {}
        self._by_pid = {}
        self._reported = {}
        self._states = {}
        self._last_pid_path = _last_pid_source(self.ctx.proc_root)
        self._last_pid = b""
        self._due_ns = 0
        self._own_pid = _own_pid(self.ctx.proc_root)

    def _fork_free(self, now: int) -> bool:
        """True when no process was created since the previous full scan (the last PID the kernel handed out,
        /proc/loadavg's last field, is unchanged) and no re-read is due: then the scan can be skipped (no
        workload to follow) or cut to the known processes (see step). A process that execs keeps its PID: it is
        caught at its recheck (recheck_seconds), as in a full scan. Otherwise the field as read now is kept for
        the next call (read before the scan's listing: a fork after it is seen next time)."""
        if not self._last_pid_path:
            return False
        try:
            with open(self._last_pid_path, "rb") as f:
                last = f.read().rsplit(None, 1)[-1]
        except (OSError, IndexError):
            self._last_pid = b""
            return False
        if last == self._last_pid and now < self._due_ns:
            return True
        self._last_pid = last
        return False

    def stop(self) -> None:
        self._seen = {}
        self._by_pid = {}
        self._reported = {}
        self._states = {}

    def step(self) -> list:
        now = self.ctx.mono_ns()
        known_only = self._fork_free(now)
        if known_only and not self._reported:
            self.scans_skipped += 1
            return []
        root = self.ctx.proc_root
        ppids: dict[int, int] = {}
        current: dict[tuple[int, int], _Seen] = {}
        by_pid: dict[int, tuple[int, int]] = {}
        letters: dict[tuple[int, int], bytes] = {}  # state of every process read this scan
        zombies: list[Event] = []
        if known_only:
            # no process created, no re-read due: the workloads' stat is what there is to read (an exit, a state);
            # the trusted non-workloads are carried over as a full scan would (~0.35 ms of listing /proc saved
            # with ~300 processes, and its loop)
            pids = list(self._by_pid)
            self.scans_known_only += 1
        else:
            try:
                pids = [int(name) for name in os.listdir(root) if name.isdigit()]
            except OSError:
                pids = []
        verify_ns = int(self.config.recheck_seconds * 1e9)
        for pid in pids:
            key = self._by_pid.get(pid)
            if key is not None:
                seen = self._seen[key]
                if (
                    seen.info is None
                    and now < seen.verify_ns
                    and not (seen.maps_next_ns and now >= seen.maps_next_ns)
                ):
                    # A known non-workload: trust it until its next verification (saves a stat read).
                    current[key] = seen
                    by_pid[pid] = key
                    ppids[pid] = seen.ppid
                    continue
            st = _read_stat(root, pid)
            if st is None:
                continue
            comm, ppid, flags, start_ticks, state = st
            key = (pid, start_ticks)
            if state in (b"Z", b"X"):
                info = self._reported.get(key)
                if state == b"Z" and info is not None:
                    zombies.append(Event(now, "process_zombie", f"{pid}:{start_ticks}",
                                         f"{_who(info)} exited, not reaped yet (state Z)"))
                continue  # exited, not yet reaped: gone for our purposes
            ppids[pid] = ppid
            letters[key] = state
            seen = self._seen.get(key)
            if flags & _PF_KTHREAD or pid == self._own_pid:
                seen = seen if seen is not None else _Seen(comm, None)
            elif seen is None or seen.comm != comm:
                seen = self._classify(pid, start_ticks, comm, ppid, now, previous=seen)
            elif seen.info is None and seen.maps_next_ns and now >= seen.maps_next_ns:
                self._recheck_maps(pid, seen, now)
            if seen is None:
                continue  # vanished while we read it
            seen.ppid = ppid
            seen.verify_ns = now + verify_ns
            current[key] = seen
            by_pid[pid] = key
        self._seen = current
        self._by_pid = by_pid
        self._due_ns = min((t for seen in current.values() if seen.info is None
                            for t in (seen.verify_ns, seen.maps_next_ns) if t), default=now + verify_ns)

        # Resolve job keys that fall back to the top-most workload ancestor, then filter helpers.
        workloads: dict[tuple[int, int], ProcessInfo] = {}
        for key, seen in current.items():
            info = seen.info
            if info is None:
                continue
            if not info.job_key and info.env.get("TORCHELASTIC_RUN_ID") == TORCHRUN_DEFAULT_RUN_ID:
                info.job_key = self._torchrun_key(key[0], info, ppids, by_pid, current)
            if not info.job_key:
                info.job_key = f"pid:{self._topmost_workload(key[0], ppids, by_pid, current)}"
            if not self.config.include_helpers and info.rank >= 0:
                parent = current.get(by_pid.get(info.ppid, (-1, -1)))
                if parent is not None and parent.info is not None and parent.info.rank == info.rank:
                    continue
            workloads[key] = info

        out: list = []
        for key, info in workloads.items():
            before = self._reported.get(key)
            if before is None or (before is not info and _identity(before) != _identity(info)):
                # new, or the same (pid, start_ticks) after exec/setproctitle changed what it runs
                out.append(info)
        out += self._track_states(workloads, letters, now)
        out += zombies
        for key in self._reported:
            if key not in workloads:
                out.append(ProcessExit(now, key[0], key[1]))
        self._reported = workloads
        self.ctx.workloads.replace(workloads)
        return out

    # -- process state ---------------------------------------------------------------------------

    def _track_states(self, workloads: dict, letters: dict, now: int) -> list[Event]:
        """Events for the state transitions of the reported workloads (rules in the module docstring)."""
        out: list[Event] = []
        states: dict[tuple[int, int], _RunState] = {}
        root = self.ctx.proc_root
        for key, info in workloads.items():
            letter = letters.get(key)
            st = self._states.get(key)
            if letter is None:  # not read this scan (cannot happen for a workload): keep what we knew
                if st is not None:
                    states[key] = st
                continue
            cls = _STATE_CLASS.get(letter, "")
            if st is None:
                st = _RunState(cls, now)
                if letter in _NEEDS_CONTINUITY:
                    st.mark = _read_schedstat(root, key[0])
            elif cls != st.cls:
                st.cls, st.since_ns = cls, now
                st.mark = _read_schedstat(root, key[0]) if letter in _NEEDS_CONTINUITY else None
            elif letter in _NEEDS_CONTINUITY and st.reported != cls:
                mark = _read_schedstat(root, key[0])
                if mark is not None and st.mark is not None and mark != st.mark:
                    st.since_ns = now  # it ran since: a new stop or wait, not the same one
                st.mark = mark if mark is not None else st.mark
            states[key] = st
            entity = f"{key[0]}:{key[1]}"
            if cls:
                if st.reported == cls:
                    continue
                lasted_ns = now - st.since_ns
                limit = self.config.stopped_after_seconds if cls == _STOPPED else self.config.blocked_after_seconds
                if letter != b"T" and lasted_ns < limit * 1e9:
                    continue
                if not st.reported:
                    st.reported_since_ns = st.since_ns
                st.reported = cls
                lasted = lasted_ns / 1e9
                if letter == b"T":
                    msg = f"{_who(info)} stopped (state T)"
                elif letter == b"t":
                    msg = f"{_who(info)} stopped (state t, ptrace stop) for {lasted:.1f} s"
                else:
                    msg = f"{_who(info)} blocked in uninterruptible sleep (state D) for {lasted:.1f} s"
                out.append(Event(now, f"process_{cls}", entity, msg, lasted))
            elif st.reported:
                lasted = (now - st.reported_since_ns) / 1e9
                out.append(Event(now, "process_running", entity,
                                 f"{_who(info)} running again (state {letter.decode('ascii', 'replace')}) "
                                 f"after {lasted:.1f} s {st.reported}", lasted))
                st.reported = ""
        self._states = states
        return out

    # -- classification --------------------------------------------------------------------------

    def _classify(self, pid: int, start_ticks: int, comm: bytes, ppid: int, now: int, previous: _Seen | None) -> _Seen | None:
        base = os.path.join(self.ctx.proc_root, str(pid))
        try:
            with open(os.path.join(base, "cmdline"), "rb") as f:
                raw = f.read()
        except OSError:
            return None
        argv = [a.decode("utf-8", "replace") for a in raw.split(b"\0")]
        if argv and argv[-1] == "":
            argv.pop()
        if len(argv) == 1 and " " in argv[0]:
            argv = argv[0].split()  # setproctitle rewrites argv as one space-joined string
        if not argv:
            return _Seen(comm, None)  # zombie or exiting
        try:
            exe = os.readlink(os.path.join(base, "exe"))
        except OSError:
            exe = ""
        python = bool(_PYTHON_RE.match(os.path.basename(argv[0]))) or bool(
            exe and _PYTHON_RE.match(os.path.basename(exe.removesuffix(" (deleted)")))
        )
        framework = _framework_from_argv(argv) if python else ""
        if not framework:
            joined = " ".join(argv)
            for text, rx in self._patterns:
                if rx.search(joined):
                    framework = f"pattern:{text}"
                    break
        seen = _Seen(comm, None, python=python, cmdline=argv)
        if not framework and python and self.config.detect_by_maps:
            framework = _framework_from_maps(base)
            if not framework:
                # libtorch appears in maps only once the program imports torch: look again later.
                wait = previous.maps_wait_ns if previous is not None and previous.maps_wait_ns else 0
                wait = min(max(wait * 2, 1_000_000_000), int(self.config.maps_recheck_max_seconds * 1e9))
                seen.maps_wait_ns = wait
                seen.maps_next_ns = now + wait if wait > 0 else 0
        if framework:
            seen.info = self._describe(pid, start_ticks, ppid, exe, argv, framework, now)
        return seen

    def _recheck_maps(self, pid: int, seen: _Seen, now: int) -> None:
        framework = _framework_from_maps(os.path.join(self.ctx.proc_root, str(pid)))
        if framework:
            st = _read_stat(self.ctx.proc_root, pid)
            if st is None:
                return
            base = os.path.join(self.ctx.proc_root, str(pid))
            try:
                exe = os.readlink(os.path.join(base, "exe"))
            except OSError:
                exe = ""
            seen.info = self._describe(pid, st[3], st[1], exe, seen.cmdline, framework, now)
            seen.maps_next_ns = 0
            return
        seen.maps_wait_ns = min(seen.maps_wait_ns * 2, int(self.config.maps_recheck_max_seconds * 1e9))
        seen.maps_next_ns = now + seen.maps_wait_ns if seen.maps_wait_ns > 0 else 0

    def _describe(self, pid: int, start_ticks: int, ppid: int, exe: str, argv: list[str], framework: str, now: int) -> ProcessInfo:
        base = os.path.join(self.ctx.proc_root, str(pid))
        env = _read_environ(base)
        cmdline, size = [], 0
        for a in argv:
            size += len(a) + 1
            if size > self.config.max_cmdline_bytes:
                break
            cmdline.append(a)
        try:
            uid = os.stat(base).st_uid
        except OSError:
            uid = 0
        return ProcessInfo(
            mono_ns=now,
            pid=pid,
            start_ticks=start_ticks,
            ppid=ppid,
            exe=exe,
            cmdline=cmdline,
            framework=framework,
            job_key=job_key_from_env(env),  # "" here: filled from the process tree by step()
            rank=_first_int(env, "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"),
            local_rank=_first_int(env, "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"),
            world_size=_first_int(env, "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
            master_addr=env.get("MASTER_ADDR", ""),
            master_port=max(0, _first_int(env, "MASTER_PORT")),
            env=env,
            container_id=_container_id(base),
            uid=uid,
        )

    def _torchrun_key(self, pid: int, info: ProcessInfo, ppids: dict[int, int], by_pid: dict, current: dict) -> str:
        """The key of a worker of a torchrun job launched without --rdzv-id (see the module docstring)."""
        master = f"{info.env.get('MASTER_ADDR', '')}:{info.env.get('MASTER_PORT', '')}"
        p, hops = ppids.get(pid, 0), 0
        while p > 1 and hops < 8:
            key = by_pid.get(p)
            seen = current.get(key) if key is not None else None
            endpoint = torchrun_endpoint(seen.cmdline) if seen is not None else None
            if endpoint is not None:
                group = _first_int(info.env, "GROUP_WORLD_SIZE")
                world, local = _first_int(info.env, "WORLD_SIZE"), _first_int(info.env, "LOCAL_WORLD_SIZE")
                one_launcher = group == 1 if group > 0 else (world > 0 and world == local)
                base = f"torchrun:{endpoint or master}"
                return f"{base}@{self.ctx.node_id}:{key[0]}.{key[1]}" if one_launcher else base
            p, hops = ppids.get(p, 0), hops + 1
        return f"torchrun:{master}" if master != ":" else ""

    @staticmethod
    def _topmost_workload(pid: int, ppids: dict[int, int], by_pid: dict, current: dict) -> int:
        top = pid
        hops = 0
        p = ppids.get(pid, 0)
        while p > 1 and hops < 256:
            seen = current.get(by_pid.get(p, (-1, -1)))
            if seen is not None and seen.info is not None:
                top = p
            p = ppids.get(p, 0)
            hops += 1
        return top


def _who(info: ProcessInfo) -> str:
    if info.rank >= 0:
        return f"rank {info.rank} of job {info.job_key}"
    return f"pid {info.pid} (no rank) of job {info.job_key}"


def _own_pid(proc_root: str) -> int:
    """This process's PID in proc_root's PID namespace (its `self` link), -1 where it has none (a fixture tree)."""
    try:
        return int(os.readlink(os.path.join(proc_root, "self")))
    except (OSError, ValueError):
        return -1


def _last_pid_source(proc_root: str) -> str:
    """/proc/loadavg, whose last field is the last PID handed out in the reader's PID namespace, where that is the
    namespace proc_root shows: this process's NSpid there has one entry (a PID namespace nested below the mount's
    would add its own); "" otherwise (an agent in a container of its own reading the host's /proc, a fixture
    tree): then every scan is a full one."""
    try:
        with open(os.path.join(proc_root, "self", "status"), "rb") as f:
            ns = [line.split()[1:] for line in f.read().splitlines() if line.startswith(b"NSpid:")]
        if not ns or len(ns[0]) != 1 or int(ns[0][0]) != os.getpid():
            return ""
        path = os.path.join(proc_root, "loadavg")
        with open(path, "rb") as f:
            int(f.read().rsplit(None, 1)[-1])
        return path
    except (OSError, IndexError, ValueError):
        return ""


def _read_schedstat(root: str, pid: int) -> tuple | None:
    """(run time ns, times scheduled in) from /proc/PID/schedstat, or None (gone, or no CONFIG_SCHED_INFO)."""
    try:
        fd = os.open(f"{root}/{pid}/schedstat", os.O_RDONLY)
    except OSError:
        return None
    try:
        fields = os.read(fd, 256).split()
    except OSError:
        return None
    finally:
        os.close(fd)
    return (fields[0], fields[2]) if len(fields) >= 3 else None


def _identity(info: ProcessInfo) -> tuple:
    return info.exe, info.cmdline, info.framework, info.env, info.job_key


def _read_stat(root: str, pid: int):
    """(comm, ppid, flags, start_ticks, state) from /proc/PID/stat, or None if the process is gone."""
    try:
        fd = os.open(f"{root}/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    close = data.rfind(b")")
    comm = data[data.find(b"(") + 1 : close]
    fields = data[close + 2 :].split()
    try:
        # fields[0] is field 3 (state): ppid=4, flags=9, starttime=22
        return comm, int(fields[1]), int(fields[6]), int(fields[19]), fields[0]
    except (IndexError, ValueError):
        return None


def _framework_from_argv(argv: list[str]) -> str:
    for i, tok in enumerate(argv):
        if tok.startswith("VLLM::"):
            return "vllm"
        if i > 0 and argv[i - 1] == "-m" or tok.startswith(("vllm.", "sglang.", "megatron.", "deepspeed.", "torch.distributed.")):
            for framework, prefixes in _MODULE_PREFIXES:
                if tok.startswith(prefixes):
                    return framework
        base = os.path.basename(tok)
        if i <= 2 and base in _SCRIPT_NAMES:
            return _SCRIPT_NAMES[base]
        low = tok.lower()
        if "megatron" in low:
            return "megatron"
        if low.startswith("--deepspeed"):
            return "deepspeed"
    return ""


def _framework_from_maps(base: str) -> str:
    """The framework whose native code the process has loaded: a marker on a line of /proc/PID/maps whose
    mapping is executable (the loader maps a library's text r-xp). A file only read through mmap (r--s, r--p: a
    symbolizer, this agent's own ELF reader for off-CPU stacks, a backup tool) does not make a workload."""
    try:
        with open(os.path.join(base, "maps"), "rb") as f:
            maps = f.read()
    except OSError:
        return ""
    for marker, framework in _MAPS_MARKERS:
        at = maps.find(marker)
        while at >= 0:
            line = maps.rfind(b"\n", 0, at) + 1
            perms = maps[line:line + 64].split(None, 2)
            if len(perms) > 1 and perms[1][2:3] == b"x":
                return framework
            end = maps.find(b"\n", at)
            at = maps.find(marker, end + 1) if end >= 0 else -1
    return ""


def _read_environ(base: str) -> dict[str, str]:
    try:
        with open(os.path.join(base, "environ"), "rb") as f:
            raw = f.read()
    except OSError:
        return {}  # EACCES for other users' processes when not root
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep and k in _ENV_KEYS_B:
            env[_ENV_KEYS_B[k]] = v.decode("utf-8", "replace")
    return env


def job_key_from_env(env: dict[str, str]) -> str:
    """The key from the environment alone; "" where the process tree decides (step())."""
    if env.get("STEPLENS_JOB"):
        return env["STEPLENS_JOB"]
    if env.get("TORCHELASTIC_RUN_ID") and env["TORCHELASTIC_RUN_ID"] != TORCHRUN_DEFAULT_RUN_ID:
        return f"torchelastic:{env['TORCHELASTIC_RUN_ID']}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}"
    if env.get("TORCHELASTIC_RUN_ID"):
        return ""  # torchrun's default run id: step() derives the key from the launcher
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"master:{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return ""


_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def torchrun_endpoint(argv: list[str]) -> str | None:
    """None when `argv` is not a torchrun launcher; else its rendezvous endpoint when a dynamic backend
    (c10d, etcd) is given one, else "" (static rendezvous: MASTER_ADDR/MASTER_PORT say it). Options are read up
    to the training script (the first *.py), so the script's own arguments are not taken for the launcher's."""
    start = next((i + 1 for i, tok in enumerate(argv[:3]) if os.path.basename(tok) == "torchrun"), None)
    if start is None:
        start = next((i + 2 for i, tok in enumerate(argv[:-1]) if tok == "-m" and argv[i + 1] in _TORCHRUN_MODULES),
                     None)
    if start is None:
        return None
    opts: dict[str, str] = {}
    i = start
    while i < len(argv) and not argv[i].endswith(".py"):
        tok = argv[i]
        name, eq, value = tok.partition("=")
        name = name.replace("_", "-")
        if name in ("--rdzv-endpoint", "--rdzv-backend"):
            if not eq and i + 1 < len(argv):
                value, i = argv[i + 1], i + 1
            opts[name] = value
        i += 1
    if opts.get("--rdzv-backend", "static") == "static":
        return ""
    return opts.get("--rdzv-endpoint", "")


def _first_int(env: dict[str, str], *keys: str) -> int:
    for k in keys:
        v = env.get(k)
        if v is not None:
            try:
                return int(v)
            except ValueError:
                continue
    return -1


def _container_id(base: str) -> str:
    try:
        with open(os.path.join(base, "cgroup"), "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return ""
    found = _CONTAINER_RE.findall(text)
    return found[-1] if found else ""
