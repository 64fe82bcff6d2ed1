"""Jobs, their parallelism and each rank's step timeline, from network flows alone (LLMPrism, ALGORITHMS.md §1).

Reads one window of flows (the store's `flows` table: eBPF bursts from the agents' netflows source, flows
imported from switches, or both) and the topology file (NIC IP -> node); nothing from the jobs themselves.
`analyse(flows, topology, config) -> FlowSnapshot`, pure: the same flows give the same snapshot.

  1. Job recognition (§1.2): union-find over the endpoints of every flow gives the cross-machine clusters; a
     job with tensor parallelism inside its nodes shows as one cluster per TP index over the same servers, so
     clusters whose server sets are identical are merged (bucketed by the frozen set: O(clusters), not the
     paper's pairwise Jaccard loop). Endpoints are IP addresses; an address the topology does not know is a
     server of its own. Loopback and a flow's own host are never endpoints.
  2. Parallelism of every endpoint pair (§1.3): the pair's flows (both directions) are split into steps
     (bocd.py: GapSplit by default, Bocd as the reference), and per step the distinct flow sizes are counted
     (sizes within 1 % are one size: retransmits and headers move a byte count, not a message). The mode over
     steps decides: several sizes -> DP (a gradient all-reduce in buckets); one size -> a point-to-point
     message. Beyond the paper, one size is told apart further: an all-to-all (EP) sends both ways at the same
     instant, a pipeline (PP) sends forward activations and backward gradients at different times, so a pair
     whose flows mostly have a reverse flow starting within `ep_sync_ns` is EP. Then DP is transitive: a PP
     pair whose ends lie in one DP component is promoted to DP (the refinement; EP pairs sit inside DP groups
     by construction and are left alone). TP pairs are inferred, never seen: GPUs of one node of the job whose
     pipeline sends start together (a TP group moves in lockstep; DP replicas drift apart); in a job without
     pipeline sends, the GPUs of a node in different cross-machine clusters, paired in GPU order.
  3. Timeline per endpoint (§1.4): its DP flows sorted by start, split at the large gaps (one per step), and
     step k ends at the latest flow end of segment k; step k starts where step k-1 ended. Step numbers are
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
    ep_sync_ns: int = 50_000             # a reverse flow starting this close makes a send an exchange (EP)
    ep_sync_fraction: float = 0.8        # ... and a pair whose flows are exchanges this often is EP
    min_pair_flows: int = 3              # pairs with fewer flows in the window are noise (not classified)
    min_job_endpoints: int = 2


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
    def from_rows(cls, rows) -> "FlowWindow":
        """rows: (start_ns, end_ns, src, dst, bytes, switches, origin) tuples, switches a tuple or a JSON list
        text; loopback endpoints and flows from a host to itself are dropped."""
        index: dict[str, int] = {}
        ips: list[str] = []
        keep_ip: dict[str, bool] = {}
        st, en, nb, sa, da, sw = [], [], [], [], [], []
        origins: set[str] = set()
        parsed: dict[str, tuple] = {}
        for s, e, a, b, n, switches, origin in rows:
            if a == b:
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
    refined: int = 0                           # PP pairs promoted to DP by transitivity
    clusters: int = 0                          # cross-machine clusters merged into it

    def summary(self) -> dict:
        kinds = Counter(self.pairs.values())
        return {"job_key": self.key, "endpoints": len(self.endpoints), "servers": len(self.servers),
                "pairs": dict(kinds), "dp_groups": len(self.dp_groups), "refined": self.refined}


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
    if len(sizes) == 0:
        return 0
    v = np.unique(sizes)
    if len(v) == 1:
        return 1
    return 1 + int(np.count_nonzero(v[1:] > v[:-1] * (1.0 + tol)))


def _size_mode(fw: FlowWindow, idx: np.ndarray, cfg: FlowConfig, segmenter) -> int:
    """The most common number of distinct flow sizes per step of these flows (idx sorted by start)."""
    if len(idx) == 0:
        return 0
    starts = fw.start[idx]
    counts = [distinct_sizes(fw.nbytes[idx[lo:hi]], cfg.size_tolerance)
              for lo, hi in segments(starts, segmenter.boundaries(starts))]
    return Counter(counts).most_common(1)[0][0] if counts else 1


def classify_pair(fw: FlowWindow, idx: np.ndarray, a: int, cfg: FlowConfig, segmenter) -> str:
    """dp | pp | ep for one pair's flows (idx sorted by start), a = the pair's lower endpoint index.
    A flow that starts together with one the other way is an exchange. A pair whose flows are mostly exchanges
    is EP if it sends one size per step, else DP (a ring of two: its buckets go both ways at once). A pair with
    size classes (4 KiB) of exchanges beside size classes sent one way (a DP ring hop inside an EP group:
    all-to-all plus the ring's buckets) is judged on its one-way flows. Otherwise several sizes per step -> dp,
    one size -> pp."""
    sync = _synced(fw, idx, a, cfg.ep_sync_ns)
    exchanges = sync.mean() >= cfg.ep_sync_fraction
    if not exchanges:
        cls = fw.nbytes[idx] >> 12
        exch = np.zeros(len(idx), dtype=bool)
        one_way = False
        for c in np.unique(cls):
            m = cls == c
            f = sync[m].mean()
            if f >= cfg.ep_sync_fraction:
                exch |= m
            one_way |= f < 1.0 - cfg.ep_sync_fraction
        if exch.any() and one_way:
            return "dp" if _size_mode(fw, idx[~exch], cfg, segmenter) >= 2 else "ep"
    if _size_mode(fw, idx, cfg, segmenter) >= 2:
        return "dp"
    return "ep" if exchanges else "pp"


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
    for (a, b), idx in pair_flows.items():
        if a in job_of:
            types[(a, b)] = classify_pair(fw, idx, a, cfg, segmenter)
    job_pairs: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for ab in types:
        job_pairs[job_of[ab[0]]].append(ab)
    for j, job in enumerate(jobs):
        mine = job_pairs.get(j, [])
        dp_uf = _UnionFind(n_ep)
        for ab in mine:
            if types[ab] == "dp":
                dp_uf.union(*ab)
        refined = 0
        for ab in mine:
            if types[ab] == "pp" and dp_uf.find(ab[0]) == dp_uf.find(ab[1]):
                types[ab] = "dp"
                refined += 1
        job.refined = refined
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
        tp = _tp_pairs(fw, members, servers, cfg.ep_sync_ns, pp_mask) if pp_idx else \
            _tp_by_clusters(job_parts[j], servers, fw.ips)
        for a, b in tp:
            job.pairs.setdefault((a, b) if a < b else (b, a), "tp")
        job.flow_index = np.sort(np.concatenate([pair_flows[ab] for ab in mine])) if mine else job.flow_index
        # 3. timelines from the DP flows (an EP job's all-to-all on a DP ring hop left out)
        phases = [_dp_phase(fw, pair_flows[ab], ab[0], cfg) for ab in mine if types[ab] == "dp"]
        job.dp_flows = np.sort(np.concatenate(phases)) if phases else job.dp_flows
        job.timeline = _timeline(fw, phases, segmenter)
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


def _tp_pairs(fw: FlowWindow, members: list[int], servers: list[str], sync_ns: int,
              pp_mask: np.ndarray) -> list[tuple[str, str]]:
    """TP pairs, which the wire never shows: GPUs of one node whose sends start together. A TP group moves in
    lockstep (every op ends in its all-reduce over NVLink), so its members send their pipeline activations at
    the same instants, each to its own counterpart; two DP replicas on one node do not (their micro-batches
    drift apart). Pipeline sends are compared where a GPU has them (a DP ring's buckets are not in lockstep
    across TP ranks: each ring's time is its own), all its sends otherwise. Peers: the median distance from
    each of a GPU's first 64 such sends to the other's nearest is within sync_ns."""
    first: dict[int, np.ndarray] = {}
    order = np.argsort(fw.start, kind="stable")
    src_sorted = fw.src[order]
    pp_sorted = pp_mask[order]
    for x in set(members):
        mine = src_sorted == x
        pp = mine & pp_sorted
        st = fw.start[order[pp if np.count_nonzero(pp) >= 4 else mine]][:64]
        if len(st) >= 4:
            first[x] = st
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


def _synced(fw: FlowWindow, idx: np.ndarray, a: int, sync_ns: int) -> np.ndarray:
    """Per flow of a pair: whether a flow the other way starts within sync_ns of it (an exchange)."""
    starts = fw.start[idx]
    fwd = fw.src[idx] == a
    out = np.zeros(len(idx), dtype=bool)
    for mine, other in ((fwd, ~fwd), (~fwd, fwd)):
        so = np.sort(starts[other])
        if len(so) == 0 or not mine.any():
            continue
        sm = starts[mine]
        pos = np.clip(np.searchsorted(so, sm), 1, max(1, len(so) - 1))
        d = np.minimum(np.abs(sm - so[pos - 1]), np.abs(so[np.minimum(pos, len(so) - 1)] - sm))
        out[np.flatnonzero(mine)] = d <= sync_ns
    return out


def _dp_phase(fw: FlowWindow, idx: np.ndarray, a: int, cfg: FlowConfig) -> np.ndarray:
    """The flows of a DP pair that belong to its all-reduce: in an EP job a ring hop inside an EP group also
    carries the group's all-to-all, a size sent both ways at once many times per step; the ring's buckets go one
    way. Sizes (4 KiB classes) that are mostly exchanges are dropped, where sizes that are not remain (a ring
    of two, whose buckets are exchanges too, keeps everything)."""
    sync = _synced(fw, idx, a, cfg.ep_sync_ns)
    cls = fw.nbytes[idx] >> 12
    keep = np.ones(len(idx), dtype=bool)
    exch = []
    for c in np.unique(cls):
        m = cls == c
        if sync[m].mean() >= cfg.ep_sync_fraction:
            exch.append(m)
    if exch and len(exch) < len(np.unique(cls)):
        for m in exch:
            keep &= ~m
    return idx[keep]


def _timeline(fw: FlowWindow, dp_pairs: list[np.ndarray], segmenter) -> dict[str, list[tuple[int, int, int]]]:
    per_ep: dict[int, list[np.ndarray]] = defaultdict(list)
    for idx in dp_pairs:
        for x in np.unique(np.concatenate((fw.src[idx[:1]], fw.dst[idx[:1]]))):
            per_ep[int(x)].append(idx)
    ends: dict[int, np.ndarray] = {}
    for x, parts in per_ep.items():
        idx = np.concatenate(parts)
        idx = idx[np.argsort(fw.start[idx], kind="stable")]
        starts = fw.start[idx]
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
            if not since_ns and snap is not None and (rowid == self._mark[0] or
                                                      0 <= until - snap.until_ns < self.refresh_ns):
                return snap
            since = since_ns or max(0, until - self.window_ns)
            t0 = _time.perf_counter()
            fw = FlowWindow.from_rows(reader.flow_rows(since, until + 1))
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
