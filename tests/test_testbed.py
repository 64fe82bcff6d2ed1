"""Testbed: 4 network-namespace hosts, real agents streaming over mutual TLS, a real gloo DP=2 x PP=2 job,
and each fault's pattern in the per-rank step logs (baseline phase, then fault phase, per kind).

Rank r is stage r // 2, replica r % 2: ranks 0/1 all-reduce together (stage 0), 2/3 likewise (stage 1);
0 sends to 2 and 1 to 3. Thresholds are loose multiples of the figures in FACTS.md, not exact numbers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO, wait_for

pytestmark = [pytest.mark.testbed, pytest.mark.privileged, pytest.mark.slow]

if os.geteuid() != 0:
    pytest.skip("the testbed needs root", allow_module_level=True)
if importlib.util.find_spec("torch") is None:  # checked without importing: this process must not map libtorch
    pytest.skip("the testbed needs torch (pip install '.[testbed]')", allow_module_level=True)
if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
    pytest.skip("no `ip netns`", allow_module_level=True)

sys.path.insert(0, REPO)
from bench.testbed import faults, netns  # noqa: E402

RESULTS: dict = {}


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    layout = netns.Layout(state_dir=str(tmp_path_factory.mktemp("testbed")))
    netns.down(layout)
    try:
        netns.up(layout)
        netns.start_job(layout, dp=2, pp=2, steps=0)
        faults.wait_steps(layout, 5, timeout=240)  # past start-up (imports, rendezvous) and the first steps
        yield layout
    finally:
        res = netns.down(layout)
        print("\nmeasured ratios:", json.dumps(RESULTS, indent=1))
        assert res["namespaces_left"] == [] and res["cgroups_left"] == []


def baseline(layout, n=6) -> dict[int, dict]:
    t0 = time.time_ns()
    faults.wait_steps(layout, n)
    t1 = time.time_ns()
    return {r: faults.summarize([s for s in faults.read_steps(layout, r) if s["start_ns"] >= t0 and s["end_ns"] <= t1])
            for r in range(4)}


def faulted(layout, entry, inside=True) -> dict[int, dict]:
    faults.wait_steps(layout, 2)  # the step that straddles the end is logged
    out = {}
    for r in range(4):
        steps = faults.window(layout, entry["start_ns"], entry["end_ns"], r)
        if inside:
            steps = [s for s in steps if s["start_ns"] >= entry["start_ns"] and s["end_ns"] <= entry["end_ns"]]
        out[r] = faults.summarize(steps)
    return out


def ratio(f, b, key="step_seconds") -> float:
    assert f["steps"] and b["steps"], f"no whole step inside a phase (machine overloaded?): fault {f}, base {b}"
    return f[key] / max(b[key], 1e-4)


def record(name, base, fault):
    RESULTS[name] = {r: {"step_x": round(ratio(fault[r], base[r]), 2), "fault_steps": fault[r]["steps"]}
                     for r in range(4)}


def test_agents_stream_to_the_collector(bed):
    def four():
        res = netns.steplens_cli(bed, "nodes", "--json")
        nodes = json.loads(res.stdout or "[]")
        return len(nodes) == 4 and all(n["records_stored"] > 0 for n in nodes) and nodes
    nodes = wait_for(four, 30, interval=0.5, what="4 nodes with stored records")
    assert sorted(n["node_id"] for n in nodes) == ["h0", "h1", "h2", "h3"]


def test_link_throttle_on_rank1(bed):
    base = baseline(bed)
    entry = faults.inject(bed, "link", "h1", 3.0, rate="200mbit")
    f = faulted(bed, entry)
    record("link 200mbit h1", base, f)
    assert all(f[r]["steps"] >= 2 for r in range(4)), f
    assert all(ratio(f[r], base[r]) > 2 for r in range(4)), RESULTS
    for r in (0, 1):  # the throttled DP pair waits in the all-reduce
        assert ratio(f[r], base[r], "allreduce_seconds") > 2, (r, f[r], base[r])
    for r in (2, 3):  # the next stage waits for activations and gradients
        assert ratio(f[r], base[r], "pipe_wait_seconds") > 2, (r, f[r], base[r])


def test_cpu_quota_on_rank1(bed):
    base = baseline(bed)
    entry = faults.inject(bed, "cpu", "rank1", 3.0, cpu_share=0.1)
    f = faulted(bed, entry)
    record("cpu 10% rank1", base, f)
    assert f[1]["steps"] >= 1
    assert ratio(f[1], base[1], "compute_seconds") > 2, (f[1], base[1])
    assert ratio(f[0], base[0], "allreduce_seconds") > 2, (f[0], base[0])  # its DP peer waits in the all-reduce
    assert ratio(f[3], base[3], "pipe_wait_seconds") > 2, (f[3], base[3])  # its next stage waits
    assert all(ratio(f[r], base[r]) > 1.8 for r in range(4)), RESULTS
    assert netns.cgroups_left() == []


def test_stop_rank1_shorter_than_the_timeout(bed):
    base = baseline(bed)
    entry = faults.inject(bed, "stop", "rank1", 2.0)
    f = faulted(bed, entry, inside=False)
    record("stop 2s rank1", base, f)
    RESULTS["stop 2s rank1"]["max_step_seconds"] = {r: round(f[r]["max_step_seconds"], 2) for r in range(4)}
    for r in range(4):  # one step of ~2 s on every rank, and only one
        steps = faults.window(bed, entry["start_ns"], entry["end_ns"], r)
        long = [s for s in steps if s["step_seconds"] > 1.0]
        assert len(long) == 1 and 1.8 < long[0]["step_seconds"] < 3.0, (r, [s["step_seconds"] for s in steps])
    assert all(netns.job_alive(bed).values())


def test_gc_storm_on_rank1(bed):
    base = baseline(bed)
    entry = faults.inject(bed, "gc_storm", "rank1", 3.0)
    f = faulted(bed, entry)
    record("gc_storm rank1", base, f)
    assert f[1]["gc_seconds"] > 0 and all(f[r]["gc_seconds"] == 0 for r in (0, 2, 3))
    assert all(ratio(f[r], base[r]) > 2 for r in range(4)), RESULTS
    assert ratio(f[0], base[0], "allreduce_seconds") > 2, (f[0], base[0])


def test_extra_sync_all_ranks(bed):
    base = baseline(bed)
    entry = faults.inject(bed, "extra_sync", "all", 1.5)
    f = faulted(bed, entry)
    record("extra_sync all", base, f)
    p = entry["params"]
    for r in range(4):  # every rank took the barrier on exactly the announced steps
        marked = [s["step"] for s in faults.read_steps(bed, r) if s["extra_sync"]]
        assert marked == list(range(p["start_step"], p["end_step"])), (r, marked, p)
        assert f[r]["sync_seconds"] > 0


def test_noisy_neighbour_on_h1(bed):
    base = baseline(bed)
    entry = faults.inject(bed, "noisy", "h1", 3.0, processes=2)
    f = faulted(bed, entry)
    record("noisy 2 procs h1", base, f)
    assert all(f[r]["steps"] >= 1 for r in range(4))
    # 2 burners against 4 ranks on 2 cores: the whole job slows (the CPU is shared, not the host's alone)
    assert sum(ratio(f[r], base[r]) for r in range(4)) / 4 > 1.2, RESULTS
    assert not [e for e in netns.recorded(bed) if e["name"].startswith("noisy") and netns.alive(e)]


def test_ground_truth_log(bed):
    kinds = [e["kind"] for e in faults.ground_truth(bed)]
    assert set(kinds) <= set(faults.KINDS) and kinds
    for e in faults.ground_truth(bed):
        assert e["start_ns"] < e["end_ns"] and e["target"]


def test_cli_help_and_status(tmp_path):
    for cmd in ("up", "run", "inject", "status", "down"):
        out = subprocess.run([sys.executable, "-m", "bench.testbed.cli", cmd, "--help"], cwd=REPO,
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and "usage" in out.stdout, out.stderr
    out = subprocess.run([sys.executable, "-m", "bench.testbed.cli", "--state-dir", str(tmp_path), "status"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "namespaces" in json.loads(out.stdout), out.stderr


def test_down_after_a_crash_mid_fault(bed):
    # runs last: the inject CLI dies (SIGKILL) with rank 1 in its CPU cgroup; `down` still removes everything
    inj = subprocess.Popen([sys.executable, "-m", "bench.testbed.cli", "--state-dir", bed.state_dir, "inject", "cpu",
                            "--target", "1", "--duration", "60"], cwd=REPO, stdout=subprocess.DEVNULL)
    wait_for(netns.cgroups_left, 30, what="the fault's cgroup")
    inj.kill()
    inj.wait(10)
    pids = [r["pid"] for r in netns.load_job(bed)["ranks"]] + [e["pid"] for e in netns.recorded(bed)]
    res = netns.down(bed)
    assert res["namespaces_left"] == [] and res["cgroups_left"] == [] and netns.list_namespaces() == []
    assert not [p for p in pids if os.path.exists(f"/proc/{p}") and netns._start_time(p) is not None]
    assert netns.down(bed)["namespaces_removed"] == []  # idempotent
