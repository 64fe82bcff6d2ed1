"""Slow communicators per job from their transfer time, even when the job's step time hides them.

Reads the window's Step records (their per-communicator summaries) and, for suspects, the stored topology and
the job's processes (rank -> node, local rank -> GPU -> NIC), through irregularity.load and
irregularity.nic_map; nothing else. Pure: `detect(reader, window, cfg) -> list[Finding]`, no writes, no
clock, no state across windows.

Why: many network faults (a slow link, a congested switch) barely move the job's step time, since
communication overlaps compute, so the irregularity gate never fires; the communicators crossing the bad
device still take longer to transfer.
Transfer time of a collective communicator in step s: the min over its members of busy_ns (the member that
waited least spent only the transfer; a slow GPU arrives last and waits least, so a compute straggler does not
raise it). Point-to-point communicators count by their sends (`<comm id>#send`: the agent summarizes sends
apart from receives; a send starts when its data is ready, its receiver mostly waits already, so its busy time
is mostly transfer; a receive's is mostly waiting and is left out). A pipeline pair's sends that did not slow
are no alibi for the devices on their path (a small transfer is latency-bound), so they count only when slow.
Flags, per communicator and step: a trailing baseline (median b of the last baseline_steps values not
flagged) and its noise (sigma = 1.4826 x their MAD: a fabric's transfers jitter by a few % from one iteration
to the next); a value is flagged when it exceeds b by >= max((ratio - 1) x b, noise_k x sigma). The threshold
follows each communicator's own noise: a 1.2x slower link is seen under 2 % jitter, and 4 % jitter raises no
flag on a healthy job (tests). Slow spans (slow_spans): >= recent_steps flagged steps in a run (`persistent`)
or >= fluctuation_min within fluctuation_steps, or runs that come back (`fluctuating`), anywhere in the
window, not only at its end: a fault that ended before the window did is still reported (evidence `ongoing`
false, "(over)" in the summary). A span whose median excess is < min_step_fraction of the job's step time is
left out: a 20 % rise on a communicator that takes 0.1 % of the step is noise (a ring's 8 % under 4 % jitter,
0.5 % of the step, was the one false finding of a healthy jittered job at 0.1 %). A pipeline pair's sends have
a lower floor (min_step_fraction_p2p, 0.1 %): their path is two NIC links and the switches between, so a slow
pair is a sharp witness of its link even when the sends take 1 % of the step (a 1.3x link under a pipeline
pair that no ring crosses: the slow sends were left out at 0.5 % and the fault went unreported).
Findings: overlapping spans form an episode; its root causes are explained greedily (explain()): the best
device over the episode's slow communicators, then the best over those it does not explain (a slow link
beside a congested switch elsewhere), up to 3, one finding each (`concurrent_with` names the first). The
communicators that slowed first (within recent_steps) go first where one device alone explains them (score
>= early_score, no tie): two links under one leaf slowing 5 steps apart are two links, not the leaf; and the
communicators an earlier cause took are no alibi for the next (they were slow). A cause
keeps its spans only over its own time (split_outside(): the median first to the median last step of its
spans): a span slow for >= recent_steps steps before or after that (a pair crossing a congested leaf and a bad
link of its own that was slow longer) leaves those steps to be explained again, so the link gets its finding
and the leaf its onset; a left-over the same device explains again joins that cause. Kind
`network`, onset at the cause's first flagged step, severity = the largest transfer-time ratio (not the
step-time ratio the other kinds carry; the summary says so), suspects: NICs, links and switches scored by
irregularity.score_devices over the slow vs all collective communicators' ring paths; the members' nodes
without a stored topology.
No duplicate of the irregularity detector: when the job's step time is itself >= gate_ratio x its baseline
(the gate's delta) on most of an episode's steps and the slow communicators explain that excess (job excess
<= 2x their largest excess transfer time), irregularity localizes the same devices with the same scoring and
this detector leaves the episode to it; a job slowed far beyond them (a slow GPU beside a slow link), or slow
already before them (on most of the recent_steps steps before), gets both findings (gate_ratio = 0: report
always).
Ties: one slow ring implicates all of its links alike (a ring runs at its slowest link's pace). When the best
suspects tie, irregularity.refine asks the agents of the ranks on them for their CommOps (progressive
fetching, probe.py) and scores their pipeline pairs' measured transfer times beside the rings: the slow link
comes first; the evidence says how many ranks were fetched. In rounds of probe_round_ranks (64) ranks, ordered
to reach the most tied devices first, another round only while the suspects still tie (probe_rounds, 4: a
512-member ring ties 512 NIC links, and one round reached about a third of them). Without fetching (no agents
connected) the tie stays and the evidence says why. A link crossed by one pipeline pair only stays tied with its
peer's link by timing; then its own port decides where the topology names the NICs' ports (ports.py: the tied
NIC links' port counters over the episode, a degraded port leads; evidence `port` on each). A NIC link on top
whose leaf its NICs' transmit wait shows congested gives way to the leaf (ports.promote_leaf: a leaf 1.06x
congested flags a few rings first, and they implicate their own links). port_counters = false: neither.
Cost: one pass over the window's steps grouped per communicator (irregularity.groups, shared with the
irregularity detector in the same pass; each step's transfer times memoized across passes) into one steps x
communicators array, and the trailing baselines of all communicators at once (baselines(): numpy over the
communicators, step by step; a median/MAD every 8 steps). 8,192 GPUs, ~18k communicators x 50 steps: 2.8 s
under cProfile in dicts and per-communicator loops, now 0.16 s (the steps' grouping and the window's load apart).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

import numpy as np

from steplens.collector.analysis import ports
from steplens.collector.analysis.base import ConfigError, DetectorConfig, DetectorSpec, Window
from steplens.collector.analysis.findings import Finding
from steplens.collector.analysis.irregularity import (SEND, IrregularityConfig, comm_devices, groups, interned, load,
                                                      nic_map, per_step, refine, score_devices, step_busy)

NOT_TRANSFER = ("#recv", "#sendrecv")  # point-to-point keys whose busy time is not a transfer


@dataclass
class CommtimeConfig(DetectorConfig):
    ratio: float = 1.05                  # a transfer >= this x its communicator's baseline can be slow ...
    noise_k: float = 4.0                 # ... and only when above the baseline by >= noise_k x its own noise
    recent_steps: int = 5                # N: a span of >= N flagged steps (one-step gaps allowed) is persistent
    fluctuation_steps: int = 12          # W: >= fluctuation_min flagged steps within W steps fluctuate
    fluctuation_min: int = 3
    baseline_steps: int = 100            # trailing unflagged steps in a communicator's baseline (median)
    min_baseline_steps: int = 10         # no verdict before this many baseline steps
    min_step_fraction: float = 0.005     # excess transfer time per step at least this share of the step time
    min_step_fraction_p2p: float = 0.001  # ... for a pipeline pair's sends (a two-link path: a sharper witness)
    gate_ratio: float = 1.1              # job step time this far above baseline: irregularity's (0: ignore)
    early_score: float = 0.9             # the first-slowed communicators explained alone by a device this good
    complete_fraction: float = 0.9       # a step counts once this share of the ranks has reported it
    max_suspects: int = 5
    probe_round_ranks: int = 64          # tied devices: ranks whose CommOps are fetched per round (refine) ...
    probe_rounds: int = 4                # ... and rounds at most, each only while the suspects still tie
    port_counters: bool = True           # NIC links still tied: their ports' counters decide (ports.py) ...
    port_errors_per_s: float = 0.1       # ... a port degraded with link errors at >= this rate in the episode
    port_error_rise: float = 2.0         # ... and >= this x its own rate before
    port_wait_rise: float = 1.5          # top suspect a NIC link: its leaf congested when NICs under it wait this
    port_wait_share: float = 0.6         # ... x longer per byte sent, this share of them, and their rise is
    port_wait_contrast: float = 2.0      # ... this x the rise elsewhere (ports.promote_leaf)

    def validate(self) -> None:
        super().validate()
        if not 1 <= self.probe_round_ranks <= 4096 or not 1 <= self.probe_rounds <= 64:
            raise ConfigError("need 1 <= probe_round_ranks <= 4096 and 1 <= probe_rounds <= 64")
        if not 1.0 < self.ratio <= 10.0:
            raise ConfigError(f"ratio must be within (1, 10], got {self.ratio}")
        if not 0.0 <= self.noise_k <= 100.0:
            raise ConfigError(f"noise_k must be within [0, 100], got {self.noise_k}")
        if not 1 <= self.recent_steps <= 1000:
            raise ConfigError(f"recent_steps must be within 1..1000, got {self.recent_steps}")
        if not 2 <= self.fluctuation_min <= self.fluctuation_steps <= 1000:
            raise ConfigError("need 2 <= fluctuation_min <= fluctuation_steps <= 1000")
        if not 2 <= self.min_baseline_steps <= self.baseline_steps <= 100_000:
            raise ConfigError("need 2 <= min_baseline_steps <= baseline_steps <= 100000")
        for name in ("min_step_fraction", "min_step_fraction_p2p"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be within [0, 1), got {getattr(self, name)}")
        if self.gate_ratio != 0 and not 1.0 < self.gate_ratio <= 10.0:
            raise ConfigError(f"gate_ratio must be 0 or within (1, 10], got {self.gate_ratio}")
        if not 0.0 < self.complete_fraction <= 1.0:
            raise ConfigError(f"complete_fraction must be within (0, 1], got {self.complete_fraction}")
        if self.max_suspects < 1:
            raise ConfigError("max_suspects must be >= 1")
        if not 0.0 <= self.port_errors_per_s <= 1e9 or not 1.0 <= self.port_error_rise <= 1e6:
            raise ConfigError("need 0 <= port_errors_per_s and 1 <= port_error_rise")
        if not 1.0 <= self.port_wait_rise <= 1e6 or not 0.0 < self.port_wait_share <= 1.0 \
                or not 1.0 <= self.port_wait_contrast <= 1e6:
            raise ConfigError("need 1 <= port_wait_rise, 0 < port_wait_share <= 1 and 1 <= port_wait_contrast")
        if not 0.0 < self.early_score <= 1.01:
            raise ConfigError(f"early_score must be within (0, 1.01] (1.01: never), got {self.early_score}")


@dataclass(eq=False)
class Transfers:
    """Per communicator (a collective's id, a point-to-point one's sends `<id>#send`) and step index its min
    busy_ns over its members (0: absent or none busy): busy[n, k] for step idx[n] and comm cids[k]; members:
    the comms with >= 2 members and who they are. One array, not a dict per comm: at 8,192 GPUs a window has
    ~18k communicators x 60 steps."""
    busy: np.ndarray
    idx: list[int]
    cids: list[str]
    members: dict[str, set[int]]

    def per(self, cid: str) -> dict[int, int]:
        """step index -> transfer time of one comm, its busy steps only."""
        k = self.cids.index(cid)
        return {i: b for i, b in zip(self.idx, self.busy[:, k].tolist()) if b > 0}


def transfer_times(js, numbers_idx: range) -> Transfers:
    """The window's transfer times (irregularity.groups: the steps grouped once per pass; each step's result
    memoized across passes: irregularity.per_step), comms in the order steps bring them."""
    col: dict[str, int] = {}
    members: dict[str, set[int]] = {}
    where: dict[int, np.ndarray] = {}   # layout id -> its comms' columns
    steps = []
    for i in numbers_idx:
        lay, busy = per_step(js, "transfer", i, lambda i: _step_transfer(js, i))
        steps.append((lay, busy))
        if id(lay) not in where:
            for cid, ranks in lay:
                members.setdefault(cid, set()).update(ranks)
            where[id(lay)] = np.array([col.setdefault(cid, len(col)) for cid, _ in lay], dtype=np.int64)
    out = np.zeros((len(steps), len(col)), dtype=np.int64)
    for n, (lay, busy) in enumerate(steps):
        out[n, where[id(lay)]] = busy
    return Transfers(out, list(numbers_idx), list(col), {c: m for c, m in members.items() if len(m) >= 2})


LAYOUTS_KEY = ("commtime", "layouts")


def _step_transfer(js, i: int) -> tuple[tuple, np.ndarray]:
    """One step of transfer_times(): its comms ((comm, members), the same tuple for every step with the same
    ones: interned on js.memo) and their min busy_ns (0: none busy)."""
    lay, sel = [], []
    for j, (cid, (ranks, _, _)) in enumerate(groups(js, i).items()):
        if not cid.endswith(NOT_TRANSFER):  # a receive's busy time is mostly waiting for its sender
            lay.append((cid, tuple(ranks)))
            sel.append(j)
    return interned(js, LAYOUTS_KEY, tuple(lay)), step_busy(js, i)[sel]


MAD_SIGMA = 1.4826   # a normal distribution's sigma per median absolute deviation


def baseline(series: list[tuple[int, int]], cfg: CommtimeConfig, k: float | None = None,
             min_excess: float = 0.0) -> tuple[float, list[bool], list[float]]:
    """Each value's flag against the trailing baseline in force when it came: the median b and the noise
    sigma = 1.4826 x MAD of the last baseline_steps unflagged values; flagged when v - b >= max((ratio - 1) x
    b, k x sigma, min_excess) (k: cfg.noise_k). Returns (the last baseline, flags, each value's ratio to the
    baseline then, 0.0 before min_baseline_steps values). The MAD is re-taken every 8 values (cost)."""
    vals = np.array([[float(v) for _, v in series]]).reshape(1, len(series))
    base, flags, ratios = baselines(vals, np.array([len(series)]), cfg, k, min_excess)
    return float(base[0]), flags[0].tolist(), ratios[0].tolist()


def baselines(vals: np.ndarray, lens: np.ndarray, cfg: CommtimeConfig, k: float | None = None,
              min_excess: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """baseline() of many series at once: row r's series is vals[r, :lens[r]]; (last baselines, flags, ratios)
    as arrays, the same values baseline() gives each. The trailing values are a ring of NaN-padded slots per
    row; a median is taken from the row sorted (NaN last), so it is the one statistics.median gives."""
    k = cfg.noise_k if k is None else k
    rows, width = vals.shape
    size = max(1, min(cfg.baseline_steps, width))   # a row never holds more than its own values
    hist = np.full((rows, size), np.nan)
    cnt = np.zeros(rows, dtype=np.int64)
    ptr = np.zeros(rows, dtype=np.int64)
    stale = np.zeros(rows, dtype=np.int64)
    b = np.zeros(rows)
    sig = np.zeros(rows)
    flags = np.zeros((rows, width), dtype=bool)
    ratios = np.zeros((rows, width))
    every = np.arange(rows)
    for j in range(width):
        active = lens > j
        ready = active & (cnt >= cfg.min_baseline_steps)
        redo = every[ready & (stale <= 0)]
        if len(redo):
            b[redo] = _medians(hist[redo], cnt[redo])
            sig[redo] = MAD_SIGMA * _medians(np.abs(hist[redo] - b[redo, None]), cnt[redo])
            stale[redo] = 8
        stale[ready] -= 1
        v = vals[:, j]
        with np.errstate(divide="ignore", invalid="ignore"):
            f = ready & (v - b >= np.maximum(np.maximum((cfg.ratio - 1.0) * b, k * sig), min_excess))
            ratios[:, j] = np.where(ready & (b != 0), v / np.where(b != 0, b, 1.0), 0.0)
        flags[:, j] = f
        add = every[active & ~f]
        hist[add, ptr[add]] = v[add]
        ptr[add] = (ptr[add] + 1) % size
        cnt[add] = np.minimum(cnt[add] + 1, size)
        young = add[(stale[add] > 0) & (cnt[add] < cfg.min_baseline_steps + 8)]
        stale[young] = 0   # a young baseline moves fast: re-take it
    full = every[cnt >= cfg.min_baseline_steps]
    last = np.zeros(rows)
    if len(full):
        last[full] = _medians(hist[full], cnt[full])
    return last, flags, ratios


def _medians(x: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Per row, the median of its n non-NaN values (NaN sorts last), as statistics.median takes it."""
    s = np.sort(x, axis=1)
    r = np.arange(len(s))
    return (s[r, (n - 1) // 2] + s[r, n // 2]) / 2


def slow_spans(flags: list[bool], cfg: CommtimeConfig) -> list[tuple[int, int, str]]:
    """Where a communicator was slow, as (first, last, pattern) positions in its series: a run of >=
    recent_steps flagged values (one-step gaps allowed) is `persistent` when >= 80 % of it is flagged,
    `fluctuating` otherwise or when another run follows within fluctuation_steps (merged); so are >=
    fluctuation_min flagged values within fluctuation_steps outside such runs; spans within fluctuation_steps
    of each other are one (`fluctuating`). A lone flagged value is noise or a spike, not a slow device."""
    idx = [i for i, f in enumerate(flags) if f]
    out: list[list] = []
    run: list[int] = []
    for i in idx + [None]:
        if run and (i is None or i - run[-1] > 2):
            if len(run) >= 3 and run[1] - run[0] > 1 and run[2] - run[1] == 1:
                run.pop(0)  # a lone flag, a gap, then a slowdown flagged step after step: the lone flag is noise,
                            # not its onset (a 1.2x leaf from step 38 flagged 36, 38, 39, ...)
            if len(run) >= cfg.recent_steps:
                dense = len(run) >= 0.8 * (run[-1] - run[0] + 1)
                if out and run[0] - out[-1][1] <= cfg.fluctuation_steps:  # slow, better, slow again: one span
                    out[-1][1], out[-1][2] = run[-1], "fluctuating"
                else:
                    out.append([run[0], run[-1], "persistent" if dense else "fluctuating", True])
            run = []
        if i is not None:
            run.append(i)
    # the flagged values outside the runs (within 2 steps of a run they are its own), counted on their own, so
    # the bursts after a run count even where a window over them reaches into the run (a 1.2x GPU with a period
    # of 12 flagged 35-38, 45-49, 59-62: one span)
    rest = [i for i in idx if not any(x[0] - 2 <= i <= x[1] + 2 for x in out)]
    lo = 0
    for hi, i in enumerate(rest):
        while i - rest[lo] >= cfg.fluctuation_steps:
            lo += 1
        if hi - lo + 1 >= cfg.fluctuation_min:
            a, b = rest[lo], i
            if out and not out[-1][3] and a <= out[-1][1] + cfg.fluctuation_steps:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b, "fluctuating", False])
    merged: list[list] = []
    for a, b, p, _ in sorted(out):  # spans within fluctuation_steps of each other: one, slow on and off
        if merged and a - merged[-1][1] <= cfg.fluctuation_steps:
            merged[-1][1], merged[-1][2] = max(b, merged[-1][1]), "fluctuating"
        else:
            merged.append([a, b, p])
    return [(a, b, p) for a, b, p in merged]


