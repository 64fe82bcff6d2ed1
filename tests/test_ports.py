"""collector/analysis/ports.py: a NIC's own port counters over an episode against before it, read from a real store
(the host source's ib_port_* Metrics through the agent encoding and StoreWriter), the tie it breaks, and the
transmit wait that tells a congested leaf from a slow NIC link under it."""

from __future__ import annotations

import time

from steplens.agent.records import Metric
from steplens.agent.transport.codec import encode_records
from steplens.collector.analysis.findings import Suspect
from steplens.collector.analysis.ports import WAIT_MAX, break_tie, leaf_congestion, port_evidence, promote_leaf
from steplens.collector.ingest.clock import ClockEstimate
from steplens.collector.store.queries import Reader
from steplens.collector.store.writer import BatchJob, StoreWriter
from steplens.collector.topology import from_dict

S = 10**9
OFF = 10**12   # the store's clock: cluster time = monotonic + OFF

TOPO = from_dict({
    "format": "steplens-topology", "version": 1,
    "switches": [{"id": "leaf0", "tier": "leaf"}],
    "nodes": [{"id": "h0", "nics": [{"id": "h0.nic0", "switch": "leaf0", "port": "mlx5_0/1", "speed_gbps": 400},
                                    {"id": "h0.nic1", "switch": "leaf0"}]},
              {"id": "h1", "nics": [{"id": "h1.nic0", "switch": "leaf0", "port": "mlx5_0/1"}]}]})


def store(tmp_path, per_node: dict[str, list[Metric]]) -> Reader:
    path = str(tmp_path / "ports.db")
    w = StoreWriter(path)
    w.start()
    done: list = []
    clock = ClockEstimate(offset_ns=OFF, drift_ppm=0.0, ref_mono_ns=0, uncertainty_ns=1, best_rtt_ns=1, samples=5)
    try:
        for i, (node, recs) in enumerate(per_node.items()):
            w.submit(BatchJob(node, "cd" * 8, 1, len(recs), encode_records([("host", m) for m in recs]),
                              max(m.mono_ns for m in recs) + 1, clock, time.time_ns(), lambda *a: done.append(a)))
        deadline = time.monotonic() + 20
        while len(done) < len(per_node) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        w.stop()
    assert len(done) == len(per_node) and all(d[0] == "stored" for d in done), done
    return Reader(path)


def series(errors_at, seconds=120, rate=400.0, up=lambda t: 1.0, saturated=0.0, port="mlx5_0/1") -> list[Metric]:
    """Samples every 2 s of one port: symbol errors counted by errors_at(t) (cumulative), the trained rate."""
    out = []
    for t in range(0, seconds + 1, 2):
        ts = t * S
        out += [Metric(ts, "ib_port_symbol_errors_total", port, float(errors_at(t))),
                Metric(ts, "ib_port_link_downed_total", port, 0.0),
                Metric(ts, "ib_port_up", port, up(t)),
                Metric(ts, "ib_port_rate_gbps", port, rate if not callable(rate) else rate(t)),
                Metric(ts, "ib_port_counters_saturated", port, saturated)]
    return out


def test_errors_rising_in_the_episode_degrade_the_port_and_a_steady_trickle_does_not(tmp_path):
    # h0's port: 0.2/s all along, then 30/s over 80-90 s; h1's: 0.2/s all along
    bad = series(lambda t: int(0.2 * t + (30 * (min(t, 90) - 80) if t > 80 else 0)))
    ok = series(lambda t: int(0.2 * t))
    reader = store(tmp_path, {"h0": bad, "h1": ok})
    ev = port_evidence(reader, TOPO.nics["h0.nic0"], OFF + 81 * S, OFF + 89 * S)
    assert ev["degraded"] and ev["errors"]["symbol_errors"] >= 240 and ev["errors_per_s"] > 20
    assert ev["baseline_errors_per_s"] < 0.5 and "symbol errors" in ev["why"]
    calm = port_evidence(reader, TOPO.nics["h1.nic0"], OFF + 81 * S, OFF + 89 * S)
    assert not calm["degraded"] and calm["rate_gbps"] == {"before": 400.0, "during": 400.0}
    assert port_evidence(reader, TOPO.nics["h0.nic1"], OFF + 81 * S, OFF + 89 * S) is None   # no port named


def test_a_reset_counter_a_port_gone_down_a_downshift_and_saturation(tmp_path):
    # h0: counter reset at 60 s (drops to 0) and a quiet port after it; h1: went down at 84 s and trained at 200
    reset = series(lambda t: 5000 + t if t < 60 else t - 60)
    down = series(lambda t: 0, rate=lambda t: 400.0 if t < 84 else 200.0, up=lambda t: 0.0 if t == 84 else 1.0,
                  saturated=1.0)
    reader = store(tmp_path, {"h0": reset, "h1": down})
    ev = port_evidence(reader, TOPO.nics["h0.nic0"], OFF + 58 * S, OFF + 62 * S)
    # reset at 60 s (to 0: what came after the 58 s sample is lost), then 0 -> 2
    assert ev["errors"]["symbol_errors"] == 2 and not ev["degraded"]
    ev = port_evidence(reader, TOPO.nics["h1.nic0"], OFF + 81 * S, OFF + 89 * S)
    assert ev["degraded"] and ev["down"] and ev["saturated"] == 1
    assert ev["rate_gbps"] == {"before": 400.0, "during": 200.0} and "trained at 200 Gb/s, 400 before" in ev["why"]


