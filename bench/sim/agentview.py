"""What real node agents would send upstream for a simulated job, and the node-local comm-op detail they keep:
the simulator's only interface to the collector and the detectors (issue 13, item 5: simulator parity).

Reads one simulation (model.simulate, re-run on each call: it is deterministic) and turns it into the records a
real agent produces, under the names and with the fields the real sources give them:
  ProcessInfo  per rank, once at start (source `procs`): pid, start_ticks, job_key, rank, local_rank, world_size,
               the launcher's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, STEPLENS_JOB);
  Step         per rank per step (source `flightrec`): boundaries and per-communicator StepComm summaries as
               agent/steps.py makes them (see "Steps" below);
  CommSummary  per rank per step (source `flightrec`): agent/commlog.py `summarize()` of the rank's ops of one
               poll, the poll taken as one step's ops (step -1: no ProfilerStep windows, as in sentinel mode);
  Metric       gpu_utilization_percent / gpu_sm_clock_mhz / gpu_power_watts (agent/sources/gpu.py names, the
               DCGM_NAMES keys), entity gpu<i> (node<n>.gpu<i> when an emulated agent hosts several nodes),
               once per GPU per simulated second (source `gpu`);
  Flow         each inter-node transfer the node sends (source `netflows`; records.Flow has no switches);
  Metric       ib_port_up / ib_port_rate_gbps / ib_port_symbol_errors_total / ib_port_link_error_recoveries_total
               (agent/sources/host.py read_ib_port names), entity `mlx5_<k>/1` (Topology.port_of), every
               PORT_INTERVAL_NS of cluster time per NIC (source `host`, kind `port`). A model, not a measurement:
               a NIC link under a slow_link, fluctuation or degradation fault at factor f retries bit errors at
               PORT_ERRORS_PER_S x (f - 1) symbol errors a second (and one link error recovery per 100), as a
               marginal cable or optic does; one NIC in ten has a steady trickle of its own (0.01-0.5/s, drawn
               from the job's seed); a congested switch makes no port errors (congestion is not a link fault). The
               rate stays at 400 Gb/s: the bandwidth loss of the model is not a rate downshift. Beside them
               ib_port_transmit_bytes_total (the bytes of the NIC's flows) and ib_port_transmit_wait_ticks_total
               (PortXmitWait: ticks, XMIT_WAIT_TICK_NS each, in which the port had data to send and no credit from
               the switch): each flow a -> b waits the share 1 - down/own of its time, own = the bandwidth of a's
               NIC link, down = the narrowest after it on the model's path (the leaf and spine shares, b's link),
               so a sender waits behind a congested switch or a slow receiver and not behind its own slow link;
               over that, a background share of the NIC's send time at full rate (the incast of a healthy fabric:
               WAIT_BASE, log-uniform per NIC), noisy per 2 s interval (log-sd WAIT_NOISE, a WAIT_BURST burst now
               and then).
               The counter is 32 bits wide and stops at its maximum (ib_port_counters_saturated 1), as the
               PortCounters field does; it starts at a random value. No congestion spreading: a flow that shares a
               switch with a waiting one does not wait for it (real lossless fabrics spread some).
Nothing else: no simulator-only value (step compute / wait split, fault ground truth) leaves this module; that
stays in truth.json and the files (output.py) for scoring.

CommOps (`commops()`, what FetchDetail returns from an agent's node-local store) look like Flight Recorder's
with CUDA-event timing: comm_id as output.py names communicators (`dp.s<s>.t<t>`, `pp.s<a>-<b>.d<d>.t<t>`,
`tp.s<s>.d<d>`, `ep.s<s>.e<e>.t<t>`, `edp.s<s>.t<t>.x<j>`), issue = start = the rank's arrival (recv: when it was
posted), end = completion; collectives carry their per-communicator `seq` (seq_source `trace`), send/recv their
`p2p_seq` and seq -1, as flightrec.py parses them; members / nranks / group_rank from the job's layout.

Steps: `steps="segmenter"` feeds each rank's CommOps, one step's worth per call, through the real
agent/steps.py StepSegmenter (one per node, as one agent runs one) and `commlog.summarize()`, so boundaries,
numbers, the steps lost while it learns the pattern (the first 1-2 per rank) and its errors are exactly a real
agent's. It costs what the real agent's code costs: the segmenter ~640k ops/s here, building the CommOp records
~700k ops/s, ~330k ops/s together; 8,192 GPUs x 100 iterations (DP=1024 PP=8, ~24M ops) would take ~75 s, so it
is not the default. `steps="constructed"` (the default) builds Step records from the simulated op times without
CommOp records: each step is one iteration's ops of the rank, from the previous step's end to its latest op end,
number = the iteration, evidence `comm_pattern`, period_ops = ops per step, StepComm fields as
StepSegmenter._step fills them. What differs from the segmenter (tests/test_agentview.py pins both): (1) it cuts at
the iteration boundary, where the segmenter cuts before the op with the largest median idle gap, which in a 1F1B
schedule is often inside the pipeline bubble (stage 0: the second backward recv), so its boundaries have a
constant phase against the segmenter's while ops per step, calls, bytes per communicator and mean step time agree;
(2) it emits every step, the segmenter none until it has learnt the pattern (3 cycles); (3) numbers are always
the iteration, the segmenter's come from a collective's seq (the same where DP or TP > 1) or a counter.
(tests/test_agentview.py checks that the segmenter cuts one step per iteration on every stage.)
Dense jobs (ep == 1) take a column-wise path (`_dense_records`: per op, numpy arithmetic over all ranks of a
stage, rounded half to even as round() is; tests/test_agentview.py checks it equals the per-rank path record for
record); EP jobs the per-rank one.

Cost (2-core machine, simulation included): 1,024 GPUs x 20 iterations (DP=128 PP=8 TP=1) ~63k rank-iterations/s
for ProcessInfo + Step records, ~35k with CommSummary, ~16k with every kind (~340k records/s: 2/3 of them Flows,
since every PP transfer crosses nodes there); 8,192 GPUs x 100 iterations (DP=1024 PP=8): ProcessInfo + Steps
6.7 s (`bench/sim_speed.py`), with CommSummary 12.8 s without faults (4.5M records); side by side with the list
version before the per-stage numpy arrays, a slow GPU and a slow link: 33 -> 12 s and 43 -> 19 s
(bench/README.md). Every kind would add ~12M Flows. `kinds` builds only what a consumer reads.

Time: mono_ns = mono_base + simulated ns since the job start (cluster base_ns), one clock for every agent.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator

import numpy as np

from steplens.agent.records import (
    CommOp,
    CommProgress,
    Event,
    CommSummary,
    Flow,
    Metric,
    ProcessInfo,
    Step,
    StepComm,
)

from .faults import Fault
from .model import Iteration, ModelConfig, simulate
from .output import Rows, pair_xfer

PID_BASE = 4000                  # local rank l runs as pid PID_BASE + l on its node
START_TICKS = 1_000_000
MASTER_PORT = 29500
MAX_COLLECTIVES = 64             # StepConfig.max_collectives: issue offsets kept per step
STEP_MODES = ("constructed", "segmenter")
KINDS = frozenset({"process", "step", "comm_summary", "metric", "flow", "progress", "port"})
PORT_INTERVAL_NS = 2 * 10**9     # the host source's infiniband_interval_seconds default
PORT_ERRORS_PER_S = 50.0         # symbol errors a second per unit of (factor - 1) on a faulty NIC link
PORT_RATE_GBPS = 400.0
XMIT_WAIT_TICK_NS = 4.0          # PortXmitWait's tick (the spec leaves it to the implementation)
WAIT_BASE = (0.01, 0.10)         # background share of a NIC's send time spent waiting for credits (log-uniform)
WAIT_NOISE = 0.5                 # log-sd of the background wait per port interval
WAIT_BURST = (0.03, 4.0)         # share of intervals with an incast burst on a NIC, and its multiplier
WAIT_MAX = (1 << 32) - 1         # PortXmitWait is a 32-bit PortCounters field: it stops there
PROGRESS_POLL_NS = 5 * 10**9     # flightrec's sentinel poll: CommProgress every poll while an op is pending
STOPPED_AFTER_NS = 2 * 10**9     # procs: a process in state T this long is reported stopped
HANG_MODES = ("stopped", "stuck")


def agent_of(node: int, n_nodes: int, agents: int = 0) -> str:
    """The emulated agent id of a node (stream.py deals nodes round-robin: node n belongs to agent n % agents)."""
    return f"sim-node-{node % agents if agents > 0 else node}"


def _iterations(cfg: ModelConfig, faults: list[Fault]) -> Iterator[Iteration]:
    """model.simulate's iterations as a generator: the simulation runs in a thread that hands over one
    Iteration and waits until the consumer is done with it (so it never runs ahead of, or mutates, what the
    consumer reads)."""
    q: queue.Queue = queue.Queue(maxsize=1)
    done = threading.Semaphore(0)
    stop = threading.Event()

    class _Stop(Exception):
        pass

    def sink(it: Iteration) -> None:
        if stop.is_set():
            raise _Stop
        q.put(("it", it))
        done.acquire()
        if stop.is_set():
            raise _Stop

    def run() -> None:
        try:
            simulate(cfg, faults, sink)
            q.put(("end", None))
        except _Stop:
            pass
        except BaseException as exc:  # handed to the consumer, raised there
            q.put(("error", exc))

    th = threading.Thread(target=run, name="sim-agentview", daemon=True)
    th.start()
    try:
        while True:
            kind, val = q.get()
            if kind == "end":
                return
            if kind == "error":
                raise val
            try:
                yield val
            finally:
                done.release()
    finally:
        stop.set()
        done.release()
        th.join(5)


def _members(cfg: ModelConfig) -> dict[str, list[int]]:
    """Every communicator of the job and its members (global ranks, group rank order)."""
    D, P, T, E = cfg.dp, cfg.pp, cfg.tp, cfg.ep
    out: dict[str, list[int]] = {}
    for s in range(P):
        for d in range(D):
            if T > 1:
                out[f"tp.s{s}.d{d}"] = [cfg.rank(s, d, t) for t in range(T)]
            for t in range(T):
                if s < P - 1:
                    out[f"pp.s{s}-{s + 1}.d{d}.t{t}"] = [cfg.rank(s, d, t), cfg.rank(s + 1, d, t)]
        for t in range(T):
            if D > 1:
                out[f"dp.s{s}.t{t}"] = [cfg.rank(s, d, t) for d in range(D)]
            if E > 1:
                for e in range(D // E):
                    out[f"ep.s{s}.e{e}.t{t}"] = [cfg.rank(s, d, t) for d in range(e * E, (e + 1) * E)]
                if D > E:
                    for j in range(E):
                        out[f"edp.s{s}.t{t}.x{j}"] = [cfg.rank(s, d, t) for d in range(j, D, E)]
    return out


def _by_rank(rows: Rows, it: Iteration, want=None) -> dict[int, list[tuple]]:
    """The iteration's comm ops per rank, (comm_id, op, seq, bytes, start_ns, end_ns), in issue order."""
    out: dict[int, list[tuple]] = {}
    for r, cid, op, seq, nb, a, b in rows.commops(it, want):
        lst = out.get(r)
        if lst is None:
            lst = out[r] = []
        lst.append((cid, op, seq, nb, a, b))
    for lst in out.values():
        lst.sort(key=lambda o: o[4])
    return out


