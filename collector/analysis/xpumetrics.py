"""XPUTimer's collective bus bandwidth (③) and training throughput (①) (ALGORITHMS.md §2.3), per rank and
compared across ranks, from a job's CommOp records and its ranks' Step / Iteration records; kernels.py holds the
kernel-timeline metrics (④ issue latency, ⑤ V_minority and V_inter).

Bandwidth (③), per collective instance: the members' records of one call (same communicator and collective
sequence number; a send and its recv by p2p sequence number and rank pair), with the nccl-tests conventions:
  t0 = max over members of start (the member that started last), t1 = max over members of end,
  algbw = S / (t1 - t0), S the call's data size: the per-rank input bytes a CommOp records, x n for all_gather
  (whose input is one rank's share; reduce_scatter's input is already the whole tensor);
  busbw = algbw x 2(n-1)/n all_reduce, x (n-1)/n all_gather, reduce_scatter, all_to_all, x 1 broadcast, reduce,
  send/recv. n = 1: no link is crossed, busbw 0 by the same formula; n unknown (no record states the group
  size: gloo's spans in a Kineto trace) with one member seen: busbw None, algbw only.
  method "all_members" (every member recorded; needs clock-aligned times: the collector's cluster time),
  "partial_members" (t0 a lower bound: a missing member may have started later, algbw under-estimated),
  "single_member": one member's own record, S / (its end - its start). On a GPU kernel that time includes
  waiting for the last member to arrive: a lower bound of the link's algbw, and the member that arrived last
  looks fastest. Each instance also carries every member's own single-member estimate.
  Timed ops only: timing gpu_kernel (NCCL kernel start/end), cuda_event (Flight Recorder with
  TORCH_NCCL_ENABLE_TIMING: enqueue time + CUDA-event duration), backend_thread (gloo's worker-thread span in a
  Kineto trace: the CPU job's analogue). cpu_enqueue ops (a gloo Flight Recorder entry, an NCCL log line, a
  Kineto call that launched no kernel) have an enqueue time or a CPU call span only: counted as untimed, skipped.
  barrier and ops of no bytes are skipped likewise.
Cross-rank: compare_busbw() takes each rank's value per instance (the instance's busbw; its own estimate for a
single-member instance) and flags a rank when >= `persist` of its values are < `ratio` x the median of the
communicator's other members' values for the same op and size bucket (power-of-two buckets of S; a rank alone
in the records has nothing to be compared with); and a communicator whose median is < `ratio`
x its sibling communicators' (same op, size bucket and group size: the data-parallel groups of one job) on
>= `persist` instances, naming its members: with every member recorded all members of one instance share one
value, so a slow link shows as a slow communicator, found by comparing groups.

Throughput (①), per step: the step's workload (tokens, else samples: an Iteration's tokens / batch_size, where the
iteration anchor saw them) or one step, over the step's period: from its start to the next step's start of the
same rank (XPUTimer's dataloader-to-dataloader time: an anchored Iteration, e.g. Optimizer.step, covers part of
the step only), or its own end - start where the next step is not the following number. Per rank against its own
earlier steps: a robust z over the trailing `window` steps (or runs of `block` steps: where the work per step
varies, one step's rate spreads widely), (x - median) / max(1.4826 MAD, 1 % of the median) (the floor: a history of
identical periods would make any change infinite); and the rank's median against the job's median rank.

Pure functions of lists of records (dataclasses of agent/records.py, or dicts with the same keys, times as *_ns
(collector rows, cluster time) or *_mono_ns); no I/O. Cost: O(ops log ops) for bandwidth, O(steps x window) for
throughput (numpy over the trailing windows).
"""

from __future__ import annotations

import math
import statistics
import warnings

import numpy as np

TIMED = ("gpu_kernel", "cuda_event", "backend_thread")
_FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
            "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
            "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0, "send": lambda n: 1.0, "recv": lambda n: 1.0,
            "send/recv": lambda n: 1.0}
P2P = ("send", "recv")


def _f(r, name, default=None):
    if isinstance(r, dict):
        return r.get(name, default)
    return getattr(r, name, default)


def _t(r, which: str) -> int:
    """A record's start/end/issue time: *_mono_ns (records) or *_ns (collector rows); 0 when absent."""
    v = _f(r, f"{which}_mono_ns")
    if v is None:
        v = _f(r, f"{which}_ns")
    return int(v or 0)


