"""Root-cause ranking of a deep dive: LatencyPrism's suspicion score (ALGORITHMS.md §4.8), extended to ranks and
resources, on what a synchronized deep window captured.

Candidates, each scored against two references:
  function  a Python function on one rank: beta = the share of the rank's main-thread samples in a cycle (its
            steps inside the window; 1 s bins without steps) whose stack holds the function (inclusive time);
            mu = the resource its class maps to (compute -> run queue, cgroup throttling, GC, stop, memory
            pressure; comm -> the connections held back by the network; data loading -> run queue, memory), the
            one whose log1p rose most (a fall is none: |Z_logmu| counts only rises; nor a rise under `mu_min_pp`
            percentage points of its share, however many sigma of a quiet reference). The process's own CPU is not
            one: it falls whenever the rank waits, whatever made it wait.
  resource  a resource of one rank or its node (run-queue wait, cgroup throttling, GC, stopped, memory pressure:
            shares of wall time; affinity: the share of its CPUs the process may no longer run on; the
            network-limited share of the connections with the node's address at either end, its own and its
            peers' to it): per-interval values of the window (each interval between two samples of the counter).
  peer reference  the same candidate on the rank's peers in the same window: for functions its role peers (the
            behavioural symmetry the paper assumes: ranks that run collectives on one communicator short of the
            whole job, a DP group's replicas of a stage or a TP group; without such groups, ranks whose innermost
            frames take alike shares of their time, above the largest gap in their similarities; else the whole
            job), for resources every other rank;
  own reference   the same rank in the reference window before the finding (sentinel-rate samples, 1 s bins).
  S = |d_beta| * (|Z_beta| + |Z_logmu|) per reference (d_beta in percentage points); S_peers + own_weight x
  S_own (0.1: every rank of a slowed job departs from its own past alike, so the own term says what changed,
  the peers who); a resource's share is its beta and its own mu. Z = (mean - mean_ref) / std_ref.
Errata handled: the paper sets Z = 0 when the reference's std is below 1e-9, which silences exactly a function or
resource that appears on one rank only (gc on the faulty rank, zero on its peers); here the std is floored at
`z_floor_pp` percentage points instead, and Z capped at `z_cap`, so one degenerate reference cannot dominate.
Resources only count when they rise (more waiting is bad; less is not a cause); functions count both ways (a
stopped rank's compute share falls). A comm function no resource explains ("waiting") is a symptom, the others'
slowness showing on this rank: its score is weighed down (`waiting_weight`). One whose share fell below its peers'
(or, with no peers, its own past) says the opposite: the others wait for this rank there, it is late (evidence
`late`), and what it names is its own work's: compute, or the compute resource that rose (a straggler whose extra
time is in no function of its own, a loop at module level, a GPU wait inside a C call, shows only there).
The cause a candidate names: a resource's own (runqueue -> cpu-contention, throttled -> cpu-throttled, gc -> gc,
stopped -> stopped, memory -> memory-pressure, network -> network, affinity -> cpu-affinity); a function's is its
mu resource's where that deviates (|Z| >= `mu_z_significant`), else compute / waiting (comm) / data-loading by its
class.
A process of no rank (a serving engine: LatencyPrism's own setting) is a candidate like a rank, keyed < 0; with no
peers only its own reference scores it.
Output: causes best first {kind, id, rank (-1: none), node, pid, cause, score, evidence}, and per rank (or
"node:pid") its best score.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

RESOURCE_CAUSE = {"runqueue": "cpu-contention", "throttled": "cpu-throttled", "gc": "gc", "stopped": "stopped",
                  "memory": "memory-pressure", "network": "network", "affinity": "cpu-affinity"}
CLASS_RESOURCES = {"compute": ("runqueue", "throttled", "gc", "stopped", "memory", "affinity"),
                   "comm": ("network",), "data": ("runqueue", "memory")}
CLASS_CAUSE = {"compute": "compute", "comm": "waiting", "data": "data-loading"}


@dataclass
class SuspicionConfig:
    z_floor_pp: float = 1.0         # reference std floor, percentage points
    z_cap: float = 50.0
    mu_z_significant: float = 3.0
    mu_min_pp: float = 2.0          # a resource explains a function only where its share rose at least this many
                                    # percentage points: a run-queue wait from 0.2 % to 0.7 % of the time is 3.8
                                    # sigma of a quiet reference and explains nothing of a 30-point shift
    min_beta: float = 0.02          # functions below this share on the rank and on its references are left out
    role_cosine: float = 0.9        # ranks alike in the reference window share a role (peer reference)
    max_frames: int = 48            # frames of a stack considered (outermost first)
    top: int = 10                   # causes kept
    own_weight: float = 0.1         # the own-reference term's weight: every rank of a slowed job departs from its
                                    # own past alike, so it says what changed more than who (peers say who)
    together_share: float = 0.95    # a function above a deeper one wherever that runs, with this share of its
                                    # samples in it, is its wrapper: only the deeper is a candidate
    waiting_weight: float = 0.5     # a comm function no resource explains ("waiting") is the others' slowness
                                    # showing on this rank: a symptom, its score weighed down


@dataclass
class RankData:
    rank: int                                        # the job's rank; a process of no rank (a serving engine): < 0
    node: str
    cycles: list = field(default_factory=list)       # deep window: [{function: share}]
    ref_cycles: list = field(default_factory=list)   # reference window: [{function: share}]
    profile: dict = field(default_factory=dict)      # innermost frame -> share (reference window, else deep): role
    comms: set = field(default_factory=set)          # collective communicators it ran ops on (its steps): role
    links: list = field(default_factory=list)        # its node's most network-limited connections (evidence)
    resources: dict = field(default_factory=dict)    # name -> [per-interval share] (deep window)
    ref_resources: dict = field(default_factory=dict)
    samples: int = 0
    ref_samples: int = 0
    pid: int = 0
    depth: dict = field(default_factory=dict)        # function -> its mean position in the stacks (0 outermost)
    within: dict = field(default_factory=dict)       # function -> the functions above it in every stack holding it
    held: dict = field(default_factory=dict)         # function -> samples of the deep window holding it


def function_class(file: str) -> str:
    if "torch/distributed" in file or "/gloo" in file or "nccl" in file.lower():
        return "comm"
    if "torch/utils/data" in file:
        return "data"
    return "compute"


def frame_key(fr: dict) -> str:
    f = fr.get("file") or ""
    return f"{fr.get('qualname') or fr.get('function')} ({f.rsplit('/', 1)[-1]})" + ("\x00" + f if f else "")


def label(key: str) -> str:
    return key.split("\x00", 1)[0]


def key_file(key: str) -> str:
    return key.split("\x00", 1)[1] if "\x00" in key else ""


def main_thread(samples: list[dict]) -> list[dict]:
    """The samples of the rank's busiest Python thread (the one with most samples holding frames)."""
    by_tid: dict[int, list[dict]] = {}
    for s in samples:
        if s.get("frames"):
            by_tid.setdefault(s["tid"], []).append(s)
    if not by_tid:
        return []
    return max(by_tid.values(), key=len)


