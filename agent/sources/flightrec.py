"""flightrec: torch.distributed Flight Recorder entries of workload processes, as CommOps, where each process
stands on each of its process groups, as CommProgress (hang detection), and the time each spent in Python's
garbage collector (python_gc_* Metrics, see GC time below).

Reads: the processes whose `<pid>.sock` the steplens bootstrap (agent/bootstrap/site, loaded with PYTHONPATH +
STEPLENS_BOOTSTRAP=1, torch's `_WorkerServer`) put in `socket_dirs`; only pids the procs source reports as
workloads are polled. With `read = "memory"` (the default) each ring is read from the process's memory
(agent/sources/frmemory.py: the recorder found by its symbol in libtorch_cpu.so, its layout from frlayouts/, only
the entries from the poll's cursor on, nothing asked of the job), which gives the same entries as the socket's
JSON (tests/test_frmemory.py, tests/test_source_flightrec.py side by side); where that cannot be done (a torch
without a layout here, a stripped library, a recorder failing frmemory's checks) the process is read through its
socket as below and the reason reported once (flightrec_read_from_socket). A read that fails on a live process
(an address unmapped as it was read) is tried once more, then made through the socket that time
(flightrec_memory_read_failed). Reads by way go out as Metric flightrec_ring_reads_by_way_total (entity
<node>:memory|socket) beside the reads by reason. Through the socket, a read sends `POST /handler/fr_trace_json`
(HTTP/1.1 over the socket; torch 2.13 answers 200 with one JSON document: version, entries, pg_config,
pg_status, nccl_comm_state) and, where the process has that handler, `dump_nccl_trace_json` (NCCL builds;
unverified here, no GPU). Verified layout versions: `accepted_versions` (torch 2.13 writes "2.10"); a dump of another
version is reported once as an Event and skipped, so an upgrade never produces wrong records silently.

Entries -> CommOp: collective_seq_id is the seq (it agrees across the ranks of a group), process_group
(name, desc) -> comm_id "pg:<name>", comm_desc, sizes x dtype -> count and bytes, time_created_ns
(CLOCK_REALTIME) -> issue time, timing "cpu_enqueue"; with NCCL timing (duration_ms present) the entry
also gets start/end and timing "cuda_event". Members are filled from pg_config where the dump lists ranks
(gloo in 2.13 does not), and for the default group ("0") from the process's WORLD_SIZE. An entry is
emitted once, when final (retired; where the layout has no `retired`, completed: a live NCCL dump holds completed
ops not yet retired, without their duration, for ~100 ms), or completed and still unretired RETIRE_GRACE_NS after
first seen so; entries are deduplicated per process by record_id across polls.
When the ring wrapped between two polls (the oldest record_id in a dump is past the last one seen + 1),
the lost entries are counted (`lost_entries`) and reported as an Event.

Anchors: the bootstrap writes where each iteration of the process ends into a ring file beside its socket,
<pid>.anchors: the end of each optimizer step and, where the loop body calls zero_grad after the step, the end
of that zero_grad (layout and rule in steplens_anchors; a file because a Python worker-server handler
deadlocks the job's exit). Each poll reads it after the Flight Recorder dump (so every anchor written before
the newest op in the dump is in it), takes the numbers not seen before, converts the times to this boot's
monotonic clock and hands them to the CommLog's segmenter (`add_anchors`), which ends a step at the last
anchor after its last collective. No file (an older bootstrap, STEPLENS_ANCHORS=0): not looked for again,
steps end at the ops; a file of another process (pid reused) or of another layout version (a newer bootstrap)
is reported once (flightrec_bad_anchors, saying which version) and left alone.
The exit dump's header carries the anchors the ring still held at exit.
A job's last ops (those after the last poll) come from the exit dump the bootstrap writes at interpreter exit,
<pid>-<start ticks>.fr-exit.json in the same directories (see steplens_bootstrap): each step reads the ones
present, emits what the periodic polls of that process did not (same record_id cursor; entries not yet
completed at exit are emitted too, there will be no later dump), and deletes the file. A process that left
the workloads keeps its cursor and ProcessInfo for EXIT_GRACE_SECONDS, so a dump read after procs reported
the exit still deduplicates and is attributed; for one never seen alive the dump's header (RANK, WORLD_SIZE,
job variables) says. A normal exit (socket gone, exit dump present) is not reported as a failure.

Progress (CommProgress, what a hang's culprit is found from): after each successful dump of a live process, one
record per process group in the dump's pg_status (torch 2.13 writes last_enqueued/started/completed_collective as
strings; gloo leaves started at -1; last_completed is raised to the group's highest done entry, as torch's gloo
threads can leave it one behind), comm_id "pg:<name>" as the CommOps', rank/job_key/start_ticks from the
process's ProcessInfo, mono_ns the time the dump was read. The oldest entry of the group not done (not retired
and state != "completed": gloo leaves every entry "scheduled" and retires it when it completes) gives pending_op
(normalized profiling name), pending_seq (collective_seq_id; p2p_seq_id for p2p), pending_peer (NCCL p2p names
"nccl:send 0->1" carry the group ranks: mapped to global through the group's members; else -1) and
pending_since_mono_ns (time_created_ns through the same REALTIME->MONOTONIC conversion as the CommOps). Emit rule,
per (process, group): when the status or the pending op changed since the last record emitted, every poll while
an op is pending (the collector sees "still waiting as of T"), and at least every progress_every_seconds
otherwise. A group in both endpoints' dumps keeps the one further on. Exit dumps give none (the process is gone),
and a process that left the workloads or failed has its state forgotten. An issue time that is not of this boot
leaves pending_since 0, counted with the CommLog's dropped times (`log.rejected`) and reported once per process
(flightrec_progress_time_dropped); a pg_status value or a pending seq that is not an int64 >= -1 (>= 0 for the
seq) is reported as flightrec_entries_malformed. A process without a job key gives none (the collector keeps
progress per job).

Failures are reported once per process and kind, then the process is retried after retry_seconds: a
socket that refuses (a stale socket file of a killed process), a process that exits mid-poll, a
truncated or non-JSON answer. The agent keeps running. An entry with a field of the wrong type is skipped
and counted (Event flightrec_entries_malformed); one whose time does not convert to this boot's monotonic
clock is dropped by CommLog.add (Event flightrec_records_dropped, with the reason).

Schedule: through the socket a dump always holds the whole ring (torch has no "entries since" request), so
reading it costs in proportion to the ring, not to what is new: per entry ~7 us of CPU in the job's worker-server
thread to build the JSON (it holds the recorder's mutex only while copying, never the GIL) and ~6 us here to parse
it (from memory: nothing in the job, ~1-2 us here per new entry, agent/sources/_frread.c), then ~5 us
per new op to convert, store and summarize it (bench/flightrec_ops.py, 2-core VM, python 3.11, 2026-12-07: convert
1.6, CommLog 3.2 with the detail store keeping ops unencoded and unchecked, the agent's GC settings; ~30-40 once).
Every new op must be read once; the rest is waste, and only the entries from the poll's cursor on are parsed
(parse_dump's from_record_id: the older ones are left out at the byte level, where the answer is laid out as torch
writes it: bench/commops.py's per-op figures in bench/README.md). With `max_interval_seconds` > 0 (the default,
20 s), the source checks every `interval_seconds` (1 s) and reads a process's ring only when it is due (`_due`,
sentinel mode). (It was opt-in for a while: a process read rarely, or only at its exit, gives its whole run in one
poll, ending with the collectives of its shutdown, and the step segmenter, which learns the step pattern from the
newest ops, found none; it now also learns from the newest ops but the last few, StepSegmenter._learn.)
  first          the process was just found (and the next check, for a second read that gives its op rate)
  ring_fill      about `ring_fill` (0.5) of its ring is new: op rate (record ids per second between its last
                 two reads) x time since the last read, or, where the bootstrap's anchor ring says how many
                 iterations ended since (one 8-byte read of its count), iterations x ops per iteration, the
                 larger; the ring size is the process's TORCH_FR_BUFFER_SIZE (/proc/PID/environ, else the
                 bootstrap's default 2000) until a wrapped dump shows it
  anchors_began  iterations began and the ops per iteration are not known yet
  max_interval   `max_interval_seconds` (20 s) since the last read: steps and summaries are never older
  stalled        the last read found nothing new with an op pending (a hang, or a long collective): re-read every
                 `stalled_interval_seconds` (5 s), so a hang's CommProgress keeps coming
  iterations_stopped  anchors were coming and stopped for max(2 s, 3 iteration times): read once, promptly
  fetch          the agent was asked for comm-op detail (FetchDetail: a trace, a diagnosis): every ring is read
                 first (Runner.refresh), so what is fetched is not up to max_interval_seconds old
Deep mode reads every ring at every check (`deep_interval_seconds`, 1 s), and `max_interval_seconds = 0` does so
in sentinel mode too (the tests that look at what one read gives). The 2-rank gloo job of bench/commops.py (~85
ops/s per rank, 2000-entry rings) is read every ~12 s instead of every 5 s. A ring that wraps between two reads
(a rate that jumped, faster than one ring per `ring_fill` x ring / rate, or than a check) loses its oldest
entries: counted (`lost_entries`), reported as flightrec_ring_wrapped with the count, and the measured rate
makes the next reads come sooner. python_gc_* metrics are read every `gc_interval_seconds` (5 s; in deep mode at every
check, `deep_interval_seconds`: a dive ranks the GC share of its window, which 1-2 points at 5 s left to chance, the
testbed's gc_storm fault named `compute` or `cpu-contention` in 5 of 6 runs), and with them the reads so far per
reason go out as Metric flightrec_ring_reads_total (entity <node>:<reason>, when it moved).
Cost: the source's thread runs at `nice` 19 (set on its own thread only), so parsing the dumps takes CPU the job
leaves idle before taking it from the job (the bootstrap can nice the job's worker server too,
STEPLENS_FR_SERVER_NICE, off by default: see there). bench/commops.py (2-core VM shared with other work;
bench/README.md has the table): the agent's CPU per running second fell from 63 to 41 ms and the job's worker-server
CPU from 22.6 to 8.2 ms/s, with no op lost; the toggled step-time cost did not fall with it (+8.8 % +- 2.8 before,
+8.3 % +- 2.5 after, the collector on the same VM unniced), far from the 0.1 % goal: what remains is per op
(convert, encode, store, summarize: every op must be handled once) and the collector's handling of what the agent
streams. With the schedule the default, orjson and the segmenter's bisection (bench/README.md, "Then"): agent 30-41
ms per running second, toggle +2.8 % to +7.7 % in three runs. Progress adds one pass over the parsed entries per
dump and, in a busy job (nearly always some op in flight), one ~80-byte record per group per poll: with 3 groups, 8
processes and 5 s polling, ~5 records/s per node.

GC time (the collector's `gc` cause): the bootstrap times every garbage collection of the process into a
128-byte file <pid>.gc in the same directory (layout, writer and torn-copy rule in steplens_bootstrap; written in
every bootstrapped process, also one that never opens a socket: a job without torch.distributed). Each step reads
it for every workload process that has one (the listing of socket_dirs that finds the sockets finds it), so at
this source's interval (5 s, 1 s in deep mode), and emits, entity pid:<pid>:<start_ticks>:
  python_gc_seconds_total (all generations), python_gc_collections_total, python_gc_gen2_seconds_total.
They restart with the process (a new entity). A file of another layout version, another process (start ticks
differ: a pid reused by a process without the bootstrap) or not one at all is reported once per process
(flightrec_bad_gc) and not read again until it is replaced; a copy torn three times is skipped for that poll. No
file (STEPLENS_GC=0, an older bootstrap): nothing. Cost: an open, two 128-byte preads and a close per process
per step (read_gc_file: ~2 us on the 2-core VM), and three Metrics.
"""

