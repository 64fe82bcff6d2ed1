"""The cluster simulator (bench/sim): fault propagation, collectives, hang, links, switches, determinism,
truth.json, the `run` CLI end to end and `stream` into a real collector on loopback."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, wait_for
from simutil import run_rows

sys.path.insert(0, REPO)

from bench.sim.faults import parse_fault  # noqa: E402
from bench.sim import model as sim_model  # noqa: E402
from bench.sim.model import ModelConfig, TESTBED_FAULTS, simulate  # noqa: E402

tb_cfg = sim_model.testbed_like
from bench.sim.output import truth  # noqa: E402


def steps_by_rank(rows_it):
    return {r[0]: r for r in rows_it}  # rank -> (rank, it, start, end, compute, wait, stall)


def test_slow_gpu_propagates_as_waiting():
    cfg = tb_cfg(iterations=8, jitter_cv=0.0)  # rank = (s * dp + d): 0 s0d0, 1 s0d1, 2 s1d0, 3 s1d1
    _, base = run_rows(cfg, [])
    _, slow = run_rows(cfg, ["slow_gpu:0:3:6:6"])
    b, f = steps_by_rank(base["steps"][4]), steps_by_rank(slow["steps"][4])
    opt = cfg.optimizer_ms * 1e6
    assert f[0][4] - opt == pytest.approx(6 * (b[0][4] - opt), rel=1e-6)  # its compute grows 6x
    for peer in (1, 2, 3):                        # DP peer, PP neighbour, the rest: compute unchanged, wait grows
        assert f[peer][4] == b[peer][4]
        assert f[peer][5] > b[peer][5] + 100e6
    # outside the fault window nothing changes (same seed: same jitter)
    def durations(rows):
        return [(r[3] - r[2], r[4], r[5], r[6]) for r in rows]
    assert durations(slow["steps"][7]) == durations(base["steps"][7])


def test_collective_completes_after_last_arrival():
    cfg = ModelConfig(dp=4, pp=2, tp=2, micro_batches=4, iterations=3, gpus_per_node=2, jitter_cv=0.05, seed=3)
    _, out = run_rows(cfg, ["slow_gpu:9:1:2:3"])
    for it, ops in out["commops"].items():
        groups = {}
        for r, cid, op, seq, nb, a, b in ops:
            if op == "all_reduce":
                groups.setdefault((cid, seq), []).append((a, b))
        assert groups
        for members in groups.values():
            last_arrival = max(a for a, _ in members)
            assert all(b >= last_arrival for _, b in members)
            assert len({b for _, b in members}) <= 1 or True
    # P2P: a recv ends exactly when the matching send's data has arrived (or when the receiver posts later)
    for ops in out["commops"].values():
        sends = {(cid, seq): b for r, cid, op, seq, nb, a, b in ops if op == "send" and cid.startswith("pp")}
        for r, cid, op, seq, nb, a, b in ops:
            if op == "recv":
                assert b == max(a, sends[(cid, seq)]) or abs(b - max(a, sends[(cid, seq)])) <= 1


def test_hang_stalls_every_dependent_rank():
    cfg = tb_cfg(iterations=6, jitter_cv=0.0)
    res = simulate(cfg, [parse_fault("hang:3:2:3:3.0", cfg.topology())], keep_steps=True)
    base = simulate(cfg, [], keep_steps=True)
    for r in range(cfg.gpus):
        assert res.step_ns[2][r] >= base.step_ns[2][r] + 2.9e9
        assert res.step_ns[1][r] == base.step_ns[1][r]
    assert max(res.step_ns[3]) < 1.2 * max(base.step_ns[3]) + 5e6
    # testbed ratio: SIGSTOP 3 s = one ~3 s step
    assert 2.9e9 < max(res.step_ns[2]) < 3.3e9


def test_hang_beyond_timeout_aborts():
    cfg = tb_cfg(iterations=6, jitter_cv=0.0, collective_timeout_s=1.0)
    res = simulate(cfg, [parse_fault("hang:1:2:3:3.0", cfg.topology())])
    assert res.aborted_at == 2 and res.iterations_done == 2
    assert truth(res)["aborted_at_iteration"] == 2


def test_slow_link_inflates_its_dp_all_reduce_only():
    cfg = ModelConfig(dp=4, pp=2, tp=2, micro_batches=4, iterations=4, gpus_per_node=2, jitter_cv=0.0)
    # rank 1 = (s0, d0, t1), NIC n0.nic1: its ring is dp.s0.t1
    _, base = run_rows(cfg, [], kinds=("commops",))
    _, slow = run_rows(cfg, ["slow_link:n0.nic1:1:3:20"], kinds=("commops",))

    def ar_time(out, it, cid):
        ops = [(a, b) for r, c, op, seq, nb, a, b in out["commops"][it] if c == cid]
        return max(b for _, b in ops) - max(a for a, _ in ops)
    assert ar_time(slow, 2, "dp.s0.t1") > 10 * ar_time(base, 2, "dp.s0.t1")
    for cid in ("dp.s0.t0", "dp.s1.t0", "dp.s1.t1"):
        assert abs(ar_time(slow, 2, cid) - ar_time(base, 2, cid)) <= 2
    assert abs(ar_time(slow, 3, "dp.s0.t1") - ar_time(base, 3, "dp.s0.t1")) <= 2


def test_network_jitter_varies_transfers_not_compute():
    """net_jitter_cv: every DP ring and PP pair transfer of an iteration gets its own multiplier (spread about
    the configured CV), the agents' send ops carry the same draw as the model's timing, and the compute jitter
    is the same draw as without it (a separate random stream)."""
    import statistics
    cfg = ModelConfig(dp=4, pp=2, tp=2, micro_batches=4, iterations=60, gpus_per_node=2, jitter_cv=0.02, seed=4)
    jit = ModelConfig(**{**cfg.__dict__, "net_jitter_cv": 0.05})
    its: dict = {"base": [], "jit": []}
    simulate(cfg, [], sink=its["base"].append)
    simulate(jit, [], sink=its["jit"].append)
    assert [i.factor for i in its["base"]] == [i.factor for i in its["jit"]]
    assert all(i.net_jitter is None for i in its["base"])
    ring = [i.ar_ns[0][1] for i in its["jit"]]
    assert len(set(ring)) == len(ring) and 0.03 < statistics.pstdev(ring) / statistics.mean(ring) < 0.08
    assert len({i.ar_ns[0][1] for i in its["base"]}) == 1
    _, out = run_rows(jit, [], kinds=("commops",))
    for it in (3, 40):
        model = its["jit"][it]
        sends = {(r, seq): b - a for r, c, op, seq, nb, a, b in out["commops"][it] if c.startswith("pp.s0-1")
                 and op == "send" and seq == it * 2 * cfg.micro_batches}  # the first forward's sends
        assert len(sends) == cfg.dp * cfg.tp
        for (r, _), took in sends.items():
            d = cfg.coords(r)[1]
            assert abs(took - model.xfer_ns[0][d]) <= 2, (r, took, model.xfer_ns[0][d])


def test_congested_switch_hits_exactly_its_flows():
    cfg = ModelConfig(dp=4, pp=4, tp=2, micro_batches=4, iterations=3, gpus_per_node=2, nodes_per_leaf=2,
                      spines=2, jitter_cv=0.0)
    _, base = run_rows(cfg, [], kinds=("flows",))
    _, cong = run_rows(cfg, ["congested_switch:spine1:1:2:10"], kinds=("flows",))
    pp_hit = pp_clear = 0
    for fb, fc in zip(base["flows"][1], cong["flows"][1]):
        assert fb[1:4] == fc[1:4] and fb[5] == fc[5]  # the same flow (its start may move)
        if fb[3] != cfg.activation_bytes:
            continue
        if "spine1" in fb[5]:  # a PP transfer through the congested switch: slower
            pp_hit += 1
            assert fc[4] > 5 * fb[4]
        else:                  # any other: untouched
            pp_clear += 1
            assert fc[4] == fb[4]
    assert pp_hit and pp_clear
    # a DP ring is as slow as its slowest hop: every hop of a ring with a hop through spine1 slows, no other
    rings = {}
    for fb, fc in zip(base["flows"][1], cong["flows"][1]):
        if fb[3] != cfg.activation_bytes:
            rings.setdefault((fb[0], fb[1] % cfg.tp), []).append((fb, fc))
    hit = [r for r in rings.values() if any("spine1" in fb[5] for fb, _ in r)]
    clear = [r for r in rings.values() if not any("spine1" in fb[5] for fb, _ in r)]
    assert hit and all(fc[4] > 5 * fb[4] for r in hit for fb, fc in r)
    assert all(fc[4] == fb[4] for r in clear for fb, fc in r)


def test_dp_buckets_split_ring_flows():
    """dp_bucket_bytes: a ring hop carries one flow per DDP bucket (1 MiB, then dp_bucket_bytes each, the rest
    last), of different sizes, summing to the single flow's bytes, back to back over the all-reduce's window;
    the expert rings the same; the model's timing is unchanged; 0 gives one flow per hop, as before."""
    from bench.sim.output import Rows
    mib = 1 << 20
    kw = dict(dp=4, pp=2, tp=2, micro_batches=4, iterations=3, gpus_per_node=2, nodes_per_leaf=2, spines=2,
              grad_bytes=100 * mib, net_jitter_cv=0.02, seed=5)
    one, bkt = ModelConfig(**kw), ModelConfig(**kw, dp_bucket_bytes=25 * mib)
    assert one.dp_buckets(100 * mib) == [100 * mib]
    assert bkt.dp_buckets(100 * mib) == [mib, 25 * mib, 25 * mib, 25 * mib, 24 * mib]
    assert bkt.dp_buckets(76 * mib) == [mib, 25 * mib, 25 * mib, 25 * mib] and bkt.dp_buckets(mib // 2) == [mib // 2]
    assert "dp_bucket_bytes" not in one.to_json() and bkt.to_json()["dp_bucket_bytes"] == 25 * mib

    def run(cfg):
        its = []
        simulate(cfg, [], sink=its.append)
        return its[1], list(Rows(cfg).flows(its[1]))
    it, flows1 = run(one)
    itb, flowsb = run(bkt)
    assert (itb.start, itb.end, itb.ar_ns) == (it.start, it.end, it.ar_ns)   # timing untouched

    def check_pair(flows, a, b, single_bytes, win_start, win_ns):
        """the flows a -> b: >= 2 sizes, bytes summing to one flow's, tiling [win_start, win_start + win_ns]"""
        got = sorted(f for f in flows if f[1:3] == (a, b))
        assert len({f[3] for f in got}) >= 2
        assert abs(sum(f[3] for f in got) - single_bytes) <= len(got)
        assert got[0][0] == one.base_ns + round(win_start)
        for f, g in zip(got, got[1:]):
            assert abs(f[0] + round(f[4] * 1e9) - g[0]) <= 2
        assert abs(got[-1][0] - one.base_ns + got[-1][4] * 1e9 - (win_start + win_ns)) <= 1
        assert sum(f[4] for f in got) == pytest.approx(win_ns / 1e9, rel=1e-9)

    # ranks 0 = (s0, d0, t0) on node 0 and 2 = (s0, d1, t0) on node 1: a DP ring hop and nothing else
    single = [f for f in flows1 if f[1:3] == (0, 2)]
    assert single == [(one.base_ns + round(it.last_b[0]), 0, 2, int(1.5 * 100 * mib), it.ar_ns[0][0] / 1e9,
                       one.topology().path(0, 2))]
    check_pair(flowsb, 0, 2, single[0][3], it.last_b[0], it.ar_ns[0][0])
    dp_bytes = {int(1.5 * 100 * mib), int(1.5 * mib), int(1.5 * 25 * mib), int(1.5 * 24 * mib)}
    assert [f for f in flows1 if f[3] not in dp_bytes] == [f for f in flowsb if f[3] not in dp_bytes]
    # expert ring of ranks 0 and 2 (DP ring 0-1-2-3, all-to-alls {0, 1} and {2, 3}): after the dense all-reduce
    kw = dict(dp=4, pp=1, tp=1, ep=2, layers_per_stage=2, moe_every=2, micro_batches=2, iterations=3,
              gpus_per_node=1, nodes_per_leaf=4, spines=2, grad_bytes=100 * mib, seed=5)
    one, bkt = ModelConfig(**kw), ModelConfig(**kw, dp_bucket_bytes=25 * mib)
    it, flows1 = run(one)
    _, flowsb = run(bkt)
    single = [f for f in flows1 if f[1:3] == (0, 2)]
    assert len(single) == 1 and single[0][3] == 50 * mib
    check_pair(flowsb, 0, 2, 50 * mib, it.last_b[0] + it.ar_ns[0][0], it.ear_ns[0][0])


def test_faults_parse_and_validate():
    topo = ModelConfig(dp=4, pp=2, tp=2, gpus_per_node=2).topology()
    assert parse_fault("slow_link:3:0:5", topo).link == "n1.nic1"
    f = parse_fault("fluctuation:leaf0:0:20:3:10", topo)
    assert f.resource == "switch" and f.factor(0) == 1.0 and f.factor(5) == pytest.approx(3.0)
    d = parse_fault("degradation:2:10:20:2", topo)
    assert d.factor(9) == 1.0 and d.factor(19) == pytest.approx(2.0) and d.factor(99) == pytest.approx(2.0)
    for bad in ("slow_gpu:99:0:1", "nope:1:0:1", "slow_gpu:n0.nic0:0:1", "congested_switch:3:0:1",
                "slow_gpu:1:5:2", "congested_switch:leaf9:0:1"):
        with pytest.raises(ValueError):
            parse_fault(bad, topo)


def test_testbed_preset_ratios():
    """The testbed's measured step-time ratios (FACTS.md) within 25 %."""
    cfg = tb_cfg(iterations=8, jitter_cv=0.0)
    base = max(simulate(cfg, [], keep_steps=True).step_ns[5])
    assert 120e6 < base < 140e6
    want = {"tbf_200mbit": 3.7, "cpu_quota_10pct": 4.0, "gc_storm": 5.0}
    for name, ratio in want.items():
        kind, value = TESTBED_FAULTS[name]
        for target in range(cfg.gpus):
            st = simulate(cfg, [parse_fault(f"{kind}:{target}:3:8:{value}", cfg.topology())], keep_steps=True).step_ns
            assert abs(max(st[5]) / base - ratio) / ratio < 0.25, (name, target, max(st[5]) / base)


def _cli(*args, check=True):
    out = subprocess.run([sys.executable, "-m", "bench.sim", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    if check:
        assert out.returncode == 0, out.stderr
    return out


def test_cli_run_end_to_end_and_deterministic(tmp_path):
    args = ["run", "--gpus", "64", "--dp", "4", "--pp", "4", "--tp", "4", "--iterations", "6", "--seed", "7",
            "--fault", "slow_gpu:5:2:4", "--fault", "congested_switch:leaf0:1:3", "--fault", "hang:40:4:5:0.5"]
    a, b = tmp_path / "a", tmp_path / "b"
    sa = json.loads(_cli(*args, "--out", str(a)).stdout)
    _cli(*args, "--out", str(b))
    names = ["commops.jsonl", "steps.jsonl", "flows.jsonl", "telemetry.jsonl", "truth.json", "topology.json"]
    assert sorted(os.listdir(a)) == sorted(names)
    for n in names:
        assert filecmp.cmp(a / n, b / n, shallow=False), n
    assert sa["rows"]["steps"] == 64 * 6
    steps = [json.loads(x) for x in open(a / "steps.jsonl")]
    assert set(steps[0]) >= {"rank", "iteration", "start_ns", "end_ns", "compute_ns", "comm_wait_ns"}
    assert all(s["end_ns"] > s["start_ns"] and s["comm_wait_ns"] >= 0 for s in steps)
    flow = json.loads(open(a / "flows.jsonl").readline())
    assert list(flow) == ["start", "src", "dst", "switches", "bytes", "duration"] and flow["switches"]
    op = json.loads(open(a / "commops.jsonl").readline())
    assert list(op) == ["rank", "comm_id", "op", "seq", "bytes", "start_ns", "end_ns", "node", "device"]
    tel = json.loads(open(a / "telemetry.jsonl").readline())
    assert {"utilization_percent", "sm_clock_mhz", "power_watts"} <= set(tel)
    t = json.load(open(a / "truth.json"))
    kinds = [f["kind"] for f in t["faults"]]
    assert kinds == ["slow_gpu", "congested_switch", "hang"]
    sg = t["faults"][0]
    assert sg["ranks"] == [5] and sg["node"] == "node0" and sg["device"] == 5 and sg["start"] == 2
    assert t["faults"][1]["switches"] == ["leaf0"] and t["faults"][1]["ranks"]
    assert t["faults"][2]["hang_seconds"] == 0.5
    # a different seed changes the jitter
    c = tmp_path / "c"
    _cli(*[x if x != "7" else "8" for x in args], "--out", str(c), "--emit", "steps")
    assert not filecmp.cmp(a / "steps.jsonl", c / "steps.jsonl", shallow=False)
    bad = _cli("run", "--gpus", "63", "--dp", "4", "--pp", "4", "--tp", "4", "--iterations", "1", "--out",
               str(tmp_path / "d"), check=False)
    assert bad.returncode != 0 and "dp*pp*tp" in bad.stderr


def test_stream_into_real_collector(collector, tmp_path):
    out = _cli("stream", "--gpus", "16", "--dp", "2", "--pp", "2", "--tp", "4", "--gpus-per-node", "4",
               "--iterations", "5", "--fault", "slow_gpu:3:1:3", "--collector", collector.address, "--insecure",
               "--procs", "2", "--state-dir", str(tmp_path / "spools"))
    summary = json.loads(out.stdout)
    assert summary["agents"] == 4 and summary["records"] > 0 and not summary["errors"]
    assert summary["records_acked"] == summary["records"] and summary["records_dropped"] == 0

    def sim_nodes():
        nodes = {n["node_id"]: n for n in collector.cli("nodes") if n["node_id"].startswith("sim-node-")}
        return nodes if len(nodes) == 4 and all(n.get("records_stored", 0) > 0 for n in nodes.values()) else None
    nodes = wait_for(sim_nodes, 20, what="4 sim nodes with stored records")
    assert sum(n["records_stored"] for n in nodes.values()) == summary["records"]
