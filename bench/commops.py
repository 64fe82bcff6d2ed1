"""Cost of the comm-op logger on a real gloo job: step time with and without it (sentinel mode), during a
Kineto deep window, and the records/s the agent handled.

One run, interleaved: rounds of three job launches in rotating order (off, sentinel, deep / sentinel, deep,
off / ...), each a fresh 2-rank torch.distributed gloo data-parallel job (2 x Linear(1024) per rank, batch 64,
a manual flat-gradient all_reduce and 3 broadcasts per step, 1 ms pause) logging its own step times. One
collector and one agent (flightrec + kineto sources, everything else as usual) run throughout:
  off       the job is launched plainly: the logger never touches it
  sentinel  launched with `steplens-agent env` variables (bootstrap: Flight Recorder worker server, polled
            by the agent every second; KINETO_USE_DAEMON=1: polls the agent's IPC endpoint; no trace window)
  deep      the same, under `steplens deep start` (Kineto hands a 4 s trace window per poll); its step time is
            the median of the steps inside the traced windows (found from the traced ops), and of all steps
The job's first 15 steps are warm-up and not counted. Medians per mode over all rounds; the last stdout line
is one JSON object.

    .venv/bin/python bench/commops.py                 # 3 rounds of 250 steps
    .venv/bin/python bench/commops.py --rounds 2 --steps 150
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
import time

from benchutil import Children

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(REPO, ".venv", "bin")
PY = sys.executable
WARMUP = 15

JOB = r'''
import json, os, sys, time
import torch, torch.distributed as dist
steps = int(sys.argv[1])
torch.manual_seed(0)
dist.init_process_group("gloo")
rank = dist.get_rank()
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
    for _ in range(3):
        dist.broadcast(flag, 0)
    off = 0
    for p in model.parameters():
        n = p.numel(); p.grad.copy_(flat[off:off + n].view_as(p)); off += n
    opt.step()
    time.sleep(0.001)
    out.append((t0, time.time_ns()))
if rank == 0:
    print(json.dumps(out), flush=True)
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
    try:
        return db.execute("SELECT COUNT(*) FROM records WHERE kind = 'commop'").fetchone()[0] + \
            (db.execute("SELECT value FROM counters WHERE key = 'records_dropped'").fetchone() or (0,))[0]
    finally:
        db.close()


def _traced_spans(state_dir: str, since_mono: int) -> list[tuple[int, int]]:
    """Realtime spans of the Kineto windows since since_mono (runs of traced ops with no gap > 0.5 s)."""
    sys.path.insert(0, REPO)
    from steplens.agent.transport.codec import decode_records, records_payload
    db = sqlite3.connect(os.path.join(state_dir, "detail.db"), timeout=10)
    try:
        blobs = [b for (b,) in db.execute("SELECT record FROM records WHERE kind = 'commop' AND mono_ns >= ?",
                                          (since_mono,))]
    finally:
        db.close()
    offset = time.time_ns() - time.monotonic_ns()
    times = sorted((r.start_mono_ns + offset, r.end_mono_ns + offset) for src, r in decode_records(records_payload(blobs))
                   if src == "kineto" and r.start_mono_ns)
    spans: list[list[int]] = []
    for a, b in times:
        if spans and a - spans[-1][1] < 500_000_000:
            spans[-1][1] = max(spans[-1][1], b)
        else:
            spans.append([a, b])
    return [(a, b) for a, b in spans]


def run_job(mode: str, steps: int, script: str, env_extra: dict, tmp: str, kids: Children) -> list[tuple[int, int]]:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", STEPLENS_JOB=f"bench-commops-{mode}")
        if mode != "off":
            env.update(env_extra)
        procs.append(kids.start([PY, script, str(steps)], env=env, stdout=subprocess.PIPE,
                                stderr=open(os.path.join(tmp, f"{mode}-rank{rank}.err"), "ab"), text=True))
    out = procs[0].communicate(timeout=600)[0]
    for p in procs[1:]:
        p.wait(timeout=120)
    if procs[0].returncode != 0:
        with open(os.path.join(tmp, f"{mode}-rank0.err")) as fh:
            raise RuntimeError(f"{mode} job failed: {fh.read()[-2000:]}")
    return [tuple(x) for x in json.loads(out.strip().splitlines()[-1])][WARMUP:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=250)
    args = ap.parse_args()
    sys.path.insert(0, REPO)
    from steplens.agent.bootstrap import site_dir

    tmp = tempfile.mkdtemp(prefix="slcb", dir="/tmp")  # short: AF_UNIX socket paths
    kids = Children()
    try:
        script = os.path.join(tmp, "job.py")
        with open(script, "w") as fh:
            fh.write(JOB)
        runtime, ksock, state = os.path.join(tmp, "fr"), os.path.join(tmp, "k"), os.path.join(tmp, "agent")
        for d in (runtime, ksock, state):
            os.makedirs(d)
        port = _free_port()
        collector = f"127.0.0.1:{port}"
        kids.start([os.path.join(VENV, "steplens-collector"), "serve", "--db", os.path.join(tmp, "c.db"), "--listen",
                    collector, "--insecure"], stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "c.log"), "ab"))
        toml = os.path.join(tmp, "agent.toml")
        with open(toml, "w") as fh:
            fh.write(f"""[sources.flightrec]
