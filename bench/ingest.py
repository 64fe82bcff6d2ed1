"""Ingest benchmark: N emulated agents stream telemetry over real gRPC into one real collector.

Prints sustained stored rows/s, the collector's CPU seconds per 100k rows, an end-to-end loss check
(every record each emulated agent produced is in the store), then the CPU and RSS of one real
`steplens-agent` (host + procs sources at 1 Hz). Goals (issue): >= 50k rows/s on the 2-core machine,
agent < 1 % of a core.

Processes (so that each CPU figure is one process's own):
  collector  `steplens-collector serve --insecure` on 127.0.0.1:<free port>, store in TMP/bench.db;
             its CPU is read from /proc/<pid>/stat (psutil) at the start and end of the window.
  emulator   this file with --_emulator: N emulated agents, each a real Spool (TMP/emu/NN/spool.db) and a
             real StreamClient, fed by one generator thread that encodes Metric records with the real
             codec (encode_records, ~1 µs per record, so no pre-encoding: the emulator stays cheap next
             to the collector) and appends batches of --batch-records. The generator keeps each spool's
             backlog at or below --max-backlog batches, so a spool never overflows (no drops), and
             otherwise runs as fast as the transport drains: the rows/s measured is the collector's
             ceiling, not an offered rate. --rate caps the offered rows/s instead.
  agent      after the ingest phase (so the two measurements do not disturb each other), a real
             `steplens-agent run --disable gpu` against the same collector: CPU seconds / wall seconds
             over --agent-seconds after a 3 s settle, and its RSS.

Series: per emulated agent 200 (16 NVML-like gpu_* metrics x gpu0..gpu7, cpu utilization/iowait x
cpu0..cpu31, 8 memory/load metrics), the names the real gpu and host sources emit. One "tick" gives
every series one sample; mono_ns per tick is max(previous + 1, time.monotonic_ns()), so time moves
strictly forward within each series (the collector rejects anything else) and never runs ahead of
the batch's send time. The agent ticks far faster than 1 Hz: the point is the collector's cost per row.

The machine is shared and noisy: the emulator and the collector share its 2 cores, so the emulator's
CPU is printed too; run twice before believing a difference under ~10 %.

    .venv/bin/python bench/ingest.py [--agents 8] [--seconds 20] [--agent-seconds 30] [--quick] [--keep]

The last line of stdout is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

GOAL_ROWS_PER_S = 50_000
GOAL_AGENT_CPU_PERCENT = 1.0
STORES = ("sqlite", "chdb")

_GPU_METRICS = ("gpu_utilization_percent", "gpu_memory_utilization_percent", "gpu_memory_used_bytes",
                "gpu_memory_free_bytes", "gpu_power_watts", "gpu_temperature_celsius",
                "gpu_memory_temperature_celsius", "gpu_sm_clock_mhz", "gpu_memory_clock_mhz",
                "gpu_energy_millijoules_total", "gpu_pcie_transmit_bytes_per_second",
                "gpu_pcie_receive_bytes_per_second", "gpu_pcie_replay_total", "gpu_ecc_corrected_errors_total",
                "gpu_ecc_uncorrected_errors_total", "gpu_clocks_event_reasons")
_HOST_METRICS = ("memory_total_bytes", "memory_available_bytes", "memory_used_bytes", "memory_cached_bytes",
                 "memory_buffers_bytes", "load1", "load5", "load15")


def bench_series() -> list[tuple[str, str]]:
    """(name, entity) of one emulated node: 128 GPU + 64 per-core CPU + 8 host series = 200."""
    out = [(m, f"gpu{g}") for g in range(8) for m in _GPU_METRICS]
    out += [(m, f"cpu{c}") for c in range(32) for m in ("cpu_utilization_percent", "cpu_iowait_percent")]
    out += [(m, "") for m in _HOST_METRICS]
    return out


# ==== emulator child process ==================================================================

class EmulatedAgent:
    """A real Spool + real StreamClient with minimal status/command handlers."""

    def __init__(self, index: int, state_dir: str, collector: str) -> None:
        from steplens.agent.spool import Spool
        from steplens.agent.transport.client import StreamClient, TransportConfig
        self.agent_id = f"bench-emu-{index:02d}"
        self.spool = Spool(os.path.join(state_dir, "spool.db"))
        self.series = bench_series()
        self.values = [random.uniform(0, 100) for _ in self.series]
        self.last_tick_mono_ns = 0
        self._collector = collector
        self._client_class, self._config_class = StreamClient, TransportConfig
        self.client = self._new_client()

    def _new_client(self):
        return self._client_class(self._config_class(self._collector, self.agent_id, insecure=True), self.spool,
                                  self.status, self.command, hostname=f"bench-{self.agent_id}",
                                  boot_id=uuid.uuid4().hex)

    def status(self, final: bool):
        from steplens.v1 import ingest_pb2 as ipb
        from steplens.v1 import records_pb2 as rpb
        st = self.spool.stats()
        return ipb.AgentStatus(
            mono_ns=time.monotonic_ns(), spool_backlog_batches=st.backlog_batches,
            spool_backlog_records=st.backlog_records, spool_backlog_bytes=st.backlog_bytes,
            records_produced=st.records_produced, records_acked=st.records_acked,
            records_dropped=st.records_dropped, mode=rpb.MODE_SENTINEL, final=final)

    def command(self, cmd):
        from steplens.v1 import ingest_pb2 as ipb
        return ipb.CommandResult(command_id=cmd.command_id, ok=False, message="bench emulator runs no commands")

    def make_batch(self, n_ticks: int) -> tuple[bytes, int, int]:
        """n_ticks samples of every series, encoded with the real codec: (payload, n_records, mono_ns)."""
        from steplens.agent.records import Metric
        from steplens.agent.transport.codec import encode_records
        items = []
        series, values = self.series, self.values
        rnd = random.random
        mono = self.last_tick_mono_ns
        for _ in range(n_ticks):
            mono = max(mono + 1, time.monotonic_ns())
            for i, (name, entity) in enumerate(series):
                v = values[i] + rnd() - 0.5
                values[i] = v
                items.append(("bench", Metric(mono, name, entity, v)))
        self.last_tick_mono_ns = mono
        return encode_records(items), len(items), mono


def _other_sources() -> list[str]:
    """Every registered source but host and procs: the issue measures the agent with those two only."""
    from steplens.agent.sources import SOURCE_PATHS
    return [name for name in SOURCE_PATHS if name not in ("host", "procs")]


def run_emulator(args) -> int:
    """Child process: connect N agents, generate until 'stop' on stdin, drain, print per-agent counts."""
    import logging
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    collector = f"127.0.0.1:{args.port}"
    agents = [EmulatedAgent(i, os.path.join(args.tmp, "emu", f"{i:02d}"), collector) for i in range(args.agents)]
    for a in agents:
        a.client.start()
    # every agent must be acknowledged (HelloAck) promptly; a refusal or a stall is a failure to report,
    # never something to retry around
    deadline = time.monotonic() + args.connect_timeout
    while not all(a.client.connected for a in agents) and time.monotonic() < deadline:
        time.sleep(0.05)
    stuck = [a for a in agents if not a.client.connected]
    if stuck:
        print(json.dumps({"event": "error", "error": f"{len(stuck)} emulated agents were not acknowledged within "
                          f"{args.connect_timeout} s", "last_errors": {a.agent_id: a.client.last_error for a in stuck}}),
              flush=True)
        return 1

    stop = threading.Event()
    gen = {"batches": 0, "records": 0, "throttled_s": 0.0, "encode_s": 0.0, "append_s": 0.0}
    n_ticks = max(1, args.batch_records // len(agents[0].series))
    per_agent_interval = 0.0
    if args.rate > 0:
        per_agent_interval = n_ticks * len(agents[0].series) * len(agents) / args.rate

    def generate() -> None:
        next_due = [time.monotonic()] * len(agents)
        while not stop.is_set():
            appended = False
            for i, a in enumerate(agents):
                if per_agent_interval and time.monotonic() < next_due[i]:
                    continue
                if a.spool.stats().backlog_batches > args.max_backlog:
                    continue
                t0 = time.perf_counter()
                payload, n, mono = a.make_batch(n_ticks)
                t1 = time.perf_counter()
                a.spool.append(payload, n, mono)
                gen["encode_s"] += t1 - t0
                gen["append_s"] += time.perf_counter() - t1
                gen["batches"] += 1
                gen["records"] += n
                next_due[i] += per_agent_interval
                appended = True
            if not appended:
                t0 = time.perf_counter()
                stop.wait(0.002)
                gen["throttled_s"] += time.perf_counter() - t0

    gen_thread = threading.Thread(target=generate, name="generator", daemon=True)
    gen_thread.start()
    print(json.dumps({"event": "ready", "series_per_agent": len(agents[0].series),
                      "records_per_batch": n_ticks * len(agents[0].series)}), flush=True)
    for line in sys.stdin:
        if line.strip() == "mark":  # the start of the measured window: reset the generator counters
            gen.update(batches=0, records=0, throttled_s=0.0, encode_s=0.0, append_s=0.0)
            print(json.dumps({"event": "marked"}), flush=True)
        elif line.strip() == "stop":
            break
    window_gen = dict(gen)
    stop.set()
    gen_thread.join(10)

    results: dict[str, dict] = {}

    def drain(a: EmulatedAgent) -> None:
        t0 = time.monotonic()
        drained = a.client.drain_and_stop(args.drain_timeout)
        st = a.spool.stats()
        results[a.agent_id] = {"drained": drained, "drain_seconds": round(time.monotonic() - t0, 2),
                               "records_produced": st.records_produced, "records_acked": st.records_acked,
                               "records_dropped": st.records_dropped, "backlog_records": st.backlog_records,
                               "connects": a.client.connects, "last_error": a.client.last_error}
        a.spool.close()
    threads = [threading.Thread(target=drain, args=(a,)) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"event": "done", "agents": results, "generator_window": window_gen}), flush=True)
    return 0


# ==== parent: orchestration and measurement =====================================================

from benchutil import Children  # noqa: E402  (bench/ is on sys.path when run as a script)


def _console_script(name: str, module: str) -> list[str]:
    path = os.path.join(os.path.dirname(sys.executable), name)
    return [path] if os.path.exists(path) else [sys.executable, "-m", module]


def _cpu_seconds(proc) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _tail(path: str, n: int = 20) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(fh.readlines()[-n:])
    except OSError:
        return ""


def _readline(stream, timeout: float, what: str) -> str:
    """One line from a child's stdout, or RuntimeError after timeout (the child may have hung)."""
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        raise RuntimeError(f"no output from {what} within {timeout:.0f} s")
    if not box[0]:
        raise RuntimeError(f"{what} exited early")
    return box[0]


