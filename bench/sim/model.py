"""The simulator's core: per-iteration timing of a DP x PP x TP job under a 1F1B schedule with faults.

Not a heap of per-op events: within one iteration the ranks of a TP group move in lockstep (every compute
op ends in a TP collective that completes at the group's last arrival), so the schedule is computed over
TP groups, vectorised over the DP replicas of each stage with plain lists, in the order the 1F1B
dependencies allow:
  F(s, m) starts at max(end of stage s's previous op, F(s-1, m) end + transfer s-1 -> s)   (recv waits for send)
  B(s, m) starts at max(end of stage s's previous op, B(s+1, m) end + transfer s+1 -> s)
  op end = start + slowest member's compute (+ the TP collective)
  DP all-reduce of stage s, TP index t = max over replicas of the last backward end + ring time, where the
  ring time is set by the slowest hop (NIC bandwidth / fault factor, every switch on the path)
  next iteration of a rank starts where its all-reduce + optimizer ended.
Expert parallelism (ep > 1, Megatron's layout): EP divides DP; the ranks with the same (pp, tp) coordinates
and consecutive DP indices d in [e*E, (e+1)*E) form EP group e. Each stage has `layers_per_stage` layers,
of which the MoE ones are every `moe_every`-th (layers 0, k, 2k, ...; or `moe_fraction` of them, evenly
spread). An op's compute is cut into segments at its MoE layers: forward runs attention, a dispatch
all-to-all, the expert MLP (`moe_mlp_share` of the layer), a combine all-to-all; backward the same in
reverse (combine's gradient first). Each all-to-all of EP group (s, e) completes at
  max over its members of their arrival (their TP group's, as the dispatcher gathers over TP first)
  + the all-to-all time, p2p latency + (E-1)/E * a2a_bytes over the slowest ordered pair's bandwidth
    (NIC / fault factor, every switch on the path, NVLink inside a node), the slowest TP index's,
so a slow GPU in one EP group shows up as its group members waiting in all_to_all, and from there on their
DP and PP peers as before. Gradients: the dense share (1 - expert_grad_share) of grad_bytes is ring
all-reduced over all DP replicas as before, then the expert share over the DP/E replicas that hold the same
experts (d = j, j+E, j+2E, ... for EP index j) on the same stream. With ep == 1 there are no MoE layers and
none of this runs: results are bit-identical to the dense model.
DDP buckets (dp_bucket_bytes > 0) change only the flow rows (output.py), never this timing.
So one slow device shows up as waiting on every rank that depends on it. Cost: O(P * 2M) list operations
of length DP per iteration plus O(ranks) for the per-rank jitter and bookkeeping: ~1-2 µs per
rank-iteration on this machine. Per-rank detail (ops, flows) is handed to a sink per iteration and never
kept, so memory stays at a few lists of length `ranks`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, asdict
from typing import Callable

from .faults import Fault
from .topology import Topology


@dataclass
class ModelConfig:
    dp: int = 2
    pp: int = 2
    tp: int = 1
    micro_batches: int = 8
    iterations: int = 10
    gpus_per_node: int = 8
    nodes_per_leaf: int = 32
    spines: int = 8
    fwd_ms: float = 8.0              # per micro-batch per stage (slowest TP member's compute)
    bwd_ms: float = 16.0
    tp_collective_ms: float = 0.3    # one TP all-reduce after each forward/backward (NVLink)
    activation_bytes: int = 16 << 20  # one PP send per micro-batch per direction
    grad_bytes: int = 512 << 20      # DP all-reduce payload per rank per step
    nic_gbps: float = 400.0
    switch_gbps: float = 400.0       # per-flow share a switch gives when not congested
    nvlink_gbps: float = 2400.0
    p2p_latency_us: float = 10.0
    hop_latency_us: float = 10.0
    optimizer_ms: float = 5.0
    jitter_cv: float = 0.02          # per rank per iteration, multiplicative on compute
    net_jitter_cv: float = 0.0       # per transfer per iteration, multiplicative on its time (a PP pair's TP
                                     # group, a DP ring, an EP all-to-all, an expert ring); 0 = deterministic
    schedule: str = "1f1b"           # or "gpipe": all forwards, then all backwards (the CPU testbed's default)
    barrier_us: float = 0.0          # > 0: a world barrier after every forward micro-batch costing this much
                                     # after the last arrival (the testbed's `extra_sync` fault)
    send_rendezvous: bool = False    # a send completes only once its receiver has taken it (gloo), and a stage
                                     # waits for all its sends before the DP all-reduce (the testbed's job)
    ep: int = 1                      # expert parallel size (divides dp); 1 = dense model, no MoE layers
    layers_per_stage: int = 4        # transformer layers per pipeline stage (used when ep > 1)
    moe_every: int = 1               # every k-th layer is MoE (Megatron's --moe-layer-freq): layers 0, k, 2k...
    moe_fraction: float = 0.0        # > 0: instead, this fraction of the stage's layers is MoE (evenly spread)
    moe_mlp_share: float = 0.6       # share of an MoE layer's compute in its expert MLP (between the all-to-alls)
    a2a_bytes: int = 8 << 20         # per rank per all-to-all (dispatch or combine), split evenly over E peers
    expert_grad_share: float = 0.5   # share of grad_bytes that are expert weights (all-reduced over DP/E ranks)
    dp_bucket_bytes: int = 0         # > 0: gradients all-reduce in DDP buckets (1 MiB first, then this size, the
                                     # remainder last), one flow per bucket per ring hop; 0 = one flow per hop.
                                     # Flow rows only: the model times each all-reduce as a whole either way
    collective_timeout_s: float = 600.0
    base_ns: int = 1_767_225_600_000_000_000  # cluster time of the job start (2026-01-01T00:00:00Z)
    seed: int = 0

    @property
    def gpus(self) -> int:
        return self.dp * self.pp * self.tp

    def topology(self) -> Topology:
        return Topology(self.gpus, self.gpus_per_node, self.nodes_per_leaf, self.spines)

    def validate(self) -> None:
        for name in ("dp", "pp", "tp", "micro_batches", "gpus_per_node", "nodes_per_leaf", "spines"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.iterations < 0:
            raise ValueError("iterations must be >= 0")
        if self.gpus_per_node % self.tp and self.tp % self.gpus_per_node:
            raise ValueError(f"tp={self.tp} must divide gpus_per_node={self.gpus_per_node} (TP stays in a node)")
        if self.tp > self.gpus_per_node:
            raise ValueError(f"tp={self.tp} larger than a node ({self.gpus_per_node} GPUs) is not modelled")
        if self.schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"schedule must be 1f1b or gpipe, not {self.schedule!r}")
        for name in ("fwd_ms", "bwd_ms", "nic_gbps", "switch_gbps", "nvlink_gbps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("jitter_cv", "net_jitter_cv"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1)")
        if self.dp_bucket_bytes < 0:
            raise ValueError("dp_bucket_bytes must be >= 0")
        if self.ep < 1:
            raise ValueError("ep must be >= 1")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp} (EP groups are formed inside DP)")
        if self.ep > 1:
            if self.layers_per_stage < 1 or self.moe_every < 1:
                raise ValueError("layers_per_stage and moe_every must be >= 1")
            if not 0.0 <= self.moe_fraction <= 1.0:
                raise ValueError("moe_fraction must be in [0, 1]")
            for name in ("moe_mlp_share", "expert_grad_share"):
                if not 0.0 <= getattr(self, name) <= 1.0:
                    raise ValueError(f"{name} must be in [0, 1]")
            if self.a2a_bytes < 0:
                raise ValueError("a2a_bytes must be >= 0")
            if not self.moe_layers():
                raise ValueError("ep > 1 needs at least one MoE layer per stage (moe_every / moe_fraction)")

    def rank(self, s: int, d: int, t: int) -> int:
        """Megatron order: TP fastest, then DP, then PP."""
        return (s * self.dp + d) * self.tp + t

    def coords(self, r: int) -> tuple[int, int, int]:
        g, t = divmod(r, self.tp)
        s, d = divmod(g, self.dp)
        return s, d, t

    def to_json(self) -> dict:
        d = asdict(self)
        if self.ep == 1:  # a dense job's config reads as before EP existed
            for k in EP_FIELDS:
                del d[k]
        if not self.dp_bucket_bytes:  # nor does one without DDP buckets
            del d["dp_bucket_bytes"]
        return d

    def dp_buckets(self, total_bytes: int) -> list[int]:
        """The buckets an all-reduce of total_bytes runs in, in order: [total_bytes] when dp_bucket_bytes == 0;
        else DDP's small first bucket (min(1 MiB, total)), then dp_bucket_bytes each, the remainder last (no
        bucket of 0 bytes, so none at all for 0 bytes)."""
        if not self.dp_bucket_bytes:
            return [total_bytes]
        first = min(FIRST_BUCKET_BYTES, total_bytes)
        full, rest = divmod(total_bytes - first, self.dp_bucket_bytes)
        return [b for b in [first] + [self.dp_bucket_bytes] * full + [rest] if b > 0]

    # -- expert parallelism -------------------------------------------------------------------
    def moe_layers(self) -> list[int]:
        """Indices (within a stage) of the MoE layers; [] when ep == 1."""
        if self.ep == 1:
            return []
        L = self.layers_per_stage
        if self.moe_fraction > 0:
            n = min(L, max(1, round(self.moe_fraction * L)))
            return sorted({i * L // n for i in range(n)})
        return list(range(0, L, self.moe_every))

    def ep_segments(self) -> tuple[list[float], list[float]]:
        """Forward and backward compute cut at the all-to-alls, as fractions of fwd_ms / bwd_ms:
        [before a2a 0, before a2a 1, ..., after the last a2a]; 2 all-to-alls per MoE layer."""
        L, moe, ms = self.layers_per_stage, set(self.moe_layers()), self.moe_mlp_share
        fwd, acc = [], 0.0
        for layer in range(L):
            if layer in moe:
                fwd += [acc + (1 - ms) / L, ms / L]   # attention, dispatch | expert MLP, combine
                acc = 0.0
            else:
                acc += 1.0 / L
        fwd.append(acc)
        bwd, acc = [], 0.0
        for layer in reversed(range(L)):
            if layer in moe:
                bwd += [acc, ms / L]                  # combine's grad | expert MLP's, dispatch's grad
                acc = (1 - ms) / L
            else:
                acc += 1.0 / L
        bwd.append(acc)
        return fwd, bwd

    def ep_group(self, r: int) -> list[int]:
        """The ranks of rank r's EP group (same stage and TP index, consecutive DP indices)."""
        s, d, t = self.coords(r)
        b = d // self.ep * self.ep
        return [self.rank(s, x, t) for x in range(b, b + self.ep)]

    def expert_dp_group(self, r: int) -> list[int]:
        """The ranks holding the same experts as rank r (its expert-gradient all-reduce): DP/EP of them."""
        s, d, t = self.coords(r)
        return [self.rank(s, x, t) for x in range(d % self.ep, self.dp, self.ep)]

    def grad_split(self) -> tuple[int, int]:
        """(dense, expert) gradient bytes per rank; (grad_bytes, 0) when ep == 1."""
        if self.ep == 1:
            return self.grad_bytes, 0
        dense = int(round(self.grad_bytes * (1.0 - self.expert_grad_share)))
        return dense, self.grad_bytes - dense


