"""The contract between the agent's runner and its sources.

A source says whether it can run here (`probe`), is started once with its validated config,
then `step()` is called on its own thread at its interval and returns Records. Optional libraries
(pynvml, bcc, cupti, torch) are imported inside probe()/start(), never at module top.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from steplens.agent.records import Mode, ProcessInfo


class ConfigError(ValueError):
    """A config value is wrong; raised before any thread starts."""


@dataclass
class SourceConfig:
    """Keys every source has. Subclasses add their own, each with a default and a unit in its name."""

    enabled: bool = True
    interval_seconds: float = 1.0
    deep_interval_seconds: float = 0.0  # 0: same as interval_seconds
    step_timeout_seconds: float = 10.0  # a step longer than this marks the source stalled

    def validate(self) -> None:
        if not (0.001 <= self.interval_seconds <= 3600):
            raise ConfigError(f"interval_seconds must be within 0.001..3600, got {self.interval_seconds}")
        if self.deep_interval_seconds and not (0.0005 <= self.deep_interval_seconds <= 3600):
            raise ConfigError(f"deep_interval_seconds must be 0 or within 0.0005..3600, got {self.deep_interval_seconds}")
        if self.step_timeout_seconds <= 0:
            raise ConfigError("step_timeout_seconds must be > 0")


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""

    @classmethod
    def yes(cls, reason: str = "") -> "Availability":
        return cls(True, reason)

    @classmethod
    def no(cls, reason: str) -> "Availability":
        return cls(False, reason)


class WorkloadRegistry:
    """The workload processes the `procs` source has found, read by other sources.

    Keyed by (pid, start_ticks) so a reused PID is never mistaken for the old process.
    Replaced as a whole each scan, so readers need no lock for a consistent view.
    Workloads that exited are remembered (the last `history` of them): their node-local detail outlives
    them, and a fetch by rank after a job ended must still find their pids.
    """

    def __init__(self, history: int = 4096) -> None:
        self._procs: dict[tuple[int, int], ProcessInfo] = {}
        self._past: dict[tuple[int, int], ProcessInfo] = {}
        self._history = history
        self._cond = threading.Condition()

    def replace(self, procs: dict[tuple[int, int], ProcessInfo]) -> None:
        with self._cond:
            for key, info in self._procs.items():
                if key not in procs:
                    self._past.pop(key, None)
                    self._past[key] = info
            for key in [k for k in self._past if k in procs]:
                del self._past[key]
            while len(self._past) > self._history:
                del self._past[next(iter(self._past))]
            self._procs = dict(procs)
            if procs:
                self._cond.notify_all()

    def snapshot(self) -> dict[tuple[int, int], ProcessInfo]:
        return self._procs

    def known(self) -> list[ProcessInfo]:
        """Every workload seen: those running and the last ones that exited (oldest first)."""
        with self._cond:
            return list(self._past.values()) + list(self._procs.values())

    def wait_nonempty(self, stop: threading.Event) -> None:
        """Block (no CPU, no periodic wake-up) until there is a workload or `stop` is set and wake() called."""
        with self._cond:
            while not self._procs and not stop.is_set():
                self._cond.wait()

    def wake(self) -> None:
        """Release every wait_nonempty() so its caller can look at its stop event."""
        with self._cond:
            self._cond.notify_all()


@dataclass
class HostContext:
    """What a source may touch of the host; tests point these at fixture trees or fakes."""

    node_id: str
    proc_root: str = "/proc"
    sys_root: str = "/sys"
    state_dir: str = "/var/lib/steplens-agent"
    mono_ns: Callable[[], int] = time.monotonic_ns
    workloads: WorkloadRegistry = field(default_factory=WorkloadRegistry)
    mode: Callable[[], Mode] = lambda: Mode.SENTINEL


class Source:
    """Base class. Subclasses set `name`, `config_class`, and implement probe/start/step."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type[SourceConfig]] = SourceConfig
    description: ClassVar[str] = ""
    # the overhead governor may stretch its interval (agent/governor.py); False for sources that drain kernel
    # buffers or rings that would overflow or wrap if read less often
    governed: ClassVar[bool] = True

    def __init__(self, ctx: HostContext, config: SourceConfig) -> None:
        self.ctx = ctx
        self.config = config
        self.errors = 0  # non-fatal errors inside steps that still returned records; the runner reports them

    @classmethod
    def probe(cls, ctx: HostContext) -> Availability:
        return Availability.yes()

    def start(self) -> None:
        """Acquire handles. May raise: the source is then marked down with the error as reason."""

    def step(self) -> list:
        raise NotImplementedError

    def idle(self) -> bool:
        """True when this source has nothing to do until a workload process appears: while there is none, the
        runner stops stepping it and waits for one (no wake-ups). Sources that watch the whole host (host,
        procs, netflows) never are; workload sources are once the state of the last ones is flushed."""
        return False

    def set_mode(self, mode: Mode) -> None:
        """Deep mode began or ended; sources with a deep mode change what they collect."""

    def pace(self) -> float:
        """How many times its configured interval this source's next step should wait (>= 1), by its own rule:
        pystacks spreads a per-host sample budget over however many processes it samples. Asked after each step;
        the governor's stretch (agent/governor.py) applies on top."""
        return 1.0

    def stop(self) -> None:
        """Release handles. Idempotent."""


