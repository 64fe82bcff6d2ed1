"""The agent's footprint: memory (RSS, and how it moves over time), CPU with no workload, CPU with an 8-rank job in
sentinel mode, and each source's share of both.

    sudo .venv/bin/python bench/agent_footprint.py                 # ~8 min: idle 120 s, job 120 s, per-source RSS
    sudo .venv/bin/python bench/agent_footprint.py --quick         # ~2 min smoke run
    sudo .venv/bin/python bench/agent_footprint.py --soak-minutes 120 --no-job --no-per-source   # RSS over hours
    sudo .venv/bin/python bench/agent_footprint.py --agent "env PYTHONPATH=/tmp/old .venv/bin/python -m \
        steplens.agent.cli"      # another checkout's agent (before/after; /tmp/old/steplens -> that checkout)

What runs: a real collector (loopback, SQLite in a temporary directory) and a real `steplens-agent run` with every
source enabled (the default config; flightrec/iters/kineto pointed at this run's runtime directory). Root is
needed for the eBPF sources; without it they are down and the figures say so (`sources_up`).

- **RSS**: /proc/PID/status (VmRSS, RssAnon, RssFile) every second through the idle window (and the soak); the
  headline is the median over the window; `rss_growth_mb_per_h` is the least-squares slope over the window after
  the first 30 s (so start-up allocations do not read as growth). The agent's compile helpers (agent/ebpf/build.py)
  are separate, short-lived processes: their peak is printed apart (`helper_peak_rss_mb`, polled every 50 ms).
- **Idle CPU**: the agent's utime+stime (/proc/PID/stat) over the idle window, in % of one core; per thread by
  its kernel-visible name (sources run on threads named `sl-<source>`, agent/governor.py name_native_thread).
- **CPU with a job**: an 8-rank (`--ranks`) torch.distributed gloo job launched with `steplens-agent env` (the
  bootstrap: Flight Recorder, iteration anchors), a small MLP with an all_reduce per step and a 20 ms pause, so
  the job leaves the 2-core machine some room; the agent's CPU over `--job-seconds` while it runs, and per thread.
- **Per-source RSS** (`--per-source`): an agent with only that source enabled, RSS after `--settle` seconds,
  minus an agent with no source enabled (the runtime: Python, gRPC, spool, transport).

The last stdout line is one JSON object with the headline figures.
Goals (issue 19): RSS <= 150 MB with every source up, steady; idle <= 0.5 % of a core; with an 8-rank job in
sentinel mode <= 1 %.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchutil import Children, cpu_ticks, threads

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(REPO, ".venv", "bin")
PY = os.path.join(VENV, "python")
CLK_TCK = os.sysconf("SC_CLK_TCK")
SOURCES = ("procs", "host", "gpu", "tcpinfo", "netflows", "sched", "gpuprobes", "pystacks", "flightrec", "iters",
           "kineto", "nccltopo")

JOB = r'''
import os, sys, time
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
release = sys.argv[1]
model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 128)
while not os.path.exists(release):
    opt.zero_grad()
    model(x).square().mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    time.sleep(0.02)
dist.barrier()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_pid(launcher: int, timeout: float = 30) -> int:
    """The agent's PID below `unshare --fork` (its first descendant running steplens-agent)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        todo = [launcher]
        while todo:
            pid = todo.pop()
            try:
                if pid != launcher and b"steplens" in open(f"/proc/{pid}/cmdline", "rb").read():
                    return pid
                for tid in os.listdir(f"/proc/{pid}/task"):
                    todo += [int(c) for c in open(f"/proc/{pid}/task/{tid}/children").read().split()]
            except OSError:
                pass
        time.sleep(0.1)
    raise RuntimeError(f"no agent process below {launcher}")


def rss(pid: int) -> dict[str, float]:
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(line.split()[1]) / 1024
    return out


def smaps_groups(pid: int) -> dict[str, float]:
    """RSS (MB) by mapping: each file by its name, anonymous memory as "[anon]" (Python's heap and arenas, thread
    stacks, malloc arenas), "[heap]", BPF maps as "[bpf-map]"."""
    out: dict[str, float] = {}
    cur = "[anon]"
    with open(f"/proc/{pid}/smaps") as fh:
        for line in fh:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):
                parts = line.split()
                name = parts[5] if len(parts) > 5 else "[anon]"
                cur = "[bpf-map]" if "bpf-map" in name else os.path.basename(name) if name.startswith("/") else name
            elif first == "Rss:":
                out[cur] = out.get(cur, 0.0) + int(line.split()[1]) / 1024
    return {k: round(v, 1) for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v >= 0.5}


