"""XPUTimer's V_inter (collector/analysis/kernels.py), bus bandwidth and throughput (collector/analysis/xpumetrics.py)
and their place in a suspect's evidence (collector/analysis/causes.py).

Figures on real recordings are checked against the same figures computed here straight from the files with plain
json: the two HTA Kineto traces of ../shared/fixtures/gpu-traces (one rank each: ProfilerStep spans, NCCL kernels
with their collective args), the H100 Flight Recorder dump of tests/fixtures/gpu-recorded (CUDA-event durations)
and the testbed's stored Iteration rows of tests/fixtures/training (a DP2 gloo job, every rank 1.39x slower for
60 s, written here through the real store). The cross-member bandwidth formula and the cross-rank comparison have
no multi-member recording to run on (every GPU trace here holds one rank): they are checked on small hand-made
cases whose answers are worked out in the comments."""

from __future__ import annotations

import gzip
import json
import math
import os
import statistics
import time
from decimal import Decimal

import pytest

from conftest import REPO
from steplens.agent import records as rec
from steplens.agent.parse import parse_file
from steplens.agent.transport.codec import encode_records
from steplens.collector.analysis import kernels as km
from steplens.collector.analysis import xpumetrics as xm
from steplens.collector.ingest.clock import ClockEstimate
from steplens.collector.store.queries import Reader
from steplens.collector.store.writer import BatchJob, StoreWriter

SHARED = os.path.join(REPO, "..", "shared", "fixtures", "gpu-traces")
TRACE_2RANK = os.path.join(SHARED, "nccl-2rank-rank0.json.gz")
TRACE_1RANK = os.path.join(SHARED, "nccl-1rank-ns.json.gz")
FR_NCCL = os.path.join(REPO, "tests", "fixtures", "gpu-recorded", "fr-nccl.json")
ITERS = os.path.join(REPO, "tests", "fixtures", "training", "testbed-iters-slow30.jsonl.gz")
need_shared = pytest.mark.skipif(not os.path.exists(TRACE_2RANK), reason="the shared GPU trace fixtures are not here")
ELEM = {"Float": 4, "Long": 8}


def _events(path):
    """The trace's events, numbers exact (absolute µs with ns decimals do not fit a float: Decimal)."""
    with gzip.open(path) as fh:
        return json.load(fh, parse_float=Decimal)["traceEvents"]


def _raw_steps_and_kernels(path):
    """ProfilerStep CPU spans (name, ts, dur) and kernels (ts, dur, launch ts) in µs, read straight from the JSON."""
    ev = _events(path)
    launch = {e["args"]["correlation"]: e["ts"] for e in ev if e.get("cat") == "cuda_runtime"
              and "correlation" in e.get("args", {})}
    steps = sorted((e["name"], e["ts"], e["dur"]) for e in ev if str(e.get("name", "")).startswith("ProfilerStep#")
                   and e.get("cat") == "user_annotation")   # Decimal µs: differences exact, then float
    kernels = [(e["ts"], e["dur"], launch[e["args"]["correlation"]]) for e in ev if e.get("cat") == "kernel"]
    return steps, kernels


# ---- V_inter on the real ProfilerStep spans -----------------------------------------------------------------------