from __future__ import annotations

import glob
import json
import os
import re
import socket
import struct
import threading
import time
import types
from collections import Counter
from dataclasses import dataclass, field

from steplens.agent.commlog import (FUTURE_SLACK_NS, INT64_MAX, CommLog, RealtimeClock, dtype_bytes, normalize_op,
                                   time_problem)
from steplens.agent import fastjson
from steplens.agent.bootstrap import DEFAULT_FR_BUFFER_SIZE
from steplens.agent.records import CommOp, CommProgress, Event, Metric, Mode, ProcessInfo
from steplens.agent.pyframes.memory import ProcessChanged, ProcessGone, PyFramesError
from steplens.agent.sources import frmemory
from steplens.agent.sources.frmemory import FrMemoryUnavailable, RecorderMemory
from steplens.agent.sources.base import (Availability, ConfigError, Source, SourceConfig, glob_dirs,
                                         runtime_files)
from steplens.agent.transport.codec import record_problem

ENDPOINTS = ("fr_trace_json", "dump_nccl_trace_json")
RETIRE_GRACE_NS = 3_000_000_000   # a completed op the watchdog has not retired after this is emitted untimed
ANCHORS = "anchors"           # <pid>.anchors: the bootstrap's ring of iteration ends (steplens_anchors)
_ANCHOR_HEAD = struct.Struct("<8sIIQI")   # magic, version, slots, start ticks, clock (steplens_anchors' layout)
_ANCHOR_MAGIC, _ANCHOR_HEADER_BYTES, _ANCHOR_COUNT_AT = b"SLANCHR1", 64, 32
_ANCHOR_VERSION = 1
EXIT_SUFFIX = ".fr-exit.json"   # <pid>-<start ticks>.fr-exit.json, written by the bootstrap at exit
GC_SUFFIX = ".gc"               # <pid>.gc: the bootstrap's GC time counters (steplens_bootstrap's layout)
_GC_HEAD = struct.Struct("<8sIIQ")   # magic, version, file size, start ticks
_GC_BODY = struct.Struct("<7Q")      # collections of gen 0, 1, 2; ns in gen 0, 1, 2; end of the last
_GC_MAGIC, _GC_VERSION, _GC_SEQ_AT, _GC_BODY_AT = b"SLGCTIM1", 1, 24, 32
EXIT_GRACE_SECONDS = 120.0      # a gone process's cursor and info are kept this long, for its exit dump


@dataclass
class FlightrecConfig(SourceConfig):
    interval_seconds: float = 1.0                 # sentinel: how often rings are checked (read when due)
    deep_interval_seconds: float = 1.0            # deep mode: every ring read at every check
    # > 0: the Schedule (rings read when due, at least this often, checked every interval_seconds).
    # 0: every ring read at every interval (then set the interval to a few seconds: a read costs the whole ring)
    max_interval_seconds: float = 20.0
    ring_fill: float = 0.5                        # sentinel: a ring is read when about this share of it is new
    stalled_interval_seconds: float = 5.0         # an op pending and nothing new since the last read: re-read
    gc_interval_seconds: float = 5.0              # python_gc_* metrics this often
    nice: int = 19                                # this source's thread's nice value (0: left as it is)
    socket_dirs: list = field(default_factory=lambda: ["/run/steplens/fr", "/tmp/steplens-fr-*"])
    accepted_versions: list = field(default_factory=lambda: ["2.10"])  # Flight Recorder dump versions
    request_timeout_seconds: float = 2.0          # per request to one process
    retry_seconds: float = 30.0                   # re-try a process whose socket failed
    max_processes: int = 64                       # processes polled at most
    max_response_bytes: int = 64 * 1024 * 1024    # a larger answer is refused
    detail_max_records: int = 2_000_000           # node-local CommOp ring (detail.db)
    progress_every_seconds: float = 30.0          # CommProgress per group at least this often (see Progress)
    # "memory": each ring read from the process's memory (frmemory: costs the job nothing) where its torch has a
    # layout here and the checks pass, else through its socket; "socket": always through the socket
    read: str = "memory"
    # with read = "memory": also the workload processes launched without the bootstrap (no socket), from their
    # memory alone: no anchors, GC times or exit dump for them (the ops after the last read before exit are missed)
    without_bootstrap: bool = True

    def validate(self) -> None:
        super().validate()
        if not self.socket_dirs:
            raise ConfigError("socket_dirs must name at least one directory")
        if not self.accepted_versions:
            raise ConfigError("accepted_versions must not be empty")
        if not (0.01 <= self.request_timeout_seconds <= 60):
            raise ConfigError("request_timeout_seconds must be within 0.01..60")
        if self.retry_seconds < 0 or not (1 <= self.max_processes <= 4096):
            raise ConfigError("retry_seconds must be >= 0 and max_processes within 1..4096")
        if self.max_response_bytes < 4096 or self.detail_max_records < 1000:
            raise ConfigError("max_response_bytes must be >= 4096 and detail_max_records >= 1000")
        if not (0 < self.progress_every_seconds <= 86400):
            raise ConfigError("progress_every_seconds must be within 0..86400 (exclusive of 0)")
        if not (0 <= self.max_interval_seconds <= 3600) or not (0.05 <= self.ring_fill <= 1):
            raise ConfigError("max_interval_seconds must be within 0..3600 and ring_fill within 0.05..1")
        if self.stalled_interval_seconds < 0 or self.gc_interval_seconds < 0:
            raise ConfigError("stalled_interval_seconds and gc_interval_seconds must be >= 0")
        if not (0 <= self.nice <= 19):
            raise ConfigError("nice must be within 0..19")
        if self.read not in ("memory", "socket"):
            raise ConfigError(f"read must be \"memory\" or \"socket\", not {self.read!r}")


class FlightrecError(Exception):
    """A dump could not be had or read; `kind` names the failure for the Event."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def http_post_unix(path: str, handler: str, timeout_s: float = 2.0, max_bytes: int = 64 << 20) -> tuple[int, bytes]:
    """POST /handler/<handler> on the Unix socket at `path`: (status, body). Raises FlightrecError."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        try:
            s.connect(path)
        except ConnectionRefusedError:
            raise FlightrecError("refused", f"{path}: connection refused (stale socket?)") from None
        except FileNotFoundError:
            raise FlightrecError("gone", f"{path}: socket file vanished") from None
        except OSError as exc:
            raise FlightrecError("connect_failed", f"{path}: {exc}") from None
        req = (f"POST /handler/{handler} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n"
               "Connection: close\r\n\r\n").encode()
        chunks, total = [], 0
        try:
            s.sendall(req)
            while True:
                b = s.recv(1 << 16)
                if not b:
                    break
                chunks.append(b)
                total += len(b)
                if total > max_bytes:
                    raise FlightrecError("too_large", f"{path}: answer larger than {max_bytes} bytes")
        except (socket.timeout, TimeoutError):
            raise FlightrecError("timeout", f"{path}: no complete answer in {timeout_s}s") from None
        except OSError as exc:
            raise FlightrecError("io_error", f"{path}: {exc}") from None
    finally:
        s.close()
    data = b"".join(chunks)
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        raise FlightrecError("truncated", f"{path}: answer without HTTP header end ({len(data)} bytes)")
    lines = head.split(b"\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        raise FlightrecError("bad_answer", f"{path}: not HTTP: {lines[0][:80]!r}") from None
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:])}
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        body = _dechunk(body, path)
    elif b"content-length" in headers:
        want = int(headers[b"content-length"])
        if len(body) < want:
            raise FlightrecError("truncated", f"{path}: {len(body)} of {want} body bytes")
        body = body[:want]
    return status, body


