"""Point-to-point probing: which pipeline pairs transfer slowly, from CommOps fetched on demand.

A slow collective communicator implicates every device on its ring alike (a ring runs at its slowest link's
pace), so the step summaries alone cannot tell which NIC link or switch of the ring is bad. The sends of a
rank to its pipeline peers cross its own NIC and the switches between the two, one pair at a time: a pair
whose transfers got slower points at the devices on its own path. This module fetches (progressive fetching,
AnalysisReader.fetch_commops -> FetchDetail on the agents of those ranks only) the CommOps of the ranks on the
tied candidate devices, for a reference span before the onset and for the slow span, and returns the slow and
healthy pairs as two-member "communicators" that irregularity.score_devices scores beside the collective ones.

Transfer time of one send: end - max(start, the matching recv's start when the peer's ops were fetched too,
matched by comm and p2p_seq) - the part of a send that only waited for its receiver is not transfer. A pair
(comm, sender, receiver) is slow when the median of its transfer times in the slow span exceeds the median in
the reference span by >= max((ratio - 1) x that median, noise_k x the noise of a median, min_excess_ns), the
noise being the reference's robust spread (1.4826 x MAD) over sqrt(steps in the slow span) (a fabric's
transfers jitter by a few % from one iteration to the next); healthy when both spans have >= 3 sends and it
is not slow. Peers: the other member of a two-member communicator, else members[peer] (FR's peer is a group
rank).
Used by irregularity.network_suspects and commtime.detect only when the best network suspects tie (within
`tie` of the best score): that is when the ring alone cannot decide. Where fetching is unavailable (a store
without agents) the tie stays and the evidence says why.
Cost: two fetches of <= max_ranks ranks x the spans' ops a round (irregularity.refine runs up to its `rounds`,
each only while the suspects still tie); the analysis itself is one pass over them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median

P2P = ("send", "recv")


@dataclass
class ProbeResult:
    slow: dict[str, float] = field(default_factory=dict)         # pair id -> transfer-time ratio
    members: dict[str, set[int]] = field(default_factory=dict)   # pair id -> {sender, receiver}, every pair seen
    ranks_fetched: list[int] = field(default_factory=list)
    ops: int = 0
    note: str = ""
    rounds: int = 0

    def evidence(self) -> dict:
        worst = sorted(self.slow, key=lambda p: -self.slow[p])[:10]
        return {"ranks_fetched": len(self.ranks_fetched), "ops_fetched": self.ops, "pairs": len(self.members),
                "slow_pairs": {p: round(self.slow[p], 3) for p in worst}, **({"rounds": self.rounds} if
                                                                              self.rounds > 1 else {}),
                **({"note": self.note} if self.note else {})}

    def merge(self, other: "ProbeResult") -> None:
        """Another round's result into this one (pairs seen again: the later round's verdict)."""
        self.slow = {p: v for p, v in self.slow.items() if p not in other.members} | other.slow
        self.members |= other.members
        self.ranks_fetched += other.ranks_fetched
        self.ops += other.ops
        self.note = other.note or self.note
        self.rounds += 1


def op_start(op: dict) -> int:
    """A fetched CommOp's start (its issue time when the start is unknown)."""
    return op.get("start_ns") or op.get("issue_ns") or 0


def peer(op: dict) -> int:
    """The global rank at the other end of a point-to-point op (FR's peer is a group rank), -1 if unknown."""
    mem = op.get("members") or []
    if len(mem) == 2 and op.get("rank") in mem:
        return mem[0] if mem[1] == op["rank"] else mem[1]
    p = op.get("peer", -1)
    return mem[p] if mem and 0 <= p < len(mem) else -1


def transfers(rows: list[dict]) -> dict[tuple[str, int, int], list[int]]:
    """(comm, sender, receiver) -> transfer times (ns) of the sends among rows (fetched CommOp dicts)."""
    recv_start: dict[tuple[str, int, int, int], int] = {}
    sends = []
    for r in rows:
        if r.get("kind", "commop") != "commop" or r.get("op") not in P2P:
            continue
        other = peer(r)
        if other < 0:
            continue
        start = op_start(r)
        if r["op"] == "recv":
            recv_start[(r["comm_id"], other, r["rank"], r.get("p2p_seq", -1))] = start
        elif r.get("end_ns", 0) > start > 0:
            sends.append((r["comm_id"], r["rank"], other, r.get("p2p_seq", -1), start, r["end_ns"]))
    out: dict[tuple[str, int, int], list[int]] = {}
    for cid, a, b, seq, start, end in sends:
        rs = recv_start.get((cid, a, b, seq), 0) if seq >= 0 else 0
        out.setdefault((cid, a, b), []).append(max(0, end - max(start, rs)))
    return out


def _within(rows: list[dict], spans: list[tuple[int, int]]) -> list[dict]:
    spans = sorted(spans)
    return [r for r in rows if any(a <= op_start(r) <= b for a, b in spans)]