def test_the_degraded_one_of_tied_links_leads_and_nothing_else_moves(tmp_path):
    bad = series(lambda t: 50 * max(0, t - 80))
    reader = store(tmp_path, {"h0": bad, "h1": series(lambda t: 0)})
    sus = [Suspect("link", "h1.nic0", 0.66, "network", {}), Suspect("link", "h0.nic0", 0.66, "network", {}),
           Suspect("switch", "leaf0", 0.33, "network", {})]
    out = break_tie(reader, TOPO, sus, OFF + 82 * S, OFF + 90 * S)
    assert max(out, key=lambda s: s.score).id == "h0.nic0" and out[1].evidence["port"]["degraded"]
    assert out[0].score == 0.66 and not out[0].evidence["port"]["degraded"] and out[2] == sus[2]
    # both degraded, or no figures: the tie stays (evidence attached where read)
    (tmp_path / "b").mkdir()
    both = store(tmp_path / "b", {"h0": bad, "h1": series(lambda t: 50 * max(0, t - 80))})
    out = break_tie(both, TOPO, sus, OFF + 82 * S, OFF + 90 * S)
    assert out[0].score == out[1].score == 0.66 and all(s.evidence["port"]["degraded"] for s in out[:2])
    assert break_tie(reader, None, sus, 0, 1) is sus


# two leaves of two nodes, two NICs each, every NIC naming its port
TWO = from_dict({
    "format": "steplens-topology", "version": 1,
    "switches": [{"id": "leaf0", "tier": "leaf"}, {"id": "leaf1", "tier": "leaf"}],
    "nodes": [{"id": f"h{n}", "nics": [{"id": f"h{n}.nic{k}", "switch": f"leaf{n // 2}", "port": f"mlx5_{k}/1"}
                                       for k in range(2)]} for n in range(4)]})
NICS = sorted(TWO.nics)


def waits(per_byte, seconds=120, gbps=100.0, start=0.0, port="mlx5_0/1") -> list[Metric]:
    """One port every 2 s: bytes sent at gbps, transmit wait ticks at per_byte(t) ticks a byte (cumulative)."""
    out, wait, sent = [], start, 0.0
    for t in range(0, seconds + 1, 2):
        if t:
            sent += gbps / 8 * 1e9 * 2
            wait = min(float(WAIT_MAX), wait + per_byte(t) * gbps / 8 * 1e9 * 2)
        out += [Metric(t * S, "ib_port_transmit_wait_ticks_total", port, float(int(wait))),
                Metric(t * S, "ib_port_transmit_bytes_total", port, sent)]
    return out


def fabric(tmp_path, per_nic: dict[str, object], name="w") -> Reader:
    """A store with every NIC of TWO sending: per_nic[nic id](t) its wait per byte (default 1e-4, steady)."""
    d = tmp_path / name
    d.mkdir()
    per_node: dict[str, list[Metric]] = {}
    for nid in NICS:
        nic = TWO.nics[nid]
        per_node.setdefault(nic.node, []).extend(waits(per_nic.get(nid, lambda t: 1e-4), port=nic.port))
    return store(d, per_node)


def after(x: float, onset: int = 80):
    return lambda t: 1e-4 * (x if t > onset else 1.0)


def test_a_congested_leaf_makes_every_nic_under_it_wait_and_leads_a_nic_link_under_it(tmp_path):
    on, off = OFF + 80 * S, OFF + 100 * S
    # leaf0's four NICs wait 4x longer per byte from 80 s; leaf1's (whose sends partly cross leaf0) 1.5x
    reader = fabric(tmp_path, {**{n: after(4.0) for n in NICS[:4]}, **{n: after(1.5) for n in NICS[4:]}})
    ev = leaf_congestion(reader, TWO, "leaf0", NICS, on, off)
    assert ev["congested"] and ev["nics"] == 4 and ev["waited_more"] == 4 and ev["outside_nics"] == 4
    assert ev["wait_per_byte_rise"] == 3e-4 and ev["outside_wait_per_byte_rise"] == 5e-5
    assert "4 of 4 NICs under it wait >= 1.5x longer per byte sent, 6.0x the rise" in ev["why"]
    assert not leaf_congestion(reader, TWO, "leaf1", NICS, on, off)["congested"]
    sus = [Suspect("link", "h0.nic1", 0.8, "network", {}), Suspect("switch", "leaf0", 0.5, "network", {}),
           Suspect("link", "h1.nic0", 0.4, "network", {})]
    out = promote_leaf(reader, TWO, sus, NICS, on, off)
    assert [s.id for s in out] == ["leaf0", "h0.nic1", "h1.nic0"] and out[0].score == 0.84
    assert out[0].evidence["xmit_wait"]["congested"] and out[1] == sus[0]
    # a leaf the detector had not listed is added; one whose NIC's own port is degraded stays behind it
    out = promote_leaf(reader, TWO, [sus[0]], NICS, on, off)
    assert [(s.kind, s.id, s.score) for s in out] == [("switch", "leaf0", 0.84), ("link", "h0.nic1", 0.8)]
    bad = Suspect("link", "h0.nic1", 0.8, "network", {"port": {"degraded": True}})
    assert promote_leaf(reader, TWO, [bad, sus[1]], NICS, on, off)[0] is bad
    # a top suspect under the other leaf, or no topology: nothing moves
    other = [Suspect("link", "h2.nic0", 0.8, "network", {})]
    assert promote_leaf(reader, TWO, other, NICS, on, off) == other
    assert promote_leaf(reader, None, sus, NICS, on, off) is sus


