"""gpuprobes: NCCL API calls and CUDA kernel launches of workload processes, seen from outside with uprobes.

Probes (bcc uprobes on exported `.dynsym` functions, program names `steplens_*`; nothing pinned):
  libnccl.so*   ncclAllReduce, ncclBroadcast, ncclReduce, ncclAllGather, ncclReduceScatter, ncclSend, ncclRecv,
                ncclGroupStart, ncclGroupEnd, ncclCommInitRank, ncclCommInitRankConfig, ncclCommInitRankScalable
  libcudart.so* cudaLaunchKernel, cudaLaunchKernel_ptsz
  libcuda.so*   cuLaunchKernel, cuLaunchKernel_ptsz
Arguments are read at function entry with the x86-64 SysV convention: PT_REGS_PARM1..6 for the first six integer
arguments; the 7th and 8th (e.g. ncclAllReduce's `stream`, ncclReduce's `comm`/`stream`) are on the user stack at
PT_REGS_SP + 8 and + 16 (SP points at the return address on entry). ncclCommInitRank's 128-byte ncclUniqueId is
passed in memory, so `rank` is the third register argument.

Attaching: each step the source reads /proc/PID/maps of the workload processes (ctx.workloads; rescanned every
`rescan_seconds` per (pid, start_ticks)) and finds mapped files whose name matches the library patterns, read
through /proc/PID/root so libraries inside containers are found. A uprobe belongs to a file (inode), not a
process: one attach per distinct (st_dev, st_ino) covers every process using that library, so libraries are
deduplicated by inode, and a probe fires in every process mapping the file; the BPF side keeps only workload
tgids (a watched hash synced each step). Probes on a library are detached once no workload maps it any more.

Emitted: Metric `nccl_calls_total` and `nccl_elements_total` [pid:<pid>:<start_ticks>:op:<Op>] (Op: AllReduce,
Broadcast, Reduce, AllGather, ReduceScatter, Send, Recv, GroupStart, GroupEnd, CommInitRank),
`cuda_kernel_launches_total` [pid:<pid>:<start_ticks>:api:<cudaLaunchKernel|cuLaunchKernel>], cumulative
in-kernel counters (never cleared). Per-call Event(kind="nccl_call", entity pid:<pid>:<start_ticks>:tid:<tid>,
message "AllReduce count=.. dtype=.. redop=.. peer=.. comm=0x.. stream=0x..", value=count, mono_ns = the
bpf_ktime_get_ns of the call, i.e. CLOCK_MONOTONIC) through a BPF ring buffer in deep mode (or always, per
`call_events`), at most `max_call_events_per_step` per step. Kernel launches are counted only, never sent
one by one. Event "gpuprobes_dropped" when calls were dropped (ring buffer full, per-step cap, counter map full).

When no workload maps any of the libraries, step() returns nothing and `self.reason` says so (probe() can
only say whether eBPF works here; it answers yes with that note).

What was verified (tests/test_source_gpuprobes.py, 2-core VM, kernel 6.18, no GPU): real uprobes attached
through this code path to stand-in libraries compiled at test time — a `libnccl.so.2` exporting ncclAllReduce,
ncclSend, ncclRecv, ncclGroupStart/End with the real NCCL prototypes, and a `libcudart.so.12` exporting
cudaLaunchKernel with its real prototype — called N times from a real process through dlopen: counts,
datatype, redop, peer, comm pointer and the stack-passed stream pointer all come out exact; detach leaves no
programs. NOT verified: the real libnccl/libcudart/libcuda on a GPU host (symbol versions, whether a given
PyTorch build links NCCL or cudart statically — then there is no libnccl.so*/libcudart.so* mapping to find and
the source reports the reason — and the per-call overhead under a real training loop).

Cost (measured on this 2-core VM, kernel 6.18, a C loop calling the stand-in ncclAllReduce 200,000 times):
1.9 ns per call unprobed, ~19.5 µs per call with the uprobe attached (counters only) and ~18-20 µs with
ring-buffer events on. That is the uprobe trap (int3 + single-step out of line) in this VM, not the BPF
program; bare-metal x86 is usually quoted at 1-3 µs (not measured here). The probe fires in EVERY process
that maps the probed file, workload or not; the watched-tgid check only skips the counting. NCCL calls
(tens to thousands per second per process) cost little; kernel launches can reach 10^4-10^5/s in eager
PyTorch, which at these figures would take a large share of the launching thread, so `cuda_launches` is off
by default. The 64-page ring buffer holds ~4,000 calls between steps; more are dropped and counted.
User space: one maps scan per workload per `rescan_seconds` (~0.75 ms of CPU for a torch process, cold, half of it
the kernel formatting the file: only the lines naming a library's literal start are parsed, 1.15 ms before) where
the size of its library code changed since the last scan (VmLib in /proc/PID/status: loading or unloading a library
always changes it, the heap never does), else one per `max_rescan_seconds` (60).
"""

