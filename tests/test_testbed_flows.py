"""Testbed, black box (issue "Diagnosis III"): a live DP2 x PP2 gloo job seen only through eBPF flows.

The bed (bench/testbed): 4 network-namespace hosts h0..h3, one agent per host; only h0's agent runs the eBPF
netflows source (`up --flows-node h0`): the probes see every namespace's packets, so the whole job's TCP bursts.
The collector (netns.COLLECTOR_TOML: a flow analysis every 5 s over the newest 30 s) recognizes the job from
those flows alone (flowjobs.py) and matches it to the job its agents know from the processes (`source: both`).
Rank r runs on h<r>: stage r // 2, replica r % 2; DP pairs {h0, h1} and {h2, h3}, PP pairs {h0, h2} and {h1, h3}.
Checked:
  * the job with its 4 hosts' addresses, and every pair typed right (the gloo all-reduce of two is one
    exchange a step both ways at once: DP; the pipeline's 128 KiB messages go one way, then the other: PP);
  * per rank, the step time from the flows (each step ends with its DP exchange) within 1 % of the job's own
    step log over the same span (mean step time: per step, the optimizer's time after the exchange jitters by
    a few ms on this loaded 2-core bed), and within 1 % of the steps the agents' comm-op path (Flight
    Recorder + anchors, the `steps` table) gives the same job;
  * a link fault on h1 (tbf 200 Mbit/s, 20 s): a `flows` finding that began with it, naming h1's link (or h1)
    first once a few passes have seen the fault (each flow against its own directed pair's history: the
    pipeline's forward bursts hold compute between messages, its backward ones do not; and per direction of a
    host's link where it talks to two peers or more).
Figures are printed (-s)."""

from __future__ import annotations

import json
import os
import sqlite3
import statistics
import sys
import threading
import time

import pytest

from conftest import REPO, skip_module_unless_testbed, wait_for

pytestmark = [pytest.mark.testbed, pytest.mark.privileged, pytest.mark.slow]

skip_module_unless_testbed()

sys.path.insert(0, REPO)
from bench.testbed import faults, netns  # noqa: E402

IPS = {f"h{i}": netns.host_ip(i) for i in range(4)}
DP = {tuple(sorted((IPS["h0"], IPS["h1"]))), tuple(sorted((IPS["h2"], IPS["h3"])))}
PP = {tuple(sorted((IPS["h0"], IPS["h2"]))), tuple(sorted((IPS["h1"], IPS["h3"])))}


def _cli_json(layout, *args):
    res = netns.steplens_cli(layout, *args, "--json", timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout or "null")


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    layout = netns.Layout(state_dir=str(tmp_path_factory.mktemp("testbed-flows")))
    netns.down(layout)
    try:
        netns.up(layout, flows_node="h0")
        res = netns.steplens_cli(layout, "import", "topology", layout.path("topology.json"), "--json")
        assert res.returncode == 0, res.stderr
        netns.start_job(layout, dp=2, pp=2, steps=0)
        faults.wait_steps(layout, 5, timeout=240)
        time.sleep(35)   # the flow analysis's 30 s window past the start-up (rendezvous, the default group's mesh)

        def flow_job():
            for j in _cli_json(layout, "jobs"):
                if j["source"] in ("flows", "both") and len(j["endpoints"]) == 4 and j["steps"] >= 50:
                    return j
            return None
        job = wait_for(flow_job, 180, interval=2, what="a job recognized from the flows, with 50 steps")
        yield {"layout": layout, "job": job}
    finally:
        netns.down(layout)


def test_job_recognized_from_flows_with_its_hosts_and_pairs(bed):
    j = bed["job"]
    print(f"\nflow job: {json.dumps({k: j[k] for k in ('job_key', 'source', 'endpoints', 'nodes', 'pairs')})}")
    assert j["source"] == "both" and j["flow_sources"] == ["ebpf"]
    assert sorted(j["endpoints"]) == sorted(IPS.values()) and sorted(j["nodes"]) == sorted(IPS)
    got = {(p["a"], p["b"]): p["type"] for p in j["pairs"]}
    assert {k for k, t in got.items() if t == "dp"} == DP and {k for k, t in got.items() if t == "pp"} == PP, got


