"""Healthy 512-GPU jobs of 1,000 iterations, every detector on the analysis loop's windows: expects no finding.

Issue 13's acceptance item: a healthy run must produce no finding over a long job, window after window.

Per run: a healthy job (no fault) of one 512-GPU shape (SHAPES_512: scoring.SHAPES' PP x TP layouts with DP
grown to 512 GPUs), nodes_per_leaf, spines and the simulator seed drawn as scoring.random_scenario draws them.
Its agent records (agentview.agent_records: ProcessInfo and Step, what real agents send) go through the real
writer into SQLite as they come (scoring.StoreFeed: agent encoding -> StoreWriter), so the store holds what a
live collector would hold at that point of the job, nothing later. Every `--every` iterations (default: the
loop's interval_seconds, 5 s, of data time: ~16 iterations at the simulated ~0.31 s step, ~12 at PP=8's
~0.41 s; the loop runs on the data that arrived since its last pass) the records so far are flushed to the
store and every registered detector runs as the loop runs it (engine.run_job): one AnalysisReader per pass,
each detector on its config's window_seconds (600 s: the whole job at these step times) ending at the job's
newest data (the store's data watermark), FetchDetail answered by the emulated agents (scoring.sim_fetcher).
Every finding of every window is counted and printed: detector, kind, window, severity, suspects, and the key
evidence the first time its identity (detector, kind, top suspect: findings.merge's) is seen.
What it does not do: the engine's merge (a finding seen in several windows is counted in each: `findings` is
the distinct identities, `finding_outputs` the per-window outputs) and the loop's CPU duty cycle (a slow pass
makes a live loop skip passes; here every pass runs). The store's read limit holds: Reader.steps returns the
newest 200,000 rows, so at 512 GPUs the detectors see the last ~390 iterations once the job is longer
(`steps_seen_max`).

    cd bench/eval && ../../.venv/bin/python healthy.py [--runs 4] [--iterations 1000] [--seed 5000]
                                                       [--every N] [--shapes 16,4,8 32,4,4 ...]

Per run: shape, seed, iterations, windows analysed, findings, max/median analysis seconds per window (the
detectors' own time; the emulated agents' fetch time apart), feed and wall seconds. Ends with one JSON line:
runs, gpus, iterations, windows, findings, finding_outputs, false_positive_windows, max_analysis_s,
median_analysis_s, max_fetch_s, ranks_fetched_max, steps_seen_max, wall_s.

Figures (2-core VM, 2026-11-24, at commit 9cd3385; the defaults: 4 runs x 512 GPUs x 1,000 iterations, seed
5000): 270 windows (64, 64, 64, 78), 0 findings; analysis per window median 5.5 s, max 11.9 s (391 iterations x
512 ranks read: the store's row limit); feed ~27 s a run; 1,721 s in all (~7 min a run), 1.6 GB peak RSS.
Before 9cd3385 one window found a straggler (irregularity/slowdown, rank 101 of DP32xPP4xTP4 at 1.00x the step
time, window ending at iteration 896: z 6.8 over the 13 steps after the change point the test picked).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import shutil
import statistics
import sys
import time
from dataclasses import replace

from steplens.agent.records import Step
from steplens.collector.analysis import all_specs
from steplens.collector.analysis.base import AnalysisSettings
from steplens.collector.analysis.engine import AnalysisReader
from steplens.collector.store.queries import Reader
from steplens.sim import agentview
from steplens.sim.model import ModelConfig

import scoring

SHAPES_512 = [(16, 4, 8), (32, 4, 4), (64, 4, 2), (32, 8, 2)]  # (dp, pp, tp): SHAPES' (4,8), (4,4), (4,2), (8,2)


def job(rng: random.Random, iterations: int, shape: tuple[int, int, int]) -> ModelConfig:
    """A healthy job of this shape, its network and seed drawn as scoring.random_scenario draws them."""
    cfg, _ = scoring.random_scenario(rng, iterations, healthy_share=1.0)
    dp, pp, tp = shape
    return replace(cfg, dp=dp, pp=pp, tp=tp)


def brief(v, items: int = 6):
    """An evidence value cut to what a line can show: the first items of every list and dict in it."""
    if isinstance(v, dict):
        out = {k: brief(x, items) for k, x in list(v.items())[:items]}
        if len(v) > items:
            out["..."] = f"{len(v) - items} more"
        return out
    if isinstance(v, (list, tuple)):
        return [brief(x, items) for x in v[:items]] + ([f"... {len(v) - items} more"] if len(v) > items else [])
    return v


class ReadSpan:
    """The store's Reader, noting the widest Step read of a pass (rows, first and last iteration): the
    iterations the detectors really saw, which the store's row limit may cut below the window's."""

    def __init__(self, reader) -> None:
        self._reader = reader
        self.widest = (0, -1, -1)

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def steps(self, *a, **kw) -> list[dict]:
        rows = self._reader.steps(*a, **kw)
        if len(rows) > self.widest[0]:  # oldest end first: the first and last rows bound the iterations
            self.widest = (len(rows), rows[0]["step"], rows[-1]["step"])
        return rows


def run(cfg: ModelConfig, every: int, tmp: str, interval_s: float) -> dict:
    """Feed the job into a new store as it runs, analysing it every `every` iterations (0: every interval_s of
    data time); returns the run's figures and findings."""
    t0 = time.perf_counter()
    path = os.path.join(tmp, f"healthy-{cfg.seed}.db")
    sf = scoring.StoreFeed(cfg, path)
    sf.topology(cfg)
    reader = Reader(path)
    off = cfg.base_ns - scoring.MONO_BASE
    windows = {name: int(spec.config_class().window_seconds * 1e9) for name, spec in all_specs().items()}
    sim_fetch = scoring.sim_fetcher(cfg, [])
    numbers: list[int] = []    # iterations fed so far, in order
    ends: list[int] = []       # per iteration: the newest step end (cluster ns), as fed
    starts: list[int] = []     # per iteration: the earliest step start (a finding's onset is one)
    analysis, fetch_s, fetched, seen, found = [], [], set(), [], []
    first_of: dict[tuple, int] = {}
    last_until = [0]
    feed_s = [0.0]

    def analyse() -> None:
        w0 = time.perf_counter()
        sf.flush()
        sf.wait()
        sf.check()
        feed_s[0] += time.perf_counter() - w0
        until = reader.data_watermarks([scoring.JOB]).get(scoring.JOB, 0)
        last_until[0] = until
        spent = [0.0]

        def fetch(*a, **kw):  # the emulated agents re-simulate the job: their time is not the analysis'
            t = time.perf_counter()
            try:
                return sim_fetch(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - t
        span = ReadSpan(reader)
        ar = AnalysisReader(span, fetch)
        got, sec = scoring.run_detectors(ar, until, own_window=True)
        analysis.append(sec - spent[0])
        fetch_s.append(spent[0])
        fetched.update(ar.ranks_fetched)
        _, lo, hi = span.widest
        seen.append(hi - lo + 1 if hi >= 0 else 0)
        k = len(analysis)
        for name, f in got:
            since = max(0, until - windows[name])
            ident = (name, f.kind, f.suspects[0].id if f.suspects else "")
            found.append({"window": k, "detector": name, "kind": f.kind, "severity": f.severity,
                          "window_steps": [numbers[min(bisect.bisect_left(ends, since), len(ends) - 1)],
                                           numbers[-1]],
                          "read_steps": [lo, hi] if hi >= 0 else None,
                          "onset_step": numbers[max(0, bisect.bisect_right(starts, f.onset_ns) - 1)],
                          "suspects": [f"{s.kind} {s.id} ({s.score:.2f} {s.cause})" for s in f.suspects[:3]],
                          "summary": f.summary, "evidence": f.evidence, "repeat_of": first_of.get(ident)})
            first_of.setdefault(ident, k)

    try:
        cur = -1
        for aid, rec in agentview.agent_records(cfg, [], scoring.JOB, scoring.MONO_BASE,
                                                kinds=frozenset({"process", "step"})):
            if type(rec) is Step and rec.step > cur:
                if ends and ((len(ends) % every == 0) if every else ends[-1] >= last_until[0] + interval_s * 1e9):
                    analyse()
                cur = rec.step
                numbers.append(cur)
                ends.append(0)
                starts.append(rec.start_mono_ns + off)
            if type(rec) is Step:  # the agents' records come iteration by iteration
                ends[-1] = max(ends[-1], rec.end_mono_ns + off)
                starts[-1] = min(starts[-1], rec.start_mono_ns + off)
            sf.add(aid, rec)
        if ends and last_until[0] < ends[-1]:
            analyse()
    finally:
        sf.close()
        for ext in ("", "-wal", "-shm"):
            if os.path.exists(path + ext):
                os.remove(path + ext)
    steps_ms = [(b - a) / 1e6 for a, b in zip(ends, ends[1:])]
    return {"gpus": cfg.gpus, "shape": f"DP{cfg.dp}xPP{cfg.pp}xTP{cfg.tp}", "seed": cfg.seed,
            "nodes_per_leaf": cfg.nodes_per_leaf, "spines": cfg.spines, "iterations": len(ends),
            "step_ms": round(statistics.median(steps_ms), 1) if steps_ms else 0.0,
            "windows": len(analysis), "findings": len(first_of), "finding_outputs": len(found),
            "false_positive_windows": len({f["window"] for f in found}), "found": found,
            "analysis_s": analysis, "max_analysis_s": round(max(analysis, default=0.0), 3),
            "median_analysis_s": round(statistics.median(analysis), 3) if analysis else 0.0,
            "max_fetch_s": round(max(fetch_s, default=0.0), 3), "ranks_fetched": len(fetched),
            "steps_seen_max": max(seen, default=0), "feed_s": round(feed_s[0], 1),
            "wall_s": round(time.perf_counter() - t0, 1)}


def show(f: dict) -> str:
    a, b = f["window_steps"]
    read = f" read {f['read_steps'][0]}-{f['read_steps'][1]}" if f["read_steps"] else ""
    line = (f"    window {f['window']:>3} (it {a}-{b}{read}) {f['detector']}/{f['kind']} severity {f['severity']} "
            f"onset it {f['onset_step']}  suspects: {'; '.join(f['suspects']) or '-'}")
    if f["repeat_of"] is not None:
        return line + f"  (as in window {f['repeat_of']})"
    ev = {k: brief(v) for k, v in f["evidence"].items()}
    return line + f"\n      {f['summary']}\n      evidence: {json.dumps(ev, default=str)[:2000]}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--iterations", type=int, default=1000)
    p.add_argument("--seed", type=int, default=5000)
    p.add_argument("--every", type=int, default=0, metavar="N",
                   help="analyse every N iterations (default 0: every analysis interval_seconds of data time)")
    p.add_argument("--shapes", nargs="+", metavar="DP,PP,TP",
                   help="job shapes, one per run in turn (default: the four 512-GPU shapes)")
    args = p.parse_args(argv)
    if args.runs < 1 or args.iterations < 2 or args.every < 0:
        p.error("need --runs >= 1, --iterations >= 2, --every >= 0")
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else SHAPES_512
    interval_s = AnalysisSettings().interval_seconds
    rng = random.Random(args.seed)
    tmp = scoring.tmpdir()
    rows = []
    t0 = time.perf_counter()
    print(f"healthy runs: detectors ({', '.join(sorted(all_specs()))}) on windows ending every "
          f"{f'{args.every} iterations' if args.every else f'{interval_s:g} s of data time (the loop interval)'}",
          flush=True)
    try:
        for i in range(args.runs):
            cfg = job(rng, args.iterations, shapes[i % len(shapes)])
            r = run(cfg, args.every, tmp, interval_s)
            rows.append(r)
            print(f"{i:>3} {r['shape']:<14} {r['gpus']} GPUs seed {r['seed']:<10} leaf {r['nodes_per_leaf']} "
                  f"spines {r['spines']}  iterations {r['iterations']} ({r['step_ms']} ms)  windows {r['windows']}  "
                  f"findings {r['findings']} ({r['finding_outputs']} in {r['false_positive_windows']} windows)  "
                  f"analysis max {r['max_analysis_s']:.2f} s median {r['median_analysis_s']:.2f} s  "
                  f"steps seen {r['steps_seen_max']}  fetched {r['ranks_fetched']} ranks  feed {r['feed_s']} s  "
                  f"wall {r['wall_s']} s", flush=True)
            for f in r["found"]:
                print(show(f), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    analysis = [a for r in rows for a in r["analysis_s"]]
    gpus = sorted({r["gpus"] for r in rows})
    print(json.dumps({"runs": len(rows), "gpus": gpus[0] if len(gpus) == 1 else gpus,
                      "iterations": args.iterations, "every": args.every or f"{interval_s:g}s",
                      "seed": args.seed, "shapes": [r["shape"] for r in rows],
                      "windows": sum(r["windows"] for r in rows), "findings": sum(r["findings"] for r in rows),
                      "finding_outputs": sum(r["finding_outputs"] for r in rows),
                      "false_positive_windows": sum(r["false_positive_windows"] for r in rows),
                      "max_analysis_s": max(r["max_analysis_s"] for r in rows),
                      "median_analysis_s": round(statistics.median(analysis), 3),
                      "max_fetch_s": max(r["max_fetch_s"] for r in rows),
                      "ranks_fetched_max": max(r["ranks_fetched"] for r in rows),
                      "steps_seen_max": max(r["steps_seen_max"] for r in rows),
                      "wall_s": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
