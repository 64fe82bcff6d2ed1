"""What a deep dive costs the job (issue "Closing the loop"): the testbed's DP2 x PP2 gloo job, quiet segments and
deep dives interleaved in one run, the job's own step times compared.

The bed (bench/testbed: 4 network-namespace hosts on this VM's 2 cores, one agent each, the collector) runs the job
under the bootstrap. Then --rounds times: --quiet-seconds with nothing, then an operator's deep dive of the job
(`steplens deep start --job`, --deep-seconds: every agent in deep mode at one instant: 1 kHz stacks, 4 Hz host
counters, 1 s comm-op polls, and the collector's fetch and ranking after it). Steps are the job's own step logs
(steps/rank<r>.jsonl, wall clock), taken per rank: those wholly inside a deep window (its first 0.5 s left out:
the switch) against those wholly inside the quiet segment just before it (1 s margins); the slowdown per round is
the ratio of the median step times, then the median over rounds and ranks. The quiet noise is the same ratio
between the first and second halves of each quiet segment (what this shared VM does on its own). The agents' own
CPU, their governor budget and the stack sampler's rate scale are read from `steplens nodes` mid-window.
--no-governor runs the agents with `[agent] governor = false` (the before). Needs root.

    .venv/bin/python bench/deepdive_cost.py [--rounds 6] [--no-governor]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.testbed import faults, netns  # noqa: E402


def _steps(layout, world: int) -> dict[int, list[dict]]:
    return {r: faults.read_steps(layout, r) for r in range(world)}


def _median_in(steps: list[dict], a: int, b: int) -> float | None:
    xs = [s["end_ns"] - s["start_ns"] for s in steps if s["start_ns"] >= a and s["end_ns"] <= b]
    return statistics.median(xs) if len(xs) >= 5 else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--quiet-seconds", type=float, default=12.0)
    ap.add_argument("--deep-seconds", type=float, default=6.0)
    ap.add_argument("--no-governor", action="store_true")
    ap.add_argument("--budget-fraction", type=float, default=0.0,
                    help="the agents' deep_cpu_budget_fraction (default: theirs, 0.01 of the CPUs they see); the bed's "
                         "4 hosts share this VM's 2 cores, so a host's own share is 0.01 / 4 = 0.0025")
    ap.add_argument("--state-dir", default="/tmp/steplens-deepcost")
    a = ap.parse_args(argv)
    if a.no_governor:
        netns.AGENT_TOML = netns.AGENT_TOML.replace("[agent]\n", "[agent]\ngovernor = false\n", 1)
    elif a.budget_fraction:
        netns.AGENT_TOML = netns.AGENT_TOML.replace(
            "[agent]\n", f"[agent]\ndeep_cpu_budget_fraction = {a.budget_fraction}\n", 1)
    layout = netns.Layout(state_dir=a.state_dir)
    netns.down(layout)
    shutil.rmtree(a.state_dir, ignore_errors=True)
    rounds, nodes_seen = [], []
    try:
        netns.up(layout)
        netns.start_job(layout, dp=2, pp=2, steps=0)
        faults.wait_steps(layout, 40, timeout=240)
        jobs = json.loads(netns.steplens_cli(layout, "jobs", "--json").stdout or "[]")
        job = next(j["job_key"] for j in jobs if len(j["ranks"]) == 4)
        time.sleep(5)
        for _ in range(a.rounds):
            q0 = time.time_ns()
            time.sleep(a.quiet_seconds)
            res = netns.steplens_cli(layout, "deep", "start", "--job", job, "--duration", f"{a.deep_seconds}s",
                                     "--lead-ms", "300", "--json")
            if res.returncode != 0:
                raise SystemExit(f"deep start failed: {res.stderr}")
            d = json.loads(res.stdout)
            start = d["start_ns"]
            end = start + int(a.deep_seconds * 1e9)
            time.sleep(max(0.0, (start - time.time_ns()) / 1e9) + a.deep_seconds / 2)
            nodes = json.loads(netns.steplens_cli(layout, "nodes", "--json").stdout or "[]")
            nodes_seen.append([{"node": n["node_id"], "mode": n["mode"], "agent_cpu_cores": n["agent_cpu_cores"],
                                "budget_cores": n["cpu_budget_cores"],
                                "pystacks_cores": n["sources"].get("pystacks", {}).get("cpu_cores"),
                                "pystacks_scale": n["sources"].get("pystacks", {}).get("rate_scale"),
                                "sources_cores": {k: round(v["cpu_cores"], 4) for k, v in sorted(
                                    n["sources"].items(), key=lambda kv: -kv[1]["cpu_cores"])[:4]}} for n in nodes])
            time.sleep(max(0.0, (end - time.time_ns()) / 1e9) + 1.0)
            rounds.append({"quiet": (q0 + 10**9, start - 10**9), "deep": (start + 500_000_000, end),
                           "command_id": d["command_id"]})
        time.sleep(3)
        steps = _steps(layout, 4)
    finally:
        netns.down(layout)
    slow, noise = [], []
    for rd in rounds:
        (qa, qb), (da, db) = rd["quiet"], rd["deep"]
        mid = (qa + qb) // 2
        rd["ratio"], rd["noise"] = {}, {}
        for r, ss in steps.items():
            q, dd = _median_in(ss, qa, qb), _median_in(ss, da, db)
            q1, q2 = _median_in(ss, qa, mid), _median_in(ss, mid, qb)
            if q and dd:
                rd["ratio"][r] = dd / q - 1
                slow.append(dd / q - 1)
            if q1 and q2:
                rd["noise"][r] = q2 / q1 - 1
                noise.append(abs(q2 / q1 - 1))
    cpu = [n["agent_cpu_cores"] for ns in nodes_seen for n in ns if n["mode"] == "deep"]
    scales = [n["pystacks_scale"] for ns in nodes_seen for n in ns if n["mode"] == "deep" and n["pystacks_scale"]]
    for i, rd in enumerate(rounds):
        print(json.dumps({"round": i, "slowdown_pct": {r: round(100 * v, 2) for r, v in rd["ratio"].items()},
                          "quiet_halves_pct": {r: round(100 * v, 2) for r, v in rd["noise"].items()},
                          "nodes": nodes_seen[i]}))
    out = {"governor": not a.no_governor, "budget_fraction": a.budget_fraction or None, "rounds": len(rounds), "deep_seconds": a.deep_seconds,
           "deep_slowdown_pct_median": round(100 * statistics.median(slow), 2) if slow else None,
           "deep_slowdown_pct_mean": round(100 * statistics.fmean(slow), 2) if slow else None,
           "quiet_noise_abs_pct_median": round(100 * statistics.median(noise), 2) if noise else None,
           "agent_cpu_cores_deep_median": round(statistics.median(cpu), 4) if cpu else None,
           "agent_budget_cores": nodes_seen[0][0]["budget_cores"] if nodes_seen and nodes_seen[0] else None,
           "pystacks_rate_scale_median": round(statistics.median(scales), 3) if scales else None}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