from __future__ import annotations

import ctypes as ct
import os
import re
from dataclasses import dataclass

from steplens.agent import ebpf
from steplens.agent.records import Event, Metric, Mode
from steplens.agent.sources.base import Availability, ConfigError, HostContext, Source, SourceConfig

BPF_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpuprobes.bpf.c")

OPS = ("AllReduce", "Broadcast", "Reduce", "AllGather", "ReduceScatter", "Send", "Recv", "GroupStart", "GroupEnd",
       "CommInitRank", "cudaLaunchKernel", "cuLaunchKernel")
OP_INDEX = {name: i for i, name in enumerate(OPS)}
FIRST_LAUNCH_OP = OP_INDEX["cudaLaunchKernel"]

# library kind -> (file-name pattern, [(symbol, BPF function, required)])
LIBRARIES: dict[str, tuple[str, list[tuple[str, str, bool]]]] = {
    "nccl": (r"libnccl\.so(\.\d+)*$", [
        ("ncclAllReduce", "steplens_nar", True), ("ncclBroadcast", "steplens_nbc", False),
        ("ncclReduce", "steplens_nrd", False), ("ncclAllGather", "steplens_nag", False),
        ("ncclReduceScatter", "steplens_nrs", False), ("ncclSend", "steplens_nsd", False),
        ("ncclRecv", "steplens_nrv", False), ("ncclGroupStart", "steplens_ngs", False),
        ("ncclGroupEnd", "steplens_nge", False), ("ncclCommInitRank", "steplens_nci", False),
        ("ncclCommInitRankConfig", "steplens_nci", False), ("ncclCommInitRankScalable", "steplens_nci", False)]),
    "cudart": (r"libcudart\.so(\.\d+)*$", [
        ("cudaLaunchKernel", "steplens_cdl", True), ("cudaLaunchKernel_ptsz", "steplens_cdl", False)]),
    "cuda": (r"libcuda\.so(\.\d+)*$", [
        ("cuLaunchKernel", "steplens_cul", True), ("cuLaunchKernel_ptsz", "steplens_cul", False)]),
}

NCCL_DTYPES = {0: "int8", 1: "uint8", 2: "int32", 3: "uint32", 4: "int64", 5: "uint64", 6: "float16", 7: "float32",
               8: "float64", 9: "bfloat16", 10: "float8e4m3", 11: "float8e5m2"}
NCCL_REDOPS = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}


@dataclass
class GpuprobesConfig(SourceConfig):
    nccl: bool = True                     # probe libnccl.so*
    cuda_launches: bool = False           # probe libcudart.so* cudaLaunchKernel and libcuda.so* cuLaunchKernel
    call_events: str = "deep"             # per-call nccl_call events: "deep" (deep mode only), "always", "never"
    max_call_events_per_step: int = 10000  # more are dropped and counted
    rescan_seconds: float = 5.0           # re-read a workload's /proc/PID/maps at most this often, where the size of
    max_rescan_seconds: float = 60.0      # its library code changed; at least this often where it did not
    ringbuf_pages: int = 64               # BPF ring buffer size in 4 KiB pages (power of two); ~64 B per call
    max_processes: int = 1024             # watched tgids
    max_counters: int = 16384             # (pid, op) counter entries

    def validate(self) -> None:
        super().validate()
        if self.call_events not in ("deep", "always", "never"):
            raise ConfigError(f"call_events must be deep, always or never, got {self.call_events!r}")
        if self.ringbuf_pages < 1 or self.ringbuf_pages & (self.ringbuf_pages - 1):
            raise ConfigError(f"ringbuf_pages must be a power of two, got {self.ringbuf_pages}")
        for key, low, high in (("max_call_events_per_step", 0, 10_000_000), ("max_processes", 1, 1 << 20),
                               ("max_counters", 16, 1 << 22)):
            if not (low <= getattr(self, key) <= high):
                raise ConfigError(f"{key} must be within {low}..{high}, got {getattr(self, key)}")
        if self.rescan_seconds < 0:
            raise ConfigError("rescan_seconds must be >= 0")
        if self.max_rescan_seconds < self.rescan_seconds:
            raise ConfigError(f"max_rescan_seconds ({self.max_rescan_seconds}) must be >= rescan_seconds "
                              f"({self.rescan_seconds})")


