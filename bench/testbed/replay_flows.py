"""Replay a testbed run's stored flows through the flows detector, offline: the flow analysis of the 30 s window
ending at each second from the fault's start, as the collector's loop would judge it (for detector work on a
recorded run; `tests/test_testbed_flows.py --basetemp DIR` keeps the bed's state directory).

    .venv/bin/python -m bench.testbed.replay_flows STATE_DIR [--from -2] [--to 15] [--window 30]

Prints, per second from the last fault's start, the finding (kind, severity, suspects) or nothing."""

from __future__ import annotations

import argparse
import json
import os

from steplens.collector.analysis.flowjobs import FlowConfig, FlowView, topology_maps
from steplens.collector.analysis.flows import FlowsConfig, diagnose
from steplens.collector.store.queries import Reader

from bench.testbed import netns


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("state_dir")
    ap.add_argument("--from", dest="lo", type=float, default=-2.0)
    ap.add_argument("--to", dest="hi", type=float, default=15.0)
    ap.add_argument("--window", type=float, default=30.0)
    a = ap.parse_args(argv)
    with open(os.path.join(a.state_dir, "ground_truth.jsonl")) as fh:
        fault = [json.loads(line) for line in fh if line.strip()][-1]
    reader = Reader(os.path.join(a.state_dir, "collector.db"))
    node_of, nic_of = topology_maps(reader.topology())
    view = FlowView(window_seconds=a.window, refresh_seconds=0.0, cfg=FlowConfig(ignore_ports=(netns.COLLECTOR_PORT,)))
    t0 = fault["start_ns"]
    print(f"fault: {fault['kind']} on {fault['target']} {fault['params']}")
    t = a.lo
    while t <= a.hi:
        until = int(t0 + t * 1e9)
        snap = view.snapshot(reader, until, since_ns=until - int(a.window * 1e9))
        line = "no flow job"
        if snap is not None and snap.jobs:
            job = max(snap.jobs, key=lambda j: len(j.timeline))
            found = diagnose(snap, job, nic_of, node_of, FlowsConfig())
            line = "no finding"
            for f in found:
                line = (f"{f.kind} {f.severity:.2f}x onset {(f.onset_ns - t0) / 1e9:+.2f} s "
                        f"{[(s.kind, s.id, round(s.score, 3)) for s in f.suspects[:3]]} "
                        f"endpoints {f.evidence['endpoints'][:4]}")
        print(f"{t:+6.1f} s  {line}")
        t += 1.0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
