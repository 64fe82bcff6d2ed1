"""The contract between the analysis engine and its detectors: a window, a config, a spec.

A detector is a pure function `detect(reader, window, config) -> list[Finding]`:
  reader  the store's read side (steplens.collector.store.queries.Reader, or the engine's AnalysisReader,
          which adds `fetch_commops` for progressive fetching); no writes, no wall clock;
  window  one job and a span of cluster time [since_ns, until_ns] (until_ns is the newest data);
  config  its validated config (a DetectorConfig subclass: every field with a default and a unit in its name).
It returns what it sees in that window; the engine sets job_key and detector on each finding and merges them
into the stored ones (findings.merge: `for` and resolve). A detector with state across windows (a model fitted
on one window and applied to the next) keeps it in an object whose `detect` is the function registered, and
says so in its module docstring; the engine holds one instance per collector.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from steplens.collector.analysis.findings import Finding, Policy


class ConfigError(ValueError):
    """A config value is wrong; raised at start-up, before any thread starts."""


@dataclass(frozen=True)
class Window:
    job_key: str
    since_ns: int
    until_ns: int

    @property
    def seconds(self) -> float:
        return (self.until_ns - self.since_ns) / 1e9


@dataclass
class DetectorConfig:
    """Keys every detector has; a detector's own config subclasses this."""

    enabled: bool = True
    window_seconds: float = 600.0          # data handed to the detector by the loop (diagnose --since overrides)
    for_seconds: float = 0.0               # confirmed this long before a finding opens (0: at once)
    resolve_after_seconds: float = 120.0   # open finding not re-confirmed this long (data time): resolved

    def validate(self) -> None:
        if not 1 <= self.window_seconds <= 7 * 86400:
            raise ConfigError(f"window_seconds must be within 1..604800, got {self.window_seconds}")
        if not 0 <= self.for_seconds <= 86400:
            raise ConfigError(f"for_seconds must be within 0..86400, got {self.for_seconds}")
        if not 0 < self.resolve_after_seconds <= 7 * 86400:
            raise ConfigError(f"resolve_after_seconds must be within 0..604800 (not 0), got "
                              f"{self.resolve_after_seconds}")

    def policy(self) -> Policy:
        return Policy(int(self.for_seconds * 1e9), int(self.resolve_after_seconds * 1e9))


@dataclass(frozen=True)
class DetectorSpec:
    """What a detector module exports as SPEC and DETECTORS names."""

    name: str                      # lower_snake_case: module, config table [detectors.<name>], metric label
    description: str
    kinds: tuple[str, ...]         # finding kinds it may emit
    config_class: type[DetectorConfig]
    detect: Callable[[Any, Window, DetectorConfig], list[Finding]]
    on_idle: bool = False          # also run, with the window ending now, on a job whose data stopped coming
                                   # (what it finds is the absence of data: a hang)


