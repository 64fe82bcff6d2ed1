"""The merged Perfetto trace (collector/perfetto.py, control/trace.py), read back by Perfetto's own trace processor
(its wasm build under Node.js: tests/perfettotp): tracks per node and rank, stacks nested, one flow per collective
member towards the member that entered last, counters, findings, deep windows; and overlapping rows clipped."""

from __future__ import annotations

import pytest

from perfettotp import TraceProcessorWasm, unavailable
from steplens.collector.analysis.findings import Finding, Suspect
from steplens.collector.control.trace import _build, _rates
from steplens.collector.perfetto import TraceBuilder, stack_spans

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "-")
S = 10**9


def _frames(*names):
    return [{"function": n, "qualname": n, "file": f"/w/{n}.py", "line": 1} for n in reversed(names)]  # innermost 1st


def _job():
    procs = [{"node_id": f"n{r // 2}", "pid": 100 + r, "start_ticks": 7, "rank": r, "job_key": "j"} for r in range(4)]
    steps = [{"node_id": f"n{r // 2}", "pid": 100 + r, "rank": r, "step": k, "start_ns": S + k * S,
              "end_ns": S + (k + 1) * S - 1000, "evidence": "commops"} for r in range(4) for k in range(3)]
    ops = []
    for seq in range(3):  # 3 all_reduces on the world; rank 2 enters each one 50 ms late
        for r in range(4):
            enter = S + seq * S + 100_000_000 + (50_000_000 if r == 2 else r * 1_000_000)
            ops.append({"kind": "commop", "node_id": f"n{r // 2}", "pid": 100 + r, "rank": r, "comm_id": "pg:0",
                        "comm_desc": "default_pg", "seq": seq, "p2p_seq": 0, "op": "all_reduce",
                        "issue_ns": enter, "start_ns": enter, "end_ns": S + seq * S + 160_000_000, "bytes": 1024,
                        "nranks": 4, "timing": "cpu"})
    stacks = []
    for r in range(4):
        for i in range(100):  # 10 ms samples: main -> train -> (forward x50, backward x50)
            leaf = "forward" if i < 50 else "backward"
            stacks.append({"kind": "stack_sample", "node_id": f"n{r // 2}", "pid": 100 + r, "tid": 100 + r,
                           "ts_ns": S + i * 10_000_000, "frames": _frames("main", "train", leaf)})
    store = {"steps": steps, "iterations": [],
             "findings": [Finding("slowdown", S, 3 * S, 1.3, "rank 2 is late", (Suspect("rank", "2", 1.0, "cpu"),),
                                  job_key="j", detector="lateness", id="f1")],
             "modes": {"n0": [{"ts_ns": 2 * S, "entity": "deep", "message": "deep (command) command c1"},
                              {"ts_ns": 3 * S, "entity": "sentinel", "message": "window ended"}], "n1": []},
             "node_metrics": {"n0": {("cpu_utilization_percent", ""): [(S, 10.0), (2 * S, 90.0)],
                                     ("network_transmit_bytes_total", "eth0"): [(S, 0.0), (2 * S, 5e6)]}},
             "proc_metrics": {"n1": {("process_cpu_percent", "pid:102:7"): [(S, 50.0), (2 * S, 99.0)]}}}
    return procs, store, ops + stacks


def _load(tmp_path, data: bytes) -> TraceProcessorWasm:
    path = tmp_path / "t.pftrace"
    path.write_bytes(data)
    return TraceProcessorWasm.load(str(path))


