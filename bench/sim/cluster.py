"""A shared cluster as switch mirroring sees it: 19 independent DP x PP x TP (x EP) jobs of 8 to 1,024 GPUs on
one 2,880-GPU fabric, their inter-node flows merged into one stream with no job boundaries (the input of a
black-box flow diagnosis such as LLMPrism), plus the truth to score one against.

Layout. The cluster is CLUSTER = Topology(2,880 GPUs, 8 per node, 4 nodes per leaf, 4 spines): 360 nodes,
90 leaves. A job (ClusterJob: name, ModelConfig, first cluster node) is simulated on its own Topology (the same
4 nodes per leaf and 4 spines) and sits at a leaf boundary on whole nodes, so its ids map onto the cluster by
offsets: local node i -> cluster node first + i, `leafK` -> `leaf{K + first // 4}`, `spineK` -> `spineK`
(the job's own ECMP choice of spine is kept). A job with fewer GPUs per node (cfg.gpus_per_node = 4) uses
devices 0..3 of each of its nodes and leaves the others idle: local rank r -> cluster GPU
(first + r // gpus_per_node) * 8 + r % gpus_per_node, with that GPU's IP and NIC (`n<node>.nic<k>`).
`layout(seed)` fills the 90 leaves with the 19 SHAPES in a seeded order, each job with seeded step time
(~1-4 s), micro-batches, payloads and start offset (0-5 s after the cluster start), DDP buckets of 25 MiB.

Faults (ClusterFault) are given in cluster ids, times in seconds from the cluster start: slow_gpu (a cluster
GPU index), slow_link (`n12.nic3`), congested_switch (`leaf7`, `spine2`). Each becomes a local fault
(faults.parse_fault) of every job it touches (the job owning the GPU or NIC, every job with a node under the
leaf, every job spanning more than one leaf for a spine), over the job's iterations that overlap the fault's
window in a healthy run of that job.

truth.json (for scoring only: reading the flows never needs it):
  cluster  {topology, start_ns, window_s, jobs, gpus, flows}
  jobs     [{name, shape {dp, pp, tp, ep, gpus_per_node}, first_node, base_ns, config, gpus (cluster GPU per
            local rank), ips, nodes, pairs [{a, b, types}] (every unordered IP pair, a < b, with a flow in the
            window and the traffic it carried: "dp" a DP or expert ring, "pp" a pipeline send, "ep" an
            all-to-all), steps {ip: [[iteration, start_ns, end_ns], ...]} (every step overlapping the window),
            faults [{cluster_fault, spec, kind, target, start, end, value}] (local ids, iterations)}]
  faults   [{kind, target, start_s, end_s, value, jobs [{job, target, start, end, spec}]}]
Cost: a job is simulated in two passes (three when a fault touches it: its healthy iteration times first),
a cheap one that finds how many iterations cover the window, then one whose sink keeps the flows starting
inside it as numpy columns (~40 bytes a flow, never an object per flow or an Iteration per step). The seed-0
minute, 2,776 busy GPUs: ~2.1 M flows, ~2.3 s to simulate and ~5 s with the files (340 MB of flows.jsonl),
~290 MiB peak memory on this 2-core machine; `python -m steplens.sim.cluster` prints these for a run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import sys
import time
from array import array
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np

from .faults import DEFAULT_VALUE, parse_fault
from .model import Iteration, ModelConfig, nominal_step_ns, simulate
from .output import Rows
from .topology import Topology

CLUSTER = Topology(gpus=2880, gpus_per_node=8, nodes_per_leaf=4, spines=4)
CLUSTER_START_NS = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z, the simulator's default job start
MIB = 1 << 20

# (dp, pp, tp, ep, gpus_per_node) of layout()'s 19 jobs: ceil(nodes / 4) leaves each, 90 in all. Every GPU
# sends or receives across the network: with pp == 1 a node holds at most 2 replicas of a DP ring, and a
# stage-per-node job (8x4x1, 4x4x1) talks to its neighbour stages on other nodes.
SHAPES = [
    (16, 8, 8, 1, 8), (32, 2, 8, 1, 8), (8, 4, 8, 1, 8), (16, 2, 8, 4, 8), (4, 4, 8, 1, 8), (8, 2, 8, 2, 8),
    (6, 2, 8, 1, 8), (8, 1, 8, 1, 8), (4, 2, 8, 1, 8), (2, 4, 8, 1, 8), (4, 1, 8, 1, 8), (2, 2, 8, 1, 8),
    (8, 4, 1, 1, 8), (2, 1, 8, 1, 8), (4, 4, 1, 1, 4), (2, 2, 4, 1, 8), (2, 2, 2, 1, 4), (2, 1, 4, 1, 4),
    (3, 1, 8, 1, 8),
]
FAULT_KINDS = ("slow_gpu", "slow_link", "congested_switch")
TRAFFIC_TYPES = {"pp": "pp", "dp": "dp", "edp": "dp", "ep": "ep"}  # Rows.stage_flows kind -> truth type


@dataclass
class ClusterJob:
    """One job of the cluster: its config (simulated on its own topology) and its first cluster node."""

    name: str
    cfg: ModelConfig
    first_node: int

    @property
    def nodes(self) -> int:
        return self.cfg.topology().nodes

    @property
    def first_leaf(self) -> int:
        return self.first_node // CLUSTER.nodes_per_leaf

    @property
    def leaves(self) -> int:
        return math.ceil(self.nodes / CLUSTER.nodes_per_leaf)

    def gpu(self, r: int) -> int:
        """Cluster GPU index of local rank r."""
        gpn = self.cfg.gpus_per_node
        return (self.first_node + r // gpn) * CLUSTER.gpus_per_node + r % gpn

    def gpus(self) -> list[int]:
        return [self.gpu(r) for r in range(self.cfg.gpus)]

    def local_rank(self, gpu: int) -> int | None:
        """The local rank on cluster GPU `gpu`, None when the job does not use it."""
        node, dev = divmod(gpu, CLUSTER.gpus_per_node)
        r = (node - self.first_node) * self.cfg.gpus_per_node + dev
        if not 0 <= node - self.first_node < self.nodes or dev >= self.cfg.gpus_per_node or r >= self.cfg.gpus:
            return None
        return r

    def cluster_switch(self, sw: str) -> str:
        """Cluster id of the job's local switch id."""
        return f"leaf{int(sw[4:]) + self.first_leaf}" if sw.startswith("leaf") else sw

    def validate(self) -> None:
        cfg = self.cfg
        cfg.validate()
        if (cfg.nodes_per_leaf, cfg.spines) != (CLUSTER.nodes_per_leaf, CLUSTER.spines):
            raise ValueError(f"job {self.name}: nodes_per_leaf and spines must be the cluster's "
                             f"({CLUSTER.nodes_per_leaf}, {CLUSTER.spines}) for its ids to map by offsets")
        if cfg.gpus_per_node > CLUSTER.gpus_per_node:
            raise ValueError(f"job {self.name}: gpus_per_node {cfg.gpus_per_node} > the cluster's")
        if self.first_node % CLUSTER.nodes_per_leaf:
            raise ValueError(f"job {self.name}: first node {self.first_node} is not at a leaf boundary")
        if not 0 <= self.first_node or self.first_node + self.nodes > CLUSTER.nodes:
            raise ValueError(f"job {self.name}: nodes {self.first_node}..{self.first_node + self.nodes - 1} "
                             f"outside the cluster's {CLUSTER.nodes}")


