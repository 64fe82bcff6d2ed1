"""`steplens trace`: gathers one job's data over a window and writes it as one Perfetto trace (collector/perfetto.py).

From the store: steps, iterations, findings, each node's deep-mode windows (ModeChange events) and its NVML, host
and per-process counters. From the agents (node-local detail, paged so every answer fits one message): comm ops,
GPU kernels and raw Python stack samples of the job's ranks. A node that cannot be asked is named in the result,
and the trace holds what the store has of it.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import grpc

from steplens.collector.control.fetch import FetchError, fetch_paged
from steplens.collector.perfetto import TraceBuilder, stack_spans

MAX_WINDOW_NS = 15 * 60 * 10**9
FINDING_MARGIN_NS = 10 * 10**9   # around a finding without a deep dive: this much before its onset and after its end

NODE_COUNTERS = ("cpu_utilization_percent", "memory_used_bytes", "network_transmit_bytes_total",
                 "network_receive_bytes_total", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_SM_CLOCK",
                 "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_FB_USED",
                 "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "DCGM_FI_DEV_MEM_COPY_UTIL")
PROC_COUNTERS = ("process_cpu_percent", "process_resident_memory_bytes", "sched_runqueue_seconds_total",
                 "sched_off_cpu_seconds_total", "sched_involuntary_switches_total")
UNITS = {"bytes": "bytes", "percent": "%", "mhz": "MHz", "seconds": "s"}


@dataclass
class TraceResult:
    data: bytes
    since_ns: int
    until_ns: int
    nodes: list = field(default_factory=list)
    ranks: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)
    messages: dict = field(default_factory=dict)
    offline: list = field(default_factory=list)

    def summary(self) -> dict:
        return {"since_ns": self.since_ns, "until_ns": self.until_ns, "bytes": len(self.data), "nodes": self.nodes,
                "ranks": self.ranks, "counts": self.counts, "messages": self.messages, "offline": self.offline}


def _unit(name: str) -> str:
    for suffix, unit in UNITS.items():
        if f"_{suffix}" in name:
            return unit
    return "count"


def _rates(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """A cumulative counter as a per-second rate between samples (a reset gives no point)."""
    out = []
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if t1 > t0 and v1 >= v0:
            out.append((t1, (v1 - v0) / ((t1 - t0) / 1e9)))
    return out


def window_of(reader, job_key: str, finding_id: str, since_ns: int, until_ns: int, now_ns: int) -> tuple[int, int]:
    """The trace's window: the finding's deep dive (or the finding with a margin each side), else since/until."""
    if finding_id:
        found = reader.findings(job_key, ids=[finding_id]) if hasattr(reader, "findings") else []
        if not found:
            raise FetchError(grpc.StatusCode.NOT_FOUND, f"no finding {finding_id!r} of job {job_key!r}")
        f = found[0]
        d = reader.deep_dives_for([f]).get(f.id) if hasattr(reader, "deep_dives_for") else None
        if d and d["start_ns"]:
            return min(d["reference_since_ns"] or d["start_ns"], d["start_ns"]), d["start_ns"] + d["duration_ns"]
        return f.onset_ns - FINDING_MARGIN_NS, (f.resolved_ns or f.last_ns) + FINDING_MARGIN_NS
    until = until_ns or now_ns
    since = since_ns or until - 60 * 10**9
    return since, until


async def build_trace(ingest, reader, clock, job_key: str, since_ns: int, until_ns: int, finding_id: str = "",
                      fetch: bool = True) -> TraceResult:
    if not job_key:
        raise FetchError(grpc.StatusCode.INVALID_ARGUMENT, "job_key is required (see `steplens jobs`)")
    since, until = await asyncio.to_thread(window_of, reader, job_key, finding_id, since_ns, until_ns,
                                           clock.now_ns())
    if until <= since:
        raise FetchError(grpc.StatusCode.INVALID_ARGUMENT, "the window is empty: since is not before until")
    if until - since > MAX_WINDOW_NS:
        raise FetchError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"the window is {(until - since) / 60e9:.1f} min; at most {MAX_WINDOW_NS / 60e9:.0f} min "
                         "(narrow --since/--until)")
    procs = [p for p in await asyncio.to_thread(reader.procs) if p["job_key"] == job_key]
    if not procs:
        raise FetchError(grpc.StatusCode.NOT_FOUND, f"no process of job {job_key!r} is known")
    res = TraceResult(b"", since, until)
    got_rows: list[dict] = []
    if fetch and ingest is not None:
        got = await fetch_paged(ingest, reader, clock, job_key, [], since, until, ["commops", "kernels", "stacks"])
        got_rows, res.messages, res.offline = got.rows, got.messages, got.offline
    store = await asyncio.to_thread(_store_rows, reader, job_key, procs, since, until)
    res.data, stats = await asyncio.to_thread(_build, job_key, procs, store, got_rows, since, until)
    res.nodes = sorted({p["node_id"] for p in procs})
    res.ranks = sorted({p["rank"] for p in procs if p["rank"] is not None and p["rank"] >= 0})
    res.counts = {"tracks": stats.tracks, "slices": stats.slices, "counters": stats.counters, "flows": stats.flows,
                  "clipped": stats.clipped, **stats.by_kind}
    return res


def _store_rows(reader, job_key: str, procs: list[dict], since: int, until: int) -> dict:
    nodes = sorted({p["node_id"] for p in procs})
    out: dict = {"steps": [r for r in reader.steps(job_key, since_ns=since) if r["start_ns"] <= until],
                 "iterations": reader.iterations(job_key, since, until) if hasattr(reader, "iterations") else [],
                 "findings": [f for f in reader.findings(job_key) if f.onset_ns <= until and
                              (f.resolved_ns or f.last_ns) >= since],
                 "modes": {}, "node_metrics": {}, "proc_metrics": {}}
    for node in nodes:
        out["modes"][node] = reader.node_events(node, ("mode",), since - 3600 * 10**9, until, limit=10_000)
        out["node_metrics"][node] = reader.metric_points(node, list(NODE_COUNTERS), None, since, until)
        ents = [f"pid:{p['pid']}:{p['start_ticks']}" for p in procs if p["node_id"] == node]
        out["proc_metrics"][node] = reader.metric_points(node, list(PROC_COUNTERS), ents, since, until)
    return out


def _build(job_key: str, procs: list[dict], store: dict, fetched: list[dict], since: int, until: int):
    b = TraceBuilder()
    top = b.track(("findings", job_key), f"findings · {job_key}", order=0)
    for f in sorted(store["findings"], key=lambda f: f.onset_ns):
        s = f.suspects[0] if f.suspects else None
        b.slice(b.track(("finding", f.id), f"{f.kind} · {f.detector}", top), max(since, f.onset_ns),
                min(until, max(f.onset_ns + 1, f.resolved_ns or f.last_ns)), f.summary[:200],
                {"id": f.id, "severity": round(f.severity, 4), "status": f.status,
                 "suspect": f"{s.kind} {s.id} ({s.cause})" if s else None}, kind="finding")
    rank_of = {(p["node_id"], p["pid"]): p["rank"] for p in procs}
    by_node: dict[str, list[dict]] = {}
    for p in procs:
        by_node.setdefault(p["node_id"], []).append(p)
    node_track, rank_track = {}, {}
    for i, node in enumerate(sorted(by_node)):
        nt = node_track[node] = b.track(("node", node), f"node {node}", order=i + 1)
        _modes(b, nt, node, store["modes"].get(node, []), since, until)
        for (name, entity), pts in sorted(store["node_metrics"].get(node, {}).items()):
            pts = _rates(pts) if name.endswith("_total") else pts
            label = name.replace("_total", "_per_s") + (f" {entity}" if entity else "")
            ct = b.track(("nc", node, name, entity), label, nt, counter_unit=_unit(name))
            for ts, v in pts:
                b.counter(ct, ts, v)
        for j, p in enumerate(sorted(by_node[node], key=lambda p: (p["rank"] if p["rank"] is not None else -1,
                                                                    p["pid"]))):
            key = (node, p["pid"])
            rt = rank_track[key] = b.track(("rank", node, p["pid"], p["start_ticks"]),
                                           f"rank {p['rank']} · pid {p['pid']}" if (p["rank"] or 0) >= 0 else
                                           f"process · pid {p['pid']}", nt, order=100 + j)   # no rank: a server
            ent = f"pid:{p['pid']}:{p['start_ticks']}"
            for (name, entity), pts in sorted(store["proc_metrics"].get(node, {}).items()):
                if entity != ent:
                    continue
                pts = _rates(pts) if name.endswith("_total") else pts
                ct = b.track(("pc", node, p["pid"], name), name.replace("_total", "_per_s"), rt,
                             counter_unit=_unit(name))
                for ts, v in pts:
                    b.counter(ct, ts, v)
    by_rank = {}
    for key, rt in rank_track.items():
        by_rank.setdefault(rank_of[key], rt)
    for st in sorted(store["steps"], key=lambda r: r["start_ns"]):
        rt = rank_track.get((st.get("node_id"), st.get("pid"))) or by_rank.get(st["rank"])
        if rt is not None:
            b.slice(b.track(("steps", rt), "steps", rt, order=0), st["start_ns"], st["end_ns"], f"step {st['step']}",
                    {"evidence": st.get("evidence")}, kind="step")
    for it in sorted(store["iterations"], key=lambda r: r["start_ns"]):
        rt = rank_track.get((it.get("node_id"), it.get("pid"))) or by_rank.get(it.get("rank"))
        if rt is not None:
            b.slice(b.track(("iters", rt), "iterations", rt, order=1), it["start_ns"], it["end_ns"],
                    f"{it.get('phase') or 'iteration'} {it.get('seq')}",
                    {k: it.get(k) for k in ("batch_size", "tokens", "micro_batches", "kv_tokens")}, kind="iteration")
    _stacks(b, [r for r in fetched if r["kind"] == "stack_sample"], rank_track, until)
    _commops(b, [r for r in fetched if r["kind"] == "commop"], rank_track, by_rank)
    for k in (r for r in fetched if r["kind"] == "kernel"):
        rt = rank_track.get((k.get("node_id"), k.get("pid"))) or by_rank.get(k.get("rank"))
        if rt is None or not k["start_ns"] or not k["end_ns"]:
            continue
        b.slice(b.track(("stream", rt, k["device"], k["stream"]), f"stream {k['device']}:{k['stream']}", rt,
                        order=40), k["start_ns"], k["end_ns"], k["name"][:120],
                {"grid": json.dumps(k["grid"]), "block": json.dumps(k["block"]),
                 "issue_latency_ns": k.get("issue_latency_ns")}, kind="kernel")
    return b.serialize(), b.stats


def _modes(b: TraceBuilder, nt: int, node: str, events: list[dict], since: int, until: int) -> None:
    """Deep-mode windows from the node's ModeChange events (entity: the mode; message names the command)."""
    start, msg = None, ""
    track = None
    for e in events:
        mode = (e.get("entity") or "").lower()
        if mode == "deep":
            start, msg = e["ts_ns"], e.get("message") or ""
        elif start is not None:
            if e["ts_ns"] >= since:
                track = track or b.track(("deep", node), "deep dives", nt, order=0)
                b.slice(track, max(since, start), e["ts_ns"], "deep mode", {"command": msg}, kind="deep_window")
            start = None
    if start is not None:
        track = track or b.track(("deep", node), "deep dives", nt, order=0)
        b.slice(track, max(since, start), until, "deep mode (open)", {"command": msg}, kind="deep_window")


