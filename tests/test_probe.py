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
