"""The inference bed: a real serving engine watched end to end, scored against its injected faults.

What runs (all on this host, loopback, nothing in the engine's code changed):
  collector   `steplens-collector serve` (SQLite in --state-dir, analysis every second, the sentinel detector)
  agent       `steplens-agent run`: procs, host (run-queue, PSI) and iters (the bootstrap's iteration rings)
  engine      bench/inference/record.py (vLLM's CPU build, one LLMEngine.step per batch, Poisson load, faults) started
              under the steplens bootstrap (PYTHONPATH = its site dir, STEPLENS_BOOTSTRAP=1): steplens_iters anchors
              LLMEngine.step and reads each batch's workload from Scheduler.schedule's output into a ring the agent
              reads. The recorder's own per-batch log (t0/t1 around engine.step(), the fault in force) is the
              ground truth; the sentinel never sees it.
With --deep (issue "Closing the loop", the inference side) the agent also runs pystacks (10 Hz in sentinel mode, up to
1 kHz in a deep window, under the agent's overhead governor) and the collector starts a synchronized deep dive for each
sentinel finding (analysis/deepdive.py: a 6 s window, an 8 s reference ending 1 s before the onset, a 20 s cool-down);
the faults' schedule starts a minute after the store holds the 1,500 decode batches of the sentinel's first fit
(record.py --faults-after), and each fault's finding is also scored on its dive: done or not, the causes ranked
(analysis/suspicion.py), whether the top one is the fault's (EXPECTED_CAUSE), and the dive's merged trace
(`steplens trace --finding`, written while the agent still answers) as Perfetto's trace processor reads it.
Scored at the end, from the collector's store and its findings:
  boundaries  the stored Iterations (cluster time) matched to the recorder's batches: median / p95 |start error| and
              |end error| as % of the batch time (the whole path: ring, agent clock, collector clock mapping);
  findings    each sentinel finding against the fault windows: a fault is found when a finding is open during it
              (from 1 s before its start), with the onset lag in decode batches and seconds (negative: the finding
              began before the fault), the cause its top suspect got (collector/analysis/causes.py); a finding
              outside every fault is false.
With --dive-cost N (the deep dive's cost to the serving engine, issue "Closing the loop"): pystacks on, no faults, no
dive started by a finding; once the engine has run `--warmup` seconds, N operator dives (the RPC of `steplens deep
start --job`, asked from the bed's own process; 6 s each, the collector's fetch and ranking after each) every 20 s.
Each decode batch's time over what its workload predicts (a least-squares fit of batch size and KV tokens on the
batches outside the dives and the 10 s after them): the median of that ratio inside each window (its first 0.5 s left
out: the switch) against the 6 s before it, then the median over rounds; the quiet noise is the same between the two
3 s halves before it (what the VM does on its own), and `after` the 8 s after the window (the agent serving the
fetch, the collector's ranking on this host).
Last line: one JSON object. Run as root (the agent reads other processes' /proc):

    .venv/bin/python bench/inference/bed.py --seconds 150 --fault noisy:70:90 --fault cpu:110:125
    .venv/bin/python bench/inference/bed.py --deep     # noisy, cpu, mem, slow 45 s apart once the sentinel judges
    .venv/bin/python bench/inference/bed.py --dive-cost 8
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
import threading
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
# the collector belongs on another host; here its analysis thread (nice 10 by default) shares the two cores with the
# engine and the faults' burners: a pass's 0.5 s of CPU took 5.5 s
nice = 0

[detectors.sentinel]
window_seconds = 60.0
resolve_after_seconds = 6.0
"""

AGENT_TOML = """[agent]
{budget}node_id = "bed"
collector = "{listen}"
state_dir = "{state}"
insecure = true
metrics_listen = ""

[sources.iters]
ring_dirs = ["{rings}"]
interval_seconds = 0.5
"""

