"""Expert parallelism in the cluster simulator (bench/sim, ModelConfig.ep / `steplens-sim run --ep E`):
EP groups inside DP (Megatron's layout), all_to_all per MoE layer completing at the last member's arrival and
timed by the slowest member's link, expert-gradient rings over DP/EP, propagation of a slow GPU, truth.json,
determinism, the CLI, and EP=1 bit-identical to the simulator before EP existed."""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import pytest

from conftest import REPO
from simutil import run_rows

sys.path.insert(0, REPO)

from bench.sim.faults import parse_fault  # noqa: E402
from bench.sim.model import ModelConfig, simulate  # noqa: E402
from bench.sim.model import testbed_like as tb_cfg  # noqa: E402
from bench.sim.output import FileSink, truth, write_truth  # noqa: E402


def small(**over):
    """DP=8 x PP=2 x TP=2, EP=4, 2 GPUs per node: EP group members sit on different nodes (rank = (s*8+d)*2+t)."""
    kw = dict(dp=8, pp=2, tp=2, ep=4, micro_batches=4, iterations=4, gpus_per_node=2, nodes_per_leaf=2, spines=2,
              jitter_cv=0.0, layers_per_stage=4, moe_every=2)
    kw.update(over)
    return ModelConfig(**kw)


# -- EP=1: bit-identical to the simulator at commit 553d78f (before EP) ----------------------------------
# re-pinned once, on purpose: pipeline sends end after their own pair's transfer (output.pair_xfer), not the
# slowest pair's of their TP group; every other byte was unchanged by that change (the model is untouched);
# and once more when the config gained net_jitter_cv (0 by default): only truth.json's config changed
DIGEST_BEFORE_EP = "3861c280c54d81f78fc63b7171800b37378018b72fbf10606ca9fd21b7064237"
DENSE_CASES = [
    (dict(dp=4, pp=4, tp=4, iterations=6, nodes_per_leaf=4, spines=2, seed=7),
     ["slow_gpu:5:2:4", "congested_switch:leaf0:1:3", "hang:40:4:5:0.5", "slow_link:n1.nic2:0:6:5",
      "fluctuation:9:0:6:3:4", "degradation:spine0:1:5:2"]),
    (dict(dp=8, pp=2, tp=1, micro_batches=4, iterations=5, gpus_per_node=4, nodes_per_leaf=2, spines=2,
          jitter_cv=0.05, seed=3), ["slow_gpu:3:1:3:3", "congested_switch:spine1:2:4:6", "slow_link:6:0:5:4"]),
    ("testbed", dict(iterations=6, barrier_us=500.0, send_rendezvous=True, schedule="gpipe"),
     ["slow_link:1:2:4:12.97", "slow_gpu:2:3:5:10.5"]),
]


