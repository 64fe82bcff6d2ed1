"""Testbed sentinel for training (issue 16 acceptance): a workload-aware step-time baseline and a 5 % slowdown.

The bed: 4 network-namespace hosts, one real agent per host, a real collector (netns.COLLECTOR_TOML: analysis every
second, the sentinel with its defaults but a 40 s window), the DP2 x PP2 gloo job under the steplens bootstrap with
`--vary-micro 2:6`: each step runs 2 to 6 micro-batches (one seed, all ranks alike), so the step time varies ~2.5x
with the workload. STEPLENS_STEP_FEATURES names the job's loop locals (micro_batches, tokens) that the bootstrap's
optimizer-step hook reads into each "train" Iteration (steplens_iters); the agents' iters source sends them.

Asserted:
  * every rank's Iterations reach the store with the job's own micro-batch counts (checked against the step logs,
    steps/rank<r>.jsonl) and boundaries within 0.1 % of the step time (median, against the logs' ends);
  * the sentinel's baseline explains the step time from the workload (out-of-fold R² in the finding's evidence;
    without features a step's time would be unexplained);
  * quiet before the fault: no sentinel finding;
  * rank 1 made 5 % slower in its compute (faults `slow`, job.py) for 25 s: a sentinel `slowdown` finding on the
    job whose onset is within the fault, within 30 s of its start.
Figures printed (-s) and kept in RESULTS.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time

import pytest

from conftest import REPO, skip_module_unless_testbed, wait_for

pytestmark = [pytest.mark.testbed, pytest.mark.privileged, pytest.mark.slow]

skip_module_unless_testbed()

sys.path.insert(0, REPO)
from bench.testbed import boundaries, cli, faults, netns  # noqa: E402

RESULTS: dict = {}


def _reader(layout):
    from steplens.collector.store.queries import Reader
    return Reader(layout.path("collector.db"))


def _sentinel_findings(layout) -> list[dict]:
    res = netns.steplens_cli(layout, "findings", "--json")
    return [f for f in json.loads(res.stdout or "[]") if f["detector"] == "sentinel"]


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    layout = netns.Layout(state_dir=str(tmp_path_factory.mktemp("testbed-sentinel")))
    netns.down(layout)
    t0 = time.monotonic()
    try:
        netns.up(layout)
        env = {r: {"STEPLENS_STEP_FEATURES": cli.STEP_FEATURES} for r in range(4)}
        netns.start_job(layout, dp=2, pp=2, steps=0, env_faults=env, extra_args=["--vary-micro", "2:6"])
        faults.wait_steps(layout, 5, timeout=240)
        job = wait_for(lambda: boundaries.job_key(layout) or None, 120, interval=2, what="the job's key")
        RESULTS["bring_up_seconds"] = round(time.monotonic() - t0, 1)
        yield {"layout": layout, "job": job}
    finally:
        res = netns.down(layout)
        print("\ntestbed sentinel:", json.dumps(RESULTS, indent=1))
        assert res["namespaces_left"] == [] and res["cgroups_left"] == []


def test_iterations_carry_the_workload_and_exact_boundaries(bed):
    layout, job = bed["layout"], bed["job"]
    reader = _reader(layout)

    def enough():
        rows = reader.iterations(job)
        per = {r: sum(1 for x in rows if x["rank"] == r) for r in range(4)}
        return rows if min(per.values()) >= 60 else None
    rows = wait_for(enough, 180, interval=2, what="60 Iterations per rank")
    assert {x["phase"] for x in rows} == {"train"}
    for r in range(4):
        log = {s["end_ns"]: s for s in faults.read_steps(layout, r)}
        ends = sorted(log)
        mine = [x for x in rows if x["rank"] == r]
        errs, agree = [], 0
        for x in mine[1:]:
            i = min(range(len(ends)), key=lambda k: abs(ends[k] - x["end_ns"]))
            s = log[ends[i]]
            errs.append(abs(ends[i] - x["end_ns"]) / (s["step_seconds"] * 1e9))
            agree += x["micro_batches"] == s["micro_batches"] and x["tokens"] == s["tokens"]
        RESULTS[f"rank{r}"] = {"iterations": len(mine), "median_end_error_pct": round(100 * statistics.median(errs), 4),
                               "workload_agrees": round(agree / len(errs), 4)}
        assert agree / len(errs) >= 0.99, RESULTS[f"rank{r}"]
        assert statistics.median(errs) <= 0.001, RESULTS[f"rank{r}"]


def test_five_percent_slowdown_is_a_sentinel_finding(bed):
    layout, job = bed["layout"], bed["job"]
    # the baseline: the sentinel fits on 200 steps per rank (fit_iterations_training), then judges; quiet meanwhile
    wait_for(lambda: min(sum(1 for x in _reader(layout).iterations(job) if x["rank"] == r) for r in range(4)) >= 320
             or None, 240, interval=2, what="320 Iterations per rank")
    quiet = _sentinel_findings(layout)
    RESULTS["quiet_findings"] = [(f["summary"][:90], f["severity"]) for f in quiet]
    before = len(faults.read_steps(layout, 1))
    box: dict = {}
    th = threading.Thread(target=lambda: box.update(faults.inject(layout, "slow", "1", 25.0, slow_fraction=0.05)))
    th.start()
    found = None
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 40 and found is None:
            time.sleep(1.0)
            start = box.get("start_ns") or time.time_ns() - int((time.monotonic() - t0) * 1e9)
            found = next((f for f in _sentinel_findings(layout) if f["onset_ns"] >= start - 10**9), None)
            found_ns = time.time_ns()
    finally:
        th.join(60)
    steps = faults.read_steps(layout, 1)
    on = [s for s in steps[before:] if s.get("slow")]
    off = [s for s in steps[max(0, before - 200):before]]
    per_micro = {}
    for name, ss in (("off", off), ("on", on)):
        per_micro[name] = statistics.median(s["step_seconds"] / s["micro_batches"] for s in ss) if ss else 0
    RESULTS["slow"] = {"steps_slowed": len(on), "step_per_micro_ratio":
                       round(per_micro["on"] / per_micro["off"], 4) if per_micro["off"] else None}
    assert found is not None, (RESULTS, _sentinel_findings(layout))
    RESULTS["finding"] = {"onset_after_s": round((found["onset_ns"] - box["start_ns"]) / 1e9, 2),
                          "seen_after_s": round((found_ns - box["start_ns"]) / 1e9, 2),
                          "severity": found["severity"], "evidence": found["evidence"]}
    assert box["start_ns"] - 10**9 <= found["onset_ns"] <= box["end_ns"], RESULTS
    assert found["kind"] == "slowdown" and found["evidence"]["fit_r2"] > 0.5, RESULTS
    assert not quiet, RESULTS