DEEP_TOML = """
[deep_dive]
detectors = ["sentinel"]
duration_seconds = 6.0
reference_seconds = 8.0
# the sentinel's onset can trail a fault's start by a few batches (a pinned engine's batches take ~1 s each): a
# 1 s gap let the pinned seconds into the reference window and the lost CPUs no longer stood out against it
reference_gap_seconds = 5.0
cooldown_seconds = 20.0
max_per_hour = 120
max_deep_fraction = 0.5
"""
NO_DEEP_TOML = "\n[deep_dive]\nenabled = false\n"
DISABLED = ("gpu", "flightrec", "pystacks", "sched", "gpuprobes", "netflows", "tcpinfo", "kineto", "nccltopo")
# what each of record.py's faults is, in the causes' words: burners on the engine's cores (cpu, noisy) make it wait
# on the run queue; `slow` pins every engine thread to one core (its affinity narrowed); `mem` is a process sweeping
# 2 GiB over and over, a core's worth of CPU and the memory bandwidth beside it (this VM has no counter of the
# bandwidth, and 2 GiB of 24 GiB is no memory pressure): what can be seen of it is the core it takes
EXPECTED_CAUSE = {"cpu": "cpu-contention", "noisy": "cpu-contention", "slow": "cpu-affinity", "mem": "cpu-contention"}


def _go_when_judged(db: str, go: str, fit: int = 1500, judging_s: float = 60.0) -> None:
    """Create `go` (record.py --faults-after) once the store holds `fit` decode iterations (the sentinel's first
    fit) and `judging_s` more seconds have passed."""
    import sqlite3
    while True:
        time.sleep(2.0)
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
            try:
                n = con.execute("SELECT COUNT(*) FROM iterations WHERE phase = 'decode'").fetchone()[0]
            finally:
                con.close()
        except sqlite3.Error:
            continue   # not created yet
        if n >= fit:
            break
    time.sleep(judging_s)
    open(go, "w").close()


def _collector_priority() -> None:
    try:
        os.nice(-5)   # root only; otherwise it runs at the engine's priority
    except OSError:
        pass


def _agent_priority() -> None:
    os.nice(5)   # as its systemd unit runs it (systemd/steplens-agent.service: Nice=5)


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


def dive_of(rd, f, hit: list, kind: str, w: dict) -> dict:
    """The deep dive a fault's finding started (or, in the cool-down, the one of its job that covered it); in_fault:
    its window began while the fault was on (a dive a false alarm started before the fault saw none of it). Of a
    finding's several dives (escalations), the first that began inside the fault, else the newest that began
    before its end: one finding can span two faults (a memory hog's slow tail running into the next fault), and
    its newest dive is then the later fault's."""
    own = rd.deep_dives(finding_ids=[x.id for x in hit])   # newest first: what the finding shows as its deep_dive
    inside = [x for x in own if w["start_ns"] <= x["start_ns"] < w["end_ns"]]
    before = [x for x in own if x["start_ns"] < w["end_ns"]]
    dives = inside[-1:] or before[:1] or own or [rd.deep_dives_for([f]).get(f.id)]
    dd = next((x for x in dives if x), None)
    if dd is None:
        return {"status": "none"}
    causes = dd.get("causes") or []
    top = causes[0] if causes else {}
    return {"status": dd["status"], "command_id": dd["command_id"], "start_after_onset_s":
            round((dd["start_ns"] - f.onset_ns) / 1e9, 2), "nodes": dd["nodes"],
            "top": [(c["kind"], c["id"], c["cause"], c["score"]) for c in causes[:3]],
            "top1_right": top.get("cause") == EXPECTED_CAUSE[kind], "note": dd.get("note", ""),
            "in_fault": w["start_ns"] <= dd["start_ns"] < w["end_ns"], "trigger": dd["trigger"],
            "dives_of_finding": len(own)}


def write_traces(db: str, listen: str, state: str) -> dict:
    """finding id -> `steplens trace JOB --finding ID`'s counts for each finding whose dive is done, and what Perfetto's
    own trace processor finds in the file (tests/perfettotp: its tracks of a process, deep windows, stack slices)."""
    from steplens.collector.store.queries import Reader
    sys.path.insert(0, os.path.join(REPO, "tests"))   # perfettotp
    rd = Reader(db)
    out = {}
    for f in rd.findings():
        dd = rd.deep_dives(finding_ids=[f.id])
        if f.detector != "sentinel" or not dd or dd[0]["status"] != "done":
            continue
        path = os.path.join(state, f"trace-{f.id}.pftrace")
        res = subprocess.run([os.path.join(BIN, "steplens"), "--collector", listen, "--insecure", "trace", f.job_key,
                              "--finding", f.id, "-o", path, "--json"], capture_output=True, text=True, timeout=240)
        if res.returncode != 0:
            out[f.id] = {"error": res.stderr.strip()[-500:]}
            continue
        rec = {"counts": json.loads(res.stdout)["counts"], "path": path}
        from perfettotp import TraceProcessorWasm, unavailable
        why = unavailable()
        if why:
            rec["trace_processor"] = why
        else:
            with TraceProcessorWasm.load(path) as tp:
                rec["process_tracks"] = [t["name"] for t in tp.query(
                    "select name from track where name like 'process · pid %'")]
                rec["deep_windows"] = tp.query("select count(*) as n from slice s join track t on s.track_id = t.id"
                                               " where t.name = 'deep dives'")[0]["n"]
                rec["python_slices"] = tp.query("select count(*) as n from slice s join track t on s.track_id = t.id"
                                                " where t.name like 'python %'")[0]["n"]
        out[f.id] = rec
    return out


