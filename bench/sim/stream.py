"""Stream a simulated job live through the real gRPC path: N emulated agents (agent_id `sim-node-<k>`),
sending what a node's agent would send, to one collector.

Two kinds of emulated agent (`agent_kind`):
  light  bench/sim/lightagent.py: the Ingest wire protocol on asyncio, no spool. Thousands of streams per
         event loop over a few shared channels (`agents_per_channel`), one loop per worker process. What it
         leaves out (durability, replay beyond what is in memory, commands, TLS) is listed in its docstring;
         the collector side is the real thing under test. Use it for scale (1,250+ agents).
  real   each agent a real Spool (SQLite) plus a real StreamClient (agent/transport/client.py: 2 threads and a
         gRPC stream each). Faithful down to the spool, but ~250 agents is the most 2 cores start in time.

Per agent (nodes are dealt round-robin: node n belongs to agent n % N), exactly what bench/sim/agentview.py
says real agents send, each under the real source's name (procs, flightrec, gpu, netflows):
  ProcessInfo per rank at start (job key `job_key`, rank, local rank, world size); per rank per step the Step
  record with its per-communicator summaries and the CommSummary records (`steps`: constructed or the real
  StepSegmenter, see agentview.py); Metric gpu_utilization_percent / gpu_sm_clock_mhz / gpu_power_watts, entity
  gpu<i> (node<n>.gpu<i> when an agent hosts several nodes), once per GPU per simulated second; Flow for each
  inter-node transfer the node sends (records.Flow has no switches: those are in the files). No simulator-only
  value (step compute / wait split, ground truth): those stay in the files and truth.json for scoring.
mono_ns = mono_base + simulated ns, with mono_base = now - job length (so every record lies in the past and
the collector's 'not ahead of the send time' check holds) or, with pace='realtime', now (records are
appended when their simulated time comes).

Phases: every worker connects all its agents (waiting for each HelloAck), reports, and waits until the
parent says go, so `connect_s` (time until every agent of every worker has its HelloAck) and the streaming
figures do not mix. Each worker then re-runs the (deterministic, ~2 µs per rank-iteration) simulation and
builds only its own agents' records (agentview.py, ~1 µs per comm op), so no records cross processes. A worker keeps each agent's
unacknowledged backlog at or below `max_backlog` batches, waiting otherwise; that wait is `backpressure_s`
(time the collector was the bottleneck), against `build_s` (building records) and `encode_s` (encoding and
handing batches over): the simulator side.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from .faults import Fault
from .model import ModelConfig, simulate

AGENT_KINDS = ("light", "real")


@dataclass
class StreamConfig:
    collector: str
    agents: int = 0            # 0: one per node
    procs: int = 1
    state_dir: str = ""        # real agents' spools (light agents have none)
    batch_records: int = 2000
    max_backlog: int = 16
    pace: str = "none"         # none | realtime
    drain_timeout_s: float = 120.0
    connect_timeout_s: float = 60.0
    connect_wave: int = 25     # real agents a worker starts at once, waiting for their HelloAck before the next
    insecure: bool = True
    agent_kind: str = "real"   # light | real
    job_key: str = "simjob"    # the job key the emulated processes' ProcessInfo / Step records carry
    steps: str = "constructed"  # constructed | segmenter (agentview.py: how Step records are made)
    linger_s: float = 0.0      # light: stay connected this long after the last ack, answering FetchDetail
    agents_per_channel: int = 100  # light: streams sharing one channel (one TCP connection)
    window_batches: int = 8    # unacknowledged batches per agent on the wire (the real client's default)

    def validate(self, nodes: int) -> None:
        if self.pace not in ("none", "realtime"):
            raise ValueError("pace must be none or realtime")
        if self.agent_kind not in AGENT_KINDS:
            raise ValueError(f"agent_kind must be one of {', '.join(AGENT_KINDS)}")
        if self.agents < 0 or self.procs < 1:
            raise ValueError("agents >= 0 and procs >= 1")
        if (self.agents or nodes) < self.procs:
            raise ValueError(f"more worker processes ({self.procs}) than agents ({self.agents or nodes})")
        if self.agents_per_channel < 1 or self.window_batches < 1 or self.max_backlog < 1:
            raise ValueError("agents_per_channel, window_batches and max_backlog must be >= 1")
        if self.steps not in ("constructed", "segmenter") or not self.job_key:
            raise ValueError("steps must be constructed or segmenter, and job_key non-empty")


class _Builder:
    """Builds the records of this worker's agents (bench/sim/agentview.py: what real agents send) and hands
    each agent's records to `emit(k, items)` in batches of `batch_records`; run() does the whole job."""

    def __init__(self, cfg: ModelConfig, sc: StreamConfig, agent_ids: list[int], n_agents: int, mono_base: int,
                 emit: Callable[[int, list], None]) -> None:
        self.cfg, self.sc = cfg, sc
        self.topo = cfg.topology()
        self.mine = set(agent_ids)
        self.n_agents = n_agents
        self.mono_base = mono_base
        self.emit = emit
        self.items: dict[int, list] = {k: [] for k in agent_ids}
        self.build_s = 0.0
        self.pace_wait_s = 0.0
        self.records = 0
        self.batches = 0
        self.emit_s = 0.0          # time inside emit (encoding, waiting on the collector): not building

    def flush(self, k: int, force: bool) -> None:
        items = self.items[k]
        if not items or (not force and len(items) < self.sc.batch_records):
            return
        self.items[k] = []
        self.records += len(items)
        self.batches += 1
        t0 = time.perf_counter()
        self.emit(k, items)
        self.emit_s += time.perf_counter() - t0

    def finish(self) -> None:
        for k in self.items:
            self.flush(k, True)

    def run(self, faults: list[Fault]) -> None:
        from .agentview import _records
        n_agents, items, batch = self.n_agents, self.items, self.sc.batch_records
        nodes = {n for n in range(self.topo.nodes) if n % n_agents in self.mine}
        index = {f"sim-node-{k}": k for k in self.mine}
        realtime = self.sc.pace == "realtime"
        t0 = time.perf_counter()
        for aid, source, rec in _records(self.cfg, faults, self.sc.job_key, self.mono_base,
                                         n_agents if n_agents < self.topo.nodes else 0, self.sc.steps, nodes,
                                         sources=True):
            if realtime and rec.mono_ns > time.monotonic_ns():
                for k in items:  # what is due goes out before waiting for the next record's time
                    self.flush(k, True)
                t1 = time.perf_counter()
                while time.monotonic_ns() < rec.mono_ns:
                    time.sleep(min(0.05, max(0.0, (rec.mono_ns - time.monotonic_ns()) / 1e9)))
                self.pace_wait_s += time.perf_counter() - t1
            k = index[aid]
            lst = items[k]
            lst.append((source, rec))
            if len(lst) >= batch:
                self.flush(k, False)
        self.finish()
        self.build_s = time.perf_counter() - t0 - self.pace_wait_s - self.emit_s


