"""Point-to-point probing (collector/analysis/probe.py): send transfer times from fetched CommOps, the slow
pairs between a reference and a slow span, and what happens when fetching is not possible."""

from __future__ import annotations

from steplens.collector.analysis import probe
from steplens.collector.analysis.findings import Suspect


def op(rank, op_, seq, start, end, comm="pp.a", members=(0, 1)):
    return {"kind": "commop", "rank": rank, "comm_id": comm, "op": op_, "p2p_seq": seq, "peer": -1,
            "members": list(members), "start_ns": start, "issue_ns": start, "end_ns": end}


def test_a_send_waiting_for_its_receiver_counts_from_the_receive():
    rows = [op(0, "send", 1, 100, 200), op(1, "recv", 1, 150, 200),   # receiver posted late: 50 ns of transfer
            op(0, "send", 2, 300, 340)]                              # receiver not fetched: the whole send
    assert probe.transfers(rows) == {("pp.a", 0, 1): [50, 40]}


class FakeReader:
    def __init__(self, ref, bad, fail=False):
        self.calls, self.ref, self.bad, self.fail = [], ref, bad, fail

    def fetch_commops(self, job, ranks, since, until, limit=0):
        if self.fail:
            raise RuntimeError("agent h3 did not answer in 30 s")
        self.calls.append((tuple(ranks), since, until))
        return self.ref if since < 1000 else self.bad


def spans(base):
    return [(base, base + 999)]


def test_slow_and_healthy_pairs():
    ref = [op(0, "send", k, k * 10, k * 10 + 5) for k in range(5)] + \
          [op(2, "send", k, k * 10, k * 10 + 5, comm="pp.b", members=(2, 3)) for k in range(5)]
    bad = [op(0, "send", k, 1000 + k * 10, 1000 + k * 10 + 9) for k in range(5)] + \
          [op(2, "send", k, 1000 + k * 10, 1000 + k * 10 + 5, comm="pp.b", members=(2, 3)) for k in range(5)]
    rd = FakeReader(ref, bad)
    res = probe.probe(rd, "job", [0, 2, 0], spans(0), spans(1000), min_excess_ns=1)
    assert res.ranks_fetched == [0, 2] and len(rd.calls) == 2
    assert res.slow == {"p2p:pp.a:0>1": 1.8} and set(res.members) == {"p2p:pp.a:0>1", "p2p:pp.b:2>3"}
    assert res.evidence()["ranks_fetched"] == 2


def test_no_fetching_or_a_failed_fetch_leaves_a_note():
    class Plain:
        pass
    assert "no progressive fetching" in probe.probe(Plain(), "job", [0], spans(0), spans(1000)).note
    res = probe.probe(FakeReader([], [], fail=True), "job", [0], spans(0), spans(1000))
    assert res.members == {} and "did not answer" in res.note


def test_tied_suspects():
    a, b, c = (Suspect("link", x, s, "network", {}) for x, s in (("l1", 1.0), ("l2", 0.99), ("l3", 0.5)))
    assert [x.id for x in probe.tied([a, b, c])] == ["l1", "l2"]
    assert probe.tied([a, c]) == [] and probe.tied([Suspect("rank", "1", 1.0, "compute", {}), c]) == []


def test_ranks_are_ordered_to_reach_the_most_tied_devices_first():
    """A rank's sends cross its own node/NIC and its pipeline peers': ranks that reach nothing new come last.
    Ranks 0..31 on nodes n0..n3 (8 each), pipeline pairs (r, r + 8): rank 0 reaches n0 and n1, rank 8 adds n2,
    rank 16 n3; the rest follow in their order."""
    node_of = {r: f"n{r // 8}" for r in range(32)}
    members = {f"pp{r}": {r, r + 8} for r in range(24)} | {"dp": set(range(0, 32, 8))}
    cands = [Suspect("node", f"n{i}", 1.0, "network", {}) for i in range(4)]
    order = probe.by_coverage(list(range(32)), cands, None, {}, node_of, members)
    assert order == [0, 8, 16] + [r for r in range(32) if r not in (0, 8, 16)]
    assert probe.by_coverage([5, 5, 3], cands[:1], None, {}, node_of, {}) == [5, 3]   # once each
    assert probe.by_coverage([], cands, None, {}, node_of, members) == []


def test_results_of_rounds_merge():
    a = probe.ProbeResult({"p1": 1.5}, {"p1": {0, 1}, "p2": {2, 3}}, [0, 2], 40, "", 1)
    b = probe.ProbeResult({"p3": 1.2}, {"p1": {0, 1}, "p3": {4, 5}}, [4], 10, "")
    a.merge(b)   # p1 seen again and healthy this time: the later verdict
    assert a.slow == {"p3": 1.2} and set(a.members) == {"p1", "p2", "p3"} and a.ranks_fetched == [0, 2, 4]
    assert a.ops == 50 and a.rounds == 2 and a.evidence()["rounds"] == 2