def bus_factor(op: str, n: int) -> float | None:
    """nccl-tests' busbw / algbw for an op over n ranks; None for an op it has no convention for here."""
    f = _FACTORS.get(op)
    return None if f is None or n < 1 else f(n)


def data_bytes(op: str, nbytes: int, n: int) -> int:
    """nccl-tests' S from the per-rank input bytes a CommOp records: x n for all_gather, else as recorded."""
    return nbytes * n if op == "all_gather" else nbytes


def size_bucket(nbytes: int) -> str:
    """The power-of-two bucket [2^k, 2^(k+1)) of a size, named by its lower end: '4MiB', '512B'."""
    if nbytes <= 0:
        return "0B"
    k = int(math.log2(nbytes))
    lo = 1 << k
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if k >= shift:
            return f"{lo >> shift}{unit}"
    return f"{lo}B"


def _instance_key(o) -> tuple:
    op = _f(o, "op", "")
    comm = _f(o, "comm_id", "")
    if op in P2P:
        ps, rank, peer = _f(o, "p2p_seq", -1), _f(o, "rank", -1), _f(o, "peer", -1)
        if ps is not None and ps >= 0 and rank >= 0 and peer >= 0:
            return (comm, "p2p", ps, min(rank, peer), max(rank, peer))
        return ("single", id(o))
    seq = _f(o, "seq", -1)
    if seq is not None and seq >= 0:
        return (comm, "coll", seq, op)
    return ("single", id(o))


def collective_instances(ops) -> tuple[list[dict], dict]:
    """Every timed collective (and p2p pair) with its bandwidth (module docstring), in t0 order; and what was
    skipped: {"untimed": cpu_enqueue or no start/end, "no_bytes": barrier or 0 bytes, "no_convention": an op
    with no nccl-tests factor here}."""
    skipped = {"untimed": 0, "no_bytes": 0, "no_convention": 0}
    groups: dict[tuple, list] = {}
    for o in ops:
        op = _f(o, "op", "")
        start, end = _t(o, "start"), _t(o, "end")
        if _f(o, "timing", "") not in TIMED or not start or end <= start:
            skipped["untimed"] += 1
            continue
        if op == "barrier" or not (_f(o, "bytes", 0) or 0) > 0:
            skipped["no_bytes"] += 1
            continue
        if op not in _FACTORS:
            skipped["no_convention"] += 1
            continue
        groups.setdefault(_instance_key(o), []).append(o)
    out = []
    for key, recs in groups.items():
        p2p = key[1] == "p2p" if key[0] != "single" else _f(recs[0], "op") in P2P
        op = "send/recv" if p2p and key[0] != "single" else _f(recs[0], "op")
        members: dict[int, list[int]] = {}      # rank -> [start, end], a rank's records of the call merged
        for i, o in enumerate(recs):
            r = _f(o, "rank", -1)
            r = r if r is not None and r >= 0 else _f(o, "group_rank", -1)
            r = r if r is not None and r >= 0 else -1 - i
            s, e = _t(o, "start"), _t(o, "end")
            m = members.setdefault(r, [s, e])
            m[0], m[1] = min(m[0], s), max(m[1], e)
        known = 2 if p2p else max([_f(o, "nranks", 0) or 0 for o in recs]
                                  + [len(_f(o, "members", []) or []) for o in recs])
        n = max(known, len(members))
        nbytes = max(_f(o, "bytes", 0) or 0 for o in recs)
        size = data_bytes(op, nbytes, n)
        # a group size no record states (gloo's spans in a Kineto trace) and one member seen: no busbw
        factor = bus_factor(op, n) if known or n > 1 else None
        t0 = max(m[0] for m in members.values())
        t1 = max(m[1] for m in members.values())
        if len(members) == 1:
            method = "single_member"
        elif len(members) >= n:
            method = "all_members"
        else:
            method = "partial_members"
        if t1 <= t0:
            skipped["untimed"] += len(recs)
            continue
        algbw = size / (t1 - t0)              # bytes per ns = GB/s
        own = {r: None if factor is None else round(size / (e - s) * factor, 6) for r, (s, e) in members.items()}
        first = recs[0]
        out.append({"comm_id": _f(first, "comm_id", ""), "op": op, "seq": key[2] if key[0] != "single" else
                    _f(first, "seq", -1), "n": n, "bytes": nbytes, "data_bytes": size, "size_bucket": size_bucket(size),
                    "timing": _f(first, "timing", ""), "members": sorted(members), "method": method,
                    "t0_ns": t0, "t1_ns": t1, "algbw_gb_per_s": round(algbw, 6),
                    "busbw_gb_per_s": None if factor is None else round(algbw * factor, 6),
                    "member_busbw_gb_per_s": own})
    out.sort(key=lambda x: (x["t0_ns"], x["comm_id"]))
    return out, skipped


