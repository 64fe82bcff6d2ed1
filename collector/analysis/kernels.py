"""XPUTimer's per-rank kernel metrics (ALGORITHMS.md §2.3), from KernelRec records (the agent's Kineto/CUPTI
parsers; in the collector, what FetchDetail brings from a rank's node-local store): computed per rank and
compared across ranks, to say *why* a rank is slow.

  issue latency    ④: t_start(GPU) - t_issue(CPU launch call start), per kernel with a launch; healthy: the
                   CPU runs ahead, kernels queue, latencies long and spread; a CPU stall (GC, a needless sync)
                   makes them short, the CDF rising steeply. distribution(): count, p10/p50/p90/p99/max and the
                   share under 50 µs (the recommended direct statistic); comm kernels (NCCL) apart.
  launch delay     HTA's figure beside it: kernel start - launch call end, clipped at 0.
  per kernel name  count, total, mean, p50, p99 duration: identical kernels compared across ranks (a slower
                   GPU, an underclocked one, shows in every name).
  minority void    ⑤ V_minority, the derived rule: per stream, kernels in start order, slot_k = max(0, start_k -
                   max(end_{k-1}, issue_k)) (launched, not started, nothing traced running on that stream), minus
                   the part covered by a traced kernel on another stream of the device; over the traced span.
  inter-step void  ⑤ V_inter per step: T_inter = the GPU's idle gap around the step's start boundary (the
                   dataloader's and the optimizer's Python between steps), V_inter = T_inter / T_step. Kernels
                   are split at the boundary by when they were *launched* (the CPU's order: XPUTimer's "last
                   kernel preceding the dataloader"), T_inter = first start of the kernels launched after it -
                   last end of those launched before, clipped at 0. by="gpu" splits by GPU times instead (last
                   kernel ending before the boundary, first starting after it): where the GPU lags the CPU it
                   measures a gap between two kernels of one step (the 1-rank HTA trace: 0.42 ms by GPU times,
                   0.8 µs by launches, the GPU running 66-90 ms behind its CPU). Step boundaries: ProfilerStep
                   spans of a Kineto trace, a rank's Step records in the collector.
  ks_distance      two-sample Kolmogorov-Smirnov distance, a rank's issue latencies against the others' (flag
                   D > 0.3 against a healthy reference, ALGORITHMS.md).
Pure functions of lists of records (objects with KernelRec's fields, or dicts with the same keys); no I/O.
Cost: O(kernels log kernels) per rank; inter_step_void O((kernels + steps) log kernels).
"""

from __future__ import annotations

import bisect

US = 1000


def _get(k, name):
    return k[name] if isinstance(k, dict) else getattr(k, name)


def _q(xs: list, q: float):
    """The q-quantile of sorted xs (nearest rank)."""
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


def is_comm(name: str) -> bool:
    return "nccl" in name.lower()


def issue_latencies(kernels, comm: bool | None = None) -> list[int]:
    """t_start(GPU) - t_issue(CPU launch) per kernel that has a launch (ns); comm: only NCCL kernels (True),
    only the others (False), all (None)."""
    out = []
    for k in kernels:
        ls = _get(k, "launch_start_mono_ns")
        if not ls:
            continue
        if comm is not None and is_comm(_get(k, "name")) != comm:
            continue
        out.append(_get(k, "start_mono_ns") - ls)
    return out


def launch_delays(kernels) -> list[int]:
    """HTA's launch delay per launched kernel: kernel start - launch call end, clipped at 0 (ns)."""
    return [max(0, _get(k, "start_mono_ns") - _get(k, "launch_end_mono_ns")) for k in kernels
            if _get(k, "launch_end_mono_ns")]


def distribution(values: list[int]) -> dict:
    xs = sorted(values)
    return {"count": len(xs), "p10_ns": _q(xs, 0.1), "p50_ns": _q(xs, 0.5), "p90_ns": _q(xs, 0.9),
            "p99_ns": _q(xs, 0.99), "max_ns": xs[-1] if xs else None,
            "below_50us_fraction": round(sum(1 for x in xs if x < 50 * US) / len(xs), 4) if xs else None}