class _Proc:
    """One emulated training process: pid, start_ticks and the identity its records carry."""
    __slots__ = ("rank", "pid", "node", "local")

    def __init__(self, cfg: ModelConfig, r: int) -> None:
        gpn = cfg.gpus_per_node
        self.rank, self.node, self.local = r, r // gpn, r % gpn
        self.pid = PID_BASE + self.local


def _commop(p: _Proc, job_key: str, cid: str, op: str, seq: int, nb: int, a: int, b: int,
            members: dict[str, list[int]] | None = None) -> CommOp:
    p2p = op in ("send", "recv")
    m = members.get(cid, []) if members is not None else []
    return CommOp(mono_ns=b, timing="cuda_event", pid=p.pid, comm_id=cid, op=op, start_ticks=START_TICKS,
                  device=p.local, rank=p.rank, group_rank=m.index(p.rank) if p.rank in m else -1, nranks=len(m),
                  members=list(m), dtype="bfloat16", count=nb // 2, bytes=nb, seq=-1 if p2p else seq,
                  p2p_seq=seq if p2p else -1, issue_mono_ns=a, start_mono_ns=a, end_mono_ns=b, job_key=job_key,
                  seq_source="" if p2p else "trace")


def _constructed_step(p: _Proc, job_key: str, number: int, start: int, ops: list[tuple]) -> Step:
    """StepSegmenter._step over one step's ops (issue order), without building CommOp records. ops are
    (comm_id, op, seq, bytes, issue_mono, end_mono); every op has start == issue and an end, timing cuda_event
    (so wait_ns is -1: not measured)."""
    comms: dict = {}
    budget = MAX_COLLECTIVES
    end = 0
    for cid, op, seq, nb, a, b in ops:
        key = (cid, op) if op in ("send", "recv") else cid  # as StepSegmenter._step: sends apart from receives
        c = comms.get(key)
        if c is None:
            c = comms[key] = StepComm(cid, op, 0, 0, 0, -1, -1, [], 0)
        elif c.op != op:
            c.op = "mixed"
        c.calls += 1
        c.bytes += nb
        if a and b:
            c.busy_ns += b - a if b > a else 0
        if op not in ("send", "recv") and seq >= 0 and (c.seq_first < 0 or seq < c.seq_first):
            c.seq_first = seq
        if budget > 0:
            c.issue_offsets_ns.append(a - start)
            budget -= 1
        else:
            c.offsets_dropped += 1
        if b > end:
            end = b
    return Step(end, p.pid, START_TICKS, job_key, p.rank, number, min(start, end), end, "comm_pattern", len(ops),
                len(ops), list(comms.values()))


