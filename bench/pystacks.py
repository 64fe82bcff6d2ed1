"""Python-stack sampler benchmark: our out-of-process reader next to py-spy, on the same target.

Prints, side by side in one run: our CPU µs per sample vs py-spy's (`py-spy record --nonblocking`)
and their ratio at 10, 100, 250 and 1,000 Hz, the achieved rates (and our ceiling when asked for
5 kHz), the target's slowdown at each rate (interleaved runs, medians), and how often the target's
threads were seen stopped while sampling. Goals (issue): <= 1/5 of py-spy's CPU per sample at every
rate, >= 2 kHz on one process, target slowdown < 0.5 % at 100 Hz, zero time stopped in the default mode.

Processes:
  target   a CPU-bound CPython program (pyenv 3.12 by default, --python): one busy main thread
           whose stack is ~26 frames deep (<module> -> main -> work_loop -> descend x (depth+1) ->
           leaf) plus --sleepers threads blocked in Event.wait a few frames down. It counts work
           units and writes "monotonic_s units" to stdout every 100 ms, so its slowdown is the drop
           in throughput it measured itself. Pinned to CPU 0.
  samplers `steplens-agent record PID --idle --rate R --duration S -o TMP/ours.txt` and
           `py-spy record --nonblocking --idle --rate R --duration S --pid PID -o TMP/pyspy.raw
           --format raw`, one at a time, pinned to CPU 1 (as is this bench), so a sampler's own CPU
           does not come out of the target's core: the slowdown is interference (memory reads,
           cache, time stopped), not a stolen core. CPU of a sampler = ru_utime + ru_stime from
           os.wait4 on that child.

CPU per sample. A run's whole CPU includes a fixed start-up cost (ours: a Python interpreter and
its imports, ~0.2 CPU s; py-spy: reading the target's binaries) that has nothing to do with the
sampling loop of a long-running agent. So each round also runs every tool/rate for 1 s, and the
headline is the marginal cost: (CPU_long - CPU_short) / (samples_long - samples_short), median
over rounds. Each rate has its own window (--windows; 45 s at 10 Hz, so that even there a long run
has some 450 samples more than its short one). The whole-command figure (CPU / samples of the long
run) and our own in-process figure (process_time around `record`'s loop, plus writing the output,
both printed by `record`: no start-up in it, so it is the steadier one) are shown next to it.

Samples. Both tools sample every thread of the target each tick; --idle makes both report
idle threads, so py-spy's "Samples: N" (one per thread stack) / thread count = ticks, and our
"N samples" is ticks already. A "sample" below is one tick: all threads of the process.

Slowdown. Each round: baseline (no sampler), then ours and py-spy at 10, 100, 250 and 1,000 Hz
(reversed in odd rounds), then the short runs; one more baseline after the last round. A run's
throughput is measured over [spawn + 0.75 s, spawn + 0.75 s + its window], inside its sampling period
(the sampler runs the window + 1 s); slowdown = 1 - throughput / mean(baseline before, baseline
after), twice:
  wall  units per second: what the job loses, stops included, but also any CPU time that other
        processes take from the target's core (on a busy shared machine this dominates; the busy
        thread's share of its core is printed per run);
  cpu   units per CPU second of the busy thread (its thread_time): immune to other processes taking
        its core, still sensitive to cache/memory interference from the sampler; blind to stops,
        which the stopped-state check below covers.
Our `record` skips ticks it is late for ("never burst"); py-spy catches up late ticks in a burst,
so its achieved rate reads as the asked one even when it fell behind.

Stopped. Our default mode never stops the target (no ptrace; PythonProcess.stopped_ns_total only
grows with --stop). It is also checked: during every sampler run the bench reads
/proc/PID/task/TID/stat of each target thread every 5 ms and counts observations in state t/T.

    .venv/bin/python bench/pystacks.py                       # 2 rounds, 45/8/5/4 s windows (~5.5 min)
    .venv/bin/python bench/pystacks.py --quick               # 1 round, 10/3/2/2 s windows (~2.5 min)
    .venv/bin/python bench/pystacks.py --python /root/.pyenv/versions/3.11.7/bin/python3 --keep
    .venv/bin/python bench/pystacks.py --profile 2000        # then cProfile 2000 PythonProcess.sample()
    .venv/bin/python bench/pystacks.py --agent "python /tmp/old_agent.py"   # another build of ours (A/B)

The machine is shared and noisy (2 cores): the baselines' spread is printed; a slowdown inside it
is noise. The last line of stdout is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

GOAL_CPU_RATIO = 0.2
GOAL_MAX_RATE_HZ = 2000
GOAL_SLOWDOWN_100HZ_PERCENT = 0.5
RATES = (10.0, 100.0, 250.0, 1000.0)
WINDOWS = "10:45,100:8,250:5,1000:4"        # seconds measured per run, by rate (default run)
QUICK_WINDOWS = "10:10,100:3,250:2,1000:2"  # --quick
LEAD_S = 0.75          # window starts this long after a sampler is spawned (its start-up)
SHORT_S = 1            # duration of the short runs (fixed-cost estimate); py-spy takes whole seconds
POLL_S = 0.005         # stopped-state poll period

TARGET_SRC = r'''
import os, sys, threading, time

cpu, depth, n_sleepers, leaf_n = (int(x) for x in sys.argv[1:5])
if cpu >= 0:
    os.sched_setaffinity(0, {cpu})
PARENT = os.getppid()


def leaf(n):
    s = 0
    for i in range(n):
        s += i * i
    return s


def descend(d, n):
    if d == 0:
        return leaf(n)
    return descend(d - 1, n)


def sleeper_wait(ev, k):
    if k:
        return sleeper_wait(ev, k - 1)
    while not ev.wait(1.0):
        pass


def work_loop(out):
    units = 0
    next_report = time.monotonic() + 0.1
    while True:
        for _ in range(16):
            descend(depth, leaf_n)
        units += 16
        now = time.monotonic()
        if now >= next_report:
            out.write(f"{now:.6f} {units} {time.thread_time():.6f}\n")
            out.flush()
            next_report += 0.1
            if next_report < now:
                next_report = now + 0.1
            if os.getppid() != PARENT:   # the bench died without stopping us
                return


def main():
    ev = threading.Event()
    for i in range(n_sleepers):
        threading.Thread(target=sleeper_wait, args=(ev, 4), name=f"sleeper-{i}", daemon=True).start()
    print(f"ready {threading.active_count()} {sys.version.split()[0]}", flush=True)
    work_loop(sys.stdout)


main()
'''


# ==== helpers ================================================================================

from benchutil import Children  # noqa: E402  (bench/ is on sys.path when run as a script)


def _console_script(name: str, module: str) -> list[str]:
    path = os.path.join(os.path.dirname(sys.executable), name)
    return [path] if os.path.exists(path) else [sys.executable, "-m", module]


def _default_python() -> str:
    found = sorted(glob.glob("/root/.pyenv/versions/3.12.*/bin/python3"),
                   key=lambda p: [int(x) for x in re.findall(r"\d+", p.split("/versions/")[1].split("/")[0])])
    return found[-1] if found else sys.executable


def _tail(path: str, n: int = 20) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(fh.readlines()[-n:])
    except OSError:
        return ""


def _med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


class Target:
    """The target process and its progress log: (monotonic s, units done) every 100 ms."""

    def __init__(self, children: Children, python: str, tmp: str, cpu: int, depth: int, sleepers: int,
                 leaf_n: int) -> None:
        src = os.path.join(tmp, "target.py")
        with open(src, "w") as fh:
            fh.write(TARGET_SRC)
        self.log_path = os.path.join(tmp, "target.err")
        self.err = open(self.log_path, "w")
        self.proc = children.start([python, src, str(cpu), str(depth), str(sleepers), str(leaf_n)],
                                   stdout=subprocess.PIPE, stderr=self.err, text=True, bufsize=1)
        self.pid = self.proc.pid
        self.depth = depth
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "ready":
            raise RuntimeError(f"target did not start:\n{_tail(self.log_path)}")
        self.threads, self.version = int(line[1]), line[2]
        self.progress: list[tuple[float, int]] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.tids = sorted(int(t) for t in os.listdir(f"/proc/{self.pid}/task"))

    def _read(self) -> None:
        for line in self.proc.stdout:
            t, u, c = line.split()
            self.progress.append((float(t), int(u), float(c)))

    def throughput(self, a: float, b: float) -> dict | None:
        """Between the first and last reports inside [a, b]: units per wall second, units per CPU second
        of the busy thread, and that thread's share of its core (what other processes left it)."""
        pts = [p for p in list(self.progress) if a <= p[0] <= b]
        if len(pts) < 2 or pts[-1][0] <= pts[0][0] or pts[-1][2] <= pts[0][2]:
            return None
        du, dt, dc = pts[-1][1] - pts[0][1], pts[-1][0] - pts[0][0], pts[-1][2] - pts[0][2]
        return {"wall": du / dt, "cpu": du / dc, "share": dc / dt}

    def alive(self) -> bool:
        return self.proc.poll() is None