@need_shared
@pytest.mark.parametrize("path", [TRACE_2RANK, TRACE_1RANK])
def test_v_inter_on_the_real_profiler_steps_matches_the_trace(path):
    steps, kernels = _raw_steps_and_kernels(path)
    res = parse_file(path)
    got = {by: km.inter_step_void(res.kernels, res.steps, by) for by in ("launch", "gpu")}
    want = {"launch": [], "gpu": []}
    for name, ts, dur in steps:
        before = [k for k in kernels if k[2] < ts]
        after = [k for k in kernels if k[2] >= ts]
        want["launch"].append(None if not before else (
            float(min(k[0] for k in after) - max(k[0] + k[1] for k in before)), float(dur)))
        ended = [k[0] + k[1] for k in kernels if k[0] + k[1] <= ts]
        want["gpu"].append(None if not ended else (float(min(k[0] for k in kernels if k[0] >= ts) - max(ended)),
                                                   float(dur)))
    for by in ("launch", "gpu"):
        rows = got[by]["steps"]
        assert [r["step"] for r in rows] == [int(n.split("#")[1]) for n, _, _ in steps]
        for r, w in zip(rows, want[by]):
            if w is None:
                assert r["t_inter_ns"] is None and r["v_inter"] is None
                continue
            assert abs(r["t_inter_ns"] - w[0] * 1000) <= 4, (by, r, w)
            assert abs(r["t_step_ns"] - w[1] * 1000) <= 4
            assert r["v_inter"] == pytest.approx(w[0] / w[1], abs=2e-6)
        vs = sorted(w[0] / w[1] for w in want[by] if w is not None)
        assert got[by]["count"] == len(vs) and got[by]["median"] == pytest.approx(statistics.median(vs), abs=2e-6)
    if path == TRACE_2RANK:
        # measured: the GPU idles 6.29 and 6.20 ms of each ~220 ms step between steps (V_inter 2.8 %); the first
        # traced step has no kernel before it. Here the GPU keeps up with its CPU: both splits agree
        gaps_ms = [r["t_inter_ns"] and round(r["t_inter_ns"] / 1e6, 2) for r in got["launch"]["steps"]]
        assert gaps_ms == [None, 6.29, 6.2]
        assert got["launch"]["median"] == pytest.approx(0.0281, abs=1e-4)
        assert got["gpu"]["median"] == got["launch"]["median"]
    else:
        # the GPU runs 66-90 ms behind its CPU: by launch the inter-step CPU work is hidden (< 1 µs of GPU idle);
        # split by GPU times the gap is between two kernels of one step (0.42 ms), not the inter-step void
        assert all(r["t_inter_ns"] < 1000 for r in got["launch"]["steps"][1:])
        assert all(400_000 < r["t_inter_ns"] < 440_000 for r in got["gpu"]["steps"][2:])


def test_v_inter_splits_by_launch_time():
    def k(issue, start, end):
        return {"start_mono_ns": start, "end_mono_ns": end, "launch_start_mono_ns": issue}
    # step 1 = [1000, 2000): nothing launched before it. Step 2 = [2000, 3000): the kernels launched before 2000 run
    # until 2150 (the GPU lags), the first launched after it (at 2300) starts at 2400: T_inter 250 of 1000
    ks = [k(1050, 1100, 1500), k(1900, 2100, 2150), k(2300, 2400, 2900)]
    got = km.inter_step_void(ks, [(1, 1000, 2000), (2, 2000, 3000)])
    assert [r["t_inter_ns"] for r in got["steps"]] == [None, 250] and got["median"] == 0.25
    # by GPU times the last kernel ending before 2000 ends 1500, the first starting after it starts 2100
    assert km.inter_step_void(ks, [(2, 2000, 3000)], by="gpu")["steps"][0]["t_inter_ns"] == 600
    # a step in which nothing was launched has no value (its next kernel belongs to a later step)
    assert km.inter_step_void(ks, [{"step": 9, "start_ns": 1550, "end_ns": 1800}])["steps"][0]["v_inter"] is None


# ---- bus bandwidth -------------------------------------------------------------------------------------------------

