"""The inference bed: a real serving engine watched end to end, scored against its injected faults.

What runs (all on this host, loopback, nothing in the engine's code changed):
  collector   `steplens-collector serve` (SQLite in --state-dir, analysis every second, the sentinel detector)
  agent       `steplens-agent run`: procs, host (run-queue, PSI) and iters (the bootstrap's iteration rings)
  engine      bench/inference/record.py (vLLM's CPU build, one LLMEngine.step per batch, Poisson load, faults) started
              under the steplens bootstrap (PYTHONPATH = its site dir, STEPLENS_BOOTSTRAP=1): steplens_iters anchors
              LLMEngine.step and reads each batch's workload from Scheduler.schedule's output into a ring the agent
              reads. The recorder's own per-batch log (t0/t1 around engine.step(), the fault in force) is the
              ground truth; the sentinel never sees it.
Scored at the end, from the collector's store and its findings:
  boundaries  the stored Iterations (cluster time) matched to the recorder's batches: median / p95 |start error| and
              |end error| as % of the batch time (the whole path: ring, agent clock, collector clock mapping);
  findings    each sentinel finding against the fault windows: a fault is found when a finding's onset lies in
              [start - 1 s, end], with the onset lag in decode batches and seconds, the cause its top suspect got
              (collector/analysis/causes.py); a finding outside every fault is false.
Last line: one JSON object. Run as root (the agent reads other processes' /proc):

    .venv/bin/python bench/inference/bed.py --seconds 150 --fault noisy:70:90 --fault cpu:110:125
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(REPO, ".venv", "bin")
VLLM_PY = os.path.join(REPO, ".venv-vllm", "bin", "python")

COLLECTOR_TOML = """[collector]
db = "{db}"
listen = "{listen}"
insecure = true

[analysis]
interval_seconds = 1.0

[detectors.sentinel]
window_seconds = 60.0
resolve_after_seconds = 6.0
"""

AGENT_TOML = """[agent]
node_id = "bed"
collector = "{listen}"
state_dir = "{state}"
insecure = true
metrics_listen = ""

