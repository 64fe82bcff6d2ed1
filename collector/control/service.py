"""The operators' Control API (grpc.aio): listings from the store, and deep-mode triggers.

Auth: on a TLS collector every call needs a bearer token (`authorization: Bearer ...`) equal to
the collector's token, or a client certificate whose CN is one of the operator names. On an
insecure (loopback-only) collector there is nothing to check.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import uuid

import grpc

from steplens.collector.control.diagnosis import DiagnosisControl
from steplens.collector.control.trigger import start_deep_mode
from steplens.collector.store.queries import Reader
from steplens.v1 import control_pb2 as cpb
from steplens.v1 import control_pb2_grpc as cgrpc


class ControlService(DiagnosisControl, cgrpc.ControlServicer):
    def __init__(self, reader: Reader, ingest, clock, tls: bool, token: str = "",
                 operator_cns: tuple[str, ...] = ("steplens-operator",)) -> None:
        self.reader = reader
        self.ingest = ingest
        self.clock = clock
        self.tls = tls
        self.token = token
        self.operator_cns = operator_cns

    async def _auth(self, context) -> None:
        if not self.tls:
            return
        md = dict(context.invocation_metadata() or ())
        given = md.get("authorization", "")
        if self.token and given.startswith("Bearer ") and hmac.compare_digest(given[7:].strip(), self.token):
            return
        auth = context.auth_context() or {}
        cns = [n.decode() for n in auth.get("x509_common_name", [])]
        if any(cn in self.operator_cns for cn in cns):
            return
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "Control needs a bearer token or an operator client certificate")

    async def ListNodes(self, request, context):
        await self._auth(context)
        rows = await asyncio.to_thread(self.reader.nodes, request.node_id)
        live: set[str] = set()
        if self.ingest.peers is not None and any(r["collector"] for r in rows):
            live = await asyncio.to_thread(self.ingest.peers.live_ids)
        out = cpb.NodeList()
        for r in rows:
            n = out.nodes.add()
            for k, v in r.items():
                if k == "sources":
                    for name, s in v.items():
                        n.sources.add(name=name, up=s["up"], reason=s["reason"],
                                      last_duration_seconds=s["last_duration_seconds"], errors=s["errors"],
                                      cpu_cores=s["cpu_cores"], rate_scale=s["rate_scale"])
                else:
                    setattr(n, k, v)
            # a live stream knows better than the store whether it is connected right now (one on another
            # collector of the store: its replicated row says, while that collector is alive)
            n.connected = r["node_id"] in self.ingest.sessions or bool(
                r["collector"] and r["connected"] and r["collector"] in live)
        return out

    async def ListGpus(self, request, context):
        await self._auth(context)
        rows = await asyncio.to_thread(self.reader.gpus, request.node_id)
        out = cpb.GpuList()
        for r in rows:
            g = out.gpus.add(node_id=r["node_id"], index=r["index"] or 0, uuid=r["uuid"], name=r["name"] or "",
                             pci_bus_id=r["pci_bus_id"] or "", memory_total_bytes=r["memory_total_bytes"] or 0,
                             driver_version=r["driver_version"] or "", last_seen_ns=r["last_seen_ns"] or 0)
            for name, m in r["latest"].items():
                g.latest.add(name=name, value=m["value"], ts_ns=m["ts_ns"])
        return out

    async def ListProcs(self, request, context):
        await self._auth(context)
        rows = await asyncio.to_thread(self.reader.procs, request.node_id, request.alive_only)
        out = cpb.ProcList()
        for r in rows:
            p = out.procs.add()
            for k, v in r.items():
                if v is not None:
                    setattr(p, k, v)
        return out

    async def ListGaps(self, request, context):
        await self._auth(context)
        rows = await asyncio.to_thread(self.reader.gaps, request.node_id)
        return cpb.GapList(gaps=[cpb.GapRow(**r) for r in rows])

    async def ListStacks(self, request, context):
        await self._auth(context)
        rows = await asyncio.to_thread(self.reader.stacks, request.node_id, request.pid, request.since_ns,
                                       request.limit or 200)
        out = cpb.StackList()
        for r in rows:
            out.stacks.add(node_id=r["node_id"], pid=r["pid"], start_ticks=r["start_ticks"], tid=r["tid"],
                           thread_name=r["thread_name"] or "", python=r["python"] or "", start_ns=r["start_ns"],
                           end_ns=r["end_ns"], samples=r["samples"], errors=r["errors"],
                           last_state=r["last_state"] or "", stacks_json=json.dumps(r["stacks"], ensure_ascii=False))
        return out

    async def ListFlows(self, request, context):
        await self._auth(context)
        try:
            rows = await asyncio.to_thread(self.reader.flows, request.since_ns, request.by or "pair",
                                           request.node_id, request.limit or 1000)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        out = cpb.FlowList()
        for r in rows:
            out.flows.add(src=r["src"], dst=r["dst"], sport=r.get("sport") or 0, dport=r.get("dport") or 0,
                          bytes=r["bytes"] or 0, packets=r["packets"] or 0, flows=r["flows"],
                          start_ns=r["first_ns"] or 0, end_ns=r["last_ns"] or 0, origin=",".join(r["origins"]))
        return out

    async def ListCommSummaries(self, request, context):
        await self._auth(context)
        if not request.job_key:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "job_key is required (see `steplens procs --json`)")
        rows = await asyncio.to_thread(self.reader.comm_summaries, request.job_key, list(request.ranks),
                                       request.since_ns, request.limit or 5000)
        return cpb.SummariesReply(rows_json=json.dumps(rows))

    async def ListComms(self, request, context):
        await self._auth(context)
        rows = await asyncio.to_thread(self.reader.comms, request.job_key, request.comm_id)
        out = cpb.CommList()
        for r in rows:
            out.members.add(comm_id=r["comm_id"], rank=r["rank"], nranks=r["nranks"], host=r["host"], pid=r["pid"],
                            cuda_dev=r["cuda_dev"], nvml_dev=r["nvml_dev"], bus_id=r["bus_id"],
                            global_rank=r["global_rank"], job_key=r["job_key"], via=r["via"], node_id=r["node_id"],
                            seen_ns=r["seen_ns"])
        return out

    async def ImportFlows(self, request, context):
        await self._auth(context)
        from steplens.collector.store.writer import ImportJob, submit_and_wait
        rows, problems = [], []
        for i, f in enumerate(request.flows):
            if not f.src or not f.dst or f.end_ns < f.start_ns or not f.start_ns or f.sport > 65535 or f.dport > 65535:
                problems.append(f"row {i}: needs src, dst, start_ns <= end_ns and ports <= 65535")
                continue
            rows.append((f.start_ns, f.end_ns, f.src, f.sport, f.dst, f.dport, f.bytes, f.packets,
                         json.dumps(list(f.switches))))
        if problems:  # all or nothing: a file with a bad row imports nothing
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(problems[:5]))
        if not request.origin or len(request.origin) > 200:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "origin must be 1-200 characters")
        outcome, n, note = await submit_and_wait(self.ingest.writer,
                                                 lambda done: ImportJob(request.origin, rows, done))
        if outcome != "stored":
            await context.abort(grpc.StatusCode.UNAVAILABLE, note)
        return cpb.ImportFlowsReply(imported=n)

    async def FetchDetail(self, request, context):
        """Ask one agent for node-local detail over its command channel and wait for the answer."""
        await self._auth(context)
        from steplens.collector.ingest.decode import BatchRejected, detail_json
        from steplens.v1 import ingest_pb2 as ipb
        session = await self.ingest.session(request.node_id)
        if session is None or session.clock is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"node {request.node_id!r} is not connected: its detail stays on the node until it is")
        clock = session.clock
        now = self.clock.now_ns()
        until = request.until_ns or now
        if request.since_ns > until:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "since_ns is after until_ns")
        cmd = ipb.Command(command_id=uuid.uuid4().hex[:12], fetch=ipb.FetchDetail(
            kinds=list(request.kinds), ranks=list(request.ranks), since_ns=request.since_ns, until_ns=until,
            since_mono_ns=max(0, clock.to_agent(request.since_ns)) if request.since_ns else 0,
            until_mono_ns=max(0, clock.to_agent(until)), limit=request.limit))
        try:
            result = await asyncio.wait_for(session.send_command(cmd), 30)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"node {request.node_id!r} did not answer in 30 s")
        if not result.ok:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{request.node_id}: {result.message}")
        try:
            rows = detail_json(result.payload, clock.to_cluster)
        except BatchRejected as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"{request.node_id}: {exc}")
        return cpb.FetchReply(node_id=request.node_id, message=result.message,
                              records_json=json.dumps(rows, ensure_ascii=False))

    async def FetchCommOps(self, request, context):
        """Comm ops of one job: ask every connected agent that hosts one of its ranks (or the given ranks),
        concurrently, over the command channel; merge the answers in cluster time (control/fetch.py)."""
        await self._auth(context)
        from steplens.collector.control.fetch import FetchError, fetch_commops, rows_json
        try:
            got = await fetch_commops(self.ingest, self.reader, self.clock, request.job_key, list(request.ranks),
                                      request.since_ns, request.until_ns, request.limit, list(request.kinds))
        except FetchError as exc:
            await context.abort(exc.code, str(exc))
        reply = cpb.CommOpsReply(records_json=rows_json(got.rows), offline=got.offline)
        for node, msg in got.messages.items():
            reply.messages[node] = msg
        return reply

    async def BuildTrace(self, request, context):
        """One Perfetto trace of a job (control/trace.py), streamed in chunks; the last carries the summary."""
        await self._auth(context)
        from steplens.collector.control.fetch import FetchError
        from steplens.collector.control.trace import build_trace
        try:
            res = await build_trace(self.ingest, self.reader, self.clock, request.job_key, request.since_ns,
                                    request.until_ns, request.finding_id, fetch=not request.store_only)
        except FetchError as exc:
            await context.abort(exc.code, str(exc))
        step = 2 * 1024 * 1024
        for off in range(0, len(res.data), step):
            yield cpb.TraceChunk(data=res.data[off:off + step])
        yield cpb.TraceChunk(summary_json=json.dumps(res.summary()))

    async def SetDeepMode(self, request, context):
        await self._auth(context)
        if request.enable and not (0 < request.duration_ns <= 3600 * 10**9):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "duration must be within 0..3600 s")
        if request.job_key:
            return await self._deep_dive(request, context)
        return await start_deep_mode(self.ingest, self.clock, request, command_id=uuid.uuid4().hex[:12])

    async def _deep_dive(self, request, context):
        """An operator's deep dive of one job (analysis/deepdive.py): its nodes, a reference window before it,
        ranked causes attached to the job's newest open finding (if any) when the window is over."""
        dives = getattr(self, "deepdives", None)
        if dives is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "deep dives are not set up on this collector")
        if request.node_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "--job picks the nodes: leave out --nodes")
        if not request.enable:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "stopping is per node (deep stop [--nodes])")
        open_ = await asyncio.to_thread(self.reader.findings, request.job_key, 0, True, 1)
        try:
            dd = await dives.start_dive(request.job_key, open_[0].id if open_ else "", "operator",
                                        duration_ns=request.duration_ns, lead_ms=request.lead_ms, force=True)
        except LookupError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        if dd is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no node of the job is connected")
        rows = await asyncio.to_thread(self.reader.deep_dives, "", None, dd.command_id, 1)
        reply = cpb.DeepReply(command_id=dd.command_id, start_ns=dd.start_ns, delivered=dd.delivered,
                              offline=[n for n in dd.nodes if n not in dd.delivered],
                              deep_dive_json=json.dumps(rows[0]) if rows else "")
        for node, msg in dd.messages.items():
            reply.messages[node] = msg
        return reply

    async def ListDeepDives(self, request, context):
        await self._auth(context)
        rows = await asyncio.to_thread(self.reader.deep_dives, request.job_key, None, request.command_id,
                                       request.limit or 100)
        return cpb.DeepDivesReply(deep_dives_json=json.dumps(rows))
