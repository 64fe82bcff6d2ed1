"""Random scenarios through the whole path: emulated agents stream -> collector -> store -> detectors ->
`steplens diagnose`, scored against the simulator's ground truth (issue 13: >= 20 scenarios this way).

Per scenario: a fresh `steplens-collector serve` on loopback (SQLite), the simulator's topology imported with
`steplens import topology`, the job streamed by light emulated agents (bench/sim/stream.py: one per node,
sending what real agents send over the real Ingest protocol) which then stay connected answering FetchDetail
from their node-local CommOps, and `steplens diagnose simjob --since 1h --json` run as an operator runs it
(so the collector's Diagnose RPC runs every registered detector on the store, fetching CommOps progressively
from the agents). Scenarios come from scoring.random_scenario (64-512 GPUs) at 128 GPUs or fewer to keep each
under a minute, with each fault lasting to the end of the job: `diagnose` is asked while the problem is on
(faults that ended before the question are the analysis loop's, which bench/eval/run.py scores window by
window). Scoring as scoring.py: detected when a finding's onset is at or after the fault start - 2
iterations; top-1/top-3 on the finding's suspects; healthy runs count false positives. The scorer maps
finding times to iterations through rank 0's stored steps (ground truth never reaches a detector).

    .venv/bin/python bench/eval/wholepath.py [--scenarios 20] [--seed 4000] [--iterations 60]

Ends with one JSON line: scenarios, faults, precision, recall, f1, top1_fraction, top3_fraction,
median_diagnose_s, ranks_fetched_max.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from steplens.collector.store.queries import Reader
from steplens.sim.faults import parse_fault
from steplens.sim.model import simulate
from steplens.sim.output import truth
from steplens.sim.stream import StreamConfig, stream

import scoring

BIN = os.path.dirname(sys.executable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(address: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(BIN, "steplens"), "--collector", address, "--insecure", *args],
                          capture_output=True, text=True, timeout=timeout)


def persistent(specs: list[str], iterations: int) -> list[str]:
    out = []
    for s in specs:
        p = s.split(":")
        p[3] = str(iterations)
        out.append(":".join(p))
    return out


def run_one(cfg, specs: list[str], work: str, linger_s: float = 25.0) -> dict:
    faults = [parse_fault(s, cfg.topology()) for s in specs]
    port = free_port()
    db = os.path.join(work, "collector.db")
    log = open(os.path.join(work, "collector.log"), "ab")
    col = subprocess.Popen([os.path.join(BIN, "steplens-collector"), "serve", "--db", db, "--listen",
                            f"127.0.0.1:{port}", "--insecure"], stdout=subprocess.PIPE, stderr=log)
    address = f"127.0.0.1:{port}"
    got: dict = {}
    try:
        line = col.stdout.readline().decode()
        if "listening" not in line:
            raise RuntimeError(f"collector did not start: {line!r}")
        topo_file = os.path.join(work, "topology.json")
        with open(topo_file, "w") as fh:
            json.dump(cfg.topology().topology_file(), fh)
        r = cli(address, "import", "topology", topo_file)
        if r.returncode != 0:
            raise RuntimeError(f"import topology failed: {r.stderr}")

        def on_phase(name: str, info: dict) -> None:
            if name != "lingering":
                return
            t0 = time.perf_counter()
            out = cli(address, "diagnose", scoring.JOB, "--since", "1h", "--json")
            got["diagnose_s"] = time.perf_counter() - t0
            got["rc"], got["stderr"] = out.returncode, out.stderr[-500:]
            got["findings"] = json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else []
        t0 = time.perf_counter()
        res = stream(cfg, faults, StreamConfig(collector=address, agent_kind="light", procs=1, linger_s=linger_s,
                                               drain_timeout_s=300), on_phase=on_phase)
        got["stream_s"] = time.perf_counter() - t0
        if res["errors"] or res["not_drained"]:
            raise RuntimeError(f"stream failed: {res['errors'][:2]} not drained {res['not_drained']}")
        ends = {x["step"]: x["end_ns"] for x in Reader(db).steps(scoring.JOB, ranks=[0])}
    finally:
        col.terminate()
        try:
            col.wait(15)
        except subprocess.TimeoutExpired:
            col.kill()
        log.close()
    if "findings" not in got:
        raise RuntimeError("diagnose did not run (the agents never reached the lingering phase)")
    if got["rc"] != 0:
        raise RuntimeError(f"steplens diagnose failed: {got['stderr']}")

    def step_of(ns: int) -> int:
        return 1 + max((s for s, e in ends.items() if e <= ns), default=-1)
    tr = truth(simulate(cfg, faults, keep_steps=False))["faults"]
    faults_out = []
    for t in tr:
        ids = scoring.target_ids(t)
        about = [f for f in got["findings"] if step_of(f["onset_ns"]) >= t["start"] - 2]
        tops = [[s["id"] for s in f["suspects"]] for f in about]
        faults_out.append({"kind": t["kind"], "target": t["target"], "value": t["value"], "start": t["start"],
                           "detected": bool(about), "top1": any(x[:1] and x[0] in ids for x in tops),
                           "top3": any(ids & set(x[:3]) for x in tops)})
    starts = [t["start"] for t in tr]
    true_f = sum(1 for f in got["findings"] if starts and step_of(f["onset_ns"]) >= min(starts) - 2)
    return {"gpus": cfg.gpus, "shape": f"DP{cfg.dp}xPP{cfg.pp}xTP{cfg.tp}", "specs": specs, "faults": faults_out,
            "findings": [{"detector": f["detector"], "kind": f["kind"], "top": [s["id"] for s in f["suspects"][:3]],
                          "ranks_fetched": f.get("evidence", {}).get("probe", {}).get("ranks_fetched", 0)}
                         for f in got["findings"]],
            "true_findings": true_f, "false_findings": len(got["findings"]) - true_f,
            "diagnose_s": round(got["diagnose_s"], 2), "stream_s": round(got["stream_s"], 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenarios", type=int, default=20)
    p.add_argument("--seed", type=int, default=4000)
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--max-gpus", type=int, default=128)
    p.add_argument("--linger", type=float, default=25.0, help="s the agents stay to answer FetchDetail")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    rows = []
    while len(rows) < args.scenarios:
        cfg, specs = scoring.random_scenario(rng, args.iterations)
        if cfg.gpus > args.max_gpus:
            continue
        specs = persistent(specs, args.iterations)
        work = tempfile.mkdtemp(prefix="steplens-wholepath-")
        try:
            r = run_one(cfg, specs, work, args.linger)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        rows.append(r)
        print(f"{len(rows) - 1:>3} {r['shape']:<14} {'; '.join(specs) or 'healthy':<60} "
              f"found {[f['detected'] for f in r['faults']]} top1 {[f['top1'] for f in r['faults']]} "
              f"FP {r['false_findings']} findings {[(f['kind'], f['top'][:2]) for f in r['findings']]} "
              f"diagnose {r['diagnose_s']} s stream {r['stream_s']} s", flush=True)
    print(json.dumps({**scoring.headline(rows),
                      "healthy_runs": sum(1 for r in rows if not r["faults"]),
                      "healthy_findings": sum(r["false_findings"] for r in rows if not r["faults"]),
                      "median_diagnose_s": statistics.median(r["diagnose_s"] for r in rows),
                      "ranks_fetched_max": max((f["ranks_fetched"] for r in rows for f in r["findings"]), default=0)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
