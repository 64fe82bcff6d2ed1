"""Black-box diagnosis of a job seen only through its network flows (LLMPrism's k-σ views, ALGORITHMS.md §1.5).

Reads what flowjobs.analyse made of the flow window (the job's pairs typed DP/PP/EP, its DP groups, every
endpoint's step timeline) and the topology (NIC of an address); nothing from the job's processes. Pure:
`diagnose(snapshot, job, nic_of, cfg) -> list[Finding]`; `detect(reader, window, cfg)` is the registered
detector, which takes the snapshot the engine keeps (`reader.flow_snapshot()`) and returns nothing for a job the
flows do not show.

The rule is LLMPrism's l > mean + kσ with its erratum fixed (σ is the standard deviation, not the mean
deviation, which is identically 0), one-sided in the bad direction, and robust where peers are few (median and
1.4826 x MAD, floored so that a noiseless simulation does not divide by zero):
  1. cross-step: the job's step time (median over its endpoints' reconstructed steps) against its own trailing
     steps; a run of flagged steps reaching the window's end is a `slowdown` from the first of them;
  2. per flow, its bandwidth (bytes / duration) over the expected: the median of its own directed pair's flows
     of its size (log2 bucket) before the onset where there are 10, else of its kind's (pair type and size), or
     of its peers in the same span where there is no baseline. Scored in the suspect span:
       switch   the upper quartile of the ratios of the flows crossing it (a congested switch slows all of them);
       endpoint the median ratio of its best peer's flows (a slow NIC link slows the flows to every peer; each
                of those peers has a healthy peer elsewhere, so its best stays high: no tie, unless the two
                have no other peer: then the finding says they tie), and where it sends to (receives from)
                two peers or more, the same per direction (a link slow one way), the worst of these;
     a score is an outlier when it is at least `min_drop` below 1 and, with >= `few_peers` peers, `k` robust σ
     below their median (with 4 to few_peers - 1, whose MAD is no measure of spread: at most few_peers_ratio x
     the others' median); endpoints whose flows all cross an outlier switch are explained by it;
  3. cross-group: each DP group's communication time per step (its DP flows' last end minus first start,
     per step segment) against the other groups' in the same span (high side).
A finding: `slowdown` when the step time rose, else `network` (a switch, link or DP group measurably slower
than its peers while the step time does not show it yet); severity = the span's step time over the baseline;
suspects best first: outlier switches, then the NIC links of outlier endpoints (id from the topology, else the
address), then their nodes; evidence: the views' figures, the slow DP groups, where the flows came from.
Cost: numpy over the job's flows in the window (a 1,024-GPU job's minute: ~0.2 s).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from steplens.collector.analysis.base import ConfigError, DetectorConfig, DetectorSpec, Window
from steplens.collector.analysis.findings import Finding, Suspect
from steplens.collector.analysis.flowjobs import topology_maps

MAD_SIGMA = 1.4826
TYPES = {"dp": 0, "pp": 1, "ep": 2}


@dataclass
class FlowsConfig(DetectorConfig):
    window_seconds: float = 60.0         # LLMPrism's one-minute window
    k: float = 3.0                       # the k of the k-σ rule
    min_baseline_steps: int = 6          # steps before a step can be judged
    baseline_steps: int = 50             # trailing steps in the baseline
    min_sigma_fraction: float = 0.01     # σ floor, as a share of the baseline mean (jitter-free data)
    min_step_ratio: float = 1.05         # a flagged step is also at least this much above the baseline
    recent_steps: int = 3                # a slowdown must reach within this many steps of the window's end
    min_drop: float = 0.15               # a switch or endpoint score at least this far below 1
    min_group_ratio: float = 1.15        # a DP group at least this much slower than the groups' median
    few_peers: int = 8                   # with 4..few_peers-1 scores, an outlier is judged by ratio, not robust z:
    few_peers_ratio: float = 0.7         # at most this times the median of the others

    def validate(self) -> None:
        super().validate()
        if not 0.5 <= self.k <= 20:
            raise ConfigError(f"k must be within 0.5..20, got {self.k}")
        if not 2 <= self.min_baseline_steps <= self.baseline_steps <= 10_000:
            raise ConfigError("need 2 <= min_baseline_steps <= baseline_steps <= 10000")
        if not 0 < self.min_sigma_fraction < 0.5 or not 1.0 <= self.min_step_ratio <= 10:
            raise ConfigError("min_sigma_fraction within (0, 0.5), min_step_ratio within [1, 10]")
        if not 1 <= self.recent_steps <= 1000:
            raise ConfigError("recent_steps must be within 1..1000")
        if not 0 < self.min_drop < 1 or not 1 < self.min_group_ratio <= 10:
            raise ConfigError("min_drop within (0, 1), min_group_ratio within (1, 10]")
        if not 4 <= self.few_peers <= 1000 or not 0 < self.few_peers_ratio < 1:
            raise ConfigError("few_peers within 4..1000, few_peers_ratio within (0, 1)")


def step_series(job) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """Per step number: (numbers, median duration ns, median start ns, median end ns) over the endpoints."""
    per: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for steps in job.timeline.values():
        for k, a, b in steps:
            per[k].append((a, b))
    ks = sorted(per)
    dur = np.array([float(np.median([b - a for a, b in per[k]])) for k in ks])
    start = np.array([float(np.median([a for a, _ in per[k]])) for k in ks])
    end = np.array([float(np.median([b for _, b in per[k]])) for k in ks])
    return ks, dur, start, end


def flag_steps(x: np.ndarray, cfg: FlowsConfig) -> tuple[list[bool], list[float]]:
    """k-σ per step against the trailing unflagged steps: (flags, the baseline mean at each step, 0 before)."""
    hist: list[float] = []
    flags, base = [], []
    for v in x:
        f, m = False, 0.0
        if len(hist) >= cfg.min_baseline_steps:
            h = np.asarray(hist[-cfg.baseline_steps:])
            m = float(h.mean())
            sd = max(float(h.std()), cfg.min_sigma_fraction * m)
            f = v > m + cfg.k * sd and v >= cfg.min_step_ratio * m
        flags.append(f)
        base.append(m)
        if not f:
            hist.append(float(v))
    return flags, base


def outliers(scores: dict, cfg: FlowsConfig) -> list[tuple[object, float, float]]:
    """(key, score, robust z) of the low outliers among scores (1 = as expected), worst first."""
    if not scores:
        return []
    v = np.asarray(list(scores.values()), dtype=np.float64)
    med = float(np.median(v))
    sd = max(MAD_SIGMA * float(np.median(np.abs(v - med))), 0.02)
    out = []
    few = 4 <= len(v) < cfg.few_peers   # the MAD of a handful is no measure of their spread
    for key, s in scores.items():
        z = (med - s) / sd
        if few:
            far = s <= cfg.few_peers_ratio * float(np.median([o for k2, o in scores.items() if k2 != key]))
        else:
            far = len(v) < 4 or z >= cfg.k
        if s <= 1.0 - cfg.min_drop and far:
            out.append((key, float(s), float(z)))
    return sorted(out, key=lambda t: t[1])


def _upper_quartile(groups: dict, r: np.ndarray) -> dict:
    return {k: float(np.percentile(r[np.asarray(ix)], 75)) for k, ix in groups.items() if len(ix) >= 3}


def diagnose(snap, job, nic_of: dict[str, str], node_of: dict[str, str], cfg: FlowsConfig) -> list[Finding]:
    fw = snap.flows
    ks, dur, st, en = step_series(job)
    n = len(ks)
    idx = job.flow_index
    if not len(idx):
        return []
    timed = n >= cfg.min_baseline_steps + 1
    slow, onset_i, baseline_mean, ratio = False, -1, 0.0, 1.0
    if timed:
        flags, base = flag_steps(dur, cfg)
        last = max((i for i, f in enumerate(flags) if f), default=-1)
        if last >= n - cfg.recent_steps:
            onset_i = last
            while onset_i > 0 and (flags[onset_i - 1] or (onset_i > 1 and flags[onset_i - 2])):
                onset_i -= 1
        slow = onset_i >= 0
        span_lo = int(st[onset_i]) if slow else int(st[max(0, n - cfg.recent_steps)])
        baseline_mean = base[onset_i] if slow else float(np.mean(dur[:-cfg.recent_steps]))
        ratio = float(np.median(dur[onset_i:]) / baseline_mean) if slow and baseline_mean else \
            float(np.median(dur[-cfg.recent_steps:]) / max(1.0, float(np.mean(dur[:-cfg.recent_steps]))))
        group_lo = min(span_lo, int(st[max(0, n - 6)]))   # >= 4 whole steps per group
    else:
        # no step ends on the wire (the job's DP rings stay inside its nodes): no step-time view; the flows of
        # the window's last third are judged against the two before
        first, last_ns = int(fw.start[idx].min()), int(fw.end[idx].max())
        span_lo = group_lo = last_ns - (last_ns - first) // 3

    # per-flow bandwidth over the expected for its kind, payload flows only (a TCP capture's ACK bursts and
    # control messages take no time to send: their "bandwidth" says nothing)
    idx = job.payload_index if len(job.payload_index) else idx
    s_ep, d_ep = fw.src[idx], fw.dst[idx]
    bw = fw.nbytes[idx] / np.maximum(1, fw.end[idx] - fw.start[idx])
    ips = fw.ips
    kind = np.array([TYPES.get(job.pairs.get((ips[a], ips[b]) if ips[a] < ips[b] else (ips[b], ips[a]), ""), 3)
                     for a, b in zip(s_ep.tolist(), d_ep.tolist())], dtype=np.int64)
    size = np.floor(np.log2(np.maximum(1, fw.nbytes[idx]))).astype(np.int64)
    cls = kind * 64 + size
    in_span = fw.start[idx] >= span_lo
    before = ~in_span
    # the expected bandwidth of a flow: its own directed pair's flows of its size before the onset where they are
    # enough (the two directions of a pair need not move alike: a pipeline's forward bursts hold compute between
    # messages, its backward ones may not), else its kind's (pair type, size), else its peers' in the span
    expected = np.ones(len(idx))
    for c in np.unique(cls):
        m = cls == c
        ref = bw[m & before]
        if len(ref) < 10:
            ref = bw[m & in_span]
        expected[m] = float(np.median(ref)) if len(ref) else 1.0
    n_ep = max(len(ips), 1)
    dkey = (s_ep.astype(np.int64) * n_ep + d_ep.astype(np.int64)) * 64 + size
    bkeys = dkey[before]
    if len(bkeys):
        order = np.argsort(bkeys, kind="stable")
        ks_, starts, counts = np.unique(bkeys[order], return_index=True, return_counts=True)
        bw_before = bw[before][order]
        keep = counts >= 10
        if keep.any():
            own_keys = ks_[keep]   # sorted (np.unique)
            own_med = np.array([np.median(bw_before[a:a + c]) for a, c in zip(starts[keep], counts[keep])])
            span_at = np.flatnonzero(in_span)
            pos = np.minimum(np.searchsorted(own_keys, dkey[span_at]), len(own_keys) - 1)
            hit = own_keys[pos] == dkey[span_at]
            expected[span_at[hit]] = own_med[pos[hit]]
    r = bw / np.maximum(expected, 1e-12)
    span_idx = np.flatnonzero(in_span)
    r_span = r[span_idx]
    ep_groups: dict[int, list[int]] = defaultdict(list)
    sw_groups: dict[str, list[int]] = defaultdict(list)
    pair_groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for j, i in enumerate(span_idx.tolist()):
        a, b = int(s_ep[i]), int(d_ep[i])
        ep_groups[a].append(j)
        ep_groups[b].append(j)
        pair_groups[(a, b)].append(j)   # directed: a sends, b receives
        for w in fw.switches[int(idx[i])]:
            sw_groups[w].append(j)
    sw_out = outliers(_upper_quartile(sw_groups, r_span), cfg)
    # an endpoint's score: the median ratio of its flows with its best peer (a slow NIC link slows the flows to
    # every peer of its endpoint, while each of those peers still has a healthy peer elsewhere); and, where it
    # sends to (receives from) two peers or more, the same per direction of its link (a link slow one way slows
    # only what crosses it that way, and a pair's other direction would hide it). Its score is the worst of these.
    undirected: dict[tuple[int, int], list[int]] = defaultdict(list)
    for (a, b), js in pair_groups.items():
        undirected[(a, b) if a < b else (b, a)].extend(js)
    ep_scores: dict[int, float] = {}
    for (a, b), js in undirected.items():
        if len(js) >= 2:
            m = float(np.median(r_span[np.asarray(js)]))
            for e in (a, b):
                ep_scores[e] = max(ep_scores.get(e, 0.0), m)
    for end in (0, 1):   # 0: the flows an endpoint sends, 1: those it receives
        best: dict[int, list[float]] = defaultdict(list)
        for ab, js in pair_groups.items():
            if len(js) >= 2:
                best[ab[end]].append(float(np.median(r_span[np.asarray(js)])))
        for e, ms in best.items():
            if len(ms) >= 2 and e in ep_scores:
                ep_scores[e] = min(ep_scores[e], max(ms))
    ep_out = outliers(ep_scores, cfg)
    explained = set()   # endpoints whose flows (nearly) all cross an outlier switch: its victims, not causes
    for w, _, _ in sw_out:
        crossing = set(sw_groups[w])
        for e, mine in ep_groups.items():
            if sum(j in crossing for j in mine) >= 0.9 * len(mine):
                explained.add(e)
    n_explained = sum(1 for e, _, _ in ep_out if e in explained)
    ep_out = [t for t in ep_out if t[0] not in explained]

    groups = _group_view(fw, job, group_lo, cfg)
    if not (slow or sw_out or ep_out or groups):
        return []
    end_ns = int(en[-1]) if timed else int(fw.end[idx].max())
    suspects: list[Suspect] = []
    for w, s, z in sw_out:
        suspects.append(Suspect("switch", str(w), round(1.0 - s, 4), "network",
                                {"bandwidth_ratio": round(s, 4), "robust_z": round(z, 2),
                                 "flows": len(sw_groups[w])}))
    nodes = []
    for e, s, z in ep_out:
        ip = ips[e]
        nic = nic_of.get(ip)
        ev = {"address": ip, "bandwidth_ratio": round(s, 4), "robust_z": round(z, 2), "flows": len(ep_groups[e])}
        tied = _tied(e, ep_out, ep_groups)
        if tied is not None:   # every flow of both runs between the two: the wire cannot tell their links apart
            ev["tied_with"] = nic_of.get(ips[tied], ips[tied])
        suspects.append(Suspect("link" if nic else "nic", nic or ip, round(1.0 - s, 4), "network", ev))
        if node_of.get(ip) and node_of[ip] not in nodes:
            nodes.append(node_of[ip])
    for g in groups:
        for ip in g["slowest"]:
            if fw.ips.index(ip) in explained:
                continue
            nic = nic_of.get(ip)
            sid = nic or ip
            if not any(x.id == sid for x in suspects):
                e = ips.index(ip)
                suspects.append(Suspect("link" if nic else "nic", sid, round(1.0 - ep_scores.get(e, 1.0), 4),
                                        "network", {"address": ip, "dp_group_ratio": g["ratio"]}))
    for node in nodes:
        suspects.append(Suspect("node", node, 0.5, "network", {}))
    onset_ns = int(st[onset_i]) if slow else span_lo
    what = []
    if sw_out:
        what.append(f"switch {sw_out[0][0]} carries the job's flows at {sw_out[0][1]:.2f}x their usual bandwidth")
    if ep_out:
        e, s, _ = ep_out[0]
        tied = _tied(e, ep_out, ep_groups)
        what.append(f"{nic_of.get(ips[e], ips[e])} ({ips[e]}) moves its flows at {s:.2f}x" +
                    (f" (or {nic_of.get(ips[tied], ips[tied])}: every flow of either runs between the two, so the "
                     "flows cannot tell which link is slow)" if tied is not None else ""))
    if groups:
        what.append(f"{len(groups)} DP group(s) communicate {groups[0]['ratio']:.2f}x longer than the others")
    head = (f"step time {ratio:.2f}x its baseline since step {ks[onset_i]} (from network flows)" if slow else
            "the job's network flows degraded while its step time holds" if timed else
            "the job's network flows degraded (no step ends on the wire: its DP traffic stays inside its nodes)")
    summary = head + (": " + "; ".join(what) if what else ": no switch, link or DP group stands out")
    evidence = {"source": "flows", "flow_sources": snap.sources, "steps_judged": n,
                "step_seconds": round(float(np.median(dur[onset_i:] if slow else dur[-cfg.recent_steps:])) / 1e9, 6)
                if timed else None,
                "baseline_step_seconds": round(baseline_mean / 1e9, 6) if baseline_mean else None,
                "switches": [{"id": w, "ratio": round(s, 4)} for w, s, _ in sw_out][:8],
                "endpoints": [{"address": ips[e], "ratio": round(s, 4)} for e, s, _ in ep_out][:16],
                "explained_by_switch": n_explained, "dp_groups": groups[:4],
                "flows_in_span": int(len(span_idx)), "pairs": len(job.pairs)}
    return [Finding("slowdown" if slow else "network", onset_ns, end_ns, max(1.0, round(ratio, 4)),
                    summary, tuple(suspects), evidence)]


def _tied(e: int, ep_out: list, ep_groups: dict) -> int | None:
    """The other outlier endpoint whose span flows are exactly e's (a pipeline pair with no other traffic)."""
    mine = set(ep_groups[e])
    for o, _, _ in ep_out:
        if o != e and set(ep_groups[o]) == mine:
            return o
    return None


