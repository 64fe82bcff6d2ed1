"""The operators' diagnosis commands (`steplens jobs|findings|diagnose|timeline|trace|topology`, `steplens import
topology`), a thin layer over Control's ListJobs, ListFindings, WatchFindings, Diagnose, Timeline, BuildTrace,
ImportTopology and GetTopology.

register() adds them to the `steplens` parser built in ops.py (which adds --watch to `jobs`); diagnose, trace
and import topology show a progress line on stderr at a terminal (cliout.Progress). JSON output: a finding is
{id, job_key, kind, detector, status, onset_ns, last_ns, resolved_ns, severity, peak_severity, summary,
 suspects: [{kind, id, score, cause, evidence}], evidence, confirmations}.
"""

from __future__ import annotations

import json
import os
import time

from steplens import cliout
from steplens.collector.cli.serve import parse_duration
from steplens.collector.topology import parse as parse_topology
from steplens.v1 import control_pb2 as cpb


def finding_json(f: cpb.Finding) -> dict:
    return {"id": f.id, "job_key": f.job_key, "kind": f.kind, "detector": f.detector, "status": f.status,
            "onset_ns": f.onset_ns, "last_ns": f.last_ns, "resolved_ns": f.resolved_ns, "severity": f.severity,
            "peak_severity": f.peak_severity, "summary": f.summary,
            "suspects": [{"kind": s.kind, "id": s.id, "score": s.score, "cause": s.cause,
                          "evidence": json.loads(s.evidence_json or "{}")} for s in f.suspects],
            "evidence": json.loads(f.evidence_json or "{}"), "confirmations": f.confirmations,
            "deep_dive": json.loads(f.deep_dive_json) if f.deep_dive_json else None}


def _since_ns(text: str) -> int:
    return time.time_ns() - int(parse_duration(text) * 1e9) if text else 0


def _ago(ns: int) -> str:
    from steplens.collector.cli.ops import _ago as ago
    return ago(ns)


def _print_findings(rows: list[dict], empty: str) -> None:
    from steplens.collector.cli.ops import _table
    if not rows:
        print(empty)
        return
    table = []
    for f in rows:
        top = f["suspects"][0] if f["suspects"] else None
        table.append([f["status"], f["job_key"], f["kind"], f"{f['severity']:.2f}x",
                      f"{top['kind']} {top['id']} ({top['cause'] or '-'})" if top else "-", _ago(f["onset_ns"]),
                      _ago(f["last_ns"]), f["detector"], f["summary"]])
    print(_table(table, ["STATUS", "JOB", "KIND", "SEVERITY", "TOP SUSPECT", "ONSET", "LAST", "DETECTOR", "SUMMARY"],
                 free=("TOP SUSPECT", "SUMMARY")))


def cmd_findings(stub, args) -> int:
    if args.watch:
        return _watch(stub, args)
    reply = stub.ListFindings(cpb.FindingsRequest(job_key=args.job or "", since_ns=_since_ns(args.since),
                                                  open_only=args.open, limit=args.limit), timeout=args.timeout)
    rows = [finding_json(f) for f in reply.findings]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    _print_findings(rows, "no findings" + (" open" if args.open else "") +
                    (f" for job {args.job}" if args.job else "") + (f" in the last {args.since}" if args.since else ""))
    return 0


def _watch(stub, args) -> int:
    """One JSON line per event ({event, dropped, finding}) until interrupted (or --count events)."""
    call = stub.WatchFindings(cpb.WatchFindingsRequest(job_key=args.job or "", include_open=args.open))
    n = 0
    try:
        for ev in call:
            print(json.dumps({"event": ev.event, "dropped": ev.dropped, "finding": finding_json(ev.finding)}),
                  flush=True)
            n += 1
            if args.count and n >= args.count:
                call.cancel()
                break
    except KeyboardInterrupt:
        call.cancel()
    return 0


