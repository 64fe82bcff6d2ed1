"""Step boundary accuracy on the live testbed: the agents' Step records against the job's own step logs.

Brings the netns testbed up with its agents (bench/testbed: 4 hosts, collector over mutual TLS), runs the DP2 x
PP2 gloo job under the steplens bootstrap, waits past start-up, lets it run `--steps` quiet steps, and compares
the Step records the collector stored with steps/rank<r>.jsonl (bench/testbed/boundaries.py): per rank the
median |end error| as a fraction of the step time, the constant phase, the error after it and the duration
error; then takes the testbed down. `--no-anchors` launches the ranks with STEPLENS_ANCHORS=0, so the steps end
at the comm ops alone (what the agent had before the anchors: issue times of gloo's DP all-reduce);
`--no-zero-grad-anchors` with STEPLENS_ANCHORS_ZERO_GRAD=0, so they end at the optimizer step's end (what the
anchors were before the zero_grad ones).
Needs root, iproute2 and torch; ~1.5 min on the 2-core VM, nothing else CPU-heavy running
(flock /tmp/steplens-cpu.lock). The last stdout line is one JSON object; the headline is
median_boundary_error_fraction (median over every matched step of every rank; goal <= 0.01, stretch 0.001).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.testbed import boundaries, faults, netns  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=150, help="quiet steps measured (after --warmup)")
    ap.add_argument("--warmup", type=int, default=30, help="steps left out after start-up")
    ap.add_argument("--no-anchors", action="store_true", help="STEPLENS_ANCHORS=0 in the ranks: comm ops only")
    ap.add_argument("--no-zero-grad-anchors", action="store_true",
                    help="STEPLENS_ANCHORS_ZERO_GRAD=0 in the ranks: optimizer-step ends only")
    ap.add_argument("--state-dir", help="testbed state (default: a fresh temporary directory)")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench/testbed_steps.py needs root (network namespaces)", file=sys.stderr)
        return 2
    layout = netns.Layout(state_dir=a.state_dir or tempfile.mkdtemp(prefix="sltb-steps-"))
    netns.down(layout)
    t_start = time.monotonic()
    try:
        netns.up(layout)
        env = {r: {"STEPLENS_ANCHORS": "0"} for r in range(4)} if a.no_anchors else \
            {r: {"STEPLENS_ANCHORS_ZERO_GRAD": "0"} for r in range(4)} if a.no_zero_grad_anchors else None
        netns.start_job(layout, dp=2, pp=2, steps=0, env_faults=env)
        faults.wait_steps(layout, a.warmup, timeout=300)
        since = time.time_ns()
        faults.wait_steps(layout, a.steps, timeout=a.steps * 2 + 60)
        until = time.time_ns()
        time.sleep(4)  # the last steps' records reach the store (flightrec every second, batches 0.5 s)
        key = boundaries.job_key(layout)
        figs = boundaries.figures(layout, key, since, until)
    finally:
        left = netns.down(layout)
    for r in range(4):
        print(f"rank {r}: {json.dumps(figs.get(r))}")
    per = [figs[r] for r in range(4) if figs.get(r, {}).get("steps")]
    result = {"median_boundary_error_fraction": figs["all"]["median_abs_error"],
              "worst_rank_median_error_fraction": max((f["median_abs_error"] for f in per), default=None),
              "phase_ms": [f["phase_ms"] for f in per],
              "median_error_after_phase_fraction": max((f["median_error_after_phase"] for f in per), default=None),
              "median_duration_error_fraction": max((f["median_duration_error"] or 0 for f in per), default=None),
              "step_ms": [f["step_ms"] for f in per], "steps_matched": figs["all"]["steps"],
              "evidence": sorted({e for f in per for e in f["evidence"]}), "anchors": not a.no_anchors,
              "zero_grad_anchors": not (a.no_anchors or a.no_zero_grad_anchors),
              "job_key": key, "seconds": round(time.monotonic() - t_start, 1),
              "left_after_down": left["namespaces_left"] + left["cgroups_left"], "goal": 0.01}
    print(json.dumps(result))
    return 0 if per else 1


if __name__ == "__main__":
    sys.exit(main())
