"""Evaluation harness (`make eval`): named scenarios on the simulator, with their ground truth.

For every scenario it simulates the job, then reports the faults (ground truth: kind, target,
iterations) and what they did to the job: step-time ratio in the fault window against the
iterations before it, on the worst rank and the median rank, and whether the job aborted.
Detectors (collector/analysis, registered in DETECTORS) will be scored here per scenario
(precision, recall, F1, top-1/top-K localization, latency); none exists yet, and the table says so.
The real CPU testbed's scenarios run with `steplens-testbed` (root, torch); see bench/testbed/README.md.

    .venv/bin/python bench/eval/run.py [--scenario NAME ...] [--iterations N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from steplens.sim.faults import parse_fault
from steplens.sim.model import ModelConfig, simulate

SHAPE = dict(dp=8, pp=4, tp=2, micro_batches=8, gpus_per_node=8, nodes_per_leaf=2, spines=2)

# name -> fault specs (KIND:TARGET:START:END[:VALUE[:PERIOD]]); targets fit SHAPE (64 GPUs, 8 nodes, 4 leaves)
SCENARIOS = {
    "healthy": [],
    "slow_gpu": ["slow_gpu:13:10:20:3"],
    "slow_link": ["slow_link:n2.nic1:10:20:8"],
    "congested_switch": ["congested_switch:leaf1:10:20:8"],
    "hang": ["hang:22:12:13:4"],
    "fluctuation": ["fluctuation:5:5:30:2:4"],
    "degradation": ["degradation:40:15:30:1.5"],
    "multiple": ["slow_gpu:3:10:20:2", "congested_switch:leaf2:12:18:6"],
}


def run_scenario(name: str, specs: list[str], iterations: int, seed: int) -> dict:
    cfg = ModelConfig(iterations=iterations, seed=seed, **SHAPE)
    topo = cfg.topology()
    faults = [parse_fault(s, topo) for s in specs]
    t0 = time.perf_counter()
    res = simulate(cfg, faults, keep_steps=True)
    wall = time.perf_counter() - t0
    steps = res.step_ns
    out = {"scenario": name, "gpus": cfg.gpus, "iterations": res.iterations_done, "sim_seconds": round(wall, 3),
           "aborted_at": res.aborted_at, "truth": [], "worst_ratio": 1.0, "median_ratio": 1.0}
    for spec, f in zip(specs, faults):
        out["truth"].append({"spec": spec, "kind": spec.split(":")[0], "target": spec.split(":")[1],
                             "start_iteration": int(spec.split(":")[2]), "end_iteration": int(spec.split(":")[3])})
    if specs and steps:
        start = min(t["start_iteration"] for t in out["truth"])
        end = max(t["end_iteration"] for t in out["truth"])
        before = [statistics.median(steps[i][r] for i in range(max(0, start - 5), start))
                  for r in range(cfg.gpus)] if start > 0 else None
        during = [statistics.median(steps[i][r] for i in range(start, min(end, len(steps))))
                  for r in range(cfg.gpus)] if end > start and start < len(steps) else None
        if before and during:
            ratios = [d / b for d, b in zip(during, before)]
            out["worst_ratio"] = round(max(ratios), 2)
            out["median_ratio"] = round(statistics.median(ratios), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="run only these")
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    names = args.scenario or list(SCENARIOS)
    rows = [run_scenario(n, SCENARIOS[n], args.iterations, args.seed) for n in names]
    try:
        from steplens.collector.analysis import DETECTORS  # registered detectors, when there are some
    except ImportError:
        DETECTORS = {}
    print(f"scenarios on the simulator ({rows[0]['gpus']} GPUs: DP={SHAPE['dp']} PP={SHAPE['pp']} TP={SHAPE['tp']}, "
          f"{args.iterations} iterations, seed {args.seed})\n")
    print(f"{'scenario':<18} {'ground truth':<52} {'step x (worst/median)':>22} {'aborted':>8}")
    for r in rows:
        truth = "; ".join(f"{t['kind']} {t['target']} it {t['start_iteration']}-{t['end_iteration']}"
                          for t in r["truth"]) or "-"
        print(f"{r['scenario']:<18} {truth[:52]:<52} {r['worst_ratio']:>10.2f} / {r['median_ratio']:<9.2f} "
              f"{'yes' if r['aborted_at'] >= 0 else 'no':>8}")
    print()
    if not DETECTORS:
        print("detectors: none registered yet (collector/analysis); precision, recall, F1 and localization "
              "accuracy will be reported here per detector and scenario")
    print()
    try:  # the simulator configured like the testbed, against the recorded testbed run (instant)
        from steplens.sim import testbed as simtb
        fx = simtb.load()
        cmp_rows = simtb.compare(fx)
        print(f"simulator vs recorded testbed (DP=2 x PP=2, {fx['date']}, {fx['machine']['node']}; "
              f"`{fx.get('command', '')}`)")
        print(simtb.table(cmp_rows))
    except (OSError, ImportError, ValueError, KeyError) as e:
        print(f"simulator vs testbed: skipped ({e})")
    print()
    print(json.dumps({"scenarios": len(rows), "detectors": len(DETECTORS),
                      "results": [{k: r[k] for k in ("scenario", "worst_ratio", "median_ratio", "aborted_at")}
                                  for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