def render_program(template: str, config: GpuprobesConfig) -> str:
    """The BPF C text for this config (pure: no kernel, no bcc)."""
    from steplens.agent.ebpf import render

    ops = {f"OP_{name.upper()}": i for i, name in enumerate(OPS)}
    return render(template, MAX_PROCESSES=config.max_processes, MAX_COUNTERS=config.max_counters,
                  RINGBUF_PAGES=config.ringbuf_pages, FIRST_LAUNCH_OP=FIRST_LAUNCH_OP, **ops)


def _literal_start(pattern: str) -> bytes:
    """The plain characters a file-name pattern begins with (r"libnccl\\.so(\\.\\d+)*$" -> b"libnccl.so"); b"" when
    it begins with anything else or has an alternation."""
    if "|" in pattern:
        return b""
    out = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern) and not pattern[i + 1].isalnum():
            out.append(pattern[i + 1])
            i += 2
        elif c.isalnum() or c in "_-":
            out.append(c)
            i += 1
        else:
            break
    if i < len(pattern) and pattern[i] in "*?{" and out:
        out.pop()  # the last character is optional or repeated
    return "".join(out).encode()


def lib_kb(proc_root: str, pid: int) -> int:
    """The size of the process's executable mappings other than its program's own text, in kB (VmLib in
    /proc/PID/status: what loading or unloading a shared library always changes, and a heap growing or shrinking
    never does), -1 where it cannot be read. ~150 us to read cold, a scan of a torch process's maps ~750 us more."""
    try:
        with open(f"{proc_root}/{pid}/status", "rb") as fh:
            text = fh.read(8192)
        i = text.index(b"VmLib:") + 6
        return int(text[i:text.index(b"kB", i)])
    except (OSError, ValueError):
        return -1


def scan_maps(proc_root: str, pid: int, kinds: dict[str, str]) -> dict[tuple[int, int], tuple[str, str]]:
    """Libraries of the given kinds mapped by pid: {(st_dev, st_ino): (kind, path through /proc/PID/root)}."""
    patterns = {kind: re.compile(p) for kind, p in kinds.items()}
    found: dict[tuple[int, int], tuple[str, str]] = {}
    seen = set()
    try:
        with open(os.path.join(proc_root, str(pid), "maps"), "rb") as fh:
            data = fh.read()
    except OSError:
        return found
    # only the lines that hold a pattern's literal start can match: a torch process maps ~350 files, and parsing
    # every line was ~40 % of a scan (the kernel's formatting of the file is the rest)
    lits = [_literal_start(p) for p in kinds.values()]
    if not all(lits):
        keep = data.split(b"\n")
    elif not any(lit in data for lit in lits):
        return found
    else:
        keep = [ln for ln in data.split(b"\n") if any(lit in ln for lit in lits)]
    for line in (ln.decode("utf-8", "surrogateescape") for ln in keep):
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        path = parts[5]
        if path in seen or path.endswith(" (deleted)"):
            continue
        seen.add(path)
        base = os.path.basename(path)
        for kind, pattern in patterns.items():
            if pattern.match(base):
                full = os.path.join(proc_root, str(pid), "root") + path
                try:
                    st = os.stat(full)
                except OSError:
                    break
                found.setdefault((st.st_dev, st.st_ino), (kind, full))
                break
    return found


class _Call(ct.Structure):
    _fields_ = [("ts_ns", ct.c_uint64), ("pid", ct.c_uint32), ("tid", ct.c_uint32), ("op", ct.c_uint32),
                ("datatype", ct.c_int32), ("peer", ct.c_int32), ("redop", ct.c_int32), ("count", ct.c_uint64),
                ("comm", ct.c_uint64), ("stream", ct.c_uint64)]


