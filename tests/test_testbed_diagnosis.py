"""Testbed diagnosis (issue 13 acceptance): faults injected into a live DP2 x PP2 gloo job, found by the collector.

The bed: 4 network-namespace hosts h0..h3 (bench/testbed), one real agent per host streaming over mutual TLS to
a real collector (analysis loop every second, detector windows for a ~0.1 s step: netns.COLLECTOR_TOML), the
testbed's topology imported, and the real gloo job launched under the steplens bootstrap (Flight Recorder plus
optimizer-step anchors). Rank r is stage r // 2, replica r % 2 on host h<r>: ranks 0/1 all-reduce together,
2/3 likewise; 0 sends to 2 and 1 to 3.

Per fault (`faults.inject`, in a thread while the test watches): the findings stream (`steplens findings
--watch`, the operator CLI in the collector's namespace) must carry, within 30 s of the fault's onset, a
finding that began with the fault (onset within ONSET_SLACK_S of its start or end: the first slow step began
before the fault did) and that names the right rank or host among its first two suspects. What is right:
  cpu, stop, gc_storm on rank 1: rank "1". Among the first two, not first: with gloo the agents see the DP
      all-reduces only (Flight Recorder records no isend/recv and no completion times), so the evidence is who
      arrives last at each all-reduce. Rank 1 is late into {0, 1}'s; rank 3, which waits for rank 1's
      activations, is late into {2, 3}'s just as much, and nothing stored says that rank 3 waited for rank 1:
      the two tie (scores within ~15 % in either order, measured) and either comes first. A 2 s stop that
      lands while rank 1 is inside its all-reduce or optimizer step makes no arrival late at all: the test
      asserts its detection and marks the attribution xfail when it misses (ATTRIBUTION_XFAIL).
  link on h1: the host h1 as rank "1" (its only rank), node "h1" or its NIC/link "h1.eth0". Not attributable
      with this data: no transfer times, so irregularity names no network device and commtime stays silent;
      the suspects are again whoever arrives last, ranks 1/3 in some runs and 0/2 in others. The test asserts
      the detection and marks the attribution xfail when it misses (ATTRIBUTION_XFAIL).
  noisy on h1: rank "1" or node "h1". The namespaces share the VM's 2 cores, so faults.py puts the burners
      and h1's rank into one cgroup for the fault (the CPU that host has: cpu.shares of one process); without
      it, all four ranks slowed alike (1.7-1.85x) and no host metric told h1 from the others (this test's xfail
      until 2026-12-04). Now rank 1 waits on its run queue behind the burners while the others keep their CPU.
Cause (issue 14, collector/analysis/causes.py): within the same 30 s, a finding that began with the fault must lead
with a suspect carrying the fault's cause (CAUSE): link -> network (its connections' RTT up while their senders
are held back by the network: tcpinfo), cpu -> cpu-throttled (the rank's cgroup throttled time: host), stop ->
stopped (procs state T; the stopped rank is added first where no detector named it), gc_storm -> gc (the
bootstrap's GC timing), noisy -> cpu-contention (run-queue wait up on a host already saturated). Measured
2026-11-24, last run: every fault found and its cause right at the top suspect 2.1-4.0 s after the onset (link
network 2.9 s with rank 1 first, cpu cpu-throttled 2.2 s, stop stopped 4.0 s, gc_storm gc 2.1 s, noisy
cpu-contention 3.3 s); in an earlier run the 2 s stop's single-step spike was judged before the stop's Event had
reached the collector (no cause). A second suspect still gets `network` at times under CPU faults.
Before each fault the test waits for the previous findings to resolve (6 s of data time without confirmation;
up to 40 s, then it goes on and records what stayed open).

Step boundaries: the agents' Step records in the collector's store against the job's own step logs
(steps/rank<r>.jsonl, wall clock), steps away from the faults: median |end error| as a fraction of the median
step time, per rank (bench/testbed_steps.py measures the same on a quiet bed). With the optimizer-step anchors
alone, measured 2026-11-24 over five runs: 0.83-1.25 % (1.0-1.25 % at ~80 ms steps, 0.90-1.0 % at ~85 ms,
0.83-0.90 % at ~105 ms), a phase of -0.75..-1.0 ms (the job's zero_grad(set_to_none=False) after opt.step()),
0.13-0.24 % after it, durations 0.19-0.40 %. With the zero_grad's end anchored too (steplens_anchors), one run
2026-11-24 (~115 ms steps, loaded machine): 0.042-0.082 % per rank, phase -0.05..-0.09 ms, 0.002-0.012 % after
it, durations 0.003-0.004 %; asserted with margin: <= 1 %, |phase| <= 0.3 ms, <= 0.5 % after the phase,
durations <= 1 %.
Figures per run are printed (-s) and kept in RESULTS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, skip_module_unless_testbed, wait_for

pytestmark = [pytest.mark.testbed, pytest.mark.privileged, pytest.mark.slow]

skip_module_unless_testbed()

sys.path.insert(0, REPO)
from bench.testbed import boundaries, faults, netns  # noqa: E402

DETECT_WITHIN_S = 30.0
ONSET_SLACK_S = 1.0
RESULTS: dict = {}

# kind -> (target, duration s, inject params, suspects that are right, top-k they must be in; 0: not judged)
FAULTS = {
    "link": ("h1", 6.0, {"rate": "200mbit"},
             {("rank", "1"), ("node", "h1"), ("link", "h1.eth0"), ("nic", "h1.eth0")}, 2),
    "cpu": ("rank1", 6.0, {"cpu_share": 0.1}, {("rank", "1")}, 2),
    "stop": ("rank1", 2.0, {}, {("rank", "1")}, 2),
    "gc_storm": ("rank1", 6.0, {}, {("rank", "1")}, 2),
    "noisy": ("h1", 6.0, {"processes": 2}, {("rank", "1"), ("node", "h1")}, 2),
}
# the cause the finding's top suspect must carry (collector/analysis/causes.py), from the agents' own evidence
CAUSE = {"link": "network", "cpu": "cpu-throttled", "stop": "stopped", "gc_storm": "gc", "noisy": "cpu-contention"}
# found, but the right suspect is not always among the first two: why (the test marks these xfail when it is not)
ATTRIBUTION_XFAIL = {
    "link": "found, but not attributed to h1: with gloo the Step records hold each rank's arrival at its DP "
            "all-reduce only (no transfer times, no isend/recv), so the suspects are whoever arrives last, rank "
            "1/3 in some runs and rank 0/2 in others; irregularity names no network device without transfer "
            "times and commtime stays silent",
    "stop": "found, but not attributed to rank 1 when the SIGSTOP lands while rank 1 is inside its all-reduce "
            "or optimizer step (~30 % of its step): rank 0 is then held inside the same all-reduce, both leave "
            "it together and no arrival is late; the stall shows only in completion times (none with gloo) "
            "or in the process's state (stopped, no CPU for 2 s), which no detector reads",
}

class FindingsWatch:
    """`steplens findings --watch` in the collector's namespace: every event with the time it arrived here."""

    def __init__(self, layout: netns.Layout) -> None:
        self.events: list[tuple[int, str, dict]] = []
        self.proc = subprocess.Popen(["ip", "netns", "exec", netns.COLLECTOR_NS, netns.bin_path("steplens"),
                                      *netns.operator_args(layout), "findings", "--watch"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            self.events.append((time.time_ns(), ev["event"], ev["finding"]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def open_findings(layout) -> list[dict]:
    res = netns.steplens_cli(layout, "findings", "--open", "--json")
    return json.loads(res.stdout or "[]")


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    layout = netns.Layout(state_dir=str(tmp_path_factory.mktemp("testbed-diag")))
    netns.down(layout)
    watch = None
    t0 = time.monotonic()
    try:
        netns.up(layout)
        res = netns.steplens_cli(layout, "import", "topology", layout.path("topology.json"), "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["nodes"] == 4
        netns.start_job(layout, dp=2, pp=2, steps=0)
        faults.wait_steps(layout, 5, timeout=240)  # past start-up (imports, rendezvous) and the first steps
        watch = FindingsWatch(layout)

        def job_with_steps():
            jobs = json.loads(netns.steplens_cli(layout, "jobs", "--json").stdout or "[]")
            for j in jobs:
                ranks = {r["rank"]: r["node_id"] for r in j["ranks"]}
                steps = boundaries.stored_steps(layout, j["job_key"])
                per = {r: sum(1 for s in steps if s["rank"] == r) for r in range(4)}
                if ranks == {r: f"h{r}" for r in range(4)} and min(per.values()) >= 40:
                    return j["job_key"]
            return None
        job_key = wait_for(job_with_steps, 120, interval=2, what="40 Step records per rank, each from its own host")
        RESULTS["bring_up_seconds"] = round(time.monotonic() - t0, 1)
        yield {"layout": layout, "watch": watch, "job": job_key, "faults": []}
    finally:
        if watch is not None:
            watch.stop()
        res = netns.down(layout)
        print("\ntestbed diagnosis:", json.dumps(RESULTS, indent=1))
        assert res["namespaces_left"] == [] and res["cgroups_left"] == []


def wait_quiet(bed, timeout: float = 40.0) -> dict:
    """A baseline again: 30 more steps on every rank, then no open finding (the last one resolved) or, after
    `timeout`, go on and record what stayed open."""
    t0 = time.monotonic()
    faults.wait_steps(bed["layout"], 30)
    left = open_findings(bed["layout"])
    while left and time.monotonic() - t0 < timeout:
        time.sleep(1.0)
        left = open_findings(bed["layout"])
    return {"quiet_wait_seconds": round(time.monotonic() - t0, 1),
            "left_open": [(f["kind"], f["summary"][:80]) for f in left]}


def matches(f: dict, start_ns: int, end_ns: int, right: set, top: int) -> bool:
    """The finding began with the fault (onset within [start - ONSET_SLACK_S, end + ONSET_SLACK_S]) and names a
    right suspect among its first `top` (0: any suspects, or none)."""
    if not (start_ns - ONSET_SLACK_S * 1e9 <= f["onset_ns"] <= end_ns + ONSET_SLACK_S * 1e9):
        return False
    if top == 0:
        return True
    return any((s["kind"], s["id"]) in right for s in f["suspects"][:top])


def _why(f: dict):
    """The top suspect's causes (a rank's evidence) or the reason it was put there (a node's)."""
    why = f["suspects"][0]["evidence"].get("why") if f["suspects"] else None
    return why.get("causes") if isinstance(why, dict) else why


@pytest.mark.parametrize("kind", list(FAULTS))
def test_fault_is_found_naming_the_right_rank_or_host(bed, kind):
    layout, watch = bed["layout"], bed["watch"]
    target, duration, params, right, top = FAULTS[kind]
    quiet = wait_quiet(bed)
    seen = len(watch.events)
    box: dict = {}

    def run():
        try:
            box["entry"] = faults.inject(layout, kind, target, duration, **params)
        except BaseException as exc:  # reported by the test body
            box["error"] = exc
    t_call = time.time_ns()
    th = threading.Thread(target=run)
    th.start()
    first = hit = caused = None  # the first finding that began with the fault; ... that also names a right
    # suspect; ... whose top suspect carries the fault's cause
    while time.time_ns() - t_call < (DETECT_WITHIN_S + 2) * 1e9:
        for recv_ns, event, f in watch.events[seen:]:
            if event in ("opened", "updated") and f["job_key"] == bed["job"]:
                if first is None and matches(f, t_call, t_call + int(duration * 1e9), right, 0):
                    first = (recv_ns, event, f)
                if hit is None and matches(f, t_call, t_call + int(duration * 1e9), right, top):
                    hit = (recv_ns, event, f)
                if caused is None and matches(f, t_call, t_call + int(duration * 1e9), right, 0) and \
                        f["suspects"] and f["suspects"][0]["cause"] == CAUSE[kind]:
                    caused = (recv_ns, event, f)
        if (hit and caused) or (not th.is_alive() and "error" in box):
            break
        time.sleep(0.2)
    th.join(duration + 60)
    assert "error" not in box, box.get("error")
    entry = box["entry"]
    bed["faults"].append(entry)
    mine = [f for _, ev, f in watch.events[seen:] if f["job_key"] == bed["job"] and ev in ("opened", "updated")]
    RESULTS[kind] = rec = {
        "target": entry["target"], **quiet,
        "findings": [{"kind": f["kind"], "detector": f["detector"], "onset_after_fault_s":
                      round((f["onset_ns"] - entry["start_ns"]) / 1e9, 2), "severity": f["severity"],
                      "top": [(s["kind"], s["id"], s["cause"], s["score"]) for s in f["suspects"][:3]],
                      "why": _why(f)}
                     for f in {f["id"]: f for f in mine}.values()]}
    for name, got in (("detected", first), ("named", hit), ("caused", caused)):
        if got:
            recv_ns, event, f = got
            rec[name] = {"after_onset_s": round((recv_ns - entry["start_ns"]) / 1e9, 2), "kind": f["kind"],
                         "onset_after_fault_s": round((f["onset_ns"] - entry["start_ns"]) / 1e9, 2),
                         "top": [(s["kind"], s["id"], s["cause"]) for s in f["suspects"][:3]],
                         "top1_right": bool(f["suspects"]) and (f["suspects"][0]["kind"], f["suspects"][0]["id"])
                         in right}
    print(f"\n{kind}: {json.dumps(rec)}")
    assert netns.cgroups_left() == [] and all(netns.job_alive(layout).values())
    assert first is not None, f"no finding began with the {kind} fault within {DETECT_WITHIN_S} s: {json.dumps(rec)}"
    assert (first[0] - entry["start_ns"]) / 1e9 <= DETECT_WITHIN_S
    assert caused is not None, f"no finding of the {kind} fault whose top suspect has cause {CAUSE[kind]!r} " \
                               f"within {DETECT_WITHIN_S} s: {json.dumps(rec)}"
    if hit is None and kind in ATTRIBUTION_XFAIL:
        pytest.xfail(ATTRIBUTION_XFAIL[kind])
    assert hit is not None, f"no finding naming {sorted(right)} in the top {top} within {DETECT_WITHIN_S} s " \
                            f"of the {kind} fault: {json.dumps(rec)}"
    assert (hit[0] - entry["start_ns"]) / 1e9 <= DETECT_WITHIN_S


def test_step_boundaries_match_the_job_step_logs(bed):
    """The agents' Step ends against the job's own, away from the faults (1 s before to 5 s after each)."""
    layout = bed["layout"]
    faults.wait_steps(layout, 20)
    time.sleep(3)  # the last steps' records reach the store (flightrec polls every second)
    away = [(e["start_ns"] - 1_000_000_000, e["end_ns"] + 5_000_000_000) for e in bed["faults"]]
    figures = boundaries.figures(layout, bed["job"], exclude=away)
    RESULTS["step_boundaries"] = figures
    print(f"\nstep boundaries: {json.dumps(figures)}")
    for r in range(4):
        f = figures[r]
        assert f["steps"] >= 50 and f["evidence"] == ["anchor"], (r, f)
        # the goal is 1 %: the boundary is the end of the job's zero_grad after its optimizer step (the anchors
        # without it, at the optimizer step's end, left a constant -0.8..-0.9 ms phase, 1.2 % of a 71 ms quiet
        # step); what is left is the jitter (module docstring) and the collector's clock-offset estimate
        assert f["median_abs_error"] <= 0.01 and abs(f["phase_ms"]) <= 0.3, (r, f)
        assert f["median_error_after_phase"] <= 0.005 and f["median_duration_error"] <= 0.01, (r, f)


def test_down_leaves_nothing(bed):
    layout = bed["layout"]
    bed["watch"].stop()
    pids = [r["pid"] for r in netns.load_job(layout)["ranks"]] + [e["pid"] for e in netns.recorded(layout)]
    res = netns.down(layout)
    assert res["namespaces_left"] == [] and res["cgroups_left"] == [] and netns.list_namespaces() == []
    assert not [p for p in pids if netns._start_time(p) is not None]
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert layout.state_dir not in ps and not os.path.exists("/run/netns/sltb-c")