def _dechunk(body: bytes, path: str) -> bytes:
    out, i = [], 0
    while True:
        j = body.find(b"\r\n", i)
        if j < 0:
            raise FlightrecError("truncated", f"{path}: chunked answer cut short")
        n = int(body[i:j].split(b";")[0], 16)
        if n == 0:
            return b"".join(out)
        out.append(body[j + 2:j + 2 + n])
        i = j + 2 + n + 2


@dataclass
class Dump:
    """One parsed Flight Recorder dump."""

    version: str
    entries: list
    members: dict          # pg name -> [global ranks]
    pg_sizes: dict         # pg name -> nranks
    status: dict = field(default_factory=dict)   # pg name -> (last enqueued, started, completed seq); -1 none
    status_malformed: int = 0                    # pg_status groups left out (a value not an int64 >= -1)
    ring_low: int = -1     # with entries left out (parse_dump's from_record_id): the ring's lowest record id

    def ring_span(self) -> tuple[int, int]:
        """(lowest record id, entries) of the whole ring the process answered with, (-1, 0) for none; also where
        parse_dump left the older entries out."""
        if self.ring_low >= 0:
            return self.ring_low, self.entries[-1]["record_id"] - self.ring_low + 1
        rids = [r for r in (e.get("record_id") for e in self.entries) if type(r) is int]
        return (min(rids), len(rids)) if rids else (-1, 0)


# torch's answer is nlohmann JSON, compact with its keys sorted (torch 2.11 NCCL in tests/fixtures/gpu-recorded,
# 2.13 gloo here): '{"comm_lib_version":..,"entries":[{"collective_seq_id":..,...,"record_id":N,"retired":..},...],
# "nccl_comm_state":...}'. Within JSON a quote inside a string is escaped, so these byte strings occur unescaped
# only as the keys themselves; "frames" objects inside an entry have neither key.
_ENTRIES_AT = b'"entries":['
_ENTRY_AT = b'{"collective_seq_id":'
_RID_AT = b'"record_id":'


def _leave_out_before(body: bytes, first: int) -> tuple[bytes, int] | None:
    """`body` without the entries older than record id `first`, and the ring's lowest record id; None where
    nothing is left out (the ring starts at or after `first`: also a wrapped ring, whose loss the full parse
    counts) or the bytes are not laid out as above (then the whole answer is parsed)."""
    i = body.find(_ENTRIES_AT)
    if i < 0:
        return None
    i += len(_ENTRIES_AT)
    j = body.find(_RID_AT, i)
    if j < 0:
        return None
    k = m = j + len(_RID_AT)
    while m < len(body) and 48 <= body[m] <= 57 and m - k < 19:
        m += 1
    if m == k or int(body[k:m]) >= first:
        return None
    p = body.find(b"%s%d," % (_RID_AT, first), j)
    s = body.rfind(_ENTRY_AT, i, p) if p > 0 else -1
    if s < 0:
        return None
    return body[:i] + body[s:], int(body[k:m])