@need_shared
def test_busbw_per_nccl_kernel_of_the_real_trace_is_the_single_member_estimate():
    ev = _events(TRACE_2RANK)
    nk = sorted((e for e in ev if e.get("cat") == "kernel" and "nccl" in e["name"].lower()), key=lambda e: e["ts"])
    inst, skipped = xm.collective_instances(parse_file(TRACE_2RANK).ops)
    assert len(inst) == len(nk) == 21 and skipped == {"untimed": 0, "no_bytes": 0, "no_convention": 0}
    for c, e in zip(inst, nk):
        a = e["args"]
        n = a["Group size"]
        nbytes = a["In msg nelems"] * ELEM[a["dtype"]]
        op = {"allreduce": "all_reduce", "broadcast": "broadcast"}[a["Collective name"]]
        factor = 2 * (n - 1) / n if op == "all_reduce" else 1.0
        assert (c["op"], c["n"], c["bytes"], c["method"], c["members"]) == (op, 2, nbytes, "single_member", [0])
        assert c["algbw_gb_per_s"] == pytest.approx(nbytes / (float(e["dur"]) * 1000), rel=1e-5)
        assert c["busbw_gb_per_s"] == pytest.approx(nbytes / (float(e["dur"]) * 1000) * factor, rel=1e-5)
    # measured: rank 0's 16 MiB all-reduces at 4.5-13.0 GB/s (median 11.0) over its own kernel time, which includes
    # waiting for rank 1 (the 2.2-6.0 ms kernels of step 6 are the slow ones)
    cmp = xm.compare_busbw(inst)
    big = cmp["communicators"]["pg:0"]["all_reduce/16MiB"]
    assert big["count"] == 9 and big["median_busbw_gb_per_s"] == pytest.approx(10.98, abs=0.01)
    # one member in the records: nobody to compare rank 0 with
    assert cmp["ranks"][0]["median_ratio"] is None and cmp["slow_ranks"] == []


@need_shared
def test_a_one_rank_trace_has_no_timed_collective():
    inst, skipped = xm.collective_instances(parse_file(TRACE_1RANK).ops)
    assert inst == [] and skipped["untimed"] == 35     # NCCL launched no kernel: the CPU call spans only


def test_flight_recorder_cuda_event_durations_give_the_single_member_figure():
    """The H100 dump: the first step's 7 ops carry duration_ms (the rest are cpu_enqueue, enqueue time only:
    skipped, like every gloo Flight Recorder entry); a 1-rank communicator crosses no link, busbw 0 except for
    broadcast (factor 1)."""
    with open(FR_NCCL) as fh:
        entries = json.load(fh)["entries"]
    timed = [e for e in entries if isinstance(e.get("duration_ms"), (int, float))]
    inst, skipped = xm.collective_instances(parse_file(FR_NCCL).ops)
    assert skipped == {"untimed": len(entries) - len(timed), "no_bytes": 1, "no_convention": 0}   # the barrier
    size = {"Float": 4, "BFloat16": 2, "Long": 8}
    want = [e for e in timed if "barrier" not in e["profiling_name"]]
    assert len(inst) == len(want) == 6
    for c, e in zip(inst, want):
        nbytes = sum(math.prod(shape) for shape in e["input_sizes"]) * size[e["input_dtypes"][0]]
        assert c["bytes"] == nbytes and c["n"] == 1
        assert c["algbw_gb_per_s"] == pytest.approx(nbytes / (e["duration_ms"] * 1e6), rel=1e-4, abs=1e-6)
        assert c["busbw_gb_per_s"] == (c["algbw_gb_per_s"] if c["op"] == "broadcast" else 0.0)


T = 10**12      # the hand-made ops' time origin (a time of 0 is "absent" in a record)


def _op(rank, start, end, op="all_reduce", nbytes=8_000_000, seq=0, comm="c0", n=4, **kw):
    """One rank's record of a call, times in ns after T."""
    return rec.CommOp(T + end, kw.pop("timing", "gpu_kernel"), 100 + rank, comm, op, rank=rank, nranks=n,
                      bytes=nbytes, seq=seq, start_mono_ns=T + start, end_mono_ns=T + end, issue_mono_ns=T + start,
                      **kw)


