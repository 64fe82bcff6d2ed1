"""Jobs, parallelism and timelines from network flows alone (collector/analysis/flowjobs.py, bocd.py), scored
against the cluster simulator's truth (bench/sim/cluster.py: 19 concurrent jobs on 2,880 GPUs, 15 s of
switch-mirrored flows with a 20 µs timestamp error); the analysis reads the flows and the topology, never the
truth. bench/eval/flows.py prints the full figures on a one-minute window."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

from steplens.collector.analysis.bocd import Bocd, GapSplit
from steplens.collector.analysis.flowjobs import FlowConfig, FlowWindow, analyse, job_key, topology_maps
from steplens.collector.topology import from_dict
from steplens.sim.cluster import CLUSTER, layout, simulate_cluster

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "eval"))
from flows import score_pairs, score_timeline, window_of  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    run = simulate_cluster(layout(1), (), 15.0)
    fw = window_of(run, noise_us=20.0, seed=1)
    server_of, _ = topology_maps(from_dict(CLUSTER.topology_file()))
    return run.truth(), fw, analyse(fw, server_of)


def test_every_job_is_recognized_with_exactly_its_gpus(cluster):
    truth, _, snap = cluster
    assert len(truth["jobs"]) == 19
    assert {frozenset(j["ips"]) for j in truth["jobs"]} == {frozenset(j.endpoints) for j in snap.jobs}
    assert not snap.unattributed
    # keys are stable: the same servers give the same key
    for j in snap.jobs:
        assert j.key == job_key(j.servers) and j.key.startswith("flows-")


def test_every_pair_is_typed_right(cluster):
    truth, _, snap = cluster
    s = score_pairs(snap, truth)
    assert s["pairs"] > 3000 and s["accuracy"] == 1.0, s
    assert set(s["per_type"]) == {"dp", "pp", "ep"}


def test_tp_pairs_are_gpus_of_one_node_in_lockstep(cluster):
    truth, _, snap = cluster
    node_of = {CLUSTER.ip(g): g // 8 for g in range(CLUSTER.gpus)}
    by_ips = {frozenset(j["ips"]): j for j in truth["jobs"]}
    checked = 0
    for fj in snap.jobs:
        tj = by_ips[frozenset(fj.endpoints)]
        tp = [ab for ab, t in fj.pairs.items() if t == "tp"]
        assert all(node_of[a] == node_of[b] for a, b in tp)
        if tj["shape"]["tp"] == 8 and tj["shape"]["gpus_per_node"] == 8:
            # a TP=8 job: each node is one TP group, all its 28 pairs
            assert len(tp) == 28 * len(fj.servers), tj["name"]
            checked += 1
    assert checked >= 5


def test_timelines_match_the_true_step_times(cluster):
    truth, _, snap = cluster
    t = score_timeline(snap, truth)
    assert t["steps"] > 5000
    assert t["median_error_pct"] < 0.1 and t["p95_error_pct"] < 0.3, t
    # jobs whose DP rings stay inside one node show no step end on the wire: no timeline, not a wrong one
    by_ips = {frozenset(j["ips"]): j for j in truth["jobs"]}
    for fj in snap.jobs:
        if not fj.timeline:
            shape = by_ips[frozenset(fj.endpoints)]["shape"]
            assert shape["gpus_per_node"] >= shape["dp"] * shape["tp"], shape


def test_gap_split_and_bocd_agree_on_step_boundaries():
    rng = np.random.default_rng(2)
    starts = []
    for k in range(12):     # 12 steps of 2 s, each a burst of 8 bucket flows 0.5-2 ms apart
        t = k * 2e9 + rng.normal(0, 1e7)
        for _ in range(8):
            t += rng.uniform(5e5, 2e6)
            starts.append(t)
    want = [8 * k for k in range(1, 12)]
    assert GapSplit().boundaries(starts) == want
    assert Bocd(flows_per_step=8).boundaries(starts) == want
    # one regime (Poisson arrivals): no boundary from either
    poisson = np.cumsum(rng.exponential(1e6, 300))
    assert GapSplit().boundaries(poisson) == [] and Bocd(20).boundaries(poisson) == []
    # flows that start together (a ring's hops) are never boundaries
    assert GapSplit().boundaries([0, 0, 5, 1e6, 1e6 + 3, 2e6]) == []


def test_bocd_erratum_textbook_change_probability_is_the_hazard():
    """Why the textbook recursion cannot be used as the paper states it: scoring the change hypothesis with the
    ending run's own predictive makes P(r_t = 0 | x) equal the hazard H at every t, whatever x is, so a 0.95
    threshold never fires at H = 1/8. Bocd scores it with the prior predictive: at H = 1/8 it passes 0.95 at
    the between-step intervals and nowhere else."""
    H = 1 / 8
    rng = np.random.default_rng(5)
    p = rng.dirichlet(np.ones(6))           # any run-length posterior
    pred = rng.uniform(1e-12, 1.0, 6)       # any predictive of x_t under each run
    growth = p * (1 - H) * pred
    change = (p * H * pred).sum()
    assert math.isclose(change / (change + growth.sum()), H)
    starts, t = [], 0.0
    for k in range(10):                     # 10 steps 2 s apart, each a burst of 8 flows 0.5-2 ms apart
        t = k * 2e9
        for _ in range(8):
            t += rng.uniform(5e5, 2e6)
            starts.append(t)
    b = Bocd(flows_per_step=8)
    assert b.hazard == H and b.threshold == 0.95
    assert b.boundaries(starts) == [8 * k for k in range(1, 10)]


def test_loopback_and_self_flows_are_not_endpoints():
    rows = [(0, 10, "127.0.0.1", "10.0.0.1", 100, "[]", "ebpf"), (0, 10, "10.0.0.1", "10.0.0.1", 100, "[]", "ebpf"),
            (0, 10, "10.0.0.1", "10.0.0.2", 100, '["leaf0"]', "ebpf"), (0, 10, "bogus", "10.0.0.2", 1, "[]", "ebpf")]
    fw = FlowWindow.from_rows(rows)
    assert len(fw) == 1 and fw.ips == ["10.0.0.1", "10.0.0.2"] and fw.switches == [("leaf0",)]
    snap = analyse(fw, {}, FlowConfig(min_pair_flows=1))
    assert snap.sources == ["ebpf"] and [j.endpoints for j in snap.jobs] == [["10.0.0.1", "10.0.0.2"]]


def test_dp_transitivity_promotes_a_ring_hop_that_looked_like_pp():
    """A ring a -> b -> c whose hop c <-> a went back and forth one bucket size at a time (a tree all-reduce's
    reduce then broadcast, or a capture that missed the other sizes): on its own it reads as PP; a and c are in
    one DP component through b (one-way ring hops), so it is DP."""
    rows = []
    for k in range(6):
        t = k * 2_000_000_000
        for i, size in enumerate((1 << 20, 25 << 20, 25 << 20, 7 << 20)):
            st = t + i * 2_000_000
            rows.append((st, st + 1_000_000, "10.0.0.1", "10.0.1.1", size, "[]", "import:x"))
            rows.append((st, st + 1_000_000, "10.0.1.1", "10.0.2.1", size, "[]", "import:x"))
        rows.append((t, t + 1_000_000, "10.0.2.1", "10.0.0.1", 25 << 20, "[]", "import:x"))
        rows.append((t + 4_000_000, t + 5_000_000, "10.0.0.1", "10.0.2.1", 25 << 20, "[]", "import:x"))
    snap = analyse(FlowWindow.from_rows(sorted(rows)), {})
    (job,) = snap.jobs
    assert job.pairs == {("10.0.0.1", "10.0.1.1"): "dp", ("10.0.1.1", "10.0.2.1"): "dp",
                         ("10.0.0.1", "10.0.2.1"): "dp"}
    assert job.refined == 1 and job.dp_groups == [["10.0.0.1", "10.0.1.1", "10.0.2.1"]]
    assert len(job.timeline["10.0.1.1"]) == 5   # 6 DP bursts: 5 whole steps


def test_tcp_capture_noise_is_not_traffic():
    """A gloo job's eBPF flows hold pure-ACK bursts and small control messages beside the payload, and bursts
    that merged k back-to-back messages: a pipeline pair (one 128 KiB message per micro-batch each way, at
    different times, merged 1-4 at a time) is PP; a DP pair of two (one 16 MB exchange a step) is DP."""
    rng = np.random.default_rng(3)
    rows = []
    msg = 131_432
    for k in range(40):
        t = k * 120_000_000
        for i in range(4):                           # forward sends h0 -> h2, merged at random
            n = int(rng.integers(1, 3))
            rows.append((t + i * 6_000_000, t + i * 6_000_000 + 200_000, "10.7.0.10", "10.7.0.12", n * msg + 228,
                         "[]", "ebpf"))
            rows.append((t + i * 6_000_000 + 300_000, t + i * 6_000_000 + 300_000, "10.7.0.12", "10.7.0.10", 132,
                         "[]", "ebpf"))             # its ACKs
        for i in range(4):                           # backward sends h2 -> h0
            s = t + 40_000_000 + i * 8_000_000
            rows.append((s, s + 300_000, "10.7.0.12", "10.7.0.10", msg, "[]", "ebpf"))
        s = t + 80_000_000                           # the all-reduce: one exchange with h1, plus control messages
        rows.append((s - 6_000_000, s - 6_000_000, "10.7.0.10", "10.7.0.11", 912, "[]", "ebpf"))
        rows.append((s, s + 15_000_000, "10.7.0.10", "10.7.0.11", 16_816_000 + int(rng.integers(0, 200_000)),
                     "[]", "ebpf"))
        rows.append((s + 300_000, s + 16_000_000, "10.7.0.11", "10.7.0.10", 16_817_000, "[]", "ebpf"))
        rows.append((s + 3_000_000, s + 13_000_000, "10.7.0.12", "10.7.0.13", 16_816_000, "[]", "ebpf"))
        rows.append((s + 3_000_000, s + 13_000_000, "10.7.0.13", "10.7.0.12", 16_816_000, "[]", "ebpf"))
        rows.append((t + 2_000_000, t + 2_300_000, "10.7.0.11", "10.7.0.13", msg, "[]", "ebpf"))
        rows.append((t + 50_000_000, t + 50_300_000, "10.7.0.13", "10.7.0.11", msg, "[]", "ebpf"))
    snap = analyse(FlowWindow.from_rows(sorted(rows)), {})
    (job,) = snap.jobs
    assert {k: v for k, v in job.pairs.items() if v != "tp"} == {
        ("10.7.0.10", "10.7.0.11"): "dp", ("10.7.0.12", "10.7.0.13"): "dp",
        ("10.7.0.10", "10.7.0.12"): "pp", ("10.7.0.11", "10.7.0.13"): "pp"}
    # each step ends with the all-reduce: 39 whole steps of 120 ms
    steps = job.timeline["10.7.0.10"]
    assert len(steps) == 39 and all(abs((b - a) - 120_000_000) < 2_000_000 for _, a, b in steps)


def test_bocd_segmenter_gives_the_same_jobs_and_pairs(cluster):
    """The paper's BOCD as the segmenter (`[analysis] flows_segmenter = "bocd"`): the same verdicts on the
    cluster's pairs as GapSplit (bench/eval/flows.py compares their boundaries)."""
    truth, fw, snap = cluster
    server_of, _ = topology_maps(from_dict(CLUSTER.topology_file()))
    slow = analyse(fw, server_of, FlowConfig(segmenter="bocd"))
    assert {frozenset(j.endpoints) for j in slow.jobs} == {frozenset(j.endpoints) for j in snap.jobs}
    assert score_pairs(slow, truth)["accuracy"] == 1.0
