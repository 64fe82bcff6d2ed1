"""What one step of the host, procs, tcpinfo and pystacks sources costs at their real cadence (procs, host and
tcpinfo once a second, pystacks at its sentinel sample budget: every step starts with cold caches), for this
checkout and, side by side in the same seconds, another build (--other PYTHONPATH, laid out like the installed
package: see agent_footprint.py --agent), optionally with agent_footprint.py's N-rank gloo job running.

    .venv/bin/python bench/source_steps.py [--seconds 60] [--other /tmp/headpkg]
    .venv/bin/python bench/source_steps.py --ranks 8 --sources procs,tcpinfo,pystacks --other /tmp/headpkg  # root
    .venv/bin/python bench/source_steps.py --ranks 8 --sources pystacks --other-env STEPLENS_PYFRAMES_NATIVE=0

Each build runs in a process of its own; both step their sources as the agent's runner would, half a second
apart, and time each step with the thread's CPU clock (time.thread_time). A whole-agent figure
(agent_footprint.py) is the sum of such steps and of every thread's wake-ups, counted by the kernel in 10 ms ticks:
a 90 s window resolves ~0.01 % of a core and the machine's noise is larger; this one resolves the steps. Prints
per build and source the mean, median and p90 µs per step and how many procs scans were skipped (no fork since the
last one) or read only the known processes; last line one JSON object."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from agent_footprint import JOB, free_port
from benchutil import Children

CHILD = r"""
import json, sys, tempfile, time
from steplens.agent.sources.base import HostContext, build_config
from steplens.agent.sources.host import HostConfig, HostSource
from steplens.agent.sources.procs import ProcsConfig, ProcsSource
from steplens.agent.sources.pystacks import PystacksConfig, PystacksSource
from steplens.agent.sources.tcpinfo import TcpinfoConfig, TcpinfoSource
ctx = HostContext(node_id="bench", state_dir=tempfile.mkdtemp(prefix="steplens-steps-"))
kinds = {"procs": (ProcsSource, ProcsConfig), "host": (HostSource, HostConfig),
         "tcpinfo": (TcpinfoSource, TcpinfoConfig), "pystacks": (PystacksSource, PystacksConfig)}
start, seconds, offset, names = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4].split(",")
srcs = {k: kinds[k][0](ctx, build_config(kinds[k][1], {}, f"sources.{k}")) for k in kinds if k in names}
for s in srcs.values():   # procs first: it fills ctx.workloads for the others
    s.start(); s.step()
times = {k: [] for k in srcs}
due = {k: start + offset for k in srcs}
while True:
    k = min(due, key=due.get)
    if due[k] >= start + offset + seconds:
        break
    time.sleep(max(0.0, due[k] - time.time()))
    s = srcs[k]
    if not ctx.workloads.snapshot() and s.idle():   # the runner waits for a workload instead of stepping it
        due[k] += s.config.interval_seconds
        continue
    c = time.thread_time(); s.step(); times[k].append(time.thread_time() - c)
    due[k] += s.config.interval_seconds * max(1.0, s.pace())   # the runner's cadence (pystacks: its sample budget)
print(json.dumps({"times": times, "skipped": getattr(srcs.get("procs"), "scans_skipped", None),
                  "known_only": getattr(srcs.get("procs"), "scans_known_only", None),
                  "workloads": len(ctx.workloads.snapshot())}))
"""


def launch_job(ranks: int, kids: Children, tmp: str) -> tuple[list[subprocess.Popen], str]:
    """agent_footprint.py's gloo job (4 all_reduces and a 20 ms sleep a step) with `ranks` ranks, no bootstrap;
    touch the returned path to end it."""
    script, release = os.path.join(tmp, "job.py"), os.path.join(tmp, "release")
    with open(script, "w") as fh:
        fh.write(JOB)
    port = free_port()
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(ranks),
                   LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", STEPLENS_JOB="bench-source-steps")
        procs.append(kids.start([sys.executable, script, release], env=env, stdout=subprocess.DEVNULL,
                                stderr=open(os.path.join(tmp, f"rank{rank}.err"), "ab")))
    return procs, release


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--other", default="", help="PYTHONPATH of another build to run beside this checkout's")
    ap.add_argument("--other-env", default="", metavar="KEY=VALUE",
                    help="set for the other build; alone, the other build is this checkout with it (e.g. "
                         "STEPLENS_PYFRAMES_NATIVE=0: pystacks with the sampler's walk in Python)")
    ap.add_argument("--sources", default="host,procs", help="comma-separated, of host, procs, tcpinfo, pystacks")
    ap.add_argument("--ranks", type=int, default=0, help="run agent_footprint.py's gloo job with this many ranks "
                    "while measuring (needs torch; 0: none)")
    ap.add_argument("--settle", type=float, default=20.0, help="seconds between the job's start and the builds'")
    a = ap.parse_args(argv)
    names = [n for n in a.sources.split(",") if n]
    unknown = set(names) - {"host", "procs", "tcpinfo", "pystacks"}
    if unknown or not names:
        ap.error(f"unknown sources: {sorted(unknown)}" if unknown else "no source")
    if "procs" not in names:
        names.insert(0, "procs")   # it finds the workloads the others follow
    builds = {"this": None}
    if a.other or a.other_env:
        builds["other"] = a.other
    other_env = dict([a.other_env.split("=", 1)]) if "=" in a.other_env else {}
    kids = Children()
    tmp = tempfile.mkdtemp(prefix="steplens-source-steps-")
    release = ""
    out: dict = {"ranks": a.ranks}
    try:
        if a.ranks:
            job, release = launch_job(a.ranks, kids, tmp)
            time.sleep(a.settle)
            if any(p.poll() is not None for p in job):
                raise SystemExit(f"job ranks exited early; see {tmp}/rank*.err")
        start = time.time() + 3.0
        procs = {}
        for i, (name, path) in enumerate(builds.items()):
            env = dict(os.environ)
            if path:
                env["PYTHONPATH"] = path
            if name == "other":
                env.update(other_env)
            procs[name] = subprocess.Popen([sys.executable, "-c", CHILD, str(start), str(a.seconds), str(0.5 * i),
                                            ",".join(names)], env=env, stdout=subprocess.PIPE, text=True)
        for name, p in procs.items():
            res = json.loads(p.communicate()[0].strip().splitlines()[-1])
            print(f"{name}: {res['workloads']} workload processes")
            for src, ts in res["times"].items():
                if not ts:
                    continue
                ts = sorted(ts)
                med, p90 = statistics.median(ts) * 1e6, ts[int(0.9 * (len(ts) - 1))] * 1e6
                mean = statistics.mean(ts) * 1e6
                core = mean * len(ts) / a.seconds / 1e4
                print(f"{name:6s} {src:8s} {len(ts)} steps: mean {mean:.0f} us, median {med:.0f}, p90 {p90:.0f} per "
                      f"step ({core:.4f} % of a core)")
                out[f"{name}_{src}_us_per_step"] = round(mean, 1)
                out[f"{name}_{src}_core_percent"] = round(core, 4)
            if res["skipped"] is not None:
                n = len(res["times"]["procs"])
                known = res.get("known_only")
                print(f"{name:6s} procs: {res['skipped']} of {n} scans skipped (no fork since the last, no workload)"
                      + (f", {known} read only the known processes" if known is not None else ""))
                out[f"{name}_procs_scans_skipped"] = res["skipped"]
    finally:
        if release:
            open(release, "w").close()
            time.sleep(3)
        kids.stop_all()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