@dataclass(frozen=True)
class ClusterFault:
    """A fault in cluster ids over [start_s, end_s) seconds from the cluster start (value as in faults.py).
    target: a cluster GPU index as a string (slow_gpu), a link id `n12.nic3` (slow_link), `leafK`/`spineK`."""

    kind: str
    target: str
    start_s: float
    end_s: float
    value: float

    def validate(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"cluster fault kind must be one of {', '.join(FAULT_KINDS)}, not {self.kind!r}")
        if not 0 <= self.start_s < self.end_s or self.value <= 0:
            raise ValueError(f"cluster fault {self}: need 0 <= start_s < end_s and value > 0")
        if self.kind == "slow_gpu":
            if not (self.target.isdigit() and int(self.target) < CLUSTER.gpus):
                raise ValueError(f"slow_gpu target must be a cluster GPU index 0..{CLUSTER.gpus - 1}")
        elif self.kind == "slow_link":
            CLUSTER.rank_of_link(self.target)
        elif self.target not in CLUSTER.switches():
            raise ValueError(f"congested_switch target {self.target!r} is not a cluster switch")

    def local_target(self, job: ClusterJob) -> str | None:
        """This fault's target in the job's local ids; None when the job has no part in it."""
        if self.kind in ("slow_gpu", "slow_link"):
            gpu = int(self.target) if self.kind == "slow_gpu" else CLUSTER.rank_of_link(self.target)
            r = job.local_rank(gpu)
            if r is None:
                return None
            return str(r) if self.kind == "slow_gpu" else job.cfg.topology().link_of(r)
        if self.target.startswith("leaf"):
            k = int(self.target[4:]) - job.first_leaf
            return f"leaf{k}" if 0 <= k < job.leaves else None
        return self.target if job.leaves > 1 else None  # a spine: only multi-leaf jobs cross one