def test_busbw_conventions_on_a_hand_computed_example():
    # 4 members; the last starts at 1 ms, the last ends at 2 ms: t0 = 1 ms, t1 = 2 ms, 1 ms for 8 MB: algbw 8 GB/s
    def call(op, nbytes, seq):
        return [_op(0, 0, 2_000_000, op, nbytes, seq), _op(1, 200_000, 1_990_000, op, nbytes, seq),
                _op(2, 1_000_000, 2_000_000, op, nbytes, seq), _op(3, 500_000, 1_950_000, op, nbytes, seq)]
    ops = call("all_reduce", 8_000_000, 0) + call("all_gather", 2_000_000, 1) + call("reduce_scatter", 8_000_000, 2) \
        + call("broadcast", 8_000_000, 3) + call("all_to_all", 8_000_000, 4)
    inst = {c["op"]: c for c in xm.collective_instances(ops)[0]}
    for c in inst.values():
        assert (c["t0_ns"] - T, c["t1_ns"] - T, c["method"], c["members"]) == (1_000_000, 2_000_000, "all_members",
                                                                              [0, 1, 2, 3])
        assert c["data_bytes"] == 8_000_000 and c["algbw_gb_per_s"] == 8.0   # all_gather: 2 MB per rank x 4
    assert inst["all_reduce"]["busbw_gb_per_s"] == 12.0                    # 8 x 2 x 3/4
    assert inst["all_gather"]["busbw_gb_per_s"] == inst["reduce_scatter"]["busbw_gb_per_s"] == 6.0   # 8 x 3/4
    assert inst["all_to_all"]["busbw_gb_per_s"] == 6.0
    assert inst["broadcast"]["busbw_gb_per_s"] == 8.0
    # each member's own estimate: rank 0 took 2 ms for 8 MB: 4 GB/s x 1.5 = 6 GB/s busbw
    assert inst["all_reduce"]["member_busbw_gb_per_s"] == {0: 6.0, 1: pytest.approx(6.7039, abs=1e-4), 2: 12.0,
                                                            3: pytest.approx(8.2759, abs=1e-4)}
    # 3 of 4 members recorded: t0 from those three (a lower bound), labelled partial
    part = xm.collective_instances(call("all_reduce", 8_000_000, 0)[:2] + call("all_reduce", 8_000_000, 0)[3:])[0][0]
    assert part["method"] == "partial_members" and part["t0_ns"] == T + 500_000
    # a send and its recv: one p2p instance, factor 1; 4 MB from t0 = 0.5 ms to t1 = 1.5 ms: 4 GB/s
    p2p = [_op(0, 0, 1_500_000, "send", 4_000_000, -1, peer=1, p2p_seq=7),
           _op(1, 500_000, 1_400_000, "recv", 4_000_000, -1, peer=0, p2p_seq=7)]
    (c,) = xm.collective_instances(p2p)[0]
    assert (c["op"], c["n"], c["busbw_gb_per_s"], c["members"]) == ("send/recv", 2, 4.0, [0, 1])
    # enqueue-only ops (a gloo Flight Recorder entry) and barriers are skipped and counted
    skipped = xm.collective_instances([_op(0, 0, 0, timing="cpu_enqueue"), _op(1, 0, 10, "barrier", 4)])[1]
    assert skipped == {"untimed": 1, "no_bytes": 1, "no_convention": 0}
    # no record states the group size (gloo's spans) and one member seen: algbw only
    (c,) = xm.collective_instances([_op(0, 0, 1_000_000, n=0, seq=-1, timing="backend_thread")])[0]
    assert (c["algbw_gb_per_s"], c["busbw_gb_per_s"], c["member_busbw_gb_per_s"]) == (8.0, None, {0: None})
    assert xm.compare_busbw([c])["ranks"] == {} and xm.compare_busbw([c])["communicators"] == {}
    assert xm.size_bucket(8_000_000) == "4MiB" and xm.size_bucket(424) == "256B" and xm.size_bucket(1 << 30) == "1GiB"


