"""Read one recorded file (Kineto trace, Flight Recorder dump, NCCL_DEBUG=INFO log) and return what steplens
extracts from it, so a user can check what steplens sees in their own traces (`steplens-agent parse`).

Reads the file once (gzip detected by its magic), up to `max_bytes`; the kind is guessed from the content
when not given. Times stay in the file's own clock, in ns (Kineto and Flight Recorder: CLOCK_REALTIME; an
NCCL log has no times: 0). Uses the same parsers as the sources (agent/kineto/trace.py,
agent/sources/flightrec.py, agent/nccltopo.py) with an identity clock. Flight Recorder dumps are read as
JSON or as the pickle torch writes on timeout; the pickle is read by an unpickler that refuses every
class, so a crafted file cannot run code.

NCCL collective lines (NCCL_DEBUG_SUBSYS=COLL)

    host:pid:tid [dev] NCCL INFO AllReduce: opCount 1a sendbuff 0x.. recvbuff 0x.. count N datatype D op O
        root R comm 0x<ptr> [nranks=N] stream 0x<stream>

become CommOps: opCount (hex, NCCL's per-communicator counter, the same on every rank) is the seq;
count x the ncclDataType_t size is the bytes (ReduceScatter logs the per-rank receive count: its input is
count x nranks); the comm pointer maps to the commId hash through the same process's Init line where
the log has one ("ptr:<host>:<pid>:<0x..>" otherwise, as nccltopo keys it). Lines that look like an Init
or collective line but do not parse (torn by concurrent writers) are counted as skipped.
"""

from __future__ import annotations

import gzip
import io
import pickle
import re
from collections import Counter
from dataclasses import asdict, dataclass, field

KINDS = ("kineto", "flightrec", "nccl-log")

# ncclDataType_t -> bytes per element (nccl.h: int8, uint8, int32, uint32, int64, uint64, float16, float32,
# float64, bfloat16, float8e4m3, float8e5m2)
NCCL_DTYPES = {0: ("int8", 1), 1: ("uint8", 1), 2: ("int32", 4), 3: ("uint32", 4), 4: ("int64", 8),
               5: ("uint64", 8), 6: ("float16", 2), 7: ("float32", 4), 8: ("float64", 8), 9: ("bfloat16", 2),
               10: ("float8_e4m3fn", 1), 11: ("float8_e5m2", 1)}

_COLL = re.compile(
    r"(?P<host>[^\s:]+):(?P<pid>\d+):(?P<tid>\d+)\s+\[(?P<dev>\d+)\]\s+NCCL INFO\s+(?:\[\d+\]\s+)?"
    r"(?P<op>[A-Za-z]+):\s+opCount\s+(?P<opcount>[0-9a-fA-F]+)\s+sendbuff\s+\S+\s+recvbuff\s+\S+\s+"
    r"count\s+(?P<count>\d+)\s+datatype\s+(?P<dt>\d+)\s+op\s+\d+\s+root\s+(?P<root>-?\d+)\s+"
    r"comm\s+(?P<comm>0x[0-9a-fA-F]+|\(nil\))\s+\[nranks=(?P<nranks>\d+)\]\s+stream\s+(?P<stream>0x[0-9a-fA-F]+|\(nil\))")


class ParseError(Exception):
    """The file cannot be read as the kind asked (or as any kind); str() says why."""


@dataclass
class Result:
    kind: str
    ops: list = field(default_factory=list)        # CommOp
    kernels: list = field(default_factory=list)    # KernelRec
    steps: list = field(default_factory=list)      # (step, start_ns, end_ns)
    skipped: int = 0
    notes: dict = field(default_factory=dict)      # kind-specific facts (version, waits, communicators)

    def to_json(self) -> dict:
        ops = []
        for o in self.ops:
            d = asdict(o)
            for k in ("mono_ns", "issue_mono_ns", "start_mono_ns", "end_mono_ns"):
                d[k.replace("_mono", "")] = d.pop(k)
            ops.append(d)
        kernels = []
        for k in self.kernels:
            d = asdict(k)
            for f in ("mono_ns", "start_mono_ns", "end_mono_ns", "launch_start_mono_ns", "launch_end_mono_ns"):
                d[f.replace("_mono", "")] = d.pop(f)
            kernels.append(d)
        return {"kind": self.kind, "ops": ops, "kernels": kernels,
                "steps": [{"step": s, "start_ns": a, "end_ns": b} for s, a, b in self.steps],
                "skipped": self.skipped, **self.notes}


