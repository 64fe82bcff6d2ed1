"""Simulator speed: simulated rank-iterations per second (goal: 8,192 GPUs x 100 iterations < 60 s on the
2-core machine), the cost of writing records, and a streaming figure: N emulated agents (default 1,250 light
asyncio agents, see bench/sim/lightagent.py; `--agent-kind real` for real Spool + StreamClient agents) spread
over worker processes, through one real collector (a child process) on loopback.

    .venv/bin/python bench/sim_speed.py [--stream-agents 1250] [--stream-procs 2] [--agent-kind light|real]
                                        [--stream-iterations 5] [--stream-batch-records 250]
                                        [--no-stream | --stream-only] [--quick]
                                        [--stream-setups sqlite,chdb:2]

The simulation figure is the model alone (no sink), dense (TP=1, TP=8) and with expert parallelism (EP=8,
`ep_rank_iterations_per_s`); the output figure writes step summaries for the same
run to a temporary directory. Streaming prints: agents connected (the collector's Control ListNodes count,
taken once every worker has its HelloAcks, before any batch), the time to connect all of them, records/s
stored by the collector (its own counts, checked against the store: every agent's seqs 1..n, no duplicate)
over the streaming phase (from the first batch until the last ack), collector and emulator CPU% (100% =
one core) over that phase, and `backpressure_s` (the longest any worker waited on the collector: backlog
full, then the final drain) against `build_s` (its own record building and encoding): whichever is larger
is the bottleneck. The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.sim.faults import parse_fault  # noqa: E402
from bench.sim.model import ModelConfig, simulate  # noqa: E402
from bench.sim.output import FileSink  # noqa: E402
from bench.sim.stream import StreamConfig, stream  # noqa: E402

GOAL_SECONDS = 60.0


def timed_sim(cfg: ModelConfig, specs: list[str]) -> float:
    faults = [parse_fault(s, cfg.topology()) for s in specs]
    t0 = time.perf_counter()
    simulate(cfg, faults)
    return time.perf_counter() - t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes_held(addresses: list[str]) -> dict:
    """collector_nodes over several collectors of one store: each agent counted on the one holding it."""
    import grpc

    from steplens.v1 import control_pb2 as cpb
    from steplens.v1 import control_pb2_grpc as cgrpc
    out = {"nodes": 0, "connected": 0, "records_stored": 0, "records_rejected": 0, "batches_duplicate": 0}
    for address in addresses:
        with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 256 << 20)]) as ch:
            nodes = [n for n in cgrpc.ControlStub(ch).ListNodes(cpb.ListRequest(), timeout=30).nodes
                     if n.node_id.startswith("sim-node-") and not getattr(n, "collector", "")]
        out["nodes"] += len(nodes)
        out["connected"] += sum(1 for n in nodes if n.connected)
        for k in ("records_stored", "records_rejected", "batches_duplicate"):
            out[k] += sum(getattr(n, k) for n in nodes)
    return out


def run_stream(agents: int, procs: int, iterations: int, tmp: str, kind: str = "light",
               batch_records: int = 250, agents_per_channel: int = 100, setup: str = "sqlite") -> dict:
    """One streaming run into `setup`: 'sqlite' (one `steplens-collector serve` on SQLite) or 'chdb:N' (N
    collectors on one chDB database, in one helper process: bench/scaleout.py --serve; chDB runs one engine per
    process), the agents spread over the N collectors."""
    import psutil

    from bench.sim.stream import collector_nodes, store_check
    log = open(os.path.join(tmp, "collector.log"), "ab")
    if setup == "sqlite":
        port = _free_port()
        address = f"127.0.0.1:{port}"
        exe = os.path.join(os.path.dirname(sys.executable), "steplens-collector")
        cmd = ([exe] if os.path.exists(exe) else [sys.executable, "-m", "steplens.collector.cli.serve"])
        db = os.path.join(tmp, "c.db")
        proc = subprocess.Popen(cmd + ["serve", "--db", db, "--listen", address, "--insecure"],
                                stdout=subprocess.PIPE, stderr=log)
    else:
        n = int(setup.split(":", 1)[1]) if ":" in setup else 1
        helper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scaleout.py")
        sdir = tempfile.mkdtemp(dir=tmp)
        proc = subprocess.Popen([sys.executable, helper, "--serve", str(n), "--tmp", sdir], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log)
    try:
        line = proc.stdout.readline().decode()
        if setup == "sqlite":
            if "listening" not in line:
                raise RuntimeError(f"collector did not start: {line!r}")
            addresses = [address]
        else:
            if not line.startswith("{"):
                raise RuntimeError(f"collectors did not start: {line!r}")
            addresses = [f"127.0.0.1:{p}" for p in json.loads(line)["ports"]]
            address = ",".join(addresses)
        cp = psutil.Process(proc.pid)

        def cpu() -> float:
            t = cp.cpu_times()
            return t.user + t.system
        marks = {"start": (time.perf_counter(), cpu())}

        def on_phase(name: str, info: dict) -> None:
            marks[name] = (time.perf_counter(), cpu())
            if name == "connected":
                marks["seen"] = collector_nodes(address) if setup == "sqlite" else _nodes_held(addresses)
                marks[name] = (time.perf_counter(), cpu())  # the ListNodes call is not streaming work
        # one node per agent, 8 GPUs each: DP = agents, PP = 8, TP = 1
        cfg = ModelConfig(dp=agents, pp=8, tp=1, micro_batches=8, iterations=iterations, seed=1)
        faults = [parse_fault("slow_gpu:3:1:2", cfg.topology())]
        out = stream(cfg, faults, StreamConfig(collector=address, agents=agents, procs=procs, agent_kind=kind,
                                               state_dir=os.path.join(tmp, "spools"), connect_timeout_s=120,
                                               drain_timeout_s=300, batch_records=batch_records,
                                               agents_per_channel=agents_per_channel),
                     on_phase=on_phase)
        if setup == "sqlite":
            seen = collector_nodes(address)
            store = store_check(db)
        else:
            time.sleep(1.0)   # the agents' last acks are after the commits: nothing more to wait for but the log
            seen = _nodes_held(addresses)
            proc.stdin.write(b"check sim-node-\n")
            proc.stdin.flush()
            store = json.loads(proc.stdout.readline())
            seen["batches_duplicate"] = 0   # per-collector counts: the store's seq check is the one that holds
        (tc, cc), (ts, cs) = marks["connected"], marks["streamed"]
        phase_s = max(1e-9, ts - tc)
        out["collector_connected"] = marks["seen"]["connected"]
        out["collector_records_stored"] = seen["records_stored"]
        out["collector_batches_duplicate"] = seen["batches_duplicate"]
        out["collector_records_rejected"] = seen["records_rejected"]
        out["store"] = store
        out["stored_records_per_s"] = round(store["records"] / out["stream_s"], 1) if out["stream_s"] else 0.0
        out["collector_cpu_percent"] = round(100 * (cs - cc) / phase_s, 1)
        out["collector_connect_cpu_percent"] = round(
            100 * (cc - marks["start"][1]) / max(1e-9, tc - marks["start"][0]), 1)
        out["emulator_cpu_percent"] = round(100 * out["emulator_stream_cpu_s"] / out["stream_s"], 1) \
            if out["stream_s"] else 0.0
        out["collector_cpu_s"] = round(cpu(), 1)
        out["gpus"] = cfg.gpus
        out["iterations"] = iterations
        log.flush()
        with open(log.name, errors="replace") as f:
            warnings = [x.strip() for x in f if " WARNING " in x or " ERROR " in x]
        out["collector_warnings"] = len(warnings)
        out["collector_warning_sample"] = warnings[:3]
        out["setup"] = setup
        out["collectors"] = len(addresses)
        return out
    finally:
        if setup != "sqlite" and proc.poll() is None:
            try:
                proc.stdin.write(b"stop\n")
                proc.stdin.flush()
                proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1,024 GPUs x 20 iterations instead of 8,192 x 100")
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--stream-only", action="store_true", help="only the streaming figure")
    ap.add_argument("--stream-agents", type=int, default=1250)
    ap.add_argument("--stream-procs", type=int, default=2, help="emulator worker processes")
    ap.add_argument("--stream-iterations", type=int, default=5)
    ap.add_argument("--stream-batch-records", type=int, default=250, help="records per batch (agent default 2000)")
    ap.add_argument("--agent-kind", choices=("light", "real"), default="light",
                    help="light: asyncio wire-protocol agents (scale); real: Spool + StreamClient (~250 at most)")
    ap.add_argument("--agents-per-channel", type=int, default=100, help="light agents sharing one gRPC channel")
    ap.add_argument("--stream-setups", default="sqlite",
                    help="comma list, run one after the other: sqlite (one collector) and/or chdb:N (N collectors on "
                         "one ClickHouse database, chDB); figures of others than sqlite prefixed e.g. chdb2_")
    args = ap.parse_args(argv)
    big = (1024, 1, 20) if args.quick else (1024, 8, 100)  # dp, tp, iterations with pp = 8
    specs = ["slow_gpu:5:10:20", "slow_link:n3.nic1:30:40", "congested_switch:spine1:50:60",
             "hang:700:70:71:2.0", "fluctuation:100:0:100:2:10", "degradation:n7.nic0:20:80:3"]
    res: dict = {"goal_seconds": GOAL_SECONDS}
    tmp = tempfile.mkdtemp(prefix="sim-speed-")
    try:
        if not args.stream_only:
            simulate_figures(big, specs, tmp, res)
        if not args.no_stream:
            for setup in args.stream_setups.split(","):
                st = run_stream(args.stream_agents, args.stream_procs, args.stream_iterations, tmp, args.agent_kind,
                                args.stream_batch_records, args.agents_per_channel, setup)
                sub: dict = {}
                print_stream(st, sub)
                tag = setup.replace(":", "")
                res.update(sub if setup == "sqlite" else {f"{tag}_{k}": v for k, v in sub.items()})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not args.stream_only:
        key = f"seconds_{8192 if not args.quick else 1024}x{big[2]}_tp1"
        res["seconds_8192x100"] = res.get(key) if not args.quick else None
        res["goal_met"] = bool(res["seconds_8192x100"] is not None and res["seconds_8192x100"] < GOAL_SECONDS)
    print(json.dumps(res))
    return 0


def simulate_figures(big: tuple, specs: list[str], tmp: str, res: dict) -> None:
    warm = ModelConfig(dp=64, pp=8, tp=1, iterations=20, seed=1)
    s = timed_sim(warm, specs[:2])
    print(f"warm-up   {warm.gpus:>6} GPUs x {warm.iterations:>3} it  {s:6.2f} s  "
          f"{warm.gpus * warm.iterations / s:>10,.0f} rank-iterations/s")
    for name, (dp, pp, tp) in (("tp1", (big[0], 8, 1)), ("tp8", (big[0] // 8, 8, 8))):
        cfg = ModelConfig(dp=dp, pp=pp, tp=tp, iterations=big[2], seed=1)
        s = timed_sim(cfg, specs)
        rate = cfg.gpus * cfg.iterations / s
        print(f"simulate  {cfg.gpus:>6} GPUs x {cfg.iterations:>3} it  {s:6.2f} s  {rate:>10,.0f} rank-iterations/s"
              f"  (DP={dp} PP={pp} TP={tp}, 6 faults)")
        res[f"seconds_{cfg.gpus}x{cfg.iterations}_{name}"] = round(s, 2)
        res.setdefault("rank_iterations_per_s", round(rate))
        res["rank_iterations_per_s"] = min(res["rank_iterations_per_s"], round(rate))
    # expert parallelism: the same GPUs as tp8 with EP=8 inside DP, 4 MoE layers per stage (every layer):
    # 16 all-to-alls per micro-batch per stage (dispatch + combine, forward + backward) + the expert ring
    dp, pp, tp, ep = big[0] // 8, 8, 8, 8
    cfg = ModelConfig(dp=dp, pp=pp, tp=tp, ep=ep, iterations=big[2], seed=1)
    s = timed_sim(cfg, specs)
    rate = cfg.gpus * cfg.iterations / s
    print(f"simulate  {cfg.gpus:>6} GPUs x {cfg.iterations:>3} it  {s:6.2f} s  {rate:>10,.0f} rank-iterations/s"
          f"  (DP={dp} PP={pp} TP={tp} EP={ep}, {len(cfg.moe_layers())} MoE layers/stage, 6 faults)")
    res[f"seconds_{cfg.gpus}x{cfg.iterations}_ep{ep}"] = round(s, 2)
    res["ep_rank_iterations_per_s"] = round(rate)
    agentview_figures(big, specs, res)
    cfg = ModelConfig(dp=big[0] // 8, pp=8, tp=8, iterations=big[2], seed=1)
    sink = FileSink(cfg, tmp, ("steps",))
    t0 = time.perf_counter()
    simulate(cfg, [parse_fault(x, cfg.topology()) for x in specs], sink)
    sink.close()
    s = time.perf_counter() - t0
    print(f"simulate + write steps.jsonl ({sink.counts['steps']:,} rows, "
          f"{os.path.getsize(os.path.join(tmp, 'steps.jsonl')) / 1e6:.0f} MB)  {s:6.2f} s")
    res["seconds_with_steps_output"] = round(s, 2)


def agentview_figures(big: tuple, specs: list[str], res: dict) -> None:
    """What the emulated agents send (bench/sim/agentview.py): every kind at 1,024 GPUs x 20 iterations, and
    the ProcessInfo + Step records a step-time detector reads at the big size (simulation included)."""
    from collections import Counter

    from bench.sim.agentview import agent_records
    for (dp, its), kinds, name in (((128, 20), None, "all"), ((big[0], big[2]), frozenset({"process", "step"}),
                                                              "steps")):
        cfg = ModelConfig(dp=dp, pp=8, tp=1, iterations=its, seed=1)
        faults = [parse_fault(x, cfg.topology()) for x in specs[:2]]
        count: Counter = Counter()
        t0 = time.perf_counter()
        for _aid, rec in agent_records(cfg, faults, **({"kinds": kinds} if kinds else {})):
            count[type(rec).__name__] += 1
        s = time.perf_counter() - t0
        n = sum(count.values())
        print(f"agentview {cfg.gpus:>6} GPUs x {cfg.iterations:>3} it  {s:6.2f} s  {n / s:>10,.0f} records/s  "
              f"{cfg.gpus * cfg.iterations / s:>8,.0f} rank-iterations/s  ({name}: "
              + ", ".join(f"{v:,} {k}" for k, v in sorted(count.items())) + ")")
        res[f"agentview_seconds_{cfg.gpus}x{cfg.iterations}_{name}"] = round(s, 2)
        res[f"agentview_records_per_s_{name}"] = round(n / s)


def print_stream(st: dict, res: dict) -> None:
    store = st["store"]
    exact = (store["records"] == st["records"] and store["batches"] == st["batches"]
             and not store["seq_not_contiguous"] and st["collector_batches_duplicate"] == 0)
    wait, busy = st["wait_on_collector_s_max"], st["emulator_busy_s_max"]
    bottleneck = "collector" if wait > busy else "emulator"
    print(f"stream    [{st['setup']}: {st['collectors']} collector(s)] {st['agent_kind']} agents: "
          f"{st['collector_connected']:,} of {st['agents']:,} connected "
          f"(collector's count) in {st['connect_s']:.1f} s ({st['procs']} worker processes; collector CPU "
          f"{st['collector_connect_cpu_percent']:.0f}% meanwhile)")
    print(f"stream    {st['gpus']:,} GPUs x {st['iterations']} it: {st['records']:,} records in {st['batches']:,} "
          f"batches sent; collector stored {store['records']:,} in {store['batches']:,} batches "
          f"({'each exactly once' if exact else 'MISMATCH'}) in {st['stream_s']:.1f} s = "
          f"{st['stored_records_per_s']:,.0f} records/s stored")
    print(f"stream    CPU over the streaming phase: collector {st['collector_cpu_percent']:.0f}%, emulator "
          f"{st['emulator_cpu_percent']:.0f}% (100% = one core); per worker: waited on the collector "
          f"{wait:.1f} s (backlog full {st['backpressure_s_max']:.1f} s + final drain {st['drain_s_max']:.1f} s) vs "
          f"own build {st['build_s_max']:.1f} s + encode {st['encode_s_max']:.1f} s -> bottleneck: {bottleneck}; "
          f"reconnects {st['reconnects']} {st['reconnect_errors'] or ''}; collector warnings {st['collector_warnings']} "
          f"{st['collector_warning_sample'] or ''}; errors {st['errors'] or 'none'}")
    res.update(stream_agent_kind=st["agent_kind"], stream_agents=st["agents"], stream_procs=st["procs"],
               stream_agents_connected=st["collector_connected"], stream_connect_s=st["connect_s"],
               stream_gpus=st["gpus"], stream_iterations=st["iterations"],
               stream_records=st["records"], stream_records_stored=store["records"],
               stream_stored_exactly_once=exact, stream_s=st["stream_s"],
               stream_records_per_s=st["stored_records_per_s"],
               stream_collector_cpu_percent=st["collector_cpu_percent"],
               stream_emulator_cpu_percent=st["emulator_cpu_percent"],
               stream_backpressure_s=wait, stream_backlog_full_s=st["backpressure_s_max"],
               stream_drain_s=st["drain_s_max"], stream_build_s=st["build_s_max"],
               stream_encode_s=st["encode_s_max"], stream_bottleneck=bottleneck,
               stream_reconnects=st["reconnects"], stream_errors=st["errors"])

if __name__ == "__main__":
    sys.exit(main())