def slow_comms(tr: Transfers, step_ns: float, cfg: CommtimeConfig) -> list[dict]:
    """Every slow span of every communicator: {comm, first, last (step indexes), pattern, ratio (median over
    its flagged steps), baseline_ns, flagged}; a span whose median excess is < min_step_fraction of the step
    is left out (a 20 % rise on a communicator that takes 0.1 % of the step is noise). A comm's series is its
    busy steps; comms go in the order of their first busy step. The baselines of all comms run at once
    (baselines); the spans are taken for those with a flag only."""
    busy = tr.busy
    if not busy.size:
        return []
    nz = busy > 0
    have = nz.sum(axis=0)
    lo = np.where(nz, busy, np.iinfo(np.int64).max).min(axis=0)
    hi = busy.max(axis=0)
    frac = np.array([cfg.min_step_fraction_p2p if c.endswith(SEND) else cfg.min_step_fraction for c in tr.cids])
    floor = frac * step_ns
    ok = np.array([c in tr.members for c in tr.cids], dtype=bool) & (have >= cfg.min_baseline_steps +
                                                                      cfg.fluctuation_min)
    # no value can be flagged (a baseline is >= the lowest value) or matter: exact, and cheap
    ok &= (hi - lo >= floor) & (hi >= cfg.ratio * lo)
    first = np.where(nz.any(axis=0), nz.argmax(axis=0), len(tr.idx))
    cand = [k for k in np.lexsort((np.arange(len(tr.cids)), first)).tolist() if ok[k]]
    if not cand:
        return []
    sub_nz = nz[:, cand].T
    lens = sub_nz.sum(axis=1)
    pos = np.argsort(~sub_nz, axis=1, kind="stable")   # each row's busy steps first, in order
    vals = np.take_along_axis(busy[:, cand].T, pos, axis=1).astype(np.float64)
    _, flags, ratios = baselines(vals, lens, cfg)
    out = []
    for r in np.flatnonzero(flags.any(axis=1)).tolist():
        k, n = cand[r], int(lens[r])
        steps = [tr.idx[j] for j in pos[r, :n].tolist()]
        fl, rt, vs = flags[r, :n].tolist(), ratios[r, :n].tolist(), vals[r, :n].tolist()
        for a, b, pattern in slow_spans(fl, cfg):
            hit = [j for j in range(a, b + 1) if fl[j]]
            rr = median(rt[j] for j in hit)
            b0 = vs[hit[0]] / rt[hit[0]] if rt[hit[0]] else 0.0
            if not b0 or (rr - 1.0) * b0 < floor[k]:
                continue
            out.append({"comm": tr.cids[k], "first": steps[a], "last": steps[b], "pattern": pattern,
                        "ratio": rr, "baseline_ns": b0, "flagged": [steps[j] for j in hit]})
    return out


