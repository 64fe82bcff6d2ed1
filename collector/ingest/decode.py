"""Decode and validate one batch payload (a serialized RecordList) into rows for the store.

Intrinsic checks only (what a record says about itself): a time that is zero or ahead of the
batch's send time, a non-finite value, over-long names, an unknown body. Failing records are
counted per reason and left out; the rest of the batch is kept. A payload that does not parse,
or whose record count disagrees with its header, rejects the whole batch: nothing of it is
written. Checks that need stored state (time going backwards within a series) live in the writer.
"""

from __future__ import annotations

import collections
import json
import math
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from steplens.v1 import records_pb2 as pb

MAX_NAME = 256
MAX_TEXT = 4096
FUTURE_SLACK_NS = 60 * 10**9
STEP_EVIDENCE = frozenset({"profiler", "comm_pattern", "anchor"})
ITER_PHASES = frozenset({"prefill", "decode", "mixed", "train", ""})
MAX_STEP_COMMS = 256       # communicators of one step
MAX_STEP_OFFSETS = 4096    # issue offsets of one communicator in one step


class BatchRejected(ValueError):
    """The whole batch is refused; the reason goes to the rejections table and the agent."""


@dataclass
class DecodedBatch:
    metrics: list = field(default_factory=list)    # (mono_ns, name, entity, value)
    gpus: list = field(default_factory=list)       # (mono_ns, GpuInfo msg)
    processes: list = field(default_factory=list)  # (mono_ns, ProcessInfo msg)
    exits: list = field(default_factory=list)      # (mono_ns, pid, start_ticks)
    events: list = field(default_factory=list)     # (mono_ns, source, kind, entity, message, value)
    gaps: list = field(default_factory=list)       # (mono_ns, source, Gap msg)
    modes: list = field(default_factory=list)      # (mono_ns, ModeChange msg)
    stacks: list = field(default_factory=list)     # (mono_ns, StackSummary msg)
    conns: list = field(default_factory=list)      # (mono_ns, ConnStats msg, source: netflows | tcpinfo)
    flows: list = field(default_factory=list)      # (mono_ns, Flow msg)
    comm_summaries: list = field(default_factory=list)  # (mono_ns, source, CommSummary msg)
    comm_members: list = field(default_factory=list)    # (mono_ns, CommMember msg)
    comm_progress: list = field(default_factory=list)   # (mono_ns, CommProgress msg)
    steps: list = field(default_factory=list)           # (mono_ns, source, Step msg)
    iterations: list = field(default_factory=list)      # (mono_ns, Iteration msg)
    rejected: collections.Counter = field(default_factory=collections.Counter)
    n_records: int = 0


