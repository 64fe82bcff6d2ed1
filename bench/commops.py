"""Cost of the comm-op logger on a real gloo job: step time with and without it (sentinel mode), during a
Kineto deep window, and the records/s the agent handled.

One run, interleaved: rounds of three job launches in rotating order (off, sentinel, deep / sentinel, deep,
off / ...), each a fresh 2-rank torch.distributed gloo data-parallel job (2 x Linear(1024) per rank, batch 64,
a manual flat-gradient all_reduce and 3 broadcasts per step, 1 ms pause) logging its own step times. One
collector and one agent run throughout, with only the logger's sources (flightrec, kineto) and procs (which
finds the workloads they need); the others (host, pystacks, eBPF, ...) have their own benchmarks:
  off       the job is launched plainly: the logger never touches it
  sentinel  launched with `steplens-agent env` variables (bootstrap: Flight Recorder worker server, polled
            by the agent every second; KINETO_USE_DAEMON=1: polls the agent's IPC endpoint; no trace window)
  deep      the same, under `steplens deep start` (Kineto hands a 4 s trace window per poll); its step time is
            the median of the steps inside the traced windows (found from the traced ops), and of all steps
The job's first 15 steps are warm-up and not counted. Jobs hold before exiting until released; a deep job is
released only after deep mode ended and its last window closed: on torch 2.13 (CPU) a process that exits
while a Kineto on-demand window is open crashes in libkineto's teardown (SIGSEGV/SIGABRT, measured), and
`job_exit_failures` counts any job that still exits non-zero. Medians per mode over all rounds; the last stdout line
is one JSON object.

Separate launches differ by a few percent from launch to launch (placement, caches), far more than the 0.1 %
goal, so the logger's run-time part is measured inside one sentinel job: the agent is paused (SIGSTOP) and
resumed (SIGCONT) in slots of --segment-seconds in ABBA order (running, paused, paused, running, then again);
a slot's figure is the mean time of the steps that lie wholly inside it (the mean, not the median: a poll that
slows one step in forty is the cost), and each quartet gives (running - paused) / paused with a linear drift
cancelled. The headline is the mean over quartets +- its standard error. The agent catches up on resume
(a poll due while it was stopped runs at once), so its work is done in the running slots only: the figure is
an upper bound of the always-on cost (up to 2x for work that is not skipped while paused). What only a launch
can switch (Flight Recorder recording in the job, the bootstrap) is in the launch comparison. Comm ops lost
are counted two ways: `ops_lost` from the stored CommOps themselves (per process and group, collective
sequence numbers 1..last that no stored op carries) and `ring_wraps` / `ops_lost_reported` from the agent's
flightrec_ring_wrapped Events in the collector. The collector runs at nice 19 (--collector-nice): in a deployment
it is on another host, and here its ingest and detectors (~60 ms/s of CPU while the agent streams this job's
steps, measured) would otherwise be counted as the logger's cost. The agent runs at --agent-nice (0; the systemd
unit has Nice=5). `--disable SOURCE` turns a source off too, to tell the sources' costs apart.

    .venv/bin/python bench/commops.py                         # 3 launch rounds of 250 steps, 600 s toggled
    .venv/bin/python bench/commops.py --rounds 0 --toggle-seconds 300    # the toggle alone
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchutil import Children

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(REPO, ".venv", "bin")
PY = sys.executable
WARMUP = 15
EXIT_FAILURES: list = []

JOB = r'''
import json, os, sys, time
import torch, torch.distributed as dist
# argv[1]: a number of steps, or "<seconds>s": run that long (rank 0 decides; the stop travels in the broadcast flag)
arg, release = sys.argv[1], sys.argv[2]
steps = int(arg) if not arg.endswith("s") else 1 << 40
torch.manual_seed(0)
dist.init_process_group("gloo")
rank = dist.get_rank()
until = time.time() + float(arg[:-1]) if arg.endswith("s") else None
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
x = torch.randn(64, 1024)
flag = torch.zeros(4)
out = []
for i in range(steps):
    t0 = time.time_ns()
    opt.zero_grad()
    model(x).square().mean().backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)
    if rank == 0 and until is not None and t0 > until * 1e9:
        flag[0] = 1.0
    for _ in range(3):
        dist.broadcast(flag, 0)
    off = 0
    for p in model.parameters():
        n = p.numel(); p.grad.copy_(flat[off:off + n].view_as(p)); off += n
    opt.step()
    time.sleep(0.001)
    out.append((t0, time.time_ns()))
    if flag[0] > 0:
        break
if rank == 0:
    print(json.dumps(out), flush=True)
# hold until released: a process that exits while a Kineto on-demand window is open crashes in libkineto's
# teardown (torch 2.13, measured), so the bench ends deep mode and lets the window close first
while not os.path.exists(release):
    time.sleep(0.05)
dist.barrier()
'''


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(collector: str, *args: str) -> dict | list:
    out = subprocess.run([os.path.join(VENV, "steplens"), "--collector", collector, "--insecure", *args, "--json"],
                         capture_output=True, text=True, timeout=60)
    if out.returncode not in (0, 1):
        raise RuntimeError(f"steplens {' '.join(args)}: {out.stderr}")
    return json.loads(out.stdout) if out.stdout.strip() else {}


def _commop_rows(state_dir: str) -> int:
    path = os.path.join(state_dir, "detail.db")
    if not os.path.exists(path):
        return 0
    db = sqlite3.connect(path, timeout=10)
    try:   # CommOps kept (a row per process and flush holds n of them; an older agent's: one a row) + dropped
        n = 0
        for table, count in (("record_batches", "SUM(n)"), ("records", "COUNT(*)")):
            try:
                n += db.execute(f"SELECT COALESCE({count}, 0) FROM {table} WHERE kind = 'commop'").fetchone()[0]
            except sqlite3.OperationalError:   # a store without that table
                pass
        return n + (db.execute("SELECT value FROM counters WHERE key = 'records_dropped'").fetchone() or (0,))[0]
    finally:
        db.close()


def _stored_commops(state_dir: str, since_mono: int = 0, pids=None) -> list[bytes]:
    """The detail store's CommOp records (serialized Records), read as the agent's fetch reads them: a second
    connection to the agent's file (WAL: it reads what is committed)."""
    sys.path.insert(0, REPO)
    from steplens.agent.detail import DetailStore
    store = DetailStore(os.path.join(state_dir, "detail.db"))
    try:
        return store.records(["commop"], since_mono_ns=since_mono, pids=pids, limit=1 << 40)
    finally:
        store.close()   # nothing of this reader's is pending: closing writes nothing


