"""Control handlers for diagnosis: jobs, findings (list, diagnose on demand, watch), topology (import, get).

A mixin of ControlService (it uses its reader, _auth, ingest.writer and clock) with the analysis engine set as
`engine` by the collector. The handlers only translate: the work is in collector/analysis (engine, findings),
collector/store/diagnosis.py and collector/topology.py. Blocking work runs in a thread (asyncio.to_thread),
so a long diagnose never stalls the event loop that serves Ingest.
"""

from __future__ import annotations

import asyncio
import json
import statistics

import grpc

from steplens.collector.analysis.findings import Finding
from steplens.collector.analysis.steptime import step_times
from steplens.collector.topology import TopologyError, parse
from steplens.v1 import control_pb2 as cpb

MAX_TOPOLOGY_BYTES = 64 << 20


def finding_pb(f: Finding, deep: dict | None = None) -> cpb.Finding:
    return cpb.Finding(deep_dive_json=json.dumps(deep) if deep else "",
        id=f.id, job_key=f.job_key, kind=f.kind, detector=f.detector, status=f.status, onset_ns=f.onset_ns,
        last_ns=f.last_ns, resolved_ns=f.resolved_ns, severity=f.severity,
        peak_severity=max(f.peak_severity, f.severity), summary=f.summary,
        suspects=[cpb.Suspect(kind=s.kind, id=s.id, score=s.score, cause=s.cause,
                              evidence_json=json.dumps(s.evidence)) for s in f.suspects],
        evidence_json=json.dumps(f.evidence), confirmations=f.confirmations)


def _topology_reply(rec: dict | None, with_doc: bool) -> cpb.TopologyReply:
    if rec is None:
        return cpb.TopologyReply()
    return cpb.TopologyReply(version=rec["version"], origin=rec["origin"], imported_ns=rec["imported_ns"],
                             digest=rec["digest"], name=rec["name"], nodes=rec["nodes"], gpus=rec["gpus"],
                             nics=rec["nics"], switches=rec["switches"], links=rec["links"],
                             topology_json=json.dumps(rec["topology"].to_dict()) if with_doc else "")


def _flow_steps(fj) -> dict:
    """step_seconds (median of the newest 3 steps), baseline (median of all), steps, from a flow job's timeline."""
    per: dict[int, list[int]] = {}
    for steps in fj.timeline.values():
        for k, a, b in steps:
            per.setdefault(k, []).append(b - a)
    ks = sorted(per)
    med = [statistics.median(per[k]) / 1e9 for k in ks]
    return {"step_seconds": statistics.median(med[-3:]) if med else None,
            "baseline_step_seconds": statistics.median(med) if len(med) >= 5 else None,
            "step_source": "flows" if med else None, "steps": len(ks)}


def rank_of_endpoints(fj, job: dict | None, topo) -> dict[str, int]:
    """Endpoint address -> global rank for a flow job matched to a procs job: the address's NIC in the topology
    names a node and GPU; the rank on that node with that local rank (or the node's only rank)."""
    if not job or topo is None:
        return {}
    on_node: dict[str, list[dict]] = {}
    for r in job["ranks"]:
        if r["rank"] >= 0:
            on_node.setdefault(r["node_id"], []).append(r)
    gpu_of_nic = {g.nic: g.index for g in topo.gpus.values()}
    nic_by_ip = {n.ip: n for n in topo.nics.values() if n.ip}
    out = {}
    for ip in fj.endpoints:
        nic = nic_by_ip.get(ip)
        ranks = on_node.get(nic.node, []) if nic else []
        if len(ranks) == 1:
            out[ip] = ranks[0]["rank"]
        elif ranks and nic.id in gpu_of_nic:
            hit = [r for r in ranks if r["local_rank"] == gpu_of_nic[nic.id]]
            if len(hit) == 1:
                out[ip] = hit[0]["rank"]
    return out


