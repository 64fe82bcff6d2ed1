"""Communication-operator-graph localization (Holmes §4.3, ALGORITHMS.md §3.6) with progressive fetching.

Used by the irregularity detector per episode, beside the arrival skew (evidence `cog`); not a detector. It walks
the grouped operator graph backwards from the pivot rank's abnormal operators in the episode's worst flagged
steps, fetching CommOps (AnalysisReader.fetch_commops -> FetchDetail) only from the ranks the walk visits:
  collective  the instance's last arrival g (the member the others waited for) is read from the step summaries
              (issue offsets per call, no fetch); when the members arrived together (spread < tie) and the op is
              abnormal, the group's transfer is slow: NETWORK on the communicator. Otherwise g's ops before its
              instance in that step, nearest first: the first abnormal one is followed (g waited for someone
              else); none: COMPUTE on g.
  recv        the peer's matching send (comm, p2p_seq): its transfer (end - max(send start, recv start)) longer
              than the pair's reference -> NETWORK on the pair; else the peer's ops before the send: the first
              abnormal one is followed; none: COMPUTE on the peer (the printed pseudocode's missing case).
  send        abnormal only by waiting for its receiver or by a slow transfer: the transfer decides as for recv,
              else the receiver's ops before its recv are searched.
Abnormal = the operator model's verdict (opmodel.OperatorModel, LightGBM, labels bootstrapped from the gate's
flagged steps and cross-rank waits), fitted on the pivot's fetched ops, or the bootstrap rule on the visited
rank's own history (opmodel.bootstrap_labels: > Q3 + 3 IQR of its identity in a flagged step): a model fitted
on one victim rank knows its long waits, not another rank's; where it cannot train (too few steps, one
class), the rule alone, and the evidence says which. Errata handled
(§3.6): all preceding ops are scanned (nearest abnormal followed), the P2P branch ends in COMPUTE on the peer,
a visited set guards cycles, depth is bounded.
Result: causes voted over the analysed (step, abnormal op) walks, best first: ("rank", r, votes, "compute") or
("comm"/"pair", id, votes, "network"), the ranks fetched (progressive fetching: usually a handful of a job's
ranks) and the path of the best walk.
Cost: one fetch per visited rank over the reference + analysed steps (max_ranks), one model fit on the pivot's
ops (30 trees: ~1 s on an 8,192-GPU job's rank, 33 steps x ~140 ops, on this loaded 2-core VM), predictions
per visited rank.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from steplens.collector.analysis.probe import P2P, op_start
from steplens.collector.analysis.probe import peer as peer_of


@dataclass
class CogConfig:
    ref_steps: int = 30          # steps before the episode fetched as each visited rank's history
    max_steps: int = 3           # flagged steps walked (the worst ones)
    ops_per_step: int = 2        # abnormal pivot ops walked per step (longest first)
    max_ranks: int = 16          # ranks fetched at most per search
    max_depth: int = 12          # hops per walk
    tie_fraction: float = 0.02   # members' arrival spread below this share of the op's duration: together
    pivot_rank: int = -1         # the walk starts here; -1: the lowest rank
    trees: int = 30              # boosting rounds of the operator model fitted on the pivot (100: ~4x the time)


@dataclass
class CogResult:
    causes: list = field(default_factory=list)     # [(kind, id, votes, cause)], best first
    ranks_fetched: list = field(default_factory=list)
    path: list = field(default_factory=list)       # the first walk's hops: "rank:comm:op"
    classifier: str = ""
    note: str = ""

    def evidence(self) -> dict:
        return {"causes": [list(c) for c in self.causes[:5]], "ranks_fetched": len(self.ranks_fetched),
                "path": self.path[:12], "classifier": self.classifier, **({"note": self.note} if self.note else {})}


class _Search:
    def __init__(self, reader, job_key: str, js, flagged: list[int], ref: list[int], cfg: CogConfig,
                 flagged_numbers: set[int]) -> None:
        self.reader, self.job_key, self.js, self.cfg = reader, job_key, js, cfg
        self.steps = sorted(set(ref) | set(flagged))
        self.span = (min(js.start_ns[i] for i in self.steps), max(js.end_ns[i] for i in self.steps))
        self.flagged_numbers = flagged_numbers
        self.ops: dict[int, list[dict]] = {}          # rank -> its fetched ops, issue order
        self.abn: dict[int, list[float]] = {}         # rank -> P(abnormal) per op
        self.model = None
        self.classifier = ""

    def steps_of(self, rank: int) -> list[tuple[int, int, int]]:
        rows = self.js.rows.get(rank, {})
        return [(s, rows[s]["start_ns"], rows[s]["end_ns"]) for s in (self.js.numbers[i] for i in self.steps)
                if s in rows]

    def fetch(self, rank: int) -> bool:
        if rank in self.ops:
            return True
        if len(self.ops) >= self.cfg.max_ranks:
            return False
        rows = self.reader.fetch_commops(self.job_key, [rank], *self.span)
        mine = sorted((r for r in rows if r.get("rank") == rank and r.get("kind", "commop") == "commop"),
                      key=op_start)
        self.ops[rank] = mine
        self.abn[rank] = self.classify(rank)
        return True

    def classify(self, rank: int) -> list[float]:
        from steplens.collector.analysis import opmodel
        ops, steps = {rank: self.ops[rank]}, {rank: self.steps_of(rank)}
        if self.model is None:  # fitted once, on the pivot (the first rank fetched); 30 trees: one rank's ops
            self.model = opmodel.OperatorModel(opmodel.OpModelConfig(trees=self.cfg.trees))
            got = self.model.fit(ops, steps, self.flagged_numbers)
            self.classifier = "lightgbm" if got["trained"] else f"bootstrap rule ({got['reason'][:80]})"
        rule = opmodel.bootstrap_labels(ops, steps, self.flagged_numbers)[rank]
        p = self.model.predict(ops, steps)[rank] if self.model.ready else rule

        def val(v):
            return 0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)
        # the model learnt from the pivot's ops (a victim: its long ops are waits in the final collective); on
        # another rank, an op its own history marks abnormal in a flagged step (the bootstrap rule) counts too
        return [max(val(a), val(b)) for a, b in zip(p, rule)]

    def in_step(self, rank: int, i: int) -> list[int]:
        """Indexes of rank's ops issued within step index i (its own step boundaries)."""
        row = self.js.rows.get(rank, {}).get(self.js.numbers[i])
        if row is None:
            return []
        return [k for k, o in enumerate(self.ops[rank]) if row["start_ns"] <= op_start(o) <= row["end_ns"]]

    def last_arrival(self, rank: int, k: int, i: int) -> tuple[int, float]:
        """The member of op k's collective instance that arrived last (from the step summaries: the call's
        issue offset per member), and the arrival spread as a share of the op's duration."""
        op = self.ops[rank][k]
        s = self.js.numbers[i]
        nth = sum(1 for j in self.in_step(rank, i) if j < k and self.ops[rank][j]["comm_id"] == op["comm_id"]
                  and self.ops[rank][j]["op"] == op["op"])
        arr = []
        for m in op.get("members") or []:
            row = self.js.rows.get(m, {}).get(s)
            c = next((c for c in (row or {}).get("comms", ()) if c["comm_id"] == op["comm_id"]
                      and c["op"] == op["op"]), None)
            if c is not None and nth < len(c["issue_offsets_ns"]):
                arr.append((row["start_ns"] + c["issue_offsets_ns"][nth], m))
        if len(arr) < len(op.get("members") or ()):  # offsets not summarized (dropped): fetch the members
            arr = []
            for m in op.get("members") or []:
                if not self.fetch(m):
                    break
                inst = self._instance(m, op, i)
                if inst >= 0:
                    arr.append((op_start(self.ops[m][inst]), m))
        if len(arr) < 2:
            return -1, 0.0
        arr.sort()
        dur = max(1, op["end_ns"] - op_start(op))
        return arr[-1][1], (arr[-1][0] - arr[(len(arr) - 1) // 2][0]) / dur

    def transfer_slow(self, send: dict, recv_start: int, rank: int) -> bool:
        """The send's transfer against the same pair's sends in the reference (non-flagged) steps."""
        same = [o for o in self.ops[rank] if o["comm_id"] == send["comm_id"] and o["op"] == "send"
                and o is not send]
        ref = sorted(o["end_ns"] - op_start(o) for o in same)
        if len(ref) < 4:
            return False
        med = ref[len(ref) // 2]
        return max(0, send["end_ns"] - max(op_start(send), recv_start)) > 1.5 * med + 20_000

    def walk(self, rank: int, k: int, i: int, seen: set, path: list, depth: int = 0) -> tuple:
        op = self.ops[rank][k]
        path.append(f"{rank}:{op['comm_id']}:{op['op']}")
        if depth >= self.cfg.max_depth or (rank, k) in seen:
            return ("rank", str(rank), "compute")
        seen.add((rank, k))
        if op["op"] not in P2P:
            g, spread = self.last_arrival(rank, k, i)
            if g < 0:
                return ("comm", op["comm_id"], "network")
            if spread < self.cfg.tie_fraction:
                return ("comm", op["comm_id"], "network")
            if g != rank and not self.fetch(g):
                return ("rank", str(g), "compute")
            return self.before(g, self._instance(g, op, i), i, seen, path, depth)
        peer = peer_of(op)
        if peer < 0 or not self.fetch(peer):
            return ("rank", str(peer), "compute") if peer >= 0 else ("pair", op["comm_id"], "network")
        match = next((j for j in self.in_step(peer, i) if self.ops[peer][j]["comm_id"] == op["comm_id"]
                      and self.ops[peer][j].get("p2p_seq") == op.get("p2p_seq")), None)
        if match is None:
            return ("rank", str(peer), "compute")
        other = self.ops[peer][match]
        send, recv, sender = (other, op, peer) if op["op"] == "recv" else (op, other, rank)
        if self.transfer_slow(send, op_start(recv), sender):
            return ("pair", op["comm_id"], "network")
        return self.before(peer, match, i, seen, path, depth)  # the sender (recv) or the receiver (send)

    def _instance(self, g: int, op: dict, i: int) -> int:
        for j in self.in_step(g, i):
            o = self.ops[g][j]
            if o["comm_id"] == op["comm_id"] and o["op"] == op["op"] and o.get("seq") == op.get("seq"):
                return j
        return -1

    def before(self, rank: int, k: int, i: int, seen: set, path: list, depth: int) -> tuple:
        """Rank's ops before op k in step i, nearest first: follow the first abnormal one; none: COMPUTE."""
        if k < 0:
            return ("rank", str(rank), "compute")
        for j in sorted((j for j in self.in_step(rank, i) if j < k), reverse=True):
            if self.abn[rank][j] >= 0.5:
                return self.walk(rank, j, i, seen, path, depth + 1)
        return ("rank", str(rank), "compute")


def search(reader, job_key: str, js, flagged: list[int], ref: list[int], ratio: list[float],
           cfg: CogConfig | None = None) -> CogResult:
    """Walks from the pivot's abnormal ops in the worst flagged steps (ratio: the gate's per-step ratio)."""
    cfg = cfg or CogConfig()
    res = CogResult()
    if getattr(reader, "fetch_commops", None) is None:
        res.note = "no progressive fetching on this reader"
        return res
    ref = ref[-cfg.ref_steps:]
    if not flagged or len(ref) < 8:
        res.note = "too few reference steps"
        return res
    worst = sorted(flagged, key=lambda i: -ratio[i])[:cfg.max_steps]
    s = _Search(reader, job_key, js, worst, ref, cfg, {js.numbers[i] for i in flagged})
    pivot = cfg.pivot_rank if cfg.pivot_rank >= 0 else min(js.rows)
    votes: Counter = Counter()
    kinds: dict = {}
    try:
        s.fetch(pivot)
        for i in worst:
            idx = s.in_step(pivot, i)
            cand = sorted((k for k in idx if s.abn[pivot][k] >= 0.5),
                          key=lambda k: -(s.ops[pivot][k]["end_ns"] - op_start(s.ops[pivot][k])))[:cfg.ops_per_step]
            for k in cand:
                path: list = []
                kind, did, why = s.walk(pivot, k, i, set(), path)
                votes[(kind, did)] += 1
                kinds[(kind, did)] = why
                if not res.path:
                    res.path = path
    except Exception as exc:  # FetchUnavailable, an agent that did not answer: say why, keep what was found
        res.note = f"fetch failed: {exc}"[:200]
    res.causes = [(k, d, n, kinds[(k, d)]) for (k, d), n in votes.most_common()]
    res.ranks_fetched = sorted(s.ops)
    res.classifier = s.classifier
    return res
