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

Congested leaf or slow NIC link (leaf_congestion, promote_leaf): timing cannot always tell a few slow links under
one leaf from the leaf itself (a leaf 1.06x congested slows the rings through it by a few % under a few % of
jitter, and the rings that flag first implicate their own NIC links). The ports can: a port that has data and no
credit from the switch counts PortXmitWait ticks (ib_port_transmit_wait_ticks_total), so a congested leaf makes
every NIC under it wait on all of its sends, the NICs elsewhere only on the share of their sends that cross that
leaf, and a slow NIC link only the NICs that send to it. Per NIC, the wait per byte sent (the transmit-bytes
counter over the same samples: a NIC whose traffic changes is not taken for one that waits) over the episode
against the baseline before it; the leaf is congested when >= wait_share of the job's NICs under it that sent
anything waited >= wait_rise x their own wait per byte before, and their rise in wait per byte (the median weighted
by bytes sent: the NICs that carry most weigh most, a burst on one does not decide) is >= wait_contrast x that of
the job's NICs elsewhere (up to max_nodes of their nodes, in the order of their ids; a NIC elsewhere whose sends
all cross the leaf waits like one under it, the weighted medians tell them apart by the traffic that stays off the
leaf). A counter standing at its 32-bit maximum stopped counting (IBA 16.1.3.5): that NIC is left out. The top
suspect of a detector, a NIC link under a congested leaf whose own port shows no degradation, gives way to the leaf
(score x 1.05); of leaves tied at the top (a pipeline pair from one congested leaf into another slows alike for
both), the congested ones lead, and of several the one whose NICs' wait rose most by wait_contrast (the NICs that
send into a congested leaf wait for it too, less than its own); evidence `xmit_wait` on each leaf weighed.
Not verified on hardware: no InfiniBand on the machines this was built on. The agent's reader is tested on a
recorded sysfs tree; this module on the simulator's model of a degrading link and of the transmit wait
(bench/sim/agentview.py `port`): how a real fabric's waits spread (a congestion tree under lossless flow control
spreads some to flows that share the switch's buffers) is not in that model.
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


WAIT, SENT = "ib_port_transmit_wait_ticks_total", "ib_port_transmit_bytes_total"
WAIT_MAX = (1 << 32) - 1   # PortXmitWait's 32-bit field: a counter there stopped counting


def transmit_wait(reader, nics: list, onset_ns: int, last_ns: int) -> dict[str, tuple[float, float, float, float]]:
    """{NIC id: (wait ticks, bytes sent) before the onset (baseline) + (wait ticks, bytes sent) over [onset, last]}
    of the NICs that sent in both, whose topology entry names a port with figures and whose wait counter did not
    stand at its maximum."""
    if not hasattr(reader, "metric_points"):
        return {}
    b0 = max(0, onset_ns - int(BASELINE_SECONDS * 1e9))
    by_node: dict[str, list] = {}
    for nic in nics:
        if getattr(nic, "port", ""):
            by_node.setdefault(nic.node, []).append(nic)
    out = {}
    for node, mine in sorted(by_node.items()):
        try:
            series = reader.metric_points(node, [WAIT, SENT], [n.port for n in mine], b0, last_ns + int(10e9))
        except Exception:   # a reader that cannot read metrics: no evidence
            return out
        for nic in mine:
            w, b = series.get((WAIT, nic.port)), series.get((SENT, nic.port))
            if not w or not b or any(v >= WAIT_MAX for _, v in w):
                continue
            before = _sums([p for p in w if p[0] <= onset_ns], [p for p in b if p[0] <= onset_ns], b0, onset_ns)
            during = _sums(w, b, onset_ns, last_ns)   # the baseline's samples end at the onset: none shared
            if before is not None and during is not None:
                out[nic.id] = before + during
    return out


def _sums(wait: list, sent: list, a: int, b: int) -> tuple[float, float] | None:
    rw, rb = counter_rise(wait, a, b), counter_rise(sent, a, b)
    return (rw[0], rb[0]) if rw and rb and rb[0] > 0 else None