class DiagnosisControl:
    engine = None  # AnalysisEngine, set by the collector
    _own_flowview = None

    def _flowview(self):
        """The engine's flow analysis (flowjobs.FlowView), or one of Control's own where the flows detector is
        off (jobs from flows are listed either way)."""
        view = getattr(self.engine, "flowview", None)
        if view is None:
            if self._own_flowview is None:
                from steplens.collector.analysis.flowjobs import FlowConfig, FlowView
                own = getattr(self.engine, "settings", None)
                cfg = FlowConfig(ignore_ports=tuple(own.flows_ignore_ports), segmenter=own.flows_segmenter) \
                    if own is not None else FlowConfig()
                self._own_flowview = FlowView(cfg=cfg)
            view = self._own_flowview
        return view

    def _jobs(self, job_key: str) -> list[dict]:
        jobs = [dict(j, source="procs", endpoints=[], pairs=[], flow_sources=[]) for j in self.reader.jobs(job_key)]
        snap = self._flowview().snapshot(self.reader)
        open_by_job: dict[str, list[Finding]] = {}
        for f in self.reader.findings(job_key=job_key, open_only=True, limit=10000):
            open_by_job.setdefault(f.job_key, []).append(f)
        for j in jobs:
            j.update(step_times(self.reader, j["job_key"]).to_json())
        if snap is not None:
            matched = snap.matched
            for j in jobs:
                fj = snap.job(matched.get(j["job_key"], ""))
                if fj is not None:
                    j.update(source="both", endpoints=fj.endpoints, flow_sources=snap.sources,
                             pairs=[{"a": a, "b": b, "type": t} for (a, b), t in sorted(fj.pairs.items())])
            taken = set(matched.values())
            for fj in snap.jobs:
                if fj.key in taken or (job_key and fj.key != job_key):
                    continue
                idx = fj.flow_index
                fw = snap.flows
                job = {"job_key": fj.key, "world_size": -1, "ranks": [], "nodes": fj.servers, "comms": [],
                       "alive": True, "first_seen_ns": int(fw.start[idx].min()) if len(idx) else 0,
                       "last_seen_ns": int(fw.end[idx].max()) if len(idx) else 0, "source": "flows",
                       "endpoints": fj.endpoints, "flow_sources": snap.sources,
                       "pairs": [{"a": a, "b": b, "type": t} for (a, b), t in sorted(fj.pairs.items())]}
                job.update(_flow_steps(fj))
                jobs.append(job)
        for j in jobs:
            j["open_findings"] = open_by_job.get(j["job_key"], [])
        return jobs

    async def ListJobs(self, request, context):
        await self._auth(context)
        jobs = await asyncio.to_thread(self._jobs, request.job_key)
        out = cpb.JobList()
        for j in jobs:
            pj = out.jobs.add(job_key=j["job_key"], world_size=j["world_size"], nodes=j["nodes"], alive=j["alive"],
                              first_seen_ns=j["first_seen_ns"], last_seen_ns=j["last_seen_ns"],
                              step_source=j["step_source"] or "", steps=j["steps"], source=j["source"],
                              endpoints=j["endpoints"], flow_sources=j["flow_sources"])
            pj.pairs.extend(cpb.JobPair(a=p["a"], b=p["b"], type=p["type"]) for p in j["pairs"])
            if j["step_seconds"] is not None:
                pj.step_seconds = j["step_seconds"]
            if j["baseline_step_seconds"] is not None:
                pj.baseline_step_seconds = j["baseline_step_seconds"]
            for r in j["ranks"]:
                pr = pj.ranks.add(rank=r["rank"], node_id=r["node_id"], pid=r["pid"], local_rank=r["local_rank"],
                                  source=r["source"])
                if r["alive"] is not None:
                    pr.alive = r["alive"]
            for c in j["comms"]:
                pj.comms.add(comm_id=c["comm_id"], nranks=c["nranks"], ranks=c["ranks"], ops=c["ops"], via=c["via"])
            pj.open_findings.extend(finding_pb(f) for f in j["open_findings"])
        return out

    def _timeline(self, job_key: str, since_ns: int, until_ns: int):
        snap = self._flowview().snapshot(self.reader, until_ns, since_ns)
        if snap is None:
            return None, None, {}
        fj = snap.job(job_key)
        source = "flows"
        if fj is None and job_key in snap.matched:
            fj, source = snap.job(snap.matched[job_key]), "both"
        if fj is None:
            return snap, None, {"known": [j.key for j in snap.jobs[:20]] + list(snap.matched)[:20]}
        ranks = {}
        if source == "both":
            known = self.reader.jobs(job_key)
            ranks = rank_of_endpoints(fj, known[0] if known else None, self.reader.topology())
        return snap, fj, {"source": source, "ranks": ranks}

    async def Timeline(self, request, context):
        await self._auth(context)
        if not request.job_key:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "job_key is required (see `steplens jobs`)")
        if request.since_ns and request.until_ns and request.since_ns >= request.until_ns:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "since_ns must be before until_ns")
        snap, fj, info = await asyncio.to_thread(self._timeline, request.job_key, request.since_ns, request.until_ns)
        if snap is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no flows stored in that window (is the netflows source "
                                "up, or were switch flows imported? `steplens flows`)")
        if fj is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no job {request.job_key!r} is recognized from the flows of that window; jobs: "
                                f"{', '.join(info['known']) or 'none'}")
        out = cpb.TimelineReply(job_key=fj.key, source=info["source"], flow_sources=snap.sources,
                                since_ns=snap.since_ns, until_ns=snap.until_ns)
        ranks = info["ranks"]
        for ip in sorted(fj.timeline):
            for k, a, b in fj.timeline[ip]:
                out.steps.add(endpoint=ip, rank=ranks.get(ip, -1), step=k, start_ns=a, end_ns=b)
        return out

    async def ListFindings(self, request, context):
        await self._auth(context)
        rows = await asyncio.to_thread(self.reader.findings, request.job_key, request.since_ns, request.open_only,
                                       request.limit or 1000)
        deep = await asyncio.to_thread(self._deep_of, rows)
        return cpb.FindingList(findings=[finding_pb(f, deep.get(f.id)) for f in rows])

    def _deep_of(self, findings) -> dict:
        """finding id -> the deep dive that observed it (Reader.deep_dives_for)."""
        if not findings or not hasattr(self.reader, "deep_dives_for"):
            return {}
        return self.reader.deep_dives_for(findings)

    async def Diagnose(self, request, context):
        await self._auth(context)
        if not request.job_key:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "job_key is required (see `steplens jobs`)")
        known = await asyncio.to_thread(self.reader.jobs, request.job_key)
        only: tuple[str, ...] = ()
        if not known:
            snap = await asyncio.to_thread(self._flowview().snapshot, self.reader)
            if snap is not None and snap.job(request.job_key) is not None:
                only = ("flows",)   # a job the flows alone show: nothing else has data on it
            else:
                jobs = [j["job_key"] for j in await asyncio.to_thread(self.reader.jobs)]
                jobs += [j.key for j in snap.jobs] if snap is not None else []
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"no job {request.job_key!r} is known; jobs: {', '.join(jobs[:20]) or 'none'}")
        now = self.clock.now_ns()
        if request.since_ns > now:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "since_ns is in the future")
        try:
            res = await asyncio.to_thread(self.engine.run_job, request.job_key, request.since_ns, now, True,
                                          0, 60.0, only)
        except RuntimeError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return cpb.DiagnoseReply(findings=[finding_pb(f) for f in res.findings], detectors=res.detectors,
                                 errors=res.errors, since_ns=res.since_ns, until_ns=res.until_ns,
                                 seconds=res.seconds, ranks_fetched=res.ranks_fetched)

    async def WatchFindings(self, request, context):
        await self._auth(context)
        sub = self.engine.hub.subscribe(asyncio.get_running_loop(), request.job_key)
        try:
            if request.include_open:
                rows = await asyncio.to_thread(self.reader.findings, request.job_key, 0, True, 10000)
                deep = await asyncio.to_thread(self._deep_of, rows)
                for f in rows:
                    yield cpb.FindingEvent(event="open", finding=finding_pb(f, deep.get(f.id)))
            while True:
                event, f, dropped = await sub.get()
                deep = await asyncio.to_thread(self._deep_of, [f]) if event != "opened" else {}
                yield cpb.FindingEvent(event=event, finding=finding_pb(f, deep.get(f.id)), dropped=dropped)
        finally:
            self.engine.hub.unsubscribe(sub)

    async def ImportTopology(self, request, context):
        await self._auth(context)
        from steplens.collector.store.diagnosis import write_topology
        from steplens.collector.store.writer import StoreJob, submit_and_wait
        if not request.origin or len(request.origin) > 200:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "origin must be 1-200 characters")
        if len(request.topology_json) > MAX_TOPOLOGY_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "topology over 64 MiB")
        try:
            topo = await asyncio.to_thread(parse, request.topology_json)
        except TopologyError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        now = self.clock.now_ns()
        outcome, version, note = await submit_and_wait(self.ingest.writer, lambda done: StoreJob(
            lambda conn: write_topology(conn, topo, request.origin, now), done))
        if outcome != "stored":
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"topology not stored: {note}")
        c = topo.counts()
        return cpb.TopologyReply(version=version, origin=request.origin, imported_ns=now, digest=topo.digest(),
                                 name=topo.name, **c)

    async def GetTopology(self, request, context):
        await self._auth(context)
        rec = await asyncio.to_thread(self.reader.topology_record)
        return _topology_reply(rec, True)