def _emulator_event(proc, timeout: float, want: str, log_path: str) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        line = _readline(proc.stdout, max(1.0, deadline - time.monotonic()), "the emulator")
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if msg.get("event") == "error":
            raise RuntimeError(f"emulator: {msg}\n{_tail(log_path)}")
        if msg.get("event") == want:
            return msg


class Store:
    """Read-only view of the collector's SQLite store (WAL: never blocks the writer)."""

    def __init__(self, path: str) -> None:
        self.conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        self.conn.execute("PRAGMA busy_timeout=5000")

    def rows_stored(self, prefix: str = "bench-emu-") -> int:
        return self.conn.execute("SELECT COALESCE(SUM(records_stored), 0) FROM agents WHERE agent_id LIKE ?",
                                 (prefix + "%",)).fetchone()[0]

    def per_agent(self) -> dict[str, tuple[int, int]]:
        return {a: (s, r) for a, s, r in self.conn.execute(
            "SELECT agent_id, records_stored, records_rejected FROM agents")}

    def one(self, sql: str, *params):
        return self.conn.execute(sql, params).fetchone()[0]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def run_ingest(args, tmp: str, children: Children, collector, store: Store, port: int) -> dict:
    import psutil
    emu_log = os.path.join(tmp, "emulator.log")
    cmd = [sys.executable, os.path.abspath(__file__), "--_emulator", "--port", str(port), "--tmp", tmp,
           "--agents", str(args.agents), "--batch-records", str(args.batch_records),
           "--max-backlog", str(args.max_backlog), "--rate", str(args.rate),
           "--drain-timeout", str(args.drain_timeout), "--connect-timeout", str(args.connect_timeout)]
    with open(emu_log, "w") as log_fh:
        emu = children.start(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_fh, text=True, bufsize=1)
    emu_ps = psutil.Process(emu.pid)
    t_start = time.monotonic()
    ready = _emulator_event(emu, 30 + args.connect_timeout, "ready", emu_log)
    connect_s = time.monotonic() - t_start
    print(f"ingest: {args.agents} emulated agents connected ({ready['series_per_agent']} series each, "
          f"{ready['records_per_batch']} records per batch); warm-up {args.warmup:.0f} s", flush=True)
    time.sleep(args.warmup)

    emu.stdin.write("mark\n")
    emu.stdin.flush()
    _emulator_event(emu, 30, "marked", emu_log)
    t0 = time.monotonic()
    rows0, cpu0, ecpu0 = store.rows_stored(), _cpu_seconds(collector), _cpu_seconds(emu_ps)
    samples = []  # per-second stored rows/s, to show how steady the rate is
    last_t, last_rows = t0, rows0
    while True:
        now = time.monotonic()
        if now - t0 >= args.seconds:
            break
        time.sleep(min(1.0, args.seconds - (now - t0)))
        if collector.is_running() is False or emu.poll() is not None:
            raise RuntimeError("a child exited during the window")
        t, rows = time.monotonic(), store.rows_stored()
        samples.append((rows - last_rows) / (t - last_t))
        last_t, last_rows = t, rows
    t1 = time.monotonic()
    rows1, cpu1, ecpu1 = store.rows_stored(), _cpu_seconds(collector), _cpu_seconds(emu_ps)
    collector_rss = collector.memory_info().rss

    emu.stdin.write("stop\n")
    emu.stdin.flush()
    done = _emulator_event(emu, args.drain_timeout + 60, "done", emu_log)
    Children.stop(emu)

    wall = t1 - t0
    rows = rows1 - rows0
    cpu = cpu1 - cpu0
    gen = done["generator_window"]
    # end-to-end: everything each emulated agent produced is stored, nothing dropped or rejected
    per_agent = store.per_agent()
    lost = 0
    mismatches = []
    for agent_id, r in sorted(done["agents"].items()):
        stored, rejected = per_agent.get(agent_id, (0, 0))
        missing = r["records_produced"] - stored
        lost += max(0, missing)
        if missing or rejected or r["records_dropped"] or not r["drained"]:
            mismatches.append({"agent_id": agent_id, "produced": r["records_produced"], "stored": stored,
                               "rejected": rejected, "dropped": r["records_dropped"], "drained": r["drained"],
                               "last_error": r["last_error"]})
    produced_total = sum(r["records_produced"] for r in done["agents"].values())
    stored_total = store.rows_stored()
    metrics_rows = store.one("SELECT COUNT(*) FROM metrics m JOIN series s ON s.id = m.series_id "
                             "WHERE s.agent_id LIKE 'bench-emu-%'") if args.store == "sqlite" else None
    return {
        "wall_s": wall, "rows": rows, "rows_per_s": rows / wall if wall else 0.0, "collector_cpu_s": cpu,
        "collector_cpu_percent": 100.0 * cpu / wall, "collector_cpu_s_per_100k_rows": cpu * 1e5 / rows if rows else None,
        "collector_rss_bytes": collector_rss, "emulator_cpu_percent": 100.0 * (ecpu1 - ecpu0) / wall,
        "per_second": samples, "generator": gen, "produced_total": produced_total, "stored_total": stored_total,
        "metrics_rows": metrics_rows, "lost_records": lost, "mismatches": mismatches,
        "reconnects": sum(r["connects"] - 1 for r in done["agents"].values()),
        "drain_seconds_max": max(r["drain_seconds"] for r in done["agents"].values()),
        "rejections": store.one("SELECT COALESCE(SUM(count), 0) FROM rejections") if args.store == "sqlite" else None,
        "connect_s": connect_s,
    }