def _member_values(instances) -> list[tuple[int, str, str, int, float]]:
    """(rank, comm_id, 'op/bucket', n, value) per member of each instance: the instance's busbw, or the member's own
    estimate for a single-member instance."""
    rows = []
    for c in instances:
        cls = f"{c['op']}/{c['size_bucket']}"
        for r in c["members"]:
            v = c["member_busbw_gb_per_s"][r] if c["method"] == "single_member" else c["busbw_gb_per_s"]
            if v is not None:
                rows.append((r, c["comm_id"], cls, c["n"], v))
    return rows


def busbw_by_rank(instances) -> dict[int, dict[str, dict]]:
    """Per rank, per 'comm_id op/bucket' it took part in: how many collectives and their median busbw (GB/s)."""
    by: dict[int, dict[str, list[float]]] = {}
    for r, comm, cls, _, v in _member_values(instances):
        by.setdefault(r, {}).setdefault(f"{comm} {cls}", []).append(v)
    return {r: {k: {"count": len(vs), "median_busbw_gb_per_s": round(statistics.median(vs), 4)}
                for k, vs in sorted(d.items())} for r, d in sorted(by.items())}


def compare_busbw(instances, ratio: float = 0.7, persist: int = 3) -> dict:
    """Ranks and communicators whose collectives run at < ratio x the reference busbw on >= persist collectives
    (module docstring). {"communicators": {comm: {'op/bucket': {count, median, members}}}, "ranks": {rank:
    {collectives, below, median_ratio}}, "slow_ranks": [rank], "slow_communicators": [{...}]}."""
    vals = _member_values(instances)
    pool: dict[tuple[str, str], dict[int, list[float]]] = {}
    for r, comm, cls, _, v in vals:
        pool.setdefault((comm, cls), {}).setdefault(r, []).append(v)
    ranks: dict[int, dict] = {}
    ratios: dict[int, list[float]] = {}
    for (comm, cls), by in pool.items():
        for r, vs in by.items():
            d = ranks.setdefault(r, {"collectives": 0, "below": 0})
            d["collectives"] += len(vs)
            others = [v for o, ovs in by.items() if o != r for v in ovs]
            m = statistics.median(others) if others else 0.0
            if m <= 0:
                continue     # no other member's value: nothing to compare with
            ratios.setdefault(r, []).extend(v / m for v in vs)
            d["below"] += sum(1 for v in vs if v < ratio * m)
    for r, d in ranks.items():
        d["median_ratio"] = round(statistics.median(ratios[r]), 3) if ratios.get(r) else None
    slow = {r for r, d in ranks.items() if d["below"] >= persist}

    # communicators against their siblings (same op, size bucket and group size)
    per_comm: dict[tuple[str, str, int], list[dict]] = {}
    for c in instances:
        if c["busbw_gb_per_s"] is not None:
            per_comm.setdefault((c["comm_id"], f"{c['op']}/{c['size_bucket']}", c["n"]), []).append(c)
    comms: dict[str, dict] = {}
    med: dict[tuple[str, str, int], float] = {}
    for (comm, cls, n), cs in per_comm.items():
        med[(comm, cls, n)] = statistics.median(c["busbw_gb_per_s"] for c in cs)
        comms.setdefault(comm, {})[cls] = {"count": len(cs), "median_busbw_gb_per_s": round(med[(comm, cls, n)], 4),
                                           "members": sorted({r for c in cs for r in c["members"]})}
    slow_comms = []
    for (comm, cls, n), cs in sorted(per_comm.items()):
        others = [m for (c2, cl2, n2), m in med.items() if cl2 == cls and n2 == n and c2 != comm]
        if not others:
            continue
        sib = statistics.median(others)
        below = sum(1 for c in cs if c["busbw_gb_per_s"] < ratio * sib)
        if sib > 0 and below >= persist:
            members = comms[comm][cls]["members"]
            slow_comms.append({"comm_id": comm, "class": cls, "n": n,
                               "median_busbw_gb_per_s": round(med[(comm, cls, n)], 4),
                               "siblings_busbw_gb_per_s": round(sib, 4), "below": below, "members": members})
            slow.update(r for r in members if r >= 0)
    return {"communicators": comms, "ranks": dict(sorted(ranks.items())), "slow_ranks": sorted(slow),
            "slow_communicators": slow_comms}