def _traced_spans(state_dir: str, since_mono: int) -> list[tuple[int, int]]:
    """Realtime spans of the Kineto windows since since_mono (runs of traced ops with no gap > 0.5 s)."""
    sys.path.insert(0, REPO)
    from steplens.agent.transport.codec import decode_records, records_payload
    blobs = _stored_commops(state_dir, since_mono)
    offset = time.time_ns() - time.monotonic_ns()
    times = sorted((r.start_mono_ns + offset, r.end_mono_ns + offset)
                   for src, r in decode_records(records_payload(blobs)) if src == "kineto" and r.start_mono_ns)
    spans: list[list[int]] = []
    for a, b in times:
        if spans and a - spans[-1][1] < 500_000_000:
            spans[-1][1] = max(spans[-1][1], b)
        else:
            spans.append([a, b])
    return [(a, b) for a, b in spans]


def run_job(mode: str, steps: int | str, script: str, env_extra: dict, tmp: str, kids: Children,
            before_exit=None, during=None, pids: list | None = None) -> list[tuple[int, int]]:
    port = _free_port()
    release = os.path.join(tmp, f"release-{port}")
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", STEPLENS_JOB=f"bench-commops-{mode}")
        if mode != "off":
            env.update(env_extra)
        procs.append(kids.start([PY, script, str(steps), release], env=env, stdout=subprocess.PIPE,
                                stderr=open(os.path.join(tmp, f"{mode}-rank{rank}.err"), "ab"), text=True))
    if pids is not None:
        pids += [p.pid for p in procs]
    if during is not None:
        stop = threading.Event()
        th = threading.Thread(target=during, args=(stop, procs), daemon=True)
        th.start()
    line = procs[0].stdout.readline()
    if during is not None:
        stop.set()
        th.join()
    if before_exit is not None:
        before_exit()
    open(release, "w").close()
    out = line + procs[0].communicate(timeout=600)[0]
    for p in procs[1:]:
        p.wait(timeout=120)
    lines = out.strip().splitlines()
    if not lines or not lines[-1].startswith("["):
        with open(os.path.join(tmp, f"{mode}-rank0.err")) as fh:
            raise RuntimeError(f"{mode} job failed (exit {procs[0].returncode}): {fh.read()[-2000:]}")
    bad = [p.returncode for p in procs if p.returncode != 0]
    if bad:  # the steps were done and logged; the exit itself failed
        EXIT_FAILURES.append((mode, bad))
        print(f"  {mode} job: exit status {bad} after its steps", flush=True)
    return [tuple(x) for x in json.loads(lines[-1])][WARMUP:]