def episodes(spans: list[dict], gap: int) -> list[list[dict]]:
    """Slow spans grouped into episodes: spans that overlap (within gap steps) are one network problem."""
    out: list[list[dict]] = []
    end = -1 << 30
    for sp in sorted(spans, key=lambda x: (x["first"], x["last"])):
        if out and sp["first"] <= end + gap:
            out[-1].append(sp)
            end = max(end, sp["last"])
        else:
            out.append([sp])
            end = sp["last"]
    return out


def detect(reader, window: Window, cfg: CommtimeConfig) -> list[Finding]:
    js = load(reader, window, IrregularityConfig(complete_fraction=cfg.complete_fraction))
    n = len(js.numbers)
    if n < cfg.min_baseline_steps + cfg.fluctuation_min:
        return []
    step_ns = median(js.x_ns)
    tr = transfer_times(js, range(n))
    members = tr.members
    spans = slow_comms(tr, step_ns, cfg)
    if not spans:
        return []
    job_flag, job_ratio = [False] * n, [0.0] * n
    if cfg.gate_ratio:
        _, job_flag, job_ratio = baseline(list(enumerate(js.x_ns)), CommtimeConfig(
            ratio=cfg.gate_ratio, noise_k=0.0, baseline_steps=cfg.baseline_steps,
            min_baseline_steps=cfg.min_baseline_steps))
    topo, nic_of = nic_map(reader, window.job_key, js)
    out = []
    for ep in episodes(spans, cfg.fluctuation_steps):
        flagged = sorted({i for sp in ep for i in sp["flagged"]})
        if cfg.gate_ratio and _left_to_irregularity(js, ep, {sp["comm"]: tr.per(sp["comm"]) for sp in ep}, flagged,
                                                    job_flag, job_ratio, cfg.recent_steps):
            continue
        found = explain(reader, window, js, ep, members, topo, nic_of, job_flag, cfg)
        lead = found[0][0][0] if found and found[0][0] else None
        for k, (sus, part, pev) in enumerate(found):
            out.append(_finding(js, part, sus, pev, members, step_ns, cfg, n,
                                f"{lead.kind} {lead.id}" if k and lead else ""))
    return out


