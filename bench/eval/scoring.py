"""Scores the registered detectors on simulated jobs fed through a real SQLite store by the real writer.

Per scenario: the simulator's agent view (bench/sim/agentview.py `agent_records`: what real agents would send)
is encoded as agents encode (agent/transport/codec.py) and handed to the collector's StoreWriter as ingest
hands it batches (decode, clock conversion, insert); the simulator's topology file is imported as
`steplens import topology` stores it. Only the ProcessInfo, Step, CommProgress and Event records and the NICs'
port Metrics are written (what the detectors read; the GPU telemetry, Flows and CommSummaries are skipped to keep
the evaluation fast). The detectors then
run on the store only: ground truth (`output.truth(res)`) is read by the scorer, never by a detector.

Detection latency: each detector runs on windows ending at onset + 5, 10, 20, 40 iterations and at the end
of the job (what the analysis loop would do as data arrives); the first window with a finding that names the
fault's target gives the iterations from onset to finding.
Scoring per fault: detected when a finding with onset at or after (fault start - 2 iterations) exists in the
final window's output or an earlier window's; top-1 / top-3 when the target (rank, NIC link id, or switch id) is
the first / among the first three suspects of any finding about it. A healthy run counts each finding as a
false positive. Precision = true findings / all findings (a finding is true when it overlaps a fault's
iterations); recall = detected faults / faults.
Hang faults are not scored here (EXCLUDED_KINDS: a hang is the hang detector's, another issue item); a finding
during one still counts as a true finding. Each fault's impact (fault_impact: its job step time at its worst
iteration against the 20 before, the fault simulated alone) is reported: many network faults of the random set
barely move the step time (communication overlaps compute), so the figures are given over all faults and over
the visible ones (impact >= VISIBLE_IMPACT, the gate's delta).
"""

from __future__ import annotations

import os
import random
import tempfile
import time

from steplens.agent.records import CommProgress, Event, Metric, ProcessInfo, Step
from steplens.agent.transport.codec import encode_records
from steplens.collector.analysis import all_specs
from steplens.collector.analysis.base import Window, no_gc
from steplens.collector.analysis.engine import AnalysisReader
from steplens.collector.ingest.clock import ClockEstimate
from steplens.collector.store import diagnosis as dstore
from steplens.collector.store.queries import Reader
from steplens.collector.store.writer import BatchJob, StoreJob, StoreWriter
from steplens.collector.topology import from_dict
from steplens.sim import agentview
from steplens.sim.faults import parse_fault
from steplens.sim.model import ModelConfig, simulate
from steplens.sim.output import truth

MONO_BASE = 10**12
EXCLUDED_KINDS = ("hang",)   # another detector's (issue 13: hang detection); its findings still count as true
VISIBLE_IMPACT = 1.1         # a fault whose job step time never reaches delta x before it is invisible to the gate
JOB = "simjob"
SOURCES = {Step: "flightrec", ProcessInfo: "procs", CommProgress: "flightrec", Event: "procs", Metric: "host"}
PORT_METRICS = "ib_port_"   # the only Metrics kept: the NICs' port figures (the sim's GPU telemetry is skipped)


