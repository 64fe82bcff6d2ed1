"""Encode agent Records into protobuf batch payloads: the only agent module that knows protobuf
besides the stream client. The collector's ingest/decode.py is the inverse; a round-trip test
keeps the two in step.
"""

from __future__ import annotations

from steplens.agent import records as r
from steplens.v1 import records_pb2 as pb


_KNOWN = frozenset({r.Metric, r.ProcessInfo, r.ProcessExit, r.GpuInfo, r.Event, r.Gap, r.ModeChange,
                    r.StackSummary, r.ConnStats, r.Flow, r.CommOp, r.KernelRec, r.CommSummary,
                    r.CommMember, r.Step, r.CommProgress, r.Iteration})
_STEP_FIELDS = tuple(n for n in r.Step.__slots__ if n not in ("mono_ns", "comms"))
_STEPCOMM_FIELDS = tuple(n for n in r.StepComm.__slots__ if n != "issue_offsets_ns")

# Records whose dataclass fields are named exactly like their protobuf message's fields (plus mono_ns):
# encoded and decoded field by field. The value is the Record.body oneof name.
_PLAIN = {r.CommOp: "commop", r.KernelRec: "kernel", r.CommSummary: "comm_summary", r.CommMember: "comm_member",
          r.CommProgress: "comm_progress", r.Iteration: "iteration"}
_PLAIN_BY_BODY = {body: t for t, body in _PLAIN.items()}
_FIELDS = {t: tuple(n for n in t.__slots__ if n != "mono_ns") for t in _PLAIN}
_REPEATED = {t: frozenset(n for n in _FIELDS[t] if n in ("members", "grid", "block")) for t in _PLAIN}



def encode_records(items: list[tuple[str, object]]) -> bytes:
    """(source name, record) pairs -> serialized RecordList."""
    out = pb.RecordList()
    add = out.records.add
    for source, rec in items:
        t = type(rec)
        if t not in _KNOWN:
            raise TypeError(f"source {source!r} emitted {t.__name__}, which is not a steplens record")
        msg = add()
        msg.mono_ns = rec.mono_ns
        msg.source = source
        body = _PLAIN.get(t)
        if body is not None:
            m = getattr(msg, body)
            rep = _REPEATED[t]
            for name in _FIELDS[t]:
                if name in rep:
                    getattr(m, name).extend(getattr(rec, name))
                else:
                    setattr(m, name, getattr(rec, name))
        elif t is r.Metric:
            m = msg.metric
            m.name = rec.name
            m.entity = rec.entity
            m.value = rec.value
        elif t is r.ProcessInfo:
            p = msg.process
            p.pid = rec.pid
            p.ppid = rec.ppid
            p.start_ticks = rec.start_ticks
            p.exe = rec.exe
            p.cmdline.extend(rec.cmdline)
            p.framework = rec.framework
            p.job_key = rec.job_key
            p.rank = rec.rank
            p.local_rank = rec.local_rank
            p.world_size = rec.world_size
            p.master_addr = rec.master_addr
            p.master_port = rec.master_port
            p.env.update(rec.env)
            p.container_id = rec.container_id
            p.uid = rec.uid
        elif t is r.ProcessExit:
            msg.process_exit.pid = rec.pid
            msg.process_exit.start_ticks = rec.start_ticks
        elif t is r.GpuInfo:
            g = msg.gpu
            g.index = rec.index
            g.uuid = rec.uuid
            g.name = rec.name
            g.pci_bus_id = rec.pci_bus_id
            g.memory_total_bytes = rec.memory_total_bytes
            g.driver_version = rec.driver_version
            g.cuda_driver_version = rec.cuda_driver_version
            g.nvlink_count = rec.nvlink_count
            g.serial = rec.serial
        elif t is r.Event:
            e = msg.event
            e.kind = rec.kind
            e.entity = rec.entity
            e.message = rec.message
            e.value = rec.value
        elif t is r.Gap:
            g = msg.gap
            g.dropped_records = rec.dropped_records
            g.dropped_batches = rec.dropped_batches
            g.first_seq = rec.first_seq
            g.last_seq = rec.last_seq
            g.reason = rec.reason
        elif t is r.StackSummary:
            st = msg.stacks
            st.pid = rec.pid
            st.start_ticks = rec.start_ticks
            st.tid = rec.tid
            st.thread_name = rec.thread_name
            st.start_mono_ns = rec.start_mono_ns
            st.samples = rec.samples
            st.errors = rec.errors
            st.python = rec.python
            st.last_state = rec.last_state
            for i, (fn, qn, file, line) in enumerate(rec.frames):
                st.frames.add(id=i, function=fn, qualname=qn, file=file, line=line)
            for ids, count, gil, running in rec.stacks:
                st.stacks.add(frame_ids=ids, count=count, gil=gil, running=running)
        elif t is r.ConnStats:
            c = msg.conn
            c.start_mono_ns = rec.start_mono_ns
            c.src, c.sport, c.dst, c.dport = rec.src, rec.sport, rec.dst, rec.dport
            c.tx_bytes, c.rx_bytes, c.tx_packets, c.rx_packets = rec.tx_bytes, rec.rx_bytes, rec.tx_packets, rec.rx_packets
            c.tx_payload_bytes, c.rx_payload_bytes = rec.tx_payload_bytes, rec.rx_payload_bytes
            c.retransmits, c.srtt_us, c.pid, c.comm = rec.retransmits, rec.srtt_us, rec.pid, rec.comm
            c.net_limited_us = rec.net_limited_us
        elif t is r.Flow:
            f = msg.flow
            f.start_mono_ns = rec.start_mono_ns
            f.src, f.sport, f.dst, f.dport = rec.src, rec.sport, rec.dst, rec.dport
            f.bytes, f.packets, f.pid = rec.bytes, rec.packets, rec.pid
        elif t is r.Step:
            m = msg.step
            for name in _STEP_FIELDS:
                setattr(m, name, getattr(rec, name))
            for c in rec.comms:
                mc = m.comms.add()
                for name in _STEPCOMM_FIELDS:
                    setattr(mc, name, getattr(c, name))
                mc.issue_offsets_ns.extend(c.issue_offsets_ns)
        elif t is r.ModeChange:
            m = msg.mode
            m.mode = int(rec.mode)
            m.command_id = rec.command_id
            m.until_mono_ns = rec.until_mono_ns
            m.reason = rec.reason
    return out.SerializeToString()


