"""The multi-job cluster simulator (bench/sim/cluster.py): the 19-job layout on 2,880 GPUs, every job GPU in
the flow stream with cluster ids, truth pairs and steps, fault mapping (a congested leaf, a slow link), the
flow file the collector imports, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pytest

from conftest import REPO

sys.path.insert(0, REPO)

from bench.sim.cluster import (CLUSTER, ClusterFault, ClusterJob, check_jobs, layout,  # noqa: E402
                               parse_cluster_fault, simulate_cluster)
from bench.sim.model import ModelConfig  # noqa: E402
from collector.cli.ops import read_flow_file  # noqa: E402

WINDOW_S = 15.0


@pytest.fixture(scope="module")
def full():
    """The whole seed-0 cluster over a short window: (jobs, run, flows as dicts)."""
    jobs = layout(0)
    run = simulate_cluster(jobs, window_s=WINDOW_S)
    return jobs, run, list(run.flows())


def job_cfg(**kw) -> ModelConfig:
    base = dict(micro_batches=2, nodes_per_leaf=4, spines=4, jitter_cv=0.0, dp_bucket_bytes=25 << 20, seed=1)
    return ModelConfig(**{**base, **kw})


def key(f: dict) -> tuple:
    """A flow's identity across runs (its start and duration may move)."""
    return f["src"], f["dst"], f["bytes"], tuple(f["switches"])


def test_layout_fills_the_cluster():
    jobs = layout(0)
    assert len(jobs) == 19
    sizes = sorted(j.cfg.gpus for j in jobs)
    assert sizes[0] == 8 and sizes[-1] == 1024
    assert sum(j.leaves for j in jobs) == CLUSTER.leaves == 90
    gpus = [g for j in jobs for g in j.gpus()]
    assert len(gpus) == len(set(gpus)) and max(gpus) < CLUSTER.gpus
    assert all(j.first_node % CLUSTER.nodes_per_leaf == 0 for j in jobs)
    check_jobs(jobs)
    assert [j.cfg.gpus for j in layout(0)] == [j.cfg.gpus for j in jobs]
    assert [j.cfg.gpus for j in layout(1)] != [j.cfg.gpus for j in jobs]      # the seed shuffles the placement
    assert len({j.cfg.base_ns for j in jobs}) == 19 and len({j.cfg.grad_bytes for j in jobs}) > 10
    bad = ClusterJob("x", job_cfg(dp=2, pp=1, tp=8), jobs[0].first_node)  # on another job's node
    with pytest.raises(ValueError, match="share node"):
        check_jobs(jobs + [bad])
    with pytest.raises(ValueError, match="leaf boundary"):
        check_jobs([ClusterJob("x", job_cfg(dp=2, pp=1, tp=8), 2)])


def test_every_job_gpu_sends_or_receives(full):
    jobs, run, flows = full
    seen = {f["src"] for f in flows} | {f["dst"] for f in flows}
    for job in jobs:
        missing = {CLUSTER.ip(g) for g in job.gpus()} - seen
        assert not missing, (job.name, sorted(missing)[:4])
    assert len(run) == len(flows) > 100_000


def test_flows_carry_cluster_ids(full):
    jobs, run, flows = full
    topo = run.topology_file()
    ips = {nic["ip"] for n in topo["nodes"] for nic in n["nics"]}
    switches = {s["id"] for s in topo["switches"]}
    assert len(ips) == CLUSTER.gpus and len(switches) == 94
    lo = run.truth()["cluster"]["start_ns"]
    assert [f["start"] for f in flows] == sorted(f["start"] for f in flows)
    assert lo <= flows[0]["start"] and flows[-1]["start"] < lo + WINDOW_S * 1e9
    leaf_of = {nic["ip"]: nic["switch"] for n in topo["nodes"] for nic in n["nics"]}
    for f in flows[::97]:
        assert f["src"] in ips and f["dst"] in ips and set(f["switches"]) <= switches
        assert f["switches"][0] == leaf_of[f["src"]] and f["switches"][-1] == leaf_of[f["dst"]]
        assert f["bytes"] > 0 and f["duration"] > 0
    assert {len(f["switches"]) for f in flows} == {1, 3}