def _left_to_irregularity(js, ep: list[dict], trans: dict[str, dict[int, int]], flagged: list[int],
                          job_flag: list[bool], job_ratio: list[float], before: int) -> bool:
    """True when the irregularity gate fires on most of the episode's steps and the slow communicators explain
    the job's slowdown (its excess step time <= 2x their largest excess transfer time, median over those
    steps): irregularity then localizes the same devices. A job slowed far beyond what the slow communicators
    cost (a slow GPU beside them) is not explained by them: both findings are made. Nor is a job that was slow
    already on most of the `before` steps before they slowed (a slow GPU from step 29, a 3x link from 42: the
    link's rings were slow on half of the GPU's episode only, irregularity did not see them, and the link's
    excess matched the GPU's by chance)."""
    hit = [i for i in flagged if job_flag[i]]
    if len(hit) * 2 < len(flagged):
        return False
    first = min(sp["first"] for sp in ep)
    pre = range(max(0, first - before), first)
    if pre and sum(job_flag[i] for i in pre) * 2 > len(pre):
        return False
    job_x, comm_x = [], []
    for i in hit:
        job_x.append(js.x_ns[i] - js.x_ns[i] / job_ratio[i] if job_ratio[i] else 0.0)
        comm_x.append(max((trans[sp["comm"]].get(i, 0) - sp["baseline_ns"] for sp in ep), default=0.0))
    return median(job_x) <= 2.0 * max(0.0, median(comm_x))


