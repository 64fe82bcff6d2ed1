"""The δ-irregularity gate per job and its kinds (Holmes §3.2-3.3), localized by cross-rank arrival skew.

Reads the window's Step records (steps table, with their per-communicator summaries) and, for network
suspects, the stored topology and the job's processes (rank -> node, local rank -> GPU -> NIC); nothing else.
Pure: `detect(reader, window, cfg) -> list[Finding]`, no writes, no clock, no state across windows.

Gate. The job's step time of step s is the max over its ranks of end_ns - start_ns (or the pivot rank's, with
pivot_rank >= 0), over steps that most ranks have reported (a step still arriving is left out). Step s is
flagged when it is >= delta x the baseline: the median of the last baseline_steps non-flagged steps (Holmes'
trailing window, REC W = 100, flagged steps excluded so the baseline is not contaminated; median, not mean,
so a lone outlier that slipped under delta does not move it).
Kinds (ALGORITHMS.md §3.3's [VAGUE→REC] classifier, adapted to what a finding needs):
  degradation  a run of flagged steps (gaps of one step allowed) of >= degradation_steps whose median ratio is
               >= delta: a level shift. The baseline is then re-taken from the new level (so spikes on top of it
               are seen); the state lasts while the median of the last degradation_steps steps stays >= delta x
               the level before it, and its finding is re-confirmed until then (then it resolves itself);
  slowdown     such a run shorter than degradation_steps (a transient slowdown, or a level shift still too
               young to call one); also a persistent straggler below the gate (see below);
  fluctuation  within fluctuation_steps steps, >= fluctuation_fraction of them flagged in >= 3 separate runs,
               with a periodic component (a DFT peak of the ratio series, period 2..50 steps, power >= 
               periodic_power x the mean power) or a small mean excess (< spike_ratio);
  spike        a run of <= spike_max_run flagged steps with ratio >= spike_ratio outside the states above,
               once a step after it was not flagged (one still going may be a slowdown's first steps).
Severity: the step-time ratio against the job's baseline (peak of the finding's steps; for a state still on,
the median of its last steps).
Suspects, best first, from the finding's flagged steps F against the window's healthy steps H:
  compute  arrival skew per collective ("who arrives last keeps the others waiting"): for each communicator
           that is not point-to-point and its k-th collective in a step, the members' arrivals are
           start_ns + issue_offsets_ns[k]; the last one (ties shared) takes the blame. late(r, c) = the share
           of c's collectives r was last in during F, minus the same during H. A rank late into every
           collective it joins computes slowly: cause `compute`, score = its mean late(r, c); a rank late only
           into some (its group waited for someone upstream) keeps half of it, cause `waiting`. "Every" is
           judged by a z of its last-arrival share per communicator (against chance; for a small group over
           few steps, 0.8 x the most those steps allow), or, where being last is diluted by back-to-back
           collectives, by its margins: later than the members' median into each of its communicators in
           >= 90 % of the slow steps, by >= 1 % of the step over the reference (late_every_step()). A rank
           late into every collective because its pipeline input came late is `waiting` (half its score): its
           receives grew by >= recv_wait_share x the job's excess step time (pipeline_victims()).
  network  a communicator whose transfer time (min over members of busy_ns: the member that waited least
           spent only the transfer) is >= comm_slow_ratio x its H median, by at least comm_slow_min_fraction
           of the baseline step, is slow. Every device on its member paths (ring order of the sorted members;
           NICs, switches and links from the topology's equal-cost paths, 1/#paths each) is scored
           precision x recall: the share of the communicators using it that are slow, times the share of the
           slow ones it is on, times 1/(1 + 0.01 x downstream NICs) for a switch (a mild tie-break, not
           Holmes' H(d): see "Ranking" below); cause `network`. Without a stored topology the devices are the
           members' nodes. A switch all of whose (>= 2) switch links are suspected alike, above it, takes
           their score: one bad switch explains them all (a congested leaf slows both its uplinks equally).
           Tied best devices (a ring's links) are re-scored with measured pipeline-pair transfers fetched
           from the ranks on them only (refine(), probe.py: progressive fetching; evidence `probe` says how
           many ranks were fetched); NIC links still tied then, by their own ports' counters (ports.py:
           a degraded port leads; evidence `port`); a NIC link on top whose leaf its NICs' transmit wait
           shows congested gives way to the leaf (ports.promote_leaf).
  order    compute suspects, then network devices, then `waiting` ranks (an effect, not a cause), each by score.
  causes   concurrent root causes get one finding each (causes()): a second rank late into every collective it
           joins with >= half the best compute score, and the best network device when the top is a GPU; the
           extra findings lead with their own suspect and name the first in `concurrent_with`; a rank that
           leads one of several findings has its own onset, where its lateness began (own_onset()).
  persistent straggler (slowdown below the gate): over the last straggler_steps steps, a rank late into
           every collective communicator it joins: per comm, its per-step margin over the members' median
           arrival (its mean, or its median under heavy-tailed jitter: lateness_z) has z >= straggler_z_every
           (>= straggler_z in one; steps as samples), and it keeps its groups waiting >= straggler_min_fraction
           of the step time per step in all (stragglers()): kind `slowdown`, cause `compute`.
Operator graph: with progressive fetching (an AnalysisReader with agents), each episode is also walked on the
           grouped communication-operator graph from the pivot's abnormal ops (cog.py, Holmes §4.3 with its
           errata fixed, abnormal ops from the LightGBM operator model): evidence `cog` (causes, path, ranks
           fetched), beside the skew's ranking, not ordering it.
Reference for the skew: the healthy steps before the finding's first flagged step; for a degradation, before
its ramp (ramp_onset: the unflagged steps just before it whose ratio is already >= 1 + ramp_fraction x
(delta - 1) carry the slow rank's lateness, and taking them as healthy hid a one-rank degradation's rank).
Ranks are global ranks ("13"); NICs, links and switches are the topology file's ids.
Ranking: suspects are ranked within one finding (one episode) by the scores above. Holmes' cross-iteration
MAP ranking (§3.7, Σ R·H(d) + α·p(d) with the erratum-fixed decay H(d) = ln(1 + C)/(C ln 2): devrank.py) is
computed beside it for every episode (map_ranking(), evidence `map`) and scored by bench/eval
(`map_top1_of_faults`): it ranks a slow GPU first as well, but ties a ring's links and puts a congested leaf
under its own NIC links (H(d) divides the leaf's sum by the NICs below it), so it does not order the suspects.
Assumptions: rings follow sorted member order (NCCL's real ring order is not in the store); with ECMP every
equal-cost path is weighted alike, so a single bad spine is not told apart from its peers.
Cost: O(ranks x steps x collectives) in plain Python (no numpy in this package): ~0.3 s for 512 ranks x 100
steps here; the offsets used per communicator and step are capped at max_collectives_per_step, and lowered so
ranks x PICK_STEPS x offsets stays under max_arrivals (collective_picks: 3 per step at 8,192 ranks).
load() keeps its last result on the reader, so the detectors of one pass parse the Step rows once, and each
step's per-step results (arrival margins, skew, transfer times) are kept across the loop's passes in the
engine's per-job memo (per_step), so a pass computes its new steps only. Measured for all detectors at 8,192
GPUs (bench/eval/scale.py, 20 scenarios): one pass from cold over 60 steps median 7.4 s (max 13.4 s), the loop's
passes every 5 steps median 3.3 s (max 5.6 s, in a pass that localizes an episode).
"""

from __future__ import annotations

import cmath
import math
from collections import deque
from dataclasses import dataclass, field
from operator import itemgetter, sub
from statistics import median

import numpy as np

from steplens.collector.analysis import cog, devrank, ports, probe
from steplens.collector.analysis.base import ConfigError, DetectorConfig, DetectorSpec, Window
from steplens.collector.analysis.findings import Finding, Suspect
from steplens.collector.analysis.steptime import EVIDENCE_RANK

P2P_OPS = ("send", "recv", "sendrecv")
SEND = "#send"   # key suffix of a point-to-point communicator's sends (agent/steps.py summarizes them apart)


def comm_key(c: dict) -> str:
    """A StepComm's key: the comm id of a collective; `<comm id>#send` / `#recv` for point-to-point ops."""
    return c["comm_id"] if c["op"] not in P2P_OPS else f"{c['comm_id']}#{c['op']}"