FIRST_BUCKET_BYTES = 1 << 20  # DDP's first bucket (torch's _DEFAULT_FIRST_BUCKET_BYTES): small, to start early

EP_FIELDS = ("ep", "layers_per_stage", "moe_every", "moe_fraction", "moe_mlp_share", "a2a_bytes",
             "expert_grad_share")


def testbed_like(**over) -> ModelConfig:
    """The real gloo CPU testbed (FACTS.md): DP=2 x PP=2 of 2x Linear(1024) per stage, 4 micro-batches of
    16 rows, one 'GPU' (a CPU process) per host, veth links, ~130 ms/step, 8.4 MB all-reduce per stage,
    64 KiB per stage send. Calibrated so the testbed's faults give its step-time ratios (see FAULT_PRESETS)."""
    cfg = dict(dp=2, pp=2, tp=1, micro_batches=4, gpus_per_node=1, nodes_per_leaf=32, spines=1,
               fwd_ms=3.5, bwd_ms=7.0, tp_collective_ms=0.0, activation_bytes=64 * 1024,
               grad_bytes=2 * (1024 * 1024 + 1024) * 4, nic_gbps=2.4, switch_gbps=10.0, nvlink_gbps=10.0,
               p2p_latency_us=150.0, hop_latency_us=150.0, optimizer_ms=48.0, jitter_cv=0.05)
    cfg.update(over)
    return ModelConfig(**cfg)


