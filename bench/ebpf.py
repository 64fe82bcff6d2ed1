"""Cost of the netflows eBPF probes: loopback TCP throughput with and without them, packets the
programs handled per second, and the agent's user-space CPU per Gbit/s of traffic.

Both ends of every transfer (a Python sender and receiver, 1 MiB sends) run on one core (--pin, by default
the last CPU), the bench and the agent on the others. The transfer is then CPU-bound on that core, where the
TX and the RX program both run, so every ns they add is throughput lost, and its rate moves far less
between segments than with the two ends on two cores (adjacent 0.25-1 s segments differ by sd 1.5-8 %,
median 4 %, pinned, against 10-17 % unpinned, in A/A runs here). It is not the costliest set-up: with the
ends on two cores there are more ACKs and recv() calls per Gbit (--pin none; both are in bench/README.md).

Runs (root):
1. --toggle-runs transfers of --toggle-seconds, during each of which the agent detaches and re-attaches the
   programs every --segment seconds (NetflowsSource.pause/resume), ABBA; a transfer's slowdown is the mean
   over its adjacent on/off pairs of segments. This is the headline, as the mean over the transfers with the
   standard error across them: adjacent segments share the machine's state, so the VM's drifts cancel, but
   each transfer keeps an offset of its own (up to 3.3 % between transfers here, several times the
   within-transfer s.e.).
2. Interleaved pairs (ABBA order) of ~3 s separate transfers, once without probes and once with a netflows
   source loaded in a separate agent process that calls step() every 1 s (include_loopback = true, so lo
   traffic is what it counts): medians of throughput and of the transfer core's busy CPU time per byte
   (/proc/stat), and the agent's CPU. Separate transfers differ by up to 30 % here (a fresh connection
   settles at ~20 or at ~30 Gbit/s), so these medians say little about a 2 % effect.
3. One more loaded transfer with the kernel's BPF statistics on gives the time per program run and the
   runs per Gbit (robust: measured by the kernel per run, but it leaves out the tracepoint dispatch
   around each run and includes the statistics' own clock reads).
4. The dispatch itself: a C loop of recv() calls firing sock_recv_length, with an empty BTF program attached
   and detached in ABBA segments (ns per call, +-1 ns here), and the empty program's run time under the
   statistics. With 3, the in-kernel cost per Gbit = runs x (body + dispatch), and against the core's CPU
   per Gbit without probes, an estimated slowdown that does not depend on the throughput noise (cache
   effects on the workload are not in it).
The last stdout line is one JSON object.

On loopback both ends of every packet are on this host: the TX and the RX program both run for each packet;
between two hosts each host runs one of them per packet.

    .venv/bin/python bench/ebpf.py                      # 3 toggle transfers of 60 s, 5 pairs of 3 s (~5 min)
    .venv/bin/python bench/ebpf.py --toggle-runs 6      # the run quoted in bench/README.md
    .venv/bin/python bench/ebpf.py --pairs 3 --seconds 2 --toggle-seconds 20 --toggle-runs 2 --pin none
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RECEIVER = textwrap.dedent("""
    import socket, sys
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
    print(srv.getsockname()[1], flush=True)
    c, _ = srv.accept(); n = 0; buf = bytearray(1 << 20)
    while True:
        k = c.recv_into(buf)
        if not k: break
        n += k
    print(n, flush=True)
""")

SENDER = textwrap.dedent("""
    import socket, sys, time
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    msg = b"x" * (1 << 20); n = 0
    t0 = time.monotonic(); end = t0 + float(sys.argv[2])
    while time.monotonic() < end:
        s.sendall(msg); n += len(msg)
    s.shutdown(socket.SHUT_WR)
    print(n, time.monotonic() - t0, flush=True)
""")

AGENT = textwrap.dedent("""
    import json, resource, sys, time
    from steplens.agent.sources.base import HostContext
    from steplens.agent.sources.netflows import NetflowsConfig, NetflowsSource
    s = NetflowsSource(HostContext(node_id="bench"), NetflowsConfig(include_loopback=True))
    s.start()
    s.step()
    r0 = resource.getrusage(resource.RUSAGE_SELF); p0 = s.packets_total; t0 = time.monotonic()
    print("ready", flush=True)
    records = 0
    try:
        while True:
            line = sys.stdin.readline()
            if not line or line.strip() == "stop":
                break
            if line.strip() in ("pause", "resume"):  # toggle measurement: detach / re-attach the programs
                getattr(s, line.strip())()
                print("ok", flush=True)
                continue
            time.sleep(1.0)  # the `step` command: one step after 1 s, like the runner at interval 1 s
            records += len(s.step())
            print("stepped", flush=True)
    finally:
        records += len(s.step())
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        print(json.dumps({"cpu_s": cpu, "packets": s.packets_total - p0, "seconds": time.monotonic() - t0,
                          "records": records}), flush=True)
        s.stop()