# -- throughput --------------------------------------------------------------------------------------------------

def _number(r) -> int:
    n = _f(r, "step")
    if n is None:
        n = _f(r, "seq")
    return int(n if n is not None else -1)


def step_rates(rows) -> dict[int, dict]:
    """Per rank: {"unit": tokens/s | samples/s | steps/s, "steps": [{step, start_ns, period_ns, work, rate}]} from
    Step or Iteration rows (any order, several ranks); the unit is the rank's: tokens where any row counts them,
    else samples (batch_size), else steps."""
    by: dict[int, list] = {}
    for r in rows:
        if _t(r, "start") and _t(r, "end") > _t(r, "start"):
            by.setdefault(int(_f(r, "rank", -1)), []).append(r)
    out = {}
    for rank, rs in sorted(by.items()):
        rs.sort(key=lambda r: (_t(r, "start"), _number(r)))
        if any((_f(r, "tokens", 0) or 0) > 0 for r in rs):
            unit, field = "tokens/s", "tokens"
        elif any((_f(r, "batch_size", 0) or 0) > 0 for r in rs):
            unit, field = "samples/s", "batch_size"
        else:
            unit, field = "steps/s", None
        steps = []
        for i, r in enumerate(rs):
            a, b = _t(r, "start"), _t(r, "end")
            nxt = rs[i + 1] if i + 1 < len(rs) else None
            period = _t(nxt, "start") - a if nxt is not None and _number(nxt) == _number(r) + 1 else b - a
            if period <= 0:
                continue
            work = (_f(r, field, 0) or 0) if field else 1
            steps.append({"step": _number(r), "start_ns": a, "period_ns": period, "work": work,
                          "rate": work / (period / 1e9)})
        out[rank] = {"unit": unit, "steps": steps}
    return out


def robust_z(values, window: int = 20, min_history: int = 5) -> list[float | None]:
    """Each value's robust z against the `window` values before it (median, 1.4826 x MAD, floored at 1 % of the
    median); None while fewer than `min_history` came before."""
    x = np.asarray(values, dtype=float)
    out: list[float | None] = [None] * len(x)
    if len(x) <= min_history:
        return out
    pad = np.concatenate([np.full(window, np.nan), x])
    hist = np.lib.stride_tricks.sliding_window_view(pad[:-1], window)   # hist[i]: the window values before x[i]
    have = np.sum(~np.isnan(hist), axis=1)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)   # the all-NaN windows of the first steps
        med = np.nanmedian(hist, axis=1)
        mad = np.nanmedian(np.abs(hist - med[:, None]), axis=1)
        scale = np.maximum(1.4826 * mad, 0.01 * np.abs(med))
        z = (x - med) / scale
    for i in range(len(x)):
        if have[i] >= min_history and np.isfinite(z[i]):
            out[i] = round(float(z[i]), 3)
    return out


def _blocks(steps: list[dict], block: int) -> list[tuple[int, int, float]]:
    """(first step, its start_ns, rate) per run of `block` consecutive steps: their work over their time (a last,
    shorter run is left out)."""
    out = []
    for i in range(0, len(steps) - block + 1, block):
        run = steps[i:i + block]
        t = sum(x["period_ns"] for x in run)
        out.append((run[0]["step"], run[0]["start_ns"], sum(x["work"] for x in run) / (t / 1e9)))
    return out


