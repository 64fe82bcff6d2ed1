"""host: per-node CPU, memory, pressure, network, disk and per-workload-process telemetry, polled at 1 Hz.

Reads (all under ctx.proc_root / ctx.sys_root, so tests can point at fixture trees):
  /proc/stat (psutil.cpu_times), /proc/meminfo + /proc/vmstat (psutil.virtual_memory/swap_memory),
  /proc/net/dev (psutil.net_io_counters), /proc/loadavg, /proc/diskstats, /sys/block/<dev> (to keep whole
  disks, drop partitions), /sys/devices/system/cpu/cpuN/cpufreq/scaling_cur_freq or /proc/cpuinfo for
  frequency, /proc/pressure/{cpu,memory,io} where the kernel has PSI (decided at start: no directory, or files
  that refuse reads with psi=0, give nothing), and, for each workload process the `procs` source published,
  /proc/PID/stat, /proc/PID/status, /proc/PID/schedstat, /proc/PID/cgroup and its cpu cgroup's cpu.stat plus
  cpu.max (v2) or cpu.cfs_quota_us/cpu.cfs_period_us (v1); the cgroup mounts come from /proc/self/mountinfo
  (read at start; a mount point under /sys is taken under sys_root), and /sys/class/infiniband/<dev>/ports/<n>/
  {state,phys_state,rate,counters/*,counters_ext/*} for RDMA ports (found at start).

Per-process figures are read straight from /proc/PID/stat and /proc/PID/status rather than through
psutil.Process: two reads per process, and the start time in the same stat read proves the PID still
belongs to the (pid, start_ticks) we were handed, so a reused PID is never reported as the old process.

Why a rank is slow (the collector's causes): cpu-throttled, cpu-contention and gc need the evidence below.
- process_runqueue_seconds_total: /proc/PID/schedstat's second field, ns runnable but waiting for a CPU. It is
  the main thread's (the tgid's own task, not summed over threads: that would cost one read per thread, and a
  torch process holds dozens); the main thread runs the training loop. A task throttled by a CPU quota stays
  runnable, so throttled time shows here too: contention is run-queue time the throttling does not explain.
  The `sched` eBPF source has per-thread run-queue time where eBPF runs.
- process_cpu_throttled_{seconds,periods}_total, process_cpu_periods_total, process_cpu_quota_cores: the CPU
  bandwidth figures of the cgroup the process is in now (/proc/PID/cgroup is re-read every step: the testbed's
  `cpu` fault moves a rank into a new cgroup with a quota). cgroup v1 where a v1 hierarchy holds the cpu
  controller (hybrid hosts), else v2 (`0::/path`). The counters are the cgroup's, so they restart when a process
  changes cgroup and are shared by the processes of one cgroup; the collector treats a drop as a reset.
  The quota is the cgroup's own (cpu.max, or cfs_quota_us/cfs_period_us; none when unlimited); a quota on an
  ancestor (a pod-level limit above a container's) throttles in the ancestor's cpu.stat, which is not read.
  A cgroup without the cpu controller (no throttling fields in cpu.stat), a path this mount namespace does not
  show (another cgroup namespace, "/../x"), or a file that does not parse gives none of the four.
- pressure_*: host-wide PSI, the time at least one task (some) or all non-idle tasks (full) were stalled.

Emitted metrics (entity in brackets):
  cpu_utilization_percent, cpu_iowait_percent [cpuN] (from /proc/stat differences; none on the first step),
  cpu_frequency_mhz [cpuN] (every cpu_frequency_interval_seconds; every step in deep mode), load1/load5/load15 [""],
  memory_{total,available,used,cached,buffers}_bytes, swap_{total,used}_bytes, swap_{in,out}_bytes_total [""],
  pressure_cpu_some_seconds_total, pressure_{memory,io}_{some,full}_seconds_total [""] (PSI `total=` us / 1e6),
  network_{receive,transmit}_{bytes,packets,errors,drops}_total [nic],
  disk_{read,written}_bytes_total, disk_{reads,writes}_completed_total, disk_io_time_seconds_total [disk],
  process_cpu_seconds_total, process_cpu_percent (100 = one full core), process_resident_memory_bytes,
  process_threads, process_{voluntary,involuntary}_context_switches_total, process_cpus_allowed (CPUs in the main
  thread's affinity mask, /proc/PID/status Cpus_allowed: a pin to fewer cores), process_runqueue_seconds_total,
  process_cpu_throttled_seconds_total, process_cpu_throttled_periods_total, process_cpu_periods_total,
  process_cpu_quota_cores (1.0 = one core) [pid:<pid>:<start_ticks>],
  ib_port_up, ib_port_rate_gbps, ib_port_{symbol_errors,link_error_recoveries,link_downed,receive_errors,
  transmit_discards}_total, ib_port_transmit_wait_ticks_total, ib_port_{transmit,receive}_bytes_total,
  ib_port_counters_saturated [<rdma device>/<port>] (every infiniband_interval_seconds, every step in deep mode;
  read_ib_port: what each means, saturation; a NIC of the topology file names its port, collector/analysis/ports.py).

Cost (2-core Debian 12 VM shared with other work, kernel 6.18, hybrid cgroups (cpu on v1), PSI on, 4 NICs, no
cpufreq driver so /proc/cpuinfo is parsed; process_time over 7 x 100 steps, median): 0.26 ms of CPU per step
with 2 workload processes (0.21 ms before PSI, run-queue and cgroup reads), 0.41 ms with 8 (0.32 ms before),
i.e. ~0.03-0.04% of a core at 1 Hz. Each workload process adds ~24 us, of which 10-21 us are the run-queue and
cgroup reads (schedstat, cgroup, cpu.stat and the quota: 5 small files on v1, 4 on v2, the cgroup's read once per
step for the processes it holds), read with os.read rather than open().read() (a third of the cost); PSI ~14 us.
tests/test_source_host.py::test_step_cost prints the per-step figure. RDMA ports (none on that VM): ~58 us of CPU
per port read on the recorded sysfs tree (tests/fixtures/sysfs-infiniband, 2026-12-06, the VM busy with other work),
so 8 ports every 2 s are ~0.02 % of a core.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from steplens.agent.records import Metric, Mode
from steplens.agent.sources.base import Availability, ConfigError, HostContext, Source, SourceConfig, host_path

_SECTOR_BYTES = 512  # /proc/diskstats counts 512-byte sectors whatever the device's sector size
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_NET_DEV_COLUMNS = (("network_receive_bytes_total", 0), ("network_transmit_bytes_total", 8),
                    ("network_receive_packets_total", 1), ("network_transmit_packets_total", 9),
                    ("network_receive_errors_total", 2), ("network_transmit_errors_total", 10),
                    ("network_receive_drops_total", 3), ("network_transmit_drops_total", 11))


def _field(text: bytes, key: bytes) -> int:
    """The integer after `key` at the start of a line of a /proc key-value file (meminfo, vmstat); KeyError if none."""
    pat = key if key.endswith(b":") else key + b" "
    i = 0 if text.startswith(pat) else text.find(b"\n" + pat) + 1
    if i <= 0 and not text.startswith(pat):
        raise KeyError(key)
    start = i + len(pat)
    end = text.find(b"\n", start)
    words = text[start:end if end >= 0 else len(text)].split()
    if not words:
        raise KeyError(key)
    return int(words[0])


@dataclass
class HostConfig(SourceConfig):
    deep_interval_seconds: float = 0.25  # deep mode: the counters a deep dive ranks causes by, 4 per second
    cpu_per_core: bool = True  # per-core utilization and iowait percent
    cpu_frequency: bool = True  # per-core frequency (sysfs cpufreq, else /proc/cpuinfo)
    # read that often (a file per core: ~0.2 % of a core at 1 Hz on a 192-core host), at every step in deep mode
    cpu_frequency_interval_seconds: float = 10.0
    processes: bool = True  # per-process figures for the workloads the procs source found
    infiniband: bool = True  # RDMA port state, rate and counters (/sys/class/infiniband), where the host has ports
    infiniband_interval_seconds: float = 2.0  # read that often (8 files a port), at every step in deep mode
    nic_exclude_regex: str = r"^(veth|cali|flannel|cni|docker|br-|virbr|ifb)"  # NICs to skip
    disk_exclude_regex: str = r"^(loop|ram|zram|sr)\d*$"  # block devices to skip

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.cpu_frequency_interval_seconds <= 3600:
            raise ConfigError("cpu_frequency_interval_seconds must be within 0..3600 (0: every step)")
        if not 0 <= self.infiniband_interval_seconds <= 3600:
            raise ConfigError("infiniband_interval_seconds must be within 0..3600 (0: every step)")
        for key in ("nic_exclude_regex", "disk_exclude_regex"):
            try:
                re.compile(getattr(self, key))
            except re.error as exc:
                raise ConfigError(f"{key}: not a valid regex: {exc}") from None


class HostSource(Source):
    name = "host"
    config_class = HostConfig
    description = "CPU, memory, load, NIC and disk counters, and per-workload-process CPU/RSS/threads (psutil + /proc)"

    config: HostConfig

    def __init__(self, ctx: HostContext, config: HostConfig) -> None:
        super().__init__(ctx, config)
        self._prev_cpu: list | None = None
        self._prev_proc: dict[tuple[int, int], tuple[int, int]] = {}  # key -> (cpu ticks, mono_ns)
        self._psutil = None
        self._nic_exclude = re.compile(config.nic_exclude_regex)
        self._disk_exclude = re.compile(config.disk_exclude_regex)
        self._freq_paths: list[tuple[str, str]] | None = None  # (entity, scaling_cur_freq path) or [] for cpuinfo
        self._cgroups: CpuCgroups | None = None
        self._psi: list[tuple[str, str]] = []  # (resource, /proc/pressure/<resource>) that read
        self._freq_due_ns = 0   # the next step reading the frequencies (0: the first)
        self._ib_ports: list[tuple[str, str]] = []  # (entity "<device>/<port>", its sysfs directory)
        self._ib_due_ns = 0
        self._deep = False

    @classmethod
    def probe(cls, ctx: HostContext) -> Availability:
        try:
            import psutil  # noqa: F401
        except ImportError as exc:
            return Availability.no(f"psutil not importable: {exc}")
        stat = host_path(ctx.proc_root, "stat")
        if not os.access(stat, os.R_OK):
            return Availability.no(f"{stat} not readable")
        return Availability.yes()

    def start(self) -> None:
        import psutil

        psutil.PROCFS_PATH = self.ctx.proc_root
        self._psutil = psutil
        self._prev_cpu = None
        self._prev_proc = {}
        self._freq_paths = self._find_freq_paths()
        self._cgroups = None
        if self.config.processes:
            self._cgroups = CpuCgroups.from_mountinfo(self.ctx.proc_root, self.ctx.sys_root)
        self._psi = _psi_paths(self.ctx.proc_root)
        self._ib_ports = ib_ports(self.ctx.sys_root) if self.config.infiniband else []
        self._ib_due_ns = 0

    def set_mode(self, mode: Mode) -> None:
        self._deep = mode == Mode.DEEP

    def stop(self) -> None:
        self._prev_cpu = None
        self._prev_proc = {}

    def step(self) -> list:
        now = self.ctx.mono_ns()
        out: list[Metric] = []
        self._cpu(now, out)
        if self.config.cpu_frequency and (self._deep or now >= self._freq_due_ns):
            self._freq_due_ns = now + int(self.config.cpu_frequency_interval_seconds * 1e9)
            self._frequency(now, out)
        self._load(now, out)
        self._memory(now, out)
        self._network(now, out)
        self._disks(now, out)
        self._pressure(now, out)
        if self._ib_ports and (self._deep or now >= self._ib_due_ns):
            self._ib_due_ns = now + int(self.config.infiniband_interval_seconds * 1e9)
            for entity, path in self._ib_ports:
                out.extend(read_ib_port(path, entity, now))
        if self.config.processes:
            self._processes(now, out)
        return out

    # -- CPU -------------------------------------------------------------------------------------

    def _cpu(self, now: int, out: list) -> None:
        if not self.config.cpu_per_core:
            return
        times = self._psutil.cpu_times(percpu=True)
        prev, self._prev_cpu = self._prev_cpu, times
        if prev is None or len(prev) != len(times):
            return
        for i, (a, b) in enumerate(zip(prev, times)):
            total = _cpu_total(b) - _cpu_total(a)
            if total <= 0:
                continue
            idle = (b.idle - a.idle) + (b.iowait - a.iowait)
            util = 100.0 * (total - idle) / total
            entity = f"cpu{i}"
            out.append(Metric(now, "cpu_utilization_percent", entity, min(100.0, max(0.0, util))))
            iowait = 100.0 * (b.iowait - a.iowait) / total
            out.append(Metric(now, "cpu_iowait_percent", entity, min(100.0, max(0.0, iowait))))

    def _find_freq_paths(self) -> list[tuple[str, str]]:
        base = host_path(self.ctx.sys_root, "devices", "system", "cpu")
        paths = []
        try:
            names = os.listdir(base)
        except OSError:
            return []
        for name in names:
            if re.fullmatch(r"cpu\d+", name):
                p = os.path.join(base, name, "cpufreq", "scaling_cur_freq")
                if os.path.exists(p):
                    paths.append((name, p))
        paths.sort(key=lambda t: int(t[0][3:]))
        return paths

    def _frequency(self, now: int, out: list) -> None:
        if self._freq_paths:
            for entity, path in self._freq_paths:
                try:
                    with open(path, "rb") as f:
                        khz = int(f.read())
                except (OSError, ValueError):
                    continue
                out.append(Metric(now, "cpu_frequency_mhz", entity, khz / 1000.0))
            return
        # No cpufreq driver (VMs): /proc/cpuinfo carries "cpu MHz" per processor.
        try:
            with open(host_path(self.ctx.proc_root, "cpuinfo"), "rb") as f:
                text = f.read()
        except OSError:
            return
        cpu = -1
        for line in text.split(b"\n"):
            if line.startswith(b"processor"):
                try:
                    cpu = int(line.split(b":", 1)[1])
                except (IndexError, ValueError):
                    cpu = -1
            elif line.startswith(b"cpu MHz") and cpu >= 0:
                try:
                    out.append(Metric(now, "cpu_frequency_mhz", f"cpu{cpu}", float(line.split(b":", 1)[1])))
                except (IndexError, ValueError):
                    pass

    # -- load, memory ----------------------------------------------------------------------------

    def _load(self, now: int, out: list) -> None:
        with open(host_path(self.ctx.proc_root, "loadavg"), "rb") as f:
            parts = f.read().split()
        for name, value in zip(("load1", "load5", "load15"), parts[:3]):
            out.append(Metric(now, name, "", float(value)))

    def _memory(self, now: int, out: list) -> None:
        total, avail, used, cached, buffers, sw_total, sw_used, sin, sout = self._meminfo()
        out.append(Metric(now, "memory_total_bytes", "", float(total)))
        out.append(Metric(now, "memory_available_bytes", "", float(avail)))
        out.append(Metric(now, "memory_used_bytes", "", float(used)))
        out.append(Metric(now, "memory_cached_bytes", "", float(cached)))
        out.append(Metric(now, "memory_buffers_bytes", "", float(buffers)))
        out.append(Metric(now, "swap_total_bytes", "", float(sw_total)))
        out.append(Metric(now, "swap_used_bytes", "", float(sw_used)))
        out.append(Metric(now, "swap_in_bytes_total", "", float(sin)))
        out.append(Metric(now, "swap_out_bytes_total", "", float(sout)))

    def _meminfo(self) -> tuple[int, ...]:
        """psutil's virtual_memory (total, available, used = total - available, cached = Cached + SReclaimable,
        buffers) and swap_memory (total, used, sin, sout: pswpin/pswpout x 4 KiB) figures, the same way, from one
        read of meminfo and one of vmstat, picking the fields wanted instead of parsing every line (psutil's two
        calls were ~60 % of this source's step). psutil where a field is missing (old kernels: no MemAvailable)."""
        try:
            with open(host_path(self.ctx.proc_root, "meminfo"), "rb") as f:
                mem = f.read()
            with open(host_path(self.ctx.proc_root, "vmstat"), "rb") as f:
                vm = f.read()
            total, free, avail = (_field(mem, k) * 1024 for k in (b"MemTotal:", b"MemFree:", b"MemAvailable:"))
            if avail <= 0:
                raise KeyError("MemAvailable")
            avail = free if avail > total else avail
            cached = _field(mem, b"Cached:") * 1024
            try:
                cached += _field(mem, b"SReclaimable:") * 1024
            except KeyError:
                pass
            buffers = _field(mem, b"Buffers:") * 1024
            sw_total, sw_free = _field(mem, b"SwapTotal:") * 1024, _field(mem, b"SwapFree:") * 1024
            return (total, avail, total - avail, cached, buffers, sw_total, sw_total - sw_free,
                    _field(vm, b"pswpin") * 4096, _field(vm, b"pswpout") * 4096)
        except (OSError, KeyError, ValueError):
            v, sw = self._psutil.virtual_memory(), self._psutil.swap_memory()
            return (v.total, v.available, v.used, getattr(v, "cached", 0), getattr(v, "buffers", 0),
                    sw.total, sw.used, sw.sin, sw.sout)

    # -- network, disks --------------------------------------------------------------------------

    def _network(self, now: int, out: list) -> None:
        """Per NIC counters from /proc/net/dev (psutil.net_io_counters reads the same file and builds a named tuple
        per NIC: ~3x this)."""
        try:
            with open(host_path(self.ctx.proc_root, "net", "dev"), "rb") as f:
                lines = f.read().split(b"\n")[2:]
        except OSError:
            return
        for line in lines:
            name, sep, rest = line.partition(b":")
            if not sep:
                continue
            nic = name.strip().decode("ascii", "replace")
            if self._nic_exclude.search(nic):
                continue
            c = rest.split()
            if len(c) < 12:
                continue
            # receive: bytes packets errs drop fifo frame compressed multicast; transmit: bytes packets errs drop
            for metric, col in _NET_DEV_COLUMNS:
                out.append(Metric(now, metric, nic, float(c[col])))

    def _disks(self, now: int, out: list) -> None:
        try:
            with open(host_path(self.ctx.proc_root, "diskstats"), "rb") as f:
                lines = f.read().decode("ascii", "replace").splitlines()
        except OSError:
            return
        sys_block = host_path(self.ctx.sys_root, "block")
        for line in lines:
            p = line.split()
            if len(p) < 14:
                continue
            dev = p[2]
            if self._disk_exclude.search(dev):
                continue
            # /sys/block lists whole disks only; partitions (sda1, nvme0n1p1) are not there.
            if not os.path.exists(os.path.join(sys_block, dev)):
                continue
            reads, rsect, writes, wsect, io_ms = int(p[3]), int(p[5]), int(p[7]), int(p[9]), int(p[12])
            out.append(Metric(now, "disk_reads_completed_total", dev, float(reads)))
            out.append(Metric(now, "disk_writes_completed_total", dev, float(writes)))
            out.append(Metric(now, "disk_read_bytes_total", dev, float(rsect * _SECTOR_BYTES)))
            out.append(Metric(now, "disk_written_bytes_total", dev, float(wsect * _SECTOR_BYTES)))
            out.append(Metric(now, "disk_io_time_seconds_total", dev, io_ms / 1000.0))

    # -- pressure stall information --------------------------------------------------------------

    def _pressure(self, now: int, out: list) -> None:
        for resource, path in self._psi:
            try:
                text = _read_small(path)
            except OSError:
                continue  # found at start, unreadable now: nothing rather than an error each second
            for line in text.split(b"\n"):
                kind, _, rest = line.partition(b" ")
                if (resource, kind) not in _PSI_NAMES:
                    continue
                for field in rest.split():
                    if field.startswith(b"total="):
                        try:
                            out.append(Metric(now, _PSI_NAMES[(resource, kind)], "", int(field[6:]) / 1e6))
                        except ValueError:
                            pass

    # -- workload processes ----------------------------------------------------------------------

    def _processes(self, now: int, out: list) -> None:
        seen: dict[tuple[int, int], tuple[int, int]] = {}
        cgroup_cache: dict[str, tuple | None] = {}  # this step's reads, per cgroup directory (ranks share one)
        for key in self.ctx.workloads.snapshot():
            pid, start_ticks = key
            sample = _read_process(self.ctx.proc_root, pid, start_ticks)
            if sample is None:
                continue  # gone (or PID reused) since the procs source scanned: not an error
            ticks, rss_pages, threads, vol, invol, cpus = sample
            entity = f"pid:{pid}:{start_ticks}"
            out.append(Metric(now, "process_cpu_seconds_total", entity, ticks / _CLK_TCK))
            prev = self._prev_proc.get(key)
            if prev is not None and now > prev[1]:
                pct = 100.0 * ((ticks - prev[0]) / _CLK_TCK) / ((now - prev[1]) / 1e9)
                out.append(Metric(now, "process_cpu_percent", entity, max(0.0, pct)))
            out.append(Metric(now, "process_resident_memory_bytes", entity, float(rss_pages * _PAGE_BYTES)))
            out.append(Metric(now, "process_threads", entity, float(threads)))
            if vol >= 0:
                out.append(Metric(now, "process_voluntary_context_switches_total", entity, float(vol)))
                out.append(Metric(now, "process_involuntary_context_switches_total", entity, float(invol)))
            if cpus > 0:
                out.append(Metric(now, "process_cpus_allowed", entity, float(cpus)))
            delay_ns = _read_run_delay_ns(self.ctx.proc_root, pid)
            if delay_ns >= 0:
                out.append(Metric(now, "process_runqueue_seconds_total", entity, delay_ns / 1e9))
            if self._cgroups is not None:
                cpu = self._cgroups.cpu_of(pid, cgroup_cache)
                if cpu is not None:
                    periods, throttled_periods, throttled_s, quota = cpu
                    out.append(Metric(now, "process_cpu_throttled_seconds_total", entity, throttled_s))
                    out.append(Metric(now, "process_cpu_throttled_periods_total", entity, float(throttled_periods)))
                    out.append(Metric(now, "process_cpu_periods_total", entity, float(periods)))
                    if quota is not None:
                        out.append(Metric(now, "process_cpu_quota_cores", entity, quota))
            seen[key] = (ticks, now)
        self._prev_proc = seen


# (resource, line) of /proc/pressure/* -> metric; the host's "cpu full" is not defined (kernel docs): left out
_PSI_NAMES = {
    ("cpu", b"some"): "pressure_cpu_some_seconds_total",
    ("memory", b"some"): "pressure_memory_some_seconds_total",
    ("memory", b"full"): "pressure_memory_full_seconds_total",
    ("io", b"some"): "pressure_io_some_seconds_total",
    ("io", b"full"): "pressure_io_full_seconds_total",
}


# -- InfiniBand / RDMA ports -----------------------------------------------------------------------------

# counters/<file> -> (metric, width in bits of the PortCounters field: it stops at 2^width - 1 and stays there
# until reset, IBA 16.1.3.5; 64: the extended counters, which do not saturate in practice)
IB_COUNTERS = (("symbol_error", "ib_port_symbol_errors_total", 16),
               ("link_error_recovery", "ib_port_link_error_recoveries_total", 8),
               ("link_downed", "ib_port_link_downed_total", 8),
               ("port_rcv_errors", "ib_port_receive_errors_total", 16),
               ("port_xmit_discards", "ib_port_transmit_discards_total", 16),
               ("port_xmit_wait", "ib_port_transmit_wait_ticks_total", 32))
IB_DATA = (("port_xmit_data", "ib_port_transmit_bytes_total"), ("port_rcv_data", "ib_port_receive_bytes_total"))


def ib_ports(sys_root: str) -> list[tuple[str, str]]:
    """(entity "<device>/<port>", directory) of every port under <sys_root>/class/infiniband, sorted; [] where the
    host has none (no RDMA devices, or the directory does not read)."""
    base = host_path(sys_root, "class", "infiniband")
    out = []
    try:
        devices = sorted(os.listdir(base))
    except OSError:
        return []
    for dev in devices:
        try:
            ports = sorted(os.listdir(os.path.join(base, dev, "ports")), key=lambda x: (len(x), x))
        except OSError:
            continue
        out += [(f"{dev}/{p}", os.path.join(base, dev, "ports", p)) for p in ports if p.isdigit()]
    return out


def _ib_read(path: str) -> bytes:
    try:
        return _read_small(path)
    except OSError:   # a driver without this file, a port going away, a read the device refused
        return b""


def _ib_number(path: str) -> int | None:
    """An integer counter file's value; None where it does not read or is not a number ("N/A (no PMA)": a device
    without a performance management agent)."""
    raw = _ib_read(path).strip()
    return int(raw) if raw.isdigit() else None


def read_ib_port(path: str, entity: str, now: int) -> list[Metric]:
    """One port's figures [entity]: ib_port_up (1: state ACTIVE and physical state LinkUp), ib_port_rate_gbps (the
    rate it trained at: a link that came up at a lower width or speed than its peers' runs slower), the error
    counters of IB_COUNTERS and the data counters in bytes (the 64-bit counters_ext/*_64 where the driver has them:
    the 32-bit ones count 4-byte words and saturate within seconds at 400 Gb/s), and ib_port_counters_saturated:
    how many of the counters read stand at their field's maximum (they stopped counting: `perfquery -R` resets
    them; a rate over such a counter would read 0). A counter that does not read is left out."""
    out: list[Metric] = []
    state = _ib_read(os.path.join(path, "state")).split(b":")[0].strip()
    phys = _ib_read(os.path.join(path, "phys_state")).split(b":")[0].strip()
    if state.isdigit() and phys.isdigit():
        out.append(Metric(now, "ib_port_up", entity, 1.0 if state == b"4" and phys == b"5" else 0.0))
    rate = _ib_read(os.path.join(path, "rate")).split()
    if rate and len(rate) > 1 and rate[1] == b"Gb/sec":
        try:
            out.append(Metric(now, "ib_port_rate_gbps", entity, float(rate[0])))
        except ValueError:
            pass
    saturated = 0
    read_any = False
    counters = os.path.join(path, "counters")
    for name, metric, bits in IB_COUNTERS:
        v = _ib_number(os.path.join(counters, name))
        if v is None:
            continue
        read_any = True
        saturated += v >= (1 << bits) - 1
        out.append(Metric(now, metric, entity, float(v)))
    for name, metric in IB_DATA:
        v = _ib_number(os.path.join(path, "counters_ext", name + "_64"))
        words = v if v is not None else _ib_number(os.path.join(counters, name))
        if words is None:
            continue
        read_any = True
        if v is None:
            saturated += words >= (1 << 32) - 1
        out.append(Metric(now, metric, entity, 4.0 * words))   # PortXmitData/PortRcvData count 4-byte words
    if read_any:
        out.append(Metric(now, "ib_port_counters_saturated", entity, float(saturated)))
    return out


def _psi_paths(proc_root: str) -> list[tuple[str, str]]:
    """The /proc/pressure files this kernel serves: none without PSI (CONFIG_PSI off: no directory; psi=0 on the
    command line: the files exist and a read fails with EOPNOTSUPP). Decided once, at start."""
    found = []
    for resource in ("cpu", "memory", "io"):
        path = host_path(proc_root, "pressure", resource)
        try:
            with open(path, "rb") as f:
                f.read()
        except OSError:
            continue
        found.append((resource, path))
    return found


def _nonempty_dir(path: str) -> bool:
    try:
        with os.scandir(path) as it:
            return any(True for _ in it)
    except OSError:
        return False


def _unescape_mount(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field) if "\\" in field else field


class CpuCgroups:
    """Where the cpu controller of a process's cgroup is, and its bandwidth figures.

    Built once from <proc_root>/self/mountinfo: the cgroup2 mount and the cgroup v1 mount whose super options
    name the `cpu` controller (with its root, for bind mounts of a sub-tree). A mount point under /sys is taken
    under sys_root, so tests and containers with the host's /sys elsewhere work. Per process, /proc/PID/cgroup is
    read every call (a process can be moved): a v1 line whose controllers include `cpu` wins, else the v2 line
    `0::/path` (on a hybrid host the cpu controller is bound to v1 and the v2 tree has no cpu.max).
    """

    def __init__(self, proc_root: str, v2: tuple[str, str] | None, v1_cpu: tuple[str, str] | None) -> None:
        self.proc_root = proc_root
        self.v2 = v2          # (mount point, root within the hierarchy)
        self.v1_cpu = v1_cpu  # same, for the v1 hierarchy that holds cpu

    @classmethod
    def from_mountinfo(cls, proc_root: str, sys_root: str) -> "CpuCgroups | None":
        """From this process's mounts; where they hold no cgroup hierarchy (an agent started under
        `ip netns exec`, which mounts a fresh /sys without /sys/fs/cgroup, or a container without it), from
        init's, read through /proc/1/root (needs the host's PID namespace and root, as the agent runs)."""
        got = cls._parse_mountinfo(proc_root, "self", lambda point: host_path(sys_root, point[5:])
                                   if point == "/sys" or point.startswith("/sys/") else point)
        if got is None:
            init_root = host_path(proc_root, "1", "root")
            got = cls._parse_mountinfo(proc_root, "1", lambda point: init_root + point)
        return got

    @classmethod
    def _parse_mountinfo(cls, proc_root: str, whose: str, place) -> "CpuCgroups | None":
        try:
            with open(host_path(proc_root, whose, "mountinfo"), "rb") as f:
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return None
        v2 = v1 = None
        for line in lines:
            pre, sep, post = line.partition(" - ")
            a, b = pre.split(), post.split()
            if not sep or len(a) < 5 or len(b) < 3:
                continue
            root, point = _unescape_mount(a[3]), place(_unescape_mount(a[4]))
            # the first mount of a hierarchy wins, unless a later one shows the whole tree (root "/")
            if b[0] == "cgroup2" and (v2 is None or (root == "/" and v2[1] != "/")):
                v2 = (point, root)
            elif b[0] == "cgroup" and "cpu" in b[2].split(",") and (v1 is None or (root == "/" and v1[1] != "/")):
                v1 = (point, root)
        # a mount listed but out of sight (under a /sys mounted over it: an empty directory or none) is none
        if v2 is not None and not _nonempty_dir(v2[0]):
            v2 = None
        if v1 is not None and not _nonempty_dir(v1[0]):
            v1 = None
        if v2 is None and v1 is None:
            return None
        return cls(proc_root, v2, v1)

    def directory_of(self, pid: int) -> tuple[str, int] | None:
        """(directory of the process's cpu cgroup, cgroup version) now, or None."""
        try:
            text = _read_small(os.path.join(self.proc_root, str(pid), "cgroup")).decode("utf-8", "replace")
        except OSError:
            return None
        v2_path = None
        for line in text.splitlines():
            hier, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            if hier == "0" and not controllers:
                v2_path = path
            elif self.v1_cpu is not None and "cpu" in controllers.split(","):
                where = _under(self.v1_cpu, path)
                return (where, 1) if where else None
        if v2_path is not None and self.v2 is not None and self.v1_cpu is None:
            where = _under(self.v2, v2_path)
            return (where, 2) if where else None
        return None

    def cpu_of(self, pid: int, cache: dict) -> tuple[int, int, float, float | None] | None:
        """(periods, throttled periods, throttled seconds, quota in cores or None) of the process's cpu cgroup,
        or None (no cpu controller there, gone, unreadable, garbage). `cache` holds reads within one step."""
        found = self.directory_of(pid)
        if found is None:
            return None
        if found[0] not in cache:
            cache[found[0]] = read_cpu_bandwidth(*found)
        return cache[found[0]]


def _under(mount: tuple[str, str], path: str) -> str:
    """The directory of cgroup `path` (as /proc/PID/cgroup writes it) below a mount (point, root); "" when the
    mount does not show it (outside the mount's sub-tree, or outside this cgroup namespace: "/../x")."""
    point, root = mount
    if not path.startswith("/") or ".." in path.split("/"):
        return ""
    if root != "/":
        if path != root and not path.startswith(root + "/"):
            return ""
        path = path[len(root):]
    rel = path.lstrip("/")
    return os.path.join(point, rel) if rel else point


def read_cpu_bandwidth(directory: str, version: int) -> tuple[int, int, float, float | None] | None:
    """(nr_periods, nr_throttled, throttled seconds, quota cores or None when unlimited) from a cgroup
    directory's cpu.stat and cpu.max (v2) or cpu.cfs_quota_us / cpu.cfs_period_us (v1); None when cpu.stat has
    no throttling fields (no cpu controller there) or anything does not parse."""
    throttled_key, scale = (b"throttled_usec", 1e6) if version == 2 else (b"throttled_time", 1e9)
    try:
        fields = dict(line.split(b" ", 1) for line in _read_small(os.path.join(directory, "cpu.stat")).split(b"\n")
                      if b" " in line)
        periods, throttled, throttled_s = int(fields[b"nr_periods"]), int(fields[b"nr_throttled"]), \
            int(fields[throttled_key]) / scale
    except (OSError, KeyError, ValueError):
        return None
    if min(periods, throttled, throttled_s) < 0:
        return None
    quota = None
    try:
        if version == 2:
            quota_s, _, period_s = _read_small(os.path.join(directory, "cpu.max")).strip().partition(b" ")
        else:
            quota_s = _read_small(os.path.join(directory, "cpu.cfs_quota_us")).strip()
            period_s = _read_small(os.path.join(directory, "cpu.cfs_period_us")).strip()
        if quota_s != b"max" and int(quota_s) >= 0 and int(period_s) > 0:  # v1 writes -1 for no limit
            quota = int(quota_s) / int(period_s)
    except (OSError, ValueError):
        pass  # the bandwidth counters stand without it
    return periods, throttled, throttled_s, quota


def _read_run_delay_ns(proc_root: str, pid: int) -> int:
    """ns the process's main thread waited on a run queue (/proc/PID/schedstat, 2nd field); -1 when unreadable."""
    try:
        return int(_read_small(os.path.join(proc_root, str(pid), "schedstat")).split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _read_small(path: str) -> bytes:
    """A small proc/cgroup file in one read(2): a third of what open().read() costs (no buffered file object)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 65536)
    finally:
        os.close(fd)


def _cpu_total(t) -> float:
    total = sum(t)
    # guest time is already counted in user/nice on Linux (psutil does the same correction)
    return total - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def _read_process(proc_root: str, pid: int, start_ticks: int):
    """(utime+stime ticks, rss pages, threads, voluntary, involuntary, CPUs its main thread may run on) or None if
    gone or not the same process (-1 for a figure /proc/PID/status did not give)."""
    base = os.path.join(proc_root, str(pid))
    try:
        stat = _read_small(os.path.join(base, "stat"))
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    # fields[0] is field 3 (state) of proc(5): utime=14, stime=15, num_threads=20, starttime=22, rss=24
    try:
        if int(fields[19]) != start_ticks:
            return None
        ticks = int(fields[11]) + int(fields[12])
        threads = int(fields[17])
        rss = int(fields[21])
    except (IndexError, ValueError):
        return None
    vol = invol = cpus = -1
    try:
        for line in _read_small(os.path.join(base, "status")).split(b"\n")[-8:]:
            if line.startswith(b"voluntary_ctxt_switches:"):
                vol = int(line.split()[1])
            elif line.startswith(b"nonvoluntary_ctxt_switches:"):
                invol = int(line.split()[1])
            elif line.startswith(b"Cpus_allowed:"):   # a hex mask, 32-bit words joined by commas
                cpus = int(line.split()[1].replace(b",", b""), 16).bit_count()
    except (OSError, ValueError, IndexError):
        pass
    return ticks, rss, threads, vol, invol, cpus