def slope_per_hour(samples: list[tuple[float, float]]) -> float:
    if len(samples) < 3:
        return 0.0
    ts = [t for t, _ in samples]
    ys = [y for _, y in samples]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - mt) ** 2 for t in ts)
    return 0.0 if den == 0 else sum((t - mt) * (y - my) for t, y in samples) / den * 3600


class HelperWatch:
    """Peak RSS of the agent's compile helpers (children running steplens.agent.ebpf.build)."""

    def __init__(self, agent_pid: int) -> None:
        self.pid, self.peak, self.seen = agent_pid, 0.0, 0
        self._stop = threading.Event()
        self._pids: set[int] = set()
        self._th = threading.Thread(target=self._run, daemon=True)
        self._th.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            kids = []
            try:
                for tid in os.listdir(f"/proc/{self.pid}/task"):  # helpers are children of source threads
                    with open(f"/proc/{self.pid}/task/{tid}/children") as fh:
                        kids += fh.read().split()
            except OSError:
                pass
            for k in kids:
                try:
                    cmd = open(f"/proc/{k}/cmdline", "rb").read()
                    if b"steplens.agent.ebpf.build" in cmd:
                        self._pids.add(int(k))
                        self.peak = max(self.peak, rss(int(k))["VmRSS"])
                except (OSError, KeyError):
                    pass
            self.seen = len(self._pids)

    def stop(self) -> None:
        self._stop.set()
        self._th.join()