def per_name(kernels) -> dict[str, dict]:
    """Kernel name -> count, total_ns, mean_ns, p50_ns, p99_ns of its durations; most total time first."""
    by: dict[str, list[int]] = {}
    for k in kernels:
        by.setdefault(_get(k, "name"), []).append(_get(k, "end_mono_ns") - _get(k, "start_mono_ns"))
    out = {}
    for name, ds in sorted(by.items(), key=lambda kv: (-sum(kv[1]), kv[0])):
        ds.sort()
        out[name] = {"count": len(ds), "total_ns": sum(ds), "mean_ns": sum(ds) // len(ds),
                     "p50_ns": _q(ds, 0.5), "p99_ns": _q(ds, 0.99)}
    return out


def _union(iv: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _covered(union: list[tuple[int, int]], starts: list[int], a: int, b: int) -> int:
    """ns of [a, b) covered by the sorted disjoint intervals union (starts: their starts)."""
    if b <= a:
        return 0
    i = max(0, bisect.bisect_right(starts, a) - 1)
    got = 0
    while i < len(union) and union[i][0] < b:
        lo, hi = max(a, union[i][0]), min(b, union[i][1])
        if hi > lo:
            got += hi - lo
        i += 1
    return got


def minority_void(kernels) -> dict:
    """V_minority over the trace, per device: the slots where a launched kernel waited with nothing traced
    running on its stream nor on another stream of the device, over the device's traced span."""
    by_dev: dict[int, list] = {}
    for k in kernels:
        by_dev.setdefault(_get(k, "device"), []).append(k)
    out = {}
    for dev, ks in sorted(by_dev.items()):
        streams: dict[int, list] = {}
        for k in ks:
            streams.setdefault(_get(k, "stream"), []).append(k)
        slots = 0
        for s, sk in streams.items():
            sk.sort(key=lambda k: _get(k, "start_mono_ns"))
            others = _union([(_get(k, "start_mono_ns"), _get(k, "end_mono_ns")) for k in ks
                             if _get(k, "stream") != s])
            starts = [a for a, _ in others]
            prev_end = None
            for k in sk:
                st, issue = _get(k, "start_mono_ns"), _get(k, "launch_start_mono_ns")
                if prev_end is not None and issue:
                    a = max(prev_end, issue)
                    if st > a:
                        slots += (st - a) - _covered(others, starts, a, st)
                prev_end = max(prev_end or 0, _get(k, "end_mono_ns"))
        span = max(_get(k, "end_mono_ns") for k in ks) - min(_get(k, "start_mono_ns") for k in ks)
        out[dev] = {"void_ns": slots, "span_ns": span, "v_minority": round(slots / span, 4) if span else 0.0}
    return out


def _step_bounds(s) -> tuple[int, int, int]:
    """(step, start, end) of a step given as a (step, start, end) tuple (the Kineto parser's ProfilerStep spans),
    or a record/dict with step (or seq) and start/end in *_mono_ns or *_ns (the collector's Step rows)."""
    if isinstance(s, tuple):
        return int(s[0]), int(s[1]), int(s[2])
    get = (lambda n: s.get(n)) if isinstance(s, dict) else (lambda n: getattr(s, n, None))
    num = get("step")
    num = get("seq") if num is None else num
    a = get("start_mono_ns")
    b = get("end_mono_ns")
    return int(num if num is not None else -1), int(a if a is not None else get("start_ns")), \
        int(b if b is not None else get("end_ns"))


def inter_step_void(kernels, steps, by: str = "launch") -> dict:
    """V_inter per step (module docstring): for each step, T_inter at its start boundary and T_inter / T_step,
    None where the trace has no kernel on one side of the boundary (the first traced step) or none launched
    inside the step; count, median and p90 over the steps measured. by: "launch" (default) or "gpu"."""
    if by not in ("launch", "gpu"):
        raise ValueError(f"by must be 'launch' or 'gpu', not {by!r}")
    bounds = sorted(_step_bounds(s) for s in steps)
    ks = [(_get(k, "launch_start_mono_ns") or _get(k, "start_mono_ns"), _get(k, "start_mono_ns"),
           _get(k, "end_mono_ns")) for k in kernels]
    rows = []
    if by == "launch":
        ks.sort()
        keys = [k[0] for k in ks]
        pre_end, acc = [], None      # max end over the kernels launched up to i
        for _, _, e in ks:
            acc = e if acc is None else max(acc, e)
            pre_end.append(acc)
        suf_start, acc = [0] * len(ks), None   # min start over the kernels launched from i on
        for i in range(len(ks) - 1, -1, -1):
            acc = ks[i][1] if acc is None else min(acc, ks[i][1])
            suf_start[i] = acc
    else:
        ends = sorted(k[2] for k in ks)
        starts = sorted(k[1] for k in ks)
    for num, a, b in bounds:
        gap = None
        if by == "launch":
            i = bisect.bisect_left(keys, a)
            if 0 < i < len(ks) and keys[i] < b:
                gap = max(0, suf_start[i] - pre_end[i - 1])
        else:
            i, j = bisect.bisect_right(ends, a), bisect.bisect_left(starts, a)
            if i > 0 and j < len(starts) and starts[j] < b:
                gap = starts[j] - ends[i - 1]
        t_step = b - a
        rows.append({"step": num, "start_ns": a, "t_step_ns": t_step, "t_inter_ns": gap,
                     "v_inter": round(gap / t_step, 6) if gap is not None and t_step > 0 else None})
    vs = sorted(r["v_inter"] for r in rows if r["v_inter"] is not None)
    med = _median(vs)
    return {"by": by, "steps": rows, "count": len(vs), "median": None if med is None else round(med, 6),
            "p90": _q(vs, 0.9)}


def _median(xs: list):
    """The median of sorted xs (the mean of the middle two for an even count)."""
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def ks_distance(a: list[int], b: list[int]) -> float:
    """Two-sample Kolmogorov-Smirnov distance between the empirical distributions of a and b."""
    if not a or not b:
        return 0.0
    xs, ys = sorted(a), sorted(b)
    i = j = 0
    d = 0.0
    while i < len(xs) and j < len(ys):
        v = min(xs[i], ys[j])
        while i < len(xs) and xs[i] <= v:
            i += 1
        while j < len(ys) and ys[j] <= v:
            j += 1
        d = max(d, abs(i / len(xs) - j / len(ys)))
    return round(d, 4)


def rank_metrics(kernels) -> dict:
    """Every metric of one rank's kernels."""
    return {"kernels": len(kernels), "issue_latency": distribution(issue_latencies(kernels)),
            "issue_latency_comm": distribution(issue_latencies(kernels, comm=True)),
            "launch_delay": distribution(launch_delays(kernels)), "per_name": per_name(kernels),
            "minority_void": minority_void(kernels)}


def compare_ranks(by_rank: dict[int, list]) -> dict[int, dict]:
    """Per rank its issue-latency KS distance against the pooled other ranks' (all kernels and comm
    kernels): the rank whose distribution differs (a CPU stalled by GC or syncs) stands out."""
    lat = {r: issue_latencies(ks) for r, ks in by_rank.items()}
    com = {r: issue_latencies(ks, comm=True) for r, ks in by_rank.items()}
    out = {}
    for r in by_rank:
        rest = [x for o, v in lat.items() if o != r for x in v]
        rest_c = [x for o, v in com.items() if o != r for x in v]
        out[r] = {"ks_issue_latency": ks_distance(lat[r], rest), "ks_issue_latency_comm": ks_distance(com[r], rest_c)}
    return out