def test_merged_trace_loads_with_every_rank_flows_stacks_counters(tmp_path):
    procs, store, fetched = _job()
    data, stats = _build("j", procs, store, fetched, 0, 10 * S)
    with _load(tmp_path, data) as tp:
        tracks = {r["id"]: r for r in tp.query("select id, name, parent_id from track")}
        by_name = {}
        for t in tracks.values():
            by_name.setdefault(t["name"], []).append(t)
        nodes = {t["name"]: t["id"] for t in tracks.values() if t["name"].startswith("node ")}
        assert set(nodes) == {"node n0", "node n1"}
        for r in range(4):  # one group per rank, under its node
            (rt,) = by_name[f"rank {r} · pid {100 + r}"]
            assert rt["parent_id"] == nodes[f"node n{r // 2}"]
        # comm ops: 12 slices; each collective: 3 flows, all into rank 2's op (the last to enter)
        ops = tp.query("select s.id, s.name, s.ts, t.parent_id from slice s join track t on s.track_id = t.id"
                       " where t.name like 'comm %'")
        assert len(ops) == 12 and {o["name"] for o in ops} == {"all_reduce"}
        flows = tp.query("select f.slice_out, f.slice_in from flow f")
        assert len(flows) == 9 == stats.flows
        op_rank = {o["id"]: o["parent_id"] for o in ops}
        rank2 = by_name["rank 2 · pid 102"][0]["id"]
        assert all(op_rank[f["slice_in"]] == rank2 and op_rank[f["slice_out"]] != rank2 for f in flows)
        # stacks: per rank main (1 s) > train (1 s) > forward (0.5 s), backward (0.5 s)
        st = tp.query("select s.name, s.depth, s.dur, t.parent_id from slice s join track t on s.track_id = t.id"
                      " where t.name like 'python %'")
        assert len(st) == 4 * 4
        for r in range(4):
            mine = sorted((x["depth"], x["name"], x["dur"]) for x in st
                          if x["parent_id"] == by_name[f"rank {r} · pid {100 + r}"][0]["id"])
            assert [(d, n.split(" ")[0]) for d, n, _ in mine] == [(0, "main"), (1, "train"), (2, "backward"),
                                                                  (2, "forward")]
            assert mine[0][2] == 1_000_000_000 and mine[2][2] == mine[3][2] == 500_000_000
        steps = tp.query("select count(*) as n from slice s join track t on s.track_id = t.id where t.name='steps'")
        assert steps[0]["n"] == 12
        # counters: cumulative bytes as a rate; per-process CPU under rank 2
        cv = {r["name"]: r["v"] for r in tp.query(
            "select t.name, max(c.value) as v from counter c join track t on c.track_id = t.id group by t.name")}
        assert cv["network_transmit_bytes_per_s eth0"] == pytest.approx(5e6)
        assert cv["cpu_utilization_percent"] == 90.0 and cv["process_cpu_percent"] == 99.0
        pc = tp.query("select parent_id from track where name = 'process_cpu_percent'")
        assert pc[0]["parent_id"] == rank2
        deep = tp.query("select s.ts, s.dur from slice s join track t on s.track_id = t.id where t.name='deep dives'")
        assert deep == [{"ts": 2 * S, "dur": S}]
        fnd = tp.query("select s.name, s.ts from slice s join track t on s.track_id = t.id"
                       " where t.name = 'slowdown · lateness'")
        assert fnd == [{"name": "rank 2 is late", "ts": S}]
    assert stats.clipped == 0


def test_overlapping_rows_are_clipped_not_broken(tmp_path):
    b = TraceBuilder()
    t = b.track(("x",), "x")
    assert b.slice(t, 100, 200, "a")
    assert b.slice(t, 150, 300, "b")      # overlaps a: starts at 200
    assert not b.slice(t, 120, 180, "c")  # inside a: nothing left
    with _load(tmp_path, b.serialize()) as tp:
        rows = tp.query("select name, ts, dur, depth from slice order by ts")
    assert rows == [{"name": "a", "ts": 100, "dur": 100, "depth": 0}, {"name": "b", "ts": 200, "dur": 100, "depth": 0}]
    assert b.stats.clipped == 2


def test_stack_spans_merge_samples_and_break_at_gaps():
    p = 10
    spans = stack_spans([(0, ["m", "a"]), (10, ["m", "a"]), (20, ["m", "b"]), (100, ["m", "b"])], p, 0)
    # a sample stands for the time to the next one, at most 2 periods: "m" breaks at the 80 ns gap
    assert [(s[0], s[1], s[2], s[3]) for s in spans] == [(0, 40, 0, "m"), (0, 20, 1, "a"), (20, 40, 1, "b"),
                                                         (100, 110, 0, "m"), (100, 110, 1, "b")]
    assert [(s[0], s[1], s[2], s[3]) for s in stack_spans([(0, ["m"]), (5, ["m"])], 5, 8)] == [(0, 8, 0, "m")]


def test_the_trace_subset_has_perfettos_own_field_numbers_and_enum_values():
    """proto/steplens/perfetto/trace.proto against Perfetto's own TracePacket descriptor (the perfetto package)."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as theirs

    from steplens.perfetto import trace_pb2 as ours
    for msg in ours.DESCRIPTOR.message_types_by_name.values():
        ref = getattr(theirs, msg.name).DESCRIPTOR
        for f in msg.fields:
            g = ref.fields_by_name[f.name]
            assert (f.number, f.type) == (g.number, g.type), (msg.name, f.name)
        for e in msg.enum_types:
            values = {v.name: v.number for v in ref.enum_types_by_name[e.name].values}
            assert all(values[v.name] == v.number for v in e.values), (msg.name, e.name)


def test_rates_of_a_cumulative_counter_skip_resets():
    assert _rates([(0, 0.0), (S, 10.0), (2 * S, 5.0), (3 * S, 7.0)]) == [(S, 10.0), (3 * S, 2.0)]