def cmd_diagnose(stub, args) -> int:
    with cliout.progress_for(args, f"diagnose {args.job}", note="the detectors run on the collector"):
        reply = stub.Diagnose(cpb.DiagnoseRequest(job_key=args.job, since_ns=_since_ns(args.since)),
                              timeout=args.timeout + 120)
    rows = [finding_json(f) for f in reply.findings]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        ran = ", ".join(reply.detectors) or "none registered"
        print(f"job {args.job}: {len(reply.detectors)} detector(s) ran ({ran}) over "
              f"{(reply.until_ns - reply.since_ns) / 1e9:.0f} s of data in {reply.seconds:.2f} s"
              + (f", node-local detail fetched from {reply.ranks_fetched} rank(s)" if reply.ranks_fetched else ""))
        _print_findings(rows, "no findings: nothing abnormal in that window" if reply.detectors else
                        "no findings (no detector is registered yet)")
    for name, err in sorted(reply.errors.items()):
        print(f"steplens: detector {name} failed: {err}", file=__import__("sys").stderr)
    return 1 if reply.errors else 0


def _fmt_seconds(v) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}ms" if v < 10 else f"{v:.2f}s"


def cmd_jobs(stub, args) -> int:
    from steplens.collector.cli.ops import _table
    reply = stub.ListJobs(cpb.JobsRequest(job_key=args.job or ""), timeout=args.timeout)
    jobs = []
    for j in reply.jobs:
        jobs.append({
            "job_key": j.job_key, "world_size": j.world_size, "alive": j.alive,
            "ranks": [{"rank": r.rank, "node_id": r.node_id, "pid": r.pid, "local_rank": r.local_rank,
                       "alive": r.alive if r.HasField("alive") else None, "source": r.source} for r in j.ranks],
            "nodes": list(j.nodes),
            "comms": [{"comm_id": c.comm_id, "nranks": c.nranks, "ranks": list(c.ranks), "ops": list(c.ops),
                       "via": list(c.via)} for c in j.comms],
            "step_seconds": j.step_seconds if j.HasField("step_seconds") else None,
            "baseline_step_seconds": j.baseline_step_seconds if j.HasField("baseline_step_seconds") else None,
            "step_source": j.step_source or None, "steps": j.steps,
            "first_seen_ns": j.first_seen_ns, "last_seen_ns": j.last_seen_ns,
            "open_findings": [finding_json(f) for f in j.open_findings],
            "source": j.source or "procs", "endpoints": list(j.endpoints), "flow_sources": list(j.flow_sources),
            "pairs": [{"a": p.a, "b": p.b, "type": p.type} for p in j.pairs]})
    if args.json:
        print(json.dumps(jobs, indent=2))
        return 0
    if not jobs:
        print("no jobs known (workload processes with a job key: `steplens procs`; flows: `steplens flows`)")
        return 0
    rows = []
    for j in jobs:
        ranks = sorted(r["rank"] for r in j["ranks"] if r["rank"] >= 0)
        kinds = {}
        for p in j["pairs"]:
            kinds[p["type"]] = kinds.get(p["type"], 0) + 1
        rows.append([j["job_key"], j["source"], f"{len(ranks)}/{j['world_size'] if j['world_size'] >= 0 else '?'}",
                     len(j["nodes"]), len(j["endpoints"]) or "-", len(j["comms"]),
                     " ".join(f"{k}:{v}" for k, v in sorted(kinds.items())) or "-", _fmt_seconds(j["step_seconds"]),
                     _fmt_seconds(j["baseline_step_seconds"]), len(j["open_findings"]),
                     "alive" if j["alive"] else "-", _ago(j["last_seen_ns"])])
    print(_table(rows, ["JOB", "SOURCE", "RANKS", "NODES", "ENDPOINTS", "COMMS", "PAIRS", "STEP", "BASELINE",
                        "OPEN FINDINGS", "STATE", "LAST"], free=("PAIRS",)))
    return 0


def cmd_timeline(stub, args) -> int:
    from steplens.collector.cli.ops import _table
    reply = stub.Timeline(cpb.TimelineRequest(job_key=args.job, since_ns=_since_ns(args.since)),
                          timeout=args.timeout + 30)
    rows = [{"endpoint": s.endpoint, "rank": s.rank if s.rank >= 0 else None, "step": s.step,
             "start_ns": s.start_ns, "end_ns": s.end_ns, "step_seconds": (s.end_ns - s.start_ns) / 1e9}
            for s in reply.steps]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"job {reply.job_key} ({reply.source}; flows from {', '.join(reply.flow_sources) or '?'}): "
          f"{len({r['endpoint'] for r in rows})} endpoints, {len({r['step'] for r in rows})} steps")
    if not rows:
        print("no step boundaries (no DP traffic recognized in the window)")
        return 0
    out = [[r["endpoint"], "-" if r["rank"] is None else r["rank"], r["step"], r["start_ns"], r["end_ns"],
            f"{r['step_seconds']:.4f}s"] for r in rows[-args.limit:]]
    print(_table(out, ["ENDPOINT", "RANK", "STEP", "START_NS", "END_NS", "STEP TIME"]))
    return 0