def parse_cluster_fault(spec: str) -> ClusterFault:
    """`KIND:TARGET:START_S:END_S[:VALUE]`, times in seconds from the cluster start."""
    parts = spec.split(":")
    if not 4 <= len(parts) <= 5:
        raise ValueError(f"cluster fault {spec!r}: want KIND:TARGET:START_S:END_S[:VALUE]")
    try:
        value = float(parts[4]) if len(parts) == 5 else DEFAULT_VALUE.get(parts[0], 0.0)
        f = ClusterFault(parts[0], parts[1], float(parts[2]), float(parts[3]), value)
    except ValueError:
        raise ValueError(f"cluster fault {spec!r}: START_S, END_S and VALUE must be numbers") from None
    f.validate()
    return f


def layout(seed: int = 0) -> list[ClusterJob]:
    """The 19 jobs of SHAPES in a seeded placement order, filling the cluster's 90 leaves, each with seeded
    timing and payloads (see the module docstring)."""
    rng = random.Random(seed)
    order = SHAPES[:]
    rng.shuffle(order)
    jobs, node = [], 0
    for i, (dp, pp, tp, ep, gpn) in enumerate(order):
        m = rng.randint(4, 16)
        step_ms = rng.uniform(1000.0, 4000.0)
        tpc = 0.3 if tp > 1 else 0.0
        op_ms = (step_ms - 20.0) / (m + pp - 1) - 2 * tpc  # forward + backward of one micro-batch
        moe = dict(ep=ep, layers_per_stage=4, moe_every=4) if ep > 1 else {}  # one MoE layer a stage
        cfg = ModelConfig(dp=dp, pp=pp, tp=tp, micro_batches=m, gpus_per_node=gpn, nodes_per_leaf=4, spines=4,
                          fwd_ms=op_ms / 3, bwd_ms=op_ms * 2 / 3, tp_collective_ms=tpc,
                          activation_bytes=rng.randint(2, 32) * MIB, grad_bytes=rng.randint(48, 384) * MIB,
                          dp_bucket_bytes=25 * MIB, jitter_cv=0.02, net_jitter_cv=0.02,
                          seed=rng.randrange(1 << 31), base_ns=CLUSTER_START_NS + rng.randrange(5 * 10**9), **moe)
        job = ClusterJob(f"job{i:02d}-{dp}x{pp}x{tp}" + (f"-ep{ep}" if ep > 1 else ""), cfg, node)
        node += job.leaves * CLUSTER.nodes_per_leaf
        if node > CLUSTER.nodes:
            raise ValueError(f"layout does not fit: job {job.name} ends past the cluster's {CLUSTER.leaves} leaves")
        jobs.append(job)
    return jobs