def _summaries(p: _Proc, job_key: str, ops: list[tuple]) -> list[CommSummary]:
    """commlog.summarize() of one poll's ops of one process, without building CommOp records."""
    groups: dict[tuple, CommSummary] = {}
    for cid, op, seq, nb, a, b in ops:
        s = groups.get((cid, op))
        if s is None:
            q = seq if op not in ("send", "recv") else -1
            s = groups[(cid, op)] = CommSummary(b, p.pid, cid, op, a, 0, 0, 0, 0, START_TICKS, job_key, p.rank, -1,
                                                q, q, "cuda_event")
        dur = b - a if b > a else 0
        s.calls += 1
        s.bytes += nb
        s.busy_ns += dur
        if dur > s.max_ns:
            s.max_ns = dur
        if a < s.start_mono_ns:
            s.start_mono_ns = a
        if b > s.mono_ns:
            s.mono_ns = b
        if op not in ("send", "recv") and seq >= 0:
            s.seq_first = seq if s.seq_first < 0 else min(s.seq_first, seq)
            s.seq_last = max(s.seq_last, seq)
    return sorted(groups.values(), key=lambda s: (s.mono_ns, s.pid, s.comm_id, s.op))


def _stage_names(cfg: ModelConfig, s: int, cache: dict) -> dict[str, list[str] | None]:
    """The comm id of each slot of stage s per column d * T + t (the same every iteration: built once)."""
    got = cache.get(s)
    if got is None:
        D, P, T = cfg.dp, cfg.pp, cfg.tp
        got = cache[s] = {
            "prev": [f"pp.s{s - 1}-{s}.d{c // T}.t{c % T}" for c in range(D * T)] if s > 0 else None,
            "next": [f"pp.s{s}-{s + 1}.d{c // T}.t{c % T}" for c in range(D * T)] if s < P - 1 else None,
            "tp": [f"tp.s{s}.d{c // T}" for c in range(D * T)] if T > 1 else None,
            "dp": [f"dp.s{s}.t{c % T}" for c in range(D * T)] if D > 1 else None}
    return got


