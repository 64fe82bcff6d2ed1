"""The closed loop on the testbed (issue 17 acceptance): a fault injected into the live DP2 x PP2 gloo job -> a finding
-> a synchronized deep dive on all 4 hosts (started by the collector, analysis/deepdive.py) -> ranked causes on the
finding and its merged Perfetto trace.

Bed as in test_testbed_diagnosis.py (4 network-namespace hosts, one agent each over mutual TLS, the collector with
netns.COLLECTOR_TOML: a 6 s dive with an 8 s reference window, 20 s cool-down). Faults last FAULT_S (14 s) so that
the dive, which starts when the finding opens (2-4 s after the onset) plus its 0.5 s lead, lies inside the fault.

Per fault: within DIVE_WITHIN_S of the fault's start a finding that began with it carries a `deep_dive` with
status done, started on h0..h3 with the ModeChange records' spread <= 10 ms (cluster time), and causes; the top
cause must name the fault's rank (its host's rank for noisy: h2 -> 2) and kind: cpu -> cpu-throttled (the rank's
cgroup quota), gc_storm -> gc, stop -> stopped, noisy -> cpu-contention; link -> network on either end of the
shaped link (rank 0 or 1: their DP all-reduce is the only connection it holds back, and both of its ends look
alike) with the link it names having h1 at an end. Then
`steplens trace --finding ID` must write a trace that Perfetto's trace processor loads with 4 rank groups.
Figures per fault are printed (-s) and kept in RESULTS.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest

from conftest import REPO, skip_module_unless_testbed, wait_for

pytestmark = [pytest.mark.testbed, pytest.mark.privileged, pytest.mark.slow]

skip_module_unless_testbed()

sys.path.insert(0, REPO)
from bench.testbed import boundaries, faults, netns  # noqa: E402

FAULT_S = 14.0
DIVE_WITHIN_S = 40.0
SPREAD_NS = 10_000_000
H1 = f"{netns.SUBNET}.11"   # h1's address (hosts are .10 + i)
RESULTS: dict = {}
# kind -> (target, inject params, rank the top cause must name, its cause)
FAULTS = {
    "cpu": ("rank1", {"cpu_share": 0.1}, 1, "cpu-throttled"),
    "gc_storm": ("rank2", {}, 2, "gc"),
    "stop": ("rank3", {}, 3, "stopped"),
    "link": ("h1", {"rate": "200mbit"}, 1, "network"),
    "noisy": ("h2", {"processes": 2}, 2, "cpu-contention"),
}
@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    layout = netns.Layout(state_dir=str(tmp_path_factory.mktemp("testbed-deep")))
    netns.down(layout)
    try:
        netns.up(layout)
        res = netns.steplens_cli(layout, "import", "topology", layout.path("topology.json"), "--json")
        assert res.returncode == 0, res.stderr
        netns.start_job(layout, dp=2, pp=2, steps=0)
        faults.wait_steps(layout, 5, timeout=240)

        def job_with_steps():
            for j in json.loads(netns.steplens_cli(layout, "jobs", "--json").stdout or "[]"):
                ranks = {r["rank"]: r["node_id"] for r in j["ranks"]}
                steps = boundaries.stored_steps(layout, j["job_key"])
                if ranks == {r: f"h{r}" for r in range(4)} and \
                        min(sum(1 for s in steps if s["rank"] == r) for r in range(4)) >= 40:
                    return j["job_key"]
            return None
        job_key = wait_for(job_with_steps, 120, interval=2, what="40 Step records per rank")
        yield {"layout": layout, "job": job_key, "tmp": tmp_path_factory.mktemp("traces")}
    finally:
        res = netns.down(layout)
        print("\ntestbed deep dives:", json.dumps(RESULTS, indent=1))
        assert res["namespaces_left"] == [] and res["cgroups_left"] == []


def _findings(layout) -> list[dict]:
    return json.loads(netns.steplens_cli(layout, "findings", "--json").stdout or "[]")


def _quiet(layout, timeout: float = 60.0) -> None:
    faults.wait_steps(layout, 30)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout and json.loads(
            netns.steplens_cli(layout, "findings", "--open", "--json").stdout or "[]"):
        time.sleep(1.0)


# noisy was xfail (every rank's run-queue wait rose alike) until faults.py put the burners and h2's ranks into one
# cgroup, a host's CPU of its own; it then passed in every run recorded since (four, bench/README.md) and is asserted.
@pytest.mark.parametrize("kind", list(FAULTS))
def test_fault_finding_deep_dive_ranked_cause_and_trace(bed, kind):
    layout = bed["layout"]
    target, params, rank, cause = FAULTS[kind]
    _quiet(layout)
    time.sleep(20)   # the previous dive's cool-down (netns.COLLECTOR_TOML)
    box: dict = {}

    def run():
        try:
            box["entry"] = faults.inject(layout, kind, target, FAULT_S, **params)
        except BaseException as exc:
            box["error"] = exc
    t0 = time.time_ns()
    th = threading.Thread(target=run)
    th.start()

    def dove():
        for f in _findings(layout):
            d = f.get("deep_dive")
            if f["job_key"] == bed["job"] and d and d["status"] in ("done", "failed") and \
                    t0 - 2e9 <= f["onset_ns"] <= t0 + FAULT_S * 1e9 and d["start_ns"] >= t0:
                return f
        return None
    f = wait_for(dove, DIVE_WITHIN_S, interval=1.0, what=f"a finding of the {kind} fault with a finished deep dive")
    th.join(FAULT_S + 60)
    assert "error" not in box, box.get("error")
    d = f["deep_dive"]
    top = d["causes"][0] if d["causes"] else None
    rec = RESULTS[kind] = {
        "finding": {"kind": f["kind"], "detector": f["detector"], "onset_after_fault_s": round((f["onset_ns"] - t0) /
                                                                                             1e9, 2)},
        "dive_start_after_fault_s": round((d["start_ns"] - t0) / 1e9, 2), "status": d["status"], "note": d["note"],
        "nodes": d["nodes"], "start_spread_ms": None if d["start_spread_ns"] is None else d["start_spread_ns"] / 1e6,
        "causes": [(c["rank"], c["kind"], c["id"], c["cause"], c["score"]) for c in d["causes"][:5]],
        "data": d["data"]}
    print(f"\n{kind}: {json.dumps(rec)}")
    assert d["status"] == "done", rec
    assert sorted(d["started"]) == ["h0", "h1", "h2", "h3"], rec
    assert d["start_spread_ns"] <= SPREAD_NS, rec
    # the merged trace of the dive (with its reference window) loads in Perfetto's trace processor
    out = os.path.join(str(bed["tmp"]), f"{kind}.pftrace")
    res = netns.steplens_cli(layout, "trace", bed["job"], "--finding", f["id"], "-o", out, "--json", timeout=240)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    rec["trace"] = {k: summary["counts"].get(k) for k in ("stack", "commop", "step", "flows", "deep_window")}
    from perfettotp import TraceProcessorWasm, unavailable
    if not unavailable():
        with TraceProcessorWasm.load(out) as tp:
            names = [t["name"] for t in tp.query("select name from track where name like 'rank %'")]
            deep = tp.query("select count(*) as n from slice s join track t on s.track_id = t.id"
                            " where t.name = 'deep dives'")[0]["n"]
        rec["trace"]["rank_tracks"], rec["trace"]["deep_windows"] = len(names), deep
        assert len(names) == 4 and deep >= 4, rec
    if kind == "link":
        # the shaped link's one loaded connection is the DP all-reduce between h0 and h1 (the pipeline sends to and
        # from h1 are too light to be held back): its two ends look alike, so either may lead; the cause must be
        # the network and the link it names the one with h1's address at an end
        assert top is not None and top["cause"] == "network" and top["rank"] in (0, 1), rec
        link = top["evidence"]["links"][0]
        rec["top_link"] = link
        assert H1 in (link["a"], link["b"]), rec
        return
    assert top is not None and (top["rank"], top["cause"]) == (rank, cause), rec