def _log_steps(layout, rank, lo, hi):
    with open(layout.path("steps", f"rank{rank}.jsonl")) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [r["step_seconds"] for r in rows if lo <= r["end_ns"] <= hi]


def test_flow_step_times_match_the_step_logs_and_the_comm_op_path(bed):
    layout, job = bed["layout"], bed["job"]
    time.sleep(5)
    rows = _cli_json(layout, "timeline", job["job_key"])
    by_rank: dict[int, list[dict]] = {}
    for r in rows:
        assert r["rank"] is not None, r   # a procs job is matched: every endpoint has its rank
        by_rank.setdefault(r["rank"], []).append(r)
    assert sorted(by_rank) == [0, 1, 2, 3]
    db = sqlite3.connect(f"file:{layout.path('collector.db')}?mode=ro", uri=True)
    figures = {}
    for rank, steps in sorted(by_rank.items()):
        lo, hi = min(s["start_ns"] for s in steps), max(s["end_ns"] for s in steps)
        flows = statistics.mean(s["step_seconds"] for s in steps)
        log = _log_steps(layout, rank, lo, hi)
        ops = [(e - s) / 1e9 for s, e in db.execute(
            "SELECT start_ns, end_ns FROM steps WHERE job_key = ? AND rank = ? AND end_ns BETWEEN ? AND ?",
            (job["job_key"], rank, lo, hi))]
        figures[rank] = {"steps_flows": len(steps), "steps_log": len(log), "steps_commops": len(ops),
                         "flows_s": round(flows, 5), "log_s": round(statistics.mean(log), 5),
                         "commops_s": round(statistics.mean(ops), 5) if ops else None}
        assert len(steps) >= 50 and abs(len(steps) - len(log)) <= 0.05 * len(log), figures[rank]
        assert abs(flows / statistics.mean(log) - 1) <= 0.01, (rank, figures[rank])
        assert ops and abs(flows / statistics.mean(ops) - 1) <= 0.01, (rank, figures[rank])
    print(f"\nstep times, flows vs step logs vs comm ops: {json.dumps(figures)}")


def test_link_fault_on_h1_is_found_from_the_flows(bed):
    layout = bed["layout"]
    time.sleep(35)   # a quiet window behind the fault (the analysis looks at the newest 30 s)
    t0 = time.time_ns()
    th = threading.Thread(target=faults.inject, args=(layout, "link", "h1", 20.0), kwargs={"rate": "200mbit"})
    th.start()
    found = None
    try:
        def flows_finding():
            # the one that began with the fault: a noise episode of this loaded bed may have begun (and ended)
            # within the same 3 s before it, so the most severe of those found
            near = [f for f in _cli_json(layout, "findings") if f["detector"] == "flows" and
                    f["kind"] in ("slowdown", "network") and abs(f["onset_ns"] - t0) <= 3e9]
            return max(near, key=lambda f: f["severity"], default=None)
        found = wait_for(flows_finding, 30, interval=1, what="a flows finding that began with the link fault")
        first_s = time.time_ns() - t0
        first_top = [(s["kind"], s["id"]) for s in found["suspects"][:3]]
        # the finding is updated by every analysis pass (every 5 s over the newest 30 s) while the fault lasts:
        # judged as an SRE reads it 12 s in, two passes on (the first pass may see a step or two of the fault,
        # too few flows of each pair to clear a healthy peer)
        time.sleep(max(0.0, 12.0 - (time.time_ns() - t0) / 1e9))
        found = flows_finding() or found
    finally:
        th.join()
    top = [(s["kind"], s["id"]) for s in found["suspects"][:3]]
    print(f"\nlink fault: {found['kind']} {found['severity']:.2f}x, onset {(found['onset_ns'] - t0) / 1e9:+.2f} s "
          f"from the fault, found {first_s / 1e9:.1f} s after it (suspects then {first_top}), 12 s in: suspects {top}: "
          f"{found['summary']}")
    assert found["severity"] > 1.5 and found["kind"] == "slowdown"
    assert top and top[0] in {("link", "h1.eth0"), ("nic", "h1.eth0"), ("node", "h1")}, top


def test_down_leaves_nothing(bed):
    res = netns.down(bed["layout"])
    assert res["namespaces_left"] == [] and res["cgroups_left"] == []
    assert not os.path.exists("/run/netns/sltb-c")