def test_a_slow_link_makes_only_its_senders_wait_and_the_leaf_stays_behind_it(tmp_path):
    on, off = OFF + 80 * S, OFF + 100 * S
    # h1.nic0 is slow: h0.nic0, which sends to it, waits 4x longer; nothing else moves
    reader = fabric(tmp_path, {"h0.nic0": after(4.0)})
    ev = leaf_congestion(reader, TWO, "leaf0", NICS, on, off)
    assert not ev["congested"] and ev["waited_more"] == 1 and ev["share"] == 0.25 and "why" not in ev
    sus = [Suspect("link", "h1.nic0", 0.8, "network", {}), Suspect("switch", "leaf0", 0.5, "network", {})]
    out = promote_leaf(reader, TWO, sus, NICS, on, off)
    assert out[0] == sus[0] and out[1].score == 0.5 and not out[1].evidence["xmit_wait"]["congested"]
    # every NIC of the job waits alike (a spine, or all sends crossing the leaf): no contrast, no leaf
    flat = fabric(tmp_path, {n: after(4.0) for n in NICS}, "flat")
    ev = leaf_congestion(flat, TWO, "leaf0", NICS, on, off)
    assert ev["share"] == 1.0 and not ev["congested"]


def test_a_saturated_wait_counter_is_left_out_and_too_few_nics_give_no_evidence(tmp_path):
    on, off = OFF + 80 * S, OFF + 100 * S
    d = tmp_path / "sat"
    d.mkdir()
    per_node: dict[str, list[Metric]] = {}
    for nid in NICS:
        nic = TWO.nics[nid]
        start = float(WAIT_MAX - 10**6) if nid != "h0.nic0" else 0.0   # all but one stop counting at once
        per_node.setdefault(nic.node, []).extend(waits(after(4.0), start=start, port=nic.port))
    reader = store(d, per_node)
    assert leaf_congestion(reader, TWO, "leaf0", NICS, on, off) is None    # one NIC under leaf0 left
    assert leaf_congestion(reader, TWO, "leaf9", NICS, on, off) is None    # no such switch
    sus = [Suspect("link", "h0.nic0", 0.8, "network", {})]
    assert promote_leaf(reader, TWO, sus, NICS, on, off) == sus


def test_of_leaves_tied_at_the_top_the_one_congested_when_the_slowing_began_leads(tmp_path):
    on, off = OFF + 80 * S, OFF + 100 * S
    tied = [Suspect("switch", "leaf0", 0.5, "network", {}), Suspect("switch", "leaf1", 0.5, "network", {})]
    # leaf1's NICs wait 4x longer from 80 s; leaf0's, whose sends cross leaf1, 2x: leaf1 leads
    reader = fabric(tmp_path, {**{n: after(2.0) for n in NICS[:4]}, **{n: after(4.0) for n in NICS[4:]}})
    out = promote_leaf(reader, TWO, tied, NICS, on, off)
    assert [(s.id, s.score) for s in out] == [("leaf1", 0.525), ("leaf0", 0.5)]
    assert out[0].evidence["xmit_wait"]["congested"] and not out[1].evidence["xmit_wait"]["congested"]
    # leaf0 congested too, from 94 s: over the first steps of the episode (early_ns 88 s) only leaf1 was
    late = fabric(tmp_path, {**{n: after(4.0, 94) for n in NICS[:4]}, **{n: after(4.0) for n in NICS[4:]}}, "late")
    out = promote_leaf(late, TWO, tied, NICS, on, off, early_ns=OFF + 88 * S)
    assert [(s.id, s.score) for s in out] == [("leaf1", 0.525), ("leaf0", 0.5)]
    # a lone leaf on top is not weighed against anything: it keeps its score, with the evidence
    out = promote_leaf(reader, TWO, tied[1:], NICS, on, off)
    assert out[0].score == 0.5 and out[0].evidence["xmit_wait"]["congested"]
