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


async def fetch_commops(ingest, reader, clock, job_key: str, ranks: list[int], since_ns: int, until_ns: int,
                        limit: int = 0, kinds: list[str] | None = None, answer_timeout_s: float = 30.0) -> Fetched:
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
        cmd = ipb.Command(command_id=uuid.uuid4().hex[:12], fetch=ipb.FetchDetail(
            kinds=kinds, ranks=sorted(r for r in node_ranks if r >= 0), pids=sorted(pids.get(node, ())),
            since_ns=since_ns, until_ns=until,
            since_mono_ns=max(0, nclock.to_agent(since_ns)) if since_ns else 0,
            until_mono_ns=max(0, nclock.to_agent(until)), limit=limit))
        asks[node] = (nclock, asyncio.ensure_future(asyncio.wait_for(session.send_command(cmd), answer_timeout_s)))
    for node, (nclock, fut) in asks.items():
        try:
            result = await fut
        except asyncio.TimeoutError:
            out.offline.append(node)
            out.messages[node] = f"did not answer in {answer_timeout_s:.0f} s"
            continue
        out.messages[node] = result.message
        if not result.ok:
            out.offline.append(node)
            continue
        try:
            got = detail_json(result.payload, nclock.to_cluster)
        except BatchRejected as exc:
            out.offline.append(node)
            out.messages[node] = str(exc)
            continue
        for r in got:
            r["node_id"] = node
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


def thread_fetcher(loop, ingest, reader, clock, timeout_s: float = 60.0):
    """A blocking fetch(job_key, ranks, since_ns, until_ns, limit, kinds) -> rows for the analysis thread, run on
    the collector's event loop (where the agents' streams live); kinds: ["commops"] (default) or ["kernels"]."""
    def fetch(job_key: str, ranks: list[int], since_ns: int, until_ns: int, limit: int = 0,
              kinds: list[str] | None = None) -> list[dict]:
        fut = asyncio.run_coroutine_threadsafe(
            fetch_commops(ingest, reader, clock, job_key, ranks, since_ns, until_ns, limit, kinds), loop)
        return fut.result(timeout_s).rows
    return fetch


def rows_json(rows: list) -> str:
    return json.dumps(rows, ensure_ascii=False)
