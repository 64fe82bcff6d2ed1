"""steplens: the operators' CLI, a thin layer over the collector's Control API.

Every listing takes --json and prints one JSON document; errors go to stderr, exit non-zero. The listings in
WATCHABLE also take --watch [SECONDS] (cliout.watch: the listing again and again; Ctrl-C ends it with 0), long
calls show a progress line on stderr at a terminal (cliout.Progress), tables fit the terminal (cliout.fit_widths)
and `steplens completion SHELL` prints a completion script walked from build_parser() (steplens.completion).
`import flows` reads its file twice with bounded memory (FlowFile: a pass that validates every row and keeps
none, then one that sends chunks of 20,000 rows, the next parsed while the collector stores the last): ~3 µs a
JSON-lines row a pass on this 2-core machine, about 10 MiB over the interpreter's; the import is then bound by
the collector's writes (700k rows of `python -m steplens.sim.cluster --window 20`: 12 s end to end, was 22 s).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Iterator

# gRPC's core logs failed handshakes at INFO on stderr ("I1124 ... Handshake failed ..."); the CLI says what
# went wrong itself (conn.explain_unreachable), so only gRPC's errors get through. Read when grpc loads.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc  # noqa: E402

from steplens import cliout, completion, conn, stackfmt
from steplens.collector.cli import diagnosis
from steplens.collector.cli.serve import parse_duration
from steplens.v1 import control_pb2 as cpb
from steplens.v1 import control_pb2_grpc as cgrpc

EXIT_RPC = 1
EXIT_USAGE = 2


def _ago(ns: int) -> str:
    if not ns:
        return "-"
    s = max(0.0, (time.time_ns() - ns) / 1e9)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.1f}h ago"


def _table(rows: list[list], header: list[str], free: tuple[str, ...] = (), columns: int | None = None) -> str:
    """Rows under a header, columns padded to their widest cell. To fit `columns` characters (by default the
    terminal's width when stdout is one; 0: do not fit) the `free` columns (header names: free text such as a
    summary or a command line) are narrowed, widest first, and their cells cut with an ellipsis; key columns
    (ids, nodes, ranks) and figures are never cut. Piped, rows are printed whole."""
    header, rows = list(header), [list(map(str, r)) for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    columns = cliout.output_columns() if columns is None else columns
    if columns:
        fitted = cliout.fit_widths(widths, [i for i, h in enumerate(header) if h in free], columns)
        if fitted != widths:
            widths = fitted
            header = [cliout.ellipsize(h, w) for h, w in zip(header, widths)]
            rows = [[cliout.ellipsize(x, w) for x, w in zip(r, widths)] for r in rows]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header)] + [fmt.format(*r) for r in rows])


def _fit_line(prefix: str, middle: str, suffix: str) -> str:
    """prefix + middle + suffix, the middle (free text: a stack's call chain) cut to fit a terminal's width."""
    columns = cliout.output_columns()
    if columns:
        middle = cliout.ellipsize(middle, max(columns - len(prefix) - len(suffix), 12))
    return prefix + middle + suffix


def _us(ns: int) -> str:
    return f"{ns / 1e3:.0f}µs" if abs(ns) < 10**7 else f"{ns / 1e6:.1f}ms"


def _cpu(n: dict) -> str:
    """The agent's own CPU (% of a core), its governor's budget, and its costliest source with its rate scale."""
    text = f"{100 * n['agent_cpu_cores']:.1f}%"
    if n["cpu_budget_cores"]:
        text += f" (≤{100 * n['cpu_budget_cores']:.1f}%)"
    top = max(n["sources"].items(), key=lambda kv: kv[1]["cpu_cores"], default=None)
    if top and top[1]["cpu_cores"] > 0:
        text += f"; {top[0]} {100 * top[1]['cpu_cores']:.1f}%" + (f" x{top[1]['rate_scale']:.2f}"
                                                                   if top[1]["rate_scale"] < 1 else "")
    return text


def cmd_nodes(stub, args) -> int:
    reply = stub.ListNodes(cpb.ListRequest(node_id=args.node or ""), timeout=args.timeout)
    nodes = []
    for n in reply.nodes:
        nodes.append({
            "node_id": n.node_id, "hostname": n.hostname, "agent_version": n.agent_version, "connected": n.connected,
            "last_seen_ns": n.last_seen_ns, "clock_offset_ns": n.clock_offset_ns,
            "clock_uncertainty_ns": n.clock_uncertainty_ns, "clock_drift_ppm": n.clock_drift_ppm,
            "clock_rtt_ns": n.clock_rtt_ns,
            "sources": {s.name: {"up": s.up, "reason": s.reason, "last_duration_seconds": s.last_duration_seconds,
                                 "errors": s.errors, "cpu_cores": s.cpu_cores, "rate_scale": s.rate_scale}
                        for s in n.sources},
            "spool_backlog": n.spool_backlog, "records_produced": n.records_produced,
            "records_acked": n.records_acked, "records_dropped": n.records_dropped,
            "records_stored": n.records_stored, "records_rejected": n.records_rejected,
            "batches_stored": n.batches_stored, "batches_duplicate": n.batches_duplicate, "gaps": n.gaps,
            "mode": n.mode, "mode_until_ns": n.mode_until_ns, "agent_cpu_cores": n.agent_cpu_cores,
            "cpu_budget_cores": n.cpu_budget_cores, "collector": n.collector})
    if args.json:
        print(json.dumps(nodes, indent=2))
        return 0
    rows = []
    for n in nodes:
        up = [k for k, s in n["sources"].items() if s["up"]]
        down = [f"{k}({s['reason']})" for k, s in n["sources"].items() if not s["up"]]
        conn = ("yes" if n["connected"] else "no") + (f" (on {n['collector']})" if n["collector"] else "")
        rows.append([n["node_id"], conn, _ago(n["last_seen_ns"]),
                     f"±{_us(n['clock_uncertainty_ns'])}", ",".join(up) or "-", "; ".join(down) or "-",
                     n["spool_backlog"], n["records_produced"], n["records_stored"], n["records_dropped"],
                     n["records_rejected"], n["gaps"], n["mode"], _cpu(n)])
    print(_table(rows, ["NODE", "CONN", "LAST SEEN", "CLOCK", "UP", "DOWN (why)", "BACKLOG", "PRODUCED", "STORED",
                        "DROPPED", "REJECTED", "GAPS", "MODE", "AGENT CPU (budget; costliest, scale)"],
                 free=("UP", "DOWN (why)", "AGENT CPU (budget; costliest, scale)")))
    return 0


_GPU_COLS = [("gpu_utilization_percent", "UTIL%"), ("gpu_memory_used_bytes", "MEM USED"),
             ("gpu_sm_clock_mhz", "SM MHz"), ("gpu_temperature_celsius", "TEMP C"), ("gpu_power_watts", "POWER W")]


def cmd_gpus(stub, args) -> int:
    reply = stub.ListGpus(cpb.ListRequest(node_id=args.node or ""), timeout=args.timeout)
    gpus = [{"node_id": g.node_id, "index": g.index, "uuid": g.uuid, "name": g.name, "pci_bus_id": g.pci_bus_id,
             "memory_total_bytes": g.memory_total_bytes, "driver_version": g.driver_version,
             "last_seen_ns": g.last_seen_ns,
             "latest": {m.name: {"value": m.value, "ts_ns": m.ts_ns} for m in g.latest}} for g in reply.gpus]
    if args.json:
        print(json.dumps(gpus, indent=2))
        return 0
    if not gpus:
        print("no GPUs reported (hosts without NVML show the reason under `steplens nodes`)")
        return 0
    rows = []
    for g in gpus:
        vals = [g["latest"].get(k, {}).get("value") for k, _ in _GPU_COLS]
        rows.append([g["node_id"], g["index"], g["name"], g["uuid"][:16]] +
                    ["-" if v is None else f"{v:.0f}" if i != 1 else f"{v / 2**30:.1f}G" for i, v in enumerate(vals)] +
                    [_ago(max((m["ts_ns"] for m in g["latest"].values()), default=0))])
    print(_table(rows, ["NODE", "GPU", "MODEL", "UUID"] + [h for _, h in _GPU_COLS] + ["UPDATED"], free=("MODEL",)))
    return 0


def cmd_procs(stub, args) -> int:
    reply = stub.ListProcs(cpb.ListRequest(node_id=args.node or "", alive_only=not args.all), timeout=args.timeout)
    procs = [{"node_id": p.node_id, "pid": p.pid, "start_ticks": p.start_ticks, "exe": p.exe, "cmdline": p.cmdline,
              "framework": p.framework, "job_key": p.job_key, "rank": p.rank, "local_rank": p.local_rank,
              "world_size": p.world_size, "master_addr": p.master_addr, "master_port": p.master_port,
              "started_ns": p.started_ns, "exited_ns": p.exited_ns, "alive": p.alive, "cpu_percent": p.cpu_percent,
              "rss_bytes": p.rss_bytes, "threads": p.threads} for p in reply.procs]
    if args.json:
        print(json.dumps(procs, indent=2))
        return 0
    rows = [[p["job_key"], p["rank"] if p["rank"] >= 0 else "-", p["world_size"] if p["world_size"] >= 0 else "-",
             p["node_id"], p["pid"], p["framework"], f"{p['cpu_percent']:.0f}", f"{p['rss_bytes'] / 2**20:.0f}M",
             p["threads"], "alive" if p["alive"] else "exited", p["cmdline"][:60]] for p in procs]
    print(_table(rows, ["JOB", "RANK", "WORLD", "NODE", "PID", "FRAMEWORK", "CPU%", "RSS", "THR", "STATE", "CMD"],
                 free=("FRAMEWORK", "CMD")))
    return 0


def cmd_gaps(stub, args) -> int:
    reply = stub.ListGaps(cpb.ListRequest(node_id=args.node or ""), timeout=args.timeout)
    gaps = [{"node_id": g.node_id, "ts_ns": g.ts_ns, "dropped_records": g.dropped_records,
             "dropped_batches": g.dropped_batches, "first_seq": g.first_seq, "last_seq": g.last_seq,
             "reason": g.reason} for g in reply.gaps]
    if args.json:
        print(json.dumps(gaps, indent=2))
        return 0
    rows = [[g["node_id"], _ago(g["ts_ns"]), g["dropped_records"], g["dropped_batches"],
             f"{g['first_seq']}-{g['last_seq']}", g["reason"]] for g in gaps]
    print(_table(rows, ["NODE", "WHEN", "RECORDS LOST", "BATCHES", "SEQS", "REASON"], free=("REASON",)) if rows
          else "no gaps: nothing lost")
    return 0


def cmd_stacks(stub, args) -> int:
    since = time.time_ns() - int(parse_duration(args.since) * 1e9) if args.since else 0
    reply = stub.ListStacks(cpb.ListRequest(node_id=args.node or "", pid=args.pid or 0, since_ns=since,
                                            limit=args.limit), timeout=args.timeout)
    rows = [{"node_id": s.node_id, "pid": s.pid, "start_ticks": s.start_ticks, "tid": s.tid,
             "thread_name": s.thread_name, "python": s.python, "start_ns": s.start_ns, "end_ns": s.end_ns,
             "samples": s.samples, "errors": s.errors, "last_state": s.last_state,
             "stacks": json.loads(s.stacks_json or "[]")} for s in reply.stacks]
    if args.json:
        print(json.dumps(rows, indent=2, ensure_ascii=False))
        return 0
    if not rows:
        print("no stack summaries (is the pystacks source up? see `steplens nodes`)")
        return 0
    for r in rows:
        print(f"{r['node_id']} pid {r['pid']} thread {r['tid']} \"{r['thread_name']}\" (python {r['python']}, "
              f"{r['samples']} samples, last {r['last_state']}, {_ago(r['end_ns'])})")
        for s in r["stacks"][:args.top]:
            pct = 100.0 * s["count"] / max(r["samples"], 1)
            if not s["frames"]:  # a thread state running no Python code: see steplens.stackfmt
                print(f"  {pct:5.1f}%  gil {s['gil']:>4}  {stackfmt.NO_PYTHON_FRAME}  ({stackfmt.NO_PYTHON_FRAME_WHY})")
                continue
            inner = s["frames"][0]
            where = " <- ".join(f[1] for f in s["frames"][:6])
            print(_fit_line(f"  {pct:5.1f}%  gil {s['gil']:>4}  ", where,
                            f"  {stackfmt.location(inner[2], inner[3])}".rstrip()))
    return 0


def cmd_flows(stub, args) -> int:
    since = time.time_ns() - int(parse_duration(args.since) * 1e9) if args.since else 0
    reply = stub.ListFlows(cpb.FlowQuery(since_ns=since, by=args.by, node_id=args.node or "", limit=args.limit),
                           timeout=args.timeout)
    rows = []
    for f in reply.flows:
        row = {"src": f.src, "dst": f.dst, "bytes": f.bytes, "flows": f.flows, "packets": f.packets,
               "first_ns": f.start_ns, "last_ns": f.end_ns, "origin": f.origin}
        if args.by == "connection":
            row.update(sport=f.sport, dport=f.dport)
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no flows (is the netflows source up on the agents? see `steplens nodes`; it leaves out loopback "
              "traffic, ranks of one host talking over lo, unless [sources.netflows] include_loopback = true)")
        return 0
    head = ["SRC", "DST"] if args.by == "pair" else ["SRC", "SPORT", "DST", "DPORT"]
    out = []
    for r in rows:
        keys = [r["src"], r["dst"]] if args.by == "pair" else [r["src"], r["sport"], r["dst"], r["dport"]]
        out.append(keys + [f"{r['bytes'] / 1e6:.2f}MB", r["flows"], _ago(r["first_ns"]), _ago(r["last_ns"]),
                           r["origin"]])
    print(_table(out, head + ["BYTES", "FLOWS", "FIRST", "LAST", "ORIGIN"], free=("ORIGIN",)))
    return 0


FLOW_FIELDS = ("start", "src", "dst", "switches", "bytes", "duration")
FLOW_CHUNK_ROWS = 20_000  # flows per ImportFlows call
# a chunk of long switch paths is split below gRPC's message limit (20,000 simulator rows make 1.3 MB)
FLOW_CHUNK_BYTES = conn.MAX_MESSAGE_BYTES // 2
FLOW_PROBLEMS_SHOWN = 10
# distinct addresses and switch paths remembered; a cluster has thousands, a bigger count restarts the memo
FLOW_MEMO_ENTRIES = 1 << 16
# a JSON array is decoded one element at a time from buffers of this many characters; an element must fit
JSON_ARRAY_BUFFER_CHARS = 1 << 20
_U64 = 1 << 64
BAD_ROW = (ValueError, TypeError, OverflowError)  # what FlowRowParser raises for a row it refuses
PROGRESS_ROWS = 4096  # rows between two updates of the check's progress line (an update is two assignments)


def _parse_start(value) -> int:
    """ns since the epoch from an integer (ns), a number of seconds, or an RFC 3339 timestamp."""
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        v = int(value)
        return v if v > 10**15 else v * 10**9
    try:
        return int(float(value) * 1e9)
    except (TypeError, ValueError):
        pass
    import datetime
    ts = datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    if ts.tzinfo is None:
        raise ValueError("timestamp without a time zone")
    return int(ts.timestamp() * 1e9)


class _Unreadable:
    """An item of a flow file that did not decode (bad JSON, bad UTF-8): a bad row with its reason."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


class FlowRowParser:
    """One flow-file row (a dict from JSON or CSV) to the tuple ImportFlows carries: (start_ns, end_ns, src, sport,
    dst, dport, bytes, packets, switches); raises ValueError, TypeError or OverflowError for a bad row. Each
    distinct address and switch path is checked once and remembered (a file has millions of rows, a cluster a
    few thousand addresses and paths), so the usual row costs a dict look-up each, not an ipaddress parse."""

    def __init__(self, memo_entries: int = FLOW_MEMO_ENTRIES) -> None:
        self.memo_entries = memo_entries
        self.addresses: dict[str, str] = {}
        self.paths: dict[object, tuple[str, ...]] = {}

    def __call__(self, row) -> tuple:
        try:
            return self._parse(row)
        except BAD_ROW:
            # every field fails its conversion when it is absent or empty, so looking for absent ones here, not
            # on every row, costs nothing on good rows and still says "missing" first, as before
            if type(row) is dict and (absent := [k for k in FLOW_FIELDS if row.get(k) in (None, "")]):
                raise ValueError(f"missing {', '.join(absent)}") from None
            raise

    def _parse(self, row) -> tuple:
        if type(row) is not dict:
            raise ValueError(row.why if type(row) is _Unreadable else "not an object")
        get = row.get
        start, src, dst, switches = get("start"), get("src"), get("dst"), get("switches")
        start_ns = start if type(start) is int and start > 10**15 else _parse_start(start)
        duration = float(get("duration"))
        nbytes = int(get("bytes"))
        if duration < 0 or nbytes < 0:
            raise ValueError("negative duration or bytes")
        address = self.addresses.get
        src = (type(src) is str and address(src)) or self._address(src)
        dst = (type(dst) is str and address(dst)) or self._address(dst)
        if type(switches) is list:
            try:
                path = self.paths.get(tuple(switches))
            except TypeError:  # an unhashable id: _path says what is wrong
                path = None
        else:
            path = self.paths.get(switches) if type(switches) is str else None
        if path is None:
            path = self._path(switches)
        sport, dport, packets = get("sport"), get("dport"), get("packets")
        if sport or dport or packets:  # optional: most exports have none of them
            sport, dport, packets = int(sport or 0), int(dport or 0), int(packets or 0)
            if not (0 <= sport <= 65535 and 0 <= dport <= 65535):
                raise ValueError("port out of range")
            if not 0 <= packets < _U64:
                raise ValueError("packets out of range")
        else:
            sport = dport = packets = 0
        end_ns = start_ns + int(duration * 1e9)
        if start_ns <= 0 or end_ns >= _U64 or nbytes >= _U64:  # the collector refuses a start of 0 (the epoch)
            raise ValueError("bytes out of range" if nbytes >= _U64 else "start must be after 1970, end before 2554")
        return start_ns, end_ns, src, sport, dst, dport, nbytes, packets, path

    def _address(self, value) -> str:
        import ipaddress
        text = str(ipaddress.ip_address(value))
        if type(value) is str:
            if len(self.addresses) >= self.memo_entries:
                self.addresses.clear()
            self.addresses[value] = text
        return text

    def _path(self, switches) -> tuple[str, ...]:
        if switches == "":
            raise ValueError("missing switches")
        ids = [x for x in switches.split(";") if x] if isinstance(switches, str) else switches
        if not isinstance(ids, list) or not all(isinstance(x, str) and x for x in ids):
            raise ValueError("switches must be a list of ids (';'-separated in CSV)")
        for x in ids:
            x.encode()  # protobuf strings are UTF-8: a lone surrogate from JSON fails here, not while sending
        path = tuple(ids)
        if len(self.paths) >= self.memo_entries:
            self.paths.clear()
        self.paths[switches if isinstance(switches, str) else path] = path
        return path


def _json_lines(fh) -> Iterator[tuple[int, object]]:
    loads, n = json.loads, 0
    try:
        for n, line in enumerate(fh, 1):
            try:
                row = loads(line)
            except (ValueError, RecursionError) as exc:
                if line.isspace():
                    continue
                row = _Unreadable(f"invalid JSON: {exc.msg} (column {exc.colno})"
                                  if isinstance(exc, json.JSONDecodeError) else f"invalid JSON: {exc}")
            yield n, row
    except UnicodeDecodeError as exc:
        yield n + 1, _Unreadable(f"not UTF-8 text (at or after this line): {exc.reason}")


def _json_array(fh, buffer_chars: int = JSON_ARRAY_BUFFER_CHARS) -> Iterator[tuple[int, object]]:
    """The elements of one JSON array, numbered from 1, decoded one at a time: memory is the buffer, not the file.
    More than buffer_chars stay buffered past each element's start (until the file ends), so an element up to that
    size is never cut; a bigger one reads as invalid JSON. A syntax error ends the array."""
    decode, skip = json.JSONDecoder().raw_decode, re.compile(r"[ \t\n\r]*").match
    buf, pos, eof, n = "", 0, False, 0
    state = "["  # what comes next: "[", "first" (a value or "]"), "value", "," (or "]"), "end" (nothing)
    try:
        while True:
            if not eof and len(buf) - pos <= buffer_chars:
                piece = fh.read(buffer_chars)
                buf, pos, eof = buf[pos:] + piece, 0, not piece
                continue
            pos = skip(buf, pos).end()
            if pos == len(buf):
                if eof:
                    if state != "end":
                        yield n + 1, _Unreadable("invalid JSON: the file ends inside the array")
                    return
                continue
            c = buf[pos]
            if state == "end":
                yield n + 1, _Unreadable("invalid JSON: extra data after the array")
                return
            if state == "[" or state == ",":
                follows = {"[[": "first", ",,": "value", ",]": "end"}.get(state + c)
                if follows is None:
                    want = "'['" if state == "[" else f"',' or ']' after element {n}"
                    yield n + 1, _Unreadable(f"invalid JSON: expected {want}, found {c!r}")
                    return
                state, pos = follows, pos + 1
            elif state == "first" and c == "]":
                state, pos = "end", pos + 1
            else:
                try:
                    value, pos = decode(buf, pos)
                except (json.JSONDecodeError, RecursionError) as exc:
                    yield n + 1, _Unreadable(f"invalid JSON: {getattr(exc, 'msg', exc)}")
                    return
                n += 1
                yield n, value
                state = ","
    except UnicodeDecodeError as exc:
        yield n + 1, _Unreadable(f"not UTF-8 text: {exc.reason}")


class FlowFile:
    """A flow file (CSV, JSON lines or a JSON array) read twice with bounded memory: validate() checks every row
    and keeps none, so a bad row imports nothing; chunks() then parses it again, FLOW_CHUNK_ROWS rows at a time.
    A pipe or other non-regular file is copied to a temporary file first, to be read twice."""

    def __init__(self, path: str, fmt: str = "auto") -> None:
        self.path, self.rows = path, None
        self.parse = FlowRowParser()
        self.fh = open(path, encoding="utf-8", newline="")  # noqa: SIM115 (held until close())
        try:
            if not stat.S_ISREG(os.fstat(self.fh.fileno()).st_mode):
                with self.fh as pipe:
                    self.fh = tempfile.TemporaryFile("w+", encoding="utf-8", newline="")  # noqa: SIM115
                    shutil.copyfileobj(pipe, self.fh)
            first = self._first_char()
            if fmt == "auto":
                fmt = "json" if first in ("[", "{") else "csv"
            self.format = "csv" if fmt == "csv" else "json-array" if first == "[" else "json-lines"
            if self.format == "csv":
                next(self._items(), None)  # reads and checks the header now: a bad one fails before any row is read
        except BaseException as exc:
            self.fh.close()
            if isinstance(exc, UnicodeDecodeError):
                raise ValueError(f"{path}: not UTF-8 text: {exc.reason}") from None
            raise

    def _first_char(self) -> str:
        self.fh.seek(0)
        while piece := self.fh.read(1 << 16):
            if text := piece.lstrip():
                return text[0]
        return ""

    def _items(self) -> Iterator[tuple[int, object]]:
        """(line, row) from the start: line is the file line (CSV, JSON lines) or the element number (array)."""
        self.fh.seek(0)
        if self.format == "json-lines":
            return _json_lines(self.fh)
        if self.format == "json-array":
            return _json_array(self.fh)
        return self._csv_rows()

    def _csv_rows(self) -> Iterator[tuple[int, object]]:
        import csv
        reader = csv.DictReader(self.fh)
        try:
            fields = reader.fieldnames
        except (csv.Error, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.path}: cannot read the CSV header: {exc}") from None
        missing = set(FLOW_FIELDS) - set(fields or [])
        if missing:
            raise ValueError(f"{self.path}: CSV header lacks {', '.join(sorted(missing))} "
                             f"(needs {', '.join(FLOW_FIELDS)})")
        try:
            for row in reader:
                yield reader.line_num, row
        except (csv.Error, UnicodeDecodeError) as exc:
            yield reader.line_num + 1, _Unreadable(f"unreadable CSV: {exc}")

    def size_bytes(self) -> int:
        return os.fstat(self.fh.fileno()).st_size

    def position_bytes(self) -> int:
        """How far the reading is, in bytes (to the text layer's read-ahead): for progress."""
        return self.fh.buffer.tell()

    def validate(self, progress: cliout.Progress | None = None) -> int:
        """Check every row and return how many; raise ValueError listing the first problems (nothing imported).
        progress: shown the bytes read, every PROGRESS_ROWS rows."""
        parse, shown, bad, rows = self.parse, [], 0, 0
        for line, row in self._items():
            if progress is not None and not line % PROGRESS_ROWS:
                progress.update(done=self.position_bytes(), note=f"{rows:,} rows")
            try:
                parse(row)
                rows += 1
            except BAD_ROW as exc:
                bad += 1
                if len(shown) < FLOW_PROBLEMS_SHOWN:
                    shown.append(f"{self.path}:{line}: {exc}")
        if bad:
            more = f" (and {bad - len(shown)} more)" if bad > len(shown) else ""
            raise ValueError("bad flow rows, nothing imported:\n  " + "\n  ".join(shown) + more)
        self.rows = rows
        return rows

    def chunks(self, size: int = FLOW_CHUNK_ROWS) -> Iterator[list[tuple]]:
        """After validate(): the rows as FlowRowParser tuples, size at a time. A row that fails now, or a row
        count that differs, means the file changed since it was checked: ValueError (the rest is not sent)."""
        if self.rows is None:
            raise RuntimeError("FlowFile.chunks() before validate()")
        parse, chunk, rows = self.parse, [], 0
        for line, row in self._items():
            if rows == self.rows:
                raise ValueError(f"{self.path} grew after it was checked: line {line} and later were not imported")
            try:
                chunk.append(parse(row))
            except BAD_ROW as exc:
                raise ValueError(f"{self.path}:{line}: {exc} (the file changed after it was checked)") from None
            rows += 1
            if len(chunk) == size:
                yield chunk
                chunk = []
        if rows != self.rows:
            raise ValueError(f"{self.path} changed after it was checked: {self.rows} rows then, {rows} now")
        if chunk:
            yield chunk

    def close(self) -> None:
        self.fh.close()

    def __enter__(self) -> FlowFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def flow_requests(origin: str, rows: list[tuple],
                  max_bytes: int = FLOW_CHUNK_BYTES) -> Iterator[cpb.ImportFlowsRequest]:
    """ImportFlows requests for a chunk of FlowRowParser tuples: one, or halves while one is over max_bytes."""
    req = cpb.ImportFlowsRequest(origin=origin)
    add = req.flows.add
    for start_ns, end_ns, src, sport, dst, dport, nbytes, packets, switches in rows:
        add(start_ns=start_ns, end_ns=end_ns, src=src, sport=sport, dst=dst, dport=dport, bytes=nbytes,
            packets=packets, switches=switches)
    if len(rows) > 1 and req.ByteSize() > max_bytes:
        half = len(rows) // 2
        yield from flow_requests(origin, rows[:half], max_bytes)
        yield from flow_requests(origin, rows[half:], max_bytes)
    else:
        yield req


def read_flow_file(path: str, fmt: str) -> list[cpb.FlowRow]:
    """Every row of a flow file as FlowRow, validated whole first (ValueError lists bad rows). Holds the whole
    file in memory: for small files and tests; `import flows` streams through FlowFile instead."""
    with FlowFile(path, fmt) as flows:
        flows.validate()
        return [flow for rows in flows.chunks() for req in flow_requests("", rows, _U64) for flow in req.flows]


class _FlowSender:
    """ImportFlows calls with one in flight, so the next chunk is parsed while the collector stores this one."""

    def __init__(self, stub, origin: str, timeout: float) -> None:
        self.stub, self.origin, self.timeout = stub, origin, timeout
        self.imported = 0  # acknowledged by the collector
        self.in_flight = 0  # flows in the call not yet answered
        self._pending = None

    def send(self, rows: list[tuple]) -> None:
        for req in flow_requests(self.origin, rows):
            self.wait()
            self._pending = self.stub.ImportFlows.future(req, timeout=self.timeout)
            self.in_flight = len(req.flows)

    def wait(self) -> None:
        if self._pending is not None:
            reply = self._pending.result()  # raises the call's grpc.RpcError
            self._pending, self.imported, self.in_flight = None, self.imported + reply.imported, 0


def cmd_import(stub, args) -> int:
    origin = args.origin or os.path.basename(args.file)
    name = os.path.basename(args.file)
    with FlowFile(args.file, args.format) as flows:
        with cliout.progress_for(args, f"checking {name}", total=flows.size_bytes(), unit="bytes") as progress:
            total = flows.validate(progress)  # a bad row raises here, before anything is sent
        sender = _FlowSender(stub, origin, args.timeout + 30)
        progress = cliout.progress_for(args, f"importing {name}", total=total, unit="flows")
        progress.update(done=0)
        try:
            with progress:
                for rows in flows.chunks():
                    sender.send(rows)
                    progress.update(done=sender.imported)
                sender.wait()
        except (grpc.RpcError, OSError, ValueError, KeyboardInterrupt) as exc:
            if isinstance(exc, (OSError, ValueError)):  # the file failed, not the call: its answer still counts
                try:
                    sender.wait()
                except grpc.RpcError:
                    pass
            unsure = f"; {sender.in_flight} more were being sent and may be stored too" if sender.in_flight else ""
            print(f"steplens: import stopped: {sender.imported} of {total} flows from {args.file} were imported before "
                  f"the error and stay imported as import:{origin} (importing the file again stores them twice)"
                  f"{unsure}", file=sys.stderr)
            raise
    out = {"file": args.file, "origin": f"import:{origin}", "imported": sender.imported}
    print(json.dumps(out) if args.json else f"imported {sender.imported} flows from {args.file} as import:{origin}")
    return 0


def cmd_detail(stub, args) -> int:
    now = time.time_ns()
    since = now - int(parse_duration(args.since) * 1e9)
    with cliout.progress_for(args, f"detail {args.kind}", note=f"fetching from {args.node}"):
        reply = stub.FetchDetail(cpb.FetchRequest(node_id=args.node, kinds=[args.kind], since_ns=since,
                                                  ranks=args.rank or [], limit=args.limit), timeout=args.timeout + 35)
    rows = json.loads(reply.records_json or "[]")
    if args.pid:
        rows = [r for r in rows if r.get("pid") == args.pid]
    if args.json:
        print(json.dumps(rows, indent=2, ensure_ascii=False))
        return 0
    print(f"{args.node}: {reply.message}")
    for r in rows[-args.show:]:
        inner = r["frames"][0] if r["frames"] else {"qualname": "", "file": "", "line": -1}
        chain = " <- ".join(f["qualname"] for f in r["frames"][:5]) or stackfmt.NO_PYTHON_FRAME
        print(_fit_line(f"  {_ago(r['ts_ns']):>8}  pid {r['pid']} tid {r['tid']} {r['state']:<9}"
                        f"{' GIL' if r['gil'] else '    '}  ", chain,
                        f"  {stackfmt.location(inner['file'], inner['line'])}".rstrip()))
    return 0


def cmd_comms(stub, args) -> int:
    reply = stub.ListComms(cpb.CommsRequest(job_key=args.job or "", comm_id=args.comm or ""), timeout=args.timeout)
    rows = [{"comm_id": m.comm_id, "rank": m.rank, "nranks": m.nranks, "host": m.host, "pid": m.pid,
             "cuda_dev": m.cuda_dev, "nvml_dev": m.nvml_dev, "bus_id": m.bus_id, "global_rank": m.global_rank,
             "job_key": m.job_key, "via": m.via, "node_id": m.node_id, "seen_ns": m.seen_ns} for m in reply.members]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    by: dict[str, list] = {}
    for r in rows:
        by.setdefault(r["comm_id"], []).append(r)
    for comm, members in by.items():
        n = members[0]["nranks"]
        seen = {m["rank"] for m in members}
        print(f"comm {comm}: {len(seen)} of {n} ranks known" + (f" (missing {n - len(seen)})" if len(seen) < n else ""))
        print(_table([[m["rank"], m["global_rank"] if m["global_rank"] >= 0 else "-", m["host"], m["pid"],
                       m["cuda_dev"], m["bus_id"], m["via"], _ago(m["seen_ns"])] for m in members],
                     ["RANK", "GLOBAL", "HOST", "PID", "GPU", "BUS", "VIA", "SEEN"], free=("VIA",)))
    if not rows:
        print("no communicators known (agents' nccltopo source: NCCL_DEBUG=INFO logs or NCCL RAS)")
    return 0


def _cmd_comm_summaries(stub, args, since: int) -> int:
    reply = stub.ListCommSummaries(cpb.SummariesRequest(job_key=args.job, ranks=args.rank or [], since_ns=since,
                                                        limit=min(args.limit, 100000)), timeout=args.timeout)
    rows = json.loads(reply.rows_json or "[]")
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    # cpu_enqueue: the source has only each op's enqueue time (gloo's Flight Recorder): no duration, not a zero one
    table = [[r["rank"], r["comm_id"] or "-", r["op"], r["step"] if r["step"] >= 0 else "-", r["calls"], r["bytes"],
              *(("-", "-") if r.get("timing") == "cpu_enqueue" else (_us(r["busy_ns"]), _us(r["max_ns"]))),
              f"{r['seq_first']}..{r['seq_last']}" if r["seq_first"] >= 0 else "-",
              _us(r["issue_latency_ns_sum"] // r["kernels"]) if r["kernels"] else "-", r["source"], _ago(r["end_ns"])]
             for r in rows[-args.show:]]
    if not rows:
        print(f"no comm summaries stored for job {args.job!r}" + (f" in the last {args.since}" if since else "") +
              " (sources: kineto, flightrec; flightrec reads a ring when it is about half full, so its summaries can"
              " come tens of seconds after the ops)")
        return 0
    print(_table(table, ["RANK", "COMM", "OP", "STEP", "CALLS", "BYTES", "BUSY", "MAX", "SEQ", "ISSUE_LAT", "SOURCE",
                         "END"]))
    return 0


def cmd_commops(stub, args) -> int:
    now = time.time_ns()
    since = now - int(parse_duration(args.since) * 1e9) if args.since else 0
    if args.summary:
        return _cmd_comm_summaries(stub, args, since)
    kinds = ["commops"] + (["kernels"] if args.kernels else [])
    with cliout.progress_for(args, f"commops {args.job}", note="fetching from the nodes of its ranks"):
        reply = stub.FetchCommOps(cpb.CommOpsRequest(job_key=args.job, ranks=args.rank or [], since_ns=since,
                                                     limit=args.limit, kinds=kinds), timeout=args.timeout + 35)
    rows = json.loads(reply.records_json or "[]")
    if args.json:
        print(json.dumps(rows, indent=2, ensure_ascii=False))
    else:
        for node, msg in sorted(reply.messages.items()):
            print(f"{node}: {msg}")
        ops = [r for r in rows if r["kind"] == "commop"]
        shown = ops[-args.show:]
        table = [[r["rank"], r["comm_id"], r["op"], r["seq"] if r["seq"] >= 0 else "-", r["bytes"],
                  _ago(r["start_ns"] or r["issue_ns"]), _us(r["end_ns"] - r["start_ns"]) if r["end_ns"] and r["start_ns"]
                  else "-", r["source"], r["timing"]] for r in shown]
        print(_table(table, ["RANK", "COMM", "OP", "SEQ", "BYTES", "START", "DURATION", "SOURCE", "TIMING"],
                     free=("SOURCE", "TIMING")))
        if len(ops) > len(shown):
            print(f"({len(ops) - len(shown)} older ops not shown; --show N or --json)")
        kern = [r for r in rows if r["kind"] == "kernel"]
        if kern:
            lat = [r["issue_latency_ns"] for r in kern if r["issue_latency_ns"] is not None]
            print(f"{len(kern)} kernels" + (f", issue latency median {_us(sorted(lat)[len(lat) // 2])}" if lat else ""))
    return 0 if not reply.offline else 1


def cmd_deep(stub, args) -> int:
    if args.action == "list":
        return _deep_list(stub, args)
    enable = args.action == "start"
    if args.job and not enable:
        raise SystemExit("steplens deep stop: --job is for start; stop takes --nodes")
    req = cpb.DeepRequest(node_ids=args.nodes.split(",") if args.nodes else [], enable=enable,
                          lead_ms=args.lead_ms, duration_ns=int(parse_duration(args.duration) * 1e9) if enable else 0,
                          sources=args.sources.split(",") if args.sources else [], job_key=args.job or "")
    reply = stub.SetDeepMode(req, timeout=args.timeout + 10)
    out = {"command_id": reply.command_id, "start_ns": reply.start_ns, "delivered": list(reply.delivered),
           "offline": list(reply.offline), "messages": dict(reply.messages)}
    if reply.deep_dive_json:
        out["deep_dive"] = json.loads(reply.deep_dive_json)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"deep mode {args.action}: command {reply.command_id}; delivered to {len(reply.delivered)} node(s)")
        for node, msg in sorted(reply.messages.items()):
            print(f"  {node}: {msg}")
        if args.job:
            print(f"ranked causes when the window is over: steplens deep list --job {args.job}")
    return 0 if not reply.offline else 1


def _deep_list(stub, args) -> int:
    reply = stub.ListDeepDives(cpb.DeepDivesRequest(job_key=args.job or "", limit=args.limit), timeout=args.timeout)
    rows = json.loads(reply.deep_dives_json or "[]")
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no deep dives")
        return 0
    table = []
    for d in rows:
        top = d["causes"][0] if d["causes"] else None
        spread = d.get("start_spread_ns")
        table.append([d["command_id"], d["job_key"], d["trigger"], d["finding_id"] or "-", _ago(d["start_ns"]),
                      f"{d['duration_ns'] / 1e9:.1f}s", str(len(d["nodes"])),
                      "-" if spread is None else f"{spread / 1e6:.2f}ms", d["status"],
                      f"{_who(top)} {top['kind']} {top['id']} ({top['cause']}, {top['score']:.0f})"
                      if top else (d["note"] or "-")])
    print(_table(table, ["COMMAND", "JOB", "TRIGGER", "FINDING", "START", "FOR", "NODES", "SPREAD", "STATUS",
                         "TOP CAUSE"], free=("TOP CAUSE",)))
    return 0


def _who(cause: dict) -> str:
    """A ranked cause's process: its rank, or its pid where it has none (a serving engine)."""
    return f"rank {cause['rank']}" if cause.get("rank", -1) >= 0 or "pid" not in cause else f"pid {cause['pid']}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="steplens", description="steplens operator CLI (talks to a collector)")
    p.add_argument("--collector", default=os.environ.get("STEPLENS_COLLECTOR", "127.0.0.1:7707"),
                   help="collector HOST:PORT (env STEPLENS_COLLECTOR)")
    p.add_argument("--insecure", action="store_true", help="plaintext, loopback collectors only")
    p.add_argument("--tls-ca", help="CA bundle for the collector's certificate")
    p.add_argument("--tls-cert", help="operator client certificate")
    p.add_argument("--tls-key", help="operator client key")
    p.add_argument("--token-file", default=os.environ.get("STEPLENS_TOKEN_FILE", ""), help="bearer token file")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress line on stderr (it is drawn only on a terminal, and not for --json into a pipe)")
    sub = p.add_subparsers(dest="command", required=True)

    def listing(name, func, help_):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("--json", action="store_true", help="one JSON document on stdout")
        sp.add_argument("--node", help="only this node")
        sp.set_defaults(func=func)
        return sp
    listing("nodes", cmd_nodes, "agents: last seen, clock, sources, spool and record counters")
    listing("gpus", cmd_gpus, "latest telemetry per GPU")
    sp = listing("procs", cmd_procs, "workload processes with job and rank")
    sp.add_argument("--all", action="store_true", help="include exited processes")
    listing("gaps", cmd_gaps, "records lost on agents (spool or queue overflow)")
    sp = listing("stacks", cmd_stacks, "Python stack summaries of workload processes (pystacks source)")
    sp.add_argument("--pid", type=int, help="only this process")
    sp.add_argument("--since", help="only summaries from the last DURATION (e.g. 5m)")
    sp.add_argument("--limit", type=int, default=50, help="rows at most (default 50)")
    sp.add_argument("--top", type=int, default=5, help="stacks shown per thread (default 5)")
    sp = listing("flows", cmd_flows, "network flows per (src, dst) pair, from agents (eBPF) and imports")
    sp.add_argument("--since", default="", help="only flows ending in the last DURATION (e.g. 60s)")
    sp.add_argument("--by", choices=["pair", "connection"], default="pair", help="connection adds the ports")
    sp.add_argument("--limit", type=int, default=1000)
    sp = sub.add_parser("import", help="import data exported elsewhere")
    isub = sp.add_subparsers(dest="what", required=True)
    ip = isub.add_parser("flows", help="flows exported by switches (ERSPAN/sFlow/IPFIX converted to CSV or JSON): "
                                       "fields start, src, dst, switches, bytes, duration [, sport, dport, packets]")
    ip.add_argument("file")
    ip.add_argument("--format", choices=["auto", "csv", "json"], default="auto")
    ip.add_argument("--origin", help="name recorded with the flows (default: the file name)")
    ip.add_argument("--json", action="store_true")
    ip.set_defaults(func=cmd_import)
    diagnosis.register_import(isub)
    sp = sub.add_parser("detail", help="fetch node-local detail from one agent on demand (raw stack samples)")
    sp.add_argument("kind", choices=["stacks"])
    sp.add_argument("--node", required=True, help="the agent's node id")
    sp.add_argument("--since", default="60s", help="from this long ago (default 60s)")
    sp.add_argument("--rank", type=int, action="append", help="only these ranks (repeatable)")
    sp.add_argument("--pid", type=int, help="only this process")
    sp.add_argument("--limit", type=int, default=10000)
    sp.add_argument("--show", type=int, default=20, help="rows printed in the table (default 20, newest)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_detail)
    sp = sub.add_parser("comms", help="NCCL communicators: comm hash -> rank -> host/pid/GPU (nccltopo source)")
    sp.add_argument("--job", help="only communicators with a member of this job")
    sp.add_argument("--comm", help="only this comm hash")
    sp.add_argument("--json", action="store_true", help="one JSON list of members")
    sp.set_defaults(func=cmd_comms)
    sp = sub.add_parser("commops", help="communication ops of a job, fetched on demand from its nodes' agents")
    sp.add_argument("job", help="the job key, as `procs --json` reports it")
    sp.add_argument("--rank", type=int, action="append", help="only these global ranks (repeatable)")
    sp.add_argument("--since", default="5m", help="from this long ago (default 5m; '' for all kept)")
    sp.add_argument("--limit", type=int, default=100000, help="records per node at most")
    sp.add_argument("--kernels", action="store_true", help="also fetch GPU kernels (KernelRec)")
    sp.add_argument("--summary", action="store_true", help="the stored per-step summaries instead (no fetch from "
                                                            "the nodes): calls, bytes, busy/max time, seq range")
    sp.add_argument("--show", type=int, default=40, help="rows printed in the table (default 40, newest)")
    sp.add_argument("--json", action="store_true", help="one JSON list: rank, comm_id, op, seq, bytes, start_ns, "
                                                         "end_ns, source, ... (cluster times)")
    sp.set_defaults(func=cmd_commops)
    sp = sub.add_parser("deep", help="synchronized deep mode on agents; with --job a deep dive of that job (its "
                                     "nodes, a reference window, ranked causes); list: the deep dives")
    sp.add_argument("action", choices=["start", "stop", "list"])
    sp.add_argument("--job", help="start: a deep dive of this job (its nodes); list: only this job's")
    sp.add_argument("--limit", type=int, default=100, help="list: at most this many, newest first")
    sp.add_argument("--nodes", help="comma-separated node ids (default: every connected agent)")
    sp.add_argument("--duration", default="30s", help="how long (start only; e.g. 30s, 5m)")
    sp.add_argument("--lead-ms", type=int, default=500, help="start this long from now, so all agents start together")
    sp.add_argument("--sources", help="comma-separated sources (default: all with a deep mode)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_deep)
    diagnosis.register(sub)
    for name in WATCHABLE:
        _add_watch(sub.choices[name])
    sp = sub.add_parser("completion", help="print a shell completion script, walked from this parser: "
                                           "eval \"$(steplens completion bash)\"")
    sp.add_argument("shell", choices=sorted(completion.SHELLS))
    sp.set_defaults(func=cmd_completion, local=True)
    return p


# listings that take --watch [SECONDS] (findings has its own: a stream of events from the collector)
WATCHABLE = ("nodes", "gpus", "procs", "gaps", "stacks", "flows", "comms", "jobs")
WATCH_SECONDS = 2.0


def _seconds(text: str) -> float:
    value = float(text)
    if not 0.1 <= value <= 86400:
        raise argparse.ArgumentTypeError(f"{text}: between 0.1 and 86400 seconds")
    return value


def _add_watch(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--watch", dest="watch_seconds", nargs="?", type=_seconds, const=WATCH_SECONDS,
                    metavar="SECONDS", help=f"re-run every SECONDS (default {WATCH_SECONDS:g}) until Ctrl-C; on a "
                    "terminal the screen is redrawn, piped each refresh follows the last (--json: one per line)")
    sp.add_argument("--count", type=int, default=0, metavar="N", help="with --watch: stop after N refreshes")


def cmd_completion(stub, args) -> int:
    print(completion.script(build_parser(), args.shell), end="")
    return 0


def _rpc_error(args, exc: grpc.RpcError) -> str:
    """What the CLI says about a failed call, on one line."""
    code, details = exc.code(), exc.details()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        why = conn.explain_unreachable(args.collector, args.insecure, f"{code.name}: {details}",
                                       min(args.timeout, 3.0))
        return f"steplens: {why}"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return (f"steplens: {args.collector}: {code.name}: {details} (operators need --token-file, or "
                "--tls-cert/--tls-key with an operator certificate)")
    return f"steplens: {args.collector}: {code.name}: {details}"


def _run(stub, args, argv: list[str]) -> int:
    if getattr(args, "watch_seconds", None) is None:
        return args.func(stub, args)

    def refresh() -> tuple[int, str]:
        try:
            return args.func(stub, args), ""
        except grpc.RpcError as exc:  # the collector may come back: the watch goes on, saying why meanwhile
            return EXIT_RPC, _rpc_error(args, exc)
    words = argv[argv.index(args.command):] if args.command in argv else [args.command]
    return cliout.watch(refresh, args.watch_seconds, args.count, shlex.join(["steplens", *words]), args.json)


@cliout.quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if getattr(args, "local", False):  # needs no collector
        return args.func(None, args)
    try:
        token = conn.read_token(args.token_file)
        channel = conn.client_channel(args.collector, args.insecure, conn.TlsFiles(args.tls_ca or "", args.tls_cert or "",
                                                                                   args.tls_key or ""), token)
        with channel:
            return _run(cgrpc.ControlStub(channel), args, argv)
    except conn.SecurityError as exc:
        print(f"steplens: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        raise  # stdout closed by its reader (`| head`): cliout ends quietly
    except (ValueError, OSError) as exc:
        print(f"steplens: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except grpc.RpcError as exc:
        print(_rpc_error(args, exc), file=sys.stderr)
        return EXIT_RPC


if __name__ == "__main__":
    sys.exit(main())