def job_keys(con) -> list[str]:
    """The jobs with stored Iterations, the most first (the engine's)."""
    return [k for (k,) in con.execute("SELECT job_key FROM iterations GROUP BY job_key ORDER BY COUNT(*) DESC")]


def _dive_rounds(listen: str, db: str, agent_pid: int, rounds: int, warmup_s: float, every_s: float, deep_s: float,
                 out: list, stop: threading.Event) -> None:
    """--dive-cost: once the store has held the engine's Iterations for warmup_s, an operator's dive of its job every
    every_s (each: command id, cluster start ns, duration ns, the agent's CPU in the window). The dives are asked
    for over gRPC from this process and the agent's CPU read from /proc: a CLI started beside the engine would
    cost it ~0.5 s of CPU in the segments compared."""
    import sqlite3

    import grpc

    sys.path.insert(0, os.path.join(REPO, "bench"))
    from benchutil import cpu_ticks, threads
    from steplens.v1 import control_pb2 as cpb
    from steplens.v1 import control_pb2_grpc as cgrpc
    job, since = "", 0.0
    while not stop.is_set() and not job:
        stop.wait(2.0)
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
            try:
                job = (job_keys(con) or [""])[0]
            finally:
                con.close()
        except sqlite3.Error:
            continue
        since = time.monotonic()
    stop.wait(max(0.0, warmup_s - (time.monotonic() - since)))
    with grpc.insecure_channel(listen) as channel:
        stub = cgrpc.ControlStub(channel)
        for _ in range(rounds):
            if stop.wait(every_s - deep_s):
                return
            try:
                reply = stub.SetDeepMode(cpb.DeepRequest(job_key=job, enable=True, duration_ns=int(deep_s * 1e9),
                                                         lead_ms=1000), timeout=30)
            except grpc.RpcError as exc:
                print(f"bed: deep start failed: {exc.details()}", file=sys.stderr)
                stop.wait(deep_s + 1.3)
                continue
            rec = {"command_id": reply.command_id, "start_ns": reply.start_ns, "duration_ns": int(deep_s * 1e9)}
            out.append(rec)
            stop.wait(max(0.0, (reply.start_ns - time.time_ns()) / 1e9) + 0.5)
            try:
                c0, th0, t0 = cpu_ticks(agent_pid), threads(agent_pid), time.monotonic()
                stop.wait(max(0.0, (reply.start_ns + int(deep_s * 1e9) - time.time_ns()) / 1e9))
                c1, th1, dt = cpu_ticks(agent_pid), threads(agent_pid), time.monotonic() - t0
            except OSError:   # the agent is gone: the run's end says why
                continue
            tick = os.sysconf("SC_CLK_TCK")
            rec["agent_cpu_cores"] = round((c1 - c0) / tick / dt, 4)
            rec["pystacks_cores"] = round((th1.get("sl-pystacks", 0) - th0.get("sl-pystacks", 0)) / tick / dt, 4)
            stop.wait(0.3)


