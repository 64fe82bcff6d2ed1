"""Jobs, their parallelism and each rank's step timeline, from network flows alone (LLMPrism, ALGORITHMS.md §1).

Reads one window of flows (the store's `flows` table: eBPF bursts from the agents' netflows source, flows
imported from switches, or both) and the topology file (NIC IP -> node); nothing from the jobs themselves.
`analyse(flows, topology, config) -> FlowSnapshot`, pure: the same flows give the same snapshot.

  1. Job recognition (§1.2): union-find over the endpoints of every flow gives the cross-machine clusters; a
     job with tensor parallelism inside its nodes shows as one cluster per TP index over the same servers, so
     clusters whose server sets are identical are merged (bucketed by the frozen set: O(clusters), not the
     paper's pairwise Jaccard loop). Endpoints are IP addresses; an address the topology does not know is a
     server of its own. Loopback and a flow's own host are never endpoints.
  2. Parallelism of every endpoint pair (§1.3), on its payload flows (control messages and ACK bursts of a
     TCP capture dropped: payload()). Beyond the paper, the direction of the traffic first: one way is a DP
     ring hop; both ways at once is an exchange (an all-to-all, or the all-reduce of a DP group of two); both
     ways one after the other is judged by the paper's rule: the pair's flows are split into steps (bocd.py:
     GapSplit by default, Bocd as the reference), per step the distinct flow sizes are counted (sizes within
     1 % are one size; a burst that merged k messages counts as the message), and the mode over steps
     decides: several sizes -> DP (a gradient all-reduce in buckets), one size -> PP. An exchange with several
     sizes is DP; with one size it is EP where both ends exchange with others too (an EP group of >= 3), else
     the all-reduce of two. Then DP is transitive: a PP pair whose ends lie in one DP component is promoted to
     DP (the refinement; EP pairs sit inside DP groups
     by construction and are left alone). TP pairs are inferred, never seen: GPUs of one node of the job whose
     pipeline sends start together (a TP group moves in lockstep; DP replicas drift apart); in a job without
     pipeline sends, the GPUs of a node in different cross-machine clusters, paired in GPU order.
  3. Timeline per endpoint (§1.4): its DP flows sorted by start, cut into steps where its own compute traffic
     (pipeline sends, all-to-alls) comes between two of them, else at the natural break of their intervals;
     step k ends at the latest flow end of segment k and starts where step k-1 ended. Step numbers are
     aligned across the job's endpoints on the endpoint with the most steps.
Cost (measured by bench/eval/flows.py on the 2,880-GPU, 19-job minute): one Python pass over the flows to
intern endpoints, then numpy per pair and per endpoint; the eval prints the seconds.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from steplens.collector.analysis.bocd import SEGMENTERS, segments


@dataclass
class FlowConfig:
    segmenter: str = "gap"               # gap | bocd (bocd.py): how a pair's flows are split into steps
    size_tolerance: float = 0.01         # flow sizes within this relative difference are one size
    ep_sync_ns: int = 50_000             # flows the other way this close in time are "at once" (exchanges, TP)
    ep_sync_fraction: float = 0.8        # ... an all-to-all's size class has this share of exchanges
    exchange_fraction: float = 0.5       # a pair with this share of its bytes sent both ways at once exchanges
    one_way_fraction: float = 0.05       # a pair whose other way carries less than this share is one way
    min_flow_fraction: float = 0.02      # flows under this share of the pair's byte-weighted median are control
    min_pair_flows: int = 3              # pairs with fewer flows in the window are noise (not classified)
    min_pair_share: float = 0.01         # pairs moving less than this share of the job's median pair: control
    min_job_endpoints: int = 2
    ignore_ports: tuple[int, ...] = ()   # flows from or to these TCP ports are not a job's (the collector's own)


@dataclass
class FlowWindow:
    """Flows as columns: start/end ns (cluster time), bytes, endpoint indices into `ips`, switches (tuples)."""

    start: np.ndarray
    end: np.ndarray
    nbytes: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    ips: list[str]
    switches: list[tuple[str, ...]]
    origins: set[str] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.start)

    @classmethod
    def from_rows(cls, rows, ignore_ports=()) -> "FlowWindow":
        """rows: (start_ns, end_ns, src, dst, bytes, switches, origin[, sport, dport]) tuples, switches a tuple
        or a JSON list text; loopback endpoints, flows from a host to itself and flows from or to one of
        ignore_ports (the collector's own: its agents' streams would join every host into one job) are
        dropped."""
        ignore = set(ignore_ports)
        index: dict[str, int] = {}
        ips: list[str] = []
        keep_ip: dict[str, bool] = {}
        st, en, nb, sa, da, sw = [], [], [], [], [], []
        origins: set[str] = set()
        parsed: dict[str, tuple] = {}
        for row in rows:
            s, e, a, b, n, switches, origin = row[:7]
            if a == b or (ignore and len(row) > 8 and (row[7] in ignore or row[8] in ignore)):
                continue
            for ip in (a, b):
                if ip not in keep_ip:
                    try:
                        keep_ip[ip] = not ipaddress.ip_address(ip).is_loopback
                    except ValueError:
                        keep_ip[ip] = False
            if not (keep_ip[a] and keep_ip[b]):
                continue
            ia = index.get(a)
            if ia is None:
                ia = index[a] = len(ips)
                ips.append(a)
            ib = index.get(b)
            if ib is None:
                ib = index[b] = len(ips)
                ips.append(b)
            if isinstance(switches, str):
                got = parsed.get(switches)
                if got is None:
                    try:
                        got = tuple(str(x) for x in json.loads(switches or "[]"))
                    except (ValueError, TypeError):
                        got = ()
                    parsed[switches] = got
                switches = got
            st.append(s)
            en.append(e)
            nb.append(n)
            sa.append(ia)
            da.append(ib)
            sw.append(switches)
            origins.add(origin)
        return cls(np.asarray(st, dtype=np.int64), np.asarray(en, dtype=np.int64), np.asarray(nb, dtype=np.int64),
                   np.asarray(sa, dtype=np.int64), np.asarray(da, dtype=np.int64), ips, sw, origins)


@dataclass
class FlowJob:
    key: str
    endpoints: list[str]                       # IP addresses, sorted
    servers: list[str]                         # node ids (or the address where the topology has none)
    pairs: dict[tuple[str, str], str]          # (a, b) with a < b -> dp | pp | ep | tp
    dp_groups: list[list[str]]                 # connected components of the DP pairs
    flow_index: np.ndarray                     # indices of the job's flows in the window
    timeline: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)  # ip -> (step, start, end)
    dp_flows: np.ndarray = field(default_factory=lambda: np.array([], dtype=np.int64))  # its all-reduce flows
    # the flows whose bytes / duration is a transfer rate: payload flows, and of a PP pair only those of one
    # message (a burst that merged several also holds the compute between them)
    payload_index: np.ndarray = field(default_factory=lambda: np.array([], dtype=np.int64))
    refined: int = 0                           # PP pairs promoted to DP by transitivity
    demoted: int = 0                           # size-only DP pairs between two DP groups, made PP
    clusters: int = 0                          # cross-machine clusters merged into it

    def summary(self) -> dict:
        kinds = Counter(self.pairs.values())
        return {"job_key": self.key, "endpoints": len(self.endpoints), "servers": len(self.servers),
                "pairs": dict(kinds), "dp_groups": len(self.dp_groups), "refined": self.refined,
                "demoted": self.demoted}


@dataclass
class FlowSnapshot:
    since_ns: int
    until_ns: int
    flows: FlowWindow
    jobs: list[FlowJob]
    server_of: dict[str, str]
    sources: list[str]                         # "ebpf" and/or "switch" (imported): what the flows came from
    unattributed: list[str] = field(default_factory=list)  # endpoints in no job (too few flows)
    matched: dict[str, str] = field(default_factory=dict)   # procs job key -> flow job key (FlowView)

    def job(self, key: str) -> FlowJob | None:
        for j in self.jobs:
            if j.key == key:
                return j
        return None


class _UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        p = self.parent
        while p[x] != x:
            p[x] = p[p[x]]
            x = p[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def job_key(servers) -> str:
    """A flow-recognized job's key: stable while it runs on the same servers."""
    return "flows-" + hashlib.sha1("\n".join(sorted(servers)).encode()).hexdigest()[:10]