class StoreFeed:
    """Agent records into the store at path through StoreWriter, batched per agent as ingest hands batches over
    (agent encoding, decode, clock conversion, insert); add() as records come, flush() + wait() to have every
    record added so far stored (healthy.py analyses the store between them, as the analysis loop sees it)."""

    def __init__(self, cfg: ModelConfig, path: str, batch: int = 2000, writer=None, sources=None) -> None:
        self.clock = ClockEstimate(cfg.base_ns - MONO_BASE, 0.0, 0, 1, 1, 5)
        self.batch = batch
        self.sources = SOURCES if sources is None else sources   # record type -> source name; others skipped
        self.writer = writer or StoreWriter(path)   # writer: another store's (tests/test_store_clickhouse.py)
        self.writer.start()
        self.outcomes: list[list] = []
        self.bufs: dict[str, list] = {}
        self.seqs: dict[str, int] = {}

    def _submit(self, job) -> None:
        while not self.writer.submit(job):
            time.sleep(0.005)

    def _flush(self, aid: str) -> None:
        recs = self.bufs.pop(aid)
        self.seqs[aid] = self.seqs.get(aid, 0) + 1
        got: list = []
        self.outcomes.append(got)
        self._submit(BatchJob(aid, "5e" * 8, self.seqs[aid], len(recs), encode_records(recs),
                              max(r.mono_ns for _, r in recs) + 1, self.clock, 0,
                              lambda *a, got=got: got.append(a)))

    def add(self, aid: str, rec) -> None:
        """One record of agent aid (only the kinds in SOURCES are kept)."""
        src = self.sources.get(type(rec))
        if src is None or (type(rec) is Metric and not rec.name.startswith(PORT_METRICS)):
            return
        lst = self.bufs.setdefault(aid, [])
        lst.append((src, rec))
        if len(lst) >= self.batch:
            self._flush(aid)

    def flush(self) -> None:
        for aid in list(self.bufs):
            self._flush(aid)

    def topology(self, cfg: ModelConfig) -> None:
        """The simulator's topology file, stored as `steplens import topology` stores it."""
        topo = from_dict(cfg.topology().topology_file())
        got: list = []
        self.outcomes.append(got)
        self._submit(StoreJob(lambda c: dstore.write_topology(c, topo, "sim", 0), lambda *a: got.append(a)))

    def wait(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.outcomes) and time.monotonic() < deadline:
            time.sleep(0.005)

    def check(self) -> None:
        bad = [o for o in self.outcomes if not o or o[0][0] != "stored"]
        if bad:
            raise RuntimeError(f"{len(bad)} batches not stored: {bad[:2]}")

    def close(self) -> None:
        self.writer.stop()


def feed(cfg: ModelConfig, faults, path: str, batch: int = 2000) -> Reader:
    """Write the job's agent records into a new store at path through StoreWriter; returns its Reader."""
    sf = StoreFeed(cfg, path, batch)
    try:
        for aid, rec in agentview.agent_records(cfg, faults, JOB, MONO_BASE):
            sf.add(aid, rec)
        sf.flush()
        sf.topology(cfg)
        sf.wait()
    finally:
        sf.close()
    sf.check()
    return Reader(path)