def encode_record(source: str, rec) -> bytes:
    """One serialized Record message (the node-local detail store keeps these; concatenating
    length-delimited Records is not needed: a fetch re-wraps them into a RecordList)."""
    return split_payload(encode_records([(source, rec)]))[0]


def encode_each(source: str, records: list) -> list:
    """Each record as its own serialized Record message, in one encoding pass; where the pass fails (a value out
    of its field's range), record by record: an entry is then the exception instead of bytes."""
    try:
        return split_payload(encode_records([(source, rec) for rec in records]))
    except (ValueError, TypeError, OverflowError):
        out: list = []
        for rec in records:
            try:
                out.append(encode_record(source, rec))
            except (ValueError, TypeError, OverflowError) as exc:
                out.append(exc)
        return out


_INT_RANGES = {"int32": (-(1 << 31), 1 << 31), "uint32": (0, 1 << 32), "int64": (-(1 << 63), 1 << 63),
               "uint64": (0, 1 << 64)}
_CHECKERS: dict[type, object] = {}


def _field_kind(fd) -> str | None:
    """'int32' | 'uint32' | 'int64' | 'uint64' for an integer field, 'string' for a string, None otherwise."""
    from google.protobuf.descriptor import FieldDescriptor as FD
    return {FD.CPPTYPE_INT32: "int32", FD.CPPTYPE_UINT32: "uint32", FD.CPPTYPE_INT64: "int64",
            FD.CPPTYPE_UINT64: "uint64", FD.CPPTYPE_STRING: "string"}.get(fd.cpp_type)


def record_problem(rec) -> str | None:
    """None where encode_records would take this plain record (CommOp, KernelRec, ...: _PLAIN), else the first
    field it would refuse ("bytes: -8 is not a uint64"), without encoding it: what the node-local detail store
    checks when it keeps records unencoded (agent/detail.py). One function per record type, generated from the
    protobuf descriptor at first use (a type check and a range check per field: ~1.3 µs for a CommOp on the 2-core
    VM, against ~5 µs to encode it)."""
    t = type(rec)
    check = _CHECKERS.get(t)
    if check is None:
        if t not in _PLAIN:
            raise TypeError(f"{t.__name__} is not a plain record")
        check = _CHECKERS[t] = _make_checker(t)
    return check(rec)


def _make_checker(t: type):
    desc = pb.Record.DESCRIPTOR.fields_by_name[_PLAIN[t]].message_type
    lines = ["def check(rec):"]
    for name in t.__slots__:
        fd = None if name == "mono_ns" else desc.fields_by_name[name]   # Record.mono_ns: a uint64
        kind = "uint64" if fd is None else _field_kind(fd)
        if kind == "string":
            lines.append(f"    if type(rec.{name}) is not str: return {name!r} + ': ' + repr(rec.{name})[:40] + "
                         "' is not a string'")
            continue
        if kind is None:
            raise TypeError(f"{t.__name__}.{name}: a field type record_problem does not check")
        lo, hi = _INT_RANGES[kind]
        test = f"type(v) is not int or not {lo} <= v < {hi}"
        why = f"{name!r} + ': ' + repr(v)[:40] + ' is not a{'n' if kind[0] == 'i' else ''} {kind}'"
        if fd is not None and fd.is_repeated:
            lines.append(f"    v = rec.{name}\n    if type(v) is not list and type(v) is not tuple: "
                         f"return {name!r} + ': ' + repr(v)[:40] + ' is not a list'")
            lines.append(f"    for v in rec.{name}:\n        if {test}: return {why}")
        else:
            lines.append(f"    v = rec.{name}\n    if {test}: return {why}")
    lines.append("    return None")
    ns: dict = {}
    exec("\n".join(lines), ns)  # generated once per type, as dataclasses generates __init__
    return ns["check"]


