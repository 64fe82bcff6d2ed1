"""What one step of the host and procs sources costs at their real cadence (1 Hz: every step starts with cold
caches), for this checkout and, side by side in the same seconds, another build (--other PYTHONPATH, laid out
like the installed package: see agent_footprint.py --agent).

    .venv/bin/python bench/source_steps.py [--seconds 60] [--other /tmp/headpkg]

Each build runs in a process of its own; both step once a second, half a second apart, and time each step with
the thread's CPU clock (time.thread_time). A whole-agent idle figure (agent_footprint.py) is the sum of such
steps and of every thread's wake-ups, counted by the kernel in 10 ms ticks: a 90 s window resolves ~0.01 % of a
core and the machine's noise is larger; this one resolves the steps. Prints per build and source the mean, median and
p90 µs per step and how many procs scans were skipped (no fork since the last one); last line one JSON object."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
from steplens.agent.sources.base import HostContext, build_config
from steplens.agent.sources.host import HostConfig, HostSource
from steplens.agent.sources.procs import ProcsConfig, ProcsSource
ctx = HostContext(node_id="bench")
srcs = {"host": HostSource(ctx, build_config(HostConfig, {}, "sources.host")),
        "procs": ProcsSource(ctx, build_config(ProcsConfig, {}, "sources.procs"))}
for s in srcs.values():
    s.start(); s.step()
start, seconds, offset = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
times = {k: [] for k in srcs}
t = start + offset
while t < start + offset + seconds:
    time.sleep(max(0.0, t - time.time()))
    for k, s in srcs.items():
        c = time.thread_time(); s.step(); times[k].append(time.thread_time() - c)
    t += 1.0
print(json.dumps({"times": times, "skipped": getattr(srcs["procs"], "scans_skipped", None)}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--other", default="", help="PYTHONPATH of another build to run beside this checkout's")
    a = ap.parse_args(argv)
    builds = {"this": None}
    if a.other:
        builds["other"] = a.other
    start = time.time() + 3.0
    procs = {}
    for i, (name, path) in enumerate(builds.items()):
        env = dict(os.environ)
        if path:
            env["PYTHONPATH"] = path
        procs[name] = subprocess.Popen([sys.executable, "-c", CHILD, str(start), str(a.seconds), str(0.5 * i)],
                                       env=env, stdout=subprocess.PIPE, text=True)
    out = {}
    for name, p in procs.items():
        res = json.loads(p.communicate()[0].strip().splitlines()[-1])
        for src, ts in res["times"].items():
            ts = sorted(ts)
            med, p90 = statistics.median(ts) * 1e6, ts[int(0.9 * (len(ts) - 1))] * 1e6
            mean = statistics.mean(ts) * 1e6
            print(f"{name:6s} {src:6s} {len(ts)} steps: mean {mean:.0f} us, median {med:.0f}, p90 {p90:.0f} per step "
                  f"({mean / 1e4:.4f} % of a core at 1 Hz)")
            out[f"{name}_{src}_us_per_step"] = round(mean, 1)
        if res["skipped"] is not None:
            print(f"{name:6s} procs: {res['skipped']} of {len(res['times']['procs'])} scans skipped (no fork since the last)")
            out[f"{name}_procs_scans_skipped"] = res["skipped"]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