def _cpu_ms(pid: int, prefix: str = "") -> float:
    """CPU ms (user + system) of the threads of `pid` whose name starts with `prefix`; 0 once it is gone."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                st = fh.read()
        except OSError:
            continue
        if st[st.find("(") + 1:st.rfind(")")].startswith(prefix):
            f = st[st.rfind(")") + 2:].split()
            total += int(f[11]) + int(f[12])
    return total * 1000.0 / os.sysconf("SC_CLK_TCK")


def _ops_lost(state_dir: str, pids: list[int]) -> tuple[int, int]:
    """(stored flightrec CommOps of these pids, collective sequence numbers missing among them): per process and
    group, the numbers 1..highest that no stored op carries."""
    from steplens.agent.transport.codec import decode_records, records_payload
    blobs = _stored_commops(state_dir, pids=set(pids))
    seqs: dict[tuple, set] = {}
    stored = 0
    for src, r in decode_records(records_payload(blobs)):
        if src == "flightrec" and r.seq >= 0:
            stored += 1
            seqs.setdefault((r.pid, r.comm_id), set()).add(r.seq)
    return stored, sum(max(s) - len(s) + (1 if min(s) == 0 else 0) for s in seqs.values())


def _wrap_events(cdb: str) -> tuple[int, int]:
    """(flightrec_ring_wrapped Events, entries they say were lost) in the collector's database."""
    db = sqlite3.connect(cdb, timeout=10)
    try:
        n, lost = db.execute("SELECT COUNT(*), COALESCE(SUM(value), 0) FROM events "
                             "WHERE kind = 'flightrec_ring_wrapped'").fetchone()
    finally:
        db.close()
    return int(n), int(lost)


def _deep_switches(cdb: str) -> int:
    """Deep-mode switches the agent reported (ModeChange to deep) in the collector's database."""
    db = sqlite3.connect(cdb, timeout=10)
    try:
        return db.execute("SELECT COUNT(*) FROM events WHERE kind = 'mode' AND entity = 'deep'").fetchone()[0]
    finally:
        db.close()


def _ring_reads(cdb: str, name: str = "flightrec_ring_reads_total") -> dict[str, int]:
    """The agent's Flight Recorder ring reads so far by reason (Metric flightrec_ring_reads_total), or by way
    (flightrec_ring_reads_by_way_total: "memory", read from the job's memory, or "socket", the job's JSON)."""
    db = sqlite3.connect(cdb, timeout=10)
    try:
        rows = db.execute("SELECT entity, last_value FROM series WHERE name = ?", (name,)).fetchall()
    finally:
        db.close()
    return {e.split(":", 1)[-1]: int(v or 0) for e, v in rows}


ABBA = ("running", "paused", "paused", "running")


