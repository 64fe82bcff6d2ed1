"""The analysis loop's Step read through a real store: one full read of the window per pass (Reader.steps, newest
200k rows) next to the incremental read kept in the job's memo (Reader.steps_after, irregularity._rows), side by
side on the same store as a simulated job's agent records arrive.

    .venv/bin/python bench/steps_read.py [--dp 64 --pp 8 --tp 8] [--iterations 80] [--every 5]

The job's records (agentview: ProcessInfo and Step, what real agents send) go through the real writer into SQLite
iteration by iteration (scoring.StoreFeed); every `--every` iterations each way loads the detectors' window
(irregularity._load, 60 s) and is timed; the steps each saw are counted. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "eval"))

import scoring  # noqa: E402

from steplens.agent.records import Step  # noqa: E402
from steplens.collector.analysis import irregularity  # noqa: E402
from steplens.collector.analysis.base import Window  # noqa: E402
from steplens.collector.store.queries import Reader  # noqa: E402
from steplens.sim import agentview  # noqa: E402
from steplens.sim.model import ModelConfig  # noqa: E402


class Kept:
    """The store's reads with the job's memo, as the engine hands them to a detector."""

    def __init__(self, reader: Reader) -> None:
        self._r, self.step_memo = reader, {}

    def __getattr__(self, name):
        return getattr(self._r, name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=64)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=80)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--store", choices=["sqlite", "chdb"], default="sqlite",
                    help="chdb: the Step rows in ClickHouse's engine (in this process), read by ClickHouseReader")
    a = ap.parse_args(argv)
    cfg = ModelConfig(dp=a.dp, pp=a.pp, tp=a.tp, micro_batches=8, iterations=a.iterations, gpus_per_node=8,
                      nodes_per_leaf=8, spines=8, seed=a.seed)
    icfg = irregularity.IrregularityConfig()
    win = int(icfg.window_seconds * 1e9)
    tmp = tempfile.mkdtemp(prefix="stepsread")
    path = os.path.join(tmp, "steps.db")
    if a.store == "chdb":
        from steplens.collector.store import clickhouse as chs
        url = chs.parse_store(f"chdb://{tmp}/chdb?database=steps")
        # retention 0: the simulated job ran on a fixed date long ago (a TTL would expire its rows)
        sf = scoring.StoreFeed(cfg, path, writer=chs.ClickHouseWriter(path, url, retention_seconds=0))
        reader = chs.ClickHouseReader(path, url)
    else:
        sf = scoring.StoreFeed(cfg, path)
        reader = Reader(path)
    kept = Kept(reader)
    full_s, inc_s, full_steps, inc_steps, rows_seen = [], [], [], [], []
    iters = 0
    cur = -1

    def analyse() -> None:
        sf.flush()
        sf.wait()
        until = reader.data_watermarks([scoring.JOB]).get(scoring.JOB, 0)
        w = Window(scoring.JOB, max(0, until - win), until + 1)
        t = time.perf_counter()
        js_full = irregularity._load(reader, w, icfg)
        full_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        js_inc = irregularity._load(kept, w, icfg)
        inc_s.append(time.perf_counter() - t)
        full_steps.append(len(js_full.numbers))
        inc_steps.append(len(js_inc.numbers))
        rows_seen.append(sum(len(v) for v in js_inc.rows.values()))
        print(f"iteration {iters}: full read {full_s[-1]:.2f} s, {full_steps[-1]} steps; incremental "
              f"{inc_s[-1]:.2f} s, {inc_steps[-1]} steps ({rows_seen[-1]} rows)", flush=True)

    t0 = time.perf_counter()
    try:
        for aid, rec in agentview.agent_records(cfg, [], scoring.JOB, scoring.MONO_BASE,
                                                kinds=frozenset({"process", "step"})):
            if type(rec) is Step and rec.step > cur:
                if iters and iters % a.every == 0 and iters >= 2 * a.every:
                    analyse()
                cur = rec.step
                iters += 1
            sf.add(aid, rec)
        analyse()
    finally:
        sf.close()
        for ext in ("", "-wal", "-shm"):
            if os.path.exists(path + ext):
                os.remove(path + ext)
    after_first = slice(1, None)   # the first incremental pass reads the whole window, as the full read does
    out = {"store": a.store, "gpus": cfg.gpus, "iterations": a.iterations, "passes": len(full_s),
           "full_read_median_s": round(statistics.median(full_s[after_first] or full_s), 3),
           "incremental_read_median_s": round(statistics.median(inc_s[after_first] or inc_s), 3),
           "speedup_x": round(statistics.median(full_s[after_first] or full_s)
                              / max(1e-9, statistics.median(inc_s[after_first] or inc_s)), 2),
           "full_read_steps_last_pass": full_steps[-1], "incremental_steps_last_pass": inc_steps[-1],
           "rows_last_pass": rows_seen[-1],
           "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