""")


# The CPU both ends of every transfer run on (main() sets it; None: not pinned). Sharing one core makes the
# transfer CPU-bound there, so every ns the programs add (both run on it) is throughput lost, and the rate moves
# far less between segments than with the two ends on two cores (pair sd median 4 % vs 10-17 % here, A/A runs).
# The bench itself and the agent run on the other cores.
PIN: list = [None]


def _pin() -> None:
    if PIN[0] is not None:
        os.sched_setaffinity(0, {PIN[0]})


def busy_seconds() -> float:
    """CPU time spent so far by the transfer's core (the whole machine when not pinned), every state but idle,
    iowait and steal (/proc/stat)."""
    want = "cpu" if PIN[0] is None else f"cpu{PIN[0]}"
    with open("/proc/stat") as fh:
        line = next(ln for ln in fh if ln.split()[0] == want)
    f = [int(x) for x in line.split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = f[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


LAST_BUSY: list = []  # CPU seconds of each transfer() (the transfer core, see busy_seconds), in call order


def transfer(seconds: float) -> tuple[float, int, float]:
    """(Gbit/s, bytes, seconds) of one loopback transfer between two fresh processes; the busy CPU
    seconds over the sender's run go to LAST_BUSY."""
    rx = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True, preexec_fn=_pin)
    port = rx.stdout.readline().strip()
    b0 = busy_seconds()
    tx = subprocess.run([sys.executable, "-c", SENDER, port, str(seconds)], capture_output=True, text=True,
                        check=True, preexec_fn=_pin)
    got = int(rx.communicate(timeout=30)[0].strip())
    LAST_BUSY.append(busy_seconds() - b0)
    sent, dur = tx.stdout.split()
    assert got == int(sent), (got, sent)
    return got * 8 / float(dur) / 1e9, got, float(dur)


def cpu_ns_per_byte(nbytes: int) -> float:
    return LAST_BUSY[-1] * 1e9 / nbytes


def _prog_stats(prefix: str = "steplens_nf") -> dict[str, tuple[int, int]]:
    out = subprocess.run(["bpftool", "prog", "show", "-j"], capture_output=True, text=True, check=True).stdout
    return {p["name"]: (p.get("run_time_ns", 0), p.get("run_cnt", 0)) for p in json.loads(out)
            if p.get("name", "").startswith(prefix)}