def _dense_stage(cfg: ModelConfig, it: Iteration, s: int, base: int, net) -> list[tuple]:
    """Rows.commops() of stage s (dense model) column-wise: [(slot, op, seq, bytes, issue, end)] in every rank's
    issue order, issue and end int64 arrays over the columns col = d * T + t. The same values as Rows.commops()
    (float ns rounded half to even, as round() does), computed per op over all ranks of the stage at once."""
    D, P, T, M = cfg.dp, cfg.pp, cfg.tp, cfg.micro_batches
    fwd, bwd = cfg.fwd_ms * 1e6, cfg.bwd_ms * 1e6
    act = cfg.activation_bytes
    s0 = (s * D) * T
    fac = np.asarray(it.factor[s0:s0 + D * T], dtype=np.float64)
    i2m = it.it * 2 * M

    def cols(x):  # per replica -> per column (T columns a replica)
        return np.repeat(x, T) if T > 1 else x

    def ns(x):
        return np.rint(x).astype(np.int64) + base

    px_next = np.asarray(pair_xfer(net, cfg, it, s), dtype=np.float64) if s < P - 1 else None
    px_prev = np.asarray(pair_xfer(net, cfg, it, s - 1), dtype=np.float64) if s > 0 else None
    rows = []
    for k, (kind, m, posted, start, end) in enumerate(it.ops[s]):
        comp = fwd if kind == "F" else bwd
        st = cols(np.asarray(start, dtype=np.float64))
        en = cols(np.asarray(end, dtype=np.float64))
        if kind == "F" and s > 0:
            rows.append(("prev", "recv", i2m + m, act, ns(cols(np.asarray(posted, dtype=np.float64))), ns(st)))
        elif kind == "B" and s < P - 1:
            rows.append(("next", "recv", i2m + M + m, act, ns(cols(np.asarray(posted, dtype=np.float64))), ns(st)))
        if T > 1:
            rows.append(("tp", "all_reduce", i2m + k, act, ns(st + comp * fac), ns(en)))
        if kind == "F" and s < P - 1:
            rows.append(("next", "send", i2m + m, act, ns(en), ns(en + px_next)))
        elif kind == "B" and s > 0:
            rows.append(("prev", "send", i2m + M + m, act, ns(en), ns(en + px_prev)))
    if D > 1:
        last = cols(np.asarray(it.ops[s][-1][4], dtype=np.float64))
        ar = np.tile(np.asarray(it.ar_ns[s], dtype=np.float64), D)
        rows.append(("dp", "all_reduce", it.it, cfg.grad_bytes, ns(last), ns(it.last_b[s] + ar)))
    return rows


def _dense_records(cfg: ModelConfig, it: Iteration, base: int, procs: list, job_key: str, last_end: dict,
                   want_step: bool, want_sum: bool, mine, net, names: dict) -> Iterator[tuple[int, object]]:
    """(rank, Step | CommSummary) of one iteration of a dense job: what _constructed_step() and _summaries()
    make of each rank's Rows.commops(), per op in arrays over a stage's ranks. last_end: per stage, the
    columns' ends of the step before (kept between calls); names: _stage_names' cache."""
    D, T = cfg.dp, cfg.tp
    C = D * T
    for s in range(cfg.pp):
        rows = _dense_stage(cfg, it, s, base, net)
        nm = _stage_names(cfg, s, names)
        n = len(rows)
        issue = np.stack([row[4] for row in rows])   # n ops x C columns
        end = np.stack([row[5] for row in rows])
        durs = np.where(end > issue, end - issue, 0)
        ends = end.max(axis=0)
        prev = last_end.get(s)
        start = issue[0] if prev is None else np.where(prev != 0, prev, issue[0])
        last_end[s] = ends
        slots: dict = {}
        pairs: dict[tuple[str, str], list[int]] = {}
        for i, row in enumerate(rows):
            slots.setdefault((row[0], row[1]) if row[1] in ("send", "recv") else row[0], []).append(i)
            pairs.setdefault((row[0], row[1]), []).append(i)
        per_slot = []   # each slot's StepComm figures per column
        if want_step:
            for slot, idx in slots.items():
                ops = {rows[i][1] for i in idx}
                seqs = [rows[i][2] for i in idx if rows[i][1] not in ("send", "recv")]
                off = [i for i in idx if i < MAX_COLLECTIVES]
                per_slot.append((nm[slot if type(slot) is str else slot[0]], ops.pop() if len(ops) == 1 else "mixed",
                                 len(idx), sum(rows[i][3] for i in idx), min(seqs) if seqs else -1,
                                 (issue[off] - start).T.tolist() if off else [[] for _ in range(C)],
                                 sum(1 for i in idx if i >= MAX_COLLECTIVES), durs[idx].sum(axis=0).tolist()))
        pair_info = []
        if want_sum:
            for (slot, op), idx in pairs.items():
                p2p = op in ("send", "recv")
                pair_info.append((nm[slot], op, len(idx), sum(rows[i][3] for i in idx),
                                  durs[idx].sum(axis=0).tolist(), durs[idx].max(axis=0).tolist(),
                                  rows[idx[0]][4].tolist(), end[idx].max(axis=0).tolist(),
                                  -1 if p2p else min(rows[i][2] for i in idx),
                                  -1 if p2p else max(rows[i][2] for i in idx)))
        ends_l, starts_l = ends.tolist(), np.minimum(start, ends).tolist()
        r0 = s * C
        for c in range(C):
            r = r0 + c
            if not mine(r):
                continue
            p = procs[r]
            if want_step:
                comms = [StepComm(ids[c], op, calls, nb, busy[c], -1, seq, offs[c], dropped)
                         for ids, op, calls, nb, seq, offs, dropped, busy in per_slot]
                yield r, Step(ends_l[c], p.pid, START_TICKS, job_key, r, it.it, starts_l[c], ends_l[c], "comm_pattern",
                              n, n, comms)
            if want_sum:
                out = [CommSummary(mono[c], p.pid, ids[c], op, first[c], calls, nb, busy[c], mx[c],
                                   START_TICKS, job_key, r, -1, q0, q1, "cuda_event")
                       for ids, op, calls, nb, busy, mx, first, mono, q0, q1 in pair_info]
                out.sort(key=lambda x: (x.mono_ns, x.pid, x.comm_id, x.op))
                for x in out:
                    yield r, x