def parse_dump(body: bytes | str | dict, accepted_versions=("2.10",), from_record_id: int = -1) -> Dump:
    """A fr_trace_json answer -> Dump; FlightrecError("bad_json" | "unknown_version" | "bad_layout").
    from_record_id > 0: the entries older than that record id are not needed (a poll's cursor: they were
    handled by an earlier poll) and, where the answer is laid out as torch writes it, not parsed: a poll reads
    the whole ring, of which usually half is new (the read schedule's ring_fill), and parsing is most of the
    source's cost (the part left out is not looked at, so not checked either). Dump.ring_span() still describes
    the whole ring."""
    ring_low = -1
    if isinstance(body, dict):
        doc = body
    else:
        if from_record_id > 0 and isinstance(body, bytes):
            cut = _leave_out_before(body, from_record_id)
            if cut is not None:
                try:
                    doc = fastjson.loads(cut[0])
                    ents = doc.get("entries") if isinstance(doc, dict) else None
                    if isinstance(ents, list) and ents and isinstance(ents[0], dict) \
                            and ents[0].get("record_id") == from_record_id \
                            and type(ents[-1].get("record_id")) is int:
                        ring_low = cut[1]
                except ValueError:
                    pass
        if ring_low < 0:
            try:
                doc = fastjson.loads(body)
            except ValueError as exc:
                raise FlightrecError("bad_json", f"not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise FlightrecError("bad_layout", f"top level is {type(doc).__name__}, not an object")
    version = str(doc.get("version", ""))
    if version not in accepted_versions:
        raise FlightrecError("unknown_version", f"Flight Recorder dump version {version!r} is not one of the "
                             f"verified versions {list(accepted_versions)}; skipped")
    entries = doc.get("entries", [])
    if not isinstance(entries, list):
        raise FlightrecError("bad_layout", "entries is not a list")
    members, sizes = {}, {}
    for name, cfg in (doc.get("pg_config") or {}).items():
        if not name or not isinstance(cfg, dict):
            continue
        ranks = cfg.get("ranks")
        if isinstance(ranks, str):
            try:
                ranks = json.loads(ranks)
            except ValueError:
                ranks = []
        if isinstance(ranks, list) and ranks and all(isinstance(r, int) for r in ranks):
            members[str(name)] = ranks
            sizes[str(name)] = len(ranks)
    status, malformed = {}, 0
    pg_status = doc.get("pg_status") or {}
    for name, st in (pg_status.items() if isinstance(pg_status, dict) else ()):
        try:  # torch 2.13 writes the numbers as strings
            seqs = tuple(int(st.get(f"last_{k}_collective", -1)) for k in ("enqueued", "started", "completed"))
        except (AttributeError, TypeError, ValueError):
            seqs = ()
        if seqs and all(-1 <= v <= INT64_MAX for v in seqs):
            status[str(name)] = seqs
        else:
            malformed += 1
    return Dump(version, [e for e in entries if isinstance(e, dict)], members, sizes, status, malformed, ring_low)


def read_anchor_ring(path: str, start_ticks: int, after: int) -> list[tuple[int, int]]:
    """[(number, realtime ns)] newer than `after` from a bootstrap anchor ring (steplens_anchors' layout and
    reading rule: a slot counts when it holds the number expected, and not when the writer may have reached it
    again while the file was read). FileNotFoundError when there is none; FlightrecError("bad_anchors")
    for another layout or another process's ring."""
    with open(path, "rb") as fh:
        data = fh.read(1 << 24)
        again = os.pread(fh.fileno(), 8, _ANCHOR_COUNT_AT)
    if len(data) < _ANCHOR_HEADER_BYTES or len(again) < 8:
        raise FlightrecError("bad_anchors", f"{path}: short file")
    magic, version, slots, ticks, clock = _ANCHOR_HEAD.unpack_from(data, 0)
    if magic != _ANCHOR_MAGIC:
        raise FlightrecError("bad_anchors", f"{path}: not an anchor ring (magic {magic!r})")
    if version != _ANCHOR_VERSION or clock != 1:
        raise FlightrecError("bad_anchors", f"{path}: anchor ring layout version {version} (clock {clock}); this "
                             f"agent reads version {_ANCHOR_VERSION} (clock 1, realtime) only: a newer bootstrap?")
    if len(data) < _ANCHOR_HEADER_BYTES + slots * 16:
        raise FlightrecError("bad_anchors", f"{path}: {len(data)} bytes, short for {slots} slots")
    if ticks != start_ticks:
        raise FlightrecError("bad_anchors", f"{path}: written by another process (start ticks {ticks}, not "
                             f"{start_ticks}: pid reused)")
    count = struct.unpack_from("<Q", data, _ANCHOR_COUNT_AT)[0]
    out = []
    for n in range(max(after + 1, struct.unpack("<Q", again)[0] - slots + 1, 0), count):
        num, ns = struct.unpack_from("<QQ", data, _ANCHOR_HEADER_BYTES + (n % slots) * 16)
        if num == n + 1:
            out.append((n, ns))
    return out


def read_gc_file(path: str, start_ticks: int) -> tuple[list[int], list[int]] | None:
    """(collections per generation 0-2, ns per generation) from a bootstrap GC counter file; None when the copy was
    torn three times (the writer was busy: the next poll reads it). FileNotFoundError when there is none;
    FlightrecError("bad_gc") for another layout or another process's file. steplens_bootstrap.read_gc's rule: take
    a copy whose sequence is even and unchanged when re-read after it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for _ in range(3):
            data = os.pread(fd, 128, 0)
            again = os.pread(fd, 8, _GC_SEQ_AT)
            if len(data) < _GC_BODY_AT + _GC_BODY.size:
                raise FlightrecError("bad_gc", f"{path}: short file ({len(data)} bytes)")
            magic, version, _, ticks = _GC_HEAD.unpack_from(data, 0)
            if magic != _GC_MAGIC:
                raise FlightrecError("bad_gc", f"{path}: not a GC counter file (magic {magic!r})")
            if version != _GC_VERSION:
                raise FlightrecError("bad_gc", f"{path}: GC counter layout version {version}; this agent reads "
                                     f"version {_GC_VERSION} only: a newer bootstrap?")
            if ticks != start_ticks:
                raise FlightrecError("bad_gc", f"{path}: written by another process (start ticks {ticks}, not "
                                     f"{start_ticks}: pid reused)")
            seq = data[_GC_SEQ_AT:_GC_SEQ_AT + 8]
            if seq == again and seq[0] % 2 == 0:
                v = _GC_BODY.unpack_from(data, _GC_BODY_AT)
                return list(v[:3]), list(v[3:6])
        return None
    finally:
        os.close(fd)


def header_anchors(doc) -> list[tuple[int, int]]:
    """The anchors of an exit dump's header ({"version": 1, "clock": "realtime", "anchors": [[n, ns], ...]});
    FlightrecError("bad_anchors") for anything else."""
    if not isinstance(doc, dict) or doc.get("version") != _ANCHOR_VERSION or doc.get("clock") != "realtime" or \
            not isinstance(doc.get("anchors"), list):
        version = doc.get("version") if isinstance(doc, dict) else None
        raise FlightrecError("bad_anchors", f"exit dump anchors: not a version {_ANCHOR_VERSION} realtime list "
                             f"(version {str(version)[:20]})")
    out = []
    for a in doc["anchors"]:
        if not (isinstance(a, list) and len(a) == 2 and all(type(x) is int and x >= 0 for x in a)):
            raise FlightrecError("bad_anchors", f"exit dump anchors: bad entry {str(a)[:80]}")
        out.append((a[0], a[1]))
    return sorted(out)


def entry_done(e: dict) -> bool:
    """The op itself is over (completed, or retired by the watchdog)."""
    return bool(e.get("retired")) or e.get("state") == "completed"


def entry_final(e: dict) -> bool:
    """The entry will not change any more: retired, where the build retires entries. A live NCCL job's dump
    (torch 2.11, recorded on an H100: tests/fixtures/gpu-recorded/fr-live-*) holds ops whose CUDA events already
    say "completed" but which the watchdog has not retired yet; those lack duration_ms, which retiring adds.
    An entry without the field (older layouts) is final when completed."""
    if "retired" in e:
        return bool(e["retired"])
    return e.get("state") == "completed"


_OP_NAMES: dict[str, str] = {}      # profiling name -> normalized op (normalize_op runs a regex)
_DTYPE_SIZES: dict[str, int] = {}   # dtype name -> bytes per element


def _op_name(name: str) -> str:
    op = _OP_NAMES.get(name)
    if op is None:
        op = normalize_op(name)
        if len(_OP_NAMES) < 4096:
            _OP_NAMES[name] = op
    return op


def _dtype_size(dtype: str) -> int:
    n = _DTYPE_SIZES.get(dtype)
    if n is None:
        n = dtype_bytes(dtype)
        if len(_DTYPE_SIZES) < 4096:
            _DTYPE_SIZES[dtype] = n
    return n


def entry_to_op(e: dict, dump: Dump, clock: RealtimeClock, pid: int, start_ticks: int = 0, rank: int = -1,
                world_size: int = -1, job_key: str = "") -> CommOp:
    """One Flight Recorder entry (layout 2.10) -> CommOp (OpConverter for many entries of one dump)."""
    return OpConverter(dump, clock, pid, start_ticks, rank, world_size, job_key)(e)


class OpConverter:
    """entry_to_op for the entries of one dump: what repeats from op to op (the group's comm id, description and
    members, this rank's place in it, the normalized op name, the dtype's size) is worked out once per distinct
    (process_group, profiling_name, dtype, is_p2p) and the clock's offset once (a dump is read in one go); per entry
    only its sizes, sequence numbers and times. bench/flightrec_ops.py ("convert"): 2.0 -> 1.6 us per op. An entry
    whose fields are not plain strings there takes the general path (the same result, nothing cached). Raises
    ValueError, TypeError or OverflowError for an entry with a field of the wrong type or size."""

    __slots__ = ("dump", "to_mono", "offset", "pid", "start_ticks", "rank", "world_size", "job_key", "_static")

    def __init__(self, dump: Dump, clock, pid: int, start_ticks: int = 0, rank: int = -1, world_size: int = -1,
                 job_key: str = "") -> None:
        self.dump, self.pid, self.start_ticks, self.rank = dump, pid, start_ticks, rank
        self.world_size, self.job_key = world_size, job_key
        # a RealtimeClock's offset is fixed between its refreshes (10 s): taken once here, not per entry
        self.offset = clock.offset_ns if isinstance(clock, RealtimeClock) else None
        self.to_mono = clock.to_mono
        self._static: dict[tuple, tuple] = {}

    def _group(self, pg, name: str, dtypes) -> tuple:
        """(comm_id, op, comm_desc, group_rank, nranks, members, dtype, dtype size), checked against the encoder's
        field types once (codec.record_problem on an op made of them): ValueError where it would refuse one."""
        if not isinstance(pg, (list, tuple)) or not isinstance(dtypes, (list, tuple)):
            raise TypeError(f"process_group {str(pg)[:40]} or dtypes {str(dtypes)[:40]} is not a list")
        pg_name = str(pg[0]) if pg else ""
        pg_desc = str(pg[1]) if len(pg) > 1 else ""
        dump, rank = self.dump, self.rank
        members = dump.members.get(pg_name, [])
        nranks = dump.pg_sizes.get(pg_name, 0)
        if not members and pg_name == "0" and self.world_size > 0:  # the default group is the world
            members, nranks = list(range(self.world_size)), self.world_size
        dtype = str(dtypes[0]) if dtypes else ""
        g = (f"pg:{pg_name}", _op_name(name), pg_desc, members.index(rank) if rank in members else -1, nranks,
             members[:], dtype, _dtype_size(dtype))
        why = record_problem(CommOp(0, "", self.pid, g[0], g[1], self.start_ticks, 0, -1, g[2], rank, g[3], g[4],
                                    g[5], dtype=dtype, job_key=self.job_key))
        if why is not None:
            raise ValueError(why)
        return g

    def __call__(self, e: dict) -> CommOp:
        get = e.get
        pg = get("process_group") or ["", ""]
        name = get("profiling_name", "")
        dtypes = get("input_dtypes") or get("output_dtypes") or []
        p2p = bool(get("is_p2p"))
        if type(pg) is list and len(pg) == 2 and type(pg[0]) is str and type(pg[1]) is str and type(name) is str \
                and type(dtypes) is list and (not dtypes or type(dtypes[0]) is str):
            key = (pg[0], pg[1], name, dtypes[0] if dtypes else "", p2p)
            g = self._static.get(key)
            if g is None:
                g = self._static[key] = self._group(pg, name, dtypes)
        else:
            g = self._group(pg, str(name), dtypes)
        comm_id, op, desc, group_rank, nranks, members, dtype, size = g
        count = 0
        for shape in get("input_sizes") or []:
            n = 1
            for d in shape:
                n *= int(d)
            count += n
        created = int(get("time_created_ns") or 0)
        issue = 0 if not created else created - self.offset if self.offset is not None else self.to_mono(created)
        start = end = 0
        timing = "cpu_enqueue"
        dur_ms = get("duration_ms")
        if isinstance(dur_ms, (int, float)) and dur_ms >= 0 and (issue or get("time_discovered_started_ns")):
            # duration_ms comes from the op's CUDA events and is exact; time_discovered_*_ns are when torch's
            # watchdog noticed the start/completion, which it polls: in a recorded H100 dump
            # (tests/fixtures/gpu-recorded) the seven ops of a step were all "discovered started" in one sweep
            # ~95 ms after they were enqueued and long after they ended. They only bound the op from above, so the
            # op is placed at its enqueue time (time_created_ns, a lower bound of its GPU start) with its measured
            # duration.
            start = issue or self.to_mono(int(e["time_discovered_started_ns"]))
            end = start + int(dur_ms * 1e6)
            timing = "cuda_event"
        seq = -1 if p2p else int(get("collective_seq_id", -1))
        p2p_seq = int(get("p2p_seq_id", -1)) if p2p else -1
        nbytes = count * size
        # the fields that vary per entry, in the encoder's ranges (the times: CommLog.add's time check); the rest
        # was checked with the group (_group), so the detail store need not check every field again (`checked`)
        if not (0 <= nbytes < _U64 and 0 <= count < _U64 and -_I64 <= seq < _I64 and -_I64 <= p2p_seq < _I64):
            raise ValueError(f"record_id {get('record_id')}: {count} elements of {nbytes} bytes, seq {seq}, p2p seq "
                             f"{p2p_seq}: out of the encoder's range")
        return CommOp(end or issue, timing, self.pid, comm_id, op, self.start_ticks, 0, -1, desc, self.rank,
                      group_rank, nranks, members, -1, -1, count, dtype, nbytes, seq, p2p_seq,
                      0, issue, start, end, self.job_key, "" if p2p else "trace")


_U64, _I64 = 1 << 64, 1 << 63


_P2P_RANKS = re.compile(r"\s+(\d+)\s*(?:->|<-)\s*(\d+)\s*$")   # NCCL's "nccl:send 0->1", "nccl:recv 1<-0"


def progress_records(dump: Dump, clock: RealtimeClock, mono_ns: int, pid: int, start_ticks: int = 0,
                     rank: int = -1, world_size: int = -1, job_key: str = "",
                     future_slack_ns: int = FUTURE_SLACK_NS) -> tuple[list[CommProgress], list[tuple[str, str]]]:
    """One CommProgress per process group of the dump's pg_status, as of mono_ns (when the dump was taken), and
    the problems met: (reason, detail) per pending op whose issue time is not one of this boot (DROP_REASONS
    keys; its pending_since is left 0) or whose sequence number is not an integer ("malformed"; no pending op
    is reported for that group)."""
    oldest: dict[str, dict] = {}
    done_high: dict[str, int] = {}   # group -> highest collective_seq_id of a done collective entry
    for e in dump.entries:
        rid = e.get("record_id")
        pg = e.get("process_group") or [""]
        name = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else ""
        if entry_done(e):
            seq = e.get("collective_seq_id")
            if not e.get("is_p2p") and type(seq) is int and seq > done_high.get(name, -1):
                done_high[name] = seq
            continue
        if not isinstance(rid, int):
            continue
        if name in dump.status and (name not in oldest or rid < oldest[name]["record_id"]):
            oldest[name] = e
    out, problems = [], []
    for name, (enq, started, done) in dump.status.items():
        # torch's gloo worker threads store last_completed_collective after the waiting caller has gone on, so
        # a slow thread can overwrite seq N with N-1 and leave it there until the next completion (seen on this
        # machine under CPU load: a rank blocked before seq N+1 read last_completed N-1 for 30 s while its
        # entry N was retired). The entries are the better witness: the higher of the two, never past enqueued.
        if done_high.get(name, -1) > done:
            done = min(done_high[name], enq) if enq >= 0 else done_high[name]
        members = dump.members.get(name, [])
        nranks = dump.pg_sizes.get(name, 0)
        if not members and name == "0" and world_size > 0:  # the default group is the world
            members, nranks = list(range(world_size)), world_size
        rec = CommProgress(mono_ns, pid, f"pg:{name}", start_ticks, job_key, rank, enq, started, done,
                           nranks=max(nranks, 0))
        e = oldest.get(name)
        if e is not None:
            p2p = bool(e.get("is_p2p"))
            try:
                seq = int(e.get("p2p_seq_id" if p2p else "collective_seq_id", -1))
                if not 0 <= seq <= INT64_MAX:
                    raise ValueError(f"sequence number {seq}")
            except (ValueError, TypeError, OverflowError) as exc:
                problems.append(("malformed", f"pg {name} record_id {e.get('record_id')}: {exc}"))
            else:
                pname = str(e.get("profiling_name", ""))
                m = _P2P_RANKS.search(pname)
                if m:
                    pname = pname[:m.start()]
                    peer = int(m.group(2))  # a rank of the group: global through the group's members
                    rec.pending_peer = members[peer] if peer < len(members) else -1
                rec.pending_op, rec.pending_seq, rec.pending_p2p = normalize_op(pname), seq, p2p
                created = e.get("time_created_ns") or 0
                since = clock.to_mono(created) if type(created) is int else created
                reason, detail = time_problem(types.SimpleNamespace(mono_ns=since), mono_ns, future_slack_ns)
                if reason:
                    problems.append((reason, f"pg {name} record_id {e.get('record_id')}: time_created_ns "
                                     f"{created!r} -> {detail}"))
                else:  # created just before the dump: the clock conversion's error may put it a little after
                    rec.pending_since_mono_ns = min(since, mono_ns)
        out.append(rec)
    return out, problems


class _Cursor:
    """Per-process, per-endpoint dedup state: the highest record_id seen and entries seen but not done."""

    __slots__ = ("high", "pending", "unretired")

    def __init__(self) -> None:
        self.high = -1
        self.pending: set[int] = set()
        self.unretired: dict[int, int] = {}   # record_id -> when first seen completed but not retired (mono ns)


def new_entries(dump: Dump, cur: _Cursor, final: bool = False, now_ns: int = 0,
                retire_grace_ns: int = RETIRE_GRACE_NS) -> tuple[list[dict], int]:
    """The entries of `dump` to emit now and how many were lost to the ring wrapping since the previous dump.
    Emitted: final entries (entry_final) not emitted before; an op completed but left unretired for longer than
    `retire_grace_ns` since first seen so (a stalled watchdog: emitted without its CUDA-event duration rather than
    never); with `final`, the process's last dump, every entry not emitted yet. Updates `cur`."""
    ents = sorted((e for e in dump.entries if isinstance(e.get("record_id"), int)), key=lambda e: e["record_id"])
    if not ents:
        return [], 0
    lowest = ents[0]["record_id"]
    lost = max(0, lowest - (cur.high + 1))
    gone_pending = {r for r in cur.pending if r < lowest}
    lost += len(gone_pending)
    cur.pending -= gone_pending
    for r in gone_pending:
        cur.unretired.pop(r, None)
    out = []
    for e in ents:
        rid = e["record_id"]
        if rid <= cur.high and rid not in cur.pending:
            continue
        ready = final or entry_final(e)
        if not ready and entry_done(e):
            since = cur.unretired.setdefault(rid, now_ns)
            ready = now_ns - since > retire_grace_ns
        if ready:
            out.append(e)
            cur.pending.discard(rid)
            cur.unretired.pop(rid, None)
        else:
            cur.pending.add(rid)
    cur.high = max(cur.high, ents[-1]["record_id"])
    return out, lost


def read_exit_dump(path: str, accepted_versions=("2.10",), max_bytes: int = 64 << 20) -> tuple[dict, Dump]:
    """An exit dump file: (header, Dump). The header has pid, start_ticks and env (the job's RANK, WORLD_SIZE,
    STEPLENS_JOB, ...). Raises FlightrecError."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise FlightrecError("io_error", f"{path}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise FlightrecError("too_large", f"{path}: larger than {max_bytes} bytes")
    head, sep, body = data.partition(b"\n")
    try:
        header = json.loads(head) if sep else None
    except ValueError:
        header = None
    if not isinstance(header, dict) or not isinstance(header.get("env", {}), dict):
        raise FlightrecError("bad_exit_dump", f"{path}: no header line")
    return header, parse_dump(body, accepted_versions)


def _exit_dump_key(name: str) -> tuple[int, int] | None:
    pid, dash, ticks = name[:-len(EXIT_SUFFIX)].partition("-")
    return (int(pid), int(ticks)) if dash and pid.isdigit() and ticks.isdigit() else None


class _Target:
    __slots__ = ("key", "path", "cursors", "missing", "info", "ring", "reads", "read_at", "read_mono_ns", "rate",
                 "stalled", "memory", "memory_why",
                 "high_at_read", "anchors_at_read", "anchor_count", "anchor_moved_at", "anchor_rate",
                 "ops_per_anchor", "pending")

    def __init__(self, key, path, info, ring: int = 0) -> None:
        self.key, self.path, self.info = key, path, info
        self.cursors = {ep: _Cursor() for ep in ENDPOINTS + (ANCHORS,)}  # anchors: .high = last number read
        self.missing: set[str] = set()  # endpoints this process does not serve
        self.memory: dict = {}          # endpoint -> its RecorderMemory; None: not readable so (memory_why)
        self.memory_why: dict = {}      # endpoint -> the FrMemoryUnavailable that says why
        # the read schedule (module docstring, Schedule); times in seconds of time.monotonic()
        self.ring = ring                # Flight Recorder entries the process keeps (its TORCH_FR_BUFFER_SIZE)
        self.reads = 0
        self.read_at = 0.0
        self.read_mono_ns = 0           # ... the same instant, the context's monotonic clock in ns (refresh())
        self.rate = -1.0                # entries recorded per second between the last two reads; -1: not known
        self.stalled = False            # the last read: nothing new and an op pending
        self.pending = False            # the last read: some group had an op enqueued and not completed
        self.high_at_read = -1          # the highest record id when last read
        self.anchors_at_read = -1       # anchors written when last read (the ring's count); -1: no ring
        self.anchor_count = -1          # ... when last checked
        self.anchor_moved_at = 0.0      # when the count last changed
        self.anchor_rate = 0.0          # anchors per second between the last two reads
        self.ops_per_anchor = -1.0      # entries per anchor between the last two reads; -1: not known


def _closed(tgt: _Target) -> _Target:
    """`tgt` with its memory readers closed (their /proc/PID/mem descriptors), to be opened again if it returns."""
    for reader in tgt.memory.values():
        if reader is not None:
            reader.close()
    tgt.memory, tgt.memory_why = {}, {}
    return tgt


class FlightrecSource(Source):
    governed = False   # its buffer or ring must be read at its interval (agent/governor.py)
    name = "flightrec"
    description = ("torch.distributed Flight Recorder entries (seq, pg, sizes) read from the workloads' memory, or "
                   "through the bootstrap's worker-server socket, and Python GC time from the bootstrap's <pid>.gc")
    config_class = FlightrecConfig

    @classmethod
    def probe(cls, ctx) -> Availability:
        layouts = sorted(os.path.basename(p)[6:-5] for p in glob.glob(os.path.join(frmemory.LAYOUT_DIR,
                                                                                    "torch-*.json")))
        return Availability.yes(f"reads the workloads' rings from their memory (torch {', '.join(layouts) or 'none'}"
                                f"; C decoder {'built' if frmemory._native() else 'not built'}), else through the "
                                "sockets of processes launched with the steplens bootstrap (steplens-agent env)")

    def start(self) -> None:
        self.log = CommLog(self.ctx.state_dir, self.name, self.config.detail_max_records,
                           monotonic_ns=self.ctx.mono_ns)
        self.clock = RealtimeClock(monotonic_ns=self.ctx.mono_ns)
        self.targets: dict[tuple[int, int], _Target] = {}
        self.failed: dict[tuple[int, int], float] = {}
        self.reported: set[tuple] = set()
        self.lost_entries = 0
        self.polls = 0
        self.gone: dict[tuple[int, int], tuple[_Target, float]] = {}  # left the workloads; cursor kept for exit dump
        self.known: dict[tuple[int, int], tuple[object, float]] = {}  # ProcessInfo of workloads, last seen
        self.finished: dict[tuple[int, int], float] = {}  # exit dump read: never polled again
        self.unremovable: set[str] = set()  # exit dumps read but not deletable here: never read again
        self.exit_dumps = 0
        self.entries_left_out = 0   # ring entries a poll did not parse (handled before: parse_dump's from_record_id)
        self.anchors_total = 0
        self.progress: dict[tuple[int, int], dict[str, tuple]] = {}  # per process, per comm: (last emitted, when)
        self.progress_total = 0
        self.gc_bad: dict[tuple[int, int], int] = {}  # a <pid>.gc reported bad: its inode, not read again
        self.reads: Counter = Counter()     # ring reads by why they were due (Schedule)
        self.reads_by_way: Counter = Counter()   # ... by how: "memory" (frmemory) or "socket" (the job's JSON)
        self.memory_read_errors = 0
        self.no_recorder: dict[tuple[int, int], float] = {}   # workloads without a recorder yet: next wait (s)
        self._refresh = False               # refresh(): read every ring at the next step
        self._reads_sent: dict[str, int] = {}
        self.checks = 0
        self.gc_at = -1e18
        self._renice()

    def _renice(self) -> None:
        """This source's thread to `nice` (module docstring, Cost): its work (a dump parsed, every new op
        converted and stored) then waits for CPU the job leaves idle rather than taking it from the job. Only on
        a thread of its own (the agent's runner), never the main thread of a program that runs the source
        directly (tests, tools)."""
        if not self.config.nice or threading.current_thread() is threading.main_thread():
            return
        try:
            tid = threading.get_native_id()
            if os.getpriority(os.PRIO_PROCESS, tid) < self.config.nice:
                os.setpriority(os.PRIO_PROCESS, tid, self.config.nice)
        except (OSError, AttributeError):
            pass

    def _ring_size(self, pid: int) -> int:
        """The process's TORCH_FR_BUFFER_SIZE from its environment, else the bootstrap's default (which the
        bootstrap sets inside the process, where /proc/PID/environ does not show it)."""
        try:
            with open(os.path.join(self.ctx.proc_root, str(pid), "environ"), "rb") as fh:
                env = fh.read(1 << 20)
        except OSError:
            env = b""
        for item in env.split(b"\0"):
            if item.startswith(b"TORCH_FR_BUFFER_SIZE="):
                value = item.partition(b"=")[2].strip()
                if value.isdigit() and int(value) > 0:
                    return int(value)
        return DEFAULT_FR_BUFFER_SIZE

    def _anchor_count(self, tgt: _Target) -> int:
        """Anchors the process has written so far (its anchor ring's count: one 8-byte read); -1 without a ring."""
        if ANCHORS in tgt.missing:
            return -1
        try:
            fd = os.open(os.path.join(os.path.dirname(tgt.path), f"{tgt.key[0]}.{ANCHORS}"), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return -1
        try:
            b = os.pread(fd, 8, _ANCHOR_COUNT_AT)
        except OSError:
            return -1
        finally:
            os.close(fd)
        return struct.unpack("<Q", b)[0] if len(b) == 8 else -1

    def _due(self, tgt: _Target, now: float) -> str:
        """Why the process's ring is to be read at this check, "" when it is not (module docstring, Schedule)."""
        cfg = self.config
        if not tgt.reads:
            return "first"
        if cfg.max_interval_seconds <= 0:
            return "every_check"
        since = now - tgt.read_at
        if since >= cfg.max_interval_seconds:
            return "max_interval"
        if tgt.stalled and since >= cfg.stalled_interval_seconds:
            return "stalled"
        recorded = self._recorded(tgt)
        if recorded >= 0:   # read from memory: how many are new is known, not estimated from a rate
            if recorded - (tgt.high_at_read + 1) >= cfg.ring_fill * tgt.ring:
                return "ring_fill"
            expect = 0.0
        elif tgt.rate < 0:
            return "rate_unknown"
        else:
            expect = tgt.rate * since
        count = self._anchor_count(tgt)
        if count >= 0:
            if count != tgt.anchor_count:
                tgt.anchor_count, tgt.anchor_moved_at = count, now
            new = count - tgt.anchors_at_read if tgt.anchors_at_read >= 0 else 0
            if new > 0 and tgt.ops_per_anchor < 0:
                return "anchors_began"      # iterations started: learn the ops per iteration
            expect = max(expect, new * tgt.ops_per_anchor)
            if tgt.anchor_rate > 0:         # iterations were coming and stopped: a hang's progress, promptly
                quiet = max(2.0, 3.0 / tgt.anchor_rate)
                if now - tgt.anchor_moved_at >= quiet and tgt.read_at < tgt.anchor_moved_at + quiet:
                    return "iterations_stopped"
        if expect >= cfg.ring_fill * tgt.ring:
            return "ring_fill"
        return ""

    def _recorded(self, tgt: _Target) -> int:
        """Entries the process has recorded so far (its recorder's next record id, one 8-byte read of its memory),
        where its ring is read from memory; -1 otherwise. A job that starts recording after the first reads, or
        changes its rate, is then read when its ring is about ring_fill new, not when an old rate says (a rate of 0
        measured before its first collective left a ring unread until max_interval_seconds: it wrapped)."""
        reader = tgt.memory.get(ENDPOINTS[0])
        if reader is None:
            return -1
        try:
            return reader.recorded()
        except (PyFramesError, FrMemoryUnavailable):
            return -1

    def _read_done(self, tgt: _Target, at: float) -> None:
        """After a read: the op rate, the anchors per op and whether the process looks stalled (Schedule)."""
        high = tgt.cursors[ENDPOINTS[0]].high
        count = self._anchor_count(tgt)
        if tgt.reads:
            dt = max(at - tgt.read_at, 1e-3)
            new = max(0, high - tgt.high_at_read)
            tgt.rate = new / dt
            if count >= 0 and tgt.anchors_at_read >= 0:
                anchors = count - tgt.anchors_at_read
                tgt.anchor_rate = max(0, anchors) / dt
                if anchors > 0:
                    tgt.ops_per_anchor = new / anchors
            tgt.stalled = new == 0 and tgt.pending
        if count != tgt.anchor_count:
            tgt.anchor_count, tgt.anchor_moved_at = count, at
        tgt.reads += 1
        tgt.read_at, tgt.high_at_read, tgt.anchors_at_read = at, high, count

    def refresh(self, until_mono_ns: int = 0, pids=None) -> bool:
        """Read every ring at the next step (Runner.refresh, before a FetchDetail of comm ops: with the Schedule a
        ring may be up to max_interval_seconds behind), unless the fetch's window ends (until_mono_ns, this host's
        monotonic clock; 0: open) before the last read of every ring it asks about (pids; None: all): then what
        is stored covers it and nothing is read (False). The collector's analysis fetches the ops of the steps it
        knows, which came from reads already made: each of those reading every ring again had made reads for
        fetches (90 in 240 s of bench/commops.py) outnumber the schedule's (8) and tripled the job's Flight
        Recorder server CPU."""
        if until_mono_ns > 0:
            targets = [t for k, t in list(self.targets.items()) if pids is None or k[0] in pids]
            if all(t.read_mono_ns >= until_mono_ns for t in targets):
                return False
        self._refresh = True
        return True

    def idle(self) -> bool:
        # no process polled and none waiting for its exit dump (EXIT_GRACE_SECONDS after it left the workloads)
        return not self.targets and not self.gone

    def _runtime_files(self) -> tuple[dict[int, str], dict[int, str]]:
        """The bootstrap's <pid>.sock and <pid>.gc files in socket_dirs, by pid (the first directory wins)."""
        found = runtime_files(self.config.socket_dirs, ("sock", "gc"))
        return found["sock"], found["gc"]

    def _report(self, out: list, key, kind: str, message: str, once: bool = True) -> None:
        if once:
            if (key, kind) in self.reported:
                return
            self.reported.add((key, kind))
        out.append(Event(self.ctx.mono_ns(), f"flightrec_{kind}", f"pid:{key[0]}:{key[1]}", message))

    def step(self) -> list:
        out: list = []
        now = time.monotonic()
        workloads = self.ctx.workloads.snapshot()
        sockets, gc_files = self._runtime_files()
        for key, info in workloads.items():
            self.known[key] = (info, now)
        for key in [k for k in self.targets if k not in workloads]:
            self.gone[key] = (_closed(self.targets.pop(key)), now)
        self.reported = {r for r in self.reported if r[0] in workloads}
        self.no_recorder = {k: v for k, v in self.no_recorder.items() if k in workloads}
        bare = self.config.read == "memory" and self.config.without_bootstrap
        for key, tgt in self.targets.items():   # a socket that appeared after the process was first read
            if not tgt.path and key[0] in sockets:
                tgt.path = sockets[key[0]]
                tgt.missing.discard(ANCHORS)
        for key, info in workloads.items():
            if key in self.targets or (key[0] not in sockets and not bare) or \
                    len(self.targets) >= self.config.max_processes:
                continue
            if now - self.failed.get(key, -1e18) < self.config.retry_seconds or key in self.finished:
                continue
            self.targets[key] = _Target(key, sockets.get(key[0], ""), info, self._ring_size(key[0]))
            if not self.targets[key].path:   # launched without the bootstrap: its memory only, no anchors
                self.targets[key].missing.add(ANCHORS)
            if key in self.gone:  # polled before: keep its cursors, or a retry would emit the ring again
                self.targets[key].cursors = self.gone.pop(key)[0].cursors
        ops: list[CommOp] = []
        deep = self.ctx.mode() is Mode.DEEP
        fetch, self._refresh = self._refresh, False
        self.checks += 1
        for key, tgt in list(self.targets.items()):
            why = "deep" if deep else "fetch" if fetch else self._due(tgt, now)
            if not why:
                continue
            self.reads[why] += 1
            try:
                at, at_ns = time.monotonic(), self.ctx.mono_ns()
                ops += self._poll(tgt, out)
                self._read_done(tgt, at)
                tgt.read_mono_ns = at_ns
            except FlightrecError as exc:
                self.gone[key] = (_closed(self.targets.pop(key)), now)
                if tgt.path and os.path.exists(os.path.join(os.path.dirname(tgt.path),
                                                            f"{key[0]}-{key[1]}{EXIT_SUFFIX}")):
                    continue  # a normal exit: its exit dump is read below
                if exc.kind == "no_recorder":
                    # a workload without torch's recorder, or not yet (procs may find it by its command line before
                    # it loads torch): quiet, not a ring read, and looked at again after 1, 2, 4 ... retry_seconds
                    self.reads[why] -= 1
                    if not self.reads[why]:
                        del self.reads[why]
                    wait = min(self.config.retry_seconds, 2 * self.no_recorder.get(key, 0.5))
                    self.no_recorder[key] = wait
                    self.failed[key] = now - self.config.retry_seconds + wait
                    continue
                gone = not os.path.exists(os.path.join(self.ctx.proc_root, str(key[0])))
                kind = "process_exited" if gone else exc.kind
                self._report(out, key, kind, str(exc) + (" (the process exited)" if gone else ""))
                self.failed[key] = now
        last = self._read_exit_dumps(out, now)
        for table in (self.gone, self.known):
            for key in [k for k, v in table.items() if now - v[1] > EXIT_GRACE_SECONDS]:
                del table[key]
        for key in [k for k, t in self.finished.items() if now - t > EXIT_GRACE_SECONDS and k not in workloads]:
            del self.finished[key]
        for key in [k for k in self.progress if k not in self.targets]:  # exited or failed: forget
            del self.progress[key]
        gc_every = self.config.gc_interval_seconds
        if deep:   # a deep window (6-10 s) holds 1-2 points at 5 s: its GC share was a guess (module docstring)
            gc_every = min(gc_every, self.config.deep_interval_seconds)
        if now - self.gc_at >= gc_every:
            self.gc_at = now
            self._gc_metrics(workloads, gc_files, out)
            mono = self.ctx.mono_ns()
            for why, n in sorted(self.reads.items()):   # what the reads cost is for (Schedule), per reason
                if n != self._reads_sent.get(why):
                    self._reads_sent[why] = n
                    out.append(Metric(mono, "flightrec_ring_reads_total", f"{self.ctx.node_id}:{why}", float(n)))
            for way, n in sorted(self.reads_by_way.items()):   # ... and how: from memory or through the job
                if n != self._reads_sent.get("way:" + way):
                    self._reads_sent["way:" + way] = n
                    out.append(Metric(mono, "flightrec_ring_reads_by_way_total", f"{self.ctx.node_id}:{way}",
                                      float(n)))
        self.polls += 1
        out += self.log.add(ops, checked=True)   # OpConverter's: in the encoder's ranges, times aside
        out += self.log.add(last, final=True, checked=True)   # the processes' last ops: may end with their shutdown's
        return out

    def _gc_metrics(self, workloads: dict, files: dict[int, str], out: list) -> None:
        """python_gc_* of each workload process with a <pid>.gc (see the module docstring, GC time)."""
        for key in [k for k in self.gc_bad if k not in workloads]:
            del self.gc_bad[key]
        for key in workloads:
            path = files.get(key[0])
            if path is None:
                continue
            if key in self.gc_bad:
                try:
                    if os.stat(path).st_ino == self.gc_bad[key]:
                        continue  # the file reported: left alone until another replaces it
                except OSError:
                    continue
            try:
                got = read_gc_file(path, key[1])
            except FileNotFoundError:
                continue  # the process exited since the listing
            except (OSError, FlightrecError) as exc:
                try:
                    self.gc_bad[key] = os.stat(path).st_ino
                except OSError:
                    continue
                self._report(out, key, "bad_gc", f"{exc}; no python_gc metrics for it")
                continue
            if got is None:
                continue  # torn three times: the next poll
            counts, ns = got
            now, entity = self.ctx.mono_ns(), f"pid:{key[0]}:{key[1]}"
            out.append(Metric(now, "python_gc_seconds_total", entity, sum(ns) / 1e9))
            out.append(Metric(now, "python_gc_collections_total", entity, float(sum(counts))))
            out.append(Metric(now, "python_gc_gen2_seconds_total", entity, ns[2] / 1e9))

    def _read_exit_dumps(self, out: list, now: float) -> list[CommOp]:
        """CommOps from the exit dumps present (see the module docstring); each file is deleted once read."""
        ops: list[CommOp] = []
        for pattern in self.config.socket_dirs:
            for d in glob_dirs(pattern):
                try:
                    names = [n for n in os.listdir(d) if n.endswith(EXIT_SUFFIX)]
                except OSError:
                    continue
                for name in names:
                    key = _exit_dump_key(name)
                    path = os.path.join(d, name)
                    if key is None or path in self.unremovable:
                        continue
                    try:
                        header, dump = read_exit_dump(path, self.config.accepted_versions,
                                                      self.config.max_response_bytes)
                    except FlightrecError as exc:
                        self._report(out, key, exc.kind, f"exit dump {exc}", once=False)
                    else:
                        ops += self._exit_ops(key, header, dump, path, out)
                    finally:
                        self.finished[key] = now
                        self.targets.pop(key, None)
                        try:
                            os.unlink(path)
                        except OSError as exc:  # another user's directory: the bootstrap removes it after an hour
                            if len(self.unremovable) < 100_000:
                                self.unremovable.add(path)
                            self._report(out, key, "exit_dump_not_removed", f"{path}: {exc.strerror or exc}")
        return ops

    def _exit_ops(self, key: tuple[int, int], header: dict, dump: Dump, path: str, out: list) -> list[CommOp]:
        tgt = self.targets.get(key) or self.gone.pop(key, (None, 0.0))[0]
        info = tgt.info if tgt is not None else self.known.get(key, (None, 0.0))[0]
        if info is None:  # never seen alive: what the process said about itself
            from steplens.agent.sources.procs import job_key_from_env
            env = {k: str(v) for k, v in header.get("env", {}).items()}

            def num(name: str) -> int:
                return int(env[name]) if env.get(name, "").lstrip("-").isdigit() else -1
            info = ProcessInfo(0, key[0], key[1], rank=num("RANK"), world_size=num("WORLD_SIZE"),
                               job_key=job_key_from_env(env))
        if "anchors" in header:
            try:
                self._anchors(key, header_anchors(header["anchors"]),
                              tgt.cursors[ANCHORS] if tgt is not None else _Cursor())
            except FlightrecError as exc:
                self._report(out, key, exc.kind, f"{path}: {exc}")
        entries, lost = new_entries(dump, tgt.cursors[ENDPOINTS[0]] if tgt is not None else _Cursor(), final=True)
        if lost:
            self.lost_entries += lost
            self._report(out, key, "ring_wrapped", f"{lost} Flight Recorder entries were overwritten before they "
                         "were read (raise TORCH_FR_BUFFER_SIZE or poll more often)", once=False)
            out[-1].value = float(lost)
        self.exit_dumps += 1
        ops = []
        conv = OpConverter(dump, self.clock, key[0], key[1], info.rank, info.world_size, info.job_key)
        for e in entries:
            try:
                ops.append(conv(e))
            except (ValueError, TypeError, OverflowError) as exc:
                self.errors += 1
                self._report(out, key, "entries_malformed", f"{path}: record_id {e.get('record_id')}: "
                             f"{type(exc).__name__}: {exc}")
        return ops

    def _poll(self, tgt: _Target, out: list) -> list[CommOp]:
        info = tgt.info
        ops: list[CommOp] = []
        progress: dict[str, CommProgress] = {}
        for ep in ENDPOINTS:
            if ep in tgt.missing:
                continue
            cur = tgt.cursors[ep]
            first = min(cur.pending) if cur.pending else cur.high + 1
            dump = self._read_memory(tgt, ep, first, out)
            if dump is not None:
                taken = self.ctx.mono_ns()
                self.reads_by_way["memory"] += 1
                tgt.ring = tgt.memory[ep].max_entries or tgt.ring
                if dump.version not in self.config.accepted_versions:   # the layout's, as a dump would say
                    self._report(out, tgt.key, "unknown_version", f"pid {tgt.key[0]} {ep} (memory): Flight "
                                 f"Recorder layout version {dump.version!r} is not one of the verified versions "
                                 f"{list(self.config.accepted_versions)}; skipped")
                    continue
            elif not tgt.path:   # no socket to fall back on
                why = tgt.memory_why.get(ep)
                if ep != ENDPOINTS[0]:
                    tgt.missing.add(ep)
                    continue
                raise FlightrecError("no_recorder" if why is not None and why.kind == "no_library" else
                                     "memory_unavailable", f"pid {tgt.key[0]} (no bootstrap socket): {why}")
            else:
                status, body = http_post_unix(tgt.path, ep, self.config.request_timeout_seconds,
                                              self.config.max_response_bytes)
                taken = self.ctx.mono_ns()
                if status == 404 or (status >= 400 and ep != ENDPOINTS[0]):
                    tgt.missing.add(ep)  # e.g. dump_nccl_trace_json on a CPU build
                    continue
                if status != 200:
                    raise FlightrecError("http_error", f"{tgt.path}: {ep} answered HTTP {status}: {body[:200]!r}")
                self.reads_by_way["socket"] += 1
                why = tgt.memory_why.pop(ep, None)
                if why is not None:   # the job builds this ring's JSON at every read: say why not from memory
                    self._report(out, tgt.key, "read_from_socket", f"{tgt.path} {ep}: read through the socket, "
                                 f"not from the process's memory: {why}")
                try:
                    dump = parse_dump(body, self.config.accepted_versions, first)
                except FlightrecError as exc:
                    if exc.kind == "unknown_version":
                        self._report(out, tgt.key, exc.kind, f"{tgt.path} {ep}: {exc}")
                        continue
                    raise
            if dump.ring_low >= 0:
                self.entries_left_out += max(0, first - dump.ring_low)
            self._progress_of(tgt, ep, dump, taken, progress, out)
            if ep == ENDPOINTS[0]:
                low, n = dump.ring_span()
                if n and (low > 0 or n > tgt.ring):  # wrapped, or larger than assumed
                    tgt.ring = n
                tgt.pending = any(enq > done for enq, _, done in dump.status.values())
            entries, lost = new_entries(dump, tgt.cursors[ep], now_ns=taken)
            if lost:
                self.lost_entries += lost
                self._report(out, tgt.key, "ring_wrapped", f"{lost} Flight Recorder entries were overwritten "
                             "before they were read (raise TORCH_FR_BUFFER_SIZE or poll more often)", once=False)
                out[-1].value = float(lost)
            malformed, first = 0, ""
            conv = OpConverter(dump, self.clock, tgt.key[0], tgt.key[1], info.rank, info.world_size, info.job_key)
            for e in entries:
                try:
                    ops.append(conv(e))
                except (ValueError, TypeError, OverflowError) as exc:  # a field of the wrong type or size
                    malformed += 1
                    first = first or f"record_id {e.get('record_id')}: {type(exc).__name__}: {exc}"
            if malformed:
                self.errors += 1
                self._report(out, tgt.key, "entries_malformed", f"{tgt.path} {ep}: {malformed} entries skipped "
                             f"(first: {first})", once=False)
                out[-1].value = float(malformed)
        if ANCHORS not in tgt.missing:  # after the dump: it covers every op the dump holds
            path = os.path.join(os.path.dirname(tgt.path), f"{tgt.key[0]}.{ANCHORS}")
            try:
                self._anchors(tgt.key, read_anchor_ring(path, tgt.key[1], tgt.cursors[ANCHORS].high),
                              tgt.cursors[ANCHORS])
            except FileNotFoundError:
                tgt.missing.add(ANCHORS)  # a bootstrap without anchors: steps end at the ops
            except (OSError, FlightrecError) as exc:
                tgt.missing.add(ANCHORS)
                self._report(out, tgt.key, "bad_anchors", f"{exc}; steps end at the last op")
        self._emit_progress(tgt.key, progress.values(), out)
        return ops

    def _read_memory(self, tgt: _Target, ep: str, first: int, out: list):
        """The Dump of `ep`'s recorder read from the process's memory (frmemory) from record id `first` on, or None:
        `read` is "socket", or this process's recorder cannot be read so (why kept in tgt.memory_why, reported
        once the socket answers instead). Raises FlightrecError where the process went away mid-read."""
        if self.config.read != "memory" or tgt.memory.get(ep, 0) is None:
            return None
        reader = tgt.memory.get(ep)
        for attempt in (1, 2):
            try:
                if reader is None:
                    reader = tgt.memory[ep] = RecorderMemory(tgt.key[0], ep, self.ctx.proc_root)
                return reader.read(first)
            except FrMemoryUnavailable as exc:
                tgt.memory[ep] = None
                tgt.memory_why[ep] = exc
                if reader is not None:
                    reader.close()
                return None
            except (ProcessGone, ProcessChanged) as exc:
                raise FlightrecError("read_failed", f"pid {tgt.key[0]}: {exc}") from None
            except PyFramesError as exc:
                # an address that was unmapped as we read it (the entries' vector grew while the ring filled):
                # once more, then through the socket this time
                self.memory_read_errors += 1
                if attempt == 2:
                    self._report(out, tgt.key, "memory_read_failed", f"pid {tgt.key[0]} {ep}: {exc}; read through "
                                 "the socket this time", once=False)
        return None

    def _progress_of(self, tgt: _Target, ep: str, dump: Dump, taken: int, progress: dict, out: list) -> None:
        """The dump's CommProgress per group into `progress` (a group in both dumps keeps the one further on)."""
        info = tgt.info
        if not info.job_key:  # the collector keeps progress per job: refused without one
            return
        recs, problems = progress_records(dump, self.clock, taken, tgt.key[0], tgt.key[1], info.rank,
                                          info.world_size, info.job_key, self.log.future_slack_ns)
        for rec in recs:
            old = progress.get(rec.comm_id)
            if old is None or (rec.last_enqueued, rec.last_completed) > (old.last_enqueued, old.last_completed):
                progress[rec.comm_id] = rec
        if dump.status_malformed:
            problems.append(("malformed", f"{dump.status_malformed} pg_status group(s) with a non-integer value"))
        for reason, detail in problems:
            if reason == "malformed":
                self.errors += 1
                self._report(out, tgt.key, "entries_malformed", f"{tgt.path} {ep}: progress: {detail}")
            else:  # as CommLog counts times that are not of this boot; only the time is left out here
                self.log.rejected[reason] += 1
                self._report(out, tgt.key, "progress_time_dropped", f"{tgt.path} {ep}: pending op's issue time "
                             f"{reason} ({detail}); its pending_since is left 0")

    def _emit_progress(self, key: tuple[int, int], recs, out: list) -> None:
        """The emit rule (module docstring, Progress): on a change, every poll while an op is pending, and at least
        every progress_every_seconds."""
        state = self.progress.setdefault(key, {})
        every = int(self.config.progress_every_seconds * 1e9)
        for rec in recs:
            sig = (rec.last_enqueued, rec.last_started, rec.last_completed, rec.pending_op, rec.pending_seq,
                   rec.pending_p2p, rec.pending_peer)
            prev = state.get(rec.comm_id)
            if prev is None or prev[0] != sig or rec.pending_op or rec.mono_ns - prev[1] >= every:
                state[rec.comm_id] = (sig, rec.mono_ns)
                out.append(rec)
                self.progress_total += 1

    def _anchors(self, key: tuple[int, int], anchors: list[tuple[int, int]], cur: _Cursor) -> None:
        """New optimizer-step ends (by sequence number) to the segmenter, on this boot's monotonic clock."""
        fresh = [t for seq, t in anchors if seq > cur.high]
        if anchors:
            cur.high = max(cur.high, anchors[-1][0])
        mono = [m for m in (self.clock.to_mono(t) for t in fresh) if m > 0]  # not of this boot: left out
        if mono:
            self.anchors_total += len(mono)
            self.log.segmenter.add_anchors(key[0], key[1], mono)

    def stop(self) -> None:
        for tgt in list(getattr(self, "targets", {}).values()):
            _closed(tgt)
        log = getattr(self, "log", None)
        if log is not None:
            self.log = None
            log.close()