def _topology_json(r: cpb.TopologyReply, doc: bool) -> dict:
    out = {"version": r.version, "origin": r.origin, "imported_ns": r.imported_ns, "digest": r.digest,
           "name": r.name, "nodes": r.nodes, "gpus": r.gpus, "nics": r.nics, "switches": r.switches,
           "links": r.links}
    if doc:
        out["topology"] = json.loads(r.topology_json) if r.topology_json else None
    return out


def cmd_topology(stub, args) -> int:
    reply = stub.GetTopology(cpb.TopologyRequest(), timeout=args.timeout)
    if args.json:
        print(json.dumps(_topology_json(reply, True) if reply.version else None, indent=2))
        return 0
    if not reply.version:
        print("no topology imported (steplens import topology FILE)")
        return 0
    print(f"topology v{reply.version} {reply.name or ''} from {reply.origin}, imported {_ago(reply.imported_ns)}: "
          f"{reply.nodes} nodes, {reply.gpus} GPUs, {reply.nics} NICs, {reply.switches} switches, {reply.links} "
          f"switch links (digest {reply.digest})")
    return 0


def cmd_import_topology(stub, args) -> int:
    with open(args.file, "rb") as fh:
        data = fh.read()
    topo = parse_topology(data)  # raises TopologyError (a ValueError) listing every problem: nothing is sent
    origin = args.origin or os.path.basename(args.file)
    with cliout.progress_for(args, f"importing {os.path.basename(args.file)}",
                             note="the collector checks and stores it"):
        reply = stub.ImportTopology(cpb.ImportTopologyRequest(origin=origin, topology_json=json.dumps(topo.to_dict())),
                                    timeout=args.timeout + 30)
    out = {"file": args.file, **_topology_json(reply, False)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"imported topology v{reply.version} from {args.file}: {reply.nodes} nodes, {reply.gpus} GPUs, "
              f"{reply.nics} NICs, {reply.switches} switches, {reply.links} switch links")
    return 0


def cmd_trace(stub, args) -> int:
    finding = args.finding or ""
    until = time.time_ns() - int(parse_duration(args.until) * 1e9) if args.until else 0
    since = _since_ns(args.since) if args.since else 0
    if finding and (args.since or args.until):
        raise SystemExit("steplens trace: --finding sets the window; leave out --since/--until")
    if since and until and since >= until:
        raise SystemExit("steplens trace: --since must be earlier than --until")
    tmp = args.output + ".part"
    summary = {}
    try:
        with open(tmp, "wb") as f, cliout.progress_for(args, f"trace {args.job}", unit="bytes") as progress:
            progress.update(note="the collector builds it" + ("" if args.store_only else
                                                              " (fetching the nodes' detail)"))
            chunks = 0
            for chunk in stub.BuildTrace(cpb.TraceRequest(job_key=args.job, finding_id=finding, since_ns=since,
                                                          until_ns=until, store_only=args.store_only),
                                         timeout=args.timeout + 300):
                if chunk.data:
                    f.write(chunk.data)
                    chunks += 1
                    progress.update(done=f.tell(), note=f"{chunks} chunk{'s' if chunks > 1 else ''} received")
                if chunk.summary_json:
                    summary = json.loads(chunk.summary_json)
        if not summary:
            raise SystemExit("steplens trace: the collector's answer ended early; nothing written")
        os.replace(tmp, args.output)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    summary["file"] = args.output
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    c = summary["counts"]
    print(f"wrote {args.output}: {summary['bytes']:,} bytes, {len(summary['ranks'])} ranks on "
          f"{len(summary['nodes'])} nodes, {(summary['until_ns'] - summary['since_ns']) / 1e9:.1f} s; "
          + ", ".join(f"{k} {v:,}" for k, v in c.items() if v and k not in ("tracks",)))
    for node in summary["offline"]:
        print(f"  node {node}: not in the trace's detail ({summary['messages'].get(node, 'not asked')})")
    for node, msg in summary["messages"].items():
        if "truncated" in msg:
            print(f"  node {node}: {msg}")
    print("open it in https://ui.perfetto.dev (Open trace file) or with trace_processor_shell")
    return 0