def dense_digest(**extra) -> str:
    """sha256 over every file (records + truth.json) of the dense cases, in name order."""
    h = hashlib.sha256()
    for case in DENSE_CASES:
        if case[0] == "testbed":
            cfg, specs = tb_cfg(**case[1], **extra), case[2]
        else:
            cfg, specs = ModelConfig(**case[0], **extra), case[1]
        with tempfile.TemporaryDirectory() as d:
            sink = FileSink(cfg, d)
            res = simulate(cfg, [parse_fault(s, cfg.topology()) for s in specs], sink)
            sink.close()
            write_truth(res, d)
            for n in sorted(os.listdir(d)):
                h.update(n.encode())
                with open(os.path.join(d, n), "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def test_ep1_bit_identical_to_before_ep():
    assert dense_digest() == DIGEST_BEFORE_EP
    # ep=1 spelled out (and MoE knobs that only matter with ep > 1) changes nothing either
    assert dense_digest(ep=1, moe_every=3, layers_per_stage=7) == DIGEST_BEFORE_EP


# -- groups -------------------------------------------------------------------------------------------
def megatron_ep_groups(cfg):
    """Megatron: per (pp, tp), the DP group's ranks in DP order, cut into consecutive chunks of EP."""
    groups = []
    for s in range(cfg.pp):
        for t in range(cfg.tp):
            dp_group = [cfg.rank(s, d, t) for d in range(cfg.dp)]
            groups += [dp_group[i:i + cfg.ep] for i in range(0, cfg.dp, cfg.ep)]
    return groups


def test_ep_groups_formed_like_megatron():
    cfg = small()
    want = megatron_ep_groups(cfg)
    assert sorted(r for g in want for r in g) == list(range(cfg.gpus))
    for g in want:
        for r in g:
            assert cfg.ep_group(r) == g
            s, d, t = cfg.coords(r)
            # expert-gradient ring: the DP/EP ranks holding the same experts (same EP index)
            edp = cfg.expert_dp_group(r)
            assert len(edp) == cfg.dp // cfg.ep and r in edp
            assert all(cfg.coords(x)[0] == s and cfg.coords(x)[2] == t and cfg.coords(x)[1] % cfg.ep == d % cfg.ep
                       for x in edp)
    assert cfg.ep_group(cfg.rank(1, 5, 1)) == [cfg.rank(1, d, 1) for d in (4, 5, 6, 7)]
    # the emitted communicators have exactly these members, and every op of a group has every member
    _, out = run_rows(cfg, [], kinds=("commops",))
    members, calls = {}, {}
    for r, cid, op, seq, nb, a, b in out["commops"][1]:
        if op == "all_to_all":
            members.setdefault(cid, set()).add(r)
            calls.setdefault((cid, seq), set()).add(r)
        if cid.startswith("edp."):
            assert op == "all_reduce"
            members.setdefault(cid, set()).add(r)
    a2a = sorted(sorted(m) for c, m in members.items() if c.startswith("ep."))
    assert a2a == sorted(want)
    edp = {c: m for c, m in members.items() if c.startswith("edp.")}
    assert len(edp) == cfg.pp * cfg.tp * cfg.ep
    assert all(sorted(m) == cfg.expert_dp_group(min(m)) for m in edp.values())
    assert all(calls[k] == members[k[0]] for k in calls)
    # 2 MoE layers (moe_every=2 of 4): per micro-batch 2 x 2 all-to-alls forward + 2 x 2 backward, per rank
    per_rank = sum(1 for r, cid, op, *_ in out["commops"][1] if op == "all_to_all" and r == 0)
    assert cfg.moe_layers() == [0, 2] and per_rank == 2 * cfg.micro_batches * 4


def test_moe_layers_and_segments():
    assert ModelConfig(dp=4, ep=2, layers_per_stage=8, moe_every=2).moe_layers() == [0, 2, 4, 6]
    assert ModelConfig(dp=4, ep=2, layers_per_stage=8, moe_fraction=0.25).moe_layers() == [0, 4]
    assert ModelConfig(dp=4, ep=1).moe_layers() == []
    for cfg in (ModelConfig(dp=4, ep=2, layers_per_stage=6, moe_every=4), ModelConfig(dp=4, ep=2)):
        f, b = cfg.ep_segments()
        assert len(f) == len(b) == 2 * len(cfg.moe_layers()) + 1
        assert sum(f) == pytest.approx(1.0) and sum(b) == pytest.approx(1.0)


# -- timing -------------------------------------------------------------------------------------------
def test_all_to_all_completes_after_last_member_arrives():
    cfg = small(jitter_cv=0.05, seed=5)
    _, out = run_rows(cfg, ["slow_gpu:9:1:3:3"], kinds=("commops",))
    for ops in out["commops"].values():
        groups = {}
        colls = {}
        for r, cid, op, seq, nb, a, b in ops:
            assert b >= a
            if op == "all_to_all":
                groups.setdefault((cid, seq), []).append((a, b))
            elif op == "all_reduce":
                colls.setdefault((cid, seq), []).append((a, b))
        assert groups
        for mem in groups.values():
            assert len(mem) == cfg.ep
            last = max(a for a, _ in mem)
            assert len({b for _, b in mem}) == 1 and mem[0][1] > last  # one completion, after the last arrival
        for mem in colls.values():  # TP, dense DP and expert rings too
            assert all(b >= max(a for a, _ in mem) for _, b in mem)


def a2a_wait(ops, ranks, it_ops=None):
    """Per rank: total ns in all_to_all (start to end)."""
    out = {r: 0 for r in ranks}
    for r, cid, op, seq, nb, a, b in ops:
        if op == "all_to_all" and r in out:
            out[r] += b - a
    return out


def test_slow_gpu_in_ep_group_shows_as_all_to_all_waiting():
    cfg = small()
    slow = cfg.rank(0, 1, 0)                       # stage 0, DP 1, TP 0: EP group e0 = DP 0..3
    _, base = run_rows(cfg, [])
    _, flt = run_rows(cfg, [f"slow_gpu:{slow}:1:3:5"])
    it = 2
    group = cfg.ep_group(slow)
    tp_peer = cfg.rank(0, 1, 1)                    # in lockstep with it (TP), its own EP group e0.t1
    other_group = cfg.ep_group(cfg.rank(0, 5, 0))  # stage 0, DP 4..7: another EP group of the same stage
    wb = a2a_wait(base["commops"][it], range(cfg.gpus))
    wf = a2a_wait(flt["commops"][it], range(cfg.gpus))
    for r in group:
        if r != slow:                              # every other member waits on it in all_to_all
            assert wf[r] > wb[r] + 20e6, (r, wb[r], wf[r])
    assert wf[slow] < wb[slow] + 1e6               # the slow one itself arrives last: no waiting
    for r in cfg.ep_group(tp_peer):
        if r != tp_peer:
            assert wf[r] > wb[r] + 20e6
    for r in other_group:                          # another EP group: its all-to-alls are not slowed
        assert abs(wf[r] - wb[r]) < 1e3
    # ... but it waits on the slow rank in the DP all-reduce, and the next stage in its recv, as before
    def total(ops, r, pred):
        return sum(b - a for rr, cid, op, seq, nb, a, b in ops if rr == r and pred(cid, op))
    for r in other_group:
        dp_b = total(base["commops"][it], r, lambda c, o: c.startswith("dp."))
        dp_f = total(flt["commops"][it], r, lambda c, o: c.startswith("dp."))
        assert dp_f > dp_b + 50e6
    pp_peer = cfg.rank(1, 1, 0)
    recv_b = total(base["commops"][it], pp_peer, lambda c, o: o == "recv")
    recv_f = total(flt["commops"][it], pp_peer, lambda c, o: o == "recv")
    assert recv_f > recv_b + 50e6
    # steps: its compute grows, every other rank's compute is unchanged and its waiting grows
    sb = {r[0]: r for r in base["steps"][it]}
    sf = {r[0]: r for r in flt["steps"][it]}
    for r in range(cfg.gpus):
        if r == slow:
            assert sf[r][4] > 3 * sb[r][4]
        else:
            assert sf[r][4] == sb[r][4] and sf[r][5] > sb[r][5] + 50e6
    # outside the window: identical
    assert flt["steps"][0] == base["steps"][0]
    assert [r[3] - r[2] for r in flt["steps"][3]] != [] and flt["commops"][0] == base["commops"][0]


def a2a_times(ops):
    """(comm_id, seq) -> all-to-all time: completion - last arrival."""
    groups = {}
    for r, cid, op, seq, nb, a, b in ops:
        if op == "all_to_all":
            groups.setdefault((cid, seq), []).append((a, b))
    return {k: v[0][1] - max(a for a, _ in v) for k, v in groups.items()}


def test_slow_link_slows_its_ep_groups_all_to_all_only():
    cfg = small()
    r = cfg.rank(1, 6, 1)                           # stage 1, DP 6, TP 1: EP group ep.s1.e1.t1
    link = cfg.topology().link_of(r)
    _, base = run_rows(cfg, [], kinds=("commops",))
    _, slow = run_rows(cfg, [f"slow_link:{link}:1:3:20"], kinds=("commops",))
    tb, ts = a2a_times(base["commops"][2]), a2a_times(slow["commops"][2])
    assert tb.keys() == ts.keys()
    hit = [k for k in tb if k[0] == "ep.s1.e1.t1"]
    assert hit
    for k in tb:
        if k in hit:
            assert ts[k] > 10 * tb[k], (k, tb[k], ts[k])
        else:
            assert abs(ts[k] - tb[k]) <= 2, k
    # after the fault window: back to normal
    tb3, ts3 = a2a_times(base["commops"][3]), a2a_times(slow["commops"][3])
    assert all(abs(ts3[k] - tb3[k]) <= 2 for k in tb3)
    # the expert-gradient ring of that rank slows too, the other expert rings do not
    def ring(ops, cid):
        m = [(a, b) for rr, c, op, seq, nb, a, b in ops if c == cid]
        return m[0][1] - m[0][0]
    mine = f"edp.s1.t1.x{6 % cfg.ep}"
    assert ring(slow["commops"][2], mine) > 10 * ring(base["commops"][2], mine)
    assert abs(ring(slow["commops"][2], "edp.s1.t1.x0") - ring(base["commops"][2], "edp.s1.t1.x0")) <= 2
    # truth names the EP group and the expert ring among the communicators the link carries
    t = truth(simulate(cfg, [parse_fault(f"slow_link:{link}:1:3:20", cfg.topology())]))
    f = t["faults"][0]
    assert "ep.s1.e1.t1" in f["comms"] and mine in f["comms"]
    assert set(cfg.ep_group(r)) <= set(f["ranks"]) and set(cfg.expert_dp_group(r)) <= set(f["ranks"])


def test_congested_switch_slows_all_to_all_flows_through_it():
    cfg = small(dp=16, pp=2, tp=1, ep=4, gpus_per_node=2, nodes_per_leaf=3, spines=2)
    _, base = run_rows(cfg, [], kinds=("flows",))
    _, cong = run_rows(cfg, ["congested_switch:spine1:1:2:10"], kinds=("flows",))
    nb = cfg.a2a_bytes // cfg.ep
    assert len(base["flows"][1]) == len(cong["flows"][1])
    groups = {}                                  # an all-to-all's flows: (start, group of src) -> [(base, cong)]
    for fb, fc in zip(base["flows"][1], cong["flows"][1]):
        assert fb[1:4] == fc[1:4] and fb[5] == fc[5]
        if fb[3] == nb:
            groups.setdefault((fb[0], tuple(cfg.ep_group(fb[1]))), []).append((fb, fc))
    hit = [g for g in groups.values() if any("spine1" in fb[5] for fb, _ in g)]
    clear = [g for g in groups.values() if not any("spine1" in fb[5] for fb, _ in g)]
    assert hit and clear
    assert all(fc[4] > 5 * fb[4] for g in hit for fb, fc in g)  # the slowest member's path sets the time
    assert all(fc[4] == fb[4] for g in clear for fb, fc in g)
    # every a2a flow connects two members of one EP group over the network, with its path
    topo = cfg.topology()
    for fb, _ in (x for g in groups.values() for x in g):
        assert fb[2] in cfg.ep_group(fb[1]) and fb[5] == topo.path(fb[1], fb[2]) != ()


def test_grad_split_and_expert_ring_bytes():
    cfg = small(expert_grad_share=0.25)
    dense, expert = cfg.grad_split()
    assert dense + expert == cfg.grad_bytes and expert == cfg.grad_bytes // 4
    _, out = run_rows(cfg, [], kinds=("commops",))
    by = {}
    for r, cid, op, seq, nb, a, b in out["commops"][0]:
        if op == "all_reduce" and cid[:3] in ("dp.", "edp"):
            by.setdefault(cid.split(".")[0], set()).add(nb)
    assert by == {"dp": {dense}, "edp": {expert}}
    # EP = DP: every replica holds different experts, no expert ring
    full = small(ep=8)
    _, out = run_rows(full, [], kinds=("commops", "flows"))
    assert not any(cid.startswith("edp.") for r, cid, *_ in out["commops"][0])


def test_ep_deterministic_and_seeded(tmp_path):
    specs = ["slow_gpu:3:1:3", "slow_link:n2.nic1:0:2:5", "congested_switch:spine0:1:3:4", "hang:17:2:3:0.2"]

    def run(seed, d):
        cfg = small(jitter_cv=0.03, seed=seed)
        sink = FileSink(cfg, str(d))
        res = simulate(cfg, [parse_fault(s, cfg.topology()) for s in specs], sink)
        sink.close()
        write_truth(res, str(d))
    run(4, tmp_path / "a")
    run(4, tmp_path / "b")
    run(5, tmp_path / "c")
    for n in ("commops.jsonl", "steps.jsonl", "flows.jsonl", "telemetry.jsonl", "truth.json"):
        assert filecmp.cmp(tmp_path / "a" / n, tmp_path / "b" / n, shallow=False), n
    assert not filecmp.cmp(tmp_path / "a" / "steps.jsonl", tmp_path / "c" / "steps.jsonl", shallow=False)


def test_ep_validation():
    with pytest.raises(ValueError, match="must divide dp"):
        ModelConfig(dp=6, ep=4).validate()
    with pytest.raises(ValueError, match="ep must be >= 1"):
        ModelConfig(dp=4, ep=0).validate()
    with pytest.raises(ValueError):
        ModelConfig(dp=4, ep=2, moe_every=0).validate()
    with pytest.raises(ValueError):
        ModelConfig(dp=4, ep=2, moe_fraction=1.5).validate()
    ModelConfig(dp=4, ep=4).validate()
    # a dense job's truth config has no EP keys (as before EP); an EP job's has them
    assert "ep" not in ModelConfig(dp=4).to_json() and ModelConfig(dp=4, ep=2).to_json()["ep"] == 2


# -- CLI ----------------------------------------------------------------------------------------------
def _cli(*args):
    return subprocess.run([sys.executable, "-m", "bench.sim", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_cli_ep_run_and_validation(tmp_path):
    out = _cli("run", "--gpus", "64", "--dp", "8", "--pp", "2", "--tp", "4", "--ep", "4", "--moe-every", "2",
               "--iterations", "3", "--fault", "slow_gpu:5:1:2", "--seed", "2", "--out", str(tmp_path / "a"))
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["rows"]["commops"] > 0
    t = json.load(open(tmp_path / "a" / "truth.json"))
    assert t["config"]["ep"] == 4 and t["config"]["moe_every"] == 2
    assert "ep.s0.e0.t1" in t["faults"][0]["comms"]   # rank 5 = (s0, d1, t1)
    ops = [json.loads(x) for x in open(tmp_path / "a" / "commops.jsonl")]
    a2a = [o for o in ops if o["op"] == "all_to_all"]
    assert a2a and list(a2a[0]) == ["rank", "comm_id", "op", "seq", "bytes", "start_ns", "end_ns", "node", "device"]
    assert {o["comm_id"].split(".")[0] for o in ops} == {"ep", "tp", "pp", "dp", "edp"}
    for argv, msg in ((["--dp", "8", "--pp", "2", "--tp", "4", "--ep", "3"], "must divide dp"),
                      (["--dp", "8", "--pp", "2", "--tp", "4", "--ep", "0"], "ep must be >= 1"),
                      (["--dp", "8", "--pp", "2", "--tp", "4", "--moe-every", "2"], "need --ep > 1"),
                      (["--dp", "8", "--pp", "2", "--tp", "4", "--ep", "2", "--moe-every", "2", "--moe-fraction",
                        "0.5"], "not both")):
        bad = _cli("run", "--gpus", "64", *argv, "--iterations", "1", "--out", str(tmp_path / "bad"))
        assert bad.returncode == 2 and msg in bad.stderr, (argv, bad.stderr)
