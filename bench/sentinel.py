"""The sentinel (collector/analysis/sentinel.py) scored on a real serving engine's recorded batches.

    .venv-vllm/bin/python bench/inference/record.py --seconds 240 --rate 25 --prompt 16:512 --output 16:160 \\
        --out /tmp/vllm-steps.jsonl --fault noisy:50:70 --fault mem:100:120 --fault slow:150:170 --fault cpu:200:215
    .venv/bin/python bench/sentinel.py /tmp/vllm-steps.jsonl [--train-seconds 45] [--settle-seconds 10]

The recording (bench/inference/record.py: vLLM's CPU build, a tiny Llama with dummy weights, Poisson load, faults
with their windows) holds per batch its workload and its duration. The sentinel is fitted on the decode batches
of the first --train-seconds (no fault there) and then judges every later decode batch in order, refitting as
it goes (alarmed batches never feed it). Scored per judged batch against the fault windows (LatencyPrism's
protocol scores samples too; its normal batches all come before its one injection, so it never meets the
window - 1 batches after a fault whose moving average still holds faulty ones: those are left out here and
their alarms printed apart): precision, recall, F1, the false-positive rate on normal batches, and per fault
window the batches from its onset to the first alarm (lag); the baseline's fit (R², MAPE, out of fold) beside
LatencyPrism's 0.963 / 6.06 % and its F1 0.985 at FPR 0.59 %. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from steplens.collector.analysis.sentinel import Sentinel, SentinelConfig, features


class _Recorded:
    """A store reader over a recording's Iteration rows (what the sentinel detector reads)."""

    path = "recording"

    def __init__(self, rows: list[dict]) -> None:
        self.rows = sorted(rows, key=lambda r: r["end_ns"])
        self.ends = [r["end_ns"] for r in self.rows]

    def iterations(self, job_key: str, since_ns: int = 0, until_ns: int = 0, limit: int = 0) -> list[dict]:
        import bisect
        a = bisect.bisect_right(self.ends, since_ns)
        b = bisect.bisect_right(self.ends, until_ns) if until_ns else len(self.ends)
        return [r for r in self.rows[a:b] if r["job_key"] == job_key]


def score_iterations(path: str, cfg_args: dict, pass_seconds: float = 1.0) -> dict:
    """A recording of stored Iteration rows (bench/testbed_sentinel.py) replayed through the sentinel detector
    itself, one pass per `pass_seconds` of data: per judged iteration (every rank's) against the fault windows,
    and its findings against them (found: a finding's onset within [start - 1 s, end])."""
    import gzip

    from steplens.collector.analysis.base import Window
    from steplens.collector.analysis.sentinel import SentinelDetector, SentinelDetectorConfig
    with gzip.open(path, "rt") as fh:
        head = json.loads(fh.readline())
        rows = [json.loads(line) for line in fh]
    cfg = SentinelDetectorConfig(**cfg_args)
    det = SentinelDetector(trace=True)
    rd = _Recorded(rows)
    job = head["job_key"]
    t, end = rd.ends[0], rd.ends[-1]
    findings: dict[tuple, object] = {}
    while t < end + int(pass_seconds * 1e9):
        t += int(pass_seconds * 1e9)
        for f in det.detect(rd, Window(job, max(0, t - int(cfg.window_seconds * 1e9)), t), cfg):
            findings[(f.kind, f.onset_ns)] = f
    faults = head["faults"]

    def in_fault(ns: int) -> bool:
        return any(f["start_ns"] <= ns <= f["end_ns"] for f in faults)
    tp = fp = fn = tn = 0
    lags = []
    for s in det.series.values():
        first = {}
        for ns, alarm in s.trace or []:
            truth = in_fault(ns)
            tp += alarm and truth
            fp += alarm and not truth
            fn += (not alarm) and truth
            tn += (not alarm) and not truth
            for k, f in enumerate(faults):
                if alarm and f["start_ns"] <= ns <= f["end_ns"] and k not in first:
                    first[k] = (ns - f["start_ns"]) / 1e9
        lags += list(first.values())
    prec = tp / max(1, tp + fp)
    rec = tp / max(1, tp + fn)
    found = [any(f["start_ns"] - 10**9 <= x.onset_ns <= f["end_ns"] for x in findings.values()) for f in faults]
    false = [x for x in findings.values() if not any(f["start_ns"] - 10**9 <= x.onset_ns <= f["end_ns"]
                                                      for f in faults)]
    m = next((s.model for s in det.series.values() if s.model is not None), None)
    return {"recording": path, "iterations": len(rows), "series": len(det.series),
            "fit_r2": round(m.fit_r2, 4) if m else None, "fit_mape_pct": round(100 * m.fit_mape, 2) if m else None,
            "ucl": round(m.ucl, 4) if m else None, "precision": round(prec, 4), "recall": round(rec, 4),
            "f1": round(2 * prec * rec / max(1e-9, prec + rec), 4), "fpr_pct": round(100 * fp / max(1, fp + tn), 3),
            "first_alarm_after_s": round(min(lags), 2) if lags else None, "faults_found": sum(found),
            "faults": len(faults), "false_findings": len(false),
            "findings": [(round((x.onset_ns - faults[0]["start_ns"]) / 1e9, 1), x.severity,
                          x.evidence.get("alarmed_iterations")) for x in findings.values()],
            "step_log": head.get("step_log")}


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--iterations":
        ap = argparse.ArgumentParser(description="score a recording of stored Iterations through the detector")
        ap.add_argument("--iterations", required=True)
        ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a [detectors.sentinel] key, e.g. window_training=50")
        a = ap.parse_args(argv)
        over = {}
        for kv in a.set:
            k, _, v = kv.partition("=")
            over[k] = json.loads(v)
        res = score_iterations(a.iterations, over)
        print(json.dumps(res))
        return 0
    return _main_batches(argv)


