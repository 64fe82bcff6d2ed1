"""Which collector runs a job's analysis, when several share one store (issue "Scale-out", item 2).

Every collector writes a heartbeat row into the store's `collectors` table (its id, the address its peers reach
it at, when it started) every `heartbeat_seconds`; the live collectors are those whose newest heartbeat is
younger than `ttl_seconds`. Each job (and the cluster-wide flow analysis, key `flows:`) belongs to the live
collector that rendezvous hashing (highest random weight: the largest hash of (collector id, key)) picks; each
collector computes the same answer from the same rows, with no election and no lock: the store is the only
thing they share. When a collector dies its heartbeat ages out and its jobs go to the survivors, each to the one
that ranks second for it; when one joins, it takes about 1/n of the jobs from the others, and nothing else moves.

While two collectors see different live sets (a heartbeat written but not yet read, for up to heartbeat_seconds
plus a loop interval) a job may be analysed twice or not at all for that moment: on a shared SQLite store its
findings are keyed by (job, detector, suspect) and merged the same way by either, so a double run yields the
same finding (on ClickHouse each collector's SQLite holds the findings, replicated between them by
store/replication.py: a finding's id is its key and onset, so a double run's two copies are one row);
a skipped pass is made up at the next one. A store that cannot be read or written leaves the set as last read; a
collector that has never read one owns every job (a lone collector, or a store without the table yet).

`Ownership(writer, reader, collector_id, address, ...)`; `start()` heartbeats on a thread of its own (the
analysis loop's passes and duty-cycle sleeps can outlast the TTL), `refresh()` does one beat and read now,
`owns(key)` per job."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Callable

log = logging.getLogger("steplens.collector.ownership")

FLOWS_KEY = "flows:"   # the black-box flow analysis of the whole cluster: one collector runs it


def weight(collector_id: str, key: str) -> int:
    """The rendezvous weight of key on a collector (stable across processes and versions: blake2b)."""
    return int.from_bytes(hashlib.blake2b(f"{collector_id}\0{key}".encode(), digest_size=8).digest(), "big")


def owner_of(key: str, collectors: list[str] | tuple[str, ...]) -> str:
    """The collector among `collectors` that owns key ('' when there is none)."""
    return max(collectors, key=lambda c: (weight(c, key), c), default="")


class Ownership:
    def __init__(self, writer, reader, collector_id: str, address: str = "", heartbeat_seconds: float = 2.0,
                 ttl_seconds: float = 10.0, now_ns: Callable[[], int] = time.time_ns) -> None:
        if not collector_id:
            raise ValueError("a collector id is needed")
        if not 0.1 <= heartbeat_seconds < ttl_seconds:
            raise ValueError("heartbeat_seconds must be >= 0.1 and below ttl_seconds")
        self.writer, self.reader = writer, reader
        self.id, self.address = collector_id, address
        self.heartbeat_ns, self.ttl_ns = int(heartbeat_seconds * 1e9), int(ttl_seconds * 1e9)
        self.now_ns = now_ns
        self.started_ns = now_ns()
        self._lock = threading.Lock()
        self._next_ns = 0
        self._live: tuple[str, ...] = ()     # () until read once: then every job is ours
        self.peers: list[dict] = []          # the live collectors' rows as last read
        self.errors = 0
        self.last_error = ""
        self.moves = 0                       # changes of the live set seen
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Heartbeat on a thread of its own, every heartbeat_seconds: a long analysis pass (or its duty-cycle
        sleep) must not let the heartbeat age out and hand this collector's jobs to the others."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._main, name="heartbeat", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _main(self) -> None:
        while True:
            self.refresh(force=True)
            if self._stop.wait(self.heartbeat_ns / 1e9):
                return

    def refresh(self, force: bool = False) -> tuple[str, ...]:
        """Heartbeat and re-read the live set, at most every heartbeat_seconds (force: now). Never raises."""
        now = self.now_ns()
        with self._lock:
            if not force and now < self._next_ns:
                return self._live
            self._next_ns = now + self.heartbeat_ns
        try:
            self.writer.heartbeat(self.id, self.address, self.started_ns, now)
            rows = self.reader.live_collectors(now - self.ttl_ns)
        except Exception as exc:   # a store away for a moment: keep the last set
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning("collector heartbeat / live set failed: %s", self.last_error)
            return self._live
        ids = {r["id"] for r in rows} | {self.id}   # its own heartbeat may not be committed yet
        live = tuple(sorted(ids))
        with self._lock:
            if self._live and live != self._live:
                self.moves += 1
                log.info("live collectors now %s (were %s)", ", ".join(live), ", ".join(self._live))
            self._live = live
            self.peers = rows
        return live

    @property
    def live(self) -> tuple[str, ...]:
        return self._live

    def owns(self, key: str) -> bool:
        live = self._live
        return not live or owner_of(key, live) == self.id

    def owner(self, key: str) -> str:
        return owner_of(key, self._live) if self._live else self.id


__all__ = ["FLOWS_KEY", "Ownership", "owner_of", "weight"]