def toggle_figures(times: list[tuple[int, int]], slots: list[tuple[str, int, int]], min_steps: int = 5) -> dict:
    """Per slot the mean (and median) time of the steps wholly inside it; per ABBA quartet (running - paused) /
    paused in %; mean +- standard error over the quartets that have min_steps in each slot."""
    means, medians = [], []
    for _, a, b in slots:
        ms = [(e - s_) / 1e6 for s_, e in times if a <= s_ and e <= b]
        means.append(statistics.fmean(ms) if len(ms) >= min_steps else None)
        medians.append(statistics.median(ms) if len(ms) >= min_steps else None)
    out = {}
    for name, per in (("mean", means), ("median", medians)):
        diffs = []
        for q in range(0, len(slots) - 3, 4):
            v = per[q:q + 4]
            if None in v or tuple(st for st, _, _ in slots[q:q + 4]) != ABBA:
                continue
            run, paused = (v[0] + v[3]) / 2, (v[1] + v[2]) / 2
            diffs.append(100.0 * (run - paused) / paused)
        se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
        out[name] = (statistics.fmean(diffs) if diffs else float("nan"), se, len(diffs))
    run_steps = [v for v, (st, _, _) in zip(means, slots) if v is not None and st == "running"]
    paused_steps = [v for v, (st, _, _) in zip(means, slots) if v is not None and st == "paused"]
    out["step_ms"] = (statistics.fmean(run_steps) if run_steps else float("nan"),
                      statistics.fmean(paused_steps) if paused_steps else float("nan"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="launch rounds (off, sentinel, deep); 0: the toggle only")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--toggle-seconds", type=float, default=600.0, help="length of the toggled sentinel job (0: none)")
    ap.add_argument("--segment-seconds", type=float, default=2.0, help="toggle slot length")
    ap.add_argument("--collector-nice", type=int, default=19,
                    help="nice value of the collector (it runs on another host in a deployment; here its ingest and "
                         "detectors, ~60 ms/s of CPU while the agent streams, would compete with the job)")
    ap.add_argument("--collector-deep-dives", action="store_true",
                    help="let the collector start deep dives on its findings (off: this bench measures sentinel mode; "
                         "a pausing agent makes the job's steps vary, and a dive's Kineto windows would be counted "
                         "as the sentinel's cost)")
    ap.add_argument("--collector-stopped", action="store_true",
                    help="SIGSTOP the collector for the toggled job (the agent spools what it cannot send and delivers "
                         "it after): the agent's cost alone, as on a host whose collector runs elsewhere")
    ap.add_argument("--agent-nice", type=int, default=0, help="nice value of the agent (the systemd unit has Nice=5)")
    ap.add_argument("--flightrec", action="append", default=[], metavar="KEY=VALUE",
                    help="a [sources.flightrec] setting for the agent, TOML syntax (repeatable)")
    ap.add_argument("--disable", action="append", default=[], metavar="SOURCE",
                    help="an agent source to turn off too (flightrec, kineto, procs: to tell their costs apart)")
    ap.add_argument("--fr-buffer-size", type=int, default=0, help="TORCH_FR_BUFFER_SIZE of the jobs (0: the "
                                                                    "bootstrap's default)")
    args = ap.parse_args()
    sys.path.insert(0, REPO)
    from steplens.agent.bootstrap import site_dir

    tmp = tempfile.mkdtemp(prefix="slcb", dir="/tmp")  # short: AF_UNIX socket paths
    kids = Children()
    result: dict = {}
    try:
        script = os.path.join(tmp, "job.py")
        with open(script, "w") as fh:
            fh.write(JOB)
        runtime, ksock, state = os.path.join(tmp, "fr"), os.path.join(tmp, "k"), os.path.join(tmp, "agent")
        for d in (runtime, ksock, state):
            os.makedirs(d)
        port = _free_port()
        collector = f"127.0.0.1:{port}"
        cdb = os.path.join(tmp, "c.db")
        ctoml = os.path.join(tmp, "collector.toml")
        with open(ctoml, "w") as fh:
            fh.write(f"[deep_dive]\nenabled = {'true' if args.collector_deep_dives else 'false'}\n")
        coll = kids.start(["nice", "-n", str(args.collector_nice), os.path.join(VENV, "steplens-collector"), "serve",
                           "--db", cdb, "--listen", collector, "--insecure", "--config", ctoml],
                          stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "c.log"), "ab"))
        toml = os.path.join(tmp, "agent.toml")
        fr_extra = "".join(f"{kv}\n" for kv in args.flightrec + (["enabled = false"] if "flightrec" in args.disable
                                                                  else []))
        k_extra = "enabled = false\n" if "kineto" in args.disable else ""
        off = "".join(f"[sources.{name}]\nenabled = false\n" for name in
                      ("netflows", "sched", "gpuprobes", "pystacks", "host", "gpu", "nccltopo", "tcpinfo", "iters",
                       *[d for d in args.disable if d not in ("flightrec", "kineto")]))
        with open(toml, "w") as fh:
            fh.write(f"""[sources.flightrec]
socket_dirs = ["{runtime}"]
{fr_extra}[sources.kineto]
socket_dir = "{ksock}"
deep_window_ms = 4000
{k_extra}{off}""")
        agent = kids.start(["nice", "-n", str(args.agent_nice), os.path.join(VENV, "steplens-agent"), "run",
                            "--config", toml, "--collector", collector, "--insecure", "--node-id", "bench",
                            "--state-dir", state, "--metrics-listen", ""],
                           stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "agent.log"), "ab"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            nodes = _cli(collector, "nodes")
            if any(n.get("node_id") == "bench" and n.get("connected") for n in nodes or []):
                break
            time.sleep(0.5)
        else:
            raise RuntimeError("the agent did not connect")
        env_extra = dict(PYTHONPATH=site_dir(), STEPLENS_BOOTSTRAP="1", STEPLENS_RUNTIME_DIR=runtime,
                         KINETO_USE_DAEMON="1", KINETO_IPC_SOCKET_DIR=ksock)
        if args.fr_buffer_size:
            env_extra["TORCH_FR_BUFFER_SIZE"] = str(args.fr_buffer_size)
        result.update(_launches(args, collector, script, env_extra, tmp, kids, state))
        if args.toggle_seconds > 0:
            result.update(_toggle(args, agent, script, env_extra, tmp, kids, state, cdb, coll))
    finally:
        kids.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    result.update(rounds=args.rounds, steps_per_run=args.steps, agent_nice=args.agent_nice, disabled=args.disable,
                  collector_nice=args.collector_nice, collector_deep_dives=args.collector_deep_dives,
                  flightrec_settings=args.flightrec, fr_buffer_size=args.fr_buffer_size or None,
                  job_exit_failures=len(EXIT_FAILURES), goal_sentinel_toggle_slowdown_percent=0.1)
    print(json.dumps(result))
    return 0