def distinct_sizes(sizes: np.ndarray, tol: float) -> int:
    """Sizes within tol of each other are one. A segment of >= 40 flows (no step structure found: the whole
    window) counts only sizes that hold >= 5 % of its flows, so a few odd bursts (a retransmission, a burst
    the capture split) do not make a pipeline pair's one size several; per step, the mode over steps does that."""
    if len(sizes) == 0:
        return 0
    v = np.sort(sizes)
    new = np.concatenate(([True], v[1:] > v[:-1] * (1.0 + tol)))
    if len(v) < 40:
        return int(new.sum())
    counts = np.diff(np.concatenate((np.flatnonzero(new), [len(v)])))
    return max(1, int(np.count_nonzero(counts >= 0.05 * len(v))))


def _size_mode(fw: FlowWindow, idx: np.ndarray, cfg: FlowConfig, segmenter, merged: bool = False) -> int:
    """The most common number of distinct flow sizes per step of these flows (idx sorted by start). merged: a
    size within tolerance of k x the pair's smallest size (k <= MAX_MERGED) is that size (a capture that splits
    bursts at an idle gap merges k back-to-back messages of one size into one flow)."""
    if len(idx) == 0:
        return 0
    sizes = fw.nbytes[idx].astype(np.float64)
    if merged:
        base = float(np.percentile(sizes, 5))
        k = np.round(sizes / base)
        unit = sizes / np.maximum(k, 1)
        sizes = np.where((k <= MAX_MERGED) & (np.abs(unit - base) <= MERGED_TOLERANCE * base), base, sizes)
    starts = fw.start[idx]
    segs = segments(starts, segmenter.boundaries(starts))
    counts = _small_segment_counts(sizes, segs, cfg.size_tolerance)
    counts += [distinct_sizes(sizes[lo:hi], cfg.size_tolerance) for lo, hi in segs if hi - lo >= 40]
    return Counter(counts).most_common(1)[0][0] if counts else 1


