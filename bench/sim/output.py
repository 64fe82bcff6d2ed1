"""What the simulator emits, per iteration: the records agents emit (CommOps per rank, step summaries,
flows with the switches on their path, NVML-like telemetry per GPU per second) and the ground truth.

Rows are built by generators over one `Iteration` (model.py), so a file sink and the streaming agents
share them. Files (JSON lines, one object a line, keys in a fixed order, integer ns in cluster time):
  commops.jsonl    rank, comm_id, op, seq, bytes, start_ns, end_ns, node, device
  steps.jsonl      rank, iteration, start_ns, end_ns, compute_ns, comm_wait_ns, stall_ns, node, device
  flows.jsonl      start (ns), src, dst, switches, bytes, duration (s) -- the collector's flow import schema
  telemetry.jsonl  ts_ns, node, gpu, rank, utilization_percent, sm_clock_mhz, power_watts
  truth.json       config, topology, faults with the ranks / links / switches / communicators they touch
Communicator ids: `tp.s<s>.d<d>`, `pp.s<a>-<b>.d<d>.t<t>`, `dp.s<s>.t<t>`; with EP (ep > 1) also
`ep.s<s>.e<e>.t<t>` (op all_to_all, one per dispatch / combine per MoE layer per micro-batch, forward and
backward) and `edp.s<s>.t<t>.x<j>` (the expert-gradient all_reduce over the DP/EP ranks holding expert
shard j); flows of an all-to-all go from every member to every other one (a2a_bytes / E each) over the
collective's time, like the DP ring's hops. With dp_bucket_bytes > 0 a DP or expert ring carries one flow per
DDP bucket per hop (ModelConfig.dp_buckets), the buckets back to back over the all-reduce's time, each taking
its share of the bytes of it.
Cost: JSON text is built with f-strings (~1 µs per row); a 64-GPU x 20-iteration run writes ~100k rows.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

from .model import Iteration, ModelConfig, Network, Result

EMIT_KINDS = ("commops", "steps", "flows", "telemetry")
SM_CLOCK_MHZ = 1980.0
IDLE_W, MAX_W = 90.0, 700.0


def pair_xfer(net: Network, cfg: ModelConfig, it: Iteration, s: int) -> list[float]:
    """Rows.pair_xfer (a function, for the column-wise agent view): cached per network state and stage."""
    key = (tuple(sorted(it.net.items())) if it.net else (), s)
    cache = net.__dict__.setdefault("_pair_xfer", {})
    got = cache.get(key)
    if got is None:
        if len(cache) > 256:
            cache.clear()
        bits = cfg.activation_bytes * 8e9
        got = cache[key] = [net.p2p_lat + bits / net.pair_bps(cfg.rank(s, d, t), cfg.rank(s + 1, d, t), it.net)
                            for d in range(cfg.dp) for t in range(cfg.tp)]
    if it.net_jitter:  # this iteration's draw for the replica's pairs (the model's xfer_ns carries the same)
        last = net.__dict__.setdefault("_pair_xfer_it", {})  # per stage: (iteration, its list), the last asked
        hit = last.get(s)
        if hit is not None and hit[0] is it and hit[1] is got:
            return hit[2]
        j, T = it.net_jitter["pp"][s], cfg.tp
        out = [x * j[c // T] for c, x in enumerate(got)]
        last[s] = (it, got, out)
        return out
    return got


class Rows:
    """Row generators for one job: cluster-time conversion, rank -> node/device, comm ids."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.topo = cfg.topology()
        self.base = cfg.base_ns
        self.net = Network(cfg, self.topo)
        self.sec_next: list[int] | None = None  # per rank: next whole second (cluster) to sample telemetry
        self._pair_net: dict | None = None      # network faults the cached pair times were computed under
        self._pair_s: dict[tuple[int, int], float] = {}
        # built on first use: per all-reduce kind, its bucket plan and per ring its hops across the network
        self._dp_plan = self._edp_plan = None
        self._dp_hops = self._edp_hops = None
        if cfg.ep > 1:
            E = cfg.ep
            self.seg = dict(zip("FB", cfg.ep_segments()))
            self.dense_bytes, self.expert_bytes = self.net.dense_bytes, self.net.expert_bytes
            # per (stage, EP group x): the ordered member pairs that cross the network, with their path
            self._a2a_pairs = [[[(a, b, self.net.path(a, b)) for a in m for b in m
                                 if a != b and self.net.path(a, b)]
                                for m in (self.net.ep_members(s, x) for x in range(cfg.dp // E * cfg.tp))]
                               for s in range(cfg.pp)]

    def ns(self, t: float) -> int:
        return self.base + int(round(t))

    def pair_xfer(self, it: Iteration, s: int) -> list[float]:
        """Stage s <-> s+1 transfer time of each pipeline pair, per column d * T + t (rank(s, d, t) with
        rank(s+1, d, t)), ns. The stage waits for the slowest (model: it.xfer_ns[s][d]); each send ends
        after its own pair's transfer, so a slow NIC shows on its own rank's sends only."""
        return pair_xfer(self.net, self.cfg, it, s)

    # -- step summaries -----------------------------------------------------------------------
    def steps(self, it: Iteration) -> Iterator[tuple[int, int, int, int, int, int, int]]:
        """(rank, iteration, start_ns, end_ns, compute_ns, comm_wait_ns, stall_ns)."""
        cfg = self.cfg
        per_op = (cfg.fwd_ms + cfg.bwd_ms) * 1e6 * cfg.micro_batches
        opt = cfg.optimizer_ms * 1e6
        stall = it.stall
        for r, (a, b, f) in enumerate(zip(it.start, it.end, it.factor)):
            comp = per_op * f + opt
            st = stall.get(r, 0.0)
            yield (r, it.it, self.ns(a), self.ns(b), int(round(comp)), int(round(b - a - comp - st)), int(round(st)))

    # -- comm ops -----------------------------------------------------------------------------
    def _pp_recv(self, it: Iteration, r, s, d, t, kind, m, posted, start):
        """A pipeline op's receive of its input (F from stage s-1, B from stage s+1), if it has one."""
        P, M, act, ns = self.cfg.pp, self.cfg.micro_batches, self.cfg.activation_bytes, self.ns
        if kind == "F" and s > 0:
            yield (r, f"pp.s{s - 1}-{s}.d{d}.t{t}", "recv", it.it * 2 * M + m, act, ns(posted[d]), ns(start[d]))
        elif kind == "B" and s < P - 1:
            yield (r, f"pp.s{s}-{s + 1}.d{d}.t{t}", "recv", it.it * 2 * M + M + m, act, ns(posted[d]), ns(start[d]))

    def _pp_send(self, it: Iteration, r, s, d, t, kind, m, end):
        """A pipeline op's send of its output (F to stage s+1, B to stage s-1), if it has one."""
        P, M, act, ns = self.cfg.pp, self.cfg.micro_batches, self.cfg.activation_bytes, self.ns
        if kind == "F" and s < P - 1:
            yield (r, f"pp.s{s}-{s + 1}.d{d}.t{t}", "send", it.it * 2 * M + m, act,
                   ns(end[d]), ns(end[d] + self.pair_xfer(it, s)[d * self.cfg.tp + t]))
        elif kind == "B" and s > 0:
            yield (r, f"pp.s{s - 1}-{s}.d{d}.t{t}", "send", it.it * 2 * M + M + m, act,
                   ns(end[d]), ns(end[d] + self.pair_xfer(it, s - 1)[d * self.cfg.tp + t]))

    def commops(self, it: Iteration,
                ranks: set[int] | None = None) -> Iterator[tuple[int, str, str, int, int, int, int]]:
        """(rank, comm_id, op, seq, bytes, start_ns, end_ns) per rank, schedule order within a stage; only those
        of `ranks` when given (an emulated agent answering FetchDetail for a few ranks)."""
        cfg = self.cfg
        D, P, T, M = cfg.dp, cfg.pp, cfg.tp, cfg.micro_batches
        fwd, bwd = cfg.fwd_ms * 1e6, cfg.bwd_ms * 1e6
        tp_bytes = cfg.activation_bytes
        factor, ns = it.factor, self.ns
        R = D * P * T
        if cfg.ep > 1:
            yield from (o for o in self._commops_ep(it) if ranks is None or o[0] in ranks)
            return
        for s in range(P):
            # the stage's ranks as (d, t, rank) in rank order: all of them, or the asked ones only (a fetch of a
            # few ranks of a large job then costs those ranks' ops, not a walk over every rank's)
            if ranks is None:
                cols = [(d, t, (s * D + d) * T + t) for d in range(D) for t in range(T)]
            else:
                cols = [(r // T % D, r % T, r) for r in sorted(ranks) if 0 <= r < R and r // (D * T) == s]
                if not cols:
                    continue
            for k, (kind, m, posted, start, end) in enumerate(it.ops[s]):
                comp = fwd if kind == "F" else bwd
                for d, t, r in cols:
                    yield from self._pp_recv(it, r, s, d, t, kind, m, posted, start)
                    if T > 1:
                        yield (r, f"tp.s{s}.d{d}", "all_reduce", it.it * 2 * M + k, tp_bytes,
                               ns(start[d] + comp * factor[r]), ns(end[d]))
                    yield from self._pp_send(it, r, s, d, t, kind, m, end)
            if D > 1:
                last = it.ops[s][-1][4]
                for d, t, r in cols:
                    yield (r, f"dp.s{s}.t{t}", "all_reduce", it.it, cfg.grad_bytes, ns(last[d]),
                           ns(it.last_b[s] + it.ar_ns[s][t]))

    def _commops_ep(self, it: Iteration) -> Iterator[tuple[int, str, str, int, int, int, int]]:
        """commops() with expert parallelism: per op recv, its all-to-alls, the TP all-reduce, send; per step
        the dense DP all-reduce, then the expert one."""
        cfg = self.cfg
        D, P, T, M, E = cfg.dp, cfg.pp, cfg.tp, cfg.micro_batches, cfg.ep
        fwd, bwd = cfg.fwd_ms * 1e6, cfg.bwd_ms * 1e6
        tp_bytes, a2a_bytes = cfg.activation_bytes, cfg.a2a_bytes
        factor, ns = it.factor, self.ns
        seg = self.seg
        n_a2a = len(seg["F"]) - 1
        a2a_ns, a2ag = it.a2a_ns, it.a2a_grp_ns
        for s in range(P):
            for k, (kind, m, posted, start, end) in enumerate(it.ops[s]):
                comp = fwd if kind == "F" else bwd
                fr = seg[kind]
                calls = it.a2a_calls[s][k]
                last_x, last_amax = calls[-1]
                seq0 = (it.it * 2 * M + k) * n_a2a
                for d in range(D):
                    g = s * D + d
                    e = d // E
                    tail = last_amax[e] + a2ag[s][e]  # the TP group resumes after its last all-to-all
                    for t in range(T):
                        r = g * T + t
                        yield from self._pp_recv(it, r, s, d, t, kind, m, posted, start)
                        cid = f"ep.s{s}.e{e}.t{t}"
                        took = a2a_ns[s][e * T + t]
                        f = comp * factor[r]
                        for i, (x, amax) in enumerate(calls):
                            yield (r, cid, "all_to_all", seq0 + i, a2a_bytes, ns(x[d] + fr[i] * f),
                                   ns(amax[e] + took))
                        if T > 1:
                            yield (r, f"tp.s{s}.d{d}", "all_reduce", it.it * 2 * M + k, tp_bytes,
                                   ns(tail + fr[n_a2a] * f), ns(end[d]))
                        yield from self._pp_send(it, r, s, d, t, kind, m, end)
            last = it.ops[s][-1][4]
            for t in range(T):
                dense_end = it.last_b[s] + it.ar_ns[s][t]
                for d in range(D):
                    r = (s * D + d) * T + t
                    if D > 1:
                        yield (r, f"dp.s{s}.t{t}", "all_reduce", it.it, self.dense_bytes, ns(last[d]), ns(dense_end))
                    if D > E:
                        j = d % E
                        yield (r, f"edp.s{s}.t{t}.x{j}", "all_reduce", it.it, self.expert_bytes, ns(dense_end),
                               ns(dense_end + it.ear_ns[s][t * E + j]))

    # -- flows (inter-node traffic only: NVLink is invisible to the network) ----------------------
    def flows(self, it: Iteration) -> Iterator[tuple[int, int, int, int, float, tuple[str, ...]]]:
        """(start_ns, src rank, dst rank, bytes, duration_s, switches)."""
        for s in range(self.cfg.pp):
            for _kind, rows in self.stage_flows(it, s):
                yield from rows

    def stage_flows(self, it: Iteration, s: int) -> list[tuple[str, Iterator]]:
        """Stage s's flows by the traffic that carries them, in flows()' order: ("pp", its pipeline sends),
        ("ep", its all-to-alls), ("dp", its DP rings), ("edp", its expert rings); kinds the job lacks left out."""
        cfg = self.cfg
        out = [("pp", self._pp_flows(it, s))]
        if cfg.ep > 1:
            out.append(("ep", self._a2a_flows(it, s)))
        if cfg.dp > 1:
            out.append(("dp", self._dp_flows(it, s)))
        if cfg.ep > 1 and cfg.dp > cfg.ep:
            out.append(("edp", self._edp_flows(it, s)))
        return out

    def _pp_flows(self, it: Iteration, s: int) -> Iterator[tuple[int, int, int, int, float, tuple[str, ...]]]:
        """Stage s's sends to its next (forward) or previous (backward) stage, leaving at each op's end."""
        cfg, net = self.cfg, self.net
        D, P, T = cfg.dp, cfg.pp, cfg.tp
        act_bits = cfg.activation_bytes * 8e9
        if it.net != self._pair_net:
            self._pair_net, self._pair_s = dict(it.net), {}
        pair_s = self._pair_s
        for kind, m, posted, start, end in it.ops[s]:
            nxt = s + 1 if kind == "F" else s - 1
            if not 0 <= nxt < P:
                continue
            for d in range(D):
                for t in range(T):
                    a, b = cfg.rank(s, d, t), cfg.rank(nxt, d, t)
                    path = net.path(a, b)
                    if path:
                        key = (a, b)
                        dur = pair_s.get(key)
                        if dur is None:
                            dur = pair_s[key] = (net.p2p_lat + act_bits / net.pair_bps(a, b, it.net)) / 1e9
                        yield (self.ns(end[d]), a, b, cfg.activation_bytes, dur, path)

    def _ring_hops(self, members: list[int]) -> list[tuple[int, int, tuple[str, ...]]]:
        """A ring's hops that cross the network: (src, dst, switches)."""
        n = len(members)
        hops = [(a, members[(i + 1) % n]) for i, a in enumerate(members)]
        return [(a, b, self.net.path(a, b)) for a, b in hops if self.net.path(a, b)]

    def _bucket_plan(self, total_bytes: int, n: int) -> list[tuple[float, float, int]]:
        """Per bucket of an all-reduce of total_bytes over a ring of n ranks: (share of the all-reduce's time
        before it, its share, bytes of one ring hop's flow). The buckets run back to back, each taking its
        share of bytes of the time; one bucket (dp_bucket_bytes == 0) is the whole window."""
        sizes = self.cfg.dp_buckets(total_bytes)
        if len(sizes) == 1:
            return [(0.0, 1.0, int(2 * (n - 1) / n * total_bytes))]
        plan, done = [], 0
        for b in sizes:
            plan.append((done / total_bytes, b / total_bytes, int(2 * (n - 1) / n * b)))
            done += b
        return plan

    def _dp_flows(self, it: Iteration, s: int) -> Iterator[tuple[int, int, int, int, float, tuple[str, ...]]]:
        """Stage s's DP ring all-reduces: per bucket, a flow per ring hop across the network."""
        cfg = self.cfg
        if self._dp_plan is None:
            self._dp_plan = self._bucket_plan(self.net.dense_bytes, cfg.dp)
            self._dp_hops = [[self._ring_hops([cfg.rank(ss, d, t) for d in range(cfg.dp)]) for t in range(cfg.tp)]
                             for ss in range(cfg.pp)]
        lb = it.last_b[s]
        for t, hops in enumerate(self._dp_hops[s]):
            ar = it.ar_ns[s][t]
            for before, share, nbytes in self._dp_plan:
                st, dur = self.ns(lb + ar * before), ar * share / 1e9
                for a, b, path in hops:
                    yield (st, a, b, nbytes, dur, path)

    def _a2a_flows(self, it: Iteration, s: int) -> Iterator[tuple[int, int, int, int, float, tuple[str, ...]]]:
        """Every all-to-all of stage s: a flow from each member to each other member across the network,
        starting when the group's last member arrived, lasting the collective's time."""
        cfg = self.cfg
        T = cfg.tp
        nb = cfg.a2a_bytes // cfg.ep
        ns = self.ns
        pairs = self._a2a_pairs[s]
        a2a_ns = it.a2a_ns[s]
        for calls in it.a2a_calls[s]:
            for _x, amax in calls:
                for e, st in enumerate(amax):
                    st_ns = ns(st)
                    for t in range(T):
                        x = e * T + t
                        dur = a2a_ns[x] / 1e9
                        for a, b, path in pairs[x]:
                            yield (st_ns, a, b, nb, dur, path)

    def _edp_flows(self, it: Iteration, s: int) -> Iterator[tuple[int, int, int, int, float, tuple[str, ...]]]:
        """Stage s's expert-gradient rings, after its dense all-reduce: per bucket, a flow per hop."""
        cfg = self.cfg
        E, T = cfg.ep, cfg.tp
        if self._edp_plan is None:
            self._edp_plan = self._bucket_plan(self.expert_bytes, cfg.dp // E)
            self._edp_hops = [[self._ring_hops(self.net.edp_members(ss, x)) for x in range(T * E)]
                              for ss in range(cfg.pp)]
        for t in range(T):
            lb = it.last_b[s] + it.ar_ns[s][t]
            for j in range(E):
                x = t * E + j
                ear = it.ear_ns[s][x]
                for before, share, nbytes in self._edp_plan:
                    st, dur = self.ns(lb + ear * before), ear * share / 1e9
                    for a, b, path in self._edp_hops[s][x]:
                        yield (st, a, b, nbytes, dur, path)

    # -- telemetry: one sample per GPU per whole second of cluster time ----------------------------
    def telemetry(self, it: Iteration) -> Iterator[tuple[int, int, float, float, float]]:
        """(ts_ns, rank, utilization_percent, sm_clock_mhz, power_watts) for each whole second in the step."""
        cfg = self.cfg
        per_op = (cfg.fwd_ms + cfg.bwd_ms) * 1e6 * cfg.micro_batches
        if self.sec_next is None:
            first = (self.base + 10**9 - 1) // 10**9 * 10**9
            self.sec_next = [first] * cfg.gpus
        nxt = self.sec_next
        for r, (a, b, f) in enumerate(zip(it.start, it.end, it.factor)):
            end_ns = self.base + int(b)
            if nxt[r] >= end_ns:
                continue
            step = b - a
            busy = min(1.0, per_op * f / step) if step > 0 else 0.0
            if it.stall.get(r):
                busy *= max(0.0, 1 - it.stall[r] / step)
            util = round(100.0 * busy, 1)
            clock = round(SM_CLOCK_MHZ / f if f > 1.5 else SM_CLOCK_MHZ, 0)
            power = round(IDLE_W + (MAX_W - IDLE_W) * busy * clock / SM_CLOCK_MHZ, 1)
            t = nxt[r]
            while t < end_ns:
                yield (t, r, util, clock, power)
                t += 10**9
            nxt[r] = t


class FileSink:
    """Writes the chosen kinds as JSON lines under out_dir; call close() at the end."""

    def __init__(self, cfg: ModelConfig, out_dir: str, emit: tuple[str, ...] = EMIT_KINDS) -> None:
        bad = set(emit) - set(EMIT_KINDS)
        if bad:
            raise ValueError(f"unknown --emit kinds {sorted(bad)}; choose from {', '.join(EMIT_KINDS)}")
        os.makedirs(out_dir, exist_ok=True)
        self.rows = Rows(cfg)
        self.topo = self.rows.topo
        self.emit = emit
        self.files = {k: open(os.path.join(out_dir, f"{k}.jsonl"), "w", encoding="utf-8", buffering=1 << 20)
                      for k in emit}
        self.counts = {k: 0 for k in emit}

    def __call__(self, it: Iteration) -> None:
        topo, rows = self.topo, self.rows
        gpn = topo.gpus_per_node
        if "steps" in self.files:
            w = self.files["steps"].write
            n = 0
            for r, i, a, b, c, wt, st in rows.steps(it):
                w(f'{{"rank": {r}, "iteration": {i}, "start_ns": {a}, "end_ns": {b}, "compute_ns": {c}, '
                  f'"comm_wait_ns": {wt}, "stall_ns": {st}, "node": "node{r // gpn}", "device": {r % gpn}}}\n')
                n += 1
            self.counts["steps"] += n
        if "commops" in self.files:
            w = self.files["commops"].write
            n = 0
            for r, cid, op, seq, nb, a, b in rows.commops(it):
                w(f'{{"rank": {r}, "comm_id": "{cid}", "op": "{op}", "seq": {seq}, "bytes": {nb}, '
                  f'"start_ns": {a}, "end_ns": {b}, "node": "node{r // gpn}", "device": {r % gpn}}}\n')
                n += 1
            self.counts["commops"] += n
        if "flows" in self.files:
            w = self.files["flows"].write
            n = 0
            ip = topo.ip
            for st, a, b, nb, dur, path in rows.flows(it):
                w(f'{{"start": {st}, "src": "{ip(a)}", "dst": "{ip(b)}", "switches": {json.dumps(list(path))}, '
                  f'"bytes": {nb}, "duration": {dur!r}}}\n')
                n += 1
            self.counts["flows"] += n
        if "telemetry" in self.files:
            w = self.files["telemetry"].write
            n = 0
            for ts, r, u, c, p in rows.telemetry(it):
                w(f'{{"ts_ns": {ts}, "node": "node{r // gpn}", "gpu": {r % gpn}, "rank": {r}, '
                  f'"utilization_percent": {u!r}, "sm_clock_mhz": {c!r}, "power_watts": {p!r}}}\n')
                n += 1
            self.counts["telemetry"] += n

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def truth(res: Result) -> dict:
    """Ground truth: each fault with the ranks, links, switches and communicators it touches."""
    cfg = res.cfg
    topo = cfg.topology()
    net = Network(cfg, topo)
    out = []
    for f in res.faults:
        entry = {"kind": f.kind, "target": f.target, "start": f.start, "end": f.end, "value": f.value,
                 "resource": f.resource}
        if f.kind == "fluctuation":
            entry["period"] = f.period
        if f.resource == "rank":
            s, d, t = cfg.coords(f.rank)
            entry.update(ranks=[f.rank], links=[topo.link_of(f.rank)], switches=[],
                         node=f"node{topo.node_of(f.rank)}", device=topo.device_of(f.rank),
                         comms=_comms_of(cfg, s, d, t))
            if f.kind == "hang":
                entry["hang_seconds"] = f.value if f.value > 0 else None
        else:
            res_id = f.link or f.switch
            users = net.index.get(res_id, [])
            ranks = set()
            for kind, s, x in users:
                if kind == "pp":
                    ranks.update(cfg.rank(ss, x, t) for ss in (s, s + 1) for t in range(cfg.tp))
                elif kind == "dp":
                    ranks.update(cfg.rank(s, d, x) for d in range(cfg.dp))
                elif kind == "ep":
                    ranks.update(net.ep_members(s, x))
                else:
                    ranks.update(net.edp_members(s, x))
            entry.update(ranks=sorted(ranks), links=[f.link] if f.link else [],
                         switches=[f.switch] if f.switch else [],
                         comms=sorted(_comm_name(cfg, k, s, x) for k, s, x in users))
            if f.link:
                r = topo.rank_of_link(f.link)
                entry.update(node=f"node{topo.node_of(r)}", device=topo.device_of(r), nic_of_rank=r)
        out.append(entry)
    return {"config": cfg.to_json(), "topology": topo.to_json(), "iterations_done": res.iterations_done,
            "aborted_at_iteration": res.aborted_at if res.aborted_at >= 0 else None,
            "end_ns": cfg.base_ns + int(round(res.end_ns)), "faults": out}


def _comm_name(cfg: ModelConfig, kind: str, s: int, x: int) -> str:
    """truth.json's name of a Network.index user (pp: a stage boundary of replica d, all TP indices)."""
    if kind == "pp":
        return f"pp.s{s}-{s + 1}.d{x}"
    if kind == "dp":
        return f"dp.s{s}.t{x}"
    if kind == "ep":
        e, t = divmod(x, cfg.tp)
        return f"ep.s{s}.e{e}.t{t}"
    t, j = divmod(x, cfg.ep)
    return f"edp.s{s}.t{t}.x{j}"


def _comms_of(cfg: ModelConfig, s: int, d: int, t: int) -> list[str]:
    out = [f"dp.s{s}.t{t}"] if cfg.dp > 1 else []
    if cfg.tp > 1:
        out.append(f"tp.s{s}.d{d}")
    if s > 0:
        out.append(f"pp.s{s - 1}-{s}.d{d}.t{t}")
    if s < cfg.pp - 1:
        out.append(f"pp.s{s}-{s + 1}.d{d}.t{t}")
    if cfg.ep > 1:
        out.append(f"ep.s{s}.e{d // cfg.ep}.t{t}")
        if cfg.dp > cfg.ep:
            out.append(f"edp.s{s}.t{t}.x{d % cfg.ep}")
    return out


def write_truth(res: Result, out_dir: str) -> str:
    path = os.path.join(out_dir, "truth.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(truth(res), f, indent=2, sort_keys=True)
        f.write("\n")
    return path
