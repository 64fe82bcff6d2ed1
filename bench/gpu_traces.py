"""XPUTimer's per-rank kernel metrics (collector/analysis/kernels.py) on the real GPU traces in
../shared/fixtures/gpu-traces (Kineto traces of NCCL jobs recorded on GPU hosts, published by
HolisticTraceAnalysis; see that folder's README): per trace (one rank each) the kernels parsed by steplens'
Kineto parser (agent/parse.py), the issue-latency distribution (all kernels and NCCL kernels), HTA's launch
delay, the minority void V_minority per device, the busiest kernel names' timing, and the issue-latency KS
distance between the two ranks' distributions (two different jobs here: the figure shows what the comparison
prints, not a fault).

    .venv/bin/python bench/gpu_traces.py [--top 8] [TRACE ...]

The last stdout line is one JSON object with the headline figures per trace.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from steplens.agent.parse import parse_file
from steplens.collector.analysis import kernels as km

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "..", "shared", "fixtures", "gpu-traces")


def _us(ns) -> str:
    return "-" if ns is None else f"{ns / 1000:.1f}"


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
        head[os.path.basename(path)] = {
            "rank": rank, "kernels": m["kernels"], "kernel_names": len(m["per_name"]),
            "issue_latency_p50_us": round(il["p50_ns"] / 1000, 1) if il["p50_ns"] is not None else None,
            "issue_latency_p99_us": round(il["p99_ns"] / 1000, 1) if il["p99_ns"] is not None else None,
            "issue_latency_below_50us_fraction": il["below_50us_fraction"],
            "nccl_issue_latency_p50_us": round(ilc["p50_ns"] / 1000, 1) if ilc["p50_ns"] is not None else None,
            "v_minority": {str(d): v["v_minority"] for d, v in m["minority_void"].items()}}
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