def explain(reader, window: Window, js, ep: list[dict], members: dict[str, set[int]], topo, nic_of, job_flag,
            cfg: CommtimeConfig, max_causes: int = 3) -> list[tuple[list, list[dict], dict | None]]:
    """The root causes of one episode's slow communicators, greedily: score every device over the slow ones
    (score_devices; ties broken by progressive fetching, refine), the first-slowed ones alone where one device
    explains them (early_score), take the best, set aside the slow communicators whose paths it is on, and
    score again over the rest (a slow link beside a congested switch elsewhere, two bad links at once), up to
    max_causes. Each cause: (its suspects, its spans, probe evidence)."""
    out = []
    rest = list(ep)
    rounds = 0
    explained: set[str] = set()  # communicators an earlier cause explains: slow, so no alibi for the next one
    while rest and len(out) < max_causes and rounds < 2 * max_causes:  # a merged left-over adds no cause: bounded
        rounds += 1
        first = min(sp["first"] for sp in rest)
        # the spans that began first (within recent_steps), where one device alone explains them (no tie, a
        # score >= early_score): that device first, the communicators that slowed later neither evidence nor
        # alibi yet (two links under one leaf slow from steps 44 and 49, at 1.5x and 2.1x: the leaf explained
        # all four slow rings best and was named for the second link). Not when the first spans tie (a congested
        # leaf's rings slow a few steps apart: each early one ties its own links, the leaf explains them all)
        sus = None
        early = [sp for sp in rest if sp["first"] < first + cfg.recent_steps]
        if len(early) < len(rest):
            later = {sp["comm"] for sp in rest} - {sp["comm"] for sp in early}
            slow, among, flagged = _scope(early, members, explained | later)
            e_sus = sorted(score_devices(slow, among, js.node_of, topo, nic_of), key=lambda s: -s.score)
            if e_sus and e_sus[0].score >= cfg.early_score and (len(e_sus) == 1 or e_sus[1].score < e_sus[0].score):
                sus = e_sus
        if sus is None:   # all of the rest at once
            slow, among, flagged = _scope(rest, members, explained)
            sus = score_devices(slow, among, js.node_of, topo, nic_of)
        ref = [i for i in range(first) if not job_flag[i]][-cfg.baseline_steps:]
        sus, pev = refine(reader, window.job_key, js, sus, slow, among, topo, nic_of, ref, flagged,
                          round_ranks=cfg.probe_round_ranks, rounds=cfg.probe_rounds)
        if cfg.port_counters and flagged:   # NIC links still tied: what their own ports say (ports.py)
            on, off = js.start_ns[flagged[0]], js.end_ns[flagged[-1]]
            sus = ports.break_tie(reader, topo, sus, on, off, cfg.port_errors_per_s, cfg.port_error_rise)
            # a NIC link on top, its leaf congested by the ports' transmit wait: the leaf
            early = js.end_ns[flagged[min(len(flagged), cfg.recent_steps) - 1]]
            sus = ports.promote_leaf(reader, topo, sus, nic_of.values(), on, off, cfg.port_wait_rise,
                                     cfg.port_wait_share, cfg.port_wait_contrast, early_ns=early)
        sus.sort(key=lambda s: (-s.score, s.kind, s.id))
        if not sus:
            if not out:
                out.append(([], rest, pev))
            break
        top = (sus[0].kind, sus[0].id)
        mine = [sp for sp in rest if sp["comm"] in members and
                top in comm_devices(topo, nic_of, js.node_of, members[sp["comm"]])]
        if not mine:  # the best device is on no slow communicator's path (a fetched pair's): all of them
            mine = rest
        taken = {id(sp) for sp in mine}
        explained |= {sp["comm"] for sp in mine}
        rest = [sp for sp in rest if id(sp) not in taken]
        mine, outside = split_outside(mine, cfg)
        same = next((k for k, (s0, _, _) in enumerate(out) if s0 and (s0[0].kind, s0[0].id) == top), None)
        if same is not None:  # a left-over span the same device explains again: that cause's, not a new one
            out[same] = (out[same][0], out[same][1] + mine, out[same][2])
        else:
            out.append((sus[:cfg.max_suspects], mine, pev))
        rest += outside
    return out