def _stacks(b: TraceBuilder, samples: list[dict], rank_track: dict, until: int) -> None:
    by_thread: dict[tuple, list] = {}
    for s in samples:
        by_thread.setdefault((s.get("node_id"), s["pid"], s["tid"]), []).append(s)
    for (node, pid, tid), rows in sorted(by_thread.items()):
        rt = rank_track.get((node, pid))
        if rt is None:
            continue
        rows.sort(key=lambda r: r["ts_ns"])
        gaps = sorted(b2["ts_ns"] - a["ts_ns"] for a, b2 in zip(rows, rows[1:]) if b2["ts_ns"] > a["ts_ns"])
        period = gaps[len(gaps) // 2] if gaps else 10_000_000
        names = [(r["ts_ns"], [f"{f['qualname'] or f['function']} ({f['file'].rsplit('/', 1)[-1]}:{f['line']})"
                               for f in reversed(r["frames"])] or ["<no Python frame>"]) for r in rows]
        track = b.track(("py", rt, tid), f"python {tid}", rt, order=20)
        b.nested(track, stack_spans(names, period, until), kind="stack")


def _commops(b: TraceBuilder, ops: list[dict], rank_track: dict, by_rank: dict) -> None:
    """Comm ops per rank and communicator; each collective's members get a flow to the member that entered last.
    An op with only its enqueue time (gloo's Flight Recorder: timing cpu_enqueue) is drawn from its entry to the
    last member's entry, the time it waited for the others (arg end=inferred); a lone one as 1 us."""
    placed: dict[tuple, list] = {}   # (comm, seq, p2p seq, op) -> [(enter_ns, track, op row)]
    for op in ops:
        rt = rank_track.get((op.get("node_id"), op["pid"])) or by_rank.get(op["rank"])
        start = op["start_ns"] or op["issue_ns"]
        if rt is None or not start:
            continue
        track = b.track(("comm", rt, op["comm_id"]), f"comm {op['comm_desc'] or op['comm_id'][:12]}", rt, order=30)
        placed.setdefault((op["comm_id"], op["seq"], op["p2p_seq"], op["op"]), []).append((start, track, op))
    flows_into: dict[int, list[int]] = {}
    flows_out: dict[int, list[int]] = {}
    pairs = []
    last_entry: dict[int, int] = {}
    for key, members in placed.items():
        last = max(members, key=lambda m: m[0])
        for m in members:
            last_entry[id(m[2])] = last[0]
            if len(members) > 1 and m is not last:
                fid = len(pairs) + 1
                pairs.append((id(m[2]), id(last[2])))
                flows_out.setdefault(id(m[2]), []).append(fid)
                flows_into.setdefault(id(last[2]), []).append(fid)
    written = set()
    for start, track, op in sorted((m for ms in placed.values() for m in ms), key=lambda m: m[0]):
        end, inferred = op["end_ns"], False
        if not end:
            end, inferred = max(last_entry[id(op)], start + 1000), True
        if b.slice(track, start, end, op["op"],
                   {"seq": op["seq"], "bytes": op["bytes"], "rank": op["rank"], "nranks": op["nranks"],
                    "timing": op["timing"], "end": "inferred" if inferred else None},
                   flows=flows_out.get(id(op), ()), ends=flows_into.get(id(op), ()), kind="commop"):
            written.add(id(op))
    b.stats.flows += sum(1 for a, z in pairs if a in written and z in written)
