"""bench/sim/agentview.py: the simulator sends only what real agents send (issue 13, item 5), and its Step /
CommSummary records are what the real agent code (agent/steps.py, agent/commlog.py) makes of the same ops."""

import dataclasses
import sys
from collections import Counter, defaultdict

import pytest
from conftest import REPO

sys.path.insert(0, REPO)

from steplens.agent.commlog import summarize  # noqa: E402
from steplens.agent.records import CommOp, CommSummary, Flow, Metric, ProcessInfo, Step  # noqa: E402
from steplens.agent.sources.gpu import DCGM_NAMES  # noqa: E402
from steplens.agent.steps import StepSegmenter  # noqa: E402

from bench.sim.agentview import agent_records, commops  # noqa: E402
from bench.sim.faults import parse_fault  # noqa: E402
from bench.sim.model import ModelConfig  # noqa: E402

MONO = 10**12


def _cfg(**kw):
    base = dict(dp=4, pp=4, tp=2, micro_batches=4, iterations=8, gpus_per_node=4, seed=3)
    base.update(kw)
    return ModelConfig(**base)


def test_records_are_what_real_agents_send():
    cfg = _cfg()
    faults = [parse_fault("slow_gpu:5:2:6:2", cfg.topology())]
    recs = list(agent_records(cfg, faults, job_key="slurm:42", mono_base=MONO))
    kinds = Counter(type(r).__name__ for _, r in recs)
    assert set(kinds) == {"ProcessInfo", "Step", "CommSummary", "Metric", "Flow"}, kinds
    # ProcessInfo per rank, first, with the job key, rank and world size the procs source reads from the env
    infos = [r for _, r in recs[:cfg.gpus]]
    assert all(isinstance(r, ProcessInfo) for r in infos) and kinds["ProcessInfo"] == cfg.gpus
    assert sorted(r.rank for r in infos) == list(range(cfg.gpus))
    assert {(r.job_key, r.world_size) for r in infos} == {("slurm:42", cfg.gpus)}
    assert all(r.env["RANK"] == str(r.rank) and r.local_rank == r.rank % 4 for r in infos)
    # agent ids: one per node; the node's processes have distinct pids
    by_agent = defaultdict(set)
    for aid, r in recs:
        if isinstance(r, ProcessInfo):
            by_agent[aid].add(r.pid)
    assert sorted(by_agent) == sorted(f"sim-node-{n}" for n in range(cfg.gpus // 4))
    assert all(len(p) == 4 for p in by_agent.values())
    # metrics only under the gpu source's real names; nothing simulator-only
    names = {r.name for _, r in recs if isinstance(r, Metric)}
    assert names and names <= set(DCGM_NAMES), names
    for _, r in recs:
        for f in (x.name for x in dataclasses.fields(r)):
            assert not f.startswith("sim_") and f not in ("compute_ns", "comm_wait_ns", "stall_ns")
    # a Step per rank per iteration, with per-communicator summaries, in the agents' clock
    steps = [r for _, r in recs if isinstance(r, Step)]
    assert len(steps) == cfg.gpus * cfg.iterations
    assert all(r.job_key == "slurm:42" and r.evidence == "comm_pattern" and r.comms for r in steps)
    assert all(MONO <= r.start_mono_ns < r.end_mono_ns for r in steps)
    s5 = sorted((r for r in steps if r.rank == 13), key=lambda r: r.step)  # stage 1, replica 2, TP index 1
    assert [r.step for r in s5] == list(range(cfg.iterations))
    assert all(a.end_mono_ns == b.start_mono_ns for a, b in zip(s5, s5[1:]))  # consecutive steps share the boundary
    comms = {c.comm_id for c in s5[0].comms}
    assert cfg.coords(13) == (1, 2, 1)
    assert comms == {"dp.s1.t1", "tp.s1.d2", "pp.s0-1.d2.t1", "pp.s1-2.d2.t1"}, comms
    assert all(isinstance(r.mono_ns, int) and r.mono_ns >= MONO for _, r in recs)


def test_agents_deal_nodes_round_robin():
    cfg = _cfg(iterations=2)
    ids = {aid for aid, _ in agent_records(cfg, [], agents=2)}
    assert ids == {"sim-node-0", "sim-node-1"}
    ents = {r.entity for _, r in agent_records(cfg, [], agents=2) if isinstance(r, Metric)}
    assert "node3.gpu1" in ents  # an agent hosting several nodes names its GPUs by node


def test_summaries_are_commlog_summarize_of_the_fetched_ops():
    """CommSummary per rank per step = the real summarize() over commops() of that step's window."""
    cfg = _cfg(iterations=4)
    recs = [r for _, r in agent_records(cfg, [], mono_base=MONO)]
    steps = {(r.rank, r.step): r for r in recs if isinstance(r, Step)}
    for rank in (0, 7, 13):
        st = steps[(rank, 2)]
        ops = [o for o in commops(cfg, [], [rank], st.start_mono_ns + 1, st.end_mono_ns, mono_base=MONO)
               if o.issue_mono_ns >= steps[(rank, 1)].end_mono_ns or o.issue_mono_ns > st.start_mono_ns]
        ops = [o for o in ops if o.end_mono_ns <= st.end_mono_ns]
        assert all(isinstance(o, CommOp) and o.rank == rank for o in ops)
        assert len(ops) == st.ops
        want = {(s.comm_id, s.op): s for s in summarize(ops)}
        got = {(s.comm_id, s.op): s for s in recs if isinstance(s, CommSummary) and s.rank == rank
               and st.start_mono_ns < s.mono_ns <= st.end_mono_ns}
        assert set(got) == set(want)
        for k, w in want.items():
            g = got[k]
            assert (g.calls, g.bytes, g.busy_ns, g.max_ns, g.start_mono_ns, g.mono_ns, g.seq_first, g.seq_last,
                    g.pid, g.timing, g.step) == (w.calls, w.bytes, w.busy_ns, w.max_ns, w.start_mono_ns, w.mono_ns,
                                                 w.seq_first, w.seq_last, w.pid, w.timing, w.step), k


def test_commops_look_like_flight_recorder_ops():
    cfg = _cfg(iterations=3)
    ops = commops(cfg, [], [5], 0, 0, mono_base=MONO)
    assert ops and {o.rank for o in ops} == {5}
    by = defaultdict(list)
    for o in ops:
        by[(o.comm_id, o.op)].append(o)
        assert o.issue_mono_ns <= o.end_mono_ns and o.timing == "cuda_event" and o.pid == 4001
        assert o.rank in o.members and o.members[o.group_rank] == 5 and o.nranks == len(o.members)
    assert cfg.coords(5) == (0, 2, 1)
    assert [o.seq for o in by[("dp.s0.t1", "all_reduce")]] == [0, 1, 2]
    assert by[("dp.s0.t1", "all_reduce")][0].members == [cfg.rank(0, d, 1) for d in range(cfg.dp)]
    assert [o.seq for o in by[("tp.s0.d2", "all_reduce")]][:3] == [0, 1, 2]
    recv = by[("pp.s0-1.d2.t1", "recv")]
    assert all(o.seq == -1 and o.p2p_seq >= 0 and o.seq_source == "" for o in recv)
    # a window cuts the list
    mid = ops[len(ops) // 2].issue_mono_ns
    part = commops(cfg, [], [5], 0, mid, mono_base=MONO)
    assert 0 < len(part) < len(ops) and all(o.issue_mono_ns <= mid for o in part)


def test_a_fetch_of_a_few_ranks_is_those_ranks_ops_of_the_whole_walk():
    """Rows.commops(it, ranks) walks the asked ranks only (a fetch of 9 ranks of 8,192 walked every rank's ops of
    every iteration): the same ops in the same order as the whole walk filtered to them, net jitter included (its
    per-iteration pair times are kept per stage); and commops() with a `keep` dict kept between calls answers as a
    fresh call does."""
    from bench.sim.model import simulate
    from bench.sim.output import Rows
    for kw in (dict(dp=4, pp=4, tp=2, micro_batches=4, gpus_per_node=4), dict(dp=2, pp=1, tp=4),
               dict(dp=1, pp=4, tp=1), dict(dp=8, pp=2, tp=1)):
        cfg = ModelConfig(iterations=5, seed=4, **kw)
        cfg.net_jitter_cv = 0.03
        faults = [parse_fault("slow_link:n0.nic1:1:3:2", cfg.topology())]
        its: list = []
        simulate(cfg, faults, sink=its.append)
        whole, part = Rows(cfg), Rows(cfg)
        for it in its:
            every = list(whole.commops(it))
            for want in ({1}, {0, cfg.gpus - 1}, set(range(1, cfg.gpus, 3)), {-1, cfg.gpus + 2}):
                assert list(part.commops(it, want)) == [o for o in every if o[0] in want], (kw, want)
        keep: dict = {}
        for ranks in ([1, 2], [cfg.gpus - 1], [0, 1, 2]):
            assert (commops(cfg, faults, ranks, 0, 0, mono_base=MONO, iterations=its, keep=keep)
                    == commops(cfg, faults, ranks, 0, 0, mono_base=MONO)), (kw, ranks)
        assert set(keep) == {"rows", "members"}


def test_constructed_steps_agree_with_the_real_segmenter():
    """The default steps and agent/steps.py's on the same ops: same ops, calls and bytes per step and
    communicator, the same mean step time; the segmenter loses the steps it needs to learn. Compared on the
    ranks whose every segmenter step is one whole cycle (every rank: see the test below)."""
    cfg = _cfg(iterations=12)
    faults = [parse_fault("slow_gpu:2:6:9:1.5", cfg.topology())]
    cons = [r for _, r in agent_records(cfg, faults) if isinstance(r, Step)]
    seg = [r for _, r in agent_records(cfg, faults, steps="segmenter") if isinstance(r, Step)]
    whole = sorted({s.rank for s in seg} - {s.rank for s in seg if s.ops != s.period_ops})
    assert whole == list(range(cfg.gpus)), whole
    for rank in whole:
        assert len([s for s in seg if s.rank == rank]) >= cfg.iterations - 3
        a = sorted((s for s in cons if s.rank == rank), key=lambda s: s.step)
        b = sorted((s for s in seg if s.rank == rank), key=lambda s: s.step)
        assert {s.ops for s in b} == {a[0].ops}
        sig = lambda s: sorted((c.comm_id, c.calls, c.bytes) for c in s.comms)  # noqa: E731
        assert all(sig(s) == sig(a[0]) for s in b)
        # steady steps (before and after the fault): the same period
        mean = lambda xs: sum(x.end_mono_ns - x.start_mono_ns for x in xs) / len(xs)  # noqa: E731
        steady_a = [s for s in a if s.step in (3, 4)]
        steady_b = [s for s in b if s.step in (3, 4)] or b[:2]
        assert abs(mean(steady_a) / mean(steady_b) - 1) < 0.02, (rank, mean(steady_a), mean(steady_b))


def test_segmenter_mode_is_the_real_segmenter():
    """steps="segmenter" emits exactly what a StepSegmenter fed with the fetched ops emits."""
    cfg = _cfg(iterations=6)
    got = [r for _, r in agent_records(cfg, [], steps="segmenter") if isinstance(r, Step) and r.rank == 6]
    seg = StepSegmenter()
    ops = commops(cfg, [], [6], 0, 0)
    want = seg.add(ops)
    assert got and [(s.step, s.start_mono_ns, s.end_mono_ns, s.ops) for s in got] == \
        [(s.step, s.start_mono_ns, s.end_mono_ns, s.ops) for s in want][:len(got)]
    assert not [r for _, r in agent_records(cfg, [], steps="segmenter") if isinstance(r, Flow) and r.bytes <= 0]


def test_segmenter_cuts_one_step_per_iteration_on_every_stage():
    """A middle 1F1B stage's cut op signature recurs inside the cycle after the pipeline bubble: still one
    step per iteration (the cut is one phase of the cycle, not every op with that signature and a long gap)."""
    cfg = _cfg(iterations=12)
    seg = [r for _, r in agent_records(cfg, [], steps="segmenter") if isinstance(r, Step)]
    assert {s.rank for s in seg} == set(range(cfg.gpus))
    assert all(s.ops == s.period_ops == 25 if cfg.coords(s.rank)[0] in (1, 2) else s.ops == s.period_ops for s in seg)


def test_dense_column_path_equals_the_per_rank_path():
    """_dense_records (column-wise, dense jobs) makes exactly the records of the generic per-rank path."""
    def key(x):
        r = x[1]
        return (x[0], type(r).__name__, getattr(r, "rank", -1), r.mono_ns, getattr(r, "comm_id", ""),
                getattr(r, "op", ""), getattr(r, "name", ""), getattr(r, "entity", ""), getattr(r, "dst", ""))
    for kw in (dict(dp=4, pp=4, tp=2, micro_batches=4, gpus_per_node=4), dict(dp=1, pp=4, tp=2),
               dict(dp=2, pp=1, tp=4), dict(dp=4, pp=2, tp=1, micro_batches=40)):  # 40: > 64 ops, offsets capped
        cfg = ModelConfig(iterations=4, seed=2, **kw)
        faults = [parse_fault("slow_gpu:1:1:3:2", cfg.topology())]
        a = sorted(agent_records(cfg, faults, mono_base=MONO), key=key)
        b = sorted(agent_records(cfg, faults, mono_base=MONO, _dense=False), key=key)
        assert a == b, kw
        # and in the same Python types (a numpy integer compares equal to an int but is not one to protobuf or
        # json; numpy >= 2 writes it np.int64(...), so the reprs differ)
        assert [repr(x) for x in a] == [repr(x) for x in b], kw


def test_kinds_select_what_is_built():
    cfg = _cfg(iterations=2)
    got = Counter(type(r).__name__ for _, r in agent_records(cfg, [], kinds=frozenset({"process", "step"})))
    assert got == {"ProcessInfo": cfg.gpus, "Step": cfg.gpus * 2}
    with pytest.raises(ValueError):
        list(agent_records(cfg, [], kinds=frozenset({"sim_steps"})))


def _port_series(cfg, faults):
    """{(agent, port): {metric name: [(ts, value)]}} of the `port` kind."""
    out: dict = defaultdict(lambda: defaultdict(list))
    for aid, rec in agent_records(cfg, faults, job_key="j", mono_base=MONO, kinds=frozenset({"port"})):
        assert isinstance(rec, Metric)
        out[(aid, rec.entity)][rec.name].append((rec.mono_ns, rec.value))
    return out


def _wait_per_byte(s, a: int, b: int) -> float:
    """Wait ticks per byte sent between the a-th and b-th samples of one port."""
    w, n = s["ib_port_transmit_wait_ticks_total"], s["ib_port_transmit_bytes_total"]
    return (w[b][1] - w[a][1]) / (n[b][1] - n[a][1])


def test_port_figures_are_the_host_sources_and_waits_follow_the_bottleneck_after_the_sender():
    from steplens.agent.sources.host import IB_COUNTERS, IB_DATA
    real = {m for _, m, _ in IB_COUNTERS} | {m for _, m in IB_DATA} | {"ib_port_up", "ib_port_rate_gbps",
                                                                       "ib_port_counters_saturated"}
    # 8 nodes on 2 leaves (DP8 x PP2 x TP4, 4 GPUs a node); leaf1 1.5x congested over the second half
    cfg = _cfg(dp=8, pp=2, tp=4, iterations=160, nodes_per_leaf=4, spines=2)
    topo = cfg.topology()
    half = cfg.iterations // 2
    ser = _port_series(cfg, [parse_fault(f"congested_switch:leaf1:{half}:{cfg.iterations}:1.5", topo)])
    assert {n for s in ser.values() for n in s} <= real and len(ser) == cfg.gpus
    n = min(len(s["ib_port_transmit_bytes_total"]) for s in ser.values())
    assert n >= 6, n
    rise: dict[str, list[float]] = defaultdict(list)
    for (aid, _), s in ser.items():
        assert all(v == 0 for _, v in s["ib_port_counters_saturated"])
        if s["ib_port_transmit_bytes_total"][n - 1][1] == 0:
            continue   # a NIC that sends nothing across nodes
        before, during = _wait_per_byte(s, 0, n // 2 - 1), _wait_per_byte(s, n // 2 + 1, n - 1)
        rise[topo.leaf_of_node(int(aid.rsplit("-", 1)[1]))].append(during / before)
    # every sending NIC under leaf1 waits longer per byte; leaf0's only for what they send across leaf1
    assert len(rise["leaf1"]) >= 4 and min(rise["leaf1"]) > 2.0, rise
    assert sorted(rise["leaf1"])[len(rise["leaf1"]) // 2] > 1.5 * sorted(rise["leaf0"])[len(rise["leaf0"]) // 2]
    # a slow NIC link: its own errors rise and its own sends do not wait for it (the NICs sending to it do)
    link = topo.link_of(9)
    ser = _port_series(cfg, [parse_fault(f"slow_link:{link}:{half}:{cfg.iterations}:2.0", topo)])
    own = ser[(f"sim-node-{9 // cfg.gpus_per_node}", topo.port_of(9))]
    errs = own["ib_port_symbol_errors_total"]
    assert errs[-1][1] - errs[n // 2][1] > 50 * (errs[n // 2 - 1][1] - errs[0][1] + 1)
    assert _wait_per_byte(own, n // 2 + 1, n - 1) < 2.0 * _wait_per_byte(own, 0, n // 2 - 1)