def decode_batch(payload: bytes, n_records: int, sent_mono_ns: int) -> DecodedBatch:
    try:
        rl = pb.RecordList.FromString(payload)
    except (DecodeError, ValueError) as exc:
        raise BatchRejected(f"malformed records payload: {exc}") from None
    recs = rl.records
    if len(recs) != n_records:
        raise BatchRejected(f"batch header says {n_records} records, payload has {len(recs)}")
    out = DecodedBatch(n_records=n_records)
    limit = sent_mono_ns + FUTURE_SLACK_NS if sent_mono_ns else 1 << 63
    rej = out.rejected
    metrics_append = out.metrics.append
    isfinite = math.isfinite
    for rec in recs:
        mono = rec.mono_ns
        if mono == 0:
            rej["missing time (mono_ns = 0)"] += 1
            continue
        if mono > limit:
            rej["time ahead of the batch's send time"] += 1
            continue
        kind = rec.WhichOneof("body")
        if kind == "metric":
            m = rec.metric
            v = m.value
            if not isfinite(v):
                rej["non-finite metric value"] += 1
                continue
            name, entity = m.name, m.entity
            if not name or len(name) > MAX_NAME or len(entity) > MAX_NAME:
                rej["metric name or entity empty or too long"] += 1
                continue
            metrics_append((mono, name, entity, v))
        elif kind == "process":
            out.processes.append((mono, rec.process))
        elif kind == "process_exit":
            out.exits.append((mono, rec.process_exit.pid, rec.process_exit.start_ticks))
        elif kind == "gpu":
            if not rec.gpu.uuid:
                rej["gpu record without uuid"] += 1
                continue
            out.gpus.append((mono, rec.gpu))
        elif kind == "event":
            e = rec.event
            if not e.kind or len(e.kind) > MAX_NAME or len(e.message) > MAX_TEXT:
                rej["event kind empty or text too long"] += 1
                continue
            v = e.value if isfinite(e.value) else 0.0
            out.events.append((mono, rec.source, e.kind, e.entity, e.message, v))
        elif kind == "gap":
            out.gaps.append((mono, rec.source, rec.gap))
        elif kind == "mode":
            out.modes.append((mono, rec.mode))
        elif kind in ("conn", "flow"):
            body = rec.conn if kind == "conn" else rec.flow
            if body.start_mono_ns > mono or not body.src or not body.dst or body.sport > 65535 or body.dport > 65535:
                rej[f"{kind} record with bad addresses, ports or times"] += 1
                continue
            if kind == "conn":
                out.conns.append((mono, body, rec.source))
            else:
                out.flows.append((mono, body))
        elif kind == "stacks":
            st = rec.stacks
            n_frames = len(st.frames)
            if not st.samples or st.start_mono_ns > mono or any(
                    i >= n_frames for c in st.stacks for i in c.frame_ids):
                rej["stack summary with bad frame ids or times"] += 1
                continue
            out.stacks.append((mono, st))
        elif kind == "comm_summary":
            c = rec.comm_summary
            if c.start_mono_ns > mono or not c.op or len(c.comm_id) > MAX_NAME or len(c.job_key) > MAX_NAME:
                rej["comm summary with bad times or names"] += 1
                continue
            out.comm_summaries.append((mono, rec.source, c))
        elif kind == "comm_member":
            c = rec.comm_member
            if not c.comm_id or len(c.comm_id) > MAX_NAME or len(c.host) > MAX_NAME or c.rank < 0 or c.nranks <= c.rank:
                rej["comm member with bad id, host or rank"] += 1
                continue
            out.comm_members.append((mono, c))
        elif kind == "comm_progress":
            reason = comm_progress_problem(rec.comm_progress, mono)
            if reason:
                rej[f"comm progress with {reason}"] += 1
                continue
            out.comm_progress.append((mono, rec.comm_progress))
        elif kind == "step":
            st = rec.step
            if (st.start_mono_ns > st.end_mono_ns or st.end_mono_ns > mono or st.evidence not in STEP_EVIDENCE
                    or len(st.job_key) > MAX_NAME or len(st.comms) > MAX_STEP_COMMS
                    or any(len(c.comm_id) > MAX_NAME or len(c.op) > MAX_NAME
                           or len(c.issue_offsets_ns) > MAX_STEP_OFFSETS for c in st.comms)):
                rej["step with bad times, evidence, names or sizes"] += 1
                continue
            out.steps.append((mono, rec.source, st))
        elif kind == "iteration":
            it = rec.iteration
            if (it.start_mono_ns > it.end_mono_ns or it.end_mono_ns > mono or not it.start_mono_ns
                    or it.phase not in ITER_PHASES or not it.anchor or len(it.anchor) > MAX_NAME
                    or len(it.job_key) > MAX_NAME):
                rej["iteration with bad times, phase or names"] += 1
                continue
            out.iterations.append((mono, it))
        elif kind in ("commop", "kernel"):
            rej[f"{kind} record sent upstream (node-local detail: fetched on demand, not streamed)"] += 1
        else:
            rej["record with no known body"] += 1
    return out


def comm_progress_problem(c, mono: int) -> str:
    """"" when a CommProgress record is consistent, else what is wrong with it (the rejection reason's tail)."""
    if not c.comm_id or len(c.comm_id) > MAX_NAME or not c.job_key or len(c.job_key) > MAX_NAME:
        return "an empty or too long comm_id or job_key"
    if len(c.pending_op) > MAX_NAME:
        return "a too long pending_op"
    if min(c.last_enqueued, c.last_started, c.last_completed, c.pending_seq) < -1 or c.rank < -1 \
            or c.pending_peer < -1:
        return "a sequence number, rank or peer below -1"
    if c.pending_since_mono_ns > mono:
        return "a pending op issued after the record's time"
    if c.pending_op:  # pending_since_mono_ns 0 is allowed: the agent could not convert the op's issue time
        if c.pending_seq < 0:
            return "a pending op without its sequence number"
    elif c.pending_seq != -1 or c.pending_since_mono_ns or c.pending_p2p or c.pending_peer != -1:
        return "pending fields without a pending op"
    return ""