def check_jobs(jobs: list[ClusterJob]) -> None:
    """Each job valid and on its own nodes."""
    owner: dict[int, str] = {}
    for job in jobs:
        job.validate()
        for n in range(job.first_node, job.first_node + job.nodes):
            if n in owner:
                raise ValueError(f"jobs {owner[n]} and {job.name} share node {n}")
            owner[n] = job.name
    if len({j.name for j in jobs}) != len(jobs):
        raise ValueError("job names must be unique")


def _bounds(cfg: ModelConfig, faults: list, until_ns: float) -> list[tuple[float, float]]:
    """(first rank's start, last rank's end) of each iteration, job ns, for enough iterations that the last
    starts at or after until_ns (so every later flow would start after it)."""
    n = max(1, math.ceil(until_ns / nominal_step_ns(cfg))) + 2
    while True:
        out: list[tuple[float, float]] = []
        simulate(replace(cfg, iterations=n), faults, sink=lambda it: out.append((min(it.start), max(it.end))))
        if out[-1][0] >= until_ns:
            return out
        n *= 2


class _JobSink:
    """Keeps a job's flows that start inside [lo_ns, hi_ns) as columns (local ranks, local path ids), the
    pairs they join per traffic kind, and each rank's steps that overlap the window."""

    def __init__(self, cfg: ModelConfig, lo_ns: int, hi_ns: int) -> None:
        self.cfg, self.lo, self.hi = cfg, lo_ns, hi_ns
        self.rows = Rows(cfg)
        self.start, self.nbytes = array("q"), array("q")
        self.src, self.dst, self.path = array("i"), array("i"), array("i")
        self.dur = array("d")
        self.paths: dict[tuple[str, ...], int] = {}
        self.pairs: dict[str, set[tuple[int, int]]] = {k: set() for k in TRAFFIC_TYPES}
        self.steps: list[list[tuple[int, int, int]]] = [[] for _ in range(cfg.gpus)]

    def __call__(self, it: Iteration) -> None:
        base, lo, hi = self.cfg.base_ns, self.lo, self.hi
        for r, (a, b) in enumerate(zip(it.start, it.end)):
            a_ns, b_ns = base + round(a), base + round(b)
            if b_ns > lo and a_ns < hi:
                self.steps[r].append((it.it, a_ns, b_ns))
        if base + min(it.start) >= hi:  # every flow of this step starts after the window
            return
        start, src, dst, nbytes, dur, pcol = self.start, self.src, self.dst, self.nbytes, self.dur, self.path
        paths = self.paths
        for s in range(self.cfg.pp):
            for kind, flows in self.rows.stage_flows(it, s):
                pairs = self.pairs[kind]
                for st, a, b, nb, d, path in flows:
                    if lo <= st < hi:
                        pid = paths.get(path)
                        if pid is None:
                            pid = paths[path] = len(paths)
                        start.append(st)
                        src.append(a)
                        dst.append(b)
                        nbytes.append(nb)
                        dur.append(d)
                        pcol.append(pid)
                        pairs.add((a, b))