def fault_impact(cfg: ModelConfig, fault) -> float:
    """The fault's own effect on the job (ground truth, scorer only): the job's step time (max over ranks) at
    its worst iteration within the fault against the median of the 20 before it, simulating that fault alone
    (a concurrent fault's effect is not lent to it)."""
    steps = simulate(cfg, [fault], keep_steps=True).step_ns
    x = [max(row) for row in steps]
    before = sorted(x[max(0, fault.start - 20):fault.start])
    during = x[fault.start:min(len(x), fault.end + 1)]
    return round(max(during) / before[len(before) // 2], 3) if before and during else 1.0


def target_ids(t: dict) -> set[str]:
    """Suspect ids that name a fault's target."""
    if t["resource"] == "rank":
        return {str(t["ranks"][0])}
    if t["resource"] == "link":
        return set(t["links"])
    return set(t["switches"])


def sim_fetcher(cfg: ModelConfig, faults):
    """FetchDetail as the emulated agents answer it (agentview.commops: the node-local CommOps of the asked
    ranks), with the clock conversion ingest applies (cluster = mono + base_ns - MONO_BASE)."""
    off = cfg.base_ns - MONO_BASE
    kept: list = []  # the job's iterations, simulated once at the first fetch (agents answer from a store)
    keep: dict = {}  # and its network model and communicators

    def fetch(job_key: str, ranks: list[int], since_ns: int, until_ns: int, limit: int = 0) -> list[dict]:
        if not kept:
            simulate(cfg, faults, sink=kept.append)
        ops = agentview.commops(cfg, faults, list(ranks), since_ns - off, until_ns - off, MONO_BASE, job_key=job_key,
                                iterations=kept, keep=keep)
        rows = [{"kind": "commop", "rank": o.rank, "comm_id": o.comm_id, "op": o.op, "seq": o.seq,
                 "p2p_seq": o.p2p_seq, "peer": o.peer, "members": o.members, "nranks": o.nranks, "bytes": o.bytes,
                 "issue_ns": o.issue_mono_ns + off, "start_ns": o.start_mono_ns + off, "end_ns": o.end_mono_ns + off}
                for o in ops]
        return rows[:limit] if limit else rows
    return fetch


def run_detectors(reader, until_ns: int, since_ns: int = 0, own_window: bool = False) -> tuple[list, float]:
    """Every registered detector with its default config on the window [since_ns, until_ns]; own_window: each
    from its config's window_seconds before until_ns instead, as the analysis loop hands it (engine.run_job).
    Returns ([(detector name, finding)], seconds)."""
    t0 = time.perf_counter()
    out = []
    with no_gc():  # as the engine runs them (engine.run_job)
        for name, spec in all_specs().items():
            cfg = spec.config_class()
            since = max(0, until_ns - int(cfg.window_seconds * 1e9)) if own_window else since_ns
            for f in spec.detect(reader, Window(JOB, since, until_ns), cfg) or []:
                out.append((name, f))
    return out, time.perf_counter() - t0


def evaluate(name: str, cfg: ModelConfig, specs: list[str], tmpdir: str) -> dict:
    topo = cfg.topology()
    faults = [parse_fault(s, topo) for s in specs]
    res = simulate(cfg, faults, keep_steps=False)
    tr = truth(res)["faults"]
    path = os.path.join(tmpdir, f"{name}.db")
    t0 = time.perf_counter()
    reader = feed(cfg, faults, path)
    feed_s = time.perf_counter() - t0
    steps = {r["step"]: r for r in reader.steps(JOB, ranks=[0])}
    end_of = {s: r["end_ns"] for s, r in steps.items()}
    last_step = max(end_of) if end_of else 0
    checks = sorted({min(last_step, f.start + k) for f in faults for k in (5, 10, 20, 40)} | {last_step})
    seen: dict[int, list] = {}
    wall = []
    fetched: set[int] = set()
    for c in checks:
        ar = AnalysisReader(reader, sim_fetcher(cfg, faults))
        found, sec = run_detectors(ar, end_of.get(c, 0) + 1)
        fetched |= ar.ranks_fetched
        wall.append(sec)
        seen[c] = found
    final = seen[last_step]

    def step_of(ns: int) -> int:
        best = 0
        for s, e in end_of.items():
            if e <= ns:
                best = max(best, s)
        return best + 1
    faults_out = []
    for t in tr:
        if t["kind"] in EXCLUDED_KINDS:
            continue
        ids = target_ids(t)
        hit1 = hit3 = detected = map1 = cog1 = cog_seen = False
        latency = None
        for c in checks:
            for _, f in seen[c]:
                onset = step_of(f.onset_ns)
                if onset < t["start"] - 2 or (t["kind"] != "degradation" and onset > t["end"] + 2):
                    continue
                detected = True
                top = [s.id for s in f.suspects]
                if top[:1] and top[0] in ids:
                    hit1 = True
                mp = f.evidence.get("map") or []
                if mp and mp[0][1] in ids:
                    map1 = True
                cg = (f.evidence.get("cog") or {}).get("causes") or []
                if cg:
                    cog_seen = True
                    cog1 = cog1 or cg[0][1] in ids
                if ids & set(top[:3]):
                    hit3 = True
                    if latency is None:
                        latency = max(0, c - t["start"])
        impact = fault_impact(cfg, next(f for f in faults if f.target == t["target"] and f.start == t["start"]))
        faults_out.append({"kind": t["kind"], "target": t["target"], "value": t["value"], "start": t["start"],
                           "end": t["end"], "detected": detected, "top1": hit1, "top3": hit3, "map_top1": map1,
                           "cog_top1": cog1, "cog_searched": cog_seen, "iterations_to_finding": latency,
                           "impact": impact})
    fault_spans = [(t["start"] - 2, (t["end"] if t["kind"] != "degradation" else 10**9) + 2) for t in tr]
    true_f = false_f = 0
    for _, f in final:
        onset = step_of(f.onset_ns)
        if any(a <= onset <= b for a, b in fault_spans):
            true_f += 1
        else:
            false_f += 1
    os.remove(path)
    for ext in ("-wal", "-shm"):
        if os.path.exists(path + ext):
            os.remove(path + ext)
    return {"scenario": name, "gpus": cfg.gpus, "shape": f"DP{cfg.dp}xPP{cfg.pp}xTP{cfg.tp}", "faults": faults_out,
            "excluded": [t["kind"] for t in tr if t["kind"] in EXCLUDED_KINDS],
            "findings": [{"kind": f.kind, "severity": f.severity, "top": [s.id for s in f.suspects[:3]],
                          "onset_step": step_of(f.onset_ns)} for _, f in final],
            "true_findings": true_f, "false_findings": false_f, "feed_seconds": round(feed_s, 3),
            "ranks_fetched": len(fetched),
            "analysis_seconds": round(max(wall), 3), "analysis_seconds_total": round(sum(wall), 3)}


SHAPES = [  # (dp, pp, tp) at 64..512 GPUs, 8 GPUs a node
    (8, 4, 2), (4, 2, 8), (16, 2, 2), (8, 2, 4), (4, 4, 4), (16, 4, 2), (8, 8, 2), (32, 2, 2), (16, 4, 4),
    (8, 4, 8), (16, 8, 2), (32, 4, 2), (64, 2, 2), (16, 4, 8),
]
RANDOM_KINDS = ("slow_gpu", "slow_link", "congested_switch", "fluctuation", "degradation")


def random_scenario(rng: random.Random, iterations: int, healthy_share: float = 0.15) -> tuple[ModelConfig, list[str]]:
    dp, pp, tp = rng.choice(SHAPES)
    cfg = ModelConfig(dp=dp, pp=pp, tp=tp, micro_batches=8, iterations=iterations, gpus_per_node=8,
                      nodes_per_leaf=rng.choice((2, 4)), spines=rng.choice((2, 4)), seed=rng.randrange(1 << 30))
    # transfers jitter like a real fabric's (1-4 % per transfer and iteration), drawn from the job's own seed so
    # the scenario sequence of a --random-seed is what it was before the jitter existed
    cfg.net_jitter_cv = round(random.Random(cfg.seed).uniform(0.01, 0.04), 4)
    topo = cfg.topology()
    if rng.random() < healthy_share:
        return cfg, []
    specs = []
    n = 1 + (rng.random() < 0.3) + (rng.random() < 0.1)  # 1 fault, sometimes 2-3 (0-2 concurrent)
    used: set[str] = set()
    for _ in range(n):
        kind = rng.choice(RANDOM_KINDS)
        if kind == "congested_switch" and topo.leaves < 2:
            kind = "slow_link"
        mag = round(rng.choice((rng.uniform(1.05, 1.5), rng.uniform(1.5, 3.0))), 2)
        start = rng.randrange(20, max(21, iterations // 2))
        end = min(iterations, start + rng.randrange(10, 40))
        if kind in ("slow_gpu", "degradation") or (kind == "fluctuation" and rng.random() < 0.5):
            target = str(rng.randrange(cfg.gpus))
        elif kind == "fluctuation" or kind == "slow_link":
            target = topo.link_of(rng.randrange(cfg.gpus))
        else:
            target = f"leaf{rng.randrange(topo.leaves)}"
        if target in used:
            continue
        used.add(target)
        if kind == "fluctuation":
            specs.append(f"{kind}:{target}:{start}:{end}:{mag}:{rng.randrange(4, 13)}")
        else:
            specs.append(f"{kind}:{target}:{start}:{end}:{mag}")
    return cfg, specs


def headline(rows: list[dict]) -> dict:
    """Precision (true / all findings), recall, F1, top-1 and top-3 over scenario rows that carry `faults`
    (each with detected/top1/top3), `true_findings` and `false_findings` (scale.py, wholepath.py)."""
    faults = [f for r in rows for f in r["faults"]]
    tp = sum(r["true_findings"] for r in rows)
    fp = sum(r["false_findings"] for r in rows)
    prec = tp / (tp + fp) if tp + fp else 1.0
    rec = sum(f["detected"] for f in faults) / len(faults) if faults else 1.0
    frac = (lambda k: round(sum(f[k] for f in faults) / len(faults), 3) if faults else None)
    return {"scenarios": len(rows), "faults": len(faults), "precision": round(prec, 3), "recall": round(rec, 3),
            "f1": round(2 * prec * rec / (prec + rec), 3) if prec + rec else 0.0,
            "top1_fraction": frac("top1"), "top3_fraction": frac("top3")}


def _rates(faults: list[dict]) -> dict:
    n = len(faults)
    return {"faults": n, "recall": round(sum(f["detected"] for f in faults) / n, 3) if n else None,
            "top1": round(sum(f["top1"] for f in faults) / n, 3) if n else None,
            "top3": round(sum(f["top3"] for f in faults) / n, 3) if n else None}


def _cog(faults: list[dict]) -> dict:
    """The operator-graph walk's first cause (irregularity evidence `cog`) against the target, over the faults
    on a rank (GPU) it walked for: its causes name ranks or communicators, not NICs or switches."""
    gpu = [f for f in faults if f.get("cog_searched") and f["target"].isdigit()]
    return {"cog_top1_of_gpu_faults_walked": round(sum(f["cog_top1"] for f in gpu) / len(gpu), 3) if gpu else None,
            "cog_gpu_faults_walked": len(gpu)}


def summarize(rows: list[dict]) -> dict:
    faults = [f for r in rows for f in r["faults"]]
    visible = [f for f in faults if f["impact"] >= VISIBLE_IMPACT]
    tp = sum(r["true_findings"] for r in rows)
    fp = sum(r["false_findings"] for r in rows)
    det = sum(f["detected"] for f in faults)
    prec = tp / (tp + fp) if tp + fp else 1.0
    rec = det / len(faults) if faults else 1.0
    f1 = 2 * prec * rec / (prec + rec) if prec + rec else 0.0
    found = [f for f in faults if f["detected"]]
    lat = sorted(f["iterations_to_finding"] for f in faults if f["iterations_to_finding"] is not None)
    kinds = {}
    for k in sorted({f["kind"] for f in faults}):
        fs = [f for f in faults if f["kind"] == k]
        kinds[k] = {"faults": len(fs), "recall": round(sum(f["detected"] for f in fs) / len(fs), 3),
                    "top1": round(sum(f["top1"] for f in fs) / len(fs), 3),
                    "top3": round(sum(f["top3"] for f in fs) / len(fs), 3)}
    healthy = [r for r in rows if not r["faults"] and not r.get("excluded")]
    return {"scenarios": len(rows), "faults": len(faults), "precision": round(prec, 3), "recall": round(rec, 3),
            "f1": round(f1, 3),
            "top1_of_faults": round(sum(f["top1"] for f in faults) / len(faults), 3) if faults else None,
            "top3_of_faults": round(sum(f["top3"] for f in faults) / len(faults), 3) if faults else None,
            "top1_of_detected": round(sum(f["top1"] for f in found) / len(found), 3) if found else None,
            "map_top1_of_faults": round(sum(f.get("map_top1", False) for f in faults) / len(faults), 3)
            if faults else None,
            **_cog(faults),
            "median_iterations_to_finding": lat[len(lat) // 2] if lat else None,
            "healthy_runs": len(healthy), "healthy_findings": sum(r["false_findings"] for r in healthy),
            "max_analysis_seconds": max((r["analysis_seconds"] for r in rows), default=0.0),
            "per_kind": kinds, "visible": {"min_impact": VISIBLE_IMPACT, **_rates(visible),
                                           "per_kind": {k: _rates([f for f in visible if f["kind"] == k])
                                                        for k in sorted({f["kind"] for f in visible})}},
            "excluded_faults": sum(len(r.get("excluded", [])) for r in rows), "excluded_kinds": list(EXCLUDED_KINDS)}


def tmpdir() -> str:
    return tempfile.mkdtemp(prefix="steplens-eval-")
