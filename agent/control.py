"""Carries out the collector's Commands on this agent; knows nothing of the RPC transport.

Deep mode: a command names a start instant (already converted by the collector into this host's
CLOCK_MONOTONIC via its clock model) and a duration, so every agent of a job switches within
the clock model's uncertainty of each other. The switch and its end are recorded as ModeChange
records and reported in the agent's status.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from steplens.agent.records import Mode, ModeChange
from steplens.agent.sources import SOURCE_PATHS, load_source_class
from steplens.agent.sources.base import build_config
from steplens.v1 import ingest_pb2 as ipb

log = logging.getLogger("steplens.agent.control")

MAX_DEEP_SECONDS = 3600
MAX_START_AHEAD_SECONDS = 600


def _realtime() -> bool:
    """Best effort: this thread (the deep-mode timer) at SCHED_FIFO priority 1, so it wakes on time on a host whose
    cores a job or a noisy neighbour keeps busy (root or CAP_SYS_NICE; measured on the testbed with two burners
    on 2 cores: 24 ms between agents at normal priority). It only sleeps and flips a mode."""
    import os
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_FIFO, os.sched_param(1))
        return True
    except (OSError, AttributeError):
        return False


class DeepModeScheduler:
    """One pending window at a time; a newer command replaces an older one."""

    def __init__(self, set_mode: Callable[[Mode], None], emit: Callable[[list], None],
                 mono_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self._set_mode = set_mode
        self._emit = emit
        self._mono_ns = mono_ns
        self._lock = threading.Lock()
        self._gen = 0
        self.mode = Mode.SENTINEL
        self.until_mono_ns = 0
        self.started_mono_ns = 0
        self.command_id = ""

    def schedule(self, command_id: str, start_mono_ns: int, duration_ns: int) -> str:
        now = self._mono_ns()
        start = start_mono_ns or now
        if start - now > MAX_START_AHEAD_SECONDS * 1e9:
            raise ValueError(f"start is {(start - now) / 1e9:.0f}s ahead; at most {MAX_START_AHEAD_SECONDS}s")
        if not (0 < duration_ns <= MAX_DEEP_SECONDS * 1e9):
            raise ValueError(f"duration must be within 0..{MAX_DEEP_SECONDS}s")
        with self._lock:
            self._gen += 1
            gen = self._gen
        threading.Thread(target=self._window, args=(gen, command_id, start, start + duration_ns),
                         name="deep-mode", daemon=True).start()
        return f"deep mode from +{max(0, start - now) / 1e6:.1f} ms for {duration_ns / 1e9:.3f} s"

    def cancel(self, command_id: str) -> str:
        with self._lock:
            self._gen += 1
            was = self.mode
        if was is Mode.DEEP:
            self._switch(Mode.SENTINEL, command_id, 0, "stopped by command")
            return "deep mode stopped"
        return "deep mode was not active"

    def _sleep_until(self, target_ns: int, gen: int) -> bool:
        while True:
            if self._gen != gen:
                return False
            left = target_ns - self._mono_ns()
            if left <= 0:
                return True
            # coarse sleep, then a short spin for the last millisecond: agents start together
            time.sleep(min(0.05, left / 1e9 - 0.001) if left > 2_000_000 else 0)

    def _window(self, gen: int, command_id: str, start: int, end: int) -> None:
        _realtime()
        if not self._sleep_until(start, gen):
            return
        with self._lock:
            if self._gen != gen:
                return
        self._switch(Mode.DEEP, command_id, end, "command")
        if not self._sleep_until(end, gen):
            return
        with self._lock:
            if self._gen != gen:
                return
        self._switch(Mode.SENTINEL, command_id, 0, "window ended")

    def _switch(self, mode: Mode, command_id: str, until: int, reason: str) -> None:
        now = self._mono_ns()
        self.mode, self.until_mono_ns, self.command_id = mode, until, command_id
        if mode is Mode.DEEP:
            self.started_mono_ns = now
        self._set_mode(mode)
        self._emit([ModeChange(now, mode, command_id, until, reason)])
        log.info("mode %s (%s)", mode.name.lower(), reason)


MAX_FETCH_ROWS = 100_000
FETCH_REFRESH_SECONDS = 3.0   # at most this long for the Flight Recorder rings to be read before a comm-op fetch
MAX_FETCH_BYTES = 6 * 1024 * 1024  # a CommandResult must fit in one gRPC message (8 MiB)
DETAIL_KINDS = ("stacks", "commops", "kernels")
_RECORD_KINDS = {"commops": "commop", "kernels": "kernelrec"}  # detail kind -> DetailStore records kind


class CommandHandler:
    def __init__(self, deep: DeepModeScheduler, state_dir: str = "", workloads=None,
                 refresh: Callable[..., bool] | None = None) -> None:
        self.deep = deep
        self.state_dir = state_dir
        self.workloads = workloads  # WorkloadRegistry: maps ranks to pids for FetchDetail
        self.refresh = refresh      # Runner.refresh: comm-op sources read their rings before a fetch
        self._refreshed_at = -1e9   # time.monotonic() of the last one (a paged fetch asks many times in a row)

    def __call__(self, cmd: ipb.Command) -> ipb.CommandResult:
        kind = cmd.WhichOneof("kind")
        try:
            if kind == "deep":
                d = cmd.deep
                if d.enable:
                    msg = self.deep.schedule(cmd.command_id, d.start_mono_ns, d.duration_ns)
                else:
                    msg = self.deep.cancel(cmd.command_id)
                return ipb.CommandResult(command_id=cmd.command_id, ok=True, message=msg)
            if kind == "config":
                if cmd.config.source not in SOURCE_PATHS:
                    raise ValueError(f"unknown source {cmd.config.source!r}")
                import tomllib
                table = tomllib.loads(cmd.config.toml)
                build_config(load_source_class(cmd.config.source).config_class, table,
                             f"[sources.{cmd.config.source}]")
                return ipb.CommandResult(command_id=cmd.command_id, ok=False,
                                         message="config is valid, but live reconfiguration is not implemented "
                                                 "in this agent version; edit agent.toml and restart")
            if kind == "fetch":
                return self._fetch(cmd)
            return ipb.CommandResult(command_id=cmd.command_id, ok=False, message=f"unknown command kind {kind!r}")
        except Exception as exc:
            return ipb.CommandResult(command_id=cmd.command_id, ok=False, message=f"{type(exc).__name__}: {exc}")

    def _fetch_records(self, cmd: ipb.Command, path: str, kinds: list[str], pids, budget: int) -> tuple[str, bytes]:
        """CommOp / KernelRec records kept as serialized Records: re-wrapped into a RecordList unparsed.
        Rank filter: a record's own rank (set by the source from the workload's environment) or a pid
        of a workload with that rank."""
        from steplens.agent.detail import open_shared, release_shared
        from steplens.agent.transport.codec import records_payload
        f = cmd.fetch
        limit = min(f.limit or 100_000, MAX_FETCH_ROWS)
        store = open_shared(path)  # the sources' own store: no second connection, no row count per fetch
        try:
            blobs = store.records([_RECORD_KINDS[k] for k in kinds], f.since_mono_ns, f.until_mono_ns or (1 << 63) - 1,
                                  pids=pids if f.ranks else None, ranks=set(f.ranks) if f.ranks else None,
                                  limit=limit + 1)
        finally:
            release_shared(store)
        truncated = len(blobs) > limit
        blobs = blobs[:limit]
        size = 0
        for i, b in enumerate(blobs):
            size += len(b) + 6
            if size > budget:
                blobs, truncated = blobs[:i], True
                break
        note = f"{len(blobs)} {'/'.join(kinds)} records" + (
            " (truncated: narrow the time range or ranks, or raise the limit)" if truncated else "")
        return note, records_payload(blobs)

    def _fetch(self, cmd: ipb.Command) -> ipb.CommandResult:
        """Node-local detail for a time range (this host's monotonic clock, filled in by the collector)
        as a RecordList: raw stack samples as one-sample StackSummary records."""
        import os

        f = cmd.fetch
        kinds = list(f.kinds) or list(DETAIL_KINDS)
        unknown = sorted(set(kinds) - set(DETAIL_KINDS))
        if unknown:
            return ipb.CommandResult(command_id=cmd.command_id, ok=False,
                                     message=f"unknown detail kind(s) {', '.join(unknown)}; this agent keeps: "
                                             f"{', '.join(DETAIL_KINDS)}")
        path = os.path.join(self.state_dir, "detail.db")
        if not os.path.exists(path):
            return ipb.CommandResult(command_id=cmd.command_id, ok=False,
                                     message="no node-local detail yet (no source has stored any: pystacks, kineto, "
                                             "flightrec)")
        pids = None
        if f.ranks:
            procs = self.workloads.known() if self.workloads is not None else []
            pids = {p.pid for p in procs if p.rank in set(f.ranks)} | set(f.pids)
        notes, parts = [], []
        record_kinds = [k for k in kinds if k in _RECORD_KINDS]
        budget = MAX_FETCH_BYTES // 2 if record_kinds and "stacks" in kinds else MAX_FETCH_BYTES
        if record_kinds and self.refresh is not None:
            # rings read first: the newest ops too. A window that ended (until in the past) is skipped by the
            # source where every ring asked about was read after it (a paged fetch's later pages, the collector's
            # analysis of steps it knows); an open one (0, or ending in the future) has them read once a second
            # at most (a paged fetch asks many times in a row)
            until = f.until_mono_ns if 0 < f.until_mono_ns <= time.monotonic_ns() else 0
            if until or time.monotonic() - self._refreshed_at > 1.0:
                self.refresh("flightrec", FETCH_REFRESH_SECONDS, until, pids)
                if not until:
                    self._refreshed_at = time.monotonic()
        if record_kinds:
            note, payload = self._fetch_records(cmd, path, record_kinds, pids, budget)
            notes.append(note)
            parts.append(payload)
        if "stacks" in kinds:
            note, payload = self._fetch_stacks(cmd, path, pids, budget)
            notes.append(note)
            parts.append(payload)
        # serialized RecordLists concatenate into one RecordList (a repeated field's entries append)
        return ipb.CommandResult(command_id=cmd.command_id, ok=True, message="; ".join(notes), payload=b"".join(parts))

    def _fetch_stacks(self, cmd: ipb.Command, path: str, pids, budget: int) -> tuple[str, bytes]:
        from steplens.agent.records import StackSummary
        from steplens.agent.transport.codec import encode_records
        f = cmd.fetch
        if f.ranks and not pids:
            return "no workload with those ranks", b""
        from steplens.agent.detail import open_shared, release_shared
        store = open_shared(path)
        try:
            limit = min(f.limit or 10_000, MAX_FETCH_ROWS)
            rows = store.stack_samples(f.since_mono_ns, f.until_mono_ns or (1 << 63) - 1, 0, limit + 1)
        finally:
            release_shared(store)
        if pids is not None:
            rows = [r for r in rows if r["pid"] in pids]
        truncated = len(rows) > limit
        rows = rows[:limit]
        items = []
        for r in rows:
            frames = [tuple(x) for x in r["frames"]]
            items.append(("pystacks", StackSummary(r["mono_ns"], r["pid"], 0, r["tid"], "", r["mono_ns"], 1, frames,
                                                   [(tuple(range(len(frames))), 1, int(r["gil"]),
                                                     int(r["state"] == "running"))], 0, "", r["state"])))
        payload = encode_records(items)
        while len(payload) > budget and items:
            items = items[:len(items) * 3 // 4]
            truncated = True
            payload = encode_records(items)
        note = f"{len(items)} stack samples" + (" (truncated: narrow the time range or raise the limit)"
                                                 if truncated else "")
        return note, payload
