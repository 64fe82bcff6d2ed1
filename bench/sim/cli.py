"""`steplens-sim`: run the cluster simulator to files (`run`) or stream it through a collector (`stream`).

    steplens-sim run --gpus 64 --dp 4 --pp 4 --tp 4 --iterations 20 --fault slow_gpu:5:5:10 --seed 1 --out DIR
    steplens-sim run --gpus 64 --dp 8 --pp 2 --tp 4 --ep 4 --moe-every 2 --iterations 20 --out DIR   (MoE, EP=4)
    steplens-sim stream --gpus 64 --dp 4 --pp 4 --tp 4 --iterations 20 --agents 8 --collector 127.0.0.1:7070
A thin layer over model.simulate / output.FileSink / stream.stream. Prints one JSON summary to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .faults import KINDS, parse_fault
from .model import ModelConfig, simulate, testbed_like
from .output import EMIT_KINDS, FileSink, write_truth
from .stream import StreamConfig, stream


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, required=True, help="total GPUs (= dp * pp * tp)")
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=None,
                   help="expert parallel size, divides --dp (EP groups inside DP, Megatron's layout; 1 = dense)")
    p.add_argument("--layers-per-stage", type=int, default=None, help="layers per pipeline stage (default 4; EP only)")
    p.add_argument("--moe-every", type=int, default=None,
                   help="every k-th layer is MoE: layers 0, k, 2k, ... (default 1; EP only)")
    p.add_argument("--moe-fraction", type=float, default=None,
                   help="instead of --moe-every: this fraction of each stage's layers is MoE (EP only)")
    p.add_argument("--iterations", type=int, required=True)
    p.add_argument("--micro-batches", type=int, default=None, help="micro-batches per step (default 8; testbed 4)")
    p.add_argument("--preset", choices=("default", "testbed"), default="default",
                   help="testbed: the gloo CPU testbed's timings (DP=2 x PP=2, 1 process per host)")
    p.add_argument("--fault", action="append", default=[], metavar="KIND:TARGET:START:END[:VALUE[:PERIOD]]",
                   help=f"KIND one of {', '.join(KINDS)}; TARGET a rank, link (n3.nic1) or switch (leaf0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--nodes-per-leaf", type=int, default=None)
    p.add_argument("--spines", type=int, default=None)
    p.add_argument("--jitter-cv", type=float, default=None, help="per rank-iteration compute noise (default 0.02)")


def _build(args) -> tuple[ModelConfig, list]:
    moe = (args.layers_per_stage, args.moe_every, args.moe_fraction)
    if (args.ep or 1) == 1 and any(v is not None for v in moe):
        raise ValueError("--layers-per-stage / --moe-every / --moe-fraction need --ep > 1 (MoE layers are modelled "
                         "with expert parallelism only)")
    if args.moe_every is not None and args.moe_fraction is not None:
        raise ValueError("give --moe-every or --moe-fraction, not both")
    over = {k: v for k, v in (("dp", args.dp), ("pp", args.pp), ("tp", args.tp), ("iterations", args.iterations),
                              ("ep", args.ep), ("layers_per_stage", args.layers_per_stage),
                              ("moe_every", args.moe_every), ("moe_fraction", args.moe_fraction),
                              ("seed", args.seed), ("micro_batches", args.micro_batches),
                              ("gpus_per_node", args.gpus_per_node), ("nodes_per_leaf", args.nodes_per_leaf),
                              ("spines", args.spines), ("jitter_cv", args.jitter_cv)) if v is not None}
    cfg = testbed_like(**over) if args.preset == "testbed" else ModelConfig(**over)
    if cfg.gpus != args.gpus:
        raise ValueError(f"--gpus {args.gpus} != dp*pp*tp = {cfg.gpus}")
    cfg.validate()
    topo = cfg.topology()
    faults = [parse_fault(s, topo) for s in args.fault]
    return cfg, faults


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="steplens-sim", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("run", help="simulate and write records + truth.json to --out")
    _model_args(pr)
    pr.add_argument("--out", required=True, help="output directory")
    pr.add_argument("--emit", default=",".join(EMIT_KINDS),
                    help=f"comma list of {', '.join(EMIT_KINDS)} (or 'none'); truth.json is always written")
    ps = sub.add_parser("stream", help="stream the simulated job through a collector as emulated agents")
    _model_args(ps)
    ps.add_argument("--collector", required=True, help="HOST:PORT")
    ps.add_argument("--agents", type=int, default=0, help="emulated agents (default: one per node)")
    ps.add_argument("--procs", type=int, default=1, help="worker processes hosting the agents")
    ps.add_argument("--agent-kind", choices=["light", "real"], default="light",
                    help="light: asyncio agents speaking the real protocol (scales to 1,000s); real: Spool + StreamClient")
    ps.add_argument("--state-dir", default="", help="spools go here (default: a temporary directory)")
    ps.add_argument("--pace", choices=("none", "realtime"), default="none")
    ps.add_argument("--batch-records", type=int, default=2000)
    ps.add_argument("--insecure", action="store_true", help="plaintext (loopback only)")
    ps.add_argument("--linger", type=float, default=0.0, metavar="SECONDS",
                    help="light agents: stay connected this long after the last ack, answering FetchDetail (commops)")
    ps.add_argument("--job-key", default="simjob", help="job key of the emulated processes (default simjob)")
    ps.add_argument("--steps", choices=("constructed", "segmenter"), default="constructed",
                    help="Step records built from the op times, or by the real agent/steps.py (slow; see agentview.py)")
    ps.add_argument("--out", default="", help="also write truth.json here")
    args = ap.parse_args(argv)
    try:
        cfg, faults = _build(args)
        if args.cmd == "run":
            emit = tuple(k for k in args.emit.split(",") if k and k != "none")
            sink = FileSink(cfg, args.out, emit)
            t0 = time.perf_counter()
            res = simulate(cfg, faults, sink)
            sink.close()
            write_truth(res, args.out)
            cfg.topology().write_topology_file(os.path.join(args.out, "topology.json"))
            print(json.dumps({"out": args.out, "gpus": cfg.gpus, "iterations": res.iterations_done,
                              "aborted_at_iteration": res.aborted_at if res.aborted_at >= 0 else None,
                              "seconds": round(time.perf_counter() - t0, 3), "rows": sink.counts}))
            return 0
        if not args.insecure:
            raise ValueError("only --insecure (plaintext on loopback) is supported by the simulator's agents yet")
        host = args.collector.rsplit(":", 1)[0].strip("[]")
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("--insecure needs a loopback collector address")
        sc = StreamConfig(collector=args.collector, agents=args.agents, procs=args.procs, state_dir=args.state_dir,
                          pace=args.pace, batch_records=args.batch_records, insecure=True,
                          agent_kind=args.agent_kind, job_key=args.job_key, steps=args.steps,
                          linger_s=args.linger)
        out = stream(cfg, faults, sc)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            write_truth(simulate(cfg, faults), args.out)
            if not sc.agents or sc.agents >= cfg.topology().nodes:  # node ids are the agents' only then
                cfg.topology().write_topology_file(os.path.join(args.out, "topology.json"))
        print(json.dumps(out))
        return 0 if not out["errors"] and not out["not_drained"] else 1
    except (ValueError, OSError) as exc:
        print(f"steplens-sim: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