def _main_batches(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("steps")
    ap.add_argument("--train-seconds", type=float, default=45.0)
    ap.add_argument("--min-ucl", type=float, default=SentinelConfig.min_ucl,
                    help="SentinelConfig.min_ucl: a floor under the UCL")
    ap.add_argument("--current-share", type=float, default=SentinelConfig.current_share,
                    help="SentinelConfig.current_share: an MA alarm needs the batch's own PPE >= this x UCL")
    ap.add_argument("--single-factor", type=float, default=SentinelConfig.single_factor,
                    help="SentinelConfig.single_factor: one batch alone alarms above this x UCL (0: off)")
    ap.add_argument("--settle-seconds", type=float, default=0.0,
                    help="also leave out the normal batches this long after each fault ends (recovery)")
    a = ap.parse_args(argv)
    with open(a.steps) as fh:
        head = json.loads(fh.readline())
        rows = [json.loads(line) for line in fh if line.strip()]
    X = features(rows)
    y = np.array([r["dur_ns"] for r in rows], dtype=np.float64)
    t = np.array([r["t_s"] for r in rows])
    fault = np.array([r["fault"] or "" for r in rows])
    train = (t < a.train_seconds) & (fault == "")
    s = Sentinel(SentinelConfig(min_ucl=a.min_ucl, current_share=a.current_share,
                                single_factor=a.single_factor)).fit(X[train], y[train])
    rest = ~(t < a.train_seconds)
    out = s.score(X[rest], y[rest])
    judged = out["judged"] & ~np.isnan(out["ma"])
    alarm = out["alarm"][judged]
    truth = fault[rest][judged] != ""
    # the moving average still holds faulty batches for window - 1 judged batches after a fault ends: those are
    # neither counted as false positives nor as true negatives (printed apart: `tail_alarms`)
    tail = np.zeros(len(truth), dtype=bool)
    ends = np.flatnonzero(truth[:-1] & ~truth[1:]) + 1
    for e in ends:
        tail[e:e + s.cfg.window - 1] = True
    tj = t[rest][judged]
    for e in ends:   # --settle-seconds: the host's recovery after a fault (reclaim, backlog), LatencyPrism's
        tail |= (tj >= tj[e]) & (tj < tj[e] + a.settle_seconds)   # protocol has none (one injection, at the end)
    tail &= ~truth
    raw_fp = int((alarm & ~truth).sum())
    counted = ~tail
    all_alarm = alarm
    alarm, truth = alarm[counted], truth[counted]
    tp = int((alarm & truth).sum())
    fp = int((alarm & ~truth).sum())
    fn = int((~alarm & truth).sum())
    prec = tp / max(1, tp + fp)
    rec = tp / max(1, tp + fn)
    f1 = 2 * prec * rec / max(1e-9, prec + rec)
    fpr = fp / max(1, int((~truth).sum()))
    per = {}
    kinds = fault[rest][judged]
    for kind in sorted(set(kinds) - {""}):
        m = kinds == kind
        first = int(np.argmax(all_alarm[m])) if all_alarm[m].any() else None
        per[kind] = {"batches": int(m.sum()), "recall": round(float(all_alarm[m].mean()), 4), "lag_batches": first,
                     "slowdown_median": round(float(np.median(y[rest][judged][m]) /
                                                    np.median(y[rest][judged][kinds == ""])), 2)}
    res = {"recording": a.steps, "vllm": head.get("vllm"), "batches": len(rows),
           "train_batches": int(s._judged(X[train]).sum()), "judged_batches": int(judged.sum()),
           "fit_r2": round(s.fit_r2, 4), "fit_mape_pct": round(100 * s.fit_mape, 2), "ucl": round(s.ucl, 4),
           "precision": round(prec, 4), "recall": round(rec, 4), "f1": round(f1, 4),
           "fpr_pct": round(100 * fpr, 3), "tail_alarms": raw_fp - fp, "refits": s.refits, "per_fault": per}
    print(f"{a.steps}: {len(rows)} batches, baseline R2 {s.fit_r2:.3f} MAPE {100 * s.fit_mape:.2f} % (out of fold; "
          f"LatencyPrism 0.963 / 6.06 %), UCL {s.ucl:.3f}; judged {int(judged.sum())} decode batches: precision "
          f"{prec:.4f} recall {rec:.4f} F1 {f1:.4f} FPR {100 * fpr:.3f} % (LatencyPrism 0.985 at 0.59 %), "
          f"{s.refits} refits; {raw_fp - fp} alarms in the {s.cfg.window - 1} batches"
          + (f" and {a.settle_seconds:g} s" if a.settle_seconds else "") + " after a fault ends not counted")
    for kind, d in per.items():
        print(f"  {kind}: {d}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