def _store_disk(kind: str, db: str, engine: str) -> dict:
    """After the collector stopped: the store's size on disk (SQLite: the file and its WAL; chdb: ClickHouse's
    parts, plus the state file) and, for chdb, its metric rows and rejections."""
    size = sum(os.path.getsize(p) for p in (db, db + "-wal") if os.path.exists(p))
    if kind != "chdb":
        return {"bytes": size}
    # in a child: chDB holds one engine directory per process, and a bench of several runs opens one per run
    code = ("import json, sys; from steplens.collector.store.clickhouse import open_ch, parse_store; "
            "ch = open_ch(parse_store(sys.argv[1])); q = lambda s: ch.query(s)[0][0]; print(json.dumps({"
            "'bytes': q(\"SELECT coalesce(sum(bytes_on_disk), 0) FROM system.parts WHERE database = 'bench' AND active\"),"
            "'metrics_rows': q(\"SELECT count() FROM bench.metrics WHERE agent_id LIKE 'bench-emu-%'\"),"
            "'rejections': q('SELECT coalesce(sum(count), 0) FROM bench.rejections')}))")
    out = subprocess.run([sys.executable, "-c", code, f"chdb://{engine}?database=bench"], capture_output=True,
                         text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"reading the chdb store's sizes failed: {out.stderr[-2000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return {"bytes": size + int(got["bytes"]), "metrics_rows": int(got["metrics_rows"]),
            "rejections": int(got["rejections"])}