def _small_segment_counts(sizes: np.ndarray, segs: list[tuple[int, int]], tol: float) -> list[int]:
    """distinct_sizes of every segment under 40 flows, in one vectorized pass (a pipeline pair cut at its
    micro-batches has thousands of them)."""
    if not segs:
        return []
    lens = np.asarray([hi - lo for lo, hi in segs])
    first = segs[0][0]
    seg_all = np.repeat(np.arange(len(segs)), lens)           # segments tile [first, last) in order
    keep = lens[seg_all] < 40
    if not keep.any():
        return []
    v = sizes[first:first + len(seg_all)][keep]
    small_ids = np.flatnonzero(lens < 40)
    seg = np.searchsorted(small_ids, seg_all[keep])            # renumbered 0..len(small) - 1
    small = small_ids
    order = np.lexsort((v, seg))
    v, seg = v[order], seg[order]
    new = np.ones(len(v), dtype=bool)
    new[1:] = (seg[1:] != seg[:-1]) | (v[1:] > v[:-1] * (1.0 + tol))
    return np.bincount(seg, weights=new, minlength=len(small)).astype(int).tolist()


MAX_MERGED = 8
MERGED_TOLERANCE = 0.05   # per message: a slowed TCP link cuts more, smaller packets (more header bytes per message)


def payload(fw: FlowWindow, idx: np.ndarray, cfg: FlowConfig) -> np.ndarray:
    """The pair's flows that carry its traffic: at least min_flow_fraction of its byte-weighted median flow size
    (a TCP capture also holds pure-ACK bursts and the library's small control messages)."""
    sizes = fw.nbytes[idx]
    if len(idx) < 2:
        return idx
    order = np.argsort(sizes)
    cum = np.cumsum(sizes[order])
    wmed = float(sizes[order][np.searchsorted(cum, cum[-1] / 2)])
    return idx[sizes >= cfg.min_flow_fraction * wmed]


def _unit_flows(fw: FlowWindow, idx: np.ndarray, kind: str) -> np.ndarray:
    """Of a PP pair's payload flows, those of one message (within MERGED_TOLERANCE of the pair's smallest
    common size); every flow of other pairs (a bucket or an all-to-all is one transfer)."""
    if kind != "pp" or len(idx) < 2:
        return idx
    sizes = fw.nbytes[idx].astype(np.float64)
    base = float(np.percentile(sizes, 5))
    return idx[np.abs(sizes / base - 1.0) <= MERGED_TOLERANCE]


def classify_pair(fw: FlowWindow, idx: np.ndarray, a: int, cfg: FlowConfig, segmenter) -> str:
    """dp | pp | x for one pair's flows (idx sorted by start), a = the pair's lower endpoint index; x: an
    exchange of one size, EP or an all-reduce of two (analyse decides by the endpoints' exchange partners).
    On the pair's payload flows, the direction of its traffic first, then LLMPrism's sizes:
      one way (the other way carries < one_way_fraction of the bytes: ACKs)  -> dp, a ring hop;
      both ways at once (>= exchange_fraction of the bytes in flows overlapping a flow the other way, give or
      take ep_sync_ns)                                                        -> dp with several sizes per step
                                                                                 (buckets), else x;
      both ways, one after the other                                          -> LLMPrism's rule: several sizes
                                                                                 per step dp, one size pp (a
                                                                                 merged burst of k messages
                                                                                 counts as the message)."""
    return _classify(fw, idx, a, cfg, segmenter)[0]