def _group_view(fw, job, span_lo: int, cfg: FlowsConfig) -> list[dict]:
    """DP groups whose per-step communication time in the span is min_group_ratio x and k robust σ above the
    groups' median; each with its members slowest first (by their flows' bandwidth). A group's all-reduce flows
    (flowjobs: an EP ring hop's all-to-all left out) are assigned to the step ends of the timeline of its member
    with the most steps (a flow belongs to the end nearest its own end: the ring's hops end together, but one
    may start after another member's last flow ended), and a step's communication time is its last flow end
    minus its first start (the first end's step left out: the span may cut it)."""
    if len(job.dp_groups) < 3:
        return []
    member = {ip: g for g, ips in enumerate(job.dp_groups) for ip in ips}
    ips = fw.ips
    per_group: dict[int, list[int]] = defaultdict(list)
    for i in job.dp_flows.tolist():
        if fw.start[i] >= span_lo:
            per_group[member[ips[int(fw.src[i])]]].append(i)
    times = {}
    for g, fl in per_group.items():
        ref = max((job.timeline.get(ip, []) for ip in job.dp_groups[g]), key=len)
        if len(ref) < 2:
            continue
        # every step end the member's timeline holds (a step left out there, off the job's alignment, still has
        # its end as the next step's start)
        ends = np.unique(np.asarray([t for _, a, b in ref for t in (a, b)], dtype=np.int64))
        fl = np.asarray(fl)
        fe = fw.end[fl]
        pos = np.clip(np.searchsorted(ends, fe), 1, len(ends) - 1)
        k = np.where(np.abs(ends[pos - 1] - fe) <= np.abs(ends[pos] - fe), pos - 1, pos)   # the nearest step end
        d = []
        for step in range(1, len(ends)):   # the first end's step may be cut by the span
            m = fl[k == step]
            if len(m):
                d.append(float(fw.end[m].max() - fw.start[m].min()))
        if d:
            times[g] = float(np.median(d))
    if len(times) < 3:
        return []
    v = np.asarray(list(times.values()))
    med = float(np.median(v))
    sd = max(MAD_SIGMA * float(np.median(np.abs(v - med))), cfg.min_sigma_fraction * med)
    out = []
    for g, t in times.items():
        if t >= cfg.min_group_ratio * med and t >= med + cfg.k * sd:
            out.append({"members": job.dp_groups[g], "comm_seconds": round(t / 1e9, 6),
                        "peers_median_seconds": round(med / 1e9, 6), "ratio": round(t / med, 4),
                        "slowest": _slowest(fw, per_group[g], job.dp_groups[g])})
    return sorted(out, key=lambda d: -d["ratio"])