def run_agent(args, tmp: str, children: Children, store: Store, port: int) -> dict:
    import psutil
    log_path = os.path.join(tmp, "agent.log")
    cmd = _console_script("steplens-agent", "steplens.agent.cli") + [
        "run", "--collector", f"127.0.0.1:{port}", "--insecure", "--node-id", "bench-agent",
        "--state-dir", os.path.join(tmp, "agent"), "--metrics-listen", ""] + [
        arg for name in _other_sources() for arg in ("--disable", name)]
    with open(log_path, "w") as log_fh:
        agent = children.start(cmd, stdout=log_fh, stderr=subprocess.STDOUT)
    ps = psutil.Process(agent.pid)
    print(f"agent: real steplens-agent (host + procs, 1 Hz), settle {args.agent_settle:.0f} s, "
          f"measure {args.agent_seconds:.0f} s", flush=True)
    time.sleep(args.agent_settle)
    if agent.poll() is not None:
        raise RuntimeError(f"steplens-agent exited with {agent.returncode}:\n{_tail(log_path)}")

    def stored() -> int:
        return store.one("SELECT COALESCE(SUM(records_stored), 0) FROM agents WHERE agent_id = 'bench-agent'")
    t0, cpu0, rows0 = time.monotonic(), _cpu_seconds(ps), stored()
    time.sleep(args.agent_seconds)
    if agent.poll() is not None:
        raise RuntimeError(f"steplens-agent exited with {agent.returncode}:\n{_tail(log_path)}")
    t1, cpu1, rows1 = time.monotonic(), _cpu_seconds(ps), stored()
    mem = ps.memory_info()
    threads = ps.num_threads()
    rc = Children.stop(agent, 20.0)
    wall = t1 - t0
    return {"wall_s": wall, "cpu_s": cpu1 - cpu0, "cpu_percent_of_core": 100.0 * (cpu1 - cpu0) / wall,
            "rss_bytes": mem.rss, "threads": threads, "rows_per_s": (rows1 - rows0) / wall, "exit_code": rc}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=8, help="emulated agents (default 8)")
    p.add_argument("--seconds", type=float, default=20.0, help="measured ingest window (default 20)")
    p.add_argument("--warmup", type=float, default=3.0, help="ingest warm-up before the window (default 3)")
    p.add_argument("--agent-seconds", type=float, default=30.0, help="real-agent CPU window (default 30; 0 skips)")
    p.add_argument("--agent-settle", type=float, default=3.0, help="real-agent start-up before its window")
    p.add_argument("--batch-records", type=int, default=2000, help="records per spooled batch (default 2000)")
    p.add_argument("--max-backlog", type=int, default=16, help="per-spool backlog (batches) above which the "
                   "generator waits (default 16)")
    p.add_argument("--rate", type=float, default=0.0, help="offered rows/s over all agents (default 0: as fast "
                   "as the collector takes them)")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="seconds to drain the spools at the end")
    p.add_argument("--connect-timeout", type=float, default=30.0, help="seconds for every emulated agent to be "
                   "acknowledged before the run fails (default 30)")
    p.add_argument("--store", default="sqlite", help="sqlite (default), chdb (telemetry in ClickHouse's engine "
                   "inside the collector), or both comma-separated (sqlite,chdb): side by side in one run")
    p.add_argument("--rounds", type=int, default=1, help="with several stores: rounds, each store once a round, "
                   "in ABBA order (default 1); the real agent is measured after the last run only")
    p.add_argument("--quick", action="store_true", help="smoke test: 5 s ingest, 5 s agent, 1 s warm-up")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (store, spools, logs)")
    p.add_argument("--tmp-dir", help="parent of the temporary directory (default: the system's)")
    p.add_argument("--collector-prefix", default="", help="command prefix for the collector, e.g. "
                   "'py-spy record -o prof.svg --' (profilers cost CPU on this 2-core box)")
    p.add_argument("--_emulator", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._emulator:
        return run_emulator(args)
    if args.quick:
        args.seconds, args.agent_seconds, args.warmup = 5.0, 5.0, 1.0
    if args.agents < 1 or args.seconds <= 0 or args.batch_records < 1:
        p.error("--agents, --seconds and --batch-records must be positive")

    stores = [x.strip() for x in args.store.split(",") if x.strip()]
    bad = [x for x in stores if x not in STORES]
    if not stores or bad:
        p.error(f"--store: one or more of {', '.join(STORES)} (comma-separated), not {args.store!r}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    # a SIGTERM to the bench still runs each run's finally (children stopped, tmp removed)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    runs: dict[str, list[dict]] = {s: [] for s in stores}
    order = [s for r in range(args.rounds) for s in (stores if r % 2 == 0 else stores[::-1])]   # ABBA...
    for i, store_kind in enumerate(order):
        if len(order) > 1:
            print(f"\n##### run {i + 1} of {len(order)}: store {store_kind}", flush=True)
        head = run_store(args, store_kind, agent=args.agent_seconds > 0 and i == len(order) - 1)
        if head is None:
            return 1
        runs[store_kind].append(head)
    if len(order) == 1:
        print(json.dumps(runs[stores[0]][0]), flush=True)
        return 0 if runs[stores[0]][0]["lost_records"] == 0 else 1
    # side by side: the median of each store's runs, and their ratio to the first store's
    print(f"\n== side by side, {args.rounds} round(s) in the order {' '.join(order)} ==")
    keys = ("rows_per_s", "collector_cpu_s_per_100k_rows", "store_bytes_per_record", "collector_rss_bytes")
    summary = {"agents": args.agents, "window_seconds": args.seconds, "rounds": args.rounds, "order": order}
    for s_kind in stores:
        med = {k: statistics.median(r[k] for r in runs[s_kind]) for k in keys}
        lost = sum(r["lost_records"] for r in runs[s_kind])
        print(f"{s_kind:<8} rows/s {med['rows_per_s']:>10,.0f} (runs: "
              f"{', '.join(format(r['rows_per_s'], ',') for r in runs[s_kind])}); CPU s per 100k rows "
              f"{med['collector_cpu_s_per_100k_rows']:.3f}; {med['store_bytes_per_record']:.1f} B per record on disk; "
              f"RSS {med['collector_rss_bytes'] / 2**20:.0f} MiB; lost {lost}")
        for k in keys:
            summary[f"{s_kind}_{k}"] = round(med[k], 3) if k != "rows_per_s" else round(med[k])
        summary[f"{s_kind}_lost_records"] = lost
    base = stores[0]
    for s_kind in stores[1:]:
        summary[f"{s_kind}_over_{base}_rows_per_s_ratio"] = round(
            summary[f"{s_kind}_rows_per_s"] / max(1, summary[f"{base}_rows_per_s"]), 3)
        summary[f"{s_kind}_over_{base}_cpu_per_row_ratio"] = round(
            summary[f"{s_kind}_collector_cpu_s_per_100k_rows"] / max(1e-9, summary[f"{base}_collector_cpu_s_per_100k_rows"]), 3)
    summary["goal_rows_per_s"] = GOAL_ROWS_PER_S
    print(json.dumps(summary), flush=True)
    return 0 if all(summary[f"{s}_lost_records"] == 0 for s in stores) else 1


def run_store(args, store_kind: str, agent: bool) -> dict | None:
    """One collector on store_kind: the ingest window, then (agent) the real agent's cost; its headline figures,
    or None after printing why it failed."""
    args = argparse.Namespace(**dict(vars(args), store=store_kind))
    import psutil
    tmp = tempfile.mkdtemp(prefix="steplens-bench-", dir=args.tmp_dir)
    children = Children()
    try:
        db = os.path.join(tmp, "bench.db")
        col_log = os.path.join(tmp, "collector.log")
        cmd = args.collector_prefix.split() + _console_script("steplens-collector", "steplens.collector.cli.serve") + [
            "serve", "--db", db, "--listen", "127.0.0.1:0", "--insecure", "--log-level", "warning"]
        engine = os.path.join(tmp, "chdb")
        if store_kind == "chdb":   # the telemetry in ClickHouse (chDB, in the collector's process), state in db
            cmd += ["--store", f"chdb://{engine}?database=bench"]
        with open(col_log, "w") as log_fh:
            col = children.start(cmd, stdout=subprocess.PIPE, stderr=log_fh, text=True)
        port = 0
        while not port:
            line = _readline(col.stdout, 60, "the collector")
            if "listening on port" in line:
                port = int(line.rsplit(" ", 1)[1])
        # with a prefix (a profiler), the collector is the prefix's child: measure that process
        col_ps = psutil.Process(col.pid)
        if args.collector_prefix:
            kids = [k for k in col_ps.children(recursive=True) if "steplens" in " ".join(k.cmdline())]
            col_ps = kids[0] if kids else col_ps
        threading.Thread(target=lambda: [None for _ in col.stdout], daemon=True).start()
        store = Store(db)
        print(f"collector: pid {col_ps.pid}, 127.0.0.1:{port}, store {db}", flush=True)

        ing = run_ingest(args, tmp, children, col_ps, store, port)
        ag = run_agent(args, tmp, children, store, port) if agent else None
        Children.stop(col)
        with open(col_log, errors="replace") as fh:
            refused = sum("refused stream" in line for line in fh)
        disk = _store_disk(store_kind, db, engine)
        if store_kind == "chdb":
            ing["metrics_rows"], ing["rejections"] = disk["metrics_rows"], disk["rejections"]

        gen = ing["generator"]
        per_s = ing["per_second"]
        print()
        print(f"== ingest: {args.agents} emulated agents, {ing['wall_s']:.1f} s window, "
              f"{os.cpu_count()} CPUs ==")
        print(f"stored rows/s           {ing['rows_per_s']:>12,.0f}   (goal {GOAL_ROWS_PER_S:,}; "
              f"{ing['rows']:,} rows in the window)")
        print(f"  per-second p10/p50/p90 {_percentile(per_s, .1):>10,.0f} / {_percentile(per_s, .5):,.0f} / "
              f"{_percentile(per_s, .9):,.0f}")
        print(f"collector CPU           {ing['collector_cpu_s']:>12.2f} s = {ing['collector_cpu_percent']:.0f} % "
              f"of one core; {ing['collector_cpu_s_per_100k_rows'] or 0:.2f} CPU s per 100k rows; "
              f"RSS {ing['collector_rss_bytes'] / 2**20:.0f} MiB")
        print(f"emulator CPU            {ing['emulator_cpu_percent']:>12.0f} % of one core (encode "
              f"{gen['encode_s']:.1f} s, spool append {gen['append_s']:.1f} s, generator waiting on "
              f"backlog {gen['throttled_s']:.1f} s of {ing['wall_s']:.1f} s)")
        print(f"end-to-end              produced {ing['produced_total']:,}, stored {ing['stored_total']:,}, "
              f"metrics rows {ing['metrics_rows']:,}, lost {ing['lost_records']}, rejected "
              f"{ing['rejections']}, reconnects {ing['reconnects']}, drain {ing['drain_seconds_max']:.1f} s")
        for m in ing["mismatches"]:
            print(f"  MISMATCH {m}")
        print(f"store                   {store_kind}: {disk['bytes'] / 2**20:.1f} MiB on disk, "
              f"{disk['bytes'] / max(1, ing['stored_total']):.1f} B per stored record")
        print(f"connect                 {ing['connect_s']:.1f} s for all emulated agents to be acked; collector "
              f"refused {refused} stream(s) over the run")
        if ag is not None:
            print(f"== real agent (host + procs at 1 Hz), {ag['wall_s']:.1f} s ==")
            print(f"agent CPU               {ag['cpu_percent_of_core']:>12.3f} % of one core "
                  f"(goal < {GOAL_AGENT_CPU_PERCENT}); {ag['cpu_s']:.2f} CPU s")
            print(f"agent RSS               {ag['rss_bytes'] / 2**20:>12.1f} MiB, {ag['threads']} threads, "
                  f"{ag['rows_per_s']:.0f} rows/s stored, exit code {ag['exit_code']}")
        if args.keep:
            print(f"kept {tmp}")
        headline = {
            "store": store_kind, "agents": args.agents, "window_seconds": round(ing["wall_s"], 2),
            "store_bytes_per_record": round(disk["bytes"] / max(1, ing["stored_total"]), 1),
            "rows_per_s": round(ing["rows_per_s"]), "rows_stored": ing["rows"],
            "collector_cpu_s_per_100k_rows": round(ing["collector_cpu_s_per_100k_rows"] or 0, 3),
            "collector_cpu_percent": round(ing["collector_cpu_percent"], 1),
            "collector_rss_bytes": ing["collector_rss_bytes"],
            "emulator_cpu_percent": round(ing["emulator_cpu_percent"], 1),
            "lost_records": ing["lost_records"], "rejected_records": ing["rejections"],
            "agent_cpu_percent_of_core": round(ag["cpu_percent_of_core"], 3) if ag else None,
            "agent_rss_bytes": ag["rss_bytes"] if ag else None,
            "agent_rows_per_s": round(ag["rows_per_s"], 1) if ag else None,
            "collector_refused_streams": refused,
            "goal_rows_per_s": GOAL_ROWS_PER_S, "goal_agent_cpu_percent": GOAL_AGENT_CPU_PERCENT,
        }
        return headline if not ing["mismatches"] else dict(headline, lost_records=max(1, headline["lost_records"]))
    except RuntimeError as exc:
        print(f"bench/ingest.py: {exc}", file=sys.stderr)
        for name in ("collector.log", "emulator.log", "agent.log"):
            tail = _tail(os.path.join(tmp, name))
            if tail:
                print(f"--- {name} (tail) ---\n{tail}", file=sys.stderr)
        return None
    finally:
        children.stop_all()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