def process_infos(cfg: ModelConfig, job_key: str, mono_ns: int) -> Iterator[tuple[int, ProcessInfo]]:
    """(node, ProcessInfo) of every rank, as the procs source describes a torchrun/SLURM worker."""
    world = cfg.gpus
    for r in range(world):
        p = _Proc(cfg, r)
        env = {"RANK": str(r), "LOCAL_RANK": str(p.local), "WORLD_SIZE": str(world), "MASTER_ADDR": "sim-node-0",
               "MASTER_PORT": str(MASTER_PORT), "STEPLENS_JOB": job_key}
        yield p.node, ProcessInfo(mono_ns, p.pid, START_TICKS, ppid=PID_BASE - 1, exe="/usr/bin/python3",
                                  cmdline=["python3", "train.py"], framework="torch", job_key=job_key, rank=r,
                                  local_rank=p.local, world_size=world, master_addr="sim-node-0",
                                  master_port=MASTER_PORT, env=env)


def agent_records(cfg: ModelConfig, faults: list[Fault], job_key: str = "simjob", mono_base: int = 0,
                  agents: int = 0, *, steps: str = "constructed", nodes: set[int] | None = None,
                  kinds: frozenset[str] = KINDS, _dense: bool = True,
                  hang_mode: str = "stopped") -> Iterator[tuple[str, object]]:
    """(agent_id, record) in (roughly) time order: what real node agents would send upstream for this job:
    ProcessInfo per rank once at start, then per step per rank the Step record and its CommSummary
    records, NVML Metrics under real names, Flows. agent_id 'sim-node-<n>' (node n; with agents>0, node n
    belongs to agent n % agents, as stream.py deals them). mono_ns = mono_base + simulated ns.
    steps: "constructed" (default) or "segmenter" (the real agent/steps.py code; slow, see the module
    docstring). nodes: only these nodes' records (a streaming worker builds its own agents' only). kinds: a
    subset of KINDS (process, step, comm_summary, metric, flow) to build only those: at 8,192 GPUs the flows
    alone are ~12M records per 100 iterations (every PP transfer crosses nodes), and a detector that reads
    steps need not pay for them. hang_mode: what a hung rank looks like from outside (hang_records)."""
    yield from _records(cfg, faults, job_key, mono_base, agents, steps, nodes, kinds=kinds, dense=_dense,
                        hang_mode=hang_mode)


