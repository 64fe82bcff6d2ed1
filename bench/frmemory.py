"""What one Flight Recorder ring read costs, read from the job's memory (agent/sources/frmemory.py, C and Python
decoders) or through its worker-server socket (the job builds the whole ring as JSON, the agent parses it from
the poll's cursor on), side by side on one live job.

The job: one gloo rank under the steplens bootstrap (its socket), a 2,000-entry ring, recording all_reduces at
about --rate ops/s. Every --every seconds one read, the ways in rotation, each from its own cursor (the entries
new since that way's last read: about rate x every x ways, near half the ring as the read schedule's ring_fill
0.5 makes it). Per read: the reading thread's CPU (time.thread_time: the read and the Dump with the new entries'
dicts, as FlightrecSource gets them) and the job's worker-server threads' CPU (/proc/PID/task/*/schedstat, ns) over
the read. Figures: CPU per new entry, medians over the reads of each way.

    .venv/bin/python bench/frmemory.py [--reads 30] [--rate 500] [--every 1.0]

Last line: one JSON object (us per new entry).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

JOB = r'''
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
rate = float(sys.argv[2])
sizes = [torch.ones(n) for n in (16384, 128, 1280, 10)]
print("ready", flush=True)
k, t0 = 0, time.monotonic()
while True:
    dist.all_reduce(sizes[k % 4])
    k += 1
    ahead = t0 + k / rate - time.monotonic()
    if ahead > 0:
        time.sleep(ahead)
'''


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_ns(pid: int) -> int:
    """Run time (ns) of the job's threads named pt_workerserver* (torch's worker server)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                if not fh.read().startswith("pt_workerserver"):
                    continue
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                total += int(fh.read().split()[0])
        except OSError:
            continue
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reads", type=int, default=30, help="reads per way")
    ap.add_argument("--rate", type=float, default=500.0, help="the job's all_reduces per second")
    ap.add_argument("--every", type=float, default=1.0, help="seconds between reads")
    args = ap.parse_args()

    from steplens.agent.cli import tune_gc
    from steplens.agent.config import AgentSettings
    from steplens.agent.bootstrap import site_dir
    from steplens.agent.sources import frmemory
    from steplens.agent.sources.flightrec import http_post_unix, parse_dump
    from steplens.agent.sources.frmemory import RecorderMemory
    tune_gc(AgentSettings().gc_young_threshold)   # the garbage collector as `steplens-agent run` sets it

    tmp = tempfile.mkdtemp(prefix="frmem-bench-")
    env = dict(os.environ, PYTHONPATH=site_dir(), STEPLENS_BOOTSTRAP="1", STEPLENS_RUNTIME_DIR=tmp,
               TORCH_FR_BUFFER_SIZE="2000")
    job = subprocess.Popen([os.path.join(ROOT, ".venv", "bin", "python"), "-c", JOB, str(_free_port()),
                            str(args.rate)], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert job.stdout.readline().strip() == "ready"
        sock = os.path.join(tmp, f"{job.pid}.sock")
        deadline = time.monotonic() + 30
        while not os.path.exists(sock) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(2000 / args.rate + 1)   # a full ring
        ways = {"socket": None, "memory_c": RecorderMemory(job.pid, native=True) if frmemory._native() else None,
                "memory_python": RecorderMemory(job.pid, native=False)}
        ways = {k: v for k, v in ways.items() if k == "socket" or v is not None}
        cursor = {}
        for name, reader in ways.items():   # each way's cursor at the ring's head
            if reader is None:
                cursor[name] = max(e["record_id"] for e in parse_dump(http_post_unix(sock, "fr_trace_json")[1])
                                   .entries) + 1
            else:
                cursor[name] = max(e["record_id"] for e in reader.read().entries) + 1
        per: dict[str, list] = {k: [] for k in ways}
        job_per: dict[str, list] = {k: [] for k in ways}
        for i in range(args.reads * len(ways)):
            name = list(ways)[i % len(ways)]
            time.sleep(args.every)
            s0, c0 = server_ns(job.pid), time.thread_time_ns()
            if ways[name] is None:
                status, body = http_post_unix(sock, "fr_trace_json")
                dump = parse_dump(body, from_record_id=cursor[name])
            else:
                dump = ways[name].read(cursor[name])
            c1, s1 = time.thread_time_ns(), server_ns(job.pid)
            new = [e for e in dump.entries if e["record_id"] >= cursor[name]]
            if not new:
                continue
            cursor[name] = new[-1]["record_id"] + 1
            per[name].append((c1 - c0) / 1e3 / len(new))
            job_per[name].append((s1 - s0) / 1e3 / len(new))
        out = {"rate_ops_per_s": args.rate, "reads_per_way": args.reads,
               "new_entries_per_read": round(args.rate * args.every * len(ways))}
        for name in ways:
            agent = statistics.median(per[name])
            jobside = statistics.median(job_per[name])
            out[f"{name}_agent_us_per_entry"] = round(agent, 3)
            out[f"{name}_job_us_per_entry"] = round(jobside, 3)
            print(f"{name:14s} agent {agent:7.3f} us per new entry, job's worker server {jobside:7.3f} us per new "
                  f"entry (medians over {len(per[name])} reads)")
        print(json.dumps(out))
    finally:
        job.kill()
        job.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
