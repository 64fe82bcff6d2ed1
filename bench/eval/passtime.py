"""Where an analysis pass goes at 8,192 GPUs: each detector's own time on each pass of one scale.py scenario.

The passes run as scale.py runs them (a pass every --every steps, the engine's per-job memo kept across them,
the cyclic GC off during a pass as the engine has it, the in-memory rows out of its sight, the emulated agents'
FetchDetail time taken out of the detector that asked), with each detector timed apart; the detectors run in
the registry's order, so the first to read the window (commtime) pays for parsing its Step rows
(irregularity.load) and the others reuse them. --profile names a detector whose slowest pass is run under
cProfile (its top functions printed).

    .venv/bin/python bench/eval/passtime.py [--seed 3000] [--scenario 0] [--every 5] [--profile irregularity]

Ends with one JSON line: the slowest pass's step and seconds, and per detector its median and max seconds.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import random
import statistics
import sys
import time

from steplens.collector.analysis import all_specs
from steplens.collector.analysis.base import Window, no_gc
from steplens.collector.analysis.engine import AnalysisReader
from steplens.sim.faults import parse_fault

import scale
import scoring


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=3000)
    p.add_argument("--scenario", type=int, default=0, help="which of scale.py's scenarios for --seed (0: the first)")
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--shape", help="DP,PP,TP instead of the 8,192-GPU shapes (a quick check on a small job)")
    p.add_argument("--profile", help="a detector to run under cProfile on its slowest pass")
    args = p.parse_args(argv)
    shapes = [tuple(int(x) for x in args.shape.split(","))] if args.shape else scale.SHAPES_8K
    rng = random.Random(args.seed)
    for _ in range(args.scenario + 1):
        cfg, specs = scale.scenario(rng, args.iterations, shapes)
    print(f"scenario {args.scenario} of seed {args.seed}: DP{cfg.dp}xPP{cfg.pp}xTP{cfg.tp} {' '.join(specs)}")
    faults = [parse_fault(s, cfg.topology()) for s in specs]
    reader = scale.MemReader(cfg, faults)
    gc.collect()
    gc.freeze()
    ends = {r["step"]: r["end_ns"] for r in reader.rows if r["rank"] == 0}
    last = max(ends)
    checks = {min(last, f.start + k) for f in faults for k in (5, 10)} | {last}
    passes = sorted(set(range(args.every, last + 1, args.every)) | checks)
    sim_fetch = scoring.sim_fetcher(cfg, faults)
    spent = [0.0]

    def fetch(*a, **kw):
        t = time.perf_counter()
        try:
            return sim_fetch(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - t
    specs_by_name = all_specs()
    memo: dict = {}
    per: dict[str, list[float]] = {name: [] for name in specs_by_name}
    totals: list[tuple[float, int]] = []
    for c in passes:
        reader.now = ends[c] + 1   # what the store holds by this pass
        ar = AnalysisReader(reader, fetch, memo)
        times = {}
        with no_gc():   # as the engine runs a pass (engine.run_job)
            for name, spec in specs_by_name.items():
                spent[0] = 0.0
                t = time.perf_counter()
                spec.detect(ar, Window(scoring.JOB, 0, ends[c] + 1), spec.config_class())
                times[name] = time.perf_counter() - t - spent[0]
                per[name].append(times[name])
        totals.append((sum(times.values()), c))
        print(f"step {c:>4}  {sum(times.values()):6.2f} s  " +
              "  ".join(f"{n} {s:5.2f}" for n, s in times.items()), flush=True)
    worst_s, worst_c = max(totals)
    if args.profile:
        if args.profile not in specs_by_name:
            p.error(f"--profile: no detector {args.profile!r} (one of {', '.join(specs_by_name)})")
        # the slowest pass again from the same memo state is not reproducible; profile a fresh pass over that
        # window after every other detector has read it (the parse shared, this detector's own work measured)
        ar = AnalysisReader(reader, fetch, {})
        w = Window(scoring.JOB, 0, ends[worst_c] + 1)
        for name, spec in specs_by_name.items():
            if name != args.profile:
                spec.detect(ar, w, spec.config_class())
        prof = cProfile.Profile()
        spec = specs_by_name[args.profile]
        prof.runcall(spec.detect, ar, w, spec.config_class())
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
        print(out.getvalue())
    print(json.dumps({"gpus": cfg.dp * cfg.pp * cfg.tp, "passes": len(passes), "slowest_pass_step": worst_c,
                      "slowest_pass_s": round(worst_s, 3),
                      **{f"{n}_median_s": round(statistics.median(v), 3) for n, v in per.items()},
                      **{f"{n}_max_s": round(max(v), 3) for n, v in per.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
