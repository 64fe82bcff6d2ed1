"""A job's step time now and its baseline, from whatever per-step data the store holds.

First the Step records (per-rank boundaries segmented on the agent, agent/steps.py): a rank's step time is the
time between the ends of its consecutive steps s-1 and s, and the job's step time for step s is the median
over its ranks. Where one rank has steps from several sources or kinds of evidence (Kineto's ProfilerStep
windows in a deep dive beside Flight Recorder's comm-pattern steps), one series per rank is used: `profiler`
evidence first, then the series with the most steps. Without Step records, the per-step comm summaries
(CommSummary with step >= 0, from the Kineto and Flight Recorder sources) in the same way: a rank's step s ends
with its last op of step s. With no per-step data, everything is None (`steplens jobs` prints "-"): no guess
from telemetry.
Baseline: the median of up to `baseline_steps` job step times before the newest `recent_steps` (Holmes §3.2's
trailing window, REC W = 100); step time now: the median of the newest `recent_steps`. Severity of a slowdown
= now / baseline. Cost: one indexed read of the window's summaries plus a sort per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median


@dataclass(frozen=True)
class StepTimes:
    source: str                      # "steps", "comm_summaries", "" when no data
    steps: list[tuple[int, int, float]]  # (step, end_ns, job step seconds), oldest first
    now_seconds: float | None
    baseline_seconds: float | None

    @property
    def ratio(self) -> float | None:
        if self.now_seconds is None or not self.baseline_seconds:
            return None
        return self.now_seconds / self.baseline_seconds

    def to_json(self) -> dict:
        return {"step_source": self.source or None, "steps": len(self.steps), "step_seconds": self.now_seconds,
                "baseline_step_seconds": self.baseline_seconds}


EVIDENCE_RANK = {"profiler": 0, "anchor": 1, "comm_pattern": 2}


def from_steps(rows: list[dict], **kw) -> StepTimes:
    """Job step times from Step rows (dicts with rank, step, end_ns, evidence, source), one series per rank."""
    series: dict[int, dict[tuple, list[dict]]] = {}
    for r in rows:
        if r["rank"] is None or r["rank"] < 0 or r["step"] is None or r["step"] < 0:
            continue
        series.setdefault(r["rank"], {}).setdefault((r["evidence"], r.get("source", "")), []).append(r)
    picked = []
    for per in series.values():
        best = min(per, key=lambda k: (EVIDENCE_RANK.get(k[0], 9), -len(per[k])))
        picked += per[best]
    out = _from_ends(picked, **kw)
    return StepTimes("steps", out.steps, out.now_seconds, out.baseline_seconds) if out.steps else out


def from_summaries(rows: list[dict], **kw) -> StepTimes:
    """Job step times from per-step comm summary rows (dicts with rank, step, end_ns)."""
    out = _from_ends(rows, **kw)
    return StepTimes("comm_summaries", out.steps, out.now_seconds, out.baseline_seconds) if out.steps else out


def _from_ends(rows: list[dict], recent_steps: int = 5, baseline_steps: int = 100,
               min_baseline_steps: int = 10) -> StepTimes:
    ends: dict[int, dict[int, int]] = {}
    for r in rows:
        if r["step"] is None or r["step"] < 0 or r["rank"] is None or r["rank"] < 0:
            continue
        per = ends.setdefault(r["rank"], {})
        if r["end_ns"] > per.get(r["step"], 0):
            per[r["step"]] = r["end_ns"]
    by_step: dict[int, list[tuple[int, int]]] = {}
    for per in ends.values():
        for s in sorted(per):
            if s - 1 in per and per[s] > per[s - 1]:
                by_step.setdefault(s, []).append((per[s] - per[s - 1], per[s]))
    steps = [(s, max(e for _, e in v), median(d for d, _ in v) / 1e9) for s, v in sorted(by_step.items())]
    if not steps:
        return StepTimes("", [], None, None)
    recent = steps[-recent_steps:]
    before = steps[:-recent_steps][-baseline_steps:]
    now = median(x[2] for x in recent)
    base = median(x[2] for x in before) if len(before) >= min_baseline_steps else None
    return StepTimes("", steps, now, base)


def step_times(reader, job_key: str, since_ns: int = 0, limit: int = 200_000, **kw) -> StepTimes:
    """The job's step times from the store (reader: queries.Reader): Step records first, else summaries."""
    if hasattr(reader, "steps"):
        out = from_steps(reader.steps(job_key, since_ns=since_ns, limit=limit), **kw)
        if out.steps:
            return out
    rows = reader.comm_summaries(job_key, since_ns=since_ns, limit=limit)
    return from_summaries(rows, **kw)