def split_payload(payload: bytes) -> list[bytes]:
    """A serialized RecordList -> its serialized Record messages, without decoding them (the inverse of
    records_payload: each is field 1, wire type 2, a varint length, then the message)."""
    out, i, n = [], 0, len(payload)
    while i < n:
        if payload[i] != 0x0A:
            raise ValueError(f"not a RecordList: tag {payload[i]:#x} at byte {i}")
        i += 1
        size = shift = 0
        while True:
            byte = payload[i]
            i += 1
            size |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
        out.append(payload[i:i + size])
        i += size
    return out


def records_payload(records: list[bytes]) -> bytes:
    """Serialized Record messages -> one RecordList payload, without decoding them: field 1 of RecordList is
    `repeated Record records`, so the payload is each record prefixed by its tag and length."""
    parts = []
    for b in records:
        n, varint = len(b), bytearray()
        while True:
            byte = n & 0x7F
            n >>= 7
            varint.append(byte | (0x80 if n else 0))
            if not n:
                break
        parts.append(b"\x0a" + bytes(varint) + b)
    return b"".join(parts)


def decode_records(payload: bytes) -> list[tuple[str, object]]:
    """The inverse of encode_records, for the node-local detail path and tests."""
    out = pb.RecordList.FromString(payload)
    items: list[tuple[str, object]] = []
    for msg in out.records:
        kind = msg.WhichOneof("body")
        plain = _PLAIN_BY_BODY.get(kind)
        if plain is not None:
            m = getattr(msg, kind)
            rep = _REPEATED[plain]
            rec = plain(msg.mono_ns, **{n: (list(getattr(m, n)) if n in rep else getattr(m, n))
                                        for n in _FIELDS[plain]})
        elif kind == "metric":
            rec = r.Metric(msg.mono_ns, msg.metric.name, msg.metric.entity, msg.metric.value)
        elif kind == "process":
            p = msg.process
            rec = r.ProcessInfo(msg.mono_ns, p.pid, p.start_ticks, p.ppid, p.exe, list(p.cmdline), p.framework,
                                p.job_key, p.rank, p.local_rank, p.world_size, p.master_addr, p.master_port,
                                dict(p.env), p.container_id, p.uid)
        elif kind == "process_exit":
            rec = r.ProcessExit(msg.mono_ns, msg.process_exit.pid, msg.process_exit.start_ticks)
        elif kind == "gpu":
            g = msg.gpu
            rec = r.GpuInfo(msg.mono_ns, g.index, g.uuid, g.name, g.pci_bus_id, g.memory_total_bytes,
                            g.driver_version, g.cuda_driver_version, g.nvlink_count, g.serial)
        elif kind == "event":
            e = msg.event
            rec = r.Event(msg.mono_ns, e.kind, e.entity, e.message, e.value)
        elif kind == "gap":
            g = msg.gap
            rec = r.Gap(msg.mono_ns, g.dropped_records, g.dropped_batches, g.first_seq, g.last_seq, g.reason)
        elif kind == "mode":
            m = msg.mode
            rec = r.ModeChange(msg.mono_ns, r.Mode(m.mode), m.command_id, m.until_mono_ns, m.reason)
        elif kind == "conn":
            c = msg.conn
            rec = r.ConnStats(msg.mono_ns, c.start_mono_ns, c.src, c.sport, c.dst, c.dport, c.tx_bytes, c.rx_bytes,
                              c.tx_packets, c.rx_packets, c.tx_payload_bytes, c.rx_payload_bytes, c.retransmits,
                              c.srtt_us, c.pid, c.comm, c.net_limited_us)
        elif kind == "flow":
            f = msg.flow
            rec = r.Flow(msg.mono_ns, f.start_mono_ns, f.src, f.sport, f.dst, f.dport, f.bytes, f.packets, f.pid)
        elif kind == "step":
            m = msg.step
            rec = r.Step(msg.mono_ns, **{n: getattr(m, n) for n in _STEP_FIELDS},
                         comms=[r.StepComm(**{n: getattr(c, n) for n in _STEPCOMM_FIELDS},
                                           issue_offsets_ns=list(c.issue_offsets_ns)) for c in m.comms])
        elif kind == "stacks":
            st = msg.stacks
            rec = r.StackSummary(msg.mono_ns, st.pid, st.start_ticks, st.tid, st.thread_name, st.start_mono_ns,
                                 st.samples, [(f.function, f.qualname, f.file, f.line) for f in st.frames],
                                 [(tuple(c.frame_ids), c.count, c.gil, c.running) for c in st.stacks],
                                 st.errors, st.python, st.last_state)
        else:
            raise ValueError(f"record with unknown body {kind!r}")
        items.append((msg.source, rec))
    return items