def bpf_cost(seconds: float, env: dict) -> tuple[dict, dict, float, float]:
    """ns per run of each program over one loaded transfer, from the kernel's BPF run-time statistics
    (kernel.bpf_stats_enabled, switched on only for this run: it adds two clock reads per run)."""
    agent = subprocess.Popen([sys.executable, "-c", AGENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=REPO, env=env)
    path = "/proc/sys/kernel/bpf_stats_enabled"
    with open(path) as fh:
        was = fh.read().strip()
    try:
        assert agent.stdout.readline().strip() == "ready"
        with open(path, "w") as fh:
            fh.write("1")
        s0 = _prog_stats()
        _, nbytes, _ = transfer(seconds)
        s1 = _prog_stats()
    finally:
        with open(path, "w") as fh:
            fh.write(was)
        agent.stdin.write("stop\n"); agent.stdin.flush()
        agent.communicate(timeout=60)
    out, per_gbit, total_ns, runs = {}, {}, 0, 0
    gbit = nbytes * 8 / 1e9
    for name, (t1, c1) in s1.items():
        t0, c0 = s0.get(name, (0, 0))
        total_ns += t1 - t0
        runs += c1 - c0
        if c1 > c0:
            out[name.removeprefix("steplens_nf_")] = round((t1 - t0) / (c1 - c0), 1)
            per_gbit[name.removeprefix("steplens_nf_")] = round((c1 - c0) / gbit, 1)
    # ns per run and runs per Gbit of each program; ms of BPF time and program runs per Gbit
    return out, per_gbit, total_ns / 1e6 / gbit, runs / gbit


LOOP_C = r"""
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
/* recv() on an empty non-blocking AF_UNIX socket: one pass through sock_recvmsg, which fires the
   sock:sock_recv_length tracepoint (ret = -EAGAIN). One line of ns per call per segment. */
int main(int argc, char **argv) {
    int sv[2]; char b; char line[16]; long calls = 200000;
    if (socketpair(AF_UNIX, SOCK_DGRAM, 0, sv)) return 1;
    while (fgets(line, sizeof(line), stdin)) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (long i = 0; i < calls; i++) recv(sv[0], &b, 1, MSG_DONTWAIT);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        printf("%.3f\n", ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / calls);
        fflush(stdout);
    }
    return 0;
}
"""

EMPTY_PROG = "int steplens_nf_em(u64 *ctx) { return 0; }\n"


def dispatch_cost(segments: int = 60) -> dict:
    """What a BTF raw-tracepoint program costs around its body, measured without throughput noise: a C loop of
    recv() calls that each fire sock_recv_length, in ~50 ms segments, with an empty program attached and
    detached in ABBA order (dispatch = the difference per call); and that empty program's run time under the
    kernel's statistics (the statistics' own cost per run, which the ns-per-run figures include). Needs a C
    compiler; {} without one."""
    import shutil
    import tempfile

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return {}
    sys.path.insert(0, REPO)
    from steplens.agent import ebpf

    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "loop.c"), os.path.join(tmp, "loop")
        with open(src, "w") as fh:
            fh.write(LOOP_C)
        subprocess.run([cc, "-O2", "-o", exe, src], check=True, capture_output=True)
        b = ebpf.compile_program(EMPTY_PROG)
        link = ebpf.BtfRawTracepoint(b, "steplens_nf_em", "sock_recv_length", "steplens_nf_em")
        loop = subprocess.Popen([exe], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=_pin)
        on_off: dict = {True: [], False: []}
        diffs = []
        try:
            def segment(attached: bool) -> float:
                link.attach() if attached else link.detach()
                loop.stdin.write("go\n")
                loop.stdin.flush()
                return float(loop.stdout.readline())
            segment(False)  # warm-up
            for i in range(segments // 2):
                order = (True, False) if i % 2 == 0 else (False, True)
                got = {a: segment(a) for a in order}
                on_off[True].append(got[True])
                on_off[False].append(got[False])
                diffs.append(got[True] - got[False])
            path = "/proc/sys/kernel/bpf_stats_enabled"
            with open(path) as fh:
                was = fh.read().strip()
            link.attach()
            s0 = _prog_stats("steplens_nf_em")
            with open(path, "w") as fh:
                fh.write("1")
            try:
                segment(True)
            finally:
                with open(path, "w") as fh:
                    fh.write(was)
            s1 = _prog_stats("steplens_nf_em")
        finally:
            loop.stdin.close()
            loop.wait(timeout=10)
            link.close()
            ebpf.cleanup(b)
    (t0, c0), (t1, c1) = s0.get("steplens_nf_em", (0, 0)), s1["steplens_nf_em"]
    return {"dispatch_ns": statistics.mean(diffs),
            "dispatch_sem_ns": statistics.stdev(diffs) / len(diffs) ** 0.5,
            "call_ns_without": statistics.median(on_off[False]),
            "stats_overhead_ns": (t1 - t0) / max(1, c1 - c0)}


def lo_bytes() -> int:
    with open("/sys/class/net/lo/statistics/tx_bytes") as fh:
        return int(fh.read())


def toggle_cost(seconds: float, segment: float, env: dict) -> dict:
    """The probes' cost inside one long transfer: the programs are detached and re-attached every `segment`
    seconds (ABBA order) and each segment's rate is read from lo's byte counter. Adjacent segments share the
    machine's state, so the VM's slow drifts cancel in the pair ratios (separate transfers differ by up to 30 %
    here from run to run)."""
    agent = subprocess.Popen([sys.executable, "-c", AGENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=REPO, env=env)
    rates = {True: [], False: []}
    pairs = []
    try:
        assert agent.stdout.readline().strip() == "ready"
        rx = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True, preexec_fn=_pin)
        port = rx.stdout.readline().strip()
        tx = subprocess.Popen([sys.executable, "-c", SENDER, port, str(seconds)], stdout=subprocess.PIPE, text=True,
                              preexec_fn=_pin)
        time.sleep(0.5)  # past connection set-up and slow start
        on = True
        order = [True, False, False, True]
        i = 0
        end = time.monotonic() + seconds - 1.0
        seg_rates = []
        while time.monotonic() < end:
            want = order[i % 4]
            if want != on:
                agent.stdin.write("resume\n" if want else "pause\n")
                agent.stdin.flush()
                assert agent.stdout.readline().strip() == "ok"
                on = want
            time.sleep(0.05)  # let the switch settle
            b0, t0 = lo_bytes(), time.monotonic()
            time.sleep(segment)
            b1, t1 = lo_bytes(), time.monotonic()
            r = (b1 - b0) * 8 / (t1 - t0) / 1e9
            rates[on].append(r)
            seg_rates.append((on, r))
            i += 1
        tx.wait(timeout=seconds + 30)
        rx.communicate(timeout=30)
    finally:
        agent.stdin.write("stop\n")
        agent.stdin.flush()
        agent.communicate(timeout=60)
    # pairs of adjacent segments, one with and one without: relative slowdown of each
    for (a_on, a), (b_on, b) in zip(seg_rates[0::2], seg_rates[1::2]):
        if a_on != b_on:
            with_, without = (a, b) if a_on else (b, a)
            pairs.append(100.0 * (without - with_) / without)
    mean = statistics.mean(pairs)
    sem = statistics.stdev(pairs) / len(pairs) ** 0.5 if len(pairs) > 1 else float("nan")
    return {"pairs": len(pairs), "slowdown_percent": mean, "sem_percent": sem,
            "median_percent": statistics.median(pairs),
            "gbit_s_with": statistics.median(rates[True]), "gbit_s_without": statistics.median(rates[False])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--toggle-seconds", type=float, default=60.0, help="length of each on/off toggle transfer")
    ap.add_argument("--toggle-runs", type=int, default=3, help="toggle transfers (the s.e. is across them)")
    ap.add_argument("--segment", type=float, default=0.25, help="toggle segment length, seconds")
    ap.add_argument("--pin", default="auto",
                    help="CPU both transfer ends run on ('auto': the last CPU when there are two or more; 'none')")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (eBPF)", file=sys.stderr)
        return 2
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin == "auto":
        PIN[0] = cpus[-1] if len(cpus) >= 2 else None
    elif args.pin != "none":
        PIN[0] = int(args.pin)
    if PIN[0] is not None and len(cpus) >= 2:
        os.sched_setaffinity(0, set(cpus) - {PIN[0]})  # the bench and the agents it starts: off that core
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    without, with_, with_bytes, with_secs = [], [], 0, 0.0
    cpb_without, cpb_with = [], []  # busy CPU ns per byte moved (busy_seconds)
    cpu_s = packets = 0.0
    agent_secs = 0.0
    for i in range(args.pairs):
        if i % 2 == 0:  # ABBA order, so a drift in machine load does not favour one side
            g, nbytes, _ = transfer(args.seconds)
            without.append(g)
            cpb_without.append(cpu_ns_per_byte(nbytes))
        agent = subprocess.Popen([sys.executable, "-c", AGENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, cwd=REPO, env=env)
        try:
            assert agent.stdout.readline().strip() == "ready"
            steps = max(1, int(args.seconds))
            agent.stdin.write("step\n" * steps); agent.stdin.flush()  # steps at 1 s during the transfer
            g, nbytes, dur = transfer(args.seconds)
            with_.append(g)
            cpb_with.append(cpu_ns_per_byte(nbytes))
            with_bytes += nbytes
            with_secs += dur
        finally:
            agent.stdin.write("stop\n"); agent.stdin.flush()
            out = agent.communicate(timeout=60)[0].strip().splitlines()
        if i % 2 == 1:
            g, nbytes, _ = transfer(args.seconds)
            without.append(g)
            cpb_without.append(cpu_ns_per_byte(nbytes))
        stats = json.loads(out[-1])
        cpu_s += stats["cpu_s"]
        packets += stats["packets"]
        agent_secs += stats["seconds"]
        print(f"pair {i + 1}: without {without[-1]:6.2f} Gbit/s   with {with_[-1]:6.2f} Gbit/s   "
              f"CPU/byte {cpb_without[-1]:.4f} / {cpb_with[-1]:.4f} ns   "
              f"agent {stats['cpu_s'] * 1000:.1f} ms CPU, {stats['packets']} packets, {stats['records']} records",
              flush=True)
    # The toggle, in --toggle-runs separate transfers: each transfer's mean has its own offset (up to 3.3 %
    # apart pinned here, several within-run s.e.), so the headline is the mean over the transfers with the
    # s.e. across them.
    togs = []
    for r in range(args.toggle_runs):
        togs.append(toggle_cost(args.toggle_seconds, args.segment, env))
        t = togs[-1]
        print(f"toggle run {r + 1}: {t['slowdown_percent']:.2f} % +- {t['sem_percent']:.2f} over {t['pairs']} pairs "
              f"({t['gbit_s_without']:.2f} Gbit/s off, {t['gbit_s_with']:.2f} on)", flush=True)
    run_means = [t["slowdown_percent"] for t in togs]
    tog = {"slowdown_percent": statistics.mean(run_means),
           "sem_percent": (statistics.stdev(run_means) / len(run_means) ** 0.5 if len(run_means) > 1
                           else togs[0]["sem_percent"]),
           "pairs": sum(t["pairs"] for t in togs),
           "median_percent": statistics.median(run_means),
           "gbit_s_without": statistics.median(t["gbit_s_without"] for t in togs),
           "gbit_s_with": statistics.median(t["gbit_s_with"] for t in togs)}
    cost, runs_each, bpf_ms_per_gbit, runs_per_gbit = bpf_cost(args.seconds, env)
    dispatch = dispatch_cost()
    med_without, med_with = statistics.median(without), statistics.median(with_)
    slowdown = 100.0 * (med_without - med_with) / med_without
    cpb0, cpb1 = statistics.median(cpb_without), statistics.median(cpb_with)
    # pairwise: each "with" run against the "without" run next to it (ABBA keeps them adjacent)
    per_pair = [100.0 * (a - b) / a for a, b in zip(without, with_)]
    pair_mean = statistics.mean(per_pair)
    pair_sem = statistics.stdev(per_pair) / len(per_pair) ** 0.5 if len(per_pair) > 1 else float("nan")
    cpu_cost = 100.0 * (cpb1 - cpb0) / cpb0
    gbit = with_bytes * 8 / 1e9
    result = {
        "throughput_gbit_s_without": round(med_without, 3),
        "throughput_gbit_s_with": round(med_with, 3),
        # the headline: the toggle (per transfer, the mean over adjacent on/off segment pairs; then the mean
        # over the transfers +- the s.e. across them)
        "slowdown_percent": round(tog["slowdown_percent"], 2),
        "slowdown_sem_percent": round(tog["sem_percent"], 2),
        "slowdown_median_percent": round(tog["median_percent"], 2),
        "slowdown_runs_percent": [round(x, 2) for x in run_means],
        "slowdown_runs_sem_percent": [round(t["sem_percent"], 2) for t in togs],
        "toggle_pairs": tog["pairs"],
        "toggle_segment_s": args.segment,
        "toggle_gbit_s_without": round(tog["gbit_s_without"], 3),
        "toggle_gbit_s_with": round(tog["gbit_s_with"], 3),
        "pinned_cpu": PIN[0],
        # separate transfers (see the docstring: too noisy here for a 2 % effect)
        "separate_runs_slowdown_percent": round(slowdown, 2),
        "separate_runs_pair_mean_percent": round(pair_mean, 2),
        "separate_runs_pair_sem_percent": round(pair_sem, 2),
        "cpu_ns_per_byte_without": round(cpb0, 5),
        "cpu_ns_per_byte_with": round(cpb1, 5),
        "cpu_per_byte_increase_percent": round(cpu_cost, 2),
        "events_per_s": round(packets / with_secs, 1),
        "agent_cpu_s_per_gbit": round(cpu_s / gbit, 6),
        "agent_cpu_percent": round(100.0 * cpu_s / agent_secs, 3),
        "pairs": args.pairs,
        "seconds_per_run": args.seconds,
        "goal_slowdown_percent": 2,
        "bpf_ns_per_run": cost,
        "bpf_cpu_ms_per_gbit": round(bpf_ms_per_gbit, 3),
        # the programs' run time against the CPU the transfer costs without them: an estimate of the slowdown
        # at saturation from two figures far less noisy here than throughput. It leaves out the tracepoint
        # dispatch and cache effects, and it includes the statistics' own clock reads (an empty program
        # shows ~75 ns per run here), so it is an estimate, not a bound
        "bpf_share_of_transfer_cpu_percent": round(100.0 * bpf_ms_per_gbit / (cpb0 * 125.0), 2),
        "bpf_runs_per_gbit": round(runs_per_gbit, 1),
        "bpf_runs_per_gbit_each": runs_each,
    }
    if dispatch:
        # in-kernel cost per Gbit = runs x (body + dispatch); the ns-per-run figures are body + the statistics'
        # own cost, so swap that for the measured dispatch
        est_ms = bpf_ms_per_gbit + runs_per_gbit * (dispatch["dispatch_ns"] - dispatch["stats_overhead_ns"]) / 1e6
        result.update({
            "dispatch_ns_per_run": round(dispatch["dispatch_ns"], 1),
            "dispatch_sem_ns": round(dispatch["dispatch_sem_ns"], 1),
            "stats_overhead_ns_per_run": round(dispatch["stats_overhead_ns"], 1),
            "in_kernel_cost_ms_per_gbit": round(est_ms, 3),
            "estimated_slowdown_percent": round(100.0 * est_ms / (cpb0 * 125.0), 2),
        })
    where = f"both ends on CPU {PIN[0]}" if PIN[0] is not None else "not pinned"
    print(f"slowdown (toggled)         {tog['slowdown_percent']:.2f} % +- {tog['sem_percent']:.2f} (goal < 2; mean +- "
          f"s.e. over {len(togs)} transfers of {args.toggle_seconds:.0f} s, each the mean of its adjacent on/off "
          f"pairs of {args.segment} s ({tog['pairs']} in all), {where}): {tog['gbit_s_without']:.2f} Gbit/s off, "
          f"{tog['gbit_s_with']:.2f} on")
    print(f"separate runs              {med_without:8.2f} Gbit/s without, {med_with:.2f} with (medians of "
          f"{args.pairs}): {slowdown:.2f} %; per adjacent pair {pair_mean:.2f} % +- {pair_sem:.2f}")
    print(f"core CPU per byte          {cpb0:.4f} ns without, {cpb1:.4f} ns with probes: {cpu_cost:+.2f} % "
          f"(separate runs)")
    print(f"packets handled            {result['events_per_s']:,.0f} /s while loaded")
    print(f"agent CPU                  {result['agent_cpu_s_per_gbit'] * 1000:.3f} ms per Gbit transferred "
          f"({result['agent_cpu_percent']:.3f} % of one core)")
    print("BPF time per program run   " + ", ".join(f"{k} {v:.0f} ns" for k, v in cost.items())
          + " (separate run with kernel.bpf_stats_enabled)")
    print("program runs per Gbit      " + ", ".join(f"{k} {v:,.0f}" for k, v in runs_each.items()))
    print(f"BPF CPU                    {bpf_ms_per_gbit:.2f} ms per Gbit counted (both ends of each packet here; "
          f"{bpf_ms_per_gbit:.2f} ms/Gbit = {bpf_ms_per_gbit:.1f} % of a core per 10 Gbit/s)")
    print(f"BPF share of transfer CPU  {result['bpf_share_of_transfer_cpu_percent']:.2f} % (the programs' run time "
          f"against the CPU per byte without them: an estimate of the slowdown, see the code)")
    if dispatch:
        print(f"dispatch per program run   {dispatch['dispatch_ns']:.1f} ns +- {dispatch['dispatch_sem_ns']:.1f} "
              f"(empty program toggled under a C recv() loop; the statistics themselves cost "
              f"{dispatch['stats_overhead_ns']:.1f} ns per run)")
        print(f"estimated slowdown         {result['estimated_slowdown_percent']:.2f} % = runs x (body + dispatch) "
              f"= {result['in_kernel_cost_ms_per_gbit']:.2f} ms per Gbit against {cpb0 * 125:.1f} ms of CPU per Gbit "
              f"without probes (cache effects not included)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
