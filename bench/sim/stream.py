"""Stream a simulated job live through the real gRPC path: N emulated agents, each a real Spool and a
real StreamClient (agent_id `sim-node-<k>`), sending what a node's agent would send.

Per agent (nodes are dealt round-robin: node n belongs to agent n % N):
  Metric sim_step_seconds / sim_comm_wait_seconds, entity rank<r>, at each step's end
  Metric gpu_utilization_percent / gpu_sm_clock_mhz / gpu_power_watts, entity gpu<i> (node<n>.gpu<i> when
         an agent hosts several nodes), once per GPU per simulated second
  Flow   for each inter-node transfer the node sends (records.Flow has no switches: those are in the files)
mono_ns = mono_base + simulated ns, with mono_base = now - job length (so every record lies in the past and
the collector's 'not ahead of the send time' check holds) or, with pace='realtime', now (records are
appended when their simulated time comes).

Scale: one StreamClient is 2 threads plus its gRPC stream, so agents are spread over `procs` worker
processes; each worker re-runs the (deterministic, ~2 µs per rank-iteration) simulation and builds only its
own agents' records, so no records cross processes. A worker keeps each spool's backlog at or below
`max_backlog` batches (waiting otherwise, counted as `backpressure_s`: time the collector was the bottleneck).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import uuid
from dataclasses import dataclass

from .faults import Fault
from .model import Iteration, ModelConfig, simulate
from .output import Rows


@dataclass
class StreamConfig:
    collector: str
    agents: int = 0            # 0: one per node
    procs: int = 1
    state_dir: str = ""
    batch_records: int = 2000
    max_backlog: int = 16
    pace: str = "none"         # none | realtime
    drain_timeout_s: float = 120.0
    connect_timeout_s: float = 60.0
    connect_wave: int = 25     # agents a worker starts at once, waiting for their HelloAck before the next
    insecure: bool = True

    def validate(self, nodes: int) -> None:
        if self.pace not in ("none", "realtime"):
            raise ValueError("pace must be none or realtime")
        if self.agents < 0 or self.procs < 1:
            raise ValueError("agents >= 0 and procs >= 1")
        if (self.agents or nodes) < self.procs:
            raise ValueError(f"more worker processes ({self.procs}) than agents ({self.agents or nodes})")


class _Agent:
    def __init__(self, k: int, state_dir: str, sc: StreamConfig) -> None:
        from steplens.agent.spool import Spool
        from steplens.agent.transport.client import StreamClient, TransportConfig
        self.agent_id = f"sim-node-{k}"
        self.spool = Spool(os.path.join(state_dir, self.agent_id, "spool.db"), max_bytes=64 << 20)
        self.items: list = []
        self.last_mono = 0
        self.client = StreamClient(TransportConfig(sc.collector, self.agent_id, insecure=sc.insecure,
                                                   reconnect_min_seconds=0.2, reconnect_max_seconds=2.0),
                                   self.spool, self.status, self.command, hostname=self.agent_id,
                                   boot_id=uuid.uuid4().hex)

    def status(self, final: bool):
        from steplens.v1 import ingest_pb2 as ipb
        from steplens.v1 import records_pb2 as rpb
        st = self.spool.stats()
        return ipb.AgentStatus(mono_ns=time.monotonic_ns(), spool_backlog_batches=st.backlog_batches,
                               spool_backlog_records=st.backlog_records, spool_backlog_bytes=st.backlog_bytes,
                               records_produced=st.records_produced, records_acked=st.records_acked,
                               records_dropped=st.records_dropped, mode=rpb.MODE_SENTINEL, final=final)

    def command(self, cmd):
        from steplens.v1 import ingest_pb2 as ipb
        return ipb.CommandResult(command_id=cmd.command_id, ok=False, message="simulated agent runs no commands")


def _worker(cfg: ModelConfig, faults: list[Fault], sc: StreamConfig, agent_ids: list[int], n_agents: int,
            job_ns: float, result_q) -> None:
    import logging
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from steplens.agent.records import Flow, Metric
    from steplens.agent.transport.codec import encode_records

    topo = cfg.topology()
    gpn = topo.gpus_per_node
    mine = set(agent_ids)
    agents = {k: _Agent(k, sc.state_dir, sc) for k in agent_ids}
    # connect in waves: 1,000+ simultaneous Hellos overrun the collector's hello timeout on 2 cores
    deadline = time.monotonic() + sc.connect_timeout_s
    order = list(agents.values())
    for i in range(0, len(order), sc.connect_wave):
        wave = order[i:i + sc.connect_wave]
        for a in wave:
            a.client.start()
        while not all(a.client.connected for a in wave) and time.monotonic() < deadline:
            time.sleep(0.02)
    stuck = [a.agent_id for a in agents.values() if not a.client.connected]
    if stuck:
        result_q.put({"error": f"{len(stuck)} agents not acknowledged in {sc.connect_timeout_s} s",
                      "last_error": agents[int(stuck[0].rsplit('-', 1)[1])].client.last_error})
        for a in agents.values():
            a.client.drain_and_stop(1.0)
        return
    one_node = n_agents >= topo.nodes
    now = time.monotonic_ns()
    mono_base = now if sc.pace == "realtime" else now - int(job_ns) - 10**9
    rows = Rows(cfg)
    stats = {"records": 0, "batches": 0, "build_s": 0.0, "encode_append_s": 0.0, "backpressure_s": 0.0,
             "pace_wait_s": 0.0}

    def owner(rank: int) -> int:
        return (rank // gpn) % n_agents

    def flush(a: _Agent, force: bool) -> None:
        if not a.items or (not force and len(a.items) < sc.batch_records):
            return
        t0 = time.perf_counter()
        while a.spool.stats().backlog_batches > sc.max_backlog:
            time.sleep(0.002)
        t1 = time.perf_counter()
        payload = encode_records(a.items)
        a.spool.append(payload, len(a.items), a.last_mono)
        stats["backpressure_s"] += t1 - t0
        stats["encode_append_s"] += time.perf_counter() - t1
        stats["records"] += len(a.items)
        stats["batches"] += 1
        a.items = []

    def sink(it: Iteration) -> None:
        t0 = time.perf_counter()
        base = cfg.base_ns
        for r, i, a_ns, b_ns, comp, wait, stall in rows.steps(it):
            k = owner(r)
            if k not in mine:
                continue
            ag = agents[k]
            mono = mono_base + (b_ns - base)
            ag.items.append(("sim", Metric(mono, "sim_step_seconds", f"rank{r}", (b_ns - a_ns) / 1e9)))
            ag.items.append(("sim", Metric(mono, "sim_comm_wait_seconds", f"rank{r}", wait / 1e9)))
            ag.last_mono = max(ag.last_mono, mono)
        for ts, r, util, clock, power in rows.telemetry(it):
            k = owner(r)
            if k not in mine:
                continue
            ag = agents[k]
            mono = mono_base + (ts - base)
            ent = f"gpu{r % gpn}" if one_node else f"node{r // gpn}.gpu{r % gpn}"
            ag.items += [("sim", Metric(mono, "gpu_utilization_percent", ent, util)),
                         ("sim", Metric(mono, "gpu_sm_clock_mhz", ent, clock)),
                         ("sim", Metric(mono, "gpu_power_watts", ent, power))]
            ag.last_mono = max(ag.last_mono, mono)
        ip = topo.ip
        for st, src, dst, nb, dur, _path in rows.flows(it):
            k = owner(src)
            if k not in mine:
                continue
            ag = agents[k]
            smono = mono_base + (st - base)
            emono = smono + max(1, int(dur * 1e9))
            ag.items.append(("sim", Flow(emono, smono, ip(src), 40000 + src % 20000, ip(dst), 29500,
                                         nb, max(1, nb // 4096))))
            ag.last_mono = max(ag.last_mono, emono)
        stats["build_s"] += time.perf_counter() - t0
        if sc.pace == "realtime":
            due = mono_base + int(max(it.end))
            t1 = time.perf_counter()
            while time.monotonic_ns() < due:
                time.sleep(min(0.05, (due - time.monotonic_ns()) / 1e9))
            stats["pace_wait_s"] += time.perf_counter() - t1
        for ag in agents.values():
            flush(ag, False)

    t_start = time.perf_counter()
    simulate(cfg, faults, sink)
    for ag in agents.values():
        flush(ag, True)
    t_gen = time.perf_counter() - t_start
    drained = {}
    for ag in agents.values():
        drained[ag.agent_id] = ag.client.drain_and_stop(sc.drain_timeout_s)
    st = {ag.agent_id: ag.spool.stats() for ag in agents.values()}
    for ag in agents.values():
        ag.spool.close()
    result_q.put({"agents": len(agents), "generate_s": round(t_gen, 3),
                  "total_s": round(time.perf_counter() - t_start, 3), **{k: round(v, 3) if isinstance(v, float)
                                                                         else v for k, v in stats.items()},
                  "records_acked": sum(s.records_acked for s in st.values()),
                  "records_dropped": sum(s.records_dropped for s in st.values()),
                  "not_drained": [k for k, v in drained.items() if not v]})


def stream(cfg: ModelConfig, faults: list[Fault], sc: StreamConfig) -> dict:
    """Run the workers, wait for them, return the summed figures."""
    topo = cfg.topology()
    sc.validate(topo.nodes)
    n_agents = sc.agents or topo.nodes
    if not sc.state_dir:
        import tempfile
        sc.state_dir = tempfile.mkdtemp(prefix="steplens-sim-")
    # the job's length (for mono_base) from a quick pass with no sink
    t0 = time.perf_counter()
    job_ns = simulate(cfg, faults).end_ns
    sim_s = time.perf_counter() - t0
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    q = ctx.Queue()
    shares = [list(range(p, n_agents, sc.procs)) for p in range(sc.procs)]
    procs = [ctx.Process(target=_worker, args=(cfg, faults, sc, share, n_agents, job_ns, q), daemon=True)
             for share in shares]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results = []
    for _ in procs:
        results.append(q.get())
    for p in procs:
        p.join(10)
    wall = time.perf_counter() - t0
    errors = [r["error"] for r in results if "error" in r]
    ok = [r for r in results if "error" not in r]
    records = sum(r["records"] for r in ok)
    out = {"agents": n_agents, "procs": sc.procs, "simulate_s": round(sim_s, 3), "wall_s": round(wall, 3),
           "records": records, "records_acked": sum(r["records_acked"] for r in ok),
           "records_dropped": sum(r["records_dropped"] for r in ok),
           "records_per_s": round(records / wall, 1) if wall > 0 else 0.0,
           "backpressure_s_max": max((r["backpressure_s"] for r in ok), default=0.0),
           "build_s_max": max((r["build_s"] for r in ok), default=0.0),
           "encode_append_s_max": max((r["encode_append_s"] for r in ok), default=0.0),
           "generate_s_max": max((r["generate_s"] for r in ok), default=0.0),
           "not_drained": sum(len(r["not_drained"]) for r in ok), "errors": errors}
    return out

