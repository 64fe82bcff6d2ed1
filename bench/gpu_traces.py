"""XPUTimer's per-rank kernel metrics (collector/analysis/kernels.py) on the real GPU traces in
../shared/fixtures/gpu-traces (Kineto traces of NCCL jobs recorded on GPU hosts, published by
HolisticTraceAnalysis; see that folder's README): per trace (one rank each) the kernels parsed by steplens'
Kineto parser (agent/parse.py), the issue-latency distribution (all kernels and NCCL kernels), HTA's launch
delay, the minority void V_minority per device, the busiest kernel names' timing, and the issue-latency KS
distance between the two ranks' distributions (two different jobs here: the figure shows what the comparison
prints, not a fault). Then the rest of XPUTimer's five metrics (collector/analysis/xpumetrics.py): V_inter per
ProfilerStep (kernels split at the step's start by launch time), throughput in steps/s per ProfilerStep (these
traces name no samples or tokens), and the bus bandwidth of every timed NCCL collective. Each file holds one
rank: busbw is the single-member estimate (its data over its own kernel's time, which includes waiting for the
other member; a lower bound of the link's), the cross-member formula needs every member's records. FLOPS of
identical GEMMs (②) needs the CPU op's "Input Dims" (record_shapes=True); the script counts them, and these two
traces have none, so no FLOPS are computed (identical kernels' durations, above, are what is comparable).

    .venv/bin/python bench/gpu_traces.py [--top 8] [TRACE ...]

The last stdout line is one JSON object with the headline figures per trace.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys

from steplens.agent.parse import parse_file
from steplens.collector.analysis import kernels as km
from steplens.collector.analysis import xpumetrics as xm

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "..", "shared", "fixtures", "gpu-traces")


def _us(ns) -> str:
    return "-" if ns is None else f"{ns / 1000:.1f}"


def shape_events(path: str) -> int:
    """CPU ops carrying "Input Dims" (what a GEMM's FLOPs would be computed from)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        ev = json.load(fh).get("traceEvents") or []
    return sum(1 for e in ev if isinstance(e, dict) and "Input Dims" in (e.get("args") or {}))


def xpu(res) -> dict:
    """V_inter, throughput and busbw of one parsed trace (one rank)."""
    vi = km.inter_step_void(res.kernels, res.steps)
    tp = xm.throughput([{"rank": 0, "step": n, "start_ns": a, "end_ns": b} for n, a, b in res.steps])
    inst, skipped = xm.collective_instances(res.ops)
    return {"v_inter": vi, "throughput": tp["ranks"].get(0), "rates": xm.step_rates(
        [{"rank": 0, "step": n, "start_ns": a, "end_ns": b} for n, a, b in res.steps]).get(0, {}).get("steps", []),
        "collectives": inst, "skipped": skipped, "busbw": xm.compare_busbw(inst)}


def print_xpu(x: dict, shapes: int) -> None:
    vi = x["v_inter"]
    print(f"  V_inter (inter-step void; kernels split at each ProfilerStep start by launch time): median {vi['median']}"
          f"  p90 {vi['p90']}  over {vi['count']} of {len(vi['steps'])} steps")
    for s in vi["steps"]:
        gap = "- (no kernel launched before it in the trace)" if s["t_inter_ns"] is None else \
            f"{s['t_inter_ns'] / 1000:.1f} us of {s['t_step_ns'] / 1e6:.1f} ms: V_inter {s['v_inter']}"
        print(f"    step {s['step']:>4}  {gap}")
    tp = x["throughput"]
    if tp:
        print(f"  throughput ({tp['unit']}, ProfilerStep start to the next one's): median {tp['median_rate']:.3f}  "
              + "  ".join(f"#{r['step']} {r['rate']:.3f}" for r in x["rates"]))
    inst = x["collectives"]
    if inst:
        print(f"  NCCL collectives ({len(inst)}, {inst[0]['method'].replace('_', '-')} estimates: this file holds one "
              f"member of {inst[0]['n']}; its kernel time includes waiting for the others)")
        print(f"    {'seq':>4} {'op':<11} {'n':>2} {'data bytes':>11} {'bucket':>7} {'time us':>9} {'algbw GB/s':>10} "
              f"{'busbw GB/s':>10}")
        for c in inst:
            print(f"    {c['seq']:>4} {c['op']:<11} {c['n']:>2} {c['data_bytes']:>11} {c['size_bucket']:>7} "
                  f"{(c['t1_ns'] - c['t0_ns']) / 1000:>9.1f} {c['algbw_gb_per_s']:>10.3f} {c['busbw_gb_per_s']:>10.3f}")
        for comm, classes in x["busbw"]["communicators"].items():
            print(f"    median busbw on {comm}: " + ", ".join(
                f"{k} {v['median_busbw_gb_per_s']:.2f} GB/s ({v['count']})" for k, v in classes.items()))
    sk = x["skipped"]
    if sk["untimed"]:
        print(f"  {sk['untimed']} comm ops untimed (cpu_enqueue: no NCCL kernel launched, e.g. a 1-rank group): "
              "no busbw")
    print(f"  FLOPS of identical GEMMs: {shapes} CPU ops carry Input Dims"
          + (" (recorded without record_shapes): not computed" if not shapes else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="*")
    p.add_argument("--top", type=int, default=8)
    a = p.parse_args(argv)
    paths = a.traces or sorted(glob.glob(os.path.join(FIXTURES, "*.json.gz")))
    if not paths:
        print(f"no traces given and none in {FIXTURES}", file=sys.stderr)
        return 2
    head, by_rank = {}, {}
    for path in paths:
        res = parse_file(path)
        rank = (res.notes.get("distributed") or {}).get("rank", -1)
        ks = res.kernels
        m = km.rank_metrics(ks)
        by_rank[os.path.basename(path)] = ks
        il, ilc, ld = m["issue_latency"], m["issue_latency_comm"], m["launch_delay"]
        print(f"\n{os.path.basename(path)} (rank {rank}): {m['kernels']} kernels")
        for label, d in (("issue latency, all", il), ("issue latency, NCCL", ilc), ("launch delay (HTA)", ld)):
            print(f"  {label:<20} n {d['count']:>5}  p10 {_us(d['p10_ns']):>9} us  p50 {_us(d['p50_ns']):>9} us  "
                  f"p90 {_us(d['p90_ns']):>9} us  p99 {_us(d['p99_ns']):>9} us  < 50 us {d['below_50us_fraction']}")
        for dev, v in m["minority_void"].items():
            print(f"  minority void, device {dev}: {v['void_ns'] / 1e6:.2f} ms of {v['span_ns'] / 1e6:.1f} ms "
                  f"(V_minority {v['v_minority']})")
        print(f"  {'kernel':<60} {'count':>6} {'total ms':>9} {'mean us':>9} {'p50 us':>9} {'p99 us':>9}")
        for name, t in list(m["per_name"].items())[:a.top]:
            print(f"  {name[:60]:<60} {t['count']:>6} {t['total_ns'] / 1e6:>9.2f} {t['mean_ns'] / 1000:>9.1f} "
                  f"{t['p50_ns'] / 1000:>9.1f} {t['p99_ns'] / 1000:>9.1f}")
        x = xpu(res)
        shapes = shape_events(path)
        print_xpu(x, shapes)
        inst = x["collectives"]
        head[os.path.basename(path)] = {
            "rank": rank, "kernels": m["kernels"], "kernel_names": len(m["per_name"]),
            "issue_latency_p50_us": round(il["p50_ns"] / 1000, 1) if il["p50_ns"] is not None else None,
            "issue_latency_p99_us": round(il["p99_ns"] / 1000, 1) if il["p99_ns"] is not None else None,
            "issue_latency_below_50us_fraction": il["below_50us_fraction"],
            "nccl_issue_latency_p50_us": round(ilc["p50_ns"] / 1000, 1) if ilc["p50_ns"] is not None else None,
            "v_minority": {str(d): v["v_minority"] for d, v in m["minority_void"].items()},
            "v_inter_median": x["v_inter"]["median"], "v_inter_steps": x["v_inter"]["count"],
            "steps_per_s_median": x["throughput"]["median_rate"] if x["throughput"] else None,
            "nccl_collectives_timed": len(inst), "busbw_method": inst[0]["method"] if inst else None,
            "busbw_median_gb_per_s": {k: v["median_busbw_gb_per_s"] for c in x["busbw"]["communicators"].values()
                                      for k, v in c.items()},
            "input_dims_events": shapes}
    if len(by_rank) > 1:
        cmp = km.compare_ranks(by_rank)
        print("\nissue-latency KS distance against the other trace(s):")
        for name, c in cmp.items():
            print(f"  {name:<28} all {c['ks_issue_latency']}  NCCL {c['ks_issue_latency_comm']}")
            head[name]["ks_issue_latency"] = c["ks_issue_latency"]
    print(json.dumps(head))
    return 0


if __name__ == "__main__":
    sys.exit(main())
