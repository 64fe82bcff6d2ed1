"""Black-box diagnosis from flows alone (LLMPrism, issue "Diagnosis III") scored on the simulated 2,880-GPU
cluster of 19 concurrent jobs (bench/sim/cluster.py): one minute of switch-mirrored flows, nothing else.

    .venv/bin/python bench/eval/flows.py                 # seed 0, 60 s window, in-memory flows
    .venv/bin/python bench/eval/flows.py --store         # the flows through a real SQLite store (writer + reader)
    .venv/bin/python bench/eval/flows.py --seeds 0 1 2   # several cluster layouts

Per seed:
  recognition     every job found with exactly its GPU set (the flow job's endpoint set == the job's IPs);
  classification  every truth pair (two IPs that exchanged flows) typed right: the predicted type is one of the
                  traffic kinds it carried (a DP ring hop inside an EP group carries both); per type, and
                  without the DP-transitivity refinement (pairs it promoted counted wrong);
  segmentation    GapSplit (the default) against Bocd (the paper's BOCD, erratum fixed) on a sample of pairs:
                  the share of pairs where both put the step boundaries at the same flows;
  timeline        per endpoint and step: |reconstructed step time - true step time| / true step time, matched
                  to the true step whose end is nearest (the step ends where its DP traffic ends; the true end
                  also holds the optimizer step, a constant per job that a step time cancels); and the
                  boundary offset (reconstructed end - true end) over the step time;
  time            recognition + classification (+ timelines) of the window, seconds on this machine; with
                  --store also the store read;
  faults          a congested leaf, a slow NIC link and a slow DP group (every NIC of one DP ring at 1/1.6 of
                  its bandwidth) from 30 s to the end, each in its own run: the flows detector on every job the
                  fault touches must name it (the switch / the link first; the group among its slow DP groups
                  with one of its links first; a link whose every flow runs to one peer is named as a tie with
                  that peer's link, counted apart); healthy jobs of those runs must have no finding.
The last line is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from steplens.collector.analysis.bocd import Bocd, GapSplit  # noqa: E402
from steplens.collector.analysis.flowjobs import FlowConfig, FlowWindow, analyse, topology_maps  # noqa: E402
from steplens.collector.analysis.flows import FlowsConfig, diagnose  # noqa: E402
from steplens.collector.topology import from_dict  # noqa: E402
from steplens.sim.cluster import CLUSTER, ClusterFault, layout, simulate_cluster  # noqa: E402


def window_of(run, noise_us: float = 0.0, seed: int = 0) -> FlowWindow:
    """The run's flows as the analysis's columns; noise_us: a switch's timestamp error, Gaussian (σ) on every
    start and end (the simulator's flow ends are the collectives' exact ends)."""
    c = run.cols
    ips = [CLUSTER.ip(g) for g in range(CLUSTER.gpus)]
    start = c["start"].astype(np.int64)
    end = start + np.maximum(1, np.round(c["duration"] * 1e9)).astype(np.int64)
    if noise_us > 0:
        rng = np.random.default_rng(seed)
        start = start + np.round(rng.normal(0, noise_us * 1e3, len(start))).astype(np.int64)
        end = np.maximum(start + 1, end + np.round(rng.normal(0, noise_us * 1e3, len(end))).astype(np.int64))
    paths = run.paths
    return FlowWindow(start, end, c["bytes"].astype(np.int64), c["src"].astype(np.int64), c["dst"].astype(np.int64),
                      ips, [paths[p] for p in c["path"].tolist()], {"import:sim"})


def window_via_store(run, tmp: str) -> tuple[FlowWindow, float, float]:
    """The flows written through the collector's StoreWriter (its thread, its transactions) into SQLite and read
    back as the engine reads them (Reader.flow_rows): (window, write seconds, read + parse seconds)."""
    import threading

    from steplens.collector.store.queries import Reader
    from steplens.collector.store.writer import StoreJob, StoreWriter
    path = os.path.join(tmp, "flows.db")
    writer = StoreWriter(path)
    writer.start()
    t0 = time.perf_counter()
    c = run.cols
    ips = [CLUSTER.ip(g) for g in range(CLUSTER.gpus)]
    sw = [json.dumps(list(p)) for p in run.paths]
    sql = ("INSERT INTO flows(agent_id, start_ns, end_ns, src, sport, dst, dport, bytes, packets, pid, origin,"
           " switches) VALUES ('import',?,?,?,0,?,0,?,0,0,'import:sim',?)")
    try:
        for lo in range(0, len(run), 200_000):
            rows = [(st, st + max(1, round(d * 1e9)), ips[a], ips[b], nb, sw[p]) for st, a, b, nb, d, p in zip(
                *(c[k][lo:lo + 200_000].tolist() for k in ("start", "src", "dst", "bytes", "duration", "path")))]
            done = threading.Event()
            while not writer.submit(StoreJob(lambda conn, rows=rows: conn.executemany(sql, rows).rowcount,
                                             lambda *a, done=done: done.set())):
                time.sleep(0.01)
            done.wait(300)
    finally:
        writer.stop()
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    reader = Reader(path)
    _, newest = reader.flow_watermark()
    fw = FlowWindow.from_rows(reader.flow_rows(0, newest + 1))
    return fw, write_s, time.perf_counter() - t0


def score_recognition(snap, truth) -> dict:
    found = {frozenset(j.endpoints) for j in snap.jobs}
    exact = [j["name"] for j in truth["jobs"] if frozenset(j["ips"]) in found]
    return {"jobs": len(truth["jobs"]), "recognized_exactly": len(exact), "flow_jobs": len(snap.jobs),
            "missed": [j["name"] for j in truth["jobs"] if j["name"] not in exact][:10]}


def score_pairs(snap, truth) -> dict:
    pred = {}
    refined = {}
    for j in snap.jobs:
        pred.update(j.pairs)
    total = ok = ok_unrefined = 0
    per = {}
    for j in truth["jobs"]:
        for p in j["pairs"]:
            key = (p["a"], p["b"]) if p["a"] < p["b"] else (p["b"], p["a"])
            t = pred.get(key, "-")
            kind = "dp" if "dp" in p["types"] else p["types"][0]
            d = per.setdefault(kind, [0, 0])
            d[0] += 1
            total += 1
            if t in p["types"]:
                ok += 1
                d[1] += 1
    for j in snap.jobs:
        refined[j.key] = j.refined + j.demoted   # both corrections undone: the verdicts before transitivity
    ok_unrefined = ok - sum(refined.values())
    return {"pairs": total, "accuracy": round(ok / max(1, total), 5),
            "accuracy_without_refinement": round(ok_unrefined / max(1, total), 5),
            "refined": sum(refined.values()),
            "per_type": {k: {"pairs": v[0], "accuracy": round(v[1] / max(1, v[0]), 5)} for k, v in sorted(per.items())}}


def score_segmenters(fw, snap, sample: int, seed: int) -> dict:
    """GapSplit against Bocd on a sample of typed pairs: the same DP/PP/EP verdict (classify_pair with each),
    and on DP pairs the same step boundaries. (A PP pair has no step-level structure to find: its intervals
    are bimodal at the micro-batch, a send and the next receive close together vs an op apart, so GapSplit cuts
    at micro-batches where BOCD sees no change; every segment still holds one size: the same verdict.)"""
    from steplens.collector.analysis.flowjobs import FlowConfig, classify_pair
    rng = random.Random(seed)
    pairs = [(ab, t) for j in snap.jobs for ab, t in j.pairs.items() if t in ("dp", "pp", "ep")]
    rng.shuffle(pairs)
    idx_of = {ip: i for i, ip in enumerate(fw.ips)}
    lo = np.minimum(fw.src, fw.dst)
    hi = np.maximum(fw.src, fw.dst)
    cfg = FlowConfig()
    same = n = dp_n = dp_same = 0
    for (a, b), t in pairs[:sample]:
        ia, ib = sorted((idx_of[a], idx_of[b]))
        m = np.flatnonzero((lo == ia) & (hi == ib))
        m = m[np.argsort(fw.start[m], kind="stable")][:600]
        g = GapSplit().boundaries(fw.start[m])
        bocd = Bocd(flows_per_step=max(2.0, len(m) / (len(g) + 1)))
        n += 1
        same += classify_pair(fw, m, ia, cfg, GapSplit()) == classify_pair(fw, m, ia, cfg, bocd)
        if t == "dp":
            dp_n += 1
            dp_same += g == bocd.boundaries(fw.start[m])
    return {"pairs": n, "same_verdict": round(same / max(1, n), 4), "dp_pairs": dp_n,
            "dp_same_boundaries": round(dp_same / max(1, dp_n), 4)}


def score_timeline(snap, truth) -> dict:
    true_steps = {}
    for j in truth["jobs"]:
        for ip, steps in j["steps"].items():
            true_steps[ip] = np.asarray([[s, e] for _, s, e in steps], dtype=np.float64)
    errs, offs = [], []
    for j in snap.jobs:
        for ip, steps in j.timeline.items():
            t = true_steps.get(ip)
            if t is None or len(t) < 2:
                continue
            ends = t[:, 1]
            for _, a, b in steps:
                i = int(np.argmin(np.abs(ends - b)))
                if i == 0:
                    continue
                true_dur = ends[i] - ends[i - 1]
                errs.append(abs((b - a) - true_dur) / true_dur)
                offs.append((b - ends[i]) / true_dur)
    if not errs:
        return {"steps": 0}
    e = np.asarray(errs)
    return {"steps": len(errs), "median_error_pct": round(100 * float(np.median(e)), 4),
            "p95_error_pct": round(100 * float(np.percentile(e, 95)), 4),
            "mean_error_pct": round(100 * float(e.mean()), 4),
            "median_boundary_offset_pct": round(100 * float(np.median(offs)), 4)}


def fault_runs(jobs, truth, seed: int) -> list[dict]:
    """Three faults from 30 s: a congested leaf under a multi-leaf job, a slow link of a pipeline job, a slow
    DP group (every NIC of one DP ring)."""
    rng = random.Random(seed + 77)
    big = [j for j in jobs if j.leaves >= 2 and j.cfg.pp >= 2]
    leaf_job = rng.choice(big)
    leaf = f"leaf{leaf_job.first_leaf + rng.randrange(leaf_job.leaves)}"
    link_job = rng.choice([j for j in jobs if j.cfg.pp >= 2 and j.cfg.dp >= 2])
    g = rng.choice(link_job.gpus())
    link = CLUSTER.link_of(g)
    grp_job = rng.choice([j for j in jobs if j.cfg.dp >= 4 and j.cfg.tp == 8])
    s, t = rng.randrange(grp_job.cfg.pp), rng.randrange(grp_job.cfg.tp)
    ring = [grp_job.gpu(grp_job.cfg.rank(s, d, t)) for d in range(grp_job.cfg.dp)]
    return [
        {"name": "congested_leaf", "expect": ("switch", leaf),
         "faults": [ClusterFault("congested_switch", leaf, 30.0, 61.0, 4.0)], "jobs": None},
        {"name": "slow_link", "expect": ("link", link),
         "faults": [ClusterFault("slow_link", link, 30.0, 61.0, 3.0)], "jobs": [link_job.name]},
        {"name": "slow_dp_group", "expect": ("dp_group", sorted(CLUSTER.ip(x) for x in ring)),
         "faults": [ClusterFault("slow_link", CLUSTER.link_of(x), 30.0, 61.0, 1.6) for x in ring],
         "jobs": [grp_job.name]},
    ]


def run_fault(jobs, spec, window: float, server_of, nic_of, fcfg, noise_us: float, seed: int) -> dict:
    run = simulate_cluster(jobs, spec["faults"], window)
    truth = run.truth()
    fw = window_of(run, noise_us, seed)
    snap = analyse(fw, server_of, fcfg)
    touched = {x["job"] for f in truth["faults"] for x in f["jobs"]}
    by_ips = {frozenset(j["ips"]): j["name"] for j in truth["jobs"]}
    out = {"fault": spec["name"], "expect": spec["expect"], "touched": sorted(touched), "named": [], "missed": [],
           "false_findings": [], "tied": []}
    for fj in snap.jobs:
        name = by_ips.get(frozenset(fj.endpoints), fj.key)
        found = diagnose(snap, fj, nic_of, server_of, FlowsConfig())
        if name not in touched:
            if found:
                out["false_findings"].append({"job": name, "summary": found[0].summary})
            continue
        kind, target = spec["expect"]
        hit = False
        for f in found:
            top = f.suspects[0] if f.suspects else None
            if kind == "dp_group":
                groups = [set(g["members"]) for g in f.evidence.get("dp_groups", [])]
                hit = any(g <= set(target) for g in groups) and top is not None and top.kind == "link" and \
                    top.evidence.get("address") in target
            else:
                hit = top is not None and (top.kind, top.id) == (kind, target)
                if not hit and top is not None and top.evidence.get("tied_with") == target:
                    out["tied"].append(name)   # the finding names it as the tie it cannot break
                    hit = True
            if hit:
                break
        (out["named"] if hit else out["missed"]).append(
            {"job": name, "top": [(s.kind, s.id) for s in (found[0].suspects if found else ())][:3],
             "summary": found[0].summary if found else None})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--store", action="store_true", help="flows through a real SQLite store")
    ap.add_argument("--segmenter-sample", type=int, default=300)
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--noise-us", type=float, default=20.0,
                    help="timestamp error (σ, µs) added to every flow start and end (default 20; 0: exact)")
    args = ap.parse_args(argv)
    topo = from_dict(CLUSTER.topology_file())
    server_of, nic_of = topology_maps(topo)
    fcfg = FlowConfig()
    results = []
    for seed in args.seeds:
        jobs = layout(seed)
        t0 = time.perf_counter()
        run = simulate_cluster(jobs, (), args.window)
        sim_s = time.perf_counter() - t0
        truth = run.truth()
        store = {}
        if args.store:
            with tempfile.TemporaryDirectory() as tmp:
                fw, write_s, read_s = window_via_store(run, tmp)
            store = {"store_write_seconds": round(write_s, 2), "store_read_seconds": round(read_s, 2)}
        else:
            fw = window_of(run, args.noise_us, seed)
        t0 = time.perf_counter()
        snap = analyse(fw, server_of, fcfg)
        analyse_s = time.perf_counter() - t0
        rec = score_recognition(snap, truth)
        pairs = score_pairs(snap, truth)
        seg = score_segmenters(fw, snap, args.segmenter_sample, seed)
        tl = score_timeline(snap, truth)
        r = {"seed": seed, "flows": len(fw), "gpus": truth["cluster"]["gpus"], "simulate_seconds": round(sim_s, 2),
             "analyse_seconds": round(analyse_s, 2), **store, "recognition": rec, "classification": pairs,
             "segmenters": seg, "timeline": tl}
        print(f"seed {seed}: {len(fw):,} flows, {truth['cluster']['gpus']} GPUs in {rec['jobs']} jobs; "
              f"recognized exactly {rec['recognized_exactly']}/{rec['jobs']} ({rec['flow_jobs']} flow jobs); "
              f"pairs {pairs['accuracy']:.4f} ({pairs['accuracy_without_refinement']:.4f} without refinement) "
              f"of {pairs['pairs']}; GapSplit vs BOCD: same verdict {seg['same_verdict']:.3f} of {seg['pairs']} pairs, "
              f"same boundaries on {seg['dp_same_boundaries']:.3f} of {seg['dp_pairs']} DP pairs; timeline "
              f"median {tl.get('median_error_pct')} % p95 {tl.get('p95_error_pct')} % of step time over "
              f"{tl.get('steps')} steps; analysis {analyse_s:.2f} s" + (f"; {store}" if store else ""))
        print("  per type:", json.dumps(pairs["per_type"]))
        if not args.no_faults:
            r["faults"] = []
            for spec in fault_runs(jobs, truth, seed):
                fr = run_fault(jobs, spec, args.window, server_of, nic_of, fcfg, args.noise_us, seed)
                r["faults"].append(fr)
                print(f"  fault {fr['fault']} {fr['expect'][1] if fr['fault'] != 'slow_dp_group' else ''}: named on "
                      f"{len(fr['named'])}/{len(fr['touched'])} touched jobs"
                      f"{' (' + str(len(fr['tied'])) + ' as a tie the flows cannot break)' if fr['tied'] else ''}; "
                      f"missed {fr['missed']}; "
                      f"false findings {fr['false_findings']}")
        results.append(r)
    head = {
        "seeds": len(results),
        "jobs_recognized_exactly": sum(r["recognition"]["recognized_exactly"] for r in results),
        "jobs": sum(r["recognition"]["jobs"] for r in results),
        "pair_accuracy": min(r["classification"]["accuracy"] for r in results),
        "pair_accuracy_without_refinement": min(r["classification"]["accuracy_without_refinement"] for r in results),
        "segmenter_same_verdict": min(r["segmenters"]["same_verdict"] for r in results),
        "segmenter_same_dp_boundaries": min(r["segmenters"]["dp_same_boundaries"] for r in results),
        "timeline_median_error_pct": max(r["timeline"].get("median_error_pct", 100) for r in results),
        "timeline_p95_error_pct": max(r["timeline"].get("p95_error_pct", 100) for r in results),
        "analyse_seconds_max": max(r["analyse_seconds"] for r in results),
        "flows_per_window": max(r["flows"] for r in results),
    }
    if not args.no_faults:
        fr = [f for r in results for f in r["faults"]]
        head["faults_named"] = sum(len(f["named"]) for f in fr)
        head["faults_touched_jobs"] = sum(len(f["touched"]) for f in fr)
        head["false_findings"] = sum(len(f["false_findings"]) for f in fr)
        head["faults_named_as_tie"] = sum(len(f["tied"]) for f in fr)
    if args.store:
        head["store_read_seconds_max"] = max(r["store_read_seconds"] for r in results)
    print(json.dumps(head))
    return 0


if __name__ == "__main__":
    sys.exit(main())