def probe(reader, job_key: str, ranks: list[int], ref_spans: list[tuple[int, int]],
          bad_spans: list[tuple[int, int]], ratio: float = 1.05, min_excess_ns: int = 20_000,
          max_ranks: int = 64, noise_k: float = 4.0) -> ProbeResult:
    """Slow and healthy pipeline pairs among the sends of `ranks` (at most max_ranks, in the order given);
    spans are (start_ns, end_ns) of steps, cluster time: one fetch covers each side's spans, ops outside
    them (steps between flagged ones) are left out."""
    res = ProbeResult()
    fetch = getattr(reader, "fetch_commops", None)
    if fetch is None:
        res.note = "no progressive fetching on this reader"
        return res
    want = list(dict.fromkeys(ranks))[:max_ranks]
    try:
        ref = _within(fetch(job_key, want, min(a for a, _ in ref_spans), max(b for _, b in ref_spans)), ref_spans)
        bad = _within(fetch(job_key, want, min(a for a, _ in bad_spans), max(b for _, b in bad_spans)), bad_spans)
    except Exception as exc:  # FetchUnavailable, an agent that did not answer: the tie stays, said why
        res.note = f"fetch failed: {exc}"[:200]
        return res
    res.ranks_fetched, res.ops = want, len(ref) + len(bad)
    t_ref, t_bad = transfers(ref), transfers(bad)
    for key, before in t_ref.items():
        now = t_bad.get(key)
        if not now or len(before) < 3 or len(now) < 3:
            continue
        cid, a, b = key
        pid = f"p2p:{cid}:{a}>{b}"
        res.members[pid] = {a, b}
        mb, mn = median(before), median(now)
        # noise of the slow span's median: the reference's spread (1.4826 x MAD), over sqrt of the steps it
        # spans (a step's sends share that step's network conditions: steps are the samples)
        sigma = 1.4826 * median(abs(x - mb) for x in before) * 1.2533 / math.sqrt(max(1, len(bad_spans)))
        if mb > 0 and mn - mb >= max((ratio - 1.0) * mb, noise_k * sigma, min_excess_ns):
            res.slow[pid] = mn / mb
    return res


def tied(suspects: list, tie: float = 0.05) -> list:
    """The network suspects whose score is within `tie` of the best (best first); [] when one stands out."""
    net = sorted((s for s in suspects if s.cause == "network"), key=lambda s: -s.score)
    if len(net) < 2:
        return []
    top = [s for s in net if s.score >= (1 - tie) * net[0].score]
    return top if len(top) >= 2 else []


def _nics_under(topo, kind: str, dev: str) -> set[str]:
    """NIC ids whose traffic may use a device: a NIC link itself; the NICs a switch serves (a switch above the
    leaves: the NICs of the leaves below it); a switch-to-switch link: those of its lower end."""
    if topo is None:
        return set()
    if kind == "link" and dev in topo.nics:
        return {dev}
    if kind == "link" and dev in topo.links:
        ln = topo.links[dev]
        return _nics_under(topo, "switch", ln.a) | _nics_under(topo, "switch", ln.b) \
            if not any(n.switch in (ln.a, ln.b) for n in topo.nics.values()) else \
            {n.id for n in topo.nics.values() if n.switch in (ln.a, ln.b)}
    if kind == "switch" and dev in topo.switches:
        direct = {n.id for n in topo.nics.values() if n.switch == dev}
        if direct:
            return direct
        return {n.id for t, _ in topo.neighbours(dev) for n in topo.nics.values() if n.switch == t}
    return set()


def by_coverage(ranks: list[int], devices: list, topo, nic_of: dict[int, str], node_of: dict[int, str],
                members: dict[str, set[int]]) -> list[int]:
    """`ranks` reordered so that each fetch round reaches as many candidate devices as it can: a rank's sends
    cross its own NIC and its pipeline peers' (the other member of each two-member communicator it is in), so a
    rank whose every such NIC (or node) is already reached by an earlier rank of the order comes later. Greedy,
    in passes over the given order (ties keep ranks_on's interleaving)."""
    want: set[str] = set()
    for d in devices:
        want |= {f"node:{d.id}"} if d.kind == "node" else _nics_under(topo, d.kind, d.id)
    peers: dict[int, set[int]] = {}
    for mem in members.values():
        if len(mem) == 2:
            a, b = sorted(mem)
            peers.setdefault(a, set()).add(b)
            peers.setdefault(b, set()).add(a)

    def reach(r: int) -> set[str]:
        out = set()
        for x in (r, *peers.get(r, ())):
            out |= {nic_of.get(x, ""), f"node:{node_of.get(x, '')}"}
        return out & want
    reaches = {r: reach(r) for r in ranks}
    left, out, seen = list(dict.fromkeys(ranks)), [], set()
    while left:
        taken = set()
        for r in left:   # a pass: each rank that still reaches something new, in order
            if reaches[r] - seen:
                taken.add(r)
                out.append(r)
                seen |= reaches[r]
        if not taken:
            return out + left
        left = [r for r in left if r not in taken]
    return out


def ranks_on(devices: list, topo, nic_of: dict[int, str], node_of: dict[int, str], among: set[int]) -> list[int]:
    """Ranks (of `among`) whose NIC is a candidate link, sits below a candidate switch or switch link, or on a
    candidate node; interleaved across the candidates so a cap keeps some of each."""
    per: list[list[int]] = []
    for d in devices:
        if d.kind == "node":
            per.append([r for r in sorted(among) if node_of.get(r) == d.id])
        else:
            nics = _nics_under(topo, d.kind, d.id)
            per.append([r for r in sorted(among) if nic_of.get(r) in nics])
    out: list[int] = []
    for i in range(max((len(p) for p in per), default=0)):
        for p in per:
            if i < len(p) and p[i] not in out:
                out.append(p[i])
    return out