def test_the_cross_rank_comparison_flags_a_slow_rank_and_a_slow_communicator():
    # single-member records (no sequence numbers: nothing joins the ranks' records): 4 ranks of one communicator,
    # 5 all-reduces each of 8 MB; ranks 0, 1, 3 take 1 ms (12 GB/s busbw), rank 2 takes 2 ms (6 GB/s): 0.5x the
    # others' median on 5 collectives
    ops = [_op(r, i * 10**7, i * 10**7 + (2 if r == 2 else 1) * 10**6, seq=-1) for r in range(4) for i in range(5)]
    inst, _ = xm.collective_instances(ops)
    assert len(inst) == 20 and {c["method"] for c in inst} == {"single_member"}
    cmp = xm.compare_busbw(inst)
    assert cmp["slow_ranks"] == [2] and cmp["ranks"][2] == {"collectives": 5, "below": 5, "median_ratio": 0.5}
    assert cmp["ranks"][0]["below"] == 0 and cmp["ranks"][0]["median_ratio"] == 1.0
    # slow on only 2 collectives: not persistent, not flagged
    ops2 = [_op(r, i * 10**7, i * 10**7 + (2 if r == 2 and i < 2 else 1) * 10**6, seq=-1) for r in range(4)
            for i in range(5)]
    assert xm.compare_busbw(xm.collective_instances(ops2)[0])["slow_ranks"] == []
    # every member recorded: three data-parallel groups of 2 (ranks 0-1, 2-3, 4-5), 5 all-reduces each; the middle
    # group's take 2.5 ms instead of 1 ms: 0.4x its siblings' busbw, its members named
    ops3 = [_op(r, i * 10**7, i * 10**7 + (2_500_000 if g == 1 else 1_000_000), seq=i, comm=f"dp{g}", n=2)
            for g in range(3) for r in (2 * g, 2 * g + 1) for i in range(5)]
    inst3, _ = xm.collective_instances(ops3)
    assert len(inst3) == 15 and {c["method"] for c in inst3} == {"all_members"}
    cmp3 = xm.compare_busbw(inst3)
    (sc,) = cmp3["slow_communicators"]
    assert sc["comm_id"] == "dp1" and sc["members"] == [2, 3] and sc["below"] == 5
    assert sc["median_busbw_gb_per_s"] == 3.2 and sc["siblings_busbw_gb_per_s"] == 8.0   # 8 MB / 2.5 ms x 2(1)/2
    assert cmp3["slow_ranks"] == [2, 3]
    assert xm.busbw_by_rank(inst3)[2] == {"dp1 all_reduce/4MiB": {"count": 5, "median_busbw_gb_per_s": 3.2}}


# ---- throughput ----------------------------------------------------------------------------------------------------

@need_shared
def test_steps_per_second_from_the_real_profiler_steps():
    steps, _ = _raw_steps_and_kernels(TRACE_2RANK)
    res = parse_file(TRACE_2RANK)
    rates = xm.step_rates([{"rank": 0, "step": n, "start_ns": a, "end_ns": b} for n, a, b in res.steps])[0]
    assert rates["unit"] == "steps/s"
    # start to the next step's start; the last step its own span
    want = [1e6 / float(steps[i + 1][1] - steps[i][1]) for i in range(len(steps) - 1)] + [1e6 / float(steps[-1][2])]
    assert [r["rate"] for r in rates["steps"]] == pytest.approx(want, rel=1e-7)
    assert xm.throughput([{"rank": 0, "step": n, "start_ns": a, "end_ns": b} for n, a, b in res.steps]
                         )["ranks"][0]["median_rate"] == pytest.approx(4.494, abs=1e-3)


def _write_iterations(path: str, rows: list[dict]) -> Reader:
    """The recorded rows as the agents' Iteration records, one batch per node, through the real writer."""
    w = StoreWriter(path)
    w.start()
    got: list = []
    try:
        by_node: dict[str, list] = {}
        for x in rows:
            by_node.setdefault(x["node_id"], []).append(rec.Iteration(
                x["end_ns"], x["pid"], x["start_ticks"], x["job_key"], x["rank"], x["seq"], x["start_ns"], x["end_ns"],
                x["anchor"], x["phase"], tokens=x["tokens"], micro_batches=x["micro_batches"]))
        for seq, (node, recs) in enumerate(sorted(by_node.items()), 1):
            job = BatchJob(node, "ab" * 8, seq, len(recs), encode_records([("iters", r) for r in recs]),
                           recs[-1].mono_ns + 1, ClockEstimate(0, 0.0, 0, 1, 1, 5), 0, lambda *a: got.append(a))
            while not w.submit(job):
                time.sleep(0.01)
        deadline = time.monotonic() + 60
        while len(got) < len(by_node) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        w.stop()
    assert len(got) == len(by_node)
    return Reader(path)