def test_truth_pairs_and_steps(full):
    jobs, run, flows = full
    truth = run.truth()
    assert truth["cluster"]["flows"] == len(flows) and truth["cluster"]["jobs"] == 19
    assert json.loads(json.dumps(truth)) == truth
    pairs = {frozenset((f["src"], f["dst"])) for f in flows}
    owner = {}
    for tj, job in zip(truth["jobs"], jobs):
        assert tj["gpus"] == job.gpus() and tj["ips"] == [CLUSTER.ip(g) for g in job.gpus()]
        assert tj["shape"]["dp"] * tj["shape"]["pp"] * tj["shape"]["tp"] == len(tj["gpus"])
        for p in tj["pairs"]:
            assert p["a"] < p["b"] and p["types"] and set(p["types"]) <= {"dp", "pp", "ep"}
            owner[frozenset((p["a"], p["b"]))] = tj["name"]
        lo, hi = truth["cluster"]["start_ns"], truth["cluster"]["start_ns"] + WINDOW_S * 1e9
        assert set(tj["steps"]) == set(tj["ips"])
        for steps in tj["steps"].values():               # consecutive iterations, each after the last
            assert steps and steps[0][1] >= tj["base_ns"]
            for (i, a, b), (j, c, d) in zip(steps, steps[1:]):
                assert j == i + 1 and a < b <= c < d
            assert all(b > lo and a < hi for _, a, b in steps)
    assert set(owner) == pairs                            # every flow's pair is in exactly one job's truth
    assert {"ep"} <= {t for tj in truth["jobs"] for p in tj["pairs"] for t in p["types"]}


def test_pair_types_of_small_jobs(tmp_path):
    """Two hand-checkable jobs. 'moe' DP=4 x PP=2, EP=2, one GPU per node at cluster node 8 (rank r = s*4 + d on
    node 8 + r): DP rings 0-1-2-3 and 4-5-6-7, all-to-alls {0,1} {2,3} {4,5} {6,7}, expert rings {0,2} {1,3}
    {4,6} {5,7}, pipeline sends r <-> r+4. 'tiny' 2x2x2 on 4 GPUs of nodes 0 and 1: DP and TP inside a node,
    only its pipeline crosses, and devices 4-7 stay idle."""
    moe = ClusterJob("moe", job_cfg(dp=4, pp=2, tp=1, ep=2, layers_per_stage=2, moe_every=2, gpus_per_node=1), 8)
    tiny = ClusterJob("tiny", job_cfg(dp=2, pp=2, tp=2, gpus_per_node=4), 0)
    run = simulate_cluster([tiny, moe], window_s=2.0)
    truth = {j["name"]: j for j in run.truth()["jobs"]}
    assert truth["moe"]["gpus"] == [(8 + r) * 8 for r in range(8)] and truth["moe"]["nodes"] == list(range(8, 16))
    assert truth["tiny"]["gpus"] == [0, 1, 2, 3, 8, 9, 10, 11]

    def got(name):
        ip = {a: r for r, a in enumerate(truth[name]["ips"])}
        return {frozenset((ip[p["a"]], ip[p["b"]])): set(p["types"]) for p in truth[name]["pairs"]}
    want = {}
    for s in (0, 4):
        for a, b, t in ((0, 1, {"dp", "ep"}), (2, 3, {"dp", "ep"}), (1, 2, {"dp"}), (0, 3, {"dp"}),
                        (0, 2, {"dp"}), (1, 3, {"dp"})):
            want[frozenset((a + s, b + s))] = t
    for r in range(4):
        want[frozenset((r, r + 4))] = {"pp"}
    assert got("moe") == want
    assert got("tiny") == {frozenset((r, r + 4)): {"pp"} for r in range(4)}
    flows = list(run.flows())
    assert all(set(f["switches"]) <= {"leaf0"} for f in flows if f["src"].startswith("10.0.0."))
    assert {s for f in flows for s in f["switches"]} <= {"leaf0", "leaf2", "leaf3"} | {f"spine{i}" for i in range(4)}
    idle = {CLUSTER.ip(g) for g in (4, 5, 6, 7, 12, 13, 14, 15)}
    assert not idle & ({f["src"] for f in flows} | {f["dst"] for f in flows})
    # the files the collector imports: flows as `steplens import flows` reads them, the topology file
    assert list(flows[0]) == ["start", "src", "dst", "switches", "bytes", "duration"]
    assert run.write_flows(str(tmp_path / "flows.jsonl")) == len(flows)
    rows = read_flow_file(str(tmp_path / "flows.jsonl"), "auto")
    assert [(r.start_ns, r.src, r.dst, r.bytes, list(r.switches)) for r in rows] == \
        [(f["start"], f["src"], f["dst"], f["bytes"], f["switches"]) for f in flows]
    run.write_topology(str(tmp_path / "topology.json"))
    assert json.loads((tmp_path / "topology.json").read_text()) == run.topology_file()


def by_key(flows):
    out = defaultdict(list)
    for f in flows:
        out[key(f)].append(f["duration"])
    return out


def pick(jobs, want):
    return next(j for j in jobs if want(j))