def throughput(rows, window: int = 20, z_flag: float = -3.0, cross_ratio: float = 0.7, block: int = 1) -> dict:
    """Per rank its step rates (step_rates), their median and p10; the robust z of each step (block = 1), or of
    each run of `block` steps' aggregate rate, against the trailing `window` of them, and the steps opening a
    value at z <= z_flag (a drop: a trailing window sees a level shift at its start, until the window holds the
    new level); and each rank's median against the job's median rank of the same unit, ranks under
    cross_ratio x that listed as slow. Per-step rates of a job whose steps carry varying work (2-6 micro-batches
    on the testbed) spread widely (a fixed per-step cost): blocks of tens of steps compare like with like."""
    rates = step_rates(rows)
    ranks = {}
    for rank, d in rates.items():
        xs = [s["rate"] for s in d["steps"]]
        blocks = _blocks(d["steps"], max(1, block))
        z = robust_z([v for _, _, v in blocks], window)
        srt = sorted(xs)
        ranks[rank] = {"unit": d["unit"], "steps": len(xs),
                       "median_rate": round(statistics.median(xs), 4) if xs else None,
                       "p10_rate": round(srt[int(round(0.1 * (len(srt) - 1)))], 4) if xs else None,
                       "block": max(1, block),
                       "low_steps": [n for (n, _, _), zz in zip(blocks, z) if zz is not None and zz <= z_flag],
                       "z": z}
    slow = []
    for unit in {d["unit"] for d in ranks.values()}:
        meds = {r: d["median_rate"] for r, d in ranks.items() if d["unit"] == unit and d["median_rate"]}
        if not meds:
            continue
        job = statistics.median(meds.values())
        for r, m in meds.items():
            ranks[r]["vs_ranks"] = round(m / job, 4) if job > 0 else None
            if len(meds) > 1 and job > 0 and m < cross_ratio * job:
                slow.append(r)
    return {"ranks": ranks, "slow_ranks": sorted(slow)}


def window_throughput(rows, a: int, b: int, runs: int = 20) -> dict[int, dict]:
    """Per rank its throughput in the window [a, b] (the work of the steps starting in it over their time) against
    the same before a, and as a robust z against the rates of the steps before a cut into `runs` equal runs (one
    step's rate spreads too widely to be the reference; the testbed's job 1.39x slower for 60 s: z -8.9, 1.057x:
    -1.9, 60 s of its quiet: -0.9): {rank: {unit, during, before, ratio, z, steps_during, steps_before}}; z None
    with fewer than 5 steps before."""
    out = {}
    for rank, d in step_rates(rows).items():
        before = [s for s in d["steps"] if s["start_ns"] < a]
        during = [s for s in d["steps"] if a <= s["start_ns"] <= b]
        if not during:
            continue

        def agg(ss):
            return sum(s["work"] for s in ss) / (sum(s["period_ns"] for s in ss) / 1e9)
        got = {"unit": d["unit"], "during": round(agg(during), 4), "steps_during": len(during),
               "before": None, "ratio": None, "z": None, "steps_before": len(before)}
        if before:
            got["before"] = round(agg(before), 4)
            got["ratio"] = round(got["during"] / got["before"], 4) if got["before"] > 0 else None
            ref = [v for _, _, v in _blocks(before, max(1, len(before) // runs))]
            if len(ref) >= 5:
                med = statistics.median(ref)
                scale = max(1.4826 * statistics.median(abs(x - med) for x in ref), 0.01 * abs(med))
                got["z"] = round((got["during"] - med) / scale, 3) if scale > 0 else None
        out[rank] = got
    return out


def step_comm_algbw(step_rows) -> dict[int, dict[str, float]]:
    """Per rank, per communicator: bytes / busy time of the rank's own ops over its Step rows' comms (StepComm:
    busy_ns where the source timed the ops), in GB/s: a single-member algbw estimate, which includes the time
    spent waiting for the other members (a lower bound of the link's; the member that arrives last looks fast)."""
    acc: dict[int, dict[str, list[int]]] = {}
    for s in step_rows:
        for c in _f(s, "comms", None) or ():
            busy, nbytes = _f(c, "busy_ns", 0) or 0, _f(c, "bytes", 0) or 0
            if busy > 0 and nbytes > 0:
                a = acc.setdefault(int(_f(s, "rank", -1)), {}).setdefault(_f(c, "comm_id", ""), [0, 0])
                a[0] += nbytes
                a[1] += busy
    return {r: {comm: round(b / ns, 4) for comm, (b, ns) in sorted(d.items())} for r, d in sorted(acc.items())}
