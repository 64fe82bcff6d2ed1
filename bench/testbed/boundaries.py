"""Step boundary accuracy on the testbed: the agents' Step records in the collector's store against the job's own
per-rank step logs.

Reads <state>/collector.db (steps table, cluster time: the agents' monotonic clocks mapped by the collector)
and <state>/steps/rank<r>.jsonl (the job's wall clock: the same machine's CLOCK_REALTIME, so the two agree to
the collector's clock-offset estimate, tens of us here). Each stored step is matched to the logged step whose
end is nearest; per rank: the median |end error| as a fraction of the rank's median logged step time, the
constant phase (median signed error: what follows the boundary the agent sees, e.g. zero_grad after the
optimizer step), the error after removing it, and the median error of step durations (consecutive matched
ends). Cost: one read of the store and the logs, O(steps log steps).
"""

from __future__ import annotations

import bisect
from statistics import median

from . import faults, netns


def stored_steps(layout: netns.Layout, job_key: str) -> list[dict]:
    from steplens.collector.store.queries import Reader
    return Reader(layout.path("collector.db")).steps(job_key)


def job_key(layout: netns.Layout) -> str:
    """The job key the collector holds the testbed job's steps under (the one with the most Step records)."""
    from steplens.collector.store.queries import Reader
    jobs = Reader(layout.path("collector.db")).jobs()
    return max((j["job_key"] for j in jobs), key=lambda k: len(stored_steps(layout, k)), default="")


def _nearest(sorted_ends: list[int], t: int) -> int:
    i = bisect.bisect_left(sorted_ends, t)
    return min((k for k in (i - 1, i) if 0 <= k < len(sorted_ends)), key=lambda k: abs(sorted_ends[k] - t))


def figures(layout: netns.Layout, key: str, since_ns: int = 0, until_ns: int = 0,
            exclude: list[tuple[int, int]] = (), skip_first: int = 10) -> dict:
    """Per rank, over stored steps ending in [since_ns, until_ns] and outside every `exclude` window:
    {rank: {steps, step_ms, median_abs_error, phase_ms, median_error_after_phase, median_duration_error,
    evidence}}, plus "all": the median |error| fraction over every matched step of every rank.
    The job's first `skip_first` steps (connecting the pairs, up to ~1 s each) are not its rhythm: left out."""
    steps = stored_steps(layout, key)
    out: dict = {}
    every: list[float] = []
    world = len(netns.load_job(layout)["ranks"])
    for r in range(world):
        log = faults.read_steps(layout, r)[skip_first:]
        if not log:
            continue
        ends = sorted(x["end_ns"] for x in log)
        step_ns = median(x["end_ns"] - x["start_ns"] for x in log)
        mine = [s for s in steps if s["rank"] == r and ends[0] <= s["end_ns"] <= ends[-1]
                and since_ns <= s["end_ns"] and (not until_ns or s["end_ns"] <= until_ns)
                and not any(a <= s["end_ns"] <= b for a, b in exclude)]
        if not mine:
            out[r] = {"steps": 0}
            continue
        idx = [_nearest(ends, s["end_ns"]) for s in mine]
        err = [s["end_ns"] - ends[i] for s, i in zip(mine, idx)]
        phase = median(err)
        by_i = dict(zip(idx, mine))
        dur = [abs((s["end_ns"] - by_i[i - 1]["end_ns"]) - (ends[i] - ends[i - 1]))
               for i, s in by_i.items() if i - 1 in by_i]
        every += [abs(e) / step_ns for e in err]
        out[r] = {"steps": len(mine), "step_ms": round(step_ns / 1e6, 2),
                  "median_abs_error": round(median(abs(e) for e in err) / step_ns, 5),
                  "phase_ms": round(phase / 1e6, 3),
                  "median_error_after_phase": round(median(abs(e - phase) for e in err) / step_ns, 5),
                  "median_duration_error": round(median(dur) / step_ns, 5) if dur else None,
                  "evidence": sorted({s["evidence"] for s in mine})}
    out["all"] = {"steps": len(every), "median_abs_error": round(median(every), 5) if every else None}
    return out