def _scope(spans: list[dict], members: dict[str, set[int]], leave_out: set[str]):
    """(slow communicator -> ratio, the communicators to score over, the flagged steps) for these spans; the
    communicators in leave_out count only when slow here."""
    slow: dict[str, float] = {}
    for sp in spans:
        slow[sp["comm"]] = max(slow.get(sp["comm"], 0.0), sp["ratio"])
    among = {c: m for c, m in members.items() if c in slow or c not in leave_out}
    return slow, among, sorted({i for sp in spans for i in sp["flagged"]})


def split_outside(mine: list[dict], cfg: CommtimeConfig) -> tuple[list[dict], list[dict]]:
    """A cause's spans cut to when the cause was on: its core is the median first to the median last step of
    its spans; a span slow for >= recent_steps flagged steps before or after the core (a pipeline pair that
    crosses a congested switch and a bad link on its own that began earlier or lasted longer) keeps only the
    core part, the parts outside go back to be explained (split spans keep their ratio and baseline). Returns
    (the cause's spans, the parts outside). One span alone has nothing to be cut against."""
    if len(mine) < 2:
        return mine, []
    firsts = sorted(sp["first"] for sp in mine)
    lasts = sorted(sp["last"] for sp in mine)
    lo, hi = firsts[len(firsts) // 2], lasts[len(lasts) // 2]  # no margin: recent_steps guards the cut
    kept, outside = [], []
    for sp in mine:
        before = [i for i in sp["flagged"] if i < lo]
        after = [i for i in sp["flagged"] if i > hi]
        core = [i for i in sp["flagged"] if lo <= i <= hi]
        cut = False
        for part in (before, after):
            if len(part) >= cfg.recent_steps and core:
                outside.append({**sp, "first": part[0], "last": part[-1], "flagged": part})
                cut = True
            else:
                core = sorted(core + part)
        if cut:
            sp = {**sp, "first": core[0], "last": core[-1], "flagged": core}
        kept.append(sp)
    return kept, outside


def _finding(js, part: list[dict], sus: list, pev: dict | None, members: dict[str, set[int]], step_ns: float,
             cfg: CommtimeConfig, n: int, concurrent_with: str) -> Finding:
    slow: dict[str, float] = {}
    for sp in part:
        slow[sp["comm"]] = max(slow.get(sp["comm"], 0.0), sp["ratio"])
    first = min(sp["first"] for sp in part)
    last = max(sp["last"] for sp in part)
    flagged = sorted({i for sp in part for i in sp["flagged"]})
    sev = max(slow.values())
    pattern = "persistent" if any(sp["pattern"] == "persistent" for sp in part) else "fluctuating"
    ongoing = last >= n - 1 - 2
    top = f"; top suspect {sus[0].kind} {sus[0].id}" if sus else ""
    port = sus[0].evidence.get("port", {}) if sus else {}
    if port.get("degraded"):   # what its own port says (ports.py), where that decided or confirms
        top += f" (its port {port['port']}: {port['why']})"
    wait = sus[0].evidence.get("xmit_wait", {}) if sus else {}
    if wait.get("congested"):   # a leaf whose NICs' transmit wait says congested (ports.promote_leaf)
        top += f" ({wait['why']})"
    also = f", concurrent with {concurrent_with}" if concurrent_with else ""
    worst = sorted(slow, key=lambda c: -slow[c])
    summary = (f"{len(slow)} communicator(s) transfer {'slowly' if pattern == 'persistent' else 'erratically'}: "
               f"up to {sev:.2f}x their baseline transfer time over steps {js.numbers[first]}-{js.numbers[last]}"
               f"{'' if ongoing else ' (over)'} (severity is this transfer-time ratio; job step time "
               f"{step_ns / 1e6:.1f} ms){top}{also}.")
    by = {sp["comm"]: sp for sp in part}
    ev = {"first_step": js.numbers[first], "last_step": js.numbers[last], "pattern": pattern, "ongoing": ongoing,
          "flagged_steps": [js.numbers[i] for i in flagged[-50:]], "ratio": cfg.ratio, "noise_k": cfg.noise_k,
          "step_ns": int(step_ns),
          "slow_comms": {c: {"ratio": round(slow[c], 3), "baseline_ns": int(by[c]["baseline_ns"]),
                             "pattern": by[c]["pattern"]} for c in worst[:10]},
          "slow_count": len(slow), "comms": len(members), **({"probe": pev} if pev else {})}
    if concurrent_with:
        ev["concurrent_with"] = concurrent_with
    return Finding(kind="network", onset_ns=js.start_ns[first], last_ns=js.end_ns[last], severity=round(sev, 4),
                   summary=summary, suspects=tuple(sus), evidence=ev)


SPEC = DetectorSpec(
    name="commtime",
    description="communicators whose transfer time (min busy time over members) rose against their own "
                "baseline, localized to NICs, links and switches over their paths",
    kinds=("network",),
    config_class=CommtimeConfig,
    detect=detect,
)
