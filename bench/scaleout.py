"""Scale-out acceptance run: two collectors on one ClickHouse store, N emulated agents split between them, the
collector that owns the job killed mid-run.

What it checks and prints (issue "Scale-out", acceptance item 2):
  - the agents split between the two collectors (each agent starts at crc32(node id) % 2 of the list "A,B");
  - on both collectors, every agent listed (the state replicated through the store) and the job with all its
    ranks; a FetchDetail from each collector to every agent (half of them through the other collector, Peer
    relay); a Diagnose of the job on each;
  - the owner of the job's analysis killed: its agents reconnect to the survivor (seconds), the survivor takes
    the job's analysis over (after the heartbeat TTL) and runs it; FetchDetail to every agent and Diagnose again
    on the survivor;
  - at the end, after the agents drained: per agent, the records it produced = the records stored (committed)
    once: lost and duplicated counts, from the store's delivery records and from the metric rows themselves.

Emulated agents (a child process): each a real Spool and a real StreamClient (bench/ingest.py EmulatedAgent),
sending Metric records (200 series) plus, per batch, one Step of the job "scaleout-job" (rank = agent index)
and once its ProcessInfo; each answers FetchDetail with an empty RecordList.

Stores and what "killed" means:
  --store chdb (default here): chDB, the ClickHouse engine in-process. chDB runs one engine per process, so both
    collectors run in this process; the kill is as abrupt as one process can make it: the owner's gRPC server
    stopped with no grace (every stream cut), its writer's store calls failing from that instant (a write group
    cut between its inserts, as by SIGKILL: never committed, never acked), its analysis and heartbeat stopped.
  --store clickhouse://HOST:PORT/DB (a server): two `steplens-collector serve` processes, the owner killed with
    SIGKILL. (No ClickHouse server can be installed on the development machine: this mode is written for one and
    was not run there.)

    .venv/bin/python bench/scaleout.py [--agents 200] [--before 20] [--after 20] [--rate 40000]

The last line of stdout is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

JOB = "scaleout-job"


# ==== emulator child process ==================================================================

def run_emulator(args) -> int:
    import logging

    from ingest import EmulatedAgent

    from steplens.agent.records import ProcessInfo, Step
    from steplens.agent.transport.codec import encode_records
    from steplens.v1 import ingest_pb2 as ipb
    from steplens.v1 import records_pb2 as rpb
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)

    class JobAgent(EmulatedAgent):
        def __init__(self, index: int, state_dir: str, collector: str) -> None:
            super().__init__(index, state_dir, collector)
            self.rank, self.step, self.metric_records, self.sent_info = index, 0, 0, False
            self.agent_id = node_id(index)
            self.client = self._new_client()
            self.fetches = 0

        def command(self, cmd):
            if cmd.WhichOneof("kind") == "fetch":
                self.fetches += 1
                return ipb.CommandResult(command_id=cmd.command_id, ok=True, message="emulated: no detail kept",
                                         payload=rpb.RecordList().SerializeToString())
            return ipb.CommandResult(command_id=cmd.command_id, ok=True, message="emulated: noted")

        def make_batch(self, n_ticks: int):
            payload, n, mono = super().make_batch(n_ticks)
            self.metric_records += n
            extra = []
            if not self.sent_info:
                extra.append(("procs", ProcessInfo(mono, 1000 + self.rank, 77, job_key=JOB, rank=self.rank,
                                                   world_size=args.agents)))
                self.sent_info = True
            extra.append(("flightrec", Step(mono, 1000 + self.rank, 77, JOB, self.rank, self.step,
                                            mono - 500_000_000, mono, "comm_pattern", 4, 4)))
            self.step += 1
            # one batch per call: the metrics' payload and the job's records go as two spool batches
            self.spool.append(encode_records(extra), len(extra), mono)
            return payload, n, mono

    collectors = args.collectors
    agents = [JobAgent(i, os.path.join(args.tmp, "emu", f"{i:03d}"), collectors) for i in range(args.agents)]
    for a in agents:
        a.client.start()
    deadline = time.monotonic() + 120
    while not all(a.client.connected for a in agents) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not all(a.client.connected for a in agents):
        print(json.dumps({"event": "error", "error": "agents not acknowledged in 120 s"}), flush=True)
        return 1
    stop = threading.Event()
    ticks = max(1, args.batch_records // len(agents[0].series))
    interval = ticks * len(agents[0].series) * len(agents) / args.rate

    def generate() -> None:
        due = time.monotonic()
        while not stop.is_set():
            for a in agents:
                if a.spool.stats().backlog_batches <= 64:
                    payload, n, mono = a.make_batch(ticks)
                    a.spool.append(payload, n, mono)
            due += interval
            stop.wait(max(0.0, due - time.monotonic()))
    th = threading.Thread(target=generate, daemon=True)
    th.start()
    print(json.dumps({"event": "ready"}), flush=True)
    for line in sys.stdin:
        if line.strip() == "stop":
            break
    stop.set()
    th.join(10)
    out = {}

    def drain(a) -> None:
        drained = a.client.drain_and_stop(args.drain_timeout)
        st = a.spool.stats()
        out[a.agent_id] = {"drained": drained, "produced": st.records_produced, "acked": st.records_acked,
                           "dropped": st.records_dropped, "metric_records": a.metric_records,
                           "connects": a.client.connects, "fetches": a.fetches}
        a.spool.close()
    threads = [threading.Thread(target=drain, args=(a,)) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"event": "done", "agents": out}), flush=True)
    return 0


def node_id(i: int) -> str:
    return f"so-{i:03d}"


# ==== the collectors ==========================================================================

class InProcess:
    """Both collectors in this process (chDB); kill(i) as abrupt as one process allows (module docstring)."""

    def __init__(self, tmp: str, store: str, n: int = 2) -> None:
        from steplens.collector.analysis.base import AnalysisSettings
        from steplens.collector.server import Collector, CollectorSettings
        self.loop = asyncio.new_event_loop()
        self.th = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.th.start()
        self.c = [Collector(CollectorSettings(
            db=os.path.join(tmp, f"c{i}.db"), store=store, listen="127.0.0.1:0", insecure=True,
            analysis=AnalysisSettings(collector_id=f"c{i}", heartbeat_seconds=0.5, collector_ttl_seconds=3.0,
                                      interval_seconds=2.0))) for i in range(n)]
        self.ports = [self._run(c.start()) for c in self.c]
        self.alive = [True] * n

    def _run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def sessions(self, i: int) -> int:
        return len(self.c[i].ingest.sessions) if self.alive[i] else 0

    def owner(self, job: str) -> int | None:
        for i, c in enumerate(self.c):
            own = c.analysis.ownership
            if self.alive[i] and own is not None and own.owns(job):
                return i
        return None

    def analysed(self, i: int) -> int:
        return self.c[i].analysis.jobs_analysed

    def kill(self, i: int) -> None:
        from steplens.collector.store.writer import BackendError
        c = self.c[i]

        class Dead:   # every store call of the killed collector's writer fails from now on
            db = c.writer.ch.db

            def __getattr__(self, name):
                def fail(*a, **k):
                    raise BackendError("collector killed")
                return fail
        c.writer.ch = Dead()
        c.analysis.stop(0.1)
        self._run(c.server.stop(0))
        self.alive[i] = False

    def store_reader(self):
        return self.c[1 - self.alive.index(False) if False in self.alive else 0].control.reader

    def close(self) -> None:
        for i, c in enumerate(self.c):
            try:
                self._run(c.stop(0.5) if self.alive[i] else c.deepdives.stop(), 60)
            except Exception:
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.th.join(10)


def _free_port() -> int:
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class ServerProcesses:
    def __init__(self, tmp: str, store: str) -> None:
        self.ports = [_free_port(), _free_port()]
        self.procs = []
        exe = os.path.join(os.path.dirname(sys.executable), "steplens-collector")
        for i, port in enumerate(self.ports):
            cfg = os.path.join(tmp, f"c{i}.toml")
            with open(cfg, "w") as fh:
                fh.write(f'[analysis]\ncollector_id = "c{i}"\nheartbeat_seconds = 0.5\ncollector_ttl_seconds = 3.0\n')
            self.procs.append(subprocess.Popen(
                [exe, "serve", "--db", os.path.join(tmp, f"c{i}.db"), "--store", store, "--listen",
                 f"127.0.0.1:{port}", "--insecure", "--config", cfg],
                stdout=open(os.path.join(tmp, f"c{i}.log"), "ab"), stderr=subprocess.STDOUT))
        self.alive = [True, True]
        self.store, self.tmp = store, tmp
        time.sleep(3)

    def sessions(self, i: int) -> int:
        if not self.alive[i]:
            return 0
        return sum(1 for n in _nodes(_stub(self.ports[i])) if n.connected and not n.collector)

    def owner(self, job: str) -> int | None:
        return None   # not visible from outside: the survivor's Diagnose and its findings stand for it

    def analysed(self, i: int) -> int:
        return -1

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(10)
        self.alive[i] = False

    def store_reader(self):
        from steplens.collector.store.clickhouse import ClickHouseReader, parse_store
        return ClickHouseReader(os.path.join(self.tmp, f"c{self.alive.index(True)}.db"), parse_store(self.store))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                p.wait(20)


# ==== Control calls ============================================================================

_STUBS: dict = {}


def _stub(port: int):
    import grpc

    from steplens.v1 import control_pb2_grpc as cgrpc
    if port not in _STUBS:
        _STUBS[port] = cgrpc.ControlStub(grpc.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_receive_message_length", 64 << 20)]))
    return _STUBS[port]


def _nodes(stub):
    from steplens.v1 import control_pb2 as cpb
    return list(stub.ListNodes(cpb.ListRequest(), timeout=30).nodes)


def _fetch_all(port: int, nodes: list[str]) -> dict:
    """FetchDetail to every node through one collector, 32 at a time: {ok, failed, seconds, errors}."""
    import grpc

    from steplens.v1 import control_pb2 as cpb
    stub = _stub(port)
    t0 = time.monotonic()
    ok, errors = 0, {}
    for k in range(0, len(nodes), 32):
        futs = {n: stub.FetchDetail.future(cpb.FetchRequest(node_id=n, kinds=["stacks"]), timeout=60)
                for n in nodes[k:k + 32]}
        for n, f in futs.items():
            try:
                f.result()
                ok += 1
            except grpc.RpcError as exc:
                errors[n] = f"{exc.code().name}: {exc.details()}"
    return {"ok": ok, "failed": len(errors), "seconds": round(time.monotonic() - t0, 2),
            "errors": dict(list(errors.items())[:5])}


def _view(port: int, n_agents: int) -> dict:
    """What one collector says: nodes listed and connected, the job's ranks, a Diagnose."""
    from steplens.v1 import control_pb2 as cpb
    stub = _stub(port)
    nodes = _nodes(stub)
    jobs = {j.job_key: j for j in stub.ListJobs(cpb.JobsRequest(), timeout=60).jobs}
    job = jobs.get(JOB)
    t0 = time.monotonic()
    diag = stub.Diagnose(cpb.DiagnoseRequest(job_key=JOB), timeout=300)
    return {"nodes": len(nodes), "connected": sum(n.connected for n in nodes),
            "held_here": sum(1 for n in nodes if n.connected and not n.collector),
            "job_ranks": len(job.ranks) if job else 0, "diagnose_detectors": len(diag.detectors),
            "diagnose_findings": len(diag.findings), "diagnose_errors": dict(diag.errors),
            "diagnose_seconds": round(time.monotonic() - t0, 2)}