def leaf_congestion(reader, topo, leaf: str, job_nics, onset_ns: int, last_ns: int, wait_rise: float = 1.5,
                    wait_share: float = 0.6, wait_contrast: float = 2.0, max_nodes: int = 32) -> dict | None:
    """The transmit-wait evidence that `leaf` was congested over [onset, last] (module docstring), from the job's
    NICs (ids) under it against those elsewhere; None where fewer than 2 NICs under it have figures."""
    if topo is None or leaf not in topo.switches:
        return None
    nics = [topo.nics[n] for n in sorted(set(job_nics)) if n in topo.nics]
    inside = [n for n in nics if n.switch == leaf]
    if len(inside) < 2:
        return None
    outside, nodes = [], set()
    for n in sorted((n for n in nics if n.switch != leaf), key=lambda n: (n.switch, n.node, n.id)):
        if n.node in nodes or len(nodes) < max_nodes:
            nodes.add(n.node)
            outside.append(n)
    got_in = transmit_wait(reader, inside, onset_ns, last_ns)
    if len(got_in) < 2:
        return None
    got_out = transmit_wait(reader, outside, onset_ns, last_ns)
    rose = sum(1 for wb, bb, wd, bd in got_in.values() if wd > 0 and wd / bd >= wait_rise * wb / bb)
    ex_in = _rise(got_in.values())
    ex_out = _rise(got_out.values()) if got_out else None
    share = rose / len(got_in)
    congested = share >= wait_share and ex_in > 0 and (ex_out is None or ex_in >= wait_contrast * ex_out)
    ev = {"leaf": leaf, "nics": len(got_in), "waited_more": rose, "share": round(share, 3),
          "wait_per_byte_rise": _sig(ex_in), "outside_nics": len(got_out),
          "outside_wait_per_byte_rise": _sig(ex_out) if ex_out is not None else None, "congested": congested}
    if congested:
        more = (f", {ex_in / ex_out:.1f}x the rise of {len(got_out)} NIC(s) elsewhere" if ex_out else
                f", none elsewhere ({len(got_out)} NIC(s))" if got_out else "")
        ev["why"] = f"{rose} of {len(got_in)} NICs under it wait >= {wait_rise:g}x longer per byte sent{more}"
    return ev


def promote_leaf(reader, topo, sus: list, job_nics, onset_ns: int, last_ns: int, wait_rise: float = 1.5,
                 wait_share: float = 0.6, wait_contrast: float = 2.0, max_leaves: int = 4,
                 early_ns: int = 0) -> list:
    """The suspects with the leaves at the top weighed by transmit wait (module docstring). Top suspect a NIC link
    (or several tied, a ring's): their leaves (up to max_leaves) over [onset, last]; a congested one leads (score
    x 1.05, added where the detector had not listed it) unless the top NIC's own port is degraded. Leaves tied at
    the top (a pipeline pair from one congested leaf into another: both slow it alike): over [onset, early_ns]
    where given (the cause was there when the slowing began, not a leaf that joined later), a congested one leads
    when another has figures and is not. Of several congested leaves only one whose NICs' wait rose >=
    wait_contrast x every other's leads (the NICs under a leaf that send into a congested one wait for it, less
    than its own NICs do). The leaves weighed get evidence `xmit_wait` where there are figures."""
    if not sus or topo is None:
        return sus
    from dataclasses import replace

    from steplens.collector.analysis.findings import Suspect

    def is_leaf(s) -> bool:
        return s.kind == "switch" and s.id in topo.switches and topo.switches[s.id].tier == "leaf"
    out = sorted(sus, key=lambda s: (-s.score, s.kind, s.id))
    top = out[0]
    tied = [s for s in out if s.score >= top.score - 1e-9]
    if top.kind in ("link", "nic") and top.id in topo.nics:
        leaves = list(dict.fromkeys(topo.nics[s.id].switch for s in tied if s.kind in ("link", "nic")
                                    and s.id in topo.nics))[:max_leaves]
        a, b = onset_ns, last_ns
    elif is_leaf(top):
        leaves = [s.id for s in tied if is_leaf(s)][:max_leaves]
        a, b = onset_ns, early_ns or last_ns
    else:
        return out
    seen = {}
    for leaf in leaves:
        ev = leaf_congestion(reader, topo, leaf, job_nics, a, b, wait_rise, wait_share, wait_contrast)
        if ev is not None:
            seen[leaf] = ev
    hot = sorted((x for x, ev in seen.items() if ev["congested"]), key=lambda x: -seen[x]["wait_per_byte_rise"])
    if len(hot) >= 2:
        lead = seen[hot[0]]["wait_per_byte_rise"]
        hot = hot[:1] if lead >= wait_contrast * seen[hot[1]]["wait_per_byte_rise"] else []
    win = hot[0] if hot else None
    if is_leaf(top) and len(seen) < 2 or top.evidence.get("port", {}).get("degraded"):
        win = None   # a lone leaf on top has nothing to be weighed against; a degraded NIC port decides
    if win is not None and not any(s.kind == "switch" and s.id == win for s in out):
        out.append(Suspect("switch", win, top.score, "network", {}))
    for k, s in enumerate(out):
        if s.kind == "switch" and s.id in seen:
            score = max(s.score, round(top.score * 1.05, 4)) if s.id == win else s.score
            out[k] = replace(s, score=score, evidence={**s.evidence, "xmit_wait": seen[s.id]})
    out.sort(key=lambda s: (-s.score, s.kind, s.id))
    return out


def _rise(rows) -> float:
    """The NICs' rise in wait per byte sent, their median weighted by the bytes each sent over the episode (the
    NICs that carry most weigh most; an incast burst on one NIC in the baseline or the episode does not move it),
    >= 0."""
    pts = sorted((wd / bd - wb / bb, bd) for wb, bb, wd, bd in rows)
    half, acc = sum(w for _, w in pts) / 2, 0.0
    for r, w in pts:
        acc += w
        if acc >= half:
            return max(0.0, r)
    return 0.0


def _sig(x: float) -> float:
    return float(f"{x:.3g}")
