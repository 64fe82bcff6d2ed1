"""Record the testbed's per-rank step times and wait components for a baseline and each fault kind.

The figures the simulator is checked against (`bench/sim/testbed.py`): one job (DP x PP, one rank per host),
then per fault: a baseline phase of `base_steps` steps just before it, the fault for its duration (the
ground-truth window from `faults.inject`), and per rank the medians of every timing column over the steps
that lie wholly inside each phase. A `stop` shows as one long step per rank, so for it the longest step
overlapping the window counts instead of medians.

    python -m bench.testbed.calibrate --out bench/sim/calibration/testbed-dp2pp2.json [--faults link,cpu]

Brings the testbed up (collector only, no agents: they would take CPU from the 4 ranks on 2 cores), runs,
and always takes it down again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

from . import faults, netns

COLUMNS = ("step_seconds", "compute_seconds", "pipe_wait_seconds", "allreduce_seconds", "tp_allreduce_seconds",
           "gc_seconds", "sync_seconds", "fwd_seconds", "bwd_seconds", "opt_seconds", "compute_cpu_seconds",
           "cpu_seconds")

# name -> (inject kind, target, duration s, inject kwargs); rank 1 = stage 0, replica 1 in DP=2 x PP=2
PLAN = {
    "link": ("link", "h1", 4.0, {"rate": "200mbit"}),
    "cpu": ("cpu", "rank1", 4.0, {"cpu_share": 0.1}),
    "stop": ("stop", "rank1", 2.0, {}),
    "gc_storm": ("gc_storm", "rank1", 4.0, {}),
    "extra_sync": ("extra_sync", "all", 2.0, {}),
    "noisy": ("noisy", "h1", 3.0, {"processes": 2}),
}


def medians(steps: list[dict]) -> dict:
    if not steps:
        return {"steps": 0}
    out: dict = {"steps": len(steps), "max_step_seconds": round(max(s["step_seconds"] for s in steps), 5)}
    for k in COLUMNS:
        vals = [s[k] for s in steps if k in s]
        if vals:
            out[k] = round(statistics.median(vals), 5)
    comp = [s["compute_seconds"] for s in steps]
    if len(comp) > 1 and statistics.mean(comp) > 0:
        out["compute_cv"] = round(statistics.stdev(comp) / statistics.mean(comp), 4)
    return out


def _phase(layout, world, t0, t1) -> dict:
    return {str(r): medians([s for s in faults.read_steps(layout, r) if s["start_ns"] >= t0 and s["end_ns"] <= t1])
            for r in range(world)}


def measure(layout: netns.Layout, names: list[str], base_steps: int = 10, log=print) -> dict:
    """Baseline + fault phases on a running job; returns {name: {kind, target, params, baseline, fault}}."""
    world = len(netns.load_job(layout)["ranks"])
    out = {}
    for name in names:
        kind, target, dur, kw = PLAN[name]
        t0 = time.time_ns()
        faults.wait_steps(layout, base_steps)
        t1 = time.time_ns()
        entry = faults.inject(layout, kind, target, dur, **kw)
        faults.wait_steps(layout, 3)  # the step straddling the end is logged, the job settles
        rec = {"kind": kind, "target": target, "params": entry.get("params", {}),
               "window_seconds": round((entry["end_ns"] - entry["start_ns"]) / 1e9, 3),
               "baseline": _phase(layout, world, t0, t1)}
        if kind == "stop":
            rec["fault"] = {str(r): medians(faults.window(layout, entry["start_ns"], entry["end_ns"], r))
                            for r in range(world)}
        else:
            rec["fault"] = _phase(layout, world, entry["start_ns"], entry["end_ns"])
        out[name] = rec
        log(f"{name}: " + ", ".join(
            f"r{r} {rec['fault'][str(r)].get('step_seconds', 0) / max(rec['baseline'][str(r)].get('step_seconds', 1), 1e-4):.2f}x"
            for r in range(world)), file=sys.stderr)
    return out


def record(names: list[str], dp: int = 2, pp: int = 2, base_steps: int = 10, state_dir: str | None = None) -> dict:
    layout = netns.Layout(state_dir=state_dir or netns.DEFAULT_STATE_DIR, hosts=dp * pp)
    netns.down(layout)
    try:
        netns.up(layout, agents=False)
        netns.start_job(layout, dp=dp, pp=pp, steps=0)
        faults.wait_steps(layout, 8, timeout=300)  # past start-up (imports, rendezvous) and warm-up
        started = time.time()
        figures = measure(layout, names, base_steps)
        return {"shape": {"dp": dp, "pp": pp, "hosts": dp * pp, "schedule": "gpipe", "micro_batches": 4,
                          "micro_batch_size": 16, "width": 1024, "agents": False},
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "machine": {"node": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release(),
                            "python": platform.python_version()},
                "seconds": round(time.time() - started, 1), "base_steps": base_steps, "faults": figures}
    finally:
        res = netns.down(layout)
        if res["namespaces_left"] or res["cgroups_left"]:
            print(f"down left {res}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--faults", default=",".join(PLAN), help=f"comma-separated, of {', '.join(PLAN)}")
    ap.add_argument("--base-steps", type=int, default=10)
    ap.add_argument("--state-dir", default=None)
    a = ap.parse_args(argv)
    names = [n for n in a.faults.split(",") if n]
    bad = [n for n in names if n not in PLAN]
    if bad:
        ap.error(f"unknown faults {bad}")
    fig = record(names, base_steps=a.base_steps, state_dir=a.state_dir)
    fig["command"] = "python -m bench.testbed.calibrate " + " ".join(argv if argv is not None else sys.argv[1:])
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(fig, fh, indent=1)
        fh.write("\n")
    print(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
