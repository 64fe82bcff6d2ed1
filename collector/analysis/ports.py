"""What a NIC's own port says: its InfiniBand/RDMA port counters over an episode against before it.

Not a detector: the network detectors ask it about NICs they suspect. A NIC of the topology file that names its
port (`"port": "mlx5_2/1"`, collector/topology.py) is read in its node's metrics (the host source's ib_port_*
figures, agent/sources/host.py read_ib_port, every 2 s by default); a NIC without one, or a node whose agent sends
none, has no port evidence.

Why: timing alone cannot say which end of a slow transfer is at fault. A pipeline pair whose two NICs carry
nothing else across the fabric (their ring neighbours on the same node, over NVLink) slows alike for a bad link at
either end, and the two links tie however many transfers are fetched (probe.py). A link that degrades shows it on
its own port: bit errors that the link layer retries (symbol errors, link error recoveries, receive errors), a
link that went down and up (link_downed), or a port that trained at a lower rate (width or speed) than it had.

Degraded port (port_evidence): over [onset, last] (the samples at or before the onset and at or after the last
step, so a short episode between two 2 s samples is covered: causes.counter_rise), its error counters rose by
>= errors_per_s per second in all and >= error_rise x their rate over the baseline before the onset
(baseline_seconds); or it went
down (ib_port_up 0 at a sample in the episode); or its rate fell below its own rate before, or below the topology's
speed_gbps for the NIC. A counter that fell is taken as reset (its new value is the rise). A counter that stands at
its field's maximum (ib_port_counters_saturated) cannot rise: the evidence says so, and it is not degraded by it.
Evidence per NIC: port, errors (rise per counter), errors_per_s, baseline_errors_per_s, rate_gbps (before/during),
down, saturated, degraded (bool) and why (words).
Cost: one metric read per NIC asked about (its node's ib_port_* series of its port, baseline + episode).
Not verified on hardware: no InfiniBand on the machines this was built on. The agent's reader is tested on a
recorded sysfs tree; this module on the simulator's model of a degrading link (bench/sim/agentview.py `port`).
"""

from __future__ import annotations

from steplens.collector.analysis.causes import counter_rise

ERRORS = ("ib_port_symbol_errors_total", "ib_port_link_error_recoveries_total", "ib_port_link_downed_total",
          "ib_port_receive_errors_total")
GAUGES = ("ib_port_up", "ib_port_rate_gbps", "ib_port_counters_saturated")
BASELINE_SECONDS = 60.0


def port_evidence(reader, nic, onset_ns: int, last_ns: int, errors_per_s: float = 0.1,
                  error_rise: float = 2.0) -> dict | None:
    """The port evidence of one topology NIC (collector.topology.Nic) over [onset_ns, last_ns]; None where the
    NIC names no port or its node sent no figures for it."""
    if not getattr(nic, "port", "") or not hasattr(reader, "metric_points"):
        return None
    b0 = max(0, onset_ns - int(BASELINE_SECONDS * 1e9))
    try:
        series = reader.metric_points(nic.node, list(ERRORS + GAUGES), [nic.port], b0, last_ns + int(10e9))
    except Exception:   # a reader that cannot read metrics: no evidence, the detector's word stands
        return None
    if not series:
        return None
    ev: dict = {"port": nic.port}
    errs, during_s, base, base_s = {}, 0.0, 0.0, 0.0
    for name in ERRORS:
        pts = series.get((name, nic.port))
        if not pts:
            continue
        got = counter_rise(pts, onset_ns, last_ns)
        if got:
            errs[name.removeprefix("ib_port_").removesuffix("_total")] = int(got[0])
            during_s = max(during_s, got[1])
        before = counter_rise([p for p in pts if p[0] <= onset_ns], b0, onset_ns)   # none from the episode
        if before:
            base += before[0]
            base_s = max(base_s, before[1])
    total = sum(errs.values())
    rate = total / during_s if during_s else 0.0
    base_rate = base / base_s if base_s else 0.0
    why = []
    if errs:
        ev.update(errors=errs, errors_per_s=round(rate, 3), baseline_errors_per_s=round(base_rate, 3))
        if rate >= errors_per_s and rate >= error_rise * base_rate:
            named = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in errs.items() if v)
            why.append(f"errors {rate:.3g}/s ({named}; {base_rate:.2g}/s before)")
    up = series.get(("ib_port_up", nic.port), [])
    if any(v == 0 and onset_ns <= t <= last_ns + int(10e9) for t, v in up):
        ev["down"] = True
        why.append("the port went down")
    rates = series.get(("ib_port_rate_gbps", nic.port), [])
    if rates:
        before = [v for t, v in rates if t < onset_ns]
        during = [v for t, v in rates if onset_ns <= t <= last_ns + int(10e9)] or [rates[-1][1]]
        now = min(during)
        ev["rate_gbps"] = {"before": max(before) if before else None, "during": now}
        if before and now < 0.95 * max(before):
            why.append(f"trained at {now:g} Gb/s, {max(before):g} before")
        elif nic.speed_gbps and now < 0.95 * nic.speed_gbps:
            why.append(f"trained at {now:g} Gb/s, the topology says {nic.speed_gbps:g}")
    sat = series.get(("ib_port_counters_saturated", nic.port), [])
    if sat and sat[-1][1] > 0:
        ev["saturated"] = int(sat[-1][1])
    ev["degraded"] = bool(why)
    if why:
        ev["why"] = "; ".join(why)
    return ev


def break_tie(reader, topo, sus: list, onset_ns: int, last_ns: int, errors_per_s: float = 0.1,
              error_rise: float = 2.0, max_nics: int = 8) -> list:
    """The suspects with port evidence on the NIC links tied at the top (score within 1e-9 of the best; at most
    max_nics of them read): each gets evidence `port`; where some have a degraded port and another tied one has
    port figures and no degradation, the degraded ones lead (score x 1.05: ahead of the rest of the tie, still
    under anything that was above it, which nothing was). Nothing changes without a topology or port figures."""
    if not sus or topo is None:
        return sus
    best = max(s.score for s in sus)
    tied = [i for i, s in enumerate(sus) if s.score >= best - 1e-9 and s.kind in ("link", "nic") and s.id in topo.nics]
    if not tied:
        return sus
    from dataclasses import replace
    out = list(sus)
    seen: dict[int, dict] = {}
    for i in tied[:max_nics]:
        ev = port_evidence(reader, topo.nics[sus[i].id], onset_ns, last_ns, errors_per_s, error_rise)
        if ev is not None:
            seen[i] = ev
            out[i] = replace(sus[i], evidence={**sus[i].evidence, "port": ev})
    bad = [i for i, ev in seen.items() if ev["degraded"]]
    if bad and len(bad) < len(seen):
        for i in bad:
            out[i] = replace(out[i], score=out[i].score * 1.05)
    return out