def test_throughput_of_the_testbed_job_through_the_store(tmp_path):
    """The DP2 testbed job: 16 tokens a micro-batch, 2-6 per step; every rank 1.39x slower for 60 s (its step log:
    8.25 -> 11.47 ms per micro-batch, i.e. 1,940 -> 1,395 tokens/s)."""
    with gzip.open(ITERS, "rt") as fh:
        head = json.loads(fh.readline())
        rows = [json.loads(line) for line in fh]
    fault = head["faults"][0]
    a, b = fault["start_ns"], fault["end_ns"]
    rd = _write_iterations(str(tmp_path / "it.db"), rows)
    stored = rd.iterations(head["job_key"])
    assert len(stored) == len(rows)
    tp = xm.throughput(stored, window=40, block=50)
    win = xm.window_throughput(stored, a, b)
    for r in (0, 1):
        rs = sorted((x for x in rows if x["rank"] == r), key=lambda x: x["start_ns"])
        periods = [y["start_ns"] - x["start_ns"] for x, y in zip(rs, rs[1:])] + [rs[-1]["end_ns"] - rs[-1]["start_ns"]]
        want = [x["tokens"] / (p / 1e9) for x, p in zip(rs, periods)]
        got = tp["ranks"][r]
        assert got["unit"] == "tokens/s" and got["steps"] == len(rs)
        assert got["median_rate"] == pytest.approx(statistics.median(want), rel=1e-6)
        # the window's tokens over its time, against the same before it
        for key, keep in (("before", lambda t: t < a), ("during", lambda t: a <= t <= b)):
            sel = [(x["tokens"], p) for x, p in zip(rs, periods) if keep(x["start_ns"])]
            assert win[r][key] == pytest.approx(sum(t for t, _ in sel) / (sum(p for _, p in sel) / 1e9), rel=1e-6)
        # measured: 1,901 -> 1,339 tokens/s (0.70x; the job's own log: 1/1.39), z -8.9 against the 120 s before
        # the fault cut into 20 runs
        assert 1850 < win[r]["before"] < 1950 and 1300 < win[r]["during"] < 1380
        assert win[r]["ratio"] == pytest.approx(1 / head["step_log"]["slowdown"], abs=0.03)
        assert win[r]["z"] < -6
        # runs of 50 steps against the 40 before them: the drop shows within a second of the fault's start, and at
        # most once in the quiet (a trailing window sees a level shift at its start only)
        starts = {x["seq"]: x["start_ns"] for x in rs}
        low = [starts[s] for s in got["low_steps"]]
        assert any(a <= t <= a + 10**9 for t in low)
        assert sum(1 for t in low if t < a or t > b + 30 * 10**9) <= 1
    # 60 s of the quiet against the 60 s before them: no drop
    quiet = xm.window_throughput(stored, a - 60 * 10**9, a - 1)
    assert all(abs(quiet[r]["z"]) < 2 and abs(quiet[r]["ratio"] - 1) < 0.06 for r in (0, 1)), quiet
    # both ranks slowed together: neither is slow against the other
    assert tp["slow_ranks"] == [] and all(abs(tp["ranks"][r]["vs_ranks"] - 1) < 0.02 for r in (0, 1))


def test_robust_z_and_a_slow_rank_across_ranks():
    # a history of 10 at +-1 (median 10, MAD 1: scale 1.4826), then 4: z = -6 / 1.4826
    z = xm.robust_z([9, 11] * 5 + [4], window=10)
    assert z[:5] == [None] * 5 and z[-1] == pytest.approx(-6 / 1.4826, abs=1e-3)
    # identical history: the scale is floored at 1 % of the median, so 9 after 10s is z = -10, not -inf
    assert xm.robust_z([10] * 6 + [9], window=6)[-1] == pytest.approx(-10.0)
    # samples per second across ranks: rank 2 runs 1 step in 2 s with the same batch as the others' 1 s
    rows = [{"rank": r, "step": s, "start_ns": T + s * (2 if r == 2 else 1) * 10**9,
             "end_ns": T + (s + 1) * (2 if r == 2 else 1) * 10**9 - 1, "batch_size": 8}
            for r in range(4) for s in range(10)]
    tp = xm.throughput(rows)
    assert tp["ranks"][0]["unit"] == "samples/s" and tp["ranks"][0]["median_rate"] == 8.0
    assert tp["slow_ranks"] == [2] and tp["ranks"][2]["vs_ranks"] == 0.5