def cycle_shares(samples: list[dict], bounds: list[tuple[int, int]], max_frames: int) -> list[dict]:
    """Per cycle [a, b): {function key: share of the cycle's samples whose stack holds it}."""
    samples = sorted(samples, key=lambda s: s["ts_ns"])
    out = []
    i = 0
    for a, b in bounds:
        while i < len(samples) and samples[i]["ts_ns"] < a:
            i += 1
        j, counts, n = i, {}, 0
        while j < len(samples) and samples[j]["ts_ns"] < b:
            n += 1
            for k in {frame_key(fr) for fr in list(reversed(samples[j]["frames"]))[:max_frames]}:
                counts[k] = counts.get(k, 0) + 1
            j += 1
        if n:
            out.append({k: c / n for k, c in counts.items()})
    return out


def frame_nesting(samples: list[dict], max_frames: int) -> tuple[dict[str, float], dict[str, frozenset],
                                                                  dict[str, int]]:
    """({function key: its mean position in the stacks that hold it, 0 the outermost frame}, {function key: the
    functions above it in every stack that holds it}, {function key: samples holding it}): a wrapper is above what
    it wraps in every stack, and of the two the deeper is the one that does the work."""
    raw: dict[tuple, int] = {}
    for smp in samples:   # each distinct stack once (a deep window holds thousands of samples of a few stacks)
        key = tuple((fr.get("qualname") or fr.get("function"), fr.get("file")) for fr in smp["frames"])
        raw[key] = raw.get(key, 0) + 1
    sums: dict[str, list] = {}
    within: dict[str, frozenset] = {}
    for frames, n in raw.items():
        stack = [frame_key({"qualname": q, "file": f}) for q, f in reversed(frames[-max_frames:])]
        above: set[str] = set()
        for i, k in enumerate(stack):
            if k in above:
                continue   # recursion: its first (outermost) position
            acc = sums.setdefault(k, [0, 0])
            acc[0] += i * n
            acc[1] += n
            within[k] = within[k] & above if k in within else frozenset(above)
            above.add(k)
    return {k: t / n for k, (t, n) in sums.items()}, within, {k: n for k, (_, n) in sums.items()}