def _wait(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.25)
    raise SystemExit(f"scaleout: timed out after {timeout:.0f} s waiting for {what}")


def _stored(reader, n_agents: int) -> dict:
    """Per agent, from the store's committed rows: batches, distinct batches, records, metric rows."""
    from steplens.collector.store.clickhouse import commit_marks, committed_cond
    ch = reader.ch
    cond, args = committed_cond(commit_marks(ch))
    out = {}
    for agent, n, uniq, recs in ch.query(
            f"SELECT agent_id, count(), uniqExact(spool_id, seq), sum(n_records) FROM {ch.db}.batches"
            f" WHERE agent_id LIKE 'so-%' AND {cond} GROUP BY agent_id", args):
        out[agent] = {"batches": n, "distinct": uniq, "records": recs}
    for agent, rows, distinct in ch.query(
            f"SELECT agent_id, count(), uniqExact(name, entity, ts_ns) FROM {ch.db}.metrics"
            f" WHERE agent_id LIKE 'so-%' AND {cond} GROUP BY agent_id", args):
        out.setdefault(agent, {}).update(metric_rows=rows, metric_distinct=distinct)
    raw = ch.query(f"SELECT count() FROM {ch.db}.metrics WHERE agent_id LIKE 'so-%'")[0][0]
    return {"agents": out, "metric_rows_uncommitted": raw - sum(v.get("metric_rows", 0) for v in out.values())}


