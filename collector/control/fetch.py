"""Progressive fetching: node-local CommOps (and kernels) of one job, asked of the agents that host its ranks.

Used by Control's FetchCommOps (an operator's `steplens commops`) and by the analysis engine's AnalysisReader
(a detector's `reader.fetch_commops`, from the analysis thread through run_coroutine_threadsafe), so a
localization search pulls detail only from the ranks it visits (Holmes §4.3). Every agent is asked
concurrently over its command channel; answers are merged in cluster time.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field

import grpc


class FetchError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Fetched:
    rows: list = field(default_factory=list)      # JSON-ready records, cluster times, each with node_id
    messages: dict = field(default_factory=dict)  # node -> the agent's answer
    offline: list = field(default_factory=list)   # nodes of the job that could not be asked


@dataclass
class _Span:
    lo: int               # the agent's clock (ns), inclusive: every record of the key in [lo, hi] is in items
    hi: int
    items: list           # (the record's time on the agent's clock, its detail_json row), oldest first
    used: int = 0         # the cache's use counter when last asked (least recently used goes first)


class DetailCache:
    """What the analysis engine fetched from the agents, kept so that asking again for a window that overlaps one
    asked before asks each agent only for the parts it has not answered: an open episode's localization (the cog
    walk, the probes) runs at every analysis pass over a window that slides and grows, and each ask costs the
    agent its ring reads, a store query and the encoding of every record (a healthy 8-rank job on the 2-core VM:
    32 asks in 90 s, ~4 ms of the agent's CPU each, almost all of its transport thread's; bench/README.md).

    Kept per (node, its boot, job, kinds, ranks, pids) as spans of the agent's clock (several: two episodes of a
    job are asked about in turn): the agent selects records by their time on its own clock, so the seams between
    what is kept and what is asked are exact there (in cluster time they would move with each clock estimate);
    each row's agent time is its cluster time mapped back through the estimate that made it. Only the settled
    part of an answer is kept: records at least `settle_ns` before the collector's now (a comm op reaches the
    node's store once retired and its ring read: the newest seconds of a window may still gain records); the rest
    is asked again next time (gloo's Flight Recorder ops are timed by their issue: one issued inside a kept span
    that took longer than settle_ns to complete is not in later answers from here; a hang's ops, never
    retired, are in no answer either way). An answer the agent truncated, or a fetch with a row limit, is
    neither kept nor served from here. Bounds: `max_spans` spans per key, each `span_ns` of the agent's clock at
    most (its oldest records go first), and `max_rows` rows in all (the least recently asked span goes first).
    Used from the event loop only (fetch_commops)."""

    def __init__(self, settle_ns: int = 10_000_000_000, span_ns: int = 600_000_000_000, max_spans: int = 8,
                 max_rows: int = 30_000) -> None:   # ~1.7 KB a row (a CommOp's dict): ~50 MB at most
        self.settle_ns, self.span_ns, self.max_spans, self.max_rows = settle_ns, span_ns, max_spans, max_rows
        self.spans: dict[tuple, list[_Span]] = {}   # key -> its spans, by lo, none adjoining another
        self.rows = 0
        self._uses = 0
        self.rows_served = 0      # rows answered from here
        self.asks_saved = 0       # asks of a node answered from here alone

    @staticmethod
    def key(node: str, session, nclock, job_key: str, kinds, ranks, pids) -> tuple:
        # the node's boot where the session says (a local one), and the clock offset to the second: an agent
        # whose host rebooted counts its clock from 0 again, and what was kept of it is no longer addressable
        return (node, getattr(session, "boot_id", ""), nclock.offset_ns // 1_000_000_000, job_key, tuple(kinds),
                tuple(ranks), tuple(pids))

    def plan(self, key: tuple, lo: int, hi: int) -> tuple[list, list]:
        """([(lo, hi), ...] still to ask of the agent, the rows kept of its [lo, hi]) for a fetch of the agent's
        clock range [lo, hi]."""
        asks, kept, at = [], [], lo
        for span in self.spans.get(key, ()):
            if span.hi < lo or span.lo > hi:
                continue
            self._uses += 1
            span.used = self._uses
            if span.lo > at:
                asks.append((at, span.lo - 1))
            kept += [row for mono, row in span.items if lo <= mono <= hi]
            at = span.hi + 1
        if at <= hi:
            asks.append((at, hi))
        self.rows_served += len(kept)
        self.asks_saved += not asks
        return asks, kept

    def store(self, key: tuple, asked: list, fetched: list, to_agent, settled_mono: int) -> None:
        """The answers to `asked` (agent clock ranges, each answered whole) were the rows `fetched` (cluster times
        made by the estimate whose inverse is to_agent): keep their part up to settled_mono, joined to the spans
        kept of the key that they adjoin."""
        monos = sorted(((to_agent(row["ts_ns"]), row) for row in fetched),
                       key=lambda it: (it[0], it[1].get("rank", -1)))
        spans = self.spans.setdefault(key, [])
        for a, b in asked:
            b = min(b, settled_mono)
            # a part that another fetch of the key stored meanwhile (two asks in flight at once) is not kept twice
            if b >= a and not any(sp.lo <= b and a <= sp.hi for sp in spans):
                spans.append(_Span(a, b, [it for it in monos if a <= it[0] <= b]))
                self.rows += len(spans[-1].items)
        if not spans:
            del self.spans[key]
            return
        spans.sort(key=lambda sp: sp.lo)
        merged = [spans[0]]
        for sp in spans[1:]:
            last = merged[-1]
            if sp.lo <= last.hi + 1:   # adjoining (asked parts lie in the gaps between kept spans: no overlap)
                last.hi, last.items, last.used = max(last.hi, sp.hi), last.items + sp.items, max(last.used, sp.used)
            else:
                merged.append(sp)
        self._uses += 1
        for sp in merged:
            if any(sp.lo <= a and b <= sp.hi for a, b in asked):
                sp.used = self._uses
            lo = sp.hi - self.span_ns   # a span keeps span_ns behind its newest end (an episode's window moves)
            if sp.lo < lo:
                keep = [it for it in sp.items if it[0] >= lo]
                self.rows -= len(sp.items) - len(keep)
                sp.items, sp.lo = keep, lo
        while len(merged) > self.max_spans:
            old = min(merged, key=lambda sp: sp.used)
            merged.remove(old)
            self.rows -= len(old.items)
        self.spans[key] = merged
        while self.rows > self.max_rows and self.spans:
            k, sp = min(((k, sp) for k, sps in self.spans.items() for sp in sps), key=lambda ks: ks[1].used)
            self.spans[k].remove(sp)
            self.rows -= len(sp.items)
            if not self.spans[k]:
                del self.spans[k]


async def fetch_commops(ingest, reader, clock, job_key: str, ranks: list[int], since_ns: int, until_ns: int,
                        limit: int = 0, kinds: list[str] | None = None, answer_timeout_s: float = 30.0,
                        cache: DetailCache | None = None, stats: dict | None = None) -> Fetched:
    from steplens.collector.ingest.decode import BatchRejected, detail_json
    from steplens.v1 import ingest_pb2 as ipb
    if not job_key:
        raise FetchError(grpc.StatusCode.INVALID_ARGUMENT, "job_key is required (see `steplens procs --json`)")
    kinds = list(kinds or []) or ["commops"]
    bad = sorted(set(kinds) - {"commops", "kernels", "stacks"})
    if bad:
        raise FetchError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"unknown kind(s) {', '.join(bad)}: commops, kernels, stacks")
    procs = await asyncio.to_thread(reader.procs)
    want = set(ranks)
    by_node: dict[str, set[int]] = {}
    pids: dict[str, set[int]] = {}
    for p in procs:
        if p["job_key"] == job_key and (not want or p["rank"] in want):
            by_node.setdefault(p["node_id"], set()).add(p["rank"])
            if p["rank"] is not None and p["rank"] >= 0 and p["pid"]:
                pids.setdefault(p["node_id"], set()).add(p["pid"])
    if not by_node:
        jobs = sorted({p["job_key"] for p in procs if p["job_key"]})
        raise FetchError(grpc.StatusCode.NOT_FOUND,
                         f"no process of job {job_key!r}" + (f" with ranks {sorted(want)}" if want else "")
                         + f" is known; jobs: {', '.join(jobs[:20]) or 'none'}")
    until = until_ns or clock.now_ns()
    if since_ns > until:
        raise FetchError(grpc.StatusCode.INVALID_ARGUMENT, "since_ns is after until_ns")
    out = Fetched()
    asks = {}
    nodes = sorted(by_node)
    sessions = dict(zip(nodes, await asyncio.gather(*(ingest.session(node) for node in nodes))))
    for node, node_ranks in sorted(by_node.items()):
        session = sessions[node]
        if session is None or session.clock is None:
            out.offline.append(node)
            out.messages[node] = "not connected: its detail stays on the node until it is"
            continue
        nclock = session.clock
        want_ranks, want_pids = sorted(r for r in node_ranks if r >= 0), sorted(pids.get(node, ()))
        lo, hi = max(0, nclock.to_agent(since_ns)) if since_ns else 0, max(0, nclock.to_agent(until))
        key, parts, kept = None, [(lo, hi)], []
        if cache is not None and not limit:
            key = cache.key(node, session, nclock, job_key, kinds, want_ranks, want_pids)
            parts, kept = cache.plan(key, lo, hi)
        futs = []
        for a, b in parts:
            cmd = ipb.Command(command_id=uuid.uuid4().hex[:12], fetch=ipb.FetchDetail(
                kinds=kinds, ranks=want_ranks, pids=want_pids, since_ns=nclock.to_cluster(a) if a else 0,
                until_ns=nclock.to_cluster(b), since_mono_ns=a, until_mono_ns=b, limit=limit))
            futs.append(asyncio.ensure_future(asyncio.wait_for(session.send_command(cmd), answer_timeout_s)))
        asks[node] = (nclock, key, parts, kept, futs)
    for node, (nclock, key, parts, kept, futs) in asks.items():
        got, notes, failed = [], [], ""
        for fut in futs:
            try:
                result = await fut
            except asyncio.TimeoutError:
                failed = failed or f"did not answer in {answer_timeout_s:.0f} s"
                continue
            notes.append(result.message)
            if not result.ok:
                failed = failed or result.message
                continue
            try:
                got += detail_json(result.payload, nclock.to_cluster)
            except BatchRejected as exc:
                failed = failed or str(exc)
        if failed:
            out.offline.append(node)
            out.messages[node] = failed
            continue
        for r in got:
            r["node_id"] = node
        out.messages[node] = "; ".join(notes + ([f"{len(kept)} records kept from earlier asks"] if kept else []))
        if key is not None and not any("truncated" in n for n in notes):
            cache.store(key, parts, got, nclock.to_agent, nclock.to_agent(clock.now_ns() - cache.settle_ns))
        if stats is not None:   # the analysis engine's fetches, on the collector's /metrics
            stats["asks"] += len(parts)
            stats["rows_agents"] += len(got)
            stats["rows_kept"] += len(kept)
        out.rows.extend(kept)
        out.rows.extend(got)
    out.rows.sort(key=lambda r: (r.get("start_ns") or r.get("issue_ns") or r["ts_ns"], r.get("rank", -1)))
    return out


async def fetch_paged(ingest, reader, clock, job_key: str, ranks: list[int], since_ns: int, until_ns: int,
                      kinds: list[str], chunk_ns: int = 2_000_000_000, min_chunk_ns: int = 20_000_000,
                      limit: int = 100_000) -> Fetched:
    """fetch_commops over a long window: asked in time chunks; a chunk an agent answered truncated (its answer
    must fit one gRPC message) is asked again in halves, down to min_chunk_ns (then what came is kept and the
    node's message says it was truncated)."""
    out = Fetched()
    t = since_ns
    while t < until_ns:
        end = min(until_ns, t + chunk_ns)
        got = await fetch_commops(ingest, reader, clock, job_key, ranks, t, end, limit, kinds)
        if any("truncated" in m for m in got.messages.values()) and end - t > min_chunk_ns:
            chunk_ns = max(min_chunk_ns, (end - t) // 2)
            continue
        # a row exactly on a chunk boundary comes in both chunks: keep it once
        out.rows.extend(r for r in got.rows if (r.get("start_ns") or r.get("ts_ns") or 0) < end or end == until_ns)
        for node, msg in got.messages.items():
            if "truncated" in msg or node not in out.messages:
                out.messages[node] = msg
        out.offline = sorted(set(out.offline) | set(got.offline))
        t = end
    out.rows.sort(key=lambda r: (r.get("start_ns") or r.get("issue_ns") or r["ts_ns"], r.get("rank", -1)))
    return out


def thread_fetcher(loop, ingest, reader, clock, timeout_s: float = 60.0, cache: DetailCache | None = None):
    """A blocking fetch(job_key, ranks, since_ns, until_ns, limit, kinds) -> rows for the analysis thread, run on
    the collector's event loop (where the agents' streams live); kinds: ["commops"] (default) or ["kernels"].
    With a cache (DetailCache), what was fetched before is not asked again. The rows are the caller's to keep
    but not to change (kept rows are shared between answers). fetch.stats counts the asks sent to agents and the
    rows that came from them and from the cache."""
    stats = {"asks": 0, "rows_agents": 0, "rows_kept": 0}

    def fetch(job_key: str, ranks: list[int], since_ns: int, until_ns: int, limit: int = 0,
              kinds: list[str] | None = None) -> list[dict]:
        fut = asyncio.run_coroutine_threadsafe(
            fetch_commops(ingest, reader, clock, job_key, ranks, since_ns, until_ns, limit, kinds, cache=cache,
                          stats=stats), loop)
        return fut.result(timeout_s).rows
    fetch.cache, fetch.stats = cache, stats
    return fetch


def rows_json(rows: list) -> str:
    return json.dumps(rows, ensure_ascii=False)