def _slowest(fw, flows: list[int], members: list[str]) -> list[str]:
    """The group's members whose DP flows in the span are slowest (upper quartile of bandwidth), 2 at most."""
    bw: dict[str, list[float]] = defaultdict(list)
    for i in flows:
        v = fw.nbytes[i] / max(1, fw.end[i] - fw.start[i])
        bw[fw.ips[int(fw.src[i])]].append(v)
        bw[fw.ips[int(fw.dst[i])]].append(v)
    q = {ip: float(np.percentile(v, 75)) for ip, v in bw.items() if ip in members}
    if not q:
        return []
    best = max(q.values())
    return [ip for ip, v in sorted(q.items(), key=lambda t: t[1]) if v < 0.9 * best][:2]


def detect(reader, window: Window, cfg: FlowsConfig) -> list[Finding]:
    get = getattr(reader, "flow_snapshot", None)
    snap = get(window.until_ns) if get else None
    if snap is None:
        return []
    job = snap.job(window.job_key) or snap.job(snap.matched.get(window.job_key, ""))
    if job is None:
        return []
    node_of, nic_of = topology_maps(reader.topology())
    return diagnose(snap, job, nic_of, node_of, cfg)


SPEC = DetectorSpec(
    name="flows",
    description="black-box diagnosis from network flows alone (LLMPrism): k-σ across steps, switches, links and "
                "DP groups of a job recognized from its flows",
    kinds=("slowdown", "network"),
    config_class=FlowsConfig,
    detect=detect,
)

__all__ = ["SPEC", "FlowsConfig", "diagnose", "detect", "flag_steps", "outliers", "step_series"]