def register(sub) -> None:
    """Add jobs, findings, diagnose and topology to the `steplens` subcommands."""
    sp = sub.add_parser("jobs", help="jobs: ranks, nodes, communicators, step time and baseline, open findings")
    sp.add_argument("--job", help="only this job key")
    sp.add_argument("--json", action="store_true", help="one JSON list of jobs")
    sp.set_defaults(func=cmd_jobs)
    sp = sub.add_parser("findings", help="findings of the detectors: what happened to which job, who is to blame")
    sp.add_argument("--job", help="only this job key")
    sp.add_argument("--since", default="", help="only findings active in the last DURATION (e.g. 1h)")
    sp.add_argument("--open", action="store_true", help="only open findings (with --watch: start with them)")
    sp.add_argument("--limit", type=int, default=1000)
    sp.add_argument("--watch", action="store_true", help="stream new/updated/resolved findings as JSON lines")
    sp.add_argument("--count", type=int, default=0, help="with --watch: stop after this many events")
    sp.add_argument("--json", action="store_true", help="one JSON list of findings")
    sp.set_defaults(func=cmd_findings)
    sp = sub.add_parser("diagnose", help="run every detector on one job now and print its findings")
    sp.add_argument("job", help="the job key (see `steplens jobs`)")
    sp.add_argument("--since", default="10m", help="window: the last DURATION of data (default 10m)")
    sp.add_argument("--json", action="store_true", help="one JSON list of the findings of this run")
    sp.set_defaults(func=cmd_diagnose)
    sp = sub.add_parser("timeline", help="per-rank step start/end of a job, reconstructed from its network flows "
                                         "(each step ends with its DP traffic)")
    sp.add_argument("job", help="a job recognized from flows (flows-...) or a job matched to one (see `steplens jobs`)")
    sp.add_argument("--since", default="", help="window: the last DURATION (default: the flow analysis's window)")
    sp.add_argument("--limit", type=int, default=200, help="rows printed at most (not with --json)")
    sp.add_argument("--json", action="store_true", help="one JSON list of {endpoint, rank, step, start_ns, end_ns}")
    sp.set_defaults(func=cmd_timeline)
    sp = sub.add_parser("trace", help="one Perfetto trace of a job's ranks in cluster time: steps, Python stacks, "
                                      "comm ops with flows, kernels, counters, deep dives, findings")
    sp.add_argument("job", help="the job key (see `steplens jobs`)")
    sp.add_argument("-o", "--output", required=True, help="the trace file to write (e.g. job.pftrace)")
    sp.add_argument("--finding", help="the window of this finding: its deep dive, or its span with 10 s each side")
    sp.add_argument("--since", default="", help="window start: DURATION ago (default: 60 s before --until)")
    sp.add_argument("--until", default="", help="window end: DURATION ago (default: now)")
    sp.add_argument("--store-only", action="store_true", help="leave out the agents' node-local detail")
    sp.add_argument("--json", action="store_true", help="print the summary as JSON")
    sp.set_defaults(func=cmd_trace)
    sp = sub.add_parser("topology", help="the physical topology the collector holds (imported from a file)")
    sp.add_argument("--json", action="store_true", help="summary plus the whole document")
    sp.set_defaults(func=cmd_topology)


def register_import(isub) -> None:
    """Add `import topology FILE` under `steplens import`."""
    ip = isub.add_parser("topology", help="import the physical topology (node -> GPUs -> NIC -> leaf -> spine) "
                                          "from a JSON file in the documented format (README: Topology file)")
    ip.add_argument("file")
    ip.add_argument("--origin", help="name recorded with it (default: the file name)")
    ip.add_argument("--json", action="store_true")
    ip.set_defaults(func=cmd_import_topology)
