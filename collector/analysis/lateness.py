"""Per-rank lateness: a GPU slower than its peers that the job's step time does not show.

Reads the window's Step records (per-communicator summaries with issue offsets) through irregularity.load;
nothing else. Pure: `detect(reader, window, cfg) -> list[Finding]`, no writes, no clock, no state across
windows.

Why: the job's step time is its slowest rank's. A second GPU slowing while another is already slower (a
fluctuating GPU under a degrading one), or a GPU fluctuating a little, moves nothing the irregularity gate
sees; the rank still arrives later than its peers at every collective it joins.
Margins of rank r in step s: per collective communicator it joins, its mean arrival (start_ns + issue offset,
over the step's picked collectives) minus the members' median arrival (irregularity.margin_arrays).
Flags per rank and step: per communicator a trailing median and noise (1.4826 x MAD) of its unflagged
margins; flagged when the rank is late by >= noise_k_every x that noise in every communicator it joins (so a
rank that only waited for someone upstream, late into its data-parallel group but on time with its
tensor-parallel peers who waited alike, is not late), by >= noise_k x in one of them at least (a wide group's
margins are noisier: at 8,192 GPUs a 1.12x GPU was 5-7 sigma late into its group of 4 and 3-6 into its group of
256 on every slow step), and the waiting it causes, summed over them (excess x
collectives per step), is >= min_step_fraction of the job's baseline step. Ranks in fewer than two collective
communicators are not judged (TP = 1: nothing tells a slow rank from one waiting on its pipeline). Slow spans
as the commtime detector finds them (commtime.slow_spans: persistent runs, fluctuating bursts, anywhere in the
window).
Not duplicated: a span that an irregularity finding leading with this rank overlaps is that finding's
(irregularity.named_ranks: the same pass's result, kept on the reader, or computed here); what remains are
masked ranks (late, but someone else is later) and fluctuations under the gate. The evidence says how much of
the span the job's step time was irregular (gate-flagged or in a level shift) and whether the rank was last.
Finding: kind `fluctuation` (a fluctuating span) or `slowdown` (persistent), one per rank span; severity =
1 + the median waiting it causes over its flagged steps / the baseline step: the step-time ratio this
rank alone would cost (the summary says so); suspect: the rank, cause `compute`; evidence: its span, flagged
steps, the waiting it causes, and `masked_by`: the rank an irregularity finding blames over the same steps.
Steps judged: up to the newest step that every rank has reported (at most max_lag_steps back): a pass takes a
step once complete_fraction of the ranks reported it, and a rank whose margins miss a judged step is not judged,
while the rank without the newest step is the slow one more often than not (it ends its steps last).
Cost: the margins of the window's last steps (irregularity.step_margins, memoized per step, so a pass computes
its new steps only) as one array per communicator, every rank's first flag found for all ranks at once in numpy
(first_flags), flags() only for those; capped so ranks x steps <= max_rank_steps (at 8,192 ranks: the last 61
steps; the evidence says how many steps were judged). A short window is a weak baseline: at 8,192 GPUs the last
24 steps left 10 for the baseline, a noise flag 7 steps before a 2.16x GPU's first burst became its onset, and
a 1.13x GPU fluctuating with a period of 12 showed one of its two bursts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from statistics import median

import numpy as np

from steplens.collector.analysis.base import ConfigError, DetectorConfig, DetectorSpec, Window
from steplens.collector.analysis.commtime import MAD_SIGMA, slow_spans
from steplens.collector.analysis.findings import Finding, Suspect
from steplens.collector.analysis.irregularity import IrregularityConfig, gate, load, margin_arrays, named_ranks


@dataclass
class LatenessConfig(DetectorConfig):
    noise_k: float = 5.0                 # flagged when above its own lateness baseline by noise_k x its noise
    noise_k_every: float = 3.0           # ... in one communicator at least, and by noise_k_every x in all
    min_step_fraction: float = 0.02      # ... and by at least this share of the job's baseline step
    recent_steps: int = 5                # a run of >= this many flagged steps is a persistent span
    fluctuation_steps: int = 16          # >= fluctuation_min flagged steps within this many: fluctuating
    fluctuation_min: int = 4
    baseline_steps: int = 100            # trailing unflagged steps in a rank's lateness baseline
    min_baseline_steps: int = 10         # no verdict before this many
    max_rank_steps: int = 500_000        # ranks x steps judged per window at most (the last steps)
    complete_fraction: float = 0.9       # a step counts once this share of the ranks has reported it
    max_collectives_per_step: int = 16   # issue offsets used per communicator and step
    max_lag_steps: int = 3               # newest steps some rank has not reported yet: judged at a later pass

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.noise_k <= 100.0:
            raise ConfigError(f"noise_k must be within [0, 100], got {self.noise_k}")
        if not 0.0 <= self.noise_k_every <= self.noise_k:
            raise ConfigError(f"noise_k_every must be within [0, noise_k], got {self.noise_k_every}")
        if not 0.0 < self.min_step_fraction < 1.0:
            raise ConfigError(f"min_step_fraction must be within (0, 1), got {self.min_step_fraction}")
        if not 2 <= self.fluctuation_min <= self.fluctuation_steps <= 1000 or not 1 <= self.recent_steps <= 1000:
            raise ConfigError("need 2 <= fluctuation_min <= fluctuation_steps <= 1000 and 1 <= recent_steps <= 1000")
        if not 2 <= self.min_baseline_steps <= self.baseline_steps <= 100_000:
            raise ConfigError("need 2 <= min_baseline_steps <= baseline_steps <= 100000")
        if self.max_rank_steps < 1000:
            raise ConfigError("max_rank_steps must be >= 1000")
        if not 0.0 < self.complete_fraction <= 1.0:
            raise ConfigError("complete_fraction must be within (0, 1]")
        if self.max_collectives_per_step < 1:
            raise ConfigError("max_collectives_per_step must be >= 1")
        if not 0 <= self.max_lag_steps <= 100:
            raise ConfigError(f"max_lag_steps must be within [0, 100], got {self.max_lag_steps}")


def flags(cols: list[list[tuple[float, int]]], step_ns: list[float], cfg: LatenessConfig) -> tuple[list[bool],
                                                                                                   list[float]]:
    """Per step: flagged when the rank is late against its own history into every collective communicator it
    joins (margin - trailing median >= noise_k x that comm's noise, 1.4826 x MAD over its unflagged steps,
    re-taken every 4 steps) and the waiting it causes, summed over them (excess x collectives per step), is
    >= min_step_fraction x the job's baseline step (step_ns: 0 before there is one). Returns (flags, the
    waiting it causes per step, ns)."""
    hist = [deque(maxlen=cfg.baseline_steps) for _ in cols]
    stats = [(0.0, 0.0)] * len(cols)
    out, cost = [], []
    stale = 0
    for p, base in enumerate(step_ns):
        f, w = False, 0.0
        if len(hist[0]) >= cfg.min_baseline_steps and base:
            if stale <= 0:
                stats = [(b, MAD_SIGMA * median(abs(x - b) for x in h)) for h in hist for b in (median(h),)]
                stale = 4
            stale -= 1
            ex = [col[p][0] - b for col, (b, _) in zip(cols, stats)]
            w = sum(e * col[p][1] for e, col in zip(ex, cols))
            f = all(e > 0 and e >= cfg.noise_k_every * sd for e, (_, sd) in zip(ex, stats)) and \
                any(e >= cfg.noise_k * sd for e, (_, sd) in zip(ex, stats)) and \
                w >= cfg.min_step_fraction * base
        out.append(f)
        cost.append(w)
        if not f:
            for h, col in zip(hist, cols):
                h.append(col[p][0])
    return out, cost


def candidates(cols_of: dict[int, list[list[tuple[float, int]]]], step_ns: list[float],
               cfg: LatenessConfig) -> set[int]:
    """The ranks flags() may flag (first_flags() over ranks given as flags() takes them)."""
    out: set[int] = set()
    by_width: dict[int, list[int]] = {}
    for rank, cols in cols_of.items():
        by_width.setdefault(len(cols), []).append(rank)
    for ranks in by_width.values():
        vals = np.array([[[v for v, _ in col] for col in cols_of[r]] for r in ranks], dtype=np.float64)
        calls = np.array([[[k for _, k in col] for col in cols_of[r]] for r in ranks], dtype=np.float64)
        out.update(r for r, h in zip(ranks, first_flags(vals, calls, step_ns, cfg).tolist()) if h)
    return out


def first_flags(vals: np.ndarray, calls: np.ndarray, step_ns: list[float], cfg: LatenessConfig) -> np.ndarray:
    """Per rank (vals, calls: ranks x comms x steps, as flags() takes each rank's columns), whether flags() flags
    any step of it, for all ranks at once: a rank's histories are its every earlier value until its first flagged
    step, so one pass over all ranks, each step's medians over the same trailing values, finds every rank's first
    flag exactly (the same float operations as flags(): median of an even count is (a + b) / 2, the waiting
    summed comm by comm); only those ranks go through flags() (8,192 ranks: ~1 %)."""
    hit = np.zeros(len(vals), dtype=bool)
    stale, b, sd = 0, None, None
    for p, base in enumerate(step_ns):
        if p < cfg.min_baseline_steps or not base:
            continue
        if stale <= 0:
            h = vals[:, :, max(0, p - cfg.baseline_steps):p]
            b = np.median(h, axis=2)
            sd = MAD_SIGMA * np.median(np.abs(h - b[:, :, None]), axis=2)
            stale = 4
        stale -= 1
        ex = vals[:, :, p] - b
        w = np.zeros(len(vals))
        for c in range(vals.shape[1]):
            w = w + ex[:, c] * calls[:, c, p]
        hit |= np.all((ex > 0) & (ex >= cfg.noise_k_every * sd), axis=1) & np.any(ex >= cfg.noise_k * sd, axis=1) \
            & (w >= cfg.min_step_fraction * base)
    return hit


def detect(reader, window: Window, cfg: LatenessConfig) -> list[Finding]:
    icfg = IrregularityConfig(complete_fraction=cfg.complete_fraction,
                              max_collectives_per_step=cfg.max_collectives_per_step)
    js = load(reader, window, icfg)
    n = len(js.numbers)
    if n < cfg.min_baseline_steps + cfg.fluctuation_min or len(js.rows) < 4:
        return []
    g = gate(js.x_ns, icfg)
    irregular = [bool(f) for f in g.flag]  # the steps irregularity sees: flagged, or in a level shift
    for first, last, _, _ in g.degradations:
        for i in range(first, last + 1):
            irregular[i] = True
    # the newest steps not every rank has reported yet (a step is taken once complete_fraction of them did) are
    # left for the next pass: a rank's columns would lack them, so it would not be judged at all, and the rank
    # missing its newest step is the slow one more often than not (it ends last; at 8,192 GPUs a 1.84x
    # fluctuating GPU went unjudged in every pass). Up to max_lag_steps back; further, a rank stopped reporting.
    end = n
    while end > n - cfg.max_lag_steps and end > 1 and js.fps[end - 1][0] < len(js.rows):
        end -= 1
    if js.fps[end - 1][0] < len(js.rows):
        end = n
    steps = min(end, max(cfg.min_baseline_steps + cfg.fluctuation_min, cfg.max_rank_steps // len(js.rows)))
    idx = list(range(end - steps, end))
    arrs = margin_arrays(js, idx, icfg)
    if not arrs:
        return []
    # every comm's columns side by side (steps x members of all comms), and per rank its (comm, column) slots
    big = np.concatenate([v for _, v, _ in arrs.values()], axis=1)
    calls_of = np.stack([k for _, _, k in arrs.values()], axis=1)   # steps x comms
    full = ~np.isnan(big).any(axis=0)                                 # a value every judged step
    slots: dict[int, list[tuple[int, int, str]]] = {}
    top: dict[str, np.ndarray] = {}   # the latest arrival per communicator and step: who kept each group waiting
    at = 0
    for c, (cid, (mem, vals, _)) in enumerate(arrs.items()):
        for j, r in enumerate(mem):
            slots.setdefault(r, []).append((at + j, c, cid))
        ok = full[at:at + len(mem)]
        if ok.any():
            top[cid] = vals[:, ok].max(axis=1)
        at += len(mem)
    base_step = [g.base_ns[i] for i in idx]
    judged: dict[int, list[int]] = {}   # width -> ranks; a rank in >= 2 comms with a value every step
    for rank, sl in slots.items():
        if len(sl) >= 2 and all(full[k] for k, _, _ in sl):
            judged.setdefault(len(sl), []).append(rank)
    maybe: list[int] = []
    for ranks in judged.values():
        cols = np.array([[k for k, _, _ in slots[r]] for r in ranks])
        cix = np.array([[c for _, c, _ in slots[r]] for r in ranks])
        hit = first_flags(big[:, cols].transpose(1, 2, 0), calls_of[:, cix].transpose(1, 2, 0), base_step, cfg)
        maybe += [r for r, h in zip(ranks, hit.tolist()) if h]
    named = None
    out = []
    for rank in sorted(maybe):   # never flagged otherwise (first_flags() is exact)
        cids = [cid for _, _, cid in slots[rank]]
        cols = [list(zip(big[:, k].tolist(), calls_of[:, c].tolist())) for k, c, _ in slots[rank]]
        fl, cost = flags(cols, base_step, cfg)
        if not any(fl):
            continue
        if named is None:
            named = named_ranks(reader, window, icfg)
        for a, b, pattern in slow_spans(fl, cfg):
            hit = [p for p in range(a, b + 1) if fl[p]]
            gated = sum(irregular[idx[p]] for p in hit) / len(hit)
            is_last = [all(cols[k][p][0] >= top[c][p] - 1000 for k, c in enumerate(cids)) for p in hit]
            first, last_i = idx[a], idx[b]
            if any(r == str(rank) and on <= js.end_ns[last_i] and js.start_ns[first] <= end
                   for r, on, end in named):
                continue  # an irregularity finding over these steps leads with this rank already
            ongoing = b >= steps - 3
            excess = median(cost[p] for p in hit)
            base = median(base_step[p] for p in hit) or median(js.x_ns)
            sev = 1.0 + max(0.0, excess) / base
            # the job's own slowdown meanwhile, as irregularity names it: what hid this rank
            by = next((r for r, on, end in named if r != str(rank) and on <= js.end_ns[last_i]
                       and js.start_ns[first] <= end), None)
            kind = "fluctuation" if pattern == "fluctuating" else "slowdown"
            summary = (f"Rank {rank} arrives later than usual at every collective it joins, keeping its groups "
                       f"waiting {excess / 1e6:.1f} ms more per step"
                       f"{' on and off' if kind == 'fluctuation' else ''} over steps {js.numbers[first]}-"
                       f"{js.numbers[last_i]}{'' if ongoing else ' (over)'}"
                       f"{f', hidden while rank {by} slows the job' if by is not None else ''} "
                       f"(severity {sev:.2f}: the step-time ratio it alone would cost).")
            out.append(Finding(
                kind=kind, onset_ns=js.start_ns[first], last_ns=js.end_ns[last_i], severity=round(sev, 4),
                summary=summary,
                suspects=(Suspect("rank", str(rank), 1.0, "compute", {"node": js.node_of.get(rank, ""),
                                                                      "comms": sorted(cids)}),),
                evidence={"first_step": js.numbers[first], "last_step": js.numbers[last_i], "pattern": pattern,
                          "ongoing": ongoing, "flagged_steps": [js.numbers[idx[p]] for p in hit][-50:],
                          "excess_waiting_ns": int(excess), "baseline_step_ns": int(base),
                          "gate_flagged_share": round(gated, 3), "steps_judged": steps,
                          "last_share": round(sum(is_last) / len(hit), 3),
                          **({"masked_by": str(by)} if by is not None else {})}))
    return out


SPEC = DetectorSpec(
    name="lateness",
    description="a rank late into every collective it joins against its own history, when the job's step "
                "time does not show it (masked by a slower rank, or fluctuating under the gate)",
    kinds=("fluctuation", "slowdown"),
    config_class=LatenessConfig,
    detect=detect,
)