def store_check(reader, prefix: str) -> dict:
    """bench/sim/stream.py store_check on a ClickHouse store, committed rows only: per agent's spool, its seqs
    1..n exactly once; the rows of each table. (A collector from before rows named their writer: every row.)"""
    ch = reader.ch
    try:
        from steplens.collector.store.clickhouse import commit_marks, committed_cond
        cond, args = committed_cond(commit_marks(ch))
    except ImportError:
        cond, args = "1", []
    rows = ch.query(f"SELECT agent_id, count(), uniqExact(seq), min(seq), max(seq), sum(n_records), sum(n_rejected)"
                    f" FROM {ch.db}.batches WHERE startsWith(agent_id, ?) AND {cond} GROUP BY agent_id, spool_id",
                    [prefix, *args])
    count = {t: ch.query(f"SELECT count() FROM {ch.db}.{t} WHERE startsWith(agent_id, ?) AND {cond}",
                         [prefix, *args])[0][0] for t in ("metrics", "flows", "steps", "comm_summaries")}
    return {"agents": len({r[0] for r in rows}), "spools": len(rows), "batches": sum(r[1] for r in rows),
            "records": sum(r[5] for r in rows), "rejected": sum(r[6] for r in rows),
            "seq_not_contiguous": [r[0] for r in rows if not (r[3] == 1 and r[4] == r[1] == r[2])],
            "metric_rows": count["metrics"], "flow_rows": count["flows"], "step_rows": count["steps"],
            "comm_summary_rows": count["comm_summaries"]}


