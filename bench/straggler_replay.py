"""Replay recorded Step rows through the real store and the irregularity detector, window after window, and score
the persistent-straggler findings against the recording's fault (issue "Sentinel": a 5 % slowdown of one rank).

Input: a file written by `bench/testbed_sentinel.py --steps-out` (gzip JSON lines: a header with the fault's
ground truth, then the stored Step rows of every rank with their comm summaries). The rows go through the agent
encoding into a fresh SQLite store (StoreWriter), then irregularity.detect runs on windows ending every --every
seconds of data time (from --warmup seconds after the first row), as the analysis loop would hand them. Only
findings of the persistent-straggler test are counted (evidence `straggler_steps`): per window end, the ranks
they name and the test that decided (`mean` or `median`, irregularity.lateness_z). The header is for scoring.

    .venv/bin/python bench/straggler_replay.py tests/fixtures/training/testbed-steps-slow5-rank1.jsonl.gz

Ends with one JSON line: windows, fault_rank, first_named_after_fault_s, windows_naming_fault_rank_during,
windows_naming_it_outside, windows_naming_others (with each other rank's window ends), wall_s.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from steplens.agent import records as r  # noqa: E402
from steplens.agent.transport.codec import encode_records  # noqa: E402
from steplens.collector.analysis.base import Window  # noqa: E402
from steplens.collector.analysis.irregularity import IrregularityConfig, detect  # noqa: E402
from steplens.collector.ingest.clock import ClockEstimate  # noqa: E402
from steplens.collector.store.queries import Reader  # noqa: E402
from steplens.collector.store.writer import BatchJob, StoreWriter  # noqa: E402

OFFSET = 5 * 10**12   # the replay's clock: cluster time = monotonic + OFFSET (the rows carry cluster times)
JOB = "replay:straggler"


def feed(rows: list[dict], path: str) -> Reader:
    """The rows as the agents of their nodes would send them (Step records, agent encoding), stored by the real
    writer; the Reader of the store."""
    by_node: dict[str, list] = {}
    for x in rows:
        st = r.Step(x["end_ns"] - OFFSET, x["pid"], x["start_ticks"], JOB, x["rank"], x["step"],
                    x["start_ns"] - OFFSET, x["end_ns"] - OFFSET, x["evidence"], x["period_ops"], x["ops"],
                    [r.StepComm(**c) for c in x["comms"]])
        by_node.setdefault(x["node_id"], []).append(("flightrec", st))
    clock = ClockEstimate(offset_ns=OFFSET, drift_ppm=0.0, ref_mono_ns=0, uncertainty_ns=1, best_rtt_ns=1, samples=5)
    w = StoreWriter(path)
    w.start()
    done: list = []
    sent = 0
    try:
        for node, recs in by_node.items():
            for i in range(0, len(recs), 500):
                part = recs[i:i + 500]
                w.submit(BatchJob(node, "ab" * 8, 1 + i // 500, len(part), encode_records(part),
                                  max(x.mono_ns for _, x in part) + 1, clock, time.time_ns(),
                                  lambda *a: done.append(a)))
                sent += 1
        deadline = time.monotonic() + 120
        while len(done) < sent and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        w.stop()
    bad = [d for d in done if d[0] != "stored"]
    if bad or len(done) < sent:
        raise SystemExit(f"the store did not take every batch: {len(done)} of {sent} answered, not stored: {bad[:3]}")
    return Reader(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("steps", help="a --steps-out file of bench/testbed_sentinel.py")
    ap.add_argument("--every", type=float, default=2.0, help="seconds of data between window ends")
    ap.add_argument("--warmup", type=float, default=10.0, help="first window end, seconds after the first row")
    a = ap.parse_args(argv)
    with gzip.open(a.steps, "rt") as fh:
        head = json.loads(fh.readline())
        rows = [json.loads(x) for x in fh]
    fault = head["faults"][0]
    target = fault["target"].removeprefix("rank")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        reader = feed(rows, os.path.join(d, "replay.db"))
        first, last = min(x["end_ns"] for x in rows), max(x["end_ns"] for x in rows)
        cfg = IrregularityConfig()
        named: list[tuple[float, str, str]] = []   # (window end from the fault's start, rank, test)
        windows = 0
        t = first + int(a.warmup * 1e9)
        while t <= last:
            windows += 1
            for f in detect(reader, Window(JOB, first, t), cfg):
                if "straggler_steps" in f.evidence:
                    tests = sorted({c.get("test", "mean") for c in f.evidence["comms"].values()})
                    named.append(((t - fault["start_ns"]) / 1e9, f.suspects[0].id, "+".join(tests)))
            t += int(a.every * 1e9)
    during = [(s, k, how) for s, k, how in named if 0 <= s * 1e9 <= fault["end_ns"] - fault["start_ns"]]
    for s, k, how in named:
        print(f"window ending {s:+8.1f} s from the fault's start: rank {k} persistently late (z by the {how})")
    hit = [s for s, k, _ in during if k == target]
    others: dict[str, list[float]] = {}
    for s, k, _ in named:
        if k != target:
            others.setdefault(k, []).append(round(s, 1))
    print(json.dumps({"windows": windows, "fault_rank": target,
                      "first_named_after_fault_s": round(min(hit), 1) if hit else None,
                      "windows_naming_fault_rank_during": len(hit),
                      "windows_naming_it_outside": sum(1 for s, k, _ in named if k == target) - len(hit),
                      "windows_naming_others": {k: len(v) for k, v in others.items()},
                      "other_window_ends_s": others, "wall_s": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