# ---- in a suspect's evidence ---------------------------------------------------------------------------------------

@need_shared
def test_the_xpu_evidence_of_a_suspect_whose_kernels_were_fetched(tmp_path):
    """The causes test's 4-rank job (healthy figures), each rank's kernels the real 2-rank trace's and its Step rows
    that trace's ProfilerStep spans, both moved into the episode: the suspect's evidence carries its V_inter (the
    trace's 2.8 %) and steps/s beside its peers', and its cause stays the detector's."""
    import test_causes as tc
    from steplens.collector.analysis import causes
    from steplens.collector.analysis.findings import Suspect

    res = parse_file(TRACE_2RANK)
    shift = tc.ONSET + 2 * tc.S - res.steps[0][1]
    rows = [{"kind": "kernel", "name": k.name, "start_ns": k.start_mono_ns + shift, "end_ns": k.end_mono_ns + shift,
             "launch_start_ns": k.launch_start_mono_ns + shift, "launch_end_ns": k.launch_end_mono_ns + shift,
             "stream": k.stream, "device": k.device} for k in res.kernels]
    per = tc._job(scenario="")
    for r in range(4):
        per[f"n{r}"] += [rec.Step(b + shift, 100 + r, 7, tc.JOB, r, n, a + shift, b + shift, "profiler", 0, 1,
                                  [rec.StepComm("pg:0", "all_reduce", 5, 10**8, 10**7, -1, 0)])
                         for n, a, b in res.steps]
    rd = tc._write(str(tmp_path / "x.db"), per)
    rd.fetch_kernels = lambda job, ranks, since, until, limit=0: [dict(x, rank=r) for r in ranks for x in rows]
    rd.step_memo = {}
    (g,) = causes.attach(rd, tc.JOB, {"x": [tc._finding(Suspect("rank", "1", 1.0, "compute"))]})["x"]
    s = g.suspects[0]
    assert s.cause == "compute"          # evidence only: the cause is the detector's, as without it
    x = s.evidence["why"]["xpu"]
    want = km.inter_step_void(res.kernels, res.steps)
    assert x["v_inter"] == {"own": want["median"], "own_p90": want["p90"], "steps": 2, "peers": want["median"]}
    assert x["throughput"]["unit"] == "steps/s" and x["throughput"]["source"] == "steps"
    assert x["throughput"]["vs_peers"] == 1.0 and x["throughput"]["before"] is None
    assert x["comm_algbw_gb_per_s"] == {"pg:0": {"own": 10.0, "peers": 10.0}}   # 3 x 10^8 B over 3 x 10^7 ns
    assert x["comm_algbw_method"] == "single_member"


# ---- the bench script prints them ----------------------------------------------------------------------------------

@need_shared
def test_bench_gpu_traces_prints_the_figures_checked_above():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu_traces.py")], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    head = json.loads(out.strip().splitlines()[-1])
    two, one = head["nccl-2rank-rank0.json.gz"], head["nccl-1rank-ns.json.gz"]
    assert two["v_inter_median"] == km.inter_step_void(parse_file(TRACE_2RANK).kernels,
                                                       parse_file(TRACE_2RANK).steps)["median"]
    assert two["v_inter_steps"] == 2 and one["v_inter_steps"] == 4
    assert two["steps_per_s_median"] == pytest.approx(4.494, abs=1e-3)
    assert (two["nccl_collectives_timed"], two["busbw_method"]) == (21, "single_member")
    assert two["busbw_median_gb_per_s"]["all_reduce/16MiB"] == pytest.approx(10.98, abs=0.01)
    assert one["nccl_collectives_timed"] == 0 and one["busbw_method"] is None
    # no CPU op of either trace carries its tensors' shapes: no GEMM FLOPS
    for path, h in ((TRACE_2RANK, two), (TRACE_1RANK, one)):
        assert h["input_dims_events"] == sum(1 for e in _events(path) if "Input Dims" in (e.get("args") or {})) == 0
    assert "V_inter" in out and "busbw" in out and "FLOPS of identical GEMMs: 0 CPU ops carry Input Dims" in out