def _classify(fw: FlowWindow, idx: np.ndarray, a: int, cfg: FlowConfig, segmenter) -> tuple[str, bool, bool]:
    """classify_pair's verdict, whether most of the pair's payload flows are exchanges (it counts as an
    exchange partner of its ends: an EP group's members each have >= 2), and whether the direction of its
    traffic decided (one way, exchanges) rather than its sizes alone."""
    idx = payload(fw, idx, cfg)
    if len(idx) == 0:
        return "pp", False, False
    fwd = fw.src[idx] == a
    w = fw.nbytes[idx].astype(np.float64)
    ab, ba = float(w[fwd].sum()), float(w[~fwd].sum())
    if min(ab, ba) < cfg.one_way_fraction * max(ab, ba):
        return "dp", False, True
    ov = _overlapped(fw, idx, fwd, cfg.ep_sync_ns)
    exchanging = bool(ov.mean() >= cfg.exchange_fraction)
    exch, one_way = _ring_under_all_to_all(fw, idx, fwd, ov, cfg)
    if exch.any() and one_way:   # a DP ring hop inside an EP group
        return "dp", exchanging, True
    if float((w * ov).sum()) >= cfg.exchange_fraction * float(w.sum()):
        return ("dp" if _size_mode(fw, idx, cfg, segmenter) >= 2 else "x"), exchanging, True
    return ("dp" if _size_mode(fw, idx, cfg, segmenter, merged=True) >= 2 else "pp"), exchanging, False


def _overlapped(fw: FlowWindow, idx: np.ndarray, fwd: np.ndarray, slack_ns: int) -> np.ndarray:
    """Per flow: whether a flow the other way is on the wire during it (within slack_ns)."""
    out = np.zeros(len(idx), dtype=bool)
    st, en = fw.start[idx], fw.end[idx]
    for mine, other in ((fwd, ~fwd), (~fwd, fwd)):
        if not mine.any() or not other.any():
            continue
        o = np.argsort(st[other], kind="stable")
        os_, oe = st[other][o], np.maximum.accumulate(en[other][o])
        pos = np.searchsorted(os_, en[mine] + slack_ns, side="right")
        ok = pos > 0
        hit = np.zeros(int(mine.sum()), dtype=bool)
        hit[ok] = oe[pos[ok] - 1] >= st[mine][ok] - slack_ns
        out[np.flatnonzero(mine)] = hit
    return out