def dive_cost(batches: list[dict], dives: list[dict], offset_ns: int) -> dict:
    """The engine's decode batches inside each dive against the 6 s before it (module docstring, --dive-cost)."""
    import numpy as np
    S = 10**9
    dec = [b for b in batches if b["mode"] == 2]
    t = np.array([b["t0_real_ns"] + offset_ns for b in dec], dtype=np.int64)
    dur = np.array([b["dur_ns"] for b in dec], dtype=float)
    x = np.array([[1.0, b["batch_size"], b["kv_tokens"]] for b in dec])
    dives = [d for d in dives if "start_ns" in d]
    busy = np.zeros(len(t), bool)
    for d in dives:
        busy |= (t >= d["start_ns"]) & (t < d["start_ns"] + d["duration_ns"] + 10 * S)
    coef, *_ = np.linalg.lstsq(x[~busy], dur[~busy], rcond=None)
    ratio = dur / np.maximum(x @ coef, 1.0)

    def med(a: int, b: int):
        m = (t >= a) & (t < b)
        return float(np.median(ratio[m])) if m.sum() >= 10 else None
    rounds, slow, noise, after = [], [], [], []
    for d in dives:
        a, b = d["start_ns"], d["start_ns"] + d["duration_ns"]
        q, q1, q2 = med(a - 6 * S, a), med(a - 6 * S, a - 3 * S), med(a - 3 * S, a)
        inside, post = med(a + S // 2, b), med(b, b + 8 * S)
        r = {"command_id": d["command_id"], "quiet": q, "deep": inside, "after": post,
             **{k: d[k] for k in ("agent_cpu_cores", "pystacks_cores") if k in d}}
        if q and inside:
            slow.append(inside / q - 1)
        if q1 and q2:
            noise.append(abs(q2 / q1 - 1))
        if q and post:
            after.append(post / q - 1)
        rounds.append({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()})

    def pct(xs):
        return round(100 * statistics.median(xs), 2) if xs else None
    cpu = [d["agent_cpu_cores"] for d in dives if d.get("agent_cpu_cores") is not None]
    return {"rounds": rounds, "dives": len(dives), "deep_slowdown_pct_median": pct(slow),
            "agent_cpu_cores_deep_median": round(statistics.median(cpu), 4) if cpu else None,
            "deep_slowdown_pct_mean": round(100 * statistics.fmean(slow), 2) if slow else None,
            "quiet_noise_abs_pct_median": pct(noise), "after_slowdown_pct_median": pct(after),
            "fit_batches": int((~busy).sum())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=0.0, help="the engine's run (default 150 s; with --deep at most "
                    "900 s: it ends 30 s after the last fault)")
    ap.add_argument("--fault", action="append", default=[], help="record.py's KIND:START_S:END_S")
    ap.add_argument("--rate", default="", help="record.py's --rate (default 1:12:40)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--state-dir", default="", help="keep everything here (default: a temporary directory)")
    ap.add_argument("--deep", action="store_true", help="pystacks on, and a deep dive for each sentinel finding")
    ap.add_argument("--dive-cost", type=int, default=0, metavar="N",
                    help="no faults: N operator dives, the engine's batches inside them against before them")
    ap.add_argument("--warmup", type=float, default=40.0, help="--dive-cost: seconds of the engine before the first")
    ap.add_argument("--budget-fraction", type=float, default=0.0,
                    help="the agent's deep_cpu_budget_fraction (default: its own)")
    a = ap.parse_args(argv)
    if a.dive_cost and (a.deep or a.fault):
        ap.error("--dive-cost runs no faults and no finding's dives: leave out --deep and --fault")
    every_s, deep_s = 20.0, 6.0
    # --deep: the faults' times count from when the sentinel can judge the engine (its first fit takes 1,500
    # decode batches, sentinel.py fit_iterations: ~80 s here on one day, ~175 s on a slower one, when the load
    # saturated the engine) plus a minute of judging, so that no fault lands in what it learns as normal; the
    # engine stops 30 s after the last fault
    faults = a.fault or (["noisy:0:15", "cpu:45:60", "mem:90:105", "slow:135:150"] if a.deep else
                         [] if a.dive_cost else ["noisy:70:90", "cpu:110:125"])
    a.seconds = a.seconds or (900.0 if a.deep else a.warmup + 30 + a.dive_cost * every_s if a.dive_cost else 150.0)
    a.rate = a.rate or "1:12:40"
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
        fh.write(COLLECTOR_TOML.format(db=db, listen=listen) + (DEEP_TOML if a.deep else NO_DEEP_TOML))
    with open(os.path.join(state, "agent.toml"), "w") as fh:
        fh.write(AGENT_TOML.format(listen=listen, state=os.path.join(state, "agent"), rings=rings, budget=(
            f"deep_cpu_budget_fraction = {a.budget_fraction}\n" if a.budget_fraction else "")))
    procs: list[subprocess.Popen] = []
    traces: dict = {}
    logs = {n: open(os.path.join(state, f"{n}.log"), "w") for n in ("collector", "agent", "engine")}
    steps = os.path.join(state, "engine-steps.jsonl")
    try:
        # the collector belongs on another host: here it shares the two cores with the engine and the faults'
        # burners, which starved its analysis passes (a finding opened 20 s after its onset); niced up instead
        procs.append(subprocess.Popen([os.path.join(BIN, "steplens-collector"), "serve", "--config",
                                       os.path.join(state, "collector.toml")], stdout=logs["collector"],
                                      stderr=subprocess.STDOUT, preexec_fn=_collector_priority))
        time.sleep(2)
        procs.append(subprocess.Popen([os.path.join(BIN, "steplens-agent"), "run", "--config",
                                       os.path.join(state, "agent.toml"),
                                       *[x for s in DISABLED if not ((a.deep or a.dive_cost) and s == "pystacks")
                                         for x in ("--disable", s)]],
                                      stdout=logs["agent"], stderr=subprocess.STDOUT, preexec_fn=_agent_priority))
        sys.path.insert(0, REPO)
        from steplens.agent.bootstrap import site_dir
        env = dict(os.environ, PYTHONPATH=site_dir(), STEPLENS_BOOTSTRAP="1", STEPLENS_RUNTIME_DIR=rings)
        t_engine = time.time_ns()
        go = os.path.join(state, "faults-go")
        gate = None
        if a.deep:
            gate = threading.Thread(target=_go_when_judged, args=(db, go), daemon=True)
            gate.start()
        dives: list[dict] = []
        stop = threading.Event()
        if a.dive_cost:
            threading.Thread(target=_dive_rounds, args=(listen, db, procs[-1].pid, a.dive_cost, a.warmup, every_s,
                                                        deep_s, dives, stop), daemon=True).start()
        eng = subprocess.run([VLLM_PY, os.path.join(REPO, "bench", "inference", "record.py"), "--seconds",
                              str(a.seconds), "--rate", a.rate, "--hidden", str(a.hidden), "--layers",
                              str(a.layers), "--out", steps, *[x for f in faults for x in ("--fault", f)],
                              *(["--faults-after", go] if a.deep else [])],
                             env=env, stdout=logs["engine"], stderr=subprocess.STDOUT)
        stop.set()
        if eng.returncode != 0:
            print(f"bed: the engine failed (rc {eng.returncode}), see {state}/engine.log", file=sys.stderr)
            return 1
        time.sleep(8)   # the agent's last reads, the collector's last analysis passes
        if a.deep:   # while the agent still answers: each dive's merged trace (its node-local detail)
            traces = write_traces(db, listen, state)
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
    keys = job_keys(con)
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
    # each fault's window from the recorder's rows (the fault in force at each batch's start): its first batch's
    # start to its last batch's end, in the order injected
    # (from the batch in flight when the fault began: it is labelled by its start, before the fault, and slowed)
    windows = []
    for i, b in enumerate(batches):
        if b["fault"] and (not windows or windows[-1]["kind"] != b["fault"] or windows[-1]["closed"]):
            windows.append({"kind": b["fault"], "start_ns": batches[max(0, i - 1)]["t0_real_ns"] + offset,
                            "closed": False})
        if windows and not windows[-1]["closed"]:
            if b["fault"] == windows[-1]["kind"]:
                windows[-1]["end_ns"] = b["t1_real_ns"] + offset
            else:
                windows[-1]["closed"] = True
    if len(windows) != len(faults):
        print(f"bed: {len(windows)} fault windows in the recorder's rows, {len(faults)} asked for", file=sys.stderr)
    per_fault = {spec.split(":")[0]: {"found": False, "injected": False} for spec in faults}
    matched = set()
    for w in windows:
        # a finding open during the fault: its onset may precede it (a stray alarm a few batches before the fault
        # merges into the fault's episode, or a false one's finding is still open when the fault begins)
        hit = [f for f in findings if f.onset_ns <= w["end_ns"] and f.last_ns >= w["start_ns"] - 10**9]
        d = {"found": bool(hit), "injected": True, "at_s": round((w["start_ns"] - t_first) / 1e9, 1)}
        if hit:
            f = max(hit, key=lambda f: min(f.last_ns, w["end_ns"]) - max(f.onset_ns, w["start_ns"]))   # most overlap
            matched.update(id(x) for x in hit)
            lag_s = (f.onset_ns - w["start_ns"]) / 1e9
            decode_between = sum(1 for b in batches if b["mode"] == 2 and w["start_ns"] <= b["t0_real_ns"] + offset
                                 < f.onset_ns)
            top = f.suspects[0] if f.suspects else None
            d.update(onset_lag_s=round(lag_s, 3), onset_lag_decode_batches=decode_between,
                     severity=f.severity, suspect=f"{top.kind}:{top.id}" if top else "", cause=top.cause if top else "",
                     cause_right=(top.cause if top else "") == EXPECTED_CAUSE[w["kind"]], summary=f.summary)
            if a.deep:
                d["deep"] = dive_of(rd, f, hit, w["kind"], w)
                tr = next((traces[x.id] for x in hit if x.id in traces), None)
                if tr is not None:
                    d["deep"]["trace"] = {k: v for k, v in tr.items() if k != "path"}
        per_fault[w["kind"]] = d
    false = [f for f in findings if id(f) not in matched]
    res = {"vllm": head.get("vllm"), "engine_batches": len(batches), "iterations_stored": len(iters),
           "iterations_matched": len(pairs), "job_key": job, "realtime_to_cluster_offset_ns": offset,
           "anchors": sorted({it["anchor"] for it in iters}),
           "start_error_median_pct": round(100 * q(start_err, 0.5), 4) if start_err else None,
           "start_error_p95_pct": round(100 * q(start_err, 0.95), 4) if start_err else None,
           "end_error_median_pct": round(100 * q(end_err, 0.5), 4) if end_err else None,
           "end_error_p95_pct": round(100 * q(end_err, 0.95), 4) if end_err else None,
           "faults_found": sum(d["found"] for d in per_fault.values()), "faults": len(faults),
           "cause_right": sum(bool(d.get("cause_right")) for d in per_fault.values()),
           "false_findings": len(false), "per_fault": per_fault,
           "false": [(round((f.onset_ns - t_first) / 1e9, 1), f.severity) for f in false],
           "state_dir": state, "engine_started_ns": t_engine}
    print(f"inference bed: {len(pairs)}/{len(batches)} batches matched to stored Iterations; boundaries median "
          f"{res['start_error_median_pct']} % (start) / {res['end_error_median_pct']} % (end) of the batch time; "
          f"faults found {res['faults_found']}/{len(faults)}, false findings {len(false)}")
    for k, d in per_fault.items():
        print(f"  {k}: {d}")
    if a.deep:
        res["deep_done"] = sum(d.get("deep", {}).get("status") == "done" for d in per_fault.values())
        res["deep_top1_right"] = sum(bool(d.get("deep", {}).get("top1_right")) for d in per_fault.values())
        inside = [d["deep"] for d in per_fault.values() if d.get("deep", {}).get("in_fault")]
        res["deep_in_fault"], res["deep_in_fault_top1_right"] = len(inside), sum(x["top1_right"] for x in inside)
        print(f"deep dives: {res['deep_done']}/{len(faults)} done, top-1 cause right {res['deep_top1_right']}/"
              f"{len(faults)} ({res['deep_in_fault_top1_right']}/{len(inside)} of the dives that began inside their "
              f"fault); the sentinel finding's own cause right {res['cause_right']}/{len(faults)}")
    if a.dive_cost:
        statuses = {d["command_id"]: d["status"] for d in rd.deep_dives(job_key=job, limit=500)}
        res["dive_cost"] = dive_cost(batches, dives, offset)
        for r in res["dive_cost"]["rounds"]:
            r["status"] = statuses.get(r["command_id"], "")
            print(f"  dive {r}")
        c = res["dive_cost"]
        print(f"deep dives' cost to the engine: {c['dives']} dives, decode batches {c['deep_slowdown_pct_median']} % "
              f"slower inside (median over rounds; mean {c['deep_slowdown_pct_mean']} %), quiet noise "
              f"{c['quiet_noise_abs_pct_median']} %, {c['after_slowdown_pct_median']} % in the 8 s after; the agent "
              f"{c['agent_cpu_cores_deep_median']} cores in a window (median)")
    if not a.state_dir:   # after the last read of its store (the dives' statuses above read it)
        shutil.rmtree(state, ignore_errors=True)
        res["state_dir"] = "(removed)"
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