# the testbed's faults as simulator faults (VALUE per FACTS.md's measured ratios); TARGET filled in by the caller
TESTBED_FAULTS = {
    "tbf_200mbit": ("slow_link", 2.4 / 0.185),    # 2.4 Gbit/s veth -> ~185 Mbit/s TCP goodput under tbf: ~3.7x
    "cpu_quota_10pct": ("slow_gpu", 10.5),        # 10 % of a core (+ throttling latency): ~4x step
    "sigstop_3s": ("hang", 3.0),                  # one 3 s step
    "gc_storm": ("slow_gpu", 13.5),               # ~5x step
}


@dataclass
class Iteration:
    """One iteration's timing, handed to sinks. Times are float ns since the job start.

    start[r], end[r]: rank r's step; factor[r]: its compute multiplier (jitter x faults); stall[r]: ns it was
    stopped (hang). ops[s]: stage s's ops in schedule order, each (kind 'F'|'B', micro-batch, posted[d],
    start[d], end[d]) over DP replicas d (posted = when the stage was ready, start = when the input had
    arrived). last_b[s]: max over replicas of stage s's last backward end (the DP all-reduce start);
    ar_ns[s][t], xfer_ns[s][d]: all-reduce and stage s -> s+1 transfer times in force (xfer: the slowest
    TP pair's, since the group moves in lockstep)."""

    it: int
    start: list[float]
    end: list[float]
    factor: list[float]
    stall: dict[int, float]
    ops: list[list[tuple]]
    last_b: list[float]
    ar_ns: list[list[float]]
    xfer_ns: list[list[float]]
    net: dict[str, float] = field(default_factory=dict)  # link/switch -> bandwidth divisor in force
    # net_jitter_cv > 0 only: the multipliers drawn for this iteration, already in ar_ns/xfer_ns/a2a_ns/ear_ns:
    # pp[s][d] (stage s -> s+1 pairs of replica d, all TP pairs alike), dp[s][t], a2a[s][e * tp + t], ear[s][x]
    net_jitter: dict | None = None
    sync_ns: list[list[float]] | None = None  # [s][d] time in per-micro-batch barriers (cfg.barrier_us > 0)
    send_wait_ns: list[list[float]] | None = None  # [s][d] waiting for sends after the last op (send_rendezvous)
    # ep > 1 only: a2a_calls[s][k] = the all-to-alls of ops[s][k], each (seg_start[d], done_at[e]): when the
    # TP group (s, d) began the compute before it, and when EP group e's last member arrived;
    # a2a_ns[s][e * tp + t] the all-to-all time of EP group (s, e, t) in force, a2a_grp_ns[s][e] its max over t;
    # ear_ns[s][t * ep + j] the expert-gradient ring time of the ranks holding expert shard j.
    a2a_calls: list[list[list[tuple]]] | None = None
    a2a_ns: list[list[float]] | None = None
    a2a_grp_ns: list[list[float]] | None = None
    ear_ns: list[list[float]] | None = None