def _mono_base(sc: StreamConfig, job_ns: float) -> int:
    now = time.monotonic_ns()
    return now if sc.pace == "realtime" else now - int(job_ns) - 10**9


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


# -- real agents: Spool + StreamClient ------------------------------------------------------------
class _Agent:
    def __init__(self, k: int, state_dir: str, sc: StreamConfig) -> None:
        from steplens.agent.spool import Spool
        from steplens.agent.transport.client import StreamClient, TransportConfig
        self.agent_id = f"sim-node-{k}"
        self.spool = Spool(os.path.join(state_dir, self.agent_id, "spool.db"), max_bytes=64 << 20)
        self.client = StreamClient(TransportConfig(sc.collector, self.agent_id, insecure=sc.insecure,
                                                   window_batches=sc.window_batches,
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


def _real_worker(cfg: ModelConfig, faults: list[Fault], sc: StreamConfig, agent_ids: list[int], n_agents: int,
                 job_ns: float, q, go) -> None:
    import logging
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from steplens.agent.transport.codec import encode_records

    agents = {k: _Agent(k, sc.state_dir, sc) for k in agent_ids}
    # connect in waves: 1,000+ simultaneous Hellos overrun the collector's hello timeout on 2 cores
    t_conn = time.perf_counter()
    deadline = time.monotonic() + sc.connect_timeout_s
    order = list(agents.values())
    for i in range(0, len(order), sc.connect_wave):
        wave = order[i:i + sc.connect_wave]
        for a in wave:
            a.client.start()
        while not all(a.client.connected for a in wave) and time.monotonic() < deadline:
            time.sleep(0.02)
    stuck = [a for a in agents.values() if not a.client.connected]
    q.put({"phase": "connected", "connected": len(agents) - len(stuck), "connect_s": time.perf_counter() - t_conn,
           "cpu_s": _cpu_s()})
    if stuck:
        q.put({"error": f"{len(stuck)} agents not acknowledged in {sc.connect_timeout_s} s",
               "last_error": stuck[0].client.last_error})
        for a in agents.values():
            a.client.drain_and_stop(1.0)
        return
    go.wait()
    cpu0 = _cpu_s()
    stats = {"backpressure_s": 0.0, "encode_s": 0.0}

    def emit(k: int, items: list) -> None:
        a = agents[k]
        t0 = time.perf_counter()
        while a.spool.stats().backlog_batches > sc.max_backlog:
            time.sleep(0.002)
        t1 = time.perf_counter()
        a.spool.append(encode_records(items), len(items), max(x[1].mono_ns for x in items))
        stats["backpressure_s"] += t1 - t0
        stats["encode_s"] += time.perf_counter() - t1

    builder = _Builder(cfg, sc, agent_ids, n_agents, _mono_base(sc, job_ns), emit)
    t_start = time.perf_counter()
    builder.run(faults)
    t_gen = time.perf_counter() - t_start
    t_drain = time.perf_counter()
    drained = {a.agent_id: a.client.drain_and_stop(sc.drain_timeout_s) for a in agents.values()}
    drain_s = time.perf_counter() - t_drain
    st = {a.agent_id: a.spool.stats() for a in agents.values()}
    for a in agents.values():
        a.spool.close()
    q.put(_result(agents=len(agents), generate_s=t_gen, total_s=time.perf_counter() - t_start, drain_s=drain_s,
                  records=builder.records, batches=builder.batches, build_s=builder.build_s,
                  pace_wait_s=builder.pace_wait_s, stream_cpu_s=_cpu_s() - cpu0, cpu_s=_cpu_s(),
                  records_acked=sum(s.records_acked for s in st.values()),
                  records_dropped=sum(s.records_dropped for s in st.values()),
                  reconnects=sum(max(0, a.client.connects - 1) for a in agents.values()),
                  reconnect_errors=sorted({a.client.last_error for a in agents.values() if a.client.last_error})[:5],
                  not_drained=[k for k, v in drained.items() if not v], **stats))


def _result(**kw) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in kw.items()}


# -- light agents: asyncio ------------------------------------------------------------------------
def _light_worker(cfg: ModelConfig, faults: list[Fault], sc: StreamConfig, agent_ids: list[int], n_agents: int,
                  job_ns: float, q, go) -> None:
    import asyncio
    import logging
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(_light_main(cfg, faults, sc, agent_ids, n_agents, job_ns, q, go))


async def _light_main(cfg: ModelConfig, faults: list[Fault], sc: StreamConfig, agent_ids: list[int],
                      n_agents: int, job_ns: float, q, go) -> None:
    import asyncio
    import threading

    from steplens.agent.transport.codec import encode_records

    from .lightagent import LightAgent, channel

    loop = asyncio.get_running_loop()
    progress = threading.Condition()

    def on_ack(_a) -> None:  # event loop thread: wake a producer waiting for room
        with progress:
            progress.notify_all()

    from steplens.conn import split_addresses
    addrs = split_addresses(sc.collector)   # several collectors of one store: the channels spread over them
    n_ch = max(len(addrs), -(-len(agent_ids) // sc.agents_per_channel))
    channels = [channel(addrs[i % len(addrs)]) for i in range(n_ch)]
    streaming = {"mono_base": None}
    agents = {k: LightAgent(f"sim-node-{k}", window_batches=sc.window_batches, on_ack=on_ack,
                            hello_timeout_s=max(15.0, sc.connect_timeout_s / 2),
                            on_command=_fetch_handler(cfg, faults, sc, k, n_agents, streaming)) for k in agent_ids}
    t_conn = time.perf_counter()
    # connect the channels first: hundreds of streams started on a channel that is still connecting
    # sometimes fail at once (CANCELLED / INTERNAL from gRPC core, nothing reaches the collector)
    try:
        await asyncio.wait_for(asyncio.gather(*(ch.channel_ready() for ch in channels)), sc.connect_timeout_s)
    except asyncio.TimeoutError:
        pass  # the agents' own hello timeouts and reconnects take it from here
    tasks = [asyncio.create_task(a.run(channels[i % n_ch])) for i, a in enumerate(agents.values())]
    deadline = time.monotonic() + sc.connect_timeout_s
    while time.monotonic() < deadline and not all(a.hello_acks for a in agents.values()):
        await asyncio.sleep(0.02)
    connect_s = time.perf_counter() - t_conn
    stuck = [a for a in agents.values() if not a.hello_acks]
    q.put({"phase": "connected", "connected": len(agents) - len(stuck), "connect_s": connect_s, "cpu_s": _cpu_s(),
           "first_ack_s_max": max((a.first_ack_s or 0.0) for a in agents.values())})
    if stuck:
        q.put({"error": f"{len(stuck)} of {len(agents)} agents not acknowledged in {sc.connect_timeout_s} s",
               "last_error": stuck[0].last_error})
        await asyncio.gather(*(a.drain_and_close(0.5) for a in agents.values()))
        for t in tasks:
            t.cancel()
        return
    await loop.run_in_executor(None, go.wait)
    cpu0 = _cpu_s()
    stats = {"backpressure_s": 0.0, "encode_s": 0.0}

    def emit(k: int, items: list) -> None:  # producer thread
        a = agents[k]
        t0 = time.perf_counter()
        if a.backlog >= sc.max_backlog:
            with progress:
                while a.backlog >= sc.max_backlog:
                    progress.wait(0.05)
        t1 = time.perf_counter()
        payload = encode_records(items)
        a.produced += 1  # counted here, so backlog holds before the loop thread runs append()
        loop.call_soon_threadsafe(a.append, payload, len(items))
        stats["backpressure_s"] += t1 - t0
        stats["encode_s"] += time.perf_counter() - t1

    builder = _Builder(cfg, sc, agent_ids, n_agents, _mono_base(sc, job_ns), emit)
    streaming["mono_base"] = builder.mono_base

    def produce() -> None:
        builder.run(faults)

    t_start = time.perf_counter()
    await loop.run_in_executor(None, produce)
    t_gen = time.perf_counter() - t_start
    t_drain = time.perf_counter()
    if sc.linger_s > 0:  # every batch acknowledged, then answer FetchDetail for a while
        deadline = time.monotonic() + sc.drain_timeout_s
        while time.monotonic() < deadline and any(a.acked_seq < a.appended for a in agents.values()):
            await asyncio.sleep(0.05)
        q.put({"phase": "lingering", "linger_s": sc.linger_s})
        await asyncio.sleep(sc.linger_s)
    drained = await asyncio.gather(*(a.drain_and_close(sc.drain_timeout_s) for a in agents.values()))
    drain_s = time.perf_counter() - t_drain
    total_s = time.perf_counter() - t_start
    await asyncio.wait(tasks, timeout=10)
    for t in tasks:
        t.cancel()
    for ch in channels:
        await ch.close()
    al = list(agents.values())
    q.put(_result(agents=len(al), channels=n_ch, generate_s=t_gen, total_s=total_s, drain_s=drain_s,
                  records=builder.records, batches=builder.batches, build_s=builder.build_s,
                  pace_wait_s=builder.pace_wait_s, stream_cpu_s=_cpu_s() - cpu0, cpu_s=_cpu_s(),
                  records_acked=sum(a.records_acked for a in al), records_dropped=0,
                  reconnects=sum(max(0, a.connects - 1) for a in al),
                  reconnect_errors=sorted({a.first_error for a in al if a.first_error})[:5],
                  not_drained=[a.agent_id for a, ok in zip(al, drained) if not ok],
                  stuck_sample=[a.debug_state() for a, ok in zip(al, drained) if not ok][:5], **stats))


def _fetch_handler(cfg: ModelConfig, faults: list[Fault], sc: StreamConfig, k: int, n_agents: int, streaming: dict):
    """A light agent's answer to commands: FetchDetail for commops from agentview.commops() over the ranks of
    the nodes this agent hosts (what a real agent answers from its node-local detail store), in a thread so
    the event loop's other streams go on; anything else is refused."""
    import asyncio

    from steplens.agent.transport.codec import encode_records
    from steplens.v1 import ingest_pb2 as ipb

    from .agentview import commops
    topo = cfg.topology()
    gpn = topo.gpus_per_node
    mine = [r for r in range(cfg.gpus) if (r // gpn) % n_agents == k]

    async def handle(cmd):
        if cmd.WhichOneof("kind") != "fetch":
            return ipb.CommandResult(command_id=cmd.command_id, ok=False,
                                     message="simulated agent runs only FetchDetail (commops)")
        f = cmd.fetch
        kinds = list(f.kinds) or ["stacks", "commops", "kernels"]
        if streaming["mono_base"] is None:
            return ipb.CommandResult(command_id=cmd.command_id, ok=False, message="no node-local detail yet")
        ranks = sorted(set(f.ranks) & set(mine)) if f.ranks else mine
        if "commops" not in kinds or not ranks:
            return ipb.CommandResult(command_id=cmd.command_id, ok=True, message="0 records", payload=b"")
        limit = min(f.limit or 100_000, 100_000)
        ops = await asyncio.get_running_loop().run_in_executor(
            None, lambda: commops(cfg, faults, ranks, f.since_mono_ns, f.until_mono_ns, streaming["mono_base"],
                                  job_key=sc.job_key))
        note = f"{min(len(ops), limit)} commops records" + (" (truncated: narrow the time range or ranks, or raise "
                                                           "the limit)" if len(ops) > limit else "")
        return ipb.CommandResult(command_id=cmd.command_id, ok=True, message=note,
                                 payload=encode_records([("flightrec", o) for o in ops[:limit]]))
    return handle


class _TaggedQueue:
    def __init__(self, w: int, q) -> None:
        self.w, self.q = w, q

    def put(self, m: dict) -> None:
        self.q.put({**m, "worker": self.w})


def _worker(w: int, cfg: ModelConfig, faults: list[Fault], sc: StreamConfig, agent_ids: list[int], n_agents: int,
            job_ns: float, q, go) -> None:
    tq = _TaggedQueue(w, q)
    try:
        target = _light_worker if sc.agent_kind == "light" else _real_worker
        target(cfg, faults, sc, agent_ids, n_agents, job_ns, tq, go)
    except BaseException as exc:  # report, so the parent does not wait for a dead worker
        import traceback
        tq.put({"error": f"worker {w} failed: {type(exc).__name__}: {exc}", "last_error": traceback.format_exc()})
        raise


# -- driver ---------------------------------------------------------------------------------------
def stream(cfg: ModelConfig, faults: list[Fault], sc: StreamConfig,
           on_phase: Callable[[str, dict], None] | None = None) -> dict:
    """Run the workers, wait for them, return the summed figures. `on_phase("connected", info)` is called
    once every worker has connected its agents (before streaming starts), `on_phase("lingering", info)` (with
    `linger_s` > 0, light agents) once every record is acknowledged and the agents wait, connected, answering
    FetchDetail (called on this thread: return quickly, or run the fetches elsewhere), `on_phase("streamed",
    out)` at the end (e.g. to sample the collector's CPU time per phase)."""
    topo = cfg.topology()
    sc.validate(topo.nodes)
    n_agents = sc.agents or topo.nodes
    if sc.agent_kind == "real" and not sc.state_dir:
        import tempfile
        sc.state_dir = tempfile.mkdtemp(prefix="steplens-sim-")
    # the job's length (for mono_base) from a quick pass with no sink
    t0 = time.perf_counter()
    job_ns = simulate(cfg, faults).end_ns
    sim_s = time.perf_counter() - t0
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    q = ctx.Queue()
    go = ctx.Event()
    shares = [list(range(p, n_agents, sc.procs)) for p in range(sc.procs)]
    procs = [ctx.Process(target=_worker, args=(w, cfg, faults, sc, share, n_agents, job_ns, q, go), daemon=True)
             for w, share in enumerate(shares)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    conn: dict[int, dict] = {}
    results: dict[int, dict] = {}
    try:
        while len(conn) < len(procs):
            m = q.get(timeout=sc.connect_timeout_s + 60)
            if m.get("phase") == "connected":
                conn[m["worker"]] = m
            else:  # a worker that failed before it could connect anything
                conn[m["worker"]] = {"connected": 0, "connect_s": 0.0, "cpu_s": 0.0}
                results[m["worker"]] = m
        connect_s = time.perf_counter() - t0
        conn = list(conn.values())
        connected = sum(c["connected"] for c in conn)
        info = {"agents": n_agents, "connected": connected, "connect_s": round(connect_s, 3),
                "worker_connect_s_max": round(max(c["connect_s"] for c in conn), 3),
                "connect_cpu_s": round(sum(c["cpu_s"] for c in conn), 3)}
        if on_phase is not None:
            on_phase("connected", info)
        t1 = time.perf_counter()
        go.set()
        lingering: set[int] = set()
        while len(results) < len(procs):
            m = q.get(timeout=sc.connect_timeout_s + sc.drain_timeout_s + sc.linger_s + 3600)
            if m.get("phase") == "lingering":  # every batch of that worker acknowledged: its agents answer fetches
                lingering.add(m["worker"])
                if len(lingering) == len(procs) and on_phase is not None:
                    on_phase("lingering", {"linger_s": sc.linger_s})
                continue
            results[m["worker"]] = m
        results = list(results.values())
        stream_s = time.perf_counter() - t1
    finally:
        for p in procs:
            p.join(10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    wall = time.perf_counter() - t0
    errors = [f"{r['error']} ({r.get('last_error', '')})" for r in results if "error" in r]
    ok = [r for r in results if "error" not in r]
    records = sum(r["records"] for r in ok)
    out = {**info, "agent_kind": sc.agent_kind, "procs": sc.procs, "simulate_s": round(sim_s, 3),
           "wall_s": round(wall, 3), "stream_s": round(stream_s, 3),
           "records": records, "batches": sum(r["batches"] for r in ok),
           "records_acked": sum(r["records_acked"] for r in ok),
           "records_dropped": sum(r["records_dropped"] for r in ok),
           "records_per_s": round(records / stream_s, 1) if stream_s > 0 else 0.0,
           "backpressure_s_max": max((r["backpressure_s"] for r in ok), default=0.0),
           "build_s_max": max((r["build_s"] for r in ok), default=0.0),
           "encode_s_max": max((r["encode_s"] for r in ok), default=0.0),
           "generate_s_max": max((r["generate_s"] for r in ok), default=0.0),
           "emulator_stream_cpu_s": round(sum(r["stream_cpu_s"] for r in ok), 3),
           "drain_s_max": max((r["drain_s"] for r in ok), default=0.0),
           # per worker: time it waited on the collector (backlog full, then the final drain) against time
           # it spent building and encoding records; the larger side is the bottleneck
           "wait_on_collector_s_max": max((round(r["backpressure_s"] + r["drain_s"], 3) for r in ok), default=0.0),
           "emulator_busy_s_max": max((round(r["build_s"] + r["encode_s"], 3) for r in ok), default=0.0),
           "reconnects": sum(r["reconnects"] for r in ok),
           "reconnect_errors": sorted({e for r in ok for e in r["reconnect_errors"]})[:5],
           "not_drained": sum(len(r["not_drained"]) for r in ok), "errors": errors,
           "stuck_sample": [x for r in ok for x in r.get("stuck_sample", [])][:5]}
    if on_phase is not None:
        on_phase("streamed", out)
    return out


# -- the collector's side of the count ------------------------------------------------------------
def collector_nodes(address: str, prefix: str = "sim-node-", timeout: float = 30.0) -> dict:
    """What the collector says (Control ListNodes on a plaintext loopback collector) about the emulated
    agents: how many are connected right now and what it stored for them."""
    import grpc

    from steplens.v1 import control_pb2 as cpb
    from steplens.v1 import control_pb2_grpc as cgrpc
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 256 << 20)]) as ch:
        reply = cgrpc.ControlStub(ch).ListNodes(cpb.ListRequest(), timeout=timeout)
    nodes = [n for n in reply.nodes if n.node_id.startswith(prefix)]
    return {"nodes": len(nodes), "connected": sum(1 for n in nodes if n.connected),
            "records_stored": sum(n.records_stored for n in nodes),
            "records_produced": sum(n.records_produced for n in nodes),  # as the agents' last status said
            "records_rejected": sum(n.records_rejected for n in nodes),
            "batches_stored": sum(n.batches_stored for n in nodes),
            "batches_duplicate": sum(n.batches_duplicate for n in nodes)}


def store_check(db_path: str, prefix: str = "sim-node-") -> dict:
    """From the collector's store (read-only): batches and records stored per emulated agent, and whether
    every agent's stored seqs are exactly 1..n (no gap, no duplicate)."""
    import sqlite3
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT agent_id, COUNT(*), MIN(seq), MAX(seq), SUM(n_records), SUM(n_rejected)"
                          " FROM batches WHERE agent_id LIKE ? GROUP BY agent_id, spool_id", (prefix + "%",)).fetchall()
        metric_rows = db.execute("SELECT COUNT(*) FROM metrics m JOIN series s ON s.id = m.series_id"
                                 " WHERE s.agent_id LIKE ?", (prefix + "%",)).fetchone()[0]
        flow_rows = db.execute("SELECT COUNT(*) FROM flows WHERE agent_id LIKE ?", (prefix + "%",)).fetchone()[0]
        other = {t: db.execute(f"SELECT COUNT(*) FROM {t} WHERE agent_id LIKE ?", (prefix + "%",)).fetchone()[0]
                 for t in ("processes", "steps", "comm_summaries")}
        sim_metrics = db.execute("SELECT COUNT(*) FROM series WHERE agent_id LIKE ? AND name LIKE 'sim\\_%' ESCAPE '\\'",
                                 (prefix + "%",)).fetchone()[0]
    finally:
        db.close()
    return {"agents": len({r[0] for r in rows}), "spools": len(rows), "batches": sum(r[1] for r in rows),
            "records": sum(r[4] for r in rows), "rejected": sum(r[5] for r in rows),
            "seq_not_contiguous": [r[0] for r in rows if not (r[2] == 1 and r[3] == r[1])],
            "metric_rows": metric_rows, "flow_rows": flow_rows, "process_rows": other["processes"],
            "step_rows": other["steps"], "comm_summary_rows": other["comm_summaries"], "sim_series": sim_metrics}