class ClusterRun:
    """The outcome of simulate_cluster: the merged flows, sorted by start, and the truth."""

    def __init__(self, window_s: float, cols: dict[str, np.ndarray], paths: list[tuple[str, ...]], jobs: list[dict],
                 faults: list[dict]) -> None:
        self.window_s = window_s
        self.cols = cols                  # start, src, dst (cluster GPUs), bytes, duration, path (index in paths)
        self.paths = paths
        self._jobs, self._faults = jobs, faults

    def __len__(self) -> int:
        return len(self.cols["start"])

    def _chunks(self, size: int = 100_000) -> Iterator[tuple[list, ...]]:
        c = self.cols
        for i in range(0, len(self), size):
            yield tuple(c[k][i:i + size].tolist() for k in ("start", "src", "dst", "bytes", "duration", "path"))

    def flows(self) -> Iterator[dict]:
        """Flow dicts for `steplens import flows`, in start order: start (ns), src, dst, switches, bytes,
        duration (s)."""
        ip, paths = CLUSTER.ip, self.paths
        for chunk in self._chunks():
            for st, a, b, nb, d, p in zip(*chunk):
                yield {"start": st, "src": ip(a), "dst": ip(b), "switches": list(paths[p]), "bytes": nb,
                       "duration": d}

    def write_flows(self, path: str) -> int:
        """flows() as JSON lines, sorted by start; returns the number written."""
        ips = [CLUSTER.ip(g) for g in range(CLUSTER.gpus)]
        sw = [json.dumps(list(p)) for p in self.paths]
        with open(path, "w", encoding="utf-8", buffering=1 << 20) as fh:
            w = fh.write
            for chunk in self._chunks():
                w("".join(f'{{"start": {st}, "src": "{ips[a]}", "dst": "{ips[b]}", "switches": {sw[p]}, '
                          f'"bytes": {nb}, "duration": {d!r}}}\n' for st, a, b, nb, d, p in zip(*chunk)))
        return len(self)

    def topology_file(self) -> dict:
        return CLUSTER.topology_file()

    def write_topology(self, path: str) -> str:
        return CLUSTER.write_topology_file(path)

    def truth(self) -> dict:
        return {"cluster": {"topology": CLUSTER.to_json(), "start_ns": CLUSTER_START_NS, "window_s": self.window_s,
                            "jobs": len(self._jobs), "gpus": sum(len(j["gpus"]) for j in self._jobs),
                            "flows": len(self)},
                "jobs": self._jobs, "faults": self._faults}


def simulate_cluster(jobs: list[ClusterJob], faults=(), window_s: float = 60.0) -> ClusterRun:
    """Simulate every job over [cluster start, + window_s) with the cluster faults mapped onto it; keep the
    flows starting inside that window."""
    if not jobs:
        raise ValueError("no jobs to simulate")
    check_jobs(jobs)
    for f in faults:
        f.validate()
    if window_s <= 0:
        raise ValueError("window_s must be > 0")
    lo, hi = CLUSTER_START_NS, CLUSTER_START_NS + round(window_s * 1e9)
    fault_truth = [{"kind": f.kind, "target": f.target, "start_s": f.start_s, "end_s": f.end_s, "value": f.value,
                    "jobs": []} for f in faults]
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("start", "src", "dst", "bytes", "duration", "path")}
    paths: dict[tuple[str, ...], int] = {}
    job_truth = []
    for job in jobs:
        cfg = job.cfg
        until = hi - cfg.base_ns
        local, specs = [], []
        mapped = [(i, f, f.local_target(job)) for i, f in enumerate(faults)]
        mapped = [m for m in mapped if m[2] is not None]
        if mapped:  # the faults' windows in this job's iterations, from its healthy run
            off = lo - cfg.base_ns  # the cluster start in job ns (<= 0)
            healthy = _bounds(cfg, [], max(until, off + max(f.end_s for _, f, _ in mapped) * 1e9))
            for i, f, target in mapped:
                a = next((k for k, (_s, e) in enumerate(healthy) if e > off + f.start_s * 1e9), len(healthy))
                b = next((k for k, (s, _e) in enumerate(healthy) if s >= off + f.end_s * 1e9), len(healthy))
                if a >= b:  # the job runs none of its steps in the fault's window
                    continue
                spec = f"{f.kind}:{target}:{a}:{b}:{f.value!r}"
                local.append(parse_fault(spec, cfg.topology()))
                specs.append({"cluster_fault": i, "spec": spec, "kind": f.kind, "target": target, "start": a,
                              "end": b, "value": f.value})
                fault_truth[i]["jobs"].append({"job": job.name, "target": target, "start": a, "end": b,
                                               "spec": spec})
        cfg = replace(cfg, iterations=len(_bounds(cfg, local, until)))
        sink = _JobSink(cfg, lo, hi)
        simulate(cfg, local, sink=sink)
        gmap = np.array(job.gpus(), dtype=np.int32)
        pmap = np.array([paths.setdefault(tuple(job.cluster_switch(s) for s in p), len(paths))
                         for p in sink.paths], dtype=np.int32)
        cols["start"].append(np.frombuffer(sink.start, dtype=np.int64))
        cols["src"].append(gmap[np.frombuffer(sink.src, dtype=np.int32)])
        cols["dst"].append(gmap[np.frombuffer(sink.dst, dtype=np.int32)])
        cols["bytes"].append(np.frombuffer(sink.nbytes, dtype=np.int64))
        cols["duration"].append(np.frombuffer(sink.dur, dtype=np.float64))
        cols["path"].append(pmap[np.frombuffer(sink.path, dtype=np.int32)])
        job_truth.append(_job_truth(job, sink, specs))
    merged = {k: np.concatenate(v) for k, v in cols.items()}
    order = np.argsort(merged["start"], kind="stable")
    merged = {k: v[order] for k, v in merged.items()}
    return ClusterRun(window_s, merged, list(paths), job_truth, fault_truth)