def stacks_json(st) -> str:
    """A StackSummary's stacks as JSON: [{"count", "gil", "running", "frames": [[fn, qualname, file, line]...]}]."""
    frames = [(f.function, f.qualname, f.file, f.line) for f in st.frames]
    return json.dumps([{"count": c.count, "gil": c.gil, "running": c.running,
                        "frames": [frames[i] for i in c.frame_ids]} for c in st.stacks],
                      ensure_ascii=False, separators=(",", ":"))


def process_row(proc) -> dict:
    return {"pid": proc.pid, "start_ticks": proc.start_ticks, "ppid": proc.ppid, "exe": proc.exe,
            "cmdline": json.dumps(list(proc.cmdline), ensure_ascii=False), "framework": proc.framework, "job_key": proc.job_key,
            "rank": proc.rank, "local_rank": proc.local_rank, "world_size": proc.world_size,
            "master_addr": proc.master_addr, "master_port": proc.master_port,
            "env_json": json.dumps(dict(proc.env), sort_keys=True, ensure_ascii=False), "container_id": proc.container_id,
            "uid": proc.uid}


def detail_json(payload: bytes, to_cluster) -> list[dict]:
    """A FetchDetail answer (RecordList) as plain rows with cluster times, for operators."""
    try:
        rl = pb.RecordList.FromString(payload)
    except (DecodeError, ValueError) as exc:
        raise BatchRejected(f"malformed detail payload: {exc}") from None
    out = []

    def t(mono: int) -> int:
        return to_cluster(mono) if mono else 0

    for rec in rl.records:
        body = rec.WhichOneof("body")
        if body == "commop":
            c = rec.commop
            out.append({"kind": "commop", "source": rec.source, "timing": c.timing, "rank": c.rank,
                        "group_rank": c.group_rank, "nranks": c.nranks, "members": list(c.members),
                        "comm_id": c.comm_id, "comm_desc": c.comm_desc, "op": c.op, "seq": c.seq,
                        "p2p_seq": c.p2p_seq, "peer": c.peer, "root": c.root, "count": c.count, "dtype": c.dtype,
                        "bytes": c.bytes, "pid": c.pid, "tid": c.tid, "device": c.device, "stream": c.stream,
                        "job_key": c.job_key, "issue_ns": t(c.issue_mono_ns), "start_ns": t(c.start_mono_ns),
                        "end_ns": t(c.end_mono_ns), "ts_ns": t(rec.mono_ns)})
            continue
        if body == "kernel":
            k = rec.kernel
            out.append({"kind": "kernel", "source": rec.source, "rank": k.rank, "pid": k.pid, "tid": k.tid,
                        "device": k.device, "stream": k.stream, "name": k.name, "grid": list(k.grid),
                        "block": list(k.block), "start_ns": t(k.start_mono_ns), "end_ns": t(k.end_mono_ns),
                        "correlation_id": k.correlation_id, "launch_api": k.launch_api,
                        "launch_start_ns": t(k.launch_start_mono_ns), "launch_end_ns": t(k.launch_end_mono_ns),
                        "issue_latency_ns": (k.start_mono_ns - k.launch_start_mono_ns)
                        if k.launch_start_mono_ns and k.start_mono_ns else None,
                        "graph_id": k.graph_id, "ts_ns": t(rec.mono_ns)})
            continue
        if body == "stacks":
            st = rec.stacks
            frames = [{"function": f.function, "qualname": f.qualname, "file": f.file, "line": f.line}
                      for f in st.frames]
            for c in st.stacks:
                out.append({"kind": "stack_sample", "ts_ns": to_cluster(rec.mono_ns), "pid": st.pid, "tid": st.tid,
                            "gil": bool(c.gil), "state": st.last_state,
                            "frames": [frames[i] for i in c.frame_ids]})
    return out


def step_comms_json(st) -> str:
    """A Step's per-communicator summaries as JSON (the steps table's comms_json)."""
    return json.dumps([{"comm_id": c.comm_id, "op": c.op, "calls": c.calls, "bytes": c.bytes, "busy_ns": c.busy_ns,
                        "wait_ns": c.wait_ns, "seq_first": c.seq_first, "issue_offsets_ns": list(c.issue_offsets_ns),
                        "offsets_dropped": c.offsets_dropped} for c in st.comms], separators=(",", ":"))