class Bench:
    def __init__(self, args, tmp: str, kids: Children) -> None:
        self.args, self.tmp, self.kids = args, tmp, kids
        self.runtime = os.path.join(tmp, "fr")
        self.ksock = os.path.join(tmp, "k")
        for d in (self.runtime, self.ksock):
            os.makedirs(d, exist_ok=True)
        self.collector = f"127.0.0.1:{free_port()}"
        self.metrics = f"127.0.0.1:{free_port()}"   # the collector's /metrics: its detectors' fetches
        ctoml = os.path.join(tmp, "collector.toml")
        with open(ctoml, "w") as fh:  # sentinel mode throughout: no deep dive started by a finding on the job
            fh.write("[deep_dive]\nenabled = false\n")
            if args.collector_fetch_cache_rows is not None:
                fh.write(f"[analysis]\nfetch_cache_rows = {args.collector_fetch_cache_rows}\n")
        kids.start([os.path.join(VENV, "steplens-collector"), "serve", "--config", ctoml, "--db",
                    os.path.join(tmp, "c.db"), "--listen", self.collector, "--insecure", "--metrics-listen",
                    self.metrics],
                   stdout=subprocess.DEVNULL,
                   stderr=open(os.path.join(tmp, "collector.log"), "ab"))
        self.n = 0

    def fetches(self) -> dict:
        """The collector's counters of what its detectors fetched from the agents (asks, rows from the agents,
        rows it had kept); {} when /metrics cannot be read."""
        import urllib.request
        try:
            text = urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=10).read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            if line.startswith("steplens_collector_detail_fetch_asks_total "):
                out["asks"] = int(float(line.split()[-1]))
            elif line.startswith("steplens_collector_detail_fetch_rows_total{"):
                out["rows_" + line.split('"')[1]] = int(float(line.split()[-1]))
        return out

    def toml(self, only: tuple[str, ...] | None) -> str:
        path = os.path.join(self.tmp, f"agent{self.n}.toml")
        fr = "".join(f"{kv}\n" for kv in self.args.flightrec)
        lines = [f'[sources.flightrec]\n{fr}socket_dirs = ["{self.runtime}"]',
                 f'[sources.kineto]\nsocket_dir = "{self.ksock}"']
        if only is not None:
            lines = []
            for s in SOURCES:
                extra = ""
                if s == "flightrec":
                    extra = f'{fr}socket_dirs = ["{self.runtime}"]\n'
                if s == "kineto":
                    extra = f'socket_dir = "{self.ksock}"\n'
                lines.append(f"[sources.{s}]\n{extra}enabled = {'true' if s in only else 'false'}")
        if self.args.cpu_budget_fraction:
            lines.insert(0, f"[agent]\ncpu_budget_fraction = {self.args.cpu_budget_fraction}")
        with open(path, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        return path

    def start_agent(self, only: tuple[str, ...] | None = None) -> tuple[subprocess.Popen, str]:
        self.n += 1
        node = f"fp{self.n}"
        state = os.path.join(self.tmp, f"state{self.n}")
        cmd = shlex.split(self.args.agent) + ["run", "--config", self.toml(only), "--collector", self.collector,
                                               "--insecure", "--node-id", node, "--state-dir", state,
                                               "--metrics-listen", ""]
        if self.args.pidns:
            cmd = ["unshare", "--pid", "--fork", "--mount-proc"] + cmd
        p = self.kids.start(cmd, stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.tmp, f"{node}.log"), "ab"))
        p.agent_pid = agent_pid(p.pid) if self.args.pidns else p.pid
        return p, node

    def nodes(self) -> list:
        out = subprocess.run([os.path.join(VENV, "steplens"), "--collector", self.collector, "--insecure", "nodes",
                              "--json"], capture_output=True, text=True, timeout=60)
        try:
            return json.loads(out.stdout)
        except ValueError:
            return []

    def wait_up(self, node: str, p: subprocess.Popen, want: tuple[str, ...], timeout: float = 120) -> dict:
        """Wait until the agent reports every source in `want` started (up, or down with a reason)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise RuntimeError(f"agent {node} exited with {p.returncode}; see {self.tmp}/{node}.log")
            for n in self.nodes():
                src = n.get("sources", {}) if n.get("node_id") == node else {}
                if src and all(s in src and (src[s].get("up") or src[s].get("reason")) for s in want):
                    return src
            time.sleep(0.5)
        raise RuntimeError(f"agent {node}: sources not reported within {timeout} s")

    def window(self, pid: int, seconds: float) -> dict:
        """CPU (% of one core), per thread, and RSS samples over `seconds`."""
        c0, t0, th0 = cpu_ticks(pid), time.monotonic(), threads(pid)
        samples = []
        end = t0 + seconds
        while time.monotonic() < end:
            samples.append((time.monotonic() - t0, rss(pid)))
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))
        c1, t1, th1 = cpu_ticks(pid), time.monotonic(), threads(pid)
        wall = t1 - t0
        per_thread = {k: round(100.0 * (th1.get(k, 0) - th0.get(k, 0)) / CLK_TCK / wall, 3) for k in th1}
        return {"cpu_percent": 100.0 * (c1 - c0) / CLK_TCK / wall, "wall_s": wall,
                "per_thread": {k: v for k, v in sorted(per_thread.items(), key=lambda kv: -kv[1]) if v > 0},
                "rss": samples}


def launch_job(b: Bench, ranks: int, kids: Children) -> tuple[list[subprocess.Popen], str]:
    script = os.path.join(b.tmp, "job.py")
    with open(script, "w") as fh:
        fh.write(JOB)
    out = subprocess.run(shlex.split(b.args.agent) + ["env", "--format", "json", "--runtime-dir", b.runtime,
                                                       "--config", b.toml(None)], capture_output=True, text=True)
    env_extra = json.loads(out.stdout)
    env_extra["KINETO_IPC_SOCKET_DIR"] = b.ksock
    port = free_port()
    release = os.path.join(b.tmp, f"release-{port}")
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", STEPLENS_JOB="bench-footprint",
                   **env_extra)
        procs.append(kids.start([PY, script, release], env=env, stdout=subprocess.DEVNULL,
                                stderr=open(os.path.join(b.tmp, f"rank{rank}.err"), "ab")))
    return procs, release


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--idle-seconds", type=float, default=120)
    ap.add_argument("--job-seconds", type=float, default=120)
    ap.add_argument("--settle", type=float, default=20, help="seconds after start-up before measuring")
    ap.add_argument("--idle-settle", type=float, default=70, help="seconds after start-up before the idle window "
                    "(the collector's clock probes slow to their steady rate 60 s into a stream)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--soak-minutes", type=float, default=0, help="extend the idle window (RSS growth over hours)")
    ap.add_argument("--no-job", action="store_true")
    ap.add_argument("--no-per-source", action="store_true")
    ap.add_argument("--agent", default=os.path.join(VENV, "steplens-agent"), help="agent command (before/after runs)")
    ap.add_argument("--quick", action="store_true", help="20 s windows, 10 s settle, 4 ranks, no per-source RSS")
    ap.add_argument("--pidns", action="store_true", help="run the agent in a PID namespace of its own (unshare): it "
                    "sees no other process as a workload, so other jobs on the machine do not disturb an idle soak")
    ap.add_argument("--flightrec", action="append", default=[], metavar="KEY=VALUE",
                    help="a [sources.flightrec] setting of the agents, TOML (e.g. 'read=\"socket\"')")
    ap.add_argument("--only", default="", help="comma-separated sources for the main agent (default: every one)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--collector-fetch-cache-rows", type=int, default=None,
                    help="the collector's [analysis] fetch_cache_rows (0: its detectors' fetches are not kept; "
                         "default: the collector's)")
    ap.add_argument("--cpu-budget-fraction", type=float, default=0.0,
                    help="the agent's sentinel CPU budget ([agent] cpu_budget_fraction, a share of the host's CPUs; "
                         "0: the default, not governed)")
    args = ap.parse_args()
    if args.quick:
        args.idle_seconds = args.job_seconds = 20
        args.settle, args.idle_settle, args.ranks, args.no_per_source = 10, 10, 4, True
    if args.soak_minutes:
        args.idle_seconds = max(args.idle_seconds, args.soak_minutes * 60)

    tmp = tempfile.mkdtemp(prefix="steplens-footprint-")
    kids = Children()
    result: dict = {"root": os.geteuid() == 0}
    try:
        b = Bench(args, tmp, kids)
        # -- every source, no workload --
        only = tuple(x for x in args.only.split(",") if x) or None
        agent, node = b.start_agent(only)
        helpers = HelperWatch(agent.agent_pid)
        src = b.wait_up(node, agent, only or SOURCES)
        up = sorted(s for s, v in src.items() if v.get("up"))
        print(f"agent {node} pid {agent.agent_pid}: up {', '.join(up)}", flush=True)
        for s, v in sorted(src.items()):
            if not v.get("up"):
                print(f"  down: {s}: {v.get('reason')}", flush=True)
        time.sleep(args.idle_settle)
        helpers.stop()
        idle = b.window(agent.agent_pid, args.idle_seconds)
        vm = [r["VmRSS"] for _, r in idle["rss"]]
        anon = [r["RssAnon"] for _, r in idle["rss"]]
        filem = [r["RssFile"] for _, r in idle["rss"]]
        growth = slope_per_hour([(t, r["VmRSS"]) for t, r in idle["rss"] if t >= 30] or
                                [(t, r["VmRSS"]) for t, r in idle["rss"]])
        groups = smaps_groups(agent.agent_pid)
        print("  RSS by mapping (MB): " + ", ".join(f"{k} {v}" for k, v in list(groups.items())[:12]), flush=True)
        result["rss_by_mapping_mb"] = dict(list(groups.items())[:12])
        src_idle = {s: v.get("cpu_cores", 0.0) * 100 for s, v in
                    next((n.get("sources", {}) for n in b.nodes() if n.get("node_id") == node), {}).items()}
        print(f"\nidle, every source ({args.idle_seconds:.0f} s): CPU {idle['cpu_percent']:.3f} % of a core; "
              f"RSS median {statistics.median(vm):.1f} MB (anon {statistics.median(anon):.1f}, file "
              f"{statistics.median(filem):.1f}), min {min(vm):.1f}, max {max(vm):.1f}, growth "
              f"{growth:+.2f} MB/h; compile helpers: {helpers.seen}, peak RSS {helpers.peak:.1f} MB", flush=True)
        print("  per thread (% of a core): " + ", ".join(f"{k} {v:.3f}" for k, v in idle["per_thread"].items()))
        result.update(sources_up=up, rss_mb=round(statistics.median(vm), 1),
                      rss_anon_mb=round(statistics.median(anon), 1), rss_file_mb=round(statistics.median(filem), 1),
                      rss_max_mb=round(max(vm), 1), rss_growth_mb_per_h=round(growth, 2),
                      idle_cpu_percent=round(idle["cpu_percent"], 3), idle_per_thread_percent=idle["per_thread"],
                      idle_per_source_percent={k: round(v, 3) for k, v in src_idle.items()},
                      helper_peak_rss_mb=round(helpers.peak, 1), helpers_run=helpers.seen)

        # -- with an N-rank job in sentinel mode --
        if not args.no_job:
            try:
                import torch  # noqa: F401
                have_torch = True
            except ImportError:
                have_torch = False
            if not have_torch:
                print("no torch: the job phase is skipped")
            else:
                procs, release = launch_job(b, args.ranks, kids)
                time.sleep(args.settle)  # ranks up, rendezvous done, the agent has found them
                dead = [p.returncode for p in procs if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"job ranks exited early: {dead}; see {tmp}/rank*.err")
                f0 = b.fetches()
                job = b.window(agent.agent_pid, args.job_seconds)
                f1 = b.fetches()
                fetched = {k: v - f0.get(k, 0) for k, v in f1.items()}
                job_cpu = sum(cpu_ticks(p.pid) for p in procs if p.poll() is None)
                src_job = {s: v.get("cpu_cores", 0.0) * 100 for s, v in
                           next((n.get("sources", {}) for n in b.nodes() if n.get("node_id") == node), {}).items()}
                open(release, "w").close()
                for p in procs:
                    try:
                        p.wait(60)
                    except subprocess.TimeoutExpired:
                        p.kill()
                vmj = [r["VmRSS"] for _, r in job["rss"]]
                print(f"\n{args.ranks}-rank gloo job, sentinel mode ({args.job_seconds:.0f} s): agent CPU "
                      f"{job['cpu_percent']:.3f} % of a core; RSS median {statistics.median(vmj):.1f} MB, max "
                      f"{max(vmj):.1f}; the job's ranks used {job_cpu / CLK_TCK:.0f} CPU s in all", flush=True)
                print("  per thread (% of a core): " + ", ".join(f"{k} {v:.3f}" for k, v in job["per_thread"].items()))
                print("  per source, governor's last period (% of a core): " +
                      ", ".join(f"{k} {v:.3f}" for k, v in sorted(src_job.items(), key=lambda kv: -kv[1])))
                print(f"  the collector's detectors fetched from the agent: {fetched.get('asks', '?')} asks, "
                      f"{fetched.get('rows_agents', '?')} rows from it, {fetched.get('rows_kept', '?')} rows it had "
                      "kept ([analysis] fetch_cache_rows)")
                result.update(job_fetch_asks=fetched.get("asks"), job_fetch_rows_from_agents=fetched.get("rows_agents"),
                              job_fetch_rows_kept=fetched.get("rows_kept"))
                result.update(job_ranks=args.ranks, job_cpu_percent=round(job["cpu_percent"], 3),
                              job_rss_mb=round(statistics.median(vmj), 1), job_per_thread_percent=job["per_thread"],
                              job_per_source_percent={k: round(v, 3) for k, v in src_job.items()})
        Children.stop(agent)

        # -- per-source RSS --
        if not args.no_per_source:
            base_agent, base_node = b.start_agent(only=())
            time.sleep(args.settle / 2)
            base = rss(base_agent.agent_pid)["VmRSS"]
            Children.stop(base_agent)
            per = {}
            for s in SOURCES:
                a, n = b.start_agent(only=(s,))
                try:
                    st = b.wait_up(n, a, (s,))
                    time.sleep(args.settle / 2)
                    per[s] = round(rss(a.agent_pid)["VmRSS"] - base, 1)
                    state = "up" if st.get(s, {}).get("up") else "down"
                finally:
                    Children.stop(a)
                print(f"  {s:10s} {per[s]:+7.1f} MB ({state})", flush=True)
            print(f"per-source RSS over an agent with no source ({base:.1f} MB): " +
                  ", ".join(f"{k} {v:+.1f}" for k, v in per.items()), flush=True)
            result.update(runtime_rss_mb=round(base, 1), per_source_rss_mb=per)
    finally:
        kids.stop_all()
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    result["cpu_budget_fraction"] = args.cpu_budget_fraction
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