@dataclass
class AnalysisSettings:
    """The collector's [analysis] table: the loop that runs detectors per job on new data."""

    enabled: bool = True
    interval_seconds: float = 5.0          # how often the loop looks for jobs with new data
    max_cpu_fraction: float = 0.25         # of one core, over the loop's runs (duty cycle: it sleeps to stay under)
    nice: int = 10                         # the analysis thread's niceness (Linux, best effort)
    max_jobs_per_cycle: int = 64           # jobs analysed per pass at most (the rest wait for the next pass)
    watch_queue_size: int = 1024           # findings events buffered per WatchFindings stream (oldest dropped)
    causes: bool = True                    # attach why each leading suspect is slow (analysis/causes.py)
    flows_interval_seconds: float = 30.0   # the black-box flow analysis (flowjobs.py) reruns this often at most
    flows_window_seconds: float = 60.0     # ... over this much of the newest flows (LLMPrism's one minute)
    flows_ignore_ports: list = field(default_factory=list)  # TCP ports whose flows are no job's (the collector's
                                           # own listen ports are added by the collector)
    flows_segmenter: str = "gap"           # step division of a pair's flows: gap (natural break) | bocd (reference)
    idle_watch_seconds: float = 3600.0     # a job whose data stopped (hung in an op no source reports, stopped)
                                           # is still run through the hang detector, up to now, this long
    fetch_cache_rows: int = 30_000         # node-local detail the detectors fetched, kept for the next passes
                                           # (control/fetch.py DetailCache; ~1.7 KB a row); 0: none kept
    # several collectors on one store (analysis/ownership.py): each job's analysis on one of them
    collector_id: str = ""                 # this collector's id among them ('' : the collector sets host:port)
    collector_address: str = ""            # where its peers reach it (the collector sets its listen address)
    heartbeat_seconds: float = 2.0         # its heartbeat into the store's collectors table
    collector_ttl_seconds: float = 10.0    # a collector silent this long is gone: its jobs go to the others

    def validate(self) -> None:
        if not 0.05 <= self.interval_seconds <= 3600:
            raise ConfigError(f"interval_seconds must be within 0.05..3600, got {self.interval_seconds}")
        if not 0.01 <= self.max_cpu_fraction <= 1.0:
            raise ConfigError(f"max_cpu_fraction must be within 0.01..1, got {self.max_cpu_fraction}")
        if not 0 <= self.nice <= 19:
            raise ConfigError(f"nice must be within 0..19, got {self.nice}")
        if not 1 <= self.flows_interval_seconds <= 3600 or not 5 <= self.flows_window_seconds <= 3600:
            raise ConfigError("flows_interval_seconds must be within 1..3600 and flows_window_seconds within 5..3600")
        if self.flows_segmenter not in ("gap", "bocd"):
            raise ConfigError(f"flows_segmenter must be gap or bocd, got {self.flows_segmenter!r}")
        if not all(isinstance(p, int) and 0 < p < 65536 for p in self.flows_ignore_ports):
            raise ConfigError(f"flows_ignore_ports must be TCP ports (1..65535), got {self.flows_ignore_ports}")
        if not 0 <= self.idle_watch_seconds <= 7 * 86400:
            raise ConfigError(f"idle_watch_seconds must be within 0..604800, got {self.idle_watch_seconds}")
        if not 0.1 <= self.heartbeat_seconds < self.collector_ttl_seconds <= 3600:
            raise ConfigError("need 0.1 <= heartbeat_seconds < collector_ttl_seconds <= 3600, got "
                              f"{self.heartbeat_seconds} and {self.collector_ttl_seconds}")
        if self.max_jobs_per_cycle < 1 or self.watch_queue_size < 1:
            raise ConfigError("max_jobs_per_cycle and watch_queue_size must be >= 1")
        if not 0 <= self.fetch_cache_rows <= 10_000_000:
            raise ConfigError(f"fetch_cache_rows must be within 0..10000000, got {self.fetch_cache_rows}")


def build_config(cls: type[DetectorConfig], table: dict, where: str) -> DetectorConfig:
    """A detector's config from its TOML table: unknown keys and bad values are errors."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(known))})")
    try:
        cfg = cls(**table)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    try:
        cfg.validate()
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return cfg


_gc_lock = threading.Lock()
_gc_holders = 0
_gc_was_enabled = False


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Python's cyclic garbage collector paused while detectors run on one job. A pass over an 8,192-GPU
    window keeps millions of parsed Step rows alive and builds millions of small containers on top of them;
    every automatic collection walks them all again, which more than tripled the communicator grouping's time
    (irregularity.groups, measured on an 8,192-GPU window). The detectors make no reference cycles that
    matter; the collector is re-enabled when the last concurrent pass ends (reference counting frees
    everything else meanwhile), as it was before."""
    global _gc_holders, _gc_was_enabled
    with _gc_lock:
        if _gc_holders == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holders += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holders -= 1
            if _gc_holders == 0 and _gc_was_enabled:
                gc.enable()


def topology_of(reader):
    """The imported physical topology, or None (none imported, or a reader without one)."""
    try:
        return reader.topology()
    except Exception:  # a reader without a topology
        return None


def nics_of(reader, node: str) -> list[str]:
    """The topology's NICs of a node (each stands for its link to its switch), where a topology is imported."""
    topo = topology_of(reader)
    return sorted(n.id for n in topo.nics.values() if n.node == node) if topo is not None else []


def nic_addresses(reader) -> dict[str, str]:
    """NIC address -> node, from the topology where one is imported (hang's and causes' connection ends)."""
    topo = topology_of(reader)
    return {n.ip: n.node for n in topo.nics.values() if n.ip} if topo is not None else {}