def bins(a: int, b: int, width_ns: int = 10**9) -> list[tuple[int, int]]:
    return [(t, min(b, t + width_ns)) for t in range(a, b, width_ns)] if b > a else []


def _stats(values: list[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def _z(x: float, ref: list[float], floor: float, cap: float) -> tuple[float, float]:
    m, s = _stats(ref)
    z = (x - m) / max(s, floor)
    return max(-cap, min(cap, z)), m


def leaf_profile(samples: list[dict]) -> dict[str, float]:
    """Share of the samples per innermost frame: what a rank spends its time in (its role)."""
    acc: dict[str, float] = {}
    for s in samples:
        if s.get("frames"):
            k = frame_key(s["frames"][0])
            acc[k] = acc.get(k, 0.0) + 1
    n = sum(acc.values())
    return {k: v / n for k, v in acc.items()} if n else {}


COLLECTIVES = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "reduce", "all_to_all", "alltoall", "_allgather_base", "_reduce_scatter_base")


def comm_roles(ranks: dict[int, RankData]) -> dict[int, list[int]] | None:
    """Role peers from the communicators: ranks that run collectives on one communicator that is not the whole job's
    (a DP group's replicas of one pipeline stage, a TP group's shards) do the same work. None where no rank has such
    a communicator (one world group: then everyone is everyone's peer, or the profiles decide)."""
    members: dict[str, set[int]] = {}
    for r, d in ranks.items():
        for c in d.comms:
            members.setdefault(c, set()).add(r)
    groups = [m for m in members.values() if 1 < len(m) < len(ranks)]
    if not groups:
        return None
    out = {}
    for r in ranks:
        peers = set().union(*[m for m in groups if r in m]) - {r}
        out[r] = sorted(peers) if peers else sorted(p for p in ranks if p != r)
    return out


def roles(ranks: dict[int, RankData], cosine: float) -> dict[int, list[int]]:
    """Each rank's role peers: the other ranks whose time goes to the same innermost functions (the cosine of their
    profiles; inclusive shares would not do: the loop's outer frames hold every sample of every rank). Every other
    rank where all are alike (>= `cosine`); else those above the largest gap (>= 0.1) in the sorted similarities;
    a rank alike to none gets every other rank."""
    vec = {}
    for r, d in ranks.items():
        acc: dict[str, float] = dict(d.profile)
        if not acc:
            for c in d.ref_cycles or d.cycles:
                for k, v in c.items():
                    acc[k] = acc.get(k, 0.0) + v
        vec[r] = acc

    def cos(a: dict, b: dict) -> float:
        num = sum(v * b.get(k, 0.0) for k, v in a.items())
        den = math.sqrt(sum(v * v for v in a.values())) * math.sqrt(sum(v * v for v in b.values()))
        return num / den if den else 0.0
    out = {}
    for r in ranks:
        others = sorted(((cos(vec[r], vec[p]), p) for p in ranks if p != r), reverse=True)
        if not others:
            out[r] = []
            continue
        # alike: those above the largest gap in the sorted similarities (LatencyPrism's auto-adjusted threshold),
        # where that gap is a real one (>= 0.1) and the most alike is alike at all (>= 1 - 2 x (1 - cosine))
        gaps = [(others[i][0] - others[i + 1][0], i) for i in range(len(others) - 1)]
        gap, at = max(gaps, default=(0.0, len(others) - 1))
        if others[0][0] >= cosine and all(c >= cosine for c, _ in others):
            out[r] = sorted(p for _, p in others)
        elif gap >= 0.1 and others[0][0] >= 1 - 2 * (1 - cosine):
            out[r] = sorted(p for _, p in others[:at + 1])
        else:
            out[r] = sorted(p for _, p in others)
    return out


def _innermost_of_together(d: RankData, share: float) -> list[str]:
    """The rank's functions less the wrappers: a function above a deeper one in every deep-window stack that holds
    the deeper (RankData.within) and with at least `share` of its own samples in the deeper one's (RankData.held).
    torch's _exception_logger wraps every c10d collective, so the two scored alike and the deep dive of `make
    run`'s demo named the wrapper; the deeper one does the work. Counted in samples of the deep window, not as
    shares per cycle: the reference, sampled at the sentinel rate, holds a couple of samples a second, where one
    sample of the wrapper's own code is tens of points of a cycle. Deepest first."""
    keys = sorted({k for c in d.cycles for k in c}, key=lambda k: (-d.depth.get(k, 0.0), k))
    kept: list[str] = []
    for k in keys:
        n = d.held.get(k, 0)
        if not (n and any(k in d.within.get(inner, ()) and d.held.get(inner, 0) >= share * n for inner in kept)):
            kept.append(k)
    return kept


def _score(x: float, peer_ref: list[float], own_ref: list[float], mu: tuple[float, float, float],
           cfg: SuspicionConfig) -> tuple[float, dict]:
    """S against the peers plus S against the rank's own reference; x and the references are shares (0..1)."""
    fl, cap = cfg.z_floor_pp / 100, cfg.z_cap
    total, ev = 0.0, {}
    for name, ref, zmu, weight in (("peers", peer_ref, mu[0], 1.0), ("own", own_ref, mu[1], cfg.own_weight)):
        if not ref:
            continue
        z, m = _z(x, ref, fl, cap)
        d_pp = (x - m) * 100
        s = weight * abs(d_pp) * (abs(z) + abs(zmu))
        total += s
        ev[name] = {"d_beta_pp": round(d_pp, 2), "z_beta": round(z, 2), "z_logmu": round(zmu, 2), "s": round(s, 1)}
    return total, ev


def rank_causes(ranks: dict[int, RankData], cfg: SuspicionConfig | None = None) -> dict:
    """The deep dive's ranking: {"causes": [...] best first, "ranks": {rank: best score}, "roles": {...}}."""
    cfg = cfg or SuspicionConfig()
    if not ranks:
        return {"causes": [], "ranks": {}, "roles": {}}
    peers = comm_roles(ranks) or roles(ranks, cfg.role_cosine)
    cap = cfg.z_cap

    def mean_of(vals):
        return statistics.fmean(vals) if vals else 0.0

    # mu per (rank, resource): Z of log1p(percent) against the peers and against the rank's own reference, and
    # the share's rise over each in percentage points (what a function's cause needs besides its Z)
    mu: dict[tuple[int, str], tuple[float, float, float, float, float]] = {}
    names = {n for d in ranks.values() for n in d.resources}
    for r, d in ranks.items():
        for n in names:
            own = d.resources.get(n) or []
            if not own:
                continue
            x = math.log1p(100 * mean_of(own))
            pref = [math.log1p(100 * v) for p in ranks if p != r for v in ranks[p].resources.get(n, [])]
            oref = [math.log1p(100 * v) for v in d.ref_resources.get(n, [])]
            zp = _z(x, pref, math.log1p(cfg.z_floor_pp) / 10, cap)[0] if pref else 0.0
            zo = _z(x, oref, math.log1p(cfg.z_floor_pp) / 10, cap)[0] if oref else 0.0
            peer_raw = [v for p in ranks if p != r for v in ranks[p].resources.get(n, [])]
            own_raw = d.ref_resources.get(n, [])
            mu[(r, n)] = (zp, zo, mean_of(own), 100 * (mean_of(own) - mean_of(peer_raw)) if peer_raw else 0.0,
                          100 * (mean_of(own) - mean_of(own_raw)) if own_raw else 0.0)
    causes = []
    for r, d in ranks.items():
        # resources: their share is their beta, their own log1p their mu; only a rise counts
        for n in names:
            own = d.resources.get(n) or []
            if not own or n not in RESOURCE_CAUSE:
                continue
            x = mean_of(own)
            pref = [v for p in ranks if p != r for v in ranks[p].resources.get(n, [])]   # resources: every rank
            oref = list(d.ref_resources.get(n, []))
            zp, zo = mu.get((r, n), (0.0, 0.0))[:2]
            s, ev = _score(x, pref, oref, (max(0.0, zp), max(0.0, zo), 0.0), cfg)
            rises = [e["d_beta_pp"] > 0 for e in ev.values()]
            if not any(rises):
                continue
            s = sum(e["s"] for e in ev.values() if e["d_beta_pp"] > 0)
            extra = {"links": d.links} if n == "network" and d.links else {}
            causes.append({"kind": "resource", "id": n, **who(r, d), "cause": RESOURCE_CAUSE[n],
                           "score": round(s, 1), "evidence": {"share": round(x, 4), **ev, **extra}})
        # functions
        if not d.cycles:
            continue
        for k in _innermost_of_together(d, cfg.together_share):
            xs = [c.get(k, 0.0) for c in d.cycles]
            x = mean_of(xs)
            pref = [c.get(k, 0.0) for p in peers[r] for c in ranks[p].cycles]
            oref = [c.get(k, 0.0) for c in d.ref_cycles]
            if max(x, mean_of(pref), mean_of(oref)) < cfg.min_beta:
                continue
            cls = function_class(key_file(k))
            # a collective this rank spends less of its time in than its peers (or than before, with no peers):
            # the others wait for it there, so it is late, and what made it late is its own work's
            late = cls == "comm" and (pref and mean_of(pref) > x or not pref and oref and mean_of(oref) > x)
            # its resource: the one whose share rose most (only a rise: every resource here is time lost to
            # something, a run-queue wait, a network hold-up, a GC pause; one that fell explains no function, and
            # LatencyPrism's |Z_logmu| of a utilisation would let a slowed PP stage's run-queue wait, down 15 sigma
            # while its link was shaped, lift its forward function over the network itself)
            best, bz = None, (0.0, 0.0)
            for n in CLASS_RESOURCES["compute" if late else cls]:
                zp, zo, _, rise_p, rise_o = mu.get((r, n), (0.0, 0.0, 0.0, 0.0, 0.0))
                z = (max(0.0, zp) if rise_p >= cfg.mu_min_pp else 0.0, max(0.0, zo) if rise_o >= cfg.mu_min_pp else 0.0)
                if sum(z) > sum(bz):
                    best, bz = n, z
            s, ev = _score(x, pref, oref, (bz[0], bz[1], 0.0), cfg)
            cause = CLASS_CAUSE["compute" if late else cls]
            if best and max(bz) >= cfg.mu_z_significant:
                cause = RESOURCE_CAUSE[best]
            if cause == "waiting":
                s *= cfg.waiting_weight
            causes.append({"kind": "function", "id": label(k), **who(r, d), "cause": cause,
                           "score": round(s, 1), "evidence": {"beta": round(x, 4), "class": cls, "mu": best,
                                                              "file": key_file(k), **({"late": True} if late else {}),
                                                              **ev}})
    causes.sort(key=lambda c: -c["score"])
    by_rank: dict[str, float] = {}
    for c in causes:
        k = proc_name(c["rank"], c["node"], c["pid"])
        by_rank[k] = max(by_rank.get(k, 0.0), c["score"])
    return {"causes": causes[:cfg.top], "ranks": dict(sorted(by_rank.items(), key=lambda x: -x[1])),
            "roles": {proc_name(r, ranks[r].node, ranks[r].pid): [proc_name(q, ranks[q].node, ranks[q].pid)
                                                                     for q in p] for r, p in peers.items()}}


def who(key: int, d: RankData) -> dict:
    """A candidate's process: its rank (-1 for a process of no rank), node and pid."""
    return {"rank": key if key >= 0 else -1, "node": d.node, "pid": d.pid}


def proc_name(rank: int, node: str, pid: int) -> str:
    """How rank_causes' "ranks" and "roles" name a process: its rank, or "node:pid" where it has none."""
    return str(rank) if rank >= 0 else f"{node}:{pid}"


# -- resources from what the store holds ------------------------------------------------------------------------

def interval_shares(points: list[tuple[int, float]], a: int, b: int) -> list[float]:
    """A cumulative seconds counter as the share of wall time in each interval between two samples in [a, b]."""
    pts = [p for p in points if a <= p[0] <= b]
    out = []
    for (t0, v0), (t1, v1) in zip(pts, pts[1:]):
        if t1 > t0 and v1 >= v0:
            out.append(min(1.0, (v1 - v0) / ((t1 - t0) / 1e9)))
    return out


def lost_shares(points: list[tuple[int, float]], a: int, b: int) -> list[float]:
    """A process's allowed CPUs (process_cpus_allowed, a gauge) as the share of them it lost at each sample in [a, b]:
    1 - allowed / the most it was allowed in `points` (both windows: a pin to one of two cores is 0.5)."""
    top = max((v for _, v in points), default=0.0)
    return [max(0.0, 1.0 - v / top) for t, v in points if a <= t <= b] if top > 0 else []


def stopped_shares(spans: list[tuple[int, int]], a: int, b: int, width_ns: int = 10**9) -> list[float]:
    """Per 1 s bin of [a, b), the share of it inside the stopped spans."""
    out = []
    for lo, hi in bins(a, b, width_ns):
        cover = sum(max(0, min(hi, s1) - max(lo, s0)) for s0, s1 in spans)
        out.append(min(1.0, cover / (hi - lo)))
    return out


def network_links(rows: list[dict], a: int, b: int, addresses: set[str], top: int = 4) -> list[dict]:
    """The connections with one of `addresses` at an end, by their network-limited share in [a, b], most first:
    which link a network cause means (both ends of a shaped link show it; the link names them both)."""
    acc: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if not (a <= r["end_ns"] <= b) or r["end_ns"] <= r["start_ns"]:
            continue
        if r.get("src") not in addresses and r.get("dst") not in addresses:
            continue
        key = tuple(sorted((r.get("src") or "", r.get("dst") or "")))
        acc.setdefault(key, []).append(min(1.0, (r.get("net_limited_us") or 0) * 1000 / (r["end_ns"] - r["start_ns"])))
    out = [{"a": k[0], "b": k[1], "net_limited_share": round(statistics.fmean(v), 3)} for k, v in acc.items()]
    return sorted(out, key=lambda x: -x["net_limited_share"])[:top]


def network_shares(rows: list[dict], a: int, b: int, addresses: set[str] | None = None) -> list[float]:
    """Connections (tcpinfo/netflows ConnStats) in [a, b]: per row, the share of its interval its sender was held
    back by the network (net_limited_us). With `addresses`, the rows that have one of them at either end (a node's
    own connections and its peers' connections to it: a shaped link slows both directions)."""
    out = []
    for r in rows:
        if not (a <= r["end_ns"] <= b) or r["end_ns"] <= r["start_ns"]:
            continue
        if addresses is not None and r.get("src") not in addresses and r.get("dst") not in addresses:
            continue
        out.append(min(1.0, (r.get("net_limited_us") or 0) * 1000 / (r["end_ns"] - r["start_ns"])))
    return out