socket_dirs = ["{runtime}"]
[sources.kineto]
socket_dir = "{ksock}"
deep_window_ms = 4000
[sources.netflows]
enabled = false
[sources.sched]
enabled = false
[sources.gpuprobes]
enabled = false
""")
        kids.start([os.path.join(VENV, "steplens-agent"), "run", "--config", toml, "--collector", collector,
                    "--insecure", "--node-id", "bench", "--state-dir", state, "--metrics-listen", ""],
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
        modes = ["off", "sentinel", "deep"]
        steps: dict[str, list[float]] = {m: [] for m in modes}
        in_window: list[float] = []
        logged_s = 0.0
        ops0 = _commop_rows(state)
        for r in range(args.rounds):
            order = modes[r % 3:] + modes[:r % 3]
            for mode in order:
                mono0 = time.monotonic_ns()
                if mode == "deep":
                    _cli(collector, "deep", "start", "--duration", "600s", "--lead-ms", "200")
                t0 = time.monotonic()
                times = run_job(mode, args.steps + WARMUP, script, env_extra, tmp, kids)
                if mode != "off":
                    logged_s += time.monotonic() - t0
                if mode == "deep":
                    _cli(collector, "deep", "stop")
                    time.sleep(1.5)  # the last trace is parsed at the next kineto step
                    spans = _traced_spans(state, mono0)
                    inside = [(b - a) / 1e6 for a, b in times if any(s <= a and b <= e for s, e in spans)]
                    in_window += inside
                    extra = f", {len(inside)} steps inside {len(spans)} traced window(s)"
                else:
                    extra = ""
                ms = [(b - a) / 1e6 for a, b in times]
                steps[mode] += ms
                print(f"round {r + 1} {mode:<9} median step {statistics.median(ms):7.2f} ms over {len(ms)} steps{extra}",
                      flush=True)
        time.sleep(2.0)
        handled = _commop_rows(state) - ops0
    finally:
        kids.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    med = {m: statistics.median(v) for m, v in steps.items()}
    win = statistics.median(in_window) if in_window else float("nan")

    def pct(x: float) -> float:
        return round(100.0 * (x - med["off"]) / med["off"], 2)

    # spread: the same comparison between the first and second half of the "off" steps (noise floor)
    off = steps["off"]
    noise = abs(statistics.median(off[::2]) - statistics.median(off[1::2])) / med["off"] * 100
    result = {"step_ms_off": round(med["off"], 3), "step_ms_sentinel": round(med["sentinel"], 3),
              "step_ms_deep_all": round(med["deep"], 3), "step_ms_deep_in_window": round(win, 3),
              "sentinel_slowdown_percent": pct(med["sentinel"]), "deep_slowdown_percent": pct(med["deep"]),
              "deep_window_slowdown_percent": pct(win) if in_window else None,
              "noise_percent": round(noise, 2), "steps_in_window": len(in_window),
              "records_handled": handled, "records_per_s": round(handled / logged_s, 1) if logged_s else 0.0,
              "rounds": args.rounds, "steps_per_run": args.steps, "goal_sentinel_slowdown_percent": 0.5}
    print(f"step time off            {med['off']:8.2f} ms (median, {len(off)} steps)")
    print(f"step time sentinel       {med['sentinel']:8.2f} ms  {result['sentinel_slowdown_percent']:+.2f} % (goal < 0.5)")
    print(f"step time deep (all)     {med['deep']:8.2f} ms  {result['deep_slowdown_percent']:+.2f} %")
    print(f"step time in a window    {win:8.2f} ms  {result['deep_window_slowdown_percent']} % "
          f"({len(in_window)} steps)")
    print(f"noise floor              {noise:8.2f} % (odd vs even steps of 'off')")
    print(f"records handled          {handled:,} CommOps, {result['records_per_s']:,.0f} /s while a logged job ran")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