[sources.iters]
ring_dirs = ["{rings}"]
interval_seconds = 0.5
"""

DISABLED = ("gpu", "flightrec", "pystacks", "sched", "gpuprobes", "netflows", "tcpinfo", "kineto", "nccltopo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def match(iters: list[dict], batches: list[dict], offset_ns: int) -> list[tuple[dict, dict]]:
    """Stored Iterations paired with the recorder's batches by nearest end (recorder realtime + offset)."""
    ends = [b["t1_real_ns"] + offset_ns for b in batches]
    out = []
    for it in iters:
        i = bisect.bisect_left(ends, it["end_ns"])
        best = min((k for k in (i - 1, i) if 0 <= k < len(ends)), key=lambda k: abs(ends[k] - it["end_ns"]),
                   default=None)
        if best is not None and abs(ends[best] - it["end_ns"]) < batches[best]["dur_ns"] / 2:
            out.append((it, batches[best]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=150.0)
    ap.add_argument("--fault", action="append", default=[], help="record.py's KIND:START_S:END_S")
    ap.add_argument("--rate", default="1:12:40")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--state-dir", default="", help="keep everything here (default: a temporary directory)")
    a = ap.parse_args(argv)
    faults = a.fault or ["noisy:70:90", "cpu:110:125"]
    if not os.path.exists(VLLM_PY):
        print("bed: .venv-vllm is missing (make inference-env)", file=sys.stderr)
        return 2
    state = a.state_dir or tempfile.mkdtemp(prefix="steplens-ibed-")
    os.makedirs(state, exist_ok=True)
    rings = os.path.join(state, "rings")
    os.makedirs(rings, exist_ok=True)
    listen = f"127.0.0.1:{free_port()}"
    db = os.path.join(state, "collector.db")
    with open(os.path.join(state, "collector.toml"), "w") as fh:
        fh.write(COLLECTOR_TOML.format(db=db, listen=listen))
    with open(os.path.join(state, "agent.toml"), "w") as fh:
        fh.write(AGENT_TOML.format(listen=listen, state=os.path.join(state, "agent"), rings=rings))
    procs: list[subprocess.Popen] = []
    logs = {n: open(os.path.join(state, f"{n}.log"), "w") for n in ("collector", "agent", "engine")}
    steps = os.path.join(state, "engine-steps.jsonl")
    try:
        procs.append(subprocess.Popen([os.path.join(BIN, "steplens-collector"), "serve", "--config",
                                       os.path.join(state, "collector.toml")], stdout=logs["collector"],
                                      stderr=subprocess.STDOUT))
        time.sleep(2)
        procs.append(subprocess.Popen([os.path.join(BIN, "steplens-agent"), "run", "--config",
                                       os.path.join(state, "agent.toml"),
                                       *[x for s in DISABLED for x in ("--disable", s)]],
                                      stdout=logs["agent"], stderr=subprocess.STDOUT))
        sys.path.insert(0, REPO)
        from steplens.agent.bootstrap import site_dir
        env = dict(os.environ, PYTHONPATH=site_dir(), STEPLENS_BOOTSTRAP="1", STEPLENS_RUNTIME_DIR=rings)
        t_engine = time.time_ns()
        eng = subprocess.run([VLLM_PY, os.path.join(REPO, "bench", "inference", "record.py"), "--seconds",
                              str(a.seconds), "--rate", a.rate, "--hidden", str(a.hidden), "--layers",
                              str(a.layers), "--out", steps, *[x for f in faults for x in ("--fault", f)]],
                             env=env, stdout=logs["engine"], stderr=subprocess.STDOUT)
        if eng.returncode != 0:
            print(f"bed: the engine failed (rc {eng.returncode}), see {state}/engine.log", file=sys.stderr)
            return 1
        time.sleep(8)   # the agent's last reads, the collector's last analysis passes
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
        for fh in logs.values():
            fh.close()
    from steplens.collector.store.queries import Reader
    rd = Reader(db)
    with open(steps) as fh:
        head = json.loads(fh.readline())
        batches = [json.loads(line) for line in fh if line.strip()]
    import sqlite3
    con = sqlite3.connect(db)
    keys = [k for (k,) in con.execute("SELECT job_key FROM iterations GROUP BY job_key ORDER BY COUNT(*) DESC")]
    con.close()
    if not keys:
        print(f"bed: no Iteration reached the store (see {state}/agent.log)", file=sys.stderr)
        return 1
    job = keys[0]
    iters = rd.iterations(job)
    # cluster time = the agent's monotonic clock + the collector's offset for it, and the ring's realtime reached
    # the agent's monotonic clock through the agent's own conversion: one constant apart from the recorder's
    # realtime. It is estimated (median over the matches) and reported (`realtime_to_cluster_offset_ns`: ~0 when
    # the collector's cluster time is this host's realtime); the errors are the spread around it
    offs = sorted(it["end_ns"] - b["t1_real_ns"] for it, b in zip(iters[:50], batches[:50]))
    offset = 0
    for _ in range(2):
        pairs = match(iters, batches, offset)
        if pairs:
            offset += int(statistics.median(it["end_ns"] - (b["t1_real_ns"] + offset) for it, b in pairs))
        else:
            offset = offs[len(offs) // 2] if offs else 0
    pairs = match(iters, batches, offset)
    start_err = sorted(abs(it["start_ns"] - (b["t0_real_ns"] + offset)) / b["dur_ns"] for it, b in pairs)
    end_err = sorted(abs(it["end_ns"] - (b["t1_real_ns"] + offset)) / b["dur_ns"] for it, b in pairs)

    def q(xs, p):
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None
    findings = [f for f in rd.findings() if f.detector == "sentinel" and f.job_key == job]
    t_first = batches[0]["t0_real_ns"] + offset - int(batches[0]["t_s"] * 1e9)
    windows = []
    for spec in faults:
        kind, s0, s1 = spec.split(":")
        windows.append({"kind": kind, "start_ns": t_first + int(float(s0) * 1e9),
                        "end_ns": t_first + int(float(s1) * 1e9)})
    per_fault, matched = {}, set()
    for w in windows:
        hit = [f for f in findings if w["start_ns"] - 10**9 <= f.onset_ns <= w["end_ns"]]
        d = {"found": bool(hit)}
        if hit:
            f = min(hit, key=lambda f: f.onset_ns)
            matched.update(id(x) for x in hit)
            lag_s = (f.onset_ns - w["start_ns"]) / 1e9
            decode_between = sum(1 for b in batches if b["mode"] == 2 and w["start_ns"] <= b["t0_real_ns"] + offset
                                 < f.onset_ns)
            top = f.suspects[0] if f.suspects else None
            d.update(onset_lag_s=round(lag_s, 3), onset_lag_decode_batches=decode_between,
                     severity=f.severity, suspect=f"{top.kind}:{top.id}" if top else "", cause=top.cause if top else "",
                     summary=f.summary)
        per_fault[w["kind"]] = d
    false = [f for f in findings if id(f) not in matched]
    res = {"vllm": head.get("vllm"), "engine_batches": len(batches), "iterations_stored": len(iters),
           "iterations_matched": len(pairs), "job_key": job, "realtime_to_cluster_offset_ns": offset,
           "anchors": sorted({it["anchor"] for it in iters}),
           "start_error_median_pct": round(100 * q(start_err, 0.5), 4) if start_err else None,
           "start_error_p95_pct": round(100 * q(start_err, 0.95), 4) if start_err else None,
           "end_error_median_pct": round(100 * q(end_err, 0.5), 4) if end_err else None,
           "end_error_p95_pct": round(100 * q(end_err, 0.95), 4) if end_err else None,
           "faults_found": sum(d["found"] for d in per_fault.values()), "faults": len(windows),
           "false_findings": len(false), "per_fault": per_fault,
           "false": [(round((f.onset_ns - t_first) / 1e9, 1), f.severity) for f in false],
           "state_dir": state, "engine_started_ns": t_engine}
    if not a.state_dir:
        shutil.rmtree(state, ignore_errors=True)
        res["state_dir"] = "(removed)"
    print(f"inference bed: {len(pairs)}/{len(batches)} batches matched to stored Iterations; boundaries median "
          f"{res['start_error_median_pct']} % (start) / {res['end_error_median_pct']} % (end) of the batch time; "
          f"faults found {res['faults_found']}/{len(windows)}, false findings {len(false)}")
    for k, d in per_fault.items():
        print(f"  {k}: {d}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