def serve(n: int, tmp: str) -> int:
    """--serve N: N collectors in this process on one chDB database (bench/sim_speed.py --collectors N): prints
    {"ports": [...]} and serves; on stdin, `check PREFIX` prints store_check's JSON, `stop` (or EOF) stops."""
    import logging
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cs = InProcess(tmp, f"chdb://{os.path.join(tmp, 'chdb')}?database=bench", n)
    try:
        print(json.dumps({"ports": cs.ports}), flush=True)
        for line in sys.stdin:
            cmd = line.split()
            if cmd and cmd[0] == "check":
                print(json.dumps(store_check(cs.c[0].control.reader, cmd[1])), flush=True)
            elif cmd and cmd[0] == "stop":
                break
    finally:
        cs.close()
    return 0


# ==== parent ====================================================================================

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=200)
    p.add_argument("--before", type=float, default=20.0, help="seconds of streaming before the kill")
    p.add_argument("--after", type=float, default=20.0, help="seconds of streaming after the survivor took over")
    p.add_argument("--rate", type=float, default=40_000.0, help="offered metric rows/s over all agents")
    p.add_argument("--batch-records", type=int, default=1000)
    p.add_argument("--drain-timeout", type=float, default=120.0)
    p.add_argument("--store", default="chdb", help="chdb (in-process, default) or clickhouse://HOST:PORT/DB")
    p.add_argument("--emulate", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--collectors", default="", help=argparse.SUPPRESS)
    p.add_argument("--tmp", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.emulate:
        return run_emulator(args)
    if args.serve:
        return serve(args.serve, args.tmp)
    tmp = tempfile.mkdtemp(prefix="steplens-scaleout-")
    if args.store == "chdb":
        store = f"chdb://{os.path.join(tmp, 'chdb')}?database=scaleout"
        cs = InProcess(tmp, store)
        mode = "chdb in-process, abrupt stop"
    else:
        cs = ServerProcesses(tmp, args.store)
        mode = "ClickHouse server, SIGKILL"
    emu = None
    result: dict = {"store": mode, "agents": args.agents}
    try:
        collectors = ",".join(f"127.0.0.1:{p}" for p in cs.ports)
        emu = subprocess.Popen([sys.executable, __file__, "--emulate", "--agents", str(args.agents), "--collectors",
                                collectors, "--tmp", tmp, "--rate", str(args.rate), "--batch-records",
                                str(args.batch_records), "--drain-timeout", str(args.drain_timeout)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        ev = json.loads(emu.stdout.readline() or '{"event": "eof"}')
        if ev.get("event") != "ready":
            raise SystemExit(f"scaleout: emulator: {ev}")
        nodes = [node_id(i) for i in range(args.agents)]
        expect = [sum(1 for n in nodes if zlib.crc32(n.encode()) % 2 == i) for i in range(2)]
        _wait(lambda: [cs.sessions(0), cs.sessions(1)] == expect, 60, f"the agents split {expect}")
        result["split"] = expect
        t_rep = _wait(lambda: all(_view_nodes(port) == args.agents for port in cs.ports), 60,
                      "every agent listed on both collectors")
        result["replicated_listing_seconds"] = round(t_rep, 1)
        time.sleep(args.before)
        result["before"] = {f"c{i}": {**_view(cs.ports[i], args.agents), "fetch": _fetch_all(cs.ports[i], nodes)}
                            for i in range(2)}
        owner = cs.owner(JOB)
        owner = 0 if owner is None else owner
        survivor = 1 - owner
        analysed0 = cs.analysed(survivor)
        print(f"scaleout: killing c{owner} (the job's analysis owner)", file=sys.stderr, flush=True)
        t_kill = time.monotonic()
        cs.kill(owner)
        t_moved = _wait(lambda: cs.sessions(survivor) == args.agents, 120, "every agent on the survivor")
        result["reconnect_seconds"] = round(t_moved, 1)
        if cs.owner(JOB) is not None or isinstance(cs, InProcess):
            _wait(lambda: cs.owner(JOB) == survivor, 60, "the survivor owning the job")
            _wait(lambda: cs.analysed(survivor) > analysed0, 120, "the survivor analysing the job")
            result["analysis_takeover_seconds"] = round(time.monotonic() - t_kill, 1)
        time.sleep(args.after)
        result["after"] = {f"c{survivor}": {**_view(cs.ports[survivor], args.agents),
                                            "fetch": _fetch_all(cs.ports[survivor], nodes)}}
        emu.stdin.write("stop\n")
        emu.stdin.flush()
        done = json.loads(emu.stdout.readline() or '{"event": "eof"}')
        if done.get("event") != "done":
            raise SystemExit(f"scaleout: emulator: {done}")
        time.sleep(2)
        stored = _stored(cs.store_reader(), args.agents)
        lost = dup = metric_lost = metric_dup = undrained = 0
        for a, prod in done["agents"].items():
            st = stored["agents"].get(a, {})
            undrained += not prod["drained"]
            lost += max(0, prod["produced"] - st.get("records", 0))
            dup += st.get("batches", 0) - st.get("distinct", 0)
            metric_lost += max(0, prod["metric_records"] - st.get("metric_rows", 0))
            metric_dup += st.get("metric_rows", 0) - st.get("metric_distinct", 0)
        produced = sum(v["produced"] for v in done["agents"].values())
        result.update(records_produced=produced, records_stored=sum(v.get("records", 0)
                                                                    for v in stored["agents"].values()),
                      records_lost=lost, batches_duplicated=dup, metric_rows_lost=metric_lost,
                      metric_rows_duplicated=metric_dup, agents_not_drained=undrained,
                      metric_rows_uncommitted_left=stored["metric_rows_uncommitted"],
                      agents_reconnected=sum(v["connects"] > 1 for v in done["agents"].values()))
    finally:
        if emu is not None and emu.poll() is None:
            emu.kill()
        cs.close()
    before, after = result.get("before", {}), result.get("after", {})
    head = {
        "store": mode, "agents": args.agents,
        "fetch_ok_before": sum(v["fetch"]["ok"] for v in before.values()),
        "fetch_ok_after": sum(v["fetch"]["ok"] for v in after.values()),
        "job_ranks_seen_per_collector": [v["job_ranks"] for v in before.values()],
        "reconnect_seconds": result.get("reconnect_seconds"),
        "analysis_takeover_seconds": result.get("analysis_takeover_seconds"),
        "records_produced": result.get("records_produced"), "records_lost": result.get("records_lost"),
        "batches_duplicated": result.get("batches_duplicated"), "metric_rows_lost": result.get("metric_rows_lost"),
        "metric_rows_duplicated": result.get("metric_rows_duplicated"),
    }
    print(json.dumps(result, indent=1), file=sys.stderr)
    print(json.dumps(head))
    return 0 if head["records_lost"] == 0 and head["batches_duplicated"] == 0 else 1


def _view_nodes(port: int) -> int:
    return sum(1 for n in _nodes(_stub(port)) if n.connected)


if __name__ == "__main__":
    sys.exit(main())