class _Ports:
    """Each NIC's port figures (the `port` kind of the module docstring): cumulative counters advanced per
    iteration at the error rate in force, and by the iteration's flows for bytes and transmit wait, sampled at
    every PORT_INTERVAL_NS boundary of cluster time."""

    def __init__(self, cfg: ModelConfig, faults: list[Fault], mono_base: int, rows: Rows) -> None:
        import math
        import random
        topo = cfg.topology()
        self.nics = [(r // topo.gpus_per_node, topo.link_of(r), topo.port_of(r)) for r in range(cfg.gpus)]
        rng = random.Random(cfg.seed ^ 0x5EED_1B)
        self.trickle = [rng.uniform(0.01, 0.5) if rng.random() < 0.1 else 0.0 for _ in self.nics]
        self.index = {link: i for i, (_, link, _) in enumerate(self.nics)}
        self.faults = [f for f in faults if f.resource == "link"]
        self.errors = [0.0] * len(self.nics)
        self.base = mono_base
        self.t = 0.0           # simulated ns the counters stand at
        self.next = PORT_INTERVAL_NS
        # transmit side: its own draws (the error model's sequence above is unchanged by them)
        wr = random.Random(cfg.seed ^ 0x3A17_E5)
        lo, hi = math.log(WAIT_BASE[0]), math.log(WAIT_BASE[1])
        self.wait_base = [math.exp(wr.uniform(lo, hi)) for _ in self.nics]
        self.wait = [float(wr.randrange(1 << 30)) for _ in self.nics]
        self.sent = [0] * len(self.nics)
        self.rng = wr
        self.nic_bps, self.sw_bps = rows.net.nic_bps, rows.net.sw_bps
        self.pending: dict[int, tuple[list[float], list[float], list[int]]] = {}  # interval -> (bg, fault, bytes)

    def add_flows(self, it: Iteration, flows) -> None:
        """The iteration's flows (Rows.flows rows) onto their senders' ports, in the interval each ends in."""
        net, nics, n = it.net, self.nics, len(self.nics)
        nic_bps, sw_bps, base, wb = self.nic_bps, self.sw_bps, self.base, self.wait_base
        for st, a, b, nb, dur, path in flows:
            ns = dur * 1e9
            k = int((st - base + ns) // PORT_INTERVAL_NS)
            acc = self.pending.get(k)
            if acc is None:
                acc = self.pending[k] = ([0.0] * n, [0.0] * n, [0] * n)
            acc[0][a] += nb * 8e9 / nic_bps * wb[a]   # the background: a share of the time at full rate
            acc[2][a] += nb
            if net:
                own = nic_bps / net.get(nics[a][1], 1.0)
                down = nic_bps / net.get(nics[b][1], 1.0)
                for sw in path:
                    down = min(down, sw_bps / net.get(sw, 1.0))
                if down < own:
                    acc[1][a] += ns * (1.0 - down / own)

    def _close(self, k: int) -> None:
        """Interval k's flows into the counters (noise on the background wait), and any left before it."""
        lognorm, rnd = self.rng.lognormvariate, self.rng.random
        for j in sorted(x for x in self.pending if x <= k):
            bg, fw, nb = self.pending.pop(j)
            for i in range(len(self.nics)):
                if bg[i]:
                    burst = WAIT_BURST[1] if rnd() < WAIT_BURST[0] else 1.0
                    w = bg[i] * lognorm(0.0, WAIT_NOISE) * burst + fw[i]
                    self.wait[i] = min(float(WAIT_MAX), self.wait[i] + w / XMIT_WAIT_TICK_NS)
                    self.sent[i] += nb[i]

    def samples(self, it: Iteration) -> Iterator[tuple[int, Metric]]:
        end = max(it.end)
        rate = list(self.trickle)
        for f in self.faults:
            x = f.factor(it.it)
            i = self.index.get(f.link)
            if x > 1.0 and i is not None:
                rate[i] += PORT_ERRORS_PER_S * (x - 1.0)
        while self.t < end:
            step = min(end, self.next) - self.t
            for i, r in enumerate(rate):
                if r:
                    self.errors[i] += r * step / 1e9
            self.t += step
            if self.t >= self.next:
                ts = self.base + int(self.next)
                self._close(int(self.next // PORT_INTERVAL_NS) - 1)
                for i, (node, _, port) in enumerate(self.nics):
                    e = int(self.errors[i])
                    yield node, Metric(ts, "ib_port_up", port, 1.0)
                    yield node, Metric(ts, "ib_port_rate_gbps", port, PORT_RATE_GBPS)
                    yield node, Metric(ts, "ib_port_symbol_errors_total", port, float(e))
                    yield node, Metric(ts, "ib_port_link_error_recoveries_total", port, float(e // 100))
                    yield node, Metric(ts, "ib_port_transmit_wait_ticks_total", port, float(int(self.wait[i])))
                    yield node, Metric(ts, "ib_port_transmit_bytes_total", port, float(self.sent[i]))
                    yield node, Metric(ts, "ib_port_counters_saturated", port, float(self.wait[i] >= WAIT_MAX))
                self.next += PORT_INTERVAL_NS


def hang_records(cfg: ModelConfig, it: Iteration, prev: dict[int, Step], procs: list, job_key: str,
                 mode: str = "stopped") -> Iterator[tuple[int, str, object]]:
    """(rank, source, record) a real agent sends while ranks hang in iteration `it` (it.stall: rank -> ns it
    stops at the start of the iteration): the flightrec source's CommProgress of every rank, every poll
    (PROGRESS_POLL_NS) while it waits, and the procs source's state Events.

    Where each rank waits, from the job's dependencies (dense jobs: DP x PP x TP; EP groups are not modelled
    here), with X = (sx, dx, tx) the hung rank and E[c] each rank's last collective seq on c at the end of the
    iteration before (its Step's StepComm: seq_first + calls - 1):
      * X itself enters nothing: stopped (SIGSTOP, mode "stopped"): no CommProgress at all (its Flight
        Recorder socket does not answer) and a process_stopped Event STOPPED_AFTER_NS after the stop,
        process_running when it resumes; stuck in Python (mode "stuck"): CommProgress with nothing pending;
      * X's TP group (same stage and replica): inside the iteration's first TP collective, seq E + 1;
      * X's pipeline (same replica, other stages): in a recv from the neighbouring stage towards X's;
      * every other pipeline: done with its forward and backward, inside its stage's DP all-reduce, seq E + 1,
        whose member in X's pipeline never enters it.
    Nothing here says who is to blame: the detector finds X as the sink of who waits for whom."""
    D = cfg.dp
    for x, dur in sorted(it.stall.items()):
        if x not in prev:
            continue
        t0 = prev[x].end_mono_ns
        sx, dx, tx = cfg.coords(x)
        polls = [t0 + k * PROGRESS_POLL_NS for k in range(1, int(dur // PROGRESS_POLL_NS) + 1)]
        px = procs[x]
        ent = f"{px.pid}:{START_TICKS}"
        if mode == "stopped":
            if dur > STOPPED_AFTER_NS:
                yield x, "procs", Event(t0 + STOPPED_AFTER_NS, "process_stopped", ent,
                                        f"rank {x} of job {job_key} stopped (state T)", STOPPED_AFTER_NS / 1e9)
                yield x, "procs", Event(t0 + int(dur), "process_running", ent,
                                        f"rank {x} of job {job_key} running again", dur / 1e9)
        for r, st in sorted(prev.items()):
            s, d, t = cfg.coords(r)
            last = {c.comm_id: c.seq_first + c.calls - 1 for c in st.comms if c.seq_first >= 0}
            wait_c, wait_peer = "", -1
            if r == x:
                pass
            elif (s, d) == (sx, dx):
                wait_c = f"tp.s{s}.d{d}"
            elif d == dx:
                a, b = (s - 1, s) if s > sx else (s, s + 1)
                wait_c, wait_peer = f"pp.s{a}-{b}.d{d}.t{t}", cfg.rank(s - 1 if s > sx else s + 1, d, t)
            elif D > 1:
                wait_c = f"dp.s{s}.t{t}"
            since = st.end_mono_ns + (0 if d == dx else int(0.9 * (st.end_mono_ns - st.start_mono_ns)))
            p = procs[r]
            for tp in polls if r != x or mode != "stopped" else ():  # stopped: its Flight Recorder is silent
                for c, e in last.items():
                    pend = c == wait_c
                    yield r, "flightrec", CommProgress(tp, p.pid, c, START_TICKS, job_key, r, e + pend, e + pend, e,
                                                       "all_reduce" if pend else "", e + 1 if pend else -1, False,
                                                       -1, since if pend else 0)
                if wait_peer >= 0:
                    yield r, "flightrec", CommProgress(tp, p.pid, wait_c, START_TICKS, job_key, r, -1, -1, -1,
                                                       "recv", 0, True, wait_peer, since, 2)
            # the first poll after the job resumed: the op completed (the status changed, so it is sent)
            tp = t0 + int(dur) + PROGRESS_POLL_NS
            for c, e in last.items():
                done = e + (c == wait_c)
                yield r, "flightrec", CommProgress(tp, p.pid, c, START_TICKS, job_key, r, done, done, done)
            if wait_peer >= 0:
                yield r, "flightrec", CommProgress(tp, p.pid, wait_c, START_TICKS, job_key, r, -1, -1, -1, nranks=2)


def _records(cfg, faults, job_key, mono_base, agents, steps, nodes, sources: bool = False, kinds=KINDS,
             dense: bool = True, hang_mode: str = "stopped"):
    """agent_records(); with sources=True, (agent_id, source, record)."""
    if steps not in STEP_MODES:
        raise ValueError(f"steps must be one of {', '.join(STEP_MODES)}")
    bad = set(kinds) - KINDS
    if bad:
        raise ValueError(f"unknown kinds {sorted(bad)}: {', '.join(sorted(KINDS))}")
    want_step, want_sum = "step" in kinds, "comm_summary" in kinds
    topo = cfg.topology()
    gpn, n_nodes = topo.gpus_per_node, topo.nodes
    one_node = agents <= 0 or agents >= n_nodes
    aid = [agent_of(n, n_nodes, agents) for n in range(n_nodes)]
    mine = (lambda n: True) if nodes is None else nodes.__contains__

    def out(node, source, rec):
        return (aid[node], source, rec) if sources else (aid[node], rec)

    for node, info in process_infos(cfg, job_key, mono_base):
        if mine(node) and "process" in kinds:
            yield out(node, "procs", info)
    procs = [_Proc(cfg, r) for r in range(cfg.gpus)]
    ranks = [r for r in range(cfg.gpus) if mine(r // gpn)]
    want = set(ranks) if nodes is not None else None
    rows = Rows(cfg)
    rows.base = mono_base  # every time Rows makes is agent-monotonic from here on
    last_end: dict[int, int] = {}
    dense_end: dict[int, object] = {}   # the dense path's last_end: per stage, an array over its ranks
    names: dict[int, dict] = {}         # the dense path's comm ids per stage
    segs: dict[int, object] = {}
    if steps == "segmenter":
        from steplens.agent.commlog import summarize
        from steplens.agent.steps import StepSegmenter
        members = _members(cfg)
    ip = topo.ip
    dense = dense and steps == "constructed" and cfg.ep == 1
    mine_rank = (lambda r: True) if want is None else want.__contains__
    want_prog = "progress" in kinds and want_step
    if want_prog and hang_mode not in HANG_MODES:
        raise ValueError(f"hang_mode must be one of {', '.join(HANG_MODES)}")
    prev: dict[int, Step] = {}   # each rank's Step of the iteration before (where a hang's ranks stand)
    ports = _Ports(cfg, faults, mono_base, rows) if "port" in kinds else None
    for it in _iterations(cfg, faults):
        if want_prog and it.stall:
            for r, source, rec in hang_records(cfg, it, prev, procs, job_key, hang_mode):
                if mine_rank(r):
                    yield out(r // gpn, source, rec)
        cur: dict[int, Step] = {}
        if dense and (want_step or want_sum):
            for r, rec in _dense_records(cfg, it, mono_base, procs, job_key, dense_end, want_step, want_sum,
                                         mine_rank, rows.net, names):
                if want_prog and type(rec) is Step:
                    cur[r] = rec
                yield out(r // gpn, "flightrec", rec)
            per_rank = {}
        else:
            per_rank = _by_rank(rows, it, want) if want_step or want_sum else {}
        for r in ranks:
            ops = per_rank.get(r)
            if not ops:
                continue
            p = procs[r]
            if steps == "segmenter":
                cops = [_commop(p, job_key, *o, members) for o in ops]
                seg = segs.get(p.node)
                if seg is None:
                    seg = segs[p.node] = StepSegmenter()
                for st in seg.add(cops):
                    if want_step:
                        yield out(p.node, "flightrec", st)
                for s in summarize(cops) if want_sum else ():
                    yield out(p.node, "flightrec", s)
                continue
            if want_step:
                st = _constructed_step(p, job_key, it.it, last_end.get(r) or ops[0][4], ops)
                last_end[r] = st.end_mono_ns
                if want_prog:
                    cur[r] = st
                yield out(p.node, "flightrec", st)
            for s in _summaries(p, job_key, ops) if want_sum else ():
                yield out(p.node, "flightrec", s)
        if want_prog:
            prev = cur
        for ts, r, util, clock, power in rows.telemetry(it) if "metric" in kinds else ():
            n = r // gpn
            if not mine(n):
                continue
            ent = f"gpu{r % gpn}" if one_node else f"node{n}.gpu{r % gpn}"
            yield out(n, "gpu", Metric(ts, "gpu_utilization_percent", ent, util))
            yield out(n, "gpu", Metric(ts, "gpu_sm_clock_mhz", ent, clock))
            yield out(n, "gpu", Metric(ts, "gpu_power_watts", ent, power))
        flows = list(rows.flows(it)) if ports is not None or "flow" in kinds else ()
        if ports is not None:
            ports.add_flows(it, flows)
            for n, rec in ports.samples(it):
                if mine(n):
                    yield out(n, "host", rec)
        for st, src, dst, nb, dur, _path in flows if "flow" in kinds else ():
            n = src // gpn
            if not mine(n):
                continue
            yield out(n, "netflows", Flow(st + max(1, int(dur * 1e9)), st, ip(src), 40000 + src % 20000, ip(dst),
                                          29500, nb, max(1, nb // 4096)))


def commops(cfg: ModelConfig, faults: list[Fault], ranks: list[int], since_ns: int, until_ns: int,
            mono_base: int = 0, *, job_key: str = "simjob", iterations: list[Iteration] | None = None,
            keep: dict | None = None) -> list[CommOp]:
    """The node-local CommOp detail of `ranks` in [since, until] (what FetchDetail returns from an agent).
    since/until in the agents' mono ns (mono_base + simulated ns); an op is in the window when it overlaps it
    (issue <= until and end >= since); until_ns <= 0 means no upper bound. Re-simulates up to `until`, or reads
    `iterations` (the job's simulated iterations, kept by a caller that fetches often: an agent answers from
    its node-local store in milliseconds, not by re-running the job). keep: a dict the caller keeps between
    calls about one job (cfg, faults, mono_base): the job's network model and communicators are built once
    (at 8,192 GPUs ~0.19 s a call otherwise, under cProfile)."""
    want = set(ranks)
    keep = {} if keep is None else keep
    members = keep.get("members")
    if members is None:
        members = keep["members"] = _members(cfg)
    procs = {r: _Proc(cfg, r) for r in want}
    rows = keep.get("rows")
    if rows is None:
        rows = keep["rows"] = Rows(cfg)
        rows.base = mono_base
    hi = until_ns if until_ns > 0 else None
    out: list[CommOp] = []
    for it in (iterations if iterations is not None else _iterations(cfg, faults)):
        if hi is not None and it.start and mono_base + min(it.start) > hi:
            break
        if it.end and mono_base + max(it.end) + 10**9 < since_ns:
            continue  # ends (with a second to spare for ops past the step end) before the window
        for r, ops in _by_rank(rows, it, want).items():
            p = procs[r]
            for cid, op, seq, nb, a, b in ops:
                if b >= since_ns and (hi is None or a <= hi):
                    out.append(_commop(p, job_key, cid, op, seq, nb, a, b, members))
    out.sort(key=lambda o: (o.issue_mono_ns, o.rank))
    return out