def analyse(fw: FlowWindow, server_of: dict[str, str] | None = None, cfg: FlowConfig | None = None,
            since_ns: int = 0, until_ns: int = 0) -> FlowSnapshot:
    cfg = cfg or FlowConfig()
    server_of = server_of or {}
    segmenter = SEGMENTERS[cfg.segmenter]()
    n_ep = len(fw.ips)
    servers = [server_of.get(ip, ip) for ip in fw.ips]
    sources = sorted({"switch" if o.startswith("import") else "ebpf" for o in fw.origins})
    # pairs: flows grouped by unordered endpoint pair
    lo = np.minimum(fw.src, fw.dst)
    hi = np.maximum(fw.src, fw.dst)
    pkey = lo * max(1, n_ep) + hi
    order = np.lexsort((fw.start, pkey))
    ks = pkey[order]
    cut = np.flatnonzero(np.diff(ks)) + 1 if len(ks) else np.array([], dtype=np.int64)
    bounds = np.concatenate(([0], cut, [len(ks)])) if len(ks) else np.array([0])
    pair_flows: dict[tuple[int, int], np.ndarray] = {}
    for i in range(len(bounds) - 1):
        k = int(ks[bounds[i]])
        if bounds[i + 1] - bounds[i] >= cfg.min_pair_flows:
            pair_flows[(k // max(1, n_ep), k % max(1, n_ep))] = order[bounds[i]:bounds[i + 1]]
    # 1. cross-machine clusters, then merged by identical server sets
    uf = _UnionFind(n_ep)
    for a, b in pair_flows:
        uf.union(a, b)
    clusters: dict[int, list[int]] = defaultdict(list)
    seen = {x for ab in pair_flows for x in ab}
    for x in seen:
        clusters[uf.find(x)].append(x)
    by_servers: dict[frozenset, list[list[int]]] = defaultdict(list)
    for members in clusters.values():
        by_servers[frozenset(servers[x] for x in members)].append(sorted(members))
    by_servers = _merge_contained(by_servers)
    jobs: list[FlowJob] = []
    job_of: dict[int, int] = {}
    job_parts: list[list[list[int]]] = []
    for sset, parts in by_servers.items():
        members = sorted(x for p in parts for x in p)
        if len(members) < cfg.min_job_endpoints:
            continue
        for x in members:
            job_of[x] = len(jobs)
        jobs.append(FlowJob(job_key(sset), sorted(fw.ips[x] for x in members), sorted(sset), {}, [],
                            np.array([], dtype=np.int64), clusters=len(parts)))
        job_parts.append(parts)
    # 2. parallelism per pair
    types: dict[tuple[int, int], str] = {}
    # control pairs: a job's library also talks between ranks that exchange no data (gloo's full mesh of the
    # default group: barriers, rendezvous), a few KB where data pairs move MB; untyped, unlisted
    pair_bytes = {ab: int(fw.nbytes[idx].sum()) for ab, idx in pair_flows.items()}
    job_med: dict[int, float] = {}
    for j in range(len(jobs)):
        vals = [v for ab, v in pair_bytes.items() if job_of.get(ab[0]) == j]
        job_med[j] = float(np.median(vals)) if vals else 0.0
    partners: Counter = Counter()
    strong: set[tuple[int, int]] = set()   # pairs whose verdict the direction of their traffic gave
    for (a, b), idx in pair_flows.items():
        if a in job_of and pair_bytes[(a, b)] >= cfg.min_pair_share * job_med[job_of[a]]:
            types[(a, b)], exchanging, by_direction = _classify(fw, idx, a, cfg, segmenter)
            if by_direction:
                strong.add((a, b))
            if exchanging:
                partners[a] += 1
                partners[b] += 1
    # an exchange of one size is an all-to-all where both ends exchange with others too (an EP group of >= 3),
    # else the all-reduce of a DP group of two (its single message each way per step)
    for ab, t in types.items():
        if t == "x":
            types[ab] = "ep" if partners[ab[0]] >= 2 and partners[ab[1]] >= 2 else "dp"
    job_pairs: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for ab in types:
        job_pairs[job_of[ab[0]]].append(ab)
    for j, job in enumerate(jobs):
        mine = job_pairs.get(j, [])
        # DP is transitive. Components over the DP pairs the direction decided (one way, exchanges): a pair the
        # sizes alone called PP inside one is DP (the paper's refinement); one the sizes alone called DP between
        # two of them joins two DP groups, which only a pipeline does: PP (a TCP capture's partial bursts of a
        # slowed link make a pipeline pair's one size look like several)
        dp_uf = _UnionFind(n_ep)
        in_dp: set[int] = set()
        for ab in mine:
            if types[ab] == "dp" and ab in strong:
                dp_uf.union(*ab)
                in_dp.update(ab)
        refined = demoted = 0
        for ab in mine:
            same = dp_uf.find(ab[0]) == dp_uf.find(ab[1])
            if types[ab] == "pp" and same:
                types[ab] = "dp"
                refined += 1
            elif types[ab] == "dp" and ab not in strong and not same and ab[0] in in_dp and ab[1] in in_dp:
                types[ab] = "pp"
                demoted += 1
        job.refined, job.demoted = refined, demoted
        for ab in mine:
            if types[ab] == "dp":
                dp_uf.union(*ab)
        comps: dict[int, set[int]] = defaultdict(set)
        for ab in mine:
            if types[ab] == "dp":
                comps[dp_uf.find(ab[0])].update(ab)
        job.dp_groups = sorted(sorted(fw.ips[x] for x in c) for c in comps.values())
        for a, b in mine:
            ia, ib = fw.ips[a], fw.ips[b]
            job.pairs[(ia, ib) if ia < ib else (ib, ia)] = types[(a, b)]
        members = [x for part in job_parts[j] for x in part]
        pp_idx = [pair_flows[ab] for ab in mine if types[ab] == "pp"]
        pp_mask = np.zeros(len(fw), dtype=bool)
        if pp_idx:
            pp_mask[np.concatenate(pp_idx)] = True
        if pp_idx:
            tp = _tp_pairs(fw, members, servers, cfg.ep_sync_ns, pp_mask,
                           np.concatenate([pair_flows[ab] for ab in mine]))
        else:
            tp = _tp_by_clusters(job_parts[j], servers, fw.ips)
        for a, b in tp:
            job.pairs.setdefault((a, b) if a < b else (b, a), "tp")
        job.flow_index = np.sort(np.concatenate([pair_flows[ab] for ab in mine])) if mine else job.flow_index
        job.payload_index = np.sort(np.concatenate([_unit_flows(fw, payload(fw, pair_flows[ab], cfg), types[ab])
                                                    for ab in mine])) if mine else job.flow_index
        # 3. timelines from the DP flows (an EP job's all-to-all on a DP ring hop left out)
        phases = [_dp_phase(fw, pair_flows[ab], ab[0], cfg) for ab in mine if types[ab] == "dp"]
        job.dp_flows = np.sort(np.concatenate(phases)) if phases else job.dp_flows
        job.timeline = _timeline(fw, phases, [payload(fw, pair_flows[ab], cfg) for ab in mine
                                              if types[ab] in ("pp", "ep")], segmenter, cfg.ep_sync_ns)
    in_flows = set(np.unique(np.concatenate((fw.src, fw.dst))).tolist()) if len(fw) else set()
    unattributed = sorted(fw.ips[x] for x in in_flows if x not in job_of)
    jobs.sort(key=lambda j: (-len(j.endpoints), j.key))
    return FlowSnapshot(since_ns, until_ns, fw, jobs, dict(server_of), sources, unattributed)


def _merge_contained(by_servers: dict[frozenset, list[list[int]]]) -> dict[frozenset, list[list[int]]]:
    """Beyond the paper: clusters over a strict subset of one other group's servers belong to it. A pipeline
    whose middle data-parallel replicas share a node with their ring neighbours (TP < GPUs per node) talks
    across machines only through its PP chain, which spans the job's odd or even nodes, not all of them: the
    paper's Jaccard = 1 merge leaves it a job of its own. Merged only where exactly one group contains it (two
    jobs on the same servers stay apart: the pitfall §1.2 warns of is not made worse)."""
    keys = sorted(by_servers, key=len, reverse=True)
    out = {k: list(v) for k, v in by_servers.items()}
    for small in sorted(keys, key=len):
        if small not in out:
            continue
        hosts = [k for k in out if k is not small and len(k) > len(small) and small < k]
        if len(hosts) == 1:
            out[hosts[0]].extend(out.pop(small))
    return out


def _tp_pairs(fw: FlowWindow, members: list[int], servers: list[str], sync_ns: int, pp_mask: np.ndarray,
              job_flows: np.ndarray) -> list[tuple[str, str]]:
    """TP pairs, which the wire never shows: GPUs of one node whose sends start together. A TP group moves in
    lockstep (every op ends in its all-reduce over NVLink), so its members send their pipeline activations at
    the same instants, each to its own counterpart; two DP replicas on one node do not (their micro-batches
    drift apart). Pipeline sends are compared where a GPU has them (a DP ring's buckets are not in lockstep
    across TP ranks: each ring's time is its own), all its sends otherwise. Peers: the median distance from
    each of a GPU's first 64 such sends to the other's nearest is within sync_ns."""
    first: dict[int, np.ndarray] = {}
    idx = job_flows[np.isin(fw.src[job_flows], np.asarray(members))]
    idx = idx[np.lexsort((fw.start[idx], fw.src[idx]))]          # by sender, then time
    src = fw.src[idx]
    cut = np.flatnonzero(np.diff(src)) + 1
    for part in np.split(idx, cut):
        if not len(part):
            continue
        pp = part[pp_mask[part]]
        st = fw.start[pp if len(pp) >= 4 else part][:64]
        if len(st) >= 4:
            first[int(fw.src[part[0]])] = st
    per_node: dict[str, list[int]] = defaultdict(list)
    for x in first:
        per_node[servers[x]].append(x)
    out = []
    for xs in per_node.values():
        xs.sort(key=lambda x: _ip_order(fw.ips[x]))
        for i, a in enumerate(xs):
            for b in xs[i + 1:]:
                sa, sb = first[a], first[b]
                pos = np.clip(np.searchsorted(sb, sa), 1, len(sb) - 1)
                d = np.minimum(np.abs(sa - sb[pos - 1]), np.abs(sb[pos] - sa))
                if float(np.median(d)) <= sync_ns:
                    out.append((fw.ips[a], fw.ips[b]))
    return out


def _tp_by_clusters(parts: list[list[int]], servers: list[str], ips: list[str]) -> list[tuple[str, str]]:
    """TP pairs of a job without pipeline sends (every step's all-reduce starts at once for all its rings, so
    nothing on the wire is in lockstep within a TP group only): the GPUs of one node in different
    cross-machine clusters (one per TP index) are paired by their order on the node, the i-th of each cluster
    with the i-th of the others (Megatron places TP ranks on consecutive GPUs)."""
    if len(parts) < 2:
        return []
    per_node: dict[str, list[list[str]]] = defaultdict(list)
    for p in parts:
        on: dict[str, list[str]] = defaultdict(list)
        for x in p:
            on[servers[x]].append(ips[x])
        for node, members in on.items():
            per_node[node].append(sorted(members, key=_ip_order))
    out = []
    for cols in per_node.values():
        cols.sort(key=lambda c: _ip_order(c[0]))
        for i in range(min(len(c) for c in cols)):
            group = [c[i] for c in cols]
            out += [(group[x], group[y]) for x in range(len(group)) for y in range(x + 1, len(group))]
    return out


def _ip_order(ip: str):
    try:
        return (0, int(ipaddress.ip_address(ip)))
    except ValueError:
        return (1, ip)


def _ring_under_all_to_all(fw: FlowWindow, idx: np.ndarray, fwd: np.ndarray, ov: np.ndarray,
                           cfg: FlowConfig) -> tuple[np.ndarray, bool]:
    """A DP ring hop inside an EP group carries the group's all-to-all (size classes, 4 KiB, exchanged both ways
    at once) beside the ring's buckets (size classes sent one way only): (the exchanged flows, whether a one-way
    class holding >= 10 % of the pair's bytes is there too)."""
    w = fw.nbytes[idx].astype(np.float64)
    cls = fw.nbytes[idx] >> 12
    total = float(w.sum())
    exch = np.zeros(len(idx), dtype=bool)
    one_way = False
    for c in np.unique(cls):
        m = cls == c
        f_ab, f_ba = float(w[m & fwd].sum()), float(w[m & ~fwd].sum())
        if ov[m].mean() >= cfg.ep_sync_fraction and min(f_ab, f_ba) > 0:
            exch |= m
        elif min(f_ab, f_ba) < cfg.one_way_fraction * max(f_ab, f_ba) and max(f_ab, f_ba) >= 0.1 * total:
            one_way = True
    return exch, one_way


def _dp_phase(fw: FlowWindow, idx: np.ndarray, a: int, cfg: FlowConfig) -> np.ndarray:
    """The payload flows of a DP pair that belong to its all-reduce: on a ring hop inside an EP group the
    all-to-all's classes are dropped (_ring_under_all_to_all); every other DP pair keeps all its payload flows."""
    idx = payload(fw, idx, cfg)
    if len(idx) == 0:
        return idx
    fwd = fw.src[idx] == a
    exch, one_way = _ring_under_all_to_all(fw, idx, fwd, _overlapped(fw, idx, fwd, cfg.ep_sync_ns), cfg)
    return idx[~exch] if exch.any() and one_way else idx


def _endpoint_flows(fw: FlowWindow, pairs: list[np.ndarray]) -> dict[int, list[np.ndarray]]:
    per_ep: dict[int, list[np.ndarray]] = defaultdict(list)
    for idx in pairs:
        if len(idx):
            for x in {int(fw.src[idx[0]]), int(fw.dst[idx[0]])}:
                per_ep[x].append(idx)
    return per_ep


def _timeline(fw: FlowWindow, dp_pairs: list[np.ndarray], other_pairs: list[np.ndarray], segmenter,
              sync_ns: int) -> dict[str, list[tuple[int, int, int]]]:
    """Per endpoint: its DP flows cut into one segment per step. Where the endpoint sends other traffic itself
    (pipeline sends, all-to-alls: the step's compute), a cut goes wherever such a send starts after every DP
    flow so far has ended (give or take sync_ns) and before the next one starts: a step's all-reduce is never
    interleaved with the endpoint's own compute traffic, and the next step's comes after it (what it receives
    is not used: the stage before it may start its next step while this one still all-reduces). That holds
    where the intervals inside an all-reduce and between steps overlap (a gloo all-reduce split into bursts up
    to 30 ms apart, steps 50-150 ms apart on a loaded host). An endpoint with DP traffic only is cut
    by the segmenter (GapSplit: the natural break of its intervals)."""
    per_ep = _endpoint_flows(fw, dp_pairs)
    others = _endpoint_flows(fw, other_pairs)
    ends: dict[int, np.ndarray] = {}
    for x, parts in per_ep.items():
        idx = np.concatenate(parts)
        idx = idx[np.argsort(fw.start[idx], kind="stable")]
        starts = fw.start[idx]
        own = np.concatenate(others[x]) if x in others else np.array([], dtype=np.int64)
        own = own[fw.src[own] == x]   # its own sends: a neighbour stage's next step may start during its all-reduce
        if len(own):
            ost = np.sort(fw.start[own])
            done = np.maximum.accumulate(fw.end[idx])[:-1] + sync_ns   # the DP flows so far are all over
            between = np.searchsorted(ost, starts[1:], side="left") - np.searchsorted(ost, done, side="right")
            cuts = [int(i) + 1 for i in np.flatnonzero(between > 0)]
        else:
            cuts = segmenter.boundaries(starts)
        e = [int(fw.end[idx[lo:hi]].max()) for lo, hi in segments(starts, cuts)]
        if len(e) >= 2:
            ends[x] = np.asarray(e, dtype=np.int64)
    if not ends:
        return {}
    ref = max(ends.values(), key=len)
    period = float(np.median(np.diff(ref))) if len(ref) > 1 else 0.0
    out: dict[str, list[tuple[int, int, int]]] = {}
    for x, e in ends.items():
        pos = np.clip(np.searchsorted(ref, e), 1, len(ref) - 1) if len(ref) > 1 else np.zeros(len(e), dtype=int)
        near = np.where(np.abs(ref[pos - 1] - e) <= np.abs(ref[pos] - e), pos - 1, pos)
        ok = np.abs(ref[near] - e) <= period / 2
        steps = []
        for k in range(1, len(e)):  # the first segment's start is before the window
            if ok[k]:
                steps.append((int(near[k]), int(e[k - 1]), int(e[k])))
        out[fw.ips[x]] = steps
    return out


def topology_maps(topo) -> tuple[dict[str, str], dict[str, str]]:
    """(address -> node id, address -> NIC id) from a topology (collector/topology.Topology), or empty."""
    server_of, nic_of = {}, {}
    if topo is not None:
        for nic in topo.nics.values():
            if nic.ip:
                server_of[nic.ip] = nic.node
                nic_of[nic.ip] = nic.id
    return server_of, nic_of


def match_jobs(snap: FlowSnapshot, known: list[dict]) -> dict[str, str]:
    """{procs job key: flow job key} where a job known from its processes runs on (nearly) the servers a flow
    job spans: Jaccard of the node sets >= 0.5, the best match for each, each flow job matched once."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    for j in known:
        nodes = set(j.get("nodes") or ())
        if not nodes:
            continue
        best, score = None, 0.5
        for fj in snap.jobs:
            s = set(fj.servers)
            jac = len(nodes & s) / len(nodes | s)
            if jac >= score and fj.key not in taken:
                best, score = fj.key, jac
        if best:
            out[j["job_key"]] = best
            taken.add(best)
    return out


class FlowView:
    """The latest black-box analysis of the cluster's flows, shared by the engine's loop, the flows detector and
    Control (`steplens jobs`, `steplens timeline`): recomputed when flows arrived and the snapshot is older than
    `refresh_ns` of data time, else served from memory. Thread-safe (one analysis at a time)."""

    def __init__(self, window_seconds: float = 60.0, refresh_seconds: float = 30.0,
                 cfg: FlowConfig | None = None) -> None:
        import threading
        self.window_ns = int(window_seconds * 1e9)
        self.refresh_ns = int(refresh_seconds * 1e9)
        self.cfg = cfg or FlowConfig()
        self._lock = threading.Lock()
        self._snap: FlowSnapshot | None = None
        self._mark: tuple[int, int] = (0, 0)
        self.analyses = 0
        self.last_seconds = 0.0

    def snapshot(self, reader, until_ns: int = 0, since_ns: int = 0) -> FlowSnapshot | None:
        """The analysis of the window ending at until_ns (default: the newest flow); None without flows. A window
        asked explicitly (since_ns) is computed for the caller and not kept."""
        import time as _time
        with self._lock:
            rowid, newest = reader.flow_watermark()
            if not rowid:
                return None
            until = min(until_ns or newest, newest) if until_ns else newest
            snap = self._snap
            # no new flows, or a snapshot within the refresh period of the time asked (either side: a job whose
            # newest data is a little older than the newest flow is served the snapshot, not a new analysis)
            if not since_ns and snap is not None and (rowid == self._mark[0] or
                                                      abs(until - snap.until_ns) < self.refresh_ns):
                return snap
            since = since_ns or max(0, until - self.window_ns)
            t0 = _time.perf_counter()
            fw = FlowWindow.from_rows(reader.flow_rows(since, until + 1), self.cfg.ignore_ports)
            server_of, _ = topology_maps(reader.topology())
            snap = analyse(fw, server_of, self.cfg, since, until)
            try:
                snap.matched = match_jobs(snap, reader.jobs())
            except AttributeError:  # a reader without process tables (a flows-only test reader)
                snap.matched = {}
            self.analyses += 1
            self.last_seconds = _time.perf_counter() - t0
            if not since_ns:
                self._snap, self._mark = snap, (rowid, newest)
            return snap