def _launches(args, collector: str, script: str, env_extra: dict, tmp: str, kids: Children, state: str) -> dict:
    """Separate launches, off / sentinel / deep in rotating order (module docstring)."""
    if args.rounds <= 0:
        return {}
    modes = ["off", "sentinel", "deep"]
    steps: dict[str, list[float]] = {m: [] for m in modes}
    in_window: list[float] = []
    per_round: dict[str, list[float]] = {m: [] for m in modes}
    logged_s = 0.0
    ops0 = _commop_rows(state)
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for mode in order:
            mono0 = time.monotonic_ns()
            if mode == "deep":
                _cli(collector, "deep", "start", "--duration", "600s", "--lead-ms", "200")
            t0_real = time.time_ns()

            def end_deep():
                _cli(collector, "deep", "stop")
                time.sleep(4.0 + 2.5)  # the open window (4 s, starting ~2 s after its hand-out) closes

            times = run_job(mode, args.steps + WARMUP, script, env_extra, tmp, kids,
                            end_deep if mode == "deep" else None)
            if mode != "off":  # from the launch to the last step's end (not the hold before exit)
                logged_s += (times[-1][1] - t0_real) / 1e9
            if mode == "deep":
                time.sleep(1.5)  # the last trace is parsed at the next kineto step
                spans = _traced_spans(state, mono0)
                inside = [(b - a) / 1e6 for a, b in times if any(s <= a and b <= e for s, e in spans)]
                in_window += inside
                extra = f", {len(inside)} steps inside {len(spans)} traced window(s)"
            else:
                extra = ""
            ms = [(b - a) / 1e6 for a, b in times]
            steps[mode] += ms
            per_round[mode].append(statistics.median(ms))
            print(f"round {r + 1} {mode:<9} median step {statistics.median(ms):7.2f} ms over {len(ms)} steps{extra}",
                  flush=True)
    time.sleep(2.0)  # the last poll of the last job is stored
    handled = _commop_rows(state) - ops0
    med = {m: statistics.median(v) for m, v in steps.items()}
    win = statistics.median(in_window) if in_window else float("nan")

    def pct(x: float) -> float:
        return round(100.0 * (x - med["off"]) / med["off"], 2)

    off = steps["off"]  # spread: odd vs even steps of "off" (noise floor)
    noise = abs(statistics.median(off[::2]) - statistics.median(off[1::2])) / med["off"] * 100
    # paired by round (each round ran every mode once, back to back): mean and spread of the differences
    diffs = [100.0 * (s_ - o) / o for s_, o in zip(per_round["sentinel"], per_round["off"])]
    paired = statistics.mean(diffs)
    paired_sd = statistics.stdev(diffs) if len(diffs) > 1 else float("nan")
    out = {"sentinel_paired_percent": round(paired, 2), "sentinel_paired_sd_percent": round(paired_sd, 2),
           "step_ms_off": round(med["off"], 3), "step_ms_sentinel": round(med["sentinel"], 3),
           "step_ms_deep_all": round(med["deep"], 3), "step_ms_deep_in_window": round(win, 3),
           "sentinel_slowdown_percent": pct(med["sentinel"]), "deep_slowdown_percent": pct(med["deep"]),
           "deep_window_slowdown_percent": pct(win) if in_window else None,
           "noise_percent": round(noise, 2), "steps_in_window": len(in_window),
           "records_handled": handled, "records_per_s": round(handled / logged_s, 1) if logged_s else 0.0}
    print(f"step time off            {med['off']:8.2f} ms (median, {len(off)} steps)")
    print(f"step time sentinel       {med['sentinel']:8.2f} ms  {out['sentinel_slowdown_percent']:+.2f} % "
          "(separate launches)")
    print(f"step time deep (all)     {med['deep']:8.2f} ms  {out['deep_slowdown_percent']:+.2f} %")
    print(f"step time in a window    {win:8.2f} ms  {out['deep_window_slowdown_percent']} % ({len(in_window)} steps)")
    print(f"sentinel vs off, paired  {paired:+8.2f} % per round (sd {paired_sd:.2f} % over {len(diffs)} rounds: "
          f"launch-to-launch spread)")
    print(f"noise floor              {noise:8.2f} % (odd vs even steps of 'off')")
    print(f"records handled          {handled:,} CommOps, {out['records_per_s']:,.0f} /s from launch to last step "
          "of the logged jobs", flush=True)
    return out