class StopPoller:
    """Counts observations of the target's threads in state t/T (stopped), every POLL_S."""

    def __init__(self, pid: int, tids: list[int]) -> None:
        self.fds = []
        for tid in tids:
            try:
                self.fds.append(os.open(f"/proc/{pid}/task/{tid}/stat", os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                pass
        self.polls = self.stopped = 0
        self._run = threading.Event()
        self._quit = False
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while not self._quit:
            if not self._run.wait(0.2):
                continue
            for fd in self.fds:
                try:
                    s = os.pread(fd, 512, 0)
                    state = s[s.rindex(b")") + 2:s.rindex(b")") + 3]
                except (OSError, ValueError):
                    continue
                self.polls += 1
                if state in (b"t", b"T"):
                    self.stopped += 1
            time.sleep(POLL_S)

    def start(self) -> tuple[int, int]:
        self._run.set()
        return self.polls, self.stopped

    def stop(self) -> tuple[int, int]:
        self._run.clear()
        time.sleep(2 * POLL_S)
        return self.polls, self.stopped

    def close(self) -> None:
        self._quit = True
        self._run.set()
        self._t.join(1)
        for fd in self.fds:
            os.close(fd)


_OURS_RE = re.compile(r"(\d+) samples in ([\d.]+)s .*?, (\d+) failed, (\d+) µs CPU per sample"
                      r"(?: \(\+(\d+) µs writing them\))?")
_PYSPY_RE = re.compile(r"Samples: (\d+) Errors: (\d+)")


class Bench:
    def __init__(self, args, tmp: str, children: Children, target: Target) -> None:
        self.args, self.tmp, self.children, self.target = args, tmp, children, target
        self.poller = StopPoller(target.pid, target.tids)
        self.agent = args.agent.split() if args.agent else _console_script("steplens-agent", "steplens.agent.cli")
        cpu = args.sampler_cpu
        self.preexec = (lambda: os.sched_setaffinity(0, {cpu})) if cpu >= 0 else None

    def sampler(self, tool: str, rate: float, duration: int, window: float | None) -> dict:
        """Run one sampler to completion; its CPU (wait4), samples, rate, and the target's throughput."""
        t = self.target
        if tool == "ours":
            out = os.path.join(self.tmp, "ours.txt")
            cmd = self.agent + ["record", str(t.pid), "--idle", "--rate", f"{rate:g}", "--duration", str(duration),
                                "-o", out]
        else:
            out = os.path.join(self.tmp, "pyspy.raw")
            cmd = [self.args.py_spy, "record", "--nonblocking", "--idle", "--rate", f"{rate:g}", "--duration",
                   str(duration), "--pid", str(t.pid), "-o", out, "--format", "raw"]
        err_path = os.path.join(self.tmp, f"{tool}.err")
        p0, s0 = self.poller.start()
        with open(err_path, "w") as err:
            t_spawn = time.monotonic()
            proc = self.children.start(cmd, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=self.preexec)
            _, status, ru = os.wait4(proc.pid, 0)
            t_exit = time.monotonic()
        proc.returncode = os.waitstatus_to_exitcode(status)
        p1, s1 = self.poller.stop()
        with open(err_path, errors="replace") as fh:
            err_text = fh.read()
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{err_text[-2000:]}")
        r = {"tool": tool, "rate": rate, "duration": duration, "cpu_s": ru.ru_utime + ru.ru_stime,
             "polls": p1 - p0, "stopped_obs": s1 - s0, "wall_s": t_exit - t_spawn, "failed": 0, "loop_us": None,
             "inproc_us": None}
        if tool == "ours":
            m = _OURS_RE.search(err_text)
            if not m:
                raise RuntimeError(f"cannot parse steplens-agent record's summary:\n{err_text[-2000:]}")
            r["samples"], r["sampling_s"] = int(m.group(1)), float(m.group(2))
            r["failed"], r["loop_us"] = int(m.group(3)), int(m.group(4))
            if m.group(5) is not None:   # loop + writing the output: everything but start-up, per sample
                r["inproc_us"] = r["loop_us"] + int(m.group(5))
        else:
            m = _PYSPY_RE.search(err_text)
            stacks = int(m.group(1)) if m else self._raw_count(out)
            r["failed"] = int(m.group(2)) if m else 0
            r["samples"] = stacks / t.threads     # --idle: one stack per thread per tick
            r["sampling_s"] = float(duration)
        r["achieved_hz"] = r["samples"] / r["sampling_s"] if r["sampling_s"] else 0.0
        r["startup_s"] = r["wall_s"] - r["sampling_s"]   # start-up + writing the output
        if window is not None:
            r["throughput"] = t.throughput(t_spawn + LEAD_S, t_spawn + LEAD_S + window)
        return r

    @staticmethod
    def _raw_count(path: str) -> int:
        n = 0
        with open(path, errors="replace") as fh:
            for line in fh:
                n += int(line.rsplit(None, 1)[1])
        return n

    def baseline(self, window: float) -> float | None:
        t0 = time.monotonic()
        time.sleep(LEAD_S + window + 0.25)
        return self.target.throughput(t0 + LEAD_S, t0 + LEAD_S + window)


def run(args, tmp: str, children: Children) -> dict:
    target = Target(children, args.python, tmp, args.target_cpu, args.depth, args.sleepers, args.leaf)
    bench = Bench(args, tmp, children, target)
    pinned = (f"target pinned to CPU {args.target_cpu}, samplers and this bench to CPU {args.sampler_cpu}"
              if args.target_cpu >= 0 else "nothing pinned")
    print(f"target: pid {target.pid}, Python {target.version} ({args.python}), {target.threads} threads "
          f"(1 busy, {target.threads - 1} sleeping), ~{args.depth + 4} frames deep; {pinned}", flush=True)
    try:
        print(f"load average before the run: {' '.join(open('/proc/loadavg').read().split()[:3])}", flush=True)
    except OSError:
        pass
    time.sleep(args.warmup)
    D = args.seconds
    win = args.windows
    conds = [(tool, rate) for rate in RATES for tool in ("ours", "py-spy")]
    baselines: list[float | None] = []
    longs: dict[tuple, list[dict]] = {c: [] for c in conds}
    shorts: dict[tuple, list[dict]] = {c: [] for c in conds}
    for rnd in range(args.rounds):
        baselines.append(bench.baseline(D))
        order = conds if rnd % 2 == 0 else conds[::-1]
        for tool, rate in order:
            r = bench.sampler(tool, rate, win[rate] + 1, win[rate])
            r["round"] = rnd
            longs[(tool, rate)].append(r)
        for tool, rate in order:
            shorts[(tool, rate)].append(bench.sampler(tool, rate, SHORT_S, None))
        if not target.alive():
            raise RuntimeError(f"the target exited:\n{_tail(target.log_path)}")
        b = baselines[-1] or {}

        def tp(x):
            return f"{x['wall']:,.0f} ({x['share'] * 100:.0f} %)" if x else "-"
        print(f"round {rnd + 1}/{args.rounds}: units/s (busy thread's share of its core): baseline {tp(b)}; "
              + "; ".join(f"{tool}@{rate:g} {tp(longs[(tool, rate)][-1]['throughput'])}"
                          for tool, rate in conds), flush=True)
    baselines.append(bench.baseline(D))
    maxr = bench.sampler("ours", float(args.max_rate), D + 1, D)
    maxr["round"] = args.rounds - 1

    def slowdown(r: dict, key: str) -> float | None:
        """key "wall": units per second; "cpu": units per CPU second of the busy thread (immune to
        other processes taking the target's core, still sensitive to cache/memory interference)."""
        refs = [x[key] for x in baselines[r["round"]:r["round"] + 2] if x]
        if not refs or not r.get("throughput"):
            return None
        return 100.0 * (1.0 - r["throughput"][key] / (sum(refs) / len(refs)))

    rows = {}
    for c in conds:
        L, S = longs[c], shorts[c]
        marg, fixed = [], []
        for lr, sr in zip(L, S):
            dn = lr["samples"] - sr["samples"]
            if dn > 0:
                m = (lr["cpu_s"] - sr["cpu_s"]) / dn
                marg.append(m * 1e6)
                fixed.append(sr["cpu_s"] - m * sr["samples"])
        row = {
            "achieved_hz": _med([r["achieved_hz"] for r in L]),
            "cpu_us_marginal": _med(marg),
            "cpu_us_whole": _med([r["cpu_s"] / r["samples"] * 1e6 for r in L if r["samples"]]),
            "cpu_us_loop": _med([r["loop_us"] for r in L]),
            "cpu_us_inproc": _med([r["inproc_us"] for r in L]),
            "fixed_cpu_s": _med(fixed),
            "stopped_obs": sum(r["stopped_obs"] for r in L + S), "polls": sum(r["polls"] for r in L + S),
            "failed": sum(r["failed"] for r in L + S), "startup_s": _med([r["startup_s"] for r in L]),
            "cpu_percent": _med([r["cpu_s"] / r["wall_s"] * 100 for r in L]),
            "share": _med([r["throughput"]["share"] * 100 for r in L if r.get("throughput")]),
        }
        for key in ("wall", "cpu"):
            sd = [x for x in (slowdown(r, key) for r in L) if x is not None]
            row[f"slowdown_{key}"] = _med(sd)
            row[f"slowdown_{key}_min"] = min(sd) if sd else None
            row[f"slowdown_{key}_max"] = max(sd) if sd else None
        rows[c] = row
    bl = [b for b in baselines if b]
    return {"target": target, "rows": rows, "max": maxr, "baselines": bl,
            "max_slowdown": {k: slowdown(maxr, k) for k in ("wall", "cpu")}, "pinned": pinned}


def profile(args, target_pid: int, n: int) -> None:
    """cProfile n PythonProcess.sample() calls in this process against the target; top functions."""
    import cProfile
    import pstats

    from steplens.agent.pyframes import reader
    proc = reader.attach(target_pid, thread_states=True)
    try:
        for _ in range(50):
            proc.sample()
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            proc.sample()
        c1, w1 = time.process_time(), time.perf_counter()
        reads0 = proc.mem.reads
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            proc.sample()
        prof.disable()
        reads = proc.mem.reads - reads0
    finally:
        proc.close()
    print(f"\n== profile: {n} PythonProcess.sample() in-process (no profiler: {(c1 - c0) / n * 1e6:.0f} µs CPU, "
          f"{(w1 - w0) / n * 1e6:.0f} µs wall per sample; {reads / n:.1f} pread per sample) ==")
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(18)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", default=_default_python(), help="interpreter of the target (default: pyenv 3.12)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--windows", default=WINDOWS, help=f"seconds measured per run, by rate (default {WINDOWS})")
    p.add_argument("--seconds", type=int, default=5, help="baseline window and our max-rate run, whole seconds "
                   "(default 5)")
    p.add_argument("--quick", action="store_true", help=f"smoke test: 1 round, windows {QUICK_WINDOWS}, 2 s")
    p.add_argument("--agent", default=None, help="command line to run as steplens-agent (default: this venv's; "
                   "for an A/B against another build)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (target, outputs, logs)")
    p.add_argument("--max-rate", type=int, default=5000, help="rate asked of ours for its ceiling (default 5000)")
    p.add_argument("--depth", type=int, default=22, help="recursion depth of the busy thread (default 22)")
    p.add_argument("--sleepers", type=int, default=3, help="sleeping threads in the target (default 3)")
    p.add_argument("--leaf", type=int, default=200, help="loop iterations per work unit (default 200)")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds the target runs before the first round")
    p.add_argument("--target-cpu", type=int, default=0, help="CPU the target is pinned to (-1: no pinning)")
    p.add_argument("--sampler-cpu", type=int, default=1, help="CPU of the samplers and the bench (-1: none)")
    p.add_argument("--py-spy", default=shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable),
                   "py-spy"), help="py-spy executable")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="afterwards, cProfile N in-process PythonProcess.sample() against the target")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.windows = 1, 2, QUICK_WINDOWS
    try:
        args.windows = {float(r): int(w) for r, w in (x.split(":") for x in args.windows.split(","))}
    except ValueError:
        p.error(f"--windows: RATE:SECONDS,... (got {args.windows!r})")
    if set(args.windows) != set(RATES) or min(args.windows.values()) < 2:
        p.error(f"--windows needs every rate of {RATES} with >= 2 s")
    if args.rounds < 1 or args.seconds < 1:
        p.error("--rounds and --seconds must be >= 1")
    if (os.cpu_count() or 1) < 2 or args.target_cpu < 0 or args.sampler_cpu < 0:
        args.target_cpu = args.sampler_cpu = -1
    if not os.path.exists(args.py_spy):
        p.error(f"py-spy not found at {args.py_spy} (pip install py-spy, or --py-spy)")
    if args.sampler_cpu >= 0:
        os.sched_setaffinity(0, {args.sampler_cpu})

    tmp = tempfile.mkdtemp(prefix="steplens-pystacks-")
    children = Children()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        res = run(args, tmp, children)
        t, rows, mx = res["target"], res["rows"], res["max"]
        bw = [b["wall"] for b in res["baselines"]]
        bc = [b["cpu"] for b in res["baselines"]]
        bs = [b["share"] * 100 for b in res["baselines"]]

        def spread(v):
            return 100.0 * (max(v) - min(v)) / statistics.median(v) if v else 0.0
        py_spy_version = subprocess.run([args.py_spy, "--version"], capture_output=True, text=True).stdout.strip()
        print()
        wins = ", ".join(f"{w} s at {r:g} Hz" for r, w in args.windows.items())
        print(f"== pystacks: Python {t.version} target, {t.threads} threads, ~{args.depth + 4} frames on the busy "
              f"thread; {args.rounds} rounds, windows {wins}; {os.cpu_count()} CPUs; {res['pinned']} ==")
        print(f"ours = steplens-agent record --idle (default mode: no ptrace); py-spy = {py_spy_version} "
              f"record --nonblocking --idle --format raw")
        print(f"baselines ({len(bw)}): {statistics.median(bw):,.0f} units/s (max-min spread {spread(bw):.1f} %), "
              f"{statistics.median(bc):,.0f} units per CPU s (spread {spread(bc):.1f} %); the busy thread got "
              f"{min(bs):.0f}-{max(bs):.0f} % of its core (the rest went to other processes)")
        print("slowdown: 'wall' = drop in units/s; 'cpu' = drop in units per CPU second of the busy thread "
              "(cache/memory interference and stops only, not CPU taken by other processes)")
        print()
        print(f"{'tool':<7}{'rate':>6}{'achieved':>9}{'CPU µs/sample':>14}{'whole':>7}{'in-':>6}{'in-':>6}"
              f"{'CPU':>6}{'target':>7}{'slowdown % wall':>24}{'slowdown % cpu':>24}{'stopped':>12}")
        print(f"{'':<7}{'Hz':>6}{'Hz':>9}{'(marginal)':>14}{'cmd':>7}{'loop':>6}{'proc':>6}{'%':>6}{'core %':>7}"
              f"{'median [min..max]':>24}{'median [min..max]':>24}{'obs/polls':>12}")

        def sd(r, key):
            return (f"{_fmt(r[f'slowdown_{key}'], '+.2f')} [{_fmt(r[f'slowdown_{key}_min'], '+.2f')}.."
                    f"{_fmt(r[f'slowdown_{key}_max'], '+.2f')}]")
        for (tool, rate), r in rows.items():
            print(f"{tool:<7}{rate:>6.0f}{r['achieved_hz']:>9.0f}{_fmt(r['cpu_us_marginal'], '.0f'):>14}"
                  f"{_fmt(r['cpu_us_whole'], '.0f'):>7}{_fmt(r['cpu_us_loop'], '.0f'):>6}"
                  f"{_fmt(r['cpu_us_inproc'], '.0f'):>6}"
                  f"{_fmt(r['cpu_percent'], '.1f'):>6}{_fmt(r['share'], '.0f'):>7}{sd(r, 'wall'):>24}"
                  f"{sd(r, 'cpu'):>24}{str(r['stopped_obs']) + '/' + str(r['polls']):>12}")
        ms = res["max_slowdown"]
        share = mx["throughput"]["share"] * 100 if mx.get("throughput") else None
        print(f"{'ours':<7}{args.max_rate:>6}{mx['achieved_hz']:>9.0f}{'':>14}"
              f"{mx['cpu_s'] / max(mx['samples'], 1) * 1e6:>7.0f}{_fmt(mx['loop_us'], '.0f'):>6}"
              f"{_fmt(mx['inproc_us'], '.0f'):>6}"
              f"{mx['cpu_s'] / mx['wall_s'] * 100:>6.1f}{_fmt(share, '.0f'):>7}"
              f"{_fmt(ms['wall'], '+.2f') + ' (1 run)':>24}{_fmt(ms['cpu'], '+.2f') + ' (1 run)':>24}"
              f"{str(mx['stopped_obs']) + '/' + str(mx['polls']):>12}")

        def ratio(a, b):
            return a / b if a is not None and b else None

        def hz(rate):
            return f"{rate / 1000:g} kHz" if rate >= 1000 else f"{rate:g} Hz"
        ours = {rate: rows[("ours", rate)] for rate in RATES}
        spy = {rate: rows[("py-spy", rate)] for rate in RATES}
        ratios = {rate: ratio(ours[rate]["cpu_us_marginal"], spy[rate]["cpu_us_marginal"]) for rate in RATES}
        ratios_inproc = {rate: ratio(ours[rate]["cpu_us_inproc"], spy[rate]["cpu_us_marginal"]) for rate in RATES}
        print()
        print("CPU per sample ours/py-spy   " + ", ".join(f"{_fmt(ratios[r], '.2f')} at {hz(r)}" for r in RATES)
              + f" (goal <= {GOAL_CPU_RATIO} at each)")
        print("  ours in-process/py-spy     " + ", ".join(f"{_fmt(ratios_inproc[r], '.2f')}" for r in RATES)
              + " (ours: loop + writing the output, no start-up: the steadier figure)")
        print("  whole command              " + ", ".join(
            f"{_fmt(ratio(ours[r]['cpu_us_whole'], spy[r]['cpu_us_whole']), '.2f')}" for r in RATES))
        print(f"fixed CPU per command        ours {_fmt(_med([ours[r]['fixed_cpu_s'] for r in RATES]), '.3f')} s, "
              f"py-spy {_fmt(_med([spy[r]['fixed_cpu_s'] for r in RATES]), '.3f')} s (start-up, attach, output; "
              f"not in the marginal figure)")
        print(f"ours max rate                {mx['achieved_hz']:.0f} Hz, asked {args.max_rate} (goal >= "
              f"{GOAL_MAX_RATE_HZ}); {mx['failed']} failed samples")
        o100, p100 = ours[100.0], spy[100.0]
        print(f"target slowdown at 100 Hz    ours {_fmt(o100['slowdown_wall'], '+.2f')} % wall, "
              f"{_fmt(o100['slowdown_cpu'], '+.2f')} % cpu; py-spy {_fmt(p100['slowdown_wall'], '+.2f')} % wall, "
              f"{_fmt(p100['slowdown_cpu'], '+.2f')} % cpu (goal < {GOAL_SLOWDOWN_100HZ_PERCENT} %; baseline spread "
              f"{spread(bw):.1f} % wall, {spread(bc):.1f} % cpu)")
        stopped_ours = sum(ours[r]["stopped_obs"] for r in RATES) + mx["stopped_obs"]
        polls_ours = sum(ours[r]["polls"] for r in RATES) + mx["polls"]
        print(f"stopped, default mode        0 ns by construction (no ptrace); {stopped_ours} of {polls_ours} "
              f"thread-state polls during our runs saw t/T (py-spy --nonblocking: "
              f"{sum(spy[r]['stopped_obs'] for r in RATES)} of {sum(spy[r]['polls'] for r in RATES)}); failed "
              f"samples: ours {sum(ours[r]['failed'] for r in RATES)}, py-spy errors "
              f"{sum(spy[r]['failed'] for r in RATES)}")
        if args.keep:
            print(f"kept {tmp}")
        if args.profile:
            profile(args, t.pid, args.profile)

        def rnd(v, n=1):
            return None if v is None else round(v, n)
        headline = {}
        for r in RATES:
            k = f"{r / 1000:g}khz" if r >= 1000 else f"{r:g}hz"
            headline.update({
                f"ratio_cpu_per_sample_{k}": rnd(ratios[r], 3),
                f"ratio_cpu_per_sample_inproc_{k}": rnd(ratios_inproc[r], 3),
                f"ours_cpu_us_per_sample_{k}": rnd(ours[r]["cpu_us_marginal"]),
                f"ours_cpu_us_per_sample_inproc_{k}": rnd(ours[r]["cpu_us_inproc"]),
                f"pyspy_cpu_us_per_sample_{k}": rnd(spy[r]["cpu_us_marginal"]),
                f"ours_achieved_hz_{k}": rnd(ours[r]["achieved_hz"]),
                f"pyspy_achieved_hz_{k}": rnd(spy[r]["achieved_hz"]),
                f"slowdown_ours_{k}_percent": rnd(ours[r]["slowdown_wall"], 3),
                f"slowdown_pyspy_{k}_percent": rnd(spy[r]["slowdown_wall"], 3),
                f"slowdown_cpu_ours_{k}_percent": rnd(ours[r]["slowdown_cpu"], 3),
                f"slowdown_cpu_pyspy_{k}_percent": rnd(spy[r]["slowdown_cpu"], 3),
            })
        headline.update({
            "ours_max_rate_hz": rnd(mx["achieved_hz"]),
            "ours_fixed_cpu_s": rnd(_med([ours[r]["fixed_cpu_s"] for r in RATES]), 3),
            "pyspy_fixed_cpu_s": rnd(_med([spy[r]["fixed_cpu_s"] for r in RATES]), 3),
            "baseline_spread_wall_percent": rnd(spread(bw), 2), "baseline_spread_cpu_percent": rnd(spread(bc), 2),
            "target_core_share_min_percent": rnd(min(bs), 1),
            "stopped_observations_default_mode": stopped_ours, "stopped_polls_default_mode": polls_ours,
            "stopped_ns_default_mode": 0,
            "python": ".".join(t.version.split(".")[:2]), "target_threads": t.threads,
            "rounds": args.rounds, "window_seconds_by_rate": {f"{r:g}": w for r, w in args.windows.items()},
            "pinned": args.target_cpu >= 0,
            "goal_cpu_ratio": GOAL_CPU_RATIO, "goal_max_rate_hz": GOAL_MAX_RATE_HZ,
            "goal_slowdown_100hz_percent": GOAL_SLOWDOWN_100HZ_PERCENT,
        })
        print(json.dumps(headline), flush=True)
        return 0
    except RuntimeError as exc:
        print(f"bench/pystacks.py: {exc}", file=sys.stderr)
        return 1
    finally:
        children.stop_all()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
