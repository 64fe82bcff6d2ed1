"""nccltopo: which host, process and GPU each rank of each NCCL communicator runs on, sent upstream as
CommMember records (LatencyPrism's commHash -> physical topology; what localization joins CommOps with).

Reads: (1) NCCL_DEBUG_FILE logs (`nccl.<host>.<pid>.log`, as `steplens-agent env` prints them) in `log_dirs`,
tailed by byte offset (a partly written last line waits for the next step; a file that shrank was replaced and
is read again from the start); only "Init START/COMPLETE" lines matter (agent/nccltopo.py parses them);
(2) NCCL RAS on `ras_host:ras_port` every `ras_interval_seconds` (NCCL >= 2.24; JSON from 2.28.7), which
also knows the ranks on other hosts. A member is sent once per (comm, rank, host, pid) and again only when
its place changes (a new pid for the rank after a restart). Where the member's pid is a workload on this
host, the process's global rank and job key are added.

Attaches at run time for RAS (nothing to set in the job); the log path needs `NCCL_DEBUG=INFO
NCCL_DEBUG_SUBSYS=INIT,COLL NCCL_DEBUG_FILE=<dir>/nccl.%h.%p.log` at the job's launch.
Failures never raise out of step(): an unreadable directory or file is skipped, RAS being unreachable is
reported once as an Event (`nccl_ras_unavailable`) and retried at the next interval.

Cost: one listdir per log dir per step and a regex per new line containing "Init "; a RAS query makes NCCL
run an internal collective among its RAS threads, hence the long default interval.
Verified: log parsing on real published NCCL 2.x lines (tests/fixtures/nccl). Not verified: a live RAS
service (no GPU here); its JSON parser is checked on a document built from NCCL's writer code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from steplens.agent.records import CommMember, Event
from steplens.agent.sources.base import ConfigError, Source, SourceConfig


@dataclass
class NccltopoConfig(SourceConfig):
    interval_seconds: float = 5.0
    log_dirs: list = field(default_factory=lambda: ["/var/log/steplens/nccl"])  # NCCL_DEBUG_FILE directories
    max_read_bytes: int = 16 * 1024 * 1024     # per file per step: a huge log is caught up over several steps
    ras: bool = True                           # query NCCL RAS
    ras_host: str = "localhost"
    ras_port: int = 28028
    ras_interval_seconds: float = 300.0
    ras_timeout_seconds: float = 5.0

    def validate(self) -> None:
        super().validate()
        if self.max_read_bytes < 4096:
            raise ConfigError("max_read_bytes must be at least 4096")
        if not (1 <= self.ras_port <= 65535):
            raise ConfigError(f"ras_port must be within 1..65535, got {self.ras_port}")
        if self.ras_interval_seconds < 1 or self.ras_timeout_seconds <= 0:
            raise ConfigError("ras_interval_seconds must be >= 1 and ras_timeout_seconds > 0")


class NccltopoSource(Source):
    governed = False   # its buffer or ring must be read at its interval (agent/governor.py)
    name = "nccltopo"
    config_class = NccltopoConfig
    description = "NCCL communicator membership: comm hash -> rank -> host/pid/GPU (NCCL init logs, NCCL RAS)"

    def __init__(self, ctx, config: NccltopoConfig) -> None:
        super().__init__(ctx, config)
        self._offsets: dict[str, int] = {}     # log file -> bytes consumed
        self._partial: dict[str, bytes] = {}   # log file -> an unfinished last line
        self._sent: dict[tuple[str, int], tuple] = {}  # (comm, rank) -> place last sent
        self._next_ras = 0
        self._ras_reported = False
        self.lines_parsed = 0

    def step(self) -> list:
        from steplens.agent import nccltopo
        now = self.ctx.mono_ns()
        comms: dict = {}
        for d in self.config.log_dirs:
            for path in nccltopo.log_files(d):
                lines = self._new_lines(path)
                if lines:
                    self.lines_parsed += len(lines)
                    nccltopo.parse_log(lines, comms)
        out: list = self._members(comms, "nccl_log", now)
        if self.config.ras and now >= self._next_ras:
            self._next_ras = now + int(self.config.ras_interval_seconds * 1e9)
            try:
                ras = nccltopo.ras_topology(self.config.ras_host, self.config.ras_port, self.config.ras_timeout_seconds)
            except nccltopo.RasUnavailable as exc:
                if not self._ras_reported:
                    self._ras_reported = True
                    out.append(Event(now, "nccl_ras_unavailable", f"{self.config.ras_host}:{self.config.ras_port}",
                                     f"NCCL RAS not reachable ({exc}); communicator membership comes from NCCL logs "
                                     f"only. Retried every {self.config.ras_interval_seconds:.0f} s"))
            except Exception as exc:  # a RAS answer we cannot read: report, keep the log path working
                self.errors += 1
                out.append(Event(now, "nccl_ras_error", f"{self.config.ras_host}:{self.config.ras_port}",
                                 f"{type(exc).__name__}: {exc}"))
            else:
                self._ras_reported = False
                out += self._members(ras, "nccl_ras", now)
        return out

    def _new_lines(self, path: str) -> list[str]:
        try:
            size = os.path.getsize(path)
            off = self._offsets.get(path, 0)
            if size < off:  # replaced or truncated: read it again
                off, self._partial[path] = 0, b""
            if size == off:
                return []
            with open(path, "rb") as fh:
                fh.seek(off)
                data = fh.read(self.config.max_read_bytes)
        except OSError:
            return []
        self._offsets[path] = off + len(data)
        data = self._partial.pop(path, b"") + data
        cut = data.rfind(b"\n") + 1
        if cut < len(data):
            self._partial[path] = data[cut:]
        return data[:cut].decode("utf-8", "replace").splitlines()

    def _members(self, comms: dict, via: str, now: int) -> list[CommMember]:
        workloads = {info.pid: info for info in self.ctx.workloads.snapshot().values()}
        host = os.uname().nodename
        out = []
        for comm in comms.values():
            for rank, place in sorted(comm.ranks.items()):
                where = (place.host, place.pid, place.cuda_dev, place.nvml_dev, place.bus_id)
                if self._sent.get((comm.comm_hash, rank)) == where:
                    continue
                self._sent[(comm.comm_hash, rank)] = where
                info = workloads.get(place.pid) if place.host in (host, host.split(".")[0]) else None
                out.append(CommMember(now, comm.comm_hash, rank, comm.nranks, place.host, place.pid, place.cuda_dev,
                                      place.nvml_dev, place.bus_id, info.rank if info else -1,
                                      info.job_key if info else "", via))
        if len(self._sent) > 1_000_000:  # bounded: forget, at worst members are sent again
            self._sent.clear()
        return out