def _toggle(args, agent, script: str, env_extra: dict, tmp: str, kids: Children, state: str, cdb: str,
            coll) -> dict:
    """The logger's run-time cost inside one sentinel job: the agent (Flight Recorder polls, Kineto IPC answers)
    paused and running in ABBA slots (module docstring). Also the agent's CPU per running second, the job's
    worker-server threads' CPU, and the comm ops lost."""
    import signal
    slots: list[tuple[str, int, int]] = []
    cpu = {"agent": 0.0, "running_s": 0.0, "server": 0.0, "wall_s": 0.0, "collector": 0.0}
    wraps0, deep0, reads0 = _wrap_events(cdb), _deep_switches(cdb), _ring_reads(cdb)
    ways0 = _ring_reads(cdb, "flightrec_ring_reads_by_way_total")

    def toggle(stop: threading.Event, procs) -> None:
        k = 0
        a0, s0, t_start = _cpu_ms(agent.pid), sum(_cpu_ms(p.pid, "pt_workerserver") for p in procs), time.time()
        c0 = _cpu_ms(coll.pid)
        if args.collector_stopped:
            os.kill(coll.pid, signal.SIGSTOP)
        try:
            while not stop.is_set():
                st = ABBA[k % 4]
                os.kill(agent.pid, signal.SIGSTOP if st == "paused" else signal.SIGCONT)
                t0 = time.time_ns()
                stop.wait(args.segment_seconds)
                slots.append((st, t0, time.time_ns()))
                if st == "running":
                    cpu["running_s"] += (slots[-1][2] - t0) / 1e9
                k += 1
        finally:
            os.kill(agent.pid, signal.SIGCONT)
            if args.collector_stopped:
                os.kill(coll.pid, signal.SIGCONT)
            cpu["agent"] = _cpu_ms(agent.pid) - a0
            cpu["collector"] = _cpu_ms(coll.pid) - c0
            cpu["server"] = sum(_cpu_ms(p.pid, "pt_workerserver") for p in procs) - s0
            cpu["wall_s"] = time.time() - t_start

    pids: list[int] = []
    times = run_job("sentinel", f"{args.toggle_seconds:.0f}s", script, env_extra, tmp, kids, during=toggle,
                    pids=pids)
    # the exit dumps are read at the agent's next step, its Events reach the collector (a stopped collector first
    # takes what the agent spooled meanwhile)
    time.sleep(30.0 if args.collector_stopped else 8.0)
    stored, lost = _ops_lost(state, pids)
    wraps = [a - b for a, b in zip(_wrap_events(cdb), wraps0)]
    deep = _deep_switches(cdb) - deep0
    reads = {k: v - reads0.get(k, 0) for k, v in _ring_reads(cdb).items() if v - reads0.get(k, 0)}
    ways = {k: v - ways0.get(k, 0) for k, v in _ring_reads(cdb, "flightrec_ring_reads_by_way_total").items()
            if v - ways0.get(k, 0)}
    fig = toggle_figures(times, slots)
    (mean, se, n), (med, med_se, _) = fig["mean"], fig["median"]
    out = {"sentinel_toggle_slowdown_percent": round(mean, 3), "sentinel_toggle_se_percent": round(se, 3),
           "sentinel_toggle_quartets": n, "sentinel_toggle_median_based_percent": round(med, 3),
           "sentinel_toggle_median_based_se_percent": round(med_se, 3),
           "toggle_step_ms_running": round(fig["step_ms"][0], 3), "toggle_step_ms_paused": round(fig["step_ms"][1], 3),
           "toggle_steps": len(times), "segment_seconds": args.segment_seconds,
           "agent_cpu_ms_per_running_s": round(cpu["agent"] / max(cpu["running_s"], 1e-9), 2),
           "job_fr_server_cpu_ms_per_s": round(cpu["server"] / max(cpu["wall_s"], 1e-9), 2),
           "collector_cpu_ms_per_s": round(cpu["collector"] / max(cpu["wall_s"], 1e-9), 2),
           "ops_stored": stored, "ops_lost": lost, "ring_wraps": wraps[0], "ops_lost_reported": wraps[1],
           "deep_mode_switches": deep, "ring_reads_by_reason": reads, "ring_reads_by_way": ways,
           "collector_stopped": args.collector_stopped}
    print(f"sentinel job, agent running vs paused: {mean:+.3f} % +- {se:.3f} % (mean step time, s.e. over {n} ABBA "
          f"quartets of {args.segment_seconds:g} s slots; median-based {med:+.3f} % +- {med_se:.3f}); steps "
          f"{fig['step_ms'][0]:.2f} vs {fig['step_ms'][1]:.2f} ms")
    print(f"agent CPU {out['agent_cpu_ms_per_running_s']} ms per running s, job worker-server threads "
          f"{out['job_fr_server_cpu_ms_per_s']} ms/s (both ranks), collector {out['collector_cpu_ms_per_s']} ms/s; "
          f"comm ops stored {stored:,}, lost {lost} "
          f"(ring wraps reported: {wraps[0]}, {wraps[1]} entries); deep-mode switches during the job: {deep}; "
          f"ring reads by reason: {reads}, by way: {ways}",
          flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
