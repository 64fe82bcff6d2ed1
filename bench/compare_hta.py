"""Cross-check steplens' Kineto trace parser (agent/kineto/trace.py through agent/parse.py `parse_file`, what
`steplens-agent parse FILE --json` prints) against HolisticTraceAnalysis (HTA, Meta's trace analyser) on the
real GPU traces in the repository.

    .venv/bin/python bench/compare_hta.py [--hta-python /tmp/htavenv/bin/python] [--top 5] [TRACE ...]

HTA is not a steplens dependency: install it in a scratch venv outside the repository,

    python3 -m venv /tmp/htavenv && /tmp/htavenv/bin/pip install HolisticTraceAnalysis

and this script runs a small HTA program in that venv as a subprocess (exit 2 if the interpreter is missing).
Per trace it compares, steplens next to HTA:

  kernels            GPU kernels: steplens' KernelRecs vs the rows of HTA's parsed dataframe whose category is
                     `kernel` (HTA's GPUKernelFilter also counts memcpy/memset: shown, not compared)
  kernel time sum    sum of the kernels' durations; kernel durations: kernel by kernel, by correlation id
  kernels/name       count per kernel name, every name (the top names are printed)
  kernels/stream     count per CUDA stream
  comm kernels       HTA's KernelType.COMMUNICATION (name matches ^nccl.*Kernel) vs steplens' NCCL test in
                     trace.py ("nccl" in the kernel name)
  comm time sum      sum of the communication kernels' durations
  comm busy time     union of the communication kernels' intervals (HTA: its merge_kernel_intervals); HTA's
                     get_gpu_kernel_breakdown figure (rows containing COMMUNICATION) is shown, not compared: it
                     truncates every overlap segment to whole µs
  launch pairs       kernels HTA's get_cuda_kernel_launch_stats pairs with a cudaLaunchKernel/cudaLaunchKernelExC
                     (include_memory_events=False) vs steplens' kernels whose launch_api is one of those two
  launch delay       HTA's launch_delay = kernel start - (launch start + launch dur), clipped at 0, computed
                     from steplens' KernelRec the same way, compared launch by launch (by correlation id)

HTA is run with HTA_DISABLE_NS_ROUNDING=1 so both read the trace's own times; HTA's defaults (it rounds
fractional-µs starts up and ends down to whole µs; TraceAnalysis drops GPU kernels whose launch is not before
the last ProfilerStep) are shown as information lines, not compared. A figure is equal when the counts are
identical, or, for times, when they differ by at most 2 ns per kernel (steplens rounds each time to an integer
ns, HTA keeps µs doubles whose step is ~1 ns at the 4.5e12 µs of relative-time traces).
The last stdout line is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEFAULT_TRACES = [
    "/work/shared/fixtures/gpu-traces/nccl-2rank-rank0.json.gz",
    "/work/shared/fixtures/gpu-traces/nccl-1rank-ns.json.gz",
    os.path.join(ROOT, "tests/fixtures/gpu-real/hta-16rank-rank0.json.gz"),
    os.path.join(ROOT, "tests/fixtures/gpu-real/hta-128rank-sampled-rank0.json.gz"),
    os.path.join(ROOT, "tests/fixtures/gpu-real/kineto-tbplugin-resnet50-2021.json.gz"),
    os.path.join(ROOT, "tests/fixtures/gpu-recorded/kineto-nccl.json.gz"),
]
HTA_LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC")
# steplens keeps integer ns (each time rounded, <= 0.5 ns), HTA float us (ulp ~1 ns at 4.5e12 us): a time
# derived from two or three trace times may differ by ~1.5 ns without either being wrong
TOL_NS = 2

# Runs in the HTA venv: argv[1] is a JSON list of trace paths; prints one JSON object {path: figures}.
HTA_PROGRAM = r'''
import copy, json, logging, os, sys, warnings
from collections import Counter
warnings.filterwarnings("ignore")
from importlib.metadata import version
from hta.configs.config import logger
logger.setLevel(logging.ERROR)
from hta.common.trace import Trace
from hta.common.trace_filter import GPUKernelFilter
from hta.analyzers.breakdown_analysis import BreakdownAnalysis
from hta.analyzers.cuda_kernel_analysis import CudaKernelAnalysis
from hta.utils.utils import get_kernel_type, KernelType, merge_kernel_intervals

COMM = KernelType.COMMUNICATION.name

def load(path, rounding):
    if rounding:
        os.environ.pop("HTA_DISABLE_NS_ROUNDING", None)
    else:
        os.environ["HTA_DISABLE_NS_ROUNDING"] = "1"
    t = Trace(trace_files={0: path}, trace_dir="/")
    t.parse_traces(use_multiprocessing=False)
    return t

def figures(t, full):
    df = t.traces[0]
    st = t.symbol_table.get_sym_table()
    cats = df["cat"].map(lambda i: st[i])
    names = df["name"].map(lambda i: st[i])
    gk = GPUKernelFilter()(df, t.symbol_table)
    out = {"gpu_filter_count": int(len(gk)),
           "gpu_filter_by_cat": dict(Counter(st[c] for c in gk["cat"]))}
    kmask = cats.str.lower().eq("kernel")
    kern = df[kmask]
    out["kernel_count"] = int(len(kern))
    out["kernel_dur_sum_us"] = float(kern["dur"].sum())
    out["kernel_ts_max_us"] = float(kern["ts"].max()) if len(kern) else 0.0
    ktype = gk["name"].map(lambda i: get_kernel_type(st[i]))
    comm = gk[ktype.eq(COMM)]
    out["comm_count"] = int(len(comm))
    out["comm_dur_sum_us"] = float(comm["dur"].sum())
    out["kernel_types"] = dict(Counter(ktype))
    type_df, _ = BreakdownAnalysis.get_gpu_kernel_breakdown(t, visualize=False)
    out["breakdown"] = {str(r["kernel_type"]): float(r["sum"]) for _, r in type_df.iterrows()}
    out["breakdown_comm_us"] = sum(v for k, v in out["breakdown"].items() if COMM in k)
    merged = merge_kernel_intervals(comm.copy()) if len(comm) else None
    out["comm_busy_us"] = float((merged["end"] - merged["ts"]).sum()) if merged is not None else 0.0
    ls = CudaKernelAnalysis.cuda_kernel_launch_stats(t, [0], include_memory_events=False, visualize=False)[0]
    delays = [float(x) for x in ls["launch_delay"]]
    out["launch_count"] = len(delays)
    out["launch_delay_median_us"] = (sorted(delays)[len(delays) // 2] if delays else None)
    if full:
        out["kernels_by_name"] = dict(Counter(names[kmask]))
        out["kernels_by_stream"] = {str(k): int(v) for k, v in Counter(kern["stream"]).items()}
        out["comm_names"] = dict(Counter(names[gk.index[ktype.eq(COMM)]] if len(comm) else []))
        out["kernel_durs"] = [[int(c), float(d)] for c, d in zip(kern["correlation"], kern["dur"])]
        out["launches"] = [[int(c), float(d)] for c, d in zip(ls["correlation"], ls["launch_delay"])]
        steps = [v for k, v in t.symbol_table.get_sym_id_map().items() if "ProfilerStep" in k]
        out["profiler_steps"] = len(steps)
        saved = {r: d.copy() for r, d in t.traces.items()}
        for last in (False, True):
            t.traces = {r: d.copy() for r, d in saved.items()}
            t.align_and_filter_trace(include_last_profiler_step=last)
            d = t.traces[0]
            c = d["cat"].map(lambda i: st[i])
            out["ta_kernel_count_last_step_%s" % ("in" if last else "out")] = int(c.str.lower().eq("kernel").sum())
        t.traces = saved
    return out

res = {"hta_version": version("HolisticTraceAnalysis"), "traces": {}}
for path in json.loads(sys.argv[1]):
    try:
        exact = figures(load(path, rounding=False), full=True)
        rounded = figures(load(path, rounding=True), full=False)
        exact["rounded"] = {k: rounded[k] for k in ("kernel_count", "kernel_dur_sum_us", "comm_dur_sum_us",
                                                    "breakdown_comm_us", "launch_count", "launch_delay_median_us")}
        res["traces"][path] = exact
    except Exception as exc:
        import traceback
        res["traces"][path] = {"error": "%s: %s" % (type(exc).__name__, exc), "tb": traceback.format_exc()}
print(json.dumps(res))
'''


def run_hta(python: str, paths: list[str]) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    p = subprocess.run(["nice", "-n", "10", python, "-c", HTA_PROGRAM, json.dumps(paths)],
                       capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0 or not p.stdout.strip():
        sys.stderr.write(p.stderr[-4000:])
        raise SystemExit(f"HTA program failed (rc {p.returncode})")
    return json.loads(p.stdout.strip().splitlines()[-1])


def union_ns(intervals: list[tuple[int, int]]) -> int:
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def steplens_figures(path: str) -> dict:
    from steplens.agent.parse import parse_file
    res = parse_file(path)
    ks = res.kernels
    comm = [k for k in ks if "nccl" in k.name.lower()]
    launches: dict[int, list[float]] = {}
    for k in ks:
        if k.launch_api in HTA_LAUNCH_APIS and k.launch_start_mono_ns:
            launches.setdefault(k.correlation_id, []).append(max(k.start_mono_ns - k.launch_end_mono_ns, 0))
    issue = sorted(k.start_mono_ns - k.launch_start_mono_ns for k in ks if k.launch_start_mono_ns)
    durs: dict[int, list[int]] = {}
    for k in ks:
        durs.setdefault(k.correlation_id, []).append(k.end_mono_ns - k.start_mono_ns)
    return {
        "kernel_count": len(ks),
        "kernel_durs": durs,
        "kernels_by_name": Counter(k.name for k in ks),
        "kernels_by_stream": Counter(str(k.stream) for k in ks),
        "comm_count": len(comm),
        "comm_dur_sum_ns": sum(k.end_mono_ns - k.start_mono_ns for k in comm),
        "comm_busy_ns": union_ns([(k.start_mono_ns, k.end_mono_ns) for k in comm]),
        "comm_names": Counter(k.name for k in comm),
        "launches": launches,
        "no_launch": sum(1 for k in ks if not k.launch_start_mono_ns),
        "launch_apis": Counter(k.launch_api or "(none)" for k in ks),
        "issue_median_ns": issue[len(issue) // 2] if issue else None,
        "ops": len(res.ops),
        "gpu_kernel_ops": sum(1 for o in res.ops if o.timing == "gpu_kernel"),
    }


def per_item(a: dict[int, list], b: dict[int, list]) -> dict:
    """Pair values by correlation id (sorted within one id) and compare: matched, over TOL_NS, max |diff|,
    median diff (steplens - HTA), in ns."""
    diffs = [x - y for corr in set(a) & set(b) for x, y in zip(sorted(a[corr]), sorted(b[corr]))]
    return {"matched": len(diffs), "bad": sum(1 for d in diffs if abs(d) > TOL_NS),
            "max": max((abs(d) for d in diffs), default=0.0),
            "median": statistics.median(diffs) if diffs else 0.0}


def counter_diff(a: Counter, b: Counter) -> list[tuple[str, int, int]]:
    return sorted(((k, a.get(k, 0), b.get(k, 0)) for k in set(a) | set(b) if a.get(k, 0) != b.get(k, 0)),
                  key=lambda r: -abs(r[1] - r[2]))


def short(name: str, n: int = 60) -> str:
    return name if len(name) <= n else name[: n - 3] + "..."


def compare(path: str, sl: dict, h: dict, top: int) -> tuple[list[dict], list[str], dict]:
    """Rows (figure, steplens, hta, equal, note), info lines, and per-trace numbers for the headline."""
    rows: list[dict] = []
    info: list[str] = []

    def row(fig, a, b, equal, note=""):
        rows.append({"figure": fig, "steplens": a, "hta": b, "equal": bool(equal), "note": note})

    kc, hc = sl["kernel_count"], h["kernel_count"]
    row("kernels", kc, hc, kc == hc, "" if kc == hc else f"diff {kc - hc:+d}")

    # kernel durations, kernel by kernel (by correlation id; several kernels of one cudaGraphLaunch share one)
    hd: dict[int, list[float]] = {}
    for corr, dur_us in h["kernel_durs"]:
        hd.setdefault(corr, []).append(dur_us * 1000)
    kd = per_item(sl["kernel_durs"], hd)
    a, b = sum(sum(v) for v in sl["kernel_durs"].values()), h["kernel_dur_sum_us"] * 1000
    row("kernel time sum (us)", f"{a / 1e3:.3f}", f"{b / 1e3:.3f}", abs(a - b) <= TOL_NS * max(kc, 1),
        f"diff {(a - b) / 1e3:+.3f} us" if abs(a - b) > TOL_NS * max(kc, 1) else "")
    row("kernel durations", f"{kc} kernels", f"{kd['matched']} matched", kd["bad"] == 0 and kd["matched"] == kc == hc,
        f"{kd['bad']} differ > {TOL_NS} ns, max |diff| {kd['max']:.1f} ns, median diff {kd['median']:+.1f} ns")

    hn = Counter(h["kernels_by_name"])
    d = counter_diff(sl["kernels_by_name"], hn)
    row("kernels/name", f"{len(sl['kernels_by_name'])} names", f"{len(hn)} names", not d,
        "" if not d else f"{len(d)} names differ, e.g. {short(d[0][0])}: {d[0][1]} vs {d[0][2]}")
    for name, n in sl["kernels_by_name"].most_common(top):
        info.append(f"  top name {n:>6} vs {hn.get(name, 0):>6}  {short(name, 90)}")

    hs = Counter({k: v for k, v in h["kernels_by_stream"].items()})
    d = counter_diff(sl["kernels_by_stream"], hs)
    fmt = lambda c: " ".join(f"{k}:{v}" for k, v in sorted(c.items(), key=lambda kv: int(kv[0])))  # noqa: E731
    row("kernels/stream", fmt(sl["kernels_by_stream"]), fmt(hs), not d,
        "" if not d else "; ".join(f"stream {s}: {a} vs {b}" for s, a, b in d[:4]))

    cc, hcc = sl["comm_count"], h["comm_count"]
    note = ""
    if cc != hcc:
        d = counter_diff(sl["comm_names"], Counter(h["comm_names"]))
        note = "; ".join(f"{short(n, 50)}: {a} vs {b}" for n, a, b in d[:3])
    row("comm kernels", cc, hcc, cc == hcc, note)

    tol = TOL_NS * max(cc, hcc, 1)
    a, b = sl["comm_dur_sum_ns"], h["comm_dur_sum_us"] * 1000
    row("comm time sum (us)", f"{a / 1e3:.3f}", f"{b / 1e3:.3f}", abs(a - b) <= tol,
        "" if abs(a - b) <= tol else f"diff {(a - b) / 1e3:+.3f} us")
    a, b = sl["comm_busy_ns"], h["comm_busy_us"] * 1000
    row("comm busy time (us)", f"{a / 1e3:.3f}", f"{b / 1e3:.3f}", abs(a - b) <= tol,
        "" if abs(a - b) <= tol else f"diff {(a - b) / 1e3:+.3f} us")

    # launch delay, launch by launch
    hl: dict[int, list[float]] = {}
    for corr, delay_us in h["launches"]:
        hl.setdefault(corr, []).append(delay_us * 1000)
    sl_l = sl["launches"]
    ns, nh = sum(len(v) for v in sl_l.values()), sum(len(v) for v in hl.values())
    row("launch pairs", ns, nh, ns == nh, "" if ns == nh else f"diff {ns - nh:+d}")
    ld = per_item(sl_l, hl)
    bad, max_abs = ld["bad"], ld["max"]
    sl_all = sorted(x for v in sl_l.values() for x in v)
    h_all = sorted(x for v in hl.values() for x in v)
    med_s = sl_all[len(sl_all) // 2] if sl_all else None
    med_h = h_all[len(h_all) // 2] if h_all else None
    row("launch delay (per launch)", f"median {med_s / 1e3:.3f} us" if med_s is not None else "-",
        f"median {med_h / 1e3:.3f} us" if med_h is not None else "-", bad == 0 and ns == nh,
        f"{ld['matched']} matched by correlation, {bad} differ > {TOL_NS} ns, max |diff| {max_abs:.1f} ns, "
        f"median diff {ld['median']:+.1f} ns")

    # information, not compared
    info.append(f"  HTA get_gpu_kernel_breakdown: time with communication running {h['breakdown_comm_us']:.3f} us "
                f"(segments truncated to whole us), rows {h['breakdown']}")
    info.append(f"  HTA GPUKernelFilter {h['gpu_filter_count']} GPU events {h['gpu_filter_by_cat']}; "
                f"kernel types {h['kernel_types']}")
    info.append(f"  HTA TraceAnalysis default (kernels launched before the last ProfilerStep, "
                f"{h['profiler_steps']} ProfilerStep names): {h['ta_kernel_count_last_step_out']} kernels; "
                f"include_last_profiler_step=True: {h['ta_kernel_count_last_step_in']}")
    r = h["rounded"]
    info.append(f"  HTA with its default ns rounding: kernels {r['kernel_count']}, kernel time "
                f"{r['kernel_dur_sum_us']:.3f} us, comm sum {r['comm_dur_sum_us']:.3f} us, breakdown comm "
                f"{r['breakdown_comm_us']:.3f} us, launch pairs "
                f"{r['launch_count']}, launch delay median "
                + (f"{r['launch_delay_median_us']:.3f} us" if r["launch_delay_median_us"] is not None else "-"))
    info.append(f"  steplens: launch APIs {dict(sl['launch_apis'])}; issue latency (kernel start - launch "
                f"start) median " + (f"{sl['issue_median_ns'] / 1e3:.3f} us" if sl["issue_median_ns"] is not None
                                     else "-") + f"; ops {sl['ops']} ({sl['gpu_kernel_ops']} timed by kernels)")
    # the step of a float64 at the trace's own `ts` values (µs, before baseTimeNanoseconds): the finest time
    # a JSON reader that parses them as doubles can see
    info.append(f"  trace ts up to {h['kernel_ts_max_us']:.6g} us: float64 step there "
                f"{math.ulp(h['kernel_ts_max_us']) * 1000:.3g} ns")
    numbers = {"kernel_count_diff": abs(kc - hc),
               "launch_median_diff_ns": (med_s - med_h) if med_s is not None and med_h is not None else None,
               "launch_max_abs_diff_ns": max_abs,
               "kernel_dur_max_abs_diff_ns": kd["max"],
               "rounded_launch_median_diff_ns": (med_s - r["launch_delay_median_us"] * 1000)
               if med_s is not None and r["launch_delay_median_us"] is not None else None}
    return rows, info, numbers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="*", help="Kineto traces (default: the repository's real GPU traces)")
    ap.add_argument("--hta-python", default="/tmp/htavenv/bin/python",
                    help="python of a venv with HolisticTraceAnalysis installed")
    ap.add_argument("--top", type=int, default=5, help="kernel names to list per trace")
    args = ap.parse_args()
    if not (os.path.isfile(args.hta_python) and os.access(args.hta_python, os.X_OK)):
        print(f"HTA python {args.hta_python!r} not found. Install HTA in a scratch venv outside the repository:\n"
              f"  python3 -m venv /tmp/htavenv && /tmp/htavenv/bin/pip install HolisticTraceAnalysis\n"
              f"or pass --hta-python PATH.", file=sys.stderr)
        return 2
    paths = [os.path.abspath(p) for p in (args.traces or DEFAULT_TRACES)]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        print(f"missing traces: {missing}", file=sys.stderr)
        return 2
    hta = run_hta(args.hta_python, paths)
    print(f"HTA {hta['hta_version']} ({args.hta_python}) vs steplens agent/kineto/trace.py, {len(paths)} traces\n")
    compared = equal = 0
    nums, errors = [], 0
    for path in paths:
        h = hta["traces"][path]
        print(f"== {os.path.relpath(path, ROOT) if path.startswith(ROOT) else path}")
        if "error" in h:
            errors += 1
            print(f"  HTA failed: {h['error']}\n{h.get('tb', '')}")
            continue
        sl = steplens_figures(path)
        rows, info, n = compare(path, sl, h, args.top)
        nums.append(n)
        print(f"  {'figure':<26} {'steplens':>22} {'HTA':>22}  {'':5} note")
        for r in rows:
            compared += 1
            equal += r["equal"]
            print(f"  {r['figure']:<26} {str(r['steplens'])[:22]:>22} {str(r['hta'])[:22]:>22}  "
                  f"{'equal' if r['equal'] else 'DIFF':5} {r['note']}")
        print("\n".join(info))
        print()
    meds = [n["launch_median_diff_ns"] for n in nums if n["launch_median_diff_ns"] is not None]
    rmeds = [n["rounded_launch_median_diff_ns"] for n in nums if n["rounded_launch_median_diff_ns"] is not None]
    head = {"hta_version": hta["hta_version"], "traces": len(paths), "hta_errors": errors,
            "figures_compared": compared, "figures_equal": equal,
            "max_kernel_count_diff": max((n["kernel_count_diff"] for n in nums), default=None),
            "launch_latency_median_diff_ns": max(meds, key=abs) if meds else None,
            "kernel_duration_max_abs_diff_ns": round(max((n["kernel_dur_max_abs_diff_ns"] for n in nums),
                                                         default=0), 3),
            "launch_latency_max_abs_diff_ns": round(max((n["launch_max_abs_diff_ns"] for n in nums), default=0), 3),
            "launch_latency_median_diff_vs_hta_rounded_ns": round(max(rmeds, key=abs), 1) if rmeds else None}
    print(json.dumps(head))
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