def _job_truth(job: ClusterJob, sink: _JobSink, faults: list[dict]) -> dict:
    cfg, gpus = sink.cfg, job.gpus()  # the config as run (its iterations)
    ips = [CLUSTER.ip(g) for g in gpus]
    types: dict[tuple[str, str], set[str]] = {}
    for kind, pairs in sink.pairs.items():
        for a, b in pairs:
            key = tuple(sorted((ips[a], ips[b])))
            types.setdefault(key, set()).add(TRAFFIC_TYPES[kind])
    return {"name": job.name,
            "shape": {"dp": cfg.dp, "pp": cfg.pp, "tp": cfg.tp, "ep": cfg.ep, "gpus_per_node": cfg.gpus_per_node},
            "first_node": job.first_node, "base_ns": cfg.base_ns, "config": cfg.to_json(),
            "gpus": gpus, "ips": ips, "nodes": list(range(job.first_node, job.first_node + job.nodes)),
            "pairs": [{"a": a, "b": b, "types": sorted(t)} for (a, b), t in sorted(types.items())],
            "steps": {ip: [list(x) for x in steps] for ip, steps in zip(ips, sink.steps)},
            "faults": faults}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m steplens.sim.cluster",
                                 description="Simulate the 19-job 2,880-GPU cluster: flows, topology and truth files.")
    ap.add_argument("--out", required=True, help="directory for flows.jsonl, topology.json and truth.json")
    ap.add_argument("--seed", type=int, default=0, help="layout seed: job order, timings, payloads, start offsets")
    ap.add_argument("--window", type=float, default=60.0, help="seconds of cluster time to emit flows for")
    ap.add_argument("--fault", action="append", default=[], metavar="KIND:TARGET:START_S:END_S[:VALUE]",
                    help=f"KIND one of {', '.join(FAULT_KINDS)}; TARGET a cluster GPU, link (n12.nic3) or switch")
    args = ap.parse_args(argv)
    try:
        faults = [parse_cluster_fault(s) for s in args.fault]
        t0 = time.perf_counter()
        run = simulate_cluster(layout(args.seed), faults, args.window)
        sim_s = time.perf_counter() - t0
        os.makedirs(args.out, exist_ok=True)
        run.write_flows(os.path.join(args.out, "flows.jsonl"))
        run.write_topology(os.path.join(args.out, "topology.json"))
        truth = run.truth()
        with open(os.path.join(args.out, "truth.json"), "w", encoding="utf-8") as fh:
            json.dump(truth, fh)
    except (ValueError, OSError) as exc:
        print(f"steplens.sim.cluster: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"out": args.out, "jobs": truth["cluster"]["jobs"], "gpus": truth["cluster"]["gpus"],
                      "flows": len(run), "simulate_seconds": round(sim_s, 2),
                      "seconds": round(time.perf_counter() - t0, 2),
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