@dataclass
class IrregularityConfig(DetectorConfig):
    delta: float = 1.1                     # a step >= delta x baseline is flagged (Holmes default)
    baseline_steps: int = 100              # W: trailing non-flagged steps in the baseline
    min_baseline_steps: int = 10           # no verdict before this many baseline steps
    pivot_rank: int = -1                   # >= 0: the job step time is this rank's; -1: max over ranks
    complete_fraction: float = 0.9         # a step counts once this share of the ranks has reported it
    spike_ratio: float = 1.25              # an isolated flag this far above baseline is a spike
    spike_max_run: int = 3                 # flagged steps in a row still called isolated
    degradation_steps: int = 10            # a sustained run this long is a level shift
    fluctuation_steps: int = 100           # window of the flagged-fraction test
    fluctuation_fraction: float = 0.05     # share of flagged steps in it
    periodic_power: float = 8.0            # DFT peak over mean power: periodic
    comm_slow_ratio: float = 1.2           # a communicator's transfer time this much above healthy: slow
    comm_slow_min_fraction: float = 0.01   # ... and by at least this share of the baseline step
    straggler_steps: int = 50              # steps of the persistent-straggler test
    straggler_min_fraction: float = 0.01   # waiting it causes per step, all its groups: this share of the step
    straggler_z: float = 6.0               # z of its per-step mean arrival margin, in one of its groups at least
    straggler_z_every: float = 3.0         # ... and at least this in every collective group it joins
    max_collectives_per_step: int = 16     # issue offsets used per communicator and step (evenly spread)
    max_arrivals: int = 500_000            # ranks x 20 steps x offsets at most (fewer offsets per step if more)
    max_suspects: int = 5
    cog: bool = True                       # walk the operator graph from the pivot (cog.py, progressive fetching)
    ramp_fraction: float = 0.25            # a step before a degradation with ratio >= 1 + this x (delta - 1) is
                                           # part of its ramp: left out of the pre-onset reference
    recv_wait_share: float = 0.5           # a late rank whose pipeline receives grew by this x the job's excess
                                           # step time waited for its stage peers: `waiting`, not `compute`
    port_counters: bool = True             # NIC links still tied: their ports' counters decide (ports.py defaults)

    def validate(self) -> None:
        super().validate()
        if not 1.0 < self.delta <= 10.0:
            raise ConfigError(f"delta must be within (1, 10], got {self.delta}")
        if not 2 <= self.min_baseline_steps <= self.baseline_steps <= 100_000:
            raise ConfigError("need 2 <= min_baseline_steps <= baseline_steps <= 100000")
        if not 0.0 < self.complete_fraction <= 1.0 or not 0.0 < self.fluctuation_fraction < 1.0:
            raise ConfigError("complete_fraction and fluctuation_fraction must be within (0, 1]")
        if self.spike_ratio < self.delta:
            raise ConfigError("spike_ratio must be >= delta")
        for name in ("spike_max_run", "degradation_steps", "fluctuation_steps", "straggler_steps",
                     "max_collectives_per_step", "max_suspects", "max_arrivals"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        if self.degradation_steps <= self.spike_max_run:
            raise ConfigError("degradation_steps must be > spike_max_run")
        for name in ("periodic_power", "comm_slow_ratio", "straggler_z", "straggler_z_every"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if not 0.0 <= self.recv_wait_share <= 10.0:
            raise ConfigError(f"recv_wait_share must be within [0, 10] (0: off), got {self.recv_wait_share}")


# -- data ----------------------------------------------------------------------------------------------

@dataclass
class JobSteps:
    numbers: list[int]                        # steps used, oldest first
    x_ns: list[int]                           # job step time per step
    end_ns: list[int]                         # latest end per step (cluster time)
    start_ns: list[int]                       # earliest start per step
    rows: dict[int, dict[int, dict]]          # rank -> step -> row (with comms)
    node_of: dict[int, str]
    by_step: dict[int, dict] = field(default_factory=dict)  # step index -> groups(): built once, shared
    fps: list[tuple] = field(default_factory=list)  # per step: what its rows are (count, sum of start, end)
    memo: dict = field(default_factory=dict)  # (name, step number) -> (fp, result): per-step results kept
                                              # across passes (the engine's per-job memo), see per_step()
    step_end: dict[int, int] = field(default_factory=dict)  # every step number in rows -> its latest end


def per_step(js: JobSteps, name: str, i: int, compute):
    """compute(i) for step index i, memoized on js.memo by step number and the step's fingerprint: a step's
    per-step result (its communicators' transfer times, its members' arrival margins) is computed once while
    its rows stay the same, so a pass of the loop pays only for the steps that are new since the last one
    (or got rows since). name carries the parameters the result depends on."""
    key = (name, js.numbers[i])
    fp = js.fps[i]
    hit = js.memo.get(key)
    if hit is not None and hit[0] == fp:
        return hit[1]
    v = compute(i)
    js.memo[key] = (fp, v)
    return v


def groups(js: JobSteps, i: int) -> dict[str, tuple[list[int], list[int], list[dict]]]:
    """Step index i's summaries grouped by communicator key (comm_key): key -> (ranks, their step start_ns,
    their comm summaries), parallel lists in rank order. Built once per step and kept on js: skew(), margin_arrays()
    and the commtime detector's transfer_times() read the same steps, and grouping 8,192 ranks' rows is most
    of their cost (parallel lists, not a tuple per member: millions of small tuples kept alive make Python's
    cyclic GC run over them again and again)."""
    g = js.by_step.get(i)
    if g is not None:
        return g
    g = {}
    s = js.numbers[i]
    for rank, steps in js.rows.items():
        row = steps.get(s)
        if row is None:
            continue
        start = row["start_ns"]
        for c in row["comms"]:
            op = c["op"]
            cid = c["comm_id"] if op not in P2P_OPS else f"{c['comm_id']}#{op}"
            grp = g.get(cid)
            if grp is None:
                grp = g[cid] = ([], [], [])
            grp[0].append(rank)
            grp[1].append(start)
            grp[2].append(c)
    js.by_step[i] = g
    return g


def load(reader, window: Window, cfg: IrregularityConfig) -> JobSteps:
    """The window's steps, one series per rank; the last result is kept on the reader (an AnalysisReader lives
    for one pass over a job), so the detectors of one pass read and parse the Step rows once."""
    key = (window, cfg.complete_fraction, cfg.pivot_rank)
    memo = getattr(reader, "_steps_memo", None)
    if memo is not None and memo[0] == key:
        return memo[1]
    js = _load(reader, window, cfg)
    memo = getattr(reader, "step_memo", None)
    if isinstance(memo, dict):  # the engine's per-job memo: per-step results of earlier passes
        js.memo = memo
        if js.numbers:
            first = js.numbers[0]
            # steps that left the window (other users of the memo keep keys of their own shape)
            for k in [k for k in memo if type(k) is tuple and len(k) == 2 and type(k[1]) is int and k[1] < first]:
                del memo[k]
    try:
        reader._steps_memo = (key, js)
    except AttributeError:
        pass
    return js


ROWS_KEY = ("irregularity", "rows")   # the job's Step rows kept in the engine's per-job memo between passes
VIEWS_KEY = ("irregularity", "views")  # the windows' parses (_View) kept beside them
MAX_VIEWS = 4                          # windows kept per job (the detectors of a pass ask for two or three)


def _rows(reader, window: Window) -> dict | None:
    """The job's Step rows kept between passes, brought up to date: with the engine's per-job memo and a store that
    reads incrementally (Reader.steps_after), each pass reads only what was stored since the last one, so no row
    limit cuts a large job's window (8,192 ranks x 60 steps is ~500k rows; Reader.steps keeps the newest 200k) and a
    pass costs what arrived. The kept rows cover the widest window asked for lately (the hang detector reads a
    longer one than irregularity in the same pass): a window reaching further back reads only the older part,
    once. Returns the cache: "rows" by (rank, evidence, source, step) (a row sent again for the same step replaces
    the one before) and "log", every change as (old row or None, new row or None) from absolute position "base"
    on, which the windows' parses (_View) follow. None without the memo or the incremental read."""
    memo = getattr(reader, "step_memo", None)
    after = getattr(reader, "steps_after", None)
    if not isinstance(memo, dict) or not callable(after):
        return None
    cache = memo.get(ROWS_KEY)
    if cache is None:
        new, top = after(window.job_key, 0, since_ns=window.since_ns)
        cache = memo[ROWS_KEY] = {"since": window.since_ns, "rowid": top, "rows": {}, "asked": deque(maxlen=32),
                                  "log": [], "base": 0}
    else:
        new = []
        if window.since_ns < cache["since"]:   # further back than kept: the older part, as of the kept rowid
            older, _ = after(window.job_key, 0, since_ns=window.since_ns, before_ns=cache["since"],
                             upto_rowid=cache["rowid"])
            new += older
            cache["since"] = window.since_ns
        more, cache["rowid"] = after(window.job_key, cache["rowid"], since_ns=cache["since"])
        new += more
    rows, log = cache["rows"], cache["log"]
    for r in new:   # in storage order
        k = (r["rank"], r["evidence"], r.get("source", ""), r["step"])
        log.append((rows.get(k), r))
        rows[k] = r
    cache["asked"].append(window.since_ns)
    floor = min(cache["asked"])
    if floor > cache["since"]:   # no window lately reaches back so far: forget what left them all
        cache["since"] = floor
        for k in [k for k, r in rows.items() if r["end_ns"] < floor]:
            log.append((rows.pop(k), None))
    return cache


class _View:
    """One window's Step rows parsed as load() hands them (one series per rank, the per-step figures), kept
    between the loop's passes and brought up to date by what changed since: the rows stored (new, sent again,
    forgotten; the cache's log) and the window's move (rows its start left behind, rows its end now reaches).
    A pass then costs what arrived and moved (8,192 ranks x 5 new steps), not the ~500k rows of an 8,192-GPU
    window. Each rank's series is a {step: row} dict in end order, replaced (never changed) when it changes, so
    the JobSteps of an earlier pass stay as they were. Ranks are in rank order."""

    def __init__(self, cf: float, pivot: int) -> None:
        self.cf, self.pivot = cf, pivot
        self.since, self.until, self.cursor = 0, -1, 0
        self.win: dict[int, dict[tuple, dict[int, dict]]] = {}  # rank -> (evidence, source) -> {step: row}
        self.key: dict[int, tuple] = {}                         # rank -> its chosen series
        self.node_of: dict[int, str] = {}
        self.by_step: dict[int, dict[tuple, dict]] = {}         # step -> cache key -> row: every window row
        self.low: dict[int, int] = {}                           # step -> its window rows' earliest end
        self.at: dict[int, dict[int, dict]] = {}                # step -> rank -> the rank's chosen row
        self.figs: dict[int, tuple] = {}                        # step -> (rows, x, end, start, fingerprint)
        self.later: dict[tuple, dict] = {}                      # rows ending after the window, by cache key
        self.order: list[int] = []                              # ranks, sorted

    def fits(self, window: Window) -> bool:
        return self.since <= window.since_ns and self.until <= window.until_ns

    def update(self, window: Window, changes) -> None:
        """Bring the parse to `window` (not before the last one) after `changes`, (old, new) row pairs."""
        s1, u1 = window.since_ns, window.until_ns
        self._touched: dict[int, set[int]] = {}    # rank -> steps whose rows changed
        self._copied: set[tuple] = set()           # (rank, series) dicts already replaced in this update
        self._unsorted: set[tuple] = set()
        by_step, later = self.by_step, self.later
        for old, new in changes:
            if old is not None:
                k = (old["rank"], old["evidence"], old.get("source", ""), old["step"])
                if by_step.get(old["step"], {}).get(k) is old:
                    self._drop(k, old)
                elif later.get(k) is old:
                    del later[k]
            if new is not None and new["end_ns"] >= s1:
                rank = new["rank"]
                if rank is None or rank < 0 or new["step"] < 0:
                    continue
                k = (rank, new["evidence"], new.get("source", ""), new["step"])
                if new["end_ns"] > u1:
                    later[k] = new
                else:
                    self._add(k, new)
        if s1 > self.since:   # rows the window's start left behind
            for st in [st for st, lo in self.low.items() if lo < s1]:
                for k, r in [(k, r) for k, r in by_step[st].items() if r["end_ns"] < s1]:
                    self._drop(k, r)
        if u1 > self.until and later:   # rows the window's end now reaches
            for k in [k for k, r in later.items() if r["end_ns"] <= u1]:
                r = later.pop(k)
                if r["end_ns"] >= s1:
                    self._add(k, r)
        self.since, self.until = s1, u1
        self._settle()

    def _series(self, rank: int, key: tuple) -> dict[int, dict]:
        """The rank's series `key`, replaced by a copy the first time this update changes it."""
        per = self.win.get(rank)
        if per is None:
            per = self.win[rank] = {}
        if (rank, key) not in self._copied:
            self._copied.add((rank, key))
            per[key] = dict(per.get(key, ()))
        return per[key]

    def _add(self, k: tuple, r: dict) -> None:
        rank, ev, src, st = k
        d = self._series(rank, (ev, src))
        if d and r["end_ns"] < d[next(reversed(d))]["end_ns"]:
            self._unsorted.add((rank, (ev, src)))
        d.pop(st, None)   # (a row of this step still here was replaced without a log entry: a plain read)
        d[st] = r
        rows = self.by_step.get(st)
        if rows is None:
            rows = self.by_step[st] = {}
            self.low[st] = r["end_ns"]
        elif r["end_ns"] < self.low[st]:
            self.low[st] = r["end_ns"]
        rows[k] = r
        self._touch(rank, st)

    def _drop(self, k: tuple, r: dict) -> None:
        rank, ev, src, st = k
        del self._series(rank, (ev, src))[st]
        rows = self.by_step[st]
        del rows[k]
        if not rows:
            del self.by_step[st], self.low[st]
        elif r["end_ns"] <= self.low[st]:
            self.low[st] = min(map(_END, rows.values()))
        self._touch(rank, st)

    def _touch(self, rank: int, st: int) -> None:
        t = self._touched.get(rank)
        if t is None:
            self._touched[rank] = {st}
        else:
            t.add(st)

    def _settle(self) -> None:
        """The changed ranks' chosen series (the best evidence, then the longest; as steptime.from_steps picks
        it) and nodes, the changed steps' chosen rows and figures, as _load gave them from one full parse."""
        for rank, key in self._unsorted:
            d = self.win[rank][key]
            self.win[rank][key] = dict(sorted(d.items(), key=lambda kv: kv[1]["end_ns"]))
        dirty: set[int] = set()
        new_rank = False
        for rank, steps in self._touched.items():
            per = self.win[rank]
            for key in [key for key, d in per.items() if not d]:
                del per[key]
            old = self.key.get(rank)
            if not per:
                del self.win[rank]
                self.key.pop(rank, None)
                self.node_of.pop(rank, None)
                new_rank = True
                if old is not None:
                    for st in [st for st, at in self.at.items() if rank in at]:
                        del self.at[st][rank]
                        dirty.add(st)
                continue
            key = next(iter(per)) if len(per) == 1 else \
                min(per, key=lambda k: (EVIDENCE_RANK.get(k[0], 9), -len(per[k]), k))
            chosen = per[key]
            self.key[rank] = key
            self.node_of[rank] = chosen[next(reversed(chosen))]["node_id"]
            if old is None:
                new_rank = True
            if old is not None and key != old:   # another series: every step of the rank's
                steps = {st for st, at in self.at.items() if rank in at} | set(chosen)
            for st in steps:
                r = chosen.get(st)
                at = self.at.get(st)
                if r is not None:
                    if at is None:
                        at = self.at[st] = {}
                    at[rank] = r
                elif at is not None:
                    at.pop(rank, None)
                dirty.add(st)
        if new_rank:
            self.order = sorted(self.win)
        pivot = self.pivot
        for st in dirty:
            at = self.at.get(st)
            if not at:
                self.at.pop(st, None)
                self.figs.pop(st, None)
                continue
            have = at.values()
            e = list(map(_END, have))
            b = list(map(_START, have))
            p = at.get(pivot) if pivot >= 0 else None
            self.figs[st] = (len(e), p["end_ns"] - p["start_ns"] if p is not None else max(map(sub, e, b)),
                             max(e), min(b), (len(e), sum(e), sum(b)))
        del self._touched, self._copied, self._unsorted

    def steps(self) -> JobSteps:
        need = max(1, math.ceil(self.cf * len(self.order)))
        numbers = sorted(st for st, f in self.figs.items() if f[0] >= need)
        figs = [self.figs[st] for st in numbers]
        win, key = self.win, self.key
        return JobSteps(numbers, [f[1] for f in figs], [f[2] for f in figs], [f[3] for f in figs],
                        {r: win[r][key[r]] for r in self.order}, {r: self.node_of[r] for r in self.order},
                        fps=[f[4] for f in figs], step_end={st: self.figs[st][2] for st in sorted(self.figs)})


def _load(reader, window: Window, cfg: IrregularityConfig) -> JobSteps:
    """The window's rows as one series per rank and the job's per-step figures. With the rows kept between passes
    (_rows), the parse of a window like this one (not reaching back further, not ending earlier) is kept too and
    brought up to date (_View): 8,192 ranks x 60 steps is ~500k rows, a pass touches the ~41k that arrived.
    Otherwise one parse of one full read."""
    cache = _rows(reader, window)
    if cache is None:
        v = _View(cfg.complete_fraction, cfg.pivot_rank)
        v.update(window, ((None, r) for r in reader.steps(window.job_key, since_ns=window.since_ns,
                                                            with_comms=True)))
        return v.steps()
    views = reader.step_memo.setdefault(VIEWS_KEY, [])
    log, base = cache["log"], cache["base"]
    live = [v for v in views if v.cursor >= base]
    fit = [v for v in live if (v.cf, v.pivot) == (cfg.complete_fraction, cfg.pivot_rank) and v.fits(window)]
    if fit:
        v = max(fit, key=lambda v: (v.since, v.until))
        v.update(window, log[v.cursor - base:])
        live.remove(v)
    else:   # a new parse from the kept rows
        v = _View(cfg.complete_fraction, cfg.pivot_rank)
        v.update(window, ((None, r) for r in cache["rows"].values()))
    v.cursor = base + len(log)
    # most recent first; a parse that fell further behind than a new one would cost is let go
    views[:] = [v] + [u for u in live if v.cursor - u.cursor <= len(cache["rows"])][:MAX_VIEWS - 1]
    keep = min(u.cursor for u in views)
    del log[:keep - base]
    cache["base"] = keep
    return v.steps()


_END, _START = itemgetter("end_ns"), itemgetter("start_ns")


# -- the gate and the kinds -------------------------------------------------------------------------------

@dataclass
class Gate:
    ratio: list[float]       # x / baseline (1.0 before a baseline exists)
    flag: list[bool]
    base_ns: list[float]     # baseline in force at each step (0: none yet)
    degradations: list[tuple[int, int, float, bool]]  # (first index, last index, level before it, still on)


def gate(x: list[int], cfg: IrregularityConfig) -> Gate:
    hist: deque = deque(maxlen=cfg.baseline_steps)
    ratio, flag, base = [], [], []
    degr: list[tuple[int, int, float, bool]] = []
    state = None  # (first index, level before)
    L = cfg.degradation_steps
    for i, v in enumerate(x):
        b = median(hist) if len(hist) >= cfg.min_baseline_steps else 0.0
        r = v / b if b else 1.0
        f = bool(b) and r >= cfg.delta
        ratio.append(r)
        flag.append(f)
        base.append(b)
        if state is not None:
            first, before = state
            recent = x[max(first, i - L + 1):i + 1]
            if median(recent) < cfg.delta * before:  # back at (or near) the old level: recovered
                last = i - 1
                while last > first and x[last] < cfg.delta * before:
                    last -= 1
                degr.append((first, last, before, False))
                state = None
        if not f:
            hist.append(v)
        elif state is None and b:
            # a flagged run with one-step gaps of >= L steps whose median is >= delta x baseline: level shift
            j, run = i, []
            while j >= 0 and (flag[j] or (j > 0 and flag[j - 1])) and len(run) < L:
                run.append(j)
                j -= 1
            if len(run) >= L and sum(flag[k] for k in run) >= 0.8 * L and \
                    median(x[k] for k in run) >= cfg.delta * base[run[-1]]:
                first = run[-1]
                while not flag[first]:
                    first += 1
                state = (first, base[first])
                hist.clear()
                hist.extend(x[first:i + 1])  # re-baseline on the new level
    if state is not None:
        degr.append((state[0], len(x) - 1, state[1], True))
    return Gate(ratio, flag, base, degr)


def _runs(idx: list[int], gap: int = 1) -> list[list[int]]:
    """Consecutive indices grouped into runs (a hole of up to `gap` - 1 steps allowed)."""
    out: list[list[int]] = []
    for i in idx:
        if out and i - out[-1][-1] <= gap:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def periodic(series: list[float], power: float) -> tuple[bool, float]:
    """A DFT peak with period 2..50 steps and power >= `power` x the mean power; (found, period)."""
    n = len(series)
    if n < 8:
        return False, 0.0
    m = sum(series) / n
    y = [v - m for v in series]
    spec = []
    for k in range(1, n // 2 + 1):
        z = sum(v * cmath.exp(-2j * math.pi * k * t / n) for t, v in enumerate(y))
        spec.append((abs(z) ** 2, n / k))
    mean = sum(p for p, _ in spec) / len(spec)
    best = max((sp for sp in spec if 2 <= sp[1] <= 50), default=(0.0, 0.0))
    return (mean > 0 and best[0] >= power * mean), best[1]


@dataclass
class Episode:
    kind: str
    idx: list[int]           # flagged step indices it covers
    last: int                # last index it is confirmed at
    severity: float
    detail: dict


def classify(js: JobSteps, g: Gate, cfg: IrregularityConfig) -> list[Episode]:
    n = len(js.x_ns)
    taken = [False] * n
    out: list[Episode] = []
    L = cfg.degradation_steps
    for first, last, before, on in g.degradations:
        idx = [i for i in range(first, last + 1)]
        for i in idx:
            taken[i] = True
        level = median(js.x_ns[max(first, last - L + 1):last + 1]) / before
        out.append(Episode("degradation", idx, n - 1 if on else last, level,
                           {"baseline_ns": int(before), "level_ns": int(level * before), "ongoing": on}))
    flagged = [i for i in range(n) if g.flag[i] and not taken[i]]
    # fluctuation: the flagged share over the last fluctuation_steps steps of each flag
    W = cfg.fluctuation_steps
    done_upto = -1
    for i in flagged:
        if i <= done_upto or taken[i]:
            continue
        lo, hi = i, min(n, i + W)
        win = [k for k in flagged if lo <= k < hi and not taken[k]]
        runs = _runs(win)
        if len(win) < max(2, cfg.fluctuation_fraction * min(W, max(n - lo, 1))) or len(runs) < 3:
            continue
        seg = g.ratio[max(0, lo - 5):hi]
        per, period = periodic(seg, cfg.periodic_power)
        excess = sum(g.ratio[k] for k in win) / len(win)
        if not per and excess >= cfg.spike_ratio:
            continue
        for k in win:
            taken[k] = True
        done_upto = win[-1]
        out.append(Episode("fluctuation", win, win[-1], max(g.ratio[k] for k in win),
                           {"flagged": len(win), "of_steps": hi - lo, "period_steps": round(period, 2) if per else None,
                            "mean_ratio": round(excess, 3)}))
    for run in _runs([i for i in flagged if not taken[i]], gap=2):
        peak = max(g.ratio[k] for k in run)
        if len(run) <= cfg.spike_max_run and run[-1] - run[0] < cfg.spike_max_run:
            # a spike is over: one still going at the newest step may be a slowdown's first steps (the demo's
            # straggler was opened as a 1-step spike, its cause `waiting` for want of steps); called next pass
            if peak >= cfg.spike_ratio and run[-1] < n - 1:
                out.append(Episode("spike", run, run[-1], peak, {"steps": len(run)}))
        elif len(run) > cfg.spike_max_run:  # sustained, but shorter than a level shift
            out.append(Episode("slowdown", run, run[-1], median(g.ratio[k] for k in run),
                               {"steps": len(run), "ongoing": run[-1] == n - 1}))
    return out


# -- localization --------------------------------------------------------------------------------------------

def _pick(offs: list[int], cap: int) -> list[int]:
    if len(offs) <= cap:
        return list(range(len(offs)))
    return [round(i * (len(offs) - 1) / (cap - 1)) for i in range(cap)] if cap > 1 else [0]


@dataclass
class Skew:
    last: dict[tuple[int, str], float]      # (rank, comm) -> collectives it was last in
    total: dict[tuple[int, str], int]       # (rank, comm) -> collectives it took part in
    margin: dict[tuple[int, str], float]    # (rank, comm) -> sum of (arrival - median of the others), ns
    members: dict[str, set[int]]
    transfer: dict[str, dict[int, int]]     # comm -> step index -> min busy_ns over members
    all_members: dict[str, set[int]]
    late: dict[int, dict[int, float]] = field(default_factory=dict)  # step index -> rank -> min over its
                                            # collective comms of its mean (arrival - median) that step, ns


PICK_STEPS = 20  # step_margins(): issue offsets per step as if a window had this many steps (8,192 ranks -> 3);
                 # the loop computes each step once (per_step), so a pass costs its new steps only


def collective_picks(js: JobSteps, steps: int, cfg: IrregularityConfig) -> int:
    """Issue offsets used per communicator and step: max_collectives_per_step, fewer on large jobs so that
    ranks x steps x picks stays within max_arrivals (bounded CPU per window: 8,192 ranks x 20 steps -> 3)."""
    return max(1, min(cfg.max_collectives_per_step, cfg.max_arrivals // max(1, len(js.rows) * max(1, steps))))


def step_busy(js: JobSteps, i: int) -> np.ndarray:
    """Per comm of step index i, in groups(js, i)'s order, the least positive busy_ns of its members' summaries
    (0: none busy), as one array, memoized per step: skew() and the commtime detector's transfer times both take
    theirs from it (~16k comms a step at 8,192 GPUs: a function call each was ~40 ms a step, twice)."""
    return per_step(js, "busy", i, lambda i: _step_busy(js, i))


_NONE = np.iinfo(np.int64).max


def _step_busy(js: JobSteps, i: int) -> np.ndarray:
    g = groups(js, i)
    if not g:
        return np.zeros(0, dtype=np.int64)
    sizes = np.fromiter(map(len, map(_RANKS, g.values())), dtype=np.int64, count=len(g))
    b = np.array([c["busy_ns"] for v in g.values() for c in v[2]], dtype=np.int64)
    b[b <= 0] = _NONE
    m = np.minimum.reduceat(b, np.r_[0, np.cumsum(sizes)[:-1]])
    m[m == _NONE] = 0
    return m


_RANKS = itemgetter(0)


def skew(js: JobSteps, idx: list[int], cfg: IrregularityConfig, tie_ns: int = 1000,
         want: set[int] | None = None) -> Skew:
    """Who arrives last (and by how much) into each collective over the steps idx, per (rank, comm); each
    step's part computed once while its rows stay the same (per_step, picks as step_margins() takes them).
    want: the per-rank sums (last, total, margin, late) of these ranks only (the communicators' transfer
    times and members for all): a reference skew needs only the ranks the episode's skew points at.
    Summed in numpy, one array per step in the step's _Layout (the same from step to step of a job): at 8,192
    GPUs a step has ~18k communicators and ~16k (rank, collective comm) pairs; summed in dicts, an episode's
    skew and its reference took 5.9 s under cProfile (a CI run beside), now 0.5 s."""
    picks = collective_picks(js, PICK_STEPS, cfg)
    name = f"skew:{picks}:{tie_ns}"
    members: dict[str, set[int]] = {}
    allm: dict[str, set[int]] = {}
    late_by_step: dict[int, dict[int, float]] = {}
    slot: dict[tuple[int, str], int] = {}    # (rank, comm) -> position in the sums
    cslot: dict[str, int] = {}               # comm -> position in the transfer times
    where: dict[int, tuple] = {}             # layout id -> (its entries' positions, its comms' positions)
    steps = []
    for i in idx:
        lay, busy, acc, share = per_step(js, name, i, lambda i: _step_skew(js, i, picks, tie_ns))
        steps.append((i, lay, busy, acc, share))
        if id(lay) not in where:   # a layout's members once per call, in the order steps bring them
            for cid, ranks, p2p, _ in lay.comms:
                allm.setdefault(cid, set()).update(ranks)
                if not p2p:
                    members.setdefault(cid, set()).update(ranks)
            where[id(lay)] = (np.array([slot.setdefault(k, len(slot)) for k in lay.keys], dtype=np.int64),
                              np.array([cslot.setdefault(c[0], len(cslot)) for c in lay.comms], dtype=np.int64))
    total = np.zeros(len(slot), dtype=np.int64)
    margin = np.zeros(len(slot))
    last = np.zeros(len(slot))
    busy_at = np.zeros((len(steps), len(cslot)), dtype=np.int64)   # step x comm: min busy_ns (0: none)
    for n, (i, lay, busy, acc, share) in enumerate(steps):
        g, c = where[id(lay)]
        total[g] += lay.nk
        margin[g] += acc
        last[g] += share
        busy_at[n, c] = busy
        if not len(acc):
            late_by_step[i] = {}
            continue
        mins = np.minimum.reduceat((acc / lay.nk)[lay.order], lay.bounds)[lay.appear].tolist()
        if want is None:
            late_by_step[i] = dict(zip(lay.uranks, mins))
        else:
            late_by_step[i] = {r: v for r, v in zip(lay.uranks, mins) if r in want}
    keys = list(slot)
    if want is not None:
        sel = [k for k, key in enumerate(keys) if key[0] in want]
        keys = [keys[k] for k in sel]
        total, margin, last = total[sel], margin[sel], last[sel]
    tot = dict(zip(keys, total.tolist()))   # every key is some step's entry
    mar = dict(zip(keys, margin.tolist()))
    lst = {k: v for k, v in zip(keys, last.tolist()) if v > 0}
    return Skew(lst, tot, mar, members, transfer_of(busy_at, [s[0] for s in steps], list(cslot)), allm,
                late_by_step)


def transfer_of(busy_at: np.ndarray, idx: list[int], cids: list[str]) -> dict[str, dict[int, int]]:
    """comm -> step index -> min busy_ns of a steps x comms array, its busy (> 0) steps only; comms in the order
    of their first busy step (then their column)."""
    if not busy_at.size:
        return {}
    nz = busy_at > 0
    first = np.where(nz.any(axis=0), nz.argmax(axis=0), len(idx))
    out: dict[str, dict[int, int]] = {}
    cols = busy_at.T.tolist()
    full = nz.all(axis=0).tolist()
    for k in np.lexsort((np.arange(len(cids)), first)).tolist():
        if first[k] == len(idx):
            break
        col = cols[k]
        out[cids[k]] = dict(zip(idx, col)) if full[k] else {i: b for i, b in zip(idx, col) if b}
    return out


@dataclass(eq=False)
class _Layout:
    """What one step's skew covers, the same object for every step with the same communicators and members
    (interned on js.memo): comms [(cid, members, point-to-point, collectives picked)]; keys: the (rank, comm) of
    each entry of a step's margin array (collective comms with picks, members in order); nk, ranks per entry;
    order/bounds/appear/uranks: the entries sorted by rank, where each rank's run starts, the runs in the order
    the entries bring their ranks, those ranks (a step's lateness per rank, the min over its comms, comes from
    np.minimum.reduceat)."""
    comms: tuple
    keys: list
    nk: np.ndarray
    ranks: np.ndarray
    order: np.ndarray
    bounds: np.ndarray
    appear: np.ndarray
    uranks: list


LAYOUTS_KEY = ("irregularity", "skew layouts")


def interned(js: JobSteps, key: tuple, comms: tuple, build=None):
    """The one object kept in js.memo[key] for a step's layout `comms` (a tuple of its communicators and
    members): build(comms), or the tuple itself, made once. A job's steps share one layout or a few, so
    per-step results in it are arrays in one order; at most 64 kept (members that churn start it afresh)."""
    memo = js.memo.get(key)
    if memo is None or len(memo) > 64:
        memo = js.memo[key] = {}
    v = memo.get(comms)
    if v is None:
        v = memo[comms] = build(comms) if build is not None else comms
    return v


def _layout(comms: tuple) -> _Layout:
    keys = [(r, cid) for cid, ranks, p2p, nk in comms if not p2p and nk for r in ranks]
    nk = np.array([nk for _, ranks, p2p, nk in comms if not p2p and nk for _ in ranks], dtype=np.int64)
    ranks = np.array([k[0] for k in keys], dtype=np.int64)
    order = np.argsort(ranks, kind="stable")
    srt = ranks[order]
    bounds = np.flatnonzero(np.r_[True, srt[1:] != srt[:-1]]) if len(srt) else np.zeros(0, dtype=np.int64)
    appear = np.argsort(order[bounds], kind="stable")   # the ranks in the order the entries bring them
    return _Layout(comms, keys, nk, ranks, order, bounds, appear, srt[bounds][appear].tolist())


def warm_skew(js: JobSteps, cfg: IrregularityConfig, tie_ns: int = 1000) -> None:
    """skew()'s part of every step this pass grouped already (JobSteps.by_step: margins and transfer times group
    each new step), computed now and memoized (per_step), so the pass that first localizes an episode does not
    compute the skew of all its steps and their reference at once (8,192 GPUs: ~0.2 s a step, 26 steps, most of
    that pass). For the loop's memo only: a cold pass computes the skew of the steps a localization reads."""
    picks = collective_picks(js, PICK_STEPS, cfg)
    name = f"skew:{picks}:{tie_ns}"
    for i in list(js.by_step):
        per_step(js, name, i, lambda i: _step_skew(js, i, picks, tie_ns))


def _step_skew(js: JobSteps, i: int, picks: int, tie_ns: int) -> tuple:
    """One step of skew(), over the comms with >= 2 members: (its _Layout; per comm of the layout its min busy_ns
    (0: none); per entry of the layout its sum over the picked collectives of its arrival minus the members'
    median, and its share of being last into them, summed). The collective comms of one size and offsets count
    (a job's tensor- or data-parallel groups: thousands of one shape per step) are computed together, as
    (comms x members x collectives) arrays (_class_skew); the few of uneven offsets one by one."""
    comms, sel = [], []                                  # sel: the comms' places in groups() (step_busy's order)
    classes: dict[tuple, tuple[list, list, list]] = {}   # (members, offsets, picks) -> entry offsets, starts, offsets
    odd = []                                             # (entry offset, starts, picked offsets lists)
    pick_memo: dict[int, tuple] = {}
    at = 0
    for j, (cid, (ranks, starts, cs)) in enumerate(groups(js, i).items()):
        n = len(ranks)
        if n < 2:
            continue
        sel.append(j)
        if cs[0]["op"] in P2P_OPS:
            comms.append((cid, tuple(ranks), True, 0))
            continue
        offs = list(map(_OFFS, cs))
        lens = set(map(len, offs))
        k_n = min(lens)
        ks = pick_memo.get(k_n)
        if ks is None:
            ks = pick_memo[k_n] = tuple(_pick(list(range(k_n)), picks))
        comms.append((cid, tuple(ranks), False, len(ks)))
        if not ks:
            continue
        if len(lens) == 1:
            cl = classes.get((n, k_n, ks))
            if cl is None:
                cl = classes[(n, k_n, ks)] = ([], [], [])
            cl[0].append(at)
            cl[1].append(starts)
            cl[2].append(offs)
        else:
            odd.append((at, starts, [[o[k] for k in ks] for o in offs]))
        at += n
    acc, share = np.zeros(at), np.zeros(at)
    for (n, k_n, ks), (pos, starts, offs) in classes.items():
        o = np.array(offs, dtype=np.int64)
        if len(ks) < k_n:
            o = o[:, :, list(ks)]
        a, sh = _class_skew(np.array(starts, dtype=np.int64)[:, :, None] + o, tie_ns)
        where = (np.array(pos, dtype=np.int64)[:, None] + np.arange(n)).ravel()
        acc[where] = a.ravel()
        share[where] = sh.ravel()
    for pos, starts, offs in odd:
        a, sh = _class_skew(np.array(starts, dtype=np.int64)[None, :, None] + np.array(offs, dtype=np.int64)[None],
                            tie_ns)
        acc[pos:pos + len(starts)] = a[0]
        share[pos:pos + len(starts)] = sh[0]
    return (interned(js, LAYOUTS_KEY, tuple(comms), _layout), step_busy(js, i)[sel], acc, share)


_OFFS = itemgetter("issue_offsets_ns")


def _class_skew(arr: np.ndarray, tie_ns: int) -> tuple[np.ndarray, np.ndarray]:
    """Arrivals (comms x members x picked collectives, int ns) -> per member its sum over the collectives of
    arrival minus the members' median (the two middle values' mean for an even count), and its share of being
    last (within tie_ns of the latest; ties share the collective), in the order and float steps of a sum taken
    one collective at a time."""
    n = arr.shape[1]
    srt = np.sort(arr, axis=1)
    mid = (srt[:, (n - 1) // 2, :] + srt[:, n // 2, :]) / 2
    last = arr.max(axis=1, keepdims=True) - arr <= tie_ns
    each = 1.0 / last.sum(axis=1)
    acc, share = np.zeros(arr.shape[:2]), np.zeros(arr.shape[:2])
    for k in range(arr.shape[2]):
        acc = acc + arr[:, :, k] - mid[:, None, k]
        share = share + np.where(last[:, :, k], each[:, None, k], 0.0)
    return acc, share


def pointed_at(bad: Skew, bad_idx: list[int], share: float = 0.05) -> set[int]:
    """The ranks an episode's skew points at, the only ones whose reference sums are read: those last into
    their collectives more than `share` of the time on average (compute_suspects drops the others whatever
    their reference: their lateness over it is at most their share) and, per flagged step, the rank latest
    into every collective it joins (map_ranking's compute causes)."""
    comms_of: dict[int, list[str]] = {}
    for cid, mem in bad.members.items():
        for r in mem:
            comms_of.setdefault(r, []).append(cid)
    out = {r for r, cids in comms_of.items() if sum(_share(bad, (r, c)) for c in cids) / len(cids) > share}
    for i in bad_idx:
        late = bad.late.get(i)
        if late:
            out.add(max(late.items(), key=lambda kv: kv[1])[0])
    return out


def _share(sk: Skew, key) -> float:
    t = sk.total.get(key, 0)
    return sk.last.get(key, 0.0) / t if t else 0.0


def late_every_step(js: JobSteps, bad: Skew, good: Skew | None, rank: int, bad_steps: list[int],
                    min_fraction: float = 0.01) -> bool:
    """Late into every collective it joins by its margins, where being last is diluted: in >= 90 % of the slow
    steps its mean margin (arrival - the members' median) into each of its collective communicators is > 0
    (Skew.late: the min over them), binomially unlikely by chance (z >= 2 against a coin), and by a mean >=
    min_fraction of the step time more than in the reference steps. A job that all-reduces its gradients one
    tensor after another waits for a slow rank at the first only; at the next ones the ranks arrive together
    and "last" falls to whoever the noise picks, so its share of last arrivals stays near chance (0.47 in a
    4-rank group while it kept the others waiting 150 ms a step: the first-run demo)."""
    vals = [bad.late[i][rank] for i in bad_steps if rank in bad.late.get(i, {})]
    n = len(vals)
    k = sum(v > 0 for v in vals)
    if n < 4 or k < 0.9 * n or (k - n / 2) / math.sqrt(n / 4) < 2.0:
        return False
    ref = [good.late[i][rank] for i in good.late if rank in good.late[i]] if good else []
    step = median(js.x_ns[i] for i in bad_steps)
    excess = sum(vals) / n - (max(0.0, sum(ref) / len(ref)) if ref else 0.0)
    return excess >= min_fraction * step


def _z_late(share: float, members: int, steps: int) -> float:
    """z of a rank's share of last arrivals into a group of `members` over `steps` steps, against chance."""
    p = 1.0 / members
    return (share - p) * math.sqrt(steps) / math.sqrt(p * (1 - p)) if 0 < p < 1 else 0.0


def compute_suspects(js: JobSteps, bad: Skew, good: Skew | None, bad_steps: list[int]) -> list[Suspect]:
    comms_of: dict[int, list[str]] = {}
    for cid, mem in bad.members.items():
        for r in mem:
            comms_of.setdefault(r, []).append(cid)
    out = []
    for rank, cids in comms_of.items():
        late = {}
        for cid in cids:
            base = _share(good, (rank, cid)) if good else 1.0 / len(bad.members[cid])
            late[cid] = max(0.0, _share(bad, (rank, cid)) - base)
        mean = sum(late.values()) / len(late)
        if mean <= 0.05:
            continue
        # "late into every collective it joins", judged per step (a rank's jitter holds for a whole step, so
        # its collectives within one step are not independent): z of its share against chance, each comm
        # A small group over few slow steps cannot reach z 2.5 even when the rank was last every time (a pair
        # over n steps at most sqrt(n)): there the bar is 0.8 x the most its steps allow, so a rank last in
        # (nearly) every collective of a young episode is called `compute`, not `waiting`, for want of steps.
        n = max(1, len(bad_steps))
        every = min(late.values()) >= 0.25 and all(
            _z_late(_share(bad, (rank, c)), len(bad.members[c]), n) >=
            min(2.5, 0.8 * _z_late(1.0, len(bad.members[c]), n)) for c in cids) or \
            late_every_step(js, bad, good, rank, bad_steps)
        score = mean if every else mean / 2
        out.append(Suspect("rank", str(rank), round(score, 4), "compute" if every else "waiting",
                           {"node": js.node_of.get(rank, ""),
                            "last_share": {c: round(_share(bad, (rank, c)), 3) for c in sorted(cids)},
                            "healthy_last_share": {c: round(_share(good, (rank, c)), 3) for c in sorted(cids)}
                            if good else None}))
    return out


def comm_devices(topo, nic_of: dict[int, str], node_of: dict[int, str],
                 mem: set[int]) -> dict[tuple[str, str], float]:
    """Devices a communicator's traffic uses, with weights: the member NICs, the switches and switch links of
    the ring's paths (1/#equal-cost paths each); without a topology, the members' nodes."""
    ranks = sorted(mem)
    pairs = list(zip(ranks, ranks[1:] + ranks[:1])) if len(ranks) > 2 else [(ranks[0], ranks[1])]
    out: dict[tuple[str, str], float] = {}

    def add(key, w):
        out[key] = max(out.get(key, 0.0), w)
    for a, b in pairs:
        if node_of.get(a) == node_of.get(b):
            continue
        if topo is None or a not in nic_of or b not in nic_of:
            add(("node", node_of.get(a, "")), 1.0)
            add(("node", node_of.get(b, "")), 1.0)
            continue
        add(("link", nic_of[a]), 1.0)
        add(("link", nic_of[b]), 1.0)
        paths = topo.paths(nic_of[a], nic_of[b])
        for p in paths:
            for j, dev in enumerate(p[1:-1]):
                add(("switch" if j % 2 == 0 else "link", dev), 1.0 / len(paths))
    return out


def network_suspects(js: JobSteps, bad: Skew, good: Skew, base_ns: float, cfg: IrregularityConfig,
                     topo, nic_of: dict[int, str], computing: set[int] = frozenset(),
                     probe_ctx: tuple | None = None) -> tuple[list[Suspect], dict]:
    slow: dict[str, float] = {}
    for cid, per in bad.transfer.items():
        if cid not in bad.members and (not cid.endswith(SEND) or computing & bad.all_members[cid]):
            continue  # a receive's busy time is mostly waiting; a send to/from a slow GPU may wait too
        h = list(good.transfer.get(cid, {}).values())
        f = list(per.values())
        if len(h) < 3 or not f:
            continue
        mh, mf = median(h), median(f)
        if mh > 0 and mf >= cfg.comm_slow_ratio * mh and mf - mh >= cfg.comm_slow_min_fraction * base_ns:
            slow[cid] = mf / mh
    if not slow:
        return [], {"slow_comms": {}}
    out = score_devices(slow, bad.all_members, js.node_of, topo, nic_of)
    ev = {"slow_comms": {c: round(v, 3) for c, v in sorted(slow.items(), key=lambda kv: -kv[1])[:10]}}
    if probe_ctx is not None:
        out, pev = refine(probe_ctx[0], probe_ctx[1], js, out, slow, bad.all_members, topo, nic_of,
                          probe_ctx[2], probe_ctx[3])
        if pev:
            ev["probe"] = pev
        if cfg.port_counters and probe_ctx[3]:   # NIC links still tied: what their own ports say (ports.py)
            on, off = js.start_ns[probe_ctx[3][0]], js.end_ns[probe_ctx[3][-1]]
            out = ports.break_tie(probe_ctx[0], topo, out, on, off)
            out = ports.promote_leaf(probe_ctx[0], topo, out, nic_of.values(), on, off)
    return out, ev


def refine(reader, job_key: str, js: JobSteps, sus: list[Suspect], slow: dict[str, float],
           members: dict[str, set[int]], topo, nic_of: dict[int, str], ref_idx: list[int],
           bad_idx: list[int], probe_steps: int = 5, round_ranks: int = 64,
           rounds: int = 4) -> tuple[list[Suspect], dict | None]:
    """Network suspects that tie (a slow ring implicates all of its links alike) re-scored with the pipeline
    pairs of the ranks on them (probe.py: their CommOps fetched from their agents only): slow pairs count as
    slow two-member communicators, healthy ones as healthy; (suspects, probe evidence or None). Progressive:
    `round_ranks` ranks a round, ordered to reach the most tied devices first (probe.by_coverage), and another
    round only while the re-scored suspects still tie, `rounds` at most (a long ring ties hundreds of links;
    one round of 64 ranks reached ~1/3 of a 512-member ring's NICs)."""
    cands = probe.tied(sus)
    if not cands or not ref_idx or not bad_idx:
        return sus, None
    among = set().union(*(members[c] for c in slow if c in members))
    ranks = probe.ranks_on(cands, topo, nic_of, js.node_of, among)
    if not ranks:
        return sus, None
    ranks = probe.by_coverage(ranks, cands, topo, nic_of, js.node_of, members)
    spans = [(js.start_ns[i], js.end_ns[i]) for i in ref_idx[-probe_steps:]], \
        [(js.start_ns[i], js.end_ns[i]) for i in bad_idx[-probe_steps:]]
    res, new = probe.ProbeResult(), sus
    for k in range(rounds):
        batch = ranks[k * round_ranks:(k + 1) * round_ranks]
        if not batch:
            break
        got = probe.probe(reader, job_key, batch, *spans, max_ranks=round_ranks)
        res.merge(got)
        if got.note:   # no fetching here, or it failed: no further round
            break
        if res.members:
            new = score_devices({**slow, **res.slow}, {**members, **res.members}, js.node_of, topo, nic_of)
            if not probe.tied(new):
                break
    ev = {"tied": [f"{c.kind} {c.id}" for c in cands[:8]], **res.evidence()}
    return new, ev


def score_devices(slow: dict[str, float], members: dict[str, set[int]], node_of: dict[int, str], topo,
                  nic_of: dict[int, str]) -> list[Suspect]:
    """Network devices scored from slow communicators (comm id -> ratio) among all of them (comm id -> member
    ranks): precision x recall over the ring paths (see the module docstring), a switch explaining all of its
    links alike above them; shared with the commtime detector."""
    use: dict[tuple[str, str], float] = {}
    hit: dict[tuple[str, str], float] = {}
    slow_n: dict[tuple[str, str], int] = {}
    for cid, mem in members.items():
        if cid.endswith(SEND) and cid not in slow:
            continue  # a small transfer is latency-bound: it may not slow where bandwidth is short (no alibi)
        for dev, w in comm_devices(topo, nic_of, node_of, mem).items():
            use[dev] = use.get(dev, 0.0) + w
            if cid in slow:
                hit[dev] = hit.get(dev, 0.0) + w
                slow_n[dev] = slow_n.get(dev, 0) + 1
    out = []
    for dev, h in hit.items():
        precision, recall = h / use[dev], h / len(slow)
        spread = 1.0 / (1.0 + 0.01 * (topo.downstream_nics(dev[1]) if topo is not None and dev[0] == "switch"
                                      and dev[1] in topo.switches else 1))
        out.append(Suspect(dev[0], dev[1], round(precision * recall * spread, 4), "network",
                           {"slow_comms": slow_n[dev],
                            "precision": round(precision, 3), "recall": round(recall, 3)}))
    if topo is not None:
        _prefer_switches(out, topo)
    return out


def _prefer_switches(out: list[Suspect], topo, tie: float = 0.1) -> None:
    """All (>= 2) switch links of one switch suspected alike (within `tie`) above the switch itself: one bad
    switch explains them all (they are the only ways out of it), where each link alone would be a separate
    fault; the switch takes their score (in place). A single bad link still wins: its peers stay clear."""
    score = {(x.kind, x.id): x for x in out}
    for i, x in enumerate(out):
        if x.kind != "switch":
            continue
        links = [lid for _, lid in topo.neighbours(x.id)]
        inc = [score[("link", lid)].score for lid in links if ("link", lid) in score]
        if 2 <= len(inc) == len(links) and max(inc) > x.score and min(inc) >= (1 - tie) * max(inc):
            out[i] = Suspect(x.kind, x.id, round(max(inc) * 1.001, 4), x.cause,
                             {**x.evidence, "explains_links": len(inc)})


def nic_map(reader, job_key: str, js: JobSteps):
    topo = reader.topology() if hasattr(reader, "topology") else None
    if topo is None:
        return None, {}
    nic_of = {}
    jobs = reader.jobs(job_key) if hasattr(reader, "jobs") else []
    for j in jobs:
        for r in j["ranks"]:
            if r["rank"] >= 0 and r.get("local_rank", -1) >= 0:
                g = topo.gpu_at(r["node_id"], r["local_rank"])
                if g is not None:
                    nic_of[r["rank"]] = g.nic
    return topo, nic_of


def localize(reader, window: Window, js: JobSteps, g: Gate, ep: Episode, healthy: list[int],
             cfg: IrregularityConfig, net_ctx) -> tuple[list[Suspect], dict]:
    bad = skew(js, ep.idx, cfg)
    good = skew(js, healthy, cfg, want=pointed_at(bad, ep.idx)) if healthy else None
    sus = compute_suspects(js, bad, good, ep.idx)
    if healthy:
        sus = pipeline_victims(js, sus, ep.idx, healthy, cfg.recv_wait_share)
    base = median(g.base_ns[i] for i in ep.idx if g.base_ns[i]) if any(g.base_ns[i] for i in ep.idx) else 0.0
    if ep.kind == "degradation" and ep.detail.get("baseline_ns"):
        base = ep.detail["baseline_ns"]
    slow: dict = {"slow_comms": {}}
    if good is not None:
        if net_ctx[0] is False:
            net_ctx[:] = list(nic_map(reader, window.job_key, js))
        computing = {int(x.id) for x in sus if x.cause == "compute"}
        net, slow = network_suspects(js, bad, good, base, cfg, net_ctx[0], net_ctx[1], computing,
                                     (reader, window.job_key, healthy, ep.idx))
        sus += net
    # a rank that only waited (late into some of its groups, not all) is an effect: a network device the slow
    # communicators point at explains it better, so `waiting` ranks go after compute and network suspects
    sus.sort(key=lambda s: (s.cause == "waiting", -s.score, s.kind, s.id))
    if good is not None:
        slow["map"] = map_ranking(js, ep.idx, healthy, bad, good, cfg, net_ctx[0], net_ctx[1])
    if cfg.cog and getattr(reader, "fetch_commops", None) is not None:
        slow["cog"] = cog.search(reader, window.job_key, js, ep.idx, healthy, g.ratio).evidence()
    slow["_late"] = bad.late   # per-step lateness, for concurrent causes' own onsets (detect() pops it)
    return sus[:cfg.max_suspects], slow


def recv_busy(js: JobSteps, rank: int, idx: list[int]) -> float | None:
    """Median over steps idx of a rank's point-to-point receive time per step (its `recv` summaries' busy
    time: mostly waiting for the sender); None where it reported none of those steps."""
    rows = js.rows.get(rank, {})
    vals = [sum(c["busy_ns"] for c in row["comms"] if c["op"] == "recv")
            for row in (rows.get(js.numbers[i]) for i in idx) if row is not None]
    return median(vals) if vals else None


def pipeline_victims(js: JobSteps, sus: list[Suspect], bad_idx: list[int], ref_idx: list[int],
                     share: float) -> list[Suspect]:
    """Compute suspects that only waited for their pipeline: a rank late into every collective it joins because
    its stage's input (or gradients) came late spends that time in its receives, a slow GPU does not (its peers
    have sent by the time it asks). A rank whose receive time per step grew by >= share x the job's excess
    step time is called `waiting` at half its score (a slow GPU in stage 2 made its TP group late, and with it
    the stage-1 rank fed by that group: named `compute` beside the GPU, one finding each; its receives grew
    by 46 ms a step of a 41 ms excess, the GPU's shrank by 10 ms)."""
    if not share or not bad_idx or not ref_idx:
        return sus
    excess = median(js.x_ns[i] for i in bad_idx) - median(js.x_ns[i] for i in ref_idx)
    if excess <= 0:
        return sus
    out = []
    for s in sus:
        if s.kind == "rank" and s.cause == "compute":
            now, before = recv_busy(js, int(s.id), bad_idx), recv_busy(js, int(s.id), ref_idx)
            if now is not None and before is not None and now - before >= share * excess:
                s = Suspect(s.kind, s.id, round(s.score / 2, 4), "waiting",
                            {**s.evidence, "recv_growth_ns": int(now - before), "excess_step_ns": int(excess)})
        out.append(s)
    return out


def own_onset(late: dict[int, dict[int, float]], idx: list[int], rank: int) -> int:
    """Where, among an episode's steps idx, a concurrent cause's rank began to be late: the change point of
    its per-step lateness (Skew.late) when its mean shifts up there (change_point, z >= 3), else the episode's
    first step. Two slow GPUs nine steps apart are one episode; each finding keeps its own onset."""
    steps = [i for i in idx if rank in late.get(i, {})]
    if len(steps) < 4:
        return idx[0]
    k = change_point([late[i][rank] for i in steps], min_z=3.0)
    return steps[k] if k else idx[0]


def map_ranking(js: JobSteps, bad_idx: list[int], ref_idx: list[int], bad: Skew, good: Skew,
                cfg: IrregularityConfig, topo, nic_of: dict[int, str], top: int = 5) -> list:
    """Holmes' cross-iteration device ranking (devrank.py) over the episode: per flagged step, the compute
    cause is the rank latest into every collective it joins (the largest min over its comms of its margin,
    if > 0) and the network causes are the collective communicators whose transfer time that step is >=
    comm_slow_ratio x their reference median; each cause weighted by R, the correlation of its series with the
    job step time over reference + flagged steps. Evidence beside the episode's own ranking; [(kind, id, I)]."""
    by_step = {**good.late, **bad.late}  # the skews' per-step lateness: no second pass over the arrivals
    idx = sorted(i for i in set(ref_idx[-cfg.baseline_steps:]) | set(bad_idx) if i in by_step)
    pos = {i: k for k, i in enumerate(idx)}
    x = [js.x_ns[i] for i in idx]
    late: dict[int, list[float]] = {}
    if idx:
        for rank in by_step[idx[0]]:
            vals = [by_step[i].get(rank) for i in idx]
            if None not in vals:
                late[rank] = vals
    r_rank: dict[int, float] = {}   # of the ranks some step blames (8,192 GPUs: a few of 8,192)
    ref_med = {}                    # a collective comm's reference median transfer time (>= 3 steps)
    for cid in bad.transfer:
        h = good.transfer.get(cid, {})
        if cid in bad.members and len(h) >= 3:
            ref_med[cid] = median(h.values())
    causes = []
    for i in bad_idx:
        k = pos[i]
        best = max(late.items(), key=lambda kv: kv[1][k], default=None)
        if best is not None and best[1][k] > 0:
            r = r_rank.get(best[0])
            if r is None:
                r = r_rank[best[0]] = devrank.pearson(best[1], x)
            causes.append((r, {("rank", str(best[0])): 1.0}))
        for cid, per in bad.transfer.items():
            m = ref_med.get(cid)
            if m is None or i not in per or per[i] < cfg.comm_slow_ratio * m:
                continue
            series = [good.transfer.get(cid, {}).get(j, bad.transfer[cid].get(j, 0)) for j in idx]
            causes.append((devrank.pearson(series, x),
                           comm_devices(topo, nic_of, js.node_of, bad.all_members[cid])))
    counts = {"rank": len(js.rows), "link": max(1, len(set(nic_of.values()))),
              "switch": len(topo.switches) if topo is not None else 1}
    return [list(t) for t in devrank.rank(causes, topo, counts)[:top]]


def causes(sus: list[Suspect], share: float = 0.5, net_score: float = 0.5) -> list[Suspect]:
    """The independent root causes among an episode's suspects, best first: the top one; every other rank
    late into every collective it joins (cause compute) scoring >= share x the best compute score (a second
    slow GPU: waiting ranks are an effect, not listed); and, when the top is a compute cause, the best network
    device if it scores >= net_score (slow communicators that a slow GPU does not explain: their transfer
    time, the min over members, does not wait for a late member; a weak one, a link that only shares a ring's
    slowness, made a finding of its own naming the wrong link, and the commtime detector reports a network
    fault beside a slow GPU itself). [] when there are no suspects."""
    if not sus:
        return []
    out = [sus[0]]
    comp = [x for x in sus if x.cause == "compute"]
    if comp:
        out += [x for x in comp[1:] if x is not sus[0] and x.score >= share * comp[0].score]
    if sus[0].cause == "compute":
        net = [x for x in sus if x.cause == "network" and x.score >= net_score]
        if net:
            out.append(net[0])
    return out


def ramp_onset(g: Gate, first: int, flagged: set[int], cfg: IrregularityConfig) -> int:
    """Where a level shift began: a degradation that ramps up is flagged only once it passes delta, and the
    unflagged steps of its ramp already carry the slow rank's lateness; walk back over up to degradation_steps
    steps whose ratio is still >= ramp_ratio x the baseline, so the reference is taken before them."""
    lo = max(0, first - cfg.degradation_steps)
    while first > lo and first - 1 not in flagged and g.base_ns[first - 1] and \
            g.ratio[first - 1] >= 1.0 + (cfg.delta - 1.0) * cfg.ramp_fraction:
        first -= 1
    return first


def margin_arrays(js: JobSteps, idx: list[int], cfg: IrregularityConfig) -> dict[str, tuple[list[int], np.ndarray,
                                                                                        np.ndarray]]:
    """The steps idx's arrival margins per collective comm: its members, their margins (steps x members; NaN
    where a member has no value that step: the rank's mean arrival over the step's picked collectives minus
    the members' median of that mean) and the collectives per step; comms in the order steps bring them. From
    the per-step memo (step_margins: the picks of a PICK_STEPS window whatever len(idx), so a step's result is
    the same in every pass and for the lateness detector, whose windows are shorter, and the loop computes
    it once). The steps of one layout (the same comms and members) are one steps x entries array: with one
    layout (a job's usual case) each comm's columns are a slice of it; with a few (the newest step may lack
    ranks that have not ended it yet) each comm's columns are gathered from them."""
    steps = step_margins(js, idx, cfg)
    if not steps:
        return {}
    blocks: dict[int, tuple] = {}   # layout -> its steps' positions, in the order steps bring the layouts
    for p, (lay, _, _) in enumerate(steps):
        b = blocks.get(id(lay))
        if b is None:
            b = blocks[id(lay)] = (lay, [])
        b[1].append(p)
    parts = []   # per layout: comm -> (column of calls, first column of margins, members); margins; calls; steps
    for lay, ps in blocks.values():
        pos, at = {}, 0
        for k, (cid, mem) in enumerate(lay):
            pos[cid] = (k, at, mem)
            at += len(mem)
        parts.append((pos, np.array([steps[p][1] for p in ps], dtype=np.float64).reshape(len(ps), -1),
                      np.array([steps[p][2] for p in ps], dtype=np.float64).reshape(len(ps), -1), ps))
    out = {}
    if len(parts) == 1:   # one layout (a job's usual case): each comm's columns a slice
        pos, big, calls, _ = parts[0]
        for cid, (k, at, mem) in pos.items():
            out[cid] = (list(mem), big[:, at:at + len(mem)], calls[:, k])
        return out
    order = dict.fromkeys(cid for lay, _ in blocks.values() for cid, _ in lay)
    for cid in order:
        got = [part[0].get(cid) for part in parts]
        first = got[0]
        if first is not None and all(g is not None and g[2] == first[2] for g in got):   # the same members every step
            n = len(first[2])
            vals, calls = np.empty((len(idx), n)), np.empty(len(idx))
            for (_, big, cl, ps), (k, at, _) in zip(parts, got):
                vals[ps] = big[:, at:at + n]
                calls[ps] = cl[:, k]
            out[cid] = (list(first[2]), vals, calls)
            continue
        mem = sorted({r for g in got if g is not None for r in g[2]})
        col = {r: k for k, r in enumerate(mem)}
        vals, calls = np.full((len(idx), len(mem)), np.nan), np.zeros(len(idx))
        for (_, big, cl, ps), g in zip(parts, got):
            if g is not None:
                k, at, m = g
                vals[np.ix_(ps, [col[r] for r in m])] = big[:, at:at + len(m)]
                calls[ps] = cl[:, k]
        out[cid] = (mem, vals, calls)
    return out


def step_margins(js: JobSteps, idx: list[int], cfg: IrregularityConfig) -> list[tuple]:
    """Per step of idx, its margins as _step_margins gives them, memoized per step (per_step) with the picks of
    a PICK_STEPS window."""
    picks = collective_picks(js, PICK_STEPS, cfg)
    name = f"margins:{picks}"
    return [per_step(js, name, i, lambda i: _step_margins(js, i, picks)) for i in idx]


MARGIN_LAYOUTS_KEY = ("irregularity", "margin layouts")


def _step_margins(js: JobSteps, i: int, picks: int) -> tuple[tuple, np.ndarray, np.ndarray]:
    """One step of step_margins(), over the collective comms with >= 2 members that have offsets: (its layout,
    ((comm, members), ...) interned (a job's steps share it); per member of each, in that order, its mean
    arrival over the picked collectives minus the members' median of it; per comm its collectives that step).
    The comms whose members all have offsets, as many, are computed by size and offsets count together; the
    others one by one."""
    out: dict[str, tuple] = {}   # comm -> (members, margins, collectives)
    classes: dict[tuple, tuple[list, list, list, list]] = {}   # (members, offsets) -> comms, starts, offsets, calls
    pick_memo: dict[int, list[int]] = {}
    for cid, (ranks, starts, cs) in groups(js, i).items():
        if cs[0]["op"] in P2P_OPS:
            continue
        offs = list(map(_OFFS, cs))
        lens = set(map(len, offs))
        if len(lens) == 1 and len(ranks) >= 2 and 0 not in lens:
            key = (len(ranks), lens.pop())
            cl = classes.get(key)
            if cl is None:
                cl = classes[key] = ([], [], [], [])
            cl[0].append((cid, ranks))
            cl[1].append(starts)
            cl[2].append(offs)
            cl[3].append(max(0, max(map(_CALLS, cs))))
            out[cid] = ()   # its place: comms in the order the step brings them
            continue
        arr, who, calls = [], [], 0
        for rank, start, c, o in zip(ranks, starts, cs, offs):
            if o:
                ks = pick_memo.get(len(o))
                if ks is None:
                    ks = pick_memo[len(o)] = _pick(list(range(len(o))), picks)
                arr.append(start + (o[ks[0]] if len(ks) == 1 else sum([o[k] for k in ks]) / len(ks)))
                who.append(rank)
                if c["calls"] > calls:
                    calls = c["calls"]
        if len(arr) < 2:
            continue
        srt = sorted(arr)
        mid = (srt[(len(srt) - 1) // 2] + srt[len(srt) // 2]) / 2
        out[cid] = (tuple(who), np.array([a - mid for a in arr], dtype=np.float64), calls)
    for (n, k_n), (keys, starts, offs, calls) in classes.items():
        ks = _pick(list(range(k_n)), picks)
        o = np.array(offs, dtype=np.int64)
        st = np.array(starts, dtype=np.int64)
        arr = st + o[:, :, ks[0]] if len(ks) == 1 else st + o[:, :, ks].sum(axis=2) / len(ks)
        srt = np.sort(arr, axis=1)
        diffs = arr - ((srt[:, (n - 1) // 2] + srt[:, n // 2]) / 2)[:, None]
        for (cid, ranks), d, k in zip(keys, diffs, calls):
            out[cid] = (tuple(ranks), d, k)
    lay = interned(js, MARGIN_LAYOUTS_KEY, tuple((cid, v[0]) for cid, v in out.items()))
    vals = np.concatenate([v[1] for v in out.values()]) if out else np.zeros(0)
    return lay, vals, np.array([v[2] for v in out.values()], dtype=np.int64)


_CALLS = itemgetter("calls")


def stragglers(js: JobSteps, cfg: IrregularityConfig) -> list[tuple[int, dict]]:
    """Ranks persistently late into every collective communicator they join: per comm, the per-step margin
    (arrival - members' median) has z >= straggler_z_every (lateness_z: mean / (sd / sqrt(steps)), or the
    median's under heavy-tailed jitter), >= straggler_z in one of them at least (a wide group's arrivals are
    noisier), and the time it keeps its groups waiting per step (that margin x collectives per step, summed
    over them) >= straggler_min_fraction of the step time. Steps are the samples (a rank's compute jitter
    holds for a whole step), so a 5 % slower GPU under 2 % per-step jitter stands out at z ~ 2.5 x sqrt(steps),
    in a group of 2 as in one of 64, where "last in most collectives" holds only in small groups. A rank not
    late on average (mean or median) into each group over the last min_baseline_steps steps is skipped
    (cheap); for the others the test runs on
    the steps from the change point of its lateness on (change_point(): a slowdown that began inside the
    window is not diluted by the healthy steps before it), at least 2 x min_baseline_steps of them (the point
    is picked where the lateness after it is highest, so a short tail after it biases the test)."""
    n = len(js.numbers)
    idx = list(range(max(0, n - cfg.straggler_steps), n))
    if len(idx) < cfg.min_baseline_steps:
        return []
    arrs = margin_arrays(js, idx, cfg)
    tail = cfg.min_baseline_steps
    comms_of: dict[int, list[str]] = {}
    quiet: set[int] = set()   # not late, on average (mean or median), into one of its groups lately: no straggler
    for cid, (mem, vals, _) in arrs.items():
        for r in mem:
            comms_of.setdefault(r, []).append(cid)
        full = ~np.isnan(vals).any(axis=0)
        last = vals[-tail:]   # a full column's last `tail` values; the others' below, on their own
        no = (last.sum(axis=0) <= 0) & (np.median(last, axis=0) <= 0)
        for k in np.flatnonzero(~full | no).tolist():
            xs = vals[:, k][~np.isnan(vals[:, k])].tolist()[-tail:] if not full[k] else []
            if full[k] or len(xs) < tail or (sum(xs) <= 0 and median(xs) <= 0):
                quiet.add(mem[k])
    step = median(js.x_ns[i] for i in idx)
    out = []
    as_lists: dict[str, tuple] = {}   # comm -> (member -> column, columns as lists, calls as a list): once a comm
    for rank, cids in comms_of.items():
        if rank in quiet:
            continue
        cols = []
        for c in cids:
            lists = as_lists.get(c)
            if lists is None:
                mem, vals, calls = arrs[c]
                lists = as_lists[c] = ({r: k for k, r in enumerate(mem)}, vals.T.tolist(), calls.tolist())
            pos, tcols, calls = lists
            cols.append([(v, k) for v, k in zip(tcols[pos[rank]], calls) if v == v])   # NaN: no value
        # where its lateness began (a slowdown that started inside the window): test the steps from there
        full = [xs for xs in cols if len(xs) == len(idx)]
        series = [sum(v * c for v, c in col) for col in zip(*full)] if full else []
        k = change_point(series, min_z=3.0) if series else 0
        if len(idx) - k < 2 * tail:
            # the change point is where the rank's lateness is highest after it: a z-test on a few steps
            # chosen that way is biased (a healthy 512-GPU run gave z 6.8 over the 13 steps after one, at
            # 1.00x the step time): at least 2 x min_baseline_steps after it, else the whole span is tested
            k = 0
        ok, ev = True, {}
        for cid, xs in zip(cids, cols):
            m, z, how = lateness_z([v for v, _ in (xs[k:] if len(xs) == len(idx) else xs)])
            per_step = m * median(c for _, c in xs) / step if step else 0.0
            if z < cfg.straggler_z_every:
                ok = False
                break
            ev[cid] = {"z": round(min(z, 1e6), 1), "test": how, "mean_margin_ns": int(m),
                       "margin_fraction": round(per_step, 4)}
        if ok and ev and max(e["z"] for e in ev.values()) >= cfg.straggler_z and \
                sum(e["margin_fraction"] for e in ev.values()) >= cfg.straggler_min_fraction:
            out.append((rank, {**ev, "_onset": idx[k]}))
    return out


def lateness_z(vals: list[float]) -> tuple[float, float, str]:
    """How surely a rank's per-step margins are late on the whole: (margin, z, test), the larger z of two tests
    on the same samples. `mean`: mean / (sd / sqrt(n)), the most powerful when the step-to-step jitter is
    Gaussian (the simulator's). `median`: median / (1.2533 x 1.4826 MAD / sqrt(n)), the median's standard
    error from a spread that a few outliers do not set: on a shared host a rank's margins have 3-4x spikes
    (preemptions of either end) that made the sd twice the robust spread (testbed, DP2 on 2 cores: 3.2 ms
    against 1.1-2.2 ms at a 34 ms step), so a rank 5 % slower, 1.1 ms late per step, stayed at z ~2.5 over 50
    steps by the mean test and was never named; by the median's it is, 7.8 s after it slowed
    (bench/straggler_replay.py on the recording; bench/README.md, "testbed_sentinel.py")."""
    n = len(vals)
    if n < 2:
        return 0.0, 0.0, "mean"
    m = sum(vals) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (n - 1))
    z = m / (sd / math.sqrt(n)) if sd > 0 else (math.inf if m > 0 else 0.0)
    med = median(vals)
    mad = 1.4826 * median([abs(v - med) for v in vals])
    zm = med / (1.2533 * mad / math.sqrt(n)) if mad > 0 else 0.0
    return (med, zm, "median") if zm > z else (m, z, "mean")


def change_point(x: list[float], min_z: float = 4.0) -> int:
    """Where a series' mean shifts up: the k maximizing (mean(x[k:]) - mean(x[:k])) x sqrt(k (n - k) / n), if
    that shift is >= min_z times the within-segment spread; else 0 (the whole series is the shifted part)."""
    n = len(x)
    if n < 4:
        return 0
    pre = [0.0]
    for v in x:
        pre.append(pre[-1] + v)
    best, k_best = 0.0, 0
    for k in range(2, n - 1):
        d = (pre[n] - pre[k]) / (n - k) - pre[k] / k
        st = d * math.sqrt(k * (n - k) / n)
        if st > best:
            best, k_best = st, k
    if not k_best:
        return 0
    a, b = x[:k_best], x[k_best:]
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    sd = math.sqrt((sum((v - ma) ** 2 for v in a) + sum((v - mb) ** 2 for v in b)) / max(1, n - 2))
    return k_best if sd > 0 and best >= min_z * sd else 0


# -- the detector -----------------------------------------------------------------------------------------

def _summary(kind: str, sev: float, n: int, sus: list[Suspect]) -> str:
    who = ""
    if sus:
        s = sus[0]
        who = f"; top suspect {s.kind} {s.id} ({s.cause})"
    what = {"spike": f"a spike of {n} step(s) at {sev:.2f}x the baseline step time",
            "fluctuation": f"fluctuating step time: {n} irregular steps, up to {sev:.2f}x the baseline",
            "degradation": f"step time degraded to {sev:.2f}x the baseline",
            "slowdown": f"step time slowed to {sev:.2f}x the baseline over {n} steps"}[kind]
    return what[0].upper() + what[1:] + who + "."


def detect(reader, window: Window, cfg: IrregularityConfig) -> list[Finding]:
    js = load(reader, window, cfg)
    if len(js.numbers) < cfg.min_baseline_steps + 1:
        return []
    if js.memo is getattr(reader, "step_memo", None):   # the loop's passes: skew as the steps arrive
        warm_skew(js, cfg)
    g = gate(js.x_ns, cfg)
    episodes = classify(js, g, cfg)
    flagged = set(i for i, f in enumerate(g.flag) if f)
    for first, last, _, _ in g.degradations:
        flagged.update(range(first, last + 1))
    healthy_all = [i for i in range(len(js.numbers)) if i not in flagged and g.base_ns[i]]
    net_ctx: list = [False, {}]
    out: list[Finding] = []
    clean = [i for i in range(len(js.numbers)) if i not in flagged]
    for ep in episodes:
        first = ep.idx[0]
        if ep.kind == "degradation":
            first = ramp_onset(g, first, flagged, cfg)
            before = [i for i in clean if i < first][-cfg.baseline_steps:]
        else:
            before = [i for i in healthy_all if i < first][-cfg.baseline_steps:]
        before = before or healthy_all[-cfg.baseline_steps:]
        sus, ev = localize(reader, window, js, g, ep, before, cfg, net_ctx)
        late = ev.pop("_late", {})
        n = len(ep.idx)
        ratios = {str(js.numbers[i]): round(g.ratio[i], 3) for i in ep.idx[-50:]}
        base = ep.detail.get("baseline_ns") or int(median(g.base_ns[i] for i in ep.idx if g.base_ns[i]))
        evidence = {"first_step": js.numbers[ep.idx[0]], "steps": n,
                    "flagged_steps": [js.numbers[i] for i in ep.idx[-50:]], "ratios": ratios,
                    "baseline_step_ns": int(base), "delta": cfg.delta, **ep.detail, **ev}
        leads = causes(sus)
        for k, lead in enumerate(leads):  # concurrent root causes: one finding each (its own identity and onset)
            order = [lead] + [x for x in sus if x is not lead]
            summary = _summary(ep.kind, ep.severity, n, order)
            if k:
                summary = summary[:-1] + f", concurrent with {sus[0].kind} {sus[0].id} ({sus[0].cause})."
            onset = ep.idx[0]
            if len(leads) > 1 and lead.kind == "rank" and lead.cause == "compute":
                onset = own_onset(late, ep.idx, int(lead.id))
            out.append(Finding(kind=ep.kind, onset_ns=js.start_ns[onset], last_ns=js.end_ns[ep.last],
                               severity=round(ep.severity, 4), summary=summary, suspects=tuple(order),
                               evidence={**evidence, "concurrent_with": f"{sus[0].kind} {sus[0].id}"} if k
                               else evidence))
    if not any(e.kind in ("slowdown", "degradation") and e.last == len(js.numbers) - 1 for e in episodes):
        lo = max(0, len(js.numbers) - cfg.straggler_steps)
        base = [g.base_ns[i] for i in range(lo, len(js.numbers)) if g.base_ns[i]]
        now = median(js.x_ns[lo:])
        for rank, ev in stragglers(js, cfg):
            onset = ev.pop("_onset")
            sev = now / median(base) if base else 1.0
            sus = (Suspect("rank", str(rank), 1.0, "compute", {"node": js.node_of.get(rank, ""), "comms": ev}),)
            out.append(Finding(kind="slowdown", onset_ns=js.start_ns[onset], last_ns=js.end_ns[-1],
                               severity=round(max(sev, 1.0), 4),
                               summary=f"Rank {rank} arrives late at every collective it joins since step "
                                       f"{js.numbers[onset]}, keeping its groups waiting (step time "
                                       f"{max(sev, 1.0):.2f}x the baseline).",
                               suspects=sus, evidence={"straggler_steps": len(js.numbers) - lo,
                                                       "first_step": js.numbers[onset], "step_ns": int(now),
                                                       "comms": ev}))
    try:  # the lateness detector of the same pass reads which ranks these findings name (named_ranks)
        reader._irregularity_memo = (window, out)
    except AttributeError:
        pass
    return out


def named_ranks(reader, window: Window, cfg: IrregularityConfig) -> list[tuple[str, int, int]]:
    """(rank id, onset_ns, last_ns) of every finding of this detector on the window that leads with a rank:
    the pass's own result when it ran already (kept on the reader), else detect() now."""
    memo = getattr(reader, "_irregularity_memo", None)
    out = memo[1] if memo is not None and memo[0] == window else detect(reader, window, cfg)
    return [(f.suspects[0].id, f.onset_ns, f.last_ns) for f in out if f.suspects and f.suspects[0].kind == "rank"]


SPEC = DetectorSpec(
    name="irregularity",
    description="δ-irregular steps per job (spike, fluctuation, degradation, slowdown) and a persistent "
                "straggler, localized by cross-rank arrival skew and slow communicators",
    kinds=("spike", "fluctuation", "degradation", "slowdown"),
    config_class=IrregularityConfig,
    detect=detect,
)
