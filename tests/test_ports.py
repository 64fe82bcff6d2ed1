"""collector/analysis/ports.py: a NIC's own port counters over an episode against before it, read from a real store
(the host source's ib_port_* Metrics through the agent encoding and StoreWriter), and the tie it breaks."""

from __future__ import annotations

import time

from steplens.agent.records import Metric
from steplens.agent.transport.codec import encode_records
from steplens.collector.analysis.findings import Suspect
from steplens.collector.analysis.ports import break_tie, port_evidence
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
