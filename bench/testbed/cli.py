"""`steplens-testbed up|run|inject|status|down`: a thin command line over `netns` and `faults`.

Prints JSON on stdout; exits non-zero with one line on stderr when something fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from . import faults, netns


def _out(obj) -> None:
    json.dump(obj, sys.stdout, indent=1)
    sys.stdout.write("\n")


# job.py's per-step workload locals (micro_batches, tokens) as the sentinel's training features
STEP_FEATURES = "micro_batches=micro_batches,tokens=tokens"


def cmd_up(layout: netns.Layout, a) -> int:
    _out(netns.up(layout, agents=not a.no_agents, flows_node=a.flows_node))
    return 0


def cmd_run(layout: netns.Layout, a) -> int:
    env = {}
    for spec in a.gc_storm_rank or []:
        env.setdefault(spec, {})["STEPLENS_TESTBED_GC_STORM"] = "1"
    if a.extra_sync:
        for r in range(a.dp * a.pp * a.tp):
            env.setdefault(r, {})["STEPLENS_TESTBED_EXTRA_SYNC"] = "1"
    extra = ["--vary-micro", a.vary_micro] if a.vary_micro else []
    if a.step_features:   # the workload the sentinel's baseline reads at each optimizer step (steplens_iters)
        for r in range(a.dp * a.pp * a.tp):
            env.setdefault(r, {})["STEPLENS_STEP_FEATURES"] = a.step_features
    ranks = netns.start_job(layout, a.dp, a.pp, a.steps, a.schedule, a.timeout_seconds, env_faults=env, tp=a.tp,
                            extra_args=extra)
    if a.detach:
        _out({"ranks": ranks})
        return 0
    while any(netns.job_alive(layout).values()):
        time.sleep(0.5)
    summary = {r["rank"]: faults.summarize(faults.read_steps(layout, r["rank"])) for r in ranks}
    _out({"ranks": ranks, "summary": summary})
    done = all(s.get("steps", 0) >= a.steps for s in summary.values()) if a.steps > 0 else True
    return 0 if done else 1


def cmd_inject(layout: netns.Layout, a) -> int:
    _out(faults.inject(layout, a.kind, a.target, a.duration, rate=a.rate, burst=a.burst, cpu_share=a.cpu_share,
                       processes=a.processes, slow_fraction=a.slow_fraction))
    return 0


def cmd_status(layout: netns.Layout, a) -> int:
    out: dict = {"namespaces": netns.list_namespaces(), "cgroups": netns.cgroups_left(),
                 "processes": [dict(e, alive=netns.alive(e)) for e in netns.recorded(layout)],
                 "ground_truth": faults.ground_truth(layout)}
    try:
        job = netns.load_job(layout)
        out["job"] = {"dp": job["dp"], "pp": job["pp"], "tp": job.get("tp", 1), "ranks": job["ranks"],
                      "last_step": faults.last_step(layout),
                      "recent": {r["rank"]: faults.summarize(faults.read_steps(layout, r["rank"])[-10:])
                                 for r in job["ranks"]}}
    except RuntimeError:
        pass
    if a.nodes and out["namespaces"]:
        res = netns.steplens_cli(layout, "nodes", "--json")
        out["nodes"] = [{"node_id": n["node_id"], "connected": n["connected"], "records_stored": n["records_stored"]}
                        for n in json.loads(res.stdout or "[]")]
    _out(out)
    return 0


def cmd_down(layout: netns.Layout, a) -> int:
    res = netns.down(layout)
    _out(res)
    return 0 if not res["namespaces_left"] and not res["cgroups_left"] else 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="steplens-testbed", description="emulated hosts (network namespaces), "
                                 "steplens agents, a real gloo DP x PP x TP job (TP within a host), "
                                 "and real faults with ground truth")
    ap.add_argument("--state-dir", default=netns.DEFAULT_STATE_DIR, help="PIDs, logs, PKI, step logs, ground truth")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("up", help="create namespaces, bridge, collector and one agent per host")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--no-agents", action="store_true", help="collector only")
    p.add_argument("--flows-node", default="", help="this host's agent (h<i>) also runs the eBPF netflows source")
    p.set_defaults(fn=cmd_up)

    p = sub.add_parser("run", help="start the DP x PP x TP training job: dp x pp hosts, tp ranks per host")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1, help="TP ranks per host (one TP group per host namespace)")
    p.add_argument("--steps", type=int, default=100, help="0 = until `down`")
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    p.add_argument("--timeout-seconds", type=float, default=30.0, help="gloo timeout")
    p.add_argument("--gc-storm-rank", type=int, action="append", help="launch this rank with a GC storm")
    p.add_argument("--extra-sync", action="store_true", help="launch with a barrier per micro-batch")
    p.add_argument("--vary-micro", default="", metavar="LO:HI", help="micro-batches per step drawn from LO..HI")
    p.add_argument("--step-features", default=STEP_FEATURES,
                   help="STEPLENS_STEP_FEATURES for the ranks: the job's locals the sentinel reads ('' none)")
    p.add_argument("--detach", action="store_true", help="return once the ranks are started")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("inject", help="apply one fault for a while and log its ground truth")
    p.add_argument("kind", choices=faults.KINDS)
    p.add_argument("--target", default="1", help="cpu/stop/gc_storm/hold: a rank (rank3 or 3); link/noisy: a host "
                   "(h1 or 1, or rank3 = its host); `all` for extra_sync")
    p.add_argument("--duration", type=float, required=True, help="seconds")
    p.add_argument("--rate", default="200mbit", help="link: tbf rate")
    p.add_argument("--burst", default="64kb", help="link: tbf bucket (default 64kb; a smaller one is closer to a "
                   "slower link, a larger one to a shaper that lets a message's start through at full speed)")
    p.add_argument("--cpu-share", type=float, default=0.1, help="cpu: fraction of one core")
    p.add_argument("--processes", type=int, default=1, help="noisy: CPU burners")
    p.add_argument("--slow-fraction", type=float, default=0.05, help="slow: extra compute, a share of the rank's")
    p.set_defaults(fn=cmd_inject)

    p = sub.add_parser("status", help="namespaces, processes, job progress, ground truth")
    p.add_argument("--nodes", action="store_true", help="also ask the collector for its nodes")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("down", help="remove everything (idempotent, also after a crash)")
    p.set_defaults(fn=cmd_down)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    layout = netns.Layout(state_dir=a.state_dir, hosts=getattr(a, "hosts", 4))
    try:
        return a.fn(layout, a)
    except (RuntimeError, ValueError, PermissionError, TimeoutError) as e:
        print(f"steplens-testbed {a.cmd}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