@dataclass
class Result:
    cfg: ModelConfig
    faults: list[Fault]
    iterations_done: int
    end_ns: float                       # latest rank end, ns since job start
    step_ns: list[list[float]] = field(default_factory=list)  # [it][rank] when keep_steps
    aborted_at: int = -1                # iteration whose hang outlived the collective timeout


def one_f_one_b(pp: int, m: int) -> list[list[tuple[str, int]]]:
    """Per stage, its ops in 1F1B order: warm-up forwards, steady 1F1B, cool-down backwards."""
    out = []
    for s in range(pp):
        warm = min(pp - s - 1, m)
        ops = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops += [("F", warm + i), ("B", i)]
        ops += [("B", i) for i in range(m - warm, m)]
        out.append(ops)
    return out


def gpipe(pp: int, m: int) -> list[list[tuple[str, int]]]:
    """Per stage: all forwards, then all backwards (micro-batch 0 first, as the testbed's job does)."""
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(pp)]


class Network:
    """Transfer and ring times per PP boundary / DP ring, recomputed only for what active faults touch."""

    def __init__(self, cfg: ModelConfig, topo: Topology) -> None:
        self.cfg, self.topo = cfg, topo
        D, P, T = cfg.dp, cfg.pp, cfg.tp
        self.nic_bps = cfg.nic_gbps * 1e9
        self.sw_bps = cfg.switch_gbps * 1e9
        self.nv_bps = cfg.nvlink_gbps * 1e9
        self.p2p_lat = cfg.p2p_latency_us * 1e3
        self.hop_lat = cfg.hop_latency_us * 1e3
        # resource -> [("pp", s, d) | ("dp", s, t) | ("ep", s, e * T + t) | ("edp", s, t * E + j)]
        self.index: dict[str, list[tuple]] = {}
        self.path_cache: dict[tuple[int, int], tuple[str, ...]] = {}
        self.dense_bytes, self.expert_bytes = cfg.grad_split()
        self.base_xfer = [[self._xfer(s, d, {}, register=True) for d in range(D)] for s in range(P - 1)]
        self.base_ar = [[self._ar(s, t, {}, register=True) for t in range(T)] for s in range(P)]
        self.ep = E = cfg.ep
        if E > 1:
            self.base_a2a = [[self._a2a(s, x, {}, register=True) for x in range(D // E * T)] for s in range(P)]
            self.base_ear = [[self._ear(s, x, {}, register=True) for x in range(T * E)] for s in range(P)]
        else:
            self.base_a2a = self.base_ear = None
        self._key: tuple = ()
        self.xfer, self.ar = self.base_xfer, self.base_ar
        self.a2a, self.ear = self.base_a2a, self.base_ear

    def path(self, a: int, b: int) -> tuple[str, ...]:
        p = self.path_cache.get((a, b))
        if p is None:
            p = self.path_cache[(a, b)] = self.topo.path(a, b)
        return p

    def pair_bps(self, a: int, b: int, net: dict[str, float]) -> float:
        path = self.path(a, b)
        if not path:
            return self.nv_bps
        bw = self.nic_bps / max(net.get(self.topo.link_of(a), 1.0), net.get(self.topo.link_of(b), 1.0)) \
            if net else self.nic_bps
        for sw in path:
            bw = min(bw, self.sw_bps / net.get(sw, 1.0))
        return bw

    def _register(self, key: tuple, a: int, b: int) -> None:
        for res in (self.topo.link_of(a), self.topo.link_of(b)) + self.path(a, b):
            lst = self.index.setdefault(res, [])
            if not lst or lst[-1] != key:
                lst.append(key)

    def _xfer(self, s: int, d: int, net: dict, register: bool = False) -> float:
        cfg = self.cfg
        worst = 0.0
        for t in range(cfg.tp):
            a, b = cfg.rank(s, d, t), cfg.rank(s + 1, d, t)
            if register:
                self._register(("pp", s, d), a, b)
            worst = max(worst, self.p2p_lat + cfg.activation_bytes * 8e9 / self.pair_bps(a, b, net))
        return worst

    def _ar(self, s: int, t: int, net: dict, register: bool = False) -> float:
        cfg, D = self.cfg, self.cfg.dp
        if D == 1:
            return 0.0
        bw = float("inf")
        for d in range(D):
            a, b = cfg.rank(s, d, t), cfg.rank(s, (d + 1) % D, t)
            if register:
                self._register(("dp", s, t), a, b)
            bw = min(bw, self.pair_bps(a, b, net))
        return 2 * (D - 1) * self.hop_lat + 2 * (D - 1) / D * self.dense_bytes * 8e9 / bw

    def ep_members(self, s: int, x: int) -> list[int]:
        """Ranks of EP group x = e * tp + t of stage s."""
        e, t = divmod(x, self.cfg.tp)
        E = self.cfg.ep
        return [self.cfg.rank(s, d, t) for d in range(e * E, (e + 1) * E)]

    def edp_members(self, s: int, x: int) -> list[int]:
        """Ranks of expert-gradient ring x = t * ep + j of stage s."""
        t, j = divmod(x, self.cfg.ep)
        return [self.cfg.rank(s, d, t) for d in range(j, self.cfg.dp, self.cfg.ep)]

    def _a2a(self, s: int, x: int, net: dict, register: bool = False) -> float:
        """All-to-all of EP group x: every member sends a2a_bytes / E to each other member at once; the
        slowest ordered pair (NIC, switches on its path, NVLink inside a node) sets the time."""
        cfg = self.cfg
        members = self.ep_members(s, x)
        E = len(members)
        bw = float("inf")
        for a in members:
            for b in members:
                if a != b:
                    if register:
                        self._register(("ep", s, x), a, b)
                    bw = min(bw, self.pair_bps(a, b, net))
        return self.p2p_lat + (E - 1) / E * cfg.a2a_bytes * 8e9 / bw

    def _ear(self, s: int, x: int, net: dict, register: bool = False) -> float:
        """Ring all-reduce of the expert gradients over the DP/EP ranks holding the same experts."""
        members = self.edp_members(s, x)
        n = len(members)
        if n == 1:
            return 0.0
        bw = float("inf")
        for i, a in enumerate(members):
            b = members[(i + 1) % n]
            if register:
                self._register(("edp", s, x), a, b)
            bw = min(bw, self.pair_bps(a, b, net))
        return 2 * (n - 1) * self.hop_lat + 2 * (n - 1) / n * self.expert_bytes * 8e9 / bw

    def update(self, net: dict[str, float]) -> None:
        key = tuple(sorted(net.items()))
        if key == self._key:
            return
        self._key = key
        if not net:
            self.xfer, self.ar = self.base_xfer, self.base_ar
            self.a2a, self.ear = self.base_a2a, self.base_ear
            return
        xfer = [row[:] for row in self.base_xfer]
        ar = [row[:] for row in self.base_ar]
        ep = self.ep > 1
        a2a = [row[:] for row in self.base_a2a] if ep else None
        ear = [row[:] for row in self.base_ear] if ep else None
        touched = set()
        for res in net:
            touched.update(self.index.get(res, ()))
        for kind, s, x in touched:
            if kind == "pp":
                xfer[s][x] = self._xfer(s, x, net)
            elif kind == "dp":
                ar[s][x] = self._ar(s, x, net)
            elif kind == "ep":
                a2a[s][x] = self._a2a(s, x, net)
            else:
                ear[s][x] = self._ear(s, x, net)
        self.xfer, self.ar = xfer, ar
        self.a2a, self.ear = a2a, ear


def nominal_step_ns(cfg: ModelConfig) -> float:
    """Fault-free step estimate (used for a hang's default duration)."""
    net = Network(cfg, cfg.topology()) if cfg.gpus <= 4096 else None
    ar = max(max(r) for r in net.base_ar) if net else 0.0
    xf = max((max(r) for r in net.base_xfer), default=0.0) if net else 0.0
    op = (cfg.fwd_ms + cfg.bwd_ms + 2 * cfg.tp_collective_ms) * 1e6
    est = (cfg.micro_batches + cfg.pp - 1) * op + 2 * (cfg.pp - 1) * xf + ar + cfg.optimizer_ms * 1e6
    if cfg.ep > 1 and net:
        a2a = max(max(r) for r in net.base_a2a)
        est += (cfg.micro_batches + cfg.pp - 1) * 4 * len(cfg.moe_layers()) * a2a
        est += max(max(r) for r in net.base_ear)
    return est


def simulate(cfg: ModelConfig, faults: list[Fault], sink: Callable[[Iteration], None] | None = None,
             keep_steps: bool = False) -> Result:
    cfg.validate()
    topo = cfg.topology()
    D, P, T, M = cfg.dp, cfg.pp, cfg.tp, cfg.micro_batches
    R = cfg.gpus
    rng = random.Random(cfg.seed)
    gauss = rng.gauss
    net = Network(cfg, topo)
    sched = gpipe(P, M) if cfg.schedule == "gpipe" else one_f_one_b(P, M)
    barrier = cfg.barrier_us * 1e3
    fwd, bwd, tpc = cfg.fwd_ms * 1e6, cfg.bwd_ms * 1e6, cfg.tp_collective_ms * 1e6
    opt = cfg.optimizer_ms * 1e6
    cv = cfg.jitter_cv
    ncv = cfg.net_jitter_cv
    ngauss = random.Random(cfg.seed * 7919 + 17).gauss if ncv > 0 else None
    timeout = cfg.collective_timeout_s * 1e9
    hang_default = None
    rank_faults = [f for f in faults if f.resource == "rank"]
    net_faults = [f for f in faults if f.resource in ("link", "switch")]
    end = [0.0] * R
    res = Result(cfg, faults, 0, 0.0)
    E = cfg.ep
    ep_on = E > 1
    if ep_on:
        NB = D // E                              # EP groups per (stage, TP index)
        seg_f, seg_b = cfg.ep_segments()
        n_a2a = len(seg_f) - 1
        blocks = [(b * E, (b + 1) * E) for b in range(NB)]
    for it in range(cfg.iterations):
        # per-rank compute multiplier: jitter x active compute faults
        if cv > 0:
            factor = [max(0.5, 1.0 + gauss(0.0, cv)) for _ in range(R)]
        else:
            factor = [1.0] * R
        stall: dict[int, float] = {}
        for f in rank_faults:
            if f.kind == "hang":
                if it == f.start:
                    if f.value > 0:
                        dur = f.value * 1e9
                    else:
                        if hang_default is None:
                            hang_default = nominal_step_ns(cfg)
                        dur = max(1, f.end - f.start) * hang_default
                    stall[f.rank] = stall.get(f.rank, 0.0) + dur
            elif f.active(it):
                factor[f.rank] *= f.factor(it)
        if any(v > timeout for v in stall.values()):
            res.aborted_at = it
            break
        netf: dict[str, float] = {}
        for f in net_faults:
            if f.active(it):
                k = f.link or f.switch
                netf[k] = netf.get(k, 1.0) * f.factor(it)
        net.update(netf)
        xfer, ar = net.xfer, net.ar
        if ep_on:
            a2a, ear = net.a2a, net.ear
        jit = None
        if ngauss is not None:  # every transfer of this iteration a little faster or slower
            def draw(rows):
                return [[max(0.5, 1.0 + ngauss(0.0, ncv)) for _ in row] for row in rows]
            jit = {"pp": draw(xfer), "dp": draw(ar)}
            xfer = [[x * j for x, j in zip(row, jr)] for row, jr in zip(xfer, jit["pp"])]
            ar = [[x * j for x, j in zip(row, jr)] for row, jr in zip(ar, jit["dp"])]
            if ep_on:
                jit["a2a"], jit["ear"] = draw(a2a), draw(ear)
                a2a = [[x * j for x, j in zip(row, jr)] for row, jr in zip(a2a, jit["a2a"])]
                ear = [[x * j for x, j in zip(row, jr)] for row, jr in zip(ear, jit["ear"])]
        if ep_on:
            a2ag = [[max(row[b * T:(b + 1) * T]) for b in range(NB)] for row in a2a]
        # group (s, d) compute multiplier = its slowest TP member; group start = its latest member's end + stall
        if T == 1:
            gfac = factor
            gstart = end[:] if not stall else [e + stall.get(r, 0.0) for r, e in enumerate(end)]
        else:
            gfac = [max(factor[g * T:(g + 1) * T]) for g in range(D * P)]
            if stall:
                gstart = [max(end[r] + stall.get(r, 0.0) for r in range(g * T, (g + 1) * T)) for g in range(D * P)]
            else:
                gstart = [max(end[g * T:(g + 1) * T]) for g in range(D * P)]
        cur = [gstart[s * D:(s + 1) * D] for s in range(P)]
        if ep_on:  # per stage, per segment: [d] durations; the last segment carries the TP collective
            fseg = [[[fwd * f * x for x in gfac[s * D:(s + 1) * D]] for f in seg_f[:-1]]
                    + [[fwd * seg_f[-1] * x + tpc for x in gfac[s * D:(s + 1) * D]]] for s in range(P)]
            bseg = [[[bwd * f * x for x in gfac[s * D:(s + 1) * D]] for f in seg_b[:-1]]
                    + [[bwd * seg_b[-1] * x + tpc for x in gfac[s * D:(s + 1) * D]]] for s in range(P)]
            calls: list[list[list[tuple]]] = [[] for _ in range(P)]
        else:
            fdur = [[fwd * x + tpc for x in gfac[s * D:(s + 1) * D]] for s in range(P)]
            bdur = [[bwd * x + tpc for x in gfac[s * D:(s + 1) * D]] for s in range(P)]
        fend = [[None] * M for _ in range(P)]
        bend = [[None] * M for _ in range(P)]
        ops: list[list[tuple]] = [[] for _ in range(P)]
        ptr = [0] * P
        remaining = P * 2 * M
        sync = [[0.0] * D for _ in range(P)] if barrier > 0 else None
        while remaining:
            progressed = False
            for s in range(P):
                sops = sched[s]
                while ptr[s] < 2 * M:
                    kind, m = sops[ptr[s]]
                    if sync is not None and ptr[s] and sops[ptr[s] - 1][0] == "F":
                        # world barrier after the previous forward: every rank of every stage must have done it
                        pm = sops[ptr[s] - 1][1]
                        if any(fend[x][pm] is None for x in range(P)):
                            break
                        done = max(max(fend[x][pm]) for x in range(P)) + barrier
                        sync[s] = [a + done - b for a, b in zip(sync[s], cur[s])]
                        cur[s] = [done] * D
                    c = cur[s]
                    if kind == "F":
                        if s > 0:
                            dep = fend[s - 1][m]
                            if dep is None:
                                break
                            st = [a if a > b + x else b + x for a, b, x in zip(c, dep, xfer[s - 1])]
                        else:
                            st = c
                        if ep_on:
                            en = _moe_op(st, fseg[s], a2ag[s], blocks, E, n_a2a, calls[s])
                        else:
                            en = [a + b for a, b in zip(st, fdur[s])]
                        fend[s][m] = en
                    else:
                        if s < P - 1:
                            dep = bend[s + 1][m]
                            if dep is None:
                                break
                            st = [a if a > b + x else b + x for a, b, x in zip(c, dep, xfer[s])]
                        else:
                            st = c
                        if ep_on:
                            en = _moe_op(st, bseg[s], a2ag[s], blocks, E, n_a2a, calls[s])
                        else:
                            en = [a + b for a, b in zip(st, bdur[s])]
                        bend[s][m] = en
                    ops[s].append((kind, m, c, st, en))
                    cur[s] = en
                    ptr[s] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                raise RuntimeError("1F1B schedule deadlocked (bug)")
        if sync is not None:  # a last forward's barrier (no op after it on that stage)
            for s in range(P):
                if sched[s][-1][0] == "F":
                    pm = sched[s][-1][1]
                    done = max(max(fend[x][pm]) for x in range(P)) + barrier
                    sync[s] = [a + done - b for a, b in zip(sync[s], cur[s])]
                    cur[s] = [done] * D
        send_wait = None
        if cfg.send_rendezvous and P > 1:
            # a send is taken when its receiver starts the op that consumes it (that op's start already is
            # max(posted, sender end + transfer)); the stage waits for the last of them
            recv_start = [{(kind, m): st for kind, m, _c, st, _e in ops[s]} for s in range(P)]
            send_wait = [[0.0] * D for _ in range(P)]
            for s in range(P):
                done = cur[s]
                for kind, m, _c, _st, _en in ops[s]:
                    if kind == "F" and s < P - 1:
                        taken = recv_start[s + 1][("F", m)]
                    elif kind == "B" and s > 0:
                        taken = recv_start[s - 1][("B", m)]
                    else:
                        continue
                    done = [a if a > b else b for a, b in zip(done, taken)]
                send_wait[s] = [a - b for a, b in zip(done, cur[s])]
                cur[s] = done
        last_b = [max(cur[s]) for s in range(P)]
        start = end
        end = [0.0] * R
        if ep_on:  # dense ring over all DP, then the expert ring over the DP/EP ranks holding the same experts
            for s in range(P):
                for t in range(T):
                    e = last_b[s] + ar[s][t] + opt
                    er = ear[s][t * E:(t + 1) * E]
                    for d in range(D):
                        end[(s * D + d) * T + t] = e + er[d % E]
        else:
            for s in range(P):
                for t in range(T):
                    e = last_b[s] + ar[s][t] + opt
                    for d in range(D):
                        end[(s * D + d) * T + t] = e
        if keep_steps:
            res.step_ns.append([b - a for a, b in zip(start, end)])
        if sink is not None:
            if ep_on:
                sink(Iteration(it, start, end, factor, stall, ops, last_b, ar, xfer, netf, jit, sync, send_wait,
                               calls, a2a, a2ag, ear))
            else:
                sink(Iteration(it, start, end, factor, stall, ops, last_b, ar, xfer, netf, jit, sync, send_wait))
        res.iterations_done = it + 1
    res.end_ns = max(end) if end else 0.0
    return res


def _moe_op(st: list[float], seg: list[list[float]], a2ag: list[float], blocks: list[tuple[int, int]], E: int,
            n_a2a: int, calls: list) -> list[float]:
    """One forward/backward op with all-to-alls over DP replicas: compute segment i, then all-to-all i, which
    completes for every member of EP group e at its last member's arrival + the group's all-to-all time.
    Appends this op's [(seg_start[d], last_arrival[e]), ...] to calls; returns the op's end per replica."""
    x = st
    rec = []
    for i in range(n_a2a):
        arr = [a + b for a, b in zip(x, seg[i])]
        amax = [max(arr[lo:hi]) for lo, hi in blocks]
        rec.append((x, amax))
        x = [v for a, g in zip(amax, a2ag) for v in (a + g,) * E]
    calls.append(rec)
    return [a + b for a, b in zip(x, seg[n_a2a])]