class GpuprobesSource(Source):
    governed = False   # its buffer or ring must be read at its interval (agent/governor.py)
    name = "gpuprobes"
    config_class = GpuprobesConfig
    description = "NCCL API calls and CUDA kernel launches of workload processes (eBPF uprobes on libnccl/libcudart/libcuda)"

    config: GpuprobesConfig

    def __init__(self, ctx: HostContext, config: GpuprobesConfig) -> None:
        super().__init__(ctx, config)
        self._bpf = None
        self._deep = False
        self._watched: dict[int, int] = {}
        # (pid, start) -> (scanned mono_ns, libs, its library code's size then (lib_kb), checked mono_ns)
        self._maps: dict[tuple[int, int], tuple[int, dict, int, int]] = {}
        self._attached: dict[tuple[int, int], tuple[str, str, list[bytes]]] = {}  # inode -> (kind, path, events)
        self._pending: list = []
        self._dropped_cap = 0
        self._drops_reported = 0
        self.reason = "not started"
        self.maps_scans = 0   # /proc/PID/maps reads (the other checks found its library code's size unchanged)
        self.missing_symbols: dict[str, list[str]] = {}  # path -> optional symbols not found there

    @classmethod
    def probe(cls, ctx: HostContext) -> Availability:
        from steplens.agent.ebpf import unavailable_reason

        reason = unavailable_reason(ctx.proc_root)
        if reason:
            return Availability.no(reason)
        return Availability.yes("uprobes attach only while a workload process maps libnccl.so*/libcudart.so*/libcuda.so*")

    @classmethod
    def planned_mode(cls, ctx: HostContext, config: GpuprobesConfig) -> tuple[str, str]:
        """(mode, why) for `steplens-agent check`: one build only, needing no BTF program type."""
        return "uprobes", "uprobes on the NCCL/CUDA libraries workload processes map, the only build"

    def _kinds(self) -> dict[str, str]:
        kinds = {}
        if self.config.nccl:
            kinds["nccl"] = LIBRARIES["nccl"][0]
        if self.config.cuda_launches:
            kinds["cudart"] = LIBRARIES["cudart"][0]
            kinds["cuda"] = LIBRARIES["cuda"][0]
        return kinds

    def start(self) -> None:
        with open(BPF_FILE) as fh:
            text = render_program(fh.read(), self.config)
        b = ebpf.compile_program(text, tables=("calls", "emit", "counts", "overflow", "watched"))
        try:
            b[b"calls"].open_ring_buffer(self._on_call)
        except Exception:
            ebpf.cleanup(b)
            raise
        self._bpf = b
        self._watched, self._maps, self._attached, self._pending = {}, {}, {}, []
        self._dropped_cap = self._drops_reported = 0
        self.reason = "no workload process seen yet"
        self._apply_emit()

    def stop(self) -> None:
        b, self._bpf = self._bpf, None
        if b is not None:
            ebpf.cleanup(b)
        self._attached, self._maps, self._watched, self._pending = {}, {}, {}, []
        self.reason = "stopped"

    def set_mode(self, mode: Mode) -> None:
        self._deep = mode == Mode.DEEP
        if self._bpf is not None:
            self._apply_emit()

    def idle(self) -> bool:
        return not self._watched and not self._attached and not self._pending

    def _apply_emit(self) -> None:
        on = self.config.call_events == "always" or (self.config.call_events == "deep" and self._deep)
        self._bpf[b"emit"][ct.c_int(0)] = ct.c_uint32(1 if on else 0)

    def _on_call(self, _ctx, data, _size) -> None:
        if len(self._pending) >= self.config.max_call_events_per_step:
            self._dropped_cap += 1
            return
        e = ct.cast(data, ct.POINTER(_Call)).contents
        self._pending.append((e.ts_ns, e.pid, e.tid, e.op, e.datatype, e.peer, e.redop, e.count, e.comm, e.stream))

    # -- step -------------------------------------------------------------------------------------

    def step(self) -> list:
        if self._bpf is None:
            return []
        now = self.ctx.mono_ns()
        snapshot = self.ctx.workloads.snapshot()
        current = {pid: start for pid, start in snapshot}
        self._sync_watched(current)
        self._sync_probes(now, snapshot)

        out: list = []
        self._bpf.ring_buffer_consume()
        pending, self._pending = self._pending, []
        if not self._attached and not pending:
            return out
        for key, c in self._bpf[b"counts"].items():
            start = current.get(key.pid)
            if start is None or key.op >= len(OPS):
                continue
            op = OPS[key.op]
            if key.op >= FIRST_LAUNCH_OP:
                out.append(Metric(now, "cuda_kernel_launches_total", f"pid:{key.pid}:{start}:api:{op}", float(c.calls)))
            else:
                entity = f"pid:{key.pid}:{start}:op:{op}"
                out.append(Metric(now, "nccl_calls_total", entity, float(c.calls)))
                out.append(Metric(now, "nccl_elements_total", entity, float(c.elements)))
        for ts, pid, tid, op, dtype, peer, redop, count, comm, stream in pending:
            start = current.get(pid, 0)
            out.append(Event(ts, "nccl_call", f"pid:{pid}:{start}:tid:{tid}",
                             _describe(op, dtype, peer, redop, count, comm, stream), float(count)))
        overflow = self._bpf[b"overflow"]
        drops = int(overflow.sum(0).value) + int(overflow.sum(1).value) + self._dropped_cap
        if drops > self._drops_reported:
            out.append(Event(now, "gpuprobes_dropped", "",
                             f"{drops - self._drops_reported} call(s) dropped since the last report (ring buffer full, "
                             f"over max_call_events_per_step={self.config.max_call_events_per_step}, or counter map "
                             f"full)", float(drops)))
            self._drops_reported = drops
        return out

    def _sync_watched(self, current: dict[int, int]) -> None:
        watched = self._bpf[b"watched"]
        for tgid, start in list(self._watched.items()):
            if current.get(tgid) != start:
                try:
                    del watched[watched.Key(tgid)]
                except KeyError:
                    pass
                self._purge_counts(tgid)
        for tgid, start in current.items():
            if self._watched.get(tgid) != start:
                watched[watched.Key(tgid)] = watched.Leaf(1)
        self._watched = dict(current)

    def _purge_counts(self, tgid: int) -> None:
        counts = self._bpf[b"counts"]
        for key in [k for k in counts.keys() if k.pid == tgid]:
            try:
                del counts[key]
            except KeyError:
                pass

    def _sync_probes(self, now: int, snapshot) -> None:
        kinds = self._kinds()
        rescan_ns = int(self.config.rescan_seconds * 1e9)
        max_ns = int(self.config.max_rescan_seconds * 1e9)
        maps = {}
        for key in snapshot:
            cached = self._maps.get(key)
            if cached is None or now - cached[3] >= rescan_ns:
                # a library loaded (dlopen) or unloaded changes the size of the process's library code, so where
                # it is what it was at the last scan the maps are not read again until max_rescan_seconds
                size = lib_kb(self.ctx.proc_root, key[0])
                if cached is None or size != cached[2] or size < 0 or now - cached[0] >= max_ns:
                    cached = (now, scan_maps(self.ctx.proc_root, key[0], kinds), size, now)
                    self.maps_scans += 1
                else:
                    cached = (cached[0], cached[1], size, now)
            maps[key] = cached
        self._maps = maps
        needed: dict[tuple[int, int], tuple[str, str]] = {}
        for _, libs, _, _ in maps.values():
            for inode, lib in libs.items():
                needed.setdefault(inode, lib)
        for inode in [i for i in self._attached if i not in needed]:
            self._detach(inode)
        for inode, (kind, path) in needed.items():
            if inode not in self._attached:
                self._attach(inode, kind, path)
        if self._attached:
            self.reason = ""
        elif not snapshot:
            self.reason = "no workload processes"
        else:
            self.reason = (f"no workload maps libnccl/libcudart/libcuda ({len(snapshot)} workload process(es) "
                           "scanned); nothing to probe")

    def _attach(self, inode, kind: str, path: str) -> None:
        b = self._bpf
        events: list[bytes] = []
        missing = []
        for sym, fn, required in LIBRARIES[kind][1]:
            before = set(b.uprobe_fds)
            try:
                b.attach_uprobe(name=path.encode(), sym=sym.encode(), fn_name=fn.encode(), pid=-1)
            except Exception:
                missing.append(sym)
                if required:
                    self.errors += 1
                continue
            events.extend(set(b.uprobe_fds) - before)
        if missing:
            self.missing_symbols[path] = missing
        self._attached[inode] = (kind, path, events)

    def _detach(self, inode) -> None:
        _, path, events = self._attached.pop(inode)
        for ev in events:
            try:
                self._bpf.detach_uprobe_event(ev)
            except Exception:
                self.errors += 1
        self.missing_symbols.pop(path, None)

    @property
    def attached_libraries(self) -> list[str]:
        return sorted(path for _, path, _ in self._attached.values())


def _describe(op: int, dtype: int, peer: int, redop: int, count: int, comm: int, stream: int) -> str:
    name = OPS[op] if 0 <= op < len(OPS) else f"op{op}"
    if name == "CommInitRank":
        return f"CommInitRank nranks={redop} rank={peer} commp=0x{comm:x}"
    if name in ("GroupStart", "GroupEnd"):
        return name
    parts = [name, f"count={count}", f"dtype={NCCL_DTYPES.get(dtype, dtype)}"]
    if redop >= 0:
        parts.append(f"redop={NCCL_REDOPS.get(redop, redop)}")
    if peer >= 0:
        parts.append(f"{'root' if name in ('Broadcast', 'Reduce') else 'peer'}={peer}")
    parts.append(f"comm=0x{comm:x}")
    parts.append(f"stream=0x{stream:x}")
    return " ".join(parts)