def build_config(cls: type[SourceConfig], table: dict[str, Any], where: str) -> SourceConfig:
    """A typed config from a TOML table: unknown keys and wrong types are errors, not ignored."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    values = {}
    for key, value in table.items():
        default = known[key].default
        if default is dataclasses.MISSING and known[key].default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = known[key].default_factory()  # type: ignore[misc]
        values[key] = _coerce(value, default, f"{where}.{key}")
    config = cls(**values)
    try:
        config.validate()
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return config


def _coerce(value: Any, default: Any, where: str) -> Any:
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    if isinstance(default, list):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where} must be a list of strings, got {value!r}")
        return list(value)
    return value


def host_path(root: str, *parts: str) -> str:
    return os.path.join(root, *parts)


_LISTINGS: dict[tuple, tuple[tuple, list]] = {}   # (kind, what) -> (its directory's stat, the result)
_LISTINGS_LOCK = threading.Lock()
_SETTLED_NS = 2 * 10**9   # a directory changed this recently may change again within its mtime's granularity


def _listed(directory: str, key: tuple, make):
    """make() once per change of `directory` (its mtime, inode and device: adding or removing an entry changes the
    mtime), cached under `key`; not cached while the mtime is within 2 s of now (a change within the file system's
    timestamp granularity leaves the mtime as it was). None where the directory cannot be read (make() raising
    OSError included)."""
    try:
        st = os.stat(directory)
    except OSError:
        return None
    sig = (st.st_mtime_ns, st.st_ino, st.st_dev)
    with _LISTINGS_LOCK:
        cached = _LISTINGS.get(key)
    if cached is not None and cached[0] == sig:
        return cached[1]
    try:
        result = make()
    except OSError:
        return None
    if time.time_ns() - st.st_mtime_ns > _SETTLED_NS:
        with _LISTINGS_LOCK:
            if len(_LISTINGS) > 1024:
                _LISTINGS.clear()
            _LISTINGS[key] = (sig, result)
    return result


def glob_dirs(pattern: str) -> list[str]:
    """glob.glob(pattern), sorted, for the runtime-directory patterns the sources poll every second
    ("/tmp/steplens-fr-*"): where only the last component has wildcards, the parent directory is listed again only
    when it changed (_listed), so a /tmp of thousands of entries is not read every second by every source that
    polls it (~0.2-0.4 ms a listing of 360 entries here). A pattern without wildcards is itself; one with them
    above the last component is globbed every time."""
    if not glob.has_magic(pattern):
        return [pattern]
    parent, last = os.path.split(pattern)
    if glob.has_magic(parent) or not last:
        return sorted(glob.glob(pattern))
    found = _listed(parent, ("glob", pattern), lambda: sorted(glob.glob(pattern)))
    return [] if found is None else found


def runtime_files(patterns, extensions: tuple[str, ...]) -> dict[str, dict[int, str]]:
    """The bootstrap's per-process files <pid>.<ext> in the directories the glob patterns match, by extension and
    pid (the first directory, in pattern then name order, wins for a pid); a directory that cannot be listed is
    skipped. Each directory's files are listed again only when it changed (the rule of glob_dirs: flightrec and
    iters ask every second, ~0.1 ms a listing of a job's files)."""
    found: dict[str, dict[int, str]] = {ext: {} for ext in extensions}
    for pattern in patterns:
        for d in glob_dirs(pattern):
            files = _dir_files(d, extensions)
            if files is None:
                continue
            for ext, pid, path in files:
                found[ext].setdefault(pid, path)
    return found


def _dir_files(d: str, extensions: tuple[str, ...]) -> list | None:
    """[(ext, pid, path)] of the <pid>.<ext> files of directory d, in listing order, listed again only when d
    changed (_listed); None where it cannot be listed."""
    def make() -> list:
        files = []
        for n in os.listdir(d):
            stem, _, ext = n.partition(".")
            if ext in extensions and stem.isdigit():
                files.append((ext, int(stem), os.path.join(d, n)))
        return files
    return _listed(d, ("files", d, extensions), make)