def test_congested_leaf_slows_only_its_job():
    """A leaf under a multi-leaf job: that job's pipeline sends through the leaf slow down, its other ones keep
    their durations; another job's flows do not change at all; the truth names the job and its local leaf."""
    jobs = layout(0)
    big = pick(jobs, lambda j: j.cfg.pp > 1 and j.leaves >= 4)
    other = pick(jobs, lambda j: j is not big and j.leaves >= 2)
    leaf = f"leaf{big.first_leaf + 1}"
    base = simulate_cluster([big, other], window_s=8.0)
    cong = simulate_cluster([big, other], [ClusterFault("congested_switch", leaf, 0.0, 8.0, 8.0)], window_s=8.0)
    tf = cong.truth()["faults"][0]
    assert [(j["job"], j["target"], j["start"]) for j in tf["jobs"]] == [(big.name, "leaf1", 0)]
    bt = {j["name"]: j for j in base.truth()["jobs"]}
    pp_pairs = {frozenset((p["a"], p["b"])) for p in bt[big.name]["pairs"] if p["types"] == ["pp"]}
    other_ips = set(bt[other.name]["ips"])
    fb, fc = list(base.flows()), list(cong.flows())
    assert [f for f in fb if f["src"] in other_ips] == [f for f in fc if f["src"] in other_ips]
    b, c = by_key(fb), by_key(fc)
    hit = clear = 0
    for k, durs in c.items():
        if frozenset(k[:2]) not in pp_pairs:
            continue
        if leaf in k[3]:
            hit += 1
            assert min(durs) > 3 * max(b[k])
        else:
            clear += 1
            assert set(durs) <= set(b[k])
    assert hit and clear


def test_slow_link_slows_its_gpu_flows():
    """A slow NIC: every flow from or to that GPU slows (its pipeline sends, its DP ring's buckets)."""
    jobs = layout(0)
    job = pick(jobs, lambda j: j.cfg.dp >= 4 and j.cfg.pp > 1 and j.cfg.tp == 8 and j.cfg.ep == 1 and j.cfg.gpus <= 128)
    gpu = job.gpu(job.cfg.rank(1, 1, 0))
    link = CLUSTER.link_of(gpu)
    fault = parse_cluster_fault(f"slow_link:{link}:0:8:10")
    assert fault.local_target(job) == job.cfg.topology().link_of(job.cfg.rank(1, 1, 0))
    base = simulate_cluster([job], window_s=8.0)
    slow = simulate_cluster([job], [fault], window_s=8.0)
    ip = CLUSTER.ip(gpu)
    b, c = by_key(base.flows()), by_key(slow.flows())
    mine = [k for k in c if ip in k[:2]]
    assert any(k[2] == job.cfg.activation_bytes for k in mine) and any(k[2] != job.cfg.activation_bytes for k in mine)
    for k in mine:
        assert min(c[k]) > 3 * max(b[k]), k
    assert [f["target"] for f in slow.truth()["jobs"][0]["faults"]] == [fault.local_target(job)]


def test_fault_targets_map_to_local_ids():
    job = ClusterJob("j", job_cfg(dp=2, pp=2, tp=2, gpus_per_node=4), 8)   # cluster nodes 8, 9 (leaf2), devices 0-3
    cases = [("slow_gpu", "65", "1"), ("slow_gpu", "74", "6"), ("slow_gpu", "77", None), ("slow_gpu", "1", None),
             ("slow_link", "n9.nic2", "n1.nic2"), ("slow_link", "n9.nic6", None),
             ("congested_switch", "leaf2", "leaf0"), ("congested_switch", "leaf3", None),
             ("congested_switch", "spine1", None)]
    for kind, target, local in cases:
        assert ClusterFault(kind, target, 0.0, 1.0, 2.0).local_target(job) == local, (kind, target)
    for bad in ("slow_gpu:2880:0:1", "slow_link:n360.nic0:0:1", "congested_switch:leaf90:0:1", "hang:3:0:1",
                "slow_gpu:3:2:1", "slow_gpu:3:a:1"):
        with pytest.raises(ValueError):
            parse_cluster_fault(bad)


def test_cli_writes_the_three_files(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench.sim.cluster", "--out", str(tmp_path), "--seed", "2",
                          "--window", "3", "--fault", "congested_switch:leaf5:0:3:4"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["jobs"] == 19 and summary["gpus"] > 2700 and summary["flows"] > 0 and summary["seconds"] > 0
    assert sum(1 for _ in open(tmp_path / "flows.jsonl")) == summary["flows"]
    truth = json.loads((tmp_path / "truth.json").read_text())
    assert truth["faults"][0]["target"] == "leaf5" and json.loads((tmp_path / "topology.json").read_text())["nodes"]
    bad = subprocess.run([sys.executable, "-m", "bench.sim.cluster", "--out", str(tmp_path), "--fault", "hang:1:0:1"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "kind must be one of" in bad.stderr
