"""Hang scenarios (issue 14): one rank of a simulated job stops at the start of an iteration for 60-180 s, either
stopped (SIGSTOP: its Flight Recorder does not answer, the procs source reports it stopped) or stuck in Python
(it answers, with nothing pending); every detector runs on the windows the analysis loop would see during the
hang (one per flightrec poll, 5 s of simulated time) and once after the job resumed.

The detectors read what real agents send (agentview.agent_records with kind `progress`: Step and ProcessInfo
records, the flightrec source's CommProgress, the procs source's state Events; MemReader answers the store's
reads in memory, as scale.py does). Ground truth (the hang's rank, start and length) is read by the scorer only.

Scored per scenario: detected (a `hang` finding during the hang), culprit top-1 (its first suspect is the hung
rank), the detection latency (simulated seconds from the stop to the first window whose finding names the
culprit first), the cause evidence (stopped / running, in no collective), and after the resume a finding that
says the job resumed. False findings: a `hang` finding on the windows before the stop.

    .venv/bin/python bench/eval/hangs.py [--scenarios 20] [--seed 6000] [--big 2]

--big N adds N scenarios at 8,192 GPUs. Ends with one JSON line: scenarios, detected_fraction,
culprit_top1_fraction, median/max_detect_latency_s, resumed_fraction, false_findings, max_window_s.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from steplens.collector.analysis import hang
from steplens.collector.analysis.base import Window
from steplens.sim.faults import parse_fault
from steplens.sim.model import ModelConfig

import scale
import scoring

SHAPES = [(8, 4, 2), (16, 2, 2), (8, 8, 1), (32, 2, 4), (16, 4, 8), (64, 4, 2)]


def scenario(rng: random.Random, shapes, iterations: int = 40) -> tuple[ModelConfig, str, str]:
    dp, pp, tp = rng.choice(shapes)
    cfg = ModelConfig(dp=dp, pp=pp, tp=tp, micro_batches=8, iterations=iterations, gpus_per_node=8,
                      nodes_per_leaf=rng.choice((2, 4)), spines=rng.choice((2, 4)), seed=rng.randrange(1 << 30))
    cfg.net_jitter_cv = round(random.Random(cfg.seed).uniform(0.01, 0.04), 4)
    start = rng.randrange(15, iterations - 5)
    spec = f"hang:{rng.randrange(cfg.gpus)}:{start}:{start + 1}:{rng.uniform(60, 180):.1f}"
    return cfg, spec, rng.choice(("stopped", "stuck"))


def evaluate(cfg: ModelConfig, spec: str, mode: str) -> dict:
    t0 = time.perf_counter()
    fault = parse_fault(spec, cfg.topology())
    reader = scale.MemReader(cfg, [fault], progress=True, hang_mode=mode)
    culprit, start, dur = fault.rank, fault.start, fault.value
    mine = {r["step"]: r["end_ns"] for r in reader.rows if r["rank"] == culprit}
    stop_ns = mine[start - 1]
    cfgd = hang.HangConfig()
    found_at, top1, cause, windows, slowest, false = None, False, "", 0, 0.0, 0
    # before the stop: every 5 s over the last 30 s of healthy steps (no hang finding expected)
    for k in range(6, 0, -1):
        w = Window(scoring.JOB, 0, stop_ns - k * 5 * 10**9)
        false += sum(1 for f in hang.detect(reader, w, cfgd))
    k = 1
    while k * 5 <= dur:
        until = stop_ns + k * 5 * 10**9 + 10**6
        w0 = time.perf_counter()
        out = hang.detect(reader, Window(scoring.JOB, 0, until), cfgd)
        slowest = max(slowest, time.perf_counter() - w0)
        windows += 1
        live = [f for f in out if f.evidence.get("ongoing")]
        if live and found_at is None:
            f = live[0]
            if f.suspects and f.suspects[0].kind == "rank" and f.suspects[0].id == str(culprit):
                found_at, top1 = k * 5.0, True
                cause = f.suspects[0].evidence.get("state", "")
            elif k * 5 >= 60:  # a wrong culprit still named a minute in: scored as found, not top-1
                found_at, cause = k * 5.0, "wrong: " + (f.suspects[0].id if f.suspects else "none")
        if found_at is not None and top1:
            break
        k += 1
    resume_ns = max(r["end_ns"] for r in reader.rows if r["step"] == start)
    after = hang.detect(reader, Window(scoring.JOB, 0, resume_ns + 20 * 10**9), cfgd)
    resumed = any(not f.evidence.get("ongoing") and f.evidence.get("resumed_ns") and f.suspects and
                  f.suspects[0].id == str(culprit) for f in after)
    return {"gpus": cfg.gpus, "shape": f"DP{cfg.dp}xPP{cfg.pp}xTP{cfg.tp}", "spec": spec, "mode": mode,
            "detected": found_at is not None, "top1": top1, "latency_s": found_at, "cause": cause,
            "resumed": resumed, "false_findings": false, "windows": windows, "max_window_s": round(slowest, 3),
            "wall_s": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenarios", type=int, default=20)
    p.add_argument("--seed", type=int, default=6000)
    p.add_argument("--big", type=int, default=0, help="scenarios at 8,192 GPUs added")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    plan = [scenario(rng, SHAPES) for _ in range(args.scenarios)]
    plan += [scenario(rng, scale.SHAPES_8K, iterations=30) for _ in range(args.big)]
    rows = []
    for i, (cfg, spec, mode) in enumerate(plan):
        r = evaluate(cfg, spec, mode)
        rows.append(r)
        print(f"{i:>3} {r['shape']:<16} {spec:<28} {mode:<8} found {'yes' if r['detected'] else 'no':<3} "
              f"top1 {'yes' if r['top1'] else 'no':<3} after {r['latency_s']} s  cause {r['cause']!r:<28} "
              f"resumed {'yes' if r['resumed'] else 'no':<3} FP {r['false_findings']}  window max "
              f"{r['max_window_s']:.3f} s  wall {r['wall_s']} s", flush=True)
    lat = [r["latency_s"] for r in rows if r["top1"]]
    n = len(rows)
    print(json.dumps({"scenarios": n, "gpus_max": max(r["gpus"] for r in rows),
                      "detected_fraction": round(sum(r["detected"] for r in rows) / n, 3),
                      "culprit_top1_fraction": round(sum(r["top1"] for r in rows) / n, 3),
                      "median_detect_latency_s": statistics.median(lat) if lat else None,
                      "max_detect_latency_s": max(lat) if lat else None,
                      "resumed_fraction": round(sum(r["resumed"] for r in rows) / n, 3),
                      "false_findings": sum(r["false_findings"] for r in rows),
                      "max_window_s": max(r["max_window_s"] for r in rows), "seed": args.seed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
