"""The 8,192-GPU evaluation (issue 13): random faults on 8,192-GPU jobs, simulate + detect end to end.

Per scenario: the simulator's agent view (agentview.agent_records: ProcessInfo and Step records, what real agents
send; no simulator-only field) is held in memory by MemReader, which answers the store reads the detectors make
(steps, and steps_after, the analysis loop's incremental read, over the rows stored by each pass's time; jobs,
topology) as the SQLite store would, rows in the same form, clock-converted as ingest converts them;
FetchDetail is answered by the emulated agents (scoring.sim_fetcher: the job simulated once at the first request,
its network model and communicators kept, each request walking the asked ranks' ops only, as an agent answers
from its node-local store), so progressive fetching counts the ranks a search really asked. The rows are built
with the cyclic GC off and frozen after: they stand for the store, not for objects in the collector's heap.
Writing 819k Step rows per scenario through SQLite would measure the store, not the detectors (the issue allows
feeding the detector code from the simulator's records directly at this scale; bench/eval/run.py scores the
smaller jobs through a real store, and bench/eval/wholepath.py through the whole stream -> collector path).
Ground truth (output.truth) is read by the scorer only.

Scored as scoring.py scores: detected when a finding's onset is at or after the fault start - 2 iterations;
top-1 / top-3 when the target is the first / among the first three suspects of any finding about it; healthy
runs count false positives. The detectors run as the analysis loop runs them: a pass every --every steps as data
arrives, with the engine's per-job memo kept across passes (irregularity.per_step: a step's per-step results
are computed once); findings are scored on the passes ending at onset + 5 and + 10 iterations and at the end.
Reported per scenario: simulate + records (s), localization = the slowest pass (s, all detectors; the emulated
agents' fetch time apart), one pass over the whole window from cold (no memo: what `steplens diagnose` on a job
the loop never saw costs), ranks fetched, the end-to-end wall time.

    .venv/bin/python bench/eval/scale.py [--scenarios 20] [--seed 3000] [--iterations 60] [--every 5]

Ends with one JSON line: top1_fraction, top3_fraction, recall, precision, f1, max_analysis_s (localization: the
detectors' own time on the slowest pass), median/max_cold_analysis_s (one pass from cold), max_fetch_s (the
emulated agents answering FetchDetail: they re-run the 8,192-GPU simulation per request on this machine, where
real agents answer from their node-local stores, in parallel), median_end_to_end_s, ranks_fetched_max,
ranks_fetched_fraction_max.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import random
import statistics
import sys
import time

from steplens.agent.records import CommProgress, Event, ProcessInfo, Step
from steplens.collector.analysis.engine import AnalysisReader
from steplens.collector.topology import from_dict
from steplens.sim import agentview
from steplens.sim.faults import parse_fault
from steplens.sim.model import ModelConfig, simulate
from steplens.sim.output import truth

import scoring

SHAPES_8K = [(128, 8, 8), (256, 4, 8), (512, 8, 2), (256, 8, 4), (1024, 4, 2)]  # (dp, pp, tp) = 8,192 GPUs
KINDS = ("slow_gpu", "degradation", "slow_link", "congested_switch", "fluctuation")


class MemReader:
    """The store's read side for one job, in memory: steps(), jobs(), topology() as collector/store returns
    them (rows with node_id, cluster times, comms as dicts)."""

    def __init__(self, cfg: ModelConfig, faults, job: str = scoring.JOB, progress: bool = False,
                 hang_mode: str = "stopped") -> None:
        # the rows stand for the store (on disk in a collector, not in its heap): built with the cyclic GC off,
        # which would walk their millions of objects again and again as they are made (it doubles the time)
        was = gc.isenabled()
        gc.disable()
        try:
            self._load(cfg, faults, job, progress, hang_mode)
        finally:
            if was:
                gc.enable()

    def _load(self, cfg: ModelConfig, faults, job: str, progress: bool, hang_mode: str) -> None:
        off = cfg.base_ns - scoring.MONO_BASE
        self.job = job
        self.rows: list[dict] = []
        self.ranks: list[dict] = []
        self.progress: list[dict] = []   # CommProgress rows (progress=True), as Reader.comm_progress gives them
        self.events: list[dict] = []     # process-state Events, as Reader.process_events gives them
        kinds = frozenset({"process", "step"} | ({"progress"} if progress else set()))
        for aid, rec in agentview.agent_records(cfg, faults, job, scoring.MONO_BASE, kinds=kinds,
                                                hang_mode=hang_mode):
            if type(rec) is CommProgress:
                self.progress.append({"node_id": aid, "pid": rec.pid, "start_ticks": rec.start_ticks,
                                      "job_key": rec.job_key, "rank": rec.rank, "comm_id": rec.comm_id,
                                      "end_ns": rec.mono_ns + off, "last_enqueued": rec.last_enqueued,
                                      "last_started": rec.last_started, "last_completed": rec.last_completed,
                                      "pending_op": rec.pending_op, "pending_seq": rec.pending_seq,
                                      "pending_p2p": rec.pending_p2p, "pending_peer": rec.pending_peer,
                                      "pending_since_ns": rec.pending_since_mono_ns + off
                                      if rec.pending_since_mono_ns else 0, "nranks": rec.nranks})
            elif type(rec) is Event:
                pid, _, ticks = rec.entity.partition(":")
                self.events.append({"node_id": aid, "ts_ns": rec.mono_ns + off, "kind": rec.kind, "pid": int(pid),
                                    "start_ticks": int(ticks), "message": rec.message, "value": rec.value})
            elif type(rec) is Step:
                self.rows.append({"node_id": aid, "source": "flightrec", "pid": rec.pid, "job_key": rec.job_key,
                                  "rank": rec.rank, "step": rec.step, "start_ns": rec.start_mono_ns + off,
                                  "end_ns": rec.end_mono_ns + off, "evidence": rec.evidence,
                                  "period_ops": rec.period_ops, "ops": rec.ops,
                                  "comms": [{"comm_id": c.comm_id, "op": c.op, "calls": c.calls, "bytes": c.bytes,
                                             "busy_ns": c.busy_ns, "wait_ns": c.wait_ns, "seq_first": c.seq_first,
                                             "issue_offsets_ns": c.issue_offsets_ns,
                                             "offsets_dropped": c.offsets_dropped} for c in rec.comms]})
            elif type(rec) is ProcessInfo:
                self.ranks.append({"rank": rec.rank, "node_id": aid, "pid": rec.pid, "local_rank": rec.local_rank})
        self.rows.sort(key=lambda r: r["end_ns"])
        self._ends = [r["end_ns"] for r in self.rows]
        self.now: int | None = None   # the rows stored: those that ended by then (None: all)
        self._topo = from_dict(cfg.topology().topology_file())
        comms: dict[str, set] = {}  # members per communicator, as the store's jobs() answers them (indexed)
        for r in self.rows:
            for c in r["comms"]:
                comms.setdefault(c["comm_id"], set()).add(r["rank"])
        self._comms = [{"comm_id": c, "nranks": len(m), "ranks": sorted(m)} for c, m in sorted(comms.items())]

    def steps(self, job_key: str, ranks=None, since_ns: int = 0, limit: int = 200_000_000, with_comms: bool = False):
        want = set(ranks) if ranks else None
        return [r for r in self.rows[:self._stored()] if r["job_key"] == job_key and r["end_ns"] >= since_ns
                and (want is None or r["rank"] in want)][-limit:]

    def steps_after(self, job_key: str, after_rowid: int, since_ns: int = 0, limit: int = 2_000_000,
                    before_ns: int = 0, upto_rowid: int = 0) -> tuple[list[dict], int]:
        """Reader.steps_after (the analysis loop's incremental read): the rows stored after `after_rowid`, a row's
        rowid its place in end order (rows arrive as their steps end) counted from 1."""
        top = upto_rowid or self._stored()
        out = [r for r in self.rows[after_rowid:top] if r["job_key"] == job_key and r["end_ns"] >= since_ns
               and (not before_ns or r["end_ns"] < before_ns)][:limit]
        return out, max(top, after_rowid)

    def _stored(self) -> int:
        """How many rows are stored by `now` (a pass's cluster time, set by the loop that replays the job; None:
        all of them)."""
        return len(self.rows) if self.now is None else bisect.bisect_right(self._ends, self.now)

    def jobs(self, job_key: str = "") -> list[dict]:
        if job_key not in ("", self.job):
            return []
        return [{"job_key": self.job, "world_size": len(self.ranks), "ranks": self.ranks, "comms": self._comms}]

    def topology(self):
        return self._topo

    def comm_progress_latest(self, job_key: str, until_ns: int = 0) -> list[dict]:
        newest: dict[tuple, dict] = {}
        for p in self.progress:
            if p["job_key"] == job_key and (not until_ns or p["end_ns"] <= until_ns):
                k = (p["node_id"], p["pid"], p["comm_id"])
                if k not in newest or p["end_ns"] >= newest[k]["end_ns"]:
                    newest[k] = p
        return sorted(newest.values(), key=lambda p: p["end_ns"])

    def process_events(self, since_ns: int = 0, until_ns: int = 0, node_ids=None, kinds=None, limit: int = 100_000):
        want = set(node_ids) if node_ids else None
        return [e for e in self.events if e["ts_ns"] >= since_ns and (not until_ns or e["ts_ns"] <= until_ns)
                and (want is None or e["node_id"] in want) and (kinds is None or e["kind"] in kinds)][:limit]


def scenario(rng: random.Random, iterations: int, shapes=SHAPES_8K) -> tuple[ModelConfig, list[str]]:
    dp, pp, tp = rng.choice(shapes)
    cfg = ModelConfig(dp=dp, pp=pp, tp=tp, micro_batches=8, iterations=iterations, gpus_per_node=8,
                      nodes_per_leaf=rng.choice((4, 8)), spines=rng.choice((4, 8)), seed=rng.randrange(1 << 30))
    cfg.net_jitter_cv = round(random.Random(cfg.seed).uniform(0.01, 0.04), 4)  # as scoring.random_scenario
    topo = cfg.topology()
    kind = rng.choice(KINDS)
    mag = round(rng.choice((rng.uniform(1.05, 1.5), rng.uniform(1.5, 3.0))), 2)
    start = rng.randrange(20, max(21, iterations // 2))
    end = min(iterations, start + rng.randrange(10, 30))
    if kind in ("slow_gpu", "degradation") or (kind == "fluctuation" and rng.random() < 0.5):
        target = str(rng.randrange(cfg.gpus))
    elif kind in ("fluctuation", "slow_link"):
        target = topo.link_of(rng.randrange(cfg.gpus))
    else:
        target = f"leaf{rng.randrange(topo.leaves)}"
    spec = f"{kind}:{target}:{start}:{end}:{mag}" + (f":{rng.randrange(4, 13)}" if kind == "fluctuation" else "")
    return cfg, [spec]


def evaluate(cfg: ModelConfig, specs: list[str], every: int = 5) -> dict:
    t0 = time.perf_counter()
    faults = [parse_fault(s, cfg.topology()) for s in specs]
    reader = MemReader(cfg, faults)
    # the rows stand for the store (on disk in a collector, not in its heap): out of the cyclic GC's sight,
    # which would otherwise walk their millions of objects after each pass and bill that to the detectors
    gc.collect()
    gc.freeze()
    t_records = time.perf_counter() - t0
    ends = {r["step"]: r["end_ns"] for r in reader.rows if r["rank"] == 0}
    last = max(ends)
    checks = sorted({min(last, f.start + k) for f in faults for k in (5, 10)} | {last})
    passes = sorted(set(range(every, last + 1, every)) | set(checks))
    found, t_detect, t_analysis, t_fetch, fetched = [], 0.0, 0.0, 0.0, set()
    sim_fetch = scoring.sim_fetcher(cfg, faults)
    memo: dict = {}  # the engine's per-job memo, kept across the loop's passes (irregularity.per_step)
    spent = [0.0]

    def fetch(*a, **kw):  # the emulated agents' time (re-simulating the job), apart from the analysis
        t = time.perf_counter()
        try:
            return sim_fetch(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - t
    for c in passes:  # the analysis loop's passes as data arrives, one every `every` steps
        spent[0] = 0.0
        reader.now = ends[c] + 1   # what the store holds by this pass
        ar = AnalysisReader(reader, fetch, memo)
        got, sec = scoring.run_detectors(ar, ends[c] + 1)
        if c in checks:  # scored on the windows ending at onset + 5, + 10 steps and at the end
            found += got
        if sec - spent[0] > t_analysis:
            t_analysis, t_fetch, t_detect = sec - spent[0], spent[0], sec
        fetched |= ar.ranks_fetched
    spent[0] = 0.0
    _, sec = scoring.run_detectors(AnalysisReader(reader, fetch), ends[last] + 1)  # one pass from cold
    t_cold = sec - spent[0]
    wall = time.perf_counter() - t0
    del reader
    gc.unfreeze()

    def step_of(ns: int) -> int:
        return 1 + max((s for s, e in ends.items() if e <= ns), default=-1)
    tr = truth(simulate(cfg, faults, keep_steps=False))["faults"]
    out = []
    for t in tr:
        ids = scoring.target_ids(t)
        hits = [f for _, f in found if step_of(f.onset_ns) >= t["start"] - 2]
        tops = [[s.id for s in f.suspects] for f in hits]
        out.append({"kind": t["kind"], "target": t["target"], "value": t["value"], "detected": bool(hits),
                    "top1": any(x[:1] and x[0] in ids for x in tops), "top3": any(ids & set(x[:3]) for x in tops),
                    "impact": scoring.fault_impact(cfg, faults[0]) if len(faults) == 1 else None})
    spans = [(t["start"] - 2, (t["end"] if t["kind"] != "degradation" else 10**9) + 2) for t in tr]
    uniq = {}
    for d, f in found:  # the same finding seen in several windows counts once (as the engine merges them)
        uniq[(d, f.kind, step_of(f.onset_ns), tuple(s.id for s in f.suspects[:1]))] = (d, f)
    found = list(uniq.values())
    true_f = sum(1 for _, f in found if any(a <= step_of(f.onset_ns) <= b for a, b in spans))
    return {"gpus": cfg.gpus, "shape": f"DP{cfg.dp}xPP{cfg.pp}xTP{cfg.tp}", "specs": specs, "faults": out,
            "findings": [{"detector": d, "kind": f.kind, "top": [s.id for s in f.suspects[:3]],
                          "onset_step": step_of(f.onset_ns), "severity": f.severity} for d, f in found],
            "true_findings": true_f, "false_findings": len(found) - true_f, "records_s": round(t_records, 2),
            "detect_s": round(t_detect, 2), "analysis_s": round(t_analysis, 2), "fetch_s": round(t_fetch, 2),
            "cold_analysis_s": round(t_cold, 2), "passes": len(passes),
            "end_to_end_s": round(wall, 2), "ranks_fetched": len(fetched),
            "windows": len(checks)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenarios", type=int, default=20)
    p.add_argument("--seed", type=int, default=3000)
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--every", type=int, default=5, help="steps between the analysis loop's passes")
    p.add_argument("--shape", help="DP,PP,TP instead of the 8,192-GPU shapes (a quick check on a small job)")
    args = p.parse_args(argv)
    shapes = [tuple(int(x) for x in args.shape.split(","))] if args.shape else SHAPES_8K
    rng = random.Random(args.seed)
    rows = []
    for i in range(args.scenarios):
        cfg, specs = scenario(rng, args.iterations, shapes)
        r = evaluate(cfg, specs, args.every)
        rows.append(r)
        f = r["faults"][0]
        print(f"{i:>3} {r['shape']:<16} {specs[0]:<36} impact {f['impact']:<6} found {'yes' if f['detected'] else 'no':<3} "
              f"top1 {'yes' if f['top1'] else 'no':<3} top3 {'yes' if f['top3'] else 'no':<3} FP {r['false_findings']} "
              f"fetched {r['ranks_fetched']:>4}  records {r['records_s']:>5.1f} s  analysis {r['analysis_s']:>5.2f} s "
              f"(+ fetch {r['fetch_s']:>5.2f} s, cold {r['cold_analysis_s']:>5.2f} s)  "
              f"end to end {r['end_to_end_s']:>5.1f} s", flush=True)
    faults = [f for r in rows for f in r["faults"]]
    vis = [f for f in faults if f["impact"] and f["impact"] >= scoring.VISIBLE_IMPACT]
    head = {**scoring.headline(rows), "gpus": rows[0]["gpus"], "iterations": args.iterations, "seed": args.seed,
            "visible_faults": len(vis),
            "visible_top1_fraction": round(sum(f["top1"] for f in vis) / len(vis), 3) if vis else None,
            "max_analysis_s": max(r["analysis_s"] for r in rows),
            "median_analysis_s": statistics.median(r["analysis_s"] for r in rows),
            "median_cold_analysis_s": statistics.median(r["cold_analysis_s"] for r in rows),
            "max_cold_analysis_s": max(r["cold_analysis_s"] for r in rows), "every_steps": args.every,
            "max_fetch_s": max(r["fetch_s"] for r in rows),
            "max_detect_with_fetch_s": max(r["detect_s"] for r in rows),
            "median_end_to_end_s": statistics.median(r["end_to_end_s"] for r in rows),
            "max_end_to_end_s": max(r["end_to_end_s"] for r in rows),
            "ranks_fetched_max": max(r["ranks_fetched"] for r in rows),
            "ranks_fetched_fraction_max": round(max(r["ranks_fetched"] for r in rows) / rows[0]["gpus"], 4)}
    print(json.dumps(head))
    return 0


if __name__ == "__main__":
    sys.exit(main())