class _Identity:
    """The clock the parsers take, left as the file's own (no conversion)."""

    @staticmethod
    def to_mono(ns: int) -> int:
        return ns


class _NoClasses(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing {module}.{name}: a Flight Recorder dump holds plain data only")


def read_bytes(path: str, max_bytes: int = 1 << 30) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
        if data[:2] == b"\x1f\x8b":
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as gz:
                data = gz.read(max_bytes + 1)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise ParseError(f"{path}: {exc}") from None
    if len(data) > max_bytes:
        raise ParseError(f"{path}: larger than {max_bytes} bytes")
    return data


def _load_doc(data: bytes):
    """JSON, or a plain-data pickle; None when it is neither."""
    head = data.lstrip()[:1]
    if head in (b"{", b"["):
        try:
            from steplens.agent.kineto.trace import loads_json
            return loads_json(data)
        except ValueError:
            return None
    if data[:1] == b"\x80":
        try:
            return _NoClasses(io.BytesIO(data)).load()
        except Exception:  # any malformed pickle: not a dump
            return None
    return None


def guess_kind(data: bytes, doc=None) -> str | None:
    doc = _load_doc(data) if doc is None else doc
    if isinstance(doc, dict):
        if isinstance(doc.get("traceEvents"), list):
            return "kineto"
        if "entries" in doc and ("version" in doc or "pg_config" in doc):
            return "flightrec"
    if doc is None and b"NCCL INFO" in data[:1 << 20]:
        return "nccl-log"
    return None


def parse_file(path: str, kind: str | None = None, max_bytes: int = 1 << 30) -> Result:
    data = read_bytes(path, max_bytes)
    doc = _load_doc(data) if kind != "nccl-log" else None
    kind = kind or guess_kind(data, doc)
    if kind is None:
        raise ParseError(f"{path}: not a Kineto trace, Flight Recorder dump or NCCL log (give --kind)")
    if kind == "kineto":
        return _kineto(path, doc)
    if kind == "flightrec":
        return _flightrec(path, doc)
    if kind == "nccl-log":
        return parse_nccl_log(data.decode("utf-8", "replace").splitlines())
    raise ParseError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")


def _kineto(path: str, doc) -> Result:
    from steplens.agent.kineto import trace
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ParseError(f"{path}: not a Kineto trace (no traceEvents list)")
    if not isinstance(doc.get("baseTimeNanoseconds", 0), int):
        raise ParseError(f"{path}: baseTimeNanoseconds is not an integer")
    pids = Counter(e.get("pid") for e in doc["traceEvents"]
                   if isinstance(e, dict) and str(e.get("cat", "")).lower() in ("cpu_op", "operator")
                   and isinstance(e.get("pid"), int))
    pid = pids.most_common(1)[0][0] if pids else 0
    p = trace.parse(doc, _Identity.to_mono, pid)
    return Result("kineto", p.ops, p.kernels, p.steps, p.skipped,
                  {"waits": p.waits, "events": p.events, "pid": pid,
                   "distributed": {k: v for k, v in (doc.get("distributedInfo") or {}).items() if k != "pg_config"}})


def _flightrec(path: str, doc) -> Result:
    from steplens.agent.sources.flightrec import FlightrecError, OpConverter, parse_dump
    if not isinstance(doc, dict):
        raise ParseError(f"{path}: not a Flight Recorder dump (neither a JSON object nor a plain-data pickle)")
    try:
        dump = parse_dump(doc, accepted_versions=(str(doc.get("version", "")),))
    except FlightrecError as exc:
        raise ParseError(f"{path}: {exc}") from None
    out = Result("flightrec", notes={"version": dump.version, "entries": len(dump.entries)})
    rank = doc.get("rank", -1)
    conv = OpConverter(dump, _Identity, pid=0, rank=rank if isinstance(rank, int) else -1)
    for e in dump.entries:
        try:
            out.ops.append(conv(e))
        except (ValueError, TypeError, OverflowError):
            out.skipped += 1
    out.ops.sort(key=lambda o: (o.comm_id, o.seq, o.issue_mono_ns))
    return out


def parse_nccl_log(lines) -> Result:
    """NCCL_DEBUG=INFO lines -> collective CommOps and the communicators of the Init lines."""
    from steplens.agent import nccltopo
    from steplens.agent.commlog import normalize_op
    from steplens.agent.records import CommOp
    lines = list(lines)
    out = Result("nccl-log")
    ptr_hash: dict[tuple, tuple[str, int]] = {}     # (host, pid, comm ptr) -> (comm id, rank in it)
    for line in lines:
        if "Init " in line and (" START" in line or " COMPLETE" in line) and "comm 0x" in line:
            f = nccltopo.parse_init_line(line)
            if f is None:
                out.skipped += 1
                continue
            key = f["comm_hash"] or f"ptr:{f['host']}:{f['pid']}:{f['comm_ptr']}"
            ptr_hash[(f["host"], f["pid"], f["comm_ptr"])] = (key, f["rank"])
    comms = nccltopo.parse_log(lines)
    for line in lines:
        if "opCount" not in line:
            continue
        m = _COLL.search(line)
        if m is None or line.count("NCCL INFO") != 1:
            out.skipped += 1
            continue
        g = m.groupdict()
        host, pid, ptr = g["host"], int(g["pid"]), g["comm"].lower()
        comm_id, my_rank = ptr_hash.get((host, pid, ptr), (f"ptr:{host}:{pid}:{ptr}", -1))
        dtype, size = NCCL_DTYPES.get(int(g["dt"]), ("", 0))
        op = normalize_op(g["op"])
        count, nranks = int(g["count"]), int(g["nranks"])
        if op == "reduce_scatter":
            count *= nranks
        p2p = op in ("send", "recv")
        out.ops.append(CommOp(
            0, "cpu_enqueue", pid, comm_id, op, tid=int(g["tid"]), device=int(g["dev"]), comm_desc=host,
            group_rank=my_rank, nranks=nranks, peer=int(g["root"]) if p2p else -1,
            root=int(g["root"]) if op in ("broadcast", "reduce") else -1, count=count, dtype=dtype,
            bytes=count * size, seq=-1 if p2p else int(g["opcount"], 16),
            p2p_seq=int(g["opcount"], 16) if p2p else -1,
            stream=int(g["stream"], 16) if g["stream"].startswith("0x") else 0,
            seq_source="" if p2p else "trace"))
    out.notes["communicators"] = [
        {"comm_id": c.comm_hash, "nranks": c.nranks, "complete": c.complete,
         "ranks": [{"rank": r.rank, "host": r.host, "pid": r.pid, "cuda_dev": r.cuda_dev, "bus_id": r.bus_id,
                    "comm_ptr": r.comm_ptr} for r in sorted(c.ranks.values(), key=lambda r: r.rank)]}
        for c in comms.values()]
    return out


def summary(res: Result, limit: int = 40) -> str:
    """Human output: counts per op kind with bytes, kernels, steps, skipped, then a table of ops."""
    lines = [f"kind: {res.kind}"]
    for k, v in res.notes.items():
        if k != "communicators":
            lines.append(f"{k}: {v}")
    per = Counter()
    nbytes = Counter()
    for o in res.ops:
        per[o.op] += 1
        nbytes[o.op] += o.bytes
    lines.append(f"ops: {len(res.ops)}" + "".join(f"  {op} {n} ({nbytes[op]:,} B)" for op, n in sorted(per.items())))
    seqs = Counter(o.seq_source or "none" for o in res.ops)
    if res.ops:
        lines.append("seq from: " + ", ".join(f"{k} {v}" for k, v in sorted(seqs.items())))
    if res.kernels:
        lat = [k.start_mono_ns - k.launch_start_mono_ns for k in res.kernels if k.launch_start_mono_ns]
        med = sorted(lat)[len(lat) // 2] / 1e3 if lat else 0.0
        lines.append(f"kernels: {len(res.kernels)}  with launch {len(lat)}  median issue latency {med:.1f} us")
    else:
        lines.append("kernels: 0")
    lines.append(f"steps: {len(res.steps)}  skipped: {res.skipped}")
    for c in res.notes.get("communicators", []):
        lines.append(f"communicator {c['comm_id']}: nranks {c['nranks']}, ranks seen {len(c['ranks'])}"
                     f"{'' if c['complete'] else ' (init not complete)'}")
    if res.ops:
        lines.append("")
        lines.append(f"{'start_ns':>20} {'dur_us':>9} {'op':<15} {'comm_id':<22} {'seq':>6} {'bytes':>14} timing")
        for o in res.ops[:limit]:
            dur = (o.end_mono_ns - o.start_mono_ns) / 1e3 if o.start_mono_ns and o.end_mono_ns else 0.0
            lines.append(f"{o.start_mono_ns or o.issue_mono_ns:>20} {dur:>9.1f} {o.op:<15} {o.comm_id[:22]:<22} "
                         f"{o.seq:>6} {o.bytes:>14,} {o.timing}")
        if len(res.ops) > limit:
            lines.append(f"... {len(res.ops) - limit} more (--json for all)")
    return "\n".join(lines)
