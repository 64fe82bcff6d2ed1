"""Record the testbed's training iterations as the collector stores them, with a slowdown injected (issue "Sentinel").

The bed (bench/testbed: 4 network-namespace hosts, real agents and collector) runs the DP2 x PP2 gloo job under the
bootstrap with `--vary-micro 2:6` (2-6 micro-batches per step) and STEPLENS_STEP_FEATURES naming its locals, so
each step's Iteration carries its workload. After --quiet-seconds, rank 1 is made `--fraction` slower (faults
`slow`: it spins for that share of its step after its micro-batches; the others wait for it) for --fault-seconds,
then --tail-seconds of quiet (--target all: every rank; --hosts 2: a DP2 job, one rank per core of this VM).
--steps-out also writes the stored Step rows around the fault's start (the straggler test's input).
Written to --out (gzip JSON lines): a header {settings, faults: the ground truth
(wall clock = the store's cluster time here, within the clock mapping's ~0.1 ms), step-log figures}, then every
stored Iteration row. What the sentinel sees is only those rows; the header is for scoring (bench/sentinel.py
--training scores a recording). Needs root.

    .venv/bin/python bench/testbed_sentinel.py --out /tmp/train-iters.jsonl.gz [--fraction 0.05]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.testbed import boundaries, cli, faults, netns  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quiet-seconds", type=float, default=120.0)
    ap.add_argument("--fault-seconds", type=float, default=60.0)
    ap.add_argument("--tail-seconds", type=float, default=40.0)
    ap.add_argument("--fraction", type=float, default=0.05)
    ap.add_argument("--vary-micro", default="2:6")
    ap.add_argument("--state-dir", default="/tmp/steplens-tbsentinel")
    ap.add_argument("--hosts", type=int, default=4, help="4: DP2 x PP2; 2: DP2 (a rank per core here)")
    ap.add_argument("--target", default="1", help="the slowed rank, or `all`")
    ap.add_argument("--steps-out", default="", help="also write the stored Step rows (both ranks, with their "
                    "comm summaries) from --steps-around seconds before the fault to as long after its start")
    ap.add_argument("--steps-around", type=float, default=40.0)
    a = ap.parse_args(argv)
    layout = netns.Layout(state_dir=a.state_dir, hosts=a.hosts)
    netns.down(layout)
    import shutil
    shutil.rmtree(a.state_dir, ignore_errors=True)   # a fresh store: a run's rows only
    try:
        netns.up(layout)
        env = {r: {"STEPLENS_STEP_FEATURES": cli.STEP_FEATURES} for r in range(a.hosts)}
        netns.start_job(layout, dp=2, pp=a.hosts // 2, steps=0, env_faults=env,
                        extra_args=["--vary-micro", a.vary_micro])
        faults.wait_steps(layout, 5, timeout=240)
        time.sleep(a.quiet_seconds)
        box: dict = {}
        th = threading.Thread(target=lambda: box.update(
            faults.inject(layout, "slow", a.target, a.fault_seconds, slow_fraction=a.fraction)))
        th.start()
        th.join()
        time.sleep(a.tail_seconds)
        job = boundaries.job_key(layout)
        from steplens.collector.store.queries import Reader
        rows = Reader(layout.path("collector.db")).iterations(job)
        logs = faults.read_steps(layout, 0)
        on = [s for s in logs if box["start_ns"] <= s["start_ns"] and s["end_ns"] <= box["end_ns"]]
        off = [s for s in logs if s["end_ns"] < box["start_ns"]][-len(on) or None:]
        per_micro = {k: statistics.median(s["step_seconds"] / s["micro_batches"] for s in v) for k, v in
                     (("on", on), ("off", off)) if v}
        # what the live collector's analysis loop found meanwhile (every detector, not only the sentinel): a
        # finding is true when it began between the fault's start (less 2 s: a step's length of slack) and its end
        found = []
        for f in Reader(layout.path("collector.db")).findings(job):
            top = f.suspects[0] if f.suspects else None
            true = box["start_ns"] - 2 * 10**9 <= f.onset_ns <= box["end_ns"]
            found.append({"detector": f.detector, "kind": f.kind, "true": true, "top": f"{top.kind} {top.id} "
                          f"({top.cause})" if top else "", "onset_s": round((f.onset_ns - box["start_ns"]) / 1e9, 2),
                          "severity": f.severity, "summary": f.summary})
        found.sort(key=lambda x: x["onset_s"])
        head = {"settings": vars(a), "job_key": job, "faults": [box],
                "step_log": {"rank0_steps": len(logs), "per_micro_step_ms_off": round(1e3 * per_micro["off"], 3),
                             "per_micro_step_ms_on": round(1e3 * per_micro["on"], 3),
                             "slowdown": round(per_micro["on"] / per_micro["off"], 4)},
                "live_findings": found}
        for x in found:
            print(f"live finding ({'during the fault' if x['true'] else 'outside it'}, onset {x['onset_s']:+} s from "
                  f"the fault): {x['detector']} {x['kind']}, top {x['top']}: {x['summary']}")
        with gzip.open(a.out, "wt") as fh:
            fh.write(json.dumps(head) + "\n")
            for r in rows:
                fh.write(json.dumps(r) + "\n")
        if a.steps_out:
            export_steps(layout.path("collector.db"), job, a.steps_out, head, a.steps_around)
        print(json.dumps({"out": a.out, "iterations": len(rows), **head["step_log"],
                          "live_findings_true": sum(x["true"] for x in found),
                          "live_findings_false": sum(not x["true"] for x in found)}))
    finally:
        netns.down(layout)
    return 0


STEP_KEYS = ("rank", "step", "start_ns", "end_ns", "pid", "start_ticks", "node_id", "evidence", "period_ops",
             "ops", "comms")


def export_steps(db: str, job: str, out: str, head: dict, around_s: float) -> int:
    """The stored Step rows (Reader.steps, with their comm summaries: what the irregularity and lateness detectors
    read) whose end lies within around_s seconds of the first fault's start, after a header line (head)."""
    from steplens.collector.store.queries import Reader
    at = head["faults"][0]["start_ns"]
    lo, hi = at - int(around_s * 1e9), at + int(around_s * 1e9)
    rows = [{k: r[k] for k in STEP_KEYS} for r in Reader(db).steps(job, since_ns=lo, with_comms=True)
            if r["end_ns"] <= hi]
    with gzip.open(out, "wt") as fh:
        fh.write(json.dumps({**head, "steps_around_seconds": around_s}) + "\n")
        for r in rows:
            fh.write(json.dumps(r, separators=(",", ":")) + "\n")
    return len(rows)


if __name__ == "__main__":
    raise SystemExit(main())
